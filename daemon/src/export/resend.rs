//! Spans the exporter dropped (its queue full, or a batch given up after its retries), re-sent from
//! the spool once the collector answers again.
//!
//! Every instance is spooled before it is queued for export, and its span ids derive from its
//! identity ([`crate::spans`]), so the spool can rebuild exactly the spans that were dropped. What is
//! kept in memory is one 64-bit key per dropped instance (its rank span's id) in [`Dropped`], at most
//! `limit` of them; a drop past that is counted as not re-sent at once. Once an export succeeds
//! again, [`run`] reads the jobs holding keys from the spool on a blocking thread and queues the
//! instances it finds again, at most [`RESEND_PER_TICK`] per [`TICK`] and only while the live queue is
//! at most half full, so live export keeps its room. A key whose instance is no longer in the spool
//! (evicted, or never spooled) is counted as not re-sent. Re-sent spans carry no acknowledgement: the
//! spool already holds their instances, so no segment waits on them. A dropped export that carried
//! its collective's root span also leaves the root's times ([`Wanted`]): a root sent when its skew
//! window closed left after its rank 0 instance was spooled, so the spool does not hold them. The
//! keys live in memory only: what a daemon dropped and had not re-sent when it stopped is not
//! re-sent by the next one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, mpsc};

use crate::export::export_queue::{ExportCounters, SpanItem};
use crate::instance::{InstanceRef, Shared};
use crate::spans;
use crate::storage::spool::{JobKey, SpoolReader};

/// Dropped instances remembered at most (about 20 MiB of keys at the worst, and about 50 MiB more
/// where every one carried a root: rank 0 alone on its node in every communicator).
pub const MAX_REMEMBERED: usize = 1 << 20;
/// The pace of re-sending: at most this many instances per [`TICK`] (10,000 a second).
pub const RESEND_PER_TICK: usize = 100;
pub const TICK: Duration = Duration::from_millis(10);
/// Instances read from the spool and waiting to be queued: the scan's memory besides its keys.
const SCAN_AHEAD: usize = 64;

/// The key the re-sender looks for in the spool: the instance's rank span id, which its identity
/// (uid, commHash, collective key, rank) determines.
pub fn key(c: InstanceRef) -> u64 {
    let id = spans::rank_span_id(c.uid(), c.comm_hash, spans::instance_key(c), c.rank);
    u64::from_be_bytes(id)
}

/// What the re-sender is asked for of one dropped export: its instance's [`key`], and the root
/// span's times if the export carried one (the spooled instance may lack them; see the module).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Wanted {
    pub key: u64,
    pub root: Option<(u64, u64)>,
}

impl Wanted {
    pub fn of(c: InstanceRef) -> Wanted {
        Wanted {
            key: key(c),
            root: c.trace_root,
        }
    }
}

/// After a failed span export, the re-sender waits this long before it tries the collector again
/// (with the next batch it re-sends) if no live export has succeeded meanwhile: after a job's last
/// collective nothing else would tell it the collector is back.
pub const PROBE_AFTER: Duration = Duration::from_secs(5);

/// The instances whose spans were dropped and not yet re-sent, per job, and whether the collector
/// answers. Shared by the engine (queue full), the exporter (given up) and the re-sender.
pub struct Dropped {
    state: Mutex<State>,
    limit: usize,
    /// Milliseconds since `epoch` of the last failed span export; 0 once one succeeded. Metrics
    /// exports are not counted: a trace backend need not take metrics (Tempo answers
    /// `unimplemented`), and only the spans are re-sent.
    failed_at: AtomicU64,
    epoch: Instant,
    /// Wakes the re-sender: a key was remembered, or the collector answered after failing.
    wake: Notify,
}

#[derive(Default)]
struct State {
    jobs: BTreeMap<JobKey, Keys>,
    /// Keys remembered, including those a scan took and has not finished with.
    held: usize,
}

/// One job's dropped instances: every key, and the root times of those that carried a root (few:
/// one local rank's in a collective carries it).
#[derive(Debug, Default)]
struct Keys {
    all: HashSet<u64>,
    roots: HashMap<u64, (u64, u64)>,
}

impl Dropped {
    pub fn new(limit: usize) -> Dropped {
        Dropped {
            state: Mutex::new(State::default()),
            limit,
            failed_at: AtomicU64::new(0),
            epoch: Instant::now(),
            wake: Notify::new(),
        }
    }

    /// Remembers a dropped export of job (`uid`, `job`); past the bound it is counted as not
    /// re-sent instead. Cheap: the engine's ingest thread calls it.
    pub fn remember(&self, uid: u32, job: &str, w: Wanted, counters: &ExportCounters) {
        let mut s = lock(&self.state);
        if s.held >= self.limit {
            counters.not_resent.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let keys = s.jobs.entry((uid, job.to_string())).or_default();
        if let Some(root) = w.root {
            keys.roots.insert(w.key, root);
        }
        if keys.all.insert(w.key) {
            s.held += 1;
        }
        drop(s);
        // While the collector fails, the first success wakes the re-sender instead.
        if self.answering() {
            self.wake.notify_one();
        }
    }

    /// Records the outcome of a span export attempt; the first success after a failure wakes the
    /// re-sender.
    pub fn answered(&self, ok: bool) {
        if !ok {
            self.failed_at
                .store(self.now_ms().max(1), Ordering::Relaxed);
        } else if self.failed_at.swap(0, Ordering::Relaxed) != 0 {
            self.wake.notify_one();
        }
    }

    /// Whether re-sending may start: the last span export succeeded, or failed [`PROBE_AFTER`] ago.
    fn answering(&self) -> bool {
        let at = self.failed_at.load(Ordering::Relaxed);
        at == 0 || self.now_ms() >= at + PROBE_AFTER.as_millis() as u64
    }

    /// Whether one more instance may be queued: always while the collector answers; while it fails,
    /// one every [`PROBE_AFTER`], whose export says whether it answers again.
    fn may_send(&self) -> bool {
        let at = self.failed_at.load(Ordering::Relaxed);
        let now = self.now_ms();
        at == 0
            || (now >= at + PROBE_AFTER.as_millis() as u64
                && (self.failed_at)
                    .compare_exchange(at, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok())
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Takes one job's keys to re-send, while the collector answers.
    fn take_job(&self) -> Option<(JobKey, Keys)> {
        if !self.answering() {
            return None;
        }
        lock(&self.state).jobs.pop_first()
    }

    /// A scan finished with `n` keys it took.
    fn release(&self, n: usize) {
        let mut s = lock(&self.state);
        s.held = s.held.saturating_sub(n);
    }

    /// Keys remembered now (for tests and figures).
    pub fn held(&self) -> usize {
        lock(&self.state).held
    }
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Re-sends dropped instances from the spool into the live queue `spans` until the queue is closed
/// (the engine dropped its sender: the daemon is stopping).
pub async fn run(
    dropped: Arc<Dropped>,
    spool: SpoolReader,
    spans: mpsc::WeakSender<SpanItem>,
    counters: Arc<ExportCounters>,
) {
    loop {
        let Some((job, keys)) = dropped.take_job() else {
            if spans.upgrade().is_none() {
                return;
            }
            // A notification sent while no one waited is kept, so none is missed between the check
            // and the wait; the timeout notices a queue closed while nothing was dropped.
            let _ = tokio::time::timeout(Duration::from_secs(1), dropped.wake.notified()).await;
            continue;
        };
        let taken = keys.all.len();
        let open = resend_job(&dropped, &spool, job, keys, &spans, &counters).await;
        dropped.release(taken);
        if !open {
            return;
        }
    }
}

/// Scans one job's spool for the instances `keys` names and queues them; counts those it cannot
/// re-send. Returns whether the live queue is still open.
async fn resend_job(
    dropped: &Dropped,
    spool: &SpoolReader,
    job: JobKey,
    keys: Keys,
    spans: &mpsc::WeakSender<SpanItem>,
    counters: &ExportCounters,
) -> bool {
    let (found_tx, mut found) = mpsc::channel::<Shared>(SCAN_AHEAD);
    let reader = spool.clone();
    // Spool reads are blocking file I/O: a thread of their own, handing over what matches.
    let scan = tokio::task::spawn_blocking(move || {
        let Keys { mut all, mut roots } = keys;
        for record in reader.read_job(&job) {
            if found_tx.is_closed() {
                return all.len();
            }
            // A corrupt record ends its file: the instances past it count as not re-sent.
            let Ok(c) = record else { continue };
            let mut inst = Shared::from(&c);
            let k = key(inst.view());
            if !all.remove(&k) {
                continue;
            }
            if let Some(root) = roots.remove(&k) {
                inst.inst.trace_root = Some(root);
            }
            if found_tx.blocking_send(inst).is_err() {
                return all.len() + 1;
            }
            if all.is_empty() {
                break;
            }
        }
        all.len()
    });
    let mut pace = Pace::new();
    let mut closed = false;
    while let Some(inst) = found.recv().await {
        let Some(tx) = pace.room(dropped, spans).await else {
            closed = true;
            counters.not_resent.fetch_add(1, Ordering::Relaxed);
            break;
        };
        let item = SpanItem {
            coll: inst,
            acked: None,
            emit_no: 0,
            settles: None,
        };
        match tx.try_send(item) {
            Ok(()) => {
                counters.resent.fetch_add(1, Ordering::Relaxed);
            }
            // Full after all (the engine queued meanwhile): remembered again for the next scan.
            Err(mpsc::error::TrySendError::Full(item)) => {
                let c = item.coll.view();
                dropped.remember(c.uid(), c.job_id(), Wanted::of(c), counters);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                closed = true;
                counters.not_resent.fetch_add(1, Ordering::Relaxed);
                break;
            }
        }
    }
    if closed {
        found.close();
        while found.recv().await.is_some() {
            counters.not_resent.fetch_add(1, Ordering::Relaxed);
        }
    }
    let missing = scan.await.unwrap_or(0) as u64;
    counters.not_resent.fetch_add(missing, Ordering::Relaxed);
    !closed
}

/// The re-sender's pace: [`RESEND_PER_TICK`] per [`TICK`], and only into room live spans leave.
struct Pace {
    tick: tokio::time::Interval,
    budget: usize,
}

impl Pace {
    fn new() -> Pace {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Pace { tick, budget: 0 }
    }

    /// Waits until one more instance may be queued; `None` once the queue is closed.
    async fn room(
        &mut self,
        dropped: &Dropped,
        spans: &mpsc::WeakSender<SpanItem>,
    ) -> Option<mpsc::Sender<SpanItem>> {
        loop {
            if self.budget == 0 {
                self.tick.tick().await;
                self.budget = RESEND_PER_TICK;
            }
            let tx = spans.upgrade()?;
            // Live spans keep at least half the queue, and while the collector fails only a probe
            // goes (what fails comes back as the exporter gives it up).
            if tx.capacity() * 2 >= tx.max_capacity() && dropped.may_send() {
                self.budget -= 1;
                return Some(tx);
            }
            self.budget = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_bound_a_drop_is_counted_not_remembered() {
        let d = Dropped::new(2);
        let c = ExportCounters::default();
        let w = |key| Wanted { key, root: None };
        d.remember(1, "j", w(10), &c);
        d.remember(1, "j", w(10), &c);
        d.remember(2, "j", w(11), &c);
        d.remember(1, "k", w(12), &c);
        assert_eq!(d.held(), 2, "a key remembered twice is held once");
        assert_eq!(c.not_resent.load(Ordering::Relaxed), 1);
        d.answered(false);
        assert!(
            d.take_job().is_none(),
            "nothing is taken while the collector fails"
        );
        d.answered(true);
        let (job, keys) = d.take_job().unwrap();
        assert_eq!((job, keys.all.len()), ((1, "j".to_string()), 1));
        assert_eq!(d.held(), 2, "taken keys still count until their scan ends");
        d.release(1);
        assert_eq!(d.held(), 1);
    }
}
