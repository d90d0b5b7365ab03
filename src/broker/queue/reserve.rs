//! A durable queue's delivery reservation: what lets a tracked delivery leave without waiting
//! for its unacked-index record's fdatasync (DESIGN.md rule 2, as [`super::settle`] states it).
//!
//! Rule 2 is there so that a crash costs at worst a duplicate, never an unflagged one: a
//! message that reached a client must come back redelivered=true. The record of each delivery
//! says so precisely, but only once it is synced, and syncing it before every delivery batch
//! put one fdatasync (~0.25-0.4 ms here) inside every prefetch window's round trip: with
//! prefetch 100 and one ack per message, the consumer of a persistent queue waited for the
//! index more than for anything else.
//!
//! So a queue keeps, in its unacked index, one more record ([`ReserveRecord`]):
//! **"everything below offset R may have been handed out"**. Steps:
//!
//! 1. A tracked delivery of a persistent message at offset `o < R`, with R's record synced,
//!    leaves at once; its own index record is appended as before and made durable by the
//!    next index sync (a cursor commit, at most every 20 ms, a renewal, or a round of
//!    [`Queue::flush_unsynced`](super::Queue)), always before the cursor passes it.
//! 2. A delivery at `o >= R`, or while a return count (`delivery_limit.rs`) waits for its
//!    sync, takes the old path: it waits for an index sync, which covers
//!    its own record (`durability.rs`); the deliveries behind it wait with it (queue order).
//! 3. There is no reservation until deliveries queue up behind an index sync (a delivery
//!    comes while another waits for one): a consumer that takes one message at a time, or a
//!    queue delivering now and then, keeps the precise path, whose flags after a crash are
//!    exact. From then on the reservation is renewed when a delivery comes within `ahead / 2`
//!    of R, while renewals come less than [`DECAY`] apart, one renewal in flight: a record `R' = highest delivered offset + 1 + ahead` is appended, the index
//!    synced, and only then does R become R' (the record of the old R goes after). `ahead`
//!    starts at [`MIN_AHEAD`], doubles (up to [`MAX_AHEAD`]) when a delivery had to take
//!    step 2 while a renewal was in flight, and halves when renewals are more than
//!    [`DECAY`] apart.
//! 4. At a graceful stop ([`release`]) the index is synced and R's record deleted: every
//!    delivery then has a durable record of its own, and after the restart exactly the
//!    messages the records name come back flagged.
//! 5. At open ([`recover`]), R is capped at the message shard's tail (nothing at or past it
//!    exists yet, so nothing there was handed out), and every live message below it comes
//!    back redelivered=true with the ones the records name. Over-approximation: up to `ahead`
//!    stored messages that were never handed out come back flagged (the spec's flag says
//!    "may have been delivered before"; RabbitMQ reads it the same way). Never one too few.
//!
//! A replicated queue has the same idea through the Raft log (`replica.rs`, step 5) and keeps
//! no index records; this is its single-node form, for durable queues that are not
//! replicated.

use std::rc::Weak;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ringmq_shards::{Shard, StoreError};

use super::durability::{release_superseded, IndexSynced};
use super::index::ReserveRecord;
use super::once_a_second;
use super::Queue;

/// Smallest reach of a reservation past the deliveries, offsets.
pub const MIN_AHEAD: u64 = 256;
/// Largest reach of a reservation past the deliveries, offsets (bounds the messages a crash
/// may flag that were never handed out).
pub const MAX_AHEAD: u64 = 65_536;
/// Renewals further apart than this halve the reach.
pub const DECAY: Duration = Duration::from_secs(1);

/// A queue's reservation state (see the module doc).
#[derive(Debug)]
pub struct Reservation {
    /// R: deliveries below it need no index sync first. Its record is durable.
    pub below: u64,
    /// Index offset of the record holding `below`.
    record: Option<u64>,
    /// Highest message offset handed out + 1.
    reach: u64,
    /// How far a renewal reaches past `reach`, offsets.
    ahead: u64,
    /// A renewal is in flight.
    renewing: bool,
    /// A delivery took step 2 during the renewal in flight (its reach doubled once).
    stalled: bool,
    /// When the last renewal started.
    last: Option<Instant>,
    /// Released at a graceful stop ([`release`]): a renewal still in flight deletes its record.
    released: bool,
}

impl Default for Reservation {
    fn default() -> Self {
        Reservation { below: 0, record: None, reach: 0, ahead: MIN_AHEAD, renewing: false, stalled: false, last: None, released: false }
    }
}

impl Reservation {
    /// True when the index holds nothing but this reservation's record among `live` records
    /// and no renewal is in flight (an idle queue may close then: the record is capped away
    /// at the next open).
    pub fn only_record(&self, live: u64) -> bool {
        !self.renewing && live == u64::from(self.record.is_some())
    }
}

/// Step 5, at open: the highest reservation of `records` (index offset, record) capped at
/// `tail` (the message shard's next offset); the others are deleted. When the cap lowers
/// it, the capped value is appended and synced before the old record goes, so a second
/// crash still flags what the first one did. Returns the reservation to start with.
///
/// # Errors
/// The index's append or sync error (the queue then does not open, as for any index error).
pub async fn recover(index: &Shard, records: &[(u64, ReserveRecord)], tail: u64) -> Result<Reservation, StoreError> {
    let Some(&(at, top)) = records.iter().max_by_key(|(_, r)| r.below) else {
        return Ok(Reservation::default());
    };
    let below = top.below.min(tail);
    let mut keep = Some(at);
    if below < top.below {
        keep = if below > 0 {
            let i = index.append(0, &ReserveRecord { below }.encode(), &Bytes::new())?;
            index.sync_appends().await?;
            Some(i)
        } else {
            None
        };
    }
    let stale: Vec<u64> = records.iter().map(|(i, _)| *i).filter(|i| Some(*i) != keep).collect();
    if !stale.is_empty() {
        index.delete_by_offsets(&stale)?;
    }
    Ok(Reservation { below, record: keep, reach: below, ..Reservation::default() })
}

/// Step 4, at a graceful stop (after the connections closed): syncs the index, so every
/// delivery's own record is durable, then deletes the reservation's record; the shard's
/// close syncs that delete.
///
/// # Errors
/// The index's sync error; then the record stays (a restart flags up to its reach).
pub async fn release(cell: &super::QueueCell) -> Result<(), StoreError> {
    let (index, record) = {
        let mut q = cell.borrow_mut();
        q.reservation.released = true;
        match (&q.index, q.reservation.record) {
            (Some(index), Some(record)) => (index.clone(), record),
            _ => return Ok(()),
        }
    };
    index.sync_appends().await?;
    let mut q = cell.borrow_mut();
    if q.reservation.record == Some(record) {
        q.reservation.record = None;
        q.reservation.below = 0;
        index.delete_by_offsets(&[record])?;
    }
    Ok(())
}

impl Queue {
    /// Step 1 or 2 for a tracked delivery of a persistent message at `offset` (one that got
    /// an index record): true when it may leave at once. Starts a renewal when the delivery
    /// comes within half the reach of the reservation.
    pub(super) fn reserved_for(&mut self, offset: u64) -> bool {
        self.reservation.reach = self.reservation.reach.max(offset + 1);
        let counting = self.delivery_limit.as_ref().is_some_and(|d| d.has_unsynced());
        // Deliveries queue up behind an index sync: the syncs, not the consumers, set the pace.
        let pressed = self.index_flushing || !self.unsynced.is_empty();
        let r = &mut self.reservation;
        let covered = offset < r.below && !counting;
        if offset >= r.below && r.renewing && !r.stalled {
            r.stalled = true;
            r.ahead = (r.ahead * 2).min(MAX_AHEAD);
        }
        let streaming = r.last.is_some_and(|t| t.elapsed() < DECAY);
        if !r.renewing && r.reach + r.ahead / 2 >= r.below && (pressed || streaming) {
            r.renewing = true;
            crate::core::spawn_soon(renew(self.me.clone()));
        }
        covered
    }
}

/// Step 3: appends the next reservation, syncs the index, then raises R; again while the
/// deliveries have come within half the reach of the new R. On an index error R stays where
/// it is (deliveries past it take step 2, whose own sync reports the error).
async fn renew(weak: Weak<std::cell::RefCell<Queue>>) {
    loop {
        let Some(cell) = weak.upgrade() else { return };
        let (index, until, at, superseded) = {
            let mut q = cell.borrow_mut();
            let index = match (&q.index, q.deleted) {
                (Some(index), false) => index.clone(),
                _ => {
                    q.reservation.renewing = false;
                    return;
                }
            };
            let now = Instant::now();
            let r = &mut q.reservation;
            if r.last.is_some_and(|t| now.duration_since(t) >= DECAY) {
                r.ahead = (r.ahead / 2).max(MIN_AHEAD);
            }
            r.last = Some(now);
            let until = r.reach + r.ahead;
            match index.append(0, &ReserveRecord { below: until }.encode(), &Bytes::new()) {
                Ok(at) => (index, until, at, std::mem::take(&mut q.index_superseded)),
                Err(e) => {
                    q.reservation.renewing = false;
                    if e.is_disk_full() {
                        q.env.disk_full();
                    }
                    if once_a_second(&super::INDEX_FAILURE_LOGGED) {
                        tracing::error!(queue = %q.qref.key.name, error = %e, "delivery reservation not stored; deliveries wait for their index records");
                    }
                    return;
                }
            }
        };
        drop(cell);
        let synced = IndexSynced::appends(&index).await;
        let Some(cell) = weak.upgrade() else { return };
        let mut q = cell.borrow_mut();
        match synced {
            Ok(proof) => {
                // The sync began after the replacements of these records were appended.
                release_superseded(&index, &superseded, &proof);
                let r = &mut q.reservation;
                let old = if until > r.below && !r.released {
                    r.below = until;
                    r.record.replace(at)
                } else {
                    Some(at)
                };
                if let Some(old) = old {
                    if let Err(e) = index.delete_by_offsets(&[old]) {
                        tracing::error!(error = %e, "unacked index delete failed");
                    }
                }
            }
            Err(e) => {
                // The superseded records stay (a later open drops them as stale).
                q.reservation.renewing = false;
                if once_a_second(&super::INDEX_FAILURE_LOGGED) {
                    tracing::error!(queue = %q.qref.key.name, error = %e, "unacked index sync failed; delivery reservation not raised");
                }
                return;
            }
        }
        let r = &mut q.reservation;
        r.stalled = false;
        if r.reach + r.ahead / 2 < r.below || q.deleted {
            q.reservation.renewing = false;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_record_counts_the_reservation() {
        let mut r = Reservation::default();
        assert!(r.only_record(0));
        assert!(!r.only_record(1));
        r.record = Some(4);
        assert!(r.only_record(1));
        assert!(!r.only_record(2));
        r.renewing = true;
        assert!(!r.only_record(1), "a renewal in flight may still append");
    }
}
