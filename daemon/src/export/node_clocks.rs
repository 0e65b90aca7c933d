//! One trace for a job across nodes. Each node's daemon times its ranks on its own CLOCK_REALTIME,
//! and nodes' clocks differ (NTP keeps them within milliseconds, PTP within microseconds) by more
//! than a collective's skew. The collectives themselves say by how much: the ranks of one instance
//! finish within microseconds of each other (its last data arrives at every rank together), so
//! where two nodes ran ranks of the same instances, the difference of their end times is the
//! difference of their clocks plus noise. A rank's end is where most of its channels end (their
//! median): a channel whose block ran late (not resident with the others) ends after the data. Its median over the instances is the estimate. Its error:
//! the spread of the differences around it (the central 80%), plus how far the ranks of one node
//! disagree on an instance's end (half of it, median: what the assumption of one end time is off
//! by), plus the ranks' calibration error bounds.

use std::collections::HashMap;

use ncclscope_proto::TimingSource;
use ncclscope_proto::api::Collective;
use serde_json::{Value, json};

/// Fewer shared instances than this estimate nothing.
pub const MIN_SHARED: usize = 3;

/// A collective instance across nodes: (uid, communicator, collective, seq, replay).
type Key = (u32, u64, String, u64, u32);

/// One node's ranks' end times per instance, gathered in a first pass over its export.
#[derive(Default)]
pub struct NodeEnds {
    /// The hosts the node's instances name (one, unless a host was renamed).
    pub hosts: Vec<String>,
    /// Per instance: the earliest and latest end among the node's ranks, and their largest
    /// calibration error.
    ends: HashMap<Key, (u64, u64, u32)>,
}

impl NodeEnds {
    pub fn add(&mut self, c: &Collective) {
        if !self.hosts.contains(&c.host) {
            self.hosts.push(c.host.clone());
        }
        // Sends and receives end on their own; host-timed work has no kernel end; an uncalibrated
        // clock is not the host's.
        if c.is_p2p
            || c.end_unix_ns == 0
            || TimingSource::parse(&c.timing_source) == TimingSource::Host
            || c.calibration_error_ns == u32::MAX
        {
            return;
        }
        let end = rank_end(c);
        let key = (c.uid, c.comm_hash, c.func.clone(), c.seq, c.replay);
        let e = self.ends.entry(key).or_insert((end, end, 0));
        *e = (e.0.min(end), e.1.max(end), e.2.max(c.calibration_error_ns));
    }
}

/// Where most of `c`'s channels end (the instance's end without channels).
fn rank_end(c: &Collective) -> u64 {
    let mut ends: Vec<u64> = (c.channels.iter())
        .map(|ch| ch.end_unix_ns)
        .filter(|&e| e != 0)
        .collect();
    if ends.is_empty() {
        return c.end_unix_ns;
    }
    ends.sort_unstable();
    ends[(ends.len() - 1) / 2]
}

/// A node's clock against the reference node's: its times less `offset_ns` are on the reference's
/// clock, good to `error_ns`.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeClock {
    pub hosts: Vec<String>,
    pub offset_ns: i64,
    pub error_ns: u64,
    /// Instances shared with the node it was estimated against (0 for the reference).
    pub instances: usize,
    /// The node it was estimated against (itself for the reference); None: it shares no instances
    /// with the others, and its clock is left as it was.
    pub against: Option<usize>,
}

impl NodeClock {
    pub fn to_json(&self) -> Value {
        json!({
            "hosts": self.hosts, "offset_ns": self.offset_ns, "error_ns": self.error_ns,
            "instances": self.instances, "estimated": self.against.is_some(),
        })
    }

    /// One line about node `index` (of the export's sources, from 0).
    pub fn describe(&self, index: usize) -> String {
        let node = format!("node {index} ({})", self.hosts.join(","));
        match self.against {
            None => format!(
                "{node}: shares fewer than {MIN_SHARED} collective instances with the others; its clock is left as it was"
            ),
            Some(_) if self.instances == 0 => format!("{node}: the reference clock"),
            Some(a) => format!(
                "{node}: clock {:+.3} us ± {:.3} us against node 0's (from {} instances' end times shared with node {a}); shifted onto it",
                self.offset_ns as f64 / 1000.0,
                self.error_ns as f64 / 1000.0,
                self.instances
            ),
        }
    }
}

/// (offset of `b` against `a`, its error, instances used), when they share enough instances.
fn pair(a: &NodeEnds, b: &NodeEnds) -> Option<(i64, u64, usize)> {
    let mid = |(lo, hi, _): (u64, u64, u32)| lo as i128 + (hi as i128 - lo as i128) / 2;
    let mut diffs = Vec::new();
    // Per shared instance: its ranks' disagreement within each node (half) and calibration errors.
    let mut within = Vec::new();
    for (key, &ea) in &a.ends {
        if let Some(&eb) = b.ends.get(key) {
            diffs.push((mid(eb) - mid(ea)) as i64);
            within.push((ea.1 - ea.0) / 2 + (eb.1 - eb.0) / 2 + u64::from(ea.2) + u64::from(eb.2));
        }
    }
    if diffs.len() < MIN_SHARED {
        return None;
    }
    diffs.sort_unstable();
    within.sort_unstable();
    let n = diffs.len();
    let median = diffs[n / 2];
    let (p10, p90) = (diffs[n / 10], diffs[n - 1 - n / 10]);
    let spread = (median - p10).max(p90 - median) as u64;
    Some((median, spread + within[n / 2], n))
}

/// Each node's clock against the first node's, or through a chain of nodes that share instances
/// (errors add along it).
pub fn estimate(nodes: &[NodeEnds]) -> Vec<NodeClock> {
    let mut clocks: Vec<NodeClock> = (nodes.iter())
        .map(|n| NodeClock {
            hosts: n.hosts.clone(),
            offset_ns: 0,
            error_ns: 0,
            instances: 0,
            against: None,
        })
        .collect();
    let Some(first) = clocks.first_mut() else {
        return clocks;
    };
    first.against = Some(0);
    let mut frontier = vec![0];
    while let Some(a) = frontier.pop() {
        for b in 0..nodes.len() {
            if clocks[b].against.is_some() {
                continue;
            }
            if let Some((offset, error, instances)) = pair(&nodes[a], &nodes[b]) {
                clocks[b] = NodeClock {
                    hosts: nodes[b].hosts.clone(),
                    offset_ns: clocks[a].offset_ns + offset,
                    error_ns: clocks[a].error_ns + error,
                    instances,
                    against: Some(a),
                };
                frontier.push(b);
            }
        }
    }
    clocks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end(host: &str, rank: u32, seq: u64, end: u64) -> Collective {
        Collective {
            host: host.into(),
            comm_hash: 9,
            func: "AllReduce".into(),
            rank,
            seq,
            timing_source: "device_hook".into(),
            start_unix_ns: end - 1000,
            end_unix_ns: end,
            calibration_error_ns: 300,
            ..Default::default()
        }
    }

    #[test]
    fn a_nodes_offset_is_the_median_difference_of_its_instances_end_times() {
        let t0 = 1_796_000_000_000_000_000u64;
        let (mut a, mut b, mut c) = (
            NodeEnds::default(),
            NodeEnds::default(),
            NodeEnds::default(),
        );
        for seq in 0..50u64 {
            let t = t0 + seq * 100_000;
            // Ends within a microsecond of each other; node b's clock 7 ms ahead, one outlier.
            a.add(&end("a", 0, seq, t + seq % 3 * 200));
            a.add(&end("a", 1, seq, t + 400));
            let noise = if seq == 7 { 900_000 } else { seq % 5 * 150 };
            b.add(&end("b", 2, seq, t + 7_000_000 + noise));
            // Node c shares instances with b only (another communicator's seq space with a).
            b.add(&Collective {
                comm_hash: 10,
                ..end("b", 0, seq, t + 7_000_000)
            });
            c.add(&Collective {
                comm_hash: 10,
                ..end("c", 1, seq, t - 2_000_000 + 100)
            });
        }
        let clocks = estimate(&[a, b, c, NodeEnds::default()]);
        assert_eq!(clocks[0].against, Some(0));
        let b = &clocks[1];
        assert!((b.offset_ns - 7_000_000).abs() < 1_000, "{b:?}");
        assert!(b.error_ns < 2_000 && b.error_ns >= 600, "{b:?}");
        assert_eq!((b.instances, b.against), (50, Some(0)));
        let c = &clocks[2];
        assert!((c.offset_ns + 2_000_000).abs() < 2_000, "{c:?}");
        assert_eq!(c.against, Some(1));
        assert!(c.error_ns > b.error_ns, "errors add along the chain: {c:?}");
        assert_eq!(clocks[3].against, None);
        assert!(clocks[3].describe(3).contains("left as it was"));
        let line = clocks[1].describe(1);
        assert!(line.starts_with("node 1 (b): clock +7000."), "{line}");
    }

    #[test]
    fn a_ranks_end_is_where_most_of_its_channels_end() {
        let ch = |end| ncclscope_proto::api::ChannelWork {
            end_unix_ns: end,
            ..Default::default()
        };
        let c = Collective {
            channels: vec![ch(9_000), ch(10_000), ch(10_000), ch(18_000)],
            ..end("a", 0, 0, 18_000)
        };
        assert_eq!(rank_end(&c), 10_000);
        assert_eq!(rank_end(&end("a", 0, 0, 18_000)), 18_000);
    }

    #[test]
    fn sends_host_timed_and_uncalibrated_work_do_not_count() {
        let mut n = NodeEnds::default();
        n.add(&Collective {
            is_p2p: true,
            ..end("a", 0, 1, 5_000)
        });
        n.add(&Collective {
            timing_source: "host".into(),
            ..end("a", 0, 2, 5_000)
        });
        n.add(&Collective {
            calibration_error_ns: u32::MAX,
            ..end("a", 0, 3, 5_000)
        });
        assert!(n.ends.is_empty());
        assert_eq!(n.hosts, ["a"]);
    }
}
