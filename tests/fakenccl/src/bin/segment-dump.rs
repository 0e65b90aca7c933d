//! Prints the records of ncclscope segments, one line each (for checking a real NCCL run by hand).
//!
//! `segment-dump [PREFIX]` dumps every segment under /dev/shm with that prefix (default "ncclscope")
//! without consuming anything.

use ncclscope_proto::Record;
use ncclscope_proto::segment::{self, Consumer, Counter, Segment};

fn main() -> anyhow::Result<()> {
    let prefix = std::env::args()
        .nth(1)
        .unwrap_or_else(|| segment::DEFAULT_PREFIX.to_string());
    let names = segment::list(&prefix)?;
    if names.is_empty() {
        anyhow::bail!("no segment named {prefix}.* under {}", segment::SHM_DIR);
    }
    for name in names {
        let seg = Segment::open(&name)?;
        let owner = seg.owner();
        println!(
            "segment {name}: pid {} uid {} host {} job {} capacity {} head {} closed {} alive {}",
            owner.pid,
            owner.uid,
            owner.hostname,
            owner.job_id,
            seg.capacity(),
            seg.head(),
            seg.is_closed(),
            segment::owner_alive(&name)
        );
        for c in Counter::ALL {
            println!("  counter {} = {}", c.name(), seg.counter(c));
        }
        let mut consumer = Consumer::new(seg);
        let mut out = Vec::new();
        while consumer.read(4096, &mut out)? > 0 {}
        for (pos, record) in out {
            match record {
                Ok(Record::Str { id, len, bytes }) => {
                    println!(
                        "  {pos}: Str {{ id: {}, text: {:?} }}",
                        id.0,
                        String::from_utf8_lossy(&bytes[..len as usize])
                    )
                }
                Ok(r) => println!("  {pos}: {r:?}"),
                Err(e) => println!("  {pos}: undecodable: {e}"),
            }
        }
    }
    Ok(())
}
