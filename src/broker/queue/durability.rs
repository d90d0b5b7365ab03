//! Durability: everything on the ack path that waits for an fdatasync, and the proofs
//! that order it. Rule numbers are DESIGN.md's, listed in [`super::settle`].
//!
//! - Publisher confirms: [`group_commit`] syncs a batch of appends and only then sends
//!   their confirms (rule 9); a failed sync nacks them.
//! - Unacked-index flush: deliveries that got an index record wait in `unsynced` until
//!   [`IndexSynced`] says the record is durable ([`Queue::flush_unsynced`]; basic.get:
//!   [`reply_get`]) — rule 2's first half — unless the queue's delivery reservation covers
//!   them (`reserve.rs`, whose renewals sync the same way).
//! - Index-record release: an acked message's index record is deleted only with the
//!   [`MessagesSynced`] proof that the message shard's deletes are durable
//!   ([`release_index_records`]) — rule 4's second delete after the first.
//! - Cursor commit: [`cursor_cas`] consumes an [`IndexSynced`] — rule 2: the shared
//!   cursor never passes a delivery whose index record is not durable.
//!
//! The proofs can only be made by the sync functions here ([`IndexSynced::appends`],
//! [`IndexSynced::all`], [`MessagesSynced::all`]): their fields are private.

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::time::Instant;

use ringmq_shards::{Shard, StoreError, Synced};

use super::consumer;
use super::{Queue, QueueCell};
use crate::broker::{ClientEvent, GetReply, QueueError, QueueKey};
use crate::meta::state::{Command, Outcome};
use crate::observe::Stage;

/// Proof that a queue's unacked index is synced: every record appended before the sync is
/// durable. Made only by [`IndexSynced::appends`] and [`IndexSynced::all`].
#[derive(Debug)]
#[must_use]
pub struct IndexSynced(#[allow(dead_code)] Synced);

impl IndexSynced {
    /// Syncs the index's appends (its records; not its deletion bitmaps).
    ///
    /// # Errors
    /// The store's error; then nothing is proven.
    pub async fn appends(index: &Shard) -> Result<IndexSynced, StoreError> {
        index.sync_appends().await.map(IndexSynced)
    }

    /// Syncs the index fully (records and deletions).
    ///
    /// # Errors
    /// The store's error; then nothing is proven.
    pub async fn all(index: &Shard) -> Result<IndexSynced, StoreError> {
        index.sync().await.map(IndexSynced)
    }
}

/// Proof that a queue's message shard is fully synced: every append and every delete made
/// before the sync is durable. Made only by [`MessagesSynced::all`].
#[derive(Debug)]
#[must_use]
pub struct MessagesSynced(#[allow(dead_code)] Synced);

impl MessagesSynced {
    /// Syncs the message shard fully (appends and deletion bitmaps).
    ///
    /// # Errors
    /// The store's error; then nothing is proven.
    pub async fn all(shard: &Shard) -> Result<MessagesSynced, StoreError> {
        shard.sync().await.map(MessagesSynced)
    }
}

/// Rule 4's second delete: removes the index records of messages whose deletion
/// `_proof` shows durable. Records of a failed sync are never released this way: they stay
/// (a later open finds them stale, or the message redelivered), never the other way round.
pub fn release_index_records(index: &Shard, records: &[u64], _proof: &MessagesSynced) {
    if records.is_empty() {
        return;
    }
    if let Err(e) = index.delete_by_offsets(records) {
        tracing::error!(error = %e, "unacked index delete failed");
    }
}

/// Rule 2 across a redelivery: deletes the index records of earlier deliveries that records
/// covered by `_proof` replaced (a message delivered again keeps a durable record at every
/// moment). Without the proof they stay: a later open drops a record of a message no longer
/// live, and a live one comes back flagged, as delivered it was.
pub fn release_superseded(index: &Shard, records: &[u64], _proof: &IndexSynced) {
    if records.is_empty() {
        return;
    }
    if let Err(e) = index.delete_by_offsets(records) {
        tracing::error!(error = %e, "unacked index delete failed");
    }
}

/// Longest time deletes (acks) wait for a full sync while publisher confirms keep the
/// group commit busy with append-only syncs.
pub const FULL_SYNC_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);

/// Group commit for publisher confirms of persistent messages in a durable queue: one
/// `sync` covers every append made before it; confirms go out only after it returns
/// (DESIGN.md ack-path rule 9). While confirms wait, a round syncs appends only (one
/// fdatasync, not one more for the deletion bitmaps the acks dirtied); deletes get a full
/// sync every [`FULL_SYNC_INTERVAL`] (a timer when no confirm waits), and only then do the
/// index records of deleted messages go (`index_trash`).
pub(super) async fn group_commit(weak: Weak<RefCell<Queue>>) {
    loop {
        let Some(cell) = weak.upgrade() else { return };
        let (shard, batch, full, env) = {
            let mut q = cell.borrow_mut();
            if q.pending_confirms.is_empty() && !q.dirty {
                q.syncing = false;
                return;
            }
            let now = Instant::now();
            let due = q.last_full_sync + FULL_SYNC_INTERVAL;
            if q.pending_confirms.is_empty() && now < due {
                // Only deletes (acks) wait: they get their full sync when the interval is up,
                // not now, between two confirm rounds (measured: while a publisher waited for
                // its confirms, most rounds were full ones, each opening and syncing the
                // deletion bitmaps, and the next confirm round waited behind them).
                q.syncing = false;
                if !std::mem::replace(&mut q.full_sync_armed, true) {
                    let weak = weak.clone();
                    crate::core::spawn_soon(async move {
                        glommio::timer::sleep(due - now).await;
                        if let Some(cell) = weak.upgrade() {
                            cell.borrow_mut().full_sync_armed = false;
                            Queue::sync_if_dirty(&cell);
                        }
                    });
                }
                return;
            }
            let full = q.pending_confirms.is_empty() || now >= due;
            let trash = if full {
                q.dirty = false;
                q.last_full_sync = now;
                std::mem::take(&mut q.index_trash)
            } else {
                Vec::new()
            };
            let samples = std::mem::take(&mut q.stored_samples);
            (q.shard.clone(), (std::mem::take(&mut q.pending_confirms), samples, trash, q.index.clone()), full, q.env.clone())
        };
        drop(cell);
        let (batch, samples, trash, index) = batch;
        crate::observe::Stats::add(&env.stats().queue_syncs, 1);
        // A full sync proves the deletes durable too (rule 4's first delete); an
        // append-only one proves only the appends.
        let synced = if full { MessagesSynced::all(&shard).await.map(Some) } else { shard.sync_appends().await.map(|_| None) };
        let (ok, proof) = match synced {
            Ok(proof) => (true, proof),
            Err(e) => {
                // Nothing of this batch is known durable: its publishes are nacked. The shard
                // is read-only now (reads and acks go on); the core reopens the queue from
                // disk once the disk alarm is clear (`Queue::store_failure`).
                // Whatever the error says, the disk is worth a look at once.
                env.disk_full();
                tracing::error!(error = %e, confirms = batch.len(), "queue store sync failed; its publishes are nacked");
                crate::observe::Stats::add(&env.stats().store_refused, batch.len() as u64);
                (false, None)
            }
        };
        // Rule 4's second delete: the messages' deletions are durable now, their index
        // records may go. (Without the proof they stay: harmless, see the function.)
        if let (Some(index), Some(proof)) = (&index, &proof) {
            release_index_records(index, &trash, proof);
        }
        if let (true, Some(cell)) = (full, weak.upgrade()) {
            // Return counts (`delivery_limit.rs`, behaviour 5): durable with the full sync.
            if let Err(e) = super::delivery_limit::sync_return_counts(&cell).await {
                tracing::error!(error = %e, "unacked index sync failed; return counts may be lost at a restart");
            }
        }
        let now = Instant::now();
        let queue = weak.upgrade();
        let stored = batch.iter().filter_map(|(_, p)| *p).chain(samples).filter(|_| ok);
        for p in stored {
            match &queue {
                Some(q) => q.borrow().stage(Stage::PublishToStored, now.duration_since(p)),
                None => env.stats().stages.record(Stage::PublishToStored, now.duration_since(p)),
            }
        }
        for (c, _) in batch {
            c.answer(ok);
        }
    }
}

/// Shortest time between two cursor commits of one queue.
pub const CURSOR_COMMIT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(20);

/// Builds the cursor commit. Taking the index's [`IndexSynced`] proof is the type-level form of
/// rule 2: no cursor moves past a delivery whose index record is not yet durable.
pub fn cursor_cas(key: &QueueKey, expected: u64, new: u64, _index_synced: IndexSynced) -> Command {
    Command::CursorCas { vhost: key.vhost.to_string(), queue: key.name.to_string(), expected, new }
}

/// Commits the queue's cursor through the Raft group by compare-and-set, one proposal in
/// flight per queue (the metadata group batches proposals of all queues into one entry).
/// A rejected CAS re-reads the stored value and retries; nothing is locked or leased.
pub(super) async fn commit_cursor(weak: Weak<RefCell<Queue>>) {
    loop {
        // Let deliveries accumulate: the cursor is a recovery aid (the unacked index already
        // covers every outstanding delivery), so one commit per interval per queue is enough
        // and keeps Raft entries off the per-message path.
        glommio::timer::sleep(CURSOR_COMMIT_INTERVAL).await;
        let Some(cell) = weak.upgrade() else { return };
        let (shard, index, key, expected, target, env) = {
            let mut q = cell.borrow_mut();
            let Some(index) = q.index.clone() else {
                q.cursor.committing = false;
                return;
            };
            if q.deleted || q.cursor.target <= q.cursor.committed {
                q.cursor.committing = false;
                return;
            }
            (q.shard.clone(), index, q.qref.key.clone(), q.cursor.committed, q.cursor.target, q.env.clone())
        };
        // A replicated queue's messages are durable in the Raft log, not through its shard.
        let replicated = cell.borrow().replicated();
        drop(cell);
        crate::observe::Stats::add(&env.stats().queue_syncs, 2);
        // The messages below the cursor must be durable (else a crash would hand their offsets
        // to new messages, below the cursor); their deletes are the group commit's (10 ms).
        let messages = if replicated { Ok(()) } else { shard.sync_appends().await.map(drop) };
        let synced = match (messages, IndexSynced::all(&index).await) {
            (Ok(_), Ok(s)) => s,
            (Err(e), _) | (_, Err(e)) => {
                // The cursor stays where it is (a recovery aid: the index covers the rest).
                tracing::error!(queue = %key.name, error = %e, "sync before a cursor commit failed; cursor not moved");
                if let Some(cell) = weak.upgrade() {
                    cell.borrow_mut().cursor.committing = false;
                }
                return;
            }
        };
        let outcome = env.meta().propose(cursor_cas(&key, expected, target, synced)).await;
        let Some(cell) = weak.upgrade() else { return };
        let mut q = cell.borrow_mut();
        match outcome {
            Ok(Outcome::CasApplied) => q.cursor.committed = target,
            Ok(Outcome::CasRejected { current }) => {
                // Someone else moved it (or our view was stale): take the stored value.
                q.cursor.committed = current.unwrap_or(0);
                q.cursor.target = q.cursor.target.max(q.cursor.committed);
            }
            Ok(other) => {
                tracing::warn!(queue = %key.name, ?other, "unexpected cursor commit outcome");
                q.cursor.committing = false;
                return;
            }
            Err(e) => {
                tracing::error!(queue = %key.name, error = %e, "cursor commit failed");
                q.cursor.committing = false;
                return;
            }
        }
    }
}

/// What a basic.get's answer waits for: the unacked index to sync, and the records its new
/// record superseded, deleted after that sync.
pub(super) type GetSync = (Rc<Shard>, Vec<u64>);

/// Answers a basic.get, after syncing the unacked index when the delivery has a record
/// there (the same rule as [`Queue::flush_unsynced`]); then deletes the records `superseded`
/// by records appended before that sync.
pub(super) fn reply_get(r: GetReply, sync: Option<GetSync>, reply: crate::broker::Reply<Result<Option<GetReply>, QueueError>>) {
    match sync {
        None => drop(reply.send(Ok(Some(r)))),
        Some((index, superseded)) => {
            crate::core::spawn_soon(async move {
                match IndexSynced::appends(&index).await {
                    Ok(synced) => release_superseded(&index, &superseded, &synced),
                    // As in `Queue::flush_unsynced`: answered all the same.
                    Err(e) => tracing::error!(error = %e, "unacked index sync failed; basic.get answered without a durable index record"),
                }
                let _ = reply.send(Ok(Some(r)));
            });
        }
    }
}

impl Queue {
    /// Starts the group-commit task unless one is running.
    pub(super) fn start_sync(&mut self, cell: &QueueCell) {
        if !self.syncing {
            self.syncing = true;
            crate::core::spawn_soon(group_commit(Rc::downgrade(cell)));
        }
    }

    /// Flow control (`broker::credit`): while the store has more than
    /// [`ringmq_shards::MAX_PENDING_CHUNKS`] MiB appended and not yet written, or a
    /// replicated queue has more than [`super::replica::MAX_REPLICATION_BACKLOG`] bytes of
    /// publishes not yet committed, a publish's credit stays here until the writer (and the
    /// group) caught up, so its connection is not read and the bodies wait in the client, not
    /// in write buffers or Raft proposals (measured without it: 2 GiB of 1 MiB transient
    /// messages from one pika publisher held 4.5 GB of RSS in them). Otherwise the credit is
    /// given back at once (dropped). `credit` gives it: a publish of this core's connection
    /// takes it only when called (`Queue::publish_local`), so one the queue does not keep
    /// costs nothing.
    pub(super) fn hold_credit(
        &mut self,
        cell: &QueueCell,
        credit: impl FnOnce() -> Option<std::sync::Arc<crate::broker::credit::CreditHeld>>,
    ) {
        self.check_egress_on_publish();
        let backlogged = self.shard.write_backlogged() || self.repl.as_ref().is_some_and(|r| r.backlogged());
        if !backlogged && !self.egress.holding() {
            return;
        }
        let Some(credit) = credit().and_then(|c| self.egress.hold(c)) else { return };
        if !backlogged {
            return;
        }
        let first = self.held_credit.is_empty();
        self.held_credit.push(credit);
        if !first {
            return;
        }
        let (weak, shard) = (Rc::downgrade(cell), self.shard.clone());
        crate::core::spawn_soon(async move {
            loop {
                shard.throttle().await;
                let Some(cell) = weak.upgrade() else { return };
                let drained = cell.borrow_mut().repl.as_mut().filter(|r| r.backlogged()).map(|r| r.when_drained());
                let Some(drained) = drained else {
                    let held = std::mem::take(&mut cell.borrow_mut().held_credit);
                    drop(held);
                    return;
                };
                drop(cell);
                // Closed when the queue goes: the upgrade above then ends the task.
                let _ = drained.recv_async().await;
            }
        });
    }

    /// Syncs deletes (acks, purges) that no publish has synced yet; called periodically by
    /// the core, so an ack is durable within about a second (a lost ack only duplicates).
    pub fn sync_if_dirty(cell: &QueueCell) {
        let mut q = cell.borrow_mut();
        if q.dirty && q.qref.durable && !q.deleted {
            q.start_sync(cell);
        }
    }

    /// Starts the index flusher unless it runs: it syncs the unacked index and sends the
    /// deliveries that waited for it, round after round while more wait, so the dispatcher
    /// goes on delivering (into the next round) during an fdatasync instead of waiting.
    pub(super) fn flush_unsynced_soon(weak: &Weak<RefCell<Queue>>) {
        let Some(cell) = weak.upgrade() else { return };
        let mut q = cell.borrow_mut();
        if q.unsynced.is_empty() || q.index_flushing {
            return;
        }
        q.index_flushing = true;
        let weak = weak.clone();
        crate::core::spawn_soon(async move {
            for _ in 0..u32::MAX {
                Queue::flush_unsynced(&weak).await;
                let Some(cell) = weak.upgrade() else { return };
                let mut q = cell.borrow_mut();
                if q.unsynced.is_empty() || q.deleted {
                    q.index_flushing = false;
                    return;
                }
            }
        });
    }

    /// Sends the deliveries that waited for their unacked-index records, once the index is
    /// synced; without a sync when the delivery reservation (`reserve.rs`) has come to
    /// cover every one of them meanwhile (they only waited so as not to overtake earlier
    /// ones). A delivery whose consumer went away meanwhile is requeued.
    async fn flush_unsynced(weak: &Weak<RefCell<Queue>>) {
        let Some(cell) = weak.upgrade() else { return };
        let (batch, index, superseded) = {
            let mut q = cell.borrow_mut();
            if q.unsynced.is_empty() {
                return;
            }
            let below = q.reservation.below;
            let counting = q.delivery_limit.as_ref().is_some_and(|d| d.has_unsynced());
            let covered = !counting && q.unsynced.iter().all(|(_, d, _)| d.offset.0 < below || !q.index_of.contains_key(&d.offset.0));
            if covered {
                (std::mem::take(&mut q.unsynced), None, Vec::new())
            } else {
                crate::observe::Stats::add(&q.env.stats().queue_syncs, 1);
                (std::mem::take(&mut q.unsynced), q.index.clone(), std::mem::take(&mut q.index_superseded))
            }
        };
        drop(cell);
        if let Some(index) = index {
            match IndexSynced::appends(&index).await {
                // The replacements of the superseded records were appended before this sync.
                Ok(synced) => release_superseded(&index, &superseded, &synced),
                // The deliveries go out all the same (the messages themselves are stored):
                // after a crash they may come back without redelivered=true, a duplicate
                // and never a loss. The queue reopens its store (see `Queue::store_failure`).
                Err(e) => tracing::error!(error = %e, "unacked index sync failed; deliveries sent without a durable index record"),
            }
        }
        let Some(cell) = weak.upgrade() else { return };
        let mut q = cell.borrow_mut();
        let mut back = Vec::new();
        for (consumer, d, pending) in batch {
            let offset = d.offset.0;
            let weight = consumer::pending_weight(d.message.body.len());
            let still_held = q.held.get(offset).is_some_and(|o| o.consumer == Some(consumer));
            let sent = still_held && q.consumers.get_mut(consumer).is_some_and(|c| c.spec.tx.send(ClientEvent::Deliver(d)).is_ok());
            if !sent {
                pending.fetch_sub(weight, std::sync::atomic::Ordering::Relaxed);
                if still_held {
                    back.push(offset);
                }
            }
        }
        if !back.is_empty() {
            q.requeue_offsets(&back);
        }
    }
}
