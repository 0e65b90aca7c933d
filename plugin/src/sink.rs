//! Where the plugin's background work puts records: the segment, through the forwarding thread.
//! A trait so the device-hook drain can be tested without a segment.

use ncclscope_proto::{Counter, Record, StrId};

pub trait Sink {
    /// Appends a record; a full segment drops it and counts [`Counter::RingFull`].
    fn push(&mut self, record: &Record);
    /// The id of `text`, sending its [`Record::Str`] first if it is new.
    fn intern(&mut self, text: &[u8]) -> StrId;
    /// Adds `n` to a loss counter in the segment header.
    fn count(&mut self, counter: Counter, n: u64);
}
