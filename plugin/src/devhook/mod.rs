//! The RFC device hook (NVIDIA/nccl PR #2285): the CUDA hook module, the per-(communicator, channel)
//! rings it writes, the drain that reads them, and the GPU clock calibration.
//!
//! NCCL calls `getDeviceHook` once per communicator, right after its `init`, on the init thread. Each
//! call gets a fresh block of rings (one per channel), so every ring has a single writer: that
//! communicator's kernels, which run in order. The forwarding thread calls [`drain`] each iteration and
//! [`finalize_comm`] when a communicator ends.
//!
//! `NCCLSCOPE_RING_MEMORY` picks where rings live: `device` (default; device memory copied out by the
//! drain with the copy engine: inside real NCCL kernels stores to it cost less than to host-mapped
//! memory, docs/benchmarks.md), `host` (pinned host-mapped memory read in place), or `cpu` (plain memory
//! and a host function as the "hook", for simulation without a GPU; never chosen automatically, since a
//! host pointer handed to a real kernel would crash it). `NCCLSCOPE_RING_SLOTS` sets the ring depth.
//!
//! Freeing: CPU rings are freed at `finalize_comm`. GPU rings (pinned or device memory) are never freed
//! by the plugin: a kernel of the finalized communicator may still be in flight, and freeing (or
//! synchronizing the context) from our thread could also break an application's graph capture. The
//! driver releases them at process exit; the cost is one block per communicator ever created.

mod calib;
mod cuda;
mod drain;
pub mod layout;
// The rings' channel count is NCCL's channel limit, which records carry (`layout.rs` stays free of
// dependencies: the build script includes it).
const _: () = assert!(layout::MAX_CHANNELS == ncclscope_proto::MAX_CHANNELS as usize);
pub mod ring;

use std::ffi::{c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use drain::{CommRings, Emitter, Memory};
use ring::{DevEvent, HeapBlock};

use crate::sink::Sink;

/// `const char* ncclProfilerDevFuncName(int funcId)`, exported by an RFC NCCL.
pub type FuncNameFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// Default slots per ring: 64 rings x 4096 x 48 B = 12 MiB per communicator.
pub const DEFAULT_RING_SLOTS: u64 = 4096;
/// Bounds of `NCCLSCOPE_RING_SLOTS` (a power of two).
pub const RING_SLOTS_RANGE: (u64, u64) = (64, 1 << 20);

/// Where a communicator's rings live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Pinned host memory mapped into the GPU; the drain reads it in place.
    Host,
    /// Device memory; the drain copies windows out with the copy engine.
    Device,
    /// Plain host memory and a host-function hook: simulation without a GPU.
    Cpu,
}

/// The ring settings, from `NCCLSCOPE_RING_MEMORY` and `NCCLSCOPE_RING_SLOTS`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingConfig {
    pub placement: Placement,
    /// log2 of the slots per ring.
    pub shift: u32,
    pub warnings: Vec<String>,
}

impl RingConfig {
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> RingConfig {
        let mut warnings = Vec::new();
        let placement = match var("NCCLSCOPE_RING_MEMORY").as_deref().map(str::trim) {
            None | Some("" | "device") => Placement::Device,
            Some("host") => Placement::Host,
            Some("cpu") => Placement::Cpu,
            Some(other) => {
                warnings.push(format!(
                    "ignoring NCCLSCOPE_RING_MEMORY={other:?} (expected device, host or cpu); using device"
                ));
                Placement::Device
            }
        };
        let (lo, hi) = RING_SLOTS_RANGE;
        let mut slots = DEFAULT_RING_SLOTS;
        if let Some(v) = var("NCCLSCOPE_RING_SLOTS") {
            match v.trim().parse::<u64>().ok().filter(|n| n.is_power_of_two() && (lo..=hi).contains(n)) {
                Some(n) => slots = n,
                None => warnings.push(format!(
                    "ignoring NCCLSCOPE_RING_SLOTS={v:?} (expected a power of two from {lo} to {hi}); using {slots}"
                )),
            }
        }
        RingConfig {
            placement,
            shift: slots.trailing_zeros(),
            warnings,
        }
    }
}

/// Rings handed out but not yet seen by the drain (the init thread only appends here).
static NEW: Mutex<Vec<(CommRings, Clock)>> = Mutex::new(Vec::new());
/// Devices to calibrate for the stock KernelCh path (no rings), adopted by the drain.
static NEW_CLOCKS: Mutex<Vec<(i32, Clock)>> = Mutex::new(Vec::new());
/// Whether any rings were ever handed out: the drain's fast path when the hook is unused.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Latched on the first panic: no more hooks are offered and nothing more is drained.
static DISABLED: AtomicBool = AtomicBool::new(false);
static DRAIN: Mutex<DrainState> = Mutex::new(DrainState::new());
static FUNC_NAME: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// Messages already logged (each is logged once per process).
static LOGGED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// How a device's clock is read for calibration.
#[derive(Clone)]
enum Clock {
    /// Simulation: CLOCK_MONOTONIC.
    Cpu,
    Gpu(Arc<cuda::Device>),
}

struct DrainState {
    comms: Vec<CommRings>,
    clocks: Vec<(calib::Tracker, Clock)>,
    funcs_seen: Vec<u64>,
}

impl DrainState {
    const fn new() -> DrainState {
        DrainState {
            comms: Vec::new(),
            clocks: Vec::new(),
            funcs_seen: Vec::new(),
        }
    }
}

static LOG_SINK: std::sync::OnceLock<fn(bool, &str)> = std::sync::OnceLock::new();

/// Where the device hook's messages go (the host side passes its NCCL logger); NCCL's logger through
/// `crate::host` when not set.
pub fn set_log(sink: fn(bool, &str)) {
    let _ = LOG_SINK.set(sink);
}

/// Logs `msg` once per process through NCCL's logger (the same text is not repeated).
fn log_once(warn: bool, msg: String) {
    let Ok(mut seen) = LOGGED.lock() else { return };
    if seen.contains(&msg) || seen.len() >= 64 {
        return;
    }
    seen.push(msg.clone());
    drop(seen);
    LOG_SINK.get().copied().unwrap_or(crate::host::log)(warn, &msg);
}

/// The RFC host's funcId -> name function (`ncclProfilerDevFuncName`), when the host side found one.
/// Without it the daemon shows `func#<id>`.
pub fn set_func_name_fn(f: Option<FuncNameFn>) {
    FUNC_NAME.store(
        f.map_or(std::ptr::null_mut(), |f| f as *mut c_void),
        Ordering::Release,
    );
}

fn func_name(func_id: u32) -> Option<Vec<u8>> {
    let p = FUNC_NAME.load(Ordering::Acquire);
    if p.is_null() {
        return None;
    }
    // SAFETY: the only non-NULL value stored is a `FuncNameFn`.
    let f = unsafe { std::mem::transmute::<*mut c_void, FuncNameFn>(p) };
    // SAFETY: the RFC's function takes any id and returns NULL or a static NUL-terminated string.
    let name = unsafe { f(func_id as c_int) };
    if name.is_null() {
        return None;
    }
    // SAFETY: checked non-NULL; a static NUL-terminated string per the RFC.
    let name = unsafe { std::ffi::CStr::from_ptr(name) };
    Some(name.to_bytes().to_vec())
}

/// Why the device hook cannot be offered on a GPU in this build or on this machine, if it cannot.
pub fn gpu_unavailable() -> Option<String> {
    cuda::driver().err()
}

/// `getDeviceHook(cudaDev, devHook, devCtx)` for communicator `comm` (the one whose `init` just ran on
/// this thread, if any). Returns with `*dev_hook = null` when no hook is available.
///
/// # Safety
/// `dev_hook` and `dev_ctx` are NULL or valid for writes.
pub unsafe fn get_device_hook(
    cuda_dev: i32,
    comm: Option<u32>,
    dev_hook: *mut *mut c_void,
    dev_ctx: *mut *mut c_void,
) {
    let offered = match comm {
        _ if DISABLED.load(Ordering::Relaxed) => None,
        None => {
            log_once(
                true,
                "getDeviceHook without a preceding init on this thread: no device hook".into(),
            );
            None
        }
        Some(comm) => match catch_unwind(|| offer(cuda_dev, comm)) {
            Ok(Ok(pair)) => Some(pair),
            Ok(Err(why)) => {
                log_once(true, format!("device hook unavailable: {why}"));
                None
            }
            Err(_) => {
                DISABLED.store(true, Ordering::Relaxed);
                log_once(true, "device hook disabled after an internal error".into());
                None
            }
        },
    };
    let (hook, ctx) = offered.unwrap_or((std::ptr::null_mut(), std::ptr::null_mut()));
    // SAFETY: the caller guarantees the pointers are NULL or writable.
    unsafe {
        if !dev_hook.is_null() {
            *dev_hook = hook;
        }
        if !dev_ctx.is_null() {
            *dev_ctx = ctx;
        }
    }
}

/// The stock KernelCh path: NCCL's `pTimer` values are raw %globaltimer of the device of the calling
/// thread's context (NCCL's init thread), so that device is calibrated like a hooked one. Returns its
/// ordinal, or -1: in simulation (`cpu` placement) the fake NCCL's simulated clock, CLOCK_MONOTONIC, is
/// calibrated as device -1; without a driver or on failure nothing is (logged once; the daemon then counts
/// the kernel times as uncalibrated).
pub fn calibrate_current_device() -> i32 {
    const NO_DEVICE: i32 = -1;
    if DISABLED.load(Ordering::Relaxed) {
        return NO_DEVICE;
    }
    if RingConfig::from_lookup(|name| std::env::var(name).ok()).placement == Placement::Cpu {
        if let Ok(mut new) = NEW_CLOCKS.lock() {
            new.push((NO_DEVICE, Clock::Cpu));
            ACTIVE.store(true, Ordering::Release);
        }
        return NO_DEVICE;
    }
    let watched = catch_unwind(|| -> Result<i32, String> {
        let ordinal = cuda::current_device()?;
        let dev = cuda::device(ordinal)?;
        NEW_CLOCKS
            .lock()
            .map_err(|_| "poisoned".to_string())?
            .push((ordinal, Clock::Gpu(dev)));
        ACTIVE.store(true, Ordering::Release);
        Ok(ordinal)
    });
    match watched {
        Ok(Ok(ordinal)) => ordinal,
        Ok(Err(why)) => {
            log_once(
                false,
                format!("no GPU clock calibration for NCCL's kernel timings: {why}"),
            );
            -1
        }
        Err(_) => {
            DISABLED.store(true, Ordering::Relaxed);
            log_once(true, "device hook disabled after an internal error".into());
            -1
        }
    }
}

/// The GPU of NCCL's init thread's context, for the communicator being initialised; `None` without a
/// driver or a context (simulation, CI), after logging why once. Independent of the ring placement:
/// a driver stand-in gives simulated ranks a GPU identity too.
pub fn current_gpu() -> Option<ncclscope_proto::Gpu> {
    if DISABLED.load(Ordering::Relaxed) {
        return None;
    }
    match catch_unwind(cuda::current_gpu) {
        Ok(Ok(gpu)) => Some(gpu),
        Ok(Err(why)) => {
            log_once(false, format!("no GPU identity for communicators: {why}"));
            None
        }
        // A symbol missing from the loaded libcuda (cudarc panics): no identity, nothing else changes.
        Err(_) => {
            log_once(
                false,
                "no GPU identity for communicators: libcuda lacks a call".into(),
            );
            None
        }
    }
}

/// Allocates `comm`'s rings and returns (hook, devCtx).
fn offer(cuda_dev: i32, comm: u32) -> Result<(*mut c_void, *mut c_void), String> {
    let config = RingConfig::from_lookup(|name| std::env::var(name).ok());
    for w in config.warnings {
        log_once(true, w);
    }
    let shift = config.shift;
    let (hook, ctx, mem, clock) = match config.placement {
        Placement::Cpu => {
            let block = HeapBlock::new(shift);
            let ctx = block.ctx();
            let words = block.words().as_ptr();
            let hook =
                ring::cpu_hook as unsafe extern "C" fn(*const DevEvent, *mut c_void) as *mut c_void;
            (
                hook,
                ctx,
                Memory::InPlace {
                    words,
                    _owner: Box::new(block),
                },
                Clock::Cpu,
            )
        }
        Placement::Host | Placement::Device => {
            let dev = cuda::device(cuda_dev)?;
            let (ctx, mem) = match config.placement {
                Placement::Host => dev.host_block(shift)?,
                _ => dev.device_block(shift)?,
            };
            (dev.hook as usize as *mut c_void, ctx, mem, Clock::Gpu(dev))
        }
    };
    let rings = CommRings::new(comm, cuda_dev, shift, mem);
    NEW.lock()
        .map_err(|_| "poisoned".to_string())?
        .push((rings, clock));
    ACTIVE.store(true, Ordering::Release);
    Ok((hook, ctx))
}

/// Called from the forwarding thread's loop: moves completed device records into the segment, and
/// calibrates each device when due. Returns how many records it produced (0 lets the loop back off).
pub fn drain(out: &mut dyn Sink) -> usize {
    if !ACTIVE.load(Ordering::Acquire) || DISABLED.load(Ordering::Relaxed) {
        return 0;
    }
    guarded(|| {
        let Ok(mut state) = DRAIN.lock() else {
            return 0;
        };
        state.adopt_new();
        // Calibrate first: a device's first calibration then precedes its first work items, which
        // the daemon compares with host enqueue times.
        let calibrated = state.calibrate(out, Instant::now());
        calibrated + state.drain(out)
    })
}

/// The communicator is being finalized: drain its rings and release them (see the module doc on when
/// memory is freed).
pub fn finalize_comm(comm: u32, out: &mut dyn Sink) {
    if !ACTIVE.load(Ordering::Acquire) || DISABLED.load(Ordering::Relaxed) {
        return;
    }
    guarded(|| {
        let Ok(mut state) = DRAIN.lock() else {
            return 0;
        };
        state.adopt_new();
        // A communicator that ends before the loop's next pass still gets its device's first
        // calibration ahead of its work items and its end (the daemon closes its ops at the end).
        state.calibrate(out, Instant::now());
        state.finalize(comm, out);
        0
    });
}

fn guarded(f: impl FnOnce() -> usize) -> usize {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        DISABLED.store(true, Ordering::Relaxed);
        log_once(
            true,
            "device hook disabled after an internal error in the drain".into(),
        );
        0
    })
}

impl DrainState {
    fn adopt_new(&mut self) {
        if let Ok(mut new) = NEW.lock() {
            for (rings, clock) in new.drain(..) {
                self.watch(rings.cuda_dev, clock);
                self.comms.push(rings);
            }
        }
        if let Ok(mut new) = NEW_CLOCKS.lock() {
            for (cuda_dev, clock) in new.drain(..) {
                self.watch(cuda_dev, clock);
            }
        }
    }

    /// Calibrates `cuda_dev` from now on (once per device).
    fn watch(&mut self, cuda_dev: i32, clock: Clock) {
        if !self.clocks.iter().any(|(t, _)| t.cuda_dev == cuda_dev) {
            self.clocks.push((calib::Tracker::new(cuda_dev), clock));
        }
    }

    fn emitter<'a>(sink: &'a mut dyn Sink, seen: &'a mut Vec<u64>) -> Emitter<'a> {
        if seen.is_empty() {
            seen.resize(drain::FUNC_BITMAP_WORDS, 0);
        }
        Emitter::new(sink, seen)
    }

    fn drain(&mut self, sink: &mut dyn Sink) -> usize {
        let mut out = Self::emitter(sink, &mut self.funcs_seen);
        for rings in &mut self.comms {
            rings.drain(&mut out);
        }
        finish(out)
    }

    fn finalize(&mut self, comm: u32, sink: &mut dyn Sink) {
        let Some(i) = self.comms.iter().position(|r| r.comm == comm) else {
            return;
        };
        let mut rings = self.comms.swap_remove(i);
        let mut out = Self::emitter(sink, &mut self.funcs_seen);
        rings.drain_all(&mut out);
        rings.close(&mut out);
        finish(out);
        drop(rings.into_memory());
    }

    fn calibrate(&mut self, sink: &mut dyn Sink, now: Instant) -> usize {
        let mut n = 0;
        for (tracker, clock) in &mut self.clocks {
            if !tracker.is_due(now) {
                continue;
            }
            let measured = match clock {
                Clock::Cpu => Ok((calib::cpu_samples(calib::SAMPLES), 1)),
                Clock::Gpu(dev) => dev.clock_samples(calib::SAMPLES),
            };
            match measured {
                Ok((samples, tick)) => {
                    tracker.reschedule(now);
                    if let Some(est) = calib::estimate(&samples, tick) {
                        sink.push(&tracker.record(est, ncclscope_proto::now_ns()));
                        n += 1;
                    }
                }
                Err(why) => {
                    tracker.retry(now);
                    log_once(
                        true,
                        format!("GPU clock calibration failed (will retry): {why}"),
                    );
                }
            }
        }
        n
    }
}

/// Adds the pass's loss to the counters; returns the records produced.
fn finish(mut out: Emitter<'_>) -> usize {
    out.flush_counts();
    if out.copy_failures > 0 {
        log_once(
            true,
            "copying device-memory rings failed; events stay in the rings until lapped".into(),
        );
    }
    out.records
}

#[cfg(test)]
mod tests;
