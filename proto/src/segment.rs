//! The per-process shared-memory segment: a header and a single-producer single-consumer ring of
//! [`Record`]s. The plugin creates and fills it; the daemon maps it, validates it and drains it.
//!
//! Everything in the segment is a 64-bit word accessed atomically, so a hostile or crashed peer can
//! give us wrong values but never undefined behaviour. Layout, in words:
//!
//! | words | contents |
//! |---|---|
//! | 0..64 | header: magic, version, sizes, identity, flags, heartbeat, hostname, job id, counters |
//! | 64..80 | producer line: `head` (records ever published) |
//! | 80..96 | consumer line: `tail` (records ever consumed); lives here so a restarted daemon resumes |
//! | 96.. | `capacity` records of [`RECORD_WORDS`] words |
//!
//! The producer never blocks: when the ring is full the record is dropped and [`Counter::RingFull`]
//! counts it. The consumer commits `tail` only after it has dealt with what it read.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use memmap2::{MmapMut, MmapOptions};
use rustix::fs::Mode;
use rustix::shm;

use crate::record::{DecodeError, RECORD_WORDS, Record};

const MAGIC: u64 = u64::from_le_bytes(*b"NCCLSCP\0");
/// Bumped whenever the layout or a record's encoding changes.
pub const LAYOUT_VERSION: u32 = 1;

const W_MAGIC: usize = 0;
const W_VERSION: usize = 1; // version | record bytes << 32
const W_CAPACITY: usize = 2;
const W_LAYOUT_HASH: usize = 3;
const W_PID_UID: usize = 4;
const W_PROC_START: usize = 5;
const W_CREATED_NS: usize = 6;
const W_FLAGS: usize = 7;
const W_HEARTBEAT_NS: usize = 8;
const W_HOSTNAME: usize = 16;
const W_JOB_ID: usize = 24;
const TEXT_WORDS: usize = 8;
const W_COUNTERS: usize = 32;
const N_COUNTERS: usize = 16;
const W_HEAD: usize = 64;
const W_TAIL: usize = 80;
const W_RECORDS: usize = 96;

/// Largest ring a reader accepts (records); bounds what an untrusted header can make us map.
pub const MAX_CAPACITY: u64 = 1 << 24;
/// Default ring size: 256 Ki records = 16 MiB. Sized from CUDA-graph replays on the device-hook path:
/// a replay writes (operations x channels) records at once (50 x 64 = 3,200 for 250 us of GPU time,
/// 12.8 M records/s while it replays), and the ring must hold what arrives while the daemon is off the
/// CPU; 64 Ki records lost a quarter of them on a loaded 2-core host where 256 Ki lost none
/// (docs/benchmarks.md, "CUDA graph replays").
pub const DEFAULT_CAPACITY: u64 = 1 << 18;

const FLAG_CLOSED: u64 = 1;

const fn layout_hash() -> u64 {
    let parts = [
        LAYOUT_VERSION as u64,
        RECORD_WORDS as u64,
        W_HOSTNAME as u64,
        W_JOB_ID as u64,
        TEXT_WORDS as u64,
        W_COUNTERS as u64,
        N_COUNTERS as u64,
        W_HEAD as u64,
        W_TAIL as u64,
        W_RECORDS as u64,
    ];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < parts.len() {
        h ^= parts[i];
        h = h.wrapping_mul(0x100_0000_01b3);
        i += 1;
    }
    h
}

/// What the plugin counts instead of delivering. Every event NCCL or the device hook produced is either
/// in a record or in one of these counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Counter {
    /// Records dropped because the segment ring was full (daemon absent or slow).
    RingFull = 0,
    /// Events dropped because the plugin's internal queue to its forwarding thread was full.
    QueueFull = 1,
    /// Events declined because the bounded handle pool was exhausted.
    PoolExhausted = 2,
    /// Device-hook events overwritten in a ring before the drain thread read them (sequence gaps).
    DevLost = 3,
    /// Device-hook START or STOP events that never found their other half.
    DevUnpaired = 4,
    /// KernelCh / KernelPhase events started but never stopped when their communicator was finalized.
    Unfinished = 5,
    /// Strings that could not be interned (table full); records refer to them as "no string".
    StrTableFull = 6,
    /// Event types or states the plugin does not handle, declined (not a loss; for visibility).
    Ignored = 7,
    /// The forwarding thread panicked and the plugin latched itself off for the process: the events it
    /// was handling (counted as one) and those queued for it, lost; nothing is recorded after it.
    ForwardPanic = 8,
    /// KernelCh events of a CUDA graph replay on stock NCCL: they name an operation from capture time,
    /// which has no kernel of its own, so they are declined rather than joined to a stale handle.
    ReplayKernelCh = 9,
}

impl Counter {
    pub const ALL: [Counter; 10] = [
        Counter::RingFull,
        Counter::QueueFull,
        Counter::PoolExhausted,
        Counter::DevLost,
        Counter::DevUnpaired,
        Counter::Unfinished,
        Counter::StrTableFull,
        Counter::Ignored,
        Counter::ForwardPanic,
        Counter::ReplayKernelCh,
    ];

    /// Stable name, used in metrics labels and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Counter::RingFull => "ring_full",
            Counter::QueueFull => "queue_full",
            Counter::PoolExhausted => "pool_exhausted",
            Counter::DevLost => "dev_lost",
            Counter::DevUnpaired => "dev_unpaired",
            Counter::Unfinished => "unfinished",
            Counter::StrTableFull => "str_table_full",
            Counter::ReplayKernelCh => "replay_kernel_ch",
            Counter::Ignored => "ignored",
            Counter::ForwardPanic => "forward_panic",
        }
    }

    /// Whether the counter stands for events that were lost (as opposed to merely ignored).
    pub fn is_loss(self) -> bool {
        !matches!(self, Counter::Ignored | Counter::StrTableFull)
    }
}
const _: () = assert!(Counter::ALL.len() <= N_COUNTERS);

/// Identity of the process that owns a segment, written once at creation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub pid: u32,
    pub uid: u32,
    /// Process start time in clock ticks since boot (/proc/PID/stat field 22): tells a reused pid apart.
    pub start_ticks: u64,
    pub hostname: String,
    pub job_id: String,
}

/// Why a segment could not be created, opened or read.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    #[error("shared memory {name}: {source}")]
    Io { name: String, source: io::Error },
    #[error("segment {name} is not initialised yet")]
    NotReady { name: String },
    #[error("segment {name} is invalid: {reason}")]
    Invalid { name: String, reason: String },
    /// Its owner shrank the shared memory object under the mapping; what was read is void.
    #[error("segment {name} was truncated by its owner while mapped (SIGBUS caught)")]
    Truncated { name: String },
}

/// A name under /dev/shm: `<prefix>.<uid>.<pid>.<start_ticks>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SegmentName {
    pub prefix: String,
    pub uid: u32,
    pub pid: u32,
    pub start_ticks: u64,
}

/// Default segment name prefix; tests and side-by-side installations use their own
/// (`NCCLSCOPE_SHM_PREFIX` in the plugin, `shm_prefix` in the daemon).
pub const DEFAULT_PREFIX: &str = "ncclscope";
/// Where Linux exposes POSIX shared memory objects, for scanning.
pub const SHM_DIR: &str = "/dev/shm";

impl SegmentName {
    pub fn parse(file_name: &str) -> Option<SegmentName> {
        let mut it = file_name.rsplitn(4, '.');
        let start_ticks = it.next()?.parse().ok()?;
        let pid = it.next()?.parse().ok()?;
        let uid = it.next()?.parse().ok()?;
        let prefix = it.next()?.to_string();
        if prefix.is_empty() || prefix.contains('/') {
            return None;
        }
        Some(SegmentName {
            prefix,
            uid,
            pid,
            start_ticks,
        })
    }
}

impl Owner {
    /// Process `pid`, run by this process's user, as the owner of a segment (start time read now;
    /// 0 if /proc does not have it).
    pub fn of_process(pid: u32, hostname: String, job_id: String) -> Owner {
        Owner {
            pid,
            uid: rustix::process::getuid().as_raw(),
            start_ticks: process_start_ticks(pid).unwrap_or(0),
            hostname,
            job_id,
        }
    }

    /// The name of this owner's segment under `prefix`.
    pub fn segment_name(&self, prefix: &str) -> SegmentName {
        SegmentName {
            prefix: prefix.into(),
            uid: self.uid,
            pid: self.pid,
            start_ticks: self.start_ticks,
        }
    }
}

impl std::fmt::Display for SegmentName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}.{}.{}.{}",
            self.prefix, self.uid, self.pid, self.start_ticks
        )
    }
}

/// The segments with `prefix` that exist now, for recovery after a daemon restart.
pub fn list(prefix: &str) -> io::Result<Vec<SegmentName>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(SHM_DIR)? {
        let name = entry?.file_name();
        if let Some(n) = name.to_str().and_then(SegmentName::parse)
            && n.prefix == prefix
        {
            out.push(n);
        }
    }
    Ok(out)
}

/// Start time of `pid` in clock ticks since boot, or None if no such process exists.
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: count fields after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process that created a segment named `name` is still running.
pub fn owner_alive(name: &SegmentName) -> bool {
    process_start_ticks(name.pid) == Some(name.start_ticks)
}

/// A mapped segment. Both sides hold one; [`Producer`] and [`Consumer`] add the ring discipline.
pub struct Segment {
    map: MmapMut,
    name: String,
    capacity: u64,
    /// Uid that owns the shared memory object (from fstat), to check against the registering peer.
    file_uid: u32,
    /// This mapping's slot in the SIGBUS guard table (segments opened by a reader).
    guard: Option<usize>,
}

impl Drop for Segment {
    fn drop(&mut self) {
        // Before the mapping goes (fields drop after this): the handler must not touch a freed range.
        if let Some(slot) = self.guard {
            fault_guard::unwatch(slot);
        }
    }
}

fn shm_path(name: &str) -> String {
    format!("/{name}")
}

fn segment_bytes(capacity: u64) -> u64 {
    ((W_RECORDS as u64) + capacity * RECORD_WORDS as u64) * 8
}

fn put_text(words: &[AtomicU64], at: usize, text: &str) {
    let mut bytes = [0u8; TEXT_WORDS * 8];
    let mut n = text.len().min(bytes.len());
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    bytes[..n].copy_from_slice(&text.as_bytes()[..n]);
    for (i, chunk) in bytes.chunks_exact(8).enumerate() {
        words[at + i].store(
            u64::from_le_bytes(chunk.try_into().expect("8-byte chunk")),
            Ordering::Relaxed,
        );
    }
}

fn get_text(words: &[AtomicU64], at: usize) -> String {
    let bytes: Vec<u8> = (0..TEXT_WORDS)
        .flat_map(|i| words[at + i].load(Ordering::Relaxed).to_le_bytes())
        .collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

impl Segment {
    /// Creates `name` (mode 0600, O_EXCL: never reuses an existing object) with room for `capacity`
    /// records, a power of two.
    pub fn create(
        name: &SegmentName,
        owner: &Owner,
        capacity: u64,
    ) -> Result<Segment, SegmentError> {
        let name_s = name.to_string();
        let io_err = |source| SegmentError::Io {
            name: name_s.clone(),
            source,
        };
        if !capacity.is_power_of_two() || capacity > MAX_CAPACITY {
            return Err(SegmentError::Invalid {
                name: name_s,
                reason: format!("capacity {capacity}"),
            });
        }
        let fd = shm::open(
            shm_path(&name_s).as_str(),
            shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io_err(e.into()))?;
        let file = File::from(fd);
        let len = segment_bytes(capacity);
        // Reserve the pages now: a tmpfs that fills up later would otherwise kill the writer with SIGBUS
        // on its first store to an unbacked page; this way a full /dev/shm is an error here instead.
        let reserved = file.set_len(len).and_then(|_| {
            rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, len)
                .map_err(io::Error::from)
        });
        let mapped = reserved.and_then(|_| {
            // SAFETY: the object was just created with O_EXCL and sized to `len`; nobody else has
            // mapped it yet, and every later access goes through atomics (see `words`).
            unsafe { MmapOptions::new().len(len as usize).map_mut(&file) }
        });
        let map = match mapped {
            Ok(m) => m,
            Err(e) => {
                let _ = shm::unlink(shm_path(&name_s).as_str());
                return Err(io_err(e));
            }
        };
        let seg = Segment {
            map,
            name: name_s,
            capacity,
            file_uid: owner.uid,
            guard: None,
        };
        let w = seg.words();
        w[W_VERSION].store(
            LAYOUT_VERSION as u64 | ((RECORD_WORDS as u64 * 8) << 32),
            Ordering::Relaxed,
        );
        w[W_CAPACITY].store(capacity, Ordering::Relaxed);
        w[W_LAYOUT_HASH].store(layout_hash(), Ordering::Relaxed);
        w[W_PID_UID].store(
            owner.pid as u64 | (owner.uid as u64) << 32,
            Ordering::Relaxed,
        );
        w[W_PROC_START].store(owner.start_ticks, Ordering::Relaxed);
        w[W_CREATED_NS].store(crate::now_ns(), Ordering::Relaxed);
        put_text(w, W_HOSTNAME, &owner.hostname);
        put_text(w, W_JOB_ID, &owner.job_id);
        // Publish: a reader that sees the magic sees every field above.
        w[W_MAGIC].store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Maps an existing segment and validates its header. The contents are untrusted.
    pub fn open(name: &SegmentName) -> Result<Segment, SegmentError> {
        let name_s = name.to_string();
        let io_err = |source| SegmentError::Io {
            name: name_s.clone(),
            source,
        };
        let invalid = |reason: String| SegmentError::Invalid {
            name: name_s.clone(),
            reason,
        };
        let fd: OwnedFd = shm::open(shm_path(&name_s).as_str(), shm::OFlags::RDWR, Mode::empty())
            .map_err(|e| io_err(e.into()))?;
        let stat = rustix::fs::fstat(&fd).map_err(|e| io_err(e.into()))?;
        let file = File::from(fd);
        let len = stat.st_size as u64;
        if len < segment_bytes(1) || len > segment_bytes(MAX_CAPACITY) || !len.is_multiple_of(8) {
            return Err(invalid(format!("size {len}")));
        }
        // SAFETY: the mapping's length is the object's current size; all access goes through atomics
        // (see `words`), and `len` is re-checked against the header below before any record is read.
        // A peer that shrinks the object under us makes accesses fault (SIGBUS): the mapping is
        // watched below, and a process that installed [`install_fault_guard`] survives that.
        let map = unsafe { MmapOptions::new().len(len as usize).map_mut(&file) }.map_err(io_err)?;
        let guard = fault_guard::watch(map.as_ptr() as usize, map.len());
        let mut seg = Segment {
            map,
            name: name_s.clone(),
            capacity: 0,
            file_uid: stat.st_uid,
            guard,
        };
        if seg.guard.is_none() {
            return Err(invalid("too many segments mapped to guard them".into()));
        }
        let w = seg.words();
        if w[W_MAGIC].load(Ordering::Acquire) != MAGIC {
            return Err(SegmentError::NotReady { name: name_s });
        }
        let version = w[W_VERSION].load(Ordering::Relaxed);
        if version as u32 != LAYOUT_VERSION || (version >> 32) != RECORD_WORDS as u64 * 8 {
            return Err(invalid(format!("layout version/record size {version:#x}")));
        }
        if w[W_LAYOUT_HASH].load(Ordering::Relaxed) != layout_hash() {
            return Err(invalid("layout hash mismatch".into()));
        }
        let capacity = w[W_CAPACITY].load(Ordering::Relaxed);
        if !capacity.is_power_of_two() || capacity > MAX_CAPACITY || segment_bytes(capacity) != len
        {
            return Err(invalid(format!("capacity {capacity} for {len} bytes")));
        }
        seg.capacity = capacity;
        Ok(seg)
    }

    /// Removes the name; existing mappings stay valid.
    pub fn unlink(name: &SegmentName) -> io::Result<()> {
        shm::unlink(shm_path(&name.to_string()).as_str()).map_err(Into::into)
    }

    fn words(&self) -> &[AtomicU64] {
        let ptr = self.map.as_ptr() as *const AtomicU64;
        // SAFETY: the mapping is page-aligned and its length a multiple of 8 (checked at create/open);
        // AtomicU64 has the size and alignment of u64; the slice borrows `self`, which owns the
        // mapping. Every process accesses these words only atomically.
        unsafe { std::slice::from_raw_parts(ptr, self.map.len() / 8) }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Uid owning the shared memory object, from fstat (not from the header, which the owner writes).
    pub fn file_uid(&self) -> u32 {
        self.file_uid
    }

    /// Whether the owner truncated the object under this mapping: a read faulted and the mapping now
    /// holds zeros (see [`install_fault_guard`]). Anything read from it is void.
    pub fn truncated(&self) -> bool {
        self.guard.is_some_and(fault_guard::faulted)
    }

    /// The identity the creator wrote into the header.
    pub fn owner(&self) -> Owner {
        let w = self.words();
        let pid_uid = w[W_PID_UID].load(Ordering::Relaxed);
        Owner {
            pid: pid_uid as u32,
            uid: (pid_uid >> 32) as u32,
            start_ticks: w[W_PROC_START].load(Ordering::Relaxed),
            hostname: get_text(w, W_HOSTNAME),
            job_id: get_text(w, W_JOB_ID),
        }
    }

    pub fn created_ns(&self) -> u64 {
        self.words()[W_CREATED_NS].load(Ordering::Relaxed)
    }

    pub fn counter(&self, c: Counter) -> u64 {
        self.words()[W_COUNTERS + c as usize].load(Ordering::Relaxed)
    }

    /// Adds to a counter; safe from any thread of the owning process.
    pub fn count(&self, c: Counter, n: u64) {
        self.words()[W_COUNTERS + c as usize].fetch_add(n, Ordering::Relaxed);
    }

    pub fn heartbeat_ns(&self) -> u64 {
        self.words()[W_HEARTBEAT_NS].load(Ordering::Relaxed)
    }

    pub fn beat(&self) {
        self.words()[W_HEARTBEAT_NS].store(crate::now_ns(), Ordering::Relaxed);
    }

    /// Marks that the producer has finished (every communicator finalized); set by the plugin.
    pub fn close(&self) {
        self.words()[W_FLAGS].fetch_or(FLAG_CLOSED, Ordering::Release);
    }

    pub fn is_closed(&self) -> bool {
        self.words()[W_FLAGS].load(Ordering::Acquire) & FLAG_CLOSED != 0
    }

    /// Records ever published by the producer.
    pub fn head(&self) -> u64 {
        self.words()[W_HEAD].load(Ordering::Acquire)
    }

    /// Records ever consumed and committed by the daemon.
    pub fn tail(&self) -> u64 {
        self.words()[W_TAIL].load(Ordering::Acquire)
    }

    fn slot(&self, index: u64) -> &[AtomicU64] {
        let at = W_RECORDS + (index & (self.capacity - 1)) as usize * RECORD_WORDS;
        &self.words()[at..at + RECORD_WORDS]
    }
}

/// The writing side of a segment; exactly one per segment (the plugin's forwarding thread).
pub struct Producer {
    seg: Segment,
    head: u64,
    tail_cache: u64,
}

impl Producer {
    pub fn new(seg: Segment) -> Producer {
        let head = seg.head();
        Producer {
            tail_cache: seg.tail(),
            head,
            seg,
        }
    }

    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Appends `record`, or drops it and counts [`Counter::RingFull`]. Never blocks.
    pub fn push(&mut self, record: &Record) -> bool {
        if self.head.wrapping_sub(self.tail_cache) >= self.seg.capacity {
            // The consumer's cursor is untrusted: one that runs ahead of head is treated as "full".
            self.tail_cache = self.seg.tail();
            if self.head.wrapping_sub(self.tail_cache) >= self.seg.capacity {
                self.seg.count(Counter::RingFull, 1);
                return false;
            }
        }
        for (word, value) in self.seg.slot(self.head).iter().zip(record.encode()) {
            word.store(value, Ordering::Relaxed);
        }
        self.head += 1;
        self.seg.words()[W_HEAD].store(self.head, Ordering::Release);
        true
    }
}

/// The reading side of a segment (the daemon). Reads are not consumed until [`Consumer::commit`].
pub struct Consumer {
    seg: Segment,
    read: u64,
}

/// One record read from a segment: its position in the stream and its decoding.
pub type Read = (u64, Result<Record, DecodeError>);
/// A record's position and its undecoded words.
pub type RawRead = (u64, [u64; RECORD_WORDS]);

impl Consumer {
    pub fn new(seg: Segment) -> Consumer {
        Consumer {
            read: seg.tail(),
            seg,
        }
    }

    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Records published but not yet read.
    pub fn pending(&self) -> u64 {
        self.seg.head().saturating_sub(self.read)
    }

    /// Reads up to `max` records after the last read position into `out`. A cursor that claims more
    /// than a ring's worth, or that went backwards, is a corrupt segment.
    pub fn read(&mut self, max: usize, out: &mut Vec<Read>) -> Result<usize, SegmentError> {
        let positions = self.take(max)?;
        let (n, from) = (positions.end - positions.start, out.len());
        out.extend(positions.map(|pos| (pos, Record::decode(&self.words(pos)))));
        self.check_truncated().inspect_err(|_| out.truncate(from))?;
        Ok(n as usize)
    }

    /// [`Consumer::read`] without decoding: each record's words, for a reader that decodes where it
    /// uses the record (a decoded `Record` copied through a buffer stalls on store forwarding).
    pub fn read_raw(&mut self, max: usize, out: &mut Vec<RawRead>) -> Result<usize, SegmentError> {
        let positions = self.take(max)?;
        let (n, from) = (positions.end - positions.start, out.len());
        out.extend(positions.map(|pos| (pos, self.words(pos))));
        self.check_truncated().inspect_err(|_| out.truncate(from))?;
        Ok(n as usize)
    }

    /// The positions of up to `max` published records after the read cursor, which moves past them.
    fn take(&mut self, max: usize) -> Result<std::ops::Range<u64>, SegmentError> {
        let head = self.seg.head();
        self.check_truncated()?;
        if head < self.read || head - self.read > self.seg.capacity {
            return Err(SegmentError::Invalid {
                name: self.seg.name.clone(),
                reason: format!("head {head} with read cursor {}", self.read),
            });
        }
        let start = self.read;
        self.read += (head - self.read).min(max as u64);
        Ok(start..self.read)
    }

    /// After a copy out of the ring: void if the mapping faulted meanwhile (or before).
    fn check_truncated(&self) -> Result<(), SegmentError> {
        if self.seg.truncated() {
            return Err(SegmentError::Truncated {
                name: self.seg.name.clone(),
            });
        }
        Ok(())
    }

    fn words(&self, pos: u64) -> [u64; RECORD_WORDS] {
        let mut w = [0u64; RECORD_WORDS];
        for (dst, word) in w.iter_mut().zip(self.seg.slot(pos)) {
            *dst = word.load(Ordering::Relaxed);
        }
        w
    }

    /// Frees every slot before `upto` for the producer; persists in the segment across daemon restarts.
    pub fn commit(&mut self, upto: u64) {
        let upto = upto.min(self.read);
        if upto > self.seg.tail() {
            self.seg.words()[W_TAIL].store(upto, Ordering::Release);
        }
    }
}

/// Makes this process survive a segment truncated under its mapping: a SIGBUS whose address lies in
/// a mapping made by [`Segment::open`] replaces that mapping with zero pages and marks the segment
/// [`Segment::truncated`], so the faulting read completes (with zeros) and the reader detaches the
/// segment at its next check. Any other SIGBUS goes to the handler that was installed before. For
/// the daemon only: a plugin must never install signal handlers in the process it is loaded into.
/// Costs nothing until a fault: no check or syscall on the read path. Idempotent.
pub fn install_fault_guard() -> io::Result<()> {
    fault_guard::install()
}

/// The SIGBUS handler and the table of watched mappings it reads (fixed, lock-free: a signal handler
/// may neither allocate nor lock).
mod fault_guard {
    use super::*;

    /// Mappings watched at once; opening beyond it fails (the daemon attaches far fewer).
    const SLOTS: usize = 8192;

    struct Slot {
        claimed: AtomicBool,
        /// Start address; 0 while the slot is not published.
        start: AtomicUsize,
        len: AtomicUsize,
        faulted: AtomicBool,
    }

    static TABLE: [Slot; SLOTS] = [const {
        Slot {
            claimed: AtomicBool::new(false),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            faulted: AtomicBool::new(false),
        }
    }; SLOTS];
    static INSTALLED: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    /// The action before ours, for faults outside any watched mapping. Written once, before the
    /// handler is installed; read only by the handler.
    static PREVIOUS: std::sync::OnceLock<libc::sigaction> = std::sync::OnceLock::new();

    pub(super) fn watch(start: usize, len: usize) -> Option<usize> {
        let i = TABLE.iter().position(|s| {
            s.claimed
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })?;
        let slot = &TABLE[i];
        slot.faulted.store(false, Ordering::Relaxed);
        slot.len.store(len, Ordering::Relaxed);
        slot.start.store(start, Ordering::Release);
        Some(i)
    }

    pub(super) fn unwatch(i: usize) {
        TABLE[i].start.store(0, Ordering::Release);
        TABLE[i].claimed.store(false, Ordering::Release);
    }

    pub(super) fn faulted(i: usize) -> bool {
        TABLE[i].faulted.load(Ordering::Acquire)
    }

    pub(super) fn install() -> io::Result<()> {
        let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        if *installed {
            return Ok(());
        }
        // SAFETY: zeroed sigaction structs are valid "no action" values; sigaction only reads `new`
        // and writes `old`, both valid for the call. The handler is async-signal-safe (atomics and
        // mmap/sigaction system calls only).
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) != 0 {
                return Err(io::Error::last_os_error());
            }
            let _ = PREVIOUS.set(old);
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = on_sigbus as *const () as usize;
            new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut new.sa_mask);
            if libc::sigaction(libc::SIGBUS, &new, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        *installed = true;
        Ok(())
    }

    extern "C" fn on_sigbus(
        _sig: libc::c_int,
        info: *mut libc::siginfo_t,
        _ctx: *mut libc::c_void,
    ) {
        // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler; si_addr is the
        // faulting address for SIGBUS.
        let addr = unsafe { (*info).si_addr() } as usize;
        for slot in &TABLE {
            let start = slot.start.load(Ordering::Acquire);
            if start == 0 || addr < start || addr - start >= slot.len.load(Ordering::Relaxed) {
                continue;
            }
            let len = slot.len.load(Ordering::Relaxed);
            // SAFETY: [start, start + len) is a live mapping of a segment (watched until the Segment
            // is dropped, before it is unmapped); MAP_FIXED replaces exactly it with private zero
            // pages, which the later munmap of the Segment releases as before.
            let p = unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                slot.faulted.store(true, Ordering::Release);
                return; // the faulting access is retried, now on a zero page
            }
            break;
        }
        // Not a segment of ours (or it could not be replaced): the previous action, by re-raising the
        // fault under it (returning retries the access).
        let fallback = PREVIOUS.get().copied();
        // SAFETY: restoring a sigaction captured from this process; a zeroed one means SIG_DFL.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            let act = fallback.unwrap_or(dfl);
            libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unique(tag: &str) -> SegmentName {
        static N: AtomicU64 = AtomicU64::new(0);
        SegmentName {
            prefix: format!(
                "ncclscope-unittest-{tag}-{}",
                N.fetch_add(1, Ordering::Relaxed)
            ),
            uid: rustix::process::getuid().as_raw(),
            pid: std::process::id(),
            start_ticks: process_start_ticks(std::process::id()).unwrap(),
        }
    }

    fn owner() -> Owner {
        Owner {
            pid: std::process::id(),
            uid: rustix::process::getuid().as_raw(),
            start_ticks: 77,
            hostname: "node-7".into(),
            job_id: "job-123".into(),
        }
    }

    fn rec(i: u64) -> Record {
        Record::OpStop {
            comm: 1,
            id: i,
            host_ns: i * 10,
        }
    }

    #[test]
    fn names_round_trip_and_reject_garbage() {
        let n = SegmentName {
            prefix: "ncclscope.x".into(),
            uid: 1000,
            pid: 42,
            start_ticks: 9,
        };
        assert_eq!(SegmentName::parse(&n.to_string()), Some(n));
        for bad in ["ncclscope", "ncclscope.1.2", ".1.2.3", "a.b.2.3", "a.1.2.x"] {
            assert_eq!(SegmentName::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn create_is_exclusive_private_and_carries_the_owner() {
        let name = unique("create");
        let seg = Segment::create(&name, &owner(), 8).unwrap();
        assert!(Segment::create(&name, &owner(), 8).is_err(), "O_EXCL");
        let mode = std::fs::metadata(format!("{SHM_DIR}/{name}")).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
        let other = Segment::open(&name).unwrap();
        assert_eq!(other.owner(), owner());
        assert_eq!(other.capacity(), 8);
        assert_eq!(list(&name.prefix).unwrap(), vec![name.clone()]);
        Segment::unlink(&name).unwrap();
        drop(seg);
    }

    #[test]
    fn ring_delivers_in_order_drops_when_full_and_resumes_from_the_committed_tail() {
        let name = unique("ring");
        let mut p = Producer::new(Segment::create(&name, &owner(), 8).unwrap());
        let mut c = Consumer::new(Segment::open(&name).unwrap());
        for i in 0..10 {
            p.push(&rec(i));
        }
        assert_eq!(p.segment().counter(Counter::RingFull), 2);
        let mut out = Vec::new();
        assert_eq!(c.read(3, &mut out).unwrap(), 3);
        c.commit(3);
        // A new consumer (a restarted daemon) resumes at the committed tail, not at what was read.
        let mut c2 = Consumer::new(Segment::open(&name).unwrap());
        out.clear();
        assert_eq!(c2.read(100, &mut out).unwrap(), 5);
        let ids: Vec<u64> = out
            .iter()
            .map(|(_, r)| match r {
                Ok(Record::OpStop { id, .. }) => *id,
                _ => 99,
            })
            .collect();
        assert_eq!(ids, vec![3, 4, 5, 6, 7]);
        c2.commit(8);
        for i in 10..20 {
            p.push(&rec(i));
        }
        out.clear();
        c2.read(100, &mut out).unwrap();
        assert_eq!(out.len(), 8);
        assert_eq!(p.segment().counter(Counter::RingFull), 4);
        // Delivered + dropped = produced.
        assert_eq!(3 + 5 + 8 + p.segment().counter(Counter::RingFull), 20);
        Segment::unlink(&name).unwrap();
    }

    #[test]
    fn corrupt_segments_are_errors() {
        let name = unique("corrupt");
        let seg = Segment::create(&name, &owner(), 8).unwrap();
        // A head beyond a ring's worth of records.
        seg.words()[W_HEAD].store(100, Ordering::Release);
        let mut c = Consumer::new(Segment::open(&name).unwrap());
        assert!(matches!(
            c.read(10, &mut Vec::new()),
            Err(SegmentError::Invalid { .. })
        ));
        // A garbage record decodes to an error in its slot, not a panic.
        seg.words()[W_HEAD].store(1, Ordering::Release);
        seg.words()[W_RECORDS].store(0xff, Ordering::Relaxed);
        let mut c = Consumer::new(Segment::open(&name).unwrap());
        let mut out = Vec::new();
        c.read(10, &mut out).unwrap();
        assert!(out[0].1.is_err());
        // Bad headers.
        for (word, value) in [(W_CAPACITY, 16), (W_VERSION, 99), (W_LAYOUT_HASH, 1)] {
            let saved = seg.words()[word].swap(value, Ordering::Relaxed);
            assert!(
                matches!(Segment::open(&name), Err(SegmentError::Invalid { .. })),
                "word {word}"
            );
            seg.words()[word].store(saved, Ordering::Relaxed);
        }
        seg.words()[W_MAGIC].store(0, Ordering::Relaxed);
        assert!(matches!(
            Segment::open(&name),
            Err(SegmentError::NotReady { .. })
        ));
        Segment::unlink(&name).unwrap();
        // A foreign object of the wrong size.
        let name = unique("foreign");
        let fd = shm::open(
            shm_path(&name.to_string()).as_str(),
            shm::OFlags::CREATE | shm::OFlags::RDWR,
            Mode::from_raw_mode(0o600),
        )
        .unwrap();
        File::from(fd).set_len(100).unwrap();
        assert!(matches!(
            Segment::open(&name),
            Err(SegmentError::Invalid { .. })
        ));
        Segment::unlink(&name).unwrap();
    }

    #[test]
    fn a_segment_truncated_under_the_reader_is_reported_not_fatal() {
        install_fault_guard().unwrap();
        let (name, other) = (unique("truncated"), unique("intact"));
        let mut p = Producer::new(Segment::create(&name, &owner(), 1024).unwrap());
        let mut q = Producer::new(Segment::create(&other, &owner(), 8).unwrap());
        for i in 0..600 {
            p.push(&rec(i));
        }
        q.push(&rec(1));
        let mut c = Consumer::new(Segment::open(&name).unwrap());
        let mut d = Consumer::new(Segment::open(&other).unwrap());
        let mut out = Vec::new();
        assert_eq!(c.read(10, &mut out).unwrap(), 10);
        // The owner shrinks its object: the pages behind the reader's mapping vanish.
        let fd = shm::open(
            shm_path(&name.to_string()).as_str(),
            shm::OFlags::RDWR,
            Mode::empty(),
        )
        .unwrap();
        rustix::fs::ftruncate(&fd, 0).unwrap();
        out.clear();
        assert!(matches!(
            c.read(500, &mut out),
            Err(SegmentError::Truncated { .. })
        ));
        assert!(
            out.is_empty(),
            "nothing read from a faulted mapping is handed out"
        );
        assert!(c.segment().truncated());
        assert!(!d.segment().truncated());
        assert_eq!(d.read(10, &mut out).unwrap(), 1, "other segments read on");
        Segment::unlink(&name).unwrap();
        Segment::unlink(&other).unwrap();
    }
}
