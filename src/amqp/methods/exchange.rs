//! Class `exchange` (spec 1.6): declare, delete, and RabbitMQ's bind/unbind
//! (exchange-to-exchange bindings). The domain part of each is `broker::topology` (shared
//! with the management API); this file decodes, calls it and answers.

use std::rc::Rc;

use amq_protocol::protocol::{exchange, AMQPClass};

use super::authorize;
use crate::amqp::connection::Session;
use crate::amqp::error::AmqpError;
use crate::broker::access::{Perm, Resource};
use crate::broker::topology::{self, binding, Caller, ExchangeDeclare};
use crate::meta::state::DestKind;

/// Dispatches an exchange method.
pub async fn handle(s: &Rc<Session>, channel: u16, m: exchange::AMQPMethod) -> Result<(), AmqpError> {
    let vhost = s.vhost();
    let me = Caller::Connection(s.id.0);
    match m {
        exchange::AMQPMethod::Declare(d) => {
            if !d.passive {
                let name = d.exchange.as_str();
                authorize(s, Perm::Configure, Resource::Exchange, name)?;
                // An alternate exchange: read on this one, write on that one (as RabbitMQ
                // checks a declare with one).
                if let Some(ae) = crate::broker::router::string_arg(&d.arguments, "alternate-exchange") {
                    authorize(s, Perm::Read, Resource::Exchange, name)?;
                    authorize(s, Perm::Write, Resource::Exchange, ae)?;
                }
            }
            let req = ExchangeDeclare {
                vhost: vhost.to_string(),
                name: d.exchange.to_string(),
                kind: d.kind.to_string(),
                durable: d.durable,
                auto_delete: d.auto_delete,
                internal: d.internal,
                arguments: d.arguments.clone(),
            };
            topology::exchange_declare(&s.core, req, d.passive).await?;
            if !d.nowait {
                s.send_method(channel, &AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})));
            }
            Ok(())
        }
        exchange::AMQPMethod::Delete(d) => {
            topology::check_exchange_name(d.exchange.as_str())?;
            authorize(s, Perm::Configure, Resource::Exchange, d.exchange.as_str())?;
            topology::exchange_delete(&s.core, &vhost, d.exchange.as_str(), d.if_unused).await?;
            if !d.nowait {
                s.send_method(channel, &AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})));
            }
            Ok(())
        }
        exchange::AMQPMethod::Bind(b) => {
            let binding =
                binding(&vhost, b.source.as_str(), DestKind::Exchange, b.destination.as_str(), b.routing_key.as_str(), &b.arguments);
            super::queue::authorize_binding(s, &binding)?;
            topology::bind(&s.core, binding, me).await?;
            if !b.nowait {
                s.send_method(channel, &AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {})));
            }
            Ok(())
        }
        exchange::AMQPMethod::Unbind(b) => {
            let binding =
                binding(&vhost, b.source.as_str(), DestKind::Exchange, b.destination.as_str(), b.routing_key.as_str(), &b.arguments);
            super::queue::authorize_binding(s, &binding)?;
            topology::unbind(&s.core, binding, me).await?;
            if !b.nowait {
                s.send_method(channel, &AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {})));
            }
            Ok(())
        }
        _ => Err(AmqpError::command_invalid("this exchange method is sent by the server")),
    }
}
