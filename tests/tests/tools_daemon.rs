//! The operator tools against a real `ncclscope daemon` process fed by real simulated ranks
//! (`ncclscope sim-rank`: the fake NCCL host driving the real plugin .so): `stats --json` matches what
//! the ranks produced and names the injected straggler, `export` writes exactly the spooled collectives
//! as a Perfetto trace (through the API and straight from the spool), the spool survives a SIGKILL of the
//! daemon, `top` names the straggler, and errors are clear.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ncclscope::storage::spool::SpoolReader;
use serde_json::Value;

/// target/<profile>/ncclscope, built by `cargo build --workspace` (scripts/test.sh) before the tests.
fn ncclscope_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let bin = dir.join("ncclscope");
    assert!(
        bin.is_file(),
        "{} is missing: run `cargo build --workspace` first",
        bin.display()
    );
    bin
}

/// A daemon process with its own sockets, spool and state; killed on drop.
struct Daemon {
    child: Option<Child>,
    dir: PathBuf,
    otlp_endpoint: String,
}

impl Daemon {
    fn api(&self) -> PathBuf {
        self.dir.join("api.sock")
    }
    fn socket(&self) -> PathBuf {
        self.dir.join("reg.sock")
    }
    fn spool(&self) -> PathBuf {
        self.dir.join("spool")
    }

    fn start(dir: &Path) -> Daemon {
        Daemon::start_with(dir, "", "")
    }

    /// With this configuration file (never the machine's /etc/ncclscope) and OTLP endpoint ("": none).
    fn start_with(dir: &Path, config: &str, otlp_endpoint: &str) -> Daemon {
        std::fs::write(dir.join("ncclscope.toml"), config).unwrap();
        let mut d = Daemon {
            child: None,
            dir: dir.to_path_buf(),
            otlp_endpoint: otlp_endpoint.to_string(),
        };
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("daemon.log"))
            .unwrap();
        let child = ncclscope_tests::daemon_args(&mut Command::new(ncclscope_bin()), &self.dir)
            .args([
                "--prometheus-listen",
                "",
                "--otlp-endpoint",
                &self.otlp_endpoint,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(self.api()).is_err() {
            assert!(
                Instant::now() < deadline,
                "daemon did not start: {}",
                self.log()
            );
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("daemon exited with {st}: {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn sigkill(&mut self) {
        let mut c = self.child.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    /// Runs `ncclscope ARGS --api-socket <ours>`.
    fn tool(&self, args: &[&str]) -> Output {
        Command::new(ncclscope_bin())
            .args(args)
            .arg("--api-socket")
            .arg(self.api())
            .output()
            .unwrap()
    }

    /// [`Daemon::tool`], which must succeed.
    fn tool_ok(&self, args: &[&str]) -> Output {
        let out = self.tool(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "ncclscope {args:?}: {err}");
        out
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `nranks` simulated ranks of `job` for `seconds` with `straggler` late; returns the instances
/// each produced.
fn run_ranks(d: &Daemon, job: &str, nranks: u32, seconds: u64, straggler: u32) -> Vec<u64> {
    run_ranks_at(&d.socket(), job, nranks, seconds, straggler)
}

/// [`run_ranks`] against the registration socket `socket` (while the daemon behind it restarts).
fn run_ranks_at(socket: &Path, job: &str, nranks: u32, seconds: u64, straggler: u32) -> Vec<u64> {
    common::run_sim_ranks(socket, job, nranks, seconds, straggler)
}

fn stats_json(d: &Daemon, job: &str) -> Value {
    let out = d.tool_ok(&["stats", "--json", "--job", job]);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Waits until the daemon has assembled `want` instances of `job` (the ranks have exited, so their
/// segments only need draining).
fn wait_for(d: &Daemon, job: &str, want: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = stats_json(d, job);
        let have = v["jobs"][0]["collectives"].as_u64().unwrap_or(0);
        if have >= want {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "daemon assembled {have} of {want} instances: {}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// (pid, collective, seq) of every collective slice in a Perfetto file.
fn perfetto_instances(path: &Path) -> BTreeSet<(u64, String, u64)> {
    let doc: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let slices: Vec<_> = events.iter().filter(|e| e["cat"] == "collective").collect();
    let set: BTreeSet<_> = slices
        .iter()
        .map(|e| {
            (
                e["args"]["pid"].as_u64().unwrap(),
                e["args"]["func"].as_str().unwrap().to_string(),
                e["args"]["seq"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        set.len(),
        slices.len(),
        "duplicate slices in {}",
        path.display()
    );
    set
}

/// A span as the OTLP/JSON file and the receiver both give it: (trace id, span id, parent span id,
/// name, start ns, end ns), ids in lowercase hex.
type SpanKey = (String, String, String, String, u64, u64);

/// Runs `export --format otlp-json` for `job` into `path` and returns its spans.
fn otlp_json_export(d: &Daemon, job: &str, path: &Path) -> Vec<SpanKey> {
    d.tool_ok(&[
        "export",
        "--job",
        job,
        "-o",
        path.to_str().unwrap(),
        "--format",
        "otlp-json",
    ]);
    let text = std::fs::read_to_string(path).unwrap();
    let mut spans = Vec::new();
    for line in text.lines() {
        let line: Value = serde_json::from_str(line).unwrap();
        for rs in line["resourceSpans"].as_array().unwrap() {
            for s in rs["scopeSpans"][0]["spans"].as_array().unwrap() {
                let str_of = |k: &str| s[k].as_str().unwrap_or("").to_string();
                let ns = |k: &str| str_of(k).parse::<u64>().unwrap();
                spans.push((
                    str_of("traceId"),
                    str_of("spanId"),
                    str_of("parentSpanId"),
                    str_of("name"),
                    ns("startTimeUnixNano"),
                    ns("endTimeUnixNano"),
                ));
            }
        }
    }
    spans
}

/// Issue 20: the file export held every instance with channel spans (277,200 spans where the live
/// export sent 18,000). With sampling and channel spans on, the file holds exactly the spans a real
/// OTLP receiver got from the daemon.
#[test]
fn otlp_json_export_holds_exactly_what_the_live_export_sent() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut collector = rt
        .block_on(fake_opentelemetry_collector::FakeCollectorServer::start())
        .unwrap();
    let endpoint = collector.endpoint();
    // The receiver hands spans over through a bounded queue: drain it all along.
    let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::<SpanKey>::new()));
    let sink = received.clone();
    rt.spawn(async move {
        loop {
            let spans = collector
                .exported_spans(1, Duration::from_millis(100))
                .await;
            sink.lock().unwrap().extend(spans.into_iter().map(|s| {
                (
                    s.trace_id,
                    s.span_id,
                    s.parent_span_id,
                    s.name,
                    s.start_time_unix_nano,
                    s.end_time_unix_nano,
                )
            }));
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let config = "[otlp]\nsample_ratio = 0.3\nchannel_spans = true\nbatch_timeout_ms = 50\n";
    let d = Daemon::start_with(dir.path(), config, &endpoint);
    let job = "otlp-json";
    let produced = run_ranks(&d, job, 3, 3, 1);
    let total: u64 = produced.iter().sum();
    wait_for(&d, job, total);

    let file = otlp_json_export(&d, job, &dir.path().join("spans.jsonl"));
    let rank_spans = file.iter().filter(|s| s.3.ends_with(" rank")).count() as u64;
    assert!(
        rank_spans > 0 && rank_spans < total,
        "{rank_spans} of {total} instances sampled"
    );
    assert!(file.iter().any(|s| s.3.ends_with(" channel")));
    let deadline = Instant::now() + Duration::from_secs(30);
    while received.lock().unwrap().len() < file.len() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    // Past the batch timeout: anything more the daemon sends would arrive now.
    std::thread::sleep(Duration::from_millis(500));
    let live = received.lock().unwrap().clone();
    let file_set: BTreeSet<_> = file.iter().cloned().collect();
    let live_set: BTreeSet<_> = live.iter().cloned().collect();
    assert_eq!(file_set.len(), file.len(), "duplicate spans in the file");
    assert_eq!(live_set.len(), live.len(), "duplicate spans sent live");
    assert_eq!(
        file_set.difference(&live_set).count() + live_set.difference(&file_set).count(),
        0,
        "{} spans in the file, {} sent live; {}",
        file.len(),
        live.len(),
        d.log()
    );
}

/// (pid, collective, seq) of every collective slice in a Perfetto protobuf trace: the slices that begin
/// on a communicator's collectives track, their process's pid from its name, their interned name and
/// `seq` attribute.
fn pftrace_instances(path: &Path) -> BTreeSet<(u64, String, u64)> {
    use ncclscope_proto::perfetto::{Trace, track_event::Type};
    use prost::Message;
    let trace = Trace::decode(std::fs::read(path).unwrap().as_slice()).unwrap();
    let (mut names, mut attrs) = (HashMap::new(), HashMap::new());
    let (mut pids, mut tracks) = (HashMap::new(), HashMap::new());
    let mut slices = Vec::new();
    for p in &trace.packet {
        let seq = p.trusted_packet_sequence_id.unwrap_or(0);
        for n in p.interned_data.iter().flat_map(|i| &i.event_names) {
            names.insert((seq, n.iid()), n.name().to_string());
        }
        for n in p
            .interned_data
            .iter()
            .flat_map(|i| &i.debug_annotation_names)
        {
            attrs.insert((seq, n.iid()), n.name().to_string());
        }
        if let Some(d) = &p.track_descriptor {
            match &d.process {
                Some(proc) => {
                    let name = proc.process_name();
                    let pid = name
                        .split(" pid ")
                        .nth(1)
                        .unwrap()
                        .split(',')
                        .next()
                        .unwrap();
                    pids.insert(d.uuid(), pid.parse::<u64>().unwrap());
                }
                None => {
                    tracks.insert(d.uuid(), (d.parent_uuid(), d.name().to_string()));
                }
            }
        }
        if let Some(e) = &p.track_event
            && e.r#type() == Type::SliceBegin
            && tracks[&e.track_uuid()].1.ends_with(" collectives")
        {
            let func = names[&(seq, e.name_iid())].clone();
            let coll_seq = (e.debug_annotations.iter())
                .find(|a| attrs[&(seq, a.name_iid())] == "seq")
                .map(|a| a.uint_value())
                .unwrap();
            slices.push((pids[&tracks[&e.track_uuid()].0], func, coll_seq));
        }
    }
    let set: BTreeSet<_> = slices.iter().cloned().collect();
    assert_eq!(
        set.len(),
        slices.len(),
        "duplicate slices in {}",
        path.display()
    );
    set
}

/// What Perfetto's own trace schema (its Python package, installed by scripts/test.sh into
/// .venv-perfetto) reads in a protobuf trace: tests/perfetto_check.py's JSON.
fn perfetto_check(path: &Path) -> Value {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = tests.join("../.venv-perfetto/bin/python");
    assert!(
        python.exists(),
        "{} is missing: scripts/test.sh installs Perfetto's Python package there",
        python.display()
    );
    ncclscope_tests::json_of(
        Command::new(python)
            .arg(tests.join("perfetto_check.py"))
            .arg(path),
    )
}

#[test]
fn tools_against_a_running_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    let job = "tools-e2e";
    let produced = run_ranks(&d, job, 3, 4, 1);
    let total: u64 = produced.iter().sum();
    assert!(
        produced.iter().all(|&n| n > 0 && n == produced[0]),
        "{produced:?}"
    );

    // stats --json: every instance counted, per rank and per collective, and the straggler named.
    let v = wait_for(&d, job, total);
    assert_eq!(v["jobs"][0]["collectives"].as_u64(), Some(total));
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 3);
    for r in ranks {
        assert_eq!(r["collectives"].as_u64(), Some(produced[0]), "{r}");
        assert_eq!(r["job_id"], job);
    }
    let by_coll: u64 = v["colls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["count"].as_u64().unwrap())
        .sum();
    assert_eq!(by_coll, total, "{}", v["colls"]);
    let funcs: BTreeSet<_> = v["colls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["func"].as_str().unwrap())
        .collect();
    assert_eq!(funcs, ["AllGather", "AllReduce", "ReduceScatter"].into());
    assert_eq!(v["stragglers"][0]["rank"], 1, "{}", v["stragglers"]);

    // stats as a table, and top's plain lines, name the straggler.
    let table = d.tool(&["stats", "--job", job]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("straggler: rank 1 of comm"), "{table}");
    let top = d.tool(&["top", "--plain", "--iterations", "1", "--job", job]);
    let top = String::from_utf8_lossy(&top.stdout);
    assert!(
        top.contains(&format!("job {job} comm")) && top.contains("3 ranks"),
        "{top}"
    );

    // export through the API: exactly the spooled instances.
    let spooled: Vec<_> = SpoolReader::open_dir(d.spool())
        .unwrap()
        .read_job(&(rustix::process::getuid().as_raw(), job.to_string()))
        .map(|c| c.unwrap())
        .collect();
    assert_eq!(spooled.len() as u64, total);
    let want: BTreeSet<_> = (spooled.iter())
        .map(|c| (u64::from(c.pid), c.func.clone(), c.seq))
        .collect();
    // The default: Perfetto's protobuf format.
    let pftrace = dir.path().join("trace.pftrace");
    d.tool_ok(&["export", "--job", job, "-o", pftrace.to_str().unwrap()]);
    assert_eq!(pftrace_instances(&pftrace), want);
    // Perfetto's own schema reads the same: every instance at its exact start, Unix time as the
    // timeline, and one flow id per instance on each of its 3 ranks.
    let official = perfetto_check(&pftrace);
    assert_eq!(official["primary_trace_clock"], serde_json::json!([1]));
    let slices = official["slices"].as_array().unwrap();
    let read: BTreeSet<_> = (slices.iter())
        .map(|s| {
            let n = |k: &str| s[k].as_u64().unwrap();
            (
                n("pid"),
                s["func"].as_str().unwrap().to_string(),
                n("seq"),
                n("start_unix_ns"),
            )
        })
        .collect();
    let exact: BTreeSet<_> = (spooled.iter())
        .map(|c| (u64::from(c.pid), c.func.clone(), c.seq, c.start_unix_ns))
        .collect();
    assert_eq!(read, exact);
    let mut per_flow: HashMap<String, usize> = HashMap::new();
    for s in slices {
        *per_flow.entry(s["flow_ids"][0].to_string()).or_default() += 1;
    }
    assert!(per_flow.values().all(|&n| n == 3), "{per_flow:?}");
    assert_eq!(per_flow.len() as u64, produced[0]);
    let trace = dir.path().join("trace.json");
    d.tool_ok(&[
        "export",
        "--job",
        job,
        "-o",
        trace.to_str().unwrap(),
        "--format",
        "perfetto-json",
    ]);
    assert_eq!(perfetto_instances(&trace), want);
    let sizes = (
        std::fs::metadata(&trace).unwrap().len(),
        std::fs::metadata(&pftrace).unwrap().len(),
    );
    assert!(sizes.0 >= 5 * sizes.1, "JSON and protobuf bytes: {sizes:?}");
    // Flow arrows chain each instance's ranks: 0 -> 1 -> 2, one id per link.
    let doc: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let flows: Vec<&Value> = (doc["traceEvents"].as_array().unwrap().iter())
        .filter(|e| e["cat"] == "flow")
        .collect();
    let ids = |ph: &str| -> BTreeSet<String> {
        (flows.iter().filter(|e| e["ph"] == ph))
            .map(|e| e["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(ids("s").len() as u64, 2 * produced[0]);
    assert_eq!(ids("s"), ids("f"));

    // Filters: one rank; a communicator by a prefix of its hash; a window that ended before the job.
    let filtered = |extra: &[&str]| {
        let path = dir.path().join("filtered.json");
        let mut args = vec!["export", "--job", job, "-o", path.to_str().unwrap()];
        args.extend(["--format", "perfetto-json"]);
        args.extend(extra);
        let out = d.tool(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        perfetto_instances(&path)
    };
    let rank1: BTreeSet<_> = (spooled.iter().filter(|c| c.rank == 1))
        .map(|c| (u64::from(c.pid), c.func.clone(), c.seq))
        .collect();
    assert_eq!(filtered(&["--rank", "1"]), rank1);
    let prefix = format!("{:016x}", spooled[0].comm_hash)[..6].to_string();
    assert_eq!(filtered(&["--comm", &prefix]), want);
    assert!(filtered(&["--until", "2000-01-01T00:00:00Z"]).is_empty());

    // SIGKILL the daemon: everything it acknowledged is still exportable, from the spool directly and
    // through a restarted daemon.
    d.sigkill();
    let offline = dir.path().join("offline.pftrace");
    let out = Command::new(ncclscope_bin())
        .args([
            "export",
            "--job",
            job,
            "-o",
            offline.to_str().unwrap(),
            "--spool",
            d.spool().to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(pftrace_instances(&offline), want);
    d.spawn();
    let again = dir.path().join("again.pftrace");
    d.tool_ok(&["export", "--job", job, "-o", again.to_str().unwrap()]);
    assert_eq!(pftrace_instances(&again), want);

    // OTLP/JSON: what the live export would send with the default configuration (no endpoint here):
    // every instance's rank span (sample_ratio 1), no channel spans (channel_spans false).
    let spans = otlp_json_export(&d, job, &dir.path().join("trace.otlp.jsonl"));
    let rank_spans = spans.iter().filter(|s| s.3.ends_with(" rank")).count();
    assert_eq!(rank_spans as u64, total);
    assert!(!spans.iter().any(|s| s.3.ends_with(" channel")));

    // Clear errors: an unknown job, and no daemon at all.
    let out = d.tool(&[
        "export",
        "--job",
        "nope",
        "-o",
        dir.path().join("x.json").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no spooled job \"nope\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(ncclscope_bin())
        .args([
            "stats",
            "--api-socket",
            dir.path().join("absent.sock").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is `ncclscope daemon` running"));
}

/// Issue 20: with RUST_BACKTRACE=1 (common on cluster images) every error printed a 30-40 frame
/// backtrace, and a misspelt NCCLSCOPE_* variable was ignored. Errors are one line and their causes
/// (the backtrace only with --debug); the daemon refuses an unknown variable, naming the likely one.
#[test]
fn errors_are_one_line_and_a_misspelt_variable_stops_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut daemon = ncclscope_tests::daemon_args(&mut Command::new(ncclscope_bin()), d)
        .args(["--prometheus-listen", ""])
        .env("NCCLSCOPE_OTLP_ENDPOIT", "http://127.0.0.1:4317")
        .env("RUST_BACKTRACE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while daemon.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = daemon.kill();
            panic!("the daemon started despite NCCLSCOPE_OTLP_ENDPOIT");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = daemon.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: ")
            && stderr.contains("NCCLSCOPE_OTLP_ENDPOIT (did you mean NCCLSCOPE_OTLP_ENDPOINT?)"),
        "{stderr}"
    );

    // A tool's error: the message and its causes, no backtrace unless --debug.
    let stats = |debug: bool| {
        let mut cmd = Command::new(ncclscope_bin());
        cmd.args(["stats", "--api-socket"])
            .arg(d.join("absent.sock"))
            .env("RUST_BACKTRACE", "1");
        if debug {
            cmd.arg("--debug");
        }
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(1));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let plain = stats(false);
    let mut lines = plain.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("error: cannot reach the ncclscope daemon's query API"),
        "{plain}"
    );
    assert!(lines.all(|l| l.starts_with("  caused by: ")), "{plain}");
    assert!(plain.lines().count() <= 4, "{plain}");
    assert!(stats(true).lines().count() > plain.lines().count());
}

/// Issue 20: `daemon --help` showed no defaults or variables. Every command's help shows them; the
/// daemon's lists every configuration key's variable with its default.
#[test]
fn every_commands_help_shows_defaults_and_variables() {
    let help = |args: &[&str]| {
        let out = Command::new(ncclscope_bin()).args(args).output().unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let daemon = help(&["daemon", "--help"]);
    for (var, default) in ncclscope::config::default_variables() {
        assert!(
            daemon
                .lines()
                .any(|l| l.trim_start().starts_with(&var) && l.trim_end().ends_with(&default)),
            "{var} = {default} missing from:\n{daemon}"
        );
    }
    assert!(
        daemon.contains("[env: NCCLSCOPE_SOCKET] [default: /run/ncclscope/ncclscope.sock]")
            && daemon.contains("NCCLSCOPE_LOG"),
        "{daemon}"
    );
    for tool in ["top", "stats", "export"] {
        let h = help(&[tool, "--help"]);
        assert!(
            h.contains("[env: NCCLSCOPE_API_SOCKET")
                && h.contains("[default: /run/ncclscope/api.sock]"),
            "{h}"
        );
    }
    let cluster = help(&["cluster", "--help"]);
    assert!(
        cluster.contains("[env: NCCLSCOPE_PROMETHEUS") && cluster.contains("[default: 1000]"),
        "{cluster}"
    );
    let demo = help(&["demo", "--help"]);
    assert!(
        demo.contains("NCCLSCOPE_PLUGIN") && demo.contains("[default: 20]"),
        "{demo}"
    );
}

/// A tmux server of its own (`-L`), with `top` in an 80x24 window; killed on drop.
struct Tmux {
    server: String,
}

impl Tmux {
    fn start(command: &str) -> Tmux {
        let t = Tmux {
            server: format!("ncclscope-test-{}", std::process::id()),
        };
        let out = t.run(&["-f", "/dev/null", "new-session", "-d", "-s", "top"]);
        assert!(
            out.status.success(),
            "tmux: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        t.run(&["resize-window", "-t", "top", "-x", "80", "-y", "24"]);
        t.run(&["send-keys", "-t", "top", command, "Enter"]);
        t
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .args(["-L", &self.server])
            .args(args)
            .output()
            .expect("tmux is missing (scripts/test.sh installs it)")
    }

    fn screen(&self) -> Vec<String> {
        let out = self.run(&["capture-pane", "-p", "-t", "top"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "top"];
        args.extend(keys);
        self.run(&args);
    }

    /// Waits up to 20 s for a screen that `ok` accepts; returns it.
    fn wait(&self, what: &str, ok: impl Fn(&[String]) -> bool) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let screen = self.screen();
            if ok(&screen) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "waited 20 s for {what}; the screen:\n{}",
                screen.join("\n")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        self.run(&["kill-server"]);
    }
}

/// Whether a screen line holds `text`.
fn shows(screen: &[String], text: &str) -> bool {
    screen.iter().any(|l| l.contains(text))
}

/// Issue 20: `top` exited with status 1 when the daemon restarted, had no keys but quit, cut values
/// mid-cell at 80x24, and waited forever (status 0) for a job that does not exist. In a real
/// terminal (tmux, 80x24) against a real daemon and ranks: open the job, its communicator and a
/// rank's channels, sort, see every rank's values whole, outlive a daemon restart, quit with 0.
#[test]
fn top_in_an_80x24_terminal_drills_down_sorts_and_outlives_a_daemon_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    let job = "top-tmux";
    let out = d.tool(&["top", "--plain", "--job", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the daemon has no job \"nope\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    std::thread::scope(|scope| {
        let socket = d.socket();
        let ranks = scope.spawn(move || run_ranks_at(&socket, job, 3, 20, 1));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !String::from_utf8_lossy(&d.tool(&["stats"]).stdout).contains(job) {
            assert!(Instant::now() < deadline, "the ranks did not register");
            std::thread::sleep(Duration::from_millis(100));
        }
        let status = dir.path().join("top.status");
        let tmux = Tmux::start(&format!(
            "{} top --interval 0.2 --api-socket {}; echo $? > {}",
            ncclscope_bin().display(),
            d.api().display(),
            status.display()
        ));
        let jobs = tmux.wait("the job", |s| shows(s, job));
        assert_eq!(jobs.len(), 24);
        assert!(jobs.iter().all(|l| l.chars().count() <= 80));

        // Each step waits for the screen the key before it leads to: the breadcrumb on line 2 says
        // where the view is (the help's text names the levels too), and a row must be there to open.
        let help = "sort: name, exec time, skew, losses";
        tmux.keys(&["?"]);
        tmux.wait("the keys", |s| shows(s, help));
        tmux.keys(&["x"]);
        tmux.wait("the keys closed", |s| !shows(s, help));
        tmux.keys(&["Enter"]);
        tmux.wait("the job's communicator", |s| {
            s[1].starts_with(&format!("job {job}  ")) && shows(s, "│▶ ")
        });
        tmux.keys(&["Enter"]);
        let ranks_view = tmux.wait("three ranks and the straggler", |s| {
            s[1].contains(" ▸ comm ") && shows(s, "◀ straggler")
        });
        // Every rank row whole: RANK COLLS EXEC p50 EXEC p99 SKEW p50 LAST LOST, times with a unit.
        let rows: Vec<Vec<&str>> = (ranks_view.iter())
            .skip_while(|l| !l.contains("RANK"))
            .skip(1)
            .take_while(|l| {
                l.starts_with("│") && !l.trim_matches(|c| c == '│' || c == ' ').is_empty()
            })
            .map(|l| {
                l.trim_matches('│')
                    .split_whitespace()
                    .filter(|t| *t != "▶")
                    .collect()
            })
            .collect();
        assert_eq!(rows.len(), 3, "{}", ranks_view.join("\n"));
        for r in &rows {
            assert!(r.len() == 7 || r[7..] == ["◀", "straggler"], "{r:?}");
            for t in &r[2..5] {
                let n = t.trim_end_matches(|c: char| c.is_ascii_alphabetic());
                assert!(
                    (t.ends_with("us") || t.ends_with("ms") || t.ends_with('s'))
                        && n.parse::<f64>().is_ok(),
                    "a cut value {t:?} in {r:?}"
                );
            }
        }
        // Sorted by skew, the straggler (rank 1) comes first.
        tmux.keys(&["s", "s", "Home"]);
        let by_skew = tmux.wait("sorting by skew, the first row selected", |s| {
            let header = s.iter().position(|l| l.contains("RANK"));
            shows(s, "sort: skew") && header.is_some_and(|h| s[h + 1].contains("▶"))
        });
        let first = (by_skew.iter()).find(|l| l.contains("▶")).unwrap();
        assert_eq!(
            first.split_whitespace().nth(1),
            Some("1"),
            "{}",
            by_skew.join("\n")
        );
        // Its channels, from the live stream.
        tmux.keys(&["Enter"]);
        tmux.wait("rank 1's channels", |s| {
            shows(s, "rank 1") && shows(s, "KERNEL p50") && shows(s, "channels, since opened")
        });

        d.sigkill();
        tmux.wait("the daemon reported unreachable", |s| {
            s[0].starts_with("daemon unreachable since")
        });
        d.spawn();
        tmux.wait("the view back", |s| s[0].starts_with("ncclscope top"));
        assert!(!status.exists(), "top exited while the daemon restarted");
        tmux.keys(&["q"]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(&status).unwrap_or_default().trim() != "0" {
            assert!(Instant::now() < deadline, "top did not quit with 0");
            std::thread::sleep(Duration::from_millis(100));
        }
        ranks.join().unwrap();
    });
}
