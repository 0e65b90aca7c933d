//! What the engine reports: the daemon's health (plugin counters of every segment seen plus the
//! daemon's own), and the snapshots the API, Prometheus and the OTLP metrics export read.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ncclscope_proto::api::{
    Communicator, Health as ApiHealth, Job, ListJobsResponse, RankInfo, StatsResponse,
};
use ncclscope_proto::segment::Counter;
use ncclscope_proto::{realtime_ns, shift};

use crate::config::Config;
use crate::export::metrics::{self, Health};
use crate::export::prometheus;
use crate::loss::{Loss, Losses, PluginCounts};
use crate::stats::Stats;
use crate::storage::hub::Hub;

use super::deliver::Outputs;
use super::segments::Segments;

/// What the health is made of.
pub(super) struct Sources<'a> {
    pub segments: &'a Segments,
    pub stats: &'a Stats,
    pub out: &'a Outputs,
    pub daemon_lost: &'a Losses,
    pub collectives: u64,
    pub forced_commits: u64,
    pub parked_ops: u64,
    pub clock_steps: u64,
}

/// The daemon's health: plugin counters of every segment seen plus the daemon's own.
pub(super) fn health(s: &Sources<'_>) -> Health {
    let segs = s.segments;
    let mut asm = segs.reaped_asm;
    // Saturating: one uid's counters can raise its own figure to the maximum, never wrap it.
    let mut attached: HashMap<u32, PluginCounts> = HashMap::new();
    let mut max_cal = 0u32;
    for s in &segs.list {
        asm.add(&s.asm.counters);
        let sum = attached.entry(s.key.uid).or_insert([0; Counter::ALL.len()]);
        for (t, v) in sum.iter_mut().zip(s.plugin_lost) {
            *t = t.saturating_add(v);
        }
        max_cal = max_cal.max(s.asm.max_calibration_error_ns());
    }
    let by_uid = segs.plugin.by_uid(&attached);
    let node = segs.plugin.node(&by_uid, Instant::now());
    let mut lost = BTreeMap::new();
    let mut plugin_lost_by_uid = BTreeMap::new();
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
    let ec = &s.out.export_counters;
    for (stage, n) in asm.losses() {
        lost.insert(stage.into(), n);
    }
    // The daemon's stages, with those counted elsewhere (the exporter, the statistics) or derived.
    let mut daemon = s.daemon_lost.clone();
    daemon.add(
        Loss::ExportDropped,
        ec.spans_dropped.load(Ordering::Relaxed),
    );
    daemon.add(Loss::ExportNotResent, ec.not_resent.load(Ordering::Relaxed));
    let unjoined = (asm.dev_work)
        .saturating_sub(asm.dev_joined)
        .saturating_sub(asm.dev_unattributed)
        .saturating_sub(asm.dev_ambiguous)
        .saturating_sub(asm.dev_p2p);
    daemon.add(Loss::DevUnjoined, unjoined);
    daemon.add(Loss::RankSeriesLimit, s.stats.rank_series_refused);
    daemon.add(Loss::ReplayRootNotResent, s.stats.replay_roots_not_resent);
    // Every stage, exported from the start (not only once one happened); each uid's refusals
    // within its bound.
    let refused = segs.refusals.node(Instant::now());
    for ((stage, n), (_, r)) in daemon.iter().zip(refused.iter()) {
        lost.insert(stage.into(), n.saturating_add(r));
    }
    Health {
        segments: segs.list.len() as u64,
        records_in: asm.records,
        decode_errors: asm.decode_errors,
        collectives: s.collectives,
        lost,
        spans_exported: ec.spans_exported.load(Ordering::Relaxed),
        export_resent: ec.resent.load(Ordering::Relaxed),
        export_errors: ec.export_errors.load(Ordering::Relaxed),
        max_calibration_error_ns: max_cal,
        dev_work: asm.dev_work.saturating_sub(asm.dev_p2p),
        dev_joined: asm.dev_joined,
        forced_commits: s.forced_commits,
        parked_ops: s.parked_ops,
        clock_steps: s.clock_steps,
        skew_clock_step: s.stats.skew_clock_step,
        plugin_lost_by_uid,
        refused_by_uid: segs.refusals.by_uid(),
    }
}

/// When the snapshots and the OTLP metrics were last taken.
pub(super) struct Report {
    pub last_snapshot: Instant,
    last_metrics_export: Instant,
    /// The node's CLOCK_REALTIME (as its ranks see it) when the engine started: the metrics' start.
    started_ns: u64,
}

impl Report {
    pub fn new(now: Instant, started_ns: u64) -> Report {
        Report {
            last_snapshot: now,
            last_metrics_export: now,
            started_ns,
        }
    }

    /// A snapshot is taken now: the metrics' start if the OTLP metrics are due too (every
    /// `otlp.metrics_interval_ms`, or with `final_export`), taken as sent.
    pub fn taken(&mut self, cfg: &Config, out: &Outputs, final_export: bool) -> Option<u64> {
        self.last_snapshot = Instant::now();
        out.metrics.as_ref()?;
        let due = self.last_metrics_export.elapsed()
            >= Duration::from_millis(cfg.otlp.metrics_interval_ms);
        if !(due || final_export) {
            return None;
        }
        self.last_metrics_export = Instant::now();
        Some(self.started_ns)
    }
}

/// Refreshes the hub's stats/jobs snapshots and the metrics: Prometheus text, and OTLP from
/// `metrics_from` (the engine's start) if they are due (see [`Report::taken`]).
pub(super) fn snapshot(s: &Sources<'_>, hub: &Hub, cfg: &Config, metrics_from: Option<u64>) {
    let health = health(s);
    let mut lost_by_rank = HashMap::new();
    let mut jobs: HashMap<(u32, String), Job> = HashMap::new();
    for s in &s.segments.list {
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
    for ((uid, job_id), (n, first, last)) in s.stats.jobs() {
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
    hub.set_jobs(ListJobsResponse { jobs });
    hub.set_stats(StatsResponse {
        colls: s.stats.coll_stats(),
        ranks: s.stats.rank_stats(&lost_by_rank),
        p2p: s.stats.p2p_stats(),
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
        s.stats,
        &health,
        &s.out.host_name,
    )));
    let _ = s.out.prometheus.send(snapshot.clone());
    if let (Some(tx), Some(from)) = (&s.out.metrics, metrics_from) {
        let now_ns = shift(realtime_ns(), cfg.test_clock_offset_ns);
        let _ = tx.try_send(metrics::to_otlp(&snapshot.families, from, now_ns));
    }
}
