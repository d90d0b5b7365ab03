//! `Shard`: the public API (open, append, sync, reads, deletes, close). The work
//! behind it is in `state.rs` (shared state), `segment.rs` (segments, roll, room),
//! `writer.rs` (the background writer), `commit.rs` (group-commit sync) and
//! `reader.rs` (the sequential reader).
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

use std::{cell::RefCell, collections::VecDeque, path::Path, rc::Rc};

use bytes::Bytes;
use glommio::{io::DmaFile, Task};

use crate::{
    error::{gio, StoreError},
    fault::Faults,
    format::{self, align_up, FileKind, Offset, Parse, MAX_BODY_BYTES, MAX_HEADER_BYTES},
    reader::Reader,
    side,
    state::Inner,
    writer::writer_loop,
    Record, RecoveryReport, ShardConfig, Synced,
};

/// `throttle` waits while more chunks than this are cut but not yet written.
pub const MAX_PENDING_CHUNKS: u64 = 16;

/// A queue shard: an append-only log of records in segment files, owned by one
/// glommio executor (`!Send`). See the crate doc for the format and guarantees.
pub struct Shard {
    pub(crate) inner: Rc<Inner>,
    writer: RefCell<Option<Task<()>>>,
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
        crate::recover::open(dir, cfg, None, None).await
    }

    /// [`Shard::open`] that keeps only the records whose flags byte has every bit of
    /// `keep`: each other live record is deleted (its bit set in the deletion bitmap, as
    /// [`Shard::delete_by_offsets`] does) and counted in [`RecoveryReport::discarded`], and
    /// a full [`Shard::sync`] makes those deletes durable and removes the segments they
    /// emptied before this returns. A crash before that sync leaves them live on disk; the
    /// next `open_retaining` discards them again. `keep = 0` keeps everything.
    ///
    /// The broker opens a durable queue's messages this way at its first open after a
    /// start, keeping persistent messages only (RabbitMQ's classic queues drop transient
    /// messages at a restart).
    ///
    /// Cost: records of unsealed segments are read by recovery anyway; a sealed segment is
    /// read only if its seal does not say every record has `keep` (then one read of each
    /// live record's 24-byte head; with [`ShardConfig::verify_on_open`], the whole record
    /// and its CRC). A record whose head does not match its index entry is kept (it is
    /// checked when read).
    ///
    /// Errors: as [`Shard::open`], and as [`Shard::sync`] when something was discarded.
    pub async fn open_retaining(dir: &Path, cfg: ShardConfig, keep: u8) -> Result<(Shard, RecoveryReport), StoreError> {
        let (shard, report) = crate::recover::open(dir, cfg, None, Some(keep)).await?;
        if report.discarded > 0 {
            shard.sync().await?;
        }
        Ok((shard, report))
    }

    /// [`Shard::open`] with a fault plan (tests: crash at named points).
    pub async fn open_with_faults(dir: &Path, cfg: ShardConfig, faults: Faults) -> Result<(Shard, RecoveryReport), StoreError> {
        crate::recover::open(dir, cfg, Some(faults), None).await
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
        self.append_owned(flags, Bytes::copy_from_slice(header), body.clone())
    }

    /// [`Shard::append`] of a header the caller already holds as [`Bytes`]: the memory
    /// cache keeps a reference to it instead of a copy (one allocation less per record).
    /// Same limits and errors.
    pub fn append_shared(&self, flags: u8, header: &Bytes, body: &Bytes) -> Result<Offset, StoreError> {
        self.append_owned(flags, header.clone(), body.clone())
    }

    /// [`Shard::append`] of a header and body the caller gives up: the memory cache keeps
    /// them (no reference count taken or dropped). Same limits and errors.
    pub fn append_owned(&self, flags: u8, header: Bytes, body: Bytes) -> Result<Offset, StoreError> {
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
            s.flags_all &= flags;
            s.count += 1;
            s.live += 1;
            s.data_end += len;
        }
        let head = format::encode_record_head(offset, flags, &header, &body);
        st.put(&head);
        st.put(&header);
        st.put(&body);
        st.next_offset += 1;
        st.live += 1;
        st.cache.push(Record { offset, flags, header, body });
        let (limit, written) = (st.cache_limit, st.written_offset);
        st.cache.evict(limit, written);
        let queued = !st.jobs.is_empty();
        drop(st);
        if queued {
            inner.work.notify();
        }
        Ok(offset)
    }

    /// Moves the next offset to `offset`, leaving the offsets in between without records:
    /// a new segment starts at `offset` (its files are created here, as a roll makes them),
    /// so the next [`Shard::append`] returns `offset`. Offsets skipped are not live, not
    /// readable and not counted. A no-op when `offset <= next_offset()`.
    ///
    /// For a store that receives a copy of another store's live records (a replica catching
    /// up): a long run of deleted records costs one segment instead of a record each. After a
    /// crash before the new segment's header is synced, the shard reopens at the old next
    /// offset (the caller repeats the skip).
    ///
    /// Errors: as [`Shard::append`] creating a segment (nothing changed then).
    pub fn skip_to(&self, offset: Offset) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let mut st = inner.st.borrow_mut();
        st.check_writable(&inner.dir)?;
        let before = st.next_offset;
        if offset <= before {
            return Ok(());
        }
        st.next_offset = offset;
        if let Err(e) = inner.roll(&mut st, 0) {
            st.next_offset = before;
            return Err(e);
        }
        st.cache.skip_to(offset);
        let queued = !st.jobs.is_empty();
        drop(st);
        if queued {
            inner.work.notify();
        }
        Ok(())
    }

    /// Gives back the disk of a shard whose records are all deleted: when no record is live
    /// and the last segment holds records, a new empty segment starts at the next offset
    /// (its header page only) and the sync that follows removes the old one, its
    /// preallocated room with it. An idle queue then takes ~40 KB of disk instead of the
    /// megabytes its last segment grew to. A no-op otherwise; offsets go on unchanged.
    ///
    /// Errors: as [`Shard::append`] creating a segment, and as [`Shard::sync`].
    pub async fn shrink_if_empty(&self) -> Result<(), StoreError> {
        {
            let inner = &*self.inner;
            let mut st = inner.st.borrow_mut();
            st.check_writable(&inner.dir)?;
            if st.live != 0 || st.segs.back().is_none_or(|s| s.count == 0) {
                return Ok(());
            }
            inner.roll(&mut st, 0)?;
        }
        self.sync_with(true, true).await.map(|_| ())
    }

    /// True while more than [`MAX_PENDING_CHUNKS`] MiB of appended data are not yet written
    /// (and the shard is neither failed nor stopping): [`Shard::throttle`] would wait.
    pub fn write_backlogged(&self) -> bool {
        let st = self.inner.st.borrow();
        st.failed.is_none() && !st.stop && st.next_seq - st.done_seq > MAX_PENDING_CHUNKS
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

    /// A sequential reader of live records from `from` on (ascending offsets).
    pub fn reader(&self, from: Offset) -> Reader<'_> {
        Reader { shard: self, next: from, buf: VecDeque::new() }
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

    /// Drops every cached record that is written (what is not yet written stays: it is read
    /// from memory until it is); reads then go to disk. For memory pressure. Returns the bytes
    /// the cache still holds.
    pub fn drop_cache(&self) -> usize {
        let mut st = self.inner.st.borrow_mut();
        let written = st.written_offset;
        st.cache.evict(0, written);
        st.cache.bytes()
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
