//! The fixed-size records that travel through a segment's ring, plugin -> daemon.
//!
//! A record is [`RECORD_WORDS`] little 64-bit words. Word 0 carries the kind in its low byte and the
//! process-local communicator index in its high 32 bits; the other words depend on the kind. Strings
//! (collective names, datatypes, algorithms, communicator names) travel once as [`Record::Str`] and are
//! referred to by a [`StrId`] afterwards. Decoding treats the words as untrusted: an unknown kind or an
//! out-of-range field is a [`DecodeError`], never a panic.

/// Words per record; a record is 64 bytes, one cache line.
pub const RECORD_WORDS: usize = 8;
/// NCCL's channel limit (`MAXCHANNELS`): every channel index in a record is below it.
pub const MAX_CHANNELS: u8 = 64;
/// Bytes of text one [`Record::Str`] carries; longer strings are truncated by the writer.
pub const STR_BYTES: usize = 48;

/// An interned string, process-local. 0 means "no string" (NCCL passed NULL).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StrId(pub u16);

/// The GPU a communicator runs on, as the CUDA driver names it in the process: its device ordinal
/// (`cuCtxGetDevice` on NCCL's init thread) and UUID (`cuDeviceGetUuid_v2`), which DCGM exporter's
/// `UUID` label spells `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`. The UUID is never all zero (the
/// encoding's "no GPU").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Gpu {
    pub ordinal: u32,
    pub uuid: [u8; 16],
}

impl Gpu {
    /// The UUID as CUDA's tools and DCGM print it.
    pub fn uuid_text(&self) -> String {
        let hex = |r: std::ops::Range<usize>| {
            self.uuid[r]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        format!(
            "GPU-{}-{}-{}-{}-{}",
            hex(0..4),
            hex(4..6),
            hex(6..8),
            hex(8..10),
            hex(10..16)
        )
    }

    /// The GPU whose UUID prints as `text` (see [`Gpu::uuid_text`]), if it is one.
    pub fn from_text(ordinal: u32, text: &str) -> Option<Gpu> {
        let hex: String = text.strip_prefix("GPU-")?.split('-').collect();
        let mut uuid = [0u8; 16];
        if hex.len() != 32 || !hex.is_ascii() {
            return None;
        }
        for (i, b) in uuid.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
        }
        (uuid != [0; 16]).then_some(Gpu { ordinal, uuid })
    }
}

/// Which timing path produced a communicator's kernel records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum TimingPath {
    /// Stock NCCL: KernelCh events with `pTimer` from NCCL's own rings.
    KernelCh = 0,
    /// The RFC device hook: [`Record::DevWork`] from the plugin's rings.
    DeviceHook = 1,
}

/// How an instance's times were taken: the API's `Collective.timing_source` and its spans'
/// `nccl.timing_source`, as text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TimingSource {
    /// Stock NCCL's KernelCh events ([`TimingPath::KernelCh`]).
    KernelGpu,
    /// The RFC device hook's work items ([`TimingPath::DeviceHook`]).
    DeviceHook,
    /// Host events only: no exec time (they bracket the enqueue, not the work).
    #[default]
    Host,
}

impl TimingSource {
    pub const ALL: [TimingSource; 3] = [Self::KernelGpu, Self::DeviceHook, Self::Host];

    /// Timed on the GPU by `path`'s kernel records.
    pub fn of(path: TimingPath) -> TimingSource {
        match path {
            TimingPath::KernelCh => Self::KernelGpu,
            TimingPath::DeviceHook => Self::DeviceHook,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::KernelGpu => "kernel_gpu",
            Self::DeviceHook => "device_hook",
            Self::Host => "host",
        }
    }

    /// The source `text` names; an unknown one reads as [`Self::Host`] (no GPU time to trust).
    pub fn parse(text: &str) -> TimingSource {
        (Self::ALL.into_iter())
            .find(|s| s.as_str() == text)
            .unwrap_or(Self::Host)
    }
}

/// One record. Times named `host_ns` are CLOCK_REALTIME nanoseconds taken by the plugin; `gpu_*` are
/// raw `%globaltimer` nanoseconds, mapped to host time by the latest [`Record::Calibration`] of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// A communicator was initialised in this process (`init`).
    Comm {
        comm: u32,
        comm_hash: u64,
        rank: u32,
        nranks: u32,
        nnodes: u32,
        cuda_dev: i32,
        name: StrId,
        nccl_version: u32,
        path: TimingPath,
        host_ns: u64,
        /// Its GPU, if the plugin could ask the driver (none in simulation or without a driver).
        /// Words 6 and 7 and the top of word 4, which plugins before it left zero: an older
        /// daemon ignores it, and an older plugin's communicators read as having none.
        gpu: Option<Gpu>,
    },
    /// The communicator was finalized; nothing more will come for it.
    CommEnd { comm: u32, host_ns: u64 },
    /// Defines `id` as `text` (at most [`STR_BYTES`] bytes of UTF-8, lossily decoded by the reader).
    Str {
        id: StrId,
        len: u8,
        bytes: [u8; STR_BYTES],
    },
    /// A collective was enqueued (`startEvent(Coll)`). `id` is unique within the process and joins the
    /// collective's kernel records through their `parent`.
    CollStart {
        comm: u32,
        id: u64,
        seq: u64,
        func: StrId,
        datatype: StrId,
        algo: StrId,
        proto: StrId,
        count: u64,
        root: i32,
        n_channels: u8,
        n_warps: u8,
        host_ns: u64,
        /// Enqueued while its stream was being captured into a CUDA graph (NCCL's CollApi
        /// `graphCaptured`): its kernel work comes at every replay of the graph, not now.
        captured: bool,
    },
    /// A point-to-point operation was enqueued (`startEvent(P2p)`).
    P2pStart {
        comm: u32,
        id: u64,
        func: StrId,
        datatype: StrId,
        count: u64,
        peer: i32,
        n_channels: u8,
        host_ns: u64,
        /// As for [`Record::CollStart`] (NCCL's P2pApi `graphCaptured`).
        captured: bool,
    },
    /// `stopEvent` of a Coll or P2p (host-side; the kernel work is in the kernel records).
    OpStop { comm: u32, id: u64, host_ns: u64 },
    /// One channel's kernel work for one Coll/P2p on stock NCCL (KernelCh start, KernelChStop).
    KernelCh {
        comm: u32,
        parent: u64,
        channel: u8,
        gpu_start: u64,
        gpu_stop: u64,
        host_ns: u64,
    },
    /// A KernelPhase child of a KernelCh (NCCL >= 2.31, symmetric kernels).
    KernelPhase {
        comm: u32,
        parent: u64,
        channel: u8,
        phase: u8,
        gpu_start: u64,
        gpu_stop: u64,
    },
    /// One work item seen by the device hook, START and STOP paired by the plugin's drain thread.
    DevWork {
        comm: u32,
        channel: u8,
        func_id: u32,
        work_counter: u64,
        gpu_start: u64,
        gpu_stop: u64,
    },
    /// GPU clock -> host clock for `cuda_dev`: `host = gpu + offset_ns`, good to `error_ns`, measured at
    /// `host_ns`. `drift_ppb` is the offset's drift since the previous calibration.
    Calibration {
        cuda_dev: i32,
        offset_ns: i64,
        error_ns: u32,
        drift_ppb: i32,
        host_ns: u64,
    },
    /// Names a device-hook `func_id` (from `ncclProfilerDevFuncName` on an RFC host).
    FuncName { func_id: u32, name: StrId },
}

/// Why a record could not be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("unknown record kind {0}")]
    UnknownKind(u8),
    #[error("record kind {kind}: field {field} out of range")]
    BadField { kind: u8, field: &'static str },
}

mod kind {
    pub const COMM: u8 = 1;
    pub const COMM_END: u8 = 2;
    pub const STR: u8 = 3;
    pub const COLL_START: u8 = 4;
    pub const P2P_START: u8 = 5;
    pub const OP_STOP: u8 = 6;
    pub const KERNEL_CH: u8 = 7;
    pub const KERNEL_PHASE: u8 = 8;
    pub const DEV_WORK: u8 = 9;
    pub const CALIBRATION: u8 = 10;
    pub const FUNC_NAME: u8 = 11;
}

fn head(kind: u8, comm: u32) -> u64 {
    kind as u64 | ((comm as u64) << 32)
}

fn pack_ids(a: StrId, b: StrId, c: StrId, d: StrId) -> u64 {
    a.0 as u64 | (b.0 as u64) << 16 | (c.0 as u64) << 32 | (d.0 as u64) << 48
}

fn unpack_id(word: u64, index: u32) -> StrId {
    StrId((word >> (16 * index)) as u16)
}

impl Record {
    /// The communicator index the record belongs to, if it has one.
    pub fn comm(&self) -> Option<u32> {
        match *self {
            Record::Comm { comm, .. }
            | Record::CommEnd { comm, .. }
            | Record::CollStart { comm, .. }
            | Record::P2pStart { comm, .. }
            | Record::OpStop { comm, .. }
            | Record::KernelCh { comm, .. }
            | Record::KernelPhase { comm, .. }
            | Record::DevWork { comm, .. } => Some(comm),
            Record::Str { .. } | Record::Calibration { .. } | Record::FuncName { .. } => None,
        }
    }

    /// Builds a [`Record::Str`], truncating `text` to [`STR_BYTES`] at a UTF-8 boundary.
    pub fn str(id: StrId, text: &[u8]) -> Record {
        let mut len = text.len().min(STR_BYTES);
        if let Ok(s) = std::str::from_utf8(text) {
            while !s.is_char_boundary(len) {
                len -= 1;
            }
        }
        let mut bytes = [0u8; STR_BYTES];
        bytes[..len].copy_from_slice(&text[..len]);
        Record::Str {
            id,
            len: len as u8,
            bytes,
        }
    }

    pub fn encode(&self) -> [u64; RECORD_WORDS] {
        let mut w = [0u64; RECORD_WORDS];
        match *self {
            Record::Comm {
                comm,
                comm_hash,
                rank,
                nranks,
                nnodes,
                cuda_dev,
                name,
                nccl_version,
                path,
                host_ns,
                gpu,
            } => {
                w[0] = head(kind::COMM, comm) | (path as u64) << 8 | (name.0 as u64) << 16;
                w[1] = comm_hash;
                w[2] = rank as u64 | (nranks as u64) << 32;
                w[3] = nnodes as u64 | (cuda_dev as u32 as u64) << 32;
                w[4] = nccl_version as u64;
                w[5] = host_ns;
                if let Some(g) = gpu {
                    w[4] |= (g.ordinal as u64) << 32;
                    w[6] = u64::from_le_bytes(g.uuid[..8].try_into().expect("8 bytes"));
                    w[7] = u64::from_le_bytes(g.uuid[8..].try_into().expect("8 bytes"));
                }
            }
            Record::CommEnd { comm, host_ns } => {
                w[0] = head(kind::COMM_END, comm);
                w[1] = host_ns;
            }
            Record::Str { id, len, bytes } => {
                w[0] = head(kind::STR, 0) | (len as u64) << 8 | (id.0 as u64) << 16;
                for (i, chunk) in bytes.chunks_exact(8).enumerate() {
                    w[2 + i] = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
                }
            }
            Record::CollStart {
                comm,
                id,
                seq,
                func,
                datatype,
                algo,
                proto,
                count,
                root,
                n_channels,
                n_warps,
                host_ns,
                captured,
            } => {
                w[0] = head(kind::COLL_START, comm) | (captured as u64) << 8;
                w[1] = id;
                w[2] = seq;
                w[3] = count;
                w[4] = pack_ids(func, datatype, algo, proto);
                w[5] = root as u32 as u64 | (n_channels as u64) << 32 | (n_warps as u64) << 40;
                w[6] = host_ns;
            }
            Record::P2pStart {
                comm,
                id,
                func,
                datatype,
                count,
                peer,
                n_channels,
                host_ns,
                captured,
            } => {
                w[0] = head(kind::P2P_START, comm) | (captured as u64) << 8;
                w[1] = id;
                w[3] = count;
                w[4] = pack_ids(func, datatype, StrId(0), StrId(0));
                w[5] = peer as u32 as u64 | (n_channels as u64) << 32;
                w[6] = host_ns;
            }
            Record::OpStop { comm, id, host_ns } => {
                w[0] = head(kind::OP_STOP, comm);
                w[1] = id;
                w[6] = host_ns;
            }
            Record::KernelCh {
                comm,
                parent,
                channel,
                gpu_start,
                gpu_stop,
                host_ns,
            } => {
                w[0] = head(kind::KERNEL_CH, comm) | (channel as u64) << 8;
                w[1] = parent;
                w[2] = gpu_start;
                w[3] = gpu_stop;
                w[6] = host_ns;
            }
            Record::KernelPhase {
                comm,
                parent,
                channel,
                phase,
                gpu_start,
                gpu_stop,
            } => {
                w[0] =
                    head(kind::KERNEL_PHASE, comm) | (channel as u64) << 8 | (phase as u64) << 16;
                w[1] = parent;
                w[2] = gpu_start;
                w[3] = gpu_stop;
            }
            Record::DevWork {
                comm,
                channel,
                func_id,
                work_counter,
                gpu_start,
                gpu_stop,
            } => {
                w[0] = head(kind::DEV_WORK, comm) | (channel as u64) << 8;
                w[1] = work_counter;
                w[2] = gpu_start;
                w[3] = gpu_stop;
                w[4] = func_id as u64;
            }
            Record::Calibration {
                cuda_dev,
                offset_ns,
                error_ns,
                drift_ppb,
                host_ns,
            } => {
                w[0] = head(kind::CALIBRATION, 0);
                w[1] = cuda_dev as u32 as u64 | (error_ns as u64) << 32;
                w[2] = offset_ns as u64;
                w[3] = drift_ppb as u32 as u64;
                w[6] = host_ns;
            }
            Record::FuncName { func_id, name } => {
                w[0] = head(kind::FUNC_NAME, 0) | (name.0 as u64) << 16;
                w[1] = func_id as u64;
            }
        }
        w
    }

    pub fn decode(w: &[u64; RECORD_WORDS]) -> Result<Record, DecodeError> {
        let k = w[0] as u8;
        let comm = (w[0] >> 32) as u32;
        let byte1 = (w[0] >> 8) as u8;
        let channel = |field| {
            if byte1 < MAX_CHANNELS {
                Ok(byte1)
            } else {
                Err(DecodeError::BadField { kind: k, field })
            }
        };
        let flag = |field| match byte1 {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError::BadField { kind: k, field }),
        };
        Ok(match k {
            kind::COMM => Record::Comm {
                comm,
                comm_hash: w[1],
                rank: w[2] as u32,
                nranks: (w[2] >> 32) as u32,
                nnodes: w[3] as u32,
                cuda_dev: (w[3] >> 32) as u32 as i32,
                name: StrId((w[0] >> 16) as u16),
                nccl_version: w[4] as u32,
                path: match byte1 {
                    0 => TimingPath::KernelCh,
                    1 => TimingPath::DeviceHook,
                    _ => {
                        return Err(DecodeError::BadField {
                            kind: k,
                            field: "path",
                        });
                    }
                },
                host_ns: w[5],
                gpu: (w[6] | w[7] != 0).then(|| {
                    let mut uuid = [0u8; 16];
                    uuid[..8].copy_from_slice(&w[6].to_le_bytes());
                    uuid[8..].copy_from_slice(&w[7].to_le_bytes());
                    Gpu {
                        ordinal: (w[4] >> 32) as u32,
                        uuid,
                    }
                }),
            },
            kind::COMM_END => Record::CommEnd {
                comm,
                host_ns: w[1],
            },
            kind::STR => {
                if byte1 as usize > STR_BYTES {
                    return Err(DecodeError::BadField {
                        kind: k,
                        field: "len",
                    });
                }
                let mut bytes = [0u8; STR_BYTES];
                for (i, chunk) in bytes.chunks_exact_mut(8).enumerate() {
                    chunk.copy_from_slice(&w[2 + i].to_le_bytes());
                }
                Record::Str {
                    id: StrId((w[0] >> 16) as u16),
                    len: byte1,
                    bytes,
                }
            }
            kind::COLL_START => Record::CollStart {
                comm,
                id: w[1],
                seq: w[2],
                count: w[3],
                func: unpack_id(w[4], 0),
                datatype: unpack_id(w[4], 1),
                algo: unpack_id(w[4], 2),
                proto: unpack_id(w[4], 3),
                root: w[5] as u32 as i32,
                n_channels: (w[5] >> 32) as u8,
                n_warps: (w[5] >> 40) as u8,
                host_ns: w[6],
                captured: flag("captured")?,
            },
            kind::P2P_START => Record::P2pStart {
                comm,
                id: w[1],
                count: w[3],
                func: unpack_id(w[4], 0),
                datatype: unpack_id(w[4], 1),
                peer: w[5] as u32 as i32,
                n_channels: (w[5] >> 32) as u8,
                host_ns: w[6],
                captured: flag("captured")?,
            },
            kind::OP_STOP => Record::OpStop {
                comm,
                id: w[1],
                host_ns: w[6],
            },
            kind::KERNEL_CH => Record::KernelCh {
                comm,
                channel: channel("channel")?,
                parent: w[1],
                gpu_start: w[2],
                gpu_stop: w[3],
                host_ns: w[6],
            },
            kind::KERNEL_PHASE => Record::KernelPhase {
                comm,
                channel: channel("channel")?,
                phase: (w[0] >> 16) as u8,
                parent: w[1],
                gpu_start: w[2],
                gpu_stop: w[3],
            },
            kind::DEV_WORK => Record::DevWork {
                comm,
                channel: channel("channel")?,
                work_counter: w[1],
                gpu_start: w[2],
                gpu_stop: w[3],
                func_id: w[4] as u32,
            },
            kind::CALIBRATION => Record::Calibration {
                cuda_dev: w[1] as u32 as i32,
                error_ns: (w[1] >> 32) as u32,
                offset_ns: w[2] as i64,
                drift_ppb: w[3] as u32 as i32,
                host_ns: w[6],
            },
            kind::FUNC_NAME => Record::FuncName {
                func_id: w[1] as u32,
                name: StrId((w[0] >> 16) as u16),
            },
            other => return Err(DecodeError::UnknownKind(other)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Record> {
        vec![
            Record::Comm {
                comm: 3,
                comm_hash: 0xdead_beef_0123_4567,
                rank: 5,
                nranks: 8,
                nnodes: 2,
                cuda_dev: -1,
                name: StrId(9),
                nccl_version: 22809,
                path: TimingPath::DeviceHook,
                host_ns: 1_700_000_000_000_000_000,
                gpu: Some(Gpu {
                    ordinal: 7,
                    uuid: *b"\x8d\x1c\x2a\x3b\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\xfe\xff",
                }),
            },
            Record::CommEnd {
                comm: u32::MAX,
                host_ns: 7,
            },
            Record::str(StrId(65535), b"AllReduce"),
            Record::CollStart {
                comm: 1,
                id: u64::MAX,
                seq: 42,
                func: StrId(1),
                datatype: StrId(2),
                algo: StrId(3),
                proto: StrId(4),
                count: 1 << 40,
                root: -1,
                n_channels: 32,
                n_warps: 16,
                host_ns: 11,
                captured: false,
            },
            Record::P2pStart {
                comm: 2,
                id: 8,
                func: StrId(5),
                datatype: StrId(6),
                count: 3,
                peer: 7,
                n_channels: 2,
                host_ns: 12,
                captured: true,
            },
            Record::OpStop {
                comm: 0,
                id: 8,
                host_ns: 13,
            },
            Record::KernelCh {
                comm: 0,
                parent: 8,
                channel: 63,
                gpu_start: 100,
                gpu_stop: 200,
                host_ns: 14,
            },
            Record::KernelPhase {
                comm: 0,
                parent: 9,
                channel: 1,
                phase: 2,
                gpu_start: 1,
                gpu_stop: 2,
            },
            Record::DevWork {
                comm: 4,
                channel: 17,
                func_id: 672,
                work_counter: 1 << 50,
                gpu_start: 5,
                gpu_stop: 6,
            },
            Record::Calibration {
                cuda_dev: 3,
                offset_ns: -123456789,
                error_ns: 900,
                drift_ppb: -12,
                host_ns: 15,
            },
            Record::FuncName {
                func_id: 672,
                name: StrId(3),
            },
        ]
    }

    #[test]
    fn every_kind_round_trips() {
        for r in samples() {
            assert_eq!(Record::decode(&r.encode()), Ok(r), "{r:?}");
        }
    }

    /// Plugins before the GPU identity leave words 6 and 7 and the top of word 4 zero: no GPU, not
    /// a guessed one; the UUID prints as DCGM's `UUID` label does.
    #[test]
    fn a_comm_without_gpu_words_has_no_gpu() {
        let mut r = samples()[0];
        let Record::Comm { gpu, .. } = &mut r else {
            unreachable!()
        };
        let g = gpu.take().unwrap();
        assert_eq!(g.uuid_text(), "GPU-8d1c2a3b-0001-0203-0405-06070809feff");
        assert_eq!(Gpu::from_text(7, &g.uuid_text()), Some(g));
        assert_eq!(Gpu::from_text(7, ""), None);
        let w = r.encode();
        assert_eq!((w[4] >> 32, w[6], w[7]), (0, 0, 0));
        assert_eq!(Record::decode(&w), Ok(r));
    }

    #[test]
    fn str_truncates_at_a_char_boundary() {
        let text = "é".repeat(30); // 60 bytes, 2 per char
        let Record::Str { len, bytes, .. } = Record::str(StrId(1), text.as_bytes()) else {
            unreachable!()
        };
        assert_eq!(len as usize, STR_BYTES);
        assert!(std::str::from_utf8(&bytes[..len as usize]).is_ok());
        let odd = "a".to_string() + &"é".repeat(30);
        let Record::Str { len, .. } = Record::str(StrId(1), odd.as_bytes()) else {
            unreachable!()
        };
        assert_eq!(len as usize, STR_BYTES - 1);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert_eq!(
            Record::decode(&[0xff; RECORD_WORDS]),
            Err(DecodeError::UnknownKind(0xff))
        );
        let mut w = Record::KernelCh {
            comm: 0,
            parent: 0,
            channel: 0,
            gpu_start: 0,
            gpu_stop: 0,
            host_ns: 0,
        }
        .encode();
        w[0] |= 200 << 8;
        assert!(matches!(
            Record::decode(&w),
            Err(DecodeError::BadField {
                field: "channel",
                ..
            })
        ));
        let mut w = Record::str(StrId(1), b"x").encode();
        w[0] |= 0xff << 8;
        assert!(matches!(
            Record::decode(&w),
            Err(DecodeError::BadField { field: "len", .. })
        ));
        // Every single-word corruption of every kind decodes or errors; none panics.
        for r in samples() {
            for i in 0..RECORD_WORDS {
                for v in [0, u64::MAX, 0x8000_0000_0000_00ff] {
                    let mut w = r.encode();
                    w[i] = v;
                    let _ = Record::decode(&w);
                }
            }
        }
    }
}
