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
/// and work items (with their record position) awaiting their operation, both oldest first.
#[derive(Debug, Default)]
pub(super) struct Lane {
    pub ops: VecDeque<u64>,
    pub works: VecDeque<(u64, Work)>,
}

impl Lane {
    /// Pairs the waiting operations with the early work items, oldest first. `fits(op, work)`:
    /// whether operation `op` can own `work` (None: it is no longer in flight, and leaves the lane).
    /// A work item the oldest operation cannot own skips the operations before the first that can
    /// (they lost their item on this channel), or is dropped if none can. Returns the pairs and how
    /// many items were dropped; the pairs (operation, item's position, item) go to `joined` (a buffer
    /// the caller reuses: no allocation per work item on the ingest path).
    pub fn pair(
        &mut self,
        fits: impl Fn(u64, &Work) -> Option<bool>,
        joined: &mut Vec<(u64, u64, Work)>,
    ) -> usize {
        let mut dropped = 0;
        while let (Some(&id), Some(&(pos, work))) = (self.ops.front(), self.works.front()) {
            match fits(id, &work) {
                None => {
                    self.ops.pop_front();
                }
                Some(true) => {
                    self.ops.pop_front();
                    self.works.pop_front();
                    joined.push((id, pos, work));
                }
                Some(false) => {
                    if (self.ops.iter().skip(1)).any(|&later| fits(later, &work) == Some(true)) {
                        self.ops.pop_front();
                    } else {
                        self.works.pop_front();
                        dropped += 1;
                    }
                }
            }
        }
        dropped
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty() && self.works.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(func_id: u32) -> Work {
        Work {
            func_id,
            gpu_start: 0,
            gpu_stop: 1,
        }
    }

    #[test]
    fn items_join_in_order_skip_operations_that_lost_theirs_and_drop_what_fits_none() {
        // Operations 1..=4 run functions 10, 20, 10, 30; operation 2 is no longer in flight.
        let func = |op: u64| [10, 20, 10, 30][op as usize - 1];
        let fits = |op: u64, w: &Work| (op != 2).then(|| func(op) == w.func_id);
        let mut lane = Lane {
            ops: (1..=4).collect(),
            works: [(5, work(10)), (6, work(10)), (7, work(99)), (8, work(30))].into(),
        };
        let mut joined = Vec::new();
        let dropped = lane.pair(fits, &mut joined);
        let pairs: Vec<(u64, u64)> = joined.iter().map(|j| (j.0, j.1)).collect();
        // 1 takes the first 10; 2 is gone; 3 takes the second 10; 99 fits nothing: dropped; 4 takes 30.
        assert_eq!(pairs, [(1, 5), (3, 6), (4, 8)]);
        assert_eq!(dropped, 1);
        assert!(lane.is_empty());

        // An item that a later operation fits skips the one before it (which lost its item here).
        let mut lane = Lane {
            ops: [1, 4].into(),
            works: [(9, work(30))].into(),
        };
        joined.clear();
        let dropped = lane.pair(fits, &mut joined);
        assert_eq!((joined.len(), joined[0].0, dropped), (1, 4, 0));
        assert!(lane.is_empty());
    }
}
