//! `ncclscope stats`: a one-shot table (or JSON for scripts) of the daemon's statistics per job,
//! collective, size bucket and rank, with the current straggler and the loss counters.

use std::fmt::Write as _;
use std::path::PathBuf;

use ncclscope_proto::api::{
    Job, ListJobsRequest, ListJobsResponse, RankStats, StatsRequest, StatsResponse,
};
use serde_json::{Value, json};

use crate::api;

#[derive(clap::Args)]
pub struct Args {
    /// Only this job (default: every job on this node).
    #[arg(long)]
    pub job: Option<String>,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The daemon's query API socket.
    #[arg(long, env = api::API_SOCKET_ENV, default_value = api::DEFAULT_API_SOCKET)]
    pub api_socket: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (jobs, stats) = rt.block_on(fetch(
        &args.api_socket,
        args.job.as_deref().unwrap_or(""),
        true,
    ))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&jobs, &stats))?);
    } else {
        print!("{}", render(&jobs, &stats));
    }
    Ok(())
}

/// The jobs (filtered to `job` unless empty) and statistics, from the daemon. With `require_job`, a job
/// the daemon does not know is an error (else it is just not there yet).
pub async fn fetch(
    socket: &std::path::Path,
    job: &str,
    require_job: bool,
) -> anyhow::Result<(ListJobsResponse, StatsResponse)> {
    let mut client = api::connect(socket).await?;
    let mut jobs = client.list_jobs(ListJobsRequest {}).await?.into_inner();
    if !job.is_empty() {
        let known: Vec<String> = (jobs.jobs.iter().take(10))
            .map(|j| format!("{:?}", j.job_id))
            .collect();
        jobs.jobs.retain(|j| j.job_id == job);
        if jobs.jobs.is_empty() && require_job {
            match known.is_empty() {
                true => anyhow::bail!("the daemon has no job {job:?} (it has none)"),
                false => anyhow::bail!(
                    "the daemon has no job {job:?} (it has {})",
                    known.join(", ")
                ),
            }
        }
    }
    let stats = client
        .get_stats(StatsRequest {
            job_id: job.to_string(),
            uid: None,
        })
        .await?
        .into_inner();
    Ok((jobs, stats))
}

/// The rank that was last to start most often in each (uid, job, communicator), if any was.
/// Sends and receives per (rank, peer): which pipeline stage or expert a rank waits on.
fn p2p_table(out: &mut String, stats: &StatsResponse, uid: u32, id: &str) {
    let rows: Vec<_> = stats
        .p2p
        .iter()
        .filter(|p| (p.uid, p.job_id.as_str()) == (uid, id))
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "  {:<16} {:>5} {:<4} {:>5} {:>9} {:>10} {:>12} {:>12} {:>12}",
        "COMM", "RANK", "P2P", "PEER", "COUNT", "BYTES", "EXEC p50", "EXEC p99", "GPU-TIMED"
    );
    for p in rows {
        let _ = writeln!(
            out,
            "  {:<16} {:>5} {:<4} {:>5} {:>9} {:>10} {:>12} {:>12} {:>12}",
            format!("{:016x}", p.comm_hash),
            p.rank,
            p.func,
            p.peer,
            p.transfers,
            bytes(p.bytes),
            timed(p.device_timed, us(p.exec_p50_us)),
            timed(p.device_timed, us(p.exec_p99_us)),
            p.device_timed
        );
    }
}

/// An exec-time cell: "-" where none of the transfers was GPU-timed (host times have no exec).
fn timed(device_timed: u64, cell: String) -> String {
    if device_timed == 0 { "-".into() } else { cell }
}

/// Bytes in binary units, as the size buckets name them.
fn bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut k) = (b as f64, 0);
    while v >= 1024.0 && k < UNITS.len() - 1 {
        v /= 1024.0;
        k += 1;
    }
    if k == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[k])
    }
}

pub fn stragglers(ranks: &[RankStats]) -> Vec<&RankStats> {
    let mut best: Vec<&RankStats> = Vec::new();
    for r in ranks.iter().filter(|r| r.straggler_count > 0) {
        match best
            .iter_mut()
            .find(|b| b.uid == r.uid && b.job_id == r.job_id && b.comm_hash == r.comm_hash)
        {
            Some(b) if r.straggler_count > b.straggler_count => *b = r,
            Some(_) => {}
            None => best.push(r),
        }
    }
    best
}

/// The table `stats` prints: per job (uid, job id), its collectives by size bucket, its ranks, the
/// straggler; then the daemon's health counters.
pub fn render(jobs: &ListJobsResponse, stats: &StatsResponse) -> String {
    let mut out = String::new();
    let job_ids: Vec<(u32, &str)> = {
        let mut ids: Vec<(u32, &str)> = jobs
            .jobs
            .iter()
            .map(|j| (j.uid, j.job_id.as_str()))
            .collect();
        for id in stats
            .colls
            .iter()
            .map(|c| (c.uid, c.job_id.as_str()))
            .chain(stats.ranks.iter().map(|r| (r.uid, r.job_id.as_str())))
        {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    };
    if job_ids.is_empty() {
        out.push_str("no jobs yet\n");
    }
    for (uid, id) in job_ids {
        let job = jobs
            .jobs
            .iter()
            .find(|j| (j.uid, j.job_id.as_str()) == (uid, id));
        let (n, live) = job.map_or((0, false), |j| (j.collectives, j.live));
        // The job listing names the communicators of attached processes; after they exit the
        // statistics still hold their ranks.
        let (comms, ranks) = shape(job, &stats.ranks, uid, id);
        let _ = writeln!(
            out,
            "job {id}  (uid {uid}, {}, {ranks} ranks, {comms} communicators, {n} collectives)",
            if live { "live" } else { "ended" }
        );
        let colls: Vec<_> = stats
            .colls
            .iter()
            .filter(|c| (c.uid, c.job_id.as_str()) == (uid, id))
            .collect();
        if !colls.is_empty() {
            let _ = writeln!(
                out,
                "  {:<16} {:<14} {:<12} {:>9} {:>12} {:>12} {:>12}",
                "COMM", "COLLECTIVE", "SIZE", "COUNT", "EXEC p50", "EXEC p99", "BUSBW p50"
            );
            for c in colls {
                let _ = writeln!(
                    out,
                    "  {:<16} {:<14} {:<12} {:>9} {:>12} {:>12} {:>12}",
                    format!("{:016x}", c.comm_hash),
                    c.func,
                    c.size_bucket,
                    c.count,
                    us(c.exec_p50_us),
                    us(c.exec_p99_us),
                    format!("{:.1} GB/s", c.busbw_p50_gbs)
                );
            }
        }
        let ranks: Vec<RankStats> = stats
            .ranks
            .iter()
            .filter(|r| (r.uid, r.job_id.as_str()) == (uid, id))
            .cloned()
            .collect();
        if !ranks.is_empty() {
            let _ = writeln!(
                out,
                "  {:<16} {:>5} {:>9} {:>12} {:>12} {:>12} {:>14} {:>8}",
                "COMM",
                "RANK",
                "COLLS",
                "EXEC p50",
                "EXEC p99",
                "SKEW p50",
                "LAST TO START",
                "LOST"
            );
            for r in &ranks {
                let _ = writeln!(
                    out,
                    "  {:<16} {:>5} {:>9} {:>12} {:>12} {:>12} {:>14} {:>8}",
                    format!("{:016x}", r.comm_hash),
                    r.rank,
                    r.collectives,
                    us(r.exec_p50_us),
                    us(r.exec_p99_us),
                    us(r.skew_p50_us),
                    r.straggler_count,
                    r.lost
                );
            }
            for s in stragglers(&ranks) {
                let _ = writeln!(out, "  {}", straggler_line(s));
            }
        }
        p2p_table(&mut out, stats, uid, id);
        out.push('\n');
    }
    if let Some(h) = &stats.health {
        // Stages that lost nothing are left out of the table (`--json` has them all).
        let mut lost: Vec<_> = h.lost.iter().filter(|(_, v)| **v > 0).collect();
        lost.sort();
        let mut lost: Vec<String> = lost.iter().map(|(k, v)| format!("{k}={v}")).collect();
        if lost.is_empty() {
            lost.push("nothing".into());
        }
        let _ = writeln!(
            out,
            "daemon: {} segments, {} records in, {} decode errors, lost [{}], {} spans exported, {} export errors, \
             max calibration error {} ns",
            h.segments,
            h.records_in,
            h.decode_errors,
            lost.join(" "),
            h.spans_exported,
            h.export_errors,
            h.max_calibration_error_ns
        );
    }
    out
}

/// (communicators, ranks of the largest one) of a job, from its listing or else its rank statistics.
pub fn shape(job: Option<&Job>, ranks: &[RankStats], uid: u32, id: &str) -> (usize, usize) {
    let listed = job.map_or((0, 0), |j| {
        let ranks = j
            .communicators
            .iter()
            .map(|c| c.ranks.len())
            .max()
            .unwrap_or(0);
        (j.communicators.len(), ranks)
    });
    let mut per_comm: std::collections::BTreeMap<u64, usize> = Default::default();
    for r in ranks.iter().filter(|r| r.uid == uid && r.job_id == id) {
        *per_comm.entry(r.comm_hash).or_default() += 1;
    }
    let seen = (
        per_comm.len(),
        per_comm.values().copied().max().unwrap_or(0),
    );
    (listed.0.max(seen.0), listed.1.max(seen.1))
}

/// One line naming a communicator's straggler and why.
pub fn straggler_line(s: &RankStats) -> String {
    let share = if s.collectives > 0 {
        100.0 * s.straggler_count as f64 / s.collectives as f64
    } else {
        0.0
    };
    format!(
        "straggler: rank {} of comm {:016x} (last to start in {} of its {} collectives, {share:.0}%; skew p50 {})",
        s.rank,
        s.comm_hash,
        s.straggler_count,
        s.collectives,
        us(s.skew_p50_us)
    )
}

/// Microseconds, scaled for reading.
pub fn us(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.1} ms", v / 1000.0)
    } else {
        format!("{v:.1} us")
    }
}

/// The JSON `stats --json` prints: stable field names (the proto's), comm hashes as 16 hex digits.
pub fn to_json(jobs: &ListJobsResponse, stats: &StatsResponse) -> Value {
    let hash = |h: u64| format!("{h:016x}");
    json!({
        "jobs": jobs.jobs.iter().map(|j| json!({
            "uid": j.uid, "job_id": j.job_id, "collectives": j.collectives, "live": j.live,
            "first_unix_ns": j.first_unix_ns, "last_unix_ns": j.last_unix_ns,
            "communicators": j.communicators.iter().map(|c| json!({
                "comm_hash": hash(c.comm_hash), "name": c.name, "nranks": c.nranks, "nnodes": c.nnodes,
                "ranks": c.ranks.iter().map(|r| json!({
                    "rank": r.rank, "pid": r.pid, "cuda_dev": r.cuda_dev, "timing_path": r.timing_path,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "colls": stats.colls.iter().map(|c| json!({
            "uid": c.uid, "job_id": c.job_id, "comm_hash": hash(c.comm_hash), "func": c.func,
            "size_bucket": c.size_bucket,
            "count": c.count, "exec_p50_us": c.exec_p50_us, "exec_p99_us": c.exec_p99_us,
            "busbw_p50_gbs": c.busbw_p50_gbs,
        })).collect::<Vec<_>>(),
        "ranks": stats.ranks.iter().map(|r| json!({
            "uid": r.uid, "job_id": r.job_id, "comm_hash": hash(r.comm_hash), "rank": r.rank,
            "collectives": r.collectives,
            "exec_p50_us": r.exec_p50_us, "exec_p99_us": r.exec_p99_us, "skew_p50_us": r.skew_p50_us,
            "straggler_count": r.straggler_count, "lost": r.lost,
        })).collect::<Vec<_>>(),
        "p2p": stats.p2p.iter().map(|p| json!({
            "uid": p.uid, "job_id": p.job_id, "comm_hash": hash(p.comm_hash), "rank": p.rank,
            "func": p.func, "peer": p.peer, "transfers": p.transfers, "bytes": p.bytes,
            "device_timed": p.device_timed, "exec_p50_us": p.exec_p50_us, "exec_p99_us": p.exec_p99_us,
        })).collect::<Vec<_>>(),
        "stragglers": stragglers(&stats.ranks).iter().map(|r| json!({
            "uid": r.uid, "job_id": r.job_id, "comm_hash": hash(r.comm_hash), "rank": r.rank,
            "straggler_count": r.straggler_count,
        })).collect::<Vec<_>>(),
        "health": stats.health.as_ref().map(|h| json!({
            "segments": h.segments, "records_in": h.records_in, "decode_errors": h.decode_errors,
            "lost": h.lost, "export_errors": h.export_errors, "spans_exported": h.spans_exported,
            "max_calibration_error_ns": h.max_calibration_error_ns,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclscope_proto::api::{CollStats, Health, Job, P2pStats};

    fn sample() -> (ListJobsResponse, StatsResponse) {
        let jobs = ListJobsResponse {
            jobs: vec![Job {
                job_id: "train".into(),
                collectives: 40,
                live: true,
                ..Default::default()
            }],
        };
        let ranks = (0..4)
            .map(|rank| RankStats {
                job_id: "train".into(),
                comm_hash: 0xfeed,
                rank,
                collectives: 10,
                exec_p50_us: 100.0,
                exec_p99_us: 150.0,
                skew_p50_us: if rank == 2 { 2500.0 } else { 3.0 },
                straggler_count: if rank == 2 { 9 } else { u64::from(rank == 0) },
                lost: 0,
                uid: 0,
            })
            .collect();
        let stats = StatsResponse {
            colls: vec![CollStats {
                job_id: "train".into(),
                comm_hash: 0xfeed,
                func: "AllReduce".into(),
                size_bucket: "<=1MiB".into(),
                count: 40,
                exec_p50_us: 100.0,
                exec_p99_us: 150.0,
                busbw_p50_gbs: 12.5,
                uid: 0,
            }],
            ranks,
            p2p: vec![P2pStats {
                job_id: "train".into(),
                comm_hash: 0xfeed,
                rank: 1,
                func: "Send".into(),
                peer: 2,
                transfers: 20,
                bytes: 20 << 20,
                device_timed: 20,
                exec_p50_us: 80.0,
                exec_p99_us: 95.0,
                uid: 0,
            }],
            health: Some(Health {
                segments: 4,
                lost: [("ring_full".to_string(), 3)].into(),
                ..Default::default()
            }),
        };
        (jobs, stats)
    }

    #[test]
    fn table_names_the_straggler_and_the_losses() {
        let (jobs, stats) = sample();
        let t = render(&jobs, &stats);
        // A rank's sends per peer, with bytes and how many were timed on the GPU.
        assert!(
            t.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
                == [
                    "000000000000feed",
                    "1",
                    "Send",
                    "2",
                    "20",
                    "20.0",
                    "MiB",
                    "80.0",
                    "us",
                    "95.0",
                    "us",
                    "20"
                ]),
            "{t}"
        );
        assert!(
            t.contains("job train  (uid 0, live, 4 ranks, 1 communicators, 40 collectives)"),
            "{t}"
        );
        assert!(
            t.contains("straggler: rank 2 of comm 000000000000feed (last to start in 9 of its 10"),
            "{t}"
        );
        assert!(t.contains("lost [ring_full=3]"), "{t}");
        assert!(t.contains("12.5 GB/s"), "{t}");
    }

    #[test]
    fn json_carries_every_row_and_the_straggler() {
        let (jobs, stats) = sample();
        let v = to_json(&jobs, &stats);
        assert_eq!(v["ranks"].as_array().unwrap().len(), 4);
        assert_eq!(v["colls"][0]["count"], 40);
        assert_eq!(v["stragglers"][0]["rank"], 2);
        assert_eq!(v["health"]["lost"]["ring_full"], 3);
    }
}
