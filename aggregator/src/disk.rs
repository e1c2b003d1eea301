//! What every file of the aggregator's data directory shares: its format version, the errors
//! that name a file, and the atomic, durable write.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Format version of every file in the data directory: 2 added the checksums.
pub const FORMAT_VERSION: u32 = 2;

/// Errors of the data directory, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An OS error on a file.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// A file that is not what it should be.
    #[error("{path}: {message}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Bytes free for this process on the file system of `path`.
pub fn free_bytes(path: &Path) -> Result<u64, StoreError> {
    let st = rustix::fs::statvfs(path).map_err(|e| io(path, e))?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

pub(crate) fn io(path: &Path, e: impl ToString) -> StoreError {
    StoreError::Io {
        path: path.into(),
        message: e.to_string(),
    }
}

pub(crate) fn corrupt(path: &Path, m: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        path: path.into(),
        message: m.into(),
    }
}

/// Writes `bytes` to `path` atomically and durably.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = File::create(&tmp).map_err(|e| io(&tmp, e))?;
        f.write_all(bytes).map_err(|e| io(&tmp, e))?;
        f.sync_all().map_err(|e| io(&tmp, e))?;
    }
    commit(&tmp, path)
}

/// Puts the synced temporary file `tmp` in place as `path` and syncs their folder.
pub(crate) fn commit(tmp: &Path, path: &Path) -> Result<(), StoreError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::rename(tmp, path).map_err(|e| io(path, e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, e))
}
