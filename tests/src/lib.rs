//! Shared support for the end-to-end tests in tests/tests/.

use std::path::{Path, PathBuf};

use fake_opentelemetry_collector::ExportedSpan;

/// The `ncclscope` binary of this build (next to the test executable's `deps/` directory).
pub fn daemon_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .join("ncclscope");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --workspace` first",
        bin.display()
    );
    bin
}

/// A span attribute's value; the fake collector keeps them in their Debug form
/// (`Some(AnyValue { value: Some(IntValue(5)) })`). "" when absent.
pub fn attr<'a>(s: &'a ExportedSpan, k: &str) -> &'a str {
    let Some(v) = s.attributes.get(k) else {
        return "";
    };
    for (open, close) in [
        ("StringValue(\"", "\")"),
        ("IntValue(", ")"),
        ("DoubleValue(", ")"),
        ("BoolValue(", ")"),
    ] {
        if let Some(rest) = v.split_once(open).map(|(_, r)| r) {
            return rest.split_once(close).map_or(rest, |(v, _)| v);
        }
    }
    v
}
