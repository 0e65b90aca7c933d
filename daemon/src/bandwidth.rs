//! Message sizes and bandwidths exactly as NCCL Inspector defines them, so ncclscope's busBW can be
//! compared with Inspector's and nccl-tests': algBW = bytes / exec time, busBW = algBW * factor, where
//!
//! | collective | bytes | busBW factor |
//! |---|---|---|
//! | AllReduce | msg | 2(n-1)/n |
//! | AllGather(V), ReduceScatter | msg * nranks | (n-1)/n |
//! | everything else (Reduce, Broadcast, p2p) | msg | 1 |
//!
//! with msg = count * sizeof(datatype).

/// Bytes per element of an NCCL datatype, by the name NCCL gives the profiler (`ncclFloat32`, ...),
/// any case. Lowercased once and matched at once: the statistics size every instance's message, and
/// a case-insensitive compare against each name in turn was over a percent of ingest.
pub fn datatype_size(name: &str) -> Option<u64> {
    let n = name.strip_prefix("nccl").unwrap_or(name);
    // Room for every name matched below (10 bytes at most): a longer one is no datatype.
    let mut buf = [0u8; 16];
    let lower = buf.get_mut(..n.len())?;
    lower.copy_from_slice(n.as_bytes());
    lower.make_ascii_lowercase();
    match &*lower {
        b"int8" | b"char" | b"uint8" | b"float8e4m3" | b"float8e5m2" => Some(1),
        b"float16" | b"half" | b"bfloat16" => Some(2),
        b"int32" | b"int" | b"uint32" | b"float32" | b"float" => Some(4),
        b"int64" | b"uint64" | b"float64" | b"double" => Some(8),
        _ => None,
    }
}

/// The bytes Inspector divides by the execution time for `func` with a message of `msg_bytes`.
pub fn inspector_bytes(func: &str, msg_bytes: u64, nranks: u32) -> u64 {
    match func {
        "AllGather" | "AllGatherV" | "ReduceScatter" => msg_bytes.saturating_mul(nranks as u64),
        _ => msg_bytes,
    }
}

/// Inspector's busBW factor for `func` over `nranks` ranks.
pub fn bus_factor(func: &str, nranks: u32) -> f64 {
    let n = nranks.max(1) as f64;
    match func {
        "AllReduce" => 2.0 * (n - 1.0) / n,
        "AllGather" | "AllGatherV" | "ReduceScatter" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// (algBW, busBW) in GB/s (10^9 bytes per second); zero when there is no execution time.
pub fn bandwidths(func: &str, bytes: u64, nranks: u32, exec_ns: u64) -> (f64, f64) {
    if exec_ns == 0 {
        return (0.0, 0.0);
    }
    let alg = bytes as f64 / exec_ns as f64; // bytes per ns = GB/s
    (alg, alg * bus_factor(func, nranks))
}

/// Labels of the message-size buckets: powers of two from 1 KiB to 16 GiB, as "upper bound".
pub fn size_bucket(bytes: u64) -> &'static str {
    const LABELS: [&str; 25] = [
        "<=1KiB", "<=2KiB", "<=4KiB", "<=8KiB", "<=16KiB", "<=32KiB", "<=64KiB", "<=128KiB",
        "<=256KiB", "<=512KiB", "<=1MiB", "<=2MiB", "<=4MiB", "<=8MiB", "<=16MiB", "<=32MiB",
        "<=64MiB", "<=128MiB", "<=256MiB", "<=512MiB", "<=1GiB", "<=2GiB", "<=4GiB", "<=8GiB",
        ">8GiB",
    ];
    let log = 64 - bytes.max(1).saturating_sub(1).leading_zeros() as usize; // ceil(log2)
    LABELS[log.saturating_sub(10).min(LABELS.len() - 1)]
}

/// NCCL Inspector's message size: count x the datatype's size (for AllGather and ReduceScatter one
/// rank's part, not [`inspector_bytes`]); `bytes` where the datatype is unknown.
pub fn message_bytes(datatype: &str, count: u64, bytes: u64) -> u64 {
    datatype_size(datatype).map_or(bytes, |size| size.saturating_mul(count))
}

const UNITS: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];

/// The scale of Inspector's message-size ranges for `bytes`: the largest 1024^k <= bytes (k <= 4).
fn unit_of(bytes: u64) -> (usize, u64) {
    let (mut k, mut unit) = (0, 1u64);
    while k < UNITS.len() - 1 && bytes / unit >= 1024 {
        k += 1;
        unit *= 1024;
    }
    (k, unit)
}

/// The lower bound in bytes of NCCL Inspector's Prometheus `message_size` range holding `bytes`:
/// whole units of the largest binary unit not above it (1536 B in [1 KB, 2 KB): 1024; 0: 0).
pub fn message_size_range(bytes: u64) -> u64 {
    let (_, unit) = unit_of(bytes);
    bytes / unit * unit
}

/// Inspector's label of the range starting at `lower` ([`message_size_range`]): `1-2KB`,
/// `8-9MB`, `0B` (units of 1024, as Inspector names them).
pub fn message_size_label(lower: u64) -> String {
    if lower == 0 {
        return "0B".into();
    }
    let (k, unit) = unit_of(lower);
    let n = lower / unit;
    format!("{n}-{}{}", n + 1, UNITS[k])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datatypes_by_nccl_name() {
        assert_eq!(datatype_size("ncclFloat32"), Some(4));
        assert_eq!(datatype_size("ncclBfloat16"), Some(2));
        assert_eq!(datatype_size("ncclInt8"), Some(1));
        assert_eq!(datatype_size("ncclFloat64"), Some(8));
        assert_eq!(datatype_size("ncclFloat8e4m3"), Some(1));
        assert_eq!(datatype_size("float8e5m2"), Some(1));
        assert_eq!(datatype_size("ncclFloat8e4m3fnuzLongerThanAny"), None);
        assert_eq!(datatype_size("ncclUint64"), Some(8));
        assert_eq!(datatype_size("ncclNothing"), None);
    }

    #[test]
    fn inspector_definitions() {
        // 1 GB AllReduce over 8 ranks in 10 ms: algBW 100 GB/s, busBW 175 GB/s.
        let (alg, bus) = bandwidths(
            "AllReduce",
            inspector_bytes("AllReduce", 1_000_000_000, 8),
            8,
            10_000_000,
        );
        assert!(
            (alg - 100.0).abs() < 1e-9 && (bus - 175.0).abs() < 1e-9,
            "{alg} {bus}"
        );
        // AllGather: bytes are msg * nranks, factor (n-1)/n.
        let b = inspector_bytes("AllGather", 1_000_000, 4);
        assert_eq!(b, 4_000_000);
        let (alg, bus) = bandwidths("AllGather", b, 4, 1_000_000);
        assert!((alg - 4.0).abs() < 1e-9 && (bus - 3.0).abs() < 1e-9);
        assert_eq!(bus_factor("Broadcast", 8), 1.0);
        assert_eq!(bus_factor("Send", 8), 1.0);
        assert_eq!(bandwidths("AllReduce", 10, 2, 0), (0.0, 0.0));
    }

    #[test]
    fn inspector_message_sizes() {
        let label = |b| message_size_label(message_size_range(b));
        assert_eq!(label(0), "0B");
        assert_eq!(label(1), "1-2B");
        assert_eq!(label(1023), "1023-1024B");
        assert_eq!(label(1024), "1-2KB");
        assert_eq!(label(1536), "1-2KB");
        assert_eq!(label(2048), "2-3KB");
        assert_eq!(label(1024 * 1024 - 1), "1023-1024KB");
        assert_eq!(label(3 << 20), "3-4MB");
        assert_eq!(label((8 << 20) + (1 << 19)), "8-9MB");
        assert_eq!(label(2 << 30), "2-3GB");
        assert_eq!(label(5000 << 40), "5000-5001TB");
        // A 1 MiB per-rank all-gather of 4 ranks: Inspector's size is the rank's part.
        assert_eq!(message_bytes("ncclFloat32", 262_144, 4 << 20), 1 << 20);
        assert_eq!(message_bytes("ncclSomething", 7, 99), 99);
    }

    #[test]
    fn size_buckets() {
        assert_eq!(size_bucket(0), "<=1KiB");
        assert_eq!(size_bucket(1024), "<=1KiB");
        assert_eq!(size_bucket(1025), "<=2KiB");
        assert_eq!(size_bucket(1 << 20), "<=1MiB");
        assert_eq!(size_bucket(u64::MAX), ">8GiB");
    }
}
