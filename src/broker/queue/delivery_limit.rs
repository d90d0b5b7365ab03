//! Poison-message handling: `x-delivery-limit`, as RabbitMQ's quorum queues have it
//! (RabbitMQ docs, "Quorum Queues", "Poison Message Handling"; 4.0 release notes, "Quorum
//! Queues Now Have a Default Redelivery Limit").
//!
//! # Behaviour
//! 1. A queue with a limit counts, per message, the deliveries that came back to it: every
//!    return through the requeue primitive (`settle.rs`, rule 5) — basic.nack and basic.reject
//!    with requeue, basic.recover(requeue), a channel or connection that closed holding it,
//!    and the acknowledgement timeout. The crash-recovery scanner's requeue is not counted
//!    (the counts did not survive the crash, see 5), nor is basic.recover(requeue=false),
//!    which hands the message to the same consumer again without returning it.
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
//! # Assumptions
//! 5. The counts live in memory on the queue's serving core: a restart, or a failover of a
//!    replicated queue, starts them again at zero. RabbitMQ keeps them in the queue's Raft
//!    log; here the limit still bounds every run's returns, it is not exact across runs.

use amq_protocol::types::{AMQPValue, FieldTable, ShortString};
use rustc_hash::FxHashMap;

use crate::broker::message::{decode_properties, encode_properties, Message};
use crate::broker::router::int_arg;

/// The limit of a quorum queue declared without `x-delivery-limit` (RabbitMQ 4.0 and later).
pub const QUORUM_DEFAULT: u32 = 20;

/// A queue's delivery limit and the return counts of its live messages (see the module doc).
/// Memory: one hash-map entry (offset, count: 12 bytes plus overhead) per message returned
/// at least once and not yet deleted.
#[derive(Debug)]
pub struct DeliveryLimit {
    limit: u32,
    returned: FxHashMap<u64, u32>,
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
        Some(DeliveryLimit { limit, returned: FxHashMap::default() })
    }

    /// The limit: returns allowed before a message is dead-lettered.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Counts one return of `offset` (behaviour 1). True when that took it over the limit
    /// (behaviour 2): its count is forgotten, the caller dead-letters or deletes it.
    pub fn returned(&mut self, offset: u64) -> bool {
        let n = self.returned.entry(offset).or_insert(0);
        *n = n.saturating_add(1);
        if *n > self.limit {
            self.returned.remove(&offset);
            return true;
        }
        false
    }

    /// How many times `offset` came back (0 if never).
    pub fn count(&self, offset: u64) -> u32 {
        self.returned.get(&offset).copied().unwrap_or(0)
    }

    /// `offset` was deleted: its count goes.
    pub fn forget(&mut self, offset: u64) {
        self.returned.remove(&offset);
    }
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
        assert_eq!(d.count(7), 0, "its count is forgotten");
        let mut zero = DeliveryLimit::from_arguments(&args(&[("x-delivery-limit", AMQPValue::LongInt(0))]), false).unwrap();
        assert!(zero.returned(1), "limit 0: the first return");
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
