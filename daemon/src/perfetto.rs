//! Writes collective instances as a Chrome/Perfetto trace (the JSON "Trace Event Format"), streaming, so
//! a job of any length exports in constant memory per rank.
//!
//! One process per rank (OS process: host + pid, named after its rank), and per communicator of that
//! process one track for the collectives and one track per channel holding that channel's kernel work.
//! Every slice carries the collective's attributes. Timestamps are microseconds (with ns decimals)
//! relative to `t0`, a whole second one hour before the first instance seen, recorded in the trace's
//! metadata as `ncclscope_t0_unix_ns`: relative so that doubles keep ns precision, and early enough that
//! an instance that completes later but started earlier stays positive.

use std::collections::HashMap;
use std::io::{self, Write};

use ncclscope_proto::api::Collective;
use serde_json::{Value, json};

/// Track ids per communicator within a process: the collectives track, then one per channel.
const TRACKS_PER_COMM: u64 = 1024;
const T0_MARGIN_NS: u64 = 3600 * 1_000_000_000;

pub struct PerfettoWriter<W: Write> {
    out: W,
    t0: Option<u64>,
    /// (host, pid) -> trace pid.
    processes: HashMap<(String, u32), u64>,
    /// (trace pid, comm hash) -> index of that communicator in the process.
    comms: HashMap<(u64, u64), u64>,
    named_tracks: std::collections::HashSet<(u64, u64)>,
    first_event: bool,
    slices: u64,
}

impl<W: Write> PerfettoWriter<W> {
    pub fn new(mut out: W) -> io::Result<Self> {
        out.write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n")?;
        Ok(PerfettoWriter {
            out,
            t0: None,
            processes: HashMap::new(),
            comms: HashMap::new(),
            named_tracks: Default::default(),
            first_event: true,
            slices: 0,
        })
    }

    /// Collective slices written so far.
    pub fn collectives(&self) -> u64 {
        self.slices
    }

    pub fn write(&mut self, c: &Collective) -> io::Result<()> {
        let (start, end) = extent(c);
        let t0 = *self.t0.get_or_insert_with(|| {
            let floor = start.saturating_sub(T0_MARGIN_NS);
            floor - floor % 1_000_000_000
        });
        let pid = self.process(c)?;
        let comm_idx = self.comm(pid, c.comm_hash);
        let coll_tid = comm_idx * TRACKS_PER_COMM;
        let comm_label = comm_label(c);
        self.track(pid, coll_tid, || format!("{comm_label} collectives"))?;
        let args = attributes(c);
        self.event(json!({
            "ph": "X", "cat": "collective", "name": c.func, "pid": pid, "tid": coll_tid,
            "ts": micros(start.saturating_sub(t0)), "dur": micros(end.saturating_sub(start)), "args": args,
        }))?;
        for ch in &c.channels {
            let tid = coll_tid + 1 + u64::from(ch.channel);
            self.track(pid, tid, || format!("{comm_label} channel {}", ch.channel))?;
            self.event(json!({
                "ph": "X", "cat": "channel", "name": c.func, "pid": pid, "tid": tid,
                "ts": micros(ch.start_unix_ns.saturating_sub(t0)),
                "dur": micros(ch.end_unix_ns.saturating_sub(ch.start_unix_ns)),
                "args": {"seq": c.seq, "replay": c.replay, "channel": ch.channel, "work_items": ch.work_items,
                         "comm_hash": format!("{:016x}", c.comm_hash)},
            }))?;
        }
        self.slices += 1;
        Ok(())
    }

    /// Closes the JSON document and returns the writer (flushed).
    pub fn finish(mut self) -> io::Result<W> {
        self.out.write_all(b"\n],\"metadata\":")?;
        let meta = json!({"ncclscope_t0_unix_ns": self.t0.unwrap_or(0), "ncclscope_collectives": self.slices});
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
        let pid = self.processes.len() as u64 + 1;
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
        if !self.first_event {
            self.out.write_all(b",\n")?;
        }
        self.first_event = false;
        serde_json::to_writer(&mut self.out, &v).map_err(io::Error::from)
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

/// Every attribute of a collective instance, as slice args.
pub fn attributes(c: &Collective) -> Value {
    json!({
        "uid": c.uid, "job_id": c.job_id, "host": c.host, "pid": c.pid,
        "comm_hash": format!("{:016x}", c.comm_hash), "comm_name": c.comm_name,
        "rank": c.rank, "nranks": c.nranks, "nnodes": c.nnodes, "seq": c.seq, "replay": c.replay,
        "func": c.func, "datatype": c.datatype, "algo": c.algo, "proto": c.proto,
        "count": c.count, "bytes": c.bytes, "root": c.root, "peer": c.peer, "is_p2p": c.is_p2p,
        "n_channels": c.n_channels, "timing_source": c.timing_source,
        "enqueue_unix_ns": c.enqueue_unix_ns, "start_unix_ns": c.start_unix_ns, "end_unix_ns": c.end_unix_ns,
        "exec_ns": c.exec_ns, "algbw_gbs": c.algbw_gbs, "busbw_gbs": c.busbw_gbs,
        "calibration_error_ns": c.calibration_error_ns,
    })
}

/// Nanoseconds as the format's microseconds; exact to the ns while `ns` < 2^53 (104 days past `t0`).
fn micros(ns: u64) -> f64 {
    ns as f64 / 1000.0
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
    fn one_process_per_rank_one_track_per_channel_exact_times() {
        let t = 1_780_000_000_123_456_789;
        let mut w = PerfettoWriter::new(Vec::new()).unwrap();
        for seq in 0..4 {
            for rank in 0..2 {
                w.write(&coll(rank, seq, t + seq * 10_000)).unwrap();
            }
        }
        let doc: Value = serde_json::from_slice(&w.finish().unwrap()).unwrap();
        let events = doc["traceEvents"].as_array().unwrap();
        let t0 = doc["metadata"]["ncclscope_t0_unix_ns"].as_u64().unwrap();
        assert!(t0 < t && t0.is_multiple_of(1_000_000_000));

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
        // ns precision survives: ts * 1000 + t0 is the exact start.
        let ts_ns = (c["ts"].as_f64().unwrap() * 1000.0).round() as u64;
        assert_eq!(ts_ns + t0, t + 10_000);
        assert_eq!(c["dur"].as_f64().unwrap(), 2.5);

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
    fn an_empty_export_is_a_valid_trace() {
        let doc: Value =
            serde_json::from_slice(&PerfettoWriter::new(Vec::new()).unwrap().finish().unwrap())
                .unwrap();
        assert_eq!(doc["traceEvents"].as_array().unwrap().len(), 0);
    }
}
