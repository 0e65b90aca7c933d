//! The engine's tests, by part; here what they share: an engine over a temporary state
//! directory, segments written as a plugin does, and their hand-over.

mod commit;
mod deliver;
mod segments;

use super::commit::{COMMIT_EVERY, Parked, Passed};
use super::*;
use crate::export::export_queue::SpanItem;
use crate::export::resend::Dropped;
use crate::export::{metrics, prometheus};
use crate::stats::RootWait;
use crate::storage::hub::SpoolRun;
use crate::storage::resume::{self, SegmentState};
use crate::storage::spool::JobKey;
use crate::storage::spool::{Spool, SpoolLimits};
use ncclscope_proto::Claims;
use ncclscope_proto::fixture::{self, Coll, Comm};
use ncclscope_proto::segment::Producer;
use ncclscope_proto::{Record, StrId};
use tokio::sync::{mpsc, watch};

/// The job "j" of the test's own uid (the owner of the segments it creates).
fn job_j() -> JobKey {
    (rustix::process::getuid().as_raw(), "j".into())
}

fn engine(dir: &std::path::Path) -> (Engine, watch::Receiver<Arc<prometheus::Snapshot>>, Arc<Hub>) {
    engine_with(dir, None, Config::default().drain.batch_records)
}

fn engine_with(
    dir: &std::path::Path,
    spool: Option<Box<dyn Durable>>,
    batch_records: usize,
) -> (Engine, watch::Receiver<Arc<prometheus::Snapshot>>, Arc<Hub>) {
    let mut cfg = Config {
        state_dir: dir.to_path_buf(),
        ..Config::default()
    };
    cfg.drain.batch_records = batch_records;
    // The tests read per-rank series, which Prometheus serves only when asked to.
    cfg.prometheus.job_series = true;
    let (prom, rx) = watch::channel(Arc::default());
    let hub = Arc::new(Hub::default());
    let out = Outputs {
        spans: None,
        metrics: None,
        export_counters: Arc::default(),
        dropped: None,
        prometheus: prom,
        host_name: "h".into(),
    };
    (
        Engine::new(Arc::new(cfg), hub.clone(), spool, out).unwrap(),
        rx,
        hub,
    )
}

/// An engine over `dir` that queues spans for export on a channel of `queue` (returned: whatever
/// the test does not acknowledge stays unacknowledged), remembering refused ones in `dropped`.
fn exporting_engine(
    dir: &std::path::Path,
    queue: usize,
    dropped: Option<Arc<Dropped>>,
) -> (Engine, mpsc::Receiver<SpanItem>) {
    let cfg = Config {
        state_dir: dir.to_path_buf(),
        ..Config::default()
    };
    let (spans, queued) = mpsc::channel(queue);
    let out = Outputs {
        spans: Some(spans),
        metrics: None,
        export_counters: Arc::default(),
        dropped,
        prometheus: watch::channel(Arc::default()).0,
        host_name: "h".into(),
    };
    let e = Engine::new(Arc::new(cfg), Arc::new(Hub::default()), None, out).unwrap();
    (e, queued)
}

/// A segment of job "j" written by this process, as a plugin's.
fn producer(capacity: u64) -> Producer {
    let claims = Claims {
        hostname: "h".into(),
        job_id: "j".into(),
        slurm_job_id: String::new(),
    };
    Producer::new(Segment::create(&claims, capacity).unwrap())
}

fn key_of(p: &Producer) -> SegmentKey {
    SegmentKey {
        uid: rustix::process::getuid().as_raw(),
        pid: std::process::id(),
        inode: p.segment().inode(),
    }
}

/// Hands `p`'s segment to `e` as the registration socket does; returns this side of the
/// connection (dropping it is the process's end).
fn hand_over(e: &mut Engine, p: &Producer) -> OwnedFd {
    hand_over_as(e, p, key_of(p))
}

/// [`hand_over`] with the identity the registration socket would have taken from the peer.
fn hand_over_as(e: &mut Engine, p: &Producer, key: SegmentKey) -> OwnedFd {
    let (ours, theirs) = connection();
    let seg = Segment::open(p.segment().fd().try_clone_to_owned().unwrap()).unwrap();
    e.attach(key, seg, Some(theirs)).unwrap();
    ours
}

/// Both ends of a registration connection: (the process's, the daemon's).
fn connection() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap()
}

/// Ticks until every segment whose process ended is drained and dropped.
fn tick_until_dropped(e: &mut Engine) {
    let t0 = Instant::now();
    while e.health().segments > 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "segment not dropped");
        e.tick();
    }
}

/// Strings and the communicator `write_colls`'s records refer to.
fn write_dictionary(p: &mut Producer) {
    p.push(&Record::str(StrId(1), b"AllReduce"));
    p.push(&Record::str(StrId(2), b"ncclFloat32"));
    p.push(&comm_record(0, 5));
}

/// A one-rank communicator on the KernelCh path.
fn comm_record(comm: u32, comm_hash: u64) -> Record {
    let c = Comm {
        comm,
        comm_hash,
        ..Comm::default()
    };
    c.record()
}

/// `write_colls`'s collective `seq` (op id seq + 1, no kernel work, no algorithm or protocol).
fn coll(seq: u64) -> Coll {
    Coll {
        id: seq + 1,
        seq,
        algo: StrId(0),
        proto: StrId(0),
        count: 1,
        n_channels: 0,
        n_warps: 0,
        host_ns: 10,
        ..Coll::default()
    }
}

fn coll_start(seq: u64) -> Record {
    coll(seq).start()
}

fn write_colls(p: &mut Producer, seqs: std::ops::Range<u64>) {
    for seq in seqs {
        p.push(&coll_start(seq));
        p.push(&coll(seq).stop(20));
    }
}
