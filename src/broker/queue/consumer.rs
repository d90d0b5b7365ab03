//! A queue's consumers: round-robin selection bounded by prefetch credit
//! (basic.qos prefetch_count, AMQP 0-9-1 spec 1.8.3.1; RabbitMQ's per-consumer reading), or,
//! for a queue declared with `x-single-active-consumer=true`, only the consumer attached
//! first (the next one takes over when it goes: RabbitMQ's single active consumer).
//!
//! Consumer priorities (`x-priority` on basic.consume, RabbitMQ's "Consumer Priorities"): a
//! delivery goes to a consumer of the highest priority among those with credit, round-robin
//! among equals; a lower one gets messages only while every higher one is blocked (out of
//! credit or backlogged). While all consumers share one priority, selection is the plain
//! round-robin.

use crate::broker::{ConsumerId, ConsumerSpec};

/// A consumer attached to a queue, with its in-flight (delivered, unsettled) count.
#[derive(Debug)]
pub struct Consumer {
    /// What the client asked for.
    pub spec: ConsumerSpec,
    /// Deliveries sent and not yet settled (manual ack only).
    pub in_flight: u32,
    /// A delivery of it was settled since [`Consumers::taking`] last asked: its window,
    /// though full when asked, keeps opening (`egress.rs`).
    pub settled: bool,
}

/// Most deliveries waiting to be written on a connection before its consumers get nothing
/// more: a client that reads slowly holds back deliveries in its queue (where they are
/// counted and paged) instead of in the broker's memory. Auto-ack and prefetch-0
/// consumers have no other bound.
pub const MAX_PENDING_EVENTS: usize = 4096;
/// Most bytes delivered to a connection and not yet written to its socket before its
/// consumers get nothing more: 16 MiB, where each delivery weighs its body plus
/// [`EVENT_WEIGHT`] (so at most [`MAX_PENDING_EVENTS`] deliveries of empty bodies). One
/// atomic counter shared by the connection and its queues: no lock on the hot path.
pub const MAX_PENDING_BYTES: usize = 16 << 20;
/// What one delivery weighs in [`MAX_PENDING_BYTES`] besides its body.
pub const EVENT_WEIGHT: usize = MAX_PENDING_BYTES / MAX_PENDING_EVENTS;

/// The weight of a delivery of `body_len` bytes in a connection's pending counter.
pub fn pending_weight(body_len: usize) -> usize {
    body_len + EVENT_WEIGHT
}

impl Consumer {
    /// Whether one more delivery fits in the consumer's prefetch window.
    pub fn has_credit(&self) -> bool {
        !self.backlogged() && self.window_open()
    }

    /// Whether no prefetch window stops it: auto-ack, or room left in its own window and its
    /// channel's (the connection may still be behind on writing, [`Consumer::backlogged`]).
    pub fn window_open(&self) -> bool {
        self.spec.no_ack || ((self.spec.prefetch == 0 || self.in_flight < self.spec.prefetch) && self.spec.channel_credit.has_room())
    }

    /// Whether the consumer's connection has not yet written what it was given.
    pub fn backlogged(&self) -> bool {
        self.spec.pending_bytes.load(std::sync::atomic::Ordering::Relaxed) >= MAX_PENDING_BYTES
    }
}

/// The consumers of one queue in attach order, with a round-robin cursor.
#[derive(Debug, Default)]
pub struct Consumers {
    list: Vec<Consumer>,
    next: usize,
    /// Only the first consumer in attach order receives (`x-single-active-consumer`).
    pub single_active: bool,
    /// When the last consumer left (`None`: none ever did); the start of an idle queue's
    /// x-expires lease (`expiry.rs`).
    emptied: Option<std::time::Instant>,
    /// Some consumers have different priorities (see the module doc).
    prioritized: bool,
}

impl Consumers {
    /// No consumers yet; `single_active` for a queue declared `x-single-active-consumer=true`.
    pub fn new(single_active: bool) -> Consumers {
        Consumers { single_active, ..Default::default() }
    }
    /// Number of consumers.
    pub fn len(&self) -> usize {
        self.list.len()
    }
    /// No consumers.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
    /// Whether an exclusive consumer holds the queue.
    pub fn has_exclusive(&self) -> bool {
        self.list.iter().any(|c| c.spec.exclusive)
    }
    /// Attaches a consumer.
    pub fn add(&mut self, spec: ConsumerSpec) {
        self.list.push(Consumer { spec, in_flight: 0, settled: false });
        self.reprioritize();
    }

    fn reprioritize(&mut self) {
        let first = self.list.first().map(|c| c.spec.priority);
        self.prioritized = self.list.iter().any(|c| Some(c.spec.priority) != first);
    }
    /// Detaches a consumer by id.
    pub fn remove(&mut self, id: ConsumerId) -> Option<Consumer> {
        let i = self.list.iter().position(|c| c.spec.id == id)?;
        if i < self.next {
            self.next -= 1;
        }
        let c = self.list.remove(i);
        if self.next >= self.list.len() {
            self.next = 0;
        }
        if self.list.is_empty() {
            self.emptied = Some(std::time::Instant::now());
        }
        self.reprioritize();
        Some(c)
    }
    /// When the last consumer left, if one ever did.
    pub fn emptied(&self) -> Option<std::time::Instant> {
        self.emptied
    }
    /// Detaches every consumer of a channel incarnation.
    pub fn remove_channel(&mut self, chan_uid: u64) -> Vec<Consumer> {
        let mut out = Vec::new();
        while let Some(c) = self.list.iter().find(|c| c.spec.chan_uid == chan_uid).map(|c| c.spec.id) {
            out.extend(self.remove(c));
        }
        out
    }
    /// The consumers of a channel incarnation.
    pub fn of_channel(&self, chan_uid: u64) -> impl Iterator<Item = &Consumer> + '_ {
        self.list.iter().filter(move |c| c.spec.chan_uid == chan_uid)
    }
    /// Detaches every consumer.
    pub fn drain(&mut self) -> Vec<Consumer> {
        self.next = 0;
        std::mem::take(&mut self.list)
    }
    /// Every consumer, in attach order.
    pub fn iter(&self) -> impl Iterator<Item = &Consumer> + '_ {
        self.list.iter()
    }
    /// Looks a consumer up by id.
    pub fn get(&self, id: ConsumerId) -> Option<&Consumer> {
        self.list.iter().find(|c| c.spec.id == id)
    }
    /// Looks a consumer up by id (mutably).
    pub fn get_mut(&mut self, id: ConsumerId) -> Option<&mut Consumer> {
        self.list.iter_mut().find(|c| c.spec.id == id)
    }
    /// Whether some consumer waits only for its connection to write what it has.
    pub fn any_backlogged(&self) -> bool {
        self.list.iter().any(Consumer::backlogged)
    }

    /// Whether a consumer of this node (any core) takes whatever it is given: no prefetch
    /// window stops it (though its connection may be behind on writing), or it settled a
    /// delivery since the last call, so its full window keeps opening (`egress.rs`). Clears
    /// the settled marks.
    pub fn taking(&mut self) -> bool {
        let mut taking = false;
        for c in &mut self.list {
            taking |= !c.spec.remote && (std::mem::take(&mut c.settled) || c.window_open());
        }
        taking
    }

    /// The next consumer in round-robin order with prefetch credit, advancing the cursor.
    pub fn next_with_credit(&mut self) -> Option<&mut Consumer> {
        if self.single_active {
            return self.list.first_mut().filter(|c| c.has_credit());
        }
        let n = self.list.len();
        if self.prioritized {
            // The first in round-robin order of the highest priority with credit.
            let mut best: Option<(i32, usize)> = None;
            for k in 0..n {
                let i = (self.next + k) % n;
                let c = &self.list[i];
                if best.is_none_or(|(p, _)| c.spec.priority > p) && c.has_credit() {
                    best = Some((c.spec.priority, i));
                }
            }
            let (_, i) = best?;
            self.next = (i + 1) % n;
            return Some(&mut self.list[i]);
        }
        for k in 0..n {
            let i = (self.next + k) % n;
            if self.list[i].has_credit() {
                self.next = (i + 1) % n;
                return Some(&mut self.list[i]);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn spec(id: u64, prefetch: u32) -> ConsumerSpec {
        prioritized(id, prefetch, 0)
    }

    fn prioritized(id: u64, prefetch: u32, priority: i32) -> ConsumerSpec {
        ConsumerSpec {
            id,
            conn: crate::broker::ConnId(1),
            channel: crate::broker::ChannelId(1),
            chan_uid: 1,
            tag: crate::broker::ConsumerTag(Arc::from(format!("c{id}"))),
            no_ack: false,
            exclusive: false,
            prefetch,
            channel_credit: Default::default(),
            cancel_notify: true,
            send_consume_ok: true,
            priority,
            tx: flume::unbounded().0,
            pending_bytes: Default::default(),
            remote: false,
        }
    }

    #[test]
    fn round_robin_respects_credit() {
        let mut cs = Consumers::default();
        cs.add(spec(1, 1));
        cs.add(spec(2, 0));
        let a = cs.next_with_credit().unwrap();
        assert_eq!(a.spec.id, 1);
        a.in_flight += 1;
        assert_eq!(cs.next_with_credit().unwrap().spec.id, 2);
        // consumer 1 is full: consumer 2 gets everything
        assert_eq!(cs.next_with_credit().unwrap().spec.id, 2);
        assert_eq!(cs.next_with_credit().unwrap().spec.id, 2);
        cs.remove(2);
        assert!(cs.next_with_credit().is_none());
    }

    #[test]
    fn a_single_active_consumer_gets_everything_until_it_goes() {
        let mut cs = Consumers::new(true);
        cs.add(spec(1, 2));
        cs.add(spec(2, 0));
        for _ in 0..2 {
            let a = cs.next_with_credit().unwrap();
            assert_eq!(a.spec.id, 1);
            a.in_flight += 1;
        }
        // Out of credit: it waits, and the second consumer still gets nothing.
        assert!(cs.next_with_credit().is_none());
        cs.remove(1);
        assert_eq!(cs.next_with_credit().unwrap().spec.id, 2, "the next consumer takes over");
    }

    #[test]
    fn the_highest_priority_with_credit_gets_it_round_robin_among_equals() {
        let mut cs = Consumers::default();
        cs.add(prioritized(1, 0, 1));
        cs.add(prioritized(2, 1, 5));
        cs.add(prioritized(3, 1, 5));
        cs.add(prioritized(4, 0, 0));
        let take = |cs: &mut Consumers| {
            let c = cs.next_with_credit().unwrap();
            c.in_flight += 1;
            c.spec.id
        };
        // 2 and 3 (priority 5) in turn until both are full, then 1 (priority 1), never 4.
        assert_eq!([take(&mut cs), take(&mut cs), take(&mut cs), take(&mut cs)], [2, 3, 1, 1]);
        cs.get_mut(3).unwrap().in_flight = 0;
        assert_eq!(take(&mut cs), 3, "credit back on a higher consumer: it comes first again");
        cs.remove(1);
        cs.remove(2);
        cs.remove(3);
        assert_eq!(take(&mut cs), 4);
    }
}
