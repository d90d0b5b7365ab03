//! A publishing connection moves to the core of the queue it publishes to; a consuming one to
//! the core of the queues it consumes from.
//!
//! A connection lives on the core whose accept thread took it, and that is chosen by the
//! kernel (SO_REUSEPORT); a queue lives on the core of the connection that declared it
//! (`core::placement`), usually its consumer's. So a 1 → 1 flow on two cores crosses them on
//! every publish, and at a moderate rate each message then wakes both cores: measured at
//! 20,000 msgs/s, 29-48 µs of broker CPU per message when the publish crosses, 15 µs when
//! publisher, queue and consumer share a core (bench/README.md). Once a connection's last
//! [`MOVE_AFTER`] publishes all went to queues of one other core of this node, it moves there:
//! the reader stops between two frames, the writer writes what it has and stops, and the
//! socket (a duplicate of its descriptor), the connection's state, its event channel and the
//! bytes read but not yet taken go to that core through its inbox, where the connection
//! goes on as it was (`adopt`). The client sees nothing.
//!
//! A queue declared by another connection (a setup connection, or the publisher) may lie on
//! another core than its consumer's connection, and then every delivery and every ack
//! crosses cores. So a connection that never published and whose consumers all consume from
//! queues of one other core of this node moves there too, once its last [`MOVE_AFTER`]
//! deliveries all came from there ([`Session::delivered_from`]). Its consumers, its unsettled
//! deliveries (the ledger) and its delivery tags go with its state: the queues know it by
//! connection and channel id and send to its event channel, which moves with it. The reader
//! stops between two frames, so a consumer that sends none (auto-ack, no heartbeat) stays
//! until it sends one.
//!
//! # Invariants
//! - Only a connection that holds nothing another task or queue waits on moves: a plain
//!   socket (not TLS), not closing or blocked, no transaction, no direct reply-to, no
//!   exclusive queue, no message half received, and no task holding its session besides its
//!   two halves; a publisher with no consumer and no unsettled delivery, a consumer that
//!   never published and consumes only from queues of the core it moves to. What a queue
//!   sends it meanwhile (confirms, deliveries) waits in its event channel, which moves with
//!   it.
//! - Order: the publishes it sent to the new core's queues went through that core's inbox
//!   before the hand-off message, so they are taken before any publish after the move.
//! - A connection moves at most once per [`MOVE_INTERVAL`], so a connection that publishes
//!   to queues of both cores by turns does not bounce between them.
//! - `--move-publishers false` turns it off.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::BytesMut;

use super::session::ConnState;
use super::{Session, Transport};
use crate::broker::node::{Node, NodeMsg, OnCore};
use crate::broker::reply_to::DIRECT_CORE;
use crate::broker::{ClientEvent, ClientTx, ConnId, QueueRef};
use crate::observe::Stats;

/// Consecutive publishes to queues of one other core after which a connection moves there.
pub const MOVE_AFTER: u32 = 256;
/// Least time between two moves of one connection.
pub const MOVE_INTERVAL: Duration = Duration::from_secs(10);

/// Where a connection's publishes went lately, and whether it is moving.
#[derive(Debug, Default)]
pub struct Handoff {
    /// The core the last run of publishes went to.
    toward: u32,
    /// How many publishes in a row went to queues of `toward`.
    run: u32,
    /// When it last moved.
    moved_at: Option<Instant>,
    /// The core it moves to, once decided.
    to: Option<u32>,
    /// The reader stopped for the move: the writer pauses once it wrote what it has.
    pausing: bool,
    /// The move follows its consumers' queues (module doc), not its publishes.
    consuming: bool,
}

impl Handoff {
    /// A move was decided and the reader has not stopped for it yet.
    pub fn due(&self) -> bool {
        self.to.is_some() && !self.pausing
    }

    /// The writer should pause: the reader stopped for a move.
    pub fn pausing(&self) -> bool {
        self.pausing
    }

    /// Calls off a move that could not be carried out: the connection stays.
    fn call_off(&mut self) {
        (self.to, self.pausing, self.run, self.consuming) = (None, false, 0, false);
    }

    /// Counts `n` more operations in a row toward core `c`, or ends the run (`None`);
    /// true once the run reached [`MOVE_AFTER`] and a move may be decided.
    fn count(&mut self, c: Option<u32>, n: u32) -> bool {
        match c {
            Some(c) => {
                if self.toward != c {
                    (self.toward, self.run) = (c, 0);
                }
                self.run = self.run.saturating_add(n);
            }
            None => self.run = 0,
        }
        if self.run < MOVE_AFTER || self.to.is_some() {
            return false;
        }
        // Checked once per run of MOVE_AFTER, not on each.
        self.run = 0;
        self.moved_at.is_none_or(|t| t.elapsed() >= MOVE_INTERVAL)
    }
}

/// What goes to the new core: everything of the connection but its core.
pub(super) struct Migrant {
    stream: std::net::TcpStream,
    id: ConnId,
    tx: ClientTx,
    rx: flume::Receiver<ClientEvent>,
    pending_bytes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    credit: std::sync::Arc<crate::broker::credit::PublishCredit>,
    st: ConnState,
    unblocked: flume::Sender<()>,
    unblocked_rx: flume::Receiver<()>,
    leftover: BytesMut,
}

impl Session {
    /// Counts a routed publish toward a move (module doc): `queues` are its targets.
    pub fn publish_routed(&self, queues: &[QueueRef]) {
        if !self.movable || !self.core.shared.config.move_publishers {
            return;
        }
        let target = match queues {
            [q] => self.other_core_of(q),
            _ => None,
        };
        let mut st = self.st.borrow_mut();
        if st.handoff.count(target, 1) && settled(&st, None) {
            st.handoff.to = Some(st.handoff.toward);
        }
    }

    /// Counts `n` deliveries from `queue` toward a move (module doc). Called by the writer.
    pub(super) fn delivered_from(&self, st: &mut ConnState, queue: &QueueRef, n: u32) {
        if !self.movable || !self.core.shared.config.move_publishers || st.published {
            return;
        }
        let target = self.other_core_of(queue);
        if st.handoff.count(target, n) && settled(st, Some(&|q| self.core_of(q) == Some(st.handoff.toward))) {
            st.handoff.to = Some(st.handoff.toward);
            st.handoff.consuming = true;
        }
    }

    /// The core of this node that serves `queue`; `None` for another node's queue or the
    /// direct reply-to pseudo-queue.
    fn core_of(&self, queue: &QueueRef) -> Option<u32> {
        let here = queue.owner_node == self.core.shared.meta.node_id() && queue.owner_core != DIRECT_CORE;
        here.then(|| queue.owner_core % self.core.shared.cores)
    }

    /// [`Session::core_of`], when it is not this connection's own core: where a move would go.
    fn other_core_of(&self, queue: &QueueRef) -> Option<u32> {
        self.core_of(queue).filter(|&c| c != self.core.id)
    }

    /// Called by the reader between two frames once a move is due: true when the reader
    /// should stop and give up its buffer (the writer was asked to pause); false when the
    /// connection no longer may move, and the move is called off. `holders`: how many hold
    /// the session when only the connection's two halves run (a method's task still waiting
    /// for a reply would be one more).
    pub(super) fn start_move(self: &Rc<Self>, holders: usize) -> bool {
        let mut st = self.st.borrow_mut();
        let to = st.handoff.to.filter(|_| st.handoff.consuming);
        let on_target = |q: &QueueRef| self.core_of(q) == to;
        if !settled(&st, to.map(|_| &on_target as &dyn Fn(&QueueRef) -> bool)) || Rc::strong_count(self) != holders {
            st.handoff.call_off();
            return false;
        }
        st.handoff.pausing = true;
        drop(st);
        // Wakes the writer, which sees the move and pauses after writing what it has.
        let _ = self.tx.send(ClientEvent::Frames(Vec::new()));
        true
    }
}

/// Whether the connection holds nothing that ties it to its core (module doc). `consuming`:
/// the move follows its consumers, each of whose queues it must accept; without it, a
/// consumer or an unsettled delivery ties the connection.
fn settled(st: &ConnState, consuming: Option<&dyn Fn(&QueueRef) -> bool>) -> bool {
    let consumers_go = |c: &crate::amqp::channel::Channel| match consuming {
        None => c.consumers.is_empty() && c.ledger.is_empty(),
        Some(goes) => c.consumers.values().all(|x| goes(&x.queue)),
    };
    st.closing.is_none()
        && !st.finish
        && !st.linger
        && !st.peer_gone
        && !st.blocked
        && (consuming.is_none() || !st.published)
        && st.exclusive_queues.is_empty()
        && st.channels.values().all(|c| {
            c.state == crate::amqp::channel::ChannelState::Open
                && consumers_go(c)
                && c.tx.is_none()
                && c.reply_to.is_none()
                && c.publish.is_none()
        })
}

/// Carries out a move the reader and writer stopped for: duplicates the socket's descriptor
/// (`fd`, open until the caller drops its halves, after this returns), takes the session
/// apart and sends it with `rx` and `leftover` (bytes read and not yet taken) to the target
/// core. When it cannot (no descriptor left, or a task still holds the session) the move is
/// called off and the session and bytes come back: the caller goes on with them here.
pub(super) fn send_away(
    core: &Rc<Node>,
    session: Rc<Session>,
    fd: RawFd,
    rx: flume::Receiver<ClientEvent>,
    leftover: BytesMut,
) -> Result<(), (Rc<Session>, BytesMut)> {
    let to = session.st.borrow().handoff.to;
    let Some(to) = to else { return Err((session, leftover)) };
    let s = match Rc::try_unwrap(session) {
        Ok(s) => s,
        Err(session) => {
            session.st.borrow_mut().handoff.call_off();
            return Err((session, leftover));
        }
    };
    // SAFETY: `fd` is the connection's socket, open until the caller drops its halves.
    let dup = match unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!(conn = %s.id, error = %e, "connection stays on its core: its socket cannot be duplicated");
            s.st.borrow_mut().handoff.call_off();
            return Err((Rc::new(s), leftover));
        }
    };
    let Session { core: _, id, tx, pending_bytes, credit, st, unblocked, unblocked_rx, movable: _ } = s;
    let mut st = st.into_inner();
    st.handoff.call_off();
    st.handoff.moved_at = Some(Instant::now());
    let m = Migrant { stream: std::net::TcpStream::from(dup), id, tx, rx, pending_bytes, credit, st, unblocked, unblocked_rx, leftover };
    core.conns.borrow_mut().remove(&id);
    Stats::add(&core.stats().connections_moved, 1);
    tracing::debug!(conn = %id, from = core.id, to, "connection moves to its queues' core");
    let work = OnCore(Box::new(move |node: &Rc<Node>| {
        crate::core::spawn_soon(adopt(node.clone(), m));
    }));
    if core.shared.inboxes.send(to as usize, NodeMsg::Run(work)).is_err() {
        tracing::warn!(conn = %id, to, "connection lost in a move: the target core stopped");
    }
    Ok(())
}

/// Goes on with a connection that moved here ([`send_away`]).
async fn adopt(core: Rc<Node>, m: Migrant) {
    let Migrant { stream, id, tx, rx, pending_bytes, credit, st, unblocked, unblocked_rx, leftover } = m;
    let stream = crate::core::accept::into_glommio(stream);
    core.conns.borrow_mut().insert(id, tx.clone());
    core.shared.clients.moved(id, core.id);
    let published = st.published;
    let session = Rc::new(Session {
        core: core.clone(),
        id,
        tx,
        pending_bytes,
        credit,
        st: std::cell::RefCell::new(st),
        unblocked,
        unblocked_rx,
        movable: true,
    });
    // An alarm raised while it travelled was told to the cores' connections, not to it.
    if published && core.shared.alarms.publishers_blocked() {
        session.set_blocked(true, None);
    }
    super::live(core, stream, session, rx, leftover).await;
}

/// The descriptor a movable transport can be handed on with.
pub(super) fn raw_fd<S: Transport>(stream: &S) -> Option<RawFd> {
    S::MOVABLE.then(|| stream.tcp().as_raw_fd())
}
