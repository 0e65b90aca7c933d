//! Starting the plugin in a process (the first `init`) and opening each communicator: the one place
//! that knows both the process-wide state (`profiler`) and the forwarding thread (`forward`).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicI32, Ordering};

use ncclscope_proto::Producer;
use ncclscope_proto::segment::{Claims, Pod, Segment};

use crate::abi::Logger;
use crate::clock;
use crate::config::Config;
use crate::devhook;
use crate::forward::Forwarder;
use crate::host;
use crate::profiler::{self, FORKED, PLUGIN, Plugin};

/// `init`: returns the communicator context (NULL when disabled), after setting NCCL's activation
/// `mask`.
#[allow(clippy::too_many_arguments)]
pub fn init(
    abi: u32,
    comm_hash: u64,
    mask: Option<&'static AtomicI32>,
    name: Vec<u8>,
    nnodes: c_int,
    nranks: c_int,
    rank: c_int,
    logfn: Option<Logger>,
) -> *mut c_void {
    host::set_logger(logfn);
    // A child forked after the plugin started is not profiled, and says nothing: a lock that another
    // thread held at fork time (NCCL's logger, stderr, our log-once set) would never be released in it.
    let launched =
        (!FORKED.load(Ordering::Relaxed)).then(|| *PLUGIN.get_or_init(|| launch(abi, logfn)));
    let Some(plugin) = launched.flatten() else {
        if let Some(mask) = mask {
            mask.store(0, Ordering::Relaxed);
        }
        return std::ptr::null_mut();
    };
    if abi == 7 && !plugin.host.v7_descriptors() && !plugin.host.is_rfc() {
        host::log_once(
            "v7-unknown-host",
            true,
            &format!(
                "ncclProfiler_v7 called by NCCL {}, which is not >= 2.31: reading v6 descriptor fields only",
                plugin.host.version_text()
            ),
        );
    }
    plugin.set_mask_ptr(mask);
    plugin.apply_mask();
    plugin.open_comm(comm_hash, name, nnodes, nranks, rank)
}

/// Starts the plugin for the process: configuration, the hosting NCCL, the segment, the forwarding
/// thread. None: disabled (logged why).
fn launch(abi: u32, logfn: Option<Logger>) -> Option<&'static Plugin> {
    let config = Config::from_env();
    for w in &config.warnings {
        host::log(true, w);
    }
    if config.disabled {
        host::log(false, "disabled by NCCLSCOPE_DISABLE=1");
        return None;
    }
    let host = host::detect(logfn);
    devhook::set_log(host::log);
    devhook::set_func_name_fn(host.dev_func_name);
    if let Some(why) = host.is_rfc().then(devhook::gpu_unavailable).flatten() {
        host::log(
            false,
            &format!("the device hook cannot use a GPU here: {why}"),
        );
    }
    if !host::pin_self() {
        host::log(
            true,
            "cannot pin the plugin library in memory; profiling disabled",
        );
        return None;
    }
    let hostname = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let claims = Claims {
        hostname,
        job_id: config.job_id.clone(),
        slurm_job_id: config.slurm_job_id.clone(),
    };
    let segment = match Segment::create(&claims, config.segment_records) {
        Ok(s) => s,
        Err(e) => {
            host::log(
                true,
                &format!("cannot create the segment ({e}); profiling disabled"),
            );
            return None;
        }
    };
    segment.set_pod(&Pod {
        name: config.k8s_pod.clone(),
        namespace: config.k8s_namespace.clone(),
    });
    host::log(
        false,
        &format!(
            "plugin {} loaded as ncclProfiler_v{abi} by NCCL {}{}; job {}, mask {:#x}",
            env!("CARGO_PKG_VERSION"),
            host.version_text(),
            if host.is_rfc() {
                " (device-hook RFC)"
            } else {
                ""
            },
            config.job_id,
            config.event_mask
        ),
    );
    let plugin: &'static Plugin = Box::leak(Box::new(Plugin::new(config, host)));
    // SAFETY: registers a handler that only stores to an atomic (async-signal-safe); the library is
    // pinned, so the handler stays mapped.
    unsafe { libc::pthread_atfork(None, None, Some(profiler::forked_child)) };
    // SAFETY: registers a function that catches every panic and touches only the leaked,
    // 'static plugin; the library is pinned, so it stays mapped until exit runs it.
    unsafe { libc::atexit(profiler::flush_at_exit) };
    clock::init();
    let forwarder = Forwarder::new(plugin, Producer::new(segment));
    match std::thread::Builder::new()
        .name("ncclscope-fwd".into())
        .spawn(move || forwarder.run())
    {
        Ok(handle) => {
            plugin.set_forwarder(handle.thread().clone());
            Some(plugin)
        }
        Err(e) => {
            host::log(
                true,
                &format!("cannot start the forwarding thread ({e}); profiling disabled"),
            );
            None
        }
    }
}
