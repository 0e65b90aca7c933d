//! OTLP/gRPC export: a bounded span queue fed by the engine, batched, retried with exponential
//! backoff, and dropped (counted) when the receiver stays away; plus the periodic metrics export.
//! Each span item carries an acknowledgement the engine waits for before it commits the segment
//! records behind it, so spans still queued when the daemon is killed are re-read and re-exported.
//! Instances whose spans are given up are remembered for [`crate::export::resend`], which re-sends them from
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
use tonic::codec::CompressionEncoding;
use tonic::metadata::MetadataMap;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::config::{Otlp, key_values, metadata};
use crate::export::export_queue::{ExportCounters, SpanItem};
use crate::export::resend::{self, Dropped};
use crate::spans;
use crate::stats::RootWait;

fn kv(key: &str, v: &str) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v.into())),
        }),
        ..Default::default()
    }
}

/// The node's resource: `service.name` (`otlp.service_name`, else `service.name` from
/// `otlp.resource_attributes`, else ncclscope), `service.version`, `host.name`, `service.instance.id`
/// ([`instance_id`]: through a collector into Prometheus it becomes the `instance` label of every
/// series), then `otlp.resource_attributes`, which may replace any of them but `service.name`.
/// One daemon serves many processes: process.pid is a span attribute, not a resource attribute.
pub fn resource(cfg: &Otlp, host: &str) -> Resource {
    resource_from(resource_attributes(cfg, host))
}

/// A resource of string attributes.
pub fn resource_from(attributes: impl IntoIterator<Item = (String, String)>) -> Resource {
    Resource {
        attributes: (attributes.into_iter()).map(|(k, v)| kv(&k, &v)).collect(),
        ..Default::default()
    }
}

/// [`resource`]'s attributes as (key, value), in its order: what the query API hands `export
/// --format otlp-json`, so the file names the node as the live export does.
pub fn resource_attributes(cfg: &Otlp, host: &str) -> Vec<(String, String)> {
    let given = key_values(&cfg.resource_attributes).unwrap_or_default();
    let name = (!cfg.service_name.is_empty())
        .then_some(cfg.service_name.as_str())
        .or_else(|| {
            given
                .iter()
                .find(|(k, _)| k == "service.name")
                .map(|(_, v)| v.as_str())
        })
        .unwrap_or("ncclscope");
    let mut attributes: Vec<(String, String)> = [
        ("service.name", name),
        ("service.version", env!("CARGO_PKG_VERSION")),
        ("host.name", host),
        ("service.instance.id", &instance_id(host)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for (k, v) in given.into_iter().filter(|(k, _)| k != "service.name") {
        match attributes.iter_mut().find(|a| a.0 == k) {
            Some(a) => a.1 = v,
            None => attributes.push((k, v)),
        }
    }
    attributes
}

/// The node's `host.name` as [`resource`] gives it: `otlp.resource_attributes`' if set, else `host`.
pub fn host_name(cfg: &Otlp, host: &str) -> String {
    let given = key_values(&cfg.resource_attributes).unwrap_or_default();
    let named = given.into_iter().find(|(k, _)| k == "host.name");
    named.map_or_else(|| host.to_string(), |(_, v)| v)
}

/// A UUID stable for the machine: its machine id (/etc/machine-id) hashed with an application key
/// (HMAC-SHA256, then the UUID version 4 bits), as machine-id(5) asks of applications, since the id
/// itself is meant to stay on the machine; the host name where there is no machine id (a container
/// without one: set `service.instance.id` through `otlp.resource_attributes` there).
fn instance_id(host: &str) -> String {
    const APP_KEY: &[u8] = b"ncclscope service.instance.id";
    let Some(machine) = std::fs::read_to_string("/etc/machine-id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit()))
    else {
        return host.to_string();
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, machine.as_bytes());
    let tag = ring::hmac::sign(&key, APP_KEY);
    let mut id = [0u8; 16];
    id.copy_from_slice(&tag.as_ref()[..16]);
    id[6] = (id[6] & 0x0f) | 0x40;
    id[8] = (id[8] & 0x3f) | 0x80;
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// What every export request carries beyond its data.
#[derive(Clone)]
struct Envelope {
    resource: Resource,
    headers: MetadataMap,
    timeout: Duration,
}

impl Envelope {
    /// `message` with the headers and a `grpc-timeout` that tells the receiver our deadline.
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut r =
            tonic::Request::from_parts(self.headers.clone(), tonic::Extensions::default(), message);
        r.set_timeout(self.timeout);
        r
    }
}

pub fn scope() -> InstrumentationScope {
    InstrumentationScope {
        name: "ncclscope".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        ..Default::default()
    }
}

/// The connection to the receiver: TLS for an https endpoint (the system's trust store, or only the
/// CAs of `otlp.ca_file`; a client certificate with `otlp.cert_file`/`otlp.key_file`), so a receiver
/// that does not speak TLS there fails every export (counted) instead of taking data in clear text.
///
/// A receiver that accepts and then stops answering keeps its connection established: a request
/// that times out leaves it open, and every later request would wait on it, even once the receiver
/// answers again on a new connection. So while requests are open, a connection that answers no
/// HTTP/2 PING within the request timeout is closed, and the next request connects anew.
pub fn channel(cfg: &Otlp) -> Result<Channel, String> {
    let timeout = Duration::from_millis(cfg.request_timeout_ms);
    let endpoint = Endpoint::from_shared(cfg.endpoint.clone())
        .map_err(|e| format!("otlp.endpoint {:?}: {e}", cfg.endpoint))?
        .timeout(timeout)
        .connect_timeout(timeout)
        .http2_keep_alive_interval(timeout)
        .keep_alive_timeout(timeout);
    if endpoint.uri().scheme_str() != Some("https") {
        return Ok(endpoint.connect_lazy());
    }
    let read = |key: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| format!("otlp.{key} {}: {e}", path.display()))
    };
    let mut tls = ClientTlsConfig::new().timeout(timeout);
    tls = if cfg.ca_file.as_os_str().is_empty() {
        tls.with_native_roots()
    } else {
        tls.ca_certificate(Certificate::from_pem(read("ca_file", &cfg.ca_file)?))
    };
    if !cfg.cert_file.as_os_str().is_empty() {
        tls = tls.identity(Identity::from_pem(
            read("cert_file", &cfg.cert_file)?,
            read("key_file", &cfg.key_file)?,
        ));
    }
    let endpoint = endpoint.tls_config(tls).map_err(|e| {
        let mut msg = format!("TLS for otlp.endpoint {}", cfg.endpoint);
        let mut cause: Option<&dyn std::error::Error> = Some(&e);
        while let Some(c) = cause {
            msg.push_str(&format!(": {c}"));
            cause = c.source();
        }
        msg
    })?;
    Ok(endpoint.connect_lazy())
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
    settles: Option<RootWait>,
    /// The instance's job and what a re-send needs, when dropped instances are remembered.
    dropped: Option<(Arc<Names>, resend::Wanted)>,
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
    let envelope = Envelope {
        resource: resource(&cfg, &host),
        // Checked when the configuration was loaded.
        headers: metadata(&cfg.headers).unwrap_or_default(),
        timeout: Duration::from_millis(cfg.request_timeout_ms),
    };
    let mut traces = TraceServiceClient::new(channel.clone());
    let mut metric_client = MetricsServiceClient::new(channel);
    if cfg.compression == "gzip" {
        traces = traces.send_compressed(CompressionEncoding::Gzip);
        metric_client = metric_client.send_compressed(CompressionEncoding::Gzip);
    }
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
                    let live: Vec<bool> = batch.iter().map(|i| i.acked.is_some() || i.settles.is_some()).collect();
                    let (colls, items): (Vec<Shared>, Vec<Sent>) = batch
                        .into_iter()
                        .map(|i| {
                            let sent = Sent {
                                acked: i.acked.map(|a| (a, i.emit_no)),
                                settles: i.settles,
                                dropped: dropped.is_some().then(|| (i.coll.names.clone(), resend::Wanted::of(i.coll.view()))),
                            };
                            (i.coll, sent)
                        })
                        .unzip();
                    let task = tokio::spawn(send_spans(cfg.clone(), envelope.clone(), traces.clone(), colls, live, counters.clone(), dropped.clone()));
                    in_flight.push_back(InFlight { items, task });
                }
                None => spans_open = false,
            },
            m = metrics.recv(), if metrics_open => match m {
                Some(m) => send_metrics(&cfg, &envelope, &mut metric_client, m, &counters).await,
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
        if let Some(root) = item.settles {
            root.settle();
        }
        if let Some((acked, emit_no)) = item.acked {
            acked.fetch_max(emit_no, Ordering::Release);
        }
        if !ok && let (Some(d), Some((names, wanted))) = (dropped, item.dropped) {
            d.remember(names.uid, &names.job_id, wanted, counters);
        }
    }
}

/// Sends one batch with retries; the request is rebuilt for each attempt rather than kept as a copy.
/// `live[i]`: whether `colls[i]` comes from the live path (not a re-send). Returns whether it was
/// exported and how many spans its live items had.
async fn send_spans(
    cfg: Otlp,
    envelope: Envelope,
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
                resource: Some(envelope.resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(scope()),
                    spans: otlp_spans,
                    ..Default::default()
                }],
                ..Default::default()
            }],
        };
        let (mut c, request) = (client.clone(), envelope.request(request));
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
    envelope: &Envelope,
    client: &mut MetricsServiceClient<Channel>,
    metrics: Vec<Metric>,
    counters: &ExportCounters,
) {
    let request = ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(envelope.resource.clone()),
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
        let (mut c, r) = (client.clone(), envelope.request(request.clone()));
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
        let channel = channel(&Otlp {
            request_timeout_ms: 200,
            ..cfg.clone()
        })
        .unwrap();
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
                trace_root_end_unix_ns: if rank == 2 { 1 } else { 0 },
                ..Default::default()
            });
            spans::live_spans_of(coll.view(), &mut produced);
            let item = SpanItem {
                coll,
                acked: Some(Arc::new(AtomicU64::new(0))),
                emit_no: 1,
                settles: None,
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
        assert_eq!(produced.len(), 4, "rank 2 also carries the root span");
        assert_eq!(counters.spans_dropped.load(Ordering::Relaxed), 4);
        assert_eq!(counters.spans_exported.load(Ordering::Relaxed), 0);
    }
}
