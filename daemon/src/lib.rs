//! The ncclscope daemon and operator tools.

pub mod api;
pub mod assemble;
pub mod bandwidth;
pub mod cli;
pub mod config;
pub mod engine;
pub mod histogram;
pub mod hub;
pub mod instance;
pub mod metrics;
pub mod notify;
pub mod otlp;
pub mod otlp_json;
pub mod perfetto;
pub mod prometheus;
pub mod register;
pub mod run;
pub mod spans;
pub mod spool;
pub mod state;
pub mod stats;

/// Every collective instance is a short-lived allocation shared by the spool, the hub and the
/// exporter; with glibc's allocator, malloc/free were about a fifth of the ingest thread's time.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
