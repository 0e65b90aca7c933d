//! The histogram shapes the daemon keeps. For export (never sampled, never reset), each series keeps
//! the same values twice ([`Distribution`]): classic buckets for Prometheus text, whose
//! `histogram_quantile` interpolates linearly inside a bucket, and base-2 exponential buckets for OTLP
//! (ExponentialHistogram) and Prometheus native histograms. Percentiles for `stats` and `top` come
//! from exponential buckets over a rolling window ([`Rolling`]), interpolated inside the bucket.

use crate::spans::RankSpan;

/// A value to record with its base-2 logarithm, which places it in every bucket layout here: taken
/// once per value, not once per histogram (a collective's time goes into four).
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    value: f64,
    log2: f64,
}

impl From<f64> for Sample {
    fn from(value: f64) -> Sample {
        Sample {
            value,
            log2: value.log2(),
        }
    }
}

/// `x.ceil()` inline: baseline x86-64 has no rounding instruction, and the libm call was a tenth of
/// the histograms' cost. At 2^52 and beyond (and for NaN and the infinities) `x` is its own ceiling.
fn ceil(x: f64) -> f64 {
    if x.abs() < (1u64 << 52) as f64 {
        let t = x as i64 as f64;
        if t < x { t + 1.0 } else { t }
    } else {
        x
    }
}

/// 2^`scale`, exactly (|scale| is small).
fn pow2(scale: i32) -> f64 {
    f64::from_bits(((1023 + scale) as u64) << 52)
}

/// Classic bucket bounds per doubling: a ratio of 2^(1/8) (1.09) keeps `histogram_quantile` within 9%
/// wherever the values sit inside a bucket (1-2-5 steps read an exec p99 83% high).
pub const CLASSIC_PER_DOUBLING: i32 = 8;

/// The classic bounds of one family: 2^(k/8) from `2^lo_exp` to `2^hi_exp`, then +Inf. They are
/// the bucket boundaries of a native histogram of schema 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub lo_exp: i32,
    pub hi_exp: i32,
}

impl Range {
    /// Finite bounds (buckets less the +Inf one).
    pub const fn bounds(self) -> usize {
        ((self.hi_exp - self.lo_exp) * CLASSIC_PER_DOUBLING + 1) as usize
    }
}

/// Execution time, microseconds: 1 us to 16.8 s (193 bounds).
pub const EXEC_US: Range = Range {
    lo_exp: 0,
    hi_exp: 24,
};
/// Bus bandwidth, GB/s: 61 KB/s (a small message's, waiting for a late rank) to 2048 GB/s (201
/// bounds).
pub const BUSBW_GBS: Range = Range {
    lo_exp: -14,
    hi_exp: 11,
};
/// Cross-rank skew, microseconds: 0.5 us to 1.05 s (169 bounds).
pub const SKEW_US: Range = Range {
    lo_exp: -1,
    hi_exp: 20,
};

/// Classic cumulative buckets over a [`Range`] (the last bucket is +Inf); `range.bounds() + 1`
/// counts, at most 202 (1.6 KiB).
#[derive(Clone, Debug, PartialEq)]
pub struct Buckets {
    pub range: Range,
    counts: Box<[u64]>,
}

impl Buckets {
    pub fn new(range: Range) -> Buckets {
        Buckets {
            range,
            counts: vec![0; range.bounds() + 1].into_boxed_slice(),
        }
    }

    pub fn record(&mut self, v: impl Into<Sample>) {
        let i = self.index(v.into());
        self.counts[i] += 1;
    }

    /// The bucket of `v`: the first bound >= v (upper bounds are inclusive). NaN and <= 0 land in
    /// the first bucket.
    fn index(&self, v: Sample) -> usize {
        let k = ceil(v.log2 * CLASSIC_PER_DOUBLING as f64);
        let first = (self.range.lo_exp * CLASSIC_PER_DOUBLING) as f64;
        (k - first).clamp(0.0, self.range.bounds() as f64) as usize
    }

    /// Upper bound of bucket `i`; `None` for +Inf.
    pub fn bound(&self, i: usize) -> Option<f64> {
        (i < self.range.bounds()).then(|| {
            let k = self.range.lo_exp * CLASSIC_PER_DOUBLING + i as i32;
            (k as f64 / CLASSIC_PER_DOUBLING as f64).exp2()
        })
    }

    /// Per-bucket (not cumulative) counts; one more than the bounds.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }
}

/// Scale of the exported exponential histograms: bucket boundaries 2^(1/32) apart, so a bucket's
/// midpoint is within 1.1% of any value in it.
pub const EXPORT_SCALE: i32 = 5;
/// Buckets of an exported exponential histogram: values over a range of 2^10 keep [`EXPORT_SCALE`];
/// a wider range halves the scale (OTLP's downscaling) rather than grow (2.5 KiB at most).
const EXPORT_MAX_BUCKETS: usize = 320;
/// Scale of the percentile histograms: boundaries 2^(1/128) (0.54%) apart while the window's values
/// span up to 256x, 2^(1/64) (1.1%) up to 65536x (fast collectives and a few waiting on a late rank);
/// interpolated inside the bucket, a percentile is within 1% over that unless its values crowd one
/// edge of a bucket.
const PERCENTILE_SCALE: i32 = 7;
/// Buckets of a percentile histogram (4 KiB at most, only for a window that wide). At 512, a window
/// spanning 3000x fell to 2.2% buckets and read a clustered p99.5 1.35% high.
const PERCENTILE_MAX_BUCKETS: usize = 1024;

/// A bucket counter: u64 for cumulative export, u32 (saturating) for rolling windows.
pub trait Count: Copy + Default + Into<u64> {
    fn add(&mut self, n: Self);
    fn one() -> Self;
}

impl Count for u32 {
    fn add(&mut self, n: u32) {
        *self = self.saturating_add(n);
    }
    fn one() -> u32 {
        1
    }
}

impl Count for u64 {
    fn add(&mut self, n: u64) {
        *self = self.saturating_add(n);
    }
    fn one() -> u64 {
        1
    }
}

/// A base-2 exponential histogram, as OTLP's ExponentialHistogram and Prometheus native
/// histograms define it: bucket `i` holds the values in (2^(i/2^scale), 2^((i+1)/2^scale)];
/// zero (and anything not above it) is counted apart. The buckets are the dense range between the
/// lowest and highest used, at most `max_buckets` long: a value beyond lowers the scale (merging
/// neighbours) until the range fits. Scale never needs to go below -4 (Prometheus' lowest
/// schema): 320 buckets of 2^16 cover every f64.
#[derive(Clone, Debug, PartialEq)]
pub struct Exponential<C: Count> {
    scale: i32,
    /// Index of `counts[0]`.
    offset: i32,
    counts: Vec<C>,
    max_buckets: usize,
    zero_count: u64,
    count: u64,
    sum: f64,
    min: f64,
    max: f64,
}

/// The bucket of a value (> 0) whose base-2 logarithm is `log2`, at `scale`. Infinity is counted as
/// `f64::MAX` (whose logarithm rounds to 1024).
fn index(log2: f64, scale: i32) -> i32 {
    let i = ceil(log2.min(1024.0) * pow2(scale)) - 1.0;
    i.clamp(i32::MIN as f64, i32::MAX as f64) as i32
}

impl<C: Count> Exponential<C> {
    fn with(scale: i32, max_buckets: usize) -> Exponential<C> {
        Exponential {
            scale,
            offset: 0,
            counts: Vec::new(),
            max_buckets,
            zero_count: 0,
            count: 0,
            sum: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }

    pub fn record(&mut self, v: impl Into<Sample>) {
        let Sample { value: v, log2 } = v.into();
        self.count += 1;
        self.sum += v;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        // Zero, and NaN (never recorded, but it must not index a bucket).
        if v <= 0.0 || v.is_nan() {
            self.zero_count += 1;
            return;
        }
        let mut i = index(log2, self.scale);
        if self.counts.is_empty() {
            self.offset = i;
            self.counts.push(C::one());
            return;
        }
        let top = self.offset + self.counts.len() as i32 - 1;
        let (lo, hi) = (self.offset.min(i) as i64, top.max(i) as i64);
        let mut shift = 0;
        while (hi >> shift) - (lo >> shift) + 1 > self.max_buckets as i64 {
            shift += 1;
        }
        if shift > 0 {
            self.downscale(shift);
            i >>= shift;
        }
        if i < self.offset {
            let grow = (self.offset - i) as usize;
            self.counts
                .splice(0..0, std::iter::repeat_n(C::default(), grow));
            self.offset = i;
        }
        let at = (i - self.offset) as usize;
        if at >= self.counts.len() {
            self.counts.resize(at + 1, C::default());
        }
        self.counts[at].add(C::one());
    }

    /// Lowers the scale by `shift`, merging each 2^shift neighbouring buckets into one.
    fn downscale(&mut self, shift: i32) {
        let offset = self.offset >> shift;
        let mut counts = vec![C::default(); ((self.top() >> shift) - offset + 1) as usize];
        for (j, c) in self.counts.iter().enumerate() {
            counts[(((self.offset + j as i32) >> shift) - offset) as usize].add(*c);
        }
        (self.scale, self.offset, self.counts) = (self.scale - shift, offset, counts);
    }

    fn top(&self) -> i32 {
        self.offset + self.counts.len() as i32 - 1
    }

    pub fn scale(&self) -> i32 {
        self.scale
    }

    /// Index of the first of [`Exponential::bucket_counts`].
    pub fn offset(&self) -> i32 {
        self.offset
    }

    pub fn bucket_counts(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.counts.iter().map(|&c| c.into())
    }

    pub fn zero_count(&self) -> u64 {
        self.zero_count
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// Smallest and largest value recorded (`None` when empty).
    pub fn min_max(&self) -> Option<(f64, f64)> {
        (self.count > 0).then_some((self.min, self.max))
    }

    /// The value at quantile `q` in [0, 1] of `parts` together (0 when they are empty): the bucket
    /// holding the nearest-rank value, interpolated geometrically inside it as if its values were
    /// spread evenly on a log scale, and kept within the smallest and largest value recorded.
    pub fn quantile_of(parts: &[&Exponential<C>], q: f64) -> f64 {
        let total: u64 = parts.iter().map(|p| p.count).sum();
        if total == 0 {
            return 0.0;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen: u64 = parts.iter().map(|p| p.zero_count).sum();
        if rank <= seen {
            return 0.0;
        }
        let used = parts.iter().filter(|p| !p.counts.is_empty());
        let scale = used.clone().map(|p| p.scale).min().unwrap_or(0);
        let at = |p: &Exponential<C>, i: i32| i >> (p.scale - scale);
        let lo = used.clone().map(|p| at(p, p.offset)).min().unwrap_or(0);
        let hi = used.clone().map(|p| at(p, p.top())).max().unwrap_or(0);
        let mut merged = vec![0u64; (hi - lo + 1) as usize];
        for p in used {
            for (j, c) in p.counts.iter().enumerate() {
                merged[(at(p, p.offset + j as i32) - lo) as usize] += (*c).into();
            }
        }
        let (min, max) = parts
            .iter()
            .filter_map(|p| p.min_max())
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (lo, hi)| {
                (a.min(lo), b.max(hi))
            });
        for (k, &n) in merged.iter().enumerate() {
            if n == 0 || seen + n < rank {
                seen += n;
                continue;
            }
            // The rank's place among the bucket's values, each at the middle of its share.
            let frac = ((rank - seen) as f64 - 0.5) / n as f64;
            let v = ((lo + k as i32) as f64 + frac) / (scale as f64).exp2();
            return v.exp2().clamp(min, max);
        }
        max
    }
}

/// A value with the rank span it was measured in: a classic bucket's link to a trace (Prometheus
/// exemplars, Grafana's drill-down from a histogram to Tempo).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Exemplar {
    pub span: RankSpan,
    pub value: f64,
    pub unix_ns: u64,
}

/// What one exported series keeps of its values: classic and exponential buckets, and the latest
/// exemplar of each classic bucket that has one.
#[derive(Clone, Debug, PartialEq)]
pub struct Distribution {
    pub classic: Buckets,
    pub exponential: Exponential<u64>,
    /// By classic bucket index, ascending; at most one per bucket.
    exemplars: Vec<(u16, Exemplar)>,
}

impl Distribution {
    pub fn new(range: Range) -> Distribution {
        Distribution {
            classic: Buckets::new(range),
            exponential: Exponential::with(EXPORT_SCALE, EXPORT_MAX_BUCKETS),
            exemplars: Vec::new(),
        }
    }

    /// Records `e.value` and makes `e` its bucket's exemplar. Replacing one allocates nothing; the
    /// list grows only when a bucket gets its first (at most one entry per bucket, 48 bytes each).
    pub fn record_exemplar(&mut self, e: Exemplar) {
        let v = Sample::from(e.value);
        self.record(v);
        let i = self.classic.index(v) as u16;
        match self.exemplars.binary_search_by_key(&i, |x| x.0) {
            Ok(at) => self.exemplars[at].1 = e,
            Err(at) => self.exemplars.insert(at, (i, e)),
        }
    }

    /// Every bucket's exemplar, in bucket order.
    pub fn exemplars(&self) -> impl Iterator<Item = &Exemplar> {
        self.exemplars.iter().map(|x| &x.1)
    }

    /// The exemplar of classic bucket `i`, if it has one.
    pub fn exemplar(&self, i: usize) -> Option<&Exemplar> {
        let at = (self.exemplars).binary_search_by_key(&i, |x| x.0 as usize);
        at.ok().map(|at| &self.exemplars[at].1)
    }

    pub fn record(&mut self, v: impl Into<Sample>) {
        let v = v.into();
        self.classic.record(v);
        self.exponential.record(v);
    }

    pub fn count(&self) -> u64 {
        self.exponential.count
    }

    pub fn sum(&self) -> f64 {
        self.exponential.sum
    }
}

/// A percentile histogram over a sliding window of between one and two `window_ns`.
#[derive(Clone, Debug)]
pub struct Rolling {
    cur: Exponential<u32>,
    prev: Exponential<u32>,
    cur_since_ns: u64,
}

impl Default for Rolling {
    fn default() -> Rolling {
        let empty = Exponential::with(PERCENTILE_SCALE, PERCENTILE_MAX_BUCKETS);
        Rolling {
            cur: empty.clone(),
            prev: empty,
            cur_since_ns: 0,
        }
    }
}

impl Rolling {
    pub fn record(&mut self, v: impl Into<Sample>, now_ns: u64, window_ns: u64) {
        if now_ns.saturating_sub(self.cur_since_ns) >= window_ns {
            let empty = Exponential::with(PERCENTILE_SCALE, PERCENTILE_MAX_BUCKETS);
            self.prev = std::mem::replace(&mut self.cur, empty);
            self.cur_since_ns = now_ns;
        }
        self.cur.record(v);
    }

    pub fn quantile(&self, q: f64) -> f64 {
        Exponential::quantile_of(&[&self.cur, &self.prev], q)
    }

    pub fn count(&self) -> u64 {
        self.cur.count + self.prev.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nearest-rank quantile of `values` (sorted): what the histograms estimate.
    fn exact(values: &[f64], q: f64) -> f64 {
        let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
        values[rank - 1]
    }

    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / b
    }

    /// Deterministic values spread over `decades` (log-uniform), plus a bimodal cluster.
    fn values(n: usize, decades: f64) -> Vec<f64> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut out: Vec<f64> = (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 11) as f64 / (1u64 << 53) as f64;
                if i % 4 == 0 {
                    1680.0 + 20.0 * u
                } else {
                    4100.0 * 10f64.powf(decades * u)
                }
            })
            .collect();
        out.sort_by(f64::total_cmp);
        out
    }

    #[test]
    fn exponential_buckets_are_upper_inclusive_and_bounded() {
        let mut h = Exponential::<u64>::with(0, 4);
        for v in [1.0, 2.0, 3.0, 4.0] {
            h.record(v);
        }
        // (0.5, 1], (1, 2], (2, 4]
        assert_eq!(
            (h.offset(), h.bucket_counts().collect::<Vec<_>>()),
            (-1, vec![1, 1, 2])
        );
        h.record(100.0);
        assert_eq!(
            h.scale(),
            -2,
            "(2^-1, 2^7] fits 4 buckets of 16, not of 2 or 4"
        );
        assert_eq!(h.bucket_counts().sum::<u64>(), 5);
        assert!(h.bucket_counts().len() <= 4);
        h.record(0.0);
        assert_eq!((h.zero_count(), h.count()), (1, 6));
        let mut wide = Exponential::<u64>::with(EXPORT_SCALE, EXPORT_MAX_BUCKETS);
        for v in [f64::MIN_POSITIVE, 1.0, f64::MAX, f64::INFINITY] {
            wide.record(v);
        }
        assert!(wide.scale() >= -4 && wide.bucket_counts().len() <= EXPORT_MAX_BUCKETS);
    }

    #[test]
    fn percentiles_are_within_a_percent() {
        for decades in [0.05, 0.5, 2.0] {
            let v = values(20_000, decades);
            let mut r = Rolling::default();
            for &x in &v {
                r.record(x, 0, u64::MAX);
            }
            for q in [0.01, 0.5, 0.9, 0.99, 0.999] {
                let (got, want) = (r.quantile(q), exact(&v, q));
                assert!(
                    rel(got, want) < 0.01,
                    "{decades} decades, q {q}: {got} vs {want}"
                );
            }
        }
        let empty = Rolling::default();
        assert_eq!(empty.quantile(0.5), 0.0);
    }

    /// A window whose values span 1000x (most collectives fast, a few waiting on a late rank) with
    /// its tail in a tight cluster: the tail's percentiles come from one bucket, where the values
    /// are not spread as the interpolation assumes, so the bucket itself must be narrow.
    #[test]
    fn a_clustered_tail_over_a_wide_range_is_within_a_percent() {
        let mut v: Vec<f64> = (0..9_800).map(|i| 10.0 + (i % 97) as f64 * 0.05).collect();
        v.extend((0..200).map(|i| 10_000.0 + (i % 7) as f64));
        v.extend((0..20).map(|i| 30_000.0 + i as f64));
        v.sort_by(f64::total_cmp);
        let mut r = Rolling::default();
        for &x in &v {
            r.record(x, 0, u64::MAX);
        }
        for q in [0.5, 0.985, 0.99, 0.995] {
            let (got, want) = (r.quantile(q), exact(&v, q));
            assert!(rel(got, want) < 0.01, "q {q}: {got} vs {want}");
        }
    }

    #[test]
    fn exported_quantiles_are_within_the_bucket_width() {
        let v = values(20_000, 0.5);
        let mut d = Distribution::new(EXEC_US);
        for &x in &v {
            d.record(x);
        }
        assert_eq!(d.exponential.scale(), EXPORT_SCALE);
        let width = (EXPORT_SCALE as f64).exp2().recip().exp2() - 1.0;
        for q in [0.5, 0.99] {
            let got = Exponential::quantile_of(&[&d.exponential], q);
            assert!(rel(got, exact(&v, q)) < width, "q {q}: {got}");
        }
        assert_eq!(d.classic.counts().iter().sum::<u64>(), d.count());
    }

    #[test]
    fn rolling_forgets_after_two_windows() {
        let mut r = Rolling::default();
        r.record(1_000_000.0, 0, 100);
        r.record(10.0, 150, 100);
        assert_eq!(r.count(), 2);
        r.record(10.0, 260, 100);
        assert_eq!(r.count(), 2);
        assert_eq!(r.quantile(1.0), 10.0);
    }

    #[test]
    fn classic_buckets_are_upper_inclusive() {
        let mut b = Buckets::new(Range {
            lo_exp: 0,
            hi_exp: 1,
        });
        // Bounds 1, 2^(1/8), ..., 2, +Inf.
        assert_eq!(
            (b.bound(0), b.bound(8), b.bound(9)),
            (Some(1.0), Some(2.0), None)
        );
        for v in [0.5, 1.0, 1.05, 2.0, 2.5] {
            b.record(v);
        }
        let c = b.counts();
        assert_eq!(
            (c[0], c[1], c[8], c[9], c.iter().sum::<u64>()),
            (2, 1, 1, 1, 5)
        );
    }

    /// The inline ceiling is libm's for every value a histogram can be given (the bucket of each
    /// value is what it was with `f64::ceil`).
    #[test]
    fn inline_ceil_is_ceil() {
        let mut xs = vec![
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.0,
            -1.0,
            1e-300,
            -1e-300,
            4503599627370495.5,
        ];
        xs.extend([
            2f64.powi(52),
            2f64.powi(60),
            -2f64.powi(60),
            f64::MAX,
            f64::MIN,
        ]);
        xs.extend([f64::INFINITY, f64::NEG_INFINITY]);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Any bit pattern: every exponent, sign and mantissa.
            xs.push(f64::from_bits(x));
            // And values near the bucket boundaries the callers compute.
            let b = (x % 4096) as f64 / 8.0 - 256.0;
            xs.extend([b, b.next_up(), b.next_down()]);
        }
        for x in xs {
            let (ours, libm) = (ceil(x), x.ceil());
            assert!(ours == libm || (ours.is_nan() && libm.is_nan()), "{x:e}");
        }
    }
}
