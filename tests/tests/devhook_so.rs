//! The device hook through the real plugin .so, loaded and called as an RFC NCCL does, on a machine
//! without a GPU: the simulation placement is used only when asked for, and then the host-function hook
//! that `getDeviceHook` returns feeds the plugin's drain exactly: every event written is delivered in
//! order or counted lost, and the simulated GPU clock is calibrated to CLOCK_REALTIME.
//!
//! One test function: it sets process environment variables the plugin reads.

use std::ffi::{CString, c_void};
use std::time::{Duration, Instant};

use ncclscope_fakenccl::nccl::{DevEvent, HookFn, RfcVtable};
use ncclscope_fakenccl::process::Catcher;
use ncclscope_proto::Record;
use ncclscope_proto::segment::{Consumer, Counter};

fn set(k: &str, v: &str) {
    // SAFETY: this test is the only thread of its process touching the environment; the plugin reads it
    // in the calls below, on this thread.
    unsafe { std::env::set_var(k, v) };
}

fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

struct Comm {
    ctx: *mut c_void,
    hook: *mut c_void,
    dev_ctx: *mut c_void,
}

fn comm(v7: &RfcVtable, hash: u64) -> Comm {
    let (mut ctx, mut mask) = (std::ptr::null_mut(), 0);
    let name = CString::new("devhook-so").unwrap();
    let (mut hook, mut dev_ctx) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: as NCCL calls them: init, then getDeviceHook on the same thread.
    unsafe {
        assert_eq!(
            (v7.base.init)(&mut ctx, hash, &mut mask, name.as_ptr(), 1, 1, 0, None),
            0
        );
        assert_eq!((v7.get_device_hook)(0, &mut hook, &mut dev_ctx), 0);
    }
    assert!(!ctx.is_null(), "init returned no context");
    Comm { ctx, hook, dev_ctx }
}

#[test]
fn simulation_hook_is_explicit_and_its_events_are_accounted_exactly() {
    let catcher = Catcher::start();
    set("NCCLSCOPE_SOCKET", catcher.socket().to_str().unwrap());
    let path = ncclscope_fakenccl::plugin_path().unwrap();
    // SAFETY: loading the plugin runs nothing that needs us.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    // SAFETY: the plugin exports `ncclProfiler_v7` with the RFC's layout; `lib` outlives its use.
    let v7: &RfcVtable = unsafe { &**lib.get::<*const RfcVtable>(b"ncclProfiler_v7\0").unwrap() };

    // Without NCCLSCOPE_RING_MEMORY=cpu no host function is ever handed out: on a machine without a GPU
    // (or a build without nvcc) there is no hook at all, and an invalid value falls back to `host`.
    let gpu_present = std::path::Path::new("/dev/nvidia0").exists();
    if !gpu_present {
        assert!(
            comm(v7, 1).hook.is_null(),
            "default placement offered a hook without a GPU"
        );
        set("NCCLSCOPE_RING_MEMORY", "simulate");
        assert!(
            comm(v7, 2).hook.is_null(),
            "an invalid placement must not select the CPU hook"
        );
    }

    set("NCCLSCOPE_RING_MEMORY", "cpu");
    set("NCCLSCOPE_RING_SLOTS", "64");
    // A communicator that ends right away (before the forwarding loop's next pass): its device must
    // still be calibrated before its end, or the daemon could only report its work on the GPU clock.
    let short = comm(v7, 4);
    // SAFETY: the hook getDeviceHook returned, with its devCtx; then the context init returned.
    unsafe {
        let hook: HookFn = std::mem::transmute::<*mut c_void, HookFn>(short.hook);
        for phase in 0..2 {
            let ev = DevEvent {
                timestamp: monotonic_ns(),
                work_counter: 1,
                func_id: 7,
                channel_id: 0,
                phase,
                rsvd: 0,
            };
            hook(&ev, short.dev_ctx);
        }
        (v7.base.finalize)(short.ctx);
    }
    let c = comm(v7, 3);
    assert!(!c.hook.is_null(), "cpu placement offered no hook");
    // SAFETY: in cpu mode the hook is a host function with the RFC hook's signature.
    let hook: HookFn = unsafe { std::mem::transmute::<*mut c_void, HookFn>(c.hook) };

    // Four writers (one per channel, as one block per channel writes on the GPU), 64-slot rings lapped
    // many times while the plugin's forwarding thread drains them.
    const CHANNELS: u8 = 4;
    const ITEMS: u64 = 50_000;
    let dev_ctx = c.dev_ctx as usize;
    let written_at = ncclscope_proto::now_ns();
    std::thread::scope(|s| {
        for channel in 0..CHANNELS {
            s.spawn(move || {
                for wc in 1..=ITEMS {
                    for phase in 0..2 {
                        let ev = DevEvent {
                            timestamp: monotonic_ns(),
                            work_counter: wc,
                            func_id: 7,
                            channel_id: channel,
                            phase,
                            rsvd: 0,
                        };
                        // SAFETY: the hook and devCtx getDeviceHook returned; one writer per channel.
                        unsafe { hook(&ev, dev_ctx as *mut c_void) };
                    }
                }
            });
        }
    });
    // SAFETY: the context init returned; nothing calls the hook any more.
    unsafe { (v7.base.finalize)(c.ctx) };

    // Read the segment until the communicator's end record (finalize drains its rings first).
    let seg = catcher.wait(Duration::from_secs(10)).unwrap();
    let mut consumer = Consumer::new(seg);
    let (mut records, mut buf) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !records
        .iter()
        .any(|r| matches!(r, Record::CommEnd { comm, .. } if Some(*comm) == comm_of(&records, 3)))
    {
        assert!(
            Instant::now() < deadline,
            "no CommEnd for the simulated communicator"
        );
        buf.clear();
        consumer.read(1 << 16, &mut buf).unwrap();
        records.extend(buf.iter().map(|(_, r)| r.unwrap()));
        if let Some((pos, _)) = buf.last() {
            consumer.commit(pos + 1);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let short = comm_of(&records, 4).unwrap();
    let device = records.iter().find_map(|r| match *r {
        Record::Comm { comm, cuda_dev, .. } if comm == short => Some(cuda_dev),
        _ => None,
    });
    let calibrated = records.iter().position(
        |r| matches!(*r, Record::Calibration { cuda_dev, .. } if Some(cuda_dev) == device),
    );
    let ended = records
        .iter()
        .position(|r| matches!(*r, Record::CommEnd { comm, .. } if comm == short));
    assert!(
        calibrated.is_some() && calibrated < ended,
        "device {device:?} calibrated at {calibrated:?}, communicator ended at {ended:?}"
    );
    let me = comm_of(&records, 3).unwrap();
    let mut last = [0u64; CHANNELS as usize];
    let mut works = 0u64;
    for r in &records {
        if let Record::DevWork {
            comm,
            channel,
            func_id,
            work_counter,
            gpu_start,
            gpu_stop,
        } = *r
        {
            works += 1;
            if comm != me {
                continue;
            }
            assert!(
                work_counter > last[channel as usize],
                "order on channel {channel}"
            );
            last[channel as usize] = work_counter;
            assert!(func_id == 7 && gpu_start <= gpu_stop && gpu_start > 0);
        }
    }
    let seg = consumer.segment();
    let (lost, unpaired) = (
        seg.counter(Counter::DevLost),
        seg.counter(Counter::DevUnpaired),
    );
    assert!(
        lost > 0,
        "64-slot rings under four busy writers must have been lapped"
    );
    assert_eq!(
        2 * works + lost + unpaired,
        2 * ITEMS * CHANNELS as u64 + 2,
        "every event delivered or counted (the short communicator's two included)"
    );

    // The simulated GPU clock (CLOCK_MONOTONIC) of cudaDev 0 is mapped to CLOCK_REALTIME.
    let (offset, error) = records
        .iter()
        .find_map(|r| match *r {
            Record::Calibration {
                cuda_dev: 0,
                offset_ns,
                error_ns,
                ..
            } => Some((offset_ns, error_ns)),
            _ => None,
        })
        .expect("a calibration of the simulated device");
    assert!(error < 1_000_000, "error bound {error} ns");
    let first = records.iter().find_map(|r| match *r {
        Record::DevWork { gpu_start, .. } => Some(gpu_start),
        _ => None,
    });
    let mapped = first.unwrap() as i64 + offset;
    assert!(
        (mapped - written_at as i64).abs() < 5_000_000_000,
        "mapped {mapped} vs written at {written_at}"
    );
    drop(lib);
}

fn comm_of(records: &[Record], hash: u64) -> Option<u32> {
    records.iter().find_map(|r| match *r {
        Record::Comm {
            comm, comm_hash, ..
        } if comm_hash == hash => Some(comm),
        _ => None,
    })
}
