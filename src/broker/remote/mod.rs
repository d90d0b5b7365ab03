//! Serving a queue from any node (DESIGN.md, "Cluster": any node serves any queue): the
//! client's node (A) forwards every operation on a queue whose store is on another node (B)
//! over the cluster transport's data lane, and hands what comes back to its connections.
//! Delivery tags stay per channel on A; routing happens on A (the routing tables are the
//! replicated metadata); B runs the operation on the queue's core as if a local connection
//! had sent it.
//!
//! # Layout
//! - [`wire`]: the frames ([`wire::Frame`]) and their binary form.
//! - `client.rs`: A's side: [`Remote::forward`] turns a [`QueueOp`] into a request and keeps
//!   what the answer needs (reply channels, each connection's event channel, its remote
//!   consumers and unanswered confirms); events and replies from B go to them.
//! - `owner.rs`: B's side, on the queue's core: a proxy per remote connection (an event
//!   channel whose events a task sends back to A), local ids for A's connections and
//!   consumers, and the answers to A's requests.
//!
//! # Invariants
//! 1. One lane per pair of nodes carries a connection's operations in order, and B runs
//!    them on the queue's core in that order, so a connection's operations on one queue keep
//!    the order they have on a single node.
//! 2. A publish is confirmed only by B's queue (its `Stored` event): nothing stored on B, no
//!    confirm on A (DESIGN.md rule 9). A publish that cannot be sent is nacked at once, but
//!    for invariant 6.
//! 3. When the lane to a peer goes down, each side acts at once, not after a timeout: B
//!    requeues everything A's channels held (their channels are closed as far as B knows);
//!    A nacks the confirms B had not answered, answers A's waiting requests with an error,
//!    and cancels its consumers of B's queues (basic.cancel to clients that asked for it),
//!    but for those of replicated queues (invariant 6).
//! 4. B never runs an operation on a queue it does not own: the metadata decides (the
//!    queue's `owner_node`).
//! 5. A publish's credit (`broker::credit`) stays on A until B answers `Event::Taken` for it:
//!    B counts the releases of the credit its queues took for A's connection, whatever became
//!    of the publish (stored, proposed, refused, a direct reply-to), and A gives back as
//!    many; a lost link gives back all A held for that peer.
//! 6. A publish to a replicated queue whose serving node is out of reach waits on A, in
//!    order, until the metadata names a server in reach (a failover), and goes there; it is
//!    nacked only after [`PARK_LIMIT`]. A consumer of such a queue is not cancelled: it
//!    follows the queue to its next server (`failover.rs`).

mod client;
mod failover;
mod owner;
pub mod wire;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::node::NodeMsg;
use super::{QueueKey, QueueRef};
use crate::core::mesh::Inboxes;
use crate::meta::{MetaHandle, NodeId};

pub use client::ClientSide;
pub use failover::PARK_LIMIT;
pub use owner::OwnerSide;

/// The data lane as the broker sees it (a `cluster::Transport` in a cluster).
pub trait DataNet: Send + Sync {
    /// Queues `payload` for `to`; never blocks. Errors: the lane is down, its queue is full,
    /// or `to` is no peer (the text says which).
    fn send(&self, to: NodeId, payload: Vec<u8>) -> Result<(), String>;
}

/// One node's forwarding state, shared by its cores and the transport's reader threads.
pub struct Remote {
    /// This node's id.
    pub me: NodeId,
    net: Arc<dyn DataNet>,
    meta: MetaHandle,
    inboxes: Inboxes<NodeMsg>,
    cores: u32,
    next_req: AtomicU64,
    /// A's side.
    pub(crate) client: Mutex<ClientSide>,
    /// B's side.
    pub(crate) owner: Mutex<OwnerSide>,
    /// Peers whose data link is up in both directions (`on_link`): requests go only to
    /// them, so the answer always has a lane back (a request sent while only the lane out
    /// was up could be answered into a lane not yet open, and its confirm lost).
    links: Mutex<std::collections::HashSet<NodeId>>,
    /// This node's direct reply-to consumers: replies from peers go straight to them.
    reply_to: Arc<crate::broker::reply_to::ReplyConsumers>,
    /// How many operations are parked (`failover.rs`), for a check without the lock.
    parked_count: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote").field("me", &self.me).finish_non_exhaustive()
    }
}

/// Where the transport's callbacks find the node's [`Remote`] once the broker is up. Peers
/// may send requests as soon as the lane is up, before this node has made its `Remote`: what
/// arrives before is kept, in order (up to 65,536 frames and link changes), and handed over
/// when it is set.
#[derive(Default)]
pub struct RemoteSlot {
    remote: OnceLock<Arc<Remote>>,
    early: Mutex<Vec<Early>>,
}

/// A callback that came before the [`Remote`] existed.
enum Early {
    Payload(NodeId, Vec<u8>),
    Link(NodeId, bool),
}

/// Most callbacks kept before the [`Remote`] exists.
const MAX_EARLY: usize = 1 << 16;

impl Early {
    fn hand_to(self, remote: &Remote) {
        match self {
            Early::Payload(from, p) => remote.on_payload(from, p),
            Early::Link(peer, up) => remote.on_link(peer, up),
        }
    }
}

impl RemoteSlot {
    /// The transport's `on_data`.
    pub fn payload(&self, from: NodeId, payload: Vec<u8>) {
        self.hand(Early::Payload(from, payload));
    }

    /// The transport's `on_link`.
    pub fn link(&self, peer: NodeId, up: bool) {
        self.hand(Early::Link(peer, up));
    }

    /// Hands `e` to the [`Remote`], or keeps it until there is one (payloads: at most
    /// [`MAX_EARLY`] kept; link changes always, so none is lost).
    fn hand(&self, e: Early) {
        if let Some(r) = self.remote.get() {
            return e.hand_to(r);
        }
        let mut early = self.early.lock();
        match self.remote.get() {
            Some(r) => {
                drop(early);
                e.hand_to(r);
            }
            None if matches!(e, Early::Link(..)) || early.len() < MAX_EARLY => early.push(e),
            None => {
                if let Early::Payload(from, _) = e {
                    tracing::warn!(from, "frame from a peer dropped: this node is still starting");
                }
            }
        }
    }

    /// Sets the node's [`Remote`] (once) and hands it what came before, in order.
    pub fn set(&self, remote: Arc<Remote>) {
        let mut early = self.early.lock();
        if self.remote.set(remote.clone()).is_err() {
            return;
        }
        for e in early.drain(..) {
            e.hand_to(&remote);
        }
    }
}

impl Remote {
    /// Forwarding state for node `me` with `cores` cores; replies to `reply_to`'s names
    /// are handed to them.
    pub fn new(
        me: NodeId,
        net: Arc<dyn DataNet>,
        meta: MetaHandle,
        inboxes: Inboxes<NodeMsg>,
        cores: u32,
        reply_to: Arc<crate::broker::reply_to::ReplyConsumers>,
    ) -> Remote {
        Remote {
            reply_to,
            me,
            net,
            meta,
            inboxes,
            cores: cores.max(1),
            next_req: AtomicU64::new(1),
            client: Mutex::new(ClientSide::default()),
            owner: Mutex::new(OwnerSide::default()),
            links: Mutex::new(Default::default()),
            parked_count: Default::default(),
        }
    }

    /// A payload arrived from peer `from` (on a transport thread). Requests go to the queue's
    /// core; events and replies to this node's connections. A frame that does not decode is
    /// logged and dropped (peers run the same version).
    pub fn on_payload(&self, from: NodeId, payload: Vec<u8>) {
        let bytes = bytes::Bytes::from(payload);
        match wire::decode_bytes(&bytes) {
            Ok(wire::Frame::Request(req)) => self.route_request(from, req),
            Ok(wire::Frame::Event { conn, event }) => self.client_event(from, conn, event),
            Ok(wire::Frame::Reply { req, reply }) => self.client_reply(req, reply),
            Err(e) => tracing::warn!(from, error = %e, "undecodable frame from a peer dropped"),
        }
    }

    /// The data lane to `peer` went down (`false`) or up (invariant 3).
    pub fn on_link(&self, peer: NodeId, up: bool) {
        if up {
            self.links.lock().insert(peer);
        } else {
            self.links.lock().remove(&peer);
        }
        if up {
            tracing::info!(peer, "data lane to node {peer} is up: its queues are served from here again");
            return;
        }
        tracing::warn!(
            peer,
            "data lane to node {peer} is down: requeueing what its clients held here; consumers of its replicated queues wait to follow them to their next server, consumers of its other queues are cancelled"
        );
        self.client_link_down(peer);
        self.owner_link_down(peer);
    }

    /// Sends a request (A's side): only over a link up in both directions.
    fn send_request(&self, to: NodeId, frame: &wire::Frame) -> Result<(), String> {
        if !self.links.lock().contains(&to) {
            return Err(format!("data link to node {to} is not up in both directions"));
        }
        self.send_frame(to, frame)
    }

    fn send_frame(&self, to: NodeId, frame: &wire::Frame) -> Result<(), String> {
        let mut out = Vec::with_capacity(64);
        wire::encode(frame, &mut out);
        self.net.send(to, out)
    }

    fn next_req(&self) -> u64 {
        self.next_req.fetch_add(1, Ordering::Relaxed)
    }

    /// This node's reference to queue `key` when this node owns it.
    fn own_queue(&self, key: &QueueKey) -> Option<QueueRef> {
        let topo = self.meta.topology();
        let def = topo.queue(&key.vhost, &key.name)?;
        (def.owner_node == self.me).then(|| QueueRef::of(def, self.cores))
    }
}
