use ncclscope_proto::fixture::{self, Coll, Comm};

use super::*;
use crate::instance::InstanceRef;

fn s(id: u16, t: &str) -> Record {
    Record::str(StrId(id), t.as_bytes())
}

fn comm(path: TimingPath) -> Record {
    let comm = Comm {
        comm_hash: 0xabc,
        rank: 1,
        nranks: 4,
        nccl_version: 23007,
        path,
        ..Comm::default()
    };
    comm.record()
}

fn coll(id: u64, seq: u64, n_channels: u8) -> Record {
    let coll = Coll {
        id,
        seq,
        n_channels,
        host_ns: 1000,
        ..Coll::default()
    };
    coll.start()
}

/// Applies `recs` at positions 0.., checking after each that the bound on waiting work items
/// counts exactly what the lanes hold.
fn feed(a: &mut Assembler, recs: &[Record]) -> Vec<Completed> {
    let mut out = Vec::new();
    for (i, r) in recs.iter().enumerate() {
        a.apply(i as u64, r, 0, &mut out);
        let waiting: usize = a.waiting.values().map(|l| l.works.len()).sum();
        assert_eq!(a.early_works, waiting, "after record {i}: {r:?}");
        let held = a.replays.held();
        assert_eq!(held, a.replays.held_recount(), "after record {i}: {r:?}");
    }
    out
}

fn prelude(path: TimingPath) -> Vec<Record> {
    let mut recs = uncalibrated_prelude(path);
    recs.insert(4, fixture::calibration(0, 1_000_000, 250));
    recs
}

/// [`prelude`] without its device's calibration.
fn uncalibrated_prelude(path: TimingPath) -> Vec<Record> {
    vec![
        s(1, "AllReduce"),
        s(2, "ncclFloat32"),
        s(3, "RING"),
        s(4, "LL128"),
        comm(path),
    ]
}

#[test]
fn stock_path_joins_by_parent_and_applies_calibration() {
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    let mut recs = prelude(TimingPath::KernelCh);
    recs.push(coll(10, 5, 2));
    recs.push(Record::OpStop {
        comm: 0,
        id: 10,
        host_ns: 1500,
    });
    recs.push(Record::KernelCh {
        comm: 0,
        parent: 10,
        channel: 1,
        gpu_start: 100,
        gpu_stop: 900,
        host_ns: 0,
    });
    // The op waits for its second channel.
    assert!(feed(&mut a, &recs).is_empty());
    let mut out = Vec::new();
    a.apply(
        99,
        &Record::KernelCh {
            comm: 0,
            parent: 10,
            channel: 0,
            gpu_start: 50,
            gpu_stop: 500,
            host_ns: 0,
        },
        0,
        &mut out,
    );
    assert_eq!(out.len(), 1);
    let c = InstanceRef {
        inst: &out[0].coll,
        names: a.names(),
    };
    assert_eq!(out[0].first_pos, 6);
    assert_eq!(
        (c.comm_hash, c.rank, c.nranks, c.desc.seq),
        (0xabc, 1, 4, 5)
    );
    assert_eq!(
        (c.func(), c.datatype(), c.algo(), c.proto()),
        ("AllReduce", "ncclFloat32", "RING", "LL128")
    );
    assert_eq!(c.timing_source.as_str(), "kernel_gpu");
    assert_eq!(c.start_unix_ns, 1_000_050);
    assert_eq!(c.end_unix_ns, 1_000_900);
    assert_eq!(c.exec_ns, 800, "max over channels");
    assert_eq!(c.bytes, 4 << 20);
    let expect_alg = (4u64 << 20) as f64 / 800.0;
    assert!((c.algbw_gbs - expect_alg).abs() < 1e-9);
    assert!((c.busbw_gbs - expect_alg * 1.5).abs() < 1e-9);
    assert_eq!(c.calibration_error_ns, 250);
    assert_eq!(
        c.channels.iter().map(|w| w.channel).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert_eq!(a.counters.incomplete, 0);
    assert_eq!(a.oldest_pending_pos(0), None);
}

const S: u64 = 1_000_000_000;

/// A calibration of device 0 good to 250 ns, taken at GPU time `gpu_ns`.
fn calibration_at(offset_ns: i64, drift_ppb: i32, gpu_ns: u64) -> Record {
    Record::Calibration {
        cuda_dev: 0,
        offset_ns,
        error_ns: 250,
        drift_ppb,
        host_ns: gpu_ns + offset_ns as u64,
    }
}

/// The calibrations `before`, an all-reduce whose kernel ran at GPU time `gpu` (800 ns), the
/// calibrations `after`, then a sweep 10 s on: its (start, calibration error), if delivered, and
/// whether it was before the sweep.
fn mapped(before: &[Record], gpu: u64, after: &[Record]) -> Option<((u64, u32), bool)> {
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    let mut recs = uncalibrated_prelude(TimingPath::KernelCh);
    recs.extend_from_slice(before);
    recs.push(coll(10, 5, 1));
    recs.push(Record::OpStop {
        comm: 0,
        id: 10,
        host_ns: 1500,
    });
    recs.push(Record::KernelCh {
        comm: 0,
        parent: 10,
        channel: 0,
        gpu_start: gpu,
        gpu_stop: gpu + 800,
        host_ns: 0,
    });
    recs.extend_from_slice(after);
    let mut out = feed(&mut a, &recs);
    let early = !out.is_empty();
    a.sweep(10 * S, 30 * S, &mut out);
    assert!(out.len() <= 1);
    let c = &out.first()?.coll;
    Some(((c.start_unix_ns, c.calibration_error_ns), early))
}

/// The GPU clock drifts against the host's (10 ppm on an H100, tests/gpu/clock): a kernel 5 s after
/// its device's calibration is mapped with the offset moved by the calibration's drift, 50 us here;
/// without it every time between calibrations was off by up to the drift times their interval. The
/// reported error grows with the distance by how far the drift may be off: the two calibrations'
/// errors over their interval, (250 + 250) ns / 0.5 s = 1 ppm, 5 us at 5 s.
#[test]
fn kernel_times_are_mapped_with_the_offset_drifted_to_their_moment() {
    let first = calibration_at(1_000_000, 0, S / 2);
    let second = calibration_at(1_005_000, 10_000, S - 5_000); // 10 ppm over 0.5 s
    assert_eq!(
        mapped(&[first, second], 6 * S, &[]),
        Some(((6 * S + 1_055_000, 250 + 5_000), true))
    );
}

/// A first calibration has no drift: an operation mapped by it alone waits for the second (the
/// plugin takes it 250 ms later), which maps it by interpolation; if none comes, the sweep maps it
/// with the first, its error grown by 100 ppm of its distance (10 us at 100 ms).
#[test]
fn operations_after_a_first_calibration_wait_for_the_second_and_are_interpolated() {
    let first = calibration_at(1_000_000, 0, S / 2);
    let second = calibration_at(1_005_000, 10_000, S - 5_000);
    // 0.2 s after the first: +2 us of the 10 ppm; 0.3 s from the second: 0.3 us more error.
    assert_eq!(
        mapped(&[first], 7 * S / 10 - 5_000, &[second]),
        Some(((7 * S / 10 + 997_000, 250 + 300), true))
    );
    assert_eq!(
        mapped(&[first], S / 2 + S / 10, &[]),
        Some(((S / 2 + S / 10 + 1_000_000, 250 + 10_000), false))
    );
}

#[test]
fn kernel_times_read_before_the_first_calibration_wait_for_it() {
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    let mut recs = uncalibrated_prelude(TimingPath::KernelCh);
    recs.push(coll(10, 5, 1));
    recs.push(Record::OpStop {
        comm: 0,
        id: 10,
        host_ns: 1500,
    });
    recs.push(Record::KernelCh {
        comm: 0,
        parent: 10,
        channel: 0,
        gpu_start: 100,
        gpu_stop: 900,
        host_ns: 0,
    });
    assert!(
        feed(&mut a, &recs).is_empty(),
        "waits for its device's calibration"
    );
    let mut out = Vec::new();
    a.apply(50, &fixture::calibration(0, 7_000, 9), 0, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(
        (out[0].coll.start_unix_ns, out[0].coll.end_unix_ns),
        (7_100, 7_900)
    );
    assert_eq!(out[0].coll.calibration_error_ns, 9);
    assert_eq!(a.counters.uncalibrated, 0);
    // Without any calibration, the timeout closes it flagged as uncalibrated.
    let mut b = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    let recs: Vec<Record> = recs.into_iter().collect();
    feed(&mut b, &recs);
    let mut out = Vec::new();
    b.sweep(100, 10, &mut out);
    assert_eq!(out[0].coll.calibration_error_ns, u32::MAX);
    assert_eq!(b.counters.uncalibrated, 1);
}

#[test]
fn a_deviceless_kernel_ch_is_anchored_to_its_host_stamps() {
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    let mut recs: Vec<Record> = uncalibrated_prelude(TimingPath::KernelCh)
        .into_iter()
        .map(|r| match r {
            Record::Comm {
                comm,
                comm_hash,
                rank,
                nranks,
                nnodes,
                name,
                nccl_version,
                path,
                host_ns,
                ..
            } => Record::Comm {
                comm,
                comm_hash,
                rank,
                nranks,
                nnodes,
                cuda_dev: -1,
                name,
                nccl_version,
                path,
                host_ns,
                gpu: None,
            },
            r => r,
        })
        .collect();
    recs.push(coll(10, 5, 2));
    recs.push(Record::OpStop {
        comm: 0,
        id: 10,
        host_ns: 1500,
    });
    recs.push(Record::KernelCh {
        comm: 0,
        parent: 10,
        channel: 0,
        gpu_start: 100,
        gpu_stop: 900,
        host_ns: 5_950,
    });
    recs.push(Record::KernelCh {
        comm: 0,
        parent: 10,
        channel: 1,
        gpu_start: 200,
        gpu_stop: 950,
        host_ns: 5_960,
    });
    let out = feed(&mut a, &recs);
    assert_eq!(out.len(), 1, "no calibration to wait for");
    // Offset = min(5950 - 900, 5960 - 950) = 5010.
    assert_eq!(
        (out[0].coll.start_unix_ns, out[0].coll.end_unix_ns),
        (5_110, 5_960)
    );
    assert_eq!(out[0].coll.exec_ns, 800);
    assert_eq!(
        out[0].coll.calibration_error_ns,
        u32::MAX,
        "not a calibration"
    );
    assert_eq!((a.counters.host_anchored, a.counters.uncalibrated), (1, 0));
}

/// A hook-path communicator whose device functions 42 and 43 are an all-reduce and a broadcast.
fn hook_prelude() -> Vec<Record> {
    let mut recs = prelude(TimingPath::DeviceHook);
    for (func_id, id, name) in [
        (42, 9, "AllReduce_Sum_f32_RING_LL128"),
        (43, 10, "Broadcast_RING_LL128"),
    ] {
        recs.push(s(id, name));
        recs.push(Record::FuncName {
            func_id,
            name: StrId(id),
        });
    }
    recs
}

#[test]
fn hook_path_joins_by_channel_order_and_checks_the_func_name() {
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    let mut recs = hook_prelude();
    recs.push(coll(1, 0, 1));
    recs.push(coll(2, 1, 1));
    recs.push(Record::OpStop {
        comm: 0,
        id: 1,
        host_ns: 0,
    });
    recs.push(Record::OpStop {
        comm: 0,
        id: 2,
        host_ns: 0,
    });
    let dev = |f, t| Record::DevWork {
        comm: 0,
        channel: 0,
        func_id: f,
        work_counter: 0,
        gpu_start: t,
        gpu_stop: t + 10,
    };
    recs.push(dev(42, 100));
    recs.push(dev(43, 200)); // wrong kernel for op 2: not joined
    recs.push(dev(42, 300));
    let out = feed(&mut a, &recs);
    let seqs: Vec<(u64, u64)> = out
        .iter()
        .map(|c| (c.coll.desc.seq, c.coll.start_unix_ns))
        .collect();
    assert_eq!(seqs, vec![(0, 1_000_100), (1, 1_000_300)]);
    assert_eq!(out[0].coll.timing_source.as_str(), "device_hook");
    assert_eq!((a.counters.dev_work, a.counters.dev_joined), (3, 2));
}

#[test]
fn hook_work_read_before_its_op_still_joins_and_a_lost_item_skips_only_its_op() {
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    let mut recs = hook_prelude();
    recs.push(s(11, "Broadcast"));
    let dev = |f, t| Record::DevWork {
        comm: 0,
        channel: 0,
        func_id: f,
        work_counter: 0,
        gpu_start: t,
        gpu_stop: t + 10,
    };
    // The drain forwarded op 1's work item before the host event of op 1.
    recs.push(dev(42, 100));
    recs.push(coll(1, 0, 1));
    recs.push(Record::OpStop {
        comm: 0,
        id: 1,
        host_ns: 0,
    });
    // Op 2 (AllReduce) lost its item; op 3 is a Broadcast whose item arrives.
    recs.push(coll(2, 1, 1));
    let mut bcast = coll(3, 2, 1);
    if let Record::CollStart { func, .. } = &mut bcast {
        *func = StrId(11);
    }
    recs.push(bcast);
    recs.push(Record::OpStop {
        comm: 0,
        id: 2,
        host_ns: 0,
    });
    recs.push(Record::OpStop {
        comm: 0,
        id: 3,
        host_ns: 0,
    });
    recs.push(dev(43, 300));
    let out = feed(&mut a, &recs);
    let got: Vec<(u64, u64)> = out
        .iter()
        .map(|c| (c.op_id, c.coll.start_unix_ns))
        .collect();
    assert_eq!(got, vec![(1, 1_000_100), (3, 1_000_300)]);
    assert_eq!((a.counters.dev_work, a.counters.dev_joined), (2, 2));
    assert_eq!(a.pending(), 1, "op 2 waits for the timeout");
}

#[test]
fn timeouts_comm_end_and_overflow_close_ops_as_incomplete() {
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 2);
    let mut recs = prelude(TimingPath::KernelCh);
    recs.extend([coll(1, 0, 1), coll(2, 1, 1), coll(3, 2, 1)]);
    let out = feed(&mut a, &recs);
    assert_eq!(
        out.iter().map(|c| c.op_id).collect::<Vec<_>>(),
        vec![1],
        "oldest closed on overflow"
    );
    assert_eq!(a.counters.pending_overflow, 1);
    assert_eq!(a.oldest_pending_pos(0), Some(7));
    let mut out = Vec::new();
    a.apply(
        20,
        &Record::OpStop {
            comm: 0,
            id: 2,
            host_ns: 2000,
        },
        50,
        &mut out,
    );
    a.sweep(60, 20, &mut out);
    assert_eq!(
        out.iter().map(|c| c.op_id).collect::<Vec<_>>(),
        vec![3],
        "op 3 idle since 0"
    );
    assert_eq!(out[0].coll.timing_source.as_str(), "host");
    a.apply(
        21,
        &Record::CommEnd {
            comm: 0,
            host_ns: 0,
        },
        60,
        &mut out,
    );
    assert_eq!(out.iter().map(|c| c.op_id).collect::<Vec<_>>(), vec![3, 2]);
    assert_eq!(
        (
            out[1].coll.start_unix_ns,
            out[1].coll.end_unix_ns - out[1].coll.start_unix_ns,
            out[1].coll.exec_ns
        ),
        (out[1].coll.enqueue_unix_ns, 1000, 0),
        "host timing: from enqueue to stop, no exec time"
    );
    assert_eq!(a.counters.incomplete, 3);
    assert_eq!(a.pending(), 0);
}

#[test]
fn the_oldest_op_in_flight_holds_the_commit_point_while_later_ones_finish() {
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 1 << 20);
    let mut recs = prelude(TimingPath::KernelCh);
    let first = recs.len() as u64;
    // Op 1 never stops; ops 2.. start and stop behind it, many times over.
    recs.push(coll(1, 0, 0));
    for id in 2..20_000 {
        recs.push(coll(id, id, 0));
        recs.push(Record::OpStop {
            comm: 0,
            id,
            host_ns: 2000,
        });
    }
    let out = feed(&mut a, &recs);
    assert_eq!(out.len(), 19_998);
    assert_eq!(a.oldest_pending_pos(0), Some(first));
    assert!(
        a.by_pos.len() <= 2 * a.pending() + 1024,
        "finished ops' entries are dropped: {}",
        a.by_pos.len()
    );
    let mut out = Vec::new();
    a.finish_all(&mut out);
    assert_eq!(out.iter().map(|c| c.op_id).collect::<Vec<_>>(), vec![1]);
    assert_eq!(a.oldest_pending_pos(0), None);
}

#[test]
fn restore_resumes_with_the_dictionary_and_marks_prior_deliveries() {
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    feed(&mut a, &prelude(TimingPath::KernelCh));
    assert!(a.take_dictionary_changed());
    let dict = a.dictionary();
    let mut b = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    b.restore(dict, [(10, 6, done::RECORDED)]);
    let mut out = Vec::new();
    b.apply(6, &coll(10, 5, 0), 0, &mut out);
    b.apply(
        7,
        &Record::OpStop {
            comm: 0,
            id: 10,
            host_ns: 1000,
        },
        0,
        &mut out,
    );
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].prior, done::RECORDED);
    let c = InstanceRef {
        inst: &out[0].coll,
        names: b.names(),
    };
    assert_eq!(c.func(), "AllReduce");
    assert!(!b.prune_prior(7), "no replay cursor");
    assert!(b.prior.is_empty());
}

/// NCCL numbers no p2p: each (peer, function) is numbered in order, so the k-th Send from a to
/// b and the k-th Recv at b from a get the same number, and a restarted daemon that reads the
/// records after its committed tail again gives them the numbers they had.
#[test]
fn p2p_is_numbered_per_peer_and_function_and_a_restart_resumes_at_the_tail() {
    let p2p = |id, func, peer| Record::P2pStart {
        comm: 0,
        id,
        func: StrId(func),
        datatype: StrId(2),
        count: 8,
        peer,
        n_channels: 0,
        host_ns: 1000,
        captured: false,
    };
    let mut recs = prelude(TimingPath::KernelCh);
    recs.extend([s(10, "Send"), s(11, "Recv")]);
    let tail = recs.len() as u64 + 4; // the third p2p's first record
    for (id, func, peer) in [(100, 10, 2), (101, 10, 3), (102, 11, 2), (103, 10, 2)] {
        recs.push(p2p(id, func, peer));
        recs.push(Record::OpStop {
            comm: 0,
            id,
            host_ns: 1000,
        });
    }
    let numbers = |out: &[Completed]| -> Vec<(i32, u64)> {
        out.iter()
            .map(|c| (c.coll.desc.peer, c.coll.desc.seq))
            .collect()
    };
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    let out = feed(&mut a, &recs);
    assert_eq!(numbers(&out), [(2, 0), (3, 0), (2, 0), (2, 1)]);
    assert!(
        a.prune_prior(tail),
        "numbers given before the tail: the saved state changes"
    );
    let mut b = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    b.restore(a.dictionary(), []);
    let mut again = Vec::new();
    for (pos, r) in recs.iter().enumerate().skip(tail as usize) {
        b.apply(pos as u64, r, 0, &mut again);
    }
    assert_eq!(numbers(&again), [(2, 0), (2, 1)]);
}

/// The state saved for a tail holds the calibrations in effect there: a change read after the
/// tail is read again after a restart, and the instances before it keep the times they had.
#[test]
fn the_saved_calibration_is_the_one_in_effect_at_the_tail() {
    let mut recs = prelude(TimingPath::KernelCh);
    let tail = recs.len() as u64;
    recs.push(fixture::calibration(0, 2_000_000, 250));
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    feed(&mut a, &recs);
    let offsets = |a: &Assembler| -> Vec<(i32, i64)> {
        (a.dictionary().calibrations.iter())
            .map(|(dev, c)| (*dev, c.offset_ns))
            .collect()
    };
    let _ = a.prune_prior(tail);
    assert_eq!(offsets(&a), [(0, 1_000_000)]);
    assert!(
        a.prune_prior(tail + 1),
        "the change is committed: save the state again"
    );
    assert_eq!(offsets(&a), [(0, 2_000_000)]);
}

#[test]
fn unknown_references_are_counted_not_fatal() {
    let mut a = Assembler::new(7, 1000, "job".into(), "node".into(), 100);
    let mut out = Vec::new();
    a.apply(0, &coll(1, 0, 1), 0, &mut out);
    a.apply(
        1,
        &Record::KernelCh {
            comm: 0,
            parent: 1,
            channel: 0,
            gpu_start: 0,
            gpu_stop: 1,
            host_ns: 0,
        },
        0,
        &mut out,
    );
    a.apply(
        2,
        &Record::OpStop {
            comm: 0,
            id: 1,
            host_ns: 0,
        },
        0,
        &mut out,
    );
    assert!(out.is_empty());
    assert_eq!(
        (a.counters.unknown_comm, a.counters.kernel_unjoined),
        (1, 1)
    );
}

fn limited() -> Assembler {
    Assembler::new(7, 0, "job".into(), "node".into(), 1000).with_limits(Limits {
        max_comms: 2,
        max_strings: 8,
        max_func_names: 2,
        max_devices: 2,
        max_early_works: 4,
        ..Limits::default()
    })
}

fn comm_at(comm: u32, cuda_dev: i32, path: TimingPath) -> Record {
    match super::tests::comm(path) {
        Record::Comm {
            comm_hash,
            rank,
            nranks,
            nnodes,
            name,
            nccl_version,
            host_ns,
            ..
        } => Record::Comm {
            comm,
            comm_hash: comm_hash + comm as u64,
            rank,
            nranks,
            nnodes,
            cuda_dev,
            name,
            nccl_version,
            path,
            host_ns,
            gpu: None,
        },
        _ => unreachable!(),
    }
}

#[test]
fn a_hostile_stream_is_refused_at_each_limit_and_counted() {
    let mut a = limited();
    let mut recs = prelude(TimingPath::KernelCh);
    for id in 5..40 {
        recs.push(s(id, "x"));
    }
    recs.push(s(1, "Broadcast")); // redefines "AllReduce"
    for comm in 1..10 {
        recs.push(comm_at(comm, 0, TimingPath::KernelCh));
    }
    for func_id in 0..10 {
        recs.push(Record::FuncName {
            func_id,
            name: StrId(1),
        });
    }
    for cuda_dev in 0..10 {
        recs.push(fixture::calibration(cuda_dev, 1_000_000, 250));
    }
    recs.push(coll(10, 5, 2));
    for _ in 0..1000 {
        recs.push(Record::KernelCh {
            comm: 0,
            parent: 10,
            channel: 0,
            gpu_start: 100,
            gpu_stop: 900,
            host_ns: 0,
        });
    }
    feed(&mut a, &recs);
    let c = a.counters;
    assert_eq!(
        c.string_limit,
        35 - 4 + 1,
        "ids above 8, and the redefinition"
    );
    assert_eq!(a.string(1), "AllReduce");
    assert_eq!(c.comm_limit, 8, "comm 0 and 1 fit");
    assert_eq!(c.func_name_limit, 8);
    assert_eq!(c.device_limit, 8);
    assert_eq!(c.channel_limit, 998, "one KernelCh per channel");
    assert_eq!(a.ops[&10].channels.len(), 2);
    // The dictionary a restart would need stays as small as the limits.
    let d = a.dictionary();
    assert_eq!(
        (
            d.strings.len(),
            d.comms.len(),
            d.func_names.len(),
            d.calibrations.len()
        ),
        (8, 2, 2, 2)
    );
    // Device-hook work items: for a live hook-path communicator only, and bounded in all.
    let mut b = limited();
    let mut recs = prelude(TimingPath::DeviceHook);
    for comm in [0, 5] {
        for channel in 0..8 {
            recs.push(Record::DevWork {
                comm,
                channel,
                func_id: 42,
                work_counter: 0,
                gpu_start: 0,
                gpu_stop: 1,
            });
        }
    }
    feed(&mut b, &recs);
    assert_eq!(b.early_items(), 4);
    assert_eq!(b.counters.early_work_limit, 4, "comm 0's channels 4..8");
    assert_eq!(b.waiting.len(), 4, "no lane for the unknown comm 5");
}

#[test]
fn finalized_communicators_make_room_once_their_end_is_committed() {
    let mut a = limited();
    let mut recs = prelude(TimingPath::KernelCh);
    recs.push(comm_at(1, 0, TimingPath::KernelCh));
    recs.push(Record::CommEnd {
        comm: 1,
        host_ns: 0,
    });
    let end_pos = recs.len() as u64 - 1;
    recs.push(comm_at(2, 0, TimingPath::KernelCh));
    feed(&mut a, &recs);
    assert_eq!(a.counters.comm_limit, 1, "comm 1's end not committed yet");
    let _ = a.prune_prior(end_pos + 1);
    let mut out = Vec::new();
    a.apply(100, &comm_at(2, 0, TimingPath::KernelCh), 0, &mut out);
    assert_eq!(a.counters.comm_limit, 1);
    let mut comms: Vec<u32> = a.all_comms().map(|c| c.comm).collect();
    comms.sort_unstable();
    assert_eq!(comms, vec![0, 2]);
}

#[test]
fn comm_end_closes_its_own_ops_in_order_and_a_first_calibration_only_those_awaiting_it() {
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 1000);
    let mut recs = uncalibrated_prelude(TimingPath::KernelCh);
    recs.push(comm_at(1, 1, TimingPath::KernelCh));
    // Comm 0 (device 0): ops 1..=3 complete and waiting for device 0's calibration; comm 1
    // (device 1): ops 11..=13 in flight.
    for id in 1..=3u64 {
        recs.push(coll(id, id, 1));
        recs.push(Record::KernelCh {
            comm: 0,
            parent: id,
            channel: 0,
            gpu_start: 10,
            gpu_stop: 20,
            host_ns: 0,
        });
        recs.push(Record::OpStop {
            comm: 0,
            id,
            host_ns: 0,
        });
        let mut other = coll(id + 10, id, 1);
        if let Record::CollStart { comm, .. } = &mut other {
            *comm = 1;
        }
        recs.push(other);
    }
    assert!(feed(&mut a, &recs).is_empty());
    assert_eq!(a.awaiting_calibration[&0].entries.len(), 3);
    let mut out = Vec::new();
    a.apply(100, &fixture::calibration(0, 0, 1), 0, &mut out);
    assert_eq!(
        out.iter().map(|c| c.op_id).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    out.clear();
    a.apply(
        101,
        &Record::CommEnd {
            comm: 1,
            host_ns: 0,
        },
        0,
        &mut out,
    );
    assert_eq!(
        out.iter().map(|c| c.op_id).collect::<Vec<_>>(),
        vec![11, 12, 13]
    );
    assert_eq!(a.pending(), 0);
}

#[test]
fn one_uids_processes_share_its_dictionary_budget() {
    let budget = UidBudget::new(6);
    let asm =
        || Assembler::new(7, 0, "job".into(), "node".into(), 100).with_uid_budget(budget.clone());
    let mut a = asm();
    feed(&mut a, &prelude(TimingPath::KernelCh));
    assert_eq!((budget.used(), a.counters.uid_limit), (6, 0));
    let mut b = asm();
    feed(&mut b, &prelude(TimingPath::KernelCh));
    assert_eq!(
        b.counters.uid_limit, 6,
        "4 strings, a device, a communicator"
    );
    assert_eq!(b.dictionary(), SavedDictionary::default());
    // The same entries read again take nothing more.
    feed(&mut a, &prelude(TimingPath::KernelCh));
    assert_eq!(budget.used(), 6);
    // A process's entries go back when its segment is reaped.
    drop(a);
    assert_eq!(budget.used(), 0);
    feed(&mut b, &prelude(TimingPath::KernelCh));
    assert_eq!(budget.used(), 6);
    let dict = b.dictionary();
    drop(b);
    // A restored dictionary counts, even beyond the budget.
    let mut c = asm();
    c.restore(dict.clone(), []);
    let mut d = asm();
    d.restore(dict, []);
    assert_eq!(budget.used(), 12);
}

/// A Coll captured into a graph (no stop, no work of its own).
fn captured(id: u64, seq: u64, func: u16, n_channels: u8) -> Record {
    let mut r = coll(id, seq, n_channels);
    if let Record::CollStart {
        func: f, captured, ..
    } = &mut r
    {
        *f = StrId(func);
        *captured = true;
    }
    r
}

fn dev(channel: u8, func_id: u32, wc: u64, t: u64, d: u64) -> Record {
    Record::DevWork {
        comm: 0,
        channel,
        func_id,
        work_counter: wc,
        gpu_start: t,
        gpu_stop: t + d,
    }
}

/// (seq, replay, exec) of each instance, in delivery order.
fn got(out: &[Completed]) -> Vec<(u64, u32, u64)> {
    out.iter()
        .map(|c| (c.coll.desc.seq, c.coll.replay, c.coll.exec_ns))
        .collect()
}

/// The hook prelude with a template of AllReduce (2 channels), Broadcast, AllReduce (1 channel
/// each) captured at NCCL seq 5; both AllReduces keep NCCL's unadvanced seq 5, made 5 and 6.
fn graph_prelude() -> Vec<Record> {
    let mut recs = hook_prelude();
    recs.push(s(11, "Broadcast"));
    recs.extend([
        captured(100, 5, 1, 2),
        captured(101, 5, 11, 1),
        captured(102, 5, 1, 1),
    ]);
    recs
}

#[test]
fn replays_are_attributed_to_the_template_and_eager_ops_keep_their_work() {
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let mut recs = graph_prelude();
    // Replay 1 ran on the GPU before the eager all-reduce was enqueued (host 5 ms).
    recs.extend([
        dev(0, 42, 0, 100, 100),
        dev(1, 42, 0, 110, 150),
        dev(0, 43, 1, 300, 20),
        dev(0, 42, 2, 400, 30),
    ]);
    let mut eager = coll(1, 5, 1);
    if let Record::CollStart { host_ns, .. } = &mut eager {
        *host_ns = 5_000_000;
    }
    recs.push(eager);
    recs.push(Record::OpStop {
        comm: 0,
        id: 1,
        host_ns: 5_000_100,
    });
    // The eager op's item, then replay 2 (its first item fits both: a replay boundary).
    recs.push(dev(0, 42, 3, 4_500_000, 999));
    recs.extend([
        dev(0, 42, 4, 6_000_000, 101),
        dev(0, 43, 5, 6_000_200, 21),
        dev(1, 42, 1, 6_000_000, 151),
        dev(0, 42, 6, 6_000_300, 31),
    ]);
    let out = feed(&mut a, &recs);
    assert_eq!(
        got(&out),
        vec![
            (5, 1, 150),
            (5, 1, 20),
            (6, 1, 30),
            (5, 0, 999),
            (5, 2, 21),
            (5, 2, 151),
            (6, 2, 31),
        ]
    );
    let replayed = &out[0].coll;
    assert_eq!(replayed.timing_source.as_str(), "device_hook");
    assert_eq!(replayed.start_unix_ns, 1_000_100);
    assert_eq!(replayed.enqueue_unix_ns, replayed.start_unix_ns);
    assert_eq!(
        replayed
            .channels
            .iter()
            .map(|c| c.channel)
            .collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert_eq!(out[3].op_id, 1, "the eager op");
    let c = &a.counters;
    assert_eq!((c.dev_work, c.dev_joined, c.dev_unattributed), (9, 9, 0));
    assert_eq!(a.pending(), 0);
}

#[test]
fn captured_operations_draw_on_the_uids_dictionary_budget() {
    let base = {
        let probe = UidBudget::new(1000);
        let mut a =
            Assembler::new(7, 0, "job".into(), "node".into(), 100).with_uid_budget(probe.clone());
        feed(&mut a, &hook_prelude());
        probe.used()
    };
    let budget = UidBudget::new(base + 2);
    let asm =
        || Assembler::new(7, 0, "job".into(), "node".into(), 100).with_uid_budget(budget.clone());
    let mut a = asm();
    let mut recs = hook_prelude();
    recs.extend([
        captured(100, 5, 1, 2),
        captured(101, 6, 1, 2),
        captured(102, 7, 1, 2),
    ]);
    feed(&mut a, &recs);
    assert_eq!(a.counters.uid_limit, 1, "the third captured op is refused");
    assert_eq!(a.replays.captured(0), 2);
    assert_eq!(budget.used(), base + 2);
    // A restarted daemon's copy holds them too; the communicator's end gives them back.
    let _ = a.prune_prior(recs.len() as u64);
    let mut b = asm();
    b.restore(a.dictionary(), []);
    assert_eq!(budget.used(), 2 * (base + 2));
    drop(b);
    let mut out = Vec::new();
    a.apply(
        100,
        &Record::CommEnd {
            comm: 0,
            host_ns: 0,
        },
        0,
        &mut out,
    );
    assert_eq!(budget.used(), base);
}

#[test]
fn work_waiting_when_a_graph_is_captured_leaves_the_bound() {
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let mut recs = hook_prelude();
    // Items read before their eager operation, then the communicator's first capture.
    recs.extend([dev(0, 42, 0, 100, 10), dev(1, 42, 0, 100, 10)]);
    recs.push(captured(100, 5, 1, 2));
    feed(&mut a, &recs);
    assert_eq!(a.early_items(), 0);
    assert_eq!(
        a.counters.dev_work - a.counters.dev_joined,
        2,
        "never joined"
    );
}

#[test]
fn lost_items_skip_their_ops_and_what_fits_nothing_is_counted() {
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let mut recs = graph_prelude();
    // Replay 1: the Broadcast's item (wc 11) was lost; the workCounter gap skips it.
    recs.extend([
        dev(0, 42, 10, 100, 10),
        dev(1, 42, 3, 100, 10),
        dev(0, 42, 12, 300, 12),
    ]);
    // A Broadcast item at a replay boundary with no eager op: fits nothing.
    recs.push(dev(0, 43, 13, 400, 5));
    // Replay 2: its all-reduce's channel-1 item was lost.
    recs.extend([
        dev(0, 42, 14, 500, 10),
        dev(0, 43, 15, 600, 11),
        dev(0, 42, 16, 700, 12),
    ]);
    let out = feed(&mut a, &recs);
    assert_eq!(
        got(&out),
        vec![(5, 1, 10), (6, 1, 12), (5, 2, 11), (6, 2, 12)]
    );
    assert_eq!(a.counters.dev_unattributed, 1);
    assert_eq!(a.pending(), 1, "replay 2's all-reduce waits for channel 1");
    // Replay 3: channel 1 lost all of replay 2's items; its workCounter gap (4) says so, so its
    // item joins replay 3, and replay 2's all-reduce, which channel 1 moved past, is dropped at
    // once (not joined to a later replay's item, not held until a timeout).
    let mut out = Vec::new();
    for (i, r) in [
        dev(0, 42, 17, 900, 10),
        dev(1, 42, 5, 900, 13),
        dev(0, 43, 18, 1000, 11),
        dev(0, 42, 19, 1100, 12),
    ]
    .iter()
    .enumerate()
    {
        a.apply(100 + i as u64, r, 0, &mut out);
    }
    assert_eq!(got(&out), vec![(5, 3, 13), (5, 3, 11), (6, 3, 12)]);
    assert_eq!(
        (
            a.counters.dev_unattributed,
            a.counters.dev_mismatch,
            a.pending()
        ),
        (1, 1, 0)
    );
    // The next replay lines up on both channels.
    let mut out = Vec::new();
    for (i, r) in [dev(0, 42, 20, 1200, 10), dev(1, 42, 6, 1200, 14)]
        .iter()
        .enumerate()
    {
        a.apply(200 + i as u64, r, 0, &mut out);
    }
    assert_eq!(got(&out), vec![(5, 4, 14)]);
    assert_eq!((a.counters.dev_mismatch, a.pending()), (1, 0));
}

#[test]
fn a_restart_mid_replay_delivers_nothing_twice_and_nothing_missing() {
    let mut recs = graph_prelude();
    let mut wc = [0u64; 2];
    for r in 0..4u64 {
        let t = 1_000 * (r + 1);
        for (ch, f, d) in [
            (0, 42, 10 + r),
            (1, 42, 20 + r),
            (0, 43, 30 + r),
            (0, 42, 40 + r),
        ] {
            recs.push(dev(ch, f, wc[ch as usize], t, d));
            wc[ch as usize] += 1;
        }
    }
    let expected: Vec<(u64, u32, u64)> = (1..=4)
        .flat_map(|r| {
            [
                (5, r, 20 + r as u64 - 1),
                (5, r, 30 + r as u64 - 1),
                (6, r, 40 + r as u64 - 1),
            ]
        })
        .collect();
    let mut whole = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let mut all = got(&feed(&mut whole, &recs));
    all.sort_unstable();
    let mut sorted = expected.clone();
    sorted.sort_unstable();
    assert_eq!(all, sorted);

    // The first daemon reads up to replay 3's channel-1 item (exclusive): replay 3's
    // all-reduce is in flight and holds the commit point.
    let cut = graph_prelude().len() + 2 * 4 + 1;
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let mut first = Vec::new();
    for (i, r) in recs[..cut].iter().enumerate() {
        a.apply(i as u64, r, 0, &mut first);
    }
    let tail = a.oldest_pending_pos(0).expect("replay 3 in flight");
    assert_eq!(tail, cut as u64 - 1);
    assert!(a.prune_prior(tail), "replays 1 and 2 moved the cursors");
    let dict = a.dictionary();
    let delivered: Vec<(u64, u64, u8)> = first
        .iter()
        .filter(|c| c.first_pos >= tail)
        .map(|c| (c.op_id, c.first_pos, done::ALL))
        .collect();
    assert!(delivered.is_empty());
    // The second daemon resumes from the tail with the saved dictionary.
    let mut b = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    b.restore(dict, delivered);
    let mut second = Vec::new();
    for (i, r) in recs.iter().enumerate().skip(tail as usize) {
        b.apply(i as u64, r, 0, &mut second);
    }
    let mut union: Vec<(u64, u32, u64)> = got(&first);
    union.extend(got(&second));
    union.sort_unstable();
    assert_eq!(union, sorted, "each replayed op exactly once");
    assert_eq!(b.counters.dev_unattributed, 0);
}

#[test]
fn a_restart_after_a_delivered_replay_marks_it_prior() {
    let mut recs = graph_prelude();
    // Replay 1: the 2-channel all-reduce's channel 1 comes last, after the others finished.
    recs.extend([
        dev(0, 42, 0, 100, 10),
        dev(0, 43, 1, 200, 11),
        dev(0, 42, 2, 300, 12),
        dev(1, 42, 0, 100, 13),
    ]);
    let cut = recs.len() - 1;
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let mut first = Vec::new();
    for (i, r) in recs[..cut].iter().enumerate() {
        a.apply(i as u64, r, 0, &mut first);
    }
    assert_eq!(got(&first), vec![(5, 1, 11), (6, 1, 12)]);
    let tail = a.oldest_pending_pos(0).unwrap();
    assert!(!a.prune_prior(tail), "nothing before the first replay item");
    let delivered: Vec<(u64, u64, u8)> = first
        .iter()
        .filter(|c| c.first_pos >= tail)
        .map(|c| (c.op_id, c.first_pos, done::ALL))
        .collect();
    assert_eq!(delivered.len(), 2);
    let mut b = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    b.restore(a.dictionary(), delivered);
    let mut second = Vec::new();
    for (i, r) in recs.iter().enumerate().skip(tail as usize) {
        b.apply(i as u64, r, 0, &mut second);
    }
    let fresh: Vec<_> = second.iter().filter(|c| c.prior != done::ALL).collect();
    assert_eq!(fresh.len(), 1);
    assert_eq!(
        (
            fresh[0].coll.desc.seq,
            fresh[0].coll.replay,
            fresh[0].coll.exec_ns
        ),
        (5, 1, 13)
    );
    assert_eq!(second.len(), 3, "the others again, marked as delivered");
}

/// An eager all-reduce `id` (NCCL seq `seq`, channel 0 only) enqueued at host time `host_ns`.
fn eager(id: u64, seq: u64, host_ns: u64) -> [Record; 2] {
    let mut r = coll(id, seq, 1);
    if let Record::CollStart { host_ns: h, .. } = &mut r {
        *h = host_ns;
    }
    let stop = Record::OpStop {
        comm: 0,
        id,
        host_ns: host_ns + 100,
    };
    [r, stop]
}

/// The GPU lags the CPU: eager all-reduce 1 is enqueued (host 5 ms) right after replay 1 was
/// launched and its host event is read before the replay's items (GPU 10 ms = host 11 ms), though
/// its own item runs after them; eager 2 likewise after replay 2. The template's functions differ
/// (all-reduce, broadcast, all-reduce on channel 0), so the items that follow decide.
fn lagging_run() -> Vec<Record> {
    let mut recs = graph_prelude();
    recs.extend(eager(1, 7, 5_000_000));
    recs.extend([
        dev(0, 42, 0, 10_000_000, 100),
        dev(1, 42, 0, 10_000_000, 150),
        dev(0, 43, 1, 10_000_200, 20),
        dev(0, 42, 2, 10_000_300, 30),
        dev(0, 42, 3, 10_000_400, 999),
    ]);
    recs.extend(eager(2, 8, 6_000_000));
    recs.extend([
        dev(0, 42, 4, 10_001_500, 101),
        dev(1, 42, 1, 10_001_500, 151),
        dev(0, 43, 5, 10_001_700, 21),
        dev(0, 42, 6, 10_001_800, 31),
        dev(0, 42, 7, 10_002_000, 888),
    ]);
    recs.push(Record::CommEnd {
        comm: 0,
        host_ns: 7_000_000,
    });
    recs
}

fn sorted(mut v: Vec<(u64, u32, u64)>) -> Vec<(u64, u32, u64)> {
    v.sort_unstable();
    v
}

#[test]
fn a_lagging_gpu_with_differing_functions_is_decided_and_every_instance_exact() {
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let out = feed(&mut a, &lagging_run());
    assert_eq!(
        sorted(got(&out)),
        sorted(vec![
            (5, 1, 150),
            (5, 1, 20),
            (6, 1, 30),
            (7, 0, 999),
            (5, 2, 151),
            (5, 2, 21),
            (6, 2, 31),
            (8, 0, 888),
        ]),
        "each eager operation has its own item, each replay its own"
    );
    let c = &a.counters;
    assert_eq!((c.dev_work, c.dev_joined), (10, 10));
    assert_eq!(
        (c.dev_ambiguous, c.dev_unattributed, c.dev_mismatch),
        (0, 0, 0)
    );
    assert_eq!((a.pending(), a.early_items()), (0, 0));
}

#[test]
fn a_lagging_gpu_with_equal_functions_is_counted_ambiguous_and_nothing_mis_joined() {
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let mut recs = hook_prelude();
    recs.extend([captured(100, 5, 1, 1), captured(101, 5, 1, 1)]);
    recs.extend(eager(1, 7, 5_000_000));
    // Replay 1 then the eager op, or the eager op then replay 1: every item fits both.
    recs.extend([
        dev(0, 42, 0, 10_000_000, 150),
        dev(0, 42, 1, 10_000_200, 200),
        dev(0, 42, 2, 10_000_400, 999),
    ]);
    // Replay 2: the eager op could also come after it (its item the last one here).
    recs.extend([
        dev(0, 42, 3, 10_001_000, 300),
        dev(0, 42, 4, 10_001_400, 400),
    ]);
    let out = feed(&mut a, &recs);
    assert!(out.is_empty(), "held while parses disagree");
    assert_eq!(a.early_items(), 5);
    assert!(a.oldest_pending_pos(0).is_some_and(|p| p <= 8 + 2 + 2));
    let mut out = Vec::new();
    let end = Record::CommEnd {
        comm: 0,
        host_ns: 7_000_000,
    };
    a.apply(recs.len() as u64, &end, 0, &mut out);
    // The eager operation lost its item: closed incomplete, with its host times only; no
    // replayed instance made up from items that may be the eager operation's.
    assert_eq!(got(&out), vec![(7, 0, 0)]);
    assert_eq!(out[0].coll.timing_source.as_str(), "host");
    assert!(out[0].coll.channels.is_empty());
    let c = &a.counters;
    assert_eq!((c.dev_ambiguous, c.dev_joined, c.incomplete), (5, 0, 1));
    assert_eq!((a.pending(), a.early_items()), (0, 0));
}

/// PyTorch's pattern: the very calls it then captures are warmed up eagerly (all-reduce,
/// broadcast, twice), synchronized, captured, and the graph replayed. The plugin forwards host
/// events first, so the warm-up's items are read after the capture, and every item fits both
/// the warm-up and a replay (same functions, same order). Only time decides: the warm-up ran
/// before the capture, and no replay of an operation can start before it was captured.
#[test]
fn warm_up_collectives_that_the_graph_repeats_are_not_taken_for_its_first_replay() {
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let mut recs = hook_prelude();
    recs.push(s(11, "Broadcast"));
    let at = |mut r: Record, ns: u64| {
        if let Record::CollStart { host_ns, .. } = &mut r {
            *host_ns = ns;
        }
        r
    };
    let warm_up = [(1, 0, 1), (2, 0, 11), (3, 1, 1), (4, 1, 11)];
    for (id, seq, func) in warm_up {
        recs.push(at(captured(id, seq, func, 1), 1_000_000 + id * 1000));
        if let Some(Record::CollStart { captured, .. }) = recs.last_mut() {
            *captured = false;
        }
        recs.push(Record::OpStop {
            comm: 0,
            id,
            host_ns: 1_000_500 + id * 1000,
        });
    }
    // Captured at host 3 ms (NCCL's seq not advanced under capture).
    recs.push(at(captured(100, 2, 1, 1), 3_000_000));
    recs.push(at(captured(101, 2, 11, 1), 3_000_100));
    // The warm-up's items: GPU 0.2 ms = host 1.2 ms, before the capture.
    for (wc, func_id) in [(0, 42), (1, 43), (2, 42), (3, 43)] {
        recs.push(dev(0, func_id, wc, 200_000 + wc * 10_000, 100 + wc));
    }
    // Two replays from GPU 5 ms = host 6 ms.
    for (wc, func_id) in [(4, 42), (5, 43), (6, 42), (7, 43)] {
        recs.push(dev(0, func_id, wc, 5_000_000 + wc * 10_000, 200 + wc));
    }
    let out = feed(&mut a, &recs);
    assert_eq!(
        sorted(got(&out)),
        sorted(vec![
            (0, 0, 100),
            (0, 0, 101),
            (1, 0, 102),
            (1, 0, 103),
            (2, 1, 204),
            (2, 1, 205),
            (2, 2, 206),
            (2, 2, 207),
        ]),
        "the warm-up device-timed, each replay its own"
    );
    let c = &a.counters;
    assert_eq!((c.dev_work, c.dev_joined), (8, 8));
    assert_eq!(
        (c.dev_ambiguous, c.dev_unattributed, c.dev_mismatch),
        (0, 0, 0)
    );
    assert_eq!((a.pending(), a.early_items()), (0, 0));
}

/// Issue 22: a host clock step between calibrations gave false stragglers, and a bad calibration put
/// a span in the year 2237. Kernel times that land an hour before their enqueue, or long after the
/// daemon read them, are not used: the instance keeps its host times, counted `implausible_time`.
#[test]
fn kernel_times_mapped_before_the_enqueue_or_into_the_future_are_not_used() {
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let mut out = feed(&mut a, &hook_prelude());
    let hour = 3_600_000_000_000u64;
    let read_at = 2 * hour;
    // Enqueued at host 2 h; its item maps (offset 1 ms) to host ~1 ms: two hours before.
    let mut recs = Vec::from(eager(1, 0, 2 * hour));
    recs.push(dev(0, 42, 0, 100, 50));
    // Enqueued at host 2 h; its item maps to ~year 2237, long after the daemon read it.
    recs.extend(eager(2, 1, 2 * hour));
    recs.push(dev(0, 42, 1, 8_400_000_000_000_000_000, 70));
    // A plausible one: starts 10 us after its enqueue, read 1 ms later.
    recs.extend(eager(3, 2, 2 * hour - 1_000_000));
    recs.push(dev(0, 42, 2, 2 * hour - 990_000 - 1_000_000, 90));
    for (i, r) in recs.iter().enumerate() {
        a.apply(100 + i as u64, r, read_at, &mut out);
    }
    let by_seq: Vec<(u64, &str, u64)> = out
        .iter()
        .map(|c| {
            (
                c.coll.desc.seq,
                c.coll.timing_source.as_str(),
                c.coll.exec_ns,
            )
        })
        .collect();
    assert_eq!(
        by_seq,
        [(0, "host", 0), (1, "host", 0), (2, "device_hook", 90)]
    );
    assert_eq!(a.counters.implausible_time, 2);
}

#[test]
fn an_item_held_when_no_more_come_goes_to_its_eager_op_at_the_timeout_or_the_end() {
    // After replay 1, an eager all-reduce's item: the next replay's first operation fits it too,
    // so it is held; no item follows.
    let mut recs = graph_prelude();
    recs.extend([
        dev(0, 42, 0, 100, 10),
        dev(1, 42, 0, 100, 10),
        dev(0, 43, 1, 200, 11),
        dev(0, 42, 2, 300, 12),
    ]);
    recs.extend(eager(1, 7, 5_000_000));
    recs.push(dev(0, 42, 3, 4_500_000, 999));
    for end in [
        None,
        Some(Record::CommEnd {
            comm: 0,
            host_ns: 7_000_000,
        }),
    ] {
        let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
        let mut out = feed(&mut a, &recs);
        assert_eq!(got(&out).len(), 3, "the eager op's item is held");
        assert_eq!(a.early_items(), 1);
        match &end {
            // Its operation idle past the timeout: no more items are coming.
            None => a.sweep(10_000_000_000, 10_000_000_000, &mut out),
            Some(r) => a.apply(recs.len() as u64, r, 0, &mut out),
        }
        assert_eq!(
            sorted(got(&out)),
            sorted(vec![(5, 1, 10), (5, 1, 11), (6, 1, 12), (7, 0, 999)]),
            "{end:?}"
        );
        assert_eq!((a.counters.dev_ambiguous, a.early_items()), (0, 0));
    }
}

#[test]
fn an_undecided_hold_older_than_the_timeout_drops_what_it_holds_and_frees_the_commit_point() {
    let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let mut recs = hook_prelude();
    recs.extend([captured(100, 5, 1, 1), captured(101, 5, 1, 1)]);
    let eager_pos = recs.len() as u64;
    recs.extend(eager(1, 7, 5_000_000));
    let before = feed(&mut a, &recs);
    assert!(before.is_empty());
    // Equal functions, the eager op's item anywhere among them: items keep coming for 11 s.
    let mut out = Vec::new();
    for wc in 0..7u64 {
        let t = 10_000_000 + 1_000 * wc;
        let now = wc * 11_000_000_000 / 6;
        a.apply(
            recs.len() as u64 + wc,
            &dev(0, 42, wc, t, 100),
            now,
            &mut out,
        );
    }
    assert!(out.is_empty(), "undecided");
    assert_eq!(
        a.oldest_pending_pos(0),
        Some(eager_pos),
        "the eager op and the held items"
    );
    a.sweep(11_000_000_000, 10_000_000_000, &mut out);
    assert_eq!(
        got(&out),
        vec![(7, 0, 0)],
        "the eager op, without device times"
    );
    assert_eq!((a.counters.dev_ambiguous, a.early_items()), (7, 0));
    assert_eq!(
        a.oldest_pending_pos(0),
        None,
        "nothing holds the commit point"
    );
}

/// Restarts `recs` at every record: the first assembler stops there and commits at its commit
/// point, the second resumes from its dictionary; together they deliver what one run delivers.
fn restart_anywhere(recs: &[Record], from: usize) {
    let mut whole = Assembler::new(7, 0, "job".into(), "node".into(), 100);
    let want = sorted(got(&feed(&mut whole, recs)));
    for cut in from..recs.len() {
        let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
        let mut first = Vec::new();
        for (i, r) in recs[..cut].iter().enumerate() {
            a.apply(i as u64, r, 0, &mut first);
        }
        let tail = a.oldest_pending_pos(0).unwrap_or(cut as u64);
        let _ = a.prune_prior(tail);
        let delivered: Vec<(u64, u64, u8)> = first
            .iter()
            .filter(|c| c.first_pos >= tail)
            .map(|c| (c.op_id, c.first_pos, done::ALL))
            .collect();
        let mut b = Assembler::new(7, 0, "job".into(), "node".into(), 100);
        b.restore(a.dictionary(), delivered);
        let mut second = Vec::new();
        for (i, r) in recs.iter().enumerate().skip(tail as usize) {
            b.apply(i as u64, r, 0, &mut second);
        }
        second.retain(|c| c.prior != done::ALL);
        first.extend(second);
        assert_eq!(sorted(got(&first)), want, "restart at {cut} (tail {tail})");
        assert_eq!(b.counters.dev_unattributed, 0, "restart at {cut}");
    }
}

#[test]
fn a_restart_while_items_are_held_delivers_nothing_twice_and_nothing_missing() {
    restart_anywhere(&lagging_run(), graph_prelude().len());
    // Across a dropped hold too: the items dropped stay dropped, the replay after it is exact.
    let mut recs = hook_prelude();
    recs.extend([captured(100, 5, 1, 1), captured(101, 5, 1, 1)]);
    let from = recs.len();
    recs.extend(eager(1, 7, 5_000_000));
    recs.extend(eager(2, 8, 5_000_500));
    for (wc, t) in [(0, 0), (1, 200), (2, 400), (3, 600), (4, 1000), (5, 1400)] {
        recs.push(dev(0, 42, wc, 10_000_000 + t, 100 + wc));
    }
    recs.push(Record::CommEnd {
        comm: 0,
        host_ns: 7_000_000,
    });
    restart_anywhere(&recs, from);
}

/// NCCL's p2p kernel runs a group's sends and receives as rounds on channels its p2p schedule
/// picks (rank 1 of 2: the round with the peer at `p2pnChannels / 2`, here 32, one work item per
/// channel for the fused send and receive), none of which a host event names: the eager send and
/// receive join that round's items, whose channel tells the width; the captured ones join the graph
/// template on those channels and each replay's items time them; the collectives beside them, eager
/// and replayed, keep their own items.
#[test]
fn p2p_work_items_join_their_round_and_leave_the_collectives_beside_them() {
    let p2p = |id, func, captured| Record::P2pStart {
        comm: 0,
        id,
        func: StrId(func),
        datatype: StrId(2),
        count: 1 << 16,
        peer: 0,
        n_channels: 2,
        host_ns: 1000,
        captured,
    };
    let stop = |id| Record::OpStop {
        comm: 0,
        id,
        host_ns: 2000,
    };
    let mut recs = hook_prelude();
    let two_ranks = Comm {
        comm_hash: 0xabc,
        rank: 1,
        nranks: 2,
        nccl_version: 23007,
        path: TimingPath::DeviceHook,
        ..Comm::default()
    };
    let at = (recs.iter())
        .position(|r| matches!(r, Record::Comm { .. }))
        .expect("prelude has its communicator");
    recs[at] = two_ranks.record();
    recs.extend([
        s(12, "SendRecv"),
        Record::FuncName {
            func_id: 50,
            name: StrId(12),
        },
        s(13, "Send"),
        s(14, "Recv"),
    ]);
    let from = recs.len();
    // Eager: an all-reduce on channel 0; a send and a receive in one plan, fused into one round on
    // channels 32 and 33; another all-reduce on channels 0 and 1.
    recs.extend([coll(1, 0, 1), stop(1), p2p(2, 13, false), p2p(3, 14, false)]);
    recs.extend([stop(2), stop(3), coll(4, 1, 2), stop(4)]);
    recs.extend([
        dev(0, 42, 0, 100, 10),
        dev(32, 50, 0, 200, 40),
        dev(33, 50, 0, 200, 40),
        dev(0, 42, 1, 300, 20),
        dev(1, 42, 0, 300, 25),
    ]);
    // A graph of an all-reduce, a send, a receive and an all-reduce, replayed twice.
    recs.extend([
        captured(10, 2, 1, 1),
        p2p(11, 13, true),
        p2p(12, 14, true),
        captured(13, 2, 1, 1),
    ]);
    for r in 0..2u64 {
        let t = 1000 + 1000 * r;
        recs.extend([
            dev(0, 42, 2 + 2 * r, t, 11),
            dev(32, 50, 1 + r, t + 100, 50),
            dev(33, 50, 1 + r, t + 100, 50),
            dev(0, 42, 3 + 2 * r, t + 200, 12),
        ]);
    }
    // (function, replay, timing source, exec) of each instance `recs` deliver, in order.
    let run = |recs: &[Record]| {
        let mut a = Assembler::new(7, 0, "job".into(), "node".into(), 100);
        let out = feed(&mut a, recs);
        let got: Vec<_> = (out.iter())
            .map(|c| {
                let name = a.names().get(c.coll.desc.func).to_string();
                (
                    name,
                    c.coll.replay,
                    c.coll.timing_source.as_str(),
                    c.coll.exec_ns,
                )
            })
            .collect();
        (a, got)
    };
    let (a, got) = run(&recs);
    // The send and receive complete with their round's items, both timed by them; the captured
    // ones are in the template on their round's channels (the eager round told the width), and
    // each replay's items time its send and receive.
    let want = [
        ("AllReduce", 0, "device_hook", 10),
        ("Send", 0, "device_hook", 40),
        ("Recv", 0, "device_hook", 40),
        ("AllReduce", 0, "device_hook", 25),
        ("AllReduce", 1, "device_hook", 11),
        ("Send", 1, "device_hook", 50),
        ("Recv", 1, "device_hook", 50),
        ("AllReduce", 1, "device_hook", 12),
        ("AllReduce", 2, "device_hook", 11),
        ("Send", 2, "device_hook", 50),
        ("Recv", 2, "device_hook", 50),
        ("AllReduce", 2, "device_hook", 12),
    ];
    let want: Vec<_> = (want.iter())
        .map(|&(f, r, t, e)| (f.to_string(), r, t, e))
        .collect();
    assert_eq!(got, want);
    let c = &a.counters;
    assert_eq!(
        (c.dev_p2p, c.p2p_host_timed, c.p2p_captured_untimed),
        (0, 0, 0)
    );
    assert_eq!(
        (c.dev_unattributed, c.dev_mismatch, c.incomplete),
        (0, 0, 0)
    );
    assert_eq!(a.pending(), 0);
    // A daemon restarted anywhere delivers the same (the width the eager round told is saved: a
    // capture read again after the restart is placed by it).
    restart_anywhere(&recs, from);

    // The capture read before the eager round's items (the plugin forwards host events while it
    // waits for its clock, so a rank's capture can come before its eager device records): placed
    // in the template once the eager items tell the width, in capture order; the eager items on
    // the channels the template uses still join their eager send and receive.
    let (items, capture) = (from + 8..from + 13, from + 13..from + 17);
    assert!(matches!(
        recs[capture.start],
        Record::CollStart { captured: true, .. }
    ));
    // As on a GPU: the capture 50 us after the eager items (host 1,000,100-1,000,345), the
    // replays after it.
    let later = |r: &Record| {
        let mut r = *r;
        match &mut r {
            Record::CollStart { host_ns, .. } | Record::P2pStart { host_ns, .. } => {
                *host_ns = 1_051_000;
            }
            Record::DevWork {
                gpu_start,
                gpu_stop,
                ..
            } => (*gpu_start, *gpu_stop) = (*gpu_start + 100_000, *gpu_stop + 100_000),
            _ => {}
        }
        r
    };
    let early: Vec<Record> = (recs[..from + 8].iter().copied())
        .chain(recs[capture.clone()].iter().map(later))
        .chain(recs[items].iter().copied())
        .chain(recs[capture.end..].iter().map(later))
        .collect();
    let (a, mut sorted_got) = run(&early);
    let mut sorted_want = want.clone();
    sorted_want.sort();
    sorted_got.sort();
    assert_eq!(sorted_got, sorted_want);
    let c = &a.counters;
    assert_eq!(
        (
            c.dev_p2p,
            c.p2p_captured_untimed,
            c.dev_unattributed,
            c.incomplete
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(a.pending(), 0);
    restart_anywhere(&early, from);
}
