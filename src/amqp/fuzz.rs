//! Fuzz targets: what a peer's bytes reach first, as functions of `&[u8]`.
//!
//! cargo-fuzz drives them (`fuzz/fuzz_targets/`, run with `fuzz/run.sh`) and `cargo test`
//! replays the corpus kept in `fuzz/corpus/<target>/` and the crashes kept in
//! `fuzz/regressions/<target>/` through them (`tests/fuzz_corpus.rs`). Each must return for
//! any input without a panic, a hang or unbounded allocation, and each checks a property of
//! what it decodes, panicking when it does not hold:
//!
//! | target | input | property |
//! |---|---|---|
//! | [`frames`] | a byte stream cut into chunks | every frame consumes exactly its framed size; a method re-encodes to a frame that decodes to the same encoding; a header's raw properties decode |
//! | [`method`] | a method frame's payload (spec 4.2.4) | parse → encode → parse → encode gives the same bytes; table depth checked without recursion |
//! | [`content_header`] | a content header payload (spec 4.2.6) | properties re-encode to bytes that decode to the same encoding; the stored header splits back |
//! | [`field_table`] | a field table (spec 4.2.5.5) | wire and snapshot (JSON) forms round-trip; every argument reader returns |
//! | [`raft_entry`] | the data of a metadata Raft entry | a batch that decodes re-encodes to the same bytes |
//! | [`topic`] | a binding pattern and a routing key | the topic matcher agrees with a plain recursive one (spec 3.1.3.3) |

use amq_protocol::protocol::{gen_class, parse_class, AMQPClass};
use amq_protocol::types::{generation::gen_field_table, parsing::parse_field_table};
use bytes::BytesMut;

use super::codec::{decode_frame, encode_method, method_tables, table_depth_ok, Frame, FRAME_OVERHEAD};
use crate::broker::message::{decode_properties, encode_properties, split_header, Message};
use crate::broker::{exchange, queue, router, topology};
use crate::meta::codec::{decode_batch, encode_batch};
use crate::meta::topology::QueueDef;
use crate::meta::wire::{field_table_from_wire, field_table_to_wire};

/// The names of the targets, as the folders of `fuzz/corpus/` and the binaries of
/// `fuzz/fuzz_targets/` are named.
pub const TARGETS: [&str; 6] = ["frames", "method", "content_header", "field_table", "raft_entry", "topic"];

/// Runs target `name` on `data`; `false` if there is no such target.
pub fn run(name: &str, data: &[u8]) -> bool {
    match name {
        "frames" => frames(data),
        "method" => method(data),
        "content_header" => content_header(data),
        "field_table" => field_table(data),
        "raft_entry" => raft_entry(data),
        "topic" => topic(data),
        _ => return false,
    }
    true
}

/// The frame splitter ([`decode_frame`]) over a stream that arrives in pieces.
///
/// `data[0]` picks frame_max (4,096 bytes, 131,072 or 0 = none) and `data[1]` the size of
/// the reads (1..=256 bytes); the rest is the stream. Decoding stops at the first error,
/// as a connection does.
pub fn frames(data: &[u8]) {
    let [fm, chunk, stream @ ..] = data else { return };
    let frame_max = [4096, 131_072, 0][usize::from(*fm) % 3];
    let chunk = usize::from(*chunk) + 1;
    let mut buf = BytesMut::new();
    for piece in stream.chunks(chunk) {
        buf.extend_from_slice(piece);
        loop {
            let before = buf.len();
            let claimed = (before >= 7).then(|| u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize);
            match decode_frame(&mut buf, frame_max) {
                Err(_) => return,
                Ok(None) => break,
                Ok(Some(frame)) => {
                    let size = claimed.expect("a frame decoded from fewer than 7 bytes");
                    assert_eq!(before - buf.len(), size + FRAME_OVERHEAD, "a frame consumed other than its framed size");
                    check_frame(frame, size, frame_max);
                }
            }
        }
    }
}

fn check_frame(frame: Frame, size: usize, frame_max: u32) {
    match frame {
        Frame::Method { channel, method } => {
            let mut out = Vec::new();
            encode_method(&mut out, channel, &method);
            let mut again = BytesMut::from(&out[..]);
            match decode_frame(&mut again, 0) {
                Ok(Some(Frame::Method { channel: c, method: m })) => {
                    assert_eq!(c, channel);
                    assert_eq!(encode(&m), encode(&method), "a method re-encoded differently");
                }
                other => panic!("a decoded method did not decode again: {other:?}"),
            }
            assert!(again.is_empty());
        }
        Frame::Header { raw_properties, body_size: _, .. } => {
            assert!(decode_properties(&raw_properties).is_some(), "a header's raw properties do not decode");
        }
        Frame::Body { payload, .. } => assert_eq!(payload.len(), size),
        Frame::Heartbeat { .. } => assert_eq!(size, 0),
    }
    assert!(frame_max == 0 || size + FRAME_OVERHEAD <= frame_max as usize);
}

fn encode(m: &AMQPClass) -> Vec<u8> {
    cookie_factory::gen_simple(gen_class(m), Vec::new()).expect("encoding a method into a Vec")
}

/// The method decoder (amq-protocol's `parse_class`, then the broker's depth check).
pub fn method(data: &[u8]) {
    let Ok((_, m)) = parse_class(data) else { return };
    let _ = method_tables(&m).is_some_and(|t| !table_depth_ok(t));
    let first = encode(&m);
    let Ok((rest, again)) = parse_class(&first[..]) else { panic!("an encoded method does not parse: {m:?}") };
    assert!(rest.is_empty(), "an encoded method left {} bytes", rest.len());
    assert_eq!(encode(&again), first, "a method re-encoded differently");
}

/// The content header decoder: `class:u16 weight:u16 body_size:u64` then the property
/// flags and fields, which the broker stores raw and decodes for what it needs.
pub fn content_header(data: &[u8]) {
    use amq_protocol::frame::parsing::parse_content_header;
    let Ok((_, header)) = parse_content_header(data) else { return };
    let raw = &data[12.min(data.len())..];
    let Some(props) = decode_properties(raw) else { return };
    if props.headers().as_ref().is_some_and(|h| !table_depth_ok(h)) {
        return;
    }
    let _ = header.properties.expiration().as_ref().map(|e| crate::broker::message::parse_expiration(e.as_str()));
    let first = encode_properties(&props);
    let again = decode_properties(&first).expect("encoded properties do not decode");
    assert_eq!(encode_properties(&again), first, "properties re-encoded differently");
    let m = Message::new("amq.topic", "a.b", raw, bytes::Bytes::new(), false);
    assert_eq!(m.parts(), ("amq.topic", "a.b", raw));
    let _ = split_header(raw);
}

/// The field-table parser, and what reads a table as queue, consumer or binding arguments.
pub fn field_table(data: &[u8]) {
    let Ok((_, t)) = parse_field_table(data) else { return };
    if !table_depth_ok(&t) {
        return;
    }
    let wire = field_table_to_wire(&t);
    let back = field_table_from_wire(&wire).expect("an encoded table does not parse");
    assert_eq!(field_table_to_wire(&back), wire, "a table re-encoded differently");
    let framed = gen_field_table(&t)(Vec::new().into()).expect("table").write;
    assert_eq!(framed, wire);
    // The snapshot form: a queue definition through JSON.
    let def = QueueDef {
        vhost: "/".into(),
        name: "q".into(),
        durable: true,
        auto_delete: false,
        exclusive_owner: None,
        arguments: t.clone(),
        owner_node: 1,
        owner_core: 0,
        owner_epoch: 1,
        replicas: Vec::new(),
        incarnation: 1,
    };
    let json = serde_json::to_vec(&def).expect("a queue definition serializes");
    let def2: QueueDef = serde_json::from_slice(&json).expect("a serialized queue definition reads back");
    assert_eq!(field_table_to_wire(&def2.arguments), wire);
    let _ = topology::validate_queue_arguments(&def);
    let _ = queue::limits::Limits::from_arguments(&t, false);
    let _ = queue::delivery_limit::DeliveryLimit::from_arguments(&t, true);
    let _ = queue::priority::max_priority(&t);
    let _ = router::int_arg(&t, "x-message-ttl");
    let _ = exchange::headers::matches(&t, Some(&t));
    let _ = queue::settle::is_cycle(&t, "q");
}

/// The metadata Raft entry decoder (what a node reads back from its Raft log or a peer).
pub fn raft_entry(data: &[u8]) {
    let Ok(cmds) = decode_batch(data) else { return };
    let mut out = Vec::new();
    encode_batch(cmds.len(), cmds.iter(), &mut out);
    let again = decode_batch(&out).expect("an encoded batch does not decode");
    let mut out2 = Vec::new();
    encode_batch(again.len(), again.iter(), &mut out2);
    assert_eq!(out, out2, "a batch re-encoded differently");
}

/// The topic matcher against a plain recursive one. The input is `pattern \n routing key`,
/// each cut to 64 bytes (the reference is exponential in the number of `#`).
pub fn topic(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (pattern, key) = text.split_once('\n').unwrap_or((&text, ""));
    let cut = |s: &str| s.chars().take(64).collect::<String>();
    let (pattern, key) = (cut(pattern), cut(key));
    let p: Vec<&str> = pattern.split('.').collect();
    let k: Vec<&str> = if key.is_empty() { vec![""] } else { key.split('.').collect() };
    let fast = exchange::topic::matches(&pattern, &key);
    let mut memo = std::collections::HashMap::new();
    assert_eq!(fast, reference(&p, &k, &mut memo), "topic {pattern:?} against {key:?}");
}

fn reference<'a>(p: &[&'a str], k: &[&'a str], memo: &mut std::collections::HashMap<(usize, usize), bool>) -> bool {
    if let Some(&v) = memo.get(&(p.len(), k.len())) {
        return v;
    }
    let v = match (p.first(), k.first()) {
        (None, None) => true,
        (None, Some(_)) => false,
        (Some(&"#"), _) => reference(&p[1..], k, memo) || (!k.is_empty() && reference(p, &k[1..], memo)),
        (Some(_), None) => false,
        (Some(&w), Some(&x)) => (w == "*" || w == x) && reference(&p[1..], &k[1..], memo),
    };
    memo.insert((p.len(), k.len()), v);
    v
}
