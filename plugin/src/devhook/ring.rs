//! The ring protocol: how an event becomes a slot of flagged words, how a block of rings is laid out, and
//! how the drain walks a ring in sequence order, accepting only complete slots and counting overwritten
//! ones as lost. Layout constants come from [`super::layout`], the one source the CUDA hook is built from.
//!
//! The writer (GPU hook or [`cpu_hook`]) publishes without fences or atomics: each 8-byte word carries 4
//! bytes of the event and a 4-byte flag, so a reader that loads each word once sees, per word, either the
//! old or the new content, and accepts a slot only when all six flags name the sequence it expects.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::layout::{BLOCK_ALIGN, CTX_SHIFT_MASK, EVENT_BYTES, MAX_CHANNELS, SLOT_WORDS};

/// The RFC's `ncclProfilerDevEvent_t`, as NCCL's kernel passes it to the hook.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevEvent {
    /// `%globaltimer` nanoseconds.
    pub timestamp: u64,
    /// NCCL's per-channel work counter (advances for every work item, kept across kernels).
    pub work_counter: u64,
    pub func_id: u32,
    pub channel: u8,
    /// 0 START, 1 STOP.
    pub phase: u8,
    pub rsvd: u16,
}

const _: () = assert!(size_of::<DevEvent>() == EVENT_BYTES && align_of::<DevEvent>() == 8);
const _: () = assert!(std::mem::offset_of!(DevEvent, work_counter) == 8);
const _: () = assert!(std::mem::offset_of!(DevEvent, func_id) == 16);
const _: () = assert!(std::mem::offset_of!(DevEvent, channel) == 20);
const _: () = assert!(std::mem::offset_of!(DevEvent, phase) == 21);

pub const PHASE_START: u8 = 0;

/// One slot's words.
pub type Slot = [u64; SLOT_WORDS];

impl DevEvent {
    /// The event's slot sequence: `workCounter * 2 + phase` (the hook uses the phase's low bit).
    pub fn seq(&self) -> u64 {
        self.work_counter
            .wrapping_mul(2)
            .wrapping_add((self.phase & 1) as u64)
    }

    /// The slot words the hook stores for this event.
    pub fn slot(&self) -> Slot {
        let flag = (self.seq().wrapping_add(1) as u32 as u64) << 32;
        let d = [
            self.timestamp as u32,
            (self.timestamp >> 32) as u32,
            self.work_counter as u32,
            (self.work_counter >> 32) as u32,
            self.func_id,
            self.channel as u32 | (self.phase as u32) << 8 | (self.rsvd as u32) << 16,
        ];
        d.map(|x| x as u64 | flag)
    }

    fn from_slot(s: &Slot) -> DevEvent {
        let d = s.map(|w| w as u32);
        DevEvent {
            timestamp: d[0] as u64 | (d[1] as u64) << 32,
            work_counter: d[2] as u64 | (d[3] as u64) << 32,
            func_id: d[4],
            channel: d[5] as u8,
            phase: (d[5] >> 8) as u8,
            rsvd: (d[5] >> 16) as u16,
        }
    }
}

/// What a reader finds in the slot where it expects sequence `expected`.
#[derive(Debug, PartialEq, Eq)]
pub enum SlotState {
    /// The expected event, complete.
    Ready(DevEvent),
    /// A complete event with a later sequence: the writer lapped the reader.
    Later(DevEvent),
    /// Partial, being rewritten, or older content: not published yet.
    NotReady,
}

/// Classifies a slot's words (each loaded once) against the sequence the reader expects.
pub fn classify(s: &Slot, expected: u64) -> SlotState {
    let flag = (s[0] >> 32) as u32;
    if s.iter().any(|w| (w >> 32) as u32 != flag) {
        return SlotState::NotReady;
    }
    let ev = DevEvent::from_slot(s);
    let seq = ev.seq();
    if seq.wrapping_add(1) as u32 != flag {
        return SlotState::NotReady;
    }
    match seq.cmp(&expected) {
        std::cmp::Ordering::Equal => SlotState::Ready(ev),
        std::cmp::Ordering::Greater => SlotState::Later(ev),
        std::cmp::Ordering::Less => SlotState::NotReady,
    }
}

/// devCtx for a block at `base` (aligned to [`BLOCK_ALIGN`]) of rings of `2^shift` slots.
pub fn make_ctx(base: u64, shift: u32) -> *mut c_void {
    debug_assert!(base.is_multiple_of(BLOCK_ALIGN as u64) && (shift as usize) <= CTX_SHIFT_MASK);
    (base | shift as u64) as usize as *mut c_void
}

/// Splits devCtx into (block address, log2 slots per ring).
pub fn split_ctx(ctx: *mut c_void) -> (usize, u32) {
    let c = ctx as usize;
    (c & !CTX_SHIFT_MASK, (c & CTX_SHIFT_MASK) as u32)
}

/// Word index of `seq`'s slot in `channel`'s ring within a block of `2^shift`-slot rings.
pub fn slot_word_index(channel: usize, seq: u64, shift: u32) -> usize {
    let mask = (1u64 << shift) - 1;
    ((channel % MAX_CHANNELS) << shift | (seq & mask) as usize) * SLOT_WORDS
}

/// The CPU writer: performs exactly the device hook's stores, for simulation (`NCCLSCOPE_RING_MEMORY=cpu`)
/// and tests. The device writes each 16-byte line with one store; here each line is two 8-byte stores in
/// the same order, which keeps the property the protocol relies on: every 8-byte word is written whole.
///
/// # Safety
/// `ev` points to a valid event and `ctx` is a devCtx handed out for a CPU-memory block that is still
/// allocated.
pub unsafe extern "C" fn cpu_hook(ev: *const DevEvent, ctx: *mut c_void) {
    // SAFETY: the caller passes a valid event.
    let ev = unsafe { *ev };
    let (base, shift) = split_ctx(ctx);
    let at = slot_word_index(ev.channel as usize, ev.seq(), shift);
    let words = ev.slot();
    // The same three lines as cuda/hook.cu (whose weak stores may land in any order): 1, 2, then 0.
    for i in [2, 3, 4, 5, 0, 1] {
        let w = words[i];
        // SAFETY: the block holds MAX_CHANNELS rings of 2^shift slots and `at` indexes a slot in it; the
        // words are 8-byte aligned and only ever accessed atomically.
        unsafe { AtomicU64::from_ptr((base as *mut u64).add(at + i)).store(w, Relaxed) };
    }
}

/// A block of rings in plain, zeroed host memory (CPU simulation, and the tests of both placements).
pub struct HeapBlock {
    ptr: NonNull<u64>,
    shift: u32,
}

// SAFETY: the block is plain memory only accessed through atomics; ownership may move between threads.
unsafe impl Send for HeapBlock {}
// SAFETY: as above: shared access is atomic only (the writer and the reader may be different threads).
unsafe impl Sync for HeapBlock {}

impl HeapBlock {
    pub fn new(shift: u32) -> HeapBlock {
        let layout = Self::layout(shift);
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) } as *mut u64)
            .unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        HeapBlock { ptr, shift }
    }

    fn layout(shift: u32) -> Layout {
        let bytes = (MAX_CHANNELS << shift) * SLOT_WORDS * 8;
        Layout::from_size_align(bytes, BLOCK_ALIGN).expect("ring block layout")
    }

    pub fn ctx(&self) -> *mut c_void {
        make_ctx(self.ptr.as_ptr() as u64, self.shift)
    }

    pub fn words(&self) -> &[AtomicU64] {
        let len = (MAX_CHANNELS << self.shift) * SLOT_WORDS;
        // SAFETY: the allocation holds `len` aligned u64 words for the block's lifetime; AtomicU64 has
        // u64's layout and every access goes through it.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr() as *const AtomicU64, len) }
    }
}

impl Drop for HeapBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { dealloc(self.ptr.as_ptr() as *mut u8, Self::layout(self.shift)) };
    }
}

/// Loads `seq`'s slot of `channel` from a block read in place, one 8-byte load per word.
pub fn load_in_place(words: &[AtomicU64], channel: usize, seq: u64, shift: u32) -> Slot {
    let at = slot_word_index(channel, seq, shift);
    std::array::from_fn(|i| words[at + i].load(Relaxed))
}

/// Where a ring's events go: paired work items and the counts of what could not be delivered.
pub trait Deliver {
    fn work(&mut self, channel: u8, start: &DevEvent, stop: &DevEvent);
}

/// Loss found while reading; the drain adds it to the segment's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Events overwritten before they were read ([`ncclscope_proto::Counter::DevLost`]).
    pub lost: u64,
    /// START or STOP events delivered without their other half (`DevUnpaired`).
    pub unpaired: u64,
}

/// The first sequence of a fresh ring: NCCL's first work item on a channel has workCounter 1.
pub const FIRST_SEQ: u64 = 2;

/// A reader's position in one ring.
#[derive(Clone, Debug)]
pub struct RingCursor {
    /// The sequence expected next.
    pub next: u64,
    /// A START waiting for its STOP (the event at `next - 1`).
    pending: Option<DevEvent>,
}

impl Default for RingCursor {
    fn default() -> RingCursor {
        RingCursor {
            next: FIRST_SEQ,
            pending: None,
        }
    }
}

impl RingCursor {
    /// Reads forward from `next` through complete slots, at most `budget` of them. `load(seq)` gives the
    /// words of the slot where `seq` lives (None: not available to this pass). Returns how far the cursor
    /// moved: slots consumed plus slots found overwritten.
    pub fn advance(
        &mut self,
        channel: u8,
        slots: u64,
        budget: usize,
        mut load: impl FnMut(u64) -> Option<Slot>,
        out: &mut impl Deliver,
        tally: &mut Tally,
    ) -> usize {
        let (from, mut done) = (self.next, 0);
        while done < budget {
            let Some(words) = load(self.next) else { break };
            match classify(&words, self.next) {
                SlotState::Ready(ev) => {
                    self.deliver(channel, ev, out, tally);
                    self.next += 1;
                    done += 1;
                }
                SlotState::Later(ev) => {
                    // The writer lapped us: everything before the oldest sequence the ring can still
                    // hold is gone, and with it the STOP of a pending START.
                    let oldest = ev.seq() - slots + 1;
                    tally.lost += oldest - self.next;
                    if self.pending.take().is_some() {
                        tally.unpaired += 1;
                    }
                    self.next = oldest;
                }
                SlotState::NotReady => break,
            }
        }
        (self.next - from) as usize
    }

    fn deliver(&mut self, channel: u8, ev: DevEvent, out: &mut impl Deliver, tally: &mut Tally) {
        if ev.phase & 1 == PHASE_START {
            if self.pending.replace(ev).is_some() {
                tally.unpaired += 1;
            }
        } else {
            match self.pending.take() {
                Some(start) if start.work_counter == ev.work_counter => {
                    out.work(channel, &start, &ev)
                }
                Some(_) => tally.unpaired += 2,
                None => tally.unpaired += 1,
            }
        }
    }

    /// No more events will come: a pending START stays unpaired.
    pub fn close(&mut self, tally: &mut Tally) {
        if self.pending.take().is_some() {
            tally.unpaired += 1;
        }
    }
}
