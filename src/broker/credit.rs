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
//! Shapes: one [`PublishCredit`] per connection (an `Arc`: the queue's core gives credit back);
//! one [`CreditHeld`] per routed publish, shared by the ops of a fanout (an `Arc`, released
//! with the last of them).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Most bytes of publishes one connection may have in flight to other cores' queues (bodies,
/// headers and [`OP_WEIGHT`] each). One message larger than this still goes (alone).
pub const MAX_IN_FLIGHT_BYTES: usize = 16 << 20;
/// What one publish weighs besides its body and header, bytes (the op, its confirm ticket,
/// the inbox slot): 32,768 small messages fill the credit.
pub const OP_WEIGHT: usize = 512;

/// A connection's publish credit (see the module doc).
#[derive(Debug)]
pub struct PublishCredit {
    in_flight: AtomicUsize,
    limit: usize,
    wake_tx: flume::Sender<()>,
    wake_rx: flume::Receiver<()>,
}

/// Credit taken by one publish; given back when dropped (on whichever core).
#[derive(Debug)]
pub struct CreditHeld {
    pool: Arc<PublishCredit>,
    bytes: usize,
}

impl PublishCredit {
    /// Credit of [`MAX_IN_FLIGHT_BYTES`].
    pub fn new() -> Arc<PublishCredit> {
        PublishCredit::with_limit(MAX_IN_FLIGHT_BYTES)
    }

    /// Credit of `limit` bytes.
    pub fn with_limit(limit: usize) -> Arc<PublishCredit> {
        let (wake_tx, wake_rx) = flume::bounded(1);
        Arc::new(PublishCredit { in_flight: AtomicUsize::new(0), limit, wake_tx, wake_rx })
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

impl Drop for CreditHeld {
    fn drop(&mut self) {
        let old = self.pool.in_flight.fetch_sub(self.bytes, Ordering::Relaxed);
        if old >= self.pool.limit && old - self.bytes < self.pool.limit {
            let _ = self.pool.wake_tx.try_send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credit_comes_back_when_the_last_holder_drops() {
        let c = PublishCredit::with_limit(10_000);
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
        let c = PublishCredit::with_limit(1_000);
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
}
