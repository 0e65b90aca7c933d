//! The meeting point between the daemon's ingest/aggregation side and its consumers (gRPC API, spool,
//! `top`): completed collective instances and the latest statistics snapshot.
//!
//! Contract: the aggregator calls [`Hub::publish`] for every completed instance, in completion order,
//! after the spool has accepted it; it replaces the snapshots about once a second.

use std::sync::{Arc, Mutex};

use ncclscope_proto::api::{ListJobsResponse, StatsResponse};
use tokio::sync::broadcast;

use crate::instance::Instance;

/// Where completed instances become durable before they are published: the spool. The engine calls
/// it with each batch in completion order; `Ok` means the batch survives a crash.
pub trait Durable: Send {
    fn append(&mut self, batch: &[&Instance]) -> std::io::Result<()>;
}

impl Durable for crate::spool::Spool {
    fn append(&mut self, batch: &[&Instance]) -> std::io::Result<()> {
        let messages: Vec<_> = batch.iter().map(|i| i.to_message()).collect();
        crate::spool::Spool::append(self, &messages)
    }
}

/// Live subscribers that fall further behind than this many instances miss some (counted by them).
pub const LIVE_BACKLOG: usize = 4096;

pub struct Hub {
    live: broadcast::Sender<Arc<Instance>>,
    stats: Mutex<StatsResponse>,
    jobs: Mutex<ListJobsResponse>,
}

impl Default for Hub {
    fn default() -> Self {
        Hub {
            live: broadcast::channel(LIVE_BACKLOG).0,
            stats: Mutex::default(),
            jobs: Mutex::default(),
        }
    }
}

impl Hub {
    pub fn publish(&self, c: &Instance) {
        // Nobody watching is the common case: no copy, and no lock taken.
        if self.live.receiver_count() > 0 {
            let _ = self.live.send(Arc::new(c.clone()));
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Instance>> {
        self.live.subscribe()
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
