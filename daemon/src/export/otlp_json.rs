//! Writes collective instances as OTLP/JSON trace data: JSON lines, each line one
//! `ExportTraceServiceRequest` (the format the OpenTelemetry Collector's `otlpjsonfile` receiver reads,
//! so a job's export can be replayed into any OTLP backend).
//!
//! The spans are exactly those the daemon's live OTLP export sends ([`crate::spans::live_spans_of`]:
//! the sampled instances and slow outliers, channel spans only with `otlp.channel_spans`, as decided
//! when the daemon recorded each instance), with the same trace and span ids.
//! The JSON mapping (hex ids, 64-bit integers as strings) is opentelemetry-proto's.

use std::io::{self, Write};

use ncclscope_proto::api::Collective;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};

use crate::instance::Shared;
use crate::spans::live_spans_of;

/// Spans per JSON line: bounded lines, each a request size a collector accepts.
const SPANS_PER_LINE: usize = 2048;

pub struct OtlpJsonWriter<W: Write> {
    out: W,
    /// The live export's resource (the daemon's answer to GetResource), so the file names the node
    /// as the spans the collector received do.
    resource: Resource,
    pending: Vec<Span>,
    collectives: u64,
}

impl<W: Write> OtlpJsonWriter<W> {
    pub fn new(out: W, resource: Resource) -> Self {
        OtlpJsonWriter {
            out,
            resource,
            pending: Vec::new(),
            collectives: 0,
        }
    }

    pub fn collectives(&self) -> u64 {
        self.collectives
    }

    pub fn write(&mut self, c: &Collective) -> io::Result<()> {
        live_spans_of(Shared::from(c).view(), &mut self.pending);
        self.collectives += 1;
        if self.pending.len() >= SPANS_PER_LINE {
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
        let request = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(self.resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(crate::export::otlp::scope()),
                    spans: std::mem::take(&mut self.pending),
                    ..Default::default()
                }],
                ..Default::default()
            }],
        };
        serde_json::to_writer(&mut self.out, &request)?;
        self.out.write_all(b"\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spans::{collective_key, rank_span_id, trace_id};
    use ncclscope_proto::api::{ChannelWork, LiveSpans};
    use serde_json::Value;

    fn coll(rank: u32, seq: u64) -> Collective {
        let live_spans = [LiveSpans::None, LiveSpans::Rank, LiveSpans::Channels][seq as usize % 3];
        // The engine gives the last rank of a sent collective the root.
        let root = rank == 1 && live_spans != LiveSpans::None;
        Collective {
            job_id: "j".into(),
            host: "node1".into(),
            pid: 10 + rank,
            comm_hash: 7,
            rank,
            nranks: 2,
            seq,
            func: "ReduceScatter".into(),
            bytes: 1 << 20,
            root: -1,
            peer: -1,
            enqueue_unix_ns: 900 + seq,
            start_unix_ns: 1_000 + seq,
            end_unix_ns: 2_000 + seq,
            channels: vec![ChannelWork {
                channel: 5,
                start_unix_ns: 1_100,
                end_unix_ns: 1_900,
                work_items: 1,
            }],
            // Sampled out, rank spans, rank and channel spans: a third each.
            live_spans: live_spans as i32,
            trace_root_start_unix_ns: if root { 999 + seq } else { 0 },
            trace_root_end_unix_ns: if root { 2_001 + seq } else { 0 },
            ..Default::default()
        }
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn lines_are_export_requests_with_the_daemons_ids_and_only_the_live_spans() {
        let resource = crate::export::otlp::resource(&crate::config::Otlp::default(), "node1");
        let mut w = OtlpJsonWriter::new(Vec::new(), resource);
        for seq in 0..1200 {
            for rank in 0..2 {
                w.write(&coll(rank, seq)).unwrap();
            }
        }
        let out = String::from_utf8(w.finish().unwrap()).unwrap();
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        // Per collective sent live: the root span and two rank spans, with channel spans two
        // more; 400 * 3 + 400 * 5 = 3200 spans in all, none of the 400 sampled out.
        assert_eq!(lines.len(), 2);
        let spans: Vec<&Value> = lines
            .iter()
            .flat_map(|l| l["resourceSpans"].as_array().unwrap())
            .flat_map(|rs| rs["scopeSpans"][0]["spans"].as_array().unwrap())
            .collect();
        assert_eq!(spans.len(), 3200);
        let channels = spans
            .iter()
            .filter(|s| s["name"] == "ReduceScatter channel");
        assert_eq!(channels.count(), 800);
        let out_key = collective_key("ReduceScatter", 42, 0);
        assert!(
            !spans
                .iter()
                .any(|s| s["traceId"] == hex(&trace_id(0, 7, out_key)))
        );
        let key = collective_key("ReduceScatter", 44, 0);
        let rank1 = spans
            .iter()
            .find(|s| s["spanId"] == hex(&rank_span_id(0, 7, key, 1)))
            .expect("rank 1 span of seq 44");
        assert_eq!(rank1["traceId"], hex(&trace_id(0, 7, key)));
        assert_eq!(rank1["startTimeUnixNano"], "1044");
        assert_eq!(rank1["name"], "ReduceScatter rank");
        let child = spans
            .iter()
            .find(|s| s["parentSpanId"] == rank1["spanId"])
            .expect("channel span");
        assert_eq!(child["traceId"], rank1["traceId"]);
        // The same parse the OTLP/JSON readers do: back into the protobuf types.
        let req: ExportTraceServiceRequest =
            serde_json::from_str(out.lines().next().unwrap()).unwrap();
        let resource = req.resource_spans[0].resource.as_ref().unwrap();
        assert_eq!(resource.attributes[2].key, "host.name");
    }
}
