//! Nothing lost but what was lost: every collective of every rank becomes its spans with exact times,
//! and a record lost of each kind, or a plugin thread that panicked, costs only its own operation and
//! is counted.

use crate::support::*;

/// Issue 16: one record lost of each kind (a CollStart, a KernelCh, an OpStop, each counted by the
/// "plugin" as `queue_full`) in a job of 20,000 collectives written in bursts of 512 (3,072 records)
/// through a 16 Ki-record ring: nothing beyond them is lost (`ring_full` 0), every other collective
/// is delivered, the two that lost a record are delivered as `incomplete`, and the tail never had to
/// be forced past open operations (which would cost a restarted daemon those operations): the
/// operations read before each gap were parked with their state saved instead. The writer keeps the
/// ring at most a quarter full, waiting for the daemon's commit before a burst: a daemon starved by a
/// loaded machine then costs time, not records or forced commits, while one whose tail waits on the
/// broken operation (until `op_timeout`, 10 s) makes it wait seconds, which fails the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_lost_of_each_kind_costs_only_its_own_operation() {
    const NCOLLS: u64 = 20_000;
    // No spans: a span not yet acknowledged also holds the tail (and, over half full, forces it).
    let (h, _collector) = Scenario::new()
        .otlp("sample_ratio = 0.0")
        .start_with_collector()
        .await;
    let spec = format!(
        "{}|16384|{NCOLLS}|512|30000|start:5000,kernel:10000,stop:15000|4096",
        h.socket().display()
    );
    let out = child_test("lossy_rank_child", LOSSY_ENV, &spec)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let waited_ms: u64 = (stdout.lines())
        .find_map(|l| l.strip_prefix("max_wait_ms "))
        .and_then(|n| n.parse().ok())
        .expect("max_wait_ms");
    if !stdout.contains("ring_full 0\n") || waited_ms >= 5000 {
        let text = h.metrics();
        let counters: Vec<&str> = (text.lines())
            .filter(|l| {
                !l.starts_with('#') && ["lost", "commit", "parked"].iter().any(|w| l.contains(w))
            })
            .collect();
        panic!("{stdout}\nthe daemon's counters:\n{}", counters.join("\n"));
    }
    let drained = |text: &str| sample(text, "ncclscope_segments") == Some(0.0);
    let text = h.metrics_when(Duration::from_secs(60), Duration::from_millis(200), drained);
    assert!(drained(&text), "segment not drained: {text}");
    let stage = |s: &str| lost(&text, s);
    assert_eq!(stage("ring_full"), Some(0.0), "{text}");
    assert_eq!(stage("queue_full"), Some(3.0));
    assert_eq!(stage("incomplete"), Some(2.0), "{text}");
    assert_eq!(
        stage("kernel_unjoined"),
        Some(4.0),
        "the start's 4 KernelCh"
    );
    assert_eq!(
        sample(&text, "ncclscope_collectives_total"),
        Some((NCOLLS - 1) as f64),
        "every collective but the one never started"
    );
    assert_eq!(sample(&text, "ncclscope_forced_commits_total"), Some(0.0));
    assert!(sample(&text, "ncclscope_parked_operations_total").is_some_and(|n| n >= 2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_ranks_of_a_collective_share_one_trace_with_calibrated_times_and_nothing_is_lost() {
    const NRANKS: u32 = 4;
    const NCOLLS: u64 = 40;
    let (mut h, mut collector) = Scenario::new().start_with_collector().await;
    h.start_ranks(NRANKS, NCOLLS, 0);
    h.wait_ranks();

    let expected_rank_spans = (NRANKS as u64 * NCOLLS) as usize;
    let mut spans = Vec::new();
    collect(&mut collector, &mut spans, Duration::from_secs(60), |s| {
        rank_spans(s).len() >= expected_rank_spans
            && s.len() >= expected_rank_spans + NCOLLS as usize
    })
    .await;
    assert_eq!(
        rank_spans(&spans).len(),
        expected_rank_spans,
        "one span per rank per collective"
    );
    assert_eq!(
        spans.len(),
        expected_rank_spans + NCOLLS as usize,
        "plus one root per collective"
    );

    let mut by_seq: BTreeMap<u64, Vec<&ExportedSpan>> = BTreeMap::new();
    for s in &spans {
        by_seq
            .entry(attr(s, "nccl.seq").parse().unwrap())
            .or_default()
            .push(s);
    }
    assert_eq!(by_seq.len(), NCOLLS as usize);
    for (seq, group) in &by_seq {
        let trace: BTreeSet<&str> = group.iter().map(|s| s.trace_id.as_str()).collect();
        assert_eq!(trace.len(), 1, "seq {seq}: every rank's span in one trace");
        let roots: Vec<_> = group
            .iter()
            .filter(|s| s.parent_span_id.is_empty())
            .collect();
        assert_eq!(roots.len(), 1, "seq {seq}: one root");
        let ranks: BTreeSet<&str> = group
            .iter()
            .filter(|s| s.parent_span_id == roots[0].span_id)
            .map(|s| attr(s, "nccl.rank"))
            .collect();
        assert_eq!(
            ranks.len(),
            NRANKS as usize,
            "seq {seq}: each rank's span is a child of the root"
        );
        // Issue 17: the root was rank 0's view and rank spans ended after it. It covers them.
        let root = roots[0];
        let children = group.iter().filter(|s| s.parent_span_id == root.span_id);
        for s in children.clone() {
            assert!(
                root.start_time_unix_nano <= s.start_time_unix_nano
                    && s.end_time_unix_nano <= root.end_time_unix_nano,
                "seq {seq}: rank {} outside its root",
                attr(s, "nccl.rank")
            );
        }
        assert_eq!(
            root.end_time_unix_nano,
            children.map(|s| s.end_time_unix_nano).max().unwrap(),
            "seq {seq}: the root ends with its last rank"
        );
        for s in group.iter().filter(|s| !s.parent_span_id.is_empty()) {
            let rank: u32 = attr(s, "nccl.rank").parse().unwrap();
            let (mut start, mut end, mut exec) = (u64::MAX, 0, 0);
            for ch in 0..CHANNELS {
                let (a, b) = gpu_times(rank, *seq, ch);
                start = start.min(a);
                end = end.max(b);
                exec = exec.max(b - a);
            }
            let host = |gpu: u64| (gpu as i64 + offset(rank)) as u64;
            assert_eq!(
                (s.start_time_unix_nano, s.end_time_unix_nano),
                (host(start), host(end)),
                "seq {seq} rank {rank}"
            );
            assert_eq!(attr(s, "nccl.exec_ns"), exec.to_string());
            assert_eq!(
                attr(s, "nccl.calibration_error_ns"),
                (100 + rank).to_string()
            );
            assert_eq!(attr(s, "nccl.collective"), "AllReduce");
            assert_eq!(attr(s, "nccl.nranks"), NRANKS.to_string());
            assert_eq!(attr(s, "nccl.comm_hash"), format!("{COMM_HASH:016x}"));
            assert_eq!(attr(s, "nccl.algo"), "RING");
            assert_eq!(attr(s, "nccl.proto"), "SIMPLE");
            assert_eq!(attr(s, "nccl.datatype"), "ncclFloat32");
            assert_eq!(attr(s, "nccl.bytes"), (4u64 << 18).to_string());
            assert_eq!(attr(s, "nccl.channels"), CHANNELS.to_string());
            assert_eq!(attr(s, "job.id"), JOB);
        }
    }

    // Metrics: every collective counted, every record read, the plugins' own loss counters carried.
    let total = NRANKS as u64 * NCOLLS;
    let text = h.metrics_when(Duration::from_secs(30), Duration::from_millis(200), |t| {
        sample(t, "ncclscope_collectives_total") == Some(total as f64)
            && sample(t, "ncclscope_segments") == Some(0.0)
    });
    assert_eq!(
        sample(&text, "ncclscope_collectives_total"),
        Some(total as f64),
        "{text}"
    );
    assert_eq!(
        sample(&text, "ncclscope_records_total"),
        Some((NRANKS as u64 * records_per_rank(NCOLLS)) as f64)
    );
    let queue_full: u64 = (1..=NRANKS as u64).sum();
    assert_eq!(lost(&text, "queue_full"), Some(queue_full as f64));
    for stage in [
        "ring_full",
        "incomplete",
        "kernel_unjoined",
        "export_dropped",
        "spool_failed",
    ] {
        assert!(matches!(lost(&text, stage), None | Some(0.0)), "{stage}");
    }
    let exec_count = summed(
        &text,
        "ncclscope_collective_exec_time_microseconds_count{",
        "",
    );
    assert_eq!(
        exec_count, total as f64,
        "every instance in the exec-time histogram"
    );
    let stragglers = sample(
        &text,
        &format!(
            "ncclscope_rank_straggler_total{{uid=\"{}\",job_id=\"{JOB}\",comm=\"{COMM_HASH:016x}\",rank=\"3\",when=\"start\"}}",
            rustix::process::getuid().as_raw()
        ),
    );
    assert_eq!(
        stragglers,
        Some(NCOLLS as f64),
        "rank 3 starts last every time (after calibration)"
    );
    // Exited processes' segments are drained and removed.
    assert_eq!(h.segments_left(), 0);

    // SIGHUP and SIGUSR1 (logrotate, an operator expecting a reload) are logged and ignored.
    let pid = rustix::process::Pid::from_raw(h.daemon.as_ref().unwrap().id() as i32).unwrap();
    for sig in [rustix::process::Signal::HUP, rustix::process::Signal::USR1] {
        rustix::process::kill_process(pid, sig).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(h.daemon_alive(), "SIGHUP or SIGUSR1 stopped the daemon");
    // SIGTERM: drain, flush, exit cleanly.
    h.stop_daemon();
}

/// The real plugin `.so` in fake-NCCL ranks (stock KernelCh path on NCCL 2.28's v5 ABI, and the
/// device-hook path on an RFC host): every operation each rank's NCCL emitted becomes one span with
/// exactly the kernel timings NCCL reported, ranks of one collective share a trace, and the
/// device-hook work items all join their collective.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_nccl_ranks_through_the_real_plugin_become_spans_with_their_kernel_timings() {
    const NRANKS: u32 = 2;
    const NCOLLS: u32 = 30;
    const P2PS: u32 = 4;
    let (h, mut collector) = Scenario::new().start_with_collector().await;
    let (colls, p2ps) = (NCOLLS.to_string(), P2PS.to_string());
    let mut children = Vec::new();
    for (kind, comm_hash) in [
        ("v5", 0x1111_0000_0000_0000u64),
        ("rfc", 0x2222_0000_0000_0000),
    ] {
        let ranks = FakeRanks::new(kind, "fake-job")
            .ranks(NRANKS)
            .comm_hash(comm_hash)
            .args(&["--colls", &colls, "--p2ps", &p2ps, "--channels", "3"])
            .args(&["--kernel-ns", "15000", "--interval-us", "200"])
            .spawn(&h);
        children.extend(ranks.into_iter().map(|child| (kind, child)));
    }
    let reports: Vec<_> = (children.into_iter())
        .map(|(kind, child)| (kind, report(child)))
        .collect();
    let ops_per_rank = (NCOLLS + P2PS) as usize;
    let expected = reports.len() * ops_per_rank;
    let mut spans = collect_rank_spans(&mut collector, expected, Duration::from_secs(60)).await;
    let rank_spans: Vec<&ExportedSpan> = spans.iter().filter(|s| is_rank_span(s)).collect();
    assert_eq!(
        rank_spans.len(),
        expected,
        "one span per operation per rank"
    );

    let mut traces: HashMap<(String, String, u64), BTreeSet<String>> = HashMap::new();
    for (kind, report) in &reports {
        let comm = &report.comms[0];
        for op in comm.ops.iter().filter(|o| o.started) {
            let is_p2p = op.kind == ncclscope_fakenccl::OpKind::P2p;
            let mine: Vec<&&ExportedSpan> = rank_spans
                .iter()
                .filter(|s| {
                    attr(s, "process.pid") == report.pid.to_string()
                        && attr(s, "nccl.collective") == op.func
                        && if is_p2p {
                            // p2p has no NCCL seq; each of this rank's sends/receives has its own count.
                            attr(s, "nccl.count") == op.count.to_string()
                        } else {
                            attr(s, "nccl.seq") == op.seq.to_string()
                        }
                })
                .collect();
            assert!(
                !mine.is_empty(),
                "{kind} rank {} op {} seq {}: no span",
                comm.rank,
                op.func,
                op.seq
            );
            // Per channel, the times NCCL reported: KernelCh pTimers (stock) or hook items (RFC).
            let times: Vec<(u64, u64)> = if *kind == "rfc" {
                op.hook_items
                    .iter()
                    .map(|i| (i.gpu_start, i.gpu_stop))
                    .collect()
            } else {
                op.kernels
                    .iter()
                    .map(|k| (k.gpu_start, k.gpu_stop))
                    .collect()
            };
            let exec = times.iter().map(|(a, b)| b - a).max().unwrap();
            let wall =
                times.iter().map(|t| t.1).max().unwrap() - times.iter().map(|t| t.0).min().unwrap();
            // On the hook path too a send or receive is timed by its round's work items (those it
            // shares with the receive of its round included).
            let s = mine.iter().find(|s| {
                attr(s, "nccl.exec_ns") == exec.to_string()
                    && s.end_time_unix_nano - s.start_time_unix_nano == wall
            });
            let s = s.unwrap_or_else(|| {
                panic!(
                    "{kind} rank {} {} seq {}: no span with exec {exec} and wall {wall}: {mine:?}",
                    comm.rank, op.func, op.seq
                )
            });
            let source = match *kind {
                "rfc" => "device_hook",
                _ => "kernel_gpu",
            };
            assert_eq!(attr(s, "nccl.timing_source"), source);
            // On the host clock (calibrated, or anchored to the plugin's host stamps), not the GPU's.
            let age_s =
                (ncclscope_proto::now_ns() as i64 - s.start_time_unix_nano as i64) / 1_000_000_000;
            assert!(
                (0..600).contains(&age_s),
                "{kind} span starts {age_s} s ago"
            );
            assert_eq!(attr(s, "nccl.datatype"), op.datatype);
            assert_eq!(attr(s, "nccl.count"), op.count.to_string());
            assert_eq!(attr(s, "job.id"), "fake-job");
            if !is_p2p {
                traces
                    .entry((kind.to_string(), op.func.clone(), op.seq))
                    .or_default()
                    .insert(s.trace_id.clone());
            }
        }
    }
    assert_eq!(traces.len(), 2 * NCOLLS as usize);
    assert!(
        traces.values().all(|t| t.len() == 1),
        "both ranks of each collective in one trace"
    );
    // Each collective's root span came too (issue 37: a rank read before the other's
    // communicator was known met no other, and the roots of the node's first collectives never
    // came; they are sent when the skew window closes, over the ranks that came).
    let want: BTreeSet<String> = traces.values().flatten().cloned().collect();
    let roots_in = |s: &[ExportedSpan]| -> BTreeSet<String> {
        (s.iter())
            .filter(|s| s.parent_span_id.is_empty() && !is_rank_span(s))
            .map(|s| s.trace_id.clone())
            .collect()
    };
    collect(&mut collector, &mut spans, Duration::from_secs(20), |s| {
        want.is_subset(&roots_in(s))
    })
    .await;
    let missing = want.difference(&roots_in(&spans)).count();
    assert_eq!(
        missing,
        0,
        "collectives without their root span, of {}",
        want.len()
    );

    drained_with_nothing_lost(
        &h,
        expected,
        &[
            "ring_full",
            "queue_full",
            "dev_lost",
            "dev_unpaired",
            "incomplete",
            "kernel_unjoined",
            "dev_unjoined",
            "uncalibrated",
        ],
    );
    assert_eq!(
        h.segments_left(),
        0,
        "segments reaped after their processes exited"
    );
    // `stats` shows each rank's sends and receives per peer, as the ranks ran them.
    let stats = ncclscope_tests::json_of(
        Command::new(ncclscope_tests::daemon_binary())
            .args(["stats", "--json", "--job", "fake-job", "--api-socket"])
            .arg(h.dir.path().join("api.sock")),
    );
    let mut got = BTreeSet::new();
    for p in stats["p2p"].as_array().unwrap() {
        got.insert((
            p["comm_hash"].as_str().unwrap().to_string(),
            p["rank"].as_u64().unwrap(),
            p["func"].as_str().unwrap().to_string(),
            p["peer"].as_i64().unwrap(),
            p["transfers"].as_u64().unwrap(),
            p["device_timed"].as_u64().unwrap(),
        ));
    }
    let mut want = BTreeSet::new();
    for (_, report) in &reports {
        let comm = &report.comms[0];
        for func in ["Send", "Recv"] {
            let ops: Vec<_> = comm
                .ops
                .iter()
                .filter(|o| o.started && o.func == func)
                .collect();
            // Device-timed on both paths.
            let timed = ops.len() as u64;
            want.insert((
                format!("{:016x}", comm.comm_hash),
                comm.rank as u64,
                func.to_string(),
                ops[0].root_or_peer as i64,
                ops.len() as u64,
                timed,
            ));
        }
    }
    assert_eq!(got, want, "{stats}");
}

/// A panic in the plugin's forwarding thread (forced after N events by the test-only
/// `NCCLSCOPE_TEST_PANIC=forward:N`, read once at init): the job's NCCL calls keep returning success,
/// `finalize` returns at once instead of waiting for a thread that is gone, and the daemon reports the
/// loss as `ncclscope_lost_total{stage="forward_panic"}`, next to what arrived before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_plugins_forwarding_thread_latches_it_off_and_is_counted() {
    const COMMS: u32 = 3;
    const COLLS: u32 = 400;
    const PANIC_AFTER: u32 = 300;
    let (mut h, mut collector) = Scenario::new().start_with_collector().await;
    let (comms, colls) = (COMMS.to_string(), COLLS.to_string());
    let [rank] = FakeRanks::new("v5", "panic-job")
        .args(&["--comms", &comms, "--colls", &colls, "--channels", "2"])
        // Finalize well after the panic: it must then return at once (while the thread is still
        // alive, finalize waits for it as it always did).
        .args(&["--interval-us", "100", "--hold-ms", "500"])
        .env("NCCLSCOPE_TEST_PANIC", format!("forward:{PANIC_AFTER}"))
        .spawn(&h)
        .try_into()
        .unwrap();
    let out = rank.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the job survives: {stderr}");
    let report: ncclscope_fakenccl::report::Report = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        stderr.contains("internal error in the forwarding thread; profiling disabled"),
        "{stderr}"
    );
    assert_eq!(report.failed_calls, 0, "every NCCL call returned success");
    let slowest = report.comms.iter().map(|c| c.finalize_ns).max().unwrap();
    assert!(
        slowest < 200_000_000,
        "finalize took {} ms, waiting for a dead thread",
        slowest / 1_000_000
    );
    let produced: usize = report
        .comms
        .iter()
        .map(|c| c.ops.iter().filter(|o| o.started).count())
        .sum();
    // Latched off, the plugin clears NCCL's activation mask: NCCL stops emitting events.
    assert_eq!(report.mask, 0, "NCCL's activation mask cleared");

    // The daemon drains what the thread wrote before it died, and counts the loss.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut text = h.metrics();
    while (sample(&text, "ncclscope_segments") != Some(0.0)
        || lost(&text, "forward_panic").unwrap_or(0.0) == 0.0)
        && Instant::now() < deadline
    {
        // Take the spans, so the exporter's acknowledgements let the segment be reaped.
        collector
            .exported_spans(1, Duration::from_millis(200))
            .await;
        text = h.metrics();
    }
    let lost = lost(&text, "forward_panic").unwrap_or(0.0);
    let delivered = sample(&text, "ncclscope_collectives_total").unwrap_or(0.0);
    eprintln!(
        "forwarding-thread panic after {PANIC_AFTER} events: {produced} of {} collectives reached the \
         plugin, {delivered} delivered, forward_panic = {lost} events lost, slowest finalize {} us",
        COMMS * COLLS,
        slowest / 1000
    );
    assert!(lost >= 1.0, "forward_panic counted: {text}");
    // At most what started: an operation the lost events left incomplete is still delivered at
    // the process's end with what it has, so all may arrive when the thread kept up.
    assert!(
        delivered > 0.0 && delivered <= produced as f64,
        "what was forwarded before the panic arrives ({delivered} of {produced})"
    );
    h.stop_daemon();
}
