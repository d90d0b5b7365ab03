//! The node-to-node transport of raft-rs messages (DESIGN.md, "Cluster").
//!
//! Owns the TCP links between the nodes of a static cluster: it carries raft-rs
//! `eraftpb::Message`s from the local Raft driver to its peers' drivers and reports what
//! raft-rs must hear about failed sends and snapshots. It knows nothing of what the group
//! replicates and imports nothing else of the crate.
//!
//! # Layout
//! - `frame.rs`: the wire format (length-prefixed frames with a kind byte, the handshake, raft
//!   messages, snapshot chunks); pure, unit-tested.
//! - `link.rs`: socket options and the handshake, both sides (dial and accept).
//! - `outbound.rs`: per peer, the raft-lane writer thread and the snapshot sender thread.
//! - `inbound.rs`: the listener thread and one reader thread per accepted connection.
//! - `transport.rs`: [`Transport`]: start, send, status, shutdown, and the state the threads
//!   share.
//! - `tests.rs` (tests only): two and three transports over loopback.
//!
//! # Lanes
//! Between nodes A and B there are up to four TCP connections, each one way for data:
//! A's raft lane to B (opened and written by A's writer thread for B), B's raft lane to A, and
//! a snapshot lane each way, opened per snapshot message and closed after it. Each connection
//! starts with a [`frame::Hello`] each way: the dialer's, then the acceptor's answer.
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
//!
//! # Assumptions
//! - Plain std threads: `on_message` and `on_report` are called on transport threads (and
//!   `on_report` also inside [`Transport::send`], on the caller's thread). They must not block
//!   for long; a slow `on_message` is backpressure on that peer's lane only.
//! - Peers are trusted once the handshake passes (no TLS, no authentication): the cluster port
//!   belongs on a private network.
//! - Linux sockets (TCP_USER_TIMEOUT, keepalive options, shutdown(2) waking blocked calls).

pub mod frame;
mod inbound;
mod link;
mod outbound;
#[cfg(test)]
mod tests;
mod transport;

use std::collections::BTreeMap;
use std::net::SocketAddr;

pub use transport::Transport;

/// A Raft node id, as raft-rs uses them (never 0).
pub type NodeId = u64;

/// Default per-peer queue capacity of the raft lane, in messages.
pub const DEFAULT_QUEUE_CAPACITY: usize = 4096;
/// Default size of one snapshot chunk, in bytes (1 MiB).
pub const DEFAULT_SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

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
}

impl TransportConfig {
    /// A configuration with the default queue capacity and chunk size.
    pub fn new(me: NodeId, listen: SocketAddr, peers: BTreeMap<NodeId, SocketAddr>) -> TransportConfig {
        TransportConfig { me, listen, peers, queue_capacity: DEFAULT_QUEUE_CAPACITY, snapshot_chunk_bytes: DEFAULT_SNAPSHOT_CHUNK_BYTES }
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
