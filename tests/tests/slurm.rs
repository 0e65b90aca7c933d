//! The Slurm scripts (deploy/slurm/) run as slurmstepd and slurmd run them, against a real daemon and
//! real simulated ranks: the TaskProlog, run as the job's user, names the plugin and the job id, and
//! the ranks started with only what it exported land in that job; the Epilog, run as root, writes the
//! node's trace of exactly those collectives into the configured directory, owned by the job's user,
//! found by the Slurm job id whatever job id the tasks chose, with its coverage stated in it and in
//! its log line, and exits 0 leaving nothing behind where there is nothing to export.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The job's user (the test runs as root, as CI does).
const UID: u32 = 61_004;
const JOB: &str = "4242";

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/slurm")
        .join(name)
}

struct Daemon {
    child: Child,
    dir: tempfile::TempDir,
}

impl Daemon {
    fn start() -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        // The job's user reaches the registration socket; the spool and state stay the daemon's.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let d = dir.path();
        let child =
            ncclscope_tests::daemon_args(&mut Command::new(ncclscope_tests::daemon_binary()), d)
                .args(["--prometheus-listen", "", "--otlp-endpoint", ""])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(d.join("daemon.log")).unwrap())
                .spawn()
                .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(d.join("api.sock")).is_err() {
            assert!(Instant::now() < deadline, "daemon did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Daemon { child, dir }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// The Slurm configuration the scripts read: the plugin of this build, exports into traces/.
    fn slurm_conf(&self, export_dir: &Path) -> PathBuf {
        let conf = self.path("slurm.env");
        std::fs::write(
            &conf,
            format!(
                "NCCLSCOPE_SLURM_PLUGIN={}\nNCCLSCOPE_SLURM_EXPORT_DIR={}\n\
                 NCCLSCOPE_SLURM_EXPORT_FORMAT=perfetto-json\nNCCLSCOPE_SLURM_SETTLE_SECONDS=0\n\
                 NCCLSCOPE_SLURM_EXPORT_SPOOL=yes\n",
                ncclscope_fakenccl::plugin_path().unwrap().display(),
                export_dir.display()
            ),
        )
        .unwrap();
        conf
    }

    /// The Epilog as slurmd runs it: root, the job's ids in the environment.
    fn epilog(&self, conf: &Path, job: &str) -> Output {
        Command::new(script("epilog"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap())
            .env("SLURM_JOB_ID", job)
            .env("SLURM_JOB_UID", UID.to_string())
            .env("SLURM_JOB_GID", UID.to_string())
            .env("NCCLSCOPE_SLURM_CONF", conf)
            .env("NCCLSCOPE_SLURM_BIN", ncclscope_tests::daemon_binary())
            .env("NCCLSCOPE_API_SOCKET", self.path("api.sock"))
            .output()
            .unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The TaskProlog as slurmstepd runs it (the job's user, the task's environment plus `env`); the
/// variables it exports, as slurmstepd reads its output.
fn task_prolog(conf: &Path, env: &[(&str, &str)]) -> BTreeMap<String, String> {
    let out = Command::new(script("task-prolog"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap())
        .env("SLURM_JOB_ID", JOB)
        .env("NCCLSCOPE_SLURM_CONF", conf)
        .envs(env.iter().copied())
        .uid(UID)
        .gid(UID)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l
                .strip_prefix("export ")
                .and_then(|kv| kv.split_once('='))
                .unwrap_or_else(|| panic!("not an export line: {l:?}"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// Two simulated ranks as the job's user with nothing of the job's but what the TaskProlog exported
/// and the Slurm job id slurmstepd gives every task; each loads the plugin that NCCL_PROFILER_PLUGIN
/// names. Returns the instances they produced.
fn run_job(d: &Daemon, exported: &BTreeMap<String, String>, slurm_job: &str) -> u64 {
    // The job's identity comes from the Slurm environment the TaskProlog exported, nothing else.
    let ranks: Vec<Child> = common::sim_ranks(&d.path("reg.sock"), "", 2, 2, 1)
        .iter_mut()
        .map(|c| {
            c.arg("--plugin")
                .arg(&exported["NCCL_PROFILER_PLUGIN"])
                .env_clear()
                .envs(exported)
                .env("SLURM_JOB_ID", slurm_job)
                .env("NCCLSCOPE_SOCKET", d.path("reg.sock"))
                .env("NCCLSCOPE_RING_MEMORY", "cpu")
                .uid(UID)
                .gid(UID)
                .spawn()
                .unwrap()
        })
        .collect();
    common::produced(ranks).into_iter().sum()
}

/// Waits until the daemon has every instance of `job` (root's view: `--uid`).
fn wait_for(d: &Daemon, job: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = Command::new(ncclscope_tests::daemon_binary())
            .args(["stats", "--json", "--job", job, "--api-socket"])
            .arg(d.path("api.sock"))
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let have = v["jobs"][0]["collectives"].as_u64().unwrap_or(0);
        if have >= want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{have} of {want} instances: {out:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn the_task_prolog_names_the_plugin_and_job_and_the_epilog_exports_the_jobs_trace() {
    let d = Daemon::start();
    let traces = d.path("traces");
    std::fs::create_dir(&traces).unwrap();
    let conf = d.slurm_conf(&traces);

    let exported = task_prolog(&conf, &[]);
    assert_eq!(
        exported.keys().collect::<Vec<_>>(),
        ["NCCLSCOPE_JOB_ID", "NCCL_PROFILER_PLUGIN"]
    );
    assert_eq!(exported["NCCLSCOPE_JOB_ID"], JOB);
    // A task that chose its own plugin or job id keeps it.
    let own = task_prolog(
        &conf,
        &[
            ("NCCL_PROFILER_PLUGIN", "/opt/other.so"),
            ("NCCLSCOPE_JOB_ID", "mine"),
        ],
    );
    assert!(own.is_empty(), "{own:?}");

    let produced = run_job(&d, &exported, JOB);
    assert!(produced > 0);
    wait_for(&d, JOB, produced);

    let out = d.epilog(&conf, JOB);
    let log = String::from_utf8_lossy(&out.stderr);
    // One log line, saying what the trace covers and that the spool had lost none of it.
    assert!(out.status.success(), "{out:?}");
    assert_eq!(log.lines().count(), 1, "{log}");
    assert!(
        log.contains(&format!(
            "coverage: {produced} collective instances of 2 ranks"
        )) && log.contains("the spool had deleted none of it"),
        "{log}"
    );
    let host =
        String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout).unwrap();
    let trace = traces
        .join(JOB)
        .join(format!("{}.perfetto.json", host.trim()));
    let meta =
        std::fs::metadata(&trace).unwrap_or_else(|e| panic!("{}: {e}: {out:?}", trace.display()));
    assert_eq!(
        (meta.uid(), meta.gid()),
        (UID, UID),
        "the job's user owns it"
    );
    assert_eq!(meta.mode() & 0o777, 0o600);
    let dir = std::fs::metadata(traces.join(JOB)).unwrap();
    assert_eq!((dir.uid(), dir.mode() & 0o777), (0, 0o755));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let slices = doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "collective")
        .count();
    assert_eq!(slices as u64, produced, "every collective the ranks ran");
    let notes = doc["metadata"]["ncclscope_notes"].to_string();
    assert!(
        notes.contains(&format!("coverage: {produced} collective instances")),
        "the trace states its coverage: {notes}"
    );
    // And the node's instances as a spool, the user's, from which the job's trace across its nodes
    // is made (here one node).
    let spool = traces.join(JOB).join(format!("{}.spool", host.trim()));
    let meta = std::fs::metadata(&spool).unwrap();
    assert_eq!((meta.uid(), meta.is_dir()), (UID, true));
    let again = d.path("again.json");
    let out = Command::new(ncclscope_tests::daemon_binary())
        .args([
            "export",
            "--slurm-job",
            JOB,
            "--format",
            "perfetto-json",
            "--spool",
        ])
        .arg(&spool)
        .arg("-o")
        .arg(&again)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&again).unwrap()).unwrap();
    let from_spool = (doc["traceEvents"].as_array().unwrap().iter())
        .filter(|e| e["cat"] == "collective")
        .count();
    assert_eq!(from_spool as u64, produced);
    assert_eq!(
        std::fs::read_dir(traces.join(JOB)).unwrap().count(),
        2,
        "no temporary file left"
    );

    // A job that ran no NCCL here: nothing written, not even its directory, and the Epilog still
    // succeeds (a failing one drains the node).
    let none = d.epilog(&conf, "4243");
    assert!(none.status.success(), "{none:?}");
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("job 4243 ran no NCCL"),
        "{none:?}"
    );
    assert!(!traces.join("4243").exists());
    assert_eq!(
        std::fs::read_dir(&traces).unwrap().count(),
        1,
        "nothing else left in the export directory"
    );
}

/// Issue 38: tasks that set their own NCCLSCOPE_JOB_ID (the TaskProlog leaves it) used to get no
/// trace, the Epilog exporting by SLURM_JOB_ID. The plugin records the Slurm job beside the job id,
/// and the Epilog finds the job's instances by it.
#[test]
fn the_epilog_exports_a_job_whose_tasks_chose_their_own_job_id() {
    const SLURM_JOB: &str = "4244";
    let d = Daemon::start();
    let traces = d.path("traces");
    std::fs::create_dir(&traces).unwrap();
    let conf = d.slurm_conf(&traces);
    let mut exported = task_prolog(&conf, &[("NCCLSCOPE_JOB_ID", "my-run")]);
    assert!(!exported.contains_key("NCCLSCOPE_JOB_ID"));
    exported.insert("NCCLSCOPE_JOB_ID".into(), "my-run".into());
    let produced = run_job(&d, &exported, SLURM_JOB);
    assert!(produced > 0);
    wait_for(&d, "my-run", produced);

    let out = d.epilog(&conf, SLURM_JOB);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && log.contains(&format!("coverage: {produced} collective instances")),
        "{log}"
    );
    let host =
        String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout).unwrap();
    let trace = traces
        .join(SLURM_JOB)
        .join(format!("{}.perfetto.json", host.trim()));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let jobs: std::collections::BTreeSet<String> = (doc["traceEvents"].as_array().unwrap().iter())
        .filter(|e| e["cat"] == "collective")
        .map(|e| e["args"]["job_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(jobs.into_iter().collect::<Vec<_>>(), ["my-run"]);
}
