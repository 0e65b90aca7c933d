//! The C ABI surface: `ncclProfiler_v5`, `_v6` and `_v7` and their thin entry points.
//!
//! Each entry point checks its pointers, reads the fields it needs out of NCCL's descriptor (never more
//! than the descriptor version it was given holds), and hands safe values to [`crate::profiler`] inside
//! `catch_unwind`. Every entry point returns `ncclSuccess`; a panic disables the plugin instead of
//! unwinding into NCCL.

#![allow(non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::abi::{
    DescrV6, DescrV7, Logger, NCCL_SUCCESS, NcclResult, Profiler, ProfilerV7, StateArgs,
    StaticCStr, event,
};
use crate::event::CText;
use crate::launch;
use crate::profiler::{self, CollInfo, P2pInfo, Start};
use crate::{abi, devhook, host};

const NAME: StaticCStr = StaticCStr(c"ncclscope".as_ptr());

/// NCCL 2.28.
#[unsafe(no_mangle)]
pub static ncclProfiler_v5: Profiler<DescrV6> = Profiler {
    name: NAME,
    init: init_v5,
    start_event: start_v6,
    stop_event: stop,
    record_event_state: record,
    finalize,
};

/// NCCL 2.29 - 2.30.
#[unsafe(no_mangle)]
pub static ncclProfiler_v6: Profiler<DescrV6> = Profiler {
    name: NAME,
    init: init_v6,
    start_event: start_v6,
    stop_event: stop,
    record_event_state: record,
    finalize,
};

/// Upstream NCCL >= 2.31 (reads the first 48 bytes) and an RFC host (also reads `getDeviceHook`).
#[unsafe(no_mangle)]
pub static ncclProfiler_v7: ProfilerV7 = ProfilerV7 {
    base: Profiler {
        name: NAME,
        init: init_v7,
        start_event: start_v7,
        stop_event: stop,
        record_event_state: record,
        finalize,
    },
    get_device_hook,
};

/// Runs `f`, turning a panic into a disabled plugin.
fn guard(what: &str, f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        profiler::fail(what);
    }
}

macro_rules! init_fn {
    ($name:ident, $abi:literal) => {
        unsafe extern "C" fn $name(
            ctx: *mut *mut c_void,
            comm_hash: u64,
            mask: *mut c_int,
            name: *const c_char,
            nnodes: c_int,
            nranks: c_int,
            rank: c_int,
            logfn: Option<Logger>,
        ) -> NcclResult {
            // SAFETY: NCCL passes a writable context pointer, its mask global and a C string (or NULLs).
            unsafe {
                init(
                    ctx, $abi, comm_hash, mask, name, nnodes, nranks, rank, logfn,
                )
            }
        }
    };
}
init_fn!(init_v5, 5);
init_fn!(init_v6, 6);
init_fn!(init_v7, 7);

/// # Safety
/// `ctx` is NULL or writable; `mask` is NULL or NCCL's activation-mask global; `name` is NULL or a
/// NUL-terminated string.
#[allow(clippy::too_many_arguments)]
unsafe fn init(
    ctx: *mut *mut c_void,
    abi: u32,
    comm_hash: u64,
    mask: *mut c_int,
    name: *const c_char,
    nnodes: c_int,
    nranks: c_int,
    rank: c_int,
    logfn: Option<Logger>,
) -> NcclResult {
    if ctx.is_null() {
        return NCCL_SUCCESS;
    }
    // SAFETY: `ctx` is non-NULL and NCCL's out pointer.
    unsafe { *ctx = std::ptr::null_mut() };
    guard("init", || {
        // SAFETY: per this function's contract.
        let (mask, name) = unsafe { (abi::activation_mask(mask), host::c_string(name)) };
        let name = name.unwrap_or_default();
        let c = launch::init(abi, comm_hash, mask, name, nnodes, nranks, rank, logfn);
        // SAFETY: `ctx` is non-NULL and NCCL's out pointer.
        unsafe { *ctx = c };
    });
    NCCL_SUCCESS
}

/// Reads a v5/v6 descriptor (112 bytes). Also used for the v6 part of a v7 descriptor.
///
/// # Safety
/// `d` points at a readable descriptor of at least 112 bytes whose union member matches `type_`.
unsafe fn read_v6(d: *const DescrV6) -> (*mut c_void, Start) {
    // SAFETY: per the contract; each read touches one field inside the first 112 bytes, and the union
    // member read is the one `type_` says NCCL filled in.
    unsafe {
        let start = match (*d).type_ {
            event::GROUP => Start::Group,
            event::GROUP_API => Start::Api {
                captured: (*d).u.group_api.graph_captured != 0,
            },
            event::COLL_API => Start::Api {
                captured: (*d).u.coll_api.graph_captured != 0,
            },
            event::P2P_API => Start::Api {
                captured: (*d).u.p2p_api.graph_captured != 0,
            },
            event::COLL => {
                let c = &raw const (*d).u.coll;
                Start::Coll(CollInfo {
                    seq: (*c).seq_number,
                    func: CText::new((*c).func),
                    datatype: CText::new((*c).datatype),
                    algo: CText::new((*c).algo),
                    proto: CText::new((*c).proto),
                    count: (*c).count as u64,
                    root: (*c).root,
                    n_channels: (*c).n_channels,
                    n_warps: (*c).n_warps,
                })
            }
            event::P2P => {
                let p = &raw const (*d).u.p2p;
                Start::P2p(P2pInfo {
                    func: CText::new((*p).func),
                    datatype: CText::new((*p).datatype),
                    count: (*p).count as u64,
                    peer: (*p).peer,
                    n_channels: (*p).n_channels,
                })
            }
            event::KERNEL_CH => {
                let k = &raw const (*d).u.kernel_ch;
                Start::KernelCh {
                    channel: (*k).channel_id,
                    p_timer: (*k).p_timer,
                }
            }
            _ => Start::Other,
        };
        ((*d).parent_obj, start)
    }
}

/// # Safety
/// `d` points at a descriptor that is 136 bytes if `v7_fields` (upstream NCCL >= 2.31) and at least 112
/// otherwise (an RFC host, or an unknown version treated conservatively).
unsafe fn read_v7(d: *const DescrV7, v7_fields: bool) -> (*mut c_void, Start) {
    // SAFETY: v7 keeps every v6 member at the same offset, so the first 112 bytes read as v6.
    let (parent, mut start) = unsafe { read_v6(d.cast::<DescrV6>()) };
    if !v7_fields {
        return (parent, start);
    }
    // SAFETY: upstream v7 host: the descriptor is 136 bytes and `type_` tags the union member read.
    unsafe {
        match (&mut start, (*d).type_) {
            (Start::Coll(c), event::COLL) => {
                let v7 = &raw const (*d).u.coll;
                // Symmetric kernels name their variant here; `algo` is only its suffix.
                if (*v7).is_sym_coll && !(*v7).kernel_variant.is_null() {
                    c.algo = CText::new((*v7).kernel_variant);
                }
            }
            (Start::Other, event::KERNEL_PHASE) => {
                let k = &raw const (*d).u.kernel_phase;
                start = Start::KernelPhase {
                    channel: (*k).channel_id,
                    phase: (*k).phase_id,
                    p_timer: (*k).p_timer,
                };
            }
            _ => {}
        }
    }
    (parent, start)
}

/// # Safety
/// `handle` is NULL or writable.
unsafe fn start_with(
    ctx: *mut c_void,
    handle: *mut *mut c_void,
    read: impl FnOnce(&profiler::Plugin) -> (*mut c_void, Start),
) -> NcclResult {
    if handle.is_null() {
        return NCCL_SUCCESS;
    }
    // SAFETY: non-NULL out pointer from NCCL. Declined unless set below.
    unsafe { *handle = std::ptr::null_mut() };
    let Some(plugin) = profiler::plugin() else {
        return NCCL_SUCCESS;
    };
    guard("startEvent", || {
        let (parent, start) = read(plugin);
        let h = plugin.start(ctx, parent, start);
        // SAFETY: as above.
        unsafe { *handle = h };
    });
    NCCL_SUCCESS
}

unsafe extern "C" fn start_v6(
    ctx: *mut c_void,
    handle: *mut *mut c_void,
    descr: *mut DescrV6,
) -> NcclResult {
    if descr.is_null() {
        return NCCL_SUCCESS;
    }
    // SAFETY: NCCL passes its out pointer and a v5/v6 descriptor to this version's startEvent.
    unsafe { start_with(ctx, handle, |_| read_v6(descr)) }
}

unsafe extern "C" fn start_v7(
    ctx: *mut c_void,
    handle: *mut *mut c_void,
    descr: *mut DescrV7,
) -> NcclResult {
    if descr.is_null() {
        return NCCL_SUCCESS;
    }
    // SAFETY: an upstream >= 2.31 host passes 136-byte descriptors (`v7_descriptors`); any other host
    // reaching `_v7` (the RFC) passes 112-byte ones, of which only v6 fields are read.
    unsafe { start_with(ctx, handle, |p| read_v7(descr, p.host.v7_descriptors())) }
}

unsafe extern "C" fn stop(handle: *mut c_void) -> NcclResult {
    if let Some(plugin) = profiler::plugin() {
        guard("stopEvent", || plugin.stop(handle));
    }
    NCCL_SUCCESS
}

unsafe extern "C" fn record(handle: *mut c_void, state: u32, args: *mut StateArgs) -> NcclResult {
    if let Some(plugin) = profiler::plugin() {
        // SAFETY: NCCL passes NULL or its 8-byte state-args union; `p_timer` is at offset 0.
        let p_timer = (!args.is_null()).then(|| unsafe { (*args).p_timer });
        guard("recordEventState", || {
            plugin.record_state(handle, state, p_timer)
        });
    }
    NCCL_SUCCESS
}

unsafe extern "C" fn finalize(ctx: *mut c_void) -> NcclResult {
    if let Some(plugin) = profiler::plugin() {
        guard("finalize", || plugin.finalize(ctx));
    }
    NCCL_SUCCESS
}

/// The RFC's `getDeviceHook(int cudaDev, void** devHook, void** devCtx)`: called once per communicator,
/// right after its `init`, on the same thread.
unsafe extern "C" fn get_device_hook(
    cuda_dev: c_int,
    dev_hook: *mut *mut c_void,
    dev_ctx: *mut *mut c_void,
) -> NcclResult {
    let clear = || {
        for p in [dev_hook, dev_ctx] {
            if !p.is_null() {
                // SAFETY: non-NULL out pointers from NCCL.
                unsafe { *p = std::ptr::null_mut() };
            }
        }
    };
    clear();
    let Some(plugin) = profiler::plugin() else {
        return NCCL_SUCCESS;
    };
    let offered = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: NCCL's out pointers (NULL or writable), as devhook requires.
        unsafe { devhook::get_device_hook(cuda_dev, plugin.last_init_comm(), dev_hook, dev_ctx) };
        // SAFETY: as above.
        let active = !dev_hook.is_null() && !unsafe { *dev_hook }.is_null();
        plugin.device_hook_offered(cuda_dev, active);
    }));
    if offered.is_err() {
        clear();
        profiler::fail("getDeviceHook");
    }
    NCCL_SUCCESS
}
