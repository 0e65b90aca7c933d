//! Writes collective instances as a Perfetto protobuf trace (a `Trace` of `TracePacket`s carrying
//! TrackEvents, `proto/perfetto_trace.proto`), streaming, in constant memory per rank.
//!
//! The same layout as the JSON trace ([`crate::export::perfetto`]): one process per rank, per communicator a
//! track for its collectives and one per channel. What makes it several times smaller:
//! - one packet sequence per rank, whose timestamps are deltas on an incremental clock (a few bytes
//!   instead of a 19-digit time); an event earlier than the one before it (instances reach the spool
//!   in completion order) carries its absolute time instead;
//! - names interned per sequence: a collective's name and every attribute name are sent once;
//! - what is constant per rank or communicator (host, pid, job, uid, communicator) is in the process
//!   and track names, not on every slice.
//!
//! Times are CLOCK_REALTIME, the trace's primary clock: absolute Unix times, the clock of PyTorch's
//! profiler traces. Every rank's slice of one collective instance carries the same flow id, so
//! Perfetto draws arrows through the instance's ranks in time order.

use std::collections::HashMap;
use std::io::{self, Write};

use ncclscope_proto::api::Collective;
use ncclscope_proto::perfetto::{
    ClockSnapshot, DebugAnnotation, DebugAnnotationName, EventName, InternedData,
    ProcessDescriptor, TracePacket, TracePacketDefaults, TrackDescriptor, TrackEvent,
    clock_snapshot::Clock, track_event::Type,
};
use prost::Message;

use crate::export::perfetto::extent;
use crate::instance::Shared;
use crate::spans::{instance_key, trace_id};

/// Perfetto's id of CLOCK_REALTIME (BUILTIN_CLOCK_REALTIME).
const REALTIME: u32 = 1;
/// The incremental clock of each sequence (64-127 name a sequence's own clocks).
const DELTA_CLOCK: u32 = 64;
/// `sequence_flags`: the sequence's interned names and clock start here.
const STATE_CLEARED: u32 = 1;
/// The tag of `Trace.packet` (field 1, length-delimited): a file of these is one `Trace`.
const PACKET_TAG: u8 = 0x0a;

/// The attributes a collective slice carries, by interned id (index + 1).
const ANNOTATIONS: [&str; 20] = [
    "seq",
    "replay",
    "bytes",
    "count",
    "datatype",
    "algo",
    "proto",
    "n_channels",
    "exec_ns",
    "algbw_gbs",
    "busbw_gbs",
    "timing_source",
    "calibration_error_ns",
    "enqueue_unix_ns",
    "nranks",
    "nnodes",
    "root",
    "peer",
    "is_p2p",
    "work_items",
];

/// A rank's process and its packet sequence.
struct Process {
    seq: u32,
    uuid: u64,
    /// The incremental clock's value: the latest time sent as a delta.
    clock: u64,
    /// Interned event names.
    names: HashMap<String, u64>,
    /// (communicator, channel or `COLLECTIVES`) -> track uuid.
    tracks: HashMap<(u64, u32), u64>,
}

/// The track key of a communicator's collectives (channels are 0..MAX_CHANNELS).
const COLLECTIVES: u32 = u32::MAX;

pub struct PerfettoProtoWriter<W: Write> {
    out: W,
    /// (host, pid) -> its process.
    processes: HashMap<(String, u32), Process>,
    next_uuid: u64,
    slices: u64,
    buf: Vec<u8>,
    /// What the trace says of itself ([`PerfettoProtoWriter::note`]), and the times it covers.
    notes: Vec<String>,
    span: Option<(u64, u64)>,
}

/// One begin or end of a slice, before they are put in time order.
struct Edge {
    ts: u64,
    end: bool,
    track: u64,
    name: u64,
    annotations: Vec<DebugAnnotation>,
    flow: Option<u64>,
}

impl<W: Write> PerfettoProtoWriter<W> {
    pub fn new(out: W) -> Self {
        PerfettoProtoWriter {
            out,
            processes: HashMap::new(),
            next_uuid: 1,
            slices: 0,
            buf: Vec::new(),
            notes: Vec::new(),
            span: None,
        }
    }

    /// A statement about the trace (its coverage, a node's clock), written at the end as a slice
    /// across the whole trace on a track of its own, named with the statement.
    pub fn note(&mut self, text: String) {
        self.notes.push(text);
    }

    /// Collective slices written so far.
    pub fn collectives(&self) -> u64 {
        self.slices
    }

    pub fn write(&mut self, c: &Collective) -> io::Result<()> {
        let (start, end) = extent(c);
        self.span = Some(
            self.span
                .map_or((start, end), |(s, e)| (s.min(start), e.max(end))),
        );
        let key = (c.host.clone(), c.pid);
        if !self.processes.contains_key(&key) {
            self.start_process(c, start)?;
        }
        let coll_track = self.track(c, COLLECTIVES)?;
        let mut interned = InternedData::default();
        let name = self.name(&key, &c.func, &mut interned);
        let flow = (!c.is_p2p).then(|| {
            let id = trace_id(c.uid, c.comm_hash, instance_key(Shared::from(c).view()));
            u64::from_be_bytes(id[..8].try_into().expect("8 bytes"))
        });
        let mut edges = vec![
            Edge {
                ts: start,
                end: false,
                track: coll_track,
                name,
                annotations: annotations(c),
                flow,
            },
            Edge {
                ts: end,
                end: true,
                track: coll_track,
                name,
                annotations: Vec::new(),
                flow: None,
            },
        ];
        for w in &c.channels {
            let track = self.track(c, w.channel)?;
            let work = (w.work_items != 1).then(|| DebugAnnotation {
                name_iid: annotation_iid("work_items"),
                uint_value: Some(u64::from(w.work_items)),
                ..Default::default()
            });
            let (s, e) = (w.start_unix_ns, w.end_unix_ns.max(w.start_unix_ns));
            edges.push(Edge {
                ts: s,
                end: false,
                track,
                name,
                annotations: work.into_iter().collect(),
                flow: None,
            });
            edges.push(Edge {
                ts: e,
                end: true,
                track,
                name,
                annotations: Vec::new(),
                flow: None,
            });
        }
        // Begins before ends at one time: a slice of no length still opens before it closes.
        edges.sort_by_key(|e| (e.ts, e.end));
        for (i, e) in edges.into_iter().enumerate() {
            let mut packet = self.timed(&key, e.ts);
            if i == 0 && !interned.event_names.is_empty() {
                packet.interned_data = Some(std::mem::take(&mut interned));
            }
            packet.track_event = Some(TrackEvent {
                r#type: Some(if e.end {
                    Type::SliceEnd
                } else {
                    Type::SliceBegin
                } as i32),
                track_uuid: Some(e.track),
                name_iid: (!e.end).then_some(e.name),
                debug_annotations: e.annotations,
                flow_ids: e.flow.into_iter().collect(),
            });
            self.packet(&packet)?;
        }
        self.slices += 1;
        Ok(())
    }

    pub fn finish(mut self) -> io::Result<W> {
        self.write_notes()?;
        self.out.flush()?;
        Ok(self.out)
    }

    /// The notes, on a sequence of their own (after every rank's), each a track with one slice.
    fn write_notes(&mut self) -> io::Result<()> {
        if self.notes.is_empty() {
            return Ok(());
        }
        let seq = self.processes.len() as u32 + 1;
        let (first, last) = self.span.unwrap_or((0, 0));
        let notes = std::mem::take(&mut self.notes);
        for (i, text) in notes.into_iter().enumerate() {
            let (uuid, iid) = (self.uuid(), i as u64 + 1);
            self.packet(&TracePacket {
                trusted_packet_sequence_id: Some(seq),
                sequence_flags: (i == 0).then_some(STATE_CLEARED),
                interned_data: Some(InternedData {
                    event_names: vec![EventName {
                        iid: Some(iid),
                        name: Some(text),
                    }],
                    ..Default::default()
                }),
                track_descriptor: Some(TrackDescriptor {
                    uuid: Some(uuid),
                    name: Some("ncclscope".into()),
                    ..Default::default()
                }),
                ..Default::default()
            })?;
            for (ts, kind) in [(first, Type::SliceBegin), (last, Type::SliceEnd)] {
                self.packet(&TracePacket {
                    timestamp: Some(ts),
                    timestamp_clock_id: Some(REALTIME),
                    trusted_packet_sequence_id: Some(seq),
                    track_event: Some(TrackEvent {
                        r#type: Some(kind as i32),
                        track_uuid: Some(uuid),
                        name_iid: (kind == Type::SliceBegin).then_some(iid),
                        ..Default::default()
                    }),
                    ..Default::default()
                })?;
            }
        }
        Ok(())
    }

    /// A rank's sequence: its incremental clock (at `t`, related to CLOCK_REALTIME), the attribute
    /// names, and its process track.
    fn start_process(&mut self, c: &Collective, t: u64) -> io::Result<()> {
        let seq = self.processes.len() as u32 + 1;
        let uuid = self.uuid();
        let first = seq == 1;
        self.packet(&TracePacket {
            timestamp: Some(t),
            timestamp_clock_id: Some(REALTIME),
            trusted_packet_sequence_id: Some(seq),
            sequence_flags: Some(STATE_CLEARED),
            trace_packet_defaults: Some(TracePacketDefaults {
                timestamp_clock_id: Some(DELTA_CLOCK),
            }),
            clock_snapshot: Some(ClockSnapshot {
                clocks: vec![
                    Clock {
                        clock_id: Some(DELTA_CLOCK),
                        timestamp: Some(t),
                        is_incremental: Some(true),
                    },
                    Clock {
                        clock_id: Some(REALTIME),
                        timestamp: Some(t),
                        is_incremental: None,
                    },
                ],
                // Once, in the first snapshot: the timeline is in Unix time.
                primary_trace_clock: first.then_some(REALTIME),
            }),
            interned_data: Some(InternedData {
                debug_annotation_names: (ANNOTATIONS.iter().enumerate())
                    .map(|(i, name)| DebugAnnotationName {
                        iid: Some(i as u64 + 1),
                        name: Some(name.to_string()),
                    })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        })?;
        self.packet(&TracePacket {
            trusted_packet_sequence_id: Some(seq),
            track_descriptor: Some(TrackDescriptor {
                uuid: Some(uuid),
                process: Some(ProcessDescriptor {
                    pid: Some(seq as i32),
                    process_name: Some(format!(
                        "rank {} ({} pid {}, job {}, uid {})",
                        c.rank, c.host, c.pid, c.job_id, c.uid
                    )),
                }),
                ..Default::default()
            }),
            ..Default::default()
        })?;
        let process = Process {
            seq,
            uuid,
            clock: t,
            names: HashMap::new(),
            tracks: HashMap::new(),
        };
        self.processes.insert((c.host.clone(), c.pid), process);
        Ok(())
    }

    /// The track of `c`'s communicator's collectives, or of one of its channels; described the first
    /// time.
    fn track(&mut self, c: &Collective, channel: u32) -> io::Result<u64> {
        let key = (c.host.clone(), c.pid);
        if let Some(&uuid) = self.processes[&key].tracks.get(&(c.comm_hash, channel)) {
            return Ok(uuid);
        }
        let uuid = self.uuid();
        let p = self.processes.get_mut(&key).expect("started");
        p.tracks.insert((c.comm_hash, channel), uuid);
        let (seq, parent) = (p.seq, p.uuid);
        let comm = match c.comm_name.as_str() {
            "" => format!("comm {:016x}", c.comm_hash),
            name => format!("comm {name} ({:016x})", c.comm_hash),
        };
        let name = match channel {
            COLLECTIVES => format!("{comm} collectives"),
            ch => format!("{comm} channel {ch}"),
        };
        self.packet(&TracePacket {
            trusted_packet_sequence_id: Some(seq),
            track_descriptor: Some(TrackDescriptor {
                uuid: Some(uuid),
                parent_uuid: Some(parent),
                name: Some(name),
                ..Default::default()
            }),
            ..Default::default()
        })?;
        Ok(uuid)
    }

    /// The interned id of event name `name` on `process`'s sequence, adding it to `interned` if new.
    fn name(&mut self, process: &(String, u32), name: &str, interned: &mut InternedData) -> u64 {
        let p = self.processes.get_mut(process).expect("started");
        if let Some(&iid) = p.names.get(name) {
            return iid;
        }
        let iid = p.names.len() as u64 + 1;
        p.names.insert(name.to_string(), iid);
        interned.event_names.push(EventName {
            iid: Some(iid),
            name: Some(name.to_string()),
        });
        iid
    }

    /// A packet of `process`'s sequence at `ts`: a delta on its incremental clock, or the absolute
    /// time where `ts` is earlier than the clock already is.
    fn timed(&mut self, process: &(String, u32), ts: u64) -> TracePacket {
        let p = self.processes.get_mut(process).expect("started");
        let mut packet = TracePacket {
            trusted_packet_sequence_id: Some(p.seq),
            ..Default::default()
        };
        if ts >= p.clock {
            packet.timestamp = Some(ts - p.clock);
            p.clock = ts;
        } else {
            packet.timestamp = Some(ts);
            packet.timestamp_clock_id = Some(REALTIME);
        }
        packet
    }

    fn uuid(&mut self) -> u64 {
        self.next_uuid += 1;
        self.next_uuid - 1
    }

    fn packet(&mut self, p: &TracePacket) -> io::Result<()> {
        self.buf.clear();
        self.buf.push(PACKET_TAG);
        p.encode_length_delimited(&mut self.buf)
            .map_err(io::Error::other)?;
        self.out.write_all(&self.buf)
    }
}

/// The interned id of attribute `name`.
fn annotation_iid(name: &str) -> Option<u64> {
    let i = ANNOTATIONS
        .iter()
        .position(|a| *a == name)
        .expect("an annotation");
    Some(i as u64 + 1)
}

/// A collective slice's attributes (what is not in its process and track names); empty strings and
/// the values that say nothing (no root, no peer) left out.
fn annotations(c: &Collective) -> Vec<DebugAnnotation> {
    let id = annotation_iid;
    let uint = |name: &str, v: u64| DebugAnnotation {
        name_iid: id(name),
        uint_value: Some(v),
        ..Default::default()
    };
    let text = |name: &str, v: &str| DebugAnnotation {
        name_iid: id(name),
        string_value: Some(v.to_string()),
        ..Default::default()
    };
    let float = |name: &str, v: f64| DebugAnnotation {
        name_iid: id(name),
        double_value: Some(v),
        ..Default::default()
    };
    let mut a = vec![
        uint("seq", c.seq),
        uint("replay", u64::from(c.replay)),
        uint("bytes", c.bytes),
        uint("count", c.count),
        text("datatype", &c.datatype),
        text("algo", &c.algo),
        text("proto", &c.proto),
        uint("n_channels", u64::from(c.n_channels)),
        uint("exec_ns", c.exec_ns),
        float("algbw_gbs", c.algbw_gbs),
        float("busbw_gbs", c.busbw_gbs),
        text("timing_source", &c.timing_source),
        uint("calibration_error_ns", u64::from(c.calibration_error_ns)),
        uint("enqueue_unix_ns", c.enqueue_unix_ns),
        uint("nranks", u64::from(c.nranks)),
        uint("nnodes", u64::from(c.nnodes)),
    ];
    if c.root >= 0 {
        a.push(DebugAnnotation {
            name_iid: id("root"),
            int_value: Some(i64::from(c.root)),
            ..Default::default()
        });
    }
    if c.is_p2p {
        a.push(DebugAnnotation {
            name_iid: id("peer"),
            int_value: Some(i64::from(c.peer)),
            ..Default::default()
        });
        a.push(DebugAnnotation {
            name_iid: id("is_p2p"),
            bool_value: Some(true),
            ..Default::default()
        });
    }
    a.retain(|a| a.string_value.as_deref() != Some(""));
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::perfetto::PerfettoWriter;
    use ncclscope_proto::api::ChannelWork;
    use ncclscope_proto::perfetto::Trace;

    /// A training-step-like instance: 16 channels, realistic values.
    fn coll(rank: u32, seq: u64, start: u64) -> Collective {
        Collective {
            job_id: "train-1".into(),
            host: "node-07".into(),
            pid: 4242 + rank,
            comm_hash: 0x5eed0ddec0ffee01,
            rank,
            nranks: 4,
            nnodes: 1,
            seq,
            func: ["AllReduce", "AllGather", "ReduceScatter"][seq as usize % 3].into(),
            datatype: "ncclBfloat16".into(),
            algo: "RING".into(),
            proto: "SIMPLE".into(),
            count: 33_554_432,
            bytes: 67_108_864,
            root: -1,
            peer: -1,
            n_channels: 16,
            enqueue_unix_ns: start - 35_123,
            start_unix_ns: start,
            end_unix_ns: start + 3_145_728,
            exec_ns: 3_145_728,
            timing_source: "device_hook".into(),
            algbw_gbs: 21.33,
            busbw_gbs: 32.0,
            calibration_error_ns: 180,
            uid: 1000,
            channels: (0..16)
                .map(|ch| ChannelWork {
                    channel: ch,
                    start_unix_ns: start + 1_000 + u64::from(ch) * 37,
                    end_unix_ns: start + 3_100_000 + u64::from(ch) * 113,
                    work_items: 1,
                })
                .collect(),
            ..Default::default()
        }
    }

    /// Every instance of 4 ranks, in the order the spool gives them (rank by rank per instance).
    fn instances() -> Vec<Collective> {
        let t = 1_780_000_000_123_456_789;
        (0..300)
            .flat_map(|seq| {
                (0..4)
                    .map(move |rank| coll(rank, seq, t + seq * 4_000_000 + u64::from(rank) * 2_000))
            })
            .collect()
    }

    #[test]
    fn five_times_smaller_than_the_json_trace() {
        let mut json = PerfettoWriter::new(Vec::new()).unwrap();
        let mut proto = PerfettoProtoWriter::new(Vec::new());
        for c in instances() {
            json.write(&c).unwrap();
            proto.write(&c).unwrap();
        }
        let (json, proto) = (json.finish().unwrap(), proto.finish().unwrap());
        assert!(
            json.len() >= 5 * proto.len(),
            "JSON {} bytes, protobuf {} bytes",
            json.len(),
            proto.len()
        );
    }

    /// Decoding the file back: each slice's absolute begin and end times, on its track, from the
    /// deltas and absolute fallbacks; names through the interning; one flow id per instance.
    #[test]
    fn slices_decode_to_their_exact_times_names_and_flows() {
        let mut colls = instances();
        // One instance late in the spool: earlier than the clock, it must go absolute.
        colls.swap(4, 40);
        let mut w = PerfettoProtoWriter::new(Vec::new());
        for c in &colls {
            w.write(c).unwrap();
        }
        assert_eq!(w.collectives(), colls.len() as u64);
        let trace = Trace::decode(w.finish().unwrap().as_slice()).unwrap();
        let mut clock: HashMap<u32, u64> = HashMap::new();
        let mut names: HashMap<(u32, u64), String> = HashMap::new();
        let mut track_names: HashMap<u64, String> = HashMap::new();
        let mut open: HashMap<u64, (u64, String, Vec<u64>)> = HashMap::new();
        let mut slices = Vec::new();
        for p in &trace.packet {
            let seq = p.trusted_packet_sequence_id.unwrap();
            if let Some(cs) = &p.clock_snapshot {
                clock.insert(seq, cs.clocks[0].timestamp.unwrap());
                continue;
            }
            if let Some(d) = &p.track_descriptor {
                track_names.insert(d.uuid.unwrap(), d.name.clone().unwrap_or_default());
                continue;
            }
            for n in p.interned_data.iter().flat_map(|i| &i.event_names) {
                names.insert((seq, n.iid.unwrap()), n.name.clone().unwrap());
            }
            let ts = match p.timestamp_clock_id {
                Some(REALTIME) => p.timestamp.unwrap(),
                _ => {
                    let c = clock.get_mut(&seq).unwrap();
                    *c += p.timestamp.unwrap();
                    *c
                }
            };
            let e = p.track_event.as_ref().unwrap();
            let track = e.track_uuid.unwrap();
            if e.r#type == Some(Type::SliceBegin as i32) {
                let name = names[&(seq, e.name_iid.unwrap())].clone();
                open.insert(track, (ts, name, e.flow_ids.clone()));
            } else {
                let (start, name, flows) = open.remove(&track).expect("an open slice");
                slices.push((track_names[&track].clone(), name, start, ts, flows));
            }
        }
        let colls_of = |c: &Collective| {
            slices
                .iter()
                .filter(|s| {
                    s.0.ends_with(" collectives") && s.2 == c.start_unix_ns && s.1 == c.func
                })
                .count()
        };
        for c in &colls {
            assert_eq!(colls_of(c), 1, "{} seq {} rank {}", c.func, c.seq, c.rank);
        }
        let coll_slices: Vec<_> = slices
            .iter()
            .filter(|s| s.0.ends_with(" collectives"))
            .collect();
        assert_eq!(coll_slices.len(), colls.len());
        assert!(coll_slices.iter().all(|s| s.3 - s.2 == 3_145_728));
        assert_eq!(slices.len(), colls.len() * 17);
        let ch5 = slices.iter().find(|s| s.0.ends_with("channel 5")).unwrap();
        assert_eq!(ch5.3 - ch5.2, 3_100_000 + 5 * 113 - 1_000 - 5 * 37);
        // The 4 ranks of an instance share one flow id; instances differ.
        let flows: std::collections::BTreeSet<u64> = coll_slices.iter().map(|s| s.4[0]).collect();
        assert_eq!(flows.len(), 300);
    }
}
