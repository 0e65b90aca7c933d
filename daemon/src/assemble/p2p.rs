//! Where NCCL runs an eager send or receive on the device-hook path: the channels of its round of
//! the communicator's p2p schedule, so that the p2p kernel's work items join the transfers they
//! carry (docs/rfc-feedback.md has the facts, read from NCCL 2.30.7 and its kernels on an H100).
//!
//! On one node NCCL schedules a group's sends and receives in rounds (`src/init.cc`,
//! `ncclP2pSchedule`): a send to `p` is round `(p - rank) mod n`, a receive from `q` round
//! `(rank - q) mod n`. A plan's tasks are started round by round, a round's send before its receive,
//! and a round's send and receive are one work item per channel (`src/enqueue.cc`, `addP2pToPlan`):
//! a Recv whose host event directly follows its round's Send in the same plan shares that send's
//! items. The round runs on `max(nSend, nRecv)` channels from `reverseBits(round, log2 P)`, wrapping
//! modulo `P`, the communicator's `p2pnChannels` (`src/include/channel.h`), a power of two up to 64
//! that no event carries. The widths that could be `P` start as all seven; a work item that no
//! placed operation waits for narrows them to those under which a pending operation runs on its
//! channel. An operation is placed (waits on its channels' lanes) once every width left puts it on
//! the same channels: a self round (round 0) at once, a peer's round at the first item that tells.
//!
//! Several nodes (a quadratic group schedule over node topology no event carries), unknown ranks
//! or a width ruled out by every item: the operation is not placed, and completes with its host
//! times (`p2p_host_timed`).

use std::collections::VecDeque;

use crate::fast_map::Map;
use crate::storage::resume::CommInfo;

/// `log2 P` for every candidate width `P` = 1, 2, ..., 64 (NCCL's MAXCHANNELS).
const ALL_WIDTHS: u8 = 0x7f;

/// Operations whose channels the widths left do not agree on yet, per communicator at most: beyond
/// it the oldest is given up (host-timed).
const MAX_PENDING: usize = 256;

/// A send or receive as its host event starts it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Task {
    pub id: u64,
    pub send: bool,
    pub peer: i32,
    pub n_channels: u8,
}

/// What the assembler does with operations whose channels are now known: each `(id, channels)` of
/// `lanes` waits on those channels' lanes; `share`: (owner, partner, channels) where a receive
/// shares its round's send's items (the owner waits there, and whatever joins it there joins the
/// partner too).
#[derive(Debug, Default, PartialEq)]
pub(super) struct Placed {
    pub lanes: Vec<(u64, u64)>,
    pub share: Option<(u64, u64, u64)>,
}

/// One round's work: its send and receive (id, nChannels), either or both.
#[derive(Clone, Copy, Debug)]
struct Work {
    round: u32,
    send: Option<(u64, u8)>,
    recv: Option<(u64, u8)>,
}

#[derive(Default)]
struct CommSchedule {
    /// Bit `i`: a width of `2^i` channels is still possible.
    widths: u8,
    /// The last work started in the plan being read, while its round's receive may still join it,
    /// and its send's channels once placed.
    open: Option<(Work, Option<u64>)>,
    /// The same for a captured send: (round, its index in the graph template, its record's
    /// position, which the commit point does not pass while a receive may still join it).
    open_captured: Option<(u32, u32, u64)>,
    pending: VecDeque<Work>,
}

/// Per communicator: the widths left, the plan being read and the operations waiting for their
/// channels.
#[derive(Default)]
pub(super) struct Schedules {
    comms: Map<u32, CommSchedule>,
    /// A communicator's widths narrowed since [`Self::take_changed`] (they are saved).
    changed: bool,
}

/// The round of NCCL's one-node p2p schedule a task runs in; None on several nodes or for a peer
/// out of range.
fn round_of(info: &CommInfo, task: &Task) -> Option<u32> {
    let n = info.nranks;
    if info.nnodes != 1 || info.rank >= n || task.peer < 0 || task.peer as u32 >= n {
        return None;
    }
    let peer = task.peer as u32;
    Some(match task.send {
        true => (peer + n - info.rank) % n,
        false => (info.rank + n - peer) % n,
    })
}

/// The channels (a bit per channel) that round `round` runs on with `parts` channels, if the
/// communicator has `2^log2` p2p channels.
fn channels(log2: u32, round: u32, parts: u8) -> u64 {
    let p = 1u32 << log2;
    let low = round & (p - 1);
    let base = if log2 == 0 {
        0
    } else {
        low.reverse_bits() >> (32 - log2)
    };
    (0..parts as u32).fold(0, |m, part| m | 1 << ((base + part) & (p - 1)))
}

/// The channels every width in `widths` puts a task of `round` with `parts` channels on, if they
/// agree.
fn agreed(widths: u8, round: u32, parts: u8) -> Option<u64> {
    let mut at = (0..7).filter(|w| widths & 1 << w != 0);
    let first = channels(at.next()?, round, parts);
    at.all(|w| channels(w, round, parts) == first)
        .then_some(first)
}

/// `work`'s lanes, if every width in `widths` agrees on both its tasks' channels: the send waits on
/// its own, the receive on those the send does not run on, and shares the send's items elsewhere.
fn place(widths: u8, work: &Work) -> Option<Placed> {
    let own = |t: Option<(u64, u8)>| match t {
        None => Some(None),
        Some((id, n)) => agreed(widths, work.round, n.max(1)).map(|m| Some((id, m))),
    };
    let (send, recv) = (own(work.send)?, own(work.recv)?);
    let mut p = Placed::default();
    match (send, recv) {
        (Some(s), Some(r)) => {
            p.lanes = vec![s, (r.0, r.1 & !s.1)];
            p.share = Some((s.0, r.0, r.1 & s.1));
        }
        (Some(one), None) | (None, Some(one)) => p.lanes.push(one),
        (None, None) => {}
    }
    Some(p)
}

impl Schedules {
    /// A send or receive of `info`'s communicator enqueued: placements now known go to `placed`.
    /// False where the operation will not be placed (it completes with its host times).
    pub fn enqueue(&mut self, info: &CommInfo, task: Task, placed: &mut Vec<Placed>) -> bool {
        let Some(round) = round_of(info, &task) else {
            return false;
        };
        let s = self.comm(info.comm);
        s.narrow_to_parts(task.n_channels);
        if s.widths == 0 {
            return false;
        }
        let me = Some((task.id, task.n_channels));
        // A receive right after its round's send in the same plan: one work.
        if !task.send
            && let Some((work, sent)) =
                (s.open.take()).filter(|(w, _)| w.round == round && w.recv.is_none())
        {
            let Some(send_lanes) = sent else {
                // The send is pending: the receive waits with it.
                if let Some(p) = s.pending.iter_mut().rev().find(|p| p.send == work.send) {
                    p.recv = me;
                }
                s.place_agreed(placed);
                return true;
            };
            // The send waits on its lanes already: the receive's own channels, and a share.
            let alone = Work {
                send: None,
                recv: me,
                ..work
            };
            let Some(p) = place(s.widths, &alone) else {
                return false;
            };
            let (id, recv) = p.lanes[0];
            let send = work.send.expect("an open work has its send").0;
            placed.push(Placed {
                lanes: vec![(id, recv & !send_lanes)],
                share: Some((send, id, recv & send_lanes)),
            });
            return true;
        }
        let work = Work {
            round,
            send: if task.send { me } else { None },
            recv: if task.send { None } else { me },
        };
        if s.pending.len() >= MAX_PENDING {
            s.pending.pop_front(); // its operations complete with their host times
        }
        s.pending.push_back(work);
        let before = placed.len();
        s.place_agreed(placed);
        let sent = (placed[before..].last())
            .filter(|p| p.lanes.first().is_some_and(|l| l.0 == task.id))
            .map(|p| p.lanes[0].1);
        s.open = task.send.then_some((work, sent));
        true
    }

    /// A send or receive of `info`'s communicator captured into a CUDA graph, as the template's
    /// operation `index`: its channels (0 until every width left agrees on them: see
    /// [`Self::captured_channels`]), and, for a receive right after its round's send in the same
    /// plan, that send's index (the two share their items). `pos`: its record's position. None on
    /// several nodes.
    pub fn capture(
        &mut self,
        info: &CommInfo,
        task: Task,
        index: u32,
        pos: u64,
    ) -> Option<(u64, Option<u32>)> {
        let round = round_of(info, &task)?;
        let s = self.comm(info.comm);
        s.narrow_to_parts(task.n_channels);
        let fused = match task.send {
            true => None,
            false => (s.open_captured.take())
                .filter(|&(r, _, _)| r == round)
                .map(|(_, send, _)| send),
        };
        s.open_captured = task.send.then_some((round, index, pos));
        Some((
            agreed(s.widths, round, task.n_channels.max(1)).unwrap_or(0),
            fused,
        ))
    }

    /// The channels of a captured send or receive, once every width left agrees on them.
    pub fn captured_channels(&self, info: &CommInfo, task: Task) -> Option<u64> {
        let s = self.comms.get(&info.comm)?;
        agreed(s.widths, round_of(info, &task)?, task.n_channels.max(1))
    }

    /// The position of the oldest captured send at or after `from` that a receive may still join:
    /// a restart must read it again with that receive, or the two would be captured apart.
    pub fn oldest_open_capture(&self, from: u64) -> Option<u64> {
        (self.comms.values())
            .filter_map(|s| s.open_captured.map(|o| o.2))
            .filter(|&pos| pos >= from)
            .min()
    }

    /// The plan being read ended (its operations' stops, or another operation, were read): a
    /// receive no longer joins its last send.
    #[inline]
    pub fn close_plan(&mut self, comm: u32) {
        if self.comms.is_empty() {
            return; // no send or receive yet: the ingest path's every operation asks
        }
        if let Some(s) = self.comms.get_mut(&comm) {
            s.open = None;
            s.open_captured = None;
        }
    }

    fn comm(&mut self, comm: u32) -> &mut CommSchedule {
        self.comms.entry(comm).or_insert_with(|| CommSchedule {
            widths: ALL_WIDTHS,
            ..Default::default()
        })
    }

    /// Whether operations of `comm` wait for its width (only then can an item narrow it).
    pub fn awaits_width(&self, comm: u32) -> bool {
        self.comms.get(&comm).is_some_and(|s| !s.pending.is_empty())
    }

    /// A p2p work item on `channel` that no placed operation waits for: the widths under which no
    /// pending operation runs there are ruled out (unless that leaves none: the item is then
    /// another's, or early), and the operations now agreed on go to `placed`. Whether the widths
    /// narrowed.
    pub fn item(&mut self, comm: u32, channel: u8, placed: &mut Vec<Placed>) -> bool {
        let Some(s) = self.comms.get_mut(&comm).filter(|s| !s.pending.is_empty()) else {
            return false;
        };
        let parts = |w: &Work| {
            let n = |t: Option<(u64, u8)>| t.map_or(0, |t| t.1);
            n(w.send).max(n(w.recv)).max(1)
        };
        let explain = (0..7u32)
            .filter(|&w| s.widths & 1 << w != 0)
            .filter(|&w| {
                (s.pending.iter()).any(|p| channels(w, p.round, parts(p)) & 1 << channel != 0)
            })
            .fold(0u8, |m, w| m | 1 << w);
        if explain != 0 && explain != s.widths {
            self.changed = true;
            s.widths = explain;
            s.place_agreed(placed);
            return true;
        }
        false
    }

    /// (communicator, widths left) where items ruled some out, for the resume state.
    pub fn widths(&self) -> Vec<(u32, u8)> {
        let mut v: Vec<(u32, u8)> = (self.comms.iter())
            .filter(|(_, s)| s.widths != ALL_WIDTHS)
            .map(|(&c, s)| (c, s.widths))
            .collect();
        v.sort_unstable();
        v
    }

    /// Continues from the widths a previous daemon saved.
    pub fn restore(&mut self, widths: &[(u32, u8)]) {
        for &(comm, w) in widths {
            self.comm(comm).widths = w & ALL_WIDTHS;
        }
    }

    /// Whether widths narrowed since the last call.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// Forgets a finalized communicator.
    pub fn remove(&mut self, comm: u32) {
        self.comms.remove(&comm);
    }
}

impl CommSchedule {
    /// A width below a task's channel count cannot be NCCL's (`p2pnChannelsPerPeer <= P`).
    fn narrow_to_parts(&mut self, parts: u8) {
        let min_log2 = (parts.max(1) as u32).next_power_of_two().trailing_zeros();
        self.widths &= ALL_WIDTHS & !((1u8 << min_log2) - 1);
    }

    /// Places the pending works every width left agrees on (the others stay, in order).
    fn place_agreed(&mut self, placed: &mut Vec<Placed>) {
        let widths = self.widths;
        self.pending.retain(|w| match place(widths, w) {
            Some(p) => {
                placed.push(p);
                false
            }
            None => true,
        });
        if let Some((work, sent @ None)) = &mut self.open
            && !self.pending.iter().any(|p| p.send == work.send)
        {
            // Placed now: a receive that follows joins it by a share.
            *sent = placed.iter().rev().find_map(|p| {
                let first = *p.lanes.first()?;
                (Some(first.0) == work.send.map(|t| t.0)).then_some(first.1)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comm(rank: u32, nranks: u32, nnodes: u32) -> CommInfo {
        CommInfo {
            comm: 7,
            comm_hash: 1,
            rank,
            nranks,
            nnodes,
            cuda_dev: 0,
            name: 0,
            device_hook: true,
            ended: false,
            ended_pos: 0,
            gpu: None,
        }
    }

    fn task(id: u64, send: bool, peer: i32, n_channels: u8) -> Task {
        Task {
            id,
            send,
            peer,
            n_channels,
        }
    }

    #[test]
    fn rounds_run_from_their_bit_reversed_base() {
        // NCCL 2.30.7 on the H100, p2pnChannels 64: round 1 on 32 (and 33), round 0 on 0 (and 1).
        assert_eq!(channels(6, 1, 1), 1 << 32);
        assert_eq!(channels(6, 1, 2), 0b11 << 32);
        assert_eq!(channels(6, 0, 2), 0b11);
        // 8 ranks, 64 channels: rounds 1..7 at 32, 16, 48, 8, 40, 24, 56.
        let bases: Vec<u32> = (1..8).map(|r| channels(6, r, 1).trailing_zeros()).collect();
        assert_eq!(bases, [32, 16, 48, 8, 40, 24, 56]);
        // Parts wrap modulo the width; one channel in all is channel 0.
        assert_eq!(channels(2, 3, 2), 1 << 3 | 1 << 0);
        assert_eq!(channels(0, 5, 1), 1);
    }

    #[test]
    fn a_self_round_is_placed_at_once_and_a_peers_round_at_the_item_that_tells_its_width() {
        let mut s = Schedules::default();
        let info = comm(0, 2, 1);
        let mut placed = Vec::new();
        // all_to_all of 2 ranks, 1 MiB: self send + recv (round 0), peer send + recv (round 1).
        assert!(s.enqueue(&info, task(1, true, 0, 2), &mut placed));
        assert!(s.enqueue(&info, task(2, false, 0, 2), &mut placed));
        assert!(s.enqueue(&info, task(3, true, 1, 2), &mut placed));
        assert!(s.enqueue(&info, task(4, false, 1, 2), &mut placed));
        s.close_plan(7);
        // Round 0 runs on channels 0-1 whatever the width (two channels rule out a width of 1);
        // the receive shares the send's items there.
        assert_eq!(
            placed,
            [
                Placed {
                    lanes: vec![(1, 0b11)],
                    share: None,
                },
                Placed {
                    lanes: vec![(2, 0)],
                    share: Some((1, 2, 0b11)),
                }
            ]
        );
        // An item on channel 0 would be the self round's under every width: it tells nothing.
        placed.clear();
        s.item(7, 32, &mut placed);
        assert_eq!(
            placed,
            [Placed {
                lanes: vec![(3, 0b11 << 32), (4, 0)],
                share: Some((3, 4, 0b11 << 32)),
            }]
        );
        // The width is known now: the next group's peer round is placed at once.
        placed.clear();
        assert!(s.enqueue(&info, task(5, true, 1, 1), &mut placed));
        s.close_plan(7);
        assert!(s.enqueue(&info, task(6, false, 1, 1), &mut placed));
        assert_eq!(placed.len(), 2, "{placed:?}");
        assert_eq!(placed[0].lanes, [(5, 1 << 32)]);
        assert_eq!(placed[1].lanes, [(6, 1 << 32)], "another plan: not fused");
    }

    #[test]
    fn a_receive_joins_its_rounds_send_placed_before_it() {
        let mut s = Schedules::default();
        let info = comm(1, 2, 1);
        let mut placed = Vec::new();
        s.enqueue(&info, task(1, true, 0, 1), &mut placed);
        s.close_plan(7);
        s.item(7, 32, &mut placed);
        assert_eq!(placed[0].lanes, [(1, 1 << 32)]);
        // Pipeline step: a 1-channel send and a 2-channel receive to the same peer, one plan.
        placed.clear();
        s.enqueue(&info, task(2, true, 0, 1), &mut placed);
        s.enqueue(&info, task(3, false, 0, 2), &mut placed);
        assert_eq!(
            placed,
            [
                Placed {
                    lanes: vec![(2, 1 << 32)],
                    share: None
                },
                Placed {
                    lanes: vec![(3, 1 << 33)],
                    share: Some((2, 3, 1 << 32)),
                }
            ]
        );
    }

    #[test]
    fn a_capture_is_placed_once_the_width_is_known_and_a_receive_joins_its_send() {
        let mut s = Schedules::default();
        let info = comm(1, 2, 1);
        // Captured before any eager transfer told the width: the peer's round waits for it.
        assert_eq!(s.capture(&info, task(0, true, 0, 1), 0, 0), Some((0, None)));
        // A self round is the same under every width.
        assert_eq!(s.capture(&info, task(0, true, 1, 1), 1, 1), Some((1, None)));
        s.close_plan(7);
        // An eager round on channel 32 tells the width (64).
        let mut placed = Vec::new();
        s.enqueue(&info, task(9, true, 0, 1), &mut placed);
        s.close_plan(7);
        s.item(7, 32, &mut placed);
        // Now a captured send and the receive after it in the same plan: one work, shared items.
        assert_eq!(
            s.capture(&info, task(0, true, 0, 2), 5, 5),
            Some((0b11 << 32, None))
        );
        assert_eq!(
            s.capture(&info, task(0, false, 0, 1), 6, 6),
            Some((1 << 32, Some(5)))
        );
        // A receive of another plan is its own work.
        s.close_plan(7);
        assert_eq!(
            s.capture(&info, task(0, false, 0, 1), 7, 7),
            Some((1 << 32, None))
        );
    }

    #[test]
    fn several_nodes_or_unknown_peers_are_not_placed() {
        let mut s = Schedules::default();
        let mut placed = Vec::new();
        assert!(!s.enqueue(&comm(0, 16, 2), task(1, true, 9, 1), &mut placed));
        assert!(!s.enqueue(&comm(0, 2, 1), task(2, true, 2, 1), &mut placed));
        assert!(!s.enqueue(&comm(0, 2, 1), task(3, true, -1, 1), &mut placed));
        assert!(placed.is_empty());
    }
}
