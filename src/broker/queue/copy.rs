//! Growing a replicated queue's replica set (`meta::grow`), on both ends: the queue's server
//! copies its live messages into the log ([`start_copy`]), and the node growing into the set
//! stores them ([`Queue::apply_copy`], [`Queue::apply_joined`]).
//!
//! # Steps at the server (`meta::grow` steps 2 and 3)
//! 1. From where the copy got (`Grow::copied`, read from the metadata each round), read up
//!    to [`COPY_BATCH_MESSAGES`] live records or [`COPY_BATCH_BYTES`] bytes below the store's
//!    next offset and propose them as one `CopyMessages`; one batch in flight at a time.
//!    While a batch is read and committed, the settles of offsets from its start on wait
//!    (`replica::hold_settles`), so a message the batch names is settled after it in the log:
//!    the receiving node then applies the copy before the settle, live and in a replay.
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
//!    is not stored when its copy arrives. (Server step 1 orders settles after the batches
//!    that name them; a batch proposed again after a leader change can still come later.
//!    Tombstones live in memory: after a crash, such a message comes back as a duplicate
//!    delivery, flagged, never as a loss.)
//! 3. A batch starting past the store's next offset means one was lost (a store being
//!    dropped as it arrived): the copy cannot be complete, and the node takes itself out
//!    (`LeaveReplicaSet`, which drops the grow; the leader starts another later). The same
//!    holds for a member whose store could not take a message, or that finds an `Enqueue`
//!    past its store's next offset; the member that serves the queue first moves it to
//!    another member in the same entry ([`step_aside`]): a copy with a gap never serves.
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
    /// Server: settles of offsets from here on wait for the copy batch in flight (step 1).
    pub(super) settles_held_from: Option<u64>,
    /// Server: the settles that wait.
    pub(super) held_settles: Vec<u64>,
    /// This copy proposed to leave the replica set already (step 3).
    leaving: bool,
}

/// What the receiving end needs of a store: the queue's shard ([`Queue`] through
/// [`QueueStore`]), or a model in the tests.
pub(super) trait CopyStore {
    /// The offset the next append gets.
    fn next_offset(&self) -> u64;
    /// True if `offset` holds a message not deleted.
    fn is_live(&self, offset: u64) -> bool;
    /// Appends `m` at the next offset (which the caller made `m.offset`).
    fn append(&mut self, m: &CopiedMessage) -> Result<(), ringmq_shards::StoreError>;
    /// Moves the next offset to `upto` with no message in between.
    fn fill_gap(&mut self, upto: u64) -> Result<(), ringmq_shards::StoreError>;
    /// Deletes these live offsets.
    fn delete(&mut self, offsets: &[u64]);
}

/// Receiving step 1: stores the copied messages of `[from, to)` (ascending offsets) in
/// `store`, skipping those `tombstones` names (step 2). Errors: why the copy cannot be
/// complete (step 3: a batch was lost, or the store failed).
pub(super) fn store_copy(
    store: &mut impl CopyStore,
    tombstones: &mut std::collections::BTreeSet<u64>,
    from: u64,
    to: u64,
    messages: &[CopiedMessage],
) -> Result<(), String> {
    let next = store.next_offset();
    if from > next {
        return Err(format!("copy batch from offset {from} after a lost one (the store reached {next})"));
    }
    let below = to.min(next);
    if from < below {
        let named: FxHashSet<u64> = messages.iter().map(|m| m.offset).filter(|o| *o < below).collect();
        let stray: Vec<u64> = (from..below).filter(|o| !named.contains(o) && store.is_live(*o)).collect();
        store.delete(&stray);
    }
    for m in messages.iter().filter(|m| m.offset >= next) {
        if tombstones.remove(&m.offset) {
            continue;
        }
        store.fill_gap(m.offset).and_then(|_| store.append(m)).map_err(|e| format!("the store could not take a copied message: {e}"))?;
    }
    store.fill_gap(to).map_err(|e| format!("the store could not skip to offset {to}: {e}"))?;
    let next = store.next_offset();
    tombstones.retain(|o| *o >= next);
    Ok(())
}

/// Receiving step 1, at the join (`tail`: the queue's next offset, where its enqueues
/// continue). The copy's last batch is in the join's entry and ends at `tail`, so a store
/// that took it is there already (or past it, in a replay); one short of it lost that batch
/// (refused while the store was being dropped, say) and is not complete: the error says so,
/// and the node leaves the set instead of joining with a gap. On success the caller drops
/// its tombstones (step 2: nothing is copied any more).
pub(super) fn store_joined(store: &impl CopyStore, tail: u64) -> Result<(), String> {
    let next = store.next_offset();
    if next < tail {
        return Err(format!("the copy's last batch never reached this store (it ends at offset {next}, the join at {tail})"));
    }
    Ok(())
}

/// Receiving step 2: of the offsets a settle deletes, keeps those `store` has not reached.
pub(super) fn note_settled(store: &impl CopyStore, tombstones: &mut std::collections::BTreeSet<u64>, offsets: &[u64]) {
    let next = store.next_offset();
    tombstones.extend(offsets.iter().copied().filter(|o| *o >= next));
}

/// A queue's shard as a [`CopyStore`]: appends also enter the ready set.
struct QueueStore<'a>(&'a mut Queue);

impl CopyStore for QueueStore<'_> {
    fn next_offset(&self) -> u64 {
        self.0.shard.next_offset()
    }
    fn is_live(&self, offset: u64) -> bool {
        self.0.shard.is_live(offset)
    }
    fn append(&mut self, m: &CopiedMessage) -> Result<(), ringmq_shards::StoreError> {
        let at = self.0.shard.append_shared(m.flags, &m.header, &m.body).inspect_err(|e| {
            if e.is_disk_full() {
                self.0.env.disk_full();
            }
        })?;
        self.0.ready.push_message(at, &m.header, m.body.len(), None);
        self.0.dirty = true;
        Ok(())
    }
    fn fill_gap(&mut self, upto: u64) -> Result<(), ringmq_shards::StoreError> {
        self.0.fill_gap(upto)
    }
    fn delete(&mut self, offsets: &[u64]) {
        self.0.delete_local(offsets);
    }
}

impl Queue {
    /// Receiving step 1 ([`store_copy`]) on this queue's store; leaves the replica set when
    /// the copy cannot be complete.
    pub(super) fn apply_copy(&mut self, from: u64, to: u64, messages: Vec<CopiedMessage>) {
        let mut tombstones = self.repl_mut().map(|r| std::mem::take(&mut r.grow.tombstones)).unwrap_or_default();
        let stored = store_copy(&mut QueueStore(self), &mut tombstones, from, to, &messages);
        if let Some(r) = self.repl_mut() {
            r.grow.tombstones = tombstones;
        }
        if let Err(why) = stored {
            self.leave_replica_set(&why);
        }
    }

    /// Receiving step 1, at the join ([`store_joined`]): the node is a member from here on,
    /// or leaves the set when its store lacks the copy's last batch.
    pub(super) fn apply_joined(&mut self, tail: u64) {
        if let Err(why) = store_joined(&QueueStore(self), tail) {
            self.leave_replica_set(&why);
            return;
        }
        if let Some(r) = self.repl_mut() {
            r.grow.tombstones.clear();
        }
        tracing::info!(queue = %self.qref.key.name, vhost = %self.qref.key.vhost, tail, "this node joined the queue's replica set with a complete copy");
    }

    /// Receiving step 2 ([`note_settled`]) on this queue's store.
    pub(super) fn tombstone_unreached(&mut self, offsets: &[u64]) {
        let Some(mut tombstones) = self.repl_mut().map(|r| std::mem::take(&mut r.grow.tombstones)) else { return };
        note_settled(&QueueStore(self), &mut tombstones, offsets);
        if let Some(r) = self.repl_mut() {
            r.grow.tombstones = tombstones;
        }
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
    /// the grow), once. The node that serves the queue steps aside first: in the same entry,
    /// the queue moves to another member of its set ([`step_aside`]), so a copy with a gap
    /// never keeps serving (it would confirm, through the log, what it cannot deliver).
    pub(super) fn leave_replica_set(&mut self, why: &str) {
        let (vhost, queue) = (self.qref.key.vhost.to_string(), self.qref.key.name.to_string());
        let meta = self.env.meta().clone();
        let node = meta.node_id();
        let Some(r) = self.repl_mut() else { return };
        let cmds = match (r.grow.leaving, r.serving) {
            (false, false) => Some(vec![Command::LeaveReplicaSet { vhost: vhost.clone(), queue: queue.clone(), node }]),
            (false, true) => step_aside(&meta, &vhost, &queue, node),
            (true, _) => None,
        };
        let Some(cmds) = cmds else {
            if once_a_second(&COPY_FAILURE_LOGGED) {
                tracing::error!(queue = %queue, vhost = %vhost, reason = why, "replicated message not stored on this member");
            }
            return;
        };
        r.grow.leaving = true;
        let serving = r.serving;
        tracing::warn!(queue = %queue, vhost = %vhost, reason = why, serving, "this node's copy of the queue is incomplete: it leaves the queue's replica set");
        let weak = self.me.clone();
        crate::core::spawn_soon(async move {
            let left = match meta.propose_batch(cmds).await {
                // A server that could not step aside (its move was refused) tries again.
                Ok(outcomes) => !serving || outcomes.first() == Some(&Outcome::Moved),
                Err(e) => {
                    tracing::warn!(error = %e, "leaving a replica set failed; retried at the copy's next failure");
                    false
                }
            };
            if !left {
                if let Some(cell) = weak.upgrade() {
                    if let Some(r) = cell.borrow_mut().repl_mut() {
                        r.grow.leaving = false;
                    }
                }
            }
        });
    }
}

/// Receiving step 3 at the node that serves the queue (`me`): the commands, for one entry,
/// that move the queue to another member of its replica set (chosen by the queue's name, as
/// failover step 1 chooses; if that one is down, step 1 moves it on, never back here) and
/// then take `me` out of the set, so no later failover picks this copy and a grow copies a
/// complete one here again. `None` when no other member stores the queue.
fn step_aside(meta: &crate::meta::MetaHandle, vhost: &str, queue: &str, me: NodeId) -> Option<Vec<Command>> {
    let topo = meta.topology();
    let def = topo.queue(vhost, queue)?;
    step_aside_commands(def, me, |n| meta.with_state(|s| s.boot_epochs.get(&n).copied().unwrap_or(0)))
}

/// [`step_aside`] for queue `def` as the metadata holds it, `epoch_of` a node's boot epoch.
fn step_aside_commands(def: &crate::meta::QueueDef, me: NodeId, epoch_of: impl Fn(NodeId) -> u64) -> Option<Vec<Command>> {
    let others: Vec<NodeId> = def.replicas.iter().copied().filter(|n| *n != me).collect();
    if def.owner_node != me || others.is_empty() {
        return None;
    }
    let (vhost, queue) = (def.vhost.clone(), def.name.clone());
    let to = others[crate::core::placement::owner_core(&vhost, &queue, others.len() as u32) as usize % others.len()];
    Some(vec![
        Command::MoveQueue { vhost: vhost.clone(), queue: queue.clone(), from: me, to, to_epoch: epoch_of(to) },
        Command::LeaveReplicaSet { vhost, queue, node: me },
    ])
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
    crate::core::spawn_soon(async move {
        copier(weak.clone(), id, node).await;
        hold_settles(&weak, None);
        if let Some(cell) = weak.upgrade() {
            if let Some(r) = cell.borrow_mut().repl_mut().filter(|r| r.grow.copier == Some(id)) {
                r.grow.copier = None;
            }
        }
    });
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
        // Settles of what this round may name wait until its batch is in the log.
        hold_settles(&weak, Some(from));
        let batch = match read_batch(&shard, from, shard.next_offset(), false).await {
            Ok(b) => b,
            Err(e) => {
                hold_settles(&weak, None);
                tracing::warn!(queue = %key.1, error = %e, "reading the queue to copy it failed; retrying");
                glommio::timer::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let copy =
            |b: Batch| Command::CopyMessages { vhost: key.0.clone(), queue: key.1.clone(), id, from, to: b.to, messages: b.messages };
        if !batch.complete {
            let outcome = meta.propose(copy(batch)).await;
            hold_settles(&weak, None);
            match outcome {
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
            hold_settles(&weak, None);
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
        hold_settles(&weak, None);
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
            let tail = meta.with_state(|s| s.tail(&key.0, &key.1));
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

fn hold_settles(weak: &Weak<RefCell<Queue>>, from: Option<u64>) {
    if let Some(cell) = weak.upgrade() {
        super::replica::hold_settles(&cell, from);
    }
}

fn release_enqueuer(weak: &Weak<RefCell<Queue>>) {
    if let Some(cell) = weak.upgrade() {
        super::replica::resume_enqueues(&cell);
    }
}

#[cfg(test)]
mod tests {
    //! The receiving end against a model: a server's history of settles racing its copy
    //! batches, enqueues before and after the join, then a crash of the receiving store and a
    //! replay of the log; the receiving store must end with exactly the server's messages.
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    /// A store in memory: every record ever appended (placeholders: an empty body), the live
    /// ones, and the next offset.
    #[derive(Clone, Default)]
    struct Model {
        next: u64,
        records: BTreeMap<u64, bytes::Bytes>,
        live: BTreeSet<u64>,
    }

    impl CopyStore for Model {
        fn next_offset(&self) -> u64 {
            self.next
        }
        fn is_live(&self, offset: u64) -> bool {
            self.live.contains(&offset)
        }
        fn append(&mut self, m: &CopiedMessage) -> Result<(), ringmq_shards::StoreError> {
            assert_eq!(m.offset, self.next, "appended out of order");
            self.records.insert(m.offset, m.body.clone());
            self.live.insert(m.offset);
            self.next += 1;
            Ok(())
        }
        fn fill_gap(&mut self, upto: u64) -> Result<(), ringmq_shards::StoreError> {
            // Short runs are placeholder records (they can come back after a crash), long
            // ones a skip (nothing there).
            while self.next < upto {
                if upto - self.next <= 8 {
                    self.records.insert(self.next, bytes::Bytes::new());
                }
                self.next += 1;
            }
            Ok(())
        }
        fn delete(&mut self, offsets: &[u64]) {
            for o in offsets {
                self.live.remove(o);
            }
        }
    }

    /// What the log hands the receiving node, in log order.
    #[derive(Clone, Debug)]
    enum Op {
        Settle(Vec<u64>),
        Copy { from: u64, to: u64, messages: Vec<CopiedMessage> },
        Joined(u64),
        Enqueue(CopiedMessage),
    }

    fn message(offset: u64) -> CopiedMessage {
        CopiedMessage { offset, flags: 1, header: bytes::Bytes::new(), body: bytes::Bytes::from(format!("m{offset}")) }
    }

    /// A server's history from `seed`: a backlog with settled holes, settles racing the copy
    /// batches (a batch is read, then messages it read are settled: their settles wait for
    /// the batch, server step 1), enqueues during the copy, the join, then more enqueues and
    /// settles. Returns the log and the server's final messages.
    fn history(seed: u64, backlog: u64, batch: usize) -> (Vec<Op>, BTreeSet<u64>) {
        let mut rng = seed | 1;
        let mut roll = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n.max(1)
        };
        let mut live: BTreeSet<u64> = (0..backlog).filter(|_| roll(4) != 0).collect();
        let mut tail = backlog;
        let mut log = Vec::new();
        let mut copied = 0;
        let settle_some = |live: &mut BTreeSet<u64>, roll: &mut dyn FnMut(u64) -> u64| {
            let mut done = Vec::new();
            for _ in 0..roll(4) {
                let Some(&o) = live.iter().nth(roll(live.len() as u64) as usize) else { break };
                live.remove(&o);
                done.push(o);
            }
            done
        };
        loop {
            // Read a batch; settles come in meanwhile: those below it go at once, the others
            // after it.
            let read: Vec<u64> = live.range(copied..tail).copied().take(batch).collect();
            let complete = read.len() < batch;
            let to = if complete { tail } else { read.last().map_or(tail, |o| o + 1) };
            let (held, now): (Vec<u64>, Vec<u64>) = settle_some(&mut live, &mut roll).into_iter().partition(|o| *o >= copied);
            if !now.is_empty() {
                log.push(Op::Settle(now));
            }
            if complete {
                // The final round: the enqueuer is held; the rest and the join in one entry.
                let rest: Vec<u64> =
                    live.range(copied..tail).copied().chain(held.iter().copied()).collect::<BTreeSet<u64>>().into_iter().collect();
                log.push(Op::Copy { from: copied, to: tail, messages: rest.into_iter().map(message).collect() });
                log.push(Op::Joined(tail));
                if !held.is_empty() {
                    log.push(Op::Settle(held));
                }
                break;
            }
            log.push(Op::Copy { from: copied, to, messages: read.into_iter().map(message).collect() });
            if !held.is_empty() {
                log.push(Op::Settle(held));
            }
            copied = to;
            for _ in 0..roll(3) {
                live.insert(tail);
                tail += 1;
            }
        }
        for _ in 0..roll(20) {
            live.insert(tail);
            log.push(Op::Enqueue(message(tail)));
            tail += 1;
            let done = settle_some(&mut live, &mut roll);
            if !done.is_empty() {
                log.push(Op::Settle(done));
            }
        }
        (log, live)
    }

    /// Applies `ops` to the receiving store as `replica.rs` does.
    fn apply(store: &mut Model, tombstones: &mut BTreeSet<u64>, ops: &[Op]) -> Result<(), String> {
        for op in ops {
            match op {
                Op::Settle(offsets) => {
                    note_settled(store, tombstones, offsets);
                    store.delete(offsets);
                }
                Op::Copy { from, to, messages } => store_copy(store, tombstones, *from, *to, messages)?,
                Op::Joined(tail) => {
                    store_joined(store, *tail)?;
                    tombstones.clear();
                }
                Op::Enqueue(m) if m.offset < store.next => {}
                Op::Enqueue(m) if m.offset == store.next => store.append(m).map_err(|e| e.to_string())?,
                Op::Enqueue(m) => return Err(format!("enqueue {} past the store's next offset {}", m.offset, store.next)),
            }
        }
        Ok(())
    }

    fn check(store: &Model, want: &BTreeSet<u64>) -> Result<(), TestCaseError> {
        prop_assert_eq!(&store.live, want);
        for o in want {
            prop_assert_eq!(store.records.get(o), Some(&message(*o).body));
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Live, and after a crash at any point with a replay from any earlier sync point,
        /// the receiving store holds exactly the server's messages: none settled, no
        /// placeholder, every confirmed one.
        #[test]
        fn the_receiving_store_ends_with_the_servers_messages(
            seed in any::<u64>(),
            backlog in 0u64..200,
            batch in 1usize..40,
            cut in any::<proptest::sample::Index>(),
            since in any::<proptest::sample::Index>(),
            lost in any::<u64>(),
        ) {
            let (log, want) = history(seed, backlog, batch);
            let mut live = Model::default();
            let mut tombstones = BTreeSet::new();
            prop_assert_eq!(apply(&mut live, &mut tombstones, &log), Ok(()));
            check(&live, &want)?;

            // A crash: the store as it was synced after op `k`, plus a prefix of what later ops
            // appended (deletes after the sync lost, some placeholders' among them), then the log
            // replayed from a compaction point `c <= k` (a compaction follows a sync).
            let k = cut.index(log.len() + 1);
            let c = since.index(k + 1);
            let (mut synced, mut t) = (Model::default(), BTreeSet::new());
            apply(&mut synced, &mut t, &log[..k]).unwrap();
            let mut after = synced.clone();
            apply(&mut after, &mut t, &log[k..]).unwrap();
            let mut crashed = synced.clone();
            crashed.next = synced.next + lost.rotate_left(17) % (after.next - synced.next + 1);
            for (o, body) in after.records.range(synced.next..crashed.next) {
                crashed.records.insert(*o, body.clone());
                if (lost >> (o % 64)) & 1 == 1 || after.live.contains(o) {
                    crashed.live.insert(*o);
                }
            }
            let mut tombstones = BTreeSet::new();
            prop_assert_eq!(apply(&mut crashed, &mut tombstones, &log[c..]), Ok(()));
            check(&crashed, &want)?;
        }
    }

    #[test]
    fn a_lost_batch_is_noticed_and_a_settle_before_its_copy_wins() {
        let mut store = Model::default();
        let mut tombstones = BTreeSet::new();
        // Offset 3 is settled before the batch that read it arrives.
        note_settled(&store, &mut tombstones, &[3]);
        let batch: Vec<CopiedMessage> = [1, 3, 4].into_iter().map(message).collect();
        assert_eq!(store_copy(&mut store, &mut tombstones, 0, 6, &batch), Ok(()));
        assert_eq!(store.live, BTreeSet::from([1, 4]));
        assert_eq!(store.next, 6);
        assert!(tombstones.is_empty());
        // A batch from 10 when the store reached 6: one was lost.
        assert!(store_copy(&mut store, &mut tombstones, 10, 12, &[message(10)]).is_err());
        // The last batch (in the join's entry) lost: the join finds the store short of it.
        assert!(store_joined(&store, 12).is_err(), "joined with a gap");
        assert_eq!(store_copy(&mut store, &mut tombstones, 6, 12, &[message(7), message(11)]), Ok(()));
        assert_eq!(store_joined(&store, 12), Ok(()));
        assert_eq!(store.live, BTreeSet::from([1, 4, 7, 11]));
    }

    /// Step 3 at the server: its entry moves the queue to another member and takes the server
    /// out of the set (a lone `LeaveReplicaSet` of the server is refused by the metadata).
    #[test]
    fn a_server_whose_copy_lacks_messages_steps_aside_to_another_member() {
        use crate::meta::state::{MetaState, Outcome};
        let mut st = MetaState::default();
        st.apply(&Command::DeclareVhost { name: "/".into() });
        let def = crate::meta::QueueDef { replicas: vec![1, 2, 3], ..crate::meta::state::tests::queue("q", true, None) };
        st.apply(&Command::DeclareQueue(def));
        let def = st.topology.queue("/", "q").unwrap().clone();
        assert_eq!(def.owner_node, 1);
        let leave = Command::LeaveReplicaSet { vhost: "/".into(), queue: "q".into(), node: 1 };
        assert_eq!(st.clone().apply(&leave), Outcome::Existed, "alone, the server's leave is refused");
        assert!(step_aside_commands(&def, 2, |_| 0).is_none(), "a member that does not serve just leaves");
        let cmds = step_aside_commands(&def, 1, |_| 5).expect("two other members");
        let outcomes: Vec<Outcome> = cmds.iter().map(|c| st.apply(c)).collect();
        assert_eq!(outcomes, vec![Outcome::Moved, Outcome::Moved]);
        let now = st.topology.queue("/", "q").unwrap();
        assert!(now.owner_node == 2 || now.owner_node == 3, "served by {}", now.owner_node);
        assert_eq!(now.owner_epoch, 5);
        assert!(!now.replicas.contains(&1), "still in the set: {:?}", now.replicas);
        let single = crate::meta::QueueDef { replicas: vec![1], ..def };
        assert!(step_aside_commands(&single, 1, |_| 0).is_none(), "no other copy to serve it");
    }
}
