//! One TCP link: socket options, the handshake on both sides (module doc, invariant 4), and
//! blocking frame reads bounded by [`MAX_FRAME_BYTES`].

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tracing::{debug, info};

use super::frame::{self, FrameError, Header, Hello, Kind, Lane, HEADER_LEN, HELLO_LEN, MAX_FRAME_BYTES, VERSION};
use super::outbound::{MAX_BACKOFF, MIN_BACKOFF};
use super::transport::{Registered, Shared};
use super::NodeId;

/// Most time a connect may take (loopback and LAN peers answer in well under this).
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Most time either side waits for the other's hello, and for each write of it.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// A write blocked this long (peer not reading) fails and takes the link down.
pub(super) const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Written data unacknowledged by the peer's TCP this long drops the connection (a dead host).
const USER_TIMEOUT: Duration = Duration::from_secs(10);
/// Keepalive: first probe after this much idle time, then every `KEEPALIVE_INTERVAL`, and the
/// connection is dropped after `KEEPALIVE_RETRIES` unanswered probes (≈ 8 s for a dead host).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
const KEEPALIVE_RETRIES: u32 = 3;
/// The data lane's tighter timings (its loss is what the broker acts on, [`super::OnLink`]):
/// unacknowledged data, or an idle connection whose keepalive probes go unanswered, drop it
/// after `DATA_USER_TIMEOUT` (first probe after `DATA_KEEPALIVE_IDLE`, then every
/// `KEEPALIVE_INTERVAL`; with TCP_USER_TIMEOUT set, Linux aborts once that much time passed
/// since the peer last answered, whatever the probe count). Linux applies it to a zero window
/// too: a receiver that reads nothing for this long also drops the connection.
pub(super) const DATA_USER_TIMEOUT: Duration = Duration::from_secs(5);
const DATA_KEEPALIVE_IDLE: Duration = Duration::from_secs(2);

/// Why a link failed or was refused. Logged, never returned from the public API.
#[derive(Debug, thiserror::Error)]
pub(super) enum LinkError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Frame(#[from] FrameError),
    #[error("handshake refused: {0}")]
    Handshake(String),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("connection closed by the peer")]
    Closed,
    #[error("transport stopped")]
    Stopped,
    #[error("data link to the peer ended (the other direction broke, or a newer lane replaced it)")]
    Ended,
}

/// Sets TCP_NODELAY, keepalive and TCP_USER_TIMEOUT on a new connection.
pub(super) fn configure(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = SockRef::from(stream);
    let keepalive = TcpKeepalive::new().with_time(KEEPALIVE_IDLE).with_interval(KEEPALIVE_INTERVAL).with_retries(KEEPALIVE_RETRIES);
    sock.set_tcp_keepalive(&keepalive)?;
    sock.set_tcp_user_timeout(Some(USER_TIMEOUT))?;
    Ok(())
}

/// Applies the data lane's timings to a configured connection once its lane is known.
pub(super) fn configure_lane(stream: &TcpStream, lane: Lane) -> io::Result<()> {
    if lane != Lane::Data {
        return Ok(());
    }
    let sock = SockRef::from(stream);
    let keepalive = TcpKeepalive::new().with_time(DATA_KEEPALIVE_IDLE).with_interval(KEEPALIVE_INTERVAL).with_retries(KEEPALIVE_RETRIES);
    sock.set_tcp_keepalive(&keepalive)?;
    sock.set_tcp_user_timeout(Some(DATA_USER_TIMEOUT))?;
    Ok(())
}

/// Connects to peer `to` at `addr` for `lane` and runs the dialer's side of the handshake:
/// send our hello, then check the answer names `to` as its sender and us as its receiver.
/// The socket is registered (shutdown wakes it) and left with no read timeout and
/// [`WRITE_TIMEOUT`] for writes.
///
/// # Errors
/// Connect and I/O errors, [`LinkError::Handshake`] for a socket connected to itself or a
/// wrong answer, [`LinkError::Stopped`] during shutdown.
/// A lane writer's way to its peer: dials `lane` to `to` at `addr` until it connects, calling
/// `before_each` ahead of every attempt (a writer drops there what was queued while its lane
/// was down), waiting [`MIN_BACKOFF`] doubling to [`MAX_BACKOFF`] between failed attempts. The
/// first failure since the lane was last up is logged at info ("down", which sets
/// `down_logged`), later ones at debug. `None` once the transport stops.
pub(super) fn dial_until_up<'a>(
    shared: &'a Shared,
    to: NodeId,
    addr: SocketAddr,
    lane: Lane,
    down_logged: &mut bool,
    mut before_each: impl FnMut(),
) -> Option<(TcpStream, Registered<'a>)> {
    let name = match lane {
        Lane::Raft => "raft",
        Lane::Snapshot => "snapshot",
        Lane::Data => "data",
        Lane::Admin => "admin",
    };
    let mut backoff = MIN_BACKOFF;
    // A peer removed at run time (`Transport::remove_peer`) is not dialed again.
    while !shared.stop.is_set() && shared.find_peer(to).is_some() {
        before_each();
        match dial(shared, to, addr, lane) {
            Ok(conn) => return Some(conn),
            Err(LinkError::Stopped) => return None,
            Err(err) => {
                if *down_logged {
                    debug!(peer = to, %addr, %err, "cluster: {name} lane connect failed");
                } else {
                    info!(peer = to, %addr, %err, "cluster: {name} lane to peer down");
                    *down_logged = true;
                }
                if shared.stop.wait(backoff) {
                    return None;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
    None
}

pub(super) fn dial<'a>(shared: &'a Shared, to: NodeId, addr: SocketAddr, lane: Lane) -> Result<(TcpStream, Registered<'a>), LinkError> {
    let stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
    // A connect to a free local port in the ephemeral range can pick that same port as its
    // source and connect to itself (TCP simultaneous open).
    if stream.local_addr()? == stream.peer_addr()? {
        return Err(LinkError::Handshake(format!("connection to {addr} is connected to itself")));
    }
    configure(&stream)?;
    configure_lane(&stream, lane)?;
    let registered = shared.sockets.register(&stream)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut out = Vec::with_capacity(HEADER_LEN + HELLO_LEN);
    frame::encode_hello(&Hello { version: VERSION, lane, from: shared.me, to }, &mut out);
    (&stream).write_all(&out)?;
    let answer = read_hello(&mut &stream)?;
    check_answer(&answer, shared.me, to, lane)?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    Ok((stream, registered))
}

/// The acceptor's side of the handshake, first half: read the dialer's hello (within
/// [`HANDSHAKE_TIMEOUT`]) and check it ([`check_offer`]). The caller then records the lane and
/// calls [`answer`], so that a dialer which saw the answer knows its lane is the current one.
///
/// # Errors
/// I/O errors (including the timeout), [`LinkError::Frame`] for bytes that are no hello,
/// [`LinkError::Handshake`] for a hello from or to the wrong node.
pub(super) fn read_offer(stream: &TcpStream, me: NodeId, known: impl Fn(NodeId) -> bool) -> Result<Hello, LinkError> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let offer = read_hello(&mut &*stream)?;
    check_offer(&offer, me, known)?;
    Ok(offer)
}

/// The acceptor's side of the handshake, second half: answer `offer` with our hello. The
/// socket is left with no read timeout and [`WRITE_TIMEOUT`] for writes.
///
/// # Errors
/// I/O errors.
pub(super) fn answer(stream: &TcpStream, me: NodeId, offer: &Hello) -> Result<(), LinkError> {
    let mut out = Vec::with_capacity(HEADER_LEN + HELLO_LEN);
    frame::encode_hello(&Hello { version: VERSION, lane: offer.lane, from: me, to: offer.from }, &mut out);
    let mut w = stream;
    w.write_all(&out)?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    Ok(())
}

/// Checks a dialer's hello as the acceptor `me`: our version, addressed to `me`, from a node
/// other than `me` that is known — except on an admin lane, which any node may open (one
/// asking to join, or a tool, as node 0).
pub(super) fn check_offer(hello: &Hello, me: NodeId, known: impl Fn(NodeId) -> bool) -> Result<(), LinkError> {
    if hello.version != VERSION {
        return Err(LinkError::Handshake(format!("version {} (we speak {VERSION})", hello.version)));
    }
    if hello.to != me {
        return Err(LinkError::Handshake(format!("addressed to node {}, this is node {me}", hello.to)));
    }
    if hello.from == me || (hello.lane != Lane::Admin && !known(hello.from)) {
        return Err(LinkError::Handshake(format!("from node {}, which is not a peer", hello.from)));
    }
    Ok(())
}

/// Checks the acceptor's answer as the dialer `me` that called `to` for `lane`. Our own hello
/// read back (a socket connected to itself) fails here: it is addressed to `to`, not `me`.
pub(super) fn check_answer(hello: &Hello, me: NodeId, to: NodeId, lane: Lane) -> Result<(), LinkError> {
    if hello.version != VERSION || hello.lane != lane || hello.from != to || hello.to != me {
        return Err(LinkError::Handshake(format!(
            "answer {hello:?} does not match a {lane:?} lane from node {to} to node {me} (version {VERSION})"
        )));
    }
    Ok(())
}

/// Reads one hello frame; anything else (another kind, a payload that is not exactly
/// `HELLO_LEN` bytes) fails before more than the header is read.
fn read_hello(reader: &mut impl Read) -> Result<Hello, LinkError> {
    let header = read_header(reader)?;
    if header.kind != Kind::Hello || header.len != HELLO_LEN {
        return Err(LinkError::Handshake(format!("first frame is {:?} of {} bytes, not a hello", header.kind, header.len)));
    }
    let mut payload = [0u8; HELLO_LEN];
    reader.read_exact(&mut payload)?;
    match frame::decode_payload(Kind::Hello, &payload)? {
        frame::Frame::Hello(hello) => Ok(hello),
        _ => unreachable!("a Hello payload decodes to a hello"),
    }
}

/// Reads one frame header; [`LinkError::Closed`] on a clean end of stream before it.
fn read_header(reader: &mut impl Read) -> Result<Header, LinkError> {
    let mut head = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match reader.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Err(LinkError::Closed),
            Ok(0) => return Err(LinkError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(Header::decode(head)?)
}

/// Reads one frame into `payload` (cleared first) and returns its header. The length is
/// checked against [`MAX_FRAME_BYTES`] before any payload is read, and `payload` grows only as
/// bytes arrive.
///
/// # Errors
/// [`LinkError::Closed`] at a clean end of stream between frames, [`LinkError::Frame`] for a
/// bad header, I/O errors (a stream ending inside a frame is `UnexpectedEof`).
pub(super) fn read_frame(reader: &mut impl Read, payload: &mut Vec<u8>) -> Result<Header, LinkError> {
    let header = read_header(reader)?;
    debug_assert!(header.len <= MAX_FRAME_BYTES);
    payload.clear();
    payload.reserve(header.len.min(256 << 10));
    let got = reader.take(header.len as u64).read_to_end(payload)?;
    if got < header.len {
        return Err(LinkError::Io(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(header)
}

/// Checks, without blocking, that the peer has not closed a connection we only write to.
///
/// # Errors
/// [`LinkError::Closed`] at end of stream, [`LinkError::Protocol`] if the peer sent bytes
/// on a one-way lane, I/O errors (a reset).
pub(super) fn check_open(stream: &TcpStream) -> Result<(), LinkError> {
    // MSG_DONTWAIT rather than O_NONBLOCK: the flag would be the socket's, shared with the
    // clones other threads write through (`Sockets`), whose writes must keep blocking.
    let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    let peeked = SockRef::from(stream).recv_with_flags(&mut probe, libc::MSG_PEEK | libc::MSG_DONTWAIT);
    match peeked {
        Ok(0) => Err(LinkError::Closed),
        Ok(_) => Err(LinkError::Protocol("bytes received on a one-way lane".into())),
        Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// One admin exchange as node `from` (0 for a tool) with node `to` at `addr`: dial an admin
/// lane, handshake, send `request`, and read the answer, each step within `timeout`.
///
/// # Errors
/// Connect and I/O errors (the timeout included), [`LinkError::Handshake`] for a wrong
/// answer (another node at that address), [`LinkError::Protocol`] for an answer that is no
/// admin frame.
pub(super) fn admin_exchange(addr: SocketAddr, from: NodeId, to: NodeId, request: &[u8], timeout: Duration) -> Result<Vec<u8>, LinkError> {
    let stream = TcpStream::connect_timeout(&addr, timeout.min(CONNECT_TIMEOUT * 4))?;
    if stream.local_addr()? == stream.peer_addr()? {
        return Err(LinkError::Handshake(format!("connection to {addr} is connected to itself")));
    }
    configure(&stream)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut out = Vec::with_capacity(HEADER_LEN + HELLO_LEN + request.len());
    frame::encode_hello(&Hello { version: VERSION, lane: Lane::Admin, from, to }, &mut out);
    frame::encode_admin(request, &mut out)?;
    (&stream).write_all(&out)?;
    let answer = read_hello(&mut &stream)?;
    check_answer(&answer, from, to, Lane::Admin)?;
    let mut payload = Vec::new();
    let header = read_frame(&mut &stream, &mut payload)?;
    if header.kind != Kind::Admin {
        return Err(LinkError::Protocol(format!("expected an admin answer, got a {:?} frame", header.kind)));
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_and_answers_are_checked() {
        let known = |id: NodeId| (1..=3).contains(&id);
        let offer = Hello { version: VERSION, lane: Lane::Raft, from: 2, to: 1 };
        assert!(check_offer(&offer, 1, known).is_ok());
        assert!(check_offer(&Hello { to: 3, ..offer }, 1, known).is_err(), "wrong to");
        assert!(check_offer(&Hello { from: 9, ..offer }, 1, known).is_err(), "unknown from");
        assert!(check_offer(&Hello { from: 1, ..offer }, 1, known).is_err(), "from myself");
        assert!(check_offer(&Hello { version: VERSION + 1, ..offer }, 1, known).is_err(), "version");

        let answer = Hello { version: VERSION, lane: Lane::Raft, from: 1, to: 2 };
        assert!(check_answer(&answer, 2, 1, Lane::Raft).is_ok());
        assert!(check_answer(&answer, 2, 1, Lane::Snapshot).is_err(), "lane");
        assert!(check_answer(&answer, 2, 3, Lane::Raft).is_err(), "someone else answered");
        // A socket connected to itself reads back our own hello (from 2 to 1).
        let own = Hello { version: VERSION, lane: Lane::Raft, from: 2, to: 1 };
        assert!(check_answer(&own, 2, 1, Lane::Raft).is_err());
    }

    #[test]
    fn read_frame_refuses_an_oversized_length_without_reading_on() {
        let mut bytes = ((MAX_FRAME_BYTES + 1) as u32).to_be_bytes().to_vec();
        bytes.push(Kind::Raft as u8);
        let mut payload = Vec::new();
        let err = read_frame(&mut &bytes[..], &mut payload).unwrap_err();
        assert!(matches!(err, LinkError::Frame(FrameError::TooLarge { .. })), "{err}");
        assert_eq!(payload.capacity(), 0);
    }

    #[test]
    fn read_frame_tells_a_clean_close_from_a_torn_frame() {
        let mut payload = Vec::new();
        assert!(matches!(read_frame(&mut &[][..], &mut payload), Err(LinkError::Closed)));
        assert!(matches!(read_frame(&mut &[0, 0][..], &mut payload), Err(LinkError::Io(_))));
        let torn = [0, 0, 0, 10, Kind::Raft as u8, 1, 2, 3];
        assert!(matches!(read_frame(&mut &torn[..], &mut payload), Err(LinkError::Io(_))));
        let mut ok = Vec::new();
        frame::encode_ack(7, &mut ok);
        let header = read_frame(&mut &ok[..], &mut payload).unwrap();
        assert_eq!((header.kind, payload.len()), (Kind::SnapshotAck, 8));
    }
}
