//! Host cost of one Coll `startEvent` + `stopEvent` pair through the real exported `ncclProfiler_v5`
//! (linked as the rlib; the forwarding thread runs and writes the segment), on 1 and 4 threads, next to
//! the same number of calls to an empty C-ABI function through a function pointer, measured in the same
//! run. Prints `key: value` lines (docs/benchmarks.md, "Plugin").
//!
//! cargo bench -p ncclscope-plugin --bench host_events

use std::ffi::{c_int, c_void};
use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use nccl_profiler_ncclscope::entry::ncclProfiler_v5 as VT;

/// Pairs per timed run and thread.
const PAIRS: u64 = 1_000_000;
/// Pairs per burst in the unsaturated case: 4 threads x 2 events x 2048 stay well below the queue's
/// 32 Ki events, and the pause between bursts lets the forwarding thread drain it.
const BURST: u64 = 2048;
const RUNS: usize = 7;
/// Descriptor bytes of v5 (112) as u64 words.
const DESCR_WORDS: usize = 14;

#[inline(never)]
extern "C" fn empty(_ctx: *mut c_void, handle: *mut *mut c_void, _descr: *mut c_void) -> c_int {
    // SAFETY: the caller passes a valid out pointer (as NCCL does).
    unsafe { *handle = std::ptr::null_mut() };
    0
}

#[inline(never)]
extern "C" fn empty_stop(_handle: *mut c_void) -> c_int {
    0
}

/// A Coll descriptor (type 0x2, seq, func, count, datatype, nChannels 4, algo, proto).
fn coll_descr() -> [u64; DESCR_WORDS] {
    let mut d = [0u64; DESCR_WORDS];
    d[0] = 0x2;
    d[3] = 1; // seqNumber (offset 24)
    d[4] = c"AllReduce".as_ptr() as u64; // func (32)
    d[7] = 1 << 20; // count (56)
    d[9] = c"ncclFloat32".as_ptr() as u64; // datatype (72)
    d[10] = 4; // nChannels (80)
    d[11] = c"RING".as_ptr() as u64; // algo (88)
    d[12] = c"LL".as_ptr() as u64; // proto (96)
    d
}

struct Ctx(*mut c_void);
// SAFETY: the plugin context is thread-safe by contract (NCCL calls it from several threads).
unsafe impl Sync for Ctx {}

fn plugin_pairs(ctx: &Ctx, n: u64) {
    let mut d = coll_descr();
    for _ in 0..n {
        let mut h = std::ptr::null_mut();
        // SAFETY: the exported vtable called as NCCL calls it: context from init, valid descriptor.
        unsafe {
            (VT.start_event)(ctx.0, &mut h, d.as_mut_ptr().cast());
            (VT.stop_event)(black_box(h));
        }
    }
}

fn empty_pairs(n: u64) {
    let start: extern "C" fn(*mut c_void, *mut *mut c_void, *mut c_void) -> c_int =
        black_box(empty);
    let stop: extern "C" fn(*mut c_void) -> c_int = black_box(empty_stop);
    let mut d = coll_descr();
    for _ in 0..n {
        let mut h = std::ptr::null_mut();
        start(std::ptr::null_mut(), &mut h, d.as_mut_ptr().cast());
        stop(black_box(h));
    }
}

/// Median ns per pair over `RUNS` runs of `threads` threads doing `PAIRS` pairs each concurrently.
/// `bursty`: only the time inside bursts of `BURST` pairs counts; between bursts the threads sleep 2 ms.
fn measure(threads: usize, bursty: bool, f: &(dyn Fn(u64) + Sync)) -> f64 {
    let mut per_pair: Vec<f64> = (0..RUNS)
        .map(|_| {
            let barrier = Barrier::new(threads);
            let elapsed: Vec<Duration> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..threads)
                    .map(|_| {
                        let barrier = &barrier;
                        s.spawn(move || {
                            barrier.wait();
                            if !bursty {
                                let t = Instant::now();
                                f(PAIRS);
                                return t.elapsed();
                            }
                            let mut busy = Duration::ZERO;
                            for _ in 0..PAIRS / BURST / 8 {
                                let t = Instant::now();
                                f(BURST);
                                busy += t.elapsed();
                                std::thread::sleep(Duration::from_millis(2));
                            }
                            busy * 8
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            elapsed.iter().max().unwrap().as_nanos() as f64 / PAIRS as f64
        })
        .collect();
    per_pair.sort_by(f64::total_cmp);
    per_pair[RUNS / 2]
}

fn main() {
    // Takes the plugin's segment in the daemon's place, to read its loss counters at the end.
    let catcher = ncclscope_fakenccl::process::Catcher::start();
    // SAFETY: set before the plugin reads it (once, at its first init); the catcher's thread does not
    // read the environment.
    unsafe {
        std::env::set_var("NCCLSCOPE_SOCKET", catcher.socket());
        // Coll | P2p: no KernelCh children, so each Coll's handle is freed at its stop.
        std::env::set_var("NCCLSCOPE_EVENT_MASK", "6");
    }
    let mut mask: c_int = 0;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: init as NCCL calls it (no logger: the plugin then runs without NCCL detection).
    unsafe {
        (VT.init)(
            &mut ctx,
            0xbe4c,
            &mut mask,
            c"bench".as_ptr(),
            1,
            1,
            0,
            None,
        )
    };
    assert!(!ctx.is_null(), "plugin init failed");
    let ctx = Ctx(ctx);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("cores: {cores}");
    for (case, bursty) in [("burst", true), ("saturated", false)] {
        for threads in [1, 2, 4] {
            let empty = measure(threads, bursty, &empty_pairs);
            let plugin = measure(threads, bursty, &|n| plugin_pairs(&ctx, n));
            println!("{case}_threads_{threads}_empty_call_pair_ns: {empty:.1}");
            println!("{case}_threads_{threads}_coll_start_stop_pair_ns: {plugin:.1}");
            println!(
                "{case}_threads_{threads}_ratio_to_empty: {:.1}",
                plugin / empty
            );
        }
    }
    // SAFETY: finalize of the context init returned.
    unsafe { (VT.finalize)(ctx.0) };
    let seg = catcher
        .wait(std::time::Duration::from_secs(10))
        .expect("bench segment");
    for c in ncclscope_proto::Counter::ALL {
        if seg.counter(c) > 0 {
            println!("segment_counter_{}: {}", c.name(), seg.counter(c));
        }
    }
}
