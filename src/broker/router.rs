//! A core's read-only copy of the routing tables.
//!
//! The topology lives in the Raft metadata group; every core holds an `Arc` of the latest
//! applied [`Topology`] and refreshes it when the metadata's topology version moves, so a
//! publish resolves its target queues on the core that received it (DESIGN.md, "Threads and
//! cores"). Routing follows the spec (3.1.3) plus RabbitMQ's exchange-to-exchange bindings
//! and alternate exchanges.

use std::collections::HashSet;
use std::sync::Arc;

use amq_protocol::types::{AMQPValue, FieldTable};

use super::exchange;
use super::{QueueKey, QueueRef};
use crate::meta::state::{DestKind, ExchangeDef, Topology};

/// Limit on exchange-to-exchange hops and alternate-exchange hops, against cycles.
const MAX_HOPS: usize = 64;

/// Routing outcome of one publish.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Route {
    /// Target queues, each once, in binding order.
    pub queues: Vec<QueueRef>,
}

/// A core's routing table.
#[derive(Debug)]
pub struct Router {
    /// Metadata topology version this copy was taken at.
    pub version: u64,
    /// The topology.
    pub topology: Arc<Topology>,
    /// Number of cores, for the owner-core mapping.
    cores: u32,
}

impl Router {
    /// Wraps a topology snapshot taken at `version`.
    pub fn new(topology: Arc<Topology>, version: u64, cores: u32) -> Router {
        Router { version, topology, cores: cores.max(1) }
    }

    /// The queue's routable reference, if it exists.
    pub fn queue_ref(&self, vhost: &str, name: &str) -> Option<QueueRef> {
        let def = self.topology.queue(vhost, name)?;
        Some(QueueRef {
            key: QueueKey::new(vhost, name),
            owner_core: def.owner_core % self.cores,
            durable: def.durable,
        })
    }

    /// The exchange, if it exists.
    pub fn exchange(&self, vhost: &str, name: &str) -> Option<&ExchangeDef> {
        self.topology.exchange(vhost, name)
    }

    /// Routes a message published to `exchange` in `vhost`.
    ///
    /// The default exchange (`""`) routes to the queue named by the routing key. Exchange
    /// bindings are followed; when an exchange routes nowhere and has an
    /// `alternate-exchange` argument, the message goes there instead (RabbitMQ semantics).
    /// A missing exchange routes nowhere (the caller checks existence first: 404).
    pub fn route(&self, vhost: &str, exchange: &str, routing_key: &str, headers: Option<&FieldTable>) -> Route {
        let mut route = Route::default();
        let mut seen_q: HashSet<&str> = HashSet::new();
        let mut seen_x: HashSet<&str> = HashSet::new();
        self.route_into(vhost, exchange, routing_key, headers, &mut route, &mut seen_q, &mut seen_x, 0);
        route
    }

    #[allow(clippy::too_many_arguments)]
    fn route_into<'a>(
        &'a self,
        vhost: &str,
        exchange: &'a str,
        rk: &str,
        headers: Option<&FieldTable>,
        out: &mut Route,
        seen_q: &mut HashSet<&'a str>,
        seen_x: &mut HashSet<&'a str>,
        depth: usize,
    ) -> bool {
        if depth > MAX_HOPS || !seen_x.insert(exchange) {
            return false;
        }
        if exchange.is_empty() {
            if let Some((k, _)) = self.topology.queues.get_key_value(&(vhost.to_owned(), rk.to_owned())) {
                if seen_q.insert(k.1.as_str()) {
                    if let Some(q) = self.queue_ref(vhost, rk) {
                        out.queues.push(q);
                    }
                }
                return true;
            }
            return false;
        }
        let Some(def) = self.topology.exchange(vhost, exchange) else { return false };
        let mut routed = false;
        for b in self.topology.bindings_from(vhost, exchange) {
            if !exchange::matches(def.kind, b, rk, headers) {
                continue;
            }
            match b.dest_kind {
                DestKind::Queue => {
                    routed = true;
                    if seen_q.insert(b.dest.as_str()) {
                        if let Some(q) = self.queue_ref(vhost, &b.dest) {
                            out.queues.push(q);
                        }
                    }
                }
                DestKind::Exchange => {
                    routed |= self.route_into(vhost, &b.dest, rk, headers, out, seen_q, seen_x, depth + 1);
                }
            }
        }
        if !routed {
            if let Some(alt) = string_arg(&def.arguments, "alternate-exchange") {
                // The alternate exchange's name borrows from the topology, which outlives `out`.
                let alt: &'a str = alt;
                routed = self.route_into(vhost, alt, rk, headers, out, seen_q, seen_x, depth + 1);
            }
        }
        routed
    }
}

/// A string-valued argument (long or short string) from a field table.
pub fn string_arg<'t>(args: &'t FieldTable, key: &str) -> Option<&'t str> {
    match args.inner().get(key)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str()),
        _ => None,
    }
}

/// An integer-valued argument of any integer type, as i64.
pub fn int_arg(args: &FieldTable, key: &str) -> Option<i64> {
    Some(match *args.inner().get(key)? {
        AMQPValue::ShortShortInt(i) => i as i64,
        AMQPValue::ShortShortUInt(i) => i as i64,
        AMQPValue::ShortInt(i) => i as i64,
        AMQPValue::ShortUInt(i) => i as i64,
        AMQPValue::LongInt(i) => i as i64,
        AMQPValue::LongUInt(i) => i as i64,
        AMQPValue::LongLongInt(i) => i,
        _ => return None,
    })
}
