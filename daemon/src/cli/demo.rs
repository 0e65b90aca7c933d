//! `ncclscope demo`: the whole system on one machine without a GPU. Starts a daemon per simulated node
//! in this process (temporary sockets, state and spool of its own, its own `host.name`), runs N
//! simulated ranks as separate processes spread over the nodes, that load the real plugin `.so`
//! through the fake NCCL host and drive a training-step mix of collectives with an injected late rank
//! or node, shows the live view (or progress lines off a terminal), names the straggler found next to
//! the injected one, writes a Perfetto trace of the run and exports OTLP when given an endpoint.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::cli::export::{Format, export_nodes_via_api, export_via_api};
use crate::cli::sim_rank::{self, TimingPath};
use crate::cli::stats::{fetch, render, stragglers};
use crate::cli::top::{ViewOptions, show};
use crate::config::Config;
use crate::storage::hub::Hub;

#[derive(clap::Args)]
#[command(
    after_help = "Variables: NCCLSCOPE_PLUGIN, the plugin .so the ranks load [default: the one built next to this \
                  executable]; NCCLSCOPE_LOG, the in-process daemon's log filter [default: info]."
)]
pub struct Args {
    /// Simulated ranks (one process each).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=64))]
    pub ranks: u32,
    /// How long the ranks run.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Simulated nodes, one daemon each; the ranks are spread over them in contiguous blocks.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub nodes: u32,
    /// The rank made late (default: one chosen at random, unless a node is made late).
    #[arg(long)]
    pub straggler: Option<u32>,
    /// The node made late: every rank on it (as behind a bad host, NIC or PCIe switch).
    #[arg(long)]
    pub late_node: Option<u32>,
    /// How late a late rank starts its kernels, in microseconds.
    #[arg(long, default_value_t = 3000)]
    pub straggler_delay_us: u64,
    /// Seconds into the run at which the late rank or node becomes late (the verdict judges the
    /// whole run: start it before the middle).
    #[arg(long, default_value_t = 0)]
    pub late_from: u64,
    /// Serve each node's /metrics (with per-job series) on 127.0.0.<node + 1>:PORT (default: none).
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// Kernel timing path: the device hook (RFC host, CPU-written rings) or stock NCCL's KernelCh events.
    #[arg(long, value_enum, default_value_t = TimingPath::Hook)]
    pub path: TimingPath,
    /// Node K's clock runs K times this far ahead of node 0's (negative: behind), in microseconds, as
    /// the NTP- or PTP-kept clocks of real nodes differ: its daemon's and its ranks' alike.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(-3_600_000_000..=3_600_000_000))]
    pub node_clock_offset_us: i64,
    /// Also export spans and metrics to this OTLP/gRPC endpoint (e.g. http://127.0.0.1:4317; default: none).
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// Where to write the Perfetto trace (default: a file in the temporary directory).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Progress lines and a summary even on a terminal.
    #[arg(long)]
    pub plain: bool,
}

/// The simulated ranks, waited for on a thread while the view runs. Stopping it (or dropping it, on any
/// early return) kills the ranks still running, so that no process outlives the demo.
struct Ranks {
    stop: Arc<AtomicBool>,
    waiter: Option<std::thread::JoinHandle<RanksOutcome>>,
}

#[derive(Default)]
struct RanksOutcome {
    produced: u64,
    failures: Vec<String>,
}

impl Ranks {
    /// Waits for `children` on a thread; `done` is set once none runs any more.
    fn watch(mut children: Vec<Child>, done: Arc<AtomicBool>) -> Ranks {
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = stop.clone();
        let waiter = std::thread::spawn(move || {
            let mut outcome = RanksOutcome::default();
            let mut running: Vec<(usize, Child)> = children.drain(..).enumerate().collect();
            while !running.is_empty() {
                if stop_flag.load(Ordering::Acquire) {
                    for (_, c) in &mut running {
                        let _ = c.kill();
                    }
                }
                let mut still = Vec::new();
                for (rank, mut c) in running {
                    match c.try_wait() {
                        Ok(None) => still.push((rank, c)),
                        Ok(Some(st)) if st.success() => {
                            let mut out = String::new();
                            if let Some(mut s) = c.stdout.take() {
                                let _ = std::io::Read::read_to_string(&mut s, &mut out);
                            }
                            outcome.produced += sim_rank::parse_produced(&out).unwrap_or(0);
                        }
                        Ok(Some(st)) => outcome.failures.push(format!("rank {rank}: {st}")),
                        Err(e) => outcome.failures.push(format!("rank {rank}: {e}")),
                    }
                }
                running = still;
                std::thread::sleep(Duration::from_millis(50));
            }
            done.store(true, Ordering::Release);
            outcome
        });
        Ranks {
            stop,
            waiter: Some(waiter),
        }
    }

    /// Waits for the ranks; with `kill`, stops the ones still running first.
    fn finish(mut self, kill: bool) -> RanksOutcome {
        if kill {
            self.stop.store(true, Ordering::Release);
        }
        self.waiter
            .take()
            .and_then(|w| w.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(w) = self.waiter.take() {
            let _ = w.join();
        }
    }
}

/// One simulated node: what its daemon is started with.
struct Node {
    /// Its `host.name` (and `service.instance.id`).
    name: String,
    config: Config,
}

impl Node {
    /// Node `index` of the demo, its sockets, state and spool under `dir`. One node keeps the
    /// machine's identity; several are told apart as `demo-node<index>`.
    fn new(dir: &std::path::Path, index: u32, args: &Args) -> Node {
        let dir = if args.nodes == 1 {
            dir.to_path_buf()
        } else {
            dir.join(format!("node{index}"))
        };
        let name = format!("demo-node{index}");
        let defaults = Config::default();
        let resource_attributes = if args.nodes == 1 {
            String::new()
        } else {
            format!("host.name={name},service.instance.id={name}")
        };
        let config = Config {
            socket: dir.join("ncclscope.sock"),
            api_socket: dir.join("api.sock"),
            state_dir: dir.join("state"),
            spool: crate::config::SpoolConfig {
                dir: dir.join("spool"),
                ..defaults.spool
            },
            prometheus: crate::config::Prometheus {
                // 127.0.0.0/8 is all loopback: each node its own address, as a scrape target.
                listen: args
                    .metrics_port
                    .map(|port| format!("127.0.0.{}:{port}", index + 1))
                    .unwrap_or_default(),
                job_series: true,
                ..defaults.prometheus
            },
            otlp: crate::config::Otlp {
                endpoint: args.otlp_endpoint.clone().unwrap_or_default(),
                resource_attributes,
                ..defaults.otlp
            },
            test_clock_offset_ns: i64::from(index) * args.node_clock_offset_us * 1000,
            ..Config::default()
        };
        Node { name, config }
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let plugin = sim_rank::find_plugin(args.path)?;
    anyhow::ensure!(
        args.nodes <= args.ranks,
        "--nodes {} is more than --ranks {}: every node runs a rank",
        args.nodes,
        args.ranks
    );
    if let Some(n) = args.late_node {
        anyhow::ensure!(
            n < args.nodes && args.nodes > 1,
            "--late-node {n} is not one of several nodes (--nodes {})",
            args.nodes
        );
    }
    let tmp = tempfile::Builder::new()
        .prefix("ncclscope-demo-")
        .tempdir()?;
    let pid = std::process::id();
    let job = format!("demo-{pid}");
    let straggler = match (args.straggler, args.late_node) {
        (Some(r), _) => Some(r),
        (None, Some(_)) => None,
        (None, None) => Some((ncclscope_proto::now_ns() / 1000 % u64::from(args.ranks)) as u32),
    };
    if let Some(r) = straggler {
        anyhow::ensure!(
            r < args.ranks,
            "--straggler {r} is not a rank of {}",
            args.ranks
        );
    }
    let trace = args
        .trace
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("ncclscope-{job}.perfetto.json")));

    // The in-process daemons log to a file (the terminal belongs to the live view).
    let log_path = trace.with_extension("daemon.log");
    let log_file = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NCCLSCOPE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(log_file))
        .init();

    let nodes: Vec<Node> = (0..args.nodes)
        .map(|k| Node::new(tmp.path(), k, &args))
        .collect();
    let tty = std::io::stdout().is_terminal() && !args.plain;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut daemons = Vec::new();
    for node in &nodes {
        match rt.block_on(crate::run::start(
            node.config.clone(),
            Arc::new(Hub::default()),
        )) {
            Ok(d) => daemons.push(d),
            Err(e) => {
                for d in daemons {
                    let _ = rt.block_on(d.stop());
                }
                return Err(e.context(format!("starting the daemon of {}", node.name)));
            }
        }
    }
    let late = sim_rank::late_ranks(args.ranks, args.nodes, straggler, args.late_node);
    let fault = match (straggler, args.late_node) {
        (Some(r), None) => format!("rank {r} made"),
        (None, Some(n)) => format!("node {n} (ranks {}) made", list(&late)),
        (Some(r), Some(n)) => format!("rank {r} and node {n} made"),
        (None, None) => unreachable!("a straggler is chosen when no node is late"),
    };
    let from = match args.late_from {
        0 => String::new(),
        s => format!(" from {s} s on"),
    };
    println!(
        "ncclscope demo: {} ranks of job {job} on {} node{} for {} s, {} timing path, {fault} {} us late{from}",
        args.ranks,
        args.nodes,
        if args.nodes == 1 { "" } else { "s" },
        args.seconds,
        args.path.name(),
        args.straggler_delay_us
    );
    for (k, (node, daemon)) in nodes.iter().zip(&daemons).enumerate() {
        let ranks: Vec<u32> = (0..args.ranks)
            .filter(|&r| sim_rank::node_of(r, args.ranks, args.nodes) == k as u32)
            .collect();
        let metrics = daemon
            .prometheus_addr
            .map(|a| format!(", /metrics on http://{a}/metrics"))
            .unwrap_or_default();
        let clock = match node.config.test_clock_offset_ns / 1000 {
            0 => String::new(),
            us => format!(", clock {us:+} us"),
        };
        println!(
            "node {k} ({}): ranks {}{clock}, daemon on {} (query it: ncclscope top --api-socket {}){metrics}",
            node.name,
            list(&ranks),
            node.config.socket.display(),
            node.config.api_socket.display(),
        );
    }

    // The ranks' stderr (the plugin logs through the fake NCCL's logger): kept next to the trace.
    let log = trace.with_extension("ranks.log");
    let counters: Vec<_> = daemons.iter().map(|d| d.export_counters.clone()).collect();
    let run = Run {
        args: &args,
        rt: &rt,
        nodes: &nodes,
        job: &job,
        straggler,
        plugin: &plugin,
        trace: &trace,
        log: &log,
        tty,
    };
    let driven = drive(&run);
    // Stop the daemons (drain, commit, flush) whatever happened, before their temporary directory goes.
    let mut stopped = Ok(());
    for d in daemons {
        let s = rt.block_on(d.stop());
        stopped = stopped.and(s);
    }
    let ranks = driven?;
    stopped?;
    if let Some(ep) = &args.otlp_endpoint {
        let sum = |f: fn(&crate::export::export_queue::ExportCounters) -> u64| -> u64 {
            counters.iter().map(|c| f(c)).sum()
        };
        println!(
            "OTLP export to {ep}: {} spans exported, {} dropped, {} export errors",
            sum(|c| c.spans_exported.load(Ordering::Relaxed)),
            sum(|c| c.spans_dropped.load(Ordering::Relaxed)),
            sum(|c| c.export_errors.load(Ordering::Relaxed))
        );
    }
    println!(
        "logs: {} (daemon{}), {} (ranks)",
        log_path.display(),
        if args.nodes == 1 { "" } else { "s" },
        log.display()
    );
    if args.nodes == 1 {
        let stats: Vec<_> = ranks.into_iter().map(|(_, r)| r).collect();
        verdict(&stats, straggler.unwrap_or_default())
    } else {
        verdict_across_nodes(&ranks, &late, args.straggler_delay_us as f64, &args)
    }
}

/// Ranks as a list: `2, 3`.
fn list(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// What one demo run works with.
struct Run<'a> {
    args: &'a Args,
    rt: &'a tokio::runtime::Runtime,
    nodes: &'a [Node],
    job: &'a str,
    straggler: Option<u32>,
    plugin: &'a std::path::Path,
    trace: &'a std::path::Path,
    log: &'a std::path::Path,
    tty: bool,
}

/// Runs the ranks against the started daemons, shows the view and the summary, writes the trace;
/// returns every node's rank statistics (with the node's index), which the verdict is drawn from.
fn drive(run: &Run<'_>) -> anyhow::Result<Vec<(u32, ncclscope_proto::api::RankStats)>> {
    let Run {
        args,
        rt,
        nodes,
        job,
        straggler,
        plugin,
        trace,
        log,
        tty,
    } = *run;
    let epoch_ns = sim_rank::monotonic_ns() + 1_000_000_000; // one second for the ranks to start
    let log_file = std::fs::File::create(log)?;
    let exe = std::env::current_exe()?;
    let comm_hash = sim_rank::comm_hash_of(job);
    let mut children = Vec::new();
    for rank in 0..args.ranks {
        let node = &nodes[sim_rank::node_of(rank, args.ranks, args.nodes) as usize];
        let mut cmd = Command::new(&exe);
        cmd.arg("sim-rank")
            .args(["--plugin".as_ref(), plugin.as_os_str()])
            .args([
                "--rank",
                &rank.to_string(),
                "--nranks",
                &args.ranks.to_string(),
                "--nnodes",
                &args.nodes.to_string(),
                "--comm-hash",
                &comm_hash.to_string(),
            ])
            .args([
                "--epoch-ns",
                &epoch_ns.to_string(),
                "--seconds",
                &args.seconds.to_string(),
            ])
            .args([
                "--straggler-delay-us",
                &args.straggler_delay_us.to_string(),
                "--late-from-s",
                &args.late_from.to_string(),
            ])
            .args(["--path", args.path.name()])
            .env("NCCLSCOPE_SOCKET", &node.config.socket)
            .env("NCCLSCOPE_RING_MEMORY", "cpu") // simulation: no GPU; CPU rings, simulated GPU clock
            .env("NCCLSCOPE_JOB_ID", job)
            .env(
                ncclscope_proto::TEST_CLOCK_OFFSET,
                node.config.test_clock_offset_ns.to_string(),
            )
            .env_remove("NCCLSCOPE_DISABLE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        if let Some(r) = straggler {
            cmd.args(["--straggler", &r.to_string()]);
        }
        if let Some(n) = args.late_node {
            cmd.args(["--late-node", &n.to_string()]);
        }
        let child = log_file.try_clone().and_then(|log| cmd.stderr(log).spawn());
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(anyhow::Error::from(e).context("starting a simulated rank"));
            }
        }
    }

    // The view (of node 0) runs until every rank has exited (or the user quits it: then the ranks
    // are stopped).
    let done = Arc::new(AtomicBool::new(false));
    let ranks = Ranks::watch(children, done.clone());
    let opts = ViewOptions {
        job: job.to_string(),
        interval: Duration::from_secs(if tty { 1 } else { 5 }),
        plain: !tty,
        iterations: None,
    };
    let view = show(rt.handle(), &nodes[0].config.api_socket, &opts, &done);
    let quit_early = !done.load(Ordering::Acquire);
    let RanksOutcome { produced, failures } = ranks.finish(quit_early);
    view?;
    if quit_early {
        println!(
            "stopped before the ranks were done: the summary covers what they produced so far"
        );
    }
    if !failures.is_empty() && !quit_early {
        anyhow::bail!(
            "simulated ranks failed ({}); their log: {}",
            failures.join(", "),
            log.display()
        );
    }

    // Let the daemons drain what the ranks wrote before they exited.
    let fetched = rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut all = Vec::new();
            for node in nodes {
                all.push(fetch(&node.config.api_socket, job, false).await?);
            }
            let seen: u64 = all
                .iter()
                .flat_map(|(jobs, _)| &jobs.jobs)
                .map(|j| j.collectives)
                .sum();
            if seen >= produced || Instant::now() > deadline {
                return anyhow::Ok((all, seen));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let (fetched, seen) = fetched?;
    let mut ranks = Vec::new();
    for (k, (node, (jobs, stats))) in nodes.iter().zip(fetched).enumerate() {
        if nodes.len() == 1 {
            println!("\n{}", render(&jobs, &stats));
        } else {
            println!("\nnode {k} ({}):\n{}", node.name, render(&jobs, &stats));
        }
        ranks.extend(stats.ranks.into_iter().map(|r| (k as u32, r)));
    }
    if !quit_early {
        println!(
            "instances: {produced} produced by the ranks, {seen} assembled by the daemon{}",
            if nodes.len() == 1 { "" } else { "s" }
        );
    }

    for (k, node) in nodes.iter().enumerate() {
        // One trace per node, as each node's daemon exports its own ranks.
        let path = if nodes.len() == 1 {
            trace.to_path_buf()
        } else {
            trace.with_extension(format!("node{k}.json"))
        };
        let n = rt.block_on(export_via_api(
            &node.config.api_socket,
            job,
            None,
            &path,
            Format::PerfettoJson,
        ))?;
        println!(
            "Perfetto trace ({n} collective instances): {}  (open it in https://ui.perfetto.dev)",
            path.display()
        );
    }
    if nodes.len() > 1 {
        // And one across the nodes, each node's clock estimated from the collectives.
        let sockets: Vec<_> = nodes.iter().map(|n| n.config.api_socket.clone()).collect();
        let n = export_nodes_via_api(&sockets, job, trace, Format::PerfettoJson)?;
        println!(
            "Perfetto trace across the nodes ({n} collective instances, node clocks aligned): {}",
            trace.display()
        );
    }
    Ok(ranks)
}

/// Names the straggler the daemon found and checks it against the injected one.
fn verdict(ranks: &[ncclscope_proto::api::RankStats], injected: u32) -> anyhow::Result<()> {
    let found = stragglers(ranks);
    match found.first() {
        Some(s) if s.rank == injected => {
            println!(
                "straggler found: rank {} (injected: rank {injected}) ✔",
                s.rank
            );
            Ok(())
        }
        Some(s) => anyhow::bail!(
            "the daemon named rank {} as the straggler, but rank {injected} was injected",
            s.rank
        ),
        None => anyhow::bail!("the daemon found no straggler (rank {injected} was injected)"),
    }
}

/// How much later than the punctual ranks of its communicator each rank starts, across nodes: the
/// largest median exec time among the communicator's ranks minus its own (a late rank waits least).
/// Exec time is a duration on each rank's own GPU clock, so nodes compare without a common clock;
/// the node-local "last to start" would name a rank on every node.
fn lateness_us(ranks: &[(u32, ncclscope_proto::api::RankStats)]) -> Vec<(u32, u32, f64)> {
    ranks
        .iter()
        .map(|(node, r)| {
            let punctual = ranks
                .iter()
                .filter(|(_, o)| (o.uid, &o.job_id, o.comm_hash) == (r.uid, &r.job_id, r.comm_hash))
                .map(|(_, o)| o.exec_p50_us)
                .fold(f64::MIN, f64::max);
            (*node, r.rank, punctual - r.exec_p50_us)
        })
        .collect()
}

/// Names the ranks found late across nodes (later than half the injected delay) and checks them
/// against the injected ones.
fn verdict_across_nodes(
    ranks: &[(u32, ncclscope_proto::api::RankStats)],
    injected: &[u32],
    delay_us: f64,
    args: &Args,
) -> anyhow::Result<()> {
    let mut found: Vec<(u32, u32, f64)> = lateness_us(ranks)
        .into_iter()
        .filter(|&(_, _, late)| late > delay_us / 2.0)
        .collect();
    found.sort_by_key(|&(_, rank, _)| rank);
    let named: Vec<String> = found
        .iter()
        .map(|(node, rank, late)| format!("rank {rank} on node {node} ({late:.0} us late)"))
        .collect();
    let found: Vec<u32> = found.iter().map(|&(_, rank, _)| rank).collect();
    let injected_text = match (args.straggler, args.late_node) {
        (Some(r), Some(n)) => format!("rank {r} and node {n}: ranks {}", list(injected)),
        (None, Some(n)) => format!("node {n}: ranks {}", list(injected)),
        _ => format!("rank {}", list(injected)),
    };
    if found == injected {
        println!(
            "late across nodes (median exec time against the communicator's slowest): {} (injected: {injected_text}) ✔",
            named.join(", ")
        );
        Ok(())
    } else if found.is_empty() {
        anyhow::bail!("no rank found late across nodes ({injected_text} was injected)")
    } else {
        anyhow::bail!(
            "found late across nodes: {}, but {injected_text} was injected",
            named.join(", ")
        )
    }
}
