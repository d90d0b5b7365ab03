//! B's side: running a peer's operations on this node's queues, on the queue's core, and
//! sending the queue's events and answers back (module doc of `remote`).
//!
//! A peer's ids (connections, channel incarnations, consumers) are made this node's own by
//! putting the peer's node id in their top 16 bits ([`local_id`]): this node's own ids come
//! from one counter starting at 1 and never reach 2^48, so no two clash, and the way back
//! ([`peer_id`]) needs no table.

use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::wire::{Event, Frame, GotMessage, Reply as WireReply, Request};
use super::Remote;
use crate::broker::credit::PublishCredit;
use crate::broker::node::{Node, NodeMsg};
use crate::broker::queue::consumer::pending_weight;
use crate::broker::{
    reply_channel, CancelOkTo, ChannelCredit, ChannelId, ClientEvent, ClientTx, ConfirmTo, ConnId, ConsumerSpec, ConsumerTag, Holder,
    Offset, QueueError, QueueOp, QueueRef,
};
use crate::meta::NodeId;

/// Bits of a local id that hold the peer's own id.
const PEER_ID_BITS: u32 = 48;

/// This node's id for a peer's id `id` (a connection, a channel incarnation, a consumer).
pub(super) fn local_id(peer: NodeId, id: u64) -> u64 {
    (peer << PEER_ID_BITS) | (id & ((1 << PEER_ID_BITS) - 1))
}

/// The peer's id behind a [`local_id`].
pub(super) fn peer_id(id: u64) -> u64 {
    id & ((1 << PEER_ID_BITS) - 1)
}

/// A peer's connection as this node's queues see it.
struct Proxy {
    /// The event channel the queues answer on; a task sends what arrives to the peer.
    tx: ClientTx,
    /// Delivered bytes not yet handed to the transport.
    pending: Arc<AtomicUsize>,
    /// Channel-wide prefetch windows, by channel.
    credits: HashMap<u16, Arc<ChannelCredit>>,
    /// (queue, local channel incarnation) it may hold deliveries in: closed when the link dies.
    touched: HashSet<(QueueRef, u64)>,
    /// The credit its publishes take here: its releases go back to the peer as
    /// `Event::Taken` (`broker::credit`, module doc).
    credit: Arc<PublishCredit>,
}

/// B's forwarding state (under `Remote::owner`).
#[derive(Default)]
pub struct OwnerSide {
    proxies: HashMap<(NodeId, u64), Proxy>,
}

impl Remote {
    /// A request from `from` (on a transport thread): a queue operation goes to the queue's
    /// core (invariant 4: only when this node owns the queue); a connection's end is handled
    /// here.
    pub(super) fn route_request(&self, from: NodeId, req: Request) {
        if let Request::Publish { queue, message, confirm, credit } = &req {
            if crate::broker::reply_to::parse(&queue.name).is_some() {
                // A reply to one of this node's direct reply-to names (`broker::reply_to`).
                let target =
                    QueueRef { key: queue.clone(), owner_core: crate::broker::reply_to::DIRECT_CORE, owner_node: self.me, durable: false };
                self.reply_to.deliver(&target, message.clone());
                if let Some(c) = confirm {
                    let event = Event::Stored { channel: c.channel, chan_uid: c.chan_uid, seq: c.seq, ok: true };
                    let _ = self.send_frame(from, &Frame::Event { conn: c.conn, event });
                }
                self.taken_at_once(from, *credit);
                return;
            }
        }
        let queue = match &req {
            Request::ConnectionClosed { conn } => {
                self.owner.lock().proxies.remove(&(from, *conn));
                return;
            }
            Request::Publish { queue, .. }
            | Request::Get { queue, .. }
            | Request::Consume { queue, .. }
            | Request::Cancel { queue, .. }
            | Request::Settle { queue, .. }
            | Request::ChannelClosed { queue, .. }
            | Request::Redeliver { queue, .. }
            | Request::Stats { queue, .. }
            | Request::Purge { queue, .. }
            | Request::Delete { queue, .. } => queue.clone(),
        };
        let Some(qref) = self.own_queue(&queue) else {
            let why = QueueError::NotFound(format!("no queue '{}' in vhost '{}' on node {}", queue.name, queue.vhost, self.me));
            self.refuse(from, req, why);
            return;
        };
        let core = qref.owner_core as usize;
        if let Err(NodeMsg::Remote { req, .. }) = self.inboxes.send(core, NodeMsg::Remote { from, qref, req: Box::new(req) }) {
            self.refuse(from, *req, QueueError::InternalError("node shutting down".into()));
        }
    }

    /// Answers a request that cannot run here.
    fn refuse(&self, from: NodeId, req: Request, why: QueueError) {
        let reply = match req {
            Request::Publish { confirm, credit, .. } => {
                if let Some(c) = confirm {
                    let event = Event::Stored { channel: c.channel, chan_uid: c.chan_uid, seq: c.seq, ok: false };
                    let _ = self.send_frame(from, &Frame::Event { conn: c.conn, event });
                }
                self.taken_at_once(from, credit);
                return;
            }
            Request::Get { req, .. } => (req, WireReply::Get(Err(why))),
            Request::Consume { req, .. } => (req, WireReply::Consume(Err(why))),
            Request::Stats { req, .. } => (req, WireReply::Stats(Err(why))),
            Request::Purge { req, .. } | Request::Delete { req, .. } => (req, WireReply::Count(Err(why))),
            // basic.cancel is always answered (the consumer is gone with its queue here).
            Request::Cancel { send_ok: true, conn, channel, consumer_tag, .. } => {
                let _ = self.send_frame(from, &Frame::Event { conn, event: Event::CancelOk { channel, consumer_tag } });
                return;
            }
            _ => return,
        };
        let _ = self.send_frame(from, &Frame::Reply { req: reply.0, reply: reply.1 });
    }

    /// A publish of `from`'s connection `conn` (0: none) holding credit there was taken
    /// without reaching a queue here (refused, or a direct reply-to): its credit goes back.
    fn taken_at_once(&self, from: NodeId, conn: u64) {
        if conn != 0 {
            let _ = self.send_frame(from, &Frame::Event { conn, event: Event::Taken { count: 1 } });
        }
    }

    /// Runs `req` from `from` on `qref`, on the queue's core (`node`).
    pub fn run_request(self: &Arc<Self>, node: &Rc<Node>, from: NodeId, qref: QueueRef, req: Request) {
        let op = match req {
            Request::Publish { message, confirm, credit, .. } => {
                // The peer's connection waits for this credit to come back (module doc of
                // `broker::credit`); the queue keeps it while its store's writer is behind.
                let credit = match credit {
                    0 => None,
                    conn => self.proxy_credit(from, conn).map(|pool| pool.take(message.body.len() + message.header.len())),
                };
                let confirm = confirm.map(|c| ConfirmTo {
                    tx: self.proxy_tx(from, c.conn),
                    conn: ConnId(local_id(from, c.conn)),
                    channel: ChannelId(c.channel),
                    chan_uid: local_id(from, c.chan_uid),
                    seq: c.seq,
                });
                QueueOp::Publish { message, confirm, published: None, credit }
            }
            Request::Get { req, no_ack, holder, .. } => {
                let chan_uid = local_id(from, holder.chan_uid);
                let tx = self.touch(from, holder.conn, &qref, chan_uid);
                let holder = Holder { conn: ConnId(local_id(from, holder.conn)), channel: ChannelId(holder.channel), chan_uid, tx };
                let (reply, rx) = reply_channel();
                let me = self.clone();
                crate::core::spawn_soon(async move {
                    let got: Result<Option<crate::broker::GetReply>, QueueError> =
                        rx.recv_async().await.unwrap_or_else(|_| Err(QueueError::InternalError("queue did not answer".into())));
                    let got = got.map(|o| {
                        o.map(|g| GotMessage {
                            offset: g.offset.0,
                            redelivered: g.redelivered,
                            message: g.message,
                            message_count: g.message_count,
                        })
                    });
                    let _ = me.send_frame(from, &Frame::Reply { req, reply: WireReply::Get(got) });
                });
                QueueOp::Get { no_ack, holder, reply }
            }
            Request::Consume { req, consumer: c, .. } => {
                let chan_uid = local_id(from, c.holder.chan_uid);
                let tx = self.touch(from, c.holder.conn, &qref, chan_uid);
                let (pending, credit) = {
                    let mut owner = self.owner.lock();
                    let proxy = owner.proxies.get_mut(&(from, c.holder.conn)).expect("touched above");
                    let credit = proxy.credits.entry(c.holder.channel).or_default().clone();
                    (proxy.pending.clone(), credit)
                };
                credit.limit.store(c.channel_prefetch, Ordering::Relaxed);
                let spec = ConsumerSpec {
                    id: local_id(from, c.id),
                    conn: ConnId(local_id(from, c.holder.conn)),
                    channel: ChannelId(c.holder.channel),
                    chan_uid,
                    tag: ConsumerTag::from(c.tag.as_str()),
                    no_ack: c.no_ack,
                    exclusive: c.exclusive,
                    prefetch: c.prefetch,
                    channel_credit: credit,
                    cancel_notify: c.cancel_notify,
                    send_consume_ok: c.send_consume_ok,
                    priority: c.priority,
                    tx,
                    pending_bytes: pending,
                    remote: true,
                };
                let (reply, rx) = reply_channel();
                self.answer_later(from, req, rx, WireReply::Consume);
                QueueOp::Consume { consumer: spec, reply }
            }
            Request::Cancel { consumer, send_ok, conn, channel, consumer_tag, .. } => {
                // Answered here whether or not the queue holds the consumer.
                let ok = send_ok
                    .then(|| CancelOkTo::new(self.proxy_tx(from, conn), ChannelId(channel), ConsumerTag::from(consumer_tag.as_str())));
                QueueOp::Cancel { consumer: local_id(from, consumer), ok }
            }
            Request::Settle { chan_uid, ack, requeue, reject, .. } => {
                let offs = |v: Vec<u64>| v.into_iter().map(Offset).collect();
                QueueOp::Settle { chan_uid: local_id(from, chan_uid), ack: offs(ack), requeue: offs(requeue), reject: offs(reject) }
            }
            Request::ChannelClosed { chan_uid, .. } => {
                let chan_uid = local_id(from, chan_uid);
                for proxy in self.owner.lock().proxies.iter_mut().filter(|((p, _), _)| *p == from).map(|(_, v)| v) {
                    proxy.touched.remove(&(qref.clone(), chan_uid));
                }
                QueueOp::ChannelClosed { chan_uid }
            }
            Request::Redeliver { offsets, .. } => QueueOp::Redeliver { offsets: offsets.into_iter().map(Offset).collect() },
            Request::Stats { req, .. } => {
                let (reply, rx) = reply_channel();
                self.answer_later(from, req, rx, WireReply::Stats);
                QueueOp::Stats { reply }
            }
            Request::Purge { req, .. } => {
                let (reply, rx) = reply_channel();
                self.answer_later(from, req, rx, WireReply::Count);
                QueueOp::Purge { reply }
            }
            Request::Delete { req, if_unused, if_empty, .. } => {
                let (reply, rx) = reply_channel();
                self.answer_later(from, req, rx, WireReply::Count);
                QueueOp::Delete { if_unused, if_empty, reply }
            }
            Request::ConnectionClosed { .. } => return,
        };
        node.send_from_connection(&qref, op);
    }

    /// Sends the queue's answer on `rx` back as reply `req` once it comes (a task on this core).
    fn answer_later<T: Send + 'static>(
        self: &Arc<Self>,
        from: NodeId,
        req: u64,
        rx: flume::Receiver<Result<T, QueueError>>,
        wrap: fn(Result<T, QueueError>) -> WireReply,
    ) {
        let me = self.clone();
        crate::core::spawn_soon(async move {
            let r = rx.recv_async().await.unwrap_or_else(|_| Err(QueueError::InternalError("queue did not answer".into())));
            let _ = me.send_frame(from, &Frame::Reply { req, reply: wrap(r) });
        });
    }

    /// The proxy event channel of `from`'s connection `conn`, created (with its sending task
    /// on this core) on first use.
    fn proxy_tx(self: &Arc<Self>, from: NodeId, conn: u64) -> ClientTx {
        let mut owner = self.owner.lock();
        if let Some(p) = owner.proxies.get(&(from, conn)) {
            return p.tx.clone();
        }
        let (tx, rx) = flume::unbounded();
        let pending = Arc::new(AtomicUsize::new(0));
        let credit = PublishCredit::counting(tx.clone());
        let proxy =
            Proxy { tx: tx.clone(), pending: pending.clone(), credits: HashMap::new(), touched: HashSet::new(), credit: credit.clone() };
        owner.proxies.insert((from, conn), proxy);
        drop(owner);
        // The task keeps a weak handle: the pool's sender must not keep its own receiver alive.
        crate::core::spawn_soon(send_events(self.clone(), from, conn, rx, pending, Arc::downgrade(&credit)));
        tx
    }

    /// The credit pool of `from`'s connection `conn` ([`Remote::proxy_tx`] creates its
    /// proxy); `None` when the connection's close removed the proxy meanwhile.
    fn proxy_credit(self: &Arc<Self>, from: NodeId, conn: u64) -> Option<Arc<PublishCredit>> {
        self.proxy_tx(from, conn);
        self.owner.lock().proxies.get(&(from, conn)).map(|p| p.credit.clone())
    }

    /// [`Remote::proxy_tx`], recording that the channel may hold deliveries of `qref`.
    fn touch(self: &Arc<Self>, from: NodeId, conn: u64, qref: &QueueRef, chan_uid: u64) -> ClientTx {
        let tx = self.proxy_tx(from, conn);
        if let Some(p) = self.owner.lock().proxies.get_mut(&(from, conn)) {
            p.touched.insert((qref.clone(), chan_uid));
        }
        tx
    }

    /// Invariant 3, B's half: every channel of `peer`'s connections is closed here (their
    /// deliveries requeued, their consumers dropped), and the proxies go.
    pub(super) fn owner_link_down(&self, peer: NodeId) {
        let gone: Vec<Proxy> = {
            let mut owner = self.owner.lock();
            let keys: Vec<(NodeId, u64)> = owner.proxies.keys().filter(|(p, _)| *p == peer).copied().collect();
            keys.into_iter().filter_map(|k| owner.proxies.remove(&k)).collect()
        };
        for proxy in gone {
            for (qref, chan_uid) in proxy.touched {
                let core = qref.owner_core as usize;
                let _ = self.inboxes.send(core, NodeMsg::Queue { queue: qref, op: QueueOp::ChannelClosed { chan_uid } });
            }
        }
    }
}

/// The task behind a proxy: sends each event the queues put on it to the peer, in order,
/// until every sender is gone (the connection closed and its queues let go of it).
async fn send_events(
    remote: Arc<Remote>,
    to: NodeId,
    conn: u64,
    rx: flume::Receiver<ClientEvent>,
    pending: Arc<AtomicUsize>,
    credit: std::sync::Weak<PublishCredit>,
) {
    while let Ok(ev) = rx.recv_async().await {
        if let ClientEvent::Deliveries(b) = ev {
            // One frame per delivery, as they came one by one.
            for d in b.into_each() {
                forward_event(&remote, to, conn, ClientEvent::Deliver(d), &pending, &credit);
            }
            continue;
        }
        forward_event(&remote, to, conn, ev, &pending, &credit);
    }
}

/// Sends one event of a proxy's connection to the peer (see [`send_events`]).
fn forward_event(remote: &Remote, to: NodeId, conn: u64, ev: ClientEvent, pending: &AtomicUsize, credit: &std::sync::Weak<PublishCredit>) {
    let mut weight = 0;
    let event = match ev {
        // Every release since the last batch, in one event.
        ClientEvent::PublishesTaken => match credit.upgrade().map(|c| c.take_counted()) {
            Some(count) if count > 0 => Event::Taken { count },
            _ => return,
        },
        ClientEvent::Deliver(d) => {
            weight = pending_weight(d.message.body.len());
            Event::Deliver {
                channel: d.channel.0,
                chan_uid: peer_id(d.chan_uid),
                consumer_tag: d.consumer_tag.0.to_string(),
                queue: d.queue.key,
                durable: d.queue.durable,
                owner_core: d.queue.owner_core,
                offset: d.offset.0,
                redelivered: d.redelivered,
                message: d.message,
                track: d.track,
            }
        }
        ClientEvent::ConsumeOk { channel, consumer_tag } => {
            Event::ConsumeOk { channel: channel.0, consumer_tag: consumer_tag.0.to_string() }
        }
        ClientEvent::CancelOk { channel, consumer_tag } => {
            Event::CancelOk { channel: channel.0, consumer_tag: consumer_tag.0.to_string() }
        }
        ClientEvent::Cancelled { channel, consumer_tag } => {
            Event::Cancelled { channel: channel.0, consumer_tag: consumer_tag.0.to_string() }
        }
        ClientEvent::Stored { channel, chan_uid, seq, ok } => {
            Event::Stored { channel: channel.0, chan_uid: peer_id(chan_uid), seq, ok }
        }
        ClientEvent::AckTimeout { channel, chan_uid, timeout_ms } => {
            Event::AckTimeout { channel: channel.0, chan_uid: peer_id(chan_uid), timeout_ms }
        }
        // Connection-wide events go to this node's own connections only.
        ClientEvent::Frames(_)
        | ClientEvent::Deleted { .. }
        | ClientEvent::Shutdown
        | ClientEvent::ResourceAlarm(_)
        | ClientEvent::Describe(_)
        // (A batch comes here one delivery at a time: `send_events` splits it.)
        | ClientEvent::Deliveries(_)
        | ClientEvent::Close(_) => return,
    };
    if let Err(why) = remote.send_frame(to, &Frame::Event { conn, event }) {
        // The link is down: its loss requeues what this connection held.
        tracing::debug!(to, %why, "event for a peer's connection dropped");
    }
    if weight > 0 {
        pending.fetch_sub(weight, Ordering::Relaxed);
    }
}
