//! What the daemon's end-to-end tests share, so that a test reads as its scenario: the synthetic rank
//! processes (this test binary re-run as an ignored test: `support::daemon_rank_child` and the
//! others, started with [`child_test`]); [`Scenario`], which configures and starts the real daemon
//! binary with a real OTLP receiver into a [`Harness`] (which starts ranks, kills and restarts the
//! daemon, reads its metrics and spool); [`FakeRanks`], the real plugin in fake-NCCL rank processes;
//! [`Drained`], a collector drained while the test blocks; and the waits and checks on spans and
//! metrics. What every test binary shares (the daemon binary, scraping /metrics) is `ncclscope_tests`.

pub(crate) use fake_opentelemetry_collector::{ExportedSpan, FakeCollectorServer};
pub(crate) use ncclscope_fakenccl::process::Registrant;
pub(crate) use ncclscope_proto::segment::{self, Claims, Counter, Producer, Segment};
pub(crate) use ncclscope_proto::{Record, StrId, TimingPath, fixture};
pub(crate) use ncclscope_tests::{attr, sample};
pub(crate) use std::collections::{BTreeMap, BTreeSet, HashMap};
pub(crate) use std::path::{Path, PathBuf};
pub(crate) use std::process::{Child, Command, Stdio};
pub(crate) use std::sync::Arc;
pub(crate) use std::sync::atomic::{AtomicBool, Ordering};
pub(crate) use std::time::{Duration, Instant};

pub(crate) const RANK_ENV: &str = "NCCLSCOPE_TEST_DAEMON_RANK";

pub(crate) const COMM_HASH: u64 = 0x5eed_0000_0000_cafe;

pub(crate) const CHANNELS: u64 = 2;

pub(crate) const GPU_BASE: u64 = 1_000_000_000;

pub(crate) const HOST_BASE: i64 = 1_790_000_000_000_000_000;

pub(crate) const JOB: &str = "e2e-job";

/// Host = GPU + offset: each rank's device gets its own offset, as real devices would.
pub(crate) fn offset(rank: u32) -> i64 {
    HOST_BASE - GPU_BASE as i64 + rank as i64 * 1_000
}

pub(crate) fn gpu_times(rank: u32, seq: u64, ch: u64) -> (u64, u64) {
    let start = GPU_BASE + seq * 100_000 + rank as u64 * 700 + ch * 50;
    (start, start + 20_000 + seq * 3 + ch * 11 + rank as u64)
}

pub(crate) fn records_per_rank(ncolls: u64) -> u64 {
    // 4 strings, calibration, comm, per collective start + channels + stop, comm end.
    4 + 1 + 1 + ncolls * (2 + CHANNELS) + 1
}

/// What a synthetic rank writes before its collectives, as the plugin does: the strings they name,
/// its device's calibration and its communicator.
pub(crate) fn announce(p: &mut Producer, rank: u32, nranks: u32) {
    for (id, text) in [
        (1, "AllReduce"),
        (2, "ncclFloat32"),
        (3, "RING"),
        (4, "SIMPLE"),
    ] {
        assert!(p.push(&Record::str(StrId(id), text.as_bytes())));
    }
    assert!(p.push(&fixture::calibration(rank as i32, offset(rank), 100 + rank)));
    let comm = fixture::Comm {
        comm_hash: COMM_HASH,
        rank,
        nranks,
        cuda_dev: rank as i32,
        nccl_version: 22809,
        host_ns: ncclscope_proto::now_ns(),
        ..fixture::Comm::default()
    };
    assert!(p.push(&comm.record()));
}

/// Collective `seq` of a synthetic rank on `channels` channels as the plugin writes it: its start,
/// one KernelCh per channel, its stop. Enqueued 1 us before its kernel starts, on the calibration's
/// (synthetic) host clock: the daemon does not use kernel times that fall before their enqueue.
pub(crate) fn collective(rank: u32, seq: u64, channels: u64) -> (Record, Vec<Record>, Record) {
    let host_ns = (gpu_times(rank, seq, 0).0 as i64 + offset(rank)) as u64 - 1_000;
    let coll = fixture::Coll {
        id: seq + 1,
        seq,
        count: 1 << 18,
        n_channels: channels as u8,
        host_ns,
        ..fixture::Coll::default()
    };
    let kernels = (0..channels)
        .map(|ch| coll.kernel(ch as u8, gpu_times(rank, seq, ch), host_ns))
        .collect();
    (coll.start(), kernels, coll.stop(host_ns))
}

/// What a synthetic rank writes at the end, as the plugin's finalize does: its communicator's end;
/// then it closes its segment.
pub(crate) fn finalize(p: &mut Producer) {
    p.push(&Record::CommEnd {
        comm: 0,
        host_ns: ncclscope_proto::now_ns(),
    });
    p.segment().close();
}

/// The rank process, run by the tests below through `RANK_ENV` = "socket|rank|nranks|ncolls|pace_us".
/// Like the plugin, it hands its segment over again whenever the daemon goes away.
#[test]
#[ignore = "child process of the daemon end-to-end tests"]
pub(crate) fn daemon_rank_child() {
    let spec = std::env::var(RANK_ENV).expect("run by the daemon e2e tests");
    let f: Vec<&str> = spec.split('|').collect();
    let socket = Path::new(f[0]);
    let rank: u32 = f[1].parse().unwrap();
    let nranks: u32 = f[2].parse().unwrap();
    let ncolls: u64 = f[3].parse().unwrap();
    let pace = Duration::from_micros(f[4].parse().unwrap());
    let claims = Claims {
        hostname: "testhost".into(),
        job_id: JOB.into(),
        slurm_job_id: String::new(),
    };
    let mut p = Producer::new(Segment::create(&claims, 1 << 14).unwrap());
    let _registered = Registrant::start(socket, p.segment(), Duration::from_secs(30));
    // A loss the plugin would have counted: it must reach the daemon's loss metrics.
    p.segment().count(Counter::QueueFull, rank as u64 + 1);
    announce(&mut p, rank, nranks);
    // Communicator init is collective in NCCL: no rank runs a collective before every rank is in.
    let barrier = socket.with_file_name(format!("ready.{rank}"));
    std::fs::write(&barrier, b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while (0..nranks).any(|r| !socket.with_file_name(format!("ready.{r}")).exists()) {
        assert!(Instant::now() < deadline, "other ranks never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    for seq in 0..ncolls {
        let (start, kernels, stop) = collective(rank, seq, CHANNELS);
        for r in std::iter::once(&start).chain(&kernels).chain([&stop]) {
            p.push(r);
        }
        if !pace.is_zero() {
            std::thread::sleep(pace);
        }
    }
    finalize(&mut p);
    assert_eq!(
        p.segment().counter(Counter::RingFull),
        0,
        "the ring was sized for the whole run"
    );
}

pub(crate) const BURST_ENV: &str = "NCCLSCOPE_TEST_BURST";

/// A process that writes a recorded segment's records into its own small live segment at a pace,
/// as the plugin forwards a burst of graph replays, run by the test below through `BURST_ENV` =
/// "socket|recorded segment file|capacity|records per millisecond". Where the ring is full it waits
/// for room, up to 5 s since the daemon's tail last moved (half the operation timeout), and then
/// drops (`ring_full`): a daemon slowed by a loaded machine costs time, a tail held on an open
/// operation costs records.
#[test]
#[ignore = "child process of the daemon end-to-end tests"]
pub(crate) fn recorded_burst_child() {
    let spec = std::env::var(BURST_ENV).expect("run by the daemon e2e tests");
    let f: Vec<&str> = spec.split('|').collect();
    let socket = Path::new(f[0]);
    let capacity: u64 = f[2].parse().unwrap();
    let per_ms: usize = f[3].parse().unwrap();
    let mut consumer = segment::Consumer::new(sealed_copy(Path::new(f[1])));
    let mut records = Vec::new();
    while consumer.read(4096, &mut records).unwrap() > 0 {}
    let claims = Claims {
        hostname: "testhost".into(),
        job_id: consumer.segment().claims().job_id,
        slurm_job_id: String::new(),
    };
    let mut p = Producer::new(Segment::create(&claims, capacity).unwrap());
    let _registered = Registrant::start(socket, p.segment(), Duration::from_secs(30));
    let full = |p: &Producer| p.segment().head() - p.segment().tail() >= capacity;
    for chunk in records.chunks(per_ms) {
        let started = Instant::now();
        for (_, r) in chunk {
            let (mut tail, mut moved) = (p.segment().tail(), Instant::now());
            while full(&p) && moved.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(1));
                if p.segment().tail() != tail {
                    (tail, moved) = (p.segment().tail(), Instant::now());
                }
            }
            p.push(r.as_ref().unwrap());
        }
        std::thread::sleep(Duration::from_millis(1).saturating_sub(started.elapsed()));
    }
    p.segment().close();
}

pub(crate) const LOSSY_ENV: &str = "NCCLSCOPE_TEST_LOSSY";

/// A rank on the stock KernelCh path that loses records as the plugin can (a full queue), run
/// through `LOSSY_ENV` = "socket|ring capacity|collectives|burst|pause_us|drops[|pace]": collectives
/// of 4 channels (6 records each) written `burst` at a time, `pause_us` apart; `drops` =
/// `start:N,kernel:N,stop:N`: collective N's CollStart, its channel 1 KernelCh, its OpStop are not
/// written and, as the plugin does, counted as `queue_full`. With `pace` > 0, before each burst it
/// waits until the daemon has left at most `pace` records unread-or-uncommitted in the ring, so a
/// daemon slowed by a loaded machine costs time, not records. Prints `ring_full <n>` and
/// `max_wait_ms <n>` (the longest of those waits) at the end.
/// Also run by hand against any daemon (docs/reliability.md, issue 16).
#[test]
#[ignore = "child process of the daemon end-to-end tests"]
pub(crate) fn lossy_rank_child() {
    const CH: u64 = 4;
    let spec = std::env::var(LOSSY_ENV).expect("run by the daemon e2e tests");
    let f: Vec<&str> = spec.split('|').collect();
    let socket = Path::new(f[0]);
    let capacity: u64 = f[1].parse().unwrap();
    let ncolls: u64 = f[2].parse().unwrap();
    let burst: u64 = f[3].parse().unwrap();
    let pause = Duration::from_micros(f[4].parse().unwrap());
    let drops: Vec<(&str, u64)> = (f[5].split(',').filter(|d| !d.is_empty()))
        .map(|d| {
            let (kind, n) = d.split_once(':').expect("kind:N");
            (kind, n.parse().unwrap())
        })
        .collect();
    let dropped = |kind: &str, seq: u64| drops.contains(&(kind, seq));
    let pace: u64 = f.get(6).map_or(0, |p| p.parse().unwrap());
    let mut max_wait = Duration::ZERO;
    let claims = Claims {
        hostname: "testhost".into(),
        job_id: JOB.into(),
        slurm_job_id: String::new(),
    };
    let mut p = Producer::new(Segment::create(&claims, capacity).unwrap());
    let _registered = Registrant::start(socket, p.segment(), Duration::from_secs(30));
    announce(&mut p, 0, 1);
    let lose = |p: &mut Producer| p.segment().count(Counter::QueueFull, 1);
    for seq in 0..ncolls {
        if pace > 0 && seq % burst == 0 {
            let waiting = Instant::now();
            while p.segment().head() - p.segment().tail() > pace
                && waiting.elapsed() < Duration::from_secs(60)
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            max_wait = max_wait.max(waiting.elapsed());
        }
        let (start, kernels, stop) = collective(0, seq, CH);
        match dropped("start", seq) {
            true => lose(&mut p),
            false => _ = p.push(&start),
        }
        for (ch, k) in kernels.iter().enumerate() {
            match ch == 1 && dropped("kernel", seq) {
                true => lose(&mut p),
                false => _ = p.push(k),
            }
        }
        match dropped("stop", seq) {
            true => lose(&mut p),
            false => _ = p.push(&stop),
        }
        if (seq + 1) % burst == 0 {
            std::thread::sleep(pause);
        }
    }
    finalize(&mut p);
    println!("ring_full {}", p.segment().counter(Counter::RingFull));
    println!("max_wait_ms {}", max_wait.as_millis());
}

/// A recorded segment file in a sealed memory file, as the plugin would have made it.
pub(crate) fn sealed_copy(path: &Path) -> Segment {
    let fd = sealed_memfd(&std::fs::read(path).unwrap());
    Segment::open(fd).unwrap()
}

pub(crate) fn sealed_memfd(bytes: &[u8]) -> std::os::fd::OwnedFd {
    let fd = rustix::fs::memfd_create("ncclscope", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::io::write(&fd, bytes).unwrap();
    rustix::fs::fcntl_add_seals(&fd, ncclscope_proto::segment::REQUIRED_SEALS).unwrap();
    fd
}

/// A daemon, its rank processes and their segments, all cleaned up on drop (even on failure). Made
/// by a [`Scenario`].
pub(crate) struct Harness {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) config: PathBuf,
    pub(crate) prometheus: String,
    /// Given on the command line (`--otlp-endpoint`), as an operator pointing at a collector would.
    pub(crate) otlp_endpoint: String,
    pub(crate) daemon: Option<Child>,
    pub(crate) ranks: Vec<Child>,
}

/// The daemon a test runs against, configured before it starts: its sockets, spool and state in a
/// directory of its own, spans batched within 50 ms, Prometheus with job series on a free port, and
/// what the test adds (`Scenario::new().otlp("sample_ratio = 0.0").start_with_collector()`).
#[derive(Default)]
pub(crate) struct Scenario {
    otlp: String,
    tables: String,
}

impl Scenario {
    pub(crate) fn new() -> Scenario {
        Scenario::default()
    }

    /// A key of the `[otlp]` table, beside the harness's own (`"max_attempts = 2"`).
    pub(crate) fn otlp(mut self, key_value: &str) -> Scenario {
        self.otlp += key_value;
        self.otlp.push('\n');
        self
    }

    /// Tables the harness does not write (`"[aggregate]\nskew_window_ms = 1000\n"`).
    pub(crate) fn config(mut self, tables: &str) -> Scenario {
        self.tables += tables;
        if !self.tables.ends_with('\n') {
            self.tables.push('\n');
        }
        self
    }

    /// The harness, its daemon not started yet, exporting to `otlp_endpoint` once it is.
    pub(crate) fn harness(self, otlp_endpoint: &str) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let prometheus = format!("127.0.0.1:{}", ncclscope_tests::free_port("127.0.0.1"));
        let config = dir.path().join("ncclscope.toml");
        let d = dir.path().display();
        std::fs::write(
            &config,
            format!(
                "socket = \"{d}/ncclscope.sock\"\napi_socket = \"{d}/api.sock\"\n\
                 state_dir = \"{d}/state\"\n[spool]\ndir = \"{d}/spool\"\n[otlp]\n{}\
                 batch_timeout_ms = 50\nmetrics_interval_ms = 500\n[prometheus]\nlisten = \"{prometheus}\"\njob_series = true\n{}",
                self.otlp, self.tables
            ),
        )
        .unwrap();
        Harness {
            dir,
            config,
            prometheus,
            otlp_endpoint: otlp_endpoint.to_string(),
            daemon: None,
            ranks: Vec::new(),
        }
    }

    /// The daemon started (listening), exporting to `otlp_endpoint` ("" for nowhere).
    pub(crate) fn start(self, otlp_endpoint: &str) -> Harness {
        let mut h = self.harness(otlp_endpoint);
        h.start_daemon();
        h
    }

    /// The daemon started, exporting to a fake collector of its own.
    pub(crate) async fn start_with_collector(self) -> (Harness, FakeCollectorServer) {
        let collector = FakeCollectorServer::start().await.unwrap();
        (self.start(&collector.endpoint()), collector)
    }
}

impl Harness {
    pub(crate) fn socket(&self) -> PathBuf {
        self.dir.path().join("ncclscope.sock")
    }

    pub(crate) fn start_daemon(&mut self) {
        let child = Command::new(ncclscope_tests::daemon_binary())
            .args(["daemon", "--config"])
            .arg(&self.config)
            .args(["--otlp-endpoint", &self.otlp_endpoint])
            .env("NCCLSCOPE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        self.daemon = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(self.socket()).is_err() {
            assert!(Instant::now() < deadline, "daemon did not start listening");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn signal_daemon(&mut self, sig: rustix::process::Signal) -> Child {
        let child = self.daemon.take().expect("daemon running");
        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        rustix::process::kill_process(pid, sig).unwrap();
        child
    }

    /// SIGKILLs the daemon, without warning, and reaps it.
    pub(crate) fn kill_daemon(&mut self) {
        let mut killed = self.signal_daemon(rustix::process::Signal::KILL);
        killed.wait().unwrap();
    }

    /// SIGTERMs the daemon, which must drain, flush and exit 0 within 20 s.
    pub(crate) fn stop_daemon(&mut self) {
        let mut daemon = self.signal_daemon(rustix::process::Signal::TERM);
        let status = wait_timeout(&mut daemon, Duration::from_secs(20));
        assert!(
            status.is_some_and(|s| s.success()),
            "daemon exits 0 on SIGTERM"
        );
    }

    /// `nranks` synthetic ranks (`daemon_rank_child`), each writing `ncolls` collectives `pace_us`
    /// apart.
    pub(crate) fn start_ranks(&mut self, nranks: u32, ncolls: u64, pace_us: u64) {
        for rank in 0..nranks {
            let spec = format!(
                "{}|{rank}|{nranks}|{ncolls}|{pace_us}",
                self.socket().display()
            );
            let child = child_test("daemon_rank_child", RANK_ENV, &spec)
                .stdout(Stdio::null())
                .spawn()
                .unwrap();
            self.ranks.push(child);
        }
    }

    pub(crate) fn wait_ranks(&mut self) {
        for mut r in self.ranks.drain(..) {
            assert!(r.wait().unwrap().success(), "a rank process failed");
        }
    }

    /// What the spool holds of the current user's `job`, oldest first.
    pub(crate) fn spooled(&self, job: &str) -> ncclscope::storage::spool::JobRecords {
        ncclscope::storage::spool::SpoolReader::open_dir(self.dir.path().join("spool"))
            .unwrap()
            .read_job(&(rustix::process::getuid().as_raw(), job.to_string()))
    }

    /// Segments the daemon holds (its `ncclscope_segments`; nothing else can hold one after its
    /// process ended).
    pub(crate) fn segments_left(&self) -> usize {
        sample(&self.metrics(), "ncclscope_segments").map_or(usize::MAX, |n| n as usize)
    }

    /// The segments the daemon still holds once it has none left or `timeout` passed.
    pub(crate) fn segments_left_after(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        while self.segments_left() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        self.segments_left()
    }

    pub(crate) fn metrics(&self) -> String {
        ncclscope_tests::scrape_metrics(&self.prometheus)
    }

    /// The daemon's metrics, scraped every `every` until `done` holds of them or `timeout` passed:
    /// the last text (the metrics are published on the daemon's tick, after what they count).
    pub(crate) fn metrics_when(
        &self,
        timeout: Duration,
        every: Duration,
        done: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + timeout;
        let mut text = self.metrics();
        while !done(&text) && Instant::now() < deadline {
            std::thread::sleep(every);
            text = self.metrics();
        }
        text
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        for c in self.ranks.iter_mut().chain(self.daemon.as_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The loss counted at `stage` (`ncclscope_lost_total{stage="..."}`) in Prometheus text.
pub(crate) fn lost(text: &str, stage: &str) -> Option<f64> {
    sample(text, &format!("ncclscope_lost_total{{stage=\"{stage}\"}}"))
}

/// The sum of the samples of the lines that start with `prefix` (a family and its `{` or ` `) and
/// contain `with` ("" for all), in Prometheus text.
pub(crate) fn summed(text: &str, prefix: &str, with: &str) -> f64 {
    (text.lines())
        .filter(|l| l.starts_with(prefix) && l.contains(with))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

/// Receives spans until `done` says so or `timeout` passes.
pub(crate) async fn collect(
    collector: &mut FakeCollectorServer,
    into: &mut Vec<ExportedSpan>,
    timeout: Duration,
    done: impl Fn(&[ExportedSpan]) -> bool,
) {
    let deadline = Instant::now() + timeout;
    while !done(into) && Instant::now() < deadline {
        into.extend(
            collector
                .exported_spans(1, Duration::from_millis(100))
                .await,
        );
    }
}

/// A rank's span of an operation (`AllReduce rank`, `Send rank`), not a root.
pub(crate) fn is_rank_span(s: &ExportedSpan) -> bool {
    s.name.ends_with(" rank")
}

/// The spans received until `n` rank spans came or `timeout` passed.
pub(crate) async fn collect_rank_spans(
    collector: &mut FakeCollectorServer,
    n: usize,
    timeout: Duration,
) -> Vec<ExportedSpan> {
    let mut spans = Vec::new();
    collect(collector, &mut spans, timeout, |s| {
        s.iter().filter(|s| is_rank_span(s)).count() >= n
    })
    .await;
    spans
}

/// Which instance a fake rank's span is of: (pid, collective, seq, replay).
pub(crate) fn instance_of(s: &ExportedSpan) -> (u32, String, u64, u32) {
    (
        attr(s, "process.pid").parse().unwrap(),
        attr(s, "nccl.collective").to_string(),
        attr(s, "nccl.seq").parse().unwrap(),
        attr(s, "nccl.replay").parse().unwrap(),
    )
}

/// The synthetic ranks' spans (all of them all-reduces).
pub(crate) fn rank_spans(spans: &[ExportedSpan]) -> Vec<&ExportedSpan> {
    spans
        .iter()
        .filter(|s| s.name == "AllReduce rank")
        .collect()
}

/// How `child` exited, if it did within `timeout` (else it is killed).
fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Per trace: the ids of its root spans, and (rank, parent id) of its other spans.
pub(crate) type Traces<'a> = HashMap<&'a str, (BTreeSet<&'a str>, BTreeSet<(u32, &'a str)>)>;

pub(crate) fn roots_and_ranks(spans: &[ExportedSpan]) -> Traces<'_> {
    let mut by_trace: Traces = HashMap::new();
    for s in spans {
        let e = by_trace.entry(s.trace_id.as_str()).or_default();
        if s.parent_span_id.is_empty() {
            e.0.insert(s.span_id.as_str());
        } else {
            e.1.insert((
                attr(s, "nccl.rank").parse().unwrap(),
                s.parent_span_id.as_str(),
            ));
        }
    }
    by_trace
}

/// Waits until the daemon has drained and removed every segment, then checks that it counted
/// `expected` instances, joined every device-hook work item and counted nothing at `stages`; returns
/// the metrics text.
pub(crate) fn drained_with_nothing_lost(h: &Harness, expected: usize, stages: &[&str]) -> String {
    // The metrics are published on the daemon's tick: spans can arrive before a first page counts them.
    let drained = |text: &str| {
        sample(text, "ncclscope_segments") == Some(0.0)
            && sample(text, "ncclscope_collectives_total") == Some(expected as f64)
    };
    let text = h.metrics_when(Duration::from_secs(30), Duration::from_millis(200), drained);
    assert_eq!(
        sample(&text, "ncclscope_device_hook_join_ratio"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "ncclscope_collectives_total"),
        Some(expected as f64),
        "{text}"
    );
    for stage in stages {
        assert!(
            matches!(lost(&text, stage), None | Some(0.0)),
            "{stage}: {text}"
        );
    }
    text
}

pub(crate) const FAULT_ENV: &str = "NCCLSCOPE_TEST_FAULT";

/// A misbehaving process, run by the tests below through `FAULT_ENV` = "mode|socket|seconds".
/// `truncate`: registers, writes a communicator and 100 complete collectives, then tries to shrink its
/// segment under the daemon's mapping (the seals refuse it), hands over a memory file that is not
/// sealed (the daemon refuses it), and lives on for `seconds`. The others register and, for
/// `seconds`, write valid records as fast as their ring takes them, each made to grow the daemon's
/// state or work. `churn`: new communicators, strings, re-definitions, device-function names and
/// devices, communicator ends, operations of refused communicators, kernel records for one operation
/// without end. `flood` (no operation and a dictionary that never changes, so nothing holds its tail):
/// device-hook work items of communicators never announced. `stall`: 16 k operations that never stop
/// (they hold its tail until they time out), then ends of another communicator, again and again.
#[test]
#[ignore = "child process of the daemon fault tests"]
pub(crate) fn daemon_fault_child() {
    let spec = std::env::var(FAULT_ENV).expect("run by the daemon fault tests");
    let f: Vec<&str> = spec.split('|').collect();
    let (mode, socket) = (f[0], Path::new(f[1]));
    let run = Duration::from_secs(f[2].parse().unwrap());
    let claims = Claims {
        hostname: "testhost".into(),
        job_id: format!("{mode}-job"),
        slurm_job_id: String::new(),
    };
    let mut p = Producer::new(Segment::create(&claims, 1 << 16).unwrap());
    let _registered = Registrant::start(socket, p.segment(), Duration::from_secs(30));
    let comm = |comm: u32, comm_hash: u64, cuda_dev: i32, path| {
        let c = fixture::Comm {
            comm,
            comm_hash,
            rank: comm % 64,
            nranks: 64,
            cuda_dev,
            nccl_version: 22809,
            path,
            ..fixture::Comm::default()
        };
        c.record()
    };
    let coll = |comm: u32, id: u64, seq: u64, n_channels: u8| {
        let c = fixture::Coll {
            comm,
            id,
            seq,
            algo: StrId(0),
            proto: StrId(0),
            count: 1 << 10,
            n_channels,
            n_warps: 8,
            ..fixture::Coll::default()
        };
        c.start()
    };
    p.push(&Record::str(StrId(1), b"AllReduce"));
    p.push(&Record::str(StrId(2), b"ncclFloat32"));
    p.push(&fixture::calibration(0, 0, 1));
    p.push(&comm(0, 0xbad, 0, TimingPath::KernelCh));
    let t0 = Instant::now();
    if mode == "truncate" {
        for id in 1..=100 {
            p.push(&coll(0, id, id, 1));
            p.push(&Record::KernelCh {
                comm: 0,
                parent: id,
                channel: 0,
                gpu_start: 10,
                gpu_stop: 20,
                host_ns: 0,
            });
            p.push(&Record::OpStop {
                comm: 0,
                id,
                host_ns: 0,
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(
            rustix::fs::ftruncate(p.segment().fd(), 0),
            Err(rustix::io::Errno::PERM),
            "a sealed segment cannot shrink"
        );
        // The same bytes in a memory file without seals: refused before the daemon maps it.
        let unsealed =
            rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let mut bytes = vec![0u8; ncclscope_proto::segment::segment_bytes(1 << 16) as usize];
        rustix::io::pread(p.segment().fd(), &mut bytes, 0).unwrap();
        rustix::io::write(&unsealed, &bytes).unwrap();
        let (reply, _) = ncclscope_fakenccl::process::register(
            socket,
            std::os::fd::AsFd::as_fd(&unsealed),
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(reply.starts_with("ERR segment is not sealed"), "{reply}");
        std::thread::sleep(run);
        return;
    }
    if mode == "churn" {
        // The operation whose kernel records never end.
        p.push(&coll(0, 1, 0, 2));
    }
    p.push(&comm(1, 0xbad1, 0, TimingPath::KernelCh));
    let mut i: u64 = 0;
    while t0.elapsed() < run {
        for _ in 0..4096 {
            i += 1;
            let n = (i / 8) as u32 + 1;
            let rec = if mode == "flood" {
                Record::DevWork {
                    comm: i as u32 + 2,
                    channel: (i % 64) as u8,
                    func_id: 1,
                    work_counter: i,
                    gpu_start: i,
                    gpu_stop: i + 1,
                }
            } else if mode == "stall" {
                if i < 16_000 {
                    coll(0, 1 + i, i, 1)
                } else {
                    Record::CommEnd {
                        comm: 1,
                        host_ns: 0,
                    }
                }
            } else {
                match i % 8 {
                    0 => comm(n, n as u64, n as i32, TimingPath::DeviceHook),
                    1 => Record::str(StrId((i % 65_535) as u16 + 1), format!("s{i}").as_bytes()),
                    2 => Record::FuncName {
                        func_id: i as u32,
                        name: StrId(1),
                    },
                    3 => fixture::calibration(i as i32, i as i64, 1),
                    4 => Record::KernelCh {
                        comm: 0,
                        parent: 1,
                        channel: (i % 64) as u8,
                        gpu_start: i,
                        gpu_stop: i + 1,
                        host_ns: 0,
                    },
                    5 => Record::CommEnd {
                        comm: n.saturating_sub(3).max(1),
                        host_ns: 0,
                    },
                    6 => coll(n, 1 + i, i << 16, 64),
                    _ => Record::DevWork {
                        comm: n,
                        channel: (i % 256) as u8,
                        func_id: i as u32,
                        work_counter: i,
                        gpu_start: i,
                        gpu_stop: i + 1,
                    },
                }
            };
            p.push(&rec);
        }
        // Leave the test machine's cores to the daemon and the other ranks.
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Harness {
    pub(crate) fn start_fault(&mut self, mode: &str, seconds: u64) {
        let spec = format!("{mode}|{}|{seconds}", self.socket().display());
        let child = child_test("daemon_fault_child", FAULT_ENV, &spec)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        self.ranks.push(child);
    }

    pub(crate) fn daemon_alive(&mut self) -> bool {
        self.daemon
            .as_mut()
            .is_some_and(|d| d.try_wait().unwrap().is_none())
    }

    /// The daemon's resident memory in MiB (VmRSS).
    pub(crate) fn daemon_rss_mib(&self) -> f64 {
        let pid = self.daemon.as_ref().expect("daemon running").id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    }

    /// The e2e ranks' collectives the daemon counted, over their rank series.
    pub(crate) fn job_collectives(&self) -> f64 {
        job_collectives(&self.metrics(), JOB)
    }
}

/// `job`'s collectives counted in Prometheus text, over its rank series.
pub(crate) fn job_collectives(text: &str, job: &str) -> f64 {
    let job = format!("job_id=\"{job}\"");
    summed(text, "ncclscope_rank_collectives_total{", &job)
}

/// Waits until the e2e ranks' `total` collectives are counted; returns how long that took.
pub(crate) fn wait_job(h: &Harness, total: u64, timeout: Duration) -> Duration {
    let t = Instant::now();
    while h.job_collectives() < total as f64 && t.elapsed() < timeout {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        h.job_collectives(),
        total as f64,
        "every collective of the well-behaved ranks counted"
    );
    t.elapsed()
}

/// Two RFC ranks with `timing` (kernel time, pauses, GPU lag) run 4 eager collectives, capture 50
/// all-reduces, replay them 6 times with 2 eager all-reduces after each replay; asserts produced =
/// delivered per (pid, seq, replay) with exact exec and wall times, one trace per (seq, replay), and
/// no loss counted.
pub(crate) async fn graph_replays(label: &str, timing: &[&str]) {
    const NRANKS: u32 = 2;
    const REPLAYS: u32 = 6;
    const GRAPH_OPS: u64 = 50;
    let (h, mut collector) = Scenario::new().start_with_collector().await;
    let (graph_ops, replays) = (GRAPH_OPS.to_string(), REPLAYS.to_string());
    let children = FakeRanks::new("rfc", "graph-job")
        .ranks(NRANKS)
        .comm_hash(0x3333_0000_0000_0000)
        .args(&["--colls", "4", "--channels", "4"])
        .args(&["--graph-ops", &graph_ops, "--graph-channels", "8"])
        .args(&["--replays", &replays, "--eager-between", "2"])
        .args(timing)
        .spawn(&h);
    let reports: Vec<_> = children.into_iter().map(report).collect();
    // What each rank produced: (pid, collective, seq, replay) -> (exec, wall).
    let mut produced: BTreeMap<(u32, String, u64, u32), (u64, u64)> = BTreeMap::new();
    for report in &reports {
        for ((func, seq, replay), op) in report.comms[0].instances() {
            let items = &op.hook_items;
            assert_eq!(items.len(), op.n_channels as usize);
            let exec = op.hook_exec_ns().unwrap();
            let wall = items.iter().map(|i| i.gpu_stop).max().unwrap()
                - items.iter().map(|i| i.gpu_start).min().unwrap();
            assert!(
                produced
                    .insert((report.pid, func.to_string(), seq, replay), (exec, wall))
                    .is_none()
            );
        }
    }
    let warm_up = if timing.contains(&"--warm-up") {
        GRAPH_OPS as usize
    } else {
        0
    };
    let expected = NRANKS as usize
        * (4 + warm_up + 2 * REPLAYS as usize + (GRAPH_OPS as usize) * REPLAYS as usize);
    assert_eq!(produced.len(), expected);
    let spans = collect_rank_spans(&mut collector, expected, Duration::from_secs(60)).await;
    let mut delivered: BTreeMap<(u32, String, u64, u32), Vec<&ExportedSpan>> = BTreeMap::new();
    for s in spans.iter().filter(|s| is_rank_span(s)) {
        delivered.entry(instance_of(s)).or_default().push(s);
    }
    if !delivered.keys().eq(produced.keys()) {
        let missing: Vec<_> = produced
            .keys()
            .filter(|k| !delivered.contains_key(k))
            .collect();
        let extra: Vec<_> = delivered
            .keys()
            .filter(|k| !produced.contains_key(k))
            .collect();
        let text = h.metrics();
        let counters: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("ncclscope_lost_total") || l.starts_with("ncclscope_plugin_"))
            .collect();
        panic!(
            "produced != delivered, per op and per replay: {} missing {missing:?}, {} extra {extra:?}; \
             the daemon's counters:\n{}",
            missing.len(),
            extra.len(),
            counters.join("\n")
        );
    }
    let mut traces: HashMap<(&str, u64, u32), BTreeSet<String>> = HashMap::new();
    for (key, (exec, wall)) in &produced {
        let got = &delivered[key];
        assert_eq!(got.len(), 1, "{key:?} delivered {} times", got.len());
        let s = got[0];
        assert_eq!(attr(s, "nccl.exec_ns"), exec.to_string(), "{key:?}");
        assert_eq!(
            s.end_time_unix_nano - s.start_time_unix_nano,
            *wall,
            "{key:?}"
        );
        assert_eq!(attr(s, "nccl.timing_source"), "device_hook");
        traces
            .entry((key.1.as_str(), key.2, key.3))
            .or_default()
            .insert(s.trace_id.clone());
    }
    assert!(
        traces.values().all(|t| t.len() == 1),
        "both ranks of each (collective, seq, replay) in one trace"
    );
    let all: BTreeSet<&String> = traces.values().flatten().collect();
    assert_eq!(
        all.len(),
        traces.len(),
        "a trace per (collective, seq, replay)"
    );

    let text = drained_with_nothing_lost(
        &h,
        expected,
        &[
            "ring_full",
            "dev_lost",
            "incomplete",
            "dev_unjoined",
            "dev_unattributed",
            "dev_mismatch",
            "dev_ambiguous",
        ],
    );
    eprintln!(
        "{label}: produced {expected} instances, delivered {}, dev_ambiguous {:?}",
        delivered.len(),
        lost(&text, "dev_ambiguous")
    );
}

/// The segment files recorded in tests/data/`name` (a tar of saved segments), unpacked into the
/// harness's directory; `tar_args` pick some (`--wildcards`, a pattern).
pub(crate) fn recorded_segments(h: &Harness, name: &str, tar_args: &[&str]) -> Vec<PathBuf> {
    let data = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name);
    let unpacked = h.dir.path().join("real");
    std::fs::create_dir_all(&unpacked).unwrap();
    let tar = Command::new("tar")
        .arg("-xJf")
        .arg(&data)
        .arg("-C")
        .arg(&unpacked)
        .args(tar_args)
        .status()
        .unwrap();
    assert!(tar.success(), "tar -xJf {}", data.display());
    (std::fs::read_dir(&unpacked).unwrap())
        .map(|f| f.unwrap().path())
        .collect()
}

/// Hands the segments recorded in tests/data/`name` (a tar of saved segments) to the daemon, each in
/// a sealed memory file, as the plugin would have made it.
pub(crate) fn hand_over_recorded_segments(h: &Harness, name: &str) {
    for f in recorded_segments(h, name, &[]) {
        let fd = sealed_memfd(&std::fs::read(f).unwrap());
        let (reply, _ended) = ncclscope_fakenccl::process::register(
            &h.socket(),
            std::os::fd::AsFd::as_fd(&fd),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(reply, "OK\n");
    }
}

/// What the daemon must deliver of torch_p2p.py's a2a and pp runs (jobs `{job}a2a` and `{job}pp`,
/// 2 ranks each, 9 eager steps and 10 replays of a captured one).
pub(crate) async fn p2p_rounds_leave_the_collectives_beside_them_whole(
    h: &Harness,
    collector: &mut FakeCollectorServer,
    job: &str,
) {
    // Per rank, 9 eager steps and 10 replays: a2a: 19 all-gathers, 19 all-reduces, 19 x (send,
    // recv) x 2 peers; pp: 19 all-reduces, 19 x 4 micro-batches x (send, recv).
    const INSTANCES: usize = 2 * (19 + 19 + 19 * 4) + 2 * (19 + 19 * 4 * 2);
    let spans = collect_rank_spans(collector, INSTANCES, Duration::from_secs(60)).await;
    let text = drained_with_nothing_lost(
        h,
        INSTANCES,
        &[
            "dev_unattributed",
            "dev_mismatch",
            "dev_ambiguous",
            "dev_unjoined",
            "incomplete",
        ],
    );
    // Every p2p work item joined its send and receive, eager or replayed.
    for stage in ["dev_p2p", "p2p_captured_untimed"] {
        assert_eq!(lost(&text, stage), Some(0.0), "{stage}");
    }
    let mut per_op: BTreeMap<(String, u32, String), usize> = BTreeMap::new();
    let mut sides: HashMap<String, Vec<(String, u32, String)>> = HashMap::new();
    for s in spans.iter().filter(|s| is_rank_span(s)) {
        let (job, coll) = (attr(s, "job.id").to_string(), attr(s, "nccl.collective"));
        let rank: u32 = attr(s, "nccl.rank").parse().unwrap();
        *per_op
            .entry((job.clone(), rank, coll.to_string()))
            .or_default() += 1;
        let p2p = coll == "Send" || coll == "Recv";
        // Every eager send and receive is timed by its round's work items, as a collective is.
        assert_eq!(attr(s, "nccl.timing_source"), "device_hook", "{s:?}");
        let exec: u64 = attr(s, "nccl.exec_ns").parse().unwrap();
        assert!(exec > 0, "{s:?}");
        if p2p {
            // No faster than one H100's memory (3.35 TB/s): a copy between two ranks on one GPU
            // reads and writes it. (Host times made 1 MiB take 0.3 us: 3.5 TB/s.)
            let bytes: f64 = attr(s, "nccl.bytes").parse().unwrap();
            assert!(bytes / exec as f64 <= 3350.0, "{s:?}");
            let side = (coll.to_string(), rank, attr(s, "nccl.peer").to_string());
            sides.entry(s.trace_id.clone()).or_default().push(side);
        }
    }
    for rank in 0..2 {
        let n = |mode: &str, coll: &str| per_op[&(format!("{job}{mode}"), rank, coll.to_string())];
        assert_eq!(
            (
                n("a2a", "AllGather"),
                n("a2a", "AllReduce"),
                n("pp", "AllReduce")
            ),
            (19, 19, 19),
            "rank {rank}: {per_op:?}"
        );
        assert_eq!((n("a2a", "Send"), n("a2a", "Recv")), (38, 38));
        assert_eq!((n("pp", "Send"), n("pp", "Recv")), (76, 76));
    }
    // A transfer's trace: a send on one rank and the receive of its peer (a rank's self-copy is its
    // own send and receive).
    assert_eq!(sides.len(), 2 * (19 * 2) + 19 * 4 * 2);
    for (trace, mut v) in sides {
        v.sort();
        let [(recv, r_rank, r_peer), (send, s_rank, s_peer)] = &v[..] else {
            panic!("trace {trace}: {v:?}");
        };
        assert_eq!((recv.as_str(), send.as_str()), ("Recv", "Send"));
        assert_eq!(
            (r_peer, s_peer),
            (&s_rank.to_string(), &r_rank.to_string()),
            "{trace}"
        );
    }
}

/// A TCP front for an OTLP receiver that is down until `up` is set: while down it accepts each
/// connection and closes it at once, or with `hang` holds it open and answers nothing (every export
/// attempt fails, at once or at its timeout); once up it relays new connections both ways to `to`,
/// so the daemon keeps the one endpoint it was given.
pub(crate) fn flaky_front(to: std::net::SocketAddr, up: Arc<AtomicBool>, hang: bool) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            if !up.load(Ordering::SeqCst) {
                if hang {
                    held.push(conn);
                }
                continue;
            }
            let Ok(back) = std::net::TcpStream::connect(to) else {
                continue;
            };
            let (conn2, back2) = (conn.try_clone().unwrap(), back.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut &conn, &mut &back);
                let _ = back.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut &back2, &mut &conn2);
                let _ = conn2.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    endpoint
}

/// A gRPC collector that answers every span export with `unavailable` while `up` is false (an
/// overloaded or misconfigured collector), then relays to the collector at `to`.
pub(crate) async fn erroring_front(to: String, up: Arc<AtomicBool>) -> String {
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
        TraceService, TraceServiceServer,
    };
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    struct Front {
        up: Arc<AtomicBool>,
        to: TraceServiceClient<tonic::transport::Channel>,
    }
    #[tonic::codegen::async_trait]
    impl TraceService for Front {
        async fn export(
            &self,
            req: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            if !self.up.load(Ordering::SeqCst) {
                return Err(tonic::Status::unavailable("collector overloaded"));
            }
            self.to.clone().export(req.into_inner()).await
        }
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let to = TraceServiceClient::connect(to).await.unwrap();
    let front = TraceServiceServer::new(Front { up, to });
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(front)
            .serve_with_incoming(incoming),
    );
    endpoint
}

/// How the collector fails while it is away.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Outage {
    /// Every connection closed at once.
    Refuse,
    /// Every connection accepted and never answered.
    Hang,
    /// Every export answered with an error status.
    Error,
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) async fn dropped_spans_re_sent_once_the_collector_answers(outage: Outage) {
    const NRANKS: u32 = 2;
    const NCOLLS: u64 = 1000;
    let mut collector = FakeCollectorServer::start().await.unwrap();
    let up = Arc::new(AtomicBool::new(false));
    let front = match outage {
        Outage::Refuse => flaky_front(collector.address(), up.clone(), false),
        Outage::Hang => flaky_front(collector.address(), up.clone(), true),
        Outage::Error => erroring_front(collector.endpoint(), up.clone()).await,
    };
    // Two attempts a batch, 1 s each at most: the outage drops everything within seconds.
    let mut h = Scenario::new()
        .otlp("max_attempts = 2")
        .otlp("request_timeout_ms = 1000")
        .start(&front);
    h.start_ranks(NRANKS, NCOLLS, 100);
    h.wait_ranks();
    wait_job(&h, NRANKS as u64 * NCOLLS, Duration::from_secs(60));
    // Each rank's span, and rank 0's root.
    let total = ((NRANKS as u64 + 1) * NCOLLS) as usize;
    let dropped = |text: &str| lost(text, "export_dropped");
    let t = Instant::now();
    let text = h.metrics_when(Duration::from_secs(120), Duration::from_millis(100), |t| {
        dropped(t) == Some(total as f64)
    });
    assert_eq!(dropped(&text), Some(total as f64), "{text}");
    let down_for = t.elapsed();
    up.store(true, Ordering::SeqCst);
    let t = Instant::now();
    let mut spans = Vec::new();
    let unique = |s: &[ExportedSpan]| s.iter().map(|s| &s.span_id).collect::<BTreeSet<_>>().len();
    collect(&mut collector, &mut spans, Duration::from_secs(60), |s| {
        unique(s) >= total
    })
    .await;
    let resent_in = t.elapsed();
    assert_eq!(unique(&spans), total, "every dropped span re-sent");

    let uid = rustix::process::getuid().as_raw();
    let by_id: HashMap<&str, &ExportedSpan> =
        spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    for seq in 0..NCOLLS {
        let key = ncclscope::spans::collective_key("AllReduce", seq, 0);
        let trace = hex(&ncclscope::spans::trace_id(uid, COMM_HASH, key));
        let root = hex(&ncclscope::spans::root_span_id(uid, COMM_HASH, key));
        assert_eq!(by_id[root.as_str()].trace_id, trace, "seq {seq}: root");
        for rank in 0..NRANKS {
            let id = hex(&ncclscope::spans::rank_span_id(uid, COMM_HASH, key, rank));
            let s = by_id[id.as_str()];
            assert_eq!((&s.trace_id, &s.parent_span_id), (&trace, &root));
            let (start, _) = gpu_times(rank, seq, 0);
            let (_, end) = gpu_times(rank, seq, CHANNELS - 1);
            let host = |gpu: u64| (gpu as i64 + offset(rank)) as u64;
            assert_eq!(
                (s.start_time_unix_nano, s.end_time_unix_nano),
                (host(start), host(end)),
                "seq {seq} rank {rank}"
            );
        }
    }

    // Every dropped instance re-sent at least once: an attempt that fails after the collector came
    // back (it timed out, though the receiver may have taken it) is dropped and re-sent again.
    let instances = (NRANKS as u64 * NCOLLS) as f64;
    let resent = |text: &str| sample(text, "ncclscope_export_resent_total").unwrap_or(0.0);
    let text = h.metrics_when(Duration::from_secs(10), Duration::from_millis(100), |t| {
        resent(t) >= instances
    });
    assert!(resent(&text) >= instances, "{text}");
    assert_eq!(lost(&text, "export_not_resent"), Some(0.0));
    assert!(dropped(&text) >= Some(total as f64));
    eprintln!(
        "{outage:?}, down {down_for:?}: {total} spans dropped; up: {} spans received ({} unique) in \
         {resent_in:?}, {} instances re-sent, {:?} spans dropped in all, export_errors {:?}",
        spans.len(),
        unique(&spans),
        resent(&text),
        dropped(&text),
        sample(&text, "ncclscope_export_errors_total"),
    );
}

/// The spans `collector` receives, drained by a task of its own until this is taken or dropped: the
/// receiver holds 64 spans, so a test that blocks its thread (restarting daemons) would otherwise
/// leave it full and the daemons' exports waiting.
pub(crate) struct Drained {
    spans: Arc<std::sync::Mutex<Vec<ExportedSpan>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drained {
    pub(crate) fn new(mut collector: FakeCollectorServer) -> Drained {
        let spans = Arc::new(std::sync::Mutex::new(Vec::new()));
        let into = spans.clone();
        let task = tokio::spawn(async move {
            loop {
                let got = collector.exported_spans(1, Duration::from_millis(50)).await;
                into.lock().unwrap().extend(got);
            }
        });
        Drained { spans, task }
    }

    /// Looks at what came every `every` until `done` holds of it or `timeout` passes.
    pub(crate) async fn until(
        &self,
        timeout: Duration,
        every: Duration,
        done: impl Fn(&[ExportedSpan]) -> bool,
    ) {
        let deadline = Instant::now() + timeout;
        while !done(&self.spans.lock().unwrap()) && Instant::now() < deadline {
            tokio::time::sleep(every).await;
        }
    }

    /// What came, the draining stopped.
    pub(crate) fn take(self) -> Vec<ExportedSpan> {
        self.task.abort();
        std::mem::take(&mut *self.spans.lock().unwrap())
    }
}

impl Drop for Drained {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// This test binary run again as the ignored test `support::{name}` (a child process of the tests
/// above), given `spec` in the environment variable `env`.
pub(crate) fn child_test(name: &str, env: &str, spec: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--ignored", "--exact", &format!("support::{name}")])
        .args(["--nocapture", "--test-threads=1"])
        .env(env, spec);
    c
}

/// Fake-NCCL rank processes (`fakenccl-rank`: the real plugin `.so` in a fake NCCL host) of one
/// communicator of a job, registering with a harness's daemon, their hook rings in plain memory (no
/// GPU here, written as the device would). `FakeRanks::new("rfc", "job").ranks(2).args(..)`.
pub(crate) struct FakeRanks<'a> {
    kind: &'a str,
    job: &'a str,
    nranks: u32,
    comm_hash: Option<u64>,
    args: Vec<String>,
    env: Vec<(&'a str, String)>,
    lag: Duration,
    report: bool,
}

impl<'a> FakeRanks<'a> {
    /// One rank of NCCL host `kind` (`v5`, `rfc`...), the host's own communicator hash.
    pub(crate) fn new(kind: &'a str, job: &'a str) -> FakeRanks<'a> {
        FakeRanks {
            kind,
            job,
            nranks: 1,
            comm_hash: None,
            args: Vec::new(),
            env: Vec::new(),
            lag: Duration::ZERO,
            report: true,
        }
    }

    pub(crate) fn ranks(mut self, nranks: u32) -> Self {
        self.nranks = nranks;
        self
    }

    pub(crate) fn comm_hash(mut self, comm_hash: u64) -> Self {
        self.comm_hash = Some(comm_hash);
        self
    }

    /// More of `fakenccl-rank`'s arguments: what each rank runs.
    pub(crate) fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    pub(crate) fn env(mut self, key: &'a str, value: impl Into<String>) -> Self {
        self.env.push((key, value.into()));
        self
    }

    /// Each rank started `lag` after the one before it.
    pub(crate) fn lag(mut self, lag: Duration) -> Self {
        self.lag = lag;
        self
    }

    /// Their reports discarded (a large one, unread, would hold its rank at exit).
    pub(crate) fn without_reports(mut self) -> Self {
        self.report = false;
        self
    }

    /// The rank processes, started, their stderr piped and their reports too unless discarded (see
    /// [`report`], [`finished`]).
    pub(crate) fn spawn(&self, h: &Harness) -> Vec<Child> {
        let rank_bin = ncclscope_fakenccl::process::rank_binary().unwrap();
        (0..self.nranks)
            .map(|rank| {
                if rank > 0 {
                    std::thread::sleep(self.lag);
                }
                let mut c = Command::new(&rank_bin);
                c.args(["--kind", self.kind])
                    .args(&self.args)
                    .args(["--rank", &rank.to_string()])
                    .args(["--nranks", &self.nranks.to_string()]);
                if let Some(hash) = self.comm_hash {
                    c.args(["--comm-hash", &hash.to_string()]);
                }
                c.env("NCCLSCOPE_SOCKET", h.socket())
                    .env("NCCLSCOPE_JOB_ID", self.job)
                    .env("NCCLSCOPE_RING_MEMORY", "cpu")
                    .envs(self.env.iter().map(|(k, v)| (k, v)))
                    .stdout(if self.report {
                        Stdio::piped()
                    } else {
                        Stdio::null()
                    })
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect()
    }
}

/// A fake rank's output, once it exited, which it must do successfully (its stderr is the failure
/// message).
pub(crate) fn finished(child: Child) -> std::process::Output {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "fakenccl-rank failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// What a fake rank ran, once it exited successfully.
pub(crate) fn report(child: Child) -> ncclscope_fakenccl::report::Report {
    serde_json::from_slice(&finished(child).stdout).unwrap()
}
