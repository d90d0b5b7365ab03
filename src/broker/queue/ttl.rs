//! Message TTL: the queue argument `x-message-ttl` and the per-message `expiration`
//! property (RabbitMQ docs, "Time-To-Live and Expiration": per-queue and per-message TTL).
//!
//! # Rules
//! 1. **One deadline, fixed at enqueue, stored with the message.** basic.publish turns an
//!    `expiration` into the deadline publish time + expiration (`amqp::methods::basic`); the
//!    queue's serving member, taking the publish, lowers it to publish time +
//!    `x-message-ttl` ([`Queue::stamp_deadline`]): the smaller TTL wins. The deadline (ms
//!    since the Unix epoch) is written in the record ([`crate::broker::message::FLAG_DEADLINE`])
//!    before the message is stored or proposed, so the replicas, a new server after a
//!    failover, and the queue after a restart or a kill -9 all read the same deadline. A
//!    requeued message keeps its record, so its deadline (RabbitMQ's behaviour).
//! 2. **Never delivered late.** The dispatcher and basic.get take the expired head out
//!    before they claim ([`Queue::expire_head`]), and check the record they claimed
//!    ([`Queue::expire_if_due`]), so a message whose deadline passed — while the broker was
//!    down too — is never handed out.
//! 3. **Expiry at the head, on a timer.** As RabbitMQ's classic queues: only the head
//!    expires; a message with a short per-message TTL behind a longer-lived head goes when it
//!    reaches the head. One task per queue with a TTL ([`expire_at_head`]) sleeps until the
//!    head's deadline, so the depth (queue.declare-ok, metrics) drops with no consumer too;
//!    it is woken when the head may have changed (publish, delivery, requeue).
//! 4. **An expired message** is dead-lettered with reason `expired` when the queue has
//!    `x-dead-letter-exchange` (`settle.rs`, rule 3: the copy, without `expiration` and with
//!    `original-expiration` in its `x-death`, is stored before the original goes), else
//!    deleted as an ack deletes it (rule 4: it never comes back after a restart).
//! 5. **TTL 0** (a deadline already reached at enqueue): delivered at once when it is the
//!    head and a consumer can take it now, else expired at once (RabbitMQ:
//!    `attempt_delivery` before `drop_expired_msgs`).
//! 6. **Replicated queues** (`replica.rs`): only the serving member expires; the delete
//!    goes through its `Settle`, so every member deletes it.
//! 7. **No TTL, no state.** [`Queue::ttl`] stays `None` for a queue without
//!    `x-message-ttl` that never took a message with `expiration`: it pays one branch per
//!    publish, wake and delete, and a record without the flag is read as before.

use std::cell::RefCell;
use std::rc::Weak;
use std::time::Duration;

use ringmq_shards::Record;
use rustc_hash::FxHashMap;

use super::index::now_ms;
use super::settle::DeathReason;
use super::Queue;
use crate::broker::message::{deadline_of, Message, FLAG_DEADLINE};

/// Stands in a deadline map for a message known to have no deadline.
const NO_DEADLINE: u64 = u64::MAX;

/// A queue's TTL state (rule 7: exists only for a queue that has a TTL to care about).
#[derive(Debug)]
pub struct Ttl {
    /// `x-message-ttl` in ms.
    pub queue_ttl: Option<u64>,
    /// Offset → deadline (ms since the Unix epoch; [`NO_DEADLINE`]) of the live messages whose
    /// deadline is known in memory: those enqueued in this run, and heads read back by the
    /// timer. Entries go when their message is deleted.
    deadlines: FxHashMap<u64, u64>,
    /// Wakes the timer task ([`expire_at_head`]).
    timer: flume::Sender<()>,
}

impl Ttl {
    /// The head may have changed: the timer looks again.
    pub fn notify(&self) {
        let _ = self.timer.try_send(());
    }

    /// `offset` is deleted.
    pub fn forget(&mut self, offset: u64) {
        self.deadlines.remove(&offset);
    }
}

/// What the timer does next.
enum Next {
    /// Sleep this long at most (`None`: until woken).
    Wait(Option<Duration>),
    /// Read the head's record to learn its deadline.
    Read(u64, std::rc::Rc<ringmq_shards::Shard>),
}

impl Queue {
    /// The TTL state, started (with its timer task) if the queue has none yet.
    pub(super) fn ttl_mut(&mut self) -> &mut Ttl {
        if self.ttl.is_none() {
            let (timer, rx) = flume::bounded(1);
            self.ttl = Some(Box::new(Ttl { queue_ttl: None, deadlines: FxHashMap::default(), timer }));
            crate::core::spawn_soon(expire_at_head(self.me.clone(), rx));
        }
        self.ttl.as_mut().expect("set above")
    }

    /// Rule 1: `message` with its deadline lowered to now + `x-message-ttl` (unchanged for a
    /// queue without one).
    pub(super) fn stamp_deadline(&self, message: Message) -> Message {
        match self.ttl.as_ref().and_then(|t| t.queue_ttl) {
            Some(ttl) => message.with_deadline(now_ms() + ttl),
            None => message,
        }
    }

    /// A message with deadline `deadline` entered the ready set at `offset` (a publish, or an
    /// `Enqueue` applied): its deadline is remembered, the timer looks again, and one already
    /// reached is handled as rule 5 says.
    pub(super) fn enqueued_with_deadline(&mut self, offset: u64, deadline: u64) {
        let ttl = self.ttl_mut();
        ttl.deadlines.insert(offset, deadline);
        ttl.notify();
        if deadline <= now_ms() {
            self.enqueued_due(offset);
        }
    }

    /// Rule 5: delivered now when it is the head and a consumer can take it, else expired.
    fn enqueued_due(&mut self, offset: u64) {
        let head = self.ready.len() == 1 && self.ready.peek_next() == Some(offset);
        if head && !self.deleted && self.may_deliver() && !self.held_back() {
            if let Some(c) = self.consumers.next_with_credit().map(|c| c.spec.id) {
                if let Some(rec) = self.shard.read_cached(offset) {
                    let _ = self.take_next();
                    self.deliver(c, rec);
                    // The dispatcher's round flushes what waits for an index sync.
                    self.wake();
                    return;
                }
            }
        }
        self.expire_head();
    }

    /// The deadline of ready `offset` if it is known without a disk read (`None`: unknown).
    fn known_deadline(&self, offset: u64) -> Option<u64> {
        if let Some(d) = self.ttl.as_ref().and_then(|t| t.deadlines.get(&offset)) {
            return Some(*d);
        }
        let rec = self.paged.get(&offset).cloned().or_else(|| self.shard.read_cached(offset))?;
        Some(deadline_of(rec.flags, &rec.header).unwrap_or(NO_DEADLINE))
    }

    /// Rules 2 and 3: takes the expired messages at the head out of the ready set and expires
    /// them (rule 4). Only the serving member decides (rule 6).
    pub(super) fn expire_head(&mut self) {
        if self.ttl.is_none() || !self.serving() || self.deleted {
            return;
        }
        let now = now_ms();
        let mut expired = Vec::new();
        while let Some(offset) = self.ready.peek_next() {
            if !self.shard.is_live(offset) {
                // A replica's ready set may still name a message settled through the log.
                let _ = self.ready.take_next();
                continue;
            }
            match self.known_deadline(offset) {
                Some(d) if d <= now => {
                    let _ = self.ready.take_next();
                    expired.push(offset);
                }
                _ => break,
            }
        }
        self.expire(expired);
    }

    /// Rule 2: a claimed record whose deadline passed is expired instead of handed out;
    /// returns true then.
    pub(super) fn expire_if_due(&mut self, rec: &Record) -> bool {
        if rec.flags & FLAG_DEADLINE == 0 {
            return false;
        }
        match deadline_of(rec.flags, &rec.header) {
            Some(d) if d <= now_ms() => {
                self.expire(vec![rec.offset]);
                true
            }
            _ => false,
        }
    }

    /// Rule 4: `offsets` (out of the ready set already) are dead-lettered with reason
    /// `expired`, or deleted.
    fn expire(&mut self, offsets: Vec<u64>) {
        if offsets.is_empty() {
            return;
        }
        tracing::debug!(queue = %self.qref.key.name, expired = offsets.len(), "messages expired");
        for o in &offsets {
            self.paged.remove(o);
        }
        if self.dead_letter_exchange.is_some() {
            self.dead_letter(offsets, DeathReason::Expired);
        } else {
            self.delete(&offsets);
        }
    }
}

/// Rule 3 at open, for a queue without `x-message-ttl`: reads the head's record once and
/// starts the timer when it carries a deadline (a message published with `expiration` in an
/// earlier run), so that it expires with no consumer too. A deadline further back is found
/// when that message reaches the head under a consumer (rule 2).
pub(super) async fn start_if_head_expires(weak: Weak<RefCell<Queue>>) {
    let Some((offset, shard)) = weak.upgrade().and_then(|c| {
        let q = c.borrow();
        q.ready.peek_next().map(|o| (o, q.shard.clone()))
    }) else {
        return;
    };
    if let Ok(Some(r)) = shard.read(offset).await {
        if r.flags & FLAG_DEADLINE != 0 {
            if let Some(cell) = weak.upgrade() {
                let mut q = cell.borrow_mut();
                if !q.deleted {
                    q.ttl_mut().notify();
                }
            }
        }
    }
}

/// Rule 3: the task that expires a queue's head when its deadline comes; ends with the
/// queue.
pub(super) async fn expire_at_head(weak: Weak<RefCell<Queue>>, woken: flume::Receiver<()>) {
    loop {
        let next = {
            let Some(cell) = weak.upgrade() else { return };
            let mut q = cell.borrow_mut();
            if q.deleted {
                return;
            }
            if !q.serving() {
                // A replica decides nothing; it serves again only through a reopen, which
                // starts a new timer. Looked at now and then all the same.
                Next::Wait(Some(Duration::from_secs(1)))
            } else {
                q.expire_head();
                match q.ready.peek_next() {
                    None => Next::Wait(None),
                    Some(offset) => match q.known_deadline(offset) {
                        Some(NO_DEADLINE) => Next::Wait(None),
                        Some(d) => Next::Wait(Some(Duration::from_millis(d.saturating_sub(now_ms()).max(1)))),
                        None => Next::Read(offset, q.shard.clone()),
                    },
                }
            }
        };
        match next {
            Next::Wait(None) => {
                if woken.recv_async().await.is_err() {
                    return;
                }
            }
            Next::Wait(Some(d)) => {
                let sleep = async {
                    glommio::timer::sleep(d).await;
                };
                let wake = async {
                    let _ = woken.recv_async().await;
                };
                futures_lite::future::or(sleep, wake).await;
            }
            Next::Read(offset, shard) => {
                let rec = shard.read(offset).await;
                let Some(cell) = weak.upgrade() else { return };
                let mut q = cell.borrow_mut();
                let d = match rec {
                    Ok(Some(r)) => deadline_of(r.flags, &r.header).unwrap_or(NO_DEADLINE),
                    // Deleted meanwhile: nothing to wait for until the head changes.
                    Ok(None) => NO_DEADLINE,
                    Err(e) => {
                        tracing::error!(queue = %q.qref.key.name, error = %e, "reading the head's deadline failed; expiring it at delivery");
                        NO_DEADLINE
                    }
                };
                if q.shard.is_live(offset) {
                    if let Some(t) = q.ttl.as_mut() {
                        t.deadlines.insert(offset, d);
                    }
                }
            }
        }
    }
}
