//! The daemon's configuration: built-in defaults, then the OpenTelemetry SDKs' `OTEL_*` variables
//! (for `[otlp]`), then the TOML file, then `NCCLSCOPE_*` environment variables, then command-line
//! flags. Every layer is checked against the same schema (unknown keys
//! are errors) and [`Config::validate`] checks what spans several keys; errors name the bad key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ncclscope_proto::env;
use serde::{Deserialize, Serialize};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};

/// Where the daemon looks for its configuration file when none is given.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/ncclscope/ncclscope.toml";
/// Prefix of the environment variables that override keys: `NCCLSCOPE_<SECTION>_<KEY>`.
pub const ENV_PREFIX: &str = "NCCLSCOPE_";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Unix socket where plugins register their segments (the plugin's `NCCLSCOPE_SOCKET`).
    pub socket: PathBuf,
    /// Per-segment state (string table, communicators, calibration, already-exported operations) that
    /// lets a restarted daemon resume a segment. On tmpfs: no segment outlives a reboot either.
    pub state_dir: PathBuf,
    /// Unix socket of the gRPC query API (`ncclscope top|stats|export`).
    pub api_socket: PathBuf,
    /// Deadline for draining and flushing on SIGTERM, in milliseconds.
    pub shutdown_timeout_ms: u64,
    pub drain: Drain,
    pub aggregate: Aggregate,
    pub otlp: Otlp,
    pub prometheus: Prometheus,
    pub spool: SpoolConfig,
    pub limits: Limits,
    /// Test harnesses only, never a key: this daemon's clock offset in ns, as a simulated node's clock
    /// differs from its neighbours'. From `NCCLSCOPE_TEST_CLOCK_OFFSET_NS` (see
    /// [`ncclscope_proto::TEST_CLOCK_OFFSET`]), or set per node by `demo`, whose daemons share one
    /// process.
    #[serde(skip)]
    pub test_clock_offset_ns: i64,
}

/// What one process's records can make the daemon hold, per segment: a record beyond a limit is
/// refused and counted (`ncclscope_lost_total{stage="..._limit"}`), so a hostile or broken process
/// bounds its own telemetry, not the daemon's memory or other processes' ingest. The defaults are far
/// above what NCCL produces (a few communicators, strings and devices per process).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Communicators known at once (finalized ones are forgotten once committed, to make room).
    pub max_comms: usize,
    /// Highest string id accepted (the plugin numbers its strings densely from 1).
    pub max_strings: usize,
    /// Device-function names (device-hook path).
    pub max_func_names: usize,
    /// Calibrated GPUs.
    pub max_devices: usize,
    /// Device-hook work items held while their operation's host event has not been read, in all.
    pub max_early_works: usize,
    /// Per-rank statistics series, across all processes (stats API, skew, stragglers).
    pub max_rank_series: usize,
    /// Statistics series, and rank series, of one job (within `aggregate.max_series` and
    /// `max_rank_series`): a job that keeps creating series fills its own share only.
    pub max_job_series: usize,
    /// Dictionary entries (communicators, strings, device-function names, devices) held by all the
    /// segments of one uid together.
    pub uid_max_dictionary: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_comms: 1024,
            max_strings: 4096,
            max_func_names: 4096,
            max_devices: 64,
            max_early_works: 65_536,
            max_rank_series: 4096,
            max_job_series: 1024,
            uid_max_dictionary: 65_536,
        }
    }
}

/// The per-job spool behind `ncclscope export`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpoolConfig {
    /// Directory; empty disables the spool (and `export` from it).
    pub dir: PathBuf,
    /// Bytes the spool may hold in all; past it the oldest file of the uid holding the most goes.
    pub max_bytes: u64,
    /// Bytes one uid's jobs may hold; past it that uid's oldest files go first. Past `max_bytes` the
    /// oldest file of the uid holding the most goes, so no user's jobs can push out another's share.
    pub max_bytes_per_uid: u64,
    /// Files older than this many hours are deleted.
    pub max_age_hours: u64,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            dir: PathBuf::from("/var/lib/ncclscope/spool"),
            max_bytes: 1 << 30,
            max_bytes_per_uid: 256 << 20,
            max_age_hours: 7 * 24,
        }
    }
}

/// How segments are drained: one shared ticker over all segments, adaptive between the two intervals.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Drain {
    /// The ticker's shortest interval, while segments have records waiting.
    pub min_interval_ms: u64,
    /// The ticker's longest interval, when every segment is idle.
    pub max_interval_ms: u64,
    /// Records read from one segment per tick, so one busy process cannot starve the others.
    pub batch_records: usize,
    /// Segments attached at once; registrations beyond it are refused.
    pub max_segments: usize,
    /// Segments of one uid attached at once, so that one user cannot take every slot of
    /// `max_segments`; that uid's registrations beyond it are refused (counted as
    /// `ncclscope_lost_total{stage="uid_segment_quota"}`).
    pub max_segments_per_uid: usize,
}

/// Collective instances: when an operation is given up, how the node's ranks are awaited for the
/// skew, and the statistics' series.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Aggregate {
    /// An operation that has made no progress for this long is completed with what it has (counted).
    pub op_timeout_ms: u64,
    /// Operations in flight per process; a process beyond it has its oldest completed as incomplete.
    pub max_pending_ops: usize,
    /// How long the ranks of one collective on this node are awaited for the skew/straggler computation.
    pub skew_window_ms: u64,
    /// Metric series (job, communicator, collective, size bucket); beyond it new series fold into "other".
    pub max_series: usize,
    /// Width of the rolling window behind p50/p99 in the stats API, in seconds.
    pub rolling_window_s: u64,
}

/// OTLP/gRPC export of spans and metrics to a collector (or Tempo, or any OTLP receiver).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Otlp {
    /// OTLP/gRPC endpoint such as `http://127.0.0.1:4317`; empty disables OTLP export.
    pub endpoint: String,
    /// Fraction of collective instances exported as spans, decided from (commHash, seq) so that every
    /// rank on every node keeps the same ones. Metrics are never sampled.
    pub sample_ratio: f64,
    /// Also keep every instance slower than this factor times its series' rolling p50 (0 disables).
    pub slow_factor: f64,
    /// Emit one child span per channel under each rank's span.
    pub channel_spans: bool,
    /// Spans waiting for export; beyond it new spans are dropped and counted.
    pub queue_spans: usize,
    /// Spans per export request.
    pub batch_spans: usize,
    /// A batch not full is sent after this long.
    pub batch_timeout_ms: u64,
    /// Attempts per batch (with exponential backoff) before the batch is dropped and counted.
    pub max_attempts: u32,
    /// Bounds connecting, the TLS handshake and each request (sent as `grpc-timeout`); a connection
    /// that answers no HTTP/2 PING within it while requests are open is closed.
    pub request_timeout_ms: u64,
    /// Period of the OTLP metrics export, in milliseconds.
    pub metrics_interval_ms: u64,
    /// gRPC metadata sent with every export, `key=value,key=value` as OTEL_EXPORTER_OTLP_HEADERS
    /// writes it (values percent-decoded): a tenant (`X-Scope-OrgID`), an `Authorization` token.
    pub headers: String,
    /// `none` or `gzip`.
    pub compression: String,
    /// PEM file of the CA(s) that sign the receiver's certificate (https only); empty: the system's
    /// trust store.
    pub ca_file: PathBuf,
    /// PEM client certificate, for a receiver that asks for one (mutual TLS); with `key_file`.
    pub cert_file: PathBuf,
    /// PEM private key of `cert_file`.
    pub key_file: PathBuf,
    /// `service.name` of the exported resource; empty: `service.name` from `resource_attributes`,
    /// else `ncclscope`.
    pub service_name: String,
    /// More resource attributes, `key=value,...` as OTEL_RESOURCE_ATTRIBUTES writes them; they
    /// override the daemon's own (`host.name`, `service.instance.id`) except `service.name`.
    pub resource_attributes: String,
}

impl Otlp {
    /// Headers, compression, resource attributes and the TLS files: each is checked here so that a
    /// mistake stops the daemon at start, naming the key, rather than failing every export.
    fn validate_transport(&self) -> Result<(), ConfigError> {
        metadata(&self.headers).map_err(|e| err("otlp.headers", e))?;
        key_values(&self.resource_attributes).map_err(|e| err("otlp.resource_attributes", e))?;
        if !["none", "gzip"].contains(&self.compression.as_str()) {
            return Err(err(
                "otlp.compression",
                format!("{:?} is neither \"none\" nor \"gzip\"", self.compression),
            ));
        }
        let files = [
            ("otlp.ca_file", &self.ca_file, "CERTIFICATE-----"),
            ("otlp.cert_file", &self.cert_file, "CERTIFICATE-----"),
            ("otlp.key_file", &self.key_file, "PRIVATE KEY-----"),
        ];
        let set = |p: &PathBuf| !p.as_os_str().is_empty();
        if set(&self.cert_file) != set(&self.key_file) {
            return Err(err(
                "otlp.cert_file",
                "otlp.cert_file and otlp.key_file go together (a client certificate and its key)",
            ));
        }
        let https = self.endpoint.starts_with("https://");
        for (key, path, pem) in files.into_iter().filter(|f| set(f.1)) {
            if !https {
                return Err(err(
                    key,
                    "is set, but otlp.endpoint is not https:// (TLS files apply to https only)",
                ));
            }
            let text = std::fs::read_to_string(path)
                .map_err(|e| err(key, format!("{}: {e}", path.display())))?;
            if !text.contains("-----BEGIN ") || !text.contains(pem) {
                return Err(err(
                    key,
                    format!(
                        "{}: no PEM {} in it",
                        path.display(),
                        pem.trim_end_matches('-')
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The Prometheus endpoint (`/metrics`, and `/healthz` for probes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Prometheus {
    /// Address of the Prometheus endpoint (`/metrics`, `/healthz`); empty disables it. Localhost by
    /// default: `0.0.0.0:9464` for a Prometheus on another host (with `remote_scrapers` under
    /// systemd).
    pub listen: String,
    /// Addresses or networks (`10.0.0.5`, `10.1.0.0/16`, comma-separated) of Prometheus servers on
    /// other hosts that scrape `listen`. The packaged unit lets only localhost through its address
    /// filter (`IPAddressDeny=any`); `ncclscope systemd-dropin` writes the drop-in that lets these,
    /// and `otlp.endpoint`'s host, through.
    pub remote_scrapers: String,
    /// Also serve per-job series (job id, uid, communicator, rank). Off by default: every local user
    /// can read a localhost port, so it would show every user's jobs to every user. Per-job metrics
    /// always go to the OTLP collector, and each user sees their own through the API.
    pub job_series: bool,
    /// Classic histogram buckets per doubling of the exec-time and bus-bandwidth histograms: 1, 2,
    /// 4 or 8 (all the daemon keeps). Each costs a sample per series and scrape; Prometheus
    /// scraping native histograms (protobuf) gets the fine resolution whatever this is.
    pub classic_buckets_per_doubling: u32,
    /// Classic buckets of the per-rank skew histograms too (one per job, communicator and rank);
    /// without, the text formats serve their sum and count (the mean), protobuf the native one.
    pub rank_classic_buckets: bool,
}

impl Prometheus {
    /// `remote_scrapers` as a list, each an address or a network (`ADDR/PREFIX`), as systemd's
    /// `IPAddressAllow=` takes them.
    pub fn remote_scrapers(&self) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        for entry in self
            .remote_scrapers
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
        {
            let (addr, prefix) = entry.split_once('/').unwrap_or((entry, ""));
            let ip: std::net::IpAddr = addr
                .parse()
                .map_err(|_| format!("{entry:?} is not an IP address or ADDR/PREFIX network"))?;
            let bits = if ip.is_ipv4() { 32 } else { 128 };
            if !prefix.is_empty() && !prefix.parse::<u8>().is_ok_and(|p| p <= bits) {
                return Err(format!("{entry:?}: the prefix length must be 0 to {bits}"));
            }
            out.push(entry.to_string());
        }
        Ok(out)
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            socket: PathBuf::from(ncclscope_proto::DEFAULT_SOCKET),
            state_dir: PathBuf::from("/run/ncclscope/state"),
            api_socket: PathBuf::from(ncclscope_proto::DEFAULT_API_SOCKET),
            shutdown_timeout_ms: 5000,
            drain: Drain::default(),
            aggregate: Aggregate::default(),
            otlp: Otlp::default(),
            prometheus: Prometheus::default(),
            spool: SpoolConfig::default(),
            limits: Limits::default(),
            test_clock_offset_ns: 0,
        }
    }
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            min_interval_ms: 1,
            max_interval_ms: 10,
            batch_records: 8192,
            max_segments: 1024,
            max_segments_per_uid: 64,
        }
    }
}

impl Default for Aggregate {
    fn default() -> Self {
        Aggregate {
            op_timeout_ms: 10_000,
            max_pending_ops: 16_384,
            skew_window_ms: 2000,
            max_series: 4096,
            rolling_window_s: 60,
        }
    }
}

impl Default for Otlp {
    fn default() -> Self {
        Otlp {
            endpoint: String::new(),
            sample_ratio: 1.0,
            slow_factor: 4.0,
            channel_spans: false,
            queue_spans: 65_536,
            batch_spans: 1024,
            batch_timeout_ms: 200,
            max_attempts: 5,
            request_timeout_ms: 5000,
            metrics_interval_ms: 10_000,
            headers: String::new(),
            compression: "none".into(),
            ca_file: PathBuf::new(),
            cert_file: PathBuf::new(),
            key_file: PathBuf::new(),
            service_name: String::new(),
            resource_attributes: String::new(),
        }
    }
}

impl Default for Prometheus {
    fn default() -> Self {
        Prometheus {
            listen: "127.0.0.1:9464".into(),
            remote_scrapers: String::new(),
            job_series: false,
            classic_buckets_per_doubling: 1,
            rank_classic_buckets: false,
        }
    }
}

/// A configuration error that names the key (or file, or variable) at fault.
#[derive(Debug, thiserror::Error)]
#[error("{origin}: {message}")]
pub struct ConfigError {
    pub origin: String,
    pub message: String,
}

fn err(origin: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        origin: origin.into(),
        message: message.into(),
    }
}

/// Values given on the command line; `None` leaves the lower layers alone.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub socket: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub api_socket: Option<PathBuf>,
    pub spool_dir: Option<PathBuf>,
    pub otlp_endpoint: Option<String>,
    pub prometheus_listen: Option<String>,
    pub sample_ratio: Option<f64>,
}

impl Config {
    /// Loads the layers. `file` given explicitly must exist; the default path may be absent.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &Overrides,
    ) -> Result<Config, ConfigError> {
        let mut table =
            toml::Table::try_from(Config::default()).map_err(|e| err("defaults", e.to_string()))?;
        let env: Vec<(String, String)> = env.into_iter().collect();
        merge(&mut table, otel_env(&env)?);
        let path = file.unwrap_or(Path::new(DEFAULT_CONFIG_PATH));
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let from_file: toml::Table = text
                    .parse()
                    .map_err(|e: toml::de::Error| err(path.display().to_string(), e.to_string()))?;
                // Deserialize the file alone first so that unknown keys are reported against it.
                Config::deserialize(toml::Value::Table(from_file.clone()))
                    .map_err(|e| err(path.display().to_string(), e.to_string()))?;
                merge(&mut table, from_file);
            }
            Err(e) if file.is_none() && e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(path.display().to_string(), e.to_string())),
        }
        let clock_offset = ncclscope_proto::parse_clock_offset(
            env.iter()
                .find(|(name, _)| name == ncclscope_proto::TEST_CLOCK_OFFSET)
                .map(|(_, v)| v.as_str()),
        )
        .map_err(|e| err(ncclscope_proto::TEST_CLOCK_OFFSET, e))?;
        apply_env(&mut table, env)?;
        let mut config = Config::deserialize(toml::Value::Table(table))
            .map_err(|e| err("configuration", e.to_string()))?;
        config.test_clock_offset_ns = clock_offset;
        let f = flags.clone();
        if let Some(v) = f.socket {
            config.socket = v;
        }
        if let Some(v) = f.state_dir {
            config.state_dir = v;
        }
        if let Some(v) = f.api_socket {
            config.api_socket = v;
        }
        if let Some(v) = f.spool_dir {
            config.spool.dir = v;
        }
        if let Some(v) = f.otlp_endpoint {
            config.otlp.endpoint = v;
        }
        if let Some(v) = f.prometheus_listen {
            config.prometheus.listen = v;
        }
        if let Some(v) = f.sample_ratio {
            config.otlp.sample_ratio = v;
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and relations between keys.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // Every count, size and duration: at least 1 and at most a bound far above any real node's
        // need, so that no accepted value overflows the arithmetic done with it (a queue allocated
        // whole, hours turned into seconds, milliseconds into nanoseconds).
        const MINUTE_MS: u64 = 60_000;
        const HOUR_MS: u64 = 60 * MINUTE_MS;
        let bounded = [
            (
                "drain.min_interval_ms",
                self.drain.min_interval_ms,
                MINUTE_MS,
            ),
            (
                "drain.max_interval_ms",
                self.drain.max_interval_ms,
                MINUTE_MS,
            ),
            (
                "drain.batch_records",
                self.drain.batch_records as u64,
                1 << 24,
            ),
            (
                "drain.max_segments",
                self.drain.max_segments as u64,
                1 << 16,
            ),
            (
                "drain.max_segments_per_uid",
                self.drain.max_segments_per_uid as u64,
                1 << 16,
            ),
            (
                "aggregate.op_timeout_ms",
                self.aggregate.op_timeout_ms,
                HOUR_MS,
            ),
            (
                "aggregate.max_pending_ops",
                self.aggregate.max_pending_ops as u64,
                1 << 24,
            ),
            (
                "aggregate.max_series",
                self.aggregate.max_series as u64,
                1 << 24,
            ),
            (
                "aggregate.rolling_window_s",
                self.aggregate.rolling_window_s,
                86_400,
            ),
            ("otlp.queue_spans", self.otlp.queue_spans as u64, 1 << 24),
            ("otlp.batch_spans", self.otlp.batch_spans as u64, 1 << 16),
            (
                "otlp.batch_timeout_ms",
                self.otlp.batch_timeout_ms,
                MINUTE_MS,
            ),
            ("otlp.max_attempts", self.otlp.max_attempts as u64, 100),
            (
                "otlp.request_timeout_ms",
                self.otlp.request_timeout_ms,
                10 * MINUTE_MS,
            ),
            (
                "otlp.metrics_interval_ms",
                self.otlp.metrics_interval_ms,
                HOUR_MS,
            ),
            (
                "shutdown_timeout_ms",
                self.shutdown_timeout_ms,
                10 * MINUTE_MS,
            ),
            ("spool.max_bytes", self.spool.max_bytes, 1 << 50),
            (
                "spool.max_bytes_per_uid",
                self.spool.max_bytes_per_uid,
                1 << 50,
            ),
            (
                "spool.max_age_hours",
                self.spool.max_age_hours,
                10 * 366 * 24,
            ),
            ("limits.max_comms", self.limits.max_comms as u64, 1 << 20),
            (
                "limits.max_strings",
                self.limits.max_strings as u64,
                u16::MAX as u64,
            ),
            (
                "limits.max_func_names",
                self.limits.max_func_names as u64,
                1 << 20,
            ),
            (
                "limits.max_devices",
                self.limits.max_devices as u64,
                1 << 12,
            ),
            (
                "limits.max_early_works",
                self.limits.max_early_works as u64,
                1 << 24,
            ),
            (
                "limits.max_rank_series",
                self.limits.max_rank_series as u64,
                1 << 24,
            ),
            (
                "limits.max_job_series",
                self.limits.max_job_series as u64,
                1 << 24,
            ),
            (
                "limits.uid_max_dictionary",
                self.limits.uid_max_dictionary as u64,
                1 << 24,
            ),
        ];
        for (key, v, max) in bounded {
            if !(1..=max).contains(&v) {
                return Err(err(key, format!("must be between 1 and {max}")));
            }
        }
        if ![1, 2, 4, 8].contains(&self.prometheus.classic_buckets_per_doubling) {
            return Err(err(
                "prometheus.classic_buckets_per_doubling",
                "must be 1, 2, 4 or 8",
            ));
        }
        if self.aggregate.skew_window_ms > HOUR_MS {
            return Err(err(
                "aggregate.skew_window_ms",
                format!("must be at most {HOUR_MS}"),
            ));
        }
        if self.drain.max_interval_ms < self.drain.min_interval_ms {
            return Err(err(
                "drain.max_interval_ms",
                "must be >= drain.min_interval_ms",
            ));
        }
        if self.drain.max_segments_per_uid > self.drain.max_segments {
            return Err(err(
                "drain.max_segments_per_uid",
                "must be <= drain.max_segments",
            ));
        }
        if self.spool.max_bytes_per_uid > self.spool.max_bytes {
            return Err(err("spool.max_bytes_per_uid", "must be <= spool.max_bytes"));
        }
        if self.otlp.batch_spans > self.otlp.queue_spans {
            return Err(err("otlp.batch_spans", "must be <= otlp.queue_spans"));
        }
        if !(0.0..=1.0).contains(&self.otlp.sample_ratio) {
            return Err(err(
                "otlp.sample_ratio",
                format!("{} is not in [0, 1]", self.otlp.sample_ratio),
            ));
        }
        if !(self.otlp.slow_factor == 0.0 || self.otlp.slow_factor >= 1.0) {
            return Err(err("otlp.slow_factor", "must be 0 (off) or >= 1"));
        }
        if !self.otlp.endpoint.is_empty() {
            let ok = (self.otlp.endpoint.starts_with("http://")
                || self.otlp.endpoint.starts_with("https://"))
                && self.otlp.endpoint.parse::<tonic::transport::Uri>().is_ok();
            if !ok {
                return Err(err(
                    "otlp.endpoint",
                    format!("{:?} is not an http(s):// URL", self.otlp.endpoint),
                ));
            }
        }
        self.otlp.validate_transport()?;
        if !self.prometheus.listen.is_empty()
            && self.prometheus.listen.parse::<SocketAddr>().is_err()
        {
            return Err(err(
                "prometheus.listen",
                format!("{:?} is not an address:port", self.prometheus.listen),
            ));
        }
        let scrapers = (self.prometheus.remote_scrapers())
            .map_err(|e| err("prometheus.remote_scrapers", e))?;
        let loopback =
            (self.prometheus.listen.parse::<SocketAddr>()).map_or(true, |a| a.ip().is_loopback());
        if !scrapers.is_empty() && loopback {
            return Err(err(
                "prometheus.remote_scrapers",
                format!(
                    "is set, but prometheus.listen {:?} is not reachable from another host (e.g. 0.0.0.0:9464)",
                    self.prometheus.listen
                ),
            ));
        }
        if self.socket.as_os_str().is_empty() {
            return Err(err("socket", "must not be empty"));
        }
        if self.api_socket.as_os_str().is_empty() || self.api_socket == self.socket {
            return Err(err("api_socket", "must be set and differ from socket"));
        }
        if self.state_dir.as_os_str().is_empty() {
            return Err(err("state_dir", "must not be empty"));
        }
        Ok(())
    }

    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown_timeout_ms)
    }
}

/// Overlays `top` onto `base`, key by key, recursing into tables.
fn merge(base: &mut toml::Table, top: toml::Table) {
    for (k, v) in top {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => merge(b, t),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// The OpenTelemetry SDKs' variables and the `[otlp]` keys they set: the lowest layer above the
/// defaults, so that a node-wide OTEL_* environment (a container image, a Kubernetes pod spec) is
/// honoured and the daemon's own configuration still wins. `OTEL_EXPORTER_OTLP_<X>` is read as
/// `OTEL_EXPORTER_OTLP_TRACES_<X>` or `..._METRICS_<X>` when one is set (traces and metrics share one
/// connection here, so the two must agree); an empty variable counts as unset, as the specification
/// says.
const OTEL_EXPORTER: [(&str, &str); 7] = [
    ("ENDPOINT", "endpoint"),
    ("HEADERS", "headers"),
    ("COMPRESSION", "compression"),
    ("TIMEOUT", "request_timeout_ms"),
    ("CERTIFICATE", "ca_file"),
    ("CLIENT_CERTIFICATE", "cert_file"),
    ("CLIENT_KEY", "key_file"),
];
const OTEL_RESOURCE: [(&str, &str); 2] = [
    ("OTEL_SERVICE_NAME", "service_name"),
    ("OTEL_RESOURCE_ATTRIBUTES", "resource_attributes"),
];

/// Every OpenTelemetry variable read and the `[otlp]` key it sets (the configuration reference).
pub fn otel_variables() -> Vec<(String, &'static str)> {
    let exporter = OTEL_EXPORTER
        .iter()
        .map(|(setting, key)| (format!("OTEL_EXPORTER_OTLP_{setting}"), *key));
    let resource = OTEL_RESOURCE
        .iter()
        .map(|(var, key)| (var.to_string(), *key));
    exporter.chain(resource).collect()
}

/// The `[otlp]` table the OTEL_* variables in `env` make (see [`OTEL_EXPORTER`]).
fn otel_env(env: &[(String, String)]) -> Result<toml::Table, ConfigError> {
    let get = |name: &str| {
        env.iter()
            .find(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.as_str())
    };
    let mut otlp = toml::Table::new();
    for (setting, key) in OTEL_EXPORTER.iter().chain(&[("PROTOCOL", "")]) {
        let [traces, metrics, generic] =
            ["TRACES_", "METRICS_", ""].map(|s| format!("OTEL_EXPORTER_OTLP_{s}{setting}"));
        let (var, value) = match (get(&traces), get(&metrics)) {
            (Some(t), Some(m)) if t != m => {
                return Err(err(
                    traces,
                    format!(
                        "differs from {metrics}: ncclscope sends traces and metrics to one receiver"
                    ),
                ));
            }
            (Some(v), _) => (traces, v),
            (None, Some(v)) => (metrics, v),
            (None, None) => match get(&generic) {
                Some(v) => (generic, v),
                None => continue,
            },
        };
        let value = match *key {
            "" if value == "grpc" => continue,
            "" => {
                return Err(err(
                    var,
                    format!("{value:?}: ncclscope exports OTLP over gRPC only (\"grpc\")"),
                ));
            }
            "request_timeout_ms" => toml::Value::Integer(
                value
                    .parse::<u32>()
                    .map_err(|_| err(&var, format!("{value:?} is not a number of milliseconds")))?
                    .into(),
            ),
            "headers" => {
                metadata(value).map_err(|e| err(&var, e))?;
                toml::Value::String(value.to_string())
            }
            _ => toml::Value::String(value.to_string()),
        };
        otlp.insert(key.to_string(), value);
    }
    for (var, key) in OTEL_RESOURCE {
        if let Some(v) = get(var) {
            if key == "resource_attributes" {
                key_values(v).map_err(|e| err(var, e))?;
            }
            otlp.insert(key.to_string(), toml::Value::String(v.to_string()));
        }
    }
    Ok(toml::Table::from_iter([(
        "otlp".to_string(),
        toml::Value::Table(otlp),
    )]))
}

/// Applies `NCCLSCOPE_<PATH>` variables to the keys they name (`NCCLSCOPE_OTLP_ENDPOINT` ->
/// `otlp.endpoint`). The plugin's and the tools' variables share the prefix and are left alone; any
/// other `NCCLSCOPE_*` name is an error, as an unknown key in the file is: a typo must not leave a
/// setting at its default unnoticed.
fn apply_env(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(), ConfigError> {
    let mut keys = Vec::new();
    leaf_keys(table, &mut Vec::new(), &mut keys);
    let env: Vec<(String, String)> = env.into_iter().collect();
    let key_vars = variables(table);
    let known: Vec<&str> = (key_vars.iter().map(|(var, _)| var.as_str()))
        .chain(env::PLUGIN.iter().chain(env::TOOLS).copied())
        .collect();
    let unknown = env::unknown(env.iter().map(|(name, _)| name.as_str()), &known);
    if !unknown.is_empty() {
        return Err(err(
            "environment",
            format!(
                "unknown {} {}: the daemon reads NCCLSCOPE_<SECTION>_<KEY> for its configuration keys (`ncclscope daemon --help` lists them)",
                if unknown.len() == 1 {
                    "variable"
                } else {
                    "variables"
                },
                env::describe(&unknown)
            ),
        ));
    }
    for (var, raw) in env {
        let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let Some(path) = keys
            .iter()
            .find(|p| p.join("_").to_ascii_uppercase() == rest)
        else {
            continue;
        };
        let (section, key) = path.split_at(path.len() - 1);
        let mut at = &mut *table;
        for s in section {
            at = at
                .get_mut(s)
                .and_then(toml::Value::as_table_mut)
                .expect("leaf_keys walks tables");
        }
        // Typed keys take TOML syntax (numbers, booleans); strings may be given bare.
        let is_string = matches!(at.get(&key[0]), Some(toml::Value::String(_)));
        let value = if is_string {
            toml::Value::String(raw.clone())
        } else {
            let doc: toml::Table = format!("v = {raw}").parse().map_err(|_| {
                err(
                    &var,
                    format!("{raw:?} is not a valid value for {}", path.join(".")),
                )
            })?;
            doc["v"].clone()
        };
        at.insert(key[0].clone(), value);
        Config::deserialize(toml::Value::Table(table.clone()))
            .map_err(|e| err(&var, e.to_string()))?;
    }
    Ok(())
}

/// The variable of every configuration key in `table` (`NCCLSCOPE_OTLP_ENDPOINT` for
/// `otlp.endpoint`) with the key's value there, in the table's order.
pub fn variables(table: &toml::Table) -> Vec<(String, toml::Value)> {
    let mut keys = Vec::new();
    leaf_keys(table, &mut Vec::new(), &mut keys);
    keys.into_iter()
        .map(|path| {
            let (key, sections) = path.split_last().expect("a key has a name");
            let at = sections.iter().fold(table, |t, s| {
                t[s].as_table().expect("leaf_keys walks tables")
            });
            let var = format!("{ENV_PREFIX}{}", path.join("_").to_ascii_uppercase());
            (var, at[key].clone())
        })
        .collect()
}

/// Every configuration key's variable and default, the default as the help shows it (a string
/// unquoted, "" for an empty one).
pub fn default_variables() -> Vec<(String, String)> {
    let defaults = toml::Table::try_from(Config::default()).expect("the defaults serialize");
    variables(&defaults)
        .into_iter()
        .map(|(var, value)| {
            let shown = match value {
                toml::Value::String(s) if s.is_empty() => "\"\"".into(),
                toml::Value::String(s) => s,
                v => v.to_string(),
            };
            (var, shown)
        })
        .collect()
}

/// The variable and default of configuration key `key` ("otlp.endpoint").
pub fn key_default(key: &str) -> (String, String) {
    let var = format!("{ENV_PREFIX}{}", key.replace('.', "_").to_ascii_uppercase());
    default_variables()
        .into_iter()
        .find(|(v, _)| *v == var)
        .unwrap_or_else(|| panic!("{key} is a configuration key"))
}

/// `ncclscope daemon --help`'s list of every configuration key: its variable and default.
pub fn help() -> String {
    let mut out = format!(
        "Configuration: the file ({DEFAULT_CONFIG_PATH} unless --config; every key with its meaning: \
         `ncclscope reference config`), then these variables, then the flags above. An NCCLSCOPE_* variable \
         that is none of these, nor one the plugin or the tools read, is an error.\n\n"
    );
    for (var, default) in default_variables() {
        out.push_str(&format!("  {var:<40} {default}\n"));
    }
    out.push_str(
        "\nBelow the file (the file, these variables and the flags override them), the OpenTelemetry\n\
         SDKs' variables set [otlp] keys: OTEL_EXPORTER_OTLP_{ENDPOINT,HEADERS,COMPRESSION,TIMEOUT,\n\
         CERTIFICATE,CLIENT_CERTIFICATE,CLIENT_KEY} (or their _TRACES_/_METRICS_ forms, which must\n\
         agree), OTEL_EXPORTER_OTLP_PROTOCOL (grpc only), OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES.\n",
    );
    out.push_str(
        "\nAlso read: NCCLSCOPE_LOG, the log filter (tracing's EnvFilter syntax) [default: info].\n\
         Errors print one line and their causes; --debug adds the debug form, with the backtrace\n\
         when RUST_BACKTRACE=1.",
    );
    out
}

fn leaf_keys(table: &toml::Table, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    for (k, v) in table {
        prefix.push(k.clone());
        match v {
            toml::Value::Table(t) => leaf_keys(t, prefix, out),
            _ => out.push(prefix.clone()),
        }
        prefix.pop();
    }
}

/// A `key=value,key=value` list as the OpenTelemetry variables write one (OTEL_EXPORTER_OTLP_HEADERS,
/// OTEL_RESOURCE_ATTRIBUTES): items trimmed, empty items skipped, values percent-decoded. Errors
/// name the item by key or position, never by value (a value may be a credential).
pub fn key_values(list: &str) -> Result<Vec<(String, String)>, String> {
    let items = list.split(',').map(str::trim).filter(|i| !i.is_empty());
    items
        .enumerate()
        .map(|(n, item)| {
            let Some((k, v)) = item.split_once('=') else {
                return Err(format!("item {} is not key=value", n + 1));
            };
            let k = k.trim();
            if k.is_empty() {
                return Err(format!("item {} has no key", n + 1));
            }
            let v = percent_decode(v.trim())
                .ok_or_else(|| format!("{k:?}: the value is not valid percent-encoded UTF-8"))?;
            Ok((k.to_string(), v))
        })
        .collect()
}

fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex = [bytes.next()?, bytes.next()?];
            out.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).ok()
}

/// `otlp.headers` as the gRPC metadata every export carries.
pub fn metadata(headers: &str) -> Result<MetadataMap, String> {
    let mut map = MetadataMap::new();
    for (k, v) in key_values(headers)? {
        let lower = k.to_ascii_lowercase();
        if lower.ends_with("-bin") || lower.starts_with("grpc-") {
            return Err(format!(
                "{k:?}: binary (-bin) and grpc- headers are not supported"
            ));
        }
        let key = MetadataKey::from_bytes(lower.as_bytes())
            .map_err(|_| format!("{k:?} is not a valid header name"))?;
        let value = MetadataValue::try_from(v.as_str())
            .map_err(|_| format!("{k:?}: the value is not printable ASCII"))?;
        map.append(key, value);
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(file: &str, env: &[(&str, &str)], flags: Overrides) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ncclscope.toml");
        std::fs::write(&path, file).unwrap();
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        Config::load(Some(&path), env, &flags)
    }

    #[test]
    fn layers_apply_in_order_file_env_flags() {
        let c = load(
            "state_dir = \"/fromfile\"\n[otlp]\nendpoint = \"http://file:4317\"\nsample_ratio = 0.5\n[drain]\nbatch_records = 100\n",
            &[("NCCLSCOPE_OTLP_SAMPLE_RATIO", "0.25"), ("NCCLSCOPE_DRAIN_MAX_INTERVAL_MS", "20"), ("NCCLSCOPE_JOB_ID", "x")],
            Overrides { otlp_endpoint: Some("http://flag:4317".into()), ..Default::default() },
        )
        .unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/fromfile"));
        assert_eq!(c.otlp.endpoint, "http://flag:4317");
        assert_eq!(c.otlp.sample_ratio, 0.25);
        assert_eq!(c.drain.batch_records, 100);
        assert_eq!(c.drain.max_interval_ms, 20);
        assert_eq!(c.drain.min_interval_ms, Drain::default().min_interval_ms);
    }

    #[test]
    fn errors_name_the_bad_key() {
        let e = load("[otlp]\nendpont = \"x\"\n", &[], Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("endpont"), "{e}");
        let e = load(
            "[drain]\nbatch_records = \"many\"\n",
            &[],
            Overrides::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("batch_records"), "{e}");
        let e = load(
            "",
            &[("NCCLSCOPE_DRAIN_BATCH_RECORDS", "lots")],
            Overrides::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("NCCLSCOPE_DRAIN_BATCH_RECORDS"), "{e}");
        let e = load(
            "[drain]\nmin_interval_ms = 50\nmax_interval_ms = 10\n",
            &[],
            Overrides::default(),
        )
        .unwrap_err();
        assert_eq!(e.origin, "drain.max_interval_ms");
        let e = load(
            "[prometheus]\nclassic_buckets_per_doubling = 3\n",
            &[],
            Overrides::default(),
        )
        .unwrap_err();
        assert_eq!(e.origin, "prometheus.classic_buckets_per_doubling");
        let e = load(
            "[otlp]\nendpoint = \"localhost:4317\"\n",
            &[],
            Overrides::default(),
        )
        .unwrap_err();
        assert_eq!(e.origin, "otlp.endpoint");
        let e = load(
            "",
            &[],
            Overrides {
                sample_ratio: Some(1.5),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert_eq!(e.origin, "otlp.sample_ratio");
        let e = load(
            "[prometheus]\nlisten = \"nowhere\"\n",
            &[],
            Overrides::default(),
        )
        .unwrap_err();
        assert_eq!(e.origin, "prometheus.listen");
    }

    /// Issue 20: a misspelt variable left its key at the default without a word.
    #[test]
    fn unknown_variables_are_errors_naming_the_likely_one() {
        let e = load(
            "",
            &[("NCCLSCOPE_OTLP_ENDPOIT", "http://c:4317")],
            Overrides::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(
                "unknown variable NCCLSCOPE_OTLP_ENDPOIT (did you mean NCCLSCOPE_OTLP_ENDPOINT?)"
            ),
            "{e}"
        );
        // The plugin's, the tools' and the test harnesses' variables are known, not keys.
        let c = load(
            "",
            &[
                ("NCCLSCOPE_RING_MEMORY", "cpu"),
                ("NCCLSCOPE_LOG", "debug"),
                ("NCCLSCOPE_TEST_DAEMON_RANK", "x"),
                ("NCCLSCOPE_API_SOCKET", "/tmp/a.sock"),
            ],
            Overrides::default(),
        )
        .unwrap();
        assert_eq!(c.api_socket, PathBuf::from("/tmp/a.sock"));
    }

    /// Issue 35: a simulated node's clock offset, for the engine; a bad one stops the daemon.
    #[test]
    fn the_test_clock_offset_is_read_and_a_bad_one_is_an_error() {
        let c = load(
            "",
            &[(ncclscope_proto::TEST_CLOCK_OFFSET, "-7000000")],
            Overrides::default(),
        );
        assert_eq!(c.unwrap().test_clock_offset_ns, -7_000_000);
        assert_eq!(
            load("", &[], Overrides::default())
                .unwrap()
                .test_clock_offset_ns,
            0
        );
        let e = load(
            "",
            &[(ncclscope_proto::TEST_CLOCK_OFFSET, "7ms")],
            Overrides::default(),
        )
        .unwrap_err();
        assert_eq!(e.origin, ncclscope_proto::TEST_CLOCK_OFFSET);
        assert!(e.message.contains("\"7ms\""), "{e}");
    }

    /// Values that used to pass and then panic at start, abort at the first span, or wrap and delete
    /// the spool at the next restart are refused at load, naming the key.
    #[test]
    fn values_beyond_sane_bounds_are_refused_before_they_overflow() {
        for (file, key) in [
            (
                "[otlp]\nqueue_spans = 2305843009213693952\n",
                "otlp.queue_spans",
            ),
            (
                "[otlp]\nqueue_spans = 1099511627776\nbatch_spans = 1099511627776\n",
                "otlp.queue_spans",
            ),
            (
                "[spool]\nmax_age_hours = 5124095576030432\n",
                "spool.max_age_hours",
            ),
            (
                "[aggregate]\nop_timeout_ms = 18446744073709551\n",
                "aggregate.op_timeout_ms",
            ),
            (
                "[aggregate]\nskew_window_ms = 18446744073709551\n",
                "aggregate.skew_window_ms",
            ),
            ("[limits]\nmax_strings = 70000\n", "limits.max_strings"),
            ("[drain]\nbatch_records = 0\n", "drain.batch_records"),
        ] {
            let e = load(file, &[], Overrides::default()).unwrap_err();
            assert_eq!(e.origin, key, "{file}: {e}");
        }
    }

    /// Issue 17: the OTEL_* variables set `[otlp]` below the file, NCCLSCOPE_* and the flags.
    #[test]
    fn otel_variables_sit_between_the_defaults_and_the_file() {
        let otel = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4317"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317"),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "X-Scope-OrgID=t1, authorization=Bearer%20abc",
            ),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "7000"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", ""),
            ("OTEL_SERVICE_NAME", "svc"),
            ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod"),
        ];
        let c = load("", &otel, Overrides::default()).unwrap();
        assert_eq!(
            c.otlp.endpoint, "http://traces:4317",
            "the signal's variable first"
        );
        assert_eq!(c.otlp.compression, "gzip");
        assert_eq!(c.otlp.request_timeout_ms, 7000);
        assert_eq!(c.otlp.service_name, "svc");
        assert_eq!(c.otlp.resource_attributes, "deployment.environment=prod");
        assert_eq!(c.otlp.ca_file, PathBuf::new(), "an empty variable is unset");
        let md = metadata(&c.otlp.headers).unwrap();
        assert_eq!(md.get("x-scope-orgid").unwrap(), "t1");
        assert_eq!(md.get("authorization").unwrap(), "Bearer abc");
        // The file beats OTEL_*, NCCLSCOPE_* beats the file, the flag beats them all.
        let file = "[otlp]\nendpoint = \"http://file:4317\"\ncompression = \"none\"\nrequest_timeout_ms = 100\n";
        let c = load(file, &otel, Overrides::default()).unwrap();
        assert_eq!(c.otlp.endpoint, "http://file:4317");
        assert_eq!(
            (c.otlp.compression.as_str(), c.otlp.request_timeout_ms),
            ("none", 100)
        );
        assert_eq!(c.otlp.service_name, "svc", "what the file leaves alone");
        let mut env = otel.to_vec();
        env.push(("NCCLSCOPE_OTLP_ENDPOINT", "http://ncclscope-env:4317"));
        let c = load(file, &env, Overrides::default()).unwrap();
        assert_eq!(c.otlp.endpoint, "http://ncclscope-env:4317");
        let flags = Overrides {
            otlp_endpoint: Some("http://flag:4317".into()),
            ..Default::default()
        };
        assert_eq!(
            load(file, &env, flags).unwrap().otlp.endpoint,
            "http://flag:4317"
        );
    }

    #[test]
    fn bad_otlp_transport_settings_are_one_line_errors_naming_the_key_or_variable() {
        let dir = tempfile::tempdir().unwrap();
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate").unwrap();
        let https = "[otlp]\nendpoint = \"https://c:4317\"\n";
        for (file, env, origin, says) in [
            (
                "[otlp]\nheaders = \"x-scope-orgid\"\n",
                vec![],
                "otlp.headers",
                "item 1 is not key=value",
            ),
            (
                "[otlp]\nheaders = \"bad key=1\"\n",
                vec![],
                "otlp.headers",
                "not a valid header name",
            ),
            (
                "[otlp]\nheaders = \"a=%zz\"\n",
                vec![],
                "otlp.headers",
                "percent-encoded",
            ),
            (
                "",
                vec![("OTEL_EXPORTER_OTLP_HEADERS", "secret-token")],
                "OTEL_EXPORTER_OTLP_HEADERS",
                "not key=value",
            ),
            (
                "",
                vec![("OTEL_EXPORTER_OTLP_TIMEOUT", "5s")],
                "OTEL_EXPORTER_OTLP_TIMEOUT",
                "milliseconds",
            ),
            (
                "",
                vec![("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")],
                "OTEL_EXPORTER_OTLP_PROTOCOL",
                "gRPC only",
            ),
            (
                "",
                vec![
                    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://a:4317"),
                    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://b:4317"),
                ],
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "one receiver",
            ),
            (
                "[otlp]\ncompression = \"zstd\"\n",
                vec![],
                "otlp.compression",
                "gzip",
            ),
            (
                &format!("{https}ca_file = \"/nonexistent/ca.pem\"\n"),
                vec![],
                "otlp.ca_file",
                "No such file",
            ),
            (
                &format!("{https}ca_file = \"{}\"\n", garbage.display()),
                vec![],
                "otlp.ca_file",
                "no PEM CERTIFICATE",
            ),
            (
                &format!("{https}cert_file = \"{}\"\n", garbage.display()),
                vec![],
                "otlp.cert_file",
                "go together",
            ),
            (
                &format!(
                    "[otlp]\nendpoint = \"http://c:4317\"\nca_file = \"{}\"\n",
                    garbage.display()
                ),
                vec![],
                "otlp.ca_file",
                "not https",
            ),
        ] {
            let e = load(file, &env, Overrides::default()).unwrap_err();
            assert_eq!(e.origin, origin, "{file} {env:?}: {e}");
            let text = e.to_string();
            assert!(
                text.contains(says) && !text.contains('\n'),
                "{file} {env:?}: {text}"
            );
            assert!(
                !text.contains("secret-token"),
                "a header's value is never shown: {text}"
            );
        }
    }

    #[test]
    fn an_explicit_file_must_exist_the_default_need_not() {
        let missing = Path::new("/nonexistent/ncclscope.toml");
        let e = Config::load(Some(missing), Vec::new(), &Overrides::default()).unwrap_err();
        assert!(e.origin.contains("/nonexistent/ncclscope.toml"));
    }

    #[test]
    fn remote_scrapers_are_addresses_or_networks_on_a_reachable_listen() {
        let reachable = "[prometheus]\nlisten = \"0.0.0.0:9464\"\n";
        let c = load(
            &format!("{reachable}remote_scrapers = \"10.0.0.5, 10.1.0.0/16,fd00::/8\"\n"),
            &[],
            Overrides::default(),
        )
        .unwrap();
        assert_eq!(
            c.prometheus.remote_scrapers().unwrap(),
            ["10.0.0.5", "10.1.0.0/16", "fd00::/8"]
        );
        for (value, says) in [
            ("prometheus.example", "is not an IP address"),
            ("10.0.0.0/33", "prefix length must be 0 to 32"),
        ] {
            let e = load(
                &format!("{reachable}remote_scrapers = \"{value}\"\n"),
                &[],
                Overrides::default(),
            )
            .unwrap_err();
            assert_eq!(e.origin, "prometheus.remote_scrapers");
            assert!(e.message.contains(says), "{e}");
        }
        let e = load(
            "[prometheus]\nremote_scrapers = \"10.0.0.5\"\n",
            &[],
            Overrides::default(),
        )
        .unwrap_err();
        assert!(e.message.contains("not reachable from another host"), "{e}");
    }

    #[test]
    fn the_shipped_example_is_valid() {
        let text = include_str!("../../deploy/ncclscope.toml");
        let c = load(text, &[], Overrides::default()).unwrap();
        c.validate().unwrap();
        assert_eq!(c, Config::default(), "the example shows the defaults");
    }

    /// Issue 39: the shipped file set every `[otlp]` key, empty, so it overrode the OTEL_* variables
    /// below it: the DaemonSet's OTEL_RESOURCE_ATTRIBUTES (the node's name) and a pod's
    /// OTEL_EXPORTER_OTLP_ENDPOINT were ignored. The example leaves those keys to the variables.
    #[test]
    fn the_shipped_example_leaves_the_otel_variables_their_keys() {
        let text = include_str!("../../deploy/ncclscope.toml");
        let env: Vec<(String, &str)> = otel_variables()
            .into_iter()
            .map(|(var, key)| {
                let value = match key {
                    "endpoint" => "https://collector:4317",
                    "headers" => "X-Scope-OrgID=t",
                    "compression" => "gzip",
                    "request_timeout_ms" => "7000",
                    "ca_file" | "cert_file" | "key_file" => "",
                    _ => "host.name=node-7",
                };
                (var, value)
            })
            .collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let c = load(text, &env, Overrides::default()).unwrap();
        assert_eq!(c.otlp.endpoint, "https://collector:4317");
        assert_eq!(c.otlp.headers, "X-Scope-OrgID=t");
        assert_eq!(c.otlp.compression, "gzip");
        assert_eq!(c.otlp.request_timeout_ms, 7000);
        assert_eq!(c.otlp.service_name, "host.name=node-7");
        assert_eq!(c.otlp.resource_attributes, "host.name=node-7");
    }
}
