//! Protocol tests with the CPU writer: the exact store sequence of the device hook, into plain memory,
//! read back through both placements' decode paths (in place, and staged copies as for device memory).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use ncclscope_proto::{Counter, Record, StrId};

use super::drain::{CommRings, CopyOut, Emitter, FUNC_BITMAP_WORDS, Memory};
use super::layout::{MAX_CHANNELS, SLOT_WORDS};
use super::ring::{self, DevEvent, HeapBlock, RingCursor, SlotState, classify, cpu_hook};
use super::{Placement, RingConfig};
use crate::sink::Sink;

#[derive(Default)]
struct TestSink {
    records: Vec<Record>,
    counters: [u64; Counter::ALL.len()],
    strings: Vec<Vec<u8>>,
}

impl Sink for TestSink {
    fn push(&mut self, record: &Record) {
        self.records.push(*record);
    }
    fn intern(&mut self, text: &[u8]) -> StrId {
        self.strings.push(text.to_vec());
        StrId(self.strings.len() as u16)
    }
    fn count(&mut self, counter: Counter, n: u64) {
        self.counters[counter as usize] += n;
    }
}

impl TestSink {
    fn counter(&self, c: Counter) -> u64 {
        self.counters[c as usize]
    }
    fn works(&self) -> impl Iterator<Item = (u32, u8, u32, u64, u64, u64)> + '_ {
        self.records.iter().filter_map(|r| match *r {
            Record::DevWork {
                comm,
                channel,
                func_id,
                work_counter,
                gpu_start,
                gpu_stop,
            } => Some((comm, channel, func_id, work_counter, gpu_start, gpu_stop)),
            _ => None,
        })
    }
    /// Events accounted for: delivered (two per work item, one per unpaired) plus counted lost.
    fn accounted(&self) -> u64 {
        2 * self.works().count() as u64
            + self.counter(Counter::DevUnpaired)
            + self.counter(Counter::DevLost)
    }
}

fn event(channel: u8, wc: u64, phase: u8) -> DevEvent {
    DevEvent {
        timestamp: stamp(wc, phase),
        work_counter: wc,
        func_id: 7 + (wc % 3) as u32,
        channel,
        phase,
        rsvd: 0,
    }
}

/// The timestamp the test writer gives an event, so content can be verified.
fn stamp(wc: u64, phase: u8) -> u64 {
    1_000_000_000_000 + wc * 1000 + phase as u64
}

fn write(ctx: *mut std::ffi::c_void, ev: &DevEvent) {
    // SAFETY: `ctx` comes from a live HeapBlock of the test.
    unsafe { cpu_hook(ev, ctx) };
}

/// Device placement's decode path on the CPU: copies words out of a heap block into a staging area, one
/// 8-byte load per word, as the copy engine moves them.
struct CpuCopy {
    block: Arc<HeapBlock>,
    staging: Vec<u64>,
    queued: Vec<(usize, usize, usize)>,
    fail_next: bool,
}

impl CopyOut for CpuCopy {
    fn queue(&mut self, src: usize, dst: usize, words: usize) {
        self.queued.push((src, dst, words));
    }
    fn complete(&mut self) -> Option<&[u64]> {
        let words = self.block.words();
        for (src, dst, n) in std::mem::take(&mut self.queued) {
            for i in 0..n {
                self.staging[dst + i] = words[src + i].load(Relaxed);
            }
        }
        if std::mem::take(&mut self.fail_next) {
            return None;
        }
        Some(&self.staging)
    }
}

/// A block plus the comm's rings reading it through `placement`'s decode path.
fn rings(comm: u32, shift: u32, staged: bool) -> (Arc<HeapBlock>, CommRings) {
    let block = Arc::new(HeapBlock::new(shift));
    let mem = if staged {
        let max_window = 64.min(1 << shift);
        let copy = CpuCopy {
            block: block.clone(),
            staging: vec![0; MAX_CHANNELS * max_window * SLOT_WORDS],
            queued: Vec::new(),
            fail_next: false,
        };
        Memory::Staged {
            copy: Box::new(copy),
            max_window,
        }
    } else {
        Memory::InPlace {
            words: block.words().as_ptr(),
            _owner: Box::new(block.clone()),
        }
    };
    (block, CommRings::new(comm, 0, shift, mem))
}

fn pass(r: &mut CommRings, sink: &mut TestSink) -> usize {
    let mut seen = vec![0u64; FUNC_BITMAP_WORDS];
    let mut out = Emitter::new(sink, &mut seen);
    let n = r.drain(&mut out);
    out.flush_counts();
    n
}

fn close(r: &mut CommRings, sink: &mut TestSink) {
    let mut seen = vec![0u64; FUNC_BITMAP_WORDS];
    let mut out = Emitter::new(sink, &mut seen);
    r.drain_all(&mut out);
    r.close(&mut out);
    out.flush_counts();
}

/// Checks every delivered work item's content and per-channel order.
fn verify(sink: &TestSink) {
    let mut last: HashMap<(u32, u8), u64> = HashMap::new();
    for (comm, ch, func, wc, start, stop) in sink.works() {
        assert_eq!(
            (func, start, stop),
            (7 + (wc % 3) as u32, stamp(wc, 0), stamp(wc, 1)),
            "content of wc {wc}"
        );
        if let Some(prev) = last.insert((comm, ch), wc) {
            assert!(
                wc > prev,
                "order on comm {comm} channel {ch}: {wc} after {prev}"
            );
        }
    }
}

#[test]
fn a_slot_is_accepted_only_when_every_word_carries_its_flag() {
    let ev = event(5, 41, 1);
    let words = ev.slot();
    assert_eq!(classify(&words, ev.seq()), SlotState::Ready(ev));
    // Any strict subset of new words over zeroed or older content is not ready.
    let old = event(5, 41 - 32, 1).slot();
    for mask in 0..(1u32 << SLOT_WORDS) - 1 {
        for base in [[0u64; SLOT_WORDS], old] {
            let mixed: [u64; SLOT_WORDS] = std::array::from_fn(|i| {
                if mask >> i & 1 == 1 {
                    words[i]
                } else {
                    base[i]
                }
            });
            assert_eq!(
                classify(&mixed, ev.seq()),
                SlotState::NotReady,
                "mask {mask:06b}"
            );
        }
    }
    // Older complete content is not ready; later complete content reports a lap.
    assert_eq!(classify(&old, ev.seq()), SlotState::NotReady);
    let later = event(5, 41 + 32, 1);
    assert_eq!(classify(&later.slot(), ev.seq()), SlotState::Later(later));
    // A payload that disagrees with its flags (corruption) is never accepted.
    let mut bad = words;
    bad[2] ^= 1;
    assert_eq!(classify(&bad, ev.seq()), SlotState::NotReady);
}

#[test]
fn the_cpu_writer_stores_where_the_reader_looks() {
    let block = HeapBlock::new(6);
    let ev = event(63, 1000, 0);
    write(block.ctx(), &ev);
    assert_eq!(
        ring::load_in_place(block.words(), 63, ev.seq(), 6),
        ev.slot()
    );
    let touched = block
        .words()
        .iter()
        .filter(|w| w.load(Relaxed) != 0)
        .count();
    assert_eq!(touched, SLOT_WORDS);
}

fn partial_slots_wait(staged: bool) {
    let (block, mut r) = rings(1, 6, staged);
    let mut sink = TestSink::default();
    let (start, stop) = (event(3, 1, 0), event(3, 1, 1));
    write(block.ctx(), &start);
    // STOP's slot written halfway, as a reader racing the GPU's stores can see it.
    let at = ring::slot_word_index(3, stop.seq(), 6);
    for (i, w) in stop.slot().into_iter().enumerate().take(4) {
        block.words()[at + i].store(w, Relaxed);
    }
    assert_eq!(
        pass(&mut r, &mut sink),
        1,
        "START delivered, partial STOP not"
    );
    assert_eq!(sink.works().count(), 0);
    write(block.ctx(), &stop);
    assert_eq!(pass(&mut r, &mut sink), 1);
    assert_eq!(
        sink.works().collect::<Vec<_>>(),
        vec![(1, 3, 8, 1, stamp(1, 0), stamp(1, 1))]
    );
    close(&mut r, &mut sink);
    assert_eq!(
        (
            sink.counter(Counter::DevLost),
            sink.counter(Counter::DevUnpaired)
        ),
        (0, 0)
    );
}

#[test]
fn partial_slots_wait_in_place() {
    partial_slots_wait(false);
}

#[test]
fn partial_slots_wait_staged() {
    partial_slots_wait(true);
}

/// Writes `items` work items on `channels` channels, draining every `every` items; returns events written.
fn run_sequential(
    r: &mut CommRings,
    block: &HeapBlock,
    sink: &mut TestSink,
    channels: u8,
    items: u64,
    every: u64,
) -> u64 {
    let mut written = 0;
    for wc in 1..=items {
        for ch in 0..channels {
            write(block.ctx(), &event(ch, wc, 0));
            write(block.ctx(), &event(ch, wc, 1));
            written += 2;
        }
        if wc % every == 0 {
            pass(r, sink);
        }
    }
    close(r, sink);
    written
}

fn wraparound_without_loss(staged: bool) {
    // 64-slot rings lapped 50 times; the reader keeps up, so nothing is lost.
    let (block, mut r) = rings(2, 6, staged);
    let mut sink = TestSink::default();
    let written = run_sequential(&mut r, &block, &mut sink, 8, 1600, 16);
    verify(&sink);
    assert_eq!(sink.works().count() as u64 * 2, written);
    assert_eq!(sink.accounted(), written);
    assert_eq!(sink.counter(Counter::DevLost), 0);
}

#[test]
fn wraparound_without_loss_in_place() {
    wraparound_without_loss(false);
}

#[test]
fn wraparound_without_loss_staged() {
    wraparound_without_loss(true);
}

fn overwrite_is_counted_exactly(staged: bool) {
    // The drain stalls: each 64-slot ring keeps only its last 64 events (32 work items) of 1000 items.
    let (block, mut r) = rings(3, 6, staged);
    let mut sink = TestSink::default();
    let written = run_sequential(&mut r, &block, &mut sink, 4, 1000, u64::MAX);
    verify(&sink);
    assert_eq!(
        sink.works().count(),
        4 * 32,
        "the last 32 items of each ring"
    );
    assert_eq!(sink.counter(Counter::DevLost), 4 * (2000 - 64));
    assert_eq!(sink.counter(Counter::DevUnpaired), 0);
    assert_eq!(sink.accounted(), written);
    assert!(sink.works().all(|w| w.3 > 1000 - 32));
}

#[test]
fn overwrite_is_counted_exactly_in_place() {
    overwrite_is_counted_exactly(false);
}

#[test]
fn overwrite_is_counted_exactly_staged() {
    overwrite_is_counted_exactly(true);
}

fn lap_between_passes_with_odd_offsets(staged: bool) {
    // Drains at irregular points (every 37 items = 74 slots > 64): each pass finds lapped slots, part of a
    // pair lost; the unpaired halves are counted, and the total is exact.
    let (block, mut r) = rings(4, 6, staged);
    let mut sink = TestSink::default();
    let written = run_sequential(&mut r, &block, &mut sink, 2, 999, 37);
    verify(&sink);
    assert!(sink.counter(Counter::DevLost) > 0);
    assert_eq!(sink.accounted(), written);
}

#[test]
fn lap_between_passes_is_counted_exactly_in_place() {
    lap_between_passes_with_odd_offsets(false);
}

#[test]
fn lap_between_passes_is_counted_exactly_staged() {
    lap_between_passes_with_odd_offsets(true);
}

#[test]
fn a_failed_copy_consumes_nothing() {
    let block = Arc::new(HeapBlock::new(6));
    let copy = CpuCopy {
        block: block.clone(),
        staging: vec![0; MAX_CHANNELS * 64 * SLOT_WORDS],
        queued: Vec::new(),
        fail_next: true,
    };
    let mut r = CommRings::new(
        0,
        0,
        6,
        Memory::Staged {
            copy: Box::new(copy),
            max_window: 64,
        },
    );
    let mut sink = TestSink::default();
    write(block.ctx(), &event(0, 1, 0));
    write(block.ctx(), &event(0, 1, 1));
    assert_eq!(pass(&mut r, &mut sink), 0);
    assert_eq!(pass(&mut r, &mut sink), 2);
    assert_eq!(sink.works().count(), 1);
}

#[test]
fn unpaired_halves_are_counted() {
    let (block, mut r) = rings(5, 6, false);
    let mut sink = TestSink::default();
    write(block.ctx(), &event(0, 1, 0));
    close(&mut r, &mut sink);
    assert_eq!(
        sink.counter(Counter::DevUnpaired),
        1,
        "a START whose STOP never came"
    );
    assert_eq!(sink.accounted(), 1);
}

fn concurrent(staged: bool, shift: u32, writers: u8, items: u64) {
    // Writer threads (one per channel: one writer per ring, as on the GPU) race a reader draining
    // continuously: partial slots are seen and must be waited for; everything is accounted for exactly.
    let (block, mut r) = rings(6, shift, staged);
    let done = AtomicBool::new(false);
    let written = AtomicU64::new(0);
    let mut sink = TestSink::default();
    std::thread::scope(|s| {
        for ch in 0..writers {
            let (block, written) = (&block, &written);
            s.spawn(move || {
                for wc in 1..=items {
                    write(block.ctx(), &event(ch, wc, 0));
                    write(block.ctx(), &event(ch, wc, 1));
                }
                written.fetch_add(2 * items, Relaxed);
            });
        }
        s.spawn(|| {
            while written.load(Relaxed) < 2 * items * writers as u64 {
                std::thread::yield_now();
            }
            done.store(true, Relaxed);
        });
        while !done.load(Relaxed) {
            pass(&mut r, &mut sink);
        }
    });
    close(&mut r, &mut sink);
    verify(&sink);
    assert_eq!(sink.accounted(), written.load(Relaxed));
}

#[test]
fn concurrent_writers_are_accounted_exactly_in_place() {
    concurrent(false, 8, 4, 200_000);
}

#[test]
fn concurrent_writers_are_accounted_exactly_staged() {
    concurrent(true, 8, 4, 200_000);
}

#[test]
fn deep_rings_deliver_everything_in_place() {
    // A ring deep enough for the whole run: concurrent reading loses nothing.
    let (block, mut r) = rings(7, 17, false);
    let mut sink = TestSink::default();
    std::thread::scope(|s| {
        let block = &block;
        let writer = s.spawn(move || {
            for wc in 1..=60_000 {
                write(block.ctx(), &event(9, wc, 0));
                write(block.ctx(), &event(9, wc, 1));
            }
        });
        while !writer.is_finished() {
            pass(&mut r, &mut sink);
        }
    });
    close(&mut r, &mut sink);
    verify(&sink);
    assert_eq!(sink.works().count(), 60_000);
    assert_eq!(
        sink.counter(Counter::DevLost) + sink.counter(Counter::DevUnpaired),
        0
    );
}

#[test]
fn a_cursor_starts_at_the_first_work_item() {
    assert_eq!(
        RingCursor::default().next,
        DevEvent {
            work_counter: 1,
            ..Default::default()
        }
        .seq()
    );
}

#[test]
fn ring_config_from_env() {
    let cfg = |vars: &[(&str, &str)]| {
        RingConfig::from_lookup(|n| {
            vars.iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        })
    };
    let d = cfg(&[]);
    assert_eq!(
        (d.placement, d.shift, d.warnings.len()),
        (Placement::Device, 12, 0)
    );
    let c = cfg(&[
        ("NCCLSCOPE_RING_MEMORY", "host"),
        ("NCCLSCOPE_RING_SLOTS", "1024"),
    ]);
    assert_eq!((c.placement, c.shift), (Placement::Host, 10));
    assert_eq!(
        cfg(&[("NCCLSCOPE_RING_MEMORY", "cpu")]).placement,
        Placement::Cpu
    );
    let bad = cfg(&[
        ("NCCLSCOPE_RING_MEMORY", "gpu"),
        ("NCCLSCOPE_RING_SLOTS", "1000"),
    ]);
    assert_eq!(
        (bad.placement, bad.shift, bad.warnings.len()),
        (Placement::Device, 12, 2)
    );
    assert_eq!(cfg(&[("NCCLSCOPE_RING_SLOTS", "32")]).warnings.len(), 1);
}

/// The build's register check, on the cubins this build produced (skipped when built without nvcc).
#[allow(dead_code)]
#[path = "../../build/registers.rs"]
mod registers;

#[test]
fn the_register_check_passes_the_built_hook_and_catches_a_lower_cap() {
    use super::layout::HOOK_MAX_REGS;
    let out = std::path::Path::new(env!("OUT_DIR"));
    for arch in [80, 90, 100, 120] {
        let Ok(hook) = std::fs::read(out.join(format!("hook_sm{arch}.rel.cubin"))) else {
            eprintln!("built without nvcc: no cubins to check");
            return;
        };
        let harness = std::fs::read(out.join(format!("harness_sm{arch}.rel.cubin"))).unwrap();
        let (hook, harness) = (
            registers::register_counts(&hook).unwrap(),
            registers::register_counts(&harness).unwrap(),
        );
        let used = hook
            .iter()
            .find(|(f, _)| f == "ncclscope_hook")
            .map(|(_, r)| *r as usize)
            .unwrap();
        assert!(
            used > 0 && used <= HOOK_MAX_REGS,
            "sm_{arch}: hook uses {used}"
        );
        assert_eq!(
            registers::check(&hook, Some(HOOK_MAX_REGS), HOOK_MAX_REGS),
            Ok(())
        );
        assert_eq!(registers::check(&harness, None, HOOK_MAX_REGS), Ok(()));
        // The same counts against a cap below what the hook uses, or a hook bigger than the harness: caught.
        assert!(
            registers::check(&hook, Some(used - 1), HOOK_MAX_REGS).is_err(),
            "sm_{arch}"
        );
        let harness_regs = harness
            .iter()
            .filter(|(f, _)| f.starts_with("ncclscope_harness"))
            .map(|(_, r)| *r as usize);
        assert!(
            registers::check(&harness, None, harness_regs.min().unwrap() + 1).is_err(),
            "sm_{arch}"
        );
    }
}

unsafe extern "C" fn test_func_name(func_id: std::ffi::c_int) -> *const std::ffi::c_char {
    match func_id {
        7 => c"ncclDevFunc_AllReduce_Sum_f32_RING_LL".as_ptr(),
        8 => c"ncclDevFunc_AllGather_RING_SIMPLE".as_ptr(),
        _ => std::ptr::null(),
    }
}

#[test]
fn each_new_func_id_is_named_once_when_the_host_can_name_it() {
    // The only test that sets the process-wide name function; it restores it afterwards.
    super::set_func_name_fn(Some(test_func_name));
    let (block, r) = rings(9, 6, false);
    let mut state = super::DrainState::new();
    state.comms.push(r);
    let mut sink = TestSink::default();
    for wc in 1..=6 {
        // funcIds 8, 9, 7, 8, 9, 7: 9 has no name (the daemon shows func#9).
        write(block.ctx(), &event(0, wc, 0));
        write(block.ctx(), &event(0, wc, 1));
    }
    state.drain(&mut sink);
    for wc in 7..=9 {
        write(block.ctx(), &event(0, wc, 0));
        write(block.ctx(), &event(0, wc, 1));
    }
    state.drain(&mut sink);
    super::set_func_name_fn(None);
    let named: Vec<(u32, Vec<u8>)> = sink
        .records
        .iter()
        .filter_map(|r| match *r {
            Record::FuncName { func_id, name } => {
                Some((func_id, sink.strings[name.0 as usize - 1].clone()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        named,
        vec![
            (8, b"ncclDevFunc_AllGather_RING_SIMPLE".to_vec()),
            (7, b"ncclDevFunc_AllReduce_Sum_f32_RING_LL".to_vec())
        ]
    );
    assert_eq!(sink.works().count(), 9);
}

#[test]
fn idle_staged_rings_are_probed_and_deliver_once_active() {
    // 63 channels stay idle for many passes (copied only every few passes); then channel 5 starts.
    let (block, mut r) = rings(10, 8, true);
    let mut sink = TestSink::default();
    for _ in 0..20 {
        assert_eq!(pass(&mut r, &mut sink), 0);
    }
    for wc in 1..=100 {
        write(block.ctx(), &event(5, wc, 0));
        write(block.ctx(), &event(5, wc, 1));
    }
    let mut passes = 0;
    while sink.works().count() < 100 {
        pass(&mut r, &mut sink);
        passes += 1;
        assert!(
            passes <= 16,
            "an idle ring is probed at least every 8 passes"
        );
    }
    close(&mut r, &mut sink);
    verify(&sink);
    assert_eq!(sink.accounted(), 200);
}
