//! Generates the gRPC API from `ncclscope.proto`, the Perfetto trace messages `export` writes from
//! `perfetto_trace.proto` and the Prometheus protobuf exposition from `prometheus_metrics.proto`,
//! when the `grpc` feature is on, with the vendored protoc so that no system protobuf compiler is
//! needed.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=ncclscope.proto");
    println!("cargo:rerun-if-changed=perfetto_trace.proto");
    println!("cargo:rerun-if-changed=prometheus_metrics.proto");
    if std::env::var_os("CARGO_FEATURE_GRPC").is_none() {
        return Ok(());
    }
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: the build script is single-threaded; this only affects its own child processes.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    tonic_prost_build::configure().compile_protos(&["ncclscope.proto"], &["."])?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .compile_protos(
            &["perfetto_trace.proto", "prometheus_metrics.proto"],
            &["."],
        )?;
    Ok(())
}
