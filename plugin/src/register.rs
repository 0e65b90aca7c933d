//! Registration with the node daemon: one `REGISTER <segment-name>\n` line on its Unix socket, answered
//! by `OK\n` or `ERR <reason>\n`. Done from the forwarding thread only, with short timeouts, retried with
//! exponential backoff while no daemon listens. The daemon also finds segments by scanning /dev/shm, so
//! a failed registration delays discovery; it loses nothing.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::host;

const IO_TIMEOUT: Duration = Duration::from_millis(100);
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

pub struct Registration {
    socket: PathBuf,
    line: String,
    next_attempt: Option<Instant>,
    backoff: Duration,
}

/// What the daemon said, or why it could not be asked.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Accepted,
    Refused(String),
    Unreachable(String),
}

impl Registration {
    pub fn new(socket: PathBuf, segment_name: &str) -> Registration {
        Registration {
            socket,
            line: format!("REGISTER {segment_name}\n"),
            next_attempt: Some(Instant::now()),
            backoff: FIRST_BACKOFF,
        }
    }

    /// Tries to register if an attempt is due. Cheap when nothing is due.
    pub fn poll(&mut self, now: Instant) {
        let Some(at) = self.next_attempt else { return };
        if now < at {
            return;
        }
        match self.attempt() {
            Outcome::Accepted => {
                host::log(
                    false,
                    &format!("registered with the daemon at {}", self.socket.display()),
                );
                self.next_attempt = None;
            }
            outcome => {
                if let Outcome::Refused(reason) = &outcome {
                    host::log_once(
                        "register-refused",
                        true,
                        &format!("the daemon refused the segment: {reason}"),
                    );
                } else if let Outcome::Unreachable(why) = &outcome {
                    host::log_once(
                        "register-unreachable",
                        false,
                        &format!(
                            "no daemon at {} ({why}); retrying in the background",
                            self.socket.display()
                        ),
                    );
                }
                self.next_attempt = Some(now + self.backoff);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            }
        }
    }

    #[cfg(test)]
    fn registered(&self) -> bool {
        self.next_attempt.is_none()
    }

    fn attempt(&self) -> Outcome {
        let stream = match connect(&self.socket) {
            Ok(s) => s,
            Err(e) => return Outcome::Unreachable(e.to_string()),
        };
        let exchange = || -> std::io::Result<String> {
            stream.set_read_timeout(Some(IO_TIMEOUT))?;
            stream.set_write_timeout(Some(IO_TIMEOUT))?;
            (&stream).write_all(self.line.as_bytes())?;
            let mut reply = String::new();
            BufReader::new(&stream).take(256).read_line(&mut reply)?;
            Ok(reply)
        };
        match exchange() {
            Ok(reply) if reply.trim_end() == "OK" => Outcome::Accepted,
            Ok(reply) if reply.starts_with("ERR") => Outcome::Refused(reply.trim_end().to_string()),
            Ok(reply) => Outcome::Unreachable(format!("unexpected reply {reply:?}")),
            Err(e) => Outcome::Unreachable(e.to_string()),
        }
    }
}

/// Connects without blocking: a daemon whose backlog is full counts as unreachable for now.
fn connect(path: &std::path::Path) -> std::io::Result<UnixStream> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::connect(&fd, &SocketAddrUnix::new(path)?)?;
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn registers_once_the_daemon_answers_and_backs_off_while_it_does_not() {
        let dir = std::env::temp_dir().join(format!("ncclscope-reg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.sock");
        let _ = std::fs::remove_file(&path);
        let mut reg = Registration::new(path.clone(), "ncclscope.1.2.3");
        let t0 = Instant::now();
        reg.poll(t0);
        assert!(!reg.registered());
        assert_eq!(reg.next_attempt, Some(t0 + FIRST_BACKOFF));
        reg.poll(t0 + Duration::from_millis(150));
        assert_eq!(reg.backoff, FIRST_BACKOFF * 4);

        let listener = UnixListener::bind(&path).unwrap();
        let daemon = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line).unwrap();
            s.write_all(b"OK\n").unwrap();
            line
        });
        reg.poll(t0 + Duration::from_secs(1));
        assert!(reg.registered());
        assert_eq!(daemon.join().unwrap(), "REGISTER ncclscope.1.2.3\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_silent_daemon_times_out() {
        let dir = std::env::temp_dir().join(format!("ncclscope-reg-silent-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        let reg = Registration::new(path, "x.1.2.3");
        let t = Instant::now();
        assert!(matches!(reg.attempt(), Outcome::Unreachable(_)));
        assert!(t.elapsed() < Duration::from_secs(5));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
