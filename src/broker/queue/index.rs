//! The persisted unacked index of a durable queue (DESIGN.md ack-path rules 2, 6, 7).
//!
//! One record per outstanding delivery of a persistent message in a durable queue, kept in
//! a second shard beside the queue's messages. A record is self-describing, so the
//! recovery scanner needs nothing else to requeue it:
//!
//! ```text
//! version:u8 (1) node:u64 epoch:u64 conn:u64 channel:u16 time_ms:u64 offset:u64
//! vhost_len:u8 vhost queue_len:u8 queue            (big-endian integers)
//! ```
//!
//! `offset` is the message's offset in the queue's message shard, `time_ms` the delivery
//! time in ms since the Unix epoch, `epoch` the boot epoch of `node` at delivery.
//!
//! The same shard holds a second kind of record for a queue with a delivery limit
//! (`delivery_limit.rs`): how many times a live message came back to the queue.
//!
//! ```text
//! version:u8 (2) offset:u64 count:u32                (big-endian integers)
//! ```
//!
//! A later record for the same message supersedes an earlier one (the highest count wins
//! at open); one is deleted with its message, as a delivery record is.
//!
//! And a third, the queue's delivery reservation (`reserve.rs`): every message below
//! `below` may have been handed out; the live one with the highest `below` counts.
//!
//! ```text
//! version:u8 (3) below:u64                           (big-endian)
//! ```

use bytes::{Buf, BufMut};

/// One unacked-index record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexRecord {
    /// Node that delivered the message.
    pub node: u64,
    /// That node's boot epoch at delivery.
    pub epoch: u64,
    /// Connection id holding it.
    pub conn: u64,
    /// Channel number holding it.
    pub channel: u16,
    /// Delivery time, ms since the Unix epoch.
    pub time_ms: u64,
    /// Message offset in the queue's shard.
    pub offset: u64,
    /// Vhost of the queue.
    pub vhost: String,
    /// Queue name.
    pub queue: String,
}

const VERSION: u8 = 1;

/// The first byte of a [`ReturnCount`] record.
const RETURN_COUNT: u8 = 2;

/// How many times the message at `offset` came back to its queue (a return-count record).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReturnCount {
    /// Message offset in the queue's shard.
    pub offset: u64,
    /// Returns counted so far (`delivery_limit.rs`, behaviour 1).
    pub count: u32,
}

impl ReturnCount {
    /// Encodes the record (13 bytes; see the module doc).
    pub fn encode(&self) -> [u8; 13] {
        let mut b = [0u8; 13];
        b[0] = RETURN_COUNT;
        b[1..9].copy_from_slice(&self.offset.to_be_bytes());
        b[9..].copy_from_slice(&self.count.to_be_bytes());
        b
    }

    /// Decodes a record; `None` for a record of another kind or a damaged one.
    pub fn decode(b: &[u8]) -> Option<ReturnCount> {
        if b.len() != 13 || b[0] != RETURN_COUNT {
            return None;
        }
        let offset = u64::from_be_bytes(b[1..9].try_into().ok()?);
        let count = u32::from_be_bytes(b[9..].try_into().ok()?);
        Some(ReturnCount { offset, count })
    }
}

/// The first byte of a [`ReserveRecord`].
const RESERVE: u8 = 3;

/// Every message below `below` may have been handed out (a queue's delivery reservation,
/// `reserve.rs`).
///
/// ```text
/// version:u8 (3) below:u64                (big-endian)
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReserveRecord {
    /// Message offset (exclusive) below which deliveries may have left.
    pub below: u64,
}

impl ReserveRecord {
    /// Encodes the record (9 bytes).
    pub fn encode(&self) -> [u8; 9] {
        let mut b = [0u8; 9];
        b[0] = RESERVE;
        b[1..].copy_from_slice(&self.below.to_be_bytes());
        b
    }

    /// Decodes a record; `None` for a record of another kind or a damaged one.
    pub fn decode(b: &[u8]) -> Option<ReserveRecord> {
        if b.len() != 9 || b[0] != RESERVE {
            return None;
        }
        Some(ReserveRecord { below: u64::from_be_bytes(b[1..].try_into().ok()?) })
    }
}

impl IndexRecord {
    /// Encodes the record (see the module doc).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(48 + self.vhost.len() + self.queue.len());
        b.put_u8(VERSION);
        b.put_u64(self.node);
        b.put_u64(self.epoch);
        b.put_u64(self.conn);
        b.put_u16(self.channel);
        b.put_u64(self.time_ms);
        b.put_u64(self.offset);
        b.put_u8(self.vhost.len() as u8);
        b.extend_from_slice(self.vhost.as_bytes());
        b.put_u8(self.queue.len() as u8);
        b.extend_from_slice(self.queue.as_bytes());
        b
    }

    /// Decodes a record; `None` for a record of another version or a damaged one.
    pub fn decode(mut b: &[u8]) -> Option<IndexRecord> {
        if b.len() < 45 || b.get_u8() != VERSION {
            return None;
        }
        let (node, epoch, conn, channel, time_ms, offset) = (b.get_u64(), b.get_u64(), b.get_u64(), b.get_u16(), b.get_u64(), b.get_u64());
        let string = |b: &mut &[u8]| -> Option<String> {
            let n = *b.first()? as usize;
            let s = std::str::from_utf8(b.get(1..1 + n)?).ok()?.to_owned();
            b.advance(1 + n);
            Some(s)
        };
        let vhost = string(&mut b)?;
        let queue = string(&mut b)?;
        Some(IndexRecord { node, epoch, conn, channel, time_ms, offset, vhost, queue })
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The live records of a queue's unacked index, by kind, each with its index offset.
#[derive(Debug, Default)]
pub struct IndexContents {
    /// Deliveries of earlier runs: (index offset, record).
    pub held: Vec<(u64, IndexRecord)>,
    /// Return counts: (index offset, record).
    pub returns: Vec<(u64, ReturnCount)>,
    /// Delivery reservations (`reserve.rs`): (index offset, record).
    pub reservations: Vec<(u64, ReserveRecord)>,
}

/// Reads every live record of a queue's unacked index (at open, before any delivery).
///
/// # Errors
/// The store's error when a record cannot be read.
pub async fn read_index(index: &ringmq_shards::Shard) -> Result<IndexContents, ringmq_shards::StoreError> {
    let mut out = IndexContents::default();
    for i in index.live_offsets() {
        if let Some(r) = index.read(i).await? {
            if let Some(rec) = IndexRecord::decode(&r.header) {
                out.held.push((i, rec));
            } else if let Some(rec) = ReturnCount::decode(&r.header) {
                out.returns.push((i, rec));
            } else if let Some(rec) = ReserveRecord::decode(&r.header) {
                out.reservations.push((i, rec));
            } else {
                tracing::warn!(index_offset = i, "undecodable unacked-index record skipped");
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(node in any::<u64>(), epoch in any::<u64>(), conn in any::<u64>(), channel in any::<u16>(),
                      time_ms in any::<u64>(), offset in any::<u64>(), vhost in ".{0,20}", queue in ".{0,40}") {
            let r = IndexRecord { node, epoch, conn, channel, time_ms, offset, vhost, queue };
            prop_assert_eq!(IndexRecord::decode(&r.encode()), Some(r));
        }
    }

    proptest! {
        #[test]
        fn return_count_round_trip(offset in any::<u64>(), count in any::<u32>()) {
            let r = ReturnCount { offset, count };
            prop_assert_eq!(ReturnCount::decode(&r.encode()), Some(r));
            prop_assert_eq!(IndexRecord::decode(&r.encode()), None, "a return count is no delivery record");
        }
    }

    proptest! {
        #[test]
        fn reserve_round_trip(below in any::<u64>()) {
            let r = ReserveRecord { below };
            prop_assert_eq!(ReserveRecord::decode(&r.encode()), Some(r));
            prop_assert_eq!(ReturnCount::decode(&r.encode()), None);
            prop_assert_eq!(IndexRecord::decode(&r.encode()), None);
        }
    }

    #[test]
    fn other_kinds_are_not_reservations() {
        let rc = ReturnCount { offset: 7, count: 2 }.encode();
        assert_eq!(ReserveRecord::decode(&rc), None);
        assert_eq!(ReserveRecord::decode(&[3; 8]), None);
        assert_eq!(ReserveRecord::decode(&[3; 10]), None);
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(IndexRecord::decode(&[2; 60]), None);
        assert_eq!(IndexRecord::decode(&[1; 10]), None);
        assert_eq!(ReturnCount::decode(&[2; 12]), None);
        assert_eq!(ReturnCount::decode(&[1; 13]), None);
    }
}
