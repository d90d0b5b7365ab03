//! Declare, delete, purge, bind and unbind, as the domain does them: the one implementation
//! behind the AMQP methods (`amqp/methods/queue.rs`, `exchange.rs`) and the management API
//! (`mgmt`), so both answer alike. Each function runs on a core's executor, against that
//! core's [`Node`] (its routing copy, the metadata group, its mesh to the queues).
//!
//! Errors are [`TopologyError`]: a [`QueueError`] (404, 403, 406, 506, 541) or one of the
//! two codes only topology methods give (405 RESOURCE_LOCKED, 503 COMMAND_INVALID); the
//! protocol layer maps them to reply codes, the management API to HTTP statuses.
//!
//! # Invariants
//! - Every write goes through the metadata group (`meta::state::Command`); the routing copies
//!   of all cores follow from the committed topology.
//! - A queue declare answers once the queue's store is open (declare-ok means it can take
//!   messages); a declare whose store cannot open is taken back ([`Node::undeclare`]).

use std::rc::Rc;

use amq_protocol::types::{AMQPValue, FieldTable};

use super::node::Node;
use super::router::{bool_arg, int_arg, string_arg, Router};
use super::{reply_channel, QueueError, QueueOp, QueueRef};
use crate::core::placement;
use crate::meta::state::{Binding, Command, DestKind, ExchangeDef, ExchangeKind, Outcome, QueueDef};
use crate::meta::MetaError;
use crate::observe::Stats;

/// A refused topology operation, in the domain's words.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// One of the refusals a queue operation gives (404, 403, 406, 506, 541).
    #[error("{0}")]
    Queue(#[from] QueueError),
    /// Another connection's exclusive queue: 405 RESOURCE_LOCKED, channel scope.
    #[error("{0}")]
    ResourceLocked(String),
    /// A request that cannot be carried out as given (an unknown exchange type): 503
    /// COMMAND_INVALID, connection scope.
    #[error("{0}")]
    CommandInvalid(String),
}

impl TopologyError {
    fn not_found(s: String) -> Self {
        TopologyError::Queue(QueueError::NotFound(s))
    }
    fn access_refused(s: String) -> Self {
        TopologyError::Queue(QueueError::AccessRefused(s))
    }
    fn precondition_failed(s: String) -> Self {
        TopologyError::Queue(QueueError::PreconditionFailed(s))
    }
    /// True for a 404 NOT_FOUND.
    pub fn is_not_found(&self) -> bool {
        matches!(self, TopologyError::Queue(QueueError::NotFound(_)))
    }
}

/// Maps a metadata failure: 506 RESOURCE_ERROR (the request may succeed later) when the
/// metadata log has no disk space or the cluster has no quorum, else 541 INTERNAL_ERROR.
pub fn meta_error(e: MetaError) -> TopologyError {
    match e {
        MetaError::DiskFull { .. } | MetaError::NoQuorum { .. } | MetaError::NotLeader { .. } => {
            TopologyError::Queue(QueueError::ResourceError(format!("metadata store: {e}")))
        }
        e => TopologyError::Queue(QueueError::InternalError(format!("metadata store: {e}"))),
    }
}

/// Who asks: a client connection of this node (exclusive queues are its own or locked), or
/// the operator through the management API (no queue is locked to it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// A connection of this node, by id.
    Connection(u64),
    /// The management API.
    Operator,
}

/// Looks a name up in the core's routing copy with `find`; on a miss in a cluster, waits for
/// a metadata read barrier and looks again, so a name declared on another node a moment ago
/// is found here too. A hit costs nothing extra.
///
/// # Errors
/// 506 RESOURCE_ERROR when the barrier finds no quorum ([`meta_error`]).
pub async fn find_synced<T>(node: &Node, find: impl Fn(&Router) -> Option<T>) -> Result<Option<T>, TopologyError> {
    if let Some(hit) = find(&node.router()) {
        return Ok(Some(hit));
    }
    if !node.shared.meta.is_cluster() {
        return Ok(None);
    }
    node.shared.meta.sync().await.map_err(meta_error)?;
    Ok(find(&node.router()))
}

/// Looks queue `vhost`/`name` up for an operation by `caller`.
///
/// # Errors
/// 404 NOT_FOUND when missing; 405 RESOURCE_LOCKED when it is another connection's exclusive
/// queue (spec 1.7.2.1, rule "exclusive"); 506 when the barrier finds no quorum.
pub async fn queue_lookup(node: &Node, vhost: &str, name: &str, caller: Caller) -> Result<(QueueRef, QueueDef), TopologyError> {
    // The definition and the reference from one router: the metadata thread can publish a
    // topology without the queue between two `router()` calls (a delete on another core).
    let (def, qref) = find_synced(node, |r| Some((r.topology.queue(vhost, name)?.clone(), r.queue_ref(vhost, name)?)))
        .await?
        .ok_or_else(|| TopologyError::not_found(format!("no queue '{name}' in vhost '{vhost}'")))?;
    // Connection ids are per node: an exclusive queue belongs to a connection of its own node.
    let here = node.shared.meta.node_id();
    if let (Caller::Connection(conn), Some(owner)) = (caller, def.exclusive_owner) {
        if owner != conn || def.owner_node != here {
            return Err(TopologyError::ResourceLocked(format!(
                "cannot obtain exclusive access to locked queue '{name}' in vhost '{vhost}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration."
            )));
        }
    }
    Ok((qref, def))
}

/// A queue's (ready messages, consumers), as queue.declare-ok reports them.
///
/// # Errors
/// The queue's refusal (404 when it went), 541 when it did not answer.
pub async fn queue_stats(node: &Rc<Node>, q: &QueueRef) -> Result<(u32, u32), TopologyError> {
    let (reply, rx) = reply_channel();
    node.send_from_connection(q, QueueOp::Stats { reply });
    Ok(rx.recv_async().await.map_err(|_| QueueError::InternalError("queue did not answer".into()))??)
}

/// What a queue.declare asks for.
#[derive(Clone, Debug)]
pub struct QueueDeclare {
    /// Virtual host.
    pub vhost: String,
    /// Queue name (not empty: the caller names a server-named queue).
    pub name: String,
    /// The name was made by the server (`amq.gen-…`): the reserved prefix is allowed.
    pub server_named: bool,
    /// Durable.
    pub durable: bool,
    /// Auto-delete after the last consumer goes.
    pub auto_delete: bool,
    /// Exclusive to the calling connection.
    pub exclusive: bool,
    /// x-arguments.
    pub arguments: FieldTable,
    /// Who declares: an existing exclusive queue of another connection is locked to a
    /// connection (405), and only a connection can own an exclusive queue.
    pub caller: Caller,
}

/// A queue.declare's answer.
#[derive(Clone, Debug)]
pub struct Declared {
    /// Ready messages.
    pub messages: u32,
    /// Consumers.
    pub consumers: u32,
    /// The queue, when this declare created it.
    pub created: Option<QueueRef>,
}

/// How long a queue.declare waits for a queue being deleted to go ([`wait_gone`]).
const GONE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A non-passive queue.declare: creates the queue (and opens its store), or checks an
/// existing one is equivalent; returns its counts.
///
/// A queue that is going (auto-delete after its last consumer, or x-expires) is still in the
/// metadata until its delete commits, and its owner answers 404 until its files are gone:
/// the declare waits for it to go and declares it anew, as RabbitMQ (bounded by 2 s).
///
/// # Errors
/// 403 for the reserved `amq.` prefix; 406 for bad or inequivalent arguments; 405 for another
/// connection's exclusive queue; 506 when file descriptors run out or there is no quorum;
/// the store's errors; 503 for an exclusive queue asked by the operator (no connection owns it).
pub async fn queue_declare(node: &Rc<Node>, req: QueueDeclare) -> Result<Declared, TopologyError> {
    let (vhost, name) = (req.vhost.as_str(), req.name.as_str());
    if !req.server_named && name.starts_with("amq.") {
        return Err(TopologyError::access_refused(format!("queue name '{name}' contains reserved prefix 'amq.*'")));
    }
    let exclusive_owner = match (req.exclusive, req.caller) {
        (false, _) => None,
        (true, Caller::Connection(id)) => Some(id),
        (true, Caller::Operator) => return Err(TopologyError::CommandInvalid("an exclusive queue belongs to a connection".into())),
    };
    let meta = &node.shared.meta;
    let mut def = QueueDef {
        vhost: vhost.to_string(),
        name: name.to_string(),
        durable: req.durable,
        auto_delete: req.auto_delete,
        exclusive_owner,
        arguments: req.arguments.clone(),
        owner_node: meta.node_id(),
        owner_core: match req.caller {
            // The declaring connection's core, while the cores stay balanced; RabbitMQ's
            // `balanced` locator (or a classic queue's older `x-queue-master-locator` values
            // other than client-local) asks for the spread of the name hash instead.
            Caller::Connection(_) if !balanced_locator(&req.arguments) => placement::local_core(node.id, &queues_per_core(node)),
            _ => placement::owner_core(vhost, name, node.shared.cores),
        },
        owner_epoch: meta.boot_epoch(),
        replicas: Vec::new(),
        incarnation: super::ids::cluster_unique_id(meta.node_id(), node.shared.next_id()),
    };
    validate_queue_arguments(&def)?;
    def.replicas = super::replicas::replica_set_for(&node.shared, &def);
    let caller = req.caller;
    let deadline = std::time::Instant::now() + GONE_WAIT;
    loop {
        match declare_once(node, &def, caller).await {
            Err(e) if e.is_not_found() && std::time::Instant::now() < deadline => wait_gone(node, vhost, name, deadline).await,
            r => {
                if let Ok(d) = &r {
                    let stats = node.stats();
                    Stats::add(&stats.queues_declared, 1);
                    Stats::add(&stats.queues_created, d.created.is_some() as u64);
                }
                return r;
            }
        }
    }
}

/// Whether the declare's `x-queue-leader-locator` (RabbitMQ 3.10+) or `x-queue-master-locator`
/// asks for a balanced placement rather than `client-local` (the default).
fn balanced_locator(args: &FieldTable) -> bool {
    let locator = string_arg(args, "x-queue-leader-locator").or_else(|| string_arg(args, "x-queue-master-locator"));
    matches!(locator, Some("balanced" | "min-masters" | "random" | "least-leaders"))
}

/// How many of this node's queues each of its cores owns (the metadata's latest topology:
/// every declare answered so far, on any connection; one still on its way is not counted).
fn queues_per_core(node: &Node) -> Vec<usize> {
    let cores = node.shared.cores.max(1);
    let me = node.shared.meta.node_id();
    let mut owned = vec![0usize; cores as usize];
    for q in node.shared.meta.topology().queues.values().filter(|q| q.owner_node == me) {
        owned[(q.owner_core % cores) as usize] += 1;
    }
    owned
}

/// One attempt at a non-passive queue.declare of `def`.
async fn declare_once(node: &Rc<Node>, def: &QueueDef, caller: Caller) -> Result<Declared, TopologyError> {
    let (vhost, name) = (def.vhost.as_str(), def.name.as_str());
    let existing = node.router().topology.queue(vhost, name).cloned();
    if existing.is_none() {
        // Descriptors for the new queue's files (one per shard segment: its messages,
        // and for a durable queue its unacked index), within the headroom.
        if let Err((open, max)) = node.shared.alarms.reserve_fds(if def.durable { 2 } else { 1 }) {
            return Err(TopologyError::Queue(QueueError::ResourceError(format!(
                "cannot declare queue '{name}' in vhost '{vhost}': file descriptor limit nearly reached ({open} of {max} open)"
            ))));
        }
    }
    let old = match existing {
        Some(old) => old,
        None => match node.shared.meta.propose(Command::DeclareQueue(def.clone())).await.map_err(meta_error)? {
            Outcome::QueueExists(old) => old,
            _ => {
                // Open its store now. Deleted meanwhile (another connection's queue.delete):
                // 404, and declared anew by the caller's retry.
                let q = node
                    .router()
                    .queue_ref(vhost, name)
                    .ok_or_else(|| TopologyError::not_found(format!("no queue '{name}' in vhost '{vhost}'")))?;
                if let Err(e) = queue_stats(node, &q).await {
                    node.undeclare(def).await;
                    return Err(e);
                }
                if !def.replicas.is_empty() {
                    tracing::info!(queue = %name, vhost = %vhost, replicas = ?def.replicas, "declared a replicated queue");
                }
                return Ok(Declared { messages: 0, consumers: 0, created: Some(q) });
            }
        },
    };
    let (q, _) = queue_lookup(node, vhost, name, caller).await?;
    check_queue_equivalent(&old, def)?;
    let (messages, consumers) = queue_stats(node, &q).await?;
    Ok(Declared { messages, consumers, created: None })
}

/// Waits until the queue `vhost`/`name` has left this node's topology (its delete committed)
/// and 2 ms more, polling every 2 ms, until `deadline` at the latest. Its owner removes its
/// files after that commit; the new queue's store opens only once they are gone
/// (`store_files::Removals`), on whichever core it lands.
async fn wait_gone(node: &Node, vhost: &str, name: &str, deadline: std::time::Instant) {
    let step = std::time::Duration::from_millis(2);
    while node.router().topology.queue(vhost, name).is_some() && std::time::Instant::now() < deadline {
        glommio::timer::sleep(step).await;
    }
    glommio::timer::sleep(step).await;
}

/// queue.purge: drops every ready message; returns how many.
///
/// # Errors
/// 404 / 405 as [`queue_lookup`]; the queue's refusal.
pub async fn queue_purge(node: &Rc<Node>, vhost: &str, name: &str, caller: Caller) -> Result<u32, TopologyError> {
    let (q, _) = queue_lookup(node, vhost, name, caller).await?;
    let (reply, rx) = reply_channel();
    node.send_from_connection(&q, QueueOp::Purge { reply });
    Ok(rx.recv_async().await.map_err(|_| QueueError::InternalError("queue did not answer".into()))??)
}

/// queue.delete with its conditions: returns the messages deleted and the queue (`None`
/// when there was none: 0 messages, as RabbitMQ answers a delete of a missing queue).
///
/// # Errors
/// 406 when `if_unused` or `if_empty` does not hold; 405 for another connection's exclusive
/// queue; the queue's and the metadata's errors.
pub async fn queue_delete(
    node: &Rc<Node>,
    vhost: &str,
    name: &str,
    caller: Caller,
    if_unused: bool,
    if_empty: bool,
) -> Result<(u32, Option<QueueRef>), TopologyError> {
    match queue_lookup(node, vhost, name, caller).await {
        Err(e) if e.is_not_found() => Ok((0, None)),
        Err(e) => Err(e),
        Ok((q, _)) => {
            let (reply, rx) = reply_channel();
            node.send_from_connection(&q, QueueOp::Delete { if_unused, if_empty, reply });
            let n = rx.recv_async().await.map_err(|_| QueueError::InternalError("queue did not answer".into()))??;
            Ok((n, Some(q)))
        }
    }
}

/// Checks a redeclare against the existing queue (406 "inequivalent arg …").
fn check_queue_equivalent(old: &QueueDef, new: &QueueDef) -> Result<(), TopologyError> {
    let what = |arg: &str, got: bool, cur: bool| {
        TopologyError::precondition_failed(format!(
            "inequivalent arg '{arg}' for queue '{}' in vhost '{}': received '{got}' but current is '{cur}'",
            old.name, old.vhost
        ))
    };
    if old.durable != new.durable {
        return Err(what("durable", new.durable, old.durable));
    }
    if old.auto_delete != new.auto_delete {
        return Err(what("auto_delete", new.auto_delete, old.auto_delete));
    }
    if old.exclusive_owner.is_some() != new.exclusive_owner.is_some() {
        return Err(what("exclusive", new.exclusive_owner.is_some(), old.exclusive_owner.is_some()));
    }
    if old.arguments != new.arguments {
        return Err(TopologyError::precondition_failed(format!(
            "inequivalent arguments for queue '{}' in vhost '{}'",
            old.name, old.vhost
        )));
    }
    Ok(())
}

/// RabbitMQ's name of a field table value's type, as its 406 texts print it.
fn rabbit_type(v: &AMQPValue) -> &'static str {
    use AMQPValue as V;
    match v {
        V::Boolean(_) => "bool",
        V::ShortShortInt(_) => "byte",
        V::ShortShortUInt(_) => "unsignedbyte",
        V::ShortInt(_) => "short",
        V::ShortUInt(_) => "unsignedshort",
        V::LongInt(_) => "signedint",
        V::LongUInt(_) => "unsignedint",
        V::LongLongInt(_) => "long",
        V::Float(_) => "float",
        V::Double(_) => "double",
        V::DecimalValue(_) => "decimal",
        V::ShortString(_) => "shortstr",
        V::LongString(_) => "longstr",
        V::FieldArray(_) => "array",
        V::Timestamp(_) => "timestamp",
        V::FieldTable(_) => "table",
        V::ByteArray(_) => "binary",
        V::Void => "void",
    }
}

/// `x-max-priority` (`queue::priority`): an integer 0–255, refused otherwise with 406 in
/// RabbitMQ's words (its `check_max_priority_arg`, as 3.10 to 4.x answer).
fn check_max_priority(def: &QueueDef) -> Result<(), TopologyError> {
    let Some(v) = def.arguments.inner().get("x-max-priority") else { return Ok(()) };
    let why = match int_arg(&def.arguments, "x-max-priority") {
        Some(n) if n < 0 => format!("{{value_negative,{n}}}"),
        Some(n) if n > super::queue::priority::MAX_SUPPORTED => format!("{{max_value_exceeded,{n}}}"),
        Some(_) => return Ok(()),
        None => format!("\"expected integer, got {}\"", rabbit_type(v)),
    };
    Err(TopologyError::precondition_failed(format!(
        "invalid arg 'x-max-priority' for queue '{}' in vhost '{}': {why}",
        def.name, def.vhost
    )))
}

/// Rejects queue arguments of the wrong type or value (406, as RabbitMQ does for the x-
/// arguments it knows).
///
/// # Errors
/// 406 PRECONDITION_FAILED naming the argument, in RabbitMQ's words.
pub fn validate_queue_arguments(def: &QueueDef) -> Result<(), TopologyError> {
    let args = &def.arguments;
    let invalid = |key: &str, why: &str| {
        TopologyError::precondition_failed(format!("invalid arg '{key}' for queue '{}' in vhost '{}': {why}", def.name, def.vhost))
    };
    for key in ["x-dead-letter-exchange", "x-dead-letter-routing-key"] {
        if args.inner().contains_key(key) && string_arg(args, key).is_none() {
            return Err(TopologyError::precondition_failed(format!("invalid arg '{key}' for queue '{}': expected a string", def.name)));
        }
    }
    // x-message-ttl in RabbitMQ's words (`rabbit_amqqueue:check_message_ttl_arg`).
    if let Some(v) = args.inner().get("x-message-ttl") {
        let why = match int_arg(args, "x-message-ttl") {
            Some(n) => super::message::check_ttl(i128::from(n)).err(),
            None => Some(format!("\"expected integer, got {}\"", rabbit_type(v))),
        };
        if let Some(why) = why {
            return Err(invalid("x-message-ttl", &why));
        }
    }
    // Integer arguments RabbitMQ knows, with their lowest valid value.
    for (key, min) in [
        ("x-consumer-timeout", 0),
        ("x-expires", 1),
        ("x-max-length", 0),
        ("x-max-length-bytes", 0),
        ("x-delivery-limit", -1),
        ("x-quorum-initial-group-size", 1),
    ] {
        if args.inner().contains_key(key) && int_arg(args, key).is_none_or(|v| v < min) {
            return Err(invalid(key, &format!("expected an integer >= {min}")));
        }
    }
    check_max_priority(def)?;
    if args.inner().contains_key("x-single-active-consumer") && bool_arg(args, "x-single-active-consumer").is_none() {
        return Err(invalid("x-single-active-consumer", "expected a boolean"));
    }
    for key in ["x-overflow", "x-queue-mode", "x-queue-type", "x-queue-master-locator", "x-queue-leader-locator"] {
        if args.inner().contains_key(key) && string_arg(args, key).is_none() {
            return Err(invalid(key, "expected a string"));
        }
    }
    // RabbitMQ's three overflow behaviours (`queue::limits`).
    if let Some(Err(why)) = string_arg(args, "x-overflow").map(super::queue::limits::Overflow::parse) {
        return Err(invalid("x-overflow", &why.to_string()));
    }
    match string_arg(args, "x-queue-type") {
        None | Some("classic") => {}
        // A quorum queue is durable, shared and lives on: RabbitMQ refuses the properties
        // that contradict that, in these words.
        Some("quorum") => {
            let refused =
                [(!def.durable, "non-durable"), (def.exclusive_owner.is_some(), "exclusive-owner"), (def.auto_delete, "auto-delete")];
            if let Some((_, what)) = refused.iter().find(|(bad, _)| *bad) {
                return Err(TopologyError::precondition_failed(format!(
                    "invalid property '{what}' for queue '{}' in vhost '{}'",
                    def.name, def.vhost
                )));
            }
        }
        Some(other) => return Err(invalid("x-queue-type", &format!("unsupported queue type '{other}' (classic or quorum)"))),
    }
    Ok(())
}

/// Refuses the default exchange and the reserved `amq.` names for declare and delete.
///
/// # Errors
/// 403 ACCESS_REFUSED, in RabbitMQ's words.
pub fn check_exchange_name(name: &str) -> Result<(), TopologyError> {
    if name.is_empty() || name.starts_with("amq.") {
        return Err(TopologyError::access_refused(format!(
            "operation not permitted on the {}",
            if name.is_empty() { "default exchange".to_owned() } else { format!("exchange '{name}' (the amq. prefix is reserved)") }
        )));
    }
    Ok(())
}

/// Checks a redeclare against the existing exchange.
///
/// # Errors
/// 406 PRECONDITION_FAILED "inequivalent arg …" as RabbitMQ words it.
pub fn check_exchange_equivalent(old: &ExchangeDef, new: &ExchangeDef) -> Result<(), TopologyError> {
    let what = |arg: &str, got: String, cur: String| {
        TopologyError::precondition_failed(format!(
            "inequivalent arg '{arg}' for exchange '{}' in vhost '{}': received '{got}' but current is '{cur}'",
            old.name, old.vhost
        ))
    };
    if old.kind != new.kind {
        return Err(what("type", new.kind.as_str().into(), old.kind.as_str().into()));
    }
    if old.durable != new.durable {
        return Err(what("durable", new.durable.to_string(), old.durable.to_string()));
    }
    if old.auto_delete != new.auto_delete {
        return Err(what("auto_delete", new.auto_delete.to_string(), old.auto_delete.to_string()));
    }
    if old.internal != new.internal {
        return Err(what("internal", new.internal.to_string(), old.internal.to_string()));
    }
    if old.arguments != new.arguments {
        return Err(TopologyError::precondition_failed(format!(
            "inequivalent arguments for exchange '{}' in vhost '{}'",
            old.name, old.vhost
        )));
    }
    Ok(())
}

/// What an exchange.declare asks for.
#[derive(Clone, Debug)]
pub struct ExchangeDeclare {
    /// Virtual host.
    pub vhost: String,
    /// Exchange name.
    pub name: String,
    /// Type name as the client gave it (`direct`, `fanout`, `topic`, `headers`, …).
    pub kind: String,
    /// Durable.
    pub durable: bool,
    /// Auto-delete after its last binding goes.
    pub auto_delete: bool,
    /// Internal (no direct publishes).
    pub internal: bool,
    /// Arguments.
    pub arguments: FieldTable,
}

/// exchange.declare, passive or not.
///
/// # Errors
/// Passive: 404 when missing. Otherwise 503 for an unknown type, 403 for a reserved name,
/// 406 for an inequivalent redeclare, the metadata's errors.
pub async fn exchange_declare(node: &Node, req: ExchangeDeclare, passive: bool) -> Result<(), TopologyError> {
    let (vhost, name) = (req.vhost.as_str(), req.name.as_str());
    if passive {
        if find_synced(node, |r| r.exchange(vhost, name).map(|_| ())).await?.is_none() {
            return Err(TopologyError::not_found(format!("no exchange '{name}' in vhost '{vhost}'")));
        }
        return Ok(());
    }
    let kind =
        ExchangeKind::from_name(&req.kind).ok_or_else(|| TopologyError::CommandInvalid(format!("unknown exchange type '{}'", req.kind)))?;
    let def = ExchangeDef {
        vhost: vhost.to_owned(),
        name: name.to_owned(),
        kind,
        durable: req.durable,
        auto_delete: req.auto_delete,
        internal: req.internal,
        arguments: req.arguments,
    };
    let existing = node.router().exchange(vhost, name).cloned();
    match existing {
        Some(old) => check_exchange_equivalent(&old, &def),
        None => {
            check_exchange_name(name)?;
            if let Outcome::ExchangeExists(old) =
                node.shared.meta.propose(Command::DeclareExchange(def.clone())).await.map_err(meta_error)?
            {
                check_exchange_equivalent(&old, &def)?;
            }
            Ok(())
        }
    }
}

/// exchange.delete; a missing exchange is no error (delete-ok, as RabbitMQ). Returns whether
/// it existed.
///
/// # Errors
/// 403 for the default and `amq.` exchanges; 406 when `if_unused` and it has bindings.
pub async fn exchange_delete(node: &Node, vhost: &str, name: &str, if_unused: bool) -> Result<bool, TopologyError> {
    check_exchange_name(name)?;
    if find_synced(node, |r| r.exchange(vhost, name).map(|_| ())).await?.is_none() {
        return Ok(false);
    }
    let cmd = Command::DeleteExchange { vhost: vhost.to_owned(), name: name.to_owned(), if_unused };
    if let Outcome::InUse = node.shared.meta.propose(cmd).await.map_err(meta_error)? {
        return Err(TopologyError::precondition_failed(format!("exchange '{name}' in vhost '{vhost}' in use")));
    }
    Ok(true)
}

/// A binding as the metadata stores it, from the fields of a bind/unbind method.
pub fn binding(vhost: &str, source: &str, dest_kind: DestKind, dest: &str, routing_key: &str, arguments: &FieldTable) -> Binding {
    Binding {
        vhost: vhost.to_owned(),
        source: source.to_owned(),
        dest_kind,
        dest: dest.to_owned(),
        routing_key: routing_key.to_owned(),
        arguments: arguments.clone(),
    }
}

/// queue.bind / exchange.bind: checks both ends exist (404 otherwise; a queue destination as
/// [`queue_lookup`] for `caller`), refuses the default exchange (403), and adds it.
///
/// # Errors
/// 404, 403, 405 as above; the metadata's errors.
pub async fn bind(node: &Node, b: Binding, caller: Caller) -> Result<(), TopologyError> {
    if b.dest_kind == DestKind::Queue {
        queue_lookup(node, &b.vhost, &b.dest, caller).await?;
    }
    check_ends(node, &b).await?;
    match node.shared.meta.propose(Command::Bind(b.clone())).await.map_err(meta_error)? {
        Outcome::NotFound => {
            Err(TopologyError::not_found(format!("no exchange '{}' or destination '{}' in vhost '{}'", b.source, b.dest, b.vhost)))
        }
        _ => Ok(()),
    }
}

/// queue.unbind / exchange.unbind. Idempotent, as RabbitMQ has been since 3.2: when the
/// source, the destination or the binding does not exist there is nothing to remove, and the
/// answer is still unbind-ok (clients' cleanup paths, aio-pika's among them, rely on it). Only
/// the default exchange (403) and another connection's exclusive queue (405) are refused.
///
/// # Errors
/// 403, 405 as above; the metadata's errors.
pub async fn unbind(node: &Node, b: Binding, caller: Caller) -> Result<(), TopologyError> {
    if b.dest_kind == DestKind::Queue {
        match queue_lookup(node, &b.vhost, &b.dest, caller).await {
            // A missing queue has no binding to remove.
            Err(e) if e.is_not_found() => return Ok(()),
            other => drop(other?),
        }
    }
    match check_ends(node, &b).await {
        Err(e) if e.is_not_found() => return Ok(()),
        other => other?,
    }
    node.shared.meta.propose(Command::Unbind(b)).await.map_err(meta_error)?;
    Ok(())
}

async fn check_ends(node: &Node, b: &Binding) -> Result<(), TopologyError> {
    if b.source.is_empty() || (b.dest_kind == DestKind::Exchange && b.dest.is_empty()) {
        return Err(TopologyError::access_refused("operation not permitted on the default exchange".into()));
    }
    if find_synced(node, |r| r.exchange(&b.vhost, &b.source).map(|_| ())).await?.is_none() {
        return Err(TopologyError::not_found(format!("no exchange '{}' in vhost '{}'", b.source, b.vhost)));
    }
    let dest_ok = find_synced(node, |r| match b.dest_kind {
        DestKind::Exchange => r.exchange(&b.vhost, &b.dest).map(|_| ()),
        DestKind::Queue => r.queue_ref(&b.vhost, &b.dest).map(|_| ()),
    })
    .await?
    .is_some();
    if !dest_ok {
        let kind = if b.dest_kind == DestKind::Queue { "queue" } else { "exchange" };
        return Err(TopologyError::not_found(format!("no {kind} '{}' in vhost '{}'", b.dest, b.vhost)));
    }
    Ok(())
}
