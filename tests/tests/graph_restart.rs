//! A daemon restarted at any commit point of a CUDA-graph run attributes what it reads again exactly
//! as the first one did. Each test runs a fake RFC rank through the real plugin (eager collectives, a
//! captured graph, replays with eager collectives between them), assembles its segment once whole and,
//! for cut points every few records, by an assembler that stops there, commits at its commit point,
//! saves its dictionary, and hands over to a fresh one restored from it (as `engine` does across a
//! SIGKILL).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use ncclscope::assemble::{Assembler, Completed, done};
use ncclscope_fakenccl::process::{Catcher, run_rank};
use ncclscope_proto::record::RECORD_WORDS;
use ncclscope_proto::{Record, TimingSource};

/// Every record applied by one assembler; what it delivered and its counters.
fn assemble_whole(records: &[Record]) -> (Assembler, Vec<Completed>) {
    let mut whole = Assembler::new(1, 0, "j".into(), "h".into(), 1 << 20);
    let mut out = Vec::new();
    for (i, r) in records.iter().enumerate() {
        whole.apply(i as u64, r, 0, &mut out);
    }
    (whole, out)
}

/// What two assemblers deliver when the first stops after `records[..cut]` and the second resumes
/// from the first's commit point with its dictionary and deliveries (those the second delivers again,
/// marked as delivered before, left out), and that commit point. With `unacked`, an instance delivered
/// but not yet acknowledged by the OTLP receiver also holds the commit point.
fn handed_over(records: &[Record], cut: usize, unacked: Option<usize>) -> (Vec<Completed>, u64) {
    let mut a = Assembler::new(1, 0, "j".into(), "h".into(), 1 << 20);
    let mut first = Vec::new();
    for (i, r) in records[..cut].iter().enumerate() {
        a.apply(i as u64, r, 0, &mut first);
    }
    let mut tail = a
        .oldest_pending_pos(0)
        .map_or(cut as u64, |p| p.min(cut as u64));
    if let Some(c) = unacked.and_then(|n| first.iter().rev().nth(n)) {
        tail = tail.min(c.first_pos);
    }
    let _ = a.prune_prior(tail);
    let delivered: Vec<(u64, u64, u8)> = first
        .iter()
        .filter(|c| c.first_pos >= tail)
        .map(|c| (c.op_id, c.first_pos, done::ALL))
        .collect();
    let mut b = Assembler::new(1, 0, "j".into(), "h".into(), 1 << 20);
    b.restore(a.dictionary(), delivered);
    let mut second = Vec::new();
    for (i, r) in records.iter().enumerate().skip(tail as usize) {
        b.apply(i as u64, r, 0, &mut second);
    }
    first.extend(second.into_iter().filter(|c| c.prior != done::ALL));
    (first, tail)
}

/// Asserts that a restart at every `step`-th record (some instances delivered but unacknowledged)
/// delivers `want` ([`instances`]).
fn restarts_deliver(records: &[Record], want: &[(u64, u32, u64, u64)], step: usize) {
    for cut in (1..records.len()).step_by(step) {
        let (got, tail) = handed_over(records, cut, Some(cut % 5));
        assert_eq!(
            instances(got.iter()),
            want,
            "restart at record {cut} (commit point {tail})"
        );
    }
}

/// (seq, replay, exec, start) of the instances delivered, sorted.
fn instances<'a>(c: impl Iterator<Item = &'a Completed>) -> Vec<(u64, u32, u64, u64)> {
    let mut v: Vec<_> = c
        .map(|c| {
            (
                c.coll.desc.seq,
                c.coll.replay,
                c.coll.exec_ns,
                c.coll.start_unix_ns,
            )
        })
        .collect();
    v.sort_unstable();
    v
}

/// (collective, seq, replay) -> exec of every instance delivered with device timing; `names`: an
/// assembler that read the process's strings.
fn timed<'a>(
    names: &Assembler,
    c: impl Iterator<Item = &'a Completed>,
) -> BTreeMap<(String, u64, u32), u64> {
    let mut m = BTreeMap::new();
    for c in c.filter(|c| c.coll.timing_source == TimingSource::DeviceHook) {
        let key = (
            names.string(c.coll.desc.func.0),
            c.coll.desc.seq,
            c.coll.replay,
        );
        assert!(
            m.insert(key.clone(), c.coll.exec_ns).is_none(),
            "{key:?} twice"
        );
    }
    m
}

/// Records as the segment holds them (little-endian words), for a failing run kept as test data.
fn save(records: &[Record]) -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("graph_restart-{}.records", std::process::id()));
    let bytes: Vec<u8> = (records.iter())
        .flat_map(|r| r.encode())
        .flat_map(u64::to_le_bytes)
        .collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Records saved by [`save`] and compressed with xz, from tests/data.
fn load(name: &str) -> Vec<Record> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name);
    let xz = Command::new("xz").arg("-dc").arg(&path).output().unwrap();
    assert!(xz.status.success(), "xz -dc {}", path.display());
    (xz.stdout.chunks_exact(8 * RECORD_WORDS))
        .map(|c| {
            let mut w = [0u64; RECORD_WORDS];
            for (w, b) in w.iter_mut().zip(c.chunks_exact(8)) {
                *w = u64::from_le_bytes(b.try_into().unwrap());
            }
            Record::decode(&w).unwrap()
        })
        .collect()
}

#[test]
fn a_restart_at_any_commit_point_of_a_graph_run_delivers_the_same_instances() {
    let catcher = Catcher::start();
    let args = [
        "--kind",
        "rfc",
        "--colls",
        "2",
        "--channels",
        "4",
        "--graph-ops",
        "20",
        "--graph-channels",
        "4",
        "--replays",
        "10",
        "--eager-between",
        "1",
        "--interval-us",
        "2000",
    ];
    let run = run_rank(&catcher, &args, &[("NCCLSCOPE_RING_MEMORY", "cpu")]).unwrap();
    let records = catcher.only_segment().unwrap().records;
    let (whole, out) = assemble_whole(&records);
    let want = instances(out.iter());
    assert_eq!(want.len(), 2 + 10 * 21, "{}", run.stderr);
    assert_eq!(whole.counters.dev_unattributed, 0);
    for cut in (1..records.len()).step_by(7) {
        let (got, tail) = handed_over(&records, cut, Some(cut % 5));
        let got = instances(got.iter());
        if got != want {
            // The records depend on the threads' timing: keep them, to replay as test data.
            let saved = save(&records);
            panic!(
                "restart at record {cut} (commit point {tail}), records in {}:\n{got:?}\n{want:?}",
                saved.display()
            );
        }
    }
}

/// A run of the test above that once failed (2 of 200 runs): the tail fell in a hold decided later,
/// after which each of channels 1-3 read an item settled as eager before the restart. That item
/// must count as seen on its channel, or the next one finds a gap in the workCounters and moves the
/// replay cursor past an item that was never lost (every later replay on the channel one item off).
#[test]
fn an_item_settled_as_eager_before_a_restart_keeps_its_channel_in_step() {
    let records = load("graph-restart-settled-eager.records.xz");
    let (whole, out) = assemble_whole(&records);
    let want = instances(out.iter());
    assert_eq!(want.len(), 2 + 10 * 21);
    assert_eq!(whole.counters.dev_unattributed, 0);
    restarts_deliver(&records, &want, 2);
}

/// CUDA-graph replays on a GPU that lags the CPU: the fake RFC rank's GPU runs each kernel after the
/// previous one on the stream (`--gpu-lag`), so the host enqueues the eager all-reduces that follow a
/// replay (same device function as the replay's first operation) while the replay still runs, and
/// their host events are in the segment before the replay's work items.
#[test]
fn replays_on_a_lagging_gpu_are_attributed_exactly_and_restart_anywhere() {
    let catcher = Catcher::start();
    let args = [
        "--kind",
        "rfc",
        "--colls",
        "4",
        "--channels",
        "4",
        "--graph-ops",
        "50",
        "--graph-channels",
        "8",
        "--replays",
        "6",
        "--eager-between",
        "2",
        "--gpu-lag",
        "--kernel-ns",
        "20000",
        "--interval-us",
        "100",
    ];
    let run = run_rank(&catcher, &args, &[("NCCLSCOPE_RING_MEMORY", "cpu")]).unwrap();
    let records = catcher.only_segment().unwrap().records;
    // What the rank produced: (collective, seq, replay) -> exec.
    let produced: BTreeMap<(String, u64, u32), u64> = (run.report.comms[0].instances())
        .map(|((f, seq, r), op)| ((f.to_string(), seq, r), op.hook_exec_ns().unwrap()))
        .collect();
    assert_eq!(produced.len(), 4 + 6 * (50 + 2));

    let (whole, out) = assemble_whole(&records);
    let c = &whole.counters;
    assert_eq!(
        timed(&whole, out.iter()),
        produced,
        "every instance delivered once with the exec time produced: {c:?}"
    );
    assert_eq!(
        (c.dev_work, c.dev_joined),
        (c.dev_work, c.dev_work),
        "{c:?}"
    );

    for cut in (1..records.len()).step_by(17) {
        let (got, tail) = handed_over(&records, cut, None);
        assert_eq!(
            timed(&whole, got.iter()),
            produced,
            "restart at record {cut} (commit point {tail})"
        );
    }
}

/// A run of `daemon_e2e`'s graph replays after a warm-up of the same operations, recorded when it
/// failed on a loaded machine (2 of about 20 runs): the forwarding thread drained the last eager
/// operation's work items after the first 7 of the graph's 50 captured operations and before the
/// other 43. Its items began holds (the eager operation or the graph's first replay?) whose replay
/// block was cut at the 7 operations captured so far, so no reading fitted the replays that
/// followed: 616 items unattributed, 128 ambiguous, 90 instances lost. A block is as long as the
/// template is when each item is read.
#[test]
fn a_capture_read_after_the_eager_work_before_it_is_replayed_whole() {
    let records = load("graph-capture-read-late.records.xz");
    let (whole, out) = assemble_whole(&records);
    let c = &whole.counters;
    let lost = (
        c.dev_unattributed,
        c.dev_ambiguous,
        c.dev_mismatch,
        c.incomplete,
    );
    assert_eq!(
        lost,
        (0, 0, 0, 0),
        "unattributed, ambiguous, mismatch, incomplete"
    );
    let got = timed(&whole, out.iter());
    // 4 eager collectives, 50 of the warm-up, 50 captured x 6 replays, 2 eager after each replay.
    assert_eq!(got.len(), 4 + 50 + 50 * 6 + 2 * 6);
    for replay in 1..=6 {
        let seqs: Vec<u64> = (got.keys())
            .filter(|k| k.2 == replay)
            .map(|k| k.1)
            .collect();
        assert_eq!(seqs, (52..102).collect::<Vec<u64>>(), "replay {replay}");
    }
    restarts_deliver(&records, &instances(out.iter()), 13);
}

/// A rank of `daemon_e2e::graphs::fake_nccl_p2p_rounds_…` (a2a: per step an all-gather on one
/// communicator, a grouped send and receive to both ranks and an all-reduce on another; 9 eager steps,
/// then one captured and replayed 10 times), recorded where it failed on a loaded machine (1 of 8
/// runs): the forwarding thread fell behind, so every host event came first and then each channel's
/// ring was drained whole in turn, the replays' items on channels 0-1 long before the eager peer
/// round's on channels 32-33. A replay's self-round item on channel 1 was taken for an eager round's
/// and narrowed the schedule to 2 channels: the eager sends and receives to the peer were placed on
/// the wrong channels and the replays misread (61 items unattributed, 20 operations mismatched, 46
/// of 114 instances lost).
#[test]
fn p2p_items_drained_channel_by_channel_after_a_capture_join_their_rounds_and_replays() {
    let records = load("p2p-drained-channel-by-channel.records.xz");
    let (whole, out) = assemble_whole(&records);
    let c = &whole.counters;
    assert_eq!(
        (
            c.dev_unattributed,
            c.dev_ambiguous,
            c.dev_mismatch,
            c.incomplete,
            c.p2p_host_timed,
            c.dev_p2p
        ),
        (0, 0, 0, 0, 0, 0),
        "unattributed, ambiguous, mismatch, incomplete, host-timed, p2p items unjoined"
    );
    // Per step: 1 all-gather, 2 sends, 2 receives, 1 all-reduce; 9 eager steps and 10 replays.
    let on_device = out
        .iter()
        .filter(|c| c.coll.timing_source == TimingSource::DeviceHook);
    assert_eq!((out.len(), on_device.count()), (19 * 6, 19 * 6));
    restarts_deliver(&records, &instances(out.iter()), 11);
}
