//! A channel's protocol state: delivery tags, the unacked ledger, consumers, prefetch,
//! publisher confirms and the content being assembled.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::basic::AMQPProperties;
use bytes::{Bytes, BytesMut};

use super::transaction::Tx;
use super::unacked::{DeliveryTag, Ledger};
use crate::broker::{ConsumerId, QueueRef};

/// Whether the channel is usable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelState {
    /// Open.
    Open,
    /// The server sent channel.close and waits for close-ok; other frames are dropped
    /// (spec 1.5.2.5).
    Closing,
}

/// A consumer as its channel knows it.
#[derive(Debug)]
pub struct ChannelConsumer {
    /// Consumer id (unique in this run).
    pub id: ConsumerId,
    /// Its queue.
    pub queue: QueueRef,
    /// Counts it in the node's consumers while it lives (`rabbitmq_consumers`); `None` in
    /// unit tests.
    pub live: Option<crate::observe::Alive>,
}

/// The channel's consumer on the direct reply-to pseudo-queue (`broker::reply_to`).
#[derive(Clone, Debug)]
pub struct ReplyTo {
    /// Its consumer tag.
    pub tag: Arc<str>,
    /// The name replies are published to (`amq.rabbitmq.reply-to.<node>.<token>`), which the
    /// channel's requests carry as their `reply_to`.
    pub name: String,
    /// Its token in the node's registry.
    pub token: u64,
}

/// A basic.publish waiting for its content header and body frames.
#[derive(Debug)]
pub struct PendingPublish {
    /// Target exchange.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// basic.publish mandatory flag.
    pub mandatory: bool,
    /// Set once the header frame arrived: declared body size in bytes.
    pub body_size: Option<u64>,
    /// Parsed properties (after the header frame); `None` for a plain header, whose
    /// properties are read from `raw_properties` (`codec::plain_properties`).
    pub properties: Option<Box<AMQPProperties>>,
    /// Raw properties as received.
    pub raw_properties: Bytes,
    /// Body assembled so far (one frame: kept zero-copy in `first`).
    pub first: Option<Bytes>,
    /// Body assembled so far when it spans several frames.
    pub body: BytesMut,
    /// Body bytes received.
    pub received: u64,
    /// The assembly buffer, counted apart by the memory alarm while the body is incomplete
    /// (`broker::alarms::BodyAssembly`).
    pub reserved: Option<crate::broker::alarms::BodyAssembly>,
}

impl PendingPublish {
    /// The whole body once complete.
    pub fn take_body(&mut self) -> Bytes {
        self.reserved = None;
        match self.first.take() {
            Some(b) if self.body.is_empty() => b,
            Some(b) => {
                let mut all = BytesMut::with_capacity(b.len() + self.body.len());
                all.extend_from_slice(&b);
                all.extend_from_slice(&self.body);
                all.freeze()
            }
            None => std::mem::take(&mut self.body).freeze(),
        }
    }

    /// Appends one body frame's payload. A body of several frames is assembled in one
    /// buffer of the declared `body_size` (bounded by the header check against the largest
    /// message), reserved at the second frame: growing it by doubling cost a 10 MB message
    /// ~24 reallocations into fresh pages (82 % of the broker's CPU went to page zeroing).
    pub fn push_body(&mut self, payload: Bytes) {
        self.received += payload.len() as u64;
        if self.first.is_none() && self.body.is_empty() {
            self.first = Some(payload);
        } else {
            if let Some(f) = self.first.take() {
                let declared = self.body_size.unwrap_or(0) as usize;
                self.body.reserve(declared.max(f.len() + payload.len()));
                self.reserved = Some(crate::broker::alarms::BodyAssembly::new(self.body.capacity()));
                self.body.extend_from_slice(&f);
            }
            self.body.extend_from_slice(&payload);
        }
    }
}

/// Publisher-confirm bookkeeping (RabbitMQ's confirm extension, confirm.select).
#[derive(Debug, Default)]
pub struct Confirms {
    /// confirm.select received.
    pub enabled: bool,
    /// Sequence number of the next publish (starts at 1).
    pub next_seq: u64,
    /// Publishes waiting for queues: seq → (queues still to store it, any failure).
    pub pending: BTreeMap<u64, (u32, bool)>,
    /// The sampled ones among them (`observe::Stage::PublishToConfirmed`): seq → end of
    /// their basic.publish, in seq order.
    pub sampled: Vec<(u64, std::time::Instant)>,
    /// Marks of the publish clock ([`Confirms::mark`]): `(s, t)` says every sequence number
    /// below `s` was taken before `t`. Oldest first, at most one per [`MARK_EVERY`].
    marks: VecDeque<(u64, Instant)>,
}

/// Longest a confirm-mode publish waits for its answer before the connection nacks it itself,
/// whatever became of it (a queue that never answers, a link that flaps, a node paused): the
/// longest legitimate wait is a failover's park (`remote::failover::PARK_LIMIT`, 10 s) followed
/// by a Raft proposal (10 s), so this fires only when something else went wrong.
pub const CONFIRM_LIMIT: Duration = Duration::from_secs(30);

/// Spacing of the publish clock's marks: an overdue publish is nacked within
/// `CONFIRM_LIMIT + MARK_EVERY` of its basic.publish.
pub const MARK_EVERY: Duration = Duration::from_secs(1);

impl Confirms {
    /// Confirms of a channel that starts numbering its publishes at `next_seq` (1 after
    /// confirm.select or tx.select), on when `enabled`.
    pub fn starting(enabled: bool, next_seq: u64) -> Confirms {
        Confirms { enabled, next_seq, ..Default::default() }
    }

    /// Records one queue's answer for `seq`. Returns `Some(ok)` when `seq` is complete (every
    /// target answered); `None` while it waits for other queues, and for any answer to a
    /// publish that is not waiting: one nacked already as overdue, or one answered already
    /// (a second confirm of a delivery tag would make a client that counts confirms, as
    /// pika's blocking channel does, take it for the next publish's).
    pub fn stored(&mut self, seq: u64, ok: bool) -> Option<bool> {
        let (left, failed) = self.pending.get_mut(&seq)?;
        *left = left.saturating_sub(1);
        *failed |= !ok;
        if *left > 0 {
            return None;
        }
        let (_, failed) = self.pending.remove(&seq).expect("present");
        Some(!failed)
    }

    /// Takes the next sequence number for a publish that waits for `queues` answers (none:
    /// complete at once, as a transaction's unroutable publish is; a confirm-mode channel's
    /// unroutable publish waits for the one answer the channel sends itself after the
    /// basic.return).
    pub fn take_seq(&mut self, queues: usize) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        if queues > 0 {
            self.pending.insert(seq, (queues as u32, false));
        }
        seq
    }

    /// Follows pending publish `seq`, whose basic.publish ended `at`, to its confirm.
    pub fn sample(&mut self, seq: u64, at: std::time::Instant) {
        if self.pending.contains_key(&seq) {
            self.sampled.push((seq, at));
        }
    }

    /// When completed publish `seq` ended, if it was sampled (forgotten here).
    pub fn take_sample(&mut self, seq: u64) -> Option<std::time::Instant> {
        let i = self.sampled.iter().position(|(s, _)| *s == seq)?;
        Some(self.sampled.remove(i).1)
    }

    /// Lowest publish still waiting, if any.
    pub fn lowest_pending(&self) -> Option<u64> {
        self.pending.keys().next().copied()
    }

    /// Reads the publish clock at `now`: while publishes wait, records which sequence numbers
    /// were taken by then, at most once per [`MARK_EVERY`], so [`Confirms::overdue`] can tell
    /// their age without a clock read per publish. Forgets the marks no waiting publish needs.
    pub fn mark(&mut self, now: Instant) {
        let Some(low) = self.lowest_pending() else {
            self.marks.clear();
            return;
        };
        while self.marks.front().is_some_and(|&(s, _)| s <= low) {
            self.marks.pop_front();
        }
        let due = self.marks.back().is_none_or(|&(s, t)| s < self.next_seq && now.duration_since(t) >= MARK_EVERY);
        if due {
            self.marks.push_back((self.next_seq, now));
        }
    }

    /// Whether some waiting publish may turn overdue: then the connection reads the clock
    /// again within [`MARK_EVERY`].
    pub fn waiting(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The publishes taken more than `limit` before `now` and still unanswered, in order:
    /// they are forgotten as pending (their nack is the caller's to send) and their late
    /// answers dropped. Empty unless a mark older than `limit` covers one.
    pub fn overdue(&mut self, now: Instant, limit: Duration) -> Vec<u64> {
        let mut below = None;
        while let Some(&(s, t)) = self.marks.front() {
            if now.saturating_duration_since(t) < limit {
                break;
            }
            below = Some(s);
            self.marks.pop_front();
        }
        let Some(below) = below else { return Vec::new() };
        let kept = self.pending.split_off(&below);
        let late = std::mem::replace(&mut self.pending, kept);
        self.sampled.retain(|&(s, _)| s >= below);
        late.into_keys().collect()
    }
}

/// One open channel.
#[derive(Debug)]
pub struct Channel {
    /// Channel number.
    pub id: u16,
    /// Unique id of this opening (see `broker::Holder::chan_uid`).
    pub uid: u64,
    /// Open or closing.
    pub state: ChannelState,
    /// Next delivery tag (starts at 1; shared by basic.get and basic.deliver).
    pub next_tag: u64,
    /// Delivered, unsettled messages.
    pub ledger: Ledger,
    /// Consumers by consumer tag.
    pub consumers: HashMap<Arc<str>, ChannelConsumer>,
    /// Queues this channel consumed or got from (told when the channel closes).
    pub touched: HashSet<QueueRef>,
    /// basic.qos prefetch_count for consumers started after it (0 = unlimited).
    pub prefetch: u32,
    /// basic.qos global=true: the window shared by all consumers of the channel.
    pub credit: std::sync::Arc<crate::broker::ChannelCredit>,
    /// Publisher confirms; after tx.select, the sequence numbers and pending answers of
    /// committed publishes (no confirm frames are sent then).
    pub confirms: Confirms,
    /// tx.select received: what the transaction holds (`crate::amqp::transaction`).
    pub tx: Option<Box<Tx>>,
    /// Its direct reply-to consumer, if it consumes from `amq.rabbitmq.reply-to`.
    pub reply_to: Option<ReplyTo>,
    /// A publish whose content is being received.
    pub publish: Option<PendingPublish>,
    /// channel.flow active flag as last set by the client.
    pub flow_active: bool,
    /// Counts it in the node's open channels while it lives (`rabbitmq_channels`); `None`
    /// in unit tests.
    pub live: Option<crate::observe::Alive>,
    /// Counts it in the node's publishers from its first basic.publish on
    /// (`rabbitmq_global_publishers`).
    pub publisher: Option<crate::observe::Alive>,
}

impl Channel {
    /// A freshly opened channel.
    pub fn new(id: u16, uid: u64) -> Channel {
        Channel {
            id,
            uid,
            state: ChannelState::Open,
            next_tag: 1,
            ledger: Ledger::default(),
            consumers: HashMap::new(),
            touched: HashSet::new(),
            prefetch: 0,
            credit: Default::default(),
            confirms: Confirms::default(),
            tx: None,
            reply_to: None,
            publish: None,
            flow_active: true,
            live: None,
            publisher: None,
        }
    }

    /// Takes the next delivery tag.
    pub fn take_tag(&mut self) -> DeliveryTag {
        let t = self.next_tag;
        self.next_tag += 1;
        DeliveryTag(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confirms_complete_when_all_queues_answer() {
        let mut c = Confirms { enabled: true, next_seq: 3, ..Default::default() };
        c.pending.insert(1, (2, false));
        c.pending.insert(2, (1, false));
        assert_eq!(c.stored(1, true), None);
        assert_eq!(c.lowest_pending(), Some(1));
        assert_eq!(c.stored(2, false), Some(false));
        assert_eq!(c.stored(1, true), Some(true));
        assert_eq!(c.lowest_pending(), None);
        // A second answer for a publish answered already is no second confirm.
        assert_eq!(c.stored(1, true), None);
        assert_eq!(c.stored(2, true), None);
    }

    #[test]
    fn a_publish_unanswered_past_the_limit_is_given_up_once() {
        let t0 = Instant::now();
        let mut c = Confirms { enabled: true, next_seq: 1, ..Default::default() };
        let (a, b) = (c.take_seq(2), c.take_seq(1));
        c.mark(t0);
        // Taken after the first mark: not known to be old yet.
        let late = c.take_seq(1);
        c.mark(t0 + Duration::from_millis(500));
        c.mark(t0 + MARK_EVERY);
        assert_eq!(c.overdue(t0 + Duration::from_secs(29), CONFIRM_LIMIT), Vec::<u64>::new());
        assert_eq!(c.stored(b, true), Some(true));
        assert_eq!(c.overdue(t0 + CONFIRM_LIMIT, CONFIRM_LIMIT), vec![a]);
        assert_eq!(c.lowest_pending(), Some(late));
        // The queues' late answers for `a` are dropped: it was answered (nacked) once.
        assert_eq!(c.stored(a, true), None);
        assert_eq!(c.stored(a, true), None);
        assert_eq!(c.overdue(t0 + CONFIRM_LIMIT + MARK_EVERY, CONFIRM_LIMIT), vec![late]);
        assert!(!c.waiting());
        // A publish answered in time is never given up, and an unroutable one still completes.
        let next = c.take_seq(1);
        c.mark(t0 + Duration::from_secs(40));
        assert_eq!(c.stored(next, false), Some(false));
        assert_eq!(c.overdue(t0 + Duration::from_secs(80), CONFIRM_LIMIT), Vec::<u64>::new());
        let unroutable = c.take_seq(1);
        assert_eq!(c.stored(unroutable, true), Some(true));
        assert_eq!(c.stored(unroutable, true), None, "answered once");
    }
}
