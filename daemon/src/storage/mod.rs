//! What the daemon keeps of the instances it assembled: the hub, where live consumers meet them in
//! memory; the spool, every instance on disk per job, and its writer thread (group commit); the
//! resume state of each segment, and its writer thread. A restarted daemon reads the resume states
//! and what the spool recorded since them (the protocol is `engine/commit.rs`'s). Of the daemon
//! it imports only the instances (`instance.rs`).

pub mod hub;
pub mod resume;
pub mod spool;
pub mod spool_writer;
pub mod state_writer;
