//! The bounded pool that event handles come from.
//!
//! A handle given to NCCL is the address of a [`Slot`] in one preallocated array: no allocation per event,
//! and a handle can be validated before use (inside the array, on a slot boundary, slot live), so a
//! garbage pointer from the host is ignored instead of dereferenced. Every slot field is an atomic, so a
//! stale handle can at worst produce a wrong record, never undefined behaviour.
//!
//! Free slots are cached per thread ([`Cache`], two "magazines" of up to [`MAGAZINE`] slots, linked
//! through the slots themselves): an NCCL thread takes and returns slots without touching anything
//! another thread writes. Only a full magazine (or an empty one) goes to or comes from the process-wide
//! stack, one compare-and-swap per [`MAGAZINE`] slots (a Treiber stack of chains, with a tag against
//! ABA). A slot freed on another thread than the one that took it (NCCL's proxy thread releases the
//! Coll its KernelCh children belong to) simply joins that thread's cache. A thread that exits hands its
//! cache back ([`Pool::flush`]), so thousands of short-lived threads strand nothing.
//!
//! A Coll/P2p slot is reference-counted: one reference for NCCL's `stopEvent` and one per announced
//! KernelCh child (`nChannels`), because NCCL starts the KernelCh events after the Coll has stopped and
//! they must still find their parent's id. The count shares a word with the slot's generation, and every
//! change is a compare-and-swap within one generation, so a slot is freed exactly once per allocation
//! (by whoever takes its count to 0) and a late or stale release of an older generation does nothing.
//! Stopped operations whose announced children never all came are released by [`Pool::sweep`].

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Slots per process: in-flight Coll/P2p (until their last KernelCh started) plus in-flight kernel events.
pub const POOL_SLOTS: u32 = 1 << 16;
/// Slots per magazine: a thread holds at most two magazines.
pub const MAGAZINE: u32 = 32;

const FREE: u32 = 0;
const STOPPED: u32 = 0x100;

/// What a slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Kind {
    Coll = 1,
    P2p = 2,
    KernelCh = 3,
    KernelPhase = 4,
}

impl Kind {
    fn from_state(state: u32) -> Option<Kind> {
        Some(match state & 0xff {
            1 => Kind::Coll,
            2 => Kind::P2p,
            3 => Kind::KernelCh,
            4 => Kind::KernelPhase,
            _ => return None,
        })
    }

    pub fn is_op(self) -> bool {
        matches!(self, Kind::Coll | Kind::P2p)
    }
}

/// One event in flight. A cache line each, so threads working on neighbouring slots don't contend.
#[repr(C, align(64))]
#[derive(Default)]
pub struct Slot {
    state: AtomicU32,
    /// Free: the next slot of its chain (index + 1; 0 ends it).
    next_free: AtomicU32,
    /// generation << 32 | references.
    refs: AtomicU64,
    pub comm: AtomicU32,
    /// Channel in the low byte, KernelPhase id in the next.
    pub channel: AtomicU32,
    /// Kernel events: the id of the Coll/P2p they belong to.
    pub parent: AtomicU64,
    pub gpu_start: AtomicU64,
    /// Kernel events: the GPU stop time. Coll/P2p: the host time of their stopEvent.
    pub gpu_stop: AtomicU64,
    /// What this event's records must follow in the segment (a [`crate::lanes::Dep`]): an operation's
    /// own start record; a kernel event's operation's start record.
    pub dep: AtomicU64,
    /// Free, first of a chain on the process-wide stack: (next chain's first index + 1) << 32 | length.
    chain: AtomicU64,
}
const _: () = assert!(size_of::<Slot>() == 64);

/// A chain of free slots linked through `next_free`: `head` is index + 1 (0: empty).
#[derive(Clone, Copy, Default, Debug)]
struct Chain {
    head: u32,
    len: u32,
}

/// One thread's free slots: two magazines, so a thread that alternates taking and returning a slot
/// at a magazine's edge does not go to the shared stack every time.
#[derive(Default, Debug)]
pub struct Cache {
    loaded: Chain,
    spare: Chain,
}

impl Cache {
    pub const EMPTY: Cache = Cache {
        loaded: Chain { head: 0, len: 0 },
        spare: Chain { head: 0, len: 0 },
    };
}

pub struct Pool {
    slots: Box<[Slot]>,
    /// Top of the stack of free chains: tag << 32 | (first index + 1); 0 in the low half means empty.
    free: AtomicU64,
}

/// A live slot, found by [`Pool::lookup`] or [`Pool::alloc`].
#[derive(Clone, Copy)]
pub struct Live<'a> {
    pub index: u32,
    pub slot: &'a Slot,
    pub kind: Kind,
    generation: u32,
}

impl Live<'_> {
    /// Process-unique event id: slot index + the slot's generation, without a shared counter.
    pub fn id(&self) -> u64 {
        (self.generation as u64) << 32 | self.index as u64
    }

    /// Marks the event stopped; false if it already was (a repeated stopEvent). A load and a store, not
    /// a read-modify-write (one locked instruction less per event): while the stopping thread holds
    /// the reference the event was started with, nothing else writes its state (no free, no other
    /// stop but a racing duplicate from the host, whose record would carry an id already stopped).
    pub fn stop(&self) -> bool {
        let state = self.slot.state.load(Ordering::Acquire);
        if state & STOPPED != 0 {
            return false;
        }
        self.slot.state.store(state | STOPPED, Ordering::Release);
        true
    }
}

impl Pool {
    pub fn new(slots: u32) -> Pool {
        let pool = Pool {
            slots: (0..slots).map(|_| Slot::default()).collect(),
            free: AtomicU64::new(0),
        };
        // Full magazines on the stack, in index order (the stack hands out the last pushed first).
        let mut first = slots;
        while first > 0 {
            let from = first.saturating_sub(MAGAZINE);
            for i in from..first {
                let next = if i + 1 < first { i + 2 } else { 0 };
                pool.slots[i as usize]
                    .next_free
                    .store(next, Ordering::Relaxed);
            }
            pool.push_chain(Chain {
                head: from + 1,
                len: first - from,
            });
            first = from;
        }
        pool
    }

    /// Takes a free slot for an event of `kind` in `comm` holding `refs` references.
    pub fn alloc(&self, cache: &mut Cache, kind: Kind, comm: u32, refs: u32) -> Option<Live<'_>> {
        if cache.loaded.len == 0 {
            if cache.spare.len > 0 {
                std::mem::swap(&mut cache.loaded, &mut cache.spare);
            } else {
                cache.loaded = self.pop_chain()?;
            }
        }
        let index = cache.loaded.head - 1;
        let slot = &self.slots[index as usize];
        cache.loaded.head = slot.next_free.load(Ordering::Relaxed);
        cache.loaded.len -= 1;
        if cache.loaded.head == 0 {
            cache.loaded.len = 0; // a chain is never longer than its links
        }
        let generation = (slot.refs.load(Ordering::Relaxed) >> 32) as u32 + 1;
        slot.comm.store(comm, Ordering::Relaxed);
        slot.refs
            .store((generation as u64) << 32 | refs as u64, Ordering::Relaxed);
        slot.channel.store(0, Ordering::Relaxed);
        slot.parent.store(0, Ordering::Relaxed);
        slot.gpu_start.store(0, Ordering::Relaxed);
        slot.gpu_stop.store(0, Ordering::Relaxed);
        slot.dep.store(0, Ordering::Relaxed);
        slot.state.store(kind as u32, Ordering::Release);
        Some(Live {
            index,
            slot,
            kind,
            generation,
        })
    }

    /// The handle NCCL keeps for a slot.
    pub fn handle(&self, live: &Live<'_>) -> *mut c_void {
        live.slot as *const Slot as *mut c_void
    }

    /// The live slot behind `handle`, or None for anything that is not one of ours.
    pub fn lookup(&self, handle: *mut c_void) -> Option<Live<'_>> {
        let base = self.slots.as_ptr() as usize;
        let offset = (handle as usize).checked_sub(base)?;
        if !offset.is_multiple_of(size_of::<Slot>()) {
            return None;
        }
        let index = offset / size_of::<Slot>();
        let slot = self.slots.get(index)?;
        let kind = Kind::from_state(slot.state.load(Ordering::Acquire))?;
        let refs = slot.refs.load(Ordering::Acquire);
        if refs as u32 == 0 {
            return None;
        }
        Some(Live {
            index: index as u32,
            slot,
            kind,
            generation: (refs >> 32) as u32,
        })
    }

    /// Drops one reference of `live`'s generation; the last one frees the slot into `cache`. A release
    /// of an older generation, or of a slot already released to 0, does nothing.
    pub fn release(&self, cache: &mut Cache, live: &Live<'_>) {
        self.drop_refs(cache, live.index, live.generation, 1);
    }

    /// Frees `live` at once, whatever references it holds (an event declined after all).
    pub fn abandon(&self, cache: &mut Cache, live: &Live<'_>) {
        self.drop_refs(cache, live.index, live.generation, u32::MAX);
    }

    /// Takes up to `n` references of `generation` from slot `index`; frees it when the count reaches 0.
    /// Returns whether this call freed it.
    fn drop_refs(&self, cache: &mut Cache, index: u32, generation: u32, n: u32) -> bool {
        let slot = &self.slots[index as usize];
        let mut cur = slot.refs.load(Ordering::Acquire);
        loop {
            let refs = cur as u32;
            if (cur >> 32) as u32 != generation || refs == 0 {
                return false;
            }
            let new = (cur & !0xffff_ffff) | refs.saturating_sub(n) as u64;
            match slot
                .refs
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if new as u32 == 0 => {
                    self.free(cache, index);
                    return true;
                }
                Ok(_) => return false,
                Err(c) => cur = c,
            }
        }
    }

    fn free(&self, cache: &mut Cache, index: u32) {
        let slot = &self.slots[index as usize];
        slot.state.store(FREE, Ordering::Release);
        if cache.loaded.len >= MAGAZINE {
            if cache.spare.len > 0 {
                self.push_chain(cache.spare);
            }
            cache.spare = std::mem::take(&mut cache.loaded);
        }
        slot.next_free.store(cache.loaded.head, Ordering::Relaxed);
        cache.loaded.head = index + 1;
        cache.loaded.len += 1;
    }

    /// Hands every slot of `cache` back to the process-wide stack (a thread's end, or a cache used for
    /// one call).
    pub fn flush(&self, cache: &mut Cache) {
        for chain in [
            std::mem::take(&mut cache.loaded),
            std::mem::take(&mut cache.spare),
        ] {
            if chain.len > 0 {
                self.push_chain(chain);
            }
        }
    }

    fn push_chain(&self, chain: Chain) {
        let first = &self.slots[(chain.head - 1) as usize];
        let mut top = self.free.load(Ordering::Acquire);
        loop {
            first.chain.store(
                ((top as u32 as u64) << 32) | chain.len as u64,
                Ordering::Relaxed,
            );
            let new = ((top >> 32).wrapping_add(1) << 32) | chain.head as u64;
            match self
                .free
                .compare_exchange_weak(top, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(t) => top = t,
            }
        }
    }

    fn pop_chain(&self) -> Option<Chain> {
        let mut top = self.free.load(Ordering::Acquire);
        loop {
            let head = top as u32;
            if head == 0 {
                return None;
            }
            // Read before the CAS; if another thread took this chain meanwhile, the tag changed and the
            // CAS fails, so a stale value is never used.
            let link = self.slots[(head - 1) as usize]
                .chain
                .load(Ordering::Relaxed);
            let new = ((top >> 32).wrapping_add(1) << 32) | (link >> 32);
            match self
                .free
                .compare_exchange_weak(top, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Some(Chain {
                        head,
                        len: (link as u32).max(1),
                    });
                }
                Err(t) => top = t,
            }
        }
    }

    /// Frees every slot of a finalized communicator; returns how many events were started but never
    /// stopped. NCCL makes no more calls for the communicator, so nothing else touches these slots.
    pub fn reclaim(&self, comm: u32) -> u64 {
        let mut cache = Cache::default();
        let mut unfinished = 0;
        for (index, slot) in self.slots.iter().enumerate() {
            let state = slot.state.load(Ordering::Acquire);
            if state == FREE || slot.comm.load(Ordering::Relaxed) != comm {
                continue;
            }
            let generation = (slot.refs.load(Ordering::Acquire) >> 32) as u32;
            if self.drop_refs(&mut cache, index as u32, generation, u32::MAX)
                && state & STOPPED == 0
            {
                unfinished += 1;
            }
        }
        self.flush(&mut cache);
        unfinished
    }

    /// Releases Coll/P2p events stopped before `stopped_before_ns` (host time) that still wait for
    /// KernelCh children NCCL never started; returns how many. Runs on the forwarding thread.
    pub fn sweep(&self, stopped_before_ns: u64) -> u64 {
        let mut cache = Cache::default();
        let mut released = 0;
        for (index, slot) in self.slots.iter().enumerate() {
            let state = slot.state.load(Ordering::Acquire);
            let stopped = state & STOPPED != 0 && Kind::from_state(state).is_some_and(Kind::is_op);
            if !stopped {
                continue;
            }
            let refs = slot.refs.load(Ordering::Acquire);
            let stop_ns = slot.gpu_stop.load(Ordering::Relaxed);
            if stop_ns != 0
                && stop_ns < stopped_before_ns
                && self.drop_refs(&mut cache, index as u32, (refs >> 32) as u32, u32::MAX)
            {
                released += 1;
            }
        }
        self.flush(&mut cache);
        released
    }

    /// Slots in use (walks the pool).
    #[cfg(test)]
    pub fn in_use(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.state.load(Ordering::Relaxed) != FREE)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A repeated stopEvent is refused, and the event keeps its kind for the stop that counted.
    #[test]
    fn an_event_stops_once() {
        let mut c = Cache::default();
        let pool = Pool::new(2);
        let op = pool.alloc(&mut c, Kind::Coll, 1, 2).unwrap();
        let h = pool.handle(&op);
        assert!(pool.lookup(h).unwrap().stop());
        assert!(!pool.lookup(h).unwrap().stop(), "a second stop is refused");
        assert_eq!(pool.lookup(h).map(|l| l.kind), Some(Kind::Coll));
    }

    #[test]
    fn alloc_until_exhausted_then_reuse_with_a_new_id() {
        let mut c = Cache::default();
        let pool = Pool::new(4);
        let a: Vec<_> = (0..4)
            .map(|_| pool.alloc(&mut c, Kind::KernelCh, 1, 1).unwrap())
            .collect();
        assert!(pool.alloc(&mut c, Kind::KernelCh, 1, 1).is_none());
        let first_id = a[2].id();
        let h = pool.handle(&a[2]);
        pool.release(&mut c, &a[2]);
        assert!(pool.lookup(h).is_none(), "a freed handle is not live");
        let b = pool.alloc(&mut c, Kind::Coll, 2, 1).unwrap();
        assert_eq!(b.index, a[2].index);
        assert_ne!(b.id(), first_id);
        assert_eq!(pool.lookup(h).unwrap().kind, Kind::Coll);
    }

    #[test]
    fn garbage_handles_are_rejected_without_touching_them() {
        let mut c = Cache::default();
        let pool = Pool::new(4);
        let live = pool.alloc(&mut c, Kind::P2p, 0, 1).unwrap();
        let h = pool.handle(&live) as usize;
        for bad in [
            0usize,
            8,
            h + 1,
            h + 4 * 64,
            h.wrapping_sub(64),
            usize::MAX - 63,
        ] {
            assert!(pool.lookup(bad as *mut c_void).is_none(), "{bad:#x}");
        }
        assert!(pool.lookup(h as *mut c_void).is_some());
    }

    #[test]
    fn op_lives_until_stop_and_all_announced_children() {
        let mut c = Cache::default();
        let pool = Pool::new(2);
        let op = pool.alloc(&mut c, Kind::Coll, 0, 3).unwrap(); // stop + 2 children
        let h = pool.handle(&op);
        assert!(op.stop());
        assert!(!op.stop(), "second stop is refused");
        pool.release(&mut c, &op);
        pool.release(&mut c, &op);
        assert!(pool.lookup(h).is_some());
        pool.release(&mut c, &op);
        assert!(pool.lookup(h).is_none());
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn reclaim_frees_a_communicator_and_counts_unstopped() {
        let mut c = Cache::default();
        let pool = Pool::new(8);
        let a = pool.alloc(&mut c, Kind::KernelCh, 7, 1).unwrap();
        let b = pool.alloc(&mut c, Kind::Coll, 7, 5).unwrap();
        b.stop();
        let _c = pool.alloc(&mut c, Kind::Coll, 8, 1).unwrap();
        assert_eq!(pool.reclaim(7), 1, "only the KernelCh was never stopped");
        assert!(pool.lookup(pool.handle(&a)).is_none());
        assert_eq!(pool.in_use(), 1);
        assert_eq!(
            (0..7)
                .filter_map(|_| pool.alloc(&mut c, Kind::P2p, 1, 1))
                .count(),
            7
        );
    }

    #[test]
    fn a_stale_release_after_reuse_does_not_touch_the_new_event() {
        let mut c = Cache::default();
        let pool = Pool::new(1);
        let op = pool.alloc(&mut c, Kind::Coll, 0, 2).unwrap();
        let stale = op; // a child that looked the parent up
        assert!(op.stop());
        pool.release(&mut c, &op);
        pool.release(&mut c, &stale); // count 0: freed
        let again = pool.alloc(&mut c, Kind::KernelCh, 0, 1).unwrap();
        pool.release(&mut c, &stale); // an extra release of the old generation
        assert_eq!(
            pool.lookup(pool.handle(&again)).unwrap().kind,
            Kind::KernelCh,
            "still live"
        );
        pool.release(&mut c, &again);
        assert_eq!(pool.in_use(), 0);
        assert!(
            pool.alloc(&mut c, Kind::P2p, 0, 1).is_some()
                && pool.alloc(&mut c, Kind::P2p, 0, 1).is_none(),
            "freed once"
        );
    }

    #[test]
    fn sweep_releases_only_old_stopped_operations_waiting_for_children() {
        let mut c = Cache::default();
        let pool = Pool::new(4);
        let old = pool.alloc(&mut c, Kind::Coll, 0, 3).unwrap();
        old.stop();
        old.slot.gpu_stop.store(100, Ordering::Relaxed);
        pool.release(&mut c, &old);
        let young = pool.alloc(&mut c, Kind::P2p, 0, 2).unwrap();
        young.stop();
        young.slot.gpu_stop.store(500, Ordering::Relaxed);
        pool.release(&mut c, &young);
        let running = pool.alloc(&mut c, Kind::Coll, 0, 2).unwrap();
        let kernel = pool.alloc(&mut c, Kind::KernelCh, 0, 1).unwrap();
        assert_eq!(pool.sweep(200), 1);
        assert!(pool.lookup(pool.handle(&old)).is_none());
        for live in [young, running, kernel] {
            assert!(pool.lookup(pool.handle(&live)).is_some());
        }
        pool.release(&mut c, &old); // a child arriving after the sweep: nothing happens
        assert_eq!(pool.in_use(), 3);
    }

    #[test]
    fn concurrent_alloc_and_free_never_hand_out_a_slot_twice() {
        let pool = Pool::new(256);
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let pool = &pool;
                s.spawn(move || {
                    let mut c = Cache::default();
                    let mut held = Vec::new();
                    for n in 0..20_000 {
                        if let Some(l) = pool.alloc(&mut c, Kind::KernelCh, t, 1) {
                            l.slot.parent.store(t as u64, Ordering::Relaxed);
                            held.push(l);
                        }
                        std::hint::spin_loop();
                        // Release in bursts so magazines fill, spill and refill.
                        if n % 97 == 0 {
                            for l in held.drain(..) {
                                assert_eq!(
                                    l.slot.parent.load(Ordering::Relaxed),
                                    t as u64,
                                    "slot shared by two threads"
                                );
                                pool.release(&mut c, &l);
                            }
                        }
                    }
                    for l in held.drain(..) {
                        pool.release(&mut c, &l);
                    }
                    pool.flush(&mut c);
                });
            }
        });
        assert_eq!(pool.in_use(), 0);
        let mut c = Cache::default();
        assert_eq!(
            (0..300)
                .filter_map(|_| pool.alloc(&mut c, Kind::P2p, 0, 1))
                .count(),
            256,
            "every slot came back"
        );
    }

    #[test]
    fn a_slot_taken_on_one_thread_and_freed_on_another_comes_back() {
        let pool = Pool::new(2 * MAGAZINE);
        let mut app = Cache::default();
        for _ in 0..1000 {
            let live: Vec<_> = (0..MAGAZINE)
                .map(|_| pool.alloc(&mut app, Kind::Coll, 0, 1).expect("a slot"))
                .collect();
            // The "proxy thread" frees them into its own cache and ends.
            std::thread::scope(|s| {
                s.spawn(|| {
                    let mut proxy = Cache::default();
                    for l in &live {
                        pool.release(&mut proxy, l);
                    }
                    pool.flush(&mut proxy);
                });
            });
        }
        pool.flush(&mut app);
        assert_eq!(pool.in_use(), 0);
        let mut c = Cache::default();
        assert_eq!(
            (0..3 * MAGAZINE)
                .filter_map(|_| pool.alloc(&mut c, Kind::P2p, 0, 1))
                .count(),
            2 * MAGAZINE as usize
        );
    }
}
