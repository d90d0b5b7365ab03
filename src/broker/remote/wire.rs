//! The frames nodes exchange to serve each other's queues (`remote/mod.rs`): what a client's
//! node (A) sends the queue's node (B), and what B sends back. Carried as the payload of the
//! cluster transport's data lane, one frame per payload.
//!
//! Node A names its own connections (`conn`) and requests (`req`); B never interprets them,
//! it only sends them back. Offsets, channel numbers and channel incarnations (`chan_uid`) are
//! those of `broker` ([`crate::broker::Holder`]).

use crate::broker::message::Message;
use crate::broker::{QueueError, QueueKey};

/// Where B answers a publish's confirm: A's connection and channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConfirm {
    /// A's connection id.
    pub conn: u64,
    /// Publishing channel.
    pub channel: u16,
    /// Its incarnation.
    pub chan_uid: u64,
    /// Publish sequence number (the confirm's delivery tag on A).
    pub seq: u64,
}

/// Who holds what B delivers: a channel on A.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteHolder {
    /// A's connection id.
    pub conn: u64,
    /// Channel.
    pub channel: u16,
    /// Its incarnation.
    pub chan_uid: u64,
}

/// A consumer on A of a queue on B ([`crate::broker::ConsumerSpec`] without its channels).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConsumer {
    /// A's consumer id (unique within A's run).
    pub id: u64,
    /// Where it lives on A.
    pub holder: RemoteHolder,
    /// Consumer tag.
    pub tag: String,
    /// Automatic acknowledgement.
    pub no_ack: bool,
    /// Exclusive consumer.
    pub exclusive: bool,
    /// basic.qos prefetch_count of the consumer (0 = unlimited).
    pub prefetch: u32,
    /// basic.qos global prefetch of its channel (0 = unlimited).
    pub channel_prefetch: u32,
    /// The client wants basic.cancel when the queue goes away.
    pub cancel_notify: bool,
    /// Send consume-ok (false for nowait).
    pub send_consume_ok: bool,
}

/// A → B: an operation on one of B's queues, or the end of one of A's connections.
#[derive(Clone, Debug)]
pub enum Request {
    /// basic.publish routed (on A) to `queue`.
    Publish {
        /// Target queue.
        queue: QueueKey,
        /// The message.
        message: Message,
        /// Confirm-mode publisher.
        confirm: Option<RemoteConfirm>,
    },
    /// basic.get.
    Get {
        /// A's request id.
        req: u64,
        /// Queue.
        queue: QueueKey,
        /// Auto-ack.
        no_ack: bool,
        /// Who gets it.
        holder: RemoteHolder,
    },
    /// basic.consume.
    Consume {
        /// A's request id.
        req: u64,
        /// Queue.
        queue: QueueKey,
        /// The consumer.
        consumer: RemoteConsumer,
    },
    /// basic.cancel.
    Cancel {
        /// Queue.
        queue: QueueKey,
        /// A's consumer id.
        consumer: u64,
        /// Send cancel-ok.
        send_ok: bool,
    },
    /// basic.ack / nack / reject by offset.
    Settle {
        /// Queue.
        queue: QueueKey,
        /// Settling channel's incarnation.
        chan_uid: u64,
        /// Acknowledged offsets.
        ack: Vec<u64>,
        /// Requeued offsets.
        requeue: Vec<u64>,
        /// Rejected offsets (dead-letter or drop).
        reject: Vec<u64>,
    },
    /// A channel on A closed: requeue what it holds in `queue`.
    ChannelClosed {
        /// Queue.
        queue: QueueKey,
        /// The channel's incarnation.
        chan_uid: u64,
    },
    /// basic.recover(requeue=false).
    Redeliver {
        /// Queue.
        queue: QueueKey,
        /// Offsets held by the channel.
        offsets: Vec<u64>,
    },
    /// queue.declare-ok counts.
    Stats {
        /// A's request id.
        req: u64,
        /// Queue.
        queue: QueueKey,
    },
    /// queue.purge.
    Purge {
        /// A's request id.
        req: u64,
        /// Queue.
        queue: QueueKey,
    },
    /// queue.delete.
    Delete {
        /// A's request id.
        req: u64,
        /// Queue.
        queue: QueueKey,
        /// Only if unused.
        if_unused: bool,
        /// Only if empty.
        if_empty: bool,
    },
    /// A's connection `conn` ended: B forgets it (its channels were closed before).
    ConnectionClosed {
        /// A's connection id.
        conn: u64,
    },
}

/// B → A: an event for one of A's connections.
#[derive(Clone, Debug)]
pub enum Event {
    /// basic.deliver.
    Deliver {
        /// Channel.
        channel: u16,
        /// Its incarnation.
        chan_uid: u64,
        /// Consumer tag.
        consumer_tag: String,
        /// Source queue.
        queue: QueueKey,
        /// The queue is durable.
        durable: bool,
        /// Its owner core on B.
        owner_core: u32,
        /// Offset in the queue.
        offset: u64,
        /// Delivered before.
        redelivered: bool,
        /// The message.
        message: Message,
        /// Manual ack: A tracks the delivery tag.
        track: bool,
    },
    /// basic.consume-ok.
    ConsumeOk {
        /// Channel.
        channel: u16,
        /// Consumer tag.
        consumer_tag: String,
    },
    /// basic.cancel-ok.
    CancelOk {
        /// Channel.
        channel: u16,
        /// Consumer tag.
        consumer_tag: String,
    },
    /// The queue cancelled the consumer (deleted).
    Cancelled {
        /// Channel.
        channel: u16,
        /// Consumer tag.
        consumer_tag: String,
    },
    /// A publish was stored (or not: `ok == false`).
    Stored {
        /// Channel.
        channel: u16,
        /// Its incarnation.
        chan_uid: u64,
        /// Publish sequence number.
        seq: u64,
        /// Stored.
        ok: bool,
    },
    /// A delivery on the channel passed its acknowledgement timeout.
    AckTimeout {
        /// Channel.
        channel: u16,
        /// Its incarnation.
        chan_uid: u64,
        /// The timeout, ms.
        timeout_ms: u64,
    },
}

/// A basic.get answer's message.
#[derive(Clone, Debug)]
pub struct GotMessage {
    /// Offset in the queue.
    pub offset: u64,
    /// Delivered before.
    pub redelivered: bool,
    /// The message.
    pub message: Message,
    /// Messages still ready.
    pub message_count: u32,
}

/// B → A: the answer to request `req`.
#[derive(Clone, Debug)]
pub enum Reply {
    /// To `Get`: a message, get-empty (`None`), or a refusal.
    Get(Result<Option<GotMessage>, QueueError>),
    /// To `Consume`.
    Consume(Result<(), QueueError>),
    /// To `Stats`: (message_count, consumer_count).
    Stats(Result<(u32, u32), QueueError>),
    /// To `Purge` and `Delete`: messages removed.
    Count(Result<u32, QueueError>),
}

/// One data-lane frame.
#[derive(Clone, Debug)]
pub enum Frame {
    /// A → B.
    Request(Request),
    /// B → A: an event for A's connection `conn`.
    Event {
        /// A's connection id.
        conn: u64,
        /// The event.
        event: Event,
    },
    /// B → A: the answer to A's request `req`.
    Reply {
        /// A's request id.
        req: u64,
        /// The answer.
        reply: Reply,
    },
}
