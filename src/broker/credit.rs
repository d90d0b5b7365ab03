//! Publisher flow control: each connection may have at most [`MAX_IN_FLIGHT_BYTES`] of
//! publishes on their way to queues of other cores, RabbitMQ's credit flow reduced to what a
//! thread-per-core broker needs.
//!
//! A publish to a queue of this core is stored before the reader takes its next frame (the
//! call is direct), so a same-core queue paces its publishers by itself. A publish to another
//! core's queue travels through that core's inbox, which is unbounded: without credit, a
//! publisher faster than the queue's store fills the inbox (measured: 2 GiB of 1 MiB transient
//! messages from one pika publisher held 3.6 GB of RSS). So a cross-core publish takes
//! credit ([`PublishCredit::take`]) for its body and header plus [`OP_WEIGHT`], carried in the
//! `QueueOp::Publish` as a [`CreditHeld`]; the credit comes back when the queue has taken the
//! message (stored it, proposed it, or refused it): whenever the op is dropped. The
//! connection's reader takes no frame while its credit is used up ([`PublishCredit::wait`]),
//! so its socket is not read and TCP slows the client, as RabbitMQ's `flow` state does. A
//! queue that cannot keep up slows the connections that publish to it, not the node.
//!
//! A publish to another node's queue (`remote`) keeps its credit on the client's node (A)
//! until the queue's node (B) says its queue took the message: B gives each forwarded
//! publish credit of a pool of its own ([`PublishCredit::counting`]) whose releases it counts
//! and sends back to A in batches (`Event::Taken`), and A then drops as many of the
//! connection's held credits, oldest first. So a publisher on A waits for B's queue (and
//! B's store writer) as it would for a queue of its own node, and neither A's data lane nor
//! B's inboxes hold more than the connection's credit of its messages.
//!
//! A publish to one open queue of the connection's own core is handed to the queue directly
//! ([`Node::publish_from_connection`]) and takes its credit only if the queue keeps it (the
//! egress rules or a store writer behind, `Queue::hold_credit`): otherwise the credit would
//! be taken and given back in the same call, an allocation and four atomic operations per
//! message (4 % of a core at 1 M msgs/s).
//!
//! Shapes: one [`PublishCredit`] per connection (an `Arc`: the queue's core gives credit back);
//! one [`CreditHeld`] per routed publish, shared by the ops of a fanout (an `Arc`, released
//! with the last of them).

use std::rc::Rc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::message::Message;
use super::node::{Node, Slot};
use super::queue::Queue;
use super::{ConfirmTo, QueueOp, QueueRef};

use super::{ClientEvent, ClientTx};

/// Most bytes of publishes one connection may have in flight to other cores' queues (bodies,
/// headers and [`OP_WEIGHT`] each). One message larger than this still goes (alone).
pub const MAX_IN_FLIGHT_BYTES: usize = 16 << 20;
/// What one publish weighs besides its body and header, bytes (the op, its confirm ticket,
/// the inbox slot): 32,768 small messages fill the credit.
pub const OP_WEIGHT: usize = 512;

/// A connection's publish credit (see the module doc).
#[derive(Debug)]
pub struct PublishCredit {
    /// The connection's id (`ConnId`), 0 for a [`PublishCredit::counting`] pool.
    conn: u64,
    in_flight: AtomicUsize,
    limit: usize,
    wake_tx: flume::Sender<()>,
    wake_rx: flume::Receiver<()>,
    /// A counting pool's releases since its owner last took them, and where a first one
    /// is announced ([`ClientEvent::PublishesTaken`]).
    counted: Option<(AtomicU32, ClientTx)>,
}

/// Credit taken by one publish; given back when dropped (on whichever core).
#[derive(Debug)]
pub struct CreditHeld {
    pool: Arc<PublishCredit>,
    bytes: usize,
}

impl PublishCredit {
    /// Credit of [`MAX_IN_FLIGHT_BYTES`] for connection `conn` (its `ConnId`).
    pub fn new(conn: u64) -> Arc<PublishCredit> {
        PublishCredit::with_limit(conn, MAX_IN_FLIGHT_BYTES)
    }

    /// Credit of `limit` bytes for connection `conn`.
    pub fn with_limit(conn: u64, limit: usize) -> Arc<PublishCredit> {
        let (wake_tx, wake_rx) = flume::bounded(1);
        Arc::new(PublishCredit { conn, in_flight: AtomicUsize::new(0), limit, wake_tx, wake_rx, counted: None })
    }

    /// An unlimited pool that counts its releases for a peer's connection (module doc): the
    /// first release after [`PublishCredit::take_counted`] emptied the count sends
    /// [`ClientEvent::PublishesTaken`] on `tx`.
    pub fn counting(tx: ClientTx) -> Arc<PublishCredit> {
        let (wake_tx, wake_rx) = flume::bounded(1);
        Arc::new(PublishCredit {
            conn: 0,
            in_flight: AtomicUsize::new(0),
            limit: usize::MAX,
            wake_tx,
            wake_rx,
            counted: Some((AtomicU32::new(0), tx)),
        })
    }

    /// A counting pool's releases since the last call (0 for another pool).
    pub fn take_counted(&self) -> u32 {
        self.counted.as_ref().map_or(0, |(n, _)| n.swap(0, Ordering::AcqRel))
    }

    /// Takes credit for a publish of `bytes` (body and header; [`OP_WEIGHT`] is added).
    /// Never waits: the reader waits before its next frame ([`PublishCredit::wait`]).
    pub fn take(self: &Arc<Self>, bytes: usize) -> Arc<CreditHeld> {
        let bytes = bytes + OP_WEIGHT;
        self.in_flight.fetch_add(bytes, Ordering::Relaxed);
        Arc::new(CreditHeld { pool: self.clone(), bytes })
    }

    /// Bytes in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// True while the credit is used up.
    pub fn exhausted(&self) -> bool {
        self.in_flight() >= self.limit
    }

    /// Returns once the credit is not used up (at once when it is not).
    pub async fn wait(&self) {
        // A wake-up left from an earlier crossing only costs one more check; a crossing while
        // one is pending finds the channel full, and that pending wake-up makes the check.
        while self.exhausted() {
            if self.wake_rx.recv_async().await.is_err() {
                return;
            }
        }
    }
}

impl CreditHeld {
    /// The connection whose credit this is (`ConnId`; 0 for a counting pool's).
    pub fn conn(&self) -> u64 {
        self.pool.conn
    }
}

impl Drop for CreditHeld {
    fn drop(&mut self) {
        let old = self.pool.in_flight.fetch_sub(self.bytes, Ordering::Relaxed);
        if old >= self.pool.limit && old - self.bytes < self.pool.limit {
            let _ = self.pool.wake_tx.try_send(());
        }
        if let Some((n, tx)) = &self.pool.counted {
            if n.fetch_add(1, Ordering::AcqRel) == 0 {
                let _ = tx.send(ClientEvent::PublishesTaken);
            }
        }
    }
}

impl Node {
    /// Hands a publish of one of this core's connections to `queue`, with credit for
    /// `bytes` (body and header) from the connection's `pool`. An open queue of this core
    /// and node that serves it takes it at once, and the credit only if it keeps it; any
    /// other goes as a `QueueOp::Publish` with its credit taken (so does every publish while
    /// some are parked: `Node::steered` must see it).
    pub fn publish_from_connection(
        self: &Rc<Self>,
        queue: &QueueRef,
        message: Message,
        confirm: Option<ConfirmTo>,
        published: Option<Instant>,
        pool: &Arc<PublishCredit>,
        bytes: usize,
    ) {
        let local = queue.owner_core != super::reply_to::DIRECT_CORE
            && queue.owner_core % self.shared.cores == self.id
            && queue.owner_node == self.shared.meta.node_id()
            && !self.shared.remote.as_ref().is_some_and(|r| r.parking());
        let open = match self.queues.borrow().get(&queue.key) {
            Some(Slot::Open(cell)) if local => Some(cell.clone()),
            _ => None,
        };
        // A replicated copy that does not serve (a failover not acted on yet) takes the
        // general path, which reopens it as the server first.
        match open.filter(|cell| cell.borrow().serving()) {
            Some(cell) => Queue::publish_local(&cell, message, confirm, published, || Some(pool.take(bytes))),
            None => self.send_from_connection(queue, QueueOp::Publish { message, confirm, published, credit: Some(pool.take(bytes)) }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credit_comes_back_when_the_last_holder_drops() {
        let c = PublishCredit::with_limit(1, 10_000);
        let a = c.take(4_000);
        let fanout = a.clone();
        assert_eq!(c.in_flight(), 4_000 + OP_WEIGHT);
        assert!(!c.exhausted());
        let b = c.take(6_000);
        assert!(c.exhausted());
        drop(a);
        assert!(c.exhausted(), "a fanout copy still holds it");
        drop(fanout);
        assert!(!c.exhausted());
        drop(b);
        assert_eq!(c.in_flight(), 0);
    }

    #[test]
    fn a_waiting_reader_wakes_when_another_thread_gives_credit_back() {
        let c = PublishCredit::with_limit(1, 1_000);
        let held = c.take(5_000);
        assert!(futures_lite::future::block_on(futures_lite::future::poll_once(c.wait())).is_none(), "waits while used up");
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(held);
        });
        futures_lite::future::block_on(c.wait());
        assert!(!c.exhausted());
        t.join().expect("thread");
        assert!(futures_lite::future::block_on(futures_lite::future::poll_once(c.wait())).is_some(), "no wait when credit is left");
    }

    #[test]
    fn a_counting_pool_announces_the_first_release_and_counts_the_rest() {
        let (tx, rx) = flume::unbounded();
        let c = PublishCredit::counting(tx);
        let held: Vec<_> = (0..5).map(|_| c.take(1 << 20)).collect();
        assert!(!c.exhausted(), "a counting pool never holds a reader back");
        let fanout = held[0].clone();
        drop(held);
        assert_eq!(rx.try_iter().count(), 1, "one wake-up for a batch of releases");
        assert_eq!(c.take_counted(), 4, "a fanout copy still holds the fifth");
        drop(fanout);
        assert!(matches!(rx.try_recv(), Ok(ClientEvent::PublishesTaken)), "announced again after the count was taken");
        assert_eq!(c.take_counted(), 1);
        assert_eq!(c.take_counted(), 0);
        assert_eq!(c.in_flight(), 0);
    }
}
