//! One module per subcommand of `ncclscope`; each has `Args` and `run`.

pub mod daemon;
pub mod demo;
pub mod export;
pub mod sim_rank;
pub mod stats;
pub mod top;
