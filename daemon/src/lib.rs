//! The ncclscope daemon and operator tools.

pub mod api;
pub mod cli;
pub mod hub;
pub mod otlp_json;
pub mod perfetto;
pub mod spool;
