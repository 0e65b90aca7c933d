//! CUDA graphs: replays on the device-hook path, after a warm-up, on a lagging GPU, and real NCCL
//! segments (graph replays, p2p rounds beside collectives, a burst longer than the ring) each become
//! one instance per collective and replay.

use crate::support::*;

/// CUDA graphs on the hook path (issue 10): two RFC ranks run eager all-reduces, capture 50 into a
/// graph, replay it 6 times with eager all-reduces of the graph's first device function between the
/// replays. Every eager op and every replayed op of every replay arrives once, with its own exec time
/// and replay index, both ranks of each in one trace; nothing unattributed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graph_replays_on_the_hook_path_are_each_one_instance_with_their_own_timings() {
    graph_replays("graph", &["--kernel-ns", "5000", "--interval-us", "300"]).await;
}

/// PyTorch's pattern (issue 15): the graph's own operations are run eagerly first (the warm-up
/// `torch.cuda.graph` asks for), then captured. The plugin forwards the capture's host events before
/// it next drains the rings, so the warm-up's work items are read after them and fit the first
/// replay just as well. On real NCCL the daemon held them all as ambiguous: 0 of 1,200 replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graph_replays_after_a_warm_up_of_the_same_operations_are_each_one_instance() {
    graph_replays("graph-warm-up", &["--warm-up", "--kernel-ns", "5000"]).await;
}

/// The same on a GPU that lags the CPU (issue 10 follow-up): each kernel starts when the previous one
/// on the stream ended (20 us kernels, 100 us between replays), so the host enqueues the eager
/// all-reduces after a replay while it still runs and their host events reach the daemon before the
/// replay's work items, which fit them too. Nothing is joined on a guess: every instance the daemon
/// delivers has the exec time the rank produced for that (seq, replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graph_replays_on_a_lagging_gpu_are_attributed_without_a_guess() {
    let args = ["--gpu-lag", "--kernel-ns", "20000", "--interval-us", "100"];
    graph_replays("graph-lag", &args).await;
}

/// Segments the plugin wrote on real NCCL 2.30.7 with the device-hook RFC (tests/data/README.md: two
/// ranks on one H200 in one process, eager launches and a 50-op graph replayed 6 and 100 times),
/// handed to the real daemon as a plugin hands its segment over, by processes that then end. Every
/// collective of every replay is one instance on each rank, both ranks' in one trace with one root, no
/// id shared by two instances (NCCL numbers collectives per type: AllGather 0 is not AllReduce 0), and
/// each replayed operation's exec time is the same every replay (within the GPU's jitter). Blocks of
/// one kernel need not run at once there (two ranks x 64 channels on one GPU): the daemon that assumed
/// they did delivered 548 of the 656 instances of the 6-replay case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_of_real_nccl_kernels_become_one_instance_per_collective_and_replay() {
    const INSTANCES: usize = 2 * (28 + 50 * 6) + 2 * (4 + 100 * 50);
    let (h, mut collector) = Scenario::new().start_with_collector().await;
    hand_over_recorded_segments(&h, "rfc-nccl-2.30.7-2ranks-one-process.tar.xz");
    let spans = collect_rank_spans(&mut collector, INSTANCES, Duration::from_secs(120)).await;
    drained_with_nothing_lost(
        &h,
        INSTANCES,
        &[
            "dev_unattributed",
            "dev_mismatch",
            "dev_ambiguous",
            "incomplete",
        ],
    );
    let mut instances = BTreeSet::new();
    let mut span_ids = BTreeSet::new();
    let mut traces: HashMap<String, (BTreeSet<u32>, usize)> = HashMap::new();
    // (job, rank, collective, seq) -> exec of each replay.
    let mut replays: BTreeMap<(String, u32, String, u64), Vec<u64>> = BTreeMap::new();
    for s in &spans {
        assert!(span_ids.insert(s.span_id.clone()), "span id reused: {s:?}");
        let t = traces.entry(s.trace_id.clone()).or_default();
        if !is_rank_span(s) {
            t.1 += 1;
            continue;
        }
        let (job, coll) = (attr(s, "job.id").to_string(), attr(s, "nccl.collective"));
        let rank: u32 = attr(s, "nccl.rank").parse().unwrap();
        let seq: u64 = attr(s, "nccl.seq").parse().unwrap();
        let replay: u32 = attr(s, "nccl.replay").parse().unwrap();
        let exec: u64 = attr(s, "nccl.exec_ns").parse().unwrap();
        assert!(
            instances.insert((job.clone(), rank, coll.to_string(), seq, replay)),
            "{job} rank {rank} {coll} seq {seq} replay {replay} delivered twice"
        );
        assert!(t.0.insert(rank), "two spans of rank {rank} in one trace");
        assert!(
            (500..5_000_000).contains(&exec),
            "implausible exec {exec} ns: {s:?}"
        );
        if replay > 0 {
            replays
                .entry((job, rank, coll.to_string(), seq))
                .or_default()
                .push(exec);
        }
    }
    assert_eq!(instances.len(), INSTANCES);
    assert!(
        traces
            .values()
            .all(|(ranks, roots)| ranks.len() == 2 && *roots == 1),
        "each trace: both ranks and one root"
    );
    assert_eq!(traces.len(), INSTANCES / 2);
    assert_eq!(
        replays.len(),
        2 * 50 * 2,
        "50 captured ops per rank per job"
    );
    for (op, mut execs) in replays {
        execs.sort_unstable();
        let median = execs[execs.len() / 2];
        assert!(
            execs[execs.len() - 1] <= 4 * median,
            "{op:?}: replays' exec {execs:?}"
        );
    }
}

/// Pipeline-parallel and MoE traffic as real NCCL 2.30.7 + RFC ran it on an H100 (tests/data/README.md:
/// PyTorch's `batch_isend_irecv` schedule and `all_to_all_single`, each beside an all-reduce on the same
/// communicator, 9 eager steps and 10 graph replays). NCCL runs an all_to_all's self round on channels
/// 0-1, the ones the all-reduce beside it uses: the daemon counted those p2p items as lost items of the
/// graph's replays and moved the replay cursor a whole replay on, so the all-reduce delivered 9 and 14
/// of its 19 instances (`dev_mismatch`), and the sends and receives arrived with host times only. Every
/// collective arrives now, every eager send and receive is timed by its round's work items (the channels
/// of NCCL's p2p schedule, `assemble/p2p.rs`), each transfer's two sides in one trace, and the replayed
/// ones' work items are counted `dev_p2p`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_nccl_p2p_rounds_leave_the_collectives_beside_them_whole() {
    let (h, mut collector) = Scenario::new().start_with_collector().await;
    hand_over_recorded_segments(&h, "rfc-nccl-2.30.7-p2p.tar.xz");
    p2p_rounds_leave_the_collectives_beside_them_whole(&h, &mut collector, "rfc-raw-").await;
}

/// The same program on the fake NCCL host (`fakenccl-rank --torch-p2p`, whose work items are real
/// NCCL's item for item, tests/tests/p2p_rounds.rs), through the real plugin: CI holds the daemon
/// to real NCCL's p2p rounds without a GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_nccl_p2p_rounds_leave_the_collectives_beside_them_whole() {
    let (h, mut collector) = Scenario::new().start_with_collector().await;
    let mut children = Vec::new();
    for (mode, comm_hash) in [("a2a", 1000), ("pp", 2000)] {
        let job = format!("fake-{mode}");
        let ranks = FakeRanks::new("rfc", &job)
            .ranks(2)
            .comm_hash(comm_hash)
            .args(&["--torch-p2p", mode, "--steps", "9", "--replays", "10"])
            .without_reports()
            .spawn(&h);
        children.extend(ranks);
    }
    children.into_iter().for_each(|c| _ = finished(c));
    p2p_rounds_leave_the_collectives_beside_them_whole(&h, &mut collector, "fake-").await;
}

/// The recorded 100-replay burst of real NCCL (200,489 records; on the GPU they came at about 2.1 M
/// records/s, ~95 ms) forwarded through a ring holding 1/12 of it, at 25 k records/s (a debug build
/// of the daemon sustained ~130 k on a loaded 2-core machine; the ring holds 0.65 s of it). The first
/// operation's work item comes 17,954 records after its host event (the plugin drains the other
/// communicator's rings first), so a tail that waited on open operations would hold the ring full:
/// the daemon must free it whatever waits, the producer drop nothing, and every instance arrive.
/// The producer waits for room while the tail keeps moving (up to 5 s since it last did, half the
/// operation timeout): a daemon starved of CPU by a loaded machine (3 busy loops on 2 cores made
/// it drop 2,791) costs time, a tail held on an open operation still costs records.
/// On the GPU the 300-replay burst overflowed the default ring (256 Ki records) and lost 60% of its
/// instances to `ring_full`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_real_graph_replays_longer_than_the_ring_is_delivered_without_ring_full() {
    if !rustix::process::getuid().is_root() {
        eprintln!("skipped: the recorded segments are uid 0's; run as root");
        return;
    }
    const INSTANCES: usize = 2 * (4 + 100 * 50);
    let mut collector = FakeCollectorServer::start().await.unwrap();
    let mut h = Scenario::new().harness(&collector.endpoint());
    let [file] = recorded_segments(
        &h,
        "rfc-nccl-2.30.7-2ranks-one-process.tar.xz",
        &["--wildcards", "diag-burst100.*"],
    )
    .try_into()
    .unwrap();
    h.start_daemon();
    let spec = format!("{}|{}|16384|25", h.socket().display(), file.display());
    let child = child_test("recorded_burst_child", BURST_ENV, &spec)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    h.ranks.push(child);
    h.wait_ranks();
    let mut spans = Vec::new();
    // Distinct span ids: a batch the exporter re-sent after a timeout arrives twice (OTLP is
    // at-least-once), and two different spans of one instance would be a bug.
    collect(&mut collector, &mut spans, Duration::from_secs(120), |s| {
        let rank_spans = s.iter().filter(|s| is_rank_span(s));
        rank_spans
            .map(|s| &s.span_id)
            .collect::<BTreeSet<_>>()
            .len()
            >= INSTANCES
    })
    .await;
    drained_with_nothing_lost(
        &h,
        INSTANCES,
        &[
            "ring_full",
            "dev_unattributed",
            "dev_mismatch",
            "dev_ambiguous",
            "incomplete",
        ],
    );
    let mut instances = BTreeMap::new();
    for s in spans.iter().filter(|s| is_rank_span(s)) {
        let key = ["nccl.rank", "nccl.collective", "nccl.seq", "nccl.replay"]
            .map(|k| attr(s, k).to_string());
        let id = instances.entry(key.clone()).or_insert(s.span_id.clone());
        assert_eq!(*id, s.span_id, "{key:?} delivered as two spans");
    }
    assert_eq!(instances.len(), INSTANCES);
}
