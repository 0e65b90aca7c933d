//! What the engine and the re-sender hand the OTLP exporter ([`crate::export::otlp`]): a span item with the
//! acknowledgement its segment waits on, and the export's outcomes, counted for the health snapshot.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::instance::Shared;
use crate::stats::RootWait;

/// One instance to export. `acked` is its segment's acknowledgement cursor: after the attempt ends
/// (accepted, or given up and counted) it is raised to `emit_no`. Items of one segment are queued in
/// `emit_no` order and handled in queue order, so the cursor only moves forward. An instance re-sent
/// from the spool has none: no segment waits on it. `settles`: the root span's settlement, when the
/// instance carries its collective's root (the other ranks' records wait on it), settled then too;
/// an item with only that (a root sent when its skew window closed) is live all the same: its spans
/// count as dropped if given up.
pub struct SpanItem {
    pub coll: Shared,
    pub acked: Option<Arc<AtomicU64>>,
    pub emit_no: u64,
    pub settles: Option<RootWait>,
}

/// Export outcomes, shared with the engine's health snapshot.
#[derive(Debug, Default)]
pub struct ExportCounters {
    pub spans_exported: AtomicU64,
    pub spans_dropped: AtomicU64,
    pub export_errors: AtomicU64,
    pub metrics_exported: AtomicU64,
    /// Dropped instances queued again from the spool.
    pub resent: AtomicU64,
    /// Dropped instances that will not be re-sent: past the bound on those remembered, or no longer
    /// in the spool.
    pub not_resent: AtomicU64,
}
