//! The real plugin .so, loaded by a fake NCCL of each flavour (2.28 v5, 2.30 v6, 2.32 v7, RFC host), from
//! several threads, with descriptors flush against a guard page: every record in the segment is checked
//! against what the host emitted (see `ncclscope_fakenccl::check`).

use ncclscope_fakenccl::check::{Expect, check};
use ncclscope_fakenccl::process::{Catcher, run_rank};
use ncclscope_proto::{Counter, Record};

/// Three communicators on three threads, collectives (half symmetric) and p2p, plus calls to ignore.
const WORKLOAD: &[&str] = &[
    "--comms",
    "3",
    "--colls",
    "40",
    "--p2ps",
    "6",
    "--channels",
    "4",
    "--symmetric",
    "--noise",
];
/// Coll | P2p | KernelCh | KernelPhase.
const MASK_WITH_PHASES: (&str, &str) = ("NCCLSCOPE_EVENT_MASK", "0x8046");

fn host_roundtrip(kind: &str, v7_fields: bool) {
    let catcher = Catcher::start();
    let mut args = vec!["--kind", kind];
    args.extend_from_slice(WORKLOAD);
    let run = run_rank(&catcher, &args, &[MASK_WITH_PHASES]).unwrap();
    assert_eq!(
        run.report.mask, 0x8046,
        "init sets the mask from NCCLSCOPE_EVENT_MASK"
    );
    let seg = catcher.only_segment().unwrap();
    let summary = check(
        &run.report,
        &seg,
        Expect {
            v7_fields,
            finalized: true,
            ordered: true,
        },
    )
    .unwrap_or_else(|e| panic!("{kind}: {e:#}\nplugin log:\n{}", run.stderr));
    assert_eq!(summary.comms, 3);
    assert_eq!(summary.ops, 3 * 46);
    assert_eq!(summary.kernel_ch, 3 * (40 * 4 + 3 + 3 * 2));
    let phases = 3 * 20 * 4 * 3;
    assert_eq!(summary.kernel_phase, if v7_fields { phases } else { 0 });
    let noise: u64 = run.report.comms.iter().map(|c| c.ignored).sum();
    assert_eq!(summary.ignored, noise, "ignored = the host's noise calls");
    assert!(
        run.stderr
            .contains(&format!("loaded as {}", run.report.symbol)),
        "{}",
        run.stderr
    );
}

#[test]
fn nccl_2_28_through_v5() {
    host_roundtrip("v5", false);
}

#[test]
fn nccl_2_30_through_v6() {
    host_roundtrip("v6", false);
}

#[test]
fn nccl_2_32_through_v7_reads_v7_fields_and_kernel_phases() {
    host_roundtrip("v7", true);
}

#[test]
fn rfc_host_gets_v6_reads_and_the_device_hook_path() {
    // 112-byte descriptors behind `ncclProfiler_v7`: a v7-field read would hit the guard page.
    let catcher = Catcher::start();
    let mut args = vec!["--kind", "rfc"];
    args.extend_from_slice(WORKLOAD);
    // Default mask: the plugin may drop KernelCh once its hook is active.
    let run = run_rank(&catcher, &args, &[("NCCLSCOPE_RING_MEMORY", "cpu")]).unwrap();
    assert_eq!(run.report.symbol, "ncclProfiler_v7");
    assert!(run.stderr.contains("device-hook RFC"), "{}", run.stderr);
    let seg = catcher.only_segment().unwrap();
    let summary = check(&run.report, &seg, Expect::FINALIZED)
        .unwrap_or_else(|e| panic!("{e:#}\nplugin log:\n{}", run.stderr));
    let hooked = run.report.comms.iter().all(|c| c.has_hook);
    // getDeviceHook ran for each communicator with its cudaDev (0, 1, 2).
    let mut devs: Vec<i32> = seg
        .records
        .iter()
        .filter_map(|r| {
            if let Record::Comm { cuda_dev, .. } = r {
                Some(*cuda_dev)
            } else {
                None
            }
        })
        .collect();
    devs.sort();
    assert_eq!(devs, vec![0, 1, 2]);
    if hooked {
        assert_eq!(
            summary.dev_work,
            3 * (40 * 4 + 9),
            "every work item reached the segment"
        );
        assert_eq!(
            summary.kernel_ch, 0,
            "the plugin drops NCCL's KernelCh path when its hook is active"
        );
    } else {
        assert_eq!(summary.kernel_ch, 3 * (40 * 4 + 9));
    }
}

/// Eager collectives, a CUDA graph of 50 all-reduces captured and replayed 6 times with eager
/// all-reduces between the replays.
const GRAPH_WORKLOAD: &[&str] = &[
    "--colls",
    "5",
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
];

#[test]
fn rfc_host_graph_capture_is_flagged_and_every_replay_item_follows_its_host_events() {
    let catcher = Catcher::start();
    let mut args = vec!["--kind", "rfc"];
    args.extend_from_slice(GRAPH_WORKLOAD);
    let run = run_rank(&catcher, &args, &[("NCCLSCOPE_RING_MEMORY", "cpu")]).unwrap();
    let seg = catcher.only_segment().unwrap();
    let summary = check(&run.report, &seg, Expect::FINALIZED)
        .unwrap_or_else(|e| panic!("{e:#}\nplugin log:\n{}", run.stderr));
    assert!(run.report.comms[0].has_hook);
    // 5 eager (4 channels), 50 captured (8 channels, work at each of the 6 replays), 12 eager
    // between the replays (8 channels).
    assert_eq!(summary.ops, 5 + 50 + 12);
    assert_eq!(summary.dev_work, 5 * 4 + 12 * 8 + 6 * 50 * 8);
    let captured = seg
        .records
        .iter()
        .filter(|r| matches!(r, Record::CollStart { captured: true, .. }))
        .count();
    assert_eq!(captured, 50);
    // Every eager op's work items come after its CollStart in the segment: the daemon decides
    // eager-or-replay from what it has read.
    let mut eager_started = 0;
    let mut items_before = Vec::new();
    for r in &seg.records {
        match r {
            Record::CollStart {
                captured: false, ..
            } => eager_started += 1,
            Record::DevWork { channel: 0, .. } => items_before.push(eager_started),
            _ => {}
        }
    }
    let ops = &run.report.comms[0].ops;
    let mut eager_seen = 0;
    let mut want = Vec::new();
    for op in ops {
        if op.replay == 0 && !op.captured {
            eager_seen += 1;
        }
        if !op.hook_items.is_empty() {
            want.push(eager_seen);
        }
    }
    assert_eq!(items_before.len(), want.len());
    for (got, want) in items_before.iter().zip(&want) {
        assert!(got >= want, "a work item was written before its host event");
    }
}

#[test]
fn stock_path_replay_kernel_ch_is_counted_not_joined_to_a_stale_handle() {
    let catcher = Catcher::start();
    let mut args = vec!["--kind", "v6"];
    args.extend_from_slice(GRAPH_WORKLOAD);
    let run = run_rank(&catcher, &args, &[]).unwrap();
    let seg = catcher.only_segment().unwrap();
    // check() compares replay_kernel_ch with the replays' KernelCh events and finds no KernelCh
    // record for them.
    let summary = check(&run.report, &seg, Expect::FINALIZED)
        .unwrap_or_else(|e| panic!("{e:#}\nplugin log:\n{}", run.stderr));
    assert_eq!(summary.kernel_ch, 5 * 4 + 12 * 8);
    assert_eq!(seg.counter(Counter::ReplayKernelCh), 6 * 50 * 8);
}

#[test]
fn v7_symbol_on_an_nccl_of_unknown_version_reads_only_v6_fields() {
    let catcher = Catcher::start();
    let mut args = vec!["--kind", "v7", "--version", "0"];
    args.extend_from_slice(WORKLOAD);
    let run = run_rank(&catcher, &args, &[MASK_WITH_PHASES]).unwrap();
    assert!(
        run.stderr.contains("reading v6 descriptor fields only"),
        "{}",
        run.stderr
    );
    assert_eq!(
        run.stderr
            .matches("reading v6 descriptor fields only")
            .count(),
        1,
        "logged once"
    );
    let seg = catcher.only_segment().unwrap();
    let summary = check(&run.report, &seg, Expect::FINALIZED).unwrap();
    assert_eq!(summary.kernel_phase, 0);
    let noise: u64 = run.report.comms.iter().map(|c| c.ignored).sum();
    // KernelPhase is an unknown type without v7 fields: declined and counted.
    assert_eq!(summary.ignored, noise + 3 * 20 * 4 * 3);
}

#[test]
fn a_full_segment_drops_and_counts_every_lost_record() {
    let catcher = Catcher::start();
    // One communicator so the 12 distinct strings all fit in the first 64 records.
    let run = run_rank(
        &catcher,
        &[
            "--kind",
            "v6",
            "--comms",
            "1",
            "--colls",
            "100",
            "--channels",
            "4",
        ],
        &[("NCCLSCOPE_SEGMENT_RECORDS", "64")],
    )
    .unwrap();
    let seg = catcher.only_segment().unwrap();
    assert_eq!(seg.capacity, 64);
    assert_eq!(seg.records.len(), 64);
    let strings = seg.strings().unwrap().len() as u64;
    assert_eq!(
        strings,
        3 + 3 + 2 + 3 + 1,
        "funcs, datatypes, algos, protos, the comm name"
    );
    let produced = 1 + strings + 100 * (2 + 4) + 1;
    assert_eq!(
        seg.records.len() as u64 + seg.counter(Counter::RingFull),
        produced
    );
    assert_eq!(
        seg.counter(Counter::QueueFull) + seg.counter(Counter::PoolExhausted),
        0
    );
    let first = seg
        .records
        .iter()
        .find(|r| !matches!(r, Record::Str { .. }));
    assert!(matches!(first, Some(Record::Comm { .. })), "{first:?}");
    assert!(run.report.comms[0].ops.iter().all(|o| o.started));
}

#[test]
fn disabled_plugin_returns_an_empty_mask_and_creates_nothing() {
    let catcher = Catcher::start();
    let run = run_rank(
        &catcher,
        &["--kind", "v5", "--colls", "3"],
        &[("NCCLSCOPE_DISABLE", "1")],
    )
    .unwrap();
    assert_eq!(run.report.mask, 0);
    assert!(run.report.comms.iter().all(|c| !c.has_context));
    assert_eq!(catcher.count(), 0, "no segment handed over");
    assert!(
        run.stderr.contains("disabled by NCCLSCOPE_DISABLE=1"),
        "{}",
        run.stderr
    );
}

#[test]
fn invalid_settings_and_unknown_variables_are_logged_once_and_defaults_used() {
    let catcher = Catcher::start();
    let run = run_rank(
        &catcher,
        &["--kind", "v5", "--comms", "2", "--colls", "3"],
        &[
            ("NCCLSCOPE_EVENT_MASK", "lots"),
            ("NCCLSCOPE_SEGMENT_RECORDS", "100"),
            // Misspelt and unknown names: one warning for both, and the job runs on.
            ("NCCLSCOPE_SEGMENT_RECODRS", "1024"),
            ("NCCLSCOPE_COLOUR", "1"),
        ],
    )
    .unwrap();
    let unknown: Vec<&str> = (run.stderr.lines())
        .filter(|l| l.contains("ignoring unknown variables"))
        .collect();
    assert_eq!(unknown.len(), 1, "{}", run.stderr);
    assert!(
        unknown[0].contains("NCCLSCOPE_SEGMENT_RECODRS (did you mean NCCLSCOPE_SEGMENT_RECORDS?)")
            && unknown[0].contains("NCCLSCOPE_COLOUR"),
        "{}",
        unknown[0]
    );
    assert_eq!(run.report.mask, 0x46, "default mask Coll | P2p | KernelCh");
    assert_eq!(
        run.stderr.matches("ignoring NCCLSCOPE_EVENT_MASK").count(),
        1,
        "{}",
        run.stderr
    );
    assert_eq!(
        run.stderr
            .matches("ignoring NCCLSCOPE_SEGMENT_RECORDS")
            .count(),
        1
    );
    let seg = catcher.only_segment().unwrap();
    check(&run.report, &seg, Expect::FINALIZED).unwrap();
}

#[test]
fn a_rank_that_never_finalizes_hands_over_an_open_segment_with_its_records() {
    let catcher = Catcher::start();
    let run = run_rank(
        &catcher,
        &[
            "--kind",
            "v5",
            "--colls",
            "5",
            "--hold-ms",
            "200",
            "--no-finalize",
        ],
        &[],
    )
    .unwrap();
    let seg = catcher.only_segment().unwrap();
    assert!(!seg.closed);
    assert!(seg.ended, "its connection ended with the process");
    check(&run.report, &seg, Expect::OPEN).unwrap();
}

/// Issue 22: a rank that exits right after its work without finalizing (a script that returns
/// without destroying its communicators) lost what was still queued for the forwarding thread,
/// uncounted (2 of 500). In `exit` the plugin now gives the thread its last chance: every event is
/// in the segment, and nothing is counted lost.
#[test]
fn a_rank_that_exits_without_finalize_right_after_its_work_loses_nothing_queued() {
    let catcher = Catcher::start();
    let run = run_rank(
        &catcher,
        // The forwarding thread idles (20 ms between looks) through the pause, then 40
        // collectives come back to back and the process exits at once.
        &[
            "--kind",
            "v5",
            "--colls",
            "2",
            "--interval-us",
            "60000",
            "--last-burst",
            "40",
            "--no-finalize",
        ],
        &[],
    )
    .unwrap();
    let seg = catcher.only_segment().unwrap();
    assert!(!seg.closed && seg.ended);
    check(&run.report, &seg, Expect::OPEN).unwrap();
    assert_eq!(seg.counters.get("exit_unflushed").copied().unwrap_or(0), 0);
}

#[test]
fn simulation_maps_the_stock_path_gpu_clock_to_host_time() {
    let catcher = Catcher::start();
    let run = run_rank(
        &catcher,
        &["--kind", "v5", "--colls", "20"],
        &[("NCCLSCOPE_RING_MEMORY", "cpu")],
    )
    .unwrap();
    let seg = catcher.only_segment().unwrap();
    check(&run.report, &seg, Expect::FINALIZED).unwrap();
    let Some(Record::Calibration {
        offset_ns,
        error_ns,
        ..
    }) = seg
        .records
        .iter()
        .find(|r| matches!(r, Record::Calibration { cuda_dev: -1, .. }))
        .copied()
    else {
        panic!("no calibration for the stock path's simulated clock");
    };
    assert!(error_ns < 1_000_000, "error {error_ns} ns");
    // The fake kernel ends just before NCCL reports KernelChStop: mapped GPU time ~ host time.
    for r in &seg.records {
        if let Record::KernelCh {
            gpu_stop, host_ns, ..
        } = r
        {
            let mapped = gpu_stop.saturating_add_signed(offset_ns);
            assert!(
                mapped.abs_diff(*host_ns) < 1_000_000_000,
                "KernelCh at {mapped} reported at {host_ns}"
            );
        }
    }
}

#[test]
fn kernel_events_from_a_concurrent_proxy_thread_keep_their_parents() {
    // NCCL's proxy/profiler thread reports KernelCh (after the Coll has stopped) while the application
    // thread already starts the next operations: parents must stay valid and ids must not mix up.
    for kind in ["v5", "v7"] {
        let catcher = Catcher::start();
        let mut args = vec!["--kind", kind, "--async-kernels"];
        args.extend_from_slice(WORKLOAD);
        let run = run_rank(&catcher, &args, &[MASK_WITH_PHASES]).unwrap();
        let seg = catcher.only_segment().unwrap();
        let v7_fields = kind == "v7";
        let summary = check(
            &run.report,
            &seg,
            Expect {
                v7_fields,
                finalized: true,
                ordered: false,
            },
        )
        .unwrap_or_else(|e| panic!("{kind}: {e:#}\nplugin log:\n{}", run.stderr));
        assert_eq!(summary.kernel_ch, 3 * (40 * 4 + 3 + 3 * 2));
        assert_eq!(
            summary.kernel_phase,
            if v7_fields { 3 * 20 * 4 * 3 } else { 0 }
        );
    }
}

#[test]
fn a_child_forked_after_init_is_not_profiled_and_the_parent_is_unaffected() {
    let catcher = Catcher::start();
    let run = run_rank(
        &catcher,
        &[
            "--kind",
            "v6",
            "--comms",
            "2",
            "--colls",
            "10",
            "--fork-probe",
        ],
        &[],
    )
    .unwrap();
    assert!(
        run.stderr.contains("fork-probe: child context: none"),
        "{}",
        run.stderr
    );
    let seg = catcher.only_segment().unwrap();
    check(&run.report, &seg, Expect::FINALIZED).unwrap();
}
