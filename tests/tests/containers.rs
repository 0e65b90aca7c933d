//! Ranks in containers (issue 21), against the real daemon binary and simulated ranks driving the real
//! plugin (`ncclscope sim-rank`): each rank runs in PID, IPC and mount namespaces of its own
//! (`unshare --pid --fork --mount-proc --ipc --mount`) with a private tmpfs on /dev/shm, so the only
//! thing it shares with the daemon is the socket directory. Every collective of every rank reaches
//! the daemon, per rank; nothing is left once a rank exits; a daemon killed mid-job and restarted (by
//! hand, or by a stand-in for systemd with socket activation and the file descriptor store) loses and
//! doubles nothing in the spool; the old names in /dev/shm are nothing the plugin or daemon looks at.
//!
//! Needs root (namespaces, mounts), as CI runs; skipped otherwise.

use std::collections::{BTreeMap, BTreeSet};
use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixDatagram, UnixListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ncclscope::storage::spool::SpoolReader;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use serde_json::Value;

/// One test at a time in this binary: the systemd stand-in makes descriptors inheritable for a moment,
/// and no other test's processes may inherit them.
static SERIAL: Mutex<()> = Mutex::new(());

/// Root (namespaces, mounts), and the lock that serialises these tests.
fn privileged() -> Option<std::sync::MutexGuard<'static, ()>> {
    if !rustix::process::getuid().is_root() {
        eprintln!("skipped: namespaces and mounts need root");
        return None;
    }
    Some(SERIAL.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A spooled instance: (pid, collective, seq, replay).
type Instance = (u32, String, u64, u32);

/// A daemon's directory: the socket directory every rank shares (`run/`), its state, spool and log.
struct Node {
    dir: tempfile::TempDir,
    prometheus: String,
    daemon: Option<Child>,
    ranks: Vec<Child>,
    /// The plugin the ranks load (default: the one this workspace built).
    plugin: Option<PathBuf>,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("run")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let d = dir.path().display();
        std::fs::write(
            dir.path().join("ncclscope.toml"),
            format!(
                "socket = \"{d}/run/ncclscope.sock\"\napi_socket = \"{d}/api.sock\"\n\
                 state_dir = \"{d}/state\"\n[spool]\ndir = \"{d}/spool\"\n\
                 [prometheus]\nlisten = \"127.0.0.1:{port}\"\n"
            ),
        )
        .unwrap();
        Node {
            dir,
            prometheus: format!("127.0.0.1:{port}"),
            daemon: None,
            ranks: Vec::new(),
            plugin: None,
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("run/ncclscope.sock")
    }

    fn daemon_command(&self) -> Command {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("daemon.log"))
            .unwrap();
        let mut cmd = Command::new(ncclscope_tests::daemon_binary());
        cmd.args(["daemon", "--config"])
            .arg(self.dir.path().join("ncclscope.toml"))
            .env("NCCLSCOPE_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log);
        cmd
    }

    /// Starts the daemon; returns once its API answers.
    fn start_daemon(&mut self, mut cmd: Command) {
        self.daemon = Some(cmd.spawn().unwrap());
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(self.dir.path().join("api.sock")).is_err() {
            assert!(
                Instant::now() < deadline,
                "daemon did not start: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn kill_daemon(&mut self) {
        let mut d = self.daemon.take().expect("a daemon");
        d.kill().unwrap();
        d.wait().unwrap();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// How long after the last start of the daemon it had attached `n` segments, from the
    /// timestamps of its log.
    fn attached_after_start(&self, n: usize) -> Duration {
        let at = |line: &str| -> Option<f64> {
            // Colour codes (ESC [ ... m) out, if the log has any.
            let mut parts = line.split('\x1b');
            let first = parts.next().unwrap_or_default();
            let plain: String = std::iter::once(first)
                .chain(parts.map(|p| p.split_once('m').map_or(p, |(_, r)| r)))
                .collect();
            let time = plain
                .split_whitespace()
                .next()?
                .split_once('T')?
                .1
                .strip_suffix('Z')?;
            let mut hms = time.split(':').map(|f| f.parse::<f64>().ok());
            Some(hms.next()?? * 3600.0 + hms.next()?? * 60.0 + hms.next()??)
        };
        // The log is read until it holds `n` attachments: the test may get here first.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            let start = lines
                .iter()
                .rposition(|l| l.contains("ncclscope daemon started"))
                .expect("a start in the log");
            let attached: Vec<f64> = lines[start..]
                .iter()
                .filter(|l| l.contains("segment attached"))
                .filter_map(|l| at(l))
                .collect();
            if attached.len() >= n {
                let started = at(lines[start]).expect("a timestamp on the start line");
                return Duration::from_secs_f64(attached[n - 1] - started);
            }
            assert!(
                Instant::now() < deadline,
                "{} of {n} segments attached since the start: {log}",
                attached.len()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts `nranks` simulated ranks of `job`, each in namespaces of its own with a private
    /// /dev/shm, sharing only the socket directory; they start their collectives at `epoch`
    /// (CLOCK_MONOTONIC ns) and run `seconds`.
    fn start_ranks(&mut self, job: &str, nranks: u32, epoch: u64, seconds: u64) {
        for rank in 0..nranks {
            let mut cmd = Command::new("unshare");
            cmd
                .args(["--pid", "--fork", "--mount-proc", "--ipc", "--mount", "sh", "-c"])
                // What the plugin left in this rank's /dev/shm, after it ran.
                .arg(r#"mount -t tmpfs none /dev/shm && "$@"; echo "shm entries: $(ls -A /dev/shm | wc -l)""#)
                .arg("sh")
                .arg(ncclscope_tests::daemon_binary())
                .arg("sim-rank")
                .args(["--rank", &rank.to_string(), "--nranks", &nranks.to_string()])
                .args(["--epoch-ns", &epoch.to_string(), "--seconds", &seconds.to_string()])
                .args(["--straggler", "0", "--straggler-delay-us", "1000"])
                .env("NCCLSCOPE_SOCKET", self.socket())
                .env("NCCLSCOPE_RING_MEMORY", "cpu")
                .env("NCCLSCOPE_JOB_ID", job)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if let Some(p) = &self.plugin {
                cmd.arg("--plugin").arg(p);
            }
            self.ranks.push(cmd.spawn().unwrap());
        }
    }

    /// Waits for the ranks; what each produced, checking that none left anything in its /dev/shm.
    fn wait_ranks(&mut self) -> Vec<(u64, String)> {
        self.ranks
            .drain(..)
            .map(|c| {
                let out = c.wait_with_output().unwrap();
                let (stdout, stderr) = (
                    String::from_utf8_lossy(&out.stdout).into_owned(),
                    String::from_utf8_lossy(&out.stderr).into_owned(),
                );
                assert!(out.status.success(), "rank failed: {stderr}");
                assert!(
                    stdout.contains("shm entries: 0"),
                    "the plugin left something in /dev/shm: {stdout}"
                );
                let produced = ncclscope::cli::sim_rank::parse_produced(&stdout)
                    .unwrap_or_else(|| panic!("no produced line: {stdout}"));
                (produced, stderr)
            })
            .collect()
    }

    /// While `n` ranks of `job` run: their pids as the daemon sees them, checked to be `n` distinct
    /// pids of the daemon's namespace (not each container's 1).
    fn live_pids(&self, job: &str, n: usize) -> BTreeSet<u64> {
        self.wait_metric("ncclscope_segments", n as f64, Duration::from_secs(20));
        let live = self.stats(job);
        let ranks = &live["jobs"][0]["communicators"][0]["ranks"];
        let pids: BTreeSet<u64> = ranks
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["pid"].as_u64().unwrap())
            .collect();
        assert_eq!(pids.len(), n, "processes told apart: {ranks}");
        assert!(
            !pids.contains(&1),
            "pids as the daemon's namespace sees them, not each container's 1: {pids:?}"
        );
        pids
    }

    /// Once the ranks end: the collectives each made, checked to be what the daemon counted for it.
    fn wait_counted_per_rank(&mut self, job: &str) -> Vec<u64> {
        let produced: Vec<u64> = self.wait_ranks().into_iter().map(|(n, _)| n).collect();
        assert!(produced.iter().all(|&n| n > 0), "{produced:?}");
        let v = self.wait_collectives(job, produced.iter().sum());
        let per_rank: Vec<u64> = v["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["collectives"].as_u64().unwrap())
            .collect();
        assert_eq!(per_rank, produced, "{}", v["ranks"]);
        produced
    }

    fn metric(&self, name: &str) -> Option<f64> {
        ncclscope_tests::sample(&ncclscope_tests::scrape_metrics(&self.prometheus), name)
    }

    /// Polls the daemon's Prometheus text until `name` is `want` (within `timeout`); how long it took.
    fn wait_metric(&self, name: &str, want: f64, timeout: Duration) -> Duration {
        let t0 = Instant::now();
        while self.metric(name) != Some(want) {
            assert!(
                t0.elapsed() < timeout,
                "{name} = {:?}, want {want}: {}",
                self.metric(name),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        t0.elapsed()
    }

    fn stats(&self, job: &str) -> Value {
        ncclscope_tests::json_of(
            Command::new(ncclscope_tests::daemon_binary())
                .args(["stats", "--json", "--job", job, "--api-socket"])
                .arg(self.dir.path().join("api.sock")),
        )
    }

    /// Waits until the daemon counted `total` collectives of `job`.
    fn wait_collectives(&self, job: &str, total: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let v = self.stats(job);
            if v["jobs"][0]["collectives"].as_u64() == Some(total) {
                return v;
            }
            assert!(Instant::now() < deadline, "{v}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until the spool holds `total` instances of `job` (the spool spans daemon runs; the
    /// statistics count what each run recorded).
    fn wait_spooled(&self, job: &str, total: u64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while (self.spooled(job).0.len() as u64) < total {
            assert!(Instant::now() < deadline, "{}", self.log());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// (pid, collective, seq, replay) of every instance of `job` in the spool, checking none is there
    /// twice; and how many there are per pid.
    fn spooled(&self, job: &str) -> (BTreeSet<Instance>, BTreeMap<u32, u64>) {
        let key = (rustix::process::getuid().as_raw(), job.to_string());
        let mut set = BTreeSet::new();
        let mut per_pid = BTreeMap::new();
        for c in SpoolReader::open_dir(self.dir.path().join("spool"))
            .unwrap()
            .read_job(&key)
        {
            let c = c.unwrap();
            *per_pid.entry(c.pid).or_default() += 1;
            assert!(
                set.insert((c.pid, c.func.clone(), c.seq, c.replay)),
                "spooled twice: pid {} {} seq {} replay {}",
                c.pid,
                c.func,
                c.seq,
                c.replay
            );
        }
        (set, per_pid)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for c in self.ranks.iter_mut().chain(self.daemon.as_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn epoch_in(after: Duration) -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64 + after.as_nanos() as u64
}

#[test]
fn ranks_in_their_own_namespaces_are_ingested_per_rank_and_leave_nothing_behind() {
    let Some(_serial) = privileged() else { return };
    const JOB: &str = "container-job";
    let mut node = Node::new();
    node.start_daemon(node.daemon_command());
    node.start_ranks(JOB, 3, epoch_in(Duration::from_millis(500)), 3);
    // While they run: every rank's segment attached, each under its pid as the daemon sees it.
    let pids = node.live_pids(JOB, 3);
    let produced = node.wait_counted_per_rank(JOB);
    let total: u64 = produced.iter().sum();
    assert!(produced.iter().all(|&n| n == produced[0]), "{produced:?}");
    // The segments are gone with their processes: drained, then dropped.
    node.wait_metric("ncclscope_segments", 0.0, Duration::from_secs(20));
    let (spooled, per_pid) = node.spooled(JOB);
    assert_eq!(spooled.len() as u64, total);
    assert_eq!(
        per_pid
            .keys()
            .copied()
            .map(u64::from)
            .collect::<BTreeSet<_>>(),
        pids
    );
    assert_eq!(
        std::fs::read_dir(node.dir.path().join("state"))
            .unwrap()
            .count(),
        0,
        "no resume state left"
    );
    eprintln!(
        "containers: 3 ranks x {} collectives, all ingested per rank; no segment, no state left",
        produced[0]
    );
}

#[test]
fn a_daemon_killed_mid_job_and_restarted_by_hand_loses_and_doubles_nothing() {
    let Some(_serial) = privileged() else { return };
    const JOB: &str = "restart-job";
    let mut node = Node::new();
    // The ranks start before any daemon exists, and write into their rings meanwhile.
    node.start_ranks(JOB, 3, epoch_in(Duration::from_millis(300)), 6);
    std::thread::sleep(Duration::from_millis(1500));
    let started = Instant::now();
    node.start_daemon(node.daemon_command());
    node.wait_metric("ncclscope_segments", 3.0, Duration::from_secs(20));
    let found = node.attached_after_start(3);
    let listening = started.elapsed();
    std::thread::sleep(Duration::from_millis(1500));
    let before_kill = node.stats(JOB)["jobs"][0]["collectives"]
        .as_u64()
        .unwrap_or(0);
    node.kill_daemon();
    std::thread::sleep(Duration::from_millis(500));
    let restarted = Instant::now();
    node.start_daemon(node.daemon_command());
    node.wait_metric("ncclscope_segments", 3.0, Duration::from_secs(20));
    let relistening = restarted.elapsed();
    let reconnect = node.attached_after_start(3);
    let ranks = node.wait_ranks();
    for (_, stderr) in &ranks {
        assert!(
            stderr.contains("segment registered again"),
            "each rank handed its segment to the new daemon: {stderr}"
        );
    }
    let total: u64 = ranks.iter().map(|(n, _)| n).sum();
    // The spool of both daemons together: every instance once, none twice.
    node.wait_spooled(JOB, total);
    let (spooled, _) = node.spooled(JOB);
    assert_eq!(spooled.len() as u64, total, "nothing lost, nothing doubled");
    node.wait_metric("ncclscope_segments", 0.0, Duration::from_secs(20));
    eprintln!(
        "restart by hand: the first daemon had the 3 ranks (started before it) {found:?} after it started \
         (its metrics showed them {listening:?} after the start began); \
         {before_kill} instances counted before SIGKILL; after the restart all 3 segments were back {reconnect:?} after the new daemon started \
         (its metrics showed them {relistening:?} after the restart began); \
         spool: {} of {total} instances, each once",
        spooled.len()
    );
}

/// What a stand-in for systemd keeps for the daemon: the descriptors it stored, by name, as systemd's
/// file descriptor store does (a stored socket that hung up is dropped, as systemd drops it).
#[derive(Default)]
struct FdStore {
    fds: Vec<(String, OwnedFd)>,
    watchdog_pings: u32,
    ready: u32,
}

/// Receives the daemon's notifications on `socket` until the test ends.
fn serve_notifications(socket: UnixDatagram, store: Arc<Mutex<FdStore>>) {
    std::thread::spawn(move || {
        loop {
            let mut buf = [0u8; 512];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let Ok(msg) = rustix::net::recvmsg(
                &socket,
                &mut [IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) else {
                return;
            };
            let fds: Vec<OwnedFd> = control
                .drain()
                .flat_map(|m| match m {
                    RecvAncillaryMessage::ScmRights(fds) => fds.collect(),
                    _ => Vec::new(),
                })
                .collect();
            let text = String::from_utf8_lossy(&buf[..msg.bytes]).into_owned();
            let fields: BTreeMap<&str, &str> =
                text.lines().filter_map(|l| l.split_once('=')).collect();
            let mut store = store.lock().unwrap();
            let name = fields
                .get("FDNAME")
                .copied()
                .unwrap_or("stored")
                .to_string();
            if fields.get("FDSTORE") == Some(&"1") {
                store
                    .fds
                    .extend(fds.into_iter().map(|fd| (name.clone(), fd)));
            } else if fields.get("FDSTOREREMOVE") == Some(&"1") {
                store.fds.retain(|(n, _)| *n != name);
            }
            store.watchdog_pings += u32::from(fields.get("WATCHDOG") == Some(&"1"));
            store.ready += u32::from(fields.get("READY") == Some(&"1"));
        }
    });
}

/// Starts the daemon as systemd does: the registration socket and the stored descriptors at 3, 4, ...
/// with their names, `$LISTEN_PID` its own, a notification socket, a file descriptor store and a
/// watchdog. Copies of the descriptors are made inheritable and moved into place by the shell that
/// becomes the daemon, then closed here.
fn start_activated(
    node: &mut Node,
    listener: &UnixListener,
    store: &Mutex<FdStore>,
    notify: &Path,
) {
    let mut passed = vec![(
        "registration".to_string(),
        listener.as_fd().try_clone_to_owned().unwrap(),
    )];
    for (name, fd) in &store.lock().unwrap().fds {
        // What systemd would still hold: not a connection whose other end has gone.
        let mut probe = [0u8; 1];
        let socket = rustix::fs::fstat(fd).is_ok_and(|st| {
            rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Socket
        });
        let hung_up = socket
            && matches!(
                rustix::net::recv(fd, &mut probe, RecvFlags::DONTWAIT | RecvFlags::PEEK),
                Ok((_, 0))
            );
        if !hung_up {
            passed.push((name.clone(), fd.try_clone().unwrap()));
        }
    }
    let mut moves = String::new();
    for (i, (_, fd)) in passed.iter().enumerate() {
        rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty()).unwrap();
        // Above any number being moved into place, then onto 3 + i.
        moves += &format!("exec {}<&{}; ", 100 + i, fd.as_raw_fd());
    }
    for i in 0..passed.len() {
        moves += &format!("exec {}<&{}; exec {}<&-; ", 3 + i, 100 + i, 100 + i);
    }
    let names: Vec<&str> = passed.iter().map(|(n, _)| n.as_str()).collect();
    let daemon = node.daemon_command();
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(format!(
            "{moves}export LISTEN_PID=$$ WATCHDOG_PID=$$; exec \"$0\" \"$@\""
        ))
        .arg(daemon.get_program())
        .args(daemon.get_args())
        .env("LISTEN_FDS", passed.len().to_string())
        .env("LISTEN_FDNAMES", names.join(":"))
        .env("NOTIFY_SOCKET", notify)
        .env("FDSTORE", "4096")
        .env("WATCHDOG_USEC", "200000")
        .env("NCCLSCOPE_LOG", "info")
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(node.dir.path().join("daemon.log"))
                .unwrap(),
        );
    node.start_daemon(cmd);
}

#[test]
fn under_systemd_a_restarted_daemon_resumes_every_segment_from_the_store_without_reconnects() {
    let Some(_serial) = privileged() else { return };
    const JOB: &str = "systemd-job";
    const SHORT: &str = "short-job";
    let mut node = Node::new();
    // systemd's side: the socket unit's listener, the notification socket, the store.
    let listener = UnixListener::bind(node.socket()).unwrap();
    let notify = node.dir.path().join("notify");
    let store = Arc::new(Mutex::new(FdStore::default()));
    serve_notifications(UnixDatagram::bind(&notify).unwrap(), store.clone());
    start_activated(&mut node, &listener, &store, &notify);
    node.start_ranks(JOB, 3, epoch_in(Duration::from_millis(300)), 10);
    node.wait_metric("ncclscope_segments", 3.0, Duration::from_secs(20));
    // One more rank, of a short job that ends while no daemon runs.
    let ranks = std::mem::take(&mut node.ranks);
    node.start_ranks(SHORT, 1, epoch_in(Duration::from_millis(200)), 3);
    let short = node.ranks.pop().unwrap();
    node.ranks = ranks;
    node.wait_metric("ncclscope_segments", 4.0, Duration::from_secs(20));
    assert!(store.lock().unwrap().ready >= 1, "READY=1");
    let pings = store.lock().unwrap().watchdog_pings;
    assert!(pings >= 2, "watchdog pinged every WatchdogSec/2: {pings}");
    let stored: Vec<String> = store
        .lock()
        .unwrap()
        .fds
        .iter()
        .map(|(n, _)| n.clone())
        .collect();
    assert_eq!(
        stored.len(),
        8,
        "each segment and its connection stored: {stored:?}\n{}",
        node.log()
    );
    node.kill_daemon();
    // The short job ends while no daemon runs: its connection hangs up, its segment stays stored.
    let out = short.wait_with_output().unwrap();
    assert!(out.status.success());
    let short_produced =
        ncclscope::cli::sim_rank::parse_produced(&String::from_utf8_lossy(&out.stdout)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let restarted = Instant::now();
    start_activated(&mut node, &listener, &store, &notify);
    node.wait_spooled(SHORT, short_produced);
    let short_done = restarted.elapsed();
    let back = node.attached_after_start(4);
    let ranks = node.wait_ranks();
    for (_, stderr) in &ranks {
        assert!(
            !stderr.contains("segment registered again"),
            "the connection outlived the daemon in the store: no rank had to hand its segment over again: {stderr}"
        );
    }
    let total: u64 = ranks.iter().map(|(n, _)| n).sum();
    node.wait_spooled(JOB, total);
    let (spooled, _) = node.spooled(JOB);
    assert_eq!(spooled.len() as u64, total, "nothing lost, nothing doubled");
    assert_eq!(node.spooled(SHORT).0.len() as u64, short_produced);
    // Drained and dropped: the store is empty again.
    node.wait_metric("ncclscope_segments", 0.0, Duration::from_secs(20));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !store.lock().unwrap().fds.is_empty() {
        assert!(Instant::now() < deadline, "segments left in the store");
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "systemd: the restarted daemon had all 4 stored segments {back:?} after it started; the short job that ended while no daemon ran \
         was complete {short_done:?} after the restart ({short_produced} instances); 3 running ranks: {} of {total} \
         instances spooled once each, no reconnect",
        spooled.len()
    );
}

#[test]
fn names_in_dev_shm_are_nothing_the_plugin_or_the_daemon_looks_at() {
    let Some(_serial) = privileged() else { return };
    const JOB: &str = "squat-job";
    let mut node = Node::new();
    // What an attacker could plant under the old names: a file squatting every segment name of the
    // next pids, and a symlink to a file the daemon must never open.
    let target = node.dir.path().join("precious");
    std::fs::write(&target, b"do not touch").unwrap();
    let uid = rustix::process::getuid().as_raw();
    let next = std::process::id();
    let mut planted = Vec::new();
    for pid in next..next + 200 {
        let squat = PathBuf::from(format!("/dev/shm/ncclscope.{uid}.{pid}.0"));
        if std::fs::write(&squat, b"").is_ok() {
            planted.push(squat);
        }
    }
    let link = PathBuf::from(format!("/dev/shm/ncclscope.{uid}.1.1"));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&target, &link).unwrap();
    planted.push(link.clone());
    let _cleanup = Planted(planted.clone());
    node.start_daemon(node.daemon_command());
    // Ranks that share the host's /dev/shm this time.
    for rank in 0..2 {
        let child = Command::new(ncclscope_tests::daemon_binary())
            .arg("sim-rank")
            .args(["--rank", &rank.to_string(), "--nranks", "2"])
            .args([
                "--epoch-ns",
                &epoch_in(Duration::from_millis(300)).to_string(),
            ])
            .args(["--seconds", "2", "--straggler", "0"])
            .env("NCCLSCOPE_SOCKET", node.socket())
            .env("NCCLSCOPE_RING_MEMORY", "cpu")
            .env("NCCLSCOPE_JOB_ID", JOB)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        node.ranks.push(child);
    }
    node.wait_metric("ncclscope_segments", 2.0, Duration::from_secs(20));
    // The daemon holds the segments as memory files, nothing under /dev/shm.
    let pid = node.daemon.as_ref().unwrap().id();
    let open: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    assert!(open.iter().all(|p| !p.starts_with("/dev/shm")), "{open:?}");
    assert_eq!(
        open.iter()
            .filter(|p| p.starts_with("/memfd:ncclscope"))
            .count(),
        2,
        "{open:?}"
    );
    let mut total = 0;
    for c in node.ranks.drain(..) {
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        total += ncclscope::cli::sim_rank::parse_produced(&String::from_utf8_lossy(&out.stdout))
            .unwrap();
    }
    node.wait_collectives(JOB, total);
    // Nothing planted was touched, followed or removed.
    assert_eq!(std::fs::read(&target).unwrap(), b"do not touch");
    assert_eq!(std::fs::read_link(&link).unwrap(), target);
    assert!(planted.iter().all(|p| std::fs::symlink_metadata(p).is_ok()));
    eprintln!(
        "squatting: {} names planted in /dev/shm; both ranks ingested ({total} instances); none touched",
        planted.len()
    );
}

/// Removes what the squatting test planted, however it ends.
struct Planted(Vec<PathBuf>);

impl Drop for Planted {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The daemon's image (scripts/build-image.sh), named by NCCLSCOPE_TEST_IMAGE, which scripts/test.sh
/// sets once podman built it; the test is skipped, and says so, without it.
fn image() -> Option<String> {
    let image = std::env::var("NCCLSCOPE_TEST_IMAGE").ok();
    if image.is_none() {
        eprintln!(
            "skipped: NCCLSCOPE_TEST_IMAGE unset (scripts/test.sh builds the image with podman and sets it)"
        );
    }
    image
}

fn podman(args: &[&str]) -> String {
    let out = Command::new("podman").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "podman {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A running container, removed when the test ends however it ends (killing `podman run` leaves it).
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("podman")
            .args(["rm", "--force", "--time", "0", &self.0])
            .output();
    }
}

#[test]
fn the_image_run_as_the_daemonset_runs_it_serves_ranks_in_their_own_namespaces() {
    let Some(_serial) = privileged() else { return };
    let Some(image) = image() else { return };
    const JOB: &str = "image-job";
    let mut node = Node::new();
    let d = node.dir.path().to_str().unwrap().to_string();
    // The init container's work: the image's plugin, copied to a host directory the job mounts.
    std::fs::create_dir(node.dir.path().join("plugin")).unwrap();
    let lib = format!(
        "/usr/lib/{}-linux-gnu/libnccl-profiler-ncclscope.so",
        std::env::consts::ARCH
    );
    podman(&[
        "run",
        "--rm",
        "--read-only",
        "--cap-drop",
        "ALL",
        "--volume",
        &format!("{d}/plugin:/host-plugin"),
        "--entrypoint",
        "cp",
        &image,
        &lib,
        "/host-plugin/",
    ]);
    node.plugin = Some(node.dir.path().join("plugin/libnccl-profiler-ncclscope.so"));
    // The fake NCCL host loads its stand-in libnccl from the plugin's folder (a job brings its own).
    let target = ncclscope_tests::daemon_binary();
    let stand_in = "libfakenccl_nccl_rfc.so";
    std::fs::copy(
        target.with_file_name(stand_in),
        node.dir.path().join("plugin").join(stand_in),
    )
    .unwrap();
    // The daemon as the DaemonSet runs it: the host's PID namespace and network, a read-only root
    // without capabilities, only the node directories mounted (here one, at the same path).
    let name = format!("ncclscope-test-{}", std::process::id());
    let _container = Container(name.clone());
    let mut cmd = Command::new("podman");
    cmd.args([
        "run",
        "--rm",
        "--name",
        &name,
        "--pid",
        "host",
        "--network",
        "host",
    ])
    .args([
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
    ])
    .args([
        "--volume",
        &format!("{d}:{d}"),
        "--env",
        "NCCLSCOPE_LOG=info",
        &image,
    ])
    .args(["daemon", "--config", &format!("{d}/ncclscope.toml")])
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(node.dir.path().join("daemon.log")).unwrap());
    node.start_daemon(cmd);
    node.start_ranks(JOB, 2, epoch_in(Duration::from_millis(500)), 3);
    node.live_pids(JOB, 2);
    let produced = node.wait_counted_per_rank(JOB);
    let total: u64 = produced.iter().sum();
    node.wait_metric("ncclscope_segments", 0.0, Duration::from_secs(20));
    assert_eq!(node.spooled(JOB).0.len() as u64, total);
    // `podman stop` (SIGTERM, as the kubelet sends) ends the daemon cleanly.
    podman(&["stop", "--time", "20", &name]);
    let status = node.daemon.take().unwrap().wait().unwrap();
    assert!(status.success(), "{status}: {}", node.log());
    eprintln!(
        "image {image}: 2 ranks x {} collectives through its plugin, all ingested by its daemon",
        produced[0]
    );
}
