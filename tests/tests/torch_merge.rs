//! `ncclscope export --merge TRACE.json`: a job's NCCL collectives added to a PyTorch profiler trace.
//! The trace is made here in the layout PyTorch's profiler writes (Kineto's Chrome JSON:
//! `baseTimeNanoseconds`, `ts` in microseconds after it, CPU ops and GPU kernels on numeric pids,
//! `distributedInfo`, `deviceProperties`); the job comes from a real spool, through the real binary.

use std::path::Path;
use std::process::{Command, Output};

use ncclscope::storage::spool::{Spool, SpoolLimits};
use ncclscope_proto::api::{ChannelWork, Collective};
use serde_json::{Value, json};

/// 1.8e18 ns: the profiled window's start, on CLOCK_REALTIME.
const BASE: u64 = 1_796_512_410_000_000_000;
const RANKS: u32 = 3;
const SEQS: u64 = 4;
/// Rank 2 starts every all-reduce this much later than the others.
const LATE_NS: u64 = 70_123;

fn coll(rank: u32, seq: u64) -> Collective {
    let start = BASE
        + 5_000_000
        + seq * 1_000_000
        + if rank == 2 {
            LATE_NS
        } else {
            17 * u64::from(rank)
        };
    Collective {
        uid: rustix::process::getuid().as_raw(),
        job_id: "train".into(),
        host: "node1".into(),
        pid: 4000 + rank,
        comm_hash: 0x5eed,
        comm_name: "dp".into(),
        rank,
        nranks: RANKS,
        seq,
        func: "AllReduce".into(),
        bytes: 1 << 20,
        start_unix_ns: start,
        end_unix_ns: start + 250_000,
        exec_ns: 250_000,
        timing_source: "device_hook".into(),
        channels: (0..2)
            .map(|channel| ChannelWork {
                channel,
                start_unix_ns: start + u64::from(channel),
                end_unix_ns: start + 240_000,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// A small trace as `torch.profiler` exports it for rank 0: a training step with a CPU op and the
/// GPU kernel it launched, all-reduce included.
fn torch_trace() -> Value {
    json!({
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "computeMajor": 9, "computeMinor": 0}],
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": RANKS},
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": BASE,
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 812, "tid": 812,
             "ts": 4000.0, "dur": 6000.0, "args": {"External id": 1}},
            {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 812, "tid": 812,
             "ts": 4990.5, "dur": 12.25, "args": {"External id": 2}},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0,
             "tid": 7, "ts": 5000.0, "dur": 250.0, "args": {"device": 0, "stream": 7, "correlation": 3}},
            {"ph": "M", "name": "process_name", "pid": 812, "args": {"name": "python3"}},
        ],
        "traceName": "rank0.pt.trace.json",
    })
}

/// `ncclscope export --job train --spool SPOOL --merge TRACE -o MERGED`, as this uid.
fn export_merged(spool: &Path, trace: &Path, merged: &Path) -> Output {
    let uid = rustix::process::getuid().as_raw().to_string();
    Command::new(ncclscope_tests::daemon_binary())
        .args(["export", "--job", "train", "--uid", &uid, "--spool"])
        .arg(spool)
        .arg("--merge")
        .arg(trace)
        .arg("-o")
        .arg(merged)
        .output()
        .unwrap()
}

#[test]
fn a_jobs_collectives_merge_into_a_pytorch_trace_on_its_clock_with_the_straggler_marked() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let mut spool = Spool::open(&spool_dir, SpoolLimits::default()).unwrap();
    let colls: Vec<_> = (0..SEQS)
        .flat_map(|seq| (0..RANKS).map(move |rank| (Default::default(), coll(rank, seq))))
        .collect();
    spool.append(&colls).unwrap();
    drop(spool);
    let trace = dir.path().join("rank0.pt.trace.json");
    std::fs::write(&trace, torch_trace().to_string()).unwrap();
    let merged = dir.path().join("merged.json");
    let out = export_merged(&spool_dir, &trace, &merged);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&std::fs::read(&merged).unwrap()).unwrap();
    let original = torch_trace();

    // PyTorch's part unchanged, its own keys and events first and in order.
    for key in [
        "schemaVersion",
        "deviceProperties",
        "distributedInfo",
        "baseTimeNanoseconds",
        "traceName",
    ] {
        assert_eq!(doc[key], original[key], "{key}");
    }
    let events = doc["traceEvents"].as_array().unwrap();
    let theirs = original["traceEvents"].as_array().unwrap();
    assert_eq!(&events[..theirs.len()], &theirs[..]);
    let added = &events[theirs.len()..];

    // One process per rank, on pids the trace does not use, named after the rank.
    let names: Vec<(u64, &str)> = (added.iter())
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(names.len(), RANKS as usize, "{names:?}");
    for (pid, name) in &names {
        assert!(*pid > 812, "pid {pid} taken by the trace");
        assert!(name.starts_with("rank "), "{name}");
    }

    // Every collective at its time on the trace's clock (ts = (unix ns - base) / 1000), the late rank
    // the straggler of each, and each channel's work on a track of its own.
    let slices: Vec<&Value> = added.iter().filter(|e| e["ph"] == "X").collect();
    let collectives: Vec<&&Value> = slices.iter().filter(|e| e["cat"] == "collective").collect();
    assert_eq!(collectives.len(), (RANKS as u64 * SEQS) as usize);
    for e in &collectives {
        let (rank, seq) = (
            e["args"]["rank"].as_u64().unwrap() as u32,
            e["args"]["seq"].as_u64().unwrap(),
        );
        let c = coll(rank, seq);
        let ts = e["ts"].as_f64().unwrap();
        let want = (c.start_unix_ns - BASE) as f64 / 1000.0;
        assert!(
            (ts - want).abs() < 0.0005,
            "rank {rank} seq {seq}: ts {ts}, want {want}"
        );
        assert!((e["dur"].as_f64().unwrap() - 250.0).abs() < 0.0005);
        assert_eq!(
            e["args"]["straggler"].as_bool().unwrap_or(false),
            rank == 2,
            "rank {rank} seq {seq}"
        );
        assert_eq!(e.get("cname").is_some(), rank == 2);
    }
    let channels = slices.iter().filter(|e| e["cat"] == "channel").count();
    assert_eq!(channels, (RANKS as u64 * SEQS * 2) as usize);
    // The rank's all-reduce lines up with the NCCL kernel PyTorch recorded for it (rank 0, seq 0).
    let kernel = &theirs[2];
    let first = collectives
        .iter()
        .find(|e| e["args"]["rank"] == 0 && e["args"]["seq"] == 0)
        .unwrap();
    assert!((first["ts"].as_f64().unwrap() - kernel["ts"].as_f64().unwrap()).abs() < 0.001);
}

#[test]
fn a_file_that_is_no_pytorch_trace_is_a_clear_error_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let mut spool = Spool::open(&spool_dir, SpoolLimits::default()).unwrap();
    spool.append(&[(Default::default(), coll(0, 0))]).unwrap();
    drop(spool);
    for (name, text) in [
        ("not-json.json", "ProfilerStep#3"),
        ("no-events.json", "{\"schemaVersion\": 1}"),
    ] {
        let trace = dir.path().join(name);
        std::fs::write(&trace, text).unwrap();
        let merged = dir.path().join("merged.json");
        let out = export_merged(&spool_dir, &trace, &merged);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains(name) && !err.contains("panicked"), "{err}");
        assert!(!merged.exists() && !dir.path().join("merged.json.partial").exists());
    }
}

/// Rank 0's trace with an NCCL kernel for each of its all-reduces as CUPTI times them: from 1.5 us
/// before the rank's work starts to 1 us after it ends, on a clock `ahead_ns` ahead of ncclscope's.
fn trace_with_kernels(ahead_ns: i64) -> Value {
    let mut t = torch_trace();
    let events = t["traceEvents"].as_array_mut().unwrap();
    events.retain(|e| e["cat"] != "kernel");
    for seq in 0..SEQS {
        let c = coll(0, seq);
        let start = c.start_unix_ns as i64 - 1_500 + ahead_ns - BASE as i64;
        let end = c.end_unix_ns as i64 + 1_000 + ahead_ns - BASE as i64;
        events.push(
            json!({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
            "pid": 0, "tid": 7, "ts": start as f64 / 1000.0, "dur": (end - start) as f64 / 1000.0,
            "args": {"device": 0, "stream": 7, "correlation": 10 + seq}}),
        );
    }
    t
}

/// A spool holding the job, and a directory for the rest.
fn spooled() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let mut spool = Spool::open(&spool_dir, SpoolLimits::default()).unwrap();
    let colls: Vec<_> = (0..SEQS)
        .flat_map(|seq| (0..RANKS).map(move |rank| (Default::default(), coll(rank, seq))))
        .collect();
    spool.append(&colls).unwrap();
    (dir, spool_dir)
}

/// Issue 38: the merged slices sat ~10 us before the kernels PyTorch recorded for them. `--merge`
/// now pairs its collectives with the trace's NCCL kernels, says the offset, and shifts them onto
/// the trace's clock, so that every kernel contains its collective; the trace records what it did.
#[test]
fn a_merge_measures_its_offset_against_the_traces_nccl_kernels_and_puts_each_collective_inside_its_kernel()
 {
    let (dir, spool_dir) = spooled();
    let trace = dir.path().join("rank0.pt.trace.json");
    std::fs::write(&trace, trace_with_kernels(10_400).to_string()).unwrap();
    let merged = dir.path().join("merged.json");
    let out = export_merged(&spool_dir, &trace, &merged);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // The shifts 8.9..11.4 us put each slice inside its kernel; the middle is taken.
    assert!(
        err.contains("4 of 4 collectives paired") && err.contains("10.150 us early"),
        "{err}"
    );
    assert!(err.contains("shifted by +10.150 us"), "{err}");
    let doc: Value = serde_json::from_slice(&std::fs::read(&merged).unwrap()).unwrap();
    let record = &doc["ncclscope_alignment"];
    assert_eq!(record["applied_offset_ns"], 10_150, "{record}");
    assert_eq!(
        (
            record["paired"].as_u64(),
            record["inside_before"].as_u64(),
            record["inside_after"].as_u64()
        ),
        (Some(4), Some(0), Some(4))
    );
    let events = doc["traceEvents"].as_array().unwrap();
    let kernels: Vec<(f64, f64)> = (events.iter())
        .filter(|e| e["cat"] == "kernel")
        .map(|e| {
            (
                e["ts"].as_f64().unwrap(),
                e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap(),
            )
        })
        .collect();
    let rank0: Vec<(f64, f64)> = (events.iter())
        .filter(|e| e["cat"] == "collective" && e["args"]["rank"] == 0)
        .map(|e| {
            (
                e["ts"].as_f64().unwrap(),
                e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(rank0.len(), SEQS as usize);
    for (s, e) in &rank0 {
        assert!(
            kernels.iter().any(|(ks, ke)| ks <= s && e <= ke),
            "slice {s}..{e} in no kernel of {kernels:?}"
        );
    }
    // The other ranks (same node, same host clock) moved with it: rank 2 is still the straggler.
    let late = (events.iter())
        .find(|e| e["cat"] == "collective" && e["args"]["rank"] == 2 && e["args"]["seq"] == 0)
        .unwrap();
    let want = (coll(2, 0).start_unix_ns + 10_150 - BASE) as f64 / 1000.0;
    assert!((late["ts"].as_f64().unwrap() - want).abs() < 0.0005);

    // Already aligned: nothing shifted.
    std::fs::write(&trace, trace_with_kernels(0).to_string()).unwrap();
    let out = export_merged(&spool_dir, &trace, &merged);
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&std::fs::read(&merged).unwrap()).unwrap();
    assert_eq!(doc["ncclscope_alignment"]["applied_offset_ns"], 0);
    assert_eq!(doc["ncclscope_alignment"]["inside_before"], 4);
}

/// `--align check` verifies only: past 1 us, or where nothing pairs, it refuses and writes nothing;
/// `off` merges as exported.
#[test]
fn a_merge_refuses_past_its_bounds_and_writes_nothing() {
    let (dir, spool_dir) = spooled();
    let trace = dir.path().join("rank0.pt.trace.json");
    let merged = dir.path().join("merged.json");
    let run = |ahead_ns: i64, align: &str| {
        std::fs::write(&trace, trace_with_kernels(ahead_ns).to_string()).unwrap();
        let uid = rustix::process::getuid().as_raw().to_string();
        Command::new(ncclscope_tests::daemon_binary())
            .args(["export", "--job", "train", "--uid", &uid, "--spool"])
            .arg(&spool_dir)
            .arg("--merge")
            .arg(&trace)
            .args(["--align", align, "-o"])
            .arg(&merged)
            .output()
            .unwrap()
    };
    let out = run(10_400, "check");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("past the 1 us"),
        "{err}"
    );
    assert!(!merged.exists());
    let out = run(600, "check");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_file(&merged).unwrap();
    // Another run's trace (an hour later): nothing pairs; `correct` merges as exported and says so,
    // `check` refuses.
    let hour = 3_600_000_000_000;
    let out = run(hour, "correct");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains("alignment not checked: none of"),
        "{err}"
    );
    let doc: Value = serde_json::from_slice(&std::fs::read(&merged).unwrap()).unwrap();
    assert_eq!(doc["ncclscope_alignment"]["checked"], false);
    std::fs::remove_file(&merged).unwrap();
    let out = run(hour, "check");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cannot check"),
        "{err}"
    );
    assert!(!merged.exists());
    let out = run(10_400, "off");
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&std::fs::read(&merged).unwrap()).unwrap();
    assert_eq!(doc["ncclscope_alignment"]["checked"], false);
}
