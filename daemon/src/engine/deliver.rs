//! Delivery: the instances the segments' assemblers completed go to the statistics, the spool
//! (queued for its writer thread), the hub and the export queue, and each segment's commit point
//! learns what it must wait for (spool batches, unacknowledged spans, unsettled roots).

use std::sync::Arc;

use ncclscope_proto::api::LiveSpans;
use opentelemetry_proto::tonic::metrics::v1::Metric;
use tokio::sync::{mpsc, watch};

use crate::assemble::{Completed, done};
use crate::config::Config;
use crate::export::export_queue::{ExportCounters, SpanItem};
use crate::export::prometheus;
use crate::export::resend::Dropped;
use crate::instance::{InstanceRef, Shared};
use crate::loss::{Loss, Losses};
use crate::stats::{RootWait, Stats};
use crate::storage::hub::{Hub, SpoolRun};
use crate::storage::spool::{Origin, Position};
use crate::storage::spool_writer::SpoolWriter;
use crate::storage::state_writer::StateWriter;

use super::commit::{OpDone, Parked};
use super::segment::Attached;

/// Minimum samples in a series before "slower than slow_factor x p50" keeps an instance.
const SLOW_MIN_SAMPLES: u64 = 100;
/// Completed instances delivered (spooled, counted, queued for export) at once, at most about.
const DELIVER_AT: usize = 1024;

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

/// What a delivery writes to besides the segments.
pub(super) struct Sinks<'a> {
    pub cfg: &'a Config,
    pub stats: &'a mut Stats,
    pub spool: Option<&'a mut SpoolWriter>,
    pub states: &'a mut StateWriter,
    pub hub: &'a Hub,
    pub out: &'a Outputs,
    pub lost: &'a mut Losses,
}

/// Instances completed and not yet delivered, and which segment's they are.
#[derive(Default)]
pub(super) struct Delivery {
    /// Runs of `completed` by segment index (kept in place: moving an instance out costs more than
    /// reading it).
    pub completed: Vec<Completed>,
    completed_runs: Vec<(usize, std::ops::Range<usize>)>,
    /// The root settlements of `completed`, in the order of `completed_runs`, while delivering.
    root_waits: Vec<Option<RootWait>>,
    /// Instances recorded by this daemon (not re-read after a restart).
    pub collectives: u64,
}

impl Delivery {
    /// Marks the instances completed since the last run as segment `i`'s.
    pub fn end_run(&mut self, i: usize) {
        let start = self.completed_runs.last().map_or(0, |r| r.1.end);
        if self.completed.len() > start {
            self.completed_runs.push((i, start..self.completed.len()));
        }
    }

    /// Whether enough is completed to deliver now, while it is still in cache.
    pub fn due(&self) -> bool {
        self.completed.len() >= DELIVER_AT
    }

    /// Statistics, then the spool (queued for the writer thread, which publishes to the hub once
    /// the instances are durable; without a spool, published here), then the export queue. An
    /// operation enters `delivered` (the saved state's "recorded") only once its batch is durable
    /// (see `CommitPoint::spool_durable`); until then it holds its segment's tail.
    pub fn deliver(&mut self, segments: &mut [Attached], to: Sinks<'_>, now: u64) {
        if self.completed.is_empty() {
            return;
        }
        let Sinks {
            cfg,
            stats,
            mut spool,
            states,
            hub,
            out,
            lost,
        } = to;
        let mut completed = std::mem::take(&mut self.completed);
        let mut runs = std::mem::take(&mut self.completed_runs);
        // Each instance's root settlement to wait on, in the order of `runs` (taken in the next pass).
        let mut waits = std::mem::take(&mut self.root_waits);
        // Statistics first, for the live-export decision ("slow" is judged against the series before
        // the instance joins it), which the spool keeps so that a file export writes the same spans.
        // Nothing outside the engine reads the statistics before this pass ends (snapshots come after
        // it), so what they count is still queued for the spool first.
        for (i, range) in &runs {
            let names = segments[*i].asm.names();
            for c in &mut completed[range.clone()] {
                let inst = InstanceRef {
                    inst: &c.coll,
                    names,
                };
                let otlp = &cfg.otlp;
                let observed = if c.prior & done::RECORDED != 0 {
                    // Re-read after a restart: counted by the daemon that recorded it (the
                    // slow-outlier verdict is gone with its statistics); it meets its collective's
                    // other ranks again, whose records waited for the root as its did.
                    let key = crate::spans::instance_key(inst);
                    let live = live_spans(otlp, false, inst.comm_hash, key);
                    let mut o = stats.rejoin(inst, now, live);
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
                    stats.observe(inst, now, SLOW_MIN_SAMPLES, |p50, key| {
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
        // The last state the spool writer must write this batch after (see `CommitPoint::on_disk`).
        let mut after = 0;
        if let Some(spool) = &spool {
            // Write-ahead: the saved state's spool mark must precede what the segment queues now.
            for (i, range) in &runs {
                let seg = &mut segments[*i];
                let end = spool.end(&seg.job);
                if seg.commit.mark_stale(Some(end))
                    && completed[range.clone()]
                        .iter()
                        .any(|c| c.prior & done::RECORDED == 0)
                {
                    // The parked operations as last saved (for this tail): some may have
                    // completed in this very batch, and are recorded (or not) only by what follows.
                    let parked = Parked::AsSaved;
                    let mark = seg.commit.spool_mark(|| spool.end(&seg.job));
                    let (cp, r) = seg.split();
                    let tail = cp.tail;
                    if let Err(e) = cp.save_state(&r, states, tail, Some(mark), parked) {
                        tracing::error!(segment = %r.label, error = %e, "cannot save resume state before spooling; a crash now could record these instances twice");
                        lost.add(Loss::StateWriteFailed, 1);
                    }
                }
            }
        }
        let mut batch = Vec::new();
        // Per segment index: (the spool's end before this batch, its operations in the batch).
        let mut spooled: Vec<(usize, Position, Vec<OpDone>)> = Vec::new();
        for (i, range) in runs.drain(..) {
            let seg = &mut segments[i];
            let names = seg.asm.names();
            let mut ops = Vec::new();
            let mut items = match &spool {
                Some(spool) => spool.buffer(),
                None => Vec::new(),
            };
            for c in &mut completed[range] {
                let mut flags = c.prior;
                let fresh = c.prior & done::RECORDED == 0;
                if fresh {
                    if spool.is_none() {
                        hub.publish(&c.coll, names);
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
                    match &out.spans {
                        // Not a graph replay's read for the first time: every replay held back
                        // by its root kept a segment's tail from moving across kills a second
                        // apart (its re-read ranks wait the skew window for ranks the kill did
                        // not make read again), and the ring filled. One read again waits: it
                        // is what counts the root as possibly lost (`stats::root_at_risk`), and
                        // a kill before that reads it again.
                        Some(_) if c.coll.replay > 0 && fresh => {}
                        Some(_) => seg.commit.hold_root(c.first_pos, w),
                        None => w.settle(),
                    }
                }
                let to_spool = fresh && spool.is_some();
                if flags & done::EXPORTED == 0 || c.coll.trace_root.is_some() {
                    match &out.spans {
                        Some(tx) => {
                            let emit_no = seg.commit.next_emit;
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
                                acked: Some(seg.commit.acked.clone()),
                                emit_no,
                                settles: carried,
                            }) {
                                Ok(()) => seg.commit.emitted(emit_no, c.first_pos, c.op_id),
                                Err(e) => {
                                    lost.add(Loss::ExportQueueFull, 1);
                                    flags |= done::EXPORTED;
                                    let item = e.into_inner();
                                    if let Some(root) = item.settles {
                                        root.settle();
                                    }
                                    if let Some(d) = &out.dropped {
                                        let c = item.coll;
                                        let v = c.view();
                                        let key = crate::export::resend::key(v);
                                        d.remember(v.uid(), v.job_id(), key, &out.export_counters);
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
                    seg.commit.recorded(c.op_id, c.first_pos, flags);
                }
            }
            if let Some(spool) = &spool
                && !ops.is_empty()
            {
                if let Some(no) = seg.commit.state_not_on_disk() {
                    after = after.max(no);
                }
                spooled.push((i, seg.commit.spool_mark(|| spool.end(&seg.job)), ops));
                let names = names.clone();
                batch.push(SpoolRun { names, items });
            }
        }
        completed.clear();
        drop(waits_in_order);
        self.completed = completed;
        self.completed_runs = runs;
        self.root_waits = waits;
        let Some(spool) = &mut spool else {
            return;
        };
        if batch.is_empty() {
            return;
        }
        let queued = spool.queue(batch, after);
        for (i, mark, ops) in spooled {
            // Refused: recorded without the spool (counted), as when an append fails.
            let no = queued.as_ref().map(|&no| no).map_err(|_| ());
            segments[i].commit.spooled(no, mark, ops);
        }
        if let Err(batch) = queued {
            let n: usize = batch.iter().map(|r| r.items.len()).sum();
            tracing::warn!(n, "spool writer behind; instances not spooled");
            lost.add(Loss::SpoolBacklog, n as u64);
            for run in &batch {
                for (_, inst) in &run.items {
                    hub.publish(inst, &run.names);
                }
            }
        }
    }
}

/// Sends the root spans of collectives whose skew window closed before every local rank came
/// ([`Stats::take_roots_due`]); their ranks' records wait until the export ends. A root the
/// export queue refuses is counted there (`export_queue_full`) and waited on no longer.
pub(super) fn send_roots_due(stats: &mut Stats, out: &Outputs, lost: &mut Losses) {
    for (coll, wait) in stats.take_roots_due() {
        let Some(tx) = &out.spans else {
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
            lost.add(Loss::ExportQueueFull, 1);
            if let Some(w) = e.into_inner().settles {
                w.settle();
            }
        }
    }
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
