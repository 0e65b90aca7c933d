//! `ncclscope daemon`: the node daemon. Configuration from OTEL_* variables (for [otlp]), then
//! /etc/ncclscope/ncclscope.toml, then
//! NCCLSCOPE_* variables, then these flags; READY=1 to systemd once every socket is bound; SIGTERM or
//! SIGINT drains, flushes and exits.

use std::path::PathBuf;
use std::sync::Arc;

use clap::builder::TypedValueParser;

use crate::config::{Config, DEFAULT_CONFIG_PATH, Overrides};
use crate::host::logging::LogFormat;
use crate::storage::hub::Hub;

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
    // Any string, "" included: clap's path parser refuses an empty value.
    #[arg(long, value_name = "DIR", value_parser = clap::builder::OsStringValueParser::new().map(PathBuf::from), help = flag("Spool directory (\"\" disables the spool)", "spool.dir"))]
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

impl Args {
    fn overrides(&self) -> Overrides {
        Overrides {
            socket: self.socket.clone(),
            state_dir: self.state_dir.clone(),
            api_socket: self.api_socket.clone(),
            spool_dir: self.spool_dir.clone(),
            otlp_endpoint: self.otlp_endpoint.clone(),
            prometheus_listen: self.prometheus_listen.clone(),
            sample_ratio: self.sample_ratio,
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::host::logging::init(args.log_format);
    let config = Config::load(args.config.as_deref(), std::env::vars(), &args.overrides())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        // Handled before the daemon says it started: a supervisor may stop it right after.
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        // Their default action kills the process undrained: a stray `kill -HUP` (logrotate, an
        // operator expecting a reload) must not cost what the rings hold.
        let mut hup = signal(SignalKind::hangup())?;
        let mut usr1 = signal(SignalKind::user_defined1())?;
        let running = crate::run::start(config, Arc::new(Hub::default())).await?;
        if let Err(e) = crate::host::notify::notify("READY=1", &[]) {
            tracing::warn!(error = %e, "could not notify systemd");
        }
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
                _ = hup.recv() => tracing::info!("SIGHUP ignored: the configuration is read at start; restart to apply a new one"),
                _ = usr1.recv() => tracing::info!("SIGUSR1 ignored"),
            }
        }
        tracing::info!("stopping: draining segments and flushing exports");
        let _ = crate::host::notify::notify("STOPPING=1", &[]);
        running.stop().await
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        daemon: Args,
    }

    /// Issue 37: `--spool-dir ""`, as its help says, disables the spool (the parser refused it); so do
    /// the other flags whose help documents "".
    #[test]
    fn flags_documented_to_take_an_empty_value_take_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ncclscope.toml");
        std::fs::write(
            &file,
            "[spool]\ndir = \"/var/spool/x\"\n[otlp]\nendpoint = \"http://c:4317\"\n\
             [prometheus]\nlisten = \"127.0.0.1:9\"\n",
        )
        .unwrap();
        let cli = Cli::try_parse_from([
            "t",
            "--spool-dir",
            "",
            "--otlp-endpoint",
            "",
            "--prometheus-listen",
            "",
        ])
        .unwrap();
        let config = Config::load(Some(&file), Vec::new(), &cli.daemon.overrides()).unwrap();
        assert_eq!(config.spool.dir, PathBuf::new());
        assert_eq!(config.otlp.endpoint, "");
        assert_eq!(config.prometheus.listen, "");
        // Every flag whose help documents "" is among those above.
        let help = Cli::command().render_long_help().to_string();
        assert_eq!(help.matches("\"\" disables").count(), 3, "{help}");
    }
}
