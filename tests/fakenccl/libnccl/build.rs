//! The RFC package builds the same source with `cfg(fakenccl_rfc)`.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(fakenccl_rfc)");
    if std::env::var("CARGO_PKG_NAME").is_ok_and(|n| n.ends_with("-rfc")) {
        println!("cargo::rustc-cfg=fakenccl_rfc");
    }
}
