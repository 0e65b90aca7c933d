//! Operations in flight: what each holds until it completes, and the indexes that find them by
//! communicator and device in stream order.

use std::collections::VecDeque;

use ncclscope_proto::MAX_CHANNELS;
use ncclscope_proto::api::ChannelWork;

use crate::fast_map::Map;
use crate::instance::{Desc, Instance};
use crate::storage::resume::SavedOp;

pub(super) struct Op {
    pub comm: u32,
    pub first_pos: u64,
    pub desc: Desc,
    /// Host time of its enqueue (0 for a replay: no host event announces it).
    pub enqueue_ns: u64,
    pub stop_ns: Option<u64>,
    pub channels: Vec<ChannelWork>,
    pub seen: u64,
    /// Offset estimate from KernelCh host stamps, for a device without calibration.
    pub host_anchor: Option<i64>,
    pub last_progress_ns: u64,
    pub prior: u8,
    /// Indexed under its device in `awaiting_calibration`.
    pub awaiting_calibration: bool,
    /// 0: eager; r >= 1: replay r of a captured operation.
    pub replay: u32,
    /// Channels whose work item was dropped as ambiguous (see `hold`): the op can no longer
    /// complete, and is closed once the others are in.
    pub lost: u64,
    /// When it was read (its first record).
    pub opened_ns: u64,
    /// Parked (see `Assembler::park`): the commit point does not wait on it; the resume state
    /// carries it instead.
    pub parked: bool,
    /// Completes with its host stop alone: no kernel work can be joined to it (a send or receive
    /// on the device-hook path, see `Dict::is_p2p_work`).
    pub host_only: bool,
    /// The channels a send or receive waits on (bit per channel) on the device-hook path.
    pub p2p_lanes: u64,
}

impl Op {
    /// An operation whose first record is at `first_pos`, enqueued at `enqueue_ns`, read at `now_ns`;
    /// `replay` 0 for an eager one.
    pub fn new(
        comm: u32,
        first_pos: u64,
        desc: Desc,
        enqueue_ns: u64,
        now_ns: u64,
        replay: u32,
    ) -> Op {
        Op {
            comm,
            first_pos,
            desc,
            enqueue_ns,
            stop_ns: None,
            channels: Vec::with_capacity(desc.n_channels.min(MAX_CHANNELS) as usize),
            seen: 0,
            host_anchor: None,
            last_progress_ns: now_ns,
            prior: 0,
            awaiting_calibration: false,
            replay,
            lost: 0,
            opened_ns: now_ns,
            parked: false,
            host_only: false,
            p2p_lanes: 0,
        }
    }

    /// What the resume state keeps of a parked operation `id`.
    pub fn saved(&self, id: u64) -> SavedOp {
        SavedOp {
            id,
            comm: self.comm,
            first_pos: self.first_pos,
            desc: self.desc,
            enqueue_ns: self.enqueue_ns,
            stop_ns: self.stop_ns,
            channels: (self.channels.iter())
                .map(|c| (c.channel, c.start_unix_ns, c.end_unix_ns))
                .collect(),
            host_anchor: self.host_anchor,
        }
    }

    /// A parked operation of a previous daemon, continued: read at `now_ns`; `prior`: sinks that
    /// daemon delivered it to.
    pub fn restored(s: &SavedOp, now_ns: u64, prior: u8) -> Op {
        let mut op = Op::new(s.comm, s.first_pos, s.desc, s.enqueue_ns, now_ns, 0);
        op.stop_ns = s.stop_ns;
        op.host_anchor = s.host_anchor;
        for &(channel, start, stop) in &s.channels {
            op.add_work(channel as u8, start, stop, now_ns);
        }
        op.prior = prior;
        op.parked = true;
        op
    }

    #[inline]
    pub fn add_work(&mut self, channel: u8, gpu_start: u64, gpu_stop: u64, now_ns: u64) {
        self.seen |= 1 << (channel % MAX_CHANNELS);
        self.last_progress_ns = now_ns;
        // GPU clock for now: mapped to host time when the op is built, with the calibration of then.
        self.channels.push(ChannelWork {
            channel: channel as u32,
            start_unix_ns: gpu_start,
            end_unix_ns: gpu_stop.max(gpu_start),
            work_items: 1,
        });
    }

    /// Lost a channel's item and has every other one's: nothing more can join it.
    #[inline]
    pub fn settled(&self) -> bool {
        self.lost != 0
            && (self.seen | self.lost).count_ones() >= self.desc.n_channels.min(MAX_CHANNELS) as u32
    }

    #[inline]
    pub fn complete(&self) -> bool {
        // A replay has no host stop: its work is all there is.
        (self.stop_ns.is_some() || self.replay > 0)
            && (self.host_only || self.seen.count_ones() >= self.desc.n_channels as u32)
    }

    /// Whether the op has its stop and every channel's work, and (with kernel times) its device
    /// has a calibration: the plugin may forward kernel records before its first calibration.
    /// `calibrated(comm)`: whether the communicator's device has a calibration; None if it has no
    /// device (e.g. NCCL's KernelCh without a CUDA context): no calibration will come, the host
    /// anchor is all there is. Asked only of a complete operation with kernel times.
    #[inline]
    pub fn ready(&self, calibrated: impl FnOnce(u32) -> Option<bool>) -> bool {
        if !self.complete() {
            return false;
        }
        if self.channels.is_empty() {
            return true;
        }
        calibrated(self.comm).unwrap_or(self.host_anchor.is_some())
    }
}

/// One finished operation, with where its records start in the segment (for the commit point).
#[derive(Debug)]
pub struct Completed {
    pub coll: Instance,
    pub op_id: u64,
    pub first_pos: u64,
    /// Sinks that already have it (from a daemon that ran before a restart).
    pub prior: u8,
}

/// Operations under one key (a communicator, a device), in start order, which is stream order. The
/// entries of finished operations go lazily: the list is pruned whenever it doubled since the last
/// pruning, so a push costs constant time on average and the list stays within twice what is live.
#[derive(Debug, Default)]
pub(super) struct OpIndex {
    pub entries: VecDeque<(u64, u64)>,
    pub prune_at: usize,
}

impl OpIndex {
    #[inline]
    pub fn push(&mut self, first_pos: u64, id: u64, ops: &Map<u64, Op>) {
        if self.entries.len() >= self.prune_at {
            self.entries.retain(|e| in_flight(ops, e));
            self.prune_at = 2 * self.entries.len() + 16;
        }
        self.entries.push_back((first_pos, id));
    }

    /// The operations still in flight, oldest first.
    pub fn live(self, ops: &Map<u64, Op>) -> impl Iterator<Item = u64> {
        self.entries
            .into_iter()
            .filter(|e| in_flight(ops, e))
            .map(|(_, id)| id)
    }
}

/// Communicators numbered below this (the plugin numbers a process's communicators from 0) have
/// their [`OpIndex`] in a vector: no hashing per operation.
pub(super) const DIRECT_COMMS: usize = 64;

/// The operations in flight of each communicator (what a CommEnd closes).
#[derive(Debug, Default)]
pub(super) struct CommOps {
    pub direct: Vec<OpIndex>,
    pub other: Map<u32, OpIndex>,
}

impl CommOps {
    #[inline]
    pub fn get_mut(&mut self, comm: u32) -> &mut OpIndex {
        let c = comm as usize;
        if c >= DIRECT_COMMS {
            return self.other.entry(comm).or_default();
        }
        if self.direct.len() <= c {
            self.direct.resize_with(c + 1, OpIndex::default);
        }
        &mut self.direct[c]
    }

    pub fn take(&mut self, comm: u32) -> OpIndex {
        match self.direct.get_mut(comm as usize) {
            Some(index) => std::mem::take(index),
            None => self.other.remove(&comm).unwrap_or_default(),
        }
    }

    /// Drops a finished operation's entry if it is its communicator's oldest (operations mostly
    /// finish in order); others go when the index is pruned.
    #[inline]
    pub fn finished(&mut self, comm: u32, first_pos: u64, id: u64) {
        let index = match self.direct.get_mut(comm as usize) {
            Some(index) => Some(index),
            None => self.other.get_mut(&comm),
        };
        if let Some(index) = index
            && index.entries.front() == Some(&(first_pos, id))
        {
            index.entries.pop_front();
        }
    }
}

/// Whether (first record position, id) is an operation in flight (not a finished one whose id was
/// reused).
#[inline]
pub(super) fn in_flight(ops: &Map<u64, Op>, &(pos, id): &(u64, u64)) -> bool {
    ops.get(&id).is_some_and(|o| o.first_pos == pos)
}
