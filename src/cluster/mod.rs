//! The node-to-node transport of raft-rs messages and opaque data (DESIGN.md, "Cluster").
//!
//! Owns the TCP links between the nodes of a static cluster: it carries raft-rs
//! `eraftpb::Message`s from the local Raft driver to its peers' drivers and reports what
//! raft-rs must hear about failed sends and snapshots; beside them, on lanes of their own,
//! opaque byte payloads (the broker's forwarded queue operations) and whether each peer's data
//! link is usable. It knows nothing of what the group replicates or what the payloads mean and
//! imports nothing else of the crate.
//!
//! # Layout
//! - `frame.rs`: the wire format (length-prefixed frames with a kind byte, the handshake, raft
//!   messages, snapshot chunks); pure, unit-tested.
//! - `link.rs`: socket options and the handshake, both sides (dial and accept).
//! - `outbound.rs`: per peer, the raft-lane writer thread and the snapshot sender thread.
//! - `data.rs`: per peer, the data link's state (sessions, `on_link`), the data-lane writer
//!   thread, and the reader of an accepted data lane.
//! - `inbound.rs`: the listener thread and one reader thread per accepted connection.
//! - `transport.rs`: [`Transport`]: start, send, send_data, status, shutdown, and the state the
//!   threads share.
//! - `tests.rs`, `data_tests.rs` (tests only): two and three transports over loopback.
//!
//! # Lanes
//! Between nodes A and B there are up to six TCP connections, each one way for data:
//! A's raft lane to B (opened and written by A's writer thread for B), B's raft lane to A, a
//! snapshot lane each way, opened per snapshot message and closed after it, and a data lane
//! each way (opened and written by A's data writer thread for B, and B's for A). Each
//! connection starts with a [`frame::Hello`] each way: the dialer's, then the acceptor's
//! answer. A data-lane flood never delays a heartbeat: the lanes share no connection, queue,
//! buffer or thread.
//!
//! # Data lane
//! [`Transport::send_data`] queues an opaque payload (at most [`frame::MAX_FRAME_BYTES`]) on
//! the peer's bounded data queue ([`TransportConfig::data_queue_capacity`] payloads); the
//! peer's data writer drains it in batches as the raft writer does. The receiver hands each
//! payload to `on_data` ([`OnData`]), in the order it was sent.
//!
//! The *data link* to a peer is up while this node's outbound data lane to it is up and an
//! inbound data lane from it is connected; `on_link` ([`OnLink`]) hears every change, once
//! (`data.rs` has the details). When the link goes down the transport closes both data
//! connections, so the peer's link goes down too: a session is a pair of connections, seen
//! by both nodes, and payloads accepted in one are never written in another. A peer's death
//! shows at once when its sockets close (its process exits or is killed, its transport shuts
//! down); a silent peer (a host gone, a cable pulled) within about [`DATA_LINK_TIMEOUT`]
//! (keepalive and TCP_USER_TIMEOUT: 5.1 s measured with loopback taken down); a peer whose
//! kernel keeps the connection open but whose process says nothing (SIGSTOP, a hung disk)
//! within 5 s (`data::SILENCE_LIMIT`): a writer with nothing to send sends an empty frame (a
//! heartbeat, never handed to `on_data`) every half second, and a reader that hears nothing
//! for that long ends the link.
//!
//! # Invariants
//! 1. [`Transport::send`] never blocks: a message goes to a bounded per-peer queue or is
//!    dropped; a dropped raft message (queue full, link down, not encodable, lost with a
//!    failed write) is reported as [`Report::Unreachable`] for its destination (raft-rs's
//!    `report_unreachable`).
//! 2. Every `MsgSnapshot` passed to `send` ends in exactly one [`Report::SnapshotFinished`] or
//!    [`Report::SnapshotFailed`] for its destination (raft-rs's `report_snapshot`): Finished
//!    once every chunk is written and flushed and the receiver acknowledged the reassembled
//!    message; Failed on any error, on a full snapshot queue, or at shutdown.
//! 3. Nothing is buffered for a lane that is down: raft messages are sent only on a link that
//!    completed its handshake, and whatever was queued when it broke is dropped (stale
//!    heartbeats and appends help no one; raft-rs resends from its log).
//! 4. A connection delivers messages only after its handshake showed the right `to` (this
//!    node), a known `from` (not this node) and this protocol version; the dialer checks the
//!    answer the same way, which also catches a socket connected to itself.
//! 5. Messages from one peer's raft lane reach `on_message` in the order that peer sent them;
//!    a newer raft lane from the same peer replaces (closes) the older one.
//! 6. No read allocates more than [`frame::MAX_FRAME_BYTES`] for a frame, or more than
//!    [`frame::MAX_SNAPSHOT_BYTES`] for a snapshot, and memory grows only as bytes arrive.
//! 7. [`Transport::send_data`] never blocks and buffers nothing for a data lane that is down:
//!    it fails with [`DataError::Down`]; whatever was queued when the lane went down is
//!    dropped (counted in [`PeerStatus::data_dropped`]), never sent on a later connection.
//! 8. Payloads from one peer reach `on_data` in the order that peer sent them, each whole; a
//!    newer data lane from the same peer replaces (closes) the older one, ending its session.
//! 9. `on_link` reports for one peer alternate strictly, starting with `true`; every `true`
//!    is followed by a `false` (at the latest when either transport shuts down).
//!
//! # Assumptions
//! - Plain std threads: `on_message` and `on_report` are called on transport threads (and
//!   `on_report` also inside [`Transport::send`], on the caller's thread). They must not block
//!   for long; a slow `on_message` is backpressure on that peer's lane only. The same holds
//!   for `on_data` and `on_link`, with a bound: a data lane whose receiver reads nothing for
//!   [`DATA_LINK_TIMEOUT`] is dropped by the sender's kernel (Linux applies TCP_USER_TIMEOUT to
//!   a zero window), so `on_data` must not block that long.
//! # Membership
//! The peers given at start are the first; [`Transport::add_peer`] adds one at run time (a
//! node that joined the cluster), none is ever taken away (a removed node's lanes keep
//! dialing, with backoff, until this node restarts without it). An *admin lane* is the one
//! lane a node that is not a peer may open: one request, one answer ([`admin_request`],
//! [`OnAdmin`]) — how a new node asks to join.
//!
//! # Assumptions (continued)
//! - Peers are trusted once the handshake passes (no TLS, no authentication): the cluster port
//!   belongs on a private network.
//! - Linux sockets (TCP_USER_TIMEOUT, keepalive options, shutdown(2) waking blocked calls).

mod data;
#[cfg(test)]
mod data_tests;
pub mod frame;
mod inbound;
mod link;
mod outbound;
#[cfg(test)]
mod tests;
mod transport;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use transport::Transport;

/// A Raft node id, as raft-rs uses them (never 0).
pub type NodeId = u64;

/// Default per-peer queue capacity of the raft lane, in messages.
pub const DEFAULT_QUEUE_CAPACITY: usize = 4096;
/// Default size of one snapshot chunk, in bytes (1 MiB).
pub const DEFAULT_SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;
/// Default per-peer queue capacity of the data lane, in payloads.
pub const DEFAULT_DATA_QUEUE_CAPACITY: usize = 65_536;
/// About how long a silent peer (no answer at all, not even from its kernel) keeps its data
/// link up: the data lanes' TCP_USER_TIMEOUT, also what their keepalive probes run into.
pub const DATA_LINK_TIMEOUT: Duration = link::DATA_USER_TIMEOUT;

/// Receives each data-lane payload: the peer it came from and the bytes, in the order that
/// peer sent them. Called on a reader thread (one per peer); blocking in it is backpressure on
/// that peer's data lane only, up to [`DATA_LINK_TIMEOUT`].
pub type OnData = Arc<dyn Fn(NodeId, Vec<u8>) + Send + Sync>;
/// Hears each change of a peer's data link (module doc, "Data lane"): `true` once both data
/// lanes with the peer are up, `false` when either breaks, closes or is replaced (and at
/// shutdown). Called on transport threads under the peer's link lock: it must not block for
/// long nor call [`Transport::shutdown`]; [`Transport::send_data`], [`Transport::data_up`] and
/// [`Transport::peers`] are fine.
pub type OnLink = Arc<dyn Fn(NodeId, bool) + Send + Sync>;
/// Answers one admin request (an admin lane, [`frame::Lane::Admin`]): the node that sent it
/// (any id, 0 for a tool; not necessarily a peer) and the request's bytes; returns the answer's
/// bytes. Called on the connection's own reader thread: it may block (the requester waits
/// with its own timeout).
pub type OnAdmin = Arc<dyn Fn(NodeId, Vec<u8>) -> Vec<u8> + Send + Sync>;

/// Sends one admin request as node `from` (0 for a tool) to node `to` listening at `addr`,
/// and returns the answer (what that node's [`OnAdmin`] returned; empty when it has none).
/// Needs no [`Transport`]: a node that is no peer yet, or a command-line tool, calls it.
///
/// # Errors
/// A text saying what failed: connect, handshake (another node at `addr`), I/O, or no
/// answer within `timeout` (applied to each step).
pub fn admin_request(addr: SocketAddr, from: NodeId, to: NodeId, request: &[u8], timeout: Duration) -> Result<Vec<u8>, String> {
    link::admin_exchange(addr, from, to, request, timeout).map_err(|e| e.to_string())
}

/// What the driver must tell raft-rs about a send (raft-rs's driver contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Report {
    /// A message to this node was dropped: call `RawNode::report_unreachable`.
    Unreachable(NodeId),
    /// A snapshot message to this node was delivered: call `RawNode::report_snapshot` with
    /// `SnapshotStatus::Finish`.
    SnapshotFinished(NodeId),
    /// A snapshot message to this node was not delivered: call `RawNode::report_snapshot` with
    /// `SnapshotStatus::Failure`.
    SnapshotFailed(NodeId),
}

/// How [`Transport::start`] sets up this node's links.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportConfig {
    /// This node's id (must be a key of `peers`).
    pub me: NodeId,
    /// The address to listen on for peers' connections (may differ from `peers[me]`, e.g.
    /// `0.0.0.0:port`).
    pub listen: SocketAddr,
    /// Every voter's id and cluster address, this node included.
    pub peers: BTreeMap<NodeId, SocketAddr>,
    /// Raft-lane queue capacity per peer, in messages (default [`DEFAULT_QUEUE_CAPACITY`]);
    /// a message sent while the queue is full is dropped and reported.
    pub queue_capacity: usize,
    /// Size of one snapshot chunk, in bytes (default [`DEFAULT_SNAPSHOT_CHUNK_BYTES`]; at most
    /// [`frame::MAX_CHUNK_DATA`]).
    pub snapshot_chunk_bytes: usize,
    /// Data-lane queue capacity per peer, in payloads (default
    /// [`DEFAULT_DATA_QUEUE_CAPACITY`]); [`Transport::send_data`] to a full queue fails with
    /// [`DataError::Full`]. It bounds the count, not the bytes: the caller bounds those.
    pub data_queue_capacity: usize,
}

impl TransportConfig {
    /// A configuration with the default queue capacities and chunk size.
    pub fn new(me: NodeId, listen: SocketAddr, peers: BTreeMap<NodeId, SocketAddr>) -> TransportConfig {
        TransportConfig {
            me,
            listen,
            peers,
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            snapshot_chunk_bytes: DEFAULT_SNAPSHOT_CHUNK_BYTES,
            data_queue_capacity: DEFAULT_DATA_QUEUE_CAPACITY,
        }
    }
}

/// The state of the links to one peer ([`Transport::peers`]). Counters are since start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStatus {
    /// The peer's node id.
    pub id: NodeId,
    /// The peer's cluster address.
    pub addr: SocketAddr,
    /// Whether the outbound raft lane to the peer is up (handshake done, no write failed since).
    pub connected: bool,
    /// Raft messages written to the raft lane (and flushed).
    pub sent: u64,
    /// Writes on the raft lane: each drains the queue into one buffer, then one `write_all`
    /// and flush, so `sent / writes` is the mean batch size.
    pub writes: u64,
    /// Raft messages dropped (queue full, link down, failed write, not encodable).
    pub dropped: u64,
    /// Snapshot messages delivered ([`Report::SnapshotFinished`]).
    pub snapshots_sent: u64,
    /// Snapshot messages that failed ([`Report::SnapshotFailed`]).
    pub snapshots_failed: u64,
    /// Whether the outbound data lane to the peer is up ([`Transport::data_up`]).
    pub data_up: bool,
    /// Whether the data link with the peer is up (the value last reported to `on_link`).
    pub data_link: bool,
    /// Data payloads written to the data lane (and flushed).
    pub data_sent: u64,
    /// Writes on the data lane (`data_sent / data_writes` is the mean batch size).
    pub data_writes: u64,
    /// Data payloads accepted by [`Transport::send_data`] but never written: queued when the
    /// lane went down, or lost with a failed write. (Refused sends are the caller's errors.)
    pub data_dropped: u64,
}

/// Why [`Transport::send_data`] refused a payload (nothing was queued).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DataError {
    /// The destination is not a peer of this node.
    #[error("no such peer")]
    UnknownPeer,
    /// The outbound data lane to the peer is not up (or the transport is shut down).
    #[error("data lane to the peer is down")]
    Down,
    /// The peer's data queue holds `data_queue_capacity` payloads.
    #[error("data queue to the peer is full")]
    Full,
    /// The payload exceeds [`frame::MAX_FRAME_BYTES`].
    #[error("payload exceeds the frame limit")]
    TooLarge,
}

/// Errors of [`Transport::start`]. Link failures after start are not errors: they are logged
/// and show as reports and [`PeerStatus`].
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The listen address could not be bound (in use, not local, no permission).
    #[error("cluster transport: bind {addr}: {source}")]
    Bind {
        /// The address from [`TransportConfig::listen`].
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The configuration is unusable (the message says why).
    #[error("cluster transport: bad configuration: {0}")]
    Config(String),
    /// A transport thread could not be spawned.
    #[error("cluster transport: spawn thread {name}: {source}")]
    Spawn {
        /// The thread's name.
        name: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}
