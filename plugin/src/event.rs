//! What NCCL's threads hand to the forwarding thread: the queue's item type.

use ncclscope_proto::{Gpu, Record, TimingPath};

pub use crate::abi::CText;

/// What NCCL threads hand to the forwarding thread. Every `host_ns` is a [`crate::clock::stamp`].
#[derive(Debug)]
pub enum Event {
    Comm {
        comm: u32,
        comm_hash: u64,
        rank: u32,
        nranks: u32,
        nnodes: u32,
        cuda_dev: i32,
        name: Vec<u8>,
        path: TimingPath,
        host_ns: u64,
        gpu: Option<Gpu>,
    },
    /// `table` is the communicator's slot in the plugin's table, flagged once the end is written.
    CommEnd { comm: u32, table: u32, host_ns: u64 },
    CollStart {
        comm: u32,
        id: u64,
        seq: u64,
        func: CText,
        datatype: CText,
        algo: CText,
        proto: CText,
        count: u64,
        root: i32,
        n_channels: u8,
        n_warps: u8,
        host_ns: u64,
        captured: bool,
    },
    P2pStart {
        comm: u32,
        id: u64,
        func: CText,
        datatype: CText,
        count: u64,
        peer: i32,
        n_channels: u8,
        host_ns: u64,
        captured: bool,
    },
    /// A record without strings (OpStop, KernelCh, KernelPhase).
    Ready(Record),
}
