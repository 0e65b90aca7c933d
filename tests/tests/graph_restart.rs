//! A daemon restarted at any commit point of a CUDA-graph run attributes what it reads again exactly
//! as the first one did: the real plugin's segment from a fake RFC rank (eager collectives, a captured
//! graph, replays with eager collectives between them), assembled once whole and, for cut points
//! every 7 records, by an assembler that stops there, commits at its commit point, saves its
//! dictionary, and hands over to a fresh one restored from it (as `engine` does across a SIGKILL).

use ncclscope::assemble::{Assembler, Completed, done};
use ncclscope_fakenccl::process::{Cleanup, read_only_segment, run_rank, unique_prefix};

/// (seq, replay, exec, start) of the instances delivered, sorted.
fn instances<'a>(c: impl Iterator<Item = &'a Completed>) -> Vec<(u64, u32, u64, u64)> {
    let mut v: Vec<_> = c
        .map(|c| {
            (
                c.coll.seq,
                c.coll.replay,
                c.coll.exec_ns,
                c.coll.start_unix_ns,
            )
        })
        .collect();
    v.sort_unstable();
    v
}

#[test]
fn a_restart_at_any_commit_point_of_a_graph_run_delivers_the_same_instances() {
    let prefix = unique_prefix("graph-restart");
    let _cleanup = Cleanup(prefix.clone());
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
    let run = run_rank(&prefix, &args, &[("NCCLSCOPE_RING_MEMORY", "cpu")]).unwrap();
    let records = read_only_segment(&prefix).unwrap().records;
    let mut whole = Assembler::new(1, 0, "j".into(), "h".into(), 1 << 20);
    let mut out = Vec::new();
    for (i, r) in records.iter().enumerate() {
        whole.apply(i as u64, r, 0, &mut out);
    }
    let want = instances(out.iter());
    assert_eq!(want.len(), 2 + 10 * 21, "{}", run.stderr);
    assert_eq!(whole.counters.dev_unattributed, 0);
    for cut in (1..records.len()).step_by(7) {
        let mut a = Assembler::new(1, 0, "j".into(), "h".into(), 1 << 20);
        let mut first = Vec::new();
        for (i, r) in records[..cut].iter().enumerate() {
            a.apply(i as u64, r, 0, &mut first);
        }
        let mut tail = a
            .oldest_pending_pos()
            .map_or(cut as u64, |p| p.min(cut as u64));
        // An instance delivered but not yet acknowledged by the OTLP receiver also holds the tail.
        if let Some(c) = first.iter().rev().nth(cut % 5) {
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
        let fresh = second.iter().filter(|c| c.prior != done::ALL);
        assert_eq!(
            instances(first.iter().chain(fresh)),
            want,
            "restart at record {cut} (commit point {tail})"
        );
    }
}
