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
//!    value (compare-and-set; DESIGN.md, "Cursor writes are conditional").
//!
//! # Wire format of commands
//! [`encode_batch`] / [`decode_batch`] give the compact binary form stored in one Raft entry
//! (see `storage.rs` for the record around it): a format byte, a varint count, then per command
//! a tag byte and its fields (varint integers, varint-length-prefixed UTF-8 strings, bools as one
//! byte, field tables in their AMQP 0-9-1 wire form, spec section 4.2.5.5). The same field-table
//! form is used by serde, so a table holding a NaN double or a byte array survives a snapshot
//! exactly.

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
    /// Survives a node restart ([`Command::NodeBoot`] keeps it).
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

    fn dest_exists(&self, vhost: &str, dest_kind: DestKind, dest: &str) -> bool {
        let key = (vhost.to_owned(), dest.to_owned());
        match dest_kind {
            DestKind::Queue => self.queues.contains_key(&key),
            DestKind::Exchange => self.exchanges.contains_key(&key),
        }
    }

    /// Removes every binding for which `drop` returns true; returns the (vhost, source) of
    /// each binding that went (for [`Topology::reap_auto_delete`]).
    fn remove_bindings_where(&mut self, mut drop: impl FnMut(&Binding) -> bool) -> Vec<(String, String)> {
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
    fn reap_auto_delete(&mut self, mut candidates: Vec<(String, String)>) {
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

/// The whole replicated state: topology, cursors and boot epochs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetaState {
    /// Vhosts, exchanges, queues, bindings.
    pub topology: Topology,
    /// Shared cursor per queue, by `(vhost, queue)`: the queue offset below which every message
    /// has been handed out (DESIGN.md, "The ack path", rule 1).
    #[serde(with = "keyed_cursors")]
    pub cursors: BTreeMap<(String, String), u64>,
    /// Boot epoch per node: 1 after its first boot, +1 on every [`Command::NodeBoot`].
    pub boot_epochs: BTreeMap<NodeId, u64>,
    /// Index of the last Raft entry applied to this state (set by the driver, not by `apply`).
    pub applied_index: u64,
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
    /// A node (re)started → `Epoch(new epoch)`. Bumps the node's boot epoch and removes every
    /// non-durable queue, every exclusive queue, every non-durable exchange, and the bindings that
    /// name a removed object. Bindings between surviving (durable) objects stay.
    NodeBoot {
        /// The node that booted.
        node: NodeId,
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
}

impl Command {
    /// True when applying this command with this outcome changed the [`Topology`] (what routers
    /// read). Cursor writes and no-op outcomes return false.
    pub fn changed_topology(&self, outcome: &Outcome) -> bool {
        match self {
            Command::CursorCas { .. } => false,
            Command::NodeBoot { .. } => true,
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
                self.cursors.insert(key, 0);
                Outcome::Created
            }
            Command::DeleteQueue { vhost, name } => {
                let key = (vhost.clone(), name.clone());
                if topo.queues.remove(&key).is_none() {
                    return Outcome::NotFound;
                }
                self.cursors.remove(&key);
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
            Command::NodeBoot { node } => {
                let epoch = self.boot_epochs.entry(*node).or_insert(0);
                *epoch += 1;
                let epoch = *epoch;
                let gone_queues: Vec<(String, String)> =
                    topo.queues.iter().filter(|(_, q)| !q.durable || q.exclusive_owner.is_some()).map(|(k, _)| k.clone()).collect();
                for key in &gone_queues {
                    topo.queues.remove(key);
                    self.cursors.remove(key);
                }
                let gone_exchanges: Vec<(String, String)> =
                    topo.exchanges.iter().filter(|(_, e)| !e.durable).map(|(k, _)| k.clone()).collect();
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
        }
    }

    /// The stored cursor of queue `queue` in `vhost` (a queue offset), if the queue exists.
    pub fn cursor(&self, vhost: &str, queue: &str) -> Option<u64> {
        self.cursors.get(&(vhost.to_owned(), queue.to_owned())).copied()
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

// ---------------------------------------------------------------------------------------------
// Binary codec of command batches (the data of one Raft entry).

/// Format byte at the start of every encoded batch.
const BATCH_FORMAT_V1: u8 = 1;

/// Error decoding a command batch: the entry is not one this code wrote.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad command batch at byte {at}: {what}")]
pub struct DecodeError {
    /// Byte offset in the entry data where decoding failed.
    pub at: usize,
    /// What was wrong.
    pub what: &'static str,
}

/// Appends the binary form of `cmds` (one batch, one Raft entry's data) to `out`; `count` must
/// be the number of commands `cmds` yields.
pub fn encode_batch<'a>(count: usize, cmds: impl IntoIterator<Item = &'a Command>, out: &mut Vec<u8>) {
    out.push(BATCH_FORMAT_V1);
    put_varint(out, count as u64);
    let mut n = 0;
    for cmd in cmds {
        encode_command(cmd, out);
        n += 1;
    }
    debug_assert_eq!(n, count, "encode_batch: count does not match the commands");
}

/// Decodes a batch written by [`encode_batch`].
pub fn decode_batch(data: &[u8]) -> Result<Vec<Command>, DecodeError> {
    let mut r = Reader { buf: data, pos: 0 };
    if r.u8()? != BATCH_FORMAT_V1 {
        return Err(r.err("unknown batch format"));
    }
    let n = r.varint()?;
    if n > data.len() as u64 {
        return Err(r.err("command count larger than the entry"));
    }
    let mut cmds = Vec::with_capacity(n as usize);
    for _ in 0..n {
        cmds.push(decode_command(&mut r)?);
    }
    if r.pos != data.len() {
        return Err(r.err("trailing bytes after the batch"));
    }
    Ok(cmds)
}

const TAG_DECLARE_VHOST: u8 = 1;
const TAG_DECLARE_EXCHANGE: u8 = 2;
const TAG_DELETE_EXCHANGE: u8 = 3;
const TAG_DECLARE_QUEUE: u8 = 4;
const TAG_DELETE_QUEUE: u8 = 5;
const TAG_BIND: u8 = 6;
const TAG_UNBIND: u8 = 7;
const TAG_CURSOR_CAS: u8 = 8;
const TAG_NODE_BOOT: u8 = 9;

fn encode_command(cmd: &Command, out: &mut Vec<u8>) {
    match cmd {
        Command::DeclareVhost { name } => {
            out.push(TAG_DECLARE_VHOST);
            put_str(out, name);
        }
        Command::DeclareExchange(def) => {
            out.push(TAG_DECLARE_EXCHANGE);
            put_str(out, &def.vhost);
            put_str(out, &def.name);
            out.push(match def.kind {
                ExchangeKind::Direct => 0,
                ExchangeKind::Fanout => 1,
                ExchangeKind::Topic => 2,
                ExchangeKind::Headers => 3,
            });
            out.push(def.durable as u8 | (def.auto_delete as u8) << 1 | (def.internal as u8) << 2);
            put_table(out, &def.arguments);
        }
        Command::DeleteExchange { vhost, name, if_unused } => {
            out.push(TAG_DELETE_EXCHANGE);
            put_str(out, vhost);
            put_str(out, name);
            out.push(*if_unused as u8);
        }
        Command::DeclareQueue(def) => {
            out.push(TAG_DECLARE_QUEUE);
            put_str(out, &def.vhost);
            put_str(out, &def.name);
            out.push(def.durable as u8 | (def.auto_delete as u8) << 1 | (def.exclusive_owner.is_some() as u8) << 2);
            if let Some(owner) = def.exclusive_owner {
                put_varint(out, owner);
            }
            put_table(out, &def.arguments);
            put_varint(out, def.owner_node);
            put_varint(out, u64::from(def.owner_core));
            put_varint(out, def.owner_epoch);
        }
        Command::DeleteQueue { vhost, name } => {
            out.push(TAG_DELETE_QUEUE);
            put_str(out, vhost);
            put_str(out, name);
        }
        Command::Bind(b) | Command::Unbind(b) => {
            out.push(if matches!(cmd, Command::Bind(_)) { TAG_BIND } else { TAG_UNBIND });
            put_str(out, &b.vhost);
            put_str(out, &b.source);
            out.push(match b.dest_kind {
                DestKind::Queue => 0,
                DestKind::Exchange => 1,
            });
            put_str(out, &b.dest);
            put_str(out, &b.routing_key);
            put_table(out, &b.arguments);
        }
        Command::CursorCas { vhost, queue, expected, new } => {
            out.push(TAG_CURSOR_CAS);
            put_str(out, vhost);
            put_str(out, queue);
            put_varint(out, *expected);
            put_varint(out, *new);
        }
        Command::NodeBoot { node } => {
            out.push(TAG_NODE_BOOT);
            put_varint(out, *node);
        }
    }
}

fn decode_command(r: &mut Reader<'_>) -> Result<Command, DecodeError> {
    let tag = r.u8()?;
    Ok(match tag {
        TAG_DECLARE_VHOST => Command::DeclareVhost { name: r.string()? },
        TAG_DECLARE_EXCHANGE => {
            let vhost = r.string()?;
            let name = r.string()?;
            let kind = match r.u8()? {
                0 => ExchangeKind::Direct,
                1 => ExchangeKind::Fanout,
                2 => ExchangeKind::Topic,
                3 => ExchangeKind::Headers,
                _ => return Err(r.err("unknown exchange kind")),
            };
            let flags = r.u8()?;
            Command::DeclareExchange(ExchangeDef {
                vhost,
                name,
                kind,
                durable: flags & 1 != 0,
                auto_delete: flags & 2 != 0,
                internal: flags & 4 != 0,
                arguments: r.table()?,
            })
        }
        TAG_DELETE_EXCHANGE => Command::DeleteExchange { vhost: r.string()?, name: r.string()?, if_unused: r.u8()? != 0 },
        TAG_DECLARE_QUEUE => {
            let vhost = r.string()?;
            let name = r.string()?;
            let flags = r.u8()?;
            let exclusive_owner = if flags & 4 != 0 { Some(r.varint()?) } else { None };
            let arguments = r.table()?;
            let owner_node = r.varint()?;
            let owner_core = u32::try_from(r.varint()?).map_err(|_| r.err("owner core out of range"))?;
            Command::DeclareQueue(QueueDef {
                vhost,
                name,
                durable: flags & 1 != 0,
                auto_delete: flags & 2 != 0,
                exclusive_owner,
                arguments,
                owner_node,
                owner_core,
                owner_epoch: r.varint()?,
            })
        }
        TAG_DELETE_QUEUE => Command::DeleteQueue { vhost: r.string()?, name: r.string()? },
        TAG_BIND | TAG_UNBIND => {
            let vhost = r.string()?;
            let source = r.string()?;
            let dest_kind = match r.u8()? {
                0 => DestKind::Queue,
                1 => DestKind::Exchange,
                _ => return Err(r.err("unknown destination kind")),
            };
            let b = Binding { vhost, source, dest_kind, dest: r.string()?, routing_key: r.string()?, arguments: r.table()? };
            if tag == TAG_BIND {
                Command::Bind(b)
            } else {
                Command::Unbind(b)
            }
        }
        TAG_CURSOR_CAS => Command::CursorCas { vhost: r.string()?, queue: r.string()?, expected: r.varint()?, new: r.varint()? },
        TAG_NODE_BOOT => Command::NodeBoot { node: r.varint()? },
        _ => return Err(r.err("unknown command tag")),
    })
}

/// LEB128 unsigned varint (1 byte for values < 128, at most 10 bytes).
pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn put_table(out: &mut Vec<u8>, t: &FieldTable) {
    if t.inner().is_empty() {
        put_varint(out, 0);
        return;
    }
    let bytes = field_table_to_wire(t);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(&bytes);
}

/// Encodes a field table in its AMQP 0-9-1 wire form (4-byte big-endian length, then entries;
/// spec section 4.2.5.5).
pub fn field_table_to_wire(t: &FieldTable) -> Vec<u8> {
    use amq_protocol::types::generation::gen_field_table;
    match gen_field_table(t)(Vec::new().into()) {
        Ok(ctx) => ctx.write,
        // Writing to a Vec cannot fail short of allocation failure, which aborts anyway.
        Err(e) => unreachable!("field table generation into a Vec failed: {e:?}"),
    }
}

/// Decodes a field table from its AMQP 0-9-1 wire form; `None` when malformed or followed by
/// trailing bytes.
pub fn field_table_from_wire(bytes: &[u8]) -> Option<FieldTable> {
    use amq_protocol::types::parsing::parse_field_table;
    match parse_field_table(bytes) {
        Ok(([], t)) => Some(t),
        _ => None,
    }
}

pub(crate) struct Reader<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn err(&self, what: &'static str) -> DecodeError {
        DecodeError { at: self.pos, what }
    }

    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        let b = *self.buf.get(self.pos).ok_or_else(|| self.err("truncated"))?;
        self.pos += 1;
        Ok(b)
    }

    pub(crate) fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.u8()?;
            let bits = u64::from(b & 0x7f);
            if i == 9 && b > 1 {
                return Err(self.err("varint overflows u64"));
            }
            v |= bits << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint longer than 10 bytes"))
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| self.err("truncated"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn len(&mut self) -> Result<usize, DecodeError> {
        let n = self.varint()?;
        usize::try_from(n).map_err(|_| self.err("length out of range"))
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.len()?;
        let at = self.pos;
        let b = self.bytes(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError { at, what: "string is not UTF-8" })
    }

    fn table(&mut self) -> Result<FieldTable, DecodeError> {
        let n = self.len()?;
        if n == 0 {
            return Ok(FieldTable::default());
        }
        let at = self.pos;
        let b = self.bytes(n)?;
        field_table_from_wire(b).ok_or(DecodeError { at, what: "malformed field table" })
    }
}

// ---------------------------------------------------------------------------------------------
// serde helpers: tuple-keyed maps become lists (JSON map keys must be strings), field tables
// become their wire bytes in hex (exact for every AMQP value, NaN included).

mod field_table_serde {
    use super::{field_table_from_wire, field_table_to_wire, FieldTable};
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
    use proptest::prelude::*;

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

    fn cas(queue: &str, expected: u64, new: u64) -> Command {
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
        assert_eq!(applied(&mut st, Command::NodeBoot { node: 1 }), Outcome::Epoch(1));
        assert_eq!(applied(&mut st, Command::NodeBoot { node: 2 }), Outcome::Epoch(1));
        assert_eq!(applied(&mut st, Command::NodeBoot { node: 1 }), Outcome::Epoch(2));
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
    fn field_tables_survive_codec_and_json_exactly() {
        let mut inner = FieldTable::default();
        inner.insert("n".into(), AMQPValue::LongLongInt(-5));
        let t = args(&[
            ("x-dead-letter-exchange", AMQPValue::LongString("dlx".into())),
            ("x-nan", AMQPValue::Double(f64::NAN)),
            ("x-bytes", AMQPValue::ByteArray(vec![0u8, 255, 7].into())),
            ("x-table", AMQPValue::FieldTable(inner)),
            ("x-bool", AMQPValue::Boolean(true)),
        ]);
        let mut q = queue("q", true, Some(3));
        q.arguments = t.clone();
        let cmd = Command::DeclareQueue(q);
        let mut buf = Vec::new();
        encode_batch(1, [&cmd], &mut buf);
        let back = decode_batch(&buf).unwrap();
        let Command::DeclareQueue(back_q) = &back[0] else { panic!("wrong command") };
        // NaN != NaN, so compare wire bytes.
        assert_eq!(field_table_to_wire(&back_q.arguments), field_table_to_wire(&t));

        let mut st = MetaState::default();
        st.apply(&cmd);
        let json = serde_json::to_vec(&st).unwrap();
        let st2: MetaState = serde_json::from_slice(&json).unwrap();
        let q2 = st2.topology.queue("/", "q").unwrap();
        assert_eq!(field_table_to_wire(&q2.arguments), field_table_to_wire(&t));
    }

    #[test]
    fn decode_rejects_garbage() {
        assert!(decode_batch(&[]).is_err());
        assert!(decode_batch(&[9]).is_err());
        assert!(decode_batch(&[1, 1, 200]).is_err());
        assert!(decode_batch(&[1, 5, 9]).is_err());
        let mut buf = Vec::new();
        encode_batch(1, [&cas("q", 1, 2)], &mut buf);
        buf.push(0);
        assert!(decode_batch(&buf).is_err(), "trailing byte");
        buf.pop();
        buf.pop();
        assert!(decode_batch(&buf).is_err(), "truncated");
    }

    // ---- property tests ----------------------------------------------------------------

    fn name() -> impl Strategy<Value = String> {
        prop_oneof![Just("a"), Just("b"), Just("c"), Just("amq.direct")].prop_map(String::from)
    }

    fn table() -> impl Strategy<Value = FieldTable> {
        prop_oneof![
            3 => Just(FieldTable::default()),
            1 => (0i64..3).prop_map(|n| args(&[("x-n", AMQPValue::LongLongInt(n))])),
            1 => Just(args(&[("x-match", AMQPValue::LongString("any".into()))])),
        ]
    }

    fn kind() -> impl Strategy<Value = ExchangeKind> {
        prop_oneof![Just(ExchangeKind::Direct), Just(ExchangeKind::Fanout), Just(ExchangeKind::Topic), Just(ExchangeKind::Headers)]
    }

    fn binding() -> impl Strategy<Value = Binding> {
        let vhost = prop_oneof![4 => Just("/".to_string()), 1 => Just("v2".to_string())];
        (vhost, name(), prop_oneof![Just(DestKind::Queue), Just(DestKind::Exchange)], name(), prop_oneof![Just("k"), Just("#")], table())
            .prop_map(|(vhost, source, dest_kind, dest, key, arguments)| Binding {
                vhost,
                source,
                dest_kind,
                dest,
                routing_key: key.into(),
                arguments,
            })
    }

    fn command() -> impl Strategy<Value = Command> {
        let vhost = prop_oneof![4 => Just("/".to_string()), 1 => Just("v2".to_string())];
        let exch = (vhost.clone(), name(), kind(), any::<bool>(), any::<bool>(), table()).prop_map(
            |(vhost, name, kind, durable, internal, arguments)| {
                Command::DeclareExchange(ExchangeDef { vhost, name, kind, durable, auto_delete: false, internal, arguments })
            },
        );
        let queue = (vhost.clone(), name(), any::<bool>(), proptest::option::of(0u64..3), table()).prop_map(
            |(vhost, name, durable, exclusive_owner, arguments)| {
                Command::DeclareQueue(QueueDef {
                    vhost,
                    name,
                    durable,
                    auto_delete: false,
                    exclusive_owner,
                    arguments,
                    owner_node: 1,
                    owner_core: 3,
                    owner_epoch: 2,
                })
            },
        );
        prop_oneof![
            1 => vhost.clone().prop_map(|name| Command::DeclareVhost { name }),
            3 => exch,
            2 => (vhost.clone(), name(), any::<bool>())
                .prop_map(|(vhost, name, if_unused)| Command::DeleteExchange { vhost, name, if_unused }),
            3 => queue,
            2 => (vhost.clone(), name()).prop_map(|(vhost, name)| Command::DeleteQueue { vhost, name }),
            4 => binding().prop_map(Command::Bind),
            2 => binding().prop_map(Command::Unbind),
            6 => (vhost, name(), 0u64..4, 0u64..4)
                .prop_map(|(vhost, queue, expected, new)| Command::CursorCas { vhost, queue, expected, new }),
            1 => (1u64..3).prop_map(|node| Command::NodeBoot { node }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Invariants hold after every command; CAS applies exactly when the model's cursor
        /// equals `expected`; cascades leave no dangling binding or cursor; every command
        /// survives the entry codec; the state survives JSON; replay is deterministic.
        #[test]
        fn apply_keeps_invariants_and_matches_the_cursor_model(
            cmds in proptest::collection::vec(command(), 1..60)
        ) {
            let mut st = MetaState::default();
            let mut model: BTreeMap<(String, String), u64> = BTreeMap::new();
            for cmd in &cmds {
                let before = st.clone();
                let out = st.apply(cmd);
                prop_assert_eq!(st.check_invariants(), Ok(()), "after {:?}", cmd);
                match (cmd, &out) {
                    (Command::CursorCas { vhost, queue, expected, new }, _) => {
                        let key = (vhost.clone(), queue.clone());
                        match model.get_mut(&key) {
                            Some(cur) if *cur == *expected => {
                                prop_assert_eq!(&out, &Outcome::CasApplied);
                                *cur = *new;
                            }
                            Some(cur) => prop_assert_eq!(&out, &Outcome::CasRejected { current: Some(*cur) }),
                            None => prop_assert_eq!(&out, &Outcome::CasRejected { current: None }),
                        }
                        prop_assert_eq!(&st.topology, &before.topology);
                    }
                    (Command::DeclareQueue(q), Outcome::Created) => {
                        model.insert((q.vhost.clone(), q.name.clone()), 0);
                    }
                    _ => {}
                }
                if !cmd.changed_topology(&out) {
                    prop_assert_eq!(&st.topology, &before.topology, "no-op changed topology");
                }
                // Queues deleted by DeleteQueue/NodeBoot drop out of the model.
                model.retain(|k, _| st.topology.queues.contains_key(k));
                prop_assert_eq!(&st.cursors, &model);

                let mut buf = Vec::new();
                encode_batch(1, [cmd], &mut buf);
                prop_assert_eq!(decode_batch(&buf).unwrap(), vec![cmd.clone()]);
            }
            let json = serde_json::to_vec(&st).unwrap();
            let back: MetaState = serde_json::from_slice(&json).unwrap();
            prop_assert_eq!(&back, &st);

            let mut again = MetaState::default();
            let mut buf = Vec::new();
            encode_batch(cmds.len(), &cmds, &mut buf);
            for cmd in decode_batch(&buf).unwrap() {
                again.apply(&cmd);
            }
            prop_assert_eq!(&again, &st);
        }
    }
}
