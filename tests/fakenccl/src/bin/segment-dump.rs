//! Prints the records of ncclscope segments, one line each (for checking a real NCCL run by hand).
//!
//! `segment-dump SOCKET [N [DIR]]` listens on SOCKET in the daemon's place (point the ranks'
//! `NCCLSCOPE_SOCKET` at it), takes the segments of N processes (default 1), and dumps each one once
//! its process has ended (its connection closed), without consuming anything. With DIR, each
//! segment's bytes are saved there as `<job>.<i>.seg` instead (test data, see tests/data).
//! `segment-dump --read FILE...` dumps segments saved so.

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixListener;

use ncclscope_fakenccl::process::{receive_segment, saved_segment};
use ncclscope_proto::Record;
use ncclscope_proto::segment::{Consumer, Counter, Segment};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(socket) = args.next() else {
        anyhow::bail!("usage: segment-dump SOCKET [N [DIR]] | segment-dump --read FILE...");
    };
    if socket == "--read" {
        for (i, path) in args.enumerate() {
            println!("file {path}");
            dump(i, saved_segment(&std::fs::read(&path)?)?)?;
        }
        return Ok(());
    }
    let n: usize = args.next().map_or(Ok(1), |a| a.parse())?;
    let save = args.next().map(std::path::PathBuf::from);
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket)?;
    let mut held = Vec::new();
    for _ in 0..n {
        let (mut conn, _) = listener.accept()?;
        let fd = receive_segment(&conn)?;
        let file = std::fs::File::from(fd.try_clone()?);
        let seg = Segment::open(fd)?;
        conn.write_all(b"OK\n")?;
        held.push((seg, file, conn));
    }
    for (i, (seg, file, mut conn)) in held.into_iter().enumerate() {
        // The plugin never writes after its registration: this returns when the process has ended.
        let _ = conn.read(&mut [0u8; 16]);
        if let Some(dir) = &save {
            let mut bytes = vec![0u8; file.metadata()?.len() as usize];
            file.read_exact_at(&mut bytes, 0)?;
            let path = dir.join(format!("{}.{i}.seg", seg.claims().job_id));
            std::fs::write(&path, bytes)?;
            println!(
                "segment {i}: saved {} (head {})",
                path.display(),
                seg.head()
            );
            continue;
        }
        dump(i, seg)?;
    }
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

/// Prints a segment's header, counters and every record it holds.
fn dump(i: usize, seg: Segment) -> anyhow::Result<()> {
    let claims = seg.claims();
    println!(
        "segment {i}: inode {} uid {} host {} job {} capacity {} head {} closed {}",
        seg.inode(),
        seg.file_uid(),
        claims.hostname,
        claims.job_id,
        seg.capacity(),
        seg.head(),
        seg.is_closed(),
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
    Ok(())
}
