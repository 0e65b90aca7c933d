//! The daemon's metrics, built once per snapshot into one neutral model and rendered three ways:
//! Prometheus text and Prometheus protobuf (served on localhost; the protobuf one carries native
//! histograms) and OTLP metrics (histograms as ExponentialHistogram). Never sampled; label sets are
//! bounded by the series cap ([`crate::stats`]) and the ranks attached to this node.
//!
//! Per-job families (labelled with the job's uid) go to the OTLP collector; Prometheus, which any
//! local user can scrape, serves only the daemon's own health unless `prometheus.job_series` says
//! every local user may see every job.

use std::collections::BTreeMap;
use std::fmt::Write;

use ncclscope_proto::prometheus as prom;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1 as otlp_metrics;
use opentelemetry_proto::tonic::metrics::v1::{
    AggregationTemporality, ExponentialHistogram, ExponentialHistogramDataPoint, Gauge, Metric,
    NumberDataPoint, Sum, exponential_histogram_data_point, metric, number_data_point,
};
use prost::Message;

use crate::bandwidth;
use crate::config::Prometheus;
use crate::histogram::{self, Distribution, Exemplar};
use crate::stats::Stats;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

#[derive(Clone, Debug)]
pub enum Value {
    Number(f64),
    Histogram(Distribution),
}

/// A metric family as declared once: the served families take their name, unit, help and kind from
/// here, and so does the metrics reference (docs/metrics.md, `ncclscope reference metrics`), which a
/// test keeps equal to this table.
#[derive(Debug)]
pub struct Def {
    pub name: &'static str,
    /// UCUM, as OpenTelemetry metrics carry units (`us`, `GBy/s`, `{collective}` for a count).
    pub unit: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    /// Every label its points may carry (each one's meaning in [`LABELS`]).
    pub labels: &'static [&'static str],
    /// Its points describe users' jobs (labelled job_id and uid), not the daemon.
    pub per_job: bool,
    /// One point per (job, communicator, rank): the node's largest label sets (see
    /// [`Exposition::rank_buckets`]).
    pub per_rank: bool,
}

/// The labels of a statistics series: NCCL Inspector's, with the job's uid and communicator.
const SERIES_LABELS: &[&str] = &[
    "uid",
    "job_id",
    "comm",
    "collective",
    "size_bucket",
    "n_nodes",
    "nranks",
    "comm_name",
    "algo_proto",
    "message_size",
];
const RANK_LABELS: &[&str] = &[
    "uid",
    "job_id",
    "comm",
    "rank",
    "gpu",
    "UUID",
    "namespace",
    "pod",
];

const fn job(
    name: &'static str,
    unit: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
) -> Def {
    Def {
        name,
        unit,
        help,
        kind,
        labels,
        per_job: true,
        per_rank: false,
    }
}

const fn health(
    name: &'static str,
    unit: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
) -> Def {
    Def {
        name,
        unit,
        help,
        kind,
        labels,
        per_job: false,
        per_rank: false,
    }
}

pub const EXEC_TIME: Def = job(
    "ncclscope_collective_exec_time_microseconds",
    "us",
    Kind::Histogram,
    SERIES_LABELS,
    "Execution time per collective instance (max over channels of the kernel work time)",
);
pub const BUS_BANDWIDTH: Def = job(
    "ncclscope_collective_bus_bandwidth_gbs",
    "GBy/s",
    Kind::Histogram,
    SERIES_LABELS,
    "Bus bandwidth per collective instance as NCCL Inspector defines it, GB/s",
);
// Skew and last-to-start compare the ranks of one node only: in a communicator over several
// nodes every node has its own latest rank, and a node whose ranks are all late has none.
pub const RANK_SKEW: Def = Def {
    per_rank: true,
    ..job(
        "ncclscope_rank_skew_microseconds",
        "us",
        Kind::Histogram,
        RANK_LABELS,
        "Node-local: how much later this rank's kernels started than the earliest of this node's \
         ranks of the same collective (not the job's: across nodes see \
         ncclscope:rank_lateness_microseconds:1m)",
    )
};
pub const RANK_STRAGGLER: Def = job(
    "ncclscope_rank_straggler_total",
    "{collective}",
    Kind::Counter,
    &[
        "uid",
        "job_id",
        "comm",
        "rank",
        "gpu",
        "UUID",
        "namespace",
        "pod",
        "when",
    ],
    "Node-local: collectives in which this rank was the last of this node's ranks to start \
     (when=start) or to end (when=end); every node of a multi-node communicator has one, so \
     it is not the job's straggler (see ncclscope:rank_lateness_microseconds:1m)",
);
pub const RANK_COLLECTIVES: Def = job(
    "ncclscope_rank_collectives_total",
    "{collective}",
    Kind::Counter,
    RANK_LABELS,
    "Collective instances per rank",
);
pub const RANK_EXEC_TIME: Def = job(
    "ncclscope_rank_exec_time_microseconds_total",
    "us",
    Kind::Counter,
    RANK_LABELS,
    "Sum of the exec times of the rank's GPU-timed instances (ncclscope_rank_timed_collectives_total): \
     over that count, the rank's mean exec time, comparable across nodes (a duration on the \
     rank's own GPU); a late rank waits least, so has the shortest of its communicator",
);
pub const RANK_TIMED: Def = job(
    "ncclscope_rank_timed_collectives_total",
    "{collective}",
    Kind::Counter,
    RANK_LABELS,
    "The rank's instances timed on its GPU, those whose exec times \
     ncclscope_rank_exec_time_microseconds_total sums (host-timed ones have none)",
);
pub const BUILD_INFO: Def = health(
    "ncclscope_build_info",
    "",
    Kind::Gauge,
    &["version", "host_name"],
    "The daemon's version and its node's host.name, always 1: joins a scrape's instance to the \
     node",
);
pub const SEGMENTS: Def = health(
    "ncclscope_segments",
    "{segment}",
    Kind::Gauge,
    &[],
    "Segments (NCCL processes) attached",
);
pub const RECORDS: Def = health(
    "ncclscope_records_total",
    "{record}",
    Kind::Counter,
    &[],
    "Records read from segments",
);
pub const DECODE_ERRORS: Def = health(
    "ncclscope_decode_errors_total",
    "{record}",
    Kind::Counter,
    &[],
    "Records that did not decode",
);
pub const COLLECTIVES: Def = health(
    "ncclscope_collectives_total",
    "{collective}",
    Kind::Counter,
    &[],
    "Collective and p2p instances completed",
);
pub const LOST: Def = health(
    "ncclscope_lost_total",
    "{event}",
    Kind::Counter,
    &["stage"],
    "Events lost (or declined) per stage: the daemon's own, and plugin counters and refused \
     registrations (each uid's taken in only up to a rate; ncclscope_plugin_lost_total and \
     ncclscope_refused_total have them exact)",
);
pub const PLUGIN_LOST: Def = health(
    "ncclscope_plugin_lost_total",
    "{event}",
    Kind::Counter,
    &["uid", "stage"],
    "Events the plugins of one uid's processes reported lost, per stage (every stage while the uid \
     has a segment attached, then non-zero ones)",
);
pub const REFUSED: Def = health(
    "ncclscope_refused_total",
    "{registration}",
    Kind::Counter,
    &["uid", "stage"],
    "Registrations (segments, connections) of one uid refused, per stage, exactly (the node-wide \
     ncclscope_lost_total takes each uid's in only up to a rate since its first)",
);
pub const SPANS_EXPORTED: Def = health(
    "ncclscope_spans_exported_total",
    "{span}",
    Kind::Counter,
    &[],
    "Spans accepted by the OTLP receiver",
);
pub const EXPORT_RESENT: Def = health(
    "ncclscope_export_resent_total",
    "{instance}",
    Kind::Counter,
    &[],
    "Instances whose spans were dropped (queue full, or given up) and queued again from the spool \
     once the OTLP receiver answered (ncclscope_lost_total{stage=\"export_not_resent\"}: those that \
     could not be)",
);
pub const FORCED_COMMITS: Def = health(
    "ncclscope_forced_commits_total",
    "{commit}",
    Kind::Counter,
    &[],
    "Segment tails committed past open operations or unacknowledged spans because the ring was \
     over half full: nothing is lost, but a daemon restarted then would not read those again",
);
pub const PARKED_OPERATIONS: Def = health(
    "ncclscope_parked_operations_total",
    "{operation}",
    Kind::Counter,
    &[],
    "Operations in flight the segment tail was committed past with their state saved for a \
     restart (after a record lost in their segment, or while they stayed open), so that an \
     operation that can no longer complete holds no ring space",
);
pub const CLOCK_STEPS: Def = health(
    "ncclscope_clock_steps_total",
    "{step}",
    Kind::Counter,
    &[],
    "Steps of the host clock (CLOCK_REALTIME against CLOCK_BOOTTIME, over 50 ms)",
);
pub const SKEW_CLOCK_STEP: Def = health(
    "ncclscope_skew_clock_step_total",
    "{collective}",
    Kind::Counter,
    &[],
    "Collectives left out of the skew and straggler counts because a rank started them near a \
     host clock step",
);
pub const EXPORT_ERRORS: Def = health(
    "ncclscope_export_errors_total",
    "{error}",
    Kind::Counter,
    &[],
    "Failed OTLP export attempts",
);
pub const CALIBRATION_ERROR: Def = health(
    "ncclscope_calibration_error_max_nanoseconds",
    "ns",
    Kind::Gauge,
    &[],
    "Largest GPU-to-host clock calibration error bound among attached processes",
);
pub const DEVICE_HOOK_JOIN_RATIO: Def = health(
    "ncclscope_device_hook_join_ratio",
    "1",
    Kind::Gauge,
    &[],
    "Fraction of device-hook work items joined to their host operation, a collective or a send or receive (p2p items no operation waited for: lost_total{stage=\"dev_p2p\"})",
);

/// Every family [`families`] builds, in the order it builds them.
pub const FAMILIES: &[&Def] = &[
    &EXEC_TIME,
    &BUS_BANDWIDTH,
    &RANK_SKEW,
    &RANK_STRAGGLER,
    &RANK_COLLECTIVES,
    &RANK_EXEC_TIME,
    &RANK_TIMED,
    &BUILD_INFO,
    &SEGMENTS,
    &RECORDS,
    &DECODE_ERRORS,
    &COLLECTIVES,
    &LOST,
    &PLUGIN_LOST,
    &REFUSED,
    &SPANS_EXPORTED,
    &EXPORT_RESENT,
    &FORCED_COMMITS,
    &PARKED_OPERATIONS,
    &CLOCK_STEPS,
    &SKEW_CLOCK_STEP,
    &EXPORT_ERRORS,
    &CALIBRATION_ERROR,
    &DEVICE_HOOK_JOIN_RATIO,
];

/// What each label means, for the reference; every label of [`FAMILIES`] is here.
pub const LABELS: &[(&str, &str)] = &[
    (
        "uid",
        "the uid of the processes that ran the job (a job is (uid, job_id))",
    ),
    (
        "job_id",
        "the job id the plugin wrote: `NCCLSCOPE_JOB_ID`, else `SLURM_JOB_ID`, `TORCHELASTIC_RUN_ID`, `NCCLSCOPE_K8S_JOB_NAME`, else `unknown`",
    ),
    ("comm", "the communicator's hash, 16 hex digits"),
    (
        "collective",
        "NCCL's collective (`AllReduce`, `AllGather`, ...; `Send`/`Recv` for p2p)",
    ),
    (
        "size_bucket",
        "the power-of-two bucket of NCCL Inspector's algBW bytes (rank count times larger for AllGather and ReduceScatter); `other` past `aggregate.max_series`",
    ),
    ("n_nodes", "the communicator's node count (NCCL's)"),
    ("nranks", "the communicator's rank count"),
    (
        "comm_name",
        "NCCL's name for the communicator, empty without one",
    ),
    (
        "algo_proto",
        "NCCL's algorithm and protocol, `RING_LL`; `unknown` for a missing part",
    ),
    (
        "message_size",
        "NCCL Inspector's message-size range (count x datatype size, in whole units of the largest binary unit below it: `8-9MB`, `1-2KB`)",
    ),
    ("rank", "the rank in the communicator"),
    (
        "gpu",
        "the rank's CUDA device ordinal in its process (DCGM exporter's name; its NVML index only where the process sees every GPU in PCI order); absent where the driver was not asked",
    ),
    (
        "UUID",
        "the rank's GPU UUID (`GPU-...`, DCGM exporter's name and the join key with its metrics); absent where the driver was not asked",
    ),
    (
        "namespace",
        "the rank's Kubernetes namespace (`NCCLSCOPE_K8S_NAMESPACE` in its pod, from the downward API; deploy/k8s/pod-snippet.yaml); absent elsewhere",
    ),
    (
        "pod",
        "the rank's Kubernetes pod (`NCCLSCOPE_K8S_POD_NAME`, likewise): with `namespace`, joins kube-state-metrics' and DCGM exporter's pod labels; absent elsewhere",
    ),
    (
        "when",
        "`start`: last of the node's ranks to start; `end`: last to end",
    ),
    ("version", "the daemon's version"),
    (
        "host_name",
        "the node's `host.name`, the OTLP resource's (`otlp.resource_attributes` may set it)",
    ),
    (
        "stage",
        "where events were lost or declined: a plugin counter (`ring_full`, `queue_full`, `dev_lost`, ...) or the daemon's own (`incomplete`, `export_dropped`, `spool_failed`, ...)",
    ),
];

#[derive(Clone, Debug)]
pub struct Family {
    pub name: &'static str,
    pub unit: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub per_job: bool,
    pub per_rank: bool,
    pub points: Vec<(Vec<(&'static str, String)>, Value)>,
}

impl Family {
    fn of(def: &'static Def) -> Family {
        Family {
            name: def.name,
            unit: def.unit,
            help: def.help,
            kind: def.kind,
            per_job: def.per_job,
            per_rank: def.per_rank,
            points: Vec::new(),
        }
    }

    fn push(&mut self, labels: Vec<(&'static str, String)>, v: f64) {
        self.points.push((labels, Value::Number(v)));
    }
}

/// The daemon's own health: what came in and what was lost where.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Health {
    pub segments: u64,
    pub records_in: u64,
    pub decode_errors: u64,
    pub collectives: u64,
    /// Per stage: every plugin counter (ring_full, queue_full, dev_lost, ...) and the daemon's own.
    pub lost: BTreeMap<String, u64>,
    pub spans_exported: u64,
    /// Instances whose dropped spans were queued again from the spool.
    pub export_resent: u64,
    pub export_errors: u64,
    pub max_calibration_error_ns: u32,
    /// Device-hook work items read (less the p2p items no operation waited for, `dev_p2p`), and
    /// joined.
    pub dev_work: u64,
    pub dev_joined: u64,
    /// Commits past open operations or unacknowledged spans because a ring was over half full.
    pub forced_commits: u64,
    /// Operations in flight parked: the tail moved past their first record, the resume state
    /// carrying them (after a gap in a segment's records, or open longer than the engine's
    /// `PARK_AFTER`).
    pub parked_ops: u64,
    /// Host clock steps the daemon saw, and collectives left out of the skew near them.
    pub clock_steps: u64,
    pub skew_clock_step: u64,
    /// Plugin counters per (uid, stage): whose processes reported the loss (every stage of a uid
    /// with a segment attached, a detached uid's non-zero ones).
    pub plugin_lost_by_uid: BTreeMap<(u32, &'static str), u64>,
    /// Registrations refused per (uid, stage), exact (non-zero ones of the uids kept: see
    /// [`crate::loss::Refusals`]).
    pub refused_by_uid: BTreeMap<(u32, &'static str), u64>,
}

fn comm_label(hash: u64) -> String {
    format!("{hash:016x}")
}

/// NCCL Inspector's `algo_proto` label: `RING_LL`, `unknown` for a part the record lacks.
fn algo_proto(algo: &str, proto: &str) -> String {
    let known = |s: &str| if s.is_empty() { "unknown" } else { s }.to_string();
    format!("{}_{}", known(algo), known(proto))
}

/// Builds every metric family from the statistics and the health counters; `host_name` is the
/// node's `host.name` (the OTLP resource's), on `ncclscope_build_info`.
pub fn families(stats: &Stats, health: &Health, host_name: &str) -> Vec<Family> {
    let mut exec = Family::of(&EXEC_TIME);
    let mut busbw = Family::of(&BUS_BANDWIDTH);
    let mut keys: Vec<_> = stats.series.iter().collect();
    keys.sort_by(|a, b| a.0.cmp(b.0));
    for (k, s) in keys {
        let labels = vec![
            ("uid", k.uid.to_string()),
            ("job_id", k.job.to_string()),
            ("comm", comm_label(k.comm_hash)),
            ("collective", k.func.to_string()),
            ("size_bucket", k.size_bucket.to_string()),
            ("n_nodes", s.nnodes.to_string()),
            ("nranks", s.nranks.to_string()),
            ("comm_name", s.comm_name.to_string()),
            ("algo_proto", algo_proto(&k.algo, &k.proto)),
            (
                "message_size",
                bandwidth::message_size_label(k.message_size),
            ),
        ];
        exec.points
            .push((labels.clone(), Value::Histogram(s.exec_us.clone())));
        busbw
            .points
            .push((labels, Value::Histogram(s.busbw_gbs.clone())));
    }
    // Skew and last-to-start compare the ranks of one node only: in a communicator over several
    // nodes every node has its own latest rank, and a node whose ranks are all late has none.
    let mut skew = Family::of(&RANK_SKEW);
    let mut straggler = Family::of(&RANK_STRAGGLER);
    let mut per_rank = Family::of(&RANK_COLLECTIVES);
    let mut rank_exec = Family::of(&RANK_EXEC_TIME);
    let mut rank_timed = Family::of(&RANK_TIMED);
    let mut ranks: Vec<_> = stats.ranks.iter().collect();
    ranks.sort_by(|a, b| a.0.cmp(b.0));
    for (k, r) in ranks {
        let mut labels = vec![
            ("uid", k.uid.to_string()),
            ("job_id", k.job.to_string()),
            ("comm", comm_label(k.comm_hash)),
            ("rank", k.rank.to_string()),
        ];
        // DCGM exporter's names for the GPU (its `gpu` is the NVML index, ours the CUDA ordinal:
        // equal only where the process sees every GPU in PCI order; `UUID` always joins).
        if let Some(g) = r.gpu {
            labels.push(("gpu", g.ordinal.to_string()));
            labels.push(("UUID", g.uuid_text()));
        }
        // kube-state-metrics' and DCGM exporter's names for the rank's pod.
        if !r.pod.namespace.is_empty() {
            labels.push(("namespace", r.pod.namespace.clone()));
        }
        if !r.pod.name.is_empty() {
            labels.push(("pod", r.pod.name.clone()));
        }
        skew.points
            .push((labels.clone(), Value::Histogram(r.skew_us.clone())));
        let with = |when: &str| {
            let mut l = labels.clone();
            l.push(("when", when.to_string()));
            l
        };
        straggler.push(with("start"), r.last_to_start as f64);
        straggler.push(with("end"), r.last_to_end as f64);
        rank_exec.push(labels.clone(), r.exec_us_sum);
        rank_timed.push(labels.clone(), r.timed as f64);
        per_rank.push(labels, r.collectives as f64);
    }
    let mut out = vec![
        exec, busbw, skew, straggler, per_rank, rank_exec, rank_timed,
    ];
    let mut build = Family::of(&BUILD_INFO);
    build.push(
        vec![
            ("version", env!("CARGO_PKG_VERSION").to_string()),
            ("host_name", host_name.to_string()),
        ],
        1.0,
    );
    out.push(build);
    let single = |def: &'static Def, v: f64| {
        let mut f = Family::of(def);
        f.push(Vec::new(), v);
        f
    };
    out.push(single(&SEGMENTS, health.segments as f64));
    out.push(single(&RECORDS, health.records_in as f64));
    out.push(single(&DECODE_ERRORS, health.decode_errors as f64));
    out.push(single(&COLLECTIVES, health.collectives as f64));
    let mut lost = Family::of(&LOST);
    for (stage, v) in &health.lost {
        lost.push(vec![("stage", stage.clone())], *v as f64);
    }
    out.push(lost);
    let mut by_uid = Family::of(&PLUGIN_LOST);
    for (&(uid, stage), v) in &health.plugin_lost_by_uid {
        by_uid.push(
            vec![("uid", uid.to_string()), ("stage", stage.to_string())],
            *v as f64,
        );
    }
    out.push(by_uid);
    let mut refused = Family::of(&REFUSED);
    for (&(uid, stage), v) in &health.refused_by_uid {
        refused.push(
            vec![("uid", uid.to_string()), ("stage", stage.to_string())],
            *v as f64,
        );
    }
    out.push(refused);
    out.push(single(&SPANS_EXPORTED, health.spans_exported as f64));
    out.push(single(&EXPORT_RESENT, health.export_resent as f64));
    out.push(single(&FORCED_COMMITS, health.forced_commits as f64));
    out.push(single(&PARKED_OPERATIONS, health.parked_ops as f64));
    out.push(single(&CLOCK_STEPS, health.clock_steps as f64));
    out.push(single(&SKEW_CLOCK_STEP, health.skew_clock_step as f64));
    out.push(single(&EXPORT_ERRORS, health.export_errors as f64));
    out.push(single(
        &CALIBRATION_ERROR,
        health.max_calibration_error_ns as f64,
    ));
    let join_rate = if health.dev_work == 0 {
        1.0
    } else {
        health.dev_joined as f64 / health.dev_work as f64
    };
    out.push(single(&DEVICE_HOOK_JOIN_RATIO, join_rate));
    out
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn label_text(labels: &[(&'static str, String)], extra: Option<(&str, String)>) -> String {
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    if let Some((k, v)) = extra {
        parts.push(format!("{k}=\"{v}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

/// What `/metrics` serves (`[prometheus]` in the configuration): which families, and how many
/// classic buckets. Classic buckets cost a sample each per series and scrape (issue 35: 96% of a
/// scrape); the native histograms of the protobuf format keep the full resolution in one sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exposition {
    /// Per-job families too (`prometheus.job_series`).
    pub job_series: bool,
    /// Classic bucket bounds per doubling served for the per-series histograms (exec time, bus
    /// bandwidth): 1, 2, 4 or [`histogram::CLASSIC_PER_DOUBLING`] (all the daemon keeps).
    pub classic_per_doubling: u32,
    /// Classic buckets of the per-rank histograms (skew) too; without, they serve only `+Inf`,
    /// `_sum` and `_count` (the mean) in text, and their native histogram in protobuf.
    pub rank_buckets: bool,
}

impl Exposition {
    /// Every family at the full classic resolution.
    pub const FULL: Exposition = Exposition {
        job_series: true,
        classic_per_doubling: histogram::CLASSIC_PER_DOUBLING as u32,
        rank_buckets: true,
    };

    /// What `[prometheus]` asks for.
    pub fn of(p: &Prometheus) -> Exposition {
        Exposition {
            job_series: p.job_series,
            classic_per_doubling: p.classic_buckets_per_doubling,
            rank_buckets: p.rank_classic_buckets,
        }
    }

    /// Every how many of the daemon's classic buckets of `f` one is served (`None`: +Inf only).
    fn classic_step(&self, f: &Family) -> Option<usize> {
        if f.per_rank && !self.rank_buckets {
            return None;
        }
        let per = self
            .classic_per_doubling
            .clamp(1, histogram::CLASSIC_PER_DOUBLING as u32);
        Some((histogram::CLASSIC_PER_DOUBLING as u32 / per) as usize)
    }

    fn shows(&self, f: &Family) -> bool {
        self.job_series || !f.per_job
    }
}

/// One served classic bucket: its upper bound (`None`: +Inf), cumulative count, and the latest
/// exemplar of the daemon's buckets merged into it.
struct Served<'a> {
    bound: Option<f64>,
    cumulative: u64,
    exemplar: Option<&'a Exemplar>,
}

/// The classic buckets of `d` served: every `step`-th bound (the bounds are 2^(k/8) from a power
/// of two, so a step of 8 keeps the powers of two; `None`: none), then +Inf. Cumulative counts
/// make the coarser buckets exact.
fn served(d: &Distribution, step: Option<usize>) -> Vec<Served<'_>> {
    let (b, mut cum) = (&d.classic, 0);
    let mut exemplar: Option<&Exemplar> = None;
    let mut out = Vec::new();
    for (i, c) in b.counts().iter().enumerate() {
        cum += c;
        if let Some(e) = d.exemplar(i)
            && exemplar.is_none_or(|x| e.unix_ns >= x.unix_ns)
        {
            exemplar = Some(e);
        }
        let bound = b.bound(i);
        if bound.is_none() || step.is_some_and(|s| i % s == 0) {
            out.push(Served {
                bound,
                cumulative: cum,
                exemplar: exemplar.take(),
            });
        }
    }
    out
}

/// Prometheus text exposition format 0.0.4.
pub fn render_prometheus(families: &[Family], how: &Exposition) -> String {
    render_text(families, how, false)
}

/// OpenMetrics text 1.0.0: the Prometheus text with each classic bucket's exemplar (the trace of
/// its latest sampled instance), counters' families named without `_total`, and `# EOF`.
pub fn render_openmetrics(families: &[Family], how: &Exposition) -> String {
    render_text(families, how, true)
}

fn render_text(families: &[Family], how: &Exposition, openmetrics: bool) -> String {
    let mut out = String::new();
    for f in families.iter().filter(|f| how.shows(f)) {
        let kind = match f.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        let family = match f.kind {
            Kind::Counter if openmetrics => f.name.strip_suffix("_total").unwrap_or(f.name),
            _ => f.name,
        };
        let _ = writeln!(out, "# HELP {family} {}\n# TYPE {family} {kind}", f.help);
        for (labels, v) in &f.points {
            match v {
                Value::Number(n) => {
                    let _ = writeln!(out, "{}{} {}", f.name, label_text(labels, None), n);
                }
                Value::Histogram(d) => {
                    for b in served(d, how.classic_step(f)) {
                        let le = b.bound.map_or("+Inf".to_string(), |x| x.to_string());
                        let _ = write!(
                            out,
                            "{}_bucket{} {}",
                            f.name,
                            label_text(labels, Some(("le", le))),
                            b.cumulative
                        );
                        if let Some(e) = b.exemplar.filter(|_| openmetrics) {
                            let _ = write!(
                                out,
                                " # {{trace_id=\"{}\",span_id=\"{}\"}} {} {}.{:09}",
                                hex(&e.span.trace_id()),
                                hex(&e.span.span_id()),
                                e.value,
                                e.unix_ns / 1_000_000_000,
                                e.unix_ns % 1_000_000_000
                            );
                        }
                        out.push('\n');
                    }
                    let _ = writeln!(
                        out,
                        "{}_sum{} {}",
                        f.name,
                        label_text(labels, None),
                        d.sum()
                    );
                    let _ = writeln!(
                        out,
                        "{}_count{} {}",
                        f.name,
                        label_text(labels, None),
                        d.count()
                    );
                }
            }
        }
    }
    if openmetrics {
        out.push_str("# EOF\n");
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Prometheus protobuf exposition (length-delimited `MetricFamily` messages), the format that
/// carries native histograms: each histogram has its classic buckets and its exponential ones as a
/// native histogram (schema = the OTLP scale; Prometheus numbers a bucket by its upper bound, one
/// above OTLP's index); its classic buckets as `how` serves them in text.
pub fn render_protobuf(families: &[Family], how: &Exposition) -> Vec<u8> {
    let mut out = Vec::new();
    for f in families.iter().filter(|f| how.shows(f)) {
        let kind = match f.kind {
            Kind::Counter => prom::MetricType::Counter,
            Kind::Gauge => prom::MetricType::Gauge,
            Kind::Histogram => prom::MetricType::Histogram,
        };
        let metric = f
            .points
            .iter()
            .map(|(labels, v)| {
                let label = labels
                    .iter()
                    .map(|(k, v)| prom::LabelPair {
                        name: Some(k.to_string()),
                        value: Some(v.clone()),
                    })
                    .collect();
                let mut m = prom::Metric {
                    label,
                    ..Default::default()
                };
                match (v, f.kind) {
                    (Value::Number(n), Kind::Counter) => {
                        m.counter = Some(prom::Counter { value: Some(*n) })
                    }
                    (Value::Number(n), _) => m.gauge = Some(prom::Gauge { value: Some(*n) }),
                    (Value::Histogram(d), _) => m.histogram = Some(native(d, how.classic_step(f))),
                }
                m
            })
            .collect();
        let family = prom::MetricFamily {
            name: Some(f.name.to_string()),
            help: Some(f.help.to_string()),
            r#type: Some(kind as i32),
            metric,
        };
        family
            .encode_length_delimited(&mut out)
            .expect("a Vec grows as needed");
    }
    out
}

fn native(d: &Distribution, classic_step: Option<usize>) -> prom::Histogram {
    let e = &d.exponential;
    let bucket = (served(d, classic_step).into_iter())
        .filter_map(|b| {
            Some(prom::Bucket {
                cumulative_count: Some(b.cumulative),
                upper_bound: Some(b.bound?),
            })
        })
        .collect();
    let mut last = 0i64;
    let positive_delta = e
        .bucket_counts()
        .map(|c| {
            let delta = c as i64 - last;
            last = c as i64;
            delta
        })
        .collect::<Vec<_>>();
    prom::Histogram {
        sample_count: Some(e.count()),
        sample_sum: Some(e.sum()),
        bucket,
        schema: Some(e.scale()),
        // The zero bucket holds only zero itself (values are never negative).
        zero_threshold: Some(0.0),
        zero_count: Some(e.zero_count()),
        // Without buckets still a span (empty, offset 0), or the histogram would read as classic.
        positive_span: vec![prom::BucketSpan {
            offset: Some(if positive_delta.is_empty() {
                0
            } else {
                e.offset() + 1
            }),
            length: Some(positive_delta.len() as u32),
        }],
        positive_delta,
    }
}

fn attributes(labels: &[(&'static str, String)]) -> Vec<KeyValue> {
    labels
        .iter()
        .map(|(k, v)| KeyValue {
            key: k.to_string(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(v.clone())),
            }),
            ..Default::default()
        })
        .collect()
}

/// The family's name as OpenTelemetry names metrics: `ncclscope.` namespace, no unit (it is in
/// `unit`) and no `_total`. A collector writing them to Prometheus adds the unit's suffix and
/// `_total` back, which gives the names served on `/metrics`, except for the bus bandwidth, whose
/// `GBy/s` it spells `gigabytes_per_second`.
pub fn otel_name(name: &str, kind: Kind, unit: &str) -> String {
    let mut name = name;
    if kind == Kind::Counter {
        name = name.strip_suffix("_total").unwrap_or(name);
    }
    let suffix = match unit {
        "us" => "_microseconds",
        "ns" => "_nanoseconds",
        "GBy/s" => "_gbs",
        "1" => "_ratio",
        _ => "",
    };
    name = name.strip_suffix(suffix).unwrap_or(name);
    match name.strip_prefix("ncclscope_") {
        Some(rest) => format!("ncclscope.{rest}"),
        None => name.to_string(),
    }
}

fn otlp_exemplar(e: &Exemplar) -> otlp_metrics::Exemplar {
    otlp_metrics::Exemplar {
        time_unix_nano: e.unix_ns,
        trace_id: e.span.trace_id().to_vec(),
        span_id: e.span.span_id().to_vec(),
        value: Some(otlp_metrics::exemplar::Value::AsDouble(e.value)),
        ..Default::default()
    }
}

/// OTLP metrics, cumulative since `start_ns`.
pub fn to_otlp(families: &[Family], start_ns: u64, now_ns: u64) -> Vec<Metric> {
    let cumulative = AggregationTemporality::Cumulative as i32;
    families
        .iter()
        .filter(|f| !f.points.is_empty())
        .map(|f| {
            let numbers = || {
                f.points
                    .iter()
                    .filter_map(|(l, v)| match v {
                        Value::Number(n) => Some(NumberDataPoint {
                            attributes: attributes(l),
                            start_time_unix_nano: start_ns,
                            time_unix_nano: now_ns,
                            value: Some(number_data_point::Value::AsDouble(*n)),
                            ..Default::default()
                        }),
                        Value::Histogram(_) => None,
                    })
                    .collect()
            };
            let data = match f.kind {
                Kind::Counter => metric::Data::Sum(Sum {
                    data_points: numbers(),
                    aggregation_temporality: cumulative,
                    is_monotonic: true,
                }),
                Kind::Gauge => metric::Data::Gauge(Gauge {
                    data_points: numbers(),
                }),
                Kind::Histogram => metric::Data::ExponentialHistogram(ExponentialHistogram {
                    data_points: f
                        .points
                        .iter()
                        .filter_map(|(l, v)| match v {
                            Value::Histogram(d) => {
                                let e = &d.exponential;
                                let (min, max) = e.min_max().unzip();
                                Some(ExponentialHistogramDataPoint {
                                    attributes: attributes(l),
                                    start_time_unix_nano: start_ns,
                                    time_unix_nano: now_ns,
                                    count: e.count(),
                                    sum: Some(e.sum()),
                                    scale: e.scale(),
                                    zero_count: e.zero_count(),
                                    positive: Some(exponential_histogram_data_point::Buckets {
                                        offset: e.offset(),
                                        bucket_counts: e.bucket_counts().collect(),
                                    }),
                                    min,
                                    max,
                                    exemplars: d.exemplars().map(otlp_exemplar).collect(),
                                    ..Default::default()
                                })
                            }
                            Value::Number(_) => None,
                        })
                        .collect(),
                    aggregation_temporality: cumulative,
                }),
            };
            Metric {
                name: otel_name(f.name, f.kind, f.unit),
                description: f.help.to_string(),
                unit: f.unit.to_string(),
                data: Some(data),
                ..Default::default()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::instance::Shared;
    use ncclscope_proto::api::LiveSpans;
    use ncclscope_tests::promql::{histogram_quantile, native_quantile, text_buckets};

    /// Rank 2 of 4's all-reduce `seq` of uid 7's job "j", kernel-timed at `exec_ns`.
    fn all_reduce(seq: u64, exec_ns: u64) -> ncclscope_proto::api::Collective {
        ncclscope_proto::api::Collective {
            uid: 7,
            job_id: "j".into(),
            comm_hash: 1,
            func: "AllReduce".into(),
            seq,
            rank: 2,
            nranks: 4,
            exec_ns,
            end_unix_ns: 1_700_000_000_000_000_000 + seq,
            timing_source: "kernel_gpu".into(),
            ..Default::default()
        }
    }

    /// A host-timed instance (an eager send on the device-hook path) is counted, but its host times
    /// bracket the enqueue, not the work: it enters no exec time, bandwidth or per-rank mean.
    #[test]
    fn host_timed_instances_are_counted_without_an_exec_time() {
        let mut stats = Stats::new(1_000_000_000, 1000, 10);
        for (seq, exec_ns, source) in [(1, 40_000, "device_hook"), (2, 0, "host"), (3, 0, "host")] {
            let c = Shared::from(&ncclscope_proto::api::Collective {
                timing_source: source.into(),
                ..all_reduce(seq, exec_ns)
            });
            stats.observe(c.view(), 0, 1, |_, _| LiveSpans::None);
        }
        let text = render_prometheus(
            &families(&stats, &Health::default(), "h"),
            &Exposition::FULL,
        );
        let value = |prefix: &str| -> f64 {
            let line = (text.lines())
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no {prefix} in {text}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        assert_eq!(value("ncclscope_rank_collectives_total{"), 3.0);
        assert_eq!(value("ncclscope_rank_timed_collectives_total{"), 1.0);
        assert_eq!(value("ncclscope_rank_exec_time_microseconds_total{"), 40.0);
        assert_eq!(
            value("ncclscope_collective_exec_time_microseconds_count{"),
            1.0
        );
    }

    /// OpenMetrics carries the latest sampled instance of a bucket as its exemplar (its trace and
    /// rank span); the classic text stays as it was.
    #[test]
    fn openmetrics_has_exemplars_on_the_buckets_of_sampled_instances() {
        let mut stats = Stats::new(1_000_000_000, 1000, 10);
        let coll = |seq: u64, exec_ns: u64| {
            Shared::from(&ncclscope_proto::api::Collective {
                end_unix_ns: 1_700_000_000_123_456_789 + seq,
                ..all_reduce(seq, exec_ns)
            })
        };
        // Bucket (2^(4/8), 2^(5/8)] us: seq 1 then seq 2 sampled (the latter kept), seq 3 not.
        for (seq, exec_ns, live) in [
            (1, 1_450, LiveSpans::Rank),
            (2, 1_500, LiveSpans::Channels),
            (3, 1_520, LiveSpans::None),
            (4, 3_000, LiveSpans::None),
        ] {
            stats.observe(coll(seq, exec_ns).view(), 0, 1, |_, _| live);
        }
        let f = families(&stats, &Health::default(), "h");
        let om = render_openmetrics(&f, &Exposition::FULL);
        let with: Vec<&str> = om.lines().filter(|l| l.contains(" # {")).collect();
        let key = crate::spans::collective_key("AllReduce", 2, 0);
        let want = format!(
            "le=\"1.5422108254079407\"}} 3 # {{trace_id=\"{}\",span_id=\"{}\"}} 1.5 1700000000.123456791",
            hex(&crate::spans::trace_id(7, 1, key)),
            hex(&crate::spans::rank_span_id(7, 1, key, 2)),
        );
        assert_eq!(with.len(), 1, "{om}");
        assert!(
            with[0].starts_with("ncclscope_collective_exec_time_microseconds_bucket{")
                && with[0].ends_with(&want),
            "{}\n{want}",
            with[0]
        );
        assert!(om.contains("# TYPE ncclscope_lost counter\n"), "{om}");
        assert!(om.ends_with("# EOF\n"));
        let text = render_prometheus(&f, &Exposition::FULL);
        assert!(!text.contains(" # {") && !text.contains("# EOF"), "{text}");
        let Some(metric::Data::ExponentialHistogram(h)) = &to_otlp(&f, 1, 2)[0].data else {
            panic!()
        };
        let e = &h.data_points[0].exemplars;
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].trace_id, crate::spans::trace_id(7, 1, key).to_vec());
        assert!(text.contains("# TYPE ncclscope_lost_total counter\n"));
    }

    #[test]
    fn prometheus_text_has_cumulative_buckets_and_escaped_labels() {
        let mut stats = Stats::new(1_000_000_000, 1000, 10);
        for exec in [1_500u64, 3_000, 3_000_000] {
            let c = Shared::from(&ncclscope_proto::api::Collective {
                uid: 1234,
                job_id: "j\"1".into(),
                comm_hash: 1,
                comm_name: "dp".into(),
                nranks: 8,
                func: "AllReduce".into(),
                datatype: "ncclFloat32".into(),
                count: 1024,
                algo: "RING".into(),
                proto: "LL".into(),
                bytes: 4096,
                exec_ns: exec,
                busbw_gbs: 1.0,
                nnodes: 1,
                timing_source: "kernel_gpu".into(),
                ..Default::default()
            });
            stats.observe(c.view(), 0, 1, |_, _| LiveSpans::None);
        }
        let health = Health {
            lost: BTreeMap::from([("ring_full".into(), 3)]),
            ..Default::default()
        };
        let text = render_prometheus(&families(&stats, &health, "h"), &Exposition::FULL);
        let l = "uid=\"1234\",job_id=\"j\\\"1\",comm=\"0000000000000001\",collective=\"AllReduce\",size_bucket=\"<=4KiB\",n_nodes=\"1\",nranks=\"8\",comm_name=\"dp\",algo_proto=\"RING_LL\",message_size=\"4-5KB\"";
        assert!(
            text.contains(&format!(
                "ncclscope_collective_exec_time_microseconds_bucket{{{l},le=\"2\"}} 1\n"
            )),
            "{text}"
        );
        assert!(text.contains(&format!(
            "ncclscope_collective_exec_time_microseconds_bucket{{{l},le=\"4\"}} 2\n"
        )));
        assert!(text.contains(&format!(
            "ncclscope_collective_exec_time_microseconds_bucket{{{l},le=\"+Inf\"}} 3\n"
        )));
        assert!(text.contains(&format!(
            "ncclscope_collective_exec_time_microseconds_count{{{l}}} 3\n"
        )));
        assert!(text.contains("ncclscope_lost_total{stage=\"ring_full\"} 3\n"));
        // By default Prometheus (any local user may scrape it) serves the daemon's health, no job.
        let public = render_prometheus(
            &families(&stats, &health, "h"),
            &Exposition {
                job_series: false,
                ..Exposition::FULL
            },
        );
        assert!(public.contains("ncclscope_lost_total{stage=\"ring_full\"} 3\n"));
        assert!(
            !public.contains("job_id") && !public.contains("uid="),
            "{public}"
        );
        assert!(public.contains(&format!(
            "ncclscope_build_info{{version=\"{}\",host_name=\"h\"}} 1\n",
            env!("CARGO_PKG_VERSION")
        )));
        let otlp = to_otlp(&families(&stats, &health, "h"), 1, 2);
        assert_eq!(
            (otlp[0].name.as_str(), otlp[0].unit.as_str()),
            ("ncclscope.collective_exec_time", "us")
        );
        let Some(metric::Data::ExponentialHistogram(h)) = &otlp[0].data else {
            panic!()
        };
        let p = &h.data_points[0];
        // 1.5 to 3000 us (2^11) does not fit 320 buckets of scale 5 (2^10): scale 4.
        assert_eq!(
            (p.count, p.scale, p.min, p.max),
            (3, 4, Some(1.5), Some(3000.0))
        );
        let positive = p.positive.as_ref().unwrap();
        assert_eq!(positive.bucket_counts.iter().sum::<u64>(), 3);
        // 1.5 us lies in (2^(9/16), 2^(10/16)]: bucket 9.
        assert_eq!((positive.offset, positive.bucket_counts[0]), (9, 1));
    }

    /// Issue 17: the 1-2-5 buckets read an all-reduce exec p99 as 9491 us where the exact value was
    /// 5180 us. The demo's shape (one rank of four has its kernel start last, so it waits for no one;
    /// the others wait 2.4 to 3.6 ms for it) through every way the daemon reports a percentile,
    /// against the exact values of the same inputs: `stats`/`top` within 1%, native and OTLP
    /// exponential histograms within their bucket (2.2%), classic buckets within 10%.
    #[test]
    fn every_reported_percentile_is_close_to_the_exact_one() {
        let mut stats = Stats::new(60_000_000_000, 1000, 10);
        let mut exact: BTreeMap<u64, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut uniform = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        for seq in 0..4000u64 {
            for bytes in [4u64 << 10, 32 << 20, 128 << 20] {
                let kernel_ns = 8_000.0 + bytes as f64 * 1.5 / 120.0;
                let wait_ns = if seq % 4 == 0 {
                    0.0
                } else {
                    2.4e6 + 1.2e6 * uniform()
                };
                let exec_ns = (kernel_ns + wait_ns + 40_000.0 * uniform()) as u64;
                let busbw_gbs = bytes as f64 * 1.5 / exec_ns as f64;
                let c = Shared::from(&ncclscope_proto::api::Collective {
                    comm_hash: 1,
                    func: "AllReduce".into(),
                    bytes,
                    exec_ns,
                    busbw_gbs,
                    timing_source: "kernel_gpu".into(),
                    ..Default::default()
                });
                stats.observe(c.view(), 0, 1, |_, _| LiveSpans::None);
                let e = exact.entry(bytes).or_default();
                e.0.push(exec_ns as f64 / 1000.0);
                e.1.push(busbw_gbs);
            }
        }
        let fams = families(&stats, &Health::default(), "h");
        let text = render_prometheus(&fams, &Exposition::FULL);
        let pb = render_protobuf(&fams, &Exposition::FULL);
        let mut pb: &[u8] = &pb;
        let mut natives = Vec::new();
        while !pb.is_empty() {
            natives.push(prom::MetricFamily::decode_length_delimited(&mut pb).unwrap());
        }
        let otlp = to_otlp(&fams, 1, 2);
        let colls = stats.coll_stats();
        let mut worst = [0f64; 4];
        for (bytes, (exec, busbw)) in &mut exact {
            let bucket = crate::bandwidth::size_bucket(*bytes);
            let with = format!("size_bucket=\"{bucket}\"");
            let s = colls.iter().find(|c| c.size_bucket == bucket).unwrap();
            for (family, values, stats_of) in [
                (
                    "ncclscope_collective_exec_time_microseconds",
                    &mut *exec,
                    [(0.5, s.exec_p50_us), (0.99, s.exec_p99_us)],
                ),
                (
                    "ncclscope_collective_bus_bandwidth_gbs",
                    &mut *busbw,
                    [(0.5, s.busbw_p50_gbs), (0.5, s.busbw_p50_gbs)],
                ),
            ] {
                values.sort_by(f64::total_cmp);
                let classic = text_buckets(&text, family, &[&with]);
                let native = natives.iter().find(|f| f.name() == family).unwrap();
                let native = native.metric.iter().find(|m| {
                    m.label
                        .iter()
                        .any(|l| l.name() == "size_bucket" && l.value() == bucket)
                });
                let h = native.unwrap().histogram.as_ref().unwrap();
                let mut last = 0i64;
                let native_counts: Vec<u64> = h
                    .positive_delta
                    .iter()
                    .map(|d| {
                        last += d;
                        last as u64
                    })
                    .collect();
                let f = fams.iter().find(|f| f.name == family).unwrap();
                let otel = otel_name(f.name, f.kind, f.unit);
                let otlp = otlp.iter().find(|m| m.name == otel).unwrap();
                let Some(metric::Data::ExponentialHistogram(e)) = &otlp.data else {
                    panic!("{family} is not exponential in OTLP")
                };
                let point = e.data_points.iter().find(|p| {
                    p.attributes.iter().any(|a| {
                        a.key == "size_bucket"
                            && a.value
                                == Some(AnyValue {
                                    value: Some(any_value::Value::StringValue(bucket.into())),
                                })
                    })
                });
                let point = point.unwrap();
                let positive = point.positive.as_ref().unwrap();
                for (q, from_stats) in stats_of {
                    let rank = ((q * values.len() as f64).ceil() as usize).max(1);
                    let want = values[rank - 1];
                    let got = [
                        from_stats,
                        native_quantile(q, h.schema(), h.positive_span[0].offset(), &native_counts),
                        native_quantile(
                            q,
                            point.scale,
                            positive.offset + 1,
                            &positive.bucket_counts,
                        ),
                        histogram_quantile(q, &classic),
                    ];
                    let bound = [0.01, 0.022, 0.022, 0.10];
                    for (k, g) in got.iter().enumerate() {
                        let err = (g - want).abs() / want;
                        worst[k] = worst[k].max(err);
                        assert!(
                            err < bound[k],
                            "{family} {bucket} q {q}: exact {want}, got {got:?} (stats, native, OTLP, classic)"
                        );
                    }
                }
            }
        }
        eprintln!("worst relative errors (stats, native, OTLP, classic): {worst:?}");
    }

    /// The default exposition (issue 35's cardinality budget): one classic bound per doubling,
    /// powers of two whose cumulative counts are exact, each with the latest exemplar of the
    /// buckets merged into it; the per-rank skew as +Inf, sum and count only. Protobuf carries the
    /// same classic buckets and the native histogram at full resolution. Per rank, the sum of exec
    /// times beside the count (its mean compares across nodes).
    #[test]
    fn the_default_serves_a_classic_bound_per_doubling_and_the_rank_exec_sum() {
        let mut stats = Stats::new(1_000_000_000, 1000, 10);
        for (seq, exec_ns, live) in [
            (1, 1_500, LiveSpans::Rank),
            (2, 1_900, LiveSpans::Rank),
            (3, 3_000, LiveSpans::None),
            (4, 900_000, LiveSpans::None),
        ] {
            let c = Shared::from(&all_reduce(seq, exec_ns));
            stats.observe(c.view(), 0, 1, |_, _| live);
        }
        let f = families(&stats, &Health::default(), "h");
        let how = Exposition {
            job_series: true,
            ..Exposition::of(&Config::default().prometheus)
        };
        let om = render_openmetrics(&f, &how);
        let exec = "ncclscope_collective_exec_time_microseconds_bucket{";
        let buckets: Vec<(&str, &str)> = (om.lines())
            .filter(|l| l.starts_with(exec))
            .map(|l| {
                let le = l.split("le=\"").nth(1).unwrap().split('"').next().unwrap();
                (le, l)
            })
            .collect();
        // 1 us to 2^24 us, then +Inf.
        assert_eq!(buckets.len(), 26, "{om}");
        for (i, (le, _)) in buckets.iter().enumerate().take(25) {
            assert_eq!(le.parse::<f64>().unwrap(), (i as f64).exp2());
        }
        let at = |le: &str| buckets.iter().find(|b| b.0 == le).unwrap().1;
        assert!(at("1").contains("} 0"), "{om}");
        // 1.5 and 1.9 us in (1, 2]: the later one (seq 2) is the exemplar.
        let key = crate::spans::collective_key("AllReduce", 2, 0);
        let span = hex(&crate::spans::rank_span_id(7, 1, key, 2));
        assert!(
            at("2").contains("} 2 # {") && at("2").contains(&span),
            "{}",
            at("2")
        );
        assert!(at("4").ends_with("} 3"), "{}", at("4"));
        assert!(at("512").ends_with("} 3") && at("1024").ends_with("} 4"));
        assert!(at("+Inf").ends_with("} 4"));
        let skew: Vec<&str> = (om.lines())
            .filter(|l| l.starts_with("ncclscope_rank_skew_microseconds"))
            .collect();
        assert_eq!(skew.len(), 3, "{skew:?}");
        assert!(skew[0].contains("le=\"+Inf\""), "{skew:?}");
        let labels = "uid=\"7\",job_id=\"j\",comm=\"0000000000000001\",rank=\"2\"";
        assert!(om.contains(&format!(
            "ncclscope_rank_exec_time_microseconds_total{{{labels}}} 906.4\n"
        )));
        assert!(om.contains(&format!("ncclscope_rank_collectives_total{{{labels}}} 4\n")));
        let mut pb: &[u8] = &render_protobuf(&f, &how);
        let mut natives = Vec::new();
        while !pb.is_empty() {
            natives.push(prom::MetricFamily::decode_length_delimited(&mut pb).unwrap());
        }
        let histogram = |name: &str| {
            let f = natives.iter().find(|f| f.name() == name).unwrap();
            f.metric[0].histogram.clone().unwrap()
        };
        let h = histogram("ncclscope_collective_exec_time_microseconds");
        let bounds: Vec<f64> = h.bucket.iter().map(|b| b.upper_bound()).collect();
        assert_eq!(
            bounds,
            (0..25).map(|i| (i as f64).exp2()).collect::<Vec<_>>()
        );
        assert_eq!((h.schema(), h.sample_count()), (histogram::EXPORT_SCALE, 4));
        let skew = histogram("ncclscope_rank_skew_microseconds");
        assert!(skew.bucket.is_empty());
    }

    /// What a collector's Prometheus exporter makes of each OTLP metric (unit suffix and `_total`
    /// added back, `.` as `_`) is the name `/metrics` serves, but for the bandwidth's unit spelling.
    #[test]
    fn otlp_names_and_units_map_back_to_the_prometheus_names() {
        let stats = Stats::new(1_000_000_000, 1000, 10);
        let fams = families(&stats, &Health::default(), "h");
        for f in &fams {
            // An info metric's value is no quantity: it alone has no unit.
            assert!(
                !f.unit.is_empty() || f.name.ends_with("_info"),
                "{} has a unit",
                f.name
            );
            let mut prom = otel_name(f.name, f.kind, f.unit).replace('.', "_");
            prom.push_str(match f.unit {
                "us" => "_microseconds",
                "ns" => "_nanoseconds",
                "GBy/s" => "_gigabytes_per_second",
                "1" if f.kind == Kind::Gauge => "_ratio",
                _ => "",
            });
            if f.kind == Kind::Counter {
                prom.push_str("_total");
            }
            let expected = f.name.replace("_gbs", "_gigabytes_per_second");
            assert_eq!(prom, expected, "unit {}", f.unit);
        }
    }

    /// The declared table is what is served: every family built, in [`FAMILIES`]' order, its points
    /// labelled only with its declared labels, each label's meaning known (the reference renders
    /// from these, so a family or label added without them fails here).
    #[test]
    fn every_served_family_and_label_is_declared_once() {
        let mut stats = Stats::new(1_000_000_000, 1000, 10);
        for rank in 0..2 {
            let c = Shared::from(&ncclscope_proto::api::Collective {
                uid: 7,
                job_id: "j".into(),
                comm_hash: 1,
                func: "AllReduce".into(),
                seq: 1,
                rank,
                nranks: 2,
                exec_ns: 1_000 + u64::from(rank),
                end_unix_ns: 1_700_000_000_000_000_000,
                timing_source: "kernel_gpu".into(),
                gpu: Some(rank),
                gpu_uuid: format!("GPU-{rank:08}-0000-0000-0000-000000000000"),
                k8s_pod: format!("train-{rank}"),
                k8s_namespace: "ml".into(),
                ..Default::default()
            });
            stats.observe(c.view(), 0, 1, |_, _| LiveSpans::Rank);
        }
        let health = Health {
            lost: [("ring_full".to_string(), 1)].into_iter().collect(),
            plugin_lost_by_uid: [((7, "ring_full"), 1)].into_iter().collect(),
            refused_by_uid: [((7, "segment_invalid"), 1)].into_iter().collect(),
            ..Health::default()
        };
        let built = families(&stats, &health, "h");
        let names: Vec<&str> = built.iter().map(|f| f.name).collect();
        let declared: Vec<&str> = FAMILIES.iter().map(|d| d.name).collect();
        assert_eq!(names, declared);
        for (f, def) in built.iter().zip(FAMILIES) {
            assert!(!f.points.is_empty(), "{}: no point to check", f.name);
            for (labels, _) in &f.points {
                for (l, _) in labels {
                    assert!(def.labels.contains(l), "{}: label {l} undeclared", f.name);
                }
            }
        }
        // The rank's pod, where its process said it runs in one: joins kube-state-metrics'.
        let ranks = &built[FAMILIES
            .iter()
            .position(|d| d.name == RANK_COLLECTIVES.name)
            .unwrap()];
        let rank1 = &ranks.points[1].0;
        assert!(rank1.contains(&("pod", "train-1".to_string())), "{rank1:?}");
        assert!(
            rank1.contains(&("namespace", "ml".to_string())),
            "{rank1:?}"
        );
        for l in FAMILIES.iter().flat_map(|d| d.labels) {
            assert!(
                LABELS.iter().any(|(n, _)| n == l),
                "label {l} has no meaning in LABELS"
            );
        }
        for (n, _) in LABELS {
            assert!(
                FAMILIES.iter().any(|d| d.labels.contains(n)),
                "LABELS has {n}, which no family carries"
            );
        }
    }
}
