//! The frames nodes exchange to serve each other's queues (`remote/mod.rs`): what a client's
//! node (A) sends the queue's node (B), and what B sends back. Carried as the payload of the
//! cluster transport's data lane, one frame per payload.
//!
//! Node A names its own connections (`conn`) and requests (`req`); B never interprets them,
//! it only sends them back. Offsets, channel numbers and channel incarnations (`chan_uid`) are
//! those of `broker` ([`crate::broker::Holder`]).
//!
//! # Binary form ([`encode`], [`decode`], [`decode_bytes`])
//! A version byte ([`VERSION`]), then the [`Frame`]: a tag byte per enum (its variants
//! numbered from 0 in declaration order), each followed by the variant's fields, and the fields
//! of structs and tuples, in declaration order:
//! - `u16`, `u32`, `u64`: LEB128 varints (`crate::meta::wire`); a `u16`/`u32` must fit;
//! - `bool`: one byte, 0 or 1 (another value is an unknown tag);
//! - strings and byte blobs: varint length + bytes (strings UTF-8);
//! - [`QueueKey`]: vhost string + name string;
//! - [`Message`]: header blob, body blob, flags byte;
//! - offset lists (`Vec<u64>`): varint count, then each offset's difference from the previous
//!   one (the first from 0), wrapping, zigzag-mapped to a varint: ascending offsets cost a
//!   byte or two each, and any order round-trips;
//! - [`QueueError`]: tag (`NotFound` 0, `AccessRefused` 1, `PreconditionFailed` 2,
//!   `ResourceError` 3, `InternalError` 4) + string;
//! - `Option<T>`: 0, or 1 + `T`; `Result<T, QueueError>`: 0 + `T`, or 1 + error.
//!
//! The frame must fill its payload exactly. Decoding checks every length and count against the
//! bytes that remain before allocating anything, so a hostile peer cannot make it allocate more
//! than its input's size warrants, and it never panics.

use bytes::Bytes;

use crate::broker::message::Message;
use crate::broker::{QueueError, QueueKey};
use crate::meta::wire::{put_str, put_varint};

/// Where B answers a publish's confirm: A's connection and channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConfirm {
    /// A's connection id.
    pub conn: u64,
    /// Publishing channel.
    pub channel: u16,
    /// Its incarnation.
    pub chan_uid: u64,
    /// Publish sequence number (the confirm's delivery tag on A).
    pub seq: u64,
}

/// Who holds what B delivers: a channel on A.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteHolder {
    /// A's connection id.
    pub conn: u64,
    /// Channel.
    pub channel: u16,
    /// Its incarnation.
    pub chan_uid: u64,
}

/// A consumer on A of a queue on B ([`crate::broker::ConsumerSpec`] without its channels).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConsumer {
    /// A's consumer id (unique within A's run).
    pub id: u64,
    /// Where it lives on A.
    pub holder: RemoteHolder,
    /// Consumer tag.
    pub tag: String,
    /// Automatic acknowledgement.
    pub no_ack: bool,
    /// Exclusive consumer.
    pub exclusive: bool,
    /// basic.qos prefetch_count of the consumer (0 = unlimited).
    pub prefetch: u32,
    /// basic.qos global prefetch of its channel (0 = unlimited).
    pub channel_prefetch: u32,
    /// The client wants basic.cancel when the queue goes away.
    pub cancel_notify: bool,
    /// Send consume-ok (false for nowait).
    pub send_consume_ok: bool,
    /// Consumer priority (`x-priority`).
    pub priority: i32,
}

/// A → B: an operation on one of B's queues, or the end of one of A's connections.
#[derive(Clone, Debug)]
// Equality for the tests only: `Message` has none outside them (`wire_tests.rs`).
#[cfg_attr(test, derive(PartialEq))]
pub enum Request {
    /// basic.publish routed (on A) to `queue`.
    Publish {
        /// Target queue.
        queue: QueueKey,
        /// The message.
        message: Message,
        /// Confirm-mode publisher.
        confirm: Option<RemoteConfirm>,
        /// A's connection whose publish credit this publish holds (`broker::credit`), 0 for
        /// none (the broker's own publishes): B answers [`Event::Taken`] for it once the
        /// queue has taken the message.
        credit: u64,
    },
    /// basic.get.
    Get {
        /// A's request id.
        req: u64,
        /// Queue.
        queue: QueueKey,
        /// Auto-ack.
        no_ack: bool,
        /// Who gets it.
        holder: RemoteHolder,
    },
    /// basic.consume.
    Consume {
        /// A's request id.
        req: u64,
        /// Queue.
        queue: QueueKey,
        /// The consumer.
        consumer: RemoteConsumer,
    },
    /// basic.cancel.
    Cancel {
        /// Queue.
        queue: QueueKey,
        /// A's consumer id.
        consumer: u64,
        /// Send cancel-ok.
        send_ok: bool,
        /// A's connection of the consumer, its channel and its tag: where the cancel-ok goes,
        /// sent whether or not B's queue still holds the consumer.
        conn: u64,
        /// The consumer's channel.
        channel: u16,
        /// The consumer's tag.
        consumer_tag: String,
    },
    /// basic.ack / nack / reject by offset.
    Settle {
        /// Queue.
        queue: QueueKey,
        /// Settling channel's incarnation.
        chan_uid: u64,
        /// Acknowledged offsets.
        ack: Vec<u64>,
        /// Requeued offsets.
        requeue: Vec<u64>,
        /// Rejected offsets (dead-letter or drop).
        reject: Vec<u64>,
    },
    /// A channel on A closed: requeue what it holds in `queue`.
    ChannelClosed {
        /// Queue.
        queue: QueueKey,
        /// The channel's incarnation.
        chan_uid: u64,
    },
    /// basic.recover(requeue=false).
    Redeliver {
        /// Queue.
        queue: QueueKey,
        /// Offsets held by the channel.
        offsets: Vec<u64>,
    },
    /// queue.declare-ok counts.
    Stats {
        /// A's request id.
        req: u64,
        /// Queue.
        queue: QueueKey,
    },
    /// queue.purge.
    Purge {
        /// A's request id.
        req: u64,
        /// Queue.
        queue: QueueKey,
    },
    /// queue.delete.
    Delete {
        /// A's request id.
        req: u64,
        /// Queue.
        queue: QueueKey,
        /// Only if unused.
        if_unused: bool,
        /// Only if empty.
        if_empty: bool,
    },
    /// A's connection `conn` ended: B forgets it (its channels were closed before).
    ConnectionClosed {
        /// A's connection id.
        conn: u64,
    },
}

/// B → A: an event for one of A's connections.
#[derive(Clone, Debug)]
#[cfg_attr(test, derive(PartialEq))]
pub enum Event {
    /// basic.deliver.
    Deliver {
        /// Channel.
        channel: u16,
        /// Its incarnation.
        chan_uid: u64,
        /// Consumer tag.
        consumer_tag: String,
        /// Source queue.
        queue: QueueKey,
        /// The queue is durable.
        durable: bool,
        /// Its owner core on B.
        owner_core: u32,
        /// Offset in the queue.
        offset: u64,
        /// Delivered before.
        redelivered: bool,
        /// The message.
        message: Message,
        /// Manual ack: A tracks the delivery tag.
        track: bool,
    },
    /// basic.consume-ok.
    ConsumeOk {
        /// Channel.
        channel: u16,
        /// Consumer tag.
        consumer_tag: String,
    },
    /// basic.cancel-ok.
    CancelOk {
        /// Channel.
        channel: u16,
        /// Consumer tag.
        consumer_tag: String,
    },
    /// The queue cancelled the consumer (deleted).
    Cancelled {
        /// Channel.
        channel: u16,
        /// Consumer tag.
        consumer_tag: String,
    },
    /// A publish was stored (or not: `ok == false`).
    Stored {
        /// Channel.
        channel: u16,
        /// Its incarnation.
        chan_uid: u64,
        /// Publish sequence number.
        seq: u64,
        /// Stored.
        ok: bool,
    },
    /// A delivery on the channel passed its acknowledgement timeout.
    AckTimeout {
        /// Channel.
        channel: u16,
        /// Its incarnation.
        chan_uid: u64,
        /// The timeout, ms.
        timeout_ms: u64,
    },
    /// B's queues took `count` more of the connection's publishes that hold credit (stored,
    /// proposed or refused them): A gives that credit back (`broker::credit`).
    Taken {
        /// Publishes taken, since the last `Taken` for the connection.
        count: u32,
    },
}

/// A basic.get answer's message.
#[derive(Clone, Debug)]
#[cfg_attr(test, derive(PartialEq))]
pub struct GotMessage {
    /// Offset in the queue.
    pub offset: u64,
    /// Delivered before.
    pub redelivered: bool,
    /// The message.
    pub message: Message,
    /// Messages still ready.
    pub message_count: u32,
}

/// B → A: the answer to request `req`.
#[derive(Clone, Debug)]
#[cfg_attr(test, derive(PartialEq))]
pub enum Reply {
    /// To `Get`: a message, get-empty (`None`), or a refusal.
    Get(Result<Option<GotMessage>, QueueError>),
    /// To `Consume`.
    Consume(Result<(), QueueError>),
    /// To `Stats`: (message_count, consumer_count).
    Stats(Result<(u32, u32), QueueError>),
    /// To `Purge` and `Delete`: messages removed.
    Count(Result<u32, QueueError>),
}

/// One data-lane frame.
#[derive(Clone, Debug)]
#[cfg_attr(test, derive(PartialEq))]
pub enum Frame {
    /// A → B.
    Request(Request),
    /// B → A: an event for A's connection `conn`.
    Event {
        /// A's connection id.
        conn: u64,
        /// The event.
        event: Event,
    },
    /// B → A: the answer to A's request `req`.
    Reply {
        /// A's request id.
        req: u64,
        /// The answer.
        reply: Reply,
    },
}

/// The format's version, the first byte of every frame.
pub const VERSION: u8 = 3;

/// A payload that is not a frame [`encode`] wrote. `at` is the byte offset in the payload
/// where decoding failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// The payload ends inside a field.
    #[error("frame truncated at byte {at}")]
    Truncated {
        /// Where the missing bytes were due.
        at: usize,
    },
    /// The first byte is not [`VERSION`].
    #[error("unsupported frame version {0}")]
    Version(u8),
    /// A tag byte names no variant of `what`.
    #[error("unknown {what} tag {tag} at byte {at}")]
    UnknownTag {
        /// Offset of the tag byte.
        at: usize,
        /// What the tag selects ("request", "option", "bool", …).
        what: &'static str,
        /// The tag.
        tag: u8,
    },
    /// A varint is longer than 10 bytes or exceeds `u64`.
    #[error("bad varint at byte {at}")]
    BadVarint {
        /// Offset of the varint.
        at: usize,
    },
    /// A `u16` or `u32` field holds a larger value.
    #[error("integer {value} at byte {at} out of range")]
    OutOfRange {
        /// Offset of the varint.
        at: usize,
        /// The value.
        value: u64,
    },
    /// A string is not UTF-8.
    #[error("string at byte {at} is not UTF-8")]
    BadUtf8 {
        /// Offset of the string's first byte.
        at: usize,
    },
    /// A length or element count exceeds the bytes that remain.
    #[error("length {len} at byte {at} exceeds the {remaining} bytes left")]
    LengthBeyondInput {
        /// Offset of the length's varint.
        at: usize,
        /// The length (or count) announced.
        len: u64,
        /// Bytes after the varint.
        remaining: usize,
    },
    /// Bytes follow the frame's end.
    #[error("{extra} trailing bytes after the frame's end at byte {at}")]
    TrailingBytes {
        /// Where the frame ended.
        at: usize,
        /// How many bytes follow.
        extra: usize,
    },
}

/// Appends `frame`'s binary form (the module doc) to `out`.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) {
    out.push(VERSION);
    frame.put(out);
}

/// Parses one frame, the whole of `bytes`; messages' header and body are copied out of it.
///
/// # Errors
/// [`WireError`]: a truncated payload, an unknown version or tag (a boolean other than 0 or 1
/// included), a bad varint, an out-of-range `u16`/`u32`, a string that is not UTF-8, a length
/// or count beyond the input, trailing bytes.
pub fn decode(bytes: &[u8]) -> Result<Frame, WireError> {
    Reader { buf: bytes, pos: 0, src: None }.frame()
}

/// [`decode`] for a payload held in [`Bytes`]: messages' header and body are slices of
/// `bytes` (no copy).
///
/// # Errors
/// As [`decode`].
pub fn decode_bytes(bytes: &Bytes) -> Result<Frame, WireError> {
    Reader { buf: bytes, pos: 0, src: Some(bytes) }.frame()
}

/// Bounds-checked cursor over a payload. `src`, when set, holds `buf` itself: blobs are
/// then slices of it rather than copies.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    src: Option<&'a Bytes>,
}

impl<'a> Reader<'a> {
    fn frame(mut self) -> Result<Frame, WireError> {
        let version = self.u8()?;
        if version != VERSION {
            return Err(WireError::Version(version));
        }
        let frame = self.get()?;
        match self.buf.len() - self.pos {
            0 => Ok(frame),
            extra => Err(WireError::TrailingBytes { at: self.pos, extra }),
        }
    }

    fn get<T: Field>(&mut self) -> Result<T, WireError> {
        T::get(self)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        let b = *self.buf.get(self.pos).ok_or(WireError::Truncated { at: self.pos })?;
        self.pos += 1;
        Ok(b)
    }

    /// A tag byte in `0..=max` for an enum named `what`.
    fn tag(&mut self, what: &'static str, max: u8) -> Result<u8, WireError> {
        let at = self.pos;
        match self.u8()? {
            tag if tag > max => Err(WireError::UnknownTag { at, what, tag }),
            tag => Ok(tag),
        }
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let at = self.pos;
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.u8()?;
            // The 10th byte holds bit 63 only.
            if i == 9 && b > 1 {
                break;
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(WireError::BadVarint { at })
    }

    /// A length or count, at most the bytes that remain after it (every element takes at
    /// least one byte), so callers may allocate for it.
    fn len(&mut self) -> Result<usize, WireError> {
        let at = self.pos;
        let len = self.varint()?;
        let remaining = self.buf.len() - self.pos;
        match usize::try_from(len) {
            Ok(n) if n <= remaining => Ok(n),
            _ => Err(WireError::LengthBeyondInput { at, len, remaining }),
        }
    }

    /// A length-prefixed run of bytes, as (its offset, the bytes).
    fn raw(&mut self) -> Result<(usize, &'a [u8]), WireError> {
        let n = self.len()?;
        let start = self.pos;
        self.pos += n;
        Ok((start, &self.buf[start..self.pos]))
    }

    fn str(&mut self) -> Result<&'a str, WireError> {
        let (at, b) = self.raw()?;
        std::str::from_utf8(b).map_err(|_| WireError::BadUtf8 { at })
    }

    fn blob(&mut self) -> Result<Bytes, WireError> {
        let (start, b) = self.raw()?;
        Ok(self.src.map_or_else(|| Bytes::copy_from_slice(b), |src| src.slice(start..self.pos)))
    }
}

/// A type's binary form (the module doc): `put` writes it, `get` reads it back.
trait Field: Sized {
    fn put(&self, out: &mut Vec<u8>);
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError>;
}

/// Writes each field, after the tag byte `$tag` if given: `put!(out, 1; a, b)`.
macro_rules! put {
    ($out:ident; $($field:expr),*) => {{
        $($field.put($out);)*
    }};
    ($out:ident, $tag:expr; $($field:expr),*) => {{
        $out.push($tag);
        $($field.put($out);)*
    }};
}

impl Field for RemoteConfirm {
    fn put(&self, out: &mut Vec<u8>) {
        put!(out; self.conn, self.channel, self.chan_uid, self.seq);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(RemoteConfirm { conn: r.get()?, channel: r.get()?, chan_uid: r.get()?, seq: r.get()? })
    }
}

impl Field for RemoteHolder {
    fn put(&self, out: &mut Vec<u8>) {
        put!(out; self.conn, self.channel, self.chan_uid);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(RemoteHolder { conn: r.get()?, channel: r.get()?, chan_uid: r.get()? })
    }
}

impl Field for RemoteConsumer {
    fn put(&self, out: &mut Vec<u8>) {
        let c = self;
        put!(out; c.id, c.holder, c.tag, c.no_ack, c.exclusive, c.prefetch, c.channel_prefetch, c.cancel_notify, c.send_consume_ok, c.priority);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(RemoteConsumer {
            id: r.get()?,
            holder: r.get()?,
            tag: r.get()?,
            no_ack: r.get()?,
            exclusive: r.get()?,
            prefetch: r.get()?,
            channel_prefetch: r.get()?,
            cancel_notify: r.get()?,
            send_consume_ok: r.get()?,
            priority: r.get()?,
        })
    }
}

impl Field for GotMessage {
    fn put(&self, out: &mut Vec<u8>) {
        put!(out; self.offset, self.redelivered, self.message, self.message_count);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(GotMessage { offset: r.get()?, redelivered: r.get()?, message: r.get()?, message_count: r.get()? })
    }
}

impl Field for Request {
    fn put(&self, out: &mut Vec<u8>) {
        match self {
            Request::Publish { queue, message, confirm, credit } => put!(out, 0; queue, message, confirm, credit),
            Request::Get { req, queue, no_ack, holder } => put!(out, 1; req, queue, no_ack, holder),
            Request::Consume { req, queue, consumer } => put!(out, 2; req, queue, consumer),
            Request::Cancel { queue, consumer, send_ok, conn, channel, consumer_tag } => {
                put!(out, 3; queue, consumer, send_ok, conn, channel, consumer_tag)
            }
            Request::Settle { queue, chan_uid, ack, requeue, reject } => put!(out, 4; queue, chan_uid, ack, requeue, reject),
            Request::ChannelClosed { queue, chan_uid } => put!(out, 5; queue, chan_uid),
            Request::Redeliver { queue, offsets } => put!(out, 6; queue, offsets),
            Request::Stats { req, queue } => put!(out, 7; req, queue),
            Request::Purge { req, queue } => put!(out, 8; req, queue),
            Request::Delete { req, queue, if_unused, if_empty } => put!(out, 9; req, queue, if_unused, if_empty),
            Request::ConnectionClosed { conn } => put!(out, 10; conn),
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(match r.tag("request", 10)? {
            0 => Request::Publish { queue: r.get()?, message: r.get()?, confirm: r.get()?, credit: r.get()? },
            1 => Request::Get { req: r.get()?, queue: r.get()?, no_ack: r.get()?, holder: r.get()? },
            2 => Request::Consume { req: r.get()?, queue: r.get()?, consumer: r.get()? },
            3 => Request::Cancel {
                queue: r.get()?,
                consumer: r.get()?,
                send_ok: r.get()?,
                conn: r.get()?,
                channel: r.get()?,
                consumer_tag: r.get()?,
            },
            4 => Request::Settle { queue: r.get()?, chan_uid: r.get()?, ack: r.get()?, requeue: r.get()?, reject: r.get()? },
            5 => Request::ChannelClosed { queue: r.get()?, chan_uid: r.get()? },
            6 => Request::Redeliver { queue: r.get()?, offsets: r.get()? },
            7 => Request::Stats { req: r.get()?, queue: r.get()? },
            8 => Request::Purge { req: r.get()?, queue: r.get()? },
            9 => Request::Delete { req: r.get()?, queue: r.get()?, if_unused: r.get()?, if_empty: r.get()? },
            _ => Request::ConnectionClosed { conn: r.get()? },
        })
    }
}

impl Field for Event {
    fn put(&self, out: &mut Vec<u8>) {
        match self {
            Event::Deliver { channel, chan_uid, consumer_tag, queue, durable, owner_core, offset, redelivered, message, track } => {
                put!(out, 0; channel, chan_uid, consumer_tag, queue, durable, owner_core, offset, redelivered, message, track)
            }
            Event::ConsumeOk { channel, consumer_tag } => put!(out, 1; channel, consumer_tag),
            Event::CancelOk { channel, consumer_tag } => put!(out, 2; channel, consumer_tag),
            Event::Cancelled { channel, consumer_tag } => put!(out, 3; channel, consumer_tag),
            Event::Stored { channel, chan_uid, seq, ok } => put!(out, 4; channel, chan_uid, seq, ok),
            Event::AckTimeout { channel, chan_uid, timeout_ms } => put!(out, 5; channel, chan_uid, timeout_ms),
            Event::Taken { count } => put!(out, 6; count),
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(match r.tag("event", 6)? {
            0 => Event::Deliver {
                channel: r.get()?,
                chan_uid: r.get()?,
                consumer_tag: r.get()?,
                queue: r.get()?,
                durable: r.get()?,
                owner_core: r.get()?,
                offset: r.get()?,
                redelivered: r.get()?,
                message: r.get()?,
                track: r.get()?,
            },
            1 => Event::ConsumeOk { channel: r.get()?, consumer_tag: r.get()? },
            2 => Event::CancelOk { channel: r.get()?, consumer_tag: r.get()? },
            3 => Event::Cancelled { channel: r.get()?, consumer_tag: r.get()? },
            4 => Event::Stored { channel: r.get()?, chan_uid: r.get()?, seq: r.get()?, ok: r.get()? },
            5 => Event::AckTimeout { channel: r.get()?, chan_uid: r.get()?, timeout_ms: r.get()? },
            _ => Event::Taken { count: r.get()? },
        })
    }
}

impl Field for Reply {
    fn put(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Get(v) => put!(out, 0; v),
            Reply::Consume(v) => put!(out, 1; v),
            Reply::Stats(v) => put!(out, 2; v),
            Reply::Count(v) => put!(out, 3; v),
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(match r.tag("reply", 3)? {
            0 => Reply::Get(r.get()?),
            1 => Reply::Consume(r.get()?),
            2 => Reply::Stats(r.get()?),
            _ => Reply::Count(r.get()?),
        })
    }
}

impl Field for Frame {
    fn put(&self, out: &mut Vec<u8>) {
        match self {
            Frame::Request(request) => put!(out, 0; request),
            Frame::Event { conn, event } => put!(out, 1; conn, event),
            Frame::Reply { req, reply } => put!(out, 2; req, reply),
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(match r.tag("frame", 2)? {
            0 => Frame::Request(r.get()?),
            1 => Frame::Event { conn: r.get()?, event: r.get()? },
            _ => Frame::Reply { req: r.get()?, reply: r.get()? },
        })
    }
}

// The forms of the plain types (integers, strings, keys, messages, tuples, options, results).
#[path = "wire_fields.rs"]
mod fields;

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
