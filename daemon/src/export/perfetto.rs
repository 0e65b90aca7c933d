//! Writes collective instances as a Chrome/Perfetto trace (the JSON "Trace Event Format"), streaming, so
//! a job of any length exports in constant memory per rank.
//!
//! One process per rank (OS process: host + pid, named after its rank), and per communicator of that
//! process one track for the collectives and one track per channel holding that channel's kernel work.
//! Every slice carries the collective's attributes. Timestamps are absolute: microseconds since the
//! Unix epoch (CLOCK_REALTIME, the clock PyTorch's profiler writes), as decimal text exact to the ns,
//! so this trace and a PyTorch one line up. Flow arrows chain the ranks of one collective instance
//! (rank r to rank r + 1) on the ranks this node ran.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{self, Write};

use ncclscope_proto::TimingSource;
use ncclscope_proto::api::Collective;
use serde_json::{Value, json};

use crate::instance::Shared;
use crate::spans::{instance_key, trace_id};

/// Track ids per communicator within a process: the collectives track, then one per channel.
const TRACKS_PER_COMM: u64 = 1024;

pub struct PerfettoWriter<W: Write> {
    out: W,
    /// Unix ns of time 0 (0: timestamps are since the epoch), and the first trace pid; a trace
    /// merged into a PyTorch one takes that trace's origin and pids it does not use.
    origin_ns: u64,
    first_pid: u64,
    /// (host, pid) -> trace pid.
    processes: HashMap<(String, u32), u64>,
    /// (trace pid, comm hash) -> index of that communicator in the process.
    comms: HashMap<(u64, u64), u64>,
    named_tracks: std::collections::HashSet<(u64, u64)>,
    first_event: bool,
    slices: u64,
    /// Written into the trace's `metadata` beside the count of collectives.
    metadata: serde_json::Map<String, Value>,
}

impl<W: Write> PerfettoWriter<W> {
    pub fn new(out: W) -> io::Result<Self> {
        Self::with_origin(out, 0, 1)
    }

    /// Timestamps relative to `origin_ns`, processes numbered from `first_pid`.
    pub fn with_origin(mut out: W, origin_ns: u64, first_pid: u64) -> io::Result<Self> {
        out.write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n")?;
        Ok(PerfettoWriter {
            out,
            origin_ns,
            first_pid,
            processes: HashMap::new(),
            comms: HashMap::new(),
            named_tracks: Default::default(),
            first_event: true,
            slices: 0,
            metadata: Default::default(),
        })
    }

    /// Adds a statement about the trace to its metadata's `ncclscope_notes`.
    pub fn add_note(&mut self, text: String) {
        let notes = self.metadata.entry("ncclscope_notes").or_insert(json!([]));
        if let Value::Array(a) = notes {
            a.push(Value::String(text));
        }
    }

    /// Sets `key` of the trace's metadata (what the trace says of itself: coverage, node clocks).
    pub fn set_metadata(&mut self, key: &str, value: Value) {
        self.metadata.insert(key.to_string(), value);
    }

    /// Collective slices written so far.
    pub fn collectives(&self) -> u64 {
        self.slices
    }

    pub fn write(&mut self, c: &Collective) -> io::Result<()> {
        self.write_marked(c, false)
    }

    /// Writes `c`; a `straggler` (its rank started the instance last) is flagged in its args and
    /// drawn in the viewer's alarm colour.
    pub fn write_marked(&mut self, c: &Collective, straggler: bool) -> io::Result<()> {
        let (start, end) = extent(c);
        let pid = self.process(c)?;
        let comm_idx = self.comm(pid, c.comm_hash);
        let coll_tid = comm_idx * TRACKS_PER_COMM;
        let comm_label = comm_label(c);
        self.track(pid, coll_tid, || format!("{comm_label} collectives"))?;
        let mut args = attributes(c);
        if straggler {
            args["straggler"] = Value::Bool(true);
        }
        self.slice("collective", c, pid, coll_tid, start, end, &args)?;
        // A chain through the instance's ranks: out of rank r into rank r + 1, bound to the slices.
        if !c.is_p2p {
            let mid = start + (end - start) / 2;
            if c.rank + 1 < c.nranks {
                self.flow("s", c, pid, coll_tid, mid, c.rank)?;
            }
            if c.rank > 0 {
                self.flow("f", c, pid, coll_tid, mid, c.rank - 1)?;
            }
        }
        for ch in &c.channels {
            let tid = coll_tid + 1 + u64::from(ch.channel);
            self.track(pid, tid, || format!("{comm_label} channel {}", ch.channel))?;
            let args = json!({"seq": c.seq, "replay": c.replay, "channel": ch.channel,
                              "work_items": ch.work_items, "comm_hash": format!("{:016x}", c.comm_hash)});
            self.slice(
                "channel",
                c,
                pid,
                tid,
                ch.start_unix_ns,
                ch.end_unix_ns.max(ch.start_unix_ns),
                &args,
            )?;
        }
        self.slices += 1;
        Ok(())
    }

    /// A complete event ("X"), written by hand so that the timestamps keep every ns digit.
    #[allow(clippy::too_many_arguments)]
    fn slice(
        &mut self,
        cat: &str,
        c: &Collective,
        pid: u64,
        tid: u64,
        start: u64,
        end: u64,
        args: &Value,
    ) -> io::Result<()> {
        let mut text = String::with_capacity(256);
        // Catapult's colour for alarms: the straggler's slice stands out next to the model's ops.
        let colour = if args.get("straggler").is_some() {
            r#""cname":"terrible","#
        } else {
            ""
        };
        let _ = write!(
            text,
            r#"{{"ph":"X","cat":"{cat}","name":{},{colour}"pid":{pid},"tid":{tid},"ts":{},"dur":{},"args":{}}}"#,
            Value::from(c.func.as_str()),
            micros(start, self.origin_ns),
            micros(end - start, 0),
            args
        );
        self.raw(&text)
    }

    /// One end of the flow from `from_rank` to `from_rank + 1` of `c`'s instance, bound to the
    /// collective slice around `ts`.
    fn flow(
        &mut self,
        ph: &str,
        c: &Collective,
        pid: u64,
        tid: u64,
        ts: u64,
        from_rank: u32,
    ) -> io::Result<()> {
        let key = instance_key(Shared::from(c).view());
        let id = trace_id(c.uid, c.comm_hash, key);
        let text = format!(
            r#"{{"ph":"{ph}","cat":"flow","name":{},"id":"0x{:016x}{:08x}","pid":{pid},"tid":{tid},"ts":{},"bp":"e"}}"#,
            Value::from(c.func.as_str()),
            u64::from_be_bytes(id[..8].try_into().expect("8 bytes")),
            from_rank,
            micros(ts, self.origin_ns)
        );
        self.raw(&text)
    }

    /// Closes the JSON document and returns the writer (flushed).
    pub fn finish(mut self) -> io::Result<W> {
        self.out.write_all(b"\n],\"metadata\":")?;
        let mut meta = std::mem::take(&mut self.metadata);
        meta.insert("ncclscope_collectives".into(), self.slices.into());
        serde_json::to_writer(&mut self.out, &meta)?;
        self.out.write_all(b"}\n")?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn process(&mut self, c: &Collective) -> io::Result<u64> {
        let key = (c.host.clone(), c.pid);
        if let Some(&pid) = self.processes.get(&key) {
            return Ok(pid);
        }
        let pid = self.processes.len() as u64 + self.first_pid;
        self.processes.insert(key, pid);
        let name = format!("rank {} ({} pid {})", c.rank, c.host, c.pid);
        self.event(json!({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}))?;
        self.event(json!({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": c.rank}}))?;
        Ok(pid)
    }

    fn comm(&mut self, pid: u64, comm_hash: u64) -> u64 {
        let next = self.comms.keys().filter(|(p, _)| *p == pid).count() as u64;
        *self.comms.entry((pid, comm_hash)).or_insert(next)
    }

    fn track(&mut self, pid: u64, tid: u64, name: impl FnOnce() -> String) -> io::Result<()> {
        if self.named_tracks.insert((pid, tid)) {
            self.event(json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name()}}))?;
            self.event(
                json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                              "args": {"sort_index": tid}}),
            )?;
        }
        Ok(())
    }

    fn event(&mut self, v: Value) -> io::Result<()> {
        self.raw(&v.to_string())
    }

    fn raw(&mut self, event: &str) -> io::Result<()> {
        if !self.first_event {
            self.out.write_all(b",\n")?;
        }
        self.first_event = false;
        self.out.write_all(event.as_bytes())
    }
}

/// The instance's time span: kernel start..end, or enqueue time when it has no kernel timing.
pub fn extent(c: &Collective) -> (u64, u64) {
    let start = if c.start_unix_ns != 0 {
        c.start_unix_ns
    } else {
        c.enqueue_unix_ns
    };
    (start, c.end_unix_ns.max(start))
}

fn comm_label(c: &Collective) -> String {
    if c.comm_name.is_empty() {
        format!("comm {:016x}", c.comm_hash)
    } else {
        format!("comm {}", c.comm_name)
    }
}

/// Every attribute of a collective instance, as slice args. A host-timed instance has no exec time
/// or bandwidth (its host events bracket the enqueue, not the work), as its span has none.
pub fn attributes(c: &Collective) -> Value {
    let mut args = json!({
        "uid": c.uid, "job_id": c.job_id, "host": c.host, "pid": c.pid,
        "comm_hash": format!("{:016x}", c.comm_hash), "comm_name": c.comm_name,
        "rank": c.rank, "nranks": c.nranks, "nnodes": c.nnodes, "seq": c.seq, "replay": c.replay,
        "func": c.func, "datatype": c.datatype, "algo": c.algo, "proto": c.proto,
        "count": c.count, "bytes": c.bytes, "root": c.root, "peer": c.peer, "is_p2p": c.is_p2p,
        "n_channels": c.n_channels, "timing_source": c.timing_source,
        "enqueue_unix_ns": c.enqueue_unix_ns, "start_unix_ns": c.start_unix_ns, "end_unix_ns": c.end_unix_ns,
        "exec_ns": c.exec_ns, "algbw_gbs": c.algbw_gbs, "busbw_gbs": c.busbw_gbs,
        "calibration_error_ns": c.calibration_error_ns,
    });
    if TimingSource::parse(&c.timing_source) == TimingSource::Host
        && let Some(args) = args.as_object_mut()
    {
        for timed in ["exec_ns", "algbw_gbs", "busbw_gbs"] {
            args.remove(timed);
        }
    }
    args
}

/// Nanoseconds since `origin` as the format's microseconds, in decimal text exact to the ns (a
/// double is not: today's times in microseconds since the epoch need 51 bits before the point).
fn micros(ns: u64, origin: u64) -> String {
    let (sign, d) = match ns.checked_sub(origin) {
        Some(d) => ("", d),
        None => ("-", origin - ns),
    };
    format!("{sign}{}.{:03}", d / 1000, d % 1000)
}

/// Moves every time of `c` by `by_ns` (onto another clock: a PyTorch trace's, another node's).
pub fn shift(c: &mut Collective, by_ns: i64) {
    let at = |t: &mut u64| {
        if *t != 0 {
            *t = t.saturating_add_signed(by_ns);
        }
    };
    at(&mut c.enqueue_unix_ns);
    at(&mut c.start_unix_ns);
    at(&mut c.end_unix_ns);
    at(&mut c.trace_root_start_unix_ns);
    at(&mut c.trace_root_end_unix_ns);
    for ch in &mut c.channels {
        at(&mut ch.start_unix_ns);
        at(&mut ch.end_unix_ns);
    }
}

/// A collective instance: (communicator, collective, seq, replay).
type InstanceId<'a> = (u64, &'a str, u64, u32);

fn instance_id(c: &Collective) -> InstanceId<'_> {
    (c.comm_hash, c.func.as_str(), c.seq, c.replay)
}

/// Each collective instance's straggler among the ranks in `colls` (the last to start), where
/// more than one of its ranks is there to compare.
fn stragglers(colls: &[Collective]) -> HashMap<InstanceId<'_>, u32> {
    let mut last: HashMap<InstanceId<'_>, ((u64, u32), usize)> = HashMap::new();
    for c in colls.iter().filter(|c| !c.is_p2p) {
        let e = last.entry(instance_id(c)).or_insert(((0, 0), 0));
        *e = (e.0.max((extent(c).0, c.rank)), e.1 + 1);
    }
    (last.into_iter())
        .filter(|(_, (_, ranks))| *ranks > 1)
        .map(|(id, ((_, rank), _))| (id, rank))
        .collect()
}

/// A PyTorch profiler trace (Kineto's Chrome JSON) with `colls` added: each rank a process of its
/// own, with per communicator a track of its collectives and one per channel, on the trace's own
/// time base (`baseTimeNanoseconds` + `ts` microseconds; absolute microseconds where the trace has
/// no base), each instance's last rank to start marked as its straggler. Everything the trace held
/// is kept as it was.
pub fn merge(mut torch: Value, colls: &[Collective]) -> io::Result<Value> {
    let invalid = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
    let events = (torch.get("traceEvents").and_then(Value::as_array))
        .ok_or_else(|| invalid("not a PyTorch profiler trace: no traceEvents array"))?;
    let origin = torch
        .get("baseTimeNanoseconds")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    // Past every numeric pid the trace uses (Kineto numbers host processes and GPUs).
    let first_pid = (events.iter())
        .filter_map(|e| e.get("pid").and_then(Value::as_u64))
        .max()
        .map_or(1, |p| p + 1);
    let last = stragglers(colls);
    let mut w = PerfettoWriter::with_origin(Vec::new(), origin, first_pid)?;
    for c in colls {
        let straggler = !c.is_p2p && last.get(&instance_id(c)) == Some(&c.rank);
        w.write_marked(c, straggler)?;
    }
    let mut ours: Value = serde_json::from_slice(&w.finish()?)?;
    let Value::Array(added) = ours["traceEvents"].take() else {
        unreachable!("the writer writes a traceEvents array")
    };
    torch["traceEvents"]
        .as_array_mut()
        .expect("checked above")
        .extend(added);
    Ok(torch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclscope_proto::api::ChannelWork;

    fn coll(rank: u32, seq: u64, start: u64) -> Collective {
        Collective {
            job_id: "j".into(),
            host: "h".into(),
            pid: 100 + rank,
            comm_hash: 0xabc,
            rank,
            nranks: 2,
            seq,
            func: "AllReduce".into(),
            bytes: 4096,
            start_unix_ns: start,
            end_unix_ns: start + 2_500,
            channels: (0..3)
                .map(|ch| ChannelWork {
                    channel: ch,
                    start_unix_ns: start + 10,
                    end_unix_ns: start + 2_000 + u64::from(ch),
                    work_items: 1,
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn one_process_per_rank_one_track_per_channel_exact_absolute_times_flows_between_ranks() {
        let t = 1_780_000_000_123_456_789;
        let mut w = PerfettoWriter::new(Vec::new()).unwrap();
        for seq in 0..4 {
            for rank in 0..2 {
                w.write(&coll(rank, seq, t + seq * 10_000)).unwrap();
            }
        }
        let bytes = w.finish().unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        let doc: Value = serde_json::from_slice(&bytes).unwrap();
        let events = doc["traceEvents"].as_array().unwrap();
        // Microseconds since the Unix epoch (PyTorch's profiler clock), every ns digit kept.
        assert!(text.contains(r#""ts":1780000000123466.789"#), "{text}");

        let procs: Vec<_> = events
            .iter()
            .filter(|e| e["name"] == "process_name")
            .collect();
        assert_eq!(procs.len(), 2);
        assert_eq!(procs[1]["args"]["name"], "rank 1 (h pid 101)");
        let colls: Vec<_> = events.iter().filter(|e| e["cat"] == "collective").collect();
        assert_eq!(colls.len(), 8);
        let c = colls[3]; // seq 1, rank 1
        assert_eq!(
            (c["args"]["seq"].as_u64(), c["args"]["rank"].as_u64()),
            (Some(1), Some(1))
        );
        assert_eq!(c["args"]["comm_hash"], "0000000000000abc");
        assert_eq!(c["dur"].as_f64().unwrap(), 2.5);
        // Each instance: a flow out of rank 0's slice into rank 1's, one id per link.
        let flows: Vec<_> = events.iter().filter(|e| e["cat"] == "flow").collect();
        assert_eq!(flows.len(), 8);
        for pair in flows.chunks(2) {
            assert_eq!((&pair[0]["ph"], &pair[1]["ph"]), (&json!("s"), &json!("f")));
            assert_eq!(pair[0]["id"], pair[1]["id"]);
            assert_eq!(
                (pair[0]["pid"].as_u64(), pair[1]["pid"].as_u64()),
                (Some(1), Some(2))
            );
        }
        assert_ne!(flows[0]["id"], flows[2]["id"], "instances apart");

        let tracks: std::collections::BTreeSet<_> = events
            .iter()
            .filter(|e| e["name"] == "thread_name" && e["pid"] == 1)
            .map(|e| e["args"]["name"].as_str().unwrap().to_string())
            .collect();
        let want: std::collections::BTreeSet<_> = [
            "comm 0000000000000abc collectives",
            "comm 0000000000000abc channel 0",
            "comm 0000000000000abc channel 1",
            "comm 0000000000000abc channel 2",
        ]
        .map(String::from)
        .into();
        assert_eq!(tracks, want);
        assert_eq!(events.iter().filter(|e| e["cat"] == "channel").count(), 24);
    }

    #[test]
    fn a_host_timed_instance_has_no_exec_time_or_bandwidth() {
        let mut c = coll(0, 1, 1_000);
        c.timing_source = "device_hook".into();
        c.exec_ns = 1_990;
        assert_eq!(attributes(&c)["exec_ns"], 1_990);
        c.timing_source = "host".into();
        c.exec_ns = 0;
        let args = attributes(&c);
        for timed in ["exec_ns", "algbw_gbs", "busbw_gbs"] {
            assert!(args.get(timed).is_none(), "{timed}: {args}");
        }
        assert_eq!(args["timing_source"], "host");
    }

    #[test]
    fn an_empty_export_is_a_valid_trace() {
        let doc: Value =
            serde_json::from_slice(&PerfettoWriter::new(Vec::new()).unwrap().finish().unwrap())
                .unwrap();
        assert_eq!(doc["traceEvents"].as_array().unwrap().len(), 0);
    }
}
