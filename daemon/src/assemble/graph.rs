//! CUDA graphs on the device-hook path: each communicator's template (its captured operations in
//! capture order), the replay cursors per channel, and what a restart needs of them as of the
//! committed tail.

use std::collections::VecDeque;

use ncclscope_proto::MAX_CHANNELS;

use crate::fast_map::Map;
use crate::storage::resume::SavedTemplate;
pub use crate::storage::resume::{CapturedOp, ReplayCursor};

/// Captured operations one communicator's template holds at most.
pub const MAX_TEMPLATE_OPS: usize = 4096;
/// ReplayCursor changes remembered for the commit point (see [`Template::marks`]), about as many as the
/// default segment holds records; beyond it the oldest go (a restart from a tail older than that would
/// resume the cursors from the oldest one kept).
pub(super) const MAX_MARKS: usize = 1 << 16;

/// One communicator's captured operations in capture order and its replay cursors. Graphs captured
/// one after another form one template: replays must come in capture order (one graph, or several
/// replayed in the order they were captured).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Template {
    pub comm: u32,
    pub ops: Vec<CapturedOp>,
    /// (channel, cursor) of every channel the captured operations use.
    pub cursors: Vec<(u8, ReplayCursor)>,
    /// Per channel: indices of the captured operations that use it.
    pub(super) by_channel: Vec<Vec<u32>>,
    /// (record position, channel, cursor before that record moved it), oldest first: the cursors as
    /// they were at any later commit point.
    pub(super) marks: VecDeque<(u64, u8, ReplayCursor)>,
    /// (replay, captured index, instance id) of replayed instances opened, oldest first.
    pub(super) open: VecDeque<(u32, u32, u64)>,
    /// (record position, position of the hold's first item) of work items dropped as ambiguous
    /// (see [`Hold`]), oldest first.
    pub(super) ambiguous_marks: VecDeque<(u64, u64)>,
    /// Per channel: workCounter of the latest item read (any owner), so a gap is counted in items
    /// lost. Not persisted: after a restart the first item of a channel finds no gap.
    pub(super) seen_wc: Vec<Option<u64>>,
    /// Per channel: items lost before a foreign item ([`Template::saw_foreign`]), still to count
    /// at the channel's next item.
    pub(super) lost_before_foreign: Vec<u64>,
    /// send index -> the index of the receive fused with it (rebuilt from [`CapturedOp::fused`]).
    pub(super) partners: Map<u32, u32>,
}

impl Template {
    pub(super) fn push(&mut self, mut op: CapturedOp) {
        if let Some(prev) = self.ops.iter().rev().find(|o| {
            o.desc.func == op.desc.func
                && o.desc.is_p2p == op.desc.is_p2p
                && (!o.desc.is_p2p || o.desc.peer == op.desc.peer)
        }) {
            op.desc.seq = op.desc.seq.max(prev.desc.seq.saturating_add(1));
        }
        let index = self.ops.len() as u32;
        if let Some(send) = op.fused {
            self.partners.insert(send, index);
        }
        let channels = op.channels;
        self.ops.push(op);
        match channels {
            None => {
                let all = match self.ops[index as usize].desc.n_channels.min(MAX_CHANNELS) {
                    MAX_CHANNELS => u64::MAX,
                    n => (1u64 << n) - 1,
                };
                self.enter(index, all);
            }
            // A send or receive whose channels are not known yet enters when they are (`place`).
            Some(0) => {}
            Some(all) => self.place(index, all),
        }
    }

    /// Places the send or receive `index` on its round's channels `all` (less those a fused receive
    /// shares with its send, which must be placed first).
    pub(super) fn place(&mut self, index: u32, all: u64) {
        let op = &mut self.ops[index as usize];
        op.channels = Some(all);
        let send = op.fused.and_then(|s| self.ops.get(s as usize));
        let own = all & !send.and_then(|s| s.channels).unwrap_or(0);
        self.enter(index, own);
    }

    /// Enters captured operation `index` in the lists of channels `own`, in capture order (one
    /// placed late goes before those captured after it).
    fn enter(&mut self, index: u32, own: u64) {
        let pos = self.ops[index as usize].pos;
        // A channel joining the template counts replays from those channel 0 has completed.
        let done = (self.cursors.iter())
            .find(|(c, _)| *c == 0)
            .map_or(0, |(_, c)| c.replay.saturating_sub((c.pos > 0) as u32));
        for ch in (0..MAX_CHANNELS).filter(|ch| own & 1 << ch != 0) {
            let at = ch as usize;
            if self.by_channel.len() <= at {
                self.by_channel.resize_with(at + 1, Vec::new);
            }
            if self.by_channel[at].is_empty() && !self.cursors.iter().any(|(c, _)| *c == ch) {
                let cursor = ReplayCursor {
                    replay: done,
                    ..Default::default()
                };
                self.cursors.push((ch, cursor));
            }
            let ops = &self.ops;
            let list = &mut self.by_channel[at];
            let i = list.partition_point(|&k| ops[k as usize].pos < pos);
            list.insert(i, index);
        }
    }

    /// Remembers that the cursor of `ch` was `before` until the record at `pos` moved it. Kept in
    /// position order: items held at a replay boundary are attributed after later records.
    pub(super) fn mark(&mut self, pos: u64, ch: u8, before: ReplayCursor) {
        if self.marks.len() >= MAX_MARKS {
            self.marks.pop_front();
        }
        let i = self.marks.partition_point(|m| m.0 <= pos);
        self.marks.insert(i, (pos, ch, before));
    }

    /// Remembers that the work item at `pos` was dropped as ambiguous by a hold that began at `first`.
    pub(super) fn ambiguous_mark(&mut self, pos: u64, first: u64) {
        if self.ambiguous_marks.len() >= MAX_MARKS {
            self.ambiguous_marks.pop_front();
        }
        let i = self.ambiguous_marks.partition_point(|m| m.0 <= pos);
        self.ambiguous_marks.insert(i, (pos, first));
    }

    /// Notes the item of workCounter `wc` on `ch`; returns how many items the channel lost before it.
    pub(super) fn saw(&mut self, ch: u8, wc: u64) -> u64 {
        if self.seen_wc.len() <= ch as usize {
            self.seen_wc.resize(ch as usize + 1, None);
            self.lost_before_foreign.resize(ch as usize + 1, 0);
        }
        let prev = self.seen_wc[ch as usize].replace(wc);
        let gap = prev.map_or(0, |p| wc.wrapping_sub(p).wrapping_sub(1));
        gap.saturating_add(std::mem::take(&mut self.lost_before_foreign[ch as usize]))
    }

    /// Notes an item of `ch` that no captured operation owns (a p2p round of the communicator): its
    /// workCounter is no loss to the captured operations' items after it, and items lost before it
    /// still count at the channel's next item.
    pub(super) fn saw_foreign(&mut self, ch: u8, wc: u64) {
        let lost = self.saw(ch, wc);
        self.lost_before_foreign[ch as usize] = lost;
    }

    /// Moves the cursor of `ch` past `n` lost items of its replays, across replay boundaries; the
    /// item at `pos`, of workCounter `wc`, found the gap.
    pub(super) fn skip_lost(&mut self, pos: u64, ch: u8, n: u64, wc: u64) {
        let len = self.by_channel.get(ch as usize).map_or(0, Vec::len) as u64;
        if len == 0 {
            return;
        }
        let before = *self.cursor(ch);
        let c = self.cursor(ch);
        // Items of the channel's replays gone by: whole replays, less what the current one lacks.
        let consumed =
            (c.replay as u64 * len).saturating_sub(if c.pos > 0 { len - c.pos as u64 } else { 0 });
        let after = consumed.saturating_add(n);
        c.replay = after.div_ceil(len).min(u32::MAX as u64) as u32;
        c.pos = (after % len) as u32;
        c.last_wc = wc.wrapping_sub(1);
        self.mark(pos, ch, before);
    }

    pub(super) fn cursor(&mut self, ch: u8) -> &mut ReplayCursor {
        let i = match self.cursors.iter().position(|(c, _)| *c == ch) {
            Some(i) => i,
            None => {
                self.cursors.push((ch, ReplayCursor::default()));
                self.cursors.len() - 1
            }
        };
        &mut self.cursors[i].1
    }

    /// The template as it was at stream position `tail`: operations captured before it, cursors
    /// before the first change at or after it.
    pub(super) fn at(&self, tail: u64) -> SavedTemplate {
        let mut t = SavedTemplate {
            comm: self.comm,
            ops: self.ops.iter().filter(|o| o.pos < tail).cloned().collect(),
            cursors: self.cursors.clone(),
            // Filled by the assembler, which marks the items joined to eager operations.
            eager_items: Vec::new(),
            ambiguous_items: (self.ambiguous_marks.iter())
                .filter(|&&(pos, first)| pos >= tail && first < tail)
                .map(|&(pos, _)| pos)
                .collect(),
        };
        for &(pos, ch, before) in self.marks.iter().rev() {
            if pos >= tail
                && let Some(c) = t.cursors.iter_mut().find(|(c, _)| *c == ch)
            {
                c.1 = before;
            }
        }
        t.cursors.sort_unstable_by_key(|(ch, _)| *ch);
        t
    }

    /// A template restored from its saved form; rebuilds what is not saved.
    pub(super) fn restored(saved: SavedTemplate) -> Template {
        let mut t = Template {
            comm: saved.comm,
            cursors: saved.cursors,
            ..Default::default()
        };
        for op in saved.ops {
            // Seqs were made unique when first captured: push keeps them.
            t.push(op);
        }
        t
    }
}

/// The instance id of replay `replay` of captured operation `index` of communicator `comm`. Bit 31 is
/// set, which the ids of the plugin's eager operations never have (pool index < 2^16); captured
/// operations' ids do, but those never become instances themselves.
pub(super) fn replay_id(comm: u32, index: u32, replay: u32) -> u64 {
    (replay as u64) << 32 | 1 << 31 | ((comm as u64 & 0x7fff) << 16) | (index as u64 & 0xffff)
}
