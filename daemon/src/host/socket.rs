//! The Unix sockets the daemon listens on (plugin registration, query API).

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;

use anyhow::Context;
use tokio::net::UnixListener;

/// Binds `path` and gives it `mode`: creates its directory, replaces a stale socket file (one nobody
/// listens on), refuses to take over a live one or to delete anything that is not a socket. `what`
/// names the socket in errors.
pub fn bind(path: &Path, mode: u32, what: &str) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                anyhow::bail!("another daemon already serves {what} at {}", path.display());
            }
            std::fs::remove_file(path)
                .with_context(|| format!("removing stale socket {}", path.display()))?;
        }
        Ok(_) => anyhow::bail!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("checking {}", path.display())),
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", path.display()))?;
    Ok(listener)
}
