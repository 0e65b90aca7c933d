//! A rank's point-to-point traffic per peer, for `stats` and `top`: pipeline stages and experts are
//! told apart by whom a rank sends to and receives from, which the per-collective series (keyed by
//! function, not peer, to keep Prometheus' cardinality bounded) fold together.

use std::collections::BTreeMap;

use ncclscope_proto::api::P2pStats;

use crate::histogram::Rolling;

/// Peers kept per rank (each direction counts): a rank of an all-to-all over more ranks folds the
/// rest into [`Peers::folded`] rather than growing without bound.
pub const MAX_PEERS_PER_RANK: usize = 256;

/// Send or receive, as NCCL names the function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Direction {
    Send,
    Recv,
}

impl Direction {
    /// The direction of a p2p function name (`Send`, `Recv`); `None` for anything else.
    pub fn of(func: &str) -> Option<Direction> {
        match func {
            "Send" => Some(Direction::Send),
            "Recv" => Some(Direction::Recv),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Direction::Send => "Send",
            Direction::Recv => "Recv",
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct PeerSeries {
    pub transfers: u64,
    pub bytes: u64,
    /// Transfers timed on the GPU, the only ones in the exec quantiles (host-timed ones have none).
    pub device_timed: u64,
    rolling_exec_ns: Rolling,
}

/// One rank's per-peer series.
#[derive(Clone, Debug, Default)]
pub struct Peers {
    series: BTreeMap<(Direction, i32), PeerSeries>,
    /// Transfers with a peer beyond [`MAX_PEERS_PER_RANK`]: counted here, in no peer's series.
    pub folded: u64,
}

/// One transfer as the per-peer series take it.
pub struct Transfer {
    pub direction: Direction,
    pub peer: i32,
    pub bytes: u64,
    pub exec_ns: u64,
    pub device_timed: bool,
}

impl Peers {
    pub fn record(&mut self, t: Transfer, now_ns: u64, window_ns: u64) {
        let full = self.series.len() >= MAX_PEERS_PER_RANK;
        let s = match self.series.get_mut(&(t.direction, t.peer)) {
            Some(s) => s,
            None if full => {
                self.folded += 1;
                return;
            }
            None => self.series.entry((t.direction, t.peer)).or_default(),
        };
        s.transfers += 1;
        s.bytes += t.bytes;
        s.device_timed += t.device_timed as u64;
        if t.device_timed {
            s.rolling_exec_ns
                .record(t.exec_ns as f64, now_ns, window_ns);
        }
    }

    /// The stats API's rows for this rank (rolling percentiles), peers in order.
    pub fn rows(&self, uid: u32, job_id: &str, comm_hash: u64, rank: u32) -> Vec<P2pStats> {
        self.series
            .iter()
            .map(|(&(direction, peer), s)| P2pStats {
                uid,
                job_id: job_id.to_string(),
                comm_hash,
                rank,
                func: direction.name().to_string(),
                peer,
                transfers: s.transfers,
                bytes: s.bytes,
                device_timed: s.device_timed,
                exec_p50_us: s.rolling_exec_ns.quantile(0.5) / 1000.0,
                exec_p99_us: s.rolling_exec_ns.quantile(0.99) / 1000.0,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(peer: i32, exec_ns: u64) -> Transfer {
        Transfer {
            direction: Direction::Send,
            peer,
            bytes: 1 << 20,
            exec_ns,
            device_timed: true,
        }
    }

    #[test]
    fn each_peer_and_direction_has_its_own_row() {
        let mut p = Peers::default();
        for _ in 0..3 {
            p.record(send(1, 10_000), 0, 1_000_000_000);
        }
        p.record(send(2, 40_000), 0, 1_000_000_000);
        p.record(
            Transfer {
                direction: Direction::Recv,
                device_timed: false,
                ..send(1, 20_000)
            },
            0,
            1_000_000_000,
        );
        let rows = p.rows(7, "j", 0xab, 0);
        let brief: Vec<_> = rows
            .iter()
            .map(|r| (r.func.as_str(), r.peer, r.transfers, r.device_timed))
            .collect();
        assert_eq!(
            brief,
            [("Send", 1, 3, 3), ("Send", 2, 1, 1), ("Recv", 1, 1, 0)]
        );
        assert_eq!(rows[0].bytes, 3 << 20);
        assert!((rows[1].exec_p50_us - 40.0).abs() < 2.0, "{rows:?}");
    }

    #[test]
    fn peers_beyond_the_bound_are_counted_not_kept() {
        let mut p = Peers::default();
        for peer in 0..MAX_PEERS_PER_RANK as i32 + 10 {
            p.record(send(peer, 1000), 0, 1_000_000_000);
        }
        p.record(send(0, 1000), 0, 1_000_000_000); // a kept peer still records
        assert_eq!(p.rows(0, "j", 0, 0).len(), MAX_PEERS_PER_RANK);
        assert_eq!(p.folded, 10);
        assert_eq!(p.rows(0, "j", 0, 0)[0].transfers, 2);
    }
}
