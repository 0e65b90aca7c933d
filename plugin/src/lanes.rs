//! The queues from NCCL's threads to the forwarding thread: one lane per thread.
//!
//! A thread takes a free lane at its first event and keeps it until it exits (`profiler`'s thread-local
//! state gives it back); a lane and what is queued in it outlive the thread, so a thread that exits with
//! events queued loses none of them, and the next thread to take the lane queues behind them.
//!
//! Only the lane's holder pushes ([`Held`] is the proof) and one consumer at a time pops (the
//! forwarding thread, or an exiting process's last thread, under the consumer's lock), so a lane is a
//! single-producer single-consumer ring: a push is a slot write and a release store of the lane's own
//! count, with no atomic read-modify-write (crossbeam's multi-producer `ArrayQueue`, here before, took
//! a fifth of an NCCL thread's time in the plugin; this push takes under a tenth), and an NCCL thread
//! never writes a cache line that another NCCL thread writes. A full lane drops the event and the
//! caller counts it; a thread that finds no free lane ([`MAX_LANES`] threads hold one) borrows one for
//! the call, or drops and counts: nothing spins or blocks.
//!
//! Order. Each lane is FIFO. Across lanes, an event that must follow others carries up to two [`Dep`]s:
//! the lane and position of an event it must follow. Every event of a communicator follows the
//! communicator's previous event (the communicator keeps where its latest one was queued), so one
//! communicator's records reach the segment in the order NCCL's threads produced them, as with one
//! shared queue; a kernel event or an OpStop also follows its operation's start (kept in the pool slot:
//! this holds even when the communicator's chain was overtaken by a racing thread), and `CommEnd`
//! follows everything queued before it in any lane ([`Dep::ALL`]). The forwarding thread, before handing
//! an event on, drains the lanes it depends on up to those positions. Positions count every event a
//! lane ever accepted, so a dependency stays valid after its lane changed owner. The daemon's assembler
//! relies on this: a KernelCh whose operation it has not seen is not joined, an OpStop without its
//! start is ignored, p2p operations are numbered in their communicator's order, and device-hook work
//! joins its communicator's operations in launch order. Records of different communicators may
//! interleave differently than they were produced.

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::event::Event;

/// Lanes per process: NCCL threads that hold one at a time (application threads, one proxy thread and,
/// from NCCL 2.31, one profiler thread per communicator). A lane's queue is allocated when a thread first
/// takes it and kept for the life of the process.
pub const MAX_LANES: usize = 128;
/// Events queued per lane.
pub const LANE_EVENTS: usize = 8192;

/// The event a queued event must follow: lane + 1 in the top 16 bits, its position (1-based) below.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dep(u64);

impl Dep {
    pub const NONE: Dep = Dep(0);
    /// Everything queued in any lane before it (a communicator's end).
    pub const ALL: Dep = Dep(u64::MAX);

    fn new(lane: usize, pos: u64) -> Dep {
        Dep(((lane as u64 + 1) << 48) | pos)
    }

    /// As stored in an atomic (pool slots, communicators).
    pub fn raw(self) -> u64 {
        self.0
    }

    pub fn from_raw(raw: u64) -> Dep {
        Dep(raw)
    }

    /// (lane, position), for a dependency on one event.
    fn target(self) -> Option<(usize, u64)> {
        let lane = (self.0 >> 48) as usize;
        (self != Dep::ALL && lane > 0).then_some((lane - 1, self.0 & ((1 << 48) - 1)))
    }
}

struct Item {
    event: Event,
    deps: [Dep; 2],
}
// Every push writes one: a cache line and a half (rare, large events are boxed, see `Event::Comm`).
const _: () = assert!(size_of::<Item>() <= 96);

/// A lane a thread holds, from [`Lanes::claim`] to [`Lanes::release`]: neither `Clone` nor `Copy`, so
/// one thread at a time pushes to a lane.
#[derive(Debug, PartialEq, Eq)]
pub struct Held(usize);

/// The producer's cache line: events the lane accepted, ever, and the consumer's count as the producer
/// last read it (so a push reads the consumer's line only when the lane looks full).
#[repr(align(64))]
#[derive(Default)]
struct ProducerLine {
    pushed: AtomicU64,
    popped_seen: AtomicU64,
}

/// The consumer's cache line: events taken out, ever, and the producer's count as the consumer last read
/// it (so a pop reads the producer's line, which every push writes, once per batch, not per event).
#[repr(align(64))]
#[derive(Default)]
struct ConsumerLine {
    popped: AtomicU64,
    pushed_seen: AtomicU64,
}

type Slot = UnsafeCell<MaybeUninit<Item>>;

#[derive(Default)]
struct Lane {
    owned: AtomicBool,
    /// The ring: event `pos` (0-based, counted ever) in slot `pos % LANE_EVENTS`.
    slots: OnceLock<Box<[Slot]>>,
    producer: ProducerLine,
    consumer: ConsumerLine,
}

// SAFETY: a slot is written only by the lane's holder (one thread at a time: `Held`, handed between
// threads through `owned`'s release and acquire) while it is free (`pushed - popped < LANE_EVENTS`),
// and read only by the consumer (one at a time: the `Consumer` mutex) once `pushed` covers it. The
// release store of `pushed` after a write and its acquire load before the read order the two; the
// release store of `popped` after a read and its acquire load before the slot's next write order those.
unsafe impl Sync for Lane {}

impl Lane {
    /// Writes `item` as the next event (`Err` when the lane is full); its position, 1-based.
    fn push(&self, _: &Held, item: Item) -> Result<u64, Item> {
        let Some(slots) = self.slots.get() else {
            return Err(item);
        };
        let pos = self.producer.pushed.load(Ordering::Relaxed);
        if pos - self.producer.popped_seen.load(Ordering::Relaxed) >= LANE_EVENTS as u64 {
            let popped = self.consumer.popped.load(Ordering::Acquire);
            self.producer.popped_seen.store(popped, Ordering::Relaxed);
            if pos - popped >= LANE_EVENTS as u64 {
                return Err(item);
            }
        }
        let slot = &slots[(pos % LANE_EVENTS as u64) as usize];
        // SAFETY: the caller holds the lane (`Held`), so no other thread writes; the slot is free (the
        // consumer read it before the `popped` we acquired, or never held it), so none reads it.
        unsafe { (*slot.get()).write(item) };
        self.producer.pushed.store(pos + 1, Ordering::Release);
        Ok(pos + 1)
    }

    /// Takes the oldest event out, if any; the `Consumer` borrow is the consumer's mutex held.
    fn pop(&self, _: &mut Consumer) -> Option<Item> {
        let slots = self.slots.get()?;
        let line = &self.consumer;
        let pos = line.popped.load(Ordering::Relaxed);
        if pos == line.pushed_seen.load(Ordering::Relaxed) {
            let pushed = self.producer.pushed.load(Ordering::Acquire);
            line.pushed_seen.store(pushed, Ordering::Relaxed);
            if pos == pushed {
                return None;
            }
        }
        let slot = &slots[(pos % LANE_EVENTS as u64) as usize];
        // SAFETY: a `pushed` acquired by this or an earlier consumer (the mutex orders those) covers the
        // slot, so its write is complete and visible; the producer does not write it again before
        // `popped` passes it, and we are the only consumer.
        let item = unsafe { (*slot.get()).assume_init_read() };
        line.popped.store(pos + 1, Ordering::Release);
        Some(item)
    }

    fn is_empty(&self) -> bool {
        self.producer.pushed.load(Ordering::Acquire) == self.consumer.popped.load(Ordering::Relaxed)
    }
}

impl Drop for Lane {
    /// Drops the events still queued (their communicator names).
    fn drop(&mut self) {
        let Some(slots) = self.slots.get_mut() else {
            return;
        };
        let (from, to) = (
            *self.consumer.popped.get_mut(),
            *self.producer.pushed.get_mut(),
        );
        for pos in from..to {
            // SAFETY: `&mut self`: no other thread; positions between popped and pushed were written
            // and not read.
            unsafe {
                slots[(pos % LANE_EVENTS as u64) as usize]
                    .get_mut()
                    .assume_init_drop()
            };
        }
    }
}

/// The consumer's side (the forwarding thread; at exit, the exiting thread), one at a time.
struct Consumer {
    /// Where the next [`Lanes::drain`] starts, so no lane waits behind busy ones.
    cursor: usize,
    /// Lanes with an event taken out and not yet handed on (while its dependencies are drained).
    busy: Vec<bool>,
}

pub struct Lanes {
    lanes: Box<[Lane]>,
    consumer: Mutex<Consumer>,
}

impl Default for Lanes {
    fn default() -> Self {
        Lanes::new()
    }
}

impl Lanes {
    pub fn new() -> Lanes {
        Lanes {
            lanes: (0..MAX_LANES).map(|_| Lane::default()).collect(),
            consumer: Mutex::new(Consumer {
                cursor: 0,
                busy: vec![false; MAX_LANES],
            }),
        }
    }

    /// Takes a free lane for the calling thread (until [`Lanes::release`]); None if all are held.
    pub fn claim(&self) -> Option<Held> {
        let at = self.lanes.iter().position(|lane| {
            let free = !lane.owned.load(Ordering::Relaxed)
                && lane
                    .owned
                    .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok();
            if free {
                lane.slots.get_or_init(|| {
                    (0..LANE_EVENTS)
                        .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
                        .collect()
                });
            }
            free
        })?;
        Some(Held(at))
    }

    /// Gives a lane back; what it holds stays queued.
    pub fn release(&self, lane: Held) {
        self.lanes[lane.0].owned.store(false, Ordering::Release);
    }

    /// Queues `event` after `deps` in `lane`. Returns the event's own position (a dependency for later
    /// events), or the event back when the lane is full.
    #[inline(always)]
    pub fn push(&self, lane: &Held, event: Event, deps: [Dep; 2]) -> Result<Dep, Event> {
        match self.lanes[lane.0].push(lane, Item { event, deps }) {
            Ok(pos) => Ok(Dep::new(lane.0, pos)),
            Err(item) => Err(item.event),
        }
    }

    /// Events queued in `lane` (approximate while the consumer runs).
    pub fn depth(&self, lane: &Held) -> u64 {
        let l = &self.lanes[lane.0];
        (l.producer.pushed.load(Ordering::Relaxed))
            .saturating_sub(l.consumer.popped.load(Ordering::Relaxed))
    }

    /// Whether every lane is empty.
    pub fn is_empty(&self) -> bool {
        self.lanes.iter().all(Lane::is_empty)
    }

    fn consumer(&self) -> std::sync::MutexGuard<'_, Consumer> {
        self.consumer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes up to about `limit` events out (a few more when dependencies pull them in), each after the
    /// events it depends on, and hands them to `f` in that order. Returns how many.
    pub fn drain(&self, limit: usize, f: &mut dyn FnMut(Event)) -> usize {
        let mut c = self.consumer();
        let mut n = 0;
        let start = c.cursor;
        for k in 0..MAX_LANES {
            let lane = (start + k) % MAX_LANES;
            while n < limit && self.pop_one(&mut c, lane, f, 0, &mut n) {}
            if n >= limit {
                c.cursor = (lane + 1) % MAX_LANES;
                return n;
            }
        }
        n
    }

    /// Takes out every event queued so far (and those their dependencies pull in), in order.
    pub fn drain_all(&self, f: &mut dyn FnMut(Event)) -> usize {
        let mut c = self.consumer();
        let mut n = 0;
        self.satisfy(&mut c, Dep::ALL, f, 0, &mut n);
        n
    }

    /// Takes out and drops everything queued; returns how many (the caller counts them lost).
    pub fn discard_all(&self) -> u64 {
        let mut c = self.consumer();
        let mut n = 0;
        for l in self.lanes.iter() {
            while l.pop(&mut c).is_some() {
                n += 1;
            }
        }
        n
    }

    /// Takes one event out of `lane` and hands it on after its dependencies; false if there is none
    /// (or the lane is busy further up the dependency chain: what it still holds came later).
    fn pop_one(
        &self,
        c: &mut Consumer,
        lane: usize,
        f: &mut dyn FnMut(Event),
        depth: usize,
        n: &mut usize,
    ) -> bool {
        let l = &self.lanes[lane];
        if c.busy[lane] {
            return false;
        }
        let Some(item) = l.pop(c) else {
            return false;
        };
        *n += 1;
        c.busy[lane] = true;
        for dep in item.deps {
            self.satisfy(c, dep, f, depth + 1, n);
        }
        c.busy[lane] = false;
        f(item.event);
        true
    }

    /// Hands on what `dep` names, if it is still queued.
    fn satisfy(
        &self,
        c: &mut Consumer,
        dep: Dep,
        f: &mut dyn FnMut(Event),
        depth: usize,
        n: &mut usize,
    ) {
        // Dependencies point at events queued earlier, so a chain cannot be longer than the lanes; the
        // bound only guards against a corrupted dependency.
        if dep == Dep::NONE || depth > MAX_LANES + 1 {
            return;
        }
        let mut drain_to = |c: &mut Consumer, lane: usize, pos: u64, n: &mut usize| {
            let popped = &self.lanes[lane].consumer.popped;
            while popped.load(Ordering::Relaxed) < pos && self.pop_one(c, lane, f, depth, n) {}
        };
        match dep.target() {
            Some((lane, pos)) if lane < MAX_LANES => drain_to(c, lane, pos, n),
            Some(_) => {}
            None => {
                for lane in 0..MAX_LANES {
                    let now = self.lanes[lane].producer.pushed.load(Ordering::Acquire);
                    drain_to(c, lane, now, n);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclscope_proto::Record;

    fn ev(id: u64) -> Event {
        Event::Ready(Record::OpStop {
            comm: 0,
            id,
            host_ns: 0,
        })
    }

    fn id(e: &Event) -> u64 {
        match e {
            Event::Ready(Record::OpStop { id, .. }) => *id,
            _ => u64::MAX,
        }
    }

    #[test]
    fn an_event_follows_its_dependency_in_another_lane_and_each_lane_stays_fifo() {
        let lanes = Lanes::new();
        let (a, b) = (lanes.claim().unwrap(), lanes.claim().unwrap());
        assert_ne!(a, b);
        // b's events come first in drain order (lane order), but 11 depends on a's 2.
        let d1 = lanes.push(&a, ev(1), [Dep::NONE; 2]).unwrap();
        let d2 = lanes.push(&a, ev(2), [d1, Dep::NONE]).unwrap();
        lanes.push(&b, ev(10), [Dep::NONE; 2]).unwrap();
        lanes.push(&b, ev(11), [Dep::NONE, d2]).unwrap();
        lanes.push(&a, ev(3), [Dep::NONE; 2]).unwrap();
        let mut out = Vec::new();
        // Start draining at b's lane.
        lanes.consumer().cursor = b.0;
        lanes.drain(100, &mut |e| out.push(id(&e)));
        assert_eq!(out, [10, 1, 2, 11, 3]);
        assert!(lanes.is_empty());
    }

    #[test]
    fn a_barrier_follows_everything_queued_before_it_but_not_later_events_of_its_lane() {
        let lanes = Lanes::new();
        let (a, b) = (lanes.claim().unwrap(), lanes.claim().unwrap());
        lanes.push(&a, ev(1), [Dep::NONE; 2]).unwrap();
        lanes.push(&b, ev(2), [Dep::ALL, Dep::NONE]).unwrap();
        lanes.push(&b, ev(3), [Dep::NONE; 2]).unwrap();
        lanes.push(&a, ev(4), [Dep::NONE; 2]).unwrap();
        lanes.consumer().cursor = b.0;
        let mut out = Vec::new();
        lanes.drain(100, &mut |e| out.push(id(&e)));
        assert_eq!(out, [1, 4, 2, 3]);
    }

    #[test]
    fn a_released_lane_keeps_its_events_and_positions_for_the_next_owner() {
        let lanes = Lanes::new();
        let a = lanes.claim().unwrap();
        let d = lanes.push(&a, ev(1), [Dep::NONE; 2]).unwrap();
        let at = a.0;
        lanes.release(a);
        let again = lanes.claim().unwrap();
        assert_eq!(again.0, at, "the first free lane is reused");
        let d2 = lanes.push(&again, ev(2), [d, Dep::NONE]).unwrap();
        assert_ne!(d, d2);
        let mut out = Vec::new();
        lanes.drain_all(&mut |e| out.push(id(&e)));
        assert_eq!(out, [1, 2]);
    }

    #[test]
    fn a_full_lane_gives_the_event_back() {
        let lanes = Lanes::new();
        let a = lanes.claim().unwrap();
        for i in 0..LANE_EVENTS as u64 {
            lanes.push(&a, ev(i), [Dep::NONE; 2]).unwrap();
        }
        assert!(lanes.push(&a, ev(0), [Dep::NONE; 2]).is_err());
        assert_eq!(lanes.depth(&a), LANE_EVENTS as u64);
        assert_eq!(lanes.discard_all(), LANE_EVENTS as u64);
        assert_eq!(lanes.depth(&a), 0);
    }

    /// The ring under a concurrent consumer: a lane wraps around many times, changes holder between
    /// threads mid-stream, and every event comes out once, in order (a push that finds the lane full
    /// is retried).
    #[test]
    fn a_lane_handed_between_threads_wraps_around_under_a_concurrent_consumer() {
        const N: u64 = 40 * LANE_EVENTS as u64;
        let lanes = Lanes::new();
        let done = AtomicBool::new(false);
        let out = std::thread::scope(|s| {
            let consumer = s.spawn(|| {
                let mut out = Vec::with_capacity(N as usize);
                while !done.load(Ordering::Acquire) || !lanes.is_empty() {
                    lanes.drain(1000, &mut |e| out.push(id(&e)));
                }
                out
            });
            let mut next = 0;
            // Four producer threads in turn, each holding the lane for a quarter of the events.
            for quarter in 1..=4 {
                let lanes = &lanes;
                next = s
                    .spawn(move || {
                        let lane = lanes.claim().unwrap();
                        while next < quarter * N / 4 {
                            if lanes.push(&lane, ev(next), [Dep::NONE; 2]).is_ok() {
                                next += 1;
                            }
                        }
                        lanes.release(lane);
                        next
                    })
                    .join()
                    .unwrap();
            }
            done.store(true, Ordering::Release);
            consumer.join().unwrap()
        });
        assert_eq!(out.len() as u64, N);
        assert!(out.iter().enumerate().all(|(i, &id)| id == i as u64));
    }
}
