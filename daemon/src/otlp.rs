//! OTLP/gRPC export: a bounded span queue fed by the engine, batched, retried with exponential
//! backoff, and dropped (counted) when the receiver stays away; plus the periodic metrics export.
//! Each span item carries an acknowledgement the engine waits for before it commits the segment
//! records behind it, so spans still queued when the daemon is killed are re-read and re-exported.
//! Instances whose spans are given up are remembered for [`crate::resend`], which re-sends them from
//! the spool once the receiver answers again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::instance::{Names, Shared};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_client::MetricsServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{Metric, ResourceMetrics, ScopeMetrics};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans};
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

use crate::config::Otlp;
use crate::resend::{self, Dropped};
use crate::spans;

/// One instance to export. `acked` is its segment's acknowledgement cursor: after the attempt ends
/// (accepted, or given up and counted) it is raised to `emit_no`. Items of one segment are queued in
/// `emit_no` order and handled in queue order, so the cursor only moves forward. An instance re-sent
/// from the spool has none: no segment waits on it.
pub struct SpanItem {
    pub coll: Shared,
    pub acked: Option<Arc<AtomicU64>>,
    pub emit_no: u64,
}

/// Export outcomes, shared with the engine's health snapshot.
#[derive(Debug, Default)]
pub struct ExportCounters {
    pub spans_exported: AtomicU64,
    pub spans_dropped: AtomicU64,
    pub export_errors: AtomicU64,
    pub metrics_exported: AtomicU64,
    /// Dropped instances queued again from the spool.
    pub resent: AtomicU64,
    /// Dropped instances that will not be re-sent: past the bound on those remembered, or no longer
    /// in the spool.
    pub not_resent: AtomicU64,
}

fn resource(host: &str) -> Resource {
    let kv = |k: &str, v: &str| KeyValue {
        key: k.into(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v.into())),
        }),
        ..Default::default()
    };
    // One daemon serves many processes: process.pid is a span attribute, not a resource attribute.
    Resource {
        attributes: vec![kv("service.name", "ncclscope"), kv("host.name", host)],
        ..Default::default()
    }
}

fn scope() -> InstrumentationScope {
    InstrumentationScope {
        name: "ncclscope".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        ..Default::default()
    }
}

/// A receiver that accepts and then stops answering keeps its connection established: a request
/// that times out leaves it open, and every later request would wait on it, even once the receiver
/// answers again on a new connection. So while requests are open, a connection that answers no
/// HTTP/2 PING within `timeout` is closed, and the next request connects anew.
pub fn channel(endpoint: &str, timeout: Duration) -> Result<Channel, tonic::transport::Error> {
    Ok(Endpoint::from_shared(endpoint.to_string())?
        .timeout(timeout)
        .connect_timeout(timeout)
        .http2_keep_alive_interval(timeout)
        .keep_alive_timeout(timeout)
        .connect_lazy())
}

/// Export requests in flight at once. Acknowledgements still go out in queue order: a batch is
/// acknowledged only after every batch queued before it.
const MAX_IN_FLIGHT: usize = 4;

/// A batch being sent: its items (acknowledged when it is done, remembered if it is given up) and
/// the task.
struct InFlight {
    items: Vec<Sent>,
    /// (exported, spans of its live items: a re-sent item's spans were counted dropped once already).
    task: tokio::task::JoinHandle<(bool, u64)>,
}

/// What a batch keeps of each item once its instance went to the send task.
struct Sent {
    acked: Option<(Arc<AtomicU64>, u64)>,
    /// The instance's job and [`resend::key`], when dropped instances are remembered.
    dropped: Option<(Arc<Names>, u64)>,
}

/// Runs until `spans` and `metrics` are both closed and drained. With `dropped`, instances given up
/// are remembered there, and every attempt's outcome tells it whether the receiver answers.
pub async fn run(
    cfg: Otlp,
    host: String,
    channel: Channel,
    mut spans: mpsc::Receiver<SpanItem>,
    mut metrics: mpsc::Receiver<Vec<Metric>>,
    counters: Arc<ExportCounters>,
    dropped: Option<Arc<Dropped>>,
) {
    let traces = TraceServiceClient::new(channel.clone());
    let mut metric_client = MetricsServiceClient::new(channel);
    let batch_timeout = Duration::from_millis(cfg.batch_timeout_ms);
    let mut in_flight: std::collections::VecDeque<InFlight> = std::collections::VecDeque::new();
    let (mut spans_open, mut metrics_open) = (true, true);
    while spans_open || metrics_open {
        tokio::select! {
            item = spans.recv(), if spans_open => match item {
                Some(item) => {
                    let mut batch = Vec::with_capacity(cfg.batch_spans);
                    batch.push(item);
                    let deadline = tokio::time::Instant::now() + batch_timeout;
                    while batch.len() < cfg.batch_spans {
                        match tokio::time::timeout_at(deadline, spans.recv()).await {
                            Ok(Some(item)) => batch.push(item),
                            Ok(None) => { spans_open = false; break; }
                            Err(_) => break,
                        }
                    }
                    if in_flight.len() >= MAX_IN_FLIGHT {
                        finish(in_flight.pop_front().expect("non-empty"), &counters, dropped.as_deref()).await;
                    }
                    let live: Vec<bool> = batch.iter().map(|i| i.acked.is_some()).collect();
                    let (colls, items): (Vec<Shared>, Vec<Sent>) = batch
                        .into_iter()
                        .map(|i| {
                            let sent = Sent {
                                acked: i.acked.map(|a| (a, i.emit_no)),
                                dropped: dropped.is_some().then(|| (i.coll.names.clone(), resend::key(i.coll.view()))),
                            };
                            (i.coll, sent)
                        })
                        .unzip();
                    let task = tokio::spawn(send_spans(cfg.clone(), host.clone(), traces.clone(), colls, live, counters.clone(), dropped.clone()));
                    in_flight.push_back(InFlight { items, task });
                }
                None => spans_open = false,
            },
            m = metrics.recv(), if metrics_open => match m {
                Some(m) => send_metrics(&cfg, &host, &mut metric_client, m, &counters).await,
                None => metrics_open = false,
            },
            ok = front_done(&mut in_flight), if !in_flight.is_empty() => {
                let f = in_flight.pop_front().expect("non-empty");
                acknowledge(f.items, ok, &counters, dropped.as_deref());
            },
        }
    }
    while let Some(f) = in_flight.pop_front() {
        finish(f, &counters, dropped.as_deref()).await;
    }
}

/// Waits for a batch and acknowledges its items.
async fn finish(f: InFlight, counters: &ExportCounters, dropped: Option<&Dropped>) {
    let ok = f.task.await.unwrap_or((false, 0));
    acknowledge(f.items, ok, counters, dropped);
}

/// Whether the oldest batch in flight was exported, and its spans (resolves when it is done).
async fn front_done(q: &mut std::collections::VecDeque<InFlight>) -> (bool, u64) {
    match q.front_mut() {
        Some(f) => (&mut f.task).await.unwrap_or((false, 0)),
        None => std::future::pending().await,
    }
}

/// Acknowledges items whose attempt ended: exported, or given up, the live items' spans counted as
/// dropped (in spans, as `spans_exported` counts them: the two add up to what was sent; a re-sent
/// item failing again is no new loss) and every item's instance remembered for re-sending.
fn acknowledge(
    items: Vec<Sent>,
    (ok, spans): (bool, u64),
    counters: &ExportCounters,
    dropped: Option<&Dropped>,
) {
    if !ok {
        counters.spans_dropped.fetch_add(spans, Ordering::Relaxed);
    }
    for item in items {
        if let Some((acked, emit_no)) = item.acked {
            acked.fetch_max(emit_no, Ordering::Release);
        }
        if !ok && let (Some(d), Some((names, key))) = (dropped, item.dropped) {
            d.remember(names.uid, &names.job_id, key, counters);
        }
    }
}

/// Sends one batch with retries; the request is rebuilt for each attempt rather than kept as a copy.
/// `live[i]`: whether `colls[i]` comes from the live path (not a re-send). Returns whether it was
/// exported and how many spans its live items had.
async fn send_spans(
    cfg: Otlp,
    host: String,
    client: TraceServiceClient<Channel>,
    colls: Vec<Shared>,
    live: Vec<bool>,
    counters: Arc<ExportCounters>,
    dropped: Option<Arc<Dropped>>,
) -> (bool, u64) {
    let (mut n, mut n_live) = (0, 0);
    let ok = with_retry(&cfg, &counters, dropped.as_deref(), || {
        let mut otlp_spans = Vec::with_capacity(colls.len() * 2);
        n_live = 0;
        for (c, &live) in colls.iter().zip(&live) {
            let before = otlp_spans.len();
            spans::live_spans_of(c.view(), &mut otlp_spans);
            if live {
                n_live += (otlp_spans.len() - before) as u64;
            }
        }
        n = otlp_spans.len() as u64;
        let request = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(resource(&host)),
                scope_spans: vec![ScopeSpans {
                    scope: Some(scope()),
                    spans: otlp_spans,
                    ..Default::default()
                }],
                ..Default::default()
            }],
        };
        let mut c = client.clone();
        async move { c.export(request).await.map(|_| ()) }
    })
    .await;
    if ok {
        counters.spans_exported.fetch_add(n, Ordering::Relaxed);
    }
    (ok, n_live)
}

async fn send_metrics(
    cfg: &Otlp,
    host: &str,
    client: &mut MetricsServiceClient<Channel>,
    metrics: Vec<Metric>,
    counters: &ExportCounters,
) {
    let request = ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(resource(host)),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(scope()),
                metrics,
                ..Default::default()
            }],
            ..Default::default()
        }],
    };
    // Not told to the re-sender (`None`): it re-sends spans, whatever the metrics endpoint says.
    let ok = with_retry(cfg, counters, None::<&Dropped>, || {
        let mut c = client.clone();
        let r = request.clone();
        async move { c.export(r).await.map(|_| ()) }
    })
    .await;
    if ok {
        counters.metrics_exported.fetch_add(1, Ordering::Relaxed);
    }
}

/// Up to `max_attempts` tries, 100 ms doubling to 5 s between them; each outcome goes to `dropped`.
async fn with_retry<F, Fut>(
    cfg: &Otlp,
    counters: &ExportCounters,
    dropped: Option<&Dropped>,
    mut attempt: F,
) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>>,
{
    let mut backoff = Duration::from_millis(100);
    for i in 0..cfg.max_attempts {
        let outcome = attempt().await;
        if let Some(d) = dropped {
            d.answered(outcome.is_ok());
        }
        match outcome {
            Ok(()) => return true,
            Err(status) => {
                counters.export_errors.fetch_add(1, Ordering::Relaxed);
                if i == 0 {
                    tracing::warn!(code = ?status.code(), message = status.message(), "OTLP export failed; retrying");
                }
            }
        }
        if i + 1 < cfg.max_attempts {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instance::Shared;

    /// Issue 22: `spans_exported_total` counted spans, `export_dropped` instances, so the two did
    /// not add up to what was sent. A collector that is not there: every span is counted dropped.
    #[tokio::test]
    async fn spans_given_up_are_counted_in_spans() {
        let cfg = Otlp {
            endpoint: "http://127.0.0.1:1".into(),
            max_attempts: 1,
            batch_timeout_ms: 10,
            ..Otlp::default()
        };
        let channel = channel(&cfg.endpoint, Duration::from_millis(200)).unwrap();
        let (tx, rx) = mpsc::channel(16);
        let (_metrics_tx, metrics_rx) = mpsc::channel(1);
        let counters = Arc::new(ExportCounters::default());
        let mut produced = Vec::new();
        for rank in 0..3 {
            let coll = Shared::from(&ncclscope_proto::api::Collective {
                job_id: "j".into(),
                func: "AllReduce".into(),
                rank,
                nranks: 3,
                live_spans: ncclscope_proto::api::LiveSpans::Rank as i32,
                ..Default::default()
            });
            spans::live_spans_of(coll.view(), &mut produced);
            let item = SpanItem {
                coll,
                acked: Some(Arc::new(AtomicU64::new(0))),
                emit_no: 1,
            };
            tx.send(item).await.unwrap();
        }
        drop(tx);
        drop(_metrics_tx);
        run(
            cfg,
            "h".into(),
            channel,
            rx,
            metrics_rx,
            counters.clone(),
            None,
        )
        .await;
        assert_eq!(produced.len(), 4, "rank 0 also carries the root span");
        assert_eq!(counters.spans_dropped.load(Ordering::Relaxed), 4);
        assert_eq!(counters.spans_exported.load(Ordering::Relaxed), 0);
    }
}
