//! Growing a replicated queue's replica set (`meta::grow`), on both ends: the queue's server
//! copies its live messages into the log ([`start_copy`]), and the node growing into the set
//! stores them ([`Queue::apply_copy`], [`Queue::apply_joined`]).
//!
//! # Steps at the server (`meta::grow` steps 2 and 3)
//! 1. From where the copy got (`Grow::copied`, read from the metadata each round), read up
//!    to [`COPY_BATCH_MESSAGES`] live records or [`COPY_BATCH_BYTES`] bytes below the store's
//!    next offset and propose them as one `CopyMessages`; one batch in flight at a time.
//! 2. Once a batch reaches the store's next offset: hold the enqueuer (publishes wait, none
//!    in flight), wait until the store holds every message the log enqueued, copy the rest
//!    and propose it with `JoinReplicaSet` in one entry, then release the enqueuer. A join
//!    refused because a message was enqueued meanwhile sends the copy round again.
//! 3. Stop when the grow is gone or changed (the metadata dropped it), or this node stops
//!    serving the queue.
//!
//! # Steps at the receiving node
//! 1. A copy of `[from, to)` lands in offset order: a message at or above the store's next
//!    offset is appended (the offsets before it that hold nothing are skipped:
//!    [`Queue::fill_gap`]), and the store's next offset is `to` afterwards. Below the next
//!    offset (a replay after a restart, or a store an earlier grow left here) the range is
//!    made to match: a live record the batch does not name is deleted (it was settled, or
//!    a gap's placeholder whose delete a crash lost).
//! 2. A settle of an offset the store has not reached is kept as a tombstone: the message
//!    is not stored when its copy arrives (the settle raced the copy).
//! 3. A batch starting past the store's next offset means one was lost (a store being
//!    dropped as it arrived): the copy cannot be complete, and the node takes itself out
//!    (`LeaveReplicaSet`, which drops the grow; the leader starts another later). The same
//!    holds for a member whose store could not take a message.
//!
//! # Why a store an earlier copy left here can be reused
//! A queue's live messages below any offset only ever shrink (a settle deletes for good, a
//! requeue keeps the offset, new messages get higher offsets), so a later copy names a
//! subset of what an earlier one stored in the same range: step 1's deletes make the store
//! match it. (A settle lost with a leader brings its message back on the other members; a
//! copy that already lacks it just lacks that duplicate.)

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

use rustc_hash::FxHashSet;

use super::{once_a_second, Queue, QueueCell};
use crate::meta::grow::CopiedMessage;
use crate::meta::state::{Command, Outcome};
use crate::meta::NodeId;

thread_local! {
    static COPY_FAILURE_LOGGED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// Most messages in one copy batch.
pub const COPY_BATCH_MESSAGES: usize = 1024;
/// Most message bytes (header and body) in one copy batch: one Raft entry of about 1 MiB.
pub const COPY_BATCH_BYTES: usize = 1 << 20;
/// A run of absent offsets up to this long is filled with placeholder records deleted at
/// once (24 bytes each); a longer one starts a new segment (`Shard::skip_to`).
const MAX_PLACEHOLDERS: u64 = 4096;
/// How long the final round waits for the enqueuer and for the store to catch up.
const HOLD_WAIT: Duration = Duration::from_secs(5);

/// The grow state of a replicated queue's copy (`Replication::grow`).
#[derive(Default)]
pub struct GrowState {
    /// The grow whose copier runs here (this node serves the queue), by id.
    pub copier: Option<u64>,
    /// Receiving end: offsets settled before the copy reached them (step 2).
    tombstones: std::collections::BTreeSet<u64>,
    /// This copy proposed to leave the replica set already (step 3).
    leaving: bool,
}

impl Queue {
    /// Receiving step 1: stores the copied messages of `[from, to)`.
    pub(super) fn apply_copy(&mut self, from: u64, to: u64, messages: Vec<CopiedMessage>) {
        let next = self.shard.next_offset();
        if from > next {
            self.leave_replica_set(&format!("copy batch from offset {from} after a lost one (the store reached {next})"));
            return;
        }
        let below = to.min(next);
        if from < below && !self.shard.is_empty() {
            let named: FxHashSet<u64> = messages.iter().map(|m| m.offset).filter(|o| *o < below).collect();
            let stray: Vec<u64> = (from..below).filter(|o| !named.contains(o) && self.shard.is_live(*o)).collect();
            self.delete_local(&stray);
        }
        for m in messages.into_iter().filter(|m| m.offset >= next) {
            if self.take_tombstone(m.offset) {
                continue;
            }
            let stored = self.fill_gap(m.offset).and_then(|_| self.shard.append_shared(m.flags, &m.header, &m.body));
            match stored {
                Ok(at) => {
                    self.ready.push(at, None);
                    self.dirty = true;
                }
                Err(e) => {
                    if e.is_disk_full() {
                        self.env.disk_full();
                    }
                    self.leave_replica_set(&format!("the store could not take a copied message: {e}"));
                    return;
                }
            }
        }
        if let Err(e) = self.fill_gap(to) {
            self.leave_replica_set(&format!("the store could not skip to offset {to}: {e}"));
        }
        let next = self.shard.next_offset();
        if let Some(r) = self.repl_mut() {
            r.grow.tombstones.retain(|o| *o >= next);
        }
    }

    /// Receiving step 1, at the join: the store's next offset becomes `tail`, where the
    /// queue's enqueues continue.
    pub(super) fn apply_joined(&mut self, tail: u64) {
        let next = self.shard.next_offset();
        if next > tail {
            return;
        }
        if let Err(e) = self.fill_gap(tail) {
            self.leave_replica_set(&format!("the store could not skip to offset {tail}: {e}"));
            return;
        }
        if let Some(r) = self.repl_mut() {
            r.grow.tombstones.clear();
        }
        tracing::info!(queue = %self.qref.key.name, vhost = %self.qref.key.vhost, tail, "this node joined the queue's replica set with a complete copy");
    }

    /// Receiving step 2: keeps the settled offsets the store has not reached as tombstones.
    pub(super) fn tombstone_unreached(&mut self, offsets: &[u64]) {
        let next = self.shard.next_offset();
        if let Some(r) = self.repl_mut() {
            r.grow.tombstones.extend(offsets.iter().copied().filter(|o| *o >= next));
        }
    }

    fn take_tombstone(&mut self, offset: u64) -> bool {
        self.repl_mut().is_some_and(|r| r.grow.tombstones.remove(&offset))
    }

    /// Moves the store's next offset to `upto` without messages in between: placeholder
    /// records deleted at once for a short run, a new segment for a long one.
    ///
    /// # Errors
    /// The store's append or segment roll error (nothing more is appended then).
    pub(super) fn fill_gap(&mut self, upto: u64) -> Result<(), ringmq_shards::StoreError> {
        let next = self.shard.next_offset();
        if upto <= next {
            return Ok(());
        }
        if upto - next > MAX_PLACEHOLDERS {
            return self.shard.skip_to(upto);
        }
        let empty = bytes::Bytes::new();
        let mut made = Vec::with_capacity((upto - next) as usize);
        let mut result = Ok(());
        for _ in next..upto {
            match self.shard.append_shared(0, &empty, &empty) {
                Ok(at) => made.push(at),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if let Err(e) = self.shard.delete_by_offsets(&made) {
            tracing::error!(queue = %self.qref.key.name, error = %e, "deleting placeholder records failed");
        }
        self.dirty = true;
        result
    }

    /// Receiving step 3: this copy cannot be complete; the node leaves the replica set (or
    /// the grow), once. Never for the node that serves the queue (the metadata refuses it).
    pub(super) fn leave_replica_set(&mut self, why: &str) {
        let (vhost, queue) = (self.qref.key.vhost.to_string(), self.qref.key.name.to_string());
        let meta = self.env.meta().clone();
        let Some(r) = self.repl_mut() else { return };
        if r.serving || r.grow.leaving {
            if once_a_second(&COPY_FAILURE_LOGGED) {
                tracing::error!(queue = %queue, vhost = %vhost, reason = why, "replicated message not stored on this member");
            }
            return;
        }
        r.grow.leaving = true;
        tracing::warn!(queue = %queue, vhost = %vhost, reason = why, "this node's copy of the queue is incomplete: it leaves the queue's replica set");
        let node = meta.node_id();
        let weak = self.me.clone();
        glommio::spawn_local(async move {
            if let Err(e) = meta.propose(Command::LeaveReplicaSet { vhost, queue, node }).await {
                tracing::warn!(error = %e, "leaving a replica set failed; retried at the copy's next failure");
                if let Some(cell) = weak.upgrade() {
                    if let Some(r) = cell.borrow_mut().repl_mut() {
                        r.grow.leaving = false;
                    }
                }
            }
        })
        .detach();
    }
}

/// Starts the server's copier for grow `id` to `node` unless it runs already.
pub fn start_copy(cell: &QueueCell, id: u64, node: NodeId) {
    let mut q = cell.borrow_mut();
    let Some(r) = q.repl_mut() else { return };
    if !r.serving || r.grow.copier == Some(id) {
        return;
    }
    r.grow.copier = Some(id);
    drop(q);
    let weak = Rc::downgrade(cell);
    glommio::spawn_local(async move {
        // A spawned task runs at once, up to its first wait: the caller's borrows end first.
        futures_lite::future::yield_now().await;
        copier(weak.clone(), id, node).await;
        if let Some(cell) = weak.upgrade() {
            if let Some(r) = cell.borrow_mut().repl_mut().filter(|r| r.grow.copier == Some(id)) {
                r.grow.copier = None;
            }
        }
    })
    .detach();
}

/// What one round of the copier read: the batch, the offset after it, and whether it
/// reached the store's next offset.
struct Batch {
    messages: Vec<CopiedMessage>,
    to: u64,
    complete: bool,
}

/// Reads live records from `from` below `tail`, up to a batch (all of them when `all`).
async fn read_batch(shard: &ringmq_shards::Shard, from: u64, tail: u64, all: bool) -> Result<Batch, ringmq_shards::StoreError> {
    let mut reader = shard.reader(from);
    let (mut messages, mut bytes) = (Vec::new(), 0usize);
    while let Some(rec) = reader.next().await? {
        if rec.offset >= tail {
            break;
        }
        bytes += rec.header.len() + rec.body.len();
        let offset = rec.offset;
        messages.push(CopiedMessage { offset, flags: rec.flags, header: rec.header, body: rec.body });
        if !all && (messages.len() >= COPY_BATCH_MESSAGES || bytes >= COPY_BATCH_BYTES) {
            return Ok(Batch { messages, to: offset + 1, complete: false });
        }
    }
    Ok(Batch { messages, to: tail, complete: true })
}

/// Server steps 1–3.
async fn copier(weak: Weak<RefCell<Queue>>, id: u64, node: NodeId) {
    let started = Instant::now();
    let mut rounds = 0u64;
    loop {
        let Some(cell) = weak.upgrade() else { return };
        let (meta, shard, key) = {
            let q = cell.borrow();
            let live = q.repl.as_ref().is_some_and(|r| r.serving && !r.moved_away) && !q.deleted;
            if !live {
                return;
            }
            (q.env.meta().clone(), q.shard.clone(), (q.qref.key.vhost.to_string(), q.qref.key.name.to_string()))
        };
        drop(cell);
        let Some(from) = meta.with_state(|s| s.growing.get(&key).filter(|g| g.id == id && g.node == node).map(|g| g.copied)) else {
            return;
        };
        if rounds == 0 {
            tracing::info!(queue = %key.1, vhost = %key.0, node, messages = shard.len(), "copying the queue to a node joining its replica set");
        }
        rounds += 1;
        let batch = match read_batch(&shard, from, shard.next_offset(), false).await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(queue = %key.1, error = %e, "reading the queue to copy it failed; retrying");
                glommio::timer::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let copy =
            |b: Batch| Command::CopyMessages { vhost: key.0.clone(), queue: key.1.clone(), id, from, to: b.to, messages: b.messages };
        if !batch.complete {
            match meta.propose(copy(batch)).await {
                Ok(Outcome::Copied { .. } | Outcome::CasRejected { .. }) => continue,
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(queue = %key.1, error = %e, "copy batch not committed; retrying");
                    glommio::timer::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            }
        }
        // Step 2: the rest and the join, in one entry, with no enqueue in flight.
        let Some(tail) = hold_enqueuer(&weak, &meta, &key).await else {
            release_enqueuer(&weak);
            glommio::timer::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let rest = read_batch(&shard, from, tail, true).await;
        let outcome = match rest {
            Ok(b) => {
                let join = Command::JoinReplicaSet { vhost: key.0.clone(), queue: key.1.clone(), id, tail };
                meta.propose_batch(vec![copy(b), join]).await
            }
            Err(e) => Err(crate::meta::MetaError::Raft(format!("reading the queue to copy it: {e}"))),
        };
        release_enqueuer(&weak);
        match outcome.as_deref() {
            Ok([Outcome::Copied { .. }, Outcome::Moved]) => {
                let ms = started.elapsed().as_millis() as u64;
                tracing::info!(queue = %key.1, vhost = %key.0, node, tail, rounds, ms, "queue replica set grown: the node joined with a complete copy");
                return;
            }
            Ok([_, Outcome::CasRejected { .. }]) | Ok([Outcome::CasRejected { .. }, _]) => {}
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(queue = %key.1, error = %e, "copy and join not committed; retrying");
                glommio::timer::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Holds the queue's enqueuer and waits until no enqueue is in flight and the store holds
/// every message the log gave the queue; returns that tail (the queue's next offset), or
/// `None` when that did not happen within [`HOLD_WAIT`] (the caller releases the hold).
async fn hold_enqueuer(weak: &Weak<RefCell<Queue>>, meta: &crate::meta::MetaHandle, key: &(String, String)) -> Option<u64> {
    let deadline = Instant::now() + HOLD_WAIT;
    loop {
        let cell = weak.upgrade()?;
        let (idle, next) = {
            let mut q = cell.borrow_mut();
            let next = q.shard.next_offset();
            let r = q.repl_mut()?;
            r.hold_enqueues(true);
            (!r.enqueue_in_flight(), next)
        };
        if idle {
            let tail = meta.with_state(|s| s.next_offsets.get(key).copied().unwrap_or(0));
            if next >= tail {
                return Some(tail);
            }
        }
        drop(cell);
        if Instant::now() >= deadline {
            return None;
        }
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
}

fn release_enqueuer(weak: &Weak<RefCell<Queue>>) {
    if let Some(cell) = weak.upgrade() {
        super::replica::resume_enqueues(&cell);
    }
}
