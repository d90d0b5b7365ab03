//! Direct reply-to (RabbitMQ's `amq.rabbitmq.reply-to` pseudo-queue, docs "Direct Reply-to"):
//! RPC replies that reach the requester's channel without a queue.
//!
//! # How it goes
//! 1. The requester consumes from [`PSEUDO_QUEUE`] in no-ack mode; its channel is registered
//!    here under a token and gets a name `amq.rabbitmq.reply-to.<node>.<token>`.
//! 2. It publishes its request with `reply_to = amq.rabbitmq.reply-to`; the broker rewrites
//!    the property to the channel's name (the protocol layer does that).
//! 3. The responder publishes its reply to the default exchange with that name as routing
//!    key. Routing gives it one pseudo target ([`target`]), which carries the node and
//!    [`DIRECT_CORE`] instead of a core: the node serving the name (this one, or a peer through
//!    `broker::remote`) hands the message straight to the requester's connection
//!    ([`ReplyConsumers::deliver`]), as a delivery without a tag to track (no-ack).
//! 4. The name lives as long as the consumer: basic.cancel, the channel's or the connection's
//!    close unregister it, and a reply to a name no longer registered is dropped (RabbitMQ's
//!    behaviour), or returned to a mandatory publisher on the same node.
//!
//! # Assumptions
//! The registry is shared by the cores and the transport threads behind one mutex: it is
//! touched once per request consumer, per reply and per cancel, never by other traffic.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::message::Message;
use super::queue::consumer::pending_weight;
use super::{ChannelId, ClientEvent, ClientTx, ConsumerTag, Delivery, Offset, QueueKey, QueueRef};
use crate::meta::NodeId;

/// The pseudo-queue a requester consumes from, and the `reply_to` it publishes with.
pub const PSEUDO_QUEUE: &str = "amq.rabbitmq.reply-to";

/// Prefix of the names replies are published to (routing key on the default exchange).
pub const PREFIX: &str = "amq.rabbitmq.reply-to.";

/// `QueueRef::owner_core` of a reply's pseudo target: no queue, no core.
pub const DIRECT_CORE: u32 = u32::MAX;

/// Where replies to one name go: the requester's channel and consumer.
#[derive(Clone, Debug)]
pub struct ReplyConsumer {
    /// The requester's channel.
    pub channel: ChannelId,
    /// Its incarnation: a reply never reaches a channel reopened under the same number.
    pub chan_uid: u64,
    /// The consumer tag of its basic.consume on [`PSEUDO_QUEUE`].
    pub consumer_tag: ConsumerTag,
    /// The requester's connection's event channel.
    pub tx: ClientTx,
    /// That connection's bytes handed to it and not yet written (`queue::consumer`).
    pub pending_bytes: Arc<AtomicUsize>,
}

/// The reply consumers of this node, by token.
#[derive(Default)]
pub struct ReplyConsumers {
    map: Mutex<FxHashMap<u64, ReplyConsumer>>,
}

/// The name of token `token` on node `node` (step 1).
pub fn name(node: NodeId, token: u64) -> String {
    format!("{PREFIX}{node}.{token:016x}")
}

/// (node, token) of a reply name, `None` for anything else.
pub fn parse(name: &str) -> Option<(NodeId, u64)> {
    let (node, token) = name.strip_prefix(PREFIX)?.split_once('.')?;
    if token.len() != 16 {
        return None;
    }
    Some((node.parse().ok()?, u64::from_str_radix(token, 16).ok()?))
}

/// The pseudo target a reply published to `routing_key` in `vhost` routes to (step 3), or
/// `None` when the routing key is no reply name.
pub fn target(vhost: &str, routing_key: &str) -> Option<QueueRef> {
    let (node, _) = parse(routing_key)?;
    Some(QueueRef { key: QueueKey::new(vhost, routing_key), owner_core: DIRECT_CORE, owner_node: node, durable: false })
}

impl ReplyConsumers {
    /// Registers a reply consumer under `token` (unique on this node, hard to guess: the
    /// caller mixes an id with the clock) and returns its name.
    pub fn register(&self, node: NodeId, token: u64, consumer: ReplyConsumer) -> String {
        self.map.lock().insert(token, consumer);
        name(node, token)
    }

    /// Removes a reply consumer (basic.cancel, channel or connection closed).
    pub fn unregister(&self, token: u64) {
        self.map.lock().remove(&token);
    }

    /// Whether replies to `name` (one of this node's) have somewhere to go.
    pub fn serves(&self, name: &str) -> bool {
        parse(name).is_some_and(|(_, token)| self.map.lock().contains_key(&token))
    }

    /// Hands a reply published to `target` (a name of this node) to its requester: true when
    /// it was handed over, false when the name is not (or no longer) registered.
    pub fn deliver(&self, target: &QueueRef, message: Message) -> bool {
        let Some((_, token)) = parse(&target.key.name) else { return false };
        let Some(c) = self.map.lock().get(&token).cloned() else { return false };
        let weight = pending_weight(message.body.len());
        c.pending_bytes.fetch_add(weight, Ordering::Relaxed);
        let d = Delivery {
            channel: c.channel,
            chan_uid: c.chan_uid,
            consumer_tag: c.consumer_tag,
            queue: target.clone(),
            offset: Offset(0),
            redelivered: false,
            message,
            track: false,
            taken: None,
        };
        if c.tx.send(ClientEvent::Deliver(d)).is_err() {
            c.pending_bytes.fetch_sub(weight, Ordering::Relaxed);
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_nothing_else_parses() {
        let n = name(3, 0xdead_beef_0000_0001);
        assert_eq!(n, "amq.rabbitmq.reply-to.3.deadbeef00000001");
        assert_eq!(parse(&n), Some((3, 0xdead_beef_0000_0001)));
        for other in [
            "amq.rabbitmq.reply-to",
            "amq.rabbitmq.reply-to.",
            "amq.rabbitmq.reply-to.x.deadbeef00000001",
            "jobs",
            "amq.rabbitmq.reply-to.1.12",
        ] {
            assert_eq!(parse(other), None, "{other}");
        }
        let t = target("/", &n).expect("a reply name routes");
        assert_eq!((t.owner_node, t.owner_core, t.key.name.as_str()), (3, DIRECT_CORE, n.as_str()));
    }

    #[test]
    fn a_reply_reaches_its_channel_once_registered_and_never_after() {
        let r = ReplyConsumers::default();
        let (tx, rx) = flume::unbounded();
        let pending = Arc::new(AtomicUsize::new(0));
        let consumer =
            ReplyConsumer { channel: ChannelId(2), chan_uid: 9, consumer_tag: ConsumerTag::from("c"), tx, pending_bytes: pending.clone() };
        let n = r.register(1, 7, consumer);
        let t = target("/", &n).unwrap();
        assert!(r.serves(&n));
        let m = Message::new("", &n, &[0, 0], bytes::Bytes::from_static(b"reply"), false);
        assert!(r.deliver(&t, m.clone()));
        match rx.try_recv() {
            Ok(ClientEvent::Deliver(d)) => {
                assert_eq!((d.channel, d.chan_uid, d.track, &d.message.body[..]), (ChannelId(2), 9, false, &b"reply"[..]));
            }
            other => panic!("expected a delivery, got {other:?}"),
        }
        assert_eq!(pending.load(Ordering::Relaxed), pending_weight(5));
        r.unregister(7);
        assert!(!r.serves(&n) && !r.deliver(&t, m), "a reply after the cancel was handed over");
    }
}
