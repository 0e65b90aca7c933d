//! What `ncclscope daemon` writes as logs, as a log collector receives it: plain text without colour
//! codes when stderr is a file or pipe (journald, a container runtime), colour on a terminal unless
//! `NO_COLOR` is set, one JSON object per line with `--log-format json`, and under systemd (stderr is
//! the journal stream) native journal entries with their PRIORITY, sent to a journal socket this test
//! binds in a mount namespace of the daemon's own.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const STARTED: &str = "ncclscope daemon started";

fn ncclscope_bin() -> PathBuf {
    ncclscope_tests::daemon_binary()
}

/// `ncclscope daemon` on sockets in `dir`, nothing exported; `wrap` runs it through another program.
fn daemon(dir: &Path, wrap: &[&str]) -> Command {
    let mut c = Command::new(
        wrap.first()
            .map_or(ncclscope_bin().as_os_str(), |w| w.as_ref()),
    );
    if !wrap.is_empty() {
        c.args(&wrap[1..]).arg(ncclscope_bin());
    }
    ncclscope_tests::daemon_args(&mut c, dir)
        .args(["--prometheus-listen", "", "--otlp-endpoint", ""])
        .env_remove("NO_COLOR")
        .env_remove("JOURNAL_STREAM")
        .env_remove("NCCLSCOPE_LOG_FORMAT")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    c
}

/// Waits until `ready()` or the daemon exits (then fails with `what()`), then stops it with SIGTERM.
fn stop_when(mut child: Child, ready: impl Fn() -> bool, what: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("daemon exited with {st}: {}", what());
        }
        assert!(
            Instant::now() < deadline,
            "daemon did not start: {}",
            what()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    assert!(child.wait().unwrap().success(), "{}", what());
}

/// Runs a daemon with stderr into a file until it logged its start; returns what it wrote.
fn log_to_file(env: &[(&str, &str)], args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("daemon.log");
    let child = daemon(dir.path(), &[])
        .args(args)
        .envs(env.iter().copied())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    stop_when(child, || read().contains(STARTED), read);
    read()
}

#[test]
fn logs_to_a_file_are_plain_text() {
    let text = log_to_file(&[], &[]);
    assert!(text.contains(" INFO "), "{text}");
    assert!(
        !text.contains('\x1b'),
        "colour codes in a log that is not a terminal: {text:?}"
    );
}

/// Runs a daemon with stderr on a pseudo-terminal; returns what the terminal showed.
fn log_to_terminal(env: &[(&str, &str)]) -> String {
    use rustix::pty::{OpenptFlags, grantpt, openpt, ptsname, unlockpt};
    let dir = tempfile::tempdir().unwrap();
    let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY).unwrap();
    grantpt(&master).unwrap();
    unlockpt(&master).unwrap();
    let slave_path = ptsname(&master, Vec::new()).unwrap();
    let slave = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(slave_path.to_str().unwrap())
        .unwrap();
    let child = daemon(dir.path(), &[])
        .envs(env.iter().copied())
        .stderr(slave)
        .spawn()
        .unwrap();
    let shown = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let reader = {
        let shown = shown.clone();
        let mut master = std::fs::File::from(master);
        // Until the terminal's last writer closes it (EIO).
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = master.read(&mut buf) {
                shown.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let text = || String::from_utf8_lossy(&shown.lock().unwrap()).into_owned();
    stop_when(child, || text().contains(STARTED), text);
    reader.join().unwrap();
    text()
}

#[test]
fn a_terminal_gets_colour_unless_no_color_is_set() {
    let coloured = log_to_terminal(&[]);
    assert!(coloured.contains('\x1b'), "{coloured:?}");
    let plain = log_to_terminal(&[("NO_COLOR", "1")]);
    assert!(plain.contains(STARTED), "{plain:?}");
    assert!(!plain.contains('\x1b'), "NO_COLOR=1: {plain:?}");
}

/// Issue 37: a supervisor that stops the daemon right after it said it started sees it exit cleanly
/// (it was killed: SIGTERM was handled only later). The daemon's stderr is a pipe kept full, so the
/// daemon is held inside the very write of that line while SIGTERM is sent.
#[test]
fn sigterm_sent_as_it_says_started_ends_it_cleanly() {
    use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
    let dir = tempfile::tempdir().unwrap();
    let (mut out, into) = std::io::pipe().unwrap();
    let flags = fcntl_getfl(&into).unwrap();
    fcntl_setfl(&into, flags | OFlags::NONBLOCK).unwrap();
    let mut filler = 0;
    while let Ok(n) = rustix::io::write(&into, &[0u8; 4096]) {
        filler += n;
    }
    // The daemon shares this open file: its writes must block, not fail.
    fcntl_setfl(&into, flags).unwrap();
    let mut child = daemon(dir.path(), &[]).stderr(into).spawn().unwrap();
    let pid = child.id();
    // Until one of its threads sleeps writing to the full pipe: its first line.
    let deadline = Instant::now() + Duration::from_secs(30);
    let writing = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|t| {
                std::fs::read_to_string(t.path().join("wchan"))
                    .is_ok_and(|w| w.ends_with("pipe_write"))
            })
    };
    while !writing() {
        assert!(child.try_wait().unwrap().is_none(), "daemon exited");
        assert!(Instant::now() < deadline, "daemon never wrote to stderr");
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let mut text = Vec::new();
    out.read_to_end(&mut text).unwrap();
    let status = child.wait().unwrap();
    let text = String::from_utf8_lossy(&text[filler..]).into_owned();
    assert!(status.success(), "{status}: {text:?}");
    assert!(
        text.lines().next().is_some_and(|l| l.contains(STARTED)),
        "the line the daemon was held in is not its start: {text}"
    );
    assert!(text.contains("stopping: draining segments"), "{text}");
}

#[test]
fn json_logs_are_one_object_per_line() {
    for (env, args) in [
        (&[][..], &["--log-format", "json"][..]),
        (&[("NCCLSCOPE_LOG_FORMAT", "json")][..], &[][..]),
    ] {
        let text = log_to_file(env, args);
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
            .collect();
        let started = lines
            .iter()
            .find(|v| v["fields"]["message"] == STARTED)
            .unwrap_or_else(|| panic!("no start line: {text}"));
        assert_eq!(started["level"], "INFO");
        assert!(
            started["fields"]["api"]
                .as_str()
                .unwrap()
                .ends_with("api.sock"),
            "{started}"
        );
        assert!(started["timestamp"].is_string(), "{started}");
    }
}

/// Under systemd, stderr is the journal stream (`JOURNAL_STREAM` names it): the daemon sends native
/// journal entries, with PRIORITY 6 for info, its identifier and its fields. The journal socket is one
/// this test binds, mounted at /run/systemd/journal in a mount namespace of the daemon's own (root,
/// as CI runs; `unshare` from util-linux).
#[test]
fn under_systemd_entries_go_to_the_journal_with_their_priority() {
    let dir = tempfile::tempdir().unwrap();
    let journal_dir = dir.path().join("journal");
    std::fs::create_dir(&journal_dir).unwrap();
    let journal = UnixDatagram::bind(journal_dir.join("socket")).unwrap();
    journal.set_nonblocking(true).unwrap();
    let stderr_path = dir.path().join("stderr");
    let stderr = std::fs::File::create(&stderr_path).unwrap();
    let st = rustix::fs::fstat(stderr.as_fd()).unwrap();
    let script = "mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/journal && \
                  mount --bind \"$1\" /run/systemd/journal && shift && exec \"$@\"";
    let mut cmd = daemon(
        dir.path(),
        &[
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            journal_dir.to_str().unwrap(),
        ],
    );
    let child = cmd
        .env("JOURNAL_STREAM", format!("{}:{}", st.st_dev, st.st_ino))
        .stderr(stderr)
        .spawn()
        .unwrap();
    let started_field = format!("MESSAGE={STARTED}");
    let entries = std::cell::RefCell::new(Vec::<Vec<String>>::new());
    let receive = || {
        let mut buf = vec![0u8; 65536];
        while let Ok(n) = journal.recv(&mut buf) {
            entries.borrow_mut().push(journal_fields(&buf[..n]));
        }
        entries.borrow().iter().any(|e| e.contains(&started_field))
    };
    let what = || {
        format!(
            "entries {:?}, stderr {:?}",
            entries.borrow(),
            std::fs::read_to_string(&stderr_path).unwrap_or_default()
        )
    };
    stop_when(child, receive, what);
    let entries = entries.borrow();
    let fields = entries.iter().find(|e| e.contains(&started_field)).unwrap();
    for want in ["PRIORITY=6", "SYSLOG_IDENTIFIER=ncclscope"] {
        assert!(fields.iter().any(|f| f == want), "{want} in {fields:?}");
    }
    assert!(
        fields
            .iter()
            .any(|f| f.starts_with("F_API=") && f.ends_with("api.sock")),
        "{fields:?}"
    );
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(
        !stderr.contains(STARTED),
        "logged to the journal, not as text on its stream: {stderr}"
    );
}

/// The fields of one datagram of the journal's native protocol: `KEY=value\n`, or `KEY\n`, a 64-bit
/// little-endian length, the value and `\n` (for values that may hold newlines).
fn journal_fields(mut d: &[u8]) -> Vec<String> {
    let mut fields = Vec::new();
    while let Some(nl) = d.iter().position(|&b| b == b'\n') {
        let line = String::from_utf8_lossy(&d[..nl]).into_owned();
        d = &d[nl + 1..];
        if line.contains('=') {
            fields.push(line);
        } else {
            let len = u64::from_le_bytes(d[..8].try_into().unwrap()) as usize;
            fields.push(format!(
                "{line}={}",
                String::from_utf8_lossy(&d[8..8 + len])
            ));
            d = &d[8 + len + 1..];
        }
    }
    fields
}
