//! The ncclscope daemon and operator tools.

pub mod api;
pub mod cli;
pub mod hub;
pub mod spool;
