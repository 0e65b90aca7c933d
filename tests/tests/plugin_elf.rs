//! The built plugin as NCCL sees it: NCCL dlopens it with RTLD_NOW, so it must export the three
//! vtables and leave no NCCL or CUDA symbol (or library) to resolve: it finds NCCL and CUDA at run time.

use std::process::Command;

fn tool(cmd: &str, args: &[&str]) -> String {
    let so = ncclscope_fakenccl::plugin_path().unwrap();
    let out = Command::new(cmd)
        .args(args)
        .arg(&so)
        .output()
        .unwrap_or_else(|e| panic!("{cmd} (binutils) is needed for this test: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn exports_the_three_vtables_with_their_sizes() {
    let defined = tool("nm", &["-D", "-S", "--defined-only"]);
    for (symbol, size) in [
        ("ncclProfiler_v5", 48),
        ("ncclProfiler_v6", 48),
        ("ncclProfiler_v7", 56),
    ] {
        let line = defined
            .lines()
            .find(|l| l.split_whitespace().last() == Some(symbol))
            .unwrap_or_else(|| panic!("{symbol} not exported:\n{defined}"));
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(u64::from_str_radix(fields[1], 16).unwrap(), size, "{line}");
        assert!(
            matches!(fields[2], "D" | "R" | "B"),
            "{symbol} is not a data object: {line}"
        );
    }
}

#[test]
fn needs_no_nccl_or_cuda_symbol_or_library() {
    let undefined = tool("nm", &["-D", "--undefined-only"]);
    let foreign: Vec<&str> = undefined
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .filter(|s| {
            s.starts_with("nccl")
                || s.starts_with("cuda")
                || (s.starts_with("cu") && s.chars().nth(2).is_some_and(|c| c.is_ascii_uppercase()))
        })
        .collect();
    assert!(
        foreign.is_empty(),
        "undefined NCCL/CUDA symbols: {foreign:?}"
    );
    assert!(
        undefined.contains("dladdr"),
        "sanity: the undefined list was read:\n{undefined}"
    );
    let dynamic = tool("readelf", &["-d"]);
    let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(!needed.is_empty(), "{dynamic}");
    for lib in &needed {
        assert!(
            !lib.contains("libcuda") && !lib.contains("libnccl") && !lib.contains("libcudart"),
            "{lib}"
        );
    }
}
