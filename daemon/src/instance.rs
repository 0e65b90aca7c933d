//! One completed collective (or p2p) instance as the daemon carries it from assembly to statistics,
//! the spool, live subscribers and export. It holds what the API's [`Collective`] message holds, but
//! its strings stay in the process's [`Names`], shared by every instance of that process: building,
//! counting and queueing an instance allocates nothing per string. Inside the ingest thread an
//! [`Instance`] is plain values read with its segment's names ([`InstanceRef`]); only one that leaves
//! it (export queue, live watchers) takes a share of them ([`Shared`]): a reference count per instance
//! is a locked instruction, which measured as the single most expensive step of ingest. The message
//! is built only where an instance leaves the daemon (spool file, Watch stream).

use std::sync::Arc;

use ncclscope_proto::api::{ChannelWork, Collective, LiveSpans};
use ncclscope_proto::segment::Pod;
use ncclscope_proto::{Gpu, StrId, TimingSource};
use serde::{Deserialize, Serialize};

/// The strings of one process: its job and host, and the strings its records define by id, with its
/// uid. The assembler replaces its copy when a record defines a string (copy on write), so an
/// instance keeps the strings that were current when it was built. The strings sit in chunks of
/// [`CHUNK`] ids, each shared between copies: a new string copies one chunk and the chunk list, not
/// every string (a process defining strings while its instances wait for export pins one small copy
/// per definition).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Names {
    /// The uid the kernel vouched for at registration (SO_PEERCRED, the segment's owner): unlike
    /// everything the segment says (job id, communicator hash, rank), it cannot be claimed. Every
    /// series, job, spool directory and trace is keyed by it.
    pub uid: u32,
    pub job_id: String,
    pub host: String,
    /// The Kubernetes pod the process claims ("" outside Kubernetes).
    pub pod: Pod,
    /// The Slurm job the process claims to run in ("" outside Slurm).
    pub slurm_job_id: String,
    chunks: Vec<Option<Arc<Chunk>>>,
}

/// Ids per chunk of [`Names`].
const CHUNK: usize = 64;
type Chunk = [Option<Arc<str>>; CHUNK];

impl Names {
    pub fn new(uid: u32, job_id: String, host: String) -> Names {
        Names {
            uid,
            job_id,
            host,
            pod: Pod::default(),
            slurm_job_id: String::new(),
            chunks: Vec::new(),
        }
    }

    /// The string `id` names ("" if it was never defined).
    pub fn get(&self, id: StrId) -> &str {
        self.defined(id).unwrap_or("")
    }

    /// The string `id` names, if it was defined.
    pub fn defined(&self, id: StrId) -> Option<&str> {
        let (chunk, at) = (id.0 as usize / CHUNK, id.0 as usize % CHUNK);
        self.chunks.get(chunk)?.as_ref()?[at].as_deref()
    }

    pub fn set(&mut self, id: StrId, text: String) {
        let (chunk, at) = (id.0 as usize / CHUNK, id.0 as usize % CHUNK);
        if self.chunks.len() <= chunk {
            self.chunks.resize(chunk + 1, None);
        }
        let c = self.chunks[chunk].get_or_insert_with(|| Arc::new(std::array::from_fn(|_| None)));
        Arc::make_mut(c)[at] = Some(text.into());
    }

    /// Every defined string, by id.
    pub fn iter(&self) -> impl Iterator<Item = (StrId, &str)> {
        self.chunks.iter().enumerate().flat_map(|(i, c)| {
            c.iter().flat_map(move |c| {
                c.iter().enumerate().filter_map(move |(at, t)| {
                    t.as_deref().map(|t| (StrId((i * CHUNK + at) as u16), t))
                })
            })
        })
    }
}

/// What a Coll or P2p is, as its host event describes it: the one description shared by the
/// operation in flight, the captured operation its replays are built from (both saved for resume:
/// `resume`'s golden tests pin its format) and the instance. Its strings are ids into the names of
/// its process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Desc {
    /// NCCL's seqNumber for a collective (per communicator and type); the assembler's numbering
    /// per (communicator, peer, function) for a p2p.
    pub seq: u64,
    pub is_p2p: bool,
    #[serde(with = "str_id")]
    pub func: StrId,
    #[serde(with = "str_id")]
    pub datatype: StrId,
    #[serde(with = "str_id")]
    pub algo: StrId,
    #[serde(with = "str_id")]
    pub proto: StrId,
    pub count: u64,
    /// -1 for a p2p.
    pub root: i32,
    /// -1 for a collective.
    pub peer: i32,
    /// As NCCL's event descriptor has it (a uint8_t); the API's `Collective` widens it to u32.
    pub n_channels: u8,
}

/// Field meanings: see `Collective` in proto/ncclscope.proto. String fields are ids into the names
/// of the instance's process (read them through [`InstanceRef`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Instance {
    pub pid: u32,
    pub comm_hash: u64,
    pub comm_name: StrId,
    pub rank: u32,
    pub nranks: u32,
    pub nnodes: u32,
    pub desc: Desc,
    pub bytes: u64,
    pub enqueue_unix_ns: u64,
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    pub exec_ns: u64,
    pub timing_source: TimingSource,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
    pub calibration_error_ns: u32,
    pub channels: Vec<ChannelWork>,
    /// 0: launched eagerly; r >= 1: the r-th graph replay on the communicator (see `Collective`).
    pub replay: u32,
    /// What the live OTLP export sends for it: decided once, when the engine records it, and
    /// spooled with it so that a file export writes the same spans.
    pub live_spans: LiveSpans,
    /// The rank's GPU, as its process's driver named it (none in simulation or without a driver).
    pub gpu: Option<Gpu>,
    /// (start, end) of its trace's root span, when this instance carries it: decided by the engine
    /// when it records the instance (see `Collective`).
    pub trace_root: Option<(u64, u64)>,
    /// The rank's node-local lateness, for its span (see `Collective.local_lateness_ns`).
    pub local_lateness_ns: Option<u64>,
}

impl Instance {
    /// A copy without its channels' work (all a root span needs), with `trace_root` as its only
    /// span.
    pub fn root_only(&self, trace_root: Option<(u64, u64)>) -> Instance {
        Instance {
            pid: self.pid,
            comm_hash: self.comm_hash,
            comm_name: self.comm_name,
            rank: self.rank,
            nranks: self.nranks,
            nnodes: self.nnodes,
            desc: self.desc,
            bytes: self.bytes,
            enqueue_unix_ns: self.enqueue_unix_ns,
            start_unix_ns: self.start_unix_ns,
            end_unix_ns: self.end_unix_ns,
            exec_ns: self.exec_ns,
            timing_source: self.timing_source,
            algbw_gbs: self.algbw_gbs,
            busbw_gbs: self.busbw_gbs,
            calibration_error_ns: self.calibration_error_ns,
            channels: Vec::new(),
            replay: self.replay,
            live_spans: LiveSpans::None,
            gpu: self.gpu,
            trace_root,
            local_lateness_ns: None,
        }
    }
}

/// An instance read with its process's names.
#[derive(Clone, Copy, Debug)]
pub struct InstanceRef<'a> {
    pub inst: &'a Instance,
    pub names: &'a Arc<Names>,
}

impl std::ops::Deref for InstanceRef<'_> {
    type Target = Instance;

    fn deref(&self) -> &Instance {
        self.inst
    }
}

impl<'a> InstanceRef<'a> {
    pub fn uid(&self) -> u32 {
        self.names.uid
    }

    pub fn job_id(&self) -> &'a str {
        &self.names.job_id
    }

    pub fn host(&self) -> &'a str {
        &self.names.host
    }

    pub fn pod(&self) -> &'a Pod {
        &self.names.pod
    }

    pub fn comm_name(&self) -> &'a str {
        self.names.get(self.inst.comm_name)
    }

    pub fn func(&self) -> &'a str {
        self.names.get(self.inst.desc.func)
    }

    pub fn datatype(&self) -> &'a str {
        self.names.get(self.inst.desc.datatype)
    }

    pub fn algo(&self) -> &'a str {
        self.names.get(self.inst.desc.algo)
    }

    pub fn proto(&self) -> &'a str {
        self.names.get(self.inst.desc.proto)
    }

    pub fn to_message(&self) -> Collective {
        Collective {
            job_id: self.job_id().into(),
            slurm_job_id: self.names.slurm_job_id.clone(),
            host: self.host().into(),
            pid: self.pid,
            comm_hash: self.comm_hash,
            comm_name: self.comm_name().into(),
            rank: self.rank,
            nranks: self.nranks,
            nnodes: self.nnodes,
            seq: self.desc.seq,
            func: self.func().into(),
            datatype: self.datatype().into(),
            algo: self.algo().into(),
            proto: self.proto().into(),
            count: self.desc.count,
            bytes: self.bytes,
            root: self.desc.root,
            peer: self.desc.peer,
            n_channels: self.desc.n_channels.into(),
            enqueue_unix_ns: self.enqueue_unix_ns,
            start_unix_ns: self.start_unix_ns,
            end_unix_ns: self.end_unix_ns,
            exec_ns: self.exec_ns,
            timing_source: self.timing_source.as_str().into(),
            algbw_gbs: self.algbw_gbs,
            busbw_gbs: self.busbw_gbs,
            calibration_error_ns: self.calibration_error_ns,
            channels: self.channels.clone(),
            is_p2p: self.desc.is_p2p,
            uid: self.uid(),
            replay: self.replay,
            live_spans: self.live_spans as i32,
            gpu: self.gpu.map(|g| g.ordinal),
            gpu_uuid: self.gpu.map(|g| g.uuid_text()).unwrap_or_default(),
            trace_root_start_unix_ns: self.trace_root.map_or(0, |r| r.0),
            trace_root_end_unix_ns: self.trace_root.map_or(0, |r| r.1),
            local_lateness_ns: self.local_lateness_ns,
            k8s_pod: self.names.pod.name.clone(),
            k8s_namespace: self.names.pod.namespace.clone(),
        }
    }
}

/// An instance with a share of its process's names: one that leaves the ingest thread.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Shared {
    pub inst: Instance,
    pub names: Arc<Names>,
}

impl Shared {
    pub fn view(&self) -> InstanceRef<'_> {
        InstanceRef {
            inst: &self.inst,
            names: &self.names,
        }
    }
}

/// For instances read back from a spool or the API (an unknown timing source reads as "host").
impl From<&Collective> for Shared {
    fn from(c: &Collective) -> Shared {
        let mut names = Names::new(c.uid, c.job_id.clone(), c.host.clone());
        names.pod = Pod {
            name: c.k8s_pod.clone(),
            namespace: c.k8s_namespace.clone(),
        };
        names.slurm_job_id = c.slurm_job_id.clone();
        let [comm_name, func, datatype, algo, proto] = [1, 2, 3, 4, 5].map(StrId);
        for (id, text) in [
            (comm_name, &c.comm_name),
            (func, &c.func),
            (datatype, &c.datatype),
            (algo, &c.algo),
            (proto, &c.proto),
        ] {
            names.set(id, text.clone());
        }
        let inst = Instance {
            pid: c.pid,
            comm_hash: c.comm_hash,
            comm_name,
            rank: c.rank,
            nranks: c.nranks,
            nnodes: c.nnodes,
            desc: Desc {
                seq: c.seq,
                is_p2p: c.is_p2p,
                func,
                datatype,
                algo,
                proto,
                count: c.count,
                root: c.root,
                peer: c.peer,
                // The daemon writes at most 255; more, from elsewhere, reads as the most there can be.
                n_channels: c.n_channels.try_into().unwrap_or(u8::MAX),
            },
            bytes: c.bytes,
            enqueue_unix_ns: c.enqueue_unix_ns,
            start_unix_ns: c.start_unix_ns,
            end_unix_ns: c.end_unix_ns,
            exec_ns: c.exec_ns,
            timing_source: TimingSource::parse(&c.timing_source),
            algbw_gbs: c.algbw_gbs,
            busbw_gbs: c.busbw_gbs,
            calibration_error_ns: c.calibration_error_ns,
            channels: c.channels.clone(),
            replay: c.replay,
            live_spans: c.live_spans(),
            gpu: c
                .gpu
                .and_then(|ordinal| Gpu::from_text(ordinal, &c.gpu_uuid)),
            trace_root: (c.trace_root_end_unix_ns != 0)
                .then_some((c.trace_root_start_unix_ns, c.trace_root_end_unix_ns)),
            local_lateness_ns: c.local_lateness_ns,
        };
        Shared {
            inst,
            names: Arc::new(names),
        }
    }
}

/// A string id saved as its number.
mod str_id {
    use ncclscope_proto::StrId;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(id: &StrId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u16(id.0)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<StrId, D::Error> {
        u16::deserialize(d).map(StrId)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_round_trip_keeps_every_field() {
        let m = Collective {
            job_id: "j".into(),
            host: "h".into(),
            pid: 3,
            comm_hash: 4,
            comm_name: "c".into(),
            rank: 5,
            nranks: 6,
            nnodes: 7,
            seq: 8,
            func: "AllReduce".into(),
            datatype: "ncclFloat32".into(),
            algo: "RING".into(),
            proto: "LL".into(),
            count: 9,
            bytes: 10,
            root: -1,
            peer: 11,
            n_channels: 2,
            enqueue_unix_ns: 12,
            start_unix_ns: 13,
            end_unix_ns: 14,
            exec_ns: 15,
            timing_source: "device_hook".into(),
            algbw_gbs: 1.5,
            busbw_gbs: 2.5,
            calibration_error_ns: 16,
            channels: vec![ChannelWork {
                channel: 1,
                start_unix_ns: 13,
                end_unix_ns: 14,
                work_items: 1,
            }],
            is_p2p: true,
            uid: 17,
            replay: 3,
            live_spans: LiveSpans::Channels as i32,
            gpu: Some(2),
            gpu_uuid: "GPU-8d1c2a3b-0001-0203-0405-06070809feff".into(),
            trace_root_start_unix_ns: 12,
            trace_root_end_unix_ns: 18,
            local_lateness_ns: Some(19),
            k8s_pod: "train-0-abcde".into(),
            k8s_namespace: "ml-team".into(),
            slurm_job_id: "4711".into(),
        };
        let s = Shared::from(&m);
        let i = s.view();
        assert_eq!((i.func(), i.comm_name(), i.host()), ("AllReduce", "c", "h"));
        assert_eq!(i.to_message(), m);
        // More channels than NCCL's uint8_t holds (not from a daemon): the most there can be.
        let wide = Shared::from(&Collective {
            n_channels: 300,
            ..m
        });
        assert_eq!(wide.inst.desc.n_channels, u8::MAX);
    }

    #[test]
    fn instances_keep_the_strings_of_their_time() {
        let mut names = Arc::new(Names::new(0, "j".into(), "h".into()));
        Arc::make_mut(&mut names).set(StrId(1), "AllReduce".into());
        let old = Shared {
            inst: Instance {
                desc: Desc {
                    func: StrId(1),
                    ..Desc::default()
                },
                ..Default::default()
            },
            names: names.clone(),
        };
        Arc::make_mut(&mut names).set(StrId(1), "AllGather".into());
        assert_eq!(old.view().func(), "AllReduce");
        assert_eq!(names.get(StrId(1)), "AllGather");
        assert_eq!(names.get(StrId(2)), "");
    }
}
