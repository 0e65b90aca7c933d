//! What the fake NCCL emitted, to compare with what arrives in the segment (also the JSON that
//! `fakenccl-rank` prints).

use serde::{Deserialize, Serialize};

use crate::HostKind;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OpKind {
    Coll,
    P2p,
}

/// One Coll or P2p and its kernel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpReport {
    pub kind: OpKind,
    /// Whether the plugin accepted the Coll/P2p event (returned a handle).
    pub started: bool,
    /// Coll sequence number per communicator (0 for P2p).
    pub seq: u64,
    pub func: String,
    pub datatype: String,
    pub algo: String,
    /// A v7 symmetric collective's `kernelVariant` (the plugin reports it as the algorithm).
    pub kernel_variant: Option<String>,
    pub proto: String,
    pub count: u64,
    pub root_or_peer: i32,
    pub n_channels: u8,
    pub n_warps: u8,
    /// KernelCh events emitted (stock path), in emission order.
    pub kernels: Vec<KernelReport>,
    /// Device-hook work items (RFC host with a hook): each called START then STOP.
    pub hook_items: Vec<HookItem>,
    /// Enqueued while its stream was captured into a CUDA graph: host events only, no kernel.
    #[serde(default)]
    pub captured: bool,
    /// r >= 1: the kernel of this captured operation at the communicator's r-th graph replay (no
    /// host events; `seq` is the captured operation's as NCCL reported it).
    #[serde(default)]
    pub replay: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelReport {
    pub channel: u8,
    pub gpu_start: u64,
    pub gpu_stop: u64,
    /// Whether the plugin accepted the KernelCh event.
    pub started: bool,
    pub phases: Vec<PhaseReport>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseReport {
    pub phase: u8,
    pub gpu_start: u64,
    pub gpu_stop: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookItem {
    pub channel: u8,
    pub work_counter: u64,
    pub func_id: u32,
    pub gpu_start: u64,
    pub gpu_stop: u64,
}

/// One communicator's run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommReport {
    pub comm_hash: u64,
    pub rank: i32,
    pub nranks: i32,
    pub nnodes: i32,
    pub name: Option<String>,
    pub has_context: bool,
    pub has_hook: bool,
    pub ops: Vec<OpReport>,
    /// Calls the plugin should have counted as ignored (see `Comm::noise`).
    pub ignored: u64,
    /// How long the plugin's `finalize` took (0 when not called).
    #[serde(default)]
    pub finalize_ns: u64,
}

impl CommReport {
    /// The operations that ran (eager ones and each replay of a captured one), each with the
    /// (collective, seq, replay) the daemon gives its instance. NCCL numbers collectives per type and
    /// does not advance seq for captured ones here; the daemon numbers each type's captured operations
    /// on in capture order, and a replayed operation takes its captured one's seq.
    pub fn instances(&self) -> impl Iterator<Item = ((&str, u64, u32), &OpReport)> {
        let mut captured: Vec<(&str, u64)> = Vec::new();
        for op in self.ops.iter().filter(|o| o.captured) {
            let prev = captured.iter().rev().find(|(f, _)| *f == op.func);
            let seq = prev.map_or(op.seq, |&(_, p)| op.seq.max(p + 1));
            captured.push((op.func.as_str(), seq));
        }
        let mut place = (0, 0);
        self.ops.iter().filter(|o| !o.captured).map(move |op| {
            if op.replay == 0 {
                return ((op.func.as_str(), op.seq, 0), op);
            }
            place = if place.0 == op.replay {
                (op.replay, place.1 + 1)
            } else {
                (op.replay, 0)
            };
            let seq = captured.get(place.1).map_or(u64::MAX, |c| c.1);
            ((op.func.as_str(), seq, op.replay), op)
        })
    }
}

impl OpReport {
    /// Its exec time as the daemon computes it from the device-hook items: the longest channel.
    pub fn hook_exec_ns(&self) -> Option<u64> {
        self.hook_items
            .iter()
            .map(|i| i.gpu_stop - i.gpu_start)
            .max()
    }
}

/// A whole fake-NCCL process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub kind: HostKind,
    pub symbol: String,
    pub plugin_name: String,
    pub pid: u32,
    /// The activation mask after the last init.
    pub mask: u64,
    /// CLOCK_REALTIME ns before the plugin was loaded and after the last finalize: every host time the
    /// plugin records lies in between.
    #[serde(default)]
    pub started_ns: u64,
    #[serde(default)]
    pub ended_ns: u64,
    pub comms: Vec<CommReport>,
    /// Plugin calls that returned anything but ncclSuccess.
    #[serde(default)]
    pub failed_calls: u64,
}
