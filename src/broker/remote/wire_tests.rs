//! Tests of the data-lane frame codec (`wire.rs`): every frame round-trips through both
//! decoders, every truncation and every trailing byte is an error, arbitrary or corrupted
//! payloads never panic, and announced lengths beyond the input fail before allocating.

use bytes::Bytes;
use proptest::prelude::*;

use super::*;

/// Message has no equality outside the tests: compare its fields.
impl PartialEq for Message {
    fn eq(&self, other: &Message) -> bool {
        self.header == other.header && self.body == other.body && self.flags == other.flags
    }
}

fn enc(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::new();
    encode(frame, &mut out);
    out
}

/// Small values most of the time (one-byte varints), the full range otherwise.
fn int() -> impl Strategy<Value = u64> {
    prop_oneof![3 => 0u64..300, 1 => any::<u64>()]
}

/// Any text, non-ASCII included.
fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(any::<char>(), 0..8).prop_map(String::from_iter)
}

fn blob() -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..40).prop_map(Bytes::from)
}

fn key() -> impl Strategy<Value = QueueKey> {
    (text(), text()).prop_map(|(v, n)| QueueKey::new(&v, &n))
}

fn message() -> impl Strategy<Value = Message> {
    (blob(), blob(), any::<u8>()).prop_map(|(header, body, flags)| Message { header, body, flags })
}

/// Offset lists: ascending runs (the usual case) or arbitrary values in any order.
fn offsets() -> impl Strategy<Value = Vec<u64>> {
    prop_oneof![
        (int(), prop::collection::vec(0u64..5, 0..10)).prop_map(|(start, gaps)| gaps
            .iter()
            .scan(start, |at, g| {
                *at = at.wrapping_add(*g);
                Some(*at)
            })
            .collect()),
        prop::collection::vec(int(), 0..10),
    ]
}

fn holder() -> impl Strategy<Value = RemoteHolder> {
    (int(), any::<u16>(), int()).prop_map(|(conn, channel, chan_uid)| RemoteHolder { conn, channel, chan_uid })
}

fn queue_error() -> impl Strategy<Value = QueueError> {
    (0..5u8, text()).prop_map(|(t, s)| match t {
        0 => QueueError::NotFound(s),
        1 => QueueError::AccessRefused(s),
        2 => QueueError::PreconditionFailed(s),
        3 => QueueError::ResourceError(s),
        _ => QueueError::InternalError(s),
    })
}

fn result<T: std::fmt::Debug>(ok: impl Strategy<Value = T>) -> impl Strategy<Value = Result<T, QueueError>> {
    prop_oneof![ok.prop_map(Ok), queue_error().prop_map(Err)]
}

fn request() -> impl Strategy<Value = Request> {
    let confirm =
        (int(), any::<u16>(), int(), int()).prop_map(|(conn, channel, chan_uid, seq)| RemoteConfirm { conn, channel, chan_uid, seq });
    let consumer = (int(), holder(), text(), any::<[bool; 4]>(), any::<u32>(), any::<u32>(), any::<i32>()).prop_map(
        |(id, holder, tag, [no_ack, exclusive, cancel_notify, send_consume_ok], prefetch, channel_prefetch, priority)| RemoteConsumer {
            id,
            holder,
            tag,
            no_ack,
            exclusive,
            prefetch,
            channel_prefetch,
            cancel_notify,
            send_consume_ok,
            priority,
        },
    );
    prop_oneof![
        (key(), message(), proptest::option::of(confirm), int()).prop_map(|(queue, message, confirm, credit)| Request::Publish {
            queue,
            message,
            confirm,
            credit
        }),
        (int(), key(), any::<bool>(), holder()).prop_map(|(req, queue, no_ack, holder)| Request::Get { req, queue, no_ack, holder }),
        (int(), key(), consumer).prop_map(|(req, queue, consumer)| Request::Consume { req, queue, consumer }),
        (key(), int(), any::<bool>(), int(), any::<u16>(), text()).prop_map(|(queue, consumer, send_ok, conn, channel, consumer_tag)| {
            Request::Cancel { queue, consumer, send_ok, conn, channel, consumer_tag }
        }),
        (key(), int(), offsets(), offsets(), offsets()).prop_map(|(queue, chan_uid, ack, requeue, reject)| Request::Settle {
            queue,
            chan_uid,
            ack,
            requeue,
            reject
        }),
        (key(), int()).prop_map(|(queue, chan_uid)| Request::ChannelClosed { queue, chan_uid }),
        (key(), offsets()).prop_map(|(queue, offsets)| Request::Redeliver { queue, offsets }),
        (int(), key()).prop_map(|(req, queue)| Request::Stats { req, queue }),
        (int(), key()).prop_map(|(req, queue)| Request::Purge { req, queue }),
        (int(), key(), any::<bool>(), any::<bool>()).prop_map(|(req, queue, if_unused, if_empty)| Request::Delete {
            req,
            queue,
            if_unused,
            if_empty
        }),
        int().prop_map(|conn| Request::ConnectionClosed { conn }),
    ]
}

fn event() -> impl Strategy<Value = Event> {
    let deliver = (any::<u16>(), int(), text(), key(), any::<[bool; 3]>(), any::<u32>(), int(), message()).prop_map(
        |(channel, chan_uid, consumer_tag, queue, [durable, redelivered, track], owner_core, offset, message)| Event::Deliver {
            channel,
            chan_uid,
            consumer_tag,
            queue,
            durable,
            owner_core,
            offset,
            redelivered,
            message,
            track,
        },
    );
    prop_oneof![
        deliver,
        (any::<u16>(), text()).prop_map(|(channel, consumer_tag)| Event::ConsumeOk { channel, consumer_tag }),
        (any::<u16>(), text()).prop_map(|(channel, consumer_tag)| Event::CancelOk { channel, consumer_tag }),
        (any::<u16>(), text()).prop_map(|(channel, consumer_tag)| Event::Cancelled { channel, consumer_tag }),
        (any::<u16>(), int(), int(), any::<bool>()).prop_map(|(channel, chan_uid, seq, ok)| Event::Stored { channel, chan_uid, seq, ok }),
        (any::<u16>(), int(), int()).prop_map(|(channel, chan_uid, timeout_ms)| Event::AckTimeout { channel, chan_uid, timeout_ms }),
        any::<u32>().prop_map(|count| Event::Taken { count }),
    ]
}

fn reply() -> impl Strategy<Value = Reply> {
    let got = (int(), any::<bool>(), message(), any::<u32>()).prop_map(|(offset, redelivered, message, message_count)| GotMessage {
        offset,
        redelivered,
        message,
        message_count,
    });
    prop_oneof![
        result(proptest::option::of(got)).prop_map(Reply::Get),
        result(Just(())).prop_map(Reply::Consume),
        result(any::<(u32, u32)>()).prop_map(Reply::Stats),
        result(any::<u32>()).prop_map(Reply::Count),
    ]
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        request().prop_map(Frame::Request),
        (int(), event()).prop_map(|(conn, event)| Frame::Event { conn, event }),
        (int(), reply()).prop_map(|(req, reply)| Frame::Reply { req, reply }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_frame_round_trips(f in frame()) {
        let bytes = enc(&f);
        prop_assert_eq!(bytes[0], VERSION);
        prop_assert_eq!(&decode(&bytes).unwrap(), &f);
        prop_assert_eq!(&decode_bytes(&Bytes::from(bytes.clone())).unwrap(), &f);
        // Appending to a non-empty buffer leaves what it held.
        let mut out = vec![7u8];
        encode(&f, &mut out);
        prop_assert_eq!(&out[1..], &bytes[..]);
    }

    #[test]
    fn every_truncation_is_an_error(f in frame()) {
        let bytes = enc(&f);
        for n in 0..bytes.len() {
            let e = decode(&bytes[..n]).unwrap_err();
            prop_assert!(matches!(e, WireError::Truncated { .. } | WireError::LengthBeyondInput { .. }), "{n}: {e:?}");
            prop_assert_eq!(decode_bytes(&Bytes::copy_from_slice(&bytes[..n])).unwrap_err(), e);
        }
    }

    #[test]
    fn trailing_bytes_are_an_error(f in frame(), extra in prop::collection::vec(any::<u8>(), 1..4)) {
        let mut bytes = enc(&f);
        let at = bytes.len();
        bytes.extend_from_slice(&extra);
        prop_assert_eq!(decode(&bytes).unwrap_err(), WireError::TrailingBytes { at, extra: extra.len() });
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64), tags in any::<[u8; 2]>()) {
        let _ = decode(&bytes);
        // And past the header, so the fields' decoders see the noise too.
        let mut framed = vec![VERSION, tags[0] % 3, tags[1] % 11];
        framed.extend_from_slice(&bytes);
        let _ = decode(&framed);
        let _ = decode_bytes(&Bytes::from(framed));
    }

    #[test]
    fn corrupted_frames_never_panic(f in frame(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut bytes = enc(&f);
        let i = at.index(bytes.len());
        bytes[i] = byte;
        if let Ok(g) = decode(&bytes) {
            // Whatever it decodes to encodes back to a frame that decodes the same.
            prop_assert_eq!(decode(&enc(&g)).unwrap(), g);
        }
    }
}

fn publish_prefix() -> Vec<u8> {
    // Version, request, publish, key ("/", "q"), an empty header.
    vec![VERSION, 0, 0, 1, b'/', 1, b'q', 0]
}

#[test]
fn a_huge_body_length_errors_before_allocating() {
    let mut bytes = publish_prefix();
    put_varint(&mut bytes, 1 << 60);
    bytes.extend_from_slice(b"abc");
    // Had the decoder trusted the length, allocating 2^60 bytes would abort the process.
    let want = WireError::LengthBeyondInput { at: 8, len: 1 << 60, remaining: 3 };
    assert_eq!(decode(&bytes).unwrap_err(), want);
    assert_eq!(decode_bytes(&Bytes::from(bytes)).unwrap_err(), want);
    // Beyond usize on 32-bit targets, and the largest varint.
    let mut bytes = publish_prefix();
    put_varint(&mut bytes, u64::MAX);
    assert!(matches!(decode(&bytes), Err(WireError::LengthBeyondInput { len: u64::MAX, .. })));
}

#[test]
fn a_huge_offset_count_errors_before_allocating() {
    // Version, request, settle, key ("", ""), chan_uid 0, then 2^60 acks.
    let mut bytes = vec![VERSION, 0, 4, 0, 0, 0];
    put_varint(&mut bytes, 1 << 60);
    bytes.extend_from_slice(&[0; 5]);
    assert_eq!(decode(&bytes).unwrap_err(), WireError::LengthBeyondInput { at: 6, len: 1 << 60, remaining: 5 });
}

#[test]
fn decode_bytes_slices_the_input() {
    let message = Message { header: Bytes::from_static(b"hdr"), body: Bytes::from(vec![9u8; 1000]), flags: 1 };
    let f = Frame::Request(Request::Publish { queue: QueueKey::new("/", "q"), message, confirm: None, credit: 0 });
    let input = Bytes::from(enc(&f));
    let range = input.as_ptr_range();
    let Frame::Request(Request::Publish { message: m, .. }) = decode_bytes(&input).unwrap() else { panic!("not a publish") };
    assert!(range.contains(&m.body.as_ptr()) && range.contains(&m.header.as_ptr()));
    assert_eq!(&m.body[..], &[9u8; 1000][..]);
}

#[test]
fn ascending_offsets_cost_a_byte_each() {
    let ack: Vec<u64> = (1_000_000_000_000..1_000_000_001_000).collect();
    let f = Frame::Request(Request::Settle { queue: QueueKey::new("/", "q"), chan_uid: 1, ack, requeue: vec![], reject: vec![] });
    let bytes = enc(&f);
    // Header, key, chan_uid, three counts and the first offset: ~20 bytes; then one per offset.
    assert!(bytes.len() < 1000 + 24, "{}", bytes.len());
    assert_eq!(decode(&bytes).unwrap(), f);
}

#[test]
fn malformed_fields_are_named() {
    assert_eq!(decode(&[]), Err(WireError::Truncated { at: 0 }));
    assert_eq!(decode(&[VERSION + 1, 0]), Err(WireError::Version(VERSION + 1)));
    assert_eq!(decode(&[VERSION, 3]), Err(WireError::UnknownTag { at: 1, what: "frame", tag: 3 }));
    assert_eq!(decode(&[VERSION, 0, 11]), Err(WireError::UnknownTag { at: 2, what: "request", tag: 11 }));
    assert_eq!(decode(&[VERSION, 1, 0, 7]), Err(WireError::UnknownTag { at: 3, what: "event", tag: 7 }));
    assert_eq!(decode(&[VERSION, 2, 0, 4]), Err(WireError::UnknownTag { at: 3, what: "reply", tag: 4 }));
    assert_eq!(decode(&[VERSION, 2, 0, 1, 2]), Err(WireError::UnknownTag { at: 4, what: "result", tag: 2 }));
    assert_eq!(decode(&[VERSION, 2, 0, 1, 1, 5, 0]), Err(WireError::UnknownTag { at: 5, what: "queue error", tag: 5 }));
    assert_eq!(decode(&[VERSION, 2, 0, 0, 0, 2]), Err(WireError::UnknownTag { at: 5, what: "option", tag: 2 }));
    // Cancel of ("", "") by consumer 0 with send_ok = 2.
    assert_eq!(decode(&[VERSION, 0, 3, 0, 0, 0, 2]), Err(WireError::UnknownTag { at: 6, what: "bool", tag: 2 }));
    // ConsumeOk on channel 65536.
    assert_eq!(decode(&[VERSION, 1, 0, 1, 0x80, 0x80, 4, 0]), Err(WireError::OutOfRange { at: 4, value: 65536 }));
    // Count of 2^32.
    let mut bytes = vec![VERSION, 2, 0, 3, 0];
    put_varint(&mut bytes, 1 << 32);
    assert_eq!(decode(&bytes), Err(WireError::OutOfRange { at: 5, value: 1 << 32 }));
    // ConsumeOk whose tag is not UTF-8.
    assert_eq!(decode(&[VERSION, 1, 0, 1, 1, 2, 0xc3, 0x28]), Err(WireError::BadUtf8 { at: 6 }));
    // ConnectionClosed with an 11-byte varint, and a 10-byte one above u64::MAX.
    let mut long = vec![VERSION, 0, 10];
    long.extend_from_slice(&[0x80; 10]);
    long.push(0);
    assert_eq!(decode(&long), Err(WireError::BadVarint { at: 3 }));
    let mut over = vec![VERSION, 0, 10];
    over.extend_from_slice(&[0xff; 9]);
    over.push(2);
    assert_eq!(decode(&over), Err(WireError::BadVarint { at: 3 }));
    let mut max = vec![VERSION, 0, 10];
    put_varint(&mut max, u64::MAX);
    assert_eq!(decode(&max), Ok(Frame::Request(Request::ConnectionClosed { conn: u64::MAX })));
}
