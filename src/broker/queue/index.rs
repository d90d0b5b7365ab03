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

/// Reads every live unacked-index record of a queue (at open, before any delivery).
///
/// # Errors
/// The store's error when a record cannot be read.
pub async fn read_index(index: &ringmq_shards::Shard) -> Result<Vec<(u64, IndexRecord)>, ringmq_shards::StoreError> {
    let mut out = Vec::new();
    for i in index.live_offsets() {
        if let Some(r) = index.read(i).await? {
            match IndexRecord::decode(&r.header) {
                Some(rec) => out.push((i, rec)),
                None => tracing::warn!(index_offset = i, "undecodable unacked-index record skipped"),
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

    #[test]
    fn rejects_garbage() {
        assert_eq!(IndexRecord::decode(&[2; 60]), None);
        assert_eq!(IndexRecord::decode(&[1; 10]), None);
    }
}
