//! A's side of a failover (invariant 6 of the module doc): what the client's node holds while
//! a replicated queue has no server within reach, and hands to the queue's next server once
//! the metadata names one in reach (the failover moved the queue, or the link came back).
//! RabbitMQ's quorum queue clients do the same across a leader election: a publisher sees a
//! confirm that comes late, not a nack, and a consumer keeps consuming, not cancelled.
//!
//! # Publishes and requests
//! 1. Parked: a publish, purge, delete or passive declare (`Stats`) on a replicated queue
//!    whose serving node's data link is not up in both directions (it died, or it restarted
//!    and the link is not back yet); a confirm-mode publish to one such queue that was in
//!    flight when the link went down (its fate there is unknown: sent again, it may be stored
//!    twice, as after a nack and a retry), ahead of the others; and any of those on a queue
//!    that already has parked ones on this node (so none overtakes them; checked where a
//!    publish reaches its queue's core, [`Node::steered`], and in `Remote::forward`). Not a get or a consume: the channel
//!    keeps the queue as it addressed it, for the delivery tags and the consumer they make,
//!    and the next server would be another (they get 404 as before, and the client retries).
//! 2. Sent on (`Remote::retry_held`, every `replicas::WATCH_PERIOD` on core 0), per queue,
//!    all of its parked operations in their order: to the new server's node over its link,
//!    under the lock that rule 1's checks take; or, when this node serves the queue now, on
//!    the queue's core, which takes them out of the list itself (`flush_local`), so that
//!    the publishes of its own connections stay behind them.
//! 3. An operation parked for [`PARK_LIMIT`] without a reachable server is refused as it was
//!    at once before (a publish nacked, a request answered 404 "home node … is down or
//!    inaccessible"); one whose queue was deleted meanwhile is answered as any operation on a
//!    vanished queue (`node::refuse`). A parked publish holds its credit, so a publisher that
//!    keeps sending is throttled, not buffered without bound.
//!
//! # Consumers
//! 4. When the link to a queue's node goes down, this node's consumers of that queue are kept
//!    (*orphans*) if the queue is replicated, instead of being cancelled. What they held is
//!    requeued by the next server (redelivered=true); an ack of it reaches no server and is
//!    a no-op, so such a message may come again (at least once, never lost).
//! 5. The watch attaches each orphan to the queue's next server as rule 2 sends publishes
//!    (without a second consume-ok); a consumer that is refused there, or that finds no
//!    server within [`PARK_LIMIT`], or whose queue was deleted, is cancelled as before
//!    (basic.cancel to a client that asked for it).
//! 6. basic.cancel and the close of a channel find the consumer where it is: an orphan is
//!    dropped (cancel-ok when asked); otherwise the operation goes to the node the metadata
//!    names now, not to the one the channel knew ([`Node::steered`]). Wherever it lands, the
//!    cancel is answered, once (`broker::CancelOkTo`).
//!
//! # Publishes in flight to a server that lost its queue
//! 7. A confirm-mode publish to one replicated queue sent to a node that the metadata no
//!    longer names as the queue's server, not answered yet, is parked as in rule 1 (ahead of
//!    the others, in publish order per channel) and goes to the new server by rule 2
//!    (`Remote::repark_moved`, at the start of every `retry_held`). In a bridge the old
//!    server keeps its link to this node but has lost its leader: it commits nothing, and
//!    would nack only when its proposals time out (10 s), long after the queue moved (2-3 s).
//!    Its later answer for such a publish finds no entry here and is dropped, as is any
//!    answer from a node a publish was taken back from (rule 1's link loss, or a nack): a
//!    publish has one answer, from where it went last (a second confirm of a delivery tag
//!    made pika's blocking channel take every later confirm for the next publish's).

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::client::ClientSide;
use super::Remote;
use crate::broker::node::{Node, NodeMsg, OnCore};
use crate::broker::queue::replica::is_replicated;
use crate::broker::{ClientEvent, ConnId, ConsumerSpec, Mesh, QueueError, QueueKey, QueueOp, QueueRef};

/// Longest a publish stays parked before it is nacked, and an orphaned consumer before it is
/// cancelled: the metadata group's proposal timeout, after which a publish to a served queue
/// is nacked too (`MetaError::NoQuorum`). A failover moves a dead node's queues within about
/// 3-4 s (`replicas::DOWN_AFTER` plus the time to notice), well inside it.
pub const PARK_LIMIT: Duration = Duration::from_secs(10);

/// One parked operation.
struct Parked {
    /// The queue as this node saw it when the operation was parked.
    qref: QueueRef,
    /// A publish (with its confirm ticket and credit) or a request (with its reply).
    op: QueueOp,
    since: Instant,
}

/// A consumer of this node whose queue's server is out of reach (rule 4).
pub(super) struct Orphan {
    pub(super) queue: QueueKey,
    pub(super) spec: ConsumerSpec,
    pub(super) since: Instant,
    /// A core of this node was asked to attach it (rule 5).
    attaching: bool,
}

impl Orphan {
    pub(super) fn new(queue: QueueKey, spec: ConsumerSpec) -> Orphan {
        Orphan { queue, spec, since: Instant::now(), attaching: false }
    }

    /// basic.cancel to its client, when the client asked for it.
    fn cancel(&self) {
        if self.spec.cancel_notify {
            let _ = self.spec.tx.send(ClientEvent::Cancelled { channel: self.spec.channel, consumer_tag: self.spec.tag.clone() });
        }
    }
}

/// What this node holds for replicated queues without a server in reach (under
/// `Remote::client`).
#[derive(Default)]
pub(super) struct Held {
    /// Parked publishes, oldest first.
    list: VecDeque<Parked>,
    /// Queues whose publishes a core of this node was asked to take (rule 2).
    flushing: std::collections::HashSet<QueueKey>,
    /// Orphaned consumers (rule 4).
    pub(super) orphans: Vec<Orphan>,
    /// Consumers that followed their queue to another server than their channel knows
    /// (rule 6), by consumer id: (queue, channel incarnation, connection).
    pub(super) followed: HashMap<u64, (QueueKey, u64, ConnId)>,
}

impl Held {
    pub(super) fn holds(&self, key: &QueueKey) -> bool {
        !self.list.is_empty() && self.list.iter().any(|p| p.qref.key == *key)
    }

    /// Takes the parked operations on `key` out of the list, in their order.
    fn take(&mut self, key: &QueueKey) -> VecDeque<Parked> {
        self.take_where(|p| p.qref.key == *key)
    }

    /// Takes the parked operations that `f` picks out of the list, in their order.
    fn take_where(&mut self, f: impl Fn(&Parked) -> bool) -> VecDeque<Parked> {
        let (out, keep) = std::mem::take(&mut self.list).into_iter().partition(|p| f(p));
        self.list = keep;
        out
    }

    fn take_orphan(&mut self, id: u64) -> Option<Orphan> {
        let i = self.orphans.iter().position(|o| o.spec.id == id)?;
        Some(self.orphans.swap_remove(i))
    }
}

impl Remote {
    /// True while some operation is parked on this node: only then does a publish to a
    /// queue of this node need rule 1's check. One relaxed load.
    pub fn parking(&self) -> bool {
        self.parked_count.load(Ordering::Relaxed) > 0
    }

    /// Parks `op` (an operation on `qref`) at the end of the list (rule 1); `since`: when it
    /// was first parked, if it was before (its limit runs from then).
    pub(super) fn park(&self, cl: &mut ClientSide, qref: &QueueRef, op: QueueOp, since: Option<Instant>) {
        if cl.failover.list.is_empty() {
            tracing::info!(queue = %qref.key.name, vhost = %qref.key.vhost, node = qref.owner_node,
                "operations on a replicated queue whose node is out of reach are held until it has a server again");
        }
        cl.failover.list.push_back(Parked { qref: qref.clone(), op, since: since.unwrap_or_else(Instant::now) });
        self.parked_count.store(cl.failover.list.len(), Ordering::Relaxed);
    }

    /// Parks `ops`, publishes that were in flight to a server that is now out of reach, in
    /// their order ahead of every parked operation: those were parked after these were sent
    /// (a publish is parked when its queue has parked ones, so none was in flight then).
    /// Each comes with when it was first parked, if it was: a publish parked, sent on and
    /// parked again as a link flaps is refused `PARK_LIMIT` after it was first parked.
    pub(super) fn park_first(&self, cl: &mut ClientSide, ops: Vec<(QueueRef, QueueOp, Option<Instant>)>) {
        for (qref, op, since) in ops.into_iter().rev() {
            cl.failover.list.push_front(Parked { qref, op, since: since.unwrap_or_else(Instant::now) });
        }
        self.parked_count.store(cl.failover.list.len(), Ordering::Relaxed);
    }

    /// Rule 1 for `op` on `qref`, a queue another node serves: park it when it is a publish
    /// or a request and its queue has parked operations already, or the link to that node is
    /// down and the queue is replicated (another member will serve it, or the link comes back).
    pub(super) fn must_park(&self, cl: &ClientSide, qref: &QueueRef, op: &QueueOp) -> bool {
        // Not a get or a consume: the channel keeps the queue as it addressed it for the
        // delivery tags and the consumer they make, and the server that answers may be another.
        let parks = matches!(op, QueueOp::Publish { .. } | QueueOp::Stats { .. } | QueueOp::Purge { .. } | QueueOp::Delete { .. });
        parks && (cl.failover.holds(&qref.key) || (!self.link_up(qref.owner_node) && self.replicated(&qref.key)))
    }

    /// Whether the data link to `peer` is up in both directions.
    fn link_up(&self, peer: crate::meta::NodeId) -> bool {
        self.links.lock().contains(&peer)
    }

    /// Whether queue `key` is replicated (so another member can serve it).
    pub(super) fn replicated(&self, key: &QueueKey) -> bool {
        self.meta.topology().queue(&key.vhost, &key.name).is_some_and(|def| is_replicated(def, true))
    }

    /// Queue `key` as the metadata knows it now (`None`: deleted).
    fn current(&self, key: &QueueKey) -> Option<QueueRef> {
        let topo = self.meta.topology();
        topo.queue(&key.vhost, &key.name).map(|def| QueueRef::of(def, self.cores))
    }

    /// Records that orphan `o` followed its queue (rule 6).
    fn follow(cl: &mut ClientSide, o: &Orphan) {
        cl.failover.followed.insert(o.spec.id, (o.queue.clone(), o.spec.chan_uid, o.spec.conn));
    }

    /// Rules 2, 3 and 5, on core 0 every watch period: hands on what can go, nacks and
    /// cancels what waited too long.
    pub fn retry_held(self: &std::sync::Arc<Self>) {
        let mut cl = self.client.lock();
        self.repark_moved(&mut cl);
        if cl.failover.list.is_empty() && cl.failover.orphans.is_empty() {
            return;
        }
        let topo = self.meta.topology();
        let mut keys: Vec<QueueKey> = Vec::new();
        for p in &cl.failover.list {
            if !keys.contains(&p.qref.key) {
                keys.push(p.qref.key.clone());
            }
        }
        let (mut gone, mut refused) = (Vec::new(), Vec::new());
        for key in keys {
            let Some(def) = topo.queue(&key.vhost, &key.name) else {
                gone.extend(cl.failover.take(&key).into_iter().map(|p| (key.clone(), p.op)));
                continue;
            };
            let now = QueueRef::of(def, self.cores);
            if now.owner_node == self.me {
                if cl.failover.flushing.insert(key.clone()) {
                    self.on_core(&now, move |node| flush_local(node, &key));
                }
            } else if self.link_up(now.owner_node) {
                for p in cl.failover.take(&key) {
                    self.forward_parked(&mut cl, &now, p.op, Some(p.since));
                }
            } else if !cl.failover.flushing.contains(&key) {
                let old = cl.failover.take_where(|p| p.qref.key == key && p.since.elapsed() >= PARK_LIMIT);
                if !old.is_empty() {
                    tracing::warn!(queue = %key.name, vhost = %key.vhost, count = old.len(),
                        "operations held {} s for a replicated queue with no server in reach: refused", PARK_LIMIT.as_secs());
                }
                refused.extend(old.into_iter().map(|p| (p.qref, p.op)));
            }
        }
        self.parked_count.store(cl.failover.list.len(), Ordering::Relaxed);
        let cancelled = self.retry_orphans(&mut cl, &topo);
        drop(cl);
        for (key, op) in gone {
            crate::broker::node::refuse(&key, op);
        }
        for (qref, op) in refused {
            refuse_unreachable(&qref, op);
        }
        for o in cancelled {
            o.cancel();
        }
    }

    /// Rule 5 under the client lock: attaches what can be, returns the orphans to cancel.
    fn retry_orphans(self: &std::sync::Arc<Self>, cl: &mut ClientSide, topo: &crate::meta::Topology) -> Vec<Orphan> {
        let mut cancelled = Vec::new();
        for o in std::mem::take(&mut cl.failover.orphans) {
            let Some(def) = topo.queue(&o.queue.vhost, &o.queue.name) else {
                cancelled.push(o);
                continue;
            };
            let now = QueueRef::of(def, self.cores);
            if now.owner_node == self.me {
                let (id, mut o) = (o.spec.id, o);
                if !std::mem::replace(&mut o.attaching, true) {
                    self.on_core(&now, move |node| attach_local(node, id));
                }
                cl.failover.orphans.push(o);
            } else if self.link_up(now.owner_node) {
                let (reply, rx) = crate::broker::reply_channel();
                let id = o.spec.id;
                let consumer = ConsumerSpec { send_consume_ok: false, ..o.spec.clone() };
                Remote::follow(cl, &o);
                self.forward_in(cl, &now, QueueOp::Consume { consumer, reply });
                crate::core::spawn_soon(attached(rx, o, self.clone()));
                tracing::info!(queue = %now.key.name, consumer = id, node = now.owner_node, "a consumer of a moved queue follows it to its new node");
            } else if o.since.elapsed() >= PARK_LIMIT {
                cancelled.push(o);
            } else {
                cl.failover.orphans.push(o);
            }
        }
        cancelled
    }

    /// Runs `work` on the core of this node that owns `qref`.
    fn on_core(&self, qref: &QueueRef, work: impl FnOnce(&Rc<Node>) + Send + 'static) {
        let core = qref.owner_core as usize;
        if self.inboxes.send(core, NodeMsg::Run(OnCore(Box::new(work)))).is_err() {
            tracing::debug!(core, "core inbox closed (shutting down)");
        }
    }
}

/// Waits for the answer to an orphan's consume at its queue's next server: when refused, the
/// consumer is cancelled (rule 5), and forgotten by this node's forwarding state (`remote`).
async fn attached(rx: flume::Receiver<Result<(), QueueError>>, o: Orphan, remote: std::sync::Arc<Remote>) {
    match rx.recv_async().await {
        Ok(Ok(())) => {}
        answer => {
            tracing::warn!(queue = %o.queue.name, ?answer, "a consumer of a moved queue could not follow it: cancelled");
            let mut cl = remote.client.lock();
            cl.failover.followed.remove(&o.spec.id);
            cl.consumers.remove(&o.spec.id);
            drop(cl);
            o.cancel();
        }
    }
}

/// Rule 3: `op` found no server of `qref` in reach: a publish is nacked, a request gets
/// 404 (RabbitMQ's "home node … is down or inaccessible").
fn refuse_unreachable(qref: &QueueRef, op: QueueOp) {
    let e = super::client::unreachable(qref, "no server of it was in reach for 10 s");
    match op {
        QueueOp::Delete { reply, .. } => drop(reply.send(Err(e))),
        op => crate::broker::node::refuse_unstored(op, e),
    }
}

/// Rule 2 on the core of a queue this node serves now: takes the queue's parked publishes
/// out of the list and runs them in order, before any later publish reaches the queue.
fn flush_local(node: &Rc<Node>, key: &QueueKey) {
    let Some(remote) = node.shared.remote.clone() else { return };
    let parked = {
        let mut cl = remote.client.lock();
        cl.failover.flushing.remove(key);
        let out = cl.failover.take(key);
        remote.parked_count.store(cl.failover.list.len(), Ordering::Relaxed);
        out
    };
    let topo = remote.meta.topology();
    for p in parked {
        match topo.queue(&key.vhost, &key.name) {
            Some(def) => node.send_from_connection(&QueueRef::of(def, remote.cores), p.op),
            None => crate::broker::node::refuse(key, p.op),
        }
    }
}

/// Rule 5 on the core of a queue this node serves now: attaches orphan `id` to it, unless
/// a basic.cancel or a channel close took it meanwhile (they run on this core too, or take
/// the lock first).
fn attach_local(node: &Rc<Node>, id: u64) {
    let Some(remote) = node.shared.remote.clone() else { return };
    let mut cl = remote.client.lock();
    let Some(o) = cl.failover.take_orphan(id) else { return };
    let Some(now) = remote.current(&o.queue) else {
        drop(cl);
        return o.cancel();
    };
    Remote::follow(&mut cl, &o);
    drop(cl);
    let (reply, rx) = crate::broker::reply_channel();
    let consumer = ConsumerSpec { send_consume_ok: false, ..o.spec.clone() };
    tracing::info!(queue = %o.queue.name, consumer = id, "a consumer of a moved queue follows it to this node");
    node.send_from_connection(&now, QueueOp::Consume { consumer, reply });
    crate::core::spawn_soon(attached(rx, o, remote));
}

impl Node {
    /// Rules 1 and 6 where an operation reaches its queue's core (`Node::queue_op`): `None`
    /// when it was taken here (a publish parked behind earlier ones, the cancel of an orphan)
    /// or sent to the server a consumer followed; else the op back, to run as addressed.
    pub(crate) fn steered(self: &Rc<Self>, qref: &QueueRef, op: QueueOp) -> Option<QueueOp> {
        let Some(remote) = self.shared.remote.as_deref() else { return Some(op) };
        match &op {
            QueueOp::Publish { .. } if remote.parking() => {
                let mut cl = remote.client.lock();
                if !cl.failover.holds(&qref.key) {
                    return Some(op);
                }
                remote.park(&mut cl, qref, op, None);
                None
            }
            QueueOp::Cancel { consumer, .. } => {
                let consumer = *consumer;
                let mut cl = remote.client.lock();
                if cl.failover.take_orphan(consumer).is_some() {
                    drop(cl);
                    // Its cancel-ok goes now (dropping `op` sends it).
                    drop(op);
                    return None;
                }
                let followed = cl.failover.followed.remove(&consumer);
                drop(cl);
                match followed.and_then(|(queue, ..)| remote.current(&queue)) {
                    Some(now) if now.owner_node != qref.owner_node => {
                        self.send(&now, op);
                        None
                    }
                    _ => Some(op),
                }
            }
            QueueOp::ChannelClosed { chan_uid } => {
                let mut cl = remote.client.lock();
                cl.failover.orphans.retain(|o| o.spec.chan_uid != *chan_uid);
                let before = cl.failover.followed.len();
                cl.failover.followed.retain(|_, (queue, uid, _)| !(*uid == *chan_uid && *queue == qref.key));
                let followed = cl.failover.followed.len() != before;
                drop(cl);
                // The server a consumer of the channel followed is told too; the one the
                // channel knew (if alive) gets the op as addressed.
                if let Some(now) = remote.current(&qref.key).filter(|now| followed && now.owner_node != qref.owner_node) {
                    self.send(&now, QueueOp::ChannelClosed { chan_uid: *chan_uid });
                }
                Some(op)
            }
            _ => Some(op),
        }
    }
}
