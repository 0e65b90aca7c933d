//! The spool keeps what it acknowledged across a SIGKILL: a child process appends batches and prints
//! each acknowledged sequence number; the test kills it mid-stream (SIGKILL, no chance to flush), then
//! reopens the spool as a restarted daemon would and finds every acknowledged instance, in order, and
//! can append after the repaired tail.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ncclscope::storage::spool::{Spool, SpoolLimits, SpoolReader};
use ncclscope_proto::api::{ChannelWork, Collective};

const CHILD_ENV: &str = "NCCLSCOPE_TEST_SPOOL_CHILD";

fn coll(seq: u64) -> Collective {
    Collective {
        job_id: "killed-job".into(),
        seq,
        rank: (seq % 8) as u32,
        func: "AllReduce".into(),
        bytes: 1 << 20,
        channels: (0..16)
            .map(|channel| ChannelWork {
                channel,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// The child process (run by the test below, ignored otherwise): appends forever, printing each
/// acknowledged batch's last seq.
#[test]
#[ignore = "child process of acknowledged_instances_survive_sigkill_and_restart"]
fn spool_child_appender() {
    let dir = std::env::var(CHILD_ENV)
        .expect("run by acknowledged_instances_survive_sigkill_and_restart");
    let mut spool = Spool::open(
        &dir,
        SpoolLimits {
            file_bytes: 256 << 10,
            ..Default::default()
        },
    )
    .unwrap();
    let mut seq = 0;
    loop {
        let batch: Vec<_> = (seq..seq + 7)
            .map(|s| (Default::default(), coll(s)))
            .collect();
        spool.append(&batch).unwrap();
        seq += 7;
        println!("ACK {}", seq - 1);
    }
}

#[test]
fn acknowledged_instances_survive_sigkill_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "spool_child_appender",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut acked = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    for line in lines.by_ref() {
        if let Some(n) = line.unwrap().strip_prefix("ACK ") {
            acked = Some(n.parse::<u64>().unwrap());
        }
        // Enough batches to span several files, then kill while it is writing.
        if acked.is_some_and(|a| a >= 3000) || Instant::now() > deadline {
            break;
        }
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // Lines already written to the pipe are acknowledgements too.
    for line in lines {
        if let Some(n) = line.unwrap().strip_prefix("ACK ") {
            acked = Some(n.parse().unwrap());
        }
    }
    let acked = acked.expect("the child acknowledged appends");

    let mut spool = Spool::open(dir.path(), SpoolLimits::default()).unwrap();
    let seqs: Vec<u64> = spool
        .reader()
        .read_job(&(0, "killed-job".into()))
        .map(|c| c.unwrap().seq)
        .collect();
    assert!(
        seqs.len() as u64 > acked,
        "lost acknowledged instances: have {}, acked up to {acked}",
        seqs.len()
    );
    assert!(
        seqs.iter().enumerate().all(|(i, &s)| s == i as u64),
        "instances out of order or missing"
    );
    // Whatever the kill tore, the spool continues cleanly after it.
    let next = seqs.len() as u64;
    spool.append(&[(Default::default(), coll(next))]).unwrap();
    drop(spool);
    let after: Vec<u64> = SpoolReader::open_dir(dir.path())
        .unwrap()
        .read_job(&(0, "killed-job".into()))
        .map(|c| c.unwrap().seq)
        .collect();
    assert_eq!(after.len() as u64, next + 1);
    assert_eq!(*after.last().unwrap(), next);
}
