//! This core's share of the broker: its queue registry and the lifecycle of its queues
//! (open on first use, delete, retire and reopen after a store failure), its copy of the
//! routing tables, its connections' event channels and its once-a-second tick. One
//! [`Node`] per core, on that core's executor only; [`Shared`] is what all cores share.
//!
//! # Invariants
//! - A queue's state is only touched on its owner core (`owner_core` in its metadata modulo
//!   the core count).
//! - Operations a queue sends (dead-lettering, auto-delete) go through the owner's inbox,
//!   even on the same core, so a queue never re-enters a queue that is being modified.
//!   Connections call a queue on their own core directly ([`Node::send_from_connection`]);
//!   a connection's operations on one queue run in the order it sent them either way.
//! - An operation on a queue that is being opened waits in its registry slot and runs, in
//!   order, once the store is open; one that finds the queue gone is answered as
//!   [`refuse`] says (a publish is never confirmed for a store that did not open).
//! - One open per queue at a time: only the open that made a slot `Opening` ends it, and a
//!   reopen or a close starts only from the queue's current `Open` copy
//!   ([`Node::begin_reopen`]), never over an open under way (whose waiting operations it
//!   would drop, and whose store it would open a second time).
//!
//! # Assumptions
//! A core never blocks: the only filesystem calls here run on glommio's blocking thread
//! (`store_files.rs`: [`writable`], [`remove_dir`], [`claim_store`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::alarms::Alarms;
use super::queue::{read_index, Queue, QueueCell, QueueEnv, Recovered};
use super::router::{Route, Router};
pub use super::store_files::queue_dir;
use super::store_files::{claim_store, destroy_shards, remove_dir, remove_replica_files, writable};
use super::{ClientEvent, ClientTx, ConnId, Mesh, QueueError, QueueKey, QueueOp, QueueRef};
use crate::config::Config;
use crate::core::mesh::Inboxes;
use crate::meta::state::{Command, QueueDef};
use crate::meta::MetaHandle;
use crate::observe::Stats;

/// State shared by all cores (Send + Sync).
pub struct Shared {
    /// Effective configuration.
    pub config: Arc<Config>,
    /// The Raft metadata group.
    pub meta: MetaHandle,
    /// Inbox of each core, by core index.
    pub inboxes: Inboxes<NodeMsg>,
    /// Number of cores.
    pub cores: u32,
    next_id: AtomicU64,
    /// Set when shutdown begins.
    pub shutting_down: AtomicBool,
    /// Counters for metrics, one block per core.
    pub stats: Vec<Stats>,
    /// Disk and file-descriptor alarms ([`super::alarms`]).
    pub alarms: Arc<Alarms>,
    /// In a cluster: (peer id, link up) for every other member, from the transport.
    pub peer_links: Option<PeerLinks>,
    /// In a cluster: serving other nodes' queues and ours to them (`broker::remote`).
    pub remote: Option<Arc<super::remote::Remote>>,
    /// This node's direct reply-to consumers (`broker::reply_to`).
    pub reply_to: Arc<super::reply_to::ReplyConsumers>,
    /// This node's open connections, for the management API (`broker::clients`).
    pub clients: super::clients::Clients,
    /// This node's channels, consumers and publishers, for the metrics.
    pub live: crate::observe::Live,
    /// When the broker started (the metrics' uptime).
    pub started: Instant,
    /// Queue directories being removed: an open of one waits for its removal.
    pub removals: super::store_files::Removals,
}

/// Reports (peer id, link up) for every other member of the cluster.
pub type PeerLinks = Arc<dyn Fn() -> Vec<(crate::meta::NodeId, bool)> + Send + Sync>;

impl Shared {
    /// State for `inboxes.len()` cores.
    pub fn new(config: Arc<Config>, meta: MetaHandle, inboxes: Inboxes<NodeMsg>, alarms: Arc<Alarms>) -> Shared {
        let cores = inboxes.len() as u32;
        Shared {
            config,
            meta,
            inboxes,
            cores,
            next_id: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            stats: (0..cores).map(|_| Stats::default()).collect(),
            alarms,
            peer_links: None,
            remote: None,
            reply_to: Default::default(),
            clients: Default::default(),
            live: Default::default(),
            started: Instant::now(),
            removals: Default::default(),
        }
    }

    /// A fresh id for a connection or consumer (unique within this run).
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// A message from one core to another.
#[derive(Debug)]
pub enum NodeMsg {
    /// An operation for a queue this core owns.
    Queue {
        /// Target queue.
        queue: QueueRef,
        /// What to do.
        op: QueueOp,
    },
    /// The disk alarm was raised (true) or cleared: tell every connection of this core.
    ResourceAlarm(bool),
    /// A peer's operation on a queue this core owns (`broker::remote`).
    Remote {
        /// The peer.
        from: crate::meta::NodeId,
        /// The queue (this node's).
        qref: QueueRef,
        /// The operation.
        req: Box<super::remote::wire::Request>,
    },
    /// Sync the shards of every replicated queue of this core, then reply (true: all synced;
    /// `replicas.rs`).
    SyncReplicas {
        /// Answered when done.
        done: flume::Sender<bool>,
    },
    /// Work handed to this core from outside the executors (the management API's threads):
    /// run on the core with its [`Node`]; it spawns a local task when it must wait, and
    /// answers on a channel it carries.
    Run(OnCore),
    /// Stop: close connections with 320, sync and close shards, then reply.
    Shutdown {
        /// Answered when this core is done.
        done: flume::Sender<()>,
    },
}

/// Work a core runs with its [`Node`] ([`NodeMsg::Run`]).
pub type CoreWork = Box<dyn FnOnce(&Rc<Node>) + Send>;

/// A closure for [`NodeMsg::Run`].
pub struct OnCore(pub CoreWork);

impl std::fmt::Debug for OnCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnCore")
    }
}

pub(super) enum Slot {
    Open(QueueCell),
    /// Closed for being idle (`idle.rs`), with its message counters of this run.
    Idle(super::queue::Counters),
    Opening(Vec<QueueOp>),
    Deleting,
}

/// One core's broker state. Lives on its executor only (`Rc`).
pub struct Node {
    /// Core index.
    pub id: u32,
    /// Shared state.
    pub shared: Arc<Shared>,
    pub(super) queues: RefCell<rustc_hash::FxHashMap<QueueKey, Slot>>,
    /// Counters of idle queues being opened again, restored once open (`idle.rs`).
    pub(super) resumed: RefCell<rustc_hash::FxHashMap<QueueKey, super::queue::Counters>>,
    /// Durable queues of this core whose messages were opened since the broker started:
    /// only a queue's first open in a run drops its transient messages (a restart); a
    /// reopen after a store failure keeps them, as the queue held them.
    opened_this_run: RefCell<rustc_hash::FxHashSet<QueueKey>>,
    router: RefCell<Rc<Router>>,
    /// Open connections on this core and their event channels.
    pub conns: RefCell<HashMap<ConnId, ClientTx>>,
    /// The memory alarm's collection loop runs on this core ([`Node::collect_during_memory_alarm`]).
    collecting: std::cell::Cell<bool>,
}

impl Node {
    /// Core `id`'s state, with a routing table built from the current metadata.
    pub fn new(id: u32, shared: Arc<Shared>) -> Rc<Node> {
        let router = Router::new(shared.meta.topology(), shared.meta.topology_version(), shared.cores);
        Rc::new(Node {
            id,
            shared,
            queues: RefCell::new(Default::default()),
            resumed: RefCell::new(Default::default()),
            opened_this_run: RefCell::new(Default::default()),
            router: RefCell::new(Rc::new(router)),
            conns: RefCell::new(HashMap::new()),
            collecting: std::cell::Cell::new(false),
        })
    }

    /// While the memory alarm lasts, every 50 ms: the queues' caches of stored messages go
    /// (their reads go to disk), and what this core freed goes back at once, not at its next
    /// tick, so the alarm lasts as long as memory is really held (`core::memory`). One loop
    /// per core (`collecting`).
    async fn collect_during_memory_alarm(self: Rc<Self>) {
        while self.shared.alarms.memory_alarm() {
            for q in self.open_queues() {
                q.borrow().shard.drop_cache();
            }
            crate::core::memory::collect_thread_heap();
            glommio::timer::sleep(Duration::from_millis(50)).await;
        }
        self.collecting.set(false);
    }

    /// This core's counters.
    pub fn stats(&self) -> &Stats {
        &self.shared.stats[self.id as usize]
    }

    /// The current routing table (refreshed when the metadata's topology moved).
    pub fn router(&self) -> Rc<Router> {
        let v = self.shared.meta.topology_version();
        if self.router.borrow().version != v {
            *self.router.borrow_mut() = Rc::new(Router::new(self.shared.meta.topology(), v, self.shared.cores));
        }
        self.router.borrow().clone()
    }

    /// Handles one inbox message; returns the reply channel of a shutdown request, which
    /// the caller carries out with [`Node::shutdown`] once its inbox loop has ended.
    pub fn handle(self: &Rc<Self>, msg: NodeMsg) -> Option<flume::Sender<()>> {
        match msg {
            NodeMsg::Queue { queue, op } => {
                self.queue_op(&queue, op);
                None
            }
            NodeMsg::ResourceAlarm(raised) => {
                for tx in self.conns.borrow().values() {
                    let _ = tx.send(ClientEvent::ResourceAlarm(raised));
                }
                if raised && self.shared.alarms.memory_alarm() && !self.collecting.replace(true) {
                    crate::core::spawn_soon(self.clone().collect_during_memory_alarm());
                }
                None
            }
            NodeMsg::Remote { from, qref, req } => {
                if let Some(remote) = &self.shared.remote {
                    remote.run_request(self, from, qref, *req);
                }
                None
            }
            NodeMsg::SyncReplicas { done } => {
                crate::core::spawn_soon(self.clone().sync_replicas(done));
                None
            }
            NodeMsg::Run(OnCore(work)) => {
                work(self);
                None
            }
            NodeMsg::Shutdown { done } => Some(done),
        }
    }

    /// Sends `op` from a connection: a queue on this core gets it at once (no inbox hop),
    /// a queue elsewhere through its core's inbox. A connection's operations on one queue
    /// keep their order either way. Never call this from inside a queue (a queue that
    /// dead-letters to itself would re-enter itself): queues use [`Mesh::send`].
    pub fn send_from_connection(self: &Rc<Self>, queue: &QueueRef, op: QueueOp) {
        if queue.owner_core % self.shared.cores == self.id {
            self.queue_op(queue, op);
        } else {
            self.send(queue, op);
        }
    }

    fn queue_op(self: &Rc<Self>, qref: &QueueRef, op: QueueOp) {
        let here = self.shared.meta.node_id();
        if qref.owner_core == super::reply_to::DIRECT_CORE {
            return self.direct_reply(qref, here, op);
        }
        let Some(op) = self.steered(qref, op) else { return };
        // Replicated data is for this node's own store, whoever serves the queue.
        let replicated = matches!(op, QueueOp::Replicated(_));
        if qref.owner_node != here && !replicated {
            match &self.shared.remote {
                Some(remote) => remote.forward(qref, op),
                None => refuse_remote(qref, here, op),
            }
            return;
        }
        let mut queues = self.queues.borrow_mut();
        if let Some(Slot::Idle(counters)) = queues.get(&qref.key) {
            let counters = *counters;
            if let QueueOp::Info { reply, .. } = op {
                return drop(reply.send(super::idle::idle_info(counters)));
            }
            queues.remove(&qref.key);
            self.resumed.borrow_mut().insert(qref.key.clone(), counters);
        }
        match queues.get_mut(&qref.key) {
            Some(Slot::Open(cell)) => {
                let cell = cell.clone();
                let take_over = !replicated && !cell.borrow().serving();
                if take_over {
                    // The metadata says this node serves it now (a failover the watch has not
                    // acted on yet): the copy reopens as the server first, the op waits.
                    queues.insert(qref.key.clone(), Slot::Opening(vec![op]));
                    drop(queues);
                    super::replicas::log_new_role(&qref.key, here, here);
                    let me = self.clone();
                    crate::core::spawn_soon(async move { me.reopen_in_place(&cell).await });
                    return;
                }
                drop(queues);
                self.run_op(&cell, op);
            }
            Some(Slot::Opening(pending)) => pending.push(op),
            Some(Slot::Deleting) => refuse(&qref.key, op),
            Some(Slot::Idle(_)) | None => {
                let topo = self.router();
                let Some(def) = topo.topology.queue(&qref.key.vhost, &qref.key.name).cloned() else {
                    drop(queues);
                    if let QueueOp::Replicated(crate::meta::data::DataOp::Dropped { .. }) = op {
                        // A replica this run never opened: its files go.
                        crate::core::spawn_soon(remove_replica_files(self.shared.config.queue_dir(&qref.key.vhost, &qref.key.name, true)));
                    }
                    refuse(&qref.key, op);
                    return;
                };
                queues.insert(qref.key.clone(), Slot::Opening(vec![op]));
                drop(queues);
                let qref = topo.queue_ref(&qref.key.vhost, &qref.key.name).unwrap_or_else(|| qref.clone());
                crate::core::spawn_soon(self.clone().open_and_run(def, qref));
            }
        }
    }

    /// A reply published to a direct reply-to name (`broker::reply_to`, step 3): handed to
    /// the requester when the name is this node's (dropped when it is no longer registered,
    /// as RabbitMQ does), else sent to the node it names. The publish is confirmed either
    /// way; no other operation names a reply target.
    fn direct_reply(&self, qref: &QueueRef, here: crate::meta::NodeId, op: QueueOp) {
        if qref.owner_node != here {
            match &self.shared.remote {
                Some(remote) => remote.forward(qref, op),
                None => refuse_remote(qref, here, op),
            }
            return;
        }
        if let QueueOp::Publish { message, confirm, .. } = op {
            self.shared.reply_to.deliver(qref, message);
            if let Some(c) = confirm {
                c.answer(true);
            }
        }
    }

    /// Opens a queue's store, starts the queue and runs the operations that waited for it;
    /// if the store cannot open, answers them as [`refuse_unstored`] says.
    pub(super) async fn open_and_run(self: Rc<Self>, def: QueueDef, qref: QueueRef) {
        let opened = self.open_queue(&def, &qref).await;
        let counters = self.resumed.borrow_mut().remove(&qref.key);
        let pending = match self.queues.borrow_mut().remove(&qref.key) {
            Some(Slot::Opening(p)) => p,
            other => {
                // Never: every open starts from an `Opening` slot that only this open ends.
                tracing::error!(queue = %qref.key.name, vhost = %qref.key.vhost, open = matches!(other, Some(Slot::Open(_))),
                    "a queue opened while its slot was not opening (two opens of one queue)");
                Vec::new()
            }
        };
        match opened {
            Ok((shard, index, recovered)) => {
                let env: Rc<dyn QueueEnv> = self.clone();
                let timeout = self.shared.config.consumer_timeout_ms;
                let cell = Queue::start(def, qref.clone(), shard, index, recovered, timeout, env);
                if let Some(c) = counters {
                    cell.borrow_mut().counters = c;
                }
                self.queues.borrow_mut().insert(qref.key.clone(), Slot::Open(cell.clone()));
                for op in pending {
                    self.run_op(&cell, op);
                }
            }
            Err(e) => {
                if e.is_disk_full() {
                    self.shared.alarms.disk_full_seen();
                }
                tracing::error!(queue = %qref.key.name, error = %e, "cannot open queue store");
                let detail = format!("cannot open the store of queue '{}': {e}", qref.key.name);
                let err = if e.is_resource() { QueueError::ResourceError(detail) } else { QueueError::InternalError(detail) };
                for op in pending {
                    if matches!(op, QueueOp::Publish { .. }) {
                        Stats::add(&self.stats().store_refused, 1);
                    }
                    refuse_unstored(op, err.clone());
                }
            }
        }
    }

    /// Opens a queue's message shard and, for a durable queue, its unacked index, and
    /// reads what recovery needs (the committed cursor and the index records).
    ///
    /// Restart semantics of RabbitMQ's classic queues: at a durable queue's first open
    /// after the broker started, its transient messages (published without delivery_mode
    /// 2) are deleted from the store (`Shard::open_retaining` keeping `FLAG_PERSISTENT`),
    /// whether the broker stopped or crashed; the persistent ones stay. Not for replicated
    /// queues nor `x-queue-type=quorum` ones, which keep every message whatever its delivery
    /// mode (as RabbitMQ's quorum queues). Rule 6 (index coverage = durability) holds: no
    /// unacked-index record names a transient message (`Queue::index_delivery`), and
    /// `Queue::start` drops any record of a message that is not live.
    async fn open_queue(
        &self,
        def: &QueueDef,
        qref: &QueueRef,
    ) -> Result<(ringmq_shards::Shard, Option<ringmq_shards::Shard>, Recovered), ringmq_shards::StoreError> {
        let dir = queue_dir(&self.shared.config, def);
        self.shared.removals.wait(&dir).await;
        if qref.durable && def.incarnation != 0 {
            claim_store(dir.clone(), def.incarnation, qref.key.name.to_string()).await?;
        }
        let cfg = ringmq_shards::ShardConfig { segment_bytes: self.shared.config.segment_bytes, ..Default::default() };
        let classic = super::router::string_arg(&def.arguments, "x-queue-type") != Some("quorum");
        let restarted = qref.durable
            && classic
            && !super::queue::replica::is_replicated(def, self.shared.meta.is_cluster())
            && !self.opened_this_run.borrow().contains(&qref.key);
        let (shard, report) = if restarted {
            let keep = super::message::FLAG_PERSISTENT;
            let opened = ringmq_shards::Shard::open_retaining(&dir.join("messages"), cfg, keep).await?;
            self.opened_this_run.borrow_mut().insert(qref.key.clone());
            opened
        } else {
            ringmq_shards::Shard::open(&dir.join("messages"), cfg).await?
        };
        if report.discarded > 0 {
            tracing::info!(queue = %qref.key.name, vhost = %qref.key.vhost, messages = report.discarded, "dropped transient messages at restart");
        }
        shard.prepare().await?;
        for (from, to, why) in &report.dropped {
            tracing::warn!(queue = %qref.key.name, from, to, why, "recovery dropped message records");
        }
        let want = super::queue::RecordScan {
            body_lens: super::policy::counts_bytes(&self.shared.meta.topology(), def),
            priorities: super::queue::priority::max_priority(&def.arguments).is_some(),
        };
        let (body_lens, priorities) =
            if want.body_lens || want.priorities { super::queue::scan_records(&shard, want).await? } else { Default::default() };
        if !qref.durable {
            return Ok((shard, None, Recovered { body_lens, priorities, ..Recovered::default() }));
        }
        let index_cfg = ringmq_shards::ShardConfig { segment_bytes: 4 << 20, cache_bytes: 1 << 20, ..Default::default() };
        let (index, _) = ringmq_shards::Shard::open(&dir.join("unacked"), index_cfg).await?;
        let super::queue::index::IndexContents { held, returns, reservations } = read_index(&index).await?;
        let reservation = super::queue::reserve::recover(&index, &reservations, shard.next_offset()).await?;
        let (vhost, name) = (&qref.key.vhost, &qref.key.name);
        let (cursor, reserved, tail) =
            self.shared.meta.with_state(|s| (s.cursor(vhost, name).unwrap_or(0), s.reservation(vhost, name), s.tail(vhost, name)));
        Ok((shard, Some(index), Recovered { cursor, held, returns, reserved, reservation, tail, body_lens, priorities }))
    }

    fn run_op(self: &Rc<Self>, cell: &QueueCell, op: QueueOp) {
        match op {
            QueueOp::Replicated(crate::meta::data::DataOp::Dropped { .. }) => self.drop_replica(cell),
            QueueOp::Delete { if_unused, if_empty, reply } => {
                // Its own statement: the borrow ends before the arms borrow mutably.
                let checked = cell.borrow().check_delete(if_unused, if_empty);
                match checked {
                    Err(e) => drop(reply.send(Err(e))),
                    Ok(n) => {
                        let key = cell.borrow().qref.key.clone();
                        let ((shard, index), cancels) = cell.borrow_mut().tear_down_quietly();
                        let dir = queue_dir(&self.shared.config, &cell.borrow().def);
                        // Before the delete commits: a declare that sees it committed, on any
                        // core, opens the name's new store only after this removal.
                        self.shared.removals.begin(dir.clone());
                        self.queues.borrow_mut().insert(key.clone(), Slot::Deleting);
                        let me = self.clone();
                        crate::core::spawn_soon(async move {
                            let cmd = Command::DeleteQueue { vhost: key.vhost.to_string(), name: key.name.to_string() };
                            match me.shared.meta.propose(cmd).await {
                                Ok(_) => Stats::add(&me.stats().queues_deleted, 1),
                                Err(e) => tracing::error!(error = %e, "metadata delete of queue failed"),
                            }
                            destroy_shards(shard, index).await;
                            remove_dir(dir.clone()).await;
                            me.shared.removals.end(&dir);
                            me.queues.borrow_mut().remove(&key);
                            me.opened_this_run.borrow_mut().remove(&key);
                            cancels.into_iter().for_each(crate::broker::queue::CancelNotice::send);
                            let _ = reply.send(Ok(n));
                        });
                    }
                }
            }
            op => Queue::handle(cell, op),
        }
    }

    /// Takes back a declare whose store could not be opened: the queue leaves the metadata
    /// and its directory goes (on the blocking thread), so the client's error is the whole
    /// story (no queue half there).
    pub async fn undeclare(&self, def: &QueueDef) {
        let cmd = Command::DeleteQueue { vhost: def.vhost.clone(), name: def.name.clone() };
        if let Err(e) = self.shared.meta.propose(cmd).await {
            tracing::error!(queue = %def.name, error = %e, "taking back a failed declare failed");
        }
        let dir = queue_dir(&self.shared.config, def);
        let _ = glommio::executor().spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
    }

    /// Closes this core's connections with 320 CONNECTION_FORCED (waiting up to 3 s for
    /// them to go), then closes every open queue's shards (each syncs what it holds).
    pub async fn shutdown(self: &Rc<Self>) {
        for tx in self.conns.borrow().values() {
            let _ = tx.send(ClientEvent::Shutdown);
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while !self.conns.borrow().is_empty() && Instant::now() < deadline {
            glommio::timer::sleep(Duration::from_millis(20)).await;
        }
        for c in self.open_queues() {
            if let Err(e) = super::queue::reserve::release(&c).await {
                tracing::error!(error = %e, "syncing an unacked index at shutdown failed");
            }
            let (shard, index) = (c.borrow().shard.clone(), c.borrow().index.clone());
            for s in [Some(shard), index].into_iter().flatten() {
                if let Err(e) = s.close().await {
                    tracing::error!(error = %e, "closing a shard failed");
                }
            }
        }
    }

    /// Retires a queue whose store failed ([`Queue::retire`]) and closes its shards; the
    /// next operation on it opens it again from disk (what was synced is there).
    async fn reopen_failed(self: &Rc<Self>, cell: &QueueCell, why: &str) {
        let key = cell.borrow().qref.key.clone();
        tracing::warn!(queue = %key.name, vhost = %key.vhost, reason = why, "reopening a queue whose store failed");
        if !self.begin_reopen(&key, cell) {
            return;
        }
        let (shard, index) = cell.borrow_mut().retire();
        for s in [Some(shard), index].into_iter().flatten() {
            let _ = s.close().await;
        }
        Stats::add(&self.stats().store_reopens, 1);
        // Operations that came while it closed waited in its slot (not a second open on the
        // store being closed): they open it now; none, and the next one opens it.
        let waiting = matches!(self.queues.borrow().get(&key), Some(Slot::Opening(w)) if !w.is_empty());
        if !waiting {
            self.queues.borrow_mut().remove(&key);
        } else if let Some((def, qref)) = self.reopen_target(&key) {
            crate::core::spawn_soon(self.clone().open_and_run(def, qref));
        }
    }

    /// The queues of this core that are open (not opening or being deleted).
    pub(super) fn open_queues(&self) -> Vec<QueueCell> {
        self.queues.borrow().values().filter_map(|s| if let Slot::Open(c) = s { Some(c.clone()) } else { None }).collect()
    }

    /// The queue `key` of this core: `Some(Some(cell))` when open, `Some(None)` while it opens
    /// or is deleted, `None` when nothing opened it or it was closed for being idle.
    pub(super) fn queue_slot(&self, key: &QueueKey) -> Option<Option<QueueCell>> {
        match self.queues.borrow().get(key)? {
            Slot::Open(c) => Some(Some(c.clone())),
            Slot::Idle(_) => None,
            _ => Some(None),
        }
    }

    /// True while a queue of this core is being opened.
    pub(super) fn any_opening(&self) -> bool {
        self.queues.borrow().values().any(|s| matches!(s, Slot::Opening(_)))
    }

    /// Marks `key` as being deleted (operations on it are refused meanwhile).
    pub(super) fn set_deleting(&self, key: &QueueKey) {
        self.queues.borrow_mut().insert(key.clone(), Slot::Deleting);
    }

    /// Forgets `key`'s slot (the next operation opens it again from the metadata).
    pub(super) fn forget_slot(&self, key: &QueueKey) {
        self.queues.borrow_mut().remove(key);
    }

    /// Takes a queue out of service here ([`Queue::retire`]), closes its shards and opens it
    /// again from its store with its current definition (a replicated queue whose serving
    /// member changed, `replicas.rs`). Operations arriving meanwhile wait in its slot.
    /// Nothing happens unless `cell` is the queue's open copy: one open per queue at a time,
    /// so a reopen under way (a take-over by `queue_op`, or another pass) keeps its slot and
    /// the operations waiting in it.
    pub(super) async fn reopen(self: &Rc<Self>, cell: &QueueCell) {
        let key = cell.borrow().qref.key.clone();
        if self.begin_reopen(&key, cell) {
            self.reopen_in_place(cell).await;
        }
    }

    /// Turns `key`'s slot from `Open(cell)` into an empty `Opening` and returns true; false,
    /// leaving the slot alone, when it holds anything else (an open under way, with the
    /// operations waiting for it; another copy; a delete).
    pub(super) fn begin_reopen(&self, key: &QueueKey, cell: &QueueCell) -> bool {
        let mut queues = self.queues.borrow_mut();
        if !matches!(queues.get(key), Some(Slot::Open(c)) if Rc::ptr_eq(c, cell)) {
            return false;
        }
        queues.insert(key.clone(), Slot::Opening(Vec::new()));
        true
    }

    /// [`Node::reopen`] once the queue's slot is already `Opening`.
    async fn reopen_in_place(self: &Rc<Self>, cell: &QueueCell) {
        let key = cell.borrow().qref.key.clone();
        let (shard, index) = cell.borrow_mut().retire();
        for s in [Some(shard), index].into_iter().flatten() {
            if let Err(e) = s.close().await {
                tracing::warn!(queue = %key.name, error = %e, "closing a queue to reopen it failed");
            }
        }
        if let Some((def, qref)) = self.reopen_target(&key) {
            self.clone().open_and_run(def, qref).await;
        }
    }

    /// The definition and reference of queue `key`, whose slot is `Opening`, to open it
    /// again; `None` when it was deleted meanwhile, after answering every operation waiting
    /// in the slot as for a queue that is gone (and dropping the slot).
    pub(super) fn reopen_target(&self, key: &QueueKey) -> Option<(QueueDef, QueueRef)> {
        let topo = self.router();
        if let (Some(def), Some(qref)) = (topo.topology.queue(&key.vhost, &key.name).cloned(), topo.queue_ref(&key.vhost, &key.name)) {
            return Some((def, qref));
        }
        if let Some(Slot::Opening(pending)) = self.queues.borrow_mut().remove(key) {
            for op in pending {
                refuse(key, op);
            }
        }
        None
    }

    /// Opens this core's queues with an x-expires lease or an x-message-ttl that are not open
    /// yet (a queue otherwise opens at its first operation), so that the lease of a queue
    /// nobody touches after a restart, or after it moved here, runs out (`queue/expiry.rs`),
    /// and its messages expire, dead-lettered into queues that open for their copies
    /// (`queue/ttl.rs`).
    fn open_expiring_queues(self: &Rc<Self>) {
        let here = self.shared.meta.node_id();
        let topo = self.router();
        let idle: Vec<QueueRef> = topo
            .topology
            .queues
            .values()
            .filter(|d| {
                // x-expires leases run from the open; x-message-ttl expires at the head on a
                // timer (`queue::ttl`, rule 3), so with no client touching the queue too.
                let timed = super::policy::is_timed(&topo.topology, d);
                d.owner_node == here && timed
            })
            .filter_map(|d| topo.queue_ref(&d.vhost, &d.name))
            .filter(|q| q.owner_core % self.shared.cores == self.id && self.queue_slot(&q.key).is_none())
            .collect();
        for q in idle {
            self.queue_op(&q, QueueOp::Wake);
        }
    }

    /// The once-a-second tick, run for the life of the core: syncs queues with unsynced
    /// deletes, sends every channel that holds a delivery past its queue's acknowledgement
    /// timeout an [`ClientEvent::AckTimeout`], and reopens queues whose store failed once
    /// the disk alarm is clear.
    pub async fn tick(self: Rc<Self>) {
        if self.shared.meta.is_cluster() {
            crate::core::spawn_soon(self.clone().watch_replicas());
        }
        let mut topology_seen = None;
        loop {
            let version = self.shared.meta.topology_version();
            if topology_seen != Some(version) {
                topology_seen = Some(version);
                self.open_expiring_queues();
                super::policy::reapply_to_open_queues(&self.router().topology, &self.open_queues(), self.shared.config.consumer_timeout_ms);
                if self.id == 0 {
                    self.shared.clients.close_revoked(&self.router().topology);
                }
            }
            glommio::timer::sleep(Duration::from_secs(1)).await;
            crate::core::memory::collect_thread_heap();
            let now = Instant::now();
            self.close_idle_queues(now).await;
            for c in self.open_queues() {
                let failure = c.borrow().store_failure();
                if let Some(why) = failure {
                    // Reopened only once writing works again: until then the queue keeps
                    // serving what it holds (a reopen would fail and leave nothing to read).
                    let dir = queue_dir(&self.shared.config, &c.borrow().def);
                    if !self.shared.alarms.disk_alarm() && writable(dir).await {
                        self.reopen_failed(&c, &why).await;
                    }
                    continue;
                }
                Queue::sync_if_dirty(&c);
                let mut q = c.borrow_mut();
                let ms = q.consumer_timeout_ms;
                for h in q.timed_out_holders(now) {
                    if !q.cancel_timed_out(h.chan_uid) {
                        let _ = h.tx.send(ClientEvent::AckTimeout { channel: h.channel, chan_uid: h.chan_uid, timeout_ms: ms });
                    }
                }
            }
        }
    }
}

/// Answers an operation on a queue that does not exist (any more): 404, except that a
/// confirm-mode publish is confirmed (RabbitMQ confirms a message whose queue vanished
/// while it was routed).
pub(super) fn refuse(key: &QueueKey, op: QueueOp) {
    match op {
        QueueOp::Publish { confirm: Some(c), .. } => {
            c.answer(true);
        }
        op => refuse_unstored(op, QueueError::NotFound(format!("no queue '{}' in vhost '{}'", key.name, key.vhost))),
    }
}

/// Answers an operation on a queue another node's store holds (a cluster serves each queue
/// from its own node for now): 404 with the node to connect to, a publish is nacked (rule 9:
/// never a confirm for what is not stored here or there).
fn refuse_remote(qref: &QueueRef, here: crate::meta::NodeId, op: QueueOp) {
    let err = QueueError::NotFound(format!(
        "queue '{}' in vhost '{}' lives on node {}; node {here} does not serve other nodes' queues yet: connect to node {}",
        qref.key.name, qref.key.vhost, qref.owner_node, qref.owner_node
    ));
    match op {
        QueueOp::Delete { reply, .. } => drop(reply.send(Err(err))),
        op => refuse_unstored(op, err),
    }
}

/// Answers an operation on a queue whose store cannot be opened: a publish is nacked
/// (DESIGN.md rule 9: never a confirm for what is not stored), the rest get `err` (a
/// basic.cancel its cancel-ok: dropping its [`super::CancelOkTo`] sends it).
pub(super) fn refuse_unstored(op: QueueOp, err: QueueError) {
    match op {
        QueueOp::Publish { confirm: Some(c), .. } => {
            c.answer(false);
        }
        QueueOp::Get { reply, .. } => drop(reply.send(Err(err))),
        QueueOp::Consume { reply, .. } => drop(reply.send(Err(err))),
        QueueOp::Stats { reply } => drop(reply.send(Err(err))),
        QueueOp::Purge { reply } => drop(reply.send(Err(err))),
        QueueOp::Delete { reply, .. } => drop(reply.send(Ok(0))),
        _ => {}
    }
}

impl Mesh for Node {
    fn send(&self, queue: &QueueRef, op: QueueOp) {
        let core = (queue.owner_core % self.shared.cores) as usize;
        if self.shared.inboxes.send(core, NodeMsg::Queue { queue: queue.clone(), op }).is_err() {
            // Only a stopping broker closes a core's inbox: nothing to warn about.
            tracing::debug!("core {core} inbox closed (shutting down)");
        }
    }
}

impl QueueEnv for Node {
    fn route(&self, vhost: &str, exchange: &str, routing_key: &str, headers: Option<&amq_protocol::types::FieldTable>) -> Route {
        self.router().route(vhost, exchange, routing_key, headers)
    }

    fn meta(&self) -> &MetaHandle {
        &self.shared.meta
    }

    fn stats(&self) -> &Stats {
        Node::stats(self)
    }

    fn disk_full(&self) {
        self.shared.alarms.disk_full_seen();
    }

    fn auto_delete(&self, key: &QueueKey) {
        let qref = QueueRef { key: key.clone(), owner_core: self.id, owner_node: self.shared.meta.node_id(), durable: false };
        let (reply, _rx) = super::reply_channel();
        self.send(&qref, QueueOp::Delete { if_unused: true, if_empty: false, reply });
    }
}
