//! Replay attribution on the device-hook path: a work item of a communicator with a graph template
//! goes to a waiting eager operation, to the replay cursor of its channel, or into a hold while both
//! can own it (see the module documentation of [`super`]). This part owns the templates, the holds
//! and what a previous daemon settled; it reads the dictionary and the eager operations it is shown,
//! and returns what it decided. The router applies each decision to the operations and lanes, in
//! order, calling back in only through [`Replays::advance`] and the marks.

use super::counters::AssembleCounters;
use super::dictionary::Dict;
use super::graph::{MAX_TEMPLATE_OPS, Template, replay_id};
use super::hold::{self, Candidate, Hold, MAX_HOLD_EAGER, Owner};
use super::lanes::{Read, Work};
use crate::fast_map::Map;
use crate::instance::Desc;
use crate::storage::resume::{CapturedOp, ReplayCursor, SavedTemplate};

/// The templates, holds and settled items of one process.
#[derive(Default)]
pub(super) struct Replays {
    /// Per communicator, its captured operations and replay cursors.
    templates: Map<u32, Template>,
    /// Work items held at ambiguous replay boundaries, per (comm, channel).
    holds: Map<(u32, u8), Hold>,
    /// Work items a daemon before a restart settled, at or after the tail it committed: position ->
    /// (comm, dropped as ambiguous; else joined to an eager operation that lies before the tail).
    /// Read again, they are not attributed again.
    settled: Map<u64, (u32, bool)>,
    /// Work items in all holds (they count against the process's early-work bound).
    held: usize,
    /// A template changed since [`Self::take_changed`] (part of the saved dictionary).
    changed: bool,
}

/// Where a work item of a communicator with a template goes ([`Replays::route`]).
#[derive(Debug, PartialEq)]
pub(super) enum Route {
    /// Into the hold of its channel: [`Replays::hold_item`] with the lane's candidates.
    Hold,
    /// To the eager operations of its lane.
    Lane,
    /// To the replay cursor of its channel: [`Replays::advance`].
    Replay,
}

/// A replayed operation's work item, as [`Replays::advance`] placed it.
pub(super) struct Step {
    /// The replayed instance's id ([`replay_id`]).
    pub id: u64,
    /// The captured operation's index in the template, and the replay's number.
    pub index: u32,
    pub replay: u32,
    pub desc: Desc,
}

/// What a hold decided for the router to apply, in order.
#[derive(Debug)]
pub(super) enum Decision {
    /// The item at `pos` is the eager candidate's (out of the lane's order).
    Join { pos: u64, c: Candidate, work: Work },
    /// The eager candidate lost its item on the channel.
    Abandon(Candidate),
    /// The item is a replay's: [`Replays::advance`] from `cursor`.
    Replay { read: Read, cursor: ReplayCursor },
}

/// What [`Replays::hold_item`] did with an item.
#[derive(Debug, PartialEq)]
pub(super) enum Held {
    /// Held: the router settles the hold ([`Replays::settle`]).
    Stepped,
    /// Items were lost past any parse: the router ends the hold ([`Replays::resolve`]) and routes
    /// the item again.
    Ended,
}

/// A hold's decisions, and the cursor its channel continues from once they are applied (the hold
/// decided: [`Replays::conclude`]).
#[derive(Debug, Default)]
pub(super) struct Settled {
    pub decisions: Vec<Decision>,
    pub conclude: Option<Conclusion>,
}

/// The channel's cursor after a decided hold: the one parse left's.
#[derive(Debug)]
pub(super) struct Conclusion {
    cursor: ReplayCursor,
    /// The cursor when the hold began, and the position of its first item.
    before: ReplayCursor,
    first_pos: u64,
}

impl Replays {
    /// Restores the templates and settled items a previous daemon saved; returns how many captured
    /// operations they hold (drawn on the uid's budget).
    pub fn restore(&mut self, saved: Vec<SavedTemplate>) -> usize {
        for t in &saved {
            let joined = t.eager_items.iter().map(|&pos| (pos, (t.comm, false)));
            let dropped = t.ambiguous_items.iter().map(|&pos| (pos, (t.comm, true)));
            self.settled.extend(joined.chain(dropped));
        }
        self.templates = (saved.into_iter())
            .filter(|t| !t.ops.is_empty())
            .map(|t| (t.comm, Template::restored(t)))
            .collect();
        self.templates.values().map(|t| t.ops.len()).sum()
    }

    /// The templates as of the committed tail, with the items settled before a restart and not
    /// committed since (also for a template captured after the tail: its operations are read
    /// again, the items' owners are not), and the router's `joined`: (position, communicator) of
    /// items joined to an operation before the tail (a communicator with or without a template).
    pub fn saved(
        &self,
        committed: u64,
        joined: impl Iterator<Item = (u64, u32)>,
    ) -> Vec<SavedTemplate> {
        let mut saved: Vec<SavedTemplate> =
            self.templates.values().map(|t| t.at(committed)).collect();
        let settled = self.settled.iter().map(|(&pos, &v)| (pos, v));
        let joined = joined.map(|(pos, comm)| (pos, (comm, false)));
        for (pos, (comm, ambiguous)) in settled.chain(joined) {
            if pos < committed {
                continue;
            }
            let i = match saved.iter().position(|t| t.comm == comm) {
                Some(i) => i,
                None => {
                    saved.push(SavedTemplate {
                        comm,
                        ..Default::default()
                    });
                    saved.len() - 1
                }
            };
            let t = &mut saved[i];
            if ambiguous {
                t.ambiguous_items.push(pos);
            } else {
                t.eager_items.push(pos);
            }
        }
        saved.retain(|t| {
            !t.ops.is_empty() || !t.eager_items.is_empty() || !t.ambiguous_items.is_empty()
        });
        for t in &mut saved {
            t.eager_items.sort_unstable();
            t.eager_items.dedup();
            t.ambiguous_items.sort_unstable();
        }
        saved.sort_unstable_by_key(|t| t.comm);
        saved
    }

    /// Forgets the settled items and the history before `tail`; whether a replay cursor moved
    /// before it (a state saved for an earlier tail is then no longer valid for this one).
    pub fn prune(&mut self, tail: u64) -> bool {
        if !self.settled.is_empty() {
            self.settled.retain(|&pos, _| pos >= tail);
        }
        let mut moved = false;
        for t in self.templates.values_mut() {
            while t.marks.front().is_some_and(|m| m.0 < tail) {
                t.marks.pop_front();
                moved = true;
            }
            while t.ambiguous_marks.front().is_some_and(|m| m.0 < tail) {
                t.ambiguous_marks.pop_front();
                moved = true;
            }
            moved |= t.ambiguous_marks.iter().any(|&(_, first)| first < tail);
        }
        moved
    }

    /// Whether a template changed since the last call.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// Work items in all holds.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Whether `comm` has a template (its work items are routed here).
    #[inline]
    pub fn has_template(&self, comm: u32) -> bool {
        !self.templates.is_empty() && self.templates.contains_key(&comm)
    }

    /// Whether `comm`'s template has captured operations on channel `ch` (a p2p item on a channel
    /// it has none on is no replay's).
    pub fn uses_channel(&self, comm: u32, ch: u8) -> bool {
        (self.templates.get(&comm))
            .and_then(|t| t.by_channel.get(ch as usize))
            .is_some_and(|l| !l.is_empty())
    }

    /// Whether `comm`'s template has a captured send or receive on channel `ch`: a p2p item there
    /// may be a replay's.
    pub fn p2p_on_channel(&self, comm: u32, ch: u8) -> bool {
        (self.templates.get(&comm)).is_some_and(|t| {
            (t.by_channel.get(ch as usize))
                .is_some_and(|l| l.iter().any(|&i| t.ops[i as usize].desc.is_p2p))
        })
    }

    /// Captured operation `index` of `comm`: a send's or receive's channels (see
    /// [`CapturedOp::channels`]) and the receive fused with it, if one is.
    pub fn p2p_of(&self, comm: u32, index: u32) -> (Option<u64>, Option<u32>) {
        let Some(t) = self.templates.get(&comm) else {
            return (None, None);
        };
        let channels = t.ops.get(index as usize).and_then(|o| o.channels);
        (channels, t.partners.get(&index).copied())
    }

    /// The communicators with a template.
    pub fn comms(&self) -> Vec<u32> {
        self.templates.keys().copied().collect()
    }

    /// The sends and receives of `comm`'s template whose channels are not known yet:
    /// (index, description), in capture order.
    pub fn unplaced(&self, comm: u32) -> Vec<(u32, Desc)> {
        let Some(t) = self.templates.get(&comm) else {
            return Vec::new();
        };
        (t.ops.iter().enumerate())
            .filter(|(_, o)| o.channels == Some(0))
            .map(|(i, o)| (i as u32, o.desc))
            .collect()
    }

    /// Places `comm`'s captured send or receive `index` on its round's channels `all`.
    pub fn place(&mut self, comm: u32, index: u32, all: u64) {
        if let Some(t) = self.templates.get_mut(&comm) {
            t.place(index, all);
            self.changed = true;
        }
    }

    /// The description of captured operation `index` of `comm`.
    pub fn desc(&self, comm: u32, index: u32) -> Option<Desc> {
        Some(self.templates.get(&comm)?.ops.get(index as usize)?.desc)
    }

    /// Captured operations of `comm`'s template.
    pub fn captured(&self, comm: u32) -> usize {
        self.templates.get(&comm).map_or(0, |t| t.ops.len())
    }

    /// Adds a captured operation to `comm`'s template (the router checked its room); whether it is
    /// the template's first.
    pub fn capture(&mut self, comm: u32, op: CapturedOp) -> bool {
        debug_assert!(self.captured(comm) < MAX_TEMPLATE_OPS);
        let t = self.templates.entry(comm).or_insert_with(|| Template {
            comm,
            ..Default::default()
        });
        let first = t.ops.is_empty();
        t.push(op);
        self.changed = true;
        first
    }

    /// Forgets `comm`'s template (it ended); returns how many captured operations it held.
    pub fn remove(&mut self, comm: u32) -> Option<usize> {
        self.templates.remove(&comm).map(|t| t.ops.len())
    }

    /// The work item at `pos`, read again after a restart, if a previous daemon settled it: whether
    /// it was dropped as ambiguous. Its workCounter is seen as before the restart, so the channel's
    /// next item finds no gap that would move the cursor past an item that was never lost.
    pub fn take_settled(&mut self, pos: u64, key: (u32, u8), wc: u64) -> Option<bool> {
        if self.settled.is_empty() {
            return None;
        }
        let (_, ambiguous) = self.settled.remove(&pos)?;
        if let Some(t) = self.templates.get_mut(&key.0) {
            t.saw(key.1, wc);
        }
        Some(ambiguous)
    }

    /// A work item of `key` that no collective owns (a p2p round, counted `dev_p2p`): its
    /// workCounter is no lost item to the template's cursor or the channel's hold. (NCCL runs an
    /// all_to_all's self round on the channels a collective beside it uses: counted as a loss, each
    /// moved the cursor a whole replay on.)
    pub fn foreign(&mut self, key: (u32, u8), wc: u64) {
        if let Some(t) = self.templates.get_mut(&key.0) {
            t.saw_foreign(key.1, wc);
        }
        if let Some(h) = self.holds.get_mut(&key) {
            h.foreign += 1;
        }
    }

    /// Where a work item of a communicator with a template goes. `eager_waits`: an eager
    /// operation waits on its lane; `eager_fits`: whether one of them can own the item. A boundary
    /// both can own begins a hold.
    pub fn route(
        &mut self,
        read: &Read,
        eager_waits: bool,
        eager_fits: impl FnOnce() -> bool,
        dict: &Dict,
        now_ns: u64,
    ) -> Route {
        let (comm, ch) = read.key;
        let t = self.templates.get_mut(&comm).expect("caller checked");
        let lost = t.saw(ch, read.wc);
        if self.holds.contains_key(&read.key) {
            return Route::Hold;
        }
        if lost > 0 && !eager_waits {
            // No eager operation waits here: the lost items were the replays'. The workCounter says
            // how many, so the channel's replay count stays exact (a time check cannot: the blocks
            // of one kernel need not run at once, e.g. two ranks sharing a GPU).
            t.skip_lost(read.pos, ch, lost, read.wc);
            self.changed = true;
        }
        let (_, next, _, replay_fits) = next_replay(t, dict, ch, read.wc, &read.work);
        let in_progress = next.pos > 0 && replay_fits;
        if in_progress {
            return Route::Replay;
        }
        if !eager_fits() {
            return Route::Replay;
        }
        if replay_fits {
            // A replay boundary that both can own: decided by the items that follow.
            let len = t.by_channel[ch as usize].len();
            let cursor = (t.cursors.iter().find(|(c, _)| *c == ch))
                .map_or_else(ReplayCursor::default, |c| c.1);
            let hold = Hold::new(len, cursor, read.pos, read.wc, now_ns);
            self.holds.insert(read.key, hold);
            return Route::Hold;
        }
        Route::Lane
    }

    /// Moves the replay cursor of the item's channel over it (from `from`, where a hold decided
    /// it, else from where it stands): the captured operation and replay it is, or None if it fits
    /// nothing there (`dev_unattributed`).
    pub fn advance(
        &mut self,
        read: &Read,
        from: Option<ReplayCursor>,
        dict: &Dict,
    ) -> Option<Step> {
        let (comm, ch) = read.key;
        let t = self.templates.get_mut(&comm)?;
        if let Some(from) = from {
            *t.cursor(ch) = from;
        }
        let (stored, mut next, index, replay_fits) = next_replay(t, dict, ch, read.wc, &read.work);
        let index = index.filter(|_| replay_fits)?;
        let list_len = t.by_channel[ch as usize].len();
        if next.pos == 0 {
            next.replay = next.replay.saturating_add(1);
        }
        let replay = next.replay;
        next.pos = if next.pos as usize + 1 == list_len {
            0
        } else {
            next.pos + 1
        };
        next.last_wc = read.wc;
        let desc = t.ops[index as usize].desc;
        *t.cursor(ch) = next;
        t.mark(read.pos, ch, stored.unwrap_or_default());
        self.changed = true;
        Some(Step {
            id: replay_id(comm, index, replay),
            index,
            replay,
            desc,
        })
    }

    /// The replayed instance `step` was opened: [`Self::passed`] closes it once its channels move on.
    pub fn opened(&mut self, comm: u32, step: &Step) {
        if let Some(t) = self.templates.get_mut(&comm) {
            t.open.push_back((step.replay, step.index, step.id));
        }
    }

    /// The replayed instances opened before (replay, index) that a channel which has moved on to it
    /// still waits for, oldest first (`waits(id)`: whether the instance still waits for the
    /// channel, None if it is closed): a channel's items come in order, so theirs was lost. The
    /// router closes them (`dev_mismatch`) now rather than at the timeout, so they do not hold the
    /// commit point behind them.
    pub fn passed(
        &mut self,
        comm: u32,
        replay: u32,
        index: u32,
        waits: impl Fn(u64) -> Option<bool>,
    ) -> Vec<u64> {
        let mut closed = Vec::new();
        let Some(t) = self.templates.get_mut(&comm) else {
            return closed;
        };
        while let Some(&(r, k, id)) = t.open.front() {
            let Some(waits_here) = waits(id) else {
                t.open.pop_front();
                continue;
            };
            if (r, k) >= (replay, index) || !waits_here {
                break;
            }
            t.open.pop_front();
            closed.push(id);
        }
        closed
    }

    /// The captured operation `index` of `comm` ran `func_id` in a replay: later replays must too
    /// (u32::MAX once two differed).
    pub fn ran(&mut self, comm: u32, index: u32, func_id: u32) {
        if let Some(c) = self
            .templates
            .get_mut(&comm)
            .map(|t| &mut t.ops[index as usize])
            && c.func_id != Some(func_id)
        {
            c.func_id = Some(c.func_id.map_or(func_id, |_| u32::MAX));
        }
    }

    /// Adds a work item (and a lost one for each workCounter skipped) to the hold of its channel,
    /// with the lane's eager `candidates` enqueued since it began, and advances the parses.
    pub fn hold_item(
        &mut self,
        read: &Read,
        candidates: impl Iterator<Item = Candidate>,
        dict: &Dict,
        now_ns: u64,
    ) -> Held {
        let Read { pos, key, wc, work } = *read;
        let hold = self.holds.get_mut(&key).expect("caller checked");
        // A replay's block is as long as the template is now: the host events of its capture can be
        // read after the hold's first item (an eager item the GPU ran before the capture, drained
        // late), and a block cut at the length the template had then fits no replay.
        if let Some(list) =
            (self.templates.get(&key.0)).and_then(|t| t.by_channel.get(key.1 as usize))
        {
            hold.len = list.len();
        }
        if hold.items.is_empty() {
            (hold.first_pos, hold.started_ns) = (pos, now_ns);
        }
        // Eager operations enqueued since: the replay may come after them.
        for c in candidates {
            if hold.eager.len() >= MAX_HOLD_EAGER {
                break;
            }
            if hold.eager.iter().all(|e| e.id != c.id) {
                hold.eager.push(c);
            }
        }
        let skipped = (wc.wrapping_sub(hold.last_wc).wrapping_sub(1))
            .wrapping_sub(std::mem::take(&mut hold.foreign));
        if skipped >= hold.len as u64 + MAX_HOLD_EAGER as u64 {
            // Items lost past any parse (or a workCounter going back): what came is all there is;
            // this item is routed as usual (it may begin another hold).
            return Held::Ended;
        }
        let fit = ChannelFit {
            dict,
            template: self.templates.get(&key.0),
            key,
        };
        for lost in 1..=skipped {
            let wc = hold.last_wc.wrapping_add(lost);
            hold.step(pos, wc, None, &fit);
        }
        hold.step(pos, wc, Some(work), &fit);
        hold.last_wc = wc;
        hold.last_ns = now_ns;
        self.held += 1;
        Held::Stepped
    }

    /// Attributes the front items of `key`'s hold that all parses agree on; ends the hold once one
    /// parse is left and nothing is held, or drops it (`dev_ambiguous`) if no parse fits.
    pub fn settle(&mut self, key: (u32, u8), c: &mut AssembleCounters) -> Settled {
        let mut settled = Settled::default();
        if let Some(hold) = self.holds.remove(&key) {
            self.settle_hold(key, hold, &mut settled, c);
        }
        settled
    }

    /// No more items will come for the hold of `key` (its communicator or process ended, its
    /// candidates timed out, or the lane is full): a parse in the middle of a replay's block, or
    /// with fewer candidates consumed than another, expects items that did not come and is ruled
    /// out; what the rest agree on is attributed, the others dropped.
    pub fn resolve(&mut self, key: (u32, u8), c: &mut AssembleCounters) -> Settled {
        let mut settled = Settled::default();
        if let Some(mut hold) = self.holds.remove(&key) {
            hold.end();
            self.settle_hold(key, hold, &mut settled, c);
        }
        settled
    }

    /// A hold older than the operation timeout whose parses still disagree (equal functions with
    /// eager operations arriving all along): what it holds is dropped (`dev_ambiguous`), so that it
    /// no longer holds the commit point, with the eager operations any parse consumed; the parses go
    /// on from their places.
    pub fn restart_undecided(&mut self, key: (u32, u8), c: &mut AssembleCounters) -> Settled {
        let mut settled = Settled::default();
        let Some(mut hold) = self.holds.remove(&key) else {
            return settled;
        };
        let (items, k) = hold.restart();
        for (pos, _, work) in items {
            if work.is_some() {
                self.held -= 1;
                c.dev_ambiguous += 1;
                if let Some(t) = self.templates.get_mut(&key.0) {
                    t.ambiguous_mark(pos, hold.first_pos);
                }
            }
        }
        (settled.decisions).extend(hold.eager[..k].iter().map(|&c| Decision::Abandon(c)));
        self.settle_hold(key, hold, &mut settled, c);
        settled
    }

    fn settle_hold(
        &mut self,
        key: (u32, u8),
        mut hold: Hold,
        settled: &mut Settled,
        c: &mut AssembleCounters,
    ) {
        let decisions = &mut settled.decisions;
        if hold.parses.is_empty() {
            // Dropped: its candidates lose their item on the channel (closed as today), and the
            // cursor stays where the hold began.
            let held = hold.held();
            self.held -= held;
            c.dev_ambiguous += held as u64;
            if let Some(t) = self.templates.get_mut(&key.0) {
                for &(pos, _, work) in &hold.items {
                    if work.is_some() {
                        t.ambiguous_mark(pos, hold.first_pos);
                    }
                }
            }
            decisions.extend(hold.eager.iter().map(|&c| Decision::Abandon(c)));
            return;
        }
        for ((pos, wc, work), owner) in hold.take_agreed() {
            let Some(work) = work else {
                if let Owner::Eager(k) = owner {
                    decisions.push(Decision::Abandon(hold.eager[k]));
                }
                continue;
            };
            self.held -= 1;
            match owner {
                Owner::Eager(k) => decisions.push(Decision::Join {
                    pos,
                    c: hold.eager[k],
                    work,
                }),
                Owner::Replay(i, b) if self.templates.contains_key(&key.0) => {
                    // The cursor as if this item came with no hold: the replay item's own path
                    // attributes it (and marks the change for a restart).
                    let cursor = ReplayCursor {
                        pos: i as u32,
                        replay: hold.cursor.replay + b - (i == 0) as u32,
                        last_wc: wc.wrapping_sub(1),
                    };
                    let read = Read { pos, key, wc, work };
                    decisions.push(Decision::Replay { read, cursor });
                }
                Owner::Replay(..) => {}
                Owner::Ambiguous => {
                    c.dev_ambiguous += 1;
                    if let Some(t) = self.templates.get_mut(&key.0) {
                        t.ambiguous_mark(pos, hold.first_pos);
                    }
                }
            }
        }
        // One parse, nothing held: the lane and the cursor continue from its state.
        let Some(p) = hold.decided() else {
            self.holds.insert(key, hold);
            return;
        };
        // Consumed by an ambiguous or lost item (a joined one is no longer in the lane).
        decisions.extend(hold.eager[..p.k].iter().map(|&c| Decision::Abandon(c)));
        settled.conclude = Some(Conclusion {
            cursor: ReplayCursor {
                pos: p.r as u32,
                replay: hold.cursor.replay + p.blocks,
                last_wc: hold.last_wc,
            },
            before: hold.cursor,
            first_pos: hold.first_pos,
        });
    }

    /// Sets the channel's cursor from a decided hold, once its decisions are applied.
    pub fn conclude(&mut self, key: (u32, u8), end: Conclusion) {
        if let Some(t) = self.templates.get_mut(&key.0)
            && *t.cursor(key.1) != end.cursor
        {
            *t.cursor(key.1) = end.cursor;
            t.mark(end.first_pos, key.1, end.before);
            self.changed = true;
        }
    }

    /// Items in all holds counted one by one (checks [`Self::held`]).
    #[cfg(test)]
    pub fn held_recount(&self) -> usize {
        self.holds.values().map(Hold::held).sum()
    }

    /// Position of the first item of the oldest hold at or after `from`.
    pub fn oldest_held(&self, from: u64) -> Option<u64> {
        (self.holds.values())
            .filter(|h| !h.items.is_empty() && h.first_pos >= from)
            .map(|h| h.first_pos)
            .min()
    }

    /// The holds of `comm` (or of every communicator), in key order, each with when its latest
    /// item was read.
    pub fn holds(&self, comm: Option<u32>) -> Vec<((u32, u8), u64)> {
        if self.holds.is_empty() {
            return Vec::new();
        }
        let mut keys: Vec<_> = (self.holds.iter())
            .filter(|(k, _)| comm.is_none_or(|c| k.0 == c))
            .map(|(k, h)| (*k, h.last_ns))
            .collect();
        keys.sort_unstable();
        keys
    }

    /// For the sweep at `now_ns`: the holds older than `timeout_ns` whose items keep coming (their
    /// parses stay undecided), in key order.
    pub fn undecided(&self, now_ns: u64, timeout_ns: u64) -> Vec<(u32, u8)> {
        let idle = |t: u64| now_ns.saturating_sub(t) >= timeout_ns;
        let mut keys: Vec<(u32, u8)> = (self.holds.iter())
            .filter(|(_, h)| idle(h.started_ns) && !idle(h.last_ns))
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable();
        keys
    }

    /// For the sweep at `now_ns`: the holds whose items stopped coming for `timeout_ns`, or with a
    /// candidate that is `stale`, in key order.
    pub fn stopped(
        &self,
        now_ns: u64,
        timeout_ns: u64,
        stale: impl Fn(u64) -> bool,
    ) -> Vec<(u32, u8)> {
        let idle = |t: u64| now_ns.saturating_sub(t) >= timeout_ns;
        let mut keys: Vec<(u32, u8)> = (self.holds.iter())
            .filter(|(_, h)| idle(h.last_ns) || h.eager.iter().any(|c| stale(c.id)))
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable();
        keys
    }
}

/// Where the replay cursor of `ch` goes with an item of workCounter `wc`: (cursor stored, cursor
/// after the item, index of the captured operation it is, whether `work` fits that one).
fn next_replay(
    t: &Template,
    dict: &Dict,
    ch: u8,
    wc: u64,
    work: &Work,
) -> (Option<ReplayCursor>, ReplayCursor, Option<u32>, bool) {
    let list = t.by_channel.get(ch as usize).map_or(&[][..], Vec::as_slice);
    let stored = t.cursors.iter().find(|(c, _)| *c == ch).map(|c| c.1);
    let cursor = stored.unwrap_or_default();
    // A replay in progress expects the next workCounter; a gap skips the items that were lost.
    let mut next = cursor;
    if cursor.pos > 0 {
        let skipped = wc.wrapping_sub(cursor.last_wc).wrapping_sub(1);
        if skipped < (list.len() - cursor.pos as usize) as u64 {
            next.pos += skipped as u32;
        } else {
            next.pos = 0;
        }
    }
    let index = list.get(next.pos as usize).copied();
    let fits = index.is_some_and(|i| dict.replay_can_own(t.comm, work, &t.ops[i as usize]));
    (stored, next, index, fits)
}

/// What a hold of (communicator, channel) `key` asks: see [`hold::Fit`].
struct ChannelFit<'a> {
    dict: &'a Dict,
    template: Option<&'a Template>,
    key: (u32, u8),
}

impl hold::Fit for ChannelFit<'_> {
    fn eager(&self, c: &Candidate, work: &Work) -> bool {
        self.dict.work_matches(work.func_id, c.func)
            && (self.dict.started_by(self.key.0, work)).is_none_or(|t| c.enqueue_ns <= t)
    }

    fn replay(&self, i: usize, work: &Work) -> bool {
        self.captured(i)
            .is_some_and(|op| self.dict.replay_can_own(self.key.0, work, op))
    }

    fn captured_func_id(&self, i: usize) -> Option<u32> {
        self.captured(i)?.func_id
    }
}

impl ChannelFit<'_> {
    /// The `i`-th captured operation on the channel.
    fn captured(&self, i: usize) -> Option<&CapturedOp> {
        let t = self.template?;
        let &k = t.by_channel.get(self.key.1 as usize)?.get(i)?;
        Some(&t.ops[k as usize])
    }
}

#[cfg(test)]
mod tests {
    use ncclscope_proto::StrId;

    use super::*;
    use crate::instance::Names;

    fn read(pos: u64, wc: u64) -> Read {
        let work = Work {
            func_id: 7,
            gpu_start: 1,
            gpu_stop: 2,
        };
        Read {
            pos,
            key: (0, 0),
            wc,
            work,
        }
    }

    /// A template of `n` AllReduces on channel 0 (funcId names unknown: any item fits any).
    fn template(n: u64) -> Replays {
        let mut r = Replays::default();
        for pos in 0..n {
            let desc = Desc {
                seq: pos,
                is_p2p: false,
                func: StrId(1),
                datatype: StrId(2),
                algo: StrId(3),
                proto: StrId(4),
                count: 1,
                root: -1,
                peer: -1,
                n_channels: 1,
            };
            let op = CapturedOp {
                pos,
                desc,
                captured_ns: 0,
                func_id: None,
                channels: None,
                fused: None,
            };
            r.capture(0, op);
        }
        r
    }

    #[test]
    fn items_follow_the_cursor_and_a_boundary_an_eager_operation_fits_is_held_until_decided() {
        let dict = Dict::new(Names::default());
        let mut c = AssembleCounters::default();
        let mut r = template(2);
        // No eager operation waits: the cursor takes the items in capture order.
        for (wc, index) in [(0, 0), (1, 1)] {
            let item = read(10 + wc, wc);
            assert_eq!(r.route(&item, false, || false, &dict, 0), Route::Replay);
            let step = r.advance(&item, None, &dict).expect("fits");
            assert_eq!((step.index, step.replay), (index, 1));
        }
        // At the next boundary an eager operation that fits waits too: the item is held.
        let item = read(12, 2);
        assert_eq!(r.route(&item, true, || true, &dict, 0), Route::Hold);
        let eager = Candidate {
            id: 9,
            first_pos: 5,
            func: StrId(1),
            enqueue_ns: 0,
        };
        let held = r.hold_item(&item, [eager].into_iter(), &dict, 0);
        assert_eq!((held, r.held()), (Held::Stepped, 1));
        // The eager operation or the second replay: undecided while no more items come.
        let settled = r.settle((0, 0), &mut c);
        assert!(settled.decisions.is_empty() && settled.conclude.is_none());
        // None come: a parse that expects the rest of a replay is ruled out. The candidates the
        // parse consumed leave the lane (the router's abandon passes over the one that was joined).
        let settled = r.resolve((0, 0), &mut c);
        assert!(matches!(
            settled.decisions[..],
            [Decision::Join { pos: 12, c, .. }, Decision::Abandon(a)] if c.id == 9 && a.id == 9
        ));
        assert!(settled.conclude.is_some());
        assert_eq!((r.held(), r.oldest_held(0)), (0, None));
    }
}
