//! The oracle of the plugin tests: does a segment hold exactly what the fake NCCL emitted?
//!
//! Per communicator the records must come in emission order: `Comm`, then per operation its start,
//! its `OpStop`, then per channel the KernelPhase children and the `KernelCh` (the fake host emits the
//! kernel events of one operation before the next operation starts), then `CommEnd`. Every field is
//! compared; strings must be defined (`Str`) before they are used. Device-hook work items (`DevWork`)
//! are compared as a set per communicator; `Calibration` and `FuncName` records are allowed anywhere.

use std::collections::{BTreeMap, HashMap, HashSet};

use anyhow::{Context, bail, ensure};
use ncclscope_proto::{Counter, Record, StrId, TimingPath};

use crate::process::Contents;
use crate::report::{CommReport, OpKind, Report};

/// What the plugin is expected to have done with the events.
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    /// The plugin reads v7-only fields (upstream NCCL >= 2.31): kernel variants and KernelPhase.
    pub v7_fields: bool,
    /// Every communicator was finalized (CommEnd present, segment closed).
    pub finalized: bool,
    /// Kernel events were emitted before the next operation (`false`: from an asynchronous proxy
    /// thread; then only their per-operation order and their content are checked, not their position).
    pub ordered: bool,
}

impl Expect {
    /// The common case: v6 fields only, every communicator finalized, kernel events in order.
    pub const FINALIZED: Expect = Expect {
        v7_fields: false,
        finalized: true,
        ordered: true,
    };
    /// The same for a rank that never finalized its communicators.
    pub const OPEN: Expect = Expect {
        finalized: false,
        ..Expect::FINALIZED
    };
}

/// Totals of a successful check.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub comms: usize,
    pub ops: usize,
    pub kernel_ch: usize,
    pub kernel_phase: usize,
    pub dev_work: usize,
    pub strings: usize,
    pub ignored: u64,
}

pub fn check(report: &Report, seg: &Contents, expect: Expect) -> anyhow::Result<Summary> {
    ensure!(
        seg.pid == report.pid,
        "segment handed over by pid {} != rank pid {}",
        seg.pid,
        report.pid
    );
    let strings = seg.strings()?;
    let mut defined = HashSet::new();
    let mut per_comm: BTreeMap<u32, Vec<Record>> = BTreeMap::new();
    let mut dev_work: HashMap<u32, Vec<Record>> = HashMap::new();
    for r in &seg.records {
        let used: &[StrId] = match r {
            Record::Str { id, .. } => {
                defined.insert(*id);
                &[]
            }
            Record::Comm { name, .. } => &[*name],
            Record::CollStart {
                func,
                datatype,
                algo,
                proto,
                ..
            } => &[*func, *datatype, *algo, *proto],
            Record::P2pStart { func, datatype, .. } => &[*func, *datatype],
            Record::FuncName { name, .. } => &[*name],
            _ => &[],
        };
        for id in used {
            ensure!(
                id.0 == 0 || defined.contains(id),
                "{r:?} uses string {id:?} before its definition"
            );
        }
        match r {
            Record::DevWork { comm, .. } => dev_work.entry(*comm).or_default().push(*r),
            Record::Str { .. } | Record::Calibration { .. } | Record::FuncName { .. } => {}
            _ => per_comm
                .entry(r.comm().context("record without a communicator")?)
                .or_default()
                .push(*r),
        }
    }
    let text = |id: StrId| -> anyhow::Result<String> {
        if id.0 == 0 {
            return Ok(String::new());
        }
        strings
            .get(&id)
            .cloned()
            .with_context(|| format!("undefined string {id:?}"))
    };
    ensure!(
        per_comm.len() == report.comms.iter().filter(|c| c.has_context).count(),
        "{} communicators in the segment, {} in the run",
        per_comm.len(),
        report.comms.len()
    );
    for r in &seg.records {
        let host_ns = match *r {
            Record::Comm { host_ns, .. }
            | Record::CommEnd { host_ns, .. }
            | Record::CollStart { host_ns, .. }
            | Record::P2pStart { host_ns, .. }
            | Record::OpStop { host_ns, .. }
            | Record::KernelCh { host_ns, .. } => host_ns,
            _ => continue,
        };
        // A millisecond of slack for the clock conversion (TSC -> CLOCK_REALTIME).
        ensure!(
            report.started_ns == 0
                || (report.started_ns - 1_000_000 <= host_ns
                    && host_ns <= report.ended_ns + 1_000_000),
            "host time {host_ns} of {r:?} outside the run [{}, {}]",
            report.started_ns,
            report.ended_ns
        );
    }
    let mut summary = Summary {
        strings: strings.len(),
        ..Summary::default()
    };
    let mut ids = HashSet::new();
    for (comm, records) in &per_comm {
        let Some(Record::Comm {
            comm_hash,
            rank,
            nranks,
            nnodes,
            name,
            nccl_version,
            path,
            cuda_dev,
            ..
        }) = records.first().copied()
        else {
            bail!(
                "communicator {comm}: first record is {:?}, not Comm",
                records.first()
            );
        };
        let rep: &CommReport = report
            .comms
            .iter()
            .find(|c| c.comm_hash == comm_hash)
            .with_context(|| format!("communicator {comm}: hash {comm_hash:#x} not in the run"))?;
        ensure!(
            (rank, nranks, nnodes) == (rep.rank as u32, rep.nranks as u32, rep.nnodes as u32),
            "communicator {comm}: rank/nranks/nnodes"
        );
        ensure!(
            text(name)? == rep.name.clone().unwrap_or_default(),
            "communicator {comm}: name"
        );
        ensure!(
            nccl_version == report.kind.version() as u32 || nccl_version == 0,
            "nccl_version {nccl_version}"
        );
        let want_path = if rep.has_hook {
            TimingPath::DeviceHook
        } else {
            TimingPath::KernelCh
        };
        ensure!(
            path == want_path,
            "communicator {comm}: path {path:?}, want {want_path:?}"
        );
        let _ = cuda_dev;
        let mut rest = Streams::new(&records[1..], expect.ordered);
        for (n, op) in rep.ops.iter().enumerate() {
            let ctx = || format!("communicator {comm}, operation {n} ({op:?})");
            let mut op_id = 0;
            let mut start_pos = 0;
            if op.started {
                let (pos, start) = rest
                    .host_at()
                    .with_context(|| format!("{}: start missing", ctx()))?;
                start_pos = pos;
                match (op.kind, start) {
                    (
                        OpKind::Coll,
                        Record::CollStart {
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
                            captured,
                            ..
                        },
                    ) => {
                        ensure!(captured == op.captured, "{}: captured flag", ctx());
                        let want_algo = match (&op.kernel_variant, expect.v7_fields) {
                            (Some(v), true) => v.clone(),
                            _ => op.algo.clone(),
                        };
                        ensure!(
                            (seq, text(func)?, text(datatype)?, text(algo)?, text(proto)?)
                                == (
                                    op.seq,
                                    op.func.clone(),
                                    op.datatype.clone(),
                                    want_algo,
                                    op.proto.clone()
                                ),
                            "{}: strings/seq of {start:?}",
                            ctx()
                        );
                        ensure!(
                            (count, root, n_channels, n_warps)
                                == (op.count, op.root_or_peer, op.n_channels, op.n_warps),
                            "{}: {start:?}",
                            ctx()
                        );
                        op_id = id;
                    }
                    (
                        OpKind::P2p,
                        Record::P2pStart {
                            id,
                            func,
                            datatype,
                            count,
                            peer,
                            n_channels,
                            captured,
                            ..
                        },
                    ) => {
                        ensure!(captured == op.captured, "{}: captured flag", ctx());
                        ensure!(
                            (text(func)?, text(datatype)?, count, peer, n_channels)
                                == (
                                    op.func.clone(),
                                    op.datatype.clone(),
                                    op.count,
                                    op.root_or_peer,
                                    op.n_channels
                                ),
                            "{}: {start:?}",
                            ctx()
                        );
                        op_id = id;
                    }
                    _ => bail!("{}: got {start:?}", ctx()),
                }
                ensure!(ids.insert(op_id), "{}: id {op_id} reused", ctx());
                let start_ns = match start {
                    Record::CollStart { host_ns, .. } | Record::P2pStart { host_ns, .. } => host_ns,
                    _ => 0,
                };
                summary.ops += 1;
                if op.captured {
                    // A captured operation's handle is not a pool slot: its stop records nothing.
                    continue;
                }
                let stop = rest.host();
                ensure!(
                    matches!(stop, Some(Record::OpStop { comm: c, id, host_ns }) if c == *comm && id == op_id && host_ns >= start_ns),
                    "{}: expected OpStop, got {stop:?}",
                    ctx()
                );
            }
            for k in op.kernels.iter().filter(|k| k.started) {
                if expect.v7_fields {
                    for ph in &k.phases {
                        let r = rest.kernel(start_pos);
                        let want = Record::KernelPhase {
                            comm: *comm,
                            parent: op_id,
                            channel: k.channel,
                            phase: ph.phase,
                            gpu_start: ph.gpu_start,
                            gpu_stop: ph.gpu_stop,
                        };
                        ensure!(r == Some(want), "{}: got {r:?}, want {want:?}", ctx());
                        summary.kernel_phase += 1;
                    }
                }
                let r = rest.kernel(start_pos);
                let ok = matches!(r, Some(Record::KernelCh { comm: c, parent, channel, gpu_start, gpu_stop, .. })
                    if c == *comm && parent == op_id && channel == k.channel
                        && gpu_start == k.gpu_start && gpu_stop == k.gpu_stop);
                ensure!(
                    ok,
                    "{}: got {r:?}, want KernelCh {k:?} of op {op_id}",
                    ctx()
                );
                summary.kernel_ch += 1;
            }
        }
        if expect.finalized {
            let end = rest.host();
            ensure!(
                matches!(end, Some(Record::CommEnd { comm: c, .. }) if c == *comm),
                "communicator {comm}: got {end:?}, want CommEnd"
            );
        }
        let extra = rest.remaining();
        ensure!(
            extra.is_empty(),
            "communicator {comm}: unexpected records {extra:?}"
        );

        let mut want_items: Vec<_> = rep.ops.iter().flat_map(|o| o.hook_items.iter()).collect();
        let got = dev_work.remove(comm).unwrap_or_default();
        ensure!(
            got.len() == want_items.len(),
            "communicator {comm}: {} DevWork, want {}",
            got.len(),
            want_items.len()
        );
        for r in got {
            let Record::DevWork {
                channel,
                func_id,
                work_counter,
                gpu_start,
                gpu_stop,
                ..
            } = r
            else {
                unreachable!()
            };
            let at = want_items
                .iter()
                .position(|i| {
                    (
                        i.channel,
                        i.func_id,
                        i.work_counter,
                        i.gpu_start,
                        i.gpu_stop,
                    ) == (channel, func_id, work_counter, gpu_start, gpu_stop)
                })
                .with_context(|| format!("communicator {comm}: unexpected {r:?}"))?;
            want_items.swap_remove(at);
            summary.dev_work += 1;
        }
        summary.comms += 1;
    }
    ensure!(
        dev_work.is_empty(),
        "DevWork for unknown communicators: {:?}",
        dev_work.keys()
    );
    // A replay's KernelCh events (stock NCCL) name a captured operation: counted and declined.
    let replay_kernels: usize = report
        .comms
        .iter()
        .flat_map(|c| &c.ops)
        .filter(|o| o.replay > 0)
        .map(|o| o.kernels.len())
        .sum();
    ensure!(
        seg.counter(Counter::ReplayKernelCh) == replay_kernels as u64,
        "replay_kernel_ch = {}, want {replay_kernels}",
        seg.counter(Counter::ReplayKernelCh)
    );
    for c in Counter::ALL {
        if c.is_loss() && c != Counter::ReplayKernelCh {
            ensure!(
                seg.counter(c) == 0,
                "loss counter {} = {}",
                c.name(),
                seg.counter(c)
            );
        }
    }
    summary.ignored = seg.counter(Counter::Ignored);
    ensure!(
        seg.closed == expect.finalized,
        "segment closed = {}",
        seg.closed
    );
    Ok(summary)
}

/// One communicator's records after its `Comm`, read in emission order: as one stream, or (for
/// asynchronous kernel events) as the host stream and the kernel stream, each in order, with every kernel
/// record after its operation's start.
struct Streams {
    host: std::collections::VecDeque<(usize, Record)>,
    kernel: std::collections::VecDeque<(usize, Record)>,
    ordered: bool,
}

impl Streams {
    fn new(records: &[Record], ordered: bool) -> Streams {
        let (mut host, mut kernel) = (
            std::collections::VecDeque::new(),
            std::collections::VecDeque::new(),
        );
        for (pos, r) in records.iter().enumerate() {
            let is_kernel = matches!(r, Record::KernelCh { .. } | Record::KernelPhase { .. });
            if is_kernel && !ordered {
                kernel.push_back((pos, *r))
            } else {
                host.push_back((pos, *r))
            }
        }
        Streams {
            host,
            kernel,
            ordered,
        }
    }

    /// The next host-side record (op start, OpStop, CommEnd) and its position.
    fn host_at(&mut self) -> Option<(usize, Record)> {
        self.host.pop_front()
    }

    fn host(&mut self) -> Option<Record> {
        self.host_at().map(|(_, r)| r)
    }

    /// The next kernel record; it must come after position `after` (its operation's start).
    fn kernel(&mut self, after: usize) -> Option<Record> {
        let (pos, r) = if self.ordered {
            self.host.pop_front()?
        } else {
            self.kernel.pop_front()?
        };
        (pos > after).then_some(r)
    }

    fn remaining(self) -> Vec<Record> {
        self.host
            .into_iter()
            .chain(self.kernel)
            .map(|(_, r)| r)
            .collect()
    }
}
