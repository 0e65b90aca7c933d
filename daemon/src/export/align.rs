//! `export --merge`'s check of its own alignment: where ncclscope's collective slices sit against the
//! NCCL kernels PyTorch's profiler (CUPTI) recorded in the trace. A collective's kernel work starts
//! after its kernel starts and ends before it ends, so on one clock every kernel contains its
//! slice; the offset that makes the most of them do so measures how far the two mappings of the GPU
//! clock to CLOCK_REALTIME (ncclscope's calibration, CUPTI's) disagree.

use ncclscope_proto::TimingSource;
use ncclscope_proto::api::Collective;
use serde_json::{Value, json};

/// Offsets within this are agreement: the calibrations' own error bounds are of this order.
pub const TOLERANCE_NS: i64 = 1_000;
/// Past this the pairing itself is suspect (another run's trace, a clock step): never corrected.
pub const MAX_CORRECTION_NS: i64 = 1_000_000;
/// Fewer pairs than this measure nothing.
pub const MIN_PAIRS: usize = 3;
/// The share of paired kernels that must contain their slice at the offset chosen, else the slices
/// do not line up with the kernels at any one offset.
pub const MIN_INSIDE: f64 = 0.9;

/// An NCCL kernel of the trace, in Unix ns.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    pub start: i64,
    pub end: i64,
    pub name: String,
}

/// The NCCL kernels of a PyTorch trace (`cat` "kernel", named `ncclDevKernel_*` or `ncclKernel_*`),
/// in start order, on Unix time (`baseTimeNanoseconds` + `ts` microseconds).
pub fn nccl_kernels(torch: &Value) -> Vec<Kernel> {
    let base = torch
        .get("baseTimeNanoseconds")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let mut kernels: Vec<Kernel> = (torch.get("traceEvents").and_then(Value::as_array))
        .into_iter()
        .flatten()
        .filter(|e| e.get("cat").and_then(Value::as_str) == Some("kernel"))
        .filter_map(|e| {
            let name = e.get("name")?.as_str()?;
            // Not ncclscope's own calibration kernel (`ncclscope_calibrate`), which profilers see too.
            if !(name.starts_with("ncclDevKernel_") || name.starts_with("ncclKernel_")) {
                return None;
            }
            let ts = e.get("ts")?.as_f64()?;
            let dur = e.get("dur").and_then(Value::as_f64).unwrap_or(0.0);
            let start = base + (ts * 1000.0).round() as i64;
            Some(Kernel {
                start,
                end: start + (dur * 1000.0).round() as i64,
                name: name.to_string(),
            })
        })
        .collect();
    kernels.sort_by_key(|k| k.start);
    kernels
}

/// What the check found for the process whose slices paired best.
#[derive(Clone, Debug, PartialEq)]
pub struct Alignment {
    /// The process: "rank R (host pid P)".
    pub process: String,
    /// Its kernel-timed slices within the trace's window, and how many paired with a kernel.
    pub slices: usize,
    pub paired: usize,
    /// Paired kernels containing their slice as exported.
    pub inside_before: usize,
    /// The shift (ns, added to ncclscope's times) that puts the most paired slices inside their
    /// kernels (0 if none is needed; else mid-way through the shifts that do), and how many it does.
    pub offset_ns: i64,
    pub inside_after: usize,
}

impl Alignment {
    /// Whether the slices line up with the kernels at one offset (else the pairing or a clock is off).
    pub fn consistent(&self) -> bool {
        self.paired >= MIN_PAIRS && self.inside_after as f64 >= MIN_INSIDE * self.paired as f64
    }

    pub fn to_json(&self, applied_ns: i64) -> Value {
        json!({
            "process": self.process, "slices": self.slices, "paired": self.paired,
            "inside_before": self.inside_before, "measured_offset_ns": self.offset_ns,
            "inside_after": self.inside_after, "applied_offset_ns": applied_ns,
            "tolerance_ns": TOLERANCE_NS,
        })
    }

    /// One line for the user.
    pub fn describe(&self) -> String {
        let dir = if self.offset_ns >= 0 { "early" } else { "late" };
        format!(
            "{}: {} of {} collectives paired with the trace's NCCL kernels, {} inside them as exported; \
             ncclscope's slices are {:.3} us {dir} against the trace (CUPTI's clock): shifted so, {} inside",
            self.process,
            self.paired,
            self.slices,
            self.inside_before,
            self.offset_ns.unsigned_abs() as f64 / 1000.0,
            self.inside_after,
        )
    }
}

/// Whether `k` can run collective `c`: `ncclDevKernel_AllReduce_Sum_f32_RING_LL` runs an
/// AllReduce; a group's sends and receives run in `ncclDevKernel_SendRecv`.
fn runs(k: &Kernel, c: &Collective) -> bool {
    if c.is_p2p {
        k.name.contains("SendRecv")
    } else {
        !c.func.is_empty() && k.name.contains(c.func.as_str())
    }
}

/// Whose trace it is: the profiled process's pid (Kineto's CPU events) and its rank
/// (`distributedInfo.rank`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Owner {
    pub pid: Option<u32>,
    pub rank: Option<u32>,
}

impl Owner {
    pub fn of(torch: &Value) -> Owner {
        let mut pids: std::collections::HashMap<u64, usize> = Default::default();
        for e in (torch.get("traceEvents").and_then(Value::as_array))
            .into_iter()
            .flatten()
        {
            if e.get("cat").and_then(Value::as_str) == Some("cpu_op")
                && let Some(pid) = e.get("pid").and_then(Value::as_u64)
            {
                *pids.entry(pid).or_default() += 1;
            }
        }
        Owner {
            pid: (pids.into_iter().max_by_key(|&(_, n)| n))
                .and_then(|(p, _)| u32::try_from(p).ok()),
            rank: (torch
                .pointer("/distributedInfo/rank")
                .and_then(Value::as_u64))
            .and_then(|r| u32::try_from(r).ok()),
        }
    }
}

/// Pairs each process's kernel-timed slices with the trace's NCCL kernels and measures the offset;
/// the trace's own process (its pid, else its rank), else the one that paired most with the least
/// shift (None: no kernels, or nothing paired). Every rank of a node may pair at some shift (a late
/// rank's slices 70 us late): only the trace's own is the one its kernels ran.
pub fn check(kernels: &[Kernel], colls: &[Collective], owner: Owner) -> Option<Alignment> {
    let (first, last) = (kernels.first()?.start, kernels.iter().map(|k| k.end).max()?);
    let mut processes: Vec<(&str, u32)> = colls.iter().map(|c| (c.host.as_str(), c.pid)).collect();
    processes.sort();
    processes.dedup();
    processes
        .into_iter()
        .filter_map(|(host, pid)| {
            let slices: Vec<(i64, i64, &Collective)> = colls
                .iter()
                .filter(|c| c.host == host && c.pid == pid)
                .filter(|c| c.start_unix_ns != 0)
                .filter(|c| TimingSource::parse(&c.timing_source) != TimingSource::Host)
                .map(|c| {
                    (
                        c.start_unix_ns as i64,
                        c.end_unix_ns.max(c.start_unix_ns) as i64,
                        c,
                    )
                })
                .filter(|&(s, e, _)| {
                    e + MAX_CORRECTION_NS >= first && s - MAX_CORRECTION_NS <= last
                })
                .collect();
            let a = check_process(kernels, &slices)?;
            let c = slices[0].2;
            let own = (owner.pid == Some(c.pid), owner.rank == Some(c.rank));
            Some((
                own,
                Alignment {
                    process: format!("rank {} ({} pid {})", c.rank, c.host, c.pid),
                    ..a
                },
            ))
        })
        .max_by_key(|(own, a)| {
            let fit = (
                a.paired,
                a.inside_after,
                std::cmp::Reverse(a.offset_ns.unsigned_abs()),
            );
            (*own, fit)
        })
        .map(|(_, a)| a)
}

fn check_process(kernels: &[Kernel], slices: &[(i64, i64, &Collective)]) -> Option<Alignment> {
    let center = |a: i64, b: i64| a + (b - a) / 2;
    // The kernel able to run `c` (its slice `s..e`, shifted) whose center is nearest the slice's,
    // looked for among the kernels starting within a millisecond of the slice's start (a kernel
    // starts just before its work, however long both are: not of its center, 2.5 ms away in a
    // 5 ms all-gather).
    let nearest = |c: &Collective, s: i64, e: i64| -> Option<usize> {
        let from = kernels.partition_point(|k| k.start < s - MAX_CORRECTION_NS);
        let to = kernels.partition_point(|k| k.start <= s + MAX_CORRECTION_NS);
        let at = center(s, e);
        (from..to)
            .filter(|&i| runs(&kernels[i], c))
            .min_by_key(|&i| (center(kernels[i].start, kernels[i].end) - at).abs())
    };
    // A coarse offset: the median distance from each slice's center to the nearest kernel's.
    let mut coarse: Vec<i64> = (slices.iter())
        .filter_map(|&(s, e, c)| {
            let k = &kernels[nearest(c, s, e)?];
            Some(center(k.start, k.end) - center(s, e))
        })
        .collect();
    if coarse.is_empty() {
        return None;
    }
    coarse.sort_unstable();
    let m0 = coarse[coarse.len() / 2];
    // Pairs: each slice, shifted by it, with the kernel nearest it that it overlaps; a kernel once.
    let mut by_kernel: std::collections::BTreeMap<usize, (i64, i64, i64)> = Default::default();
    for &(s, e, c) in slices {
        let Some(i) = nearest(c, s + m0, e + m0) else {
            continue;
        };
        let k = &kernels[i];
        if s + m0 > k.end || e + m0 < k.start {
            continue;
        }
        let gap = (center(k.start, k.end) - center(s, e) - m0).abs();
        // Shifts that put the slice inside the kernel: [k.start - s, k.end - e].
        let feasible = (k.start - s, k.end - e);
        match by_kernel.get(&i) {
            Some(&(g, _, _)) if g <= gap => {}
            _ => {
                by_kernel.insert(i, (gap, feasible.0, feasible.1));
            }
        }
    }
    let intervals: Vec<(i64, i64)> = by_kernel.values().map(|&(_, lo, hi)| (lo, hi)).collect();
    let inside_before = intervals
        .iter()
        .filter(|&&(lo, hi)| lo <= 0 && 0 <= hi)
        .count();
    let (offset_ns, inside_after) = best_shift(&intervals);
    Some(Alignment {
        process: String::new(),
        slices: slices.len(),
        paired: intervals.len(),
        inside_before,
        offset_ns,
        inside_after,
    })
}

/// The shift inside the most of `intervals` (closed), with how many: 0 where 0 is one, else the
/// middle of the run of such shifts nearest 0 (equal margins at the kernel's start and end).
fn best_shift(intervals: &[(i64, i64)]) -> (i64, usize) {
    // Sweep: +1 at each start, -1 just after each end; starts before ends at one point.
    let mut edges: Vec<(i64, i32)> = (intervals.iter())
        .filter(|(lo, hi)| lo <= hi)
        .flat_map(|&(lo, hi)| [(lo, 1), (hi + 1, -1)])
        .collect();
    edges.sort_by_key(|&(x, d)| (x, -d));
    let (mut depth, mut best, mut run) = (0i32, 0i32, (0i64, 0i64));
    let distance = |(a, b): (i64, i64)| 0i64.clamp(a, b).abs();
    for (i, &(x, d)) in edges.iter().enumerate() {
        depth += d;
        // The shifts [x, next edge) are inside `depth` intervals.
        let end = edges.get(i + 1).map_or(x, |e| e.0 - 1);
        if end >= x && (depth > best || (depth == best && distance((x, end)) < distance(run))) {
            best = depth;
            run = (x, end);
        }
    }
    let at = if run.0 <= 0 && 0 <= run.1 {
        0
    } else {
        run.0 + (run.1 - run.0) / 2
    };
    (at, best.max(0) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coll(pid: u32, seq: u64, start: u64, end: u64) -> Collective {
        Collective {
            host: "n".into(),
            pid,
            seq,
            func: "AllReduce".into(),
            timing_source: "device_hook".into(),
            start_unix_ns: start,
            end_unix_ns: end,
            ..Default::default()
        }
    }

    fn kernel(start: i64, end: i64) -> Kernel {
        Kernel {
            start,
            end,
            name: "ncclDevKernel_AllReduce_Sum_f32_RING_LL".into(),
        }
    }

    #[test]
    fn the_shift_that_puts_most_slices_inside_is_zero_or_mid_way_through_the_run_nearest_it() {
        assert_eq!(best_shift(&[(-5, 10), (-2, 3), (1, 5)]), (2, 3));
        assert_eq!(best_shift(&[(-5, 10), (-2, 3)]), (0, 2));
        // An outlier does not move it.
        assert_eq!(best_shift(&[(5, 9), (6, 12), (7, 9), (-900, -800)]), (8, 3));
        assert_eq!(best_shift(&[]), (0, 0));
        assert_eq!(best_shift(&[(-9, -4)]), (-7, 1));
    }

    /// The picture: slices ~10 us early against CUPTI's kernels, every 100 us.
    #[test]
    fn slices_ten_microseconds_early_are_found_and_measured() {
        let t0 = 1_796_000_000_000_000_000i64;
        let kernels: Vec<Kernel> = (0..20)
            .map(|i| kernel(t0 + i * 100_000, t0 + i * 100_000 + 30_000))
            .collect();
        let colls: Vec<Collective> = (0..20)
            .map(|i| {
                // Work from 1.5 us after the kernel starts to 1 us before it ends, 10.4 us early.
                let s = t0 + i * 100_000 + 1_500 - 10_400;
                coll(7, i as u64, s as u64, (s + 27_500) as u64)
            })
            .collect();
        let a = check(&kernels, &colls, Owner::default()).unwrap();
        assert_eq!((a.paired, a.inside_before, a.inside_after), (20, 0, 20));
        // Shifts of 8.9..11.4 us put all inside: the middle leaves equal margins.
        assert_eq!(a.offset_ns, 10_150);
        assert!(a.consistent());
        assert!(a.describe().contains("10.150 us early"), "{}", a.describe());
    }

    /// As on the H100 (torch_profile.py): 5 ms all-gathers beside 30 us ones, each slice inside its
    /// kernel; a long kernel's center is 2.5 ms from its start, so it must still be found.
    #[test]
    fn long_kernels_pair_with_their_slices() {
        let t0 = 1_796_000_000_000_000_000i64;
        let len = |i: i64| if i % 2 == 0 { 4_900_000 } else { 30_000 };
        let starts: Vec<i64> = (0..10)
            .scan(t0, |at, i| {
                let s = *at;
                *at += len(i) + 8_000;
                Some(s)
            })
            .collect();
        let kernels: Vec<Kernel> = (0..10)
            .map(|i| kernel(starts[i], starts[i] + len(i as i64)))
            .collect();
        let colls: Vec<Collective> = (0..10)
            .map(|i| {
                let s = starts[i] + 1_000;
                coll(7, i as u64, s as u64, (s + len(i as i64) - 3_000) as u64)
            })
            .collect();
        let a = check(&kernels, &colls, Owner::default()).unwrap();
        assert_eq!((a.paired, a.inside_before, a.offset_ns), (10, 10, 0));
    }

    #[test]
    fn slices_already_inside_are_left_where_they_are_and_other_processes_do_not_pair() {
        let t0 = 1_000_000_000i64;
        let kernels: Vec<Kernel> = (0..5)
            .map(|i| kernel(t0 + i * 50_000, t0 + i * 50_000 + 9_000))
            .collect();
        let mut colls: Vec<Collective> = (0..5)
            .map(|i| {
                coll(
                    1,
                    i,
                    (t0 + i as i64 * 50_000 + 500) as u64,
                    (t0 + i as i64 * 50_000 + 8_000) as u64,
                )
            })
            .collect();
        // Another process, far from every kernel and of a collective the trace never ran.
        colls.extend((0..5).map(|i| Collective {
            func: "AllGather".into(),
            ..coll(2, i, 5, 6)
        }));
        // A late rank of the same node: its slices pair too, 3 us late.
        colls.extend((0..5).map(|i| Collective {
            rank: 2,
            ..coll(
                3,
                i,
                (t0 + i as i64 * 50_000 + 3_500) as u64,
                (t0 + i as i64 * 50_000 + 11_000) as u64,
            )
        }));
        let a = check(&kernels, &colls, Owner::default()).unwrap();
        assert_eq!((a.paired, a.inside_before, a.offset_ns), (5, 5, 0));
        assert!(a.process.contains("pid 1"), "{}", a.process);
        // The trace's own process wins, whatever its fit.
        let late = check(
            &kernels,
            &colls,
            Owner {
                pid: None,
                rank: Some(2),
            },
        )
        .unwrap();
        assert!(
            late.process.contains("pid 3") && late.offset_ns < 0,
            "{late:?}"
        );
        assert_eq!(check(&[], &colls, Owner::default()), None);
    }

    #[test]
    fn kernels_come_from_the_trace_on_its_time_base() {
        let trace = json!({"baseTimeNanoseconds": 1_000_000_000u64, "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 2.5, "dur": 1.25},
            {"ph": "X", "cat": "kernel", "name": "ampere_sgemm", "ts": 1.0, "dur": 1.0},
            {"ph": "X", "cat": "kernel", "name": "ncclscope_calibrate", "ts": 1.5, "dur": 0.1},
            {"ph": "X", "cat": "cpu_op", "name": "nccl:all_reduce", "ts": 1.0, "dur": 1.0},
            {"ph": "X", "cat": "kernel", "name": "ncclKernel_AllReduce_RING_LL_Sum_float", "ts": 0.5, "dur": 1.0},
        ]});
        assert_eq!(
            Owner::of(&trace),
            Owner {
                pid: None,
                rank: None
            }
        );
        let owned = json!({"distributedInfo": {"rank": 3}, "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 812, "ts": 1.0},
            {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "ts": 1.0}]});
        assert_eq!(
            Owner::of(&owned),
            Owner {
                pid: Some(812),
                rank: Some(3)
            }
        );
        let k = nccl_kernels(&trace);
        assert_eq!(k.len(), 2);
        assert_eq!((k[0].start, k[0].end), (1_000_000_500, 1_000_001_500));
        assert_eq!((k[1].start, k[1].end), (1_000_002_500, 1_000_003_750));
    }
}
