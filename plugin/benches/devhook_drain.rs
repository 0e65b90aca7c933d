//! Drain throughput and idle cost on the CPU: the real plugin .so in simulation mode
//! (`NCCLSCOPE_RING_MEMORY=cpu`), its `getDeviceHook` host-function hook called as the kernel would call
//! the device hook, its forwarding thread draining the rings into the segment, and this process reading
//! the segment as the daemon would, checking every work item.
//!
//! cargo build --release -p ncclscope-plugin && cargo bench -p ncclscope-plugin --bench devhook_drain
//! Prints `key: value` lines (docs/benchmarks.md, "Device hook").

mod devhook_support;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use devhook_support::{Plugin, cpu_time, forwarding_thread_cpu, forwarding_thread_switches};
use ncclscope_fakenccl::nccl::{DevEvent, HookFn as Hook};
use ncclscope_proto::Counter;

const CHANNELS: u8 = 16;

fn func_of(wc: u64) -> u32 {
    7 + (wc % 3) as u32
}

fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Writes work items on `channels` (each channel has one writer, as each ring has on the GPU), at `rate`
/// events/s (0: as fast as possible) for `duration`, continuing from work counter `wc`. Returns the
/// next work counter.
fn write(
    hook: Hook,
    ctx: *mut c_void,
    channels: std::ops::Range<u8>,
    rate: u64,
    duration: Duration,
    mut wc: u64,
    written: &AtomicU64,
) -> u64 {
    let t0 = Instant::now();
    let base = monotonic_ns();
    let mut n = 0u64;
    while t0.elapsed() < duration {
        for _ in 0..1024 {
            for channel in channels.clone() {
                for phase in 0..2 {
                    // A synthetic timestamp: the clock read is not what is measured here.
                    let timestamp = base + wc * 2 + phase as u64;
                    let ev = DevEvent {
                        timestamp,
                        work_counter: wc,
                        func_id: func_of(wc),
                        channel_id: channel,
                        phase,
                        rsvd: 0,
                    };
                    // SAFETY: the plugin's CPU hook with the devCtx it handed out for this communicator.
                    unsafe { hook(&ev, ctx) };
                }
            }
            wc += 1;
        }
        let batch = 1024 * 2 * channels.len() as u64;
        n += batch;
        written.fetch_add(batch, Relaxed);
        if rate > 0 {
            // Sleep (not spin) when ahead: on a small machine a spinning writer would starve the drain.
            let due = Duration::from_secs_f64(n as f64 / rate as f64);
            if let Some(ahead) = due.checked_sub(t0.elapsed()) {
                std::thread::sleep(ahead);
            }
        }
    }
    wc
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let plugin = Plugin::load(&[
        ("NCCLSCOPE_RING_MEMORY", "cpu"),
        ("NCCLSCOPE_RING_SLOTS", "131072"),
        ("NCCLSCOPE_SEGMENT_RECORDS", "4194304"),
    ]);
    let comm = plugin.comm(0xd1a1, 0);
    assert!(
        !comm.hook.is_null(),
        "the plugin offered no hook in cpu mode"
    );
    // SAFETY: in cpu mode getDeviceHook returns a host function with the hook's signature.
    let hook: Hook = unsafe { std::mem::transmute::<*mut c_void, Hook>(comm.hook) };
    let mut reader = plugin.segment();
    // Writer threads, each owning CHANNELS / writers channels (DEVHOOK_WRITERS, default 2).
    let writers: u8 = std::env::var("DEVHOOK_WRITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
        .clamp(1, CHANNELS);
    let per = CHANNELS / writers;
    let mut next_wc = vec![1u64; writers as usize];
    let mut total_written = 0u64;
    println!("writers: {writers}");

    for (label, rate, secs) in [("paced_20M", 20_000_000u64, 5u64), ("unpaced", 0, 3)] {
        let written = AtomicU64::new(0);
        let running = AtomicU64::new(writers as u64);
        let before = reader.check.works * 2
            + reader.counter(Counter::DevLost)
            + reader.counter(Counter::DevUnpaired);
        let lost_before = reader.counter(Counter::DevLost);
        let fwd_before = forwarding_thread_cpu().unwrap_or_default();
        let sw_before = forwarding_thread_switches().unwrap_or_default();
        let t0 = Instant::now();
        let ctx = comm.dev_ctx as usize;
        std::thread::scope(|s| {
            for (i, wc) in next_wc.iter_mut().enumerate() {
                let (written, running) = (&written, &running);
                let channels = i as u8 * per..(i as u8 + 1) * per;
                s.spawn(move || {
                    *wc = write(
                        hook,
                        ctx as *mut c_void,
                        channels,
                        rate / writers as u64,
                        Duration::from_secs(secs),
                        *wc,
                        written,
                    );
                    running.fetch_sub(1, Relaxed);
                });
            }
            // Read until the writers are done and every written event is accounted for (delivered or counted).
            let deadline = Instant::now() + Duration::from_secs(secs + 30);
            loop {
                // As the daemon does: read on a ticker, in batches.
                reader.poll(&func_of);
                std::thread::sleep(Duration::from_millis(1));
                let accounted = reader.check.works * 2
                    + reader.counter(Counter::DevLost)
                    + reader.counter(Counter::DevUnpaired)
                    - before;
                if running.load(Relaxed) == 0 && accounted >= written.load(Relaxed)
                    || Instant::now() > deadline
                {
                    break;
                }
            }
        });
        let elapsed = t0.elapsed().as_secs_f64();
        let w = written.load(Relaxed);
        total_written += w;
        let lost = reader.counter(Counter::DevLost) - lost_before;
        println!("{label}_events_written: {w}");
        println!("{label}_events_per_s: {:.2}M", w as f64 / elapsed / 1e6);
        println!("{label}_lost: {lost}");
        // What the drain costs, independent of how much CPU this shared machine gave it.
        let fwd = (forwarding_thread_cpu().unwrap_or_default() - fwd_before).as_secs_f64();
        println!("{label}_forwarding_thread_cpu_s: {fwd:.2}");
        let sw = forwarding_thread_switches().unwrap_or_default();
        println!(
            "{label}_forwarding_thread_parks_preemptions: {} {}",
            sw.0 - sw_before.0,
            sw.1 - sw_before.1
        );
        println!(
            "{label}_events_per_forwarding_cpu_s: {:.2}M",
            (w - lost) as f64 / fwd / 1e6
        );
    }
    // Pending START halves stay unpaired until finalize; a writer always finishes its pairs.
    println!("out_of_order: {}", reader.check.out_of_order);
    println!("bad_content: {}", reader.check.bad_content);
    println!("calibrations: {}", reader.check.calibrations.len());

    // Idle: rings exist, nothing is written; the forwarding thread keeps polling them.
    std::thread::sleep(Duration::from_secs(1));
    let (c0, t0) = (cpu_time(), Instant::now());
    std::thread::sleep(Duration::from_secs(10));
    let idle = (cpu_time() - c0).as_secs_f64() / t0.elapsed().as_secs_f64();
    println!("idle_cpu_percent_of_one_core: {:.3}", idle * 100.0);

    plugin.finalize(&comm);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) {
        if reader.poll(&func_of) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let accounted = reader.check.works * 2
        + reader.counter(Counter::DevLost)
        + reader.counter(Counter::DevUnpaired);
    println!("events_written_total: {total_written}");
    println!("events_accounted_total: {accounted}");
    // Records the segment had no room for (this benchmark's reader fell behind); each DevWork is 2 events.
    println!(
        "segment_ring_full_records: {}",
        reader.counter(Counter::RingFull)
    );
}
