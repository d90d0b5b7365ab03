//! The metadata log's writer: the `write` and `fdatasync` of every Ready happen here, off the
//! driver thread, so the driver keeps ticking, stepping peers' messages and taking proposals
//! while the disk works (raft-rs's asynchronous Ready: `advance_append_async`, then
//! `on_persist_ready` once the write is durable; DESIGN.md, "tick never waits on a disk").
//!
//! # Contract
//! 1. [`DiskStorage::stage`](super::storage::DiskStorage::stage) updates memory at once (raft-rs
//!    reads staged entries through `raft::Storage` before they are durable) and returns the
//!    bytes and their offset as a [`LogWrite`]; the driver hands it here with
//!    [`LogWriter::submit`], which numbers it.
//! 2. Writes run in submission order. The thread takes every write waiting when it wakes, makes
//!    them with `pwrite`, and calls one `fdatasync` per file for the group when any of them asks
//!    for one (group commit across Readys). It then sends the raft-rs messages that waited for
//!    those writes (a follower's append responses and votes: they go to the network from here,
//!    without waiting for the driver to wake) and reports the number of the group's last write:
//!    every write up to it is on disk.
//! 3. A failed write or fdatasync is reported once and ends the thread; the driver stops on
//!    it (the page cache state is unknown, as before).
//! 4. Compaction and installing a snapshot replace `meta.log`: the driver first waits for every
//!    submitted write ([`LogWriter::wait_idle`]), then writes those files itself. They are rare
//!    (one per 10,000 entries or 16 MiB of log).
//!
//! A single voter writes inline ([`LogWriter::inline`]): it has no heartbeats to keep.
//! The simulator (`sim.rs`) runs the writer by hand ([`LogWriter::manual`]): it chooses when
//! queued writes reach the disk, and a node it crashes loses the writes not yet made, as a
//! killed process loses what its writer thread had not written.

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use raft::eraftpb::Message;

use super::net::RaftNet;
use super::storage::io_err;
use super::{Counters, MetaError};

/// Most writes taken into one group (one fdatasync).
const MAX_GROUP: usize = 1024;

/// One write of `meta.log`: `bytes` at byte `offset` of `file`, then an fdatasync when `sync`.
#[derive(Debug)]
pub struct LogWrite {
    /// The log file (a compaction opens a new one; writes name the file they belong to).
    pub(super) file: Arc<File>,
    /// The log's path, for error messages.
    pub(super) path: Arc<PathBuf>,
    /// Byte offset in the file.
    pub(super) offset: u64,
    /// Encoded records (`record.rs`); may be empty for a pure fdatasync.
    pub(super) bytes: Vec<u8>,
    /// fdatasync after the write (raft-rs's `must_sync`).
    pub(super) sync: bool,
    /// raft-rs's persisted messages of the Ready: sent once this write and every earlier one
    /// are durable.
    pub(super) msgs: Vec<Message>,
}

impl LogWrite {
    /// Makes the write (and, when `sync`, the fdatasync) on the calling thread; it carries no
    /// messages. Errors: [`MetaError::Io`].
    pub(super) fn run(self, counters: &Counters) -> Result<(), MetaError> {
        run_group(&mut [self], counters, None)
    }

    fn write(&self, counters: &Counters) -> Result<(), MetaError> {
        if !self.bytes.is_empty() {
            self.file.write_all_at(&self.bytes, self.offset).map_err(io_err("write log", &self.path))?;
            counters.log_bytes_written.add(self.bytes.len() as u64);
        }
        Ok(())
    }
}

/// Makes one group of writes in order, one fdatasync per file that needs one, then sends the
/// messages that waited for them.
fn run_group(group: &mut [LogWrite], counters: &Counters, net: Option<&Arc<dyn RaftNet>>) -> Result<(), MetaError> {
    for w in group.iter() {
        w.write(counters)?;
    }
    // Files in the group, in order, that a write asked to sync (a group spans two files only
    // across a compaction, which waits for the writer first; this stays right regardless).
    let mut synced: Vec<&LogWrite> = Vec::new();
    for w in group.iter().filter(|w| w.sync) {
        if !synced.iter().any(|s| Arc::ptr_eq(&s.file, &w.file)) {
            synced.push(w);
        }
    }
    for w in synced {
        w.file.sync_data().map_err(io_err("fdatasync log", &w.path))?;
        counters.fsyncs.add(1);
    }
    let msgs: Vec<Message> = group.iter_mut().flat_map(|w| std::mem::take(&mut w.msgs)).collect();
    if let (Some(net), false) = (net, msgs.is_empty()) {
        net.send(msgs);
    }
    Ok(())
}

enum Mode {
    /// The writer thread: writes go out on `tx`, the number of the last durable write comes
    /// back on `done` (an error ends the thread).
    Thread {
        tx: Option<flume::Sender<(u64, LogWrite)>>,
        done: flume::Receiver<Result<u64, MetaError>>,
        thread: Option<std::thread::JoinHandle<()>>,
    },
    /// A single voter: each write is made at once on the driver's thread. It has no peers
    /// whose heartbeats could wait, and a thread hop per write measured 6% of single-node
    /// throughput.
    Inline,
    /// Writes wait in `queue` until [`LogWriter::run_manual`] makes them (the simulator).
    #[cfg_attr(not(test), allow(dead_code))]
    Manual { queue: VecDeque<(u64, LogWrite)>, net: Option<Arc<dyn RaftNet>> },
}

/// The writer of one driver's log (module doc).
pub(super) struct LogWriter {
    mode: Mode,
    counters: Arc<Counters>,
    /// Number of the last write submitted (writes are numbered from 1).
    submitted: u64,
    /// Number of the last write known to be durable.
    durable: u64,
    /// The error that ended the writer, once seen.
    failed: Option<String>,
}

impl LogWriter {
    /// Starts the writer thread (`ringmq-meta-log`). `net`: where the persisted messages go.
    /// `stall_ms`: tests set it to make every group wait that long first (a stalling disk); 0
    /// otherwise. Errors: [`MetaError::Raft`] when the thread cannot be spawned.
    pub(super) fn thread(counters: Arc<Counters>, net: Option<Arc<dyn RaftNet>>, stall_ms: Arc<AtomicU64>) -> Result<LogWriter, MetaError> {
        let (tx, rx) = flume::unbounded::<(u64, LogWrite)>();
        let (done_tx, done) = flume::unbounded();
        let c = counters.clone();
        let thread = std::thread::Builder::new()
            .name("ringmq-meta-log".into())
            .spawn(move || {
                // Ends when the driver drops its sender (after its last write) or on an error.
                while let Ok(first) = rx.recv() {
                    let stall = stall_ms.load(Ordering::Relaxed);
                    if stall > 0 {
                        std::thread::sleep(std::time::Duration::from_millis(stall));
                    }
                    let mut last = first.0;
                    let mut group = vec![first.1];
                    for (n, w) in rx.try_iter().take(MAX_GROUP - 1) {
                        last = n;
                        group.push(w);
                    }
                    let r = run_group(&mut group, &c, net.as_ref());
                    let failed = r.is_err();
                    let _ = done_tx.send(r.map(|()| last));
                    if failed {
                        return;
                    }
                }
            })
            .map_err(|e| MetaError::Raft(format!("spawn the metadata log writer: {e}")))?;
        Ok(LogWriter { mode: Mode::Thread { tx: Some(tx), done, thread: Some(thread) }, counters, submitted: 0, durable: 0, failed: None })
    }

    /// A writer that makes each write at once on the caller's thread (a single voter).
    pub(super) fn inline(counters: Arc<Counters>) -> LogWriter {
        LogWriter { mode: Mode::Inline, counters, submitted: 0, durable: 0, failed: None }
    }

    /// A writer run by hand with [`LogWriter::run_manual`] (tests, the simulator).
    #[cfg(test)]
    pub(super) fn manual(counters: Arc<Counters>, net: Option<Arc<dyn RaftNet>>) -> LogWriter {
        LogWriter { mode: Mode::Manual { queue: VecDeque::new(), net }, counters, submitted: 0, durable: 0, failed: None }
    }

    /// Queues `w`; returns its number. Errors: the writer's earlier failure, as
    /// [`MetaError::Failed`].
    pub(super) fn submit(&mut self, w: LogWrite) -> Result<u64, MetaError> {
        self.check()?;
        self.submitted += 1;
        let n = self.submitted;
        match &mut self.mode {
            Mode::Thread { tx, .. } => {
                let sent = tx.as_ref().is_some_and(|tx| tx.send((n, w)).is_ok());
                if !sent {
                    // The thread ended: its error is on `done`.
                    self.poll()?;
                    return Err(MetaError::Failed("the metadata log writer stopped".into()));
                }
            }
            Mode::Manual { queue, .. } => queue.push_back((n, w)),
            Mode::Inline => {
                self.note(w.run(&self.counters).map(|()| n))?;
            }
        }
        Ok(n)
    }

    /// Number of the last write known durable, after taking the thread's news without
    /// waiting. Errors: a failed write ([`MetaError::Io`] the first time it is seen,
    /// [`MetaError::Failed`] after).
    pub(super) fn poll(&mut self) -> Result<u64, MetaError> {
        self.check()?;
        if let Mode::Thread { done, .. } = &self.mode {
            let news: Vec<_> = done.try_iter().collect();
            for r in news {
                self.note(r)?;
            }
        }
        Ok(self.durable)
    }

    /// Takes one report from the thread (received by the driver's select, `driver.rs`).
    /// Errors: as [`LogWriter::poll`].
    pub(super) fn note(&mut self, r: Result<u64, MetaError>) -> Result<(), MetaError> {
        match r {
            Ok(n) => {
                self.durable = self.durable.max(n);
                Ok(())
            }
            Err(e) => {
                self.failed = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// The thread's reports, for the driver to wait on beside its requests (None: inline or
    /// manual, which have nothing to wait for).
    pub(super) fn reports(&self) -> Option<&flume::Receiver<Result<u64, MetaError>>> {
        match &self.mode {
            Mode::Thread { done, .. } => Some(done),
            Mode::Manual { .. } | Mode::Inline => None,
        }
    }

    /// Number of the last write submitted.
    pub(super) fn submitted(&self) -> u64 {
        self.submitted
    }

    /// True when every submitted write is durable.
    pub(super) fn idle(&self) -> bool {
        self.durable == self.submitted
    }

    /// Waits until every submitted write is durable (manual: makes them now).
    /// Errors: as [`LogWriter::poll`].
    pub(super) fn wait_idle(&mut self) -> Result<(), MetaError> {
        self.check()?;
        if let Mode::Manual { .. } = self.mode {
            return self.run_manual(usize::MAX);
        }
        // Bounded: each report moves `durable` up, and the thread reports every group it takes.
        while !self.idle() {
            let r = match &self.mode {
                Mode::Thread { done, .. } => done.recv(),
                Mode::Manual { .. } | Mode::Inline => return Ok(()),
            };
            match r {
                Ok(r) => self.note(r)?,
                Err(_) => return Err(MetaError::Failed("the metadata log writer stopped".into())),
            }
        }
        Ok(())
    }

    /// Manual writer: makes the first `n` queued writes, in order, one fdatasync per file for
    /// them. Errors: [`MetaError::Io`].
    pub(super) fn run_manual(&mut self, n: usize) -> Result<(), MetaError> {
        let Mode::Manual { queue, net } = &mut self.mode else { return Ok(()) };
        let k = n.min(queue.len());
        if k == 0 {
            return Ok(());
        }
        let group: Vec<(u64, LogWrite)> = queue.drain(..k).collect();
        let last = group.last().map(|(n, _)| *n).unwrap_or(self.durable);
        let mut writes: Vec<LogWrite> = group.into_iter().map(|(_, w)| w).collect();
        let r = run_group(&mut writes, &self.counters, net.as_ref()).map(|()| last);
        self.note(r)
    }

    /// Manual writer: how many writes wait.
    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        match &self.mode {
            Mode::Manual { queue, .. } => queue.len(),
            Mode::Thread { .. } | Mode::Inline => (self.submitted - self.durable) as usize,
        }
    }

    fn check(&self) -> Result<(), MetaError> {
        match &self.failed {
            Some(why) => Err(MetaError::Failed(why.clone())),
            None => Ok(()),
        }
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        if let Mode::Thread { tx, thread, .. } = &mut self.mode {
            // The thread makes the writes already queued, then ends.
            drop(tx.take());
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(file: &Arc<File>, path: &Arc<PathBuf>, offset: u64, bytes: &[u8], sync: bool) -> LogWrite {
        LogWrite { file: file.clone(), path: path.clone(), offset, bytes: bytes.to_vec(), sync, msgs: Vec::new() }
    }

    #[test]
    fn thread_writes_in_order_and_reports_the_last_durable_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = Arc::new(dir.path().join("log"));
        let file = Arc::new(std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&*path).unwrap());
        let counters = Arc::new(Counters::default());
        let mut w = LogWriter::thread(counters.clone(), None, Default::default()).unwrap();
        let mut expected = Vec::new();
        for i in 0..200u64 {
            let bytes = [i as u8; 7];
            assert_eq!(w.submit(write(&file, &path, i * 7, &bytes, i % 3 == 0)).unwrap(), i + 1);
            expected.extend_from_slice(&bytes);
        }
        w.wait_idle().unwrap();
        assert!(w.idle());
        assert_eq!(w.poll().unwrap(), 200);
        assert_eq!(std::fs::read(&*path).unwrap(), expected);
        let fsyncs = counters.fsyncs.get();
        assert!((1..=67).contains(&fsyncs), "grouped fdatasyncs, at most one per syncing write: {fsyncs}");
        assert_eq!(counters.log_bytes_written.get(), 1400);
    }

    #[test]
    fn a_failed_write_stops_the_writer_and_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = Arc::new(dir.path().join("log"));
        std::fs::write(&*path, b"x").unwrap();
        // Opened read-only: every write fails with EBADF.
        let file = Arc::new(File::open(&*path).unwrap());
        let mut w = LogWriter::thread(Arc::new(Counters::default()), None, Default::default()).unwrap();
        w.submit(write(&file, &path, 0, b"abc", true)).unwrap();
        let err = w.wait_idle().unwrap_err();
        assert!(matches!(err, MetaError::Io { what: "write log", .. }), "{err}");
        assert!(matches!(w.submit(write(&file, &path, 0, b"abc", true)), Err(MetaError::Failed(_))));
        assert!(matches!(w.poll(), Err(MetaError::Failed(_))));
    }

    #[test]
    fn manual_writes_reach_the_file_only_when_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = Arc::new(dir.path().join("log"));
        let file = Arc::new(std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&*path).unwrap());
        let mut w = LogWriter::manual(Arc::new(Counters::default()), None);
        w.submit(write(&file, &path, 0, b"ab", true)).unwrap();
        w.submit(write(&file, &path, 2, b"cd", false)).unwrap();
        assert_eq!((w.queued(), w.poll().unwrap()), (2, 0));
        assert!(std::fs::read(&*path).unwrap().is_empty());
        w.run_manual(1).unwrap();
        assert_eq!((w.queued(), w.poll().unwrap()), (1, 1));
        assert_eq!(std::fs::read(&*path).unwrap(), b"ab");
        w.wait_idle().unwrap();
        assert_eq!(std::fs::read(&*path).unwrap(), b"abcd");
        assert!(w.idle());
    }
}
