//! The daemon as a library: [`start`] binds its sockets and starts ingest, export and the query API;
//! [`Running::stop`] drains, flushes and stops. `ncclscope daemon` and `ncclscope demo` both use it.

use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::engine::{Attach, Engine, Handover, Outputs, SegmentKey};
use crate::export::export_queue::ExportCounters;
use crate::export::otlp;
use crate::export::resend::{self, Dropped};
use crate::export::{metrics, prometheus};
use crate::host::{activation, notify};
use crate::storage::hub::{Durable, Hub};
use crate::storage::spool::{Spool, SpoolLimits};
use crate::{api, register};

/// A started daemon.
pub struct Running {
    stop: Arc<AtomicBool>,
    engine: Option<std::thread::JoinHandle<()>>,
    exporter: Option<JoinHandle<()>>,
    listeners: Vec<JoinHandle<()>>,
    api_shutdown: Option<oneshot::Sender<()>>,
    api: Option<JoinHandle<anyhow::Result<()>>>,
    shutdown_timeout: Duration,
    /// Where the Prometheus endpoint listens (the actual port when the config said port 0).
    pub prometheus_addr: Option<SocketAddr>,
    /// The registration socket this daemon bound (`None`: systemd's, which outlives the daemon).
    pub socket: Option<PathBuf>,
    pub api_socket: PathBuf,
    /// Export outcomes, for callers that want to report them.
    pub export_counters: Arc<ExportCounters>,
}

/// What systemd passed at start: the registration socket, and the segments (with their connections)
/// the previous daemon kept in the file descriptor store.
struct Passed {
    registration: Option<std::os::fd::OwnedFd>,
    segments: Vec<Handover>,
}

impl Passed {
    fn take() -> Passed {
        let mut registration = None;
        let mut stored: std::collections::BTreeMap<String, Vec<std::os::fd::OwnedFd>> =
            Default::default();
        for (name, fd) in activation::take() {
            if name == activation::REGISTRATION_FD_NAME {
                registration = Some(fd);
            } else if let Some(label) = name.strip_prefix(notify::SEGMENT_FD_PREFIX) {
                stored.entry(label.to_string()).or_default().push(fd);
            } else {
                tracing::warn!(name = %name, "unexpected descriptor from systemd; closed");
            }
        }
        let segments = stored
            .into_iter()
            .filter_map(|(label, fds)| match restore(&label, fds) {
                Ok(a) => Some(Handover::Attach(a)),
                Err(e) => {
                    tracing::warn!(segment = %label, error = %e, "stored segment not restored");
                    let _ = notify::notify(
                        &format!(
                            "FDSTOREREMOVE=1\nFDNAME={}",
                            notify::segment_fd_name(&label)
                        ),
                        &[],
                    );
                    None
                }
            })
            .collect();
        Passed {
            registration,
            segments,
        }
    }
}

/// A segment the previous daemon stored under `label`: its memory file, checked again as at
/// registration, and its connection if systemd still holds it (it drops one that hung up: the
/// process ended meanwhile).
fn restore(label: &str, fds: Vec<std::os::fd::OwnedFd>) -> anyhow::Result<Attach> {
    use rustix::fs::FileType;
    let key: SegmentKey = label
        .parse()
        .map_err(|()| anyhow::anyhow!("not a segment key"))?;
    let (mut memfd, mut conn) = (None, None);
    for fd in fds {
        let stat = rustix::fs::fstat(&fd)?;
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::Socket => conn = Some(fd),
            FileType::RegularFile if stat.st_ino == key.inode && stat.st_uid == key.uid => {
                memfd = Some(fd)
            }
            _ => anyhow::bail!("a stored descriptor is neither its memory file nor a socket"),
        }
    }
    let segment = ncclscope_proto::Segment::open(memfd.context("no memory file")?)?;
    Ok(Attach {
        key,
        segment,
        conn,
        reply: None,
    })
}

/// The machine's host name (the resource's `host.name` unless configured). From uname, not
/// /proc/sys: the hardened unit shows the daemon only process entries of /proc.
pub fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// Starts the daemon on the current tokio runtime. Every socket is bound before this returns, so a
/// caller may signal readiness (systemd) or start plugins right after.
pub async fn start(config: Config, hub: Arc<Hub>) -> anyhow::Result<Running> {
    config.validate()?;
    let cfg = Arc::new(config);
    // The resume state names every user's jobs and communicators: the daemon's alone.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&cfg.state_dir)
        .and_then(|()| {
            std::fs::set_permissions(&cfg.state_dir, std::fs::Permissions::from_mode(0o700))
        })
        .with_context(|| format!("creating state_dir {} (mode 0700)", cfg.state_dir.display()))?;
    let (spool, reader): (Option<Box<dyn Durable>>, _) = if cfg.spool.dir.as_os_str().is_empty() {
        (None, None)
    } else {
        let limits = SpoolLimits {
            max_bytes: cfg.spool.max_bytes,
            max_bytes_per_uid: cfg.spool.max_bytes_per_uid,
            max_age: Duration::from_secs(cfg.spool.max_age_hours * 3600),
            ..SpoolLimits::default()
        };
        let spool = Spool::open(&cfg.spool.dir, limits)
            .with_context(|| format!("opening spool.dir {}", cfg.spool.dir.display()))?;
        let reader = spool.reader();
        (Some(Box::new(spool)), Some(reader))
    };
    let passed = Passed::take();
    let socket_activated = passed.registration.is_some();
    let registration = match passed.registration {
        Some(fd) => {
            let listener = std::os::unix::net::UnixListener::from(fd);
            listener.set_nonblocking(true)?;
            tokio::net::UnixListener::from_std(listener)
                .context("the registration socket systemd passed")?
        }
        None => register::bind(&cfg.socket)?,
    };
    let api_listener = api::bind(&cfg.api_socket)?;
    let prometheus_listener = if cfg.prometheus.listen.is_empty() {
        None
    } else {
        let l = tokio::net::TcpListener::bind(&cfg.prometheus.listen)
            .await
            .with_context(|| format!("binding prometheus.listen {}", cfg.prometheus.listen))?;
        Some(l)
    };
    let prometheus_addr = prometheus_listener
        .as_ref()
        .and_then(|l| l.local_addr().ok());
    let host = hostname();
    let resource = otlp::resource_attributes(&cfg.otlp, &host);
    let export_counters = Arc::new(ExportCounters::default());
    let (prom_tx, prom_rx) = watch::channel(Arc::default());
    let mut outputs = Outputs {
        spans: None,
        metrics: None,
        export_counters: export_counters.clone(),
        dropped: None,
        prometheus: prom_tx,
        host_name: otlp::host_name(&cfg.otlp, &host),
    };
    let exporter = if cfg.otlp.endpoint.is_empty() {
        None
    } else {
        let channel = otlp::channel(&cfg.otlp).map_err(anyhow::Error::msg)?;
        let (span_tx, span_rx) = mpsc::channel(cfg.otlp.queue_spans);
        let (metrics_tx, metrics_rx) = mpsc::channel(2);
        // Dropped spans can be re-sent only from a spool. The re-sender ends once the engine's
        // sender is gone, so it never keeps the queue open at shutdown.
        if let Some(reader) = &reader {
            let dropped = Arc::new(Dropped::new(resend::MAX_REMEMBERED));
            tokio::spawn(resend::run(
                dropped.clone(),
                reader.clone(),
                span_tx.downgrade(),
                export_counters.clone(),
            ));
            outputs.dropped = Some(dropped);
        }
        outputs.spans = Some(span_tx);
        outputs.metrics = Some(metrics_tx);
        Some(tokio::spawn(otlp::run(
            cfg.otlp.clone(),
            host,
            channel,
            span_rx,
            metrics_rx,
            export_counters.clone(),
            outputs.dropped.clone(),
        )))
    };
    let (reg_tx, reg_rx) = std::sync::mpsc::channel();
    for restored in passed.segments {
        let _ = reg_tx.send(restored);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let engine = Engine::new(cfg.clone(), hub.clone(), spool, outputs)
        .context("starting the state writer thread")?;
    // Logged before the ingest thread starts, so the segments it restores from systemd's store are
    // logged after it (its sockets are bound: connections queue until they are served).
    tracing::info!(socket = %cfg.socket.display(), api = %cfg.api_socket.display(), otlp = %cfg.otlp.endpoint, prometheus = ?prometheus_addr, "ncclscope daemon started");
    let engine = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("ncclscope-ingest".into())
            .spawn(move || engine.run(reg_rx, stop))?
    };
    let mut listeners = vec![tokio::spawn(register::serve(registration, reg_tx))];
    if let Some(l) = prometheus_listener {
        let how = metrics::Exposition::of(&cfg.prometheus);
        listeners.push(tokio::spawn(prometheus::serve(l, prom_rx, how)));
    }
    let (api_shutdown, api_stop) = oneshot::channel::<()>();
    let service = api::QueryService::new(hub, reader, resource);
    let api = tokio::spawn(api::serve(
        api_listener,
        service,
        api::Timeouts::DAEMON,
        async move {
            let _ = api_stop.await;
        },
    ));
    Ok(Running {
        stop,
        engine: Some(engine),
        exporter,
        listeners,
        api_shutdown: Some(api_shutdown),
        api: Some(api),
        shutdown_timeout: cfg.shutdown_timeout(),
        prometheus_addr,
        socket: (!socket_activated).then(|| cfg.socket.clone()),
        api_socket: cfg.api_socket.clone(),
        export_counters,
    })
}

impl Running {
    /// Stops accepting registrations, drains every segment, commits, flushes the exporter (bounded
    /// by `shutdown_timeout_ms` each), and stops the query API.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        for l in self.listeners.drain(..) {
            l.abort();
        }
        self.stop.store(true, Ordering::Release);
        if let Some(engine) = self.engine.take() {
            tokio::task::spawn_blocking(move || engine.join())
                .await
                .context("joining the ingest thread")?
                .map_err(|_| anyhow::anyhow!("the ingest thread panicked"))?;
        }
        if let Some(exporter) = self.exporter.take()
            && tokio::time::timeout(self.shutdown_timeout, exporter)
                .await
                .is_err()
        {
            tracing::warn!(
                "OTLP flush did not finish within shutdown_timeout_ms; unexported spans stay in the segments"
            );
        }
        if let Some(tx) = self.api_shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(api) = self.api.take() {
            let _ = tokio::time::timeout(self.shutdown_timeout, api).await;
        }
        if let Some(socket) = &self.socket {
            let _ = std::fs::remove_file(socket);
        }
        let _ = std::fs::remove_file(&self.api_socket);
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for l in &self.listeners {
            l.abort();
        }
    }
}
