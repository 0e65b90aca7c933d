//! Per-job spool: every completed collective instance the daemon accepted, kept on disk so that
//! `ncclscope export` works during and after a job, and across a daemon crash or restart.
//!
//! Layout: `<dir>/<uid>/<job>/<seq>.spool`. A job is (uid, job id): the uid is the one the kernel
//! vouched for at registration, so another user's process naming the same job id writes under its own
//! uid, never into the claimed job's files. Directories are created 0700 and files 0600 (explicit
//! modes, whatever the umask): only the daemon reads them, and answers each user through the API for
//! their own uid. `<job>` is the job id with every byte outside `[A-Za-z0-9._-]` written as `%XX`, and
//! `<seq>` is a spool-wide, ever-increasing 16-digit hex number (so the oldest file of the whole spool
//! is the one with the smallest sequence). A file is an 8-byte magic followed by records
//! `{u32 len LE, u32 crc32(payload) LE, payload}`, payload the record's [`Origin`] (32 bytes) then a
//! prost-encoded [`Collective`]. Files are only appended to; [`Spool::append`] returns after `fdatasync`, so
//! what it acknowledged survives a SIGKILL or power loss. A torn tail (the daemon died mid-append) is
//! truncated when the spool is opened. Past the configured size or age the oldest files are deleted:
//! past a uid's share that uid's oldest, past the total the oldest of the uid holding the most, so one
//! user's jobs never push out another user's share.
//!
//! Beside a job's files: an empty `slurm-<id>` for every Slurm job its processes ran in (so the
//! Slurm Epilog finds the job whatever job id its tasks chose), and `dropped`, what the bounds
//! deleted of the job so far (`files bytes until_unix_ns`: its instances appended before that time
//! may be gone), so that an export can say what it covers.
//!
//! The origin makes the spool exactly-once across a daemon crash: a restarted daemon reads the origins
//! appended since a segment's saved [`Position`] ([`Spool::recorded_since`]) and does not record those
//! operations again.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use ncclscope_proto::api::Collective;
use prost::Message;
use serde::{Deserialize, Serialize};

const MAGIC: &[u8; 8] = b"NCSPOOL2";
const RECORD_HEADER: usize = 8;
const ORIGIN_LEN: usize = 32;
/// A record larger than this is corruption, not a collective.
const MAX_RECORD: usize = 16 << 20;
const EXT: &str = "spool";
/// Spool directories and files: the daemon's alone.
const DIR_MODE: u32 = 0o700;
const FILE_MODE: u32 = 0o600;

/// A spooled job: the uid that ran it and its job id.
pub type JobKey = (u32, String);

/// Where a spooled instance came from: its process's segment and the operation in that segment's
/// stream. All zero when unknown (instances not read from a segment).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Origin {
    pub uid: u32,
    pub pid: u32,
    /// The inode of its memory file (see `engine::SegmentKey`).
    pub inode: u64,
    /// The operation's id and the stream position of its first record.
    pub op_id: u64,
    pub first_pos: u64,
}

impl Origin {
    fn encode(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&self.uid.to_le_bytes());
        buf.extend_from_slice(&self.pid.to_le_bytes());
        buf.extend_from_slice(&self.inode.to_le_bytes());
        buf.extend_from_slice(&self.op_id.to_le_bytes());
        buf.extend_from_slice(&self.first_pos.to_le_bytes());
    }

    fn decode(b: &[u8; ORIGIN_LEN]) -> Origin {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Origin {
            uid: u32_at(0),
            pid: u32_at(4),
            inode: u64_at(8),
            op_id: u64_at(16),
            first_pos: u64_at(24),
        }
    }
}

/// A point in a job's spool: file `seq`, byte `offset` in it. Everything the job's spool receives
/// later lies at or after it (in that file past `offset`, or in a file with a larger `seq`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Position {
    pub seq: u64,
    pub offset: u64,
}

/// How much the spool keeps.
#[derive(Clone, Debug)]
pub struct SpoolLimits {
    /// Total bytes on disk over all jobs; past it the uid holding the most loses its oldest file first.
    pub max_bytes: u64,
    /// Bytes of one uid's jobs; past it that uid's oldest files go first.
    pub max_bytes_per_uid: u64,
    /// Files whose last append is older than this are deleted.
    pub max_age: Duration,
    /// A job's file is closed and a new one started past this size (the unit of deletion).
    pub file_bytes: u64,
}

impl Default for SpoolLimits {
    fn default() -> Self {
        SpoolLimits {
            max_bytes: 1 << 30,
            max_bytes_per_uid: 256 << 20,
            max_age: Duration::from_secs(7 * 24 * 3600),
            file_bytes: 16 << 20,
        }
    }
}

/// What [`Spool::open`] found and repaired, and what the bounds removed since.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpoolStats {
    pub bytes: u64,
    pub files: u64,
    /// Bytes cut off torn or corrupt tails when the spool was opened.
    pub truncated_bytes: u64,
    /// Files deleted because the spool was over its size or age bound.
    pub evicted_files: u64,
}

/// One spool file as the index knows it: `len` is the acknowledged (fsynced) length.
#[derive(Clone, Debug)]
struct FileEntry {
    seq: u64,
    path: PathBuf,
    len: u64,
    modified: SystemTime,
}

/// The committed state, shared between the writer and any number of readers.
#[derive(Debug, Default)]
struct Index {
    jobs: BTreeMap<JobKey, Vec<FileEntry>>,
    stats: SpoolStats,
    /// The Slurm jobs each job's processes ran in (its `slurm-<id>` markers).
    slurm: BTreeMap<JobKey, std::collections::BTreeSet<String>>,
    /// What the bounds deleted of each job still spooled (its `dropped` file).
    dropped: BTreeMap<JobKey, Evicted>,
}

/// What the spool's bounds deleted of a job: whole files, the last written at `until_unix_ns`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Evicted {
    pub files: u64,
    pub bytes: u64,
    pub until_unix_ns: u64,
}

/// The name of a job's marker for Slurm job `id`.
const SLURM_MARKER: &str = "slurm-";
/// The name of a job's record of what was deleted of it.
const DROPPED: &str = "dropped";

/// The writer side, owned by the daemon's aggregation task.
pub struct Spool {
    dir: PathBuf,
    limits: SpoolLimits,
    index: Arc<Mutex<Index>>,
    /// The next file's sequence number (shared with [`SpoolIndex`], written only here).
    next_seq: Arc<AtomicU64>,
    /// Open append handle per job (its newest file).
    open: BTreeMap<JobKey, File>,
}

/// Where a spool stands (acknowledged ends, the next file's number, origins read back), readable
/// from any thread while its [`Spool`] appends on another: what the engine asks while the spool
/// writer thread appends (see `spool_writer`).
#[derive(Clone)]
pub struct SpoolIndex {
    index: Arc<Mutex<Index>>,
    next_seq: Arc<AtomicU64>,
}

impl SpoolIndex {
    /// A position at or before where the job's next record will go (its newest file's acknowledged
    /// end, or the start of the next file the spool will create).
    pub fn end(&self, job: &JobKey) -> Position {
        // The next file's number first: a file created meanwhile has it, and a later one a higher.
        let next_seq = self.next_seq.load(Ordering::Acquire);
        match lock(&self.index).jobs.get(job).and_then(|f| f.last()) {
            Some(f) => Position {
                seq: f.seq,
                offset: f.len,
            },
            None => Position {
                seq: next_seq,
                offset: 0,
            },
        }
    }

    /// Origins of the job's records at or after `from` (all of the job's records if `None`), in
    /// append order. Reads what lies between: the caller keeps `from` recent.
    pub fn recorded_since(&self, job: &JobKey, from: Option<Position>) -> io::Result<Vec<Origin>> {
        let from = from.unwrap_or_default();
        let files = lock(&self.index).jobs.get(job).cloned().unwrap_or_default();
        let mut out = Vec::new();
        for entry in files.iter().filter(|f| f.seq >= from.seq) {
            let Some(mut cur) = open_cursor(entry)? else {
                continue;
            };
            let mut at = MAGIC.len() as u64;
            if entry.seq == from.seq && from.offset > at {
                let skip = (from.offset - at).min(cur.remaining);
                cur.reader.seek_relative(skip as i64)?;
                cur.remaining -= skip;
                at += skip;
            }
            while let Some((origin, _, used)) = read_record(&mut cur.reader, cur.remaining)
                .map_err(|e| {
                    io::Error::new(e.kind(), format!("{} at {at}: {e}", entry.path.display()))
                })?
            {
                cur.remaining -= used;
                at += used;
                out.push(origin);
            }
        }
        Ok(out)
    }
}

/// A cheap, cloneable, `Send` handle that reads what the spool has acknowledged, concurrently with
/// appends (the gRPC Export call runs on it).
#[derive(Clone)]
pub struct SpoolReader {
    index: Arc<Mutex<Index>>,
}

impl Spool {
    /// Opens (creating if needed) the spool in `dir`, truncating torn tails left by a crash.
    pub fn open(dir: impl AsRef<Path>, limits: SpoolLimits) -> io::Result<Spool> {
        let dir = dir.as_ref().to_path_buf();
        fs::DirBuilder::new()
            .recursive(true)
            .mode(DIR_MODE)
            .create(&dir)?;
        // Also an existing directory (e.g. from a version that wrote 0644 files under 0755 ones).
        fs::set_permissions(&dir, fs::Permissions::from_mode(DIR_MODE))?;
        let mut index = scan(&dir)?;
        // Only a job's newest file is ever appended to, so only it can have a torn tail; older files are
        // checked by readers (CRC per record).
        for files in index.jobs.values_mut() {
            if let Some(last) = files.last_mut() {
                let valid = repair_tail(&last.path)?;
                index.stats.truncated_bytes += last.len.saturating_sub(valid);
                index.stats.bytes = index.stats.bytes - last.len + valid;
                last.len = valid;
            }
        }
        let next_seq = index
            .jobs
            .values()
            .flatten()
            .map(|f| f.seq + 1)
            .max()
            .unwrap_or(0);
        let mut spool = Spool {
            dir,
            limits,
            index: Arc::new(Mutex::new(index)),
            next_seq: Arc::new(AtomicU64::new(next_seq)),
            open: BTreeMap::new(),
        };
        spool.enforce_limits()?;
        Ok(spool)
    }

    /// Where the spool stands, for another thread while this one appends.
    pub fn index(&self) -> SpoolIndex {
        SpoolIndex {
            index: self.index.clone(),
            next_seq: self.next_seq.clone(),
        }
    }

    pub fn reader(&self) -> SpoolReader {
        SpoolReader {
            index: self.index.clone(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn stats(&self) -> SpoolStats {
        lock(&self.index).stats.clone()
    }

    /// Appends `batch` to the files of the (uid, job) each instance belongs to; durable (fdatasync) when
    /// it returns `Ok`. On an error (full disk, I/O error) nothing of the failing job's part of the batch is kept: the
    /// file is cut back to its last acknowledged length, so the spool stays readable.
    pub fn append(&mut self, batch: &[(Origin, Collective)]) -> io::Result<()> {
        let mut by_job: BTreeMap<(u32, &str), Vec<u8>> = BTreeMap::new();
        let mut slurm: BTreeMap<(u32, &str), std::collections::BTreeSet<&str>> = BTreeMap::new();
        for (origin, c) in batch {
            if !c.slurm_job_id.is_empty() {
                (slurm.entry((c.uid, c.job_id.as_str())).or_default()).insert(&c.slurm_job_id);
            }
            let buf = by_job.entry((c.uid, c.job_id.as_str())).or_default();
            let len = ORIGIN_LEN + c.encoded_len();
            buf.reserve(RECORD_HEADER + len);
            buf.extend_from_slice(&(len as u32).to_le_bytes());
            let at = buf.len();
            buf.extend_from_slice(&[0; 4]);
            let start = buf.len();
            origin.encode(buf);
            c.encode(buf).map_err(io::Error::other)?;
            let crc = crc32fast::hash(&buf[start..]);
            buf[at..start].copy_from_slice(&crc.to_le_bytes());
        }
        let mut result = Ok(());
        for ((uid, job), bytes) in by_job {
            let key = (uid, job.to_string());
            let appended = self.append_job(&key, &bytes).and_then(|()| {
                let ids = slurm.remove(&(uid, job)).unwrap_or_default();
                self.mark_slurm_jobs(&key, ids)
            });
            if let Err(e) = appended {
                result = Err(e);
            }
        }
        self.enforce_limits()?;
        result
    }

    /// See [`SpoolIndex::end`].
    pub fn end(&self, job: &JobKey) -> Position {
        self.index().end(job)
    }

    /// See [`SpoolIndex::recorded_since`].
    pub fn recorded_since(&self, job: &JobKey, from: Option<Position>) -> io::Result<Vec<Origin>> {
        self.index().recorded_since(job, from)
    }

    fn append_job(&mut self, job: &JobKey, bytes: &[u8]) -> io::Result<()> {
        let needs_new = {
            let index = lock(&self.index);
            index
                .jobs
                .get(job)
                .and_then(|f| f.last())
                .is_none_or(|f| f.len >= self.limits.file_bytes)
        };
        if needs_new {
            self.start_file(job)?;
        } else if !self.open.contains_key(job) {
            // The job's newest file from before a restart (or a failed append): continue it.
            let (path, committed) = lock(&self.index).jobs[job]
                .last()
                .map(|f| (f.path.clone(), f.len))
                .expect("job has a file");
            let file = OpenOptions::new().append(true).open(path)?;
            if file.metadata()?.len() != committed {
                // A failed append whose cut-back failed too: cut back now, before anything follows it.
                file.set_len(committed)?;
            }
            self.open.insert(job.clone(), file);
        }
        let committed = lock(&self.index).jobs[job].last().map_or(0, |f| f.len);
        let file = self.open.get_mut(job).expect("opened above");
        let written = file.write_all(bytes).and_then(|()| file.sync_data());
        if let Err(e) = written {
            // Cut back to what was acknowledged, so a later append does not follow garbage.
            let _ = file.set_len(committed);
            self.open.remove(job);
            return Err(e);
        }
        let mut index = lock(&self.index);
        let last = index
            .jobs
            .get_mut(job)
            .and_then(|f| f.last_mut())
            .expect("job has a file");
        last.len += bytes.len() as u64;
        last.modified = SystemTime::now();
        index.stats.bytes += bytes.len() as u64;
        Ok(())
    }

    fn job_dir(&self, job: &JobKey) -> PathBuf {
        self.dir.join(job.0.to_string()).join(escape_job(&job.1))
    }

    /// Marks `job` as run in each Slurm job of `ids` it was not marked with yet.
    fn mark_slurm_jobs<'a>(
        &mut self,
        job: &JobKey,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> io::Result<()> {
        for id in ids {
            if lock(&self.index)
                .slurm
                .get(job)
                .is_some_and(|s| s.contains(id))
            {
                continue;
            }
            let path = self
                .job_dir(job)
                .join(format!("{SLURM_MARKER}{}", escape_job(id)));
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(FILE_MODE)
                .open(&path)?;
            (lock(&self.index).slurm.entry(job.clone()).or_default()).insert(id.to_string());
        }
        Ok(())
    }

    /// Starts a new file for `job` (its first, or after the current one reached `file_bytes`).
    fn start_file(&mut self, job: &JobKey) -> io::Result<()> {
        let uid_dir = self.dir.join(job.0.to_string());
        let job_dir = uid_dir.join(escape_job(&job.1));
        if !job_dir.is_dir() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(DIR_MODE)
                .create(&job_dir)?;
            // The uid's and the job's directory entries must survive a crash too.
            File::open(&self.dir)?.sync_all()?;
            File::open(&uid_dir)?.sync_all()?;
        }
        let seq = self.next_seq.load(Ordering::Relaxed);
        let path = job_dir.join(format!("{seq:016x}.{EXT}"));
        let mut file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .mode(FILE_MODE)
            .open(&path)?;
        if let Err(e) = file.write_all(MAGIC).and_then(|()| file.sync_data()) {
            let _ = fs::remove_file(&path);
            return Err(e);
        }
        // The new directory entry must survive a crash too.
        File::open(&job_dir)?.sync_all()?;
        self.next_seq.store(seq + 1, Ordering::Release);
        self.open.insert(job.clone(), file);
        let mut index = lock(&self.index);
        index.stats.bytes += MAGIC.len() as u64;
        index.stats.files += 1;
        index.jobs.entry(job.clone()).or_default().push(FileEntry {
            seq,
            path,
            len: MAGIC.len() as u64,
            modified: SystemTime::now(),
        });
        Ok(())
    }

    /// Deletes every file whose last append is older than `max_age`, then the oldest files of a uid
    /// over `max_bytes_per_uid`, then, while the spool is over `max_bytes`, the oldest file of the uid
    /// holding the most. Called by every append; call it periodically too so that the age bound
    /// applies to an idle spool.
    pub fn enforce_limits(&mut self) -> io::Result<()> {
        let now = SystemTime::now();
        loop {
            let victim = {
                let index = lock(&self.index);
                let files = index
                    .jobs
                    .iter()
                    .flat_map(|(job, files)| files.iter().map(move |f| (job, f)));
                let expired = |f: &FileEntry| {
                    now.duration_since(f.modified).unwrap_or_default() > self.limits.max_age
                };
                let mut by_uid: BTreeMap<u32, u64> = BTreeMap::new();
                for (job, f) in files.clone() {
                    *by_uid.entry(job.0).or_default() += f.len;
                }
                let over_share = by_uid
                    .iter()
                    .find(|(_, b)| **b > self.limits.max_bytes_per_uid);
                let biggest = by_uid
                    .iter()
                    .max_by_key(|(uid, b)| (**b, std::cmp::Reverse(**uid)));
                let oldest_of = |uid: u32| {
                    files
                        .clone()
                        .filter(|(job, _)| job.0 == uid)
                        .min_by_key(|(_, f)| f.seq)
                        .map(|(job, f)| (job.clone(), f.seq))
                };
                if let Some((job, f)) = files.clone().find(|(_, f)| expired(f)) {
                    Some((job.clone(), f.seq))
                } else if let Some((&uid, _)) = over_share {
                    oldest_of(uid)
                } else if index.stats.bytes > self.limits.max_bytes {
                    biggest.and_then(|(&uid, _)| oldest_of(uid))
                } else {
                    None
                }
            };
            let Some((job, seq)) = victim else {
                return Ok(());
            };
            self.evict(&job, seq)?;
        }
    }

    fn evict(&mut self, job: &JobKey, seq: u64) -> io::Result<()> {
        let entry = {
            let mut index = lock(&self.index);
            let files = index.jobs.get_mut(job).expect("victim exists");
            let pos = files
                .iter()
                .position(|f| f.seq == seq)
                .expect("victim exists");
            let entry = files.remove(pos);
            if pos == files.len() {
                // It was the job's newest file, the one appends go to.
                self.open.remove(job);
            }
            let gone = files.is_empty();
            if gone {
                index.jobs.remove(job);
                index.slurm.remove(job);
                index.dropped.remove(job);
            } else {
                let d = index.dropped.entry(job.clone()).or_default();
                d.files += 1;
                d.bytes += entry.len;
                d.until_unix_ns = d.until_unix_ns.max(unix_ns(entry.modified));
            }
            index.stats.bytes -= entry.len;
            index.stats.files -= 1;
            index.stats.evicted_files += 1;
            entry
        };
        match fs::remove_file(&entry.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let dropped = lock(&self.index).dropped.get(job).copied();
        if let (Some(d), Some(parent)) = (dropped, entry.path.parent()) {
            // Informational: a failure to record it must not fail the append that evicted.
            let text = format!("{} {} {}\n", d.files, d.bytes, d.until_unix_ns);
            let _ = write_small(&parent.join(DROPPED), &text);
        } else if let Some(parent) = entry.path.parent() {
            // The job's last file: its markers go with it.
            for f in fs::read_dir(parent)?.flatten() {
                let name = f.file_name();
                let name = name.to_string_lossy();
                if name.starts_with(SLURM_MARKER) || name == DROPPED {
                    let _ = fs::remove_file(f.path());
                }
            }
        }
        if let Some(parent) = entry.path.parent() {
            // Only succeeds once the job's (then the uid's) directory is empty.
            let _ = fs::remove_dir(parent).and_then(|()| match parent.parent() {
                Some(uid_dir) => fs::remove_dir(uid_dir),
                None => Ok(()),
            });
        }
        Ok(())
    }
}

impl SpoolReader {
    /// Reads a spool directory without a daemon (`ncclscope export --spool DIR`): nothing is repaired;
    /// a torn tail simply ends that file.
    pub fn open_dir(dir: impl AsRef<Path>) -> io::Result<SpoolReader> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no spool directory at {}", dir.display()),
            ));
        }
        Ok(SpoolReader {
            index: Arc::new(Mutex::new(scan(dir)?)),
        })
    }

    /// (uid, job id) of every job with spooled collectives, sorted.
    pub fn jobs(&self) -> Vec<JobKey> {
        lock(&self.index).jobs.keys().cloned().collect()
    }

    /// The spooled job named `job_id`: of `uid` if given, else of the only uid that ran a job of that
    /// name. The error says which exist.
    pub fn find(&self, job_id: &str, uid: Option<u32>) -> Result<JobKey, String> {
        let uids: Vec<u32> = self
            .jobs()
            .into_iter()
            .filter(|(_, j)| j == job_id)
            .map(|(u, _)| u)
            .collect();
        match (uid, uids.as_slice()) {
            (Some(u), _) if uids.contains(&u) => Ok((u, job_id.to_string())),
            (None, [u]) => Ok((*u, job_id.to_string())),
            (None, [_, _, ..]) => Err(format!(
                "job {job_id:?} was run by several uids ({uids:?}); name one"
            )),
            (Some(u), _) => Err(format!("no spooled job {job_id:?} of uid {u}")),
            (None, []) => Err(format!("no spooled job {job_id:?}")),
        }
    }

    /// The Slurm jobs `job`'s processes ran in.
    pub fn slurm_jobs(&self, job: &JobKey) -> Vec<String> {
        (lock(&self.index).slurm.get(job)).map_or_else(Vec::new, |s| s.iter().cloned().collect())
    }

    /// The spooled jobs of `uid` (any uid if None) whose processes ran in Slurm job `id`.
    pub fn in_slurm_job(&self, uid: Option<u32>, id: &str) -> Vec<JobKey> {
        let index = lock(&self.index);
        (index.slurm.iter())
            .filter(|(job, ids)| uid.is_none_or(|u| u == job.0) && ids.contains(id))
            .filter(|(job, _)| index.jobs.contains_key(job))
            .map(|(job, _)| job.clone())
            .collect()
    }

    /// What the spool's bounds deleted of `job` (None: nothing).
    pub fn evicted(&self, job: &JobKey) -> Option<Evicted> {
        lock(&self.index).dropped.get(job).copied()
    }

    /// Bytes the spool holds for `job` (for a progress bar).
    pub fn job_bytes(&self, job: &JobKey) -> u64 {
        lock(&self.index)
            .jobs
            .get(job)
            .map_or(0, |f| f.iter().map(|f| f.len).sum())
    }

    /// The job's collectives, oldest first, as acknowledged when this is called. Blocking file I/O: run
    /// it off the async runtime. A corrupt record yields one error and ends that file.
    pub fn read_job(&self, job: &JobKey) -> JobRecords {
        let files = lock(&self.index).jobs.get(job).cloned().unwrap_or_default();
        JobRecords {
            files: files.into_iter(),
            current: None,
        }
    }
}

/// Iterator over one job's spooled records; owns its snapshot of the index so it outlives the lock.
pub struct JobRecords {
    files: std::vec::IntoIter<FileEntry>,
    current: Option<FileCursor>,
}

struct FileCursor {
    reader: BufReader<File>,
    remaining: u64,
    path: PathBuf,
}

impl Iterator for JobRecords {
    type Item = io::Result<Collective>;

    fn next(&mut self) -> Option<io::Result<Collective>> {
        loop {
            if self.current.is_none() {
                let entry = self.files.next()?;
                match open_cursor(&entry) {
                    Ok(Some(c)) => self.current = Some(c),
                    // Deleted by the age/size bound since the snapshot: it is gone, not an error.
                    Ok(None) => continue,
                    Err(e) => return Some(Err(e)),
                }
            }
            let cur = self.current.as_mut().expect("set above");
            match read_record(&mut cur.reader, cur.remaining) {
                Ok(Some((_, c, used))) => {
                    cur.remaining -= used;
                    return Some(Ok(c));
                }
                Ok(None) => self.current = None,
                Err(e) => {
                    let path = cur.path.display().to_string();
                    self.current = None;
                    return Some(Err(io::Error::new(e.kind(), format!("{path}: {e}"))));
                }
            }
        }
    }
}

fn open_cursor(entry: &FileEntry) -> io::Result<Option<FileCursor>> {
    let mut file = match File::open(&entry.path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut magic = [0; 8];
    file.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: not a spool file", entry.path.display()),
        ));
    };
    Ok(Some(FileCursor {
        reader: BufReader::new(file),
        remaining: entry.len.saturating_sub(MAGIC.len() as u64),
        path: entry.path.clone(),
    }))
}

/// Reads one record within `remaining` bytes: `Ok(None)` at a clean end, an error for a torn or corrupt
/// record. The length field is checked against `remaining` and [`MAX_RECORD`] before anything is
/// allocated.
fn read_record(r: &mut impl Read, remaining: u64) -> io::Result<Option<(Origin, Collective, u64)>> {
    if remaining == 0 {
        return Ok(None);
    }
    let corrupt = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    if remaining < RECORD_HEADER as u64 {
        return Err(corrupt("torn record header"));
    }
    let mut header = [0; RECORD_HEADER];
    r.read_exact(&mut header)?;
    let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(header[4..].try_into().expect("4 bytes"));
    if len > MAX_RECORD || (RECORD_HEADER + len) as u64 > remaining {
        return Err(corrupt("torn or oversized record"));
    }
    let mut payload = vec![0; len];
    r.read_exact(&mut payload)?;
    if crc32fast::hash(&payload) != crc {
        return Err(corrupt("record CRC mismatch"));
    }
    let Some((origin, body)) = payload.split_first_chunk::<ORIGIN_LEN>() else {
        return Err(corrupt("record shorter than its origin"));
    };
    let origin = Origin::decode(origin);
    let c = Collective::decode(body).map_err(|e| corrupt(&format!("bad record: {e}")))?;
    Ok(Some((origin, c, (RECORD_HEADER + len) as u64)))
}

/// Finds the length of the valid prefix of a spool file and truncates it there (fsynced).
fn repair_tail(path: &Path) -> io::Result<u64> {
    let mut file = OpenOptions::new().read(true).write(true).open(path)?;
    let size = file.metadata()?.len();
    let mut magic = [0; 8];
    if size >= MAGIC.len() as u64 {
        file.read_exact(&mut magic)?;
    }
    if &magic != MAGIC {
        // Its creation was torn (the daemon died before the magic was synced): make it empty and valid.
        file.set_len(0)?;
        file.seek(SeekFrom::Start(0))?;
        file.write_all(MAGIC)?;
        file.sync_data()?;
        return Ok(MAGIC.len() as u64);
    }
    let mut reader = BufReader::new(&mut file);
    let mut valid = MAGIC.len() as u64;
    while let Ok(Some((_, _, used))) = read_record(&mut reader, size - valid) {
        valid += used;
    }
    if valid < size {
        file.set_len(valid)?;
        file.sync_data()?;
    }
    Ok(valid)
}

/// Builds the index from the directory tree (file lengths as found; the caller repairs tails).
/// Anything but `<uid>/<job>/<seq>.spool` (e.g. the uid-less layout of earlier versions) is ignored.
fn scan(dir: &Path) -> io::Result<Index> {
    let mut index = Index::default();
    for uid_dir in fs::read_dir(dir)? {
        let uid_dir = uid_dir?;
        let Some(uid) = uid_dir
            .file_name()
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if uid_dir.file_type()?.is_dir() {
            scan_uid(&uid_dir.path(), uid, &mut index)?;
        }
    }
    Ok(index)
}

fn scan_uid(dir: &Path, uid: u32, index: &mut Index) -> io::Result<()> {
    for job_dir in fs::read_dir(dir)? {
        let job_dir = job_dir?;
        if !job_dir.file_type()?.is_dir() {
            continue;
        }
        let Some(job) = job_dir.file_name().to_str().and_then(unescape_job) else {
            continue;
        };
        let mut files = Vec::new();
        let mut slurm = std::collections::BTreeSet::new();
        let mut dropped = None;
        for f in fs::read_dir(job_dir.path())? {
            let f = f?;
            let path = f.path();
            let name = f.file_name();
            let name = name.to_string_lossy();
            if let Some(id) = name.strip_prefix(SLURM_MARKER).and_then(unescape_job) {
                slurm.insert(id);
                continue;
            }
            if name == DROPPED {
                dropped = parse_dropped(&fs::read_to_string(&path).unwrap_or_default());
                continue;
            }
            let Some(seq) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(&format!(".{EXT}")))
                .and_then(|s| u64::from_str_radix(s, 16).ok())
            else {
                continue;
            };
            let meta = f.metadata()?;
            files.push(FileEntry {
                seq,
                path,
                len: meta.len(),
                modified: meta.modified()?,
            });
        }
        if files.is_empty() {
            continue;
        }
        files.sort_by_key(|f| f.seq);
        index.stats.files += files.len() as u64;
        index.stats.bytes += files.iter().map(|f| f.len).sum::<u64>();
        if !slurm.is_empty() {
            index.slurm.insert((uid, job.clone()), slurm);
        }
        if let Some(d) = dropped {
            index.dropped.insert((uid, job.clone()), d);
        }
        index.jobs.insert((uid, job), files);
    }
    Ok(())
}

/// `files bytes until_unix_ns`, as [`Spool::evict`] writes it.
fn parse_dropped(text: &str) -> Option<Evicted> {
    let mut n = text.split_whitespace().map(str::parse::<u64>);
    Some(Evicted {
        files: n.next()?.ok()?,
        bytes: n.next()?.ok()?,
        until_unix_ns: n.next()?.ok()?,
    })
}

/// Replaces a small file (under a temporary name, renamed into place).
fn write_small(path: &Path, text: &str) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(FILE_MODE)
        .open(&tmp)?;
    f.write_all(text.as_bytes())?;
    fs::rename(&tmp, path)
}

fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A job id as a directory name: any byte outside `[A-Za-z0-9._-]` (and a leading '.') as `%XX`.
fn escape_job(job: &str) -> String {
    let mut out = String::with_capacity(job.len());
    for (i, b) in job.bytes().enumerate() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && i > 0) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.is_empty() {
        out.push('%');
    }
    out
}

fn unescape_job(name: &str) -> Option<String> {
    if name == "%" {
        return Some(String::new());
    }
    let bytes = name.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = name.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn lock(index: &Mutex<Index>) -> std::sync::MutexGuard<'_, Index> {
    index.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coll(job: &str, rank: u32, seq: u64) -> Collective {
        Collective {
            job_id: job.into(),
            rank,
            seq,
            func: "AllReduce".into(),
            bytes: 1 << 20,
            channels: vec![Default::default(); 4],
            ..Default::default()
        }
    }

    fn rec(job: &str, rank: u32, seq: u64) -> (Origin, Collective) {
        (Origin::default(), coll(job, rank, seq))
    }

    fn read_all(r: &SpoolReader, job: &str) -> Vec<Collective> {
        r.read_job(&key(job)).collect::<io::Result<_>>().unwrap()
    }

    /// The job `job` of uid 0 (what [`coll`] builds).
    fn key(job: &str) -> JobKey {
        (0, job.to_string())
    }

    #[test]
    fn appends_read_back_in_order_per_job_and_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), SpoolLimits::default()).unwrap();
        let batch: Vec<_> = (0..10)
            .map(|i| rec(if i % 2 == 0 { "a" } else { "b/c d" }, i, i as u64))
            .collect();
        spool.append(&batch).unwrap();
        spool.append(&[rec("a", 0, 100)]).unwrap();
        let seqs = |v: Vec<Collective>| v.iter().map(|c| c.seq).collect::<Vec<_>>();
        assert_eq!(seqs(read_all(&spool.reader(), "a")), [0, 2, 4, 6, 8, 100]);
        assert_eq!(seqs(read_all(&spool.reader(), "b/c d")), [1, 3, 5, 7, 9]);
        assert_eq!(spool.reader().jobs(), [key("a"), key("b/c d")]);
        drop(spool);

        let mut spool = Spool::open(dir.path(), SpoolLimits::default()).unwrap();
        spool.append(&[rec("a", 0, 101)]).unwrap();
        assert_eq!(
            seqs(read_all(&spool.reader(), "a")),
            [0, 2, 4, 6, 8, 100, 101]
        );
        assert_eq!(
            read_all(&SpoolReader::open_dir(dir.path()).unwrap(), "b/c d").len(),
            5
        );
        assert_eq!(spool.stats().truncated_bytes, 0);
    }

    #[test]
    fn torn_tail_is_truncated_on_open_and_appends_continue_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), SpoolLimits::default()).unwrap();
        spool.append(&[rec("j", 0, 1), rec("j", 0, 2)]).unwrap();
        let path = lock(&spool.index).jobs[&key("j")][0].path.clone();
        drop(spool);
        // A crash mid-append: half a record header and payload after the acknowledged records.
        let good = fs::metadata(&path).unwrap().len();
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[200, 0, 0, 0, 1, 2, 3, 4, 5]).unwrap();
        drop(f);

        let mut spool = Spool::open(dir.path(), SpoolLimits::default()).unwrap();
        assert_eq!(spool.stats().truncated_bytes, 9);
        assert_eq!(fs::metadata(&path).unwrap().len(), good);
        spool.append(&[rec("j", 0, 3)]).unwrap();
        let seqs: Vec<_> = read_all(&spool.reader(), "j")
            .iter()
            .map(|c| c.seq)
            .collect();
        assert_eq!(seqs, [1, 2, 3]);
    }

    #[test]
    fn a_file_whose_creation_was_torn_is_made_valid_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), SpoolLimits::default()).unwrap();
        spool.append(&[rec("j", 0, 1)]).unwrap();
        drop(spool);
        // A crash right after creating the job's next file: it exists, empty.
        let torn = dir
            .path()
            .join("0")
            .join("j")
            .join(format!("{:016x}.{EXT}", 99));
        File::create(&torn).unwrap();
        let mut spool = Spool::open(dir.path(), SpoolLimits::default()).unwrap();
        assert_eq!(fs::metadata(&torn).unwrap().len(), MAGIC.len() as u64);
        spool.append(&[rec("j", 0, 2)]).unwrap();
        let seqs: Vec<_> = read_all(&spool.reader(), "j")
            .iter()
            .map(|c| c.seq)
            .collect();
        assert_eq!(seqs, [1, 2]);
        let on_disk: u64 = walk(dir.path())
            .iter()
            .map(|p| fs::metadata(p).unwrap().len())
            .sum();
        assert_eq!(on_disk, spool.stats().bytes);
    }

    #[test]
    fn corrupt_record_is_an_error_not_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), SpoolLimits::default()).unwrap();
        spool.append(&[rec("j", 0, 1), rec("j", 0, 2)]).unwrap();
        let path = lock(&spool.index).jobs[&key("j")][0].path.clone();
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        fs::write(&path, bytes).unwrap();
        let got: Vec<_> = spool.reader().read_job(&key("j")).collect();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].as_ref().unwrap().seq, 1);
        assert!(
            got[1].as_ref().unwrap_err().to_string().contains("CRC"),
            "{:?}",
            got[1]
        );
    }

    #[test]
    fn oldest_files_go_first_past_the_size_bound() {
        let dir = tempfile::tempdir().unwrap();
        let one = (RECORD_HEADER + ORIGIN_LEN + coll("j", 0, 0).encoded_len()) as u64;
        let limits = SpoolLimits {
            max_bytes: 20 * one,
            max_bytes_per_uid: 20 * one,
            max_age: Duration::from_secs(3600),
            file_bytes: 4 * one,
        };
        let mut spool = Spool::open(dir.path(), limits.clone()).unwrap();
        for seq in 0..100 {
            spool.append(&[rec("old", 0, seq)]).unwrap();
        }
        for seq in 0..10 {
            spool.append(&[rec("new", 0, seq)]).unwrap();
        }
        let stats = spool.stats();
        assert!(stats.bytes <= limits.max_bytes, "{stats:?}");
        assert!(stats.evicted_files > 0);
        // Everything of the newest job is kept; the old job lost its oldest records, not its newest.
        assert_eq!(read_all(&spool.reader(), "new").len(), 10);
        let old: Vec<_> = read_all(&spool.reader(), "old")
            .iter()
            .map(|c| c.seq)
            .collect();
        assert!(
            !old.is_empty() && old[0] > 0 && *old.last().unwrap() == 99,
            "{old:?}"
        );
        assert!(old.windows(2).all(|w| w[1] == w[0] + 1));
        // Bytes on disk agree with the accounting.
        let on_disk: u64 = walk(dir.path())
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == EXT))
            .map(|p| fs::metadata(p).unwrap().len())
            .sum();
        assert_eq!(on_disk, stats.bytes);
    }

    /// Issue 38: the Slurm Epilog finds a job by the Slurm job its processes ran in, and says what
    /// the bounds had deleted of it; both survive a restart and go with the job's last file.
    #[test]
    fn a_job_remembers_its_slurm_jobs_and_what_the_bounds_deleted_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let one = (RECORD_HEADER + ORIGIN_LEN + coll("j", 0, 0).encoded_len()) as u64 + 8;
        let limits = SpoolLimits {
            max_bytes: 20 * one,
            max_bytes_per_uid: 20 * one,
            max_age: Duration::from_secs(3600),
            file_bytes: 4 * one,
        };
        let in_slurm = |job: &str, seq: u64, slurm: &str| {
            let (o, c) = rec(job, 0, seq);
            (
                o,
                Collective {
                    slurm_job_id: slurm.into(),
                    ..c
                },
            )
        };
        let mut spool = Spool::open(dir.path(), limits.clone()).unwrap();
        spool
            .append(&[in_slurm("mine", 0, "42"), in_slurm("other", 0, "43")])
            .unwrap();
        spool
            .append(&[in_slurm("mine", 1, "42"), rec("plain", 0, 0)])
            .unwrap();
        let r = spool.reader();
        assert_eq!(r.in_slurm_job(Some(0), "42"), [key("mine")]);
        assert_eq!(r.in_slurm_job(Some(1), "42"), []);
        assert_eq!(r.slurm_jobs(&key("other")), ["43"]);
        assert_eq!(r.evicted(&key("mine")), None);
        for seq in 2..60 {
            spool.append(&[in_slurm("mine", seq, "42")]).unwrap();
        }
        let d = spool
            .reader()
            .evicted(&key("mine"))
            .expect("old files of it deleted");
        assert!(d.files > 0 && d.bytes > 0 && d.until_unix_ns > 0, "{d:?}");
        drop(spool);
        let spool = Spool::open(dir.path(), limits).unwrap();
        let r = spool.reader();
        assert_eq!(r.in_slurm_job(None, "42"), [key("mine")]);
        assert_eq!(r.evicted(&key("mine")), Some(d));
        // "other" and "plain" were deleted whole: nothing of them is left, markers included.
        assert_eq!(r.in_slurm_job(None, "43"), []);
        assert!(!dir.path().join("0/other").exists());
        assert_eq!(
            SpoolReader::open_dir(dir.path())
                .unwrap()
                .in_slurm_job(None, "42"),
            [key("mine")]
        );
    }

    #[test]
    fn files_past_the_age_bound_are_deleted_with_their_job() {
        let dir = tempfile::tempdir().unwrap();
        let limits = SpoolLimits {
            max_age: Duration::from_millis(50),
            ..Default::default()
        };
        let mut spool = Spool::open(dir.path(), limits).unwrap();
        spool.append(&[rec("j", 0, 1)]).unwrap();
        std::thread::sleep(Duration::from_millis(120));
        spool.enforce_limits().unwrap();
        assert!(spool.reader().jobs().is_empty());
        assert!(walk(dir.path()).is_empty());
        // The job starts a fresh file afterwards.
        spool.append(&[rec("j", 0, 2)]).unwrap();
        assert_eq!(read_all(&spool.reader(), "j").len(), 1);
    }

    #[test]
    fn a_reader_snapshot_ignores_later_appends_and_survives_eviction() {
        let dir = tempfile::tempdir().unwrap();
        let one = (RECORD_HEADER + ORIGIN_LEN + coll("j", 0, 0).encoded_len()) as u64;
        let limits = SpoolLimits {
            max_bytes: 1 << 30,
            max_bytes_per_uid: 1 << 30,
            max_age: Duration::from_secs(3600),
            file_bytes: 2 * one,
        };
        let mut spool = Spool::open(dir.path(), limits).unwrap();
        for seq in 0..6 {
            spool.append(&[rec("j", 0, seq)]).unwrap();
        }
        let mut it = spool.reader().read_job(&key("j"));
        assert_eq!(it.next().unwrap().unwrap().seq, 0);
        spool.append(&[rec("j", 0, 6)]).unwrap();
        spool.limits.max_bytes = 0;
        spool.enforce_limits().unwrap();
        // The open file is read to its end; the deleted ones are skipped; the later append is not seen.
        let rest: Vec<_> = it.map(|c| c.unwrap().seq).collect();
        assert_eq!(rest, [1]);
    }

    #[test]
    fn a_full_disk_is_an_error_that_keeps_the_spool_consistent() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), SpoolLimits::default()).unwrap();
        spool.append(&[rec("j", 0, 1)]).unwrap();
        let before = spool.stats();
        // The job's file now sits on a full device: every write fails with ENOSPC.
        let full = OpenOptions::new().append(true).open("/dev/full").unwrap();
        spool.open.insert(key("j"), full);
        let err = spool.append(&[rec("j", 0, 2), rec("j", 0, 3)]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::StorageFull, "{err}");
        assert_eq!(spool.stats(), before, "nothing unacknowledged is accounted");
        // The disk has room again: the next append goes to the job's real file, after what was kept.
        spool.append(&[rec("j", 0, 4)]).unwrap();
        let seqs: Vec<_> = read_all(&spool.reader(), "j")
            .iter()
            .map(|c| c.seq)
            .collect();
        assert_eq!(seqs, [1, 4]);
    }

    #[test]
    fn origins_are_read_back_from_a_position_on() {
        let dir = tempfile::tempdir().unwrap();
        let one = (RECORD_HEADER + ORIGIN_LEN + coll("j", 0, 0).encoded_len()) as u64;
        let limits = SpoolLimits {
            file_bytes: 3 * one,
            ..Default::default()
        };
        let mut spool = Spool::open(dir.path(), limits.clone()).unwrap();
        let start = spool.end(&key("j"));
        let from = |op_id| Origin {
            uid: 1,
            pid: 2,
            inode: 3,
            op_id,
            first_pos: op_id * 10,
        };
        let mut mark = None;
        for op in 0..8 {
            if op == 4 {
                mark = Some(spool.end(&key("j")));
            }
            spool.append(&[(from(op), coll("j", 0, op))]).unwrap();
            spool.append(&[(from(op), coll("other", 0, op))]).unwrap();
        }
        let ops = |v: Vec<Origin>| v.iter().map(|o| o.op_id).collect::<Vec<_>>();
        assert_eq!(
            ops(spool.recorded_since(&key("j"), None).unwrap()),
            (0..8).collect::<Vec<_>>()
        );
        assert_eq!(
            ops(spool.recorded_since(&key("j"), Some(start)).unwrap()),
            (0..8).collect::<Vec<_>>()
        );
        // The mark sits in the middle of the job's second file; the rest spans two files.
        assert_eq!(
            ops(spool.recorded_since(&key("j"), mark).unwrap()),
            [4, 5, 6, 7]
        );
        assert_eq!(spool.recorded_since(&key("j"), mark).unwrap()[0], from(4));
        assert_eq!(
            spool
                .recorded_since(&key("j"), Some(spool.end(&key("j"))))
                .unwrap(),
            []
        );
        // After a restart (a reopened spool) the same.
        drop(spool);
        let spool = Spool::open(dir.path(), limits).unwrap();
        assert_eq!(
            ops(spool.recorded_since(&key("j"), mark).unwrap()),
            [4, 5, 6, 7]
        );
    }

    #[test]
    fn uids_get_their_own_private_directories_and_shares() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let one = (RECORD_HEADER + ORIGIN_LEN + coll("j", 0, 0).encoded_len()) as u64;
        let limits = SpoolLimits {
            max_bytes: 40 * one,
            max_bytes_per_uid: 24 * one,
            max_age: Duration::from_secs(3600),
            file_bytes: 4 * one,
        };
        let mut spool = Spool::open(dir.path().join("spool"), limits).unwrap();
        let of = |uid, seq| Collective {
            uid,
            ..coll("j", 0, seq)
        };
        // Two users, one job id: two jobs, in two directories.
        for seq in 0..10 {
            spool
                .append(&[(Origin::default(), of(61001, seq))])
                .unwrap();
        }
        spool
            .append(&[(Origin::default(), of(61002, 100))])
            .unwrap();
        let r = spool.reader();
        assert_eq!(r.jobs(), [(61001, "j".into()), (61002, "j".into())]);
        let seqs = |uid| {
            r.read_job(&(uid, "j".into()))
                .map(|c| c.unwrap().seq)
                .collect::<Vec<_>>()
        };
        assert_eq!(seqs(61002), [100]);
        assert_eq!(seqs(61001), (0..10).collect::<Vec<_>>());
        assert_eq!(r.find("j", Some(61002)), Ok((61002, "j".into())));
        assert!(r.find("j", None).unwrap_err().contains("several uids"));
        // Modes are explicit, whatever the umask.
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(spool.dir()), 0o700);
        for uid in ["61001", "61002"] {
            assert_eq!(mode(&spool.dir().join(uid)), 0o700);
            assert_eq!(mode(&spool.dir().join(uid).join("j")), 0o700);
        }
        let files = walk(spool.dir());
        assert!(!files.is_empty());
        for f in &files {
            assert_eq!(mode(f), 0o600, "{}", f.display());
        }
        // uid 61002 writes far more than its share: it loses its own oldest, never 61001's.
        for seq in 0..200 {
            spool
                .append(&[(Origin::default(), of(61002, 1000 + seq))])
                .unwrap();
        }
        assert_eq!(seqs(61001), (0..10).collect::<Vec<_>>());
        let theirs = seqs(61002);
        assert_eq!(*theirs.last().unwrap(), 1199);
        assert!(theirs.len() as u64 <= 24, "{}", theirs.len());
        // Over the total, the uid holding the most gives up its oldest first.
        spool.limits.max_bytes = spool.stats().bytes - 1;
        spool.enforce_limits().unwrap();
        assert_eq!(seqs(61001), (0..10).collect::<Vec<_>>());
        assert_eq!(seqs(61002), theirs[4..], "one file of four records");
    }

    #[test]
    fn job_ids_round_trip_through_directory_names() {
        for job in ["", "a", ".hidden", "x/../y", "pod-1_2.3", "ünï %41"] {
            let name = escape_job(job);
            assert!(
                !name.contains('/') && !name.starts_with('.') && !name.is_empty(),
                "{name}"
            );
            assert_eq!(unescape_job(&name).as_deref(), Some(job));
        }
    }

    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.extend(walk(&p))
            } else {
                out.push(p)
            }
        }
        out
    }
}
