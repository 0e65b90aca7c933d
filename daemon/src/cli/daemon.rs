//! `ncclscope daemon`: the node daemon. Configuration from OTEL_* variables (for [otlp]), then
//! /etc/ncclscope/ncclscope.toml, then
//! NCCLSCOPE_* variables, then these flags; READY=1 to systemd once every socket is bound; SIGTERM or
//! SIGINT drains, flushes and exits.

use std::path::PathBuf;
use std::sync::Arc;

use crate::config::{Config, DEFAULT_CONFIG_PATH, Overrides};
use crate::hub::Hub;
use crate::logging::LogFormat;

#[derive(clap::Args)]
#[command(
    after_help = "--help lists every configuration key with its variable and default.",
    after_long_help = crate::config::help()
)]
pub struct Args {
    #[arg(long, value_name = "FILE", help = format!("Configuration file, optional at its default [default: {DEFAULT_CONFIG_PATH}]"))]
    pub config: Option<PathBuf>,
    #[arg(long, value_name = "PATH", help = flag("Registration socket for plugins", "socket"))]
    pub socket: Option<PathBuf>,
    #[arg(long, value_name = "DIR", help = flag("Directory for per-segment resume state", "state_dir"))]
    pub state_dir: Option<PathBuf>,
    #[arg(long, value_name = "PATH", help = flag("Query API socket", "api_socket"))]
    pub api_socket: Option<PathBuf>,
    #[arg(long, value_name = "DIR", help = flag("Spool directory (\"\" disables the spool)", "spool.dir"))]
    pub spool_dir: Option<PathBuf>,
    #[arg(long, value_name = "URL", help = flag("OTLP/gRPC endpoint, e.g. http://127.0.0.1:4317 (\"\" disables)", "otlp.endpoint"))]
    pub otlp_endpoint: Option<String>,
    #[arg(long, value_name = "ADDR", help = flag("Prometheus endpoint address (\"\" disables)", "prometheus.listen"))]
    pub prometheus_listen: Option<String>,
    #[arg(long, value_name = "RATIO", help = flag("Fraction of collectives exported as spans", "otlp.sample_ratio"))]
    pub sample_ratio: Option<f64>,
    /// Log format: auto is journald when stderr is the journal, else text.
    #[arg(long, env = "NCCLSCOPE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Auto)]
    pub log_format: LogFormat,
}

/// A flag's help: what it sets, with the configuration key, its variable and its default (the
/// flag overrides both; the defaults come from [`Config::default`], so they cannot drift).
fn flag(what: &str, key: &str) -> String {
    let (var, default) = crate::config::key_default(key);
    format!("{what} [config: {key}] [env: {var}] [default: {default}]")
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init(args.log_format);
    let overrides = Overrides {
        socket: args.socket,
        state_dir: args.state_dir,
        api_socket: args.api_socket,
        spool_dir: args.spool_dir,
        otlp_endpoint: args.otlp_endpoint,
        prometheus_listen: args.prometheus_listen,
        sample_ratio: args.sample_ratio,
    };
    let config = Config::load(args.config.as_deref(), std::env::vars(), &overrides)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let running = crate::run::start(config, Arc::new(Hub::default())).await?;
        if let Err(e) = crate::notify::notify("READY=1", &[]) {
            tracing::warn!(error = %e, "could not notify systemd");
        }
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        // Their default action kills the process undrained: a stray `kill -HUP` (logrotate, an
        // operator expecting a reload) must not cost what the rings hold.
        let mut hup = signal(SignalKind::hangup())?;
        let mut usr1 = signal(SignalKind::user_defined1())?;
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = tokio::signal::ctrl_c() => break,
                _ = hup.recv() => tracing::info!("SIGHUP ignored: the configuration is read at start; restart to apply a new one"),
                _ = usr1.recv() => tracing::info!("SIGUSR1 ignored"),
            }
        }
        tracing::info!("stopping: draining segments and flushing exports");
        let _ = crate::notify::notify("STOPPING=1", &[]);
        running.stop().await
    })
}
