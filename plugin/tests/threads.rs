//! The plugin's per-thread hot path through its real exported `ncclProfiler_v5` (the rlib linked in, its
//! forwarding thread writing the segment that a stand-in daemon catches): many threads at once, threads
//! that exit with events still queued, thousands of short-lived threads, and events stopped on another
//! thread than the one that started them. Every record must arrive exactly once, after the records it
//! depends on (a kernel record after its operation's start), or be counted as dropped.
//!
//! One test function: the plugin keeps one state per process.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_int, c_void};
use std::time::Duration;

use nccl_profiler_ncclscope::entry::ncclProfiler_v5 as VT;
use ncclscope_fakenccl::nccl::{event, off, state};
use ncclscope_fakenccl::process::Catcher;
use ncclscope_proto::{Counter, Record};

/// v5 descriptor bytes as u64 words.
const WORDS: usize = 14;

#[derive(Clone, Copy)]
struct Ptr(*mut c_void);
// SAFETY: plugin handles and contexts; the plugin is required to be thread-safe (NCCL moves handles
// between its threads).
unsafe impl Send for Ptr {}
// SAFETY: as above.
unsafe impl Sync for Ptr {}

fn descr(ty: u64, parent: Ptr) -> [u64; WORDS] {
    let mut d = [0u64; WORDS];
    d[off::TYPE / 8] = ty;
    d[off::PARENT / 8] = parent.0 as u64;
    d
}

fn start(ctx: Ptr, d: &mut [u64; WORDS]) -> Ptr {
    let mut h = std::ptr::null_mut();
    // SAFETY: the exported startEvent with a context from init, a 112-byte descriptor, an out pointer.
    unsafe { (VT.start_event)(ctx.0, &mut h, d.as_mut_ptr().cast()) };
    Ptr(h)
}

fn stop(h: Ptr) {
    // SAFETY: stopEvent on a handle startEvent returned (or NULL).
    unsafe { (VT.stop_event)(h.0) };
}

fn coll_start(ctx: Ptr, seq: u64, channels: u8) -> Ptr {
    let mut d = descr(event::COLL, Ptr(std::ptr::null_mut()));
    d[off::COLL_SEQ / 8] = seq;
    d[off::COLL_FUNC / 8] = c"AllReduce".as_ptr() as u64;
    d[off::COLL_COUNT / 8] = 1 << 20;
    d[off::COLL_DATATYPE / 8] = c"ncclFloat32".as_ptr() as u64;
    d[off::COLL_NCHANNELS / 8] = channels as u64;
    d[off::COLL_ALGO / 8] = c"RING".as_ptr() as u64;
    d[off::COLL_PROTO / 8] = c"LL".as_ptr() as u64;
    start(ctx, &mut d)
}

fn kernel_start(ctx: Ptr, parent: Ptr, channel: u8, p_timer: u64) -> Ptr {
    let mut d = descr(event::KERNEL_CH, parent);
    d[off::KCH_CHANNEL / 8] = channel as u64;
    d[off::KCH_PTIMER / 8] = p_timer;
    start(ctx, &mut d)
}

/// KernelChStop with the GPU stop time, then stopEvent.
fn kernel_stop(h: Ptr, p_timer: u64) {
    let mut t = p_timer;
    // SAFETY: recordEventState with NCCL's 8-byte state args (kernelCh.pTimer).
    unsafe { (VT.record_event_state)(h.0, state::KERNEL_CH_STOP as u32, (&raw mut t).cast()) };
    stop(h);
}

/// One collective with `channels` KernelCh children, all on this thread; `seq` also sets the GPU times.
/// False if the plugin declined it (its start dropped and counted: then it has no children).
fn collective(ctx: Ptr, seq: u64, channels: u8) -> bool {
    let coll = coll_start(ctx, seq, channels);
    if coll.0.is_null() {
        return false;
    }
    stop(coll);
    for ch in 0..channels {
        let k = kernel_start(ctx, coll, ch, seq * 100 + ch as u64);
        kernel_stop(k, seq * 100 + ch as u64 + 50);
    }
    true
}

fn init(hash: u64) -> Ptr {
    let mut mask: c_int = 0;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: init as NCCL calls it (no logger).
    unsafe {
        (VT.init)(
            &mut ctx,
            hash,
            &mut mask,
            c"threads".as_ptr(),
            1,
            1,
            0,
            None,
        )
    };
    assert!(!ctx.is_null(), "plugin init failed");
    Ptr(ctx)
}

fn finalize(ctx: Ptr) {
    // SAFETY: finalize of a context init returned.
    unsafe { (VT.finalize)(ctx.0) };
}

/// What one communicator's records say.
#[derive(Default)]
struct Seen {
    /// CollStart seq -> op id.
    starts: HashMap<u64, u64>,
    stops: HashSet<u64>,
    /// (op id, channel) of each KernelCh.
    kernels: HashSet<(u64, u8)>,
    duplicates: Vec<String>,
    out_of_order: Vec<String>,
}

fn by_comm(records: &[Record]) -> HashMap<u64, Seen> {
    let mut hash_of = HashMap::new();
    let mut seen: HashMap<u64, Seen> = HashMap::new();
    let mut started = HashSet::new();
    for r in records {
        match *r {
            Record::Comm {
                comm, comm_hash, ..
            } => {
                hash_of.insert(comm, comm_hash);
            }
            Record::CollStart { comm, id, seq, .. } => {
                let s = seen.entry(hash_of[&comm]).or_default();
                if s.starts.insert(seq, id).is_some() {
                    s.duplicates.push(format!("{r:?}"));
                }
                started.insert(id);
            }
            Record::OpStop { comm, id, .. } => {
                let s = seen.entry(hash_of[&comm]).or_default();
                if !started.contains(&id) {
                    s.out_of_order.push(format!("{r:?}"));
                }
                if !s.stops.insert(id) {
                    s.duplicates.push(format!("{r:?}"));
                }
            }
            Record::KernelCh {
                comm,
                parent,
                channel,
                ..
            } => {
                let s = seen.entry(hash_of[&comm]).or_default();
                if !started.contains(&parent) {
                    s.out_of_order.push(format!("{r:?}"));
                }
                if !s.kernels.insert((parent, channel)) {
                    s.duplicates.push(format!("{r:?}"));
                }
            }
            _ => {}
        }
    }
    seen
}

/// Every collective `0..colls` of the communicator with its stop and `channels` kernels, exactly once.
fn assert_complete(seen: &Seen, what: &str, colls: u64, channels: u8) {
    assert!(seen.duplicates.is_empty(), "{what}: {:?}", seen.duplicates);
    assert!(
        seen.out_of_order.is_empty(),
        "{what}: {:?}",
        seen.out_of_order
    );
    assert_eq!(seen.starts.len() as u64, colls, "{what}: starts");
    for (seq, id) in &seen.starts {
        assert!(seen.stops.contains(id), "{what}: op {seq} has no stop");
        for ch in 0..channels {
            assert!(
                seen.kernels.contains(&(*id, ch)),
                "{what}: op {seq} has no KernelCh {ch}"
            );
        }
    }
}

#[test]
fn threads_deliver_every_record_once_after_its_parent_or_count_it() {
    let catcher = Catcher::start();
    // SAFETY: set before the plugin reads it (at its first init); no other thread reads the environment.
    unsafe {
        std::env::set_var("NCCLSCOPE_SOCKET", catcher.socket());
        std::env::set_var("NCCLSCOPE_EVENT_MASK", "0x46"); // Coll | P2p | KernelCh
        // Room for every record: the stand-in daemon does not drain the segment.
        std::env::set_var("NCCLSCOPE_SEGMENT_RECORDS", "1048576");
    }

    // 1. A thread that queues its events and exits at once (the forwarding thread may be asleep for
    //    20 ms): its lane keeps them. 1000 x 6 events fit in one lane, so nothing may be dropped.
    let exiting = init(0x1);
    std::thread::scope(|s| {
        s.spawn(|| {
            for seq in 0..1000 {
                assert!(collective(exiting, seq, 4));
            }
        });
    });

    // 2. Thousands of short-lived threads, one collective each (as a fake NCCL's kernel thread per
    //    launch): lanes and cached pool slots come back when each exits (the pool holds 65,536 slots; a
    //    thread takes 32 at a time), so nothing is exhausted.
    let short = init(0x2);
    for seq in 0..3000 {
        std::thread::scope(|s| {
            s.spawn(|| assert!(collective(short, seq, 4)));
        });
    }

    // 3. Started on one thread, stopped on others: the Coll on A, its KernelCh started on B and stopped
    //    on C (with the state recorded on B), the Coll stopped on D after its kernels started.
    let cross = init(0x3);
    for seq in 0..200u64 {
        let coll = std::thread::scope(|s| s.spawn(|| coll_start(cross, seq, 2)).join().unwrap());
        let kernels: Vec<Ptr> = std::thread::scope(|s| {
            s.spawn(|| {
                (0..2)
                    .map(|ch| {
                        let k = kernel_start(cross, coll, ch, 10);
                        let mut t = 20u64;
                        // SAFETY: as in `kernel_stop`.
                        unsafe {
                            (VT.record_event_state)(
                                k.0,
                                state::KERNEL_CH_STOP as u32,
                                (&raw mut t).cast(),
                            )
                        };
                        k
                    })
                    .collect()
            })
            .join()
            .unwrap()
        });
        std::thread::scope(|s| {
            s.spawn(|| kernels.iter().for_each(|k| stop(*k)));
        });
        std::thread::scope(|s| {
            s.spawn(|| stop(coll));
        });
    }

    // 4. 16 threads at once, each with its own communicator, back to back (the forwarding thread
    //    competes for this machine's cores: a full lane drops and counts).
    let stress: Vec<Ptr> = (0..16).map(|i| init(0x100 + i)).collect();
    let per_thread = 3000u64;
    let accepted: u64 = std::thread::scope(|s| {
        let threads: Vec<_> = stress
            .iter()
            .map(|ctx| {
                s.spawn(move || {
                    (0..per_thread)
                        .filter(|seq| collective(*ctx, *seq, 4))
                        .count() as u64
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    });

    for ctx in [exiting, short, cross].into_iter().chain(stress) {
        finalize(ctx);
    }
    catcher.wait(Duration::from_secs(10)).expect("segment");
    let seg = catcher.only_segment().expect("segment contents");
    assert!(seg.closed, "the last finalize closes the segment");
    let seen = by_comm(&seg.records);
    assert_complete(
        &seen[&0x1],
        "thread that exited with its events queued",
        1000,
        4,
    );
    assert_complete(&seen[&0x2], "3000 short-lived threads", 3000, 4);
    assert_complete(&seen[&0x3], "stops on other threads", 200, 2);
    assert_eq!(seg.counter(Counter::PoolExhausted), 0);
    assert_eq!(seg.counter(Counter::Unfinished), 0);

    // The stress communicators: what is missing is what was counted, and nothing came twice or early.
    let mut delivered = 0u64;
    for i in 0..16 {
        // A thread that had every event dropped (its lane full the whole time) has no entry.
        let Some(s) = seen.get(&(0x100 + i)) else {
            continue;
        };
        assert!(s.duplicates.is_empty(), "{:?}", s.duplicates);
        assert!(s.out_of_order.is_empty(), "{:?}", s.out_of_order);
        delivered += (s.starts.len() + s.stops.len() + s.kernels.len()) as u64;
    }
    // Every drop in this process is in the stress phase (the others are complete). A dropped Coll
    // start is declined: its stop and kernels are never made. Of the accepted collectives' 6 records
    // each, every one is delivered or counted.
    let declined = 16 * per_thread - accepted;
    let dropped = seg.counter(Counter::QueueFull) + seg.counter(Counter::RingFull) - declined;
    assert_eq!(
        delivered + dropped,
        6 * accepted,
        "{declined} collectives declined, {dropped} of the accepted ones' records dropped"
    );
    eprintln!(
        "stress: {accepted} of {} collectives accepted, {delivered} records delivered, {dropped} dropped",
        16 * per_thread
    );
}
