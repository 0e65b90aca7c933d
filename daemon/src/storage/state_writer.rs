//! Resume states made durable on a thread of their own ("ncclscope-state"), so that the ingest
//! thread never waits on the disk: the engine queues a segment's state and goes on; the writer takes
//! what queued up meanwhile, keeps each segment's newest state only, writes and syncs them (one
//! directory sync for all), and then reports them durable.
//!
//! The engine commits a segment's tail only once a state describing that tail is reported durable
//! ([`StateWriter::durable`]), as it waits for the spool's batches: whatever is killed or rebooted,
//! the tail on disk never runs ahead of the state on disk. A state not made durable (a full disk) is
//! reported ([`StateWriter::take_failed`]); the tail waits for the next save.

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::storage::resume::{self, SegmentState};

/// Where resume states become durable: the state directory (a test's gate around it).
pub trait Store: Send {
    /// Replaces the saved state of each of `states`' segments so that it survives a crash; the
    /// index (in `states`) and error of each one that was not.
    fn store(&mut self, states: &[SegmentState]) -> Vec<(usize, io::Error)>;
}

/// The state directory: each state written, synced and renamed, then the directory synced once.
pub struct Dir(pub PathBuf);

impl Store for Dir {
    fn store(&mut self, states: &[SegmentState]) -> Vec<(usize, io::Error)> {
        let mut failed: Vec<_> = (states.iter().enumerate())
            .filter_map(|(i, s)| resume::store(&self.0, s).err().map(|e| (i, e)))
            .collect();
        if failed.len() < states.len()
            && let Err(e) = resume::sync_dir(&self.0)
        {
            // The renames may not survive a crash: none of them is durable.
            failed = (0..states.len())
                .map(|i| (i, io::Error::new(e.kind(), e.to_string())))
                .collect();
        }
        failed
    }
}

/// How many of its queued items a writer thread has finished (numbered from 1 in queue order; every
/// lower one is finished too): the state writer's and the spool's.
#[derive(Default)]
pub struct Done(AtomicU64);

impl Done {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Reports everything up to `number` finished (the writer thread).
    pub fn reach(&self, number: u64) {
        self.0.store(number, Ordering::Release);
    }

    /// Waits until item `number` is finished, for at most `timeout`; whether it is.
    pub fn wait(&self, number: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.get() < number {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        true
    }
}

/// What the writer reports back, read by the engine (and by the spool writer, which waits for the
/// states a batch must follow).
#[derive(Default)]
pub struct Progress {
    /// States written and synced, or failed.
    done: Done,
    /// (segment, number) of each state that was not made durable, with every earlier one of the
    /// segment it replaced; until the engine takes them.
    failed: Mutex<Vec<(String, u64)>>,
}

impl Progress {
    /// Waits until state `number` is durable (or failed), for at most `timeout`; whether it is.
    pub fn wait(&self, number: u64, timeout: Duration) -> bool {
        self.done.wait(number, timeout)
    }
}

/// Shortest time between two groups. A segment queues a state at every commit (every 10 ms while
/// instances flow) and before spooled batches; written as they come, 32 ranks at 500 k records/s
/// cost the writer more CPU (3.7 s in 10 s) than the ingest thread. Every 50 ms, a segment's tail
/// waits at most that much longer for its state, and its ring holds the records meanwhile.
const GROUP_EVERY: Duration = Duration::from_millis(50);

pub struct StateWriter {
    tx: Option<mpsc::Sender<SegmentState>>,
    progress: Arc<Progress>,
    /// States queued so far.
    queued: u64,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StateWriter {
    pub fn start(store: Box<dyn Store>) -> io::Result<StateWriter> {
        // Unbounded: the engine queues a segment's state at most once per commit or spooled batch,
        // and holds a segment's commits while states of it are queued (see `engine::commit::MAX_SAVING`).
        let (tx, rx) = mpsc::channel();
        let progress = Arc::new(Progress::default());
        let thread = {
            let progress = progress.clone();
            std::thread::Builder::new()
                .name("ncclscope-state".into())
                .spawn(move || write_loop(store, rx, &progress))?
        };
        Ok(StateWriter {
            tx: Some(tx),
            progress,
            queued: 0,
            thread: Some(thread),
        })
    }

    /// Queues `state`; its number (see [`Self::durable`]), or an error if the writer is gone.
    pub fn queue(&mut self, state: SegmentState) -> io::Result<u64> {
        let tx = self.tx.as_ref().expect("queued before drop");
        tx.send(state)
            .map_err(|_| io::Error::other("the state writer thread ended"))?;
        self.queued += 1;
        Ok(self.queued)
    }

    /// The highest state number written and synced, or failed (see [`Self::take_failed`]); every
    /// lower one is, too.
    pub fn durable(&self) -> u64 {
        self.progress.done.get()
    }

    /// The states reported as failed since the last call: (segment, number). Read after
    /// [`Self::durable`], it holds every failure up to what that returned.
    pub fn take_failed(&self) -> Vec<(String, u64)> {
        std::mem::take(&mut *self.progress.failed.lock().expect("not poisoned"))
    }

    /// Waits until state `number` is durable (or failed), for at most `timeout`; whether it is.
    pub fn wait(&self, number: u64, timeout: Duration) -> bool {
        self.progress.wait(number, timeout)
    }

    /// Waits until every queued state is durable (or failed), for at most `timeout`.
    pub fn flush(&self, timeout: Duration) -> bool {
        self.wait(self.queued, timeout)
    }

    /// For the spool writer, which appends a batch only once the states it must follow are durable.
    pub fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }
}

impl Drop for StateWriter {
    /// Writes what is queued, then ends the thread.
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("the state writer thread panicked");
        }
    }
}

fn write_loop(mut store: Box<dyn Store>, rx: mpsc::Receiver<SegmentState>, progress: &Progress) {
    // Each segment's newest state queued, its number, and where it is in `group`.
    let mut group: Vec<SegmentState> = Vec::new();
    let mut numbers: Vec<u64> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    let mut n = 0u64;
    while let Ok(first) = rx.recv() {
        let started = Instant::now();
        let mut next = Some(first);
        while let Some(state) = next {
            n += 1;
            match at.get(&state.segment) {
                // Only the newest needs writing: it describes a tail at or after the replaced one's.
                Some(&i) => (group[i], numbers[i]) = (state, n),
                None => {
                    at.insert(state.segment.clone(), group.len());
                    group.push(state);
                    numbers.push(n);
                }
            }
            next = rx.try_recv().ok();
        }
        let failed = store.store(&group);
        if !failed.is_empty() {
            let mut reported = progress.failed.lock().expect("not poisoned");
            for (i, e) in failed {
                tracing::error!(segment = %group[i].segment, error = %e, "cannot save resume state; its tail waits for the next save");
                reported.push((group[i].segment.clone(), numbers[i]));
            }
        }
        progress.done.reach(n);
        group.clear();
        numbers.clear();
        at.clear();
        // What queues meanwhile is coalesced into the next group.
        std::thread::sleep(GROUP_EVERY.saturating_sub(started.elapsed()));
    }
}
