//! Running fake ranks as separate processes (the plugin keeps one state per process) and reading back
//! the segments they handed over, for tests.

use std::collections::BTreeMap;
use std::io::{IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use ncclscope_proto::segment::{Claims, Consumer, Counter, REQUIRED_SEALS, Segment};
use ncclscope_proto::{Record, StrId};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::report::Report;

/// Stands in for the daemon's registration socket: takes every segment a rank hands over, answers OK
/// and holds it with its connection, so that what a rank wrote outlives the rank (as it does in the
/// daemon) and the test can read it and see the connection end with the process.
pub struct Catcher {
    dir: tempfile::TempDir,
    caught: Arc<Mutex<Vec<(Segment, UnixStream)>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Catcher {
    pub fn start() -> Catcher {
        let dir = tempfile::tempdir().expect("temp dir");
        let listener = UnixListener::bind(dir.path().join("catcher.sock")).expect("bind");
        let caught = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (caught, stop) = (caught.clone(), stop.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    let Ok(mut conn) = conn else { continue };
                    if let Ok(fd) = receive_segment(&conn)
                        && let Ok(seg) = Segment::open(fd)
                    {
                        let _ = conn.write_all(b"OK\n");
                        caught.lock().unwrap().push((seg, conn));
                    }
                }
            })
        };
        Catcher {
            dir,
            caught,
            stop,
            thread: Some(thread),
        }
    }

    /// Where ranks register (their `NCCLSCOPE_SOCKET`).
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("catcher.sock")
    }

    /// Segments handed over so far.
    pub fn count(&self) -> usize {
        self.caught.lock().unwrap().len()
    }

    /// Another mapping of the first segment handed over, once there is one (within `timeout`).
    pub fn wait(&self, timeout: std::time::Duration) -> anyhow::Result<Segment> {
        let t0 = std::time::Instant::now();
        loop {
            if let Some((seg, _)) = self.caught.lock().unwrap().first() {
                return Ok(Segment::open(seg.fd().try_clone_to_owned()?)?);
            }
            if t0.elapsed() > timeout {
                bail!("no segment handed over within {timeout:?}");
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Another mapping of every segment handed over so far, in order (e.g. to drain them as a daemon).
    pub fn segments(&self) -> Vec<Segment> {
        self.caught
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(seg, _)| Segment::open(seg.fd().try_clone_to_owned().ok()?).ok())
            .collect()
    }

    /// Reads the only segment handed over so far.
    pub fn only_segment(&self) -> anyhow::Result<Contents> {
        let mut caught = self.caught.lock().unwrap();
        if caught.len() != 1 {
            bail!("expected one segment, caught {}", caught.len());
        }
        let (seg, conn) = caught.remove(0);
        read_segment(seg, &conn)
    }
}

impl Drop for Catcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = UnixStream::connect(self.socket());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Keeps a segment registered with the daemon at a socket, as the plugin's forwarding thread does: hands
/// it over, holds the connection, and hands it over again whenever the daemon goes away. Dropping it
/// closes the connection (the "process" ends).
pub struct Registrant {
    conn: Arc<Mutex<Option<UnixStream>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Registrant {
    /// Registers `segment` (the first time within `wait`, or panics) and keeps it registered.
    pub fn start(
        socket: &std::path::Path,
        segment: &Segment,
        wait: std::time::Duration,
    ) -> Registrant {
        let fd = segment.fd().try_clone_to_owned().expect("dup");
        let (reply, first) = register(socket, fd.as_fd(), wait).expect("registration");
        assert_eq!(reply, "OK\n", "registration refused");
        let conn = Arc::new(Mutex::new(Some(first.try_clone().expect("dup"))));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (conn, stop, socket) = (conn.clone(), stop.clone(), socket.to_path_buf());
            std::thread::spawn(move || {
                let mut held = first;
                loop {
                    // The daemon sends nothing after OK: this returns when the connection ends.
                    let _ = held.read(&mut [0u8; 16]);
                    // Like the plugin, never give up: retry until accepted (or this "process" ends).
                    loop {
                        if stop.load(Ordering::Acquire) {
                            return;
                        }
                        match register(&socket, fd.as_fd(), std::time::Duration::from_secs(1)) {
                            Ok((reply, c)) if reply == "OK\n" => {
                                *conn.lock().unwrap() = c.try_clone().ok();
                                held = c;
                                break;
                            }
                            _ => std::thread::sleep(std::time::Duration::from_millis(100)),
                        }
                    }
                }
            })
        };
        Registrant {
            conn,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Registrant {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(c) = self.conn.lock().unwrap().take() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Hands the segment `fd` to the daemon at `socket` as the plugin does (`REGISTER` with the
/// descriptor), retrying for up to `wait` while no daemon listens; returns the daemon's answer line
/// and the connection, which the caller holds for as long as its "process" lives.
pub fn register(
    socket: &std::path::Path,
    fd: BorrowedFd<'_>,
    wait: std::time::Duration,
) -> anyhow::Result<(String, UnixStream)> {
    let deadline = std::time::Instant::now() + wait;
    let conn = loop {
        match UnixStream::connect(socket) {
            Ok(c) => break c,
            Err(e) if std::time::Instant::now() >= deadline => {
                return Err(e).with_context(|| format!("no daemon at {}", socket.display()));
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    };
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    rustix::net::sendmsg(
        &conn,
        &[std::io::IoSlice::new(b"REGISTER\n")],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    let mut reply = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(&conn), &mut reply)?;
    Ok((reply, conn))
}

/// The descriptor a `REGISTER` message carries, as the daemon receives it.
pub fn receive_segment(conn: &UnixStream) -> anyhow::Result<OwnedFd> {
    let mut buf = [0u8; 64];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = rustix::net::recvmsg(
        conn,
        &mut [IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    if &buf[..msg.bytes] != b"REGISTER\n" {
        bail!("unexpected message {:?}", &buf[..msg.bytes]);
    }
    control
        .drain()
        .find_map(|m| match m {
            RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
            _ => None,
        })
        .context("no descriptor")
}

/// `fakenccl-rank` in the target dir.
pub fn rank_binary() -> anyhow::Result<PathBuf> {
    let p = crate::target_dir().join("fakenccl-rank");
    if !p.exists() {
        bail!(
            "{} is missing: run `cargo build --workspace` first (scripts/test.sh does)",
            p.display()
        );
    }
    Ok(p)
}

/// A finished fake rank.
pub struct RankRun {
    pub report: Report,
    /// What the plugin logged through the fake NCCL's logger (`fakenccl-log:` lines) and anything else.
    pub stderr: String,
}

/// Runs `fakenccl-rank` with `args` and the plugin env `env`, registering with `catcher`.
pub fn run_rank(catcher: &Catcher, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<RankRun> {
    let mut cmd = Command::new(rank_binary()?);
    cmd.args(args)
        .env("NCCLSCOPE_SOCKET", catcher.socket())
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().context("running fakenccl-rank")?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        bail!("fakenccl-rank {args:?} failed ({}):\n{stderr}", out.status);
    }
    let report = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("fakenccl-rank output; stderr:\n{stderr}"))?;
    Ok(RankRun { report, stderr })
}

/// Everything a segment holds, read without consuming.
pub struct Contents {
    /// The process that handed it over (SO_PEERCRED).
    pub pid: u32,
    pub claims: Claims,
    /// Whether the connection it came with has ended (the process that registered it exited).
    pub ended: bool,
    pub records: Vec<Record>,
    pub counters: BTreeMap<&'static str, u64>,
    pub closed: bool,
    pub capacity: u64,
}

impl Contents {
    pub fn counter(&self, c: Counter) -> u64 {
        self.counters[c.name()]
    }

    /// The interned strings, checking each is defined once.
    pub fn strings(&self) -> anyhow::Result<BTreeMap<StrId, String>> {
        let mut out = BTreeMap::new();
        for r in &self.records {
            if let Record::Str { id, len, bytes } = r {
                let text = String::from_utf8_lossy(&bytes[..*len as usize]).into_owned();
                if out.insert(*id, text).is_some() {
                    bail!("string {id:?} defined twice");
                }
            }
        }
        Ok(out)
    }
}

/// Everything `seg` holds, and whether `conn` (the connection it came with) has ended.
pub fn read_segment(seg: Segment, conn: &UnixStream) -> anyhow::Result<Contents> {
    let mut probe = [0u8; 16];
    let ended = matches!(
        rustix::net::recv(conn, &mut probe, RecvFlags::DONTWAIT),
        Ok((_, 0))
    );
    let cred = rustix::net::sockopt::socket_peercred(conn)?;
    let claims = seg.claims();
    let closed = seg.is_closed();
    let capacity = seg.capacity();
    let counters = Counter::ALL
        .iter()
        .map(|c| (c.name(), seg.counter(*c)))
        .collect();
    let records = all_records(seg)?;
    Ok(Contents {
        pid: cred.pid.as_raw_nonzero().get() as u32,
        claims,
        ended,
        records,
        counters,
        closed,
        capacity,
    })
}

/// Every record `seg` holds, in order, read without consuming.
pub fn all_records(seg: Segment) -> anyhow::Result<Vec<Record>> {
    let mut consumer = Consumer::new(seg);
    let mut raw = Vec::new();
    while consumer.read(4096, &mut raw)? > 0 {}
    raw.into_iter()
        .map(|(pos, r)| r.with_context(|| format!("record {pos}")))
        .collect()
}

/// A segment saved as bytes (tests/data, `segment-dump SOCKET N DIR`), back in a sealed memory file
/// as the plugin hands one over.
pub fn saved_segment(bytes: &[u8]) -> anyhow::Result<Segment> {
    let fd = rustix::fs::memfd_create("ncclscope", rustix::fs::MemfdFlags::ALLOW_SEALING)?;
    let mut at = 0;
    while at < bytes.len() {
        at += rustix::io::write(&fd, &bytes[at..])?;
    }
    rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS)?;
    Ok(Segment::open(fd)?)
}
