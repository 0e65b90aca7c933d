//! OpenTelemetry spans for collective instances, with ids that every node derives alike.
//!
//! An instance is identified within its communicator by [`collective_key`]: (collective type, seq)
//! for an eager launch, (type, seq, replay) for a graph replay's (the captured operation's seq and
//! the replay's index on the communicator), the same on every rank. From it:
//! - trace id = f(uid, commHash, key): all ranks of one collective, on every node, land in one trace;
//! - each rank's span id = f(uid, commHash, key, rank), its parent the collective's root span
//!   id = f(uid, commHash, key); the root span itself is emitted by rank 0's daemon only, so no
//!   coordination is needed and the root is never duplicated. It spans the rank spans that daemon
//!   sends (the earliest start to the latest end among the node's ranks, carried by the last of them
//!   to complete: [`crate::stats::Observed::trace_root`]); ranks on other nodes hang under it with
//!   their own times;
//! - optional channel spans: id = f(uid, commHash, key, rank, channel), children of the rank's span.
//!
//! The uid is the one the kernel reported at registration; commHash, seq and rank are what the
//! segment says. A job runs under one uid on every node (the same on a cluster with shared accounts),
//! so its ranks still meet in one trace without coordination, while another user's process claiming
//! the same commHash (even as rank 0) lands in a trace of its own uid: it can neither add spans to
//! the victim's trace nor emit its root.
//!
//! Sampling is a function of (commHash, key), so every rank keeps the same collectives.
//! The daemon builds OTLP protobuf spans itself (opentelemetry-proto) because the SDK generates ids.

use crate::instance::InstanceRef;
use ncclscope_proto::TimingSource;
use ncclscope_proto::api::LiveSpans;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{Span, Status, span::SpanKind, status::StatusCode};

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn mix(a: u64, b: u64) -> u64 {
    splitmix(a ^ splitmix(b))
}

/// OTLP ids must not be all zero.
fn nonzero(x: u64) -> u64 {
    if x == 0 { 1 } else { x }
}

/// What identifies an instance within its communicator. NCCL numbers collectives per communicator
/// and per collective type (`seqNumber[func]`, the Coll event's seqNumber): AllGather 0 and AllReduce
/// 0 are two collectives. So the key is (collective type, seq) for an eager launch and (type, seq,
/// replay) for the r-th graph replay, the same on every rank of every node.
pub fn collective_key(func: &str, seq: u64, replay: u32) -> u64 {
    typed_key(type_key(func), seq, replay)
}

/// [`collective_key`] of the type whose [`type_key`] is `type_key`.
fn typed_key(type_key: u64, seq: u64, replay: u32) -> u64 {
    let key = mix(type_key, seq);
    if replay == 0 {
        key
    } else {
        mix(key, 0x7265_706c_6179_0000 | replay as u64) // "replay"
    }
}

/// The collective type's part of [`collective_key`]: FNV-1a of its name, a fixed function of the
/// name on every node (unlike the std hashers).
pub fn type_key(func: &str) -> u64 {
    func.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// The instance's identity within its communicator: [`collective_key`] of a collective; for a p2p,
/// the transfer's (sender, receiver, number), the same on its Send and its Recv side (the assembler
/// numbers each (peer, function) in order).
pub fn instance_key(c: InstanceRef) -> u64 {
    instance_key_typed(c, type_key(c.func()))
}

/// [`instance_key`] given the [`type_key`] of `c`'s function: the statistics take that once per
/// instance, for its key and its skew window (each FNV pass over the name was a percent of ingest).
pub fn instance_key_typed(c: InstanceRef, func_key: u64) -> u64 {
    if c.desc.is_p2p {
        let (from, to) = match c.func() {
            "Recv" => (c.desc.peer as u32, c.rank),
            _ => (c.rank, c.desc.peer as u32),
        };
        return collective_key(
            "p2p",
            mix((from as u64) << 32 | to as u64, c.desc.seq),
            c.replay,
        );
    }
    typed_key(func_key, c.desc.seq, c.replay)
}

/// The collective's identity: everything the ids derive from.
fn collective(uid: u32, comm_hash: u64, seq: u64) -> u64 {
    mix(mix(comm_hash, seq), 0x7569_6400_0000_0000 | uid as u64) // "uid"
}

pub fn trace_id(uid: u32, comm_hash: u64, seq: u64) -> [u8; 16] {
    let hi = collective(uid, comm_hash, seq);
    let lo = mix(hi, 0x7472_6163_6500_0001); // "trace"
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&hi.to_be_bytes());
    id[8..].copy_from_slice(&nonzero(lo).to_be_bytes());
    id
}

pub fn root_span_id(uid: u32, comm_hash: u64, seq: u64) -> [u8; 8] {
    nonzero(mix(collective(uid, comm_hash, seq), 0x726f_6f74)).to_be_bytes() // "root"
}

/// A rank span named by what its ids derive from (an exemplar's link): the ids are computed when
/// exported, not for every instance recorded.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankSpan {
    pub uid: u32,
    pub comm_hash: u64,
    /// [`instance_key`].
    pub key: u64,
    pub rank: u32,
}

impl RankSpan {
    pub fn trace_id(&self) -> [u8; 16] {
        trace_id(self.uid, self.comm_hash, self.key)
    }

    pub fn span_id(&self) -> [u8; 8] {
        rank_span_id(self.uid, self.comm_hash, self.key, self.rank)
    }
}

pub fn rank_span_id(uid: u32, comm_hash: u64, seq: u64, rank: u32) -> [u8; 8] {
    nonzero(mix(
        collective(uid, comm_hash, seq),
        0x1_0000_0000 | rank as u64,
    ))
    .to_be_bytes()
}

pub fn channel_span_id(uid: u32, comm_hash: u64, seq: u64, rank: u32, channel: u32) -> [u8; 8] {
    let rank_id = u64::from_be_bytes(rank_span_id(uid, comm_hash, seq, rank));
    nonzero(mix(rank_id, 0x2_0000_0000 | channel as u64)).to_be_bytes()
}

/// Whether (commHash, key) falls in the sampled fraction `ratio`: the same answer on every node.
pub fn sampled(comm_hash: u64, key: u64, ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    let h = mix(comm_hash ^ 0x7361_6d70_6c65, key); // "sample"
    (h as f64) < ratio * 18_446_744_073_709_551_616.0
}

fn kv(key: &str, v: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.to_string(),
        value: Some(AnyValue { value: Some(v) }),
        ..Default::default()
    }
}

fn s(key: &str, v: &str) -> KeyValue {
    kv(key, any_value::Value::StringValue(v.to_string()))
}

fn i(key: &str, v: i64) -> KeyValue {
    kv(key, any_value::Value::IntValue(v))
}

fn f(key: &str, v: f64) -> KeyValue {
    kv(key, any_value::Value::DoubleValue(v))
}

/// Attributes every span of an instance carries.
fn common(c: InstanceRef) -> Vec<KeyValue> {
    vec![
        s("nccl.collective", c.func()),
        i("nccl.nranks", c.nranks as i64),
        s("nccl.comm_hash", &format!("{:016x}", c.comm_hash)),
        i("nccl.seq", c.desc.seq as i64),
        i("nccl.replay", c.replay as i64),
        s("job.id", c.job_id()),
        // OpenTelemetry's name for the uid of a process.
        i("process.real_user.id", c.uid() as i64),
    ]
}

/// ERROR with what is wrong where the instance is known bad: closed without its end or without
/// every channel's kernel work (timed out, its process ended: what the daemon counts as
/// `incomplete`), or timed on a GPU clock never calibrated to the host's. Otherwise UNSET, as the
/// specification asks of instrumentation (OK is the operator's to set).
fn status(c: InstanceRef) -> Option<Status> {
    let mut worked: Vec<u32> = c.channels.iter().map(|w| w.channel).collect();
    worked.sort_unstable();
    worked.dedup();
    let worked = worked.len() as u32;
    let message = if c.timing_source == TimingSource::Host && c.end_unix_ns <= c.enqueue_unix_ns {
        "incomplete: closed without its end (timed out, or its process ended)".to_string()
    } else if worked < u32::from(c.desc.n_channels) {
        format!(
            "incomplete: kernel work on {worked} of {} channels",
            c.desc.n_channels
        )
    } else if c.calibration_error_ns == u32::MAX {
        "GPU times not calibrated to the host clock".to_string()
    } else {
        return None;
    };
    Some(Status {
        message,
        code: StatusCode::Error as i32,
    })
}

/// Appends the spans the live export sends for `c`, as the engine decided when it recorded it
/// ([`LiveSpans`], and the root span if `c` carries it). The daemon's OTLP export and `export
/// --format otlp-json` both write these.
pub fn live_spans_of(c: InstanceRef, out: &mut Vec<Span>) {
    if let Some((start, end)) = c.trace_root {
        let key = instance_key(c);
        let mut attributes = common(c);
        attributes.push(i("nccl.bytes", c.bytes as i64));
        // No status: each rank span carries its own.
        out.push(Span {
            trace_id: trace_id(c.uid(), c.comm_hash, key).to_vec(),
            span_id: root_span_id(c.uid(), c.comm_hash, key).to_vec(),
            name: c.func().to_string(),
            kind: SpanKind::Internal as i32,
            start_time_unix_nano: start,
            end_time_unix_nano: end,
            attributes,
            ..Default::default()
        });
    }
    match c.live_spans {
        LiveSpans::None => {}
        LiveSpans::Rank => spans_of(c, false, out),
        LiveSpans::Channels => spans_of(c, true, out),
    }
}

/// Appends the rank's span of `c`, a child of its collective's root span, and one span per channel
/// if asked.
fn spans_of(c: InstanceRef, channel_spans: bool, out: &mut Vec<Span>) {
    let key = instance_key(c);
    let trace_id = trace_id(c.uid(), c.comm_hash, key).to_vec();
    let root_id = root_span_id(c.uid(), c.comm_hash, key).to_vec();
    let rank_id = rank_span_id(c.uid(), c.comm_hash, key, c.rank);
    let is_collective = !c.desc.is_p2p;
    let status = status(c);
    let mut attributes = common(c);
    attributes.extend([
        i("nccl.rank", c.rank as i64),
        s("nccl.algo", c.algo()),
        s("nccl.proto", c.proto()),
        s("nccl.datatype", c.datatype()),
        i("nccl.bytes", c.bytes as i64),
        i("nccl.count", c.desc.count as i64),
        i("nccl.channels", c.desc.n_channels as i64),
        i("nccl.nnodes", c.nnodes as i64),
        i("nccl.exec_ns", c.exec_ns as i64),
        f("nccl.algbw_gbs", c.algbw_gbs),
        f("nccl.busbw_gbs", c.busbw_gbs),
        s("nccl.timing_source", c.timing_source.as_str()),
        i("nccl.calibration_error_ns", c.calibration_error_ns as i64),
        i("nccl.enqueue_unix_ns", c.enqueue_unix_ns as i64),
        i("process.pid", c.pid as i64),
    ]);
    // Empty strings (p2p has no algorithm/protocol; unnamed communicators) carry no information.
    attributes.retain(|kv| !matches!(&kv.value, Some(AnyValue { value: Some(any_value::Value::StringValue(v)) }) if v.is_empty()));
    // Host times bracket the enqueue, not the work: no exec time or bandwidth rather than a wrong one.
    if c.timing_source == TimingSource::Host {
        attributes.retain(|kv| {
            !matches!(
                kv.key.as_str(),
                "nccl.exec_ns" | "nccl.algbw_gbs" | "nccl.busbw_gbs"
            )
        });
    }
    if !c.comm_name().is_empty() {
        attributes.push(s("nccl.comm_name", c.comm_name()));
    }
    if let Some(g) = c.gpu {
        attributes.push(i("nccl.gpu", g.ordinal as i64));
        attributes.push(s("nccl.gpu_uuid", &g.uuid_text()));
    }
    // OpenTelemetry's Kubernetes attributes, on the span: one daemon serves every pod of its node.
    let pod = c.pod();
    if !pod.name.is_empty() {
        attributes.push(s("k8s.pod.name", &pod.name));
    }
    if !pod.namespace.is_empty() {
        attributes.push(s("k8s.namespace.name", &pod.namespace));
    }
    if let Some(ns) = c.local_lateness_ns {
        attributes.push(i("ncclscope.local_lateness_ns", ns as i64));
    }
    if c.desc.is_p2p {
        attributes.push(i("nccl.peer", c.desc.peer as i64));
    } else if c.desc.root >= 0 {
        attributes.push(i("nccl.root", c.desc.root as i64));
    }
    out.push(Span {
        trace_id: trace_id.clone(),
        span_id: rank_id.to_vec(),
        parent_span_id: if is_collective { root_id } else { Vec::new() },
        name: format!("{} rank", c.func()),
        kind: SpanKind::Internal as i32,
        start_time_unix_nano: c.start_unix_ns,
        end_time_unix_nano: c.end_unix_ns,
        attributes,
        status,
        ..Default::default()
    });
    if channel_spans {
        for w in &c.channels {
            out.push(Span {
                trace_id: trace_id.clone(),
                span_id: channel_span_id(c.uid(), c.comm_hash, key, c.rank, w.channel).to_vec(),
                parent_span_id: rank_id.to_vec(),
                name: format!("{} channel", c.func()),
                kind: SpanKind::Internal as i32,
                start_time_unix_nano: w.start_unix_ns,
                end_time_unix_nano: w.end_unix_ns,
                attributes: vec![
                    i("nccl.rank", c.rank as i64),
                    i("nccl.channel", w.channel as i64),
                    i("nccl.work_items", w.work_items as i64),
                ],
                ..Default::default()
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instance::Shared;
    use ncclscope_proto::api::ChannelWork;

    #[test]
    fn ids_depend_on_the_right_inputs() {
        assert_eq!(trace_id(7, 1, 2), trace_id(7, 1, 2));
        assert_ne!(trace_id(7, 1, 2), trace_id(7, 1, 3));
        assert_ne!(trace_id(7, 1, 2), trace_id(7, 2, 2));
        assert_ne!(rank_span_id(7, 1, 2, 0), rank_span_id(7, 1, 2, 1));
        assert_ne!(rank_span_id(7, 1, 2, 0), root_span_id(7, 1, 2));
        assert_ne!(
            channel_span_id(7, 1, 2, 0, 0),
            channel_span_id(7, 1, 2, 1, 0)
        );
        // Another uid claiming the same communicator and seq: other trace, other root, other spans.
        assert_ne!(trace_id(7, 1, 2), trace_id(8, 1, 2));
        assert_ne!(root_span_id(7, 1, 2), root_span_id(8, 1, 2));
        assert_ne!(rank_span_id(7, 1, 2, 0), rank_span_id(8, 1, 2, 0));
        assert_ne!(
            channel_span_id(7, 1, 2, 0, 0),
            channel_span_id(8, 1, 2, 0, 0)
        );
        let k = |func, seq, replay| collective_key(func, seq, replay);
        assert_eq!(
            k("AllReduce", 2, 0),
            k("AllReduce", 2, 0),
            "the same on every rank"
        );
        assert_ne!(
            k("AllReduce", 0, 0),
            k("AllGather", 0, 0),
            "types numbered apart"
        );
        assert_ne!(k("AllReduce", 2, 1), k("AllGather", 2, 1));
        assert_ne!(k("AllReduce", 2, 1), k("AllReduce", 2, 2));
        assert_ne!(k("AllReduce", 2, 1), k("AllReduce", 3, 1));
        assert_ne!(k("AllReduce", 2, 0), k("AllReduce", 2, 1));
    }

    /// A transfer's Send and Recv sides share one trace; other pairs, numbers or directions do not.
    #[test]
    fn a_p2p_transfer_is_one_instance_on_both_sides() {
        let side = |func: &str, rank: u32, peer: i32, seq: u64| {
            Shared::from(&ncclscope_proto::api::Collective {
                func: func.into(),
                comm_hash: 5,
                seq,
                rank,
                peer,
                nranks: 4,
                is_p2p: true,
                ..Default::default()
            })
        };
        let key = |c: Shared| instance_key(c.view());
        assert_eq!(key(side("Send", 0, 1, 3)), key(side("Recv", 1, 0, 3)));
        assert_ne!(key(side("Send", 0, 1, 3)), key(side("Send", 2, 3, 3)));
        assert_ne!(key(side("Send", 0, 1, 3)), key(side("Send", 1, 0, 3)));
        assert_ne!(key(side("Send", 0, 1, 3)), key(side("Recv", 0, 1, 3)));
        assert_ne!(key(side("Send", 0, 1, 3)), key(side("Send", 0, 1, 4)));
        let (mut send, mut recv) = (Vec::new(), Vec::new());
        spans_of(side("Send", 0, 1, 3).view(), false, &mut send);
        spans_of(side("Recv", 1, 0, 3).view(), false, &mut recv);
        assert_eq!((send.len(), recv.len()), (1, 1), "no root for a p2p");
        assert_eq!(send[0].trace_id, recv[0].trace_id);
        assert_ne!(send[0].span_id, recv[0].span_id);
    }

    #[test]
    fn sampling_is_by_collective_and_close_to_the_ratio() {
        let kept = (0..100_000)
            .filter(|&seq| sampled(0xfeed, seq, 0.1))
            .count();
        assert!((9_000..11_000).contains(&kept), "{kept}");
        assert!((0..1000).all(|seq| sampled(7, seq, 1.0)));
        assert!(!(0..1000).any(|seq| sampled(7, seq, 0.0)));
    }

    /// The instance carrying the root emits it with the times it was given (the node's rank spans'
    /// envelope, see `stats`), whatever its rank; ranks hang under it, channels under their rank.
    #[test]
    fn the_carrier_emits_the_root_and_channels_hang_under_the_rank() {
        let c = Shared::from(&ncclscope_proto::api::Collective {
            func: "AllReduce".into(),
            comm_hash: 5,
            seq: 9,
            rank: 1,
            nranks: 2,
            start_unix_ns: 100,
            end_unix_ns: 200,
            enqueue_unix_ns: 50,
            channels: vec![ChannelWork {
                channel: 3,
                start_unix_ns: 100,
                end_unix_ns: 190,
                work_items: 1,
            }],
            live_spans: LiveSpans::Channels as i32,
            trace_root_start_unix_ns: 90,
            trace_root_end_unix_ns: 250,
            ..Default::default()
        });
        let mut out = Vec::new();
        live_spans_of(c.view(), &mut out);
        assert_eq!(out.len(), 3);
        assert_eq!(
            (out[0].start_time_unix_nano, out[0].end_time_unix_nano),
            (90, 250)
        );
        let (root, rank, ch) = (&out[0], &out[1], &out[2]);
        assert!(root.parent_span_id.is_empty());
        assert_eq!(rank.parent_span_id, root.span_id);
        assert_eq!(ch.parent_span_id, rank.span_id);
        let key = collective_key("AllReduce", 9, 0);
        assert!(
            out.iter()
                .all(|s| s.trace_id == trace_id(0, 5, key).to_vec())
        );
        assert_eq!(
            (rank.start_time_unix_nano, rank.end_time_unix_nano),
            (100, 200)
        );
        let mut out = Vec::new();
        let mut rank0 = c.clone();
        (rank0.inst.rank, rank0.inst.trace_root) = (0, None);
        rank0.inst.live_spans = LiveSpans::Rank;
        live_spans_of(rank0.view(), &mut out);
        assert_eq!(out.len(), 1, "only the carrier emits the root");
        assert_eq!(out[0].parent_span_id, root_span_id(0, 5, key).to_vec());
        // A carrier whose own spans are not sent (another rank's were: slow) still emits the root.
        let mut out = Vec::new();
        let mut unsent = c.clone();
        unsent.inst.live_spans = LiveSpans::None;
        live_spans_of(unsent.view(), &mut out);
        assert_eq!(out.len(), 1);
        assert!(out[0].parent_span_id.is_empty());
    }

    /// The rank's GPU as DCGM names it, on its span only where the process knew it (never guessed).
    #[test]
    fn a_rank_span_carries_its_gpu_when_known() {
        let m = ncclscope_proto::api::Collective {
            func: "AllReduce".into(),
            rank: 1,
            nranks: 2,
            gpu: Some(3),
            gpu_uuid: "GPU-8d1c2a3b-0001-0203-0405-06070809feff".into(),
            ..Default::default()
        };
        let attrs = |m: &ncclscope_proto::api::Collective| {
            let mut out = Vec::new();
            spans_of(Shared::from(m).view(), false, &mut out);
            out.pop().unwrap().attributes
        };
        let with = attrs(&m);
        let get = |k: &str| {
            with.iter()
                .find(|kv| kv.key == k)
                .and_then(|kv| kv.value.clone())
        };
        assert_eq!(
            get("nccl.gpu").unwrap().value,
            Some(any_value::Value::IntValue(3))
        );
        assert_eq!(
            get("nccl.gpu_uuid").unwrap().value,
            Some(any_value::Value::StringValue(m.gpu_uuid.clone()))
        );
        let without = attrs(&ncclscope_proto::api::Collective {
            gpu: None,
            gpu_uuid: String::new(),
            ..m
        });
        assert!(!without.iter().any(|kv| kv.key.starts_with("nccl.gpu")));
    }

    /// Issue 39: a rank span names the pod and namespace its process claimed (OpenTelemetry's
    /// `k8s.pod.name`, `k8s.namespace.name`), so a trace joins the pod that ran the rank; none outside
    /// Kubernetes.
    #[test]
    fn a_rank_span_carries_its_pod_when_known() {
        let m = ncclscope_proto::api::Collective {
            func: "AllReduce".into(),
            rank: 1,
            nranks: 2,
            k8s_pod: "train-1-x7k2p".into(),
            k8s_namespace: "ml-team".into(),
            ..Default::default()
        };
        let attrs = |m: &ncclscope_proto::api::Collective| {
            let mut out = Vec::new();
            spans_of(Shared::from(m).view(), false, &mut out);
            let span = out.pop().unwrap();
            (span.attributes.into_iter())
                .filter(|kv| kv.key.starts_with("k8s."))
                .map(|kv| (kv.key, kv.value.and_then(|v| v.value)))
                .collect::<Vec<_>>()
        };
        let text = |v: &str| Some(any_value::Value::StringValue(v.into()));
        assert_eq!(
            attrs(&m),
            [
                ("k8s.pod.name".to_string(), text("train-1-x7k2p")),
                ("k8s.namespace.name".to_string(), text("ml-team"))
            ]
        );
        let outside = ncclscope_proto::api::Collective {
            k8s_pod: String::new(),
            k8s_namespace: String::new(),
            ..m
        };
        assert!(attrs(&outside).is_empty());
    }

    /// Issue 35: the rank's node-local lateness, for TraceQL (`span.ncclscope.local_lateness_ns >
    /// 1000000`), on its span where the daemon evaluated it, absent elsewhere.
    #[test]
    fn a_rank_span_carries_its_node_local_lateness_when_evaluated() {
        let m = ncclscope_proto::api::Collective {
            func: "AllReduce".into(),
            rank: 1,
            nranks: 2,
            local_lateness_ns: Some(3_000_000),
            ..Default::default()
        };
        let lateness = |m: &ncclscope_proto::api::Collective| {
            let mut out = Vec::new();
            spans_of(Shared::from(m).view(), false, &mut out);
            let span = out.pop().unwrap();
            let kv = span.attributes.into_iter();
            kv.filter(|kv| kv.key == "ncclscope.local_lateness_ns")
                .map(|kv| kv.value.and_then(|v| v.value))
                .collect::<Vec<_>>()
        };
        assert_eq!(lateness(&m), [Some(any_value::Value::IntValue(3_000_000))]);
        let none = ncclscope_proto::api::Collective {
            local_lateness_ns: None,
            ..m
        };
        assert!(lateness(&none).is_empty());
    }

    /// Issue 17: span status was never set. A complete instance leaves it UNSET; one closed without
    /// its end, short of channels, or on an uncalibrated clock is ERROR, saying why.
    #[test]
    fn known_bad_instances_have_error_status() {
        let good = ncclscope_proto::api::Collective {
            func: "AllReduce".into(),
            rank: 1,
            nranks: 2,
            n_channels: 1,
            enqueue_unix_ns: 50,
            start_unix_ns: 100,
            end_unix_ns: 200,
            timing_source: "kernel_gpu".into(),
            channels: vec![ChannelWork {
                channel: 0,
                start_unix_ns: 100,
                end_unix_ns: 200,
                work_items: 1,
            }],
            ..Default::default()
        };
        let status_of = |c: &ncclscope_proto::api::Collective| {
            let mut out = Vec::new();
            spans_of(Shared::from(c).view(), false, &mut out);
            out.pop().unwrap().status
        };
        assert_eq!(status_of(&good), None);
        let no_end = ncclscope_proto::api::Collective {
            timing_source: "host".into(),
            channels: Vec::new(),
            start_unix_ns: 50,
            end_unix_ns: 50,
            ..good.clone()
        };
        let short = ncclscope_proto::api::Collective {
            n_channels: 4,
            ..good.clone()
        };
        let uncalibrated = ncclscope_proto::api::Collective {
            calibration_error_ns: u32::MAX,
            ..good.clone()
        };
        for (c, says) in [
            (no_end, "without its end"),
            (short, "1 of 4 channels"),
            (uncalibrated, "not calibrated"),
        ] {
            let s = status_of(&c).expect("a status");
            assert_eq!(s.code, StatusCode::Error as i32);
            assert!(s.message.contains(says), "{}", s.message);
        }
    }
}
