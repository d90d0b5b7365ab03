//! # ringmq-shards: the segment store behind every queue
//!
//! A *shard* is an append-only log of records owned by exactly one glommio
//! executor (core). It knows nothing of AMQP: a record is an offset, a flags
//! byte and two opaque byte strings, `header` (the broker puts exchange,
//! routing key and properties there) and `body`.
//! Requirements: ringmq issue 3; design: DESIGN.md, section Storage.
//!
//! # Layout
//! - `format.rs`: on-disk framing (pure functions, unit-tested).
//! - `side.rs`: the memory-mapped `.idx` (offset index) and `.del` (deletion bitmap) files.
//! - `shard.rs`: [`Shard`]: the public API (open, append, sync, reads, deletes, close).
//! - `state.rs`: the shard's shared state (`State`, `Inner`): lookups, failure, delete bookkeeping.
//! - `segment.rs`: a segment's files and counters, the roll that starts one, room and preallocation.
//! - `writer.rs`: the chunk stream, write jobs and the background writer.
//! - `commit.rs`: group-commit sync (fdatasync), sealing and removal of segments.
//! - `reader.rs`: the sequential [`Reader`] and batched disk reads.
//! - `recover.rs`: open and crash recovery.
//! - `cache.rs`: the memory cache of recent records.
//! - `fault.rs`: fault injection at named points (crash tests; ENOSPC/EMFILE).
//! - `space.rs`: disk blocks and descriptors taken before use.
//!
//! # On-disk format (version 1)
//! A shard directory holds:
//! - `format`: 4096 bytes, the line `ringmq-shard format 1\n` then zeros. It is
//!   written (with std::fs, fsync'ed) before any direct-I/O file is opened, and is
//!   the first file opened with direct I/O: see *IOPOLL trap* below.
//! - per segment, named by its base offset as 20 decimal digits:
//!   - `<base>.seg`: record data, written with direct I/O (O_DIRECT through
//!     io_uring), every write 4096-byte aligned in position and length.
//!     Bytes 0..4096: header `magic "RMQSEG\0\x01" | version u32 = 1 |
//!     header_len u32 = 4096 | base u64 | segment_bytes u64 | crc32 u32 of bytes
//!     0..32`, zeros. From byte 4096: records back to back, then zeros up to the
//!     next 4096 boundary. A record (all integers little-endian):
//!
//!     | bytes | field |
//!     |---|---|
//!     | 0..4   | `len` u32: framed length in bytes, ≥ 24 (0 = end of data) |
//!     | 4..8   | `crc` u32: CRC32 (IEEE, crc32fast) of bytes 8..len |
//!     | 8..16  | `offset` u64 |
//!     | 16     | `flags` u8 |
//!     | 17     | `kind` u8 = 1 (data record) |
//!     | 18..20 | reserved, 0 |
//!     | 20..24 | `header_len` u32 |
//!     | 24..   | header bytes, then body bytes (`len - 24 - header_len`) |
//!
//!     A segment takes records until the next one would pass `segment_bytes`
//!     (default 64 MiB); a single record larger than that gets a segment of its own.
//!     The file is created and preallocated (fallocate) by the roll that starts
//!     the segment, then ahead of the writes, 1 to 16 MiB at a time up to
//!     `segment_bytes` (so an idle shard takes little disk); `append` accepts a
//!     record only if it ends within the allocated room, so a write never needs
//!     a new block. Its tail after the records reads as zeros; direct-I/O writes into it are
//!     overwrites that ext4 does inline from io_uring (extending writes are
//!     punted to worker threads, where writes to one file serialize). Once a
//!     full segment is sealed, its file is cut to the 4096 boundary after its
//!     last record.
//!   - `<base>.idx`: 4096-byte header (`magic "RMQIDX\0\x01" | version | flags
//!     (bit 0 sealed; bit 1: bits 8..16 hold the AND of every record's flags byte,
//!     written with the seal) | base | capacity | count | data_end | entries_crc |
//!     header_crc`), then one u32 file position per record. Memory-mapped.
//!     Sealed (with `count`, `data_end` and a CRC of the entries) and fdatasync'ed
//!     once the segment is full and durable: at open a sealed index is trusted
//!     and its segment is not scanned.
//!   - `<base>.del`: 4096-byte header, then the deletion bitmap, one bit per
//!     record (bit `i % 8` of byte `i / 8`, 1 = deleted). Memory-mapped;
//!     fdatasync'ed by the next `sync` after a change.
//!
//! The side files are sized for `capacity = (segment_bytes - 4096) / 24 + 2`
//! records and are sparse, but no page is touched before its blocks are
//! allocated (fallocate, in steps of 1,024 doubling to 65,536 record slots): a
//! store into a mapped hole on a full disk would be a SIGBUS.
//!
//! # Resources (see `space.rs`)
//! A full disk or the open-files limit is an error value: an `append` that
//! cannot get its blocks returns [`StoreError::DiskFull`], one that cannot
//! create the next segment's files an EMFILE [`StoreError::Io`]
//! ([`StoreError::is_resource`] for both); nothing is appended and the shard
//! stays writable. A failed write or fdatasync turns the shard read-only
//! ([`Shard::failure`]). A shard holds one descriptor per segment file; side
//! files are mapped and their descriptors closed, a `.del`/`.idx` is opened
//! only for the fdatasync that needs it, and one `format` file per thread is
//! the direct-I/O buffer allocator. Recovery needs no new blocks.
//!
//! # Memory per record
//! - A record in the cache: its header and body (the body `Bytes` is shared
//!   with the caller, not copied) plus ~96 bytes. The cache keeps the newest
//!   records up to `cache_bytes`, and always every record not yet written.
//! - A record not in the cache: **no heap memory**. 4 bytes of index and 1 bit
//!   of bitmap in memory-mapped files (page cache, reclaimable), i.e. about
//!   4.1 bytes per record, plus ~250 bytes of heap per segment.
//!
//! # Durability and group commit
//! `append` copies the framed record into a direct-I/O buffer (64 KiB at the
//! start of a segment, then 1 MiB; and the index entry into the mapped index);
//! full buffers are written in the background (up to 4 writes in flight, a
//! buffer never partly written goes as it is). `sync` copies the blocks it has
//! not yet written (padded to 4096; the partial last block is rewritten by the
//! next write, which is ordered after it) into a write of their size, waits for
//! all writes, then fdatasyncs the touched segment files and the changed
//! deletion bitmaps concurrently, and returns a [`Synced`] token;
//! `sync_appends` leaves the bitmaps out. Concurrent `sync` calls coalesce into
//! as few rounds as possible (a caller waiting for a round in progress has its
//! records written meanwhile). Records covered by a `Synced` survive kill -9 and
//! power loss; later records may or may not. Deletes are durable after the next
//! full `sync`; a delete lost in a crash brings the record back (a duplicate,
//! never a loss). `prepare` creates a new shard's first segment ahead of use.
//!
//! # Recovery
//! Segments with a sealed index are trusted (with
//! [`ShardConfig::verify_on_open`], every live record's CRC is checked as well,
//! and a corrupt one is reported and dropped without touching its neighbours).
//! Other segments are scanned record by record (CRC, expected offset); the
//! index is rebuilt. The scan stops at a zero length field; the rest of the
//! file must then be zeros (the preallocated tail: the end of the log, not
//! damage). A torn or corrupt tail of the last segment (a bad record, or any
//! non-zero byte after the last good one) is truncated, zero-padded, reported
//! and fdatasync'ed; the last segment is preallocated again. Every dropped range is in the
//! [`RecoveryReport`] and the log; recovery never panics on bad data. Bitmap
//! bits above the recovered end are cleared, so an offset reused after a crash
//! is never born deleted.
//!
//! Offsets of records that were appended but lost in a crash (not covered by a
//! `Synced`) are handed out again after recovery.
//!
//! [`Shard::open_retaining`] also deletes every live record whose flags byte lacks the
//! bits it keeps (the broker: transient messages at a restart), read during the scan of
//! unsealed segments and from the record heads of sealed ones whose seal's flags summary
//! does not rule them out; the deletes are synced before it returns.
//!
//! # The IOPOLL trap
//! glommio probes polled I/O on the first direct-I/O file opened on a device
//! (per thread) with a read at byte 0; on an empty file that probe succeeds
//! wrongly and later reads fail with EOPNOTSUPP (os error 95) on devices
//! without poll queues. `open` therefore writes the non-empty `format` file
//! with std::fs and opens it with direct I/O before any segment.
//!
//! # Invariants
//! See `shard.rs` (and each module's own). In short: dense offsets; one owner executor; no `RefCell`
//! borrow across an `.await`; a `Synced(n)` is only made after the data and
//! bitmaps below `n` are fdatasync'ed.
//!
//! # Assumptions
//! - The shard directory is used by one `Shard` at a time.
//! - `open`/`destroy` and segment rolls do a few small blocking file-system
//!   calls (mkdir, create/mmap of side files, unlink); the data path does not.
//! - glommio executors need the default memlock limit (8 MiB).

mod cache;
mod commit;
mod error;
mod event;
pub mod fault;
pub mod format;
mod reader;
mod recover;
mod segment;
mod shard;
mod side;
mod space;
mod state;
mod writer;

use std::path::Path;

use cache::Cache;

pub use error::StoreError;
pub use fault::{FaultAction, FaultPoint, Faults};
pub use format::Offset;
pub use reader::{Reader, READ_WINDOW};
pub use shard::{Shard, MAX_PENDING_CHUNKS};
pub use writer::{CHUNK_BYTES, MAX_INFLIGHT};

/// Shard settings.
#[derive(Clone, Debug)]
pub struct ShardConfig {
    /// Bytes per segment file before a new one starts (default 64 MiB;
    /// 64 KiB ..= 1 GiB).
    pub segment_bytes: u64,
    /// Bytes of recent records kept in memory (default 64 MiB). Records not
    /// yet written to disk are always kept, whatever this says.
    pub cache_bytes: usize,
    /// At open, read every sealed segment and check each live record's CRC
    /// (default false: sealed segments are trusted and checked when read).
    pub verify_on_open: bool,
}

impl Default for ShardConfig {
    fn default() -> Self {
        ShardConfig { segment_bytes: 64 << 20, cache_bytes: 64 << 20, verify_on_open: false }
    }
}

impl ShardConfig {
    fn validate(&self) -> Result<(), StoreError> {
        if !(64 << 10..=1 << 30).contains(&self.segment_bytes) {
            return Err(StoreError::Config(format!("segment_bytes {} out of range 65536..=1073741824", self.segment_bytes)));
        }
        Ok(())
    }
}

/// A stored record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Its offset in the shard.
    pub offset: Offset,
    /// Flags byte, opaque to the store (the broker: persistent, redelivered…).
    pub flags: u8,
    /// Opaque header bytes (≤ 1 MiB).
    pub header: bytes::Bytes,
    /// Opaque body bytes (≤ 128 MiB).
    pub body: bytes::Bytes,
}

/// Proof that every record below [`Synced::upto`] is durable. Only
/// [`Shard::sync`] makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Synced(Offset);

impl Synced {
    /// The next offset at sync time: records `< upto()` are durable.
    pub fn upto(&self) -> Offset {
        self.0
    }
}

/// What `Shard::open` found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Live records recovered.
    pub records: u64,
    /// Records recovered as deleted (bit set in the deletion bitmap).
    pub deleted: u64,
    /// Live records deleted by this open because their flags lacked what
    /// [`Shard::open_retaining`] keeps (not in `records` nor `deleted`; 0 for [`Shard::open`]).
    pub discarded: u64,
    /// Offset ranges `[from, to)` dropped as damage, with the reason. For a torn
    /// tail the range runs to the last record the segment's index listed, or is
    /// `[first lost, first lost + 1)` when the index lists none past the damage.
    /// A file cut short (a segment's length is always a multiple of 4096 bytes
    /// unless something else cut it) is damage even when the cut falls between
    /// two records.
    pub dropped: Vec<(Offset, Offset, String)>,
    /// Repairs that lost no record but may bring back deleted ones (e.g. an
    /// unreadable deletion bitmap), or rewrote a header; and records appended
    /// before a crash that are not in the file (zeros where the index or the next
    /// segment's base says they were: never synced, or lost by the disk), named
    /// once by offset range.
    pub warnings: Vec<String>,
}

/// Creates directory `dir` and its missing parents, then fsyncs the parent of each one it
/// created, top down: a new directory's entry is durable only once its parent is synced.
/// ext4 and XFS commit it sooner in practice, POSIX does not promise it, and a power loss
/// that follows POSIX (`lazyfs/`) otherwise takes the directory and everything under it,
/// fsynced files included. A directory that exists already costs one `stat` (one created by
/// a process that crashed before its fsync is left to the kernel's writeback).
///
/// # Errors
/// The first failed `mkdir`, open or fsync.
pub fn create_dir_all_durable(dir: &Path) -> std::io::Result<()> {
    let mut missing = Vec::new();
    let mut next = Some(dir);
    while let Some(d) = next.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        missing.push(d);
        next = d.parent();
    }
    if missing.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    for d in missing.iter().rev() {
        let parent = d.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// Bytes available to unprivileged writers on the filesystem holding `path`
/// (statvfs `f_bavail * f_frsize`). The broker blocks publishers below a margin.
pub fn free_disk_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `s` a valid out-pointer.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut s) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
}
