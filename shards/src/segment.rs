//! A segment: its files and counters ([`Segment`]), how many records it holds
//! ([`capacity_for`]), how the shard starts one ([`Inner::roll`]) and how room is made
//! in it for the next record ([`Inner::make_room`], [`prealloc_target`]).
//!
//! # Invariants
//! 1. Only the newest segment takes appends; a roll marks the one before it `full`.
//! 2. Index and bitmap entries are written through the mappings only below
//!    `reserved`, whose pages are allocated on disk (no store into a mapped hole:
//!    that would be a SIGBUS on a full disk).
//! 3. A record is accepted only if it ends within `seg_room`, the allocated part of
//!    the `.seg` file, so no write needs a new block.
//! 4. A roll that fails (full disk, open-files limit) removes the files it created
//!    and leaves the shard's state as it was: nothing appended, still writable.

use std::rc::Rc;

use glommio::io::DmaFile;
use memmap2::MmapMut;

use crate::{
    error::StoreError,
    fault::{FaultAction, FaultPoint},
    format::{self, align_up, FileKind, Offset, SEG_HEADER_BYTES},
    side,
    state::{Inner, State},
    writer::{Chunk, JobKind},
};

/// One segment: its files and counters.
pub(crate) struct Segment {
    /// Offset of its first record (also in its file names).
    pub base: Offset,
    /// Index/bitmap slots (records that fit).
    pub capacity: u64,
    /// Records in this segment, `base..base + count`.
    pub count: u64,
    /// Records not deleted.
    pub live: u64,
    /// Byte position after the last record in the `.seg` file.
    pub data_end: u64,
    /// `.idx` mapping: u32 file position per record.
    pub idx: MmapMut,
    /// `.del` mapping: deletion bitmap.
    pub del: MmapMut,
    /// The `.seg` file opened for direct I/O (None until the writer opens it).
    pub file: Option<Rc<DmaFile>>,
    /// The `.seg` file as `roll` created and preallocated it, held until the writer
    /// opens it for direct I/O: it keeps a descriptor for that open (one is closed
    /// right before the other is opened).
    pub placeholder: Option<std::fs::File>,
    /// Record slots whose `.idx` and `.del` pages are allocated on disk: entries below
    /// it may be written through the mappings (see `crate::space`).
    pub reserved: u64,
    /// Bytes of the `.seg` file that are allocated (preallocated or written):
    /// `append` accepts a record only if it ends within them (on a filesystem without
    /// fallocate, what was asked for is taken as allocated: see `space::allocate`).
    pub seg_room: u64,
    /// No more appends (a newer segment exists).
    pub full: bool,
    /// Index sealed on disk.
    pub sealed: bool,
    /// Bitmap changed since the last sync.
    pub del_dirty: bool,
    /// AND of the flags byte of every record in the segment (`0xff` while it has none),
    /// written into the index with its seal: recovery skips reading the flags of a sealed
    /// segment whose records all have the flags it keeps ([`crate::Shard::open_retaining`]).
    /// Known for every segment that can still be sealed (recovery scans those); a trusted
    /// sealed segment holds what its seal says, or 0.
    pub flags_all: u8,
}

impl Segment {
    pub(crate) fn end(&self) -> Offset {
        self.base + self.count
    }
}

/// Records a segment can hold for `segment_bytes` (each record is ≥ 24 bytes).
pub(crate) fn capacity_for(segment_bytes: u64) -> u64 {
    (segment_bytes.saturating_sub(SEG_HEADER_BYTES as u64) / format::RECORD_HEAD_BYTES as u64).max(1) + 1
}

impl Inner {
    /// Starts a new segment at `next_offset` (the previous one is cut and marked full),
    /// with room for a first record of `first_len` bytes: its side files and its `.seg`
    /// file are created and their first pages allocated here, so a full disk or the
    /// open-files limit is an error of this `append` (nothing appended, the shard stays
    /// writable), not of a later write.
    pub(crate) fn roll(&self, st: &mut State, first_len: u64) -> Result<(), StoreError> {
        let base = st.next_offset;
        let capacity = capacity_for(self.cfg.segment_bytes);
        let ip = self.seg_file_path(base, FileKind::Idx);
        let dp = self.seg_file_path(base, FileKind::Del);
        let sp = self.seg_file_path(base, FileKind::Seg);
        let reserved = crate::space::slot_step(0, 1, capacity);
        // A segment started with no record to come (`Shard::prepare` at a queue's declare,
        // `skip_to`) gets its header page only: an idle queue then takes ~40 KB of disk, not
        // the 2 MiB of a first step. The first append allocates that step (`make_room`).
        let seg_room = match first_len {
            0 => align_up(SEG_HEADER_BYTES as u64),
            _ => prealloc_target(align_up(SEG_HEADER_BYTES as u64 + first_len), self.cfg.segment_bytes),
        };
        let cleanup = || {
            for p in [&ip, &dp, &sp] {
                let _ = std::fs::remove_file(p);
            }
        };
        self.injected(FaultPoint::Open, "creating index", &ip)?;
        let idx = side::create(&ip, true, base, capacity, reserved).map_err(|e| {
            cleanup();
            StoreError::io("creating index", &ip, e)
        })?;
        let made = self
            .injected(FaultPoint::Open, "creating deletion bitmap", &dp)
            .and_then(|_| {
                side::create(&dp, false, base, capacity, reserved).map_err(|e| StoreError::io("creating deletion bitmap", &dp, e))
            })
            .and_then(|del| {
                self.injected(FaultPoint::Open, "creating segment", &sp)?;
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(&sp)
                    .map_err(|e| StoreError::io("creating segment", &sp, e))?;
                self.injected(FaultPoint::Allocate, "preallocating segment", &sp)?;
                crate::space::allocate(&f, 0, seg_room).map_err(|e| StoreError::io("preallocating segment", &sp, e))?;
                Ok((del, f))
            });
        let (del, placeholder) = match made {
            Ok(v) => v,
            Err(e) => {
                drop(idx);
                cleanup();
                return Err(e);
            }
        };
        match self.hit(FaultPoint::SegmentRoll) {
            None => {}
            Some(a) if a.is_failure() => {
                drop((idx, del, placeholder));
                cleanup();
                return Err(StoreError::io("creating segment", sp, a.error()));
            }
            Some(FaultAction::Tear { keep_bytes }) => {
                st.cut(JobKind::RollCut);
                match st.jobs.iter_mut().rev().find(|j| j.kind == JobKind::RollCut) {
                    Some(j) => j.tear = Some(keep_bytes),
                    None => {
                        st.fail("injected crash at segment roll".into());
                        return Err(self.crash_error());
                    }
                }
            }
            Some(_) => {
                st.fail("injected crash at segment roll".into());
                return Err(self.crash_error());
            }
        }
        st.cut(JobKind::RollCut);
        if let Some(old) = st.segs.back_mut() {
            old.full = true;
        }
        st.segs.push_back(Segment {
            base,
            capacity,
            count: 0,
            live: 0,
            data_end: SEG_HEADER_BYTES as u64,
            idx,
            del,
            file: None,
            placeholder: Some(placeholder),
            reserved,
            seg_room,
            full: false,
            sealed: false,
            del_dirty: false,
            flags_all: 0xff,
        });
        let mut buf = st.alloc_first_chunk();
        format::encode_seg_header(base, self.cfg.segment_bytes, buf.as_bytes_mut());
        st.chunk = Some(Chunk { seg_base: base, pos: 0, buf, fill: SEG_HEADER_BYTES, clean: 0, create: true });
        st.dir_dirty = true;
        Ok(())
    }

    /// Makes room in the active segment for a record ending at byte `end` (aligned) and
    /// in slot `slot`: allocates the next step of side-file pages and of the `.seg` file
    /// where they do not reach that far. The writer asks for the next `.seg` step in the
    /// background before it is needed (see `preallocate_ahead`), so this allocates
    /// synchronously only when appends outrun it.
    ///
    /// Errors: [`StoreError::DiskFull`] (or the I/O error) of the allocation; nothing is
    /// changed then, and the shard stays writable.
    pub(crate) fn make_room(&self, s: &mut Segment, slot: u64, end: u64) -> Result<(), StoreError> {
        if slot >= s.reserved {
            let to = crate::space::slot_step(s.reserved, slot + 1, s.capacity);
            for (kind, idx, op) in [(FileKind::Idx, true, "allocating index pages"), (FileKind::Del, false, "allocating bitmap pages")] {
                let p = self.seg_file_path(s.base, kind);
                self.injected(FaultPoint::Allocate, op, &p)?;
                side::reserve(&p, idx, s.reserved, to, s.capacity).map_err(|e| StoreError::io(op, &p, e))?;
            }
            s.reserved = to;
        }
        if end > s.seg_room {
            let p = self.seg_file_path(s.base, FileKind::Seg);
            self.injected(FaultPoint::Allocate, "preallocating segment", &p)?;
            let target = prealloc_target(end, self.cfg.segment_bytes);
            let r = crate::space::allocate_path(&p, 0, target).map(|_| target).or_else(|_| {
                // Not that much left: exactly what this record needs.
                crate::space::allocate_path(&p, 0, end).map(|_| end)
            });
            s.seg_room = r.map_err(|e| StoreError::io("preallocating segment", &p, e))?;
        }
        Ok(())
    }
}

/// Bytes a segment file is preallocated ahead of its writes: as much again as is written,
/// between 1 and 16 MiB, so a shard with little in it takes little disk (2 MiB), and a
/// busy one extends its file once per 16 MiB of writes.
pub(crate) fn prealloc_target(need: u64, segment_bytes: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    let step = need.clamp(MIB, 16 * MIB);
    (need + step).div_ceil(MIB).saturating_mul(MIB).min(segment_bytes).max(need)
}

#[cfg(test)]
mod prealloc_tests {
    use super::prealloc_target;
    const MIB: u64 = 1 << 20;

    #[test]
    fn grows_in_small_steps_and_stays_in_the_segment() {
        assert_eq!(prealloc_target(4096, 64 * MIB), 2 * MIB);
        assert_eq!(prealloc_target(3 * MIB, 64 * MIB), 6 * MIB);
        assert_eq!(prealloc_target(40 * MIB, 64 * MIB), 56 * MIB);
        assert_eq!(prealloc_target(63 * MIB, 64 * MIB), 64 * MIB);
        // a record larger than the segment: at least what is written
        assert_eq!(prealloc_target(100 * MIB, 64 * MIB), 100 * MIB);
    }
}
