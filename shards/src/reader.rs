//! Batched reads from disk: the sequential [`Reader`], the run reads it is served
//! by ([`READ_WINDOW`] bytes of one segment at a time) and the dropping of a record
//! that fails its check.
//!
//! # Invariants
//! 1. Records not yet written are served from the cache; a run read stops at
//!    `written_offset`, and no `RefCell` borrow is held across its `.await`.
//! 2. A record that fails its CRC or framing check is logged and marked deleted
//!    (unless its bitmap page cannot be allocated): later reads skip it; its
//!    neighbours are untouched.

use std::{collections::VecDeque, path::PathBuf};

use bytes::Bytes;

use crate::{
    error::{gio, StoreError},
    format::{self, FileKind, Offset, Parse},
    side, Record, Shard,
};

/// Bytes read per disk access by the sequential [`Reader`].
pub const READ_WINDOW: u64 = 1 << 20;

impl Shard {
    pub(crate) fn drop_corrupt(&self, offset: Offset, path: PathBuf, reason: String) -> StoreError {
        tracing::error!(offset, path = %path.display(), %reason, "corrupt record dropped");
        if let Err(e) = self.inner.st.borrow_mut().delete_one(&self.inner.dir, offset, &mut 0) {
            tracing::warn!(offset, error = %e, "corrupt record not marked deleted");
        }
        StoreError::Corrupt { offset, path, reason }
    }

    /// Reads the live records of one segment from `from` on, up to about
    /// `max_bytes`, in one disk read. Returns them and the offset to continue at.
    async fn read_run(&self, from: Offset, max_bytes: u64) -> Result<(Vec<Record>, Offset), StoreError> {
        let inner = &*self.inner;
        let (file, start, end, first, last, seg_base) = {
            let st = inner.st.borrow();
            let Some(si) = st.seg_index(from) else { return Ok((Vec::new(), from + 1)) };
            let s = &st.segs[si];
            let i0 = from - s.base;
            let start = side::idx_get(&s.idx, i0);
            let limit = s.count.min(st.written_offset.saturating_sub(s.base));
            let mut j = i0 + 1;
            while j < limit && side::idx_get(&s.idx, j) - start < max_bytes {
                j += 1;
            }
            let end = if j < s.count { side::idx_get(&s.idx, j) } else { s.data_end };
            let Some(f) = s.file.clone() else { return Ok((Vec::new(), from + 1)) };
            (f, start, end, i0, j, s.base)
        };
        let path = inner.seg_file_path(seg_base, FileKind::Seg);
        let rr = file.read_at(start, (end - start) as usize).await.map_err(|e| StoreError::io("reading segment", &path, gio(e)))?;
        // One copy of the run; its records' headers and bodies are slices of it (no
        // allocation per record). A record kept alive keeps the run's buffer (at most
        // READ_WINDOW bytes) alive: readers hand records out for delivery, not for keeping.
        let rr = Bytes::copy_from_slice(&rr);
        let mut out = Vec::with_capacity((last - first) as usize);
        let mut corrupt = Vec::new();
        {
            let st = inner.st.borrow();
            let Some(si) = st.seg_index(seg_base) else { return Ok((out, seg_base + last)) };
            let s = &st.segs[si];
            for k in first..last {
                if side::bit_get(&s.del, k) {
                    continue;
                }
                let a = (side::idx_get(&s.idx, k) - start) as usize;
                let b = if k + 1 < s.count { side::idx_get(&s.idx, k + 1) } else { s.data_end };
                let b = (b - start) as usize;
                let o = seg_base + k;
                match rr.get(a..b).map(format::parse_record) {
                    Some(Parse::Record(r)) if r.offset == o && r.len == b - a => {
                        out.push(Record { offset: o, flags: r.flags, header: rr.slice_ref(r.header), body: rr.slice_ref(r.body) })
                    }
                    _ => corrupt.push(o),
                }
            }
        }
        for o in corrupt {
            let _ = self.drop_corrupt(o, path.clone(), "CRC or framing check failed during a sequential read".into());
        }
        Ok((out, seg_base + last))
    }
}

/// Sequential reader over live records (see [`Shard::reader`]). Records in the
/// memory cache are served from it; older ones are read from disk about
/// [`READ_WINDOW`] bytes at a time. A record that fails its CRC is logged,
/// dropped and skipped.
pub struct Reader<'a> {
    pub(crate) shard: &'a Shard,
    pub(crate) next: Offset,
    pub(crate) buf: VecDeque<Record>,
}

impl Reader<'_> {
    /// The next live record, or `None` at the end of the log.
    pub async fn next(&mut self) -> Result<Option<Record>, StoreError> {
        loop {
            if let Some(r) = self.next_buffered() {
                return Ok(Some(r));
            }
            let found = self.shard.inner.st.borrow().first_live_from(self.next);
            let Some(o) = found else { return Ok(None) };
            if let Some(r) = self.shard.read_cached(o) {
                self.next = o + 1;
                return Ok(Some(r));
            }
            let (recs, after) = self.shard.read_run(o, READ_WINDOW).await?;
            self.next = after.max(o + 1);
            self.buf.extend(recs);
        }
    }

    /// The next live record already read from disk with an earlier [`Reader::next`] (no
    /// I/O), or `None` when none is left: lets a caller that stops take the rest of the run
    /// it paid for.
    pub fn next_buffered(&mut self) -> Option<Record> {
        while let Some(r) = self.buf.pop_front() {
            if self.shard.is_live(r.offset) {
                return Some(r);
            }
        }
        None
    }
}
