//! The metadata group's side of the network: what the driver sends through, what the
//! transport feeds back, and the figures the cluster metrics show.
//!
//! `meta` names no transport: the wiring (`server.rs`/`main.rs`) connects a
//! `cluster::Transport` to these two ends. Outbound, the driver hands raft-rs's messages to a
//! [`RaftNet`]; inbound, the transport calls a [`NetInbox`] for every received message and
//! for every failed send and finished snapshot (raft-rs's driver contract:
//! `report_unreachable`, `report_snapshot`).

use std::sync::Arc;

use raft::eraftpb::Message;

use super::driver::Request;
use super::topology::NodeId;

/// Where the driver sends raft-rs's messages (a `cluster::Transport` in a cluster).
///
/// `send` must not block on the network: a message that cannot go is dropped and reported
/// back through [`NetInbox::unreachable`] (raft-rs retransmits). A `MsgSnapshot` must end in
/// exactly one [`NetInbox::snapshot_done`] for its `to`.
pub trait RaftNet: Send + Sync {
    /// Queues `msgs` for their `to` nodes.
    fn send(&self, msgs: Vec<Message>);

    /// Node `id`, listening at `addr` (as given in its join request), became a voter: send to
    /// it from now on. Called on the driver thread, also for the changes a restart replays;
    /// must not block. The default does nothing (a network that knows every node).
    fn add_peer(&self, id: NodeId, addr: &str) {
        let _ = (id, addr);
    }

    /// The group's voters are `voters`: stop talking to the peers that are none (nodes the
    /// group removed; `members.rs`). Called on the driver thread at start, on a snapshot from
    /// the leader and after a removal applies; must not block. The default does nothing.
    fn retain_peers(&self, voters: &[NodeId]) {
        let _ = voters;
    }

    /// The voters a running node that knows a leader names, asked over the network (blocks
    /// for a few seconds at most); `None` when none answered. Asked while this node waits
    /// for a majority at start: a node the group removed (`--forget-node`) learns so at once
    /// instead of waiting out the start timeout. The default knows nothing.
    fn voters_elsewhere(&self) -> Option<Vec<NodeId>> {
        None
    }
}

/// A cluster's shape as the metadata group sees it.
#[derive(Clone)]
pub struct ClusterSpec {
    /// The voters to start a fresh data directory with: every node of the `--peers` list, this
    /// one included; for a node joining a running group (`joining`), the voters that group was
    /// formed with (this node not among them).
    pub voters: Vec<NodeId>,
    /// This node joins a running group: it starts as no voter and becomes one when the group
    /// applies its `MemberChange::Add` (`members.rs`).
    pub joining: bool,
    /// The outbound side of the transport.
    pub net: Arc<dyn RaftNet>,
}

impl std::fmt::Debug for ClusterSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSpec").field("voters", &self.voters).finish_non_exhaustive()
    }
}

/// The inbound side: cheap to clone, `Send + Sync`. A received message queues a request for
/// the driver (blocking briefly when its queue of 65,536 requests is full: backpressure on the
/// sending peer's connection). Reports never block and are never lost: they go to a queue of
/// their own, unbounded, which the driver drains every iteration (≤ 100 ms later) — a
/// transport may report from inside [`RaftNet::send`], on the driver's own thread, and a
/// lost snapshot report would freeze replication to that peer. Calls after the driver
/// stopped are dropped.
#[derive(Clone, Debug)]
pub struct NetInbox {
    pub(super) tx: flume::Sender<Request>,
    pub(super) reports: flume::Sender<Request>,
}

/// The driver's end of a [`NetInbox`], handed to [`MetaHandle::start_cluster`](super::MetaHandle::start_cluster).
#[derive(Debug)]
pub struct NetInboxRx {
    pub(super) tx: flume::Sender<Request>,
    pub(super) rx: flume::Receiver<Request>,
    pub(super) reports: flume::Receiver<Request>,
}

/// Capacity of the driver's request queue (requests).
pub(super) const REQUEST_QUEUE: usize = 1 << 16;

/// A new inbox pair: give the [`NetInbox`] to the transport's callbacks and the
/// [`NetInboxRx`] to [`MetaHandle::start_cluster`](super::MetaHandle::start_cluster).
pub fn inbox() -> (NetInbox, NetInboxRx) {
    let (tx, rx) = flume::bounded(REQUEST_QUEUE);
    let (reports_tx, reports) = flume::unbounded();
    (NetInbox { tx: tx.clone(), reports: reports_tx }, NetInboxRx { tx, rx, reports })
}

impl NetInbox {
    /// A message received from a peer: raft-rs `step`s it.
    pub fn step(&self, msg: Message) {
        let _ = self.tx.send(Request::Step(Box::new(msg)));
    }

    /// A message to `to` could not be sent: raft-rs's `report_unreachable(to)`.
    pub fn unreachable(&self, to: NodeId) {
        let _ = self.reports.send(Request::Unreachable(to));
    }

    /// A snapshot to `to` was sent completely (`ok`) or failed: raft-rs's `report_snapshot`.
    pub fn snapshot_done(&self, to: NodeId, ok: bool) {
        let _ = self.reports.send(Request::SnapshotDone { to, ok });
    }
}

/// Raft role of this node, as raft-rs reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Role {
    /// Follows a leader (or waits for one).
    #[default]
    Follower,
    /// Campaigning (pre-vote, raft-rs's `PreCandidate`).
    PreCandidate,
    /// Campaigning (vote).
    Candidate,
    /// Leads the group.
    Leader,
}

impl Role {
    /// Lower-case name for logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Role::Follower => "follower",
            Role::PreCandidate => "pre_candidate",
            Role::Candidate => "candidate",
            Role::Leader => "leader",
        }
    }
}

/// One peer's replication state, as the leader sees it (raft-rs's `Progress`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerProgress {
    /// The peer's node id.
    pub id: NodeId,
    /// Highest log index known to be replicated on it.
    pub matched: u64,
    /// Entries it lacks: the leader's last index − `matched`.
    pub lag: u64,
    /// Heard from within the last election timeout (check_quorum's view).
    pub recent_active: bool,
}

/// The metadata group's state for `/metrics` and logs; refreshed by the driver after every
/// loop iteration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterFigures {
    /// Voters of the group (this node included).
    pub voters: Vec<NodeId>,
    /// Current Raft term.
    pub term: u64,
    /// Current leader (0: none known).
    pub leader: NodeId,
    /// This node's role.
    pub role: Role,
    /// Highest committed log index known here.
    pub commit_index: u64,
    /// Highest log index applied to the state here.
    pub applied_index: u64,
    /// Index of the last entry written to this node's log (RabbitMQ's `last_written_index`).
    pub last_index: u64,
    /// Index of the snapshot this node's log starts after (0: none).
    pub snapshot_index: u64,
    /// Time from the first request of this node's latest applied proposal to its
    /// application here, µs (RabbitMQ's `commit_latency`; 0 before any).
    pub commit_latency_us: u64,
    /// Times the known leader changed since start (to another node or to none).
    pub leader_changes: u64,
    /// Per peer progress; filled on the leader only (empty elsewhere).
    pub peers: Vec<PeerProgress>,
}
