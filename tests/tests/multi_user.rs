//! Two real users on one node against the real daemon binary: processes of uid 61001 ("A") and uid
//! 61002 ("B"), spawned by this test (which runs as root, as CI does) through `CommandExt::uid/gid`.
//! What a segment says (job id, communicator hash, rank) is B's to choose; what the kernel says (the
//! registering uid) is not. Each test checks what A relies on: B cannot land in A's statistics,
//! spool or traces, cannot read A's jobs through the API or Prometheus, and cannot take every segment
//! slot of the node.
//!
//! The user processes are this test binary re-run as `multi_user_child` (an ignored test), writing
//! with `proto::Producer` the records the plugin writes on the stock KernelCh path.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use fake_opentelemetry_collector::{ExportedSpan, FakeCollectorServer};
use ncclscope_fakenccl::process::register;
use ncclscope_proto::fixture::{self, Coll, Comm};
use ncclscope_proto::segment::{Claims, Counter, Producer, Segment};
use ncclscope_proto::{Record, StrId};
use ncclscope_tests::attr;

const CHILD_ENV: &str = "NCCLSCOPE_TEST_MULTI_USER";
const A: u32 = 61001;
const B: u32 = 61002;
const JOB: &str = "shared-job";
const COMM_HASH: u64 = 0x0a0a_0000_0000_beef;
const NCOLLS: u64 = 30;
const GPU_BASE: u64 = 1_000_000_000;
const HOST_BASE: i64 = 1_790_000_000_000_000_000;
/// Records a "lose" child loses to its full ring.
const LOST: u64 = 500;

/// Kernel start and end (GPU clock) of `rank`'s collective `seq`; B's claimed rank 0 is 900 us long.
fn gpu_times(uid: u32, rank: u32, seq: u64) -> (u64, u64) {
    let start = GPU_BASE + seq * 100_000 + rank as u64 * 700;
    let exec = if uid == B {
        900_000
    } else {
        20_000 + rank as u64
    };
    (start, start + exec)
}

/// The user process, `CHILD_ENV` = "rank|socket|shared_dir|rank|nranks" (writes NCOLLS collectives
/// of JOB on COMM_HASH, the ranks of one uid meeting at a barrier), "hold|socket|shared_dir|tag"
/// (registers an empty segment, prints the daemon's reply; if refused, retries every 200 ms as the
/// plugin does and prints the reply that accepts it; keeps the segment until
/// `shared_dir/release.<tag>` exists), "lose|..." (as hold, after losing LOST records to a full
/// ring), "forge|..." (as hold, then writes forged loss counters into its header),
/// "foreign|socket|shared_dir|uid" (run as root: creates a segment, becomes `uid` and hands it over,
/// prints the reply), "unwritten|socket|shared_dir|log2 capacity|punch" (see
/// [`reading_a_ring_never_written_or_punched_out_costs_the_daemon_no_memory`]) or
/// "twice|socket|shared_dir|first" (see [`one_memory_file_registered_by_two_processes_is_read_once`]).
#[test]
#[ignore = "child process of the multi-user tests"]
fn multi_user_child() {
    let spec = std::env::var(CHILD_ENV).expect("run by the multi-user tests");
    let f: Vec<&str> = spec.split('|').collect();
    let (socket, shared) = (Path::new(f[1]), Path::new(f[2]));
    let claims = Claims {
        hostname: "testhost".into(),
        job_id: JOB.into(),
        slurm_job_id: String::new(),
    };
    match f[0] {
        "unwritten" => return unwritten_child(socket, &claims, f[3].parse().unwrap(), f[4] == "1"),
        "twice" => return twice_child(socket, shared, &claims, f[3]),
        _ => {}
    }
    let mut p = Producer::new(Segment::create(&claims, 1 << 12).unwrap());
    if f[0] == "foreign" {
        // The registering thread's credentials are what the kernel reports to the daemon.
        let uid = rustix::process::Uid::from_raw(f[3].parse().unwrap());
        rustix::thread::set_thread_uid(uid).unwrap();
        let (reply, _conn) = register(socket, p.segment().fd(), Duration::from_secs(30)).unwrap();
        println!("REPLY {}", reply.trim_end());
        return;
    }
    if f[0] == "lose" {
        // A real loss: records written while no daemon reads the ring, LOST more than it holds.
        for _ in 0..p.segment().capacity() + LOST {
            p.push(&Record::str(StrId(1), b"x"));
        }
        assert_eq!(p.segment().counter(Counter::RingFull), LOST);
    }
    let (reply, conn) = register(socket, p.segment().fd(), Duration::from_secs(30)).unwrap();
    if f[0] == "forge" {
        // A hostile owner writes its header's counters as it likes.
        p.segment().count(Counter::RingFull, u64::MAX - 3);
        p.segment().count(Counter::ForwardPanic, 1_000_000);
    }
    if matches!(f[0], "hold" | "lose" | "forge") {
        println!("REPLY {}", reply.trim_end());
        std::io::stdout().flush().unwrap();
        let release = shared.join(format!("release.{}", f[3]));
        let released = || release.exists() || shared.join("release.all").exists();
        let (mut reply, mut _conn) = (reply, conn);
        while reply != "OK\n" && !released() {
            std::thread::sleep(Duration::from_millis(200));
            (reply, _conn) = register(socket, p.segment().fd(), Duration::from_secs(30)).unwrap();
            if reply == "OK\n" {
                println!("REPLY {}", reply.trim_end());
                std::io::stdout().flush().unwrap();
            }
        }
        while !released() {
            std::thread::sleep(Duration::from_millis(20));
        }
        return;
    }
    assert_eq!(reply, "OK\n");
    let _conn = conn;
    let (rank, nranks): (u32, u32) = (f[3].parse().unwrap(), f[4].parse().unwrap());
    write_job(&mut p, shared, rank, nranks, NCOLLS);
}

/// What a rank of `nranks` writes: its dictionary, clock and communicator, then `ncolls`
/// collectives (after the other ranks of its uid are ready, for A), then its communicator's end.
fn write_job(p: &mut Producer, shared: &Path, rank: u32, nranks: u32, ncolls: u64) {
    let uid = rustix::process::getuid().as_raw();
    for (id, text) in [(1, "AllReduce"), (2, "ncclFloat32")] {
        assert!(p.push(&Record::str(StrId(id), text.as_bytes())));
    }
    let offset_ns = HOST_BASE - GPU_BASE as i64;
    assert!(p.push(&fixture::calibration(0, offset_ns, 100)));
    let comm = Comm {
        comm_hash: COMM_HASH,
        rank,
        nranks,
        nccl_version: 22809,
        host_ns: ncclscope_proto::now_ns(),
        ..Comm::default()
    };
    assert!(p.push(&comm.record()));
    // The ranks of this uid meet before their first collective, as NCCL's communicator init does.
    std::fs::write(shared.join(format!("ready.{uid}.{rank}")), b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(0..nranks).all(|r| shared.join(format!("ready.{uid}.{r}")).exists()) && uid == A {
        assert!(Instant::now() < deadline, "the other rank never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    for seq in 0..ncolls {
        let (gpu_start, gpu_stop) = gpu_times(uid, rank, seq);
        // Enqueued 1 us before its kernel starts, on the calibration's (synthetic) host clock.
        let host_ns = (gpu_start as i64 + HOST_BASE - GPU_BASE as i64) as u64 - 1_000;
        let c = Coll {
            id: seq + 1,
            seq,
            algo: StrId(0),
            proto: StrId(0),
            count: 1 << 10,
            host_ns,
            ..Coll::default()
        };
        p.push(&c.start());
        p.push(&c.kernel(0, (gpu_start, gpu_stop), host_ns));
        p.push(&c.stop(host_ns));
    }
    p.push(&Record::CommEnd {
        comm: 0,
        host_ns: ncclscope_proto::now_ns(),
    });
    p.segment().close();
}

/// A hostile owner's segment of `1 << log2` records: never written, or written and then punched
/// out after registering; either way its header says a full ring was published. Prints the reply,
/// then, once the daemon committed every record, how much memory the file holds.
fn unwritten_child(socket: &Path, claims: &Claims, log2: u32, punch: bool) {
    use ncclscope_proto::fixture::{publish_unwritten, unwritten_segment};
    let capacity = 1u64 << log2;
    let seg = if punch {
        Segment::create(claims, capacity).unwrap()
    } else {
        unwritten_segment(claims, capacity).unwrap()
    };
    let allocated = || rustix::fs::fstat(seg.fd()).unwrap().st_blocks as u64 * 512;
    let header_page = 4096;
    let (reply, _conn) = register(socket, seg.fd(), Duration::from_secs(30)).unwrap();
    println!("REPLY {}", reply.trim_end());
    std::io::stdout().flush().unwrap();
    if punch {
        let len = rustix::fs::fstat(seg.fd()).unwrap().st_size as u64;
        rustix::fs::fallocate(
            seg.fd(),
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            header_page,
            len - header_page,
        )
        .unwrap();
    }
    let before = allocated();
    publish_unwritten(&seg, capacity);
    let deadline = Instant::now() + Duration::from_secs(120);
    while seg.tail() < capacity && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "REPLY tail={} allocated_before={before} allocated_after={}",
        seg.tail(),
        allocated()
    );
}

/// "first": registers a segment, then has another process (this binary again, as "second", which
/// inherits the memory file as a forked child does) register the same file, prints both replies,
/// writes a job of 1,000 collectives, and keeps both connections open until `release.all`.
fn twice_child(socket: &Path, shared: &Path, claims: &Claims, role: &str) {
    use std::os::fd::{AsFd, AsRawFd};
    // Or the test's directory is gone (it ended without releasing this process).
    let released = || shared.join("release.all").exists() || !shared.exists();
    let reply_file = shared.join("second.reply");
    if let Some(fd) = role.strip_prefix("second:") {
        // The descriptor the first process left open across exec for this one.
        let file = (std::fs::File::options().read(true).write(true))
            .open(format!("/proc/self/fd/{fd}"))
            .unwrap();
        let (reply, _conn) = register(socket, file.as_fd(), Duration::from_secs(30)).unwrap();
        let tmp = shared.join("second.reply.tmp");
        std::fs::write(&tmp, reply.trim_end()).unwrap();
        std::fs::rename(tmp, reply_file).unwrap();
        while !released() {
            std::thread::sleep(Duration::from_millis(20));
        }
        return;
    }
    let mut p = Producer::new(Segment::create(claims, 1 << 12).unwrap());
    let (reply, _conn) = register(socket, p.segment().fd(), Duration::from_secs(30)).unwrap();
    println!("REPLY {}", reply.trim_end());
    std::io::stdout().flush().unwrap();
    rustix::io::fcntl_setfd(p.segment().fd(), rustix::io::FdFlags::empty()).unwrap();
    let spec = format!(
        "twice|{}|{}|second:{}",
        socket.display(),
        shared.display(),
        p.segment().fd().as_raw_fd()
    );
    let mut second = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "multi_user_child",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, spec)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !reply_file.exists() {
        assert!(
            Instant::now() < deadline,
            "the second process never registered"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("REPLY {}", std::fs::read_to_string(&reply_file).unwrap());
    std::io::stdout().flush().unwrap();
    write_job(&mut p, shared, 0, 1, 1000);
    while !released() {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(second.wait().unwrap().success());
}

/// A daemon (root) on sockets every user can reach, and the user processes; cleaned up on drop.
struct Node {
    dir: tempfile::TempDir,
    prometheus: String,
    daemon: Child,
    children: Vec<Child>,
}

impl Node {
    fn start(otlp_endpoint: &str, extra_config: &str) -> Node {
        Node::start_with(otlp_endpoint, extra_config, &[])
    }

    /// [`Node::start`], the daemon run through `wrap` (a program and its arguments).
    fn start_with(otlp_endpoint: &str, extra_config: &str, wrap: &[&str]) -> Node {
        let dir = tempfile::tempdir().unwrap();
        // Users reach the sockets and their shared directory; the daemon's state and spool stay its own.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let prometheus = format!(
            "127.0.0.1:{}",
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        );
        let d = dir.path().display();
        let config = dir.path().join("ncclscope.toml");
        std::fs::write(
            &config,
            format!(
                "socket = \"{d}/reg.sock\"\napi_socket = \"{d}/api.sock\"\n\
                 state_dir = \"{d}/state\"\n{extra_config}\n[spool]\ndir = \"{d}/spool\"\n\
                 [otlp]\nendpoint = \"{otlp_endpoint}\"\nbatch_timeout_ms = 50\n\
                 [prometheus]\nlisten = \"{prometheus}\"\n"
            ),
        )
        .unwrap();
        let bin = ncclscope_tests::daemon_binary();
        let mut command = match wrap {
            [] => Command::new(&bin),
            [program, args @ ..] => {
                let mut c = Command::new(program);
                c.args(args).arg(&bin);
                c
            }
        };
        let daemon = command
            .args(["daemon", "--config"])
            .arg(&config)
            .env("NCCLSCOPE_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let node = Node {
            dir,
            prometheus,
            daemon,
            children: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(node.path("api.sock")).is_err() {
            assert!(Instant::now() < deadline, "daemon did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        node
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Starts this test binary as `uid`'s process with `spec` after the mode.
    fn spawn(&mut self, uid: u32, mode: &str, rest: &str) -> usize {
        let spec = format!(
            "{mode}|{}|{}|{rest}",
            self.path("reg.sock").display(),
            self.path("shared").display()
        );
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "multi_user_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, spec)
            .uid(uid)
            .gid(uid)
            .current_dir("/")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        self.children.push(child);
        self.children.len() - 1
    }

    /// The daemon's reply to a `hold` child's registration.
    fn reply(&mut self, child: usize) -> String {
        let out = self.children[child].stdout.as_mut().unwrap();
        let mut text = String::new();
        let mut byte = [0u8; 1];
        // The test harness prints its own lines too, and may start the child's on one of them.
        while out.read(&mut byte).unwrap() == 1 {
            if byte[0] == b'\n' {
                if let Some((_, reply)) = text.split_once("REPLY ") {
                    return reply.to_string();
                }
                text.clear();
            } else {
                text.push(byte[0] as char);
            }
        }
        panic!("the child exited without a reply");
    }

    fn wait_all(&mut self) {
        for c in &mut self.children {
            assert!(c.wait().unwrap().success(), "a user process failed");
        }
    }

    /// An `ncclscope` tool run as `uid` (root: 0) against this daemon's API.
    fn tool(&self, uid: u32, args: &[&str]) -> Output {
        Command::new(ncclscope_tests::daemon_binary())
            .args(args)
            .arg("--api-socket")
            .arg(self.path("api.sock"))
            .uid(uid)
            .gid(uid)
            .current_dir("/")
            .output()
            .unwrap()
    }

    fn stats(&self, uid: u32) -> serde_json::Value {
        let out = self.tool(uid, &["stats", "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    fn metrics(&self) -> String {
        ncclscope_tests::scrape_metrics(&self.prometheus)
    }

    /// Polls Prometheus until `sample` has `want`.
    fn wait_metric(&self, sample: &str, want: f64) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = self.metrics();
            let v = ncclscope_tests::sample(&text, sample);
            if v == Some(want) || Instant::now() > deadline {
                assert_eq!(v, Some(want), "{sample}\n{text}");
                return text;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::write(self.path("shared/release.all"), b"");
        for c in self.children.iter_mut().chain(Some(&mut self.daemon)) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// B's process claims A's job id, A's communicator hash and rank 0 (so the root span) at the same time
/// as A's two ranks run: B's instances land in B's own series, spool directory and traces; A's stay
/// exactly A's. Through the API each user sees only their own jobs, root sees both; the spool is
/// private (0700 directories, 0600 files); Prometheus serves no job by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_users_process_claiming_a_job_lands_in_its_own_series_spool_and_traces() {
    let mut collector = FakeCollectorServer::start().await.unwrap();
    let mut node = Node::start(&collector.endpoint(), "");
    node.spawn(A, "rank", "0|2");
    node.spawn(A, "rank", "1|2");
    node.spawn(B, "rank", "0|2");
    node.wait_all();

    // Traces: A's collective and B's never share a trace, and each has its own uid's root.
    let want = (3 * NCOLLS + 2 * NCOLLS) as usize; // rank spans + one root per collective per uid
    let mut spans = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while spans.len() < want && Instant::now() < deadline {
        spans.extend(
            collector
                .exported_spans(1, Duration::from_millis(100))
                .await,
        );
    }
    assert_eq!(
        spans.len(),
        want,
        "rank spans of A (2 ranks) and B (1), a root per uid"
    );
    let mut traces: BTreeMap<&str, Vec<&ExportedSpan>> = BTreeMap::new();
    for s in &spans {
        traces.entry(s.trace_id.as_str()).or_default().push(s);
    }
    assert_eq!(
        traces.len(),
        2 * NCOLLS as usize,
        "one trace per collective per uid"
    );
    let mut per_uid: BTreeMap<u32, usize> = BTreeMap::new();
    for group in traces.values() {
        let uids: BTreeSet<&str> = group
            .iter()
            .map(|s| attr(s, "process.real_user.id"))
            .collect();
        assert_eq!(uids.len(), 1, "a trace holds one uid's spans: {uids:?}");
        let uid: u32 = uids.first().unwrap().parse().unwrap();
        *per_uid.entry(uid).or_default() += 1;
        let roots: Vec<_> = group
            .iter()
            .filter(|s| s.parent_span_id.is_empty())
            .collect();
        assert_eq!(roots.len(), 1, "one root per trace");
        let ranks: BTreeSet<&str> = group
            .iter()
            .filter(|s| s.parent_span_id == roots[0].span_id)
            .map(|s| attr(s, "nccl.rank"))
            .collect();
        let seq: u64 = attr(roots[0], "nccl.seq").parse().unwrap();
        let end = |rank| (gpu_times(uid, rank, seq).1 as i64 + HOST_BASE - GPU_BASE as i64) as u64;
        let last = if uid == A { end(0).max(end(1)) } else { end(0) };
        assert_eq!(
            roots[0].end_time_unix_nano, last,
            "the root ends with the last of its own uid's ranks"
        );
        if uid == A {
            assert_eq!(ranks, BTreeSet::from(["0", "1"]));
        } else {
            assert_eq!(ranks, BTreeSet::from(["0"]));
        }
    }
    assert_eq!(
        per_uid,
        BTreeMap::from([(A, NCOLLS as usize), (B, NCOLLS as usize)])
    );

    // Statistics (root's view): one job per uid, A's series holds A's instances only.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut all = node.stats(0);
    let counted = |v: &serde_json::Value| -> u64 {
        v["colls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["count"].as_u64().unwrap())
            .sum()
    };
    while counted(&all) < 3 * NCOLLS && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        all = node.stats(0);
    }
    let colls: BTreeMap<u64, (u64, f64)> = all["colls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(
                (c["job_id"].as_str(), c["comm_hash"].as_str()),
                (Some(JOB), Some("0a0a00000000beef"))
            );
            (
                c["uid"].as_u64().unwrap(),
                (
                    c["count"].as_u64().unwrap(),
                    c["exec_p99_us"].as_f64().unwrap(),
                ),
            )
        })
        .collect();
    assert_eq!(colls.len(), 2, "{all}");
    assert_eq!(colls[&(A as u64)].0, 2 * NCOLLS);
    assert!(
        colls[&(A as u64)].1 < 100.0,
        "B's 900 us kernels are not in A's series: {all}"
    );
    assert_eq!(colls[&(B as u64)].0, NCOLLS);
    let job_uids = |v: &serde_json::Value| -> BTreeSet<u64> {
        v["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["uid"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(job_uids(&all), BTreeSet::from([A as u64, B as u64]));

    // Each user sees only their own job through the API.
    for (uid, other) in [(A, B), (B, A)] {
        let mine = node.stats(uid);
        assert_eq!(job_uids(&mine), BTreeSet::from([uid as u64]), "{mine}");
        for part in ["colls", "ranks"] {
            assert!(
                mine[part]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|c| c["uid"] == uid),
                "uid {uid} sees another uid's {part}: {mine}"
            );
        }
        let out = node.path(&format!("shared/{uid}.json"));
        let export = node.tool(uid, &["export", "--job", JOB, "-o", out.to_str().unwrap()]);
        assert!(
            export.status.success(),
            "{}",
            String::from_utf8_lossy(&export.stderr)
        );
        let n = if uid == A { 2 * NCOLLS } else { NCOLLS };
        assert!(
            String::from_utf8_lossy(&export.stderr)
                .contains(&format!("wrote {n} collective instances")),
            "{}",
            String::from_utf8_lossy(&export.stderr)
        );
        let theirs = node.tool(
            uid,
            &[
                "export",
                "--job",
                JOB,
                "--uid",
                &other.to_string(),
                "-o",
                out.to_str().unwrap(),
            ],
        );
        let err = String::from_utf8_lossy(&theirs.stderr);
        assert!(
            !theirs.status.success() && err.contains("may not read"),
            "{err}"
        );
    }
    let root_export = node.tool(
        0,
        &[
            "export",
            "--job",
            JOB,
            "-o",
            node.path("root.json").to_str().unwrap(),
        ],
    );
    let err = String::from_utf8_lossy(&root_export.stderr);
    assert!(
        !root_export.status.success() && err.contains("several uids"),
        "{err}"
    );

    // The spool: A's job directory holds A's instances only; everything private to the daemon.
    let spool = ncclscope::storage::spool::SpoolReader::open_dir(node.path("spool")).unwrap();
    assert_eq!(spool.jobs(), [(A, JOB.to_string()), (B, JOB.to_string())]);
    let a: Vec<_> = spool
        .read_job(&(A, JOB.into()))
        .map(|c| c.unwrap())
        .collect();
    assert_eq!(a.len() as u64, 2 * NCOLLS);
    assert!(a.iter().all(|c| c.uid == A && c.exec_ns < 100_000));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let mut stack = vec![node.path("spool")];
    let mut files = 0;
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            assert_eq!(mode(&p), 0o700, "{}", p.display());
            stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else {
            assert_eq!(mode(&p), 0o600, "{}", p.display());
            files += 1;
        }
    }
    assert_eq!(files, 2, "one spool file per (uid, job)");
    // The resume state names the jobs and communicators of every user: the daemon's alone too.
    assert_eq!(mode(&node.path("state")), 0o700);

    // Prometheus, readable by any local user, serves the daemon's health and no job.
    let text = node.wait_metric("ncclscope_collectives_total", (3 * NCOLLS) as f64);
    assert!(
        !text.contains("job_id=") && !text.contains("uid="),
        "{text}"
    );
    eprintln!(
        "claim: produced A {} + B {} instances of job {JOB}; series A {} B {}; traces {per_uid:?} \
         (uid: count), {} spans; spool A {} records, {files} files",
        2 * NCOLLS,
        NCOLLS,
        colls[&(A as u64)].0,
        colls[&(B as u64)].0,
        spans.len(),
        a.len()
    );
}

/// One uid's segments beyond `drain.max_segments_per_uid` are refused with an ERR line and counted
/// once each, while another uid still registers; the refused segment is attached once its uid has room.
#[test]
fn the_segment_quota_refuses_one_uids_extra_segment_while_another_uid_registers() {
    let mut node = Node::start("", "[drain]\nmax_segments_per_uid = 2");
    let a: Vec<usize> = (0..3)
        .map(|i| node.spawn(A, "hold", &format!("a{i}")))
        .collect();
    let replies: Vec<String> = a.iter().map(|&c| node.reply(c)).collect();
    assert_eq!(
        replies.iter().filter(|r| *r == "OK").count(),
        2,
        "{replies:?}"
    );
    let refused = replies
        .iter()
        .find(|r| r.starts_with("ERR"))
        .expect("one refused");
    assert!(
        refused.contains(&format!(
            "uid {A} already has 2 segments attached (drain.max_segments_per_uid = 2)"
        )),
        "{refused}"
    );
    let b = node.spawn(B, "hold", "b0");
    assert_eq!(node.reply(b), "OK");
    node.wait_metric("ncclscope_segments", 3.0);
    // The refused process retries (every 200 ms, as the plugin does) but is counted once.
    std::thread::sleep(Duration::from_millis(1000));
    node.wait_metric("ncclscope_lost_total{stage=\"uid_segment_quota\"}", 1.0);
    // One of A's attached processes exits: once the daemon dropped its segment, the refused one's
    // retry is accepted (2 of A's again, 1 of B's).
    let i = replies.iter().position(|r| r == "OK").unwrap();
    let r = replies.iter().position(|r| r != "OK").unwrap();
    std::fs::write(node.path(&format!("shared/release.a{i}")), b"").unwrap();
    assert!(node.children[a[i]].wait().unwrap().success());
    assert_eq!(node.reply(a[r]), "OK", "accepted once its uid had room");
    // Past the next statistics snapshot (every second).
    std::thread::sleep(Duration::from_millis(1500));
    node.wait_metric("ncclscope_segments", 3.0);
    node.wait_metric("ncclscope_lost_total{stage=\"uid_segment_quota\"}", 1.0);
    eprintln!(
        "quota: A's replies {replies:?}; B's OK; refusals counted 1; attached after room: 3 segments"
    );
}

/// A memory file one user created, handed over by a process running as another (root's segment,
/// registered once the registering thread became A): refused before the daemon maps it, and counted.
/// Whoever holds the descriptor, the file stays its creator's.
#[test]
fn a_segment_handed_over_by_another_uid_is_refused_and_counted() {
    let mut node = Node::start("", "");
    let c = node.spawn(0, "foreign", &A.to_string());
    let reply = node.reply(c);
    assert_eq!(
        reply,
        format!("ERR the segment was created by uid 0, the peer is uid {A}")
    );
    node.wait_all();
    node.wait_metric("ncclscope_lost_total{stage=\"segment_foreign\"}", 1.0);
    node.wait_metric("ncclscope_segments", 0.0);
}

/// Issue 37: a forged header held the node-wide `ring_full` at 1.8e19 for the daemon's life (another
/// user's losses there changed nothing Prometheus read) and raised a false `forward_panic` of 10^6.
/// B's process, registered through the real socket, writes those counters into its header; A's loses
/// LOST records to a full ring. A's loss is in A's series exactly and in the node-wide figure, which
/// stays below 2^53 (where a change of one still shows); B's counts there stay within its bound.
#[test]
fn a_forged_header_cannot_pin_the_node_wide_loss_figures() {
    let rate = ncclscope::loss::UID_RATE_PER_SEC as f64;
    let mut node = Node::start("", "");
    let started = Instant::now();
    let b = node.spawn(B, "forge", "b");
    assert_eq!(node.reply(b), "OK");
    node.wait_metric(
        &format!("ncclscope_plugin_lost_total{{uid=\"{B}\",stage=\"forward_panic\"}}"),
        1e6,
    );
    let a = node.spawn(A, "lose", "a");
    assert_eq!(node.reply(a), "OK");
    let text = node.wait_metric(
        &format!("ncclscope_plugin_lost_total{{uid=\"{A}\",stage=\"ring_full\"}}"),
        LOST as f64,
    );
    let bound = started.elapsed().as_secs_f64() * rate;
    let value = |sample: &str| -> f64 {
        let v = text
            .lines()
            .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok());
        v.unwrap_or_else(|| panic!("{sample} missing\n{text}"))
    };
    let ring_full = value("ncclscope_lost_total{stage=\"ring_full\"}");
    let forward_panic = value("ncclscope_lost_total{stage=\"forward_panic\"}");
    assert!(
        ring_full < 2f64.powi(53),
        "node-wide ring_full {ring_full}: pinned where A's loss changes nothing"
    );
    assert!(
        ring_full >= LOST as f64 && ring_full <= LOST as f64 + bound,
        "node-wide ring_full {ring_full}: A's {LOST} and at most {bound} of B's"
    );
    assert!(
        forward_panic <= bound,
        "node-wide forward_panic {forward_panic}"
    );
    assert_eq!(
        value(&format!(
            "ncclscope_plugin_lost_total{{uid=\"{B}\",stage=\"ring_full\"}}"
        )),
        (u64::MAX - 3) as f64,
        "B's own figure as it wrote it"
    );
    eprintln!(
        "forged: node-wide ring_full {ring_full} (A lost {LOST}), forward_panic {forward_panic}, bound {bound:.0}"
    );
}

/// Issue 37: reading a segment faulted its pages in, charged to the daemon: one user's 1 GiB memory
/// file that was never written, its header saying a full ring was published, OOM-killed the daemon
/// (and under systemd, every restarted one). A ring of the largest accepted size never written, and
/// one written then punched out after registering, are read through to their head while the daemon's
/// shared memory (RssShmem) stays under 1 MiB and the files gain no page; a sound job is still read.
#[test]
fn reading_a_ring_never_written_or_punched_out_costs_the_daemon_no_memory() {
    let mut node = Node::start("", "");
    let pid = node.daemon.id();
    let shmem_kib = move || -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        (status.lines())
            .find_map(|l| l.strip_prefix("RssShmem:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    };
    let max_log2 = ncclscope_proto::segment::MAX_CAPACITY.trailing_zeros();
    for (log2, punch) in [(max_log2, "0"), (20, "1")] {
        let c = node.spawn(A, "unwritten", &format!("{log2}|{punch}"));
        assert_eq!(node.reply(c), "OK");
        // Sampled while the daemon reads, until the child says it read everything.
        let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = {
            let (peak, done) = (peak.clone(), done.clone());
            std::thread::spawn(move || {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    peak.fetch_max(shmem_kib(), std::sync::atomic::Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        let report = node.reply(c);
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        sampler.join().unwrap();
        let field = |name: &str| -> u64 {
            (report.split(' '))
                .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} in {report}"))
        };
        let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
        eprintln!(
            "unwritten ring of 2^{log2} records, punched {punch}: {report}; daemon RssShmem peak {peak} KiB"
        );
        assert_eq!(
            field("tail"),
            1 << log2,
            "the daemon read every record: {report}"
        );
        assert_eq!(
            field("allocated_after"),
            field("allocated_before"),
            "reading allocated pages of the file"
        );
        assert!(peak < 1024, "daemon RssShmem {peak} KiB");
        assert!(node.children[c].wait().unwrap().success());
    }
    // A sound job of another user is still read whole.
    node.spawn(B, "rank", "0|1");
    node.wait_all();
    node.wait_metric("ncclscope_collectives_total", NCOLLS as f64);
}

/// Issue 37: one memory file registered by a process and by its child (which inherited it) was read
/// by two consumers: its 1,000 collectives spooled and counted twice. The second registration of a
/// file already attached is refused and counted; the job is spooled once.
#[test]
fn one_memory_file_registered_by_two_processes_is_read_once() {
    let mut node = Node::start("", "");
    let c = node.spawn(A, "twice", "first");
    assert_eq!(node.reply(c), "OK");
    let second = node.reply(c);
    assert!(
        second.starts_with("ERR its memory file is attached already, handed over by pid"),
        "{second}"
    );
    node.wait_metric("ncclscope_collectives_total", 1000.0);
    node.wait_metric("ncclscope_lost_total{stage=\"segment_duplicate\"}", 1.0);
    // Past the next statistics snapshot: a second reader would have counted more by now.
    std::thread::sleep(Duration::from_millis(1500));
    node.wait_metric("ncclscope_collectives_total", 1000.0);
    let spool = ncclscope::storage::spool::SpoolReader::open_dir(node.path("spool")).unwrap();
    assert_eq!(spool.read_job(&(A, JOB.into())).count(), 1000);
    std::fs::write(node.path("shared/release.all"), b"").unwrap();
    node.wait_all();
}

/// Issue 37: registration connections had no per-uid bound: one user holding ~21,000 idle ones kept
/// the daemon at its descriptor limit, and another user's job lost spool writes and resume-state
/// saves. The daemon runs with 256 descriptors; A holds `register::MAX_CONNECTIONS_PER_UID` (the most
/// one user may: one more is answered ERR at once) and keeps opening 200 more, re-opening each the
/// daemon closes, while B's job runs: B loses nothing.
#[test]
fn one_user_holding_its_most_registration_connections_costs_another_users_job_nothing() {
    use ncclscope::register::MAX_CONNECTIONS_PER_UID;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut node = Node::start_with("", "", &["prlimit", "--nofile=256", "--"]);
    let socket = node.path("reg.sock");
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (probe_tx, probe_rx) = std::sync::mpsc::channel();
    let hostile = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            rustix::thread::set_thread_uid(rustix::process::Uid::from_raw(A)).unwrap();
            let connect = || UnixStream::connect(&socket).unwrap();
            let mut held: Vec<UnixStream> =
                (0..MAX_CONNECTIONS_PER_UID).map(|_| connect()).collect();
            // One more: answered at once, not after the silent ones' timeout.
            let extra = connect();
            extra
                .set_read_timeout(Some(Duration::from_secs(1)))
                .unwrap();
            let mut reply = String::new();
            let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(&extra), &mut reply);
            probe_tx.send(reply).unwrap();
            // Keep MAX + 200 open, re-opening every one the daemon answered (refused, or timed out).
            while !stop.load(Ordering::Relaxed) {
                held.retain(|s| {
                    s.set_nonblocking(true).unwrap();
                    let mut b = [0u8; 1];
                    matches!(
                        rustix::net::recv(s, &mut b, rustix::net::RecvFlags::PEEK),
                        Err(rustix::io::Errno::AGAIN)
                    )
                });
                while held.len() < MAX_CONNECTIONS_PER_UID + 200 {
                    held.push(connect());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let probe = probe_rx.recv().unwrap();
    assert_eq!(
        probe,
        format!(
            "ERR uid {A} holds {MAX_CONNECTIONS_PER_UID} registration connections not yet \
             answered, the most one user may\n"
        )
    );
    // B's job, while A holds its most (its silent ones time out after 2 s and are re-opened).
    std::thread::sleep(Duration::from_secs(3));
    node.spawn(B, "rank", "0|1");
    node.wait_all();
    let text = node.wait_metric("ncclscope_collectives_total", NCOLLS as f64);
    stop.store(true, Ordering::Relaxed);
    hostile.join().unwrap();
    for stage in ["spool_failed", "state_write_failed"] {
        let sample = format!("ncclscope_lost_total{{stage=\"{stage}\"}} 0");
        assert!(text.lines().any(|l| l == sample), "{sample}\n{text}");
    }
    let refused = sample(
        &text,
        &format!("ncclscope_refused_total{{uid=\"{A}\",stage=\"uid_connection_quota\"}}"),
    );
    assert!(
        refused >= 200.0,
        "A's connections past its most are counted, in A's series: {refused}"
    );
    let spool = ncclscope::storage::spool::SpoolReader::open_dir(node.path("spool")).unwrap();
    assert_eq!(spool.read_job(&(B, JOB.into())).count() as u64, NCOLLS);
    eprintln!(
        "connections: A held {MAX_CONNECTIONS_PER_UID}, {refused} refused; B's {NCOLLS} collectives spooled, 0 spool_failed, 0 state_write_failed"
    );
}

/// A sample's value in a metrics text, which must have it.
fn sample(text: &str, sample: &str) -> f64 {
    let v = ncclscope_tests::sample(text, sample);
    v.unwrap_or_else(|| panic!("{sample} missing\n{text}"))
}

/// Issue 37: any user's junk registrations raised the node-wide `segment_invalid` by 568 k in 15 s,
/// burying another user's refused segment, and nothing said whose they were. A sends JUNK
/// malformed registrations through the real socket, B hands over a segment another uid created:
/// each is counted exactly in its uid's `ncclscope_refused_total`, the node-wide figure takes in A's
/// only up to its rate since its first, and B's refusal shows there in full.
#[test]
fn one_users_junk_registrations_are_its_own_and_cannot_bury_anothers_refusal() {
    use std::io::BufRead;
    use std::os::unix::net::UnixStream;
    const JUNK: u64 = 5_000;
    let mut node = Node::start("", "");
    let socket = node.path("reg.sock");
    let started = Instant::now();
    let hostile = std::thread::spawn(move || {
        rustix::thread::set_thread_uid(rustix::process::Uid::from_raw(A)).unwrap();
        for _ in 0..JUNK {
            let mut s = UnixStream::connect(&socket).unwrap();
            s.write_all(b"junk\n").unwrap();
            let mut reply = String::new();
            std::io::BufReader::new(&s).read_line(&mut reply).unwrap();
            assert!(reply.starts_with("ERR expected `REGISTER`"), "{reply}");
        }
    });
    hostile.join().unwrap();
    let c = node.spawn(0, "foreign", &B.to_string());
    assert_eq!(
        node.reply(c),
        format!("ERR the segment was created by uid 0, the peer is uid {B}")
    );
    node.wait_all();
    node.wait_metric(
        &format!("ncclscope_refused_total{{uid=\"{B}\",stage=\"segment_foreign\"}}"),
        1.0,
    );
    let text = node.wait_metric(
        &format!("ncclscope_refused_total{{uid=\"{A}\",stage=\"segment_invalid\"}}"),
        JUNK as f64,
    );
    let bound =
        started.elapsed().as_secs_f64() * ncclscope::loss::UID_REFUSALS_PER_SEC as f64 + 1.0;
    let invalid = sample(&text, "ncclscope_lost_total{stage=\"segment_invalid\"}");
    assert!(
        invalid <= bound && invalid < JUNK as f64,
        "node-wide segment_invalid {invalid}: A's {JUNK} taken in at most {bound:.0}"
    );
    assert_eq!(
        sample(&text, "ncclscope_lost_total{stage=\"segment_foreign\"}"),
        1.0,
        "B's, in full"
    );
    assert!(
        !text.contains(&format!(
            "ncclscope_refused_total{{uid=\"{B}\",stage=\"segment_invalid\"}}"
        )),
        "A's junk is not B's"
    );
    eprintln!(
        "junk: A's {JUNK} refused exactly in its series, node-wide segment_invalid {invalid} (bound {bound:.0}); B's segment_foreign 1"
    );
}
