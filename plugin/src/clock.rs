//! Host timestamps for the hot path. On x86-64, when the kernel itself keeps time with the TSC (so it
//! is invariant and synchronised across cores), NCCL threads read the TSC (a few ns) and the forwarding
//! thread converts the ticks to CLOCK_REALTIME; elsewhere the stamp is CLOCK_REALTIME itself (vDSO,
//! ~30 ns). Every `host_ns` in the segment is CLOCK_REALTIME either way, shifted by the process's
//! test clock offset ([`ncclscope_proto::clock_offset_ns`]): the offset is added by the forwarding
//! thread's conversion (in the anchors read with [`now_ns`], or to the stamp without the TSC), never
//! on NCCL's threads.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ncclscope_proto::{now_ns, realtime_ns, shift};

static TSC: AtomicBool = AtomicBool::new(false);

/// Picks the stamp source; call once before the first [`stamp`].
pub fn init() {
    let tsc = cfg!(target_arch = "x86_64")
        && std::fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        )
        .is_ok_and(|s| s.trim() == "tsc");
    TSC.store(tsc, Ordering::Relaxed);
}

/// A timestamp for an event, to be turned into CLOCK_REALTIME ns by a [`Converter`].
#[inline]
pub fn stamp() -> u64 {
    if TSC.load(Ordering::Relaxed) {
        ticks()
    } else {
        realtime_ns()
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn ticks() -> u64 {
    // SAFETY: RDTSC has no preconditions on x86-64.
    unsafe { std::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn ticks() -> u64 {
    realtime_ns()
}

/// The first baseline of the tick rate. Re-anchored after 1, 2, 4, ... ms (up to [`MAX_PERIOD`]), a
/// stamp is never further from its anchor than the rate's baseline is long, so the rate's error
/// (the reading's ~50 ns over the baseline) stays below ~100 ns from the first millisecond on.
const FIRST_BASELINE: Duration = Duration::from_millis(1);
const MAX_PERIOD: Duration = Duration::from_secs(1);

/// Stamps -> CLOCK_REALTIME: a linear map anchored at a recent (ticks, realtime) pair, with the tick
/// rate measured over the longest baseline seen. Owned by the forwarding thread.
pub struct Converter {
    tsc: bool,
    /// The clock offset added to a stamp without the TSC (with it, the anchors carry it).
    offset_ns: i64,
    first: (u64, u64),
    anchor: (u64, u64),
    /// ns per tick, 32.32 fixed point.
    rate: u64,
    /// Whether `rate` was measured (over at least [`FIRST_BASELINE`]).
    measured: bool,
    period: Duration,
    next_refresh: Instant,
}

/// (ticks, realtime ns) read as close together as possible: the tightest of a few brackets.
fn pair() -> (u64, u64) {
    let mut best = (u64::MAX, 0, 0);
    for _ in 0..5 {
        let t0 = ticks();
        let ns = now_ns();
        let t1 = ticks();
        if t1.wrapping_sub(t0) < best.0 {
            best = (t1.wrapping_sub(t0), t0 + (t1.wrapping_sub(t0)) / 2, ns);
        }
    }
    (best.1, best.2)
}

impl Converter {
    /// Takes the first anchor; the tick rate is known [`FIRST_BASELINE`] later ([`Converter::ready`]).
    pub fn start() -> Converter {
        let tsc = TSC.load(Ordering::Relaxed);
        let first = if tsc { pair() } else { (0, 0) };
        Converter {
            tsc,
            offset_ns: ncclscope_proto::clock_offset_ns(),
            first,
            anchor: first,
            rate: 1 << 32,
            measured: !tsc,
            period: FIRST_BASELINE,
            next_refresh: Instant::now() + FIRST_BASELINE,
        }
    }

    /// Whether stamps can be converted yet (the tick rate is measured; always without the TSC).
    pub fn ready(&self) -> bool {
        self.measured
    }

    /// Refreshes when due: after 1, 2, 4, ... ms, then every [`MAX_PERIOD`]. Called by the
    /// forwarding thread on every pass.
    pub fn tick(&mut self, now: Instant) {
        if now < self.next_refresh {
            return;
        }
        self.refresh();
        self.measured = true;
        self.period = (self.period * 2).min(MAX_PERIOD);
        self.next_refresh = now + self.period;
    }

    /// Re-anchors at the current time and re-measures the rate from the first anchor, so NTP steps
    /// and slews of CLOCK_REALTIME are followed.
    fn refresh(&mut self) {
        if !self.tsc {
            return;
        }
        let now = pair();
        let dt = now.0.wrapping_sub(self.first.0);
        let dns = now.1.saturating_sub(self.first.1);
        if dt > 0 && dns > 0 {
            self.rate = ((dns as u128) << 32)
                .checked_div(dt as u128)
                .map_or(self.rate, |r| r as u64);
        }
        self.anchor = now;
    }

    /// CLOCK_REALTIME ns of a stamp.
    pub fn to_ns(&self, stamp: u64) -> u64 {
        if !self.tsc {
            return shift(stamp, self.offset_ns);
        }
        let dt = stamp.wrapping_sub(self.anchor.0) as i64 as i128;
        let dns = (dt * self.rate as i128) >> 32;
        (self.anchor.1 as i128 + dns).max(0) as u64
    }

    /// A stamp taken `age` ago.
    pub fn stamp_ago(&self, age: Duration) -> u64 {
        let now = stamp();
        if !self.tsc {
            return now.saturating_sub(age.as_nanos() as u64);
        }
        let ticks = ((age.as_nanos()) << 32) / self.rate.max(1) as u128;
        now.saturating_sub(ticks as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_convert_to_realtime() {
        init();
        let mut conv = Converter::start();
        assert_eq!(conv.ready(), !TSC.load(Ordering::Relaxed));
        std::thread::sleep(FIRST_BASELINE);
        conv.tick(Instant::now());
        assert!(conv.ready());
        for _ in 0..3 {
            conv.tick(Instant::now());
            let before = now_ns();
            let s = stamp();
            let after = now_ns();
            let ns = conv.to_ns(s);
            assert!(
                ns + 200_000 >= before && ns <= after + 200_000,
                "{before} <= {ns} <= {after}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let ago = conv.to_ns(conv.stamp_ago(Duration::from_secs(1)));
        assert!(
            now_ns().abs_diff(ago + 1_000_000_000) < 5_000_000,
            "stamp_ago"
        );
    }
}
