//! Layout of a bench message body.
//!
//! ```text
//! bytes 0..8   tag, u64 little-endian: run (16 bits) | producer (16 bits) | sequence (32 bits)
//! bytes 8..16  intended send time, u64 little-endian, CLOCK_MONOTONIC ns (see clock::now_ns)
//! bytes 16..   zero filler up to --size
//! ```
//! The run id tells this run's messages from leftovers of an earlier one. Bodies shorter
//! than 16 bytes carry nothing: such runs report rates but no latency nor loss.

/// Bytes a body needs to carry tag and timestamp.
pub const HEADER_LEN: usize = 16;

/// Identity of one message: which run, which producer, which sequence number (from 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tag {
    /// Random per bench process.
    pub run: u16,
    /// Producer index within the run.
    pub producer: u16,
    /// Per-producer sequence number, from 0, in publish order.
    pub seq: u32,
}

impl Tag {
    fn to_u64(self) -> u64 {
        (u64::from(self.run) << 48) | (u64::from(self.producer) << 32) | u64::from(self.seq)
    }

    fn from_u64(v: u64) -> Self {
        Tag { run: (v >> 48) as u16, producer: (v >> 32) as u16, seq: v as u32 }
    }
}

/// Writes tag and timestamp (ns) into the first 16 bytes of `body`; no-op when shorter.
pub fn encode(body: &mut [u8], tag: Tag, sent_ns: u64) {
    if body.len() >= HEADER_LEN {
        body[0..8].copy_from_slice(&tag.to_u64().to_le_bytes());
        body[8..16].copy_from_slice(&sent_ns.to_le_bytes());
    }
}

/// Reads tag and timestamp (ns) back; `None` for bodies shorter than 16 bytes.
pub fn decode(body: &[u8]) -> Option<(Tag, u64)> {
    if body.len() < HEADER_LEN {
        return None;
    }
    let tag = u64::from_le_bytes(body[0..8].try_into().ok()?);
    let ts = u64::from_le_bytes(body[8..16].try_into().ok()?);
    Some((Tag::from_u64(tag), ts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_tag_and_time() {
        let mut b = vec![0u8; 16];
        let tag = Tag { run: 0xBEEF, producer: 999, seq: u32::MAX - 1 };
        encode(&mut b, tag, 123_456_789);
        assert_eq!(decode(&b), Some((tag, 123_456_789)));
    }

    #[test]
    fn short_bodies_carry_nothing() {
        let mut b = vec![0u8; 15];
        encode(&mut b, Tag { run: 1, producer: 1, seq: 1 }, 1);
        assert!(b.iter().all(|&x| x == 0));
        assert_eq!(decode(&b), None);
    }
}
