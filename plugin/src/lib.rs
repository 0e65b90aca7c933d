//! The ncclscope NCCL profiler plugin.

mod devhook;
mod sink;
