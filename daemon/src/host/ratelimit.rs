//! Log lines that a local user's processes or connections can cause (a refused segment, a corrupt
//! one, a connection past the bound) are limited per uid, so that no user can flood the daemon's log
//! or bury another's lines: [`BURST`] a minute per uid, and the next line allowed says how many were
//! held back. What they count is counted in full elsewhere (metrics); only the lines are limited.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines one uid may cause per [`WINDOW`].
pub const BURST: u32 = 10;
pub const WINDOW: Duration = Duration::from_secs(60);
/// Uids remembered at once; past it the map starts afresh (a uid then gets a new burst).
const MAX_UIDS: usize = 4096;

#[derive(Debug)]
struct Uid {
    since: Instant,
    lines: u32,
    held_back: u64,
}

/// A limiter of lines per uid.
#[derive(Debug, Default)]
pub struct PerUid {
    uids: Mutex<HashMap<u32, Uid>>,
}

impl PerUid {
    /// Whether a line caused by `uid` may be logged now; if so, how many were held back before it.
    pub fn allow(&self, uid: u32) -> Option<u64> {
        self.allow_at(uid, Instant::now())
    }

    fn allow_at(&self, uid: u32, now: Instant) -> Option<u64> {
        let mut uids = self.uids.lock().unwrap_or_else(|e| e.into_inner());
        if uids.len() >= MAX_UIDS && !uids.contains_key(&uid) {
            uids.clear();
        }
        let u = uids.entry(uid).or_insert(Uid {
            since: now,
            lines: 0,
            held_back: 0,
        });
        if now.duration_since(u.since) >= WINDOW {
            (u.since, u.lines) = (now, 0);
        }
        if u.lines >= BURST {
            u.held_back += 1;
            return None;
        }
        u.lines += 1;
        Some(std::mem::take(&mut u.held_back))
    }
}

/// The daemon's limiter: every site that logs on a user's account shares it.
pub fn lines() -> &'static PerUid {
    static LINES: std::sync::OnceLock<PerUid> = std::sync::OnceLock::new();
    LINES.get_or_init(PerUid::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_per_uid_a_minute_and_then_what_was_held_back() {
        let l = PerUid::default();
        let t0 = Instant::now();
        let allowed = (0..1000).filter(|_| l.allow_at(7, t0).is_some()).count();
        assert_eq!(allowed, BURST as usize);
        assert_eq!(l.allow_at(8, t0), Some(0), "another uid has its own burst");
        let later = t0 + WINDOW;
        assert_eq!(l.allow_at(7, later), Some(1000 - BURST as u64));
        assert_eq!(l.allow_at(7, later), Some(0));
    }
}
