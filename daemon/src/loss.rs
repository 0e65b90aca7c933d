//! The daemon's own loss stages (the `stage` label of `ncclscope_lost_total`, next to the plugin's
//! counters and the assembler's): one enum, so that a stage cannot be misspelt in one place and
//! exported under another name. Also what of the plugins' own counters (which each process writes
//! into its segment's header, so any user can forge its own) the node-wide totals take in
//! ([`PluginLosses`]).

use std::collections::HashMap;
use std::time::Instant;

use ncclscope_proto::segment::Counter;

macro_rules! stages {
    ($( $(#[$doc:meta])* $variant:ident => $name:literal, )*) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Loss {
            $( $(#[$doc])* $variant, )*
        }

        impl Loss {
            pub const ALL: &[Loss] = &[$( Loss::$variant ),*];

            /// The stage's name in metrics and the API.
            pub fn name(self) -> &'static str {
                match self {
                    $( Loss::$variant => $name, )*
                }
            }
        }
    };
}

stages! {
    /// A registration that did not hand over a sound segment (no descriptor, malformed, too small).
    SegmentInvalid => "segment_invalid",
    /// A segment handed over by a peer other than the uid that created it.
    SegmentForeign => "segment_foreign",
    /// A segment whose memory file is not sealed (its size could change under the daemon).
    SegmentUnsealed => "segment_unsealed",
    /// Segments refused because the daemon holds `drain.max_segments`.
    SegmentsRefused => "segments_refused",
    /// Segments refused because their uid holds `limits.max_segments_per_uid`.
    UidSegmentQuota => "uid_segment_quota",
    /// A segment whose memory file is attached already, handed over by another process (a forked
    /// child): one reader per ring, or its records would be counted twice.
    SegmentDuplicate => "segment_duplicate",
    /// Registration connections closed at accept because their uid held
    /// `register::MAX_CONNECTIONS_PER_UID`.
    UidConnectionQuota => "uid_connection_quota",
    /// Registration connections closed at accept because the daemon held `register::MAX_CONNECTIONS`.
    ConnectionsRefused => "connections_refused",
    /// A segment whose ring could not be read (a corrupt header or record words).
    CorruptSegment => "corrupt_segment",
    /// The spool could not be read back when a segment's resume state was checked against it.
    SpoolUnreadable => "spool_unreadable",
    /// A segment attached after a restart whose resume state is gone: read from its tail anew.
    ResumeStateMissing => "resume_state_missing",
    /// A resume state that could not be written (the tail then does not move).
    StateWriteFailed => "state_write_failed",
    /// Instances the spool could not take (a full disk, an I/O error).
    SpoolFailed => "spool_failed",
    /// Instances not spooled because the spool writer had `spool_writer::QUEUE_BATCHES` batches
    /// queued (a disk slower than ingest): ingest does not wait for it.
    SpoolBacklog => "spool_backlog",
    /// Instances refused at the exporter's queue (a slow or absent collector).
    ExportQueueFull => "export_queue_full",
    /// Instances whose spans the exporter gave up on (the receiver stayed away past its retries);
    /// counted by the exporter (`ExportCounters::spans_dropped`).
    ExportDropped => "export_dropped",
    /// Dropped instances that will not be re-sent: past the bound on those remembered, or no longer
    /// in the spool (`ExportCounters::not_resent`).
    ExportNotResent => "export_not_resent",
    /// Device-hook work items that joined nothing and were not counted under another stage
    /// (unattributed, ambiguous, p2p): the assembler's `dev_work` less those.
    DevUnjoined => "dev_unjoined",
    /// Instances left out of per-rank series past `limits.max_rank_series` (the statistics' count).
    RankSeriesLimit => "rank_series_limit",
    /// Root spans of graph replays' collectives a restarted daemon could not send again: read again
    /// without the node's rank 0, whose records (a replay's, read for the first time, do not wait on
    /// its root) were committed before the kill; the root may not have reached the receiver (the
    /// statistics' count, an upper bound: `stats::root_at_risk`).
    ReplayRootNotResent => "replay_root_not_resent",
    /// Spans whose records a forced commit (a ring over half full) passed before the receiver
    /// acknowledged them, still unacknowledged when the daemon was killed: its successor cannot
    /// send them again. Counted by the successor from the last saved state (an upper bound: those
    /// acknowledged after it was written count too).
    SpanNotResent => "span_not_resent",
    /// Root spans lost the same way (a forced commit passed their ranks' records before they
    /// settled), once per collective.
    RootNotResent => "root_not_resent",
}

/// A count per stage.
#[derive(Clone, Debug, Default)]
pub struct Losses([u64; Loss::ALL.len()]);

impl Losses {
    pub fn add(&mut self, stage: Loss, n: u64) {
        let c = &mut self.0[stage as usize];
        *c = c.saturating_add(n);
    }

    pub fn get(&self, stage: Loss) -> u64 {
        self.0[stage as usize]
    }

    /// (name, count) of every stage, zero ones included: each is exported from the start.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        Loss::ALL.iter().map(|&s| (s.name(), self.0[s as usize]))
    }
}

/// One segment's (or uid's) plugin counters, by [`Counter`].
pub type PluginCounts = [u64; Counter::ALL.len()];

/// How much one uid's plugin counters may have raised a node-wide stage, per second since its first
/// segment attached. Its owner writes a header counter, so a hostile user could raise it to 2^64 and
/// hold the node-wide figure there (another user's losses then change nothing Prometheus reads), or
/// make one jump: in the node-wide totals a uid counts at most this rate times how long it has been
/// here; past that its figure is taken in as time goes on (its own series,
/// `ncclscope_plugin_lost_total{uid,stage}`, is exact). With at most [`MAX_DETACHED_UIDS`] plus
/// `drain.max_segments` uids known at once (2,048 by default), a node-wide stage stays below 2^53
/// (where Prometheus's float64 still shows a change of one) for two years of every one of them
/// forging its counters; a real loss within the bound shows at once.
pub const UID_RATE_PER_SEC: u64 = 1 << 16;

/// Uids kept, with no segment attached, for their figures: past it, the one detached longest is
/// forgotten (what the node-wide totals took in from it stays there).
pub const MAX_DETACHED_UIDS: usize = 1024;

/// Each uid's plugin counters (those of its detached segments, summed) and what the node-wide totals
/// take in of them (see [`UID_RATE_PER_SEC`]).
#[derive(Default)]
pub struct PluginLosses {
    uids: HashMap<u32, UidCounts>,
    /// Taken in from uids forgotten.
    forgotten: PluginCounts,
}

struct UidCounts {
    /// Its segments that were detached, summed (saturating).
    detached: PluginCounts,
    /// Its first segment attached (since it was last forgotten).
    since: Instant,
    /// When its last segment was detached.
    detached_at: Instant,
}

impl PluginLosses {
    /// A segment of `uid` attached (from now on its counts may enter the node-wide totals).
    pub fn attached(&mut self, uid: u32) {
        let now = Instant::now();
        self.uids.entry(uid).or_insert(UidCounts {
            detached: [0; Counter::ALL.len()],
            since: now,
            detached_at: now,
        });
    }

    /// A segment of `uid` was detached with `counts`; `attached`: the uids still with a segment.
    pub fn detached(&mut self, uid: u32, counts: &PluginCounts, attached: &[u32]) {
        self.attached(uid);
        let u = self.uids.get_mut(&uid).expect("inserted above");
        for (d, v) in u.detached.iter_mut().zip(counts) {
            *d = d.saturating_add(*v);
        }
        u.detached_at = Instant::now();
        let idle = || self.uids.iter().filter(|(k, _)| !attached.contains(k));
        if idle().count() > MAX_DETACHED_UIDS
            && let Some((&old, _)) = idle().min_by_key(|(_, u)| u.detached_at)
        {
            let gone = self.uids.remove(&old).expect("listed above");
            let taken = taken_in(&gone.detached, gone.since, Instant::now());
            for (f, v) in self.forgotten.iter_mut().zip(taken) {
                *f = f.saturating_add(v);
            }
        }
    }

    /// Each known uid's counters: its detached segments' plus those of `attached` (a uid's attached
    /// segments, summed), saturating.
    pub fn by_uid(&self, attached: &HashMap<u32, PluginCounts>) -> HashMap<u32, PluginCounts> {
        let mut out: HashMap<u32, PluginCounts> =
            self.uids.iter().map(|(&k, u)| (k, u.detached)).collect();
        for (uid, counts) in attached {
            let sum = out.entry(*uid).or_insert([0; Counter::ALL.len()]);
            for (t, v) in sum.iter_mut().zip(counts) {
                *t = t.saturating_add(*v);
            }
        }
        out
    }

    /// The node-wide figure of each counter: what every uid's `by_uid` figure contributes within
    /// its bound, plus what forgotten uids contributed.
    pub fn node(&self, by_uid: &HashMap<u32, PluginCounts>, now: Instant) -> PluginCounts {
        let mut node = self.forgotten;
        for (uid, counts) in by_uid {
            let since = self.uids.get(uid).map_or(now, |u| u.since);
            for (n, v) in node.iter_mut().zip(taken_in(counts, since, now)) {
                *n = n.saturating_add(v);
            }
        }
        node
    }
}

/// What a uid's `counts`, here `since`, contribute to the node-wide totals at `now`.
fn taken_in(counts: &PluginCounts, since: Instant, now: Instant) -> PluginCounts {
    let bound = rate_bound(since, now, UID_RATE_PER_SEC);
    counts.map(|v| v.min(bound))
}

/// `per_sec` times the time from `since` to `now`: how much of one uid's count a node-wide figure
/// takes in by then.
fn rate_bound(since: Instant, now: Instant, per_sec: u64) -> u64 {
    let elapsed = now.saturating_duration_since(since).as_nanos();
    (elapsed * per_sec as u128 / 1_000_000_000).min(u64::MAX as u128) as u64
}

/// How many of one uid's refused registrations a node-wide stage takes in per second since its
/// first: any local user can open registration connections and send junk as fast as the daemon
/// answers (568,000 `segment_invalid` in 15 s), which buried another user's refused segment in the
/// node-wide figure. Its own series (`ncclscope_refused_total{uid,stage}`) is exact; a plugin
/// retrying a refused segment every 2 s, even a job's worth of them, stays within the bound.
pub const UID_REFUSALS_PER_SEC: u64 = 64;

/// Uids whose refusals are kept: past it, the one refused longest ago is forgotten (what the
/// node-wide figures took in from it stays there).
pub const MAX_REFUSED_UIDS: usize = 1024;

/// Registrations refused (segments and connections), per uid, and what the node-wide figures take
/// in of them (see [`UID_REFUSALS_PER_SEC`]).
#[derive(Default)]
pub struct Refusals {
    uids: HashMap<u32, UidRefusals>,
    /// Taken in from uids forgotten.
    forgotten: Losses,
}

struct UidRefusals {
    counts: Losses,
    /// Its first refusal (since it was last forgotten), and its latest.
    since: Instant,
    last: Instant,
}

impl Refusals {
    pub fn add(&mut self, uid: u32, stage: Loss) {
        let now = Instant::now();
        if !self.uids.contains_key(&uid)
            && self.uids.len() >= MAX_REFUSED_UIDS
            && let Some((&old, _)) = self.uids.iter().min_by_key(|(_, u)| u.last)
        {
            let gone = self.uids.remove(&old).expect("listed above");
            let bound = rate_bound(gone.since, now, UID_REFUSALS_PER_SEC).max(1);
            for &s in Loss::ALL {
                self.forgotten.add(s, gone.counts.get(s).min(bound));
            }
        }
        let u = self.uids.entry(uid).or_insert_with(|| UidRefusals {
            counts: Losses::default(),
            since: now,
            last: now,
        });
        u.counts.add(stage, 1);
        u.last = now;
    }

    /// Each kept uid's non-zero stages, exact.
    pub fn by_uid(&self) -> std::collections::BTreeMap<(u32, &'static str), u64> {
        let counts = self.uids.iter().flat_map(|(&uid, u)| {
            (u.counts.iter()).filter_map(move |(stage, n)| (n > 0).then_some(((uid, stage), n)))
        });
        counts.collect()
    }

    /// The node-wide figure of each stage at `now`: every uid's within its bound, plus what
    /// forgotten uids contributed. A first refusal shows at once (the bound starts at one).
    pub fn node(&self, now: Instant) -> Losses {
        let mut node = self.forgotten.clone();
        for u in self.uids.values() {
            let bound = rate_bound(u.since, now, UID_REFUSALS_PER_SEC).max(1);
            for &s in Loss::ALL {
                node.add(s, u.counts.get(s).min(bound));
            }
        }
        node
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_has_its_own_slot_and_name() {
        let mut l = Losses::default();
        for (i, &s) in Loss::ALL.iter().enumerate() {
            assert_eq!(s as usize, i);
            l.add(s, i as u64 + 1);
        }
        l.add(Loss::SpoolFailed, u64::MAX);
        let names: std::collections::BTreeSet<_> = l.iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), Loss::ALL.len(), "names are distinct");
        assert_eq!(l.get(Loss::SegmentForeign), 2);
        assert_eq!(l.get(Loss::SpoolFailed), u64::MAX, "saturating");
    }

    /// Issue 37: a forged header held the node-wide `ring_full` at 2^64 - 1 for the daemon's life
    /// (and `forward_panic` jumped by 10^6), so another user's real losses changed nothing
    /// Prometheus read. A uid now reaches the node-wide figure only at its bound per second here;
    /// another uid's loss shows in full.
    #[test]
    fn a_forged_counter_reaches_the_node_wide_figure_only_within_its_bound() {
        let (victim, hostile) = (1001, 1002);
        let mut p = PluginLosses::default();
        p.attached(victim);
        p.attached(hostile);
        let t0 = p.uids[&hostile].since.max(p.uids[&victim].since);
        let counts = |ring_full: u64, forward_panic: u64| {
            let mut c = [0; Counter::ALL.len()];
            c[Counter::RingFull as usize] = ring_full;
            c[Counter::ForwardPanic as usize] = forward_panic;
            c
        };
        let mut attached = HashMap::from([
            (victim, counts(7, 0)),
            (hostile, counts(u64::MAX - 3, 1_000_000)),
        ]);
        let at = |secs: u64| t0 + std::time::Duration::from_secs(secs);
        let ring_full = |p: &PluginLosses, a: &HashMap<u32, PluginCounts>, secs| {
            p.node(&p.by_uid(a), at(secs))[Counter::RingFull as usize]
        };
        let by_uid = p.by_uid(&attached);
        assert_eq!(
            by_uid[&hostile][Counter::RingFull as usize],
            u64::MAX - 3,
            "its own figure exact"
        );
        let node = p.node(&by_uid, at(1));
        assert_eq!(node[Counter::RingFull as usize], 7 + UID_RATE_PER_SEC);
        assert_eq!(
            node[Counter::ForwardPanic as usize],
            UID_RATE_PER_SEC,
            "not 10^6 at once"
        );
        // The victim loses 5 more: the node-wide figure shows them, next to the hostile uid's bound.
        let before = ring_full(&p, &attached, 2);
        attached.insert(victim, counts(12, 0));
        assert_eq!(ring_full(&p, &attached, 2) - before, 5);
        // Both processes end; the figures stay.
        p.detached(hostile, &attached[&hostile], &[victim]);
        p.detached(victim, &attached[&victim], &[]);
        attached.clear();
        assert_eq!(ring_full(&p, &attached, 2), 12 + 2 * UID_RATE_PER_SEC);
        assert_eq!(p.by_uid(&attached)[&victim][Counter::RingFull as usize], 12);
        // Two years on, every uid that can be known at once forging its counters: still below 2^53.
        let two_years = 2 * 365 * 86_400;
        let worst = 2048 * UID_RATE_PER_SEC * two_years;
        assert!(worst < 1 << 53, "{worst}");
        assert_eq!(
            ring_full(&p, &attached, two_years),
            12 + UID_RATE_PER_SEC * two_years
        );
    }

    /// Past [`MAX_DETACHED_UIDS`], the uid detached longest is forgotten: its series go, what it
    /// contributed to the node-wide figure stays.
    #[test]
    fn detached_uids_are_bounded_and_the_node_wide_figure_keeps_what_they_gave() {
        let mut p = PluginLosses::default();
        let mut one = [0; Counter::ALL.len()];
        one[Counter::QueueFull as usize] = 1;
        for uid in 0..=MAX_DETACHED_UIDS as u32 {
            p.attached(uid);
            std::thread::sleep(std::time::Duration::from_micros(20));
            p.detached(uid, &one, &[]);
        }
        let by_uid = p.by_uid(&HashMap::new());
        assert_eq!(by_uid.len(), MAX_DETACHED_UIDS);
        assert!(!by_uid.contains_key(&0), "the oldest is forgotten");
        let later = Instant::now() + std::time::Duration::from_secs(1);
        let node = p.node(&by_uid, later);
        assert_eq!(
            node[Counter::QueueFull as usize],
            MAX_DETACHED_UIDS as u64 + 1
        );
    }

    /// Issue 37: junk registrations raised the node-wide `segment_invalid` by 568 k in 15 s. Each
    /// uid's refusals are exact in its own series; the node-wide figure takes in each uid's at most
    /// [`UID_REFUSALS_PER_SEC`] since its first, and another uid's refusal shows there at once.
    #[test]
    fn one_uids_refusals_enter_the_node_wide_figure_only_within_its_bound() {
        let (hostile, victim) = (1002, 1001);
        let mut r = Refusals::default();
        let t0 = Instant::now();
        for _ in 0..100_000 {
            r.add(hostile, Loss::SegmentInvalid);
        }
        r.add(victim, Loss::SegmentInvalid);
        r.add(victim, Loss::SegmentForeign);
        let by_uid = r.by_uid();
        assert_eq!(by_uid[&(hostile, "segment_invalid")], 100_000, "exact");
        assert_eq!(by_uid[&(victim, "segment_invalid")], 1);
        assert_eq!(by_uid[&(victim, "segment_foreign")], 1);
        assert_eq!(by_uid.len(), 3, "non-zero stages only");
        let later = t0 + std::time::Duration::from_secs(2);
        let bound = rate_bound(t0, later, UID_REFUSALS_PER_SEC);
        let node = r.node(later);
        assert!(node.get(Loss::SegmentInvalid) <= bound + 1, "not 100,000");
        assert!(node.get(Loss::SegmentInvalid) >= 2 * UID_REFUSALS_PER_SEC);
        assert_eq!(node.get(Loss::SegmentForeign), 1, "the victim's, at once");
        let much_later = t0 + std::time::Duration::from_secs(3600);
        assert_eq!(r.node(much_later).get(Loss::SegmentInvalid), 100_001);
    }

    /// Past [`MAX_REFUSED_UIDS`], the uid refused longest ago is forgotten; what the node-wide
    /// figure took in from it stays.
    #[test]
    fn refusals_keep_a_bounded_set_of_uids() {
        let mut r = Refusals::default();
        for uid in 0..=MAX_REFUSED_UIDS as u32 {
            r.add(uid, Loss::SegmentUnsealed);
            if uid == 0 {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
        let by_uid = r.by_uid();
        assert_eq!(by_uid.len(), MAX_REFUSED_UIDS);
        assert!(!by_uid.contains_key(&(0, "segment_unsealed")), "the oldest");
        let node = r.node(Instant::now());
        assert_eq!(node.get(Loss::SegmentUnsealed), MAX_REFUSED_UIDS as u64 + 1);
    }
}
