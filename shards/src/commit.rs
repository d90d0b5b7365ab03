//! Group commit: [`Shard::sync_with`] (behind `sync`, `sync_appends` and `prepare`)
//! waits for the cut writes, fdatasyncs the touched segment files and deletion
//! bitmaps concurrently and the directory when files came or went, then seals full
//! segments and removes dead ones.
//!
//! # Invariants
//! 1. `Synced(n)` is returned only after every job cut so far is written and every
//!    file written since the previous sync is fdatasync'ed: all records `< n` are
//!    durable. Deletion bitmaps dirtied before the cut are fdatasync'ed in the same
//!    sync (a bitmap that cannot be opened now is left dirty for the next one).
//! 2. One sync at a time holds `sync_lock`; a caller waiting for it cuts its records
//!    meanwhile, and one whose records a finished sync covered returns at once.
//! 3. A segment is sealed (its index trusted at open) only after its data is
//!    durable, and removed only when it is full, fully deleted and durable (never the
//!    newest segment).
//! 4. A failed fdatasync turns the shard read-only (`fail_with`); so does a failed
//!    write, which the sync finds as `check_writable`'s error while it waits.

use std::{path::Path, rc::Rc};

use glommio::{
    io::{BufferedFile, DmaFile},
    Task,
};

use crate::{
    error::{gio, StoreError},
    fault::FaultPoint,
    format::{align_up, FileKind, Offset},
    segment::Segment,
    side,
    state::Inner,
    writer::JobKind,
    Shard, Synced,
};

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

impl Inner {
    /// Opens a side file for the fdatasync that needs it (closed after it: an idle shard
    /// holds no descriptor for its side files).
    async fn open_for_fdatasync(&self, path: &Path) -> std::io::Result<BufferedFile> {
        match self.hit(FaultPoint::Open) {
            Some(a) => Err(a.error()),
            None => BufferedFile::open(path).await.map_err(gio),
        }
    }
}

impl Shard {
    /// [`Shard::sync`]; with `force`, cuts and syncs even when no record is new
    /// (the header of a segment that [`Shard::prepare`] just created); without
    /// `deletes`, deletion bitmaps are left out ([`Shard::sync_appends`]).
    pub(crate) async fn sync_with(&self, force: bool, deletes: bool) -> Result<Synced, StoreError> {
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
                side::idx_write_seal(&mut s.idx, s.count, s.data_end, s.flags_all);
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
}
