//! The device hook on a real GPU, through the real plugin .so: `getDeviceHook` hands out the hook and a
//! devCtx per communicator, the NCCL-shaped harness kernel (cuda/harness.cu, loaded as its own module)
//! calls it through a function pointer, the plugin's forwarding thread drains the rings into the segment,
//! and this process reads the segment and checks every work item.
//!
//! Modes (one per process; tests/gpu/devhook_bench.sh runs them all):
//! - `verify <host|device> <slots> <spin_ns>`: 2 communicators on 2 streams, plain launches and CUDA-graph
//!   replays, 64 channels, >= 1 M events; every work item delivered, in order, content checked, 0 lost.
//! - `overrun`: 64-slot rings overrun by a burst; delivered + lost + unpaired must equal written.
//! - `bench`: ns per event of our hook (both placements) against reference hooks, side by side.
//! - `calibration <secs>`: the exported GPU clock calibrations (error bound, drift) over a run.
//!
//! Built on the CPU machine (`cargo build --release -p ncclscope-plugin --benches` with NVCC set) and
//! carried to the GPU machine with the .so.

mod devhook_support;

use std::ffi::{CStr, c_void};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use devhook_support::{Comm, Plugin, Reader};
use ncclscope_proto::Counter;

static HARNESS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ncclscope_harness.fatbin"));
static HOOKS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ncclscope_hook.fatbin"));

const THREADS: u32 = 512;
const FUNC_ID: u32 = 100;
const N_WORKS: u32 = 2;

/// The funcId the harness gives work item `wc` (batches of N_WORKS items, alternating ids).
fn func_of(wc: u64) -> u32 {
    FUNC_ID + (((wc - 1) / N_WORKS as u64) & 1) as u32
}

fn ck(rc: cu::CUresult, what: &str) {
    assert_eq!(rc, cu::CUresult::CUDA_SUCCESS, "{what}");
}

struct Gpu {
    harness: cu::CUfunction,
    byval: cu::CUfunction,
    inline: cu::CUfunction,
    event32: cu::CUfunction,
    refs: cu::CUmodule,
}

fn load_module(image: &[u8]) -> cu::CUmodule {
    assert!(
        !image.is_empty(),
        "built without nvcc: set NVCC and rebuild"
    );
    let mut aligned = vec![0u64; image.len().div_ceil(8)];
    // SAFETY: `aligned` has room for the image.
    unsafe {
        std::ptr::copy_nonoverlapping(image.as_ptr(), aligned.as_mut_ptr() as *mut u8, image.len())
    };
    let mut m = std::ptr::null_mut();
    // SAFETY: a complete fatbin; a context is current.
    ck(
        unsafe { cu::cuModuleLoadData(&mut m, aligned.as_ptr() as *const c_void) },
        "cuModuleLoadData",
    );
    m
}

fn function(m: cu::CUmodule, name: &CStr) -> cu::CUfunction {
    let mut f = std::ptr::null_mut();
    // SAFETY: valid module and name.
    ck(
        unsafe { cu::cuModuleGetFunction(&mut f, m, name.as_ptr()) },
        "cuModuleGetFunction",
    );
    f
}

fn pointer(m: cu::CUmodule, name: &CStr) -> u64 {
    let (mut g, mut size, mut v) = (0u64, 0usize, 0u64);
    // SAFETY: the global is an 8-byte function pointer.
    unsafe {
        ck(
            cu::cuModuleGetGlobal_v2(&mut g, &mut size, m, name.as_ptr()),
            "cuModuleGetGlobal",
        );
        ck(
            cu::cuMemcpyDtoH_v2(&mut v as *mut u64 as *mut c_void, g, 8),
            "cuMemcpyDtoH",
        );
    }
    v
}

fn init_gpu() -> Gpu {
    // SAFETY: driver initialisation and the primary context of device 0, made current on this thread.
    unsafe {
        assert!(cu::is_culib_present(), "no libcuda");
        ck(cu::cuInit(0), "cuInit");
        let (mut dev, mut ctx) = (0, std::ptr::null_mut());
        ck(cu::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        ck(
            cu::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            "cuDevicePrimaryCtxRetain",
        );
        ck(cu::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
        let mut name = [0i8; 128];
        ck(
            cu::cuDeviceGetName(name.as_mut_ptr(), 128, dev),
            "cuDeviceGetName",
        );
        println!(
            "device: {}",
            CStr::from_ptr(name.as_ptr()).to_string_lossy()
        );
    }
    let m = load_module(HARNESS);
    let gpu = Gpu {
        harness: function(m, c"ncclscope_harness"),
        byval: function(m, c"ncclscope_harness_byval"),
        inline: function(m, c"ncclscope_harness_inline"),
        event32: function(m, c"ncclscope_harness_event32"),
        refs: load_module(HOOKS),
    };
    let mut regs = 0;
    // SAFETY: valid function, out pointer.
    ck(
        unsafe {
            cu::cuFuncGetAttribute(
                &mut regs,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS,
                gpu.harness,
            )
        },
        "regs",
    );
    println!("harness_registers: {regs}");
    gpu
}

fn stream() -> cu::CUstream {
    let mut s = std::ptr::null_mut();
    // SAFETY: out pointer.
    ck(
        unsafe { cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
        "cuStreamCreate",
    );
    s
}

fn dev_zeroed(bytes: usize) -> u64 {
    let mut d = 0;
    // SAFETY: out pointer; memset of the new allocation.
    unsafe {
        ck(cu::cuMemAlloc_v2(&mut d, bytes), "cuMemAlloc");
        ck(cu::cuMemsetD8_v2(d, 0, bytes), "cuMemset");
    }
    d
}

/// One harness launch: `channels` blocks; each does `batches` batches of N_WORKS items.
#[allow(clippy::too_many_arguments)]
fn launch(
    f: cu::CUfunction,
    s: cu::CUstream,
    channels: u32,
    hook: u64,
    ctx: u64,
    wcs: u64,
    batches: u32,
    spin_ns: u32,
) {
    let (mut hook, mut ctx, mut wcs, mut batches, mut works, mut func, mut spin) =
        (hook, ctx, wcs, batches, N_WORKS, FUNC_ID, spin_ns);
    let mut params = [
        &mut hook as *mut u64 as *mut c_void,
        &mut ctx as *mut u64 as *mut c_void,
        &mut wcs as *mut u64 as *mut c_void,
        &mut batches as *mut u32 as *mut c_void,
        &mut works as *mut u32 as *mut c_void,
        &mut func as *mut u32 as *mut c_void,
        &mut spin as *mut u32 as *mut c_void,
    ];
    // SAFETY: the harness kernels take (void*, void*, u64*, u32, u32, u32, u32).
    ck(
        unsafe {
            cu::cuLaunchKernel(
                f,
                channels,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        "cuLaunchKernel",
    );
}

fn sync(s: cu::CUstream) {
    // SAFETY: a live stream.
    ck(unsafe { cu::cuStreamSynchronize(s) }, "cuStreamSynchronize");
}

/// Captures one launch into a CUDA graph (global capture mode, as PyTorch uses) and instantiates it.
fn graph_of(s: cu::CUstream, f: impl FnOnce()) -> cu::CUgraphExec {
    let (mut g, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: capture on our stream, then instantiate the captured graph.
    unsafe {
        ck(
            cu::cuStreamBeginCapture_v2(s, cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL),
            "begin capture",
        );
        f();
        ck(cu::cuStreamEndCapture(s, &mut g), "end capture");
        ck(
            cu::cuGraphInstantiateWithFlags(&mut exec, g, 0),
            "instantiate",
        );
    }
    exec
}

fn accounted(r: &Reader) -> u64 {
    r.check.works * 2 + r.counter(Counter::DevLost) + r.counter(Counter::DevUnpaired)
}

/// Reads the segment until `events` are accounted for or `limit` passes.
fn read_until(r: &mut Reader, events: u64, limit: Duration) {
    let t0 = Instant::now();
    while accounted(r) < events && t0.elapsed() < limit {
        if r.poll(&func_of) == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

fn finalize_and_read(plugin: &Plugin, comms: &[Comm], r: &mut Reader) {
    for c in comms {
        plugin.finalize(c);
    }
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        if r.poll(&func_of) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn verify(gpu: &Gpu, placement: &str, slots: &str, spin: u32) {
    let plugin = Plugin::load(&[
        ("NCCLSCOPE_RING_MEMORY", placement),
        ("NCCLSCOPE_RING_SLOTS", slots),
        ("NCCLSCOPE_SEGMENT_RECORDS", "4194304"),
    ]);
    let comms: Vec<Comm> = (0..2).map(|i| plugin.comm(0xc0 + i, 0)).collect();
    for c in &comms {
        assert!(
            !c.hook.is_null(),
            "getDeviceHook offered no hook ({placement})"
        );
    }
    println!(
        "hook: {:#x} devctx: {:#x} {:#x}",
        comms[0].hook as u64, comms[0].dev_ctx as u64, comms[1].dev_ctx as u64
    );
    let mut reader = plugin.segment();
    const CHANNELS: u32 = 64;
    const BATCHES: u32 = 1024; // 2048 items per launch
    let streams: Vec<_> = comms.iter().map(|_| stream()).collect();
    let wcs: Vec<u64> = comms.iter().map(|_| dev_zeroed(64 * 8)).collect();
    // Per communicator: 2 plain launches, then a captured launch replayed 2 times: 8192 items per channel.
    let graphs: Vec<_> = (0..2)
        .map(|i| {
            let (c, s, w) = (&comms[i], streams[i], wcs[i]);
            graph_of(s, || {
                launch(
                    gpu.harness,
                    s,
                    CHANNELS,
                    c.hook as u64,
                    c.dev_ctx as u64,
                    w,
                    BATCHES,
                    spin,
                )
            })
        })
        .collect();
    let t0 = Instant::now();
    for _ in 0..2 {
        for i in 0..2 {
            let (c, s, w) = (&comms[i], streams[i], wcs[i]);
            launch(
                gpu.harness,
                s,
                CHANNELS,
                c.hook as u64,
                c.dev_ctx as u64,
                w,
                BATCHES,
                spin,
            );
        }
    }
    for _ in 0..2 {
        for i in 0..2 {
            // SAFETY: an instantiated graph on its stream.
            ck(
                unsafe { cu::cuGraphLaunch(graphs[i], streams[i]) },
                "cuGraphLaunch",
            );
        }
    }
    let items = 4 * BATCHES as u64 * N_WORKS as u64;
    let events = 2 * 2 * CHANNELS as u64 * items;
    read_until(&mut reader, events, Duration::from_secs(60));
    for s in &streams {
        sync(*s);
    }
    let kernels_s = t0.elapsed().as_secs_f64();
    finalize_and_read(&plugin, &comms, &mut reader);
    let c = &reader.check;
    let tag = format!("verify_{placement}_slots{slots}_spin{spin}");
    println!("{tag}_events_written: {events}");
    println!("{tag}_events_delivered: {}", c.works * 2);
    println!("{tag}_lost: {}", reader.counter(Counter::DevLost));
    println!("{tag}_unpaired: {}", reader.counter(Counter::DevUnpaired));
    println!("{tag}_out_of_order: {}", c.out_of_order);
    println!("{tag}_bad_content: {}", c.bad_content);
    println!("{tag}_comms_seen: {}", c.comms.len());
    println!("{tag}_seconds: {kernels_s:.3}");
    let ok = c.works * 2 == events
        && c.out_of_order == 0
        && c.bad_content == 0
        && accounted(&reader) == events;
    println!("{tag}: {}", if ok { "PASS" } else { "FAIL" });
}

fn overrun(gpu: &Gpu, placement: &str) {
    let plugin = Plugin::load(&[
        ("NCCLSCOPE_RING_MEMORY", placement),
        ("NCCLSCOPE_RING_SLOTS", "64"),
        ("NCCLSCOPE_SEGMENT_RECORDS", "4194304"),
    ]);
    let comm = plugin.comm(0xbad, 0);
    assert!(!comm.hook.is_null());
    let mut reader = plugin.segment();
    let s = stream();
    let w = dev_zeroed(64 * 8);
    launch(
        gpu.harness,
        s,
        64,
        comm.hook as u64,
        comm.dev_ctx as u64,
        w,
        4096,
        0,
    );
    sync(s);
    let events = 2 * 64 * 4096 * N_WORKS as u64;
    finalize_and_read(&plugin, std::slice::from_ref(&comm), &mut reader);
    let tag = format!("overrun_{placement}");
    println!("{tag}_events_written: {events}");
    println!("{tag}_events_delivered: {}", reader.check.works * 2);
    println!("{tag}_lost: {}", reader.counter(Counter::DevLost));
    println!("{tag}_unpaired: {}", reader.counter(Counter::DevUnpaired));
    println!("{tag}_bad_content: {}", reader.check.bad_content);
    let ok = accounted(&reader) == events
        && reader.counter(Counter::DevLost) > 0
        && reader.check.bad_content == 0;
    println!(
        "{tag}: {}",
        if ok {
            "PASS (delivered + lost + unpaired == written)"
        } else {
            "FAIL"
        }
    );
}

fn bench(gpu: &Gpu) {
    let plugin = Plugin::load(&[
        ("NCCLSCOPE_RING_SLOTS", "4096"),
        ("NCCLSCOPE_SEGMENT_RECORDS", "4194304"),
    ]);
    // SAFETY: no other thread of ours reads the environment; the plugin reads it in getDeviceHook.
    unsafe { std::env::set_var("NCCLSCOPE_RING_MEMORY", "host") };
    let host = plugin.comm(0xb1, 0);
    // SAFETY: as above.
    unsafe { std::env::set_var("NCCLSCOPE_RING_MEMORY", "device") };
    let device = plugin.comm(0xb2, 0);
    assert!(!host.hook.is_null() && !device.hook.is_null());
    let mut reader = plugin.segment();
    let s = stream();
    let (wc_host, wc_dev, wc_other) = (dev_zeroed(512), dev_zeroed(512), dev_zeroed(512));
    let mut inline_host: *mut c_void = std::ptr::null_mut();
    let mut inline_dev = 0u64;
    // SAFETY: pinned mapped buffer for NCCL-style inline stores (64 channels x 64 entries x 2 x 16 bytes).
    unsafe {
        ck(
            cu::cuMemHostAlloc(
                &mut inline_host,
                64 * 64 * 2 * 16,
                cu::CU_MEMHOSTALLOC_DEVICEMAP,
            ),
            "alloc",
        );
        ck(
            cu::cuMemHostGetDevicePointer_v2(&mut inline_dev, inline_host, 0),
            "map",
        );
    }
    let refs = gpu.refs;
    let variants: Vec<(&str, cu::CUfunction, u64, u64, u64)> = vec![
        ("none", gpu.harness, 0, 0, wc_other),
        (
            "empty",
            gpu.harness,
            pointer(refs, c"ncclscope_ref_empty_ptr"),
            0,
            wc_other,
        ),
        (
            "loadonly",
            gpu.harness,
            pointer(refs, c"ncclscope_ref_loadonly_ptr"),
            0,
            wc_other,
        ),
        (
            "ours_host",
            gpu.harness,
            host.hook as u64,
            host.dev_ctx as u64,
            wc_host,
        ),
        (
            "ours_device",
            gpu.harness,
            device.hook as u64,
            device.dev_ctx as u64,
            wc_dev,
        ),
        (
            "byval_empty",
            gpu.byval,
            pointer(refs, c"ncclscope_ref_byval_empty_ptr"),
            0,
            wc_other,
        ),
        (
            "byval_host",
            gpu.byval,
            pointer(refs, c"ncclscope_hook_byval_ptr"),
            host.dev_ctx as u64,
            wc_host,
        ),
        (
            "byval_device",
            gpu.byval,
            pointer(refs, c"ncclscope_hook_byval_ptr"),
            device.dev_ctx as u64,
            wc_dev,
        ),
        ("nccl_inline", gpu.inline, 0, inline_dev, wc_other),
        // The RFC event grown to 32 bytes (docs/rfc-feedback.md), into 64-byte slots in device memory:
        // 64 rings of 2^12 slots, the low bits of the address holding the shift as in our devCtx.
        (
            "event32_device",
            gpu.event32,
            pointer(refs, c"ncclscope_ref_event32_ptr"),
            dev_zeroed(64 << 12 << 6) | 12,
            wc_other,
        ),
    ];
    const CHANNELS: u32 = 32;
    const BATCHES: u32 = 10_000; // 20,000 items per channel
    let items = (BATCHES * N_WORKS) as f64;
    let (mut e0, mut e1) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: out pointers.
    unsafe {
        ck(cu::cuEventCreate(&mut e0, 0), "event");
        ck(cu::cuEventCreate(&mut e1, 0), "event");
    }
    let mut per_item: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..6 {
        for (i, (_, f, hook, ctx, wcs)) in variants.iter().enumerate() {
            let mut ms = 0f32;
            // SAFETY: events and stream are live.
            unsafe {
                ck(cu::cuEventRecord(e0, s), "record");
                launch(*f, s, CHANNELS, *hook, *ctx, *wcs, BATCHES, 0);
                ck(cu::cuEventRecord(e1, s), "record");
                ck(cu::cuEventSynchronize(e1), "sync");
                ck(cu::cuEventElapsedTime_v2(&mut ms, e0, e1), "elapsed");
            }
            if round > 0 {
                per_item[i].push(ms as f64 * 1e6 / items);
            }
            reader.poll(&func_of);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&mut per_item[0].clone());
    println!(
        "bench_channels: {CHANNELS} threads: {THREADS} items_per_channel: {items} rounds: 5 (median)"
    );
    println!("bench_ns_per_work_item_none: {base:.1}");
    let mut cost = std::collections::HashMap::new();
    for (i, (name, ..)) in variants.iter().enumerate().skip(1) {
        let t = median(&mut per_item[i]);
        let ns_per_event = (t - base) / 2.0;
        cost.insert(*name, ns_per_event);
        println!("bench_ns_per_event_{name}: {ns_per_event:.1}   (work item {t:.1} ns)");
    }
    println!(
        "hook_cost_ratio: {:.3}",
        cost["ours_host"] / cost["loadonly"]
    );
    println!(
        "hook_cost_ratio_device: {:.3}",
        cost["ours_device"] / cost["loadonly"]
    );
    println!(
        "event32_cost_ratio_device: {:.3}",
        cost["event32_device"] / cost["ours_device"]
    );
    println!("bench_events_drained_meanwhile: {}", reader.check.works * 2);
    println!("bench_bad_content: {}", reader.check.bad_content);
    finalize_and_read(&plugin, &[host, device], &mut reader);
}

fn calibration(gpu: &Gpu, secs: u64) {
    let plugin = Plugin::load(&[("NCCLSCOPE_RING_MEMORY", "host")]);
    let comm = plugin.comm(0xca1, 0);
    assert!(!comm.hook.is_null());
    let mut reader = plugin.segment();
    let s = stream();
    let w = dev_zeroed(512);
    let t0 = Instant::now();
    // Light traffic meanwhile: a short harness launch every 100 ms.
    while t0.elapsed() < Duration::from_secs(secs) {
        launch(
            gpu.harness,
            s,
            8,
            comm.hook as u64,
            comm.dev_ctx as u64,
            w,
            100,
            1000,
        );
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(100) {
            if reader.poll(&func_of) == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    sync(s);
    finalize_and_read(&plugin, std::slice::from_ref(&comm), &mut reader);
    let cal = &reader.check.calibrations;
    let first = cal.first().map_or(0, |c| c.3);
    for (offset, error, drift, host) in cal {
        println!(
            "calibration t={:.1}s offset_ns={offset} error_ns={error} drift_ppb={drift}",
            (host - first) as f64 / 1e9
        );
    }
    let max_err = cal.iter().map(|c| c.1).max().unwrap_or(u32::MAX);
    let span = cal.last().map_or(0, |c| c.3) - first;
    let total_drift = cal.last().map_or(0, |c| c.0) - cal.first().map_or(0, |c| c.0);
    println!("calibration_count: {}", cal.len());
    println!("calibration_max_error_ns: {max_err}");
    println!(
        "calibration_offset_change_ns_over_run: {total_drift} over {:.1} s",
        span as f64 / 1e9
    );
    println!("calibration_dev_work_delivered: {}", reader.check.works);
    println!(
        "calibration: {}",
        if max_err <= 2000 && cal.len() >= 2 {
            "PASS (error bound <= 2 us)"
        } else {
            "FAIL"
        }
    );
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip_while(|a| !["verify", "overrun", "bench", "calibration"].contains(&a.as_str()))
        .collect();
    let Some(mode) = args.first() else {
        // `cargo bench` without a mode (or on a machine without a GPU) does nothing.
        println!(
            "usage: devhook_gpu [plugin.so] verify <host|device> <slots> <spin_ns> | overrun <host|device> | bench | calibration <secs>"
        );
        return;
    };
    let gpu = init_gpu();
    match mode.as_str() {
        "verify" => verify(&gpu, &args[1], &args[2], args[3].parse().expect("spin_ns")),
        "overrun" => overrun(&gpu, &args[1]),
        "bench" => bench(&gpu),
        "calibration" => calibration(&gpu, args[1].parse().expect("secs")),
        _ => unreachable!(),
    }
}
