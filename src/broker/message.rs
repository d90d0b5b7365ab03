//! A message as the broker stores and delivers it.
//!
//! Record layout in the shard (the store treats it as opaque bytes):
//! `header = exchange_len:u8 exchange routing_key_len:u8 routing_key properties`, where
//! `properties` are the content-header property flags and fields exactly as published
//! (AMQP 0-9-1 spec 4.2.6.1), and `body` is the message body. Record flags: bit 0 =
//! persistent (delivery_mode 2).
//!
//! [`encode_properties`] and [`decode_properties`] convert between the raw properties and
//! their fields (for the headers a move adds, e.g. dead-lettering's `x-death`).

use amq_protocol::protocol::basic::AMQPProperties;
use bytes::{BufMut, Bytes};

/// Record flag: the message was published with delivery_mode 2.
pub const FLAG_PERSISTENT: u8 = 1;

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
    pub fn new(exchange: &str, routing_key: &str, raw_properties: &[u8], body: Bytes, persistent: bool) -> Message {
        let mut h = Vec::with_capacity(2 + exchange.len() + routing_key.len() + raw_properties.len());
        h.put_u8(exchange.len() as u8);
        h.extend_from_slice(exchange.as_bytes());
        h.put_u8(routing_key.len() as u8);
        h.extend_from_slice(routing_key.as_bytes());
        h.extend_from_slice(raw_properties);
        Message { header: Bytes::from(h), body, flags: if persistent { FLAG_PERSISTENT } else { 0 } }
    }

    /// Whether the message is persistent (delivery_mode 2).
    pub fn persistent(&self) -> bool {
        self.flags & FLAG_PERSISTENT != 0
    }

    /// Splits the stored header into (exchange, routing key, raw properties).
    /// A malformed header (never written by ringmq) yields empty parts.
    pub fn parts(&self) -> (&str, &str, &[u8]) {
        split_header(&self.header)
    }
}

/// Splits a stored header into (exchange, routing key, raw properties).
pub fn split_header(h: &[u8]) -> (&str, &str, &[u8]) {
    let get = |at: usize| -> Option<(&str, usize)> {
        let len = *h.get(at)? as usize;
        let s = std::str::from_utf8(h.get(at + 1..at + 1 + len)?).ok()?;
        Some((s, at + 1 + len))
    };
    match get(0).and_then(|(x, n)| get(n).map(|(rk, m)| (x, rk, m))) {
        Some((x, rk, m)) => (x, rk, &h[m..]),
        None => ("", "", &[]),
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
    fn header_round_trip() {
        let m = Message::new("amq.direct", "rk.1", &[0x80, 0, 1, b'x'], Bytes::from_static(b"body"), true);
        assert!(m.persistent());
        assert_eq!(m.parts(), ("amq.direct", "rk.1", &[0x80, 0, 1, b'x'][..]));
        assert_eq!(split_header(&[5, b'a']), ("", "", &[][..]));
    }
}
