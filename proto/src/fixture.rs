//! Records as the plugin writes them, for tests, benchmarks and fuzz seeds: a fixture names the
//! values it is about and takes the usual ones for the rest, instead of spelling out every field of
//! every record again; and segments as a hostile owner makes them. No I/O beyond creating a segment;
//! nothing in the plugin or the daemon uses it.

use crate::segment::{Claims, Segment, SegmentError};
use crate::{Gpu, Record, StrId, TimingPath};

/// A segment of `capacity` records as a hostile owner can hand it over: sealed, its header sound, but
/// none of its record pages reserved or written (only the header's page is allocated), and nothing
/// published yet (see [`publish_unwritten`]).
pub fn unwritten_segment(claims: &Claims, capacity: u64) -> Result<Segment, SegmentError> {
    Segment::create_in(claims, capacity, false)
}

/// Says `head` records were published without writing them, as a hostile owner can (or one that
/// punched its written pages out of the file).
pub fn publish_unwritten(seg: &Segment, head: u64) {
    seg.set_head(head);
}

/// One collective as its records carry it. [`Coll::default`]: operation 1, seq 0 of communicator 0,
/// an AllReduce of 1 Mi elements on one channel, with string ids 1 to 4 for its function, datatype,
/// algorithm and protocol.
#[derive(Clone, Copy, Debug)]
pub struct Coll {
    pub comm: u32,
    /// The plugin's operation id, which its KernelCh and OpStop records name.
    pub id: u64,
    pub seq: u64,
    pub algo: StrId,
    pub proto: StrId,
    pub count: u64,
    pub n_channels: u8,
    pub n_warps: u8,
    /// When it was enqueued (host clock).
    pub host_ns: u64,
    pub captured: bool,
}

impl Default for Coll {
    fn default() -> Coll {
        Coll {
            comm: 0,
            id: 1,
            seq: 0,
            algo: StrId(3),
            proto: StrId(4),
            count: 1 << 20,
            n_channels: 1,
            n_warps: 16,
            host_ns: 0,
            captured: false,
        }
    }
}

impl Coll {
    pub fn start(&self) -> Record {
        Record::CollStart {
            comm: self.comm,
            id: self.id,
            seq: self.seq,
            func: StrId(1),
            datatype: StrId(2),
            algo: self.algo,
            proto: self.proto,
            count: self.count,
            root: -1,
            n_channels: self.n_channels,
            n_warps: self.n_warps,
            host_ns: self.host_ns,
            captured: self.captured,
        }
    }

    /// Its kernel's work on `channel` (GPU clock), stamped `host_ns` by the plugin.
    pub fn kernel(&self, channel: u8, gpu: (u64, u64), host_ns: u64) -> Record {
        Record::KernelCh {
            comm: self.comm,
            parent: self.id,
            channel,
            gpu_start: gpu.0,
            gpu_stop: gpu.1,
            host_ns,
        }
    }

    pub fn stop(&self, host_ns: u64) -> Record {
        Record::OpStop {
            comm: self.comm,
            id: self.id,
            host_ns,
        }
    }
}

/// A communicator's announcement. [`Comm::default`]: communicator 0, rank 0 of 1 on device 0, one
/// node, no name, the KernelCh path.
#[derive(Clone, Copy, Debug)]
pub struct Comm {
    pub comm: u32,
    pub comm_hash: u64,
    pub rank: u32,
    pub nranks: u32,
    pub nnodes: u32,
    pub cuda_dev: i32,
    pub name: StrId,
    pub nccl_version: u32,
    pub path: TimingPath,
    pub host_ns: u64,
    pub gpu: Option<Gpu>,
}

impl Default for Comm {
    fn default() -> Comm {
        Comm {
            comm: 0,
            comm_hash: 0,
            rank: 0,
            nranks: 1,
            nnodes: 1,
            cuda_dev: 0,
            name: StrId(0),
            nccl_version: 0,
            path: TimingPath::KernelCh,
            host_ns: 0,
            gpu: None,
        }
    }
}

impl Comm {
    pub fn record(&self) -> Record {
        Record::Comm {
            comm: self.comm,
            comm_hash: self.comm_hash,
            rank: self.rank,
            nranks: self.nranks,
            nnodes: self.nnodes,
            cuda_dev: self.cuda_dev,
            name: self.name,
            nccl_version: self.nccl_version,
            path: self.path,
            host_ns: self.host_ns,
            gpu: self.gpu,
        }
    }
}

/// A device's calibration: GPU time + `offset_ns` is host time, within `error_ns`.
pub fn calibration(cuda_dev: i32, offset_ns: i64, error_ns: u32) -> Record {
    Record::Calibration {
        cuda_dev,
        offset_ns,
        error_ns,
        drift_ppb: 0,
        host_ns: 0,
    }
}
