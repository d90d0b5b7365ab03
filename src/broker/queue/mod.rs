//! A queue on its owner core.
//!
//! A queue owns one shard (`ringmq-shards`) holding its messages, and in memory only
//! offsets: the ready set ([`ready::ReadySet`]) and the outstanding (delivered, unsettled)
//! offsets with their holders ([`settle::Held`]). Memory per ready message is one `u64` in
//! a `VecDeque` (8 bytes) plus the shard's own per-record index.
//!
//! # Layout
//! - this file: the queue's state, its start (with the recovery scan), the operations of
//!   [`QueueOp`] and its lifecycle (purge, delete, retire);
//! - [`ready`]: the ready set and its order;
//! - [`dispatch`]: the dispatcher task, deliveries and basic.get;
//! - [`settle`]: the ack path — DESIGN.md's rules 1–10, and one function per entry point;
//! - [`durability`]: everything that waits for an fdatasync, with the proofs that order it;
//! - [`index`]: the unacked-index record; [`consumer`]: consumers and their credit;
//! - [`reapply`]: a policy change applied to an open queue.
//! - [`limits`]: `x-max-length`, `x-max-length-bytes` and `x-overflow`;
//! - [`delivery_limit`]: `x-delivery-limit` (poison-message handling);
//! - [`ttl`]: message TTL (`x-message-ttl`, `expiration`): deadlines and expiry at the head;
//! - [`priority`]: `x-max-priority`, the levels of a priority queue's ready set;
//! - [`replica`]: a replicated queue's data through the log; [`copy`]: growing its replica set.
//! - [`reserve`]: a durable queue's delivery reservation (deliveries without an index sync).
//! - `idle`: whether an empty, unused queue may be closed (its core closes it).
//!
//! # Invariants
//! - An offset is in exactly one of: the ready set, the outstanding set, `paging`
//!   (claimed while its record is read from disk), or deleted from the shard.
//! - A consumer's `in_flight` equals the outstanding offsets whose holder is that consumer.
//!
//! # Assumptions
//! Single-threaded per core: no `RefCell` borrow of a queue is held across an `.await`.

pub mod consumer;
pub mod copy;
pub mod delivery_limit;
pub mod dispatch;
pub mod durability;
pub mod egress;
pub mod expiry;
mod idle;
pub mod index;
pub mod limits;
pub mod priority;
pub mod ready;
pub mod reapply;
pub mod replica;
pub mod reserve;
pub mod settle;
pub mod ttl;

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::time::Instant;

use ringmq_shards::{Record, Shard};
use rustc_hash::FxHashMap;

use super::message::Message;
use super::router::{int_arg, string_arg, Route};
use super::{ClientEvent, ConfirmTo, ConsumerId, Delivery, Mesh, QueueError, QueueKey, QueueOp, QueueRef};
use crate::meta::state::QueueDef;
use crate::meta::MetaHandle;
use crate::observe::Stage;
use consumer::Consumers;
pub use delivery_limit::sync_return_counts;
pub use index::read_index;
use index::IndexRecord;
use limits::Limits;
use ready::ReadySet;
use replica::Replication;
use settle::Held;

thread_local! {
    pub(super) static INDEX_FAILURE_LOGGED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    pub(super) static REFUSAL_LOGGED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// True at most once a second per `slot` and thread: for log lines a full disk would
/// otherwise print once per message.
pub(super) fn once_a_second(slot: &'static std::thread::LocalKey<std::cell::Cell<Option<Instant>>>) -> bool {
    slot.with(|c| {
        let due = c.get().is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(1));
        if due {
            c.set(Some(Instant::now()));
        }
        due
    })
}

/// Default delivery acknowledgement timeout: 30 minutes (RabbitMQ's consumer_timeout), in ms.
pub const DEFAULT_CONSUMER_TIMEOUT_MS: u64 = 30 * 60 * 1000;

/// What a queue needs from its core besides its own state.
pub trait QueueEnv: Mesh {
    /// Routes a message (for dead-lettering) with the core's current routing table.
    fn route(&self, vhost: &str, exchange: &str, routing_key: &str, headers: Option<&amq_protocol::types::FieldTable>) -> Route;
    /// The queue has become unused and should go (auto-delete, or its x-expires lease ran
    /// out): queue.delete with if-unused, so a consumer that attached meanwhile keeps it.
    fn auto_delete(&self, key: &QueueKey);
    /// The metadata group (cursor commits, leader check, node id and boot epoch).
    fn meta(&self) -> &MetaHandle;
    /// This core's counters and latency histograms.
    fn stats(&self) -> &crate::observe::Stats;
    /// A store reported a full disk (the disk alarm is checked at once).
    fn disk_full(&self);
}

/// A durable queue's shared cursor: every offset below `committed` has been delivered at
/// least once (or, after a replicated queue moved, may have been: `replica.rs`, step 5), and
/// the Raft metadata says so (committed by compare-and-set). A priority queue hands higher
/// offsets out before lower ones: its target is its ready set's floor, not the highest
/// delivery (`ready.rs`, "Priorities and the cursor").
#[derive(Debug, Default)]
pub struct Cursor {
    /// Value stored in the metadata.
    pub committed: u64,
    /// Highest delivered offset + 1, for a priority queue its floor (what the next commit
    /// proposes).
    pub target: u64,
    /// A commit task is running.
    pub committing: bool,
}

/// What a queue learns from its store when it opens.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The committed cursor from the metadata.
    pub cursor: u64,
    /// Unacked-index records left by earlier runs: (index offset, record).
    pub held: Vec<(u64, IndexRecord)>,
    /// Return counts left by earlier runs (`delivery_limit.rs`): (index offset, record).
    pub returns: Vec<(u64, index::ReturnCount)>,
    /// A replicated queue's delivery reservation from the metadata (`replica.rs`, step 5).
    pub reserved: u64,
    /// Any other durable queue's reservation from its unacked index (`reserve.rs`), capped
    /// at its tail.
    pub reservation: reserve::Reservation,
    /// A replicated queue's tail in the metadata (its next offset) when it opens. The
    /// metadata a queue opens with holds every `Enqueue` of a message an earlier server
    /// handed out (this node's own start applied its `NodeBoot`, after them in the log; a
    /// takeover applied the `MoveQueue`, which ends the old server's deliveries), so nothing
    /// at or past it was handed out before.
    pub tail: u64,
    /// (offset, body bytes) of every live message, read only for a queue with
    /// `x-max-length-bytes` ([`limits`]); empty otherwise.
    pub body_lens: Vec<(u64, u32)>,
    /// (offset, `priority` property) of every live message, read only for a queue with
    /// `x-max-priority` ([`priority`]); empty otherwise.
    pub priorities: Vec<(u64, u8)>,
}

/// What a queue that opens needs read from each of its live records.
#[derive(Clone, Copy)]
pub struct RecordScan {
    /// Body lengths, for `x-max-length-bytes` ([`limits`]).
    pub body_lens: bool,
    /// `priority` properties, for `x-max-priority` ([`priority`]).
    pub priorities: bool,
}

/// ((offset, body bytes), (offset, priority)) of every live record of `shard`, each list
/// only when `want` asks for it, read in one pass through the shard's sequential reader.
///
/// # Errors
/// The store's read errors.
pub async fn scan_records(
    shard: &ringmq_shards::Shard,
    want: RecordScan,
) -> Result<(Vec<(u64, u32)>, Vec<(u64, u8)>), ringmq_shards::StoreError> {
    let mut reader = shard.reader(shard.start_offset());
    let (mut lens, mut prios) = (Vec::new(), Vec::new());
    while let Some(r) = reader.next().await? {
        if want.body_lens {
            lens.push((r.offset, u32::try_from(r.body.len()).unwrap_or(u32::MAX)));
        }
        if want.priorities {
            prios.push((r.offset, priority::of_header(&r.header)));
        }
    }
    Ok((lens, prios))
}

/// A queue's state. See the module doc.
pub struct Queue {
    /// Routable reference (key, owner core, durability).
    pub qref: QueueRef,
    /// Declaration.
    pub def: QueueDef,
    /// The message store.
    pub shard: Rc<Shard>,
    /// The unacked index (durable queues only).
    pub index: Option<Rc<Shard>>,
    /// The shared cursor (durable queues only; see [`Cursor`]).
    pub cursor: Cursor,
    me: Weak<RefCell<Queue>>,
    /// Ready offsets, in delivery order, with their redelivered flags.
    ready: ReadySet,
    /// Outstanding deliveries and their holders.
    held: Held,
    paging: usize,
    /// Attached consumers.
    pub consumers: Consumers,
    had_consumer: bool,
    pending_confirms: Vec<(ConfirmTo, Option<Instant>)>,
    /// basic.publish end of sampled persistent messages published without a confirm,
    /// waiting for the sync that stores them (their `publish_to_stored`).
    stored_samples: Vec<Instant>,
    syncing: bool,
    /// Message offset → its live unacked-index record. A record outlives a requeue (the
    /// message was delivered: after a crash it must come back redelivered=true).
    index_of: FxHashMap<u64, u64>,
    /// Index records of messages whose deletion (ack, drop, dead-letter, purge) is not yet
    /// synced in the message shard. They are deleted only after the next message-shard
    /// sync, so an index record never disappears before its message does (else a crash in
    /// between would redeliver a delivered message unflagged).
    index_trash: Vec<u64>,
    /// Index records of earlier deliveries of messages delivered again (requeued since):
    /// deleted only after an index sync that began once their replacements were appended
    /// returns (`Queue::flush_unsynced`, `durability::reply_get`). A deletion-bitmap bit is
    /// in the page cache as soon as it is set, so a kill -9 keeps it even unsynced: deleted
    /// before its replacement is durable, the message would come back unflagged (rule 2).
    index_superseded: Vec<u64>,
    /// When the last full sync (appends and deletes) of the message shard started.
    last_full_sync: Instant,
    /// A timer will start the next full sync (`durability::group_commit`).
    full_sync_armed: bool,
    /// When an operation other than [`QueueOp::Info`] last reached it, to the core's tick
    /// (1 s): [`Queue::handle`] only sets `used`, and the tick folds it in (`idle.rs`), so
    /// an operation does not read the clock.
    last_used: Instant,
    /// An operation other than [`QueueOp::Info`] reached it since the last tick.
    used: bool,
    /// The index flusher task runs (see [`Queue::flush_unsynced_soon`]).
    index_flushing: bool,
    /// What deliveries may leave without their index records synced (`reserve.rs`).
    reservation: reserve::Reservation,
    /// Deliveries waiting for their unacked-index records to be synced.
    unsynced: Vec<(ConsumerId, Delivery, std::sync::Arc<std::sync::atomic::AtomicUsize>)>,
    /// Set by the dispatcher for a synchronous stretch of deliveries: they gather in
    /// `batched`, one event per consumer, sent by [`Queue::flush_deliveries`] before it awaits.
    batching: bool,
    /// Deliveries gathered while `batching`, per consumer.
    batched: Vec<(ConsumerId, crate::broker::Deliveries)>,
    /// Records read ahead from disk, by offset (see [`dispatch::read_ahead`]); bounded by
    /// [`dispatch::READ_AHEAD_BYTES`] per read, dropped when taken or purged.
    paged: std::collections::BTreeMap<u64, Record>,
    /// Appends or deletes not yet covered by a sync.
    dirty: bool,
    /// Publish credit kept while the store's writer is behind (`durability.rs`,
    /// [`Queue::hold_credit`]); given back, all at once, when it has caught up.
    held_credit: Vec<std::sync::Arc<crate::broker::credit::CreditHeld>>,
    /// Publish credit held for a consumer behind on a saturated core (`egress.rs`).
    egress: egress::Egress,
    wake: flume::Sender<()>,
    /// A wake was sent that the dispatcher has not yet started a step after: another
    /// would find the same state (a flume send takes a lock: 3 % of a core at 1 M
    /// publishes/s when sent for each).
    wake_pending: std::cell::Cell<bool>,
    /// Set once the queue is deleted; tasks holding a reference stop.
    pub deleted: bool,
    /// Delivery acknowledgement timeout in ms (x-consumer-timeout or the default); 0: none.
    pub consumer_timeout_ms: u64,
    /// x-expires: the queue's lease (`expiry.rs`); `None` without the argument.
    pub expiry: Option<expiry::Expiry>,
    /// x-dead-letter-exchange.
    pub dead_letter_exchange: Option<String>,
    /// x-dead-letter-routing-key.
    pub dead_letter_routing_key: Option<String>,
    /// A replicated queue's state (`replica.rs`); `None` for a queue of one node.
    repl: Option<Replication>,
    /// Length limits (`limits.rs`); `None` for a queue without `x-max-length(-bytes)`.
    limits: Option<Limits>,
    /// `x-delivery-limit` and the return counts (`delivery_limit.rs`); `None` without a limit.
    delivery_limit: Option<delivery_limit::DeliveryLimit>,
    /// Message TTL (`ttl.rs`); `None` for a queue without `x-message-ttl` that took no
    /// message with `expiration` in this run.
    ttl: Option<Box<ttl::Ttl>>,
    /// Messages through this queue since it opened, for the management API.
    pub counters: Counters,
    /// Per-stage latency of this queue's sampled messages (the management UI's latency view
    /// and `/metrics/per-object`), the per-queue stages only.
    pub stages: crate::observe::Stages,
    env: Rc<dyn QueueEnv>,
}

/// A queue's message counts since it opened in this run (RabbitMQ's `message_stats`):
/// plain integers, written by the queue's core only, read through [`QueueOp::Info`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Messages published to it (basic.publish routed here, dead-lettered copies included).
    pub published: u64,
    /// Messages handed to a consumer or a basic.get (redeliveries included).
    pub delivered: u64,
    /// Deliveries acknowledged.
    pub acked: u64,
}

/// A queue's shards: its messages and, for a durable queue, its unacked index.
pub type Shards = (Rc<Shard>, Option<Rc<Shard>>);

/// A basic.cancel owed to a consumer of a queue taken out of service
/// ([`Queue::tear_down_quietly`]).
pub struct CancelNotice {
    tx: super::ClientTx,
    event: ClientEvent,
}

impl CancelNotice {
    /// Sends it to the consumer's connection (gone connections are ignored).
    pub fn send(self) {
        let _ = self.tx.send(self.event);
    }
}

/// Shared handle to a queue on its owner core.
pub type QueueCell = Rc<RefCell<Queue>>;

impl Queue {
    /// Builds a queue around its opened shards and starts its dispatcher task.
    ///
    /// Ready messages are the shard's live records, in offset order. Recovery (DESIGN.md
    /// rule 7): a live message below the committed cursor, or named by an unacked-index
    /// record of an earlier run (a replicated queue: below its delivery reservation, which
    /// stands in for the index there), was delivered before and comes back redelivered=true. On
    /// the Raft leader, the scanner requeues those deliveries (their boot epoch is dead):
    /// the messages are ready again and keep their records until settled.
    pub fn start(
        def: QueueDef,
        qref: QueueRef,
        shard: Shard,
        index: Option<Shard>,
        recovered: Recovered,
        default_timeout_ms: u64,
        env: Rc<dyn QueueEnv>,
    ) -> QueueCell {
        let (wake, wake_rx) = flume::bounded(1);
        let live = shard.live_offsets();
        let replicated = replica::is_replicated(&def, env.meta().is_cluster());
        // A replicated queue keeps no unacked-index records: whatever a server of it may have
        // handed out lies below its reservation (`replica.rs`, step 5).
        let delivered_below = if replicated {
            recovered.cursor.max(recovered.reserved.min(recovered.tail))
        } else {
            recovered.cursor.max(recovered.reservation.below)
        };
        let below_cursor: Vec<u64> = live.iter().copied().take_while(|o| *o < delivered_below).collect();
        let indexed = recovered.held.iter().map(|(_, r)| r.offset).filter(|o| shard.is_live(*o));
        let mut ready = ReadySet::recovered(live, below_cursor.into_iter().chain(indexed));
        // The effective arguments: declared ones merged with the policies (`broker::policy`,
        // the one point where they are computed); every `x-` argument below reads them.
        let args = super::policy::effective_queue_arguments(&env.meta().topology(), &def);
        let quorum = string_arg(&args, "x-queue-type") == Some("quorum");
        let limits = Limits::from_arguments(&args, quorum);
        let mut delivery_limit = delivery_limit::DeliveryLimit::from_arguments(&args, quorum);
        if limits.is_some_and(|l| l.counts_bytes()) {
            ready.count_bytes(recovered.body_lens.iter().copied().filter(|(o, _)| shard.is_live(*o)));
        }
        if let Some(max) = priority::max_priority(&args) {
            ready.prioritise(max, recovered.priorities.iter().copied());
        }
        // The scanner (rule 7): records of a dead boot epoch are requeued at once — their
        // messages are ready again, flagged; the records stay as theirs until the messages are
        // settled (a record of a message no longer live goes now). It runs where the queue's
        // index is: on the Raft leader, and on the queue's own node, the only one holding its
        // store while queues are not replicated (every record there is of an earlier boot of
        // this node, so of a dead epoch).
        let (mut index_of, mut stale) = (FxHashMap::default(), Vec::new());
        if index.is_some() && (env.meta().is_leader() || def.owner_node == env.meta().node_id()) {
            (index_of, stale) = settle::scan(&recovered.held, |o| shard.is_live(o));
            if !recovered.held.is_empty() {
                tracing::info!(queue = %qref.key.name, records = recovered.held.len(), "requeued deliveries of a dead boot epoch");
            }
        }
        // Return counts of an earlier run (`delivery_limit.rs`, behaviour 5).
        match &mut delivery_limit {
            Some(d) => stale.extend(d.recover(&recovered.returns, |o| shard.is_live(o))),
            None => stale.extend(recovered.returns.iter().map(|(i, _)| *i)),
        }
        if let (Some(index), false) = (&index, stale.is_empty()) {
            if let Err(e) = index.delete_by_offsets(&stale) {
                tracing::error!(error = %e, "unacked index delete failed");
            }
        }
        let consumer_timeout_ms = int_arg(&args, "x-consumer-timeout").filter(|v| *v >= 0).map(|v| v as u64).unwrap_or(default_timeout_ms);
        let dead_letter_exchange = string_arg(&args, "x-dead-letter-exchange").map(str::to_owned);
        let expiry = expiry::Expiry::from_arg(int_arg(&args, "x-expires"));
        let single_active = super::router::bool_arg(&args, "x-single-active-consumer").unwrap_or(false);
        let dead_letter_routing_key = string_arg(&args, "x-dead-letter-routing-key").map(str::to_owned);
        let repl = replicated
            .then(|| Replication::new(def.owner_node == env.meta().node_id(), recovered.reserved.max(recovered.cursor), delivered_below));
        let q = Rc::new_cyclic(|me| {
            RefCell::new(Queue {
                qref,
                def,
                shard: Rc::new(shard),
                index: index.map(Rc::new),
                cursor: Cursor { committed: recovered.cursor, target: recovered.cursor, committing: false },
                me: me.clone(),
                ready,
                held: Held::default(),
                paging: 0,
                consumers: Consumers::new(single_active),
                had_consumer: false,
                pending_confirms: Vec::new(),
                stored_samples: Vec::new(),
                syncing: false,
                index_flushing: false,
                reservation: recovered.reservation,
                unsynced: Vec::new(),
                batching: false,
                batched: Vec::new(),
                index_of,
                index_trash: Vec::new(),
                index_superseded: Vec::new(),
                last_full_sync: Instant::now(),
                full_sync_armed: false,
                last_used: Instant::now(),
                used: false,
                paged: Default::default(),
                dirty: false,
                held_credit: Vec::new(),
                egress: Default::default(),
                wake,
                wake_pending: std::cell::Cell::new(false),
                deleted: false,
                consumer_timeout_ms,
                expiry,
                dead_letter_exchange,
                dead_letter_routing_key,
                repl,
                limits,
                delivery_limit,
                ttl: None,
                counters: Counters::default(),
                stages: Default::default(),
                env,
            })
        });
        let weak = Rc::downgrade(&q);
        if expiry.is_some() {
            crate::core::spawn_soon(expiry::expire_when_unused(weak.clone()));
        }
        crate::core::spawn_soon(dispatch::dispatcher(weak, wake_rx));
        let message_ttl = int_arg(&args, "x-message-ttl").and_then(|v| u64::try_from(v).ok());
        if let Some(ms) = message_ttl {
            // `ttl.rs`, rule 3: the timer looks at the head at once (what expired while the
            // broker was down goes now).
            q.borrow_mut().ttl_mut().queue_ttl = Some(ms);
        } else if !q.borrow().ready.is_empty() {
            // A head with a per-message TTL from an earlier run starts the timer too.
            crate::core::spawn_soon(ttl::start_if_head_expires(Rc::downgrade(&q)));
        }
        // `limits.rs`, behaviour 2, at open (RabbitMQ's `init_max_length`): deliveries of an
        // earlier run that came back ready may have taken the queue over its limit.
        if limits.is_some() {
            q.borrow_mut().drop_head();
        }
        q
    }

    /// A replicated queue's replication state (`None` for a queue of one node).
    pub(super) fn repl_mut(&mut self) -> Option<&mut Replication> {
        self.repl.as_mut()
    }

    /// Messages ready for delivery.
    pub fn message_count(&self) -> u32 {
        self.ready.len() as u32
    }

    /// Outstanding (delivered, unsettled) messages.
    pub fn unacked_count(&self) -> usize {
        self.held.len()
    }

    /// The queue's figures for the management API ([`QueueOp::Info`]); with `with_unacked`,
    /// every outstanding delivery too, oldest first. Touches nothing (no lease renewal).
    fn info(&self, with_unacked: bool) -> super::QueueInfo {
        let consumers = self
            .consumers
            .iter()
            .map(|c| super::ConsumerInfo {
                tag: c.spec.tag.clone(),
                conn: c.spec.conn,
                channel: c.spec.channel,
                no_ack: c.spec.no_ack,
                exclusive: c.spec.exclusive,
                prefetch: c.spec.prefetch,
                priority: c.spec.priority,
            })
            .collect();
        let unacked = if with_unacked { self.held.listing(|id| self.consumers.get(id).map(|c| c.spec.tag.clone())) } else { Vec::new() };
        super::QueueInfo {
            messages_ready: u64::from(self.message_count()),
            messages_unacked: self.held.len() as u64,
            consumers,
            counters: self.counters,
            stages: self.stages.counts(),
            unacked,
        }
    }

    fn wake(&self) {
        if !self.wake_pending.replace(true) {
            let _ = self.wake.try_send(());
        }
        if let Some(t) = &self.ttl {
            t.notify();
        }
    }

    /// A use that renews an x-expires lease (basic.get, queue.declare; `expiry.rs` rule 1).
    fn renew_lease(&mut self) {
        if let Some(e) = &mut self.expiry {
            e.used = Instant::now();
        }
    }

    /// A publish from a connection of this core (`Node::publish_from_connection`): as
    /// `QueueOp::Publish`, but its credit is taken from the connection's pool only if the
    /// queue keeps it ([`Queue::hold_credit`]), which it rarely does.
    pub fn publish_local(
        cell: &QueueCell,
        message: Message,
        confirm: Option<ConfirmTo>,
        published: Option<Instant>,
        credit: impl FnOnce() -> Option<std::sync::Arc<crate::broker::credit::CreditHeld>>,
    ) {
        let mut q = cell.borrow_mut();
        q.used = true;
        q.take_publish(cell, message, confirm, published, credit);
    }

    fn take_publish(
        &mut self,
        cell: &QueueCell,
        message: Message,
        confirm: Option<ConfirmTo>,
        published: Option<Instant>,
        credit: impl FnOnce() -> Option<std::sync::Arc<crate::broker::credit::CreditHeld>>,
    ) {
        self.counters.published += 1;
        self.publish(cell, message, confirm, published);
        // The message is taken (stored, proposed or refused): its connection may send more,
        // unless the store's writer is behind or its consumers are (egress).
        self.hold_credit(cell, credit);
    }

    /// Executes one operation. Called by the owner core in arrival order.
    pub fn handle(cell: &QueueCell, op: QueueOp) {
        let mut q = cell.borrow_mut();
        q.used |= !matches!(op, QueueOp::Info { .. });
        match op {
            QueueOp::Publish { message, confirm, published, credit } => q.take_publish(cell, message, confirm, published, || credit),
            QueueOp::Get { no_ack, holder, reply } => {
                q.renew_lease();
                drop(q);
                dispatch::basic_get(cell, no_ack, holder, reply);
            }
            QueueOp::Consume { consumer, reply } => {
                if q.consumers.has_exclusive() || (consumer.exclusive && !q.consumers.is_empty()) {
                    let _ = reply.send(Err(QueueError::AccessRefused(format!(
                        "queue '{}' in vhost '{}' in exclusive use",
                        q.qref.key.name, q.qref.key.vhost
                    ))));
                    return;
                }
                if consumer.send_consume_ok {
                    let _ = consumer.tx.send(ClientEvent::ConsumeOk { channel: consumer.channel, consumer_tag: consumer.tag.clone() });
                }
                q.had_consumer = true;
                q.consumers.add(consumer);
                let _ = reply.send(Ok(()));
                q.wake();
            }
            QueueOp::Cancel { consumer, ok } => {
                // Answered whether or not the consumer is here (a failover or a reopen may
                // have dropped it): a client's close waits for it.
                q.consumers.remove(consumer);
                if let Some(ok) = ok {
                    ok.answer();
                }
                q.maybe_auto_delete();
            }
            QueueOp::Settle { chan_uid, ack, requeue, reject } => {
                drop(q);
                Queue::settle(cell, chan_uid, &ack, &requeue, &reject);
            }
            QueueOp::ChannelClosed { chan_uid } => q.channel_closed(chan_uid),
            QueueOp::Redeliver { offsets } => q.redeliver(&offsets),
            QueueOp::Wake => q.wake(),
            QueueOp::Replicated(op) => {
                drop(q);
                Queue::apply_replicated(cell, op);
            }
            QueueOp::Stats { reply } => {
                // queue.declare, active or passive, renews an x-expires lease (RabbitMQ's `stat`).
                q.renew_lease();
                q.expire_head();
                let _ = reply.send(Ok((q.message_count(), q.consumers.len() as u32)));
            }
            QueueOp::Info { with_unacked, reply } => drop(reply.send(q.info(with_unacked))),
            QueueOp::Purge { reply } => {
                let n = q.purge();
                let _ = reply.send(Ok(n));
            }
            QueueOp::Delete { reply, .. } => {
                // Deletion is carried out by the core (it owns the registry); reaching here
                // means the core already tore the queue down.
                let _ = reply.send(Err(QueueError::NotFound(format!("no queue '{}'", q.qref.key.name))));
            }
        }
    }

    fn publish(&mut self, cell: &QueueCell, mut message: Message, mut confirm: Option<ConfirmTo>, published: Option<Instant>) {
        if confirm.is_some() && crate::core::failpoint::unanswered_queue(&self.qref.key.name) {
            confirm = None;
        }
        if self.ttl.is_some() {
            // `ttl.rs`, rule 1: the deadline is fixed before the message is stored or proposed.
            message = self.stamp_deadline(message);
        }
        // The one branch a queue without length limits pays (`limits.rs`).
        if self.limits.is_none() {
            return self.store_published(cell, message, confirm, published);
        }
        if self.refuse_over_limit(&message, confirm.as_ref()) {
            return;
        }
        let replicated = self.repl.is_some();
        self.store_published(cell, message, confirm, published);
        if !replicated {
            // A replicated queue drops when it applies the `Enqueue` (`replica.rs`).
            self.drop_head();
        }
    }

    /// Appends a published message (or proposes it, for a replicated queue) and answers or
    /// queues its confirm.
    fn store_published(&mut self, cell: &QueueCell, message: Message, confirm: Option<ConfirmTo>, published: Option<Instant>) {
        if self.repl.is_some() {
            return self.propose_enqueue(cell, message, confirm, published);
        }
        let needs_sync = self.qref.durable && message.persistent();
        let deadline = message.deadline();
        let (level, body_len) = (self.ready.level_of(&message.header), message.body.len());
        match self.shard.append_owned(message.flags, message.header, message.body) {
            Ok(offset) => {
                let now = published.map(|_| Instant::now());
                self.ready.push_leveled(offset, level, body_len, now);
                if let (Some(p), Some(n)) = (published, now) {
                    self.stage(Stage::PublishToEnqueued, n.duration_since(p));
                }
                if needs_sync {
                    // Stored once synced: with its confirm, or alone (`durability.rs`).
                    match (confirm, published) {
                        (Some(c), _) => self.pending_confirms.push((c, published)),
                        (None, Some(p)) => self.stored_samples.push(p),
                        (None, None) => {}
                    }
                    self.dirty = true;
                    self.start_sync(cell);
                } else if let Some(c) = confirm {
                    c.answer(true);
                }
                self.wake();
                if let Some(d) = deadline {
                    self.enqueued_with_deadline(offset, d);
                }
            }
            Err(e) => {
                if e.is_disk_full() {
                    self.env.disk_full();
                }
                if once_a_second(&REFUSAL_LOGGED) {
                    tracing::warn!(queue = %self.qref.key.name, error = %e, "publish not stored (nacked)");
                }
                crate::observe::Stats::add(&self.env.stats().store_refused, 1);
                if let Some(c) = confirm {
                    c.answer(false);
                }
            }
        }
    }

    /// queue.purge: deletes every ready message (outstanding ones stay); returns how many.
    fn purge(&mut self) -> u32 {
        let n = self.message_count();
        self.paged.clear();
        let offs = self.ready.drain();
        self.delete(&offs);
        n
    }

    /// Whether the queue may be deleted under queue.delete's conditions.
    ///
    /// # Errors
    /// 406 PRECONDITION_FAILED when `if_unused` and it has consumers, or `if_empty` and it
    /// has ready messages (spec 1.7.2.9).
    pub fn check_delete(&self, if_unused: bool, if_empty: bool) -> Result<u32, QueueError> {
        if if_unused && !self.consumers.is_empty() {
            return Err(QueueError::PreconditionFailed(format!(
                "queue '{}' in vhost '{}' in use",
                self.qref.key.name, self.qref.key.vhost
            )));
        }
        if if_empty && self.message_count() > 0 {
            return Err(QueueError::PreconditionFailed(format!(
                "queue '{}' in vhost '{}' not empty",
                self.qref.key.name, self.qref.key.vhost
            )));
        }
        Ok(self.message_count())
    }

    /// Marks the queue deleted and tells every consumer (basic.cancel for clients that
    /// announced consumer_cancel_notify). Returns the shards (messages, unacked index) for
    /// the caller to destroy.
    pub fn tear_down(&mut self) -> (Rc<Shard>, Option<Rc<Shard>>) {
        let (shards, cancels) = self.tear_down_quietly();
        cancels.into_iter().for_each(CancelNotice::send);
        shards
    }

    /// [`Queue::tear_down`], the basic.cancel notices left for the caller to send: queue.delete
    /// sends them once the delete is committed, right before its delete-ok, so a client that
    /// deletes a queue it consumes from sees the cancel and the delete-ok together (amqplib's
    /// "cancelled consumer" test closes the channel on the cancel, and RabbitMQ's delete-ok
    /// is there by then).
    pub fn tear_down_quietly(&mut self) -> (Shards, Vec<CancelNotice>) {
        // RabbitMQ confirms what was routed to a queue deleted meanwhile.
        self.out_of_service(true)
    }

    /// Marks the queue deleted, drops its consumers (returning the basic.cancel owed to those
    /// that announced consumer_cancel_notify), answers waiting confirms with `ok`, wakes its
    /// tasks (they stop); returns its shards.
    fn out_of_service(&mut self, confirms_ok: bool) -> (Shards, Vec<CancelNotice>) {
        self.deleted = true;
        let mut cancels = Vec::new();
        for c in self.consumers.drain() {
            if c.spec.cancel_notify {
                let event = ClientEvent::Cancelled { channel: c.spec.channel, consumer_tag: c.spec.tag.clone() };
                cancels.push(CancelNotice { tx: c.spec.tx.clone(), event });
            }
        }
        for (c, _) in self.pending_confirms.drain(..) {
            c.answer(confirms_ok);
        }
        if let Some(r) = &mut self.repl {
            r.refuse_waiting();
        }
        self.wake();
        ((self.shard.clone(), self.index.clone()), cancels)
    }

    /// Why this queue's store stopped taking writes, if it did (a write or fdatasync of its
    /// message shard or unacked index failed, e.g. EIO or a full disk that fallocate did
    /// not see coming). Its publishes are nacked meanwhile; reads, deliveries and acks go
    /// on. The core retires such a queue and reopens it from disk once the disk alarm is
    /// clear ([`Queue::retire`]).
    pub fn store_failure(&self) -> Option<String> {
        self.shard.failure().or_else(|| self.index.as_ref().and_then(|i| i.failure()))
    }

    /// Takes a queue whose store failed out of service, to be reopened from disk: consumers
    /// are cancelled (basic.cancel to clients that announced consumer_cancel_notify), waiting
    /// confirms are nacked, tasks stop. What the store synced comes back at the reopen; the
    /// deliveries outstanding now come back redelivered (rules 5 and 7). Returns the shards
    /// for the caller to close.
    pub fn retire(&mut self) -> (Rc<Shard>, Option<Rc<Shard>>) {
        let (shards, cancels) = self.out_of_service(false);
        cancels.into_iter().for_each(CancelNotice::send);
        shards
    }

    fn maybe_auto_delete(&self) {
        if self.def.auto_delete && self.had_consumer && self.consumers.is_empty() && !self.deleted {
            self.env.auto_delete(&self.qref.key);
        }
    }
}
