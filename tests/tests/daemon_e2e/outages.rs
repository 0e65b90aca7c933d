//! Collector outages: a collector that never answers, is down, hangs or refuses costs the spool and
//! the metrics nothing, and the spans it dropped are re-sent from the spool once it answers.

use crate::support::*;

/// Issue 22, item 3: a collector that accepts TCP and never answers. The spans wait for it (bounded,
/// counted when dropped), but the rings keep moving: every collective reaches the metrics and the
/// spool, and no rank loses a record (each rank process asserts `ring_full` 0 itself). 2 ranks x
/// 10,000 collectives (80,000 records) through 16 Ki-record rings, while every export request hangs
/// for its 5 s timeout.
#[test]
fn a_collector_that_never_answers_costs_the_spool_and_the_metrics_nothing() {
    const NCOLLS: u64 = 10_000;
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", hung.local_addr().unwrap());
    // Accepts every connection and holds it, reading nothing, answering nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in hung.incoming() {
            held.push(c);
        }
    });
    let mut h = Scenario::new().start(&endpoint);
    h.start_ranks(2, NCOLLS, 200);
    h.wait_ranks();
    wait_job(&h, 2 * NCOLLS, Duration::from_secs(60));
    let text = h.metrics();
    assert_eq!(lost(&text, "ring_full"), Some(0.0), "{text}");
    assert_eq!(sample(&text, "ncclscope_spans_exported_total"), Some(0.0));
}

/// Issue 22: spans given up while the collector was down are re-sent from the spool once it
/// answers. 2 ranks x 1,000 collectives complete while every export attempt fails; after all 3,000
/// spans are counted dropped the collector comes up, and every one of them arrives with the ids and
/// times the live export would have given it, counted as re-sent, none as not re-sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_dropped_while_the_collector_is_down_are_re_sent_from_the_spool_once_it_answers() {
    dropped_spans_re_sent_once_the_collector_answers(Outage::Refuse).await;
}

/// The same with a collector that accepts and never answers (each attempt fails at its 1 s
/// timeout): the exporter must leave the hung connections for one that answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_dropped_while_the_collector_hangs_are_re_sent_from_the_spool_once_it_answers() {
    dropped_spans_re_sent_once_the_collector_answers(Outage::Hang).await;
}

/// The same with a collector that answers every export with an error status (`unavailable`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_refused_with_an_error_status_are_re_sent_from_the_spool_once_it_accepts() {
    dropped_spans_re_sent_once_the_collector_answers(Outage::Error).await;
}

/// Issue 22: the re-sender in this process, with a real spool and a real receiver. Instances
/// remembered as dropped (as the engine remembers those its full export queue refuses) are queued
/// again from the spool and arrive with their ids; one the spool does not hold (evicted meanwhile)
/// is counted as not re-sent. A root span that went after its rank 0 instance was spooled (its skew
/// window closed before a local rank came) is re-sent with the times its dropped export carried,
/// which the spool does not hold. Once the live queue's sender is gone, the re-sender ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_re_sender_queues_what_the_spool_holds_and_counts_what_it_does_not() {
    use ncclscope::export::export_queue::ExportCounters;
    use ncclscope::export::otlp;
    use ncclscope::export::resend::{self, Dropped};
    use ncclscope::instance::Shared;
    use ncclscope::storage::spool::{Origin, Spool, SpoolLimits};
    use ncclscope_proto::api::Collective;
    const N: u64 = 500;
    const UID: u32 = 4321;
    let dir = tempfile::tempdir().unwrap();
    let mut spool = Spool::open(dir.path(), SpoolLimits::default()).unwrap();
    const LATE_ROOT: (u64, u64) = (1_000, 9_000);
    let coll = |seq| Collective {
        uid: UID,
        job_id: "j".into(),
        func: "AllReduce".into(),
        comm_hash: COMM_HASH,
        seq,
        // Rank 0 of the last one: its root span was sent when its window closed, not spooled.
        rank: if seq == N - 1 { 0 } else { 1 },
        nranks: 2,
        // As the engine spools an instance whose rank span the live export sends.
        live_spans: ncclscope_proto::api::LiveSpans::Rank as i32,
        ..Default::default()
    };
    let spooled: Vec<_> = (0..N).map(|seq| (Origin::default(), coll(seq))).collect();
    spool.append(&spooled).unwrap();
    let counters = Arc::new(ExportCounters::default());
    let dropped = Arc::new(Dropped::new(resend::MAX_REMEMBERED));
    for seq in 0..=N {
        let mut c = Shared::from(&coll(seq));
        if seq == N - 1 {
            // The root-only export of that instance, dropped after its own.
            dropped.remember(UID, "j", resend::Wanted::of(c.view()), &counters);
            c.inst.trace_root = Some(LATE_ROOT);
            c.inst.live_spans = ncclscope_proto::api::LiveSpans::None;
        }
        dropped.remember(UID, "j", resend::Wanted::of(c.view()), &counters);
    }
    let mut collector = FakeCollectorServer::start().await.unwrap();
    let cfg = ncclscope::config::Otlp {
        endpoint: collector.endpoint(),
        batch_timeout_ms: 10,
        ..Default::default()
    };
    let channel = otlp::channel(&cfg).unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(cfg.queue_spans);
    let (metrics_tx, metrics_rx) = tokio::sync::mpsc::channel(1);
    let exporter = tokio::spawn(otlp::run(
        cfg,
        "h".into(),
        channel,
        rx,
        metrics_rx,
        counters.clone(),
        Some(dropped.clone()),
    ));
    let t = Instant::now();
    let resender = tokio::spawn(resend::run(
        dropped.clone(),
        spool.reader(),
        tx.downgrade(),
        counters.clone(),
    ));
    let mut spans = Vec::new();
    collect(&mut collector, &mut spans, Duration::from_secs(30), |s| {
        s.len() > N as usize
    })
    .await;
    let took = t.elapsed();
    let ids: BTreeSet<String> = spans.iter().map(|s| s.span_id.clone()).collect();
    let mut expected: BTreeSet<String> = (0..N)
        .map(|seq| {
            let c = coll(seq);
            let key = ncclscope::spans::collective_key("AllReduce", seq, 0);
            hex(&ncclscope::spans::rank_span_id(UID, COMM_HASH, key, c.rank))
        })
        .collect();
    let late = ncclscope::spans::collective_key("AllReduce", N - 1, 0);
    let root_id = hex(&ncclscope::spans::root_span_id(UID, COMM_HASH, late));
    expected.insert(root_id.clone());
    assert_eq!(
        ids, expected,
        "every spooled instance re-sent with its ids, and the late root"
    );
    let root = spans.iter().find(|s| s.span_id == root_id).unwrap();
    assert_eq!(
        (root.start_time_unix_nano, root.end_time_unix_nano),
        LATE_ROOT,
        "the root's times, which only its dropped export had"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while dropped.held() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(dropped.held(), 0, "every key forgotten once its scan ended");
    assert_eq!(counters.resent.load(Ordering::Relaxed), N);
    assert_eq!(counters.not_resent.load(Ordering::Relaxed), 1);
    drop((tx, metrics_tx));
    tokio::time::timeout(Duration::from_secs(5), exporter)
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), resender)
        .await
        .expect("the re-sender ends with the queue")
        .unwrap();
    eprintln!("{N} re-sent in {took:?}, 1 not in the spool counted");
}
