//! Support shared by the end-to-end tests that need the daemon crate itself (a dev-dependency, so not
//! in the `ncclscope_tests` library): simulated ranks through the real plugin.

#![allow(dead_code)] // each test binary uses a part of it

use std::path::Path;
use std::process::{Child, Command, Stdio};

use ncclscope::cli::sim_rank::{comm_hash_of, monotonic_ns, node_of, parse_produced};

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
    SimJob {
        straggler: Some(straggler),
        ..SimJob::new(job, nranks, seconds)
    }
    .commands(&[socket])
}

/// A simulated job, on one node or several: its ranks spread over the nodes in contiguous blocks
/// (`sim_rank::node_of`), NCCL's `nnodes` set, the communicator's hash the job's own.
pub struct SimJob<'a> {
    pub job: &'a str,
    pub nranks: u32,
    pub seconds: u64,
    /// A late rank.
    pub straggler: Option<u32>,
    /// A late node: every rank on it.
    pub late_node: Option<u32>,
    /// Seconds after the first step at which the late ranks start being late.
    pub late_from_s: u64,
    pub delay_us: u64,
}

/// How long after [`SimJob::commands`] the simulated ranks start their collectives.
pub const SIM_LEAD: std::time::Duration = std::time::Duration::from_secs(2);

impl<'a> SimJob<'a> {
    /// No fault, 3 ms of delay for any added.
    pub fn new(job: &'a str, nranks: u32, seconds: u64) -> SimJob<'a> {
        SimJob {
            job,
            nranks,
            seconds,
            straggler: None,
            late_node: None,
            late_from_s: 0,
            delay_us: 3000,
        }
    }

    /// The ranks' commands, each registering at its node's daemon (`sockets[node]`), starting their
    /// collectives at one moment two seconds from now: every rank's process has started and
    /// registered by then, as NCCL's collective init makes sure before a job's first collective (a
    /// rank read only after the others' first collectives meets none of them: their roots are lost).
    /// Callers add what else they need (a uid, a GPU, another stdout) and spawn them.
    pub fn commands(&self, sockets: &[&Path]) -> Vec<Command> {
        let epoch = monotonic_ns() + SIM_LEAD.as_nanos() as u64;
        let nnodes = sockets.len() as u32;
        (0..self.nranks)
            .map(|rank| {
                let mut c = Command::new(ncclscope_tests::daemon_binary());
                c.arg("sim-rank")
                    .args([
                        "--rank",
                        &rank.to_string(),
                        "--nranks",
                        &self.nranks.to_string(),
                    ])
                    .args(["--nnodes", &nnodes.to_string()])
                    .args(["--comm-hash", &comm_hash_of(self.job).to_string()])
                    .args([
                        "--epoch-ns",
                        &epoch.to_string(),
                        "--seconds",
                        &self.seconds.to_string(),
                    ])
                    .args(["--straggler-delay-us", &self.delay_us.to_string()])
                    .args(["--late-from-s", &self.late_from_s.to_string()])
                    .env(
                        "NCCLSCOPE_SOCKET",
                        sockets[node_of(rank, self.nranks, nnodes) as usize],
                    )
                    .env("NCCLSCOPE_RING_MEMORY", "cpu")
                    .env("NCCLSCOPE_JOB_ID", self.job)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                if let Some(r) = self.straggler {
                    c.args(["--straggler", &r.to_string()]);
                }
                if let Some(n) = self.late_node {
                    c.args(["--late-node", &n.to_string()]);
                }
                c
            })
            .collect()
    }
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
