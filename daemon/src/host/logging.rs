//! The daemon's log output. Colour only for a terminal (and never with `NO_COLOR`), JSON lines for log
//! shippers, and the journal's native protocol when stderr is the journal (systemd sets
//! `JOURNAL_STREAM`): each line then carries its PRIORITY and the event's fields (`F_PID`, `F_UID`, ...)
//! instead of arriving as undifferentiated text.

use std::io::IsTerminal;
use std::os::fd::AsFd;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// `--log-format` / `NCCLSCOPE_LOG_FORMAT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `journald` when stderr is the journal, else `text`.
    Auto,
    /// Human-readable lines on stderr, coloured only on a terminal without `NO_COLOR`.
    Text,
    /// One JSON object per line on stderr (timestamp, level, target, fields).
    Json,
    /// The journal's native protocol (/run/systemd/journal/socket).
    Journald,
}

/// Installs the global subscriber; the level filter comes from `NCCLSCOPE_LOG` (default `info`).
pub fn init(format: LogFormat) {
    let filter = || EnvFilter::try_from_env("NCCLSCOPE_LOG").unwrap_or_else(|_| "info".into());
    let format = match format {
        LogFormat::Auto if stderr_is_journal(std::env::var("JOURNAL_STREAM").ok().as_deref()) => {
            LogFormat::Journald
        }
        LogFormat::Auto => LogFormat::Text,
        f => f,
    };
    let journald = match format {
        LogFormat::Journald => Some(tracing_journald::layer().map(|l| {
            l.with_syslog_identifier("ncclscope".into())
                .with_priority_mappings(syslog_priorities())
        })),
        _ => None,
    };
    match journald {
        Some(Ok(layer)) => tracing_subscriber::registry()
            .with(filter())
            .with(layer)
            .init(),
        Some(Err(e)) => {
            init_text(filter());
            tracing::warn!(error = %e, "journald is not reachable: logging text to stderr");
        }
        None if format == LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .init(),
        None => init_text(filter()),
    }
}

fn init_text(filter: EnvFilter) {
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR").as_deref(),
        ))
        .with_writer(std::io::stderr)
        .init();
}

/// https://no-color.org: any non-empty `NO_COLOR` turns colour off.
fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// systemd sets `JOURNAL_STREAM=<dev>:<inode>` for a service whose stderr it connects to the journal;
/// a child that inherited the variable but not the descriptor must not take it for its own.
fn stderr_is_journal(journal_stream: Option<&str>) -> bool {
    let Some((dev, ino)) = journal_stream.and_then(|v| v.split_once(':')) else {
        return false;
    };
    let Ok(st) = rustix::fs::fstat(std::io::stderr().as_fd()) else {
        return false;
    };
    dev.parse() == Ok(st.st_dev) && ino.parse() == Ok(st.st_ino)
}

/// syslog's own meaning of the levels (tracing-journald maps info to notice by default): info is 6,
/// so `journalctl -p info` shows the daemon's info lines and `-p notice` only its warnings and errors.
fn syslog_priorities() -> tracing_journald::PriorityMappings {
    use tracing_journald::Priority;
    tracing_journald::PriorityMappings {
        error: Priority::Error,
        warn: Priority::Warning,
        info: Priority::Informational,
        debug: Priority::Debug,
        trace: Priority::Debug,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".as_ref())));
        assert!(!colour(true, Some("1".as_ref())));
        assert!(!colour(false, None));
    }

    #[test]
    fn journal_stream_must_name_this_stderr() {
        let st = rustix::fs::fstat(std::io::stderr().as_fd()).unwrap();
        assert!(stderr_is_journal(Some(&format!(
            "{}:{}",
            st.st_dev, st.st_ino
        ))));
        assert!(!stderr_is_journal(Some(&format!(
            "{}:{}",
            st.st_dev,
            st.st_ino + 1
        ))));
        assert!(!stderr_is_journal(None));
        assert!(!stderr_is_journal(Some("garbage")));
    }
}
