//! `ncclscope cluster` against a real Prometheus (Debian's, from scripts/install-prometheus.sh) with
//! the shipped scrape configuration and recording rules, scraping two daemons as two nodes
//! (/metrics on 127.0.0.1 and 127.0.0.2, `host.name` node-0 and node-1), each running 2 ranks of
//! two simultaneous 4-rank jobs (`sim-rank`: the real plugin through the fake NCCL host, a GPU
//! identity from the fake libcuda). After a healthy start, job `late-rank` gets rank 3 late and job
//! `late-node` every rank of node 1 late, 3 ms: `cluster` names each within one minute of the delay
//! starting (rank, node, GPU UUID, the lateness), names nothing before it, and never a healthy node.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{SIM_LEAD, SimJob};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

fn prometheus_binary() -> PathBuf {
    let p = repo().join(".prometheus/usr/bin/prometheus");
    assert!(
        p.exists(),
        "{} is missing: run scripts/install-prometheus.sh (scripts/test.sh does)",
        p.display()
    );
    p
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn answers(url: &str) -> bool {
    Command::new("curl")
        .args(["-sf", "--max-time", "5", "-o", "/dev/null", url])
        .status()
        .is_ok_and(|s| s.success())
}

fn wait_for(url: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !answers(url) {
        assert!(Instant::now() < deadline, "{what} never answered {url}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Node `index`'s daemon under `root`: /metrics on 127.0.0.<index + 1>, `host.name` node-<index>.
/// Returns it and its scrape target.
fn node(root: &Path, index: u32) -> (Proc, String) {
    let dir = root.join(format!("node{index}"));
    std::fs::create_dir(&dir).unwrap();
    let ip = format!("127.0.0.{}", index + 1);
    let target = format!("{ip}:{}", ncclscope_tests::free_port(&ip));
    std::fs::write(
        dir.join("ncclscope.toml"),
        format!(
            "[prometheus]\nlisten = \"{target}\"\njob_series = true\n[otlp]\n\
             resource_attributes = \"host.name=node-{index},service.instance.id=node-{index}\"\n"
        ),
    )
    .unwrap();
    let daemon = Proc(
        ncclscope_tests::daemon_args(&mut Command::new(ncclscope_tests::daemon_binary()), &dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("daemon.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_for(&format!("http://{target}/healthz"), "the daemon");
    (daemon, target)
}

/// Prometheus with the shipped scrape configuration and rules, scraping `targets`.
fn prometheus(dir: &Path, targets: &[String]) -> (Proc, String) {
    let shipped = repo().join("deploy/prometheus");
    let mut yml = std::fs::read_to_string(shipped.join("prometheus-scrape.yml")).unwrap();
    let list = targets
        .iter()
        .map(|t| format!("\"{t}\""))
        .collect::<Vec<_>>()
        .join(", ");
    assert!(yml.contains("[\"gpu-node-1:9464\"]"), "{yml}");
    yml = yml.replace("[\"gpu-node-1:9464\"]", &format!("[{list}]"));
    let conf = dir.join("prometheus");
    std::fs::create_dir(&conf).unwrap();
    std::fs::write(conf.join("prometheus.yml"), yml).unwrap();
    std::fs::copy(
        shipped.join("ncclscope-rules.yaml"),
        conf.join("ncclscope-rules.yaml"),
    )
    .unwrap();
    let port = ncclscope_tests::free_port("127.0.0.1");
    let proc = Proc(
        Command::new(prometheus_binary())
            .arg(format!(
                "--config.file={}",
                conf.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let url = format!("http://127.0.0.1:{port}");
    wait_for(&format!("{url}/-/ready"), "Prometheus");
    (proc, url)
}

/// `ncclscope cluster --once` for `job`: its stdout (it must succeed).
fn cluster_once(prom: &str, job: &str) -> String {
    let out = Command::new(ncclscope_tests::daemon_binary())
        .args(["cluster", "--prometheus", prom, "--job", job, "--once"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The suspect lines of a refresh: `node ...` and `rank ...`.
fn suspects(out: &str) -> Vec<&str> {
    out.lines()
        .map(str::trim_start)
        .filter_map(|l| l.split_once(' ').map(|(_, rest)| rest.trim_start()))
        .filter(|l| l.starts_with("node ") || l.starts_with("rank "))
        .collect()
}

/// Seconds of healthy running before the faults start: the rules need two scrapes of every rank's
/// counters inside their 1m window (45 s was too short once, in a full test run on a 2-core VM).
const HEALTHY_S: u64 = 60;

#[test]
fn cluster_names_a_late_rank_and_a_late_node_within_a_minute_and_no_healthy_node() {
    let dir = tempfile::tempdir().unwrap();
    let (_d0, t0) = node(dir.path(), 0);
    let (_d1, t1) = node(dir.path(), 1);
    let (_prom, prom) = prometheus(dir.path(), &[t0.clone(), t1.clone()]);

    // Each rank's process finds the fake libcuda as libcuda.so, device = rank: a GPU UUID per rank.
    let cuda = dir.path().join("cuda");
    std::fs::create_dir(&cuda).unwrap();
    std::fs::copy(
        ncclscope_fakenccl::target_dir().join("libfakenccl_cuda.so"),
        cuda.join("libcuda.so"),
    )
    .unwrap();
    let sockets = [
        dir.path().join("node0/reg.sock"),
        dir.path().join("node1/reg.sock"),
    ];
    let sockets: Vec<&Path> = sockets.iter().map(PathBuf::as_path).collect();
    let seconds = HEALTHY_S + 75;
    let late_rank = SimJob {
        straggler: Some(3),
        late_from_s: HEALTHY_S,
        ..SimJob::new("late-rank", 4, seconds)
    };
    let late_node = SimJob {
        late_node: Some(1),
        late_from_s: HEALTHY_S,
        ..SimJob::new("late-node", 4, seconds)
    };
    let mut ranks: Vec<Proc> = Vec::new();
    for job in [&late_rank, &late_node] {
        for (rank, mut c) in job.commands(&sockets).into_iter().enumerate() {
            c.env("LD_LIBRARY_PATH", &cuda)
                .env("FAKENCCL_CUDA_DEVICE", rank.to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            ranks.push(Proc(c.spawn().unwrap()));
        }
    }
    // The ranks' first step is SIM_LEAD after their commands were made.
    let delay_starts = Instant::now() + SIM_LEAD + Duration::from_secs(HEALTHY_S);

    // Healthy: once the rules have data for both jobs, nobody is named.
    let mut judged = 0;
    while Instant::now() + Duration::from_secs(3) < delay_starts {
        for job in ["late-rank", "late-node"] {
            let out = cluster_once(&prom, job);
            if out.contains(" of 2 nodes and 0 of 4 ranks late") {
                judged += 1;
            }
            assert!(suspects(&out).is_empty(), "before any delay: {out}");
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    assert!(
        judged > 0,
        "the rules never had data before the delay started"
    );

    // Late: each named within a minute, with its evidence; node 0 never, node 1 only in job late-node.
    let mut named: [Option<Duration>; 2] = [None, None];
    let mut last = [String::new(), String::new()];
    while named.iter().any(Option::is_none) {
        let since = Instant::now().saturating_duration_since(delay_starts);
        assert!(
            since < Duration::from_secs(60),
            "not named within a minute of the delay:\nlate-rank: {}\nlate-node: {}",
            last[0],
            last[1]
        );
        for (i, job) in ["late-rank", "late-node"].into_iter().enumerate() {
            let out = cluster_once(&prom, job);
            let s = suspects(&out);
            assert!(
                s.iter().all(|l| !l.contains("node-0")),
                "a healthy node named: {out}"
            );
            let want: &[&str] = if i == 0 {
                assert!(s.iter().all(|l| l.starts_with("rank 3 on node-1")), "{out}");
                &["rank 3 on node-1"]
            } else {
                assert!(
                    s.iter().all(|l| l.starts_with("node node-1")
                        || l.starts_with("rank 2 on node-1")
                        || l.starts_with("rank 3 on node-1")),
                    "{out}"
                );
                &["node node-1", "rank 2 on node-1", "rank 3 on node-1"]
            };
            if named[i].is_none() && want.iter().all(|w| s.iter().any(|l| l.starts_with(w))) {
                named[i] = Some(since);
                // The evidence: the GPU's UUID, and how late (about the 3 ms injected).
                let rank3 = s.iter().find(|l| l.starts_with("rank 3")).unwrap();
                assert!(rank3.contains(", GPU 3 GPU-"), "{rank3}");
                let us: f64 = rank3
                    .split("starts ")
                    .nth(1)
                    .and_then(|r| r.split(' ').next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("{rank3}"));
                assert!(us > 1000.0 && us < 3600.0, "{rank3}");
            }
            last[i] = out;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    eprintln!(
        "named after the delay started: late rank {:?}, late node {:?}",
        named[0].unwrap(),
        named[1].unwrap()
    );

    // Live: a refresh loop printing plain lines off a terminal.
    let mut live = Command::new(ncclscope_tests::daemon_binary())
        .args(["cluster", "--prometheus", &prom, "--job", "late-node"])
        .args(["--interval", "1"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    let _ = live.kill();
    let out = live.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let refreshes = text
        .lines()
        .filter(|l| l.contains(" job late-node: "))
        .count();
    assert!(refreshes >= 2, "{text}");
    assert!(
        !text.contains('\x1b'),
        "no terminal codes off a terminal: {text:?}"
    );

    // A job Prometheus has no series of is said so.
    let out = cluster_once(&prom, "no-such-job");
    assert!(
        out.contains("Prometheus has no series of job no-such-job"),
        "{out}"
    );
}

/// An unreachable Prometheus is an error as the other commands print them: a line, its causes, no
/// backtrace, exit status 1.
#[test]
fn an_unreachable_prometheus_is_a_one_line_error() {
    let port = ncclscope_tests::free_port("127.0.0.1");
    let out = Command::new(ncclscope_tests::daemon_binary())
        .args(["cluster", "--job", "j", "--once"])
        .args(["--prometheus", &format!("http://127.0.0.1:{port}")])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with(&format!(
            "error: querying http://127.0.0.1:{port}/api/v1/query for ncclscope:rank_lateness_microseconds:1m{{job_id=\"j\"}}\n  caused by: "
        )),
        "{err}"
    );
    assert!(
        !err.contains("stack backtrace") && !err.contains("Stack backtrace"),
        "{err}"
    );
}
