//! The shard's shared state: [`State`] (the segments, counters, write queue and
//! cache, behind one `RefCell`) and [`Inner`] (that state with the events, the
//! sync lock, the directory, the config and the fault plan), with the lookups,
//! failure and delete bookkeeping every other module uses.
//!
//! # Invariants
//! 1. `segs` is ascending by `base` and its segments do not overlap; there are gaps
//!    where fully deleted segments were removed. Offsets below `next_offset` were
//!    handed out densely.
//! 2. `State::live` is the sum of the segments' `live`, and a segment's `live` counts
//!    its clear bitmap bits below `count`: `delete_one` keeps them in step and
//!    removes the record from the cache.
//! 3. `failed` keeps the first reason only; setting it drops the queued write jobs.
//!    Appends and syncs check `check_writable` first; reads and deletes still work.
//! 4. Single-threaded: one executor owns the shard; no `RefCell` borrow of `st` is
//!    held across an `.await`.

use std::{
    cell::RefCell,
    collections::{BTreeSet, VecDeque},
    path::{Path, PathBuf},
    rc::Rc,
};

use glommio::{
    io::{DmaBuffer, DmaFile},
    sync::Semaphore,
};

use crate::{
    error::StoreError,
    event::Event,
    fault::{FaultAction, FaultPoint, Faults},
    format::{self, FileKind, Offset},
    segment::Segment,
    side,
    writer::{Chunk, Job},
    Cache, ShardConfig,
};

pub(crate) struct State {
    pub next_offset: Offset,
    pub live: u64,
    pub segs: VecDeque<Segment>,
    pub chunk: Option<Chunk>,
    pub(crate) jobs: VecDeque<Job>,
    pub(crate) next_seq: u64,
    pub(crate) done_seq: u64,
    pub(crate) done_set: BTreeSet<u64>,
    pub(crate) inflight: usize,
    pub(crate) marks: VecDeque<(u64, Offset)>,
    pub written_offset: Offset,
    pub durable_offset: Offset,
    pub(crate) del_epoch: u64,
    pub(crate) del_durable_epoch: u64,
    pub cache: Cache,
    pub(crate) cache_limit: usize,
    pub(crate) failed: Option<String>,
    pub(crate) closed: bool,
    pub(crate) stop: bool,
    pub(crate) dirty_data: Vec<(Offset, Rc<DmaFile>)>,
    pub dir_dirty: bool,
    pub(crate) start_hint: Offset,
    pub(crate) alloc: Rc<DmaFile>,
    /// Written full-size chunk buffers, reused (saves page faults of fresh memory).
    pub(crate) pool: Vec<DmaBuffer>,
}

pub(crate) struct Inner {
    pub st: RefCell<State>,
    /// A background preallocation step runs (see `preallocate_ahead`).
    pub(crate) prealloc_busy: std::cell::Cell<bool>,
    pub(crate) work: Event,
    pub(crate) io_done: Event,
    pub(crate) sync_lock: Semaphore,
    pub dir: PathBuf,
    pub cfg: ShardConfig,
    pub faults: Option<Faults>,
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

    /// Index in `segs` of the segment holding `o`.
    pub(crate) fn seg_index(&self, o: Offset) -> Option<usize> {
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

    pub(crate) fn check_writable(&self, dir: &Path) -> Result<(), StoreError> {
        if self.closed {
            return Err(StoreError::Closed { dir: dir.to_path_buf() });
        }
        if let Some(r) = &self.failed {
            return Err(StoreError::Failed { dir: dir.to_path_buf(), reason: r.clone() });
        }
        Ok(())
    }

    pub(crate) fn fail(&mut self, reason: String) {
        if self.failed.is_none() {
            tracing::error!(%reason, "shard turns read-only");
            self.failed = Some(reason);
        }
        self.jobs.clear();
    }

    pub(crate) fn is_live(&self, o: Offset) -> bool {
        match self.seg_index(o) {
            Some(si) => {
                let s = &self.segs[si];
                !side::bit_get(&s.del, o - s.base)
            }
            None => false,
        }
    }

    /// Lowest live offset `>= from`.
    pub(crate) fn first_live_from(&self, from: Offset) -> Option<Offset> {
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
    pub(crate) fn delete_one(&mut self, dir: &Path, o: Offset, hint: &mut usize) -> Result<bool, StoreError> {
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
    pub(crate) fn seg_file_path(&self, base: Offset, kind: FileKind) -> PathBuf {
        format::seg_path(&self.dir, base, kind)
    }

    pub(crate) fn hit(&self, point: FaultPoint) -> Option<FaultAction> {
        self.faults.as_ref().and_then(|f| f.hit(point))
    }

    pub(crate) fn crashed(&self) -> bool {
        self.faults.as_ref().is_some_and(|f| f.crashed())
    }

    pub(crate) fn crash_error(&self) -> StoreError {
        StoreError::Failed { dir: self.dir.clone(), reason: "injected crash".into() }
    }

    /// The injected failure at `point`, as the error `op` on `path` would give.
    pub(crate) fn injected(&self, point: FaultPoint, op: &'static str, path: &Path) -> Result<(), StoreError> {
        match self.hit(point) {
            Some(a) if a.is_failure() => Err(StoreError::io(op, path, a.error())),
            Some(_) => Err(self.crash_error()),
            None => Ok(()),
        }
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
