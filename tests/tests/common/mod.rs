//! Support shared by the end-to-end tests that need the daemon crate itself (a dev-dependency, so not
//! in the `ncclscope_tests` library): simulated ranks through the real plugin.

#![allow(dead_code)] // each test binary uses a part of it

use std::path::Path;
use std::process::{Child, Command, Stdio};

use ncclscope::cli::sim_rank::{monotonic_ns, parse_produced};

/// One `ncclscope sim-rank` per rank of a job of `nranks`, registering at `socket`: the real plugin
/// through the fake NCCL host, with CPU rings and a simulated GPU clock (no GPU), every rank starting
/// its collectives at the same moment, half a second from now, and running `seconds`; rank
/// `straggler` 3 ms late. Callers add what else they need (a uid, another stdout) and spawn them.
pub fn sim_ranks(
    socket: &Path,
    job: &str,
    nranks: u32,
    seconds: u64,
    straggler: u32,
) -> Vec<Command> {
    let epoch = monotonic_ns() + 500_000_000;
    (0..nranks)
        .map(|rank| {
            let mut c = Command::new(ncclscope_tests::daemon_binary());
            c.arg("sim-rank")
                .args(["--rank", &rank.to_string(), "--nranks", &nranks.to_string()])
                .args([
                    "--epoch-ns",
                    &epoch.to_string(),
                    "--seconds",
                    &seconds.to_string(),
                ])
                .args([
                    "--straggler",
                    &straggler.to_string(),
                    "--straggler-delay-us",
                    "3000",
                ])
                .env("NCCLSCOPE_SOCKET", socket)
                .env("NCCLSCOPE_RING_MEMORY", "cpu")
                .env("NCCLSCOPE_JOB_ID", job)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c
        })
        .collect()
}

/// Waits for ranks started from [`sim_ranks`]; the instances each made (its `produced` line).
/// Panics with the output of a rank that failed.
pub fn produced(ranks: Vec<Child>) -> Vec<u64> {
    ranks
        .into_iter()
        .map(|r| {
            let out = r.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "sim-rank failed: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            parse_produced(&stdout).expect("sim-rank reports what it produced")
        })
        .collect()
}

/// [`sim_ranks`] spawned and waited for.
pub fn run_sim_ranks(
    socket: &Path,
    job: &str,
    nranks: u32,
    seconds: u64,
    straggler: u32,
) -> Vec<u64> {
    let ranks = sim_ranks(socket, job, nranks, seconds, straggler)
        .iter_mut()
        .map(|c| c.spawn().unwrap())
        .collect();
    produced(ranks)
}
