//! The figures of the queues this node serves, gathered on scrape for the Prometheus
//! endpoint: each queue's owner core answers a `QueueOp::Info` by message passing (all asked
//! at once, [`FIGURES_WAIT`] at most), from the scrape's own thread, never a core's.

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

    /// This node's identity and open connections, for `rabbitmq_identity_info` and
    /// `rabbitmq_connections`.
    pub fn identity(&self) -> Identity {
        Identity { node: format!("ringmq@{}", self.meta.node_id()), connections: self.clients.list().len() as u64 }
    }
}
