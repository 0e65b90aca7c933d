//! What the hosting NCCL is, and its logger.
//!
//! The plugin never links an NCCL symbol (NCCL dlopens plugins with RTLD_NOW: one unresolved symbol and
//! the whole plugin is rejected). Instead it finds libnccl through the `logfn` NCCL passes to `init`:
//! `dladdr(logfn)` names the library, `dlopen(path, RTLD_NOLOAD)` gets a handle without loading anything,
//! and `dlsym` looks up `ncclGetVersion` and `ncclProfilerDevFuncName` (present only on an RFC host).
//! Without a handle it falls back to `dlsym(RTLD_DEFAULT)`.

use std::ffi::{CStr, CString, c_char, c_int, c_ulong, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::abi::{DevFuncNameFn, GetVersionFn, Logger, NCCL_SUCCESS};

/// First NCCL whose `ncclProfiler_v7` passes 136-byte v7 descriptors.
pub const FIRST_V7_VERSION: u32 = 23100;

/// The hosting NCCL, as far as it could be found out.
#[derive(Clone, Copy, Debug)]
pub struct HostInfo {
    /// `ncclGetVersion`, e.g. 22809 for 2.28.9; None when it could not be asked.
    pub version: Option<u32>,
    /// `ncclProfilerDevFuncName`: present only on an NCCL with the device-hook RFC.
    pub dev_func_name: Option<DevFuncNameFn>,
}

impl HostInfo {
    pub fn is_rfc(&self) -> bool {
        self.dev_func_name.is_some()
    }

    /// "2.28.9", or "of unknown version".
    pub fn version_text(&self) -> String {
        match self.version {
            Some(v) => format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100),
            None => "of unknown version".to_string(),
        }
    }

    /// Whether `ncclProfiler_v7` receives upstream v7 (136-byte) descriptors: an upstream NCCL >= 2.31.
    /// An RFC host passes v6 descriptors; an unknown version is treated as v6 (the safe subset).
    pub fn v7_descriptors(&self) -> bool {
        !self.is_rfc() && self.version.is_some_and(|v| v >= FIRST_V7_VERSION)
    }
}

/// Finds the hosting NCCL from the logger it passed to `init`.
pub fn detect(logfn: Option<Logger>) -> HostInfo {
    let handle = logfn.map_or(std::ptr::null_mut(), |f| library_of(f as *const c_void));
    let get_version: Option<GetVersionFn> = lookup(handle, c"ncclGetVersion")
        // SAFETY: a non-NULL `ncclGetVersion` has this signature in every NCCL.
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, GetVersionFn>(p) });
    let dev_func_name: Option<DevFuncNameFn> = lookup(handle, c"ncclProfilerDevFuncName")
        // SAFETY: the RFC declares `const char* ncclProfilerDevFuncName(int funcId)`.
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, DevFuncNameFn>(p) });
    if !handle.is_null() {
        // SAFETY: `handle` came from a successful dlopen(RTLD_NOLOAD), which took a reference we return;
        // the library stays loaded (NCCL uses it), so the symbols above stay valid.
        unsafe { libc::dlclose(handle) };
    }
    let version = get_version.and_then(|f| {
        let mut v: c_int = 0;
        // SAFETY: `f` is ncclGetVersion; `v` is a valid out pointer.
        let rc = unsafe { f(&mut v) };
        (rc == NCCL_SUCCESS && v > 0).then_some(v as u32)
    });
    HostInfo {
        version,
        dev_func_name,
    }
}

/// A handle (with a reference taken) to the already-loaded library that contains `addr`, or NULL.
fn library_of(addr: *const c_void) -> *mut c_void {
    // SAFETY: Dl_info is plain data; all-zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only inspects the address; `info` is a valid out pointer.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the dynamic linker; RTLD_NOLOAD never loads
    // anything new, it only returns a handle to a library already in the process.
    unsafe { libc::dlopen(info.dli_fname, libc::RTLD_NOW | libc::RTLD_NOLOAD) }
}

/// Keeps this library mapped for the life of the process. NCCL dlcloses the plugin when its last
/// communicator is destroyed, but the forwarding thread keeps running (a later communicator reuses it),
/// so its code must never be unmapped. Returns false if the library could not be pinned.
pub fn pin_self() -> bool {
    // SAFETY: Dl_info is plain data; all-zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only inspects the address of one of our own functions.
    if unsafe { libc::dladdr(pin_self as *const c_void, &mut info) } == 0
        || info.dli_fname.is_null()
    {
        return false;
    }
    // SAFETY: RTLD_NOLOAD only takes a reference to a library already loaded (this one); RTLD_NODELETE
    // makes later dlcloses leave it mapped. The reference is deliberately never released.
    let handle = unsafe {
        libc::dlopen(
            info.dli_fname,
            libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE,
        )
    };
    if !handle.is_null() {
        return true;
    }
    // Linked into the executable itself (NCCL_PROFILER_PLUGIN=STATIC_PLUGIN, benchmarks): never unloaded.
    // SAFETY: dli_fname is a NUL-terminated path owned by the dynamic linker.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    let exe = std::env::current_exe().ok();
    std::fs::canonicalize(path)
        .ok()
        .is_some_and(|p| Some(p) == exe)
}

/// `dlsym` in `handle`, or in the global scope when there is no handle.
fn lookup(handle: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    let scope = if handle.is_null() {
        libc::RTLD_DEFAULT
    } else {
        handle
    };
    // SAFETY: `scope` is RTLD_DEFAULT or a live handle; `name` is NUL-terminated.
    let p = unsafe { libc::dlsym(scope, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// NCCL's logger, kept from the first `init` that passed one.
static LOGGER: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// Messages already logged by [`log_once`].
static LOGGED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

const NCCL_LOG_WARN: c_int = 2;
const NCCL_LOG_INFO: c_int = 3;
const NCCL_INIT: c_ulong = 0x1;
const NCCL_PROFILE: c_ulong = 0x4000;

pub fn set_logger(logfn: Option<Logger>) {
    if let Some(f) = logfn {
        let _ = LOGGER.compare_exchange(
            std::ptr::null_mut(),
            f as *mut c_void,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

/// Logs through NCCL's logger (shown with NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT or PROFILE).
pub fn log(warn: bool, msg: &str) {
    let p = LOGGER.load(Ordering::Acquire);
    if p.is_null() {
        return;
    }
    // SAFETY: the only non-NULL value ever stored is a `Logger` passed to us by NCCL.
    let f: Logger = unsafe { std::mem::transmute::<*mut c_void, Logger>(p) };
    let Ok(text) = CString::new(format!("NCCLSCOPE: {msg}")) else {
        return;
    };
    let level = if warn { NCCL_LOG_WARN } else { NCCL_LOG_INFO };
    // SAFETY: NCCL's logger is printf-like; "%s" consumes exactly the one string argument we pass.
    unsafe {
        f(
            level,
            NCCL_INIT | NCCL_PROFILE,
            c"ncclscope".as_ptr(),
            line!() as c_int,
            c"%s".as_ptr(),
            text.as_ptr(),
        )
    };
}

/// Logs `msg` the first time `key` is seen in this process.
pub fn log_once(key: &'static str, warn: bool, msg: &str) {
    let Ok(mut seen) = LOGGED.lock() else { return };
    if seen.contains(&key) {
        return;
    }
    seen.push(key);
    drop(seen);
    log(warn, msg);
}

/// Reads a NUL-terminated string NCCL passed (may be NULL); copied, lossily decoded.
///
/// # Safety
/// `p` is NULL or points at a NUL-terminated string valid for the call.
pub unsafe fn c_string(p: *const c_char) -> Option<Vec<u8>> {
    // SAFETY: per the function's contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_bytes().to_vec())
}
