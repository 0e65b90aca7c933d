//! Running fake ranks as separate processes (the plugin keeps one state per process) and reading back
//! what they left in shared memory, for tests.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, bail};
use ncclscope_proto::segment::{self, Consumer, Counter, Owner, Segment, SegmentName};
use ncclscope_proto::{Record, StrId};

use crate::report::Report;

/// A segment prefix no other test (or process) uses.
pub fn unique_prefix(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "nstest-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Unlinks every segment with a prefix when dropped, so failed tests leave nothing in /dev/shm.
pub struct Cleanup(pub String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for name in segment::list(&self.0).unwrap_or_default() {
            let _ = Segment::unlink(&name);
        }
    }
}

/// `fakenccl-rank` in the target dir.
pub fn rank_binary() -> anyhow::Result<PathBuf> {
    let p = crate::target_dir().join("fakenccl-rank");
    if !p.exists() {
        bail!(
            "{} is missing: run `cargo build --workspace` first (scripts/test.sh does)",
            p.display()
        );
    }
    Ok(p)
}

/// A finished fake rank.
pub struct RankRun {
    pub report: Report,
    /// What the plugin logged through the fake NCCL's logger (`fakenccl-log:` lines) and anything else.
    pub stderr: String,
}

/// Runs `fakenccl-rank` with `args`, the plugin env `env` and `NCCLSCOPE_SHM_PREFIX=prefix`; the daemon
/// socket defaults to a path where nothing listens.
pub fn run_rank(prefix: &str, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<RankRun> {
    let mut cmd = Command::new(rank_binary()?);
    cmd.args(args)
        .env("NCCLSCOPE_SHM_PREFIX", prefix)
        .env(
            "NCCLSCOPE_SOCKET",
            std::env::temp_dir().join(format!("{prefix}-no-daemon.sock")),
        )
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().context("running fakenccl-rank")?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        bail!("fakenccl-rank {args:?} failed ({}):\n{stderr}", out.status);
    }
    let report = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("fakenccl-rank output; stderr:\n{stderr}"))?;
    Ok(RankRun { report, stderr })
}

/// Everything a segment holds, read without consuming.
pub struct Contents {
    pub name: SegmentName,
    pub owner: Owner,
    pub records: Vec<Record>,
    pub counters: BTreeMap<&'static str, u64>,
    pub closed: bool,
    pub capacity: u64,
}

impl Contents {
    pub fn counter(&self, c: Counter) -> u64 {
        self.counters[c.name()]
    }

    /// The interned strings, checking each is defined once.
    pub fn strings(&self) -> anyhow::Result<BTreeMap<StrId, String>> {
        let mut out = BTreeMap::new();
        for r in &self.records {
            if let Record::Str { id, len, bytes } = r {
                let text = String::from_utf8_lossy(&bytes[..*len as usize]).into_owned();
                if out.insert(*id, text).is_some() {
                    bail!("string {id:?} defined twice");
                }
            }
        }
        Ok(out)
    }
}

/// Reads the only segment with `prefix`.
pub fn read_only_segment(prefix: &str) -> anyhow::Result<Contents> {
    let names = segment::list(prefix)?;
    let [name] = names.as_slice() else {
        bail!("expected one segment named {prefix}.*, found {names:?}")
    };
    read_segment(name)
}

pub fn read_segment(name: &SegmentName) -> anyhow::Result<Contents> {
    let seg = Segment::open(name)?;
    let owner = seg.owner();
    let closed = seg.is_closed();
    let capacity = seg.capacity();
    let counters = Counter::ALL
        .iter()
        .map(|c| (c.name(), seg.counter(*c)))
        .collect();
    let mut consumer = Consumer::new(seg);
    let mut raw = Vec::new();
    while consumer.read(4096, &mut raw)? > 0 {}
    let records = raw
        .into_iter()
        .map(|(pos, r)| r.with_context(|| format!("record {pos} of {name}")))
        .collect::<anyhow::Result<_>>()?;
    Ok(Contents {
        name: name.clone(),
        owner,
        records,
        counters,
        closed,
        capacity,
    })
}
