//! The ack path: every transition of a delivered message, on its queue's owner core.
//!
//! A message is *ready* ([`super::ready::ReadySet`]), *outstanding* (delivered to exactly
//! one channel, unsettled: [`Held`]) or *deleted*. The rules are DESIGN.md's, "The ack path
//! — invariants", with its numbers; every other doc refers to these numbers:
//!
//! 1. **One consumer at a time.** Only the owner core moves an offset out of the ready set,
//!    and [`Held::hold`] records its one holder before the delivery leaves the core. A
//!    settlement names its channel's incarnation and touches only offsets that channel
//!    holds ([`Held::settle`]).
//! 2. **Index before cursor.** A tracked delivery of a persistent message in a durable
//!    queue appends an unacked-index record (`Queue::index_delivery`), and the delivery
//!    leaves only once that record is synced, or at once when it lies below the queue's
//!    durable delivery reservation (`reserve.rs`: a synced record saying everything below
//!    it may have been handed out); the cursor commit consumes the index's
//!    [`super::durability::IndexSynced`] proof ([`super::durability::cursor_cas`]).
//! 3. **New copy before old delete.** [`Queue::dead_letter`] publishes the new copy with a
//!    confirm ticket and deletes the original only after every target queue stored (and,
//!    for durable targets, synced) it.
//! 4. **Ack is two deletes**: [`Queue::delete`] removes the offset from the message shard
//!    and queues its unacked-index record, which [`super::durability::release_index_records`]
//!    deletes only with the proof that the message shard's deletes are synced
//!    ([`super::durability::MessagesSynced`]): a record never goes before its message.
//! 5. **One requeue primitive**, [`Queue::requeue`], behind basic.nack(requeue) and
//!    basic.reject(requeue) and basic.recover(requeue) ([`Queue::settle`]), channel and
//!    connection close and the acknowledgement timeout ([`Queue::channel_closed`]), and the
//!    recovery scanner ([`scan`]). A requeued offset is delivered again with
//!    redelivered=true, before never-delivered messages (original position).
//!    basic.cancel does not requeue.
//! 6. **Index coverage equals durability.** Only persistent messages of durable queues get
//!    index records (`Queue::index_delivery`).
//! 7. **Crash recovery.** [`scan`] (on the metadata leader only) requeues the deliveries of
//!    earlier boot epochs at open; [`Queue::timed_out_holders`] finds live holders past the
//!    acknowledgement timeout, whose channel the connection closes with 406.
//! 8. **Errors as the protocol says.** Unknown or settled delivery tags are answered 406 by
//!    the channel's ledger (`amqp::unacked`) before anything reaches the queue; settling an
//!    offset the channel does not hold here is a no-op (a race with a close), never a
//!    delete or a duplicate.
//! 9. **Confirms** go out only after the message is stored and, when persistent in a
//!    durable queue, synced ([`super::durability::group_commit`]); a store failure nacks.
//! 10. **Prefetch.** [`Queue::release`] gives back the consumer's and the channel's credit
//!     of every settled delivery; nothing is claimed that cannot be delivered at once
//!     (the dispatcher asks for a consumer with credit first).
//!
//! The decisions ([`Held`], [`Actions`]) are pure and property-tested; the `Queue` methods
//! below carry them out top to bottom.

use std::rc::Rc;
use std::time::Instant;

use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use rustc_hash::{FxHashMap, FxHashSet};

use super::index::IndexRecord;
use super::{Queue, QueueCell};
use crate::broker::message::{decode_properties, encode_properties, Message};
use crate::broker::{ChannelCredit, ClientEvent, ConfirmTo, ConsumerId, Holder, Offset, QueueOp};
use crate::observe::Stage;

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
    pub credit: Option<std::sync::Arc<ChannelCredit>>,
    /// It was delivered with redelivered=true (for the management API's listing).
    pub redelivered: bool,
    /// One of the sampled deliveries: its ack records `taken_to_acked` (`observe::stages`).
    pub sampled: bool,
}

/// Settled offsets with their former holders, by what happens to them next.
#[derive(Debug, Default)]
pub struct Actions {
    /// Acknowledged: deleted (rule 4).
    pub ack: Vec<(u64, Outstanding)>,
    /// Rejected with no dead-letter exchange: deleted.
    pub drop: Vec<(u64, Outstanding)>,
    /// Rejected with a dead-letter exchange: moved (rule 3).
    pub dead_letter: Vec<(u64, Outstanding)>,
    /// Given back: ready again, redelivered (rule 5).
    pub requeue: Vec<(u64, Outstanding)>,
}

impl Actions {
    /// Nothing was settled.
    pub fn is_empty(&self) -> bool {
        self.ack.is_empty() && self.drop.is_empty() && self.dead_letter.is_empty() && self.requeue.is_empty()
    }
}

/// The outstanding deliveries of one queue: offset → its one holder (rule 1).
#[derive(Debug, Default)]
pub struct Held {
    map: FxHashMap<u64, Outstanding>,
}

impl Held {
    /// Records `o` as the holder of `offset`, before the delivery leaves the core.
    pub fn hold(&mut self, offset: u64, o: Outstanding) {
        let before = self.map.insert(offset, o);
        debug_assert!(before.is_none(), "offset {offset} delivered while outstanding");
    }

    /// Outstanding deliveries.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Nothing is outstanding.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Every outstanding delivery (oldest first) for the management API, its consumer's tag
    /// from `tag_of` (none for a basic.get, or a consumer gone since).
    pub fn listing(&self, tag_of: impl Fn(ConsumerId) -> Option<crate::broker::ConsumerTag>) -> Vec<crate::broker::UnackedInfo> {
        let now = Instant::now();
        let mut v: Vec<crate::broker::UnackedInfo> = self
            .map
            .iter()
            .map(|(&offset, o)| crate::broker::UnackedInfo {
                offset,
                conn: o.holder.conn,
                channel: o.holder.channel,
                chan_uid: o.holder.chan_uid,
                consumer_tag: o.consumer.and_then(&tag_of),
                redelivered: o.redelivered,
                age_ms: now.duration_since(o.since).as_millis() as u64,
            })
            .collect();
        v.sort_by(|a, b| b.age_ms.cmp(&a.age_ms).then(a.offset.cmp(&b.offset)));
        v
    }

    /// The holder of `offset`, if it is outstanding.
    pub fn get(&self, offset: u64) -> Option<&Outstanding> {
        self.map.get(&offset)
    }

    /// Takes `offset` out, whoever holds it.
    pub fn release(&mut self, offset: u64) -> Option<Outstanding> {
        self.map.remove(&offset)
    }

    /// Takes out each of `offsets` that channel incarnation `chan_uid` holds, in the order
    /// given; others are skipped (rules 1 and 8).
    fn take_mine(&mut self, chan_uid: u64, offsets: &[Offset]) -> Vec<(u64, Outstanding)> {
        let mut out = Vec::with_capacity(offsets.len());
        for &Offset(off) in offsets {
            if self.map.get(&off).is_some_and(|o| o.holder.chan_uid == chan_uid) {
                out.push((off, self.map.remove(&off).expect("present")));
            }
        }
        out
    }

    /// basic.ack, basic.nack, basic.reject and basic.recover(requeue=true) of channel
    /// `chan_uid`: acked offsets are deleted, requeued ones come back, rejected ones are
    /// dead-lettered when `dead_letters`, else dropped. Offsets the channel does not hold
    /// are skipped; an offset named twice is settled by its first mention (ack, then
    /// requeue, then reject).
    pub fn settle(&mut self, chan_uid: u64, ack: &[Offset], requeue: &[Offset], reject: &[Offset], dead_letters: bool) -> Actions {
        let ack = self.take_mine(chan_uid, ack);
        let requeue = self.take_mine(chan_uid, requeue);
        let reject = self.take_mine(chan_uid, reject);
        let (dead_letter, drop) = if dead_letters { (reject, Vec::new()) } else { (Vec::new(), reject) };
        Actions { ack, drop, dead_letter, requeue }
    }

    /// A channel closed (or its connection died, or its acknowledgement timeout closed it):
    /// every offset it holds comes back, in offset order (rule 5).
    pub fn close_channel(&mut self, chan_uid: u64) -> Actions {
        let mut mine: Vec<Offset> = self.map.iter().filter(|(_, o)| o.holder.chan_uid == chan_uid).map(|(off, _)| Offset(*off)).collect();
        mine.sort_unstable();
        Actions { requeue: self.take_mine(chan_uid, &mine), ..Default::default() }
    }

    /// Holders whose oldest delivery is older than `limit` at `now`, each channel
    /// incarnation once (rule 7: the acknowledgement timeout).
    pub fn timed_out(&self, now: Instant, limit: std::time::Duration) -> Vec<Holder> {
        let mut seen = FxHashSet::default();
        self.map
            .values()
            .filter(|o| now.duration_since(o.since) > limit && seen.insert(o.holder.chan_uid))
            .map(|o| o.holder.clone())
            .collect()
    }
}

/// The recovery scanner's decision at open (rule 7), on the metadata leader only: of the
/// unacked-index records of earlier runs, `(index offset, record)`, the first record of
/// each message still live stays as that message's record (the message is ready again and
/// comes back flagged redelivered); the others are stale and go. Returns (message offset →
/// kept record, stale records).
pub fn scan(held: &[(u64, IndexRecord)], is_live: impl Fn(u64) -> bool) -> (FxHashMap<u64, u64>, Vec<u64>) {
    let mut index_of = FxHashMap::default();
    let mut stale = Vec::new();
    for (i, r) in held {
        if is_live(r.offset) && !index_of.contains_key(&r.offset) {
            index_of.insert(r.offset, *i);
        } else {
            stale.push(*i);
        }
    }
    (index_of, stale)
}

impl Queue {
    /// Gives back the prefetch credit a settled delivery held (rule 10).
    pub(super) fn release(&mut self, o: &Outstanding) {
        if let Some(credit) = &o.credit {
            credit.give();
        }
        if let Some(cid) = o.consumer {
            if let Some(c) = self.consumers.get_mut(cid) {
                c.in_flight = c.in_flight.saturating_sub(1);
                c.settled = true;
            }
        }
    }

    /// The delete primitive (rule 4): `offsets` leave the message shard now; their
    /// unacked-index records go once that delete is synced (`index_trash`, released by
    /// [`super::durability::release_index_records`]). Used by ack, reject without a dead-letter
    /// exchange, a dead-letter move once the copy is stored, auto-ack and purge.
    pub(super) fn delete(&mut self, offsets: &[u64]) {
        self.delete_local(offsets);
        // A replicated queue tells the other members (`replica.rs`, step 3).
        self.propose_settle(offsets);
    }

    /// [`Queue::delete`] on this member's store only.
    pub(super) fn delete_local(&mut self, offsets: &[u64]) {
        if offsets.is_empty() {
            return;
        }
        for &off in offsets {
            self.ready.forget(off);
            if let Some(i) = self.delivery_limit.as_mut().and_then(|d| d.forget(off)) {
                self.index_trash.push(i);
            }
            if let Some(t) = &mut self.ttl {
                t.forget(off);
            }
            if let Some(i) = self.index_of.remove(&off) {
                self.index_trash.push(i);
            }
        }
        self.dirty = true;
        if let Err(e) = self.shard.delete_by_offsets(offsets) {
            tracing::error!(queue = %self.qref.key.name, error = %e, "delete failed");
        }
    }

    /// The requeue primitive (rule 5): settled deliveries go back to the ready set at their
    /// original position, flagged redelivered; their holders' credit is given back. Their
    /// index records stay (the messages were delivered: after a crash they come back
    /// flagged). A queue with a delivery limit counts each return, and a message returned
    /// more times than the limit is dead-lettered (reason `delivery_limit`) or deleted
    /// instead (`delivery_limit.rs`, behaviours 1 and 2).
    pub(super) fn requeue(&mut self, settled: Vec<(u64, Outstanding)>) {
        if settled.is_empty() {
            return;
        }
        let mut over_limit = Vec::new();
        for (off, o) in settled {
            self.release(&o);
            if self.count_return(off) {
                over_limit.push(off);
                continue;
            }
            self.ready.requeue(off);
        }
        if !over_limit.is_empty() {
            tracing::debug!(queue = %self.qref.key.name, messages = over_limit.len(), "returned more times than the delivery limit");
            if self.dead_letter_exchange.is_some() {
                self.dead_letter(over_limit, DeathReason::DeliveryLimit);
            } else {
                self.delete(&over_limit);
            }
        }
        if self.limits.is_some() {
            // `limits.rs`, behaviour 4: a requeue may take the queue over its limit.
            self.drop_head();
        }
        self.wake();
    }

    /// Requeues those of `offsets` that are outstanding, whoever holds them.
    pub(super) fn requeue_offsets(&mut self, offsets: &[u64]) {
        let settled = offsets.iter().filter_map(|&off| self.held.release(off).map(|o| (off, o))).collect();
        self.requeue(settled);
    }

    /// Entry point: basic.ack, basic.nack, basic.reject and basic.recover(requeue=true)
    /// from channel incarnation `chan_uid` ([`QueueOp::Settle`]).
    pub fn settle(cell: &QueueCell, chan_uid: u64, ack: &[Offset], requeue: &[Offset], reject: &[Offset]) {
        let mut q = cell.borrow_mut();
        // Rules 1 and 8: only what this channel holds.
        let dead_letters = q.dead_letter_exchange.is_some();
        let actions = q.held.settle(chan_uid, ack, requeue, reject, dead_letters);
        if actions.is_empty() {
            return;
        }
        let Actions { ack, drop: dropped, dead_letter: moved, requeue } = actions;
        // Rule 10: credit back for every settled delivery.
        let now = Instant::now();
        for (_, o) in ack.iter().chain(&dropped).chain(&moved) {
            q.release(o);
        }
        for (_, o) in ack.iter().filter(|(_, o)| o.sampled) {
            q.stage(Stage::TakenToAcked, now.duration_since(o.since));
        }
        q.counters.acked += ack.len() as u64;
        // Rule 4: acked and dropped messages are deleted.
        let deleted: Vec<u64> = ack.iter().chain(&dropped).map(|(off, _)| *off).collect();
        q.delete(&deleted);
        // Rule 5.
        q.requeue(requeue);
        q.wake();
        // Rule 3.
        q.dead_letter(moved.into_iter().map(|(off, _)| off).collect(), DeathReason::Rejected);
    }

    /// Entry point: a channel closed, gracefully or with its connection, or by its
    /// acknowledgement timeout ([`QueueOp::ChannelClosed`]): its consumers go and every
    /// offset it holds is requeued (rule 5).
    pub fn channel_closed(&mut self, chan_uid: u64) {
        self.consumers.remove_channel(chan_uid);
        let actions = self.held.close_channel(chan_uid);
        self.requeue(actions.requeue);
        self.maybe_auto_delete();
    }

    /// Entry point: basic.recover(requeue=false) ([`QueueOp::Redeliver`]): the given
    /// outstanding offsets go again, flagged redelivered, to the consumers holding them; a
    /// basic.get holding one, or a record no longer in memory, is requeued instead.
    pub fn redeliver(&mut self, offsets: &[Offset]) {
        for &Offset(off) in offsets {
            let Some(o) = self.held.release(off) else { continue };
            let Some(cid) = o.consumer else {
                // Held by basic.get: no consumer to send it to again.
                self.requeue(vec![(off, o)]);
                continue;
            };
            self.release(&o);
            self.ready.mark_redelivered(off);
            match self.shard.read_cached(off) {
                Some(rec) => self.deliver(cid, rec),
                None => self.ready.requeue(off),
            }
            self.wake();
        }
    }

    /// Rule 7, live half: holders whose oldest delivery exceeds the acknowledgement timeout
    /// at `now`, each channel incarnation once. The core tells each one's connection, which
    /// closes the channel with 406 (and so requeues through [`Queue::channel_closed`]),
    /// unless [`Queue::cancel_timed_out`] handled it.
    /// A timeout of 0 is none: no holder ever times out.
    pub fn timed_out_holders(&self, now: Instant) -> Vec<Holder> {
        if self.consumer_timeout_ms == 0 {
            return Vec::new();
        }
        self.held.timed_out(now, std::time::Duration::from_millis(self.consumer_timeout_ms))
    }

    /// Entry point, rule 7 on a quorum queue (`x-queue-type=quorum`, RabbitMQ 4.3's
    /// reading): a channel past the acknowledgement timeout whose consumers of this queue all
    /// announced `consumer_cancel_notify` loses them (basic.cancel) and its deliveries of this
    /// queue are requeued (rule 5); the channel stays open. Returns false, doing nothing, for
    /// any other queue, or when the channel has a consumer without that capability or holds
    /// a basic.get delivery here: its channel is closed with 406 instead.
    pub fn cancel_timed_out(&mut self, chan_uid: u64) -> bool {
        if crate::broker::router::string_arg(&self.def.arguments, "x-queue-type") != Some("quorum") {
            return false;
        }
        let (mine, notified) = self.consumers.of_channel(chan_uid).fold((0, 0), |(n, k), c| (n + 1, k + usize::from(c.spec.cancel_notify)));
        if mine == 0 || notified < mine {
            return false;
        }
        if self.held.map.values().any(|o| o.holder.chan_uid == chan_uid && o.consumer.is_none()) {
            return false;
        }
        for c in self.consumers.of_channel(chan_uid) {
            tracing::info!(queue = %self.qref.key.name, consumer_tag = %c.spec.tag, timeout_ms = self.consumer_timeout_ms, "delivery acknowledgement timed out: consumer cancelled, its messages requeued");
            let _ = c.spec.tx.send(ClientEvent::Cancelled { channel: c.spec.channel, consumer_tag: c.spec.tag.clone() });
        }
        // What a channel close does to this queue, the channel itself staying open.
        self.channel_closed(chan_uid);
        true
    }
}

/// Why a message is dead-lettered: the `reason` of its `x-death` entry (RabbitMQ docs,
/// "Dead Letter Exchanges").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeathReason {
    /// basic.reject or basic.nack with requeue=false.
    Rejected,
    /// Dropped or refused at a length limit (`limits.rs`).
    Maxlen,
    /// Returned more times than the queue's delivery limit (`delivery_limit.rs`).
    DeliveryLimit,
    /// Its TTL ran out (`ttl.rs`).
    Expired,
}

impl DeathReason {
    /// The reason as RabbitMQ writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            DeathReason::Rejected => "rejected",
            DeathReason::Maxlen => "maxlen",
            DeathReason::DeliveryLimit => "delivery_limit",
            DeathReason::Expired => "expired",
        }
    }
}

impl Queue {
    /// Rule 3: dead-letters `offsets` (out of the ready and outstanding sets already) through
    /// the queue's `x-dead-letter-exchange` with an `x-death` entry of `reason`, deleting each
    /// original only after every target queue has stored its copy. A copy that is not stored
    /// everywhere leaves the original in place (logged; it is ready again after a restart).
    pub(super) fn dead_letter(&self, offsets: Vec<u64>, reason: DeathReason) {
        if offsets.is_empty() {
            return;
        }
        let Some(target) = DeadLetterTarget::of(self) else { return };
        let shard = self.shard.clone();
        let weak = self.me.clone();
        crate::core::spawn_soon(async move {
            for off in offsets {
                let rec = match shard.read(off).await {
                    Ok(Some(r)) => r,
                    Ok(None) => continue,
                    Err(e) => {
                        tracing::error!(error = %e, "dead-letter read failed; message kept");
                        continue;
                    }
                };
                let original = Message { header: rec.header, body: rec.body, flags: rec.flags };
                if !target.publish_copy(&original, reason, off).await {
                    tracing::error!(offset = off, "dead-letter copy not stored everywhere; original kept");
                    continue;
                }
                if let Some(cell) = weak.upgrade() {
                    cell.borrow_mut().delete(&[off]);
                }
            }
        });
    }

    /// Dead-letters a message that was never stored here (`reject-publish-dlx`, `limits.rs`):
    /// only the copy is published; a copy not stored is logged and lost, as the refused
    /// publish itself is (its publisher got basic.nack).
    pub(super) fn dead_letter_unstored(&self, message: Message, reason: DeathReason) {
        let Some(target) = DeadLetterTarget::of(self) else { return };
        crate::core::spawn_soon(async move {
            if !target.publish_copy(&message, reason, 0).await {
                tracing::warn!(queue = %target.source.name, "dead-letter copy of a refused publish not stored everywhere");
            }
        });
    }
}

/// Where a queue's dead letters go, and what a copy needs from the queue.
struct DeadLetterTarget {
    dlx: String,
    dlrk: Option<String>,
    source: crate::broker::QueueKey,
    env: Rc<dyn super::QueueEnv>,
}

impl DeadLetterTarget {
    fn of(q: &Queue) -> Option<DeadLetterTarget> {
        Some(DeadLetterTarget {
            dlx: q.dead_letter_exchange.clone()?,
            dlrk: q.dead_letter_routing_key.clone(),
            source: q.qref.key.clone(),
            env: q.env.clone(),
        })
    }

    /// Publishes the dead-lettered copy of `original` to every queue the exchange routes it
    /// to, but those it would reach in a cycle ([`is_cycle`]); true once every one of them
    /// stored it (also when it routes nowhere: RabbitMQ drops such a copy).
    async fn publish_copy(&self, original: &Message, reason: DeathReason, seq: u64) -> bool {
        let (exchange, rk, raw) = original.parts();
        let mut props = decode_properties(raw).unwrap_or_default();
        let new_rk = self.dlrk.clone().unwrap_or_else(|| rk.to_owned());
        // An expired copy loses its `expiration`, kept in its x-death (RabbitMQ's
        // `original-expiration`), so that it does not expire again where it lands.
        let mut original_expiration = None;
        if reason == DeathReason::Expired {
            original_expiration = props.expiration().clone();
            props = without_expiration(props);
        }
        let props = with_x_death(props, &self.source.name, reason.as_str(), exchange, rk, original_expiration.as_ref().map(|e| e.as_str()));
        let copy = Message::new(&self.dlx, &new_rk, &encode_properties(&props), original.body.clone(), original.persistent());
        let mut route = self.env.route(&self.source.vhost, &self.dlx, &new_rk, props.headers().as_ref());
        if let Some(h) = props.headers() {
            route.queues.retain(|t| !is_cycle(h, &t.key.name));
        }
        let (tx, rx) = flume::unbounded();
        // Its own "connection" id: a target on another node answers this flow, not another.
        let conn = crate::broker::ConnId::pseudo();
        let n = route.queues.len();
        let published = crate::observe::sample_at(crate::observe::SamplePoint::DeadLetter).then(Instant::now);
        for target in &route.queues {
            let confirm = ConfirmTo { tx: tx.clone(), conn, channel: crate::broker::ChannelId(0), chan_uid: 0, seq };
            self.env.send(target, QueueOp::Publish { message: copy.clone(), confirm: Some(confirm), published, credit: None });
        }
        drop(tx);
        let mut stored = 0;
        while stored < n {
            match rx.recv_async().await {
                Ok(ClientEvent::Stored { ok: true, .. }) => stored += 1,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        stored == n
    }
}

/// RabbitMQ's dead-letter cycle check: a copy whose `x-death` (newest first, this death
/// included) already names `target`, with no `rejected` death since that entry, would go
/// round for ever (e.g. a `maxlen` queue dead-lettering into itself): it is not sent there.
/// A cycle with a rejection in it is a client's choice and goes on.
pub fn is_cycle(headers: &FieldTable, target: &str) -> bool {
    let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else { return false };
    let field = |t: &FieldTable, k: &str| match t.inner().get(k) {
        Some(AMQPValue::LongString(v)) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(v)) => v.as_str().to_owned(),
        _ => String::new(),
    };
    for d in deaths.as_slice() {
        let AMQPValue::FieldTable(t) = d else { continue };
        if field(t, "reason") == DeathReason::Rejected.as_str() {
            return false;
        }
        if field(t, "queue") == target {
            return true;
        }
    }
    false
}

/// `props` without their `expiration` (amq-protocol has no setter that clears a field).
pub fn without_expiration(p: AMQPProperties) -> AMQPProperties {
    let mut n = AMQPProperties::default();
    macro_rules! keep {
        ($($get:ident => $set:ident),*) => {$( if let Some(v) = p.$get().clone() { n = n.$set(v); } )*};
    }
    keep!(content_type => with_content_type, content_encoding => with_content_encoding, headers => with_headers,
        delivery_mode => with_delivery_mode, priority => with_priority, correlation_id => with_correlation_id,
        reply_to => with_reply_to, message_id => with_message_id, timestamp => with_timestamp, kind => with_type,
        user_id => with_user_id, app_id => with_app_id, cluster_id => with_cluster_id);
    n
}

/// Adds or updates the `x-death` header as RabbitMQ writes it: an array of tables, most
/// recent first, one per (queue, reason), with `count`, `reason`, `queue`, `time`
/// (seconds), `exchange`, `routing-keys` and, for a message that expired by its own
/// `expiration`, `original-expiration`; plus `x-first-death-{reason,queue,exchange}`
/// once and `x-last-death-{reason,queue,exchange}` every time (RabbitMQ docs, "Dead Letter
/// Exchanges", "Dead-Lettered Messages").
pub fn with_x_death(
    props: AMQPProperties,
    queue: &str,
    reason: &str,
    exchange: &str,
    routing_key: &str,
    original_expiration: Option<&str>,
) -> AMQPProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut deaths: Vec<AMQPValue> = match headers.inner().get("x-death") {
        Some(AMQPValue::FieldArray(a)) => a.as_slice().to_vec(),
        _ => Vec::new(),
    };
    let same = |t: &FieldTable| {
        let s = |k: &str| match t.inner().get(k) {
            Some(AMQPValue::LongString(v)) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
            Some(AMQPValue::ShortString(v)) => v.as_str().to_owned(),
            _ => String::new(),
        };
        s("queue") == queue && s("reason") == reason
    };
    let mut entry = None;
    if let Some(i) = deaths.iter().position(|d| matches!(d, AMQPValue::FieldTable(t) if same(t))) {
        if let AMQPValue::FieldTable(t) = deaths.remove(i) {
            entry = Some(t);
        }
    }
    let mut t = entry.unwrap_or_default();
    let count = match t.inner().get("count") {
        Some(AMQPValue::LongLongInt(c)) => *c + 1,
        Some(AMQPValue::LongInt(c)) => *c as i64 + 1,
        _ => 1,
    };
    t.insert("count".into(), AMQPValue::LongLongInt(count));
    t.insert("reason".into(), AMQPValue::LongString(LongString::from(reason)));
    t.insert("queue".into(), AMQPValue::LongString(LongString::from(queue)));
    t.insert("time".into(), AMQPValue::Timestamp(now));
    t.insert("exchange".into(), AMQPValue::LongString(LongString::from(exchange)));
    let mut keys = FieldArray::default();
    keys.push(AMQPValue::LongString(LongString::from(routing_key)));
    t.insert("routing-keys".into(), AMQPValue::FieldArray(keys));
    if let Some(e) = original_expiration {
        t.insert("original-expiration".into(), AMQPValue::LongString(LongString::from(e)));
    }
    deaths.insert(0, AMQPValue::FieldTable(t));
    headers.insert("x-death".into(), AMQPValue::FieldArray(FieldArray::from(deaths)));
    for (k, v) in [("x-first-death-reason", reason), ("x-first-death-queue", queue), ("x-first-death-exchange", exchange)] {
        if !headers.inner().contains_key(k) {
            headers.insert(ShortString::from(k), AMQPValue::LongString(LongString::from(v)));
        }
    }
    for (k, v) in [("x-last-death-reason", reason), ("x-last-death-queue", queue), ("x-last-death-exchange", exchange)] {
        headers.insert(ShortString::from(k), AMQPValue::LongString(LongString::from(v)));
    }
    props.with_headers(headers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn x_death_counts_per_queue_and_reason() {
        let p = with_x_death(AMQPProperties::default(), "src", "rejected", "", "src", None);
        let p = with_x_death(p, "src", "rejected", "", "src", None);
        let h = p.headers().clone().unwrap();
        let AMQPValue::FieldArray(a) = h.inner().get("x-death").unwrap() else { panic!() };
        assert_eq!(a.as_slice().len(), 1);
        let AMQPValue::FieldTable(t) = &a.as_slice()[0] else { panic!() };
        assert_eq!(t.inner().get("count"), Some(&AMQPValue::LongLongInt(2)));
        assert_eq!(h.inner().get("x-first-death-queue"), Some(&AMQPValue::LongString("src".into())));
        let p = with_x_death(p, "other", "maxlen", "x", "k", None);
        let h = p.headers().clone().unwrap();
        let AMQPValue::FieldArray(a) = h.inner().get("x-death").unwrap() else { panic!() };
        assert_eq!(a.as_slice().len(), 2);
        // The first death stays, the last one follows each death.
        let got = |k: &str| h.inner().get(k).cloned();
        assert_eq!(got("x-first-death-queue"), Some(AMQPValue::LongString("src".into())));
        assert_eq!(got("x-first-death-reason"), Some(AMQPValue::LongString("rejected".into())));
        assert_eq!(got("x-last-death-queue"), Some(AMQPValue::LongString("other".into())));
        assert_eq!(got("x-last-death-reason"), Some(AMQPValue::LongString("maxlen".into())));
        assert_eq!(got("x-last-death-exchange"), Some(AMQPValue::LongString("x".into())));
    }

    fn holder(chan_uid: u64, tx: &flume::Sender<ClientEvent>) -> Outstanding {
        let holder =
            Holder { conn: crate::broker::ConnId(1), channel: crate::broker::ChannelId(chan_uid as u16), chan_uid, tx: tx.clone() };
        Outstanding { consumer: None, holder, since: Instant::now(), credit: None, redelivered: false, sampled: false }
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Deliver the next offset to channel incarnation c.
        Deliver(u64),
        /// Channel c settles these offsets (by index into all offsets so far) as ack,
        /// requeue and reject.
        Settle(u64, Vec<usize>, Vec<usize>, Vec<usize>),
        Close(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let offs = || proptest::collection::vec(any::<usize>(), 0..6);
        prop_oneof![
            4 => (0u64..4).prop_map(Op::Deliver),
            4 => (0u64..4, offs(), offs(), offs()).prop_map(|(c, a, r, j)| Op::Settle(c, a, r, j)),
            1 => (0u64..4).prop_map(Op::Close),
        ]
    }

    proptest! {
        /// Rules 1, 5 and 8 as a user sees them: a delivery is settled at most once, only by
        /// the channel holding it; a settlement from any other channel changes nothing;
        /// closing a channel requeues exactly what it holds; nothing settled is lost or
        /// appears in two actions.
        #[test]
        fn settlement_belongs_to_the_holder(ops in proptest::collection::vec(op(), 1..120), dlx in any::<bool>()) {
            let (tx, _rx) = flume::unbounded();
            let mut held = Held::default();
            let mut model: BTreeMap<u64, u64> = BTreeMap::new(); // offset → holder chan_uid
            let mut next = 0u64;
            for op in ops {
                match op {
                    Op::Deliver(c) => {
                        held.hold(next, holder(c, &tx));
                        model.insert(next, c);
                        next += 1;
                    }
                    Op::Settle(c, a, r, j) => {
                        let pick = |v: &[usize]| -> Vec<Offset> { v.iter().map(|i| Offset((*i as u64) % next.max(1))).collect() };
                        let (a, r, j) = (pick(&a), pick(&r), pick(&j));
                        let act = held.settle(c, &a, &r, &j, dlx);
                        let mut seen = std::collections::BTreeSet::new();
                        for (list, from) in [(&act.ack, &a), (&act.requeue, &r), (&act.drop, &j), (&act.dead_letter, &j)] {
                            for (off, o) in list.iter() {
                                prop_assert!(seen.insert(*off), "offset {} settled twice", off);
                                prop_assert_eq!(o.holder.chan_uid, c);
                                prop_assert!(from.contains(&Offset(*off)));
                                prop_assert_eq!(model.remove(off), Some(c));
                            }
                        }
                        let unused_kind_empty = if dlx { act.drop.is_empty() } else { act.dead_letter.is_empty() };
                        prop_assert!(unused_kind_empty, "rejects go to one place");
                        // Whatever this channel named and held is settled now.
                        for off in a.iter().chain(&r).chain(&j) {
                            prop_assert!(model.get(&off.0) != Some(&c));
                        }
                    }
                    Op::Close(c) => {
                        let act = held.close_channel(c);
                        let want: Vec<u64> = model.iter().filter(|(_, h)| **h == c).map(|(o, _)| *o).collect();
                        let got: Vec<u64> = act.requeue.iter().map(|(o, _)| *o).collect();
                        prop_assert_eq!(&got, &want);
                        prop_assert!(act.ack.is_empty() && act.drop.is_empty() && act.dead_letter.is_empty());
                        model.retain(|_, h| *h != c);
                    }
                }
                prop_assert_eq!(held.len(), model.len());
                for (off, c) in &model {
                    prop_assert_eq!(held.get(*off).map(|o| o.holder.chan_uid), Some(*c));
                }
            }
        }
    }

    #[test]
    fn scan_keeps_one_record_per_live_message() {
        let rec = |offset| IndexRecord { node: 1, epoch: 1, conn: 1, channel: 1, time_ms: 0, offset, vhost: "/".into(), queue: "q".into() };
        let held = vec![(10, rec(5)), (11, rec(6)), (12, rec(5)), (13, rec(7))];
        let (index_of, stale) = scan(&held, |o| o != 6);
        assert_eq!(index_of.get(&5), Some(&10), "the first record of a live message stays");
        assert_eq!(index_of.get(&7), Some(&13));
        assert_eq!(stale, vec![11, 12], "a dead message's record and a second record go");
    }

    #[test]
    fn timed_out_names_each_channel_once() {
        let (tx, _rx) = flume::unbounded();
        let mut held = Held::default();
        for off in 0..3 {
            held.hold(off, holder(off % 2, &tx));
        }
        let later = Instant::now() + std::time::Duration::from_secs(5);
        let mut chans: Vec<u64> = held.timed_out(later, std::time::Duration::from_secs(1)).iter().map(|h| h.chan_uid).collect();
        chans.sort_unstable();
        assert_eq!(chans, vec![0, 1]);
        assert!(held.timed_out(Instant::now(), std::time::Duration::from_secs(60)).is_empty());
    }
}
