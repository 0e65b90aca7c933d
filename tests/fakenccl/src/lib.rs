//! A fake NCCL host for tests and simulations: it loads the real plugin `.so` (dlopen RTLD_NOW |
//! RTLD_LOCAL, as NCCL does) and calls it exactly as NCCL 2.28 (`ncclProfiler_v5`), 2.30 (`_v6`), 2.32
//! (`_v7`, 136-byte descriptors) or an NCCL with the device-hook RFC (`_v7` + `getDeviceHook`, 112-byte
//! descriptors) would, with a simulated kernel behind each collective.
//!
//! ```no_run
//! use ncclscope_fakenccl::{CollSpec, CommSpec, Host, HostKind};
//! let host = Host::load("target/debug/libnccl_profiler_ncclscope.so".as_ref(), HostKind::V5)?;
//! let mut comm = host.init_comm(&CommSpec { comm_hash: 0xabc, rank: 0, nranks: 2, ..CommSpec::default() })?;
//! let op = comm.collective(&CollSpec { n_channels: 4, kernel_ns: 20_000, ..CollSpec::default() });
//! // `op` is what NCCL emitted: seq, strings, and per channel the GPU start/stop times (KernelCh pTimer)
//! // or the device-hook work items, to compare with what arrives in the segment.
//! comm.finalize();
//! # anyhow::Ok(())
//! ```
//!
//! "libnccl" is a stand-in library (`libfakenccl_nccl.so`, or `libfakenccl_nccl_rfc.so` for the RFC
//! host) built next to the plugin: its logger is the `logfn` passed to `init`, so the plugin finds
//! `ncclGetVersion` (and `ncclProfilerDevFuncName`) through the same dladdr/dlopen path as in a real job.
//! The simulated GPU clock is CLOCK_MONOTONIC in ns. Descriptors and state args are placed flush
//! against an unmapped page, so an over-read by the plugin faults. Host events come from the calling
//! thread; kernel events (KernelCh, KernelPhase, device-hook calls) from a second thread, as NCCL's
//! proxy/profiler thread and the GPU would.
//!
//! The `fakenccl-rank` binary drives one process ("a rank") from the command line and prints a JSON
//! [`report::Report`]; `segment-dump` prints the records of a segment.

pub mod check;
pub mod guard;
pub mod nccl;
pub mod process;
pub mod report;

use std::ffi::{CStr, CString, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

use anyhow::{Context, bail};
use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

use guard::GuardedPage;
use nccl::{
    DESCR_V6_BYTES, DESCR_V7_BYTES, Descr, DevEvent, GetDeviceHookFn, HookFn, Logger, RfcVtable,
    Vtable, event, off, state,
};
pub use report::{HookItem, KernelReport, OpKind, OpReport, PhaseReport};

/// Which NCCL the host pretends to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostKind {
    /// NCCL 2.28.9: looks up `ncclProfiler_v5`.
    V5,
    /// NCCL 2.30.7: `ncclProfiler_v6`.
    V6,
    /// NCCL 2.32.3: `ncclProfiler_v7`, 136-byte descriptors, KernelPhase for symmetric kernels.
    V7,
    /// NCCL 2.30.7 with the device-hook RFC: `ncclProfiler_v7` with `getDeviceHook`, v6 descriptors.
    Rfc,
}

impl HostKind {
    pub const ALL: [HostKind; 4] = [HostKind::V5, HostKind::V6, HostKind::V7, HostKind::Rfc];

    /// `ncclGetVersion`'s answer.
    pub fn version(self) -> i32 {
        match self {
            HostKind::V5 => 22809,
            HostKind::V6 | HostKind::Rfc => 23007,
            HostKind::V7 => 23203,
        }
    }

    /// Symbols looked up in order, as that NCCL does.
    fn symbols(self) -> &'static [&'static CStr] {
        match self {
            HostKind::V5 => &[c"ncclProfiler_v5"],
            HostKind::V6 => &[c"ncclProfiler_v6", c"ncclProfiler_v5"],
            HostKind::V7 | HostKind::Rfc => {
                &[c"ncclProfiler_v7", c"ncclProfiler_v6", c"ncclProfiler_v5"]
            }
        }
    }

    fn descr_bytes(self) -> usize {
        if self == HostKind::V7 {
            DESCR_V7_BYTES
        } else {
            DESCR_V6_BYTES
        }
    }

    /// The stand-in libnccl this host uses.
    pub fn libnccl_name(self) -> &'static str {
        if self == HostKind::Rfc {
            "libfakenccl_nccl_rfc.so"
        } else {
            "libfakenccl_nccl.so"
        }
    }

    pub fn parse(s: &str) -> Option<HostKind> {
        HostKind::ALL.into_iter().find(|k| k.name() == s)
    }

    pub fn name(self) -> &'static str {
        match self {
            HostKind::V5 => "v5",
            HostKind::V6 => "v6",
            HostKind::V7 => "v7",
            HostKind::Rfc => "rfc",
        }
    }
}

/// A loaded plugin, as one NCCL process holds it.
pub struct Host {
    pub kind: HostKind,
    /// The symbol NCCL settled on, e.g. "ncclProfiler_v5".
    pub symbol: String,
    vt: Vtable,
    get_device_hook: Option<GetDeviceHookFn>,
    logger: Logger,
    /// NCCL's process-wide activation mask.
    mask: &'static AtomicI32,
    /// Plugin calls that returned anything but ncclSuccess (NCCL would fail the job's call).
    failed_calls: AtomicU64,
    _plugin: Library,
    _nccl: Library,
}

// SAFETY: the vtable's name points at the plugin's static string; its functions are required to be
// thread-safe (NCCL calls them from several threads); the mask is an atomic.
unsafe impl Send for Host {}
// SAFETY: as above.
unsafe impl Sync for Host {}

/// A communicator to create.
#[derive(Clone, Debug)]
pub struct CommSpec {
    pub comm_hash: u64,
    pub rank: i32,
    pub nranks: i32,
    pub nnodes: i32,
    /// `config.commName`; None passes NULL.
    pub name: Option<String>,
    /// Passed to `getDeviceHook` on an RFC host.
    pub cuda_dev: i32,
}

impl Default for CommSpec {
    fn default() -> Self {
        CommSpec {
            comm_hash: 0x1234_5678_9abc_def0,
            rank: 0,
            nranks: 1,
            nnodes: 1,
            name: None,
            cuda_dev: 0,
        }
    }
}

/// One collective call and its simulated kernel: one work item per channel.
#[derive(Clone, Debug)]
pub struct CollSpec {
    pub func: &'static CStr,
    pub datatype: &'static CStr,
    pub algo: &'static CStr,
    pub proto: &'static CStr,
    pub count: u64,
    pub root: i32,
    pub n_channels: u8,
    pub n_warps: u8,
    /// Simulated kernel duration per channel.
    pub kernel_ns: u64,
    /// Device function id the hook reports (RFC host).
    pub func_id: u32,
    /// A symmetric kernel's variant name (v7: `kernelVariant`, `isSymColl`, and KernelPhase events).
    pub symmetric: Option<&'static CStr>,
    pub user_tag: u64,
}

impl Default for CollSpec {
    fn default() -> Self {
        CollSpec {
            func: c"AllReduce",
            datatype: c"ncclFloat32",
            algo: c"RING",
            proto: c"LL",
            count: 1024,
            root: 0,
            n_channels: 2,
            n_warps: 16,
            kernel_ns: 10_000,
            func_id: 2,
            symmetric: None,
            user_tag: 0,
        }
    }
}

/// One send or receive. Its channels are NCCL's, from its size ([`p2p_channels`]) and its round.
#[derive(Clone, Debug)]
pub struct P2pSpec {
    pub func: &'static CStr,
    pub datatype: &'static CStr,
    pub count: u64,
    pub peer: i32,
    pub kernel_ns: u64,
}

impl Default for P2pSpec {
    fn default() -> Self {
        P2pSpec {
            func: c"Send",
            datatype: c"ncclInt8",
            count: 4096,
            peer: 1,
            kernel_ns: 5_000,
        }
    }
}

impl P2pSpec {
    fn is_send(&self) -> bool {
        self.func == c"Send"
    }

    /// Its round of the communicator's p2p schedule on one node (NCCL 2.30 `ncclP2pSchedule`,
    /// src/init.cc): a send to `peer` runs in round `peer - rank`, a receive from it in `rank - peer`.
    fn round(&self, rank: i32, nranks: i32) -> i32 {
        let delta = if self.is_send() {
            self.peer - rank
        } else {
            rank - self.peer
        };
        delta.rem_euclid(nranks.max(1))
    }

    fn bytes(&self) -> u64 {
        let size = match self.datatype.to_bytes() {
            b"ncclInt8" | b"ncclUint8" | b"ncclFloat8e4m3" | b"ncclFloat8e5m2" => 1,
            b"ncclFloat16" | b"ncclBfloat16" => 2,
            b"ncclInt64" | b"ncclUint64" | b"ncclFloat64" => 8,
            _ => 4,
        };
        self.count * size
    }
}

/// `comm->p2pnChannels` of the recorded H100 runs (docs/rfc-feedback.md): the channels p2p rounds
/// are spread over.
pub const P2P_CHANNELS: u8 = 64;

/// funcId of NCCL's p2p device function (`ncclDevFunc_SendRecv` in the stand-in libnccl-rfc): every
/// p2p work item carries it, whatever its round or direction.
pub const SEND_RECV_FUNC_ID: u32 = 0;

/// Channels of one send or receive of `bytes` on one node, as NCCL 2.30 chose them on the H100
/// (`addP2pToPlan`: one channel per `p2pChunkSize / 8` part, up to `p2pnChannelsPerPeer`, 2): 1 at
/// 2-4 KiB, 2 at 512 KiB-1 MiB. Where 1 becomes 2 was not recorded: 64 KiB is the all-NVLink
/// chunk's eighth (docs/rfc-feedback.md).
pub fn p2p_channels(bytes: u64) -> u8 {
    bytes.div_ceil(64 << 10).clamp(1, 2) as u8
}

/// The first channel of a p2p round on one node (`ncclP2pChannelBaseForRound`, src/include/channel.h):
/// the round bit-reversed over log2(p2pnChannels) bits, so a two-rank communicator's peer round runs
/// on channel 32 and the self round on channel 0.
pub fn p2p_channel_base(round: i32) -> u8 {
    let bits = P2P_CHANNELS.trailing_zeros();
    ((round as u32).reverse_bits() >> (32 - bits)) as u8
}

/// CLOCK_MONOTONIC in ns: the simulated GPU globaltimer.
pub fn gpu_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Host {
    /// Loads `plugin` as a `kind` host would, with the stand-in libnccl found next to it.
    pub fn load(plugin: &Path, kind: HostKind) -> anyhow::Result<Arc<Host>> {
        Host::load_as(plugin, kind, kind.version())
    }

    /// Like [`Host::load`], with `ncclGetVersion` answering `version` (0: the call fails).
    pub fn load_as(plugin: &Path, kind: HostKind, version: i32) -> anyhow::Result<Arc<Host>> {
        let dir = plugin.parent().unwrap_or(Path::new("."));
        let nccl_path = dir.join(kind.libnccl_name());
        // SAFETY: loading our own stand-in library; its initialisers are Rust statics only.
        let nccl = unsafe { Library::open(Some(&nccl_path), RTLD_NOW | RTLD_LOCAL) }
            .with_context(|| format!("loading the stand-in libnccl {}", nccl_path.display()))?;
        // SAFETY: the stand-in's exported functions have exactly these signatures.
        let (set_version, log) = unsafe {
            (
                *nccl.get::<unsafe extern "C" fn(c_int)>(b"fakenccl_set_version\0")?,
                *nccl.get::<*const c_void>(b"fakenccl_log\0")?,
            )
        };
        // SAFETY: as above.
        unsafe { set_version(version) };
        // SAFETY: `fakenccl_log` reads the fixed arguments of NCCL's variadic logger (see its docs).
        let logger: Logger = unsafe { std::mem::transmute::<*const c_void, Logger>(log) };
        // SAFETY: NCCL loads profiler plugins the same way; the plugin's initialisers are Rust statics.
        let lib = unsafe { Library::open(Some(plugin), RTLD_NOW | RTLD_LOCAL) }
            .with_context(|| format!("dlopen {} (RTLD_NOW)", plugin.display()))?;
        for sym in kind.symbols() {
            // SAFETY: looking up a data symbol; its address is what NCCL reads.
            let Ok(p) = (unsafe { lib.get::<*const c_void>(sym.to_bytes_with_nul()) }) else {
                continue;
            };
            let p = *p as *const Vtable;
            // SAFETY: the exported object is at least the 48-byte vtable NCCL reads.
            let vt = unsafe { *p };
            let get_device_hook =
                (kind == HostKind::Rfc && sym == &c"ncclProfiler_v7").then(|| {
                    // SAFETY: an RFC host reads `getDeviceHook` at offset 48 of `ncclProfiler_v7`.
                    unsafe { (*p.cast::<RfcVtable>()).get_device_hook }
                });
            let mask: &'static AtomicI32 = Box::leak(Box::new(AtomicI32::new(0)));
            return Ok(Arc::new(Host {
                kind,
                symbol: sym.to_string_lossy().into_owned(),
                vt,
                get_device_hook,
                logger,
                mask,
                failed_calls: AtomicU64::new(0),
                _plugin: lib,
                _nccl: nccl,
            }));
        }
        bail!("{} exports none of {:?}", plugin.display(), kind.symbols())
    }

    /// Plugin calls after `init` that did not return ncclSuccess.
    pub fn failed_calls(&self) -> u64 {
        self.failed_calls.load(Ordering::Relaxed)
    }

    /// The activation mask the plugin set (NCCL's global).
    pub fn mask(&self) -> u64 {
        self.mask.load(Ordering::Relaxed) as u32 as u64
    }

    /// The plugin's `name` field.
    pub fn plugin_name(&self) -> String {
        // SAFETY: NCCL logs this pointer as a C string; the plugin keeps it static.
        unsafe { CStr::from_ptr(self.vt.name) }
            .to_string_lossy()
            .into_owned()
    }

    /// `init` for a new communicator (and `getDeviceHook` right after it on an RFC host).
    pub fn init_comm(self: &Arc<Host>, spec: &CommSpec) -> anyhow::Result<Comm> {
        let name = spec.name.as_deref().map(CString::new).transpose()?;
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: the arguments NCCL passes: out pointer, mask global, C string or NULL, logger.
        let rc = unsafe {
            (self.vt.init)(
                &mut ctx,
                spec.comm_hash,
                self.mask.as_ptr(),
                name.as_ref().map_or(std::ptr::null(), |n| n.as_ptr()),
                spec.nnodes,
                spec.nranks,
                spec.rank,
                Some(self.logger),
            )
        };
        if rc != 0 {
            bail!("init returned {rc}");
        }
        let mut hook = None;
        if let Some(get) = self.get_device_hook {
            let (mut f, mut dev_ctx) = (std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: the RFC signature with valid out pointers.
            unsafe { get(spec.cuda_dev, &mut f, &mut dev_ctx) };
            if !f.is_null() {
                // SAFETY: a non-NULL devHook is the plugin's `void hook(const ev*, void* devCtx)`.
                hook = Some((
                    unsafe { std::mem::transmute::<*mut c_void, HookFn>(f) },
                    SendPtr(dev_ctx),
                ));
            }
        }
        Ok(Comm {
            host: self.clone(),
            ctx: SendPtr(ctx),
            rank: spec.rank,
            nranks: spec.nranks,
            seq: Vec::new(),
            work_counter: [0; 64],
            hook,
            app_page: GuardedPage::new()?,
            gpu_page: GuardedPage::new()?,
            proxy: None,
            capturing: false,
            graph: Vec::new(),
            replays: 0,
            stream_free_ns: None,
        })
    }
}

/// A raw pointer moved between the fake NCCL's threads (as NCCL moves handles between its threads).
#[derive(Clone, Copy, Debug)]
pub struct SendPtr(pub *mut c_void);
// SAFETY: the pointee belongs to the plugin, which is required to be thread-safe.
unsafe impl Send for SendPtr {}

/// One communicator of a host.
pub struct Comm {
    host: Arc<Host>,
    ctx: SendPtr,
    rank: i32,
    nranks: i32,
    /// NCCL's `seqNumber[func]`: collectives are numbered per communicator and per collective type.
    seq: Vec<(&'static CStr, u64)>,
    /// NCCL's per-channel work counter, kept across kernels.
    work_counter: [u64; 64],
    hook: Option<(HookFn, SendPtr)>,
    app_page: GuardedPage,
    gpu_page: GuardedPage,
    proxy: Option<Proxy>,
    /// Between [`Comm::begin_capture`] and [`Comm::end_capture`]: the stream is being captured.
    capturing: bool,
    /// The operations captured so far, in capture order: what every replay runs.
    graph: Vec<Captured>,
    /// Graph replays on this communicator so far.
    replays: u32,
    /// With [`Comm::set_gpu_lag`]: when the simulated GPU finishes the last kernel launched on the
    /// communicator's stream.
    stream_free_ns: Option<u64>,
}

/// A launch captured into a CUDA graph: a collective, or a group's sends and receives.
struct Captured {
    /// Its operations as reported at capture.
    reports: Vec<OpReport>,
    /// The handles the plugin returned for them: a replay's KernelCh (stock NCCL) still names them.
    handles: Vec<SendPtr>,
    kernel: Kernel,
}

/// Calls into the plugin with descriptors and state args on a guarded page.
struct Caller<'a> {
    vt: &'a Vtable,
    failed: &'a AtomicU64,
    page: &'a mut GuardedPage,
    descr_bytes: usize,
    rank: i32,
}

impl Caller<'_> {
    fn start(
        &mut self,
        ctx: SendPtr,
        ty: u64,
        parent: SendPtr,
        fill: impl FnOnce(&Descr),
    ) -> SendPtr {
        let d = Descr {
            ptr: self.page.flush_end(self.descr_bytes),
            len: self.descr_bytes,
        };
        d.u64(off::TYPE, ty)
            .ptr(off::PARENT, parent.0)
            .i32(off::RANK, self.rank);
        fill(&d);
        let mut handle = std::ptr::null_mut();
        // SAFETY: the plugin's startEvent with a valid out pointer and a descriptor of this host's size.
        let rc = unsafe { (self.vt.start_event)(ctx.0, &mut handle, d.ptr) };
        self.returned(rc);
        SendPtr(handle)
    }

    fn returned(&self, rc: i32) {
        if rc != 0 {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The GroupApi event NCCL starts around every API call (its `graphCaptured` says whether the
    /// stream is being captured), when the mask has anything below it.
    fn group_api(&mut self, ctx: SendPtr, mask: u64, kernel_bits: u64, captured: bool) -> SendPtr {
        if mask & (event::GROUP_API | event::GROUP | event::COLL | event::P2P | kernel_bits) == 0 {
            return SendPtr(std::ptr::null_mut());
        }
        self.start(ctx, event::GROUP_API, SendPtr(std::ptr::null_mut()), |d| {
            d.u8(off::GROUPAPI_CAPTURED, captured as u8)
                .i32(off::GROUPAPI_DEPTH, 1);
        })
    }

    fn record(&mut self, handle: SendPtr, st: i32, p_timer: Option<u64>) {
        let args = match p_timer {
            Some(t) => {
                let p = self.page.flush_end(8);
                // SAFETY: 8 writable bytes.
                unsafe { *(p as *mut u64) = t };
                p as *mut u64
            }
            None => std::ptr::null_mut(),
        };
        // SAFETY: the plugin's recordEventState; args NULL or 8 bytes flush against the guard page.
        let rc = unsafe { (self.vt.record_event_state)(handle.0, st, args) };
        self.returned(rc);
    }

    fn stop(&mut self, handle: SendPtr) {
        // SAFETY: the plugin's stopEvent.
        let rc = unsafe { (self.vt.stop_event)(handle.0) };
        self.returned(rc);
    }
}

fn text(s: &CStr) -> String {
    s.to_string_lossy().into_owned()
}

/// One launch's kernel: a work item on each of `channels` (in order; a channel may come twice), and
/// per operation of the launch the items it runs on (its KernelCh events). A collective runs on all
/// of its items; a send and a receive fused into one p2p round share the round's items.
#[derive(Clone)]
struct Kernel {
    channels: Vec<u8>,
    ops: Vec<Vec<usize>>,
    kernel_ns: u64,
    func_id: u32,
    phases: bool,
    symmetric: Option<&'static CStr>,
}

impl Kernel {
    /// A collective's kernel: one work item on each of channels 0..n.
    fn collective(n_channels: u8, kernel_ns: u64, func_id: u32) -> Kernel {
        Kernel {
            channels: (0..n_channels).collect(),
            ops: vec![(0..n_channels as usize).collect()],
            kernel_ns,
            func_id,
            phases: false,
            symmetric: None,
        }
    }
}

/// One kernel's events, as NCCL's proxy/profiler thread and the GPU report them.
struct KernelJob {
    /// Simulated GPU time before which its events are not emitted (the kernel has not run yet).
    not_before: u64,
    items: Vec<HookItem>,
    /// Per operation: its handle (KernelCh parent) and the indexes of its items.
    ops: Vec<(SendPtr, Vec<usize>)>,
    kernel_ch: bool,
    phases: bool,
}

/// Per operation of a launch: its KernelCh reports and the work items reported with it (each item
/// once, with the first operation that runs on it).
type OpKernels = Vec<(Vec<KernelReport>, Vec<HookItem>)>;

/// The long-lived proxy thread of an asynchronous communicator.
struct Proxy {
    tx: std::sync::mpsc::Sender<KernelJob>,
    thread: std::thread::JoinHandle<()>,
}

/// The three KernelPhase intervals of a work item: (phase, start, stop).
fn phase_bounds(it: &HookItem) -> [(u8, u64, u64); 3] {
    let span = it.gpu_stop - it.gpu_start;
    let b = [
        it.gpu_start,
        it.gpu_start + span / 4,
        it.gpu_stop - span / 4,
        it.gpu_stop,
    ];
    [(0, b[0], b[1]), (1, b[1], b[2]), (2, b[2], b[3])]
}

const PHASE_NAMES: [&CStr; 3] = [c"initial_sync", c"compute", c"final_sync"];

impl KernelJob {
    /// The work items reported with each operation: each item with the first operation on it.
    fn hook_items(&self) -> Vec<Vec<HookItem>> {
        let mut claimed = vec![false; self.items.len()];
        (self.ops.iter())
            .map(|(_, idx)| {
                (idx.iter())
                    .filter(|&&i| !std::mem::replace(&mut claimed[i], true))
                    .map(|&i| self.items[i].clone())
                    .collect()
            })
            .collect()
    }

    /// What emitting this job reports if the plugin accepts every event.
    fn expected(&self, hook: bool) -> OpKernels {
        let hook_items = self.hook_items();
        (self.ops.iter().zip(hook_items))
            .map(|((_, idx), items)| {
                let kernels = (idx.iter())
                    .filter(|_| self.kernel_ch)
                    .map(|&i| {
                        let it = &self.items[i];
                        KernelReport {
                            channel: it.channel,
                            gpu_start: it.gpu_start,
                            gpu_stop: it.gpu_stop,
                            started: true,
                            phases: if self.phases {
                                phase_bounds(it)
                                    .map(|(phase, a, b)| PhaseReport {
                                        phase,
                                        gpu_start: a,
                                        gpu_stop: b,
                                    })
                                    .to_vec()
                            } else {
                                Vec::new()
                            },
                        }
                    })
                    .collect();
                (kernels, if hook { items } else { Vec::new() })
            })
            .collect()
    }

    /// Device-hook calls, then KernelCh (and KernelPhase) events for every work item.
    fn emit(
        self,
        host: &Host,
        ctx: SendPtr,
        rank: i32,
        hook: Option<(HookFn, SendPtr)>,
        page: &mut GuardedPage,
    ) -> OpKernels {
        if let Some((f, dev_ctx)) = hook {
            for it in &self.items {
                for (phase, ts) in [(0u8, it.gpu_start), (1, it.gpu_stop)] {
                    let ev = DevEvent {
                        timestamp: ts,
                        work_counter: it.work_counter,
                        func_id: it.func_id,
                        channel_id: it.channel,
                        phase,
                        rsvd: 0,
                    };
                    // SAFETY: the hook the plugin returned, with its devCtx and a valid event.
                    unsafe { f(&ev, dev_ctx.0) };
                }
            }
        }
        let mut out: OpKernels = (self.hook_items().into_iter())
            .map(|items| (Vec::new(), if hook.is_some() { items } else { Vec::new() }))
            .collect();
        if !self.kernel_ch {
            return out;
        }
        let mut c = Caller {
            vt: &host.vt,
            failed: &host.failed_calls,
            page,
            descr_bytes: host.kind.descr_bytes(),
            rank,
        };
        for ((parent, idx), (kernels, _)) in self.ops.iter().zip(&mut out) {
            for it in idx.iter().map(|&i| &self.items[i]) {
                let kc = c.start(ctx, event::KERNEL_CH, *parent, |d| {
                    d.u8(off::KCH_CHANNEL, it.channel)
                        .u64(off::KCH_PTIMER, it.gpu_start);
                });
                let mut report = KernelReport {
                    channel: it.channel,
                    gpu_start: it.gpu_start,
                    gpu_stop: it.gpu_stop,
                    started: !kc.0.is_null(),
                    phases: Vec::new(),
                };
                if self.phases && !kc.0.is_null() {
                    for (phase, p0, p1) in phase_bounds(it) {
                        let ph = c.start(ctx, event::KERNEL_PHASE, kc, |d| {
                            d.u8(off::KPH_CHANNEL, it.channel)
                                .u8(off::KPH_PHASE, phase)
                                .ptr(off::KPH_NAME, PHASE_NAMES[phase as usize].as_ptr())
                                .u64(off::KPH_PTIMER, p0);
                        });
                        if !ph.0.is_null() {
                            c.record(ph, state::KERNEL_PHASE_STOP, Some(p1));
                            c.stop(ph);
                        }
                        report.phases.push(PhaseReport {
                            phase,
                            gpu_start: p0,
                            gpu_stop: p1,
                        });
                    }
                }
                if !kc.0.is_null() {
                    c.record(kc, state::KERNEL_CH_STOP, Some(it.gpu_stop));
                    c.stop(kc);
                }
                kernels.push(report);
            }
        }
        out
    }
}

impl Comm {
    fn caller(&mut self) -> Caller<'_> {
        Caller {
            vt: &self.host.vt,
            failed: &self.host.failed_calls,
            page: &mut self.app_page,
            descr_bytes: self.host.kind.descr_bytes(),
            rank: self.rank,
        }
    }

    fn kernel_bits(&self) -> u64 {
        if self.host.kind == HostKind::V7 {
            event::KERNEL_CH | event::KERNEL_PHASE
        } else {
            event::KERNEL_CH
        }
    }

    /// Emits one collective: Group and Coll on this thread, then the simulated kernel's events.
    pub fn collective(&mut self, spec: &CollSpec) -> OpReport {
        let mask = self.host.mask();
        let kernel_bits = self.kernel_bits();
        let captured = self.capturing;
        let i = match self.seq.iter().position(|(f, _)| *f == spec.func) {
            Some(i) => i,
            None => {
                self.seq.push((spec.func, 0));
                self.seq.len() - 1
            }
        };
        let seq = self.seq[i].1;
        // NCCL advances a captured collective's seqNumber only with KernelCh in the mask.
        if !captured || mask & event::KERNEL_CH != 0 {
            self.seq[i].1 += 1;
        }
        let v7 = self.host.kind == HostKind::V7;
        let ctx = self.ctx;
        let mut c = self.caller();
        let group_api = c.group_api(ctx, mask, kernel_bits, captured);
        let coll_api = if mask & (event::COLL_API | event::COLL | kernel_bits) != 0 {
            c.start(ctx, event::COLL_API, group_api, |d| {
                d.ptr(off::COLLAPI_FUNC, spec.func.as_ptr())
                    .u64(off::COLLAPI_COUNT, spec.count)
                    .ptr(off::COLLAPI_DATATYPE, spec.datatype.as_ptr())
                    .i32(off::COLLAPI_ROOT, spec.root)
                    .u64(off::COLLAPI_STREAM, 0x7300_0000)
                    .u8(off::COLLAPI_CAPTURED, captured as u8);
            })
        } else {
            SendPtr(std::ptr::null_mut())
        };
        let group = if mask & (event::GROUP | event::COLL | event::P2P | kernel_bits) != 0 {
            c.start(ctx, event::GROUP, SendPtr(std::ptr::null_mut()), |_| {})
        } else {
            SendPtr(std::ptr::null_mut())
        };
        let coll = if mask & (event::COLL | kernel_bits) != 0 {
            // The CollApi event is the Coll's parent: how a plugin knows it was captured.
            c.start(ctx, event::COLL, coll_api, |d| {
                d.u64(off::COLL_SEQ, seq)
                    .ptr(off::COLL_FUNC, spec.func.as_ptr())
                    .u64(off::COLL_SEND, 0x7000_0000)
                    .u64(off::COLL_RECV, 0x7100_0000)
                    .u64(off::COLL_COUNT, spec.count)
                    .i32(off::COLL_ROOT, spec.root)
                    .ptr(off::COLL_DATATYPE, spec.datatype.as_ptr())
                    .u8(off::COLL_NCHANNELS, spec.n_channels)
                    .u8(off::COLL_NWARPS, spec.n_warps)
                    .ptr(off::COLL_ALGO, spec.algo.as_ptr())
                    .ptr(off::COLL_PROTO, spec.proto.as_ptr())
                    .ptr(off::COLL_PARENT_GROUP, group.0);
                if v7 {
                    d.ptr(
                        off::COLL_KERNEL_VARIANT,
                        spec.symmetric.map_or(std::ptr::null(), |s| s.as_ptr()),
                    )
                    .u8(off::COLL_IS_SYM, spec.symmetric.is_some() as u8)
                    .u64(off::COLL_USER_TAG, spec.user_tag);
                }
            })
        } else {
            SendPtr(std::ptr::null_mut())
        };
        // NCCL stops the Coll once it is enqueued; its kernel events come later, from another thread.
        for h in [coll, group, coll_api, group_api] {
            if !h.0.is_null() {
                c.stop(h);
            }
        }
        let kernel = Kernel {
            phases: v7 && spec.symmetric.is_some(),
            symmetric: spec.symmetric,
            ..Kernel::collective(spec.n_channels, spec.kernel_ns, spec.func_id)
        };
        // Captured: the kernel runs at each replay, not now.
        let (kernels, hook_items) = if captured {
            (Vec::new(), Vec::new())
        } else {
            self.run_kernel(mask, &[coll], &kernel).remove(0)
        };
        let report = OpReport {
            kind: OpKind::Coll,
            started: !coll.0.is_null(),
            seq,
            func: text(spec.func),
            datatype: text(spec.datatype),
            algo: text(spec.algo),
            kernel_variant: spec.symmetric.filter(|_| v7).map(text),
            proto: text(spec.proto),
            count: spec.count,
            root_or_peer: spec.root,
            n_channels: spec.n_channels,
            n_warps: spec.n_warps,
            kernels,
            hook_items,
            captured,
            replay: 0,
        };
        if captured {
            self.graph.push(Captured {
                reports: vec![report.clone()],
                handles: vec![coll],
                kernel,
            });
        }
        report
    }

    /// Emits one send or receive as a group of its own (see [`Comm::p2p_group`]).
    pub fn p2p(&mut self, spec: &P2pSpec) -> OpReport {
        self.p2p_group(std::slice::from_ref(spec)).remove(0)
    }

    /// Emits the sends and receives of one NCCL group (`ncclGroupStart` .. `ncclGroupEnd`) and their
    /// one kernel, as NCCL 2.30 schedules them on one node (`scheduleP2pTasksToPlan`,
    /// `addP2pToPlan`, src/enqueue.cc): round by round of the p2p schedule (epoch after epoch while a
    /// peer has more), the round's first queued send and receive are one work: one work item on each
    /// of its `max(send, recv)` channels from [`p2p_channel_base`] on, funcId [`SEND_RECV_FUNC_ID`],
    /// advancing those channels' workCounters. Host events: a P2pApi per call, then one Group and a
    /// P2p per operation in NCCL's task order (work by work, the send before the receive), each with
    /// its own `nChannels`; on the stock path each operation's KernelCh events name its own channels.
    /// One report per operation in that order; a fused work's items are reported with its first.
    pub fn p2p_group(&mut self, specs: &[P2pSpec]) -> Vec<OpReport> {
        let mask = self.host.mask();
        let kernel_bits = self.kernel_bits();
        let ctx = self.ctx;
        let captured = self.capturing;
        let (rank, nranks) = (self.rank, self.nranks);
        // NCCL's task queue: works in schedule order, each a send and/or a receive (spec indexes).
        let mut left: Vec<usize> = (0..specs.len()).collect();
        let mut works: Vec<(i32, Vec<usize>)> = Vec::new();
        while !left.is_empty() {
            for round in 0..nranks.max(1) {
                let mut work = Vec::new();
                for send in [true, false] {
                    if let Some(at) = left.iter().position(|&i| {
                        specs[i].is_send() == send && specs[i].round(rank, nranks) == round
                    }) {
                        work.push(left.remove(at));
                    }
                }
                if !work.is_empty() {
                    works.push((round, work));
                }
            }
        }
        let mut channels = Vec::new();
        let mut op_items = vec![Vec::new(); specs.len()];
        for (round, work) in &works {
            let base = p2p_channel_base(*round);
            let n = work.iter().map(|&i| p2p_channels(specs[i].bytes()));
            let first = channels.len();
            for part in 0..n.clone().max().unwrap_or(1) {
                channels.push((base + part) % P2P_CHANNELS);
            }
            for (&i, n) in work.iter().zip(n) {
                op_items[i] = (first..first + n as usize).collect();
            }
        }
        let order: Vec<usize> = works.iter().flat_map(|(_, w)| w.iter().copied()).collect();
        let mut c = self.caller();
        let group_api = c.group_api(ctx, mask, kernel_bits, captured);
        let p2p_apis: Vec<SendPtr> = (specs.iter())
            .map(|spec| {
                if mask & (event::P2P_API | event::P2P | kernel_bits) == 0 {
                    return SendPtr(std::ptr::null_mut());
                }
                c.start(ctx, event::P2P_API, group_api, |d| {
                    d.ptr(off::P2PAPI_FUNC, spec.func.as_ptr())
                        .u64(off::P2PAPI_COUNT, spec.count)
                        .ptr(off::P2PAPI_DATATYPE, spec.datatype.as_ptr())
                        .u64(off::P2PAPI_STREAM, 0x7300_0000)
                        .u8(off::P2PAPI_CAPTURED, captured as u8);
                })
            })
            .collect();
        let group = if mask & (event::GROUP | event::COLL | event::P2P | kernel_bits) != 0 {
            c.start(ctx, event::GROUP, SendPtr(std::ptr::null_mut()), |_| {})
        } else {
            SendPtr(std::ptr::null_mut())
        };
        let ops: Vec<SendPtr> = (order.iter())
            .map(|&i| {
                let spec = &specs[i];
                if mask & (event::P2P | kernel_bits) == 0 {
                    return SendPtr(std::ptr::null_mut());
                }
                c.start(ctx, event::P2P, p2p_apis[i], |d| {
                    d.ptr(off::P2P_FUNC, spec.func.as_ptr())
                        .u64(off::P2P_BUFF, 0x7200_0000)
                        .ptr(off::P2P_DATATYPE, spec.datatype.as_ptr())
                        .u64(off::P2P_COUNT, spec.count)
                        .i32(off::P2P_PEER, spec.peer)
                        .u8(off::P2P_NCHANNELS, op_items[i].len() as u8)
                        .ptr(off::P2P_PARENT_GROUP, group.0);
                })
            })
            .collect();
        let api_handles = p2p_apis.iter().copied();
        for h in (ops.iter().copied())
            .chain([group])
            .chain(api_handles)
            .chain([group_api])
        {
            if !h.0.is_null() {
                c.stop(h);
            }
        }
        let kernel = Kernel {
            channels,
            ops: order.iter().map(|&i| op_items[i].clone()).collect(),
            kernel_ns: specs.iter().map(|s| s.kernel_ns).max().unwrap_or(0),
            func_id: SEND_RECV_FUNC_ID,
            phases: false,
            symmetric: None,
        };
        let ran = if captured {
            vec![(Vec::new(), Vec::new()); order.len()]
        } else {
            self.run_kernel(mask, &ops, &kernel)
        };
        let reports: Vec<OpReport> = (order.iter().zip(&ops).zip(ran))
            .map(|((&i, op), (kernels, hook_items))| OpReport {
                kind: OpKind::P2p,
                started: !op.0.is_null(),
                seq: 0,
                func: text(specs[i].func),
                datatype: text(specs[i].datatype),
                algo: String::new(),
                kernel_variant: None,
                proto: String::new(),
                count: specs[i].count,
                root_or_peer: specs[i].peer,
                n_channels: op_items[i].len() as u8,
                n_warps: 0,
                kernels,
                hook_items,
                captured,
                replay: 0,
            })
            .collect();
        if captured {
            self.graph.push(Captured {
                reports: reports.clone(),
                handles: ops,
                kernel,
            });
        }
        reports
    }

    /// Starts capturing this communicator's stream into a CUDA graph: until [`Comm::end_capture`],
    /// operations produce their host events (`graphCaptured` set) and no kernel.
    pub fn begin_capture(&mut self) {
        self.capturing = true;
    }

    pub fn end_capture(&mut self) {
        self.capturing = false;
    }

    /// Operations captured so far.
    pub fn captured_ops(&self) -> usize {
        self.graph.iter().map(|g| g.reports.len()).sum()
    }

    /// Launches the captured graph once: every captured operation's kernel in capture order, with fresh
    /// per-channel workCounters and no host event (on stock NCCL, KernelCh events naming the handle
    /// from capture time). One report per operation, `replay` = this communicator's replay count.
    pub fn replay(&mut self) -> Vec<OpReport> {
        self.replays += 1;
        let mask = self.host.mask();
        let mut out = Vec::with_capacity(self.graph.len());
        for i in 0..self.graph.len() {
            let g = &self.graph[i];
            let (handles, kernel) = (g.handles.clone(), g.kernel.clone());
            let ran = self.run_kernel(mask, &handles, &kernel);
            for (report, (kernels, hook_items)) in self.graph[i].reports.iter().zip(ran) {
                out.push(OpReport {
                    started: false,
                    captured: false,
                    replay: self.replays,
                    kernels,
                    hook_items,
                    ..report.clone()
                });
            }
        }
        out
    }

    /// The simulated kernel: its work items timed on the simulated GPU clock, each advancing its
    /// channel's workCounter, reported to the plugin from a second thread (NCCL's proxy/profiler
    /// thread for KernelCh, "the GPU" for the hook). `parents`: the handle of each of `k.ops`.
    fn run_kernel(&mut self, mask: u64, parents: &[SendPtr], k: &Kernel) -> OpKernels {
        let mut base = gpu_now_ns();
        let mut not_before = 0;
        let n = k.channels.len();
        // As on a real GPU shared by several ranks (2 ranks x 64 channels on 132 SMs), not every
        // channel's block is resident at once: the last quarter start when the first ones finish, so
        // the channels of one kernel need not overlap in time.
        let first_wave = n - n / 4;
        if let Some(free) = &mut self.stream_free_ns {
            // Kernels of one stream run back to back: this one starts when the previous one ended.
            base = base.max(*free);
            *free = base + 2 * k.kernel_ns + 1 + n as u64;
            not_before = *free;
        }
        let start_of = |i: usize| match i < first_wave {
            true => base + i as u64,
            false => base + k.kernel_ns + 1 + i as u64,
        };
        let mut items = Vec::new();
        for (i, &ch) in k.channels.iter().enumerate() {
            self.work_counter[ch as usize] += 1;
            let start = start_of(i);
            items.push(HookItem {
                channel: ch,
                work_counter: self.work_counter[ch as usize],
                func_id: k.func_id,
                gpu_start: start,
                gpu_stop: start + k.kernel_ns,
            });
        }
        let job = KernelJob {
            not_before,
            items,
            ops: parents.iter().copied().zip(k.ops.iter().cloned()).collect(),
            kernel_ch: mask & self.kernel_bits() != 0,
            phases: k.phases && k.symmetric.is_some() && mask & event::KERNEL_PHASE != 0,
        };
        if let Some(proxy) = &self.proxy {
            // Asynchronous: reported as NCCL will emit them; the plugin's answers are not waited for.
            let reports = job.expected(self.hook.is_some());
            proxy.tx.send(job).expect("proxy thread");
            return reports;
        }
        let (host, ctx, rank, hook) = (self.host.clone(), self.ctx, self.rank, self.hook);
        let page = &mut self.gpu_page;
        std::thread::scope(|s| {
            s.spawn(move || job.emit(&host, ctx, rank, hook, page))
                .join()
                .expect("simulated kernel thread")
        })
    }

    /// From now on, kernel events come from one long-lived proxy thread per communicator, concurrently
    /// with the host events of later operations (as NCCL's proxy thread does), instead of being
    /// emitted before the next operation starts. Reports then assume the plugin accepted every event.
    pub fn set_async_kernels(&mut self) -> anyhow::Result<()> {
        if self.proxy.is_some() {
            return Ok(());
        }
        let (tx, rx) = std::sync::mpsc::channel::<KernelJob>();
        let (host, ctx, rank, hook) = (self.host.clone(), self.ctx, self.rank, self.hook);
        let mut page = GuardedPage::new()?;
        let thread = std::thread::Builder::new()
            .name("fakenccl-proxy".into())
            .spawn(move || {
                for job in rx {
                    // The GPU writes a work item when it runs it: not before.
                    while let Some(wait) = job.not_before.checked_sub(gpu_now_ns()) {
                        std::thread::sleep(std::time::Duration::from_nanos(wait.min(1_000_000)));
                    }
                    job.emit(&host, ctx, rank, hook, &mut page);
                }
            })?;
        self.proxy = Some(Proxy { tx, thread });
        Ok(())
    }

    /// From now on the simulated GPU lags the host as a busy one does: a kernel starts when the
    /// previous one on the communicator's stream ended (or at its launch if that is later), and its
    /// events are emitted only once it has run, from the proxy thread (kernels become asynchronous).
    /// With kernels longer than the pause between launches, the host enqueues later operations
    /// while earlier ones still run.
    pub fn set_gpu_lag(&mut self) -> anyhow::Result<()> {
        self.set_async_kernels()?;
        self.stream_free_ns.get_or_insert(0);
        Ok(())
    }

    /// Calls the plugin must decline or ignore cheaply: event types it does not handle (ProxyOp, a
    /// type from the future), GroupApi states with NULL args, a KernelCh state on the Group handle,
    /// stop/record on NULL and on a garbage pointer, a Coll on a garbage context. Returns how many of them the
    /// plugin should count as ignored (declined starts, records matching no event, unknown handles).
    pub fn noise(&mut self) -> u64 {
        let ctx = self.ctx;
        let mut c = self.caller();
        let mut ignored = 0;
        for ty in [event::PROXY_OP, 1 << 20] {
            let h = c.start(ctx, ty, SendPtr(std::ptr::null_mut()), |_| {});
            assert!(h.0.is_null(), "type {ty:#x} should be declined");
            ignored += 1;
        }
        // GroupApi states come with NULL args, on the GroupApi handle: nothing to record.
        let group_api = c.start(ctx, event::GROUP_API, SendPtr(std::ptr::null_mut()), |_| {});
        for st in [state::GROUP_START_API_STOP, state::GROUP_END_API_START] {
            c.record(group_api, st, None);
        }
        c.stop(group_api);
        let group = c.start(ctx, event::GROUP, SendPtr(std::ptr::null_mut()), |_| {});
        c.record(group, state::KERNEL_CH_STOP, Some(1));
        ignored += 1;
        c.stop(group);
        c.stop(SendPtr(std::ptr::null_mut()));
        let garbage = SendPtr(0xdead_bee8usize as *mut c_void);
        // A context that is not one the plugin handed out.
        let h = c.start(garbage, event::COLL, SendPtr(std::ptr::null_mut()), |d| {
            d.u8(off::COLL_NCHANNELS, 1);
        });
        assert!(
            h.0.is_null(),
            "an event on an unknown context should be declined"
        );
        ignored += 1;
        c.stop(garbage);
        c.record(garbage, state::KERNEL_CH_STOP, Some(1));
        ignored += 2;
        ignored
    }

    /// `finalize` (after the proxy thread, if any, has emitted everything: NCCL stops it first).
    /// Returns how long the plugin's finalize took.
    pub fn finalize(mut self) -> std::time::Duration {
        if let Some(proxy) = self.proxy.take() {
            drop(proxy.tx);
            proxy.thread.join().expect("proxy thread");
        }
        let t0 = std::time::Instant::now();
        if !self.ctx.0.is_null() {
            // SAFETY: the context `init` returned; NCCL calls finalize only for a non-NULL one.
            let rc = unsafe { (self.host.vt.finalize)(self.ctx.0) };
            if rc != 0 {
                self.host.failed_calls.fetch_add(1, Ordering::Relaxed);
            }
        }
        t0.elapsed()
    }

    /// Whether the plugin handed out a device hook for this communicator.
    pub fn has_hook(&self) -> bool {
        self.hook.is_some()
    }

    /// Whether `init` returned a context (false: the plugin is disabled).
    pub fn has_context(&self) -> bool {
        !self.ctx.0.is_null()
    }
}

/// The cargo target directory of the running test or binary (`target/<profile>`), where the plugin,
/// the stand-in libnccl and the fakenccl binaries are built.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// The plugin built in `target_dir()`, or an error saying how to build it.
pub fn plugin_path() -> anyhow::Result<PathBuf> {
    let p = target_dir().join("libnccl_profiler_ncclscope.so");
    if !p.exists() {
        bail!(
            "{} is missing: run `cargo build --workspace` first (scripts/test.sh does)",
            p.display()
        );
    }
    Ok(p)
}
