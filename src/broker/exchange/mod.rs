//! Exchange types: one file per type, each a pure matching function.
//!
//! Routing follows the AMQP 0-9-1 spec section 3.1.3 and RabbitMQ's documentation
//! ("Exchanges", "Headers exchange", "Alternate exchanges", "Exchange to exchange bindings").

pub mod direct;
pub mod fanout;
pub mod headers;
pub mod topic;

use amq_protocol::types::FieldTable;

use crate::meta::state::{Binding, ExchangeKind};

/// Does `binding` of an exchange of `kind` match a message with `routing_key` and
/// message `headers`?
pub fn matches(kind: ExchangeKind, binding: &Binding, routing_key: &str, headers: Option<&FieldTable>) -> bool {
    match kind {
        ExchangeKind::Direct => direct::matches(&binding.routing_key, routing_key),
        ExchangeKind::Fanout => fanout::matches(),
        ExchangeKind::Topic => topic::matches(&binding.routing_key, routing_key),
        ExchangeKind::Headers => headers::matches(&binding.arguments, headers),
    }
}
