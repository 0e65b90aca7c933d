//! The ingest engine: one thread that drains every attached segment on a shared adaptive ticker,
//! assembles collective instances, records them (spool, then live subscribers, statistics), queues
//! sampled ones for OTLP, and commits each segment's tail only past records whose effects are safe.
//!
//! Commit point of a segment = the oldest of: the first record of an operation still in flight, the
//! first record of a completed operation whose span is not yet acknowledged by the exporter, and the
//! read position. Committing saves the segment's resume state (see [`crate::storage::resume`]) for that point
//! through the state writer thread ([`crate::storage::state_writer`]), and moves the ring's tail there only
//! once the writer reports the state durable (a later tick): a daemon killed, or a machine rebooted,
//! at any point re-reads what it had not finished and skips what it had delivered. The engine goes
//! on from the new point meanwhile (`CommitPoint::tail`); it never waits on the disk.
//!
//! The spool is exactly-once across a kill, and metrics count an instance in one daemon run only:
//! every spooled instance carries its origin (segment, operation), and the saved state holds a spool
//! position (`spool_mark`) that precedes everything of the segment spooled after that save (saved
//! ahead of a segment's first append, and again once the spool moved far past it). A restarted
//! engine reads the origins past the mark and treats those operations as recorded: not spooled,
//! published or counted again.
//!
//! This file is the router: the engine and its loop (read, apply, deliver, commit, reap), the only
//! place that calls across its parts. Each part owns its state (docs/architecture.md, "engine/"):
//! `segment.rs` one attached segment, `commit.rs` its commit point (the resume protocol),
//! `segments.rs` the segments as they come and go, `deliver.rs` delivery, `report.rs` health and
//! snapshots.

mod commit;
mod deliver;
mod report;
mod segment;
mod segments;
#[cfg(test)]
mod tests;

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use ncclscope_proto::segment::{Consumer, Counter, Segment};
use ncclscope_proto::{realtime_ns, shift};
use tokio::sync::oneshot;

use crate::config::Config;
use crate::export::metrics::Health;
use crate::host::clock_step::StepDetector;
use crate::host::{notify, ratelimit};
use crate::loss::{Loss, Losses};
use crate::stats::Stats;
use crate::storage::hub::{Durable, Hub};
use crate::storage::spool_writer::{BACKLOG_PAUSE, SpoolWriter};
use crate::storage::state_writer::{self, StateWriter};

use commit::{CommitPoint, READ_CHUNK, ring_pressed};
use deliver::{Delivery, Sinks, Source};
use report::{Report, Sources};
use segment::Attached;
use segments::Segments;

pub use deliver::Outputs;
pub use segment::SegmentKey;

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

const SWEEP_EVERY: Duration = Duration::from_millis(100);
const LIVENESS_EVERY: Duration = Duration::from_millis(500);
const SNAPSHOT_EVERY: Duration = Duration::from_secs(1);
/// A series (job, communicator, collective, size) without an instance this long is dropped.
const SERIES_IDLE: Duration = Duration::from_secs(3600);
/// An operation open this long is parked (see `Assembler::park`): the tail moves past its records
/// and the resume state carries it. Long enough that an operation rarely is (its records come within
/// a few drain intervals), short enough that one whose record was lost uncounted (a gap the plugin
/// did not see) holds a small share of its ring.
const PARK_AFTER: Duration = Duration::from_millis(100);
/// [`PARK_AFTER`] while the ring is over half full.
const PARK_PRESSED: Duration = Duration::from_millis(10);

pub struct Engine {
    cfg: Arc<Config>,
    segments: Segments,
    stats: Stats,
    hub: Arc<Hub>,
    spool: Option<SpoolWriter>,
    /// After `spool`, whose thread may wait on it when dropped.
    states: StateWriter,
    /// Instances the spool writer reported it could not append, as last counted.
    spool_failed: u64,
    out: Outputs,
    daemon_lost: Losses,
    /// Commits past open operations or unacknowledged spans because the ring was over half full.
    forced_commits: u64,
    /// Operations parked (see `Assembler::park`).
    parked_ops: u64,
    /// The time the last tick read records at (what the operations it read were opened at).
    tick_ns: u64,
    watchdog: Option<(Duration, Instant)>,
    /// Where every segment's records are copied to be decoded (one buffer: it stays in cache).
    reads: Vec<[u64; ncclscope_proto::record::RECORD_WORDS]>,
    delivery: Delivery,
    /// Host clock steps, sampled every tick (see `clock_step`).
    clock: StepDetector,
    report: Report,
    last_sweep: Instant,
    last_liveness: Instant,
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
            segments: Segments::new(),
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
            daemon_lost: Losses::default(),
            forced_commits: 0,
            parked_ops: 0,
            tick_ns: 0,
            clock: StepDetector::default(),
            watchdog: notify::watchdog_interval().map(|every| (every, now)),
            reads: Vec::new(),
            delivery: Delivery::default(),
            report: Report::new(now, started_ns),
            last_sweep: now,
            last_liveness: now,
            started: now,
        })
    }

    /// Drains until `stop` is set; then reads what is left (bounded by the shutdown timeout), commits
    /// and saves every segment's state. Operations still in flight stay uncommitted for the next daemon.
    pub fn run(mut self, registrations: std_mpsc::Receiver<Handover>, stop: Arc<AtomicBool>) {
        self.segments.load_unclaimed(&self.cfg.state_dir);
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
        while (self.segments.list.iter_mut()).any(|s| s.commit.exports_in_flight())
            && Instant::now() < deadline
        {
            std::thread::sleep(min);
            self.tick();
        }
        self.collect_spooled();
        self.commit_all(true);
        self.snapshot(true);
        tracing::info!(segments = self.segments.list.len(), "ingest stopped");
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
            Handover::Refused { uid, stage } => self.segments.refusals.add(uid, stage),
        }
    }

    /// Pings systemd's watchdog when it is due (from the ingest loop: a stuck ingest stops the pings).
    fn watchdog(&mut self) {
        if let Some((every, last)) = &mut self.watchdog
            && last.elapsed() >= *every / 2
        {
            *last = Instant::now();
            if let Err(e) = notify::notify("WATCHDOG=1", &[]) {
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
        mut conn: Option<OwnedFd>,
    ) -> Result<(), String> {
        if self.segments.reconnect(key, &mut conn) {
            return Ok(());
        }
        self.segments.refuse(key, &segment, &self.cfg)?;
        let label = key.to_string();
        let (job, mut asm) = self.segments.assembler(key, &segment, &self.cfg);
        let mut consumer = Consumer::new(segment);
        let spool = self.spool.as_ref();
        let recorded = |mark| {
            let origins = spool?.recorded_since(&job, mark);
            Some(origins.map(|o| o.into_iter().filter(|o| key.made(o)).collect()))
        };
        let now_ns = self.now_ns();
        let commit = CommitPoint::restore(
            &self.cfg.state_dir,
            &label,
            &mut consumer,
            &mut asm,
            recorded,
            now_ns,
            &mut self.daemon_lost,
        );
        let tail = consumer.segment().tail();
        // A previous daemon may have read (and delivered) any record written before now.
        let read_again_until = match commit.resumed() {
            true => consumer.segment().head(),
            false => 0,
        };
        let exited = conn.is_none();
        self.segments.add(Attached {
            key,
            label,
            conn,
            job,
            consumer,
            asm,
            read_upto: tail,
            read_again_until,
            gaps: 0,
            exited,
            roots_only_since: None,
            plugin_lost: [0; Counter::ALL.len()],
            commit,
        });
        self.refresh_local_ranks();
        Ok(())
    }

    /// The ranks of each (uid, communicator) on this node, for the statistics' root waits.
    fn refresh_local_ranks(&mut self) {
        self.stats.set_local_ranks(self.segments.local_ranks());
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
        for i in 0..self.segments.list.len() {
            let seg = &mut self.segments.list[i];
            // A batch is read in chunks that stay in cache between decoding and assembly.
            let mut left = batch;
            while left > 0 {
                let want = left.min(READ_CHUNK);
                let (first, reads) = match seg.consumer.read_raw(want, &mut self.reads) {
                    Ok(r) => r,
                    Err(e) => {
                        if let Some(held_back) = ratelimit::lines().allow(seg.key.uid) {
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
                        Ok(ref rec) => seg.asm.apply(pos, rec, now, &mut self.delivery.completed),
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
            self.delivery.end_run(i);
            // With many busy segments, deliver while what was assembled is still in cache.
            if self.delivery.due() {
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
                if (self.segments).check_ended(self.started, &self.cfg.state_dir) {
                    self.refresh_local_ranks();
                }
            }
            for i in 0..self.segments.list.len() {
                let seg = &mut self.segments.list[i];
                seg.asm.sweep(now, timeout, &mut self.delivery.completed);
                if seg.exited && seg.consumer.pending() == 0 {
                    seg.asm.finish_all(&mut self.delivery.completed);
                }
                self.delivery.end_run(i);
            }
            self.stats.expire(now);
        }
        if comms_changed {
            self.refresh_local_ranks();
        }
        self.deliver(now);
        deliver::send_roots_due(&mut self.stats, &self.out, &mut self.daemon_lost);
        // After delivery: what a segment held before it proved corrupt is still delivered.
        for i in broken.into_iter().rev() {
            let seg = self.segments.break_off(i, &self.cfg);
            self.daemon_lost.add(Loss::CorruptSegment, 1);
            (self.segments).forget(&seg, &self.states, &self.cfg.state_dir);
            self.segments.retire(seg);
        }
        self.collect_spooled();
        self.collect_states();
        self.collect_acks();
        self.commit_all(false);
        self.reap();
        if self.report.last_snapshot.elapsed() >= SNAPSHOT_EVERY {
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

    /// Delivers what the segments completed: the statistics' pass, the spool's write-ahead states,
    /// then the spool and the export ([`Delivery::send`]), whose decisions each segment's commit
    /// point takes.
    fn deliver(&mut self, now: u64) {
        if self.delivery.completed.is_empty() {
            return;
        }
        let list = &mut self.segments.list;
        let shown = |i: usize| (list[i].asm.names(), list[i].read_again_until);
        self.delivery
            .observe(shown, &self.cfg, &mut self.stats, now);
        if let Some(spool) = &self.spool {
            for i in self.delivery.segments(true) {
                let end = spool.end(&list[i].job);
                let (cp, r) = list[i].split();
                cp.write_ahead(r, &mut self.states, end, &mut self.daemon_lost);
            }
        }
        let mut sources: Vec<Option<Source>> = Vec::new();
        sources.resize_with(list.len(), || None);
        for i in self.delivery.segments(false) {
            let seg = &list[i];
            let spool = self.spool.as_ref();
            sources[i] = Some(Source {
                key: seg.key,
                names: seg.asm.names(),
                next_emit: seg.commit.next_emit,
                acked: &seg.commit.acked,
                spool_mark: spool.map(|s| seg.commit.spool_mark(|| s.end(&seg.job))),
                state_not_on_disk: seg.commit.state_not_on_disk(),
                read_again_until: seg.read_again_until,
            });
        }
        let to = Sinks {
            spool: self.spool.as_mut(),
            hub: &self.hub,
            out: &self.out,
            lost: &mut self.daemon_lost,
        };
        let (decided, batch) = self.delivery.send(&sources, to);
        drop(sources);
        for d in decided {
            list[d.seg].commit.take(d, batch);
        }
    }

    /// Takes note of the batches the spool writer made durable, and counts the instances it could
    /// not append.
    fn collect_spooled(&mut self) {
        let Some(spool) = &self.spool else {
            return;
        };
        let durable = spool.durable();
        for seg in &mut self.segments.list {
            seg.commit.spool_durable(durable);
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
            if let Some(seg) = self.segments.list.iter_mut().find(|s| s.label == label) {
                seg.commit.state_failed(no);
            }
        }
        for seg in &mut self.segments.list {
            seg.commit.states_durable(durable, &mut seg.consumer);
        }
    }

    fn collect_acks(&mut self) {
        for seg in &mut self.segments.list {
            seg.commit.collect_acks();
        }
    }

    /// Saves state and commits each segment whose commit point moved (at most every
    /// `COMMIT_EVERY` unless `now` or the ring is a quarter full). With `now` (shutdown), waits
    /// (bounded by the shutdown timeout) until the states are durable and the tails committed.
    fn commit_all(&mut self, now: bool) {
        let now_ns = self.now_ns();
        for seg in &mut self.segments.list {
            // Operations open long (sooner once the ring is over half full) no longer hold the
            // tail: the state carries them. Not younger ones even then: they mostly complete within
            // a few ticks, and parking them would save the state at every commit (a forced commit
            // passes them instead).
            let after = match ring_pressed(&seg.consumer) {
                true => PARK_PRESSED,
                false => PARK_AFTER,
            };
            let read_before = (now_ns.saturating_sub(after.as_nanos() as u64)).min(self.tick_ns);
            self.parked_ops += seg.asm.park(seg.read_upto, read_before);
            Self::commit(
                seg,
                &mut self.states,
                self.spool.as_ref(),
                now,
                &mut self.daemon_lost,
                &mut self.forced_commits,
            );
        }
        if now {
            self.states.flush(self.cfg.shutdown_timeout());
            self.collect_states();
        }
    }

    /// Moves `seg`'s commit point where it can go (see [`CommitPoint::commit`]).
    fn commit(
        seg: &mut Attached,
        states: &mut StateWriter,
        spool: Option<&SpoolWriter>,
        now: bool,
        lost: &mut Losses,
        forced: &mut u64,
    ) {
        let end = spool.map(|s| seg.commit.spool_mark(|| s.end(&seg.job)));
        let (cp, r) = seg.split();
        cp.commit(r, states, now, end, lost, forced);
    }

    /// Detaches segments whose process exited once everything they held is delivered (see
    /// [`Segments::take_drained`]).
    fn reap(&mut self) {
        let grace = Duration::from_millis(self.cfg.aggregate.skew_window_ms);
        let mut i = 0;
        while let Some(mut seg) = self.segments.take_drained(&mut i, grace) {
            Self::commit(
                &mut seg,
                &mut self.states,
                self.spool.as_ref(),
                true,
                &mut self.daemon_lost,
                &mut self.forced_commits,
            );
            (self.segments).forget(&seg, &self.states, &self.cfg.state_dir);
            tracing::info!(segment = %seg.label, "process exited; segment drained and dropped");
            self.segments.retire(seg);
            self.refresh_local_ranks();
        }
    }

    fn sources(&self) -> Sources<'_> {
        Sources {
            segments: &self.segments,
            stats: &self.stats,
            out: &self.out,
            daemon_lost: &self.daemon_lost,
            collectives: self.delivery.collectives,
            forced_commits: self.forced_commits,
            parked_ops: self.parked_ops,
            clock_steps: self.clock.steps,
        }
    }

    /// The daemon's health: plugin counters of every segment seen plus the daemon's own.
    pub fn health(&self) -> Health {
        report::health(&self.sources())
    }

    /// Refreshes the hub's stats/jobs snapshots and the metrics (Prometheus text, OTLP when due).
    fn snapshot(&mut self, final_export: bool) {
        self.stats
            .evict_idle(self.now_ns(), SERIES_IDLE.as_nanos() as u64);
        let metrics_from = self.report.taken(&self.cfg, &self.out, final_export);
        report::snapshot(&self.sources(), &self.hub, &self.cfg, metrics_from);
    }
}
