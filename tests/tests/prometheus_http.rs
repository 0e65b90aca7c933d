//! The daemon's Prometheus endpoint through a real HTTP client (curl) while a real run goes on
//! (simulated ranks through the real plugin): every percentile it reports (`stats --json`, classic
//! buckets through `histogram_quantile`, native histograms over the protobuf exposition) against
//! the exact values of the run's spooled instances; and the HTTP itself (HEAD, keep-alive, gzip,
//! the health endpoint, build info).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ncclscope::storage::spool::SpoolReader;
use ncclscope_proto::prometheus::MetricFamily;
use ncclscope_tests::promql::{histogram_quantile, native_quantile, text_buckets};
use prost::Message;
use serde_json::Value;

const JOB: &str = "prom-http";
/// The daemon's `host.name`.
const HOST: &str = "gpu-node-7";

struct Daemon {
    child: Child,
    dir: tempfile::TempDir,
    url: String,
}

impl Daemon {
    /// The classic buckets at their finest (the percentile test holds them to 10%), and the
    /// node's name as an operator sets it.
    fn start() -> Daemon {
        Daemon::start_with(&format!(
            "classic_buckets_per_doubling = 8\n[otlp]\nresource_attributes = \"host.name={HOST}\"\n"
        ))
    }

    /// A daemon serving per-job series, with more configuration `extra` (after `[prometheus]`).
    fn start_with(extra: &str) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config =
            format!("[prometheus]\nlisten = \"127.0.0.1:{port}\"\njob_series = true\n{extra}");
        std::fs::write(dir.path().join("ncclscope.toml"), config).unwrap();
        let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
        let child = ncclscope_tests::daemon_args(
            &mut Command::new(ncclscope_tests::daemon_binary()),
            dir.path(),
        )
        .args(["--otlp-endpoint", ""])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
        let d = Daemon {
            child,
            dir,
            url: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&d.url[7..]).is_err() {
            assert!(Instant::now() < deadline, "no /metrics: {}", d.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    fn tool(&self, args: &[&str]) -> Output {
        let out = Command::new(ncclscope_tests::daemon_binary())
            .args(args)
            .arg("--api-socket")
            .arg(self.dir.path().join("api.sock"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// curl with `args`, which must succeed; its stdout.
fn curl(args: &[&str]) -> Vec<u8> {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20"])
        .args(args)
        .output()
        .expect("curl");
    assert!(
        out.status.success(),
        "curl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Runs `nranks` simulated ranks of [`JOB`] for `seconds`, rank 1 late; the instances they made.
fn run_ranks(socket: &Path, nranks: u32, seconds: u64) -> u64 {
    common::run_sim_ranks(socket, JOB, nranks, seconds, 1)
        .into_iter()
        .sum()
}

/// A series' exec times (us) and bus bandwidths (GB/s).
type ExecAndBusbw = (Vec<f64>, Vec<f64>);

/// The nearest-rank quantile of sorted `values`: what `stats` reports.
fn exact(values: &[f64], q: f64) -> f64 {
    values[((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1]
}

/// Issue 17: `stats` read p50/p99 3-9% low and Grafana an all-reduce exec p99 83% high. Every
/// percentile the daemon reports for a real run against the run's exact values: `stats` within 1%,
/// native histograms within their bucket, classic buckets (`histogram_quantile`) within 10%.
#[test]
fn reported_percentiles_match_the_exact_values_of_the_run() {
    let d = Daemon::start();
    let produced = run_ranks(&d.dir.path().join("reg.sock"), 4, 8);
    let deadline = Instant::now() + Duration::from_secs(60);
    let stats = loop {
        let out = d.tool(&["stats", "--json", "--job", JOB]);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        if v["jobs"][0]["collectives"].as_u64() == Some(produced) {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "not all instances: {v}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    // The metrics of the snapshot after the last instance (one a second).
    std::thread::sleep(Duration::from_millis(1500));
    let text = String::from_utf8(curl(&[&format!("{}/metrics", d.url)])).unwrap();
    let accept = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;\
                  encoding=delimited;q=0.7,text/plain;version=0.0.4;q=0.3";
    let pb = curl(&[
        "-H",
        &format!("Accept: {accept}"),
        &format!("{}/metrics", d.url),
    ]);
    let mut pb: &[u8] = &pb;
    let mut families = Vec::new();
    while !pb.is_empty() {
        families.push(MetricFamily::decode_length_delimited(&mut pb).unwrap());
    }
    // Exact values per (collective, size bucket), from the spool.
    let mut runs: BTreeMap<(String, &str), ExecAndBusbw> = BTreeMap::new();
    let uid = rustix::process::getuid().as_raw();
    for c in SpoolReader::open_dir(d.dir.path().join("spool"))
        .unwrap()
        .read_job(&(uid, JOB.to_string()))
    {
        let c = c.unwrap();
        let e = runs
            .entry((c.func.clone(), ncclscope::bandwidth::size_bucket(c.bytes)))
            .or_default();
        e.0.push(c.exec_ns as f64 / 1000.0);
        if c.exec_ns > 0 {
            e.1.push(c.busbw_gbs);
        }
    }
    assert!(runs.len() >= 4, "{runs:?}");
    let mut worst = [0f64; 3];
    let mut checked = 0;
    for ((func, bucket), (exec, busbw)) in &mut runs {
        let s = stats["colls"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["func"] == func.as_str() && c["size_bucket"] == *bucket)
            .unwrap_or_else(|| panic!("no stats for {func} {bucket}: {stats}"));
        let f = |k: &str| s[k].as_f64().unwrap();
        for (family, values, from_stats) in [
            (
                "ncclscope_collective_exec_time_microseconds",
                exec,
                vec![(0.5, f("exec_p50_us")), (0.99, f("exec_p99_us"))],
            ),
            (
                "ncclscope_collective_bus_bandwidth_gbs",
                busbw,
                vec![(0.5, f("busbw_p50_gbs"))],
            ),
        ] {
            values.sort_by(f64::total_cmp);
            let labels = [
                format!("collective=\"{func}\""),
                format!("size_bucket=\"{bucket}\""),
            ];
            let classic = text_buckets(&text, family, &[&labels[0], &labels[1]]);
            let native = families
                .iter()
                .find(|f| f.name() == family)
                .and_then(|f| {
                    f.metric.iter().find(|m| {
                        let has = |k: &str, v: &str| {
                            m.label.iter().any(|l| l.name() == k && l.value() == v)
                        };
                        has("collective", func) && has("size_bucket", bucket)
                    })
                })
                .and_then(|m| m.histogram.clone())
                .unwrap_or_else(|| panic!("no native {family} for {func} {bucket}"));
            assert_eq!(native.sample_count(), values.len() as u64);
            assert_eq!(native.positive_span.len(), 1);
            let mut count = 0i64;
            let counts: Vec<u64> = (native.positive_delta.iter())
                .map(|d| {
                    count += d;
                    count as u64
                })
                .collect();
            let native_width = (-(native.schema() as f64)).exp2().exp2() - 1.0;
            for (q, got_stats) in from_stats {
                let want = exact(values, q);
                let first = native.positive_span[0].offset();
                let got = [
                    got_stats,
                    native_quantile(q, native.schema(), first, &counts),
                    histogram_quantile(q, &classic),
                ];
                let mut errs = got.map(|g| (g - want).abs() / want);
                // Below the first classic bound (the 8-byte all-reduce's busBW, 5 KB/s) the
                // classic buckets know only that it is below: not compared.
                if want <= classic[0].0 {
                    errs[2] = 0.0;
                }
                for k in 0..3 {
                    worst[k] = worst[k].max(errs[k]);
                }
                assert!(
                    errs[0] < 0.01 && errs[1] < native_width && errs[2] < 0.10,
                    "{family} {func} {bucket} q {q}: exact {want}, (stats, native, classic) {got:?}"
                );
                checked += 1;
            }
        }
    }
    eprintln!("{checked} percentiles; worst relative errors (stats, native, classic): {worst:?}");
}

/// /metrics on a real HTTP server: HEAD, keep-alive, gzip when asked, 404 elsewhere, the health
/// endpoint and the build info (with the configured host name).
#[test]
fn metrics_endpoint_speaks_http() {
    let d = Daemon::start();
    let metrics = format!("{}/metrics", d.url);
    let build_info = format!(
        "ncclscope_build_info{{version=\"{}\",host_name=\"{HOST}\"}} 1\n",
        env!("CARGO_PKG_VERSION")
    );
    // The first snapshot comes a second after the start.
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = String::from_utf8(curl(&[&metrics])).unwrap();
        if text.contains(&build_info) {
            break text;
        }
        assert!(Instant::now() < deadline, "{text}");
        std::thread::sleep(Duration::from_millis(200));
    };
    // HEAD: the headers of a GET, no body.
    let head = String::from_utf8(curl(&["-I", &metrics])).unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length: ")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("{head}"));
    assert!(length > 100, "{head}");
    // Keep-alive: two requests, one connection.
    let connects = String::from_utf8(curl(&[
        "-o",
        "/dev/null",
        "-o",
        "/dev/null",
        "-w",
        "%{num_connects} ",
        &metrics,
        &format!("{}/healthz", d.url),
    ]))
    .unwrap();
    assert_eq!(connects, "1 0 ", "the second request reuses the connection");
    // gzip only when the client accepts it; curl --compressed decodes it.
    let raw = curl(&["-H", "Accept-Encoding: gzip", "-D", "-", &metrics]);
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let headers = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    assert!(headers.contains("content-encoding: gzip"), "{headers}");
    assert_eq!(&raw[split..split + 2], [0x1f, 0x8b], "a gzip stream");
    assert!(raw.len() - split < text.len() / 2, "compressed");
    let plain = curl(&["-D", "-", &metrics]);
    assert!(
        !String::from_utf8_lossy(&plain)
            .to_ascii_lowercase()
            .contains("content-encoding")
    );
    let decoded = String::from_utf8(curl(&["--compressed", &metrics])).unwrap();
    assert!(decoded.starts_with("# HELP ") && decoded.contains("ncclscope_build_info"));
    // Health, and nothing else.
    let status = |path: &str| {
        let url = format!("{}{path}", d.url);
        String::from_utf8(curl(&["-o", "/dev/null", "-w", "%{http_code}", &url])).unwrap()
    };
    assert_eq!(status("/healthz"), "200");
    assert_eq!(status("/nothing"), "404");
    assert_eq!(
        String::from_utf8(curl(&[&format!("{}/healthz", d.url)])).unwrap(),
        "ok\n"
    );
}

/// What one scrape of `/metrics` costs: samples (lines that are not comments) and bytes.
fn scrape_cost(body: &str) -> (usize, usize) {
    let samples = body
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count();
    (samples, body.len())
}

/// The cardinality budget (issue 35) on one node's load: 8 ranks (processes of the real plugin
/// through the fake NCCL, each with its GPU from the fake libcuda) of a 64-rank, 8-node job, each
/// in the same 16 communicators, each running 3 collective types (one size each): 48 series and
/// 128 rank series. At the default configuration (per-job series on) one text scrape is at most
/// 10,000 samples and 1 MB, OpenMetrics (Prometheus' default, with exemplars) too. The same load
/// with every classic bucket the daemon keeps (the configuration before the budget) is printed
/// beside it, and must be over the budget: the cut is what keeps the default within it.
#[test]
fn a_node_of_8_ranks_16_communicators_and_3_collectives_fits_the_scrape_budget() {
    const SAMPLES: usize = 10_000;
    const BYTES: usize = 1_000_000;
    let default = node_load_scrapes("");
    let full = node_load_scrapes("classic_buckets_per_doubling = 8\nrank_classic_buckets = true\n");
    for (what, (text, om, pb)) in [("default", &default), ("every classic bucket", &full)] {
        let (t, o) = (scrape_cost(text), scrape_cost(om));
        // Scraped as native histograms, a histogram is one sample: one per metric.
        let mut rest: &[u8] = pb;
        let mut native = 0;
        while !rest.is_empty() {
            native += MetricFamily::decode_length_delimited(&mut rest)
                .unwrap()
                .metric
                .len();
        }
        eprintln!(
            "{what}: text {} samples {} bytes; OpenMetrics {} samples {} bytes; protobuf {} bytes, \
             {native} samples as native histograms",
            t.0,
            t.1,
            o.0,
            o.1,
            pb.len()
        );
    }
    let (text, om, _) = &default;
    for (format, body) in [("text", text), ("OpenMetrics", om)] {
        let (samples, bytes) = scrape_cost(body);
        assert!(
            samples <= SAMPLES && bytes <= BYTES,
            "{format}: {samples} samples, {bytes} bytes"
        );
    }
    let (samples, bytes) = scrape_cost(&full.0);
    assert!(samples > SAMPLES || bytes > BYTES, "{samples} {bytes}");
}

/// Runs the node's load of the budget test against a daemon with `extra` configuration; its
/// text, OpenMetrics and protobuf scrapes once every instance is counted.
fn node_load_scrapes(extra: &str) -> (String, String, Vec<u8>) {
    const RANKS: u32 = 8;
    const COMMS: u32 = 16;
    const COLLECTIVES: u32 = 3;
    let d = Daemon::start_with(extra);
    let cuda = d.dir.path().join("cuda");
    std::fs::create_dir(&cuda).unwrap();
    let fake = ncclscope_fakenccl::target_dir().join("libfakenccl_cuda.so");
    assert!(
        fake.exists(),
        "{} is missing: cargo build -p ncclscope-fakenccl-libcuda",
        fake.display()
    );
    std::fs::copy(&fake, cuda.join("libcuda.so")).unwrap();
    let rank_binary = ncclscope_fakenccl::process::rank_binary().unwrap();
    let ranks: Vec<Child> = (0..RANKS)
        .map(|rank| {
            Command::new(&rank_binary)
                .args([
                    "--rank",
                    &rank.to_string(),
                    "--nranks",
                    "64",
                    "--nnodes",
                    "8",
                ])
                .args(["--comms", &COMMS.to_string()])
                .args(["--colls", &COLLECTIVES.to_string()])
                .env("NCCLSCOPE_SOCKET", d.dir.path().join("reg.sock"))
                .env("NCCLSCOPE_RING_MEMORY", "cpu")
                .env("NCCLSCOPE_JOB_ID", "4242424")
                .env("LD_LIBRARY_PATH", &cuda)
                .env("FAKENCCL_CUDA_DEVICE", rank.to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut r in ranks {
        assert!(r.wait().unwrap().success());
    }
    let metrics = format!("{}/metrics", d.url);
    let want = format!(
        "ncclscope_collectives_total {}\n",
        RANKS * COMMS * COLLECTIVES
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = String::from_utf8(curl(&[&metrics])).unwrap();
        if text.contains(&want) {
            break;
        }
        assert!(Instant::now() < deadline, "{want}?\n{text}\n{}", d.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    // The snapshot after the last instance (one a second).
    std::thread::sleep(Duration::from_millis(1500));
    let text = String::from_utf8(curl(&[&metrics])).unwrap();
    let count = |prefix: &str| text.lines().filter(|l| l.starts_with(prefix)).count();
    assert_eq!(
        count("ncclscope_collective_exec_time_microseconds_count{"),
        (COMMS * COLLECTIVES) as usize,
        "{text}"
    );
    let per_rank = "ncclscope_rank_collectives_total{";
    assert_eq!(count(per_rank), (RANKS * COMMS) as usize, "{text}");
    assert!(
        (text.lines())
            .filter(|l| l.starts_with(per_rank))
            .all(|l| l.contains("UUID=\"GPU-")),
        "{text}"
    );
    let om = curl(&["-H", "Accept: application/openmetrics-text", &metrics]);
    let pb = curl(&[
        "-H",
        "Accept: application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited",
        &metrics,
    ]);
    (text, String::from_utf8(om).unwrap(), pb)
}
