//! The ingest engine: one thread that drains every attached segment on a shared adaptive ticker,
//! assembles collective instances, records them (spool, then live subscribers, statistics), queues
//! sampled ones for OTLP, and commits each segment's tail only past records whose effects are safe.
//!
//! Commit point of a segment = the oldest of: the first record of an operation still in flight, the
//! first record of a completed operation whose span is not yet acknowledged by the exporter, and the
//! read position. Before committing, the segment's resume state (see [`crate::state`]) is saved, so a
//! daemon killed at any point re-reads what it had not finished and skips what it had delivered.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc as std_mpsc};
use std::time::{Duration, Instant};

use ncclscope_proto::api::{
    Communicator, Health as ApiHealth, Job, ListJobsResponse, RankInfo, StatsResponse,
};
use ncclscope_proto::now_ns;
use ncclscope_proto::segment::{self, Consumer, Counter, RawRead, Segment, SegmentName};
use opentelemetry_proto::tonic::metrics::v1::Metric;
use tokio::sync::{mpsc, oneshot, watch};

use crate::assemble::{AssembleCounters, Assembler, Completed, done};
use crate::config::Config;
use crate::hub::{Durable, Hub};
use crate::instance::{InstanceRef, Shared};
use crate::metrics::{self, Health};
use crate::otlp::{ExportCounters, SpanItem};
use crate::state::{self, SegmentState};
use crate::stats::Stats;

/// A segment handed over by the registration socket, already opened and checked against its peer.
pub struct Attach {
    pub name: SegmentName,
    pub segment: Segment,
    pub reply: oneshot::Sender<Result<(), String>>,
}

/// Where the engine sends what it produces besides the spool and the hub.
pub struct Outputs {
    pub spans: Option<mpsc::Sender<SpanItem>>,
    pub metrics: Option<mpsc::Sender<Vec<Metric>>>,
    pub export_counters: Arc<ExportCounters>,
    pub prometheus: watch::Sender<Arc<String>>,
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
/// Records decoded at once (a few pages: still in cache when they are applied).
const READ_CHUNK: usize = 256;
/// Completed instances delivered (spooled, counted, queued for export) at once, at most about.
const DELIVER_AT: usize = 1024;

struct Attached {
    name: SegmentName,
    label: String,
    consumer: Consumer,
    asm: Assembler,
    read_upto: u64,
    acked: Arc<AtomicU64>,
    next_emit: u64,
    /// Completed operations queued for export, oldest first: (emit number, first record, op id).
    unacked: VecDeque<(u64, u64, u64)>,
    /// Operations this daemon delivered whose records are not yet committed: id -> (pos, sinks).
    delivered: HashMap<u64, (u64, u8), foldhash::fast::RandomState>,
    last_commit: Instant,
    /// `delivered` changed since the state was last saved.
    dirty: bool,
    /// A state file for this segment exists (saved by this daemon, or restored from a previous one).
    state_saved: bool,
    exited: bool,
}

pub struct Engine {
    cfg: Arc<Config>,
    segments: Vec<Attached>,
    stats: Stats,
    hub: Arc<Hub>,
    spool: Option<Box<dyn Durable>>,
    out: Outputs,
    started_ns: u64,
    /// Plugin counters and assembler counters of segments already reaped.
    reaped_plugin: [u64; Counter::ALL.len()],
    reaped_asm: AssembleCounters,
    daemon_lost: HashMap<&'static str, u64>,
    collectives: u64,
    /// Segments detached as corrupt; skipped by rescans while they exist.
    broken: std::collections::HashSet<SegmentName>,
    /// Buffers reused by every tick (their capacity would otherwise be reallocated each time).
    reads: Vec<RawRead>,
    /// Instances completed and not yet delivered, and which segment's they are: runs of `completed`
    /// by segment index (kept in place: moving an instance out costs more than reading it).
    completed: Vec<Completed>,
    completed_runs: Vec<(usize, std::ops::Range<usize>)>,
    last_sweep: Instant,
    last_liveness: Instant,
    last_snapshot: Instant,
    last_metrics_export: Instant,
    last_rescan: Instant,
}

fn add(a: &mut AssembleCounters, b: &AssembleCounters) {
    a.records += b.records;
    a.decode_errors += b.decode_errors;
    a.kernel_unjoined += b.kernel_unjoined;
    a.dev_work += b.dev_work;
    a.dev_joined += b.dev_joined;
    a.incomplete += b.incomplete;
    a.pending_overflow += b.pending_overflow;
    a.uncalibrated += b.uncalibrated;
    a.host_anchored += b.host_anchored;
    a.unknown_comm += b.unknown_comm;
    a.dev_unattributed += b.dev_unattributed;
    a.dev_mismatch += b.dev_mismatch;
    a.template_full += b.template_full;
}

impl Engine {
    pub fn new(
        cfg: Arc<Config>,
        hub: Arc<Hub>,
        spool: Option<Box<dyn Durable>>,
        out: Outputs,
    ) -> Engine {
        let now = Instant::now();
        Engine {
            stats: Stats::new(
                cfg.aggregate.rolling_window_s * 1_000_000_000,
                cfg.aggregate.skew_window_ms * 1_000_000,
                cfg.aggregate.max_series,
            ),
            cfg,
            segments: Vec::new(),
            hub,
            spool,
            out,
            started_ns: now_ns(),
            reaped_plugin: [0; Counter::ALL.len()],
            reaped_asm: AssembleCounters::default(),
            daemon_lost: HashMap::new(),
            collectives: 0,
            broken: Default::default(),
            reads: Vec::new(),
            completed: Vec::new(),
            completed_runs: Vec::new(),
            last_sweep: now,
            last_liveness: now,
            last_snapshot: now,
            last_metrics_export: now,
            last_rescan: now,
        }
    }

    /// Drains until `stop` is set; then reads what is left (bounded by the shutdown timeout), commits
    /// and saves every segment's state. Operations still in flight stay uncommitted for the next daemon.
    pub fn run(mut self, registrations: std_mpsc::Receiver<Attach>, stop: Arc<AtomicBool>) {
        self.rescan();
        let min = Duration::from_millis(self.cfg.drain.min_interval_ms);
        let max = Duration::from_millis(self.cfg.drain.max_interval_ms);
        let mut interval = min;
        while !stop.load(Ordering::Acquire) {
            while let Ok(a) = registrations.try_recv() {
                let r = self.attach(a.name, a.segment, true);
                let _ = a.reply.send(r);
            }
            let busy = self.tick();
            interval = if busy { min } else { (interval * 2).min(max) };
            std::thread::sleep(interval);
        }
        let deadline = Instant::now() + self.cfg.shutdown_timeout();
        while self.tick() && Instant::now() < deadline {}
        // Wait for the exporter's acknowledgements, so a clean restart re-sends nothing.
        while self.segments.iter().any(|s| !s.unacked.is_empty()) && Instant::now() < deadline {
            std::thread::sleep(min);
            self.tick();
        }
        self.commit_all(true);
        self.snapshot(true);
        tracing::info!(segments = self.segments.len(), "ingest stopped");
    }

    /// Attaches `segment` unless it is attached already. `registered`: came through the socket.
    pub fn attach(
        &mut self,
        name: SegmentName,
        segment: Segment,
        registered: bool,
    ) -> Result<(), String> {
        let label = name.to_string();
        if self.segments.iter().any(|s| s.name == name) {
            return Ok(());
        }
        if self.segments.len() >= self.cfg.drain.max_segments {
            *self.daemon_lost.entry("segments_refused").or_default() += 1;
            return Err(format!(
                "daemon is at drain.max_segments = {}",
                self.cfg.drain.max_segments
            ));
        }
        let owner = segment.owner();
        let mut asm = Assembler::new(
            owner.pid,
            owner.job_id.clone(),
            owner.hostname.clone(),
            self.cfg.aggregate.max_pending_ops,
        );
        let mut state_saved = false;
        match state::load(&self.cfg.state_dir, &label) {
            Ok(Some(st)) if st.tail <= segment.tail() => {
                asm.restore(st.dictionary, st.delivered);
                state_saved = true;
            }
            Ok(Some(_)) | Ok(None) => {
                if segment.tail() > 0 {
                    // Records before the tail defined strings and communicators we no longer know.
                    tracing::warn!(segment = %label, "no resume state for a partly consumed segment");
                    *self.daemon_lost.entry("resume_state_missing").or_default() += 1;
                }
            }
            Err(e) => {
                tracing::warn!(segment = %label, error = %e, "unreadable resume state; starting without it");
                *self.daemon_lost.entry("resume_state_missing").or_default() += 1;
            }
        }
        tracing::info!(segment = %label, pid = owner.pid, job = %owner.job_id, tail = segment.tail(), head = segment.head(), registered, "segment attached");
        let consumer = Consumer::new(segment);
        let read_upto = consumer.segment().tail();
        self.segments.push(Attached {
            name,
            label,
            consumer,
            asm,
            read_upto,
            acked: Arc::new(AtomicU64::new(0)),
            next_emit: 1,
            unacked: VecDeque::new(),
            delivered: HashMap::default(),
            last_commit: Instant::now(),
            dirty: false,
            state_saved,
            exited: false,
        });
        self.refresh_local_ranks();
        Ok(())
    }

    /// Finds segments with our prefix that are not attached (start-up recovery, and processes that
    /// never managed to register).
    fn rescan(&mut self) {
        self.last_rescan = Instant::now();
        let names = match segment::list(&self.cfg.shm_prefix) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "cannot scan {}", segment::SHM_DIR);
                return;
            }
        };
        for name in names.iter().cloned() {
            if self.segments.iter().any(|s| s.name == name) || self.broken.contains(&name) {
                continue;
            }
            match Segment::open(&name) {
                Ok(seg) => {
                    let owner = seg.owner();
                    if seg.file_uid() != owner.uid || owner.uid != name.uid || owner.pid != name.pid
                    {
                        tracing::warn!(segment = %name, "owner in the header does not match the object or its name; ignored");
                        continue;
                    }
                    if let Err(e) = self.attach(name, seg, false) {
                        tracing::warn!(error = %e, "segment not attached");
                    }
                }
                Err(segment::SegmentError::NotReady { .. }) => {}
                Err(e) => tracing::warn!(error = %e, "segment ignored"),
            }
        }
        // Resume state of segments that no longer exist (removed while no daemon ran). A segment that
        // exists but is not attached (not ready, refused) keeps its state for a later attach.
        let existing: Vec<String> = names.iter().map(SegmentName::to_string).collect();
        for stale in state::list(&self.cfg.state_dir) {
            if !existing.contains(&stale)
                && SegmentName::parse(&stale).is_some_and(|n| n.prefix == self.cfg.shm_prefix)
            {
                state::remove(&self.cfg.state_dir, &stale);
            }
        }
        self.broken.retain(|n| names.contains(n));
        // A corrupt segment whose process is gone will never be read again: remove it.
        let dead: Vec<SegmentName> = self
            .broken
            .iter()
            .filter(|n| !segment::owner_alive(n))
            .cloned()
            .collect();
        for n in dead {
            let _ = Segment::unlink(&n);
            state::remove(&self.cfg.state_dir, &n.to_string());
            self.broken.remove(&n);
        }
    }

    fn refresh_local_ranks(&mut self) {
        let mut m: HashMap<u64, usize> = HashMap::new();
        for s in &self.segments {
            // Finalized communicators count too: their last collectives may still be awaited.
            for c in s.asm.all_comms() {
                *m.entry(c.comm_hash).or_default() += 1;
            }
        }
        self.stats.set_local_ranks(m);
    }

    /// One pass over every segment. Returns whether any segment had a full batch (more is waiting).
    pub fn tick(&mut self) -> bool {
        let now = now_ns();
        let batch = self.cfg.drain.batch_records;
        let mut busy = false;
        let mut comms_changed = false;
        let mut broken = Vec::new();
        for i in 0..self.segments.len() {
            let seg = &mut self.segments[i];
            // A batch is read in chunks that stay in cache between decoding and assembly.
            let mut left = batch;
            while left > 0 {
                let want = left.min(READ_CHUNK);
                self.reads.clear();
                let n = match seg.consumer.read_raw(want, &mut self.reads) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::error!(segment = %seg.label, error = %e, "corrupt segment detached");
                        broken.push(i);
                        break;
                    }
                };
                left -= n;
                for &(pos, ref words) in &self.reads {
                    seg.read_upto = pos + 1;
                    match ncclscope_proto::Record::decode(words) {
                        Ok(ref rec) => {
                            comms_changed |= matches!(
                                rec,
                                ncclscope_proto::Record::Comm { .. }
                                    | ncclscope_proto::Record::CommEnd { .. }
                            );
                            seg.asm.apply(pos, rec, now, &mut self.completed);
                        }
                        Err(_) => seg.asm.counters.decode_errors += 1,
                    }
                }
                if n < want {
                    break;
                }
            }
            busy |= left == 0;
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
            let check_alive = self.last_liveness.elapsed() >= LIVENESS_EVERY;
            if check_alive {
                self.last_liveness = Instant::now();
            }
            for i in 0..self.segments.len() {
                let seg = &mut self.segments[i];
                seg.asm.sweep(now, timeout, &mut self.completed);
                if check_alive && !seg.exited && !segment::owner_alive(&seg.name) {
                    seg.exited = true;
                }
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
        // After delivery: what a segment held before it proved corrupt is still delivered.
        for i in broken.into_iter().rev() {
            let seg = self.segments.remove(i);
            *self.daemon_lost.entry("corrupt_segment").or_default() += 1;
            // Not re-attached by the next scan: its cursors cannot be trusted.
            self.broken.insert(seg.name.clone());
            self.retire(seg);
        }
        self.collect_acks();
        self.commit_all(false);
        self.reap();
        if self.last_rescan.elapsed()
            >= Duration::from_millis(self.cfg.drain.rescan_interval_ms.max(1))
            && self.cfg.drain.rescan_interval_ms > 0
        {
            self.rescan();
        }
        if self.last_snapshot.elapsed() >= SNAPSHOT_EVERY {
            self.snapshot(false);
        }
        busy
    }

    /// Marks the instances completed since the last run as segment `i`'s.
    fn end_run(&mut self, i: usize) {
        let start = self.completed_runs.last().map_or(0, |r| r.1.end);
        if self.completed.len() > start {
            self.completed_runs.push((i, start..self.completed.len()));
        }
    }

    /// Spool first (durable), then the hub, statistics and the export queue.
    fn deliver(&mut self, now: u64) {
        if self.completed.is_empty() {
            return;
        }
        let mut completed = std::mem::take(&mut self.completed);
        let mut runs = std::mem::take(&mut self.completed_runs);
        if let Some(spool) = self.spool.as_mut() {
            let fresh: Vec<InstanceRef> = runs
                .iter()
                .flat_map(|(i, range)| {
                    let names = self.segments[*i].asm.names();
                    completed[range.clone()]
                        .iter()
                        .filter(|c| c.prior & done::RECORDED == 0)
                        .map(move |c| InstanceRef {
                            inst: &c.coll,
                            names,
                        })
                })
                .collect();
            if !fresh.is_empty()
                && let Err(e) = spool.append(&fresh)
            {
                tracing::error!(error = %e, n = fresh.len(), "spool append failed; instances not spooled");
                *self.daemon_lost.entry("spool_failed").or_default() += fresh.len() as u64;
            }
        }
        for (i, range) in runs.drain(..) {
            let seg = &mut self.segments[i];
            let names = seg.asm.names();
            for c in &mut completed[range] {
                let mut flags = c.prior;
                if c.prior & done::RECORDED == 0 {
                    self.hub.publish(&c.coll, names);
                    // "Slow" is judged against the series before this instance joins it.
                    let inst = InstanceRef {
                        inst: &c.coll,
                        names,
                    };
                    let p50 = self.stats.observe(inst, now, SLOW_MIN_SAMPLES);
                    let slow = self.cfg.otlp.slow_factor > 0.0
                        && p50.is_some_and(|p50| {
                            c.coll.exec_ns as f64 > self.cfg.otlp.slow_factor * p50 as f64
                        });
                    self.collectives += 1;
                    flags |= done::RECORDED;
                    if c.prior & done::EXPORTED == 0
                        && !slow
                        && !crate::spans::sampled(
                            c.coll.comm_hash,
                            crate::spans::collective_key(c.coll.seq, c.coll.replay),
                            self.cfg.otlp.sample_ratio,
                        )
                    {
                        flags |= done::EXPORTED;
                    }
                } else if c.prior & done::EXPORTED == 0
                    && !crate::spans::sampled(
                        c.coll.comm_hash,
                        crate::spans::collective_key(c.coll.seq, c.coll.replay),
                        self.cfg.otlp.sample_ratio,
                    )
                {
                    // Re-read after a restart: the slow-outlier verdict is gone with the old statistics.
                    flags |= done::EXPORTED;
                }
                if flags & done::EXPORTED == 0 {
                    match &self.out.spans {
                        Some(tx) => {
                            let emit_no = seg.next_emit;
                            let coll = Shared {
                                inst: std::mem::take(&mut c.coll),
                                names: names.clone(),
                            };
                            match tx.try_send(SpanItem {
                                coll,
                                acked: seg.acked.clone(),
                                emit_no,
                            }) {
                                Ok(()) => {
                                    seg.next_emit += 1;
                                    seg.unacked.push_back((emit_no, c.first_pos, c.op_id));
                                }
                                Err(_) => {
                                    *self.daemon_lost.entry("export_queue_full").or_default() += 1;
                                    flags |= done::EXPORTED;
                                }
                            }
                        }
                        None => flags |= done::EXPORTED,
                    }
                }
                seg.delivered.insert(c.op_id, (c.first_pos, flags));
                seg.dirty = true;
            }
        }
        completed.clear();
        self.completed = completed;
        self.completed_runs = runs;
    }

    fn collect_acks(&mut self) {
        for seg in &mut self.segments {
            let acked = seg.acked.load(Ordering::Acquire);
            while let Some(&(emit_no, _, id)) = seg.unacked.front() {
                if emit_no > acked {
                    break;
                }
                seg.unacked.pop_front();
                if let Some(e) = seg.delivered.get_mut(&id) {
                    e.1 |= done::EXPORTED;
                    seg.dirty = true;
                }
            }
        }
    }

    /// Saves state and commits each segment whose commit point moved (at most every [`COMMIT_EVERY`]
    /// unless `now` or the ring is a quarter full).
    fn commit_all(&mut self, now: bool) {
        for seg in &mut self.segments {
            commit(&self.cfg.state_dir, seg, now, &mut self.daemon_lost);
        }
    }

    /// Detaches segments whose process exited once everything they held is delivered.
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.segments.len() {
            let s = &self.segments[i];
            let drained = s.exited
                && s.consumer.pending() == 0
                && s.asm.pending() == 0
                && s.unacked.is_empty();
            if drained {
                let mut seg = self.segments.remove(i);
                commit(&self.cfg.state_dir, &mut seg, true, &mut self.daemon_lost);
                if let Err(e) = Segment::unlink(&seg.name) {
                    tracing::warn!(segment = %seg.label, error = %e, "unlink failed");
                }
                state::remove(&self.cfg.state_dir, &seg.label);
                tracing::info!(segment = %seg.label, "process exited; segment drained and removed");
                self.retire(seg);
                self.refresh_local_ranks();
            } else {
                i += 1;
            }
        }
    }

    fn retire(&mut self, seg: Attached) {
        for c in Counter::ALL {
            self.reaped_plugin[c as usize] += seg.consumer.segment().counter(c);
        }
        add(&mut self.reaped_asm, &seg.asm.counters);
    }

    /// The daemon's health: plugin counters of every segment seen plus the daemon's own.
    pub fn health(&self) -> Health {
        let mut asm = self.reaped_asm;
        let mut plugin = self.reaped_plugin;
        let mut max_cal = 0u32;
        for s in &self.segments {
            add(&mut asm, &s.asm.counters);
            for c in Counter::ALL {
                plugin[c as usize] += s.consumer.segment().counter(c);
            }
            max_cal = max_cal.max(s.asm.max_calibration_error_ns());
        }
        let mut lost = std::collections::BTreeMap::new();
        for c in Counter::ALL {
            lost.insert(c.name().to_string(), plugin[c as usize]);
        }
        let ec = &self.out.export_counters;
        lost.insert(
            "export_dropped".into(),
            ec.spans_dropped.load(Ordering::Relaxed),
        );
        lost.insert("kernel_unjoined".into(), asm.kernel_unjoined);
        lost.insert(
            "dev_unjoined".into(),
            asm.dev_work - asm.dev_joined - asm.dev_unattributed,
        );
        lost.insert("dev_unattributed".into(), asm.dev_unattributed);
        lost.insert("dev_mismatch".into(), asm.dev_mismatch);
        lost.insert("template_full".into(), asm.template_full);
        lost.insert("incomplete".into(), asm.incomplete);
        lost.insert("pending_overflow".into(), asm.pending_overflow);
        lost.insert("unknown_comm".into(), asm.unknown_comm);
        lost.insert("uncalibrated".into(), asm.uncalibrated);
        for (k, v) in &self.daemon_lost {
            lost.insert(k.to_string(), *v);
        }
        Health {
            segments: self.segments.len() as u64,
            records_in: asm.records,
            decode_errors: asm.decode_errors,
            collectives: self.collectives,
            lost,
            spans_exported: ec.spans_exported.load(Ordering::Relaxed),
            export_errors: ec.export_errors.load(Ordering::Relaxed),
            max_calibration_error_ns: max_cal,
            dev_work: asm.dev_work,
            dev_joined: asm.dev_joined,
        }
    }

    /// Refreshes the hub's stats/jobs snapshots and the metrics (Prometheus text, OTLP when due).
    fn snapshot(&mut self, final_export: bool) {
        self.last_snapshot = Instant::now();
        self.stats
            .evict_idle(now_ns(), SERIES_IDLE.as_nanos() as u64);
        let health = self.health();
        let mut lost_by_rank = HashMap::new();
        let mut jobs: HashMap<String, Job> = HashMap::new();
        for s in &self.segments {
            let lost: u64 = Counter::ALL
                .iter()
                .filter(|c| c.is_loss())
                .map(|&c| s.consumer.segment().counter(c))
                .sum();
            let job = jobs
                .entry(s.asm.job_id().to_string())
                .or_insert_with(|| Job {
                    job_id: s.asm.job_id().to_string(),
                    live: true,
                    ..Default::default()
                });
            for c in s.asm.comms() {
                lost_by_rank.insert((Arc::from(s.asm.job_id()), c.comm_hash, c.rank), lost);
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
        for (job_id, (n, first, last)) in self.stats.jobs() {
            let job = jobs.entry(job_id.to_string()).or_insert_with(|| Job {
                job_id: job_id.to_string(),
                ..Default::default()
            });
            job.collectives = n;
            job.first_unix_ns = first;
            job.last_unix_ns = last;
        }
        let mut jobs: Vec<Job> = jobs.into_values().collect();
        jobs.sort_by(|a, b| a.job_id.cmp(&b.job_id));
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
        let families = metrics::families(&self.stats, &health);
        let _ = self
            .out
            .prometheus
            .send(Arc::new(metrics::render_prometheus(&families)));
        if let Some(tx) = &self.out.metrics {
            let due = self.last_metrics_export.elapsed()
                >= Duration::from_millis(self.cfg.otlp.metrics_interval_ms);
            if due || final_export {
                self.last_metrics_export = Instant::now();
                let _ = tx.try_send(metrics::to_otlp(&families, self.started_ns, now_ns()));
            }
        }
    }
}

fn commit(
    state_dir: &std::path::Path,
    seg: &mut Attached,
    now: bool,
    lost: &mut HashMap<&'static str, u64>,
) {
    let mut target = seg.read_upto;
    if let Some(p) = seg.asm.oldest_pending_pos() {
        target = target.min(p);
    }
    if let Some(&(_, p, _)) = seg.unacked.front() {
        target = target.min(p);
    }
    let tail = seg.consumer.segment().tail();
    let dict_changed = seg.asm.take_dictionary_changed();
    if target <= tail && !dict_changed && !seg.dirty {
        return;
    }
    let lag = target.saturating_sub(tail);
    let quarter = seg.consumer.segment().capacity() / 4;
    if !now && !dict_changed && lag < quarter && seg.last_commit.elapsed() < COMMIT_EVERY {
        return;
    }
    seg.delivered.retain(|_, (pos, _)| *pos >= target);
    // A replay cursor that moved before the new tail makes the saved state stale for it.
    let cursors_moved = seg.asm.prune_prior(target);
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
    // A saved state stays valid for any later tail: with the same dictionary and nothing delivered
    // past the new tail, there is nothing new to save (the common case of a segment fully drained).
    if delivered.is_empty() && !dict_changed && !cursors_moved && seg.state_saved {
        seg.consumer.commit(target);
        seg.last_commit = Instant::now();
        seg.dirty = false;
        return;
    }
    let st = SegmentState {
        segment: seg.label.clone(),
        tail: target.max(tail),
        dictionary: seg.asm.dictionary(),
        delivered,
    };
    if let Err(e) = state::store(state_dir, &st) {
        // Without saved state a restart could not interpret what lies before the tail: keep it.
        tracing::error!(segment = %seg.label, error = %e, "cannot save resume state; not committing");
        *lost.entry("state_write_failed").or_default() += 1;
        return;
    }
    seg.state_saved = true;
    seg.consumer.commit(target);
    seg.last_commit = Instant::now();
    seg.dirty = false;
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclscope_proto::segment::{Owner, Producer};
    use ncclscope_proto::{Record, StrId, TimingPath};

    fn engine(
        dir: &std::path::Path,
        prefix: &str,
    ) -> (Engine, watch::Receiver<Arc<String>>, Arc<Hub>) {
        let cfg = Config {
            state_dir: dir.to_path_buf(),
            shm_prefix: prefix.into(),
            ..Config::default()
        };
        let (prom, rx) = watch::channel(Arc::new(String::new()));
        let hub = Arc::new(Hub::default());
        let out = Outputs {
            spans: None,
            metrics: None,
            export_counters: Arc::default(),
            prometheus: prom,
        };
        (Engine::new(Arc::new(cfg), hub.clone(), None, out), rx, hub)
    }

    fn producer(prefix: &str) -> (SegmentName, Producer) {
        let owner = Owner::of_process(std::process::id(), "h".into(), "j".into());
        let name = owner.segment_name(prefix);
        (
            name.clone(),
            Producer::new(Segment::create(&name, &owner, 64).unwrap()),
        )
    }

    fn write_colls(p: &mut Producer, seqs: std::ops::Range<u64>) {
        for seq in seqs {
            p.push(&Record::CollStart {
                comm: 0,
                id: seq + 1,
                seq,
                func: StrId(1),
                datatype: StrId(2),
                algo: StrId(0),
                proto: StrId(0),
                count: 1,
                root: -1,
                n_channels: 0,
                n_warps: 0,
                host_ns: 10,
                captured: false,
            });
            p.push(&Record::OpStop {
                comm: 0,
                id: seq + 1,
                host_ns: 20,
            });
        }
    }

    #[test]
    fn a_restarted_engine_resumes_from_the_saved_state_without_duplicates() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = format!("ncclscope-enginetest-{}", std::process::id());
        let (name, mut p) = producer(&prefix);
        p.push(&Record::str(StrId(1), b"AllReduce"));
        p.push(&Record::str(StrId(2), b"ncclFloat32"));
        p.push(&Record::Comm {
            comm: 0,
            comm_hash: 5,
            rank: 0,
            nranks: 1,
            nnodes: 1,
            cuda_dev: 0,
            name: StrId(0),
            nccl_version: 0,
            path: TimingPath::KernelCh,
            host_ns: 0,
        });
        write_colls(&mut p, 0..10);
        let (mut e1, _rx1, hub1) = engine(dir.path(), &prefix);
        let mut live = hub1.subscribe();
        e1.rescan();
        e1.tick();
        e1.commit_all(true);
        let mut seen = Vec::new();
        while let Ok(c) = live.try_recv() {
            seen.push(c.inst.seq);
        }
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        let saved = std::fs::read(state::path(dir.path(), &name.to_string())).unwrap();
        // Drained again with the same dictionary: the tail moves on, the saved state stays as it was.
        write_colls(&mut p, 10..20);
        e1.tick();
        e1.commit_all(true);
        assert_eq!(live.try_recv().unwrap().inst.seq, 10);
        assert_eq!(
            std::fs::read(state::path(dir.path(), &name.to_string())).unwrap(),
            saved
        );
        // The first engine goes away (tail committed): the dictionary records lie before the tail and
        // are not read again; only the saved state still knows them.
        drop(e1);
        write_colls(&mut p, 20..40);
        let (mut e2, _rx2, hub2) = engine(dir.path(), &prefix);
        let mut live = hub2.subscribe();
        e2.rescan();
        e2.tick();
        let mut seen = Vec::new();
        while let Ok(c) = live.try_recv() {
            assert_eq!(
                (c.view().func(), c.inst.comm_hash, c.inst.bytes),
                ("AllReduce", 5, 4),
                "dictionary restored"
            );
            seen.push(c.inst.seq);
        }
        assert_eq!(
            seen,
            (20..40).collect::<Vec<_>>(),
            "nothing twice, nothing missing"
        );
        Segment::unlink(&name).unwrap();
    }

    #[test]
    fn a_corrupt_segment_is_detached_counted_and_not_reattached() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = format!("ncclscope-enginecorrupt-{}", std::process::id());
        let (name, mut p) = producer(&prefix);
        let (mut e, _rx, _hub) = engine(dir.path(), &prefix);
        e.rescan();
        assert_eq!(e.health().segments, 1);
        // Someone else consumes and commits behind the engine's back, so the producer's cursor runs
        // more than a ring ahead of the engine's read cursor: corrupt.
        for _ in 0..64 {
            p.push(&Record::CommEnd {
                comm: 0,
                host_ns: 0,
            });
        }
        let raw = Segment::open(&name).unwrap();
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
        e.rescan();
        assert_eq!(e.health().segments, 0, "not re-attached");
        Segment::unlink(&name).unwrap();
    }
}
