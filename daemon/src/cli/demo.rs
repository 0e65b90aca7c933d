//! `ncclscope demo`: the whole system on one machine without a GPU. Starts a daemon in this process
//! (temporary sockets and spool), runs N simulated ranks as separate processes
//! that load the real plugin `.so` through the fake NCCL host and drive a training-step mix of
//! collectives with one injected straggler, shows the live view (or progress lines off a terminal),
//! names the straggler the daemon found, writes a Perfetto trace of the run and exports OTLP when
//! given an endpoint.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::cli::export::{Format, export_via_api};
use crate::cli::sim_rank::{self, TimingPath};
use crate::cli::stats::{fetch, render, stragglers};
use crate::cli::top::{ViewOptions, show};
use crate::config::Config;
use crate::hub::Hub;

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
    /// The rank made late (default: chosen at random).
    #[arg(long)]
    pub straggler: Option<u32>,
    /// How late the straggler starts its kernels, in microseconds.
    #[arg(long, default_value_t = 3000)]
    pub straggler_delay_us: u64,
    /// Kernel timing path: the device hook (RFC host, CPU-written rings) or stock NCCL's KernelCh events.
    #[arg(long, value_enum, default_value_t = TimingPath::Hook)]
    pub path: TimingPath,
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

/// Where the plugin library is: `NCCLSCOPE_PLUGIN`, else next to this executable (target/<profile>/),
/// else in its deps/ folder (where cargo leaves it when it is built as this package's dependency). The
/// fake NCCL host needs its stand-in libnccl in the same folder.
pub fn find_plugin(path: TimingPath) -> anyhow::Result<PathBuf> {
    const PLUGIN: &str = "libnccl_profiler_ncclscope.so";
    let libnccl = sim_rank::host_kind(path).libnccl_name();
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

pub fn run(args: Args) -> anyhow::Result<()> {
    let plugin = find_plugin(args.path)?;
    let tmp = tempfile::Builder::new()
        .prefix("ncclscope-demo-")
        .tempdir()?;
    let pid = std::process::id();
    let job = format!("demo-{pid}");
    let straggler = args
        .straggler
        .unwrap_or_else(|| (ncclscope_proto::now_ns() / 1000 % u64::from(args.ranks)) as u32);
    anyhow::ensure!(
        straggler < args.ranks,
        "--straggler {straggler} is not a rank of {}",
        args.ranks
    );
    let trace = args
        .trace
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("ncclscope-{job}.perfetto.json")));

    // The in-process daemon logs to a file (the terminal belongs to the live view).
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

    let defaults = Config::default();
    let config = Config {
        socket: tmp.path().join("ncclscope.sock"),
        api_socket: tmp.path().join("api.sock"),
        state_dir: tmp.path().join("state"),
        spool: crate::config::SpoolConfig {
            dir: tmp.path().join("spool"),
            ..defaults.spool
        },
        prometheus: crate::config::Prometheus {
            listen: String::new(),
            ..defaults.prometheus
        },
        otlp: crate::config::Otlp {
            endpoint: args.otlp_endpoint.clone().unwrap_or_default(),
            ..defaults.otlp
        },
        ..Config::default()
    };
    let tty = std::io::stdout().is_terminal() && !args.plain;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let daemon = rt.block_on(crate::run::start(config.clone(), Arc::new(Hub::default())))?;
    println!(
        "ncclscope demo: daemon on {} (query it: ncclscope top --api-socket {}), {} ranks of job {job} for {} s, \
         {} timing path, rank {straggler} made {} us late",
        config.socket.display(),
        config.api_socket.display(),
        args.ranks,
        args.seconds,
        args.path.name(),
        args.straggler_delay_us
    );

    // The ranks' stderr (the plugin logs through the fake NCCL's logger): kept next to the trace.
    let log = trace.with_extension("ranks.log");
    let counters = daemon.export_counters.clone();
    let run = Run {
        args: &args,
        rt: &rt,
        config: &config,
        job: &job,
        straggler,
        plugin: &plugin,
        trace: &trace,
        log: &log,
        tty,
    };
    let driven = drive(&run);
    // Stop the daemon (drain, commit, flush) whatever happened, before its temporary directory goes.
    let stopped = rt.block_on(daemon.stop());
    let ranks = driven?;
    stopped?;
    if let Some(ep) = &args.otlp_endpoint {
        let c = &counters;
        println!(
            "OTLP export to {ep}: {} spans exported, {} dropped, {} export errors",
            c.spans_exported.load(Ordering::Relaxed),
            c.spans_dropped.load(Ordering::Relaxed),
            c.export_errors.load(Ordering::Relaxed)
        );
    }
    println!(
        "logs: {} (daemon), {} (ranks)",
        log_path.display(),
        log.display()
    );
    verdict(&ranks, straggler)
}

/// What one demo run works with.
struct Run<'a> {
    args: &'a Args,
    rt: &'a tokio::runtime::Runtime,
    config: &'a Config,
    job: &'a str,
    straggler: u32,
    plugin: &'a std::path::Path,
    trace: &'a std::path::Path,
    log: &'a std::path::Path,
    tty: bool,
}

/// Runs the ranks against the started daemon, shows the view and the summary, writes the trace; returns
/// the rank statistics the verdict is drawn from.
fn drive(run: &Run<'_>) -> anyhow::Result<Vec<ncclscope_proto::api::RankStats>> {
    let Run {
        args,
        rt,
        config,
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
    let mut children = Vec::new();
    for rank in 0..args.ranks {
        let mut cmd = Command::new(&exe);
        cmd.arg("sim-rank")
            .args(["--plugin".as_ref(), plugin.as_os_str()])
            .args([
                "--rank",
                &rank.to_string(),
                "--nranks",
                &args.ranks.to_string(),
            ])
            .args([
                "--epoch-ns",
                &epoch_ns.to_string(),
                "--seconds",
                &args.seconds.to_string(),
            ])
            .args([
                "--straggler",
                &straggler.to_string(),
                "--straggler-delay-us",
                &args.straggler_delay_us.to_string(),
            ])
            .args(["--path", args.path.name()])
            .env("NCCLSCOPE_SOCKET", &config.socket)
            .env("NCCLSCOPE_RING_MEMORY", "cpu") // simulation: no GPU; CPU rings, simulated GPU clock
            .env("NCCLSCOPE_JOB_ID", job)
            .env_remove("NCCLSCOPE_DISABLE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
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

    // The view runs until every rank has exited (or the user quits it: then the ranks are stopped).
    let done = Arc::new(AtomicBool::new(false));
    let ranks = Ranks::watch(children, done.clone());
    let opts = ViewOptions {
        job: job.to_string(),
        interval: Duration::from_secs(if tty { 1 } else { 5 }),
        plain: !tty,
        iterations: None,
    };
    let view = show(rt.handle(), &config.api_socket, &opts, &done);
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

    // Let the daemon drain what the ranks wrote before they exited.
    let (jobs, stats) = rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (jobs, stats) = fetch(&config.api_socket, job, false).await?;
            let seen: u64 = jobs.jobs.iter().map(|j| j.collectives).sum();
            if seen >= produced || Instant::now() > deadline {
                return anyhow::Ok((jobs, stats));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })?;
    let seen: u64 = jobs.jobs.iter().map(|j| j.collectives).sum();
    println!("\n{}", render(&jobs, &stats));
    if !quit_early {
        println!("instances: {produced} produced by the ranks, {seen} assembled by the daemon");
    }

    let n = rt.block_on(export_via_api(
        &config.api_socket,
        job,
        None,
        trace,
        Format::PerfettoJson,
    ))?;
    println!(
        "Perfetto trace ({n} collective instances): {}  (open it in https://ui.perfetto.dev)",
        trace.display()
    );
    Ok(stats.ranks)
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
