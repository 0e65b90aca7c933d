//! What the assembler counts, declared once: the struct, its sum over segments and the list of
//! losses the daemon exports are generated from the one table below.

/// Whether a counter measures the flow of records or a loss (exported as `ncclscope_lost_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Flow,
    Loss,
}

macro_rules! counters {
    ($( $(#[$doc:meta])* $name:ident: $kind:ident, )*) => {
        /// What the assembler counts; all monotonic.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct AssembleCounters {
            $( $(#[$doc])* pub $name: u64, )*
        }

        impl AssembleCounters {
            /// Adds `other` (saturating: a sum over segments never wraps).
            pub fn add(&mut self, other: &AssembleCounters) {
                $( self.$name = self.$name.saturating_add(other.$name); )*
            }

            /// (stage name, count) of every loss counter.
            pub fn losses(&self) -> impl Iterator<Item = (&'static str, u64)> {
                [$( (stringify!($name), Kind::$kind, self.$name) ),*]
                    .into_iter()
                    .filter(|c| c.1 == Kind::Loss)
                    .map(|c| (c.0, c.2))
            }
        }
    };
}

counters! {
    records: Flow,
    decode_errors: Flow,
    /// Device-hook work items read (joined, attributed to a replay, or not).
    dev_work: Flow,
    dev_joined: Flow,
    /// Operations mapped to host time by their KernelCh host stamps (no calibration of the device).
    host_anchored: Flow,
    /// Kernel records whose operation is unknown (never started, or already closed).
    kernel_unjoined: Loss,
    /// Operations closed without all their kernel work (timeout, communicator end, process exit).
    incomplete: Loss,
    /// Operations closed early because too many were in flight.
    pending_overflow: Loss,
    /// Kernel work left on the GPU clock: no calibration of its device and no host stamp.
    uncalibrated: Loss,
    /// Records for a communicator index that was never announced.
    unknown_comm: Loss,
    /// Records refused by a `Limits` bound (or redefining what is defined): new communicators,
    /// strings, device-function names, devices; kernel records beyond an operation's channels;
    /// device-hook work items beyond what may wait for their operation.
    comm_limit: Loss,
    string_limit: Loss,
    func_name_limit: Loss,
    device_limit: Loss,
    channel_limit: Loss,
    early_work_limit: Loss,
    /// Dictionary entries refused because the uid's segments together hold `uid_max_dictionary`.
    uid_limit: Loss,
    /// Device-hook work items of a communicator with captured operations that fit neither an eager
    /// operation nor the graph template's cursor: counted and dropped.
    dev_unattributed: Loss,
    /// Device-hook work items of NCCL's point-to-point kernel that no send or receive waited for on
    /// their channel when read: replays of a transfer the template does not hold (see
    /// `p2p_captured_untimed`), transfers on several nodes (`p2p_host_timed`), an item read before
    /// its operation's host event (see `assemble/p2p.rs`).
    dev_p2p: Loss,
    /// Sends and receives on the device-hook path delivered with their host times only: on several
    /// nodes (NCCL's p2p schedule there follows node topology that no event carries), or whose
    /// round's work items did not come.
    p2p_host_timed: Flow,
    /// Sends and receives captured into a CUDA graph on the device-hook path on several nodes (or
    /// to a peer out of range): not in the graph template, so their replays (which have no host
    /// event) are not delivered.
    p2p_captured_untimed: Loss,
    /// Device-hook instances whose work covers fewer channels than they announced: dropped.
    dev_mismatch: Loss,
    /// Device-hook work items at a replay boundary that an eager operation and the replay could
    /// both own, in every order the later items allow: dropped (see `hold`).
    dev_ambiguous: Loss,
    /// Instances whose kernel times, mapped to the host clock, fell before their enqueue or after the
    /// daemon read them (a host clock step between calibrations, a bad calibration): delivered with
    /// their host times only (a replay, which has none, dropped).
    implausible_time: Loss,
    /// Captured operations beyond `MAX_TEMPLATE_OPS` on one communicator (their replays' work
    /// items then count as `dev_unattributed`).
    template_full: Loss,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_saturate_and_losses_list_only_losses() {
        let mut a = AssembleCounters {
            records: 5,
            dev_ambiguous: u64::MAX - 1,
            ..Default::default()
        };
        a.add(&AssembleCounters {
            records: 2,
            dev_ambiguous: 7,
            uid_limit: 3,
            ..Default::default()
        });
        assert_eq!((a.records, a.dev_ambiguous, a.uid_limit), (7, u64::MAX, 3));
        let losses: std::collections::BTreeMap<_, _> = a.losses().collect();
        assert_eq!(losses["dev_ambiguous"], u64::MAX);
        assert_eq!(losses["uid_limit"], 3);
        assert_eq!(losses.len(), 19);
        assert!(!losses.contains_key("records") && !losses.contains_key("dev_joined"));
    }
}
