//! A message as the broker stores and delivers it.
//!
//! Record layout in the shard (the store treats it as opaque bytes):
//! `header = exchange_len:u8 exchange routing_key_len:u8 routing_key properties`, where
//! `properties` are the content-header property flags and fields exactly as published
//! (AMQP 0-9-1 spec 4.2.6.1), and `body` is the message body. Record flags: bit 0 =
//! persistent (delivery_mode 2); bit 1 = [`FLAG_DEADLINE`]: the header starts with the
//! message's expiry deadline, 8 bytes big-endian (ms since the Unix epoch), before the layout
//! above. Only a message with a TTL (`x-message-ttl` or `expiration`: `queue::ttl`) carries
//! it, so a message without one is stored and read as before.
//!
//! [`encode_properties`] and [`decode_properties`] convert between the raw properties and
//! their fields (for the headers a move adds, e.g. dead-lettering's `x-death`).

use amq_protocol::protocol::basic::AMQPProperties;
use bytes::{BufMut, Bytes};

/// Record flag: the message was published with delivery_mode 2.
pub const FLAG_PERSISTENT: u8 = 1;
/// Record flag: the header starts with an 8-byte expiry deadline (see the module doc).
/// Restart filters keep records by [`FLAG_PERSISTENT`] alone (`flags & keep == keep`), so
/// this bit changes nothing there.
pub const FLAG_DEADLINE: u8 = 2;

/// Most ms a TTL may be (`x-message-ttl`, `expiration`): RabbitMQ's `?MAX_EXPIRY_TIMER`,
/// ten years.
pub const MAX_TTL_MS: u64 = 315_360_000_000;

/// Bytes of one chunk of a thread's header arena ([`Message::new`]): ~250 headers of a
/// publish to a short queue name with a few properties.
pub const HEADER_ARENA_BYTES: usize = 16 << 10;

thread_local! {
    /// Where [`Message::new`] writes headers: the unused rest of the current chunk.
    static HEADER_ARENA: std::cell::RefCell<bytes::BytesMut> = std::cell::RefCell::new(bytes::BytesMut::new());
}

/// A message on its way to or from a queue. Cloning is cheap (reference-counted bytes),
/// so one publish routed to many queues shares one body.
#[derive(Clone, Debug)]
pub struct Message {
    /// Stored header: exchange, routing key and raw properties (see the module doc).
    pub header: Bytes,
    /// Body bytes.
    pub body: Bytes,
    /// Record flags ([`FLAG_PERSISTENT`]).
    pub flags: u8,
}

impl Message {
    /// Builds a message from the parts of a basic.publish.
    ///
    /// `exchange` and `routing_key` are AMQP short strings (≤ 255 bytes, enforced by the codec).
    ///
    /// The header is written into this thread's header arena ([`HEADER_ARENA_BYTES`] chunks)
    /// and split off it: a message costs no allocation of its own for its header, and the
    /// store's copy of it is a reference count (a header built in a `Vec` cost two
    /// allocations and frees per message, ~5 % of a core at 1 M msgs/s). A chunk is freed
    /// with the last header in it, or reused once all of them are gone.
    pub fn new(exchange: &str, routing_key: &str, raw_properties: &[u8], body: Bytes, persistent: bool) -> Message {
        let need = 2 + exchange.len() + routing_key.len() + raw_properties.len();
        let header = HEADER_ARENA.with(|arena| {
            let mut h = arena.borrow_mut();
            if h.capacity() < need {
                h.reserve(need.max(HEADER_ARENA_BYTES));
            }
            h.put_u8(exchange.len() as u8);
            h.extend_from_slice(exchange.as_bytes());
            h.put_u8(routing_key.len() as u8);
            h.extend_from_slice(routing_key.as_bytes());
            h.extend_from_slice(raw_properties);
            h.split().freeze()
        });
        Message { header, body, flags: if persistent { FLAG_PERSISTENT } else { 0 } }
    }

    /// Whether the message is persistent (delivery_mode 2).
    pub fn persistent(&self) -> bool {
        self.flags & FLAG_PERSISTENT != 0
    }

    /// Splits the stored header into (exchange, routing key, raw properties), past the
    /// deadline when there is one. A malformed header (never written by ringmq) yields empty
    /// parts.
    pub fn parts(&self) -> (&str, &str, &[u8]) {
        split_header(self.header.get(self.deadline_len()..).unwrap_or_default())
    }

    /// [`Message::parts`] as bytes, for a basic.deliver: what `Message::new` wrote from
    /// strings already checked, so not checked again (validating both per delivery was 2 %
    /// of a core at 1 M msgs/s).
    pub fn wire_parts(&self) -> (&[u8], &[u8], &[u8]) {
        split_header_bytes(self.header.get(self.deadline_len()..).unwrap_or_default())
    }

    /// The expiry deadline (ms since the Unix epoch), when the message has one.
    pub fn deadline(&self) -> Option<u64> {
        deadline_of(self.flags, &self.header)
    }

    fn deadline_len(&self) -> usize {
        if self.flags & FLAG_DEADLINE != 0 {
            8
        } else {
            0
        }
    }

    /// The message with expiry deadline `at_ms` (ms since the Unix epoch), or its own when
    /// that is earlier (the smaller TTL wins). Copies the header (not the body) when it
    /// changes.
    pub fn with_deadline(self, at_ms: u64) -> Message {
        let old = self.deadline();
        if old.is_some_and(|d| d <= at_ms) {
            return self;
        }
        let rest = &self.header[self.deadline_len()..];
        let mut h = Vec::with_capacity(8 + rest.len());
        h.put_u64(at_ms);
        h.extend_from_slice(rest);
        Message { header: Bytes::from(h), body: self.body, flags: self.flags | FLAG_DEADLINE }
    }
}

/// The deadline a record of `flags` and `header` carries (see the module doc).
pub fn deadline_of(flags: u8, header: &[u8]) -> Option<u64> {
    if flags & FLAG_DEADLINE == 0 {
        return None;
    }
    header.get(..8).map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
}

/// Parses a per-message `expiration` property as RabbitMQ does (`rabbit_basic:
/// parse_expiration`, Erlang's `string:to_integer`: an optional sign, then digits, nothing
/// after them): the TTL in ms.
///
/// # Errors
/// The part of RabbitMQ's 406 text after `invalid expiration '<value>': ` — `no_integer`,
/// `{leftover_string,"<rest>"}`, `{value_negative,<n>}` or `{value_too_large,<n>}`.
pub fn parse_expiration(s: &str) -> Result<u64, String> {
    let b = s.as_bytes();
    let sign = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let digits = b[sign..].iter().take_while(|c| c.is_ascii_digit()).count();
    if digits == 0 {
        return Err("no_integer".to_owned());
    }
    let (num, rest) = s.split_at(sign + digits);
    if !rest.is_empty() {
        return Err(format!("{{leftover_string,\"{rest}\"}}"));
    }
    let n: i128 = num.parse().unwrap_or(i128::MAX);
    check_ttl(n)
}

/// RabbitMQ's `check_expiry`: a TTL in ms is 0 ..= [`MAX_TTL_MS`].
///
/// # Errors
/// `{value_negative,<n>}` or `{value_too_large,<n>}`, as RabbitMQ writes them.
pub fn check_ttl(n: i128) -> Result<u64, String> {
    if n < 0 {
        return Err(format!("{{value_negative,{n}}}"));
    }
    if n > i128::from(MAX_TTL_MS) {
        return Err(format!("{{value_too_large,{n}}}"));
    }
    Ok(n as u64)
}

/// Splits a stored header into (exchange, routing key, raw properties).
pub fn split_header(h: &[u8]) -> (&str, &str, &[u8]) {
    let (x, rk, props) = split_header_bytes(h);
    match (std::str::from_utf8(x), std::str::from_utf8(rk)) {
        (Ok(x), Ok(rk)) => (x, rk, props),
        _ => ("", "", &[]),
    }
}

/// [`split_header`] without the UTF-8 check: exchange and routing key as the short
/// strings' bytes. A malformed header yields empty parts.
pub fn split_header_bytes(h: &[u8]) -> (&[u8], &[u8], &[u8]) {
    let get = |at: usize| -> Option<(&[u8], usize)> {
        let len = *h.get(at)? as usize;
        Some((h.get(at + 1..at + 1 + len)?, at + 1 + len))
    };
    match get(0).and_then(|(x, n)| get(n).map(|(rk, m)| (x, rk, m))) {
        Some((x, rk, m)) => (x, rk, &h[m..]),
        None => (&[], &[], &[]),
    }
}

/// Serializes `props` into the property flags + fields layout of a content header.
pub fn encode_properties(props: &AMQPProperties) -> Vec<u8> {
    cookie_factory::gen_simple(amq_protocol::protocol::basic::gen_properties(props), Vec::new()).expect("encoding properties into a Vec")
}

/// Parses property flags + fields (the inverse of [`encode_properties`]).
pub fn decode_properties(raw: &[u8]) -> Option<AMQPProperties> {
    match amq_protocol::protocol::basic::parse_properties(raw) {
        Ok((&[], p)) => Some(p),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_from_one_arena_stay_apart_across_chunks_and_after_reuse() {
        let props = [0x80u8, 0, 3, b'a', b'b', b'c'];
        // Enough headers to fill several chunks; every other one is dropped at once, so
        // chunks are both shared by live headers and reused.
        let mut kept = Vec::new();
        for i in 0..5 * HEADER_ARENA_BYTES / 20 {
            let rk = format!("key.{i}");
            let m = Message::new("x", &rk, &props, Bytes::new(), false);
            if i % 2 == 0 {
                kept.push((rk, m));
            }
        }
        // A header as long as a whole chunk still gets one of its own.
        let long = "k".repeat(255);
        let big = Message::new(&long, &long, &vec![7u8; HEADER_ARENA_BYTES], Bytes::new(), false);
        assert_eq!(big.parts().2.len(), HEADER_ARENA_BYTES);
        for (rk, m) in &kept {
            assert_eq!(m.parts(), ("x", rk.as_str(), &props[..]));
        }
    }

    #[test]
    fn header_round_trip() {
        let m = Message::new("amq.direct", "rk.1", &[0x80, 0, 1, b'x'], Bytes::from_static(b"body"), true);
        assert!(m.persistent());
        assert_eq!(m.parts(), ("amq.direct", "rk.1", &[0x80, 0, 1, b'x'][..]));
        assert_eq!(m.wire_parts(), (&b"amq.direct"[..], &b"rk.1"[..], &[0x80, 0, 1, b'x'][..]));
        assert_eq!(split_header(&[5, b'a']), ("", "", &[][..]));
    }

    #[test]
    fn a_deadline_goes_before_the_header_and_the_smaller_one_wins() {
        let m = Message::new("x", "rk", &[0, 0], Bytes::from_static(b"b"), true);
        assert_eq!(m.deadline(), None);
        let d = m.clone().with_deadline(1_000);
        assert_eq!((d.deadline(), d.flags), (Some(1_000), FLAG_PERSISTENT | FLAG_DEADLINE));
        assert_eq!(d.parts(), m.parts());
        assert_eq!(d.clone().with_deadline(2_000).deadline(), Some(1_000), "a later deadline changes nothing");
        let e = d.with_deadline(500);
        assert_eq!((e.deadline(), e.parts()), (Some(500), m.parts()));
    }

    #[test]
    fn expiration_as_rabbitmq_parses_it() {
        assert_eq!(parse_expiration("1000"), Ok(1000));
        assert_eq!(parse_expiration("+5"), Ok(5));
        assert_eq!(parse_expiration("0"), Ok(0));
        assert_eq!(parse_expiration("abc").unwrap_err(), "no_integer");
        assert_eq!(parse_expiration("").unwrap_err(), "no_integer");
        assert_eq!(parse_expiration(" 5").unwrap_err(), "no_integer");
        assert_eq!(parse_expiration("10x").unwrap_err(), "{leftover_string,\"x\"}");
        assert_eq!(parse_expiration("-1").unwrap_err(), "{value_negative,-1}");
        assert_eq!(parse_expiration("315360000000"), Ok(MAX_TTL_MS));
        assert_eq!(parse_expiration("315360000001").unwrap_err(), "{value_too_large,315360000001}");
    }
}
