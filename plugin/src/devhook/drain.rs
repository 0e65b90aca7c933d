//! One communicator's rings and the drain that turns them into records: paired START/STOP as
//! [`Record::DevWork`], losses as counters, new funcIds as [`Record::FuncName`].
//!
//! Two ways to read a block: in place (CPU memory, and pinned host-mapped memory that the GPU writes
//! over PCIe), or staged (device memory: a window of each ring is copied out with the copy engine, then
//! decoded from the copy). Both use the same cursor logic; the staged windows adapt to each ring's rate.

use std::sync::atomic::AtomicU64;

use ncclscope_proto::{Counter, Record};

use super::layout::{MAX_CHANNELS, SLOT_WORDS};
use super::ring::{Deliver, DevEvent, RingCursor, Slot, Tally, load_in_place};
use crate::sink::Sink;

/// Copies ring windows out of memory the host cannot read in place (the `device` placement).
pub trait CopyOut: Send {
    /// Queues a copy of `words` 8-byte words from word `src` of the block to word `dst` of the staging area.
    fn queue(&mut self, src: usize, dst: usize, words: usize);
    /// Waits for the queued copies; the staging area, or None when the copy failed (nothing is consumed).
    fn complete(&mut self) -> Option<&[u64]>;
}

/// Where a block's words are read.
pub enum Memory {
    /// Host-readable words (plain memory, or pinned host-mapped memory). The owner keeps them alive.
    InPlace {
        words: *const AtomicU64,
        _owner: Box<dyn Send>,
    },
    /// Device memory, read through copies into a staging area of `MAX_CHANNELS * max_window` slots.
    Staged {
        copy: Box<dyn CopyOut>,
        max_window: usize,
    },
}

// SAFETY: `words` points into memory owned by `owner`, which is Send; it is only read through atomics.
unsafe impl Send for Memory {}

/// Smallest window (slots) a staged ring is copied with while idle.
const MIN_WINDOW: usize = 8;
/// Most slots one ring delivers per drain call, so one busy ring cannot starve the others.
const BUDGET: usize = 4096;
/// Slots read from each ring in turn (in-place rings): a kernel's work items on all its channels land
/// close together in the segment, so the daemon completes an operation, and commits past it, without
/// waiting behind whole rings of other channels (at 64 channels, 64 x BUDGET records apart would not
/// fit a segment).
const ROUND: usize = 32;
/// Most copy rounds of a staged block per drain call.
const ROUNDS: usize = 4;
/// A staged ring with no progress for this many drain calls in a row is copied only every
/// `IDLE_PROBE`-th call until it moves again (its ring absorbs the wait).
const IDLE_AFTER: u32 = 4;
const IDLE_PROBE: u32 = 8;

/// One communicator's block of rings and the drain's position in each.
pub struct CommRings {
    pub comm: u32,
    pub cuda_dev: i32,
    shift: u32,
    mem: Memory,
    cursors: Vec<RingCursor>,
    /// Staged placement: slots copied per ring, passes without progress, calls left to skip.
    windows: Vec<usize>,
    idle: Vec<u32>,
    skip: Vec<u32>,
}

impl CommRings {
    pub fn new(comm: u32, cuda_dev: i32, shift: u32, mem: Memory) -> CommRings {
        CommRings {
            comm,
            cuda_dev,
            shift,
            mem,
            cursors: vec![RingCursor::default(); MAX_CHANNELS],
            windows: vec![MIN_WINDOW; MAX_CHANNELS],
            idle: vec![0; MAX_CHANNELS],
            skip: vec![0; MAX_CHANNELS],
        }
    }

    pub fn slots(&self) -> u64 {
        1 << self.shift
    }

    /// Reads every ring once; returns how far the cursors moved (slots consumed or found overwritten).
    pub fn drain(&mut self, out: &mut Emitter<'_>) -> usize {
        let slots = self.slots();
        let shift = self.shift;
        let mut total = 0;
        let mut tally = Tally::default();
        out.comm = self.comm;
        match &mut self.mem {
            Memory::InPlace { words, .. } => {
                let len = (MAX_CHANNELS << shift) * SLOT_WORDS;
                // SAFETY: `words` is the block's `len` words, kept alive by `owner`.
                let words = unsafe { std::slice::from_raw_parts(*words, len) };
                let mut moved = [0usize; MAX_CHANNELS];
                loop {
                    let mut round = 0;
                    for (ch, cursor) in self.cursors.iter_mut().enumerate() {
                        let budget = BUDGET.saturating_sub(moved[ch]).min(ROUND);
                        if budget == 0 {
                            continue;
                        }
                        let load = |seq| Some(load_in_place(words, ch, seq, shift));
                        let n = cursor.advance(ch as u8, slots, budget, load, out, &mut tally);
                        moved[ch] += n;
                        round += n;
                    }
                    total += round;
                    if round == 0 {
                        break;
                    }
                }
            }
            Memory::Staged { copy, max_window } => {
                // Which rings to copy this call: idle rings only every IDLE_PROBE-th call (most of the 64
                // channels are often unused; each copy is a driver call).
                let mut active = [false; MAX_CHANNELS];
                for (ch, a) in active.iter_mut().enumerate() {
                    *a = self.skip[ch] == 0;
                    self.skip[ch] = self.skip[ch].saturating_sub(1);
                }
                // Copy rounds while some ring filled its window (bounded): such a ring is probably
                // behind, its window grows fourfold, and only such rings are copied again.
                let max_window = (*max_window).min(slots as usize);
                for _ in 0..ROUNDS {
                    for (ch, cursor) in self
                        .cursors
                        .iter()
                        .enumerate()
                        .filter(|(ch, _)| active[*ch])
                    {
                        let len = self.windows[ch].min(max_window);
                        let dst = ch * max_window * SLOT_WORDS;
                        let first = (cursor.next & (slots - 1)) as usize;
                        let head = len.min(slots as usize - first);
                        let ring = (ch << shift) * SLOT_WORDS;
                        copy.queue(ring + first * SLOT_WORDS, dst, head * SLOT_WORDS);
                        if head < len {
                            copy.queue(ring, dst + head * SLOT_WORDS, (len - head) * SLOT_WORDS);
                        }
                    }
                    let Some(staging) = copy.complete() else {
                        out.copy_failures += 1;
                        break;
                    };
                    let mut behind = false;
                    for (ch, cursor) in self.cursors.iter_mut().enumerate() {
                        if !active[ch] {
                            continue;
                        }
                        let len = self.windows[ch].min(max_window);
                        let start = cursor.next;
                        let base = ch * max_window * SLOT_WORDS;
                        let load = |seq: u64| {
                            let i = seq.checked_sub(start).filter(|&i| i < len as u64)? as usize;
                            let at = base + i * SLOT_WORDS;
                            Some(Slot::try_from(&staging[at..at + SLOT_WORDS]).expect("slot words"))
                        };
                        let moved = cursor.advance(ch as u8, slots, len, load, out, &mut tally);
                        let full = moved >= len;
                        active[ch] = full;
                        behind |= full;
                        self.windows[ch] =
                            if full { len * 4 } else { moved * 2 }.clamp(MIN_WINDOW, max_window);
                        self.idle[ch] = if moved == 0 { self.idle[ch] + 1 } else { 0 };
                        if self.idle[ch] >= IDLE_AFTER {
                            self.skip[ch] = IDLE_PROBE - 1;
                        }
                        total += moved;
                    }
                    if !behind {
                        break;
                    }
                }
            }
        }
        out.add(tally);
        total
    }

    /// The communicator is gone: nothing more will be written, so a START still waiting is unpaired.
    /// Drains until nothing more is complete (bounded: a kernel may still be writing), idle rings
    /// included; for finalize.
    pub fn drain_all(&mut self, out: &mut Emitter<'_>) {
        for _ in 0..1024 {
            self.skip.fill(0);
            if self.drain(out) == 0 {
                break;
            }
        }
    }

    pub fn close(&mut self, out: &mut Emitter<'_>) {
        let mut tally = Tally::default();
        for cursor in &mut self.cursors {
            cursor.close(&mut tally);
        }
        out.add(tally);
    }

    /// The memory, for the owner to free or retire.
    pub fn into_memory(self) -> Memory {
        self.mem
    }
}

/// Receives a drain pass's output: records into the sink, loss into the segment's counters; a funcId
/// not seen before is named (`FuncName`) before its first work item, so the daemon can check the
/// items it attributes against it (a pass can last as long as items keep coming).
pub struct Emitter<'a> {
    pub sink: &'a mut dyn Sink,
    comm: u32,
    /// Records pushed.
    pub records: usize,
    /// funcIds seen in this process, as a bitmap (NCCL's funcId is 15 bits).
    seen: &'a mut [u64],
    /// Staged copies that failed (each pass that failed consumed nothing).
    pub copy_failures: u64,
    tally: Tally,
}

/// Words of the funcId bitmap.
pub const FUNC_BITMAP_WORDS: usize = (1 << 15) / 64;

impl<'a> Emitter<'a> {
    pub fn new(sink: &'a mut dyn Sink, seen: &'a mut [u64]) -> Emitter<'a> {
        Emitter {
            sink,
            comm: 0,
            records: 0,
            seen,
            copy_failures: 0,
            tally: Tally::default(),
        }
    }

    fn add(&mut self, t: Tally) {
        self.tally.lost += t.lost;
        self.tally.unpaired += t.unpaired;
    }

    /// Adds the loss seen so far to the sink's counters (once per pass, not per event).
    pub fn flush_counts(&mut self) {
        let t = std::mem::take(&mut self.tally);
        if t.lost > 0 {
            self.sink.count(Counter::DevLost, t.lost);
        }
        if t.unpaired > 0 {
            self.sink.count(Counter::DevUnpaired, t.unpaired);
        }
    }
}

impl Deliver for Emitter<'_> {
    fn work(&mut self, channel: u8, start: &DevEvent, stop: &DevEvent) {
        let func_id = start.func_id;
        let (word, bit) = ((func_id as usize / 64) % FUNC_BITMAP_WORDS, func_id % 64);
        if self.seen[word] & (1 << bit) == 0 && func_id < (1 << 15) {
            self.seen[word] |= 1 << bit;
            if let Some(name) = super::func_name(func_id) {
                let name = self.sink.intern(&name);
                self.sink.push(&Record::FuncName { func_id, name });
                self.records += 1;
            }
        }
        self.sink.push(&Record::DevWork {
            comm: self.comm,
            channel,
            func_id,
            work_counter: start.work_counter,
            gpu_start: start.timestamp,
            gpu_stop: stop.timestamp,
        });
        self.records += 1;
    }
}
