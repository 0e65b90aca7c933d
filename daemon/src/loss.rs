//! The daemon's own loss stages (the `stage` label of `ncclscope_lost_total`, next to the plugin's
//! counters and the assembler's): one enum, so that a stage cannot be misspelt in one place and
//! exported under another name.

macro_rules! stages {
    ($( $(#[$doc:meta])* $variant:ident => $name:literal, )*) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Loss {
            $( $(#[$doc])* $variant, )*
        }

        impl Loss {
            pub const ALL: &[Loss] = &[$( Loss::$variant ),*];

            /// The stage's name in metrics and the API.
            pub fn name(self) -> &'static str {
                match self {
                    $( Loss::$variant => $name, )*
                }
            }
        }
    };
}

stages! {
    /// A registration that did not hand over a sound segment (no descriptor, malformed, too small).
    SegmentInvalid => "segment_invalid",
    /// A segment handed over by a peer other than the uid that created it.
    SegmentForeign => "segment_foreign",
    /// A segment whose memory file is not sealed (its size could change under the daemon).
    SegmentUnsealed => "segment_unsealed",
    /// Segments refused because the daemon holds `drain.max_segments`.
    SegmentsRefused => "segments_refused",
    /// Segments refused because their uid holds `limits.max_segments_per_uid`.
    UidSegmentQuota => "uid_segment_quota",
    /// A segment whose memory file is attached already, handed over by another process (a forked
    /// child): one reader per ring, or its records would be counted twice.
    SegmentDuplicate => "segment_duplicate",
    /// Registration connections closed at accept because their uid held
    /// `register::MAX_CONNECTIONS_PER_UID`.
    UidConnectionQuota => "uid_connection_quota",
    /// Registration connections closed at accept because the daemon held `register::MAX_CONNECTIONS`.
    ConnectionsRefused => "connections_refused",
    /// A segment whose ring could not be read (a corrupt header or record words).
    CorruptSegment => "corrupt_segment",
    /// The spool could not be read back when a segment's resume state was checked against it.
    SpoolUnreadable => "spool_unreadable",
    /// A segment attached after a restart whose resume state is gone: read from its tail anew.
    ResumeStateMissing => "resume_state_missing",
    /// A resume state that could not be written (the tail then does not move).
    StateWriteFailed => "state_write_failed",
    /// Instances the spool could not take (a full disk, an I/O error).
    SpoolFailed => "spool_failed",
    /// Instances not spooled because the spool writer had `group_commit::QUEUE_BATCHES` batches
    /// queued (a disk slower than ingest): ingest does not wait for it.
    SpoolBacklog => "spool_backlog",
    /// Instances refused at the exporter's queue (a slow or absent collector).
    ExportQueueFull => "export_queue_full",
}

/// A count per stage.
#[derive(Clone, Debug, Default)]
pub struct Losses([u64; Loss::ALL.len()]);

impl Losses {
    pub fn add(&mut self, stage: Loss, n: u64) {
        let c = &mut self.0[stage as usize];
        *c = c.saturating_add(n);
    }

    pub fn get(&self, stage: Loss) -> u64 {
        self.0[stage as usize]
    }

    /// (name, count) of every stage, zero ones included: each is exported from the start.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        Loss::ALL.iter().map(|&s| (s.name(), self.0[s as usize]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_has_its_own_slot_and_name() {
        let mut l = Losses::default();
        for (i, &s) in Loss::ALL.iter().enumerate() {
            assert_eq!(s as usize, i);
            l.add(s, i as u64 + 1);
        }
        l.add(Loss::SpoolFailed, u64::MAX);
        let names: std::collections::BTreeSet<_> = l.iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), Loss::ALL.len(), "names are distinct");
        assert_eq!(l.get(Loss::SegmentForeign), 2);
        assert_eq!(l.get(Loss::SpoolFailed), u64::MAX, "saturating");
    }
}
