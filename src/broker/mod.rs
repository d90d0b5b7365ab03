//! The broker's domain: exchanges, routing, queues, consumers, settlement and
//! dead-lettering. It never touches a socket and does no raw file I/O (messages live in
//! `ringmq-shards`).
//!
//! # Layout
//! - [`exchange`]: one pure matching function per exchange type.
//! - [`router`]: a core's read-only copy of the routing tables (from the Raft metadata).
//! - [`queue`]: a queue on its owner core: ready set, consumers, prefetch, unacked offsets;
//!   [`queue::settle`] holds every transition of a delivered message.
//! - [`message`]: the stored form of a message and its property codec.
//! - [`node`]: each core's share of the broker (queue registry and lifecycle, routing-table
//!   copy, connections, the 1 s tick) and the state all cores share.
//! - [`store_files`]: a queue's directory, its incarnation marker and the filesystem calls
//!   on them (on the blocking thread).
//! - [`topology`]: declare, delete, purge, bind and unbind as the domain does them, for the
//!   AMQP methods and the management API alike.
//! - [`clients`]: this node's connections, for the management API.
//! - [`cluster_name`]: the cluster's one name and permanent id, in the metadata.
//! - [`auth`]: who may log in, and with which tags (the seam user stores plug into).
//! - [`access`]: users, vhosts, permissions: logins, permission checks, the run-time API;
//!   [`policy`]: policies and operator policies, and the queue arguments they give.
//! - [`alarms`]: disk and file-descriptor alarms.
//! - [`error`]: [`QueueError`], mapped to reply codes by `amqp`.
//!
//! # Invariants
//! - A queue's state is touched only by its owner core; everything else reaches it through a
//!   [`QueueOp`] sent by the [`Mesh`].
//! - Events to a client (deliveries, consume-ok, cancel, confirms) travel on that client's
//!   event channel, so a consumer's consume-ok always precedes its first delivery and its
//!   cancel-ok follows its last.

pub mod access;
pub mod alarms;
pub mod auth;
pub mod clients;
pub mod cluster_name;
pub mod credit;
pub mod error;
pub mod exchange;
pub mod figures;
pub mod grow;
mod idle;
pub mod ids;
pub mod message;
pub mod node;
pub mod policy;
pub mod queue;
pub mod remote;
pub mod replicas;
pub mod reply_to;
pub mod router;
pub mod store_files;
pub mod topology;

use std::sync::Arc;

pub use error::QueueError;

/// The RabbitMQ version this broker answers as: the management API's `rabbitmq_version` and
/// `management_version` (tools read them to pick features) and `rabbitmq_build_info`'s label.
pub const RABBITMQ_COMPAT_VERSION: &str = "3.13.7";
pub use ids::{ChannelId, ConnId, ConsumerTag, Offset, QueueName};
use message::Message;

/// Identifies a queue: (vhost, queue name). Cheap to clone and to send between cores.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueKey {
    /// Virtual host.
    pub vhost: Arc<str>,
    /// Queue name.
    pub name: QueueName,
}

impl QueueKey {
    /// Builds a key.
    pub fn new(vhost: &str, name: &str) -> QueueKey {
        QueueKey { vhost: Arc::from(vhost), name: QueueName::from(name) }
    }
}

/// A routable queue: its key and owner core (from `core::placement`, recorded in the metadata).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct QueueRef {
    /// Which queue.
    pub key: QueueKey,
    /// Executor index that owns it.
    pub owner_core: u32,
    /// Node that serves it (its `owner_node` in the metadata): other nodes forward their
    /// operations there (`remote`). A replicated queue's copies live on every member
    /// (`queue::replica`); failover changes this node (`replicas`).
    pub owner_node: crate::meta::NodeId,
    /// Durable queue: persistent messages are synced before a confirm.
    pub durable: bool,
}

impl QueueRef {
    /// The reference to queue `def` on a node of `cores` executors (its owner core taken
    /// modulo `cores`: the declaring node may have had more).
    pub fn of(def: &crate::meta::state::QueueDef, cores: u32) -> QueueRef {
        QueueRef {
            key: QueueKey::new(&def.vhost, &def.name),
            owner_core: def.owner_core % cores.max(1),
            owner_node: def.owner_node,
            durable: def.durable,
        }
    }
}

/// A consumer's id, unique within this node's run.
pub type ConsumerId = u64;

/// The sending side of a client's event channel (one per connection).
pub type ClientTx = flume::Sender<ClientEvent>;

/// Events for a client connection, written to its socket in arrival order.
#[derive(Debug)]
pub enum ClientEvent {
    /// Frames the connection's reader already encoded (replies to methods).
    Frames(Vec<u8>),
    /// basic.deliver to a consumer. The connection assigns the delivery tag.
    Deliver(Delivery),
    /// Several basic.deliver to one consumer, in queue order: what a queue's dispatcher
    /// handed it in one stretch, sent as one event (one channel send and one wake-up of
    /// the connection, the consumer's tag and queue shared by all of them).
    Deliveries(Deliveries),
    /// basic.consume-ok, sent by the queue before the consumer's first delivery.
    ConsumeOk {
        /// Channel of the consumer.
        channel: ChannelId,
        /// Consumer tag.
        consumer_tag: ConsumerTag,
    },
    /// basic.cancel-ok, sent by the queue after the consumer's last delivery.
    CancelOk {
        /// Channel of the consumer.
        channel: ChannelId,
        /// Consumer tag.
        consumer_tag: ConsumerTag,
    },
    /// The broker cancelled a consumer (its queue was deleted): basic.cancel to the client
    /// when it announced consumer_cancel_notify.
    Cancelled {
        /// Channel of the consumer.
        channel: ChannelId,
        /// Consumer tag.
        consumer_tag: ConsumerTag,
    },
    /// A queue.delete of this connection is answered: `frames` (its delete-ok, or nothing),
    /// then the basic.cancel notices held back for `queue`'s consumers on this connection
    /// while it was being deleted, so the client reads delete-ok first (RabbitMQ's order).
    Deleted {
        /// The reply frames, already encoded.
        frames: Vec<u8>,
        /// The deleted queue's name, in the connection's vhost.
        queue: QueueName,
    },
    /// One queue stored (and, when required, synced) publish `seq` of a confirm-mode channel,
    /// or failed to (`ok == false` → basic.nack).
    Stored {
        /// Publishing channel.
        channel: ChannelId,
        /// Incarnation of that channel ([`Holder::chan_uid`]): an answer for a channel
        /// closed since goes nowhere, never to a channel reopened under its number.
        chan_uid: u64,
        /// Publish sequence number on that channel (confirm delivery tag).
        seq: u64,
        /// Stored successfully.
        ok: bool,
    },
    /// A delivery on `channel` exceeded its queue's acknowledgement timeout: close the
    /// channel with 406 and requeue (RabbitMQ's consumer_timeout).
    AckTimeout {
        /// Channel holding the delivery.
        channel: ChannelId,
        /// Incarnation of that channel.
        chan_uid: u64,
        /// Timeout that was exceeded, in ms.
        timeout_ms: u64,
    },
    /// The broker is shutting down: close the connection (320 CONNECTION_FORCED).
    Shutdown,
    /// A resource alarm (memory, disk) now blocks publishers (true) or none does: a
    /// connection that publishes is blocked (connection.blocked, not read) or unblocked.
    ResourceAlarm(bool),
    /// Describe the connection's channels (the management API, `clients.rs`).
    Describe(Reply<clients::ConnDescription>),
    /// Close the connection with 320 CONNECTION_FORCED and this text (the management API's
    /// `DELETE /api/connections/{name}`).
    Close(String),
    /// A peer's publishes to this node's queues were taken: the proxy of the peer's
    /// connection sends their count back ([`credit::PublishCredit::counting`], `remote`).
    /// A connection of this node never gets it.
    PublishesTaken,
}

/// Deliveries of one queue to one consumer ([`ClientEvent::Deliveries`]): the fields of a
/// [`Delivery`] they share, and per message its offset, redelivered flag and contents, in
/// queue order.
#[derive(Debug)]
pub struct Deliveries {
    /// Channel of the consumer.
    pub channel: ChannelId,
    /// Incarnation of that channel (see [`Holder::chan_uid`]).
    pub chan_uid: u64,
    /// Consumer tag.
    pub consumer_tag: ConsumerTag,
    /// Source queue.
    pub queue: QueueRef,
    /// Manual ack: the connection tracks each delivery tag until it is settled.
    pub track: bool,
    /// `(offset, redelivered, message, taken)` of each delivery (`taken`: see
    /// [`Delivery::taken`]).
    pub items: Vec<(Offset, bool, Message, Option<std::time::Instant>)>,
}

impl Deliveries {
    /// Each delivery on its own, in order (for a path that handles one at a time).
    pub fn into_each(self) -> impl Iterator<Item = Delivery> {
        let Deliveries { channel, chan_uid, consumer_tag, queue, track, items } = self;
        items.into_iter().map(move |(offset, redelivered, message, taken)| Delivery {
            channel,
            chan_uid,
            consumer_tag: consumer_tag.clone(),
            queue: queue.clone(),
            offset,
            redelivered,
            message,
            track,
            taken,
        })
    }
}

/// A message handed to a consumer.
#[derive(Debug)]
pub struct Delivery {
    /// Channel of the consumer.
    pub channel: ChannelId,
    /// Incarnation of that channel (see [`Holder::chan_uid`]).
    pub chan_uid: u64,
    /// Consumer tag.
    pub consumer_tag: ConsumerTag,
    /// Source queue.
    pub queue: QueueRef,
    /// Offset of the message in the queue's shard.
    pub offset: Offset,
    /// Delivered before (requeued).
    pub redelivered: bool,
    /// The message.
    pub message: Message,
    /// Manual ack: the connection tracks the delivery tag until it is settled.
    pub track: bool,
    /// When the queue took it, for a sampled delivery (`observe::Stage::TakenToWritten`;
    /// for a queue on another node, when it arrived on this one); `None` for the others.
    pub taken: Option<std::time::Instant>,
}

/// A basic.get answer.
#[derive(Debug)]
pub struct GetReply {
    /// Offset of the message in the queue's shard.
    pub offset: Offset,
    /// Delivered before.
    pub redelivered: bool,
    /// The message.
    pub message: Message,
    /// Messages still ready in the queue after this one.
    pub message_count: u32,
}

/// A channel's shared prefetch window (basic.qos with global=true, RabbitMQ's reading:
/// one limit for all consumers of the channel, whichever queues and cores they are on).
#[derive(Debug, Default)]
pub struct ChannelCredit {
    /// prefetch_count for the whole channel (0 = unlimited).
    pub limit: std::sync::atomic::AtomicU32,
    /// Tracked deliveries outstanding on the channel.
    pub in_flight: std::sync::atomic::AtomicU32,
}

impl ChannelCredit {
    /// Whether one more delivery fits.
    pub fn has_room(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let limit = self.limit.load(Relaxed);
        limit == 0 || self.in_flight.load(Relaxed) < limit
    }
    /// A delivery is outstanding.
    pub fn take(&self) {
        self.in_flight.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    /// A delivery was settled.
    pub fn give(&self) {
        let _ = self
            .in_flight
            .fetch_update(std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed, |v| Some(v.saturating_sub(1)));
    }
}

/// A consumer as the queue sees it.
#[derive(Debug, Clone)]
pub struct ConsumerSpec {
    /// Unique id.
    pub id: ConsumerId,
    /// Owning connection.
    pub conn: ConnId,
    /// Channel on that connection.
    pub channel: ChannelId,
    /// Incarnation of that channel (see [`Holder::chan_uid`]).
    pub chan_uid: u64,
    /// Consumer tag.
    pub tag: ConsumerTag,
    /// Automatic acknowledgement (no_ack).
    pub no_ack: bool,
    /// Exclusive consumer.
    pub exclusive: bool,
    /// basic.qos prefetch_count in force when it started (0 = unlimited).
    pub prefetch: u32,
    /// The channel's shared window (basic.qos global=true).
    pub channel_credit: Arc<ChannelCredit>,
    /// Whether the client wants basic.cancel when the queue goes away.
    pub cancel_notify: bool,
    /// Whether the queue must send consume-ok (false for nowait).
    pub send_consume_ok: bool,
    /// Consumer priority (basic.consume argument `x-priority`, RabbitMQ's consumer
    /// priorities; 0 by default): see `queue::consumer`.
    pub priority: i32,
    /// Where its deliveries go.
    pub tx: ClientTx,
    /// Body bytes delivered to its connection and not yet written to the socket.
    pub pending_bytes: Arc<std::sync::atomic::AtomicUsize>,
    /// A consumer of another node, served through `remote`: a queue never holds its
    /// publishers for such a consumer (`queue/egress.rs`).
    pub remote: bool,
}

/// Who asked and where to answer: a holder of deliveries on a channel.
#[derive(Clone, Debug)]
pub struct Holder {
    /// Connection id.
    pub conn: ConnId,
    /// Channel.
    pub channel: ChannelId,
    /// Unique id of this opening of the channel: a channel number can be reused after a
    /// close, and a late operation of the old channel must not touch the new one.
    pub chan_uid: u64,
    /// Its event channel.
    pub tx: ClientTx,
}

/// Publisher-confirm ticket: where to report that a queue stored a message.
#[derive(Clone, Debug)]
pub struct ConfirmTo {
    /// Publisher's event channel.
    pub tx: ClientTx,
    /// Publisher's connection.
    pub conn: ConnId,
    /// Publishing channel.
    pub channel: ChannelId,
    /// Incarnation of that channel ([`Holder::chan_uid`]).
    pub chan_uid: u64,
    /// Publish sequence number.
    pub seq: u64,
}

impl ConfirmTo {
    /// Reports to the publisher that this queue stored the message (`ok`) or could not.
    pub fn answer(&self, ok: bool) {
        let _ = self.tx.send(ClientEvent::Stored { channel: self.channel, chan_uid: self.chan_uid, seq: self.seq, ok });
    }
}

/// A basic.cancel-ok owed to a client: basic.cancel is always answered, for a consumer that
/// is gone or unknown too (RabbitMQ answers cancel-ok for an unknown tag). Sent once: by
/// [`CancelOkTo::answer`] (a queue does, after the consumer's last delivery on the same event
/// channel), or when it is dropped unanswered on any path (a queue gone, a list of waiting
/// operations dropped, a core stopping); never when [`CancelOkTo::handed_on`] gave the answer
/// to another node's queue.
#[derive(Debug)]
pub struct CancelOkTo {
    /// The connection's event channel; `None` once answered or handed on.
    tx: Option<ClientTx>,
    channel: ChannelId,
    tag: ConsumerTag,
}

impl CancelOkTo {
    /// The cancel-ok of consumer `tag` on `channel`, sent on `tx`.
    pub fn new(tx: ClientTx, channel: ChannelId, tag: ConsumerTag) -> CancelOkTo {
        CancelOkTo { tx: Some(tx), channel, tag }
    }

    /// Sends the cancel-ok now.
    pub fn answer(mut self) {
        self.send();
    }

    /// Another node's queue answers (its cancel-ok comes back as an event, or the loss of
    /// the link answers it: `remote::client`): nothing is sent from here.
    pub fn handed_on(mut self) {
        self.tx = None;
    }

    fn send(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(ClientEvent::CancelOk { channel: self.channel, consumer_tag: self.tag.clone() });
        }
    }
}

impl Drop for CancelOkTo {
    fn drop(&mut self) {
        self.send();
    }
}

/// One-shot reply channel (a bounded(1) flume channel).
pub type Reply<T> = flume::Sender<T>;

/// Operations on a queue, executed by its owner core in arrival order.
#[derive(Debug)]
pub enum QueueOp {
    /// Append a message; report to `confirm` once stored (synced if durable and persistent).
    Publish {
        /// The message.
        message: Message,
        /// Confirm ticket for confirm-mode publishers.
        confirm: Option<ConfirmTo>,
        /// When its basic.publish content was complete, for sampled messages (the
        /// publish→stored histogram; see `observe::sample`).
        published: Option<std::time::Instant>,
        /// Its connection's publish credit, given back when the op is dropped (set for a
        /// queue of another core; see [`credit`]).
        credit: Option<std::sync::Arc<credit::CreditHeld>>,
    },
    /// basic.get: claim the next ready message.
    Get {
        /// Auto-ack: delete on delivery, track nothing.
        no_ack: bool,
        /// Who gets it (manual ack).
        holder: Holder,
        /// The answer (None = get-empty).
        reply: Reply<Result<Option<GetReply>, QueueError>>,
    },
    /// basic.consume.
    Consume {
        /// The consumer.
        consumer: ConsumerSpec,
        /// Ok, or 403 for exclusivity conflicts.
        reply: Reply<Result<(), QueueError>>,
    },
    /// basic.cancel: the queue drops the consumer if it holds it, and answers `ok` either way.
    Cancel {
        /// Which consumer.
        consumer: ConsumerId,
        /// The basic.cancel-ok to send (`None` for nowait).
        ok: Option<CancelOkTo>,
    },
    /// Settle delivered messages by offset (see [`queue::settle`]).
    Settle {
        /// The settling channel's incarnation ([`Holder::chan_uid`]): only offsets it holds
        /// are settled (a tag from before a queue was reopened names nothing now).
        chan_uid: u64,
        /// Acknowledged: delete.
        ack: Vec<Offset>,
        /// Requeued: ready again, redelivered=true, original position.
        requeue: Vec<Offset>,
        /// Rejected without requeue: dead-letter or drop.
        reject: Vec<Offset>,
    },
    /// A channel closed (or its connection died): drop its consumers and requeue every
    /// offset it holds in this queue, including deliveries still on their way to it.
    ChannelClosed {
        /// The channel's incarnation ([`Holder::chan_uid`]).
        chan_uid: u64,
    },
    /// basic.recover(requeue=false): deliver these held offsets again to their consumers.
    Redeliver {
        /// Offsets held by the channel.
        offsets: Vec<Offset>,
    },
    /// Re-check consumers' credit (a channel-wide window opened up elsewhere).
    Wake,
    /// Ready and consumer counts (queue.declare-ok).
    Stats {
        /// (message_count, consumer_count)
        reply: Reply<Result<(u32, u32), QueueError>>,
    },
    /// The queue's figures for the management API: counts, consumers, message counters and,
    /// with `with_unacked`, its outstanding deliveries. Unlike [`QueueOp::Stats`] it renews
    /// no x-expires lease (looking at a queue is not using it). Served on the queue's own
    /// node only (a peer's queue is asked [`QueueOp::Stats`]).
    Info {
        /// List every outstanding delivery too.
        with_unacked: bool,
        /// The answer.
        reply: Reply<QueueInfo>,
    },
    /// queue.purge: drop every ready message.
    Purge {
        /// Messages purged.
        reply: Reply<Result<u32, QueueError>>,
    },
    /// queue.delete with its conditions (406 when violated).
    Delete {
        /// Only if it has no consumers.
        if_unused: bool,
        /// Only if it has no ready messages.
        if_empty: bool,
        /// Messages deleted.
        reply: Reply<Result<u32, QueueError>>,
    },
    /// Replicated data the metadata group applied (`meta::data`): every member's store of a
    /// replicated queue takes it, whichever node serves the queue (never forwarded).
    Replicated(crate::meta::data::DataOp),
}

/// A queue's figures at one moment ([`QueueOp::Info`]).
#[derive(Clone, Debug, Default)]
pub struct QueueInfo {
    /// Messages ready for delivery.
    pub messages_ready: u64,
    /// Messages delivered and not yet settled.
    pub messages_unacked: u64,
    /// Its consumers, in attach order.
    pub consumers: Vec<ConsumerInfo>,
    /// Messages through it since it opened in this run.
    pub counters: queue::Counters,
    /// Its per-stage latency histograms, in [`crate::observe::STAGES`] order.
    pub stages: [crate::observe::HistogramCounts; crate::observe::STAGE_COUNT],
    /// Its outstanding deliveries, oldest first (only when asked).
    pub unacked: Vec<UnackedInfo>,
}

/// A consumer as [`QueueInfo`] lists it.
#[derive(Clone, Debug)]
pub struct ConsumerInfo {
    /// Consumer tag.
    pub tag: ConsumerTag,
    /// Its connection (an id of the queue's node).
    pub conn: ConnId,
    /// Its channel.
    pub channel: ChannelId,
    /// Automatic acknowledgement.
    pub no_ack: bool,
    /// Exclusive consumer.
    pub exclusive: bool,
    /// prefetch_count in force (0 = unlimited).
    pub prefetch: u32,
    /// Consumer priority (`x-priority`).
    pub priority: i32,
}

/// One outstanding delivery as [`QueueInfo`] lists it (item 4 of the management issue).
#[derive(Clone, Debug)]
pub struct UnackedInfo {
    /// Offset of the message in the queue's shard.
    pub offset: u64,
    /// The holding connection.
    pub conn: ConnId,
    /// The holding channel.
    pub channel: ChannelId,
    /// That channel's incarnation ([`Holder::chan_uid`]).
    pub chan_uid: u64,
    /// The consumer's tag (none for a basic.get).
    pub consumer_tag: Option<ConsumerTag>,
    /// Delivered with redelivered=true.
    pub redelivered: bool,
    /// Time since it was delivered, ms.
    pub age_ms: u64,
}

/// How the domain reaches queues on any core. Implemented by [`node::Node`] over the
/// runtime's per-core inboxes.
pub trait Mesh {
    /// Sends `op` to the owner core of `queue` (a local call when that is this core).
    fn send(&self, queue: &QueueRef, op: QueueOp);
}

/// Creates a one-shot reply channel.
pub fn reply_channel<T>() -> (Reply<T>, flume::Receiver<T>) {
    flume::bounded(1)
}
