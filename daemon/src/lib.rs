//! The ncclscope daemon and operator tools.
//!
//! The root holds the model every part shares (instances, statistics, spans, losses, the
//! configuration) and the wiring that joins the parts (`run`, `api`, `register`, `reference`); each
//! folder is one job: `host/`, `storage/`, `export/`, `assemble/`, `engine/`, `cli/`. Imports go one
//! way (docs/architecture.md, "Folders").

pub mod api;
pub mod assemble;
pub mod bandwidth;
pub mod cli;
pub mod config;
pub mod engine;
pub mod export;
pub mod fast_map;
pub mod histogram;
pub mod host;
pub mod instance;
pub mod loss;
pub mod peers;
pub mod reference;
pub mod register;
pub mod run;
pub mod spans;
pub mod stats;
pub mod storage;

/// The exporter builds a batch of OTLP spans (many small strings) per request, and every instance
/// has its channel list: with glibc's allocator export ran at about 60% of this rate.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
