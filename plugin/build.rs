//! Compiles the CUDA device code (cuda/) into fatbins embedded in the plugin:
//! - `ncclscope_hook.fatbin`: the hook, its reference variants and the calibration kernel;
//! - `ncclscope_harness.fatbin`: the NCCL-shaped harness kernels (GPU tests and benchmark only).
//!
//! Each is relocatable code (`-rdc`), compiled per architecture (sm_80, sm_90, sm_100, sm_120) and
//! device-linked with nvlink, so function-pointer globals hold real addresses; plus compute_120 PTX. The
//! hook is capped at `HOOK_MAX_REGS` registers and the build CHECKS the cap (EIATTR_REGCOUNT in each
//! cubin's .nv.info): a hook using more registers than a calling kernel allocates faults at the first
//! call. The harness kernels must allocate at least that many. The ring layout comes from
//! src/devhook/layout.rs, passed as -D defines.
//!
//! nvcc is found through NVCC, CUDA_HOME/bin or PATH. Without nvcc the build still succeeds (empty
//! fatbins; the plugin reports the hook unavailable), unless NVCC is set: then any failure is fatal.

use std::path::{Path, PathBuf};
use std::process::Command;

include!("src/devhook/layout.rs");

#[path = "build/registers.rs"]
mod registers;

const ARCHS: [u32; 4] = [80, 90, 100, 120];
const PTX_ARCH: u32 = 120;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    // Read when the script runs, not baked in when it is compiled: a build-script binary reused from
    // another checkout sharing the target directory would otherwise compile that checkout's CUDA.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR");
    let cuda = Path::new(&manifest).join("../cuda");
    println!("cargo:rerun-if-changed={}", cuda.display());
    println!("cargo:rerun-if-changed=src/devhook/layout.rs");
    println!("cargo:rerun-if-changed=build");
    for var in ["NVCC", "CUDA_HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let explicit = std::env::var_os("NVCC").is_some();
    let Some(nvcc) = find_nvcc() else {
        println!(
            "cargo:warning=nvcc not found (NVCC, CUDA_HOME, PATH): building without device code"
        );
        for name in ["ncclscope_hook.fatbin", "ncclscope_harness.fatbin"] {
            std::fs::write(out.join(name), []).expect("write empty fatbin");
        }
        return;
    };
    let built = std::thread::scope(|s| {
        let hook = s.spawn(|| build(&nvcc, &cuda, &out, "hook", Some(HOOK_MAX_REGS)));
        let harness = s.spawn(|| build(&nvcc, &cuda, &out, "harness", None));
        [
            hook.join().expect("hook build"),
            harness.join().expect("harness build"),
        ]
    });
    for result in built {
        if let Err(e) = result {
            // With NVCC set (CI) or a working-looking toolchain, broken device code must fail the build.
            let how = if explicit {
                "NVCC is set"
            } else {
                "nvcc was found"
            };
            panic!("device code build failed ({how}):\n{e}");
        }
    }
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        let p = Path::new(&home).join("bin/nvcc");
        if p.is_file() {
            return Some(p);
        }
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}

/// Builds cuda/<name>.cu into OUT_DIR/ncclscope_<name>.fatbin. `cap`: the register cap to apply and check
/// on device functions; None: check instead that every kernel allocates at least HOOK_MAX_REGS.
fn build(
    nvcc: &Path,
    cuda: &Path,
    out: &Path,
    name: &str,
    cap: Option<usize>,
) -> Result<(), String> {
    let nvlink = nvcc.with_file_name("nvlink");
    let fatbinary = nvcc.with_file_name("fatbinary");
    let src = cuda.join(format!("{name}.cu"));
    let mut common: Vec<String> = vec![
        "-O3".into(),
        "-rdc=true".into(),
        format!("-I{}", cuda.display()),
    ];
    common.extend(DEFINES.iter().map(|(k, v)| format!("-DNCCLSCOPE_{k}={v}")));
    if let Some(cap) = cap {
        common.push(format!("-maxrregcount={cap}"));
    }
    let mut images = Vec::new();
    for arch in ARCHS {
        let rel = out.join(format!("{name}_sm{arch}.rel.cubin"));
        let linked = out.join(format!("{name}_sm{arch}.cubin"));
        run(Command::new(nvcc)
            .args(&common)
            .arg(format!("-arch=sm_{arch}"))
            .arg("-cubin")
            .arg(&src)
            .arg("-o")
            .arg(&rel))?;
        check_registers(&rel, arch, cap)?;
        run(Command::new(&nvlink)
            .arg(format!("-arch=sm_{arch}"))
            .arg(&rel)
            .arg("-o")
            .arg(&linked))?;
        images.push(format!(
            "--image3=kind=elf,sm={arch},file={}",
            linked.display()
        ));
    }
    let ptx = out.join(format!("{name}.ptx"));
    run(Command::new(nvcc)
        .args(&common)
        .arg(format!("-arch=compute_{PTX_ARCH}"))
        .arg("-ptx")
        .arg(&src)
        .arg("-o")
        .arg(&ptx))?;
    images.push(format!(
        "--image3=kind=ptx,sm={PTX_ARCH},file={}",
        ptx.display()
    ));
    let fatbin = out.join(format!("ncclscope_{name}.fatbin"));
    run(Command::new(&fatbinary)
        .arg("-64")
        .arg(format!("--create={}", fatbin.display()))
        .args(&images))
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let output = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?} failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// Checks the register counts ptxas recorded in a relocatable cubin (see build/registers.rs).
fn check_registers(cubin: &Path, arch: u32, cap: Option<usize>) -> Result<(), String> {
    let elf = std::fs::read(cubin).map_err(|e| format!("{}: {e}", cubin.display()))?;
    let counts = registers::register_counts(&elf)
        .ok_or_else(|| format!("{}: cannot read .nv.info", cubin.display()))?;
    registers::check(&counts, cap, HOOK_MAX_REGS).map_err(|e| format!("sm_{arch}: {e}"))
}
