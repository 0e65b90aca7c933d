//! Hostile segments: one truncated under the daemon, one unsealed, one flooding it: refused or
//! bounded, counted, and the others not starved.

use crate::support::*;

/// Issue 11, item 3, issue 21: a process cannot truncate its registered segment under the daemon's
/// mapping (sealed), and one that hands over a memory file without the seals is refused and counted.
#[test]
fn a_segment_cannot_be_truncated_under_the_daemon_and_an_unsealed_one_is_refused() {
    const NCOLLS: u64 = 2000;
    let mut h = Scenario::new().start("");
    h.start_fault("truncate", 3);
    h.start_ranks(2, NCOLLS, 1000);
    let text = h.metrics_when(Duration::from_secs(20), Duration::from_millis(100), |t| {
        lost(t, "segment_unsealed") == Some(1.0)
    });
    assert_eq!(lost(&text, "segment_unsealed"), Some(1.0), "{text}");
    // The sealed segment was delivered whole; nothing is corrupt.
    let text = h.metrics();
    let delivered = job_collectives(&text, "truncate-job");
    assert_eq!(delivered, 100.0, "{text}");
    assert_eq!(lost(&h.metrics(), "corrupt_segment"), Some(0.0));
    h.wait_ranks();
    let took = wait_job(&h, 2 * NCOLLS, Duration::from_secs(30));
    eprintln!("truncate: well-behaved ranks complete {took:?} after they exited");
    assert!(h.daemon_alive());
    // Every segment is dropped once its process is gone.
    assert_eq!(h.segments_left_after(Duration::from_secs(30)), 0);
}

/// Issue 11, item 4: a process writing an adversarial stream beside two well-behaved ranks. The
/// daemon's memory stays bounded, the refusals are counted, and the ranks are ingested completely
/// and promptly.
#[test]
fn a_hostile_segment_is_bounded_and_does_not_starve_the_others() {
    const NCOLLS: u64 = 4000;
    const HOSTILE_SECS: u64 = 12;
    // Operations that never stop time out early in the run, not in the middle of the RSS samples;
    // the dictionary limits are reached within the first seconds even on a loaded machine.
    let mut h = Scenario::new()
        .config("[aggregate]\nop_timeout_ms = 2000")
        .config(
            "[limits]\nmax_comms = 256\nmax_strings = 1024\nmax_func_names = 1024\n\
             max_job_series = 64",
        )
        .start("");
    std::thread::sleep(Duration::from_millis(300));
    let rss_start = h.daemon_rss_mib();
    for mode in ["churn", "flood", "stall"] {
        h.start_fault(mode, HOSTILE_SECS);
    }
    let t0 = Instant::now();
    let mut samples = Vec::new();
    // The well-behaved ranks start once the hostile stream is in full flow.
    let mut ranks_started = false;
    while t0.elapsed() < Duration::from_secs(HOSTILE_SECS) {
        assert!(h.daemon_alive(), "the daemon died");
        samples.push((t0.elapsed().as_secs_f64(), h.daemon_rss_mib()));
        if !ranks_started && t0.elapsed() > Duration::from_secs(4) {
            h.start_ranks(2, NCOLLS, 500);
            ranks_started = true;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let text = h.metrics();
    let peak = |from: f64, to: f64| {
        (samples.iter())
            .filter(|s| (from..to).contains(&s.0))
            .map(|s| s.1)
            .fold(0.0, f64::max)
    };
    let t = HOSTILE_SECS as f64;
    let rss_max = peak(0.0, t);
    // Peak of the last third over the peak of the middle third: what the daemon holds still grows?
    let late_growth = peak(2.0 * t / 3.0, t) - peak(t / 3.0, 2.0 * t / 3.0);
    let stage = |s: &str| lost(&text, s).unwrap_or(0.0);
    eprintln!(
        "hostile: daemon RSS {rss_start:.1} MiB before, max {rss_max:.1} MiB, last third's peak \
         over the middle third's {late_growth:.1} MiB; records {:?}; refused: comm {} string {} \
         func_name {} device {} channel {} early_work {} rank_series {}; dev_unjoined {} \
         pending_overflow {} ring_full {}",
        sample(&text, "ncclscope_records_total"),
        stage("comm_limit"),
        stage("string_limit"),
        stage("func_name_limit"),
        stage("device_limit"),
        stage("channel_limit"),
        stage("early_work_limit"),
        stage("rank_series_limit"),
        stage("dev_unjoined"),
        stage("pending_overflow"),
        stage("ring_full"),
    );
    // The well-behaved ranks ran beside it (paced: about 2 s) and are complete within seconds.
    h.wait_ranks();
    let took = wait_job(&h, 2 * NCOLLS, Duration::from_secs(5));
    eprintln!("hostile: well-behaved ranks complete {took:?} after they exited; RSS {samples:?}");
    assert!(h.daemon_alive());
    assert!(rss_max < 150.0, "daemon RSS {rss_max:.1} MiB: {samples:?}");
    assert!(
        late_growth < 12.0,
        "daemon RSS still growing by {late_growth:.1} MiB: {samples:?}"
    );
    for s in [
        "comm_limit",
        "string_limit",
        "func_name_limit",
        "device_limit",
        "channel_limit",
    ] {
        assert!(stage(s) > 0.0, "{s} counted");
    }
}
