//! One attached segment: which process's it is, its ring and assembler, how far it was read, the
//! highest loss counters its plugin showed, whether its process ended, and its commit point.

use std::os::fd::OwnedFd;
use std::time::Instant;

use ncclscope_proto::segment::{Consumer, Counter};

use crate::assemble::Assembler;
use crate::loss::PluginCounts;
use crate::storage::spool::{JobKey, Origin};

use super::commit::{CommitPoint, Reading};

/// Which process's segment: the uid and pid the kernel reported for the process that handed it over
/// (the pid as seen from the daemon's PID namespace), and the memory file's inode, which tells a
/// process's segments apart while they exist. Names its resume state and its entries in systemd's
/// file descriptor store, as `<uid>.<pid>.<inode>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentKey {
    pub uid: u32,
    pub pid: u32,
    pub inode: u64,
}

impl SegmentKey {
    /// Whether a spooled instance's origin is of this segment.
    pub(super) fn made(&self, o: &Origin) -> bool {
        (o.uid, o.pid, o.inode) == (self.uid, self.pid, self.inode)
    }
}

impl std::fmt::Display for SegmentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.uid, self.pid, self.inode)
    }
}

impl std::str::FromStr for SegmentKey {
    type Err = ();

    fn from_str(s: &str) -> Result<SegmentKey, ()> {
        let mut it = s.splitn(3, '.').map(|p| p.parse::<u64>().map_err(|_| ()));
        let (uid, pid, inode) = (
            it.next().ok_or(())??,
            it.next().ok_or(())??,
            it.next().ok_or(())??,
        );
        Ok(SegmentKey {
            uid: u32::try_from(uid).map_err(|_| ())?,
            pid: u32::try_from(pid).map_err(|_| ())?,
            inode,
        })
    }
}

pub(super) struct Attached {
    pub key: SegmentKey,
    pub label: String,
    /// The highest value each plugin counter of the segment has shown. Its owner writes the header:
    /// a counter it lowers, or wraps, lowers nothing here.
    pub plugin_lost: PluginCounts,
    /// The registering process's connection; its end is the process's end.
    pub conn: Option<OwnedFd>,
    /// The spool's key of the process's job: (uid, job id).
    pub job: JobKey,
    pub consumer: Consumer,
    pub asm: Assembler,
    pub read_upto: u64,
    /// Records before this were written before the segment was attached to this daemon, after a
    /// restart (0 otherwise): the previous daemon may have read them.
    pub read_again_until: u64,
    /// Records lost in the segment as last seen (plugin loss counters, records of unknown
    /// operations, undecodable records): a rise is a gap (see `observe_gaps`).
    pub gaps: u64,
    pub exited: bool,
    /// Since when its process exited and everything it held was delivered and acknowledged but
    /// roots of its collectives (see `Segments::drained`).
    pub roots_only_since: Option<Instant>,
    pub commit: CommitPoint,
}

impl Attached {
    /// The commit point, and what it reads of the rest of the segment.
    pub fn split(&mut self) -> (&mut CommitPoint, Reading<'_>) {
        let r = Reading {
            label: &self.label,
            consumer: &mut self.consumer,
            asm: &mut self.asm,
            read_upto: self.read_upto,
        };
        (&mut self.commit, r)
    }

    /// Whether its process exited and everything it held was delivered, acknowledged and durable
    /// in the spool (its roots aside).
    pub fn drained(&self) -> bool {
        self.exited
            && self.consumer.pending() == 0
            && self.asm.pending() == 0
            && self.commit.settled()
    }

    /// Whether operations of it wait on their collectives' roots.
    pub fn roots_unsettled(&self) -> bool {
        !self.commit.roots.is_empty()
    }

    /// The number of the last state queued for it and not yet durable.
    pub fn last_state_queued(&self) -> Option<u64> {
        self.commit.last_saving()
    }

    pub fn observe_plugin_counters(&mut self) {
        for c in Counter::ALL {
            let v = &mut self.plugin_lost[c as usize];
            *v = (*v).max(self.consumer.segment().counter(c));
        }
    }

    /// After [`Self::observe_plugin_counters`]: whether records were lost since the last call,
    /// somewhere before the producer's head. The plugin counts a record it drops (ring or queue
    /// full, ...) before writing later ones, and the daemon counts records of operations it does not
    /// know as it reads them: an operation read so far may be missing one, and is parked rather than
    /// left to hold the tail until it times out.
    pub fn observe_gaps(&mut self) -> bool {
        let plugin = (Counter::ALL.iter())
            .filter(|c| c.is_loss())
            .fold(0u64, |t, &c| t.saturating_add(self.plugin_lost[c as usize]));
        let c = &self.asm.counters;
        let gaps = plugin
            .saturating_add(c.kernel_unjoined)
            .saturating_add(c.decode_errors);
        let rose = gaps > self.gaps;
        self.gaps = gaps;
        rose
    }
}
