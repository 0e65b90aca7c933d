//! One fake-NCCL process ("a rank"): loads the plugin as the chosen NCCL would, runs communicators on
//! their own threads, and prints a JSON `Report` of everything it emitted on stdout.

use std::ffi::CStr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use ncclscope_fakenccl::report::{CommReport, OpReport, Report};
use ncclscope_fakenccl::{CollSpec, Comm, CommSpec, Host, HostKind, P2pSpec};

#[derive(Parser)]
struct Args {
    /// The plugin .so (default: the one in this binary's target dir).
    #[arg(long)]
    plugin: Option<PathBuf>,
    /// v5 (NCCL 2.28), v6 (2.30), v7 (2.32) or rfc (2.30 + device-hook RFC).
    #[arg(long, default_value = "v5", value_parser = parse_kind)]
    kind: HostKind,
    /// Override what ncclGetVersion answers (0: it fails).
    #[arg(long)]
    version: Option<i32>,
    /// Communicators, each driven by its own thread.
    #[arg(long, default_value_t = 1)]
    comms: u32,
    /// Collectives per communicator.
    #[arg(long, default_value_t = 10)]
    colls: u32,
    /// Sends/receives per communicator (after the collectives).
    #[arg(long, default_value_t = 0)]
    p2ps: u32,
    #[arg(long, default_value_t = 2)]
    channels: u8,
    #[arg(long, default_value_t = 10_000)]
    kernel_ns: u64,
    /// Make every other collective a symmetric kernel (v7: KernelPhase events).
    #[arg(long)]
    symmetric: bool,
    /// Also make calls the plugin must decline or ignore (unknown types, NULL args, garbage handles).
    #[arg(long)]
    noise: bool,
    /// Emit kernel events from a long-lived proxy thread per communicator, concurrently with later
    /// operations' host events.
    #[arg(long)]
    async_kernels: bool,
    /// The simulated GPU lags the host: each kernel starts when the previous one on the stream ended
    /// and its events come once it has run (implies --async-kernels). With --kernel-ns longer than
    /// --interval-us, the host enqueues eager operations while a graph replay still runs.
    #[arg(long)]
    gpu_lag: bool,
    #[arg(long, default_value_t = 0)]
    rank: i32,
    #[arg(long, default_value_t = 1)]
    nranks: i32,
    #[arg(long, default_value_t = 1)]
    nnodes: i32,
    #[arg(long, default_value_t = 0x5ca1_ab1e_0000_0000)]
    comm_hash: u64,
    /// Pause between operations, in microseconds.
    #[arg(long, default_value_t = 0)]
    interval_us: u64,
    /// Stay alive this long after the work, before finalize.
    #[arg(long, default_value_t = 0)]
    hold_ms: u64,
    /// After the work, fork; the child creates a communicator (as a forked worker using NCCL would) and
    /// reports on stderr whether the plugin stayed out ("fork-probe: child context: none").
    #[arg(long)]
    fork_probe: bool,
    /// Exit without calling finalize (a crashed or killed rank).
    #[arg(long)]
    no_finalize: bool,
    /// After everything else (pauses included): this many collectives back to back, then at once
    /// the end (finalize or exit), while the forwarding thread may be asleep.
    #[arg(long, default_value_t = 0)]
    last_burst: usize,
    /// After the collectives and p2ps: capture this many f32 all-reduces (8 B to 16 MiB, cycling)
    /// into a CUDA graph (host events only), then replay it `--replays` times (work items only).
    #[arg(long, default_value_t = 0)]
    graph_ops: u32,
    #[arg(long, default_value_t = 0)]
    replays: u32,
    /// Before the capture, run the graph's operations once eagerly, as PyTorch warms up the calls
    /// it then captures: the same device functions in the same order as every replay.
    #[arg(long)]
    warm_up: bool,
    /// Eager 8 B all-reduces (the graph's first device function) after each replay.
    #[arg(long, default_value_t = 1)]
    eager_between: u32,
    /// Channels of the captured all-reduces (default: --channels).
    #[arg(long)]
    graph_channels: Option<u8>,
    /// Kernel time of each captured all-reduce: `--kernel-ns` plus bytes / this many bytes per ns
    /// (0: `--kernel-ns` only). 170 gives a 16 MiB all-reduce ~99 us, as on an H100.
    #[arg(long, default_value_t = 170)]
    graph_bytes_per_ns: u64,
    /// Instead of the workload above: the communication of tests/gpu/rfc_nccl/torch_p2p.py in this
    /// mode (a2a or pp) as PyTorch issues it to NCCL on one of 2 ranks, `--steps` eager steps then
    /// one step captured and replayed `--replays` times (the recorded real runs of tests/data).
    #[arg(long, value_parser = ["a2a", "pp"])]
    torch_p2p: Option<String>,
    #[arg(long, default_value_t = 9)]
    steps: u32,
}

/// The graph's `n`-th captured all-reduce: f32, 8 B << (n % 22), its device function by size.
fn graph_coll(n: u32, channels: u8, kernel_ns: u64, bytes_per_ns: u64) -> CollSpec {
    let bytes = 8u64 << (n % 22);
    let (proto, func_id) = if bytes <= 65_536 {
        (c"LL", 2)
    } else if bytes <= 1_048_576 {
        (c"LL128", 4)
    } else {
        (c"SIMPLE", 5)
    };
    CollSpec {
        func: c"AllReduce",
        datatype: c"ncclFloat32",
        algo: c"RING",
        proto,
        count: bytes / 4,
        root: 0,
        n_channels: channels,
        n_warps: 8,
        kernel_ns: kernel_ns + bytes.checked_div(bytes_per_ns).unwrap_or(0),
        func_id,
        symmetric: None,
        user_tag: 0,
    }
}

fn parse_kind(s: &str) -> Result<HostKind, String> {
    HostKind::parse(s).ok_or_else(|| format!("unknown host kind {s:?} (v5, v6, v7, rfc)"))
}

const FUNCS: [(&CStr, u32); 3] = [(c"AllReduce", 2), (c"AllGather", 1), (c"ReduceScatter", 3)];
const TYPES: [&CStr; 3] = [c"ncclFloat32", c"ncclBfloat16", c"ncclInt8"];
const ALGOS: [&CStr; 2] = [c"RING", c"TREE"];
const PROTOS: [&CStr; 3] = [c"LL", c"LL128", c"SIMPLE"];

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let plugin = match &args.plugin {
        Some(p) => p.clone(),
        None => ncclscope_fakenccl::plugin_path()?,
    };
    let started_ns = ncclscope_proto::now_ns();
    let host = Host::load_as(
        &plugin,
        args.kind,
        args.version.unwrap_or(args.kind.version()),
    )?;
    let comms: Vec<CommReport> = if let Some(mode) = &args.torch_p2p {
        torch_p2p(&host, &args, mode)?
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..args.comms)
                .map(|i| {
                    let host = host.clone();
                    let args = &args;
                    s.spawn(move || run_comm(&host, args, i))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("communicator thread"))
                .collect::<anyhow::Result<_>>()
        })?
    };
    if args.fork_probe {
        fork_probe(&host)?;
    }
    let ended_ns = ncclscope_proto::now_ns();
    let report = Report {
        started_ns,
        ended_ns,
        kind: args.kind,
        symbol: host.symbol.clone(),
        plugin_name: host.plugin_name(),
        pid: std::process::id(),
        mask: host.mask(),
        comms,
        failed_calls: host.failed_calls(),
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn run_comm(host: &std::sync::Arc<Host>, args: &Args, i: u32) -> anyhow::Result<CommReport> {
    let spec = CommSpec {
        comm_hash: args.comm_hash + i as u64,
        rank: args.rank,
        nranks: args.nranks,
        nnodes: args.nnodes,
        name: i.is_multiple_of(2).then(|| format!("comm-{i}")),
        cuda_dev: i as i32,
    };
    let mut comm = host.init_comm(&spec)?;
    if args.async_kernels {
        comm.set_async_kernels()?;
    }
    if args.gpu_lag {
        comm.set_gpu_lag()?;
    }
    let mut ops = Vec::new();
    let pause = || {
        if args.interval_us > 0 {
            std::thread::sleep(Duration::from_micros(args.interval_us));
        }
    };
    for n in 0..args.colls as usize {
        let (func, func_id) = FUNCS[n % FUNCS.len()];
        let coll = CollSpec {
            func,
            datatype: TYPES[n % TYPES.len()],
            algo: ALGOS[n % ALGOS.len()],
            proto: PROTOS[n % PROTOS.len()],
            count: 1024 << (n % 8),
            root: (n % 3) as i32,
            n_channels: args.channels,
            n_warps: 8,
            kernel_ns: args.kernel_ns,
            func_id,
            symmetric: (args.symmetric && n % 2 == 1).then_some(c"AllReduce_RSxLD_AGxST"),
            user_tag: n as u64,
        };
        ops.push(comm.collective(&coll));
        pause();
    }
    for n in 0..args.p2ps as usize {
        let p2p = P2pSpec {
            func: if n.is_multiple_of(2) {
                c"Send"
            } else {
                c"Recv"
            },
            peer: (args.rank + 1) % args.nranks.max(1),
            // 4 KiB and 1 MiB in turn: NCCL runs them on 1 and 2 channels.
            count: (4096 << (8 * (n % 2))) + n as u64,
            kernel_ns: args.kernel_ns / 2,
            ..P2pSpec::default()
        };
        ops.push(comm.p2p(&p2p));
        pause();
    }
    if args.graph_ops > 0 {
        let channels = args.graph_channels.unwrap_or(args.channels);
        let eager = graph_coll(0, channels, args.kernel_ns, args.graph_bytes_per_ns);
        for n in 0..args.graph_ops * args.warm_up as u32 {
            let spec = graph_coll(n, channels, args.kernel_ns, args.graph_bytes_per_ns);
            ops.push(comm.collective(&spec));
        }
        comm.begin_capture();
        for n in 0..args.graph_ops {
            let spec = graph_coll(n, channels, args.kernel_ns, args.graph_bytes_per_ns);
            ops.push(comm.collective(&spec));
        }
        comm.end_capture();
        for _ in 0..args.replays {
            ops.extend(comm.replay());
            for _ in 0..args.eager_between {
                ops.push(comm.collective(&eager));
            }
            pause();
        }
    }
    for n in 0..args.last_burst {
        let (func, func_id) = FUNCS[n % FUNCS.len()];
        let coll = CollSpec {
            func,
            datatype: TYPES[0],
            algo: ALGOS[0],
            proto: PROTOS[0],
            count: 1024,
            root: 0,
            n_channels: args.channels,
            n_warps: 8,
            kernel_ns: args.kernel_ns,
            func_id,
            symmetric: None,
            user_tag: n as u64,
        };
        ops.push(comm.collective(&coll));
    }
    let ignored = if args.noise { comm.noise() } else { 0 };
    if args.hold_ms > 0 {
        std::thread::sleep(Duration::from_millis(args.hold_ms));
    }
    let (has_context, has_hook) = (comm.has_context(), comm.has_hook());
    let finalize_ns = if args.no_finalize {
        0
    } else {
        comm.finalize().as_nanos() as u64
    };
    Ok(CommReport {
        comm_hash: spec.comm_hash,
        rank: spec.rank,
        nranks: spec.nranks,
        nnodes: spec.nnodes,
        name: spec.name.clone(),
        has_context,
        has_hook,
        ops,
        ignored,
        finalize_ns,
    })
}

/// torch_p2p.py's sizes: f32 elements of a step's tensors, small (4 KiB: LL) and large (1 MiB: SIMPLE)
/// in turn.
const TORCH_SIZES: [u64; 2] = [1 << 10, 1 << 18];

/// A collective of torch_p2p.py with the channels and protocol NCCL gave it on the H100 (1 channel
/// for the small ones, 64 for the large; the large all-gather SIMPLE, the others LL).
fn torch_coll(func: &'static CStr, datatype: &'static CStr, count: u64, large: bool) -> CollSpec {
    let (proto, func_id) = match (func == c"AllGather", large) {
        (true, true) => (c"SIMPLE", 6),
        (true, false) => (c"LL", 1),
        (false, _) => (c"LL", 2),
    };
    CollSpec {
        func,
        datatype,
        proto,
        count,
        n_channels: if large { 64 } else { 1 },
        n_warps: 16,
        func_id,
        ..CollSpec::default()
    }
}

/// One step of torch_p2p.py on this rank of 2: `comms[0]` is the default group, `comms[1]` a2a's
/// second group. PyTorch's `all_to_all_single` is one NCCL group of a send and a receive to every
/// rank; `batch_isend_irecv` one group per micro-batch.
fn torch_step(comms: &mut [Comm], mode: &str, rank: i32, elems: u64, ops: &mut [Vec<OpReport>]) {
    const MICRO: usize = 4;
    let large = elems == TORCH_SIZES[1];
    let p2p = |func, count, peer| P2pSpec {
        func,
        datatype: c"ncclFloat32",
        count,
        peer,
        kernel_ns: 5_000,
    };
    if mode == "a2a" {
        let gather = torch_coll(c"AllGather", c"ncclInt8", 4 * elems, large);
        ops[0].push(comms[0].collective(&gather));
        let group: Vec<P2pSpec> = (0..2)
            .flat_map(|r| [p2p(c"Send", elems / 2, r), p2p(c"Recv", elems / 2, r)])
            .collect();
        ops[1].extend(comms[1].p2p_group(&group));
        let reduce = torch_coll(c"AllReduce", c"ncclFloat32", elems, large);
        ops[1].push(comms[1].collective(&reduce));
        return;
    }
    let (forward, backward) = if rank == 0 {
        (c"Send", c"Recv")
    } else {
        (c"Recv", c"Send")
    };
    for m in 0..=MICRO {
        let mut group = Vec::new();
        if m < MICRO {
            group.push(p2p(forward, elems, 1 - rank));
        }
        if m > 0 {
            group.push(p2p(backward, elems, 1 - rank));
        }
        ops[0].extend(comms[0].p2p_group(&group));
    }
    let loss = torch_coll(c"AllReduce", c"ncclFloat32", 1, false);
    ops[0].push(comms[0].collective(&loss));
}

/// `--torch-p2p`: torch_p2p.py's eager steps (sizes in turn), then a large step captured into one
/// CUDA graph over its communicators and replayed.
fn torch_p2p(
    host: &std::sync::Arc<Host>,
    args: &Args,
    mode: &str,
) -> anyhow::Result<Vec<CommReport>> {
    anyhow::ensure!(args.nranks == 2, "--torch-p2p runs one of 2 ranks");
    let specs: Vec<CommSpec> = (0..if mode == "a2a" { 2 } else { 1 })
        .map(|i| CommSpec {
            comm_hash: args.comm_hash + i,
            rank: args.rank,
            nranks: 2,
            ..CommSpec::default()
        })
        .collect();
    let mut comms = (specs.iter())
        .map(|s| host.init_comm(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut ops = vec![Vec::new(); comms.len()];
    for i in 0..args.steps as usize {
        torch_step(&mut comms, mode, args.rank, TORCH_SIZES[i % 2], &mut ops);
    }
    comms.iter_mut().for_each(Comm::begin_capture);
    torch_step(&mut comms, mode, args.rank, TORCH_SIZES[1], &mut ops);
    comms.iter_mut().for_each(Comm::end_capture);
    for _ in 0..args.replays {
        for (comm, ops) in comms.iter_mut().zip(&mut ops) {
            ops.extend(comm.replay());
        }
    }
    Ok((comms.into_iter().zip(specs).zip(ops))
        .map(|((comm, spec), ops)| CommReport {
            comm_hash: spec.comm_hash,
            rank: spec.rank,
            nranks: spec.nranks,
            nnodes: spec.nnodes,
            name: None,
            has_context: comm.has_context(),
            has_hook: comm.has_hook(),
            ops,
            ignored: 0,
            finalize_ns: comm.finalize().as_nanos() as u64,
        })
        .collect())
}

/// Forks; the child inits a communicator and exits with 0 if the plugin gave it no context.
fn fork_probe(host: &std::sync::Arc<Host>) -> anyhow::Result<()> {
    // SAFETY: the child only calls the plugin's init (which returns at once in a forked child) and
    // exits with _exit, without unwinding or running destructors.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = match host.init_comm(&CommSpec::default()) {
            Ok(comm) if !comm.has_context() => 0,
            _ => 1,
        };
        // SAFETY: terminates the forked child immediately.
        unsafe { libc::_exit(code) };
    }
    anyhow::ensure!(pid > 0, "fork failed");
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    eprintln!(
        "fork-probe: child context: {}",
        if ok { "none" } else { "GIVEN" }
    );
    Ok(())
}
