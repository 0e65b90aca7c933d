//! Per-segment resume state, one small JSON file per segment in `state_dir`. The segment's committed
//! tail survives a daemon restart inside the segment itself; this file carries what the records before
//! the tail defined (strings, communicators, calibration) and which operations after the tail were
//! already delivered, so a restarted daemon neither misreads nor double-counts what it re-reads
//! (together with the spool's record of what it holds from the saved position on).

use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::assemble::Dictionary;
use crate::spool::Position;

#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SegmentState {
    /// The segment this belongs to (a reused file name with another owner is ignored).
    pub segment: String,
    /// Committed tail when written: the file is valid for a segment whose tail is this or later.
    pub tail: u64,
    pub dictionary: Dictionary,
    /// (operation id, position of its first record, sinks it was delivered to).
    pub delivered: Vec<(u64, u64, u8)>,
    /// The spool of the segment's job when this was written: whatever of the segment was spooled later
    /// lies past it (`None`: written without a spool, or by a daemon that did not record it).
    #[serde(default)]
    pub spool_mark: Option<Position>,
}

pub fn path(dir: &Path, segment: &str) -> PathBuf {
    dir.join(format!("{segment}.json"))
}

/// The state saved for `segment`, if any.
pub fn load(dir: &Path, segment: &str) -> io::Result<Option<SegmentState>> {
    let text = match std::fs::read(path(dir, segment)) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let state: SegmentState =
        serde_json::from_slice(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok((state.segment == segment).then_some(state))
}

/// Replaces the saved state atomically (write then rename).
pub fn store(dir: &Path, state: &SegmentState) -> io::Result<()> {
    let final_path = path(dir, &state.segment);
    let tmp = final_path.with_extension("json.tmp");
    // 0600 whatever the umask: a state names a user's job, communicators and strings.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(&serde_json::to_vec(state).map_err(io::Error::other)?)?;
    drop(f);
    std::fs::rename(&tmp, &final_path)
}

pub fn remove(dir: &Path, segment: &str) {
    let _ = std::fs::remove_file(path(dir, segment));
}

/// Segment names that have a state file (to clean up after segments that vanished meanwhile).
pub fn list(dir: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| {
        e.ok()?
            .file_name()
            .to_str()?
            .strip_suffix(".json")
            .map(str::to_string)
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_owner_check() {
        let dir = tempfile::tempdir().unwrap();
        let s = SegmentState {
            segment: "p.1.2.3".into(),
            tail: 9,
            delivered: vec![(5, 10, 3)],
            ..Default::default()
        };
        store(dir.path(), &s).unwrap();
        let mode = std::fs::metadata(path(dir.path(), "p.1.2.3"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "the daemon's alone, whatever the umask"
        );
        assert_eq!(load(dir.path(), "p.1.2.3").unwrap(), Some(s));
        assert_eq!(list(dir.path()), vec!["p.1.2.3".to_string()]);
        assert_eq!(load(dir.path(), "p.1.2.4").unwrap(), None);
        std::fs::write(path(dir.path(), "bad"), b"{").unwrap();
        assert!(load(dir.path(), "bad").is_err());
        remove(dir.path(), "p.1.2.3");
        assert_eq!(load(dir.path(), "p.1.2.3").unwrap(), None);
    }
}
