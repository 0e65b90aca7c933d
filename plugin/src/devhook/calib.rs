//! GPU clock -> host clock calibration. A sample brackets one GPU clock read between two CLOCK_REALTIME
//! reads; causality puts the GPU read inside the bracket, so the midpoint maps the clocks to within half
//! the bracket plus the GPU clock's tick. The narrowest bracket of a batch wins; repeated batches give
//! the drift.

use std::time::{Duration, Instant};

use ncclscope_proto::Record;

/// How often a device is recalibrated.
pub const PERIOD: Duration = Duration::from_secs(5);
/// The first intervals, before [`PERIOD`]: the daemon carries each calibration's drift (the offset's
/// change since the previous one) to the times it maps, and a first calibration has none, so the
/// second comes soon (an H100's clock drifts 10.5 ppm: 50 us in 5 s, 2.6 us in 250 ms).
pub const FIRST_INTERVALS: [Duration; 2] = [Duration::from_millis(250), Duration::from_secs(1)];
/// How soon a calibration that could not run is tried again.
pub const RETRY: Duration = Duration::from_millis(250);
/// Samples per calibration.
pub const SAMPLES: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// CLOCK_REALTIME before the GPU clock was read.
    pub before: u64,
    pub gpu: u64,
    /// CLOCK_REALTIME after the GPU clock's value was seen.
    pub after: u64,
}

/// `host = gpu + offset_ns`, good to `error_ns`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Estimate {
    pub offset_ns: i64,
    pub error_ns: u32,
}

/// The estimate from the sample with the smallest bracket; `tick_ns` is the GPU clock's resolution.
pub fn estimate(samples: &[Sample], tick_ns: u64) -> Option<Estimate> {
    let best = samples
        .iter()
        .filter(|s| s.after >= s.before)
        .min_by_key(|s| s.after - s.before)?;
    let rtt = best.after - best.before;
    let mid = best.before + rtt / 2;
    Some(Estimate {
        offset_ns: mid as i64 - best.gpu as i64,
        error_ns: (rtt.div_ceil(2) + tick_ns).min(u32::MAX as u64) as u32,
    })
}

/// Simulation: the "GPU clock" is CLOCK_MONOTONIC (the fake NCCL stamps events with it).
pub fn cpu_samples(n: usize) -> Vec<Sample> {
    (0..n)
        .map(|_| {
            let before = ncclscope_proto::now_ns();
            let gpu = monotonic_ns();
            let after = ncclscope_proto::now_ns();
            Sample { before, gpu, after }
        })
        .collect()
}

/// CLOCK_MONOTONIC in nanoseconds: the simulated GPU clock.
pub fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One device's calibration history.
#[derive(Debug)]
pub struct Tracker {
    pub cuda_dev: i32,
    last: Option<(u64, i64)>,
    due: Instant,
    /// Calibrations scheduled so far (the first ones come at [`FIRST_INTERVALS`]).
    scheduled: usize,
}

impl Tracker {
    pub fn new(cuda_dev: i32) -> Tracker {
        Tracker {
            cuda_dev,
            last: None,
            due: Instant::now(),
            scheduled: 0,
        }
    }

    pub fn is_due(&self, now: Instant) -> bool {
        now >= self.due
    }

    /// Schedules the next calibration.
    pub fn reschedule(&mut self, now: Instant) {
        self.due = now + *FIRST_INTERVALS.get(self.scheduled).unwrap_or(&PERIOD);
        self.scheduled += 1;
    }

    /// A calibration could not run (the GPU was too busy to start its kernel): try again soon.
    pub fn retry(&mut self, now: Instant) {
        self.due = now + RETRY;
    }

    /// The record for a new estimate taken at `host_ns`, with the drift since the previous one.
    pub fn record(&mut self, est: Estimate, host_ns: u64) -> Record {
        let drift_ppb = match self.last {
            Some((host, offset)) if host_ns > host => {
                let ppb =
                    (est.offset_ns - offset) as i128 * 1_000_000_000 / (host_ns - host) as i128;
                ppb.clamp(i32::MIN as i128, i32::MAX as i128) as i32
            }
            _ => 0,
        };
        self.last = Some((host_ns, est.offset_ns));
        Record::Calibration {
            cuda_dev: self.cuda_dev,
            offset_ns: est.offset_ns,
            error_ns: est.error_ns,
            drift_ppb,
            host_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_narrowest_bracket_wins() {
        let s = [
            Sample {
                before: 1000,
                gpu: 10,
                after: 3000,
            },
            Sample {
                before: 5000,
                gpu: 4100,
                after: 5200,
            },
            Sample {
                before: 9000,
                gpu: 10,
                after: 8000,
            },
        ];
        let e = estimate(&s, 32).unwrap();
        assert_eq!(
            e,
            Estimate {
                offset_ns: 5100 - 4100,
                error_ns: 100 + 32
            }
        );
        assert_eq!(estimate(&[], 32), None);
    }

    #[test]
    fn simulated_clock_maps_to_realtime_within_the_bound() {
        let e = estimate(&cpu_samples(SAMPLES), 1).unwrap();
        let (real, mono) = (ncclscope_proto::now_ns(), monotonic_ns());
        let mapped = mono as i64 + e.offset_ns;
        assert!(
            (mapped - real as i64).abs() < 1_000_000,
            "mapped {mapped} vs realtime {real}"
        );
        assert!(e.error_ns < 1_000_000);
    }

    #[test]
    fn the_second_calibration_comes_soon_then_every_period() {
        let mut t = Tracker::new(0);
        let start = Instant::now();
        assert!(
            t.is_due(start + Duration::from_nanos(1)),
            "the first is due at once"
        );
        let mut at = start;
        let mut intervals = vec![];
        for _ in 0..4 {
            t.reschedule(at);
            intervals.push(t.due - at);
            at = t.due;
        }
        assert_eq!(
            intervals,
            [FIRST_INTERVALS[0], FIRST_INTERVALS[1], PERIOD, PERIOD]
        );
        // A failed calibration is retried without consuming the schedule.
        t.retry(at);
        assert_eq!(t.due - at, RETRY);
    }

    #[test]
    fn drift_is_the_offset_change_per_second() {
        let mut t = Tracker::new(0);
        let r0 = t.record(
            Estimate {
                offset_ns: 1000,
                error_ns: 5,
            },
            1_000_000_000,
        );
        assert!(matches!(r0, Record::Calibration { drift_ppb: 0, .. }));
        let r1 = t.record(
            Estimate {
                offset_ns: 1500,
                error_ns: 5,
            },
            2_000_000_000,
        );
        assert!(matches!(
            r1,
            Record::Calibration {
                drift_ppb: 500,
                offset_ns: 1500,
                ..
            }
        ));
    }
}
