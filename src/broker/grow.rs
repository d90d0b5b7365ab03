//! Growing replica sets back to their size, the node's side (`meta::grow` is the metadata's,
//! `queue/copy.rs` the queue's): RabbitMQ's continuous membership reconciliation of quorum
//! queues, on by default here.
//!
//! # Steps
//! 1. On the metadata leader, core 0, every [`GROW_PERIOD`]: a replicated queue whose set is
//!    smaller than its size (`x-quorum-initial-group-size` or `--replicas`, capped at the
//!    voters) and whose server is up gets a `GrowReplicaSet` to a live voter outside the set:
//!    the one storing the fewest queues ([`crate::core::placement::grow_target`]). At most
//!    [`MAX_GROWS`] grows run at once, and a (queue, node) pair is not tried again within
//!    [`RETRY_AFTER`] (a copy that failed on the node, say on a full disk, is not retried in
//!    a loop). Sets shrink when a node leaves them (a snapshot made it miss messages) or the
//!    cluster (`--forget-node`); a node that joins the cluster takes queues declared while
//!    the cluster was smaller than their size.
//! 2. On every core, whenever the metadata changed (and once a second): a growing queue this
//!    node serves on this core runs its copier (`queue/copy.rs`), opening the queue first if
//!    nothing has opened it since the start.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::{QueueKey, QueueOp, QueueRef};
use crate::meta::state::Command;
use crate::meta::NodeId;

/// How often the leader looks for replica sets to grow.
pub const GROW_PERIOD: Duration = Duration::from_secs(1);
/// Most grows under way at once in the cluster: each copies a queue through the log.
pub const MAX_GROWS: usize = 2;
/// A grow of the same queue to the same node is not started again within this time.
pub const RETRY_AFTER: Duration = Duration::from_secs(30);

/// What step 1 remembers between checks (on the leader's core 0).
#[derive(Default)]
pub struct GrowWatch {
    last_check: Option<Instant>,
    /// When each (queue, node) grow was last started here.
    started: HashMap<(String, String, NodeId), Instant>,
}

impl super::node::Node {
    /// The queues being copied to this node (their copies here are kept).
    pub(super) fn grows_here(&self) -> HashSet<QueueKey> {
        let me = self.shared.meta.node_id();
        self.shared.meta.with_state(|s| s.growing.iter().filter(|(_, g)| g.node == me).map(|((v, q), _)| QueueKey::new(v, q)).collect())
    }

    /// Step 2: runs the copier of every growing queue this core serves.
    pub(super) fn run_copiers(self: &std::rc::Rc<Self>) {
        let me = self.shared.meta.node_id();
        let growing: Vec<((String, String), u64, NodeId)> =
            self.shared.meta.with_state(|s| s.growing.iter().map(|(k, g)| (k.clone(), g.id, g.node)).collect());
        if growing.is_empty() {
            return;
        }
        let topo = self.router();
        for ((vhost, name), id, node) in growing {
            let Some(qref) = topo.queue_ref(&vhost, &name) else { continue };
            if qref.owner_node != me || qref.owner_core % self.shared.cores != self.id {
                continue;
            }
            match self.queue_slot(&qref.key) {
                Some(Some(cell)) => super::queue::copy::start_copy(&cell, id, node),
                Some(None) => {}
                // Opened by an operation that does nothing; the next check starts the copier.
                None => self.open_for_copy(qref),
            }
        }
    }

    fn open_for_copy(self: &std::rc::Rc<Self>, qref: QueueRef) {
        let (reply, _answer) = super::reply_channel();
        self.send_from_connection(&qref, QueueOp::Stats { reply });
    }

    /// Step 1, on core 0 (every call; acts once per [`GROW_PERIOD`], on the metadata leader).
    pub(super) async fn grow_replica_sets(self: &std::rc::Rc<Self>, watch: &mut GrowWatch) {
        let now = Instant::now();
        if watch.last_check.is_some_and(|t| now.duration_since(t) < GROW_PERIOD) || !self.shared.meta.is_leader() {
            return;
        }
        watch.last_check = Some(now);
        watch.started.retain(|_, t| now.duration_since(*t) < RETRY_AFTER);
        let Some((links, figures)) = self.peer_liveness() else { return };
        let me = self.shared.meta.node_id();
        let voters = figures.voters;
        let live: Vec<NodeId> = links.iter().filter(|(_, up)| *up).map(|(id, _)| *id).chain([me]).filter(|n| voters.contains(n)).collect();
        let under_way = self.shared.meta.with_state(|s| s.growing.len());
        if under_way >= MAX_GROWS || voters.len() < 2 {
            return;
        }
        let topo = self.shared.meta.topology();
        let mut load = super::replicas::replica_load(&topo, &voters);
        let busy: HashSet<(String, String)> = self.shared.meta.with_state(|s| s.growing.keys().cloned().collect());
        let mut grows = Vec::new();
        for def in topo.queues.values() {
            if under_way + grows.len() >= MAX_GROWS {
                break;
            }
            let key = (def.vhost.clone(), def.name.clone());
            if !super::replicas::below_size(&self.shared, def, voters.len()) || busy.contains(&key) || !live.contains(&def.owner_node) {
                continue;
            }
            let candidates: Vec<NodeId> = live
                .iter()
                .copied()
                .filter(|n| !def.replicas.contains(n) && !watch.started.contains_key(&(def.vhost.clone(), def.name.clone(), *n)))
                .collect();
            let stored = |n: NodeId| load.get(&n).copied().unwrap_or(0);
            let Some(node) = crate::core::placement::grow_target(&def.vhost, &def.name, &candidates, stored) else { continue };
            *load.entry(node).or_default() += 1;
            watch.started.insert((def.vhost.clone(), def.name.clone(), node), now);
            let id = super::ids::cluster_unique_id(me, self.shared.next_id());
            tracing::info!(queue = %def.name, vhost = %def.vhost, node, replicas = ?def.replicas, "growing a queue's replica set: copying it to a node");
            grows.push(Command::GrowReplicaSet { vhost: def.vhost.clone(), queue: def.name.clone(), node, id });
        }
        if grows.is_empty() {
            return;
        }
        if let Err(e) = self.shared.meta.propose_batch(grows).await {
            tracing::warn!(error = %e, "growing replica sets failed; retried later");
        }
    }
}
