//! The daemon's gRPC query API (`proto/ncclscope.proto`, service `Query`), served over a Unix socket
//! separate from the plugins' registration socket, and the client side used by `top`, `stats` and
//! `export`.
//!
//! The server reads only the [`Hub`] (snapshots and the live stream) and a [`SpoolReader`] (Export), so
//! it never slows ingest: a slow watcher misses instances (broadcast lag), a slow exporter only holds a
//! file descriptor.
//!
//! Who sees what: the socket is open to every local user (mode 0666), and each call is answered for
//! the caller's uid as the kernel reports it (SO_PEERCRED): a user sees, watches and exports only jobs
//! their own processes ran (a job is (uid, job id)); root sees every uid's.
//!
//! What one user can hold is bounded per uid (root excepted): [`MAX_CONNECTIONS_PER_UID`]
//! connections (more are closed at accept) and [`MAX_STREAMS_PER_UID`] open Watch/Export streams
//! (more are refused with `resource_exhausted`); an Export whose client reads nothing for
//! [`STALLED_CLIENT`] is ended; a connection is closed once it is [`Timeouts::DAEMON`]'s `max_age`
//! old and holds no stream, or if it is silent from the start (one forgotten by its client frees its
//! slot; the tools' clients reconnect). No
//! user can take the daemon's descriptors, threads or memory from the others.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::Context;
use hyper_util::rt::TokioIo;
use ncclscope_proto::api::query_client::QueryClient;
use ncclscope_proto::api::query_server::{Query, QueryServer};
use ncclscope_proto::api::{
    Collective, ExportRequest, ListJobsRequest, ListJobsResponse, ResourceAttribute,
    ResourceRequest, ResourceResponse, StatsRequest, StatsResponse, WatchRequest,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, UdsConnectInfo};
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status};

use crate::host::per_uid::{Held, PerUid};
use crate::storage::hub::Hub;
use crate::storage::spool::{JobKey, SpoolReader};

/// Where the daemon serves the API and the tools look for it (`--api-socket`, `NCCLSCOPE_API_SOCKET`).
pub use ncclscope_proto::DEFAULT_API_SOCKET;
/// The environment variable naming the API socket, for the daemon and the tools alike.
pub const API_SOCKET_ENV: &str = "NCCLSCOPE_API_SOCKET";

/// Where to serve the API. Only a Unix socket: job telemetry must not go over a network in clear text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApiAddr {
    Unix(PathBuf),
}

impl ApiAddr {
    /// Parses `PATH`, `unix:PATH`, or refuses `tcp://...` (and any other scheme) with the reason.
    pub fn parse(s: &str) -> anyhow::Result<ApiAddr> {
        if let Some(rest) = s.strip_prefix("unix:") {
            return Ok(ApiAddr::Unix(PathBuf::from(rest)));
        }
        if s.contains("://") || s.parse::<std::net::SocketAddr>().is_ok() {
            anyhow::bail!(
                "refusing to serve the query API on {s:?}: TCP would need TLS, which this build does not \
                 support; serve it on a Unix socket (a path or unix:PATH) and forward that socket \
                 (e.g. ssh -L /local.sock:{DEFAULT_API_SOCKET}) to reach it remotely"
            );
        }
        if s.is_empty() {
            anyhow::bail!("the query API socket path is empty");
        }
        Ok(ApiAddr::Unix(PathBuf::from(s)))
    }
}

/// API connections one uid (other than root) holds at most.
pub const MAX_CONNECTIONS_PER_UID: usize = 64;
/// Watch and Export streams one uid (other than root) has open at most.
pub const MAX_STREAMS_PER_UID: usize = 16;
/// How long an Export waits for a client that reads nothing before it ends the stream.
pub const STALLED_CLIENT: Duration = Duration::from_secs(30);
/// When the server ends a connection.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// Age at which a connection is asked to close (HTTP/2 GOAWAY): the streams it has open run on
    /// to their end, no new one starts on it, and it closes once it has none.
    pub max_age: Duration,
    /// A connection that sends nothing this long after it was accepted is closed (one that never
    /// speaks HTTP/2 has no stream for the age to wait on, nor a handshake to end).
    pub silent: Duration,
    /// HTTP/2 PING every this long; a connection whose peer does not answer within as long again
    /// is closed (closing at its age waits on such an answer too).
    pub keepalive: Duration,
}

impl Timeouts {
    /// The daemon's.
    pub const DAEMON: Timeouts = Timeouts {
        max_age: Duration::from_secs(600),
        silent: Duration::from_secs(10),
        keepalive: Duration::from_secs(60),
    };
}
/// Spooled instances an Export reads per blocking read (the thread is given back between reads).
const EXPORT_CHUNK: usize = 1024;

/// The `Query` service over the daemon's hub and spool.
#[derive(Clone)]
pub struct QueryService {
    hub: Arc<Hub>,
    spool: Option<SpoolReader>,
    streams: Arc<PerUid>,
    /// The live export's resource ([`crate::export::otlp::resource_attributes`]).
    resource: Arc<[(String, String)]>,
}

impl QueryService {
    /// `spool: None` (a daemon run without a spool) makes Export answer `unavailable`; `resource`
    /// is what GetResource answers.
    pub fn new(
        hub: Arc<Hub>,
        spool: Option<SpoolReader>,
        resource: Vec<(String, String)>,
    ) -> QueryService {
        QueryService {
            hub,
            spool,
            streams: Arc::default(),
            resource: resource.into(),
        }
    }

    /// A stream slot of `req`'s caller, or `resource_exhausted`.
    fn stream_slot<T>(&self, req: &Request<T>) -> Result<Held, Status> {
        let uid = caller(req)?;
        (self.streams.take(uid, MAX_STREAMS_PER_UID, usize::MAX)).map_err(|_| {
            Status::resource_exhausted(format!(
                "uid {uid} has {MAX_STREAMS_PER_UID} Watch/Export streams open, the most one user may; \
                 close one first"
            ))
        })
    }

    pub fn into_server(self) -> QueryServer<QueryService> {
        QueryServer::new(self)
    }
}

type CollectiveStream = Pin<Box<dyn Stream<Item = Result<Collective, Status>> + Send>>;

/// The uid whose jobs `req` may see (`None`: every uid's, for root), narrowed to `asked` if given.
/// The caller's uid is the kernel's word for the connection (SO_PEERCRED), never the request's.
fn scope<T>(req: &Request<T>, asked: Option<u32>) -> Result<Option<u32>, Status> {
    match (caller(req)?, asked) {
        (0, asked) => Ok(asked),
        (uid, None) => Ok(Some(uid)),
        (uid, Some(asked)) if asked == uid => Ok(Some(uid)),
        (uid, Some(asked)) => Err(Status::permission_denied(format!(
            "uid {uid} may not read uid {asked}'s jobs (only root may)"
        ))),
    }
}

/// The caller's uid, as the kernel reported it for the connection.
fn caller<T>(req: &Request<T>) -> Result<u32, Status> {
    req.extensions()
        .get::<UdsConnectInfo>()
        .and_then(|info| info.peer_cred)
        .map(|cred| cred.uid())
        .ok_or_else(|| Status::unauthenticated("the caller's credentials are unavailable"))
}

fn visible(scope: Option<u32>, uid: u32) -> bool {
    scope.is_none_or(|s| s == uid)
}

/// Instances sent ahead of a slow Export/Watch client before the server waits for it.
const STREAM_BUFFER: usize = 256;

#[tonic::async_trait]
impl Query for QueryService {
    async fn list_jobs(
        &self,
        req: Request<ListJobsRequest>,
    ) -> Result<Response<ListJobsResponse>, Status> {
        let scope = scope(&req, None)?;
        let mut jobs = self.hub.jobs();
        jobs.jobs.retain(|j| visible(scope, j.uid));
        // A job the daemon no longer holds in memory (e.g. before a restart) is still exportable.
        if let Some(spool) = &self.spool {
            for (uid, job_id) in spool.jobs() {
                if visible(scope, uid)
                    && !jobs
                        .jobs
                        .iter()
                        .any(|j| (j.uid, &j.job_id) == (uid, &job_id))
                {
                    jobs.jobs.push(ncclscope_proto::api::Job {
                        uid,
                        job_id,
                        ..Default::default()
                    });
                }
            }
            // What the spool knows of each: its Slurm jobs, what its bounds deleted.
            for j in &mut jobs.jobs {
                let key = (j.uid, j.job_id.clone());
                j.slurm_job_ids = spool.slurm_jobs(&key);
                let d = spool.evicted(&key).unwrap_or_default();
                j.spool_dropped_files = d.files;
                j.spool_dropped_bytes = d.bytes;
                j.spool_dropped_until_unix_ns = d.until_unix_ns;
            }
        }
        Ok(Response::new(jobs))
    }

    async fn get_stats(
        &self,
        req: Request<StatsRequest>,
    ) -> Result<Response<StatsResponse>, Status> {
        let scope = scope(&req, req.get_ref().uid)?;
        let job = req.into_inner().job_id;
        let mut stats = self.hub.stats();
        let wanted = |uid, job_id: &str| visible(scope, uid) && (job.is_empty() || job_id == job);
        stats.colls.retain(|c| wanted(c.uid, &c.job_id));
        stats.ranks.retain(|r| wanted(r.uid, &r.job_id));
        Ok(Response::new(stats))
    }

    type WatchStream = CollectiveStream;

    async fn watch(
        &self,
        req: Request<WatchRequest>,
    ) -> Result<Response<CollectiveStream>, Status> {
        let scope = scope(&req, req.get_ref().uid)?;
        let slot = self.stream_slot(&req)?;
        let job = req.into_inner().job_id;
        let mut live = self.hub.subscribe();
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(async move {
            let _slot = slot;
            loop {
                let received = tokio::select! {
                    // The client went away while its job was quiet: stop now, not at the next instance.
                    () = tx.closed() => return,
                    r = live.recv() => r,
                };
                let c = match received {
                    Ok(c) => c,
                    // This watcher fell behind: it misses some instances, the daemon does not wait for it.
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                let c = c.view();
                if visible(scope, c.uid())
                    && (job.is_empty() || c.job_id() == job)
                    && tx.send(Ok(c.to_message())).await.is_err()
                {
                    return; // the client went away
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type ExportStream = CollectiveStream;

    async fn export(
        &self,
        req: Request<ExportRequest>,
    ) -> Result<Response<CollectiveStream>, Status> {
        let scope = scope(&req, req.get_ref().uid)?;
        let slot = self.stream_slot(&req)?;
        let ExportRequest {
            job_id,
            slurm_job_id,
            ..
        } = req.into_inner();
        let Some(spool) = self.spool.clone() else {
            return Err(Status::unavailable(
                "this daemon runs without a spool: nothing to export",
            ));
        };
        let jobs = if slurm_job_id.is_empty() {
            vec![spool.find(&job_id, scope).map_err(|e| {
                let yours: Vec<String> = spool
                    .jobs()
                    .into_iter()
                    .filter(|(uid, _)| visible(scope, *uid))
                    .map(|(uid, j)| format!("{j} (uid {uid})"))
                    .collect();
                Status::not_found(format!("{e}; spooled jobs you may export: {yours:?}"))
            })?]
        } else {
            let jobs = spool.in_slurm_job(scope, &slurm_job_id);
            if jobs.is_empty() {
                return Err(Status::not_found(format!(
                    "no spooled instances of Slurm job {slurm_job_id:?}"
                )));
            }
            jobs
        };
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(async move {
            let _slot = slot;
            for job in jobs {
                if !send_job(&spool, job, &slurm_job_id, &tx).await {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_resource(
        &self,
        req: Request<ResourceRequest>,
    ) -> Result<Response<ResourceResponse>, Status> {
        // Any local user: it names the node, as every span the collector receives does.
        caller(&req)?;
        let attributes = (self.resource.iter())
            .map(|(key, value)| ResourceAttribute {
                key: key.clone(),
                value: value.clone(),
            })
            .collect();
        Ok(Response::new(ResourceResponse { attributes }))
    }
}

/// Streams `job`'s spooled instances (of Slurm job `slurm_job_id` only, unless it is empty) to
/// `tx`; false once the stream has ended (the client left or stalled, or the spool failed).
async fn send_job(
    spool: &SpoolReader,
    job: JobKey,
    slurm_job_id: &str,
    tx: &mpsc::Sender<Result<Collective, Status>>,
) -> bool {
    let mut records = spool.read_job(&job);
    loop {
        // Read off the async threads, a chunk at a time: no thread waits on the client.
        let read = tokio::task::spawn_blocking(move || {
            let chunk: Vec<_> = records.by_ref().take(EXPORT_CHUNK).collect();
            (records, chunk)
        });
        let Ok((rest, chunk)) = read.await else {
            return false;
        };
        if chunk.is_empty() {
            return true;
        }
        records = rest;
        for item in chunk {
            if (item.as_ref())
                .is_ok_and(|c| !slurm_job_id.is_empty() && c.slurm_job_id != slurm_job_id)
            {
                continue;
            }
            let item = item.map_err(|e| {
                Status::data_loss(format!("spool of job {:?} (uid {}): {e}", job.1, job.0))
            });
            let failed = item.is_err();
            // Gone, or reading nothing for STALLED_CLIENT: the stream ends, its slot is free.
            let sent = tokio::time::timeout(STALLED_CLIENT, tx.send(item)).await;
            if !matches!(sent, Ok(Ok(()))) || failed {
                return false;
            }
        }
    }
}

/// Binds the API socket, mode 0666: every local user may query it, for their own jobs.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    crate::host::socket::bind(path, 0o666, "the query API")
}

/// Serves `service` on `listener` until `shutdown` completes; connections end as `timeouts` say.
pub async fn serve(
    listener: UnixListener,
    service: QueryService,
    timeouts: Timeouts,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let connections = Arc::new(PerUid::default());
    let incoming = UnixListenerStream::new(listener).filter_map(move |accepted| {
        let io = match accepted {
            Ok(io) => io,
            Err(e) => return Some(Err(e)),
        };
        let uid = io.peer_cred().map(|c| c.uid()).ok()?;
        let Ok(held) = connections.take(uid, MAX_CONNECTIONS_PER_UID, usize::MAX) else {
            // Closed at once (dropped); the line limited per uid.
            if let Some(held_back) = crate::host::ratelimit::lines().allow(uid) {
                tracing::warn!(
                    uid,
                    held_back,
                    "uid {uid} holds {MAX_CONNECTIONS_PER_UID} API connections, the most one user may: \
                     closing its new ones"
                );
            }
            return None;
        };
        let silent = Some(Box::pin(tokio::time::sleep(timeouts.silent)));
        Some(Ok(Connection {
            io,
            silent,
            _held: held,
        }))
    });
    Server::builder()
        .max_connection_age(timeouts.max_age)
        .http2_keepalive_interval(Some(timeouts.keepalive))
        .http2_keepalive_timeout(Some(timeouts.keepalive))
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .context("serving the query API")
}

/// An accepted API connection, holding its place in its uid's count until it closes.
struct Connection {
    io: UnixStream,
    /// Until the first byte comes: reads end (EOF) once it fires.
    silent: Option<Pin<Box<tokio::time::Sleep>>>,
    _held: Held,
}

impl Connected for Connection {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> UdsConnectInfo {
        self.io.connect_info()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        let Some(silent) = this.silent.as_mut() else {
            return read;
        };
        match read {
            Poll::Ready(Ok(())) if buf.filled().len() > before => this.silent = None,
            // Nothing yet, and silent for too long: end of stream, so the server closes it.
            Poll::Pending if silent.as_mut().poll(cx).is_ready() => return Poll::Ready(Ok(())),
            _ => {}
        }
        read
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The API socket the tools use: the flag, else `NCCLSCOPE_API_SOCKET`, else the default.
pub fn socket_path(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os(API_SOCKET_ENV).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_API_SOCKET))
}

/// Connects to the daemon's API on its Unix socket, with an error that says what to check.
pub async fn connect(path: &Path) -> anyhow::Result<QueryClient<Channel>> {
    let socket = path.to_path_buf();
    // The URI is required by the HTTP/2 layer but never resolved: the connector dials the socket.
    let channel = Endpoint::from_static("http://ncclscope.local")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
        .with_context(|| {
            format!(
                "cannot reach the ncclscope daemon's query API at {} (is `ncclscope daemon` running? \
                 point --api-socket or {API_SOCKET_ENV} at its API socket)",
                path.display()
            )
        })?;
    Ok(QueryClient::new(channel).max_decoding_message_size(64 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::spool::{Spool, SpoolLimits};
    use ncclscope_proto::api::{CollStats, Job, RankStats};
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Mutex;

    fn coll(job: &str, seq: u64) -> Collective {
        Collective {
            job_id: job.into(),
            seq,
            func: "AllGather".into(),
            ..Default::default()
        }
    }

    struct Running {
        _dir: tempfile::TempDir,
        socket: PathBuf,
        hub: Arc<Hub>,
        spool: Spool,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<anyhow::Result<()>>,
    }

    async fn start() -> Running {
        start_with(Timeouts::DAEMON).await
    }

    async fn start_with(timeouts: Timeouts) -> Running {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("run/api.sock");
        let hub = Arc::new(Hub::default());
        let spool = Spool::open(dir.path().join("spool"), SpoolLimits::default()).unwrap();
        let listener = bind(&socket).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let service = QueryService::new(hub.clone(), Some(spool.reader()), Vec::new());
        let task = tokio::spawn(serve(listener, service, timeouts, async {
            let _ = stopped.await;
        }));
        Running {
            _dir: dir,
            socket,
            hub,
            spool,
            stop: Some(stop),
            task,
        }
    }

    #[tokio::test]
    async fn lists_filters_stats_exports_and_watches_over_the_socket() {
        let mut d = start().await;
        d.hub.set_jobs(ListJobsResponse {
            jobs: vec![Job {
                job_id: "live".into(),
                live: true,
                ..Default::default()
            }],
        });
        d.hub.set_stats(StatsResponse {
            colls: vec![
                CollStats {
                    job_id: "a".into(),
                    count: 3,
                    ..Default::default()
                },
                CollStats {
                    job_id: "b".into(),
                    count: 4,
                    ..Default::default()
                },
            ],
            ranks: vec![RankStats {
                job_id: "b".into(),
                rank: 1,
                ..Default::default()
            }],
            p2p: vec![],
            health: None,
        });
        let batch: Vec<_> = (0..1000)
            .map(|s| coll(if s % 3 == 0 { "x" } else { "y" }, s))
            .collect();
        let batch: Vec<_> = batch.into_iter().map(|c| (Default::default(), c)).collect();
        d.spool.append(&batch).unwrap();

        let mut client = connect(&d.socket).await.unwrap();
        let jobs = client
            .list_jobs(ListJobsRequest {})
            .await
            .unwrap()
            .into_inner();
        let ids: Vec<_> = jobs.jobs.iter().map(|j| j.job_id.as_str()).collect();
        assert_eq!(ids, ["live", "x", "y"]);

        let all = client
            .get_stats(StatsRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(all.colls.len(), 2);
        let b = client
            .get_stats(StatsRequest {
                job_id: "b".into(),
                uid: None,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((b.colls.len(), b.colls[0].count, b.ranks.len()), (1, 4, 1));

        let mut stream = client
            .export(ExportRequest {
                job_id: "x".into(),
                uid: None,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut seqs = Vec::new();
        while let Some(c) = stream.message().await.unwrap() {
            seqs.push(c.seq);
        }
        assert_eq!(seqs, (0..1000).filter(|s| s % 3 == 0).collect::<Vec<_>>());

        let err = client
            .export(ExportRequest {
                job_id: "nope".into(),
                uid: None,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound);

        let mut watch = client
            .watch(WatchRequest {
                job_id: "y".into(),
                uid: None,
            })
            .await
            .unwrap()
            .into_inner();
        // The subscription exists once the call returned; publish after it, filtered to job y.
        for s in 0..5 {
            let c = coll(if s % 2 == 0 { "y" } else { "z" }, s);
            let c = crate::instance::Shared::from(&c);
            d.hub.publish(&c.inst, &c.names);
        }
        for want in [0, 2, 4] {
            let c = watch.message().await.unwrap().unwrap();
            assert_eq!((c.job_id.as_str(), c.seq), ("y", want));
        }

        d.stop.take().unwrap().send(()).unwrap();
        drop(watch);
        d.task.await.unwrap().unwrap();
    }

    /// Issue 22: idle connections were never timed out. A connection silent from the start is
    /// closed; past its age one that holds no stream is closed, a Watch opened before goes on, and
    /// the tools' client carries on over a new connection.
    #[tokio::test]
    async fn connections_close_past_their_age_once_they_hold_no_stream() {
        let age = Duration::from_millis(300);
        let mut d = start_with(Timeouts {
            max_age: age,
            silent: age,
            keepalive: age,
        })
        .await;
        let silent = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
        // An HTTP/2 client that opens no stream and answers nothing: the preface and an empty
        // SETTINGS frame.
        let idle = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
        std::io::Write::write_all(&mut &idle, preface).unwrap();
        let mut client = connect(&d.socket).await.unwrap();
        let mut watch = client
            .watch(WatchRequest {
                job_id: "y".into(),
                uid: None,
            })
            .await
            .unwrap()
            .into_inner();
        tokio::time::sleep(age * 3).await;

        for (conn, what) in [(&silent, "silent"), (&idle, "idle")] {
            conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            // The server's own HTTP/2 frames (settings, then GOAWAY), then the end.
            let mut frames = Vec::new();
            let end = std::io::Read::read_to_end(&mut &*conn, &mut frames);
            assert!(end.is_ok(), "a {what} connection is closed: {end:?}");
        }
        let c = crate::instance::Shared::from(&coll("y", 7));
        d.hub.publish(&c.inst, &c.names);
        let got = watch.message().await.unwrap().unwrap();
        assert_eq!(got.seq, 7, "a stream opened before goes on");
        // A call that races the close fails (Cancelled, as at a daemon restart); the next one goes
        // over a new connection.
        for _ in 0..3 {
            if client.list_jobs(ListJobsRequest {}).await.is_err() {
                (client.list_jobs(ListJobsRequest {}).await)
                    .expect("the client reconnects for a new call");
            }
            tokio::time::sleep(age).await;
        }
        d.stop.take().unwrap().send(()).unwrap();
        drop(watch);
        d.task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn bind_replaces_a_stale_socket_but_not_a_live_one_or_a_file() {
        let d = start().await;
        let err = bind(&d.socket).unwrap_err().to_string();
        assert!(err.contains("already serves"), "{err}");
        d.task.abort();
        let _ = d.task.await;
        // The listener is gone; the socket file is left behind, stale.
        assert!(d.socket.exists());
        drop(bind(&d.socket).unwrap());

        let file = d._dir.path().join("plain");
        std::fs::write(&file, b"x").unwrap();
        assert!(
            bind(&file)
                .unwrap_err()
                .to_string()
                .contains("not a socket")
        );
    }

    #[tokio::test]
    async fn connecting_to_no_daemon_says_what_to_check() {
        let err = connect(Path::new("/nonexistent/ncclscope/api.sock"))
            .await
            .unwrap_err();
        assert!(
            format!("{err:#}").contains("is `ncclscope daemon` running"),
            "{err:#}"
        );
    }

    #[test]
    fn tcp_is_refused_without_tls() {
        for addr in ["tcp://0.0.0.0:7000", "127.0.0.1:7000", "http://x:1"] {
            let err = ApiAddr::parse(addr).unwrap_err().to_string();
            assert!(err.contains("TLS"), "{err}");
        }
        assert_eq!(
            ApiAddr::parse("unix:/a/b").unwrap(),
            ApiAddr::Unix("/a/b".into())
        );
        assert_eq!(
            ApiAddr::parse("/a/b").unwrap(),
            ApiAddr::Unix("/a/b".into())
        );
    }

    /// Connections to `socket` made on a thread running as `uid` (SO_PEERCRED reports the
    /// credentials of the thread that connected); needs root.
    fn connect_as(uid: u32, socket: &Path, n: usize) -> Vec<std::os::unix::net::UnixStream> {
        let socket = socket.to_path_buf();
        std::thread::spawn(move || {
            // This thread only, and for good: a raw setuid, not glibc's process-wide one.
            rustix::thread::set_thread_uid(rustix::process::Uid::from_raw(uid)).unwrap();
            (0..n)
                .map(|_| std::os::unix::net::UnixStream::connect(&socket).unwrap())
                .collect()
        })
        .join()
        .unwrap()
    }

    /// A client over one connection made as `uid`.
    async fn client_as(uid: u32, socket: &Path) -> QueryClient<Channel> {
        let conn = Mutex::new(connect_as(uid, socket, 1).pop());
        let channel = Endpoint::from_static("http://ncclscope.local")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let conn = conn.lock().unwrap().take();
                async move {
                    let conn = conn.ok_or_else(|| io::Error::other("one connection only"))?;
                    conn.set_nonblocking(true)?;
                    Ok::<_, io::Error>(TokioIo::new(UnixStream::from_std(conn)?))
                }
            }))
            .await
            .unwrap();
        QueryClient::new(channel)
    }

    /// Issue 22: a local user held 1,100 idle connections (the daemon's descriptors) and 600
    /// unread Export streams (a blocking thread each: 516 threads, other users' exports hung).
    /// Now one uid holds at most MAX_CONNECTIONS_PER_UID connections and MAX_STREAMS_PER_UID
    /// streams, no stream holds a thread while its client does not read, and root is unaffected.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_user_cannot_hold_more_than_its_connections_and_streams() {
        if !rustix::process::getuid().is_root() {
            eprintln!("skipped: needs root to connect as another uid");
            return;
        }
        const USER: u32 = 61003;
        const STREAMER: u32 = 61004;
        let mut d = start().await;
        std::fs::set_permissions(d._dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let batch: Vec<_> = (0..5000)
            .map(|s| {
                let mut c = coll("big", s);
                c.uid = STREAMER;
                (Default::default(), c)
            })
            .collect();
        d.spool.append(&batch).unwrap();

        // Connections: the ones past the bound are closed at once, without a byte.
        let extra = 10;
        let conns = connect_as(USER, &d.socket, MAX_CONNECTIONS_PER_UID + extra);
        let mut closed = 0;
        for mut c in conns.iter() {
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut first = [0u8; 1];
            if matches!(std::io::Read::read(&mut c, &mut first), Ok(0)) {
                closed += 1;
            }
        }
        assert_eq!(closed, extra, "held: the bound, closed: the rest");
        let mut root = connect(&d.socket).await.unwrap();
        root.list_jobs(ListJobsRequest {}).await.unwrap();
        drop(conns);

        // Streams: MAX_STREAMS_PER_UID unread exports open, the next refused; root's still served.
        // (Another uid: the server frees the first one's connections only as it sees them close.)
        let mut user = client_as(STREAMER, &d.socket).await;
        let export = || ExportRequest {
            job_id: "big".into(),
            uid: None,
            ..Default::default()
        };
        let mut open = Vec::new();
        for _ in 0..MAX_STREAMS_PER_UID {
            open.push(user.export(export()).await.unwrap().into_inner());
        }
        let refused = user.export(export()).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused}");
        let mut all = root
            .export(ExportRequest {
                job_id: "big".into(),
                uid: Some(STREAMER),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut n = 0;
        while all.message().await.unwrap().is_some() {
            n += 1;
        }
        assert_eq!(
            n, 5000,
            "root's export is whole while the user's streams stall"
        );
        // Closed streams give their slots back.
        drop(open);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut again = user.export(export()).await;
        while again.is_err() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            again = user.export(export()).await;
        }
        let mut again = again.unwrap().into_inner();
        assert!(again.message().await.unwrap().is_some());
        let _ = d.stop.take().unwrap().send(());
    }
}
