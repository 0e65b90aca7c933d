//! The ingest engine: one thread that drains every attached segment on a shared adaptive ticker,
//! assembles collective instances, records them (spool, then live subscribers, statistics), queues
//! sampled ones for OTLP, and commits each segment's tail only past records whose effects are safe.
//!
//! Commit point of a segment = the oldest of: the first record of an operation still in flight, the
//! first record of a completed operation whose span is not yet acknowledged by the exporter, and the
//! read position. Committing saves the segment's resume state (see [`crate::resume`]) for that point
//! through the state writer thread ([`crate::state_writer`]), and moves the ring's tail there only
//! once the writer reports the state durable (a later tick): a daemon killed, or a machine rebooted,
//! at any point re-reads what it had not finished and skips what it had delivered. The engine goes
//! on from the new point meanwhile (`Attached::tail`); it never waits on the disk.
//!
//! The spool is exactly-once across a kill, and metrics count an instance in one daemon run only:
//! every spooled instance carries its origin (segment, operation), and the saved state holds a spool
//! position (`spool_mark`) that precedes everything of the segment spooled after that save (saved
//! ahead of a segment's first append, and again once the spool moved [`MARK_LAG`] past it). A
//! restarted engine reads the origins past the mark and treats those operations as recorded: not
//! spooled, published or counted again.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc as std_mpsc};
use std::time::{Duration, Instant};

use ncclscope_proto::api::{
    Communicator, Health as ApiHealth, Job, ListJobsResponse, LiveSpans, RankInfo, StatsResponse,
};
use ncclscope_proto::segment::{Consumer, Counter, Segment};
use ncclscope_proto::{realtime_ns, shift};
use opentelemetry_proto::tonic::metrics::v1::Metric;
use tokio::sync::{mpsc, oneshot, watch};

use crate::assemble::{AssembleCounters, Assembler, Completed, UidBudget, done};
use crate::clock_step::StepDetector;
use crate::config::Config;
use crate::group_commit::{BACKLOG_PAUSE, SpoolWriter};
use crate::hub::{Durable, Hub, SpoolRun};
use crate::instance::{InstanceRef, Shared};
use crate::loss::{Loss, Losses, PluginCounts, PluginLosses, Refusals};
use crate::metrics::{self, Health};
use crate::otlp::{ExportCounters, SpanItem};
use crate::prometheus;
use crate::resend::Dropped;
use crate::resume::{self, SegmentState};
use crate::spool::{JobKey, Origin, Position};
use crate::state_writer::{self, StateWriter};
use crate::stats::{RootWait, Stats};

/// Which process's segment: the uid and pid the kernel reported for the process that handed it over
/// (the pid as seen from the daemon's PID namespace), and the memory file's inode, which tells a
/// process's segments apart while they exist. Names its resume state and its entries in systemd's
/// file descriptor store, as `<uid>.<pid>.<inode>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentKey {
    pub uid: u32,
    pub pid: u32,
    pub inode: u64,
}

impl std::fmt::Display for SegmentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.uid, self.pid, self.inode)
    }
}

impl std::str::FromStr for SegmentKey {
    type Err = ();

    fn from_str(s: &str) -> Result<SegmentKey, ()> {
        let mut it = s.splitn(3, '.').map(|p| p.parse::<u64>().map_err(|_| ()));
        let (uid, pid, inode) = (
            it.next().ok_or(())??,
            it.next().ok_or(())??,
            it.next().ok_or(())??,
        );
        Ok(SegmentKey {
            uid: u32::try_from(uid).map_err(|_| ())?,
            pid: u32::try_from(pid).map_err(|_| ())?,
            inode,
        })
    }
}

/// A segment handed over (by a registering process, or restored from systemd's file descriptor
/// store), already checked against its peer, with the connection whose end means the process ended
/// (`None`: it ended while no daemon ran).
pub struct Attach {
    pub key: SegmentKey,
    pub segment: Segment,
    pub conn: Option<OwnedFd>,
    pub reply: Option<oneshot::Sender<Result<(), String>>>,
}

/// What the registration socket hands the engine.
pub enum Handover {
    Attach(Attach),
    /// A segment (or registration connection) of `uid` refused before it was mapped, counted
    /// under `stage`.
    Refused {
        uid: u32,
        stage: Loss,
    },
}

/// Where the engine sends what it produces besides the spool and the hub.
pub struct Outputs {
    pub spans: Option<mpsc::Sender<SpanItem>>,
    pub metrics: Option<mpsc::Sender<Vec<Metric>>>,
    pub export_counters: Arc<ExportCounters>,
    /// Where instances refused by a full export queue are remembered for re-sending from the spool
    /// (`None` without a spool or an exporter).
    pub dropped: Option<Arc<Dropped>>,
    pub prometheus: watch::Sender<Arc<prometheus::Snapshot>>,
    /// The node's `host.name`, on `ncclscope_build_info`.
    pub host_name: String,
}

/// Minimum samples in a series before "slower than slow_factor x p50" keeps an instance.
const SLOW_MIN_SAMPLES: u64 = 100;
const SWEEP_EVERY: Duration = Duration::from_millis(100);
const LIVENESS_EVERY: Duration = Duration::from_millis(500);
const SNAPSHOT_EVERY: Duration = Duration::from_secs(1);
/// A series (job, communicator, collective, size) without an instance this long is dropped.
const SERIES_IDLE: Duration = Duration::from_secs(3600);
/// Longest a segment's tail may lag the engine's progress before it is committed.
const COMMIT_EVERY: Duration = Duration::from_millis(10);
/// Records copied out of a ring (one pread) and decoded at once: 64 KiB, still in cache when they are
/// applied, and the system call's cost spread over as many.
const READ_CHUNK: usize = 1024;
/// Completed instances delivered (spooled, counted, queued for export) at once, at most about.
const DELIVER_AT: usize = 1024;
/// A changed dictionary rewrites the segment's whole state file: saved at most every [`COMMIT_EVERY`]
/// and every this many times the last save's duration, so a process that keeps redefining its
/// dictionary costs the ingest thread a bounded share of its time (its own tail waits meanwhile),
/// except while its ring is over half full: then every [`COMMIT_EVERY`], or the producer drops.
const DICT_SAVE_SHARE: u32 = 50;
/// How far a job's spool may run past a segment's saved `spool_mark` before the state is saved again:
/// bounds what a restarted engine reads back per segment.
const MARK_LAG: u64 = 1 << 20;
/// An operation open this long is parked (see `Assembler::park`): the tail moves past its records
/// and the resume state carries it. Long enough that an operation rarely is (its records come within
/// a few drain intervals), short enough that one whose record was lost uncounted (a gap the plugin
/// did not see) holds a small share of its ring.
const PARK_AFTER: Duration = Duration::from_millis(100);
/// [`PARK_AFTER`] while the ring is over half full.
const PARK_PRESSED: Duration = Duration::from_millis(10);
/// How long after start a resume state waits for its segment to be handed over again (plugins retry
/// at least every 2 s) before it is taken for one whose process ended while no daemon ran.
const STATE_CLAIM_WINDOW: Duration = Duration::from_secs(300);
/// States of a segment queued and not yet durable at which its commits wait for the writer: bounds
/// what a slow state disk makes the daemon hold (the ring holds the records meanwhile).
const MAX_SAVING: usize = 8;
/// Longest a detached segment waits for its queued states before its state file is removed.
const FORGET_WAIT: Duration = Duration::from_secs(1);

struct Attached {
    key: SegmentKey,
    label: String,
    /// The highest value each plugin counter of the segment has shown. Its owner writes the header:
    /// a counter it lowers, or wraps, lowers nothing here.
    plugin_lost: PluginCounts,
    /// The registering process's connection; its end is the process's end.
    conn: Option<OwnedFd>,
    /// The spool's key of the process's job: (uid, job id).
    job: JobKey,
    consumer: Consumer,
    asm: Assembler,
    /// The committed tail as far as the engine goes: that of the last state queued. The ring's tail
    /// follows once that state is durable (see `saving`).
    tail: u64,
    /// (state number, tail) of each state queued and not yet durable, in queue order: the ring's tail
    /// moves to `tail` once the state writer reports the number durable.
    saving: VecDeque<(u64, u64)>,
    /// The last state queued was not written: save again before the tail moves on.
    resave: bool,
    /// A state of this segment is durable. Until one is, its spooled batches wait for the states
    /// queued before them: without a state, a restarted engine would not read the spool back for
    /// it. (A later state only moves the spool mark on: one left older makes a restart read more.)
    on_disk: bool,
    read_upto: u64,
    acked: Arc<AtomicU64>,
    next_emit: u64,
    /// Completed operations queued for export and not yet acknowledged.
    unacked: Unacked,
    /// Delivered operations whose collective's root span is not settled (not graph replays').
    roots: RootHolds,
    /// Operations this daemon delivered whose records are not yet committed: id -> (pos, sinks).
    delivered: HashMap<u64, (u64, u8), foldhash::fast::RandomState>,
    last_commit: Instant,
    /// `delivered` changed since the state was last saved.
    dirty: bool,
    /// A state for this segment was queued by this daemon, or restored from a previous one.
    state_saved: bool,
    /// The dictionary changed since the state was last saved.
    dict_changed: bool,
    /// When a changed dictionary was last saved, and how long the ingest thread spent on it (see
    /// [`DICT_SAVE_SHARE`]).
    dict_saved_at: Instant,
    dict_save_cost: Duration,
    /// The spool position in the saved state.
    spool_mark: Option<Position>,
    /// The parked operations in the saved state, and the read position they are as of: saved
    /// again as they were by a save that does not move the tail (see `deliver`).
    saved_parked: (Vec<resume::SavedOp>, u64),
    /// Batches queued for the spool and not yet durable, in queue order.
    spooling: VecDeque<Spooling>,
    /// Records lost in the segment as last seen (plugin loss counters, records of unknown
    /// operations, undecodable records): a rise is a gap (see `observe_gaps`).
    gaps: u64,
    exited: bool,
    /// Since when its process exited and everything it held was delivered and acknowledged but
    /// roots of its collectives (see `Engine::reap`).
    roots_only_since: Option<Instant>,
}

/// A segment's instances in a batch queued for the spool writer and not yet durable.
struct Spooling {
    batch: u64,
    /// The spool's end before the batch was queued: at or before where the batch lands.
    mark: Position,
    /// First record of the earliest of its operations: the tail waits there until it is durable.
    first_pos: u64,
    /// Its operations, for `delivered` once durable.
    ops: Vec<OpDone>,
}

/// A resume state file not yet claimed by a segment, and the (uid, communicator hash) of each
/// communicator it holds (the ranks expected back, see `Engine::refresh_local_ranks`).
type Unclaimed = (String, Vec<(u32, u64)>);

/// An operation delivered: (op id, position of its first record, sinks: see [`done`]).
type OpDone = (u64, u64, u8);

/// The spool position a segment's state may save: at or before everything of it the spool takes
/// from now on and everything of it queued and not yet durable.
fn spool_mark(seg: &Attached, spool: &SpoolWriter) -> Position {
    match seg.spooling.front() {
        Some(s) => s.mark,
        None => spool.end(&seg.job),
    }
}

impl Attached {
    fn observe_plugin_counters(&mut self) {
        for c in Counter::ALL {
            let v = &mut self.plugin_lost[c as usize];
            *v = (*v).max(self.consumer.segment().counter(c));
        }
    }

    /// After [`Self::observe_plugin_counters`]: whether records were lost since the last call,
    /// somewhere before the producer's head. The plugin counts a record it drops (ring or queue
    /// full, ...) before writing later ones, and the daemon counts records of operations it does not
    /// know as it reads them: an operation read so far may be missing one, and is parked rather than
    /// left to hold the tail until it times out.
    fn observe_gaps(&mut self) -> bool {
        let plugin = (Counter::ALL.iter())
            .filter(|c| c.is_loss())
            .fold(0u64, |t, &c| t.saturating_add(self.plugin_lost[c as usize]));
        let c = &self.asm.counters;
        let gaps = plugin
            .saturating_add(c.kernel_unjoined)
            .saturating_add(c.decode_errors);
        let rose = gaps > self.gaps;
        self.gaps = gaps;
        rose
    }
}

/// Spans queued for export and not yet acknowledged, in emit order (the exporter acknowledges a
/// prefix), with the first records of their operations counted: operations complete out of start
/// order (another communicator, a longer kernel), so the oldest emitted is not always the one whose
/// records come first, and the tail must wait on the latter.
#[derive(Default)]
struct Unacked {
    /// (emit number, first record, op id).
    queue: VecDeque<(u64, u64, u64)>,
    first_pos: Positions,
}

impl Unacked {
    fn push(&mut self, emit_no: u64, first_pos: u64, op_id: u64) {
        self.queue.push_back((emit_no, first_pos, op_id));
        self.first_pos.add(first_pos);
    }

    /// The op id of the oldest span if the exporter acknowledged it (`acked` and all before).
    fn pop_acked(&mut self, acked: u64) -> Option<u64> {
        let &(emit_no, pos, id) = self.queue.front()?;
        if emit_no > acked {
            return None;
        }
        self.queue.pop_front();
        self.first_pos.remove(pos);
        Some(id)
    }

    fn oldest_pos(&self) -> Option<u64> {
        self.first_pos.oldest()
    }

    /// Stops waiting on spans whose operations' records lie before `pos` (a forced commit).
    fn forget_before(&mut self, pos: u64) {
        self.queue.retain(|&(_, p, _)| p >= pos);
        self.first_pos.forget_before(pos);
    }

    fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// Operations whose collective's root span is not settled yet ([`RootWait`]), in delivery order,
/// with their first records counted: the tail waits on the oldest. One settled behind one that is
/// not waits with it (a FIFO: the queue is bounded by what the ring holds before a forced commit).
#[derive(Default)]
struct RootHolds {
    queue: VecDeque<(u64, RootWait)>,
    first_pos: Positions,
}

impl RootHolds {
    fn push(&mut self, first_pos: u64, wait: RootWait) {
        self.queue.push_back((first_pos, wait));
        self.first_pos.add(first_pos);
    }

    fn pop_settled(&mut self) {
        while let Some((pos, wait)) = self.queue.front()
            && wait.settled()
        {
            self.first_pos.remove(*pos);
            self.queue.pop_front();
        }
    }

    fn oldest_pos(&self) -> Option<u64> {
        self.first_pos.oldest()
    }

    /// Stops waiting on roots whose operations' records lie before `pos` (a forced commit).
    fn forget_before(&mut self, pos: u64) {
        self.queue.retain(|&(p, _)| p >= pos);
        self.first_pos.forget_before(pos);
    }

    fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// First record positions a segment's tail waits on, each counted as often as it is waited on.
#[derive(Default)]
struct Positions(std::collections::BTreeMap<u64, u32>);

impl Positions {
    fn add(&mut self, pos: u64) {
        *self.0.entry(pos).or_default() += 1;
    }

    fn remove(&mut self, pos: u64) {
        if let Some(n) = self.0.get_mut(&pos) {
            *n -= 1;
            if *n == 0 {
                self.0.remove(&pos);
            }
        }
    }

    fn oldest(&self) -> Option<u64> {
        self.0.keys().next().copied()
    }

    fn forget_before(&mut self, pos: u64) {
        self.0 = self.0.split_off(&pos);
    }
}

pub struct Engine {
    cfg: Arc<Config>,
    segments: Vec<Attached>,
    stats: Stats,
    hub: Arc<Hub>,
    spool: Option<SpoolWriter>,
    /// After `spool`, whose thread may wait on it when dropped.
    states: StateWriter,
    /// Instances the spool writer reported it could not append, as last counted.
    spool_failed: u64,
    out: Outputs,
    started_ns: u64,
    /// Plugin counters per uid (those of segments already reaped) and what the node-wide totals
    /// take in of them.
    plugin: PluginLosses,
    /// Assembler counters of segments already reaped.
    reaped_asm: AssembleCounters,
    daemon_lost: Losses,
    /// Registrations refused, per uid (see [`Refusals`]).
    refusals: Refusals,
    /// Commits past open operations or unacknowledged spans because the ring was over half full.
    forced_commits: u64,
    /// Operations parked (see `Assembler::park`).
    parked_ops: u64,
    /// The time the last tick read records at (what the operations it read were opened at).
    tick_ns: u64,
    collectives: u64,
    /// Dictionary budget of each uid with segments attached (shared by its assemblers).
    uid_budgets: HashMap<u32, Arc<UidBudget>>,
    /// Segments detached as corrupt, refused if handed over again (the most recent
    /// `drain.max_segments`).
    broken: VecDeque<SegmentKey>,
    /// Segments refused for want of room (`drain.max_segments`, or their uid's
    /// `drain.max_segments_per_uid`) or because their file is attached already, each counted once
    /// however often its plugin retries (the most recent `drain.max_segments`); attached once there
    /// is room again, or the other reader of their file is gone.
    refused: VecDeque<SegmentKey>,
    /// Resume state files not yet claimed by a segment: removed once [`STATE_CLAIM_WINDOW`] passed.
    unclaimed_states: Option<Vec<Unclaimed>>,
    /// systemd's file descriptor store, where attached segments are kept across a restart.
    fd_store: bool,
    watchdog: Option<(Duration, Instant)>,
    /// Where every segment's records are copied to be decoded (one buffer: it stays in cache).
    reads: Vec<[u64; ncclscope_proto::record::RECORD_WORDS]>,
    /// Instances completed and not yet delivered, and which segment's they are: runs of `completed`
    /// by segment index (kept in place: moving an instance out costs more than reading it).
    completed: Vec<Completed>,
    completed_runs: Vec<(usize, std::ops::Range<usize>)>,
    /// The root settlements of `completed`, in the order of `completed_runs`, while delivering.
    root_waits: Vec<Option<RootWait>>,
    /// Host clock steps, sampled every tick (see `clock_step`).
    clock: StepDetector,
    last_sweep: Instant,
    last_liveness: Instant,
    last_snapshot: Instant,
    last_metrics_export: Instant,
    started: Instant,
}

impl Engine {
    /// This node's CLOCK_REALTIME, the time base of its ranks' records: shifted by the node's test
    /// clock offset ([`Config::test_clock_offset_ns`]) as theirs are.
    fn now_ns(&self) -> u64 {
        shift(realtime_ns(), self.cfg.test_clock_offset_ns)
    }

    /// Starts the state writer thread (and the spool's, with a spool) for an engine.
    pub fn new(
        cfg: Arc<Config>,
        hub: Arc<Hub>,
        spool: Option<Box<dyn Durable>>,
        out: Outputs,
    ) -> std::io::Result<Engine> {
        let now = Instant::now();
        let started_ns = shift(realtime_ns(), cfg.test_clock_offset_ns);
        let states = StateWriter::start(Box::new(state_writer::Dir(cfg.state_dir.clone())))?;
        Ok(Engine {
            stats: Stats::new(
                cfg.aggregate.rolling_window_s * 1_000_000_000,
                cfg.aggregate.skew_window_ms * 1_000_000,
                cfg.aggregate.max_series,
            )
            .with_rank_limit(cfg.limits.max_rank_series)
            .with_job_limit(cfg.limits.max_job_series),
            cfg,
            segments: Vec::new(),
            spool: spool.and_then(|s| match SpoolWriter::start(s, hub.clone(), states.progress()) {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the spool writer thread; nothing is spooled");
                    None
                }
            }),
            states,
            spool_failed: 0,
            hub,
            out,
            started_ns,
            plugin: PluginLosses::default(),
            reaped_asm: AssembleCounters::default(),
            daemon_lost: Losses::default(),
            refusals: Refusals::default(),
            forced_commits: 0,
            parked_ops: 0,
            tick_ns: 0,
            clock: StepDetector::default(),
            collectives: 0,
            uid_budgets: HashMap::new(),
            broken: VecDeque::new(),
            refused: VecDeque::new(),
            unclaimed_states: None,
            fd_store: crate::notify::fd_store_available(),
            watchdog: crate::notify::watchdog_interval().map(|every| (every, now)),
            reads: Vec::new(),
            completed: Vec::new(),
            completed_runs: Vec::new(),
            root_waits: Vec::new(),
            last_sweep: now,
            last_liveness: now,
            last_snapshot: now,
            last_metrics_export: now,
            started: now,
        })
    }

    /// Drains until `stop` is set; then reads what is left (bounded by the shutdown timeout), commits
    /// and saves every segment's state. Operations still in flight stay uncommitted for the next daemon.
    pub fn run(mut self, registrations: std_mpsc::Receiver<Handover>, stop: Arc<AtomicBool>) {
        let dir = &self.cfg.state_dir;
        let states = resume::list(dir).into_iter().map(|label| {
            let uid = label.parse::<SegmentKey>().map(|k| k.uid);
            let comms = match (uid, resume::load(dir, &label)) {
                (Ok(uid), Ok(Some(st))) => (st.dictionary.comms.iter())
                    .map(|c| (uid, c.comm_hash))
                    .collect(),
                _ => Vec::new(),
            };
            (label, comms)
        });
        self.unclaimed_states = Some(states.collect());
        self.refresh_local_ranks();
        let min = Duration::from_millis(self.cfg.drain.min_interval_ms);
        let max = Duration::from_millis(self.cfg.drain.max_interval_ms);
        let mut interval = min;
        while !stop.load(Ordering::Acquire) {
            while let Ok(h) = registrations.try_recv() {
                self.hand_over(h);
            }
            self.watchdog();
            let busy = self.tick();
            interval = if busy { min } else { (interval * 2).min(max) };
            std::thread::sleep(interval);
        }
        let deadline = Instant::now() + self.cfg.shutdown_timeout();
        while self.tick() && Instant::now() < deadline {
            if self.spool_behind() {
                std::thread::sleep(min);
            }
        }
        // What the spool writer holds, durable before the last states are saved.
        if let Some(spool) = &self.spool {
            spool.flush(deadline.saturating_duration_since(Instant::now()));
        }
        // Wait for the exporter's acknowledgements, so a clean restart re-sends nothing.
        while self.segments.iter().any(|s| !s.unacked.is_empty()) && Instant::now() < deadline {
            std::thread::sleep(min);
            self.tick();
        }
        self.collect_spooled();
        self.commit_all(true);
        self.snapshot(true);
        tracing::info!(segments = self.segments.len(), "ingest stopped");
    }

    /// Takes what the registration socket (or the start-up restore) hands over.
    pub fn hand_over(&mut self, h: Handover) {
        match h {
            Handover::Attach(a) => {
                let r = self.attach(a.key, a.segment, a.conn);
                if let Some(reply) = a.reply {
                    let _ = reply.send(r);
                } else if let Err(e) = r {
                    tracing::warn!(segment = %a.key, error = %e, "restored segment not attached");
                }
            }
            Handover::Refused { uid, stage } => self.refusals.add(uid, stage),
        }
    }

    /// Counts (and logs) a segment refused under `stage` (no room for it, or its file attached
    /// already), once however often it is retried.
    fn count_refusal(&mut self, key: SegmentKey, stage: Loss, why: &str) {
        if !self.refused.contains(&key) {
            if let Some(held_back) = crate::ratelimit::lines().allow(key.uid) {
                tracing::warn!(segment = %key, reason = %why, held_back, "segment refused; attached if handed over again once it may be");
            }
            remember(&mut self.refused, key, self.cfg.drain.max_segments);
            self.refusals.add(key.uid, stage);
        }
    }

    /// Pings systemd's watchdog when it is due (from the ingest loop: a stuck ingest stops the pings).
    fn watchdog(&mut self) {
        if let Some((every, last)) = &mut self.watchdog
            && last.elapsed() >= *every / 2
        {
            *last = Instant::now();
            if let Err(e) = crate::notify::notify("WATCHDOG=1", &[]) {
                tracing::warn!(error = %e, "watchdog ping failed");
            }
        }
    }

    /// Attaches `segment` of `key` unless it is attached already (then its connection is replaced:
    /// the process reconnected). `conn`: the registering connection, `None` if the process ended.
    pub fn attach(
        &mut self,
        key: SegmentKey,
        segment: Segment,
        conn: Option<OwnedFd>,
    ) -> Result<(), String> {
        let label = key.to_string();
        if let Some(s) = self.segments.iter_mut().find(|s| s.key == key) {
            if conn.is_some() {
                s.exited = false;
                s.conn = conn;
            }
            return Ok(());
        }
        if self.broken.contains(&key) {
            return Err("the segment was detached as corrupt".into());
        }
        let file = segment.file_id();
        if let Some(s) = (self.segments.iter()).find(|s| s.consumer.segment().file_id() == file) {
            let why = format!(
                "its memory file is attached already, handed over by pid {}",
                s.key.pid
            );
            self.count_refusal(key, Loss::SegmentDuplicate, &why);
            return Err(why);
        }
        if self.segments.len() >= self.cfg.drain.max_segments {
            let why = format!(
                "daemon is at drain.max_segments = {}",
                self.cfg.drain.max_segments
            );
            self.count_refusal(key, Loss::SegmentsRefused, &why);
            return Err(why);
        }
        // The uid is the registering peer's (SO_PEERCRED), which created the memory file.
        let uid = key.uid;
        let of_uid = self.segments.iter().filter(|s| s.key.uid == uid).count();
        if of_uid >= self.cfg.drain.max_segments_per_uid {
            let why = format!(
                "uid {uid} already has {of_uid} segments attached (drain.max_segments_per_uid = {})",
                self.cfg.drain.max_segments_per_uid
            );
            self.count_refusal(key, Loss::UidSegmentQuota, &why);
            return Err(why);
        }
        let claims = segment.claims();
        let pod = segment.pod();
        let job: JobKey = (uid, claims.job_id.clone());
        self.uid_budgets.retain(|_, b| Arc::strong_count(b) > 1);
        let budget = (self.uid_budgets.entry(uid))
            .or_insert_with(|| UidBudget::new(self.cfg.limits.uid_max_dictionary))
            .clone();
        let mut asm = Assembler::new(
            key.pid,
            uid,
            claims.job_id.clone(),
            claims.hostname.clone(),
            self.cfg.aggregate.max_pending_ops,
        )
        .with_limits(self.cfg.limits.clone())
        .with_uid_budget(budget)
        .with_pod(pod)
        .with_slurm_job(claims.slurm_job_id.clone());
        let mut state_saved = false;
        let mut spool_mark = None;
        let mut saved_parked = (Vec::new(), 0);
        let mut consumer = Consumer::new(segment);
        match resume::load(&self.cfg.state_dir, &label) {
            Ok(Some(st)) if finish_commit(&mut consumer, st.tail) => {
                let tail = consumer.segment().tail();
                let mut delivered = st.delivered;
                if let Some(spool) = &self.spool {
                    // Spooled by the previous daemon after it saved this state: recorded already.
                    match spool.recorded_since(&job, st.spool_mark) {
                        Ok(origins) => {
                            mark_recorded(&mut delivered, &key, tail, &st.parked, origins)
                        }
                        Err(e) => {
                            tracing::warn!(segment = %label, error = %e, "cannot read the spool back; what it holds past the saved state may be recorded twice");
                            self.daemon_lost.add(Loss::SpoolUnreadable, 1);
                        }
                    }
                }
                asm.restore(st.dictionary, delivered);
                asm.restore_parked(&st.parked, st.parked_upto, self.now_ns());
                state_saved = true;
                spool_mark = st.spool_mark;
                saved_parked = (st.parked, st.parked_upto);
            }
            Ok(Some(_)) | Ok(None) => {
                if consumer.segment().tail() > 0 {
                    // Records before the tail defined strings and communicators we no longer know.
                    tracing::warn!(segment = %label, "no resume state for a partly consumed segment");
                    self.daemon_lost.add(Loss::ResumeStateMissing, 1);
                }
            }
            Err(e) => {
                tracing::warn!(segment = %label, error = %e, "unreadable resume state; starting without it");
                self.daemon_lost.add(Loss::ResumeStateMissing, 1);
            }
        }
        tracing::info!(segment = %label, pid = key.pid, uid, job = %claims.job_id, tail = consumer.segment().tail(), head = consumer.segment().head(), restored = conn.is_none(), "segment attached");
        self.refused.retain(|k| *k != key);
        if let Some(states) = &mut self.unclaimed_states {
            states.retain(|s| s.0 != label);
        }
        if self.fd_store {
            // Kept across a restart by systemd: the memory file, and the connection whose end tells
            // the next daemon that the process ended (systemd drops a stored socket once it hangs up).
            let fds: Vec<_> = std::iter::once(consumer.segment().fd())
                .chain(conn.as_ref().map(|c| c.as_fd()))
                .collect();
            let name = crate::notify::segment_fd_name(&label);
            if let Err(e) = crate::notify::notify(&format!("FDSTORE=1\nFDNAME={name}"), &fds) {
                tracing::warn!(segment = %label, error = %e, "cannot keep the segment in systemd's file descriptor store");
            }
        }
        let tail = consumer.segment().tail();
        let exited = conn.is_none();
        self.plugin.attached(uid);
        self.segments.push(Attached {
            key,
            label,
            conn,
            job,
            consumer,
            asm,
            tail,
            saving: VecDeque::new(),
            resave: false,
            on_disk: state_saved,
            read_upto: tail,
            acked: Arc::new(AtomicU64::new(0)),
            next_emit: 1,
            unacked: Unacked::default(),
            roots: RootHolds::default(),
            delivered: HashMap::default(),
            last_commit: Instant::now(),
            dirty: false,
            state_saved,
            dict_changed: false,
            dict_saved_at: Instant::now(),
            dict_save_cost: Duration::ZERO,
            spool_mark,
            saved_parked,
            spooling: VecDeque::new(),
            gaps: 0,
            exited,
            roots_only_since: None,
            plugin_lost: [0; Counter::ALL.len()],
        });
        self.refresh_local_ranks();
        Ok(())
    }

    /// Marks the segments whose process ended: the kernel closed its end of the registration
    /// connection (a forked child does not keep it: the plugin closes the child's copy).
    fn check_ended(&mut self) {
        let mut buf = [0u8; 64];
        for seg in &mut self.segments {
            let Some(conn) = &seg.conn else { continue };
            match rustix::net::recv(conn, &mut buf, rustix::net::RecvFlags::DONTWAIT) {
                // The plugin sends nothing after its request: anything else is ignored.
                Ok((_, 1..)) | Err(rustix::io::Errno::AGAIN) => {}
                Ok((_, 0)) | Err(_) => {
                    seg.exited = true;
                    seg.conn = None;
                }
            }
        }
        // Resume state of segments that were not handed over again after a restart: their process
        // ended while no daemon ran, and their segment with it.
        if self.started.elapsed() >= STATE_CLAIM_WINDOW
            && let Some(states) = self.unclaimed_states.take()
        {
            for (stale, _) in states {
                resume::remove(&self.cfg.state_dir, &stale);
            }
            self.refresh_local_ranks();
        }
    }

    /// The ranks of each (uid, communicator) on this node: those of attached segments, and after a
    /// restart those of segments not handed over again yet (their plugins retry within seconds;
    /// without them, a rank that came back first would meet no other and its collectives' roots
    /// would wait for it in vain).
    fn refresh_local_ranks(&mut self) {
        let mut m: HashMap<(u32, u64), usize> = HashMap::new();
        for s in &self.segments {
            // Finalized communicators count too: their last collectives may still be awaited.
            for c in s.asm.all_comms() {
                *m.entry((s.asm.names().uid, c.comm_hash)).or_default() += 1;
            }
        }
        for (_, comms) in self.unclaimed_states.iter().flatten() {
            for &comm in comms {
                *m.entry(comm).or_default() += 1;
            }
        }
        self.stats.set_local_ranks(m);
    }

    /// One pass over every segment. Returns whether any segment had a full batch (more is waiting).
    pub fn tick(&mut self) -> bool {
        // Before this tick's instances: those the processes timed near a step meet it in the skew.
        if let Some(step) = self.clock.sample() {
            tracing::warn!(
                delta_ms = step.delta_ns / 1_000_000,
                "host clock stepped: collectives near it left out of the skew"
            );
            let at_ns = shift(step.at_ns, self.cfg.test_clock_offset_ns);
            self.stats.clock_stepped(at_ns, step.delta_ns);
        }
        let now = self.now_ns();
        self.tick_ns = now;
        // A spool writer that fell behind (a slow disk) holds reading, not this thread: the records
        // wait in the rings meanwhile.
        let spool_behind = self.spool_behind();
        let batch = match spool_behind {
            true => 0,
            false => self.cfg.drain.batch_records,
        };
        let mut busy = spool_behind;
        let mut comms_changed = false;
        let mut broken = Vec::new();
        for i in 0..self.segments.len() {
            let seg = &mut self.segments[i];
            // A batch is read in chunks that stay in cache between decoding and assembly.
            let mut left = batch;
            while left > 0 {
                let want = left.min(READ_CHUNK);
                let (first, reads) = match seg.consumer.read_raw(want, &mut self.reads) {
                    Ok(r) => r,
                    Err(e) => {
                        if let Some(held_back) = crate::ratelimit::lines().allow(seg.key.uid) {
                            tracing::error!(segment = %seg.label, error = %e, held_back, "corrupt segment detached");
                        }
                        broken.push(i);
                        break;
                    }
                };
                let n = reads.len();
                left -= n;
                for (pos, words) in (first..).zip(reads) {
                    seg.read_upto = pos + 1;
                    match ncclscope_proto::Record::decode(words) {
                        Ok(ref rec) => seg.asm.apply(pos, rec, now, &mut self.completed),
                        Err(_) => seg.asm.counters.decode_errors += 1,
                    }
                }
                if n < want {
                    break;
                }
            }
            busy |= left == 0;
            seg.observe_plugin_counters();
            if seg.observe_gaps() {
                self.parked_ops += seg.asm.park(seg.read_upto, u64::MAX);
            }
            comms_changed |= seg.asm.take_comms_changed();
            self.end_run(i);
            // With many busy segments, deliver while what was assembled is still in cache.
            if self.completed.len() >= DELIVER_AT {
                if std::mem::take(&mut comms_changed) {
                    self.refresh_local_ranks();
                }
                self.deliver(now);
            }
        }
        if self.last_sweep.elapsed() >= SWEEP_EVERY {
            self.last_sweep = Instant::now();
            let timeout = self.cfg.aggregate.op_timeout_ms * 1_000_000;
            if self.last_liveness.elapsed() >= LIVENESS_EVERY {
                self.last_liveness = Instant::now();
                self.check_ended();
            }
            for i in 0..self.segments.len() {
                let seg = &mut self.segments[i];
                seg.asm.sweep(now, timeout, &mut self.completed);
                if seg.exited && seg.consumer.pending() == 0 {
                    seg.asm.finish_all(&mut self.completed);
                }
                self.end_run(i);
            }
            self.stats.expire(now);
        }
        if comms_changed {
            self.refresh_local_ranks();
        }
        self.deliver(now);
        self.send_roots_due();
        // After delivery: what a segment held before it proved corrupt is still delivered.
        for i in broken.into_iter().rev() {
            let seg = self.segments.remove(i);
            self.daemon_lost.add(Loss::CorruptSegment, 1);
            // Not attached again if handed over again: its cursors cannot be trusted.
            remember(&mut self.broken, seg.key, self.cfg.drain.max_segments);
            self.forget(&seg);
            self.retire(seg);
        }
        self.collect_spooled();
        self.collect_states();
        self.collect_acks();
        self.commit_all(false);
        self.reap();
        if self.last_snapshot.elapsed() >= SNAPSHOT_EVERY {
            self.snapshot(false);
        }
        busy
    }

    /// Waits (at most `timeout` each) until the spool writer and the state writer made everything
    /// queued durable, and takes note of it (committing the tails that waited for states); whether
    /// they did. Shutdown does this; tests and benchmarks that read the spool too.
    pub fn flush(&mut self, timeout: Duration) -> bool {
        let flushed = self.spool.as_ref().is_none_or(|s| s.flush(timeout));
        self.collect_spooled();
        let saved = self.states.flush(timeout);
        self.collect_states();
        flushed && saved
    }

    /// Whether reading waits for the spool writer (see [`BACKLOG_PAUSE`]).
    pub fn spool_behind(&self) -> bool {
        (self.spool.as_ref()).is_some_and(|s| s.backlog() >= BACKLOG_PAUSE)
    }

    /// Marks the instances completed since the last run as segment `i`'s.
    fn end_run(&mut self, i: usize) {
        let start = self.completed_runs.last().map_or(0, |r| r.1.end);
        if self.completed.len() > start {
            self.completed_runs.push((i, start..self.completed.len()));
        }
    }

    /// Statistics, then the spool (queued for the writer thread, which publishes to the hub once
    /// the instances are durable; without a spool, published here), then the export queue. An
    /// operation enters `delivered` (the saved state's "recorded") only once its batch is durable
    /// (see [`Self::collect_spooled`]); until then it holds its segment's tail.
    fn deliver(&mut self, now: u64) {
        if self.completed.is_empty() {
            return;
        }
        let mut completed = std::mem::take(&mut self.completed);
        let mut runs = std::mem::take(&mut self.completed_runs);
        // Each instance's root settlement to wait on, in the order of `runs` (taken in the next pass).
        let mut waits = std::mem::take(&mut self.root_waits);
        // Statistics first, for the live-export decision ("slow" is judged against the series before
        // the instance joins it), which the spool keeps so that a file export writes the same spans.
        // Nothing outside the engine reads the statistics before this pass ends (snapshots come after
        // it), so what they count is still queued for the spool first.
        for (i, range) in &runs {
            let names = self.segments[*i].asm.names();
            for c in &mut completed[range.clone()] {
                let inst = InstanceRef {
                    inst: &c.coll,
                    names,
                };
                let otlp = &self.cfg.otlp;
                let observed = if c.prior & done::RECORDED != 0 {
                    // Re-read after a restart: counted by the daemon that recorded it (the
                    // slow-outlier verdict is gone with its statistics); it meets its collective's
                    // other ranks again, whose records waited for the root as its did.
                    let key = crate::spans::instance_key(inst);
                    let live = live_spans(otlp, false, inst.comm_hash, key);
                    let mut o = self.stats.rejoin(inst, now, live);
                    if c.prior & done::EXPORTED != 0 {
                        // Sent: only a root it carries for the node's ranks goes now (one it
                        // carried alone went with its own span).
                        o.live_spans = LiveSpans::None;
                        if o.root_wait.is_none() {
                            o.trace_root = None;
                        }
                    }
                    o
                } else {
                    self.stats.observe(inst, now, SLOW_MIN_SAMPLES, |p50, key| {
                        let slow = otlp.slow_factor > 0.0
                            && p50.is_some_and(|p50| {
                                inst.exec_ns as f64 > otlp.slow_factor * p50 as f64
                            });
                        live_spans(otlp, slow, inst.comm_hash, key)
                    })
                };
                c.coll.live_spans = observed.live_spans;
                c.coll.trace_root = observed.trace_root;
                c.coll.local_lateness_ns = observed.local_lateness_ns;
                waits.push(observed.root_wait);
            }
        }
        let mut waits_in_order = waits.drain(..);
        // The last state the spool writer must write this batch after (see `Attached::on_disk`).
        let mut after = 0;
        if let Some(spool) = &self.spool {
            // Write-ahead: the saved state's spool mark must precede what the segment queues now.
            for (i, range) in &runs {
                let seg = &mut self.segments[*i];
                let end = spool.end(&seg.job);
                if mark_stale(seg.spool_mark, Some(end))
                    && completed[range.clone()]
                        .iter()
                        .any(|c| c.prior & done::RECORDED == 0)
                {
                    // The parked operations as last saved (for this tail): some may have
                    // completed in this very batch, and are recorded (or not) only by what follows.
                    let parked = Parked::AsSaved;
                    let mark = spool_mark(seg, spool);
                    if let Err(e) = save_state(&mut self.states, seg, seg.tail, Some(mark), parked)
                    {
                        tracing::error!(segment = %seg.label, error = %e, "cannot save resume state before spooling; a crash now could record these instances twice");
                        self.daemon_lost.add(Loss::StateWriteFailed, 1);
                    }
                }
            }
        }
        let mut batch = Vec::new();
        // Per segment index: (the spool's end before this batch, its operations in the batch).
        let mut spooled: Vec<(usize, Position, Vec<OpDone>)> = Vec::new();
        for (i, range) in runs.drain(..) {
            let seg = &mut self.segments[i];
            let names = seg.asm.names();
            let mut ops = Vec::new();
            let mut items = match &self.spool {
                Some(spool) => spool.buffer(),
                None => Vec::new(),
            };
            for c in &mut completed[range] {
                let mut flags = c.prior;
                let fresh = c.prior & done::RECORDED == 0;
                if fresh {
                    if self.spool.is_none() {
                        self.hub.publish(&c.coll, names);
                    }
                    self.collectives += 1;
                    flags |= done::RECORDED;
                }
                if c.coll.live_spans == LiveSpans::None && c.coll.trace_root.is_none() {
                    flags |= done::EXPORTED;
                }
                // The root this instance waits on, and the one it carries (settled once its export
                // ends); without an exporter there is nothing to wait for.
                let wait = waits_in_order.next().flatten();
                let carried = wait.clone().filter(|_| c.coll.trace_root.is_some());
                if let Some(w) = wait
                    && !w.settled()
                {
                    match &self.out.spans {
                        // Not a graph replay's: a tail held back by its root re-reads more of a
                        // replayed graph after a kill, and resuming its template from there lost
                        // replays (`daemon_e2e::a_daemon_killed_mid_replay...`, 3 of 6 runs).
                        Some(_) if c.coll.replay > 0 => {}
                        // Records a forced commit already freed cannot be read again.
                        Some(_) if c.first_pos >= seg.tail => seg.roots.push(c.first_pos, w),
                        Some(_) => {}
                        None => w.settle(),
                    }
                }
                let to_spool = fresh && self.spool.is_some();
                if flags & done::EXPORTED == 0 || c.coll.trace_root.is_some() {
                    match &self.out.spans {
                        Some(tx) => {
                            let emit_no = seg.next_emit;
                            let inst = match to_spool {
                                true => c.coll.clone(),
                                false => std::mem::take(&mut c.coll),
                            };
                            let coll = Shared {
                                inst,
                                names: names.clone(),
                            };
                            match tx.try_send(SpanItem {
                                coll,
                                acked: Some(seg.acked.clone()),
                                emit_no,
                                settles: carried,
                            }) {
                                Ok(()) => {
                                    seg.next_emit += 1;
                                    // Records a forced commit already freed cannot be read again.
                                    if c.first_pos >= seg.tail {
                                        seg.unacked.push(emit_no, c.first_pos, c.op_id);
                                    }
                                }
                                Err(e) => {
                                    self.daemon_lost.add(Loss::ExportQueueFull, 1);
                                    flags |= done::EXPORTED;
                                    let item = e.into_inner();
                                    if let Some(root) = item.settles {
                                        root.settle();
                                    }
                                    if let Some(d) = &self.out.dropped {
                                        let c = item.coll;
                                        let v = c.view();
                                        let key = crate::resend::key(v);
                                        d.remember(
                                            v.uid(),
                                            v.job_id(),
                                            key,
                                            &self.out.export_counters,
                                        );
                                    }
                                }
                            }
                        }
                        None => flags |= done::EXPORTED,
                    }
                }
                if to_spool {
                    let origin = Origin {
                        uid: seg.key.uid,
                        pid: seg.key.pid,
                        inode: seg.key.inode,
                        op_id: c.op_id,
                        first_pos: c.first_pos,
                    };
                    items.push((origin, std::mem::take(&mut c.coll)));
                    ops.push((c.op_id, c.first_pos, flags));
                } else {
                    seg.delivered.insert(c.op_id, (c.first_pos, flags));
                    seg.dirty = true;
                }
            }
            if let Some(spool) = &self.spool
                && !ops.is_empty()
            {
                if !seg.on_disk
                    && let Some(&(no, _)) = seg.saving.back()
                {
                    after = after.max(no);
                }
                spooled.push((i, spool_mark(seg, spool), ops));
                let names = names.clone();
                batch.push(SpoolRun { names, items });
            }
        }
        completed.clear();
        drop(waits_in_order);
        self.completed = completed;
        self.completed_runs = runs;
        self.root_waits = waits;
        let Some(spool) = &mut self.spool else {
            return;
        };
        if batch.is_empty() {
            return;
        }
        let queued = spool.queue(batch, after);
        for (i, mark, ops) in spooled {
            let seg = &mut self.segments[i];
            match queued {
                Ok(no) => seg.spooling.push_back(Spooling {
                    batch: no,
                    mark,
                    first_pos: ops.iter().map(|o| o.1).min().unwrap_or(u64::MAX),
                    ops,
                }),
                Err(_) => {
                    // Recorded without the spool (counted), as when an append fails.
                    for (id, pos, flags) in ops {
                        seg.delivered.insert(id, (pos, flags));
                    }
                    seg.dirty = true;
                }
            }
        }
        if let Err(batch) = queued {
            let n: usize = batch.iter().map(|r| r.items.len()).sum();
            tracing::warn!(n, "spool writer behind; instances not spooled");
            self.daemon_lost.add(Loss::SpoolBacklog, n as u64);
            for run in &batch {
                for (_, inst) in &run.items {
                    self.hub.publish(inst, &run.names);
                }
            }
        }
    }

    /// Sends the root spans of collectives whose skew window closed before every local rank came
    /// ([`Stats::take_roots_due`]); their ranks' records wait until the export ends. A root the
    /// export queue refuses is counted there (`export_queue_full`) and waited on no longer.
    fn send_roots_due(&mut self) {
        for (coll, wait) in self.stats.take_roots_due() {
            let Some(tx) = &self.out.spans else {
                wait.settle();
                continue;
            };
            let item = SpanItem {
                coll,
                acked: None,
                emit_no: 0,
                settles: Some(wait),
            };
            if let Err(e) = tx.try_send(item) {
                self.daemon_lost.add(Loss::ExportQueueFull, 1);
                if let Some(w) = e.into_inner().settles {
                    w.settle();
                }
            }
        }
    }

    /// Moves the operations of batches the spool writer made durable into `delivered`, and counts
    /// the instances it could not append.
    fn collect_spooled(&mut self) {
        let Some(spool) = &self.spool else {
            return;
        };
        let durable = spool.durable();
        for seg in &mut self.segments {
            while seg.spooling.front().is_some_and(|s| s.batch <= durable) {
                let s = seg.spooling.pop_front().expect("checked");
                for (id, pos, flags) in s.ops {
                    seg.delivered.insert(id, (pos, flags));
                }
                seg.dirty = true;
            }
        }
        let failed = spool.failed();
        if failed > self.spool_failed {
            self.daemon_lost
                .add(Loss::SpoolFailed, failed - self.spool_failed);
            self.spool_failed = failed;
        }
    }

    /// Moves each segment's ring tail to that of its newest state the state writer made durable;
    /// counts the states it could not write, whose segments save again at their next commit (their
    /// tails wait meanwhile).
    fn collect_states(&mut self) {
        // Before the failures: every failure up to it is reported by then.
        let durable = self.states.durable();
        for (label, no) in self.states.take_failed() {
            self.daemon_lost.add(Loss::StateWriteFailed, 1);
            if let Some(seg) = self.segments.iter_mut().find(|s| s.label == label) {
                seg.saving.retain(|&(n, _)| n > no);
                seg.resave = true;
            }
        }
        for seg in &mut self.segments {
            let mut tail = None;
            while let Some(&(no, t)) = seg.saving.front()
                && no <= durable
            {
                seg.saving.pop_front();
                tail = Some(t);
            }
            if let Some(t) = tail {
                seg.consumer.commit(t);
                seg.on_disk = true;
            }
        }
    }

    fn collect_acks(&mut self) {
        for seg in &mut self.segments {
            seg.roots.pop_settled();
            let acked = seg.acked.load(Ordering::Acquire);
            while let Some(id) = seg.unacked.pop_acked(acked) {
                if let Some(e) = seg.delivered.get_mut(&id) {
                    e.1 |= done::EXPORTED;
                    seg.dirty = true;
                } else if let Some(op) =
                    (seg.spooling.iter_mut()).find_map(|s| s.ops.iter_mut().find(|o| o.0 == id))
                {
                    op.2 |= done::EXPORTED; // acknowledged before the spool made it durable
                }
            }
        }
    }

    /// Saves state and commits each segment whose commit point moved (at most every [`COMMIT_EVERY`]
    /// unless `now` or the ring is a quarter full). With `now` (shutdown), waits (bounded by the
    /// shutdown timeout) until the states are durable and the tails committed.
    fn commit_all(&mut self, now: bool) {
        let now_ns = self.now_ns();
        for seg in &mut self.segments {
            // Operations open long (sooner once the ring is over half full) no longer hold the
            // tail: the state carries them. Not younger ones even then: they mostly complete within
            // a few ticks, and parking them would save the state at every commit (a forced commit
            // passes them instead).
            let after = match ring_pressed(seg) {
                true => PARK_PRESSED,
                false => PARK_AFTER,
            };
            let read_before = (now_ns.saturating_sub(after.as_nanos() as u64)).min(self.tick_ns);
            self.parked_ops += seg.asm.park(seg.read_upto, read_before);
            let end = self.spool.as_ref().map(|s| spool_mark(seg, s));
            commit(
                &mut self.states,
                seg,
                now,
                end,
                &mut self.daemon_lost,
                &mut self.forced_commits,
            );
        }
        if now {
            self.states.flush(self.cfg.shutdown_timeout());
            self.collect_states();
        }
    }

    /// Detaches segments whose process exited once everything they held is delivered.
    /// Its roots' settlements hold such a segment at most the skew window more: every root of its
    /// collectives was sent by then (or known not to come), and only a kill before the exporter is
    /// done with it could lose one (a receiver that stays away holds the exporter for its retries).
    fn reap(&mut self) {
        let grace = Duration::from_millis(self.cfg.aggregate.skew_window_ms);
        let mut i = 0;
        while i < self.segments.len() {
            let s = &mut self.segments[i];
            let delivered = s.exited
                && s.consumer.pending() == 0
                && s.asm.pending() == 0
                && s.unacked.is_empty()
                && s.spooling.is_empty();
            if !delivered {
                s.roots_only_since = None;
            }
            let since = match delivered && !s.roots.is_empty() {
                true => *s.roots_only_since.get_or_insert_with(Instant::now),
                false => Instant::now(),
            };
            let drained = delivered && (s.roots.is_empty() || since.elapsed() >= grace);
            if drained {
                let mut seg = self.segments.remove(i);
                let end = self.spool.as_ref().map(|s| spool_mark(&seg, s));
                commit(
                    &mut self.states,
                    &mut seg,
                    true,
                    end,
                    &mut self.daemon_lost,
                    &mut self.forced_commits,
                );
                self.forget(&seg);
                tracing::info!(segment = %seg.label, "process exited; segment drained and dropped");
                self.retire(seg);
                self.refresh_local_ranks();
            } else {
                i += 1;
            }
        }
    }

    /// Removes what would bring a detached segment back: its resume state (once the states queued
    /// for it are written, so none comes back after) and its descriptors in systemd's store. The
    /// mapping and the memory file go with the [`Attached`] value.
    fn forget(&self, seg: &Attached) {
        if let Some(&(no, _)) = seg.saving.back()
            && !self.states.wait(no, FORGET_WAIT)
        {
            tracing::warn!(segment = %seg.label, "resume state still being written; it may outlive its segment until the next restart");
        }
        resume::remove(&self.cfg.state_dir, &seg.label);
        if self.fd_store {
            let name = crate::notify::segment_fd_name(&seg.label);
            if let Err(e) = crate::notify::notify(&format!("FDSTOREREMOVE=1\nFDNAME={name}"), &[]) {
                tracing::warn!(segment = %seg.label, error = %e, "cannot remove the segment from systemd's file descriptor store");
            }
        }
    }

    fn retire(&mut self, mut seg: Attached) {
        seg.observe_plugin_counters();
        let attached: Vec<u32> = self.segments.iter().map(|s| s.key.uid).collect();
        (self.plugin).detached(seg.key.uid, &seg.plugin_lost, &attached);
        self.reaped_asm.add(&seg.asm.counters);
    }

    /// The daemon's health: plugin counters of every segment seen plus the daemon's own.
    pub fn health(&self) -> Health {
        let mut asm = self.reaped_asm;
        // Saturating: one uid's counters can raise its own figure to the maximum, never wrap it.
        let mut attached: HashMap<u32, PluginCounts> = HashMap::new();
        let mut max_cal = 0u32;
        for s in &self.segments {
            asm.add(&s.asm.counters);
            let sum = attached.entry(s.key.uid).or_insert([0; Counter::ALL.len()]);
            for (t, v) in sum.iter_mut().zip(s.plugin_lost) {
                *t = t.saturating_add(v);
            }
            max_cal = max_cal.max(s.asm.max_calibration_error_ns());
        }
        let by_uid = self.plugin.by_uid(&attached);
        let node = self.plugin.node(&by_uid, Instant::now());
        let mut lost = std::collections::BTreeMap::new();
        let mut plugin_lost_by_uid = std::collections::BTreeMap::new();
        for c in Counter::ALL {
            lost.insert(c.name().to_string(), node[c as usize]);
            // Every stage of a uid with a segment attached (a first loss then shows as an increase);
            // a detached uid's non-zero ones.
            for (&uid, counts) in &by_uid {
                let v = counts[c as usize];
                if v > 0 || attached.contains_key(&uid) {
                    plugin_lost_by_uid.insert((uid, c.name()), v);
                }
            }
        }
        let ec = &self.out.export_counters;
        lost.insert(
            "export_dropped".into(),
            ec.spans_dropped.load(Ordering::Relaxed),
        );
        lost.insert(
            "export_not_resent".into(),
            ec.not_resent.load(Ordering::Relaxed),
        );
        for (stage, n) in asm.losses() {
            lost.insert(stage.into(), n);
        }
        lost.insert(
            "dev_unjoined".into(),
            (asm.dev_work)
                .saturating_sub(asm.dev_joined)
                .saturating_sub(asm.dev_unattributed)
                .saturating_sub(asm.dev_ambiguous)
                .saturating_sub(asm.dev_p2p),
        );
        lost.insert("rank_series_limit".into(), self.stats.rank_series_refused);
        // Every stage, exported from the start (not only once one happened); each uid's refusals
        // within its bound.
        let refused = self.refusals.node(Instant::now());
        for ((stage, n), (_, r)) in self.daemon_lost.iter().zip(refused.iter()) {
            lost.insert(stage.into(), n.saturating_add(r));
        }
        Health {
            segments: self.segments.len() as u64,
            records_in: asm.records,
            decode_errors: asm.decode_errors,
            collectives: self.collectives,
            lost,
            spans_exported: ec.spans_exported.load(Ordering::Relaxed),
            export_resent: ec.resent.load(Ordering::Relaxed),
            export_errors: ec.export_errors.load(Ordering::Relaxed),
            max_calibration_error_ns: max_cal,
            dev_work: asm.dev_work.saturating_sub(asm.dev_p2p),
            dev_joined: asm.dev_joined,
            forced_commits: self.forced_commits,
            parked_ops: self.parked_ops,
            clock_steps: self.clock.steps,
            skew_clock_step: self.stats.skew_clock_step,
            plugin_lost_by_uid,
            refused_by_uid: self.refusals.by_uid(),
        }
    }

    /// Refreshes the hub's stats/jobs snapshots and the metrics (Prometheus text, OTLP when due).
    fn snapshot(&mut self, final_export: bool) {
        self.last_snapshot = Instant::now();
        self.stats
            .evict_idle(self.now_ns(), SERIES_IDLE.as_nanos() as u64);
        let health = self.health();
        let mut lost_by_rank = HashMap::new();
        let mut jobs: HashMap<(u32, String), Job> = HashMap::new();
        for s in &self.segments {
            // Saturating, over the highest values shown: the owner writes these words (a sum that
            // overflowed stopped the ingest thread where overflow is checked).
            let lost = (Counter::ALL.iter())
                .filter(|c| c.is_loss())
                .fold(0u64, |t, &c| t.saturating_add(s.plugin_lost[c as usize]));
            let uid = s.asm.names().uid;
            let job = jobs
                .entry((uid, s.asm.job_id().to_string()))
                .or_insert_with(|| Job {
                    uid,
                    job_id: s.asm.job_id().to_string(),
                    live: true,
                    ..Default::default()
                });
            for c in s.asm.comms() {
                lost_by_rank.insert((uid, Arc::from(s.asm.job_id()), c.comm_hash, c.rank), lost);
                let idx = match job
                    .communicators
                    .iter()
                    .position(|x| x.comm_hash == c.comm_hash)
                {
                    Some(i) => i,
                    None => {
                        job.communicators.push(Communicator {
                            comm_hash: c.comm_hash,
                            name: s.asm.string(c.name),
                            nranks: c.nranks,
                            nnodes: c.nnodes,
                            ranks: Vec::new(),
                        });
                        job.communicators.len() - 1
                    }
                };
                job.communicators[idx].ranks.push(RankInfo {
                    rank: c.rank,
                    pid: s.asm.pid(),
                    cuda_dev: c.cuda_dev,
                    timing_path: if c.device_hook {
                        "device_hook"
                    } else {
                        "kernel_ch"
                    }
                    .into(),
                });
            }
        }
        for ((uid, job_id), (n, first, last)) in self.stats.jobs() {
            let job = jobs
                .entry((uid, job_id.to_string()))
                .or_insert_with(|| Job {
                    uid,
                    job_id: job_id.to_string(),
                    ..Default::default()
                });
            job.collectives = n;
            job.first_unix_ns = first;
            job.last_unix_ns = last;
        }
        let mut jobs: Vec<Job> = jobs.into_values().collect();
        jobs.sort_by(|a, b| (a.uid, &a.job_id).cmp(&(b.uid, &b.job_id)));
        for j in &mut jobs {
            j.communicators.sort_by_key(|c| c.comm_hash);
            for c in &mut j.communicators {
                c.ranks.sort_by_key(|r| r.rank);
            }
        }
        self.hub.set_jobs(ListJobsResponse { jobs });
        self.hub.set_stats(StatsResponse {
            colls: self.stats.coll_stats(),
            ranks: self.stats.rank_stats(&lost_by_rank),
            p2p: self.stats.p2p_stats(),
            health: Some(ApiHealth {
                segments: health.segments,
                records_in: health.records_in,
                decode_errors: health.decode_errors,
                lost: health.lost.clone().into_iter().collect(),
                export_errors: health.export_errors,
                spans_exported: health.spans_exported,
                max_calibration_error_ns: health.max_calibration_error_ns,
            }),
        });
        let snapshot = Arc::new(prometheus::Snapshot::new(metrics::families(
            &self.stats,
            &health,
            &self.out.host_name,
        )));
        let _ = self.out.prometheus.send(snapshot.clone());
        if let Some(tx) = &self.out.metrics {
            let due = self.last_metrics_export.elapsed()
                >= Duration::from_millis(self.cfg.otlp.metrics_interval_ms);
            if due || final_export {
                self.last_metrics_export = Instant::now();
                let metrics = metrics::to_otlp(&snapshot.families, self.started_ns, self.now_ns());
                let _ = tx.try_send(metrics);
            }
        }
    }
}

/// Whether a state saved for a committed tail of `state_tail` applies to the consumer's segment, after
/// finishing its commit if a kill came between saving the state and committing the tail (the state is
/// saved first): the records up to `state_tail` were applied and what they completed delivered, so the
/// consumer skips them. A state past what the segment holds, or a segment that cannot be read to it,
/// does not apply.
fn finish_commit(consumer: &mut Consumer, state_tail: u64) -> bool {
    let tail = consumer.segment().tail();
    if state_tail <= tail {
        return true;
    }
    if state_tail > consumer.segment().head() {
        return false;
    }
    let (mut left, mut skipped) = (state_tail - tail, Vec::new());
    while left > 0 {
        match consumer.read_raw((left as usize).min(READ_CHUNK), &mut skipped) {
            Ok((_, skipped)) if !skipped.is_empty() => left -= skipped.len() as u64,
            _ => return false,
        }
    }
    consumer.commit(state_tail);
    true
}

/// Adds `key` to a bounded list of remembered segments, forgetting the oldest past `max`.
fn remember(list: &mut VecDeque<SegmentKey>, key: SegmentKey, max: usize) {
    if list.len() >= max.max(1) {
        list.pop_front();
    }
    list.push_back(key);
}

/// What the live export sends for the instance of `comm_hash` whose [`crate::spans::instance_key`] is
/// `key`: nothing unless it is sampled or `slow`; its channels' spans with `otlp.channel_spans`.
fn live_spans(otlp: &crate::config::Otlp, slow: bool, comm_hash: u64, key: u64) -> LiveSpans {
    if !slow && !crate::spans::sampled(comm_hash, key, otlp.sample_ratio) {
        LiveSpans::None
    } else if otlp.channel_spans {
        LiveSpans::Channels
    } else {
        LiveSpans::Rank
    }
}

/// Whether a segment's saved spool mark is missing or far enough behind the spool's `end` that the
/// state should be saved again (`end`: `None` without a spool).
fn mark_stale(mark: Option<Position>, end: Option<Position>) -> bool {
    match (mark, end) {
        (_, None) => false,
        (None, Some(_)) => true,
        (Some(m), Some(e)) => m.seq != e.seq || e.offset.saturating_sub(m.offset) > MARK_LAG,
    }
}

/// Adds the operations of `name` that `origins` (read back from the spool) show as recorded to a
/// restored `delivered` list; operations before `tail` are committed and never read again, except
/// the `parked` ones, which the restarted engine continues.
fn mark_recorded(
    delivered: &mut Vec<(u64, u64, u8)>,
    key: &SegmentKey,
    tail: u64,
    parked: &[resume::SavedOp],
    origins: Vec<Origin>,
) {
    let continued: std::collections::HashSet<(u64, u64)> =
        parked.iter().map(|p| (p.id, p.first_pos)).collect();
    let mut known: HashMap<u64, usize> = delivered
        .iter()
        .enumerate()
        .map(|(i, d)| (d.0, i))
        .collect();
    for o in origins {
        if (o.uid, o.pid, o.inode) != (key.uid, key.pid, key.inode)
            || (o.first_pos < tail && !continued.contains(&(o.op_id, o.first_pos)))
        {
            continue;
        }
        match known.get(&o.op_id) {
            Some(&i) => delivered[i].2 |= done::RECORDED,
            None => {
                known.insert(o.op_id, delivered.len());
                delivered.push((o.op_id, o.first_pos, done::RECORDED));
            }
        }
    }
}

/// Moves the segment's commit point (`Attached::tail`) where it can go, queueing the state that
/// describes it; the ring's tail follows once that state is durable (see `Engine::collect_states`).
fn commit(
    states: &mut StateWriter,
    seg: &mut Attached,
    now: bool,
    spool_end: Option<Position>,
    lost: &mut Losses,
    forced: &mut u64,
) {
    // A state disk this far behind: the records wait in the ring rather than states in memory.
    if seg.saving.len() >= MAX_SAVING {
        return;
    }
    let tail = seg.tail;
    let mut target = seg.read_upto;
    if let Some(p) = seg.asm.oldest_pending_pos(tail) {
        target = target.min(p);
    }
    if let Some(p) = seg.unacked.oldest_pos() {
        target = target.min(p);
    }
    if let Some(p) = seg.roots.oldest_pos() {
        target = target.min(p);
    }
    // Not past an operation whose instance the spool has not made durable yet.
    if let Some(p) = seg.spooling.iter().map(|s| s.first_pos).min() {
        target = target.min(p);
    }
    // Over half full, the producer is about to drop records (a burst of graph replays, a slow
    // collector): free what was read even past operations still open and spans not yet acknowledged,
    // and save the state as often as that takes. They are delivered as usual; only a daemon
    // restarted before they finish would not read them again.
    let capacity = seg.consumer.segment().capacity();
    let pressed = ring_pressed(seg);
    let forcing = pressed && target < seg.read_upto;
    if forcing {
        target = seg.read_upto;
    }
    seg.dict_changed |= seg.asm.take_dictionary_changed();
    let dict_changed = seg.dict_changed;
    let stale = mark_stale(seg.spool_mark, spool_end);
    if target <= tail && !dict_changed && !seg.dirty && !stale && !seg.resave {
        return;
    }
    let lag = target.saturating_sub(tail);
    if !now && !dict_changed && lag < capacity / 4 && seg.last_commit.elapsed() < COMMIT_EVERY {
        return;
    }
    let save_every = match pressed {
        true => COMMIT_EVERY,
        false => COMMIT_EVERY.max(seg.dict_save_cost * DICT_SAVE_SHARE),
    };
    if !now && dict_changed && seg.dict_saved_at.elapsed() < save_every {
        return;
    }
    if forcing {
        seg.unacked.forget_before(target);
        seg.roots.forget_before(target);
        *forced += 1;
    }
    seg.delivered.retain(|_, (pos, _)| *pos >= target);
    // A replay cursor that moved before the new tail makes the saved state stale for it.
    let cursors_moved = seg.asm.prune_prior(target);
    // A saved state stays valid for any later tail: with the same dictionary, nothing delivered past
    // the new tail, no operation parked (the saved ones are continued from where they were saved)
    // and a recent spool mark, there is nothing new to save (a segment fully drained). The ring's
    // tail moves once the last state queued is durable (at once if it is).
    if seg.delivered.is_empty()
        && !seg.asm.has_parked()
        && seg.saved_parked.0.is_empty()
        && seg.asm.prior_deliveries().next().is_none()
        && !dict_changed
        && !stale
        && !cursors_moved
        && seg.state_saved
        && !seg.resave
    {
        seg.tail = seg.tail.max(target);
        match seg.saving.back() {
            Some(&(no, _)) => seg.saving.push_back((no, seg.tail)),
            None => seg.consumer.commit(seg.tail),
        }
        seg.last_commit = Instant::now();
        seg.dirty = false;
        return;
    }
    // What the ingest thread spends on it (the state's copy; the writer thread does the rest).
    let started = Instant::now();
    if let Err(e) = save_state(states, seg, target.max(tail), spool_end, Parked::Now) {
        // Without saved state a restart could not interpret what lies before the tail: keep it.
        tracing::error!(segment = %seg.label, error = %e, "cannot save resume state; not committing");
        lost.add(Loss::StateWriteFailed, 1);
        return;
    }
    if dict_changed {
        seg.dict_changed = false;
        seg.dict_saved_at = Instant::now();
        seg.dict_save_cost = started.elapsed();
    }
    seg.last_commit = Instant::now();
    seg.dirty = false;
}

/// Whether the segment's ring is over half full: the producer is about to drop records.
fn ring_pressed(seg: &Attached) -> bool {
    let s = seg.consumer.segment();
    // The head is the producer's word: saturating, so a head behind the tail is not "full".
    s.head().saturating_sub(s.tail()) > s.capacity() / 2
}

/// Which parked operations a saved state carries.
#[derive(Clone, Copy)]
enum Parked {
    /// Those in flight now that began before the tail, as of the read position.
    Now,
    /// Those of the last save, as they were then (the tail has not moved since).
    AsSaved,
}

/// Queues the segment's resume state for a committed tail of `tail` (which becomes the segment's
/// commit point): its dictionary, what it delivered past the tail, the operations in flight that
/// began before it, and the spool position everything it spools later will follow. Its number
/// ([`StateWriter::queue`]); the ring's tail moves to `tail` once it is durable.
fn save_state(
    states: &mut StateWriter,
    seg: &mut Attached,
    tail: u64,
    spool_mark: Option<Position>,
    parked: Parked,
) -> std::io::Result<u64> {
    let mut delivered: Vec<(u64, u64, u8)> = seg
        .delivered
        .iter()
        .map(|(id, (pos, f))| (*id, *pos, *f))
        .collect();
    delivered.extend(
        seg.asm
            .prior_deliveries()
            .filter(|(id, _, _)| !seg.delivered.contains_key(id)),
    );
    delivered.sort_unstable();
    let (parked, parked_upto) = match parked {
        Parked::Now => (seg.asm.parked_ops(tail), seg.read_upto),
        Parked::AsSaved => seg.saved_parked.clone(),
    };
    let st = SegmentState {
        segment: seg.label.clone(),
        tail,
        dictionary: seg.asm.dictionary(),
        delivered,
        spool_mark,
        parked_upto: if parked.is_empty() { 0 } else { parked_upto },
        parked,
    };
    let saved_parked = (st.parked.clone(), st.parked_upto);
    let no = states.queue(st)?;
    seg.tail = tail;
    seg.saving.push_back((no, tail));
    seg.resave = false;
    seg.state_saved = true;
    seg.spool_mark = spool_mark;
    seg.saved_parked = saved_parked;
    Ok(no)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spool::{Spool, SpoolLimits};
    use ncclscope_proto::Claims;
    use ncclscope_proto::fixture::{self, Coll, Comm};
    use ncclscope_proto::segment::Producer;
    use ncclscope_proto::{Record, StrId};

    /// The job "j" of the test's own uid (the owner of the segments it creates).
    fn job_j() -> JobKey {
        (rustix::process::getuid().as_raw(), "j".into())
    }

    fn engine(
        dir: &std::path::Path,
    ) -> (Engine, watch::Receiver<Arc<prometheus::Snapshot>>, Arc<Hub>) {
        engine_with(dir, None, Config::default().drain.batch_records)
    }

    fn engine_with(
        dir: &std::path::Path,
        spool: Option<Box<dyn Durable>>,
        batch_records: usize,
    ) -> (Engine, watch::Receiver<Arc<prometheus::Snapshot>>, Arc<Hub>) {
        let mut cfg = Config {
            state_dir: dir.to_path_buf(),
            ..Config::default()
        };
        cfg.drain.batch_records = batch_records;
        // The tests read per-rank series, which Prometheus serves only when asked to.
        cfg.prometheus.job_series = true;
        let (prom, rx) = watch::channel(Arc::default());
        let hub = Arc::new(Hub::default());
        let out = Outputs {
            spans: None,
            metrics: None,
            export_counters: Arc::default(),
            dropped: None,
            prometheus: prom,
            host_name: "h".into(),
        };
        (
            Engine::new(Arc::new(cfg), hub.clone(), spool, out).unwrap(),
            rx,
            hub,
        )
    }

    /// A segment of job "j" written by this process, as a plugin's.
    fn producer(capacity: u64) -> Producer {
        let claims = Claims {
            hostname: "h".into(),
            job_id: "j".into(),
            slurm_job_id: String::new(),
        };
        Producer::new(Segment::create(&claims, capacity).unwrap())
    }

    fn key_of(p: &Producer) -> SegmentKey {
        SegmentKey {
            uid: rustix::process::getuid().as_raw(),
            pid: std::process::id(),
            inode: p.segment().inode(),
        }
    }

    /// Hands `p`'s segment to `e` as the registration socket does; returns this side of the
    /// connection (dropping it is the process's end).
    fn hand_over(e: &mut Engine, p: &Producer) -> OwnedFd {
        hand_over_as(e, p, key_of(p))
    }

    /// [`hand_over`] with the identity the registration socket would have taken from the peer.
    fn hand_over_as(e: &mut Engine, p: &Producer, key: SegmentKey) -> OwnedFd {
        let (ours, theirs) = connection();
        let seg = Segment::open(p.segment().fd().try_clone_to_owned().unwrap()).unwrap();
        e.attach(key, seg, Some(theirs)).unwrap();
        ours
    }

    /// Both ends of a registration connection: (the process's, the daemon's).
    fn connection() -> (OwnedFd, OwnedFd) {
        rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap()
    }

    /// Ticks until every segment whose process ended is drained and dropped.
    fn tick_until_dropped(e: &mut Engine) {
        let t0 = Instant::now();
        while e.health().segments > 0 {
            assert!(t0.elapsed() < Duration::from_secs(5), "segment not dropped");
            e.tick();
        }
    }

    /// Strings and the communicator `write_colls`'s records refer to.
    fn write_dictionary(p: &mut Producer) {
        p.push(&Record::str(StrId(1), b"AllReduce"));
        p.push(&Record::str(StrId(2), b"ncclFloat32"));
        p.push(&comm_record(0, 5));
    }

    /// A one-rank communicator on the KernelCh path.
    fn comm_record(comm: u32, comm_hash: u64) -> Record {
        let c = Comm {
            comm,
            comm_hash,
            ..Comm::default()
        };
        c.record()
    }

    /// `write_colls`'s collective `seq` (op id seq + 1, no kernel work, no algorithm or protocol).
    fn coll(seq: u64) -> Coll {
        Coll {
            id: seq + 1,
            seq,
            algo: StrId(0),
            proto: StrId(0),
            count: 1,
            n_channels: 0,
            n_warps: 0,
            host_ns: 10,
            ..Coll::default()
        }
    }

    fn coll_start(seq: u64) -> Record {
        coll(seq).start()
    }

    fn write_colls(p: &mut Producer, seqs: std::ops::Range<u64>) {
        for seq in seqs {
            p.push(&coll_start(seq));
            p.push(&coll(seq).stop(20));
        }
    }

    /// A burst longer than the ring (300 graph replays on a real GPU write ~2 M records/s) must not
    /// wait on an operation that stays open: over half full, the tail moves past it, the producer
    /// drops nothing, and the open operation is still delivered when it ends.
    #[test]
    fn a_ring_over_half_full_commits_past_an_open_operation_and_drops_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = producer(64);
        write_dictionary(&mut p);
        assert!(p.push(&coll_start(999_999)));
        let (mut e, _rx, _hub) = engine(dir.path());
        let _conn = hand_over(&mut e, &p);
        // 40 rounds of 8 collectives: 640 records through a 64-record ring.
        for round in 0..40 {
            write_colls(&mut p, round * 8..round * 8 + 8);
            e.tick();
            e.commit_all(true);
        }
        assert!(p.push(&Record::OpStop {
            comm: 0,
            id: 1_000_000,
            host_ns: 20,
        }));
        e.tick();
        let h = e.health();
        assert_eq!(p.segment().counter(Counter::RingFull), 0);
        assert_eq!(
            h.collectives,
            40 * 8 + 1,
            "every operation delivered, the open one too"
        );
        assert!(h.forced_commits > 0);
        assert_eq!(h.lost.values().sum::<u64>(), 0, "{:?}", h.lost);
    }

    #[test]
    fn a_restarted_engine_resumes_from_the_saved_state_without_duplicates() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = producer(64);
        let name = key_of(&p);
        write_dictionary(&mut p);
        write_colls(&mut p, 0..10);
        let (mut e1, _rx1, hub1) = engine(dir.path());
        let mut live = hub1.subscribe();
        let _conn1 = hand_over(&mut e1, &p);
        e1.tick();
        e1.commit_all(true);
        let mut seen = Vec::new();
        while let Ok(c) = live.try_recv() {
            seen.push(c.inst.desc.seq);
        }
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        let saved = std::fs::read(resume::path(dir.path(), &name.to_string())).unwrap();
        // Drained again with the same dictionary: the tail moves on, the saved state stays as it was.
        write_colls(&mut p, 10..20);
        e1.tick();
        e1.commit_all(true);
        assert_eq!(live.try_recv().unwrap().inst.desc.seq, 10);
        assert_eq!(
            std::fs::read(resume::path(dir.path(), &name.to_string())).unwrap(),
            saved
        );
        // The first engine goes away (tail committed): the dictionary records lie before the tail and
        // are not read again; only the saved state still knows them.
        drop(e1);
        write_colls(&mut p, 20..40);
        let (mut e2, _rx2, hub2) = engine(dir.path());
        let mut live = hub2.subscribe();
        let _conn2 = hand_over(&mut e2, &p);
        e2.tick();
        let mut seen = Vec::new();
        while let Ok(c) = live.try_recv() {
            assert_eq!(
                (c.view().func(), c.inst.comm_hash, c.inst.bytes),
                ("AllReduce", 5, 4),
                "dictionary restored"
            );
            seen.push(c.inst.desc.seq);
        }
        assert_eq!(
            seen,
            (20..40).collect::<Vec<_>>(),
            "nothing twice, nothing missing"
        );
    }

    const KILL_ENV: &str = "NCCLSCOPE_TEST_ENGINE_KILL";
    /// Records per tick in the killed engine: the dictionary and four collectives, then six more.
    const KILL_BATCH: usize = 12;

    /// The real spool, and a SIGKILL of this process as soon as its `kill_at`-th append returned: the
    /// engine dies after a batch is durable in the spool and before any state records it.
    struct KillAfterAppend {
        spool: Spool,
        appends: usize,
        kill_at: usize,
    }

    impl Durable for KillAfterAppend {
        fn append(&mut self, batch: &[SpoolRun]) -> std::io::Result<()> {
            Durable::append(&mut self.spool, batch)?;
            self.appends += 1;
            if self.appends == self.kill_at {
                let me = rustix::process::getpid();
                rustix::process::kill_process(me, rustix::process::Signal::KILL)?;
            }
            Ok(())
        }

        fn index(&self) -> crate::spool::SpoolIndex {
            self.spool.index()
        }
    }

    /// The engine that is killed, in a process of its own (this test binary run again by the test
    /// below): it drains the test's segment, saving state after every tick, until the kill.
    #[test]
    #[ignore = "child process of a_daemon_killed_between_spooling_and_saving_state_records_nothing_twice"]
    fn engine_killed_child() {
        let spec = std::env::var(KILL_ENV).expect("run by the kill test");
        let f: Vec<&str> = spec.split('|').collect();
        let (dir, segment, key, kill_at) = (std::path::Path::new(f[0]), f[1], f[2], f[3]);
        let spool = KillAfterAppend {
            spool: Spool::open(dir.join("spool"), SpoolLimits::default()).unwrap(),
            appends: 0,
            kill_at: kill_at.parse().unwrap(),
        };
        let (mut e, _rx, _hub) = engine_with(&dir.join("state"), Some(Box::new(spool)), KILL_BATCH);
        // The parent's segment, opened through its descriptor in /proc (the same memory file).
        let fd = std::fs::File::options()
            .read(true)
            .write(true)
            .open(segment)
            .unwrap();
        let seg = Segment::open(fd.into()).unwrap();
        let (_ours, theirs) = connection();
        e.attach(key.parse().unwrap(), seg, Some(theirs)).unwrap();
        for _ in 0..100 {
            e.tick();
            e.flush(Duration::from_secs(10));
            e.commit_all(true);
        }
        panic!("not killed");
    }

    #[test]
    fn a_daemon_killed_between_spooling_and_saving_state_records_nothing_twice() {
        use std::os::unix::process::ExitStatusExt;
        // 1: killed at its first append (no state saved by a commit yet); 2: at its second (after a
        // commit saved the state for the first).
        for kill_at in [1, 2] {
            let dir = tempfile::tempdir().unwrap();
            std::fs::create_dir_all(dir.path().join("state")).unwrap();
            let mut p = producer(64);
            write_dictionary(&mut p);
            write_colls(&mut p, 0..10);
            let fd_path = format!("/proc/{}/fd/{}", std::process::id(), {
                use std::os::fd::AsRawFd;
                p.segment().fd().as_raw_fd()
            });
            let status = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--ignored", "--exact", "engine::tests::engine_killed_child"])
                .env(
                    KILL_ENV,
                    format!(
                        "{}|{fd_path}|{}|{kill_at}",
                        dir.path().display(),
                        key_of(&p)
                    ),
                )
                .stdout(std::process::Stdio::null())
                .status()
                .unwrap();
            assert_eq!(status.signal(), Some(9), "the child was killed: {status:?}");
            let spooled = |dir: &std::path::Path| -> Vec<u64> {
                crate::spool::SpoolReader::open_dir(dir.join("spool"))
                    .unwrap()
                    .read_job(&job_j())
                    .map(|c| c.unwrap().seq)
                    .collect()
            };
            let before = spooled(dir.path()).len() as u64;
            assert_eq!(before, [4, 10][kill_at - 1], "spooled before the kill");

            // The process goes on; a new engine takes over from what the killed one left.
            write_colls(&mut p, 10..20);
            let spool = Spool::open(dir.path().join("spool"), SpoolLimits::default()).unwrap();
            let (mut e, rx, hub) =
                engine_with(&dir.path().join("state"), Some(Box::new(spool)), KILL_BATCH);
            let mut live = hub.subscribe();
            let _conn = hand_over(&mut e, &p);
            while e.tick() {}
            e.flush(Duration::from_secs(10));
            e.commit_all(true);
            e.snapshot(true);
            assert_eq!(
                spooled(dir.path()),
                (0..20).collect::<Vec<_>>(),
                "each instance spooled once (killed at append {kill_at})"
            );
            let mut published = Vec::new();
            while let Ok(c) = live.try_recv() {
                published.push(c.inst.desc.seq);
            }
            assert_eq!(published, (before..20).collect::<Vec<_>>());
            assert_eq!(e.health().collectives, 20 - before);
            let text =
                metrics::render_prometheus(&rx.borrow().families, &metrics::Exposition::FULL);
            let counted: f64 = text
                .lines()
                .filter(|l| l.starts_with("ncclscope_rank_collectives_total{"))
                .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
                .sum();
            assert_eq!(counted, (20 - before) as f64, "{text}");
        }
    }

    #[test]
    fn a_kill_between_saving_state_and_committing_the_tail_loses_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        std::fs::create_dir_all(&state_dir).unwrap();
        let mut p = producer(1024);
        write_dictionary(&mut p);
        write_colls(&mut p, 0..10);
        let spool =
            || Box::new(Spool::open(dir.path().join("spool"), SpoolLimits::default()).unwrap());
        let (mut e1, _rx1, _hub1) = engine_with(&state_dir, Some(spool()), 8192);
        let _conn1 = hand_over(&mut e1, &p);
        e1.tick();
        e1.flush(Duration::from_secs(10));
        e1.commit_all(true);
        write_colls(&mut p, 10..20);
        // No commit inside this tick: the next one is not due.
        e1.segments[0].last_commit = Instant::now() + Duration::from_secs(60);
        e1.tick();
        e1.flush(Duration::from_secs(10));
        let committed = e1.segments[0].consumer.segment().tail();
        // What `commit` does first, without the second step: the state for the new tail is saved...
        let target = e1.segments[0].read_upto;
        assert!(target > committed);
        let end = e1.spool.as_ref().map(|s| s.end(&job_j()));
        save_state(
            &mut e1.states,
            &mut e1.segments[0],
            target,
            end,
            Parked::Now,
        )
        .unwrap();
        // ... and the daemon is killed before the tail is committed.
        drop(e1);
        assert_eq!(p.segment().tail(), committed);

        write_colls(&mut p, 20..30);
        let (mut e2, _rx2, hub2) = engine_with(&state_dir, Some(spool()), 8192);
        let mut live = hub2.subscribe();
        let _conn2 = hand_over(&mut e2, &p);
        assert_eq!(
            e2.segments[0].consumer.segment().tail(),
            target,
            "commit finished"
        );
        while e2.tick() {}
        e2.flush(Duration::from_secs(10));
        let mut seen = Vec::new();
        while let Ok(c) = live.try_recv() {
            assert_eq!(c.view().func(), "AllReduce", "dictionary restored");
            seen.push(c.inst.desc.seq);
        }
        assert_eq!(
            seen,
            (20..30).collect::<Vec<_>>(),
            "nothing twice, nothing missing"
        );
        assert_eq!(e2.health().lost.get("resume_state_missing"), Some(&0));
        let spooled: Vec<u64> = crate::spool::SpoolReader::open_dir(dir.path().join("spool"))
            .unwrap()
            .read_job(&job_j())
            .map(|c| c.unwrap().seq)
            .collect();
        assert_eq!(spooled, (0..30).collect::<Vec<_>>());
    }

    /// One lost record costs at most its own operation, however long the run: a host event, a
    /// kernel record and a stop each missing once in a run 10x the ring, at 20 records a
    /// millisecond. The operations they belong to stay open (or never open), the tail moves past
    /// them, the producer drops nothing and every other operation is delivered.
    #[test]
    fn a_lost_record_costs_its_own_operation_and_nothing_more() {
        const N: u64 = 2000;
        const NO_START: u64 = 500;
        const NO_KERNEL: u64 = 1000;
        const NO_STOP: u64 = 1500;
        let dir = tempfile::tempdir().unwrap();
        let mut p = producer(1024);
        write_dictionary(&mut p);
        p.push(&calibration());
        let (mut e, _rx, hub) = engine(dir.path());
        let mut live = hub.subscribe();
        let conn = hand_over(&mut e, &p);
        for seq in 0..N {
            let channels: &[u32] = if seq == NO_KERNEL { &[0] } else { &[0, 1] };
            coll_with_work(&mut p, seq, seq != NO_START, channels, seq != NO_STOP);
            if seq % 4 == 3 {
                e.tick();
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        drop(conn);
        tick_until_dropped(&mut e);
        let mut seen = Vec::new();
        while let Ok(c) = live.try_recv() {
            seen.push(c.inst.desc.seq);
        }
        seen.sort_unstable();
        let expected: Vec<u64> = (0..N).filter(|&s| s != NO_START).collect();
        assert_eq!(p.segment().counter(Counter::RingFull), 0);
        assert!(
            seen == expected,
            "{} delivered of {}",
            seen.len(),
            expected.len()
        );
        // The two that never completed are delivered at the process's end with what they have,
        // and counted; the one that never started has nothing to deliver.
        let lost = e.health().lost;
        assert_eq!(lost["incomplete"], 2, "{lost:?}");
    }

    /// A collective of `write_colls`'s communicator with kernel work on `channels` of 2 (op id seq +
    /// 1), started unless `start` is false, stopped unless `stop` is false.
    fn coll_with_work(p: &mut Producer, seq: u64, start: bool, channels: &[u32], stop: bool) {
        let c = Coll {
            n_channels: 2,
            ..coll(seq)
        };
        if start {
            assert!(p.push(&c.start()));
        }
        for &channel in channels {
            let gpu = (1000 * seq + 10, 1000 * seq + 500);
            assert!(p.push(&c.kernel(channel as u8, gpu, 10)));
        }
        if stop {
            assert!(p.push(&c.stop(20)));
        }
    }

    fn calibration() -> Record {
        fixture::calibration(0, 0, 100)
    }

    /// Issue 16: a record the plugin counts as lost (here an OpStop and a KernelCh) parks the
    /// operations read so far at once: the tail moves past the two that can no longer complete,
    /// rather than waiting on them until they time out while the ring fills. Without the count the
    /// tail waits on the first of them (checked first). A gap the daemon sees itself (kernel work of
    /// an operation whose start never came) does the same.
    #[test]
    fn a_counted_gap_parks_the_operations_read_so_far_and_frees_their_records() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = producer(1 << 12);
        write_dictionary(&mut p);
        p.push(&calibration());
        let (mut e, _rx, hub) = engine(dir.path());
        let mut live = hub.subscribe();
        let _conn = hand_over(&mut e, &p);
        for seq in 0..10 {
            coll_with_work(&mut p, seq, true, &[0, 1], true);
        }
        let no_stop = p.segment().head();
        coll_with_work(&mut p, 10, true, &[0, 1], false);
        coll_with_work(&mut p, 11, true, &[1], true);
        for seq in 12..20 {
            coll_with_work(&mut p, seq, true, &[0, 1], true);
        }
        e.tick();
        e.commit_all(true);
        assert_eq!(p.segment().tail(), no_stop, "no gap seen: the tail waits");
        assert_eq!(e.health().parked_ops, 0);

        // What the plugin does on dropping the two records: count them in the segment's header.
        p.segment().count(Counter::QueueFull, 2);
        e.tick();
        e.commit_all(true);
        assert_eq!(
            p.segment().tail(),
            p.segment().head(),
            "the tail moved past them"
        );
        assert_eq!(e.health().parked_ops, 2);
        let state = resume::load(dir.path(), &key_of(&p).to_string())
            .unwrap()
            .unwrap();
        let parked: Vec<u64> = state.parked.iter().map(|o| o.desc.seq).collect();
        assert_eq!(parked, [10, 11], "the resume state carries them");

        // Uncounted: an operation without its stop, then one whose start is missing.
        coll_with_work(&mut p, 20, true, &[0, 1], false);
        e.tick();
        e.commit_all(true);
        assert!(
            p.segment().tail() < p.segment().head(),
            "no gap seen: the tail waits"
        );
        coll_with_work(&mut p, 21, false, &[0, 1], true);
        for seq in 22..30 {
            coll_with_work(&mut p, seq, true, &[0, 1], true);
        }
        e.tick();
        e.commit_all(true);
        assert_eq!(
            p.segment().tail(),
            p.segment().head(),
            "the tail moved past it"
        );
        assert_eq!(e.health().parked_ops, 3);
        let mut seen: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
            .map(|c| c.inst.desc.seq)
            .collect();
        seen.sort_unstable();
        let expected: Vec<u64> = (0..30).filter(|s| ![10, 11, 20, 21].contains(s)).collect();
        assert_eq!(seen, expected, "every other operation delivered");
    }

    /// A parked operation is continued by a restarted engine from the saved state: delivered once,
    /// complete, with the kernel work read before and after the restart; also when the killed
    /// engine had already spooled it but not saved a state saying so (the state dir unwritable
    /// stands for the kill: the tail stays where the last state was saved).
    #[test]
    fn a_parked_operation_is_continued_after_a_restart_and_recorded_once() {
        for killed_after_spooling in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let state_dir = dir.path().join("state");
            std::fs::create_dir_all(&state_dir).unwrap();
            let spool = || Spool::open(dir.path().join("spool"), SpoolLimits::default()).unwrap();
            let mut p = producer(1 << 12);
            write_dictionary(&mut p);
            p.push(&calibration());
            let (mut e1, _rx, _hub) = engine_with(&state_dir, Some(Box::new(spool())), 1 << 12);
            let _conn1 = hand_over(&mut e1, &p);
            coll_with_work(&mut p, 0, true, &[0], false);
            for seq in 1..10 {
                coll_with_work(&mut p, seq, true, &[0, 1], true);
            }
            p.segment().count(Counter::QueueFull, 1);
            e1.tick();
            e1.flush(Duration::from_secs(10));
            e1.commit_all(true);
            assert_eq!(p.segment().tail(), p.segment().head());
            assert_eq!(e1.health().parked_ops, 1);
            // The rest of operation 0 (its record was late, not lost), then more.
            coll_with_work(&mut p, 0, false, &[1], true);
            for seq in 10..15 {
                coll_with_work(&mut p, seq, true, &[0, 1], true);
            }
            if killed_after_spooling {
                let away = dir.path().join("state.away");
                std::fs::rename(&state_dir, &away).unwrap();
                std::fs::write(&state_dir, b"not a directory").unwrap();
                e1.tick();
                e1.flush(Duration::from_secs(10));
                e1.commit_all(true);
                assert_eq!(e1.health().collectives, 15, "all spooled before the kill");
                std::fs::remove_file(&state_dir).unwrap();
                std::fs::rename(&away, &state_dir).unwrap();
            }
            drop(e1);
            let (mut e2, _rx, hub) = engine_with(&state_dir, Some(Box::new(spool())), 1 << 12);
            let mut live = hub.subscribe();
            let _conn2 = hand_over(&mut e2, &p);
            e2.tick();
            e2.flush(Duration::from_secs(10));
            e2.commit_all(true);
            let spooled: Vec<_> = crate::spool::SpoolReader::open_dir(dir.path().join("spool"))
                .unwrap()
                .read_job(&job_j())
                .map(|c| c.unwrap())
                .collect();
            let mut seqs: Vec<u64> = spooled.iter().map(|c| c.seq).collect();
            seqs.sort_unstable();
            assert_eq!(
                seqs,
                (0..15).collect::<Vec<_>>(),
                "each once (killed after spooling: {killed_after_spooling})"
            );
            let op0 = spooled.iter().find(|c| c.seq == 0).unwrap();
            assert_eq!(
                op0.channels.len(),
                2,
                "work from before and after the restart"
            );
            let published: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
                .map(|c| c.inst.desc.seq)
                .collect();
            match killed_after_spooling {
                true => assert!(published.is_empty(), "{published:?}"),
                false => assert_eq!(published, [0, 10, 11, 12, 13, 14]),
            }
            let mut lost = e2.health().lost;
            assert_eq!(lost.remove("queue_full"), Some(1));
            assert!(lost.values().all(|&n| n == 0), "{lost:?}");
        }
    }

    /// Group commit (issue 16 item 3): ingest does not wait for the spool. While the spool's append
    /// is blocked (a slow fdatasync), ticks go on reading, assembling and counting, and the tail stays
    /// at the first operation not yet durable; once the spool has them, the tail moves past them and
    /// the spool holds each once, in completion order.
    #[test]
    fn ingest_goes_on_while_the_spool_syncs_and_the_tail_waits_for_it() {
        struct Gated {
            spool: Spool,
            open: Arc<AtomicBool>,
        }
        impl Durable for Gated {
            fn append(&mut self, batch: &[SpoolRun]) -> std::io::Result<()> {
                while !self.open.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Durable::append(&mut self.spool, batch)
            }

            fn index(&self) -> crate::spool::SpoolIndex {
                self.spool.index()
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let open = Arc::new(AtomicBool::new(false));
        let spool = Gated {
            spool: Spool::open(dir.path().join("spool"), SpoolLimits::default()).unwrap(),
            open: open.clone(),
        };
        let (mut e, _rx, hub) = engine_with(dir.path(), Some(Box::new(spool)), 1 << 12);
        let mut live = hub.subscribe();
        let mut p = producer(1 << 12);
        write_dictionary(&mut p);
        let first = p.segment().head();
        let _conn = hand_over(&mut e, &p);
        for round in 0..3 {
            write_colls(&mut p, round * 10..round * 10 + 10);
            e.tick();
            e.commit_all(true);
            assert_eq!(e.health().collectives, round * 10 + 10, "ingest went on");
            assert_eq!(p.segment().tail(), first, "the tail waits for the spool");
        }
        assert!(
            live.try_recv().is_err(),
            "published once durable, not before"
        );
        open.store(true, Ordering::Release);
        assert!(e.flush(Duration::from_secs(10)));
        e.commit_all(true);
        assert_eq!(p.segment().tail(), p.segment().head());
        let spooled: Vec<u64> = crate::spool::SpoolReader::open_dir(dir.path().join("spool"))
            .unwrap()
            .read_job(&job_j())
            .map(|c| c.unwrap().seq)
            .collect();
        assert_eq!(spooled, (0..30).collect::<Vec<_>>());
        let published: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
            .map(|c| c.inst.desc.seq)
            .collect();
        assert_eq!(published, (0..30).collect::<Vec<_>>());
    }

    /// Issue 19: the resume state is durable before the tail it describes is committed, and ingest
    /// does not wait for it. While the state writer is held (a slow fsync), ticks go on reading and
    /// delivering, and the ring's tail stays where the last durable state is (none yet: where it
    /// began); once the writer has caught up, the tail moves on, and an engine restarted from the
    /// state on disk delivers each operation once.
    #[test]
    fn the_tail_waits_for_a_durable_state_and_ingest_does_not() {
        struct Gated {
            dir: state_writer::Dir,
            open: Arc<AtomicBool>,
        }
        impl state_writer::Store for Gated {
            fn store(&mut self, states: &[SegmentState]) -> Vec<(usize, std::io::Error)> {
                while !self.open.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                self.dir.store(states)
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let mut p = producer(1 << 12);
        let name = key_of(&p).to_string();
        write_dictionary(&mut p);
        let (mut e, _rx, hub) = engine(dir.path());
        let open = Arc::new(AtomicBool::new(false));
        let gated = Gated {
            dir: state_writer::Dir(dir.path().to_path_buf()),
            open: open.clone(),
        };
        e.states = StateWriter::start(Box::new(gated)).unwrap();
        let mut live = hub.subscribe();
        let _conn = hand_over(&mut e, &p);
        for round in 0..3 {
            write_colls(&mut p, round * 10..round * 10 + 10);
            e.tick();
            std::thread::sleep(COMMIT_EVERY);
            e.tick();
            assert_eq!(e.health().collectives, round * 10 + 10, "ingest went on");
            assert_eq!(p.segment().tail(), 0, "the tail waits for a durable state");
        }
        assert_eq!(resume::load(dir.path(), &name).unwrap(), None);
        open.store(true, Ordering::Release);
        assert!(e.flush(Duration::from_secs(10)));
        assert_eq!(p.segment().tail(), p.segment().head(), "the tail moved on");
        let saved = resume::load(dir.path(), &name).unwrap().unwrap();
        assert!(saved.tail > 0 && saved.tail <= p.segment().tail());
        let published: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
            .map(|c| c.inst.desc.seq)
            .collect();
        assert_eq!(published, (0..30).collect::<Vec<_>>());

        drop(e);
        write_colls(&mut p, 30..40);
        let (mut e2, _rx2, hub2) = engine(dir.path());
        let mut live = hub2.subscribe();
        let _conn2 = hand_over(&mut e2, &p);
        e2.tick();
        let seen: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
            .inspect(|c| assert_eq!(c.view().func(), "AllReduce", "dictionary restored"))
            .map(|c| c.inst.desc.seq)
            .collect();
        assert_eq!(
            seen,
            (30..40).collect::<Vec<_>>(),
            "nothing twice, nothing missing"
        );
        assert_eq!(e2.health().lost["resume_state_missing"], 0);
    }

    /// A state that cannot be written (its directory gone, as a full disk) is counted and the tail
    /// does not move; nothing the engine accepted is lost: once the directory is back, the next
    /// commit saves again, the tail moves on, and a restart delivers each operation once.
    #[test]
    fn a_state_that_cannot_be_written_is_counted_and_saved_again() {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        std::fs::create_dir(&state_dir).unwrap();
        let mut p = producer(1 << 12);
        write_dictionary(&mut p);
        write_colls(&mut p, 0..10);
        let (mut e, _rx, _hub) = engine(&state_dir);
        let _conn = hand_over(&mut e, &p);
        std::fs::remove_dir(&state_dir).unwrap();
        e.tick();
        e.commit_all(true);
        assert_eq!(e.health().collectives, 10);
        assert!(e.health().lost["state_write_failed"] > 0);
        assert_eq!(p.segment().tail(), 0, "not committed without its state");

        std::fs::create_dir(&state_dir).unwrap();
        e.commit_all(true);
        assert_eq!(
            p.segment().tail(),
            p.segment().head(),
            "saved again, committed"
        );
        drop(e);
        write_colls(&mut p, 10..20);
        let (mut e2, _rx2, hub2) = engine(&state_dir);
        let mut live = hub2.subscribe();
        let _conn2 = hand_over(&mut e2, &p);
        e2.tick();
        let seen: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
            .map(|c| c.inst.desc.seq)
            .collect();
        assert_eq!(
            seen,
            (10..20).collect::<Vec<_>>(),
            "nothing twice, nothing missing"
        );
    }

    /// Spans are at-least-once across a kill: an operation that started first but finished after
    /// another (here on another communicator) keeps the tail at its first record until its span is
    /// acknowledged, although it was emitted second.
    #[test]
    fn the_tail_waits_on_the_unacknowledged_operation_whose_records_come_first() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config {
            state_dir: dir.path().to_path_buf(),
            ..Config::default()
        };
        let (spans, _unread) = mpsc::channel(16);
        let out = Outputs {
            spans: Some(spans),
            metrics: None,
            export_counters: Arc::default(),
            dropped: None,
            prometheus: watch::channel(Arc::default()).0,
            host_name: "h".into(),
        };
        let mut e = Engine::new(Arc::new(cfg), Arc::new(Hub::default()), None, out).unwrap();
        let mut p = producer(64);
        write_dictionary(&mut p);
        p.push(&comm_record(1, 6));
        let first = p.segment().head();
        p.push(&coll_start(0));
        let mut other = coll_start(1);
        if let Record::CollStart { comm, .. } = &mut other {
            *comm = 1;
        }
        p.push(&other);
        p.push(&Record::OpStop {
            comm: 1,
            id: 2,
            host_ns: 20,
        });
        p.push(&Record::OpStop {
            comm: 0,
            id: 1,
            host_ns: 30,
        });
        let _conn = hand_over(&mut e, &p);
        e.tick();
        e.commit_all(true);
        assert_eq!(e.health().collectives, 2);
        assert_eq!(p.segment().tail(), first, "neither span acknowledged");
    }

    /// Issue 22: an instance the full export queue refuses is counted and remembered for re-sending
    /// from the spool; a queued one still carries its segment's acknowledgement.
    #[test]
    fn instances_refused_by_a_full_export_queue_are_remembered_for_re_sending() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config {
            state_dir: dir.path().to_path_buf(),
            ..Config::default()
        };
        let (spans, mut queued) = mpsc::channel(1);
        let dropped = Arc::new(Dropped::new(crate::resend::MAX_REMEMBERED));
        let out = Outputs {
            spans: Some(spans),
            metrics: None,
            export_counters: Arc::default(),
            dropped: Some(dropped.clone()),
            prometheus: watch::channel(Arc::default()).0,
            host_name: "h".into(),
        };
        let mut e = Engine::new(Arc::new(cfg), Arc::new(Hub::default()), None, out).unwrap();
        let mut p = producer(64);
        write_dictionary(&mut p);
        for seq in 0..3 {
            p.push(&coll_start(seq));
            p.push(&Record::OpStop {
                comm: 0,
                id: seq + 1,
                host_ns: 10 + seq,
            });
        }
        let _conn = hand_over(&mut e, &p);
        e.tick();
        assert_eq!(e.health().lost["export_queue_full"], 2);
        assert_eq!(dropped.held(), 2, "both refused instances remembered");
        let first = queued.try_recv().unwrap();
        assert_eq!(first.coll.inst.desc.seq, 0);
        assert!(
            first.acked.is_some(),
            "a live span is acknowledged to its segment"
        );
    }

    /// Loss counters come from headers their owners write: one uid's segment can raise its own
    /// figure to the maximum but never wrap it, nor raise the node's figure past its bound (see
    /// `loss::UID_RATE_PER_SEC`), and a counter its owner lowers lowers nothing; each uid's own
    /// figure is kept apart.
    #[test]
    fn no_segment_can_lower_or_wrap_another_uids_loss_counters() {
        use crate::loss::UID_RATE_PER_SEC;
        let dir = tempfile::tempdir().unwrap();
        let (mut e, _rx, _hub) = engine(dir.path());
        let (victim, hostile) = (producer(64), producer(64));
        let mut conns = Vec::new();
        let t0 = Instant::now();
        for (p, uid) in [(&victim, 1001), (&hostile, 1002)] {
            conns.push(hand_over_as(&mut e, p, SegmentKey { uid, ..key_of(p) }));
        }
        victim.segment().count(Counter::RingFull, 7);
        hostile.segment().count(Counter::RingFull, u64::MAX - 3);
        std::thread::sleep(Duration::from_millis(2));
        e.tick();
        let h = e.health();
        let bound = |since: Instant| since.elapsed().as_secs_f64() * UID_RATE_PER_SEC as f64;
        // The victim's 7 in full, the hostile uid's within its bound: not saturated at 2^64 - 1.
        let node = h.lost["ring_full"];
        assert!((7..=7 + bound(t0) as u64).contains(&node), "{node}");
        assert_eq!(h.plugin_lost_by_uid[&(1001, "ring_full")], 7);
        assert_eq!(
            h.plugin_lost_by_uid[&(1001, "queue_full")],
            0,
            "every stage"
        );
        // The hostile owner winds its counter back (wrapping add): nothing goes down.
        hostile.segment().count(Counter::RingFull, u64::MAX - 10);
        e.tick();
        let h = e.health();
        assert_eq!(h.plugin_lost_by_uid[&(1002, "ring_full")], u64::MAX - 3);
        assert_eq!(h.plugin_lost_by_uid[&(1001, "ring_full")], 7);
        assert!(h.lost["ring_full"] >= node);
        // Both processes end: their figures stay, per uid.
        drop(conns);
        let t0 = Instant::now();
        while e.health().segments > 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "segments not dropped"
            );
            e.tick();
        }
        let h = e.health();
        assert_eq!(h.plugin_lost_by_uid[&(1001, "ring_full")], 7);
        assert!(h.lost["ring_full"] < 1 << 53);
    }

    #[test]
    fn the_end_of_a_processs_connection_drains_then_drops_its_segment() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = producer(64);
        write_dictionary(&mut p);
        write_colls(&mut p, 0..5);
        let (mut e, _rx, hub) = engine(dir.path());
        let mut live = hub.subscribe();
        let first = hand_over(&mut e, &p);
        e.tick();
        // Handed over again on a new connection (the plugin reconnected): the same segment, once.
        let second = hand_over(&mut e, &p);
        drop(first);
        write_colls(&mut p, 5..10);
        let t0 = Instant::now();
        while t0.elapsed() < LIVENESS_EVERY * 2 {
            e.tick();
        }
        assert_eq!(e.health().segments, 1, "still connected through the second");
        // The process ends: what it wrote last is still delivered, then the segment is dropped.
        write_colls(&mut p, 10..12);
        drop(second);
        tick_until_dropped(&mut e);
        let mut seen = Vec::new();
        while let Ok(c) = live.try_recv() {
            seen.push(c.inst.desc.seq);
        }
        assert_eq!(seen, (0..12).collect::<Vec<_>>());
        assert!(resume::list(dir.path()).is_empty(), "resume state removed");
    }

    #[test]
    fn a_corrupt_segment_is_detached_counted_and_not_reattached() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = producer(64);
        let (mut e, _rx, _hub) = engine(dir.path());
        let _conn = hand_over(&mut e, &p);
        assert_eq!(e.health().segments, 1);
        // Someone else consumes and commits behind the engine's back, so the producer's cursor runs
        // more than a ring ahead of the engine's read cursor: corrupt.
        for _ in 0..64 {
            p.push(&Record::CommEnd {
                comm: 0,
                host_ns: 0,
            });
        }
        let raw = Segment::open(p.segment().fd().try_clone_to_owned().unwrap()).unwrap();
        let mut c = Consumer::new(raw);
        c.read(64, &mut Vec::new()).unwrap();
        c.commit(64);
        for _ in 0..64 {
            p.push(&Record::CommEnd {
                comm: 0,
                host_ns: 0,
            });
        }
        e.tick();
        assert_eq!(e.health().segments, 0);
        assert_eq!(e.health().lost.get("corrupt_segment"), Some(&1));
        let seg = Segment::open(p.segment().fd().try_clone_to_owned().unwrap()).unwrap();
        let again = e.attach(key_of(&p), seg, None);
        assert_eq!(again, Err("the segment was detached as corrupt".into()));
        assert_eq!(e.health().segments, 0, "not attached again");
    }

    #[test]
    fn a_dictionary_that_keeps_changing_is_saved_at_a_bounded_rate_and_restart_safe() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = producer(64);
        let name = key_of(&p);
        let (mut e, _rx, _hub) = engine(dir.path());
        let _conn = hand_over(&mut e, &p);
        // A new string on every tick, for 200 ms.
        let (mut saves, mut last) = (0, None);
        let t0 = Instant::now();
        let mut id = 1;
        while t0.elapsed() < Duration::from_millis(200) && id < 4000 {
            if p.push(&Record::str(StrId(id), b"x")) {
                id += 1;
            }
            e.tick();
            let committed = p.segment().tail();
            let saved = std::fs::read(resume::path(dir.path(), &name.to_string())).ok();
            if let Some(text) = &saved {
                let st: SegmentState = serde_json::from_slice(text).unwrap();
                assert!(
                    st.tail >= committed,
                    "the tail runs behind the state on disk"
                );
            }
            if saved.is_some() && saved != last {
                saves += 1;
                last = saved;
            }
        }
        assert!(id > 50, "strings defined: {id}");
        assert!(
            saves <= 21,
            "{saves} state files written in 200 ms for {id} strings"
        );
        // The tail moved only with a saved dictionary that covers every record before it (once the
        // last state queued is durable, the ring's tail is its).
        assert!(e.flush(Duration::from_secs(10)));
        let st = resume::load(dir.path(), &name.to_string())
            .unwrap()
            .unwrap();
        assert_eq!(st.tail, p.segment().tail());
        assert!(st.dictionary.strings.len() as u64 >= st.tail);
    }
}
