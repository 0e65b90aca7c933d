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

struct Daemon {
    child: Child,
    dir: PathBuf,
    metrics: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free TCP port on `ip` (a loopback address: all of 127.0.0.0/8 is the local host).
fn free_port(ip: &str) -> u16 {
    let l = std::net::TcpListener::bind((ip, 0)).unwrap();
    l.local_addr().unwrap().port()
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
/// `node-<index>`, exporting to `endpoint`.
fn node(root: &Path, index: u32, endpoint: &str) -> Daemon {
    let dir = root.join(format!("node{index}"));
    std::fs::create_dir(&dir).unwrap();
    let ip = format!("127.0.0.{}", index + 1);
    let listen = format!("{ip}:{}", free_port(&ip));
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
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_communicator_on_two_nodes_is_one_trace_per_instance_with_n_nodes_2() {
    let mut collector = FakeCollectorServer::start().await.unwrap();
    let root = tempfile::tempdir().unwrap();
    let nodes = [
        node(root.path(), 0, &collector.endpoint()),
        node(root.path(), 1, &collector.endpoint()),
    ];
    let sockets: Vec<PathBuf> = nodes.iter().map(|n| n.dir.join("reg.sock")).collect();
    let sockets: Vec<&Path> = sockets.iter().map(PathBuf::as_path).collect();
    let job = SimJob {
        straggler: Some(3),
        ..SimJob::new("multi-node", 4, 3)
    };
    let other = SimJob::new("multi-node-b", 4, 3);
    let ranks: Vec<Child> = [job, other]
        .iter()
        .flat_map(|j| j.commands(&sockets))
        .map(|mut c| c.spawn().unwrap())
        .collect();
    let waited = tokio::task::spawn_blocking(move || common::produced(ranks));

    // The receiver hands spans over through a bounded queue: drain it while the ranks run, and
    // read each node's series meanwhile.
    let mut spans: Vec<ExportedSpan> = Vec::new();
    let mut texts = [String::new(), String::new()];
    while !waited.is_finished() {
        spans.extend(
            collector
                .exported_spans(1, Duration::from_millis(200))
                .await,
        );
        for (text, n) in texts.iter_mut().zip(&nodes) {
            if let Some(t) = get(&n.metrics).filter(|t| t.contains("job_id=\"multi-node\"")) {
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
    let count = |spans: &[ExportedSpan]| {
        let ranks = spans.iter().filter(|s| s.name.ends_with(" rank")).count();
        let roots = spans.iter().filter(|s| s.parent_span_id.is_empty()).count();
        (ranks, roots)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && {
        let (ranks, roots) = count(&spans);
        ranks < 2 * 4 * instances || roots < 2 * instances
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
    let mut traces: BTreeMap<&str, Vec<&ExportedSpan>> = BTreeMap::new();
    for s in &spans {
        traces.entry(s.trace_id.as_str()).or_default().push(s);
    }
    assert_eq!(traces.len(), 2 * instances, "{} spans", spans.len());
    for (id, t) in &traces {
        let roots: Vec<&&ExportedSpan> = t.iter().filter(|s| s.parent_span_id.is_empty()).collect();
        let names: Vec<(&str, &str)> = t
            .iter()
            .map(|s| (s.name.as_str(), ncclscope_tests::attr(s, "nccl.rank")))
            .collect();
        assert_eq!(
            roots.len(),
            1,
            "trace {id}: {names:?}; (rank spans, roots) in all: {:?}",
            count(&spans)
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
