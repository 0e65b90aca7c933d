//! A segment's commit point: the whole resume protocol of one segment. Which records the ring's
//! tail may pass (read, delivered, durable in the spool, acknowledged by the collector, their
//! collective's root settled), the state that describes a tail and when it is durable, and the
//! restore half of attach: what a restarted engine takes of a previous one's state and spool.
//!
//! It owns only its own state; what it reads of the rest of its segment (the ring, the assembler,
//! how far it was read) it is handed as [`Reading`].

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ncclscope_proto::segment::Consumer;

use crate::assemble::{Assembler, done};
use crate::fast_map::Map;
use crate::loss::{Loss, Losses};
use crate::stats::RootWait;
use crate::storage::resume::{self, AtRisk, SegmentState};
use crate::storage::spool::{Origin, Position};
use crate::storage::state_writer::StateWriter;

/// Records copied out of a ring (one pread) and decoded at once: 64 KiB, still in cache when they are
/// applied, and the system call's cost spread over as many. Also what finishing a commit skips at once.
pub(super) const READ_CHUNK: usize = 1024;
/// Longest a segment's tail may lag the engine's progress before it is committed.
pub(super) const COMMIT_EVERY: Duration = Duration::from_millis(10);
/// A changed dictionary rewrites the segment's whole state file: saved at most every [`COMMIT_EVERY`]
/// and every this many times the last save's duration, so a process that keeps redefining its
/// dictionary costs the ingest thread a bounded share of its time (its own tail waits meanwhile),
/// except while its ring is over half full: then every [`COMMIT_EVERY`], or the producer drops.
const DICT_SAVE_SHARE: u32 = 50;
/// How far a job's spool may run past a segment's saved `spool_mark` before the state is saved again:
/// bounds what a restarted engine reads back per segment.
const MARK_LAG: u64 = 1 << 20;
/// States of a segment queued and not yet durable at which its commits wait for the writer: bounds
/// what a slow state disk makes the daemon hold (the ring holds the records meanwhile).
const MAX_SAVING: usize = 8;

/// An operation delivered: (op id, position of its first record, sinks: see [`done`]).
pub(super) type OpDone = (u64, u64, u8);

/// What a commit reads of its segment besides its own state.
pub(super) struct Reading<'a> {
    /// Names the segment's resume state.
    pub label: &'a str,
    pub consumer: &'a mut Consumer,
    pub asm: &'a mut Assembler,
    /// One past the last record read.
    pub read_upto: u64,
}

/// What one segment's commit point takes of a delivery (see `CommitPoint::take`).
#[derive(Default)]
pub(super) struct Delivered {
    pub seg: usize,
    /// (first record, settlement) of each operation that waits on its collective's root.
    pub roots: Vec<(u64, RootWait)>,
    /// (emit number, first record, op id) of each span queued for export.
    pub emitted: Vec<(u64, u64, u64)>,
    /// Operations recorded without the spool (or re-read: recorded before).
    pub recorded: Vec<OpDone>,
    /// Operations queued for the spool, with the spool mark they follow (in the batch `send`
    /// returns).
    pub spooled: Option<(Position, Vec<OpDone>)>,
}

/// One segment's commit point and what it waits on.
pub(super) struct CommitPoint {
    /// The committed tail as far as the engine goes: that of the last state queued. The ring's tail
    /// follows once that state is durable (see `saving`).
    pub tail: u64,
    /// (state number, tail) of each state queued and not yet durable, in queue order: the ring's tail
    /// moves to `tail` once the state writer reports the number durable.
    saving: VecDeque<(u64, u64)>,
    /// The last state queued was not written: save again before the tail moves on.
    resave: bool,
    /// A state of this segment is durable. Until one is, its spooled batches wait for the states
    /// queued before them: without a state, a restarted engine would not read the spool back for
    /// it. (A later state only moves the spool mark on: one left older makes a restart read more.)
    on_disk: bool,
    /// What the exporter acknowledged of the segment's spans (emit numbers, in order).
    pub acked: Arc<AtomicU64>,
    pub next_emit: u64,
    /// Completed operations queued for export and not yet acknowledged.
    pub unacked: Unacked,
    /// Delivered operations whose collective's root span is not settled (not graph replays').
    pub roots: RootHolds,
    /// What a forced commit passed unacknowledged, and how much of it the last saved state says
    /// is at risk.
    passed: Passed,
    saved_at_risk: AtRisk,
    /// Operations this daemon delivered whose records are not yet committed: id -> (pos, sinks).
    delivered: Map<u64, (u64, u8)>,
    pub last_commit: Instant,
    /// `delivered` changed since the state was last saved.
    dirty: bool,
    /// A state for this segment was queued by this daemon, or restored from a previous one.
    state_saved: bool,
    /// The dictionary changed since the state was last saved.
    dict_changed: bool,
    /// When a changed dictionary was last saved, and how long the ingest thread spent on it (see
    /// [`DICT_SAVE_SHARE`]).
    dict_saved_at: Instant,
    dict_save_cost: Duration,
    /// The spool position in the saved state.
    spool_mark: Option<Position>,
    /// The parked operations in the saved state, and the read position they are as of: saved
    /// again as they were by a save that does not move the tail (see `Delivery::deliver`).
    saved_parked: (Vec<resume::SavedOp>, u64),
    /// Batches queued for the spool and not yet durable, in queue order.
    pub spooling: VecDeque<Spooling>,
}

/// A segment's instances in a batch queued for the spool writer and not yet durable.
pub(super) struct Spooling {
    pub batch: u64,
    /// The spool's end before the batch was queued: at or before where the batch lands.
    pub mark: Position,
    /// First record of the earliest of its operations: the tail waits there until it is durable.
    pub first_pos: u64,
    /// Its operations, for `delivered` once durable.
    pub ops: Vec<OpDone>,
}

impl CommitPoint {
    /// The restore half of attach: the commit point of a segment handed over, from the state a
    /// previous daemon saved for it (in `state_dir`), if any applies. `recorded` reads back what the
    /// spool recorded of this segment since a spool mark (`None` without a spool): spooled by the
    /// previous daemon after it saved the state, those operations are recorded already.
    pub fn restore(
        state_dir: &Path,
        label: &str,
        consumer: &mut Consumer,
        asm: &mut Assembler,
        recorded: impl FnOnce(Option<Position>) -> Option<std::io::Result<Vec<Origin>>>,
        now_ns: u64,
        lost: &mut Losses,
    ) -> CommitPoint {
        let mut state_saved = false;
        let mut spool_mark = None;
        let mut saved_parked = (Vec::new(), 0);
        let mut resave = false;
        match resume::load(state_dir, label) {
            Ok(Some(st)) if finish_commit(consumer, st.tail) => {
                // The previous daemon's in-flight spans and roots behind its tail are lost with it:
                // counted here, and the state saved again without them at the first commit.
                lost.add(Loss::SpanNotResent, st.at_risk.spans);
                lost.add(Loss::RootNotResent, st.at_risk.roots);
                resave = st.at_risk != AtRisk::default();
                let tail = consumer.segment().tail();
                let mut delivered = st.delivered;
                match recorded(st.spool_mark) {
                    Some(Ok(origins)) => mark_recorded(&mut delivered, tail, &st.parked, origins),
                    Some(Err(e)) => {
                        tracing::warn!(segment = %label, error = %e, "cannot read the spool back; what it holds past the saved state may be recorded twice");
                        lost.add(Loss::SpoolUnreadable, 1);
                    }
                    None => {}
                }
                asm.restore(st.dictionary, delivered);
                asm.restore_parked(&st.parked, st.parked_upto, now_ns);
                state_saved = true;
                spool_mark = st.spool_mark;
                saved_parked = (st.parked, st.parked_upto);
            }
            Ok(Some(_)) | Ok(None) => {
                if consumer.segment().tail() > 0 {
                    // Records before the tail defined strings and communicators we no longer know.
                    tracing::warn!(segment = %label, "no resume state for a partly consumed segment");
                    lost.add(Loss::ResumeStateMissing, 1);
                }
            }
            Err(e) => {
                tracing::warn!(segment = %label, error = %e, "unreadable resume state; starting without it");
                lost.add(Loss::ResumeStateMissing, 1);
            }
        }
        CommitPoint {
            tail: consumer.segment().tail(),
            saving: VecDeque::new(),
            resave,
            on_disk: state_saved,
            acked: Arc::new(AtomicU64::new(0)),
            next_emit: 1,
            unacked: Unacked::default(),
            roots: RootHolds::default(),
            passed: Passed::default(),
            saved_at_risk: AtRisk::default(),
            delivered: Map::default(),
            last_commit: Instant::now(),
            dirty: false,
            state_saved,
            dict_changed: false,
            dict_saved_at: Instant::now(),
            dict_save_cost: Duration::ZERO,
            spool_mark,
            saved_parked,
            spooling: VecDeque::new(),
        }
    }

    /// Whether a previous daemon's state for the segment applied (at attach: a restart).
    pub fn resumed(&self) -> bool {
        self.state_saved
    }

    /// The spool position the segment's state may save (`end`: the spool's end for its job): at or
    /// before everything of it the spool takes from now on and everything of it queued and not yet
    /// durable.
    pub fn spool_mark(&self, end: impl FnOnce() -> Position) -> Position {
        match self.spooling.front() {
            Some(s) => s.mark,
            None => end(),
        }
    }

    /// The number of the last state queued, while none of the segment's is durable yet: what its
    /// spooled batches must wait for (see `on_disk`).
    pub fn state_not_on_disk(&self) -> Option<u64> {
        match self.on_disk {
            true => None,
            false => self.saving.back().map(|&(no, _)| no),
        }
    }

    /// The number of the last state queued and not yet durable.
    pub fn last_saving(&self) -> Option<u64> {
        self.saving.back().map(|&(no, _)| no)
    }

    /// An operation recorded without the spool (or whose spooled batch is durable).
    fn recorded(&mut self, op_id: u64, first_pos: u64, flags: u8) {
        self.delivered.insert(op_id, (first_pos, flags));
        self.dirty = true;
    }

    /// Takes what a delivery decided for this segment ([`Delivered`]; `batch`: the number of the
    /// spool batch its spooled operations are in, `Err` if the spool writer refused it).
    pub fn take(&mut self, d: Delivered, batch: Result<u64, ()>) {
        for (first_pos, wait) in d.roots {
            self.hold_root(first_pos, wait);
        }
        for (emit_no, first_pos, op_id) in d.emitted {
            debug_assert_eq!(emit_no, self.next_emit);
            self.emitted(emit_no, first_pos, op_id);
        }
        for (op_id, first_pos, flags) in d.recorded {
            self.recorded(op_id, first_pos, flags);
        }
        if let Some((mark, ops)) = d.spooled {
            self.spooled(batch, mark, ops);
        }
    }

    /// Before the segment's fresh instances are queued for the spool (write-ahead): a state whose
    /// spool mark precedes them, if the saved one is missing or far behind the spool's `end`. It
    /// keeps the parked operations as last saved (for this tail): some may complete in this very
    /// batch, and are recorded (or not) only by what follows.
    pub fn write_ahead(
        &mut self,
        r: Reading<'_>,
        states: &mut StateWriter,
        end: Position,
        lost: &mut Losses,
    ) {
        if !mark_stale(self.spool_mark, Some(end)) {
            return;
        }
        let mark = self.spool_mark(|| end);
        let tail = self.tail;
        if let Err(e) = self.save_state(&r, states, tail, Some(mark), Parked::AsSaved) {
            tracing::error!(segment = %r.label, error = %e, "cannot save resume state before spooling; a crash now could record these instances twice");
            lost.add(Loss::StateWriteFailed, 1);
        }
    }

    /// Waits on the root of an operation whose records begin at `first_pos`.
    fn hold_root(&mut self, first_pos: u64, wait: RootWait) {
        // Records a forced commit already freed cannot be read again: at risk until it settles.
        match first_pos >= self.tail {
            true => self.roots.push(first_pos, wait),
            false => self.passed.root(wait),
        }
    }

    /// A span queued for export as `emit_no` (see `next_emit`).
    fn emitted(&mut self, emit_no: u64, first_pos: u64, op_id: u64) {
        self.next_emit += 1;
        // Records a forced commit already freed cannot be read again: at risk until acknowledged.
        match first_pos >= self.tail {
            true => self.unacked.push(emit_no, first_pos, op_id),
            false => self.passed.spans.push(emit_no),
        }
    }

    /// A batch queued for the spool (`Ok`: its number), or refused (recorded without the spool,
    /// counted, as when an append fails).
    fn spooled(&mut self, queued: Result<u64, ()>, mark: Position, ops: Vec<OpDone>) {
        match queued {
            Ok(no) => self.spooling.push_back(Spooling {
                batch: no,
                mark,
                first_pos: ops.iter().map(|o| o.1).min().unwrap_or(u64::MAX),
                ops,
            }),
            Err(()) => {
                for (id, pos, flags) in ops {
                    self.delivered.insert(id, (pos, flags));
                }
                self.dirty = true;
            }
        }
    }

    /// Moves the operations of batches the spool writer made durable (up to `durable`) into
    /// `delivered`.
    pub fn spool_durable(&mut self, durable: u64) {
        while self.spooling.front().is_some_and(|s| s.batch <= durable) {
            let s = self.spooling.pop_front().expect("checked");
            for (id, pos, flags) in s.ops {
                self.delivered.insert(id, (pos, flags));
            }
            self.dirty = true;
        }
    }

    /// State `no` could not be written: save again before the tail moves on.
    pub fn state_failed(&mut self, no: u64) {
        self.saving.retain(|&(n, _)| n > no);
        self.resave = true;
    }

    /// Moves the ring's tail to that of the newest state the state writer made durable (up to
    /// `durable`).
    pub fn states_durable(&mut self, durable: u64, consumer: &mut Consumer) {
        let mut tail = None;
        while let Some(&(no, t)) = self.saving.front()
            && no <= durable
        {
            self.saving.pop_front();
            tail = Some(t);
        }
        if let Some(t) = tail {
            consumer.commit(t);
            self.on_disk = true;
        }
    }

    /// Takes note of the spans the exporter acknowledged and the roots settled.
    pub fn collect_acks(&mut self) {
        self.roots.pop_settled();
        let acked = self.acked.load(Ordering::Acquire);
        while let Some(id) = self.unacked.pop_acked(acked) {
            if let Some(e) = self.delivered.get_mut(&id) {
                e.1 |= done::EXPORTED;
                self.dirty = true;
            } else if let Some(op) =
                (self.spooling.iter_mut()).find_map(|s| s.ops.iter_mut().find(|o| o.0 == id))
            {
                op.2 |= done::EXPORTED; // acknowledged before the spool made it durable
            }
        }
    }

    /// Whether everything delivered is acknowledged and durable in the spool (roots aside).
    pub fn settled(&self) -> bool {
        self.unacked.is_empty() && self.spooling.is_empty()
    }

    /// Whether spans or roots this segment exported are still in flight (what a clean shutdown
    /// waits for, so that a restart neither re-sends nor counts them).
    pub fn exports_in_flight(&mut self) -> bool {
        let acked = self.acked.load(Ordering::Acquire);
        !self.unacked.is_empty() || self.passed.at_risk(acked) != AtRisk::default()
    }

    /// Moves the segment's commit point (`tail`) where it can go, queueing the state that
    /// describes it; the ring's tail follows once that state is durable (see
    /// [`Self::states_durable`]).
    pub fn commit(
        &mut self,
        r: Reading<'_>,
        states: &mut StateWriter,
        now: bool,
        spool_end: Option<Position>,
        lost: &mut Losses,
        forced: &mut u64,
    ) {
        // A state disk this far behind: the records wait in the ring rather than states in memory.
        if self.saving.len() >= MAX_SAVING {
            return;
        }
        let tail = self.tail;
        let mut target = r.read_upto;
        if let Some(p) = r.asm.oldest_pending_pos(tail) {
            target = target.min(p);
        }
        if let Some(p) = self.unacked.oldest_pos() {
            target = target.min(p);
        }
        if let Some(p) = self.roots.oldest_pos() {
            target = target.min(p);
        }
        // Not past an operation whose instance the spool has not made durable yet.
        if let Some(p) = self.spooling.iter().map(|s| s.first_pos).min() {
            target = target.min(p);
        }
        // Over half full, the producer is about to drop records (a burst of graph replays, a slow
        // collector): free what was read even past operations still open and spans not yet
        // acknowledged, and save the state as often as that takes. They are delivered as usual;
        // only a daemon restarted before they finish would not read them again.
        let capacity = r.consumer.segment().capacity();
        let pressed = ring_pressed(r.consumer);
        let forcing = pressed && target < r.read_upto;
        if forcing {
            target = r.read_upto;
        }
        self.dict_changed |= r.asm.take_dictionary_changed();
        let dict_changed = self.dict_changed;
        let stale = mark_stale(self.spool_mark, spool_end);
        let at_risk = self.passed.at_risk(self.acked.load(Ordering::Acquire));
        let risk_changed = at_risk != self.saved_at_risk;
        if target <= tail && !dict_changed && !self.dirty && !stale && !self.resave && !risk_changed
        {
            return;
        }
        let lag = target.saturating_sub(tail);
        if !now && !dict_changed && lag < capacity / 4 && self.last_commit.elapsed() < COMMIT_EVERY
        {
            return;
        }
        let save_every = match pressed {
            true => COMMIT_EVERY,
            false => COMMIT_EVERY.max(self.dict_save_cost * DICT_SAVE_SHARE),
        };
        if !now && dict_changed && self.dict_saved_at.elapsed() < save_every {
            return;
        }
        if forcing {
            self.passed.spans.extend(self.unacked.forget_before(target));
            for wait in self.roots.forget_before(target) {
                self.passed.root(wait);
            }
            *forced += 1;
        }
        self.delivered.retain(|_, (pos, _)| *pos >= target);
        // A replay cursor that moved before the new tail makes the saved state stale for it.
        let cursors_moved = r.asm.prune_prior(target);
        // A saved state stays valid for any later tail: with the same dictionary, nothing delivered
        // past the new tail, no operation parked (the saved ones are continued from where they were
        // saved) and a recent spool mark, there is nothing new to save (a segment fully drained).
        // The ring's tail moves once the last state queued is durable (at once if it is).
        if self.delivered.is_empty()
            && !r.asm.has_parked()
            && self.saved_parked.0.is_empty()
            && r.asm.prior_deliveries().next().is_none()
            && !dict_changed
            && !stale
            && !cursors_moved
            && self.state_saved
            && !self.resave
            && !risk_changed
        {
            self.tail = self.tail.max(target);
            match self.saving.back() {
                Some(&(no, _)) => self.saving.push_back((no, self.tail)),
                None => r.consumer.commit(self.tail),
            }
            self.last_commit = Instant::now();
            self.dirty = false;
            return;
        }
        // What the ingest thread spends on it (the state's copy; the writer thread does the rest).
        let started = Instant::now();
        let label = r.label;
        if let Err(e) = self.save_state(&r, states, target.max(tail), spool_end, Parked::Now) {
            // Without saved state a restart could not interpret what lies before the tail: keep it.
            tracing::error!(segment = %label, error = %e, "cannot save resume state; not committing");
            lost.add(Loss::StateWriteFailed, 1);
            return;
        }
        if dict_changed {
            self.dict_changed = false;
            self.dict_saved_at = Instant::now();
            self.dict_save_cost = started.elapsed();
        }
        self.last_commit = Instant::now();
        self.dirty = false;
    }

    /// Queues the segment's resume state for a committed tail of `tail` (which becomes the
    /// segment's commit point): its dictionary, what it delivered past the tail, the operations in
    /// flight that began before it, and the spool position everything it spools later will follow.
    /// Its number ([`StateWriter::queue`]); the ring's tail moves to `tail` once it is durable.
    pub fn save_state(
        &mut self,
        r: &Reading<'_>,
        states: &mut StateWriter,
        tail: u64,
        spool_mark: Option<Position>,
        parked: Parked,
    ) -> std::io::Result<u64> {
        let mut delivered: Vec<(u64, u64, u8)> = self
            .delivered
            .iter()
            .map(|(id, (pos, f))| (*id, *pos, *f))
            .collect();
        delivered.extend(
            r.asm
                .prior_deliveries()
                .filter(|(id, _, _)| !self.delivered.contains_key(id)),
        );
        delivered.sort_unstable();
        let (parked, parked_upto) = match parked {
            Parked::Now => (r.asm.parked_ops(tail), r.read_upto),
            Parked::AsSaved => self.saved_parked.clone(),
        };
        let at_risk = self.passed.at_risk(self.acked.load(Ordering::Acquire));
        let st = SegmentState {
            segment: r.label.to_string(),
            tail,
            dictionary: r.asm.dictionary(),
            delivered,
            spool_mark,
            parked_upto: if parked.is_empty() { 0 } else { parked_upto },
            parked,
            at_risk,
        };
        let saved_parked = (st.parked.clone(), st.parked_upto);
        let no = states.queue(st)?;
        self.tail = tail;
        self.saving.push_back((no, tail));
        self.resave = false;
        self.state_saved = true;
        self.spool_mark = spool_mark;
        self.saved_parked = saved_parked;
        self.saved_at_risk = at_risk;
        Ok(no)
    }
}

/// Whether a state saved for a committed tail of `state_tail` applies to the consumer's segment,
/// after finishing its commit if a kill came between saving the state and committing the tail (the
/// state is saved first): the records up to `state_tail` were applied and what they completed
/// delivered, so the consumer skips them. A state past what the segment holds, or a segment that
/// cannot be read to it, does not apply.
fn finish_commit(consumer: &mut Consumer, state_tail: u64) -> bool {
    let tail = consumer.segment().tail();
    if state_tail <= tail {
        return true;
    }
    if state_tail > consumer.segment().head() {
        return false;
    }
    let (mut left, mut skipped) = (state_tail - tail, Vec::new());
    while left > 0 {
        match consumer.read_raw((left as usize).min(READ_CHUNK), &mut skipped) {
            Ok((_, skipped)) if !skipped.is_empty() => left -= skipped.len() as u64,
            _ => return false,
        }
    }
    consumer.commit(state_tail);
    true
}

/// Whether a segment's saved spool mark is missing or far enough behind the spool's `end` that the
/// state should be saved again (`end`: `None` without a spool).
fn mark_stale(mark: Option<Position>, end: Option<Position>) -> bool {
    match (mark, end) {
        (_, None) => false,
        (None, Some(_)) => true,
        (Some(m), Some(e)) => m.seq != e.seq || e.offset.saturating_sub(m.offset) > MARK_LAG,
    }
}

/// Adds the operations that `origins` (read back from the spool, the segment's own) show as
/// recorded to a restored `delivered` list; operations before `tail` are committed and never read
/// again, except the `parked` ones, which the restarted engine continues.
fn mark_recorded(
    delivered: &mut Vec<(u64, u64, u8)>,
    tail: u64,
    parked: &[resume::SavedOp],
    origins: Vec<Origin>,
) {
    let continued: HashSet<(u64, u64)> = parked.iter().map(|p| (p.id, p.first_pos)).collect();
    let mut known: HashMap<u64, usize> = delivered
        .iter()
        .enumerate()
        .map(|(i, d)| (d.0, i))
        .collect();
    for o in origins {
        if o.first_pos < tail && !continued.contains(&(o.op_id, o.first_pos)) {
            continue;
        }
        match known.get(&o.op_id) {
            Some(&i) => delivered[i].2 |= done::RECORDED,
            None => {
                known.insert(o.op_id, delivered.len());
                delivered.push((o.op_id, o.first_pos, done::RECORDED));
            }
        }
    }
}

/// Whether the segment's ring is over half full: the producer is about to drop records.
pub(super) fn ring_pressed(consumer: &Consumer) -> bool {
    let s = consumer.segment();
    // The head is the producer's word: saturating, so a head behind the tail is not "full".
    s.head().saturating_sub(s.tail()) > s.capacity() / 2
}

/// Which parked operations a saved state carries.
#[derive(Clone, Copy)]
pub(super) enum Parked {
    /// Those in flight now that began before the tail, as of the read position.
    Now,
    /// Those of the last save, as they were then (the tail has not moved since).
    AsSaved,
}

/// Spans queued for export and not yet acknowledged, in emit order (the exporter acknowledges a
/// prefix), with the first records of their operations counted: operations complete out of start
/// order (another communicator, a longer kernel), so the oldest emitted is not always the one whose
/// records come first, and the tail must wait on the latter.
#[derive(Default)]
pub(super) struct Unacked {
    /// (emit number, first record, op id).
    queue: VecDeque<(u64, u64, u64)>,
    first_pos: Positions,
}

impl Unacked {
    fn push(&mut self, emit_no: u64, first_pos: u64, op_id: u64) {
        self.queue.push_back((emit_no, first_pos, op_id));
        self.first_pos.add(first_pos);
    }

    /// The op id of the oldest span if the exporter acknowledged it (`acked` and all before).
    fn pop_acked(&mut self, acked: u64) -> Option<u64> {
        let &(emit_no, pos, id) = self.queue.front()?;
        if emit_no > acked {
            return None;
        }
        self.queue.pop_front();
        self.first_pos.remove(pos);
        Some(id)
    }

    fn oldest_pos(&self) -> Option<u64> {
        self.first_pos.oldest()
    }

    /// Stops waiting on spans whose operations' records lie before `pos` (a forced commit): their
    /// emit numbers.
    fn forget_before(&mut self, pos: u64) -> Vec<u64> {
        let mut passed = Vec::new();
        self.queue.retain(|&(emit_no, p, _)| {
            if p < pos {
                passed.push(emit_no);
            }
            p >= pos
        });
        self.first_pos.forget_before(pos);
        passed
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// Operations whose collective's root span is not settled yet ([`RootWait`]), in delivery order,
/// with their first records counted: the tail waits on the oldest. One settled behind one that is
/// not waits with it (a FIFO: the queue is bounded by what the ring holds before a forced commit).
#[derive(Default)]
pub(super) struct RootHolds {
    queue: VecDeque<(u64, RootWait)>,
    first_pos: Positions,
}

impl RootHolds {
    fn push(&mut self, first_pos: u64, wait: RootWait) {
        self.queue.push_back((first_pos, wait));
        self.first_pos.add(first_pos);
    }

    fn pop_settled(&mut self) {
        while let Some((pos, wait)) = self.queue.front()
            && wait.settled()
        {
            self.first_pos.remove(*pos);
            self.queue.pop_front();
        }
    }

    fn oldest_pos(&self) -> Option<u64> {
        self.first_pos.oldest()
    }

    /// Stops waiting on roots whose operations' records lie before `pos` (a forced commit): their
    /// settlements.
    fn forget_before(&mut self, pos: u64) -> Vec<RootWait> {
        let mut passed = Vec::new();
        self.queue.retain(|(p, wait)| {
            if *p < pos {
                passed.push(wait.clone());
            }
            *p >= pos
        });
        self.first_pos.forget_before(pos);
        passed
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// Spans (emit numbers) and roots whose records the tail passed before the receiver acknowledged
/// them (a forced commit): a daemon killed before it does cannot send them again. Each saved state
/// carries how many are still in flight ([`AtRisk`]), which a restarted engine counts.
#[derive(Default)]
pub(super) struct Passed {
    spans: Vec<u64>,
    roots: Vec<RootWait>,
}

impl Passed {
    /// A root passed unsettled, kept by the first segment to pass it (one count per collective).
    pub fn root(&mut self, wait: RootWait) {
        if !wait.settled() && wait.pass() {
            self.roots.push(wait);
        }
    }

    /// How many are still in flight, forgetting those acknowledged (up to `acked`) or settled.
    pub fn at_risk(&mut self, acked: u64) -> AtRisk {
        self.spans.retain(|&emit_no| emit_no > acked);
        self.roots.retain(|w| !w.settled());
        AtRisk {
            spans: self.spans.len() as u64,
            roots: self.roots.len() as u64,
        }
    }
}

/// First record positions a segment's tail waits on, each counted as often as it is waited on.
#[derive(Default)]
struct Positions(BTreeMap<u64, u32>);

impl Positions {
    fn add(&mut self, pos: u64) {
        *self.0.entry(pos).or_default() += 1;
    }

    fn remove(&mut self, pos: u64) {
        if let Some(n) = self.0.get_mut(&pos) {
            *n -= 1;
            if *n == 0 {
                self.0.remove(&pos);
            }
        }
    }

    fn oldest(&self) -> Option<u64> {
        self.0.keys().next().copied()
    }

    fn forget_before(&mut self, pos: u64) {
        self.0 = self.0.split_off(&pos);
    }
}
