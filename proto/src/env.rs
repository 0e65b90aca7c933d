//! The `NCCLSCOPE_*` environment variables, listed once for both sides: a name that is not one of
//! them is a typo (`NCCLSCOPE_OTLP_ENDPOIT`) that would otherwise be ignored without a word. The
//! daemon refuses to start with one; the plugin, which never fails a job, logs one warning.

/// Every prefix of this crate's variables.
pub const PREFIX: &str = "NCCLSCOPE_";

/// The variables the plugin reads (docs/operator-guide.md, "The plugin").
pub const PLUGIN: &[&str] = &[
    "NCCLSCOPE_DISABLE",
    "NCCLSCOPE_EVENT_MASK",
    "NCCLSCOPE_SOCKET",
    "NCCLSCOPE_JOB_ID",
    "NCCLSCOPE_K8S_JOB_NAME",
    "NCCLSCOPE_K8S_POD_NAME",
    "NCCLSCOPE_K8S_NAMESPACE",
    "NCCLSCOPE_SEGMENT_RECORDS",
    "NCCLSCOPE_RING_MEMORY",
    "NCCLSCOPE_RING_SLOTS",
    "NCCLSCOPE_TEST_PANIC",
];

/// The variables the `ncclscope` commands read besides the daemon's configuration keys: the API
/// socket of `top`/`stats`/`export`, the log filter and format, the plugin `demo` loads.
pub const TOOLS: &[&str] = &[
    "NCCLSCOPE_API_SOCKET",
    "NCCLSCOPE_LOG",
    "NCCLSCOPE_LOG_FORMAT",
    "NCCLSCOPE_PLUGIN",
];

/// Prefixes of variables that belong to others, so neither side checks them: what test and
/// benchmark harnesses hand their own child processes, and the Slurm scripts' settings
/// (deploy/slurm, read by the scripts, not by `ncclscope`).
pub const NOT_OURS: &[&str] = &["NCCLSCOPE_TEST_", "NCCLSCOPE_BENCH_", "NCCLSCOPE_SLURM_"];

/// The `NCCLSCOPE_*` names in `names` that are neither in `known` nor another's ([`NOT_OURS`]), each
/// with the closest known name when it is a likely typo of it (at most two edits away).
pub fn unknown<'a>(
    names: impl IntoIterator<Item = &'a str>,
    known: &[&'a str],
) -> Vec<(&'a str, Option<&'a str>)> {
    names
        .into_iter()
        .filter(|n| n.starts_with(PREFIX))
        .filter(|n| !NOT_OURS.iter().any(|p| n.starts_with(p)) && !known.contains(n))
        .map(|n| {
            let best = known
                .iter()
                .map(|k| (edits(n, k), *k))
                .min()
                .filter(|(d, _)| *d <= 2)
                .map(|(_, k)| k);
            (n, best)
        })
        .collect()
}

/// "NCCLSCOPE_X (did you mean NCCLSCOPE_Y?), NCCLSCOPE_Z": the names [`unknown`] found, for a message.
pub fn describe(unknown: &[(&str, Option<&str>)]) -> String {
    unknown
        .iter()
        .map(|(n, best)| match best {
            Some(b) => format!("{n} (did you mean {b}?)"),
            None => n.to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Levenshtein distance over bytes.
fn edits(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typos_are_found_with_their_likely_name_and_harness_variables_pass() {
        let known = ["NCCLSCOPE_OTLP_ENDPOINT", "NCCLSCOPE_SOCKET"];
        let names = [
            "NCCLSCOPE_OTLP_ENDPOIT",
            "NCCLSCOPE_SOCKET",
            "NCCLSCOPE_COLOUR",
            "NCCLSCOPE_TEST_DAEMON_RANK",
            "PATH",
        ];
        let found = unknown(names, &known);
        assert_eq!(
            found,
            [
                ("NCCLSCOPE_OTLP_ENDPOIT", Some("NCCLSCOPE_OTLP_ENDPOINT")),
                ("NCCLSCOPE_COLOUR", None)
            ]
        );
        assert_eq!(
            describe(&found),
            "NCCLSCOPE_OTLP_ENDPOIT (did you mean NCCLSCOPE_OTLP_ENDPOINT?), NCCLSCOPE_COLOUR"
        );
        assert_eq!(edits("kitten", "sitting"), 3);
    }
}
