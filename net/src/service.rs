//! What a long-running service needs from its process, the same for the agent and the
//! aggregator: one process per state folder ([`StateLock`]), paths in a config file that mean
//! the same wherever the service starts ([`resolve_path`]), a stop that a second signal forces
//! ([`stop_signal`]), and output to a closed pipe that ends a command quietly ([`print_out`]).

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// Why a state folder could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds the folder.
    #[error(
        "{folder} is in use by another {what} (pid {holder}): one process per state folder; stop that one first"
    )]
    InUse {
        /// The state folder.
        folder: PathBuf,
        /// The service kind, as its user knows it (`unifed-agent`, `unifed-aggregator`).
        what: String,
        /// The process id the holder wrote into the lock file (`?` if unreadable).
        holder: String,
    },
    /// The folder or its lock file cannot be made or locked.
    #[error("cannot lock {path}: {source}")]
    Io {
        /// The lock file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// An exclusive hold on a service's state folder for as long as it lives: a second agent or
/// aggregator on the same folder is refused at start instead of knocking the first off the
/// broker or deleting its files. The hold is an advisory `flock` on `<folder>/lock`, released by
/// the kernel when the process ends however it ends; the file keeps the holder's pid, for the
/// message.
#[derive(Debug)]
pub struct StateLock {
    _file: File,
    path: PathBuf,
}

impl StateLock {
    /// The name of the lock file inside a state folder.
    pub const FILE: &'static str = "lock";

    /// Creates `folder` if needed and takes it for this process; `what` names the service in
    /// the refusal.
    pub fn acquire(folder: &Path, what: &str) -> Result<StateLock, LockError> {
        let path = folder.join(Self::FILE);
        let io = |source| LockError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(folder).map_err(io)?;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = match holder.trim() {
                    "" => "?".to_string(),
                    h => h.to_string(),
                };
                return Err(LockError::InUse {
                    folder: folder.into(),
                    what: what.into(),
                    holder,
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
        }
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        Ok(StateLock { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// `path` as a config file at `config` means it: a relative path is relative to the config
/// file's folder, not to wherever the service was started; an absolute path, and one that starts
/// with an environment variable (`$CREDENTIALS_DIRECTORY/...`, expanded where it is read), are
/// kept as they are.
pub fn resolve_path(config: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() || path.as_os_str().to_string_lossy().starts_with('$') {
        return path.to_path_buf();
    }
    let base = config.parent().unwrap_or(Path::new(""));
    if base.as_os_str().is_empty() {
        path.to_path_buf()
    } else {
        base.join(path)
    }
}

/// [`resolve_path`] on an optional path, in place.
pub fn resolve_opt(config: &Path, path: &mut Option<PathBuf>) {
    if let Some(p) = path {
        *p = resolve_path(config, p);
    }
}

/// Resolves when the process is asked to stop: SIGINT (Ctrl-C), SIGTERM (systemd, `kill`) or
/// SIGHUP (the terminal went away). A stop finishes quickly but not instantly (the service says
/// goodbye to the broker and keeps its last checkpoint), so from then on a second request ends
/// the process at once (exit status 130), and `what` says so on stderr. The signals are watched
/// from the start, so a second request right after the first is not missed.
pub async fn stop_signal(what: &'static str) {
    let mut signals = match Signals::new() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot watch for SIGTERM and SIGHUP ({e}); Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    signals.recv().await;
    eprintln!("{what}: stopping; ask again (Ctrl-C) to stop at once");
    tokio::spawn(async move {
        signals.recv().await;
        eprintln!("{what}: stopping now, on a second request");
        std::process::exit(130);
    });
}

/// The stop signals, each a stream from the moment this is made.
struct Signals {
    #[cfg(unix)]
    streams: [tokio::signal::unix::Signal; 3],
}

impl Signals {
    fn new() -> std::io::Result<Signals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Signals {
                streams: [
                    signal(SignalKind::interrupt())?,
                    signal(SignalKind::terminate())?,
                    signal(SignalKind::hangup())?,
                ],
            })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    /// The next stop request.
    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            let [int, term, hup] = &mut self.streams;
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
                _ = hup.recv() => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Writes `text` and a newline to stdout. A closed pipe (`... | head -1`) is not a failure of
/// the command: it returns `Ok` and the command ends quietly, where `println!` would panic.
pub fn print_out(text: impl std::fmt::Display) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_hold_on_a_state_folder_is_refused_and_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("site");
        let first = StateLock::acquire(&folder, "unifed-agent").unwrap();
        assert!(folder.is_dir(), "the folder is made");
        let err = StateLock::acquire(&folder, "unifed-agent").unwrap_err();
        match &err {
            LockError::InUse { holder, what, .. } => {
                assert_eq!(holder, &std::process::id().to_string());
                assert_eq!(what, "unifed-agent");
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("in use by another unifed-agent"));
        drop(first);
        // Released with its holder: the next process takes it (and writes its pid once).
        let again = StateLock::acquire(&folder, "unifed-agent").unwrap();
        let text = std::fs::read_to_string(again.path()).unwrap();
        assert_eq!(text, format!("{}\n", std::process::id()));
    }

    #[test]
    fn config_paths_are_relative_to_the_config_file() {
        let cfg = Path::new("/etc/unifed/agent.toml");
        assert_eq!(
            resolve_path(cfg, Path::new("keys/site.key")),
            Path::new("/etc/unifed/keys/site.key")
        );
        assert_eq!(
            resolve_path(cfg, Path::new("/var/lib/unifed")),
            Path::new("/var/lib/unifed")
        );
        assert_eq!(
            resolve_path(cfg, Path::new("$CREDENTIALS_DIRECTORY/identity.key")),
            Path::new("$CREDENTIALS_DIRECTORY/identity.key")
        );
        assert_eq!(
            resolve_path(Path::new("agent.toml"), Path::new("run/grey")),
            Path::new("run/grey")
        );
        assert_eq!(
            resolve_path(Path::new("site/agent.toml"), Path::new("../data")),
            Path::new("site/../data")
        );
        let mut none = None;
        resolve_opt(cfg, &mut none);
        assert_eq!(none, None);
    }
}
