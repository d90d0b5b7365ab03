//! Per-segment side files mapped with memmap2: the offset index (`.idx`) and the
//! deletion bitmap (`.del`).
//!
//! `.idx`: a 4096-byte header, then one `u32` file position per record.
//! Header: `magic[8] | version u32 | flags u32 | base u64 | capacity u64 | count u64 |
//! data_end u64 | entries_crc u32 | header_crc u32` (`header_crc` = CRC32 of bytes 0..52).
//! `flags`: bit 0 = sealed; bit 1 = bits 8..16 hold the AND of the flags byte of every
//! record in the segment (written with the seal; indexes sealed before it have bit 1
//! clear: unknown). A sealed index is trusted at open.
//!
//! `.del`: a 4096-byte header `magic[8] | version u32 | 0u32 | base u64 |
//! capacity u64 | header_crc u32` (CRC of bytes 0..32), then one bit per
//! record, bit `i % 8` of byte `i / 8`, 1 = deleted.

use std::{fs::OpenOptions, path::Path};

use memmap2::MmapMut;

use crate::format::{Offset, DEL_MAGIC, FORMAT_VERSION, IDX_MAGIC, SIDE_HEADER_BYTES};

const H: usize = SIDE_HEADER_BYTES;

/// Side files are sparse and touched a page at a time: without this, each page fault reads
/// ahead (for a hole: zero-fills) a large folio, which with a thousand queues cost the
/// broker most of its CPU (perf: kernel memset under filemap_fault).
fn no_readahead(m: &MmapMut) {
    let _ = m.advise(memmap2::Advice::Random);
}

/// Bytes of a side file of `capacity` records up to the end of the 4 KiB page holding the
/// entry of slot `slots - 1` (`.idx`: 4 bytes a record; `.del`: 1 bit), and never past the
/// file's end. Whole pages: a store into a mapped page makes the filesystem back the whole
/// page (with 1 KiB blocks, four of them), so every block of it must be allocated; past
/// the end would grow the file, and on a full disk fail for nothing.
pub(crate) fn bytes_for(idx: bool, slots: u64, capacity: u64) -> u64 {
    let end = |n: u64| H as u64 + if idx { n * 4 } else { n.div_ceil(8) };
    end(slots).div_ceil(4096).saturating_mul(4096).min(end(capacity))
}

/// Allocates the blocks of the side file at `path` (of `capacity` records) that hold the
/// pages of slots `from..to` (see [`crate::space`]): after it, touching those slots'
/// entries cannot SIGBUS.
///
/// Errors: the OS error of fallocate (ENOSPC when the disk is full).
pub(crate) fn reserve(path: &Path, idx: bool, from: u64, to: u64, capacity: u64) -> std::io::Result<()> {
    let a = bytes_for(idx, from, capacity) / 4096 * 4096;
    crate::space::allocate_path(path, a.min(bytes_for(idx, to, capacity)), bytes_for(idx, to, capacity))
}

/// Creates (or truncates) a side file of `capacity` records, with the pages of its header
/// and of its first `reserved` slots allocated on disk before anything is written
/// (fallocate: a full disk is an error here, never a SIGBUS later), and maps it.
pub(crate) fn create(path: &Path, idx: bool, base: Offset, capacity: u64, reserved: u64) -> std::io::Result<MmapMut> {
    let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
    let body = if idx { capacity * 4 } else { capacity.div_ceil(8) };
    f.set_len(H as u64 + body)?;
    crate::space::allocate(&f, 0, bytes_for(idx, reserved.min(capacity), capacity))?;
    // SAFETY: the file is private to this shard (one owner core); nobody truncates it while mapped.
    let mut m = unsafe { MmapMut::map_mut(&f)? };
    no_readahead(&m);
    m[0..8].copy_from_slice(if idx { IDX_MAGIC } else { DEL_MAGIC });
    m[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    m[16..24].copy_from_slice(&base.to_le_bytes());
    m[24..32].copy_from_slice(&capacity.to_le_bytes());
    if idx {
        let crc = crc32fast::hash(&m[0..52]);
        m[52..56].copy_from_slice(&crc.to_le_bytes());
    } else {
        let crc = crc32fast::hash(&m[0..32]);
        m[32..36].copy_from_slice(&crc.to_le_bytes());
    }
    Ok(m)
}

/// Maps an existing side file and checks its header; `Err(why)` if unusable.
pub(crate) fn open(path: &Path, idx: bool, base: Offset) -> Result<(MmapMut, u64), String> {
    let f = OpenOptions::new().read(true).write(true).open(path).map_err(|e| e.to_string())?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    if len < H as u64 {
        return Err(format!("{len} bytes, shorter than its header"));
    }
    // SAFETY: as in `create`.
    let m = unsafe { MmapMut::map_mut(&f).map_err(|e| e.to_string())? };
    no_readahead(&m);
    if &m[0..8] != (if idx { IDX_MAGIC } else { DEL_MAGIC }) {
        return Err("bad magic".into());
    }
    let (crc_at, crc_end) = if idx { (52, 52) } else { (32, 32) };
    let crc = u32::from_le_bytes(m[crc_at..crc_at + 4].try_into().unwrap());
    if crc != crc32fast::hash(&m[0..crc_end]) {
        return Err("header CRC mismatch".into());
    }
    let version = u32::from_le_bytes(m[8..12].try_into().unwrap());
    if version != FORMAT_VERSION {
        return Err(format!("unsupported version {version}"));
    }
    let b = u64::from_le_bytes(m[16..24].try_into().unwrap());
    if b != base {
        return Err(format!("header names base {b}, file name {base}"));
    }
    let capacity = u64::from_le_bytes(m[24..32].try_into().unwrap());
    let body = if idx { capacity * 4 } else { capacity.div_ceil(8) };
    if len < H as u64 + body {
        return Err(format!("{len} bytes, capacity {capacity} needs {}", H as u64 + body));
    }
    Ok((m, capacity))
}

/// Index entry `i` (file position of record `base + i`).
#[inline]
pub(crate) fn idx_get(m: &[u8], i: u64) -> u64 {
    let at = H + i as usize * 4;
    u32::from_le_bytes(m[at..at + 4].try_into().unwrap()) as u64
}

/// Sets index entry `i`.
#[inline]
pub(crate) fn idx_set(m: &mut [u8], i: u64, pos: u64) {
    let at = H + i as usize * 4;
    m[at..at + 4].copy_from_slice(&(pos as u32).to_le_bytes());
}

/// Sets index entry `i` only if it holds another value: recovery rewrites what it finds,
/// and on a full disk a store into a page that is not backed must not happen.
#[inline]
pub(crate) fn idx_put(m: &mut [u8], i: u64, pos: u64) {
    if idx_get(m, i) != pos {
        idx_set(m, i, pos);
    }
}

/// Entries from `from` on that list records past the data a recovery scan found: the
/// first must start at `data_end` (where the scan stopped), each later one past the one
/// before, all below `capacity`. These are records appended before a crash whose bytes are
/// not in the file (never written, or lost). Returns how many.
pub(crate) fn idx_listed_past(m: &[u8], from: u64, data_end: u64, capacity: u64) -> u64 {
    let mut k = from;
    let mut prev = None;
    while k < capacity {
        let pos = idx_get(m, k);
        let next = match prev {
            None => pos == data_end,
            Some(p) => pos > p,
        };
        if !next {
            break;
        }
        prev = Some(pos);
        k += 1;
    }
    k - from
}

/// Zeroes entries `from..from + n` (entries that hold a value: their pages are backed, so
/// the store cannot fault on a full disk).
pub(crate) fn idx_clear(m: &mut [u8], from: u64, n: u64) {
    for k in from..from + n {
        idx_put(m, k, 0);
    }
}

/// Seal of an index: `(count, data_end)` if the header says sealed and the CRC of
/// the entries matches.
pub(crate) fn idx_seal(m: &[u8]) -> Option<(u64, u64)> {
    let flags = u32::from_le_bytes(m[12..16].try_into().unwrap());
    if flags & IDX_SEALED == 0 {
        return None;
    }
    let count = u64::from_le_bytes(m[32..40].try_into().unwrap());
    let data_end = u64::from_le_bytes(m[40..48].try_into().unwrap());
    let capacity = u64::from_le_bytes(m[24..32].try_into().unwrap());
    if count > capacity {
        return None;
    }
    let crc = u32::from_le_bytes(m[48..52].try_into().unwrap());
    (crc == crc32fast::hash(&m[H..H + count as usize * 4])).then_some((count, data_end))
}

/// Index header flag: the index is sealed.
const IDX_SEALED: u32 = 1;
/// Index header flag: bits 8..16 hold the AND of every record's flags byte.
const IDX_FLAGS_ALL: u32 = 2;

/// The AND of the flags byte of every record of a sealed segment, if its seal says
/// (indexes sealed by a version before the summary: `None`).
pub(crate) fn idx_flags_all(m: &[u8]) -> Option<u8> {
    let flags = u32::from_le_bytes(m[12..16].try_into().unwrap());
    (flags & IDX_SEALED != 0 && flags & IDX_FLAGS_ALL != 0).then_some((flags >> 8) as u8)
}

/// Writes the seal (count, data end, entries CRC, and `flags_all`: the AND of the flags
/// byte of every record) into the index header.
pub(crate) fn idx_write_seal(m: &mut [u8], count: u64, data_end: u64, flags_all: u8) {
    let crc = crc32fast::hash(&m[H..H + count as usize * 4]);
    m[32..40].copy_from_slice(&count.to_le_bytes());
    m[40..48].copy_from_slice(&data_end.to_le_bytes());
    m[48..52].copy_from_slice(&crc.to_le_bytes());
    let flags = IDX_SEALED | IDX_FLAGS_ALL | (flags_all as u32) << 8;
    m[12..16].copy_from_slice(&flags.to_le_bytes());
    let hcrc = crc32fast::hash(&m[0..52]);
    m[52..56].copy_from_slice(&hcrc.to_le_bytes());
}

/// True if bit `i` (record `base + i`) is set (deleted).
#[inline]
pub(crate) fn bit_get(m: &[u8], i: u64) -> bool {
    m[H + (i >> 3) as usize] & (1 << (i & 7)) != 0
}

/// Sets bit `i`; returns true if it was clear.
#[inline]
pub(crate) fn bit_set(m: &mut [u8], i: u64) -> bool {
    let b = &mut m[H + (i >> 3) as usize];
    let mask = 1u8 << (i & 7);
    let was_clear = *b & mask == 0;
    *b |= mask;
    was_clear
}

/// Clears bits `from..capacity` (records that do not exist after a crash), writing only
/// bytes that are not already zero, and reading only the byte ranges of the file at
/// `path` that hold data (`crate::space::data_ranges`): holes are zeros, and touching
/// them would cost memory and, on a full disk, a SIGBUS.
pub(crate) fn bits_clear_from(m: &mut [u8], path: &Path, from: u64, capacity: u64) {
    let mut i = from;
    while i < capacity && !i.is_multiple_of(8) {
        let b = &mut m[H + (i >> 3) as usize];
        if *b & (1u8 << (i & 7)) != 0 {
            *b &= !(1u8 << (i & 7));
        }
        i += 1;
    }
    if i >= capacity {
        return;
    }
    let start = (H + (i >> 3) as usize) as u64;
    let end = (H + capacity.div_ceil(8) as usize) as u64;
    for (a, b) in crate::space::data_ranges(path, start, end) {
        for byte in &mut m[a as usize..b as usize] {
            if *byte != 0 {
                *byte = 0;
            }
        }
    }
}

/// Number of set bits among `0..count`.
pub(crate) fn bits_count(m: &[u8], count: u64) -> u64 {
    let full = (count / 8) as usize;
    let mut n: u64 = m[H..H + full].iter().map(|b| b.count_ones() as u64).sum();
    for i in (full as u64 * 8)..count {
        n += bit_get(m, i) as u64;
    }
    n
}

/// Index of the first clear bit in `from..count`, if any.
pub(crate) fn first_clear(m: &[u8], from: u64, count: u64) -> Option<u64> {
    let mut i = from;
    while i < count {
        if i.is_multiple_of(8) && i + 8 <= count && m[H + (i >> 3) as usize] == 0xff {
            i += 8;
            continue;
        }
        if !bit_get(m, i) {
            return Some(i);
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmap_and_index() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.del");
        let mut m = create(&p, false, 5, 100, 100).unwrap();
        assert!(bit_set(&mut m, 3));
        assert!(!bit_set(&mut m, 3));
        for i in 8..16 {
            bit_set(&mut m, i);
        }
        assert_eq!(bits_count(&m, 100), 9);
        assert_eq!(first_clear(&m, 8, 100), Some(16));
        bits_clear_from(&mut m, &p, 10, 100);
        assert_eq!(bits_count(&m, 100), 3);
        drop(m);
        let (m, cap) = open(&p, false, 5).unwrap();
        assert_eq!((cap, bits_count(&m, 100)), (100, 3));
        assert!(open(&p, false, 6).is_err());

        let q = dir.path().join("x.idx");
        let mut m = create(&q, true, 5, 10, 10).unwrap();
        idx_set(&mut m, 0, 4096);
        idx_set(&mut m, 1, 5000);
        assert_eq!(idx_seal(&m), None);
        assert_eq!(idx_flags_all(&m), None, "not sealed");
        idx_write_seal(&mut m, 2, 6000, 0x81);
        assert_eq!(idx_seal(&m), Some((2, 6000)));
        assert_eq!(idx_flags_all(&m), Some(0x81));
        drop(m);
        let (mut m, _) = open(&q, true, 5).unwrap();
        assert_eq!(idx_get(&m, 1), 5000);
        idx_set(&mut m, 1, 5001);
        assert_eq!(idx_seal(&m), None, "entry changed after seal: CRC must fail");
    }
}
