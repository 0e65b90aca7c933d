//! CUDA-graph replays on a GPU that lags the CPU: the fake RFC rank's GPU runs each kernel after the
//! previous one on the stream (`--gpu-lag`), so the host enqueues the eager all-reduces that follow a
//! replay (same device function as the replay's first operation) while the replay still runs, and
//! their host events are in the segment before the replay's work items. The real plugin's segment is
//! assembled once whole and, for cut points every 17 records, by an assembler that stops there,
//! commits at its commit point and hands over to a fresh one restored from its dictionary.

use std::collections::BTreeMap;

use ncclscope::assemble::{Assembler, Completed, done};
use ncclscope_fakenccl::process::{Cleanup, read_only_segment, run_rank, unique_prefix};

/// (seq, replay) -> exec of every instance delivered with device timing.
fn timed<'a>(c: impl Iterator<Item = &'a Completed>) -> BTreeMap<(u64, u32), u64> {
    let mut m = BTreeMap::new();
    for c in c.filter(|c| c.coll.timing_source == "device_hook") {
        let key = (c.coll.seq, c.coll.replay);
        assert!(m.insert(key, c.coll.exec_ns).is_none(), "{key:?} twice");
    }
    m
}

#[test]
fn replays_on_a_lagging_gpu_are_attributed_exactly_and_restart_anywhere() {
    let prefix = unique_prefix("graph-lag");
    let _cleanup = Cleanup(prefix.clone());
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
    let run = run_rank(&prefix, &args, &[("NCCLSCOPE_RING_MEMORY", "cpu")]).unwrap();
    let records = read_only_segment(&prefix).unwrap().records;
    // What the rank produced: (seq, replay) -> exec (a replayed op's seq is the captured one's, made
    // unique per function in capture order).
    let ops = &run.report.comms[0].ops;
    let capture_seq = ops.iter().find(|o| o.captured).unwrap().seq;
    let mut produced = BTreeMap::new();
    let mut index = BTreeMap::new();
    for op in ops.iter().filter(|o| !o.captured) {
        let seq = if op.replay > 0 {
            let i = index.entry(op.replay).or_insert(0);
            *i += 1;
            capture_seq + *i - 1
        } else {
            op.seq
        };
        let exec = op.hook_items.iter().map(|i| i.gpu_stop - i.gpu_start).max();
        produced.insert((seq, op.replay), exec.unwrap());
    }
    assert_eq!(produced.len(), 4 + 6 * (50 + 2));

    let mut whole = Assembler::new(1, 0, "j".into(), "h".into(), 1 << 20);
    let mut out = Vec::new();
    for (i, r) in records.iter().enumerate() {
        whole.apply(i as u64, r, 0, &mut out);
    }
    let c = &whole.counters;
    assert_eq!(
        timed(out.iter()),
        produced,
        "every instance delivered once with the exec time produced: {c:?}"
    );
    assert_eq!(
        (c.dev_work, c.dev_joined),
        (c.dev_work, c.dev_work),
        "{c:?}"
    );

    for cut in (1..records.len()).step_by(17) {
        let mut a = Assembler::new(1, 0, "j".into(), "h".into(), 1 << 20);
        let mut first = Vec::new();
        for (i, r) in records[..cut].iter().enumerate() {
            a.apply(i as u64, r, 0, &mut first);
        }
        let tail = (a.oldest_pending_pos()).map_or(cut as u64, |p| p.min(cut as u64));
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
        let fresh = second.iter().filter(|c| c.prior != done::ALL);
        assert_eq!(
            timed(first.iter().chain(fresh)),
            produced,
            "restart at record {cut} (commit point {tail})"
        );
    }
}
