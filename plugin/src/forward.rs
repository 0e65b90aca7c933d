//! The forwarding thread ("ncclscope-fwd"): the segment's only producer.
//!
//! NCCL threads push [`Event`]s into their own bounded lane (`lanes`) and return; this thread takes them
//! out in an order that keeps every event after the ones it depends on, turns them into
//! records (interning NCCL's static strings on the way), drains the device-hook rings, flushes the loss
//! counters into the segment header, heartbeats the segment and hands it to the daemon (again after a
//! daemon restart). When there
//! is nothing to do it sleeps, 1 ms growing to 20 ms; NCCL threads wake it early when their lane fills
//! up. It empties the lanes from its first moment; for the first millisecond, until the TSC rate is
//! measured, the events wait in the thread's own buffer.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ncclscope_proto::{Counter, Producer, Record, StrId};

use crate::clock::Converter;
use crate::devhook;
use crate::event::{CText, Event};
use crate::profiler::{self, ORPHAN_AGE, Plugin};
use crate::register::Registration;
use crate::sink::Sink;

/// How often the handle pool is swept for operations whose KernelCh children never came.
const SWEEP_PERIOD: Duration = Duration::from_secs(1);
const MIN_IDLE: Duration = Duration::from_millis(1);
const MAX_IDLE: Duration = Duration::from_millis(20);
/// Longest the last communicator's end waits for a daemon to take the segment (within NCCL's
/// `finalize` wait, [`crate::profiler`]'s 2 s).
const REGISTER_SETTLE: Duration = Duration::from_secs(1);
/// Events handled per batch before the thread looks at the device rings and the heartbeat again.
const BATCH: usize = 4096;
/// Events held while the TSC rate is measured (the first millisecond).
const EARLY_EVENTS: usize = 1 << 15;
/// Device-hook records held back while the host events queued before them are written (see `run`);
/// reaching it writes them early, in the same order.
const HELD: usize = 8192;

/// `record` with its `host_ns`, a [`crate::clock::stamp`] taken on an NCCL thread, in CLOCK_REALTIME.
fn host_time(mut record: Record, clock: &Converter) -> Record {
    match &mut record {
        Record::Comm { host_ns, .. }
        | Record::CollStart { host_ns, .. }
        | Record::P2pStart { host_ns, .. }
        | Record::OpStop { host_ns, .. }
        | Record::KernelCh { host_ns, .. }
        | Record::CommEnd { host_ns, .. } => *host_ns = clock.to_ns(*host_ns),
        _ => {}
    }
    record
}

/// Interned strings: by pointer first (NCCL's strings are static), then by content. foldhash, not
/// SipHash: the pointer lookup runs four times per collective, and SipHash made it a quarter of the
/// forwarding thread's time.
#[derive(Default)]
struct Interner {
    by_ptr: HashMap<usize, StrId, foldhash::fast::RandomState>,
    by_text: HashMap<Vec<u8>, StrId, foldhash::fast::RandomState>,
}

impl Interner {
    fn intern(&mut self, text: &[u8], out: &mut Producer) -> StrId {
        if let Some(id) = self.by_text.get(text) {
            return *id;
        }
        let Ok(next) = u16::try_from(self.by_text.len() + 1) else {
            out.segment().count(Counter::StrTableFull, 1);
            return StrId(0);
        };
        let id = StrId(next);
        // A definition lost to a full ring is not cached, so the string is sent again next time.
        if !out.push(&Record::str(id, text)) {
            return StrId(0);
        }
        self.by_text.insert(text.to_vec(), id);
        id
    }

    fn intern_static(&mut self, text: CText, out: &mut Producer) -> StrId {
        if text.addr() == 0 {
            return StrId(0);
        }
        if let Some(id) = self.by_ptr.get(&text.addr()) {
            return *id;
        }
        let id = self.intern(text.bytes().unwrap_or_default(), out);
        if id != StrId(0) {
            self.by_ptr.insert(text.addr(), id);
        }
        id
    }
}

pub struct Forwarder {
    plugin: &'static Plugin,
    producer: Producer,
    strings: Interner,
    registration: Registration,
    sweep_due: Instant,
    /// NCCL threads' stamps -> CLOCK_REALTIME.
    clock: Converter,
    /// Events taken out of the lanes before the clock could convert their stamps (the first ms).
    early: Vec<Event>,
    /// While the rings are drained: their records, written after the host events queued before them.
    holding: bool,
    held: Vec<Record>,
}

impl Sink for Forwarder {
    fn push(&mut self, record: &Record) {
        if !self.holding {
            self.producer.push(record);
            return;
        }
        self.held.push(*record);
        if self.held.len() >= HELD {
            self.release_held();
            self.holding = true;
        }
    }

    fn intern(&mut self, text: &[u8]) -> StrId {
        self.strings.intern(text, &mut self.producer)
    }

    fn count(&mut self, counter: Counter, n: u64) {
        self.producer.segment().count(counter, n);
    }
}

impl Forwarder {
    pub fn new(plugin: &'static Plugin, producer: Producer) -> Forwarder {
        let registration = Registration::new(plugin.config.socket.clone());
        Forwarder {
            plugin,
            producer,
            strings: Interner::default(),
            registration,
            sweep_due: Instant::now() + SWEEP_PERIOD,
            clock: Converter::start(),
            early: Vec::new(),
            holding: false,
            held: Vec::with_capacity(HELD),
        }
    }

    /// Writes every event queued so far, then the held ring records. An operation's host event is
    /// queued before its kernel is launched, so every work item read from a ring follows the
    /// CollStart / P2pStart of its operation in the segment: the daemon can tell an eager launch's
    /// work from a graph replay's by what it has already read.
    fn release_held(&mut self) {
        self.holding = false;
        if self.held.is_empty() {
            return;
        }
        let mut held = std::mem::take(&mut self.held);
        // Everything queued before the rings were read (and what NCCL threads added meanwhile, up to
        // where each lane was when this pass looked at it).
        let plugin = self.plugin;
        plugin.lanes.drain_all(&mut |event| {
            if matches!(event, Event::CommEnd { .. }) {
                // Its end drains the communicator's rings again: the older records go first.
                for r in held.drain(..) {
                    self.producer.push(&r);
                }
            }
            self.forward(event);
        });
        for r in held.drain(..) {
            self.producer.push(&r);
        }
        self.held = held;
    }

    /// The thread's body; runs for the life of the process. A panic in it latches the plugin off (every
    /// entry point returns at once, `finalize` included) and is counted in the segment, which is then
    /// closed; the thread lives on only to keep the segment with a daemon (the segment ends with the
    /// process that holds it), so the daemon drains what was written and reports the loss.
    pub fn run(mut self) {
        if catch_unwind(AssertUnwindSafe(|| self.forward_forever())).is_ok() {
            return;
        }
        profiler::fail("the forwarding thread");
        let lost = 1 + self.early.len() as u64 + self.plugin.lanes.discard_all();
        let segment = self.producer.segment();
        segment.count(Counter::ForwardPanic, lost);
        self.plugin.flush_counters(segment);
        segment.close();
        let _ = catch_unwind(AssertUnwindSafe(|| {
            loop {
                self.registration
                    .poll(Instant::now(), self.producer.segment().fd());
                std::thread::sleep(MAX_IDLE * 5);
            }
        }));
    }

    fn forward_forever(&mut self) {
        let mut idle = MIN_IDLE;
        let mut forwarded = 0u64;
        loop {
            // First: a daemon that is there gets the segment before anything else can go wrong.
            self.registration
                .poll(Instant::now(), self.producer.segment().fd());
            self.clock.tick(Instant::now());
            if !self.clock.ready() {
                // The lanes are emptied from the first moment; the events wait here for the clock
                // (and the rings for them: a work item follows its operation's host event).
                let room = EARLY_EVENTS.saturating_sub(self.early.len());
                if room > 0 {
                    let early = &mut self.early;
                    self.plugin
                        .lanes
                        .drain(room, &mut |event| early.push(event));
                }
                std::thread::sleep(Duration::from_micros(100));
                continue;
            }
            for event in std::mem::take(&mut self.early) {
                self.forward(event);
            }
            let plugin = self.plugin;
            let mut work = plugin.lanes.drain(BATCH, &mut |event| self.forward(event));
            forwarded += work as u64;
            if let Some(n) = self.plugin.config.test_panic_forward
                && forwarded >= n
            {
                panic!("NCCLSCOPE_TEST_PANIC=forward:{n}: panicking after {forwarded} events");
            }
            self.holding = true;
            work += devhook::drain(self);
            self.release_held();
            self.plugin.flush_counters(self.producer.segment());
            self.producer.segment().beat();
            let now = Instant::now();
            if now >= self.sweep_due {
                self.plugin.sweep(self.clock.stamp_ago(ORPHAN_AGE));
                self.sweep_due = now + SWEEP_PERIOD;
            }
            if work > 0 {
                idle = MIN_IDLE;
                continue;
            }
            self.plugin.fwd_idle.store(true, Ordering::SeqCst);
            if self.plugin.lanes.is_empty() {
                std::thread::park_timeout(idle);
            }
            self.plugin.fwd_idle.store(false, Ordering::SeqCst);
            idle = (idle * 2).min(MAX_IDLE);
        }
    }

    fn forward(&mut self, event: Event) {
        let record = match event {
            Event::Comm(c) => Record::Comm {
                comm: c.comm,
                comm_hash: c.comm_hash,
                rank: c.rank,
                nranks: c.nranks,
                nnodes: c.nnodes,
                cuda_dev: c.cuda_dev,
                name: match c.name.is_empty() {
                    true => StrId(0),
                    false => self.intern(&c.name),
                },
                nccl_version: self.plugin.host.version.unwrap_or(0),
                path: c.path,
                host_ns: c.host_ns,
                gpu: c.gpu,
            },
            Event::CommEnd {
                comm,
                table,
                host_ns,
            } => {
                devhook::finalize_comm(comm, &mut *self);
                let host_ns = self.clock.to_ns(host_ns);
                self.producer.push(&Record::CommEnd { comm, host_ns });
                if self.plugin.live_comms() == 0 {
                    self.registration
                        .settle(self.producer.segment().fd(), REGISTER_SETTLE);
                }
                self.plugin.comm_ended(table, self.producer.segment());
                return;
            }
            Event::CollStart {
                comm,
                id,
                seq,
                func,
                datatype,
                algo,
                proto,
                count,
                root,
                n_channels,
                n_warps,
                host_ns,
                captured,
            } => Record::CollStart {
                comm,
                id,
                seq,
                func: self.strings.intern_static(func, &mut self.producer),
                datatype: self.strings.intern_static(datatype, &mut self.producer),
                algo: self.strings.intern_static(algo, &mut self.producer),
                proto: self.strings.intern_static(proto, &mut self.producer),
                count,
                root,
                n_channels,
                n_warps,
                host_ns,
                captured,
            },
            Event::P2pStart {
                comm,
                id,
                func,
                datatype,
                count,
                peer,
                n_channels,
                host_ns,
                captured,
            } => Record::P2pStart {
                comm,
                id,
                func: self.strings.intern_static(func, &mut self.producer),
                datatype: self.strings.intern_static(datatype, &mut self.producer),
                count,
                peer,
                n_channels,
                host_ns,
                captured,
            },
            Event::Ready(record) => record,
        };
        self.producer.push(&host_time(record, &self.clock));
    }
}
