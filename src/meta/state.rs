//! The metadata state machine: topology (vhosts, exchanges, queues, bindings), one cursor per
//! queue, and the boot epoch of every node.
//!
//! Pure and deterministic: [`MetaState::apply`] reads nothing but its arguments (no clock, no
//! randomness, no I/O), so every replica that applies the same committed [`Command`]s in the same
//! order holds the same state (DESIGN.md, "Metadata and the embedded Raft group").
//!
//! # Invariants
//! 1. Every queue in `topology.queues` has exactly one entry in `cursors`, and every cursor belongs
//!    to a queue (a new queue's cursor starts at offset 0; deleting the queue deletes it).
//! 2. Every binding's source exchange exists, and so does its destination (queue or exchange):
//!    deleting an object deletes every binding that names it, in either role.
//! 3. No two bindings are equal (vhost, source, dest_kind, dest, routing_key, arguments).
//! 4. A cursor only changes through [`Command::CursorCas`] whose `expected` equals the stored
//!    value (compare-and-set; DESIGN.md, "Cursor writes are conditional"), and through
//!    [`Command::MoveQueue`], which raises it over what the old server may have handed out
//!    (`data.rs`, invariant 5).
//! 5. Every delivery reservation (`reservations`) belongs to a queue.
//! 6. Every grow (`growing`) belongs to a queue with an explicit replica set that does not
//!    name its node (`grow.rs`).
//!
//! # Where the rest lives
//! - `topology.rs`: the types the commands carry and [`Topology`] (re-exported here).
//! - `codec.rs`: the binary form of a command batch in a Raft entry.
//! - `proptests.rs`: property tests of `apply` together with the codec and the snapshot JSON.

use std::collections::BTreeMap;

use amq_protocol::types::FieldTable;
use serde::{Deserialize, Serialize};

use super::topology::{NodeId, PREDECLARED_EXCHANGES};

// Re-exports for callers outside src/meta that import these from `meta::state` (amqp/methods/
// exchange.rs and queue.rs, broker/router.rs, broker/queue/mod.rs, broker/exchange/mod.rs,
// config.rs, core/mod.rs). They live in `topology.rs`; a later change can point those callers
// at `meta::topology` (or the `meta::` re-exports) and drop this line.
pub use super::topology::{Binding, DestKind, ExchangeDef, ExchangeKind, QueueDef, Topology};

/// The whole replicated state: topology, cursors and boot epochs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetaState {
    /// Vhosts, exchanges, queues, bindings.
    pub topology: Topology,
    /// Shared cursor per queue, by `(vhost, queue)`: the queue offset below which every message
    /// has been handed out (DESIGN.md, "The ack path", rule 1), or may have been (a move
    /// raises it to the old server's reservation: `data.rs`, invariant 5).
    #[serde(with = "keyed_cursors")]
    pub cursors: BTreeMap<(String, String), u64>,
    /// Boot epoch per node: 1 after its first boot, +1 on every [`Command::NodeBoot`].
    pub boot_epochs: BTreeMap<NodeId, u64>,
    /// Next offset per replicated queue, by `(vhost, queue)` (`data.rs`, invariant 1).
    #[serde(with = "keyed_cursors", default)]
    pub next_offsets: BTreeMap<(String, String), u64>,
    /// Delivery reservation per replicated queue, by `(vhost, queue)`: the queue offset below
    /// which its serving node may hand messages out (`data.rs`, invariant 5). Absent: 0.
    #[serde(with = "keyed_cursors", default)]
    pub reservations: BTreeMap<(String, String), u64>,
    /// Replica sets being grown, by `(vhost, queue)` (`grow.rs`).
    #[serde(with = "keyed_cursors", default)]
    pub growing: BTreeMap<(String, String), super::grow::Grow>,
    /// Index of the last Raft entry applied to this state (set by the driver, not by `apply`).
    pub applied_index: u64,
    /// Cluster addresses of the nodes added by a membership change (`members.rs`), by id; the
    /// founding nodes' addresses are in every node's `--peers`.
    #[serde(default)]
    pub members: BTreeMap<NodeId, String>,
    /// The voters the group was formed with, recorded when the first membership change
    /// applies (empty before: the voters never changed). A joining node starts from them and
    /// replays every change after.
    #[serde(default)]
    pub initial_voters: Vec<NodeId>,
    /// The latest entries applied per proposing driver (`driver.rs`: an entry's context is
    /// the driver's nonce and its batch sequence), so that a copy proposed again after a
    /// leader change (`Driver::repropose`) is skipped when its original reached the log too:
    /// applying both would enqueue every message of the entry twice. Part of the replicated
    /// state (snapshots carry it), so every node skips the same copies.
    #[serde(default)]
    pub applied_proposals: BTreeMap<u64, AppliedProposals>,
    /// The highest index a leader compacted its log to ([`Command::LogCompacted`]): every
    /// voter held the entries up to it then; a follower compacts no further (Raft log index).
    #[serde(default)]
    pub compacted_to: u64,
}

/// The latest entries one driver proposed that were applied ([`MetaState::applied_proposals`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AppliedProposals {
    /// Their batch sequences, the [`MAX_APPLIED_PER_PROPOSER`] highest.
    pub seqs: std::collections::BTreeSet<u64>,
    /// Log index of the last of them.
    pub last_index: u64,
}

/// The proposing driver's nonce and batch sequence from an entry's context (16 bytes,
/// little-endian, as `Driver::propose_entries` writes them); `None` for any other context
/// (a leader's no-op, a membership change).
pub fn proposal_context(ctx: &[u8]) -> Option<(u64, u64)> {
    let ctx = <[u8; 16]>::try_from(ctx).ok()?;
    let nonce = u64::from_le_bytes(ctx[..8].try_into().expect("8 bytes"));
    Some((nonce, u64::from_le_bytes(ctx[8..].try_into().expect("8 bytes"))))
}

/// Batch sequences remembered per proposer: far more than the entries a driver can have in
/// flight when the leader changes (they are bounded by its 10 s proposal timeout).
pub const MAX_APPLIED_PER_PROPOSER: usize = 4096;
/// Proposers remembered; the one whose last entry is oldest is forgotten first (a node that
/// restarted proposes under a new nonce).
pub const MAX_PROPOSERS: usize = 64;

/// A state-machine command. Proposed through the Raft log, applied by [`MetaState::apply`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// Creates a vhost with its predeclared exchanges ([`PREDECLARED_EXCHANGES`]).
    /// → `Created` | `Existed`.
    DeclareVhost {
        /// Vhost name.
        name: String,
    },
    /// → `Created` | `ExchangeExists(existing)` (the broker compares the definitions and replies
    /// 406 PRECONDITION_FAILED itself).
    DeclareExchange(ExchangeDef),
    /// → `Deleted` | `NotFound` | `InUse` (only with `if_unused` and bindings from it). Removes the
    /// bindings where it is the source or the destination.
    DeleteExchange {
        /// Vhost name.
        vhost: String,
        /// Exchange name.
        name: String,
        /// Refuse (`InUse`) when the exchange is the source of a binding.
        if_unused: bool,
    },
    /// → `Created` (cursor at 0) | `QueueExists(existing)`.
    DeclareQueue(QueueDef),
    /// → `Deleted` | `NotFound`. Removes the queue's bindings and its cursor.
    DeleteQueue {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        name: String,
    },
    /// → `Created` | `Existed` | `NotFound` (source exchange or destination missing).
    Bind(Binding),
    /// → `Deleted` | `NotFound` (no binding equal in every field).
    Unbind(Binding),
    /// Conditional cursor write → `CasApplied` when the stored cursor equals `expected` (it becomes
    /// `new`), else `CasRejected { current }` (`None`: no such queue).
    CursorCas {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// Cursor value the proposer read (a queue offset).
        expected: u64,
        /// Cursor value to store (a queue offset).
        new: u64,
    },
    /// A node (re)started → `Epoch(new epoch)`. Bumps the node's boot epoch and removes the
    /// queues that died with its previous run, and the bindings that name a removed object
    /// (bindings between surviving objects stay):
    /// - a single node (`cluster: None`): every non-durable or exclusive queue and every
    ///   non-durable exchange;
    /// - one node of a cluster (`cluster: Some(prev)`): only the non-durable or exclusive
    ///   queues owned by `node` (their messages lived there). Exchanges belong to no node and
    ///   stay: a transient exchange lives as long as the cluster (RabbitMQ's reading).
    ///
    /// A cluster boot applies only while the node's epoch is still `prev` (the one it read
    /// before proposing); otherwise it is a no-op answering the current epoch. A proposal
    /// re-sent after a leader change, or retried after a timeout, is thus counted once.
    NodeBoot {
        /// The node that booted.
        node: NodeId,
        /// `Some(epoch before this boot)` for one voter of a cluster; `None` for a single node.
        cluster: Option<u64>,
    },
    /// A message for a replicated queue (`data.rs`) → `Enqueued { offset }` | `NotFound`.
    Enqueue {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// Record flags as the shard stores them.
        flags: u8,
        /// Stored header (`broker::message` form).
        header: bytes::Bytes,
        /// Body.
        body: bytes::Bytes,
    },
    /// Deletes of a replicated queue's messages (`data.rs`) → `Settled` | `NotFound`.
    Settle {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// Queue offsets.
        offsets: Vec<u64>,
    },
    /// Return counts of a replicated queue's messages (`broker/queue/delivery_limit.rs`):
    /// each member raises its count of each offset to the one given → `Settled` | `NotFound`.
    Return {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// (queue offset, returns counted so far).
        counts: Vec<(u64, u32)>,
    },
    /// Takes `node` out of a queue's replica set: its copy missed messages (it was sent a
    /// snapshot, `data.rs`, invariant 4) → `Moved` | `Existed` (not in the set, the set's only
    /// node, or the queue's server) | `NotFound`.
    LeaveReplicaSet {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// The node whose copy is incomplete.
        node: NodeId,
    },
    /// Lets the node serving a replicated queue hand out its messages below offset `until`
    /// (`data.rs`, invariant 5) → `Reserved { until }` (the stored reservation, never lower
    /// than before) | `Existed` (`node` does not serve the queue: nothing may be handed out)
    /// | `NotFound`.
    Reserve {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// The node that asks (it must serve the queue).
        node: NodeId,
        /// Queue offset: messages below it may be delivered.
        until: u64,
    },
    /// Moves a queue to another node while `from` serves it (`data.rs`, invariant 3); the
    /// cursor rises to what `from` had reserved, up to the queue's tail (invariant 5)
    /// → `Moved` | `Existed` (not served by `from` any more) | `NotFound`.
    MoveQueue {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// The node that served it.
        from: NodeId,
        /// The node to serve it.
        to: NodeId,
        /// `to`'s boot epoch, as the proposer read it.
        to_epoch: u64,
    },
    /// Starts copying a replicated queue to `node`, which joins its set once the copy is
    /// complete (`grow.rs`, step 1) → `Created` | `Existed` | `NotFound`.
    GrowReplicaSet {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// The node to receive the copy.
        node: NodeId,
        /// The grow's id (random, from the proposer).
        id: u64,
    },
    /// The live messages of queue offsets `[from, to)` for grow `id` (`grow.rs`, step 2)
    /// → `Copied { upto }` | `Existed` (no such grow) | `CasRejected { current }`.
    CopyMessages {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// The grow's id.
        id: u64,
        /// First queue offset the batch covers.
        from: u64,
        /// Queue offset after the last one it covers.
        to: u64,
        /// The live messages in `[from, to)`, ascending offsets.
        messages: Vec<super::grow::CopiedMessage>,
    },
    /// Ends grow `id`: its node joins the set if the copy reached `tail`, the queue's next
    /// offset (`grow.rs`, step 3) → `Moved` | `Existed` | `CasRejected { current }`.
    JoinReplicaSet {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// The grow's id.
        id: u64,
        /// The queue's next offset, as the copy reached it.
        tail: u64,
    },
    /// Deletes a vhost and everything in it: exchanges, queues (with their cursors), bindings,
    /// permissions and policies → `Deleted` | `NotFound`. The broker deletes the queues'
    /// stores first (`broker::access::delete_vhost`); this is the metadata's cascade.
    DeleteVhost {
        /// Vhost name.
        name: String,
    },
    /// Creates or replaces a user (`access.rs`) → `Created` | `Updated` | `Existed` (identical).
    PutUser(super::access::UserDef),
    /// Deletes a user and its permissions → `Deleted` | `NotFound`.
    DeleteUser {
        /// User name.
        name: String,
    },
    /// Sets a user's permissions in a vhost → `Created` | `Updated` | `Existed` | `NotFound`
    /// (no such user or vhost).
    SetPermission(super::access::Permission),
    /// Clears a user's permissions in a vhost → `Deleted` | `NotFound`.
    ClearPermission {
        /// User name.
        user: String,
        /// Vhost name.
        vhost: String,
    },
    /// Sets a policy or an operator policy → `Created` | `Updated` | `Existed` | `NotFound`
    /// (no such vhost).
    SetPolicy(super::access::PolicyDef),
    /// Clears a policy (`operator` false) or an operator policy → `Deleted` | `NotFound`.
    ClearPolicy {
        /// Vhost name.
        vhost: String,
        /// Policy name.
        name: String,
        /// An operator policy.
        operator: bool,
    },
    /// Names the cluster ([`Topology::cluster`]) → `Created` (the first name, with
    /// `permanent_id`) | `Updated` (renamed; the permanent id stays) | `Existed` (the same
    /// name, or `initial` and a name is already set).
    SetClusterName {
        /// The new name.
        name: String,
        /// The permanent id to record if none is recorded yet.
        permanent_id: String,
        /// Only if the cluster has no name yet (a node's start proposes its default so).
        initial: bool,
    },
    /// The leader compacted its log up to `index`, an entry every voter had then (`driver.rs`,
    /// step 6) → `Updated` (the floor rose, [`MetaState::compacted_to`]) | `Existed`. A
    /// follower compacts no further than this floor, so whoever leads next still holds the
    /// entries a node briefly behind lacks, and sends it those instead of a snapshot.
    LogCompacted {
        /// Raft log index.
        index: u64,
    },
}

/// Result of applying one [`Command`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    /// The object was created.
    Created,
    /// An identical object (vhost or binding) already existed; nothing changed.
    Existed,
    /// An object (user, permission, policy) existed and was replaced by a different one.
    Updated,
    /// The object was deleted.
    Deleted,
    /// The object (or, for `Bind`, an end of the binding) does not exist.
    NotFound,
    /// `DeleteExchange { if_unused: true }` on an exchange that is a binding source.
    InUse,
    /// An exchange with that name exists; here is its definition.
    ExchangeExists(ExchangeDef),
    /// A queue with that name exists; here is its definition.
    QueueExists(QueueDef),
    /// The cursor compare-and-set succeeded.
    CasApplied,
    /// The cursor compare-and-set failed; `current` is the stored cursor (`None`: no such queue).
    CasRejected {
        /// Stored cursor at apply time.
        current: Option<u64>,
    },
    /// The node's boot epoch after `NodeBoot`.
    Epoch(u64),
    /// `Enqueue`: the offset the message got.
    Enqueued {
        /// Queue offset.
        offset: u64,
    },
    /// `Settle` or `Return` applied.
    Settled,
    /// `MoveQueue` applied.
    Moved,
    /// `Reserve` applied: the queue's stored reservation (a queue offset).
    Reserved {
        /// Messages below this offset may be delivered by the queue's server.
        until: u64,
    },
    /// `CopyMessages` applied: the copy reached this queue offset.
    Copied {
        /// Queue offset.
        upto: u64,
    },
}

impl Command {
    /// True when applying this command with this outcome changed the [`Topology`] (what routers
    /// read). Cursor writes and no-op outcomes return false.
    pub fn changed_topology(&self, outcome: &Outcome) -> bool {
        match self {
            Command::CursorCas { .. }
            | Command::Enqueue { .. }
            | Command::Settle { .. }
            | Command::Return { .. }
            | Command::Reserve { .. }
            | Command::CopyMessages { .. }
            | Command::LogCompacted { .. } => false,
            Command::NodeBoot { .. } => true,
            Command::MoveQueue { .. } | Command::LeaveReplicaSet { .. } | Command::JoinReplicaSet { .. } => {
                matches!(outcome, Outcome::Moved)
            }
            _ => matches!(outcome, Outcome::Created | Outcome::Deleted | Outcome::Updated),
        }
    }
}

impl MetaState {
    /// Records that the entry with context `ctx` is applied at `index`; false when a copy of
    /// it was applied before, which the caller then skips. A context that is not a driver's
    /// (16 bytes: nonce, batch sequence, little-endian) is always applied.
    pub fn first_application(&mut self, ctx: &[u8], index: u64) -> bool {
        let Some((nonce, seq)) = proposal_context(ctx) else { return true };
        if !self.applied_proposals.contains_key(&nonce) && self.applied_proposals.len() >= MAX_PROPOSERS {
            let oldest = self.applied_proposals.iter().min_by_key(|(_, p)| p.last_index).map(|(n, _)| *n);
            if let Some(n) = oldest {
                self.applied_proposals.remove(&n);
            }
        }
        let p = self.applied_proposals.entry(nonce).or_default();
        if p.seqs.contains(&seq) || p.seqs.len() >= MAX_APPLIED_PER_PROPOSER && p.seqs.first().is_some_and(|&f| seq < f) {
            return false;
        }
        p.seqs.insert(seq);
        p.last_index = index;
        while p.seqs.len() > MAX_APPLIED_PER_PROPOSER {
            p.seqs.pop_first();
        }
        true
    }

    /// Applies one command and returns its outcome. Pure and deterministic (see the module doc).
    pub fn apply(&mut self, cmd: &Command) -> Outcome {
        let topo = &mut self.topology;
        match cmd {
            Command::DeclareVhost { name } => {
                if !topo.vhosts.insert(name.clone()) {
                    return Outcome::Existed;
                }
                for (ex, kind) in PREDECLARED_EXCHANGES {
                    topo.exchanges.entry((name.clone(), ex.to_owned())).or_insert_with(|| ExchangeDef {
                        vhost: name.clone(),
                        name: ex.to_owned(),
                        kind,
                        durable: true,
                        auto_delete: false,
                        internal: false,
                        arguments: FieldTable::default(),
                    });
                }
                Outcome::Created
            }
            Command::DeclareExchange(def) => {
                let key = (def.vhost.clone(), def.name.clone());
                if let Some(existing) = topo.exchanges.get(&key) {
                    return Outcome::ExchangeExists(existing.clone());
                }
                topo.exchanges.insert(key, def.clone());
                Outcome::Created
            }
            Command::DeleteExchange { vhost, name, if_unused } => {
                let key = (vhost.clone(), name.clone());
                if !topo.exchanges.contains_key(&key) {
                    return Outcome::NotFound;
                }
                if *if_unused && topo.bindings.contains_key(&key) {
                    return Outcome::InUse;
                }
                topo.exchanges.remove(&key);
                topo.bindings.remove(&key);
                let sources = topo.remove_bindings_where(|b| b.dest_kind == DestKind::Exchange && b.vhost == *vhost && b.dest == *name);
                topo.reap_auto_delete(sources);
                Outcome::Deleted
            }
            Command::DeclareQueue(def) => {
                let key = (def.vhost.clone(), def.name.clone());
                if let Some(existing) = topo.queues.get(&key) {
                    return Outcome::QueueExists(existing.clone());
                }
                topo.queues.insert(key.clone(), def.clone());
                self.cursors.insert(key.clone(), 0);
                self.next_offsets.insert(key, 0);
                Outcome::Created
            }
            Command::DeleteQueue { vhost, name } => {
                let key = (vhost.clone(), name.clone());
                if topo.queues.remove(&key).is_none() {
                    return Outcome::NotFound;
                }
                self.cursors.remove(&key);
                self.next_offsets.remove(&key);
                self.reservations.remove(&key);
                self.growing.remove(&key);
                let sources = topo.remove_bindings_where(|b| b.dest_kind == DestKind::Queue && b.vhost == *vhost && b.dest == *name);
                topo.reap_auto_delete(sources);
                Outcome::Deleted
            }
            Command::Bind(b) => {
                let key = (b.vhost.clone(), b.source.clone());
                if !topo.exchanges.contains_key(&key) || !topo.dest_exists(&b.vhost, b.dest_kind, &b.dest) {
                    return Outcome::NotFound;
                }
                let list = topo.bindings.entry(key).or_default();
                if list.iter().any(|x| x == b) {
                    return Outcome::Existed;
                }
                list.push(b.clone());
                Outcome::Created
            }
            Command::Unbind(b) => {
                let key = (b.vhost.clone(), b.source.clone());
                let Some(list) = topo.bindings.get_mut(&key) else {
                    return Outcome::NotFound;
                };
                let Some(pos) = list.iter().position(|x| x == b) else {
                    return Outcome::NotFound;
                };
                list.remove(pos);
                if list.is_empty() {
                    topo.bindings.remove(&key);
                }
                topo.reap_auto_delete(vec![key]);
                Outcome::Deleted
            }
            Command::CursorCas { vhost, queue, expected, new } => {
                // Hot path: probe without building a key when possible is not possible with a
                // tuple key; two small allocations per CAS are accepted.
                let key = (vhost.clone(), queue.clone());
                match self.cursors.get_mut(&key) {
                    Some(cur) if *cur == *expected => {
                        *cur = *new;
                        Outcome::CasApplied
                    }
                    Some(cur) => Outcome::CasRejected { current: Some(*cur) },
                    None => Outcome::CasRejected { current: None },
                }
            }
            Command::NodeBoot { node, cluster } => {
                let epoch = self.boot_epochs.entry(*node).or_insert(0);
                if cluster.is_some_and(|prev| prev != *epoch) {
                    return Outcome::Epoch(*epoch);
                }
                *epoch += 1;
                let epoch = *epoch;
                let cluster = cluster.is_some();
                let died = |q: &QueueDef| (!q.durable || q.exclusive_owner.is_some()) && (!cluster || q.owner_node == *node);
                let gone_queues: Vec<(String, String)> = topo.queues.iter().filter(|(_, q)| died(q)).map(|(k, _)| k.clone()).collect();
                for key in &gone_queues {
                    topo.queues.remove(key);
                    self.cursors.remove(key);
                    self.next_offsets.remove(key);
                    self.reservations.remove(key);
                    self.growing.remove(key);
                }
                let gone_exchanges: Vec<(String, String)> =
                    topo.exchanges.iter().filter(|(_, e)| !e.durable && !cluster).map(|(k, _)| k.clone()).collect();
                for key in &gone_exchanges {
                    topo.exchanges.remove(key);
                }
                if !gone_queues.is_empty() || !gone_exchanges.is_empty() {
                    let queues = &topo.queues;
                    let exchanges = &topo.exchanges;
                    let dead = |b: &Binding| {
                        let src = (b.vhost.clone(), b.source.clone());
                        let dst = (b.vhost.clone(), b.dest.clone());
                        !exchanges.contains_key(&src)
                            || match b.dest_kind {
                                DestKind::Queue => !queues.contains_key(&dst),
                                DestKind::Exchange => !exchanges.contains_key(&dst),
                            }
                    };
                    let mut bindings = std::mem::take(&mut topo.bindings);
                    bindings.retain(|_, list| {
                        list.retain(|b| !dead(b));
                        !list.is_empty()
                    });
                    topo.bindings = bindings;
                }
                Outcome::Epoch(epoch)
            }
            Command::Enqueue { vhost, queue, .. } => super::data::enqueue(self, vhost, queue),
            Command::Settle { vhost, queue, .. } | Command::Return { vhost, queue, .. } => {
                if topo.queues.contains_key(&(vhost.clone(), queue.clone())) {
                    Outcome::Settled
                } else {
                    Outcome::NotFound
                }
            }
            Command::MoveQueue { vhost, queue, from, to, to_epoch } => super::data::move_queue(self, vhost, queue, *from, *to, *to_epoch),
            Command::LeaveReplicaSet { vhost, queue, node } => super::data::leave_replica_set(self, vhost, queue, *node),
            Command::Reserve { vhost, queue, node, until } => super::data::reserve(self, vhost, queue, *node, *until),
            Command::GrowReplicaSet { vhost, queue, node, id } => super::grow::grow(self, vhost, queue, *node, *id),
            Command::CopyMessages { vhost, queue, id, from, to, .. } => super::grow::copy(self, vhost, queue, *id, *from, *to),
            Command::JoinReplicaSet { vhost, queue, id, tail } => super::grow::join(self, vhost, queue, *id, *tail),
            Command::DeleteVhost { name } => self.delete_vhost(name),
            Command::PutUser(_)
            | Command::DeleteUser { .. }
            | Command::SetPermission(_)
            | Command::ClearPermission { .. }
            | Command::SetPolicy(_)
            | Command::ClearPolicy { .. } => topo.access.apply(&topo.vhosts, cmd),
            Command::SetClusterName { name, permanent_id, initial } => match &mut topo.cluster {
                None => {
                    topo.cluster = Some(super::topology::ClusterIdentity { name: name.clone(), permanent_id: permanent_id.clone() });
                    Outcome::Created
                }
                Some(c) if *initial || c.name == *name => Outcome::Existed,
                Some(c) => {
                    c.name = name.clone();
                    Outcome::Updated
                }
            },
            Command::LogCompacted { index } if *index > self.compacted_to => {
                self.compacted_to = *index;
                Outcome::Updated
            }
            Command::LogCompacted { .. } => Outcome::Existed,
        }
    }

    /// `DeleteVhost`: the vhost and everything that lives in it.
    fn delete_vhost(&mut self, name: &str) -> Outcome {
        let topo = &mut self.topology;
        if !topo.vhosts.remove(name) {
            return Outcome::NotFound;
        }
        let mine = |k: &(String, String)| k.0 == name;
        topo.exchanges.retain(|k, _| !mine(k));
        topo.queues.retain(|k, _| !mine(k));
        topo.bindings.retain(|k, _| !mine(k));
        self.cursors.retain(|k, _| !mine(k));
        self.next_offsets.retain(|k, _| !mine(k));
        self.reservations.retain(|k, _| !mine(k));
        self.growing.retain(|k, _| !mine(k));
        topo.access.drop_vhost(name);
        Outcome::Deleted
    }

    /// The stored cursor of queue `queue` in `vhost` (a queue offset), if the queue exists.
    pub fn cursor(&self, vhost: &str, queue: &str) -> Option<u64> {
        self.cursors.get(&(vhost.to_owned(), queue.to_owned())).copied()
    }

    /// The tail of queue `queue` in `vhost`: the offset its next `Enqueue` gets (0 when none).
    pub fn tail(&self, vhost: &str, queue: &str) -> u64 {
        self.next_offsets.get(&(vhost.to_owned(), queue.to_owned())).copied().unwrap_or(0)
    }

    /// The delivery reservation of queue `queue` in `vhost` (a queue offset; 0 when none).
    pub fn reservation(&self, vhost: &str, queue: &str) -> u64 {
        self.reservations.get(&(vhost.to_owned(), queue.to_owned())).copied().unwrap_or(0)
    }

    /// Checks the invariants of the module doc; returns the first one broken. Used by tests and
    /// after loading a snapshot.
    pub fn check_invariants(&self) -> Result<(), String> {
        let topo = &self.topology;
        for key in topo.queues.keys() {
            if !self.cursors.contains_key(key) {
                return Err(format!("queue {key:?} has no cursor"));
            }
        }
        for key in self.cursors.keys() {
            if !topo.queues.contains_key(key) {
                return Err(format!("cursor {key:?} has no queue"));
            }
        }
        if let Some(key) = self.reservations.keys().find(|k| !topo.queues.contains_key(*k)) {
            return Err(format!("reservation {key:?} has no queue"));
        }
        for (key, g) in &self.growing {
            match topo.queues.get(key) {
                Some(q) if !q.replicas.is_empty() && !q.replicas.contains(&g.node) => {}
                _ => return Err(format!("grow {key:?} to node {} has no queue, or the node is in its set", g.node)),
            }
        }
        for ((vhost, name), def) in &topo.exchanges {
            if *vhost != def.vhost || *name != def.name {
                return Err(format!("exchange key {vhost:?}/{name:?} != its def"));
            }
        }
        for ((vhost, name), def) in &topo.queues {
            if *vhost != def.vhost || *name != def.name {
                return Err(format!("queue key {vhost:?}/{name:?} != its def"));
            }
        }
        for ((vhost, source), list) in &topo.bindings {
            if list.is_empty() {
                return Err(format!("empty binding list for {vhost:?}/{source:?}"));
            }
            for (i, b) in list.iter().enumerate() {
                if b.vhost != *vhost || b.source != *source {
                    return Err(format!("binding {b:?} filed under {vhost:?}/{source:?}"));
                }
                if !topo.exchanges.contains_key(&(vhost.clone(), source.clone())) {
                    return Err(format!("binding {b:?} has no source"));
                }
                if !topo.dest_exists(vhost, b.dest_kind, &b.dest) {
                    return Err(format!("binding {b:?} has no destination"));
                }
                if list[..i].contains(b) {
                    return Err(format!("duplicate binding {b:?}"));
                }
            }
        }
        topo.access.check(&topo.vhosts)
    }
}

// serde helper: a map keyed by (vhost, queue) becomes a list of (vhost, queue, value) (JSON
// map keys must be strings).

mod keyed_cursors {
    use super::*;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer, V: Serialize>(m: &BTreeMap<(String, String), V>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.iter().map(|((v, q), c)| (v, q, c)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>, V: Deserialize<'de>>(d: D) -> Result<BTreeMap<(String, String), V>, D::Error> {
        let list = Vec::<(String, String, V)>::deserialize(d)?;
        Ok(list.into_iter().map(|(v, q, c)| ((v, q), c)).collect())
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
pub(crate) mod tests;
