//! Dispatch: the queue's dispatcher task and everything that hands a message out —
//! consumer deliveries ([`Queue::deliver`]), basic.get ([`basic_get`]), reading a backlog
//! back from disk ([`read_ahead`]), the unacked-index record a tracked delivery gets
//! (rule 2's first half, [`Queue::index_delivery`]) and the cursor's target.
//!
//! Rule numbers are DESIGN.md's, listed in [`super::settle`].
//!
//! # Invariants
//! - An offset is claimed from the ready set only when a consumer with credit exists
//!   (rule 10) or a basic.get asked; it is recorded in [`super::settle::Held`] before the
//!   delivery leaves the core (rule 1).
//! - A delivery with an index record leaves only after that record is synced
//!   ([`super::durability`]).

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::time::Instant;

use bytes::Bytes;
use ringmq_shards::{Record, Shard};

use super::consumer;
use super::durability::{commit_cursor, reply_get, GetSync};
use super::index::{now_ms, IndexRecord};
use super::settle::Outstanding;
use super::{once_a_second, Queue, QueueCell, INDEX_FAILURE_LOGGED};
use crate::broker::message::Message;
use crate::broker::{ClientEvent, ConsumerId, Deliveries, Delivery, GetReply, Holder, Offset, QueueError};
use crate::observe::Stage;

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

/// The dispatcher task of one queue: delivers while consumers have credit and messages
/// are ready; sleeps until woken by a publish, a settle, or a consumer change.
pub(super) async fn dispatcher(weak: Weak<RefCell<Queue>>, wake: flume::Receiver<()>) {
    while wake.recv_async().await.is_ok() {
        let mut sent = 0u32;
        loop {
            let Some(cell) = weak.upgrade() else { return };
            // Deliveries of one synchronous stretch gather per consumer; every path out of
            // the stretch (an await, the end) sends them first.
            let step = {
                let mut q = cell.borrow_mut();
                // This step sees everything a wake until now announced.
                q.wake_pending.set(false);
                q.batching = true;
                let step = q.step();
                if !matches!(step, Step::Sent) {
                    q.flush_deliveries();
                }
                step
            };
            match step {
                Step::Idle => {
                    cell.borrow_mut().egress_idle(&cell);
                    break;
                }
                Step::Backlogged => {
                    cell.borrow_mut().check_egress();
                    drop(cell);
                    Queue::flush_unsynced_soon(&weak);
                    glommio::timer::sleep(std::time::Duration::from_millis(1)).await;
                }
                Step::Sent => {
                    sent += 1;
                    if sent.is_multiple_of(256) {
                        {
                            let mut q = cell.borrow_mut();
                            q.flush_deliveries();
                            q.check_egress();
                        }
                        drop(cell);
                        Queue::flush_unsynced_soon(&weak);
                        glommio::yield_if_needed().await;
                    }
                }
                Step::Read { offset, consumer } => {
                    cell.borrow_mut().check_egress();
                    let shard = cell.borrow().shard.clone();
                    drop(cell);
                    let run = read_ahead(&shard, offset).await;
                    let Some(cell) = weak.upgrade() else { return };
                    let mut q = cell.borrow_mut();
                    q.paging -= 1;
                    match run {
                        Ok(recs) if !q.deleted => {
                            // Entries below the one read were settled elsewhere; whatever
                            // else nobody took is dropped past a bound.
                            q.paged = q.paged.split_off(&offset);
                            if q.paged.len() > MAX_PAGED_RECORDS {
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
                            if let Some(rec) = first.filter(|r| !q.expire_if_due(r)) {
                                q.deliver(consumer, rec);
                            }
                        }
                        Ok(_) => {}
                        Err(e) => {
                            tracing::error!(queue = %q.qref.key.name, error = %e, "read failed; message left in place");
                            q.unclaim(offset);
                            // The dispatcher now waits for a wake: held publishers must not
                            // wait with it (`egress.rs`, rule 3).
                            drop(q.egress.release());
                            break;
                        }
                    }
                }
            }
        }
        Queue::flush_unsynced_soon(&weak);
    }
}

/// Records from which one read-ahead stops reading from disk.
pub const READ_AHEAD_RECORDS: usize = 1024;
/// Body bytes from which one read-ahead stops reading from disk.
pub const READ_AHEAD_BYTES: usize = 4 << 20;
/// Most records a queue's page buffer keeps; past it, entries nobody took are dropped.
pub const MAX_PAGED_RECORDS: usize = 1 << 16;

/// Reads the live records from `offset` on until [`READ_AHEAD_RECORDS`] or
/// [`READ_AHEAD_BYTES`] are reached, plus the rest of the last disk read (up to
/// `ringmq_shards::READ_WINDOW` bytes, already paid for: at 16 B a window holds ~17,000
/// records, and dropping all but 1,024 of them cost the backlog drain most of its time),
/// with the shard's sequential reader (a few large disk reads instead of one read per
/// message) — for a consumer draining a backlog that left the cache.
pub async fn read_ahead(shard: &Shard, offset: u64) -> Result<Vec<Record>, ringmq_shards::StoreError> {
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
    out.extend(std::iter::from_fn(|| reader.next_buffered()));
    Ok(out)
}

/// basic.get: claims the next ready message for `holder`.
pub(super) fn basic_get(cell: &QueueCell, no_ack: bool, holder: Holder, reply: crate::broker::Reply<Result<Option<GetReply>, QueueError>>) {
    let mut q = cell.borrow_mut();
    // `ttl.rs`, rule 2: an expired message is never the answer.
    q.expire_head();
    let offset = loop {
        if q.held_back() {
            // A replicated queue's message past its delivery reservation (`replica.rs`, step 5).
            q.park_get((no_ack, holder, reply));
            return;
        }
        let Some(offset) = q.take_next() else {
            let _ = reply.send(Ok(None));
            return;
        };
        match q.paged.remove(&offset).or_else(|| q.shard.read_cached(offset)) {
            Some(rec) if q.expire_if_due(&rec) => continue,
            Some(rec) => {
                let (r, sync) = q.finish_get(rec, no_ack, holder);
                drop(q);
                reply_get(r, sync, reply);
                return;
            }
            None => break offset,
        }
    };
    q.paging += 1;
    let shard = q.shard.clone();
    drop(q);
    let weak = Rc::downgrade(cell);
    crate::core::spawn_soon(async move {
        let rec = shard.read(offset).await;
        let Some(cell) = weak.upgrade() else { return };
        let mut q = cell.borrow_mut();
        q.paging -= 1;
        match rec {
            Ok(Some(rec)) if q.expire_if_due(&rec) => {
                // Expired: the next message is the answer.
                drop(q);
                basic_get(&cell, no_ack, holder, reply);
            }
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
    });
}

impl Queue {
    /// Claims the next ready offset (the lowest: rule 5's order), recording its
    /// enqueued→taken time when it was sampled.
    pub(super) fn take_next(&mut self) -> Option<u64> {
        let (offset, stored_at) = self.ready.take_next()?;
        self.counters.delivered += 1;
        if let Some(t) = &self.ttl {
            // The head changed (`ttl.rs`, rule 3).
            t.notify();
        }
        if let Some(at) = stored_at {
            self.stage(Stage::EnqueuedToTaken, at.elapsed());
        }
        Some(offset)
    }

    /// Records a sampled message's time in a per-queue `stage`, for the queue and its node.
    pub(super) fn stage(&self, stage: Stage, d: std::time::Duration) {
        self.env.stats().stages.record(stage, d);
        self.stages.record(stage, d);
    }

    /// Puts a claimed but undelivered offset back at its original position (not redelivered).
    pub(super) fn unclaim(&mut self, offset: u64) {
        self.ready.unclaim(offset);
    }

    /// One dispatcher step: deliver one cached message, or claim one that must be read.
    fn step(&mut self) -> Step {
        if self.ttl.is_some() && !self.consumers.is_empty() {
            // `ttl.rs`, rule 2: the expired head goes before a delivery is claimed.
            self.expire_head();
        }
        if self.deleted || self.consumers.is_empty() || self.message_count() == 0 {
            return Step::Idle;
        }
        if !self.may_deliver() {
            // A replicated queue cut off from the metadata leader (`replica.rs`): retried
            // while it has consumers, delivering again once a leader is known.
            return Step::Backlogged;
        }
        let Some(consumer) = self.consumers.next_with_credit().map(|c| c.spec.id) else {
            return if self.consumers.any_backlogged() { Step::Backlogged } else { Step::Idle };
        };
        if self.held_back() {
            // Past a replicated queue's delivery reservation (`replica.rs`, step 5): woken
            // when the next one is committed.
            return Step::Idle;
        }
        let offset = self.take_next().expect("message_count > 0");
        match self.paged.remove(&offset).or_else(|| self.shard.read_cached(offset)) {
            Some(rec) => {
                if !self.expire_if_due(&rec) {
                    self.deliver(consumer, rec);
                }
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
    /// unacked index first and leaves the core at once when it lies below the queue's
    /// durable delivery reservation (`reserve.rs`), else only once that record is synced
    /// ([`Queue::flush_unsynced`]): after any crash, a message that reached a client is
    /// known to have been delivered (redelivered=true), never silently handed out again.
    /// Tracked deliveries behind a waiting one wait with it, so none overtakes it.
    pub(super) fn deliver(&mut self, consumer: ConsumerId, rec: Record) {
        let offset = rec.offset;
        let flags = rec.flags;
        let redelivered = self.ready.is_redelivered(offset);
        let message = self.as_delivered(offset, Message { header: rec.header, body: rec.body, flags });
        let Some(c) = self.consumers.get_mut(consumer) else {
            self.unclaim(offset);
            return;
        };
        let track = !c.spec.no_ack;
        // Delivery-side stages follow one delivery in 16 (`observe::stages`).
        let taken = crate::observe::sample_delivery().then(Instant::now);
        let weight = consumer::pending_weight(message.body.len());
        c.spec.pending_bytes.fetch_add(weight, std::sync::atomic::Ordering::Relaxed);
        let mut index_offset = None;
        if track {
            c.in_flight += 1;
            c.spec.channel_credit.take();
            let credit = Some(c.spec.channel_credit.clone());
            let holder = Holder { conn: c.spec.conn, channel: c.spec.channel, chan_uid: c.spec.chan_uid, tx: c.spec.tx.clone() };
            index_offset = self.index_delivery(offset, flags, &holder);
            let since = taken.unwrap_or_else(Instant::now);
            let sampled = taken.is_some();
            self.held.hold(offset, Outstanding { consumer: Some(consumer), holder, since, credit, redelivered, sampled });
        }
        self.passed(offset);
        // Queue order (AMQP 0-9-1 section 4.7): a tracked delivery that needs no index record
        // (a transient message) must not overtake one still waiting for its record's sync,
        // so while any waits (or a flush round is on its way) it waits with them.
        // A delivery below the reservation (`reserve.rs`) needs no sync of its record first.
        let wait = (index_offset.is_some() && !self.reserved_for(offset)) || (track && (self.index_flushing || !self.unsynced.is_empty()));
        if self.batching && !wait {
            // Sent with the rest of this stretch (`flush_deliveries`), before the dispatcher
            // awaits. A batch names its consumer and queue once: a delivery added to one
            // touches no reference count of theirs (shared with the consumer's core).
            if let Some((_, b)) = self.batched.iter_mut().find(|(id, _)| *id == consumer) {
                b.items.push((Offset(offset), redelivered, message, taken));
                return;
            }
        }
        let c = self.consumers.get(consumer).expect("the consumer delivered to");
        let d = Delivery {
            channel: c.spec.channel,
            chan_uid: c.spec.chan_uid,
            consumer_tag: c.spec.tag.clone(),
            queue: self.qref.clone(),
            offset: Offset(offset),
            redelivered,
            message,
            track,
            taken,
        };
        if wait {
            let pending = c.spec.pending_bytes.clone();
            self.unsynced.push((consumer, d, pending));
            return;
        }
        if self.batching {
            // The consumer's first delivery of this stretch (its batch is found above).
            let Delivery { channel, chan_uid, consumer_tag, queue, offset, redelivered, message, track, taken } = d;
            let items = vec![(offset, redelivered, message, taken)];
            self.batched.push((consumer, Deliveries { channel, chan_uid, consumer_tag, queue, track, items }));
            return;
        }
        let (tx, pending) = match self.consumers.get_mut(consumer) {
            Some(c) => (c.spec.tx.clone(), c.spec.pending_bytes.clone()),
            None => return,
        };
        if tx.send(ClientEvent::Deliver(d)).is_err() {
            pending.fetch_sub(weight, std::sync::atomic::Ordering::Relaxed);
            self.undeliverable(consumer, &[offset], track);
            return;
        }
        if !track {
            // Auto-ack: settled on delivery (rule 4).
            self.delete(&[offset]);
        }
    }

    /// Deliveries of `offsets` to `consumer` that could not be sent: its connection is gone
    /// (its close will settle the rest), so the consumer goes and the offsets come back to
    /// their places, unclaimed and not redelivered (held ones released first).
    fn undeliverable(&mut self, consumer: ConsumerId, offsets: &[u64], track: bool) {
        self.consumers.remove(consumer);
        for &offset in offsets {
            if let Some(o) = self.held.release(offset) {
                self.release(&o);
                self.unclaim(offset);
            } else if !track {
                self.unclaim(offset);
            }
        }
    }

    /// Sends what the dispatcher gathered in this stretch (`batching`), one event per
    /// consumer, and ends the stretch. Auto-ack deliveries are settled once sent (rule 4); a
    /// consumer whose connection is gone loses its place, and its deliveries go back
    /// (rule 5's order: unclaimed, not redelivered).
    pub(super) fn flush_deliveries(&mut self) {
        self.batching = false;
        for (consumer, b) in std::mem::take(&mut self.batched) {
            let weight: usize = b.items.iter().map(|(_, _, m, _)| consumer::pending_weight(m.body.len())).sum();
            let offsets: Vec<u64> = b.items.iter().map(|(o, ..)| o.0).collect();
            let track = b.track;
            let sent = self
                .consumers
                .get_mut(consumer)
                .map(|c| (c.spec.tx.send(ClientEvent::Deliveries(b)).is_ok(), c.spec.pending_bytes.clone()));
            match sent {
                Some((true, _)) => {
                    if !track {
                        self.delete(&offsets);
                    }
                }
                failed => {
                    if let Some((_, pending)) = failed {
                        pending.fetch_sub(weight, std::sync::atomic::Ordering::Relaxed);
                    }
                    self.undeliverable(consumer, &offsets, track);
                }
            }
        }
    }

    /// Rule 2, first half: a tracked delivery of a persistent message in a durable queue
    /// gets an unacked-index record (appended now, synced before the cursor passes it).
    fn index_delivery(&mut self, offset: u64, flags: u8, holder: &Holder) -> Option<u64> {
        let index = self.index.clone()?;
        if flags & crate::broker::message::FLAG_PERSISTENT == 0 {
            return None;
        }
        if self.replicated() {
            // A replicated queue's deliveries lie below its reservation, committed in the
            // Raft log before they leave (`replica.rs`, step 5): that is what flags them after
            // a crash or a failover, so they wait for no index fdatasync.
            return None;
        }
        let meta = self.env.meta();
        let rec = IndexRecord {
            node: meta.node_id(),
            epoch: meta.boot_epoch(),
            conn: holder.conn.0,
            channel: holder.channel.0,
            time_ms: now_ms(),
            offset,
            vhost: self.qref.key.vhost.to_string(),
            queue: self.qref.key.name.to_string(),
        };
        match index.append(0, &rec.encode(), &Bytes::new()) {
            Ok(i) => {
                // A record from an earlier delivery (requeued since) is replaced: the new
                // one is synced before this delivery leaves, the old one goes only after
                // that sync (`index_superseded`), so a crash in between leaves one of them.
                if let Some(old) = self.index_of.insert(offset, i) {
                    self.index_superseded.push(old);
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
    /// A priority queue's cursor moves only to its ready set's floor, below which everything
    /// was delivered (`ready.rs`, "Priorities and the cursor").
    fn passed(&mut self, offset: u64) {
        let next = self.ready.delivered_floor().unwrap_or(offset + 1);
        if self.index.is_none() || next <= self.cursor.target {
            return;
        }
        self.cursor.target = next;
        if !self.cursor.committing {
            self.cursor.committing = true;
            crate::core::spawn_soon(commit_cursor(self.me.clone()));
        }
    }

    /// The stored message at `offset` as it goes to a client: with `x-delivery-count` when
    /// the queue has a delivery limit and the message came back before
    /// (`delivery_limit.rs`, behaviour 3); as stored otherwise.
    fn as_delivered(&self, offset: u64, message: Message) -> Message {
        match self.delivery_limit.as_ref().map_or(0, |d| d.count(offset)) {
            0 => message,
            n => super::delivery_limit::with_delivery_count(message, n),
        }
    }

    /// Claims `rec` for a basic.get; returns the reply and, when the delivery got an
    /// unacked-index record, the index to sync before answering with the superseded records
    /// that sync lets go.
    fn finish_get(&mut self, rec: Record, no_ack: bool, holder: Holder) -> (GetReply, Option<GetSync>) {
        let offset = rec.offset;
        let redelivered = self.ready.is_redelivered(offset);
        let mut sync = None;
        if no_ack {
            // Auto-ack: settled on delivery (rule 4).
            self.delete(&[offset]);
        } else {
            let index_offset = self.index_delivery(offset, rec.flags, &holder);
            if index_offset.is_some() && !self.reserved_for(offset) {
                sync = self.index.clone().map(|index| (index, std::mem::take(&mut self.index_superseded)));
            }
            let sampled = crate::observe::sample_delivery();
            self.held.hold(offset, Outstanding { consumer: None, holder, since: Instant::now(), credit: None, redelivered, sampled });
        }
        self.passed(offset);
        let r = GetReply {
            offset: Offset(offset),
            redelivered,
            message: self.as_delivered(offset, Message { header: rec.header, body: rec.body, flags: rec.flags }),
            message_count: self.message_count(),
        };
        (r, sync)
    }
}
