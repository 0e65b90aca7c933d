//! Stand-ins for the CUDA runtime and driver calls that NCCL's own profiler plugins make outside the
//! host event path, so `fakenccl-bench` can load them on a machine without a GPU (and, for the same
//! code path, on one with a GPU): NCCL Inspector links `libcudart.so.13` (`cudaGetDevice`,
//! `cudaGetErrorString`) and dlopens `libcuda.so.1` (`cuDeviceGet`, `cuDeviceGetUuid`, `cuGetErrorString`) at init; the
//! example plugin references `cudaEvent*` for its CE events, which a host-path benchmark never sends.
//! The benchmark puts copies of this library under those names in a directory on `LD_LIBRARY_PATH` of
//! the peer's process only. Every call succeeds: device 0, a fixed UUID, events that are complete.
//!
//! As `libcuda.so` on a simulated rank's `LD_LIBRARY_PATH` it also gives ncclscope's plugin a GPU
//! identity (`cuCtxGetCurrent`, `cuCtxGetDevice`, `cuDeviceGetUuid_v2`): the device is
//! `FAKENCCL_CUDA_DEVICE` (default 0), its UUID 16 bytes of `device ^ 0x5a`.

use std::ffi::{c_char, c_float, c_int, c_uint, c_void};

const SUCCESS: c_int = 0;

/// `cudaError_t cudaGetDevice(int* device)`.
///
/// # Safety
/// `device` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaGetDevice(device: *mut c_int) -> c_int {
    if !device.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { *device = 0 };
    }
    SUCCESS
}

/// `const char* cudaGetErrorString(cudaError_t)`.
#[unsafe(no_mangle)]
pub extern "C" fn cudaGetErrorString(_error: c_int) -> *const c_char {
    c"no error (fakenccl CUDA stand-in)".as_ptr()
}

/// `cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags)`: a non-NULL dummy.
///
/// # Safety
/// `event` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaEventCreateWithFlags(
    event: *mut *mut c_void,
    _flags: c_uint,
) -> c_int {
    if !event.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { *event = 8 as *mut c_void };
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaEventDestroy(_event: *mut c_void) -> c_int {
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaEventRecord(_event: *mut c_void, _stream: *mut c_void) -> c_int {
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaEventQuery(_event: *mut c_void) -> c_int {
    SUCCESS
}

/// # Safety
/// `ms` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaEventElapsedTime(
    ms: *mut c_float,
    _start: *mut c_void,
    _end: *mut c_void,
) -> c_int {
    if !ms.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { *ms = 0.0 };
    }
    SUCCESS
}

/// `CUresult cuDeviceGet(CUdevice* device, int ordinal)`.
///
/// # Safety
/// `device` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> c_int {
    if !device.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { *device = ordinal };
    }
    SUCCESS
}

/// `CUresult cuInit(unsigned flags)`.
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> c_int {
    SUCCESS
}

/// `CUresult cuCtxGetCurrent(CUcontext* ctx)`: a non-NULL dummy context.
///
/// # Safety
/// `ctx` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> c_int {
    if !ctx.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { *ctx = 16 as *mut c_void };
    }
    SUCCESS
}

/// `CUresult cuCtxGetDevice(CUdevice* device)`: `FAKENCCL_CUDA_DEVICE`, default 0.
///
/// # Safety
/// `device` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut c_int) -> c_int {
    let ordinal = std::env::var("FAKENCCL_CUDA_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if !device.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { *device = ordinal };
    }
    SUCCESS
}

/// `CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice dev)`: as [`cuDeviceGetUuid`].
///
/// # Safety
/// `uuid` is NULL or 16 writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut u8, dev: c_int) -> c_int {
    // SAFETY: the same contract.
    unsafe { cuDeviceGetUuid(uuid, dev) }
}

/// `CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice dev)` (16 bytes).
///
/// # Safety
/// `uuid` is NULL or 16 writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut u8, dev: c_int) -> c_int {
    if !uuid.is_null() {
        // SAFETY: 16 writable bytes per the contract.
        unsafe { std::ptr::write_bytes(uuid, dev as u8 ^ 0x5a, 16) };
    }
    SUCCESS
}

/// `CUresult cuGetErrorString(CUresult error, const char** str)`.
///
/// # Safety
/// `text` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(_error: c_int, text: *mut *const c_char) -> c_int {
    if !text.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { *text = c"no error (fakenccl CUDA stand-in)".as_ptr() };
    }
    SUCCESS
}
