//! The GPU side of the host code: the CUDA driver (loaded at run time through cudarc, never linked),
//! the hook module embedded in the .so (one per context), ring memory in both placements, and the
//! calibration kernel's ping-pong.
//!
//! Every driver call goes through [`driver`] first, which checks that libcuda exists before the first
//! call: cudarc panics on a machine without a driver, and a panic must never reach NCCL.

use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use super::calib::Sample;
use super::drain::{CopyOut, Memory};
use super::layout::{BLOCK_ALIGN, MAX_CHANNELS, SLOT_BYTES};
use super::ring::make_ctx;

/// The hook module: relocatable code device-linked into a fatbin by plugin/build.rs (empty when the
/// build had no nvcc).
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ncclscope_hook.fatbin"));

/// Largest window (slots) of one device-memory ring copied out per drain pass.
const MAX_WINDOW: usize = 512;

fn check(rc: cu::CUresult, what: &str) -> Result<(), String> {
    if rc == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {rc:?}"))
    }
}

/// Ok once the fatbin is present, libcuda loaded and initialised.
pub fn driver() -> Result<(), String> {
    if FATBIN.is_empty() {
        return Err("the plugin was built without nvcc (no device code)".into());
    }
    libcuda()
}

/// Ok once libcuda is loaded and initialised: enough to ask about devices, with or without device code.
fn libcuda() -> Result<(), String> {
    static STATE: OnceLock<Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: only tries to dlopen libcuda under its usual names.
            if !unsafe { cu::is_culib_present() } {
                return Err("libcuda not found".into());
            }
            // SAFETY: libcuda is present; cuInit may be called any number of times. cudarc panics
            // on a library without the symbol (not a driver): caught, not a driver either.
            match std::panic::catch_unwind(|| unsafe { cu::cuInit(0) }) {
                Ok(rc) => check(rc, "cuInit"),
                Err(_) => Err("libcuda has no cuInit".into()),
            }
        })
        .clone()
}

/// The hook module loaded in one context.
pub struct Device {
    ctx: cu::CUcontext,
    /// The device address of `ncclscope_hook`.
    pub hook: u64,
    calibrate: cu::CUfunction,
    /// The drain's own stream for copies out of device rings.
    stream: cu::CUstream,
    /// The calibration kernel's stream (a kernel queued behind other work must not hold up copies).
    calib_stream: cu::CUstream,
    /// Pinned, mapped: [0] the host's "go" word, [1] the tick, [2..] one GPU clock read per sample.
    ping: *mut AtomicU64,
    ping_dev: u64,
}

// SAFETY: the context, module, function and stream handles are usable from any thread once the context
// is made current there; `ping` is pinned memory only accessed atomically, by one thread at a time (the
// drain, under its lock).
unsafe impl Send for Device {}
// SAFETY: as above; shared references only read the handles.
unsafe impl Sync for Device {}

/// Calibration samples per kernel launch, at most.
const MAX_PINGS: usize = 64;
/// Tells the calibration kernel to stop waiting.
const PING_ABORT: u64 = u64::MAX;

static DEVICES: Mutex<Vec<Arc<Device>>> = Mutex::new(Vec::new());

/// The device of the calling thread's current context (NCCL's, on its init thread).
pub fn current_device() -> Result<i32, String> {
    driver()?;
    context_device()
}

/// The device of the calling thread's current context; libcuda is loaded.
fn context_device() -> Result<cu::CUdevice, String> {
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out pointer.
    check(unsafe { cu::cuCtxGetCurrent(&mut ctx) }, "cuCtxGetCurrent")?;
    if ctx.is_null() {
        return Err("no current CUDA context on NCCL's init thread".into());
    }
    let mut dev: cu::CUdevice = 0;
    // SAFETY: valid out pointer; a context is current.
    check(unsafe { cu::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    Ok(dev)
}

/// The GPU of the calling thread's current context (NCCL's, on its init thread): its ordinal and UUID.
/// An error without a driver or a current context; never a guess.
pub fn current_gpu() -> Result<ncclscope_proto::Gpu, String> {
    libcuda()?;
    let dev = context_device()?;
    let mut uuid = cu::CUuuid { bytes: [0; 16] };
    // SAFETY: valid out pointer; `dev` is the current context's device.
    let rc = unsafe { cu::cuDeviceGetUuid_v2(&mut uuid, dev) };
    check(rc, "cuDeviceGetUuid_v2")?;
    let uuid = uuid.bytes.map(|b| b as u8);
    match (u32::try_from(dev), uuid != [0; 16]) {
        (Ok(ordinal), true) => Ok(ncclscope_proto::Gpu { ordinal, uuid }),
        _ => Err(format!("device {dev} has no usable identity")),
    }
}

/// The hook module for the calling thread's current context (NCCL's, for `cuda_dev`), loaded once.
pub fn device(cuda_dev: i32) -> Result<Arc<Device>, String> {
    driver()?;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out pointer.
    check(unsafe { cu::cuCtxGetCurrent(&mut ctx) }, "cuCtxGetCurrent")?;
    if ctx.is_null() {
        // No current context on NCCL's thread (unusual): use the device's primary one, as the runtime would.
        let mut dev: cu::CUdevice = 0;
        // SAFETY: valid out pointers; the primary context is retained for the life of the process.
        unsafe {
            check(cu::cuDeviceGet(&mut dev, cuda_dev), "cuDeviceGet")?;
            check(
                cu::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            check(cu::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
        }
    }
    let mut devices = DEVICES.lock().map_err(|_| "poisoned")?;
    if let Some(d) = devices.iter().find(|d| d.ctx == ctx) {
        return Ok(d.clone());
    }
    let d = Arc::new(load(ctx)?);
    devices.push(d.clone());
    Ok(d)
}

fn load(ctx: cu::CUcontext) -> Result<Device, String> {
    // The driver wants the image aligned; include_bytes! promises nothing.
    let mut image = vec![0u64; FATBIN.len().div_ceil(8)];
    // SAFETY: `image` has at least FATBIN.len() bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(FATBIN.as_ptr(), image.as_mut_ptr() as *mut u8, FATBIN.len())
    };
    let mut module: cu::CUmodule = std::ptr::null_mut();
    let image = image.as_ptr() as *const c_void;
    // SAFETY: `image` is a complete fatbin; `ctx` is current on this thread. The module is never unloaded
    // (NCCL's kernels hold pointers into it).
    let rc = unsafe { cu::cuModuleLoadData(&mut module, image) };
    check(rc, "cuModuleLoadData")?;
    let hook = read_pointer(module, c"ncclscope_hook_ptr")?;
    // Device-linked code holds a real address. A GPU with no linked image in the fatbin gets the PTX
    // compiled as a whole program, whose function-pointer globals hold small descriptors that fault when
    // called from another module (CUDA_ERROR_INVALID_PC on the H200): refuse instead.
    if hook < 1 << 16 {
        return Err(format!(
            "no device-linked hook image for this GPU (pointer {hook:#x}); rebuild with its architecture"
        ));
    }
    let mut calibrate: cu::CUfunction = std::ptr::null_mut();
    let (mut stream, mut calib_stream): (cu::CUstream, cu::CUstream) =
        (std::ptr::null_mut(), std::ptr::null_mut());
    let (ping, ping_dev) = pinned_mapped((MAX_PINGS + 2) * 8)?;
    // SAFETY: valid out pointers; names are NUL-terminated.
    unsafe {
        check(
            cu::cuModuleGetFunction(&mut calibrate, module, c"ncclscope_calibrate".as_ptr()),
            "cuModuleGetFunction",
        )?;
        for s in [&mut stream, &mut calib_stream] {
            check(
                cu::cuStreamCreate(s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                "cuStreamCreate",
            )?;
        }
    }
    Ok(Device {
        ctx,
        hook,
        calibrate,
        stream,
        calib_stream,
        ping: ping as *mut AtomicU64,
        ping_dev,
    })
}

/// Reads a `__device__` function-pointer global of the module (a real address once device-linked).
pub fn read_pointer(module: cu::CUmodule, name: &CStr) -> Result<u64, String> {
    let (mut global, mut size, mut value) = (0u64, 0usize, 0u64);
    // SAFETY: valid out pointers; the global is 8 bytes (checked) and copied into `value`.
    unsafe {
        check(
            cu::cuModuleGetGlobal_v2(&mut global, &mut size, module, name.as_ptr()),
            "cuModuleGetGlobal",
        )?;
        if size != 8 {
            return Err(format!("{name:?} is {size} bytes, not a pointer"));
        }
        check(
            cu::cuMemcpyDtoH_v2(&mut value as *mut u64 as *mut c_void, global, 8),
            "cuMemcpyDtoH",
        )?;
    }
    if value == 0 {
        Err(format!("{name:?} is NULL"))
    } else {
        Ok(value)
    }
}

/// Zeroed pinned host memory mapped into the device: (host address, device address).
fn pinned_mapped(bytes: usize) -> Result<(*mut u8, u64), String> {
    let mut host: *mut c_void = std::ptr::null_mut();
    let mut dev = 0u64;
    let flags = cu::CU_MEMHOSTALLOC_DEVICEMAP | cu::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: valid out pointers; the memory is zeroed before its device address is handed out.
    unsafe {
        check(
            cu::cuMemHostAlloc(&mut host, bytes, flags),
            "cuMemHostAlloc",
        )?;
        std::ptr::write_bytes(host as *mut u8, 0, bytes);
        check(
            cu::cuMemHostGetDevicePointer_v2(&mut dev, host, 0),
            "cuMemHostGetDevicePointer",
        )?;
    }
    Ok((host as *mut u8, dev))
}

/// Owns GPU-visible memory that is deliberately never freed (see the module doc of `devhook`).
struct Retained;

impl Device {
    /// Makes the context current on NCCL's init thread (already current there in practice).
    fn make_current(&self) -> Result<(), String> {
        // SAFETY: `ctx` is a live context (never destroyed by us; NCCL's outlives its communicators).
        check(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// Prepares the drain thread (ours) for driver calls: the context current, and relaxed stream-capture
    /// mode, so the drain's copies and calibration launches on its own stream never invalidate a CUDA
    /// graph the application captures in global mode on another thread (PyTorch does; seen on the H200).
    fn enter_drain_thread(&self) -> Result<(), String> {
        thread_local!(static RELAXED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
        if !RELAXED.get() {
            let mut mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
            // SAFETY: valid in/out pointer; only affects the calling thread.
            let rc = unsafe { cu::cuThreadExchangeStreamCaptureMode(&mut mode) };
            check(rc, "cuThreadExchangeStreamCaptureMode")?;
            RELAXED.set(true);
        }
        // SAFETY: `ctx` is a live context (never destroyed by us; NCCL's outlives its communicators).
        check(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// A block of rings in pinned host memory mapped into the GPU: (devCtx, memory read in place).
    pub fn host_block(&self, shift: u32) -> Result<(*mut c_void, Memory), String> {
        self.make_current()?;
        let bytes = (MAX_CHANNELS << shift) * SLOT_BYTES;
        // Small pinned allocations may be sub-allocated with less than page alignment: align by hand.
        let (host, dev) = pinned_mapped(bytes + BLOCK_ALIGN)?;
        let pad = (dev.next_multiple_of(BLOCK_ALIGN as u64) - dev) as usize;
        // SAFETY: `pad < BLOCK_ALIGN`, so the block lies inside the allocation; host and device
        // addresses of mapped memory differ by a constant.
        let host = unsafe { host.add(pad) };
        Ok((
            make_ctx(dev + pad as u64, shift),
            Memory::InPlace {
                words: host as *const AtomicU64,
                _owner: Box::new(Retained),
            },
        ))
    }

    /// A block of rings in device memory, with a pinned staging area for the drain's copies.
    pub fn device_block(self: &Arc<Self>, shift: u32) -> Result<(*mut c_void, Memory), String> {
        self.make_current()?;
        let bytes = (MAX_CHANNELS << shift) * SLOT_BYTES;
        let mut raw = 0u64;
        // SAFETY: valid out pointer; zeroed before the address is handed out.
        unsafe {
            check(
                cu::cuMemAlloc_v2(&mut raw, bytes + BLOCK_ALIGN),
                "cuMemAlloc",
            )?
        };
        let dev = raw.next_multiple_of(BLOCK_ALIGN as u64);
        // SAFETY: [dev, dev + bytes) lies inside the allocation.
        unsafe { check(cu::cuMemsetD8_v2(dev, 0, bytes), "cuMemsetD8")? };
        let max_window = MAX_WINDOW.min(1 << shift);
        let staging_bytes = MAX_CHANNELS * max_window * SLOT_BYTES;
        let mut staging: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        unsafe {
            check(
                cu::cuMemHostAlloc(&mut staging, staging_bytes, 0),
                "cuMemHostAlloc",
            )?
        };
        let copy = DeviceCopy {
            dev: self.clone(),
            ring: dev,
            staging: staging as *mut u64,
            len: staging_bytes / 8,
            queued: Vec::new(),
        };
        Ok((
            make_ctx(dev, shift),
            Memory::Staged {
                copy: Box::new(copy),
                max_window,
            },
        ))
    }

    /// Brackets `n` GPU clock reads between host clock reads: (samples, GPU clock tick in ns).
    pub fn clock_samples(&self, n: usize) -> Result<(Vec<Sample>, u64), String> {
        let n = n.min(MAX_PINGS);
        self.enter_drain_thread()?;
        // A kernel of an earlier attempt that never started still owns the ping words.
        // SAFETY: our own stream; a query does not block.
        if unsafe { cu::cuStreamQuery(self.calib_stream) } != cu::CUresult::CUDA_SUCCESS {
            return Err("an earlier calibration kernel has not run yet".into());
        }
        // SAFETY: `ping` holds MAX_PINGS + 2 words, pinned for the life of the process.
        let words = unsafe { std::slice::from_raw_parts(self.ping, MAX_PINGS + 2) };
        for w in words {
            w.store(0, Ordering::Relaxed);
        }
        let (mut go, mut out, mut count) = (self.ping_dev, self.ping_dev + 8, n as u32);
        let mut params = [
            &mut go as *mut u64 as *mut c_void,
            &mut out as *mut u64 as *mut c_void,
            &mut count as *mut u32 as *mut c_void,
        ];
        // SAFETY: the kernel takes (u64* go, u64* out, u32 n), matching `params`; one thread.
        unsafe {
            check(
                cu::cuLaunchKernel(
                    self.calibrate,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    self.calib_stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "cuLaunchKernel(calibrate)",
            )?
        };
        // The kernel first measures its clock's tick and reports it; it may wait behind other work.
        let wait = |w: &AtomicU64, limit: Duration| {
            let t0 = Instant::now();
            loop {
                let v = w.load(Ordering::Acquire);
                if v != 0 {
                    return Some(v);
                }
                if t0.elapsed() > limit {
                    return None;
                }
                std::hint::spin_loop();
            }
        };
        let mut samples = Vec::with_capacity(n);
        // The drain thread waits here, so not long: a GPU full of other work is simply tried again later.
        let result = match wait(&words[1], Duration::from_millis(2)) {
            None => Err("the calibration kernel did not start within 2 ms".to_string()),
            Some(tick) => {
                for i in 0..n {
                    let before = ncclscope_proto::now_ns();
                    words[0].store(i as u64 + 1, Ordering::Release);
                    let Some(gpu) = wait(&words[2 + i], Duration::from_millis(10)) else {
                        break;
                    };
                    samples.push(Sample {
                        before,
                        gpu,
                        after: ncclscope_proto::now_ns(),
                    });
                }
                Ok((samples, tick))
            }
        };
        // Ends the kernel: at once if it is waiting for a ping, on start if it has not started. Only a
        // kernel that ran is waited for (it is finishing); one still queued is left to exit on its own.
        words[0].store(PING_ABORT, Ordering::Release);
        if result.is_ok() {
            // SAFETY: our own stream.
            let rc = unsafe { cu::cuStreamSynchronize(self.calib_stream) };
            check(rc, "cuStreamSynchronize")?;
        }
        result
    }
}

/// Copies windows of a device-memory block into pinned staging with the copy engine, on the drain's stream.
struct DeviceCopy {
    dev: Arc<Device>,
    ring: u64,
    staging: *mut u64,
    len: usize,
    queued: Vec<(usize, usize, usize)>,
}

// SAFETY: the staging area is owned by this value; the device handles are thread-agnostic (see Device).
unsafe impl Send for DeviceCopy {}

impl CopyOut for DeviceCopy {
    fn queue(&mut self, src: usize, dst: usize, words: usize) {
        self.queued.push((src, dst, words));
    }

    fn complete(&mut self) -> Option<&[u64]> {
        let queued = std::mem::take(&mut self.queued);
        let mut ok = self.dev.enter_drain_thread().is_ok();
        for (src, dst, words) in queued {
            if !ok || dst + words > self.len {
                ok = false;
                break;
            }
            // SAFETY: source inside the ring block, destination inside the pinned staging area (checked).
            let rc = unsafe {
                cu::cuMemcpyDtoHAsync_v2(
                    self.staging.add(dst) as *mut c_void,
                    self.ring + src as u64 * 8,
                    words * 8,
                    self.dev.stream,
                )
            };
            ok = rc == cu::CUresult::CUDA_SUCCESS;
        }
        // SAFETY: our own stream; waits for the copies above before the staging area is read.
        ok &= unsafe { cu::cuStreamSynchronize(self.dev.stream) } == cu::CUresult::CUDA_SUCCESS;
        // SAFETY: `len` words of pinned memory owned by this value, no copy in flight.
        ok.then(|| unsafe { std::slice::from_raw_parts(self.staging, self.len) })
    }
}
