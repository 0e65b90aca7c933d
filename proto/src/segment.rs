//! The per-process segment: a header and a single-producer single-consumer ring of [`Record`]s in an
//! anonymous memory file (memfd). The plugin creates it, sizes it once and seals it against shrinking
//! and growing, then hands its descriptor to the daemon over the registration socket; the daemon checks
//! the seals and the size before it maps its header, and drains it.
//!
//! The daemon maps only the header's page and copies records out of the file with pread(2): reading
//! a page the owner never wrote, or punched out after sealing (`fallocate(PUNCH_HOLE)` is allowed on a
//! sealed memfd), copies zeros and allocates nothing, whereas a fault through a shared mapping
//! allocates the page, charged to the daemon's memory cgroup. What an owner can make the daemon's
//! reads allocate is one header page per segment (a one-page mapping takes no huge page).
//!
//! Nothing has a name: no other process can open, pre-create or replace a segment, and a container
//! shares only the socket directory with the daemon. The sealed size means the owner cannot truncate
//! the file under the daemon's mapping. Who the segment belongs to is what the kernel says about the
//! process that handed it over (see the daemon's `register`), never what the header says.
//!
//! Everything in the segment is a 64-bit word accessed atomically, so a hostile or crashed peer can
//! give us wrong values but never undefined behaviour. Layout, in words:
//!
//! | words | contents |
//! |---|---|
//! | 0..64 | header: magic, version, sizes, flags, heartbeat, hostname, job id, counters |
//! | 64..80 | producer line: `head` (records ever published) |
//! | 80..96 | consumer line: `tail` (records ever consumed); lives here so a restarted daemon resumes |
//! | 96.. | `capacity` records of [`RECORD_WORDS`] words |
//!
//! The producer never blocks: when the ring is full the record is dropped and [`Counter::RingFull`]
//! counts it. The consumer commits `tail` only after it has dealt with what it read.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapMut, MmapOptions};
use rustix::fs::{FileType, MemfdFlags, SealFlags};

use crate::record::{DecodeError, RECORD_WORDS, Record};

const MAGIC: u64 = u64::from_le_bytes(*b"NCCLSCP\0");
/// Bumped whenever the layout or a record's encoding changes, except for a field added in words
/// every earlier writer left zero (a record is encoded from zeroed words) where zero reads as
/// "absent": an older reader ignores it and a newer one reads an older writer's record as without
/// it, so neither side needs the other upgraded (`Record::Comm`'s `gpu`).
pub const LAYOUT_VERSION: u32 = 1;

const W_MAGIC: usize = 0;
const W_VERSION: usize = 1; // version | record bytes << 32
const W_CAPACITY: usize = 2;
const W_LAYOUT_HASH: usize = 3;
// Words 4 and 5 are unused: the process's identity comes from the kernel, not from the segment.
const W_CREATED_NS: usize = 6;
const W_FLAGS: usize = 7;
const W_HEARTBEAT_NS: usize = 8;
const W_HOSTNAME: usize = 16;
const W_JOB_ID: usize = 24;
const TEXT_WORDS: usize = 8;
const W_COUNTERS: usize = 32;
const N_COUNTERS: usize = 16;
/// The Kubernetes namespace and pod the process ran in (text; "" outside Kubernetes): the words
/// after the counters, and the second cache line of the head's padding, which nothing else writes.
/// Older writers left them zero ("absent"), so the layout's version and hash stay as they were.
const W_K8S_NAMESPACE: usize = 56;
const W_K8S_POD: usize = 72;
/// The batch scheduler's job (SLURM_JOB_ID) the process ran in: text, after the counters. Older
/// writers left these words zero ("absent"), so the layout's version and hash stay as they were.
const W_SLURM_JOB_ID: usize = 48;
const W_HEAD: usize = 64;
const W_TAIL: usize = 80;
const W_RECORDS: usize = 96;

/// Largest ring a reader accepts (records); bounds what an untrusted header can make us map.
pub const MAX_CAPACITY: u64 = 1 << 24;
/// Default ring size: 1 Mi records = 64 MiB (memfd, reserved at creation and charged to the rank's
/// process). Sized from real NCCL 2.30 with the device hook (one H100, 2 ranks): a CUDA graph of 50
/// collectives replayed 300 times back to back writes 433 k records per rank in about a second, in
/// bursts faster than the daemon drains them; 256 Ki records lost 16-18% of them (`ring_full`), 1 Mi
/// and 2 Mi none (docs/benchmarks.md, "Real NCCL 2.30.7 with the device-hook RFC").
pub const DEFAULT_CAPACITY: u64 = 1 << 20;

/// The seals a segment must carry before a reader maps it: its size can never change (so no access
/// through the mapping can fault), and no seal can be added later (a write seal would stop a restarted
/// daemon from mapping it writable to commit its cursor).
pub const REQUIRED_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

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
    /// Events still queued when the process exited without finalizing its communicators, after the
    /// forwarding thread had its last chance to write them (in `exit`).
    ExitUnflushed = 10,
}

impl Counter {
    pub const ALL: [Counter; 11] = [
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
        Counter::ExitUnflushed,
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
            Counter::ExitUnflushed => "exit_unflushed",
        }
    }

    /// Whether the counter stands for events that were lost (as opposed to merely ignored).
    pub fn is_loss(self) -> bool {
        !matches!(self, Counter::Ignored | Counter::StrTableFull)
    }
}
const _: () = assert!(Counter::ALL.len() <= N_COUNTERS);
const _: () = assert!(
    W_COUNTERS + N_COUNTERS <= W_SLURM_JOB_ID
        && W_SLURM_JOB_ID + TEXT_WORDS <= W_K8S_NAMESPACE
        && W_K8S_NAMESPACE + TEXT_WORDS <= W_HEAD
        && W_HEAD + TEXT_WORDS <= W_K8S_POD
        && W_K8S_POD + TEXT_WORDS <= W_TAIL
);

/// What a process says about itself in its segment's header: trusted only as that process's claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claims {
    pub hostname: String,
    pub job_id: String,
    /// SLURM_JOB_ID where the process ran under Slurm ("" otherwise): the Slurm Epilog finds a
    /// job's instances by it whatever ncclscope job id the tasks chose.
    pub slurm_job_id: String,
}

/// The Kubernetes pod a process says it runs in (the plugin's `NCCLSCOPE_K8S_POD_NAME` and
/// `NCCLSCOPE_K8S_NAMESPACE`, set from the downward API; both "" elsewhere): a claim like
/// [`Claims`], at most 64 bytes each (a namespace is at most 63, and so is the host name Kubernetes
/// makes of a pod's name).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pod {
    pub name: String,
    pub namespace: String,
}

/// Why a segment could not be created or opened.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
    #[error("segment is not initialised yet")]
    NotReady,
    /// Its size could still change under a reader's mapping: refused before it is mapped.
    #[error("segment is not sealed against resizing (seals {0:?})")]
    Unsealed(SealFlags),
    #[error("segment is invalid: {0}")]
    Invalid(String),
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> SegmentError {
    move |source| SegmentError::Io { what, source }
}

/// A mapped segment. Both sides hold one; [`Producer`] and [`Consumer`] add the ring discipline.
pub struct Segment {
    /// The whole file for its creator ([`Segment::create`]); the header alone for a reader
    /// ([`Segment::open`]), which reads records with pread(2).
    map: MmapMut,
    fd: OwnedFd,
    capacity: u64,
    /// The memory file's device, inode number and owner, from fstat: the kernel's, not the producer's.
    dev: u64,
    inode: u64,
    file_uid: u32,
}

/// The size of a segment of `capacity` records: what its memory file is sealed at.
pub fn segment_bytes(capacity: u64) -> u64 {
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
    /// Creates a segment with room for `capacity` records (a power of two): a memfd, sized once with
    /// its pages reserved, sealed with [`REQUIRED_SEALS`], mapped.
    pub fn create(claims: &Claims, capacity: u64) -> Result<Segment, SegmentError> {
        Segment::create_in(claims, capacity, true)
    }

    /// [`Segment::create`], reserving the pages or not (a hostile owner's, in `fixture`).
    pub(crate) fn create_in(
        claims: &Claims,
        capacity: u64,
        reserve: bool,
    ) -> Result<Segment, SegmentError> {
        if !capacity.is_power_of_two() || capacity > MAX_CAPACITY {
            return Err(SegmentError::Invalid(format!("capacity {capacity}")));
        }
        let fd =
            rustix::fs::memfd_create("ncclscope", MemfdFlags::ALLOW_SEALING | MemfdFlags::CLOEXEC)
                .map_err(|e| io_err("memfd_create")(e.into()))?;
        let len = segment_bytes(capacity);
        rustix::fs::ftruncate(&fd, len).map_err(|e| io_err("ftruncate")(e.into()))?;
        // Reserve the pages now: memory that runs out later would otherwise kill the writer with
        // SIGBUS on its first store to an unbacked page; this way it is an error here instead.
        if reserve {
            rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, len)
                .map_err(|e| io_err("fallocate")(e.into()))?;
        }
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS)
            .map_err(|e| io_err("sealing")(e.into()))?;
        let seg = Segment::map(fd, len)?;
        let w = seg.words();
        w[W_VERSION].store(
            LAYOUT_VERSION as u64 | ((RECORD_WORDS as u64 * 8) << 32),
            Ordering::Relaxed,
        );
        w[W_CAPACITY].store(capacity, Ordering::Relaxed);
        w[W_LAYOUT_HASH].store(layout_hash(), Ordering::Relaxed);
        w[W_CREATED_NS].store(crate::now_ns(), Ordering::Relaxed);
        put_text(w, W_HOSTNAME, &claims.hostname);
        put_text(w, W_JOB_ID, &claims.job_id);
        put_text(w, W_SLURM_JOB_ID, &claims.slurm_job_id);
        // Publish: a reader that sees the magic sees every field above.
        w[W_MAGIC].store(MAGIC, Ordering::Release);
        let mut seg = seg;
        seg.capacity = capacity;
        Ok(seg)
    }

    /// Maps the header of a segment handed over by another process and validates it: a regular memory
    /// file that carries [`REQUIRED_SEALS`] and has the size its header declares. The contents are
    /// untrusted. The records are not mapped: [`Consumer`] reads them with pread(2).
    pub fn open(fd: OwnedFd) -> Result<Segment, SegmentError> {
        let stat = rustix::fs::fstat(&fd).map_err(|e| io_err("fstat")(e.into()))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(SegmentError::Invalid("not a regular file".into()));
        }
        // Only a memfd created to allow sealing can carry these (any other file reports F_SEAL_SEAL).
        let seals = rustix::fs::fcntl_get_seals(&fd).unwrap_or(SealFlags::empty());
        if !seals.contains(REQUIRED_SEALS) {
            return Err(SegmentError::Unsealed(seals));
        }
        let len = stat.st_size as u64;
        if len < segment_bytes(1) || len > segment_bytes(MAX_CAPACITY) || !len.is_multiple_of(8) {
            return Err(SegmentError::Invalid(format!("size {len}")));
        }
        let mut seg = Segment::map(fd, W_RECORDS as u64 * 8)?;
        let w = seg.words();
        if w[W_MAGIC].load(Ordering::Acquire) != MAGIC {
            return Err(SegmentError::NotReady);
        }
        let version = w[W_VERSION].load(Ordering::Relaxed);
        if version as u32 != LAYOUT_VERSION || (version >> 32) != RECORD_WORDS as u64 * 8 {
            return Err(SegmentError::Invalid(format!(
                "layout version/record size {version:#x}"
            )));
        }
        if w[W_LAYOUT_HASH].load(Ordering::Relaxed) != layout_hash() {
            return Err(SegmentError::Invalid("layout hash mismatch".into()));
        }
        let capacity = w[W_CAPACITY].load(Ordering::Relaxed);
        if !capacity.is_power_of_two() || capacity > MAX_CAPACITY || segment_bytes(capacity) != len
        {
            return Err(SegmentError::Invalid(format!(
                "capacity {capacity} for {len} bytes"
            )));
        }
        seg.capacity = capacity;
        Ok(seg)
    }

    /// Maps the first `len` bytes of a sealed memory file (capacity 0 until the caller has checked the
    /// header).
    fn map(fd: OwnedFd, len: u64) -> Result<Segment, SegmentError> {
        let stat = rustix::fs::fstat(&fd).map_err(|e| io_err("fstat")(e.into()))?;
        let file = File::from(fd);
        // SAFETY: the file is sealed against shrinking and growing (created so above, or checked by
        // `open`) and `len` is at most its size, so no access through the mapping can fault; every
        // access goes through atomics (see `words`), so whatever the other process writes is a value,
        // never UB.
        let map = unsafe { MmapOptions::new().len(len as usize).map_mut(&file) }
            .map_err(io_err("mmap"))?;
        Ok(Segment {
            map,
            fd: file.into(),
            capacity: 0,
            dev: stat.st_dev,
            inode: stat.st_ino,
            file_uid: stat.st_uid,
        })
    }

    fn words(&self) -> &[AtomicU64] {
        let ptr = self.map.as_ptr() as *const AtomicU64;
        // SAFETY: the mapping is page-aligned and its length a multiple of 8 (checked at create/open);
        // AtomicU64 has the size and alignment of u64; the slice borrows `self`, which owns the
        // mapping. Every process accesses these words only atomically.
        unsafe { std::slice::from_raw_parts(ptr, self.map.len() / 8) }
    }

    /// The memory file, to hand to the daemon (or, in the daemon, to systemd's file descriptor store).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The memory file's inode number: tells segments apart while they exist.
    pub fn inode(&self) -> u64 {
        self.inode
    }

    /// The memory file's device and inode number: two segments with the same are one file.
    pub fn file_id(&self) -> (u64, u64) {
        (self.dev, self.inode)
    }

    /// Uid that created the memory file, from fstat (not from the header, which the owner writes).
    pub fn file_uid(&self) -> u32 {
        self.file_uid
    }

    /// What the creator wrote into the header about itself.
    pub fn claims(&self) -> Claims {
        let w = self.words();
        Claims {
            hostname: get_text(w, W_HOSTNAME),
            job_id: get_text(w, W_JOB_ID),
            slurm_job_id: get_text(w, W_SLURM_JOB_ID),
        }
    }

    /// Writes the process's pod into the header: by its creator, before it hands the segment over.
    pub fn set_pod(&self, pod: &Pod) {
        let w = self.words();
        put_text(w, W_K8S_POD, &pod.name);
        put_text(w, W_K8S_NAMESPACE, &pod.namespace);
    }

    /// What the creator wrote about its pod (both "" from a writer that wrote none).
    pub fn pod(&self) -> Pod {
        let w = self.words();
        Pod {
            name: get_text(w, W_K8S_POD),
            namespace: get_text(w, W_K8S_NAMESPACE),
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

    /// Says `head` records were published, whatever was written (a hostile owner's, in `fixture`).
    pub(crate) fn set_head(&self, head: u64) {
        self.words()[W_HEAD].store(head, Ordering::Release);
    }

    /// Records ever consumed and committed by the daemon.
    pub fn tail(&self) -> u64 {
        self.words()[W_TAIL].load(Ordering::Acquire)
    }

    /// The words of a record's slot; only the creator maps them.
    fn slot(&self, index: u64) -> &[AtomicU64] {
        let at = W_RECORDS + (index & (self.capacity - 1)) as usize * RECORD_WORDS;
        &self.words()[at..at + RECORD_WORDS]
    }

    /// The byte offset of a record's slot in the memory file.
    fn slot_offset(&self, index: u64) -> u64 {
        (W_RECORDS as u64 + (index & (self.capacity - 1)) * RECORD_WORDS as u64) * 8
    }
}

/// The writing side of a segment; exactly one per segment (the plugin's forwarding thread).
pub struct Producer {
    seg: Segment,
    head: u64,
    tail_cache: u64,
}

impl Producer {
    /// `seg` must be the creator's ([`Segment::create`]): a reader's maps no records.
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
    /// Where [`Consumer::read`] copies records before it decodes them (kept: it only grows).
    copied: Vec<[u64; RECORD_WORDS]>,
}

/// One record read from a segment: its position in the stream and its decoding.
pub type Read = (u64, Result<Record, DecodeError>);

impl Consumer {
    pub fn new(seg: Segment) -> Consumer {
        Consumer {
            read: seg.tail(),
            seg,
            copied: Vec::new(),
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
        let mut copied = std::mem::take(&mut self.copied);
        let read = self.read_raw(max, &mut copied).map(|(first, words)| {
            out.extend(
                (first..)
                    .zip(words)
                    .map(|(pos, w)| (pos, Record::decode(w))),
            );
            words.len()
        });
        self.copied = copied;
        read
    }

    /// [`Consumer::read`] without decoding: the first record's position and each record's words, for a
    /// reader that decodes where it uses the record (a decoded `Record` copied through a buffer stalls
    /// on store forwarding). The words are copied out of the memory file with pread(2), so a hole
    /// reads as zeros (an invalid record) without allocating a page, into `buf`, which only grows:
    /// one buffer for every segment a reader drains stays in cache.
    pub fn read_raw<'b>(
        &mut self,
        max: usize,
        buf: &'b mut Vec<[u64; RECORD_WORDS]>,
    ) -> Result<(u64, &'b [[u64; RECORD_WORDS]]), SegmentError> {
        let positions = self.take(max)?;
        let n = (positions.end - positions.start) as usize;
        if buf.len() < n {
            buf.resize(n, [0; RECORD_WORDS]);
        }
        // The ring's end splits a read in two.
        let first = positions.start & (self.seg.capacity - 1);
        let before_end = ((self.seg.capacity - first) as usize).min(n);
        let (a, b) = buf[..n].split_at_mut(before_end);
        pread_words(self.seg.fd(), a, self.seg.slot_offset(positions.start))?;
        pread_words(self.seg.fd(), b, self.seg.slot_offset(0))?;
        Ok((positions.start, &buf[..n]))
    }

    /// The positions of up to `max` published records after the read cursor, which moves past them.
    fn take(&mut self, max: usize) -> Result<std::ops::Range<u64>, SegmentError> {
        let head = self.seg.head();
        if head < self.read || head - self.read > self.seg.capacity {
            return Err(SegmentError::Invalid(format!(
                "head {head} with read cursor {}",
                self.read
            )));
        }
        let start = self.read;
        self.read += (head - self.read).min(max as u64);
        Ok(start..self.read)
    }

    /// Frees every slot before `upto` for the producer; persists in the segment across daemon restarts.
    pub fn commit(&mut self, upto: u64) {
        let upto = upto.min(self.read);
        if upto > self.seg.tail() {
            self.seg.words()[W_TAIL].store(upto, Ordering::Release);
        }
    }
}

/// Fills `records` from `fd` at byte `offset` (the slots of consecutive records).
fn pread_words(
    fd: BorrowedFd<'_>,
    records: &mut [[u64; RECORD_WORDS]],
    mut offset: u64,
) -> Result<(), SegmentError> {
    // SAFETY: the slice's memory is `size_of_val` initialized bytes, borrowed mutably for as long
    // as this view lives; u64 has no padding and every byte pattern is a valid u64.
    let mut bytes = unsafe {
        std::slice::from_raw_parts_mut(
            records.as_mut_ptr().cast::<u8>(),
            std::mem::size_of_val(records),
        )
    };
    while !bytes.is_empty() {
        match rustix::io::pread(fd, &mut *bytes, offset) {
            Ok(0) => return Err(SegmentError::Invalid("records past its end".into())),
            Ok(n) => {
                bytes = &mut bytes[n..];
                offset += n as u64;
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(io_err("pread")(e.into())),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> Claims {
        Claims {
            hostname: "node-7".into(),
            job_id: "job-123".into(),
            slurm_job_id: "4711".into(),
        }
    }

    fn rec(i: u64) -> Record {
        Record::OpStop {
            comm: 1,
            id: i,
            host_ns: i * 10,
        }
    }

    /// Another handle on the same memory file, as the daemon gets it over the socket.
    fn handed_over(seg: &Segment) -> OwnedFd {
        seg.fd().try_clone_to_owned().unwrap()
    }

    /// A memory file shaped like a segment of `capacity` records (header copied from a real one) but
    /// carrying only `seals`.
    fn sealed_with(capacity: u64, seals: SealFlags) -> OwnedFd {
        let real = Segment::create(&claims(), capacity).unwrap();
        let fd = rustix::fs::memfd_create("other", MemfdFlags::ALLOW_SEALING).unwrap();
        let bytes: Vec<u8> = real
            .words()
            .iter()
            .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
            .collect();
        rustix::io::write(&fd, &bytes).unwrap();
        if !seals.is_empty() {
            rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
        }
        fd
    }

    #[test]
    fn a_created_segment_is_an_anonymous_sealed_file_that_carries_the_claims() {
        let seg = Segment::create(&claims(), 8).unwrap();
        let seals = rustix::fs::fcntl_get_seals(seg.fd()).unwrap();
        assert!(seals.contains(REQUIRED_SEALS), "{seals:?}");
        assert!(
            rustix::fs::ftruncate(seg.fd(), 0).is_err(),
            "cannot be shrunk"
        );
        assert!(
            rustix::fs::ftruncate(seg.fd(), 1 << 30).is_err(),
            "cannot grow"
        );
        let link = std::fs::read_link(format!("/proc/self/fd/{}", {
            use std::os::fd::AsRawFd;
            seg.fd().as_raw_fd()
        }))
        .unwrap();
        assert!(
            link.to_string_lossy().starts_with("/memfd:ncclscope"),
            "not in any directory: {link:?}"
        );
        assert_eq!(seg.pod(), Pod::default(), "no pod written: absent");
        let pod = Pod {
            name: "train-0-abcde".into(),
            namespace: "ml-team".into(),
        };
        seg.set_pod(&pod);
        let other = Segment::open(handed_over(&seg)).unwrap();
        assert_eq!(other.claims(), claims());
        assert_eq!(other.pod(), pod);
        assert_eq!(other.capacity(), 8);
        assert_eq!(other.inode(), seg.inode());
        assert_eq!(other.file_uid(), rustix::process::getuid().as_raw());
    }

    #[test]
    fn ring_delivers_in_order_drops_when_full_and_resumes_from_the_committed_tail() {
        let seg = Segment::create(&claims(), 8).unwrap();
        let fd = handed_over(&seg);
        let fd2 = handed_over(&seg);
        let mut p = Producer::new(seg);
        let mut c = Consumer::new(Segment::open(fd).unwrap());
        for i in 0..10 {
            p.push(&rec(i));
        }
        assert_eq!(p.segment().counter(Counter::RingFull), 2);
        let mut out = Vec::new();
        assert_eq!(c.read(3, &mut out).unwrap(), 3);
        c.commit(3);
        // A new consumer (a restarted daemon) resumes at the committed tail, not at what was read.
        let mut c2 = Consumer::new(Segment::open(fd2).unwrap());
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
    }

    /// Bytes of memory the file holds (its allocated pages).
    fn allocated(fd: BorrowedFd<'_>) -> u64 {
        rustix::fs::fstat(fd).unwrap().st_blocks as u64 * 512
    }

    /// Issue 37: a reader's fault on a page its owner never wrote (or punched out) allocated it,
    /// charged to the reader (the daemon OOM-killed by one registration). Reading a whole ring of such
    /// pages allocates nothing but the header's page; a sound ring still reads right, across its end.
    #[test]
    fn reading_pages_never_written_or_punched_out_allocates_nothing() {
        const CAPACITY: u64 = 1 << 16; // 4 MiB of records
        let seg = crate::fixture::unwritten_segment(&claims(), CAPACITY).unwrap();
        // Only the header's page, which its creator wrote.
        let page = allocated(seg.fd());
        assert!((4096..=65536).contains(&page), "{page}");
        crate::fixture::publish_unwritten(&seg, CAPACITY);
        let mut c = Consumer::new(Segment::open(handed_over(&seg)).unwrap());
        let (mut read, mut buf) = (0, Vec::new());
        while let Ok((_, words)) = c.read_raw(4096, &mut buf)
            && !words.is_empty()
        {
            assert!(words.iter().all(|w| *w == [0; RECORD_WORDS]));
            read += words.len() as u64;
        }
        assert_eq!(read, CAPACITY);
        assert_eq!(allocated(seg.fd()), page, "reading allocated pages");

        // Written, handed over, then punched out: what is read is zeros, and allocates nothing.
        let seg = Segment::create(&claims(), CAPACITY).unwrap();
        let fd = handed_over(&seg);
        let mut p = Producer::new(seg);
        let mut c = Consumer::new(Segment::open(fd).unwrap());
        for i in 0..CAPACITY / 2 {
            assert!(p.push(&rec(i)));
        }
        let len = segment_bytes(CAPACITY);
        rustix::fs::fallocate(
            p.segment().fd(),
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            page,
            len - page,
        )
        .unwrap();
        // The header's page, and the last one (partly records: zeroed, not freed).
        let punched = allocated(p.segment().fd());
        assert_eq!(punched, 2 * page);
        let mut out = Vec::new();
        assert_eq!(
            c.read(CAPACITY as usize, &mut out).unwrap(),
            CAPACITY as usize / 2
        );
        // Past the header's page, zeros: no record.
        let in_first_page = (page as usize - W_RECORDS * 8) / (RECORD_WORDS * 8);
        assert!(out[..in_first_page].iter().all(|(_, r)| r.is_ok()));
        assert!(out[in_first_page..].iter().all(|(_, r)| r.is_err()));
        assert_eq!(
            allocated(p.segment().fd()),
            punched,
            "reading allocated pages"
        );

        // A sound ring, read in pieces that wrap around its end.
        c.commit(CAPACITY / 2);
        for i in CAPACITY / 2..CAPACITY * 3 / 2 {
            assert!(p.push(&rec(i)));
        }
        let mut ids = Vec::new();
        while let Ok((first, words)) = c.read_raw(1000, &mut buf)
            && !words.is_empty()
        {
            for (pos, w) in (first..).zip(words) {
                match Record::decode(w) {
                    Ok(Record::OpStop { id, .. }) => ids.push((pos, id)),
                    r => panic!("{pos}: {r:?}"),
                }
            }
        }
        assert_eq!(ids.len() as u64, CAPACITY);
        assert!(ids.iter().all(|(pos, id)| pos == id));
    }

    #[test]
    fn corrupt_segments_are_errors() {
        let seg = Segment::create(&claims(), 8).unwrap();
        // A head beyond a ring's worth of records.
        seg.words()[W_HEAD].store(100, Ordering::Release);
        let mut c = Consumer::new(Segment::open(handed_over(&seg)).unwrap());
        assert!(matches!(
            c.read(10, &mut Vec::new()),
            Err(SegmentError::Invalid(_))
        ));
        // A garbage record decodes to an error in its slot, not a panic.
        seg.words()[W_HEAD].store(1, Ordering::Release);
        seg.words()[W_RECORDS].store(0xff, Ordering::Relaxed);
        let mut c = Consumer::new(Segment::open(handed_over(&seg)).unwrap());
        let mut out = Vec::new();
        c.read(10, &mut out).unwrap();
        assert!(out[0].1.is_err());
        // Bad headers.
        for (word, value) in [(W_CAPACITY, 16), (W_VERSION, 99), (W_LAYOUT_HASH, 1)] {
            let saved = seg.words()[word].swap(value, Ordering::Relaxed);
            assert!(
                matches!(
                    Segment::open(handed_over(&seg)),
                    Err(SegmentError::Invalid(_))
                ),
                "word {word}"
            );
            seg.words()[word].store(saved, Ordering::Relaxed);
        }
        seg.words()[W_MAGIC].store(0, Ordering::Relaxed);
        assert!(matches!(
            Segment::open(handed_over(&seg)),
            Err(SegmentError::NotReady)
        ));
    }

    #[test]
    fn a_file_that_could_change_size_is_refused_before_it_is_mapped() {
        // Unsealed, or missing one of the seals: the owner could truncate it under the reader.
        for seals in [
            SealFlags::empty(),
            SealFlags::SHRINK | SealFlags::SEAL,
            SealFlags::SHRINK | SealFlags::GROW,
        ] {
            assert!(
                matches!(
                    Segment::open(sealed_with(8, seals)),
                    Err(SegmentError::Unsealed(_))
                ),
                "{seals:?}"
            );
        }
        assert!(Segment::open(sealed_with(8, REQUIRED_SEALS)).is_ok());
        // A file with a path (not a memfd cannot carry seals), and a sealed file of the wrong size.
        let dir = tempfile::tempdir().unwrap();
        let file = File::create(dir.path().join("f")).unwrap();
        file.set_len(segment_bytes(8)).unwrap();
        assert!(matches!(
            Segment::open(file.into()),
            Err(SegmentError::Unsealed(_))
        ));
        let fd = rustix::fs::memfd_create("short", MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 100).unwrap();
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS).unwrap();
        assert!(matches!(Segment::open(fd), Err(SegmentError::Invalid(_))));
        // The declared capacity must match the sealed size.
        let fd = sealed_with(8, SealFlags::empty());
        rustix::fs::ftruncate(&fd, segment_bytes(16)).unwrap();
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS).unwrap();
        assert!(matches!(Segment::open(fd), Err(SegmentError::Invalid(_))));
    }
}
