//! The wire format of the cluster transport: pure encoding and decoding, no sockets.
//!
//! # Frames
//! Every frame is a 5-byte header then `len` payload bytes:
//!
//! | bytes | field                                                        |
//! |-------|--------------------------------------------------------------|
//! | 0..4  | `len`: payload length in bytes, u32 big-endian, ≤ [`MAX_FRAME_BYTES`] |
//! | 4     | `kind`: [`Kind`] as a byte                                   |
//! | 5..   | payload                                                      |
//!
//! Payloads by kind (integers big-endian):
//! - `1` [`Kind::Hello`], exactly [`HELLO_LEN`] bytes: magic `RMQT` (4), version u16, lane u8
//!   (`0` raft, `1` snapshot, `2` data, `3` admin), from node id u64, to node id u64. The first
//!   frame each way on every connection.
//! - `2` [`Kind::Raft`]: one raft-rs `eraftpb::Message` in raft-rs's protobuf encoding.
//! - `3` [`Kind::SnapshotChunk`]: snapshot sequence u64, byte offset u64, total bytes u64, then
//!   the chunk's bytes. The chunks of one snapshot, in order, concatenate to the protobuf
//!   encoding of one `MsgSnapshot` message of `total` bytes (at most [`MAX_SNAPSHOT_BYTES`]).
//! - `4` [`Kind::SnapshotAck`]: snapshot sequence u64; the receiver's answer once it has
//!   reassembled and decoded that snapshot and handed it on.
//! - `5` [`Kind::Data`]: one opaque payload of the data lane, as the sender gave it (the
//!   transport never looks inside).
//! - `6` [`Kind::Admin`]: one opaque admin request (dialer to acceptor) or its answer (the
//!   other way), on an admin lane.
//!
//! # Invariants
//! 1. A decoder never allocates or reads more than [`MAX_FRAME_BYTES`] for one frame: the
//!    length is checked in [`Header::decode`] before any payload is read.
//! 2. Decoding is total: any byte string yields a frame, "need more bytes", or a
//!    [`FrameError`] — never a panic.

use protobuf::Message as _;
use raft::eraftpb::Message;

use super::NodeId;

/// Header length in bytes: payload length (4) + kind (1).
pub const HEADER_LEN: usize = 5;
/// Largest payload of one frame, in bytes (64 MiB). A larger length is a protocol error.
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// Largest encoded snapshot message, in bytes (1 GiB), summed over its chunks.
pub const MAX_SNAPSHOT_BYTES: u64 = 1 << 30;
/// The magic bytes opening a [`Hello`] payload.
pub const MAGIC: [u8; 4] = *b"RMQT";
/// The protocol version this code speaks; a peer with another one is refused.
pub const VERSION: u16 = 1;
/// Payload length of a [`Hello`] frame, in bytes.
pub const HELLO_LEN: usize = 4 + 2 + 1 + 8 + 8;
/// Bytes of a snapshot chunk's payload before its data: sequence, offset, total.
pub const CHUNK_HEADER_LEN: usize = 24;
/// Largest data part of one snapshot chunk, in bytes.
pub const MAX_CHUNK_DATA: usize = MAX_FRAME_BYTES - CHUNK_HEADER_LEN;

/// What a connection carries, fixed by its [`Hello`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Raft messages other than snapshots, one [`Kind::Raft`] frame each, one way.
    Raft,
    /// Snapshot chunks one way, [`Kind::SnapshotAck`] frames the other way.
    Snapshot,
    /// Opaque payloads, one [`Kind::Data`] frame each, one way.
    Data,
    /// One [`Kind::Admin`] request, one [`Kind::Admin`] answer, then the connection closes. The
    /// only lane a node that is no peer (yet) may open: one asking to join, or a tool.
    Admin,
}

impl Lane {
    fn to_byte(self) -> u8 {
        match self {
            Lane::Raft => 0,
            Lane::Snapshot => 1,
            Lane::Data => 2,
            Lane::Admin => 3,
        }
    }

    fn from_byte(b: u8) -> Result<Lane, FrameError> {
        Ok(match b {
            0 => Lane::Raft,
            1 => Lane::Snapshot,
            2 => Lane::Data,
            3 => Lane::Admin,
            other => return Err(FrameError::UnknownLane(other)),
        })
    }
}

/// The kind byte of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The handshake ([`Hello`]).
    Hello = 1,
    /// One raft message.
    Raft = 2,
    /// One chunk of a snapshot message ([`Chunk`]).
    SnapshotChunk = 3,
    /// The receipt of a reassembled snapshot.
    SnapshotAck = 4,
    /// One opaque data-lane payload.
    Data = 5,
    /// One opaque admin request or answer.
    Admin = 6,
}

impl Kind {
    fn from_byte(b: u8) -> Result<Kind, FrameError> {
        Ok(match b {
            1 => Kind::Hello,
            2 => Kind::Raft,
            3 => Kind::SnapshotChunk,
            4 => Kind::SnapshotAck,
            5 => Kind::Data,
            6 => Kind::Admin,
            other => return Err(FrameError::UnknownKind(other)),
        })
    }
}

/// The handshake payload: who speaks, to whom, on which lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version ([`VERSION`] when we send it).
    pub version: u16,
    /// The lane this connection carries.
    pub lane: Lane,
    /// The sending node.
    pub from: NodeId,
    /// The node the sender believes it is talking to.
    pub to: NodeId,
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The frame kind.
    pub kind: Kind,
    /// Payload length in bytes, ≤ [`MAX_FRAME_BYTES`].
    pub len: usize,
}

impl Header {
    /// Decodes a header.
    ///
    /// # Errors
    /// [`FrameError::TooLarge`] when the length exceeds [`MAX_FRAME_BYTES`],
    /// [`FrameError::UnknownKind`] for a kind byte outside 1..=6.
    pub fn decode(bytes: [u8; HEADER_LEN]) -> Result<Header, FrameError> {
        let len = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        if len > MAX_FRAME_BYTES {
            return Err(FrameError::TooLarge { len, max: MAX_FRAME_BYTES });
        }
        Ok(Header { kind: Kind::from_byte(bytes[4])?, len })
    }
}

/// One chunk of a snapshot message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk<'a> {
    /// The sender's sequence number of this snapshot (per connection, from 1).
    pub seq: u64,
    /// Byte offset of `data` in the encoded snapshot message.
    pub offset: u64,
    /// Length of the whole encoded snapshot message, in bytes.
    pub total: u64,
    /// The chunk's bytes.
    pub data: &'a [u8],
}

/// A decoded frame; chunk data borrows from the input.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame<'a> {
    /// The handshake.
    Hello(Hello),
    /// One raft message.
    Raft(Message),
    /// One snapshot chunk.
    SnapshotChunk(Chunk<'a>),
    /// Receipt of the snapshot with this sequence number.
    SnapshotAck {
        /// The acknowledged snapshot's sequence number.
        seq: u64,
    },
    /// One data-lane payload.
    Data(&'a [u8]),
    /// One admin request or answer.
    Admin(&'a [u8]),
}

/// A frame that cannot be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The payload length exceeds the bound (frame payload or whole snapshot), in bytes.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// The announced or encoded length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The kind byte is not one of [`Kind`].
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A fixed-size payload has the wrong length.
    #[error("{kind:?} payload of {len} bytes, expected {expected}")]
    BadLength {
        /// The frame kind.
        kind: Kind,
        /// The payload length received.
        len: usize,
        /// The length this kind requires.
        expected: usize,
    },
    /// A hello that does not start with [`MAGIC`].
    #[error("bad handshake magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A hello with a lane byte other than 0..=3.
    #[error("unknown lane {0}")]
    UnknownLane(u8),
    /// The raft message does not encode or parse (the protobuf error's text).
    #[error("raft message protobuf: {0}")]
    Protobuf(String),
}

/// Appends a [`Kind::Hello`] frame to `out`.
pub fn encode_hello(hello: &Hello, out: &mut Vec<u8>) {
    put_header(out, Kind::Hello, HELLO_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&hello.version.to_be_bytes());
    out.push(hello.lane.to_byte());
    out.extend_from_slice(&hello.from.to_be_bytes());
    out.extend_from_slice(&hello.to.to_be_bytes());
}

/// Appends a [`Kind::Raft`] frame carrying `msg` (raft-rs's protobuf encoding) to `out`.
///
/// # Errors
/// [`FrameError::TooLarge`] when the encoding exceeds [`MAX_FRAME_BYTES`];
/// [`FrameError::Protobuf`] when protobuf refuses it. On error `out` is left as it was.
pub fn encode_raft(msg: &Message, out: &mut Vec<u8>) -> Result<(), FrameError> {
    let len = msg.compute_size() as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len, max: MAX_FRAME_BYTES });
    }
    let start = out.len();
    put_header(out, Kind::Raft, len);
    if let Err(err) = msg.write_to_vec(out) {
        out.truncate(start);
        return Err(FrameError::Protobuf(err.to_string()));
    }
    debug_assert_eq!(out.len() - start - HEADER_LEN, len);
    Ok(())
}

/// Appends a [`Kind::SnapshotChunk`] frame to `out`.
///
/// # Errors
/// [`FrameError::TooLarge`] when `chunk.data` exceeds [`MAX_CHUNK_DATA`] bytes.
pub fn encode_chunk(chunk: &Chunk<'_>, out: &mut Vec<u8>) -> Result<(), FrameError> {
    if chunk.data.len() > MAX_CHUNK_DATA {
        return Err(FrameError::TooLarge { len: chunk.data.len(), max: MAX_CHUNK_DATA });
    }
    put_header(out, Kind::SnapshotChunk, CHUNK_HEADER_LEN + chunk.data.len());
    out.extend_from_slice(&chunk.seq.to_be_bytes());
    out.extend_from_slice(&chunk.offset.to_be_bytes());
    out.extend_from_slice(&chunk.total.to_be_bytes());
    out.extend_from_slice(chunk.data);
    Ok(())
}

/// Appends a [`Kind::SnapshotAck`] frame for snapshot `seq` to `out`.
pub fn encode_ack(seq: u64, out: &mut Vec<u8>) {
    put_header(out, Kind::SnapshotAck, 8);
    out.extend_from_slice(&seq.to_be_bytes());
}

/// Appends a [`Kind::Data`] frame carrying `payload` to `out`.
///
/// # Errors
/// [`FrameError::TooLarge`] when `payload` exceeds [`MAX_FRAME_BYTES`]; `out` is then left as
/// it was.
pub fn encode_data(payload: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    encode_opaque(Kind::Data, payload, out)
}

/// Appends a [`Kind::Admin`] frame carrying `payload` to `out`.
///
/// # Errors
/// [`FrameError::TooLarge`] when `payload` exceeds [`MAX_FRAME_BYTES`]; `out` is then left as
/// it was.
pub fn encode_admin(payload: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    encode_opaque(Kind::Admin, payload, out)
}

/// A frame of `kind` whose payload is `payload` as given.
fn encode_opaque(kind: Kind, payload: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    if payload.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len: payload.len(), max: MAX_FRAME_BYTES });
    }
    put_header(out, kind, payload.len());
    out.extend_from_slice(payload);
    Ok(())
}

/// Decodes the payload of a frame whose header was `kind` (the payload is exactly the frame's
/// `len` bytes).
///
/// # Errors
/// [`FrameError::BadLength`] for a fixed-size payload of the wrong length,
/// [`FrameError::BadMagic`] / [`FrameError::UnknownLane`] for a bad hello,
/// [`FrameError::Protobuf`] for a raft message that does not parse, and
/// [`FrameError::TooLarge`] for a chunk whose `total` exceeds [`MAX_SNAPSHOT_BYTES`].
pub fn decode_payload(kind: Kind, payload: &[u8]) -> Result<Frame<'_>, FrameError> {
    let exact = |expected: usize| {
        if payload.len() == expected {
            Ok(())
        } else {
            Err(FrameError::BadLength { kind, len: payload.len(), expected })
        }
    };
    match kind {
        Kind::Hello => {
            exact(HELLO_LEN)?;
            let magic = [payload[0], payload[1], payload[2], payload[3]];
            if magic != MAGIC {
                return Err(FrameError::BadMagic(magic));
            }
            let lane = Lane::from_byte(payload[6])?;
            Ok(Frame::Hello(Hello {
                version: u16::from_be_bytes([payload[4], payload[5]]),
                lane,
                from: be_u64(&payload[7..15]),
                to: be_u64(&payload[15..23]),
            }))
        }
        Kind::Raft => Message::parse_from_bytes(payload).map(Frame::Raft).map_err(|err| FrameError::Protobuf(err.to_string())),
        Kind::SnapshotChunk => {
            if payload.len() < CHUNK_HEADER_LEN {
                return Err(FrameError::BadLength { kind, len: payload.len(), expected: CHUNK_HEADER_LEN });
            }
            let total = be_u64(&payload[16..24]);
            if total > MAX_SNAPSHOT_BYTES {
                return Err(FrameError::TooLarge { len: usize::try_from(total).unwrap_or(usize::MAX), max: MAX_SNAPSHOT_BYTES as usize });
            }
            Ok(Frame::SnapshotChunk(Chunk {
                seq: be_u64(&payload[0..8]),
                offset: be_u64(&payload[8..16]),
                total,
                data: &payload[CHUNK_HEADER_LEN..],
            }))
        }
        Kind::SnapshotAck => {
            exact(8)?;
            Ok(Frame::SnapshotAck { seq: be_u64(payload) })
        }
        Kind::Data => Ok(Frame::Data(payload)),
        Kind::Admin => Ok(Frame::Admin(payload)),
    }
}

/// Decodes the first frame of `buf`: `Ok(None)` when `buf` holds only part of it (read more),
/// else the frame and the number of bytes it took.
///
/// # Errors
/// As [`Header::decode`] and [`decode_payload`]; a too-large length is reported from the
/// header alone, before the payload arrives.
pub fn decode(buf: &[u8]) -> Result<Option<(Frame<'_>, usize)>, FrameError> {
    let Some(head) = buf.get(..HEADER_LEN) else { return Ok(None) };
    let header = Header::decode([head[0], head[1], head[2], head[3], head[4]])?;
    let end = HEADER_LEN + header.len;
    let Some(payload) = buf.get(HEADER_LEN..end) else { return Ok(None) };
    Ok(Some((decode_payload(header.kind, payload)?, end)))
}

fn put_header(out: &mut Vec<u8>, kind: Kind, len: usize) {
    debug_assert!(len <= MAX_FRAME_BYTES);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    out.push(kind as u8);
}

fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use raft::eraftpb::{Entry, MessageType};

    use super::*;

    fn append(from: NodeId, to: NodeId) -> Message {
        let entries = (1..=3u64).map(|i| Entry { index: i, term: 7, data: vec![i as u8; 100].into(), ..Default::default() });
        Message {
            msg_type: MessageType::MsgAppend,
            from,
            to,
            term: 7,
            log_term: 6,
            index: 41,
            commit: 40,
            entries: entries.collect::<Vec<_>>().into(),
            ..Default::default()
        }
    }

    #[test]
    fn round_trip_every_kind() {
        let hello = Hello { version: VERSION, lane: Lane::Snapshot, from: 3, to: u64::MAX };
        let msg = append(1, 2);
        let data = vec![0xab; 1000];
        let chunk = Chunk { seq: 9, offset: 4096, total: 10_000, data: &data };

        let mut buf = vec![0xee]; // appending after existing bytes must leave them alone
        encode_hello(&hello, &mut buf);
        encode_raft(&msg, &mut buf).unwrap();
        encode_chunk(&chunk, &mut buf).unwrap();
        encode_ack(9, &mut buf);
        encode_data(b"opaque \x00\xff bytes", &mut buf).unwrap();
        encode_data(b"", &mut buf).unwrap();
        encode_admin(b"join 4", &mut buf).unwrap();
        encode_hello(&Hello { version: VERSION, lane: Lane::Data, from: 1, to: 2 }, &mut buf);

        let mut at = 1;
        let mut frames = Vec::new();
        while let Some((frame, used)) = decode(&buf[at..]).unwrap() {
            frames.push(frame);
            at += used;
        }
        assert_eq!(at, buf.len());
        let data_hello = Hello { version: VERSION, lane: Lane::Data, from: 1, to: 2 };
        assert_eq!(
            frames,
            vec![
                Frame::Hello(hello),
                Frame::Raft(msg),
                Frame::SnapshotChunk(chunk),
                Frame::SnapshotAck { seq: 9 },
                Frame::Data(b"opaque \x00\xff bytes"),
                Frame::Data(b""),
                Frame::Admin(b"join 4"),
                Frame::Hello(data_hello),
            ]
        );
    }

    #[test]
    fn raft_frame_is_raft_rs_encoding() {
        let msg = append(5, 6);
        let mut buf = Vec::new();
        encode_raft(&msg, &mut buf).unwrap();
        assert_eq!(&buf[HEADER_LEN..], &msg.write_to_bytes().unwrap()[..]);
        assert_eq!(buf[4], Kind::Raft as u8);
        assert_eq!(u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize, buf.len() - HEADER_LEN);
    }

    #[test]
    fn truncated_input_needs_more_at_every_cut() {
        let mut buf = Vec::new();
        encode_hello(&Hello { version: VERSION, lane: Lane::Raft, from: 1, to: 2 }, &mut buf);
        encode_raft(&append(1, 2), &mut buf).unwrap();
        let first = HEADER_LEN + HELLO_LEN;
        for cut in 0..first {
            assert_eq!(decode(&buf[..cut]), Ok(None), "cut at {cut}");
        }
        for cut in first + 1..buf.len() {
            assert_eq!(decode(&buf[first..cut]), Ok(None), "cut at {cut}");
        }
        assert!(matches!(decode(&buf[first..]), Ok(Some((Frame::Raft(_), _)))));
    }

    #[test]
    fn oversized_length_is_refused_from_the_header_alone() {
        let mut head = ((MAX_FRAME_BYTES + 1) as u32).to_be_bytes().to_vec();
        head.push(Kind::Raft as u8);
        assert_eq!(decode(&head), Err(FrameError::TooLarge { len: MAX_FRAME_BYTES + 1, max: MAX_FRAME_BYTES }));
        let max = [0xff, 0xff, 0xff, 0xff, 2];
        assert!(matches!(Header::decode(max), Err(FrameError::TooLarge { .. })));
        // exactly the limit is fine (header-wise)
        let ok = Header::decode([0x04, 0, 0, 0, 2]).unwrap();
        assert_eq!(ok.len, MAX_FRAME_BYTES);
    }

    #[test]
    fn bad_payloads_are_errors_not_panics() {
        assert_eq!(Header::decode([0, 0, 0, 0, 9]), Err(FrameError::UnknownKind(9)));
        assert_eq!(decode_payload(Kind::Hello, &[0; 3]), Err(FrameError::BadLength { kind: Kind::Hello, len: 3, expected: HELLO_LEN }));
        let mut hello = Vec::new();
        encode_hello(&Hello { version: VERSION, lane: Lane::Raft, from: 1, to: 2 }, &mut hello);
        let mut bad_magic = hello[HEADER_LEN..].to_vec();
        bad_magic[0] = b'X';
        assert!(matches!(decode_payload(Kind::Hello, &bad_magic), Err(FrameError::BadMagic(_))));
        let mut bad_lane = hello[HEADER_LEN..].to_vec();
        bad_lane[6] = 7;
        assert_eq!(decode_payload(Kind::Hello, &bad_lane), Err(FrameError::UnknownLane(7)));
        assert!(matches!(decode_payload(Kind::Raft, &[0xff; 16]), Err(FrameError::Protobuf(_))));
        assert!(matches!(decode_payload(Kind::SnapshotChunk, &[0; 23]), Err(FrameError::BadLength { .. })));
        let mut huge = vec![0u8; CHUNK_HEADER_LEN];
        huge[16..24].copy_from_slice(&(MAX_SNAPSHOT_BYTES + 1).to_be_bytes());
        assert!(matches!(decode_payload(Kind::SnapshotChunk, &huge), Err(FrameError::TooLarge { .. })));
        assert!(matches!(decode_payload(Kind::SnapshotAck, &[0; 7]), Err(FrameError::BadLength { .. })));
        // arbitrary bytes never panic
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 64) as usize;
            let bytes: Vec<u8> = (0..n).map(|i| (x >> (i % 8 * 8)) as u8).collect();
            let _ = decode(&bytes);
        }
    }

    #[test]
    fn data_frame_is_the_payload_as_given_and_bounded() {
        let mut buf = Vec::new();
        encode_data(&[1, 2, 3], &mut buf).unwrap();
        assert_eq!(buf, [0, 0, 0, 3, Kind::Data as u8, 1, 2, 3]);
        let mut out = vec![9];
        assert!(matches!(encode_data(&vec![0u8; MAX_FRAME_BYTES + 1], &mut out), Err(FrameError::TooLarge { .. })));
        assert_eq!(out, [9]);
        assert_eq!(Header::decode([0, 0, 0, 0, 5]), Ok(Header { kind: Kind::Data, len: 0 }));
    }

    #[test]
    fn oversized_chunk_data_is_refused() {
        let data = vec![0u8; MAX_CHUNK_DATA + 1];
        let mut out = Vec::new();
        let chunk = Chunk { seq: 1, offset: 0, total: data.len() as u64, data: &data };
        assert!(matches!(encode_chunk(&chunk, &mut out), Err(FrameError::TooLarge { .. })));
        assert!(out.is_empty());
    }
}
