//! The hash map of the ingest path. Its keys are ids, hashes and positions the daemon reads from a
//! process's records, looked up for every record: foldhash is several times cheaper than the
//! standard SipHash there, and its random seed per map still keeps a process from choosing keys that
//! collide.

pub type Map<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
