//! The registration socket: a plugin connects, writes `REGISTER <segment-name>\n`, and gets `OK\n` or
//! `ERR <reason>\n`. The peer's pid and uid come from SO_PEERCRED, never from what it says: a segment is
//! accepted only if its name, its shared-memory object's owner and its header all agree with the peer.

use std::path::Path;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use ncclscope_proto::segment::{Segment, SegmentError, SegmentName};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::oneshot;

use crate::engine::Attach;

/// Longest request line accepted.
const MAX_LINE: usize = 512;
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Binds the registration socket, mode 0666: every user's NCCL processes register.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    crate::socket::bind(path, 0o666, "plugin registration")
}

/// Accepts registrations until the task is dropped.
pub async fn serve(listener: UnixListener, prefix: String, engine: std_mpsc::Sender<Attach>) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept on the registration socket failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let prefix = prefix.clone();
        let engine = engine.clone();
        tokio::spawn(async move {
            if let Err(e) =
                tokio::time::timeout(IO_TIMEOUT * 3, handle(stream, &prefix, &engine)).await
            {
                tracing::debug!(error = %e, "registration timed out");
            }
        });
    }
}

async fn handle(stream: UnixStream, prefix: &str, engine: &std_mpsc::Sender<Attach>) {
    let cred = stream.peer_cred();
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read.take(MAX_LINE as u64));
    let read = tokio::time::timeout(IO_TIMEOUT, reader.read_line(&mut line)).await;
    if matches!(read, Ok(Ok(0))) {
        return; // connected and closed without a request: a liveness probe
    }
    let reply = match (cred, read) {
        (Ok(cred), Ok(Ok(_))) => match cred.pid() {
            Some(pid) => register(line.trim_end(), pid as u32, cred.uid(), prefix, engine).await,
            None => Err("peer pid unavailable".to_string()),
        },
        (Err(e), _) => Err(format!("no peer credentials: {e}")),
        (_, Ok(Err(e))) => Err(format!("read: {e}")),
        (_, Err(_)) => Err("timed out reading the request".into()),
    };
    let text = match &reply {
        Ok(()) => "OK\n".to_string(),
        Err(reason) => {
            tracing::warn!(request = %line.trim_end(), reason = %reason, "registration refused");
            format!("ERR {}\n", reason.replace('\n', " "))
        }
    };
    let _ = tokio::time::timeout(IO_TIMEOUT, write.write_all(text.as_bytes())).await;
}

/// The segment a request line (`REGISTER <segment-name>`, newline removed) names, if it is one of
/// this daemon's prefix. Untrusted input: any line gets a clear error.
pub fn parse_request(line: &str, prefix: &str) -> Result<SegmentName, String> {
    let name = line
        .strip_prefix("REGISTER ")
        .ok_or("expected `REGISTER <segment-name>`")?;
    let name = SegmentName::parse(name).ok_or_else(|| format!("{name:?} is not a segment name"))?;
    if name.prefix != prefix {
        return Err(format!(
            "prefix {:?} is not this daemon's ({prefix:?})",
            name.prefix
        ));
    }
    Ok(name)
}

async fn register(
    line: &str,
    pid: u32,
    uid: u32,
    prefix: &str,
    engine: &std_mpsc::Sender<Attach>,
) -> Result<(), String> {
    let name = parse_request(line, prefix)?;
    if name.pid != pid || name.uid != uid {
        return Err(format!(
            "segment names pid {} uid {}, peer is pid {pid} uid {uid}",
            name.pid, name.uid
        ));
    }
    let seg = Segment::open(&name).map_err(|e| match e {
        SegmentError::NotReady { .. } => "segment not initialised yet".to_string(),
        e => e.to_string(),
    })?;
    let owner = seg.owner();
    if seg.file_uid() != uid {
        return Err(format!(
            "shared memory object is owned by uid {}, peer is uid {uid}",
            seg.file_uid()
        ));
    }
    if owner.uid != uid || owner.pid != pid {
        return Err(format!(
            "segment header says pid {} uid {}, peer is pid {pid} uid {uid}",
            owner.pid, owner.uid
        ));
    }
    let (tx, rx) = oneshot::channel();
    engine
        .send(Attach {
            name,
            segment: seg,
            reply: tx,
        })
        .map_err(|_| "daemon is shutting down".to_string())?;
    rx.await
        .map_err(|_| "daemon is shutting down".to_string())?
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclscope_proto::segment::{Owner, process_start_ticks};

    async fn request(path: &Path, line: &str) -> String {
        let mut s = UnixStream::connect(path).await.unwrap();
        s.write_all(line.as_bytes()).await.unwrap();
        let mut reply = String::new();
        BufReader::new(s).read_line(&mut reply).await.unwrap();
        reply
    }

    #[tokio::test]
    async fn refuses_what_the_peer_does_not_own_and_hands_over_what_it_does() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("reg.sock");
        let prefix = format!("ncclscope-regtest-{}", std::process::id());
        let (tx, rx) = std_mpsc::channel::<Attach>();
        let engine = std::thread::spawn(move || {
            let a = rx.recv().unwrap();
            let name = a.name.clone();
            a.reply.send(Ok(())).unwrap();
            name
        });
        tokio::spawn(serve(bind(&path).unwrap(), prefix.clone(), tx));
        let pid = std::process::id();
        let uid = rustix::process::getuid().as_raw();
        let start_ticks = process_start_ticks(pid).unwrap();
        let owner = |pid| Owner {
            pid,
            uid,
            start_ticks,
            hostname: "h".into(),
            job_id: "j".into(),
        };
        // Another process's segment (by name and header): refused, whatever the caller claims.
        let theirs = SegmentName {
            prefix: prefix.clone(),
            uid,
            pid: pid + 1,
            start_ticks,
        };
        Segment::create(&theirs, &owner(pid + 1), 8).unwrap();
        let reply = request(&path, &format!("REGISTER {theirs}\n")).await;
        assert!(
            reply.starts_with("ERR ") && reply.contains(&format!("peer is pid {pid}")),
            "{reply}"
        );
        // Our name but a header that names someone else.
        let lying = SegmentName {
            prefix: prefix.clone(),
            uid,
            pid,
            start_ticks: start_ticks + 1,
        };
        Segment::create(&lying, &owner(pid + 1), 8).unwrap();
        let reply = request(&path, &format!("REGISTER {lying}\n")).await;
        assert!(reply.starts_with("ERR segment header says"), "{reply}");
        // Another daemon's prefix, garbage, a missing segment.
        let other = SegmentName {
            prefix: "someone-else".into(),
            uid,
            pid,
            start_ticks,
        };
        assert!(
            request(&path, &format!("REGISTER {other}\n"))
                .await
                .starts_with("ERR prefix")
        );
        assert!(request(&path, "HELLO\n").await.starts_with("ERR expected"));
        let missing = SegmentName {
            prefix: prefix.clone(),
            uid,
            pid,
            start_ticks: start_ticks + 2,
        };
        assert!(
            request(&path, &format!("REGISTER {missing}\n"))
                .await
                .starts_with("ERR ")
        );
        // Ours: handed to the engine, then OK.
        let ours = SegmentName {
            prefix: prefix.clone(),
            uid,
            pid,
            start_ticks,
        };
        Segment::create(&ours, &owner(pid), 8).unwrap();
        assert_eq!(request(&path, &format!("REGISTER {ours}\n")).await, "OK\n");
        assert_eq!(engine.join().unwrap(), ours);
        for n in [theirs, lying, ours] {
            Segment::unlink(&n).unwrap();
        }
        // A live daemon's socket is not taken over.
        assert!(bind(&path).is_err());
    }
}
