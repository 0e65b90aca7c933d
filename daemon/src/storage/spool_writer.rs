//! The spool on a thread of its own ("ncclscope-spool"): the engine queues each delivery's new
//! instances as one batch and goes on reading segments; the writer appends what queued up meanwhile
//! in one go, syncs it once (group commit), publishes it to the hub, and then reports it durable.
//!
//! Exactly-once stays with the engine: a segment's commit point passes an operation only once the
//! batch holding it is reported durable ([`SpoolWriter::durable`]), and only then does the saved
//! state list the operation as recorded. The spool position a segment's state saves
//! (`spool_mark`) precedes every batch of the segment not yet reported durable: each batch carries
//! the spool's end as it was before the batch was queued, and the writer appends in queue order.
//! A batch also waits for the resume states queued ahead of it that it must follow (a segment's
//! first state, which tells a restarted engine to look for the segment in the spool at all): the
//! state writer is another thread ([`crate::storage::state_writer`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use crate::storage::hub::{Durable, Hub, SpoolRun};
use crate::storage::spool::{JobKey, Origin, Position, SpoolIndex};
use crate::storage::state_writer;

/// Batches queued and not yet durable (a delivery's new instances each, about 1,000) at which the
/// engine stops reading segments until the writer catches up: a disk slower than a burst leaves the
/// burst in the rings (which the producers only count as lost if it overflows them) rather than in
/// the daemon's memory. The engine's thread never waits on it.
pub const BACKLOG_PAUSE: u64 = 16;
/// Batches queued at most: what one tick can deliver on top of [`BACKLOG_PAUSE`] (each segment's
/// `drain.batch_records` at most per tick) fits many times; past it a delivery is not spooled but
/// counted (`spool_backlog`).
pub const QUEUE_BATCHES: usize = 1024;
/// Instances appended (and synced) at once at most.
const GROUP_INSTANCES: usize = 16_384;
/// Emptied buffers kept for reuse, and the largest kept (instances): at most about 7 MiB held.
const SPARE_BUFFERS: usize = 32;
const SPARE_CAPACITY: usize = 1024;
/// Longest a batch waits for the states it must follow: a state disk that hangs this long no longer
/// holds the spool (a kill then could record the batch twice, as when the state write fails).
const STATE_WAIT: Duration = Duration::from_secs(10);

type Batch = Vec<SpoolRun>;
type Items = Vec<(Origin, crate::instance::Instance)>;

/// What the writer reports back, read by the engine.
#[derive(Default)]
struct Progress {
    /// Batches written and synced, or failed.
    done: state_writer::Done,
    /// Instances whose append failed (full disk, I/O error).
    failed: AtomicU64,
}

pub struct SpoolWriter {
    /// Each batch with the number of the last resume state it must follow (0: none).
    tx: Option<mpsc::SyncSender<(Batch, u64)>>,
    /// Emptied runs' buffers back from the writer, for the next batches: a fresh buffer each time
    /// cost the ingest thread a page fault per page and a copy per growth.
    spare: mpsc::Receiver<Items>,
    index: SpoolIndex,
    progress: Arc<Progress>,
    /// Batches queued so far.
    queued: u64,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SpoolWriter {
    /// Starts the writer thread over `spool`; it publishes what it made durable to `hub`, and waits
    /// on `states` for the states a batch must follow.
    pub fn start(
        spool: Box<dyn Durable>,
        hub: Arc<Hub>,
        states: Arc<state_writer::Progress>,
    ) -> std::io::Result<SpoolWriter> {
        let index = spool.index();
        let (tx, rx) = mpsc::sync_channel(QUEUE_BATCHES);
        let (spare_tx, spare) = mpsc::sync_channel(SPARE_BUFFERS);
        let progress = Arc::new(Progress::default());
        let thread = {
            let progress = progress.clone();
            std::thread::Builder::new()
                .name("ncclscope-spool".into())
                .spawn(move || write_loop(spool, hub, &states, rx, spare_tx, &progress))?
        };
        Ok(SpoolWriter {
            tx: Some(tx),
            spare,
            index,
            progress,
            queued: 0,
            thread: Some(thread),
        })
    }

    /// An empty buffer for a run of instances (one the writer is done with, if any).
    pub fn buffer(&self) -> Items {
        self.spare.try_recv().unwrap_or_default()
    }

    /// Queues `batch`, to be appended once resume state number `after` is durable (0: at once); its
    /// number (see [`Self::durable`]), or the batch back if the queue is full.
    pub fn queue(&mut self, batch: Batch, after: u64) -> Result<u64, Batch> {
        let tx = self.tx.as_ref().expect("queued before drop");
        match tx.try_send((batch, after)) {
            Ok(()) => {
                self.queued += 1;
                Ok(self.queued)
            }
            Err(mpsc::TrySendError::Full(b) | mpsc::TrySendError::Disconnected(b)) => Err(b.0),
        }
    }

    /// The highest batch number written and synced (or failed: see [`Self::failed`]); every lower
    /// one is, too.
    pub fn durable(&self) -> u64 {
        self.progress.done.get()
    }

    /// Batches queued and not yet durable.
    pub fn backlog(&self) -> u64 {
        self.queued - self.durable()
    }

    /// Instances the spool could not take so far.
    pub fn failed(&self) -> u64 {
        self.progress.failed.load(Ordering::Relaxed)
    }

    /// Waits until every queued batch is durable, for at most `timeout`; whether they are.
    pub fn flush(&self, timeout: Duration) -> bool {
        self.progress.done.wait(self.queued, timeout)
    }

    /// See [`SpoolIndex::end`].
    pub fn end(&self, job: &JobKey) -> Position {
        self.index.end(job)
    }

    /// See [`SpoolIndex::recorded_since`].
    pub fn recorded_since(
        &self,
        job: &JobKey,
        from: Option<Position>,
    ) -> std::io::Result<Vec<Origin>> {
        self.index.recorded_since(job, from)
    }
}

impl Drop for SpoolWriter {
    /// Writes what is queued, then ends the thread.
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("the spool writer thread panicked");
        }
    }
}

fn write_loop(
    mut spool: Box<dyn Durable>,
    hub: Arc<Hub>,
    states: &state_writer::Progress,
    rx: mpsc::Receiver<(Batch, u64)>,
    spare: mpsc::SyncSender<Items>,
    progress: &Progress,
) {
    let mut group: Batch = Vec::new();
    let size = |b: &Batch| b.iter().map(|r| r.items.len()).sum::<usize>();
    while let Ok((first, mut after)) = rx.recv() {
        let (mut n, mut instances) = (1, size(&first));
        group.extend(first);
        // Whatever queued up while the last group was synced goes with this one.
        while instances < GROUP_INSTANCES
            && let Ok((more, more_after)) = rx.try_recv()
        {
            instances += size(&more);
            group.extend(more);
            after = after.max(more_after);
            n += 1;
        }
        if !states.wait(after, STATE_WAIT) {
            tracing::error!(
                "resume state not saved in time; spooling without it (a crash now could record these instances twice)"
            );
        }
        if let Err(e) = spool.append(&group) {
            tracing::error!(error = %e, n = instances, "spool append failed; instances not spooled");
            progress
                .failed
                .fetch_add(instances as u64, Ordering::Relaxed);
        }
        for mut run in group.drain(..) {
            for (_, inst) in &run.items {
                hub.publish(inst, &run.names);
            }
            if run.items.capacity() <= SPARE_CAPACITY {
                run.items.clear();
                let _ = spare.try_send(run.items);
            }
        }
        progress.done.reach(progress.done.get() + n);
    }
}
