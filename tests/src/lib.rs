//! Shared support for the end-to-end tests in tests/tests/.

use std::path::{Path, PathBuf};
use std::process::Command;

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

/// Adds `daemon` and its arguments for a daemon whose sockets, spool and state are in `dir`, and
/// whose configuration is `dir/ncclscope.toml` (written empty unless the test wrote one): a test
/// must not pick up the machine's /etc/ncclscope. Exports and Prometheus are the caller's to set.
pub fn daemon_args<'a>(c: &'a mut Command, dir: &Path) -> &'a mut Command {
    let config = dir.join("ncclscope.toml");
    if !config.exists() {
        std::fs::write(&config, "").unwrap();
    }
    c.arg("daemon")
        .arg("--config")
        .arg(config)
        .args(["--socket".as_ref(), dir.join("reg.sock").as_os_str()])
        .args(["--api-socket".as_ref(), dir.join("api.sock").as_os_str()])
        .args(["--spool-dir".as_ref(), dir.join("spool").as_os_str()])
        .args(["--state-dir".as_ref(), dir.join("state").as_os_str()])
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
