//! Fake NCCL host.
