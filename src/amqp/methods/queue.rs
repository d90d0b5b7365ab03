//! Class `queue` (spec 1.7): declare, bind, unbind, purge, delete.

use std::rc::Rc;

use amq_protocol::protocol::{queue, AMQPClass};

use super::exchange::{bind, binding, unbind};
use super::{args_equivalent, authorize, find_synced, meta_error, unique_suffix};
use crate::amqp::connection::Session;
use crate::amqp::error::AmqpError;
use crate::broker::access::{Perm, Resource};
use crate::broker::{reply_channel, QueueOp, QueueRef};
use crate::core::placement;
use crate::meta::state::{Command, DestKind, Outcome, QueueDef};

/// Looks a queue up for an operation by connection `conn`.
///
/// A miss is looked up again behind a metadata read barrier in a cluster
/// ([`find_synced`]).
///
/// # Errors
/// 404 NOT_FOUND when missing; 405 RESOURCE_LOCKED when it is another connection's
/// exclusive queue (spec 1.7.2.1, rule "exclusive"); 506 when the barrier finds no quorum.
pub async fn lookup(s: &Session, name: &str) -> Result<(QueueRef, QueueDef), AmqpError> {
    let vhost = s.vhost();
    // The definition and the reference from one router: the metadata thread can publish a
    // topology without the queue between two `router()` calls (a delete on another core).
    let (def, qref) = find_synced(s, |r| Some((r.topology.queue(&vhost, name)?.clone(), r.queue_ref(&vhost, name)?)))
        .await?
        .ok_or_else(|| AmqpError::not_found(format!("no queue '{name}' in vhost '{vhost}'")))?;
    // Connection ids are per node: an exclusive queue belongs to a connection of its own node.
    if def.exclusive_owner.is_some_and(|o| o != s.id.0 || def.owner_node != s.core.shared.meta.node_id()) {
        return Err(AmqpError::resource_locked(format!(
            "cannot obtain exclusive access to locked queue '{name}' in vhost '{vhost}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration."
        )));
    }
    Ok((qref, def))
}

/// Checks a redeclare against the existing queue (406 "inequivalent arg …").
fn check_equivalent(old: &QueueDef, new: &QueueDef) -> Result<(), AmqpError> {
    let what = |arg: &str, got: bool, cur: bool| {
        AmqpError::precondition_failed(format!(
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
    if !args_equivalent(&old.arguments, &new.arguments) {
        return Err(AmqpError::precondition_failed(format!("inequivalent arguments for queue '{}' in vhost '{}'", old.name, old.vhost)));
    }
    Ok(())
}

/// How long a queue.declare waits for a queue being deleted to go ([`wait_gone`]).
const GONE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

async fn stats(s: &Session, q: &QueueRef) -> Result<(u32, u32), AmqpError> {
    let (reply, rx) = reply_channel();
    s.queue_send(q, QueueOp::Stats { reply });
    Ok(rx.recv_async().await.map_err(|_| AmqpError::internal_error("queue did not answer"))??)
}

/// One attempt at a non-passive queue.declare of `def`: the existing queue's counts (after
/// the equivalence check), or the new queue's (0, 0) once its store is open. `durable` and
/// `exclusive` are the method's flags.
///
/// # Errors
/// 404 when the queue exists in the metadata but its owner no longer serves it (it is being
/// deleted); 406 for an inequivalent redeclare; 405 for another connection's exclusive queue;
/// 506 when file descriptors run out; the metadata's and the store's errors.
async fn declare_once(s: &Session, def: &QueueDef, durable: bool, exclusive: bool) -> Result<(u32, u32), AmqpError> {
    let (vhost, name) = (def.vhost.as_str(), def.name.as_str());
    let meta = &s.core.shared.meta;
    let existing = s.core.router().topology.queue(vhost, name).cloned();
    if existing.is_none() {
        // Descriptors for the new queue's files (one per shard segment: its messages,
        // and for a durable queue its unacked index), within the headroom.
        if let Err((open, max)) = s.core.shared.alarms.reserve_fds(if durable { 2 } else { 1 }) {
            return Err(AmqpError::resource_error(format!(
                "cannot declare queue '{name}' in vhost '{vhost}': file descriptor limit nearly reached ({open} of {max} open)"
            )));
        }
    }
    let counts = match existing {
        Some(old) => {
            let (q, _) = lookup(s, name).await?;
            check_equivalent(&old, def)?;
            stats(s, &q).await?
        }
        None => match meta.propose(Command::DeclareQueue(def.clone())).await.map_err(meta_error)? {
            Outcome::QueueExists(old) => {
                let (q, _) = lookup(s, name).await?;
                check_equivalent(&old, def)?;
                stats(s, &q).await?
            }
            _ => {
                // Open its store now: declare-ok means the queue can take messages.
                // Deleted meanwhile (another connection's queue.delete): 404, and declared anew
                // by the caller's retry.
                let q = s
                    .core
                    .router()
                    .queue_ref(vhost, name)
                    .ok_or_else(|| AmqpError::not_found(format!("no queue '{name}' in vhost '{vhost}'")))?;
                if let Err(e) = stats(s, &q).await {
                    s.core.undeclare(def).await;
                    return Err(e);
                }
                if exclusive {
                    s.st.borrow_mut().exclusive_queues.push(q);
                }
                if !def.replicas.is_empty() {
                    tracing::info!(queue = %name, vhost = %vhost, replicas = ?def.replicas, "declared a replicated queue");
                }
                (0, 0)
            }
        },
    };
    Ok(counts)
}

/// Waits until the queue `vhost`/`name` has left this node's topology (its delete committed)
/// and 2 ms more (its owner removes its files next), polling every 2 ms, until `deadline` at
/// the latest.
async fn wait_gone(s: &Session, vhost: &str, name: &str, deadline: std::time::Instant) {
    let step = std::time::Duration::from_millis(2);
    while s.core.router().topology.queue(vhost, name).is_some() && std::time::Instant::now() < deadline {
        glommio::timer::sleep(step).await;
    }
    glommio::timer::sleep(step).await;
}

/// Dispatches a queue method.
pub async fn handle(s: &Rc<Session>, channel: u16, m: queue::AMQPMethod) -> Result<(), AmqpError> {
    let vhost = s.vhost();
    match m {
        queue::AMQPMethod::Declare(d) => {
            let mut name = d.queue.to_string();
            if d.passive {
                // The direct reply-to pseudo-queue can be declared passively, as in RabbitMQ.
                let (messages, consumers) = if name == crate::broker::reply_to::PSEUDO_QUEUE {
                    (0, 0)
                } else {
                    let (q, _) = lookup(s, &name).await?;
                    stats(s, &q).await?
                };
                if !d.nowait {
                    declare_ok(s, channel, &name, messages, consumers);
                }
                return Ok(());
            }
            if name.is_empty() {
                name = format!("amq.gen-{}", unique_suffix(s.core.shared.next_id()));
            } else if name.starts_with("amq.") {
                return Err(AmqpError::access_refused(format!("queue name '{name}' contains reserved prefix 'amq.*'")));
            }
            authorize(s, Perm::Configure, Resource::Queue, &name)?;
            // A dead-letter exchange: read on the queue, write on the exchange (RabbitMQ's
            // `check_dlx_permissions`).
            if let Some(dlx) = crate::broker::router::string_arg(&d.arguments, "x-dead-letter-exchange") {
                authorize(s, Perm::Read, Resource::Queue, &name)?;
                authorize(s, Perm::Write, Resource::Exchange, dlx)?;
            }
            let meta = &s.core.shared.meta;
            let mut def = QueueDef {
                vhost: vhost.to_string(),
                name: name.clone(),
                durable: d.durable,
                auto_delete: d.auto_delete,
                exclusive_owner: if d.exclusive { Some(s.id.0) } else { None },
                arguments: d.arguments.clone(),
                owner_node: meta.node_id(),
                owner_core: placement::owner_core(&vhost, &name, s.core.shared.cores),
                owner_epoch: meta.boot_epoch(),
                replicas: Vec::new(),
                incarnation: crate::broker::ids::cluster_unique_id(meta.node_id(), s.core.shared.next_id()),
            };
            validate_arguments(&def)?;
            def.replicas = crate::broker::replicas::replica_set_for(&s.core.shared, &def);
            // A queue that is going (auto-delete after its last consumer, or x-expires) is
            // still in the metadata until its delete commits, and its owner answers 404 until
            // its files are gone. Then wait for it to go and declare it anew, as RabbitMQ,
            // whose deletion is done by the time the last consumer's connection.close-ok is
            // sent (amqp091-go's ExampleConnection_reconnect redeclares an auto-delete queue
            // at once). Bounded by GONE_WAIT.
            let deadline = std::time::Instant::now() + GONE_WAIT;
            let (messages, consumers) = loop {
                match declare_once(s, &def, d.durable, d.exclusive).await {
                    Err(e) if e.code == crate::amqp::error::code::NOT_FOUND && std::time::Instant::now() < deadline => {
                        wait_gone(s, &vhost, &name, deadline).await;
                    }
                    r => break r?,
                }
            };
            if !d.nowait {
                declare_ok(s, channel, &name, messages, consumers);
            }
            Ok(())
        }
        queue::AMQPMethod::Bind(b) => {
            let binding = binding(&vhost, b.exchange.as_str(), DestKind::Queue, b.queue.as_str(), b.routing_key.as_str(), &b.arguments);
            authorize_binding(s, &binding)?;
            lookup(s, &binding.dest).await?;
            bind(s, binding).await?;
            if !b.nowait {
                s.send_method(channel, &AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})));
            }
            Ok(())
        }
        queue::AMQPMethod::Unbind(b) => {
            let binding = binding(&vhost, b.exchange.as_str(), DestKind::Queue, b.queue.as_str(), b.routing_key.as_str(), &b.arguments);
            authorize_binding(s, &binding)?;
            // A missing queue has no binding to remove: unbind-ok, as RabbitMQ answers (`unbind`);
            // another connection's exclusive queue is still 405.
            match lookup(s, &binding.dest).await {
                Err(e) if e.code == crate::amqp::error::code::NOT_FOUND => {}
                Err(e) => return Err(e),
                Ok(_) => unbind(s, binding).await?,
            }
            s.send_method(channel, &AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {})));
            Ok(())
        }
        queue::AMQPMethod::Purge(p) => {
            authorize(s, Perm::Read, Resource::Queue, p.queue.as_str())?;
            let (q, _) = lookup(s, p.queue.as_str()).await?;
            let (reply, rx) = reply_channel();
            s.queue_send(&q, QueueOp::Purge { reply });
            let n = rx.recv_async().await.map_err(|_| AmqpError::internal_error("queue did not answer"))??;
            if !p.nowait {
                s.send_method(channel, &AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk { message_count: n })));
            }
            Ok(())
        }
        queue::AMQPMethod::Delete(d) => {
            authorize(s, Perm::Configure, Resource::Queue, d.queue.as_str())?;
            let n = match lookup(s, d.queue.as_str()).await {
                Err(e) if e.code == crate::amqp::error::code::NOT_FOUND => 0,
                Err(e) => return Err(e),
                Ok((q, _)) => {
                    let (reply, rx) = reply_channel();
                    s.queue_send(&q, QueueOp::Delete { if_unused: d.if_unused, if_empty: d.if_empty, reply });
                    let n = rx.recv_async().await.map_err(|_| AmqpError::internal_error("queue did not answer"))??;
                    s.st.borrow_mut().exclusive_queues.retain(|x| x.key != q.key);
                    n
                }
            };
            if !d.nowait {
                s.send_method(channel, &AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk { message_count: n })));
            }
            Ok(())
        }
        _ => Err(AmqpError::command_invalid("this queue method is sent by the server")),
    }
}

/// A bind or unbind needs write on the destination and read on the source exchange
/// (RabbitMQ's `binding_action`).
pub fn authorize_binding(s: &Session, b: &crate::meta::Binding) -> Result<(), AmqpError> {
    let dest_kind = match b.dest_kind {
        DestKind::Queue => Resource::Queue,
        DestKind::Exchange => Resource::Exchange,
    };
    authorize(s, Perm::Write, dest_kind, &b.dest)?;
    authorize(s, Perm::Read, Resource::Exchange, &b.source)
}

fn declare_ok(s: &Session, channel: u16, name: &str, message_count: u32, consumer_count: u32) {
    s.send_method(
        channel,
        &AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk { queue: name.into(), message_count, consumer_count })),
    );
}

/// RabbitMQ's name of a field table value's type, as its 406 texts print it.
fn rabbit_type(v: &amq_protocol::types::AMQPValue) -> &'static str {
    use amq_protocol::types::AMQPValue as V;
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

/// `x-max-priority` (`broker::queue::priority`): an integer 0–255, refused otherwise with
/// 406 in RabbitMQ's words (its `check_max_priority_arg`, as 3.10 to 4.x answer).
fn check_max_priority(def: &QueueDef) -> Result<(), AmqpError> {
    let Some(v) = def.arguments.inner().get("x-max-priority") else { return Ok(()) };
    let why = match crate::broker::router::int_arg(&def.arguments, "x-max-priority") {
        Some(n) if n < 0 => format!("{{value_negative,{n}}}"),
        Some(n) if n > crate::broker::queue::priority::MAX_SUPPORTED => format!("{{max_value_exceeded,{n}}}"),
        Some(_) => return Ok(()),
        None => {
            let ty = rabbit_type(v);
            format!("\"expected integer, got {ty}\"")
        }
    };
    Err(AmqpError::precondition_failed(format!("invalid arg 'x-max-priority' for queue '{}' in vhost '{}': {why}", def.name, def.vhost)))
}

/// Rejects queue arguments of the wrong type (406, as RabbitMQ does for the x- arguments
/// it knows).
fn validate_arguments(def: &QueueDef) -> Result<(), AmqpError> {
    use crate::broker::router::{bool_arg, int_arg, string_arg};
    let args = &def.arguments;
    for key in ["x-dead-letter-exchange", "x-dead-letter-routing-key"] {
        if args.inner().contains_key(key) && string_arg(args, key).is_none() {
            return Err(AmqpError::precondition_failed(format!("invalid arg '{key}' for queue '{}': expected a string", def.name)));
        }
    }
    // x-message-ttl in RabbitMQ's words (`rabbit_amqqueue:check_message_ttl_arg`).
    if let Some(v) = args.inner().get("x-message-ttl") {
        let why = match int_arg(args, "x-message-ttl") {
            Some(n) => crate::broker::message::check_ttl(i128::from(n)).err(),
            None => Some(format!("\"expected integer, got {}\"", rabbit_type(v))),
        };
        if let Some(why) = why {
            return Err(AmqpError::precondition_failed(format!(
                "invalid arg 'x-message-ttl' for queue '{}' in vhost '{}': {why}",
                def.name, def.vhost
            )));
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
            return Err(AmqpError::precondition_failed(format!(
                "invalid arg '{key}' for queue '{}' in vhost '{}': expected an integer >= {min}",
                def.name, def.vhost
            )));
        }
    }
    check_max_priority(def)?;
    if args.inner().contains_key("x-single-active-consumer") && bool_arg(args, "x-single-active-consumer").is_none() {
        return Err(AmqpError::precondition_failed(format!(
            "invalid arg 'x-single-active-consumer' for queue '{}' in vhost '{}': expected a boolean",
            def.name, def.vhost
        )));
    }
    for key in ["x-overflow", "x-queue-mode", "x-queue-type", "x-queue-master-locator"] {
        if args.inner().contains_key(key) && string_arg(args, key).is_none() {
            return Err(AmqpError::precondition_failed(format!(
                "invalid arg '{key}' for queue '{}' in vhost '{}': expected a string",
                def.name, def.vhost
            )));
        }
    }
    // RabbitMQ's three overflow behaviours (`broker::queue::limits`).
    if let Some(Err(why)) = string_arg(args, "x-overflow").map(crate::broker::queue::limits::Overflow::parse) {
        return Err(AmqpError::precondition_failed(format!(
            "invalid arg 'x-overflow' for queue '{}' in vhost '{}': {why}",
            def.name, def.vhost
        )));
    }
    match string_arg(args, "x-queue-type") {
        None | Some("classic") => {}
        // A quorum queue is durable, shared and lives on: RabbitMQ refuses the properties
        // that contradict that, in these words.
        Some("quorum") => {
            let refused =
                [(!def.durable, "non-durable"), (def.exclusive_owner.is_some(), "exclusive-owner"), (def.auto_delete, "auto-delete")];
            if let Some((_, what)) = refused.iter().find(|(bad, _)| *bad) {
                return Err(AmqpError::precondition_failed(format!(
                    "invalid property '{what}' for queue '{}' in vhost '{}'",
                    def.name, def.vhost
                )));
            }
        }
        Some(other) => {
            return Err(AmqpError::precondition_failed(format!(
                "invalid arg 'x-queue-type' for queue '{}' in vhost '{}': unsupported queue type '{other}' (classic or quorum)",
                def.name, def.vhost
            )));
        }
    }
    Ok(())
}
