//! Shared by the device-hook benchmarks: loads the real plugin .so and calls it as an RFC NCCL does
//! (`ncclProfiler_v7.init`, then `getDeviceHook` at offset 48, `finalize`), and reads what its forwarding
//! thread writes into the shared-memory segment, checking every device-hook work item.

#![allow(dead_code)]

use std::ffi::{CString, c_int, c_void};
use std::path::PathBuf;
use std::time::Duration;

use ncclscope_fakenccl::nccl::RfcVtable;
use ncclscope_fakenccl::process::Catcher;
use ncclscope_proto::segment::{Consumer, Counter};
use ncclscope_proto::{Record, segment};

pub struct Plugin {
    _lib: libloading::Library,
    v7: &'static RfcVtable,
    /// Takes the segment in the daemon's place.
    catcher: Catcher,
}

/// The plugin .so built next to this benchmark (target/<profile>/), or argv[1] when it names a .so.
pub fn plugin_path() -> PathBuf {
    if let Some(p) = std::env::args().nth(1).filter(|a| a.ends_with(".so")) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let so = dir.join("libnccl_profiler_ncclscope.so");
    assert!(
        so.exists(),
        "{} missing: run cargo build --release -p ncclscope-plugin first",
        so.display()
    );
    so
}

impl Plugin {
    /// Loads the .so, registering its segment with a catcher in this process instead of a daemon.
    pub fn load(vars: &[(&str, &str)]) -> Plugin {
        let catcher = Catcher::start();
        // SAFETY: set before the plugin reads the environment; the catcher's thread does not read it.
        unsafe {
            std::env::set_var("NCCLSCOPE_SOCKET", catcher.socket());
            for (k, v) in vars {
                std::env::set_var(k, v);
            }
        }
        let path = plugin_path();
        // SAFETY: loading the plugin runs no initialisers that need anything from us.
        let lib = unsafe { libloading::Library::new(&path) }.expect("dlopen plugin");
        // SAFETY: the plugin exports `ncclProfiler_v7` with the RFC layout; the library stays loaded.
        let v7 = unsafe {
            let sym = lib
                .get::<*const RfcVtable>(b"ncclProfiler_v7\0")
                .expect("ncclProfiler_v7");
            &**sym
        };
        Plugin {
            _lib: lib,
            v7,
            catcher,
        }
    }

    /// `init` for a one-rank communicator, then `getDeviceHook` as the RFC host calls it right after.
    pub fn comm(&self, hash: u64, cuda_dev: i32) -> Comm {
        let mut ctx = std::ptr::null_mut();
        let mut mask: c_int = 0;
        let name = CString::new(format!("bench-{hash:x}")).unwrap();
        let (mut hook, mut dev_ctx) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: arguments as NCCL passes them; no logger.
        unsafe {
            (self.v7.base.init)(&mut ctx, hash, &mut mask, name.as_ptr(), 1, 1, 0, None);
            (self.v7.get_device_hook)(cuda_dev, &mut hook, &mut dev_ctx);
        }
        Comm {
            ctx,
            hook,
            dev_ctx,
            hash,
        }
    }

    pub fn finalize(&self, comm: &Comm) {
        // SAFETY: a context returned by init, finalized once.
        unsafe { (self.v7.base.finalize)(comm.ctx) };
    }

    /// The segment the plugin created (created at the first init, handed over soon after).
    pub fn segment(&self) -> Reader {
        let seg = self
            .catcher
            .wait(Duration::from_secs(10))
            .expect("the plugin's segment");
        Reader {
            consumer: Consumer::new(seg),
            buf: Vec::new(),
            check: Check::default(),
        }
    }
}

pub struct Comm {
    pub ctx: *mut c_void,
    pub hook: *mut c_void,
    pub dev_ctx: *mut c_void,
    pub hash: u64,
}

// SAFETY: plain handles; the hook and devCtx are usable from any thread (one writer per ring).
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

/// Checks device-hook work items as they arrive: per (comm, channel), consecutive work counters from 1,
/// START before STOP, and the funcId the writer derives from the counter.
#[derive(Default)]
pub struct Check {
    /// comm index -> comm hash, from Record::Comm.
    pub comms: Vec<(u32, u64)>,
    /// Last work counter per comm * 64 + channel.
    last: Vec<u64>,
    pub works: u64,
    pub out_of_order: u64,
    pub bad_content: u64,
    pub calibrations: Vec<(i64, u32, i32, u64)>,
    pub func_names: u64,
}

impl Check {
    fn see(&mut self, r: &Record, func_of: &dyn Fn(u64) -> u32) {
        match *r {
            Record::Comm {
                comm, comm_hash, ..
            } => self.comms.push((comm, comm_hash)),
            Record::DevWork {
                comm,
                channel,
                func_id,
                work_counter,
                gpu_start,
                gpu_stop,
            } => {
                self.works += 1;
                let i = comm as usize * 64 + channel as usize;
                if self.last.len() <= i {
                    self.last.resize(i + 1, 0);
                }
                let prev = std::mem::replace(&mut self.last[i], work_counter);
                if work_counter != prev + 1 {
                    self.out_of_order += 1;
                }
                if func_id != func_of(work_counter) || gpu_stop < gpu_start || gpu_start == 0 {
                    self.bad_content += 1;
                }
            }
            Record::Calibration {
                offset_ns,
                error_ns,
                drift_ppb,
                host_ns,
                ..
            } => self
                .calibrations
                .push((offset_ns, error_ns, drift_ppb, host_ns)),
            Record::FuncName { .. } => self.func_names += 1,
            _ => {}
        }
    }
}

pub struct Reader {
    consumer: Consumer,
    buf: Vec<segment::Read>,
    pub check: Check,
}

impl Reader {
    /// Reads and checks everything published so far; returns the records read.
    pub fn poll(&mut self, func_of: &dyn Fn(u64) -> u32) -> usize {
        self.buf.clear();
        let n = self
            .consumer
            .read(1 << 16, &mut self.buf)
            .expect("segment read");
        for (_, r) in &self.buf {
            self.check.see(r.as_ref().expect("record decodes"), func_of);
        }
        if let Some((pos, _)) = self.buf.last() {
            self.consumer.commit(pos + 1);
        }
        n
    }

    pub fn counter(&self, c: Counter) -> u64 {
        self.consumer.segment().counter(c)
    }
}

/// CPU time of this process (user + system), for idle-cost measurements.
pub fn cpu_time() -> Duration {
    // SAFETY: rusage is plain data, filled by the call.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// CPU time of the plugin's forwarding thread ("ncclscope-fwd"), which runs the drain.
pub fn forwarding_thread_cpu() -> Option<Duration> {
    let tick = 100.0; // USER_HZ on Linux
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = task.ok()?.path();
        if std::fs::read_to_string(dir.join("comm")).ok()?.trim() != "ncclscope-fwd" {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let (utime, stime): (f64, f64) = (fields[11].parse().ok()?, fields[12].parse().ok()?);
        return Some(Duration::from_secs_f64((utime + stime) / tick));
    }
    None
}

/// (voluntary, involuntary) context switches of the forwarding thread: parks vs preemptions.
pub fn forwarding_thread_switches() -> Option<(u64, u64)> {
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = task.ok()?.path();
        if std::fs::read_to_string(dir.join("comm")).ok()?.trim() != "ncclscope-fwd" {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).ok()?;
        let get = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
        };
        return Some((
            get("voluntary_ctxt_switches:")?,
            get("nonvoluntary_ctxt_switches:")?,
        ));
    }
    None
}
