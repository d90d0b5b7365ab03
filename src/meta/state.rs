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
}

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
}

/// Result of applying one [`Command`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    /// The object was created.
    Created,
    /// An identical object (vhost or binding) already existed; nothing changed.
    Existed,
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
    /// `Settle` applied.
    Settled,
    /// `MoveQueue` applied.
    Moved,
    /// `Reserve` applied: the queue's stored reservation (a queue offset).
    Reserved {
        /// Messages below this offset may be delivered by the queue's server.
        until: u64,
    },
}

impl Command {
    /// True when applying this command with this outcome changed the [`Topology`] (what routers
    /// read). Cursor writes and no-op outcomes return false.
    pub fn changed_topology(&self, outcome: &Outcome) -> bool {
        match self {
            Command::CursorCas { .. } | Command::Enqueue { .. } | Command::Settle { .. } | Command::Reserve { .. } => false,
            Command::NodeBoot { .. } => true,
            Command::MoveQueue { .. } | Command::LeaveReplicaSet { .. } => matches!(outcome, Outcome::Moved),
            _ => matches!(outcome, Outcome::Created | Outcome::Deleted),
        }
    }
}

impl MetaState {
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
            Command::Settle { vhost, queue, .. } => {
                if topo.queues.contains_key(&(vhost.clone(), queue.clone())) {
                    Outcome::Settled
                } else {
                    Outcome::NotFound
                }
            }
            Command::MoveQueue { vhost, queue, from, to, to_epoch } => super::data::move_queue(self, vhost, queue, *from, *to, *to_epoch),
            Command::LeaveReplicaSet { vhost, queue, node } => super::data::leave_replica_set(self, vhost, queue, *node),
            Command::Reserve { vhost, queue, node, until } => super::data::reserve(self, vhost, queue, *node, *until),
        }
    }

    /// The stored cursor of queue `queue` in `vhost` (a queue offset), if the queue exists.
    pub fn cursor(&self, vhost: &str, queue: &str) -> Option<u64> {
        self.cursors.get(&(vhost.to_owned(), queue.to_owned())).copied()
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
        Ok(())
    }
}

// serde helper: the tuple-keyed cursor map becomes a list (JSON map keys must be strings).

mod keyed_cursors {
    use super::*;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(m: &BTreeMap<(String, String), u64>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.iter().map(|((v, q), c)| (v, q, c)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<(String, String), u64>, D::Error> {
        let list = Vec::<(String, String, u64)>::deserialize(d)?;
        Ok(list.into_iter().map(|(v, q, c)| ((v, q), c)).collect())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use amq_protocol::types::{AMQPValue, FieldTable};

    pub(crate) fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    pub(crate) fn exchange(name: &str, kind: ExchangeKind, durable: bool) -> ExchangeDef {
        ExchangeDef {
            vhost: "/".into(),
            name: name.into(),
            kind,
            durable,
            auto_delete: false,
            internal: false,
            arguments: FieldTable::default(),
        }
    }

    pub(crate) fn queue(name: &str, durable: bool, exclusive_owner: Option<u64>) -> QueueDef {
        QueueDef {
            vhost: "/".into(),
            name: name.into(),
            durable,
            auto_delete: false,
            exclusive_owner,
            arguments: FieldTable::default(),
            owner_node: 1,
            owner_core: 0,
            owner_epoch: 1,
            replicas: Vec::new(),
            incarnation: 0,
        }
    }

    pub(crate) fn bind(source: &str, dest_kind: DestKind, dest: &str, key: &str) -> Binding {
        Binding {
            vhost: "/".into(),
            source: source.into(),
            dest_kind,
            dest: dest.into(),
            routing_key: key.into(),
            arguments: FieldTable::default(),
        }
    }

    pub(crate) fn cas(queue: &str, expected: u64, new: u64) -> Command {
        Command::CursorCas { vhost: "/".into(), queue: queue.into(), expected, new }
    }

    fn applied(st: &mut MetaState, cmd: Command) -> Outcome {
        let o = st.apply(&cmd);
        st.check_invariants().unwrap();
        o
    }

    #[test]
    fn auto_delete_exchange_goes_with_its_last_binding() {
        let mut st = MetaState::default();
        applied(&mut st, Command::DeclareVhost { name: "/".into() });
        let mut x = exchange("ad", ExchangeKind::Fanout, false);
        x.auto_delete = true;
        let mut x2 = exchange("ad2", ExchangeKind::Fanout, false);
        x2.auto_delete = true;
        applied(&mut st, Command::DeclareExchange(x));
        applied(&mut st, Command::DeclareExchange(x2));
        applied(&mut st, Command::DeclareQueue(queue("q1", false, None)));
        applied(&mut st, Command::DeclareQueue(queue("q2", false, None)));
        applied(&mut st, Command::Bind(bind("ad", DestKind::Queue, "q1", "")));
        applied(&mut st, Command::Bind(bind("ad", DestKind::Queue, "q2", "")));
        applied(&mut st, Command::Bind(bind("ad2", DestKind::Exchange, "ad", "")));
        // a binding left: the exchange stays
        applied(&mut st, Command::Unbind(bind("ad", DestKind::Queue, "q1", "")));
        assert!(st.topology.exchange("/", "ad").is_some());
        // the last binding goes with its queue: the exchange goes, and so does ad2, whose
        // only binding pointed at it
        applied(&mut st, Command::DeleteQueue { vhost: "/".into(), name: "q2".into() });
        assert!(st.topology.exchange("/", "ad").is_none());
        assert!(st.topology.exchange("/", "ad2").is_none());
        // a new auto-delete exchange with no binding yet stays
        let mut x3 = exchange("ad3", ExchangeKind::Direct, false);
        x3.auto_delete = true;
        applied(&mut st, Command::DeclareExchange(x3));
        applied(&mut st, Command::Unbind(bind("ad3", DestKind::Queue, "q1", "")));
        assert!(st.topology.exchange("/", "ad3").is_some());
    }

    #[test]
    fn vhost_declare_creates_predeclared_exchanges() {
        let mut st = MetaState::default();
        assert_eq!(applied(&mut st, Command::DeclareVhost { name: "/".into() }), Outcome::Created);
        assert_eq!(applied(&mut st, Command::DeclareVhost { name: "/".into() }), Outcome::Existed);
        for (name, kind) in PREDECLARED_EXCHANGES {
            let ex = st.topology.exchange("/", name).unwrap();
            assert_eq!((ex.kind, ex.durable), (kind, true));
        }
        assert_eq!(st.topology.exchanges.len(), 6);
    }

    #[test]
    fn exchange_declare_returns_existing_definition() {
        let mut st = MetaState::default();
        let x = exchange("logs", ExchangeKind::Fanout, true);
        assert_eq!(applied(&mut st, Command::DeclareExchange(x.clone())), Outcome::Created);
        let mut other = x.clone();
        other.kind = ExchangeKind::Topic;
        assert_eq!(applied(&mut st, Command::DeclareExchange(other)), Outcome::ExchangeExists(x.clone()));
        assert_eq!(st.topology.exchange("/", "logs"), Some(&x));
    }

    #[test]
    fn exchange_delete_if_unused_and_cascade() {
        let mut st = MetaState::default();
        applied(&mut st, Command::DeclareExchange(exchange("a", ExchangeKind::Direct, true)));
        applied(&mut st, Command::DeclareExchange(exchange("b", ExchangeKind::Direct, true)));
        applied(&mut st, Command::DeclareQueue(queue("q", true, None)));
        assert_eq!(applied(&mut st, Command::Bind(bind("a", DestKind::Queue, "q", "k"))), Outcome::Created);
        assert_eq!(applied(&mut st, Command::Bind(bind("b", DestKind::Exchange, "a", "k"))), Outcome::Created);
        let del = |name: &str, if_unused| Command::DeleteExchange { vhost: "/".into(), name: name.into(), if_unused };
        assert_eq!(applied(&mut st, del("a", true)), Outcome::InUse);
        assert_eq!(applied(&mut st, del("nope", false)), Outcome::NotFound);
        // Deleting `a` removes a->q (a is source) and b->a (a is destination).
        assert_eq!(applied(&mut st, del("a", false)), Outcome::Deleted);
        assert_eq!(st.topology.binding_count(), 0);
        // `b` is now unused.
        assert_eq!(applied(&mut st, del("b", true)), Outcome::Deleted);
        assert!(st.topology.exchanges.is_empty());
    }

    #[test]
    fn queue_declare_starts_cursor_at_zero_and_returns_existing() {
        let mut st = MetaState::default();
        let q = queue("q", true, None);
        assert_eq!(applied(&mut st, Command::DeclareQueue(q.clone())), Outcome::Created);
        assert_eq!(st.cursor("/", "q"), Some(0));
        let mut other = q.clone();
        other.durable = false;
        assert_eq!(applied(&mut st, Command::DeclareQueue(other)), Outcome::QueueExists(q));
    }

    #[test]
    fn queue_delete_removes_bindings_and_cursor() {
        let mut st = MetaState::default();
        applied(&mut st, Command::DeclareExchange(exchange("x", ExchangeKind::Topic, true)));
        applied(&mut st, Command::DeclareQueue(queue("q", true, None)));
        applied(&mut st, Command::DeclareQueue(queue("r", true, None)));
        applied(&mut st, Command::Bind(bind("x", DestKind::Queue, "q", "a.*")));
        applied(&mut st, Command::Bind(bind("x", DestKind::Queue, "r", "a.*")));
        applied(&mut st, cas("q", 0, 7));
        let del = Command::DeleteQueue { vhost: "/".into(), name: "q".into() };
        assert_eq!(applied(&mut st, del.clone()), Outcome::Deleted);
        assert_eq!(applied(&mut st, del), Outcome::NotFound);
        assert_eq!(st.cursor("/", "q"), None);
        let left: Vec<_> = st.topology.bindings_from("/", "x").map(|b| b.dest.as_str()).collect();
        assert_eq!(left, ["r"]);
        // Redeclared, it starts over at 0.
        applied(&mut st, Command::DeclareQueue(queue("q", true, None)));
        assert_eq!(st.cursor("/", "q"), Some(0));
    }

    #[test]
    fn bind_and_unbind() {
        let mut st = MetaState::default();
        let b = bind("x", DestKind::Queue, "q", "k");
        assert_eq!(applied(&mut st, Command::Bind(b.clone())), Outcome::NotFound);
        applied(&mut st, Command::DeclareExchange(exchange("x", ExchangeKind::Direct, true)));
        assert_eq!(applied(&mut st, Command::Bind(b.clone())), Outcome::NotFound, "no queue");
        applied(&mut st, Command::DeclareQueue(queue("q", true, None)));
        assert_eq!(applied(&mut st, Command::Bind(b.clone())), Outcome::Created);
        assert_eq!(applied(&mut st, Command::Bind(b.clone())), Outcome::Existed);
        // Same key, other arguments: a different binding.
        let mut b2 = b.clone();
        b2.arguments = args(&[("x-match", AMQPValue::LongString("all".into()))]);
        assert_eq!(applied(&mut st, Command::Unbind(b2.clone())), Outcome::NotFound);
        assert_eq!(applied(&mut st, Command::Bind(b2.clone())), Outcome::Created);
        assert_eq!(st.topology.bindings_from("/", "x").count(), 2);
        assert_eq!(st.topology.bindings_to("/", DestKind::Queue, "q").count(), 2);
        assert_eq!(applied(&mut st, Command::Unbind(b.clone())), Outcome::Deleted);
        assert_eq!(applied(&mut st, Command::Unbind(b)), Outcome::NotFound);
        assert_eq!(applied(&mut st, Command::Unbind(b2)), Outcome::Deleted);
        assert!(st.topology.bindings.is_empty());
    }

    #[test]
    fn cursor_cas_accepts_rejects_and_reports_current() {
        let mut st = MetaState::default();
        assert_eq!(applied(&mut st, cas("q", 0, 1)), Outcome::CasRejected { current: None });
        applied(&mut st, Command::DeclareQueue(queue("q", true, None)));
        assert_eq!(applied(&mut st, cas("q", 0, 10)), Outcome::CasApplied);
        // A proposer that read 0 before the write above is stale now.
        assert_eq!(applied(&mut st, cas("q", 0, 5)), Outcome::CasRejected { current: Some(10) });
        assert_eq!(st.cursor("/", "q"), Some(10));
        // It re-reads and retries.
        assert_eq!(applied(&mut st, cas("q", 10, 15)), Outcome::CasApplied);
        assert_eq!(st.cursor("/", "q"), Some(15));
    }

    #[test]
    fn node_boot_keeps_durable_and_drops_the_rest() {
        let mut st = MetaState::default();
        applied(&mut st, Command::DeclareVhost { name: "/".into() });
        applied(&mut st, Command::DeclareExchange(exchange("dx", ExchangeKind::Direct, true)));
        applied(&mut st, Command::DeclareExchange(exchange("tx", ExchangeKind::Direct, false)));
        applied(&mut st, Command::DeclareQueue(queue("dq", true, None)));
        applied(&mut st, Command::DeclareQueue(queue("tq", false, None)));
        applied(&mut st, Command::DeclareQueue(queue("xq", true, Some(9))));
        for b in [
            bind("dx", DestKind::Queue, "dq", "k"),
            bind("dx", DestKind::Queue, "tq", "k"),
            bind("dx", DestKind::Queue, "xq", "k"),
            bind("tx", DestKind::Queue, "dq", "k"),
            bind("dx", DestKind::Exchange, "tx", "k"),
            bind("amq.direct", DestKind::Exchange, "dx", "k"),
        ] {
            assert_eq!(applied(&mut st, Command::Bind(b)), Outcome::Created);
        }
        applied(&mut st, cas("dq", 0, 3));
        assert_eq!(applied(&mut st, Command::NodeBoot { node: 1, cluster: None }), Outcome::Epoch(1));
        assert_eq!(applied(&mut st, Command::NodeBoot { node: 2, cluster: None }), Outcome::Epoch(1));
        assert_eq!(applied(&mut st, Command::NodeBoot { node: 1, cluster: None }), Outcome::Epoch(2));
        let t = &st.topology;
        assert!(t.queue("/", "dq").is_some());
        assert!(t.queue("/", "tq").is_none() && t.queue("/", "xq").is_none());
        assert!(t.exchange("/", "dx").is_some() && t.exchange("/", "tx").is_none());
        assert_eq!(t.exchanges.len(), 7, "6 predeclared + dx");
        let left: Vec<_> = t.all_bindings().cloned().collect();
        assert_eq!(left, [bind("amq.direct", DestKind::Exchange, "dx", "k"), bind("dx", DestKind::Queue, "dq", "k")]);
        assert_eq!(st.cursor("/", "dq"), Some(3));
        assert_eq!(st.cursor("/", "tq"), None);
        assert_eq!(st.boot_epochs.get(&1), Some(&2));
    }

    #[test]
    fn a_cluster_node_boot_removes_only_its_own_transient_queues() {
        let mut st = MetaState::default();
        applied(&mut st, Command::DeclareVhost { name: "/".into() });
        applied(&mut st, Command::DeclareExchange(exchange("tx", ExchangeKind::Fanout, false)));
        let on = |name: &str, node: NodeId, durable: bool| QueueDef { owner_node: node, ..queue(name, durable, None) };
        for q in [on("t1", 1, false), on("t2", 2, false), on("d2", 2, true)] {
            assert_eq!(applied(&mut st, Command::DeclareQueue(q)), Outcome::Created);
        }
        assert_eq!(applied(&mut st, Command::Bind(bind("tx", DestKind::Queue, "t1", ""))), Outcome::Created);
        assert_eq!(applied(&mut st, Command::NodeBoot { node: 2, cluster: Some(0) }), Outcome::Epoch(1));
        // The same boot again (a re-sent proposal) is counted once.
        let before = st.clone();
        assert_eq!(applied(&mut st, Command::NodeBoot { node: 2, cluster: Some(0) }), Outcome::Epoch(1));
        assert_eq!(st, before);
        let t = &st.topology;
        assert!(t.queue("/", "t1").is_some(), "node 1's transient queue went with node 2's restart");
        assert!(t.queue("/", "t2").is_none() && t.queue("/", "d2").is_some());
        assert!(t.exchange("/", "tx").is_some(), "a transient exchange lives as long as the cluster");
        assert_eq!(t.bindings_from("/", "tx").count(), 1);
        assert_eq!(applied(&mut st, Command::NodeBoot { node: 1, cluster: Some(0) }), Outcome::Epoch(1));
        assert!(st.topology.queue("/", "t1").is_none());
        assert_eq!(st.topology.bindings_from("/", "tx").count(), 0);
    }
}
