//! Writes collective instances as OTLP/JSON trace data: JSON lines, each line one
//! `ExportTraceServiceRequest` (the format the OpenTelemetry Collector's `otlpjsonfile` receiver reads,
//! so a job's export can be replayed into any OTLP backend).
//!
//! Each rank's instance of a collective is a span with one child span per channel. All ranks of one
//! collective share a trace id derived from (communicator hash, seqNumber), and span ids derive from
//! (communicator, seq, rank[, channel]), so exports from different nodes land in the same trace without
//! coordination (DESIGN.md, "Cross-node traces").

use std::collections::BTreeMap;
use std::io::{self, Write};

use ncclscope_proto::api::Collective;
use serde_json::{Value, json};

use crate::perfetto::extent;

/// Spans per JSON line: bounded lines, and each one a request a collector accepts.
const SPANS_PER_LINE: usize = 2048;
const SPAN_KIND_INTERNAL: u32 = 1;

pub struct OtlpJsonWriter<W: Write> {
    out: W,
    /// Pending spans per resource (job, host, pid).
    pending: BTreeMap<(String, String, u32), Vec<Value>>,
    pending_spans: usize,
    collectives: u64,
}

impl<W: Write> OtlpJsonWriter<W> {
    pub fn new(out: W) -> Self {
        OtlpJsonWriter {
            out,
            pending: BTreeMap::new(),
            pending_spans: 0,
            collectives: 0,
        }
    }

    pub fn collectives(&self) -> u64 {
        self.collectives
    }

    pub fn write(&mut self, c: &Collective) -> io::Result<()> {
        let trace_id = trace_id(c.comm_hash, c.seq);
        let root_id = span_id(c.comm_hash, c.seq, c.rank, None);
        let (start, end) = extent(c);
        let mut spans = vec![json!({
            "traceId": hex(&trace_id),
            "spanId": hex(&root_id.to_be_bytes()),
            "name": c.func,
            "kind": SPAN_KIND_INTERNAL,
            "startTimeUnixNano": start.to_string(),
            "endTimeUnixNano": end.to_string(),
            "attributes": attributes(c),
        })];
        for ch in &c.channels {
            spans.push(json!({
                "traceId": hex(&trace_id),
                "spanId": hex(&span_id(c.comm_hash, c.seq, c.rank, Some(ch.channel)).to_be_bytes()),
                "parentSpanId": hex(&root_id.to_be_bytes()),
                "name": format!("{} channel {}", c.func, ch.channel),
                "kind": SPAN_KIND_INTERNAL,
                "startTimeUnixNano": ch.start_unix_ns.to_string(),
                "endTimeUnixNano": ch.end_unix_ns.max(ch.start_unix_ns).to_string(),
                "attributes": [kv_int("nccl.channel", ch.channel.into()), kv_int("nccl.work_items", ch.work_items.into())],
            }));
        }
        self.pending_spans += spans.len();
        self.pending
            .entry((c.job_id.clone(), c.host.clone(), c.pid))
            .or_default()
            .extend(spans);
        self.collectives += 1;
        if self.pending_spans >= SPANS_PER_LINE {
            self.flush_line()
        } else {
            Ok(())
        }
    }

    pub fn finish(mut self) -> io::Result<W> {
        self.flush_line()?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn flush_line(&mut self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let resource_spans: Vec<Value> = std::mem::take(&mut self.pending)
            .into_iter()
            .map(|((job, host, pid), spans)| {
                json!({
                    "resource": {"attributes": [
                        kv_str("service.name", "ncclscope"),
                        kv_str("ncclscope.job_id", &job),
                        kv_str("host.name", &host),
                        kv_int("process.pid", pid.into()),
                    ]},
                    "scopeSpans": [{"scope": {"name": "ncclscope", "version": env!("CARGO_PKG_VERSION")}, "spans": spans}],
                })
            })
            .collect();
        self.pending_spans = 0;
        serde_json::to_writer(&mut self.out, &json!({"resourceSpans": resource_spans}))?;
        self.out.write_all(b"\n")
    }
}

fn attributes(c: &Collective) -> Vec<Value> {
    let mut a = vec![
        kv_str("nccl.func", &c.func),
        kv_str("nccl.comm_hash", &format!("{:016x}", c.comm_hash)),
        kv_int("nccl.rank", c.rank.into()),
        kv_int("nccl.nranks", c.nranks.into()),
        kv_int("nccl.nnodes", c.nnodes.into()),
        kv_int("nccl.seq", c.seq),
        kv_int("nccl.count", c.count),
        kv_int("nccl.bytes", c.bytes),
        kv_int("nccl.n_channels", c.n_channels.into()),
        kv_int("nccl.exec_ns", c.exec_ns),
        kv_str("ncclscope.timing_source", &c.timing_source),
        kv_double("nccl.algbw_gbs", c.algbw_gbs),
        kv_double("nccl.busbw_gbs", c.busbw_gbs),
        kv_int(
            "ncclscope.calibration_error_ns",
            c.calibration_error_ns.into(),
        ),
        kv_int("ncclscope.enqueue_unix_ns", c.enqueue_unix_ns),
    ];
    for (k, v) in [
        ("nccl.comm_name", &c.comm_name),
        ("nccl.datatype", &c.datatype),
        ("nccl.algo", &c.algo),
        ("nccl.proto", &c.proto),
    ] {
        if !v.is_empty() {
            a.push(kv_str(k, v));
        }
    }
    if c.is_p2p {
        a.push(kv_int("nccl.peer", c.peer as u64));
    } else if c.root >= 0 {
        a.push(kv_int("nccl.root", c.root as u64));
    }
    a
}

fn kv_str(key: &str, v: &str) -> Value {
    json!({"key": key, "value": {"stringValue": v}})
}

/// OTLP/JSON writes 64-bit integers as strings.
fn kv_int(key: &str, v: u64) -> Value {
    json!({"key": key, "value": {"intValue": v.to_string()}})
}

fn kv_double(key: &str, v: f64) -> Value {
    json!({"key": key, "value": {"doubleValue": v}})
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// FNV-1a over the little-endian bytes of `words`, from `seed`: stable across hosts, builds and versions.
fn fnv1a(seed: u64, words: &[u64]) -> u64 {
    let mut h = seed;
    for b in words.iter().flat_map(|w| w.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// The trace of one collective: the same on every rank and node.
pub fn trace_id(comm_hash: u64, seq: u64) -> [u8; 16] {
    let mut id = [0; 16];
    id[..8].copy_from_slice(&fnv1a(FNV_OFFSET, &[comm_hash, seq]).to_be_bytes());
    id[8..].copy_from_slice(&fnv1a(FNV_OFFSET ^ 0x5bd1_e995, &[seq, comm_hash]).to_be_bytes());
    id
}

/// A rank's span in that trace, or (with `channel`) its child span for one channel. Never zero.
pub fn span_id(comm_hash: u64, seq: u64, rank: u32, channel: Option<u32>) -> u64 {
    let ch = channel.map_or(0, |c| u64::from(c) + 1);
    fnv1a(FNV_OFFSET, &[comm_hash, seq, rank.into(), ch]).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclscope_proto::api::ChannelWork;

    fn coll(job: &str, pid: u32, rank: u32, seq: u64) -> Collective {
        Collective {
            job_id: job.into(),
            host: "node1".into(),
            pid,
            comm_hash: 7,
            rank,
            seq,
            func: "ReduceScatter".into(),
            bytes: 1 << 20,
            root: -1,
            peer: -1,
            start_unix_ns: 1_000 + seq,
            end_unix_ns: 2_000 + seq,
            channels: vec![ChannelWork {
                channel: 5,
                start_unix_ns: 1_100,
                end_unix_ns: 1_900,
                work_items: 1,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn lines_are_export_requests_with_shared_trace_ids_across_ranks() {
        let mut w = OtlpJsonWriter::new(Vec::new());
        for seq in 0..1500 {
            for rank in 0..2 {
                w.write(&coll("j", 10 + rank, rank, seq)).unwrap();
            }
        }
        let out = String::from_utf8(w.finish().unwrap()).unwrap();
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        // 1500 * 2 ranks * 2 spans = 6000 spans in lines of at most SPANS_PER_LINE (+ one collective).
        assert_eq!(lines.len(), 3);
        let mut spans = Vec::new();
        for line in &lines {
            for rs in line["resourceSpans"].as_array().unwrap() {
                let attrs = rs["resource"]["attributes"].as_array().unwrap();
                assert!(attrs.contains(&kv_str("ncclscope.job_id", "j")));
                spans.extend(
                    rs["scopeSpans"][0]["spans"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .cloned(),
                );
            }
        }
        assert_eq!(spans.len(), 6000);
        let roots: Vec<_> = spans
            .iter()
            .filter(|s| s.get("parentSpanId").is_none())
            .collect();
        assert_eq!(roots.len(), 3000);
        let of = |rank: u64, seq: u64| {
            roots
                .iter()
                .find(|s| {
                    let a = s["attributes"].as_array().unwrap();
                    a.contains(&kv_int("nccl.rank", rank)) && a.contains(&kv_int("nccl.seq", seq))
                })
                .unwrap()
        };
        assert_eq!(of(0, 42)["traceId"], of(1, 42)["traceId"]);
        assert_ne!(of(0, 42)["traceId"], of(0, 43)["traceId"]);
        assert_ne!(of(0, 42)["spanId"], of(1, 42)["spanId"]);
        assert_eq!(of(1, 42)["startTimeUnixNano"], "1042");
        assert_eq!(of(1, 42)["traceId"].as_str().unwrap().len(), 32);
        let child = spans
            .iter()
            .find(|s| s["parentSpanId"] == of(1, 42)["spanId"])
            .unwrap();
        assert_eq!(child["name"], "ReduceScatter channel 5");
    }
}
