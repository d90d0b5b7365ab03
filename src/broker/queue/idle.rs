//! Whether a queue may be closed for being idle: its core closes such a queue's store and
//! keeps only its registry slot (`broker/idle.rs`), so that thousands of unused durable
//! queues hold no file descriptor and little memory. The next operation opens it again from
//! disk, as after a restart.

use std::time::{Duration, Instant};

use super::Queue;

impl Queue {
    /// From the core's tick, before [`Queue::closable`]: an operation since the last tick
    /// counts as a use at `now` (operations only set a flag; reading the clock per operation
    /// cost 3 % of a core at 1 M msgs/s).
    pub fn note_use(&mut self, now: Instant) {
        if std::mem::take(&mut self.used) {
            self.last_used = now;
        }
    }

    /// True when nothing would be lost or delayed by closing the queue now and opening it
    /// again at its next operation: a durable, non-exclusive, unreplicated queue without
    /// x-expires lease or message TTL (their timers run while it is open), holding no message
    /// (ready, outstanding, or in its unacked index), no consumer, no waiting confirm, no
    /// write in progress, and untouched (but for [`super::QueueOp::Info`]) for `idle`.
    pub fn closable(&self, now: Instant, idle: Duration) -> bool {
        self.def.durable
            && self.def.exclusive_owner.is_none()
            && !self.deleted
            && self.repl.is_none()
            && self.expiry.is_none()
            && self.ttl.is_none()
            && now.saturating_duration_since(self.last_used) >= idle
            && self.consumers.is_empty()
            && self.ready.is_empty()
            && self.held.is_empty()
            && self.paging == 0
            && self.paged.is_empty()
            && self.pending_confirms.is_empty()
            && self.unsynced.is_empty()
            && self.held_credit.is_empty()
            && self.egress.is_empty()
            && self.index_of.is_empty()
            && self.index_trash.is_empty()
            && self.index_superseded.is_empty()
            && !self.syncing
            && !self.dirty
            && !self.index_flushing
            && self.shard.is_empty()
            && self.shard.durable_offset() == self.shard.next_offset()
            && self.index.as_ref().is_none_or(|i| self.reservation.only_record(i.len()) && i.durable_offset() == i.next_offset())
    }
}
