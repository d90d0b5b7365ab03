//! Queue priorities (`x-max-priority`), as RabbitMQ 3.13/4.x documents them ("Priority
//! Support"): a message's `priority` property (0–255; absent = 0; above the queue's maximum
//! = the maximum) decides its place in the ready set — higher levels first, offset order
//! within a level. Pure data, used only by [`super::ready::ReadySet`] of a queue declared with
//! `x-max-priority` ≥ 1; an ordinary queue never builds one (its ready set keeps its
//! `VecDeque` fast path).
//!
//! # Invariants
//! - `order` holds exactly the ready offsets, each once, keyed (level descending, offset
//!   ascending): its first entry is the next to go. A requeued message keeps its offset, so
//!   it returns at its original place within its level, before every message of that level
//!   never delivered (DESIGN.md rule 5).
//! - `level` maps every live offset the queue knows (ready or claimed) to its level, so a
//!   claimed offset given back finds its level again.
//! - `fresh` holds the ready offsets never claimed, and `claimed_end` is one past the highest
//!   offset ever claimed: [`Levels::delivered_floor`] = min(`fresh`'s first, `claimed_end`)
//!   is an offset below which every live message was claimed at least once — what the
//!   shared cursor may pass (see `ready.rs`, "Priorities and the cursor").
//! - `stored_at` holds the store time of the sampled ready offsets that were never claimed.

use std::cmp::Reverse;
use std::collections::BTreeSet;
use std::time::Instant;

use rustc_hash::FxHashMap;

use crate::broker::message::split_header;

/// Highest `x-max-priority` RabbitMQ accepts (its `MAX_SUPPORTED_PRIORITY`).
pub const MAX_SUPPORTED: i64 = 255;

/// The queue's maximum priority from its declare arguments: `None` for an ordinary queue
/// (no `x-max-priority`, or 0, which RabbitMQ accepts and which orders as one level, FIFO).
/// Values are checked at declare (`amqp::methods::queue`); out of range here reads as 255.
pub fn max_priority(args: &amq_protocol::types::FieldTable) -> Option<u8> {
    let v = crate::broker::router::int_arg(args, "x-max-priority")?;
    (v > 0).then(|| v.min(MAX_SUPPORTED) as u8)
}

/// The `priority` property of a stored message header (`message.rs` layout), 0 when absent
/// or unreadable. Reads the property flags and skips the fields before `priority`
/// (content-type, content-encoding, headers, delivery-mode: AMQP 0-9-1 spec 4.2.6.1 and the
/// basic class's property list) without decoding the headers table.
pub fn of_header(header: &[u8]) -> u8 {
    of_properties(split_header(header).2).unwrap_or(0)
}

fn of_properties(p: &[u8]) -> Option<u8> {
    const CONTENT_TYPE: u16 = 1 << 15;
    const CONTENT_ENCODING: u16 = 1 << 14;
    const HEADERS: u16 = 1 << 13;
    const DELIVERY_MODE: u16 = 1 << 12;
    const PRIORITY: u16 = 1 << 11;
    let flags = u16::from_be_bytes([*p.first()?, *p.get(1)?]);
    if flags & PRIORITY == 0 {
        return Some(0);
    }
    let mut at = 2usize;
    for bit in [CONTENT_TYPE, CONTENT_ENCODING] {
        if flags & bit != 0 {
            at += 1 + *p.get(at)? as usize;
        }
    }
    if flags & HEADERS != 0 {
        let len = u32::from_be_bytes(p.get(at..at + 4)?.try_into().ok()?);
        at += 4 + len as usize;
    }
    if flags & DELIVERY_MODE != 0 {
        at += 1;
    }
    p.get(at).copied()
}

/// The ready offsets of a priority queue, by level. See the module doc.
#[derive(Debug)]
pub struct Levels {
    max: u8,
    order: BTreeSet<(Reverse<u8>, u64)>,
    level: FxHashMap<u64, u8>,
    fresh: BTreeSet<u64>,
    claimed_end: u64,
    stored_at: FxHashMap<u64, Instant>,
}

impl Levels {
    /// An empty set for a queue of levels 0..=`max`.
    pub fn new(max: u8) -> Levels {
        Levels {
            max,
            order: BTreeSet::new(),
            level: FxHashMap::default(),
            fresh: BTreeSet::new(),
            claimed_end: 0,
            stored_at: FxHashMap::default(),
        }
    }

    /// Ready offsets.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// No offset is ready.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// A ready offset at `priority` (clamped to the maximum); `fresh` when never delivered.
    pub fn insert(&mut self, offset: u64, priority: u8, fresh: bool, stored_at: Option<Instant>) {
        let p = priority.min(self.max);
        self.level.insert(offset, p);
        self.order.insert((Reverse(p), offset));
        if fresh {
            self.fresh.insert(offset);
        }
        if let Some(at) = stored_at {
            self.stored_at.insert(offset, at);
        }
    }

    /// The offset [`Levels::take`] would claim.
    pub fn peek(&self) -> Option<u64> {
        self.order.first().map(|(_, o)| *o)
    }

    /// Claims the first offset (highest level, lowest offset in it); with its store time
    /// when it was sampled and is claimed for the first time.
    pub fn take(&mut self) -> Option<(u64, Option<Instant>)> {
        let (_, o) = self.order.pop_first()?;
        self.fresh.remove(&o);
        self.claimed_end = self.claimed_end.max(o + 1);
        Some((o, self.stored_at.remove(&o)))
    }

    /// A claimed offset is ready again at its place in its level (0 if its level was
    /// forgotten); `fresh` when it was never delivered.
    pub fn give_back(&mut self, offset: u64, fresh: bool) {
        let p = self.level.get(&offset).copied().unwrap_or(0);
        self.order.insert((Reverse(p), offset));
        if fresh {
            self.fresh.insert(offset);
        }
    }

    /// `offset` is deleted.
    pub fn forget(&mut self, offset: u64) {
        self.level.remove(&offset);
        self.stored_at.remove(&offset);
    }

    /// Takes every ready offset out (queue.purge).
    pub fn drain(&mut self) -> Vec<u64> {
        let offs: Vec<u64> = std::mem::take(&mut self.order).into_iter().map(|(_, o)| o).collect();
        for o in &offs {
            self.level.remove(o);
        }
        self.fresh.clear();
        self.stored_at.clear();
        offs
    }

    /// An offset below which every live message was claimed at least once.
    pub fn delivered_floor(&self) -> u64 {
        self.fresh.first().map_or(self.claimed_end, |f| (*f).min(self.claimed_end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::message::{encode_properties, Message};
    use amq_protocol::protocol::basic::AMQPProperties;
    use amq_protocol::types::{AMQPValue, FieldTable};

    #[test]
    fn priority_is_read_past_the_fields_before_it() {
        let mut h = FieldTable::default();
        h.insert("k".into(), AMQPValue::LongString("v".repeat(300).into()));
        let cases = [
            (AMQPProperties::default(), 0),
            (AMQPProperties::default().with_priority(7), 7),
            (
                AMQPProperties::default()
                    .with_content_type("text/plain".into())
                    .with_content_encoding("gzip".into())
                    .with_headers(h)
                    .with_delivery_mode(2)
                    .with_priority(200)
                    .with_message_id("id".into()),
                200,
            ),
            (AMQPProperties::default().with_delivery_mode(2).with_expiration("5".into()), 0),
        ];
        for (props, want) in cases {
            let m = Message::new("x", "rk", &encode_properties(&props), bytes::Bytes::new(), false);
            assert_eq!(of_header(&m.header), want, "{props:?}");
        }
        assert_eq!(of_header(&[]), 0, "a malformed header reads as 0");
        assert_eq!(of_properties(&[0x08, 0x00]), None, "a truncated field list reads as unknown");
    }

    #[test]
    fn the_floor_stays_below_the_lowest_never_claimed_offset() {
        let mut l = Levels::new(9);
        for (o, p) in [(0, 0), (1, 9), (2, 0), (3, 9)] {
            l.insert(o, p, true, None);
        }
        assert_eq!(l.take().map(|t| t.0), Some(1));
        assert_eq!(l.take().map(|t| t.0), Some(3));
        assert_eq!(l.delivered_floor(), 0, "0 and 2 were never handed out");
        assert_eq!(l.take().map(|t| t.0), Some(0));
        assert_eq!(l.delivered_floor(), 2);
        assert_eq!(l.take().map(|t| t.0), Some(2));
        assert_eq!(l.delivered_floor(), 4);
    }
}
