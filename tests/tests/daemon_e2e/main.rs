//! End to end with real processes: rank processes write their shared-memory segments and register on
//! the daemon's socket; the real `ncclscope daemon` binary ingests them and exports OTLP/gRPC to a real
//! receiver (fake-opentelemetry-collector in this test process) and Prometheus text.
//!
//! The rank processes are this test binary re-run as `support::daemon_rank_child` (an ignored
//! test), writing with `proto::Producer` exactly the records the plugin writes on the stock KernelCh
//! path, with known GPU times and a known calibration, so the test can check every span's times to
//! the nanosecond.
//!
//! By what they prove: `loss.rs`, `restart.rs`, `graphs.rs`, `hostile.rs`, `outages.rs`; what they
//! share in `support.rs`.

mod graphs;
mod hostile;
mod loss;
mod outages;
mod restart;
mod support;
