//! Class `exchange` (spec 1.6): declare, delete, and RabbitMQ's bind/unbind
//! (exchange-to-exchange bindings).

use std::rc::Rc;

use amq_protocol::protocol::{exchange, AMQPClass};

use super::{args_equivalent, authorize, find_synced, meta_error};
use crate::amqp::connection::Session;
use crate::amqp::error::AmqpError;
use crate::broker::access::{Perm, Resource};
use crate::meta::state::{Binding, Command, DestKind, ExchangeDef, ExchangeKind, Outcome};

fn check_name(name: &str) -> Result<(), AmqpError> {
    if name.is_empty() || name.starts_with("amq.") {
        return Err(AmqpError::access_refused(format!(
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
pub fn check_equivalent(old: &ExchangeDef, new: &ExchangeDef) -> Result<(), AmqpError> {
    let what = |arg: &str, got: String, cur: String| {
        AmqpError::precondition_failed(format!(
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
    if !args_equivalent(&old.arguments, &new.arguments) {
        return Err(AmqpError::precondition_failed(format!("inequivalent arguments for exchange '{}' in vhost '{}'", old.name, old.vhost)));
    }
    Ok(())
}

/// Dispatches an exchange method.
pub async fn handle(s: &Rc<Session>, channel: u16, m: exchange::AMQPMethod) -> Result<(), AmqpError> {
    let vhost = s.vhost();
    let meta = s.core.shared.meta.clone();
    match m {
        exchange::AMQPMethod::Declare(d) => {
            let name = d.exchange.as_str();
            if d.passive {
                if find_synced(s, |r| r.exchange(&vhost, name).map(|_| ())).await?.is_none() {
                    return Err(AmqpError::not_found(format!("no exchange '{name}' in vhost '{vhost}'")));
                }
            } else {
                authorize(s, Perm::Configure, Resource::Exchange, name)?;
                // An alternate exchange: read on this one, write on that one (as RabbitMQ
                // checks a declare with one).
                if let Some(ae) = crate::broker::router::string_arg(&d.arguments, "alternate-exchange") {
                    authorize(s, Perm::Read, Resource::Exchange, name)?;
                    authorize(s, Perm::Write, Resource::Exchange, ae)?;
                }
                let topo = s.core.router();
                let kind = ExchangeKind::from_name(d.kind.as_str())
                    .ok_or_else(|| AmqpError::command_invalid(format!("unknown exchange type '{}'", d.kind)))?;
                let def = ExchangeDef {
                    vhost: vhost.to_string(),
                    name: name.to_owned(),
                    kind,
                    durable: d.durable,
                    auto_delete: d.auto_delete,
                    internal: d.internal,
                    arguments: d.arguments.clone(),
                };
                match topo.exchange(&vhost, name) {
                    Some(old) => check_equivalent(old, &def)?,
                    None => {
                        check_name(name)?;
                        if let Outcome::ExchangeExists(old) =
                            meta.propose(Command::DeclareExchange(def.clone())).await.map_err(meta_error)?
                        {
                            check_equivalent(&old, &def)?;
                        }
                    }
                }
            }
            if !d.nowait {
                s.send_method(channel, &AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})));
            }
            Ok(())
        }
        exchange::AMQPMethod::Delete(d) => {
            let name = d.exchange.as_str();
            check_name(name)?;
            authorize(s, Perm::Configure, Resource::Exchange, name)?;
            if find_synced(s, |r| r.exchange(&vhost, name).map(|_| ())).await?.is_some() {
                let cmd = Command::DeleteExchange { vhost: vhost.to_string(), name: name.to_owned(), if_unused: d.if_unused };
                if let Outcome::InUse = meta.propose(cmd).await.map_err(meta_error)? {
                    return Err(AmqpError::precondition_failed(format!("exchange '{name}' in vhost '{vhost}' in use")));
                }
            }
            if !d.nowait {
                s.send_method(channel, &AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})));
            }
            Ok(())
        }
        exchange::AMQPMethod::Bind(b) => {
            let binding =
                binding(&vhost, b.source.as_str(), DestKind::Exchange, b.destination.as_str(), b.routing_key.as_str(), &b.arguments);
            super::queue::authorize_binding(s, &binding)?;
            bind(s, binding).await?;
            if !b.nowait {
                s.send_method(channel, &AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {})));
            }
            Ok(())
        }
        exchange::AMQPMethod::Unbind(b) => {
            let binding =
                binding(&vhost, b.source.as_str(), DestKind::Exchange, b.destination.as_str(), b.routing_key.as_str(), &b.arguments);
            super::queue::authorize_binding(s, &binding)?;
            unbind(s, binding).await?;
            if !b.nowait {
                s.send_method(channel, &AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {})));
            }
            Ok(())
        }
        _ => Err(AmqpError::command_invalid("this exchange method is sent by the server")),
    }
}

/// A binding as the metadata stores it, from the fields of a bind/unbind method.
pub fn binding(
    vhost: &str,
    source: &str,
    dest_kind: DestKind,
    dest: &str,
    routing_key: &str,
    arguments: &amq_protocol::types::FieldTable,
) -> Binding {
    Binding {
        vhost: vhost.to_owned(),
        source: source.to_owned(),
        dest_kind,
        dest: dest.to_owned(),
        routing_key: routing_key.to_owned(),
        arguments: arguments.clone(),
    }
}

/// Checks both ends of a binding exist (404 otherwise), refuses the default exchange
/// (403), and adds it.
pub async fn bind(s: &Rc<Session>, b: Binding) -> Result<(), AmqpError> {
    check_ends(s, &b).await?;
    match s.core.shared.meta.propose(Command::Bind(b.clone())).await.map_err(meta_error)? {
        Outcome::NotFound => {
            Err(AmqpError::not_found(format!("no exchange '{}' or destination '{}' in vhost '{}'", b.source, b.dest, b.vhost)))
        }
        _ => Ok(()),
    }
}

/// Removes a binding. Idempotent, as RabbitMQ has been since 3.2: when the source, the destination or the binding
/// does not exist there is nothing to remove, and the answer is still unbind-ok (clients'
/// cleanup paths, aio-pika's among them, rely on it). Only the default exchange is refused.
pub async fn unbind(s: &Rc<Session>, b: Binding) -> Result<(), AmqpError> {
    match check_ends(s, &b).await {
        Err(e) if e.code == crate::amqp::error::code::NOT_FOUND => return Ok(()),
        other => other?,
    }
    s.core.shared.meta.propose(Command::Unbind(b)).await.map_err(meta_error)?;
    Ok(())
}

async fn check_ends(s: &Rc<Session>, b: &Binding) -> Result<(), AmqpError> {
    if b.source.is_empty() || (b.dest_kind == DestKind::Exchange && b.dest.is_empty()) {
        return Err(AmqpError::access_refused("operation not permitted on the default exchange"));
    }
    if find_synced(s, |r| r.exchange(&b.vhost, &b.source).map(|_| ())).await?.is_none() {
        return Err(AmqpError::not_found(format!("no exchange '{}' in vhost '{}'", b.source, b.vhost)));
    }
    let dest_ok = find_synced(s, |r| match b.dest_kind {
        DestKind::Exchange => r.exchange(&b.vhost, &b.dest).map(|_| ()),
        DestKind::Queue => r.queue_ref(&b.vhost, &b.dest).map(|_| ()),
    })
    .await?
    .is_some();
    if !dest_ok {
        let kind = if b.dest_kind == DestKind::Queue { "queue" } else { "exchange" };
        return Err(AmqpError::not_found(format!("no {kind} '{}' in vhost '{}'", b.dest, b.vhost)));
    }
    Ok(())
}
