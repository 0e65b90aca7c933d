//! Shared support for the end-to-end tests in tests/tests/.

use std::path::{Path, PathBuf};

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
