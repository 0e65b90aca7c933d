//! The ncclscope NCCL profiler plugin (`libnccl-profiler-ncclscope.so`).
//!
//! One library for stock NCCL 2.28 - 2.32 (`ncclProfiler_v5`, `_v6`, `_v7`) and an NCCL with the
//! device-hook RFC (`_v7` with `getDeviceHook`). NCCL's host events (Coll, P2p, KernelCh with the GPU
//! `pTimer`, KernelPhase) and the device hook's work items go through one forwarding thread into a
//! per-process shared-memory segment that the node daemon drains.
//!
//! - [`entry`]: the exported vtables and their C entry points (reads NCCL's descriptors);
//! - `abi`: the NCCL ABI types with their layout assertions;
//! - `host`: which NCCL we run in (found through its logger, never linked) and logging through it;
//! - `launch`: the plugin's start in a process and each communicator's `init`;
//! - `profiler`: per-process and per-communicator state, what each callback does;
//! - `clock`: cheap host timestamps (TSC) converted to CLOCK_REALTIME off the hot path;
//! - `pool`: bounded, validated event handles (free slots cached per thread); `event`: what NCCL's
//!   threads queue; `lanes`: their per-thread queues, and the order across them; `forward`: the
//!   forwarding thread; `register`: the daemon.

mod abi;
mod clock;
mod config;
mod devhook;
pub mod entry;
mod event;
mod forward;
mod host;
mod lanes;
mod launch;
mod pool;
mod profiler;
mod register;
mod sink;
