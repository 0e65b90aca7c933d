//! One module per subcommand of `ncclscope`; each has `Args` and `run`.

pub mod cluster;
pub mod daemon;
#[cfg(feature = "demo")]
pub mod demo;
pub mod error;
pub mod export;
pub mod reference;
#[cfg(feature = "demo")]
pub mod sim_rank;
pub mod stats;
pub mod systemd_dropin;
pub mod top;
