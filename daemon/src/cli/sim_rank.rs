//! `ncclscope sim-rank` (hidden; started by `demo`): one simulated rank of a training job. It loads
//! the real plugin `.so` through the fake NCCL host and drives it as NCCL would: a communicator, then a
//! training-step mix of all-reduce, all-gather and reduce-scatter over 8 to 32 channels, with kernel
//! work timed on the simulated GPU clock (CLOCK_MONOTONIC).
//!
//! The ranks do not talk to each other: every rank computes every rank's arrival time from the same
//! deterministic schedule (shared epoch, hashed jitter, the injected faults' delay), so all of them
//! agree on when each collective's kernels can finish, exactly as a real collective ends only after its
//! last rank arrived.
//!
//! A job may span nodes: ranks are placed on `--nnodes` nodes in contiguous blocks, as a launcher
//! places them, and NCCL's `init` gets the node count; each node's ranks register with that node's
//! daemon (the caller's `NCCLSCOPE_SOCKET`), on that node's clock (the caller's
//! `NCCLSCOPE_TEST_CLOCK_OFFSET_NS`, read by the plugin). The faults: one late rank (`--straggler`) and one late
//! node (`--late-node`: every rank on it late, as behind a bad host, NIC or PCIe switch), from
//! `--late-from-s` on.

use std::ffi::CStr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use ncclscope_fakenccl::{CollSpec, CommSpec, Host, HostKind};

/// Kernel timing path the simulated NCCL exercises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TimingPath {
    /// The RFC device hook (an RFC-patched NCCL host), rings written by the CPU writer.
    Hook,
    /// Stock NCCL 2.28: KernelCh events with the GPU `pTimer`.
    Stock,
}

impl TimingPath {
    pub fn name(self) -> &'static str {
        match self {
            TimingPath::Hook => "hook",
            TimingPath::Stock => "stock",
        }
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// The plugin library to load (default: found as `demo` finds it).
    #[arg(long)]
    pub plugin: Option<PathBuf>,
    #[arg(long)]
    pub rank: u32,
    #[arg(long)]
    pub nranks: u32,
    /// CLOCK_MONOTONIC ns at which the first training step starts (shared by all ranks).
    #[arg(long)]
    pub epoch_ns: u64,
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// Nodes the job's ranks are spread over (contiguous blocks of ranks, as [`node_of`] places them).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub nnodes: u32,
    /// The communicator's hash (NCCL derives it from the communicator's unique id; default: the demo's).
    #[arg(long, default_value_t = COMM_HASH)]
    pub comm_hash: u64,
    /// The communicator's name (`config.commName`).
    #[arg(long, default_value = "demo-dp")]
    pub comm_name: String,
    /// A rank made late.
    #[arg(long)]
    pub straggler: Option<u32>,
    /// A node made late: every rank on it.
    #[arg(long)]
    pub late_node: Option<u32>,
    /// How late a late rank starts its kernels, in microseconds.
    #[arg(long, default_value_t = 3000)]
    pub straggler_delay_us: u64,
    /// Seconds after the first step at which the late ranks start being late.
    #[arg(long, default_value_t = 0)]
    pub late_from_s: u64,
    #[arg(long, value_enum, default_value_t = TimingPath::Hook)]
    pub path: TimingPath,
}

/// Runs the rank: loads the plugin as the chosen NCCL would, joins the communicator, drives every
/// collective of the schedule at its planned time, finalizes, and prints [`produced_line`].
pub fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rank < args.nranks,
        "rank {} is not below nranks {}",
        args.rank,
        args.nranks
    );
    anyhow::ensure!(
        args.nnodes <= args.nranks,
        "{} nodes for {} ranks: every node runs a rank",
        args.nnodes,
        args.nranks
    );
    if let Some(n) = args.late_node {
        anyhow::ensure!(
            n < args.nnodes,
            "--late-node {n} is not a node of {}",
            args.nnodes
        );
    }
    let plugin = match args.plugin {
        Some(p) => p,
        None => find_plugin(args.path)?,
    };
    let host = Host::load(&plugin, host_kind(args.path))?;
    let node = node_of(args.rank, args.nranks, args.nnodes);
    let first_on_node = (0..args.nranks)
        .find(|&r| node_of(r, args.nranks, args.nnodes) == node)
        .unwrap_or(0);
    let mut comm = host.init_comm(&CommSpec {
        comm_hash: args.comm_hash,
        rank: args.rank as i32,
        nranks: args.nranks as i32,
        nnodes: args.nnodes as i32,
        name: Some(args.comm_name.clone()),
        // The node's local device, as a launcher hands out one GPU per local rank.
        cuda_dev: (args.rank - first_on_node) as i32,
    })?;
    let late = late_ranks(args.nranks, args.nnodes, args.straggler, args.late_node);
    let schedule = Schedule {
        epoch_ns: args.epoch_ns,
        nranks: args.nranks,
        late,
        late_from_ns: args.late_from_s * 1_000_000_000,
        straggler_delay_ns: args.straggler_delay_us * 1000,
    };
    let total = schedule.count(args.seconds);
    for seq in 0..total {
        let plan = schedule.plan(seq, args.rank);
        sleep_until(plan.arrival_ns);
        let op = plan.op;
        // The kernel starts now (this rank's arrival) and ends when the last rank's data is in.
        let kernel_ns = plan.end_ns.saturating_sub(monotonic_ns()).max(1_000);
        comm.collective(&CollSpec {
            func: op.func,
            datatype: op.datatype,
            algo: c"RING",
            proto: op.proto,
            count: op.bytes / op.elem_bytes,
            root: -1,
            n_channels: op.channels,
            n_warps: 16,
            kernel_ns,
            func_id: op.func_id,
            symmetric: None,
            user_tag: seq,
        });
    }
    comm.finalize();
    println!("{}", produced_line(total));
    Ok(())
}

/// Where the plugin library is: `NCCLSCOPE_PLUGIN`, else next to this executable (target/<profile>/),
/// else in its deps/ folder (where cargo leaves it when it is built as this package's dependency). The
/// fake NCCL host needs its stand-in libnccl in the same folder.
pub fn find_plugin(path: TimingPath) -> anyhow::Result<PathBuf> {
    const PLUGIN: &str = "libnccl_profiler_ncclscope.so";
    let libnccl = host_kind(path).libnccl_name();
    let usable = |dir: &std::path::Path| dir.join(PLUGIN).is_file() && dir.join(libnccl).is_file();
    if let Some(p) = std::env::var_os("NCCLSCOPE_PLUGIN") {
        let p = PathBuf::from(p);
        anyhow::ensure!(
            p.is_file(),
            "NCCLSCOPE_PLUGIN={} does not exist",
            p.display()
        );
        return Ok(p);
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no directory")?;
    for dir in [dir.to_path_buf(), dir.join("deps")] {
        if usable(&dir) {
            return Ok(dir.join(PLUGIN));
        }
    }
    anyhow::bail!(
        "{PLUGIN} and the fake NCCL's {libnccl} are not next to {}: build them with `cargo build --release \
         --workspace` (or run the demo with `cargo run --release --bin ncclscope -- demo`, which builds them)",
        exe.display()
    )
}

/// The NCCL the fake host pretends to be for a timing path: an RFC-patched 2.30 for the device hook,
/// stock 2.28 (ncclProfiler_v5, KernelCh events) otherwise.
pub fn host_kind(path: TimingPath) -> HostKind {
    match path {
        TimingPath::Hook => HostKind::Rfc,
        TimingPath::Stock => HostKind::V5,
    }
}

/// The communicator a simulated rank joins unless told another (`--comm-hash`).
pub const COMM_HASH: u64 = 0x5eed_0dde_c0ff_ee01;

/// A simulated job's communicator hash, from its job id: two jobs running at once never share one
/// (and so never share trace ids), as NCCL's hashes of random unique ids never do.
pub fn comm_hash_of(job: &str) -> u64 {
    job.bytes()
        .fold(COMM_HASH, |h, b| splitmix(h ^ u64::from(b)))
}

/// The ranks made late by a late rank (`straggler`) and a late node (all its ranks), in order.
pub fn late_ranks(
    nranks: u32,
    nnodes: u32,
    straggler: Option<u32>,
    late_node: Option<u32>,
) -> Vec<u32> {
    (0..nranks)
        .filter(|&r| straggler == Some(r) || late_node == Some(node_of(r, nranks, nnodes)))
        .collect()
}

/// The node `rank` runs on: ranks fill nodes in contiguous blocks (node sizes differ by at most one).
pub fn node_of(rank: u32, nranks: u32, nnodes: u32) -> u32 {
    (u64::from(rank) * u64::from(nnodes) / u64::from(nranks)) as u32
}
/// A training step: every op in [`STEP_MIX`] once, then idle until the next step.
pub const STEP_PERIOD_NS: u64 = 200_000_000;
/// Compute between two collectives of a step.
const GAP_NS: u64 = 4_000_000;
/// Modelled bus bandwidth and launch latency of a collective's kernel.
const BUSBW_BYTES_PER_NS: f64 = 120.0;
const LATENCY_NS: u64 = 8_000;
/// Arrival jitter of a punctual rank.
const JITTER_NS: u64 = 40_000;

/// One collective call of a training step, with the fake NCCL's device function id for it.
#[derive(Debug, PartialEq)]
pub struct Op {
    pub func: &'static CStr,
    pub func_id: u32,
    pub datatype: &'static CStr,
    pub elem_bytes: u64,
    pub proto: &'static CStr,
    pub bytes: u64,
    pub channels: u8,
}

const fn op(func: &'static CStr, bytes: u64, channels: u8) -> Op {
    // Device function ids and names of the fake NCCL build (tests/fakenccl/libnccl).
    match func.to_bytes() {
        b"AllGather" => Op {
            func,
            func_id: 1,
            datatype: c"ncclFloat32",
            elem_bytes: 4,
            proto: c"LL",
            bytes,
            channels,
        },
        b"AllReduce" => Op {
            func,
            func_id: 2,
            datatype: c"ncclFloat32",
            elem_bytes: 4,
            proto: c"LL",
            bytes,
            channels,
        },
        _ => Op {
            func,
            func_id: 3,
            datatype: c"ncclBfloat16",
            elem_bytes: 2,
            proto: c"SIMPLE",
            bytes,
            channels,
        },
    }
}

/// One training step (FSDP-like: parameter all-gathers, gradient reduce-scatters and all-reduces, a
/// small metadata all-reduce and the loss scalar).
pub const STEP_MIX: &[Op] = &[
    op(c"AllGather", 32 << 20, 16),
    op(c"AllGather", 32 << 20, 16),
    op(c"ReduceScatter", 32 << 20, 16),
    op(c"ReduceScatter", 32 << 20, 16),
    op(c"AllReduce", 128 << 20, 32),
    op(c"AllReduce", 128 << 20, 32),
    op(c"AllReduce", 4 << 10, 8),
    op(c"AllReduce", 8, 8),
];

/// One collective instance of the schedule, as seen by one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    pub seq: u64,
    pub op: &'static Op,
    /// When this rank enqueues it and its kernel starts (CLOCK_MONOTONIC ns).
    pub arrival_ns: u64,
    /// When every rank's kernel ends: after the last rank arrived.
    pub end_ns: u64,
}

/// The schedule every rank computes alike.
pub struct Schedule {
    pub epoch_ns: u64,
    pub nranks: u32,
    /// The ranks made late (a late rank, every rank of a late node).
    pub late: Vec<u32>,
    /// From this long after the epoch on (by planned step start), the late ranks are late.
    pub late_from_ns: u64,
    pub straggler_delay_ns: u64,
}

impl Schedule {
    /// The `seq`-th collective of the job, seen by `rank`.
    pub fn plan(&self, seq: u64, rank: u32) -> Planned {
        let index = (seq % STEP_MIX.len() as u64) as usize;
        let step = seq / STEP_MIX.len() as u64;
        // Within a step, each op starts a compute gap after the previous one could have ended at the
        // latest (so instances of one communicator never overlap).
        let mut base = self.epoch_ns + step * STEP_PERIOD_NS;
        for earlier in &STEP_MIX[..index] {
            base += GAP_NS + self.kernel_ns(earlier) + self.straggler_delay_ns * 2 + JITTER_NS;
        }
        let late_now = step * STEP_PERIOD_NS >= self.late_from_ns;
        let arrival = |r: u32| {
            let jitter = splitmix(seq ^ (u64::from(r) << 40)) % JITTER_NS;
            let late = if late_now && self.late.contains(&r) {
                // 80% .. 120% of the configured delay.
                self.straggler_delay_ns * 4 / 5
                    + splitmix(seq.wrapping_mul(31) ^ 0xdead)
                        % (self.straggler_delay_ns * 2 / 5 + 1)
            } else {
                0
            };
            base + jitter + late
        };
        let last = (0..self.nranks).map(arrival).max().unwrap_or(base);
        let op = &STEP_MIX[index];
        Planned {
            seq,
            op,
            arrival_ns: arrival(rank),
            end_ns: last + self.kernel_ns(op),
        }
    }

    /// A ring collective's kernel time once every rank is in: latency plus bytes over bus bandwidth.
    fn kernel_ns(&self, op: &Op) -> u64 {
        let n = f64::from(self.nranks);
        LATENCY_NS + (op.bytes as f64 * 2.0 * (n - 1.0) / n / BUSBW_BYTES_PER_NS) as u64
    }

    /// Collectives that start within `seconds` of the epoch.
    pub fn count(&self, seconds: u64) -> u64 {
        seconds * 1_000_000_000 / STEP_PERIOD_NS * STEP_MIX.len() as u64
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// CLOCK_MONOTONIC in ns: the simulated GPU clock (common.md, "Simulated GPU clock").
pub fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sleeps until CLOCK_MONOTONIC reaches `t`.
pub fn sleep_until(t: u64) {
    let now = monotonic_ns();
    if t > now {
        std::thread::sleep(Duration::from_nanos(t - now));
    }
}

/// The line a rank prints on stdout when it is done, read back by `demo`.
pub fn produced_line(n: u64) -> String {
    format!("produced {n}")
}

pub fn parse_produced(out: &str) -> Option<u64> {
    out.lines()
        .find_map(|l| l.strip_prefix("produced ")?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule() -> Schedule {
        Schedule {
            epoch_ns: 1_000_000_000,
            nranks: 4,
            late: vec![2],
            late_from_ns: 0,
            straggler_delay_ns: 1_500_000,
        }
    }

    #[test]
    fn the_straggler_arrives_last_and_every_rank_agrees_on_the_end() {
        let s = schedule();
        for seq in 0..200 {
            let plans: Vec<_> = (0..4).map(|r| s.plan(seq, r)).collect();
            let last = plans.iter().max_by_key(|p| p.arrival_ns).unwrap();
            assert_eq!(s.plan(seq, 2).arrival_ns, last.arrival_ns, "seq {seq}");
            assert!(
                plans
                    .iter()
                    .all(|p| p.end_ns == plans[0].end_ns && p.end_ns > p.arrival_ns)
            );
        }
    }

    #[test]
    fn one_ranks_instances_never_overlap_and_fit_their_step() {
        let s = schedule();
        let plans: Vec<_> = (0..80).map(|seq| s.plan(seq, 2)).collect();
        for w in plans.windows(2) {
            assert!(w[0].end_ns < w[1].arrival_ns, "{w:?}");
        }
        // Every step's work ends before the next step starts.
        for p in &plans {
            let step = p.seq / STEP_MIX.len() as u64;
            assert!(p.end_ns < s.epoch_ns + (step + 1) * STEP_PERIOD_NS);
        }
        assert_eq!(s.count(20), 100 * STEP_MIX.len() as u64);
    }

    #[test]
    fn a_late_node_is_late_in_every_rank_from_its_start_on() {
        // 4 ranks on 2 nodes, node 1 (ranks 2 and 3) late from the second second on.
        assert_eq!(
            (0..4).map(|r| node_of(r, 4, 2)).collect::<Vec<_>>(),
            [0, 0, 1, 1]
        );
        assert_eq!(
            (0..5).map(|r| node_of(r, 5, 2)).collect::<Vec<_>>(),
            [0, 0, 0, 1, 1]
        );
        let s = Schedule {
            late: vec![2, 3],
            late_from_ns: 1_000_000_000,
            ..schedule()
        };
        let lateness = |seq: u64, r: u32| {
            let earliest = (0..4).map(|r| s.plan(seq, r).arrival_ns).min().unwrap();
            s.plan(seq, r).arrival_ns - earliest
        };
        let per_second = s.count(1);
        for seq in 0..per_second {
            assert!((0..4).all(|r| lateness(seq, r) < JITTER_NS), "seq {seq}");
        }
        for seq in per_second..3 * per_second {
            for r in [2, 3] {
                assert!(
                    lateness(seq, r) >= 1_200_000 - JITTER_NS,
                    "seq {seq} rank {r}"
                );
            }
            assert!([0, 1].iter().all(|&r| lateness(seq, r) < JITTER_NS));
        }
    }

    #[test]
    fn each_job_has_its_own_communicator_hash() {
        assert_ne!(comm_hash_of("job-a"), comm_hash_of("job-b"));
        assert_eq!(comm_hash_of("job-a"), comm_hash_of("job-a"));
    }

    #[test]
    fn produced_round_trips() {
        assert_eq!(
            parse_produced(&format!("noise\n{}\n", produced_line(812))),
            Some(812)
        );
    }
}
