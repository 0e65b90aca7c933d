//! The NCCL profiler plugin ABI (v5, v6, upstream v7 and the device-hook RFC's v7), written by hand from
//! /work/shared/reference/nccl-profiler-abi.md. Only the members the plugin reads are spelled out; every
//! offset is asserted at compile time.
//!
//! Descriptors are never copied whole: the entry points read single fields through raw pointers, so a
//! 112-byte descriptor is never read past byte 112 even when it is viewed through the 136-byte v7 type.

use std::ffi::{CStr, c_char, c_int, c_ulong, c_void};
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicI32, AtomicPtr, Ordering};

/// `ncclResult_t`, a 4-byte C enum.
pub type NcclResult = c_int;
pub const NCCL_SUCCESS: NcclResult = 0;

/// `ncclDebugLogger_t`: `void(int level, unsigned long flags, const char* file, int line, const char* fmt, ...)`.
pub type Logger = unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...);

/// `ncclGetVersion(int*)`, exported by libnccl.
pub type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
/// `ncclProfilerDevFuncName(int funcId)`, exported by an RFC-patched libnccl only.
pub type DevFuncNameFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// Event-type bits (descriptor `type`, activation mask).
pub mod event {
    pub const GROUP: u64 = 0x1;
    pub const COLL: u64 = 0x2;
    pub const P2P: u64 = 0x4;
    pub const KERNEL_CH: u64 = 0x40;
    /// API events: NCCL starts them whenever Coll/P2p (or their children) are in the mask, and makes
    /// the API event the Coll's / P2p's `parentObj`.
    pub const GROUP_API: u64 = 0x100;
    pub const COLL_API: u64 = 0x200;
    pub const P2P_API: u64 = 0x400;
    /// v7 (NCCL >= 2.31) only.
    pub const KERNEL_PHASE: u64 = 0x8000;
}

/// `ncclProfilerEventState_t` values the plugin handles (a plain integer: NCCL may pass values we don't know).
pub mod state {
    /// `ncclProfilerKernelChStop`: args carry the stop `pTimer`.
    pub const KERNEL_CH_STOP: u32 = 22;
    /// `ncclProfilerKernelPhaseStop` (v7): args carry the phase stop `pTimer`.
    pub const KERNEL_PHASE_STOP: u32 = 31;
}

/// `coll` union member, v5/v6 layout (88 bytes, descriptor offsets 24..112).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CollV6 {
    pub seq_number: u64,
    pub func: *const c_char,
    pub send_buff: *const c_void,
    pub recv_buff: *mut c_void,
    pub count: usize,
    pub root: c_int,
    pub datatype: *const c_char,
    pub n_channels: u8,
    pub n_warps: u8,
    pub algo: *const c_char,
    pub proto: *const c_char,
    pub parent_group: *mut c_void,
}

/// `coll` union member, upstream v7 layout: v6's members followed by three new ones.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CollV7 {
    pub v6: CollV6,
    pub kernel_variant: *const c_char,
    pub is_sym_coll: bool,
    pub user_tag: u64,
}

/// `p2p` union member, v5/v6 layout.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct P2pV6 {
    pub func: *const c_char,
    pub buff: *mut c_void,
    pub datatype: *const c_char,
    pub count: usize,
    pub peer: c_int,
    pub n_channels: u8,
    pub parent_group: *mut c_void,
}

/// `groupApi` union member (all versions).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct GroupApi {
    /// C `bool`, read as a byte (any non-zero value is true).
    pub graph_captured: u8,
    pub group_depth: c_int,
}

/// `collApi` union member, v5/v6 fields (v7 appends `userTag`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CollApi {
    pub func: *const c_char,
    pub count: usize,
    pub datatype: *const c_char,
    pub root: c_int,
    pub stream: *mut c_void,
    /// C `bool`, read as a byte (any non-zero value is true).
    pub graph_captured: u8,
}

/// `p2pApi` union member, v5/v6 fields (v7 appends `userTag`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct P2pApi {
    pub func: *const c_char,
    pub count: usize,
    pub datatype: *const c_char,
    pub stream: *mut c_void,
    /// C `bool`, read as a byte (any non-zero value is true).
    pub graph_captured: u8,
}

/// `kernelCh` union member (all versions).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernelCh {
    pub channel_id: u8,
    pub p_timer: u64,
}

/// `kernelPhase` union member (v7 only).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernelPhase {
    pub channel_id: u8,
    pub phase_id: u8,
    pub phase_name: *const c_char,
    pub p_timer: u64,
}

/// The descriptor union of v5 and v6 (v6 only adds CE members, which the plugin does not read).
#[repr(C)]
pub union UnionV6 {
    pub group_api: GroupApi,
    pub coll_api: CollApi,
    pub p2p_api: P2pApi,
    pub coll: CollV6,
    pub p2p: P2pV6,
    pub kernel_ch: KernelCh,
    size: [u64; 11],
}

/// The descriptor union of upstream v7.
#[repr(C)]
pub union UnionV7 {
    pub coll: CollV7,
    pub p2p: P2pV6,
    pub kernel_ch: KernelCh,
    pub kernel_phase: KernelPhase,
    size: [u64; 14],
}

/// `ncclProfilerEventDescr_vN_t`: a header and a union tagged by `type_`.
#[repr(C)]
pub struct Descr<U> {
    pub type_: u64,
    pub parent_obj: *mut c_void,
    pub rank: c_int,
    pub u: U,
}
/// v5 and v6 descriptors (112 bytes); also what an RFC host passes to its `ncclProfiler_v7`.
pub type DescrV6 = Descr<UnionV6>;
/// Upstream v7 descriptors (136 bytes, NCCL >= 2.31).
pub type DescrV7 = Descr<UnionV7>;

/// `ncclProfilerEventStateArgs_t`: an 8-byte union; the plugin only reads `kernelCh.pTimer` at offset 0.
#[repr(C)]
pub struct StateArgs {
    pub p_timer: u64,
}

/// A static C string owned by NCCL ("AllReduce", "ncclFloat32", ...), as a descriptor names it: NCCL's
/// threads hand it to the forwarding thread, which reads it.
#[derive(Clone, Copy, Debug)]
pub struct CText(*const c_char);
// SAFETY: it points at a NUL-terminated string NCCL never frees or changes (static storage); reading
// it from another thread is what NCCL's own plugins do.
unsafe impl Send for CText {}

impl CText {
    /// # Safety
    /// `p` is NULL or a NUL-terminated string that NCCL never frees or changes.
    pub unsafe fn new(p: *const c_char) -> CText {
        CText(p)
    }

    /// The string's address: the same string of NCCL's is always at the same one.
    pub fn addr(self) -> usize {
        self.0 as usize
    }

    /// The string's bytes (None for NULL).
    pub fn bytes(self) -> Option<&'static [u8]> {
        // SAFETY: a non-NULL `p` is a static NUL-terminated string (see `new`).
        (!self.0.is_null()).then(|| unsafe { CStr::from_ptr(self.0) }.to_bytes())
    }
}

/// NCCL's activation mask (`ncclProfilerEventMask`: one int for the process, read by NCCL with atomic
/// loads), as `init` hands it over.
///
/// # Safety
/// `p` is NULL or NCCL's activation-mask global: aligned, alive as long as the process, accessed
/// atomically by everyone.
pub unsafe fn activation_mask(p: *mut c_int) -> Option<&'static AtomicI32> {
    // SAFETY: per this function's contract.
    (!p.is_null()).then(|| unsafe { AtomicI32::from_ptr(p) })
}

/// Where NCCL's activation mask lives: a later `init` may pass another address.
pub struct MaskSlot(AtomicPtr<AtomicI32>);

impl MaskSlot {
    pub const fn new() -> MaskSlot {
        MaskSlot(AtomicPtr::new(std::ptr::null_mut()))
    }

    pub fn set(&self, mask: Option<&'static AtomicI32>) {
        let p = mask.map_or(std::ptr::null(), |m| m as *const AtomicI32);
        self.0.store(p.cast_mut(), Ordering::Release);
    }

    /// Stores `value` in the mask, if one was set.
    pub fn store(&self, value: i32) {
        let p = self.0.load(Ordering::Acquire);
        // SAFETY: only `set` stores a pointer here, from a `&'static AtomicI32`.
        if let Some(mask) = unsafe { p.as_ref() } {
            mask.store(value, Ordering::Relaxed);
        }
    }
}

/// A C string pointer that may live in a `static` (the plugin's name).
#[repr(transparent)]
pub struct StaticCStr(pub *const c_char);
// SAFETY: it only ever points at a 'static, immutable C string literal.
unsafe impl Sync for StaticCStr {}

/// `ncclProfiler_vN_t` (v5, v6, upstream v7): 48 bytes, six members.
#[repr(C)]
pub struct Profiler<D> {
    pub name: StaticCStr,
    pub init: unsafe extern "C" fn(
        *mut *mut c_void,
        u64,
        *mut c_int,
        *const c_char,
        c_int,
        c_int,
        c_int,
        Option<Logger>,
    ) -> NcclResult,
    pub start_event: unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut D) -> NcclResult,
    pub stop_event: unsafe extern "C" fn(*mut c_void) -> NcclResult,
    pub record_event_state: unsafe extern "C" fn(*mut c_void, u32, *mut StateArgs) -> NcclResult,
    pub finalize: unsafe extern "C" fn(*mut c_void) -> NcclResult,
}

/// `getDeviceHook(int cudaDev, void** devHook, void** devCtx)`.
pub type GetDeviceHookFn =
    unsafe extern "C" fn(c_int, *mut *mut c_void, *mut *mut c_void) -> NcclResult;

/// Our `ncclProfiler_v7`: the upstream 48-byte layout (which stock NCCL reads) with the RFC's
/// `getDeviceHook` appended at offset 48 (which only an RFC host reads).
#[repr(C)]
pub struct ProfilerV7 {
    pub base: Profiler<DescrV7>,
    pub get_device_hook: GetDeviceHookFn,
}

const _: () = {
    assert!(size_of::<Profiler<DescrV6>>() == 48);
    assert!(size_of::<Profiler<DescrV7>>() == 48);
    assert!(offset_of!(Profiler<DescrV6>, init) == 8);
    assert!(offset_of!(Profiler<DescrV6>, start_event) == 16);
    assert!(offset_of!(Profiler<DescrV6>, stop_event) == 24);
    assert!(offset_of!(Profiler<DescrV6>, record_event_state) == 32);
    assert!(offset_of!(Profiler<DescrV6>, finalize) == 40);
    assert!(size_of::<ProfilerV7>() == 56);
    assert!(offset_of!(ProfilerV7, get_device_hook) == 48);

    assert!(size_of::<DescrV6>() == 112);
    assert!(size_of::<DescrV7>() == 136);
    assert!(offset_of!(DescrV6, type_) == 0);
    assert!(offset_of!(DescrV6, parent_obj) == 8);
    assert!(offset_of!(DescrV6, rank) == 16);
    assert!(offset_of!(DescrV6, u) == 24);
    assert!(offset_of!(DescrV7, u) == 24);

    // coll (absolute offsets = 24 + member offset).
    assert!(24 + offset_of!(CollV6, seq_number) == 24);
    assert!(24 + offset_of!(CollV6, func) == 32);
    assert!(24 + offset_of!(CollV6, count) == 56);
    assert!(24 + offset_of!(CollV6, root) == 64);
    assert!(24 + offset_of!(CollV6, datatype) == 72);
    assert!(24 + offset_of!(CollV6, n_channels) == 80);
    assert!(24 + offset_of!(CollV6, n_warps) == 81);
    assert!(24 + offset_of!(CollV6, algo) == 88);
    assert!(24 + offset_of!(CollV6, proto) == 96);
    assert!(24 + offset_of!(CollV6, parent_group) == 104);
    assert!(24 + size_of::<CollV6>() == 112);
    assert!(24 + offset_of!(CollV7, kernel_variant) == 112);
    assert!(24 + offset_of!(CollV7, is_sym_coll) == 120);
    assert!(24 + offset_of!(CollV7, user_tag) == 128);
    assert!(24 + size_of::<CollV7>() == 136);

    // p2p.
    assert!(24 + offset_of!(P2pV6, func) == 24);
    assert!(24 + offset_of!(P2pV6, datatype) == 40);
    assert!(24 + offset_of!(P2pV6, count) == 48);
    assert!(24 + offset_of!(P2pV6, peer) == 56);
    assert!(24 + offset_of!(P2pV6, n_channels) == 60);
    assert!(24 + offset_of!(P2pV6, parent_group) == 64);

    // API events.
    assert!(24 + offset_of!(GroupApi, graph_captured) == 24);
    assert!(24 + offset_of!(GroupApi, group_depth) == 28);
    assert!(24 + offset_of!(CollApi, datatype) == 40);
    assert!(24 + offset_of!(CollApi, root) == 48);
    assert!(24 + offset_of!(CollApi, stream) == 56);
    assert!(24 + offset_of!(CollApi, graph_captured) == 64);
    assert!(24 + offset_of!(P2pApi, stream) == 48);
    assert!(24 + offset_of!(P2pApi, graph_captured) == 56);

    // kernelCh and kernelPhase.
    assert!(24 + offset_of!(KernelCh, channel_id) == 24);
    assert!(24 + offset_of!(KernelCh, p_timer) == 32);
    assert!(24 + offset_of!(KernelPhase, channel_id) == 24);
    assert!(24 + offset_of!(KernelPhase, phase_id) == 25);
    assert!(24 + offset_of!(KernelPhase, phase_name) == 32);
    assert!(24 + offset_of!(KernelPhase, p_timer) == 40);

    assert!(size_of::<StateArgs>() == 8);
};
