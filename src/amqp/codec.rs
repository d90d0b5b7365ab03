//! Frame codec: splits the byte stream into AMQP 0-9-1 frames and writes frames.
//!
//! Wire format (spec section 4.2.3): `type:u8 channel:u16 size:u32 payload[size] 0xCE`.
//! Method payloads are parsed with amq-protocol; content header properties are kept as the
//! raw bytes the publisher sent (so they are delivered byte-for-byte) and parsed once for
//! the fields the broker needs; body payloads are zero-copy slices of the read buffer.

use amq_protocol::frame::parsing::parse_content_header;
use amq_protocol::protocol::{basic, basic::AMQPProperties, parse_class, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};
use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::error::AmqpError;

/// Frame type octets (spec, "Constants").
pub const FRAME_METHOD: u8 = 1;
/// Content header frame.
pub const FRAME_HEADER: u8 = 2;
/// Content body frame.
pub const FRAME_BODY: u8 = 3;
/// Heartbeat frame.
pub const FRAME_HEARTBEAT: u8 = 8;
/// Frame-end octet.
pub const FRAME_END: u8 = 0xCE;
/// Bytes of framing around a payload: 7 of header, 1 frame-end.
pub const FRAME_OVERHEAD: usize = 8;
/// The AMQP 0-9-1 protocol header a client sends first and the server answers with
/// when the version is wrong (spec 4.2.2).
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";

/// One decoded frame.
#[derive(Debug)]
pub enum Frame {
    /// A method frame; `class_id`/`method_id` as on the wire.
    Method {
        /// Channel number.
        channel: u16,
        /// The parsed method.
        method: Box<AMQPClass>,
    },
    /// A content header frame.
    Header {
        /// Channel number.
        channel: u16,
        /// Content class (60 for basic).
        class_id: u16,
        /// Total body size in bytes.
        body_size: u64,
        /// Parsed properties; `None` for the plain forms (no property, or `delivery_mode`
        /// alone), which [`plain_properties`] reads from the raw ones (parsing and boxing
        /// them was 2 % of a core at 1 M msgs/s).
        properties: Option<Box<AMQPProperties>>,
        /// The property flags and fields exactly as received (what a delivery sends back).
        raw_properties: Bytes,
    },
    /// A content body frame (a slice of the body).
    Body {
        /// Channel number.
        channel: u16,
        /// Body bytes of this frame.
        payload: Bytes,
    },
    /// A heartbeat frame; `channel` must be 0.
    Heartbeat {
        /// Channel number as received.
        channel: u16,
    },
}

/// Deepest nesting of field tables and arrays accepted in a frame (a table holding a table
/// is depth 2). Deeper input is refused with 502 SYNTAX_ERROR: the metadata thread and
/// every later reader of the value would otherwise recurse that deep.
pub const MAX_TABLE_DEPTH: usize = 64;

/// Whether `t` nests no deeper than [`MAX_TABLE_DEPTH`] (iterative: no recursion here).
pub fn table_depth_ok(t: &FieldTable) -> bool {
    let mut stack: Vec<(&AMQPValue, usize)> = t.inner().values().map(|v| (v, 1)).collect();
    while let Some((v, d)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &AMQPValue>> = match v {
            AMQPValue::FieldTable(t) => Box::new(t.inner().values()),
            AMQPValue::FieldArray(a) => Box::new(a.as_slice().iter()),
            _ => continue,
        };
        if d + 1 > MAX_TABLE_DEPTH {
            return false;
        }
        stack.extend(children.map(|c| (c, d + 1)));
    }
    true
}

/// The field tables a client may send in a method's arguments.
pub(crate) fn method_tables(m: &AMQPClass) -> Option<&FieldTable> {
    use amq_protocol::protocol::{basic, connection, exchange, queue};
    Some(match m {
        AMQPClass::Connection(connection::AMQPMethod::StartOk(x)) => &x.client_properties,
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(x)) => &x.arguments,
        AMQPClass::Exchange(exchange::AMQPMethod::Bind(x)) => &x.arguments,
        AMQPClass::Exchange(exchange::AMQPMethod::Unbind(x)) => &x.arguments,
        AMQPClass::Queue(queue::AMQPMethod::Declare(x)) => &x.arguments,
        AMQPClass::Queue(queue::AMQPMethod::Bind(x)) => &x.arguments,
        AMQPClass::Queue(queue::AMQPMethod::Unbind(x)) => &x.arguments,
        AMQPClass::Basic(basic::AMQPMethod::Consume(x)) => &x.arguments,
        _ => return None,
    })
}

/// Known (class id, method id) pairs that a client may send; anything else gets
/// 540 NOT_IMPLEMENTED, per spec 1.2 "not-implemented".
fn is_known_method(class_id: u16, method_id: u16) -> bool {
    match class_id {
        10 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31 | 40 | 41 | 50 | 51 | 60 | 61 | 70 | 71),
        20 => matches!(method_id, 10 | 11 | 20 | 21 | 40 | 41),
        30 => matches!(method_id, 10 | 11),
        40 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31 | 40 | 51),
        50 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31 | 40 | 41 | 50 | 51),
        60 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31 | 40 | 50 | 60 | 70 | 71 | 72 | 80 | 90 | 100 | 110 | 111 | 120),
        85 => matches!(method_id, 10 | 11),
        90 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31),
        _ => false,
    }
}

/// Most bytes [`decode_frame`] reserves for a frame still arriving, ahead of its bytes.
const RESERVE_AHEAD: usize = 1 << 20;

/// Decodes one frame from the front of `buf`.
///
/// Returns `Ok(None)` when `buf` does not yet hold a whole frame. `frame_max` is the
/// negotiated maximum frame size in bytes, framing included (spec 4.2.1).
///
/// # Errors
/// 501 FRAME_ERROR for an oversized frame, a bad frame-end octet or an unknown frame type;
/// 540 NOT_IMPLEMENTED for an unknown class or method (and basic.qos with a prefetch_size);
/// 501 FRAME_ERROR for a method whose arguments do not decode; 502 SYNTAX_ERROR for a
/// content header whose fields do not parse. All are connection errors.
pub fn decode_frame(buf: &mut BytesMut, frame_max: u32) -> Result<Option<Frame>, AmqpError> {
    if buf.len() < 7 {
        return Ok(None);
    }
    let frame_type = buf[0];
    let channel = u16::from_be_bytes([buf[1], buf[2]]);
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize;
    if frame_max > 0 && size + FRAME_OVERHEAD > frame_max as usize {
        return Err(AmqpError::frame_error(format!("frame of {} bytes exceeds frame_max {frame_max}", size + FRAME_OVERHEAD)));
    }
    if !matches!(frame_type, FRAME_METHOD | FRAME_HEADER | FRAME_BODY | FRAME_HEARTBEAT) {
        return Err(AmqpError::frame_error(format!("unknown frame type {frame_type}")));
    }
    if frame_type == FRAME_HEARTBEAT && size != 0 {
        // Spec 4.2.7: a heartbeat frame has an empty payload; anything else is a frame error.
        return Err(AmqpError::frame_error(format!("heartbeat frame with a payload of {size} bytes")));
    }
    if buf.len() < 7 + size + 1 {
        // Room for the rest of the frame, but never more than RESERVE_AHEAD before the
        // bytes come: a peer's size field alone must not make the broker allocate (with
        // frame_max 0, or a large --frame-max, it may claim 4 GiB; found by fuzz/frames).
        buf.reserve((7 + size + 1 - buf.len()).min(RESERVE_AHEAD));
        return Ok(None);
    }
    if buf[7 + size] != FRAME_END {
        return Err(AmqpError::frame_error(format!("bad frame end octet 0x{:02x}", buf[7 + size])));
    }
    if frame_type == FRAME_METHOD {
        // Parsed from the buffer in place: a method keeps no slice of it.
        let frame = decode_method(channel, &buf[7..7 + size]);
        buf.advance(7 + size + 1);
        return frame.map(Some);
    }
    if frame_type == FRAME_HEADER {
        // Parsed in place too; only the raw properties are kept (12 bytes in: class id,
        // weight, body size), and the two forms nearly every publisher sends are static.
        let payload = &buf[7..7 + size];
        let (class_id, body_size, properties) = match plain_header(payload) {
            Some((class_id, body_size)) => (class_id, body_size, None),
            None => match decode_header(payload) {
                Some(Ok((class_id, body_size, properties))) => (class_id, body_size, Some(Box::new(properties))),
                Some(Err(e)) => return Err(e),
                None => return Err(AmqpError::syntax_error("malformed content header frame")),
            },
        };
        let raw_properties = match &buf[7 + 12..7 + size] {
            [0, 0] => Bytes::from_static(&[0, 0]),
            [0x10, 0, 1] => Bytes::from_static(&[0x10, 0, 1]),
            [0x10, 0, 2] => Bytes::from_static(&[0x10, 0, 2]),
            _ => {
                buf.advance(7 + 12);
                let raw = buf.split_to(size - 12).freeze();
                buf.advance(1);
                return Ok(Some(Frame::Header { channel, class_id, body_size, properties, raw_properties: raw }));
            }
        };
        buf.advance(7 + size + 1);
        return Ok(Some(Frame::Header { channel, class_id, body_size, properties, raw_properties }));
    }
    buf.advance(7);
    let frame = match frame_type {
        FRAME_BODY => Frame::Body { channel, payload: buf.split_to(size).freeze() },
        _ => Frame::Heartbeat { channel },
    };
    buf.advance(1);
    Ok(Some(frame))
}

/// Decodes a method frame's payload (class id, method id, arguments).
fn decode_method(channel: u16, payload: &[u8]) -> Result<Frame, AmqpError> {
    if payload.len() < 4 {
        return Err(AmqpError::syntax_error("method frame shorter than 4 bytes"));
    }
    let class_id = u16::from_be_bytes([payload[0], payload[1]]);
    let method_id = u16::from_be_bytes([payload[2], payload[3]]);
    let undecodable = || {
        // Spec "frame-error": a frame the recipient could not decode (RabbitMQ answers
        // truncated arguments and overlong field tables the same way).
        AmqpError::frame_error(format!("cannot decode the arguments of method {class_id}.{method_id}")).on_method(class_id, method_id)
    };
    if (class_id, method_id) == (60, 40) {
        // basic.publish, the method of every message: parsed by hand (amq-protocol's parser
        // allocates its flag names for each one).
        let p = parse_publish(&payload[4..]).ok_or_else(undecodable)?;
        return Ok(Frame::Method { channel, method: Box::new(AMQPClass::Basic(basic::AMQPMethod::Publish(p))) });
    }
    if !is_known_method(class_id, method_id) {
        return Err(AmqpError::not_implemented(format!("unknown method {class_id}.{method_id}")).on_method(class_id, method_id));
    }
    // basic.qos prefetch_size is dropped by the parser; RabbitMQ refuses a non-zero one.
    if (class_id, method_id) == (60, 10) && payload.len() >= 8 && payload[4..8] != [0, 0, 0, 0] {
        return Err(AmqpError::not_implemented("prefetch_size != 0 is not supported; use prefetch_count").on_method(class_id, method_id));
    }
    match parse_class(payload) {
        Ok((&[], method)) => {
            if method_tables(&method).is_some_and(|t| !table_depth_ok(t)) {
                return Err(AmqpError::syntax_error(format!("field table nested deeper than {MAX_TABLE_DEPTH} levels"))
                    .on_method(class_id, method_id));
            }
            Ok(Frame::Method { channel, method: Box::new(method) })
        }
        _ => Err(undecodable()),
    }
}

/// basic.publish's arguments (spec 1.8.3.7: reserved short, exchange and routing key as
/// short strings of UTF-8, then one octet of bits: mandatory, immediate), exactly as
/// amq-protocol's parser reads them: `None` where it fails (short input, bytes left over,
/// a string that is not UTF-8).
fn parse_publish(args: &[u8]) -> Option<basic::Publish> {
    fn short_string(i: &[u8]) -> Option<(String, &[u8])> {
        let (&n, rest) = i.split_first()?;
        let (s, rest) = (rest.get(..n as usize)?, &rest[n as usize..]);
        Some((std::str::from_utf8(s).ok()?.to_owned(), rest))
    }
    let (exchange, rest) = short_string(args.get(2..)?)?;
    let (routing_key, rest) = short_string(rest)?;
    let &[bits] = rest else { return None };
    Some(basic::Publish { exchange: exchange.into(), routing_key: routing_key.into(), mandatory: bits & 1 != 0, immediate: bits & 2 != 0 })
}

/// Property flags of a content header that carries no property (spec 4.2.6.1).
const NO_PROPERTIES: u16 = 0;
/// Property flags of a content header that carries only `delivery_mode`.
const DELIVERY_MODE_ONLY: u16 = 1 << 12;

/// Decodes a content header frame's payload: (class id, body size in bytes, properties);
/// `None` when it does not parse to its last byte, `Some(Err)` (502) for headers nested
/// deeper than [`MAX_TABLE_DEPTH`]. The two headers most publishers send (no property, or
/// `delivery_mode` alone) are read by hand; the others by amq-protocol.
fn decode_header(payload: &[u8]) -> Option<Result<(u16, u64, AMQPProperties), AmqpError>> {
    if payload.len() >= 14 {
        let class_id = u16::from_be_bytes([payload[0], payload[1]]);
        let body_size = u64::from_be_bytes(payload[4..12].try_into().expect("8 bytes"));
        match (u16::from_be_bytes([payload[12], payload[13]]), &payload[14..]) {
            (NO_PROPERTIES, []) => return Some(Ok((class_id, body_size, AMQPProperties::default()))),
            (DELIVERY_MODE_ONLY, &[mode]) => return Some(Ok((class_id, body_size, AMQPProperties::default().with_delivery_mode(mode)))),
            _ => {}
        }
    }
    match parse_content_header(payload) {
        Ok((_, header)) if header.properties.headers().as_ref().is_some_and(|h| !table_depth_ok(h)) => {
            Some(Err(AmqpError::syntax_error(format!("message headers nested deeper than {MAX_TABLE_DEPTH} levels"))))
        }
        Ok((&[], header)) => Some(Ok((header.class_id, header.body_size, header.properties))),
        _ => None,
    }
}

/// A content header payload of a plain form (spec 4.2.6.1: class, weight, body size, then
/// property flags announcing no property, or `delivery_mode` alone, and nothing else):
/// its class id and body size. `None` for any other payload.
fn plain_header(payload: &[u8]) -> Option<(u16, u64)> {
    let flags = u16::from_be_bytes([*payload.get(12)?, *payload.get(13)?]);
    match (flags, payload.len()) {
        (NO_PROPERTIES, 14) | (DELIVERY_MODE_ONLY, 15) => {
            Some((u16::from_be_bytes([payload[0], payload[1]]), u64::from_be_bytes(payload[4..12].try_into().expect("8 bytes"))))
        }
        _ => None,
    }
}

/// The properties of a plain content header ([`Frame::Header`] without parsed ones) from
/// its raw properties: `delivery_mode` when given, nothing else.
pub fn plain_properties(raw: &[u8]) -> AMQPProperties {
    match plain_delivery_mode(raw) {
        Some(mode) => AMQPProperties::default().with_delivery_mode(mode),
        None => AMQPProperties::default(),
    }
}

/// The `delivery_mode` of a plain content header's raw properties, when given.
pub fn plain_delivery_mode(raw: &[u8]) -> Option<u8> {
    match *raw {
        [0x10, 0, mode] => Some(mode),
        _ => None,
    }
}

/// Appends one method frame for `method` on `channel` to `out`.
pub fn encode_method(out: &mut Vec<u8>, channel: u16, method: &AMQPClass) {
    let start = out.len();
    out.put_u8(FRAME_METHOD);
    out.put_u16(channel);
    out.put_u32(0);
    let body_start = out.len();
    let buf = std::mem::take(out);
    // Writing to a Vec cannot fail short of allocation failure.
    let buf = cookie_factory::gen_simple(amq_protocol::protocol::gen_class(method), buf).expect("encoding a method into a Vec");
    *out = buf;
    let size = (out.len() - body_start) as u32;
    out[start + 3..start + 7].copy_from_slice(&size.to_be_bytes());
    out.put_u8(FRAME_END);
}

/// Appends a basic.deliver method frame (spec 1.8.3.9), encoded by hand: it is sent once
/// per delivered message. Short strings are at most 255 bytes (the caller's values come
/// from the wire or from the broker, which keeps them short).
pub fn encode_deliver(
    out: &mut Vec<u8>,
    channel: u16,
    consumer_tag: &str,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &[u8],
    routing_key: &[u8],
) {
    fn short(s: &[u8]) -> &[u8] {
        &s[..s.len().min(255)]
    }
    let (ct, ex, rk) = (short(consumer_tag.as_bytes()), short(exchange), short(routing_key));
    let size = 4 + 1 + ct.len() + 8 + 1 + 1 + ex.len() + 1 + rk.len();
    out.reserve(size + FRAME_OVERHEAD);
    out.put_u8(FRAME_METHOD);
    out.put_u16(channel);
    out.put_u32(size as u32);
    out.put_u16(60);
    out.put_u16(60);
    out.put_u8(ct.len() as u8);
    out.extend_from_slice(ct);
    out.put_u64(delivery_tag);
    out.put_u8(redelivered as u8);
    out.put_u8(ex.len() as u8);
    out.extend_from_slice(ex);
    out.put_u8(rk.len() as u8);
    out.extend_from_slice(rk);
    out.put_u8(FRAME_END);
}

/// Appends a content header frame and the body frames of a message to `out`.
///
/// `raw_properties` are the property flags and fields as stored; `body` is split into
/// frames of at most `frame_max - 8` bytes (`frame_max` 0 = unlimited).
pub fn encode_content(out: &mut Vec<u8>, channel: u16, raw_properties: &[u8], body: &[u8], frame_max: u32) {
    let chunk = if frame_max == 0 { usize::MAX } else { frame_max as usize - FRAME_OVERHEAD };
    // One reservation for all frames: a large body grown by doubling went through ~24
    // reallocations into fresh pages per 10 MB message.
    let frames = body.len().div_ceil(chunk.max(1));
    out.reserve(FRAME_OVERHEAD + 12 + raw_properties.len() + body.len() + frames * FRAME_OVERHEAD);
    out.put_u8(FRAME_HEADER);
    out.put_u16(channel);
    out.put_u32((12 + raw_properties.len()) as u32);
    out.put_u16(60);
    out.put_u16(0);
    out.put_u64(body.len() as u64);
    out.extend_from_slice(raw_properties);
    out.put_u8(FRAME_END);
    for piece in body.chunks(chunk.max(1)) {
        out.put_u8(FRAME_BODY);
        out.put_u16(channel);
        out.put_u32(piece.len() as u32);
        out.extend_from_slice(piece);
        out.put_u8(FRAME_END);
    }
}

/// Appends a heartbeat frame (channel 0, empty payload) to `out`.
pub fn encode_heartbeat(out: &mut Vec<u8>) {
    out.extend_from_slice(&[FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::message::encode_properties;
    use amq_protocol::protocol::{basic, queue};

    fn one(bytes: &[u8], frame_max: u32) -> Result<Option<Frame>, AmqpError> {
        let mut b = BytesMut::from(bytes);
        decode_frame(&mut b, frame_max)
    }

    #[test]
    fn method_round_trip() {
        let m = AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q1".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: Default::default(),
        }));
        let mut out = Vec::new();
        encode_method(&mut out, 3, &m);
        let mut b = BytesMut::from(&out[..]);
        match decode_frame(&mut b, 131072).unwrap().unwrap() {
            Frame::Method { channel, method } => {
                assert_eq!(channel, 3);
                assert_eq!(*method, m);
            }
            f => panic!("unexpected {f:?}"),
        }
        assert!(b.is_empty());
    }

    /// A size field alone reserves at most RESERVE_AHEAD (fuzz/regressions/frames/oom-*:
    /// a 4 GiB claim with no frame_max made the buffer reserve 4 GiB at once).
    #[test]
    fn a_huge_size_field_reserves_little_before_its_bytes_come() {
        for frame_max in [0, u32::MAX] {
            let mut b = BytesMut::from(&[FRAME_BODY, 0, 1, 0xff, 0xff, 0xff, 0xf0, 1, 2, 3][..]);
            assert!(decode_frame(&mut b, frame_max).unwrap().is_none());
            assert!(b.capacity() <= 2 * RESERVE_AHEAD, "reserved {} bytes", b.capacity());
        }
    }

    #[test]
    fn a_heartbeat_with_a_payload_is_a_frame_error() {
        let mut ok = Vec::new();
        encode_heartbeat(&mut ok);
        assert!(matches!(one(&ok, 131072), Ok(Some(Frame::Heartbeat { channel: 0 }))));
        let e = one(&[8, 0, 0, 0, 0, 0, 2, b'h', b'i', 0xce], 131072).unwrap_err();
        assert_eq!(e.code, 501, "{e}");
    }

    #[test]
    fn hand_encoded_deliver_matches_the_generic_encoder() {
        let mut a = Vec::new();
        encode_deliver(&mut a, 7, "ctag-1", 42, true, b"amq.topic", b"a.b");
        let mut b = Vec::new();
        encode_method(
            &mut b,
            7,
            &AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "ctag-1".into(),
                delivery_tag: 42,
                redelivered: true,
                exchange: "amq.topic".into(),
                routing_key: "a.b".into(),
            })),
        );
        assert_eq!(a, b);
    }

    #[test]
    fn deep_tables_are_refused() {
        let mut v = AMQPValue::LongString("x".into());
        for _ in 0..MAX_TABLE_DEPTH {
            let mut t = FieldTable::default();
            t.insert("k".into(), v);
            v = AMQPValue::FieldTable(t);
        }
        let AMQPValue::FieldTable(ok) = v.clone() else { unreachable!() };
        assert!(table_depth_ok(&ok));
        let mut t = FieldTable::default();
        t.insert("k".into(), v);
        assert!(!table_depth_ok(&t));
        let m = AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q".into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: t,
        }));
        let mut out = Vec::new();
        encode_method(&mut out, 1, &m);
        assert_eq!(one(&out, 0).unwrap_err().code, 502);
    }

    #[test]
    fn partial_frame_waits() {
        let mut out = Vec::new();
        encode_heartbeat(&mut out);
        assert!(one(&out[..5], 0).unwrap().is_none());
        assert!(one(&out[..7], 0).unwrap().is_none());
        assert!(matches!(one(&out, 0).unwrap(), Some(Frame::Heartbeat { channel: 0 })));
    }

    #[test]
    fn bad_frame_end_is_501() {
        let e = one(&[8, 0, 0, 0, 0, 0, 0, 0xCD], 0).unwrap_err();
        assert_eq!(e.code, 501);
    }

    #[test]
    fn oversized_is_501() {
        let e = one(&[3, 0, 1, 0, 0, 16, 0], 4096).unwrap_err();
        assert_eq!(e.code, 501);
    }

    #[test]
    fn unknown_method_is_540() {
        let e = one(&[1, 0, 1, 0, 0, 0, 4, 0, 60, 0, 99, 0xCE], 0).unwrap_err();
        assert_eq!((e.code, e.class_id, e.method_id), (540, 60, 99));
    }

    #[test]
    fn content_round_trip_splits_body() {
        let props = basic::AMQPProperties::default().with_delivery_mode(2).with_message_id("m".into());
        let raw = encode_properties(&props);
        let body = vec![7u8; 10_000];
        let mut out = Vec::new();
        encode_content(&mut out, 1, &raw, &body, 4096);
        let mut b = BytesMut::from(&out[..]);
        let mut got = Vec::new();
        let mut frames = 0;
        while let Some(f) = decode_frame(&mut b, 4096).unwrap() {
            match f {
                Frame::Header { body_size, properties, raw_properties, .. } => {
                    assert_eq!(body_size, 10_000);
                    assert_eq!(*properties.expect("parsed"), props);
                    assert_eq!(&raw_properties[..], &raw[..]);
                }
                Frame::Body { payload, .. } => {
                    frames += 1;
                    got.extend_from_slice(&payload)
                }
                f => panic!("unexpected {f:?}"),
            }
        }
        assert_eq!(got, body);
        assert_eq!(frames, 3);
    }

    /// Content headers of the common forms (kept as static bytes) and of others (a slice of
    /// the read buffer), back to back in one buffer: each keeps its own raw properties, and
    /// the frames after it decode from the right place.
    #[test]
    fn raw_properties_survive_in_every_form() {
        let forms = [
            basic::AMQPProperties::default(),
            basic::AMQPProperties::default().with_delivery_mode(1),
            basic::AMQPProperties::default().with_delivery_mode(2),
            basic::AMQPProperties::default().with_delivery_mode(7),
            basic::AMQPProperties::default().with_delivery_mode(2).with_message_id("id-1".into()),
        ];
        let mut out = Vec::new();
        for (i, props) in forms.iter().enumerate() {
            encode_content(&mut out, 1, &encode_properties(props), &[i as u8; 3], 4096);
        }
        let mut b = BytesMut::from(&out[..]);
        for (i, props) in forms.iter().enumerate() {
            match decode_frame(&mut b, 4096).unwrap() {
                Some(Frame::Header { body_size: 3, properties, raw_properties, .. }) => {
                    assert_eq!(properties.is_none(), i < 4, "form {i}: only the plain ones are left unparsed");
                    let properties = properties.map_or_else(|| plain_properties(&raw_properties), |p| *p);
                    assert_eq!(properties, *props, "form {i}");
                    assert_eq!(&raw_properties[..], &encode_properties(props)[..], "form {i}");
                }
                f => panic!("form {i}: expected a header, got {f:?}"),
            }
            match decode_frame(&mut b, 4096).unwrap() {
                Some(Frame::Body { payload, .. }) => assert_eq!(&payload[..], &[i as u8; 3], "form {i}"),
                f => panic!("form {i}: expected a body, got {f:?}"),
            }
        }
        assert!(b.is_empty());
    }

    /// The hand parser of basic.publish agrees with amq-protocol's on every input: what
    /// amq-protocol encodes, and arbitrary bytes (which mostly fail for both).
    mod publish_fast_path {
        use super::*;
        use amq_protocol::protocol::basic::parse_publish as library;
        use proptest::prelude::*;

        fn both(args: &[u8]) {
            let ours = parse_publish(args);
            let theirs = match library(args) {
                Ok((&[], p)) => Some(p),
                _ => None,
            };
            assert_eq!(ours, theirs, "arguments {args:?}");
        }

        proptest! {
            #[test]
            fn encoded(ex in "[a-z.é]{0,40}", rk in ".{0,60}", mandatory: bool, immediate: bool) {
                let p = basic::Publish { exchange: ex.as_str().into(), routing_key: rk.as_str().into(), mandatory, immediate };
                let mut out = Vec::new();
                encode_method(&mut out, 1, &AMQPClass::Basic(basic::AMQPMethod::Publish(p.clone())));
                both(&out[11..out.len() - 1]);
                match one(&out, 0).unwrap().unwrap() {
                    Frame::Method { method, .. } => prop_assert_eq!(*method, AMQPClass::Basic(basic::AMQPMethod::Publish(p))),
                    f => panic!("unexpected {f:?}"),
                }
            }

            #[test]
            fn arbitrary(args in proptest::collection::vec(any::<u8>(), 0..24)) {
                both(&args);
            }

            #[test]
            fn truncated_or_padded(ex in "[a-z]{0,8}", rk in "[a-z]{0,8}", cut in 0usize..20, pad: bool) {
                let p = basic::Publish { exchange: ex.as_str().into(), routing_key: rk.as_str().into(), mandatory: true, immediate: false };
                let mut out = Vec::new();
                encode_method(&mut out, 1, &AMQPClass::Basic(basic::AMQPMethod::Publish(p)));
                let mut args = out[11..out.len() - 1].to_vec();
                args.truncate(args.len().saturating_sub(cut));
                if pad {
                    args.push(0);
                }
                both(&args);
            }
        }

        /// A publish that does not decode is 501 FRAME_ERROR on 60.40, as before.
        #[test]
        fn a_short_publish_is_a_frame_error() {
            let e = one(&[1, 0, 1, 0, 0, 0, 7, 0, 60, 0, 40, 0, 0, 5, 0xCE], 0).unwrap_err();
            assert_eq!((e.code, e.class_id, e.method_id), (501, 60, 40), "{e}");
        }

        /// The two headers read by hand, and their near misses, decode as amq-protocol does.
        #[test]
        fn headers_read_by_hand_match_the_library() {
            let mut cases: Vec<Vec<u8>> = Vec::new();
            for props in [basic::AMQPProperties::default(), basic::AMQPProperties::default().with_delivery_mode(2)] {
                let raw = encode_properties(&props);
                let mut p = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0];
                p.extend_from_slice(&raw);
                cases.push(p.clone());
                cases.push(p[..p.len() - 1].to_vec());
                p.push(9);
                cases.push(p);
            }
            for mode in [0u8, 1, 2, 255] {
                cases.push(vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0x10, 0, mode]);
            }
            for p in cases {
                let ours = decode_header(&p).map(|r| r.unwrap());
                let theirs = match parse_content_header(&p[..]) {
                    Ok((&[], h)) => Some((h.class_id, h.body_size, h.properties)),
                    _ => None,
                };
                assert_eq!(ours, theirs, "header {p:?}");
            }
        }
    }
}
