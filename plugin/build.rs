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

const ARCHS: [u32; 4] = [80, 90, 100, 120];
const PTX_ARCH: u32 = 120;
const EIATTR_REGCOUNT: u8 = 0x2f;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let cuda = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cuda");
    println!("cargo:rerun-if-changed={}", cuda.display());
    println!("cargo:rerun-if-changed=src/devhook/layout.rs");
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

/// Checks the register counts ptxas recorded for each function (EIATTR_REGCOUNT in .nv.info).
fn check_registers(cubin: &Path, arch: u32, cap: Option<usize>) -> Result<(), String> {
    let elf = std::fs::read(cubin).map_err(|e| format!("{}: {e}", cubin.display()))?;
    let counts = register_counts(&elf)
        .ok_or_else(|| format!("{}: cannot read .nv.info", cubin.display()))?;
    let mut seen_hook = false;
    for (func, regs) in &counts {
        match cap {
            Some(cap)
                if func.starts_with("ncclscope_hook") || func.starts_with("ncclscope_ref_") =>
            {
                seen_hook |= func == "ncclscope_hook";
                if *regs as usize > cap {
                    return Err(format!(
                        "sm_{arch}: {func} uses {regs} registers, over the cap of {cap}"
                    ));
                }
            }
            None if func.starts_with("ncclscope_harness") && (*regs as usize) < HOOK_MAX_REGS => {
                return Err(format!(
                    "sm_{arch}: kernel {func} allocates {regs} registers, fewer than the hook's {HOOK_MAX_REGS}"
                ));
            }
            _ => {}
        }
    }
    if cap.is_some() && !seen_hook {
        return Err(format!(
            "sm_{arch}: no register count recorded for ncclscope_hook: {counts:?}"
        ));
    }
    Ok(())
}

/// (function name, registers) from a CUDA ELF's .nv.info section. Records are
/// {format u8, attribute u8, size u16, payload}; REGCOUNT's payload is {symbol index u32, count u32}.
fn register_counts(elf: &[u8]) -> Option<Vec<(String, u32)>> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    if elf.get(..5)? != b"\x7fELF\x02" {
        return None;
    }
    let (shoff, shentsize, shnum, shstrndx) = (
        u64_at(0x28)? as usize,
        u16_at(0x3a)? as usize,
        u16_at(0x3c)? as usize,
        u16_at(0x3e)? as usize,
    );
    let section = |i: usize| {
        let h = shoff + i * shentsize;
        Some((
            u32_at(h)?,
            u32_at(h + 4)?,
            u64_at(h + 0x18)? as usize,
            u64_at(h + 0x20)? as usize,
            u32_at(h + 0x28)?,
        ))
    };
    let cstr = |o: usize| {
        let bytes = elf.get(o..)?;
        let end = bytes.iter().position(|&b| b == 0)?;
        Some(String::from_utf8_lossy(&bytes[..end]).into_owned())
    };
    let (_, _, names, _, _) = section(shstrndx)?;
    let (mut info, mut symtab) = (None, None);
    for i in 0..shnum {
        let (name, kind, off, size, link) = section(i)?;
        match cstr(names + name as usize)?.as_str() {
            ".nv.info" => info = Some((off, size)),
            _ if kind == 2 => symtab = Some((off, size, link)),
            _ => {}
        }
    }
    let ((info_off, info_size), (sym_off, _, strtab)) = (info?, symtab?);
    let (_, _, str_off, _, _) = section(strtab as usize)?;
    let mut counts = Vec::new();
    let mut o = info_off;
    while o + 4 <= info_off + info_size {
        let (attr, size) = (elf[o + 1], u16_at(o + 2)? as usize);
        if elf[o] == 0x04 && attr == EIATTR_REGCOUNT {
            let (sym, regs) = (u32_at(o + 4)? as usize, u32_at(o + 8)?);
            let name = cstr(str_off + u32_at(sym_off + sym * 24)? as usize)?;
            counts.push((name, regs));
        }
        o += 4 + if elf[o] == 0x04 { size } else { 0 };
    }
    Some(counts)
}
