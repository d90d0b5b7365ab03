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
//! 1. A publish is proposed as `Enqueue`, batched per queue (one batch in flight at a time,
//!    so offsets follow the publish order). The publisher's confirm waits for the outcome:
//!    the entry is then fdatasync'ed in the log of a majority. Nothing is appended before.
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
//! 5. Deliveries are as for any durable queue: the unacked-index record is synced before a
//!    delivery leaves, the cursor is committed after, at most every 20 ms. A member that takes
//!    the queue over flags what lies below the committed cursor; what the dead member handed
//!    out in its last ≤ 20 ms comes again unflagged. (Committing the cursor before each
//!    delivery batch closes that window; measured A/B on the 3-node bench it made the
//!    consumer fall behind the publisher — 17.9-19.8k vs 22.1k msgs/s consumed, e2e p50
//!    2.4-4.1 s vs 5 ms — with one raft round per batch in series: it waits for a
//!    pipelined form.)
//! 6. Shards are synced lazily (the 1 s tick, and before the log is compacted): the Raft
//!    log is what a confirm rests on.

use std::rc::{Rc, Weak};
use std::time::Instant;

use super::{once_a_second, Queue, QueueCell, REFUSAL_LOGGED};
use crate::broker::message::Message;
use crate::broker::ConfirmTo;
use crate::meta::data::DataOp;
use crate::meta::state::{Command, Outcome};

thread_local! {
    static SETTLE_FAILURE_LOGGED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    static APPLY_FAILURE_LOGGED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// True when `def` is replicated in a cluster: durable and not exclusive (an exclusive
/// queue dies with its connection, so with its node).
pub fn is_replicated(def: &crate::meta::state::QueueDef, cluster: bool) -> bool {
    cluster && def.survives_restart()
}

/// Most messages proposed in one batch.
const MAX_BATCH: usize = 4096;

/// A replicated queue's replication state (`None` on [`Queue::repl`] otherwise).
#[derive(Default)]
pub struct Replication {
    /// This member serves the queue (its metadata names this node).
    pub serving: bool,
    /// Publishes waiting to be proposed: (command, confirm ticket, publish time).
    enqueues: Vec<(Command, Option<ConfirmTo>, Option<Instant>)>,
    enqueuing: bool,
    /// Offsets settled here, waiting to be proposed.
    settles: Vec<u64>,
    settling: bool,
}

impl Replication {
    /// The state of a replicated queue this member serves (`serving`) or only stores.
    pub fn new(serving: bool) -> Replication {
        Replication { serving, ..Default::default() }
    }

    /// Publishes accepted but not yet proposed: answered "not stored" when the queue goes
    /// out of service here (the publisher sends them again).
    pub(super) fn refuse_waiting(&mut self) {
        for (_, c, _) in self.enqueues.drain(..) {
            if let Some(c) = c {
                c.answer(false);
            }
        }
    }
}

impl Queue {
    /// Step 1: queues `message` for the next `Enqueue` batch of this queue.
    pub(super) fn propose_enqueue(&mut self, cell: &QueueCell, message: Message, confirm: Option<ConfirmTo>, published: Option<Instant>) {
        let Some(repl) = &mut self.repl else { return };
        let cmd = Command::Enqueue {
            vhost: self.qref.key.vhost.to_string(),
            queue: self.qref.key.name.to_string(),
            flags: message.flags,
            header: message.header,
            body: message.body,
        };
        repl.enqueues.push((cmd, confirm, published));
        if !repl.enqueuing {
            repl.enqueuing = true;
            glommio::spawn_local(enqueuer(Rc::downgrade(cell))).detach();
        }
    }

    /// Step 3: proposes the offsets this serving member deleted.
    pub(super) fn propose_settle(&mut self, offsets: &[u64]) {
        let me = self.me.clone();
        let Some(repl) = &mut self.repl else { return };
        if !repl.serving || offsets.is_empty() {
            return;
        }
        repl.settles.extend_from_slice(offsets);
        if !repl.settling {
            repl.settling = true;
            glommio::spawn_local(settler(me)).detach();
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
                    if once_a_second(&APPLY_FAILURE_LOGGED) {
                        tracing::error!(queue = %q.qref.key.name, offset, next, "replica lacks earlier messages of its queue; message not stored here");
                    }
                    return;
                }
                match q.shard.append_shared(flags, &header, &body) {
                    Ok(at) if at == offset => {
                        q.ready.push(at, None);
                        if at < q.cursor.committed {
                            // Stored again by a replay (this copy's shard had lost its unsynced
                            // tail): handed out before, as the cursor says.
                            q.ready.mark_redelivered(at);
                        }
                        q.dirty = true;
                        q.wake();
                    }
                    Ok(at) => {
                        tracing::error!(queue = %q.qref.key.name, offset, at, "replica stored a message at another offset");
                        q.ready.push(at, None);
                    }
                    Err(e) => {
                        if e.is_disk_full() {
                            q.env.disk_full();
                        }
                        if once_a_second(&APPLY_FAILURE_LOGGED) {
                            tracing::error!(queue = %q.qref.key.name, error = %e, "replicated message not stored on this member");
                        }
                    }
                }
            }
            DataOp::Settle { offsets, .. } => {
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
            // Carried out by the core (it owns the registry).
            DataOp::Dropped { .. } => {}
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

/// Proposes the queue's waiting publishes, one batch at a time, and answers their confirms
/// with the outcome (step 1). A queue deleted meanwhile confirms (RabbitMQ's reading).
async fn enqueuer(weak: Weak<std::cell::RefCell<Queue>>) {
    futures_lite::future::yield_now().await;
    loop {
        let Some(cell) = weak.upgrade() else { return };
        let (batch, meta, env) = {
            let mut q = cell.borrow_mut();
            let env = q.env.clone();
            let Some(repl) = &mut q.repl else { return };
            if repl.enqueues.is_empty() {
                repl.enqueuing = false;
                return;
            }
            let n = repl.enqueues.len().min(MAX_BATCH);
            let batch: Vec<_> = repl.enqueues.drain(..n).collect();
            (batch, env.meta().clone(), env)
        };
        drop(cell);
        let (cmds, tickets): (Vec<Command>, Vec<_>) = batch.into_iter().map(|(c, t, p)| (c, (t, p))).unzip();
        let result = meta.propose_batch(cmds).await;
        let now = Instant::now();
        match result {
            Ok(outcomes) => {
                for ((ticket, published), o) in tickets.into_iter().zip(outcomes) {
                    let ok = matches!(o, Outcome::Enqueued { .. } | Outcome::NotFound);
                    if let Some(p) = published {
                        env.stats().publish_to_stored.record(now.duration_since(p));
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
                for (ticket, _) in tickets {
                    if let Some(c) = ticket {
                        c.answer(false);
                    }
                }
            }
        }
    }
}

/// Proposes the offsets the serving member settled (step 3), all waiting ones in one
/// command.
async fn settler(weak: Weak<std::cell::RefCell<Queue>>) {
    futures_lite::future::yield_now().await;
    loop {
        let Some(cell) = weak.upgrade() else { return };
        let (cmd, meta) = {
            let mut q = cell.borrow_mut();
            let (vhost, queue) = (q.qref.key.vhost.to_string(), q.qref.key.name.to_string());
            let meta = q.env.meta().clone();
            let Some(repl) = &mut q.repl else { return };
            if repl.settles.is_empty() {
                repl.settling = false;
                return;
            }
            let offsets = std::mem::take(&mut repl.settles);
            (Command::Settle { vhost, queue, offsets }, meta)
        };
        drop(cell);
        if let Err(e) = meta.propose(cmd).await {
            if once_a_second(&SETTLE_FAILURE_LOGGED) {
                tracing::warn!(error = %e, "replicated settle not committed; the other members keep those messages");
            }
        }
    }
}
