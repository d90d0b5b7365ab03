//! Idle queues are closed: a durable queue that holds nothing and has not been used for
//! [`IDLE_CLOSE`] gives back its store's file descriptors and its memory, and keeps only its
//! registry slot ([`Slot::Idle`], with its message counters). Its next operation opens it
//! again from disk, as the first operation after a restart does; a management listing is
//! answered from the slot without opening it. Thousands of per-device queues that are
//! nearly always empty then cost a directory of small files each, not an open store
//! (issue 14, item 5).
//!
//! # Invariants
//! - Only what [`super::queue::Queue::closable`] allows is closed: nothing stored is lost, no client is
//!   attached, no timer (x-expires, message TTL) runs.
//! - Operations that arrive while it closes wait in its slot ([`Slot::Opening`]) and run once
//!   it has opened again.

use std::rc::Rc;
use std::time::{Duration, Instant};

use super::node::{Node, Slot};
use super::queue::Counters;
use super::QueueInfo;

/// How long a queue must go unused (but for management listings) before it is closed.
pub const IDLE_CLOSE: Duration = Duration::from_secs(10);

/// What [`super::QueueOp::Info`] answers for an idle queue: nothing ready, nothing
/// outstanding, no consumer, its counters of this run; latency histograms start anew when it
/// opens again.
pub fn idle_info(counters: Counters) -> QueueInfo {
    QueueInfo { messages_ready: 0, messages_unacked: 0, consumers: Vec::new(), counters, stages: Default::default(), unacked: Vec::new() }
}

impl Node {
    /// From the core's tick: closes the open queues of this core that the queue
    /// allows at `now` ([`super::queue::Queue::closable`]), one after another.
    pub(super) async fn close_idle_queues(self: &Rc<Self>, now: Instant) {
        for cell in self.open_queues() {
            cell.borrow_mut().note_use(now);
            if !cell.borrow().closable(now, IDLE_CLOSE) {
                continue;
            }
            let (key, counters) = (cell.borrow().qref.key.clone(), cell.borrow().counters);
            if !self.begin_reopen(&key, &cell) {
                continue;
            }
            let (shard, index) = cell.borrow_mut().retire();
            for s in [Some(shard), index].into_iter().flatten() {
                // Its deleted records' segment goes: an idle queue keeps a header page.
                if let Err(e) = s.shrink_if_empty().await {
                    tracing::warn!(queue = %key.name, error = %e, "shrinking an idle queue's store failed");
                }
                if let Err(e) = s.close().await {
                    tracing::warn!(queue = %key.name, error = %e, "closing an idle queue's store failed");
                }
            }
            let used = matches!(self.queues.borrow().get(&key), Some(Slot::Opening(waiting)) if !waiting.is_empty());
            if !used {
                tracing::debug!(queue = %key.name, vhost = %key.vhost, "closed an idle queue");
                self.queues.borrow_mut().insert(key, Slot::Idle(counters));
                continue;
            }
            // Used while it closed: open again for what waits.
            let Some((def, qref)) = self.reopen_target(&key) else { continue };
            self.resumed.borrow_mut().insert(key, counters);
            crate::core::spawn_soon(self.clone().open_and_run(def, qref));
        }
    }
}
