//! Issue 17: OTLP export for production receivers. A real `ncclscope daemon` fed by simulated ranks
//! (`ncclscope sim-rank`, the real plugin) exports over TLS with a client certificate to a gRPC
//! receiver made here (certificates from rcgen), which checks every request's headers, compression
//! and resource; a plain receiver behind an https endpoint gets nothing and the daemon counts the
//! failures; a bad setting stops the daemon at start with one line.

mod common;

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::Value;
use tonic::codec::CompressionEncoding;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};

/// A CA and two certificates it signed: the receiver's (for localhost) and the daemon's client one.
struct Pki {
    ca: String,
    server: (String, String),
    client: (String, String),
}

fn pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    Pki {
        ca: ca.pem(),
        server: leaf("localhost"),
        client: leaf("ncclscope-daemon"),
    }
}

/// What the receiver saw of one export request.
#[derive(Clone, Debug)]
struct Seen {
    metrics: bool,
    /// The headers the test configures, and the request's compression.
    orgid: Option<String>,
    authorization: Option<String>,
    encoding: Option<String>,
    resource: Vec<(String, String)>,
    spans: Vec<Span>,
}

#[derive(Clone, Default)]
struct Receiver {
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Receiver {
    fn record<T>(&self, req: &tonic::Request<T>, resource: Option<&Resource>, spans: Vec<Span>) {
        let md = req.metadata();
        let header = |k: &str| md.get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
        let resource = resource
            .map(|r| r.attributes.iter().map(attribute).collect())
            .unwrap_or_default();
        self.seen.lock().unwrap().push(Seen {
            metrics: spans.is_empty(),
            orgid: header("x-scope-orgid"),
            authorization: header("authorization"),
            encoding: header("grpc-encoding"),
            resource,
            spans,
        });
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn attribute(kv: &KeyValue) -> (String, String) {
    let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        other => format!(
            "{:?}",
            other.cloned().map(|value| AnyValue { value: Some(value) })
        ),
    };
    (kv.key.clone(), v)
}

#[tonic::codegen::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        for rs in &req.get_ref().resource_spans {
            let spans = rs
                .scope_spans
                .iter()
                .flat_map(|s| s.spans.clone())
                .collect();
            self.record(&req, rs.resource.as_ref(), spans);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tonic::codegen::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        for rm in &req.get_ref().resource_metrics {
            self.record(&req, rm.resource.as_ref(), Vec::new());
        }
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

/// A TLS OTLP receiver on localhost that requires a client certificate signed by `pki.ca` and
/// accepts gzip; returns its https endpoint.
async fn tls_receiver(pki: &Pki, receiver: Receiver) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!(
        "https://localhost:{}",
        listener.local_addr().unwrap().port()
    );
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(&pki.server.0, &pki.server.1))
        .client_ca_root(Certificate::from_pem(&pki.ca));
    let server = Server::builder()
        .tls_config(tls)
        .unwrap()
        .add_service(
            TraceServiceServer::new(receiver.clone()).accept_compressed(CompressionEncoding::Gzip),
        )
        .add_service(
            MetricsServiceServer::new(receiver).accept_compressed(CompressionEncoding::Gzip),
        )
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(server);
    endpoint
}

/// A plain-text OTLP receiver on localhost; returns its http endpoint.
async fn plain_receiver(receiver: Receiver) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
    let server = Server::builder()
        .add_service(TraceServiceServer::new(receiver.clone()))
        .add_service(MetricsServiceServer::new(receiver))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(server);
    endpoint
}

/// A daemon process in `dir` (configuration `config`, OTLP endpoint `endpoint`, extra variables
/// `env`); killed on drop.
struct Daemon {
    child: Child,
    dir: std::path::PathBuf,
}

impl Daemon {
    fn start(dir: &Path, config: &str, endpoint: &str, env: &[(&str, &str)]) -> Daemon {
        std::fs::write(dir.join("ncclscope.toml"), config).unwrap();
        let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
        let child =
            ncclscope_tests::daemon_args(&mut Command::new(ncclscope_tests::daemon_binary()), dir)
                .args(["--prometheus-listen", "", "--otlp-endpoint", endpoint])
                .envs(env.iter().copied())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap();
        let mut d = Daemon {
            child,
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(dir.join("api.sock")).is_err() {
            if let Some(st) = d.child.try_wait().unwrap() {
                panic!("daemon exited with {st}: {}", d.log());
            }
            assert!(
                Instant::now() < deadline,
                "daemon did not start: {}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    /// `ncclscope stats --json`'s health: the daemon's export counters.
    fn health(&self) -> Value {
        ncclscope_tests::json_of(
            Command::new(ncclscope_tests::daemon_binary())
                .args(["stats", "--json", "--api-socket"])
                .arg(self.dir.join("api.sock")),
        )["health"]
            .clone()
    }

    /// Simulated ranks of one job through the real plugin for `seconds`; the instances they made.
    fn run_ranks(&self, nranks: u32, seconds: u64) -> Vec<u64> {
        common::run_sim_ranks(&self.dir.join("reg.sock"), "otlp-tls", nranks, seconds, 0)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// Every span reaches a TLS receiver that requires a client certificate, each request carrying the
/// configured headers (here from OTEL_EXPORTER_OTLP_HEADERS, as a pod spec would set them), gzip,
/// and a resource that names the node.
#[test]
fn a_tls_receiver_gets_every_span_with_the_headers_gzip_and_the_node() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pki = pki();
    let receiver = Receiver::default();
    let endpoint = rt.block_on(tls_receiver(&pki, receiver.clone()));
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = format!(
        "[otlp]\nbatch_timeout_ms = 50\nmetrics_interval_ms = 300\ncompression = \"gzip\"\n\
         ca_file = \"{}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        write(d, "ca.pem", &pki.ca),
        write(d, "client.pem", &pki.client.0),
        write(d, "client.key", &pki.client.1),
    );
    let daemon = Daemon::start(
        d,
        &config,
        &endpoint,
        &[
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "X-Scope-OrgID=tenant-a,Authorization=Bearer%20s3cret",
            ),
            ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test"),
        ],
    );
    let produced = daemon.run_ranks(2, 2);
    // Rank 0's daemon also sends each collective's root span.
    let expected = produced.iter().sum::<u64>() + produced[0];
    let span_count = |seen: &[Seen]| seen.iter().map(|s| s.spans.len() as u64).sum::<u64>();
    let deadline = Instant::now() + Duration::from_secs(60);
    while span_count(&receiver.seen()) < expected && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    // Past the batch timeout and a metrics period: anything more would arrive now.
    std::thread::sleep(Duration::from_millis(600));
    let seen = receiver.seen();
    assert_eq!(span_count(&seen), expected, "{}", daemon.log());
    assert!(seen.iter().any(|s| s.metrics), "metrics arrive too");
    let health = daemon.health();
    assert_eq!(health["spans_exported"], expected);
    assert_eq!(health["export_errors"], 0, "{}", daemon.log());
    let instance = seen[0]
        .resource
        .iter()
        .find(|(k, _)| k == "service.instance.id");
    for s in &seen {
        assert_eq!(s.orgid.as_deref(), Some("tenant-a"));
        assert_eq!(s.authorization.as_deref(), Some("Bearer s3cret"));
        assert_eq!(s.encoding.as_deref(), Some("gzip"));
        let attr = |k: &str| {
            s.resource
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(attr("service.name"), Some("ncclscope"));
        assert_eq!(attr("service.version"), Some(env!("CARGO_PKG_VERSION")));
        assert_eq!(attr("deployment.environment"), Some("test"));
        assert!(attr("host.name").is_some_and(|h| !h.is_empty()));
        assert!(
            instance.is_some_and(|(_, v)| !v.is_empty()),
            "{:?}",
            s.resource
        );
        assert_eq!(
            s.resource.iter().find(|(k, _)| k == "service.instance.id"),
            instance,
            "one instance id for the node"
        );
    }
}

/// Issue 17: `https://` to a receiver that speaks plain gRPC delivered 240 spans in clear text. Now
/// the TLS handshake fails: the receiver gets nothing, the daemon counts export errors and runs on.
#[test]
fn a_plain_receiver_behind_https_gets_nothing_and_the_failures_are_counted() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut collector = rt
        .block_on(fake_opentelemetry_collector::FakeCollectorServer::start())
        .unwrap();
    let endpoint = collector.endpoint().replace("http://", "https://");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = format!(
        "[otlp]\nbatch_timeout_ms = 50\nmax_attempts = 1\nmetrics_interval_ms = 300\nca_file = \"{}\"\n",
        write(d, "ca.pem", &pki().ca)
    );
    let mut daemon = Daemon::start(d, &config, &endpoint, &[]);
    let produced: u64 = daemon.run_ranks(2, 1).iter().sum();
    assert!(produced > 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while daemon.health()["export_errors"].as_u64().unwrap_or(0) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let spans = rt.block_on(collector.exported_spans(1, Duration::from_secs(1)));
    let metrics = rt.block_on(collector.exported_metrics(1, Duration::from_millis(100)));
    assert!(
        spans.is_empty() && metrics.is_empty(),
        "{} spans and {} metrics in clear text",
        spans.len(),
        metrics.len()
    );
    let health = daemon.health();
    assert!(health["export_errors"].as_u64().unwrap() > 0, "{health}");
    assert_eq!(health["spans_exported"], 0);
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "the daemon runs on: {}",
        daemon.log()
    );
}

/// A malformed header or an unreadable CA file stops the daemon at start with one line naming it.
#[test]
fn a_bad_header_or_ca_file_stops_the_daemon_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (config, env, says) in [
        (
            "[otlp]\nendpoint = \"https://localhost:4317\"\nca_file = \"/nonexistent/ca.pem\"\n",
            ("NCCLSCOPE_LOG", "info"),
            "error: otlp.ca_file: /nonexistent/ca.pem: No such file",
        ),
        (
            "",
            ("OTEL_EXPORTER_OTLP_HEADERS", "Authorization"),
            "error: OTEL_EXPORTER_OTLP_HEADERS: item 1 is not key=value",
        ),
    ] {
        std::fs::write(d.join("ncclscope.toml"), config).unwrap();
        let out: Output =
            ncclscope_tests::daemon_args(&mut Command::new(ncclscope_tests::daemon_binary()), d)
                .args(["--prometheus-listen", ""])
                .env(env.0, env.1)
                .env("RUST_BACKTRACE", "1")
                .stdin(Stdio::null())
                .output()
                .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.starts_with(says), "{stderr}");
    }
}

/// Issue 39: the OTLP/JSON file named the machine (its host name, `service.name` only) where the live
/// export sends the configured resource. Now the file's resource is exactly the one the receiver got:
/// the configured `host.name`, `service.instance.id`, `service.version` and the configured attributes.
#[test]
fn the_otlp_json_file_carries_the_resource_the_receiver_got() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let receiver = Receiver::default();
    let endpoint = rt.block_on(plain_receiver(receiver.clone()));
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = "[otlp]\nbatch_timeout_ms = 50\nservice_name = \"nccl-telemetry\"\n\
                  resource_attributes = \"host.name=gpu-node-7,deployment.environment=test\"\n";
    let daemon = Daemon::start(d, config, &endpoint, &[]);
    let produced = daemon.run_ranks(2, 1);
    let expected = produced.iter().sum::<u64>() + produced[0];
    let span_count = |seen: &[Seen]| seen.iter().map(|s| s.spans.len() as u64).sum::<u64>();
    let deadline = Instant::now() + Duration::from_secs(60);
    while span_count(&receiver.seen()) < expected && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let seen = receiver.seen();
    let live = &seen
        .iter()
        .find(|s| !s.metrics)
        .expect("spans arrived")
        .resource;

    let file = d.join("trace.otlp.jsonl");
    let out = Command::new(ncclscope_tests::daemon_binary())
        .args([
            "export",
            "--job",
            "otlp-tls",
            "--format",
            "otlp-json",
            "--api-socket",
        ])
        .arg(d.join("api.sock"))
        .arg("-o")
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = std::fs::read_to_string(&file).unwrap();
    let mut resources = Vec::new();
    for line in text.lines() {
        let line: Value = serde_json::from_str(line).unwrap();
        for rs in line["resourceSpans"].as_array().unwrap() {
            let attrs: Vec<(String, String)> = (rs["resource"]["attributes"].as_array().unwrap())
                .iter()
                .map(|a| {
                    let v = a["value"]["stringValue"].as_str().unwrap();
                    (a["key"].as_str().unwrap().to_string(), v.to_string())
                })
                .collect();
            resources.push(attrs);
        }
    }
    assert!(!resources.is_empty(), "{text}");
    for r in &resources {
        assert_eq!(r, live, "the file's resource against the receiver's");
    }
    let attr = |k: &str| {
        live.iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(attr("service.name"), Some("nccl-telemetry"));
    assert_eq!(attr("host.name"), Some("gpu-node-7"));
    assert_eq!(attr("deployment.environment"), Some("test"));
    assert_eq!(attr("service.version"), Some(env!("CARGO_PKG_VERSION")));
    assert!(attr("service.instance.id").is_some_and(|v| !v.is_empty()));
}
