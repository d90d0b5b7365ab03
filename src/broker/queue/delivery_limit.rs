//! Poison-message handling: `x-delivery-limit`, as RabbitMQ's quorum queues have it
//! (RabbitMQ docs, "Quorum Queues", "Poison Message Handling"; 4.0 release notes, "Quorum
//! Queues Now Have a Default Redelivery Limit").
//!
//! # Behaviour
//! 1. A queue with a limit counts, per message, the deliveries that came back to it: every
//!    return through the requeue primitive (`settle.rs`, rule 5) — basic.nack and basic.reject
//!    with requeue, basic.recover(requeue), a channel or connection that closed holding it,
//!    and the acknowledgement timeout. The crash-recovery scanner's requeue is not counted
//!    (the broker failed, not the consumer), nor is basic.recover(requeue=false), which
//!    hands the message to the same consumer again without returning it.
//! 2. A message returned more times than the limit is not made ready again: it is
//!    dead-lettered with reason `delivery_limit` through the queue's `x-dead-letter-exchange`,
//!    or deleted when the queue has none. With limit 0 the first return already does it.
//! 3. A delivery of a message returned before carries its count in the `x-delivery-count`
//!    header (a long integer); a first delivery has no such header, nor has any delivery
//!    from a queue without a limit (so those pay nothing). The dead-lettered copy has no
//!    `x-delivery-count` either (RabbitMQ's copy carries only `x-death` and its companions).
//! 4. Which queues: `x-queue-type=quorum` ones, with [`QUORUM_DEFAULT`] when the argument is
//!    absent and no limit for `-1` (RabbitMQ 4.x), and any other queue declared with
//!    `x-delivery-limit` >= 0 (RabbitMQ ignores the argument there; here it means what it
//!    says, rather than being accepted and silently ignored).
//!
//! # Durability
//! 5. The counts survive a restart, a kill -9 and a replicated queue's failover, for a
//!    durable queue: each count is a record in the queue's unacked index
//!    (`index.rs`, [`ReturnCount`]), read back at open (the highest count of a message
//!    wins; the others are stale and go). A queue of one node appends the record at the
//!    return. A replicated queue's serving member proposes the counts as `Return` in the
//!    metadata log (one command per batch of returns, as settles go), and every member,
//!    the serving one included, raises its counts to them and appends the record as it
//!    applies the entry; a replay appends only what the index lost. A record is
//!    synced with the queue's next full sync (at most about a second later, and before
//!    the metadata log is compacted), so a crash may forget the returns of the last
//!    second; a record goes with its message (rule 4's order: after the message's delete
//!    is synced), and one superseded by a higher count only once that count is synced.
//!    A transient queue's counts live in memory only, as the queue does.

use amq_protocol::types::{AMQPValue, FieldTable, ShortString};
use bytes::Bytes;
use rustc_hash::FxHashMap;

use super::index::ReturnCount;
use super::Queue;
use crate::broker::message::{decode_properties, encode_properties, Message};
use crate::broker::router::int_arg;

/// The limit of a quorum queue declared without `x-delivery-limit` (RabbitMQ 4.0 and later).
pub const QUORUM_DEFAULT: u32 = 20;

/// One returned message's count and its record in the unacked index.
#[derive(Clone, Copy, Debug, Default)]
struct Returns {
    /// Returns counted.
    count: u32,
    /// The count its newest record holds (0: none).
    stored: u32,
    /// Index offset of that record.
    record: Option<u64>,
}

/// A queue's delivery limit and the return counts of its live messages (see the module doc).
/// Memory: one hash-map entry (offset → count, stored count, record: 32 bytes plus
/// overhead) per message returned at least once and not yet deleted.
#[derive(Debug)]
pub struct DeliveryLimit {
    limit: u32,
    returned: FxHashMap<u64, Returns>,
    /// Index offsets of records superseded by a higher count not yet known synced.
    superseded: Vec<u64>,
    /// A record was appended since the last index sync that covered the counts.
    unsynced: bool,
}

impl DeliveryLimit {
    /// The limit of a queue declared with `arguments` (behaviour 4); `None` for a queue
    /// without one. `quorum`: the queue is `x-queue-type=quorum`.
    pub fn from_arguments(arguments: &FieldTable, quorum: bool) -> Option<DeliveryLimit> {
        let limit = match int_arg(arguments, "x-delivery-limit") {
            Some(v) if v < 0 => return None,
            Some(v) => u32::try_from(v).unwrap_or(u32::MAX),
            None if quorum => QUORUM_DEFAULT,
            None => return None,
        };
        Some(DeliveryLimit { limit, returned: FxHashMap::default(), superseded: Vec::new(), unsynced: false })
    }

    /// The limit: returns allowed before a message is dead-lettered.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Changes the limit (a policy change, `reapply.rs`); the counts so far stay.
    pub fn set_limit(&mut self, limit: u32) {
        self.limit = limit;
    }

    /// Takes the counts of an earlier run (behaviour 5): `records` are the return-count
    /// records read from the index at open, `(index offset, record)`. For each message
    /// still live the highest count stays, with its record; returns the index offsets of
    /// the other records (stale: to delete).
    pub fn recover(&mut self, records: &[(u64, ReturnCount)], is_live: impl Fn(u64) -> bool) -> Vec<u64> {
        let mut stale = Vec::new();
        for &(i, r) in records {
            if !is_live(r.offset) {
                stale.push(i);
                continue;
            }
            let e = self.returned.entry(r.offset).or_default();
            if e.record.is_some() && e.stored >= r.count {
                stale.push(i);
                continue;
            }
            stale.extend(e.record);
            *e = Returns { count: e.count.max(r.count), stored: r.count, record: Some(i) };
        }
        stale
    }

    /// Counts one return of `offset` (behaviour 1). True when that took it over the limit
    /// (behaviour 2): the caller dead-letters or deletes it.
    pub fn returned(&mut self, offset: u64) -> bool {
        let e = self.returned.entry(offset).or_default();
        e.count = e.count.saturating_add(1);
        e.count > self.limit
    }

    /// Raises the count of `offset` to `count` (a replicated queue's `Return`, applied);
    /// a lower count (a replay) changes nothing.
    pub fn raise(&mut self, offset: u64, count: u32) {
        let e = self.returned.entry(offset).or_default();
        e.count = e.count.max(count);
    }

    /// How many times `offset` came back (0 if never).
    pub fn count(&self, offset: u64) -> u32 {
        self.returned.get(&offset).map_or(0, |e| e.count)
    }

    /// The record `offset` needs, if its count is higher than the one stored.
    fn to_store(&self, offset: u64) -> Option<ReturnCount> {
        self.returned.get(&offset).filter(|e| e.count > e.stored).map(|e| ReturnCount { offset, count: e.count })
    }

    /// A return count was appended and no sync of its own covered it yet: a delivery then
    /// waits for an index sync (`reserve.rs`), so a crash never forgets a return counted
    /// before a delivery left.
    pub fn has_unsynced(&self) -> bool {
        self.unsynced
    }

    /// `rec` was appended to the index at `index_offset`: the record it supersedes goes
    /// once the index is synced.
    fn stored(&mut self, rec: ReturnCount, index_offset: u64) {
        let e = self.returned.entry(rec.offset).or_default();
        self.superseded.extend(e.record.replace(index_offset));
        e.stored = rec.count;
        self.unsynced = true;
    }

    /// `offset` was deleted: its count goes; returns the index offset of its record, to
    /// delete with the message's other index record.
    pub fn forget(&mut self, offset: u64) -> Option<u64> {
        self.returned.remove(&offset).and_then(|e| e.record)
    }

    /// (a record was appended since the last call, the records superseded meanwhile): a
    /// sync of the index's appends made after this call lets the latter go.
    fn take_unsynced(&mut self) -> (bool, Vec<u64>) {
        (std::mem::take(&mut self.unsynced), std::mem::take(&mut self.superseded))
    }
}

impl Queue {
    /// A delivery of `offset` came back through the requeue primitive (behaviour 1):
    /// counts it and makes the count durable (behaviour 5). True when the message is over
    /// the limit (behaviour 2). Always false for a queue without a limit.
    pub(super) fn count_return(&mut self, offset: u64) -> bool {
        let Some(d) = &mut self.delivery_limit else { return false };
        if d.returned(offset) {
            return true;
        }
        let count = d.count(offset);
        if self.replicated() {
            // Every member stores it as it applies the `Return` (behaviour 5).
            self.propose_return(offset, count);
        } else {
            self.store_return_count(offset);
        }
        false
    }

    /// Applies a replicated queue's `Return` (behaviour 5): raises the counts of the
    /// offsets this member still stores, and stores those that rose.
    pub(super) fn apply_returned(&mut self, counts: &[(u64, u32)]) {
        for &(offset, count) in counts {
            if !self.shard.is_live(offset) {
                continue;
            }
            if let Some(d) = &mut self.delivery_limit {
                d.raise(offset, count);
                self.store_return_count(offset);
            }
        }
    }

    /// Appends the return-count record of `offset` to the unacked index when its count is
    /// higher than the one stored (a durable queue; a transient one keeps counts in
    /// memory). A failed append is logged: the count is then lost at a restart.
    fn store_return_count(&mut self, offset: u64) {
        let (Some(d), Some(index)) = (&mut self.delivery_limit, &self.index) else { return };
        let Some(rec) = d.to_store(offset) else { return };
        match index.append(0, &rec.encode(), &Bytes::new()) {
            Ok(i) => {
                d.stored(rec, i);
                self.dirty = true;
            }
            Err(e) => {
                if e.is_disk_full() {
                    self.env.disk_full();
                }
                tracing::warn!(queue = %self.qref.key.name, error = %e, "return count not stored; a restart forgets it");
            }
        }
    }
}

/// Syncs the return-count records appended so far, then deletes the records they
/// superseded (behaviour 5). Called by the queue's full sync and before the metadata log
/// is compacted; does nothing for a queue without new records.
///
/// # Errors
/// The index's sync error; the superseded records then stay (stale, dropped at the next
/// open).
pub async fn sync_return_counts(cell: &super::QueueCell) -> Result<(), ringmq_shards::StoreError> {
    let (index, (unsynced, superseded)) = {
        let mut q = cell.borrow_mut();
        let Some(index) = q.index.clone() else { return Ok(()) };
        let Some(d) = &mut q.delivery_limit else { return Ok(()) };
        (index, d.take_unsynced())
    };
    if unsynced {
        index.sync_appends().await?;
    }
    if !superseded.is_empty() {
        index.delete_by_offsets(&superseded)?;
    }
    Ok(())
}

/// `message` as delivered after `count` returns: with `x-delivery-count` = `count` in its
/// headers (behaviour 3), other headers and properties, persistence and expiry deadline
/// unchanged. Re-encodes the properties: called only for a message returned at least once.
pub fn with_delivery_count(message: Message, count: u32) -> Message {
    let (exchange, routing_key, raw) = message.parts();
    let props = decode_properties(raw).unwrap_or_default();
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(ShortString::from("x-delivery-count"), AMQPValue::LongLongInt(i64::from(count)));
    let props = props.with_headers(headers);
    let m = Message::new(exchange, routing_key, &encode_properties(&props), message.body.clone(), message.persistent());
    match message.deadline() {
        Some(at_ms) => m.with_deadline(at_ms),
        None => m,
    }
}

#[cfg(test)]
mod tests {
    use super::super::limits::tests::args;
    use super::*;
    use amq_protocol::protocol::basic::AMQPProperties;

    /// The `x-delivery-count` of a delivered message's headers, if any.
    fn delivery_count(headers: &FieldTable) -> Option<i64> {
        match headers.inner().get("x-delivery-count")? {
            AMQPValue::LongLongInt(n) => Some(*n),
            AMQPValue::LongInt(n) => Some(i64::from(*n)),
            _ => None,
        }
    }

    #[test]
    fn which_queues_have_a_limit() {
        let none = FieldTable::default();
        assert_eq!(DeliveryLimit::from_arguments(&none, true).map(|d| d.limit()), Some(QUORUM_DEFAULT));
        assert!(DeliveryLimit::from_arguments(&none, false).is_none(), "a classic queue without the argument has none");
        let off = args(&[("x-delivery-limit", AMQPValue::LongLongInt(-1))]);
        assert!(DeliveryLimit::from_arguments(&off, true).is_none(), "-1 turns the quorum default off");
        let five = args(&[("x-delivery-limit", AMQPValue::LongInt(5))]);
        assert_eq!(DeliveryLimit::from_arguments(&five, false).map(|d| d.limit()), Some(5));
    }

    #[test]
    fn a_message_goes_on_the_return_past_the_limit() {
        let mut d = DeliveryLimit::from_arguments(&args(&[("x-delivery-limit", AMQPValue::LongInt(2))]), false).unwrap();
        assert!(!d.returned(7));
        assert!(!d.returned(7));
        assert_eq!(d.count(7), 2);
        assert!(d.returned(7), "the third return of limit 2 is over it");
        assert_eq!(d.forget(7), None, "no record was stored");
        assert_eq!(d.count(7), 0, "its count is forgotten with the message");
        let mut zero = DeliveryLimit::from_arguments(&args(&[("x-delivery-limit", AMQPValue::LongInt(0))]), false).unwrap();
        assert!(zero.returned(1), "limit 0: the first return");
    }

    #[test]
    fn records_follow_the_counts() {
        let mut d = DeliveryLimit::from_arguments(&args(&[("x-delivery-limit", AMQPValue::LongInt(5))]), false).unwrap();
        assert!(!d.returned(3));
        let first = d.to_store(3).expect("a first count needs a record");
        d.stored(first, 100);
        assert_eq!(d.to_store(3), None, "stored already");
        assert!(!d.returned(3));
        let second = d.to_store(3).unwrap();
        assert_eq!(second.count, 2);
        d.stored(second, 101);
        assert_eq!(d.take_unsynced(), (true, vec![100]), "the first record goes once the second is synced");
        assert_eq!(d.take_unsynced(), (false, vec![]));
        d.raise(3, 1);
        assert_eq!((d.count(3), d.to_store(3)), (2, None), "a lower count (a replay) changes nothing");
        d.raise(3, 4);
        assert_eq!(d.to_store(3).map(|r| r.count), Some(4));
        assert_eq!(d.forget(3), Some(101), "the message's record goes with it");
    }

    #[test]
    fn recovery_keeps_the_highest_count_of_live_messages() {
        let mut d = DeliveryLimit::from_arguments(&args(&[("x-delivery-limit", AMQPValue::LongInt(5))]), false).unwrap();
        let rc = |offset, count| ReturnCount { offset, count };
        let records = [(10, rc(1, 1)), (11, rc(2, 1)), (12, rc(1, 3)), (13, rc(1, 2)), (14, rc(9, 4))];
        let mut stale = d.recover(&records, |o| o != 9);
        stale.sort_unstable();
        assert_eq!(stale, vec![10, 13, 14], "lower counts and a message no longer live");
        assert_eq!((d.count(1), d.count(2), d.count(9)), (3, 1, 0));
        assert_eq!(d.to_store(1), None, "recovered counts are stored already");
        assert!(!d.returned(1) && !d.returned(1));
        assert!(d.returned(1), "3 recovered + 3 returns is over 5");
    }

    #[test]
    fn the_header_is_added_and_the_rest_kept() {
        let mut h = FieldTable::default();
        h.insert("app".into(), AMQPValue::LongString("x".into()));
        let props = AMQPProperties::default().with_headers(h).with_content_type("text/plain".into());
        let m = Message::new("ex", "rk", &encode_properties(&props), bytes::Bytes::from_static(b"body"), true);
        let d = with_delivery_count(m.with_deadline(42), 3);
        assert_eq!(d.deadline(), Some(42), "the expiry deadline stays");
        let (ex, rk, raw) = d.parts();
        assert_eq!((ex, rk, d.persistent(), &d.body[..]), ("ex", "rk", true, &b"body"[..]));
        let p = decode_properties(raw).unwrap();
        let headers = p.headers().clone().unwrap();
        assert_eq!(delivery_count(&headers), Some(3));
        assert!(headers.inner().contains_key("app"));
        assert_eq!(p.content_type().as_ref().map(|s| s.as_str()), Some("text/plain"));
    }
}
