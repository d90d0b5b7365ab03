//! The node's side of replicated queues (`queue/replica.rs` is the queue's): the sink that
//! takes what the metadata group applied to this node's cores, syncing replicas before the
//! log is compacted, dropping a deleted queue's replica, and failover — which member serves
//! a queue, and moving the queues of a node that is gone.
//!
//! # Failover (DESIGN.md, "Cluster")
//! 1. On the metadata group's leader only (raft-rs's leader id, checked every 200 ms), a peer
//!    whose link has been down, or that answered no heartbeat, for [`DOWN_AFTER`] is gone: every replicated queue it serves
//!    is moved (`MoveQueue`, compare-and-set on the serving node) to a live member, chosen
//!    by the queue name among the live members, so the queues spread.
//! 2. Every member compares, whenever the topology changed, whom the metadata names as serving each of its
//!    replicated queues with what its own copy does; when that changed, the copy is
//!    reopened from its store in its new role. A member that starts serving opens the queue
//!    as after a restart: messages below the committed cursor come back redelivered=true
//!    (the move raised it to what the old server had reserved: `queue/replica.rs`, step 5).
//!    One that stops serving cancels its consumers (basic.cancel to those that announced
//!    consumer_cancel_notify) and answers waiting publishes "not stored".
//! 3. A minority side never moves a queue (the move is a Raft proposal) and never confirms
//!    (a confirm is a committed `Enqueue`).

use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::node::{NodeMsg, Shared};
use super::queue::replica::is_replicated;
use super::queue::QueueCell;
use super::{QueueKey, QueueOp, QueueRef};
use crate::core::mesh::Inboxes;
use crate::meta::data::{DataOp, DataSink, FlushWait};
use crate::meta::state::Command;
use crate::meta::{MetaHandle, NodeId};

/// A peer whose link has been down this long is taken as gone: a confirm again within about
/// 3 s of a node's death (the issue asks for 5 s; RabbitMQ notices a dead node in about 5 s).
pub const DOWN_AFTER: Duration = Duration::from_secs(2);
/// How often a core checks for gone peers and moved queues.
pub const WATCH_PERIOD: Duration = Duration::from_millis(200);
/// How long a flush before compaction waits for the cores.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// The [`DataSink`] of a node: hands applied data to the queue's core (in order: one
/// unbounded inbox per core), and syncs every core's replicas on demand.
pub struct ReplicaSink {
    meta: MetaHandle,
    inboxes: Inboxes<NodeMsg>,
}

impl ReplicaSink {
    /// The sink for cores reached through `inboxes`.
    pub fn new(meta: MetaHandle, inboxes: Inboxes<NodeMsg>) -> ReplicaSink {
        ReplicaSink { meta, inboxes }
    }
}

impl DataSink for ReplicaSink {
    fn applied(&self, _index: u64, ops: Vec<DataOp>) {
        let topo = self.meta.topology();
        let cores = self.inboxes.len() as u32;
        let me = self.meta.node_id();
        for op in ops {
            let (vhost, name) = op.queue();
            let qref = match topo.queue(vhost, name) {
                // The entry decided what this node stores as it applied (`meta::grow::stored_by`);
                // ops held since (a replay at start) are dropped for a queue whose set left this
                // node since, unless it is being copied here again (not its enqueues: those lie
                // below the copy's tail).
                Some(def)
                    if !def.stored_on(me)
                        && (matches!(op, DataOp::Enqueue { .. }) || !self.meta.with_state(|s| s.growing_to(vhost, name, me))) =>
                {
                    continue
                }
                Some(def) => QueueRef::of(def, cores),
                // Deleted (by this entry or a later one): its core still gets the drop.
                None => match &op {
                    DataOp::Dropped { owner_core, .. } => {
                        QueueRef { key: QueueKey::new(vhost, name), owner_core: owner_core % cores.max(1), owner_node: 0, durable: true }
                    }
                    _ => continue,
                },
            };
            let core = qref.owner_core as usize;
            let _ = self.inboxes.send(core, NodeMsg::Queue { queue: qref, op: QueueOp::Replicated(op) });
        }
    }

    fn flush(&self) -> FlushWait {
        let mut waits = Vec::new();
        for core in 0..self.inboxes.len() {
            let (done, rx) = flume::bounded(1);
            if self.inboxes.send(core, NodeMsg::SyncReplicas { done }).is_err() {
                return FlushWait::done(false);
            }
            waits.push(rx);
        }
        FlushWait::new(waits, Instant::now() + FLUSH_TIMEOUT)
    }

    fn skipped_to(&self, index: u64) {
        // A node that just joined stores no queue yet: nothing of its own was skipped.
        let me = self.meta.node_id();
        let stored = self.meta.topology().queues.values().filter(|q| is_replicated(q, true) && q.stored_on(me)).count();
        if stored == 0 {
            tracing::info!(index, "metadata snapshot installed; this node stores no replicated queue yet");
            return;
        }
        tracing::warn!(
            index,
            "this node was too far behind: a metadata snapshot replaced its log, and replicated queue messages committed meanwhile are not stored here"
        );
    }
}

/// The replica set for a queue about to be declared on this node (`def.owner_node`): empty
/// when `def` is not replicated (a single node, a transient or exclusive queue); else
/// `x-quorum-initial-group-size` or `--replicas` nodes, capped at the cluster's voters, the
/// owner among them, the others the voters storing the fewest queues
/// ([`crate::core::placement::replica_set`]).
pub fn replica_set_for(shared: &Shared, def: &crate::meta::QueueDef) -> Vec<NodeId> {
    if !is_replicated(def, shared.meta.is_cluster()) {
        return Vec::new();
    }
    let size = replica_set_size(shared, def);
    let mut members = shared.meta.cluster_figures().voters;
    if members.is_empty() {
        members = shared.config.peers.keys().copied().collect();
    }
    let load = replica_load(&shared.meta.topology(), &members);
    let stored = |node: NodeId| load.get(&node).copied().unwrap_or(0);
    crate::core::placement::replica_set(&def.vhost, &def.name, def.owner_node, &members, size, stored)
}

/// How many nodes a replicated queue's set holds when it can (before the cap at the voters):
/// its `x-quorum-initial-group-size`, else `--replicas`.
pub fn replica_set_size(shared: &Shared, def: &crate::meta::QueueDef) -> usize {
    super::router::int_arg(&def.arguments, "x-quorum-initial-group-size")
        .and_then(|n| usize::try_from(n).ok())
        .unwrap_or(shared.config.replicas as usize)
}

/// True when `def` is a replicated queue whose explicit set is smaller than its size capped
/// at `voters` nodes: a set `grow.rs` grows back.
pub fn below_size(shared: &Shared, def: &crate::meta::QueueDef, voters: usize) -> bool {
    is_replicated(def, true) && !def.replicas.is_empty() && def.replicas.len() < replica_set_size(shared, def).min(voters)
}

/// How many replica sets name each of `members` (one pass over the queues).
pub fn replica_load(topo: &crate::meta::Topology, members: &[NodeId]) -> HashMap<NodeId, usize> {
    let mut load: HashMap<NodeId, usize> = HashMap::new();
    for q in topo.queues.values().filter(|q| is_replicated(q, true)) {
        for &m in members {
            if q.stored_on(m) {
                *load.entry(m).or_default() += 1;
            }
        }
    }
    load
}

impl super::node::Node {
    /// A replicated queue was deleted: this member's copy goes (consumers, if any, are
    /// cancelled) and its files are removed.
    pub(super) fn drop_replica(self: &Rc<Self>, cell: &QueueCell) {
        let key = cell.borrow().qref.key.clone();
        let (shard, index) = cell.borrow_mut().tear_down();
        self.set_deleting(&key);
        let dir = self.shared.config.queue_dir(&key.vhost, &key.name, true);
        self.shared.removals.begin(dir.clone());
        let me = self.clone();
        crate::core::spawn_soon(async move {
            super::store_files::destroy_shards(shard, index).await;
            super::store_files::remove_replica_files(dir.clone()).await;
            me.shared.removals.end(&dir);
            me.forget_slot(&key);
        });
    }

    /// Answers [`NodeMsg::SyncReplicas`]: once no queue of this core is still opening (its
    /// waiting ops are applied then), syncs every replicated queue's shard.
    pub(super) async fn sync_replicas(self: Rc<Self>, done: flume::Sender<bool>) {
        let deadline = Instant::now() + FLUSH_TIMEOUT;
        while self.any_opening() && Instant::now() < deadline {
            glommio::timer::sleep(Duration::from_millis(5)).await;
        }
        let mut ok = !self.any_opening();
        for cell in self.open_queues() {
            if !cell.borrow().replicated() {
                continue;
            }
            let shard = cell.borrow().shard.clone();
            if let Err(e) = shard.sync().await {
                tracing::warn!(error = %e, "replica sync failed; the metadata log keeps its entries");
                ok = false;
            }
            if let Err(e) = super::queue::sync_return_counts(&cell).await {
                tracing::warn!(error = %e, "replica return counts not synced; the metadata log keeps their entries");
                ok = false;
            }
        }
        let _ = done.send(ok);
    }

    /// Runs failover for the life of the core (a cluster node only): every [`WATCH_PERIOD`],
    /// step 1 on core 0, and step 2 whenever the topology changed (and once a second
    /// anyway, for a copy opened meanwhile).
    pub async fn watch_replicas(self: Rc<Self>) {
        let mut watch = GoneWatch::default();
        let mut grows = super::grow::GrowWatch::default();
        let (mut seen, mut last_full) = (u64::MAX, Instant::now());
        loop {
            glommio::timer::sleep(WATCH_PERIOD).await;
            if self.id == 0 {
                if let Some(remote) = &self.shared.remote {
                    remote.retry_held();
                }
                self.move_queues_of_gone_peers(&mut watch).await;
                self.grow_replica_sets(&mut grows).await;
            }
            let version = self.shared.meta.topology_version();
            if version != seen || last_full.elapsed() >= Duration::from_secs(1) {
                seen = version;
                last_full = Instant::now();
                self.reconcile_replicas().await;
                self.run_copiers();
            }
        }
    }

    /// Failover step 2: reopens every replicated queue of this core whose serving member
    /// changed in the metadata.
    pub(super) async fn reconcile_replicas(self: &Rc<Self>) {
        let me = self.shared.meta.node_id();
        let topo = self.router();
        let copying_here = self.grows_here();
        for cell in self.open_queues() {
            let (key, serving, replicated) = {
                let q = cell.borrow();
                (q.qref.key.clone(), q.serving(), q.replicated())
            };
            if !matches!(self.queue_slot(&key), Some(Some(c)) if Rc::ptr_eq(&c, &cell)) {
                // Reopened since this pass began (an operation took it over while an earlier
                // queue reopened): that open, under way or done, has the current role.
                continue;
            }
            let Some(def) = topo.topology.queue(&key.vhost, &key.name) else { continue };
            if replicated && !serving && !def.stored_on(me) && !copying_here.contains(&key) {
                // Out of the queue's replica set (its copy here missed messages, or the node
                // was forgotten): the copy goes; the queue lives on in its set.
                tracing::info!(queue = %key.name, vhost = %key.vhost, "this node left the queue's replica set: dropping its copy");
                self.drop_replica(&cell);
                continue;
            }
            if !replicated || !is_replicated(def, true) || (def.owner_node == me) == serving {
                continue;
            }
            log_new_role(&key, def.owner_node, me);
            self.reopen(&cell).await;
        }
    }

    /// Failover step 1, on core 0: on the metadata leader, moves the queues of peers gone
    /// for [`DOWN_AFTER`], each to a live node of its replica set.
    pub(super) async fn move_queues_of_gone_peers(self: &Rc<Self>, watch: &mut GoneWatch) {
        let GoneWatch { down_since, unplaced } = watch;
        let Some((links, figures)) = self.peer_liveness() else { return };
        let now = Instant::now();
        for &(peer, up) in &links {
            if up {
                down_since.remove(&peer);
            } else {
                down_since.entry(peer).or_insert(now);
            }
        }
        if !self.shared.meta.is_leader() {
            return;
        }
        let me = self.shared.meta.node_id();
        let mut live: Vec<NodeId> = links.iter().filter(|(_, up)| *up).map(|(id, _)| *id).chain([me]).collect();
        live.sort_unstable();
        let down: Vec<NodeId> = down_since.iter().filter(|(_, t)| now.duration_since(**t) >= DOWN_AFTER).map(|(id, _)| *id).collect();
        // A node the group forgot (`--forget-node`) is gone too, whether its link is known or not.
        let voters = &figures.voters;
        let forgotten = |n: NodeId| !voters.is_empty() && !voters.contains(&n) && n != me;
        live.retain(|n| !forgotten(*n));
        let topo = self.shared.meta.topology();
        let orphans: Vec<&crate::meta::QueueDef> =
            topo.queues.values().filter(|d| is_replicated(d, true) && (down.contains(&d.owner_node) || forgotten(d.owner_node))).collect();
        if orphans.is_empty() {
            unplaced.clear();
            return;
        }
        let mut still_unplaced = HashSet::new();
        let epochs = self.shared.meta.with_state(|s| s.boot_epochs.clone());
        let mut moves = Vec::new();
        for def in orphans {
            // Only a live node of its replica set holds its messages.
            let candidates: Vec<NodeId> = live.iter().copied().filter(|n| def.stored_on(*n)).collect();
            if candidates.is_empty() {
                if !unplaced.contains(&(def.vhost.clone(), def.name.clone())) {
                    tracing::warn!(queue = %def.name, vhost = %def.vhost, replicas = ?def.replicas, "every node of a queue's replica set is down: the queue waits for one of them");
                }
                still_unplaced.insert((def.vhost.clone(), def.name.clone()));
                continue;
            }
            let to = candidates
                [(crate::core::placement::owner_core(&def.vhost, &def.name, candidates.len() as u32)) as usize % candidates.len()];
            let to_epoch = epochs.get(&to).copied().unwrap_or(0);
            tracing::info!(queue = %def.name, vhost = %def.vhost, from = def.owner_node, to, "moving a queue off a node that is gone");
            moves.push(Command::MoveQueue { vhost: def.vhost.clone(), queue: def.name.clone(), from: def.owner_node, to, to_epoch });
        }
        *unplaced = still_unplaced;
        if moves.is_empty() {
            return;
        }
        if let Err(e) = self.shared.meta.propose_batch(moves).await {
            tracing::warn!(error = %e, "moving queues off a node that is gone failed; retried at the next check");
        }
    }
}

impl super::node::Node {
    /// Each peer and whether it is up: its link is up and (on the leader) raft-rs heard from
    /// it within an election timeout — a node frozen (SIGSTOP, a hung disk) whose kernel
    /// still answers TCP keeps its link up but stops answering heartbeats. With the cluster
    /// figures it was read from; `None` on a node without peers.
    pub(super) fn peer_liveness(&self) -> Option<(Vec<(NodeId, bool)>, crate::meta::ClusterFigures)> {
        let links = self.shared.peer_links.as_ref()?;
        let figures = self.shared.meta.cluster_figures();
        let silent = |peer: NodeId| figures.peers.iter().any(|p| p.id == peer && !p.recent_active);
        let links = links().into_iter().map(|(peer, up)| (peer, up && !silent(peer))).collect();
        Some((links, figures))
    }
}

/// What failover step 1 remembers between checks.
#[derive(Default)]
pub(super) struct GoneWatch {
    /// When each peer was first seen down.
    down_since: HashMap<NodeId, Instant>,
    /// Queues of gone nodes with no live node in their replica set (logged once).
    unplaced: HashSet<(String, String)>,
}

/// The log line of a copy changing role: this node (`me`) serves the queue now, or
/// `server` does and this node keeps a copy.
pub(super) fn log_new_role(key: &QueueKey, server: NodeId, me: NodeId) {
    if server == me {
        tracing::info!(queue = %key.name, vhost = %key.vhost, "queue leader moved here: serving the queue from this node's replica");
    } else {
        tracing::info!(queue = %key.name, vhost = %key.vhost, node = server, "queue leader moved to another node: keeping a replica here");
    }
}

/// Attaches this node's replica sink to the metadata group (a cluster node only).
pub fn attach(shared: &Arc<Shared>) {
    if shared.meta.is_cluster() {
        shared.meta.attach_data_sink(Arc::new(ReplicaSink::new(shared.meta.clone(), shared.inboxes.clone())));
    }
}
