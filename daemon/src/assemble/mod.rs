//! Turns one process's record stream into completed collective (and p2p) instances: resolves strings
//! and communicators, joins each host Coll/P2p event with its kernel work, maps GPU time to host time.
//!
//! Joins: on the stock path a `KernelCh` names its operation (`parent` = the `CollStart` id), so the
//! join is exact. On the device-hook path a `DevWork` carries only (channel, funcId, workCounter): it
//! joins the oldest operation of its communicator still waiting for work on that channel (kernels of
//! one communicator run in order), checked against the funcId's name when the host supplied one.
//!
//! CUDA graphs (hook path): a Coll/P2p enqueued while its stream was captured produces its host event
//! once, at capture, and its work items at every replay, with no host event then. Captured operations
//! never wait in the lanes; they form the communicator's [`Template`], in capture order. A work item
//! goes to the oldest eager operation of its lane that can own it (funcId fits, enqueued before the
//! work started within the calibration error), otherwise to the template's replay cursor of its
//! (communicator, channel): the next captured operation on that channel, funcId checked (its name's
//! collective and protocol, and the funcId its earlier replays ran). A replay in progress on a channel
//! continues first (a graph's kernels run back to back: consecutive workCounters; a gap skips the
//! captured operations whose items were lost). At a replay boundary where both a waiting eager
//! operation and the template's first operation fit, nothing is guessed: the CPU runs ahead of the
//! GPU, so an eager operation enqueued after a graph launch waits while the replay's items are read.
//! The channel's items are held ([`Hold`]) and every parse of them (each item the next waiting eager
//! operation in launch order, or the next operation of a replay's block) is followed until the parses
//! agree on the oldest; items that parses reaching the same state disagree on can never be decided and
//! are dropped (`dev_ambiguous`), as are items still disputed far back (equal functions throughout).
//! Each replayed operation is one instance (captured seq, replay index r >= 1, counted per
//! communicator from the first replay, identical on every rank). A work item that fits nothing is
//! counted (`dev_unattributed`), never joined to a guess; an instance that ends with fewer channels'
//! work than it announced is counted (`dev_mismatch`) and dropped.

use std::collections::VecDeque;

use std::sync::Arc;

use ncclscope_proto::api::ChannelWork;
use ncclscope_proto::{MAX_CHANNELS, Record, StrId, TimingPath};

use crate::config::Limits;
use crate::fast_map::Map;
use crate::instance::{Desc, Names};
use crate::storage::resume::SavedDictionary;
use crate::storage::resume::{Calibration, CapturedOp, CommInfo, ReplayCursor, SavedOp};

mod build;
mod counters;
mod dictionary;
mod graph;
mod hold;
mod lanes;
mod operations;
mod p2p;
mod replay;
pub use counters::AssembleCounters;
use dictionary::Dict;
pub use dictionary::UidBudget;
use graph::{MAX_MARKS, MAX_TEMPLATE_OPS};
use hold::Candidate;
use lanes::{Lane, MAX_EARLY_WORKS, Read, Work};
pub use operations::Completed;
use operations::{CommOps, Op, OpIndex};
use p2p::{Placed, Schedules, Task};
use replay::{Decision, Held, Replays, Route, Settled, Step};

/// Sinks a previous daemon already delivered an operation to (persisted in the segment state).
pub mod done {
    /// Spool, live subscribers, statistics and metrics.
    pub const RECORDED: u8 = 1;
    /// OTLP spans (or decided not to export: sampled out, dropped and counted).
    pub const EXPORTED: u8 = 2;
    pub const ALL: u8 = RECORDED | EXPORTED;
}

/// Send/Recv numbering per (communicator, peer, function). NCCL gives p2p no sequence number, and
/// delivers each pair's transfers in order: the k-th Send from rank a to b and the k-th Recv at b from
/// a are one transfer, so both sides derive the same instance identity from k. Restart-safe as the
/// templates are: the numbers as of the committed tail are saved, the changes since then replayed.
#[derive(Default)]
struct P2pSeqs {
    next: Map<(u32, i32, u16), u64>,
    /// (record position, key) of each number given past the committed tail, oldest first.
    since_tail: VecDeque<(u64, (u32, i32, u16))>,
}

/// Distinct (comm, peer, function) numbered at most; beyond it, a p2p keeps the plugin's op id,
/// unique in its process, so it pairs with nothing rather than with the wrong transfer.
const MAX_P2P_KEYS: usize = 1 << 16;

impl P2pSeqs {
    fn take(&mut self, pos: u64, key: (u32, i32, u16), op_id: u64) -> u64 {
        if self.next.len() >= MAX_P2P_KEYS && !self.next.contains_key(&key) {
            return op_id;
        }
        self.since_tail.push_back((pos, key));
        let n = self.next.entry(key).or_insert(0);
        *n += 1;
        *n - 1
    }

    /// Forgets the history before `tail`; whether anything went (the saved numbers are then stale).
    fn prune(&mut self, tail: u64) -> bool {
        let before = self.since_tail.len();
        while self.since_tail.front().is_some_and(|e| e.0 < tail) {
            self.since_tail.pop_front();
        }
        self.since_tail.len() != before
    }

    /// The numbers as of the committed tail (after [`Self::prune`] up to it).
    fn at_tail(&self) -> Vec<(u32, i32, u16, u64)> {
        let mut at = self.next.clone();
        for (_, key) in &self.since_tail {
            *at.get_mut(key).expect("numbered") -= 1;
        }
        let mut v: Vec<_> = at.into_iter().map(|((c, p, f), n)| (c, p, f, n)).collect();
        v.sort_unstable();
        v
    }
}

/// Per-process assembly state.
pub struct Assembler {
    pid: u32,
    dict: Dict,
    /// Device-hook path: per (comm, channel), the operations awaiting work there, oldest first.
    waiting: Map<(u32, u8), Lane>,
    /// Device-hook path: graph templates, replay cursors and holds.
    replays: Replays,
    p2p_seqs: P2pSeqs,
    /// Device-hook path: the channels of eager sends and receives (their rounds of NCCL's p2p
    /// schedule).
    p2p: Schedules,
    /// A receive sharing its round's send's work items: send id -> (receive id, the channels where
    /// what joins the send joins the receive too).
    shares: Map<u64, (u64, u64)>,
    ops: Map<u64, Op>,
    /// (first record position, id) of operations in start order, which is position order (records
    /// are applied in stream order). Entries of finished operations go lazily; the front is always
    /// an operation in flight.
    by_pos: VecDeque<(u64, u64)>,
    /// Operations already delivered by a previous daemon: id -> (first record position, sinks).
    prior: Map<u64, (u64, u8)>,
    dictionary_changed: bool,
    max_pending: usize,
    comm_ops: CommOps,
    /// Complete operations waiting only for their device's first or second calibration, per device.
    awaiting_calibration: Map<i32, OpIndex>,
    /// Device-hook work items in all lanes (those in holds: [`Replays::held`]).
    early_works: usize,
    /// Committed tail (the latest passed to [`Self::prune_prior`]): records before it are never read
    /// again, and [`Self::dictionary`] describes the templates as they were there.
    committed: u64,
    /// [`Lane::pair`]'s buffer, kept between calls.
    paired: Vec<(u64, u64, Work)>,
    /// (record position, owner's first position, comm) of device-hook work items joined to an
    /// eager operation that started before them, in position order, at most [`MAX_MARKS`]: a
    /// restart whose tail falls between the two must not join the item again, to the next
    /// operation waiting there (saved as [`SavedTemplate::eager_items`], see [`Self::settled`]).
    eager_marks: VecDeque<(u64, u64, u32)>,
    /// Operations in flight that are parked (see [`Self::park`]).
    parked: usize,
    /// Operations continued from a previous daemon's state, and the read position it was saved as
    /// of: their records before it are in them already and, read again, are skipped.
    restored: Map<u64, u64>,
    /// Every parkable operation whose first record lies before this position was offered to
    /// [`Self::park`] (parked unless [`MAX_PARKED`] were).
    park_from: u64,
    pub counters: AssembleCounters,
}

/// Operations parked at once, at most: each is saved with every state written while it is in
/// flight. Beyond it an operation keeps the commit point as before (until the ring is half full).
pub const MAX_PARKED: usize = 4096;

impl Assembler {
    /// `uid`: the process's uid as the kernel reported it (see [`Names::uid`]).
    pub fn new(pid: u32, uid: u32, job_id: String, host: String, max_pending: usize) -> Assembler {
        Assembler {
            pid,
            dict: Dict::new(Names::new(uid, job_id, host)),
            waiting: Map::default(),
            replays: Replays::default(),
            p2p_seqs: P2pSeqs::default(),
            p2p: Schedules::default(),
            shares: Map::default(),
            ops: Map::default(),
            by_pos: VecDeque::new(),
            prior: Map::default(),
            dictionary_changed: false,
            max_pending,
            comm_ops: CommOps::default(),
            awaiting_calibration: Map::default(),
            early_works: 0,
            committed: 0,
            paired: Vec::new(),
            eager_marks: VecDeque::new(),
            parked: 0,
            restored: Map::default(),
            park_from: 0,
            counters: AssembleCounters::default(),
        }
    }

    /// Bounds what this process's records can make it hold (see [`Limits`]).
    pub fn with_limits(mut self, limits: Limits) -> Assembler {
        self.dict.limits = limits;
        self
    }

    /// The Kubernetes pod the process claims to run in (its segment's header), carried on its
    /// instances.
    pub fn with_pod(mut self, pod: ncclscope_proto::segment::Pod) -> Assembler {
        Arc::make_mut(&mut self.dict.names).pod = pod;
        self
    }

    /// Counts this process's dictionary against its uid's budget, shared with the uid's other segments.
    pub fn with_uid_budget(mut self, uid: Arc<UidBudget>) -> Assembler {
        self.dict.set_uid_budget(uid);
        self
    }

    /// The Slurm job the process claims to run in (its segment's header), carried on its instances.
    pub fn with_slurm_job(mut self, id: String) -> Assembler {
        Arc::make_mut(&mut self.dict.names).slurm_job_id = id;
        self
    }

    /// Resumes from a persisted dictionary and the operations a previous daemon delivered.
    pub fn restore(
        &mut self,
        dict: SavedDictionary,
        delivered: impl IntoIterator<Item = (u64, u64, u8)>,
    ) {
        self.dict
            .restore(dict.strings, dict.func_names, dict.calibrations, dict.comms);
        let captured = self.replays.restore(dict.templates);
        self.p2p.restore(&dict.p2p_widths);
        for comm in self.replays.comms() {
            self.place_captures(comm);
        }
        self.p2p_seqs = P2pSeqs {
            next: (dict.p2p_seqs.into_iter())
                .map(|(c, p, f, n)| ((c, p, f), n))
                .collect(),
            since_tail: VecDeque::new(),
        };
        self.prior = delivered
            .into_iter()
            .map(|(id, pos, flags)| (id, (pos, flags)))
            .collect();
        // What a previous daemon accepted is restored whole, even beyond the uid's budget now.
        self.dict.restored_uid(captured);
    }

    pub fn dictionary(&self) -> SavedDictionary {
        let mut d = SavedDictionary {
            strings: (self.dict.names.iter())
                .map(|(id, text)| (id.0, text.to_string()))
                .collect(),
            func_names: (self.dict.func_names.iter())
                .map(|(k, v)| (*k, *v))
                .collect(),
            calibrations: self.dict.calibrations_at_tail(),
            comms: self.dict.comms.values().cloned().collect(),
            templates: Vec::new(),
            p2p_seqs: self.p2p_seqs.at_tail(),
            p2p_widths: self.p2p.widths(),
        };
        // Items joined to an operation before the tail (with or without a template): a restart
        // must not join them again, to the next operation waiting there.
        let tail = self.committed;
        let joined = (self.eager_marks.iter())
            .filter(|&&(pos, owner, _)| pos >= tail && owner < tail)
            .map(|&(pos, _, comm)| (pos, comm));
        d.templates = self.replays.saved(tail, joined);
        d.strings.sort_unstable_by_key(|e| e.0);
        d.func_names.sort_unstable_by_key(|e| e.0);
        d.calibrations.sort_unstable_by_key(|e| e.0);
        d.comms.sort_unstable_by_key(|c| c.comm);
        d
    }

    /// Whether a communicator was announced, finalized or forgotten since the last call.
    pub fn take_comms_changed(&mut self) -> bool {
        self.dict.take_comms_changed()
    }

    /// Whether the dictionary changed since the last call.
    pub fn take_dictionary_changed(&mut self) -> bool {
        std::mem::take(&mut self.dictionary_changed)
            | self.replays.take_changed()
            | self.p2p.take_changed()
    }

    /// Communicators not finalized yet.
    pub fn comms(&self) -> impl Iterator<Item = &CommInfo> {
        self.dict.comms.values().filter(|c| !c.ended)
    }

    /// Every communicator announced, finalized ones included.
    pub fn all_comms(&self) -> impl Iterator<Item = &CommInfo> {
        self.dict.comms.values()
    }

    /// An interned string ("" if unknown).
    pub fn string(&self, id: u16) -> String {
        self.dict.names.get(StrId(id)).to_string()
    }

    /// Largest calibration error bound among this process's devices.
    pub fn max_calibration_error_ns(&self) -> u32 {
        self.dict
            .calibrations
            .values()
            .map(|c| c.error_ns)
            .max()
            .unwrap_or(0)
    }

    /// Deliveries by a previous daemon still relevant: (op id, first record position, sinks).
    pub fn prior_deliveries(&self) -> impl Iterator<Item = (u64, u64, u8)> + '_ {
        self.prior.iter().map(|(id, (pos, f))| (*id, *pos, *f))
    }

    pub fn job_id(&self) -> &str {
        &self.dict.names.job_id
    }

    /// The strings this process's instances refer to.
    pub fn names(&self) -> &Arc<Names> {
        &self.dict.names
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Position of the first record of the oldest operation still in flight and not parked, work
    /// item held, or captured send a receive may still join, at or after `from` (the committed
    /// tail): what lies before it cannot be read again,
    /// so it pins nothing. Something in flight lies before the tail after it was parked, or after a
    /// commit forced by a nearly full ring.
    pub fn oldest_pending_pos(&self, from: u64) -> Option<u64> {
        let held = self.replays.oldest_held(from);
        let capturing = self.p2p.oldest_open_capture(from);
        // `by_pos` is in position order: skip what lies before `from`, then its first live entry.
        let after = self.by_pos.partition_point(|&(pos, _)| pos < from);
        let open = (self.by_pos.range(after..))
            .find(|&&(pos, id)| {
                (self.ops.get(&id)).is_some_and(|o| o.first_pos == pos && !o.parked)
            })
            .map(|&(pos, _)| pos);
        open.into_iter().chain(held).chain(capturing).min()
    }

    /// Parks the operations in flight whose first record lies before `upto` and that were read
    /// before `read_before_ns`: the commit point no longer waits on them, and the resume state
    /// carries them instead ([`Self::parked_ops`]), so the tail moves past their records with the
    /// restart guarantee kept. For an operation whose record was lost (a gap the plugin counted), or
    /// that is slow to complete. Only operations joined by id (the KernelCh path, eager): the
    /// device-hook path joins work by order, which a restart could not continue from a saved
    /// operation. Returns how many were parked.
    pub fn park(&mut self, upto: u64, read_before_ns: u64) -> u64 {
        // The front is in flight (finished entries leave it eagerly) and the oldest read: if it
        // is younger, so is everything (the common case, one lookup per commit).
        if let Some(&(_, id)) = self.by_pos.front()
            && self
                .ops
                .get(&id)
                .is_some_and(|o| !o.parked && o.opened_ns >= read_before_ns)
        {
            return 0;
        }
        let mut n = 0;
        let from = self
            .by_pos
            .partition_point(|&(pos, _)| pos < self.park_from);
        for &(pos, id) in self.by_pos.range(from..) {
            if pos >= upto || self.parked >= MAX_PARKED {
                break;
            }
            let Some(op) = self.ops.get_mut(&id).filter(|o| o.first_pos == pos) else {
                self.park_from = pos + 1;
                continue; // finished
            };
            if op.opened_ns >= read_before_ns {
                break; // read in stream order: so are the ones after it
            }
            self.park_from = pos + 1;
            let hook = self.dict.comms.get(&op.comm).is_none_or(|c| c.device_hook);
            if op.parked || op.replay > 0 || hook {
                continue;
            }
            op.parked = true;
            self.parked += 1;
            n += 1;
        }
        n
    }

    /// Whether an operation in flight is parked.
    pub fn has_parked(&self) -> bool {
        self.parked > 0
    }

    /// The parked operations whose first record lies before `tail`, for the resume state (those
    /// at or after it are read again from their first record).
    pub fn parked_ops(&self, tail: u64) -> Vec<SavedOp> {
        if self.parked == 0 {
            return Vec::new();
        }
        let mut v: Vec<SavedOp> = (self.ops.iter())
            .filter(|(_, o)| o.parked && o.first_pos < tail)
            .map(|(&id, o)| o.saved(id))
            .collect();
        v.sort_unstable_by_key(|o| o.first_pos);
        v
    }

    /// Continues the operations a previous daemon parked (after [`Self::restore`]): their records
    /// before `upto` are in them already. Read at `now_ns`.
    pub fn restore_parked(&mut self, saved: &[SavedOp], upto: u64, now_ns: u64) {
        for s in saved.iter().take(MAX_PARKED) {
            if self.ops.contains_key(&s.id) || !self.dict.comms.contains_key(&s.comm) {
                continue;
            }
            let prior = self.prior.get(&s.id).map_or(0, |p| p.1);
            let mut op = Op::restored(s, now_ns, prior);
            op.host_only = s.desc.is_p2p && self.dict.comms[&s.comm].device_hook;
            self.restored.insert(s.id, upto);
            // Position order: restored before anything is read, and saved in that order.
            self.by_pos.push_back((s.first_pos, s.id));
            self.ops.insert(s.id, op);
            self.comm_ops
                .get_mut(s.comm)
                .push(s.first_pos, s.id, &self.ops);
            self.parked += 1;
        }
    }

    pub fn pending(&self) -> usize {
        self.ops.len()
    }

    /// Device-hook work items waiting in lanes and holds (what `max_early_works` bounds).
    #[cfg(test)]
    fn early_items(&self) -> usize {
        self.early_works + self.replays.held()
    }

    /// Forgets prior deliveries whose records are now committed (they can never be read again), and
    /// the replay cursors' history before `tail`; the next [`Self::dictionary`] is as of `tail`.
    /// Returns whether a replay cursor moved before `tail`: a state saved for an earlier tail is then
    /// no longer valid for this one.
    #[must_use]
    pub fn prune_prior(&mut self, tail: u64) -> bool {
        self.prior.retain(|_, (pos, _)| *pos >= tail);
        self.committed = self.committed.max(tail);
        let mut moved = self.p2p_seqs.prune(tail);
        while self.eager_marks.front().is_some_and(|m| m.0 < tail) {
            self.eager_marks.pop_front();
            moved = true;
        }
        moved |= self.eager_marks.iter().any(|&(_, owner, _)| owner < tail);
        moved |= self.dict.prune(tail);
        moved |= self.replays.prune(tail);
        moved
    }

    /// Applies one record at stream position `pos`; finished operations are appended to `out`.
    /// By reference: moving a `Record` by value cost a store-forwarding stall per record.
    pub fn apply(&mut self, pos: u64, record: &Record, now_ns: u64, out: &mut Vec<Completed>) {
        self.counters.records += 1;
        match *record {
            Record::Str { id, len, bytes } => {
                let text = String::from_utf8_lossy(&bytes[..len as usize]);
                self.dictionary_changed |= self.dict.string(id, &text, &mut self.counters);
            }
            Record::FuncName { func_id, name } => {
                self.dictionary_changed |= self.dict.func_name(func_id, name, &mut self.counters);
            }
            Record::Calibration {
                cuda_dev,
                offset_ns,
                error_ns,
                drift_ppb,
                host_ns,
            } => {
                let cal = Calibration {
                    offset_ns,
                    error_ns,
                    drift_ppb,
                    host_ns,
                    ..Calibration::default()
                };
                let (changed, release) =
                    (self.dict).calibration(pos, cuda_dev, cal, &mut self.counters);
                self.dictionary_changed |= changed;
                // Operations that were only waiting for this device's (second) calibration.
                if release && let Some(waiting) = self.awaiting_calibration.remove(&cuda_dev) {
                    let ids: Vec<u64> = waiting.live(&self.ops).collect();
                    for id in ids {
                        self.try_finish(id, out);
                    }
                }
            }
            Record::Comm {
                comm,
                comm_hash,
                rank,
                nranks,
                nnodes,
                cuda_dev,
                name,
                path,
                gpu,
                ..
            } => {
                let info = CommInfo {
                    comm,
                    comm_hash,
                    rank,
                    nranks,
                    nnodes,
                    cuda_dev,
                    name: name.0,
                    device_hook: path == TimingPath::DeviceHook,
                    ended: false,
                    ended_pos: 0,
                    gpu,
                };
                let (changed, gone) = self.dict.comm(info, self.committed, &mut self.counters);
                self.dictionary_changed |= changed;
                for comm in gone {
                    self.comm_ops.take(comm);
                }
            }
            Record::CommEnd { comm, .. } => {
                // No more work items of it: held ones are resolved with what came.
                for (key, _) in self.replays.holds(Some(comm)) {
                    self.resolve_ended(key, now_ns, out);
                }
                let ids: Vec<u64> = self.comm_ops.take(comm).live(&self.ops).collect();
                for id in ids {
                    self.finish(id, out);
                }
                // Its lanes by key (lanes exist below MAX_CHANNELS only): not a pass over all lanes.
                for ch in 0..MAX_CHANNELS {
                    if let Some(lane) = self.waiting.remove(&(comm, ch)) {
                        self.early_works -= lane.works.len();
                    }
                }
                if let Some(captured) = self.replays.remove(comm) {
                    self.dict.give_uid(captured);
                }
                self.p2p.remove(comm);
                self.dictionary_changed |= self.dict.comm_ended(comm, pos);
            }
            Record::CollStart {
                comm,
                id,
                seq,
                func,
                datatype,
                algo,
                proto,
                count,
                root,
                n_channels,
                host_ns,
                captured,
                ..
            } => {
                let desc = Desc {
                    seq,
                    is_p2p: false,
                    func,
                    datatype,
                    algo,
                    proto,
                    count,
                    root,
                    peer: -1,
                    n_channels,
                };
                let event = HostEvent {
                    comm,
                    id,
                    desc,
                    host_ns,
                    captured,
                };
                self.p2p.close_plan(comm);
                self.host_event(pos, event, now_ns, out);
            }
            Record::P2pStart {
                comm,
                id,
                func,
                datatype,
                count,
                peer,
                n_channels,
                host_ns,
                captured,
            } => {
                let seq = self.p2p_seqs.take(pos, (comm, peer, func.0), id);
                let desc = Desc {
                    seq,
                    is_p2p: true,
                    func,
                    datatype,
                    algo: StrId(0),
                    proto: StrId(0),
                    count,
                    root: -1,
                    peer,
                    n_channels,
                };
                let event = HostEvent {
                    comm,
                    id,
                    desc,
                    host_ns,
                    captured,
                };
                self.host_event(pos, event, now_ns, out);
            }
            Record::OpStop { comm, id, host_ns } => {
                self.p2p.close_plan(comm);
                if !self.restored.is_empty() && self.restored.get(&id).is_some_and(|&u| pos < u) {
                    return; // in the operation a previous daemon saved
                }
                if let Some(op) = self.ops.get_mut(&id) {
                    op.stop_ns = Some(host_ns);
                    op.last_progress_ns = now_ns;
                    if op_ready(&self.dict, op) {
                        self.finish(id, out);
                    } else {
                        self.await_calibration(id);
                    }
                }
            }
            Record::KernelCh {
                parent,
                channel,
                gpu_start,
                gpu_stop,
                host_ns,
                ..
            } => {
                if !self.restored.is_empty() && self.restored.get(&parent).is_some_and(|&u| pos < u)
                {
                    return; // in the operation a previous daemon saved
                }
                if let Some(op) = self.ops.get_mut(&parent) {
                    // One record per channel: more would grow the op (and keep it alive) forever.
                    let channels = if op.desc.n_channels == 0 {
                        MAX_CHANNELS
                    } else {
                        op.desc.n_channels.min(MAX_CHANNELS)
                    };
                    if op.channels.len() >= channels as usize {
                        self.counters.channel_limit += 1;
                        return;
                    }
                    // The plugin stamped the stop on the host after the GPU wrote it: host - gpu is an
                    // upper bound of the clock offset (tightest over the op's channels).
                    if host_ns > 0 && gpu_stop > 0 {
                        let anchor = (host_ns as i64).saturating_sub(gpu_stop as i64);
                        op.host_anchor = Some(op.host_anchor.map_or(anchor, |a| a.min(anchor)));
                    }
                    op.add_work(channel, gpu_start, gpu_stop, now_ns);
                    if op_ready(&self.dict, op) {
                        self.finish(parent, out);
                    } else if op.complete() {
                        self.await_calibration(parent);
                    }
                } else {
                    self.counters.kernel_unjoined += 1;
                }
            }
            // Phases refine a KernelCh that is already timed; the Collective has no place for them.
            Record::KernelPhase { .. } => {}
            Record::DevWork {
                comm,
                channel,
                func_id,
                work_counter,
                gpu_start,
                gpu_stop,
            } => {
                // Lanes only for the channels of a live hook-path communicator (any other work item
                // can never join: counted as dev_work - dev_joined), and work items in all lanes
                // bounded (each lane's also is).
                if !self.dict.live_hook_comm(comm) || channel >= MAX_CHANNELS {
                    self.counters.dev_work += 1;
                    return;
                }
                if let Some(ambiguous) =
                    (self.replays).take_settled(pos, (comm, channel), work_counter)
                {
                    self.counters.dev_work += 1;
                    match ambiguous {
                        true => self.counters.dev_ambiguous += 1,
                        false => self.counters.dev_joined += 1,
                    }
                    return;
                }
                let work = Work {
                    func_id,
                    gpu_start,
                    gpu_stop,
                };
                let read = Read {
                    pos,
                    key: (comm, channel),
                    wc: work_counter,
                    work,
                };
                // A p2p item joins a send or receive waiting on its channel, or nothing (it never
                // waits in a lane); where the graph template has captured operations on its
                // channel it is attributed as a collective's item is.
                if self.dict.is_p2p_work(func_id) {
                    self.narrow_p2p(&read, now_ns, out);
                    if !self.replays.uses_channel(comm, channel) {
                        self.counters.dev_work += 1;
                        self.replays.foreign((comm, channel), work_counter);
                        if !self.join_p2p(read, now_ns, out) {
                            self.counters.dev_p2p += 1;
                        }
                        return;
                    }
                }
                if self.early_works + self.replays.held() >= self.dict.limits.max_early_works {
                    self.counters.early_work_limit += 1;
                    return;
                }
                self.counters.dev_work += 1;
                if self.replays.has_template(comm) {
                    self.attribute(read, now_ns, out);
                    return;
                }
                let lane = self.waiting.entry((comm, channel)).or_default();
                if lane.works.len() >= MAX_EARLY_WORKS {
                    lane.works.pop_front(); // never joined: counted as dev_work - dev_joined
                    self.early_works -= 1;
                }
                self.early_works += 1;
                lane.works.push_back((pos, work));
                self.match_lane((comm, channel), now_ns, out);
            }
        }
    }

    /// A Coll or P2p host event at `pos`: captured into its communicator's graph template, or an
    /// operation now in flight.
    fn host_event(&mut self, pos: u64, e: HostEvent, now_ns: u64, out: &mut Vec<Completed>) {
        if e.captured {
            self.capture(e.comm, pos, e.desc, e.host_ns);
            return;
        }
        let op = Op::new(e.comm, pos, e.desc, e.host_ns, now_ns, 0);
        self.start(e.id, op, out);
    }

    /// Adds a captured operation to its communicator's template. Device-hook path only: on stock NCCL
    /// a replay's KernelCh events are counted and declined by the plugin, and a capture has no work.
    fn capture(&mut self, comm: u32, pos: u64, desc: Desc, captured_ns: u64) {
        let mut op = CapturedOp {
            pos,
            desc,
            captured_ns,
            func_id: None,
            channels: None,
            fused: None,
        };
        let Some(info) = self.dict.comms.get(&comm) else {
            self.counters.unknown_comm += 1;
            return;
        };
        if !info.device_hook {
            return;
        }
        if self.replays.captured(comm) >= MAX_TEMPLATE_OPS {
            self.counters.template_full += 1;
            return;
        }
        // A send or receive joins the template on the channels of its round, once they are known
        // (an eager transfer before the capture tells them); else its replays are counted.
        if desc.is_p2p {
            let task = self.p2p_task(0, &desc);
            let index = self.replays.captured(comm) as u32;
            let Some((channels, fused)) = self.p2p.capture(info, task, index, pos) else {
                self.counters.p2p_captured_untimed += 1;
                return;
            };
            (op.channels, op.fused) = (Some(channels), fused);
        }
        // A captured operation is kept as long as its communicator: it draws on the uid's
        // dictionary budget like a string or a communicator does.
        if !self.dict.take_uid(&mut self.counters) {
            return;
        }
        if self.replays.capture(comm, op) {
            // Work items held for eager operations not read yet: from now on an item that no eager
            // operation can own goes to the template instead.
            for (_, lane) in self.waiting.iter_mut().filter(|(k, _)| k.0 == comm) {
                self.early_works -= lane.works.len();
                lane.works.clear();
            }
        }
    }

    /// A work item of a communicator with a graph template: to an eager operation, to the replay
    /// cursor of its channel, held while both can own it, or counted (see the module documentation).
    fn attribute(&mut self, read: Read, now_ns: u64, out: &mut Vec<Completed>) {
        let key = read.key;
        let eager_waits = self.waiting.get(&key).is_some_and(|l| !l.ops.is_empty());
        let (waiting, ops, dict) = (&self.waiting, &self.ops, &self.dict);
        let fits = || eager_can_own(waiting, ops, dict, key, &read.work);
        match (self.replays).route(&read, eager_waits, fits, dict, now_ns) {
            Route::Hold => self.hold_item(read, now_ns, out),
            Route::Lane if self.dict.is_p2p_work(read.work.func_id) => {
                if !self.join_p2p(read, now_ns, out) {
                    self.counters.dev_p2p += 1;
                }
            }
            Route::Lane => {
                let lane = self.waiting.entry(key).or_default();
                lane.works.push_back((read.pos, read.work));
                self.early_works += 1;
                self.match_lane(key, now_ns, out);
            }
            Route::Replay => self.replay_item(read, None, now_ns, out),
        }
    }

    /// A work item to the replay cursor of its channel (set to `from` first, where a hold decided
    /// it), or counted if it fits nothing there.
    fn replay_item(
        &mut self,
        read: Read,
        from: Option<ReplayCursor>,
        now_ns: u64,
        out: &mut Vec<Completed>,
    ) {
        let (comm, ch) = read.key;
        let Some(step) = self.replays.advance(&read, from, &self.dict) else {
            self.counters.dev_unattributed += 1;
            return;
        };
        let id = step.id;
        if !self.ops.contains_key(&id) {
            self.start_replay(&step, &read, now_ns, out);
        }
        // The oldest replayed instances still waiting for this channel, which has moved on.
        let ops = &self.ops;
        let waits = |id| {
            let op = ops.get(&id)?;
            let uses = match op.desc.is_p2p {
                true => op.p2p_lanes & 1 << (ch % MAX_CHANNELS) != 0,
                false => ch < op.desc.n_channels.min(MAX_CHANNELS),
            };
            Some(uses && op.seen & 1 << (ch % MAX_CHANNELS) == 0)
        };
        for passed in self.replays.passed(comm, step.replay, step.index, waits) {
            self.finish(passed, out);
        }
        match self.ops.get_mut(&id) {
            Some(op) if op.seen & 1 << (ch % MAX_CHANNELS) == 0 => {
                op.add_work(ch, read.work.gpu_start, read.work.gpu_stop, now_ns);
                self.counters.dev_joined += 1;
                self.replays.ran(comm, step.index, read.work.func_id);
                self.try_finish(id, out);
            }
            _ => {
                self.counters.dev_unattributed += 1;
                return;
            }
        }
        // A replayed send's item on a channel it shares with its round's receive is that one's too.
        let (_, partner) = self.replays.p2p_of(comm, step.index);
        let Some(index) = partner else {
            return;
        };
        let (Some(shared), _) = self.replays.p2p_of(comm, index) else {
            return;
        };
        if shared & 1 << (ch % MAX_CHANNELS) == 0 {
            return;
        }
        let id = graph::replay_id(comm, index, step.replay);
        if !self.ops.contains_key(&id) {
            let Some(desc) = self.replays.desc(comm, index) else {
                return;
            };
            let step = Step {
                id,
                index,
                replay: step.replay,
                desc,
            };
            self.start_replay(&step, &read, now_ns, out);
        }
        if let Some(op) = self.ops.get_mut(&id)
            && op.seen & 1 << (ch % MAX_CHANNELS) == 0
        {
            op.add_work(ch, read.work.gpu_start, read.work.gpu_stop, now_ns);
            self.try_finish(id, out);
        }
    }

    /// Adds a work item to the hold of its (comm, ch) with the eager operations waiting there, and
    /// applies what the hold decides.
    fn hold_item(&mut self, read: Read, now_ns: u64, out: &mut Vec<Completed>) {
        let key = read.key;
        let ops = &self.ops;
        let candidates = (self.waiting.get(&key).into_iter())
            .flat_map(|lane| lane.ops.iter())
            .filter_map(|id| {
                let op = ops.get(id)?;
                Some(Candidate {
                    id: *id,
                    first_pos: op.first_pos,
                    func: op.desc.func,
                    enqueue_ns: op.enqueue_ns,
                })
            });
        match (self.replays).hold_item(&read, candidates, &self.dict, now_ns) {
            Held::Stepped => {
                let settled = self.replays.settle(key, &mut self.counters);
                self.apply_settled(key, settled, now_ns, out);
            }
            Held::Ended => {
                self.resolve_ended(key, now_ns, out);
                if self.replays.has_template(key.0) {
                    self.attribute(read, now_ns, out);
                }
            }
        }
    }

    /// Applies a hold's decisions in order, then sets its channel's cursor if it decided.
    fn apply_settled(
        &mut self,
        key: (u32, u8),
        settled: Settled,
        now_ns: u64,
        out: &mut Vec<Completed>,
    ) {
        for decision in settled.decisions {
            match decision {
                Decision::Join { pos, c, work } => self.join_eager(pos, key, c, work, now_ns, out),
                Decision::Abandon(c) => self.abandon(c, key, out),
                Decision::Replay { read, cursor } => {
                    self.replay_item(read, Some(cursor), now_ns, out)
                }
            }
        }
        if let Some(end) = settled.conclude {
            self.replays.conclude(key, end);
        }
    }

    /// See [`Replays::restart_undecided`].
    fn restart_undecided(&mut self, key: (u32, u8), now_ns: u64, out: &mut Vec<Completed>) {
        let settled = self.replays.restart_undecided(key, &mut self.counters);
        self.apply_settled(key, settled, now_ns, out);
    }

    /// See [`Replays::resolve`].
    fn resolve_ended(&mut self, key: (u32, u8), now_ns: u64, out: &mut Vec<Completed>) {
        let settled = self.replays.resolve(key, &mut self.counters);
        self.apply_settled(key, settled, now_ns, out);
    }

    /// Joins a held work item to the eager operation `id` (out of the lane's order: the hold decided).
    fn join_eager(
        &mut self,
        pos: u64,
        key: (u32, u8),
        c: Candidate,
        work: Work,
        now_ns: u64,
        out: &mut Vec<Completed>,
    ) {
        let id = c.id;
        let Some(op) = self.ops.get_mut(&id).filter(|o| o.first_pos == c.first_pos) else {
            // Closed meanwhile (timeout, overflow, its other channels' loss): the item was its.
            self.counters.dev_unattributed += 1;
            return;
        };
        op.add_work(key.1, work.gpu_start, work.gpu_stop, now_ns);
        let first_pos = op.first_pos;
        self.counters.dev_joined += 1;
        self.eager_mark(pos, first_pos, key.0);
        if let Some(lane) = self.waiting.get_mut(&key) {
            lane.ops.retain(|&x| x != id);
        }
        self.joined_p2p(id, key.1, &work, now_ns, out);
    }

    /// An eager operation lost its item on the lane `key`: it waits there no more, and is closed
    /// once its other channels are in (counted `dev_mismatch` or `incomplete`).
    fn abandon(&mut self, c: Candidate, key: (u32, u8), out: &mut Vec<Completed>) {
        let bit = 1 << (key.1 % MAX_CHANNELS);
        match self.ops.get_mut(&c.id) {
            Some(op) if op.first_pos == c.first_pos && op.seen & bit == 0 => op.lost |= bit,
            _ => return,
        }
        if let Some(lane) = self.waiting.get_mut(&key) {
            lane.ops.retain(|&x| x != c.id);
        }
        self.try_finish(c.id, out);
    }

    /// Opens the instance of a captured operation's replay (`step`) at its first work item.
    fn start_replay(&mut self, step: &Step, first: &Read, now_ns: u64, out: &mut Vec<Completed>) {
        let (pos, comm, id) = (first.pos, first.key.0, step.id);
        self.replays.opened(comm, step);
        let mut op = Op::new(comm, pos, step.desc, 0, now_ns, step.replay);
        op.prior = self.prior.get(&id).map_or(0, |p| p.1);
        if step.desc.is_p2p {
            op.p2p_lanes = self.replays.p2p_of(comm, step.index).0.unwrap_or(0);
        }
        self.by_pos.push_back((pos, id));
        self.ops.insert(id, op);
        self.comm_ops.get_mut(comm).push(pos, id, &self.ops);
        while self.ops.len() > self.max_pending {
            let &(_, oldest) = self.by_pos.front().expect("ops and by_pos agree");
            self.counters.pending_overflow += 1;
            self.finish(oldest, out);
        }
    }

    fn start(&mut self, id: u64, mut op: Op, out: &mut Vec<Completed>) {
        let Some(info) = self.dict.comms.get(&op.comm) else {
            self.counters.unknown_comm += 1;
            return;
        };
        if !self.prior.is_empty()
            && let Some(&(_, flags)) = self.prior.get(&id)
        {
            op.prior = flags;
        }
        // An eager send or receive waits on the channels of its round of NCCL's p2p schedule, once
        // they are known; where they cannot be, it completes with its host times.
        let mut placed = Vec::new();
        if info.device_hook && op.desc.is_p2p {
            let task = self.p2p_task(id, &op.desc);
            op.host_only = !self.p2p.enqueue(info, task, &mut placed);
        }
        let hook_lanes = if info.device_hook && !op.desc.is_p2p {
            op.desc.n_channels.min(MAX_CHANNELS)
        } else {
            0
        };
        for ch in 0..hook_lanes {
            self.waiting
                .entry((op.comm, ch))
                .or_default()
                .ops
                .push_back(id);
        }
        let (first_pos, comm, now_ns) = (op.first_pos, op.comm, op.last_progress_ns);
        self.by_pos.push_back((first_pos, id));
        if let Some(old) = self.ops.insert(id, op) {
            // A reused id: close the old one as it is rather than mixing the two.
            self.parked -= old.parked as usize;
            if !self.restored.is_empty() {
                self.restored.remove(&id);
            }
            self.counters.incomplete += 1;
            self.prune_by_pos();
        }
        self.comm_ops.get_mut(comm).push(first_pos, id, &self.ops);
        for ch in 0..hook_lanes {
            self.match_lane((comm, ch), now_ns, out);
        }
        if !placed.is_empty() {
            self.place_p2p(comm, placed, now_ns, out);
        }
        while self.ops.len() > self.max_pending {
            let &(_, oldest) = self.by_pos.front().expect("ops and by_pos agree");
            self.counters.pending_overflow += 1;
            self.finish(oldest, out);
        }
    }

    /// The send or receive `desc` as the p2p schedule sees it.
    fn p2p_task(&self, id: u64, desc: &Desc) -> Task {
        Task {
            id,
            send: self.dict.names.get(desc.func).eq_ignore_ascii_case("Send"),
            peer: desc.peer,
            n_channels: desc.n_channels,
        }
    }

    /// Sends and receives whose channels are now known wait on those lanes, in stream order among
    /// the operations there (one placed late goes before those enqueued after it); a receive's
    /// share of its send's items takes what the send already has.
    fn place_p2p(&mut self, comm: u32, placed: Vec<Placed>, now_ns: u64, out: &mut Vec<Completed>) {
        for p in placed {
            for (id, lanes) in p.lanes {
                let Some(first_pos) = self.ops.get_mut(&id).map(|op| {
                    op.p2p_lanes |= lanes;
                    op.first_pos
                }) else {
                    continue; // closed meanwhile
                };
                for ch in (0..MAX_CHANNELS).filter(|ch| lanes & 1 << ch != 0) {
                    let ops = &self.ops;
                    let lane = self.waiting.entry((comm, ch)).or_default();
                    let at = lane
                        .ops
                        .iter()
                        .rposition(|o| ops.get(o).is_none_or(|o| o.first_pos < first_pos))
                        .map_or(0, |i| i + 1);
                    lane.ops.insert(at, id);
                }
            }
            let Some((send, recv, shared)) = p.share.filter(|s| s.2 != 0) else {
                continue;
            };
            let had: Vec<ChannelWork> = (self.ops.get(&send).into_iter())
                .flat_map(|op| op.channels.iter())
                .filter(|c| shared & 1 << c.channel != 0)
                .copied()
                .collect();
            let Some(op) = self.ops.get_mut(&recv) else {
                continue;
            };
            for c in &had {
                op.add_work(c.channel as u8, c.start_unix_ns, c.end_unix_ns, now_ns);
            }
            let rest = had.iter().fold(shared, |m, c| m & !(1 << c.channel));
            if rest != 0 && self.ops.contains_key(&send) {
                self.shares.insert(send, (recv, rest));
            }
            self.try_finish(recv, out);
        }
    }

    /// A p2p work item that no send or receive waiting on its channel can own narrows the
    /// communicator's p2p schedule, which may place eager operations (they then wait on their
    /// lanes) and captured ones (they enter the graph template on their channels) it belongs to.
    fn narrow_p2p(&mut self, read: &Read, now_ns: u64, out: &mut Vec<Completed>) {
        let (comm, ch) = read.key;
        // Only while operations wait for the width (rarely, once it is known). An item a replay of
        // a captured send or receive may own tells nothing of the eager rounds' width: a
        // forwarding thread that fell behind drains one channel's ring whole, the replays' items
        // with it, before the ring of the channel an eager round ran on.
        if !self.p2p.awaits_width(comm)
            || self.p2p_owner(read).is_some()
            || self.replays.p2p_on_channel(comm, ch)
        {
            return;
        }
        let mut placed = Vec::new();
        let narrowed = self.p2p.item(comm, ch, &mut placed);
        if !placed.is_empty() {
            self.place_p2p(comm, placed, now_ns, out);
        }
        if narrowed {
            self.place_captures(comm);
        }
    }

    /// Enters `comm`'s captured sends and receives whose channels are known now into its template.
    fn place_captures(&mut self, comm: u32) {
        let Some(info) = self.dict.comms.get(&comm).cloned() else {
            return;
        };
        for (index, desc) in self.replays.unplaced(comm) {
            let task = self.p2p_task(0, &desc);
            if let Some(all) = self.p2p.captured_channels(&info, task) {
                self.replays.place(comm, index, all);
            }
        }
    }

    /// The oldest send or receive waiting on the item's lane, (its place there, id), if it can own
    /// the item: it was enqueued before the item started (an older item is none of theirs: a
    /// captured transfer's replay, or one whose operation closed).
    fn p2p_owner(&self, read: &Read) -> Option<(usize, u64)> {
        let lane = self.waiting.get(&read.key)?;
        let ops = &self.ops;
        let i = (lane.ops.iter()).position(|id| ops.get(id).is_some_and(|o| o.desc.is_p2p))?;
        let id = lane.ops[i];
        let op = &self.ops[&id];
        let started = self.dict.started_by(read.key.0, &read.work);
        let owns = started.is_none_or(|t| op.enqueue_ns <= t)
            && self.dict.work_matches(read.work.func_id, op.desc.func);
        owns.then_some((i, id))
    }

    /// Joins a p2p item to the oldest send or receive waiting on its lane, if it can own it.
    fn join_p2p(&mut self, read: Read, now_ns: u64, out: &mut Vec<Completed>) -> bool {
        let key = read.key;
        let Some((i, id)) = self.p2p_owner(&read) else {
            return false;
        };
        let lane = self.waiting.get_mut(&key).expect("the owner waits there");
        lane.ops.remove(i);
        if lane.is_empty() {
            self.waiting.remove(&key);
        }
        let op = self.ops.get_mut(&id).expect("in flight");
        op.add_work(key.1, read.work.gpu_start, read.work.gpu_stop, now_ns);
        let first_pos = op.first_pos;
        self.counters.dev_joined += 1;
        self.eager_mark(read.pos, first_pos, key.0);
        self.joined_p2p(id, key.1, &read.work, now_ns, out);
        true
    }

    /// An eager operation `id` got its item on `ch`: finished if that was its last, and the item
    /// joins the receive that shares it there, if one does.
    fn joined_p2p(&mut self, id: u64, ch: u8, work: &Work, now_ns: u64, out: &mut Vec<Completed>) {
        let partner = self.take_share(id, ch);
        self.try_finish(id, out);
        if let Some(p) = partner
            && let Some(op) = self.ops.get_mut(&p)
        {
            op.add_work(ch, work.gpu_start, work.gpu_stop, now_ns);
            self.try_finish(p, out);
        }
    }

    /// The receive that shares `owner`'s item on `ch`, if one does (once).
    fn take_share(&mut self, owner: u64, ch: u8) -> Option<u64> {
        let (partner, mask) = self.shares.get_mut(&owner)?;
        if *mask & 1 << ch == 0 {
            return None;
        }
        *mask &= !(1 << ch);
        let partner = *partner;
        if *mask == 0 {
            self.shares.remove(&owner);
        }
        Some(partner)
    }

    /// Joins a lane's waiting operations and early work items in order (see [`Lane::pair`]).
    fn match_lane(&mut self, key: (u32, u8), now_ns: u64, out: &mut Vec<Completed>) {
        let Some(lane) = self.waiting.get_mut(&key) else {
            return;
        };
        let (ops, dict) = (&self.ops, &self.dict);
        let mut joined = std::mem::take(&mut self.paired);
        let dropped = lane.pair(
            |id, work| (ops.get(&id)).map(|op| dict.work_matches(work.func_id, op.desc.func)),
            &mut joined,
        );
        if lane.is_empty() {
            self.waiting.remove(&key);
        }
        self.early_works -= joined.len() + dropped;
        self.counters.dev_joined += joined.len() as u64;
        for &(id, pos, work) in &joined {
            if let Some(op) = self.ops.get_mut(&id) {
                op.add_work(key.1, work.gpu_start, work.gpu_stop, now_ns);
                let first_pos = op.first_pos;
                self.eager_mark(pos, first_pos, key.0);
            }
            self.try_finish(id, out);
        }
        joined.clear();
        self.paired = joined;
    }

    /// Remembers that the work item at `pos` of `comm` joined the eager operation starting at `owner`.
    fn eager_mark(&mut self, pos: u64, owner: u64, comm: u32) {
        if owner >= pos {
            return; // read before its operation: a restart reads both again
        }
        if self.eager_marks.len() >= MAX_MARKS {
            self.eager_marks.pop_front();
        }
        let i = self.eager_marks.partition_point(|m| m.0 <= pos);
        self.eager_marks.insert(i, (pos, owner, comm));
    }

    /// Finishes `id` if it is [`Op::ready`].
    fn try_finish(&mut self, id: u64, out: &mut Vec<Completed>) {
        if self
            .ops
            .get(&id)
            .is_some_and(|op| op_ready(&self.dict, op) || op.settled())
        {
            self.finish(id, out);
        } else {
            self.await_calibration(id);
        }
    }

    /// Indexes `id` under its device if it is complete and waits only for the device's first
    /// calibration, so that calibration finishes it without looking at any other operation.
    fn await_calibration(&mut self, id: u64) {
        let Some(op) = self.ops.get_mut(&id) else {
            return;
        };
        if op.awaiting_calibration || !op.complete() || op.channels.is_empty() {
            return;
        }
        let Some(dev) = self.dict.comms.get(&op.comm).map(|c| c.cuda_dev) else {
            return;
        };
        // A device's first calibration has no drift yet: its operations wait for the second, due
        // 250 ms later, which maps them by interpolation (2.6 us better at an H100's 10.5 ppm).
        // Devices without calibration are as many as the process's communicators at most; beyond
        // that an operation waits for the sweep (CALIBRATION_WAIT_NS) instead.
        let known = self.awaiting_calibration.contains_key(&dev);
        if dev < 0
            || (self.dict.calibrations.get(&dev)).is_some_and(|c| !c.awaits_second())
            || (!known && self.awaiting_calibration.len() >= self.dict.limits.max_devices)
        {
            return;
        }
        op.awaiting_calibration = true;
        let first_pos = op.first_pos;
        self.awaiting_calibration
            .entry(dev)
            .or_default()
            .push(first_pos, id, &self.ops);
    }

    /// Complete operations wait this long for their device's first (or second) calibration, at most.
    const CALIBRATION_WAIT_NS: u64 = 1_000_000_000;

    /// Closes operations without progress for `timeout_ns`, and complete ones that waited
    /// [`Self::CALIBRATION_WAIT_NS`] for a calibration that did not come (flagged uncalibrated).
    pub fn sweep(&mut self, now_ns: u64, timeout_ns: u64, out: &mut Vec<Completed>) {
        // Holds older than the timeout whose items keep coming (parses stay undecided) drop what
        // they hold; holds whose items stopped coming, or whose candidates are about to time out,
        // are resolved with what came.
        for key in self.replays.undecided(now_ns, timeout_ns) {
            self.restart_undecided(key, now_ns, out);
        }
        let ops = &self.ops;
        let stale = |id| {
            ops.get(&id)
                .is_some_and(|o| now_ns.saturating_sub(o.last_progress_ns) >= timeout_ns)
        };
        for key in self.replays.stopped(now_ns, timeout_ns, stale) {
            self.resolve_ended(key, now_ns, out);
        }
        let wait = timeout_ns.min(Self::CALIBRATION_WAIT_NS);
        let mut stale: Vec<(u64, u64)> = self
            .ops
            .iter()
            .filter(|(_, op)| {
                let idle = now_ns.saturating_sub(op.last_progress_ns);
                idle >= timeout_ns || (op.complete() && idle >= wait)
            })
            .map(|(id, op)| (op.first_pos, *id))
            .collect();
        stale.sort_unstable();
        for (_, id) in stale {
            self.finish(id, out);
        }
    }

    /// Closes every operation in flight (the process is gone and its segment drained).
    pub fn finish_all(&mut self, out: &mut Vec<Completed>) {
        for (key, last_ns) in self.replays.holds(None) {
            self.resolve_ended(key, last_ns, out);
        }
        while let Some(&(_, id)) = self.by_pos.front() {
            self.finish(id, out);
        }
    }

    /// Drops the entries of finished operations from the front of `by_pos`, and all of them once
    /// they are the majority (an operation that stays in flight long keeps the front).
    fn prune_by_pos(&mut self) {
        let ops = &self.ops;
        let in_flight = |&(pos, id): &(u64, u64)| ops.get(&id).is_some_and(|o| o.first_pos == pos);
        while self.by_pos.front().is_some_and(|e| !in_flight(e)) {
            self.by_pos.pop_front();
        }
        if self.by_pos.len() > 2 * ops.len() + 1024 {
            self.by_pos.retain(in_flight);
        }
    }

    fn finish(&mut self, id: u64, out: &mut Vec<Completed>) {
        let Some(mut op) = self.ops.remove(&id) else {
            return;
        };
        self.parked -= op.parked as usize;
        if !self.restored.is_empty() {
            self.restored.remove(&id);
        }
        self.prune_by_pos();
        self.comm_ops.finished(op.comm, op.first_pos, id);
        let elem_bytes = self.dict.datatype_size(op.desc.datatype);
        // Looked up once for all that follows.
        let info = self.dict.comms.get(&op.comm);
        let hook = info.is_some_and(|c| c.device_hook);
        if hook && op.replay == 0 && !op.host_only {
            let leave = |ch| {
                if let Some(lane) = self.waiting.get_mut(&(op.comm, ch)) {
                    lane.ops.retain(|&x| x != id);
                }
            };
            if op.desc.is_p2p {
                (0..MAX_CHANNELS)
                    .filter(|ch| op.p2p_lanes & 1 << ch != 0)
                    .for_each(leave);
            } else {
                (0..op.desc.n_channels.min(MAX_CHANNELS)).for_each(leave);
            }
        }
        if !self.shares.is_empty() {
            self.shares.remove(&id);
        }
        // Work on some channels but not all: its exec time would be a guess.
        if hook
            && !op.channels.is_empty()
            && op.seen.count_ones() < op.desc.n_channels.min(MAX_CHANNELS) as u32
        {
            self.counters.dev_mismatch += 1;
            return;
        }
        // A send or receive whose channels or items did not come (see `p2p_item`) has its host
        // times, as one that was never placed.
        let host_timed = op.host_only || (hook && op.desc.is_p2p && op.channels.is_empty());
        if host_timed && op.stop_ns.is_some() {
            self.counters.p2p_host_timed += 1;
        } else if !op.complete() {
            self.counters.incomplete += 1;
        }
        let calibration = info
            .and_then(|c| self.dict.calibrations.get(&c.cuda_dev))
            .copied();
        if !op.channels.is_empty() && calibration.is_none() {
            match op.host_anchor {
                Some(_) => self.counters.host_anchored += 1,
                None => self.counters.uncalibrated += 1,
            }
        }
        if let Some(offset) = calibration.map(|c| c.offset_ns).or(op.host_anchor)
            && !build::plausible(&op, offset)
        {
            self.counters.implausible_time += 1;
            if op.replay > 0 {
                return; // nothing else times a replay
            }
            op.channels.clear(); // its host times only
        }
        let (first_pos, prior) = (op.first_pos, op.prior);
        let coll = build::instance(
            op,
            self.pid,
            &self.dict.names,
            info,
            calibration,
            elem_bytes,
        );
        out.push(Completed {
            coll,
            op_id: id,
            first_pos,
            prior,
        });
    }
}

/// A Coll or P2p as its host event starts it.
struct HostEvent {
    comm: u32,
    /// The plugin's handle id (unique among its operations in flight).
    id: u64,
    desc: Desc,
    host_ns: u64,
    captured: bool,
}

/// Whether an eager operation waiting on `key` can own `work`: the oldest whose function fits
/// ([`Assembler::match_lane`] takes that one) was enqueued before the work started (see
/// [`Dict::started_by`]).
fn eager_can_own(
    waiting: &Map<(u32, u8), Lane>,
    ops: &Map<u64, Op>,
    dict: &Dict,
    key: (u32, u8),
    work: &Work,
) -> bool {
    let Some(lane) = waiting.get(&key) else {
        return false;
    };
    let started = dict.started_by(key.0, work);
    let fits = |op: &&Op| dict.work_matches(work.func_id, op.desc.func);
    let owner = lane.ops.iter().filter_map(|id| ops.get(id)).find(fits);
    owner.is_some_and(|o| started.is_none_or(|t| o.enqueue_ns <= t))
}

/// Whether `op` can be finished (see [`Op::ready`]).
#[inline]
fn op_ready(dict: &Dict, op: &Op) -> bool {
    op.ready(|comm| match dict.comms.get(&comm) {
        Some(c) if c.cuda_dev >= 0 => {
            Some((dict.calibrations.get(&c.cuda_dev)).is_some_and(|cal| !cal.awaits_second()))
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests;
