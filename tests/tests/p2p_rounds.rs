//! The fake NCCL host's point-to-point work against real NCCL's: `fakenccl-rank --torch-p2p` issues
//! the communication of tests/gpu/rfc_nccl/torch_p2p.py (an all_to_all with a self and a peer round,
//! pipeline steps of fused send/receive rounds, the collectives beside them, 9 eager steps and 10
//! graph replays) through the real plugin, and its segments must hold the work items that real NCCL
//! 2.30.7 + RFC wrote for the same program on an H100 (tests/data/rfc-nccl-2.30.7-p2p.tar.xz): the
//! same channels, items per channel, funcIds and workCounters, and the same host P2p/Coll events.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use ncclscope_fakenccl::process::{Catcher, all_records, run_rank, saved_segment};
use ncclscope_proto::Record;

/// On one channel of one communicator, in workCounter order: (is a p2p item, workCounter).
type Lane = Vec<(bool, u64)>;

/// A P2p or Coll event: (function, peer or -1, count, nChannels, captured).
type Op = (String, i32, u64, u8, bool);

/// What the test compares of one rank's segment.
#[derive(Debug, PartialEq, Eq)]
struct Shape {
    /// Per (communicator, channel).
    lanes: BTreeMap<(u32, u8), Lane>,
    /// Per communicator, its P2p and Coll events in order.
    ops: BTreeMap<u32, Vec<Op>>,
}

/// The rank of `records`' communicators and their shape.
fn shape(records: &[Record]) -> (u32, Shape) {
    let mut strs = BTreeMap::new();
    let mut p2p_funcs = Vec::new();
    let mut rank = None;
    let mut lanes: BTreeMap<(u32, u8), Lane> = BTreeMap::new();
    let mut ops: BTreeMap<u32, Vec<Op>> = BTreeMap::new();
    for r in records {
        match r {
            Record::Str { id, len, bytes } => {
                let text = String::from_utf8_lossy(&bytes[..*len as usize]).into_owned();
                strs.insert(*id, text);
            }
            Record::Comm { rank: r, .. } => {
                assert!(rank.is_none_or(|x| x == *r), "one rank per segment");
                rank = Some(*r);
            }
            Record::FuncName { func_id, name } if strs[name].ends_with("SendRecv") => {
                p2p_funcs.push(*func_id);
            }
            Record::DevWork {
                comm,
                channel,
                func_id,
                work_counter,
                ..
            } => lanes
                .entry((*comm, *channel))
                .or_default()
                .push((p2p_funcs.contains(func_id), *work_counter)),
            Record::P2pStart {
                comm,
                func,
                peer,
                count,
                n_channels,
                captured,
                ..
            } => ops.entry(*comm).or_default().push((
                strs[func].clone(),
                *peer,
                *count,
                *n_channels,
                *captured,
            )),
            Record::CollStart {
                comm,
                func,
                count,
                n_channels,
                captured,
                ..
            } => ops.entry(*comm).or_default().push((
                strs[func].clone(),
                -1,
                *count,
                *n_channels,
                *captured,
            )),
            _ => {}
        }
    }
    for lane in lanes.values_mut() {
        lane.sort_by_key(|&(_, wc)| wc);
    }
    (rank.expect("a Comm record"), Shape { lanes, ops })
}

/// The real segments of `mode` (a2a or pp), per rank.
fn real(mode: &str) -> BTreeMap<u32, Shape> {
    let dir = tempfile::tempdir().unwrap();
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/rfc-nccl-2.30.7-p2p.tar.xz");
    let tar = Command::new("tar")
        .arg("-xJf")
        .arg(&data)
        .arg("-C")
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(tar.success(), "tar -xJf {}", data.display());
    (0..2)
        .map(|i| {
            let bytes = std::fs::read(dir.path().join(format!("rfc-raw-{mode}.{i}.seg"))).unwrap();
            shape(&all_records(saved_segment(&bytes).unwrap()).unwrap())
        })
        .collect()
}

/// Both fake ranks of `mode`, through the real plugin on an RFC host.
fn fake(mode: &str) -> BTreeMap<u32, Shape> {
    (0..2)
        .map(|rank| {
            let catcher = Catcher::start();
            let rank = rank.to_string();
            let args = ["--kind", "rfc", "--torch-p2p", mode, "--nranks", "2"];
            let args = [
                &args[..],
                &["--rank", &rank, "--steps", "9", "--replays", "10"],
            ]
            .concat();
            let run = run_rank(&catcher, &args, &[("NCCLSCOPE_RING_MEMORY", "cpu")]).unwrap();
            let seg = catcher.only_segment().unwrap();
            assert_eq!(run.report.failed_calls, 0, "{}", run.stderr);
            shape(&seg.records)
        })
        .collect()
}

/// Fails on the first lane or operation list that differs (the whole maps are too long to read).
fn assert_same(mode: &str, fake: &BTreeMap<u32, Shape>, real: &BTreeMap<u32, Shape>) {
    for rank in 0..2 {
        let (f, r) = (&fake[&rank], &real[&rank]);
        assert_eq!(
            f.lanes.keys().collect::<Vec<_>>(),
            r.lanes.keys().collect::<Vec<_>>(),
            "{mode} rank {rank}: (communicator, channel) with work items"
        );
        for (key, lane) in &r.lanes {
            assert_eq!(&f.lanes[key], lane, "{mode} rank {rank}: lane {key:?}");
        }
        assert_eq!(f.ops, r.ops, "{mode} rank {rank}: host events");
    }
}

/// An all_to_all_single per step: the self round on channel 0 (0-1 at 1 MiB), the peer's on 32
/// (32-33), one item per channel for the round's send and receive, beside an all-reduce on 1 or 64
/// channels of the same communicator and an all-gather on another.
#[test]
fn fake_all_to_all_rounds_are_real_nccls() {
    assert_same("a2a", &fake("a2a"), &real("a2a"));
}

/// A pipeline step: per micro-batch one group, the activation's send (or receive) and the previous
/// gradient's receive (or send) to the one peer fused into one round on channel 32 (32-33 at 1 MiB).
#[test]
fn fake_pipeline_rounds_are_real_nccls() {
    assert_same("pp", &fake("pp"), &real("pp"));
}
