//! Shared support for the end-to-end tests in tests/tests/.

use std::path::{Path, PathBuf};
use std::process::Command;

use fake_opentelemetry_collector::ExportedSpan;

/// Runs `cmd`, which must succeed (its stderr is the failure message), and parses its stdout as JSON.
pub fn json_of(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The `ncclscope` binary of this build (next to the test executable's `deps/` directory).
pub fn daemon_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .join("ncclscope");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --workspace` first",
        bin.display()
    );
    bin
}

/// Adds `daemon` and its arguments for a daemon whose sockets, spool and state are in `dir`, and
/// whose configuration is `dir/ncclscope.toml` (written empty unless the test wrote one): a test
/// must not pick up the machine's /etc/ncclscope. Exports and Prometheus are the caller's to set.
pub fn daemon_args<'a>(c: &'a mut Command, dir: &Path) -> &'a mut Command {
    let config = dir.join("ncclscope.toml");
    if !config.exists() {
        std::fs::write(&config, "").unwrap();
    }
    c.arg("daemon")
        .arg("--config")
        .arg(config)
        .args(["--socket".as_ref(), dir.join("reg.sock").as_os_str()])
        .args(["--api-socket".as_ref(), dir.join("api.sock").as_os_str()])
        .args(["--spool-dir".as_ref(), dir.join("spool").as_os_str()])
        .args(["--state-dir".as_ref(), dir.join("state").as_os_str()])
}

/// A TCP port on `ip` that nothing listens on (now); `ip` any loopback address, all of 127.0.0.0/8
/// being the local host.
pub fn free_port(ip: &str) -> u16 {
    let l = std::net::TcpListener::bind((ip, 0)).unwrap();
    l.local_addr().unwrap().port()
}

/// The body of `GET /metrics` from the Prometheus endpoint at `addr` (`host:port`): "" while nothing
/// answers there (a daemon starting or gone).
pub fn scrape_metrics(addr: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_string())
}

/// Value of the sample `name{labels}` (labels as written, "" for none) in Prometheus text.
pub fn sample(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(name_and_labels)?
            .strip_prefix(' ')?
            .parse()
            .ok()
    })
}

/// A span attribute's value; the fake collector keeps them in their Debug form
/// (`Some(AnyValue { value: Some(IntValue(5)) })`). "" when absent.
pub fn attr<'a>(s: &'a ExportedSpan, k: &str) -> &'a str {
    let Some(v) = s.attributes.get(k) else {
        return "";
    };
    for (open, close) in [
        ("StringValue(\"", "\")"),
        ("IntValue(", ")"),
        ("DoubleValue(", ")"),
        ("BoolValue(", ")"),
    ] {
        if let Some(rest) = v.split_once(open).map(|(_, r)| r) {
            return rest.split_once(close).map_or(rest, |(v, _)| v);
        }
    }
    v
}

/// Quantiles as Prometheus computes them from what the daemon exports, to compare with exact values.
pub mod promql {
    /// `histogram_quantile` over classic cumulative buckets `(upper bound, count)`, +Inf last:
    /// linear inside the bucket that holds rank q * count, from the previous bound (0 for the
    /// first); in the +Inf bucket, the highest finite bound.
    pub fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> f64 {
        let rank = q * buckets.last().unwrap().1;
        let b = buckets.iter().position(|&(_, c)| c >= rank).unwrap();
        if b == buckets.len() - 1 {
            return buckets[b - 1].0;
        }
        let (start, before) = if b == 0 { (0.0, 0.0) } else { buckets[b - 1] };
        let (end, cum) = buckets[b];
        start + (end - start) * (rank - before) / (cum - before)
    }

    /// The classic buckets `(le, cumulative count)`, in order, of `name`'s series whose labels
    /// include every one of `with` (`key="value"`), read from Prometheus text.
    pub fn text_buckets(text: &str, name: &str, with: &[&str]) -> Vec<(f64, f64)> {
        let prefix = format!("{name}_bucket{{");
        text.lines()
            .filter(|l| l.starts_with(&prefix) && with.iter().all(|w| l.contains(w)))
            .map(|l| {
                let le = l.split("le=\"").nth(1).unwrap().split('"').next().unwrap();
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                (le, l.rsplit(' ').next().unwrap().parse().unwrap())
            })
            .collect()
    }

    /// A native (or OTLP exponential) histogram's quantile: exponential interpolation inside the
    /// bucket holding rank q * count. `counts[k]` is bucket `first + k`, (base^(i-1), base^i] with
    /// base 2^(2^-schema).
    pub fn native_quantile(q: f64, schema: i32, first: i32, counts: &[u64]) -> f64 {
        let rank = q * counts.iter().sum::<u64>() as f64;
        let log_bound = |i: i32| i as f64 / (schema as f64).exp2();
        let mut seen = 0.0;
        for (k, &c) in counts.iter().enumerate() {
            let c = c as f64;
            if c > 0.0 && seen + c >= rank {
                let i = first + k as i32;
                let (lo, hi) = (log_bound(i - 1), log_bound(i));
                return (lo + (hi - lo) * (rank - seen) / c).exp2();
            }
            seen += c;
        }
        panic!("rank {rank} beyond the buckets")
    }
}
