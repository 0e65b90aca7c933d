//! A stand-in for `libnccl.so`, loaded by the fake NCCL host (`ncclscope-fakenccl`) so the plugin finds
//! "NCCL" exactly as it does in a real job: through the logger passed to `init` (`dladdr` names this
//! library, `dlopen(RTLD_NOLOAD)` + `dlsym` find `ncclGetVersion`, and on the RFC build
//! `ncclProfilerDevFuncName`). The host loads it RTLD_LOCAL, so a global `dlsym` would not find it.

use std::ffi::{CStr, c_char, c_int, c_ulong};
use std::sync::atomic::{AtomicI32, Ordering};

static VERSION: AtomicI32 = AtomicI32::new(0);

/// Sets what `ncclGetVersion` reports (e.g. 22809 for 2.28.9). 0 makes it fail, like an unknown NCCL.
#[unsafe(no_mangle)]
pub extern "C" fn fakenccl_set_version(version: c_int) {
    VERSION.store(version, Ordering::Relaxed);
}

/// `ncclResult_t ncclGetVersion(int* version)`.
///
/// # Safety
/// `version` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> c_int {
    let v = VERSION.load(Ordering::Relaxed);
    if version.is_null() || v == 0 {
        return 4; // ncclInvalidArgument
    }
    // SAFETY: non-NULL and writable per the contract.
    unsafe { *version = v };
    0
}

/// NCCL's logger as seen by plugins (`ncclDebugLogger_t`, variadic). This stand-in reads the one string
/// argument that follows a "%s" format (what the ncclscope plugin passes) and prints the line to stderr
/// as `fakenccl-log: <level> <message>`; the x86-64 and AArch64 C ABIs pass that argument exactly as a
/// sixth fixed parameter.
///
/// # Safety
/// `fmt` is NULL or a C string; if it is "%s", `arg` is a C string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakenccl_log(
    level: c_int,
    _flags: c_ulong,
    _file: *const c_char,
    _line: c_int,
    fmt: *const c_char,
    arg: *const c_char,
) {
    if fmt.is_null() {
        return;
    }
    // SAFETY: a C string per the contract.
    let fmt = unsafe { CStr::from_ptr(fmt) }.to_string_lossy();
    let msg = if fmt == "%s" && !arg.is_null() {
        // SAFETY: "%s" means `arg` is a C string.
        unsafe { CStr::from_ptr(arg) }
            .to_string_lossy()
            .into_owned()
    } else {
        fmt.into_owned()
    };
    let level = match level {
        2 => "WARN",
        3 => "INFO",
        _ => "TRACE",
    };
    eprintln!("fakenccl-log: {level} {msg}");
}

/// Device function names of this fake NCCL build, indexed by funcId.
#[cfg(fakenccl_rfc)]
const FUNC_NAMES: [&CStr; 7] = [
    c"ncclDevFunc_SendRecv",
    c"ncclDevFunc_AllGather_RING_LL",
    c"ncclDevFunc_AllReduce_Sum_f32_RING_LL",
    c"ncclDevFunc_ReduceScatter_Sum_bf16_RING_SIMPLE",
    c"ncclDevFunc_AllReduce_Sum_f32_RING_LL128",
    c"ncclDevFunc_AllReduce_Sum_f32_RING_SIMPLE",
    c"ncclDevFunc_AllGather_RING_SIMPLE",
];

/// The RFC's `const char* ncclProfilerDevFuncName(int funcId)`: NULL for an unknown id.
#[cfg(fakenccl_rfc)]
#[unsafe(no_mangle)]
pub extern "C" fn ncclProfilerDevFuncName(func_id: c_int) -> *const c_char {
    usize::try_from(func_id)
        .ok()
        .and_then(|i| FUNC_NAMES.get(i))
        .map_or(std::ptr::null(), |n| n.as_ptr())
}
