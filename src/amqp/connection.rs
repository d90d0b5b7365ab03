//! One client connection on the core that accepted it.
//!
//! Two halves run in one task: the **reader** parses frames and carries out methods, and
//! the **writer** drains the connection's event channel ([`ClientEvent`](crate::broker::ClientEvent)s from the reader
//! and from queues on any core) into one socket write per batch, assigning delivery tags
//! and coalescing publisher confirms on the way. Whichever half ends first ends the
//! connection; then every channel is closed (requeueing what it held) and exclusive queues
//! are deleted. A connection that only publishes, to queues of one other core, moves to
//! that core (`handoff`).
//!
//! Handshake (spec 2.2.4): protocol header → start/start-ok (PLAIN, AMQPLAIN, and EXTERNAL
//! for a TLS client with a verified certificate) → tune/tune-ok → open/open-ok. On the amqps
//! listener ([`serve_tls`]) the TLS handshake comes first, inside the same
//! [`HANDSHAKE_TIMEOUT`]. Errors are reported as the spec assigns: channel errors
//! with channel.close, connection errors with connection.close, after which only
//! connection.close-ok (or close) is read, for at most [`CLOSE_WAIT`].
//!
//! # Layout
//! This file holds [`serve`] and [`serve_tls`] (TLS handshake, AMQP handshake, then the
//! reader/writer pair, then teardown or a move to another core) and the connection's
//! limits; the rest lives in submodules:
//! - `handshake`: protocol header, connection.start/tune/open, credentials, capabilities.
//! - `session`: [`Session`] and [`ConnState`], the reader loop, blocked/unblocked state,
//!   error reporting and channel/connection teardown.
//! - `dispatch`: frame → method handler, content assembly, channel routing.
//! - `outbound`: the writer (event → frames, deliveries, confirms, heartbeats).
//! - `tags`: delivery-tag assignment for basic.deliver (pure).
//! - `confirms`: publisher-confirm coalescing into basic.ack/basic.nack (pure).
//! - `transport`: [`Transport`], the plain or TLS stream the rest is generic over.
//! - `handoff`: a publishing connection moves to the core of the queue it publishes to.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_rustls::TlsAcceptor;
use glommio::net::TcpStream;

use super::error::AmqpError;
use crate::broker::node::Node;
use crate::broker::ClientEvent;
use crate::observe::Stats;

mod confirms;
mod dispatch;
mod handoff;
mod handshake;
mod outbound;
mod session;
mod tags;
mod transport;

pub use session::{close_effects, CloseEffects, ConnState, Session};
pub use transport::Transport;

use handshake::handshake;
use outbound::{writer, WriterEnd};
use session::{reader, ReaderEnd};

/// How long the server waits for connection.close-ok after sending connection.close.
pub const CLOSE_WAIT: Duration = Duration::from_secs(1);
/// Limit for the whole handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a TLS client's certificate, verified against `--tls-ca`, says of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCert {
    /// The subject's common name: the user an EXTERNAL login is for (`None`: the
    /// certificate has none, and EXTERNAL is refused).
    pub common_name: Option<String>,
}

/// Serves one socket accepted on a plain AMQP listener until it closes.
pub async fn serve(core: Rc<Node>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    Stats::add(&core.stats().connections_opened, 1);
    run(core, stream, None, Instant::now() + HANDSHAKE_TIMEOUT).await;
}

/// Serves one socket accepted on an amqps listener until it closes: the TLS handshake with
/// `acceptor`, then the AMQP connection over it. Both handshakes together are bounded by
/// [`HANDSHAKE_TIMEOUT`]; a failed or stalled TLS handshake (a plaintext client, a client
/// certificate that does not verify, nothing sent) closes the socket with one log line.
pub async fn serve_tls(core: Rc<Node>, acceptor: TlsAcceptor, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok();
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    Stats::add(&core.stats().connections_opened, 1);
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let accepted = futures_lite::future::or(async { acceptor.accept(stream).await.map_err(Some) }, async {
        glommio::timer::sleep(HANDSHAKE_TIMEOUT).await;
        Err(None)
    })
    .await;
    let tls = match accepted {
        Ok(tls) => tls,
        Err(e) => {
            let peer = peer.map(|p| p.to_string()).unwrap_or_else(|| "unknown".into());
            match e {
                // rustls's own errors (not TLS, a bad certificate, no common cipher suite).
                Some(e) if e.kind() == std::io::ErrorKind::InvalidData => tracing::warn!(%peer, error = %e, "TLS handshake failed"),
                Some(e) => tracing::info!(%peer, error = %e, "TLS handshake ended"),
                None => tracing::info!(%peer, "TLS handshake not completed in time"),
            }
            Stats::add(&core.stats().connections_closed, 1);
            return;
        }
    };
    let peer_cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| PeerCert { common_name: crate::amqp::x509::subject_common_name(c) });
    run(core, tls, peer_cert, deadline).await;
}

/// The AMQP handshake (until `deadline`), then the connection's life, on `stream`.
async fn run<S: Transport>(core: Rc<Node>, mut stream: S, peer_cert: Option<PeerCert>, deadline: Instant) {
    let peer = stream.tcp().peer_addr().ok();
    let local = stream.tcp().local_addr().ok();
    // One deadline for the whole handshake (a client dribbling bytes must not hold a
    // connection open forever).
    let bounded = futures_lite::future::or(handshake(&core, &mut stream, peer, peer_cert.as_ref()), async {
        glommio::timer::sleep(deadline.saturating_duration_since(Instant::now())).await;
        Err(AmqpError::connection_forced("handshake not completed in time"))
    });
    let tuned = match bounded.await {
        Ok(t) => t,
        Err(e) => {
            tracing::debug!(?peer, error = %e, "handshake ended");
            Stats::add(&core.stats().connections_closed, 1);
            return;
        }
    };
    let id = crate::broker::ConnId(core.shared.next_id());
    let (tx, rx) = flume::unbounded();
    core.conns.borrow_mut().insert(id, tx.clone());
    let hb = tuned.heartbeat;
    let connected_at_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    core.shared.clients.opened(crate::broker::clients::ClientInfo {
        id,
        core: core.id,
        peer,
        local,
        user: tuned.user.clone(),
        vhost: tuned.vhost.clone(),
        connected_at_ms,
        heartbeat: hb,
        frame_max: tuned.frame_max,
        channel_max: tuned.channel_max,
        client_properties: tuned.client_properties,
        tx: tx.clone(),
    });
    // Listed before the client hears open-ok, so it can find itself at once.
    if let Err(e) = handshake::send_open_ok(&mut stream).await {
        tracing::debug!(?peer, error = %e, "handshake ended");
        core.conns.borrow_mut().remove(&id);
        core.shared.clients.closed(id);
        Stats::add(&core.stats().connections_closed, 1);
        return;
    }
    let (unblocked_tx, unblocked_rx) = flume::bounded(1);
    let session = Rc::new(Session {
        core: core.clone(),
        id,
        tx,
        pending_bytes: Default::default(),
        credit: crate::broker::credit::PublishCredit::new(id.0),
        st: RefCell::new(ConnState {
            vhost: std::sync::Arc::from(tuned.vhost.as_str()),
            grant: crate::broker::access::Grant::new(&tuned.user, &tuned.vhost),
            user: tuned.user,
            loopback: tuned.loopback,
            frame_max: tuned.frame_max,
            channel_max: tuned.channel_max,
            heartbeat: hb,
            channels: Default::default(),
            cancel_notify: tuned.cancel_notify,
            spec_qos: tuned.spec_qos,
            closing: None,
            finish: false,
            linger: false,
            peer_gone: false,
            exclusive_queues: Vec::new(),
            deleting: Vec::new(),
            held_cancels: Vec::new(),
            confirms_ready: Vec::new(),
            confirm_clock: false,
            blocked_notify: tuned.blocked_notify,
            published: false,
            blocked: false,
            handoff: Default::default(),
        }),
        unblocked: unblocked_tx,
        unblocked_rx,
        movable: S::MOVABLE,
    });
    tracing::debug!(?peer, %id, "connection open");
    live(core, stream, session, rx, tuned.leftover).await;
}

/// The life of an open connection on this core: the reader and writer halves, then either
/// the teardown when it ends, or its hand-off to another core (`handoff`), after which it
/// goes on there from `leftover` (bytes read and not yet taken).
async fn live<S: Transport>(core: Rc<Node>, stream: S, session: Rc<Session>, rx: flume::Receiver<ClientEvent>, leftover: BytesMut) {
    let peer = stream.tcp().peer_addr().ok();
    let id = session.id;
    let hb = session.st.borrow().heartbeat;
    let _ = stream.tcp().set_read_timeout(if hb > 0 { Some(Duration::from_secs(hb as u64 * 2)) } else { None });
    let fd = handoff::raw_fd(&stream);
    let (mut r, mut w) = futures_lite::io::split(stream);
    let (mut session, mut leftover) = (session, leftover);
    loop {
        let moving = RefCell::new(None);
        let read_half = async {
            match reader(session.clone(), &mut r, leftover).await {
                ReaderEnd::Closed => {
                    // The client's EOF, a read error or missed heartbeats: the writer still
                    // sends what is queued, then ends the connection; a writer stuck on a
                    // client that stopped reading is cut off after twice CLOSE_WAIT.
                    session.peer_gone();
                    glommio::timer::sleep(CLOSE_WAIT * 2).await;
                }
                // The writer pauses and ends the race.
                ReaderEnd::Move(buf) => {
                    *moving.borrow_mut() = Some(buf);
                    std::future::pending::<()>().await;
                }
            }
            WriterEnd::Ended
        };
        let end = futures_lite::future::or(read_half, writer(session.clone(), rx.clone(), &mut w, S::BUFFERED)).await;
        match (moving.into_inner(), end, fd) {
            (Some(buf), WriterEnd::Paused, Some(fd)) => match handoff::send_away(&core, session, fd, rx.clone(), buf) {
                // Dropping the halves closes this core's descriptor; the duplicate went on.
                Ok(()) => return,
                // Called off: the connection goes on here.
                Err((s, buf)) => (session, leftover) = (s, buf),
            },
            _ => break,
        }
    }
    session.teardown();
    core.conns.borrow_mut().remove(&id);
    core.shared.clients.closed(id);
    if let Some(remote) = &core.shared.remote {
        remote.connection_closed(id);
    }
    Stats::add(&core.stats().connections_closed, 1);
    tracing::debug!(?peer, %id, "connection closed");
}
