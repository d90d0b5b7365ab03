//! A core's read-only copy of the routing tables.
//!
//! The topology lives in the Raft metadata group; every core holds an `Arc` of the latest
//! applied [`Topology`] and refreshes it when the metadata's topology version moves, so a
//! publish resolves its target queues on the core that received it (DESIGN.md, "Threads and
//! cores"). Routing follows the spec (3.1.3) plus RabbitMQ's exchange-to-exchange bindings
//! and alternate exchanges.

use std::collections::HashMap;
use std::rc::Rc;

use rustc_hash::FxHashMap;
use std::sync::Arc;

use amq_protocol::types::{AMQPValue, FieldTable};

use super::exchange;
use super::QueueRef;
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
    /// vhost → queue name → the route to that queue alone (the default exchange's), built
    /// once per topology version so that routing to it allocates nothing and counts no
    /// shared reference ([`Router::route_shared`]). Fx-hashed, as the core's queue slots are
    /// (`Node::queues`): two lookups per publish cost 2 % of a core in SipHash at 1 M msgs/s.
    queues: FxHashMap<String, FxHashMap<String, Rc<[QueueRef]>>>,
    /// The empty route, shared.
    nowhere: Rc<[QueueRef]>,
    /// Alternate exchanges given by policies, by `(vhost, exchange)` (`broker::policy`): for
    /// exchanges declared without the argument. Usually empty.
    policy_alternates: HashMap<(String, String), String>,
}

impl Router {
    /// Wraps a topology snapshot taken at `version`; `cores` maps owner cores.
    pub fn new(topology: Arc<Topology>, version: u64, cores: u32) -> Router {
        let cores = cores.max(1);
        let mut queues: FxHashMap<String, FxHashMap<String, Rc<[QueueRef]>>> = FxHashMap::default();
        for def in topology.queues.values() {
            let r = QueueRef::of(def, cores);
            queues.entry(def.vhost.clone()).or_default().insert(def.name.clone(), Rc::new([r]));
        }
        let policy_alternates = super::policy::exchange_alternates(&topology);
        Router { version, topology, queues, nowhere: Rc::new([]), policy_alternates }
    }

    /// The queue's routable reference, if it exists.
    pub fn queue_ref(&self, vhost: &str, name: &str) -> Option<QueueRef> {
        self.queues.get(vhost)?.get(name).map(|r| r[0].clone())
    }

    /// [`Router::route`]'s queues, shared: a publish to the default exchange gets the
    /// router's own one-queue route (a count of this core's, no `Arc` counted: cloning
    /// and dropping the queue's two names was 5 % of a core at 1 M msgs/s).
    pub fn route_shared(&self, vhost: &str, exchange: &str, routing_key: &str, headers: Option<&FieldTable>) -> Rc<[QueueRef]> {
        if exchange.is_empty() {
            return self.queues.get(vhost).and_then(|m| m.get(routing_key)).unwrap_or(&self.nowhere).clone();
        }
        let queues = self.route(vhost, exchange, routing_key, headers).queues;
        if queues.is_empty() {
            return self.nowhere.clone();
        }
        queues.into()
    }

    /// The exchange, if it exists.
    pub fn exchange(&self, vhost: &str, name: &str) -> Option<&ExchangeDef> {
        self.topology.exchange(vhost, name)
    }

    /// Routes a message published to `exchange` in `vhost`.
    ///
    /// The default exchange (`""`) routes to the queue named by the routing key. Exchange
    /// bindings are followed; when an exchange routes nowhere and has an
    /// `alternate-exchange` argument (or a policy gives it one), the message goes there
    /// instead (RabbitMQ semantics).
    /// A missing exchange routes nowhere (the caller checks existence first: 404).
    pub fn route(&self, vhost: &str, exchange: &str, routing_key: &str, headers: Option<&FieldTable>) -> Route {
        let mut route = Route::default();
        if exchange.is_empty() {
            // The default exchange: the queue named by the routing key, no bindings to walk.
            route.queues.extend(self.queue_ref(vhost, routing_key));
            return route;
        }
        let mut seen_x: Vec<&str> = Vec::new();
        self.route_into(vhost, exchange, routing_key, headers, &mut route, &mut seen_x, 0);
        route
    }

    /// Adds `q` to the route unless it is there already (routes are short: a Vec beats a set).
    fn push_queue(&self, vhost: &str, name: &str, out: &mut Route) {
        if out.queues.iter().any(|q| &*q.key.name == name) {
            return;
        }
        out.queues.extend(self.queue_ref(vhost, name));
    }

    #[allow(clippy::too_many_arguments)]
    fn route_into<'a>(
        &'a self,
        vhost: &str,
        exchange: &'a str,
        rk: &str,
        headers: Option<&FieldTable>,
        out: &mut Route,
        seen_x: &mut Vec<&'a str>,
        depth: usize,
    ) -> bool {
        if depth > MAX_HOPS || seen_x.contains(&exchange) {
            return false;
        }
        seen_x.push(exchange);
        if exchange.is_empty() {
            let exists = self.queue_ref(vhost, rk).is_some();
            self.push_queue(vhost, rk, out);
            return exists;
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
                    self.push_queue(vhost, &b.dest, out);
                }
                DestKind::Exchange => {
                    routed |= self.route_into(vhost, &b.dest, rk, headers, out, seen_x, depth + 1);
                }
            }
        }
        if !routed {
            let from_policy = || match self.policy_alternates.is_empty() {
                true => None,
                false => self.policy_alternates.get(&(vhost.to_owned(), exchange.to_owned())).map(String::as_str),
            };
            if let Some(alt) = string_arg(&def.arguments, "alternate-exchange").or_else(from_policy) {
                // The alternate exchange's name borrows from the topology, which outlives `out`.
                let alt: &'a str = alt;
                routed = self.route_into(vhost, alt, rk, headers, out, seen_x, depth + 1);
            }
        }
        routed
    }
}

/// A string-valued argument (long or short string) from a field table.
pub fn string_arg<'t>(args: &'t FieldTable, key: &str) -> Option<&'t str> {
    std::str::from_utf8(str_value(args.inner().get(key)?)?).ok()
}

/// A boolean argument (`Some(b)` only for an AMQP boolean).
pub fn bool_arg(args: &FieldTable, key: &str) -> Option<bool> {
    match args.inner().get(key)? {
        AMQPValue::Boolean(b) => Some(*b),
        _ => None,
    }
}

/// An integer-valued argument of any integer type, as i64.
pub fn int_arg(args: &FieldTable, key: &str) -> Option<i64> {
    match args.inner().get(key)? {
        AMQPValue::Timestamp(_) => None,
        v => int_value(v).and_then(|i| i64::try_from(i).ok()),
    }
}

/// The value of any AMQP integer type (timestamps included), widened.
pub fn int_value(v: &AMQPValue) -> Option<i128> {
    Some(match *v {
        AMQPValue::ShortShortInt(i) => i as i128,
        AMQPValue::ShortShortUInt(i) => i as i128,
        AMQPValue::ShortInt(i) => i as i128,
        AMQPValue::ShortUInt(i) => i as i128,
        AMQPValue::LongInt(i) => i as i128,
        AMQPValue::LongUInt(i) => i as i128,
        AMQPValue::LongLongInt(i) => i as i128,
        AMQPValue::Timestamp(i) => i as i128,
        _ => return None,
    })
}

/// The bytes of a long or short string value.
pub fn str_value(v: &AMQPValue) -> Option<&[u8]> {
    match v {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
        _ => None,
    }
}
