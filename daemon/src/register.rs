//! The registration socket: a plugin connects and sends one `REGISTER\n` message carrying its segment's
//! descriptor (SCM_RIGHTS), and gets `OK\n` or `ERR <reason>\n`. Who the segment belongs to is what the
//! kernel says about the peer (SO_PEERCRED: its uid, and its pid as seen from the daemon's PID
//! namespace), never what the segment or the message says; the memory file must have been created by
//! that uid, be sealed against resizing and have the size its header declares, or it is refused and
//! counted before it is mapped. The connection then stays open until the process ends: that end is
//! how the engine learns the process is gone.
//!
//! What one user can make the daemon hold here is bounded: [`MAX_CONNECTIONS_PER_UID`] connections
//! not yet answered (root excepted), [`MAX_CONNECTIONS`] of every uid together; more are answered
//! `ERR` and closed at accept, and counted. A connection answered `OK` is the engine's to hold, one
//! per attached segment (`drain.max_segments_per_uid`).

use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, mpsc as std_mpsc};
use std::time::Duration;

use ncclscope_proto::segment::{Segment, SegmentError};
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::oneshot;

use crate::engine::{Attach, Handover, SegmentKey};
use crate::host::per_uid::{Full, PerUid};
use crate::loss::Loss;

/// The message a plugin sends with its descriptor.
pub const REQUEST: &[u8] = b"REGISTER\n";
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Registration connections not yet answered that one uid (other than root) holds at most: as many
/// as its segments (`drain.max_segments_per_uid`'s default) registering at once. Each is held at
/// most [`IO_TIMEOUT`] unless it sent its request.
pub const MAX_CONNECTIONS_PER_UID: usize = 64;
/// Registration connections not yet answered that every uid together holds at most: with
/// `drain.max_segments` (1024) segments' memory files and connections, well within the unit's
/// `LimitNOFILE` (65536).
pub const MAX_CONNECTIONS: usize = 1024;

/// Binds the registration socket, mode 0666: every user's NCCL processes register.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    crate::host::socket::bind(path, 0o666, "plugin registration")
}

/// Accepts registrations until the task is dropped.
pub async fn serve(listener: UnixListener, engine: std_mpsc::Sender<Handover>) {
    let pending = Arc::new(PerUid::default());
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept on the registration socket failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(uid) = stream.peer_cred().map(|c| c.uid()) else {
            continue;
        };
        let held = match pending.take(uid, MAX_CONNECTIONS_PER_UID, MAX_CONNECTIONS) {
            Ok(held) => held,
            Err(full) => {
                refuse(&stream, uid, full, &engine);
                continue;
            }
        };
        let engine = engine.clone();
        tokio::spawn(async move {
            handle(stream, &engine).await;
            drop(held);
        });
    }
}

/// Answers a connection beyond the bounds and counts it; the caller closes it. The answer is written
/// only if the socket takes it at once (a fresh connection's buffer is empty).
fn refuse(stream: &UnixStream, uid: u32, full: Full, engine: &std_mpsc::Sender<Handover>) {
    let (stage, reason) = match full {
        Full::Uid => (
            Loss::UidConnectionQuota,
            format!(
                "uid {uid} holds {MAX_CONNECTIONS_PER_UID} registration connections not yet answered, \
                 the most one user may"
            ),
        ),
        Full::All => (
            Loss::ConnectionsRefused,
            format!("the daemon holds {MAX_CONNECTIONS} registration connections not yet answered"),
        ),
    };
    if let Some(held_back) = crate::host::ratelimit::lines().allow(uid) {
        tracing::warn!(uid, reason = %reason, held_back, "registration connection refused");
    }
    let _ = stream.try_write(format!("ERR {reason}\n").as_bytes());
    let _ = engine.send(Handover::Refused { uid, stage });
}

/// Why a handed-over segment was refused: the loss stage it is counted under, and the reply.
type Refusal = (Loss, String);

/// Reads the request and answers it. Reading and writing are bounded by [`IO_TIMEOUT`]; the engine's
/// verdict is awaited however long it takes: the plugin waits for it (the engine may already hold the
/// connection as the segment's), so it must come.
async fn handle(mut stream: UnixStream, engine: &std_mpsc::Sender<Handover>) {
    let received = tokio::time::timeout(IO_TIMEOUT, receive(&stream)).await;
    let reply = match received {
        Ok(Ok(None)) => return, // connected and closed without a request: a liveness probe
        Ok(Ok(Some((message, fd)))) => register(&stream, &message, fd, engine).await,
        Ok(Err(e)) => Err(format!("read: {e}")),
        Err(_) => Err("timed out reading the request".into()),
    };
    let text = match &reply {
        Ok(()) => "OK\n".to_string(),
        Err(reason) => {
            // Logged where it was decided, once per segment: a refused plugin retries every 2 s.
            tracing::debug!(reason = %reason, "registration refused");
            format!("ERR {}\n", reason.replace('\n', " "))
        }
    };
    let _ = tokio::time::timeout(IO_TIMEOUT, stream.write_all(text.as_bytes())).await;
}

/// The request and the one descriptor it carried (`None` if the peer closed without sending).
/// Descriptors beyond the first are closed.
async fn receive(stream: &UnixStream) -> std::io::Result<Option<(Vec<u8>, Option<OwnedFd>)>> {
    let mut buf = [0u8; 64];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    loop {
        stream.readable().await?;
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = stream.try_io(Interest::READABLE, || {
            rustix::net::recvmsg(
                stream.as_fd(),
                &mut [IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
            )
            .map_err(Into::into)
        });
        let msg = match got {
            Ok(msg) => msg,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        let mut fds = control.drain().flat_map(|m| match m {
            RecvAncillaryMessage::ScmRights(fds) => fds.collect(),
            _ => Vec::new(),
        });
        let fd = fds.next();
        drop(fds);
        if msg.bytes == 0 && fd.is_none() {
            return Ok(None);
        }
        return Ok(Some((buf[..msg.bytes].to_vec(), fd)));
    }
}

async fn register(
    stream: &UnixStream,
    message: &[u8],
    fd: Option<OwnedFd>,
    engine: &std_mpsc::Sender<Handover>,
) -> Result<(), String> {
    let cred = stream
        .peer_cred()
        .map_err(|e| format!("no peer credentials: {e}"))?;
    let pid = cred
        .pid()
        .filter(|p| *p > 0)
        .ok_or("peer pid unavailable (in no PID namespace the daemon can see)")?;
    let checked = check(message, fd, cred.uid());
    let segment = match checked {
        Ok(s) => s,
        Err((stage, reason)) => {
            if let Some(held_back) = crate::host::ratelimit::lines().allow(cred.uid()) {
                tracing::warn!(pid, uid = cred.uid(), reason = %reason, held_back, "segment refused");
            }
            let uid = cred.uid();
            let _ = engine.send(Handover::Refused { uid, stage });
            return Err(reason);
        }
    };
    let key = SegmentKey {
        uid: cred.uid(),
        pid: pid as u32,
        inode: segment.inode(),
    };
    // The engine holds its own copy of the connection, to see it end; this one answers.
    let conn = stream
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| format!("cannot hold the connection: {e}"))?;
    let (tx, rx) = oneshot::channel();
    engine
        .send(Handover::Attach(Attach {
            key,
            segment,
            conn: Some(conn),
            reply: Some(tx),
        }))
        .map_err(|_| "daemon is shutting down".to_string())?;
    rx.await
        .map_err(|_| "daemon is shutting down".to_string())?
}

/// The segment a request hands over, if it may be attached for a peer of `uid`. Untrusted input:
/// anything else gets a clear refusal.
pub fn check(message: &[u8], fd: Option<OwnedFd>, uid: u32) -> Result<Segment, Refusal> {
    let invalid = |reason: String| (Loss::SegmentInvalid, reason);
    if message != REQUEST {
        return Err(invalid("expected `REGISTER` with a descriptor".into()));
    }
    let fd = fd.ok_or_else(|| invalid("no descriptor came with the request".into()))?;
    // Before mapping anything: a file another user created is theirs, whoever hands it over.
    let owner = rustix::fs::fstat(&fd)
        .map_err(|e| invalid(format!("fstat: {e}")))?
        .st_uid;
    if owner != uid {
        return Err((
            Loss::SegmentForeign,
            format!("the segment was created by uid {owner}, the peer is uid {uid}"),
        ));
    }
    Segment::open(fd).map_err(|e| match e {
        e @ SegmentError::Unsealed(_) => (Loss::SegmentUnsealed, e.to_string()),
        e => invalid(e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclscope_proto::Claims;
    use ncclscope_proto::segment::REQUIRED_SEALS;
    use rustix::fs::{MemfdFlags, SealFlags};
    use std::io::{BufRead, BufReader, IoSlice};
    use std::os::fd::BorrowedFd;
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::net::UnixStream as StdStream;
    use std::sync::{Arc, Mutex};

    fn claims() -> Claims {
        Claims {
            hostname: "h".into(),
            job_id: "j".into(),
            slurm_job_id: String::new(),
        }
    }

    /// Sends `message` with `fds` like the plugin does, and returns the daemon's answer.
    fn request(path: &Path, message: &[u8], fds: &[BorrowedFd<'_>]) -> (StdStream, String) {
        let s = StdStream::connect(path).unwrap();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            control.push(rustix::net::SendAncillaryMessage::ScmRights(fds));
        }
        rustix::net::sendmsg(
            &s,
            &[IoSlice::new(message)],
            &mut control,
            rustix::net::SendFlags::empty(),
        )
        .unwrap();
        let mut reply = String::new();
        BufReader::new(&s).read_line(&mut reply).unwrap();
        (s, reply)
    }

    /// Issue 22: any user flooded the log (2,206 WARN lines in 12 s). 200 refused registrations of
    /// one uid write a burst of lines, and another uid's refusal right after is still logged; every
    /// refusal is counted.
    #[tokio::test]
    async fn one_users_flood_of_refusals_writes_a_burst_and_hides_no_other_users_line() {
        if !rustix::process::getuid().is_root() {
            eprintln!("skipped: needs root to connect as other uids");
            return;
        }
        const FLOODER: u32 = 61005;
        const OTHER: u32 = 61006;
        #[derive(Clone, Default)]
        struct Lines(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let log = Lines::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        // This test's runtime runs on this thread only: the server's tasks log here.
        let _guard = tracing::subscriber::set_default(subscriber);
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().join("reg.sock");
        let (tx, rx) = std_mpsc::channel::<Handover>();
        tokio::spawn(serve(bind(&path).unwrap(), tx));
        // `n` registrations without a descriptor, from a thread running as `uid`.
        let refused_as = |uid: u32, n: usize| {
            let path = path.clone();
            tokio::task::spawn_blocking(move || {
                std::thread::spawn(move || {
                    rustix::thread::set_thread_uid(rustix::process::Uid::from_raw(uid)).unwrap();
                    for _ in 0..n {
                        let (_, reply) = request(&path, REQUEST, &[]);
                        assert!(reply.starts_with("ERR no descriptor"), "{reply}");
                    }
                })
                .join()
                .unwrap()
            })
        };
        const FLOOD: usize = 200;
        refused_as(FLOODER, FLOOD).await.unwrap();
        refused_as(OTHER, 1).await.unwrap();
        let refused = rx
            .try_iter()
            .filter(|h| matches!(h, Handover::Refused { .. }))
            .count();
        assert_eq!(refused, FLOOD + 1, "every refusal counted");
        let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        let lines = |uid: u32| {
            let uid = format!("uid={uid} ");
            (text.lines())
                .filter(|l| l.contains("segment refused") && l.contains(&uid))
                .count()
        };
        assert_eq!(lines(FLOODER), crate::host::ratelimit::BURST as usize);
        assert_eq!(lines(OTHER), 1, "{text}");
    }

    #[tokio::test]
    async fn refuses_what_is_unsealed_or_malformed_and_hands_over_what_is_sound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("reg.sock");
        let (tx, rx) = std_mpsc::channel::<Handover>();
        tokio::spawn(serve(bind(&path).unwrap(), tx));
        let engine = std::thread::spawn(move || {
            let mut refused = Vec::new();
            for h in rx {
                match h {
                    Handover::Refused { stage, .. } => refused.push(stage),
                    Handover::Attach(a) => {
                        a.reply.unwrap().send(Ok(())).unwrap();
                        return (a.key, refused);
                    }
                }
            }
            panic!("no attach");
        });
        let path2 = path.clone();
        let (key, refused, inode) = tokio::task::spawn_blocking(move || {
            // Shaped like a segment but unsealed: the owner could truncate it under the daemon.
            let unsealed = rustix::fs::memfd_create("x", MemfdFlags::ALLOW_SEALING).unwrap();
            rustix::fs::ftruncate(&unsealed, 4096).unwrap();
            let (_, reply) = request(&path2, REQUEST, &[unsealed.as_fd()]);
            assert!(reply.starts_with("ERR segment is not sealed"), "{reply}");
            rustix::fs::fcntl_add_seals(&unsealed, REQUIRED_SEALS - SealFlags::GROW).unwrap();
            let (_, reply) = request(&path2, REQUEST, &[unsealed.as_fd()]);
            assert!(reply.starts_with("ERR segment is not sealed"), "{reply}");
            // No descriptor, another message, a sealed file that is no segment.
            let (_, reply) = request(&path2, REQUEST, &[]);
            assert!(reply.starts_with("ERR no descriptor"), "{reply}");
            let seg = Segment::create(&claims(), 8).unwrap();
            let (_, reply) = request(&path2, b"REGISTER /dev/shm/x\n", &[seg.fd()]);
            assert!(reply.starts_with("ERR expected"), "{reply}");
            let empty = rustix::fs::memfd_create("y", MemfdFlags::ALLOW_SEALING).unwrap();
            rustix::fs::fcntl_add_seals(&empty, REQUIRED_SEALS).unwrap();
            let (_, reply) = request(&path2, REQUEST, &[empty.as_fd()]);
            assert!(
                reply.starts_with("ERR segment is invalid: size 0"),
                "{reply}"
            );
            // A sound segment: attached, keyed by the kernel's view of the peer; a second descriptor
            // in the same message is ignored.
            let (_conn, reply) = request(&path2, REQUEST, &[seg.fd(), empty.as_fd()]);
            assert_eq!(reply, "OK\n");
            let (key, refused) = engine.join().unwrap();
            (key, refused, seg.inode())
        })
        .await
        .unwrap();
        assert_eq!(
            refused,
            [
                Loss::SegmentUnsealed,
                Loss::SegmentUnsealed,
                Loss::SegmentInvalid,
                Loss::SegmentInvalid,
                Loss::SegmentInvalid
            ]
        );
        assert_eq!(
            key,
            SegmentKey {
                uid: rustix::process::getuid().as_raw(),
                pid: std::process::id(),
                inode,
            }
        );
        // A live daemon's socket is not taken over.
        assert!(bind(&path).is_err());
    }
}
