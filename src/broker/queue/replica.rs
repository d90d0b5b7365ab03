//! A replicated queue: a durable queue of a cluster, whose messages and settlements go
//! through the metadata group's Raft log (`meta::data`) and are stored by every member of its
//! replica set (`QueueDef::replicas`, chosen at declare; empty: every node).
//!
//! # Roles
//! Every member of the set holds the queue (its shard, its ready set) on the queue's core;
//! other nodes skip its data. One member *serves* it: the one its metadata names
//! (`owner_node`). Clients reach only that one (`Node::queue_op` forwards there); the other
//! members only apply what the log brings.
//!
//! # Steps (DESIGN.md rule 9 in a cluster; `meta::data` invariants 1–2)
//! 1. A publish is proposed as `Enqueue`, batched per queue. One task hands the batches to
//!    the metadata driver, in publish order, so offsets follow it; up to
//!    [`MAX_BATCHES_IN_FLIGHT`] batches wait for their commit at once, so a publish that
//!    arrives during a commit is proposed at once instead of waiting for it. The publisher's
//!    confirm waits for the outcome: the entry is then fdatasync'ed in the log of a
//!    majority. Nothing is appended before. A batch that fails (no quorum in time) is nacked
//!    while a later one may be confirmed: the confirmed messages keep their order.
//! 2. Every member, the serving one included, appends the message when it applies the entry
//!    ([`Queue::apply_replicated`]), at the offset the state machine gave it; an offset its
//!    shard already holds (a replay after a restart) is skipped.
//! 3. The serving member deletes settled messages from its shard at once (rule 4) and
//!    proposes the offsets as `Settle`; every member deletes them when it applies it (the
//!    serving one finds them deleted already). A settle that is lost (no quorum) leaves the
//!    message on the other members: after a failover it comes again, redelivered — a
//!    duplicate, never a loss.
//! 4. A member that knows no metadata leader (a minority side, an election) delivers
//!    nothing: the majority may move the queue meanwhile.
//! 5. Deliveries are as for any durable queue (the cursor is committed after them, at most
//!    every 20 ms) but for the unacked index, which a replicated queue does not keep: the
//!    serving member hands out a message only below its *reservation*, an offset
//!    the log stored for it ([`Command::Reserve`], `meta::data` invariant 5). The
//!    reservation runs [`Replication::ahead`] offsets past the deliveries and is renewed
//!    when half of that is used, one proposal in flight, so deliveries wait for it only
//!    when the renewal is slower than the consumers (then the next reaches twice as far).
//!    When the queue moves, the cursor rises to the old server's reservation, capped at
//!    the queue's tail, and the new server flags what lies below it: every message a dead
//!    server handed out comes again redelivered=true, with at most `ahead` flags too many.
//!    (Committing the cursor before each delivery batch, in series, was measured to make
//!    the 3-node bench's consumer fall behind its publisher: 17.9-19.8k vs 22.1k msgs/s.)
//!    A `Moved` op (the log's move, in log order) stops the old server's deliveries before
//!    it applies anything enqueued after the move. The reservation also stands in for the
//!    unacked index: a server that restarts flags what lies below it too (a delivery waits
//!    for no index fdatasync: measured, e2e p50 3.6-4.2 → 2.4 ms and 15% less CPU per
//!    message in the 3-node bench), at the price of up to `ahead` stored messages flagged
//!    that were never handed out, as at a failover (capped at the queue's tail when the copy
//!    opens: what is published later is never flagged).
//! 6. Shards are synced lazily (the 1 s tick, and before the log is compacted): the Raft
//!    log is what a confirm rests on.

use std::rc::{Rc, Weak};
use std::time::Instant;

use super::{once_a_second, Queue, QueueCell, QueueEnv, REFUSAL_LOGGED};
use crate::broker::message::Message;
use crate::broker::{ConfirmTo, GetReply, Holder, QueueError, Reply};
use crate::meta::data::DataOp;
use crate::meta::state::{Command, Outcome};
use crate::observe::Stage;

thread_local! {
    static SETTLE_FAILURE_LOGGED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    static RESERVE_FAILURE_LOGGED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    static TOO_LARGE_LOGGED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// True when `def` is replicated in a cluster: durable and not exclusive (an exclusive
/// queue dies with its connection, so with its node).
pub fn is_replicated(def: &crate::meta::state::QueueDef, cluster: bool) -> bool {
    cluster && def.survives_restart()
}

/// Most messages proposed in one batch.
const MAX_BATCH: usize = 4096;

/// Most `Enqueue` batches of one queue waiting for their commit at once (step 1).
pub const MAX_BATCHES_IN_FLIGHT: usize = 4;

/// Most bytes of publishes (bodies, headers and [`crate::broker::credit::OP_WEIGHT`] each) a
/// replicated queue keeps waiting to be proposed or committed before it holds its
/// publishers' credit (`durability.rs`, `Queue::hold_credit`): a group that commits slower
/// than they publish (a slow follower, a lost majority) slows them instead of filling memory.
pub const MAX_REPLICATION_BACKLOG: u64 = 16 << 20;

/// Most bytes of publishes ([`backlog_weight`] each, at least one publish) in one `Enqueue`
/// batch: a batch is one proposal, and the metadata driver never splits a proposal across
/// entries, so this bounds the entry (as its own `MAX_ENTRY_BYTES` bounds a merged one).
/// Without it a flood of 1 MiB messages made 4,096-message entries, Raft messages of 174 MB
/// to 1.4 GB that the transport refuses (64 MiB frames): replication stopped and the leader
/// was lost.
const MAX_BATCH_BYTES: u64 = crate::meta::driver::MAX_ENTRY_BYTES as u64;

/// Largest message (header and body, bytes) a replicated queue takes: its `Enqueue` must fit
/// a Raft message of the cluster transport ([`crate::cluster::frame::MAX_FRAME_BYTES`]) with
/// room to spare. A larger one is refused (nacked), never proposed: an entry no frame can
/// carry would stop the metadata group's replication.
pub const MAX_REPLICATED_MESSAGE: usize = crate::cluster::frame::MAX_FRAME_BYTES / 2;

/// What one waiting publish (an `Enqueue`; 0 for another command) weighs in
/// [`MAX_REPLICATION_BACKLOG`] and [`MAX_BATCH_BYTES`], bytes.
fn backlog_weight(cmd: &Command) -> u64 {
    match cmd {
        Command::Enqueue { header, body, .. } => (header.len() + body.len() + crate::broker::credit::OP_WEIGHT) as u64,
        _ => 0,
    }
}

/// Shortest reach of a delivery reservation past the deliveries (offsets; step 5): at most
/// this many undelivered messages come flagged redelivered=true after a failover at low rates.
pub const MIN_RESERVE_AHEAD: u64 = 256;
/// Longest reach of a delivery reservation (offsets).
pub const MAX_RESERVE_AHEAD: u64 = 1 << 16;
/// A renewal this long after the previous one halves the reach (down to the minimum).
const RESERVE_DECAY: std::time::Duration = std::time::Duration::from_secs(1);

/// A basic.get waiting for a reservation: (no_ack, holder, reply).
type ParkedGet = (bool, Holder, Reply<Result<Option<GetReply>, QueueError>>);

/// A replicated queue's replication state (`None` on [`Queue::repl`] otherwise).
#[derive(Default)]
pub struct Replication {
    /// This member serves the queue (its metadata names this node).
    pub serving: bool,
    /// Publishes waiting to be proposed: (command, confirm ticket, publish time).
    enqueues: Vec<(Command, Option<ConfirmTo>, Option<Instant>)>,
    /// The task handing batches to the driver runs.
    enqueuing: bool,
    /// `Enqueue` batches taken from `enqueues` whose outcome is not known yet.
    batches_in_flight: usize,
    /// Offsets settled here, waiting to be proposed.
    settles: Vec<u64>,
    /// Return counts (offset, count) waiting to be proposed (`delivery_limit.rs`,
    /// behaviour 5); they go with the settles, by the same task.
    returns: Vec<(u64, u32)>,
    settling: bool,
    /// Step 5: messages below this offset may be handed out (this node's reservation, as
    /// the log applied it here).
    reserved: u64,
    /// The reservation (or the cursor, if higher) when this copy opened, capped at the tail
    /// then: a message the log replays below it may have been handed out by an earlier
    /// server (this node before a crash included) and is flagged redelivered.
    delivered_below: u64,
    /// How far a new reservation reaches past the deliveries (offsets, between
    /// [`MIN_RESERVE_AHEAD`] and [`MAX_RESERVE_AHEAD`]).
    pub ahead: u64,
    /// A `Reserve` proposal is in flight.
    reserving: bool,
    /// Deliveries waited for the reservation in flight (its reach doubled once).
    stalled: bool,
    /// When the last renewal was proposed.
    last_reserve: Option<Instant>,
    /// basic.get requests waiting for a reservation.
    gets: Vec<ParkedGet>,
    /// The log moved the queue to another node: nothing more is handed out here.
    pub(super) moved_away: bool,
    /// A copier holds the enqueuer (`copy.rs`, server step 2): publishes wait.
    holding: bool,
    /// Growing the replica set (`copy.rs`): the copier here, or the receiving end's state.
    pub(super) grow: super::copy::GrowState,
    /// Messages (and their body bytes) a length limit admitted (`limits.rs`) whose `Enqueue`
    /// this member has not applied yet, nor seen fail: they count toward the limit.
    unapplied: (u64, u64),
    /// Bytes of the publishes waiting to be proposed or committed ([`backlog_weight`] each).
    backlog: u64,
    /// Told once the backlog is back under [`MAX_REPLICATION_BACKLOG`] (the task holding
    /// publishers' credit, `durability.rs`).
    drained: Option<flume::Sender<()>>,
}

impl Replication {
    /// The state of a replicated queue this member serves (`serving`) or only stores;
    /// `reserved`: its reservation in the metadata, or its cursor if higher; `delivered_below`:
    /// what an earlier server may have handed out lies below it (the reservation, capped at
    /// the queue's tail when it opened; queue offsets).
    pub fn new(serving: bool, reserved: u64, delivered_below: u64) -> Replication {
        Replication { serving, reserved, delivered_below, ahead: MIN_RESERVE_AHEAD, ..Default::default() }
    }

    /// Publishes accepted but not yet proposed: answered "not stored" when the queue goes
    /// out of service here (the publisher sends them again); waiting basic.gets are
    /// answered empty.
    pub(super) fn refuse_waiting(&mut self) {
        for (cmd, c, _) in self.enqueues.drain(..) {
            self.backlog = self.backlog.saturating_sub(backlog_weight(&cmd));
            if let Some(c) = c {
                c.answer(false);
            }
        }
        self.backlog_shrank();
        self.answer_gets_empty();
    }

    /// True while more than [`MAX_REPLICATION_BACKLOG`] bytes of publishes wait to be
    /// proposed or committed.
    pub(super) fn backlogged(&self) -> bool {
        self.backlog > MAX_REPLICATION_BACKLOG
    }

    /// A receiver told once the backlog is back under [`MAX_REPLICATION_BACKLOG`] (or the
    /// queue's replication state goes: the channel closes).
    pub(super) fn when_drained(&mut self) -> flume::Receiver<()> {
        let (tx, rx) = flume::bounded(1);
        self.drained = Some(tx);
        rx
    }

    fn backlog_shrank(&mut self) {
        if !self.backlogged() {
            if let Some(tx) = self.drained.take() {
                let _ = tx.try_send(());
            }
        }
    }

    /// Holds (or lets go) the enqueuer: while held, publishes wait and no new `Enqueue`
    /// batch is proposed (`copy.rs`, server step 2).
    pub(super) fn hold_enqueues(&mut self, hold: bool) {
        self.holding = hold;
    }

    /// True while an `Enqueue` batch of this queue is being proposed.
    pub(super) fn enqueue_in_flight(&self) -> bool {
        self.batches_in_flight > 0
    }

    /// Starts the task that proposes the waiting publishes (step 1) unless it runs, the
    /// enqueuer is held, or [`MAX_BATCHES_IN_FLIGHT`] batches wait already.
    fn kick_enqueuer(&mut self, cell: Weak<std::cell::RefCell<Queue>>) {
        if !self.enqueuing && !self.holding && !self.enqueues.is_empty() && self.batches_in_flight < MAX_BATCHES_IN_FLIGHT {
            self.enqueuing = true;
            crate::core::spawn_soon(enqueuer(cell));
        }
    }

    /// Messages and body bytes admitted under a length limit and not applied yet.
    pub(super) fn unapplied(&self) -> (u64, u64) {
        self.unapplied
    }

    /// A length limit admitted a message of `body_len` bytes (applied or failed later).
    pub(super) fn admitted(&mut self, body_len: u64) {
        self.unapplied.0 += 1;
        self.unapplied.1 += body_len;
    }

    /// An admitted message was applied here, or its `Enqueue` failed. Saturating: a member
    /// that took over the queue applies what an earlier server admitted.
    fn settled_admission(&mut self, body_len: u64) {
        self.unapplied.0 = self.unapplied.0.saturating_sub(1);
        self.unapplied.1 = self.unapplied.1.saturating_sub(body_len);
    }

    fn answer_gets_empty(&mut self) {
        for (_, _, reply) in self.gets.drain(..) {
            let _ = reply.send(Ok(None));
        }
    }
}

impl Queue {
    /// Step 1: queues `message` for the next `Enqueue` batch of this queue.
    pub(super) fn propose_enqueue(&mut self, cell: &QueueCell, message: Message, confirm: Option<ConfirmTo>, published: Option<Instant>) {
        let counted = self.limits.is_some_and(|l| l.rejects_publish());
        let name = self.qref.key.name.clone();
        let Some(repl) = &mut self.repl else { return };
        let size = message.header.len() + message.body.len();
        if size > MAX_REPLICATED_MESSAGE {
            if once_a_second(&TOO_LARGE_LOGGED) {
                tracing::warn!(queue = %name, bytes = size, limit = MAX_REPLICATED_MESSAGE, "message too large for a replicated queue: refused (nacked)");
            }
            if counted {
                repl.settled_admission(message.body.len() as u64);
            }
            if let Some(c) = confirm {
                c.answer(false);
            }
            return;
        }
        let cmd = Command::Enqueue {
            vhost: self.qref.key.vhost.to_string(),
            queue: self.qref.key.name.to_string(),
            flags: message.flags,
            header: message.header,
            body: message.body,
        };
        repl.backlog += backlog_weight(&cmd);
        repl.enqueues.push((cmd, confirm, published));
        repl.kick_enqueuer(Rc::downgrade(cell));
    }

    /// Step 3: proposes the offsets this serving member deleted.
    pub(super) fn propose_settle(&mut self, offsets: &[u64]) {
        let me = self.me.clone();
        let Some(repl) = &mut self.repl else { return };
        if !repl.serving || offsets.is_empty() {
            return;
        }
        match repl.grow.settles_held_from {
            // A copy batch that may name them is being read or committed (`copy.rs`, server
            // step 1): their settle goes after it in the log.
            Some(from) => {
                let (later, now): (Vec<u64>, Vec<u64>) = offsets.iter().partition(|o| **o >= from);
                repl.grow.held_settles.extend(later);
                repl.settles.extend(now);
            }
            None => repl.settles.extend_from_slice(offsets),
        }
        if !repl.settling && !repl.settles.is_empty() {
            repl.settling = true;
            crate::core::spawn_soon(settler(me));
        }
    }

    /// Proposes a return count of this serving member (`delivery_limit.rs`, behaviour 5),
    /// with the next settles.
    pub(super) fn propose_return(&mut self, offset: u64, count: u32) {
        let me = self.me.clone();
        let Some(repl) = self.repl.as_mut().filter(|r| r.serving) else { return };
        repl.returns.push((offset, count));
        if !repl.settling {
            repl.settling = true;
            crate::core::spawn_soon(settler(me));
        }
    }

    /// Step 2: applies what the log brought, in log order.
    pub fn apply_replicated(cell: &QueueCell, op: DataOp) {
        let mut q = cell.borrow_mut();
        match op {
            DataOp::Enqueue { offset, flags, header, body, .. } => {
                let next = q.shard.next_offset();
                if offset < next {
                    return;
                }
                if offset > next {
                    q.leave_replica_set(&format!("it lacks messages {next}..{offset} of the queue"));
                    return;
                }
                if q.limits.is_some_and(|l| l.rejects_publish()) {
                    if let Some(r) = q.repl.as_mut().filter(|r| r.serving) {
                        r.settled_admission(body.len() as u64);
                    }
                }
                match q.shard.append_shared(flags, &header, &body) {
                    Ok(at) if at == offset => {
                        q.ready.push_message(at, &header, body.len(), None);
                        let below = q.repl.as_ref().map_or(0, |r| r.delivered_below);
                        if at < q.cursor.committed.max(below) {
                            // Stored again by a replay (this copy's shard had lost its unsynced
                            // tail): handed out before, as the cursor or the reservation says.
                            q.ready.mark_redelivered(at);
                        }
                        q.dirty = true;
                        if q.limits.is_some() {
                            // `limits.rs`, behaviour 5: the serving member drops, through `Settle`.
                            q.drop_head();
                        }
                        q.wake();
                        if let Some(d) = crate::broker::message::deadline_of(flags, &header) {
                            // `ttl.rs`: the deadline the serving member fixed, in the record.
                            q.enqueued_with_deadline(at, d);
                        }
                    }
                    Ok(at) => {
                        tracing::error!(queue = %q.qref.key.name, offset, at, "replica stored a message at another offset");
                        q.ready.push_message(at, &header, body.len(), None);
                    }
                    Err(e) => {
                        if e.is_disk_full() {
                            q.env.disk_full();
                        }
                        q.leave_replica_set(&format!("the store could not take message {offset}: {e}"));
                    }
                }
            }
            DataOp::Settle { offsets, .. } => {
                q.tombstone_unreached(&offsets);
                let live: Vec<u64> = offsets.into_iter().filter(|o| q.shard.is_live(*o)).collect();
                // Held here (a delivery of this member) or not, the log says it is settled.
                for off in &live {
                    if let Some(o) = q.held.release(*off) {
                        q.release(&o);
                    }
                }
                q.delete_local(&live);
                q.wake();
            }
            DataOp::Returned { counts, .. } => q.apply_returned(&counts),
            DataOp::Moved { to, .. } => {
                let me = q.env.meta().node_id();
                if let Some(repl) = q.repl.as_mut().filter(|r| r.serving) {
                    // In log order: nothing applied after the move is handed out here.
                    repl.moved_away = to != me;
                    if repl.moved_away {
                        repl.answer_gets_empty();
                    }
                }
            }
            DataOp::Copy { from, to, messages, .. } => q.apply_copy(from, to, messages),
            DataOp::Joined { tail, .. } => q.apply_joined(tail),
            // Carried out by the core (it owns the registry).
            DataOp::Dropped { .. } => {}
        }
    }

    /// Step 5: true when the next ready message may not be handed out now: a replicated
    /// queue's, on a node that does not serve it or past its reservation. Renews the
    /// reservation when half of its reach is used or the message is past it. Always false
    /// for a queue that is not replicated.
    pub(super) fn held_back(&mut self) -> bool {
        let Some(offset) = self.ready.peek_next() else { return false };
        let me = self.me.clone();
        let Some(repl) = &mut self.repl else { return false };
        if !repl.serving || repl.moved_away {
            return true;
        }
        let past = offset >= repl.reserved;
        if past && repl.reserving && !repl.stalled {
            // The renewal was slower than the consumers: reach further next time.
            repl.stalled = true;
            repl.ahead = (repl.ahead * 2).min(MAX_RESERVE_AHEAD);
        }
        if !repl.reserving && (past || offset + repl.ahead / 2 >= repl.reserved) {
            repl.reserving = true;
            crate::core::spawn_soon(reserver(me));
        }
        past
    }

    /// A basic.get whose message lies past the reservation waits for the next one (or is
    /// answered empty at once where this node cannot hand anything out).
    pub(super) fn park_get(&mut self, get: ParkedGet) {
        match &mut self.repl {
            Some(repl) if repl.serving && !repl.moved_away => repl.gets.push(get),
            _ => drop(get.2.send(Ok(None))),
        }
    }

    /// True when this member serves the queue (always, for a queue that is not replicated).
    pub fn serving(&self) -> bool {
        self.repl.as_ref().is_none_or(|r| r.serving)
    }

    /// False while a replicated queue's member knows no metadata leader (it is on the
    /// minority side of a partition, or the group is electing): it delivers nothing then,
    /// since the majority may move the queue to another member meanwhile (failover step 3).
    pub(super) fn may_deliver(&self) -> bool {
        self.repl.is_none() || self.env.meta().leader_id().is_some()
    }

    /// True for a replicated queue.
    pub fn replicated(&self) -> bool {
        self.repl.is_some()
    }
}

/// Holds (`Some(from)`: of offsets `from` and up) or lets go (`None`) the settles of the
/// serving member, and proposes those that waited when let go (`copy.rs`, server step 1).
pub(super) fn hold_settles(cell: &QueueCell, from: Option<u64>) {
    let me = Rc::downgrade(cell);
    let mut q = cell.borrow_mut();
    let Some(repl) = &mut q.repl else { return };
    repl.grow.settles_held_from = from;
    if from.is_some() {
        return;
    }
    let held = std::mem::take(&mut repl.grow.held_settles);
    repl.settles.extend(held);
    if !repl.settling && !repl.settles.is_empty() {
        repl.settling = true;
        crate::core::spawn_soon(settler(me));
    }
}

/// Lets the enqueuer go after a copier held it, and proposes what waited meanwhile.
pub(super) fn resume_enqueues(cell: &QueueCell) {
    let mut q = cell.borrow_mut();
    let Some(repl) = &mut q.repl else { return };
    repl.holding = false;
    repl.kick_enqueuer(Rc::downgrade(cell));
}

/// Hands the queue's waiting publishes to the metadata driver in batches, in publish order,
/// while fewer than [`MAX_BATCHES_IN_FLIGHT`] wait for their commit (step 1); each batch's
/// outcome is awaited by a task of its own ([`answer_batch`]).
async fn enqueuer(weak: Weak<std::cell::RefCell<Queue>>) {
    loop {
        let Some(cell) = weak.upgrade() else { return };
        let (batch, meta, env) = {
            let mut q = cell.borrow_mut();
            let env = q.env.clone();
            let Some(repl) = &mut q.repl else { return };
            if repl.enqueues.is_empty() || repl.holding || repl.batches_in_flight >= MAX_BATCHES_IN_FLIGHT {
                repl.enqueuing = false;
                return;
            }
            let mut bytes = 0;
            let n = repl
                .enqueues
                .iter()
                .take(MAX_BATCH)
                .take_while(|(c, _, _)| {
                    let first = bytes == 0;
                    bytes += backlog_weight(c);
                    first || bytes <= MAX_BATCH_BYTES
                })
                .count();
            let batch: Vec<_> = repl.enqueues.drain(..n).collect();
            repl.batches_in_flight += 1;
            (batch, env.meta().clone(), env)
        };
        drop(cell);
        let (cmds, tickets): (Vec<Command>, Vec<_>) = batch
            .into_iter()
            .map(|(c, t, p)| {
                let len = match &c {
                    Command::Enqueue { body, .. } => body.len() as u64,
                    _ => 0,
                };
                let weight = backlog_weight(&c);
                (c, (t, p, len, weight))
            })
            .unzip();
        // Only this task submits, and it awaits each submission: batches reach the driver in order.
        let submitted = meta.submit_batch(cmds).await;
        crate::core::spawn_soon(answer_batch(weak.clone(), env, submitted, tickets));
    }
}

/// Answers one `Enqueue` batch's confirms with its outcome (a queue deleted meanwhile
/// confirms: RabbitMQ's reading), then lets the enqueuer propose what waited. `tickets`:
/// (confirm, publish time, body bytes, [`backlog_weight`]) per message.
async fn answer_batch(
    weak: Weak<std::cell::RefCell<Queue>>,
    env: Rc<dyn QueueEnv>,
    submitted: Result<crate::meta::Proposal, crate::meta::MetaError>,
    tickets: Vec<(Option<ConfirmTo>, Option<Instant>, u64, u64)>,
) {
    let weight: u64 = tickets.iter().map(|t| t.3).sum();
    let result = match submitted {
        Ok(p) => p.outcomes().await,
        Err(e) => Err(e),
    };
    let now = Instant::now();
    // Body bytes of the messages not enqueued (`limits.rs`: they no longer count).
    let mut failed = Vec::new();
    match result {
        Ok(outcomes) => {
            for ((ticket, published, len, _), o) in tickets.into_iter().zip(outcomes) {
                let ok = matches!(o, Outcome::Enqueued { .. } | Outcome::NotFound);
                if !ok {
                    failed.push(len);
                }
                // Committed and applied: ready and stored at once (step 1).
                if let Some(p) = published.filter(|_| ok) {
                    for stage in [Stage::PublishToEnqueued, Stage::PublishToStored] {
                        match weak.upgrade() {
                            Some(q) => q.borrow().stage(stage, now.duration_since(p)),
                            None => env.stats().stages.record(stage, now.duration_since(p)),
                        }
                    }
                }
                if let Some(c) = ticket {
                    c.answer(ok);
                }
            }
        }
        Err(e) => {
            if once_a_second(&REFUSAL_LOGGED) {
                tracing::warn!(error = %e, messages = tickets.len(), "replicated publish not committed (nacked)");
            }
            crate::observe::Stats::add(&env.stats().store_refused, tickets.len() as u64);
            for (ticket, _, len, _) in tickets {
                failed.push(len);
                if let Some(c) = ticket {
                    c.answer(false);
                }
            }
        }
    }
    let Some(cell) = weak.upgrade() else { return };
    let mut q = cell.borrow_mut();
    let counted = q.limits.is_some_and(|l| l.rejects_publish());
    if let Some(repl) = &mut q.repl {
        if counted {
            for len in failed {
                repl.settled_admission(len);
            }
        }
        repl.batches_in_flight = repl.batches_in_flight.saturating_sub(1);
        repl.backlog = repl.backlog.saturating_sub(weight);
        repl.backlog_shrank();
        repl.kick_enqueuer(weak.clone());
    }
}

/// Proposes the serving member's next reservation (step 5): `ahead` offsets past the last
/// delivery or the next ready offset, whichever is higher. Retried while the group cannot
/// commit it and consumers wait; then wakes the dispatcher and runs the waiting basic.gets.
async fn reserver(weak: Weak<std::cell::RefCell<Queue>>) {
    loop {
        let Some(cell) = weak.upgrade() else { return };
        let (cmd, meta) = {
            let mut q = cell.borrow_mut();
            let from = q.cursor.target.max(q.ready.peek_next().unwrap_or(0));
            let (vhost, queue) = (q.qref.key.vhost.to_string(), q.qref.key.name.to_string());
            let meta = q.env.meta().clone();
            let deleted = q.deleted;
            let Some(repl) = &mut q.repl else { return };
            if deleted || !repl.serving || repl.moved_away {
                repl.reserving = false;
                repl.answer_gets_empty();
                return;
            }
            let now = Instant::now();
            if repl.last_reserve.is_some_and(|t| now.duration_since(t) >= RESERVE_DECAY) {
                repl.ahead = (repl.ahead / 2).max(MIN_RESERVE_AHEAD);
            }
            repl.last_reserve = Some(now);
            (Command::Reserve { vhost, queue, node: meta.node_id(), until: from + repl.ahead }, meta)
        };
        drop(cell);
        let outcome = meta.propose(cmd).await;
        let Some(cell) = weak.upgrade() else { return };
        let gets = {
            let mut q = cell.borrow_mut();
            let idle = q.consumers.is_empty();
            let name = q.qref.key.name.clone();
            let Some(repl) = &mut q.repl else { return };
            let retry = match outcome {
                Ok(Outcome::Reserved { until }) => {
                    repl.reserved = repl.reserved.max(until);
                    false
                }
                // The log says another node serves the queue (or it is gone): hand out nothing.
                Ok(_) => {
                    repl.moved_away = true;
                    false
                }
                Err(e) => {
                    if once_a_second(&RESERVE_FAILURE_LOGGED) {
                        tracing::warn!(queue = %name, error = %e, "delivery reservation not committed; deliveries wait");
                    }
                    repl.answer_gets_empty();
                    !idle
                }
            };
            if retry {
                None
            } else {
                repl.reserving = false;
                repl.stalled = false;
                let gets = std::mem::take(&mut repl.gets);
                q.wake();
                Some(gets)
            }
        };
        let Some(gets) = gets else {
            drop(cell);
            glommio::timer::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        for (no_ack, holder, reply) in gets {
            super::dispatch::basic_get(&cell, no_ack, holder, reply);
        }
        return;
    }
}

/// Proposes the offsets the serving member settled (step 3), all waiting ones in one
/// command, and the return counts waiting (`delivery_limit.rs`) in another.
async fn settler(weak: Weak<std::cell::RefCell<Queue>>) {
    loop {
        let Some(cell) = weak.upgrade() else { return };
        let (settle, returns, meta) = {
            let mut q = cell.borrow_mut();
            let (vhost, queue) = (q.qref.key.vhost.to_string(), q.qref.key.name.to_string());
            let meta = q.env.meta().clone();
            let Some(repl) = &mut q.repl else { return };
            if repl.settles.is_empty() && repl.returns.is_empty() {
                repl.settling = false;
                return;
            }
            let offsets = std::mem::take(&mut repl.settles);
            let counts = std::mem::take(&mut repl.returns);
            let settle = (!offsets.is_empty()).then(|| Command::Settle { vhost: vhost.clone(), queue: queue.clone(), offsets });
            let returns = (!counts.is_empty()).then_some(Command::Return { vhost, queue, counts });
            (settle, returns, meta)
        };
        drop(cell);
        for cmd in [settle, returns].into_iter().flatten() {
            if let Err(e) = meta.propose(cmd).await {
                if once_a_second(&SETTLE_FAILURE_LOGGED) {
                    tracing::warn!(error = %e, "replicated settle or return count not committed; the other members keep those messages and counts");
                }
            }
        }
    }
}
