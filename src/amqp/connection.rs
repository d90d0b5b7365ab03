//! One client connection on the core that accepted it.
//!
//! Two halves run in one task: the **reader** parses frames and carries out methods, and
//! the **writer** drains the connection's event channel ([`ClientEvent`](crate::broker::ClientEvent)s from the reader
//! and from queues on any core) into one socket write per batch, assigning delivery tags
//! and coalescing publisher confirms on the way. Whichever half ends first ends the
//! connection; then every channel is closed (requeueing what it held) and exclusive queues
//! are deleted.
//!
//! Handshake (spec 2.2.4): protocol header → start/start-ok (PLAIN, AMQPLAIN) →
//! tune/tune-ok → open/open-ok. Errors are reported as the spec assigns: channel errors
//! with channel.close, connection errors with connection.close, after which only
//! connection.close-ok (or close) is read, for at most [`CLOSE_WAIT`].
//!
//! # Layout
//! This file holds [`serve`] (handshake, then the reader/writer pair, then teardown) and
//! the connection's limits; the rest lives in submodules:
//! - `handshake`: protocol header, connection.start/tune/open, credentials, capabilities.
//! - `session`: [`Session`] and [`ConnState`], the reader loop, blocked/unblocked state,
//!   error reporting and channel/connection teardown.
//! - `dispatch`: frame → method handler, content assembly, channel routing.
//! - `outbound`: the writer (event → frames, deliveries, confirms, heartbeats).
//! - `tags`: delivery-tag assignment for basic.deliver (pure).
//! - `confirms`: publisher-confirm coalescing into basic.ack/basic.nack (pure).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use glommio::net::TcpStream;

use super::error::AmqpError;
use crate::broker::node::Node;
use crate::observe::Stats;

mod confirms;
mod dispatch;
mod handshake;
mod outbound;
mod session;
mod tags;

pub use session::{close_effects, CloseEffects, ConnState, Session};

use handshake::handshake;
use outbound::writer;
use session::reader;

/// How long the server waits for connection.close-ok after sending connection.close.
pub const CLOSE_WAIT: Duration = Duration::from_secs(1);
/// Limit for the whole handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves one accepted socket until it closes.
pub async fn serve(core: Rc<Node>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok();
    let local = stream.local_addr().ok();
    Stats::add(&core.stats().connections_opened, 1);
    // One deadline for the whole handshake (a client dribbling bytes must not hold a
    // connection open forever).
    let bounded = futures_lite::future::or(handshake(&core, &mut stream, peer), async {
        glommio::timer::sleep(HANDSHAKE_TIMEOUT).await;
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
        tx: tx.clone(),
    });
    let _ = stream.set_read_timeout(if hb > 0 { Some(Duration::from_secs(hb as u64 * 2)) } else { None });
    let (unblocked_tx, unblocked_rx) = flume::bounded(1);
    let session = Rc::new(Session {
        core: core.clone(),
        id,
        tx,
        pending_bytes: Default::default(),
        st: RefCell::new(ConnState {
            vhost: Rc::from(tuned.vhost.as_str()),
            grant: crate::broker::access::Grant::new(&tuned.user, &tuned.vhost),
            user: tuned.user,
            loopback: tuned.loopback,
            frame_max: tuned.frame_max,
            channel_max: tuned.channel_max,
            heartbeat: hb,
            channels: Default::default(),
            cancel_notify: tuned.cancel_notify,
            closing: None,
            finish: false,
            linger: false,
            peer_gone: false,
            exclusive_queues: Vec::new(),
            confirms_ready: Vec::new(),
            blocked_notify: tuned.blocked_notify,
            published: false,
            blocked: false,
        }),
        unblocked: unblocked_tx,
        unblocked_rx,
    });
    tracing::debug!(?peer, %id, "connection open");
    let (r, w) = futures_lite::io::split(stream);
    let read_half = async {
        reader(session.clone(), r, tuned.leftover).await;
        // The client's EOF, a read error or missed heartbeats: the writer still sends what
        // is queued, then ends the connection; a writer stuck on a client that stopped
        // reading is cut off after twice CLOSE_WAIT.
        session.peer_gone();
        glommio::timer::sleep(CLOSE_WAIT * 2).await;
    };
    futures_lite::future::or(read_half, writer(session.clone(), rx, w)).await;
    session.teardown();
    core.conns.borrow_mut().remove(&id);
    core.shared.clients.closed(id);
    if let Some(remote) = &core.shared.remote {
        remote.connection_closed(id);
    }
    Stats::add(&core.stats().connections_closed, 1);
    tracing::debug!(?peer, %id, "connection closed");
}
