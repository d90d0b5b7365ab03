//! `StoreError`: every way a shard operation can fail, each with the path and
//! the figures a reader needs to act on it.

use std::{io, path::PathBuf};

use crate::format::Offset;

/// Errors of the segment store. Messages name the file and the operation.
///
/// After an I/O error on a write or a sync the shard turns read-only
/// ([`StoreError::Failed`] from `append`/`sync`): reads and deletes of the
/// records it holds keep working, and reopening it recovers every synced record.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An operating-system error on `path` while doing `op`.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done ("writing segment", "fdatasync", …).
        op: &'static str,
        /// File or directory concerned.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The filesystem returned ENOSPC (or EDQUOT: the user's quota is used up).
    #[error("disk full while {op} {}: {free_bytes} bytes free on that filesystem", path.display())]
    DiskFull {
        /// What was being done.
        op: &'static str,
        /// File concerned.
        path: PathBuf,
        /// Free bytes reported by statvfs right after the failure (0 if unknown).
        free_bytes: u64,
    },
    /// The kernel accepted fewer bytes than asked.
    #[error("short write to {} at byte {pos}: {written} of {expected} bytes written", path.display())]
    ShortWrite {
        /// Segment file.
        path: PathBuf,
        /// File position of the write, in bytes.
        pos: u64,
        /// Bytes written.
        written: usize,
        /// Bytes asked.
        expected: usize,
    },
    /// `append` with a header or body over the limits.
    #[error("record too large: header {header_bytes} bytes (max {max_header}), body {body_bytes} bytes (max {max_body})")]
    RecordTooLarge {
        /// Header size, in bytes.
        header_bytes: usize,
        /// Body size, in bytes.
        body_bytes: usize,
        /// Header limit, in bytes.
        max_header: usize,
        /// Body limit, in bytes.
        max_body: usize,
    },
    /// A stored record failed its CRC or framing check when read. The record is
    /// dropped (marked deleted) so the caller can log and skip it.
    #[error("corrupt record at offset {offset} in {}: {reason}; record dropped", path.display())]
    Corrupt {
        /// Offset of the record.
        offset: Offset,
        /// Segment file.
        path: PathBuf,
        /// What check failed.
        reason: String,
    },
    /// A file this shard needs is not in a format this build reads.
    #[error("{}: {reason}", path.display())]
    Format {
        /// File concerned.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Invalid `ShardConfig`.
    #[error("invalid shard config: {0}")]
    Config(String),
    /// The shard stopped accepting writes after an earlier error; reopen it.
    #[error("shard {} is read-only after an earlier error ({reason}); reopen it to recover the synced records", dir.display())]
    Failed {
        /// Shard directory.
        dir: PathBuf,
        /// The first error.
        reason: String,
    },
    /// The shard was closed.
    #[error("shard {} is closed", dir.display())]
    Closed {
        /// Shard directory.
        dir: PathBuf,
    },
}

impl StoreError {
    /// Wraps an I/O error, turning ENOSPC into [`StoreError::DiskFull`].
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> StoreError {
        let path = path.into();
        if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) || source.kind() == io::ErrorKind::StorageFull {
            let free_bytes = path.parent().and_then(|p| crate::free_disk_bytes(p).ok()).unwrap_or(0);
            return StoreError::DiskFull { op, path, free_bytes };
        }
        StoreError::Io { op, path, source }
    }

    /// True for [`StoreError::DiskFull`].
    pub fn is_disk_full(&self) -> bool {
        matches!(self, StoreError::DiskFull { .. })
    }

    /// True when the process or the system is out of file descriptors (EMFILE, ENFILE).
    pub fn is_out_of_files(&self) -> bool {
        matches!(self, StoreError::Io { source, .. } if matches!(source.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)))
    }

    /// True when a resource ran out (disk space, quota, file descriptors) rather than
    /// something being broken: the operation may succeed once the resource is back. An
    /// `append`, a delete or an open that failed this way changed nothing and the shard is
    /// still usable; a `sync` that failed this way (a write or fdatasync) has turned the
    /// shard read-only all the same (see `Shard::failure`).
    pub fn is_resource(&self) -> bool {
        self.is_disk_full() || self.is_out_of_files()
    }
}

/// Turns a glommio error into the `io::Error` it carries (keeping the OS error code).
pub(crate) fn gio<T>(e: glommio::GlommioError<T>) -> io::Error {
    match e {
        glommio::GlommioError::IoError(e) => e,
        glommio::GlommioError::EnhancedIoError { source, .. } => source,
        other => io::Error::other(other.to_string()),
    }
}
