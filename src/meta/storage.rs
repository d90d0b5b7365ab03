//! Durable Raft storage in the data directory: an append-only record log plus one snapshot file.
//!
//! [`DiskStorage`] is the `raft::Storage` behind the `RawNode`: entries, HardState and ConfState
//! held in memory, every change staged as a write of `meta.log` that the log writer makes off
//! the driver thread (`writer.rs`). Only the driver thread touches the storage itself, so there
//! are no locks; opening, compaction and installing a snapshot do their file I/O on it.
//!
//! Here: opening and replaying the directory, staging Readys, the log's disk room, and the
//! `raft::Storage` reads. The record format of `meta.log` is in `record.rs`; `meta.snap` and
//! compaction are in `snapshot.rs`.
//!
//! # Files (in the metadata directory)
//! - `meta.log`: the magic `RMQMLOG1`, then checksummed records of three kinds: Entry, HardState,
//!   ConfState (byte layout: `record.rs`).
//!
//!   Later records win: an Entry at an index already present truncates the log there first (Raft
//!   log overwrite), the last HardState / ConfState is the current one.
//! - `meta.snap`: the snapshot, a JSON [`SnapshotBody`](super::snapshot::SnapshotBody) behind a
//!   checksummed header (layout: `snapshot.rs`).
//!
//! # Invariants
//! 1. Every Ready's entries and HardState reach the disk in one `write` and, when raft-rs says
//!    `must_sync`, an `fdatasync`, in Ready order, before the driver tells raft-rs they are
//!    persisted (`on_persist_ready`) and sends the messages that waited for them.
//! 2. In memory, `entries[i].index == snap_index + 1 + i`.
//! 3. A compaction writes the snapshot before it replaces the log (the steps: `snapshot.rs`).
//!
//! # Recovery
//! A record whose length runs past the end of the file, whose CRC does not match, or that is
//! followed only by zero bytes is a torn tail: the file is truncated before it and a
//! `tracing::warn!` says how many bytes went. A bad record followed by a valid one is corruption
//! in the middle of the log: [`MetaError::CorruptLog`], never a panic.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, StorageError};

use super::record::{
    decode_entry, parse_record, push_conf_state, push_entry, push_hard_state, valid_record_follows, RecordParse, KIND_CONF_STATE,
    KIND_ENTRY, KIND_HARD_STATE, LOG_MAGIC, RECORD_HEADER,
};
use super::snapshot::{read_snapshot, COMPACT_BYTES, COMPACT_ENTRIES, SNAP_FILE, SNAP_TMP};
use super::state::MetaState;
use super::wire::Reader;
use super::writer::LogWrite;
use super::{Counters, MetaError};

/// File name of the record log.
pub const LOG_FILE: &str = "meta.log";
const LOG_TMP: &str = "meta.log.tmp";
/// Bytes of `meta.log` preallocated ahead of its writes (1 MiB).
pub const LOG_PREALLOC_BYTES: u64 = 1 << 20;
/// Bytes of preallocated log kept for raft-rs's own records when a proposal is checked
/// against the disk (64 KiB: hundreds of HardState records and leader no-ops).
pub const LOG_RESERVE_BYTES: u64 = 64 << 10;

/// What [`DiskStorage::open`] found.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The snapshot's state, when a snapshot exists (`applied_index` = snapshot index).
    pub state: Option<MetaState>,
    /// Entries replayed from the log (after the snapshot).
    pub entries: u64,
    /// Bytes cut from a torn log tail (0 when the log ended cleanly).
    pub torn_bytes: u64,
    /// True when the directory held no log and no snapshot.
    pub fresh: bool,
}

/// The durable `raft::Storage`. See the module doc for the format.
pub struct DiskStorage {
    pub(super) dir: PathBuf,
    /// The open `meta.log` (shared with the writes in flight, `writer.rs`).
    log: Arc<File>,
    /// Its path.
    log_path: Arc<PathBuf>,
    /// Bytes in `meta.log` (the next record's offset).
    pub(super) log_len: u64,
    /// Bytes of `meta.log` known to have disk blocks (written, or preallocated with
    /// fallocate KEEP_SIZE): writes below it cannot fail for lack of space.
    log_room: u64,
    pub(super) hard_state: HardState,
    pub(super) conf_state: ConfState,
    /// HardState changed in memory but not yet in the log (a commit-index move).
    hs_dirty: bool,
    pub(super) snap_index: u64,
    pub(super) snap_term: u64,
    pub(super) entries: Vec<Entry>,
    pub(super) counters: Arc<Counters>,
    /// Compaction thresholds: entries since the snapshot, log bytes.
    pub(super) compact_at: (u64, u64),
}

pub(super) fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> MetaError + 'a {
    move |source| MetaError::Io { what, path: path.to_owned(), source }
}

fn sync_dir(dir: &Path) -> Result<(), MetaError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("fsync directory", dir))
}

impl DiskStorage {
    /// Opens (creating when missing) the metadata directory `dir` and replays `meta.snap` and
    /// `meta.log`. A torn log tail is truncated (with a warning). Errors: [`MetaError::Io`],
    /// [`MetaError::CorruptLog`], [`MetaError::CorruptSnapshot`].
    pub(crate) fn open(dir: &Path, counters: Arc<Counters>) -> Result<(DiskStorage, Recovered), MetaError> {
        ringmq_shards::create_dir_all_durable(dir).map_err(io_err("create directory", dir))?;
        for tmp in [LOG_TMP, SNAP_TMP] {
            let p = dir.join(tmp);
            if p.exists() {
                fs::remove_file(&p).map_err(io_err("remove temp file", &p))?;
            }
        }
        let mut rec = Recovered::default();
        let snap_path = dir.join(SNAP_FILE);
        let snap = if snap_path.exists() { Some(read_snapshot(&snap_path)?) } else { None };
        let log_path = dir.join(LOG_FILE);
        rec.fresh = snap.is_none() && !log_path.exists();

        let mut st = DiskStorage {
            dir: dir.to_owned(),
            log: Arc::new(File::open(dir).map_err(io_err("open directory", dir))?), // replaced below
            log_path: Arc::new(log_path.clone()),
            log_len: 0,
            log_room: 0,
            hard_state: HardState::default(),
            conf_state: ConfState::default(),
            hs_dirty: false,
            snap_index: 0,
            snap_term: 0,
            entries: Vec::new(),
            counters,
            compact_at: (COMPACT_ENTRIES, COMPACT_BYTES),
        };
        if let Some(body) = snap {
            st.snap_index = body.index;
            st.snap_term = body.term;
            st.conf_state = body.conf_state();
            st.hard_state.term = body.term;
            st.hard_state.commit = body.index;
            let mut state = body.state;
            state.applied_index = body.index;
            state.check_invariants().map_err(|why| MetaError::CorruptSnapshot { path: snap_path.clone(), why })?;
            rec.state = Some(state);
        }

        if log_path.exists() {
            let mut bytes = Vec::new();
            File::open(&log_path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(io_err("read log", &log_path))?;
            let (good_len, n) = st.replay(&bytes, &log_path)?;
            rec.entries = n;
            let log = OpenOptions::new().read(true).write(true).open(&log_path).map_err(io_err("open log", &log_path))?;
            if good_len < bytes.len() as u64 {
                rec.torn_bytes = bytes.len() as u64 - good_len;
                tracing::warn!(
                    path = %log_path.display(),
                    torn_bytes = rec.torn_bytes,
                    kept_bytes = good_len,
                    "metadata log has a torn tail (interrupted write); truncating it"
                );
                log.set_len(good_len).map_err(io_err("truncate log", &log_path))?;
                log.sync_all().map_err(io_err("fsync log", &log_path))?;
            }
            st.log = Arc::new(log);
            st.log_len = good_len;
            st.log_room = good_len;
            if good_len < LOG_MAGIC.len() as u64 {
                // Torn before the magic was complete: start the file over.
                st.rewrite_log()?;
            }
        } else {
            st.rewrite_log()?;
        }
        // A snapshot newer than the log's HardState (crash between the two renames).
        st.hard_state.commit = st.hard_state.commit.max(st.snap_index).min(st.last());
        st.hard_state.term = st.hard_state.term.max(st.snap_term);
        Ok((st, rec))
    }

    /// Parses the log bytes into memory; returns (length of the valid prefix, entries kept).
    fn replay(&mut self, bytes: &[u8], path: &Path) -> Result<(u64, u64), MetaError> {
        if bytes.len() < LOG_MAGIC.len() {
            if bytes.iter().zip(LOG_MAGIC).all(|(a, b)| a == b) {
                return Ok((0, 0)); // torn while creating
            }
            return Err(MetaError::CorruptLog { path: path.to_owned(), offset: 0, why: "bad magic" });
        }
        if &bytes[..8] != LOG_MAGIC {
            return Err(MetaError::CorruptLog { path: path.to_owned(), offset: 0, why: "bad magic" });
        }
        let mut off = LOG_MAGIC.len();
        let mut kept = 0u64;
        // Bounded: each iteration consumes at least RECORD_HEADER bytes or stops.
        while off < bytes.len() {
            let bad = |why: &'static str| MetaError::CorruptLog { path: path.to_owned(), offset: off as u64, why };
            match parse_record(&bytes[off..]) {
                RecordParse::Ok(payload) => {
                    let next = off + RECORD_HEADER + payload.len();
                    self.replay_record(payload).map_err(|_| bad("undecodable record"))?;
                    if payload[0] == KIND_ENTRY {
                        kept += 1;
                    }
                    off = next;
                }
                RecordParse::Torn => {
                    // Torn only if nothing valid follows; otherwise it is mid-log damage.
                    if valid_record_follows(&bytes[off..]) {
                        return Err(bad("bad record followed by valid records"));
                    }
                    return Ok((off as u64, kept));
                }
            }
        }
        Ok((off as u64, kept))
    }

    fn replay_record(&mut self, payload: &[u8]) -> Result<(), ()> {
        match payload[0] {
            KIND_ENTRY => {
                let e = decode_entry(&payload[1..]).ok_or(())?;
                if e.index <= self.snap_index {
                    return Ok(()); // covered by the snapshot
                }
                let first = self.snap_index + 1;
                if e.index > self.last() + 1 {
                    return Err(()); // gap
                }
                self.entries.truncate((e.index - first) as usize);
                self.entries.push(e);
                Ok(())
            }
            KIND_HARD_STATE => {
                let mut r = Reader { buf: &payload[1..], pos: 0 };
                let mut u = || -> Result<u64, ()> {
                    let b = r.bytes(8).map_err(|_| ())?;
                    Ok(u64::from_le_bytes(b.try_into().map_err(|_| ())?))
                };
                let (term, vote, commit) = (u()?, u()?, u()?);
                self.hard_state.term = term;
                self.hard_state.vote = vote;
                self.hard_state.commit = commit;
                Ok(())
            }
            KIND_CONF_STATE => {
                self.conf_state = ConfState::parse_from_bytes(&payload[1..]).map_err(|_| ())?;
                Ok(())
            }
            _ => Err(()),
        }
    }

    /// Index of the last entry (the snapshot index when the log is empty).
    pub fn last(&self) -> u64 {
        self.snap_index + self.entries.len() as u64
    }

    /// Index of the snapshot the log starts after (0: none).
    pub fn snapshot_index(&self) -> u64 {
        self.snap_index
    }

    /// Entries held after the snapshot.
    pub fn entry_count(&self) -> u64 {
        self.entries.len() as u64
    }

    /// Bytes in `meta.log`.
    pub fn log_bytes(&self) -> u64 {
        self.log_len
    }

    /// Current HardState (term, vote, commit).
    pub fn hard_state(&self) -> &HardState {
        &self.hard_state
    }

    /// Current ConfState (voters, learners).
    pub fn conf_state(&self) -> &ConfState {
        &self.conf_state
    }

    /// Sets and persists (with an fsync, on this thread) the ConfState of a fresh directory.
    /// Errors: [`MetaError::Io`].
    pub fn set_conf_state(&mut self, cs: ConfState) -> Result<(), MetaError> {
        self.stage_conf_state(cs).run(&self.counters)
    }

    /// Sets the ConfState in memory (an applied configuration change) and returns its record
    /// as a synced write for the log writer (`writer.rs`).
    pub(super) fn stage_conf_state(&mut self, cs: ConfState) -> LogWrite {
        self.conf_state = cs;
        let mut buf = Vec::new();
        push_conf_state(&mut buf, &self.conf_state);
        self.stage_bytes(buf, true)
    }

    /// Stages one Ready: `entries` (which may overwrite a suffix of the log) and `hs` are in
    /// memory when this returns, so raft-rs reads them at once; the returned write (one
    /// `pwrite`, then one fdatasync when `sync`, raft-rs `Ready::must_sync`) makes them durable
    /// and goes to the log writer (`writer.rs`). None: nothing to write (a commit-index move
    /// rides with the next write). Errors: [`MetaError::Raft`] for an append outside the log.
    pub fn stage(&mut self, entries: &[Entry], hs: Option<&HardState>, sync: bool) -> Result<Option<LogWrite>, MetaError> {
        if let Some(first) = entries.first() {
            if first.index <= self.snap_index || first.index > self.last() + 1 {
                return Err(MetaError::Raft(format!("append of index {} outside ({}, {}]", first.index, self.snap_index, self.last() + 1)));
            }
        }
        let mut buf = Vec::new();
        for e in entries {
            push_entry(&mut buf, e);
        }
        if let Some(hs) = hs {
            self.hard_state = hs.clone();
            self.hs_dirty = true;
        }
        if self.hs_dirty && (!buf.is_empty() || sync) {
            push_hard_state(&mut buf, &self.hard_state);
            self.hs_dirty = false;
        }
        if let Some(first) = entries.first() {
            self.entries.truncate((first.index - self.snap_index - 1) as usize);
            self.entries.extend_from_slice(entries);
            self.counters.entries_appended.add(entries.len() as u64);
        }
        if buf.is_empty() && !sync {
            return Ok(None);
        }
        Ok(Some(self.stage_bytes(buf, sync)))
    }

    /// The write of `buf` at the log's end (which moves past it).
    fn stage_bytes(&mut self, buf: Vec<u8>, sync: bool) -> LogWrite {
        // Raft's own records come out of the reserve; when even that is short, try.
        let _ = self.reserve_log(buf.len() as u64);
        let w = LogWrite { bytes: buf, sync, ..self.empty_write() };
        self.log_len += w.bytes.len() as u64;
        w
    }

    /// A write of nothing: it only carries messages behind the writes before it.
    pub(super) fn empty_write(&self) -> LogWrite {
        LogWrite {
            file: self.log.clone(),
            path: self.log_path.clone(),
            offset: self.log_len,
            bytes: Vec::new(),
            sync: false,
            msgs: Vec::new(),
        }
    }

    /// [`DiskStorage::stage`] and the write, on this thread (tests, shutdown). Errors:
    /// [`MetaError::Io`]; after one the log must not be used again (the driver stops).
    pub fn append(&mut self, entries: &[Entry], hs: Option<&HardState>, sync: bool) -> Result<(), MetaError> {
        match self.stage(entries, hs, sync)? {
            Some(w) => w.run(&self.counters),
            None => Ok(()),
        }
    }

    /// Records a new commit index in memory; it reaches the log with the next write (it needs
    /// no fsync of its own: a restarted single voter recommits every persisted entry).
    pub fn set_commit(&mut self, commit: u64) {
        if commit > self.hard_state.commit {
            self.hard_state.commit = commit;
            self.hs_dirty = true;
        }
    }

    /// Writes any pending HardState and fsyncs the log (shutdown, once the writer is idle).
    pub fn flush(&mut self) -> Result<(), MetaError> {
        self.append(&[], None, true)
    }

    /// Replaces `meta.log` by a fresh one: magic, ConfState, HardState, the entries in memory.
    pub(super) fn rewrite_log(&mut self) -> Result<(), MetaError> {
        let mut out = Vec::new();
        out.extend_from_slice(LOG_MAGIC);
        push_conf_state(&mut out, &self.conf_state);
        push_hard_state(&mut out, &self.hard_state);
        for e in &self.entries {
            push_entry(&mut out, e);
        }
        self.replace_file(LOG_TMP, LOG_FILE, &out)?;
        let path = self.dir.join(LOG_FILE);
        self.log = Arc::new(OpenOptions::new().read(true).write(true).open(&path).map_err(io_err("open log", &path))?);
        self.log_len = out.len() as u64;
        self.log_room = self.log_len;
        self.hs_dirty = false;
        Ok(())
    }

    /// Makes sure `bytes` more can be written to the log, with [`LOG_RESERVE_BYTES`] left
    /// over for raft-rs's own records (HardState, leader no-ops): preallocates the log
    /// (fallocate KEEP_SIZE) [`LOG_PREALLOC_BYTES`] ahead, or only what is asked when the
    /// disk has less. The driver calls it before proposing, so a full disk refuses a
    /// proposal ([`MetaError::DiskFull`]) instead of failing a write raft-rs has already
    /// taken (which stops the group).
    ///
    /// Errors: [`MetaError::DiskFull`] when the blocks cannot be had.
    pub fn reserve_log(&mut self, bytes: u64) -> Result<(), MetaError> {
        let need = self.log_len + bytes + LOG_RESERVE_BYTES;
        if need <= self.log_room {
            return Ok(());
        }
        use std::os::fd::AsRawFd;
        let fd = self.log.as_raw_fd();
        let alloc = |to: u64| {
            // SAFETY: fallocate on a descriptor we own.
            let rc = unsafe { libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, 0, to as libc::off_t) };
            rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP)
        };
        let ahead = need + LOG_PREALLOC_BYTES;
        if alloc(ahead) {
            self.log_room = ahead;
        } else if alloc(need) {
            self.log_room = need;
        } else {
            return Err(MetaError::DiskFull { path: self.dir.join(LOG_FILE), bytes });
        }
        Ok(())
    }

    /// Writes `bytes` to `tmp`, fsyncs it, renames it to `name`, fsyncs the directory.
    pub(super) fn replace_file(&mut self, tmp: &str, name: &str, bytes: &[u8]) -> Result<(), MetaError> {
        let tmp_path = self.dir.join(tmp);
        let path = self.dir.join(name);
        let mut f = File::create(&tmp_path).map_err(io_err("create temp file", &tmp_path))?;
        f.write_all(bytes).map_err(io_err("write temp file", &tmp_path))?;
        f.sync_all().map_err(io_err("fsync temp file", &tmp_path))?;
        drop(f);
        fs::rename(&tmp_path, &path).map_err(io_err("rename temp file", &path))?;
        sync_dir(&self.dir)?;
        self.counters.fsyncs.add(2);
        self.counters.log_bytes_written.add(bytes.len() as u64);
        Ok(())
    }
}

impl raft::Storage for DiskStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(self.hard_state.clone(), self.conf_state.clone()))
    }

    fn entries(&self, low: u64, high: u64, max_size: impl Into<Option<u64>>, _context: GetEntriesContext) -> raft::Result<Vec<Entry>> {
        if low <= self.snap_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let lo = (low - self.snap_index - 1) as usize;
        let hi = (high - self.snap_index - 1) as usize;
        let mut ents = self.entries[lo..hi].to_vec();
        raft::util::limit_size(&mut ents, max_size.into());
        Ok(ents)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx == self.snap_index {
            return Ok(self.snap_term);
        }
        if idx < self.snap_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if idx > self.last() {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        Ok(self.entries[(idx - self.snap_index - 1) as usize].term)
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.snap_index + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        self.snapshot_for_peer(request_index)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use raft::Storage as _;

    pub(crate) fn entry(index: u64, term: u64, payload: &[u8]) -> Entry {
        Entry { index, term, context: vec![7u8; 16].into(), data: payload.to_vec().into(), ..Default::default() }
    }

    pub(crate) fn open(dir: &Path) -> (DiskStorage, Recovered) {
        DiskStorage::open(dir, Arc::new(Counters::default())).unwrap()
    }

    pub(crate) fn hs(term: u64, vote: u64, commit: u64) -> HardState {
        HardState { term, vote, commit, ..Default::default() }
    }

    pub(crate) fn terms(st: &DiskStorage) -> Vec<(u64, u64)> {
        let (lo, hi) = (st.first_index().unwrap(), st.last_index().unwrap() + 1);
        st.entries(lo, hi, None, GetEntriesContext::empty(false)).unwrap().iter().map(|e| (e.index, e.term)).collect()
    }

    #[test]
    fn entries_hard_state_and_conf_state_survive_reopen_with_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let (mut st, rec) = open(dir.path());
        assert!(rec.fresh);
        let cs = ConfState { voters: vec![1, 2, 3], ..Default::default() };
        st.set_conf_state(cs.clone()).unwrap();
        let ents: Vec<Entry> = (1..=5).map(|i| entry(i, 1, &[i as u8; 3])).collect();
        st.append(&ents, Some(&hs(1, 1, 2)), true).unwrap();
        // A new leader overwrites from index 4.
        st.append(&[entry(4, 2, b"x")], Some(&hs(2, 2, 3)), true).unwrap();
        st.set_commit(4);
        st.flush().unwrap();
        drop(st);

        let (st, rec) = open(dir.path());
        assert!(!rec.fresh);
        assert_eq!(rec.torn_bytes, 0);
        assert_eq!(terms(&st), [(1, 1), (2, 1), (3, 1), (4, 2)]);
        assert_eq!(st.hard_state(), &hs(2, 2, 4));
        assert_eq!(st.conf_state().voters, cs.voters);
        assert_eq!(st.term(4).unwrap(), 2);
        let e = st.entries(4, 5, None, GetEntriesContext::empty(false)).unwrap();
        assert_eq!(&e[0].data[..], b"x");
        assert_eq!(&e[0].context[..], &[7u8; 16]);
    }

    #[test]
    fn zero_filled_tail_is_torn_not_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let (mut st, _) = open(dir.path());
        st.append(&[entry(1, 1, b"a"), entry(2, 1, b"b")], Some(&hs(1, 1, 2)), true).unwrap();
        drop(st);
        let path = dir.path().join(LOG_FILE);
        let mut bytes = fs::read(&path).unwrap();
        let good = bytes.len();
        bytes.extend_from_slice(&[0u8; 4096]);
        fs::write(&path, &bytes).unwrap();
        let (st, rec) = open(dir.path());
        assert_eq!(rec.torn_bytes, 4096);
        assert_eq!(fs::metadata(&path).unwrap().len(), good as u64);
        assert_eq!(st.last(), 2);
    }

    #[test]
    fn bad_magic_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(LOG_FILE), b"NOTALOG!....").unwrap();
        let r = DiskStorage::open(dir.path(), Arc::new(Counters::default()));
        assert!(matches!(r, Err(MetaError::CorruptLog { offset: 0, .. })));
    }
}
