//! The outputs: what leaves the daemon, live or on request. Live: OTLP spans and metrics to a
//! collector, with the spans it dropped re-sent from the spool, and Prometheus' `/metrics`, both
//! rendered from one metrics model. On request: a job's trace as Perfetto (protobuf or JSON) or
//! OTLP/JSON, and for `export --merge` the nodes' clocks and the check against PyTorch's trace. It
//! reads the model (instances, spans, statistics, configuration) and the spool; nothing below
//! imports it.

pub mod align;
pub mod export_queue;
pub mod metrics;
pub mod node_clocks;
pub mod otlp;
pub mod otlp_json;
pub mod perfetto;
pub mod perfetto_proto;
pub mod prometheus;
pub mod resend;
