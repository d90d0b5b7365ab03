//! The write path: the chunk stream appends are copied into ([`Chunk`]), its cut into
//! numbered write jobs ([`State::cut`]), and the background writer that submits them
//! ([`writer_loop`], [`write_job`]), opens each new `.seg` file for direct I/O and
//! asks for the next preallocation step ahead of the writes ([`preallocate_ahead`]).
//!
//! # Invariants
//! 1. Jobs are numbered in the order they are cut and written at their own file
//!    positions; a chunk's `pos` is 4096-aligned and `clean <= fill <= buf.len()`.
//! 2. A job that rewrites the partial last block of the previous job (`overlaps`) is
//!    submitted only when no write is in flight, so the device never reorders two
//!    versions of one block; otherwise at most [`MAX_INFLIGHT`] writes are in flight.
//! 3. `done_seq` is the lowest job number not yet written; `written_offset` moves
//!    only past records whose jobs are all written, and the cache keeps every live
//!    record at or above it (a read hits memory or finds the record on disk).
//! 4. A failed write turns the shard read-only (`State::fail`); a written file is
//!    listed in `dirty_data` for the next sync's fdatasync.

use std::{
    path::{Path, PathBuf},
    rc::Rc,
};

use glommio::io::{DmaBuffer, DmaFile, OpenOptions};

use crate::{
    error::{gio, StoreError},
    fault::{FaultAction, FaultPoint},
    format::{align_up, FileKind, Offset, ALIGN},
    segment::prealloc_target,
    state::{Inner, State},
};

/// Size of one write buffer (a chunk of the segment stream), in bytes.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Size of the first write buffer of a segment (and of a reopened shard's), in bytes:
/// a shard that receives little (most of 1,000 queues) never holds more; one that fills
/// it moves on to [`CHUNK_BYTES`] buffers.
pub const FIRST_CHUNK_BYTES: usize = 64 << 10;
/// Most writes in flight per shard.
pub const MAX_INFLIGHT: usize = 4;
/// Written chunk buffers kept for reuse.
const POOL_CHUNKS: usize = 4;

/// The buffer receiving appended bytes for the active segment.
pub(crate) struct Chunk {
    pub seg_base: Offset,
    /// File position of `buf[0]` (aligned).
    pub pos: u64,
    pub buf: DmaBuffer,
    /// Bytes filled.
    pub fill: usize,
    /// Leading bytes already submitted in an earlier job.
    pub clean: usize,
    /// The first job of this chunk creates the `.seg` file.
    pub create: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum JobKind {
    Fill,
    SyncCut,
    RollCut,
}

pub(crate) struct Job {
    pub(crate) seq: u64,
    pub(crate) seg_base: Offset,
    pub(crate) pos: u64,
    pub(crate) buf: DmaBuffer,
    pub(crate) create: bool,
    pub(crate) overlaps: bool,
    pub(crate) kind: JobKind,
    pub(crate) tear: Option<usize>,
}

impl State {
    /// A [`CHUNK_BYTES`] write buffer, reused from the pool when one is there.
    pub(crate) fn alloc_chunk(&mut self) -> DmaBuffer {
        self.pool.pop().unwrap_or_else(|| self.alloc.alloc_dma_buffer(CHUNK_BYTES))
    }

    /// The write buffer a segment's stream starts with ([`FIRST_CHUNK_BYTES`]).
    pub(crate) fn alloc_first_chunk(&mut self) -> DmaBuffer {
        self.alloc.alloc_dma_buffer(FIRST_CHUNK_BYTES)
    }

    /// Copies `src` into the chunk stream, cutting full chunks into jobs.
    pub(crate) fn put(&mut self, mut src: &[u8]) {
        while !src.is_empty() {
            let c = self.chunk.as_mut().expect("active chunk");
            let cap = c.buf.len();
            let n = (cap - c.fill).min(src.len());
            c.buf.as_bytes_mut()[c.fill..c.fill + n].copy_from_slice(&src[..n]);
            c.fill += n;
            src = &src[n..];
            if c.fill == cap {
                self.cut(JobKind::Fill);
            }
        }
    }

    /// Turns the chunk's unsubmitted bytes into a job (zero-padded to a block).
    /// Returns false if there was nothing to write.
    ///
    /// A full chunk that was never partly submitted goes to the device as it is
    /// (no copy) and a pooled buffer takes its place. Anything else, a sync's
    /// partial cut or the rest of a chunk that was partly submitted before, is
    /// copied into a job buffer of its own size, from the block holding `clean`
    /// to the end of the data; the chunk keeps its buffer and carries on filling
    /// it (or starts over at its next position when full). A queue syncing a few
    /// records at a time thus writes a few blocks per sync without taking a
    /// fresh 1 MiB buffer each time (measured: fresh buffers' page faults were a
    /// quarter of the broker's CPU with 1,000 slow queues).
    pub(crate) fn cut(&mut self, kind: JobKind) -> bool {
        let Some(mut c) = self.chunk.take() else { return false };
        if c.fill == c.clean && !c.create {
            self.chunk = Some(c);
            return false;
        }
        let end = align_up(c.fill as u64) as usize;
        let from = c.clean / ALIGN * ALIGN;
        let (create, overlaps) = (c.create, c.clean % ALIGN != 0);
        let cap = c.buf.len();
        let full = c.fill == cap;
        let (buf, pos) = if from == 0 && full {
            (std::mem::replace(&mut c.buf, self.alloc_chunk()), c.pos)
        } else {
            let mut jb = self.alloc.alloc_dma_buffer(end - from);
            let b = jb.as_bytes_mut();
            b[..c.fill - from].copy_from_slice(&c.buf.as_bytes()[from..c.fill]);
            b[c.fill - from..].fill(0);
            if full && cap != CHUNK_BYTES {
                c.buf = self.alloc_chunk();
            }
            (jb, c.pos + from as u64)
        };
        let next = if full {
            Chunk { seg_base: c.seg_base, pos: c.pos + cap as u64, buf: c.buf, fill: 0, clean: 0, create: false }
        } else {
            Chunk { clean: c.fill, create: false, ..c }
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.jobs.push_back(Job { seq, seg_base: next.seg_base, pos, buf, create, overlaps, kind, tear: None });
        self.marks.push_back((seq, self.next_offset));
        self.chunk = Some(next);
        true
    }

    pub(crate) fn mark_done(&mut self, seq: u64) {
        self.done_set.insert(seq);
        while self.done_set.remove(&self.done_seq) {
            self.done_seq += 1;
        }
        while let Some(&(s, below)) = self.marks.front() {
            if s >= self.done_seq {
                break;
            }
            self.written_offset = self.written_offset.max(below);
            self.marks.pop_front();
        }
        self.cache.evict(self.cache_limit, self.written_offset);
    }
}

pub(crate) async fn writer_loop(inner: Rc<Inner>) {
    loop {
        let job = loop {
            let g = inner.work.gen();
            {
                let mut st = inner.st.borrow_mut();
                if st.stop {
                    return;
                }
                if let Some(j) = st.jobs.pop_front() {
                    break j;
                }
            }
            inner.work.wait(g).await;
        };
        loop {
            let g = inner.io_done.gen();
            {
                let st = inner.st.borrow();
                if st.stop {
                    return;
                }
                let max = if job.overlaps { 1 } else { MAX_INFLIGHT };
                if st.inflight < max {
                    break;
                }
            }
            inner.io_done.wait(g).await;
        }
        let path = inner.seg_file_path(job.seg_base, FileKind::Seg);
        let file = if job.create {
            if inner.crashed() {
                None
            } else {
                let opened = open_segment_for_dma(&inner, job.seg_base, &path).await;
                match opened {
                    Ok(f) => {
                        let f = Rc::new(f);
                        let mut st = inner.st.borrow_mut();
                        if let Some(si) = st.segs.iter().position(|s| s.base == job.seg_base) {
                            st.segs[si].file = Some(f.clone());
                        }
                        st.dir_dirty = true;
                        Some(f)
                    }
                    Err(e) => {
                        inner.st.borrow_mut().fail(e.to_string());
                        inner.io_done.notify();
                        continue;
                    }
                }
            }
        } else {
            let st = inner.st.borrow();
            st.segs.iter().find(|s| s.base == job.seg_base).and_then(|s| s.file.clone())
        };
        if let Some(f) = &file {
            preallocate_ahead(&inner, f, job.seg_base, job.pos + job.buf.len() as u64);
        }
        inner.st.borrow_mut().inflight += 1;
        glommio::spawn_local(write_job(inner.clone(), job, file, path)).detach();
    }
}

/// Opens the `.seg` file that `roll` created for direct I/O, in the descriptor slot its
/// placeholder frees. An open that fails (EMFILE: another thread took the slot) is tried
/// again for up to about a second before the shard gives up and turns read-only.
async fn open_segment_for_dma(inner: &Rc<Inner>, seg_base: Offset, path: &Path) -> Result<DmaFile, StoreError> {
    let mut last = None;
    for attempt in 0..50u32 {
        if attempt > 0 {
            glommio::timer::sleep(std::time::Duration::from_millis(20)).await;
        }
        if let Some(s) = inner.st.borrow_mut().segs.iter_mut().find(|s| s.base == seg_base) {
            s.placeholder = None;
        }
        if let Some(a) = inner.hit(FaultPoint::Open) {
            last = Some(StoreError::io("opening segment", path, a.error()));
            if !a.is_failure() {
                break;
            }
            continue;
        }
        match OpenOptions::new().read(true).write(true).create(true).dma_open(path).await {
            Ok(f) => return Ok(f),
            Err(e) => {
                let e = gio(e);
                let retry = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM));
                last = Some(StoreError::io("opening segment", path, e));
                if !retry {
                    break;
                }
            }
        }
    }
    Err(last.expect("at least one attempt"))
}

/// Asks for the next preallocation step of the segment being written, in the background,
/// once a write ending at `end` is past half of its allocated room: steady appends then
/// find the room allocated ([`Inner::make_room`] allocates synchronously only when they
/// outrun this). Preallocated space is unwritten extents (fallocate, size set): every
/// write is an overwrite that ext4 does inline from io_uring instead of punting it to a
/// worker thread, where writes to one file serialize; recovery reads the zero tail as the
/// end of the log.
fn preallocate_ahead(inner: &Rc<Inner>, f: &Rc<DmaFile>, seg_base: Offset, end: u64) {
    let room = match inner.st.borrow().segs.iter().rev().find(|s| s.base == seg_base) {
        // A segment with no record yet is one `prepare` made: its header page is all it
        // needs until a first append (`Inner::roll`).
        Some(s) if !s.full && s.count > 0 => s.seg_room,
        _ => return,
    };
    let limit = inner.cfg.segment_bytes;
    if inner.prealloc_busy.get() || room >= limit || end < room / 2 {
        return;
    }
    let target = prealloc_target(room, limit);
    inner.prealloc_busy.set(true);
    let (inner, f) = (inner.clone(), f.clone());
    glommio::spawn_local(async move {
        let ok = match inner.hit(FaultPoint::Allocate) {
            Some(a) => Err(a.error()),
            None => f.pre_allocate(target, false).await.map_err(gio),
        };
        inner.prealloc_busy.set(false);
        match ok {
            Ok(()) => {
                if let Some(s) = inner.st.borrow_mut().segs.iter_mut().rev().find(|s| s.base == seg_base) {
                    s.seg_room = s.seg_room.max(target);
                }
            }
            // Appends allocate what they need themselves; a full disk shows there.
            Err(e) => tracing::debug!(seg_base, error = %e, "background segment preallocation failed"),
        }
    })
    .detach();
}

async fn write_job(inner: Rc<Inner>, job: Job, file: Option<Rc<DmaFile>>, path: PathBuf) {
    let Job { seq, seg_base, pos, mut buf, kind, tear, .. } = job;
    let len = buf.len();
    let action = if tear.is_some() {
        None
    } else {
        match kind {
            JobKind::Fill => inner.hit(FaultPoint::Append),
            JobKind::SyncCut => inner.hit(FaultPoint::Sync),
            JobKind::RollCut => inner.crashed().then_some(FaultAction::Crash),
        }
    };
    let mut reuse = None;
    let tear = tear.or(match action {
        Some(FaultAction::Tear { keep_bytes }) => Some(keep_bytes),
        _ => None,
    });
    let res: Result<Rc<DmaFile>, StoreError> = match (file, action) {
        (None, _) if inner.crashed() => Err(inner.crash_error()),
        (None, _) => Err(StoreError::io("writing segment (file missing)", &path, std::io::ErrorKind::NotFound.into())),
        (Some(_), Some(FaultAction::Crash)) => Err(inner.crash_error()),
        (Some(_), Some(a)) if a.is_failure() => Err(StoreError::io("writing segment", &path, a.error())),
        (Some(f), _) if tear.is_some() => {
            let keep = (tear.unwrap() / 512 * 512).min(len);
            if keep > 0 {
                buf.trim_to_size(keep);
                let _ = f.write_rc_at(Rc::new(buf), pos).await;
            }
            Err(StoreError::Failed { dir: inner.dir.clone(), reason: "injected torn write".into() })
        }
        (Some(f), _) => {
            let rc = Rc::new(buf);
            let r = match f.write_rc_at(rc.clone(), pos).await {
                Ok(n) if n == len => Ok(f),
                Ok(n) => Err(StoreError::ShortWrite { path: path.clone(), pos, written: n, expected: len }),
                Err(e) => Err(StoreError::io("writing segment", &path, gio(e))),
            };
            if let Ok(b) = Rc::try_unwrap(rc) {
                if b.len() == CHUNK_BYTES {
                    reuse = Some(b);
                }
            }
            r
        }
    };
    {
        let mut st = inner.st.borrow_mut();
        if let Some(b) = reuse {
            if st.pool.len() < POOL_CHUNKS {
                st.pool.push(b);
            }
        }
        st.inflight -= 1;
        match res {
            Ok(f) => {
                if !st.dirty_data.iter().any(|(b, _)| *b == seg_base) {
                    st.dirty_data.push((seg_base, f));
                }
                st.mark_done(seq);
            }
            Err(e) => st.fail(e.to_string()),
        }
    }
    inner.io_done.notify();
}
