//! The plugin's process-wide state and what each NCCL callback does with an event once the entry point
//! (`entry.rs`) has read it out of NCCL's descriptor.
//!
//! Hot path (startEvent / stopEvent / recordEventState): validate the handle, take or return a pool slot
//! from the thread's own cache, push one [`Event`] into the thread's own lane. No lock, no allocation, no
//! syscall (timestamps are TSC reads, see `clock`), no cache line written by another NCCL thread; a full
//! pool or lane drops the event and counts it.

use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use ncclscope_proto::segment::Segment;
use ncclscope_proto::{Counter, Gpu, Record, TimingPath};

use crate::abi::{MaskSlot, event};
use crate::clock;
use crate::config::Config;
use crate::devhook;
use crate::event::{CText, CommEvent, Event};
use crate::host::{self, HostInfo};
use crate::lanes::{Dep, Held, LANE_EVENTS, Lanes};
use crate::pool::{Cache, Kind, POOL_SLOTS, Pool};

/// Lane depth at which an NCCL thread wakes the sleeping forwarding thread.
const WAKE_DEPTH: u64 = LANE_EVENTS as u64 / 4;
/// Communicators alive at once in one process.
pub const MAX_COMMS: usize = 1024;
/// How long a stopped Coll/P2p may wait for its announced KernelCh children before [`Plugin::sweep`]
/// releases it. Generous: a kernel can sit behind other work on its stream for a long time.
pub const ORPHAN_AGE: Duration = Duration::from_secs(30);
/// How long `finalize` waits for the forwarding thread to write the communicator's end.
const FINALIZE_WAIT: Duration = Duration::from_secs(2);
/// How long `exit` waits, in a process that did not finalize its communicators, for the forwarding
/// thread to write what is queued.
const EXIT_WAIT: Duration = Duration::from_millis(200);

/// The handle returned for Group events: they carry nothing we forward, so they take no pool slot.
static GROUP_HANDLE: u8 = 0;

pub fn group_handle() -> *mut c_void {
    &GROUP_HANDLE as *const u8 as *mut c_void
}

/// The handles returned for API events (GroupApi, CollApi, P2pApi), one per value of their
/// `graphCaptured`: NCCL makes the CollApi / P2pApi handle the `parentObj` of the Coll / P2p, which is
/// how that operation is known to be captured into a CUDA graph. No pool slot: nothing to forward.
static API_HANDLES: [u8; 2] = [0; 2];

fn api_handle(captured: bool) -> *mut c_void {
    &API_HANDLES[captured as usize] as *const u8 as *mut c_void
}

/// The handle of every captured Coll / P2p. Its kernels run at each graph replay, long after capture,
/// and nothing is to be joined to the capture itself: no pool slot, so a replay's KernelCh (stock NCCL)
/// names this handle rather than a slot that a later operation may have taken.
static CAPTURED_OP: u8 = 0;

fn captured_op_handle() -> *mut c_void {
    &CAPTURED_OP as *const u8 as *mut c_void
}

/// Whether `handle` is one of the static handles above (stop and state calls on them do nothing).
fn is_static(handle: *mut c_void) -> bool {
    handle == group_handle()
        || handle == api_handle(false)
        || handle == api_handle(true)
        || handle == captured_op_handle()
}

/// One communicator (the `context` NCCL keeps between `init` and `finalize`).
#[derive(Default)]
struct CommSlot {
    live: AtomicBool,
    id: AtomicU32,
    announced: AtomicBool,
    ended: AtomicBool,
    comm_hash: AtomicU64,
    rank: AtomicU32,
    nranks: AtomicU32,
    nnodes: AtomicU32,
    name: Mutex<Vec<u8>>,
    /// Its GPU as the driver named it at `init`, on NCCL's init thread (the thread whose current
    /// context is the communicator's).
    gpu: Mutex<Option<Gpu>>,
    /// Where its latest event was queued (a [`Dep`]): the next one follows it, so the daemon reads a
    /// communicator's records in the order NCCL's threads produced them (see `lanes`). On its own cache
    /// line: written at every event, by the threads of this communicator only.
    last: PaddedU64,
}

#[repr(align(64))]
#[derive(Default)]
struct PaddedU64(AtomicU64);

impl CommSlot {
    /// What the communicator's next event must follow.
    fn last(&self) -> Dep {
        Dep::from_raw(self.last.0.load(Ordering::Acquire))
    }

    /// The communicator's latest event was queued `at`.
    fn advance(&self, at: Dep) {
        if at != Dep::NONE {
            self.last.0.store(at.raw(), Ordering::Release);
        }
    }
}

/// An NCCL thread's own state: its lane and its free slots. Given back when the thread exits.
pub(crate) struct Local {
    plugin: Option<&'static Plugin>,
    lane: Option<Held>,
    cache: Cache,
}

impl Local {
    const fn new() -> Local {
        Local {
            plugin: None,
            lane: None,
            cache: Cache::EMPTY,
        }
    }
}

impl Drop for Local {
    /// Thread exit: the free slots go back to the pool, the lane (with what it still holds, which the
    /// forwarding thread drains as usual) to the lanes. Never unwinds.
    fn drop(&mut self) {
        let Some(plugin) = self.plugin.take() else {
            return;
        };
        let (lane, cache) = (self.lane.take(), &mut self.cache);
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            plugin.pool.flush(cache);
            if let Some(lane) = lane {
                plugin.lanes.release(lane);
            }
        }));
    }
}

/// A Coll read from its descriptor.
pub struct CollInfo {
    pub seq: u64,
    pub func: CText,
    pub datatype: CText,
    pub algo: CText,
    pub proto: CText,
    pub count: u64,
    pub root: i32,
    pub n_channels: u8,
    pub n_warps: u8,
}

/// A P2p read from its descriptor.
pub struct P2pInfo {
    pub func: CText,
    pub datatype: CText,
    pub count: u64,
    pub peer: i32,
    pub n_channels: u8,
}

impl CollInfo {
    fn event(&self, comm: u32, id: u64, host_ns: u64, captured: bool) -> Event {
        Event::CollStart {
            comm,
            id,
            seq: self.seq,
            func: self.func,
            datatype: self.datatype,
            algo: self.algo,
            proto: self.proto,
            count: self.count,
            root: self.root,
            n_channels: self.n_channels,
            n_warps: self.n_warps,
            host_ns,
            captured,
        }
    }
}

impl P2pInfo {
    fn event(&self, comm: u32, id: u64, host_ns: u64, captured: bool) -> Event {
        Event::P2pStart {
            comm,
            id,
            func: self.func,
            datatype: self.datatype,
            count: self.count,
            peer: self.peer,
            n_channels: self.n_channels,
            host_ns,
            captured,
        }
    }
}

/// A `startEvent`, read from its descriptor.
pub enum Start {
    Group,
    /// GroupApi, CollApi or P2pApi, with its `graphCaptured`.
    Api {
        captured: bool,
    },
    Coll(CollInfo),
    P2p(P2pInfo),
    KernelCh {
        channel: u8,
        p_timer: u64,
    },
    KernelPhase {
        channel: u8,
        phase: u8,
        p_timer: u64,
    },
    /// A type this plugin does not handle (or does not know).
    Other,
}

pub struct Plugin {
    pub config: Config,
    pub host: HostInfo,
    pool: Pool,
    comms: Box<[CommSlot]>,
    next_comm: AtomicU32,
    live_comms: AtomicU32,
    pub(crate) lanes: Lanes,
    /// Losses counted on NCCL threads, moved into the segment header by the forwarding thread.
    pending: [AtomicU64; Counter::ALL.len()],
    /// NCCL's activation mask (one global int for all communicators) and the value we want in it.
    mask_ptr: MaskSlot,
    mask: AtomicI32,
    fwd: OnceLock<Thread>,
    pub(crate) fwd_idle: AtomicBool,
    /// Ids of captured operations (they take no pool slot): bit 31 set, which pool ids never have.
    next_captured: AtomicU64,
}

/// None: disabled (NCCLSCOPE_DISABLE, or the segment could not be set up).
pub(crate) static PLUGIN: OnceLock<Option<&'static Plugin>> = OnceLock::new();
/// Set on the first panic caught at the C boundary: every entry point then returns at once.
static FAILED: AtomicBool = AtomicBool::new(false);
/// Set in a child forked after the plugin started (e.g. a data-loader worker): the forwarding thread
/// does not exist there and the segment belongs to the parent, so the plugin stays out of the way.
pub(crate) static FORKED: AtomicBool = AtomicBool::new(false);

/// At `exit` (atexit handler): see [`Plugin::flush_at_exit`]. Never unwinds into libc.
pub(crate) extern "C" fn flush_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(p) = plugin() {
            p.flush_at_exit();
        }
    });
}

pub(crate) extern "C" fn forked_child() {
    FORKED.store(true, Ordering::Relaxed);
    // The daemon learns that the process ended when its connection closes: a child must not keep it.
    crate::register::close_inherited_connection();
}

thread_local! {
    /// The communicator whose `init` ran last on this thread: NCCL calls `getDeviceHook` right after it.
    static LAST_INIT: Cell<Option<u32>> = const { Cell::new(None) };
    /// This thread's lane and free slots.
    static LOCAL: RefCell<Local> = const { RefCell::new(Local::new()) };
}

/// The plugin, if it is running.
pub fn plugin() -> Option<&'static Plugin> {
    if FAILED.load(Ordering::Relaxed) || FORKED.load(Ordering::Relaxed) {
        return None;
    }
    PLUGIN.get().copied().flatten()
}

/// Whether a panic latched the plugin off.
fn failed() -> bool {
    FAILED.load(Ordering::Relaxed)
}

/// Latches the plugin off after a panic: clears NCCL's mask so the event callbacks stop coming.
pub fn fail(what: &str) {
    if !FAILED.swap(true, Ordering::SeqCst) {
        if let Some(p) = PLUGIN.get().copied().flatten() {
            p.set_mask(0);
        }
        host::log(
            true,
            &format!("internal error in {what}; profiling disabled for this process"),
        );
    }
}

impl Plugin {
    /// The process-wide state, before its forwarding thread starts (see `launch`).
    pub(crate) fn new(config: Config, host: HostInfo) -> Plugin {
        Plugin {
            mask: AtomicI32::new(config.event_mask),
            config,
            host,
            pool: Pool::new(POOL_SLOTS),
            comms: (0..MAX_COMMS).map(|_| CommSlot::default()).collect(),
            next_comm: AtomicU32::new(0),
            live_comms: AtomicU32::new(0),
            lanes: Lanes::new(),
            pending: Default::default(),
            mask_ptr: MaskSlot::new(),
            fwd: OnceLock::new(),
            fwd_idle: AtomicBool::new(false),
            next_captured: AtomicU64::new(0),
        }
    }

    /// The forwarding thread, so NCCL's threads can wake it.
    pub(crate) fn set_forwarder(&self, thread: Thread) {
        let _ = self.fwd.set(thread);
    }

    /// Where NCCL's activation mask lives (given at every `init`).
    pub(crate) fn set_mask_ptr(&self, mask: Option<&'static AtomicI32>) {
        self.mask_ptr.set(mask);
    }

    /// Writes the mask we want into NCCL's (again: a later `init` may pass a new address).
    pub(crate) fn apply_mask(&self) {
        self.set_mask(self.mask.load(Ordering::Relaxed));
    }

    /// Stores `value` in NCCL's activation mask (shared by all communicators; NCCL reads it atomically).
    pub fn set_mask(&self, value: i32) {
        self.mask.store(value, Ordering::Relaxed);
        self.mask_ptr.store(value);
    }

    pub fn count(&self, counter: Counter) {
        self.pending[counter as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Moves the counts taken on NCCL threads into the segment header (forwarding thread).
    pub fn flush_counters(&self, segment: &Segment) {
        for c in Counter::ALL {
            let n = self.pending[c as usize].swap(0, Ordering::Relaxed);
            if n > 0 {
                segment.count(c, n);
            }
        }
    }

    /// Runs `f` with this thread's [`Local`] (taking a lane at the thread's first event). A thread
    /// whose thread-local state is gone (it is exiting) or that holds no lane (all taken) borrows a free
    /// lane for the call, and its slots go back to the pool at once.
    fn with_local<R>(&'static self, f: impl FnOnce(&mut Local) -> R) -> R {
        let mut f = Some(f);
        let done = LOCAL
            .try_with(|local| {
                let mut local = local.try_borrow_mut().ok()?;
                let plugin = *local.plugin.get_or_insert(self);
                if !std::ptr::eq(plugin, self) {
                    return None;
                }
                if local.lane.is_none() {
                    local.lane = Some(self.lanes.claim()?);
                }
                f.take().map(|f| f(&mut local))
            })
            .ok()
            .flatten();
        if let Some(r) = done {
            return r;
        }
        let mut borrowed = Local::new();
        borrowed.lane = self.lanes.claim();
        let r = (f.take().expect("not called yet"))(&mut borrowed);
        self.pool.flush(&mut borrowed.cache);
        if let Some(lane) = borrowed.lane.take() {
            self.lanes.release(lane);
        }
        r
    }

    /// Queues `event` after `deps` in the thread's lane; returns its position (what later events that
    /// must follow it depend on), or [`Dep::NONE`] when it was dropped (counted).
    #[inline(always)]
    fn push(&self, local: &mut Local, event: Event, deps: [Dep; 2]) -> Dep {
        let Some(lane) = &local.lane else {
            self.count(Counter::QueueFull);
            return Dep::NONE;
        };
        let Ok(at) = self.lanes.push(lane, event, deps) else {
            self.count(Counter::QueueFull);
            return Dep::NONE;
        };
        if self.fwd_idle.load(Ordering::Relaxed)
            && self.lanes.depth(lane) >= WAKE_DEPTH
            && self.fwd_idle.swap(false, Ordering::SeqCst)
        {
            self.wake();
        }
        at
    }

    fn wake(&self) {
        if let Some(t) = self.fwd.get() {
            t.unpark();
        }
    }

    pub(crate) fn open_comm(
        &'static self,
        comm_hash: u64,
        name: Vec<u8>,
        nnodes: c_int,
        nranks: c_int,
        rank: c_int,
    ) -> *mut c_void {
        let Some((index, slot)) = self.comms.iter().enumerate().find(|(_, s)| {
            s.live
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        }) else {
            host::log_once(
                "comm-table-full",
                true,
                &format!("more than {MAX_COMMS} communicators; not profiling the rest"),
            );
            return std::ptr::null_mut();
        };
        let id = self.next_comm.fetch_add(1, Ordering::Relaxed);
        slot.id.store(id, Ordering::Relaxed);
        slot.comm_hash.store(comm_hash, Ordering::Relaxed);
        slot.rank.store(rank as u32, Ordering::Relaxed);
        slot.nranks.store(nranks as u32, Ordering::Relaxed);
        slot.nnodes.store(nnodes as u32, Ordering::Relaxed);
        if let Ok(mut n) = slot.name.lock() {
            *n = name;
        }
        if let Ok(mut g) = slot.gpu.lock() {
            *g = devhook::current_gpu();
        }
        slot.ended.store(false, Ordering::Relaxed);
        slot.last.0.store(0, Ordering::Relaxed);
        slot.announced.store(false, Ordering::Release);
        self.live_comms.fetch_add(1, Ordering::AcqRel);
        LAST_INIT.set(Some(index as u32));
        // On an RFC host the timing path is known once `getDeviceHook` has run; announce then.
        if !self.host.is_rfc() {
            let cuda_dev = devhook::calibrate_current_device();
            self.with_local(|l| self.announce(l, slot, TimingPath::KernelCh, cuda_dev));
        }
        slot as *const CommSlot as *mut c_void
    }

    /// Queues the communicator's [`Record::Comm`], once.
    fn announce(&self, local: &mut Local, slot: &CommSlot, path: TimingPath, cuda_dev: i32) {
        if slot.announced.swap(true, Ordering::AcqRel) {
            return;
        }
        let name = slot.name.lock().map(|n| n.clone()).unwrap_or_default();
        let gpu = slot.gpu.lock().map(|g| *g).unwrap_or_default();
        let event = Event::Comm(Box::new(CommEvent {
            comm: slot.id.load(Ordering::Relaxed),
            comm_hash: slot.comm_hash.load(Ordering::Relaxed),
            rank: slot.rank.load(Ordering::Relaxed),
            nranks: slot.nranks.load(Ordering::Relaxed),
            nnodes: slot.nnodes.load(Ordering::Relaxed),
            cuda_dev,
            name,
            path,
            host_ns: clock::stamp(),
            gpu,
        }));
        let at = self.push(local, event, [Dep::NONE; 2]);
        slot.advance(at);
    }

    /// The communicator behind an NCCL context pointer, if it is one of ours and alive.
    fn comm(&self, ctx: *mut c_void) -> Option<&CommSlot> {
        let offset = (ctx as usize).checked_sub(self.comms.as_ptr() as usize)?;
        if !offset.is_multiple_of(size_of::<CommSlot>()) {
            return None;
        }
        self.comms
            .get(offset / size_of::<CommSlot>())
            .filter(|s| s.live.load(Ordering::Acquire))
    }

    /// `getDeviceHook` has run for the communicator last initialised on this thread.
    pub fn device_hook_offered(&'static self, cuda_dev: i32, active: bool) {
        let Some(slot) = LAST_INIT.get().and_then(|i| self.comms.get(i as usize)) else {
            return;
        };
        if active && !self.config.mask_explicit {
            // The hook times every work item on the GPU; NCCL's own KernelCh path would only add cost.
            self.set_mask(self.mask.load(Ordering::Relaxed) & !(event::KERNEL_CH as i32));
        }
        let path = if active {
            TimingPath::DeviceHook
        } else {
            TimingPath::KernelCh
        };
        self.with_local(|l| self.announce(l, slot, path, cuda_dev));
    }

    /// The communicator id `getDeviceHook` is about (the last `init` on this thread).
    pub fn last_init_comm(&self) -> Option<u32> {
        LAST_INIT
            .get()
            .and_then(|i| self.comms.get(i as usize))
            .map(|s| s.id.load(Ordering::Relaxed))
    }

    /// `startEvent`: the handle NCCL keeps, or NULL to decline.
    pub fn start(
        &'static self,
        ctx: *mut c_void,
        parent: *mut c_void,
        start: Start,
    ) -> *mut c_void {
        match start {
            // Nothing to queue or keep: no thread state needed.
            Start::Group => group_handle(),
            Start::Api { captured } => api_handle(captured),
            Start::Other => {
                self.count(Counter::Ignored);
                std::ptr::null_mut()
            }
            // By reference: the descriptor's fields are not moved through the closure.
            start => self.with_local(|l| self.start_event(l, ctx, parent, &start)),
        }
    }

    fn start_event(
        &self,
        l: &mut Local,
        ctx: *mut c_void,
        parent: *mut c_void,
        start: &Start,
    ) -> *mut c_void {
        let Some(comm_slot) = self.comm(ctx) else {
            self.count(Counter::Ignored);
            return std::ptr::null_mut();
        };
        if !comm_slot.announced.load(Ordering::Relaxed) {
            self.announce(l, comm_slot, TimingPath::KernelCh, -1);
        }
        let comm = comm_slot.id.load(Ordering::Relaxed);
        let kernel_children = |n_channels: u8| {
            if self.mask.load(Ordering::Relaxed) & event::KERNEL_CH as i32 != 0 {
                n_channels as u32
            } else {
                0
            }
        };
        let captured = parent == api_handle(true);
        // Only an operation's start reads the host clock: a kernel event's start records none.
        match start {
            Start::Group | Start::Api { .. } | Start::Other => std::ptr::null_mut(),
            Start::Coll(c) if captured => {
                let event = c.event(comm, self.captured_id(), clock::stamp(), true);
                comm_slot.advance(self.push(l, event, [comm_slot.last(), Dep::NONE]));
                captured_op_handle()
            }
            Start::P2p(p) if captured => {
                let event = p.event(comm, self.captured_id(), clock::stamp(), true);
                comm_slot.advance(self.push(l, event, [comm_slot.last(), Dep::NONE]));
                captured_op_handle()
            }
            Start::Coll(c) => {
                let refs = 1 + kernel_children(c.n_channels);
                self.start_op(l, comm_slot, Kind::Coll, refs, |id| {
                    c.event(comm, id, clock::stamp(), false)
                })
            }
            Start::P2p(p) => {
                let refs = 1 + kernel_children(p.n_channels);
                self.start_op(l, comm_slot, Kind::P2p, refs, |id| {
                    p.event(comm, id, clock::stamp(), false)
                })
            }
            Start::KernelCh { .. } if parent == captured_op_handle() => {
                self.count(Counter::ReplayKernelCh);
                std::ptr::null_mut()
            }
            &Start::KernelCh { channel, p_timer } => {
                let op = self.pool.lookup(parent).filter(|p| p.kind.is_op());
                let Some(live) = self.alloc(l, Kind::KernelCh, comm_slot, 1, channel as u32) else {
                    if let Some(op) = op {
                        self.pool.release(&mut l.cache, &op);
                    }
                    return std::ptr::null_mut();
                };
                // Its record follows its operation's start.
                let (parent_id, dep) =
                    op.map_or((0, 0), |op| (op.id(), op.slot.dep.load(Ordering::Relaxed)));
                live.slot.parent.store(parent_id, Ordering::Relaxed);
                live.slot.dep.store(dep, Ordering::Relaxed);
                live.slot.gpu_start.store(p_timer, Ordering::Relaxed);
                if let Some(op) = op {
                    // This child has its parent's id now; the parent no longer waits for it.
                    self.pool.release(&mut l.cache, &op);
                }
                self.pool.handle(&live)
            }
            &Start::KernelPhase {
                channel,
                phase,
                p_timer,
            } => {
                let kernel = self
                    .pool
                    .lookup(parent)
                    .filter(|p| p.kind == Kind::KernelCh);
                let (op_id, dep) = kernel.map_or((0, 0), |k| {
                    (
                        k.slot.parent.load(Ordering::Relaxed),
                        k.slot.dep.load(Ordering::Relaxed),
                    )
                });
                let bits = channel as u32 | (phase as u32) << 8;
                let Some(live) = self.alloc(l, Kind::KernelPhase, comm_slot, 1, bits) else {
                    return std::ptr::null_mut();
                };
                live.slot.parent.store(op_id, Ordering::Relaxed);
                live.slot.dep.store(dep, Ordering::Relaxed);
                live.slot.gpu_start.store(p_timer, Ordering::Relaxed);
                self.pool.handle(&live)
            }
        }
    }

    fn captured_id(&self) -> u64 {
        self.next_captured.fetch_add(1, Ordering::Relaxed) << 32 | 1 << 31
    }

    /// An eager Coll or P2p: a slot for it and its `refs - 1` kernel children, and its start queued
    /// after the communicator's last event. A start that cannot be queued (dropped, counted) declines
    /// the operation, so no stop or kernel record names a start that never reaches the daemon.
    fn start_op(
        &self,
        l: &mut Local,
        comm_slot: &CommSlot,
        kind: Kind,
        refs: u32,
        event: impl FnOnce(u64) -> Event,
    ) -> *mut c_void {
        let Some(live) = self.alloc(l, kind, comm_slot, refs, 0) else {
            return std::ptr::null_mut();
        };
        let at = self.push(l, event(live.id()), [comm_slot.last(), Dep::NONE]);
        if at == Dep::NONE {
            self.pool.abandon(&mut l.cache, &live);
            return std::ptr::null_mut();
        }
        comm_slot.advance(at);
        live.slot.dep.store(at.raw(), Ordering::Relaxed);
        self.pool.handle(&live)
    }

    /// A slot for an event of `comm`, with the communicator's table index in the top half of
    /// `channel` (where its stop finds the communicator) and `channel_bits` (a kernel event's
    /// channel and phase) in the bottom half: one store, no read-modify-write.
    fn alloc(
        &self,
        l: &mut Local,
        kind: Kind,
        comm: &CommSlot,
        refs: u32,
        channel_bits: u32,
    ) -> Option<crate::pool::Live<'_>> {
        let id = comm.id.load(Ordering::Relaxed);
        let Some(live) = self.pool.alloc(&mut l.cache, kind, id, refs) else {
            self.count(Counter::PoolExhausted);
            return None;
        };
        let table = (comm as *const CommSlot as usize - self.comms.as_ptr() as usize)
            / size_of::<CommSlot>();
        live.slot
            .channel
            .store((table as u32) << 16 | channel_bits, Ordering::Relaxed);
        Some(live)
    }

    /// `stopEvent` (possibly on another thread than the start: the slot carries everything).
    pub fn stop(&'static self, handle: *mut c_void) {
        let Some(live) = self.pool.lookup(handle) else {
            if !is_static(handle) && !handle.is_null() {
                self.count(Counter::Ignored);
            }
            return;
        };
        if !live.stop() {
            return;
        }
        self.with_local(|l| self.stopped(l, &live));
    }

    /// The record of a stopped event, queued; the slot released.
    fn stopped(&self, l: &mut Local, live: &crate::pool::Live<'_>) {
        let comm = live.slot.comm.load(Ordering::Relaxed);
        let channel = live.slot.channel.load(Ordering::Relaxed);
        let gpu_start = live.slot.gpu_start.load(Ordering::Relaxed);
        let gpu_stop = live.slot.gpu_stop.load(Ordering::Relaxed);
        let parent = live.slot.parent.load(Ordering::Relaxed);
        let start = Dep::from_raw(live.slot.dep.load(Ordering::Relaxed));
        let comm_slot = self.comms.get((channel >> 16) as usize);
        let event = Event::Ready(match live.kind {
            Kind::Coll | Kind::P2p => {
                let host_ns = clock::stamp();
                // Kept for `sweep`: how long the operation has waited for its KernelCh children.
                live.slot.gpu_stop.store(host_ns, Ordering::Relaxed);
                Record::OpStop {
                    comm,
                    id: live.id(),
                    host_ns,
                }
            }
            Kind::KernelCh => Record::KernelCh {
                comm,
                parent,
                channel: channel as u8,
                gpu_start,
                gpu_stop,
                host_ns: clock::stamp(),
            },
            Kind::KernelPhase => Record::KernelPhase {
                comm,
                parent,
                channel: channel as u8,
                phase: (channel >> 8 & 0xff) as u8,
                gpu_start,
                gpu_stop,
            },
        });
        self.pool.release(&mut l.cache, live);
        let last = comm_slot.map_or(Dep::NONE, CommSlot::last);
        let at = self.push(l, event, [start, last]);
        if let Some(c) = comm_slot {
            c.advance(at);
        }
    }

    /// Releases operations stopped before `stopped_before` (a [`clock::stamp`]) that still wait for
    /// KernelCh children NCCL never started (counted as [`Counter::Unfinished`]), so a host that announces
    /// more channels than it reports cannot exhaust the pool. Forwarding thread, about once a second,
    /// with the stamp of [`ORPHAN_AGE`] ago.
    pub fn sweep(&self, stopped_before: u64) {
        let released = self.pool.sweep(stopped_before);
        self.pending[Counter::Unfinished as usize].fetch_add(released, Ordering::Relaxed);
    }

    /// `recordEventState`; `p_timer` is the state args' `kernelCh.pTimer` (None for NULL args).
    pub fn record_state(&self, handle: *mut c_void, state: u32, p_timer: Option<u64>) {
        if is_static(handle) && p_timer.is_none() {
            return; // GroupApi states (NULL args): nothing to record
        }
        let live = self.pool.lookup(handle);
        let expected = match live.map(|l| l.kind) {
            Some(Kind::KernelCh) => crate::abi::state::KERNEL_CH_STOP,
            Some(Kind::KernelPhase) => crate::abi::state::KERNEL_PHASE_STOP,
            _ => u32::MAX,
        };
        match (live, p_timer) {
            (Some(live), Some(t)) if state == expected => {
                live.slot.gpu_stop.store(t, Ordering::Relaxed)
            }
            _ => self.count(Counter::Ignored),
        }
    }

    /// `finalize`: frees the communicator's events and waits (bounded) until its end is in the segment.
    pub fn finalize(&'static self, ctx: *mut c_void) {
        let Some(slot) = self.comm(ctx) else { return };
        let table = (ctx as usize - self.comms.as_ptr() as usize) / size_of::<CommSlot>();
        self.with_local(|l| self.finalize_comm(l, slot, table));
    }

    fn finalize_comm(&self, l: &mut Local, slot: &CommSlot, table: usize) {
        self.announce(l, slot, TimingPath::KernelCh, -1);
        let comm = slot.id.load(Ordering::Relaxed);
        let unfinished = self.pool.reclaim(comm);
        self.pending[Counter::Unfinished as usize].fetch_add(unfinished, Ordering::Relaxed);
        self.live_comms.fetch_sub(1, Ordering::AcqRel);
        let deadline = Instant::now() + FINALIZE_WAIT;
        let mut end = Some(Event::CommEnd {
            comm,
            table: table as u32,
            host_ns: clock::stamp(),
        });
        // After everything queued before it, in every lane (the proxy thread's last kernel events).
        while let Some(event) = end.take() {
            let pushed = match &l.lane {
                Some(lane) => self.lanes.push(lane, event, [Dep::ALL, Dep::NONE]),
                None => Err(event),
            };
            if let Err(event) = pushed {
                if Instant::now() >= deadline || failed() || l.lane.is_none() {
                    self.count(Counter::QueueFull);
                    break;
                }
                end = Some(event);
                self.wake();
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.wake();
        // The forwarding thread gone (a panic latched the plugin off), nobody will confirm: no wait.
        while !slot.ended.load(Ordering::Acquire) && Instant::now() < deadline && !failed() {
            std::thread::sleep(Duration::from_micros(200));
        }
        if !slot.ended.load(Ordering::Acquire) && !failed() {
            host::log_once(
                "finalize-timeout",
                true,
                "finalize: the forwarding thread did not confirm in time",
            );
        }
        slot.live.store(false, Ordering::Release);
    }

    /// A process exiting with communicators not finalized (a rank that returns from main, or calls
    /// `exit`, without destroying them): the forwarding thread gets up to [`EXIT_WAIT`] to write
    /// what NCCL's threads queued (and what the rings hold); what is still queued after it is counted
    /// (`exit_unflushed`) and the thread gets one more pass to write the count.
    fn flush_at_exit(&self) {
        if self.live_comms() == 0 {
            return;
        }
        let deadline = Instant::now() + EXIT_WAIT;
        let wait = |done: &dyn Fn() -> bool| {
            while !done() && Instant::now() < deadline {
                self.wake();
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        // Written once the lanes are empty and the thread found nothing more to do.
        wait(&|| self.lanes.is_empty() && self.fwd_idle.load(Ordering::SeqCst));
        let left = self.lanes.discard_all();
        if left > 0 {
            let pending = &self.pending[Counter::ExitUnflushed as usize];
            pending.fetch_add(left, Ordering::Relaxed);
            // Moved into the segment header by the thread's next pass.
            wait(&|| pending.load(Ordering::Relaxed) == 0);
        }
    }

    /// The forwarding thread wrote the communicator's end. Closes the segment when it was the last one.
    /// Communicators initialized and not yet finalized.
    pub fn live_comms(&self) -> u32 {
        self.live_comms.load(Ordering::Acquire)
    }

    pub fn comm_ended(&self, table: u32, segment: &Segment) {
        if let Some(slot) = self.comms.get(table as usize) {
            slot.ended.store(true, Ordering::Release);
        }
        if self.live_comms() == 0 {
            self.flush_counters(segment);
            segment.close();
        }
    }
}
