//! A job across nodes, as an operator runs one: two daemons as two nodes (own sockets, state, spool,
//! `/metrics` on 127.0.0.1 and 127.0.0.2, distinct `host.name`/`service.instance.id`), each serving 2
//! ranks of one 4-rank communicator (`ncclscope sim-rank`: the real plugin through the fake NCCL
//! host, NCCL's `nnodes` = 2), both exporting to one real OTLP/gRPC receiver. Every instance is one
//! trace holding the 4 rank spans from both nodes under one root, and the series say `n_nodes="2"`.
//! A second job runs on the same nodes at the same time: its communicator hash is its own, so no
//! trace holds spans of both.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fake_opentelemetry_collector::{ExportedSpan, FakeCollectorServer};

use common::SimJob;
use ncclscope::cli::sim_rank::node_of;
use ncclscope_proto::TEST_CLOCK_OFFSET;

struct Daemon {
    child: Child,
    dir: PathBuf,
    metrics: String,
    /// Its node's clock offset, its ranks' too.
    clock_offset_ns: i64,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn get(url: &str) -> Option<String> {
    let out = Command::new("curl")
        .args(["-sSf", "--max-time", "10", url])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Node `index`'s daemon: its directory under `root`, /metrics on 127.0.0.<index + 1>, its name
/// `node-<index>`, exporting to `endpoint`, its clock `clock_offset_ns` off the host's.
fn node(root: &Path, index: u32, endpoint: &str, clock_offset_ns: i64) -> Daemon {
    let dir = root.join(format!("node{index}"));
    std::fs::create_dir(&dir).unwrap();
    let ip = format!("127.0.0.{}", index + 1);
    let listen = format!("{ip}:{}", ncclscope_tests::free_port(&ip));
    std::fs::write(
        dir.join("ncclscope.toml"),
        format!(
            "[prometheus]\nlisten = \"{listen}\"\njob_series = true\n[otlp]\n\
             resource_attributes = \"host.name=node-{index},service.instance.id=node-{index}\"\n"
        ),
    )
    .unwrap();
    let child =
        ncclscope_tests::daemon_args(&mut Command::new(ncclscope_tests::daemon_binary()), &dir)
            .args(["--otlp-endpoint", endpoint])
            .env(TEST_CLOCK_OFFSET, clock_offset_ns.to_string())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("daemon.log")).unwrap())
            .spawn()
            .unwrap();
    let metrics = format!("http://{listen}/metrics");
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(&format!("http://{listen}/healthz")).is_none() {
        assert!(
            Instant::now() < deadline,
            "node {index}'s daemon never answered"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Daemon {
        child,
        dir,
        metrics,
        clock_offset_ns,
    }
}

/// What the receiver and the nodes' `/metrics` showed of jobs run to their end.
struct Seen {
    spans: Vec<ExportedSpan>,
    /// Each node's last scrape that had series of the first job.
    texts: Vec<String>,
    /// Instances each job ran.
    instances: usize,
}

/// Runs `jobs` (of equal length) on `nodes`, collecting the spans every instance of them makes.
async fn run(collector: &mut FakeCollectorServer, nodes: &[Daemon], jobs: &[SimJob<'_>]) -> Seen {
    let sockets: Vec<PathBuf> = nodes.iter().map(|n| n.dir.join("reg.sock")).collect();
    let sockets: Vec<&Path> = sockets.iter().map(PathBuf::as_path).collect();
    let ranks: Vec<Child> = jobs
        .iter()
        .flat_map(|j| {
            // Each rank on its node's clock.
            let nnodes = nodes.len() as u32;
            j.commands(&sockets)
                .into_iter()
                .enumerate()
                .map(move |(rank, mut c)| {
                    let node = &nodes[node_of(rank as u32, j.nranks, nnodes) as usize];
                    c.env(TEST_CLOCK_OFFSET, node.clock_offset_ns.to_string());
                    c
                })
        })
        .map(|mut c| c.spawn().unwrap())
        .collect();
    let waited = tokio::task::spawn_blocking(move || common::produced(ranks));

    // The receiver hands spans over through a bounded queue: drain it while the ranks run, and
    // read each node's series meanwhile.
    let first = format!("job_id=\"{}\"", jobs[0].job);
    let mut spans: Vec<ExportedSpan> = Vec::new();
    let mut texts = vec![String::new(); nodes.len()];
    while !waited.is_finished() {
        spans.extend(
            collector
                .exported_spans(1, Duration::from_millis(200))
                .await,
        );
        for (text, n) in texts.iter_mut().zip(nodes) {
            if let Some(t) = get(&n.metrics).filter(|t| t.contains(&first)) {
                *text = t;
            }
        }
    }
    let produced = waited.await.unwrap();
    assert!(
        produced.iter().all(|&p| p == produced[0] && p > 0),
        "{produced:?}"
    );
    // Per job.
    let instances = produced[0] as usize;

    // A root comes with the last of its node's rank spans, or once it stops waiting for them.
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && {
        let (ranks, roots) = count(&spans);
        ranks < jobs.len() * 4 * instances || roots < jobs.len() * instances
    } {
        spans.extend(
            collector
                .exported_spans(1, Duration::from_millis(200))
                .await,
        );
    }
    spans.extend(
        collector
            .exported_spans(usize::MAX, Duration::from_millis(500))
            .await,
    );
    Seen {
        spans,
        texts,
        instances,
    }
}

/// (rank spans, roots) among `spans`.
fn count(spans: &[ExportedSpan]) -> (usize, usize) {
    let ranks = spans.iter().filter(|s| s.name.ends_with(" rank")).count();
    let roots = spans.iter().filter(|s| s.parent_span_id.is_empty()).count();
    (ranks, roots)
}

/// `spans` by trace id.
fn traces(spans: &[ExportedSpan]) -> BTreeMap<&str, Vec<&ExportedSpan>> {
    let mut traces: BTreeMap<&str, Vec<&ExportedSpan>> = BTreeMap::new();
    for s in spans {
        traces.entry(s.trace_id.as_str()).or_default().push(s);
    }
    traces
}

/// Asserts each trace is one instance: one root, the 4 rank spans under it, of one job.
fn assert_one_instance_each(traces: &BTreeMap<&str, Vec<&ExportedSpan>>, spans: &[ExportedSpan]) {
    for (id, t) in traces {
        let roots: Vec<&&ExportedSpan> = t.iter().filter(|s| s.parent_span_id.is_empty()).collect();
        let names: Vec<(&str, &str)> = t
            .iter()
            .map(|s| (s.name.as_str(), ncclscope_tests::attr(s, "nccl.rank")))
            .collect();
        assert_eq!(
            roots.len(),
            1,
            "trace {id}: {names:?}; (rank spans, roots) in all: {:?}",
            count(spans)
        );
        let mut ranks: Vec<&str> = t
            .iter()
            .filter(|s| s.name.ends_with(" rank"))
            .inspect(|s| assert_eq!(s.parent_span_id, roots[0].span_id, "trace {id}"))
            .map(|s| ncclscope_tests::attr(s, "nccl.rank"))
            .collect();
        ranks.sort();
        assert_eq!(ranks, ["0", "1", "2", "3"], "trace {id}: {names:?}");
        let jobs: BTreeSet<&str> = t
            .iter()
            .map(|s| ncclscope_tests::attr(s, "job.id"))
            .collect();
        assert_eq!(jobs.len(), 1, "trace {id}: {jobs:?}");
        assert!(
            t.iter()
                .filter(|s| s.name.ends_with(" rank"))
                .all(|s| ncclscope_tests::attr(s, "nccl.nnodes") == "2"),
            "trace {id}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_communicator_on_two_nodes_is_one_trace_per_instance_with_n_nodes_2() {
    let mut collector = FakeCollectorServer::start().await.unwrap();
    let root = tempfile::tempdir().unwrap();
    let nodes = [
        node(root.path(), 0, &collector.endpoint(), 0),
        node(root.path(), 1, &collector.endpoint(), 0),
    ];
    let job = SimJob {
        straggler: Some(3),
        ..SimJob::new("multi-node", 4, 3)
    };
    let other = SimJob::new("multi-node-b", 4, 3);
    let Seen {
        spans,
        texts,
        instances,
    } = run(&mut collector, &nodes, &[job, other]).await;

    // Each node's daemon saw its own two ranks only, and says the communicator spans 2 nodes.
    for (k, text) in texts.iter().enumerate() {
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("ncclscope_collective_exec_time_microseconds_count{"))
            .filter(|l| l.contains("job_id=\"multi-node\""))
            .collect();
        assert!(!series.is_empty(), "node {k}:\n{text}");
        assert!(
            series
                .iter()
                .all(|l| l.contains("n_nodes=\"2\"") && l.contains("nranks=\"4\"")),
            "node {k}: {series:?}"
        );
        let ranks: BTreeSet<&str> = text
            .lines()
            .filter(|l| {
                l.starts_with("ncclscope_rank_collectives_total{")
                    && l.contains("job_id=\"multi-node\"")
            })
            .map(|l| {
                l.split("rank=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap()
            })
            .collect();
        let want: BTreeSet<&str> = if k == 0 { ["0", "1"] } else { ["2", "3"] }.into();
        assert_eq!(ranks, want, "node {k}");
    }

    // Every instance of each job: one trace, one root (rank 0's node sends it), the 4 rank spans under
    // it, ranks 0-1 from node 0's daemon and 2-3 from node 1's (each daemon serves only its own
    // ranks), all of the one job.
    let traces = traces(&spans);
    assert_eq!(traces.len(), 2 * instances, "{} spans", spans.len());
    assert_one_instance_each(&traces, &spans);
}

/// Per rank of `job`, the sum of `family`'s series in a node's `/metrics` text.
fn per_rank(text: &str, family: &str, job: &str) -> BTreeMap<String, f64> {
    let mut sums = BTreeMap::new();
    let job = format!("job_id=\"{job}\"");
    for l in text.lines() {
        if !l.starts_with(&format!("{family}{{")) || !l.contains(&job) {
            continue;
        }
        let rank = l
            .split("rank=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        let value: f64 = l.rsplit(' ').next().unwrap().parse().unwrap();
        *sums.entry(rank.to_string()).or_default() += value;
    }
    sums
}

/// Nodes' clocks differ (NTP or PTP keep them only so close): node 1's runs 7 ms ahead, its daemon's
/// and its ranks' alike. Trace and span ids never depend on a clock, so every instance is still one
/// trace of 4 rank spans under one root; node 1's spans start ~7 ms after node 0's of the same
/// instance (the offset reaches the receiver); and the exec-time lateness, a duration on each rank's
/// own clock, still names the one late rank of a job with a straggler and none of a job without; and
/// `export` over both daemons makes one trace of each job with node 1's clock estimated and corrected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_with_differing_clocks_still_join_and_name_no_rank_late() {
    const OFFSET_NS: i64 = 7_000_000;
    let mut collector = FakeCollectorServer::start().await.unwrap();
    let root = tempfile::tempdir().unwrap();
    let nodes = [
        node(root.path(), 0, &collector.endpoint(), 0),
        node(root.path(), 1, &collector.endpoint(), OFFSET_NS),
    ];
    let late = SimJob {
        straggler: Some(3),
        ..SimJob::new("clock-late", 4, 3)
    };
    let healthy = SimJob::new("clock-healthy", 4, 3);
    let Seen {
        spans,
        texts,
        instances,
    } = run(&mut collector, &nodes, &[late, healthy]).await;

    let traces = traces(&spans);
    assert_eq!(traces.len(), 2 * instances, "{} spans", spans.len());
    assert_one_instance_each(&traces, &spans);

    // Per instance of the healthy job: node 1's ranks' mean start less node 0's; their median.
    let mut shifts: Vec<i64> = traces
        .values()
        .filter(|t| ncclscope_tests::attr(t[0], "job.id") == "clock-healthy")
        .map(|t| {
            let start = |ranks: [&str; 2]| {
                let s: Vec<i64> = t
                    .iter()
                    .filter(|s| s.name.ends_with(" rank"))
                    .filter(|s| ranks.contains(&ncclscope_tests::attr(s, "nccl.rank")))
                    .map(|s| s.start_time_unix_nano as i64)
                    .collect();
                assert_eq!(s.len(), 2);
                (s[0] + s[1]) / 2
            };
            start(["2", "3"]) - start(["0", "1"])
        })
        .collect();
    assert_eq!(shifts.len(), instances);
    shifts.sort();
    let median = shifts[shifts.len() / 2];
    assert!(
        (median - OFFSET_NS).abs() < 2_500_000,
        "node 1's spans start {median} ns after node 0's, not ~{OFFSET_NS}"
    );

    // Lateness per rank (the communicator's longest mean exec time less the rank's own, us), as the
    // shipped recording rules compute it across both nodes' series.
    let lateness = |job: &str| -> BTreeMap<String, f64> {
        let mut mean = BTreeMap::new();
        for text in &texts {
            let exec = per_rank(text, "ncclscope_rank_exec_time_microseconds_total", job);
            let n = per_rank(text, "ncclscope_rank_timed_collectives_total", job);
            for (rank, e) in exec {
                mean.insert(rank.clone(), e / n[&rank]);
            }
        }
        assert_eq!(mean.len(), 4, "{job}: {mean:?}");
        let most = mean.values().copied().fold(0.0, f64::max);
        mean.into_iter().map(|(r, m)| (r, most - m)).collect()
    };
    let named = |job: &str| -> Vec<String> {
        let l = lateness(job);
        l.iter()
            .filter(|(_, us)| **us > 1500.0)
            .map(|(r, _)| r.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(named("clock-late"), ["3"], "{:?}", lateness("clock-late"));
    assert!(
        named("clock-healthy").is_empty(),
        "{:?}",
        lateness("clock-healthy")
    );

    // Issue 38: one trace of the job across both nodes' daemons, node 1's clock estimated from the
    // collectives (the ranks of an instance end together) and shifted onto node 0's, the estimate
    // and its error written into the trace. (Not the straggler's job: the fake NCCL runs a kernel's
    // last quarter of channels after the rest and a stream's kernels back to back, so ranks that
    // wait long for a straggler end later than it, which no real collective does.)
    {
        let job = "clock-healthy";
        let combined = root.path().join(format!("{job}.json"));
        let out = Command::new(ncclscope_tests::daemon_binary())
            .args(["export", "--job", job, "--format", "perfetto-json", "-o"])
            .arg(&combined)
            .arg("--api-socket")
            .arg(nodes[0].dir.join("api.sock"))
            .arg("--api-socket")
            .arg(nodes[1].dir.join("api.sock"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(
            err.contains("node 1 (") && err.contains("shifted onto it"),
            "{err}"
        );
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&combined).unwrap()).unwrap();
        let clocks = doc["metadata"]["ncclscope_node_clocks"].as_array().unwrap();
        assert_eq!(clocks.len(), 2, "{clocks:?}");
        let (offset, error) = (
            clocks[1]["offset_ns"].as_i64().unwrap(),
            clocks[1]["error_ns"].as_i64().unwrap(),
        );
        // The error bounds the estimate's. The simulated kernels end as exactly as the ranks are
        // scheduled on this shared CPU (within a millisecond or a few under load); on GPUs, within
        // microseconds.
        assert!(
            (offset - OFFSET_NS).abs() <= error.max(1_000) && error < OFFSET_NS,
            "{job}: node 1 estimated {offset} ns ± {error} ns ahead, not {OFFSET_NS}"
        );
        assert_eq!(clocks[1]["instances"].as_u64(), Some(instances as u64));
        // Every instance's 4 rank slices, from both nodes, end together on the one clock.
        let mut ends: BTreeMap<(String, u64), Vec<f64>> = BTreeMap::new();
        for e in doc["traceEvents"].as_array().unwrap() {
            if e["cat"] == "collective" {
                let key = (
                    e["name"].as_str().unwrap().to_string(),
                    e["args"]["seq"].as_u64().unwrap(),
                );
                ends.entry(key)
                    .or_default()
                    .push(e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap());
            }
        }
        assert_eq!(ends.len(), instances);
        let mut spreads: Vec<f64> = (ends.iter())
            .map(|(key, e)| {
                assert_eq!(e.len(), 4, "{key:?}");
                let max = e.iter().copied().fold(f64::MIN, f64::max);
                (max - e.iter().copied().fold(f64::MAX, f64::min)) * 1000.0
            })
            .collect();
        spreads.sort_by(f64::total_cmp);
        // The same trace from each node's instances exported as a spool (as the Slurm Epilog
        // leaves them beside its traces): the same estimate.
        let spools: Vec<PathBuf> = (0..2)
            .map(|k| {
                let spool = root.path().join(format!("{job}.node{k}.spool"));
                let out = Command::new(ncclscope_tests::daemon_binary())
                    .args(["export", "--job", job, "--format", "spool", "-o"])
                    .arg(&spool)
                    .arg("--api-socket")
                    .arg(nodes[k].dir.join("api.sock"))
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{out:?}");
                spool
            })
            .collect();
        let from_spools = root.path().join(format!("{job}.from-spools.json"));
        let out = Command::new(ncclscope_tests::daemon_binary())
            .args(["export", "--job", job, "--format", "perfetto-json", "-o"])
            .arg(&from_spools)
            .args(
                spools
                    .iter()
                    .flat_map(|s| [Path::new("--spool"), s.as_path()]),
            )
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let again: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&from_spools).unwrap()).unwrap();
        assert_eq!(
            again["metadata"]["ncclscope_node_clocks"],
            doc["metadata"]["ncclscope_node_clocks"]
        );
        // Uncorrected, node 1's ends would sit 7 ms after node 0's; corrected, they spread by the
        // simulated ranks' scheduling noise.
        let median = spreads[spreads.len() / 2];
        assert!(
            median < (OFFSET_NS / 2).max(2 * error) as f64,
            "{job}: the ranks' ends of an instance spread {median} ns (median); {err}"
        );
    }
}
