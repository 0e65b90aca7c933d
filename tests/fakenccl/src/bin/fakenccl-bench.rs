//! Host-path cost of a profiler plugin under NCCL 2.30's event tree, for any plugin `.so` (ncclscope,
//! NCCL's example profiler, NCCL Inspector, an older ncclscope build), side by side in one run.
//!
//! Per collective, on each calling thread (one communicator per thread, as one rank per GPU), the
//! events NCCL 2.30's stock path emits, gated by the plugin's activation mask as NCCL gates them:
//! GroupApi, CollApi (parent GroupApi), Group, Coll (parent CollApi), their four stops, then per channel
//! KernelCh (parent Coll) with its KernelChStop state (GPU `pTimer`) and stop. With `--proxy` the
//! KernelCh events come from a second thread per rank, as NCCL's proxy thread reports them (their
//! parent started on the application thread). `pair` mode: one Coll start + stop per iteration (no
//! kernel children), the figure of the old `host_events` bench.
//!
//! The parent process runs one child process per (round, plugin), plugins in a rotating order, so every
//! plugin runs on the same driver, machine and load; each child loads one plugin (`dlopen`, RTLD_NOW |
//! RTLD_LOCAL, symbol `ncclProfiler_v6` then `_v5`, as NCCL 2.30 does) and measures every (mode,
//! channels, threads) case. Threads work in bursts of `--burst` collectives with a pause between
//! them (the forwarding thread of a plugin that has one drains), and only time inside bursts counts;
//! reported: the median over rounds of ns per collective per thread (slowest thread of the run).
//! Peers get stand-ins for their CUDA calls (libfakenccl_cuda.so copied as libcudart.so.13 and
//! libcuda.so.1 on their LD_LIBRARY_PATH). ncclscope children hand their segment to a stand-in daemon
//! that drains it, and print its loss counters.
//!
//! fakenccl-bench [--rounds 5] [--threads 1,2,4,8] [--channels 1,4] [--modes tree,pair] [--proxy]
//!                NAME=PATH.so ... [empty]
//!
//! NAME `example*` runs with 1 channel only (its KernelCh stop path recognises channel 0 only).

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_ulong, c_void};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_LOCAL, RTLD_NOW};
use ncclscope_fakenccl::nccl::{Logger, Vtable, event, off, state};

#[derive(Parser, Clone)]
struct Args {
    /// Plugins as NAME=PATH (and `empty`: no-op functions, the cost of the calls themselves).
    plugins: Vec<String>,
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    threads: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    channels: Vec<u8>,
    #[arg(long, value_delimiter = ',', default_value = "tree,pair")]
    modes: Vec<String>,
    /// KernelCh events from a proxy thread per rank (cross-thread parents and stops).
    #[arg(long)]
    proxy: bool,
    /// Collectives per burst and thread.
    #[arg(long, default_value_t = 1000)]
    burst: u64,
    /// Bursts per measured run.
    #[arg(long, default_value_t = 10)]
    bursts: u64,
    /// Pause between bursts (ms).
    #[arg(long, default_value_t = 3)]
    pause_ms: u64,
    /// The CUDA stand-in library (default: libfakenccl_cuda.so next to this binary).
    #[arg(long)]
    cuda_stub: Option<PathBuf>,
    /// Internal: run as the child measuring one plugin.
    #[arg(long, hide = true)]
    child: bool,
}

/// What NCCL passes as `logfn`: a variadic C function. This one reads only the fixed arguments, which
/// the x86-64 and AArch64 C ABIs pass the same way for a variadic callee; with FAKENCCL_BENCH_LOG set
/// it prints the format string (not its arguments) to stderr.
extern "C" fn quiet_log(
    _l: c_int,
    _f: c_ulong,
    _file: *const c_char,
    _line: c_int,
    fmt: *const c_char,
) {
    if !fmt.is_null() && std::env::var_os("FAKENCCL_BENCH_LOG").is_some() {
        // SAFETY: a plugin passes a NUL-terminated format string, as to NCCL's logger.
        let fmt = unsafe { std::ffi::CStr::from_ptr(fmt) };
        eprintln!("log: {}", fmt.to_string_lossy());
    }
}

fn logger() -> Logger {
    // SAFETY: see `quiet_log`: a callee that reads only the fixed arguments.
    unsafe { std::mem::transmute::<*const c_void, Logger>(quiet_log as *const c_void) }
}

extern "C" fn empty_init(
    ctx: *mut *mut c_void,
    _: u64,
    mask: *mut c_int,
    _: *const c_char,
    _: c_int,
    _: c_int,
    _: c_int,
    _: Option<Logger>,
) -> c_int {
    // SAFETY: NCCL's out pointers.
    unsafe {
        *ctx = 8 as *mut c_void;
        *mask = 0x46;
    }
    0
}
extern "C" fn empty_start(_: *mut c_void, h: *mut *mut c_void, _: *mut u8) -> c_int {
    // SAFETY: NCCL's out pointer.
    unsafe { *h = 8 as *mut c_void };
    0
}
extern "C" fn empty_stop(_: *mut c_void) -> c_int {
    0
}
extern "C" fn empty_record(_: *mut c_void, _: c_int, _: *mut u64) -> c_int {
    0
}
extern "C" fn empty_finalize(_: *mut c_void) -> c_int {
    0
}

struct Loaded {
    vt: Vtable,
    mask: &'static AtomicI32,
    _lib: Option<Library>,
}
// SAFETY: the vtable's functions are thread-safe by the profiler contract; the mask is an atomic.
unsafe impl Sync for Loaded {}

fn load(path: &str) -> anyhow::Result<Loaded> {
    let mask: &'static AtomicI32 = Box::leak(Box::new(AtomicI32::new(0)));
    if path == "empty" {
        let vt = Vtable {
            name: c"empty".as_ptr(),
            init: empty_init,
            start_event: empty_start,
            stop_event: empty_stop,
            record_event_state: empty_record,
            finalize: empty_finalize,
        };
        return Ok(Loaded {
            vt,
            mask,
            _lib: None,
        });
    }
    // SAFETY: NCCL loads profiler plugins this way; their initialisers are their own business.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
        .with_context(|| format!("dlopen {path}"))?;
    for sym in [&b"ncclProfiler_v6\0"[..], b"ncclProfiler_v5\0"] {
        // SAFETY: a data symbol; NCCL reads its first 48 bytes as the vtable.
        if let Ok(p) = unsafe { lib.get::<*const Vtable>(sym) } {
            // SAFETY: as above.
            let vt = unsafe { **p };
            return Ok(Loaded {
                vt,
                mask,
                _lib: Some(lib),
            });
        }
    }
    bail!("{path} exports neither ncclProfiler_v6 nor ncclProfiler_v5")
}

#[derive(Clone, Copy)]
struct Ptr(*mut c_void);
// SAFETY: plugin handles and contexts move between NCCL's threads; plugins are thread-safe.
unsafe impl Send for Ptr {}
// SAFETY: as above.
unsafe impl Sync for Ptr {}
const NULL: Ptr = Ptr(std::ptr::null_mut());

/// v6 descriptor (112 bytes) as u64 words.
type Descr = [u64; 14];

struct Caller<'a> {
    p: &'a Loaded,
    ctx: Ptr,
}

impl Caller<'_> {
    #[inline]
    fn start(&self, d: &mut Descr) -> Ptr {
        let mut h = std::ptr::null_mut();
        // SAFETY: startEvent with the plugin's context, an out pointer and a 112-byte descriptor.
        unsafe { (self.p.vt.start_event)(self.ctx.0, &mut h, d.as_mut_ptr().cast()) };
        Ptr(h)
    }

    #[inline]
    fn stop(&self, h: Ptr) {
        if !h.0.is_null() {
            // SAFETY: stopEvent on a handle the plugin returned.
            unsafe { (self.p.vt.stop_event)(h.0) };
        }
    }

    /// A KernelCh of `parent` on `channel`, its KernelChStop with the GPU stop time, its stop.
    #[inline]
    fn kernel(&self, parent: Ptr, channel: u8, t: u64) {
        let mut d: Descr = [0; 14];
        d[off::TYPE / 8] = event::KERNEL_CH;
        d[off::PARENT / 8] = parent.0 as u64;
        d[off::KCH_CHANNEL / 8] = channel as u64;
        d[off::KCH_PTIMER / 8] = t;
        let k = self.start(&mut d);
        if !k.0.is_null() {
            let mut stop = t + 5_000;
            // SAFETY: recordEventState with 8 bytes of state args (kernelCh.pTimer).
            unsafe { (self.p.vt.record_event_state)(k.0, state::KERNEL_CH_STOP, &mut stop) };
            self.stop(k);
        }
    }

    /// The host part of one collective; returns the Coll handle (the kernel events' parent).
    #[inline]
    fn collective(&self, seq: u64, channels: u8) -> Ptr {
        let m = self.p.mask.load(Ordering::Relaxed) as u64;
        let below = event::GROUP | event::COLL | event::P2P | event::KERNEL_CH;
        let group_api = if m & (event::GROUP_API | below) != 0 {
            let mut d: Descr = [0; 14];
            d[off::TYPE / 8] = event::GROUP_API;
            d[off::GROUPAPI_DEPTH / 8] = 1 << 32; // groupDepth (int at 28) = 1
            self.start(&mut d)
        } else {
            NULL
        };
        let coll_api = if m & (event::COLL_API | event::COLL | event::KERNEL_CH) != 0 {
            let mut d: Descr = [0; 14];
            d[off::TYPE / 8] = event::COLL_API;
            d[off::PARENT / 8] = group_api.0 as u64;
            d[off::COLLAPI_FUNC / 8] = c"AllReduce".as_ptr() as u64;
            d[off::COLLAPI_COUNT / 8] = 1 << 20;
            d[off::COLLAPI_DATATYPE / 8] = c"ncclFloat32".as_ptr() as u64;
            d[off::COLLAPI_STREAM / 8] = 0x7300_0000;
            self.start(&mut d)
        } else {
            NULL
        };
        let group = if m & below != 0 {
            let mut d: Descr = [0; 14];
            d[off::TYPE / 8] = event::GROUP;
            self.start(&mut d)
        } else {
            NULL
        };
        let coll = if m & (event::COLL | event::KERNEL_CH) != 0 {
            let mut d = coll_descr(seq, channels);
            d[off::PARENT / 8] = coll_api.0 as u64;
            d[off::COLL_PARENT_GROUP / 8] = group.0 as u64;
            self.start(&mut d)
        } else {
            NULL
        };
        for h in [coll, group, coll_api, group_api] {
            self.stop(h);
        }
        coll
    }
}

fn coll_descr(seq: u64, channels: u8) -> Descr {
    let mut d: Descr = [0; 14];
    d[off::TYPE / 8] = event::COLL;
    d[off::COLL_SEQ / 8] = seq;
    d[off::COLL_FUNC / 8] = c"AllReduce".as_ptr() as u64;
    d[off::COLL_SEND / 8] = 0x7000_0000;
    d[off::COLL_RECV / 8] = 0x7100_0000;
    d[off::COLL_COUNT / 8] = 1 << 20; // 4 MiB of f32: above Inspector's 8 KiB dump minimum
    d[off::COLL_DATATYPE / 8] = c"ncclFloat32".as_ptr() as u64;
    d[off::COLL_NCHANNELS / 8] = channels as u64 | 8 << 8; // nWarps 8
    d[off::COLL_ALGO / 8] = c"RING".as_ptr() as u64;
    d[off::COLL_PROTO / 8] = c"SIMPLE".as_ptr() as u64;
    d
}

/// One rank's work for a measured run; returns the time spent inside bursts.
fn rank(
    p: &Loaded,
    ctx: Ptr,
    a: &Args,
    mode: &str,
    channels: u8,
    seq0: u64,
    start: &Barrier,
) -> Duration {
    let c = Caller { p, ctx };
    let kernel_ch = p.mask.load(Ordering::Relaxed) as u64 & event::KERNEL_CH != 0;
    let (tx, rx) = std::sync::mpsc::sync_channel::<Msg>(4 * a.burst as usize);
    std::thread::scope(|s| {
        // NCCL's proxy thread: KernelCh events of collectives the application thread enqueued.
        let proxy = (a.proxy && mode == "tree").then(move || {
            s.spawn(move || {
                let c = Caller { p, ctx };
                while let Ok(msg) = rx.recv() {
                    match msg {
                        Msg::Kernels(coll, t) => {
                            for ch in 0..channels {
                                c.kernel(coll, ch, t + ch as u64);
                            }
                        }
                        Msg::Sync(done) => {
                            let _ = done.send(());
                        }
                        Msg::Stop => return,
                    }
                }
            })
        });
        start.wait();
        let mut busy = Duration::ZERO;
        let mut seq = seq0;
        for _ in 0..a.bursts {
            let t0 = Instant::now();
            for _ in 0..a.burst {
                seq += 1;
                if mode == "pair" {
                    // No kernel children announced: the Coll is complete at its stop.
                    let mut d = coll_descr(seq, 0);
                    let h = c.start(&mut d);
                    c.stop(h);
                    continue;
                }
                let coll = c.collective(seq, channels);
                if !kernel_ch {
                    continue;
                }
                let t = seq * 1_000_000;
                match &proxy {
                    Some(_) => tx.send(Msg::Kernels(coll, t)).expect("proxy thread"),
                    None => (0..channels).for_each(|ch| c.kernel(coll, ch, t + ch as u64)),
                }
            }
            if proxy.is_some() {
                // The burst ends when the proxy thread has reported its kernels.
                let (done_tx, done_rx) = std::sync::mpsc::sync_channel::<()>(1);
                tx.send(Msg::Sync(done_tx)).expect("proxy thread");
                let _ = done_rx.recv();
            }
            busy += t0.elapsed();
            std::thread::sleep(Duration::from_millis(a.pause_ms));
        }
        let _ = tx.send(Msg::Stop);
        if let Some(p) = proxy {
            p.join().expect("proxy thread");
        }
        busy
    })
}

/// From an application thread to its proxy thread.
enum Msg {
    /// Report the kernel of this Coll handle (GPU start time).
    Kernels(Ptr, u64),
    /// Answer when everything sent before is reported.
    Sync(std::sync::mpsc::SyncSender<()>),
    Stop,
}

fn child(a: &Args) -> anyhow::Result<()> {
    let (name, path) = a.plugins[0].split_once('=').unwrap_or(("empty", "empty"));
    let catcher = ncclscope_fakenccl::process::Catcher::start();
    // SAFETY: before any plugin or thread reads the environment.
    unsafe { std::env::set_var("NCCLSCOPE_SOCKET", catcher.socket()) };
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| -> anyhow::Result<()> {
        // A stand-in daemon: drains every segment, as the real one does.
        s.spawn(|| {
            let mut consumers: Vec<ncclscope_proto::segment::Consumer> = Vec::new();
            let mut buf = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if consumers.is_empty() {
                    consumers = catcher
                        .segments()
                        .into_iter()
                        .map(ncclscope_proto::segment::Consumer::new)
                        .collect();
                }
                for c in &mut consumers {
                    while let Ok((first, read @ [_, ..])) = c.read_raw(4096, &mut buf) {
                        let upto = first + read.len() as u64;
                        c.commit(upto);
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let r = measure(a, name, path, &catcher);
        stop.store(true, Ordering::Relaxed);
        r
    })
}

/// The child's measurements of one plugin.
fn measure(
    a: &Args,
    name: &str,
    path: &str,
    catcher: &ncclscope_fakenccl::process::Catcher,
) -> anyhow::Result<()> {
    {
        if is_peer(name) {
            // The example plugin's CE-event code references CUDA runtime symbols without linking
            // libcudart: the stand-in (on this process's LD_LIBRARY_PATH) provides them globally.
            // SAFETY: our own stand-in library; its initialisers are Rust statics only.
            let cudart = unsafe { Library::open(Some("libcudart.so.13"), RTLD_NOW | RTLD_GLOBAL) }
                .context("loading the CUDA stand-in (libcudart.so.13 on LD_LIBRARY_PATH)")?;
            std::mem::forget(cudart);
        }
        let p = load(path)?;
        let max_threads = a.threads.iter().copied().max().unwrap_or(1);
        let ctxs: Vec<Ptr> = (0..max_threads)
            .map(|i| {
                let mut ctx = std::ptr::null_mut();
                // SAFETY: init as NCCL calls it: out pointer, mask global, name, logger.
                let rc = unsafe {
                    (p.vt.init)(
                        &mut ctx,
                        0xbe4c_0000 + i as u64,
                        p.mask.as_ptr(),
                        c"bench".as_ptr(),
                        1,
                        max_threads as c_int,
                        i as c_int,
                        Some(logger()),
                    )
                };
                if rc != 0 || ctx.is_null() {
                    bail!("{name}: init returned {rc} (context {ctx:?})");
                }
                Ok(Ptr(ctx))
            })
            .collect::<anyhow::Result<_>>()?;
        let mut seq = 0;
        let mut drops_before = dropped(catcher);
        for mode in &a.modes {
            for &channels in &a.channels {
                if mode == "pair" && channels != a.channels[0] {
                    continue; // pair mode has no channels
                }
                if name.starts_with("example") && channels != 1 {
                    continue;
                }
                for &threads in &a.threads {
                    let barrier = Barrier::new(threads);
                    let busy: Vec<Duration> = std::thread::scope(|s| {
                        let hs: Vec<_> = (0..threads)
                            .map(|i| {
                                let (p, ctx, barrier) = (&p, ctxs[i], &barrier);
                                std::thread::Builder::new()
                                    .name(format!("rank-{i}"))
                                    .spawn_scoped(s, move || {
                                        rank(p, ctx, a, mode, channels, seq, barrier)
                                    })
                                    .expect("rank thread")
                            })
                            .collect();
                        hs.into_iter().map(|h| h.join().expect("rank")).collect()
                    });
                    seq += a.burst * a.bursts + 1;
                    let slowest = busy.iter().max().copied().unwrap_or_default();
                    let ns = slowest.as_nanos() as f64 / (a.burst * a.bursts) as f64;
                    let ch = if mode == "pair" { 0 } else { channels };
                    println!("result {mode} {ch} {threads} {name} {ns:.1}");
                    // What this case dropped (ncclscope: its segment's counters, moved there by its
                    // forwarding thread within 20 ms).
                    if !is_peer(name) && name != "empty" {
                        std::thread::sleep(Duration::from_millis(40));
                        let total = dropped(catcher);
                        println!(
                            "drops {mode} {ch} {threads} {name} {}",
                            total - drops_before
                        );
                        drops_before = total;
                    }
                }
            }
        }
        for ctx in ctxs {
            // SAFETY: finalize of a context init returned.
            unsafe { (p.vt.finalize)(ctx.0) };
        }
        std::thread::sleep(Duration::from_millis(50));
        for seg in catcher.segments() {
            for c in ncclscope_proto::Counter::ALL {
                if seg.counter(c) > 0 {
                    println!("counter {name} {} {}", c.name(), seg.counter(c));
                }
            }
        }
        Ok(())
    }
}

/// Events the plugin's segments count as dropped so far (lane or segment full, pool exhausted).
fn dropped(catcher: &ncclscope_fakenccl::process::Catcher) -> u64 {
    use ncclscope_proto::Counter;
    catcher
        .segments()
        .iter()
        .map(|s| {
            s.counter(Counter::QueueFull)
                + s.counter(Counter::RingFull)
                + s.counter(Counter::PoolExhausted)
        })
        .sum()
}

/// A directory with the CUDA stand-in under the names the peers load.
fn stub_dir(a: &Args) -> anyhow::Result<tempfile::TempDir> {
    let stub = match &a.cuda_stub {
        Some(p) => p.clone(),
        None => ncclscope_fakenccl::target_dir().join("libfakenccl_cuda.so"),
    };
    let dir = tempfile::tempdir()?;
    for name in ["libcudart.so.13", "libcuda.so.1", "libcuda.so"] {
        std::fs::copy(&stub, dir.path().join(name))
            .with_context(|| format!("copying the CUDA stand-in {}", stub.display()))?;
    }
    Ok(dir)
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if a.child {
        return child(&a);
    }
    if a.plugins.is_empty() {
        bail!("name at least one plugin: NAME=PATH.so (or `empty`)");
    }
    let stubs = stub_dir(&a)?;
    let dump = tempfile::tempdir()?;
    let exe = std::env::current_exe()?;
    println!(
        "cores: {}, rounds: {}, bursts: {} x {} collectives, proxy thread: {}",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        a.rounds,
        a.bursts,
        a.burst,
        a.proxy
    );
    // (mode, channels, threads, plugin) -> ns per collective, one per round.
    let mut results: BTreeMap<(String, u8, usize, String), Vec<f64>> = BTreeMap::new();
    let mut counters: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut drops: BTreeMap<(String, u8, usize, String), u64> = BTreeMap::new();
    for round in 0..a.rounds {
        for k in 0..a.plugins.len() {
            let spec = &a.plugins[(round + k) % a.plugins.len()];
            let mut cmd = Command::new(&exe);
            cmd.arg("--child")
                .arg(format!("--threads={}", join(&a.threads)))
                .arg(format!("--channels={}", join(&a.channels)))
                .arg(format!("--modes={}", a.modes.join(",")))
                .arg(format!("--burst={}", a.burst))
                .arg(format!("--bursts={}", a.bursts))
                .arg(format!("--pause-ms={}", a.pause_ms))
                .args(a.proxy.then_some("--proxy"))
                .arg(spec)
                // NCCL Inspector: on, no dump thread, its files in a temporary directory.
                .env("NCCL_INSPECTOR_ENABLE", "1")
                .env("NCCL_INSPECTOR_DUMP_THREAD_ENABLE", "0")
                .env("NCCL_INSPECTOR_DUMP_DIR", dump.path())
                // The example plugin: the events ncclscope asks for (Coll | P2p | KernelCh).
                .env("NCCL_PROFILE_EVENT_MASK", "70");
            if is_peer(spec) {
                cmd.env("LD_LIBRARY_PATH", stubs.path());
            }
            let out = cmd.output()?;
            if !out.status.success() {
                bail!(
                    "{spec}: {}\n{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let f: Vec<&str> = line.split_whitespace().collect();
                match f.as_slice() {
                    ["result", mode, ch, threads, name, ns] => results
                        .entry((
                            mode.to_string(),
                            ch.parse()?,
                            threads.parse()?,
                            name.to_string(),
                        ))
                        .or_default()
                        .push(ns.parse()?),
                    ["drops", mode, ch, threads, name, n] => {
                        *drops
                            .entry((
                                mode.to_string(),
                                ch.parse()?,
                                threads.parse()?,
                                name.to_string(),
                            ))
                            .or_default() += n.parse::<u64>()?
                    }
                    ["counter", name, counter, n] => {
                        *counters
                            .entry((name.to_string(), counter.to_string()))
                            .or_default() += n.parse::<u64>()?
                    }
                    _ => {}
                }
            }
        }
    }
    let names: Vec<String> = a
        .plugins
        .iter()
        .map(|s| s.split_once('=').map_or(s.clone(), |(n, _)| n.to_string()))
        .collect();
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut cases: Vec<(String, u8, usize)> = results
        .keys()
        .map(|(m, c, t, _)| (m.clone(), *c, *t))
        .collect();
    cases.dedup();
    println!(
        "\nns per collective per thread (median of {} rounds; pair = Coll start+stop)",
        a.rounds
    );
    println!("mode channels threads {}", names.join(" "));
    for (mode, ch, threads) in &cases {
        let row: Vec<String> = names
            .iter()
            .map(|n| {
                results
                    .get(&(mode.clone(), *ch, *threads, n.clone()))
                    .map_or("-".into(), |v| format!("{:.0}", median(v)))
            })
            .collect();
        println!("{mode} {ch} {threads} {}", row.join(" "));
    }
    // Ratios: the first plugin over each other one, and each plugin's scaling (n threads / 1 thread).
    println!("\nratios: {} / other (same case, same run)", names[0]);
    for (mode, ch, threads) in &cases {
        let first = results.get(&(mode.clone(), *ch, *threads, names[0].clone()));
        let row: Vec<String> = names[1..]
            .iter()
            .map(|n| {
                match (
                    first,
                    results.get(&(mode.clone(), *ch, *threads, n.clone())),
                ) {
                    (Some(a), Some(b)) => format!("{n}={:.2}", median(a) / median(b)),
                    _ => format!("{n}=-"),
                }
            })
            .collect();
        println!("{mode} {ch} {threads} {}", row.join(" "));
    }
    println!("\nscaling: ns at n threads / ns at 1 thread");
    for n in &names {
        for (mode, ch, threads) in cases.iter().filter(|c| c.2 != 1) {
            if let (Some(one), Some(at)) = (
                results.get(&(mode.clone(), *ch, 1, n.clone())),
                results.get(&(mode.clone(), *ch, *threads, n.clone())),
            ) {
                println!("{n} {mode} {ch} {threads} {:.2}", median(at) / median(one));
            }
        }
    }
    if !drops.is_empty() {
        println!(
            "\nevents dropped and counted (all rounds; a dropped event is cheaper than a queued one)"
        );
        for ((mode, ch, threads, name), n) in &drops {
            let emitted = a.rounds as u64 * *threads as u64 * a.burst * a.bursts;
            println!("{name} {mode} {ch} {threads}: {n} over {emitted} collectives");
        }
    }
    for ((name, counter), n) in &counters {
        println!("segment counter {name} {counter}: {n}");
    }
    Ok(())
}

/// NCCL's own plugins (NAME inspector* or example*): they get the CUDA stand-ins. (Not ncclscope:
/// its GPU clock calibration would find the stand-in as libcuda.)
fn is_peer(spec: &str) -> bool {
    spec.starts_with("inspector") || spec.starts_with("example")
}

fn join<T: ToString>(v: &[T]) -> String {
    v.iter().map(T::to_string).collect::<Vec<_>>().join(",")
}
