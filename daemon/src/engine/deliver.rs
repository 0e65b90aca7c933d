//! Delivery: the instances the segments' assemblers completed go to the statistics, the spool
//! (queued for its writer thread), the hub and the export queue; what each segment's commit point
//! must wait for (spool batches, unacknowledged spans, unsettled roots) is returned to the router.
//! It sees of a segment only what the router shows it ([`Source`]).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use ncclscope_proto::api::LiveSpans;
use opentelemetry_proto::tonic::metrics::v1::Metric;
use tokio::sync::{mpsc, watch};

use crate::assemble::{Completed, done};
use crate::config::Config;
use crate::export::export_queue::{ExportCounters, SpanItem};
use crate::export::prometheus;
use crate::export::resend::{Dropped, Wanted};
use crate::instance::{InstanceRef, Names, Shared};
use crate::loss::{Loss, Losses};
use crate::stats::{RootWait, Stats};
use crate::storage::hub::{Hub, SpoolRun};
use crate::storage::spool::{Origin, Position};
use crate::storage::spool_writer::SpoolWriter;

use super::commit::Delivered;
use super::segment::SegmentKey;

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

/// What a delivery writes to.
pub(super) struct Sinks<'a> {
    pub spool: Option<&'a mut SpoolWriter>,
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

    /// Segments (indices) with instances to deliver, each once; with `fresh`, only those with
    /// instances this daemon did not record before (not read again after a restart): what the
    /// spool will take of them.
    pub fn segments(&self, fresh: bool) -> Vec<usize> {
        let mut segs: Vec<usize> = (self.completed_runs.iter())
            .filter(|(_, range)| {
                !fresh
                    || (self.completed[range.clone()].iter()).any(|c| c.prior & done::RECORDED == 0)
            })
            .map(|(i, _)| *i)
            .collect();
        segs.sort_unstable();
        segs.dedup();
        segs
    }

    /// The statistics' pass, before anything is sent: the live-export decision ("slow" is judged
    /// against the series before the instance joins it), which the spool keeps so that a file
    /// export writes the same spans, the root each instance carries and the settlement it waits on.
    /// Nothing outside the engine reads the statistics before the delivery ends (snapshots come
    /// after it), so what they count is still queued for the spool first. `shown`: a segment's
    /// names and `read_again_until` (see `Attached`).
    pub fn observe<'n>(
        &mut self,
        shown: impl Fn(usize) -> (&'n Arc<Names>, u64),
        cfg: &Config,
        stats: &mut Stats,
        now: u64,
    ) {
        let otlp = &cfg.otlp;
        for (i, range) in &self.completed_runs {
            let (names, read_again_until) = shown(*i);
            for c in &mut self.completed[range.clone()] {
                let inst = InstanceRef {
                    inst: &c.coll,
                    names,
                };
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
                    // Not recorded by the daemon before a restart, though it may have read it
                    // (killed before the spool had it): it meets its collective's ranks as one
                    // read again does (`Stats::observe_read`).
                    let again = c.first_pos < read_again_until;
                    stats.observe_read(inst, now, SLOW_MIN_SAMPLES, again, |p50, key| {
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
                self.root_waits.push(observed.root_wait);
            }
        }
    }

    /// After [`Self::observe`] (and the spool's write-ahead states): the spool (queued for the
    /// writer thread, which publishes to the hub once the instances are durable; without a spool,
    /// published here), then the export queue. `sources`: by segment index, those with instances
    /// to deliver. What each segment's commit point must wait for is returned (the router hands it
    /// over): an operation enters its `delivered` (the saved state's "recorded") only once its
    /// batch is durable (see `CommitPoint::spool_durable`); until then it holds its segment's tail.
    pub fn send(
        &mut self,
        sources: &[Option<Source<'_>>],
        to: Sinks<'_>,
    ) -> (Vec<Delivered>, Result<u64, ()>) {
        let Sinks {
            mut spool,
            hub,
            out,
            lost,
        } = to;
        let mut completed = std::mem::take(&mut self.completed);
        let mut runs = std::mem::take(&mut self.completed_runs);
        let mut waits = std::mem::take(&mut self.root_waits);
        let mut waits_in_order = waits.drain(..);
        let mut decided: Vec<Option<Delivered>> = Vec::new();
        decided.resize_with(sources.len(), || None);
        // The last state the spool writer must write this batch after (see `CommitPoint::on_disk`).
        let mut after = 0;
        let mut batch = Vec::new();
        for (i, range) in runs.drain(..) {
            let src = sources[i]
                .as_ref()
                .expect("a source for every segment delivered");
            let d = decided[i].get_or_insert_with(|| Delivered {
                seg: i,
                ..Delivered::default()
            });
            let names = src.names;
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
                        // a kill before that reads it again; so does one a daemon before a
                        // restart may have read without recording it.
                        Some(_)
                            if c.coll.replay > 0
                                && fresh
                                && c.first_pos >= src.read_again_until => {}
                        Some(_) => d.roots.push((c.first_pos, w)),
                        None => w.settle(),
                    }
                }
                let to_spool = fresh && spool.is_some();
                if flags & done::EXPORTED == 0 || c.coll.trace_root.is_some() {
                    match &out.spans {
                        Some(tx) => {
                            // Numbered on from the commit point's next, in the order queued.
                            let emit_no = src.next_emit + d.emitted.len() as u64;
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
                                acked: Some(src.acked.clone()),
                                emit_no,
                                settles: carried,
                            }) {
                                Ok(()) => d.emitted.push((emit_no, c.first_pos, c.op_id)),
                                Err(e) => {
                                    lost.add(Loss::ExportQueueFull, 1);
                                    flags |= done::EXPORTED;
                                    let item = e.into_inner();
                                    if let Some(root) = item.settles {
                                        root.settle();
                                    }
                                    remember_dropped(out, item.coll.view());
                                }
                            }
                        }
                        None => flags |= done::EXPORTED,
                    }
                }
                if to_spool {
                    let k = src.key;
                    let origin = Origin {
                        uid: k.uid,
                        pid: k.pid,
                        inode: k.inode,
                        op_id: c.op_id,
                        first_pos: c.first_pos,
                    };
                    items.push((origin, std::mem::take(&mut c.coll)));
                    ops.push((c.op_id, c.first_pos, flags));
                } else {
                    d.recorded.push((c.op_id, c.first_pos, flags));
                }
            }
            if !ops.is_empty() {
                if let Some(no) = src.state_not_on_disk {
                    after = after.max(no);
                }
                let mark = src.spool_mark.expect("a spool mark with a spool");
                d.spooled
                    .get_or_insert_with(|| (mark, Vec::new()))
                    .1
                    .extend(ops);
                let names = names.clone();
                batch.push(SpoolRun { names, items });
            }
        }
        completed.clear();
        drop(waits_in_order);
        self.completed = completed;
        self.completed_runs = runs;
        self.root_waits = waits;
        let decided: Vec<Delivered> = decided.into_iter().flatten().collect();
        let Some(spool) = &mut spool else {
            return (decided, Err(()));
        };
        if batch.is_empty() {
            return (decided, Err(()));
        }
        let queued = spool.queue(batch, after);
        // Refused: recorded without the spool (counted), as when an append fails.
        let no = queued.as_ref().map(|&no| no).map_err(|_| ());
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
        (decided, no)
    }
}

/// What delivery reads of one segment: the router shows it, so delivery never holds the segment.
pub(super) struct Source<'a> {
    pub key: SegmentKey,
    pub names: &'a Arc<Names>,
    /// Its commit point's next emit number, and what the exporter acknowledged of its spans.
    pub next_emit: u64,
    pub acked: &'a Arc<AtomicU64>,
    /// With a spool: the spool position its instances queued now follow, and the number of the
    /// state they must be written after while none of the segment's is durable.
    pub spool_mark: Option<Position>,
    pub state_not_on_disk: Option<u64>,
    /// See `Attached::read_again_until`.
    pub read_again_until: u64,
}

/// Sends the root spans of collectives whose skew window closed before every local rank came
/// ([`Stats::take_roots_due`]); their ranks' records wait until the export ends. A root the
/// export queue refuses is counted there (`export_queue_full`), waited on no longer and re-sent
/// like a dropped span.
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
            let item = e.into_inner();
            if let Some(w) = item.settles {
                w.settle();
            }
            remember_dropped(out, item.coll.view());
        }
    }
}

/// An export the full queue refused, for the re-sender (with the root it carried, which its
/// spooled instance may lack).
fn remember_dropped(out: &Outputs, c: InstanceRef) {
    if let Some(d) = &out.dropped {
        let wanted = Wanted::of(c);
        d.remember(c.uid(), c.job_id(), wanted, &out.export_counters);
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
