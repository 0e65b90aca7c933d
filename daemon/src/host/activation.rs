//! Descriptors systemd passes to the daemon at start (`$LISTEN_FDS`, `$LISTEN_FDNAMES`): the
//! registration socket of `ncclscope.socket` (socket activation: plugins' connections queue in it
//! while the daemon restarts) and what the previous daemon put in the file descriptor store (each
//! attached segment and its connection). The only module that turns raw descriptor numbers into owned
//! descriptors.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// Where systemd's passed descriptors start (`SD_LISTEN_FDS_START`).
const FIRST_FD: i32 = 3;
/// The name `ncclscope.socket` gives its socket (`FileDescriptorName=`).
pub const REGISTRATION_FD_NAME: &str = "registration";

static TAKEN: AtomicBool = AtomicBool::new(false);

/// The descriptors passed to this process, with their names; empty when systemd passed none (or
/// passed them to another process: `$LISTEN_PID` names the one they are for). Only the first call
/// gets them.
pub fn take() -> Vec<(String, OwnedFd)> {
    let ours = std::env::var("LISTEN_PID").is_ok_and(|p| p.parse() == Ok(std::process::id()));
    let count: i32 = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    if !ours || count <= 0 || TAKEN.swap(true, Ordering::AcqRel) {
        return Vec::new();
    }
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    let mut names = names.split(':');
    (FIRST_FD..FIRST_FD + count)
        .map(|raw| {
            // SAFETY: systemd opened descriptors FIRST_FD..FIRST_FD+LISTEN_FDS for this very process
            // (LISTEN_PID) and nothing else in it owns them; TAKEN makes this the only place that
            // takes ownership of them, once.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            // Not inherited by anything this process might start.
            let _ = rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC);
            (names.next().unwrap_or("unknown").to_string(), fd)
        })
        .collect()
}
