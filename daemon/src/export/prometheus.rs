//! The Prometheus endpoint, an HTTP/1.1 server (hyper): `GET` and `HEAD` of `/metrics` (text format
//! 0.0.4; the protobuf format with native histograms, or OpenMetrics text with exemplars, when the
//! scraper asks for it; gzip when it accepts gzip) and of [`HEALTH_PATH`]; keep-alive. Rendered per request from the ingest thread's
//! latest [`Snapshot`], off that thread.

use std::convert::Infallible;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flate2::Compression;
use flate2::write::GzEncoder;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

use crate::export::metrics::{self, Exposition, Family};

/// Answers 200 while the ingest thread publishes snapshots (every second), 503 once the latest is
/// older than [`STALE_AFTER`]: for liveness probes and load balancers.
pub const HEALTH_PATH: &str = "/healthz";
const STALE_AFTER: Duration = Duration::from_secs(30);
/// A connection sending no complete request header for this long is closed (an idle keep-alive
/// one too): a silent client holds no connection.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// After this long a connection finishes the request in progress and closes (the scraper opens a
/// new one), within [`GRACE`]: a client that stops reading a response holds no connection.
const LIFETIME: Duration = Duration::from_secs(60);
const GRACE: Duration = Duration::from_secs(10);
/// Connections served at once; further ones wait in the listen backlog.
const MAX_CONNECTIONS: usize = 64;

const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PROTOBUF: &str =
    "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited";

/// The ingest thread's latest metric families and when it built them.
pub struct Snapshot {
    pub families: Vec<Family>,
    pub at: Instant,
}

impl Snapshot {
    pub fn new(families: Vec<Family>) -> Snapshot {
        Snapshot {
            families,
            at: Instant::now(),
        }
    }
}

impl Default for Snapshot {
    fn default() -> Snapshot {
        Snapshot::new(Vec::new())
    }
}

/// Serves `listener` until the task is dropped, the families and buckets `how` says.
pub async fn serve(
    listener: TcpListener,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    how: Exposition,
) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let snapshots = snapshots.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<_>| {
                let snapshot = snapshots.borrow().clone();
                let response = respond(
                    req.method(),
                    req.uri().path(),
                    req.headers(),
                    &snapshot,
                    &how,
                );
                async move { Ok::<_, Infallible>(response) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = tokio::time::sleep(LIFETIME) => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(GRACE, conn).await;
                }
            }
            drop(permit);
        });
    }
}

fn respond(
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    snapshot: &Snapshot,
    how: &Exposition,
) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "GET or HEAD\n");
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match path {
        "/metrics" => {
            let (body, content_type) = if wants_protobuf(headers) {
                let body = metrics::render_protobuf(&snapshot.families, how);
                (body, PROTOBUF)
            } else if wants_openmetrics(headers) {
                let text = metrics::render_openmetrics(&snapshot.families, how);
                (text.into_bytes(), OPENMETRICS)
            } else {
                let text = metrics::render_prometheus(&snapshot.families, how);
                (text.into_bytes(), TEXT)
            };
            let gzip = accepts_gzip(headers);
            let body = if gzip { gzipped(&body) } else { body };
            let mut r = Response::new(Full::new(Bytes::from(body)));
            let h = r.headers_mut();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            h.insert(
                header::VARY,
                HeaderValue::from_static("Accept, Accept-Encoding"),
            );
            if gzip {
                h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
            }
            r
        }
        HEALTH_PATH => {
            let age = snapshot.at.elapsed();
            if age < STALE_AFTER {
                plain(StatusCode::OK, "ok\n")
            } else {
                let why = format!("ingest stalled: last snapshot {} s ago\n", age.as_secs());
                plain(StatusCode::SERVICE_UNAVAILABLE, &why)
            }
        }
        _ => plain(StatusCode::NOT_FOUND, "not found: /metrics or /healthz\n"),
    }
}

fn plain(status: StatusCode, text: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(text.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Whether the scraper lists Prometheus' protobuf format (it does when native histograms are on).
fn wants_protobuf(headers: &HeaderMap) -> bool {
    headers.get_all(header::ACCEPT).iter().any(|v| {
        let v = v.to_str().unwrap_or("");
        v.contains("application/vnd.google.protobuf")
            && v.contains("proto=io.prometheus.client.MetricFamily")
            && v.contains("encoding=delimited")
    })
}

/// Whether the scraper lists OpenMetrics text with a non-zero weight (Prometheus does, first, unless
/// it asks for protobuf): the text format that carries exemplars.
fn wants_openmetrics(headers: &HeaderMap) -> bool {
    listed(headers, header::ACCEPT, "application/openmetrics-text")
}

/// Whether `Accept-Encoding` lists gzip with a non-zero weight.
fn accepts_gzip(headers: &HeaderMap) -> bool {
    listed(headers, header::ACCEPT_ENCODING, "gzip")
}

/// Whether a `header` lists `name` (a media type or a coding) with a non-zero weight.
fn listed(headers: &HeaderMap, header: header::HeaderName, name: &str) -> bool {
    let items = headers.get_all(header).iter();
    items
        .flat_map(|v| v.to_str().unwrap_or("").split(','))
        .any(|item| {
            let mut parts = item.split(';').map(str::trim);
            let first = parts.next().unwrap_or("");
            let q = parts
                .find_map(|p| p.strip_prefix("q="))
                .map_or(1.0, |q| q.parse::<f64>().unwrap_or(0.0));
            first.eq_ignore_ascii_case(name) && q > 0.0
        })
}

fn gzipped(body: &[u8]) -> Vec<u8> {
    let mut gz = GzEncoder::new(Vec::with_capacity(body.len() / 8), Compression::fast());
    gz.write_all(body).expect("writing to a Vec");
    gz.finish().expect("writing to a Vec")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(header::HeaderName, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (k.clone(), HeaderValue::from_static(v)))
            .collect()
    }

    #[test]
    fn gzip_only_when_accepted() {
        let yes = ["gzip", "br, gzip;q=0.5", "GZIP", "identity, gzip"];
        for v in yes {
            assert!(
                accepts_gzip(&headers(&[(header::ACCEPT_ENCODING, v)])),
                "{v}"
            );
        }
        for v in ["identity", "gzip;q=0", "br", "xgzip"] {
            assert!(
                !accepts_gzip(&headers(&[(header::ACCEPT_ENCODING, v)])),
                "{v}"
            );
        }
        assert!(!accepts_gzip(&HeaderMap::new()));
    }

    /// Prometheus' own Accept headers: OpenMetrics by default, protobuf with native histograms;
    /// a client naming neither gets the text format.
    #[test]
    fn the_format_is_the_one_the_scraper_asks_for() {
        let content_type = |accept: &'static str| {
            let r = respond(
                &Method::GET,
                "/metrics",
                &headers(&[(header::ACCEPT, accept)]),
                &Snapshot::default(),
                &Exposition::FULL,
            );
            r.headers()[header::CONTENT_TYPE]
                .to_str()
                .unwrap()
                .to_string()
        };
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                          version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(content_type(prometheus), OPENMETRICS);
        let native = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;\
                      encoding=delimited;q=0.6,application/openmetrics-text;version=1.0.0;q=0.5";
        assert_eq!(content_type(native), PROTOBUF);
        for accept in ["*/*", "text/plain", "application/openmetrics-text;q=0"] {
            assert_eq!(content_type(accept), TEXT, "{accept}");
        }
    }

    #[test]
    fn health_turns_503_when_snapshots_stop() {
        let fresh = Snapshot::default();
        let r = respond(
            &Method::GET,
            HEALTH_PATH,
            &HeaderMap::new(),
            &fresh,
            &Exposition::FULL,
        );
        assert_eq!(r.status(), StatusCode::OK);
        let Some(at) = Instant::now().checked_sub(STALE_AFTER + Duration::from_secs(1)) else {
            return; // a machine up for less than that
        };
        let stale = Snapshot {
            families: Vec::new(),
            at,
        };
        let r = respond(
            &Method::GET,
            HEALTH_PATH,
            &HeaderMap::new(),
            &stale,
            &Exposition::FULL,
        );
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let r = respond(
            &Method::POST,
            "/metrics",
            &HeaderMap::new(),
            &fresh,
            &Exposition::FULL,
        );
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    }
}
