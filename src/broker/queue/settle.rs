//! Every transition of a delivered message, on its queue's owner core.
//!
//! A message is *ready*, *outstanding* (delivered to exactly one channel, unsettled) or
//! *deleted*. The rules (DESIGN.md, "The ack path"), in the order each function runs them:
//!
//! 1. **One consumer at a time.** Only the owner core moves an offset out of the ready set,
//!    and it records the holder before the delivery leaves the core ([`Queue::step`]).
//! 2. **Index before cursor.** A tracked delivery of a persistent message in a durable
//!    queue appends an unacked-index record ([`super::index`]); the cursor commit that
//!    passes it needs the index's `Synced` token ([`super::Queue`]'s `commit_cursor`).
//! 3. **New copy before old delete.** [`reject`] dead-letters by publishing the new copy
//!    with a confirm ticket, and deletes the original only after every target queue has
//!    stored (and, for durable targets, synced) it.
//! 4. **Ack is two deletes**: the message's offset in its shard ([`Queue::ack`]) and its
//!    unacked-index record — the latter only after the message shard's next sync
//!    (`Queue::trash_index`), so a record never goes before its message: a requeued
//!    message keeps its record, and after any crash a delivered message comes back flagged.
//! 5. **One requeue primitive**, [`Queue::requeue`], behind basic.nack(requeue),
//!    basic.reject(requeue), basic.recover(requeue), channel/connection close and the
//!    acknowledgement timeout. A requeued offset is delivered again with redelivered=true,
//!    before never-delivered messages (original position).
//! 6. Settling an offset the queue does not hold outstanding is a no-op: the channel's
//!    ledger has already answered 406 for unknown tags, so a repeat here can only be a
//!    race with a close, and must not delete or duplicate anything.
//!
//! [`Queue::step`]: super::Queue

use std::rc::Rc;

use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};

use super::{Queue, QueueCell};
use crate::broker::message::{decode_properties, encode_properties, Message};
use crate::broker::{ClientEvent, ConfirmTo, QueueOp};

impl Queue {
    /// Takes an offset out of the outstanding set and returns its holder's prefetch credit.
    /// Every transition of a delivered message starts here; its unacked-index record stays
    /// until the message itself is deleted durably (`Queue::trash_index`, rule 4's second
    /// delete).
    pub(super) fn settle_one(&mut self, offset: u64) -> Option<super::Outstanding> {
        let o = self.outstanding.remove(&offset)?;
        if let Some(credit) = &o.credit {
            credit.give();
        }
        if let Some(cid) = o.consumer {
            if let Some(c) = self.consumers.get_mut(cid) {
                c.in_flight = c.in_flight.saturating_sub(1);
            }
        }
        Some(o)
    }

    /// basic.ack: rule 4, delete each settled offset from the shard.
    pub fn ack(&mut self, offsets: &[u64]) {
        let mut done = Vec::with_capacity(offsets.len());
        let now = std::time::Instant::now();
        for &off in offsets {
            if let Some(o) = self.settle_one(off) {
                self.env.stats().delivered_to_acked.record(now.duration_since(o.since));
                self.redelivered.remove(&off);
                self.trash_index(off);
                done.push(off);
            }
        }
        if !done.is_empty() {
            self.dirty = true;
            if let Err(e) = self.shard.delete_by_offsets(&done) {
                tracing::error!(queue = %self.qref.key.name, error = %e, "ack delete failed");
            }
            self.wake();
        }
    }

    /// The requeue primitive (rule 5): back to the ready set at the original position,
    /// flagged redelivered.
    pub fn requeue(&mut self, offsets: &[u64]) {
        let mut any = false;
        for &off in offsets {
            if self.settle_one(off).is_some() {
                self.redelivered.insert(off);
                self.requeued.insert(off);
                any = true;
            }
        }
        if any {
            self.wake();
        }
    }
}

/// basic.reject / basic.nack with requeue=false: dead-letter through the queue's
/// `x-dead-letter-exchange` when it has one, else drop (delete).
pub fn reject(cell: &QueueCell, offsets: Vec<u64>) {
    if offsets.is_empty() {
        return;
    }
    let mut q = cell.borrow_mut();
    let mut mine = Vec::with_capacity(offsets.len());
    for off in offsets {
        if q.settle_one(off).is_some() {
            mine.push(off);
        }
    }
    if mine.is_empty() {
        return;
    }
    q.wake();
    let Some(dlx) = q.dead_letter_exchange.clone() else {
        for &off in &mine {
            q.redelivered.remove(&off);
            q.trash_index(off);
        }
        q.dirty = true;
        if let Err(e) = q.shard.delete_by_offsets(&mine) {
            tracing::error!(queue = %q.qref.key.name, error = %e, "reject delete failed");
        }
        return;
    };
    let dlrk = q.dead_letter_routing_key.clone();
    let shard = q.shard.clone();
    let source = q.qref.key.clone();
    let env = q.env.clone();
    drop(q);
    let weak = Rc::downgrade(cell);
    glommio::spawn_local(async move {
        futures_lite::future::yield_now().await;
        for off in mine {
            let rec = match shard.read(off).await {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "dead-letter read failed; message kept");
                    continue;
                }
            };
            let original = Message { header: rec.header, body: rec.body, flags: rec.flags };
            let (exchange, rk, raw) = original.parts();
            let props = decode_properties(raw).unwrap_or_default();
            let (new_rk, props) = (dlrk.clone().unwrap_or_else(|| rk.to_owned()), props);
            let props = with_x_death(props, &source.name, "rejected", exchange, rk);
            let copy = Message::new(&dlx, &new_rk, &encode_properties(&props), original.body.clone(), original.persistent());
            let route = env.route(&source.vhost, &dlx, &new_rk, props.headers().as_ref());
            // Rule 3: the new copy is stored in every target before the original goes.
            let (tx, rx) = flume::unbounded();
            let n = route.queues.len();
            let published = crate::observe::sample().then(std::time::Instant::now);
            for target in &route.queues {
                let confirm = ConfirmTo { tx: tx.clone(), channel: 0, seq: off };
                env.send(target, QueueOp::Publish { message: copy.clone(), confirm: Some(confirm), published });
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
            if stored < n {
                tracing::error!(offset = off, "dead-letter copy not stored everywhere; original kept");
                continue;
            }
            if let Some(cell) = weak.upgrade() {
                let mut q = cell.borrow_mut();
                q.redelivered.remove(&off);
                q.trash_index(off);
                q.dirty = true;
                if let Err(e) = q.shard.delete_by_offsets(&[off]) {
                    tracing::error!(error = %e, "dead-letter delete failed");
                }
            }
        }
    })
    .detach();
}

/// Adds or updates the `x-death` header as RabbitMQ writes it: an array of tables, most
/// recent first, one per (queue, reason), with `count`, `reason`, `queue`, `time`
/// (seconds), `exchange` and `routing-keys`; plus `x-first-death-{reason,queue,exchange}`
/// once (RabbitMQ docs, "Dead Letter Exchanges", "Dead-Lettered Messages").
pub fn with_x_death(props: AMQPProperties, queue: &str, reason: &str, exchange: &str, routing_key: &str) -> AMQPProperties {
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
    deaths.insert(0, AMQPValue::FieldTable(t));
    headers.insert("x-death".into(), AMQPValue::FieldArray(FieldArray::from(deaths)));
    for (k, v) in [("x-first-death-reason", reason), ("x-first-death-queue", queue), ("x-first-death-exchange", exchange)] {
        if !headers.inner().contains_key(k) {
            headers.insert(ShortString::from(k), AMQPValue::LongString(LongString::from(v)));
        }
    }
    props.with_headers(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x_death_counts_per_queue_and_reason() {
        let p = with_x_death(AMQPProperties::default(), "src", "rejected", "", "src");
        let p = with_x_death(p, "src", "rejected", "", "src");
        let h = p.headers().clone().unwrap();
        let AMQPValue::FieldArray(a) = h.inner().get("x-death").unwrap() else { panic!() };
        assert_eq!(a.as_slice().len(), 1);
        let AMQPValue::FieldTable(t) = &a.as_slice()[0] else { panic!() };
        assert_eq!(t.inner().get("count"), Some(&AMQPValue::LongLongInt(2)));
        assert_eq!(h.inner().get("x-first-death-queue"), Some(&AMQPValue::LongString("src".into())));
        let p = with_x_death(p, "other", "rejected", "x", "k");
        let h = p.headers().clone().unwrap();
        let AMQPValue::FieldArray(a) = h.inner().get("x-death").unwrap() else { panic!() };
        assert_eq!(a.as_slice().len(), 2);
    }
}
