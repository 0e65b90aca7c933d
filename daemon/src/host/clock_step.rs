//! Host clock steps (an NTP step, `date -s`, a VM resumed): CLOCK_REALTIME jumps against
//! CLOCK_BOOTTIME. Each process maps its GPU clock to CLOCK_REALTIME with a calibration it repeats
//! every few seconds, so for that long after a step the ranks of one node disagree by the step:
//! their skew and stragglers would be the step's, not the job's. The engine samples the two clocks
//! every tick; [`crate::stats::Stats::clock_stepped`] leaves the collectives around a step out of the
//! skew. The clocks are read unshifted: a test clock offset ([`crate::config::Config::test_clock_offset_ns`])
//! is constant for the process's life, so never a step; the engine moves a step's time onto its clock.

use rustix::time::{ClockId, clock_gettime};

/// A change of CLOCK_REALTIME - CLOCK_BOOTTIME larger than this between two samples is a step. NTP
/// slews at most 500 ppm: 50 ms would take 100 s of slewing, while samples are milliseconds apart.
pub const STEP_NS: i64 = 50_000_000;

/// Longest a sample's reads of the two clocks may take (they take well under a microsecond).
const MAX_SAMPLE_NS: i64 = 1_000_000;

/// A step of the host clock: when (on the new clock) and by how much.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub at_ns: u64,
    pub delta_ns: i64,
}

/// Compares successive samples of CLOCK_REALTIME - CLOCK_BOOTTIME.
#[derive(Debug, Default)]
pub struct StepDetector {
    offset: Option<i64>,
    pub steps: u64,
}

impl StepDetector {
    /// Samples the clocks now. A sample whose reads were far apart (the thread was preempted between
    /// them) is not used: the time between would read as a step.
    pub fn sample(&mut self) -> Option<Step> {
        let ns = |id| {
            let t = clock_gettime(id);
            t.tv_sec as i64 * 1_000_000_000 + t.tv_nsec as i64
        };
        let before = ns(ClockId::Boottime);
        let real = ns(ClockId::Realtime);
        let after = ns(ClockId::Boottime);
        if after - before > MAX_SAMPLE_NS {
            return None;
        }
        self.observe(real, before + (after - before) / 2)
    }

    /// A sample of both clocks (nanoseconds); the step since the previous one, if any.
    pub fn observe(&mut self, realtime_ns: i64, boottime_ns: i64) -> Option<Step> {
        let offset = realtime_ns.saturating_sub(boottime_ns);
        let before = self.offset.replace(offset)?;
        let delta_ns = offset.saturating_sub(before);
        if delta_ns.unsigned_abs() <= STEP_NS as u64 {
            return None;
        }
        self.steps += 1;
        Some(Step {
            at_ns: realtime_ns.max(0) as u64,
            delta_ns,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jump_of_the_wall_clock_is_a_step_and_slewing_is_not() {
        let mut d = StepDetector::default();
        let s = 1_000_000_000i64;
        assert_eq!(d.observe(1_700_000_000 * s, 100 * s), None, "first sample");
        // 10 ms of slew over a second: not a step.
        assert_eq!(d.observe(1_700_000_001 * s + 10_000_000, 101 * s), None);
        // An hour forward.
        let at = 1_700_003_602 * s + 10_000_000;
        let step = d.observe(at, 102 * s).unwrap();
        assert_eq!((step.at_ns, step.delta_ns), (at as u64, 3600 * s));
        // And back again.
        let back = d.observe(1_700_000_003 * s + 10_000_000, 103 * s).unwrap();
        assert_eq!(back.delta_ns, -3600 * s);
        assert_eq!(d.steps, 2);
        // The real clocks, sampled twice: no step between.
        let mut real = StepDetector::default();
        assert_eq!(real.sample(), None);
        assert_eq!(real.sample(), None);
    }
}
