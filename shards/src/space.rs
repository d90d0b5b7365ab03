//! Disk space and descriptors, taken before they are used.
//!
//! A shard never writes where no disk block is allocated:
//! - a `.seg` file is preallocated (fallocate) ahead of the records `append`
//!   accepts, so its direct-I/O writes are overwrites of allocated blocks;
//! - the pages of the memory-mapped `.idx`/`.del` files are allocated in steps of
//!   record slots before a slot is touched ([`slot_step`]): a store into a mapped
//!   hole on a full filesystem is a SIGBUS, an `fallocate` that fails is an error
//!   value (`StoreError::DiskFull`) the caller can answer with a nack.
//!
//! Recovery writes into a mapped file only bytes that differ from what is there,
//! so opening a shard on a full disk needs no new blocks.
//!
//! Descriptors: a shard keeps one open file per segment (its `.seg`, for reads and
//! writes). Side files are mapped and their descriptors closed at once; a `.del`
//! or `.idx` is opened only for the fdatasync that needs it; the direct-I/O
//! buffer allocator is one file per thread ([`thread_allocator`]).

use std::{cell::RefCell, fs::OpenOptions, io, os::fd::AsRawFd, path::Path, rc::Rc};

use glommio::io::DmaFile;

/// Fewest record slots whose side-file pages one allocation step takes.
pub(crate) const SLOT_STEP_MIN: u64 = 1024;
/// Most record slots one allocation step adds (256 KiB of index, 8 KiB of bitmap).
pub(crate) const SLOT_STEP_MAX: u64 = 64 * 1024;

/// Slots to reserve when `need` slots must be backed and `reserved` are: doubling from
/// [`SLOT_STEP_MIN`] by at most [`SLOT_STEP_MAX`] at a time, never past `capacity`.
pub(crate) fn slot_step(reserved: u64, need: u64, capacity: u64) -> u64 {
    let step = reserved.clamp(SLOT_STEP_MIN, SLOT_STEP_MAX);
    (reserved + step).max(need).min(capacity)
}

/// Allocates disk blocks for bytes `[from, to)` of the open file `f` (fallocate mode 0;
/// the size grows to `to` if it was smaller). Allocated ranges cost no new blocks, so
/// this is also how an open on a full disk checks that the pages it will touch are
/// backed.
///
/// A filesystem without fallocate (EOPNOTSUPP) is taken as it is: `Ok`, and its pages
/// are backed when first written, as without this call.
///
/// Errors: the OS error (ENOSPC, EDQUOT, EIO…).
pub(crate) fn allocate(f: &impl AsRawFd, from: u64, to: u64) -> io::Result<()> {
    if to <= from {
        return Ok(());
    }
    for _ in 0..100 {
        // SAFETY: plain syscall on a descriptor the caller owns.
        let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, from as libc::off_t, (to - from) as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EOPNOTSUPP) => return Ok(()),
            _ => return Err(e),
        }
    }
    Err(io::Error::from_raw_os_error(libc::EINTR))
}

/// [`allocate`] on the file at `path` (opened for the call and closed after it).
pub(crate) fn allocate_path(path: &Path, from: u64, to: u64) -> io::Result<()> {
    if to <= from {
        return Ok(());
    }
    let f = OpenOptions::new().write(true).open(path)?;
    allocate(&f, from, to)
}

/// The ranges of `[from, to)` of the file at `path` that hold data (SEEK_DATA /
/// SEEK_HOLE); holes read as zeros without being touched. Falls back to the whole
/// range where the filesystem cannot say.
pub(crate) fn data_ranges(path: &Path, from: u64, to: u64) -> Vec<(u64, u64)> {
    let whole = vec![(from, to)];
    let Ok(f) = std::fs::File::open(path) else { return whole };
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut at = from;
    for _ in 0..1_000_000 {
        if at >= to {
            break;
        }
        // SAFETY: lseek on a descriptor we own.
        let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            return match io::Error::last_os_error().raw_os_error() {
                Some(libc::ENXIO) => out, // no data after `at`
                _ => whole,
            };
        }
        let data = data as u64;
        if data >= to {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
        if hole < 0 {
            return whole;
        }
        let end = (hole as u64).min(to);
        out.push((data, end));
        at = end.max(data + 1);
    }
    out
}

thread_local! {
    static ALLOCATOR: RefCell<Option<Rc<DmaFile>>> = const { RefCell::new(None) };
}

/// The file this thread's shards allocate direct-I/O buffers through (glommio hands out
/// buffers per executor, whatever file asks): the first `format` file opened on the
/// thread, kept open; `candidate` is closed by the caller when it is not taken.
pub(crate) fn thread_allocator(candidate: DmaFile) -> (Rc<DmaFile>, Option<DmaFile>) {
    ALLOCATOR.with(|a| {
        let mut a = a.borrow_mut();
        match &*a {
            Some(f) => (f.clone(), Some(candidate)),
            None => {
                let f = Rc::new(candidate);
                *a = Some(f.clone());
                (f, None)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_steps_double_and_stay_in_capacity() {
        assert_eq!(slot_step(0, 1, 1_000_000), SLOT_STEP_MIN);
        assert_eq!(slot_step(1024, 1025, 1_000_000), 2048);
        assert_eq!(slot_step(4096, 4097, 1_000_000), 8192);
        assert_eq!(slot_step(200_000, 200_001, 1_000_000), 200_000 + SLOT_STEP_MAX);
        assert_eq!(slot_step(999_000, 999_001, 1_000_000), 1_000_000);
        assert_eq!(slot_step(0, 5000, 1_000_000), 5000);
        assert_eq!(slot_step(0, 10, 3), 3);
    }

    #[test]
    fn allocate_backs_a_sparse_range_and_data_ranges_sees_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(1 << 20).unwrap();
        assert!(data_ranges(&p, 0, 1 << 20).iter().all(|&(a, b)| a >= b) || data_ranges(&p, 0, 1 << 20).is_empty());
        use std::os::unix::fs::FileExt;
        f.write_at(&[1u8; 4096], 8192).unwrap();
        f.sync_all().unwrap();
        let r = data_ranges(&p, 0, 1 << 20);
        assert!(r.iter().any(|&(a, b)| a <= 8192 && b >= 8192 + 4096), "{r:?}");
        allocate(&f, 0, 65536).unwrap();
        allocate_path(&p, 65536, 131072).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20);
    }
}
