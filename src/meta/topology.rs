//! The topology types of the metadata: vhosts, exchanges ([`ExchangeDef`]), queues
//! ([`QueueDef`]), bindings ([`Binding`]) and [`Topology`], the part of the replicated state
//! every core's router reads.
//!
//! Plain data. The rules that change it are in
//! [`MetaState::apply`](super::state::MetaState::apply) (`state.rs`); the cascade helpers here
//! (`remove_bindings_where`, `reap_auto_delete`) are only called from there. Also here: the
//! serde forms of these types used by the snapshot JSON (tuple-keyed maps become lists, field
//! tables their AMQP wire bytes in hex, see `wire.rs`).

use std::collections::{BTreeMap, BTreeSet};

use amq_protocol::types::FieldTable;
use serde::{Deserialize, Serialize};

/// Identifier of a node in the Raft group (raft-rs peer id; never 0).
pub type NodeId = u64;

/// Exchange type (AMQP 0-9-1 spec section 3.1.3; `headers` as RabbitMQ implements it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ExchangeKind {
    /// Routes on exact routing-key equality.
    Direct,
    /// Routes to every bound destination.
    Fanout,
    /// Routes on dotted-word patterns with `*` and `#`.
    Topic,
    /// Routes on message headers (`x-match` all/any).
    Headers,
}

impl ExchangeKind {
    /// The AMQP name of the kind (`"direct"`, `"fanout"`, `"topic"`, `"headers"`).
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
        }
    }

    /// Parses an AMQP exchange type name; `None` for an unknown one (the broker replies
    /// 503 COMMAND_INVALID, spec section 1.1 exchange.declare "type").
    pub fn from_name(name: &str) -> Option<ExchangeKind> {
        match name {
            "direct" => Some(ExchangeKind::Direct),
            "fanout" => Some(ExchangeKind::Fanout),
            "topic" => Some(ExchangeKind::Topic),
            "headers" => Some(ExchangeKind::Headers),
            _ => None,
        }
    }
}

/// A declared exchange.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExchangeDef {
    /// Virtual host the exchange lives in.
    pub vhost: String,
    /// Exchange name (`""` is the default exchange).
    pub name: String,
    /// Routing algorithm.
    pub kind: ExchangeKind,
    /// Survives a node restart ([`Command::NodeBoot`](super::state::Command::NodeBoot) keeps it).
    pub durable: bool,
    /// Deleted by the broker when its last binding as a source goes.
    pub auto_delete: bool,
    /// Clients cannot publish to it directly (only exchange-to-exchange bindings reach it).
    pub internal: bool,
    /// Declare arguments (e.g. `alternate-exchange`), kept as the client sent them.
    #[serde(with = "field_table_serde")]
    pub arguments: FieldTable,
}

/// A declared queue.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueDef {
    /// Virtual host the queue lives in.
    pub vhost: String,
    /// Queue name.
    pub name: String,
    /// Survives a node restart unless exclusive.
    pub durable: bool,
    /// Deleted by the broker when its last consumer goes.
    pub auto_delete: bool,
    /// Connection id that owns an exclusive queue (`None`: not exclusive). Exclusive queues never
    /// survive a node restart.
    pub exclusive_owner: Option<u64>,
    /// Declare arguments (`x-dead-letter-exchange`, `x-consumer-timeout`, ...).
    #[serde(with = "field_table_serde")]
    pub arguments: FieldTable,
    /// Node whose core owns the queue's state.
    pub owner_node: NodeId,
    /// Core (executor index) on `owner_node` that owns the queue (`core::placement`).
    pub owner_core: u32,
    /// Boot epoch of `owner_node` when the queue was placed.
    pub owner_epoch: u64,
    /// Nodes that store a replicated queue's messages (its replica set, `owner_node` among
    /// them while it serves), ascending; chosen at declare (`--replicas`,
    /// `x-quorum-initial-group-size`). Empty: every member (a queue declared before replica
    /// sets existed, and every queue that is not replicated).
    #[serde(default)]
    pub replicas: Vec<NodeId>,
    /// This declaration's id, unique in the cluster's life (0: declared before incarnations
    /// existed). A durable queue's store on disk is marked with it: a store marked with another
    /// id is what an earlier queue of the same name left (deleted while this node was down) and
    /// is discarded, not opened, when this one opens.
    #[serde(default)]
    pub incarnation: u64,
}

impl QueueDef {
    /// Durable and not exclusive: the queue survives a restart of its node (an exclusive one
    /// dies with its connection); in a cluster it is replicated.
    pub fn survives_restart(&self) -> bool {
        self.durable && self.exclusive_owner.is_none()
    }

    /// True when `node` stores this queue's replicated messages: it is in the replica set, or
    /// the set is empty (every member).
    pub fn stored_on(&self, node: NodeId) -> bool {
        self.replicas.is_empty() || self.replicas.contains(&node)
    }
}

/// What a binding routes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DestKind {
    /// queue.bind
    Queue,
    /// exchange.bind (RabbitMQ's exchange-to-exchange extension)
    Exchange,
}

/// A binding from a source exchange to a queue or an exchange.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Binding {
    /// Virtual host of both ends.
    pub vhost: String,
    /// Source exchange name.
    pub source: String,
    /// Whether `dest` names a queue or an exchange.
    pub dest_kind: DestKind,
    /// Destination name.
    pub dest: String,
    /// Binding key (a pattern for topic exchanges).
    pub routing_key: String,
    /// Binding arguments (`x-match` and header values for headers exchanges).
    #[serde(with = "field_table_serde")]
    pub arguments: FieldTable,
}

/// The exchanges predeclared in every virtual host: name and kind. All durable, not auto-delete,
/// not internal, no arguments (RabbitMQ's set; AMQP 0-9-1 spec section 3.1.3.1 requires the
/// default exchange and `amq.direct`/`amq.fanout`/`amq.topic`, `amq.match`/`amq.headers`).
pub const PREDECLARED_EXCHANGES: [(&str, ExchangeKind); 6] = [
    ("", ExchangeKind::Direct),
    ("amq.direct", ExchangeKind::Direct),
    ("amq.fanout", ExchangeKind::Fanout),
    ("amq.topic", ExchangeKind::Topic),
    ("amq.headers", ExchangeKind::Headers),
    ("amq.match", ExchangeKind::Headers),
];

/// Everything in the metadata but the cursors: what every core's router reads. Cheap to share
/// behind an `Arc` (see `MetaHandle::topology`).
///
/// Maps are keyed `(vhost, name)`. Bindings are indexed by `(vhost, source exchange)`, each list
/// in bind order, so a publish finds its candidate bindings with one lookup
/// ([`Topology::bindings_from`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// Declared virtual hosts.
    pub vhosts: BTreeSet<String>,
    /// Exchanges by `(vhost, name)`.
    #[serde(with = "keyed_exchanges")]
    pub exchanges: BTreeMap<(String, String), ExchangeDef>,
    /// Queues by `(vhost, name)`.
    #[serde(with = "keyed_queues")]
    pub queues: BTreeMap<(String, String), QueueDef>,
    /// Bindings by `(vhost, source exchange)`, in bind order; never an empty list.
    #[serde(with = "keyed_bindings")]
    pub bindings: BTreeMap<(String, String), Vec<Binding>>,
    /// Users, permissions and policies (`access.rs`): read by every core's connections for
    /// logins and permission checks, and by queue declares for policies.
    #[serde(default)]
    pub access: super::access::Access,
    /// The cluster's name and permanent id ([`Command::SetClusterName`](super::state::Command::SetClusterName));
    /// `None` until the first start of a node with this code sets them (a log or snapshot
    /// from before has none: the next start sets them).
    #[serde(default)]
    pub cluster: Option<ClusterIdentity>,
}

/// One name and one permanent id for the whole cluster, as RabbitMQ's `cluster_name`
/// (`rabbitmqctl set_cluster_name`, `PUT /api/cluster-name`) and `persistent_cluster_id`
/// (the `rabbitmq_cluster` and `rabbitmq_cluster_permanent_id` labels of
/// `rabbitmq_identity_info`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterIdentity {
    /// The name: `ringmq@<host of the node that set it first>` unless an operator chose one.
    pub name: String,
    /// Set once, with the first name, and never changed: a UUID (version 4, random).
    pub permanent_id: String,
}

impl Topology {
    /// The bindings whose source is exchange `source` in `vhost`, in bind order.
    pub fn bindings_from<'a>(&'a self, vhost: &str, source: &str) -> impl Iterator<Item = &'a Binding> + 'a {
        // BTreeMap<(String, String), _> cannot be probed with (&str, &str) without allocating;
        // a range over the vhost's keys, then a scan, would be slower for the usual few sources.
        let key = (vhost.to_owned(), source.to_owned());
        self.bindings.get(&key).into_iter().flatten()
    }

    /// Every binding, grouped by `(vhost, source)` in key order, each group in bind order.
    pub fn all_bindings(&self) -> impl Iterator<Item = &Binding> + '_ {
        self.bindings.values().flatten()
    }

    /// The bindings whose destination is `dest` (of kind `dest_kind`) in `vhost`. Scans every
    /// binding: O(bindings). Used by queue.delete and exchange.delete, not by routing.
    pub fn bindings_to<'a>(&'a self, vhost: &'a str, dest_kind: DestKind, dest: &'a str) -> impl Iterator<Item = &'a Binding> + 'a {
        self.all_bindings().filter(move |b| b.vhost == vhost && b.dest_kind == dest_kind && b.dest == dest)
    }

    /// The exchange `name` in `vhost`, if declared.
    pub fn exchange(&self, vhost: &str, name: &str) -> Option<&ExchangeDef> {
        self.exchanges.get(&(vhost.to_owned(), name.to_owned()))
    }

    /// The queue `name` in `vhost`, if declared.
    pub fn queue(&self, vhost: &str, name: &str) -> Option<&QueueDef> {
        self.queues.get(&(vhost.to_owned(), name.to_owned()))
    }

    /// Number of bindings.
    pub fn binding_count(&self) -> usize {
        self.bindings.values().map(Vec::len).sum()
    }

    pub(super) fn dest_exists(&self, vhost: &str, dest_kind: DestKind, dest: &str) -> bool {
        let key = (vhost.to_owned(), dest.to_owned());
        match dest_kind {
            DestKind::Queue => self.queues.contains_key(&key),
            DestKind::Exchange => self.exchanges.contains_key(&key),
        }
    }

    /// Removes every binding for which `drop` returns true; returns the (vhost, source) of
    /// each binding that went (for [`Topology::reap_auto_delete`]).
    pub(super) fn remove_bindings_where(&mut self, mut drop: impl FnMut(&Binding) -> bool) -> Vec<(String, String)> {
        let mut sources = Vec::new();
        self.bindings.retain(|key, list| {
            let before = list.len();
            list.retain(|b| !drop(b));
            if list.len() != before {
                sources.push(key.clone());
            }
            !list.is_empty()
        });
        sources
    }

    /// Deletes every auto-delete exchange among `candidates` (sources that just lost a
    /// binding) that has no binding left as a source, as RabbitMQ does; deleting one removes
    /// the bindings to it, which may reap further exchanges.
    pub(super) fn reap_auto_delete(&mut self, mut candidates: Vec<(String, String)>) {
        while let Some(key) = candidates.pop() {
            let reap = self.exchanges.get(&key).is_some_and(|e| e.auto_delete) && !self.bindings.contains_key(&key);
            if !reap {
                continue;
            }
            self.exchanges.remove(&key);
            let (vhost, name) = key;
            candidates.extend(self.remove_bindings_where(|b| b.dest_kind == DestKind::Exchange && b.vhost == vhost && b.dest == name));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// serde helpers: tuple-keyed maps become lists (JSON map keys must be strings), field tables
// become their wire bytes in hex (exact for every AMQP value, NaN included).

mod field_table_serde {
    use super::FieldTable;
    use crate::meta::wire::{field_table_from_wire, field_table_to_wire};
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &FieldTable, s: S) -> Result<S::Ok, S::Error> {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let bytes = field_table_to_wire(t);
        let mut hex = String::with_capacity(bytes.len() * 2);
        for b in bytes {
            hex.push(HEX[usize::from(b >> 4)] as char);
            hex.push(HEX[usize::from(b & 15)] as char);
        }
        s.serialize_str(&hex)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<FieldTable, D::Error> {
        let hex = String::deserialize(d)?;
        if hex.len() % 2 != 0 {
            return Err(D::Error::custom("field table hex of odd length"));
        }
        let digit = |c: u8| match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            _ => Err(D::Error::custom("bad hex digit in field table")),
        };
        let mut bytes = Vec::with_capacity(hex.len() / 2);
        for pair in hex.as_bytes().chunks(2) {
            bytes.push(digit(pair[0])? << 4 | digit(pair[1])?);
        }
        field_table_from_wire(&bytes).ok_or_else(|| D::Error::custom("malformed field table"))
    }
}

macro_rules! keyed_by_vhost_name {
    ($module:ident, $ty:ty) => {
        mod $module {
            use super::*;
            use serde::{Deserializer, Serializer};

            pub fn serialize<S: Serializer>(m: &BTreeMap<(String, String), $ty>, s: S) -> Result<S::Ok, S::Error> {
                s.collect_seq(m.values())
            }

            pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<(String, String), $ty>, D::Error> {
                let list = Vec::<$ty>::deserialize(d)?;
                Ok(list.into_iter().map(|v| ((v.vhost.clone(), v.name.clone()), v)).collect())
            }
        }
    };
}
keyed_by_vhost_name!(keyed_exchanges, ExchangeDef);
keyed_by_vhost_name!(keyed_queues, QueueDef);

mod keyed_bindings {
    use super::*;

    type BySource = BTreeMap<(String, String), Vec<Binding>>;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(m: &BySource, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.values().flatten())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BySource, D::Error> {
        let list = Vec::<Binding>::deserialize(d)?;
        let mut m = BySource::new();
        for b in list {
            m.entry((b.vhost.clone(), b.source.clone())).or_default().push(b);
        }
        Ok(m)
    }
}
