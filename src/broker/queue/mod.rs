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
pub mod settle;

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::rc::{Rc, Weak};
use std::time::Instant;

use ringmq_shards::{Record, Shard};

use super::message::Message;
use super::router::{int_arg, string_arg, Route};
use super::{
    ClientEvent, ConfirmTo, ConsumerId, Delivery, GetReply, Holder, Mesh, QueueKey, QueueOp, QueueRef,
};
use crate::amqp::error::AmqpError;
use crate::meta::state::QueueDef;
use consumer::Consumers;

/// Default delivery acknowledgement timeout: 30 minutes (RabbitMQ's consumer_timeout), in ms.
pub const DEFAULT_CONSUMER_TIMEOUT_MS: u64 = 30 * 60 * 1000;

/// What a queue needs from its core besides its own state.
pub trait QueueEnv: Mesh {
    /// Routes a message (for dead-lettering) with the core's current routing table.
    fn route(&self, vhost: &str, exchange: &str, routing_key: &str, headers: Option<&amq_protocol::types::FieldTable>) -> Route;
    /// The queue has become unused and is auto-delete: remove it.
    fn auto_delete(&self, key: &QueueKey);
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
}

/// A queue's state. See the module doc.
pub struct Queue {
    /// Routable reference (key, owner core, durability).
    pub qref: QueueRef,
    /// Declaration.
    pub def: QueueDef,
    /// The message store.
    pub shard: Rc<Shard>,
    ready: VecDeque<u64>,
    requeued: BTreeSet<u64>,
    redelivered: HashSet<u64>,
    outstanding: HashMap<u64, Outstanding>,
    paging: usize,
    /// Attached consumers.
    pub consumers: Consumers,
    had_consumer: bool,
    pending_confirms: Vec<ConfirmTo>,
    syncing: bool,
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
    Sent,
    Read { offset: u64, consumer: ConsumerId },
}

impl Queue {
    /// Builds a queue around an opened shard and starts its dispatcher task.
    /// Ready messages are the shard's live records, in offset order.
    pub fn start(def: QueueDef, qref: QueueRef, shard: Shard, default_timeout_ms: u64, env: Rc<dyn QueueEnv>) -> QueueCell {
        let (wake, wake_rx) = flume::bounded(1);
        let ready: VecDeque<u64> = shard.live_offsets().into_iter().collect();
        let consumer_timeout_ms = int_arg(&def.arguments, "x-consumer-timeout")
            .filter(|v| *v > 0)
            .map(|v| v as u64)
            .unwrap_or(default_timeout_ms);
        let dead_letter_exchange = string_arg(&def.arguments, "x-dead-letter-exchange").map(str::to_owned);
        let dead_letter_routing_key = string_arg(&def.arguments, "x-dead-letter-routing-key").map(str::to_owned);
        let q = Rc::new(RefCell::new(Queue {
            qref,
            def,
            shard: Rc::new(shard),
            ready,
            requeued: BTreeSet::new(),
            redelivered: HashSet::new(),
            outstanding: HashMap::new(),
            paging: 0,
            consumers: Consumers::default(),
            had_consumer: false,
            pending_confirms: Vec::new(),
            syncing: false,
            dirty: false,
            wake,
            deleted: false,
            consumer_timeout_ms,
            dead_letter_exchange,
            dead_letter_routing_key,
            env,
        }));
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
        self.requeued.pop_first().or_else(|| self.ready.pop_front())
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
            QueueOp::Publish { message, confirm } => q.publish(cell, message, confirm),
            QueueOp::Get { no_ack, holder, reply } => {
                drop(q);
                basic_get(cell, no_ack, holder, reply);
            }
            QueueOp::Consume { consumer, reply } => {
                if q.consumers.has_exclusive() || (consumer.exclusive && !q.consumers.is_empty()) {
                    let _ = reply.send(Err(AmqpError::access_refused(format!(
                        "queue '{}' in vhost '{}' in exclusive use",
                        q.qref.key.name, q.qref.key.vhost
                    ))));
                    return;
                }
                if consumer.send_consume_ok {
                    let _ = consumer
                        .tx
                        .send(ClientEvent::ConsumeOk { channel: consumer.channel, consumer_tag: consumer.tag.clone() });
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
            QueueOp::Settle { ack, requeue, reject } => {
                q.ack(&ack);
                q.requeue(&requeue);
                drop(q);
                settle::reject(cell, reject);
            }
            QueueOp::ChannelClosed { chan_uid } => {
                q.consumers.remove_channel(chan_uid);
                let mut held: Vec<u64> =
                    q.outstanding.iter().filter(|(_, o)| o.holder.chan_uid == chan_uid).map(|(off, _)| *off).collect();
                held.sort_unstable();
                q.requeue(&held);
                q.maybe_auto_delete();
            }
            QueueOp::Redeliver { offsets } => q.redeliver(&offsets),
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
                let _ = reply.send(Err(AmqpError::not_found(format!("no queue '{}'", q.qref.key.name))));
            }
        }
    }

    fn publish(&mut self, cell: &QueueCell, message: Message, confirm: Option<ConfirmTo>) {
        let needs_sync = self.qref.durable && message.persistent();
        match self.shard.append(message.flags, &message.header, &message.body) {
            Ok(offset) => {
                self.ready.push_back(offset);
                if needs_sync {
                    self.pending_confirms.extend(confirm);
                    self.dirty = true;
                    self.start_sync(cell);
                } else if let Some(c) = confirm {
                    let _ = c.tx.send(ClientEvent::Stored { channel: c.channel, seq: c.seq, ok: true });
                }
                self.wake();
            }
            Err(e) => {
                tracing::error!(queue = %self.qref.key.name, error = %e, "append failed");
                if let Some(c) = confirm {
                    let _ = c.tx.send(ClientEvent::Stored { channel: c.channel, seq: c.seq, ok: false });
                }
            }
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
        let mut offs: Vec<u64> = self.ready.drain(..).collect();
        offs.extend(std::mem::take(&mut self.requeued));
        for o in &offs {
            self.redelivered.remove(o);
        }
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
    pub fn check_delete(&self, if_unused: bool, if_empty: bool) -> Result<u32, AmqpError> {
        if if_unused && !self.consumers.is_empty() {
            return Err(AmqpError::precondition_failed(format!("queue '{}' in vhost '{}' in use", self.qref.key.name, self.qref.key.vhost)));
        }
        if if_empty && self.message_count() > 0 {
            return Err(AmqpError::precondition_failed(format!("queue '{}' in vhost '{}' not empty", self.qref.key.name, self.qref.key.vhost)));
        }
        Ok(self.message_count())
    }

    /// Marks the queue deleted and tells every consumer (basic.cancel for clients that
    /// announced consumer_cancel_notify). Returns the shard for the caller to destroy.
    pub fn tear_down(&mut self) -> Rc<Shard> {
        self.deleted = true;
        for c in self.consumers.drain() {
            if c.spec.cancel_notify {
                let _ = c.spec.tx.send(ClientEvent::Cancelled { channel: c.spec.channel, consumer_tag: c.spec.tag.clone() });
            }
        }
        for c in self.pending_confirms.drain(..) {
            let _ = c.tx.send(ClientEvent::Stored { channel: c.channel, seq: c.seq, ok: true });
        }
        self.wake();
        self.shard.clone()
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
        let Some(consumer) = self.consumers.next_with_credit().map(|c| c.spec.id) else { return Step::Idle };
        let offset = self.take_next().expect("message_count > 0");
        match self.shard.read_cached(offset) {
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
    fn deliver(&mut self, consumer: ConsumerId, rec: Record) {
        let offset = rec.offset;
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
            message: Message { header: rec.header, body: rec.body, flags: rec.flags },
            track,
        };
        if c.spec.tx.send(ClientEvent::Deliver(d)).is_err() {
            // The connection is gone; its close will settle the rest.
            self.consumers.remove(consumer);
            self.unclaim(offset);
            return;
        }
        if track {
            c.in_flight += 1;
            let holder = Holder { conn: c.spec.conn, channel: c.spec.channel, chan_uid: c.spec.chan_uid, tx: c.spec.tx.clone() };
            self.outstanding.insert(offset, Outstanding { consumer: Some(consumer), holder, since: Instant::now() });
        } else {
            self.forget(offset);
        }
    }

    /// Deletes a settled or auto-acked offset from the store (DESIGN.md ack-path rule 4).
    fn forget(&mut self, offset: u64) {
        self.redelivered.remove(&offset);
        self.dirty = true;
        if let Err(e) = self.shard.delete_by_offsets(&[offset]) {
            tracing::error!(queue = %self.qref.key.name, error = %e, "delete failed");
        }
    }

    /// basic.recover(requeue=false): send the given outstanding offsets again to the
    /// consumers holding them, flagged redelivered.
    fn redeliver(&mut self, offsets: &[u64]) {
        for &off in offsets {
            let Some(o) = self.outstanding.remove(&off) else { continue };
            let Some(cid) = o.consumer else {
                // Held by basic.get: no consumer to send it to again; requeue it.
                self.redelivered.insert(off);
                self.requeued.insert(off);
                self.wake();
                continue;
            };
            if let Some(c) = self.consumers.get_mut(cid) {
                c.in_flight = c.in_flight.saturating_sub(1);
            }
            self.redelivered.insert(off);
            match self.shard.read_cached(off) {
                Some(rec) => self.deliver(cid, rec),
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
                Step::Sent => {
                    sent += 1;
                    if sent % 256 == 0 {
                        drop(cell);
                        glommio::yield_if_needed().await;
                    }
                }
                Step::Read { offset, consumer } => {
                    let shard = cell.borrow().shard.clone();
                    drop(cell);
                    let rec = shard.read(offset).await;
                    let Some(cell) = weak.upgrade() else { return };
                    let mut q = cell.borrow_mut();
                    q.paging -= 1;
                    match rec {
                        Ok(Some(rec)) if !q.deleted => q.deliver(consumer, rec),
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
    }
}

/// Group commit for publisher confirms of persistent messages in a durable queue: one
/// `sync` covers every append made before it; confirms go out only after it returns
/// (DESIGN.md ack-path rule 9).
async fn group_commit(weak: Weak<RefCell<Queue>>) {
    // glommio may run a spawned task at once: let the spawner release its borrow first.
    futures_lite::future::yield_now().await;
    loop {
        let Some(cell) = weak.upgrade() else { return };
        let (shard, batch) = {
            let mut q = cell.borrow_mut();
            if q.pending_confirms.is_empty() && !q.dirty {
                q.syncing = false;
                return;
            }
            q.dirty = false;
            (q.shard.clone(), std::mem::take(&mut q.pending_confirms))
        };
        drop(cell);
        let ok = match shard.sync().await {
            Ok(_) => true,
            Err(e) => {
                tracing::error!(error = %e, "sync failed");
                crate::core::fatal::fatal(&format!("fdatasync of a queue shard failed: {e}"));
            }
        };
        for c in batch {
            let _ = c.tx.send(ClientEvent::Stored { channel: c.channel, seq: c.seq, ok });
        }
    }
}

/// basic.get: claims the next ready message for `holder`.
fn basic_get(cell: &QueueCell, no_ack: bool, holder: Holder, reply: super::Reply<Result<Option<GetReply>, AmqpError>>) {
    let mut q = cell.borrow_mut();
    let Some(offset) = q.take_next() else {
        let _ = reply.send(Ok(None));
        return;
    };
    if let Some(rec) = q.shard.read_cached(offset) {
        let r = q.finish_get(rec, no_ack, holder);
        let _ = reply.send(Ok(Some(r)));
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
                let r = q.finish_get(rec, no_ack, holder);
                let _ = reply.send(Ok(Some(r)));
            }
            Ok(None) => {
                let _ = reply.send(Ok(None));
            }
            Err(e) => {
                q.unclaim(offset);
                let _ = reply.send(Err(AmqpError::internal_error(format!("read failed: {e}"))));
            }
        }
    })
    .detach();
}

impl Queue {
    fn finish_get(&mut self, rec: Record, no_ack: bool, holder: Holder) -> GetReply {
        let offset = rec.offset;
        let redelivered = self.redelivered.contains(&offset);
        if no_ack {
            self.forget(offset);
        } else {
            self.outstanding.insert(offset, Outstanding { consumer: None, holder, since: Instant::now() });
        }
        GetReply {
            offset,
            redelivered,
            message: Message { header: rec.header, body: rec.body, flags: rec.flags },
            message_count: self.message_count(),
        }
    }
}

/// A queue's key as a `QueueKey` (convenience for callers holding a cell).
pub fn key_of(cell: &QueueCell) -> QueueKey {
    cell.borrow().qref.key.clone()
}
