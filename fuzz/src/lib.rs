//! Fuzz targets for what ncclscope reads from other processes and from operators: a segment record
//! and a stream of them applied to the daemon's assembler (written by any local process), a spool file (on disk across crashes), a registration (a
//! request and the memory file it hands over, from any local process) and the daemon's configuration
//! (TOML file and environment). Each target asserts what a user relies on, beyond "no panic": decoding
//! is the inverse of encoding, a repaired spool reads back cleanly and can be appended to, an accepted
//! registration is a well-formed segment whose every record can be read, an accepted configuration
//! reloads to itself.
//!
//! `scripts/fuzz.sh` runs them under AFL++ (coverage-guided, stable Rust); the inputs it found that
//! failed are kept in `fuzz/regressions/TARGET/` and run, with the seeds, by this crate's tests.

use std::path::Path;

use ncclscope::config::{Config, Overrides};
use ncclscope::storage::spool::{Origin, Spool, SpoolLimits, SpoolReader};
use ncclscope_proto::api::Collective;
use ncclscope_proto::fixture::Coll;
use ncclscope_proto::record::RECORD_WORDS;
use ncclscope_proto::segment::segment_bytes;
use ncclscope_proto::{Claims, Consumer, Record, Segment, StrId, TimingPath};

/// A target: takes any input; panics when the property it checks does not hold.
pub type Target = fn(&[u8]);

/// Every target, by name.
pub const TARGETS: [(&str, Target); 5] = [
    ("record", record),
    ("records", records),
    ("spool", spool),
    ("register", register),
    ("config", config),
];

pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|t| t.0 == name).map(|t| t.1)
}

/// A segment record: the 64 bytes of a ring slot (shorter input is zero-padded).
pub fn record(data: &[u8]) {
    let mut w = [0u64; RECORD_WORDS];
    for (word, chunk) in w.iter_mut().zip(data.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *word = u64::from_le_bytes(b);
    }
    if let Ok(r) = Record::decode(&w) {
        assert_eq!(Record::decode(&r.encode()), Ok(r), "decode(encode(r)) != r");
    }
}

/// A segment's stream as the daemon consumes it: 64-byte slots decoded and applied in order to the
/// daemon's assembler (with timeouts and the process's exit), whatever they say.
pub fn records(data: &[u8]) {
    let mut asm = ncclscope::assemble::Assembler::new(1, 0, "j".into(), "h".into(), 64);
    let mut out = Vec::new();
    for (pos, slot) in data.chunks(RECORD_WORDS * 8).enumerate() {
        let mut w = [0u64; RECORD_WORDS];
        for (word, chunk) in w.iter_mut().zip(slot.chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *word = u64::from_le_bytes(b);
        }
        if let Ok(r) = Record::decode(&w) {
            asm.apply(pos as u64, &r, 1_000 * pos as u64, &mut out);
        }
        if pos % 16 == 15 {
            asm.sweep(1_000 * pos as u64, 5_000, &mut out);
        }
    }
    asm.finish_all(&mut out);
    assert_eq!(asm.pending(), 0, "nothing pending after the process's exit");
}

/// A spool file, as a crash, a full disk or another program may have left it: read without repair
/// (errors end the file), then opened by a daemon (the torn tail cut off) and appended to.
pub fn spool(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    // Job "j" of uid 0 (what `Collective::default()` says).
    let key = (0, "j".to_string());
    let job = dir.path().join("0").join("j");
    std::fs::create_dir_all(&job).expect("job directory");
    std::fs::write(job.join("0000000000000000.spool"), data).expect("spool file");
    let reader = SpoolReader::open_dir(dir.path()).expect("spool directory");
    let before = reader.read_job(&key).take_while(Result::is_ok).count();
    let mut spool =
        Spool::open(dir.path(), SpoolLimits::default()).expect("a daemon opens any spool");
    let kept: Vec<Collective> = spool
        .reader()
        .read_job(&key)
        .collect::<Result<_, _>>()
        .expect("after the repair every record reads back");
    assert_eq!(
        kept.len(),
        before,
        "the repair keeps exactly the valid prefix"
    );
    spool
        .recorded_since(&key, None)
        .expect("origins read back after the repair");
    let next = Collective {
        job_id: "j".into(),
        seq: u64::MAX,
        ..Default::default()
    };
    spool
        .append(&[(Origin::default(), next.clone())])
        .expect("append after the repair");
    let after: Vec<Collective> = spool
        .reader()
        .read_job(&key)
        .collect::<Result<_, _>>()
        .expect("everything reads back after the append");
    assert_eq!(after.len(), kept.len() + 1);
    assert_eq!(after.last(), Some(&next));
}

/// A registration: the request (up to and including the first newline) and, after it, the contents
/// of the memory file it hands over, sealed as a plugin seals it.
pub fn register(data: &[u8]) {
    use rustix::fs::MemfdFlags;
    let split = data
        .iter()
        .position(|&b| b == b'\n')
        .map_or(data.len(), |i| i + 1);
    let (message, contents) = data.split_at(split);
    let fd = rustix::fs::memfd_create("fuzz", MemfdFlags::ALLOW_SEALING).expect("memfd");
    let mut written = 0;
    while written < contents.len() {
        written += rustix::io::write(&fd, &contents[written..]).expect("write");
    }
    rustix::fs::fcntl_add_seals(&fd, ncclscope_proto::segment::REQUIRED_SEALS).expect("seal");
    let uid = rustix::process::getuid().as_raw();
    if let Ok(seg) = ncclscope::register::check(message, Some(fd), uid) {
        assert_eq!(message, ncclscope::register::REQUEST);
        assert_eq!(
            segment_bytes(seg.capacity()),
            contents.len() as u64,
            "the sealed size is the declared one"
        );
        let mut consumer = Consumer::new(seg);
        let mut out = Vec::new();
        while let Ok(n @ 1..) = consumer.read(4096, &mut out) {
            assert!(n <= 4096);
            out.clear();
        }
    }
}

/// The daemon's configuration: a TOML file, then (after a NUL byte) `NCCLSCOPE_...=value` lines.
pub fn config(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (file, env) = text.split_once('\0').unwrap_or((&text, ""));
    let env: Vec<(String, String)> = env
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("ncclscope.toml");
    std::fs::write(&path, file).expect("config file");
    match Config::load(Some(&path), env, &Overrides::default()) {
        Ok(c) => {
            let again = reload(&c, dir.path());
            assert_eq!(
                again, c,
                "an accepted configuration written back reloads to itself"
            );
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

fn reload(c: &Config, dir: &Path) -> Config {
    let path = dir.join("again.toml");
    std::fs::write(&path, toml::to_string(c).expect("serialisable")).expect("config file");
    Config::load(Some(&path), Vec::new(), &Overrides::default())
        .unwrap_or_else(|e| panic!("an accepted configuration written back is refused: {e}"))
}

/// Starting inputs for `target`: valid examples of each format, built with the real encoders.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    match target {
        "record" => sample_records()
            .iter()
            .map(|r| r.encode().iter().flat_map(|w| w.to_le_bytes()).collect())
            .collect(),
        "spool" => {
            let dir = tempfile::tempdir().expect("temporary directory");
            let mut spool = Spool::open(dir.path(), SpoolLimits::default()).expect("spool");
            let coll = |seq| Collective {
                job_id: "j".into(),
                seq,
                func: "AllReduce".into(),
                channels: vec![Default::default(); 2],
                ..Default::default()
            };
            let origin = Origin {
                uid: 1000,
                pid: 42,
                inode: 7,
                op_id: 3,
                first_pos: 9,
            };
            spool
                .append(&[(origin, coll(1)), (Origin::default(), coll(2))])
                .expect("append");
            let file = dir
                .path()
                .join("0")
                .join("j")
                .join("0000000000000000.spool");
            vec![std::fs::read(file).expect("spool file")]
        }
        "records" => vec![
            sample_records()
                .iter()
                .flat_map(|r| r.encode())
                .flat_map(|w| w.to_le_bytes())
                .collect(),
        ],
        "register" => {
            let claims = Claims {
                hostname: "node".into(),
                job_id: "job".into(),
                slurm_job_id: String::new(),
            };
            let mut p =
                ncclscope_proto::Producer::new(Segment::create(&claims, 16).expect("segment"));
            for r in sample_records() {
                p.push(&r);
            }
            let mut contents = vec![0u8; segment_bytes(16) as usize];
            rustix::io::pread(p.segment().fd(), &mut contents, 0).expect("read the segment");
            let mut seed = ncclscope::register::REQUEST.to_vec();
            seed.extend_from_slice(&contents);
            vec![
                seed,
                b"REGISTER /dev/shm/ncclscope.1000.4242.987654\n".to_vec(),
            ]
        }
        "config" => vec![
            include_bytes!("../../deploy/ncclscope.toml").to_vec(),
            b"[otlp]\nsample_ratio = 0.5\n\0NCCLSCOPE_OTLP_ENDPOINT=http://127.0.0.1:4317\n"
                .to_vec(),
        ],
        _ => Vec::new(),
    }
}

fn sample_records() -> Vec<Record> {
    let coll = Coll {
        comm: 1,
        id: 9,
        seq: 4,
        n_channels: 16,
        n_warps: 8,
        host_ns: 6,
        ..Coll::default()
    };
    vec![
        Record::str(StrId(1), b"AllReduce"),
        Record::Comm {
            comm: 1,
            comm_hash: 0xfeed,
            rank: 3,
            nranks: 8,
            nnodes: 2,
            cuda_dev: 3,
            name: StrId(2),
            nccl_version: 22809,
            path: TimingPath::DeviceHook,
            host_ns: 5,
            gpu: None,
        },
        coll.start(),
        // Captured into a CUDA graph: its work comes with every replay.
        Coll {
            id: 10,
            seq: 5,
            n_channels: 2,
            host_ns: 7,
            captured: true,
            ..coll
        }
        .start(),
        coll.kernel(5, (100, 200), 7),
        Record::DevWork {
            comm: 1,
            channel: 2,
            func_id: 11,
            work_counter: 77,
            gpu_start: 300,
            gpu_stop: 400,
        },
        Record::Calibration {
            cuda_dev: 0,
            offset_ns: -5,
            error_ns: 32,
            drift_ppb: -3,
            host_ns: 8,
        },
        coll.stop(9),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every seed, and every input the fuzzer found failing once (kept in `regressions/TARGET/`).
    #[test]
    fn seeds_and_past_failures_pass_every_target() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
        let mut failed = Vec::new();
        for (name, run) in TARGETS {
            let seeds = seeds(name);
            assert!(!seeds.is_empty(), "{name} has seeds");
            let mut inputs: Vec<(String, Vec<u8>)> = seeds
                .into_iter()
                .enumerate()
                .map(|(i, s)| (format!("seed {i}"), s))
                .collect();
            if let Ok(dir) = std::fs::read_dir(root.join(name)) {
                for f in dir {
                    let path = f.unwrap().path();
                    inputs.push((path.display().to_string(), std::fs::read(&path).unwrap()));
                }
            }
            for (what, input) in inputs {
                if let Err(panic) = std::panic::catch_unwind(|| run(&input)) {
                    let why = panic
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or(panic.downcast_ref::<&str>().copied())
                        .unwrap_or("");
                    failed.push(format!("{name}: {what}: {why}"));
                }
            }
        }
        assert!(failed.is_empty(), "{failed:#?}");
    }
}
