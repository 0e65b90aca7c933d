//! The attached segments as they come and go: admission (or refusal, counted once however often a
//! plugin retries), the resume states not yet claimed after a restart, the end of a process, which
//! segments are drained, and what goes with a detached one (its state file, its descriptors in
//! systemd's store, its counters into the totals).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ncclscope_proto::segment::Segment;

use crate::assemble::{AssembleCounters, Assembler, UidBudget};
use crate::config::Config;
use crate::host::{notify, ratelimit};
use crate::loss::{Loss, PluginLosses, Refusals};
use crate::storage::resume;
use crate::storage::spool::JobKey;
use crate::storage::state_writer::StateWriter;

use super::segment::{Attached, SegmentKey};

/// How long after start a resume state waits for its segment to be handed over again (plugins retry
/// at least every 2 s) before it is taken for one whose process ended while no daemon ran.
const STATE_CLAIM_WINDOW: Duration = Duration::from_secs(300);
/// Longest a detached segment waits for its queued states before its state file is removed.
const FORGET_WAIT: Duration = Duration::from_secs(1);

/// A resume state file not yet claimed by a segment, and the (uid, communicator hash) of each
/// communicator it holds (the ranks expected back, see [`Segments::local_ranks`]).
type Unclaimed = (String, Vec<(u32, u64)>);

#[derive(Default)]
pub(super) struct Segments {
    pub list: Vec<Attached>,
    /// Plugin counters per uid (those of segments already reaped) and what the node-wide totals
    /// take in of them.
    pub plugin: PluginLosses,
    /// Assembler counters of segments already reaped.
    pub reaped_asm: AssembleCounters,
    /// Registrations refused, per uid (see [`Refusals`]).
    pub refusals: Refusals,
    /// Dictionary budget of each uid with segments attached (shared by its assemblers).
    uid_budgets: HashMap<u32, Arc<UidBudget>>,
    /// Segments detached as corrupt, refused if handed over again (the most recent
    /// `drain.max_segments`).
    broken: VecDeque<SegmentKey>,
    /// Segments refused for want of room (`drain.max_segments`, or their uid's
    /// `drain.max_segments_per_uid`) or because their file is attached already, each counted once
    /// however often its plugin retries (the most recent `drain.max_segments`); attached once there
    /// is room again, or the other reader of their file is gone.
    refused: VecDeque<SegmentKey>,
    /// Resume state files not yet claimed by a segment: removed once [`STATE_CLAIM_WINDOW`] passed.
    unclaimed_states: Option<Vec<Unclaimed>>,
    /// systemd's file descriptor store, where attached segments are kept across a restart.
    fd_store: bool,
}

impl Segments {
    pub fn new() -> Segments {
        Segments {
            fd_store: notify::fd_store_available(),
            ..Segments::default()
        }
    }

    /// The resume states in `dir`, each unclaimed until its segment is handed over again.
    pub fn load_unclaimed(&mut self, dir: &Path) {
        let states = resume::list(dir).into_iter().map(|label| {
            let uid = label.parse::<SegmentKey>().map(|k| k.uid);
            let comms = match (uid, resume::load(dir, &label)) {
                (Ok(uid), Ok(Some(st))) => (st.dictionary.comms.iter())
                    .map(|c| (uid, c.comm_hash))
                    .collect(),
                _ => Vec::new(),
            };
            (label, comms)
        });
        self.unclaimed_states = Some(states.collect());
    }

    /// Whether `key` is attached already; then its connection is replaced by `conn`, if any (the
    /// process reconnected).
    pub fn reconnect(&mut self, key: SegmentKey, conn: &mut Option<OwnedFd>) -> bool {
        let Some(s) = self.list.iter_mut().find(|s| s.key == key) else {
            return false;
        };
        if conn.is_some() {
            s.exited = false;
            s.conn = conn.take();
        }
        true
    }

    /// Why `segment` of `key` may not be attached, if it may not (counted once).
    pub fn refuse(
        &mut self,
        key: SegmentKey,
        segment: &Segment,
        cfg: &Config,
    ) -> Result<(), String> {
        if self.broken.contains(&key) {
            return Err("the segment was detached as corrupt".into());
        }
        let file = segment.file_id();
        if let Some(s) = (self.list.iter()).find(|s| s.consumer.segment().file_id() == file) {
            let why = format!(
                "its memory file is attached already, handed over by pid {}",
                s.key.pid
            );
            self.count_refusal(key, Loss::SegmentDuplicate, &why, cfg);
            return Err(why);
        }
        if self.list.len() >= cfg.drain.max_segments {
            let why = format!(
                "daemon is at drain.max_segments = {}",
                cfg.drain.max_segments
            );
            self.count_refusal(key, Loss::SegmentsRefused, &why, cfg);
            return Err(why);
        }
        // The uid is the registering peer's (SO_PEERCRED), which created the memory file.
        let uid = key.uid;
        let of_uid = self.list.iter().filter(|s| s.key.uid == uid).count();
        if of_uid >= cfg.drain.max_segments_per_uid {
            let why = format!(
                "uid {uid} already has {of_uid} segments attached (drain.max_segments_per_uid = {})",
                cfg.drain.max_segments_per_uid
            );
            self.count_refusal(key, Loss::UidSegmentQuota, &why, cfg);
            return Err(why);
        }
        Ok(())
    }

    /// Counts (and logs) a segment refused under `stage` (no room for it, or its file attached
    /// already), once however often it is retried.
    fn count_refusal(&mut self, key: SegmentKey, stage: Loss, why: &str, cfg: &Config) {
        if !self.refused.contains(&key) {
            if let Some(held_back) = ratelimit::lines().allow(key.uid) {
                tracing::warn!(segment = %key, reason = %why, held_back, "segment refused; attached if handed over again once it may be");
            }
            remember(&mut self.refused, key, cfg.drain.max_segments);
            self.refusals.add(key.uid, stage);
        }
    }

    /// The job and the assembler of `segment` of `key`, within its uid's dictionary budget.
    pub fn assembler(
        &mut self,
        key: SegmentKey,
        segment: &Segment,
        cfg: &Config,
    ) -> (JobKey, Assembler) {
        let claims = segment.claims();
        let pod = segment.pod();
        let uid = key.uid;
        let job: JobKey = (uid, claims.job_id.clone());
        self.uid_budgets.retain(|_, b| Arc::strong_count(b) > 1);
        let budget = (self.uid_budgets.entry(uid))
            .or_insert_with(|| UidBudget::new(cfg.limits.uid_max_dictionary))
            .clone();
        let asm = Assembler::new(
            key.pid,
            uid,
            claims.job_id.clone(),
            claims.hostname.clone(),
            cfg.aggregate.max_pending_ops,
        )
        .with_limits(cfg.limits.clone())
        .with_uid_budget(budget)
        .with_pod(pod)
        .with_slurm_job(claims.slurm_job_id.clone());
        (job, asm)
    }

    /// Attaches `seg`: claims its resume state, keeps it in systemd's store.
    pub fn add(&mut self, seg: Attached) {
        let (key, label) = (seg.key, &seg.label);
        tracing::info!(segment = %label, pid = key.pid, uid = key.uid, job = %seg.job.1, tail = seg.consumer.segment().tail(), head = seg.consumer.segment().head(), restored = seg.conn.is_none(), "segment attached");
        self.refused.retain(|k| *k != key);
        if let Some(states) = &mut self.unclaimed_states {
            states.retain(|s| s.0 != *label);
        }
        if self.fd_store {
            // Kept across a restart by systemd: the memory file, and the connection whose end tells
            // the next daemon that the process ended (systemd drops a stored socket once it hangs up).
            let fds: Vec<_> = std::iter::once(seg.consumer.segment().fd())
                .chain(seg.conn.as_ref().map(|c| c.as_fd()))
                .collect();
            let name = notify::segment_fd_name(label);
            if let Err(e) = notify::notify(&format!("FDSTORE=1\nFDNAME={name}"), &fds) {
                tracing::warn!(segment = %label, error = %e, "cannot keep the segment in systemd's file descriptor store");
            }
        }
        self.plugin.attached(key.uid);
        self.list.push(seg);
    }

    /// Marks the segments whose process ended: the kernel closed its end of the registration
    /// connection (a forked child does not keep it: the plugin closes the child's copy). Removes
    /// the resume states not claimed within [`STATE_CLAIM_WINDOW`] of `started`; whether it did.
    pub fn check_ended(&mut self, started: Instant, state_dir: &Path) -> bool {
        let mut buf = [0u8; 64];
        for seg in &mut self.list {
            let Some(conn) = &seg.conn else { continue };
            match rustix::net::recv(conn, &mut buf, rustix::net::RecvFlags::DONTWAIT) {
                // The plugin sends nothing after its request: anything else is ignored.
                Ok((_, 1..)) | Err(rustix::io::Errno::AGAIN) => {}
                Ok((_, 0)) | Err(_) => {
                    seg.exited = true;
                    seg.conn = None;
                }
            }
        }
        // Resume state of segments that were not handed over again after a restart: their process
        // ended while no daemon ran, and their segment with it.
        if started.elapsed() >= STATE_CLAIM_WINDOW
            && let Some(states) = self.unclaimed_states.take()
        {
            for (stale, _) in states {
                resume::remove(state_dir, &stale);
            }
            return true;
        }
        false
    }

    /// The ranks of each (uid, communicator) on this node: those of attached segments, and after a
    /// restart those of segments not handed over again yet (their plugins retry within seconds;
    /// without them, a rank that came back first would meet no other and its collectives' roots
    /// would wait for it in vain).
    pub fn local_ranks(&self) -> HashMap<(u32, u64), usize> {
        let mut m: HashMap<(u32, u64), usize> = HashMap::new();
        for s in &self.list {
            // Finalized communicators count too: their last collectives may still be awaited.
            for c in s.asm.all_comms() {
                *m.entry((s.asm.names().uid, c.comm_hash)).or_default() += 1;
            }
        }
        for (_, comms) in self.unclaimed_states.iter().flatten() {
            for &comm in comms {
                *m.entry(comm).or_default() += 1;
            }
        }
        m
    }

    /// Takes out the segment at `i` as corrupt: not attached again if handed over again (its
    /// cursors cannot be trusted).
    pub fn break_off(&mut self, i: usize, cfg: &Config) -> Attached {
        let seg = self.list.remove(i);
        remember(&mut self.broken, seg.key, cfg.drain.max_segments);
        seg
    }

    /// Takes out the next segment from `*i` on whose process exited once everything it held is
    /// delivered. Its roots' settlements hold such a segment at most `grace` (the skew window)
    /// more: every root of its collectives was sent by then (or known not to come), and only a kill
    /// before the exporter is done with it could lose one (a receiver that stays away holds the
    /// exporter for its retries).
    pub fn take_drained(&mut self, i: &mut usize, grace: Duration) -> Option<Attached> {
        while *i < self.list.len() {
            let s = &mut self.list[*i];
            let delivered = s.drained();
            if !delivered {
                s.roots_only_since = None;
            }
            let roots = s.roots_unsettled();
            let since = match delivered && roots {
                true => *s.roots_only_since.get_or_insert_with(Instant::now),
                false => Instant::now(),
            };
            if delivered && (!roots || since.elapsed() >= grace) {
                return Some(self.list.remove(*i));
            }
            *i += 1;
        }
        None
    }

    /// Removes what would bring a detached segment back: its resume state (once the states queued
    /// for it are written, so none comes back after) and its descriptors in systemd's store. The
    /// mapping and the memory file go with the [`Attached`] value.
    pub fn forget(&self, seg: &Attached, states: &StateWriter, state_dir: &Path) {
        if let Some(no) = seg.last_state_queued()
            && !states.wait(no, FORGET_WAIT)
        {
            tracing::warn!(segment = %seg.label, "resume state still being written; it may outlive its segment until the next restart");
        }
        resume::remove(state_dir, &seg.label);
        if self.fd_store {
            let name = notify::segment_fd_name(&seg.label);
            if let Err(e) = notify::notify(&format!("FDSTOREREMOVE=1\nFDNAME={name}"), &[]) {
                tracing::warn!(segment = %seg.label, error = %e, "cannot remove the segment from systemd's file descriptor store");
            }
        }
    }

    /// Takes a detached segment's counters into the totals.
    pub fn retire(&mut self, mut seg: Attached) {
        seg.observe_plugin_counters();
        let attached: Vec<u32> = self.list.iter().map(|s| s.key.uid).collect();
        (self.plugin).detached(seg.key.uid, &seg.plugin_lost, &attached);
        self.reaped_asm.add(&seg.asm.counters);
    }
}

/// Adds `key` to a bounded list of remembered segments, forgetting the oldest past `max`.
fn remember(list: &mut VecDeque<SegmentKey>, key: SegmentKey, max: usize) {
    if list.len() >= max.max(1) {
        list.pop_front();
    }
    list.push_back(key);
}
