//! What NCCL's threads hand to the forwarding thread: the queue's item type.

use ncclscope_proto::{Gpu, Record, TimingPath};

pub use crate::abi::CText;

/// What NCCL threads hand to the forwarding thread. Every `host_ns` is a [`crate::clock::stamp`].
#[derive(Debug)]
pub enum Event {
    /// Boxed: it comes once per communicator, and unboxed it would make every queued event larger.
    Comm(Box<CommEvent>),
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

/// A communicator's announcement ([`Event::Comm`]).
#[derive(Debug)]
pub struct CommEvent {
    pub comm: u32,
    pub comm_hash: u64,
    pub rank: u32,
    pub nranks: u32,
    pub nnodes: u32,
    pub cuda_dev: i32,
    pub name: Vec<u8>,
    pub path: TimingPath,
    pub host_ns: u64,
    pub gpu: Option<Gpu>,
}
