//! Eager operations on the device-hook path: per (communicator, channel), the operations waiting
//! for their work item there and the work items read before their operation's host event.

use std::collections::VecDeque;

/// Device-hook work items that arrived before their operation's host event was read.
pub(super) const MAX_EARLY_WORKS: usize = 1024;

/// One device-hook work item (START/STOP of one channel of one kernel), on the GPU clock.
#[derive(Clone, Copy, Debug)]
pub(super) struct Work {
    pub func_id: u32,
    pub gpu_start: u64,
    pub gpu_stop: u64,
}

/// A work item as read: its record position, (communicator, channel) and workCounter.
#[derive(Clone, Copy, Debug)]
pub(super) struct Read {
    pub pos: u64,
    pub key: (u32, u8),
    pub wc: u64,
    pub work: Work,
}

/// One (communicator, channel) on the device-hook path: operations awaiting their work item there,
/// and work items awaiting their operation, both oldest first.
#[derive(Debug, Default)]
pub(super) struct Lane {
    pub ops: VecDeque<u64>,
    pub works: VecDeque<Work>,
}
