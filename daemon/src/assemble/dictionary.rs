//! What a process announced and every operation of it is read with: strings, device-function
//! names, calibrations, communicators; the uid budget they draw on; and the checks built on them
//! (whether a device function can be an operation's kernel, when a work item started on the host
//! clock).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ncclscope_proto::StrId;

use super::counters::AssembleCounters;
use super::graph::{CapturedOp, MAX_MARKS};
use super::lanes::Work;
use crate::bandwidth;
use crate::config::Limits;
use crate::fast_map::Map;
use crate::instance::Names;
use crate::storage::resume::{Calibration, CommInfo};

/// Dictionary entries (communicators, strings, device-function names, devices) held by every
/// segment of one uid together, shared by their assemblers: one user's processes cannot together
/// hold more than `limits.uid_max_dictionary`, however many segments they attach. Taken and given
/// back only where an entry is added or forgotten, never per operation.
#[derive(Debug)]
pub struct UidBudget {
    used: AtomicUsize,
    max: usize,
}

impl UidBudget {
    pub fn new(max: usize) -> Arc<UidBudget> {
        Arc::new(UidBudget {
            used: AtomicUsize::new(0),
            max,
        })
    }

    /// Entries held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    fn take(&self) -> bool {
        (self.used)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                (u < self.max).then_some(u + 1)
            })
            .is_ok()
    }
}

/// The process's dictionary (see the module documentation).
pub(super) struct Dict {
    /// Job, host and the strings defined so far; shared with the instances built from them.
    pub names: Arc<Names>,
    pub func_names: Map<u32, u16>,
    /// The device functions whose name holds NCCL's point-to-point kernel function's (`SendRecv`), kept
    /// with `func_names` (few: one per NCCL build in practice).
    p2p_funcs: Vec<u32>,
    pub calibrations: Map<i32, Calibration>,
    /// (record position, device, its calibration before) of each change past the committed tail,
    /// oldest first: the saved state holds the calibrations as of the tail, so an instance read
    /// again after a restart is timed as it was the first time. At most [`MAX_MARKS`]. A device's
    /// first calibration is saved at once: what is read again before it waits for it, as it did.
    calibrations_since_tail: VecDeque<(u64, i32, Calibration)>,
    pub comms: Map<u32, CommInfo>,
    /// Earliest CommEnd position among the finalized communicators held (u64::MAX: none), so a
    /// communicator refused at the limit costs a look at all of them only when one can go.
    first_end: u64,
    /// The set of communicators changed since [`Dict::take_comms_changed`].
    comms_changed: bool,
    /// Element size by datatype string id (cleared when strings change).
    datatype_bytes: Map<u16, Option<u64>>,
    pub limits: Limits,
    /// The uid's budget and what this process holds of it (given back on drop).
    uid: Arc<UidBudget>,
    uid_held: usize,
}

impl Drop for Dict {
    fn drop(&mut self) {
        self.uid.used.fetch_sub(self.uid_held, Ordering::Relaxed);
    }
}

/// Allowance for the plugin's host stamps (TSC readings converted to CLOCK_REALTIME, good to some
/// microseconds when the host is busy) when an enqueue is compared with a calibrated GPU time.
const HOST_STAMP_SLACK_NS: u64 = 50_000;

impl Dict {
    pub fn new(names: Names) -> Dict {
        Dict {
            names: Arc::new(names),
            func_names: Map::default(),
            p2p_funcs: Vec::new(),
            calibrations: Map::default(),
            calibrations_since_tail: VecDeque::new(),
            comms: Map::default(),
            first_end: u64::MAX,
            comms_changed: false,
            datatype_bytes: Map::default(),
            limits: Limits::default(),
            uid: UidBudget::new(usize::MAX),
            uid_held: 0,
        }
    }

    pub fn set_uid_budget(&mut self, uid: Arc<UidBudget>) {
        self.uid = uid;
    }

    /// One more dictionary entry from the uid's budget; counted `uid_limit` when there is none left.
    pub fn take_uid(&mut self, c: &mut AssembleCounters) -> bool {
        if self.uid.take() {
            self.uid_held += 1;
            return true;
        }
        c.uid_limit += 1;
        false
    }

    pub fn give_uid(&mut self, n: usize) {
        self.uid.used.fetch_sub(n, Ordering::Relaxed);
        self.uid_held -= n;
    }

    /// Takes `n` entries restored from a saved state whole, even beyond the uid's budget now.
    pub fn restored_uid(&mut self, n: usize) {
        self.uid.used.fetch_add(n, Ordering::Relaxed);
        self.uid_held += n;
    }

    /// Restores the saved strings, device-function names, calibrations and communicators.
    pub fn restore(
        &mut self,
        strings: Vec<(u16, String)>,
        func_names: Vec<(u32, u16)>,
        calibrations: Vec<(i32, Calibration)>,
        comms: Vec<CommInfo>,
    ) {
        let names = Arc::make_mut(&mut self.names);
        for (id, text) in strings {
            names.set(StrId(id), text);
        }
        self.func_names = func_names.into_iter().collect();
        self.index_p2p_funcs();
        self.calibrations = calibrations.into_iter().collect();
        self.comms = comms.into_iter().map(|c| (c.comm, c)).collect();
        self.first_end = (self.comms.values())
            .filter(|c| c.ended)
            .map(|c| c.ended_pos)
            .min()
            .unwrap_or(u64::MAX);
        let n = self.names.iter().count()
            + self.func_names.len()
            + self.calibrations.len()
            + self.comms.len();
        self.restored_uid(n);
    }

    /// The calibrations as of the committed tail (see `calibrations_since_tail`).
    pub fn calibrations_at_tail(&self) -> Vec<(i32, Calibration)> {
        let mut at = self.calibrations.clone();
        for &(_, dev, before) in self.calibrations_since_tail.iter().rev() {
            at.insert(dev, before);
        }
        at.into_iter().collect()
    }

    /// Forgets the calibration history before `tail`; whether anything went.
    pub fn prune(&mut self, tail: u64) -> bool {
        let mut moved = false;
        while (self.calibrations_since_tail.front()).is_some_and(|c| c.0 < tail) {
            self.calibrations_since_tail.pop_front();
            moved = true;
        }
        moved
    }

    /// Whether a communicator was announced, finalized or forgotten since the last call.
    pub fn take_comms_changed(&mut self) -> bool {
        std::mem::take(&mut self.comms_changed)
    }

    /// A `Str` record; whether the dictionary changed. The plugin defines each id once; the same
    /// definition read again (after a restart) changes nothing, another one is refused: an
    /// instance's strings never change under it, and a string costs at most one copy of its chunk.
    pub fn string(&mut self, id: StrId, text: &str, c: &mut AssembleCounters) -> bool {
        match self.names.defined(id).map(|t| *t == *text) {
            Some(true) => false,
            Some(false) => {
                c.string_limit += 1;
                false
            }
            None if id.0 as usize > self.limits.max_strings => {
                c.string_limit += 1;
                false
            }
            None if !self.take_uid(c) => false,
            None => {
                Arc::make_mut(&mut self.names).set(id, text.to_owned());
                self.datatype_bytes.clear();
                true
            }
        }
    }

    /// A `FuncName` record; whether the dictionary changed.
    pub fn func_name(&mut self, func_id: u32, name: StrId, c: &mut AssembleCounters) -> bool {
        let known = self.func_names.contains_key(&func_id);
        if self.func_names.get(&func_id) == Some(&name.0) {
            false
        } else if !known && self.func_names.len() >= self.limits.max_func_names {
            c.func_name_limit += 1;
            false
        } else if known || self.take_uid(c) {
            self.func_names.insert(func_id, name.0);
            self.index_p2p_funcs();
            true
        } else {
            false
        }
    }

    /// A `Calibration` record at `pos`: (whether the dictionary changed, whether operations
    /// waiting for the device's calibration can now be mapped: it is the first, or the one a
    /// first awaited, [`Calibration::awaits_second`]).
    pub fn calibration(
        &mut self,
        pos: u64,
        cuda_dev: i32,
        cal: Calibration,
        c: &mut AssembleCounters,
    ) -> (bool, bool) {
        let full = self.calibrations.len() >= self.limits.max_devices;
        let cal = cal.after(self.calibrations.get(&cuda_dev));
        match self.calibrations.get_mut(&cuda_dev) {
            Some(old) if *old == cal => (false, false),
            Some(old) => {
                if self.calibrations_since_tail.len() >= MAX_MARKS {
                    self.calibrations_since_tail.pop_front();
                }
                self.calibrations_since_tail
                    .push_back((pos, cuda_dev, *old));
                let released = old.awaits_second();
                *old = cal;
                (true, released)
            }
            None if full => {
                c.device_limit += 1;
                (false, false)
            }
            None if !self.uid.take() => {
                c.uid_limit += 1;
                (false, false)
            }
            None => {
                self.uid_held += 1;
                self.calibrations.insert(cuda_dev, cal);
                (true, !cal.awaits_second())
            }
        }
    }

    /// A `Comm` record: whether the dictionary changed, and the finalized communicators forgotten
    /// to make room for it (their records are all committed).
    pub fn comm(
        &mut self,
        info: CommInfo,
        committed: u64,
        c: &mut AssembleCounters,
    ) -> (bool, Vec<u32>) {
        let known = self.comms.contains_key(&info.comm);
        if self.comms.get(&info.comm) == Some(&info) {
            return (false, Vec::new());
        }
        let gone = if known {
            Vec::new()
        } else {
            self.forget_ended(committed)
        };
        if !known && self.comms.len() >= self.limits.max_comms {
            c.comm_limit += 1;
            return (false, gone);
        }
        if known || self.take_uid(c) {
            self.comms.insert(info.comm, info);
            self.comms_changed = true;
            return (true, gone);
        }
        (false, gone)
    }

    /// At the communicator limit: forgets finalized communicators whose CommEnd is before
    /// `committed` (no record of theirs can be read again); returns them.
    fn forget_ended(&mut self, committed: u64) -> Vec<u32> {
        if self.comms.len() < self.limits.max_comms || self.first_end >= committed {
            return Vec::new();
        }
        let gone: Vec<u32> = (self.comms.values())
            .filter(|c| c.ended && c.ended_pos < committed)
            .map(|c| c.comm)
            .collect();
        self.first_end = (self.comms.values())
            .filter(|c| c.ended && c.ended_pos >= committed)
            .map(|c| c.ended_pos)
            .min()
            .unwrap_or(u64::MAX);
        for comm in &gone {
            self.comms.remove(comm);
            self.give_uid(1);
        }
        if !gone.is_empty() {
            self.comms_changed = true;
        }
        gone
    }

    /// Marks `comm` finalized at `pos`; whether it was live.
    pub fn comm_ended(&mut self, comm: u32, pos: u64) -> bool {
        match self.comms.get_mut(&comm) {
            Some(c) if !c.ended => {
                c.ended = true;
                c.ended_pos = pos;
                self.first_end = self.first_end.min(pos);
                self.comms_changed = true;
                true
            }
            _ => false,
        }
    }

    /// Whether device function `func_id` is NCCL's point-to-point kernel work. One such work item is
    /// a round of a group's sends and receives (a send to one peer and a receive from another), on
    /// channels NCCL derives from its p2p schedule and that no host event names
    /// (docs/rfc-feedback.md): it never joins a collective's lane or a replay cursor.
    #[inline]
    pub fn is_p2p_work(&self, func_id: u32) -> bool {
        !self.p2p_funcs.is_empty() && self.p2p_funcs.contains(&func_id)
    }

    fn index_p2p_funcs(&mut self) {
        let names = &self.names;
        self.p2p_funcs = (self.func_names.iter())
            .filter(|&(_, &n)| names.get(StrId(n)).contains("SendRecv"))
            .map(|(&id, _)| id)
            .collect();
    }

    /// Whether `comm` is a live communicator on the device-hook path.
    #[inline]
    pub fn live_hook_comm(&self, comm: u32) -> bool {
        self.comms
            .get(&comm)
            .is_some_and(|c| c.device_hook && !c.ended)
    }

    /// The calibration of `comm`'s device, if it has one.
    pub fn calibration_of(&self, comm: u32) -> Option<Calibration> {
        let dev = self.comms.get(&comm)?.cuda_dev;
        self.calibrations.get(&dev).copied()
    }

    /// The latest host time `work` of `comm` can have started at (its calibrated GPU start plus the
    /// calibration error and [`HOST_STAMP_SLACK_NS`]); None without a calibration.
    pub fn started_by(&self, comm: u32, work: &Work) -> Option<u64> {
        let c = self.calibration_of(comm)?;
        Some(
            work.gpu_start
                .saturating_add_signed(c.offset_ns)
                .saturating_add(c.error_ns as u64 + HOST_STAMP_SLACK_NS),
        )
    }

    /// Whether a device function (by funcId) can be `func`'s kernel; unknown names match anything.
    pub fn work_matches(&self, func_id: u32, func: StrId) -> bool {
        let Some(&name) = self.func_names.get(&func_id) else {
            return true;
        };
        let (name, func) = (
            self.names.get(StrId(name)).as_bytes(),
            self.names.get(func).as_bytes(),
        );
        func.is_empty()
            || name
                .windows(func.len())
                .any(|w| w.eq_ignore_ascii_case(func))
    }

    /// Whether `work` of `comm` can be a replay of `op`: its function fits (see
    /// [`Self::work_matches_captured`]) and it did not start before `op` was captured. The second
    /// separates warm-up collectives from the first replay when both run the same functions in the
    /// same order (PyTorch warms up the very calls it then captures).
    pub fn replay_can_own(&self, comm: u32, work: &Work, op: &CapturedOp) -> bool {
        self.work_matches_captured(work.func_id, op)
            && self
                .started_by(comm, work)
                .is_none_or(|t| op.captured_ns <= t)
    }

    /// Whether a device function (by funcId) can be captured operation `op`'s kernel: as
    /// [`Self::work_matches`], the funcId is the one its earlier replays ran, and the protocol that
    /// ends the function's name (`..._LL`, `_LL128`, `_SIMPLE`) is the operation's, when these are
    /// known. A template's operations of one collective differ mostly by protocol (chosen by size):
    /// without this, an item one place off would fit.
    fn work_matches_captured(&self, func_id: u32, op: &CapturedOp) -> bool {
        const PROTOS: [&str; 3] = ["LL", "LL128", "SIMPLE"];
        if !self.work_matches(func_id, op.desc.func)
            || op.func_id.is_some_and(|f| f != func_id && f != u32::MAX)
        {
            return false;
        }
        let Some(&name) = self.func_names.get(&func_id) else {
            return true;
        };
        let last = self.names.get(StrId(name)).rsplit('_').next().unwrap_or("");
        let proto = self.names.get(op.desc.proto);
        proto.is_empty()
            || !PROTOS.iter().any(|p| last.eq_ignore_ascii_case(p))
            || last.eq_ignore_ascii_case(proto)
    }

    /// Bytes per element of the datatype string `id` names.
    #[inline]
    pub fn datatype_size(&mut self, id: StrId) -> Option<u64> {
        let names = &self.names;
        *self
            .datatype_bytes
            .entry(id.0)
            .or_insert_with(|| bandwidth::datatype_size(names.get(id)))
    }
}
