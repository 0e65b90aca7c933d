//! One module per subcommand of `ncclscope`; each has `Args` and `run`.

pub mod daemon;
#[cfg(feature = "demo")]
pub mod demo;
pub mod export;
#[cfg(feature = "demo")]
pub mod sim_rank;
pub mod stats;
pub mod top;
