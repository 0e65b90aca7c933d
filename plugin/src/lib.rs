//! The ncclscope NCCL profiler plugin.
