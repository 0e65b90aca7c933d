//! Registration with the daemon over its Unix socket (`REGISTER\n` with the segment's descriptor ->
//! `OK\n`), done from the plugin's forwarding thread with retries while NCCL keeps running and the
//! segment keeps filling, and done again when the daemon goes away.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ncclscope_fakenccl::check::{Expect, check};
use ncclscope_fakenccl::process::{rank_binary, read_segment, receive_segment};
use ncclscope_fakenccl::report::Report;
use ncclscope_proto::Segment;

/// Kills the child if the test fails before it exits.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Accepts the next registration within `within`: the connection and the segment it handed over.
fn accept(listener: &UnixListener, within: Duration) -> (UnixStream, Segment) {
    let t0 = Instant::now();
    let conn = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(t0.elapsed() < within, "the plugin never registered");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    conn.set_nonblocking(false).unwrap();
    let seg = Segment::open(receive_segment(&conn).unwrap()).unwrap();
    (conn, seg)
}

#[test]
fn hands_over_its_segment_once_a_daemon_appears_and_again_to_the_next_one() {
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
        .env("NCCLSCOPE_SOCKET", &socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Child(child);
    let pid = child.0.id();

    // No daemon yet: the rank runs and writes into its segment meanwhile.
    std::thread::sleep(Duration::from_millis(300));
    // The daemon appears; the plugin's backoff (at most 2 s) brings the segment to it.
    let listener = UnixListener::bind(&socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    let t1 = Instant::now();
    let (mut first, seg) = accept(&listener, Duration::from_secs(5));
    let found_in = t1.elapsed();
    let cred = rustix::net::sockopt::socket_peercred(&first).unwrap();
    assert_eq!(
        cred.pid.as_raw_nonzero().get() as u32,
        pid,
        "the rank's own"
    );
    assert_eq!(seg.file_uid(), rustix::process::getuid().as_raw());
    assert!(seg.head() > 0, "records written before any daemon listened");
    first.write_all(b"OK\n").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // That daemon goes away: the plugin hands the same segment to the next one.
    drop(first);
    let t2 = Instant::now();
    let (mut second, again) = accept(&listener, Duration::from_secs(5));
    let back_in = t2.elapsed();
    assert_eq!(again.inode(), seg.inode(), "the same memory file");
    second.write_all(b"OK\n").unwrap();
    eprintln!(
        "handed over {found_in:?} after the daemon appeared, again {back_in:?} after it left"
    );

    // Held from then on: no third connection while the rank finishes, and its end ends the connection.
    let out = finish(&mut child.0);
    assert!(listener.accept().is_err(), "registered a third time");
    let report: Report = serde_json::from_slice(&out.0).unwrap();
    assert!(out.1.contains("segment registered again"), "{}", out.1);
    let seg = read_segment(again, &second).unwrap();
    assert!(seg.ended);
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
