//! rabbitmq_prometheus's families, under its names, so RabbitMQ's Grafana dashboards
//! (RabbitMQ-Overview, RabbitMQ-Quorum-Queues-Raft) read a ringmq node as they read a
//! RabbitMQ node: every panel joins on `rabbitmq_identity_info{rabbitmq_cluster=…}`.
//!
//! Names, help texts and labels follow rabbitmq_prometheus's collectors
//! (`prometheus_rabbitmq_core_metrics_collector`, `…_global_metrics_collector`,
//! `…_message_size_metrics_collector`, `…_raft_metrics_collector`). What a node counts:
//! - per core, plain counters in [`Stats`] (one writer each), summed on scrape;
//! - objects that live on a connection (channels, consumers, publishers): a [`Churn`] per
//!   kind, counted up when one is made and down when its [`Alive`] guard is dropped, so
//!   every way it can end (close, cancel, a dropped connection) is counted.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Identity, QueueSample, RaftFigures, Stats};

/// Upper bounds of `rabbitmq_message_size_bytes`, bytes, with the `le` text RabbitMQ writes
/// (the dashboards select buckets by that text: `le="100.0"`, `le="1e+06"`).
pub const SIZE_BOUNDS: [(u64, &str); 8] = [
    (100, "100.0"),
    (1_000, "1000.0"),
    (10_000, "10000.0"),
    (100_000, "100000.0"),
    (1_000_000, "1e+06"),
    (10_000_000, "1e+07"),
    (50_000_000, "5e+07"),
    (100_000_000, "1e+08"),
];

/// Message body sizes at publish, in [`SIZE_BOUNDS`]' buckets (the last one takes the
/// rest). One writer: its core ([`Stats::add`]).
#[derive(Debug, Default)]
pub struct SizeHistogram {
    /// Non-cumulative counts; `buckets[8]` counts bodies above 100 MB.
    buckets: [AtomicU64; 9],
    /// Sum of the sizes, bytes.
    sum: AtomicU64,
}

impl SizeHistogram {
    /// Records one body of `bytes` bytes.
    pub fn record(&self, bytes: u64) {
        let i = SIZE_BOUNDS.iter().position(|&(b, _)| bytes <= b).unwrap_or(SIZE_BOUNDS.len());
        Stats::add(&self.buckets[i], 1);
        Stats::add(&self.sum, bytes);
    }
}

/// How many objects of one kind were made and ended on this node; alive = made − ended.
/// Atomic adds: objects are made and ended on any core (a connection moves between
/// cores), and far more rarely than messages.
#[derive(Debug, Default)]
pub struct Churn {
    made: AtomicU64,
    ended: AtomicU64,
}

impl Churn {
    /// Counts one object made; it is counted ended when the guard is dropped.
    pub fn enter(self: &Arc<Self>) -> Alive {
        self.made.fetch_add(1, Ordering::Relaxed);
        Alive(self.clone())
    }

    /// (made, ended) now.
    pub fn counts(&self) -> (u64, u64) {
        // Ended first: a scrape between the two loads never sees more ended than made.
        let ended = self.ended.load(Ordering::Relaxed);
        (self.made.load(Ordering::Relaxed), ended)
    }

    /// Objects alive now.
    pub fn alive(&self) -> u64 {
        let (made, ended) = self.counts();
        made.saturating_sub(ended)
    }
}

/// One live object of a [`Churn`]: counted ended when dropped.
#[derive(Debug)]
pub struct Alive(Arc<Churn>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.ended.fetch_add(1, Ordering::Relaxed);
    }
}

/// This node's channels, consumers and publishers (channels that published).
#[derive(Debug, Default)]
pub struct Live {
    /// Channels opened and closed.
    pub channels: Arc<Churn>,
    /// Consumers (basic.consume) started and ended.
    pub consumers: Arc<Churn>,
    /// Channels that published at least once, and their ends.
    pub publishers: Arc<Churn>,
}

/// (name without `_total`, help, value): a counter.
pub(super) type Family = (&'static str, &'static str, u64);
/// (name, help, [(labels, value)]): a gauge with labels.
pub(super) type Labeled = (&'static str, &'static str, Vec<(Vec<(&'static str, String)>, i64)>);

/// The counters rabbitmq_prometheus exports in `/metrics`, summed over `stats`.
pub(super) fn counters(stats: &[Stats], live: &Live) -> Vec<Family> {
    let sum = |f: fn(&Stats) -> &AtomicU64| stats.iter().map(|s| f(s).load(Ordering::Relaxed)).sum::<u64>();
    let (channels_opened, channels_closed) = live.channels.counts();
    vec![
        ("rabbitmq_global_messages_received", "Total number of messages received from publishers", sum(|s| &s.published)),
        (
            "rabbitmq_global_messages_received_confirm",
            "Total number of messages received from publishers expecting confirmations",
            sum(|s| &s.received_confirm),
        ),
        ("rabbitmq_global_messages_routed", "Total number of messages routed to queues or streams", sum(|s| &s.routed)),
        (
            "rabbitmq_global_messages_unroutable_dropped",
            "Total number of messages published as non-mandatory into an exchange and dropped as unroutable",
            sum(|s| &s.unroutable_dropped),
        ),
        (
            "rabbitmq_global_messages_unroutable_returned",
            "Total number of messages published as mandatory into an exchange and returned to the publisher as unroutable",
            sum(|s| &s.returned),
        ),
        ("rabbitmq_global_messages_confirmed", "Total number of messages confirmed to publishers", sum(|s| &s.confirmed)),
        ("rabbitmq_global_messages_delivered", "Total number of messages delivered to consumers", sum(|s| &s.delivered)),
        (
            "rabbitmq_global_messages_delivered_consume_manual_ack",
            "Total number of messages delivered to consumers using basic.consume with manual acknowledgment",
            sum(|s| &s.delivered_consume_manual_ack),
        ),
        (
            "rabbitmq_global_messages_delivered_consume_auto_ack",
            "Total number of messages delivered to consumers using basic.consume with automatic acknowledgment",
            sum(|s| &s.delivered_consume_auto_ack),
        ),
        (
            "rabbitmq_global_messages_delivered_get_manual_ack",
            "Total number of messages delivered to consumers using basic.get with manual acknowledgment",
            sum(|s| &s.delivered_get_manual_ack),
        ),
        (
            "rabbitmq_global_messages_delivered_get_auto_ack",
            "Total number of messages delivered to consumers using basic.get with automatic acknowledgment",
            sum(|s| &s.delivered_get_auto_ack),
        ),
        ("rabbitmq_global_messages_get_empty", "Total number of times basic.get operations fetched no message", sum(|s| &s.get_empty)),
        ("rabbitmq_global_messages_redelivered", "Total number of messages redelivered to consumers", sum(|s| &s.redelivered)),
        ("rabbitmq_global_messages_acknowledged", "Total number of messages acknowledged by consumers", sum(|s| &s.acked)),
        // The per-channel families, aggregated as rabbitmq_prometheus's `/metrics` does (one
        // series for the node), counted since the node started.
        ("rabbitmq_channel_messages_published", "Total number of messages published into an exchange on a channel", sum(|s| &s.published)),
        (
            "rabbitmq_channel_messages_confirmed",
            "Total number of messages published into an exchange and confirmed on the channel",
            sum(|s| &s.confirmed),
        ),
        (
            "rabbitmq_channel_messages_unroutable_returned",
            "Total number of messages published as mandatory into an exchange and returned to the publisher as unroutable",
            sum(|s| &s.returned),
        ),
        (
            "rabbitmq_channel_messages_unroutable_dropped",
            "Total number of messages published as non-mandatory into an exchange and dropped as unroutable",
            sum(|s| &s.unroutable_dropped),
        ),
        (
            "rabbitmq_channel_get_ack",
            "Total number of messages fetched with basic.get in manual acknowledgement mode",
            sum(|s| &s.delivered_get_manual_ack),
        ),
        (
            "rabbitmq_channel_get",
            "Total number of messages fetched with basic.get in automatic acknowledgement mode",
            sum(|s| &s.delivered_get_auto_ack),
        ),
        ("rabbitmq_channel_get_empty", "Total number of times basic.get operations fetched no message", sum(|s| &s.get_empty)),
        (
            "rabbitmq_channel_messages_delivered_ack",
            "Total number of messages delivered to consumers in manual acknowledgement mode",
            sum(|s| &s.delivered_consume_manual_ack),
        ),
        (
            "rabbitmq_channel_messages_delivered",
            "Total number of messages delivered to consumers in automatic acknowledgement mode",
            sum(|s| &s.delivered_consume_auto_ack),
        ),
        ("rabbitmq_channel_messages_redelivered", "Total number of messages redelivered to consumers", sum(|s| &s.redelivered)),
        ("rabbitmq_channel_messages_acked", "Total number of messages acknowledged by consumers", sum(|s| &s.acked)),
        ("rabbitmq_connections_opened", "Total number of connections opened", sum(|s| &s.connections_opened)),
        ("rabbitmq_connections_closed", "Total number of connections closed or terminated", sum(|s| &s.connections_closed)),
        ("rabbitmq_channels_opened", "Total number of channels opened", channels_opened),
        ("rabbitmq_channels_closed", "Total number of channels closed", channels_closed),
        ("rabbitmq_queues_declared", "Total number of queues declared", sum(|s| &s.queues_declared)),
        ("rabbitmq_queues_created", "Total number of queues created", sum(|s| &s.queues_created)),
        ("rabbitmq_queues_deleted", "Total number of queues deleted", sum(|s| &s.queues_deleted)),
    ]
}

/// The gauges rabbitmq_prometheus exports in `/metrics` that come from the node's objects
/// (the resource gauges are `super::render`'s).
pub(super) fn gauges(queues: &[QueueSample], id: &Identity, live: &Live, raft: &RaftFigures) -> Vec<(&'static str, &'static str, i64)> {
    let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let queue_sum = |f: fn(&QueueSample) -> u64| g(queues.iter().map(f).sum::<u64>());
    let consumers = g(live.consumers.alive());
    vec![
        ("rabbitmq_queues", "Queues available", g(queues.len() as u64)),
        ("rabbitmq_queue_messages_ready", "Messages ready to be delivered to consumers", queue_sum(|q| q.ready)),
        ("rabbitmq_queue_messages_unacked", "Messages delivered to consumers but not yet acknowledged", queue_sum(|q| q.unacked)),
        ("rabbitmq_queue_messages", "Sum of ready and unacknowledged messages - total queue depth", queue_sum(|q| q.ready + q.unacked)),
        ("rabbitmq_queue_consumers", "Consumers on a queue", queue_sum(|q| q.consumers)),
        ("rabbitmq_connections", "Connections currently open", g(id.connections)),
        ("rabbitmq_channels", "Channels currently open", g(live.channels.alive())),
        ("rabbitmq_consumers", "Consumers currently connected", consumers),
        ("rabbitmq_channel_consumers", "Consumers on a channel", consumers),
        ("rabbitmq_global_publishers", "Current number of publishers", g(live.publishers.alive())),
        ("rabbitmq_global_consumers", "Current number of consumers", consumers),
        ("rabbitmq_erlang_uptime_seconds", "Node uptime (here: the broker process's)", g(id.uptime_ms / 1000)),
        // The metadata group (which also carries every replicated queue's log) under
        // rabbitmq_prometheus's Raft names.
        ("rabbitmq_raft_term", "Current Raft term of the metadata group", g(raft.term)),
        ("rabbitmq_raft_commit_index", "Index of the last entry committed in the metadata group's log", g(raft.commit_index)),
        ("rabbitmq_raft_last_applied", "Index of the last entry applied to the metadata state here", g(raft.applied_index)),
        ("rabbitmq_raft_last_written_index", "Index of the last entry written to this node's metadata log", g(raft.last_index)),
        ("rabbitmq_raft_snapshot_index", "Index of the snapshot this node's metadata log starts after", g(raft.snapshot_index)),
    ]
}

/// `rabbitmq_identity_info` (with `rabbitmq_endpoint`: "aggregated" for `/metrics`,
/// "per-object", "detailed") and `rabbitmq_build_info`.
pub(super) fn info(id: &Identity, endpoint: &str) -> Vec<Labeled> {
    let version = env!("CARGO_PKG_VERSION").to_string();
    vec![
        (
            "rabbitmq_identity_info",
            "RabbitMQ node & cluster identity info",
            vec![(
                vec![
                    ("rabbitmq_node", id.node.clone()),
                    ("rabbitmq_cluster", id.cluster.clone()),
                    ("rabbitmq_cluster_permanent_id", id.cluster_permanent_id.clone()),
                    ("rabbitmq_endpoint", endpoint.to_string()),
                ],
                1,
            )],
        ),
        (
            "rabbitmq_build_info",
            "RabbitMQ & Erlang/OTP version info (here: the RabbitMQ version ringmq answers as, and ringmq's own)",
            vec![(
                vec![
                    ("product_name", "ringmq".to_string()),
                    ("product_version", version.clone()),
                    ("rabbitmq_version", id.rabbitmq_version.clone()),
                    ("prometheus_plugin_version", version),
                    ("prometheus_client_version", "0.24".to_string()),
                    ("erlang_version", "none".to_string()),
                ],
                1,
            )],
        ),
    ]
}

/// `rabbitmq_message_size_bytes{protocol="amqp091"}`, summed over `stats`, in the text
/// format (written by hand: the dashboards select buckets by RabbitMQ's `le` text, which the
/// encoder would write otherwise, `1000000.0` for `1e+06`).
pub(super) fn message_sizes(stats: &[Stats]) -> String {
    let mut buckets = [0u64; 9];
    let mut sum = 0u64;
    for s in stats {
        for (acc, b) in buckets.iter_mut().zip(&s.message_sizes.buckets) {
            *acc += b.load(Ordering::Relaxed);
        }
        sum += s.message_sizes.sum.load(Ordering::Relaxed);
    }
    let name = "rabbitmq_message_size_bytes";
    let mut out = format!("# HELP {name} Size of messages received from publishers\n# TYPE {name} histogram\n");
    let mut cumulative = 0;
    for (i, count) in buckets.iter().enumerate() {
        cumulative += count;
        let le = SIZE_BOUNDS.get(i).map_or("+Inf", |b| b.1);
        let _ = writeln!(out, "{name}_bucket{{protocol=\"amqp091\",le=\"{le}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_sum{{protocol=\"amqp091\"}} {sum}\n{name}_count{{protocol=\"amqp091\"}} {cumulative}");
    out
}

/// `rabbitmq_raft_commit_latency_seconds`, a float gauge (written by hand beside
/// [`message_sizes`]).
pub(super) fn commit_latency(raft: &RaftFigures) -> String {
    let name = "rabbitmq_raft_commit_latency_seconds";
    format!(
        "# HELP {name} Time taken for a log entry to be committed (the metadata group: this node's latest proposal)\n# TYPE {name} gauge\n{name} {}\n",
        raft.commit_latency_us as f64 / 1e6
    )
}
