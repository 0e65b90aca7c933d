//! Statistics over completed instances, across every process on the node: per (uid, job,
//! communicator, collective, size bucket, algorithm and protocol, NCCL Inspector's message-size
//! range) and per (uid, job, communicator, rank), plus the cross-rank
//! skew and the straggler of each collective among this node's ranks of one uid. The uid is the one the
//! kernel reported at registration; job id and communicator hash are whatever the segment says, so
//! another user's process claiming them lands in its own series, never in the claimed one. Bounded: the series count is capped and the
//! skew rendezvous holds a bounded window of recent collectives.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ncclscope_proto::TimingSource;
use ncclscope_proto::api::{CollStats, P2pStats, RankStats};

use crate::bandwidth;
use crate::histogram::{BUSBW_GBS, Distribution, EXEC_US, Exemplar, Rolling, SKEW_US, Sample};
use crate::instance::{InstanceRef, Shared};
use crate::peers::{Direction, Peers, Transfer};
use crate::spans;
use ncclscope_proto::api::LiveSpans;

/// Label of the series that absorbs everything beyond `max_series`.
pub const OVERFLOW_BUCKET: &str = "other";
/// Collectives of one communicator awaited at once for the skew computation.
const MAX_WINDOW: usize = 65_536;
/// Collectives awaited at once over all communicators (a slot is at most 64 bytes, plus its
/// arrivals): a window grows past its share only while the others leave room.
const MAX_SLOTS: usize = 1 << 20;
/// Collectives that start this long before a host clock step ([`Stats::clock_stepped`]) or this
/// long after it, on the clock before or after it, are left out of the skew: the processes
/// recalibrate every 5 s and re-anchor their host clock within 1 s.
const STEP_BEFORE_NS: u64 = 1_000_000_000;
const STEP_AFTER_NS: u64 = 10_000_000_000;
/// Clock steps remembered.
const MAX_STEPS: usize = 8;
/// How far before its first collective a window opens back for a late first arrival.
const MAX_BACK: usize = 64;
/// Collectives whose rendezvous the skew window closed while a local rank was still missing, kept
/// at most this many and this long: rank 0 coming late carries the root over the ranks that came (a
/// graph replay's instances may wait on held work items for seconds), and a rank coming after the
/// root went finds that it did.
const MAX_LATE: usize = 16_384;
const LATE_NS: u64 = 30_000_000_000;
/// Samples between recomputations of a series' cached p50.
const P50_EVERY: u32 = 256;

/// hashbrown rather than std: its maps are looked up by the instance's borrowed strings
/// ([`SeriesRef`], [`RankRef`]), so a known series costs no allocation or reference count.
type Map<K, V> = hashbrown::HashMap<K, V, foldhash::fast::RandomState>;
use hashbrown::hash_map::RawEntryMut;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeriesKey {
    pub uid: u32,
    pub job: Arc<str>,
    pub comm_hash: u64,
    pub func: Arc<str>,
    pub size_bucket: &'static str,
    /// NCCL's algorithm and protocol (`RING`, `LL`; "" where the record has none) and the lower
    /// bound of NCCL Inspector's message-size range ([`bandwidth::message_size_range`]): Inspector's
    /// Prometheus series are keyed by these, so ours are too.
    pub algo: Arc<str>,
    pub proto: Arc<str>,
    pub message_size: u64,
}

/// A [`SeriesKey`] borrowed from an instance; same fields in the same order, so the same hash.
#[derive(Hash)]
struct SeriesRef<'a> {
    uid: u32,
    job: &'a str,
    comm_hash: u64,
    func: &'a str,
    size_bucket: &'static str,
    algo: &'a str,
    proto: &'a str,
    message_size: u64,
}

impl hashbrown::Equivalent<SeriesKey> for SeriesRef<'_> {
    fn equivalent(&self, k: &SeriesKey) -> bool {
        (
            self.comm_hash,
            self.uid,
            self.size_bucket,
            self.message_size,
            self.func,
            self.job,
            self.algo,
            self.proto,
        ) == (
            k.comm_hash,
            k.uid,
            k.size_bucket,
            k.message_size,
            &*k.func,
            &*k.job,
            &*k.algo,
            &*k.proto,
        )
    }
}

#[derive(Clone, Debug)]
pub struct Series {
    /// The communicator's size, nodes and name (NCCL's `commName`, "" without one), as its first
    /// instance gave them: labels NCCL Inspector's dashboards filter on.
    pub nnodes: u32,
    pub nranks: u32,
    pub comm_name: Arc<str>,
    pub exec_us: Distribution,
    pub busbw_gbs: Distribution,
    rolling_exec_ns: Rolling,
    rolling_busbw_gbs: Rolling,
    p50_exec_ns: u64,
    p50_age: u32,
    /// Daemon time of the latest instance, for evicting series of finished jobs.
    last_ns: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankKey {
    pub uid: u32,
    pub job: Arc<str>,
    pub comm_hash: u64,
    pub rank: u32,
}

/// A [`RankKey`] borrowed from an instance (same hash).
#[derive(Hash)]
struct RankRef<'a> {
    uid: u32,
    job: &'a str,
    comm_hash: u64,
    rank: u32,
}

impl hashbrown::Equivalent<RankKey> for RankRef<'_> {
    fn equivalent(&self, k: &RankKey) -> bool {
        (self.comm_hash, self.rank, self.uid, self.job) == (k.comm_hash, k.rank, k.uid, &*k.job)
    }
}

/// How many series and rank series a job has.
#[derive(Clone, Copy, Debug, Default)]
struct JobSeries {
    series: usize,
    ranks: usize,
}

/// A job's key in the per-job counts, borrowed (hashes as `(u32, Arc<str>)`).
#[derive(Hash)]
struct JobRef<'a>(u32, &'a str);

impl hashbrown::Equivalent<(u32, Arc<str>)> for JobRef<'_> {
    fn equivalent(&self, k: &(u32, Arc<str>)) -> bool {
        (self.0, self.1) == (k.0, &*k.1)
    }
}

fn job_entry<'a>(
    per_job: &'a mut Map<(u32, Arc<str>), JobSeries>,
    uid: u32,
    job: &str,
) -> &'a mut JobSeries {
    per_job
        .raw_entry_mut()
        .from_key(&JobRef(uid, job))
        .or_insert_with(|| ((uid, job.into()), JobSeries::default()))
        .1
}

#[derive(Clone, Debug)]
pub struct RankSeries {
    /// The rank's GPU as its latest instance gave it: labels that join DCGM exporter's series.
    pub gpu: Option<ncclscope_proto::Gpu>,
    /// The rank's Kubernetes pod as its latest instance gave it: labels that join
    /// kube-state-metrics' (and DCGM exporter's pod labels).
    pub pod: ncclscope_proto::segment::Pod,
    pub collectives: u64,
    /// Sum of those instances' exec times (us): with `collectives`, the rank's mean exec time, which
    /// compares across nodes (a duration on the rank's own GPU clock): a late rank waits least.
    pub exec_us_sum: f64,
    /// Instances timed on the GPU: those `exec_us_sum` sums.
    pub timed: u64,
    pub skew_us: Distribution,
    /// Collectives in which this rank's kernels started last / ended last among the node's ranks.
    pub last_to_start: u64,
    pub last_to_end: u64,
    /// In the rank's latest collective evaluated with other ranks of this node: the longest exec
    /// time (kernel start to end) among them less its own. A late rank waits least, so it reads about its delay; a node
    /// whose ranks are all late reads ~0 (node-local).
    pub local_lateness_ns: Option<u64>,
    rolling_exec_ns: Rolling,
    rolling_skew_ns: Rolling,
    last_ns: u64,
    /// Earliest and latest end time of this rank's collectives (a job's span, over its ranks).
    first_end_ns: u64,
    last_end_ns: u64,
    /// Its sends and receives per peer.
    pub peers: Peers,
}

#[derive(Clone, Copy)]
struct Arrival {
    rank: u32,
    start: u64,
    end: u64,
    /// Its rank span is sent: the root covers it.
    sent: bool,
}

/// What [`Stats::observe`] decided for an instance.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    pub live_spans: LiveSpans,
    /// (start, end) of the collective's root span, when this instance carries it: the last of the
    /// node's ranks to complete the collective carries it (or rank 0 coming after the skew window
    /// closed), on the node of rank 0 and only if rank 0's span is sent; it covers the rank spans
    /// this node sends (earliest start to latest end).
    pub trace_root: Option<(u64, u64)>,
    /// The rank's node-local lateness (see [`RankSeries::local_lateness_ns`]), for a sent span.
    pub local_lateness_ns: Option<u64>,
    /// Whether the root span of the collective the instance met its node's other ranks in is
    /// settled: the instance's records must stay uncommitted until it is (see [`RootWait`]).
    pub root_wait: Option<RootWait>,
}

/// Whether a collective's root span is settled: sent and acknowledged by the receiver (or given up
/// and counted as `export_dropped`), or known not to come from this node. The root depends on every
/// local rank's instance that met it, so each of them keeps its records uncommitted until then: a
/// daemon killed before reads them all again and meets them again (the root at least once;
/// [`Stats::rejoin`]). Every one settles within the skew window and the export's retries: a
/// collective whose local ranks did not all come in time sends its root with those that did
/// ([`Stats::take_roots_due`]), or, without rank 0, settles (rank 0's instance carries the root
/// alone when it comes).
#[derive(Clone, Debug, Default)]
pub struct RootWait(Arc<RootFlags>);

#[derive(Debug, Default)]
struct RootFlags {
    settled: AtomicBool,
    /// A segment's tail passed the records of one of its ranks before it settled (a forced
    /// commit): that segment counts it while it is at risk (once, whichever ranks' tails pass it).
    passed: AtomicBool,
}

impl RootWait {
    pub fn settle(&self) {
        self.0.settled.store(true, Ordering::Release);
    }

    pub fn settled(&self) -> bool {
        self.0.settled.load(Ordering::Acquire)
    }

    /// Marks the root passed by a commit before it settled; whether this is the first to.
    pub fn pass(&self) -> bool {
        !self.0.passed.swap(true, Ordering::AcqRel)
    }
}

impl PartialEq for RootWait {
    fn eq(&self, other: &RootWait) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The local ranks' arrivals for one collective.
struct Rendezvous {
    arrivals: Vec<Arrival>,
    opened_ns: u64,
    /// A rank started it near a host clock step: its skew would be the step's (not evaluated).
    near_step: bool,
    /// An instance re-read after a restart met it: the daemon that recorded that instance may have
    /// counted the skew already (not evaluated).
    rejoined: bool,
    root: RootWait,
    /// Rank 0's instance, without its channels, once it came with its span sent and others were
    /// still awaited: what sends the root if the skew window closes first.
    rank0: Option<Box<Shared>>,
}

/// One communicator's collectives of one type awaiting their local ranks, by seq: slot `k` is seq
/// `base + k` (NCCL numbers a communicator's collectives of each type densely, `seqNumber[func]`, and
/// each rank reports them in order), so an arrival finds its collective by index rather than
/// through a hash table.
struct Window {
    job: Arc<str>,
    base: u64,
    slots: VecDeque<Option<Rendezvous>>,
}

pub struct Stats {
    window_ns: u64,
    skew_window_ns: u64,
    max_series: usize,
    pub series: Map<SeriesKey, Series>,
    pub ranks: Map<RankKey, RankSeries>,
    /// Skew windows by (uid, communicator hash, collective type ([`crate::spans::type_key`]), replay):
    /// eager collectives (replay 0) of a type in one window, each graph replay's in its own (its seqs
    /// are the captured operations').
    windows: Map<(u32, u64, u64, u32), Window>,
    /// Ranks of each (uid, communicator) attached on this node (how many arrivals a rendezvous awaits).
    local_ranks: Map<(u32, u64), usize>,
    /// Job and collective name of the overflow series.
    none: Arc<str>,
    pub folded: u64,
    pub skew_evaluated: u64,
    /// (from, until) of the start times near each recent host clock step, on either clock.
    steps: VecDeque<(u64, u64)>,
    /// Collectives left out of the skew because a rank started them near a clock step.
    pub skew_clock_step: u64,
    /// Rank series at most (`limits.max_rank_series`); instances of further ranks are counted here
    /// and left out of the per-rank statistics and skew.
    max_ranks: usize,
    pub rank_series_refused: u64,
    /// Series and rank series one job may have (`limits.max_job_series`): a job that creates
    /// series without end fills its own share, not the room of every other job.
    max_job_series: usize,
    per_job: Map<(u32, Arc<str>), JobSeries>,
    /// Slots of every window.
    slots: usize,
    /// The arrivals of collectives evaluated before every local rank arrived, by (uid,
    /// communicator, type, replay, seq), with when, and whether their root went.
    late: Late,
    /// Root spans of collectives the skew window closed before every local rank came, each with
    /// the settlement its ranks' records wait on: for the engine to send.
    roots_due: Vec<(Shared, RootWait)>,
    /// Roots of graph replays' collectives a restart may have lost ([`root_at_risk`]).
    pub replay_roots_not_resent: u64,
}

/// [`Stats`]'s late collectives: (uid, communicator, type, replay, seq) -> (arrivals, when kept,
/// whether the root was sent).
type Late = Map<(u32, u64, u64, u32, u64), (Vec<Arrival>, u64, bool)>;

impl Stats {
    pub fn new(window_ns: u64, skew_window_ns: u64, max_series: usize) -> Stats {
        Stats {
            window_ns,
            skew_window_ns,
            max_series,
            series: Map::default(),
            ranks: Map::default(),
            windows: Map::default(),
            late: Map::default(),
            roots_due: Vec::new(),
            replay_roots_not_resent: 0,
            local_ranks: Map::default(),
            none: "".into(),
            folded: 0,
            skew_evaluated: 0,
            steps: VecDeque::new(),
            skew_clock_step: 0,
            max_ranks: usize::MAX,
            rank_series_refused: 0,
            max_job_series: usize::MAX,
            per_job: Map::default(),
            slots: 0,
        }
    }

    /// Caps the rank series (see [`Stats::rank_series_refused`]).
    pub fn with_rank_limit(mut self, max_ranks: usize) -> Stats {
        self.max_ranks = max_ranks;
        self
    }

    /// Caps the series and the rank series of each job.
    pub fn with_job_limit(mut self, max_job_series: usize) -> Stats {
        self.max_job_series = max_job_series;
        self
    }

    pub fn set_local_ranks(&mut self, local_ranks: HashMap<(u32, u64), usize>) {
        self.local_ranks = local_ranks.into_iter().collect();
    }

    /// Records `c` and returns what the live export sends of it: `decide` gets its series' rolling
    /// p50 exec time before `c`, once the series has `min_samples` (for the slow-outlier sampling
    /// decision), and `c`'s [`spans::instance_key`]. An instance whose spans are sent becomes its
    /// exec-time bucket's exemplar.
    pub fn observe(
        &mut self,
        c: InstanceRef,
        now_ns: u64,
        min_samples: u64,
        decide: impl FnOnce(Option<u64>, u64) -> LiveSpans,
    ) -> Observed {
        self.observe_read(c, now_ns, min_samples, false, decide)
    }

    /// [`Self::observe`], for an instance a daemon before a restart may have read (`again`): not
    /// recorded by it (killed before its spool had it), so counted here, but it meets its
    /// collective's ranks as a re-read one does ([`Self::rejoin`]): the others may be gone with the
    /// previous daemon, and a graph replay's root it carried may be lost (`root_at_risk`).
    pub fn observe_read(
        &mut self,
        c: InstanceRef,
        now_ns: u64,
        min_samples: u64,
        again: bool,
        decide: impl FnOnce(Option<u64>, u64) -> LiveSpans,
    ) -> Observed {
        let window = self.window_ns;
        let type_key = spans::type_key(c.func());
        let key = spans::instance_key_typed(c, type_key);
        let exec_ns = Sample::from(c.exec_ns as f64);
        // Host-timed instances are counted; they have no exec time to record (see build.rs).
        let timed = c.timing_source != TimingSource::Host;
        let live = self.with_series(c, now_ns, |s| {
            // A settled p50 moves slowly: once the series has a few windows' worth of samples,
            // recompute it every P50_EVERY samples rather than on every instance.
            if s.p50_age >= P50_EVERY || s.rolling_exec_ns.count() < 4 * P50_EVERY as u64 {
                s.p50_exec_ns = s.rolling_exec_ns.quantile(0.5).round() as u64;
                s.p50_age = 0;
            }
            s.p50_age += 1;
            s.last_ns = now_ns;
            let p50 = (s.rolling_exec_ns.count() >= min_samples).then_some(s.p50_exec_ns);
            let live = decide(p50, key);
            if !timed {
                return live;
            }
            let exec_us = c.exec_ns as f64 / 1000.0;
            if live == LiveSpans::None {
                s.exec_us.record(exec_us);
            } else {
                s.exec_us.record_exemplar(Exemplar {
                    span: spans::RankSpan {
                        uid: c.uid(),
                        comm_hash: c.comm_hash,
                        key,
                        rank: c.rank,
                    },
                    value: exec_us,
                    unix_ns: c.end_unix_ns,
                });
            }
            s.rolling_exec_ns.record(exec_ns, now_ns, window);
            if c.exec_ns > 0 {
                let busbw = Sample::from(c.busbw_gbs);
                s.busbw_gbs.record(busbw);
                s.rolling_busbw_gbs.record(busbw, now_ns, window);
            }
            live
        });
        let rank = RankRef {
            uid: c.uid(),
            job: c.job_id(),
            comm_hash: c.comm_hash,
            rank: c.rank,
        };
        let at_limit = self.ranks.len() >= self.max_ranks;
        let entry = self.ranks.raw_entry_mut().from_key(&rank);
        if let RawEntryMut::Vacant(_) = entry {
            let job = job_entry(&mut self.per_job, rank.uid, rank.job);
            if at_limit || job.ranks >= self.max_job_series {
                self.rank_series_refused += 1;
                return Observed {
                    live_spans: live,
                    trace_root: None,
                    local_lateness_ns: None,
                    root_wait: None,
                };
            }
            job.ranks += 1;
        }
        let (_, r) = entry.or_insert_with(|| {
            let key = RankKey {
                uid: c.uid(),
                job: c.job_id().into(),
                comm_hash: c.comm_hash,
                rank: c.rank,
            };
            let series = RankSeries {
                gpu: None,
                pod: Default::default(),
                collectives: 0,
                exec_us_sum: 0.0,
                timed: 0,
                skew_us: Distribution::new(SKEW_US),
                last_to_start: 0,
                last_to_end: 0,
                local_lateness_ns: None,
                rolling_exec_ns: Rolling::default(),
                rolling_skew_ns: Rolling::default(),
                last_ns: now_ns,
                first_end_ns: c.end_unix_ns,
                last_end_ns: c.end_unix_ns,
                peers: Peers::default(),
            };
            (key, series)
        });
        r.gpu = c.gpu;
        if r.pod != *c.pod() {
            r.pod = c.pod().clone();
        }
        r.collectives += 1;
        r.exec_us_sum += c.exec_ns as f64 / 1000.0;
        r.last_ns = now_ns;
        r.first_end_ns = r.first_end_ns.min(c.end_unix_ns);
        r.last_end_ns = r.last_end_ns.max(c.end_unix_ns);
        if timed {
            r.timed += 1;
            r.rolling_exec_ns.record(exec_ns, now_ns, window);
        }
        if let Some(direction) = Direction::of(c.func()).filter(|_| c.desc.is_p2p) {
            let transfer = Transfer {
                direction,
                peer: c.desc.peer,
                bytes: c.bytes,
                exec_ns: c.exec_ns,
                device_timed: timed,
            };
            r.peers.record(transfer, now_ns, window);
        }
        let local_lateness_ns =
            (r.local_lateness_ns).filter(|_| live != LiveSpans::None && !c.desc.is_p2p);
        Observed {
            local_lateness_ns,
            ..self.meet(c, type_key, now_ns, live, again)
        }
    }

    /// An instance re-read after a restart, which the daemon that recorded it counted: it only meets
    /// its collective's other local ranks again (whose records waited for the root as its did), so
    /// that the last of them carries the root again. `live`: what the live export sends of it.
    pub fn rejoin(&mut self, c: InstanceRef, now_ns: u64, live: LiveSpans) -> Observed {
        self.meet(c, spans::type_key(c.func()), now_ns, live, true)
    }

    /// `c` meets the node's other ranks of its collective: the root span it carries, if any, and
    /// the root's settlement it waits on.
    fn meet(
        &mut self,
        c: InstanceRef,
        type_key: u64,
        now_ns: u64,
        live: LiveSpans,
        rejoined: bool,
    ) -> Observed {
        // Skew needs at least two of the collective's ranks on this node.
        let local = self
            .local_ranks
            .get(&(c.uid(), c.comm_hash))
            .copied()
            .unwrap_or(0);
        let sent = live != LiveSpans::None;
        // Without kernel times a rank meets no other (nor its root: it has none). Alone on its node,
        // rank 0 carries its own root in its own export, which its records wait on anyway.
        let (trace_root, root_wait) = match (
            c.desc.is_p2p || c.timing_source == TimingSource::Host,
            local >= 2,
        ) {
            (true, _) => (None, None),
            (false, true) => self.arrive(c, type_key, local, now_ns, sent, rejoined),
            (false, false) => (
                (c.rank == 0 && sent).then_some((c.start_unix_ns, c.end_unix_ns)),
                None,
            ),
        };
        Observed {
            live_spans: live,
            trace_root,
            local_lateness_ns: None,
            root_wait,
        }
    }

    /// Applies `f` to `c`'s series, created if new; beyond `max_series` in all, or beyond the job's
    /// share ([`Stats::with_job_limit`]), new series fold into the overflow series.
    fn with_series<R>(
        &mut self,
        c: InstanceRef,
        now_ns: u64,
        f: impl FnOnce(&mut Series) -> R,
    ) -> R {
        let key = SeriesRef {
            uid: c.uid(),
            job: c.job_id(),
            comm_hash: c.comm_hash,
            func: c.func(),
            size_bucket: bandwidth::size_bucket(c.bytes),
            algo: c.algo(),
            proto: c.proto(),
            message_size: bandwidth::message_size_range(bandwidth::message_bytes(
                c.datatype(),
                c.desc.count,
                c.bytes,
            )),
        };
        let new = || Series {
            nnodes: c.nnodes,
            nranks: c.nranks,
            comm_name: c.comm_name().into(),
            exec_us: Distribution::new(EXEC_US),
            busbw_gbs: Distribution::new(BUSBW_GBS),
            rolling_exec_ns: Rolling::default(),
            rolling_busbw_gbs: Rolling::default(),
            p50_exec_ns: 0,
            p50_age: u32::MAX,
            last_ns: now_ns,
        };
        let full = self.series.len() >= self.max_series;
        match self.series.raw_entry_mut().from_key(&key) {
            RawEntryMut::Occupied(mut e) => return f(e.get_mut()),
            RawEntryMut::Vacant(v) => {
                let job = job_entry(&mut self.per_job, key.uid, key.job);
                if !full && job.series < self.max_job_series {
                    job.series += 1;
                    let owned = SeriesKey {
                        uid: key.uid,
                        job: key.job.into(),
                        comm_hash: key.comm_hash,
                        func: key.func.into(),
                        size_bucket: key.size_bucket,
                        algo: key.algo.into(),
                        proto: key.proto.into(),
                        message_size: key.message_size,
                    };
                    return f(v.insert(owned, new()).1);
                }
            }
        }
        self.folded += 1;
        let overflow = SeriesKey {
            uid: 0,
            job: self.none.clone(),
            comm_hash: 0,
            func: self.none.clone(),
            size_bucket: OVERFLOW_BUCKET,
            algo: self.none.clone(),
            proto: self.none.clone(),
            message_size: 0,
        };
        f(self.series.entry(overflow).or_insert_with(new))
    }

    /// `c` (of the collective type `type_key`) joins the node's ranks of its collective; the root
    /// span's times when it completes them (see [`Observed::trace_root`]), and the root's
    /// settlement, settled here where no root comes of it.
    fn arrive(
        &mut self,
        c: InstanceRef,
        type_key: u64,
        expected: usize,
        now_ns: u64,
        sent: bool,
        rejoined: bool,
    ) -> (Option<(u64, u64)>, Option<RootWait>) {
        let arrival = Arrival {
            rank: c.rank,
            start: c.start_unix_ns,
            end: c.end_unix_ns,
            sent,
        };
        let key = (c.uid(), c.comm_hash, type_key, c.replay);
        if !self.late.is_empty() {
            let late_key = (key.0, key.1, key.2, key.3, c.desc.seq);
            if let Some((arrivals, _, root_sent)) = self.late.get_mut(&late_key) {
                arrivals.push(arrival);
                // The last local rank carries the root over them all (again, with the same ids,
                // if it went when the skew window closed: at least once); rank 0 coming late
                // carries it over the ranks that came. Only the carrier's records wait on it: the
                // others' wait no longer.
                let all = arrivals.len() >= expected;
                if !all && (c.rank != 0 || !sent || *root_sent) {
                    return (None, None);
                }
                let root = root_span(arrivals);
                *root_sent |= root.is_some();
                if all {
                    self.late.remove(&late_key);
                }
                return settled_unless_root(root, RootWait::default());
            }
        }
        let ranks = &mut self.ranks;
        let late = &mut self.late;
        let w = self.windows.entry(key).or_insert_with(|| {
            // The job as the rank series holds it (observe just made sure it exists).
            let rank = RankRef {
                uid: c.uid(),
                job: c.job_id(),
                comm_hash: c.comm_hash,
                rank: c.rank,
            };
            let job = ranks
                .get_key_value(&rank)
                .map_or_else(|| c.job_id().into(), |(k, _)| k.job.clone());
            Window {
                job,
                base: c.desc.seq,
                slots: VecDeque::new(),
            }
        });
        // Another job with the same communicator hash (a 64-bit random id): not comparable.
        if *w.job != *c.job_id() {
            return (None, None);
        }
        let (window_ns, mut evaluated) = (self.window_ns, 0);
        let before = w.slots.len();
        // A collective shortly before the window's first (its instance completed after a later
        // one's, as a graph replay's may): the window opens back to it. Not further: a segment
        // jumping back and forth must not cost a window's worth of slots per instance.
        if c.desc.seq < w.base {
            let back = (w.base - c.desc.seq) as usize;
            if back > MAX_BACK || back + before > MAX_WINDOW {
                // Too far behind to meet the ranks that came (they went on without it): rank 0
                // carries the root over itself, as when it comes after the skew window closed.
                if c.rank == 0 && sent {
                    return settled_unless_root(root_span(&[arrival]), RootWait::default());
                }
                return (None, None);
            }
            for _ in 0..back {
                w.slots.push_front(None);
            }
            w.base = c.desc.seq;
        }
        let room = MAX_WINDOW
            .min(before + MAX_SLOTS.saturating_sub(self.slots))
            .max(1);
        // Far ahead of the oldest awaited: those are evaluated with the ranks that arrived.
        let ahead = (c.desc.seq - w.base) as usize;
        if ahead >= room {
            let leave = ahead + 1 - room;
            for (i, rv) in w.slots.drain(..leave.min(w.slots.len())).enumerate() {
                let Some(mut rv) = rv else { continue };
                let (due, lost) = (&mut self.roots_due, &mut self.replay_roots_not_resent);
                keep_late(late, due, lost, key, w.base + i as u64, &mut rv, now_ns);
                evaluated +=
                    evaluate(ranks, c.uid(), &w.job, c.comm_hash, rv, now_ns, window_ns) as u64;
            }
            w.base += leave as u64;
        }
        let k = (c.desc.seq - w.base) as usize;
        if w.slots.len() <= k {
            w.slots.resize_with(k + 1, || None);
        }
        let rv = w.slots[k].get_or_insert_with(|| Rendezvous {
            arrivals: Vec::with_capacity(expected),
            opened_ns: now_ns,
            near_step: false,
            rejoined: false,
            root: RootWait::default(),
            rank0: None,
        });
        rv.rejoined |= rejoined;
        if !rv.near_step
            && (self.steps.iter()).any(|(lo, hi)| (lo..=hi).contains(&&c.start_unix_ns))
        {
            rv.near_step = true;
            self.skew_clock_step += 1;
        }
        rv.arrivals.push(arrival);
        let mut wait = Some(rv.root.clone());
        // With every local rank in, evaluate now; otherwise the skew window decides.
        let mut root = None;
        if rv.arrivals.len() >= expected {
            let rv = w.slots[k].take().expect("filled above");
            (root, wait) = settled_unless_root(root_span(&rv.arrivals), rv.root.clone());
            evaluated +=
                evaluate(ranks, c.uid(), &w.job, c.comm_hash, rv, now_ns, window_ns) as u64;
            while matches!(w.slots.front(), Some(None)) {
                w.slots.pop_front();
                w.base += 1;
            }
        } else if c.rank == 0 && sent {
            rv.rank0 = Some(Box::new(Shared {
                inst: c.inst.root_only(None),
                names: c.names.clone(),
            }));
        }
        self.slots = self.slots + w.slots.len() - before;
        self.skew_evaluated += evaluated;
        (root, wait)
    }

    /// The host clock stepped by `delta_ns` at `at_ns` (on the new clock): collectives that any rank
    /// starts near it, as the clock was before or after, are left out of the skew and stragglers.
    pub fn clock_stepped(&mut self, at_ns: u64, delta_ns: i64) {
        let before = at_ns.saturating_add_signed(delta_ns.saturating_neg());
        for t in [at_ns, before] {
            if self.steps.len() >= 2 * MAX_STEPS {
                self.steps.pop_front();
            }
            let span = (
                t.saturating_sub(STEP_BEFORE_NS),
                t.saturating_add(STEP_AFTER_NS),
            );
            self.steps.push_back(span);
        }
    }

    /// Evaluates collectives awaited longer than the skew window (ranks that never arrived are left
    /// out), and forgets windows with nothing awaited.
    pub fn expire(&mut self, now_ns: u64) {
        let (skew_window, window_ns) = (self.skew_window_ns, self.window_ns);
        self.late
            .retain(|_, (_, at, _)| now_ns.saturating_sub(*at) < LATE_NS);
        for (&key, w) in &mut self.windows {
            let (uid, comm_hash, _, _) = key;
            let before = w.slots.len();
            loop {
                match w.slots.front() {
                    Some(None) => {}
                    Some(Some(rv)) if now_ns.saturating_sub(rv.opened_ns) >= skew_window => {}
                    _ => break,
                }
                if let Some(Some(mut rv)) = w.slots.pop_front() {
                    let (late, due) = (&mut self.late, &mut self.roots_due);
                    let lost = &mut self.replay_roots_not_resent;
                    keep_late(late, due, lost, key, w.base, &mut rv, now_ns);
                    self.skew_evaluated += evaluate(
                        &mut self.ranks,
                        uid,
                        &w.job,
                        comm_hash,
                        rv,
                        now_ns,
                        window_ns,
                    ) as u64;
                }
                w.base += 1;
            }
            self.slots -= before - w.slots.len();
        }
        self.windows.retain(|_, w| !w.slots.is_empty());
    }

    /// The root spans of collectives whose skew window closed before every local rank came (see
    /// [`keep_late`]): each an instance of rank 0 carrying only its root, and the settlement its
    /// ranks' records wait on (settle it once the export ends, or at once where it is not sent).
    pub fn take_roots_due(&mut self) -> Vec<(Shared, RootWait)> {
        std::mem::take(&mut self.roots_due)
    }

    /// Forgets series, ranks and jobs without an instance for `idle_ns` (finished jobs), so the
    /// series cap bounds what is live rather than everything ever seen.
    pub fn evict_idle(&mut self, now_ns: u64, idle_ns: u64) {
        let live = |last: u64| now_ns.saturating_sub(last) < idle_ns;
        self.series.retain(|_, s| live(s.last_ns));
        self.ranks.retain(|_, r| live(r.last_ns));
        self.per_job.clear();
        for k in self.series.keys() {
            job_entry(&mut self.per_job, k.uid, &k.job).series += 1;
        }
        for k in self.ranks.keys() {
            job_entry(&mut self.per_job, k.uid, &k.job).ranks += 1;
        }
    }

    /// Collectives per (uid, job), with the first and last end time, over the job's ranks.
    pub fn jobs(&self) -> HashMap<(u32, Arc<str>), (u64, u64, u64)> {
        let mut jobs: HashMap<(u32, Arc<str>), (u64, u64, u64)> = HashMap::new();
        for (k, r) in &self.ranks {
            let j =
                jobs.entry((k.uid, k.job.clone()))
                    .or_insert((0, r.first_end_ns, r.last_end_ns));
            j.0 += r.collectives;
            j.1 = j.1.min(r.first_end_ns);
            j.2 = j.2.max(r.last_end_ns);
        }
        jobs
    }

    /// The stats API's view (rolling percentiles).
    pub fn coll_stats(&self) -> Vec<CollStats> {
        let mut out: Vec<CollStats> = self
            .series
            .iter()
            .map(|(k, s)| CollStats {
                uid: k.uid,
                job_id: k.job.to_string(),
                comm_hash: k.comm_hash,
                func: k.func.to_string(),
                size_bucket: k.size_bucket.to_string(),
                count: s.exec_us.count(),
                exec_p50_us: s.rolling_exec_ns.quantile(0.5) / 1000.0,
                exec_p99_us: s.rolling_exec_ns.quantile(0.99) / 1000.0,
                busbw_p50_gbs: s.rolling_busbw_gbs.quantile(0.5),
            })
            .collect();
        out.sort_by(|a, b| {
            (a.uid, &a.job_id, a.comm_hash, &a.func, &a.size_bucket).cmp(&(
                b.uid,
                &b.job_id,
                b.comm_hash,
                &b.func,
                &b.size_bucket,
            ))
        });
        out
    }

    /// `lost_by_rank`: events lost by the process of each (uid, job, communicator, rank).
    pub fn rank_stats(
        &self,
        lost_by_rank: &HashMap<(u32, Arc<str>, u64, u32), u64>,
    ) -> Vec<RankStats> {
        let mut out: Vec<RankStats> = self
            .ranks
            .iter()
            .map(|(k, r)| RankStats {
                uid: k.uid,
                job_id: k.job.to_string(),
                comm_hash: k.comm_hash,
                rank: k.rank,
                collectives: r.collectives,
                exec_p50_us: r.rolling_exec_ns.quantile(0.5) / 1000.0,
                exec_p99_us: r.rolling_exec_ns.quantile(0.99) / 1000.0,
                skew_p50_us: r.rolling_skew_ns.quantile(0.5) / 1000.0,
                straggler_count: r.last_to_start,
                lost: lost_by_rank
                    .get(&(k.uid, k.job.clone(), k.comm_hash, k.rank))
                    .copied()
                    .unwrap_or(0),
            })
            .collect();
        out.sort_by(|a, b| {
            (a.uid, &a.job_id, a.comm_hash, a.rank).cmp(&(b.uid, &b.job_id, b.comm_hash, b.rank))
        });
        out
    }

    /// The stats API's per-peer view of sends and receives, ranks in order.
    pub fn p2p_stats(&self) -> Vec<P2pStats> {
        let mut ranks: Vec<_> = self.ranks.iter().collect();
        ranks.sort_by(|a, b| a.0.cmp(b.0));
        ranks
            .into_iter()
            .flat_map(|(k, r)| r.peers.rows(k.uid, &k.job, k.comm_hash, k.rank))
            .collect()
    }
}

/// Collective `seq` of window `key`, evaluated before every local rank arrived: its root is sent
/// now with the ranks that came if rank 0's span is one of them ([`Stats::take_roots_due`]), and
/// its ranks' records wait on that; without rank 0 they wait no longer (rank 0 coming late carries
/// the root itself). Its arrivals are kept, at most [`MAX_LATE`] of them and [`LATE_NS`], for a
/// late rank (a graph replay's held work) to find: the last carries the root over them all. A
/// root that may have been lost to a restart is counted in `roots_not_resent` ([`root_at_risk`]).
fn keep_late(
    late: &mut Late,
    roots_due: &mut Vec<(Shared, RootWait)>,
    roots_not_resent: &mut u64,
    key: (u32, u64, u64, u32),
    seq: u64,
    rv: &mut Rendezvous,
    now_ns: u64,
) {
    let late_key = (key.0, key.1, key.2, key.3, seq);
    let root_sent = match rv.rank0.take() {
        Some(mut root) => {
            root.inst.trace_root = root_span(&rv.arrivals);
            roots_due.push((*root, rv.root.clone()));
            true
        }
        None => {
            *roots_not_resent += root_at_risk(key.3, rv) as u64;
            rv.root.settle();
            false
        }
    };
    if late.len() < MAX_LATE && rv.arrivals.iter().any(|a| a.sent) {
        late.insert(late_key, (rv.arrivals.clone(), now_ns, root_sent));
    }
}

/// Whether the root of a graph replay's collective (`replay` > 0) whose skew window closed without
/// rank 0 may be lost: an instance read again after a restart met it with a span to send. A
/// replay's records do not wait on their root (see `Delivery::deliver`), so the ranks the restart
/// did not read again may have been committed before the kill while the root, carried by a rank
/// read again, had not yet reached the receiver. An upper bound: the receiver may have had the root
/// (its acknowledgement not yet seen), or a rank still to come sends it ([`Stats::arrive`]'s late
/// arrivals).
fn root_at_risk(replay: u32, rv: &Rendezvous) -> bool {
    replay > 0 && rv.rejoined && rv.arrivals.iter().any(|a| a.sent)
}

/// The root a completed collective carries, with its settlement, settled now if there is none.
fn settled_unless_root(
    root: Option<(u64, u64)>,
    wait: RootWait,
) -> (Option<(u64, u64)>, Option<RootWait>) {
    if root.is_none() {
        wait.settle();
    }
    (root, Some(wait))
}

/// The root span of a collective whose node ranks all arrived: from the earliest start to the latest
/// end of the sent rank spans, if rank 0's is one of them (its node emits the root).
fn root_span(arrivals: &[Arrival]) -> Option<(u64, u64)> {
    arrivals.iter().find(|a| a.rank == 0 && a.sent)?;
    let sent = arrivals.iter().filter(|a| a.sent);
    let start = sent.clone().map(|a| a.start).min()?;
    Some((start, sent.map(|a| a.end).max()?))
}

/// Skew (start minus the earliest start) and last-to-start / last-to-end of one collective into its
/// ranks' series. Whether there was anything to compare (two ranks or more).
fn evaluate(
    ranks: &mut Map<RankKey, RankSeries>,
    uid: u32,
    job: &str,
    comm_hash: u64,
    rv: Rendezvous,
    now_ns: u64,
    window_ns: u64,
) -> bool {
    if rv.arrivals.len() < 2 || rv.near_step || rv.rejoined {
        return false;
    }
    let min_start = rv.arrivals.iter().map(|a| a.start).min().unwrap_or(0);
    let last_start = rv
        .arrivals
        .iter()
        .max_by_key(|a| (a.start, a.rank))
        .map(|a| a.rank);
    let last_end = rv
        .arrivals
        .iter()
        .max_by_key(|a| (a.end, a.rank))
        .map(|a| a.rank);
    let exec = |a: &Arrival| a.end.saturating_sub(a.start);
    let longest = rv.arrivals.iter().map(exec).max().unwrap_or(0);
    for a in rv.arrivals {
        let skew = a.start - min_start;
        let key = RankRef {
            uid,
            job,
            comm_hash,
            rank: a.rank,
        };
        let Some(r) = ranks.get_mut(&key) else {
            continue;
        };
        r.skew_us.record(skew as f64 / 1000.0);
        r.rolling_skew_ns.record(skew as f64, now_ns, window_ns);
        if Some(a.rank) == last_start {
            r.last_to_start += 1;
        }
        if Some(a.rank) == last_end {
            r.last_to_end += 1;
        }
        r.local_lateness_ns = Some(longest - exec(&a));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instance::Shared;

    fn no_spans(_: Option<u64>, _: u64) -> LiveSpans {
        LiveSpans::None
    }

    fn coll(rank: u32, seq: u64, start: u64, exec: u64) -> Shared {
        Shared::from(&ncclscope_proto::api::Collective {
            job_id: "j".into(),
            comm_hash: 9,
            rank,
            nranks: 4,
            seq,
            func: "AllReduce".into(),
            bytes: 1 << 20,
            start_unix_ns: start,
            end_unix_ns: start + exec,
            exec_ns: exec,
            busbw_gbs: 10.0,
            timing_source: "kernel_gpu".into(),
            ..Default::default()
        })
    }

    /// Issue 35: a rank's node-local lateness, for its span: the longest exec among the node's
    /// ranks of its latest collective evaluated before this instance, less its own. Rank 1, 3 ms
    /// late, waits least: 3 ms; the others ~0. None before any evaluation, nor for unsent spans.
    #[test]
    fn a_sent_rank_span_carries_its_node_local_lateness() {
        let mut s = Stats::new(60_000_000_000, 1_000_000_000, 100);
        s.set_local_ranks(HashMap::from([((0, 9), 3)]));
        let sent = |_: Option<u64>, _: u64| LiveSpans::Rank;
        let lateness = |s: &mut Stats, rank, seq, start, exec| {
            s.observe(coll(rank, seq, start, exec).view(), 0, 1, sent)
                .local_lateness_ns
        };
        assert_eq!(lateness(&mut s, 0, 1, 1_000, 3_200_000), None);
        assert_eq!(lateness(&mut s, 2, 1, 1_100, 3_150_000), None);
        assert_eq!(lateness(&mut s, 1, 1, 3_001_000, 200_000), None);
        assert_eq!(lateness(&mut s, 0, 2, 5_000_000, 3_200_000), Some(0));
        assert_eq!(lateness(&mut s, 2, 2, 5_000_100, 3_180_000), Some(50_000));
        let o = s.observe(coll(1, 2, 8_000_000, 200_000).view(), 0, 1, no_spans);
        assert_eq!(o.local_lateness_ns, None);
        assert_eq!(lateness(&mut s, 1, 3, 9_000_000, 250_000), Some(3_000_000));
    }

    /// Issue 17: the root span was rank 0's view, and rank spans ended after it. The last of the
    /// node's ranks to complete a collective carries a root from the earliest start to the latest
    /// end of the sent rank spans; only where rank 0's is sent.
    #[test]
    fn the_last_local_rank_carries_a_root_covering_the_sent_rank_spans() {
        let mut s = Stats::new(60_000_000_000, 1_000_000_000, 100);
        s.set_local_ranks(HashMap::from([((0, 9), 3)]));
        let sent = |_: Option<u64>, _: u64| LiveSpans::Rank;
        let observed = [
            s.observe(coll(0, 1, 100, 500).view(), 0, 1, sent),
            s.observe(coll(2, 1, 50, 1_000).view(), 0, 1, sent),
            s.observe(coll(1, 1, 120, 900).view(), 0, 1, sent),
        ];
        assert_eq!(
            observed.map(|o| o.trace_root),
            [None, None, Some((50, 1_050))]
        );
        assert_eq!(s.skew_evaluated, 1);
        // A rank without kernel times (closed incomplete) meets no other: no root.
        let mut host_timed = coll(2, 7, 50, 1_000);
        host_timed.inst.timing_source = TimingSource::Host;
        s.observe(coll(0, 7, 100, 500).view(), 0, 1, sent);
        s.observe(coll(1, 7, 100, 500).view(), 0, 1, sent);
        assert_eq!(s.observe(host_timed.view(), 0, 1, sent).trace_root, None);
        // Rank 1's span not sent (sampled out): not covered. Rank 0's not sent: no root here.
        s.observe(coll(0, 2, 100, 500).view(), 0, 1, sent);
        s.observe(coll(2, 2, 90, 100).view(), 0, 1, sent);
        let o = s.observe(coll(1, 2, 120, 2_000).view(), 0, 1, no_spans);
        assert_eq!(o.trace_root, Some((90, 600)));
        s.observe(coll(0, 3, 100, 500).view(), 0, 1, no_spans);
        s.observe(coll(1, 3, 100, 500).view(), 0, 1, sent);
        let o = s.observe(coll(2, 3, 100, 500).view(), 0, 1, sent);
        assert_eq!(o.trace_root, None);
        // A rank later than the skew window (a replay's held work) still completes the root.
        s.observe(coll(0, 6, 100, 500).view(), 0, 1, sent);
        s.observe(coll(1, 6, 100, 500).view(), 0, 1, sent);
        s.expire(2_000_000_000);
        let o = s.observe(coll(2, 6, 50, 2_000).view(), 0, 1, sent);
        assert_eq!(o.trace_root, Some((50, 2_050)));
        assert_eq!(s.late.len(), 1, "seq 7's, whose third rank never comes");
        // Alone on its node, rank 0 is its own root; a p2p has none.
        s.set_local_ranks(HashMap::from([((0, 9), 1)]));
        let o = s.observe(coll(0, 4, 100, 500).view(), 0, 1, sent);
        assert_eq!(o.trace_root, Some((100, 600)));
        let mut p2p = coll(0, 5, 100, 500);
        p2p.inst.desc.is_p2p = true;
        assert_eq!(s.observe(p2p.view(), 0, 1, sent).trace_root, None);
    }

    /// Issue 37: the root depends on every local rank's instance, so each waits on its settlement
    /// (the engine keeps their records until then); one that completes without a root is settled
    /// here, and one whose skew window closes first sends its root with the ranks that came or,
    /// without rank 0, waits no longer. Instances re-read after a restart meet again and carry the
    /// root again, without counting their skew twice.
    #[test]
    fn every_local_rank_waits_on_its_roots_settlement_and_re_read_ranks_meet_again() {
        let mut s = Stats::new(60_000_000_000, 1_000_000_000, 100);
        s.set_local_ranks(HashMap::from([((0, 9), 2)]));
        let sent = |_: Option<u64>, _: u64| LiveSpans::Rank;
        let first = s.observe(coll(1, 1, 100, 500).view(), 0, 1, sent);
        let last = s.observe(coll(0, 1, 120, 900).view(), 0, 1, sent);
        let wait = first.root_wait.clone().expect("waits on its root");
        assert_eq!(
            last.root_wait.as_ref(),
            Some(&wait),
            "one settlement per collective"
        );
        assert!(
            last.trace_root.is_some() && !wait.settled(),
            "settled once the root is sent"
        );
        // Rank 0's span not sent: no root, settled at once.
        s.observe(coll(1, 2, 100, 500).view(), 0, 1, sent);
        let o = s.observe(coll(0, 2, 100, 500).view(), 0, 1, no_spans);
        assert!(o.trace_root.is_none() && o.root_wait.unwrap().settled());
        // Rank 1 never comes in time: rank 0's root is sent when the skew window closes, over the
        // rank that came, and its records wait for that export; rank 1 coming later carries it
        // again over both (the same ids).
        let alone = s
            .observe(coll(0, 3, 100, 500).view(), 0, 1, sent)
            .root_wait
            .unwrap();
        assert!(s.take_roots_due().is_empty());
        s.expire(2_000_000_000);
        let due = s.take_roots_due();
        assert_eq!(due.len(), 1);
        let (root, due_wait) = &due[0];
        assert_eq!(root.inst.trace_root, Some((100, 600)));
        assert_eq!((root.inst.rank, root.inst.desc.seq), (0, 3));
        assert_eq!(root.inst.live_spans, LiveSpans::None, "only the root");
        assert!(root.inst.channels.is_empty());
        assert!(
            *due_wait == alone && !alone.settled(),
            "settled by its export"
        );
        let o = s.observe(coll(1, 3, 100, 5_000).view(), 0, 1, sent);
        assert_eq!(
            o.trace_root,
            Some((100, 5_100)),
            "the root again, over both"
        );
        let carried = o.root_wait.unwrap();
        assert!(
            carried != alone && !carried.settled(),
            "its own export settles it"
        );
        // Rank 0 never comes in time: rank 1's records wait no longer, and rank 0 coming late
        // carries the root over both, in its own export.
        let early = s
            .observe(coll(1, 5, 100, 500).view(), 0, 1, sent)
            .root_wait
            .unwrap();
        s.expire(4_000_000_000);
        assert!(early.settled() && s.take_roots_due().is_empty());
        let o = s.observe(coll(0, 5, 150, 5_000).view(), 0, 1, sent);
        assert_eq!(o.trace_root, Some((100, 5_150)));
        assert!(o.root_wait.is_some_and(|w| w != early && !w.settled()));
        // After a restart both instances of seq 1 are read again: they meet, the last carries the
        // root again, and the skew is not counted a second time.
        let evaluated = s.skew_evaluated;
        s.rejoin(coll(0, 1, 120, 900).view(), 0, LiveSpans::Rank);
        let o = s.rejoin(coll(1, 1, 100, 500).view(), 0, LiveSpans::Rank);
        assert_eq!(o.trace_root, last.trace_root);
        assert_eq!(s.skew_evaluated, evaluated);
        // A re-read instance whose other rank was committed (its root acknowledged before the
        // kill) waits no longer than the skew window.
        let reread = s
            .rejoin(coll(1, 4, 100, 500).view(), 0, LiveSpans::Rank)
            .root_wait
            .unwrap();
        s.expire(6_000_000_000);
        assert!(reread.settled());
    }

    /// Issue 37: the root of a graph replay's collective that a restart may have lost is counted: one
    /// read again without rank 0, whose skew window closes without the root. Not an eager one (its
    /// ranks' records wait on the root), nor one whose rank 0 was read again too.
    #[test]
    fn a_replays_root_a_restart_may_have_lost_is_counted() {
        let mut s = Stats::new(60_000_000_000, 1_000_000_000, 100);
        s.set_local_ranks(HashMap::from([((0, 9), 2)]));
        let replayed = |rank, seq, replay| {
            let mut c = coll(rank, seq, 100, 500);
            c.inst.replay = replay;
            c
        };
        s.rejoin(replayed(1, 1, 3).view(), 0, LiveSpans::Rank);
        s.rejoin(replayed(1, 2, 0).view(), 0, LiveSpans::Rank);
        s.rejoin(replayed(0, 4, 3).view(), 0, LiveSpans::Rank);
        let o = s.rejoin(replayed(1, 4, 3).view(), 0, LiveSpans::Rank);
        assert!(
            o.trace_root.is_some(),
            "rank 0 read again too: the root goes"
        );
        s.expire(2_000_000_000);
        assert_eq!(s.replay_roots_not_resent, 1);
        // One the previous daemon read but did not record (killed before its spool had it) counts
        // the same; read for the first time, it does not.
        let sent = |_: Option<u64>, _: u64| LiveSpans::Rank;
        s.observe_read(replayed(1, 5, 3).view(), 0, 1, true, sent);
        s.observe_read(replayed(1, 6, 3).view(), 0, 1, false, sent);
        s.expire(4_000_000_000);
        assert_eq!(s.replay_roots_not_resent, 2);
    }

    /// Issue 37: a rank whose segment the daemon reads before another local rank's communicator is
    /// known meets no other; the other's instance of that collective, read next, awaited it in vain
    /// and the root never came (a node's first collectives, in the fake-ranks test 9 of 30). Its
    /// root is now sent when the skew window closes, over the ranks that came.
    #[test]
    fn a_rank_read_before_the_others_communicator_was_known_still_gets_its_root() {
        assert!(size_of::<Option<Rendezvous>>() <= 64, "see MAX_SLOTS");
        let mut s = Stats::new(60_000_000_000, 1_000_000_000, 100);
        let sent = |_: Option<u64>, _: u64| LiveSpans::Rank;
        s.set_local_ranks(HashMap::from([((0, 9), 1)]));
        let o = s.observe(coll(1, 0, 100, 500).view(), 0, 1, sent);
        assert_eq!(
            (o.trace_root, o.root_wait),
            (None, None),
            "alone, not rank 0"
        );
        s.set_local_ranks(HashMap::from([((0, 9), 2)]));
        let o = s.observe(coll(0, 0, 120, 900).view(), 0, 1, sent);
        assert_eq!(o.trace_root, None, "awaits rank 1");
        let wait = o.root_wait.unwrap();
        s.expire(1_000_000_000);
        let due = s.take_roots_due();
        assert_eq!(due.len(), 1, "the root is sent");
        assert_eq!(due[0].0.inst.trace_root, Some((120, 1_020)));
        assert!(due[0].1 == wait);
        // Rank 1 read alone further than the window opens back for rank 0's first instances, read
        // next: rank 0 carries each of their roots over itself (the multi-node test lost 3-56 of
        // 240 roots so).
        let ahead = MAX_BACK as u64 + 10;
        s.observe(coll(1, ahead, 100, 500).view(), 0, 1, sent);
        let o = s.observe(coll(0, 1, 130, 700).view(), 0, 1, sent);
        assert_eq!(o.trace_root, Some((130, 830)));
        assert!(!o.root_wait.unwrap().settled(), "its records wait on it");
        let o = s.observe(coll(0, 2, 130, 700).view(), 0, 1, |_, _| LiveSpans::None);
        assert_eq!(
            (o.trace_root, o.root_wait),
            (None, None),
            "no span, no root"
        );
    }

    #[test]
    fn skew_and_stragglers_across_the_nodes_ranks() {
        let mut s = Stats::new(60_000_000_000, 1000, 100);
        s.set_local_ranks(HashMap::from([((0, 9), 3)]));
        for seq in 0..10 {
            // Rank 2 always starts 5 us late; rank 0 ends last.
            s.observe(coll(0, seq, 1_000_000, 20_000).view(), 0, 1, no_spans);
            s.observe(coll(1, seq, 1_000_000, 1_000).view(), 0, 1, no_spans);
            s.observe(coll(2, seq, 1_005_000, 1_000).view(), 0, 1, no_spans);
        }
        assert_eq!(s.skew_evaluated, 10);
        let ranks = s.rank_stats(&HashMap::new());
        assert_eq!(
            ranks.iter().map(|r| r.straggler_count).collect::<Vec<_>>(),
            vec![0, 0, 10]
        );
        assert!(
            (4.95..=5.05).contains(&ranks[2].skew_p50_us),
            "{}",
            ranks[2].skew_p50_us
        );
        assert_eq!(
            s.ranks[&RankKey {
                uid: 0,
                job: Arc::from("j"),
                comm_hash: 9,
                rank: 0
            }]
                .last_to_end,
            10
        );
        let colls = s.coll_stats();
        assert_eq!(colls.len(), 1);
        assert_eq!(colls[0].count, 30);
        assert_eq!(colls[0].size_bucket, "<=1MiB");
    }

    /// Issue 22: a 1 h host clock step gave 100 false stragglers. Rank 0 recalibrated right after
    /// the step (its times on the new clock), rank 1 not yet (on the old one): the collectives near
    /// the step are left out of the skew and counted; those away from it are evaluated as before.
    #[test]
    fn collectives_near_a_host_clock_step_make_no_stragglers() {
        const S: u64 = 1_000_000_000;
        let (at, delta) = (1_700_003_600 * S, 3600 * S as i64);
        let mut s = Stats::new(600 * S, 1000, 100);
        s.set_local_ranks(HashMap::from([((0, 9), 2)]));
        s.clock_stepped(at, delta);
        let before = at - delta as u64;
        for seq in 0..10 {
            // Around the step: a second apart on the new clock and the old.
            let t = seq * S / 2;
            s.observe(coll(0, seq, at + t, 1_000).view(), 0, 1, no_spans);
            s.observe(coll(1, seq, before + t, 1_000).view(), 0, 1, no_spans);
        }
        for seq in 10..20 {
            // A minute later, both recalibrated: rank 1 starts 5 us late.
            s.observe(coll(0, seq, at + 60 * S, 1_000).view(), 0, 1, no_spans);
            s.observe(
                coll(1, seq, at + 60 * S + 5_000, 1_000).view(),
                0,
                1,
                no_spans,
            );
        }
        assert_eq!((s.skew_evaluated, s.skew_clock_step), (10, 10));
        let ranks = s.rank_stats(&HashMap::new());
        assert_eq!(
            ranks.iter().map(|r| r.straggler_count).collect::<Vec<_>>(),
            vec![0, 10],
            "only the late rank after the step"
        );
        assert!(ranks[0].skew_p50_us < 1.0, "{}", ranks[0].skew_p50_us);
    }

    #[test]
    fn graph_replays_meet_by_seq_and_replay_without_disturbing_eager_collectives() {
        let mut s = Stats::new(60_000_000_000, 1000, 100);
        s.set_local_ranks(HashMap::from([((0, 9), 2)]));
        let replayed = |rank, seq, replay, start| {
            let mut c = coll(rank, seq, start, 10);
            c.inst.replay = replay;
            c
        };
        // Eager seqs 100.., then three replays of a graph captured at seqs 4..6, rank 1 late in each.
        // Eager: rank 0 late.
        for seq in 100..103 {
            s.observe(coll(0, seq, 5_000, 10).view(), 0, 1, no_spans);
            s.observe(coll(1, seq, 1_000, 10).view(), 0, 1, no_spans);
        }
        for replay in 1..=3 {
            for seq in 4..7 {
                s.observe(replayed(0, seq, replay, 2_000).view(), 0, 1, no_spans);
                s.observe(replayed(1, seq, replay, 9_000).view(), 0, 1, no_spans);
            }
        }
        s.observe(coll(0, 103, 5_000, 10).view(), 0, 1, no_spans);
        s.observe(coll(1, 103, 1_000, 10).view(), 0, 1, no_spans);
        assert_eq!(
            s.skew_evaluated,
            4 + 9,
            "every (seq, replay) once, eager ones too"
        );
        let ranks = s.rank_stats(&HashMap::new());
        assert_eq!(
            (ranks[0].straggler_count, ranks[1].straggler_count),
            (4, 9),
            "rank 0 late in the eager collectives, rank 1 in every replayed one"
        );
    }

    #[test]
    fn ranks_out_of_step_still_meet_and_the_window_stays_bounded() {
        let mut s = Stats::new(60_000_000_000, 1000, 100);
        s.set_local_ranks(HashMap::from([((0, 9), 2)]));
        // Rank 0 runs 50 collectives ahead of rank 1; each collective is evaluated once both are in.
        for seq in 0..50 {
            s.observe(coll(0, seq, 1_000, 10).view(), 0, 1, no_spans);
        }
        for seq in 0..50 {
            s.observe(coll(1, seq, 1_000, 10).view(), 0, 1, no_spans);
        }
        assert_eq!(s.skew_evaluated, 50);
        assert_eq!(
            s.windows[&(0, 9, crate::spans::type_key("AllReduce"), 0)]
                .slots
                .len(),
            0,
            "evaluated collectives leave"
        );
        // A rank far ahead (or a seq jump): the window keeps at most MAX_WINDOW collectives.
        s.observe(coll(0, 50, 1_000, 10).view(), 0, 1, no_spans);
        s.observe(
            coll(0, 50 + MAX_WINDOW as u64 + 10, 1_000, 10).view(),
            0,
            1,
            no_spans,
        );
        assert!(
            s.windows[&(0, 9, crate::spans::type_key("AllReduce"), 0)]
                .slots
                .len()
                <= MAX_WINDOW
        );
        // Late arrivals for collectives that left the window are not compared.
        s.observe(coll(1, 50, 1_000, 10).view(), 0, 1, no_spans);
        assert_eq!(s.skew_evaluated, 50);
        s.expire(u64::MAX);
        assert!(
            s.windows.is_empty(),
            "nothing awaited after the skew window"
        );
    }

    #[test]
    fn another_uid_claiming_the_job_and_communicator_stays_apart() {
        let mut s = Stats::new(60_000_000_000, 1000, 100);
        let of = |uid, rank, seq, start| {
            let mut c = coll(rank, seq, start, 1_000);
            Arc::make_mut(&mut c.names).uid = uid;
            c
        };
        s.set_local_ranks(HashMap::from([((61001, 9), 2), ((61002, 9), 1)]));
        for seq in 0..10 {
            s.observe(of(61001, 0, seq, 1_000).view(), 0, 1, no_spans);
            s.observe(of(61001, 1, seq, 1_500).view(), 0, 1, no_spans);
            // Same job id, communicator, seq and rank 0, starting very late: another user's process.
            s.observe(of(61002, 0, seq, 900_000).view(), 0, 1, no_spans);
        }
        let colls = s.coll_stats();
        let count = |uid| colls.iter().find(|c| c.uid == uid).map(|c| c.count);
        assert_eq!((count(61001), count(61002)), (Some(20), Some(10)));
        let ranks = s.rank_stats(&HashMap::new());
        let a: Vec<_> = ranks.iter().filter(|r| r.uid == 61001).collect();
        assert_eq!(a.len(), 2);
        // 61001's rendezvous met only its own two ranks: rank 1 is its straggler, 500 ns late.
        assert_eq!((a[0].straggler_count, a[1].straggler_count), (0, 10));
        assert!(a[1].skew_p50_us < 1.0, "{}", a[1].skew_p50_us);
        assert_eq!(s.skew_evaluated, 10);
        assert_eq!(s.jobs().len(), 2, "one job per uid");
    }

    #[test]
    fn finished_jobs_are_evicted_after_the_idle_time() {
        let mut s = Stats::new(60_000_000_000, 1000, 100);
        s.observe(coll(0, 0, 0, 10).view(), 1_000, 1, no_spans);
        let mut other = coll(0, 0, 0, 10);
        Arc::make_mut(&mut other.names).job_id = "k".into();
        s.observe(other.view(), 5_000, 1, no_spans);
        s.evict_idle(6_000, 2_000);
        assert_eq!(
            s.series
                .keys()
                .map(|k| k.job.to_string())
                .collect::<Vec<_>>(),
            vec!["k"]
        );
        assert_eq!(s.ranks.len(), 1);
        assert_eq!(s.jobs().len(), 1);
    }

    #[test]
    fn the_p50_for_outliers_is_current_from_the_first_samples_on() {
        let mut s = Stats::new(60_000_000_000, 1000, 100);
        let mut p50 = None;
        for seq in 0..300 {
            s.observe(coll(0, seq, 0, 10_000 + seq % 7).view(), 0, 100, |p, _| {
                p50 = p;
                LiveSpans::None
            });
            if seq < 100 {
                assert_eq!(p50, None, "not enough samples yet");
            }
        }
        let p50 = p50.unwrap();
        assert!((9_950..=10_060).contains(&p50), "{p50}");
    }

    #[test]
    fn a_missing_rank_is_evaluated_after_the_window_and_series_are_capped() {
        let mut s = Stats::new(60_000_000_000, 1000, 1);
        s.set_local_ranks(HashMap::from([((0, 9), 3)]));
        s.observe(coll(0, 1, 100, 10).view(), 0, 1, no_spans);
        s.observe(coll(1, 1, 300, 10).view(), 0, 1, no_spans);
        assert_eq!(s.skew_evaluated, 0);
        s.expire(500);
        assert_eq!(s.skew_evaluated, 0, "window not over");
        s.expire(1000);
        assert_eq!(s.skew_evaluated, 1);
        let mut other = coll(0, 2, 0, 10);
        Arc::make_mut(&mut other.names).set(other.inst.desc.func, "Broadcast".into());
        s.observe(other.view(), 0, 1, no_spans);
        assert_eq!(s.folded, 1);
        assert!(s.series.keys().any(|k| k.size_bucket == OVERFLOW_BUCKET));
    }

    #[test]
    fn rank_series_beyond_the_limit_are_refused_and_counted() {
        let mut s = Stats::new(60_000_000_000, 1000, 100).with_rank_limit(2);
        s.set_local_ranks(HashMap::from([((0, 9), 4)]));
        for rank in 0..4 {
            s.observe(coll(rank, 0, 1_000, 10).view(), 0, 1, no_spans);
        }
        assert_eq!((s.ranks.len(), s.rank_series_refused), (2, 2));
        assert_eq!(
            s.coll_stats()[0].count,
            4,
            "the collective series still counts them"
        );
        // A seq far ahead takes at most its window's share of the awaited slots.
        s.observe(coll(0, 1 << 40, 1_000, 10).view(), 0, 1, no_spans);
        assert!(s.slots <= MAX_WINDOW);
        s.expire(u64::MAX);
        assert_eq!(s.slots, 0);
        // A job at its share of series: its new series fold, another job's do not.
        let mut s = Stats::new(60_000_000_000, 1000, 100).with_job_limit(1);
        s.observe(coll(0, 0, 1_000, 10).view(), 0, 1, no_spans);
        let mut other = coll(1, 0, 1_000, 10);
        Arc::make_mut(&mut other.names).set(other.inst.desc.func, "Broadcast".into());
        s.observe(other.view(), 0, 1, no_spans);
        assert_eq!((s.folded, s.rank_series_refused), (1, 1));
        let mut job = coll(0, 0, 1_000, 10);
        Arc::make_mut(&mut job.names).job_id = "k".into();
        s.observe(job.view(), 0, 1, no_spans);
        assert_eq!((s.folded, s.rank_series_refused, s.ranks.len()), (1, 1, 2));
        s.evict_idle(10, 5);
        assert!(s.per_job.is_empty(), "shares follow eviction");
    }
}
