//! The listener thread and one reader thread per accepted connection: handshake, then raft
//! messages (raft lane) or snapshot chunks reassembled into one message (snapshot lane), each
//! handed to `on_message`, or opaque payloads (data lane, `data.rs`) handed to `on_data`.

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};
use tracing::{debug, info, warn};

use super::data;
use super::frame::{self, Chunk, Frame, Hello, Kind, Lane};
use super::link::{self, LinkError};
use super::transport::{Registered, Shared};
use super::NodeId;

/// Most accepted connections alive at once; more are closed at once (a node takes up to 3 from
/// each peer: raft, snapshot and data lanes).
const MAX_INBOUND: usize = 64;
/// A snapshot lane on which nothing arrives this long is dropped (with its partial snapshot).
const SNAPSHOT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Read buffer of a raft lane, bytes.
const READ_BUFFER: usize = 256 << 10;

/// Accepts connections until the transport stops, each served on a reader thread of its own.
pub(super) fn run_listener(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let accepted = listener.accept();
        if shared.stop.is_set() {
            break;
        }
        let (stream, addr) = match accepted {
            Ok(conn) => conn,
            Err(err) => {
                // EMFILE and the like: back off rather than spin.
                warn!(%err, "cluster: accept failed");
                if shared.stop.wait(Duration::from_millis(50)) {
                    break;
                }
                continue;
            }
        };
        if shared.inbound.load(Ordering::Acquire) >= MAX_INBOUND {
            warn!(%addr, "cluster: too many inbound connections; closed");
            continue;
        }
        shared.inbound.fetch_add(1, Ordering::AcqRel);
        let s = shared.clone();
        let spawned = std::thread::Builder::new().name("cluster-in".into()).spawn(move || {
            serve(&s, stream, addr);
            s.inbound.fetch_sub(1, Ordering::AcqRel);
        });
        match spawned {
            Ok(handle) => {
                let mut readers = shared.readers.lock();
                readers.retain(|h| !h.is_finished());
                readers.push(handle);
            }
            Err(err) => {
                shared.inbound.fetch_sub(1, Ordering::AcqRel);
                warn!(%addr, %err, "cluster: cannot spawn a reader thread; connection closed");
            }
        }
    }
    debug!("cluster: listener stopped");
}

/// Serves one accepted connection until it closes, fails or the transport stops.
fn serve(shared: &Shared, stream: TcpStream, addr: SocketAddr) {
    let registered = match link::configure(&stream).map_err(LinkError::from).and_then(|()| shared.sockets.register(&stream)) {
        Ok(registered) => registered,
        Err(err) => {
            debug!(%addr, %err, "cluster: inbound connection dropped before its handshake");
            return;
        }
    };
    let hello = match link::read_offer(&stream, shared.me, |id| shared.find_peer(id).is_some()) {
        Ok(hello) => hello,
        Err(err) => {
            warn!(%addr, %err, "cluster: inbound connection refused");
            return;
        }
    };
    let from = hello.from;
    if hello.lane == Lane::Admin {
        serve_admin(shared, &stream, &hello, addr);
        return;
    }
    if let Err(err) = link::configure_lane(&stream, hello.lane) {
        debug!(peer = from, %addr, %err, "cluster: inbound connection dropped before its answer");
        return;
    }
    // The lane becomes the current one before the dialer hears it is accepted (invariant 5).
    let live = match hello.lane {
        Lane::Raft => {
            replace_raft_lane(shared, from, &registered);
            None
        }
        Lane::Data => match shared.find_peer(from) {
            Some(peer) => Some(peer.data.accepted(shared, from, registered.id)),
            None => return, // removed since its offer was read
        },
        Lane::Snapshot | Lane::Admin => None,
    };
    // `live` is set for a data lane only.
    let result = match (link::answer(&stream, shared.me, &hello), live.as_deref()) {
        (Err(err), _) => {
            debug!(peer = from, %addr, %err, "cluster: handshake answer failed");
            Err(LinkError::Stopped) // nothing came up: nothing to log as down
        }
        (Ok(()), Some(live)) => {
            info!(peer = from, %addr, "cluster: data lane from peer up");
            data::read_data_lane(shared, &stream, from, live)
        }
        (Ok(()), None) if hello.lane == Lane::Raft => {
            info!(peer = from, %addr, "cluster: raft lane from peer up");
            read_raft_lane(shared, &stream, from)
        }
        (Ok(()), None) => {
            debug!(peer = from, %addr, "cluster: snapshot lane from peer opened");
            read_snapshot_lane(shared, &stream, from)
        }
    };
    let current = match hello.lane {
        Lane::Raft => release_raft_lane(shared, from, registered.id),
        Lane::Data => shared.find_peer(from).is_none_or(|peer| peer.data.released(shared, from, registered.id)),
        Lane::Snapshot | Lane::Admin => true,
    };
    if !current {
        // A newer lane from the same peer logged "up" (or the data link's session ended and
        // closed this one); this one going is no transition.
        debug!(peer = from, %addr, lane = ?hello.lane, "cluster: replaced lane from peer closed");
        return;
    }
    match (hello.lane, result) {
        (_, Err(LinkError::Stopped)) => {}
        (Lane::Raft | Lane::Data, Err(LinkError::Closed)) => {
            info!(peer = from, %addr, lane = ?hello.lane, "cluster: lane from peer down (closed)")
        }
        (Lane::Raft | Lane::Data, Err(err)) => info!(peer = from, %addr, lane = ?hello.lane, %err, "cluster: lane from peer down"),
        (Lane::Snapshot | Lane::Admin, Err(LinkError::Closed)) => debug!(peer = from, %addr, "cluster: snapshot lane from peer closed"),
        (Lane::Snapshot | Lane::Admin, Err(err)) => warn!(peer = from, %addr, %err, "cluster: snapshot lane from peer failed"),
        (_, Ok(())) => {}
    }
}

/// Forgets the raft lane `id` from `from` if it is still the current one (true), else leaves
/// the newer lane alone (false).
fn release_raft_lane(shared: &Shared, from: NodeId, id: u64) -> bool {
    let mut lanes = shared.inbound_raft.lock();
    let current = lanes.get(&from) == Some(&id);
    if current {
        lanes.remove(&from);
    }
    current
}

/// Makes `registered` the raft lane from `from`, shutting down the one it replaces.
fn replace_raft_lane(shared: &Shared, from: NodeId, registered: &Registered<'_>) {
    let old = shared.inbound_raft.lock().insert(from, registered.id);
    if let Some(old) = old {
        debug!(peer = from, "cluster: newer raft lane from peer replaces the old one");
        shared.sockets.shutdown_one(old);
    }
}

/// Reads raft messages until the lane ends; `Err` always (`Closed` for a clean close,
/// `Stopped` when the transport stops).
fn read_raft_lane(shared: &Shared, stream: &TcpStream, from: NodeId) -> Result<(), LinkError> {
    let mut reader = BufReader::with_capacity(READ_BUFFER, stream);
    let mut payload = Vec::new();
    loop {
        let header = link::read_frame(&mut reader, &mut payload).map_err(|err| stopped_or(shared, err))?;
        if header.kind != Kind::Raft {
            return Err(LinkError::Protocol(format!("{:?} frame on a raft lane", header.kind)));
        }
        let Frame::Raft(msg) = frame::decode_payload(Kind::Raft, &payload)? else { unreachable!("a Raft payload decodes to a message") };
        check_addressed(shared, &msg, from)?;
        (shared.on_message)(msg);
        shrink(&mut payload);
    }
}

/// Reassembly of one snapshot message from its chunks.
struct Assembly {
    seq: u64,
    total: u64,
    bytes: Vec<u8>,
}

impl Assembly {
    /// Adds `chunk`; the whole encoded message once it is complete.
    fn add(current: &mut Option<Assembly>, chunk: &Chunk<'_>) -> Result<Option<Vec<u8>>, LinkError> {
        let asm = match current {
            Some(asm) => {
                if chunk.seq != asm.seq || chunk.total != asm.total || chunk.offset != asm.bytes.len() as u64 {
                    return Err(LinkError::Protocol(format!(
                        "snapshot chunk (seq {}, offset {}, total {}) does not continue snapshot {} at {} of {}",
                        chunk.seq,
                        chunk.offset,
                        chunk.total,
                        asm.seq,
                        asm.bytes.len(),
                        asm.total
                    )));
                }
                asm
            }
            None => {
                if chunk.offset != 0 {
                    return Err(LinkError::Protocol(format!("snapshot {} starts at offset {}", chunk.seq, chunk.offset)));
                }
                // `total` is bounded by MAX_SNAPSHOT_BYTES (frame decoding), but reserve only
                // what the first chunks need: memory follows the bytes that arrive.
                let reserve = (chunk.total as usize).min(4 * chunk.data.len().max(1 << 16));
                current.insert(Assembly { seq: chunk.seq, total: chunk.total, bytes: Vec::with_capacity(reserve) })
            }
        };
        if asm.bytes.len() as u64 + chunk.data.len() as u64 > asm.total {
            return Err(LinkError::Protocol(format!("snapshot {} chunks exceed its {} bytes", asm.seq, asm.total)));
        }
        asm.bytes.extend_from_slice(chunk.data);
        if asm.bytes.len() as u64 == asm.total {
            return Ok(current.take().map(|asm| asm.bytes));
        }
        Ok(None)
    }
}

/// Reads snapshot chunks, and for each complete snapshot: decode, check, `on_message`, ack.
fn read_snapshot_lane(shared: &Shared, stream: &TcpStream, from: NodeId) -> Result<(), LinkError> {
    stream.set_read_timeout(Some(SNAPSHOT_IDLE_TIMEOUT))?;
    let mut reader = BufReader::with_capacity(READ_BUFFER, stream);
    let mut payload = Vec::new();
    let mut current = None;
    loop {
        let header = link::read_frame(&mut reader, &mut payload).map_err(|err| stopped_or(shared, err))?;
        let Frame::SnapshotChunk(chunk) = frame::decode_payload(header.kind, &payload)? else {
            return Err(LinkError::Protocol(format!("{:?} frame on a snapshot lane", header.kind)));
        };
        let seq = chunk.seq;
        let Some(encoded) = Assembly::add(&mut current, &chunk)? else { continue };
        let msg = Message::parse_from_bytes(&encoded).map_err(|err| LinkError::Frame(frame::FrameError::Protobuf(err.to_string())))?;
        drop(encoded);
        if msg.msg_type != MessageType::MsgSnapshot {
            return Err(LinkError::Protocol(format!("{:?} sent on a snapshot lane", msg.msg_type)));
        }
        check_addressed(shared, &msg, from)?;
        debug!(peer = from, seq, "cluster: snapshot received");
        (shared.on_message)(msg);
        let mut ack = Vec::with_capacity(frame::HEADER_LEN + 8);
        frame::encode_ack(seq, &mut ack);
        let mut writer = stream;
        writer.write_all(&ack)?;
        writer.flush()?;
        payload = Vec::new();
    }
}

/// A message must come from the lane's peer and be addressed to this node.
fn check_addressed(shared: &Shared, msg: &Message, from: NodeId) -> Result<(), LinkError> {
    if msg.from != from || msg.to != shared.me {
        return Err(LinkError::Protocol(format!(
            "{:?} from {} to {} on the lane from node {from} to node {}",
            msg.msg_type, msg.from, msg.to, shared.me
        )));
    }
    if shared.find_peer(from).is_none() {
        return Err(LinkError::Protocol(format!("raft message from node {from}, which is no peer (removed)")));
    }
    Ok(())
}

/// A read error after shutdown is the stop, not a failure worth a log line.
fn stopped_or(shared: &Shared, err: LinkError) -> LinkError {
    if shared.stop.is_set() {
        LinkError::Stopped
    } else {
        err
    }
}

/// Gives back the memory of an unusually large frame.
fn shrink(payload: &mut Vec<u8>) {
    if payload.capacity() > 4 * READ_BUFFER {
        *payload = Vec::new();
    }
}

/// Serves one admin lane: answer the hello, read the one request, hand it to `on_admin`
/// (which may block: this is the connection's own thread), write its answer, close.
fn serve_admin(shared: &Shared, stream: &TcpStream, hello: &Hello, addr: SocketAddr) {
    let from = hello.from;
    let mut request = Vec::new();
    let read = link::answer(stream, shared.me, hello).and_then(|()| {
        stream.set_read_timeout(Some(link::HANDSHAKE_TIMEOUT))?;
        link::read_frame(&mut &*stream, &mut request)
    });
    match read {
        Ok(header) if header.kind == Kind::Admin => {}
        Ok(header) => {
            warn!(peer = from, %addr, kind = ?header.kind, "cluster: admin lane without an admin request; closed");
            return;
        }
        Err(err) => {
            debug!(peer = from, %addr, %err, "cluster: admin lane closed before its request");
            return;
        }
    }
    let handler = shared.on_admin.read().clone();
    let reply = match handler {
        Some(f) => f(from, request),
        None => Vec::new(),
    };
    let mut out = Vec::with_capacity(frame::HEADER_LEN + reply.len());
    if frame::encode_admin(&reply, &mut out).is_ok() {
        let mut w = stream;
        if let Err(err) = w.write_all(&out).and_then(|()| w.flush()) {
            debug!(peer = from, %addr, %err, "cluster: admin answer not written");
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(seq: u64, offset: u64, total: u64, data: &[u8]) -> Chunk<'_> {
        Chunk { seq, offset, total, data }
    }

    #[test]
    fn chunks_reassemble_in_order_only() {
        let mut cur = None;
        assert_eq!(Assembly::add(&mut cur, &chunk(1, 0, 6, b"abc")).unwrap(), None);
        assert_eq!(Assembly::add(&mut cur, &chunk(1, 3, 6, b"def")).unwrap(), Some(b"abcdef".to_vec()));
        assert!(cur.is_none());

        let mut cur = None;
        assert!(Assembly::add(&mut cur, &chunk(2, 3, 6, b"def")).is_err(), "must start at 0");
        Assembly::add(&mut cur, &chunk(2, 0, 6, b"abc")).unwrap();
        assert!(Assembly::add(&mut cur, &chunk(3, 3, 6, b"def")).is_err(), "other seq");
        assert!(Assembly::add(&mut cur, &chunk(2, 2, 6, b"def")).is_err(), "gap/overlap");
        assert!(Assembly::add(&mut cur, &chunk(2, 3, 7, b"def")).is_err(), "other total");
        assert!(Assembly::add(&mut cur, &chunk(2, 3, 6, b"defg")).is_err(), "past total");
    }
}
