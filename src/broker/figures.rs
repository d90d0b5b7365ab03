//! What a scrape of the Prometheus endpoint reads, gathered on the scrape's own thread,
//! never a core's: the cores' counters, the alarms, the metadata group's figures, this
//! node's identity (the cluster's name from the metadata), and the figures of the queues
//! this node serves (each queue's owner core answers a `QueueOp::Info` by message passing,
//! all asked at once, [`FIGURES_WAIT`] at most).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::node::{NodeMsg, Shared};
use super::{QueueInfo, QueueOp, QueueRef};
use crate::meta::state::QueueDef;
use crate::observe::{Identity, QueueSample};

/// How long a scrape waits for the queues' answers.
pub const FIGURES_WAIT: Duration = Duration::from_secs(2);

impl Shared {
    /// One [`QueueSample`] per queue this node serves (a replicated queue on the node that
    /// serves it; its other members report nothing of it), in vhost and name order. A queue
    /// that does not answer within [`FIGURES_WAIT`] is left out.
    pub fn queue_samples(&self) -> Vec<QueueSample> {
        let here = self.meta.node_id();
        let topo = self.meta.topology();
        let mut defs: Vec<_> = topo.queues.values().filter(|d| d.owner_node == here).collect();
        defs.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
        let asked: Vec<_> = defs.iter().filter_map(|d| self.ask_info(d, false).map(|rx| (d, rx))).collect();
        let deadline = Instant::now() + FIGURES_WAIT;
        asked
            .into_iter()
            .filter_map(|(d, rx)| {
                let i = rx.recv_deadline(deadline).ok()?;
                Some(QueueSample {
                    vhost: d.vhost.clone(),
                    name: d.name.clone(),
                    ready: i.messages_ready,
                    unacked: i.messages_unacked,
                    consumers: i.consumers.len() as u64,
                    published: i.counters.published,
                    delivered: i.counters.delivered,
                    acked: i.counters.acked,
                    stages: i.stages,
                })
            })
            .collect()
    }

    /// Asks the owner core of `def`, a queue this node serves, for its [`QueueInfo`] (with its
    /// outstanding deliveries when `with_unacked`); the receiver gets the one answer. `None`
    /// when the core's inbox is closed (the broker is stopping).
    pub fn ask_info(&self, def: &QueueDef, with_unacked: bool) -> Option<flume::Receiver<QueueInfo>> {
        let qref = QueueRef::of(def, self.cores);
        let (reply, rx) = flume::bounded(1);
        let op = QueueOp::Info { with_unacked, reply };
        self.inboxes.send(qref.owner_core as usize, NodeMsg::Queue { queue: qref, op }).ok().map(|()| rx)
    }

    /// This node's identity and open connections, for `rabbitmq_identity_info`,
    /// `rabbitmq_build_info` and `rabbitmq_connections`.
    pub fn identity(&self) -> Identity {
        let cluster = super::cluster_name::identity(&self.meta.topology());
        Identity {
            node: format!("ringmq@{}", self.meta.node_id()),
            cluster: cluster.name,
            cluster_permanent_id: cluster.permanent_id,
            rabbitmq_version: super::RABBITMQ_COMPAT_VERSION.to_owned(),
            connections: self.clients.list().len() as u64,
            uptime_ms: self.started.elapsed().as_millis() as u64,
        }
    }

    /// Replicated queues whose replica set is smaller than their size (capped at `voters`):
    /// those `broker/grow.rs` grows back.
    fn queues_below_replicas(&self, voters: &[crate::meta::NodeId]) -> u64 {
        if voters.len() < 2 {
            return 0;
        }
        let topo = self.meta.topology();
        topo.queues.values().filter(|q| super::replicas::below_size(self, q, voters.len())).count() as u64
    }

    /// The Prometheus text of every core's counters, the alarms and the metadata group
    /// (`observe::render` does the formatting).
    pub fn metrics_text(&self) -> String {
        let a = &self.alarms;
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
        let gauges = crate::observe::Gauges {
            open_fds: load(&a.open_fds),
            max_fds: load(&a.max_fds),
            disk_free_bytes: load(&a.disk_free_bytes),
            disk_free_limit: a.disk_free_limit.load(Ordering::Relaxed),
            disk_alarm: a.disk_alarm(),
            fd_alarm: a.fd_alarm.load(Ordering::Relaxed),
            memory_used: load(&a.memory_used),
            memory_limit: load(&a.memory_limit),
            memory_alarm: a.memory_alarm(),
            connections_refused: load(&a.connections_refused),
        };
        let m = self.meta.stats();
        let f = self.meta.cluster_figures();
        let links = self.peer_links.as_ref().map(|l| l()).unwrap_or_default();
        let peers = links
            .iter()
            .map(|&(id, up)| crate::observe::PeerFigures { id, up, lag: f.peers.iter().find(|p| p.id == id).map(|p| p.lag) })
            .collect();
        let raft = crate::observe::RaftFigures {
            entries_appended: m.entries_appended,
            fsyncs: m.fsyncs,
            commands_applied: m.commands_applied,
            is_leader: self.meta.is_leader(),
            term: f.term,
            leader: f.leader,
            role: f.role.name(),
            commit_index: f.commit_index,
            applied_index: f.applied_index,
            last_index: f.last_index,
            snapshot_index: f.snapshot_index,
            commit_latency_us: f.commit_latency_us,
            leader_changes: f.leader_changes,
            peers,
            members: f.voters.len() as u64,
            replica_grows: self.meta.with_state(|s| s.growing.len() as u64),
            queues_below_replicas: self.queues_below_replicas(&f.voters),
        };
        crate::observe::render(&self.stats, &gauges, &raft, &self.queue_samples(), &self.identity(), &self.live)
    }
}
