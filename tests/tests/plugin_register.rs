//! Registration with the daemon over its Unix socket (`REGISTER <segment-name>\n` -> `OK\n`), done from
//! the plugin's forwarding thread with retries, while NCCL keeps running and the segment keeps filling.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ncclscope_fakenccl::check::{Expect, check};
use ncclscope_fakenccl::process::{Cleanup, rank_binary, read_only_segment, unique_prefix};
use ncclscope_fakenccl::report::Report;
use ncclscope_proto::SegmentName;

/// Kills the child if the test fails before it exits.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn registers_after_the_daemon_appears_and_keeps_working_meanwhile() {
    let prefix = unique_prefix("register");
    let _cleanup = Cleanup(prefix.clone());
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ncclscope.sock");
    let child = Command::new(rank_binary().unwrap())
        .args([
            "--kind",
            "v6",
            "--comms",
            "2",
            "--colls",
            "50",
            "--interval-us",
            "2000",
            "--hold-ms",
            "3000",
        ])
        .env("NCCLSCOPE_SHM_PREFIX", &prefix)
        .env("NCCLSCOPE_SOCKET", &socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Child(child);
    let pid = child.0.id();

    // No daemon yet: the rank runs and its segment fills.
    let t0 = Instant::now();
    while ncclscope_proto::segment::list(&prefix).unwrap().is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no segment appeared"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));

    // The daemon appears; the plugin's backoff brings it back within a few seconds.
    let listener = UnixListener::bind(&socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    let t1 = Instant::now();
    let mut stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    t1.elapsed() < Duration::from_secs(15),
                    "the plugin never registered"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).unwrap();
    let name = line
        .strip_prefix("REGISTER ")
        .and_then(|n| n.strip_suffix('\n'))
        .expect("REGISTER line");
    let name = SegmentName::parse(name).unwrap_or_else(|| panic!("bad segment name in {line:?}"));
    assert_eq!((name.prefix.as_str(), name.pid), (prefix.as_str(), pid));
    assert_eq!(name.uid, rustix::process::getuid().as_raw());
    assert_eq!(
        ncclscope_proto::segment::list(&prefix).unwrap(),
        vec![name.clone()]
    );
    stream.write_all(b"OK\n").unwrap();
    drop(stream);

    // Registered once: no second connection while the rank finishes.
    let out = finish(&mut child.0);
    assert!(listener.accept().is_err(), "registered twice");
    let report: Report = serde_json::from_slice(&out.0).unwrap();
    assert!(out.1.contains("registered with the daemon"), "{}", out.1);
    let seg = read_only_segment(&prefix).unwrap();
    check(&report, &seg, Expect::FINALIZED).unwrap();
}

/// Waits for the rank to exit successfully; its stdout and stderr.
fn finish(child: &mut std::process::Child) -> (Vec<u8>, String) {
    use std::io::Read;
    let mut out = Vec::new();
    let mut err = String::new();
    child.stdout.take().unwrap().read_to_end(&mut out).unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(
        child.wait().unwrap().success(),
        "fakenccl-rank failed:\n{err}"
    );
    (out, err)
}
