//! The RFC device hook (NVIDIA/nccl PR #2285): the CUDA hook module, the per-(communicator, channel)
//! rings it writes, the drain that reads them, and the GPU clock calibration.
//!
//! STUB until the device-hook work lands: no hook is offered, nothing is drained.

use std::ffi::c_void;

use crate::sink::Sink;

/// `getDeviceHook(cudaDev, devHook, devCtx)` for communicator `comm` (the one whose `init` just ran on
/// this thread, if any). Returns with `*dev_hook = null` when no hook is available.
///
/// # Safety
/// `dev_hook` and `dev_ctx` are NULL or valid for writes.
pub unsafe fn get_device_hook(_cuda_dev: i32, _comm: Option<u32>, dev_hook: *mut *mut c_void, dev_ctx: *mut *mut c_void) {
    // SAFETY: the caller guarantees the pointers are NULL or writable.
    unsafe {
        if !dev_hook.is_null() {
            *dev_hook = std::ptr::null_mut();
        }
        if !dev_ctx.is_null() {
            *dev_ctx = std::ptr::null_mut();
        }
    }
}

/// Called from the forwarding thread's loop: moves completed device records into the segment.
/// Returns how many records it produced (0 lets the loop back off).
pub fn drain(_out: &mut dyn Sink) -> usize {
    0
}

/// The communicator is being finalized: drain its rings and free them once no kernel can write them.
pub fn finalize_comm(_comm: u32, _out: &mut dyn Sink) {}
