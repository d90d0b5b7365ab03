//! Per peer, the two sending threads: the raft-lane writer (connect with backoff, then drain
//! the queue in batches) and the snapshot sender (one connection per snapshot message, sent in
//! chunks, acknowledged by the receiver).

use std::io::{BufReader, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use protobuf::Message as _;
use raft::eraftpb::Message;
use tracing::{info, warn};

use super::frame::{self, Chunk, Frame, Kind, Lane, MAX_SNAPSHOT_BYTES};
use super::link::{self, LinkError};
use super::transport::{Peer, PeerStats, Shared};
use super::{NodeId, Report};

/// First reconnect delay; doubled after each failed attempt up to `MAX_BACKOFF`.
pub(super) const MIN_BACKOFF: Duration = Duration::from_millis(100);
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// An idle writer checks this often that the peer has not closed its lane.
pub(super) const IDLE_CHECK: Duration = Duration::from_millis(500);
/// A batch is written once it holds this many bytes even if more messages are queued.
pub(super) const MAX_BATCH_BYTES: usize = 4 << 20;
/// The batch buffer is shrunk back to this capacity after a batch that grew it past 4×.
pub(super) const BATCH_CAPACITY: usize = 256 << 10;
/// Most time a snapshot's receiver may take to reassemble, decode and hand it on.
const SNAPSHOT_ACK_TIMEOUT: Duration = Duration::from_secs(30);

pub(super) enum Wake<T> {
    Msg(T),
    Idle,
    Stop,
}

/// Waits up to `timeout` for a queued message or the stop signal.
pub(super) fn next<T>(shared: &Shared, rx: &flume::Receiver<T>, timeout: Duration) -> Wake<T> {
    if shared.stop.is_set() {
        return Wake::Stop;
    }
    flume::Selector::new()
        .recv(rx, |m| m.map_or(Wake::Stop, Wake::Msg))
        .recv(shared.stop.receiver(), |_| Wake::Stop)
        .wait_timeout(timeout)
        .unwrap_or(Wake::Idle)
}

/// The raft-lane writer of peer `id`: keeps one connection up (reconnecting with backoff on
/// its own thread, so `send` never waits on a connect) and writes what `rx` holds.
pub(super) fn run_raft_writer(shared: std::sync::Arc<Shared>, id: NodeId, rx: flume::Receiver<Message>) {
    let Some(peer) = shared.find_peer(id) else { return };
    let peer = &*peer;
    // Whether "down" was logged since the last "up" (one info line per transition).
    let mut down_logged = false;
    let mut batch = Vec::with_capacity(BATCH_CAPACITY);
    while let Some((stream, registered)) =
        link::dial_until_up(&shared, id, peer.addr, Lane::Raft, &mut down_logged, || drop_queued(&shared, peer, &rx))
    {
        peer.stats.connected.store(true, std::sync::atomic::Ordering::Release);
        info!(peer = id, addr = %peer.addr, "cluster: raft lane to peer up");
        let result = pump(&shared, peer, &rx, &stream, &mut batch);
        peer.stats.connected.store(false, std::sync::atomic::Ordering::Release);
        let _ = stream.shutdown(Shutdown::Both);
        drop(registered);
        match result {
            Ok(()) => break,
            Err(err) => {
                info!(peer = id, addr = %peer.addr, %err, "cluster: raft lane to peer down");
                down_logged = true;
                shared.report(Report::Unreachable(id));
            }
        }
    }
    peer.stats.connected.store(false, std::sync::atomic::Ordering::Release);
}

/// Drops whatever was queued for a lane that is not up (invariant 3); one report covers them.
fn drop_queued(shared: &Shared, peer: &Peer, rx: &flume::Receiver<Message>) {
    let stale = rx.drain().count() as u64;
    if stale > 0 {
        PeerStats::add(&peer.stats.dropped, stale);
        shared.report(Report::Unreachable(peer.id));
    }
}

/// Writes queued messages on an established raft lane until it fails (`Err`) or the
/// transport stops (`Ok`). Each round drains the queue into `batch` (up to
/// `MAX_BATCH_BYTES`) and writes it with one `write_all`.
fn pump(shared: &Shared, peer: &Peer, rx: &flume::Receiver<Message>, stream: &TcpStream, batch: &mut Vec<u8>) -> Result<(), LinkError> {
    let mut writer = stream;
    loop {
        let first = match next(shared, rx, IDLE_CHECK) {
            Wake::Stop => return Ok(()),
            // A peer removed at run time: the lane ends (its writer with it).
            Wake::Idle if shared.find_peer(peer.id).is_none() => return Ok(()),
            Wake::Idle => {
                link::check_open(stream)?;
                continue;
            }
            Wake::Msg(msg) => msg,
        };
        batch.clear();
        let mut count = encode(shared, peer, &first, batch);
        while batch.len() < MAX_BATCH_BYTES {
            let Ok(msg) = rx.try_recv() else { break };
            count += encode(shared, peer, &msg, batch);
        }
        if batch.is_empty() {
            continue;
        }
        if let Err(err) = writer.write_all(batch).and_then(|()| writer.flush()) {
            PeerStats::add(&peer.stats.dropped, count);
            return Err(err.into());
        }
        PeerStats::add(&peer.stats.sent, count);
        PeerStats::add(&peer.stats.writes, 1);
        if batch.capacity() > 4 * BATCH_CAPACITY {
            batch.clear();
            batch.shrink_to(BATCH_CAPACITY);
        }
    }
}

/// Appends `msg`'s frame to `batch`: 1 when it was, 0 when it cannot be encoded (dropped and
/// reported).
fn encode(shared: &Shared, peer: &Peer, msg: &Message, batch: &mut Vec<u8>) -> u64 {
    match frame::encode_raft(msg, batch) {
        Ok(()) => 1,
        Err(err) => {
            warn!(peer = peer.id, msg_type = ?msg.msg_type, %err, "cluster: raft message not sendable, dropped");
            PeerStats::add(&peer.stats.dropped, 1);
            shared.report(Report::Unreachable(peer.id));
            0
        }
    }
}

/// The snapshot sender of peer `id`: sends each queued `MsgSnapshot` on a connection of its
/// own and reports it exactly once (invariant 2). Shutdown fails whatever is left queued.
pub(super) fn run_snapshot_sender(shared: std::sync::Arc<Shared>, id: NodeId, rx: flume::Receiver<Message>) {
    let Some(peer) = shared.find_peer(id) else { return };
    let peer = &*peer;
    let mut seq = 0u64;
    loop {
        let msg = match next(&shared, &rx, Duration::from_secs(60)) {
            Wake::Msg(msg) => msg,
            // A peer removed at run time: this thread ends.
            Wake::Idle if shared.find_peer(id).is_none() => break,
            Wake::Idle => continue,
            Wake::Stop => break,
        };
        seq += 1;
        let started = Instant::now();
        match send_snapshot(&shared, peer, &msg, seq) {
            Ok(bytes) => {
                PeerStats::add(&peer.stats.snapshots_sent, 1);
                info!(peer = id, bytes, ms = started.elapsed().as_millis() as u64, "cluster: snapshot sent");
                shared.report(Report::SnapshotFinished(id));
            }
            Err(err) => {
                PeerStats::add(&peer.stats.snapshots_failed, 1);
                warn!(peer = id, %err, "cluster: snapshot send failed");
                shared.report(Report::SnapshotFailed(id));
            }
        }
    }
}

/// Sends one snapshot message: encode, connect a snapshot lane, write the chunks, flush, wait
/// for the receiver's ack of `seq`. Returns the encoded size in bytes.
fn send_snapshot(shared: &Shared, peer: &Peer, msg: &Message, seq: u64) -> Result<u64, LinkError> {
    let encoded = msg.write_to_bytes().map_err(|err| LinkError::Frame(frame::FrameError::Protobuf(err.to_string())))?;
    let total = encoded.len() as u64;
    if total > MAX_SNAPSHOT_BYTES {
        return Err(LinkError::Frame(frame::FrameError::TooLarge { len: encoded.len(), max: MAX_SNAPSHOT_BYTES as usize }));
    }
    let (stream, _registered) = link::dial(shared, peer.id, peer.addr, Lane::Snapshot)?;
    let mut writer = &stream;
    let mut out = Vec::with_capacity(shared.chunk_bytes + frame::HEADER_LEN + frame::CHUNK_HEADER_LEN);
    let mut offset = 0usize;
    loop {
        if shared.stop.is_set() {
            return Err(LinkError::Stopped);
        }
        let end = (offset + shared.chunk_bytes).min(encoded.len());
        out.clear();
        frame::encode_chunk(&Chunk { seq, offset: offset as u64, total, data: &encoded[offset..end] }, &mut out)?;
        writer.write_all(&out)?;
        offset = end;
        if offset == encoded.len() {
            break;
        }
    }
    writer.flush()?;
    stream.set_read_timeout(Some(SNAPSHOT_ACK_TIMEOUT))?;
    let mut payload = Vec::new();
    let header = link::read_frame(&mut BufReader::new(&stream), &mut payload)?;
    match (header.kind, frame::decode_payload(header.kind, &payload)?) {
        (Kind::SnapshotAck, Frame::SnapshotAck { seq: acked }) if acked == seq => {}
        (kind, _) => return Err(LinkError::Protocol(format!("expected the ack of snapshot {seq}, got a {kind:?} frame"))),
    }
    let _ = stream.shutdown(Shutdown::Both);
    Ok(total)
}
