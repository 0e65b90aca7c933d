//! The daemon's metrics, built once per snapshot into one neutral model and rendered two ways:
//! Prometheus text (served on localhost) and OTLP metrics. Never sampled; label sets are bounded by
//! the series cap ([`crate::stats`]) and the ranks attached to this node.
//!
//! Per-job families (labelled with the job's uid) go to the OTLP collector; Prometheus, which any
//! local user can scrape, serves only the daemon's own health unless `prometheus.job_series` says
//! every local user may see every job.

use std::collections::BTreeMap;
use std::fmt::Write;

use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{
    AggregationTemporality, Gauge, Histogram, HistogramDataPoint, Metric, NumberDataPoint, Sum,
    metric, number_data_point,
};

use crate::histogram::Buckets;
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
    Histogram(Buckets),
}

#[derive(Clone, Debug)]
pub struct Family {
    pub name: &'static str,
    /// UCUM, as OpenTelemetry metrics carry units (`us`, `GBy/s`, `{collective}` for a count).
    pub unit: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    /// Its points describe users' jobs (labelled job_id and uid), not the daemon.
    pub per_job: bool,
    pub points: Vec<(Vec<(&'static str, String)>, Value)>,
}

impl Family {
    fn new(name: &'static str, unit: &'static str, help: &'static str, kind: Kind) -> Family {
        Family {
            name,
            unit,
            help,
            kind,
            per_job: false,
            points: Vec::new(),
        }
    }

    fn per_job(mut self) -> Family {
        self.per_job = true;
        self
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
    /// Non-zero plugin counters per (uid, stage): whose processes reported the loss.
    pub plugin_lost_by_uid: BTreeMap<(u32, &'static str), u64>,
}

fn comm_label(hash: u64) -> String {
    format!("{hash:016x}")
}

/// Builds every metric family from the statistics and the health counters.
pub fn families(stats: &Stats, health: &Health) -> Vec<Family> {
    let mut exec = Family::new(
        "ncclscope_collective_exec_time_microseconds",
        "us",
        "Execution time per collective instance (max over channels of the kernel work time)",
        Kind::Histogram,
    )
    .per_job();
    let mut busbw = Family::new(
        "ncclscope_collective_bus_bandwidth_gbs",
        "GBy/s",
        "Bus bandwidth per collective instance as NCCL Inspector defines it, GB/s",
        Kind::Histogram,
    )
    .per_job();
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
        ];
        exec.points
            .push((labels.clone(), Value::Histogram(s.exec_us.clone())));
        busbw
            .points
            .push((labels, Value::Histogram(s.busbw_gbs.clone())));
    }
    let mut skew = Family::new(
        "ncclscope_rank_skew_microseconds",
        "us",
        "How much later this rank's kernels started than the earliest rank of the same collective on this node",
        Kind::Histogram,
    )
    .per_job();
    let mut straggler = Family::new(
        "ncclscope_rank_straggler_total",
        "{collective}",
        "Collectives in which this rank was the last of the node's ranks to start (when=start) or to end (when=end)",
        Kind::Counter,
    )
    .per_job();
    let mut per_rank = Family::new(
        "ncclscope_rank_collectives_total",
        "{collective}",
        "Collective instances per rank",
        Kind::Counter,
    )
    .per_job();
    let mut ranks: Vec<_> = stats.ranks.iter().collect();
    ranks.sort_by(|a, b| a.0.cmp(b.0));
    for (k, r) in ranks {
        let labels = vec![
            ("uid", k.uid.to_string()),
            ("job_id", k.job.to_string()),
            ("comm", comm_label(k.comm_hash)),
            ("rank", k.rank.to_string()),
        ];
        skew.points
            .push((labels.clone(), Value::Histogram(r.skew_us.clone())));
        let with = |when: &str| {
            let mut l = labels.clone();
            l.push(("when", when.to_string()));
            l
        };
        straggler.push(with("start"), r.last_to_start as f64);
        straggler.push(with("end"), r.last_to_end as f64);
        per_rank.push(labels, r.collectives as f64);
    }
    let mut out = vec![exec, busbw, skew, straggler, per_rank];
    let counter = |name, unit, help, v: u64| {
        let mut f = Family::new(name, unit, help, Kind::Counter);
        f.push(Vec::new(), v as f64);
        f
    };
    let gauge = |name, unit, help, v: f64| {
        let mut f = Family::new(name, unit, help, Kind::Gauge);
        f.push(Vec::new(), v);
        f
    };
    out.push(gauge(
        "ncclscope_segments",
        "{segment}",
        "Segments (NCCL processes) attached",
        health.segments as f64,
    ));
    out.push(counter(
        "ncclscope_records_total",
        "{record}",
        "Records read from segments",
        health.records_in,
    ));
    out.push(counter(
        "ncclscope_decode_errors_total",
        "{record}",
        "Records that did not decode",
        health.decode_errors,
    ));
    out.push(counter(
        "ncclscope_collectives_total",
        "{collective}",
        "Collective and p2p instances completed",
        health.collectives,
    ));
    let mut lost = Family::new(
        "ncclscope_lost_total",
        "{event}",
        "Events lost (or declined) per stage: plugin counters and the daemon's own",
        Kind::Counter,
    );
    for (stage, v) in &health.lost {
        lost.push(vec![("stage", stage.clone())], *v as f64);
    }
    out.push(lost);
    let mut by_uid = Family::new(
        "ncclscope_plugin_lost_total",
        "{event}",
        "Events the plugins of one uid's processes reported lost, per stage (non-zero only)",
        Kind::Counter,
    );
    for (&(uid, stage), v) in &health.plugin_lost_by_uid {
        by_uid.push(
            vec![("uid", uid.to_string()), ("stage", stage.to_string())],
            *v as f64,
        );
    }
    out.push(by_uid);
    out.push(counter(
        "ncclscope_spans_exported_total",
        "{span}",
        "Spans accepted by the OTLP receiver",
        health.spans_exported,
    ));
    out.push(counter(
        "ncclscope_export_resent_total",
        "{instance}",
        "Instances whose spans were dropped (queue full, or given up) and queued again from the spool \
         once the OTLP receiver answered (ncclscope_lost_total{stage=\"export_not_resent\"}: those that \
         could not be)",
        health.export_resent,
    ));
    out.push(counter(
        "ncclscope_forced_commits_total",
        "{commit}",
        "Segment tails committed past open operations or unacknowledged spans because the ring was \
         over half full: nothing is lost, but a daemon restarted then would not read those again",
        health.forced_commits,
    ));
    out.push(counter(
        "ncclscope_parked_operations_total",
        "{operation}",
        "Operations in flight the segment tail was committed past with their state saved for a \
         restart (after a record lost in their segment, or while they stayed open), so that an \
         operation that can no longer complete holds no ring space",
        health.parked_ops,
    ));
    out.push(counter(
        "ncclscope_clock_steps_total",
        "{step}",
        "Steps of the host clock (CLOCK_REALTIME against CLOCK_BOOTTIME, over 50 ms)",
        health.clock_steps,
    ));
    out.push(counter(
        "ncclscope_skew_clock_step_total",
        "{collective}",
        "Collectives left out of the skew and straggler counts because a rank started them near a \
         host clock step",
        health.skew_clock_step,
    ));
    out.push(counter(
        "ncclscope_export_errors_total",
        "{error}",
        "Failed OTLP export attempts",
        health.export_errors,
    ));
    out.push(gauge(
        "ncclscope_calibration_error_max_nanoseconds",
        "ns",
        "Largest GPU-to-host clock calibration error bound among attached processes",
        health.max_calibration_error_ns as f64,
    ));
    let join_rate = if health.dev_work == 0 {
        1.0
    } else {
        health.dev_joined as f64 / health.dev_work as f64
    };
    out.push(gauge(
        "ncclscope_device_hook_join_ratio",
        "1",
        "Fraction of device-hook work items joined to a host collective",
        join_rate,
    ));
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

/// Prometheus text exposition format 0.0.4; per-job families only with `job_series`.
pub fn render_prometheus(families: &[Family], job_series: bool) -> String {
    let mut out = String::new();
    for f in families.iter().filter(|f| job_series || !f.per_job) {
        let kind = match f.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        let _ = writeln!(
            out,
            "# HELP {} {}\n# TYPE {} {}",
            f.name, f.help, f.name, kind
        );
        for (labels, v) in &f.points {
            match v {
                Value::Number(n) => {
                    let _ = writeln!(out, "{}{} {}", f.name, label_text(labels, None), n);
                }
                Value::Histogram(b) => {
                    let mut cum = 0;
                    for (i, c) in b.counts().iter().enumerate() {
                        cum += c;
                        let le = b
                            .bounds
                            .get(i)
                            .map_or("+Inf".to_string(), |x| x.to_string());
                        let _ = writeln!(
                            out,
                            "{}_bucket{} {}",
                            f.name,
                            label_text(labels, Some(("le", le))),
                            cum
                        );
                    }
                    let _ = writeln!(out, "{}_sum{} {}", f.name, label_text(labels, None), b.sum);
                    let _ = writeln!(
                        out,
                        "{}_count{} {}",
                        f.name,
                        label_text(labels, None),
                        b.count
                    );
                }
            }
        }
    }
    out
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
fn otel_name(f: &Family) -> String {
    let mut name = f.name;
    if f.kind == Kind::Counter {
        name = name.strip_suffix("_total").unwrap_or(name);
    }
    let suffix = match f.unit {
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
                Kind::Histogram => metric::Data::Histogram(Histogram {
                    data_points: f
                        .points
                        .iter()
                        .filter_map(|(l, v)| match v {
                            Value::Histogram(b) => Some(HistogramDataPoint {
                                attributes: attributes(l),
                                start_time_unix_nano: start_ns,
                                time_unix_nano: now_ns,
                                count: b.count,
                                sum: Some(b.sum),
                                bucket_counts: b.counts().to_vec(),
                                explicit_bounds: b.bounds.to_vec(),
                                ..Default::default()
                            }),
                            Value::Number(_) => None,
                        })
                        .collect(),
                    aggregation_temporality: cumulative,
                }),
            };
            Metric {
                name: otel_name(f),
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
    use crate::instance::Shared;

    #[test]
    fn prometheus_text_has_cumulative_buckets_and_escaped_labels() {
        let mut stats = Stats::new(1_000_000_000, 1000, 10);
        for exec in [1_500u64, 3_000, 3_000_000] {
            let c = Shared::from(&ncclscope_proto::api::Collective {
                uid: 1234,
                job_id: "j\"1".into(),
                comm_hash: 1,
                func: "AllReduce".into(),
                bytes: 4096,
                exec_ns: exec,
                busbw_gbs: 1.0,
                nnodes: 1,
                timing_source: "kernel_gpu".into(),
                ..Default::default()
            });
            stats.observe(c.view(), 0, 1);
        }
        let health = Health {
            lost: BTreeMap::from([("ring_full".into(), 3)]),
            ..Default::default()
        };
        let text = render_prometheus(&families(&stats, &health), true);
        let l = "uid=\"1234\",job_id=\"j\\\"1\",comm=\"0000000000000001\",collective=\"AllReduce\",size_bucket=\"<=4KiB\",n_nodes=\"1\"";
        assert!(
            text.contains(&format!(
                "ncclscope_collective_exec_time_microseconds_bucket{{{l},le=\"2\"}} 1\n"
            )),
            "{text}"
        );
        assert!(text.contains(&format!(
            "ncclscope_collective_exec_time_microseconds_bucket{{{l},le=\"5\"}} 2\n"
        )));
        assert!(text.contains(&format!(
            "ncclscope_collective_exec_time_microseconds_bucket{{{l},le=\"+Inf\"}} 3\n"
        )));
        assert!(text.contains(&format!(
            "ncclscope_collective_exec_time_microseconds_count{{{l}}} 3\n"
        )));
        assert!(text.contains("ncclscope_lost_total{stage=\"ring_full\"} 3\n"));
        // By default Prometheus (any local user may scrape it) serves the daemon's health, no job.
        let public = render_prometheus(&families(&stats, &health), false);
        assert!(public.contains("ncclscope_lost_total{stage=\"ring_full\"} 3\n"));
        assert!(
            !public.contains("job_id") && !public.contains("uid="),
            "{public}"
        );
        let otlp = to_otlp(&families(&stats, &health), 1, 2);
        assert_eq!(
            (otlp[0].name.as_str(), otlp[0].unit.as_str()),
            ("ncclscope.collective_exec_time", "us")
        );
        let Some(metric::Data::Histogram(h)) = &otlp[0].data else {
            panic!()
        };
        assert_eq!(h.data_points[0].count, 3);
        assert_eq!(h.data_points[0].bucket_counts.iter().sum::<u64>(), 3);
    }

    /// What a collector's Prometheus exporter makes of each OTLP metric (unit suffix and `_total`
    /// added back, `.` as `_`) is the name `/metrics` serves, but for the bandwidth's unit spelling.
    #[test]
    fn otlp_names_and_units_map_back_to_the_prometheus_names() {
        let stats = Stats::new(1_000_000_000, 1000, 10);
        let fams = families(&stats, &Health::default());
        for f in &fams {
            assert!(!f.unit.is_empty(), "{} has a unit", f.name);
            let mut prom = otel_name(f).replace('.', "_");
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
}
