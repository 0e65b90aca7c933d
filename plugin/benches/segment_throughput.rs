//! Records per second from a producer process to a consumer process: through a shared-memory segment
//! (the plugin -> daemon channel), next to a Unix-domain stream socket carrying the same 64-byte
//! records, in the same run. The consumer decodes every record and checks a checksum in all cases.
//! Prints `key: value` lines (docs/benchmarks.md, "Plugin").
//!
//! cargo bench -p ncclscope-plugin --bench segment_throughput

use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::time::Instant;

use ncclscope_proto::Record;
use ncclscope_proto::record::RECORD_WORDS;
use ncclscope_proto::segment::{Claims, Consumer, Producer, Segment};

const RECORDS: u64 = 2_000_000;
/// Alternating rounds per transport; the median is reported (the machine is shared and noisy).
const ROUNDS: usize = 5;
const ROLE: &str = "NCCLSCOPE_BENCH_ROLE";

fn record(i: u64) -> Record {
    Record::OpStop {
        comm: 1,
        id: i,
        host_ns: i,
    }
}

fn checksum(r: &Record) -> u64 {
    match r {
        Record::OpStop { id, .. } => *id,
        _ => panic!("unexpected record {r:?}"),
    }
}

fn expected_sum() -> u64 {
    RECORDS * (RECORDS - 1) / 2
}

/// Child side: consume `RECORDS` records, say "ready" first and the checksum at the end.
fn consume(role: &str, target: &str) {
    let mut sum = 0u64;
    let mut got = 0u64;
    match role {
        "shm" => {
            // The parent's segment through its descriptor in /proc: the same memory file.
            let fd = std::fs::File::options()
                .read(true)
                .write(true)
                .open(target)
                .expect("open segment");
            let mut c = Consumer::new(Segment::open(fd.into()).expect("map segment"));
            println!("ready");
            let mut out = Vec::with_capacity(4096);
            while got < RECORDS {
                out.clear();
                let n = c.read(4096, &mut out).expect("read");
                if n == 0 {
                    std::thread::yield_now();
                    continue;
                }
                for (pos, r) in &out {
                    sum = sum.wrapping_add(checksum(r.as_ref().expect("decode")));
                    got = pos + 1;
                }
                c.commit(got);
            }
        }
        _ => {
            let s = UnixStream::connect(target).expect("connect");
            println!("ready");
            let mut r = BufReader::with_capacity(1 << 16, s);
            let mut buf = [0u8; RECORD_WORDS * 8];
            while got < RECORDS {
                r.read_exact(&mut buf).expect("read");
                let mut w = [0u64; RECORD_WORDS];
                for (i, chunk) in buf.chunks_exact(8).enumerate() {
                    w[i] = u64::from_le_bytes(chunk.try_into().unwrap());
                }
                sum = sum.wrapping_add(checksum(&Record::decode(&w).expect("decode")));
                got += 1;
            }
        }
    }
    println!("{sum}");
}

/// Starts a consumer process and waits for its "ready".
fn spawn(role: &str, target: &str) -> (std::process::Child, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(ROLE, format!("{role}:{target}"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn consumer");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    (child, out)
}

fn finish(
    mut child: std::process::Child,
    mut out: BufReader<std::process::ChildStdout>,
    t: Instant,
) -> f64 {
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let secs = t.elapsed().as_secs_f64();
    assert!(child.wait().unwrap().success());
    assert_eq!(
        line.trim().parse::<u64>().unwrap(),
        expected_sum(),
        "consumer checksum"
    );
    RECORDS as f64 / secs
}

fn shm() -> f64 {
    let claims = Claims {
        hostname: "bench".into(),
        job_id: "bench".into(),
        slurm_job_id: String::new(),
    };
    let seg = Segment::create(&claims, 1 << 16).expect("create segment");
    let path = format!("/proc/{}/fd/{}", std::process::id(), {
        use std::os::fd::AsRawFd;
        seg.fd().as_raw_fd()
    });
    let (child, out) = spawn("shm", &path);
    let mut p = Producer::new(seg);
    let t = Instant::now();
    for i in 0..RECORDS {
        // Wait for room instead of dropping: this measures what the channel can carry.
        while p.segment().head() - p.segment().tail() >= p.segment().capacity() {
            std::thread::yield_now();
        }
        p.push(&record(i));
    }
    finish(child, out, t)
}

fn socket(batched: bool) -> f64 {
    let dir = std::env::temp_dir().join(format!("ncclscope-bench-tput-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("s.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let (child, out) = spawn("uds", path.to_str().unwrap());
    let (stream, _) = listener.accept().unwrap();
    let t = Instant::now();
    // Batched: 64 KiB writes (1024 records per syscall); otherwise one write per record.
    let mut w = BufWriter::with_capacity(if batched { 1 << 16 } else { 0 }, stream);
    for i in 0..RECORDS {
        let mut bytes = [0u8; RECORD_WORDS * 8];
        for (chunk, word) in bytes.chunks_exact_mut(8).zip(record(i).encode()) {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        w.write_all(&bytes).unwrap();
    }
    w.flush().unwrap();
    let rate = finish(child, out, t);
    let _ = std::fs::remove_dir_all(&dir);
    rate
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        let (role, target) = role.split_once(':').expect("role:target");
        return consume(role, target);
    }
    let (mut shm_rates, mut batched_rates, mut unbatched_rates) =
        (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        shm_rates.push(shm());
        batched_rates.push(socket(true));
        unbatched_rates.push(socket(false));
    }
    let (shm, batched, unbatched) = (
        median(shm_rates),
        median(batched_rates),
        median(unbatched_rates),
    );
    println!("records_per_round: {RECORDS}");
    println!("rounds: {ROUNDS}");
    println!("segment_records_per_s: {shm:.0}");
    println!("uds_batched_records_per_s: {batched:.0}");
    println!("uds_per_record_write_records_per_s: {unbatched:.0}");
    println!("segment_vs_uds_batched: {:.1}", shm / batched);
    println!("segment_vs_uds_per_record_write: {:.1}", shm / unbatched);
}
