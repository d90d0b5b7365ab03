//! The data lane (module doc, "Data lane"): per peer, the link state behind `on_link` and
//! [`Transport::data_up`](super::Transport::data_up), the writer thread (like the raft lane's:
//! connect with backoff, drain the queue in batches), and the reader of an accepted data lane.
//!
//! # The link and its sessions
//! The link to peer P is *up* while both this node's outbound data lane to P is up (handshake
//! done, nothing failed since) and an inbound data lane from P is connected (handshake
//! answered, not replaced, not closed). Each change of that value is reported once to
//! `on_link`, under the peer's state lock, so reports for one peer alternate strictly
//! (`true`, `false`, `true`, …; the first one is a `true`).
//!
//! The two connections that were current when the link went up form its *session*. The first
//! event that ends it (either connection failing or closing, or a newer inbound lane from P
//! replacing the session's one) reports `false` and closes both: the peer then sees both of
//! its data connections to this node break too, so its own `on_link(false)` follows, and
//! nothing sent in the old session is delivered after the `false` (but for an `on_data` call
//! already under way). The writer then dials again at once; the next `true` is a new session.
//! Payloads queued in one session are never written in another.

use std::io::{BufReader, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tracing::{debug, info};

use super::frame::{self, Kind, Lane, MAX_FRAME_BYTES};
use super::link::{self, LinkError};
use super::outbound::{next, Wake, BATCH_CAPACITY, IDLE_CHECK, MAX_BATCH_BYTES};
use super::transport::{PeerStats, Shared};
use super::{DataError, NodeId};

/// A data lane's writer sends an empty frame (a heartbeat) after this long without payloads
/// ([`IDLE_CHECK`]); a reader that hears nothing, not even a heartbeat, for [`SILENCE_LIMIT`]
/// ends the lane, so a peer frozen while its kernel still answers TCP (SIGSTOP, a hung disk)
/// is taken as down.
pub const SILENCE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Read buffer of a data lane, bytes.
const READ_BUFFER: usize = 256 << 10;
/// A delivered payload whose buffer has this much spare capacity is shrunk to fit first.
const MAX_SLACK: usize = 64 << 10;

/// One payload waiting in a peer's data queue, tagged with the outbound session it was
/// accepted in.
pub(super) struct Queued {
    session: u64,
    payload: Vec<u8>,
}

/// Per peer: the data queue, the outbound lane's state as `send_data` reads it, and the link.
pub(super) struct DataLink {
    tx: flume::Sender<Queued>,
    /// `session << 1 | up` of the outbound lane; changed only under `state`'s lock.
    out_state: AtomicU64,
    /// Mirror of `LinkState::reported`, for status without the lock.
    link_up: AtomicBool,
    state: Mutex<LinkState>,
    pub(super) sent: AtomicU64,
    pub(super) writes: AtomicU64,
    pub(super) dropped: AtomicU64,
}

#[derive(Default)]
struct LinkState {
    /// Outbound sessions so far (the current one's number when `out` is set).
    session: u64,
    /// Registered socket id of the outbound lane while it is up.
    out: Option<u64>,
    /// The current inbound lane.
    inbound: Option<Inbound>,
    /// The value last passed to `on_link`.
    reported: bool,
}

struct Inbound {
    socket: u64,
    /// Cleared when the lane is replaced or its session ends: its reader delivers no more.
    live: Arc<AtomicBool>,
}

impl DataLink {
    /// A link with a queue of `capacity` payloads; the receiver goes to the writer thread.
    pub(super) fn new(capacity: usize) -> (DataLink, flume::Receiver<Queued>) {
        let (tx, rx) = flume::bounded(capacity);
        let link = DataLink {
            tx,
            out_state: AtomicU64::new(0),
            link_up: AtomicBool::new(false),
            state: Mutex::new(LinkState::default()),
            sent: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        };
        (link, rx)
    }

    /// Whether the outbound lane is up.
    pub(super) fn out_up(&self) -> bool {
        self.out_state.load(Ordering::Acquire) & 1 == 1
    }

    /// Whether the link is up (as last reported to `on_link`).
    pub(super) fn link_up(&self) -> bool {
        self.link_up.load(Ordering::Acquire)
    }

    /// `Transport::send_data` once the peer is known and the transport running.
    pub(super) fn send(&self, payload: Vec<u8>) -> Result<(), DataError> {
        if payload.len() > MAX_FRAME_BYTES {
            return Err(DataError::TooLarge);
        }
        let state = self.out_state.load(Ordering::Acquire);
        if state & 1 == 0 {
            return Err(DataError::Down);
        }
        match self.tx.try_send(Queued { session: state >> 1, payload }) {
            Ok(()) => Ok(()),
            Err(flume::TrySendError::Full(_)) => Err(DataError::Full),
            Err(flume::TrySendError::Disconnected(_)) => Err(DataError::Down),
        }
    }

    /// The writer's lane to `peer` is up on `socket`: a new session; returns its number.
    fn opened(&self, shared: &Shared, peer: NodeId, socket: u64) -> u64 {
        let mut st = self.state.lock();
        st.session += 1;
        st.out = Some(socket);
        self.out_state.store(st.session << 1 | 1, Ordering::Release);
        let session = st.session;
        self.settle(shared, peer, &mut st);
        session
    }

    /// The writer's lane on `socket` is down (if the session did not already end).
    fn closed(&self, shared: &Shared, peer: NodeId, socket: u64) {
        let mut st = self.state.lock();
        if st.out == Some(socket) {
            st.out = None;
            self.out_state.store(st.session << 1, Ordering::Release);
        }
        self.settle(shared, peer, &mut st);
    }

    /// An inbound lane from `peer` on `socket` passed its handshake: it becomes the current
    /// one, closing the lane it replaces (and ending the session that one belonged to).
    /// Returns the flag its reader checks before each delivery.
    pub(super) fn accepted(&self, shared: &Shared, peer: NodeId, socket: u64) -> Arc<AtomicBool> {
        let mut st = self.state.lock();
        if let Some(old) = st.inbound.take() {
            debug!(peer, "cluster: newer data lane from peer replaces the old one");
            old.live.store(false, Ordering::Release);
            shared.sockets.shutdown_one(old.socket);
            self.settle(shared, peer, &mut st);
        }
        let live = Arc::new(AtomicBool::new(true));
        st.inbound = Some(Inbound { socket, live: live.clone() });
        self.settle(shared, peer, &mut st);
        live
    }

    /// The inbound lane on `socket` ended: true if it was still the current one.
    pub(super) fn released(&self, shared: &Shared, peer: NodeId, socket: u64) -> bool {
        let mut st = self.state.lock();
        if st.inbound.as_ref().map(|i| i.socket) != Some(socket) {
            return false;
        }
        st.inbound = None;
        self.settle(shared, peer, &mut st);
        true
    }

    /// Reports a change of the link's value; a session that ends closes both its connections.
    ///
    /// Before a new session starts, its outbound lane is checked: one the peer closed already
    /// (ending its own session) while the writer, which only writes, has not noticed yet is
    /// dropped (the writer dials again), never paired with the peer's fresh inbound lane. Paired,
    /// it failed at the next write and ended the new session, whose close did the same to the
    /// peer's next one: a link that went up and down every second after a flapping partition.
    fn settle(&self, shared: &Shared, peer: NodeId, st: &mut LinkState) {
        let mut up = st.out.is_some() && st.inbound.is_some();
        if up && !st.reported {
            if let Some(socket) = st.out.filter(|&socket| shared.sockets.finished(socket)) {
                debug!(peer, "cluster: outbound data lane closed by the peer before the link came up: dialing again");
                st.out = None;
                self.out_state.store(st.session << 1, Ordering::Release);
                shared.sockets.shutdown_one(socket);
                up = false;
            }
        }
        if up == st.reported {
            return;
        }
        if !up {
            if let Some(socket) = st.out.take() {
                self.out_state.store(st.session << 1, Ordering::Release);
                shared.sockets.shutdown_one(socket);
            }
            if let Some(inbound) = st.inbound.take() {
                inbound.live.store(false, Ordering::Release);
                shared.sockets.shutdown_one(inbound.socket);
            }
        }
        st.reported = up;
        self.link_up.store(up, Ordering::Release);
        info!(peer, up, "cluster: data link to peer {}", if up { "up" } else { "down" });
        (shared.on_link)(peer, up);
    }
}

/// The data-lane writer of peer `id`: keeps one connection up and writes what `rx` holds,
/// as the raft-lane writer does.
pub(super) fn run_data_writer(shared: Arc<Shared>, id: NodeId, rx: flume::Receiver<Queued>) {
    let Some(peer) = shared.find_peer(id) else { return };
    let link = &peer.data;
    let mut down_logged = false;
    let mut batch = Vec::with_capacity(BATCH_CAPACITY);
    while let Some((stream, registered)) =
        link::dial_until_up(&shared, id, peer.addr, Lane::Data, &mut down_logged, || drop_queued(link, &rx))
    {
        // Anything queued now was accepted before this session: stale.
        drop_queued(link, &rx);
        let session = link.opened(&shared, id, registered.id);
        info!(peer = id, addr = %peer.addr, session, "cluster: data lane to peer up");
        let result = pump(&shared, link, &rx, &stream, session, &mut batch);
        link.closed(&shared, id, registered.id);
        let _ = stream.shutdown(Shutdown::Both);
        drop(registered);
        match result {
            Ok(()) => break,
            Err(err) => {
                info!(peer = id, addr = %peer.addr, %err, "cluster: data lane to peer down");
                down_logged = true;
            }
        }
    }
    drop_queued(link, &rx);
}

/// Drops what is queued for a lane that is not up (nothing is buffered for a down lane).
fn drop_queued(link: &DataLink, rx: &flume::Receiver<Queued>) {
    let stale = rx.drain().count() as u64;
    PeerStats::add(&link.dropped, stale);
}

/// Writes queued payloads of `session` until the lane fails or its session ends (`Err`) or
/// the transport stops (`Ok`). Each round drains the queue into `batch` (up to
/// `MAX_BATCH_BYTES`) and writes it with one `write_all` and flush.
fn pump(
    shared: &Shared,
    link: &DataLink,
    rx: &flume::Receiver<Queued>,
    stream: &TcpStream,
    session: u64,
    batch: &mut Vec<u8>,
) -> Result<(), LinkError> {
    let live = session << 1 | 1;
    let mut writer = stream;
    loop {
        if link.out_state.load(Ordering::Acquire) != live {
            return Err(LinkError::Ended);
        }
        let first = match next(shared, rx, IDLE_CHECK) {
            Wake::Stop => return Ok(()),
            Wake::Idle => {
                link::check_open(stream)?;
                // The heartbeat: an empty frame the reader skips (see `SILENCE_LIMIT`).
                batch.clear();
                let _ = frame::encode_data(&[], batch);
                writer.write_all(batch).and_then(|()| writer.flush())?;
                continue;
            }
            Wake::Msg(queued) => queued,
        };
        batch.clear();
        let (mut count, mut stale) = (0u64, 0u64);
        let mut add = |q: Queued, batch: &mut Vec<u8>| {
            // `send` bounded the size: encoding cannot fail.
            if q.session == session && frame::encode_data(&q.payload, batch).is_ok() {
                count += 1;
            } else {
                stale += 1;
            }
        };
        add(first, batch);
        while batch.len() < MAX_BATCH_BYTES {
            let Ok(queued) = rx.try_recv() else { break };
            add(queued, batch);
        }
        PeerStats::add(&link.dropped, stale);
        if batch.is_empty() {
            continue;
        }
        if let Err(err) = writer.write_all(batch).and_then(|()| writer.flush()) {
            PeerStats::add(&link.dropped, count);
            return Err(err.into());
        }
        PeerStats::add(&link.sent, count);
        PeerStats::add(&link.writes, 1);
        if batch.capacity() > 4 * BATCH_CAPACITY {
            batch.clear();
            batch.shrink_to(BATCH_CAPACITY);
        }
    }
}

/// Reads data frames from an accepted data lane and hands each payload to `on_data` while
/// `live` holds; `Err` always (`Closed` for a clean close, `Stopped` when the transport
/// stops, `Ended` once the lane is replaced or its session ended).
pub(super) fn read_data_lane(shared: &Shared, stream: &TcpStream, from: NodeId, live: &AtomicBool) -> Result<(), LinkError> {
    stream.set_read_timeout(Some(SILENCE_LIMIT))?;
    let mut reader = BufReader::with_capacity(READ_BUFFER, stream);
    let mut payload = Vec::new();
    loop {
        let header =
            link::read_frame(&mut reader, &mut payload).map_err(|err| if shared.stop.is_set() { LinkError::Stopped } else { err })?;
        if header.kind != Kind::Data {
            return Err(LinkError::Protocol(format!("{:?} frame on a data lane", header.kind)));
        }
        if !live.load(Ordering::Acquire) {
            return Err(LinkError::Ended);
        }
        if payload.is_empty() {
            // A heartbeat.
            continue;
        }
        let mut delivered = std::mem::take(&mut payload);
        if delivered.capacity() - delivered.len() > MAX_SLACK {
            delivered.shrink_to_fit();
        }
        (shared.on_data)(from, delivered);
    }
}
