//! A's side: forwarding a connection's operations to the queue's node, and handing events and
//! replies back to the connection (module doc of `remote`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::wire::{Event, Frame, GotMessage, RemoteConfirm, RemoteConsumer, RemoteHolder, Reply as WireReply, Request};
use super::Remote;
use crate::broker::credit::CreditHeld;
use crate::broker::queue::consumer::pending_weight;
use crate::broker::{
    CancelOkTo, ChannelId, ClientEvent, ClientTx, ConfirmTo, ConnId, ConsumerSpec, ConsumerTag, Delivery, GetReply, Offset, QueueError,
    QueueKey, QueueOp, QueueRef, Reply,
};
use crate::meta::NodeId;

/// A request waiting for its reply.
enum Waiting {
    Get(Reply<Result<Option<GetReply>, QueueError>>),
    Consume(Reply<Result<(), QueueError>>),
    Stats(Reply<Result<(u32, u32), QueueError>>),
    Count(Reply<Result<u32, QueueError>>),
}

impl Waiting {
    fn fail(self, e: QueueError) {
        match self {
            Waiting::Get(r) => drop(r.send(Err(e))),
            Waiting::Consume(r) => drop(r.send(Err(e))),
            Waiting::Stats(r) => drop(r.send(Err(e))),
            Waiting::Count(r) => drop(r.send(Err(e))),
        }
    }
}

/// One of this node's connections that has used another node's queue.
struct Conn {
    tx: ClientTx,
    /// Its `pending_bytes` (known once it consumed remotely): deliveries from a peer weigh
    /// there as local ones do (the connection's writer takes the weight off again).
    pending_bytes: Option<Arc<AtomicUsize>>,
    /// Peers it sent operations to (told when it closes).
    peers: HashSet<NodeId>,
}

/// A consumer of another node's queue.
pub(super) struct Consumer {
    peer: NodeId,
    conn: u64,
    channel: u16,
    tag: String,
    cancel_notify: bool,
    /// basic.cancel sent, its cancel-ok not back yet: `Some(send_ok)`.
    cancelling: Option<bool>,
    /// Its queue and itself as sent, to follow the queue to its next server
    /// (`failover.rs`, rule 4).
    queue: QueueKey,
    spec: ConsumerSpec,
}

/// A publish sent to a peer whose confirm is not back yet.
struct Unanswered {
    channel: u16,
    /// Answers due: one per target queue on that peer.
    due: u32,
    /// The publish as sent, while it went to one queue there: parked for the queue's next
    /// server if the link goes down before the answer and the queue is replicated
    /// (`failover.rs`, rule 1), instead of nacked.
    resend: Option<(QueueRef, crate::broker::Message)>,
    /// When the publish was first parked, if it was (`failover.rs`): parked again, it keeps
    /// that time, so a flapping link does not hold it past `PARK_LIMIT` in all.
    parked: Option<Instant>,
}

/// How often `Remote::repark_moved` looks again without a topology change.
const MOVED_RECHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// A's forwarding state (under `Remote::client`).
pub struct ClientSide {
    /// Requests waiting for their reply, with their queue (whose node answers).
    waiting: HashMap<u64, (QueueRef, Waiting)>,
    conns: HashMap<u64, Conn>,
    pub(super) consumers: HashMap<u64, Consumer>,
    /// Confirms not answered yet: (peer, conn, chan_uid, seq) → what is due.
    confirms: HashMap<(NodeId, u64, u64, u64), Unanswered>,
    /// Publish credit of this node's connections held for their publishes to a peer's
    /// queues, oldest first, until the peer says they were taken (`Event::Taken`;
    /// `broker::credit`): (peer, conn) → credits. An entry stays while the connection lives
    /// (it names the peers to tell when the connection closes).
    held: HashMap<(NodeId, u64), VecDeque<Arc<CreditHeld>>>,
    /// Publishes and consumers held while their replicated queue has no server in reach
    /// (`failover.rs`).
    pub(super) failover: super::failover::Held,
    /// The topology version `repark_moved` last looked at, and when.
    moved_seen: (u64, Instant),
}

impl Default for ClientSide {
    fn default() -> ClientSide {
        ClientSide {
            waiting: HashMap::new(),
            conns: HashMap::new(),
            consumers: HashMap::new(),
            confirms: HashMap::new(),
            held: HashMap::new(),
            failover: Default::default(),
            moved_seen: (u64::MAX, Instant::now()),
        }
    }
}

impl ClientSide {
    fn conn(&mut self, conn: ConnId, tx: &ClientTx, peer: NodeId) -> &mut Conn {
        let c = self.conns.entry(conn.0).or_insert_with(|| Conn { tx: tx.clone(), pending_bytes: None, peers: HashSet::new() });
        c.peers.insert(peer);
        c
    }
}

pub(super) fn unreachable(qref: &QueueRef, why: &str) -> QueueError {
    QueueError::NotFound(format!(
        "home node {} of queue '{}' in vhost '{}' is down or inaccessible ({why})",
        qref.owner_node, qref.key.name, qref.key.vhost
    ))
}

impl Remote {
    /// Sends `op` on `qref` (a queue of another node) to its node. Never blocks; when the
    /// lane is down the operation is answered at once as refused (a publish is nacked), but
    /// for what `failover.rs` holds until the queue has a server again.
    pub fn forward(&self, qref: &QueueRef, op: QueueOp) {
        self.forward_in(&mut self.client.lock(), qref, op);
    }

    /// [`Remote::forward`] under the client lock `cl`.
    pub(super) fn forward_in(&self, cl: &mut ClientSide, qref: &QueueRef, op: QueueOp) {
        self.forward_parked(cl, qref, op, None)
    }

    /// [`Remote::forward_in`] for an operation first parked at `parked` (`failover.rs`).
    pub(super) fn forward_parked(&self, cl: &mut ClientSide, qref: &QueueRef, op: QueueOp, parked: Option<Instant>) {
        if self.must_park(cl, qref, &op) {
            return self.park(cl, qref, op, parked);
        }
        let peer = qref.owner_node;
        let queue = qref.key.clone();
        let (req, waiting) = match op {
            QueueOp::Publish { message, confirm, credit, .. } => {
                if let Some(c) = self.send_publish(cl, qref, message, confirm, credit, parked) {
                    c.answer(false);
                }
                return;
            }
            QueueOp::Get { no_ack, holder, reply } => {
                cl.conn(holder.conn, &holder.tx, peer);
                let req = self.next_req();
                let h = RemoteHolder { conn: holder.conn.0, channel: holder.channel.0, chan_uid: holder.chan_uid };
                (Request::Get { req, queue, no_ack, holder: h }, Some((req, Waiting::Get(reply))))
            }
            QueueOp::Consume { consumer: c, reply } => {
                let conn = cl.conn(c.conn, &c.tx, peer);
                conn.pending_bytes = Some(c.pending_bytes.clone());
                let cancel_notify = c.cancel_notify;
                let (tag, spec) = (c.tag.0.to_string(), c.clone());
                cl.consumers.insert(
                    c.id,
                    Consumer {
                        peer,
                        conn: c.conn.0,
                        channel: c.channel.0,
                        tag,
                        cancel_notify,
                        cancelling: None,
                        queue: queue.clone(),
                        spec,
                    },
                );
                let req = self.next_req();
                let consumer = RemoteConsumer {
                    id: c.id,
                    holder: RemoteHolder { conn: c.conn.0, channel: c.channel.0, chan_uid: c.chan_uid },
                    tag: c.tag.0.to_string(),
                    no_ack: c.no_ack,
                    exclusive: c.exclusive,
                    prefetch: c.prefetch,
                    channel_prefetch: c.channel_credit.limit.load(Ordering::Relaxed),
                    cancel_notify,
                    send_consume_ok: c.send_consume_ok,
                    priority: c.priority,
                };
                (Request::Consume { req, queue, consumer }, Some((req, Waiting::Consume(reply))))
            }
            QueueOp::Cancel { consumer, ok } => {
                let Some(c) = cl.consumers.get_mut(&consumer) else {
                    // No consumer of the peer's queue this node knows (refused, or gone with
                    // a link): answered here (`ok` dropped), the peer drops it if it has it.
                    drop(ok);
                    let (conn, channel, consumer_tag) = (0, 0, String::new());
                    return self.send_cancel(peer, Request::Cancel { queue, consumer, send_ok: false, conn, channel, consumer_tag });
                };
                // The peer's queue answers it, or the loss of the link does (`client_link_down`).
                let send_ok = ok.map(CancelOkTo::handed_on).is_some();
                c.cancelling = Some(send_ok);
                (Request::Cancel { queue, consumer, send_ok, conn: c.conn, channel: c.channel, consumer_tag: c.tag.clone() }, None)
            }
            QueueOp::Settle { chan_uid, ack, requeue, reject } => {
                let offs = |v: Vec<Offset>| v.into_iter().map(|o| o.0).collect();
                (Request::Settle { queue, chan_uid, ack: offs(ack), requeue: offs(requeue), reject: offs(reject) }, None)
            }
            QueueOp::ChannelClosed { chan_uid } => {
                // Its consumers of this queue are gone here at once, whatever becomes of the
                // request: a link that goes down after the close (the peer frozen or dead,
                // the request unread) must not make them orphans that follow the queue to
                // its next server and take messages for a channel that no longer exists.
                cl.consumers.retain(|_, c| !(c.spec.chan_uid == chan_uid && c.queue == queue));
                (Request::ChannelClosed { queue, chan_uid }, None)
            }
            QueueOp::Redeliver { offsets } => (Request::Redeliver { queue, offsets: offsets.into_iter().map(|o| o.0).collect() }, None),
            // The queue's node keeps its own window for this channel (settlements there give
            // it back); nothing to wake from here.
            // Replicated data goes to this node's own store only.
            // The management API asks a peer's queue `Stats` instead (dropping the reply
            // tells it so).
            QueueOp::Wake | QueueOp::Replicated(_) | QueueOp::Info { .. } => return,
            QueueOp::Stats { reply } => {
                let req = self.next_req();
                (Request::Stats { req, queue }, Some((req, Waiting::Stats(reply))))
            }
            QueueOp::Purge { reply } => {
                let req = self.next_req();
                (Request::Purge { req, queue }, Some((req, Waiting::Count(reply))))
            }
            QueueOp::Delete { if_unused, if_empty, reply } => {
                let req = self.next_req();
                (Request::Delete { req, queue, if_unused, if_empty }, Some((req, Waiting::Count(reply))))
            }
        };
        if let Some((id, w)) = waiting {
            cl.waiting.insert(id, (qref.clone(), w));
        }
        let cancel = match &req {
            Request::Cancel { consumer, send_ok, .. } => Some((*consumer, *send_ok)),
            _ => None,
        };
        let req_id = match &req {
            Request::Get { req, .. }
            | Request::Consume { req, .. }
            | Request::Stats { req, .. }
            | Request::Purge { req, .. }
            | Request::Delete { req, .. } => Some(*req),
            _ => None,
        };
        if let Err(why) = self.send_request(peer, &Frame::Request(req)) {
            tracing::debug!(peer, %why, "operation on another node's queue not sent");
            if let Some((_, w)) = req_id.and_then(|id| cl.waiting.remove(&id)) {
                w.fail(unreachable(qref, &why));
            }
            // A cancel that cannot reach the queue: the consumer is gone with the link.
            if let Some((consumer, send_ok)) = cancel {
                if let Some(c) = cl.consumers.remove(&consumer) {
                    if let (true, Some(conn)) = (send_ok, cl.conns.get(&c.conn)) {
                        let _ = conn
                            .tx
                            .send(ClientEvent::CancelOk { channel: ChannelId(c.channel), consumer_tag: ConsumerTag::from(c.tag.as_str()) });
                    }
                }
            }
        }
    }

    /// Sends a basic.cancel nobody waits for (no cancel-ok due through the peer).
    fn send_cancel(&self, peer: NodeId, req: Request) {
        if let Err(why) = self.send_request(peer, &Frame::Request(req)) {
            tracing::debug!(peer, %why, "cancel of a consumer on another node's queue not sent");
        }
    }

    /// Sends a publish to `qref`'s node, under the client lock `cl` (so parked publishes
    /// sent on by `failover.rs` keep their order with new ones). When it cannot be sent, a
    /// publish to a replicated queue is parked; otherwise the confirm ticket to nack is
    /// returned.
    pub(super) fn send_publish(
        &self,
        cl: &mut ClientSide,
        qref: &QueueRef,
        message: crate::broker::Message,
        confirm: Option<ConfirmTo>,
        credit: Option<Arc<CreditHeld>>,
        parked: Option<Instant>,
    ) -> Option<ConfirmTo> {
        let peer = qref.owner_node;
        let rc = confirm.as_ref().map(|c| {
            cl.conn(c.conn, &c.tx, peer);
            let e = cl.confirms.entry((peer, c.conn.0, c.chan_uid, c.seq)).or_insert(Unanswered {
                channel: c.channel.0,
                due: 0,
                resend: None,
                parked: None,
            });
            e.due += 1;
            e.resend = (e.due == 1).then(|| (qref.clone(), message.clone()));
            e.parked = parked;
            RemoteConfirm { conn: c.conn.0, channel: c.channel.0, chan_uid: c.chan_uid, seq: c.seq }
        });
        let credit = credit.filter(|c| c.conn() != 0);
        let credit_conn = credit.as_ref().map_or(0, |c| c.conn());
        let frame = Frame::Request(Request::Publish { queue: qref.key.clone(), message, confirm: rc, credit: credit_conn });
        match (self.send_request(peer, &frame), confirm) {
            (Ok(()), _) => {
                if let Some(credit) = credit {
                    // Held until the peer's queue took it (`Event::Taken`).
                    cl.held.entry((peer, credit_conn)).or_default().push_back(credit);
                }
                None
            }
            (Err(why), Some(c)) => {
                let key = (peer, c.conn.0, c.chan_uid, c.seq);
                if let Some(e) = cl.confirms.get_mut(&key) {
                    e.due -= 1;
                    if e.due == 0 {
                        cl.confirms.remove(&key);
                    }
                }
                if let (Frame::Request(Request::Publish { message, .. }), true) = (frame, self.replicated(&qref.key)) {
                    // The link went down (or its queue is full) since `must_park` looked.
                    self.park(cl, qref, QueueOp::Publish { message, confirm: Some(c), published: None, credit }, parked);
                    return None;
                }
                tracing::debug!(peer, %why, "publish to another node's queue not sent: nacked");
                Some(c)
            }
            (Err(_), None) => None,
        }
    }

    /// An event from `from` for this node's connection `conn` (on a transport thread).
    pub(super) fn client_event(&self, from: NodeId, conn: u64, event: Event) {
        let mut cl = self.client.lock();
        if let Event::Taken { count } = event {
            // The oldest go first: the peer's queues may take a connection's publishes out
            // of order, but the credit is the connection's either way.
            let released: Vec<Arc<CreditHeld>> = match cl.held.get_mut(&(from, conn)) {
                Some(h) => h.drain(..(count as usize).min(h.len())).collect(),
                None => Vec::new(),
            };
            drop(cl);
            drop(released);
            return;
        }
        let Some(c) = cl.conns.get(&conn) else { return };
        let tx = c.tx.clone();
        let ev = match event {
            Event::Deliver { channel, chan_uid, consumer_tag, queue, durable, owner_core, offset, redelivered, message, track } => {
                if let Some(p) = &c.pending_bytes {
                    p.fetch_add(pending_weight(message.body.len()), Ordering::Relaxed);
                }
                ClientEvent::Deliver(Delivery {
                    channel: ChannelId(channel),
                    chan_uid,
                    consumer_tag: ConsumerTag::from(consumer_tag.as_str()),
                    queue: QueueRef { key: queue, owner_core, owner_node: from, durable },
                    offset: Offset(offset),
                    redelivered,
                    message,
                    track,
                    // The queue's node took it; its clock is not this one's.
                    taken: crate::observe::sample_at(crate::observe::SamplePoint::Hand).then(std::time::Instant::now),
                })
            }
            Event::ConsumeOk { channel, consumer_tag } => {
                ClientEvent::ConsumeOk { channel: ChannelId(channel), consumer_tag: ConsumerTag::from(consumer_tag.as_str()) }
            }
            Event::CancelOk { channel, consumer_tag } => {
                cl.consumers.retain(|_, k| !(k.peer == from && k.conn == conn && k.channel == channel && k.tag == consumer_tag));
                ClientEvent::CancelOk { channel: ChannelId(channel), consumer_tag: ConsumerTag::from(consumer_tag.as_str()) }
            }
            Event::Cancelled { channel, consumer_tag } => {
                cl.consumers.retain(|_, k| !(k.peer == from && k.conn == conn && k.channel == channel && k.tag == consumer_tag));
                ClientEvent::Cancelled { channel: ChannelId(channel), consumer_tag: ConsumerTag::from(consumer_tag.as_str()) }
            }
            Event::Stored { channel, chan_uid, seq, ok } => {
                let key = (from, conn, chan_uid, seq);
                let Some(e) = cl.confirms.get_mut(&key) else {
                    // A late answer from a node this publish is no longer waiting for: it was
                    // sent on to the queue's next server, or nacked, when the link went down or
                    // the queue moved (`take_unanswered`). The publish has its one answer
                    // from there; a second confirm of its delivery tag would make a client that
                    // counts confirms take it for the next publish's.
                    tracing::debug!(from, seq, ok, "late answer of a publish answered elsewhere: dropped");
                    return;
                };
                e.due = e.due.saturating_sub(1);
                e.resend = None;
                if e.due == 0 {
                    cl.confirms.remove(&key);
                }
                // The broker's own publish (a dead-letter copy) is done with once answered.
                if ConnId(conn).is_pseudo() && !cl.confirms.keys().any(|k| k.1 == conn) {
                    cl.conns.remove(&conn);
                }
                ClientEvent::Stored { channel: ChannelId(channel), chan_uid, seq, ok }
            }
            Event::AckTimeout { channel, chan_uid, timeout_ms } => {
                ClientEvent::AckTimeout { channel: ChannelId(channel), chan_uid, timeout_ms }
            }
            Event::Taken { .. } => return,
        };
        drop(cl);
        let _ = tx.send(ev);
    }

    /// The reply to this node's request `req`.
    pub(super) fn client_reply(&self, req: u64, reply: WireReply) {
        let Some((_, waiting)) = self.client.lock().waiting.remove(&req) else { return };
        match (waiting, reply) {
            (Waiting::Get(r), WireReply::Get(got)) => {
                let got = got.map(|o| {
                    o.map(|g: GotMessage| GetReply {
                        offset: Offset(g.offset),
                        redelivered: g.redelivered,
                        message: g.message,
                        message_count: g.message_count,
                    })
                });
                let _ = r.send(got);
            }
            (Waiting::Consume(r), WireReply::Consume(x)) => drop(r.send(x)),
            (Waiting::Stats(r), WireReply::Stats(x)) => drop(r.send(x)),
            (Waiting::Count(r), WireReply::Count(x)) => drop(r.send(x)),
            (w, other) => {
                tracing::warn!(req, ?other, "reply of the wrong kind from a peer");
                w.fail(QueueError::InternalError("a peer answered with the wrong kind of reply".into()));
            }
        }
    }

    /// Invariant 3, A's half: the lane to `peer` is down.
    pub(super) fn client_link_down(&self, peer: NodeId) {
        let mut cl = self.client.lock();
        let waiting: Vec<u64> = cl.waiting.iter().filter(|(_, (q, _))| q.owner_node == peer).map(|(id, _)| *id).collect();
        let failed: Vec<(QueueRef, Waiting)> = waiting.into_iter().filter_map(|id| cl.waiting.remove(&id)).collect();
        let gone: Vec<u64> = cl.consumers.iter().filter(|(_, c)| c.peer == peer).map(|(id, _)| *id).collect();
        let mut events: Vec<(ClientTx, ClientEvent)> = Vec::new();
        for id in gone {
            if let Some(c) = cl.consumers.remove(&id) {
                if c.cancelling.is_none() && self.replicated(&c.queue) {
                    // Another member will serve the queue: the consumer follows it there.
                    cl.failover.orphans.push(super::failover::Orphan::new(c.queue, c.spec));
                    continue;
                }
                let Some(conn) = cl.conns.get(&c.conn) else { continue };
                let (channel, consumer_tag) = (ChannelId(c.channel), ConsumerTag::from(c.tag.as_str()));
                // A cancel on its way gets its cancel-ok (the consumer is gone either way);
                // otherwise basic.cancel to a client that asked for it.
                let ev = match c.cancelling {
                    Some(true) => Some(ClientEvent::CancelOk { channel, consumer_tag }),
                    Some(false) => None,
                    None => c.cancel_notify.then_some(ClientEvent::Cancelled { channel, consumer_tag }),
                };
                if let Some(ev) = ev {
                    events.push((conn.tx.clone(), ev));
                }
            }
        }
        // The credit held for the peer comes back: what it had not taken is lost with it.
        let released: Vec<_> = cl.held.iter_mut().filter(|((p, _), _)| *p == peer).flat_map(|(_, h)| h.drain(..)).collect();
        let resend = self.take_unanswered(&mut cl, |k, _| k.0 == peer, &mut events);
        self.park_first(&mut cl, resend);
        drop(cl);
        drop(released);
        for (qref, w) in failed {
            w.fail(unreachable(&qref, "the link to it went down"));
        }
        for (tx, ev) in events {
            let _ = tx.send(ev);
        }
    }

    /// Takes the confirms not answered yet that `pick` selects, for publishes whose fate at
    /// their peer is unknown: each publish to one replicated queue comes back, in publish
    /// order per channel, to be parked ahead of the others and sent to the queue's next server
    /// (a duplicate when the peer had stored it too; the publisher would send it again after
    /// a nack all the same); every other is nacked through `events`.
    fn take_unanswered(
        &self,
        cl: &mut ClientSide,
        pick: impl Fn(&(NodeId, u64, u64, u64), &Unanswered) -> bool,
        events: &mut Vec<(ClientTx, ClientEvent)>,
    ) -> Vec<(QueueRef, QueueOp, Option<Instant>)> {
        let mut picked: Vec<_> = cl.confirms.iter().filter(|(k, u)| pick(k, u)).map(|(k, _)| *k).collect();
        picked.sort_unstable();
        let mut resend = Vec::new();
        for key in picked {
            let Some(u) = cl.confirms.remove(&key) else { continue };
            let (_, conn, chan_uid, seq) = key;
            let Some(tx) = cl.conns.get(&conn).map(|c| c.tx.clone()) else { continue };
            let channel = ChannelId(u.channel);
            match u.resend.filter(|(q, _)| u.due == 1 && self.replicated(&q.key)) {
                Some((qref, message)) => {
                    let confirm = ConfirmTo { tx, conn: ConnId(conn), channel, chan_uid, seq };
                    let op = QueueOp::Publish { message, confirm: Some(confirm), published: None, credit: None };
                    resend.push((qref, op, u.parked));
                }
                None => {
                    for _ in 0..u.due {
                        events.push((tx.clone(), ClientEvent::Stored { channel, chan_uid, seq, ok: false }));
                    }
                }
            }
        }
        resend
    }

    /// `failover.rs`, rule 7: publishes in flight to a node that no longer serves their
    /// queue (the metadata moved it while the link to that node stayed up: a bridge, where
    /// the old server has no leader and commits nothing) are parked for the new server, as
    /// if the link had gone down. Looks when the topology changed, and once a second for
    /// publishes sent on a view older than the move. Under the client lock `cl`.
    pub(super) fn repark_moved(&self, cl: &mut ClientSide) {
        let version = self.meta.topology_version();
        if cl.confirms.is_empty() || (version == cl.moved_seen.0 && cl.moved_seen.1.elapsed() < MOVED_RECHECK) {
            return;
        }
        cl.moved_seen = (version, Instant::now());
        let topo = self.meta.topology();
        let mut servers: HashMap<QueueKey, Option<NodeId>> = HashMap::new();
        let mut moved = |k: &(NodeId, u64, u64, u64), u: &Unanswered| {
            let Some((qref, _)) = u.resend.as_ref().filter(|_| u.due == 1) else { return false };
            let now = *servers.entry(qref.key.clone()).or_insert_with(|| topo.queue(&qref.key.vhost, &qref.key.name).map(|d| d.owner_node));
            now.is_some_and(|n| n != k.0)
        };
        let picked: HashSet<(NodeId, u64, u64, u64)> = cl.confirms.iter().filter(|(k, u)| moved(k, u)).map(|(k, _)| *k).collect();
        if picked.is_empty() {
            return;
        }
        let mut none = Vec::new();
        let resend = self.take_unanswered(cl, |k, _| picked.contains(k), &mut none);
        debug_assert!(none.is_empty(), "only publishes to one queue are picked");
        tracing::info!(count = resend.len(), "publishes in flight to a node that no longer serves their queue are sent to its new server");
        self.park_first(cl, resend);
    }

    /// This node's connection `conn` closed (after its channels' `ChannelClosed`): the
    /// peers it used forget it.
    pub fn connection_closed(&self, conn: ConnId) {
        let mut cl = self.client.lock();
        let mut peers = cl.conns.remove(&conn.0).map(|c| c.peers).unwrap_or_default();
        let credited: Vec<(NodeId, u64)> = cl.held.keys().filter(|k| k.1 == conn.0).copied().collect();
        let released: Vec<_> = credited.into_iter().filter_map(|k| cl.held.remove(&k).map(|h| (k.0, h))).collect();
        peers.extend(released.iter().map(|(p, _)| *p));
        cl.consumers.retain(|_, k| k.conn != conn.0);
        cl.failover.orphans.retain(|o| o.spec.conn != conn);
        cl.failover.followed.retain(|_, f| f.2 != conn);
        cl.confirms.retain(|k, _| k.1 != conn.0);
        drop(cl);
        drop(released);
        for peer in peers {
            let _ = self.send_request(peer, &Frame::Request(Request::ConnectionClosed { conn: conn.0 }));
        }
    }
}
