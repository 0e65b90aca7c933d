//! `ncclscope`: the node daemon and the operator CLI.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ncclscope::cli;

#[derive(Parser)]
#[command(
    name = "ncclscope",
    version,
    about = "NCCL kernel telemetry: node daemon and operator tools"
)]
struct Cli {
    /// On an error, print its debug form too: the backtrace where RUST_BACKTRACE=1 captured one.
    #[arg(long, global = true)]
    debug: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the node daemon: ingest every process's segment, aggregate, export OTLP.
    Daemon(cli::daemon::Args),
    /// Daemon plus simulated ranks through the real plugin; no GPU needed.
    #[cfg(feature = "demo")]
    Demo(cli::demo::Args),
    /// Live terminal view of the jobs on this node.
    Top(cli::top::Args),
    /// One-shot statistics table or JSON.
    Stats(cli::stats::Args),
    /// Export a job's trace (Perfetto protobuf or JSON, or OTLP JSON).
    Export(cli::export::Args),
    /// A job's late ranks and nodes across the cluster, from Prometheus (Thanos, Mimir).
    Cluster(cli::cluster::Args),
    /// The configuration or metrics reference (Markdown), from the code.
    Reference(cli::reference::Args),
    /// The systemd drop-in that lets the configured collector and scrapers through the unit's
    /// address filter.
    SystemdDropin(cli::systemd_dropin::Args),
    /// One simulated rank (used by `demo`).
    #[cfg(feature = "demo")]
    #[command(hide = true)]
    SimRank(cli::sim_rank::Args),
}

fn main() -> ExitCode {
    let args = Cli::parse();
    let result = match args.cmd {
        Cmd::Daemon(a) => cli::daemon::run(a),
        #[cfg(feature = "demo")]
        Cmd::Demo(a) => cli::demo::run(a),
        Cmd::Top(a) => cli::top::run(a),
        Cmd::Stats(a) => cli::stats::run(a),
        Cmd::Export(a) => cli::export::run(a),
        Cmd::Cluster(a) => cli::cluster::run(a),
        Cmd::Reference(a) => cli::reference::run(a),
        Cmd::SystemdDropin(a) => cli::systemd_dropin::run(a),
        #[cfg(feature = "demo")]
        Cmd::SimRank(a) => cli::sim_rank::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprint!("{}", cli::error::report(&e, args.debug));
            ExitCode::FAILURE
        }
    }
}
