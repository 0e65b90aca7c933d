//! Talking to systemd: readiness and watchdog pings (`Type=notify`, `WatchdogSec=`) and the file
//! descriptor store (`FDSTORE=1`), each one datagram to `$NOTIFY_SOCKET`; nothing when it is unset.

use std::io;
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use rustix::net::{
    AddressFamily, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix,
    SocketFlags, SocketType,
};

/// Descriptors sent with one message at most (a segment and its connection).
const MAX_FDS: usize = 2;

/// Sends `state` (e.g. "READY=1") with `fds` to the service manager, if there is one. Never waits: a
/// manager that does not keep up gets an error (WouldBlock), not a stalled ingest thread.
pub fn notify(state: &str, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(path) => send(&path.to_string_lossy(), state, fds),
        None => Ok(()),
    }
}

/// Sends `state` with `fds` to the notification socket at `path` (`@` starts an abstract name).
fn send(path: &str, state: &str, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let addr = match path.strip_prefix('@') {
        Some(abstract_name) => SocketAddrUnix::new_abstract_name(abstract_name.as_bytes())?,
        None => SocketAddrUnix::new(path)?,
    };
    if fds.len() > MAX_FDS {
        return Err(io::Error::other(
            "too many descriptors for one notification",
        ));
    }
    let socket = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        control.push(SendAncillaryMessage::ScmRights(fds));
    }
    rustix::net::sendmsg_addr(
        &socket,
        &addr,
        &[IoSlice::new(state.as_bytes())],
        &mut control,
        SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
    )?;
    Ok(())
}

/// Whether a service manager keeps descriptors for this process (`FileDescriptorStoreMax=` > 0,
/// which systemd announces as `$FDSTORE`).
pub fn fd_store_available() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
        && std::env::var("FDSTORE").is_ok_and(|n| n.parse::<u32>().is_ok_and(|n| n > 0))
}

/// How often systemd expects a watchdog ping from this process (`WatchdogSec=`), if it does.
pub fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    let for_us =
        std::env::var("WATCHDOG_PID").map_or(true, |p| p.parse() == Ok(std::process::id()));
    (for_us && usec > 0).then(|| Duration::from_micros(usec))
}

/// The name a segment's descriptors carry in the file descriptor store (`FDNAME=`, back in
/// `$LISTEN_FDNAMES` after a restart).
pub fn segment_fd_name(label: &str) -> String {
    format!("{SEGMENT_FD_PREFIX}{label}")
}

pub const SEGMENT_FD_PREFIX: &str = "segment.";

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    #[test]
    fn sends_to_the_notification_socket_with_descriptors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let server = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        let file = tempfile::tempfile().unwrap();
        let path = path.to_str().unwrap();
        super::send(path, "READY=1", &[]).unwrap();
        super::send(path, "FDSTORE=1\nFDNAME=segment.1.2.3", &[file.as_fd()]).unwrap();
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"FDSTORE=1\nFDNAME=segment.1.2.3");
    }
}
