//! `Shard`: the append/sync/read/delete API and the background writer.
//!
//! # Invariants
//! 1. Offsets are handed out densely by `append`; a record's bytes go to the
//!    active segment's stream at `data_end`, its index entry is written at once.
//! 2. Write jobs are numbered; a job that rewrites the partial last block of the
//!    previous job (`overlaps`) is submitted only when no write is in flight, so
//!    the device never reorders two versions of one block.
//! 3. `sync` returns `Synced(n)` only after every job cut so far is written and
//!    every file written since the previous sync is fdatasync'ed: all records
//!    `< n` are durable. Deletion bitmaps dirtied before the cut are fdatasync'ed
//!    in the same sync.
//! 4. The cache never evicts a record whose bytes are not yet written, so a read
//!    either hits memory or finds the record on disk.
//! 5. A segment is sealed (its index trusted at open) only after its data is
//!    durable, and removed only when it is full, fully deleted and durable.
//!
//! # Assumptions
//! Single-threaded: one executor owns the shard; no `RefCell` borrow is held
//! across an `.await`.

use std::{
    cell::RefCell,
    collections::{BTreeSet, VecDeque},
    path::{Path, PathBuf},
    rc::Rc,
};

use bytes::Bytes;
use glommio::{
    io::{BufferedFile, DmaBuffer, DmaFile, OpenOptions},
    sync::Semaphore,
    Task,
};
use memmap2::MmapMut;

use crate::{
    error::{gio, StoreError},
    event::Event,
    fault::{FaultAction, FaultPoint, Faults},
    format::{self, align_up, FileKind, Offset, Parse, ALIGN, MAX_BODY_BYTES, MAX_HEADER_BYTES, SEG_HEADER_BYTES},
    side, Cache, Record, RecoveryReport, ShardConfig, Synced,
};

/// Size of one write buffer (a chunk of the segment stream), in bytes.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Size of the first write buffer of a segment (and of a reopened shard's), in bytes:
/// a shard that receives little (most of 1,000 queues) never holds more; one that fills
/// it moves on to [`CHUNK_BYTES`] buffers.
pub const FIRST_CHUNK_BYTES: usize = 64 << 10;
/// Most writes in flight per shard.
pub const MAX_INFLIGHT: usize = 4;
/// `throttle` waits while more chunks than this are cut but not yet written.
pub const MAX_PENDING_CHUNKS: u64 = 16;
/// Written chunk buffers kept for reuse.
const POOL_CHUNKS: usize = 4;
/// Bytes read per disk access by the sequential [`Reader`].
pub const READ_WINDOW: u64 = 1 << 20;

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
}

impl Segment {
    fn end(&self) -> Offset {
        self.base + self.count
    }
}

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
enum JobKind {
    Fill,
    SyncCut,
    RollCut,
}

struct Job {
    seq: u64,
    seg_base: Offset,
    pos: u64,
    buf: DmaBuffer,
    create: bool,
    overlaps: bool,
    kind: JobKind,
    tear: Option<usize>,
}

pub(crate) struct State {
    pub next_offset: Offset,
    pub live: u64,
    pub segs: VecDeque<Segment>,
    pub chunk: Option<Chunk>,
    jobs: VecDeque<Job>,
    next_seq: u64,
    done_seq: u64,
    done_set: BTreeSet<u64>,
    inflight: usize,
    marks: VecDeque<(u64, Offset)>,
    pub written_offset: Offset,
    pub durable_offset: Offset,
    del_epoch: u64,
    del_durable_epoch: u64,
    pub cache: Cache,
    cache_limit: usize,
    failed: Option<String>,
    closed: bool,
    stop: bool,
    dirty_data: Vec<(Offset, Rc<DmaFile>)>,
    pub dir_dirty: bool,
    start_hint: Offset,
    alloc: Rc<DmaFile>,
    /// Written full-size chunk buffers, reused (saves page faults of fresh memory).
    pool: Vec<DmaBuffer>,
}

pub(crate) struct Inner {
    pub st: RefCell<State>,
    /// A background preallocation step runs (see `preallocate_ahead`).
    prealloc_busy: std::cell::Cell<bool>,
    work: Event,
    io_done: Event,
    sync_lock: Semaphore,
    pub dir: PathBuf,
    pub cfg: ShardConfig,
    pub faults: Option<Faults>,
}

/// A queue shard: an append-only log of records in segment files, owned by one
/// glommio executor (`!Send`). See the crate doc for the format and guarantees.
pub struct Shard {
    inner: Rc<Inner>,
    writer: RefCell<Option<Task<()>>>,
}

/// Records a segment can hold for `segment_bytes` (each record is ≥ 24 bytes).
pub(crate) fn capacity_for(segment_bytes: u64) -> u64 {
    (segment_bytes.saturating_sub(SEG_HEADER_BYTES as u64) / format::RECORD_HEAD_BYTES as u64).max(1) + 1
}

impl State {
    pub(crate) fn new(next_offset: Offset, segs: VecDeque<Segment>, cache_limit: usize, alloc: Rc<DmaFile>) -> State {
        let live = segs.iter().map(|s| s.live).sum();
        let start_hint = segs.front().map(|s| s.base).unwrap_or(next_offset);
        State {
            next_offset,
            live,
            segs,
            chunk: None,
            jobs: VecDeque::new(),
            next_seq: 0,
            done_seq: 0,
            done_set: BTreeSet::new(),
            inflight: 0,
            marks: VecDeque::new(),
            written_offset: next_offset,
            durable_offset: next_offset,
            del_epoch: 0,
            del_durable_epoch: 0,
            cache: Cache::starting_at(next_offset),
            cache_limit,
            failed: None,
            closed: false,
            stop: false,
            dirty_data: Vec::new(),
            dir_dirty: false,
            start_hint,
            alloc,
            pool: Vec::new(),
        }
    }

    /// A [`CHUNK_BYTES`] write buffer, reused from the pool when one is there.
    pub(crate) fn alloc_chunk(&mut self) -> DmaBuffer {
        self.pool.pop().unwrap_or_else(|| self.alloc.alloc_dma_buffer(CHUNK_BYTES))
    }

    /// The write buffer a segment's stream starts with ([`FIRST_CHUNK_BYTES`]).
    pub(crate) fn alloc_first_chunk(&mut self) -> DmaBuffer {
        self.alloc.alloc_dma_buffer(FIRST_CHUNK_BYTES)
    }

    /// Index in `segs` of the segment holding `o`.
    fn seg_index(&self, o: Offset) -> Option<usize> {
        let n = self.segs.len();
        let last = self.segs.back()?;
        if o >= last.base {
            return (o < last.end()).then_some(n - 1);
        }
        let i = self.segs.partition_point(|s| s.base <= o);
        if i == 0 {
            return None;
        }
        (o < self.segs[i - 1].end()).then_some(i - 1)
    }

    fn check_writable(&self, dir: &Path) -> Result<(), StoreError> {
        if self.closed {
            return Err(StoreError::Closed { dir: dir.to_path_buf() });
        }
        if let Some(r) = &self.failed {
            return Err(StoreError::Failed { dir: dir.to_path_buf(), reason: r.clone() });
        }
        Ok(())
    }

    fn fail(&mut self, reason: String) {
        if self.failed.is_none() {
            tracing::error!(%reason, "shard turns read-only");
            self.failed = Some(reason);
        }
        self.jobs.clear();
    }

    /// Copies `src` into the chunk stream, cutting full chunks into jobs.
    fn put(&mut self, mut src: &[u8]) {
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
    fn cut(&mut self, kind: JobKind) -> bool {
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

    fn mark_done(&mut self, seq: u64) {
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

    fn is_live(&self, o: Offset) -> bool {
        match self.seg_index(o) {
            Some(si) => {
                let s = &self.segs[si];
                !side::bit_get(&s.del, o - s.base)
            }
            None => false,
        }
    }

    /// Lowest live offset `>= from`.
    fn first_live_from(&self, from: Offset) -> Option<Offset> {
        let start = self.segs.partition_point(|s| s.end() <= from);
        for s in self.segs.iter().skip(start) {
            if s.live == 0 {
                continue;
            }
            let i = from.saturating_sub(s.base);
            if let Some(k) = side::first_clear(&s.del, i, s.count) {
                return Some(s.base + k);
            }
        }
        None
    }

    /// Marks `o` deleted; `Ok(true)` if it was live. A slot whose bitmap page is not known
    /// to be allocated (a segment written by an older version, opened on a full disk) gets
    /// it allocated first; if that fails the record stays live (a duplicate after a
    /// restart, never a SIGBUS) and the allocation's error is returned.
    fn delete_one(&mut self, dir: &Path, o: Offset, hint: &mut usize) -> Result<bool, StoreError> {
        let si = match self.segs.get(*hint) {
            Some(s) if s.base <= o && o < s.end() => *hint,
            _ => match self.seg_index(o) {
                Some(i) => {
                    *hint = i;
                    i
                }
                None => return Ok(false),
            },
        };
        let s = &mut self.segs[si];
        let i = o - s.base;
        if i >= s.reserved {
            let p = format::seg_path(dir, s.base, FileKind::Del);
            side::reserve(&p, false, s.reserved, s.count, s.capacity).map_err(|e| StoreError::io("allocating bitmap pages", &p, e))?;
            s.reserved = s.reserved.max(s.count);
        }
        if !side::bit_set(&mut s.del, i) {
            return Ok(false);
        }
        s.live -= 1;
        s.del_dirty = true;
        self.live -= 1;
        self.cache.remove(o);
        Ok(true)
    }
}

impl Inner {
    fn seg_file_path(&self, base: Offset, kind: FileKind) -> PathBuf {
        format::seg_path(&self.dir, base, kind)
    }

    fn hit(&self, point: FaultPoint) -> Option<FaultAction> {
        self.faults.as_ref().and_then(|f| f.hit(point))
    }

    fn crashed(&self) -> bool {
        self.faults.as_ref().is_some_and(|f| f.crashed())
    }

    fn crash_error(&self) -> StoreError {
        StoreError::Failed { dir: self.dir.clone(), reason: "injected crash".into() }
    }

    /// Starts a new segment at `next_offset` (the previous one is cut and marked full),
    /// with room for a first record of `first_len` bytes: its side files and its `.seg`
    /// file are created and their first pages allocated here, so a full disk or the
    /// open-files limit is an error of this `append` (nothing appended, the shard stays
    /// writable), not of a later write.
    fn roll(&self, st: &mut State, first_len: u64) -> Result<(), StoreError> {
        let base = st.next_offset;
        let capacity = capacity_for(self.cfg.segment_bytes);
        let ip = self.seg_file_path(base, FileKind::Idx);
        let dp = self.seg_file_path(base, FileKind::Del);
        let sp = self.seg_file_path(base, FileKind::Seg);
        let reserved = crate::space::slot_step(0, 1, capacity);
        let seg_room = prealloc_target(align_up(SEG_HEADER_BYTES as u64 + first_len), self.cfg.segment_bytes);
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
        });
        let mut buf = st.alloc_first_chunk();
        format::encode_seg_header(base, self.cfg.segment_bytes, buf.as_bytes_mut());
        st.chunk = Some(Chunk { seg_base: base, pos: 0, buf, fill: SEG_HEADER_BYTES, clean: 0, create: true });
        st.dir_dirty = true;
        Ok(())
    }

    /// Opens a side file for the fdatasync that needs it (closed after it: an idle shard
    /// holds no descriptor for its side files).
    async fn open_for_fdatasync(&self, path: &Path) -> std::io::Result<BufferedFile> {
        match self.hit(FaultPoint::Open) {
            Some(a) => Err(a.error()),
            None => BufferedFile::open(path).await.map_err(gio),
        }
    }

    /// The injected failure at `point`, as the error `op` on `path` would give.
    fn injected(&self, point: FaultPoint, op: &'static str, path: &Path) -> Result<(), StoreError> {
        match self.hit(point) {
            Some(a) if a.is_failure() => Err(StoreError::io(op, path, a.error())),
            Some(_) => Err(self.crash_error()),
            None => Ok(()),
        }
    }

    /// Makes room in the active segment for a record ending at byte `end` (aligned) and
    /// in slot `slot`: allocates the next step of side-file pages and of the `.seg` file
    /// where they do not reach that far. The writer asks for the next `.seg` step in the
    /// background before it is needed (see `preallocate_ahead`), so this allocates
    /// synchronously only when appends outrun it.
    ///
    /// Errors: [`StoreError::DiskFull`] (or the I/O error) of the allocation; nothing is
    /// changed then, and the shard stays writable.
    fn make_room(&self, s: &mut Segment, slot: u64, end: u64) -> Result<(), StoreError> {
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

async fn writer_loop(inner: Rc<Inner>) {
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
        Some(s) if !s.full => s.seg_room,
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

async fn fdatasync_all(tasks: Vec<Task<Result<(), StoreError>>>) -> Result<(), StoreError> {
    let mut first = Ok(());
    for t in tasks {
        let r = t.await;
        if first.is_ok() {
            first = r;
        }
    }
    first
}

impl Shard {
    pub(crate) fn from_parts(inner: Rc<Inner>) -> Shard {
        let writer = glommio::spawn_local(writer_loop(inner.clone()));
        Shard { inner, writer: RefCell::new(Some(writer)) }
    }

    /// Opens (creating if missing) the shard in `dir` and recovers it.
    ///
    /// Returns the shard and what recovery found: live and deleted record
    /// counts and every range it dropped with the reason (also logged).
    /// Errors: [`StoreError::Config`], [`StoreError::Format`] for a directory
    /// of another format version, [`StoreError::Io`] for unreadable files.
    pub async fn open(dir: &Path, cfg: ShardConfig) -> Result<(Shard, RecoveryReport), StoreError> {
        crate::recover::open(dir, cfg, None).await
    }

    /// [`Shard::open`] with a fault plan (tests: crash at named points).
    pub async fn open_with_faults(dir: &Path, cfg: ShardConfig, faults: Faults) -> Result<(Shard, RecoveryReport), StoreError> {
        crate::recover::open(dir, cfg, Some(faults)).await
    }

    /// Shard directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Appends a record and returns its offset. Buffered in memory (no I/O wait);
    /// full 1 MiB chunks are written in the background, durability needs [`Shard::sync`].
    ///
    /// `header` ≤ 1 MiB and `body` ≤ 128 MiB ([`StoreError::RecordTooLarge`]).
    /// Errors: [`StoreError::Failed`] after an earlier write error,
    /// [`StoreError::Closed`], [`StoreError::DiskFull`] when the disk blocks the
    /// record needs cannot be allocated, or an I/O error creating the next segment's
    /// files (EMFILE at the open-files limit). In those last two cases nothing was
    /// appended and the shard stays writable: a later append may succeed.
    pub fn append(&self, flags: u8, header: &[u8], body: &Bytes) -> Result<Offset, StoreError> {
        self.append_with(flags, header, body, || Bytes::copy_from_slice(header))
    }

    /// [`Shard::append`] of a header the caller already holds as [`Bytes`]: the memory
    /// cache keeps a reference to it instead of a copy (one allocation less per record).
    /// Same limits and errors.
    pub fn append_shared(&self, flags: u8, header: &Bytes, body: &Bytes) -> Result<Offset, StoreError> {
        self.append_with(flags, header, body, || header.clone())
    }

    fn append_with(&self, flags: u8, header: &[u8], body: &Bytes, cached: impl FnOnce() -> Bytes) -> Result<Offset, StoreError> {
        if header.len() > MAX_HEADER_BYTES || body.len() > MAX_BODY_BYTES {
            return Err(StoreError::RecordTooLarge {
                header_bytes: header.len(),
                body_bytes: body.len(),
                max_header: MAX_HEADER_BYTES,
                max_body: MAX_BODY_BYTES,
            });
        }
        let inner = &*self.inner;
        let mut st = inner.st.borrow_mut();
        st.check_writable(&inner.dir)?;
        let len = format::record_len(header.len(), body.len()) as u64;
        let need_roll = match st.segs.back() {
            None => true,
            Some(s) => s.full || (s.count > 0 && s.data_end + len > inner.cfg.segment_bytes) || s.count >= s.capacity,
        };
        if need_roll {
            inner.roll(&mut st, len)?;
        }
        let offset = st.next_offset;
        {
            let s = st.segs.back_mut().expect("active segment");
            let i = s.count;
            inner.make_room(s, i, align_up(s.data_end + len))?;
            side::idx_set(&mut s.idx, i, s.data_end);
            s.count += 1;
            s.live += 1;
            s.data_end += len;
        }
        let head = format::encode_record_head(offset, flags, header, body);
        st.put(&head);
        st.put(header);
        st.put(body);
        st.next_offset += 1;
        st.live += 1;
        st.cache.push(Record { offset, flags, header: cached(), body: body.clone() });
        let (limit, written) = (st.cache_limit, st.written_offset);
        st.cache.evict(limit, written);
        let queued = !st.jobs.is_empty();
        drop(st);
        if queued {
            inner.work.notify();
        }
        Ok(offset)
    }

    /// Waits while more than [`MAX_PENDING_CHUNKS`] MiB of appended data are not yet
    /// written, then yields once if writes are queued so the writer can submit
    /// them. Call it between batches of appends that are not followed by a sync.
    pub async fn throttle(&self) {
        for _ in 0..1_000_000 {
            let g = self.inner.io_done.gen();
            {
                let st = self.inner.st.borrow();
                if st.failed.is_some() || st.stop || st.next_seq - st.done_seq <= MAX_PENDING_CHUNKS {
                    break;
                }
            }
            self.inner.io_done.wait(g).await;
        }
        if !self.inner.st.borrow().jobs.is_empty() {
            futures_lite::future::yield_now().await;
        }
    }

    /// Creates the first segment of a shard that has none (its side files, its
    /// `.seg` file with the header written and synced), so that the first
    /// [`Shard::append`] does no file work. A no-op for a shard with segments.
    /// The broker calls it when a queue is declared, where RabbitMQ users expect
    /// the cost, instead of on the queue's first publish.
    ///
    /// Errors: as [`Shard::append`] creating a segment, and as [`Shard::sync`].
    pub async fn prepare(&self) -> Result<(), StoreError> {
        {
            let inner = &*self.inner;
            let mut st = inner.st.borrow_mut();
            st.check_writable(&inner.dir)?;
            if !st.segs.is_empty() {
                return Ok(());
            }
            inner.roll(&mut st, 0)?;
        }
        self.sync_with(true, true).await.map(|_| ())
    }

    /// Group commit: makes every record appended so far and every delete so
    /// far durable, with one write and one fdatasync per touched file.
    /// Concurrent callers coalesce: a caller whose records were covered by a
    /// sync that finished while it waited returns at once.
    ///
    /// Returns `Synced(n)`: all records `< n` survive a crash (kill -9, power loss).
    /// Errors: the write or fdatasync error (the shard then turns read-only, see
    /// [`StoreError::Failed`]), [`StoreError::Closed`].
    pub async fn sync(&self) -> Result<Synced, StoreError> {
        self.sync_with(false, true).await
    }

    /// [`Shard::sync`] for appends only: makes every record appended so far durable,
    /// and leaves deletes made since the last full sync to a later [`Shard::sync`] (a
    /// delete lost in a crash brings a record back; it never loses one). One fdatasync
    /// of segment data, without the deletion bitmaps: a publisher confirm waits for the
    /// message, not for the acks made meanwhile.
    ///
    /// Returns `Synced(n)`: all records `< n` survive a crash. Errors: as [`Shard::sync`].
    pub async fn sync_appends(&self) -> Result<Synced, StoreError> {
        self.sync_with(false, false).await
    }

    /// [`Shard::sync`]; with `force`, cuts and syncs even when no record is new
    /// (the header of a segment that [`Shard::prepare`] just created); without
    /// `deletes`, deletion bitmaps are left out ([`Shard::sync_appends`]).
    async fn sync_with(&self, force: bool, deletes: bool) -> Result<Synced, StoreError> {
        let inner = &*self.inner;
        let (target, del_target) = {
            let st = inner.st.borrow();
            st.check_writable(&inner.dir)?;
            (st.next_offset, st.del_epoch)
        };
        if inner.sync_lock.available() == 0 {
            // A sync is in its fdatasync: start writing this one's records now, so that
            // only the fdatasync is left when the lock comes (group commit, pipelined).
            let queued = inner.st.borrow_mut().cut(JobKind::SyncCut);
            if queued {
                inner.work.notify();
            }
        }
        let _permit = inner.sync_lock.acquire_permit(1).await.map_err(|_| StoreError::Closed { dir: inner.dir.clone() })?;
        let (wait_seq, cut_below, del_epoch, del_segs) = {
            let mut st = inner.st.borrow_mut();
            st.check_writable(&inner.dir)?;
            if !force && st.durable_offset >= target && (!deletes || st.del_durable_epoch >= del_target) {
                return Ok(Synced(st.durable_offset));
            }
            st.cut(JobKind::SyncCut);
            let mut del_segs = Vec::new();
            for s in st.segs.iter_mut().filter(|s| deletes && s.del_dirty) {
                s.del_dirty = false;
                del_segs.push(s.base);
            }
            (st.next_seq, st.next_offset, st.del_epoch, del_segs)
        };
        inner.work.notify();
        // 1. Wait for every write cut so far.
        loop {
            let g = inner.io_done.gen();
            {
                let st = inner.st.borrow();
                st.check_writable(&inner.dir)?;
                if st.done_seq >= wait_seq {
                    break;
                }
            }
            inner.io_done.wait(g).await;
        }
        // 2. fdatasync segment data and deletion bitmaps, concurrently.
        let data_files = std::mem::take(&mut inner.st.borrow_mut().dirty_data);
        let mut tasks = Vec::new();
        if !data_files.is_empty() {
            match inner.hit(FaultPoint::Fdatasync) {
                None => {}
                Some(a) if a.is_failure() => return Err(self.fail_with(StoreError::io("fdatasync", &inner.dir, a.error()))),
                Some(_) => return Err(self.fail_with(inner.crash_error())),
            }
        }
        for (base, f) in data_files {
            let path = inner.seg_file_path(base, FileKind::Seg);
            tasks.push(glommio::spawn_local(async move { f.fdatasync().await.map_err(|e| StoreError::io("fdatasync", &path, gio(e))) }));
        }
        if !del_segs.is_empty() {
            match inner.hit(FaultPoint::Delete) {
                None => {}
                Some(a) if a.is_failure() => {
                    return Err(self.fail_with(StoreError::io("fdatasync deletion bitmap", &inner.dir, a.error())))
                }
                Some(_) => return Err(self.fail_with(inner.crash_error())),
            }
        }
        let mut del_deferred = false;
        for base in del_segs {
            // Opened for this fdatasync only: an idle shard holds no descriptor for its
            // bitmaps. One that cannot be opened (the open-files limit) leaves its deletes
            // for the next sync: a delete lost in a crash only brings a record back.
            let path = inner.seg_file_path(base, FileKind::Del);
            let f = match inner.open_for_fdatasync(&path).await {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "deletion bitmap not synced now; retried by the next sync");
                    if let Some(s) = inner.st.borrow_mut().segs.iter_mut().find(|s| s.base == base) {
                        s.del_dirty = true;
                    }
                    del_deferred = true;
                    continue;
                }
            };
            tasks.push(glommio::spawn_local(async move {
                let r = f.fdatasync().await.map_err(|e| StoreError::io("fdatasync deletion bitmap", &path, gio(e)));
                let _ = f.close().await;
                r
            }));
        }
        fdatasync_all(tasks).await.map_err(|e| self.fail_with(e))?;
        // 3. New or removed files: make the directory entries durable.
        if std::mem::take(&mut inner.st.borrow_mut().dir_dirty) {
            if inner.crashed() {
                return Err(self.fail_with(inner.crash_error()));
            }
            let d = glommio::io::Directory::open(&inner.dir)
                .await
                .map_err(|e| self.fail_with(StoreError::io("opening directory", &inner.dir, gio(e))))?;
            d.sync().await.map_err(|e| self.fail_with(StoreError::io("fsync directory", &inner.dir, gio(e))))?;
            let _ = d.close().await;
        }
        // 4. Seal full segments whose records are all durable.
        self.seal_full(cut_below).await?;
        // 5. Remove full, fully deleted, durable segments.
        self.remove_dead(cut_below).await;
        let mut st = inner.st.borrow_mut();
        st.durable_offset = st.durable_offset.max(cut_below);
        if deletes && !del_deferred {
            st.del_durable_epoch = st.del_durable_epoch.max(del_epoch);
        }
        Ok(Synced(st.durable_offset))
    }

    fn fail_with(&self, e: StoreError) -> StoreError {
        self.inner.st.borrow_mut().fail(e.to_string());
        self.inner.io_done.notify();
        e
    }

    async fn seal_full(&self, below: Offset) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let sealed: Vec<(Offset, u64, Option<Rc<DmaFile>>)> = {
            let mut st = inner.st.borrow_mut();
            let mut v = Vec::new();
            for s in st.segs.iter_mut().filter(|s| s.full && !s.sealed && s.end() <= below && s.live > 0) {
                side::idx_write_seal(&mut s.idx, s.count, s.data_end);
                s.sealed = true;
                v.push((s.base, s.data_end, s.file.clone()));
            }
            v
        };
        for (base, data_end, file) in sealed {
            if inner.crashed() {
                return Err(self.fail_with(inner.crash_error()));
            }
            let path = inner.seg_file_path(base, FileKind::Idx);
            let f = match inner.open_for_fdatasync(&path).await {
                Ok(f) => f,
                Err(e) => {
                    // The seal is in the mapping; the kernel writes it back in time. Until
                    // then a crash finds the index unsealed (or its CRC not matching) and
                    // scans the segment: slower, never wrong.
                    tracing::warn!(path = %path.display(), error = %e, "sealed index not fdatasync'ed now");
                    continue;
                }
            };
            let r = f.fdatasync().await.map_err(|e| StoreError::io("fdatasync index", &path, gio(e)));
            let _ = f.close().await;
            r.map_err(|e| self.fail_with(e))?;
            // Give back the preallocated space after the last record (the
            // segment takes no more writes). Not made durable: if a crash loses
            // it, recovery reads the zero tail as the end of the records.
            if let Some(f) = file {
                let keep = align_up(data_end);
                if f.file_size().await.is_ok_and(|size| size > keep) {
                    if let Err(e) = f.truncate(keep).await {
                        tracing::debug!(base, error = %e, "trimming a sealed segment failed");
                    }
                }
            }
        }
        Ok(())
    }

    async fn remove_dead(&self, below: Offset) {
        let inner = &*self.inner;
        let dead: Vec<Segment> = {
            let mut st = inner.st.borrow_mut();
            let n = st.segs.len();
            let mut dead = Vec::new();
            let mut i = 0;
            while i < st.segs.len() {
                let s = &st.segs[i];
                if i + 1 < n && s.full && s.live == 0 && s.end() <= below {
                    dead.push(st.segs.remove(i).unwrap());
                } else {
                    i += 1;
                }
            }
            if !dead.is_empty() {
                st.dir_dirty = true;
            }
            dead
        };
        for s in dead {
            let base = s.base;
            let file = s.file.clone();
            drop(s);
            if inner.crashed() {
                return;
            }
            let sp = inner.seg_file_path(base, FileKind::Seg);
            if let Err(e) = std::fs::remove_file(&sp) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %sp.display(), error = %e, "removing dead segment");
                }
            }
            if let Some(f) = file {
                let _ = DmaFile::close_rc(f).await;
            }
            match inner.hit(FaultPoint::SegmentRemove) {
                Some(a) if a.is_failure() => {
                    tracing::warn!(base, "injected failure removing segment side files; left for the next open");
                    continue;
                }
                Some(_) => return,
                None => {}
            }
            for kind in [FileKind::Idx, FileKind::Del] {
                let p = inner.seg_file_path(base, kind);
                if let Err(e) = std::fs::remove_file(&p) {
                    tracing::warn!(path = %p.display(), error = %e, "removing dead segment file");
                }
            }
            tracing::debug!(base, "removed fully deleted segment");
        }
    }

    /// The record at `offset` if it is in the memory cache and live. No I/O.
    pub fn read_cached(&self, offset: Offset) -> Option<Record> {
        self.inner.st.borrow().cache.get(offset).cloned()
    }

    /// The record at `offset`: from memory if cached, else one disk read.
    /// `Ok(None)` if deleted or never existed.
    ///
    /// Errors: [`StoreError::Corrupt`] if the stored bytes fail their CRC (the
    /// record is then dropped: later reads return `None`), I/O errors.
    pub async fn read(&self, offset: Offset) -> Result<Option<Record>, StoreError> {
        let inner = &*self.inner;
        let (file, pos, len) = {
            let st = inner.st.borrow();
            if let Some(r) = st.cache.get(offset) {
                return Ok(Some(r.clone()));
            }
            let Some(si) = st.seg_index(offset) else { return Ok(None) };
            let s = &st.segs[si];
            let i = offset - s.base;
            if side::bit_get(&s.del, i) || offset >= st.written_offset {
                return Ok(None);
            }
            if st.closed {
                return Err(StoreError::Closed { dir: inner.dir.clone() });
            }
            let pos = side::idx_get(&s.idx, i);
            let end = if i + 1 < s.count { side::idx_get(&s.idx, i + 1) } else { s.data_end };
            let Some(f) = s.file.clone() else { return Ok(None) };
            (f, pos, end.saturating_sub(pos) as usize)
        };
        let path = inner.seg_file_path(self.seg_base_of(offset).unwrap_or(0), FileKind::Seg);
        let rr = file.read_at(pos, len).await.map_err(|e| StoreError::io("reading segment", &path, gio(e)))?;
        match format::parse_record(&rr) {
            Parse::Record(r) if r.offset == offset && r.len == len => {
                Ok(Some(Record { offset, flags: r.flags, header: Bytes::copy_from_slice(r.header), body: Bytes::copy_from_slice(r.body) }))
            }
            other => {
                let reason = match other {
                    Parse::Record(r) => format!("found offset {} length {} at byte {pos}, expected {offset} length {len}", r.offset, r.len),
                    Parse::Bad(why) => format!("{why} at byte {pos}"),
                    Parse::End | Parse::Short { .. } => format!("record at byte {pos} is cut short ({} bytes read)", rr.len()),
                };
                Err(self.drop_corrupt(offset, path, reason))
            }
        }
    }

    fn seg_base_of(&self, offset: Offset) -> Option<Offset> {
        let st = self.inner.st.borrow();
        st.seg_index(offset).map(|i| st.segs[i].base)
    }

    fn drop_corrupt(&self, offset: Offset, path: PathBuf, reason: String) -> StoreError {
        tracing::error!(offset, path = %path.display(), %reason, "corrupt record dropped");
        if let Err(e) = self.inner.st.borrow_mut().delete_one(&self.inner.dir, offset, &mut 0) {
            tracing::warn!(offset, error = %e, "corrupt record not marked deleted");
        }
        StoreError::Corrupt { offset, path, reason }
    }

    /// A sequential reader of live records from `from` on (ascending offsets).
    pub fn reader(&self, from: Offset) -> Reader<'_> {
        Reader { shard: self, next: from, buf: VecDeque::new() }
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
                    Some(Parse::Record(r)) if r.offset == o && r.len == b - a => out.push(Record {
                        offset: o,
                        flags: r.flags,
                        header: Bytes::copy_from_slice(r.header),
                        body: Bytes::copy_from_slice(r.body),
                    }),
                    _ => corrupt.push(o),
                }
            }
        }
        for o in corrupt {
            let _ = self.drop_corrupt(o, path.clone(), "CRC or framing check failed during a sequential read".into());
        }
        Ok((out, seg_base + last))
    }

    /// Marks records deleted: any order, O(1) each (a bit flip in the segment's
    /// mapped bitmap), idempotent; unknown offsets are ignored. Durable by the
    /// next [`Shard::sync`]; a fully deleted segment is removed by a later sync.
    ///
    /// Errors: [`StoreError::Closed`]; [`StoreError::DiskFull`] when a bitmap page of a
    /// segment opened without its pages allocated (an older version's sparse file, on a
    /// full disk) cannot be allocated: those records stay live, the others are deleted.
    pub fn delete_by_offsets(&self, offsets: &[Offset]) -> Result<(), StoreError> {
        let mut st = self.inner.st.borrow_mut();
        if st.closed {
            return Err(StoreError::Closed { dir: self.inner.dir.clone() });
        }
        let mut hint = st.segs.len().saturating_sub(1);
        let mut any = false;
        let mut failed = None;
        for &o in offsets {
            match st.delete_one(&self.inner.dir, o, &mut hint) {
                Ok(live) => any |= live,
                Err(e) => failed = Some(e),
            }
        }
        if any {
            st.del_epoch += 1;
        }
        failed.map_or(Ok(()), Err)
    }

    /// True if `offset` holds a record that is not deleted.
    pub fn is_live(&self, offset: Offset) -> bool {
        self.inner.st.borrow().is_live(offset)
    }

    /// Every live offset, ascending (1 bit read per stored record).
    pub fn live_offsets(&self) -> Vec<Offset> {
        let st = self.inner.st.borrow();
        let mut v = Vec::with_capacity(st.live as usize);
        for s in &st.segs {
            let mut i = 0;
            while let Some(k) = side::first_clear(&s.del, i, s.count) {
                v.push(s.base + k);
                i = k + 1;
            }
        }
        v
    }

    /// Lowest live offset (`== next_offset()` when there is none).
    pub fn start_offset(&self) -> Offset {
        let mut st = self.inner.st.borrow_mut();
        let r = st.first_live_from(st.start_hint).unwrap_or(st.next_offset);
        st.start_hint = r;
        r
    }

    /// Why the shard turned read-only (a write or fdatasync failed), if it did: appends
    /// and syncs then fail with [`StoreError::Failed`], reads and deletes still work, and
    /// reopening the directory recovers every synced record.
    pub fn failure(&self) -> Option<String> {
        self.inner.st.borrow().failed.clone()
    }

    /// Offset the next `append` returns.
    pub fn next_offset(&self) -> Offset {
        self.inner.st.borrow().next_offset
    }

    /// Live (not deleted) records.
    pub fn len(&self) -> u64 {
        self.inner.st.borrow().live
    }

    /// True if no record is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `upto()` of the latest `Synced`: records below it are durable.
    pub fn durable_offset(&self) -> Offset {
        self.inner.st.borrow().durable_offset
    }

    /// Bytes held by the memory cache (headers + bodies + 96 per record).
    pub fn cached_bytes(&self) -> usize {
        self.inner.st.borrow().cache.bytes()
    }

    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.inner.st.borrow().segs.len()
    }

    async fn stop_writer(&self) {
        {
            let mut st = self.inner.st.borrow_mut();
            st.stop = true;
        }
        self.inner.work.notify();
        self.inner.io_done.notify();
        let task = self.writer.borrow_mut().take();
        if let Some(t) = task {
            t.await;
        }
        for _ in 0..100_000 {
            let g = self.inner.io_done.gen();
            if self.inner.st.borrow().inflight == 0 {
                break;
            }
            self.inner.io_done.wait(g).await;
        }
    }

    /// Clean shutdown: sync, then close every file. Later calls fail with
    /// [`StoreError::Closed`]. Returns the sync error, if any (files are closed anyway).
    pub async fn close(&self) -> Result<(), StoreError> {
        if self.inner.st.borrow().closed {
            return Ok(());
        }
        let synced = if self.inner.st.borrow().failed.is_none() { self.sync().await.map(|_| ()) } else { Ok(()) };
        self.stop_writer().await;
        let files: Vec<Rc<DmaFile>> = {
            let mut st = self.inner.st.borrow_mut();
            st.closed = true;
            st.dirty_data.clear();
            st.segs.iter_mut().filter_map(|s| s.file.take()).collect()
        };
        for f in files {
            let _ = DmaFile::close_rc(f).await;
        }
        synced
    }

    /// Deletes the shard (queue.delete): closes it and removes its directory.
    pub async fn destroy(self) -> Result<(), StoreError> {
        let _ = self.close().await;
        let dir = self.inner.dir.clone();
        let d2 = dir.clone();
        glommio::executor()
            .spawn_blocking(move || std::fs::remove_dir_all(&d2))
            .await
            .map_err(|e| StoreError::io("removing shard directory", &dir, e))
    }

    /// Test hook: stops without syncing, as a kill -9 would (in-flight writes
    /// finish, queued ones are dropped). Reopen the directory afterwards.
    #[doc(hidden)]
    pub async fn abandon(self) {
        self.stop_writer().await;
    }
}

impl Drop for Shard {
    fn drop(&mut self) {
        if let Ok(mut st) = self.inner.st.try_borrow_mut() {
            st.stop = true;
        }
        self.inner.work.notify();
        if let Some(t) = self.writer.borrow_mut().take() {
            t.detach();
        }
    }
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.inner.st.borrow();
        f.debug_struct("Shard")
            .field("dir", &self.inner.dir)
            .field("next_offset", &st.next_offset)
            .field("live", &st.live)
            .field("segments", &st.segs.len())
            .finish()
    }
}

pub(crate) fn new_inner(st: State, dir: PathBuf, cfg: ShardConfig, faults: Option<Faults>) -> Rc<Inner> {
    Rc::new(Inner {
        st: RefCell::new(st),
        prealloc_busy: std::cell::Cell::new(false),
        work: Event::default(),
        io_done: Event::default(),
        sync_lock: Semaphore::new(1),
        dir,
        cfg,
        faults,
    })
}

/// Sequential reader over live records (see [`Shard::reader`]). Records in the
/// memory cache are served from it; older ones are read from disk about
/// [`READ_WINDOW`] bytes at a time. A record that fails its CRC is logged,
/// dropped and skipped.
pub struct Reader<'a> {
    shard: &'a Shard,
    next: Offset,
    buf: VecDeque<Record>,
}

impl Reader<'_> {
    /// The next live record, or `None` at the end of the log.
    pub async fn next(&mut self) -> Result<Option<Record>, StoreError> {
        loop {
            while let Some(r) = self.buf.pop_front() {
                if self.shard.is_live(r.offset) {
                    return Ok(Some(r));
                }
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
}
