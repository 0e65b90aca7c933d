//! The meeting point between the daemon's ingest/aggregation side and its consumers (gRPC API, spool,
//! `top`): completed collective instances and the latest statistics snapshot.
//!
//! Contract: every completed instance is published ([`Hub::publish`]) once, in completion order, after
//! the spool has accepted it (by the spool writer thread; by the engine when there is no spool); the
//! engine replaces the snapshots about once a second.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ncclscope_proto::api::{ListJobsResponse, StatsResponse};
use tokio::sync::broadcast;

use crate::instance::{Instance, InstanceRef, Names, Shared};
use crate::storage::spool::{Origin, Spool, SpoolIndex};

/// Where completed instances become durable before they are published: the spool. The spool
/// writer thread (`spool_writer`) calls it with the batches the engine queued, in completion order,
/// several at once when they queued up meanwhile; `Ok` means they survive a crash. Each instance
/// carries its origin, so a restarted engine can tell which operations its predecessor already
/// recorded.
pub trait Durable: Send {
    fn append(&mut self, batch: &[SpoolRun]) -> std::io::Result<()>;
    /// Where the spool stands, read by the engine's thread while appends go on.
    fn index(&self) -> SpoolIndex;
}

/// Instances of one process for the spool, each with its origin, sharing the process's names (one
/// reference for the run, not one per instance).
#[derive(Debug)]
pub struct SpoolRun {
    pub names: Arc<Names>,
    pub items: Vec<(Origin, Instance)>,
}

impl Durable for Spool {
    fn append(&mut self, batch: &[SpoolRun]) -> std::io::Result<()> {
        let messages: Vec<_> = (batch.iter())
            .flat_map(|run| {
                (run.items.iter()).map(|(o, inst)| {
                    let names = &run.names;
                    (*o, InstanceRef { inst, names }.to_message())
                })
            })
            .collect();
        Spool::append(self, &messages)
    }

    fn index(&self) -> SpoolIndex {
        Spool::index(self)
    }
}

/// Live subscribers that fall further behind than this many instances miss some (counted by them).
pub const LIVE_BACKLOG: usize = 4096;

pub struct Hub {
    live: broadcast::Sender<Arc<Shared>>,
    /// Live [`Subscription`]s: publishing checks this rather than the channel (which takes a lock).
    watchers: Arc<AtomicUsize>,
    stats: Mutex<StatsResponse>,
    jobs: Mutex<ListJobsResponse>,
}

impl Default for Hub {
    fn default() -> Self {
        Hub {
            live: broadcast::channel(LIVE_BACKLOG).0,
            watchers: Arc::default(),
            stats: Mutex::default(),
            jobs: Mutex::default(),
        }
    }
}

impl Hub {
    /// Inlined: nobody watching is the common case, a load in the ingest loop (no call, no copy,
    /// no lock).
    #[inline]
    pub fn publish(&self, inst: &Instance, names: &Arc<Names>) {
        if self.watchers.load(Ordering::Relaxed) > 0 {
            self.send(inst, names);
        }
    }

    #[inline(never)]
    fn send(&self, inst: &Instance, names: &Arc<Names>) {
        let _ = self.live.send(Arc::new(Shared {
            inst: inst.clone(),
            names: names.clone(),
        }));
    }

    pub fn subscribe(&self) -> Subscription {
        self.watchers.fetch_add(1, Ordering::Relaxed);
        Subscription {
            rx: self.live.subscribe(),
            watchers: self.watchers.clone(),
        }
    }

    pub fn set_stats(&self, s: StatsResponse) {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }

    pub fn stats(&self) -> StatsResponse {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_jobs(&self, j: ListJobsResponse) {
        *self.jobs.lock().unwrap_or_else(|e| e.into_inner()) = j;
    }

    pub fn jobs(&self) -> ListJobsResponse {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Instances published from now on, while it lives.
pub struct Subscription {
    rx: broadcast::Receiver<Arc<Shared>>,
    watchers: Arc<AtomicUsize>,
}

impl Subscription {
    pub async fn recv(&mut self) -> Result<Arc<Shared>, broadcast::error::RecvError> {
        self.rx.recv().await
    }

    pub fn try_recv(&mut self) -> Result<Arc<Shared>, broadcast::error::TryRecvError> {
        self.rx.try_recv()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.watchers.fetch_sub(1, Ordering::Relaxed);
    }
}
