//! NCCL's side of the profiler ABI, written independently of the plugin's own `#[repr(C)]` types (from
//! /work/shared/reference/nccl-profiler-abi.md): descriptors are filled by byte offset, so a layout
//! mistake on either side shows up as a wrong record in the tests.

use std::ffi::{c_char, c_int, c_ulong, c_void};

/// `ncclDebugLogger_t`.
pub type Logger = unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...);
pub type InitFn = unsafe extern "C" fn(
    *mut *mut c_void,
    u64,
    *mut c_int,
    *const c_char,
    c_int,
    c_int,
    c_int,
    Option<Logger>,
) -> c_int;
pub type StartFn = unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut u8) -> c_int;
pub type StopFn = unsafe extern "C" fn(*mut c_void) -> c_int;
pub type RecordFn = unsafe extern "C" fn(*mut c_void, c_int, *mut u64) -> c_int;
pub type FinalizeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
/// The RFC's `getDeviceHook(int cudaDev, void** devHook, void** devCtx)` at offset 48 of its `_v7`.
pub type GetDeviceHookFn = unsafe extern "C" fn(c_int, *mut *mut c_void, *mut *mut c_void) -> c_int;
/// The device hook, called by the (simulated) kernel: `hook(&ev, devCtx)`.
pub type HookFn = unsafe extern "C" fn(*const DevEvent, *mut c_void);

/// `ncclProfiler_vN_t` as NCCL reads it: the first 48 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Vtable {
    pub name: *const c_char,
    pub init: InitFn,
    pub start_event: StartFn,
    pub stop_event: StopFn,
    pub record_event_state: RecordFn,
    pub finalize: FinalizeFn,
}
const _: () = assert!(size_of::<Vtable>() == 48);

/// `ncclProfiler_v7` as an RFC host reads it: the six methods, then `getDeviceHook` at offset 48.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RfcVtable {
    pub base: Vtable,
    pub get_device_hook: GetDeviceHookFn,
}
const _: () =
    assert!(size_of::<RfcVtable>() == 56 && std::mem::offset_of!(RfcVtable, get_device_hook) == 48);

/// The RFC device event (24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DevEvent {
    pub timestamp: u64,
    pub work_counter: u64,
    pub func_id: u32,
    pub channel_id: u8,
    /// 0 = START, 1 = STOP.
    pub phase: u8,
    pub rsvd: u16,
}
const _: () =
    assert!(size_of::<DevEvent>() == 24 && std::mem::offset_of!(DevEvent, channel_id) == 20);

/// Event-type bits.
pub mod event {
    pub const GROUP: u64 = 0x1;
    pub const COLL: u64 = 0x2;
    pub const P2P: u64 = 0x4;
    pub const PROXY_OP: u64 = 0x8;
    pub const KERNEL_CH: u64 = 0x40;
    pub const GROUP_API: u64 = 0x100;
    pub const COLL_API: u64 = 0x200;
    pub const P2P_API: u64 = 0x400;
    pub const KERNEL_PHASE: u64 = 0x8000;
}

/// State values.
pub mod state {
    pub const KERNEL_CH_STOP: i32 = 22;
    pub const GROUP_START_API_STOP: i32 = 23;
    pub const GROUP_END_API_START: i32 = 24;
    pub const KERNEL_PHASE_STOP: i32 = 31;
}

/// Descriptor byte offsets.
pub mod off {
    pub const TYPE: usize = 0;
    pub const PARENT: usize = 8;
    pub const RANK: usize = 16;
    pub const GROUPAPI_CAPTURED: usize = 24;
    pub const GROUPAPI_DEPTH: usize = 28;
    pub const COLLAPI_FUNC: usize = 24;
    pub const COLLAPI_COUNT: usize = 32;
    pub const COLLAPI_DATATYPE: usize = 40;
    pub const COLLAPI_ROOT: usize = 48;
    pub const COLLAPI_STREAM: usize = 56;
    pub const COLLAPI_CAPTURED: usize = 64;
    pub const P2PAPI_FUNC: usize = 24;
    pub const P2PAPI_COUNT: usize = 32;
    pub const P2PAPI_DATATYPE: usize = 40;
    pub const P2PAPI_STREAM: usize = 48;
    pub const P2PAPI_CAPTURED: usize = 56;
    pub const COLL_SEQ: usize = 24;
    pub const COLL_FUNC: usize = 32;
    pub const COLL_SEND: usize = 40;
    pub const COLL_RECV: usize = 48;
    pub const COLL_COUNT: usize = 56;
    pub const COLL_ROOT: usize = 64;
    pub const COLL_DATATYPE: usize = 72;
    pub const COLL_NCHANNELS: usize = 80;
    pub const COLL_NWARPS: usize = 81;
    pub const COLL_ALGO: usize = 88;
    pub const COLL_PROTO: usize = 96;
    pub const COLL_PARENT_GROUP: usize = 104;
    pub const COLL_KERNEL_VARIANT: usize = 112;
    pub const COLL_IS_SYM: usize = 120;
    pub const COLL_USER_TAG: usize = 128;
    pub const P2P_FUNC: usize = 24;
    pub const P2P_BUFF: usize = 32;
    pub const P2P_DATATYPE: usize = 40;
    pub const P2P_COUNT: usize = 48;
    pub const P2P_PEER: usize = 56;
    pub const P2P_NCHANNELS: usize = 60;
    pub const P2P_PARENT_GROUP: usize = 64;
    pub const KCH_CHANNEL: usize = 24;
    pub const KCH_PTIMER: usize = 32;
    pub const KPH_CHANNEL: usize = 24;
    pub const KPH_PHASE: usize = 25;
    pub const KPH_NAME: usize = 32;
    pub const KPH_PTIMER: usize = 40;
}

/// v5/v6 descriptors (and what an RFC host passes).
pub const DESCR_V6_BYTES: usize = 112;
/// Upstream v7 descriptors.
pub const DESCR_V7_BYTES: usize = 136;

/// A descriptor being filled in; `len` bytes, zeroed by the caller (NCCL zero-fills too).
pub struct Descr {
    pub ptr: *mut u8,
    pub len: usize,
}

impl Descr {
    fn put<const N: usize>(&self, at: usize, bytes: [u8; N]) {
        assert!(
            at + N <= self.len,
            "field at {at} outside a {}-byte descriptor",
            self.len
        );
        // SAFETY: `ptr` is valid for `len` bytes (see `GuardedPage::flush_end`), checked above.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(at), N) };
    }
    pub fn u64(&self, at: usize, v: u64) -> &Self {
        self.put(at, v.to_ne_bytes());
        self
    }
    pub fn i32(&self, at: usize, v: i32) -> &Self {
        self.put(at, v.to_ne_bytes());
        self
    }
    pub fn u8(&self, at: usize, v: u8) -> &Self {
        self.put(at, [v]);
        self
    }
    pub fn ptr<T>(&self, at: usize, p: *const T) -> &Self {
        self.u64(at, p as usize as u64)
    }
}
