//! The hold-and-parse: work items of one (communicator, channel) at a replay boundary that both an
//! eager operation and a graph replay can own, held until the items that follow decide. A pure
//! state machine: it asks its owner only whether an owner fits an item ([`Fit`]) and returns the
//! items it has decided, which the assembler then attributes.

use std::collections::VecDeque;

use ncclscope_proto::StrId;

use super::graph::ReplayCursor;
use super::lanes::{MAX_EARLY_WORKS, Work};

/// Eager operations, at most, that a [`Hold`] places among replays.
pub(super) const MAX_HOLD_EAGER: usize = 64;

/// An eager operation a [`Hold`] places, as it was when it joined the hold.
#[derive(Clone, Copy, Debug)]
pub(super) struct Candidate {
    pub id: u64,
    /// Its first record position: ids are reused once an operation is closed.
    pub first_pos: u64,
    pub func: StrId,
    pub enqueue_ns: u64,
}

/// Who owns a held work item in one [`Parse`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Owner {
    /// The hold's k-th eager candidate.
    Eager(usize),
    /// The i-th captured operation on the channel in the b-th replay the hold saw begin (b >= 1).
    Replay(usize, u32),
    /// Parses that reach the same state own it differently: it can never be decided.
    Ambiguous,
}

/// One way to read a hold's items: each is the next eager candidate or the next operation of a
/// replay's block (a replay's operations on a channel run back to back, eager operations in launch
/// order).
#[derive(Clone, Debug)]
pub(super) struct Parse {
    /// Eager candidates consumed.
    pub k: usize,
    /// Place in the current replay's block; 0 at a boundary.
    pub r: usize,
    /// Replays begun.
    pub blocks: u32,
    /// (place in the block, funcId) of the captured operations whose funcId is not known yet: the
    /// parse's first item for each; a later block must carry the same.
    pub learned: Vec<(usize, u32)>,
    /// Owner of each held item, in order.
    pub owners: VecDeque<Owner>,
}

/// Work items of one (communicator, channel) held from a replay boundary where both an eager
/// operation waiting there and the template's first operation on the channel fit the first item.
/// The CPU runs ahead of the GPU: an eager operation enqueued right after a graph launch already
/// waits when the replay's first item is read, though its own item comes after the replay's. Every
/// parse of the items (see [`Parse`]) that fits them is followed; the front items are attributed as
/// soon as all parses agree on them, and parses that reach the same state are merged, the items they
/// disagree on becoming ambiguous (dropped and counted, `dev_ambiguous`). The hold ends when one
/// parse is left and no item is held; the cursor and the lane then continue from its state.
#[derive(Debug)]
pub(super) struct Hold {
    /// The lane's waiting eager operations, in launch order; operations enqueued during the hold
    /// join at the end.
    pub eager: Vec<Candidate>,
    /// Captured operations on the channel: a replay's block.
    pub len: usize,
    /// The channel's cursor when the hold began (a boundary).
    pub cursor: ReplayCursor,
    /// Record position of the hold's first item: it holds the commit point until the hold ends, so
    /// a restarted daemon reads the hold again whole.
    pub first_pos: u64,
    /// workCounter of the latest item (a gap is a lost item: a place any owner fits).
    pub last_wc: u64,
    /// Items since `last_wc` that no collective owns (p2p rounds): in the gap, but not lost.
    pub foreign: u64,
    /// Items not attributed yet: (record position, workCounter, work; None for a lost one).
    pub items: VecDeque<(u64, u64, Option<Work>)>,
    /// The parses that fit every item so far, in distinct states.
    pub parses: Vec<Parse>,
    /// When the latest item was read.
    pub last_ns: u64,
    /// When the hold's first item still held was read: a hold older than the operation timeout
    /// whose items keep coming drops them, so that it does not hold the commit point for long.
    pub started_ns: u64,
}

/// What a hold asks of the operations it places items among (the assembler's dictionary, lanes
/// and template).
pub(super) trait Fit {
    /// Whether eager candidate `c` can own `work`.
    fn eager(&self, c: &Candidate, work: &Work) -> bool;
    /// Whether the `i`-th captured operation on the channel can own `work` (false if none).
    fn replay(&self, i: usize, work: &Work) -> bool;
    /// The funcId the `i`-th captured operation on the channel ran in earlier replays, if known.
    fn captured_func_id(&self, i: usize) -> Option<u32>;
}

/// A held item: (record position, workCounter, work; None for a lost one).
pub(super) type Item = (u64, u64, Option<Work>);

impl Hold {
    /// A hold beginning at the boundary where `cursor` stands, with the item of workCounter `wc`
    /// (given to [`Hold::step`] next) as its first; `len` captured operations on the channel.
    pub(super) fn new(
        len: usize,
        cursor: ReplayCursor,
        first_pos: u64,
        wc: u64,
        now_ns: u64,
    ) -> Hold {
        Hold {
            eager: Vec::new(),
            len,
            cursor,
            first_pos,
            last_wc: wc.wrapping_sub(1),
            foreign: 0,
            items: VecDeque::new(),
            parses: vec![Parse {
                k: 0,
                r: 0,
                blocks: 0,
                learned: Vec::new(),
                owners: VecDeque::new(),
            }],
            last_ns: now_ns,
            started_ns: now_ns,
        }
    }

    /// Items held that were read (not lost).
    pub(super) fn held(&self) -> usize {
        self.items.iter().filter(|i| i.2.is_some()).count()
    }

    /// Adds an item (None: a lost one) and advances every parse by it.
    pub(super) fn step(&mut self, pos: u64, wc: u64, work: Option<Work>, fit: &impl Fit) {
        self.items.push_back((pos, wc, work));
        let blocks = self.parses.iter().map(|p| p.blocks).max().unwrap_or(0);
        self.advance(work.as_ref(), fit);
        if self.parses.is_empty() {
            // No parse fits (an item lost unseen, a graph the template does not describe): the
            // channel lost its place. What is held is dropped, the candidates lose their item here,
            // and the parses start again at every place of a replay's block.
            self.cursor.replay += blocks;
            let (k, held) = (self.eager.len(), self.items.len() - 1);
            self.parses = (0..self.len.max(1))
                .map(|r| Parse {
                    k,
                    r,
                    blocks: (r > 0) as u32,
                    learned: Vec::new(),
                    owners: std::iter::repeat_n(Owner::Ambiguous, held).collect(),
                })
                .collect();
            self.advance(work.as_ref(), fit);
        }
    }

    /// Whether `owner` can own `work` in parse `p` (None: a lost item, which any owner can).
    fn fits(&self, p: &Parse, owner: Owner, work: Option<&Work>, fit: &impl Fit) -> bool {
        let Some(work) = work else {
            return true;
        };
        match owner {
            Owner::Eager(k) => fit.eager(&self.eager[k], work),
            Owner::Replay(i, _) => {
                fit.replay(i, work)
                    && (p.learned.iter()).all(|&(place, f)| place != i || f == work.func_id)
            }
            Owner::Ambiguous => false,
        }
    }

    /// Advances every parse by the latest item; merges parses that reach the same state.
    fn advance(&mut self, work: Option<&Work>, fit: &impl Fit) {
        let work = work.copied();
        let mut next: Vec<Parse> = Vec::with_capacity(self.parses.len() + 1);
        let parses = std::mem::take(&mut self.parses);
        for p in parses {
            let mut options = [None, None];
            if p.r > 0 {
                options[0] = Some(Owner::Replay(p.r, p.blocks));
            } else {
                if p.k < self.eager.len() {
                    options[0] = Some(Owner::Eager(p.k));
                }
                options[1] = Some(Owner::Replay(0, p.blocks + 1));
            }
            let fitting: Vec<Owner> = (options.into_iter().flatten())
                .filter(|&o| self.fits(&p, o, work.as_ref(), fit))
                .collect();
            for owner in fitting {
                let mut q = p.clone();
                match owner {
                    Owner::Eager(_) => q.k += 1,
                    Owner::Replay(i, b) => {
                        q.blocks = b;
                        q.r = if i + 1 == self.len { 0 } else { i + 1 };
                        if let Some(w) = &work
                            && q.learned.iter().all(|l| l.0 != i)
                            && fit.captured_func_id(i).is_none()
                        {
                            q.learned.push((i, w.func_id));
                        }
                    }
                    Owner::Ambiguous => {}
                }
                q.owners.push_back(owner);
                let state = |o: &Parse| (o.k, o.r, o.blocks);
                match next.iter_mut().find(|o| state(o) == state(&q)) {
                    Some(o) => {
                        // The same state reached two ways: what they disagree on is undecidable.
                        for (a, b) in o.owners.iter_mut().zip(&q.owners) {
                            if a != b {
                                *a = Owner::Ambiguous;
                            }
                        }
                        o.learned.retain(|l| q.learned.contains(l));
                    }
                    None => next.push(q),
                }
            }
        }
        self.parses = next;
    }

    /// Takes the front items every parse agrees on, each with its owner. Parses that still disagree
    /// this far back never will (equal functions throughout): such a front item comes out as
    /// [`Owner::Ambiguous`] and the parses go on. Owners held in all parses stay within 64 Ki.
    /// Call with at least one parse.
    pub(super) fn take_agreed(&mut self) -> Vec<(Item, Owner)> {
        let limit = (2 * self.len + self.eager.len() + 16)
            .min(MAX_EARLY_WORKS / 2)
            .min(65_536 / self.parses.len());
        let mut agreed = Vec::new();
        while let Some(&item) = self.items.front() {
            let mut owner = self.parses[0].owners[0];
            if self.parses.iter().any(|p| p.owners[0] != owner) {
                if self.items.len() <= limit {
                    break;
                }
                owner = Owner::Ambiguous;
            }
            self.items.pop_front();
            for p in &mut self.parses {
                p.owners.pop_front();
            }
            agreed.push((item, owner));
        }
        agreed
    }

    /// The one parse left once nothing is held: the lane and the cursor continue from its state.
    pub(super) fn decided(&self) -> Option<&Parse> {
        (self.parses.len() == 1 && self.items.is_empty()).then(|| &self.parses[0])
    }

    /// No more items will come: a parse in the middle of a replay's block, or with fewer candidates
    /// consumed than another, expects items that did not come and is ruled out; the parses left
    /// differ in nothing that can still be decided and are merged, what they disagree on ambiguous.
    pub(super) fn end(&mut self) {
        if self.parses.iter().any(|p| p.r == 0) {
            self.parses.retain(|p| p.r == 0);
        }
        if let Some(k) = self.parses.iter().map(|p| p.k).max() {
            self.parses.retain(|p| p.k == k);
        }
        while self.parses.len() > 1 {
            let q = self.parses.pop().expect("more than one");
            for (a, b) in self.parses[0].owners.iter_mut().zip(&q.owners) {
                if *a != *b {
                    *a = Owner::Ambiguous;
                }
            }
        }
    }

    /// Gives up what it holds (still undecided long after it began): returns the items and the
    /// number of eager candidates the furthest parse consumed; the parses go on from their places.
    pub(super) fn restart(&mut self) -> (VecDeque<Item>, usize) {
        let items = std::mem::take(&mut self.items);
        let k = self.parses.iter().map(|p| p.k).max().unwrap_or(0);
        let mut parses: Vec<Parse> = Vec::new();
        for mut p in std::mem::take(&mut self.parses) {
            (p.k, p.owners) = (k, VecDeque::new());
            if !parses.iter().any(|q| (q.r, q.blocks) == (p.r, p.blocks)) {
                parses.push(p);
            }
        }
        self.parses = parses;
        (items, k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Eager candidates own an item whose funcId is their function's string id; the template's
    /// operations on the channel run the funcIds in `template`.
    struct Toy {
        template: Vec<u32>,
    }

    impl Fit for Toy {
        fn eager(&self, c: &Candidate, work: &Work) -> bool {
            c.func.0 as u32 == work.func_id
        }
        fn replay(&self, i: usize, work: &Work) -> bool {
            self.template.get(i) == Some(&work.func_id)
        }
        fn captured_func_id(&self, i: usize) -> Option<u32> {
            self.template.get(i).copied()
        }
    }

    fn hold(template: &[u32], eager: &[u16]) -> (Hold, Toy) {
        let mut h = Hold::new(template.len(), ReplayCursor::default(), 10, 0, 0);
        h.eager = (eager.iter().enumerate())
            .map(|(i, &func)| Candidate {
                id: i as u64,
                first_pos: i as u64,
                func: StrId(func),
                enqueue_ns: 0,
            })
            .collect();
        let toy = Toy {
            template: template.to_vec(),
        };
        (h, toy)
    }

    fn item(func_id: u32) -> Option<Work> {
        Some(Work {
            func_id,
            gpu_start: 0,
            gpu_stop: 1,
        })
    }

    fn owners(agreed: &[(Item, Owner)]) -> Vec<Owner> {
        agreed.iter().map(|a| a.1).collect()
    }

    #[test]
    fn the_items_that_follow_decide_a_boundary_both_could_own() {
        // Replay of [42, 43] or the eager 42 first: after 42 43 42, the third is the eager op or
        // the next replay's first; the next two (42 43) leave "replay, eager, replay" alone.
        let (mut h, toy) = hold(&[42, 43], &[42]);
        for (wc, f) in [(0, 42), (1, 43), (2, 42)] {
            h.step(10 + wc, wc, item(f), &toy);
        }
        assert_eq!(
            owners(&h.take_agreed()),
            [Owner::Replay(0, 1), Owner::Replay(1, 1)]
        );
        assert!(h.decided().is_none(), "the third item is still disputed");
        for (wc, f) in [(3, 42), (4, 43)] {
            h.step(10 + wc, wc, item(f), &toy);
        }
        assert_eq!(
            owners(&h.take_agreed()),
            [Owner::Eager(0), Owner::Replay(0, 2), Owner::Replay(1, 2)]
        );
        let p = h.decided().expect("one parse, nothing held");
        assert_eq!((p.k, p.r, p.blocks), (1, 0, 2));
    }

    #[test]
    fn equal_functions_throughout_are_held_then_ambiguous() {
        // One captured 42 and one eager 42: which of three items is the eager op's is undecidable.
        let (mut h, toy) = hold(&[42], &[42]);
        for wc in 0..3 {
            h.step(10 + wc, wc, item(42), &toy);
        }
        assert!(
            h.take_agreed().is_empty(),
            "parses disagree: nothing decided yet"
        );
        assert!(h.decided().is_none());
        h.end();
        assert_eq!(owners(&h.take_agreed()), [Owner::Ambiguous; 3]);
        assert!(h.decided().is_some());
    }

    #[test]
    fn a_lost_item_fits_any_owner_and_an_item_that_fits_nowhere_ends_every_parse() {
        let (mut h, toy) = hold(&[42, 43], &[]);
        h.step(10, 0, item(42), &toy);
        h.step(11, 1, None, &toy); // 43 lost: the replay still fits
        h.step(12, 2, item(42), &toy);
        assert_eq!(
            owners(&h.take_agreed()),
            [
                Owner::Replay(0, 1),
                Owner::Replay(1, 1),
                Owner::Replay(0, 2)
            ]
        );
        // A funcId no operation runs, at no place of the block either: no parse is left (the
        // assembler then drops the hold, counted ambiguous).
        h.step(13, 3, item(99), &toy);
        assert!(h.parses.is_empty());
    }
}
