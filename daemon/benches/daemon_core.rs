//! Daemon core benchmarks (docs/benchmarks.md, "Daemon"): `cargo bench -p ncclscope --bench daemon_core`.
//!
//! 1. ingest: records drained, decoded and assembled into collectives (with statistics) per second on
//!    one thread, through the real engine over a real segment.
//! 2. export: spans per second through the real OTLP exporter to an in-process OTLP/gRPC receiver that
//!    only counts.
//! 3. rss: the real `ncclscope daemon` with 64 rank processes (8 communicators of 8 ranks) writing
//!    1 M records/s in total for 10 s, OTLP to the counting receiver at sample_ratio 0.01, spool off;
//!    reports the daemon's peak RSS (VmHWM), the records it ingested and every loss counter.
//! 4. real: the real `ncclscope daemon` binary ingesting prefilled segments (150 k collectives,
//!    900 k records, in all), handed over on its socket at once as ranks register: records per
//!    CPU-second of the daemon process and of its ingest thread, kernel records in order or each
//!    written 8 operations late, spool off or on, 1 to 64 ranks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ncclscope::config::Config;
use ncclscope::engine::{Engine, Outputs, SegmentKey};
use ncclscope::export::export_queue::{ExportCounters, SpanItem};
use ncclscope::export::otlp;
use ncclscope::instance::Shared;
use ncclscope::storage::hub::{Durable, Hub};
use ncclscope::storage::spool::{Spool, SpoolLimits};
use ncclscope_proto::api::{ChannelWork, Collective};
use ncclscope_proto::fixture::{self, Coll, Comm};
use ncclscope_proto::segment::{Claims, Producer, Segment};
use ncclscope_proto::{Record, StrId};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

const CHANNELS: u64 = 4;

/// Collective `seq` as the plugin writes it (strings 1-4 from `prelude`).
fn coll(seq: u64) -> Coll {
    Coll {
        id: seq + 1,
        seq,
        count: 1 << (10 + seq % 12),
        n_channels: CHANNELS as u8,
        host_ns: seq,
        ..Coll::default()
    }
}

fn coll_start(seq: u64) -> Record {
    coll(seq).start()
}

/// Collective `seq`'s KernelCh records, one per channel.
fn kernels(p: &mut Producer, seq: u64) {
    let c = coll(seq);
    for ch in 0..CHANNELS {
        let t = 1_000_000 + seq * 10_000 + ch * 10;
        p.push(&c.kernel(ch as u8, (t, t + 5000 + seq % 977), 0));
    }
}

fn op_stop(seq: u64) -> Record {
    coll(seq).stop(seq)
}

fn fill(p: &mut Producer, seq0: u64, n: u64) -> u64 {
    for seq in seq0..seq0 + n {
        p.push(&coll_start(seq));
        kernels(p, seq);
        p.push(&op_stop(seq));
    }
    n * (2 + CHANNELS)
}

/// A segment of `capacity` records, handed to `engine` as process `pid`'s; returns the producer and
/// the process's end of its connection.
fn bench_segment(engine: &mut Engine, pid: u32, capacity: u64) -> (Producer, std::os::fd::OwnedFd) {
    let claims = Claims {
        hostname: "bench".into(),
        job_id: "bench".into(),
        slurm_job_id: String::new(),
    };
    let p = Producer::new(Segment::create(&claims, capacity).unwrap());
    let (ours, theirs) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let key = SegmentKey {
        uid: rustix::process::getuid().as_raw(),
        pid,
        inode: p.segment().inode(),
    };
    let seg = Segment::open(p.segment().fd().try_clone_to_owned().unwrap()).unwrap();
    engine.attach(key, seg, Some(theirs)).unwrap();
    (p, ours)
}

/// `fill` with each operation's KernelCh records written `lag` operations late (after the host
/// events of the operations that follow), as NCCL's proxy thread reports kernels while the host
/// enqueues the next collectives.
fn fill_late_kernels(p: &mut Producer, seq0: u64, n: u64, lag: u64) -> u64 {
    for seq in seq0..seq0 + n {
        p.push(&coll_start(seq));
        p.push(&op_stop(seq));
        if seq >= seq0 + lag {
            kernels(p, seq - lag);
        }
    }
    for seq in (seq0 + n).saturating_sub(lag).max(seq0)..seq0 + n {
        kernels(p, seq);
    }
    n * (2 + CHANNELS)
}

/// What a rank announces before its collectives: the strings `fill` uses, its communicator and a
/// calibration of its device.
fn prelude(p: &mut Producer, comm_hash: u64, rank: u32, nranks: u32, cuda_dev: i32) {
    for (id, t) in [
        (1, "AllReduce"),
        (2, "ncclBfloat16"),
        (3, "RING"),
        (4, "LL128"),
    ] {
        p.push(&Record::str(StrId(id), t.as_bytes()));
    }
    let comm = Comm {
        comm_hash,
        rank,
        nranks,
        cuda_dev,
        nccl_version: 22809,
        ..Comm::default()
    };
    p.push(&comm.record());
    p.push(&fixture::calibration(cuda_dev, 1 << 60, 100));
}

/// (records/s of wall time, records/s of the engine thread's CPU time, records/s of the process's
/// CPU time: the engine and the spool writer thread) with `ranks` processes' segments, ranks of one
/// communicator (from 2 on, every collective also goes through the cross-rank skew); `spool`: every
/// instance also appended to a spool in a temporary directory (by the spool writer thread, one
/// fdatasync per group of batches), each round timed until the spool has it all.
fn ingest(ranks: u64, spool: bool) -> (f64, f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config {
        state_dir: dir.path().join("state"),
        ..Config::default()
    };
    std::fs::create_dir_all(&cfg.state_dir).unwrap();
    let (prom, _rx) = tokio::sync::watch::channel(Arc::default());
    let outputs = Outputs {
        spans: None,
        metrics: None,
        export_counters: Arc::default(),
        dropped: None,
        prometheus: prom,
        host_name: "bench".into(),
    };
    let spool = spool.then(|| {
        let s = Spool::open(dir.path().join("spool"), SpoolLimits::default()).unwrap();
        Box::new(s) as Box<dyn Durable>
    });
    let mut engine = Engine::new(
        Arc::new(cfg.clone()),
        Arc::new(Hub::default()),
        spool,
        outputs,
    )
    .unwrap();
    // 150 k collectives (900 k records) per round in all; one warm-up round, then 6 measured.
    let per_rank = 150_000 / ranks;
    let capacity = (per_rank * (2 + CHANNELS)).next_power_of_two();
    let mut producers = Vec::new();
    for rank in 0..ranks {
        let (mut p, conn) = bench_segment(&mut engine, std::process::id() + rank as u32, capacity);
        prelude(&mut p, 7, rank as u32, ranks.max(8) as u32, rank as i32);
        producers.push((conn, p));
    }
    let (mut records, mut wall, mut cpu) = (0u64, Duration::ZERO, Duration::ZERO);
    let mut process = Duration::ZERO;
    for round in 0..7 {
        let mut written = 0;
        for (_, p) in &mut producers {
            written += fill(p, round * per_rank, per_rank);
        }
        let (t, c, pc) = (Instant::now(), thread_cpu(), process_cpu());
        while engine.tick() {
            if engine.spool_behind() {
                // As the daemon's loop does (it ticks again after 1 ms when busy).
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        engine.tick();
        let c = thread_cpu() - c;
        assert!(engine.flush(Duration::from_secs(60)), "spool flushed");
        if round > 0 {
            records += written;
            wall += t.elapsed();
            cpu += c;
            process += process_cpu() - pc;
        }
        // Untimed: the engine commits a drained tail at most every 10 ms; free the rings for the next round.
        std::thread::sleep(Duration::from_millis(15));
        engine.tick();
        assert!(engine.flush(Duration::from_secs(60)), "states saved");
    }
    let health = engine.health();
    let lost: Vec<_> = health.lost.iter().filter(|(_, n)| **n > 0).collect();
    assert!(lost.is_empty(), "nothing lost: {lost:?}");
    assert_eq!(
        health.collectives,
        7 * per_rank * ranks,
        "every collective assembled"
    );
    (
        records as f64 / wall.as_secs_f64(),
        records as f64 / cpu.as_secs_f64(),
        records as f64 / process.as_secs_f64(),
    )
}

/// CPU time of this process (all its threads).
fn process_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// CPU time of this thread: "per core" figures that do not depend on what else the machine runs.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

struct Counting(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for Counting {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let n: usize = request
            .into_inner()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.0.fetch_add(n as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn export() -> f64 {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let received = Arc::new(AtomicU64::new(0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(
                    TraceServiceServer::new(Counting(received.clone()))
                        .max_decoding_message_size(64 << 20),
                )
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let mut cfg = Config::default().otlp;
        cfg.batch_spans = 2048;
        cfg.endpoint = format!("http://{addr}");
        cfg.request_timeout_ms = 10_000;
        let channel = otlp::channel(&cfg).unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(cfg.queue_spans);
        let (_mtx, mrx) = tokio::sync::mpsc::channel(1);
        let counters = Arc::new(ExportCounters::default());
        let exporter = tokio::spawn(otlp::run(
            cfg,
            "bench".into(),
            channel,
            rx,
            mrx,
            counters.clone(),
            None,
        ));
        let acked = Arc::new(AtomicU64::new(0));
        let n = 200_000u64;
        // As from the assembler: every instance shares its process's strings.
        let template = Shared::from(&Collective {
            job_id: "bench".into(),
            comm_hash: 7,
            nranks: 8,
            func: "AllReduce".into(),
            datatype: "ncclBfloat16".into(),
            algo: "RING".into(),
            proto: "LL128".into(),
            timing_source: "kernel_gpu".into(),
            channels: (0..4)
                .map(|c| ChannelWork {
                    channel: c,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        });
        let t = Instant::now();
        for seq in 0..n {
            let mut coll = template.clone();
            coll.inst.rank = 1 + (seq % 7) as u32; // not rank 0: one span per instance
            coll.inst.desc.seq = seq;
            tx.send(SpanItem {
                coll,
                acked: Some(acked.clone()),
                emit_no: seq + 1,
                settles: None,
            })
            .await
            .unwrap();
        }
        drop(tx);
        drop(_mtx);
        exporter.await.unwrap();
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(
            received.load(Ordering::Relaxed),
            n,
            "receiver got every span"
        );
        assert_eq!(acked.load(Ordering::Relaxed), n);
        n as f64 / secs
    })
}

const RANK_ENV: &str = "NCCLSCOPE_BENCH_RANK";
const RANKS: u64 = 64;
const RECORDS_PER_SEC: u64 = 1_000_000;
const RUN: Duration = Duration::from_secs(10);

/// What `rss` runs: `NCCLSCOPE_BENCH_RSS=ranks,records_per_sec,spool` (spool 0 or 1; default
/// RANKS, RECORDS_PER_SEC, 0), e.g. `32,500000,1` for the spool at 32 ranks.
fn rss_params() -> (u64, u64, bool) {
    let v = std::env::var("NCCLSCOPE_BENCH_RSS").unwrap_or_default();
    let f: Vec<u64> = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
    match f[..] {
        [ranks, rate, spool] => (ranks.max(1), rate, spool != 0),
        _ => (RANKS, RECORDS_PER_SEC, false),
    }
}

/// A simulated rank process: `socket|rank|ranks|records_per_sec`, writing its share of the records
/// a second.
fn rank_child(spec: &str) {
    let f: Vec<&str> = spec.split('|').collect();
    let (socket, rank) = (f[0], f[1].parse::<u64>().unwrap());
    let (ranks, rate): (u64, u64) = (f[2].parse().unwrap(), f[3].parse().unwrap());
    let claims = Claims {
        hostname: "bench".into(),
        job_id: "bench".into(),
        slurm_job_id: String::new(),
    };
    let mut p = Producer::new(Segment::create(&claims, 1 << 16).unwrap());
    let _registered = ncclscope_fakenccl::process::Registrant::start(
        std::path::Path::new(socket),
        p.segment(),
        Duration::from_secs(10),
    );
    prelude(&mut p, 0xbe7c_0000 + rank / 8, (rank % 8) as u32, 8, 0);
    let colls_per_sec = rate as f64 / ranks as f64 / (2 + CHANNELS) as f64;
    let t0 = Instant::now();
    let mut seq = 0;
    while t0.elapsed() < RUN {
        let due = (t0.elapsed().as_secs_f64() * colls_per_sec) as u64;
        if due > seq {
            fill(&mut p, seq, due - seq);
            seq = due;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    p.push(&Record::CommEnd {
        comm: 0,
        host_ns: 0,
    });
    p.segment().close();
}

/// A field of /proc/PID/status in KiB (VmHWM, VmRSS, RssAnon, RssShmem).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .strip_prefix(':')?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn rss() {
    let (nranks, rate, spool) = rss_params();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let received = Arc::new(AtomicU64::new(0));
    let addr = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(Counting(received.clone())))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    });
    let dir = tempfile::tempdir().unwrap();
    let (config, port) = daemon_config(
        dir.path(),
        spool,
        &format!(
            "[otlp]\nendpoint = \"http://{addr}\"\nsample_ratio = 0.01\nmetrics_interval_ms = 3600000\n"
        ),
    );
    let (mut daemon, socket) = start_daemon(&config, dir.path());
    let cpu0 = run_ns(daemon.id(), None);
    // Peak private (anonymous) memory, sampled: VmHWM also counts the segments' shared pages, which
    // belong to the ranks' rings (64 x 4 MiB here) rather than to the daemon.
    let daemon_pid = daemon.id();
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        std::thread::spawn(move || {
            let (mut anon, mut shmem) = (0, 0);
            while sampling.load(Ordering::Relaxed) {
                anon = status_kib(daemon_pid, "RssAnon").max(anon);
                shmem = status_kib(daemon_pid, "RssShmem").max(shmem);
                std::thread::sleep(Duration::from_millis(20));
            }
            (anon, shmem)
        })
    };
    let ranks: Vec<_> = (0..nranks)
        .map(|r| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .env(
                    RANK_ENV,
                    format!("{}|{r}|{nranks}|{rate}", socket.display()),
                )
                .spawn()
                .unwrap()
        })
        .collect();
    for mut r in ranks {
        assert!(r.wait().unwrap().success());
    }
    // Let the daemon finish draining, then read its own account.
    std::thread::sleep(Duration::from_secs(3));
    let metrics = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut t = String::new();
        s.read_to_string(&mut t).unwrap();
        t
    };
    let hwm = status_kib(daemon_pid, "VmHWM");
    let cpu = run_ns(daemon_pid, None) - cpu0;
    let (ingest, spooler, states) = (
        run_ns(daemon_pid, Some("ncclscope-ingest")),
        run_ns(daemon_pid, Some("ncclscope-spool")),
        run_ns(daemon_pid, Some("ncclscope-state")),
    );
    sampling.store(false, Ordering::Relaxed);
    let (anon, shmem) = sampler.join().unwrap();
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(daemon.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    );
    let _ = daemon.wait();
    let value = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    println!(
        "rss: daemon peak private (anon) RSS {:.1} MiB; VmHWM {:.1} MiB incl. up to {:.1} MiB of mapped segment pages; \
         {nranks} ranks at {:.2} M records/s offered for {:?}{}; ingested {:.0} records, {:.0} collectives, {} spans received; \
         daemon CPU {:.2} s (ingest thread {:.2} s, spool writer thread {:.2} s, state writer thread {:.2} s)",
        anon as f64 / 1024.0,
        hwm as f64 / 1024.0,
        shmem as f64 / 1024.0,
        rate as f64 / 1e6,
        RUN,
        if spool { ", spool on" } else { "" },
        value("ncclscope_records_total"),
        value("ncclscope_collectives_total"),
        received.load(Ordering::Relaxed),
        cpu as f64 / 1e9,
        ingest as f64 / 1e9,
        spooler as f64 / 1e9,
        states as f64 / 1e9,
    );
    let losses: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("ncclscope_lost_total{") && !l.ends_with(" 0"))
        .collect();
    println!("rss: non-zero loss counters: {losses:?}");
}

/// The daemon binary `rss` and `real` run: this build's, or `NCCLSCOPE_BENCH_DAEMON` (another
/// build's, to compare side by side).
fn daemon_binary() -> std::path::PathBuf {
    std::env::var_os("NCCLSCOPE_BENCH_DAEMON").map_or(
        env!("CARGO_BIN_EXE_ncclscope").into(),
        std::path::PathBuf::from,
    )
}

/// The daemon binary run with `config` (written by [`daemon_config`] into `dir`), once its
/// registration socket takes connections; the child and that socket.
fn start_daemon(
    config: &std::path::Path,
    dir: &std::path::Path,
) -> (std::process::Child, std::path::PathBuf) {
    let daemon = std::process::Command::new(daemon_binary())
        .args(["daemon", "--config"])
        .arg(config)
        .env("NCCLSCOPE_LOG", "warn")
        .spawn()
        .unwrap();
    let socket = dir.join("s.sock");
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        std::thread::sleep(Duration::from_millis(20));
    }
    (daemon, socket)
}

/// Run time of a thread (/proc/PID/task/TID/schedstat, ns) or of all of a process's threads.
fn run_ns(pid: u32, thread: Option<&str>) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    let mut ns = 0;
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        // The kernel keeps 15 bytes of a thread's name.
        if thread.is_some_and(|name| comm.trim() != &name[..name.len().min(15)]) {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
        ns += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    ns
}

/// A daemon's configuration in `dir`: its sockets and state there, the spool too if `spool`,
/// Prometheus on a free port, then `more` (further sections). Its path and the Prometheus port.
fn daemon_config(dir: &std::path::Path, spool: bool, more: &str) -> (std::path::PathBuf, u16) {
    let d = dir.display();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let spool_dir = match spool {
        true => format!("{d}/spool"),
        false => String::new(),
    };
    let config = dir.join("ncclscope.toml");
    std::fs::write(
        &config,
        format!(
            "socket = \"{d}/s.sock\"\napi_socket = \"{d}/api.sock\"\nstate_dir = \"{d}/state\"\n\
             [spool]\ndir = \"{spool_dir}\"\n[prometheus]\nlisten = \"127.0.0.1:{port}\"\n{more}"
        ),
    )
    .unwrap();
    (config, port)
}

/// Records per CPU-second of the daemon process and of its ingest thread.
struct Rate {
    process: f64,
    ingest: f64,
}

/// Rounds the real daemon ingests after the first, in steady state.
const WARM_ROUNDS: u64 = 3;

/// The real daemon binary over prefilled segments, every loss counter checked zero: (cold, warm).
/// Cold: the first 150 k collectives, in segments the daemon finds full (as after a burst or its
/// own restart), CPU counted from just before they are handed over until the daemon's metrics
/// (refreshed every second) count every collective, so it includes up to a second of idle ticks and
/// everything a daemon does once (series, maps and buffers growing, the segments' pages mapped).
/// Warm: [`WARM_ROUNDS`] more rounds of 150 k, each written once the daemon committed the one
/// before (every segment's tail at its head), CPU counted until the last round is committed: the
/// ingest rate of a daemon already running, as the in-process `ingest` bench measures it.
fn real(ranks: u64, spool: bool, late_kernels: bool) -> (Rate, Rate) {
    let dir = tempfile::tempdir().unwrap();
    let (config, port) = daemon_config(dir.path(), spool, "");
    // The segments first: the daemon finds them full, as after a burst or its own restart.
    let per_rank = 150_000 / ranks;
    let capacity = (per_rank * (2 + CHANNELS) + 64).next_power_of_two();
    let write = |p: &mut Producer, round: u64| match late_kernels {
        true => fill_late_kernels(p, round * per_rank, per_rank, 8),
        false => fill(p, round * per_rank, per_rank),
    };
    let mut records = 0;
    let mut producers: Vec<Producer> = (0..ranks)
        .map(|rank| {
            let claims = Claims {
                hostname: "bench".into(),
                job_id: "bench".into(),
                slurm_job_id: String::new(),
            };
            let mut p = Producer::new(Segment::create(&claims, capacity).unwrap());
            prelude(&mut p, 0xbe7c, rank as u32, ranks as u32, rank as i32);
            records += write(&mut p, 0);
            p
        })
        .collect();
    let (mut daemon, socket) = start_daemon(&config, dir.path());
    let scrape = || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut t = String::new();
        s.read_to_string(&mut t).unwrap();
        t
    };
    let value = |text: &str, name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let pid = daemon.id();
    std::thread::sleep(Duration::from_millis(200));
    // The daemon's CPU so far: (process, ingest thread), ns.
    let cpu = || (run_ns(pid, None), run_ns(pid, Some("ncclscope-ingest")));
    let (t0, cpu0) = (Instant::now(), cpu());
    let conns: Vec<_> = (producers.iter())
        .map(|p| {
            let fd = p.segment().fd();
            ncclscope_fakenccl::process::register(&socket, fd, Duration::from_secs(10)).unwrap()
        })
        .collect();
    // The metrics' text once they count `n` collectives.
    let counted = |n: u64| loop {
        let text = scrape();
        if value(&text, "ncclscope_collectives_total") >= n as f64 {
            break text;
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "not ingested");
        // The counters behind /metrics change once a second: polling faster finds the end no
        // sooner, and each render is the daemon's CPU (every 5 ms, a tenth of what was measured).
        std::thread::sleep(Duration::from_millis(100));
    };
    counted(per_rank * ranks);
    let cold = rate(records, cpu0, cpu());
    let committed = |producers: &[Producer]| {
        let t0 = Instant::now();
        while !producers
            .iter()
            .all(|p| p.segment().tail() == p.segment().head())
        {
            assert!(t0.elapsed() < Duration::from_secs(300), "not committed");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    committed(&producers);
    let cpu0 = cpu();
    let mut records = 0;
    for round in 1..=WARM_ROUNDS {
        for p in &mut producers {
            records += write(p, round);
        }
        committed(&producers);
    }
    let warm = rate(records, cpu0, cpu());
    let text = counted(per_rank * ranks * (1 + WARM_ROUNDS));
    let lost: Vec<&str> = (text.lines())
        .filter(|l| l.starts_with("ncclscope_lost_total{") && !l.ends_with(" 0"))
        .collect();
    assert!(lost.is_empty(), "nothing lost: {lost:?}");
    drop(conns);
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::TERM,
    );
    let _ = daemon.wait();
    (cold, warm)
}

/// `records` over the CPU (process, ingest thread; ns) spent between `from` and `to`.
fn rate(records: u64, from: (u64, u64), to: (u64, u64)) -> Rate {
    Rate {
        process: records as f64 / ((to.0 - from.0) as f64 / 1e9),
        ingest: records as f64 / ((to.1 - from.1) as f64 / 1e9),
    }
}

fn main() {
    if let Ok(spec) = std::env::var(RANK_ENV) {
        return rank_child(&spec);
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // `cargo bench -p ncclscope --bench daemon_core -- [ingest] [export] [rss]`: a subset; default all.
    let args: Vec<String> = std::env::args().collect();
    let all = !["ingest", "export", "rss", "real"]
        .iter()
        .any(|p| args.iter().any(|a| a == p));
    let want = |part: &str| all || args.iter().any(|a| a == part);
    if want("ingest") {
        // NCCLSCOPE_BENCH_INGEST=ranks,spool (e.g. `8,1`): that case only (to profile it).
        let only: Vec<u64> = (std::env::var("NCCLSCOPE_BENCH_INGEST").unwrap_or_default())
            .split(',')
            .filter_map(|x| x.trim().parse().ok())
            .collect();
        for (ranks, spool) in [(1, false), (8, false), (8, true)] {
            if let [r, s] = only[..]
                && (r, s != 0) != (ranks, spool)
            {
                continue;
            }
            let (wall, cpu, process) = ingest(ranks, spool);
            let sinks = if spool { " + spool" } else { "" };
            println!(
                "ingest, {ranks} rank(s){sinks}: {:.2} M records per CPU-second of the engine thread, \
                 {:.2} M of the process ({:.2} M/s of wall time) (engine tick: drain + decode + \
                 assemble + stats + hub{sinks})",
                cpu / 1e6,
                process / 1e6,
                wall / 1e6
            );
        }
    }
    if want("export") {
        let export = export();
        println!(
            "export: {:.0} k spans/s to a local OTLP/gRPC receiver",
            export / 1e3
        );
    }
    if want("rss") {
        rss();
    }
    if want("real") {
        // NCCLSCOPE_BENCH_REAL=ranks,spool,late (e.g. `8,0,0`): that case only (to profile it).
        let only: Vec<u64> = (std::env::var("NCCLSCOPE_BENCH_REAL").unwrap_or_default())
            .split(',')
            .filter_map(|x| x.trim().parse().ok())
            .collect();
        for (ranks, spool, late) in [
            (1, false, false),
            (1, false, true),
            (8, false, false),
            (8, false, true),
            (8, true, false),
            (32, true, false),
            (64, true, false),
        ] {
            if let [r, s, l] = only[..]
                && (r, s != 0, l != 0) != (ranks, spool, late)
            {
                continue;
            }
            let (cold, warm) = real(ranks, spool, late);
            println!(
                "real daemon, {ranks} prefilled segment(s){}{}: {:.2} M records per CPU-second of the \
                 process, {:.2} M of its ingest thread; warm ({WARM_ROUNDS} more rounds): {:.2} M, \
                 {:.2} M",
                if late {
                    ", kernel records 8 operations late"
                } else {
                    ""
                },
                if spool { " + spool" } else { "" },
                cold.process / 1e6,
                cold.ingest / 1e6,
                warm.process / 1e6,
                warm.ingest / 1e6,
            );
        }
    }
}
