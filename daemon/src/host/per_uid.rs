//! How many of something (connections, streams) each uid holds, bounded per uid and in all: what
//! one local user can make the daemon hold. A [`Held`] gives its place back when dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, Default)]
pub struct PerUid {
    held: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    of: HashMap<u32, usize>,
    all: usize,
}

/// Why no place was given: the uid holds its most, or all uids together hold theirs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    Uid,
    All,
}

impl PerUid {
    /// One more for `uid`, if it holds fewer than `per_uid` (root: any number) and every uid
    /// together fewer than `all`.
    pub fn take(self: &Arc<Self>, uid: u32, per_uid: usize, all: usize) -> Result<Held, Full> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.all >= all {
            return Err(Full::All);
        }
        let n = held.of.entry(uid).or_default();
        if uid != 0 && *n >= per_uid {
            return Err(Full::Uid);
        }
        *n += 1;
        held.all += 1;
        Ok(Held {
            uid,
            of: self.clone(),
        })
    }
}

#[derive(Debug)]
pub struct Held {
    uid: u32,
    of: Arc<PerUid>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.of.held.lock().unwrap_or_else(|e| e.into_inner());
        held.all -= 1;
        if let Some(n) = held.of.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                held.of.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_each_uid_and_all_of_them_and_gives_places_back() {
        let p = Arc::new(PerUid::default());
        let a: Vec<_> = (0..2).map(|_| p.take(1000, 2, 4).unwrap()).collect();
        assert_eq!(p.take(1000, 2, 4).unwrap_err(), Full::Uid);
        let root: Vec<_> = (0..2).map(|_| p.take(0, 2, 4).unwrap()).collect();
        assert_eq!(
            p.take(1001, 2, 4).unwrap_err(),
            Full::All,
            "root counts in all"
        );
        drop(root);
        let b = p.take(1001, 2, 4).unwrap();
        drop(a);
        let again: Vec<_> = (0..2).map(|_| p.take(1000, 2, 4).unwrap()).collect();
        let r = p.take(0, 2, 4).unwrap();
        assert_eq!(p.take(0, 2, 4).unwrap_err(), Full::All);
        drop((b, again, r));
        assert_eq!(p.held.lock().unwrap().all, 0);
        assert!(p.held.lock().unwrap().of.is_empty());
    }
}
