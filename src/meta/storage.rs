//! Durable Raft storage in the data directory: an append-only record log plus one snapshot file.
//!
//! [`DiskStorage`] is the `raft::Storage` behind the `RawNode` (entries, HardState and ConfState
//! held in memory, every change written to `meta.log` first). Only the driver thread touches it,
//! so blocking file I/O is fine here and there are no locks.
//!
//! # Files (in the metadata directory)
//! - `meta.log`: the magic `RMQMLOG1` (8 bytes), then records. A record is
//!   `[payload length: u32 LE][crc32 of payload: u32 LE][payload]`; the payload's first byte is its
//!   kind:
//!   - `1` Entry: `index u64 LE, term u64 LE, entry type u8, context length varint, context,
//!     data` (data runs to the end of the payload; it is a command batch, see `state.rs`);
//!   - `2` HardState: `term u64 LE, vote u64 LE, commit u64 LE`;
//!   - `3` ConfState: its protobuf encoding (raft-rs `eraftpb.ConfState`).
//!
//!   Later records win: an Entry at an index already present truncates the log there first (Raft
//!   log overwrite), the last HardState / ConfState is the current one.
//! - `meta.snap`: the magic `RMQMSNP1`, `crc32 u32 LE`, `length u64 LE`, then a JSON
//!   [`SnapshotBody`] (index, term, conf state, the whole [`MetaState`]). Written to
//!   `meta.snap.tmp`, fsynced, renamed, directory fsynced.
//!
//! # Invariants
//! 1. Every Ready's entries and HardState reach the disk in one `write` and, when raft-rs says
//!    `must_sync`, one `fdatasync`, before the Ready is advanced (raft-rs `Ready` steps 4–6).
//! 2. In memory, `entries[i].index == snap_index + 1 + i`.
//! 3. A compaction writes the snapshot (fsync, rename, fsync dir) before replacing the log
//!    (same steps), so a crash between them leaves a new snapshot and an old log whose entries
//!    below the snapshot index are skipped on replay.
//!
//! # Recovery
//! A record whose length runs past the end of the file, whose CRC does not match, or that is
//! followed only by zero bytes is a torn tail: the file is truncated before it and a
//! `tracing::warn!` says how many bytes went. A bad record followed by a valid one is corruption
//! in the middle of the log: [`MetaError::CorruptLog`], never a panic.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, EntryType, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, StorageError};
use serde::{Deserialize, Serialize};

use super::state::{put_varint, MetaState, Reader};
use super::{Counters, MetaError};

/// File name of the record log.
pub const LOG_FILE: &str = "meta.log";
/// File name of the snapshot.
pub const SNAP_FILE: &str = "meta.snap";
const LOG_TMP: &str = "meta.log.tmp";
const SNAP_TMP: &str = "meta.snap.tmp";
const LOG_MAGIC: &[u8; 8] = b"RMQMLOG1";
const SNAP_MAGIC: &[u8; 8] = b"RMQMSNP1";
/// Record header: payload length (4 bytes) + crc32 (4 bytes).
const RECORD_HEADER: usize = 8;
/// Largest payload a record may have (bytes); a larger length field is damage.
const MAX_RECORD: usize = 256 << 20;

const KIND_ENTRY: u8 = 1;
const KIND_HARD_STATE: u8 = 2;
const KIND_CONF_STATE: u8 = 3;

/// When to compact: the log holds more entries than this since the last snapshot...
pub const COMPACT_ENTRIES: u64 = 10_000;
/// ...or the log file is larger than this (bytes).
pub const COMPACT_BYTES: u64 = 16 << 20;
/// Bytes of `meta.log` preallocated ahead of its writes (1 MiB).
pub const LOG_PREALLOC_BYTES: u64 = 1 << 20;
/// Bytes of preallocated log kept for raft-rs's own records when a proposal is checked
/// against the disk (64 KiB: hundreds of HardState records and leader no-ops).
pub const LOG_RESERVE_BYTES: u64 = 64 << 10;

/// The JSON body of `meta.snap`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotBody {
    /// Raft index of the last entry the state includes.
    pub index: u64,
    /// Raft term of that entry.
    pub term: u64,
    /// Voters of the group at `index`.
    pub voters: Vec<u64>,
    /// Learners of the group at `index`.
    pub learners: Vec<u64>,
    /// Outgoing voters (joint consensus), usually empty.
    #[serde(default)]
    pub voters_outgoing: Vec<u64>,
    /// Learners next (joint consensus), usually empty.
    #[serde(default)]
    pub learners_next: Vec<u64>,
    /// Auto-leave flag of a joint configuration.
    #[serde(default)]
    pub auto_leave: bool,
    /// The state machine at `index`.
    pub state: MetaState,
}

impl SnapshotBody {
    fn conf_state(&self) -> ConfState {
        ConfState {
            voters: self.voters.clone(),
            learners: self.learners.clone(),
            voters_outgoing: self.voters_outgoing.clone(),
            learners_next: self.learners_next.clone(),
            auto_leave: self.auto_leave,
            ..Default::default()
        }
    }
}

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
    dir: PathBuf,
    log: File,
    /// Bytes in `meta.log` (the next record's offset).
    log_len: u64,
    /// Bytes of `meta.log` known to have disk blocks (written, or preallocated with
    /// fallocate KEEP_SIZE): writes below it cannot fail for lack of space.
    log_room: u64,
    hard_state: HardState,
    conf_state: ConfState,
    /// HardState changed in memory but not yet in the log (a commit-index move).
    hs_dirty: bool,
    snap_index: u64,
    snap_term: u64,
    entries: Vec<Entry>,
    counters: Arc<Counters>,
    buf: Vec<u8>,
    /// Compaction thresholds: entries since the snapshot, log bytes.
    compact_at: (u64, u64),
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> MetaError + 'a {
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
        fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
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
            log: File::open(dir).map_err(io_err("open directory", dir))?, // replaced below
            log_len: 0,
            log_room: 0,
            hard_state: HardState::default(),
            conf_state: ConfState::default(),
            hs_dirty: false,
            snap_index: 0,
            snap_term: 0,
            entries: Vec::new(),
            counters,
            buf: Vec::new(),
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
            st.log = log;
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

    /// Sets and persists (with an fsync) the ConfState: on a fresh directory, and when a
    /// configuration change is applied.
    pub fn set_conf_state(&mut self, cs: ConfState) -> Result<(), MetaError> {
        self.conf_state = cs;
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        push_conf_state(&mut buf, &self.conf_state);
        let r = self.write_and_sync(&buf, true);
        self.buf = buf;
        r
    }

    /// Persists one Ready: `entries` (which may overwrite a suffix of the log) and `hs` in one
    /// write, then one fdatasync when `sync` (raft-rs `Ready::must_sync`). Updates memory after
    /// the write. Errors: [`MetaError::Io`]; after one the log must not be used again (the
    /// driver stops).
    pub fn append(&mut self, entries: &[Entry], hs: Option<&HardState>, sync: bool) -> Result<(), MetaError> {
        if let Some(first) = entries.first() {
            if first.index <= self.snap_index || first.index > self.last() + 1 {
                return Err(MetaError::Raft(format!("append of index {} outside ({}, {}]", first.index, self.snap_index, self.last() + 1)));
            }
        }
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
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
        let r = self.write_and_sync(&buf, sync);
        self.buf = buf;
        r?;
        if let Some(first) = entries.first() {
            self.entries.truncate((first.index - self.snap_index - 1) as usize);
            self.entries.extend_from_slice(entries);
            self.counters.entries_appended.add(entries.len() as u64);
        }
        Ok(())
    }

    /// Records a new commit index in memory; it reaches the log with the next write (it needs
    /// no fsync of its own: a restarted single voter recommits every persisted entry).
    pub fn set_commit(&mut self, commit: u64) {
        if commit > self.hard_state.commit {
            self.hard_state.commit = commit;
            self.hs_dirty = true;
        }
    }

    /// Writes any pending HardState and fsyncs the log (shutdown).
    pub fn flush(&mut self) -> Result<(), MetaError> {
        self.append(&[], None, true)
    }

    fn write_and_sync(&mut self, buf: &[u8], sync: bool) -> Result<(), MetaError> {
        let path = self.dir.join(LOG_FILE);
        if !buf.is_empty() {
            // Raft's own records come out of the reserve; when even that is short, try.
            let _ = self.reserve_log(buf.len() as u64);
            self.log.write_all_at(buf, self.log_len).map_err(io_err("write log", &path))?;
            self.log_len += buf.len() as u64;
            self.counters.log_bytes_written.add(buf.len() as u64);
        }
        if sync {
            self.log.sync_data().map_err(io_err("fdatasync log", &path))?;
            self.counters.fsyncs.add(1);
        }
        Ok(())
    }

    /// Sets the compaction thresholds: more than `entries` entries since the snapshot, or a log
    /// file larger than `bytes` (defaults [`COMPACT_ENTRIES`], [`COMPACT_BYTES`]).
    pub fn set_compaction(&mut self, entries: u64, bytes: u64) {
        self.compact_at = (entries, bytes);
    }

    /// True when the log is due for compaction (see [`DiskStorage::set_compaction`]).
    pub fn wants_compaction(&self) -> bool {
        self.entries.len() as u64 > self.compact_at.0 || self.log_len > self.compact_at.1
    }

    /// Writes a snapshot of `state` (which must include exactly the entries up to
    /// `state.applied_index`, all of them persisted) and starts a fresh log holding the
    /// ConfState, the HardState and the entries after it. Errors: [`MetaError::Io`].
    pub fn compact(&mut self, state: &MetaState) -> Result<(), MetaError> {
        let index = state.applied_index;
        if index <= self.snap_index || index > self.last() {
            return Ok(());
        }
        let term = self.entries[(index - self.snap_index - 1) as usize].term;
        let cs = &self.conf_state;
        let body = SnapshotBody {
            index,
            term,
            voters: cs.voters.clone(),
            learners: cs.learners.clone(),
            voters_outgoing: cs.voters_outgoing.clone(),
            learners_next: cs.learners_next.clone(),
            auto_leave: cs.auto_leave,
            state: state.clone(),
        };
        self.write_snapshot(&body)?;
        self.entries.drain(..(index - self.snap_index) as usize);
        self.snap_index = index;
        self.snap_term = term;
        self.rewrite_log()?;
        self.counters.snapshots.add(1);
        Ok(())
    }

    /// Installs a snapshot received from a leader (its data is a JSON [`SnapshotBody`]); returns
    /// the state to continue from. Errors: [`MetaError::CorruptSnapshot`], [`MetaError::Io`].
    pub fn install_snapshot(&mut self, snap: &Snapshot) -> Result<MetaState, MetaError> {
        let path = self.dir.join(SNAP_FILE);
        let mut body: SnapshotBody = serde_json::from_slice(&snap.data)
            .map_err(|e| MetaError::CorruptSnapshot { path: path.clone(), why: format!("received: {e}") })?;
        let meta = snap.get_metadata();
        body.index = meta.index;
        body.term = meta.term;
        let cs = meta.get_conf_state();
        body.voters = cs.voters.clone();
        body.learners = cs.learners.clone();
        body.voters_outgoing = cs.voters_outgoing.clone();
        body.learners_next = cs.learners_next.clone();
        body.auto_leave = cs.auto_leave;
        body.state.applied_index = meta.index;
        self.write_snapshot(&body)?;
        self.snap_index = body.index;
        self.snap_term = body.term;
        self.conf_state = body.conf_state();
        self.entries.clear();
        self.hard_state.term = self.hard_state.term.max(body.term);
        self.hard_state.commit = body.index;
        self.rewrite_log()?;
        Ok(body.state)
    }

    fn write_snapshot(&mut self, body: &SnapshotBody) -> Result<(), MetaError> {
        let json = serde_json::to_vec(body).map_err(|e| MetaError::Raft(format!("snapshot: {e}")))?;
        let mut out = Vec::with_capacity(json.len() + 20);
        out.extend_from_slice(SNAP_MAGIC);
        out.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        self.replace_file(SNAP_TMP, SNAP_FILE, &out)?;
        Ok(())
    }

    /// Replaces `meta.log` by a fresh one: magic, ConfState, HardState, the entries in memory.
    fn rewrite_log(&mut self) -> Result<(), MetaError> {
        let mut out = Vec::new();
        out.extend_from_slice(LOG_MAGIC);
        push_conf_state(&mut out, &self.conf_state);
        push_hard_state(&mut out, &self.hard_state);
        for e in &self.entries {
            push_entry(&mut out, e);
        }
        self.replace_file(LOG_TMP, LOG_FILE, &out)?;
        let path = self.dir.join(LOG_FILE);
        self.log = OpenOptions::new().read(true).write(true).open(&path).map_err(io_err("open log", &path))?;
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
    fn replace_file(&mut self, tmp: &str, name: &str, bytes: &[u8]) -> Result<(), MetaError> {
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

    fn snapshot_for_peer(&self, request_index: u64) -> raft::Result<Snapshot> {
        let path = self.dir.join(SNAP_FILE);
        let unavailable = raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable);
        if self.snap_index == 0 || self.snap_index < request_index {
            return Err(unavailable);
        }
        let body = read_snapshot(&path).map_err(|_| unavailable)?;
        let mut snap = Snapshot::default();
        let meta = snap.mut_metadata();
        meta.index = body.index;
        meta.term = body.term;
        meta.set_conf_state(body.conf_state());
        snap.data = serde_json::to_vec(&body).unwrap_or_default().into();
        Ok(snap)
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

fn read_snapshot(path: &Path) -> Result<SnapshotBody, MetaError> {
    let bytes = fs::read(path).map_err(io_err("read snapshot", path))?;
    let corrupt = |why: String| MetaError::CorruptSnapshot { path: path.to_owned(), why };
    if bytes.len() < 20 || &bytes[..8] != SNAP_MAGIC {
        return Err(corrupt("bad magic or header".into()));
    }
    let crc = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_default());
    let len = u64::from_le_bytes(bytes[12..20].try_into().unwrap_or_default());
    let json = &bytes[20..];
    if json.len() as u64 != len || crc32fast::hash(json) != crc {
        return Err(corrupt("length or crc mismatch".into()));
    }
    serde_json::from_slice(json).map_err(|e| corrupt(format!("json: {e}")))
}

enum RecordParse<'a> {
    Ok(&'a [u8]),
    Torn,
}

fn parse_record(b: &[u8]) -> RecordParse<'_> {
    if b.len() < RECORD_HEADER {
        return RecordParse::Torn;
    }
    let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let crc = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    if len == 0 || len > MAX_RECORD || b.len() - RECORD_HEADER < len {
        return RecordParse::Torn;
    }
    let payload = &b[RECORD_HEADER..RECORD_HEADER + len];
    if crc32fast::hash(payload) != crc {
        return RecordParse::Torn;
    }
    RecordParse::Ok(payload)
}

/// True when a valid record starts anywhere after the bad record at the start of `b`: then the
/// damage is in the middle of the log, not a torn tail (an interrupted append leaves only a
/// prefix of its bytes, or zeros, never a valid record after an invalid one). Scans byte by
/// byte; candidates must have a plausible length and kind before their CRC is computed, and
/// the CRC work is capped (past the cap the log counts as damaged: refuse rather than guess).
fn valid_record_follows(b: &[u8]) -> bool {
    const CRC_BUDGET: usize = 256 << 20;
    let mut spent = 0usize;
    for p in 1..b.len().saturating_sub(RECORD_HEADER) {
        let c = &b[p..];
        let len = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
        if len == 0 || len > MAX_RECORD || c.len() - RECORD_HEADER < len {
            continue;
        }
        if !matches!(c[RECORD_HEADER], KIND_ENTRY | KIND_HARD_STATE | KIND_CONF_STATE) {
            continue;
        }
        spent += len;
        if spent > CRC_BUDGET {
            return true;
        }
        if matches!(parse_record(c), RecordParse::Ok(_)) {
            return true;
        }
    }
    false
}

fn begin_record(out: &mut Vec<u8>) -> usize {
    let at = out.len();
    out.extend_from_slice(&[0u8; RECORD_HEADER]);
    at
}

fn end_record(out: &mut [u8], at: usize) {
    let payload = &out[at + RECORD_HEADER..];
    let len = payload.len() as u32;
    let crc = crc32fast::hash(payload);
    out[at..at + 4].copy_from_slice(&len.to_le_bytes());
    out[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
}

fn push_entry(out: &mut Vec<u8>, e: &Entry) {
    let at = begin_record(out);
    out.push(KIND_ENTRY);
    out.extend_from_slice(&e.index.to_le_bytes());
    out.extend_from_slice(&e.term.to_le_bytes());
    out.push(match e.get_entry_type() {
        EntryType::EntryNormal => 0,
        EntryType::EntryConfChange => 1,
        EntryType::EntryConfChangeV2 => 2,
    });
    put_varint(out, e.context.len() as u64);
    out.extend_from_slice(&e.context);
    out.extend_from_slice(&e.data);
    end_record(out, at);
}

fn decode_entry(b: &[u8]) -> Option<Entry> {
    let mut r = Reader { buf: b, pos: 0 };
    let index = u64::from_le_bytes(r.bytes(8).ok()?.try_into().ok()?);
    let term = u64::from_le_bytes(r.bytes(8).ok()?.try_into().ok()?);
    let ty = match r.u8().ok()? {
        0 => EntryType::EntryNormal,
        1 => EntryType::EntryConfChange,
        2 => EntryType::EntryConfChangeV2,
        _ => return None,
    };
    let ctx_len = usize::try_from(r.varint().ok()?).ok()?;
    let ctx = r.bytes(ctx_len).ok()?.to_vec();
    let data = b[r.pos..].to_vec();
    Some(Entry { index, term, entry_type: ty, context: ctx.into(), data: data.into(), ..Default::default() })
}

fn push_hard_state(out: &mut Vec<u8>, hs: &HardState) {
    let at = begin_record(out);
    out.push(KIND_HARD_STATE);
    out.extend_from_slice(&hs.term.to_le_bytes());
    out.extend_from_slice(&hs.vote.to_le_bytes());
    out.extend_from_slice(&hs.commit.to_le_bytes());
    end_record(out, at);
}

fn push_conf_state(out: &mut Vec<u8>, cs: &ConfState) {
    let at = begin_record(out);
    out.push(KIND_CONF_STATE);
    // Encoding a plain message into a Vec cannot fail.
    let bytes = cs.write_to_bytes().unwrap_or_default();
    out.extend_from_slice(&bytes);
    end_record(out, at);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::state::{Command, MetaState};
    use raft::Storage as _;

    fn entry(index: u64, term: u64, payload: &[u8]) -> Entry {
        Entry { index, term, context: vec![7u8; 16].into(), data: payload.to_vec().into(), ..Default::default() }
    }

    fn open(dir: &Path) -> (DiskStorage, Recovered) {
        DiskStorage::open(dir, Arc::new(Counters::default())).unwrap()
    }

    fn hs(term: u64, vote: u64, commit: u64) -> HardState {
        HardState { term, vote, commit, ..Default::default() }
    }

    fn terms(st: &DiskStorage) -> Vec<(u64, u64)> {
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
    fn compaction_then_crash_before_the_log_rename_replays_correctly() {
        let dir = tempfile::tempdir().unwrap();
        let (mut st, _) = open(dir.path());
        let ents: Vec<Entry> = (1..=6).map(|i| entry(i, 1, b"e")).collect();
        st.append(&ents, Some(&hs(1, 1, 6)), true).unwrap();
        let old_log = fs::read(dir.path().join(LOG_FILE)).unwrap();
        let mut state = MetaState::default();
        state.apply(&Command::DeclareVhost { name: "/".into() });
        state.applied_index = 4;
        st.compact(&state).unwrap();
        assert_eq!((st.snapshot_index(), st.entry_count()), (4, 2));
        assert_eq!(st.term(4).unwrap(), 1);
        assert!(st.term(3).is_err());
        drop(st);

        // Normal reopen: snapshot + short log.
        let (st, rec) = open(dir.path());
        assert_eq!(rec.state.as_ref().map(|s| s.applied_index), Some(4));
        assert!(rec.state.unwrap().topology.vhosts.contains("/"));
        assert_eq!(terms(&st), [(5, 1), (6, 1)]);
        drop(st);

        // Crash after the snapshot rename, before the log rename: old log, new snapshot.
        fs::write(dir.path().join(LOG_FILE), &old_log).unwrap();
        let (st, rec) = open(dir.path());
        assert_eq!(rec.state.map(|s| s.applied_index), Some(4));
        assert_eq!(terms(&st), [(5, 1), (6, 1)]);
        assert_eq!(st.hard_state().commit, 6);
    }

    #[test]
    fn bad_magic_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(LOG_FILE), b"NOTALOG!....").unwrap();
        let r = DiskStorage::open(dir.path(), Arc::new(Counters::default()));
        assert!(matches!(r, Err(MetaError::CorruptLog { offset: 0, .. })));
    }
}
