//! The plugin's settings, from `NCCLSCOPE_*` environment variables, read once at the first `init`.
//! An invalid value never fails the plugin: it is reported (logged once through NCCL's logger) and the
//! default is used instead.

use std::path::PathBuf;

use ncclscope_proto::env;
use ncclscope_proto::segment::{DEFAULT_CAPACITY, MAX_CAPACITY};

use crate::abi::event;

/// Events requested when `NCCLSCOPE_EVENT_MASK` is not set: Coll | P2p | KernelCh.
pub const DEFAULT_EVENT_MASK: i32 = (event::COLL | event::P2P | event::KERNEL_CH) as i32;
/// Where the job id comes from, first set wins: ours, Slurm's, torchrun's (the same on every node of
/// one run), and a Kubernetes Job or JobSet name passed in through the downward API (the pod's
/// `batch.kubernetes.io/job-name` or `jobset.sigs.k8s.io/jobset-name` label). Not `POD_NAME`: it
/// differs per pod, so it would split one job's ranks into many jobs.
pub const JOB_ID_SOURCES: [&str; 4] = [
    "NCCLSCOPE_JOB_ID",
    "SLURM_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "NCCLSCOPE_K8S_JOB_NAME",
];
/// Where the daemon listens when `NCCLSCOPE_SOCKET` is not set.
pub use ncclscope_proto::DEFAULT_SOCKET;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// `NCCLSCOPE_DISABLE=1`: `init` succeeds with an empty mask and nothing else happens.
    pub disabled: bool,
    /// `NCCLSCOPE_EVENT_MASK` (decimal or 0x-hex).
    pub event_mask: i32,
    /// Whether the user chose the mask; if not, the plugin may adjust it (drop KernelCh under the hook).
    pub mask_explicit: bool,
    /// `NCCLSCOPE_SOCKET`.
    pub socket: PathBuf,
    /// The first of [`JOB_ID_SOURCES`] that is set, else "unknown".
    pub job_id: String,
    /// `NCCLSCOPE_K8S_POD_NAME` and `NCCLSCOPE_K8S_NAMESPACE` (the downward API's `metadata.name`
    /// and `metadata.namespace`; "" elsewhere): the rank's pod, for labels that join
    /// kube-state-metrics' and DCGM exporter's.
    pub k8s_pod: String,
    pub k8s_namespace: String,
    /// `SLURM_JOB_ID` ("" outside Slurm), recorded beside the job id: the Slurm Epilog exports a
    /// job's trace by it even where the tasks chose their own `NCCLSCOPE_JOB_ID`.
    pub slurm_job_id: String,
    /// `NCCLSCOPE_SEGMENT_RECORDS`: ring capacity of the segment, a power of two.
    pub segment_records: u64,
    /// `NCCLSCOPE_TEST_PANIC=forward:N` (tests only): the forwarding thread panics once it has
    /// forwarded N events, to exercise what a real panic there does.
    pub test_panic_forward: Option<u64>,
    /// Problems found while reading the environment, for the log.
    pub warnings: Vec<String>,
}

impl Config {
    pub fn from_env() -> Config {
        let mut config = Config::from_lookup(|name| std::env::var(name).ok());
        let names: Vec<String> = std::env::vars_os()
            .filter_map(|(name, _)| name.into_string().ok())
            .collect();
        config
            .warnings
            .extend(unknown_variables(names.iter().map(String::as_str)));
        config
    }

    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Config {
        let mut warnings = Vec::new();
        let mut invalid = |name: &str, value: &str, why: &str| {
            warnings.push(format!(
                "ignoring {name}={value:?} ({why}); using the default"
            ));
        };
        let disabled = match var("NCCLSCOPE_DISABLE").as_deref().map(str::trim) {
            None | Some("" | "0") => false,
            Some("1") => true,
            Some(other) => {
                invalid("NCCLSCOPE_DISABLE", other, "expected 0 or 1");
                false
            }
        };
        let mut event_mask = DEFAULT_EVENT_MASK;
        let mut mask_explicit = false;
        if let Some(v) = var("NCCLSCOPE_EVENT_MASK") {
            match parse_int(&v)
                .and_then(|m| i32::try_from(m).ok())
                .filter(|m| *m >= 0)
            {
                Some(m) => {
                    event_mask = m;
                    mask_explicit = true;
                }
                None => invalid(
                    "NCCLSCOPE_EVENT_MASK",
                    &v,
                    "expected a non-negative integer",
                ),
            }
        }
        let socket = match var("NCCLSCOPE_SOCKET") {
            Some(s) if !s.is_empty() => PathBuf::from(s),
            _ => PathBuf::from(DEFAULT_SOCKET),
        };
        let job_id = JOB_ID_SOURCES
            .iter()
            .find_map(|name| var(name).filter(|v| !v.is_empty()))
            .unwrap_or_else(|| "unknown".to_string());
        let mut segment_records = DEFAULT_CAPACITY;
        if let Some(v) = var("NCCLSCOPE_SEGMENT_RECORDS") {
            match parse_int(&v).filter(|n| n.is_power_of_two() && *n >= 16 && *n <= MAX_CAPACITY) {
                Some(n) => segment_records = n,
                None => invalid(
                    "NCCLSCOPE_SEGMENT_RECORDS",
                    &v,
                    "expected a power of two from 16 to 2^24",
                ),
            }
        }
        // Read by `ncclscope_proto::clock_offset_ns`, which takes an invalid value as 0.
        let name = ncclscope_proto::TEST_CLOCK_OFFSET;
        if let Some(v) = var(name)
            && let Err(why) = ncclscope_proto::parse_clock_offset(Some(&v))
        {
            invalid(name, &v, &why);
        }
        let mut test_panic_forward = None;
        if let Some(v) = var("NCCLSCOPE_TEST_PANIC") {
            match v.strip_prefix("forward:").and_then(parse_int) {
                Some(n) => test_panic_forward = Some(n),
                None => invalid("NCCLSCOPE_TEST_PANIC", &v, "expected forward:N"),
            }
        }
        Config {
            disabled,
            event_mask,
            mask_explicit,
            socket,
            job_id,
            k8s_pod: var("NCCLSCOPE_K8S_POD_NAME").unwrap_or_default(),
            k8s_namespace: var("NCCLSCOPE_K8S_NAMESPACE").unwrap_or_default(),
            slurm_job_id: var("SLURM_JOB_ID").unwrap_or_default(),
            segment_records,
            test_panic_forward,
            warnings,
        }
    }
}

/// One warning naming every `NCCLSCOPE_*` variable in `names` that neither the plugin nor the
/// `ncclscope` tools read: a misspelt setting would otherwise stay at its default without a word.
/// A warning, never an error: the plugin does not fail a job.
pub fn unknown_variables<'a>(names: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let known: Vec<&str> = env::PLUGIN.iter().chain(env::TOOLS).copied().collect();
    let unknown = env::unknown(names, &known);
    (!unknown.is_empty()).then(|| {
        format!(
            "ignoring unknown {} {} (the plugin reads {})",
            if unknown.len() == 1 {
                "variable"
            } else {
                "variables"
            },
            env::describe(&unknown),
            env::PLUGIN.join(", ")
        )
    })
}

fn parse_int(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(vars: &[(&str, &str)]) -> Config {
        Config::from_lookup(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        let c = config(&[]);
        assert!(!c.disabled);
        assert_eq!(c.event_mask, 0x46);
        assert!(!c.mask_explicit);
        assert_eq!(c.socket, PathBuf::from(DEFAULT_SOCKET));
        assert_eq!(c.job_id, "unknown");
        assert_eq!(c.segment_records, DEFAULT_CAPACITY);
        assert_eq!(c.test_panic_forward, None);
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn values_are_parsed() {
        let c = config(&[
            ("NCCLSCOPE_DISABLE", "1"),
            ("NCCLSCOPE_EVENT_MASK", "0x8046"),
            ("NCCLSCOPE_SOCKET", "/tmp/s.sock"),
            ("SLURM_JOB_ID", "42"),
            ("TORCHELASTIC_RUN_ID", "run-1"),
            ("NCCLSCOPE_K8S_JOB_NAME", "train"),
            ("NCCLSCOPE_SEGMENT_RECORDS", "1024"),
        ]);
        assert!(c.disabled);
        assert_eq!((c.event_mask, c.mask_explicit), (0x8046, true));
        assert_eq!(c.socket, PathBuf::from("/tmp/s.sock"));
        assert_eq!(
            c.job_id, "42",
            "SLURM_JOB_ID wins over torchrun's and the Job's"
        );
        assert_eq!(c.segment_records, 1024);
        assert_eq!(config(&[("NCCLSCOPE_EVENT_MASK", "6")]).event_mask, 6);
        let k8s = [
            ("NCCLSCOPE_K8S_JOB_NAME", "train"),
            ("POD_NAME", "train-0-x7"),
        ];
        assert_eq!(config(&k8s).job_id, "train", "a pod's name is not a job id");
        assert_eq!(config(&k8s[1..]).job_id, "unknown");
        // The pod, for labels, only from the variables of ours the pod snippet sets.
        assert_eq!(config(&k8s).k8s_pod, "");
        let pod = config(&[
            ("NCCLSCOPE_K8S_JOB_NAME", "train"),
            ("NCCLSCOPE_K8S_POD_NAME", "train-0-x7"),
            ("NCCLSCOPE_K8S_NAMESPACE", "ml-team"),
        ]);
        assert_eq!(
            (
                pod.job_id.as_str(),
                pod.k8s_pod.as_str(),
                pod.k8s_namespace.as_str()
            ),
            ("train", "train-0-x7", "ml-team")
        );
        let elastic = [
            ("TORCHELASTIC_RUN_ID", "run-1"),
            ("NCCLSCOPE_K8S_JOB_NAME", "t"),
        ];
        assert_eq!(config(&elastic).job_id, "run-1");
        let own = config(&[("NCCLSCOPE_JOB_ID", "mine"), ("SLURM_JOB_ID", "42")]);
        assert_eq!(
            (own.job_id.as_str(), own.slurm_job_id.as_str()),
            ("mine", "42"),
            "a task's own job id, and the Slurm job beside it"
        );
        let panic = config(&[("NCCLSCOPE_TEST_PANIC", "forward:300")]);
        assert_eq!(panic.test_panic_forward, Some(300));
    }

    #[test]
    fn invalid_values_fall_back_with_a_warning() {
        let c = config(&[
            ("NCCLSCOPE_DISABLE", "yes"),
            ("NCCLSCOPE_EVENT_MASK", "-1"),
            ("NCCLSCOPE_SEGMENT_RECORDS", "1000"),
            ("NCCLSCOPE_TEST_PANIC", "drain"),
            ("NCCLSCOPE_TEST_CLOCK_OFFSET_NS", "7ms"),
        ]);
        assert!(!c.disabled);
        assert_eq!((c.event_mask, c.mask_explicit), (DEFAULT_EVENT_MASK, false));
        assert_eq!(c.segment_records, DEFAULT_CAPACITY);
        assert_eq!(c.test_panic_forward, None);
        assert_eq!(c.warnings.len(), 5, "{:?}", c.warnings);
        assert!(c.warnings[1].contains("NCCLSCOPE_EVENT_MASK"));
        assert!(c.warnings[3].contains("NCCLSCOPE_TEST_CLOCK_OFFSET_NS=\"7ms\""));
    }
}
