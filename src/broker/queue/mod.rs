//! A queue on its owner core.
//!
//! A queue owns one shard (`ringmq-shards`) holding its messages, and in memory only
//! offsets: the ready list, the requeued set, the redelivered set and the outstanding
//! (delivered, unsettled) offsets with their holders. Memory per ready message is one
//! `u64` in a `VecDeque` (8 bytes) plus the shard's own per-record index.
//!
//! # Invariants
//! - An offset is in exactly one of: `ready`, `requeued`, `outstanding`, `paging`
//!   (claimed while its record is read from disk), or deleted from the shard.
//! - Every offset in `requeued` is lower than every offset in `ready`, so taking
//!   `requeued` first delivers a requeued message at its original position.
//! - A consumer's `in_flight` equals the outstanding offsets whose holder is that consumer.
//!
//! # Assumptions
//! Single-threaded per core: no `RefCell` borrow of a queue is held across an `.await`.

pub mod consumer;
pub mod index;
pub mod settle;

use std::cell::RefCell;
use std::collections::{BTreeSet, HashSet, VecDeque};

use rustc_hash::{FxHashMap, FxHashSet};
use std::rc::{Rc, Weak};
use std::time::Instant;

use bytes::Bytes;
use ringmq_shards::{Record, Shard, Synced};

use super::message::Message;
use super::router::{int_arg, string_arg, Route};
use super::{ClientEvent, ConfirmTo, ConsumerId, Delivery, GetReply, Holder, Mesh, QueueError, QueueKey, QueueOp, QueueRef};
use crate::meta::state::{Command, Outcome, QueueDef};
use crate::meta::MetaHandle;
use consumer::Consumers;
use index::{now_ms, IndexRecord};

thread_local! {
    static INDEX_FAILURE_LOGGED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    static REFUSAL_LOGGED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// True at most once a second per `slot` and thread: for log lines a full disk would
/// otherwise print once per message.
fn once_a_second(slot: &'static std::thread::LocalKey<std::cell::Cell<Option<Instant>>>) -> bool {
    slot.with(|c| {
        let due = c.get().is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(1));
        if due {
            c.set(Some(Instant::now()));
        }
        due
    })
}

/// Default delivery acknowledgement timeout: 30 minutes (RabbitMQ's consumer_timeout), in ms.
pub const DEFAULT_CONSUMER_TIMEOUT_MS: u64 = 30 * 60 * 1000;

/// What a queue needs from its core besides its own state.
pub trait QueueEnv: Mesh {
    /// Routes a message (for dead-lettering) with the core's current routing table.
    fn route(&self, vhost: &str, exchange: &str, routing_key: &str, headers: Option<&amq_protocol::types::FieldTable>) -> Route;
    /// The queue has become unused and is auto-delete: remove it.
    fn auto_delete(&self, key: &QueueKey);
    /// The metadata group (cursor commits, leader check, node id and boot epoch).
    fn meta(&self) -> &MetaHandle;
    /// This core's counters and latency histograms.
    fn stats(&self) -> &crate::observe::Stats;
    /// A store reported a full disk (the disk alarm is checked at once).
    fn disk_full(&self);
}

/// Who holds an outstanding delivery.
#[derive(Debug)]
pub struct Outstanding {
    /// The consumer it was delivered to (None for basic.get).
    pub consumer: Option<ConsumerId>,
    /// Where the holder lives.
    pub holder: Holder,
    /// When it was delivered.
    pub since: Instant,
    /// The holder channel's shared prefetch window (consumer deliveries only).
    pub credit: Option<std::sync::Arc<super::ChannelCredit>>,
}

/// A durable queue's shared cursor: every offset below `committed` has been delivered at
/// least once, and the Raft metadata says so (committed by compare-and-set).
#[derive(Debug, Default)]
pub struct Cursor {
    /// Value stored in the metadata.
    pub committed: u64,
    /// Highest delivered offset + 1 (what the next commit proposes).
    pub target: u64,
    /// A commit task is running.
    pub committing: bool,
}

/// What a queue learns from its store when it opens.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The committed cursor from the metadata.
    pub cursor: u64,
    /// Unacked-index records left by earlier runs: (index offset, record).
    pub held: Vec<(u64, IndexRecord)>,
}

/// A queue's state. See the module doc.
pub struct Queue {
    /// Routable reference (key, owner core, durability).
    pub qref: QueueRef,
    /// Declaration.
    pub def: QueueDef,
    /// The message store.
    pub shard: Rc<Shard>,
    /// The unacked index (durable queues only).
    pub index: Option<Rc<Shard>>,
    /// The shared cursor (durable queues only; see [`Cursor`]).
    pub cursor: Cursor,
    me: Weak<RefCell<Queue>>,
    ready: VecDeque<u64>,
    /// (offset, when stored) of the sampled messages (1 in 16) among `ready`, in offset
    /// order, for the stored→delivered histogram; entries behind the ready list's head
    /// (a purge, an unclaim) are dropped when passed.
    ready_at: VecDeque<(u64, Instant)>,
    requeued: BTreeSet<u64>,
    redelivered: FxHashSet<u64>,
    outstanding: FxHashMap<u64, Outstanding>,
    paging: usize,
    /// Attached consumers.
    pub consumers: Consumers,
    had_consumer: bool,
    pending_confirms: Vec<(ConfirmTo, Option<Instant>)>,
    syncing: bool,
    /// Message offset → its live unacked-index record. A record outlives a requeue (the
    /// message was delivered: after a crash it must come back redelivered=true).
    index_of: FxHashMap<u64, u64>,
    /// Index records of messages whose deletion (ack, drop, dead-letter, purge) is not yet
    /// synced in the message shard. They are deleted only after the next message-shard
    /// sync, so an index record never disappears before its message does (else a crash in
    /// between would redeliver a delivered message unflagged).
    index_trash: Vec<u64>,
    /// When the last full sync (appends and deletes) of the message shard started.
    last_full_sync: Instant,
    /// The index flusher task runs (see [`Queue::flush_unsynced_soon`]).
    index_flushing: bool,
    /// Deliveries waiting for their unacked-index records to be synced.
    unsynced: Vec<(ConsumerId, Delivery, std::sync::Arc<std::sync::atomic::AtomicUsize>)>,
    /// Records read ahead from disk, by offset (see [`read_ahead`]); bounded by
    /// [`READ_AHEAD_BYTES`] per read, dropped when taken or purged.
    paged: std::collections::BTreeMap<u64, Record>,
    /// Appends or deletes not yet covered by a sync.
    dirty: bool,
    wake: flume::Sender<()>,
    /// Set once the queue is deleted; tasks holding a reference stop.
    pub deleted: bool,
    /// Delivery acknowledgement timeout in ms (x-consumer-timeout or the default).
    pub consumer_timeout_ms: u64,
    /// x-dead-letter-exchange.
    pub dead_letter_exchange: Option<String>,
    /// x-dead-letter-routing-key.
    pub dead_letter_routing_key: Option<String>,
    env: Rc<dyn QueueEnv>,
}

/// Shared handle to a queue on its owner core.
pub type QueueCell = Rc<RefCell<Queue>>;

/// What the dispatcher does next.
enum Step {
    Idle,
    /// Messages wait, and a consumer's connection is behind on writing (see
    /// [`consumer::MAX_PENDING_EVENTS`]): try again shortly.
    Backlogged,
    Sent,
    Read {
        offset: u64,
        consumer: ConsumerId,
    },
}

impl Queue {
    /// Builds a queue around its opened shards and starts its dispatcher task.
    ///
    /// Ready messages are the shard's live records, in offset order. Recovery (DESIGN.md
    /// rule 7): a live message below the committed cursor, or named by an unacked-index
    /// record of an earlier run, was delivered before and comes back redelivered=true. On
    /// the Raft leader, the scanner requeues those deliveries (their boot epoch is dead):
    /// the messages are ready again and keep their records until settled.
    pub fn start(
        def: QueueDef,
        qref: QueueRef,
        shard: Shard,
        index: Option<Shard>,
        recovered: Recovered,
        default_timeout_ms: u64,
        env: Rc<dyn QueueEnv>,
    ) -> QueueCell {
        let (wake, wake_rx) = flume::bounded(1);
        let ready: VecDeque<u64> = shard.live_offsets().into_iter().collect();
        let ready_at = VecDeque::new();
        let mut redelivered: FxHashSet<u64> = ready.iter().copied().take_while(|o| *o < recovered.cursor).collect();
        redelivered.extend(recovered.held.iter().map(|(_, r)| r.offset).filter(|o| shard.is_live(*o)));
        // The scanner (Raft leader only): records of a dead boot epoch are requeued at once —
        // their messages are ready again, flagged; the records stay as theirs until the
        // messages are settled (a record of a message no longer live goes now).
        let mut index_of = FxHashMap::default();
        let mut stale = Vec::new();
        if index.is_some() && env.meta().is_leader() {
            for (i, r) in &recovered.held {
                if shard.is_live(r.offset) && !index_of.contains_key(&r.offset) {
                    index_of.insert(r.offset, *i);
                } else {
                    stale.push(*i);
                }
            }
            if !recovered.held.is_empty() {
                tracing::info!(queue = %qref.key.name, records = recovered.held.len(), "requeued deliveries of a dead boot epoch");
            }
        }
        if let (Some(index), false) = (&index, stale.is_empty()) {
            if let Err(e) = index.delete_by_offsets(&stale) {
                tracing::error!(error = %e, "unacked index delete failed");
            }
        }
        let consumer_timeout_ms =
            int_arg(&def.arguments, "x-consumer-timeout").filter(|v| *v > 0).map(|v| v as u64).unwrap_or(default_timeout_ms);
        let dead_letter_exchange = string_arg(&def.arguments, "x-dead-letter-exchange").map(str::to_owned);
        let dead_letter_routing_key = string_arg(&def.arguments, "x-dead-letter-routing-key").map(str::to_owned);
        let q = Rc::new_cyclic(|me| {
            RefCell::new(Queue {
                qref,
                def,
                shard: Rc::new(shard),
                index: index.map(Rc::new),
                cursor: Cursor { committed: recovered.cursor, target: recovered.cursor, committing: false },
                me: me.clone(),
                ready,
                ready_at,
                requeued: BTreeSet::new(),
                redelivered,
                outstanding: FxHashMap::default(),
                paging: 0,
                consumers: Consumers::default(),
                had_consumer: false,
                pending_confirms: Vec::new(),
                syncing: false,
                index_flushing: false,
                unsynced: Vec::new(),
                index_of,
                index_trash: Vec::new(),
                last_full_sync: Instant::now(),
                paged: Default::default(),
                dirty: false,
                wake,
                deleted: false,
                consumer_timeout_ms,
                dead_letter_exchange,
                dead_letter_routing_key,
                env,
            })
        });
        let weak = Rc::downgrade(&q);
        glommio::spawn_local(dispatcher(weak, wake_rx)).detach();
        q
    }

    /// Messages ready for delivery.
    pub fn message_count(&self) -> u32 {
        (self.ready.len() + self.requeued.len()) as u32
    }

    /// Outstanding (delivered, unsettled) messages.
    pub fn unacked_count(&self) -> usize {
        self.outstanding.len()
    }

    fn wake(&self) {
        let _ = self.wake.try_send(());
    }

    fn take_next(&mut self) -> Option<u64> {
        if let Some(o) = self.requeued.pop_first() {
            return Some(o);
        }
        let o = self.ready.pop_front()?;
        while let Some(&(sampled, at)) = self.ready_at.front() {
            if sampled > o {
                break;
            }
            self.ready_at.pop_front();
            if sampled == o {
                self.env.stats().stored_to_delivered.record(at.elapsed());
            }
        }
        Some(o)
    }

    /// Puts a claimed but undelivered offset back at its original position (not redelivered).
    fn unclaim(&mut self, offset: u64) {
        if self.ready.front().is_none_or(|f| offset < *f) {
            self.requeued.insert(offset);
        } else {
            self.ready.push_front(offset);
        }
    }

    /// Executes one operation. Called by the owner core in arrival order.
    pub fn handle(cell: &QueueCell, op: QueueOp) {
        let mut q = cell.borrow_mut();
        match op {
            QueueOp::Publish { message, confirm, published } => q.publish(cell, message, confirm, published),
            QueueOp::Get { no_ack, holder, reply } => {
                drop(q);
                basic_get(cell, no_ack, holder, reply);
            }
            QueueOp::Consume { consumer, reply } => {
                if q.consumers.has_exclusive() || (consumer.exclusive && !q.consumers.is_empty()) {
                    let _ = reply.send(Err(QueueError::AccessRefused(format!(
                        "queue '{}' in vhost '{}' in exclusive use",
                        q.qref.key.name, q.qref.key.vhost
                    ))));
                    return;
                }
                if consumer.send_consume_ok {
                    let _ = consumer.tx.send(ClientEvent::ConsumeOk { channel: consumer.channel, consumer_tag: consumer.tag.clone() });
                }
                q.had_consumer = true;
                q.consumers.add(consumer);
                let _ = reply.send(Ok(()));
                q.wake();
            }
            QueueOp::Cancel { consumer, send_ok } => {
                if let Some(c) = q.consumers.remove(consumer) {
                    if send_ok {
                        let _ = c.spec.tx.send(ClientEvent::CancelOk { channel: c.spec.channel, consumer_tag: c.spec.tag.clone() });
                    }
                }
                q.maybe_auto_delete();
            }
            QueueOp::Settle { chan_uid, mut ack, mut requeue, mut reject } => {
                // Rule 1 at the queue: a channel settles only what it holds.
                for offs in [&mut ack, &mut requeue, &mut reject] {
                    offs.retain(|o| q.outstanding.get(o).is_some_and(|h| h.holder.chan_uid == chan_uid));
                }
                q.ack(&ack);
                q.requeue(&requeue);
                drop(q);
                settle::reject(cell, reject);
            }
            QueueOp::ChannelClosed { chan_uid } => {
                q.consumers.remove_channel(chan_uid);
                let mut held: Vec<u64> = q.outstanding.iter().filter(|(_, o)| o.holder.chan_uid == chan_uid).map(|(off, _)| *off).collect();
                held.sort_unstable();
                q.requeue(&held);
                q.maybe_auto_delete();
            }
            QueueOp::Redeliver { offsets } => q.redeliver(&offsets),
            QueueOp::Wake => q.wake(),
            QueueOp::Stats { reply } => {
                let _ = reply.send(Ok((q.message_count(), q.consumers.len() as u32)));
            }
            QueueOp::Purge { reply } => {
                let n = q.purge();
                let _ = reply.send(Ok(n));
            }
            QueueOp::Delete { reply, .. } => {
                // Deletion is carried out by the core (it owns the registry); reaching here
                // means the core already tore the queue down.
                let _ = reply.send(Err(QueueError::NotFound(format!("no queue '{}'", q.qref.key.name))));
            }
        }
    }

    fn publish(&mut self, cell: &QueueCell, message: Message, confirm: Option<ConfirmTo>, published: Option<Instant>) {
        let needs_sync = self.qref.durable && message.persistent();
        match self.shard.append_shared(message.flags, &message.header, &message.body) {
            Ok(offset) => {
                let now = published.map(|_| Instant::now());
                self.ready.push_back(offset);
                if let Some(n) = now {
                    self.ready_at.push_back((offset, n));
                }
                if needs_sync {
                    if let Some(c) = confirm {
                        self.pending_confirms.push((c, published));
                    } else if let (Some(p), Some(n)) = (published, now) {
                        self.env.stats().publish_to_stored.record(n.duration_since(p));
                    }
                    self.dirty = true;
                    self.start_sync(cell);
                } else {
                    if let (Some(p), Some(n)) = (published, now) {
                        self.env.stats().publish_to_stored.record(n.duration_since(p));
                    }
                    if let Some(c) = confirm {
                        let _ = c.tx.send(ClientEvent::Stored { channel: c.channel, seq: c.seq, ok: true });
                    }
                }
                self.wake();
            }
            Err(e) => {
                if e.is_disk_full() {
                    self.env.disk_full();
                }
                if once_a_second(&REFUSAL_LOGGED) {
                    tracing::warn!(queue = %self.qref.key.name, error = %e, "publish not stored (nacked)");
                }
                crate::observe::Stats::add(&self.env.stats().store_refused, 1);
                if let Some(c) = confirm {
                    let _ = c.tx.send(ClientEvent::Stored { channel: c.channel, seq: c.seq, ok: false });
                }
            }
        }
    }

    /// The message at `offset` is being deleted: its index record goes after the next
    /// message-shard sync (see `index_trash`).
    pub(super) fn trash_index(&mut self, offset: u64) {
        if let Some(i) = self.index_of.remove(&offset) {
            self.index_trash.push(i);
        }
    }

    /// Starts the group-commit task unless one is running.
    fn start_sync(&mut self, cell: &QueueCell) {
        if !self.syncing {
            self.syncing = true;
            glommio::spawn_local(group_commit(Rc::downgrade(cell))).detach();
        }
    }

    /// Syncs deletes (acks, purges) that no publish has synced yet; called periodically by
    /// the core, so an ack is durable within about a second (a lost ack only duplicates).
    pub fn sync_if_dirty(cell: &QueueCell) {
        let mut q = cell.borrow_mut();
        if q.dirty && q.qref.durable && !q.deleted {
            q.start_sync(cell);
        }
    }

    fn purge(&mut self) -> u32 {
        let n = self.message_count();
        self.paged.clear();
        let mut offs: Vec<u64> = self.ready.drain(..).collect();
        self.ready_at.clear();
        offs.extend(std::mem::take(&mut self.requeued));
        for &o in &offs {
            self.redelivered.remove(&o);
            self.trash_index(o);
        }
        self.dirty = true;
        if let Err(e) = self.shard.delete_by_offsets(&offs) {
            tracing::error!(queue = %self.qref.key.name, error = %e, "purge delete failed");
        }
        n
    }

    /// Whether the queue may be deleted under queue.delete's conditions.
    ///
    /// # Errors
    /// 406 PRECONDITION_FAILED when `if_unused` and it has consumers, or `if_empty` and it
    /// has ready messages (spec 1.7.2.9).
    pub fn check_delete(&self, if_unused: bool, if_empty: bool) -> Result<u32, QueueError> {
        if if_unused && !self.consumers.is_empty() {
            return Err(QueueError::PreconditionFailed(format!(
                "queue '{}' in vhost '{}' in use",
                self.qref.key.name, self.qref.key.vhost
            )));
        }
        if if_empty && self.message_count() > 0 {
            return Err(QueueError::PreconditionFailed(format!(
                "queue '{}' in vhost '{}' not empty",
                self.qref.key.name, self.qref.key.vhost
            )));
        }
        Ok(self.message_count())
    }

    /// Marks the queue deleted and tells every consumer (basic.cancel for clients that
    /// announced consumer_cancel_notify). Returns the shards (messages, unacked index) for
    /// the caller to destroy.
    pub fn tear_down(&mut self) -> (Rc<Shard>, Option<Rc<Shard>>) {
        // RabbitMQ confirms what was routed to a queue deleted meanwhile.
        self.out_of_service(true)
    }

    /// Marks the queue deleted, cancels its consumers, answers waiting confirms with `ok`,
    /// wakes its tasks (they stop); returns its shards.
    fn out_of_service(&mut self, confirms_ok: bool) -> (Rc<Shard>, Option<Rc<Shard>>) {
        self.deleted = true;
        for c in self.consumers.drain() {
            if c.spec.cancel_notify {
                let _ = c.spec.tx.send(ClientEvent::Cancelled { channel: c.spec.channel, consumer_tag: c.spec.tag.clone() });
            }
        }
        for (c, _) in self.pending_confirms.drain(..) {
            let _ = c.tx.send(ClientEvent::Stored { channel: c.channel, seq: c.seq, ok: confirms_ok });
        }
        self.wake();
        (self.shard.clone(), self.index.clone())
    }

    /// Why this queue's store stopped taking writes, if it did (a write or fdatasync of its
    /// message shard or unacked index failed, e.g. EIO or a full disk that fallocate did
    /// not see coming). Its publishes are nacked meanwhile; reads, deliveries and acks go
    /// on. The core retires such a queue and reopens it from disk once the disk alarm is
    /// clear ([`Queue::retire`]).
    pub fn store_failure(&self) -> Option<String> {
        self.shard.failure().or_else(|| self.index.as_ref().and_then(|i| i.failure()))
    }

    /// Takes a queue whose store failed out of service, to be reopened from disk: consumers
    /// are cancelled (basic.cancel to clients that announced consumer_cancel_notify), waiting
    /// confirms are nacked, tasks stop. What the store synced comes back at the reopen; the
    /// deliveries outstanding now come back redelivered (rules 5 and 7). Returns the shards
    /// for the caller to close.
    pub fn retire(&mut self) -> (Rc<Shard>, Option<Rc<Shard>>) {
        self.out_of_service(false)
    }

    fn maybe_auto_delete(&self) {
        if self.def.auto_delete && self.had_consumer && self.consumers.is_empty() && !self.deleted {
            self.env.auto_delete(&self.qref.key);
        }
    }

    /// Holders whose oldest delivery exceeds the acknowledgement timeout, at `now`.
    /// Each (connection's event channel, channel) appears once.
    pub fn timed_out_holders(&self, now: Instant) -> Vec<Holder> {
        let limit = std::time::Duration::from_millis(self.consumer_timeout_ms);
        let mut seen: HashSet<u64> = HashSet::new();
        let mut out = Vec::new();
        for o in self.outstanding.values() {
            if now.duration_since(o.since) > limit && seen.insert(o.holder.chan_uid) {
                out.push(o.holder.clone());
            }
        }
        out
    }

    /// One dispatcher step: deliver one cached message, or claim one that must be read.
    fn step(&mut self) -> Step {
        if self.deleted || self.consumers.is_empty() || self.message_count() == 0 {
            return Step::Idle;
        }
        let Some(consumer) = self.consumers.next_with_credit().map(|c| c.spec.id) else {
            return if self.consumers.any_backlogged() { Step::Backlogged } else { Step::Idle };
        };
        let offset = self.take_next().expect("message_count > 0");
        match self.paged.remove(&offset).or_else(|| self.shard.read_cached(offset)) {
            Some(rec) => {
                self.deliver(consumer, rec);
                Step::Sent
            }
            None => {
                self.paging += 1;
                Step::Read { offset, consumer }
            }
        }
    }

    /// Hands `rec` to `consumer`; on a vanished consumer the offset goes back.
    ///
    /// A tracked delivery of a persistent message in a durable queue is recorded in the
    /// unacked index first and leaves the core only once that record is synced
    /// ([`Queue::flush_unsynced`]): after any crash, a message that reached a client is
    /// known to have been delivered (redelivered=true), never silently handed out again.
    fn deliver(&mut self, consumer: ConsumerId, rec: Record) {
        let offset = rec.offset;
        let flags = rec.flags;
        let redelivered = self.redelivered.contains(&offset);
        let qref = self.qref.clone();
        let Some(c) = self.consumers.get_mut(consumer) else {
            self.unclaim(offset);
            return;
        };
        let track = !c.spec.no_ack;
        let d = Delivery {
            channel: c.spec.channel,
            chan_uid: c.spec.chan_uid,
            consumer_tag: c.spec.tag.clone(),
            queue: qref,
            offset,
            redelivered,
            message: Message { header: rec.header, body: rec.body, flags },
            track,
        };
        let tx = c.spec.tx.clone();
        let pending = c.spec.pending_bytes.clone();
        let weight = consumer::pending_weight(d.message.body.len());
        pending.fetch_add(weight, std::sync::atomic::Ordering::Relaxed);
        let mut index_offset = None;
        if track {
            c.in_flight += 1;
            c.spec.channel_credit.take();
            let credit = Some(c.spec.channel_credit.clone());
            let holder = Holder { conn: c.spec.conn, channel: c.spec.channel, chan_uid: c.spec.chan_uid, tx: tx.clone() };
            index_offset = self.index_delivery(offset, flags, &holder);
            self.outstanding.insert(offset, Outstanding { consumer: Some(consumer), holder, since: Instant::now(), credit });
        }
        self.passed(offset);
        if index_offset.is_some() {
            self.unsynced.push((consumer, d, pending));
            return;
        }
        if tx.send(ClientEvent::Deliver(d)).is_err() {
            pending.fetch_sub(weight, std::sync::atomic::Ordering::Relaxed);
            // The connection is gone; its close will settle the rest.
            self.consumers.remove(consumer);
            if self.settle_one(offset).is_some() || !track {
                self.unclaim(offset);
            }
            return;
        }
        if !track {
            self.forget(offset);
        }
    }

    /// Starts the index flusher unless it runs: it syncs the unacked index and sends the
    /// deliveries that waited for it, round after round while more wait, so the dispatcher
    /// goes on delivering (into the next round) during an fdatasync instead of waiting.
    fn flush_unsynced_soon(weak: &Weak<RefCell<Queue>>) {
        let Some(cell) = weak.upgrade() else { return };
        let mut q = cell.borrow_mut();
        if q.unsynced.is_empty() || q.index_flushing {
            return;
        }
        q.index_flushing = true;
        let weak = weak.clone();
        glommio::spawn_local(async move {
            // glommio may run a spawned task at once: let the spawner release its borrow.
            futures_lite::future::yield_now().await;
            for _ in 0..u32::MAX {
                Queue::flush_unsynced(&weak).await;
                let Some(cell) = weak.upgrade() else { return };
                let mut q = cell.borrow_mut();
                if q.unsynced.is_empty() || q.deleted {
                    q.index_flushing = false;
                    return;
                }
            }
        })
        .detach();
    }

    /// Sends the deliveries that waited for their unacked-index records, once the index is
    /// synced. A delivery whose consumer went away meanwhile is requeued.
    async fn flush_unsynced(weak: &Weak<RefCell<Queue>>) {
        let Some(cell) = weak.upgrade() else { return };
        let (batch, index) = {
            let mut q = cell.borrow_mut();
            if q.unsynced.is_empty() {
                return;
            }
            crate::observe::Stats::add(&q.env.stats().queue_syncs, 1);
            (std::mem::take(&mut q.unsynced), q.index.clone())
        };
        drop(cell);
        if let Some(index) = index {
            if let Err(e) = index.sync_appends().await {
                // The deliveries go out all the same (the messages themselves are stored):
                // after a crash they may come back without redelivered=true, a duplicate
                // and never a loss. The queue reopens its store (see `Queue::store_failure`).
                tracing::error!(error = %e, "unacked index sync failed; deliveries sent without a durable index record");
            }
        }
        let Some(cell) = weak.upgrade() else { return };
        let mut q = cell.borrow_mut();
        let mut back = Vec::new();
        for (consumer, d, pending) in batch {
            let offset = d.offset;
            let weight = consumer::pending_weight(d.message.body.len());
            let still_held = q.outstanding.get(&offset).is_some_and(|o| o.consumer == Some(consumer));
            let sent = still_held && q.consumers.get_mut(consumer).is_some_and(|c| c.spec.tx.send(ClientEvent::Deliver(d)).is_ok());
            if !sent {
                pending.fetch_sub(weight, std::sync::atomic::Ordering::Relaxed);
                if still_held {
                    back.push(offset);
                }
            }
        }
        if !back.is_empty() {
            q.requeue(&back);
        }
    }

    /// Rule 2, first half: a tracked delivery of a persistent message in a durable queue
    /// gets an unacked-index record (appended now, synced before the cursor passes it).
    fn index_delivery(&mut self, offset: u64, flags: u8, holder: &Holder) -> Option<u64> {
        let index = self.index.clone()?;
        if flags & super::message::FLAG_PERSISTENT == 0 {
            return None;
        }
        let meta = self.env.meta();
        let rec = IndexRecord {
            node: meta.node_id(),
            epoch: meta.boot_epoch(),
            conn: holder.conn,
            channel: holder.channel,
            time_ms: now_ms(),
            offset,
            vhost: self.qref.key.vhost.to_string(),
            queue: self.qref.key.name.to_string(),
        };
        match index.append(0, &rec.encode(), &Bytes::new()) {
            Ok(i) => {
                // A record from an earlier delivery (requeued since) is replaced; the new
                // one is synced before this delivery leaves, the old one may go any time.
                if let Some(old) = self.index_of.insert(offset, i) {
                    let _ = index.delete_by_offsets(&[old]);
                }
                Some(i)
            }
            Err(e) => {
                // Delivered all the same (the message is stored): after a crash it may come
                // back without redelivered=true, a duplicate and never a loss. A full disk
                // makes this happen for every delivery: logged at most once a second.
                if e.is_disk_full() {
                    self.env.disk_full();
                }
                if once_a_second(&INDEX_FAILURE_LOGGED) {
                    tracing::error!(queue = %self.qref.key.name, error = %e, "unacked index append failed; delivering without an index record");
                }
                None
            }
        }
    }

    /// The cursor moves past a delivered offset; a commit task carries it to the metadata.
    fn passed(&mut self, offset: u64) {
        if self.index.is_none() || offset < self.cursor.target {
            return;
        }
        self.cursor.target = offset + 1;
        if !self.cursor.committing {
            self.cursor.committing = true;
            glommio::spawn_local(commit_cursor(self.me.clone())).detach();
        }
    }

    /// Deletes a settled or auto-acked offset from the store (DESIGN.md ack-path rule 4).
    fn forget(&mut self, offset: u64) {
        self.redelivered.remove(&offset);
        self.trash_index(offset);
        self.dirty = true;
        if let Err(e) = self.shard.delete_by_offsets(&[offset]) {
            tracing::error!(queue = %self.qref.key.name, error = %e, "delete failed");
        }
    }

    /// basic.recover(requeue=false): send the given outstanding offsets again to the
    /// consumers holding them, flagged redelivered.
    fn redeliver(&mut self, offsets: &[u64]) {
        for &off in offsets {
            let Some(o) = self.settle_one(off) else { continue };
            let Some(cid) = o.consumer else {
                // Held by basic.get: no consumer to send it to again; requeue it.
                self.redelivered.insert(off);
                self.requeued.insert(off);
                self.wake();
                continue;
            };
            self.redelivered.insert(off);
            match self.shard.read_cached(off) {
                Some(rec) => {
                    self.deliver(cid, rec);
                    self.wake();
                }
                None => {
                    self.requeued.insert(off);
                    self.wake();
                }
            }
        }
    }
}

/// The dispatcher task of one queue: delivers while consumers have credit and messages
/// are ready; sleeps until woken by a publish, a settle, or a consumer change.
async fn dispatcher(weak: Weak<RefCell<Queue>>, wake: flume::Receiver<()>) {
    futures_lite::future::yield_now().await;
    while wake.recv_async().await.is_ok() {
        let mut sent = 0u32;
        loop {
            let Some(cell) = weak.upgrade() else { return };
            let step = cell.borrow_mut().step();
            match step {
                Step::Idle => break,
                Step::Backlogged => {
                    drop(cell);
                    Queue::flush_unsynced_soon(&weak);
                    glommio::timer::sleep(std::time::Duration::from_millis(1)).await;
                }
                Step::Sent => {
                    sent += 1;
                    if sent.is_multiple_of(256) {
                        drop(cell);
                        Queue::flush_unsynced_soon(&weak);
                        glommio::yield_if_needed().await;
                    }
                }
                Step::Read { offset, consumer } => {
                    let shard = cell.borrow().shard.clone();
                    drop(cell);
                    let run = read_ahead(&shard, offset).await;
                    let Some(cell) = weak.upgrade() else { return };
                    let mut q = cell.borrow_mut();
                    q.paging -= 1;
                    match run {
                        Ok(recs) if !q.deleted => {
                            if q.paged.len() > 4 * READ_AHEAD_RECORDS {
                                // Entries nobody took (settled elsewhere): start over.
                                q.paged.clear();
                            }
                            let mut first = None;
                            for r in recs {
                                if r.offset == offset {
                                    first = Some(r);
                                } else if r.offset > offset {
                                    q.paged.insert(r.offset, r);
                                }
                            }
                            // None: deleted meanwhile (purge), nothing to deliver.
                            if let Some(rec) = first {
                                q.deliver(consumer, rec);
                            }
                        }
                        Ok(_) => {}
                        Err(e) => {
                            tracing::error!(queue = %q.qref.key.name, error = %e, "read failed; message left in place");
                            q.unclaim(offset);
                            break;
                        }
                    }
                }
            }
        }
        Queue::flush_unsynced_soon(&weak);
    }
}

/// Most records one read-ahead brings into a queue's page buffer.
pub const READ_AHEAD_RECORDS: usize = 1024;
/// Most body bytes one read-ahead brings in.
pub const READ_AHEAD_BYTES: usize = 4 << 20;

/// Reads the live records from `offset` on, up to [`READ_AHEAD_RECORDS`] or
/// [`READ_AHEAD_BYTES`], with the shard's sequential reader (a few large disk reads instead
/// of one read per message) — for a consumer draining a backlog that left the cache.
async fn read_ahead(shard: &Shard, offset: u64) -> Result<Vec<Record>, ringmq_shards::StoreError> {
    let mut reader = shard.reader(offset);
    let mut out = Vec::new();
    let mut bytes = 0;
    while out.len() < READ_AHEAD_RECORDS && bytes < READ_AHEAD_BYTES {
        match reader.next().await? {
            Some(r) => {
                bytes += r.body.len() + r.header.len();
                out.push(r);
            }
            None => break,
        }
    }
    Ok(out)
}

/// Longest time deletes (acks) wait for a full sync while publisher confirms keep the
/// group commit busy with append-only syncs.
pub const FULL_SYNC_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);

/// Group commit for publisher confirms of persistent messages in a durable queue: one
/// `sync` covers every append made before it; confirms go out only after it returns
/// (DESIGN.md ack-path rule 9). While confirms wait, a round syncs appends only (one
/// fdatasync, not one more for the deletion bitmaps the acks dirtied); deletes get a full
/// sync at least every [`FULL_SYNC_INTERVAL`] and when no confirm waits, and only then do
/// the index records of deleted messages go (`index_trash`).
async fn group_commit(weak: Weak<RefCell<Queue>>) {
    // glommio may run a spawned task at once: let the spawner release its borrow first.
    futures_lite::future::yield_now().await;
    loop {
        let Some(cell) = weak.upgrade() else { return };
        let (shard, batch, full, env) = {
            let mut q = cell.borrow_mut();
            if q.pending_confirms.is_empty() && !q.dirty {
                q.syncing = false;
                return;
            }
            let now = Instant::now();
            let full = q.pending_confirms.is_empty() || now.duration_since(q.last_full_sync) >= FULL_SYNC_INTERVAL;
            let trash = if full {
                q.dirty = false;
                q.last_full_sync = now;
                std::mem::take(&mut q.index_trash)
            } else {
                Vec::new()
            };
            (q.shard.clone(), (std::mem::take(&mut q.pending_confirms), trash, q.index.clone()), full, q.env.clone())
        };
        drop(cell);
        let (batch, trash, index) = batch;
        crate::observe::Stats::add(&env.stats().queue_syncs, 1);
        let synced = if full { shard.sync().await } else { shard.sync_appends().await };
        let ok = match synced {
            Ok(_) => true,
            Err(e) => {
                // Nothing of this batch is known durable: its publishes are nacked. The shard
                // is read-only now (reads and acks go on); the core reopens the queue from
                // disk once the disk alarm is clear (`Queue::store_failure`).
                // Whatever the error says, the disk is worth a look at once.
                env.disk_full();
                tracing::error!(error = %e, confirms = batch.len(), "queue store sync failed; its publishes are nacked");
                crate::observe::Stats::add(&env.stats().store_refused, batch.len() as u64);
                false
            }
        };
        // The messages' deletions are durable now: their index records may go.
        if let (Some(index), false) = (&index, trash.is_empty()) {
            if let Err(e) = index.delete_by_offsets(&trash) {
                tracing::error!(error = %e, "unacked index delete failed");
            }
        }
        let now = Instant::now();
        for (c, published) in batch {
            if let Some(p) = published {
                env.stats().publish_to_stored.record(now.duration_since(p));
            }
            let _ = c.tx.send(ClientEvent::Stored { channel: c.channel, seq: c.seq, ok });
        }
    }
}

/// Shortest time between two cursor commits of one queue.
pub const CURSOR_COMMIT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(20);

/// Builds the cursor commit. Taking the index's [`Synced`] token is the type-level form of
/// rule 2: no cursor moves past a delivery whose index record is not yet durable.
fn cursor_cas(key: &QueueKey, expected: u64, new: u64, _index_synced: &Synced) -> Command {
    Command::CursorCas { vhost: key.vhost.to_string(), queue: key.name.to_string(), expected, new }
}

/// Commits the queue's cursor through the Raft group by compare-and-set, one proposal in
/// flight per queue (the metadata group batches proposals of all queues into one entry).
/// A rejected CAS re-reads the stored value and retries; nothing is locked or leased.
async fn commit_cursor(weak: Weak<RefCell<Queue>>) {
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
        drop(cell);
        crate::observe::Stats::add(&env.stats().queue_syncs, 2);
        let synced = match (shard.sync().await, index.sync().await) {
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
        let outcome = env.meta().propose(cursor_cas(&key, expected, target, &synced)).await;
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

/// Reads every live unacked-index record of a queue (at open, before any delivery).
///
/// # Errors
/// The store's error when a record cannot be read.
pub async fn read_index(index: &Shard) -> Result<Vec<(u64, IndexRecord)>, ringmq_shards::StoreError> {
    let mut out = Vec::new();
    for i in index.live_offsets() {
        if let Some(r) = index.read(i).await? {
            match IndexRecord::decode(&r.header) {
                Some(rec) => out.push((i, rec)),
                None => tracing::warn!(index_offset = i, "undecodable unacked-index record skipped"),
            }
        }
    }
    Ok(out)
}

/// basic.get: claims the next ready message for `holder`.
fn basic_get(cell: &QueueCell, no_ack: bool, holder: Holder, reply: super::Reply<Result<Option<GetReply>, QueueError>>) {
    let mut q = cell.borrow_mut();
    let Some(offset) = q.take_next() else {
        let _ = reply.send(Ok(None));
        return;
    };
    if let Some(rec) = q.paged.remove(&offset).or_else(|| q.shard.read_cached(offset)) {
        let (r, sync) = q.finish_get(rec, no_ack, holder);
        drop(q);
        reply_get(r, sync, reply);
        return;
    }
    q.paging += 1;
    let shard = q.shard.clone();
    drop(q);
    let weak = Rc::downgrade(cell);
    glommio::spawn_local(async move {
        let rec = shard.read(offset).await;
        let Some(cell) = weak.upgrade() else { return };
        let mut q = cell.borrow_mut();
        q.paging -= 1;
        match rec {
            Ok(Some(rec)) => {
                let (r, sync) = q.finish_get(rec, no_ack, holder);
                drop(q);
                reply_get(r, sync, reply);
            }
            Ok(None) => {
                let _ = reply.send(Ok(None));
            }
            Err(e) => {
                q.unclaim(offset);
                let _ = reply.send(Err(QueueError::InternalError(format!("read failed: {e}"))));
            }
        }
    })
    .detach();
}

/// Answers a basic.get, after syncing the unacked index when the delivery has a record
/// there (the same rule as [`Queue::flush_unsynced`]).
fn reply_get(r: GetReply, sync: Option<Rc<Shard>>, reply: super::Reply<Result<Option<GetReply>, QueueError>>) {
    match sync {
        None => drop(reply.send(Ok(Some(r)))),
        Some(index) => {
            glommio::spawn_local(async move {
                if let Err(e) = index.sync_appends().await {
                    // As in `Queue::flush_unsynced`: answered all the same.
                    tracing::error!(error = %e, "unacked index sync failed; basic.get answered without a durable index record");
                }
                let _ = reply.send(Ok(Some(r)));
            })
            .detach();
        }
    }
}

impl Queue {
    /// Claims `rec` for a basic.get; returns the reply and, when the delivery got an
    /// unacked-index record, the index to sync before answering.
    fn finish_get(&mut self, rec: Record, no_ack: bool, holder: Holder) -> (GetReply, Option<Rc<Shard>>) {
        let offset = rec.offset;
        let redelivered = self.redelivered.contains(&offset);
        let mut sync = None;
        if no_ack {
            self.forget(offset);
        } else {
            let index_offset = self.index_delivery(offset, rec.flags, &holder);
            if index_offset.is_some() {
                sync = self.index.clone();
            }
            self.outstanding.insert(offset, Outstanding { consumer: None, holder, since: Instant::now(), credit: None });
        }
        self.passed(offset);
        let r = GetReply {
            offset,
            redelivered,
            message: Message { header: rec.header, body: rec.body, flags: rec.flags },
            message_count: self.message_count(),
        };
        (r, sync)
    }
}
