//! Class `queue` (spec 1.7): declare, bind, unbind, purge, delete. The domain part of each
//! is `broker::topology` (shared with the management API); this file decodes, calls it and
//! answers.

use std::rc::Rc;

use amq_protocol::protocol::{queue, AMQPClass};

use super::{authorize, unique_suffix};
use crate::amqp::codec::encode_method;
use crate::amqp::connection::Session;
use crate::amqp::error::AmqpError;
use crate::broker::access::{Perm, Resource};
use crate::broker::topology::{self, binding, Caller, QueueDeclare};
use crate::broker::{ClientEvent, QueueRef};
use crate::meta::state::{DestKind, QueueDef};

/// Looks a queue up for an operation by connection `conn` ([`topology::queue_lookup`]).
///
/// # Errors
/// 404 NOT_FOUND when missing; 405 RESOURCE_LOCKED when it is another connection's
/// exclusive queue (spec 1.7.2.1, rule "exclusive"); 506 when the barrier finds no quorum.
pub async fn lookup(s: &Session, name: &str) -> Result<(QueueRef, QueueDef), AmqpError> {
    Ok(topology::queue_lookup(&s.core, &s.vhost(), name, Caller::Connection(s.id.0)).await?)
}

/// Dispatches a queue method.
pub async fn handle(s: &Rc<Session>, channel: u16, m: queue::AMQPMethod) -> Result<(), AmqpError> {
    let vhost = s.vhost();
    let me = Caller::Connection(s.id.0);
    match m {
        queue::AMQPMethod::Declare(d) => {
            let mut name = d.queue.to_string();
            if d.passive {
                // The direct reply-to pseudo-queue can be declared passively, as in RabbitMQ.
                let (messages, consumers) = if name == crate::broker::reply_to::PSEUDO_QUEUE {
                    (0, 0)
                } else {
                    let (q, _) = lookup(s, &name).await?;
                    topology::queue_stats(&s.core, &q).await?
                };
                if !d.nowait {
                    declare_ok(s, channel, &name, messages, consumers);
                }
                return Ok(());
            }
            let server_named = name.is_empty();
            if server_named {
                name = format!("amq.gen-{}", unique_suffix(s.core.shared.next_id()));
            }
            authorize(s, Perm::Configure, Resource::Queue, &name)?;
            // A dead-letter exchange: read on the queue, write on the exchange (RabbitMQ's
            // `check_dlx_permissions`).
            if let Some(dlx) = crate::broker::router::string_arg(&d.arguments, "x-dead-letter-exchange") {
                authorize(s, Perm::Read, Resource::Queue, &name)?;
                authorize(s, Perm::Write, Resource::Exchange, dlx)?;
            }
            let req = QueueDeclare {
                vhost: vhost.to_string(),
                name: name.clone(),
                server_named,
                durable: d.durable,
                auto_delete: d.auto_delete,
                exclusive: d.exclusive,
                arguments: d.arguments.clone(),
                caller: me,
            };
            let declared = topology::queue_declare(&s.core, req).await?;
            if let (Some(q), true) = (declared.created, d.exclusive) {
                s.st.borrow_mut().exclusive_queues.push(q);
            }
            if !d.nowait {
                declare_ok(s, channel, &name, declared.messages, declared.consumers);
            }
            Ok(())
        }
        queue::AMQPMethod::Bind(b) => {
            let binding = binding(&vhost, b.exchange.as_str(), DestKind::Queue, b.queue.as_str(), b.routing_key.as_str(), &b.arguments);
            authorize_binding(s, &binding)?;
            topology::bind(&s.core, binding, me).await?;
            if !b.nowait {
                s.send_method(channel, &AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})));
            }
            Ok(())
        }
        queue::AMQPMethod::Unbind(b) => {
            let binding = binding(&vhost, b.exchange.as_str(), DestKind::Queue, b.queue.as_str(), b.routing_key.as_str(), &b.arguments);
            authorize_binding(s, &binding)?;
            topology::unbind(&s.core, binding, me).await?;
            s.send_method(channel, &AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {})));
            Ok(())
        }
        queue::AMQPMethod::Purge(p) => {
            authorize(s, Perm::Read, Resource::Queue, p.queue.as_str())?;
            let n = topology::queue_purge(&s.core, &vhost, p.queue.as_str(), me).await?;
            if !p.nowait {
                s.send_method(channel, &AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk { message_count: n })));
            }
            Ok(())
        }
        queue::AMQPMethod::Delete(d) => {
            authorize(s, Perm::Configure, Resource::Queue, d.queue.as_str())?;
            // The queue's basic.cancel to this connection's consumers of it waits until
            // delete-ok is sent (RabbitMQ's order; py-amqp raises ConsumerCancelled out of
            // queue_delete otherwise).
            let name = crate::broker::QueueName::from(d.queue.as_str());
            s.st.borrow_mut().deleting.push(name.clone());
            let deleted = topology::queue_delete(&s.core, &vhost, d.queue.as_str(), me, d.if_unused, d.if_empty).await;
            let mut frames = Vec::new();
            if let Ok((n, q)) = &deleted {
                if let Some(q) = q {
                    s.st.borrow_mut().exclusive_queues.retain(|x| x.key != q.key);
                }
                if !d.nowait {
                    encode_method(
                        &mut frames,
                        channel,
                        &AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk { message_count: *n })),
                    );
                }
            }
            // Through the event channel, behind the cancels the queue sent before it answered.
            let _ = s.tx.send(ClientEvent::Deleted { frames, queue: name });
            deleted.map(|_| ()).map_err(Into::into)
        }
        _ => Err(AmqpError::command_invalid("this queue method is sent by the server")),
    }
}

/// A bind or unbind needs write on the destination and read on the source exchange
/// (RabbitMQ's `binding_action`).
///
/// # Errors
/// 403 ACCESS_REFUSED naming the refused resource.
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
