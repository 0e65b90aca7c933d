//! Registration with the node daemon: one `REGISTER\n` message on its Unix socket that carries the
//! segment's descriptor (SCM_RIGHTS), answered by `OK\n` or `ERR <reason>\n`. The connection is then
//! held for the life of the process: the kernel closes it when the process ends, which is how the
//! daemon learns of the end; when the daemon goes away instead, the plugin sees it close, reconnects
//! and sends the descriptor again, so a restarted daemon resumes the segment where the old one
//! committed. A rank that starts before any daemon keeps writing into its ring and keeps trying.
//!
//! Everything here runs on the forwarding thread and never blocks: the socket is non-blocking, the
//! reply is looked for on later polls, and a dead connection is noticed by a non-blocking read.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix,
    SocketFlags, SocketType,
};

use crate::host;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait between attempts: also bounds how long a rank waits for a restarted daemon.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How often the held connection is checked for its end.
const CHECK_EVERY: Duration = Duration::from_millis(100);

/// The held connection's descriptor number, or -1: a forked child closes its copy (see
/// [`close_inherited_connection`]) so that the daemon sees the connection end with the process that
/// registered.
static CONNECTION_FD: AtomicI32 = AtomicI32::new(-1);

/// In a child forked after the plugin started: closes its copy of the parent's connection, which
/// would keep the connection open after the parent ends. Async-signal-safe.
pub fn close_inherited_connection() {
    let fd = CONNECTION_FD.swap(-1, Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: `fd` is the parent's connection, inherited by this child, where no thread owns it
        // (fork copies only the calling thread; the `Connection` is the forwarding thread's).
        unsafe { libc::close(fd) };
    }
}

/// A connection to the daemon, published in [`CONNECTION_FD`] while it is open.
struct Connection(OwnedFd);

impl Connection {
    fn open(path: &std::path::Path) -> std::io::Result<Connection> {
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
            None,
        )?;
        // A daemon whose backlog is full answers EAGAIN: unreachable for now.
        rustix::net::connect(&fd, &SocketAddrUnix::new(path)?)?;
        CONNECTION_FD.store(fd.as_raw_fd(), Ordering::Relaxed);
        Ok(Connection(fd))
    }

    /// Whatever the daemon sent, without waiting: `Ok(None)` if nothing is there, `Ok(Some(0))` at
    /// the end of the connection.
    fn read(&self, into: &mut Vec<u8>) -> std::io::Result<Option<usize>> {
        let mut buf = [0u8; 256];
        match rustix::net::recv(&self.0, &mut buf, RecvFlags::DONTWAIT) {
            Ok((_, n)) => {
                let room = buf.len().saturating_sub(into.len());
                into.extend_from_slice(&buf[..n.min(room)]);
                Ok(Some(n))
            }
            Err(Errno::AGAIN) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Before the descriptor is closed (the field drops after this) and its number reused.
        let _ = CONNECTION_FD.compare_exchange(
            self.0.as_raw_fd(),
            -1,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }
}

enum State {
    /// Not connected; the next attempt is due then.
    Idle(Instant),
    /// The descriptor was sent; waiting for the daemon's answer, however long it takes: a daemon that
    /// is slow, or not yet started behind a socket-activated listener, answers late, and one that
    /// goes away closes the connection. (Giving up would close a connection the daemon may have
    /// taken for the segment's, which it would read as the process's end.)
    Asked(Connection),
    /// Accepted and held; looked at again then.
    Held(Connection, Instant),
}

pub struct Registration {
    socket: PathBuf,
    state: State,
    backoff: Duration,
    reply: Vec<u8>,
    /// Times the daemon accepted the segment (more than once: it restarted meanwhile).
    accepted: u32,
}

/// What the daemon said, or why it could not be asked.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Accepted,
    Refused(String),
    Unreachable(String),
}

impl Registration {
    pub fn new(socket: PathBuf) -> Registration {
        Registration {
            socket,
            state: State::Idle(Instant::now()),
            backoff: FIRST_BACKOFF,
            reply: Vec::new(),
            accepted: 0,
        }
    }

    /// Moves the registration on if something is due: connects and sends `segment`, reads the answer,
    /// or checks that the held connection is still there. Cheap when nothing is due.
    pub fn poll(&mut self, now: Instant, segment: BorrowedFd<'_>) {
        let state = std::mem::replace(&mut self.state, State::Idle(now));
        self.state = match state {
            State::Idle(at) if now < at => State::Idle(at),
            State::Idle(_) => match self.ask(segment) {
                Ok(conn) => State::Asked(conn),
                Err(e) => self.failed(now, Outcome::Unreachable(e.to_string())),
            },
            State::Asked(conn) => match conn.read(&mut self.reply) {
                Ok(None) => State::Asked(conn),
                Ok(Some(0)) => self.failed(now, Outcome::Unreachable("closed".into())),
                Ok(Some(_)) if !self.reply.contains(&b'\n') => State::Asked(conn),
                Ok(Some(_)) => match answer(&self.reply) {
                    Outcome::Accepted => self.accept(now, conn),
                    outcome => self.failed(now, outcome),
                },
                Err(e) => self.failed(now, Outcome::Unreachable(e.to_string())),
            },
            State::Held(conn, at) if now < at => State::Held(conn, at),
            State::Held(conn, _) => {
                self.reply.clear();
                match conn.read(&mut self.reply) {
                    Ok(None) | Ok(Some(1..)) => State::Held(conn, now + CHECK_EVERY),
                    Ok(Some(0)) | Err(_) => {
                        host::log_once(
                            "register-lost",
                            false,
                            "the daemon went away; sending the segment again once one listens",
                        );
                        self.backoff = FIRST_BACKOFF;
                        State::Idle(now)
                    }
                }
            }
        };
    }

    /// Waits (polling, at most `within`) until a daemon has the segment or none could be asked, trying
    /// at once whatever the backoff: a process that ends takes its segment with it, so its last
    /// communicator's end gives a daemon that is there the chance to take it first.
    pub fn settle(&mut self, segment: BorrowedFd<'_>, within: Duration) {
        let deadline = Instant::now() + within;
        if let State::Idle(at) = &mut self.state {
            *at = Instant::now();
        }
        loop {
            self.poll(Instant::now(), segment);
            if !matches!(self.state, State::Asked(..)) || Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Connects and sends the descriptor (a few bytes: they fit in an empty socket buffer at once).
    fn ask(&mut self, segment: BorrowedFd<'_>) -> std::io::Result<Connection> {
        let conn = Connection::open(&self.socket)?;
        let fds = [segment];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        control.push(SendAncillaryMessage::ScmRights(&fds));
        let sent = rustix::net::sendmsg(
            conn.0.as_fd(),
            &[IoSlice::new(b"REGISTER\n")],
            &mut control,
            SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
        )?;
        if sent != b"REGISTER\n".len() {
            return Err(std::io::Error::other("short send"));
        }
        self.reply.clear();
        Ok(conn)
    }

    fn accept(&mut self, now: Instant, conn: Connection) -> State {
        self.accepted += 1;
        let again = if self.accepted > 1 { "again " } else { "" };
        host::log(
            false,
            &format!(
                "segment registered {again}with the daemon at {}",
                self.socket.display()
            ),
        );
        self.backoff = FIRST_BACKOFF;
        State::Held(conn, now + CHECK_EVERY)
    }

    fn failed(&mut self, now: Instant, outcome: Outcome) -> State {
        match &outcome {
            Outcome::Refused(reason) => host::log_once(
                "register-refused",
                true,
                &format!("the daemon refused the segment: {reason}"),
            ),
            Outcome::Unreachable(why) => host::log_once(
                "register-unreachable",
                false,
                &format!(
                    "no daemon at {} ({why}); retrying in the background",
                    self.socket.display()
                ),
            ),
            Outcome::Accepted => {}
        }
        let at = now + self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        State::Idle(at)
    }

    #[cfg(test)]
    fn held(&self) -> bool {
        matches!(self.state, State::Held(..))
    }
}

fn answer(reply: &[u8]) -> Outcome {
    let line = String::from_utf8_lossy(reply);
    let line = line.split('\n').next().unwrap_or_default();
    if line == "OK" {
        Outcome::Accepted
    } else if line.starts_with("ERR") {
        Outcome::Refused(line.to_string())
    } else {
        Outcome::Unreachable(format!("unexpected reply {line:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclscope_proto::{Claims, Segment};
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage};
    use std::io::{IoSliceMut, Write};
    use std::os::unix::net::{UnixListener, UnixStream};

    /// Accepts one registration like the daemon: the message and the descriptor it carries.
    fn receive(listener: &UnixListener) -> (UnixStream, Vec<u8>, OwnedFd) {
        let (s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 64];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = rustix::net::recvmsg(
            &s,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::empty(),
        )
        .unwrap();
        let fd = control
            .drain()
            .find_map(|m| match m {
                RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
                _ => None,
            })
            .expect("a descriptor");
        (s, buf[..msg.bytes].to_vec(), fd)
    }

    fn segment() -> Segment {
        let claims = Claims {
            hostname: "h".into(),
            job_id: "j".into(),
            slurm_job_id: String::new(),
        };
        Segment::create(&claims, 8).unwrap()
    }

    fn settle(reg: &mut Registration, seg: &Segment, until: impl Fn(&Registration) -> bool) {
        let t0 = Instant::now();
        while !until(reg) {
            assert!(t0.elapsed() < Duration::from_secs(10), "never settled");
            reg.poll(Instant::now(), seg.fd());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn hands_over_the_descriptor_holds_the_connection_and_hands_it_over_again_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let seg = segment();
        let mut reg = Registration::new(path.clone());
        let t0 = Instant::now();
        reg.poll(t0, seg.fd());
        assert!(matches!(reg.state, State::Idle(at) if at == t0 + FIRST_BACKOFF));
        reg.poll(t0 + Duration::from_millis(150), seg.fd());
        assert_eq!(reg.backoff, FIRST_BACKOFF * 4);

        let listener = UnixListener::bind(&path).unwrap();
        let daemon = std::thread::spawn(move || {
            let (mut s, msg, fd) = receive(&listener);
            s.write_all(b"OK\n").unwrap();
            let inode = Segment::open(fd).unwrap().inode();
            (listener, s, msg, inode)
        });
        settle(&mut reg, &seg, Registration::held);
        let (listener, first, msg, inode) = daemon.join().unwrap();
        assert_eq!(msg, b"REGISTER\n");
        assert_eq!(
            inode,
            seg.inode(),
            "the daemon maps the plugin's own segment"
        );
        // The daemon goes away: the plugin notices and sends the same segment to the next one.
        drop(first);
        let daemon = std::thread::spawn(move || {
            let (mut s, _, fd) = receive(&listener);
            s.write_all(b"OK\n").unwrap();
            (s, Segment::open(fd).unwrap().inode())
        });
        settle(&mut reg, &seg, |r| r.held() && r.accepted == 2);
        assert_eq!(daemon.join().unwrap().1, seg.inode());
    }

    #[test]
    fn settling_tries_at_once_despite_the_backoff_and_waits_for_the_answer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let seg = segment();
        let mut reg = Registration::new(path.clone());
        // No daemon: one failed attempt, then a backoff far in the future; settling returns at once.
        reg.poll(Instant::now(), seg.fd());
        reg.state = State::Idle(Instant::now() + Duration::from_secs(60));
        let t0 = Instant::now();
        reg.settle(seg.fd(), Duration::from_secs(1));
        assert!(t0.elapsed() < Duration::from_millis(100));
        // A daemon that appeared meanwhile and answers after 50 ms: taken now, not in 60 s.
        let listener = UnixListener::bind(&path).unwrap();
        let daemon = std::thread::spawn(move || {
            let (mut s, _, _) = receive(&listener);
            std::thread::sleep(Duration::from_millis(50));
            s.write_all(b"OK\n").unwrap();
            s
        });
        reg.state = State::Idle(Instant::now() + Duration::from_secs(60));
        reg.settle(seg.fd(), Duration::from_secs(1));
        assert!(reg.held(), "handed over before the process ends");
        drop(daemon.join().unwrap());
    }

    #[test]
    fn a_silent_daemon_is_waited_for_without_blocking_and_a_refusal_retried() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let seg = segment();
        let mut reg = Registration::new(path);
        let t0 = Instant::now();
        reg.poll(t0, seg.fd());
        assert!(matches!(reg.state, State::Asked(..)));
        // Nobody answers yet: each poll returns at once, and keeps waiting.
        reg.poll(t0, seg.fd());
        reg.poll(t0 + Duration::from_secs(60), seg.fd());
        assert!(t0.elapsed() < Duration::from_millis(50));
        assert!(matches!(reg.state, State::Asked(..)));
        // The daemon gets to it late and refuses: retried after the backoff.
        let (mut s, msg, _) = receive(&listener);
        assert_eq!(msg, b"REGISTER\n");
        s.write_all(b"ERR no\n").unwrap();
        let t1 = Instant::now();
        while matches!(reg.state, State::Asked(..)) {
            assert!(t1.elapsed() < Duration::from_secs(5));
            reg.poll(Instant::now(), seg.fd());
        }
        assert!(matches!(reg.state, State::Idle(at) if at > Instant::now()));
        assert_eq!(answer(b"ERR no\n"), Outcome::Refused("ERR no".into()));
        assert_eq!(answer(b"OK\n"), Outcome::Accepted);
    }
}
