//! An operation becomes an instance: GPU times mapped to host time, exec time, bandwidths.

use ncclscope_proto::api::LiveSpans;
use ncclscope_proto::{StrId, TimingSource};

use super::operations::Op;
use crate::bandwidth;
use crate::instance::{Instance, Names};
use crate::storage::resume::{Calibration, CommInfo};

/// How far a kernel's start, on the host clock, may fall before its operation's enqueue, or its end
/// after the daemon read it. A calibration is good to microseconds (milliseconds at worst): beyond
/// this the mapping is wrong (the host clock stepped between two calibrations, a bad calibration).
const CLOCK_SLACK_NS: u64 = 1_000_000_000;

/// Whether `op`'s kernel times, shifted by `offset` to the host clock, lie where they can: not
/// before its enqueue (eager operations) and not after the daemon read them, within
/// [`CLOCK_SLACK_NS`]. (Times of 0 are unknown and bound nothing.)
pub(super) fn plausible(op: &Op, offset: i64) -> bool {
    let (Some(start), Some(end)) = (
        op.channels.iter().map(|c| c.start_unix_ns).min(),
        op.channels.iter().map(|c| c.end_unix_ns).max(),
    ) else {
        return true;
    };
    let (start, end) = (
        start.saturating_add_signed(offset),
        end.saturating_add_signed(offset),
    );
    let after_enqueue = op.replay > 0
        || op.enqueue_ns == 0
        || start.saturating_add(CLOCK_SLACK_NS) >= op.enqueue_ns;
    let before_read =
        op.last_progress_ns == 0 || end <= op.last_progress_ns.saturating_add(CLOCK_SLACK_NS);
    after_enqueue && before_read
}

/// The instance of process `pid`; takes the op's channel work rather than copying it.
#[inline]
pub(super) fn instance(
    op: Op,
    pid: u32,
    names: &Names,
    info: Option<&CommInfo>,
    calibration: Option<Calibration>,
    elem_bytes: Option<u64>,
) -> Instance {
    let nranks = info.map_or(1, |c| c.nranks);
    let func = names.get(op.desc.func);
    let msg = elem_bytes.unwrap_or(0).saturating_mul(op.desc.count);
    let bytes = bandwidth::inspector_bytes(func, msg, nranks);
    let mut channels = op.channels;
    channels.sort_unstable_by_key(|c| c.channel);
    // The error of the mapping at the op's farthest GPU time from the calibration, its first start
    // or its last end (the error grows with the distance).
    let calibration_error_ns = match calibration {
        Some(c) => {
            let first = channels.iter().map(|ch| ch.start_unix_ns).min();
            let last = channels.iter().map(|ch| ch.end_unix_ns).max();
            [first, last]
                .into_iter()
                .flatten()
                .map(|t| c.error_at(t))
                .max()
                .unwrap_or(c.error_ns)
        }
        // No calibration (closed by a timeout before the first one arrived): GPU clock, flagged.
        None if channels.is_empty() => 0,
        None => u32::MAX,
    };
    // The GPU times with the offset of the operation's moment, its first start (the GPU clock
    // drifts against the host's). One offset for all: durations stay the GPU's own, where an offset
    // per time rounded them apart by a nanosecond; within one operation the drift moves the
    // offset by nanoseconds (10 ppm over a 5 ms kernel: 50 ns), well inside the calibration error.
    let first = channels.iter().map(|c| c.start_unix_ns).min().unwrap_or(0);
    let offset = match calibration {
        Some(c) => c.offset_at(first),
        None => op.host_anchor.unwrap_or(0),
    };
    for c in &mut channels {
        c.start_unix_ns = c.start_unix_ns.saturating_add_signed(offset);
        c.end_unix_ns = c.end_unix_ns.saturating_add_signed(offset);
    }
    // Host events bracket the enqueue, not the work (NCCL stops an eager send's P2p event ~0.3 us
    // after starting it, whatever its bytes): a host-timed instance has no exec time, and so no
    // bandwidth, rather than a wrong one.
    let (timing_source, start, end, exec) = if channels.is_empty() {
        let end = op.stop_ns.unwrap_or(op.enqueue_ns);
        (TimingSource::Host, op.enqueue_ns, end, 0)
    } else {
        let start = channels.iter().map(|c| c.start_unix_ns).min().unwrap_or(0);
        let end = channels.iter().map(|c| c.end_unix_ns).max().unwrap_or(0);
        let exec = channels
            .iter()
            .map(|c| c.end_unix_ns - c.start_unix_ns)
            .max()
            .unwrap_or(0);
        let source = if info.is_some_and(|c| c.device_hook) {
            TimingSource::DeviceHook
        } else {
            TimingSource::KernelGpu
        };
        (source, start, end, exec)
    };
    let (algbw, busbw) = bandwidth::bandwidths(func, bytes, nranks, exec);
    Instance {
        pid,
        comm_hash: info.map_or(0, |c| c.comm_hash),
        comm_name: StrId(info.map_or(0, |c| c.name)),
        rank: info.map_or(0, |c| c.rank),
        nranks,
        nnodes: info.map_or(1, |c| c.nnodes),
        desc: op.desc,
        bytes,
        // A replay is launched with its graph, which no host event reports.
        enqueue_unix_ns: if op.replay > 0 { start } else { op.enqueue_ns },
        start_unix_ns: start,
        end_unix_ns: end,
        exec_ns: exec,
        timing_source,
        algbw_gbs: algbw,
        busbw_gbs: busbw,
        calibration_error_ns,
        channels,
        replay: op.replay,
        // Decided by the engine when it records the instance.
        live_spans: LiveSpans::None,
        gpu: info.and_then(|c| c.gpu),
        trace_root: None,
        local_lateness_ns: None,
    }
}
