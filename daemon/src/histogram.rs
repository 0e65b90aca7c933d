//! The two histogram shapes the daemon keeps: cumulative explicit-bucket histograms for export
//! (Prometheus, OTLP: never sampled, never reset) and rolling log-bucketed ones for percentiles.

/// Upper bounds of the exported execution-time histogram, in microseconds.
pub const EXEC_US_BOUNDS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5,
    5e5, 1e6, 1e7,
];
/// Upper bounds of the exported bus-bandwidth histogram, in GB/s.
pub const BUSBW_GBS_BOUNDS: &[f64] = &[
    0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0,
];
/// Upper bounds of the exported cross-rank skew histogram, in microseconds.
pub const SKEW_US_BOUNDS: &[f64] = &[
    0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 1e4, 1e5, 1e6,
];

/// Buckets of the largest histogram above (+Inf included).
const MAX_BUCKETS: usize = EXEC_US_BOUNDS.len() + 1;

/// A cumulative histogram over fixed bounds (the last bucket is +Inf). The counts live inline: they
/// are incremented for every instance, next to the series' other fields.
#[derive(Clone, Debug, PartialEq)]
pub struct Buckets {
    pub bounds: &'static [f64],
    counts: [u64; MAX_BUCKETS],
    pub sum: f64,
    pub count: u64,
}

impl Buckets {
    pub fn new(bounds: &'static [f64]) -> Buckets {
        assert!(bounds.len() < MAX_BUCKETS, "at most {MAX_BUCKETS} buckets");
        Buckets {
            bounds,
            counts: [0; MAX_BUCKETS],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn record(&mut self, v: f64) {
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    /// Per-bucket (not cumulative) counts; one more than `bounds`.
    pub fn counts(&self) -> &[u64] {
        &self.counts[..self.bounds.len() + 1]
    }
}

const SUB_BITS: u32 = 3;
const SUB: usize = 1 << SUB_BITS;
const SLOTS: usize = (64 - SUB_BITS as usize + 1) * SUB;

/// Log-linear buckets (8 per power of two, so within 12.5%) over u64 values, allocated on first use.
#[derive(Clone, Debug, Default)]
pub struct LogHistogram {
    counts: Option<Box<[u32; SLOTS]>>,
    total: u64,
}

fn slot(v: u64) -> usize {
    if v < SUB as u64 {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // >= SUB_BITS
    let sub = (v >> (e - SUB_BITS)) as usize & (SUB - 1);
    (e - SUB_BITS + 1) as usize * SUB + sub
}

/// The smallest value of slot `i` (the percentile reported for it).
fn slot_low(i: usize) -> u64 {
    if i < SUB {
        return i as u64;
    }
    let e = (i / SUB) as u32 + SUB_BITS - 1;
    ((SUB + i % SUB) as u64) << (e - SUB_BITS)
}

impl LogHistogram {
    pub fn record(&mut self, v: u64) {
        let counts = self.counts.get_or_insert_with(|| Box::new([0; SLOTS]));
        let c = &mut counts[slot(v)];
        *c = c.saturating_add(1);
        self.total += 1;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    /// The value at quantile `q` in [0, 1] over `self` and `other` together (0 when both are empty).
    pub fn quantile_with(&self, other: &LogHistogram, q: f64) -> u64 {
        let total = self.total + other.total;
        if total == 0 {
            return 0;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0u64;
        for i in 0..SLOTS {
            let n = |h: &LogHistogram| h.counts.as_ref().map_or(0, |c| c[i] as u64);
            seen += n(self) + n(other);
            if seen >= rank {
                return slot_low(i);
            }
        }
        slot_low(SLOTS - 1)
    }
}

/// A log histogram over a sliding window of between one and two `window_ns`.
#[derive(Clone, Debug, Default)]
pub struct Rolling {
    cur: LogHistogram,
    prev: LogHistogram,
    cur_since_ns: u64,
}

impl Rolling {
    pub fn record(&mut self, v: u64, now_ns: u64, window_ns: u64) {
        if now_ns.saturating_sub(self.cur_since_ns) >= window_ns {
            self.prev = std::mem::take(&mut self.cur);
            self.cur_since_ns = now_ns;
        }
        self.cur.record(v);
    }

    pub fn quantile(&self, q: f64) -> u64 {
        self.cur.quantile_with(&self.prev, q)
    }

    pub fn count(&self) -> u64 {
        self.cur.count() + self.prev.count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_monotonic_and_within_an_eighth() {
        let mut last = 0;
        for v in (0..100_000u64).chain([u64::MAX / 3, u64::MAX]) {
            let s = slot(v);
            assert!(s >= last && s < SLOTS, "{v}");
            last = s;
            let low = slot_low(s);
            assert!(
                low <= v && (v - low) as f64 <= v as f64 / 8.0,
                "{v} -> {low}"
            );
        }
    }

    #[test]
    fn quantiles() {
        let mut h = LogHistogram::default();
        for v in 1..=1000u64 {
            h.record(v * 1000);
        }
        let empty = LogHistogram::default();
        let p50 = h.quantile_with(&empty, 0.5);
        let p99 = h.quantile_with(&empty, 0.99);
        assert!((440_000..=500_000).contains(&p50), "{p50}");
        assert!((880_000..=990_000).contains(&p99), "{p99}");
        assert_eq!(empty.quantile_with(&empty, 0.5), 0);
    }

    #[test]
    fn rolling_forgets_after_two_windows() {
        let mut r = Rolling::default();
        r.record(1_000_000, 0, 100);
        r.record(10, 150, 100);
        assert_eq!(r.count(), 2);
        r.record(10, 260, 100);
        assert_eq!(r.count(), 2);
        assert_eq!(r.quantile(1.0), 10);
    }

    #[test]
    fn buckets_are_upper_inclusive() {
        let mut b = Buckets::new(&[1.0, 10.0]);
        for v in [0.5, 1.0, 5.0, 10.0, 11.0] {
            b.record(v);
        }
        assert_eq!(b.counts(), [2, 2, 1]);
        assert_eq!(b.count, 5);
    }
}
