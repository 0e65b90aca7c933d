//! The host: what ties the daemon to its node and operating system rather than to NCCL's data.
//! The Unix sockets it binds, systemd's socket activation, readiness, watchdog and file descriptor
//! store, its log output, what each local uid may hold and how many log lines its processes can
//! cause, and steps of the host's clock. Its code imports nothing else of the daemon, so any part
//! may use it.

pub mod activation;
pub mod clock_step;
pub mod logging;
pub mod notify;
pub mod per_uid;
pub mod ratelimit;
pub mod socket;
