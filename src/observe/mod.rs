//! Observability: one [`Stats`] block of plain counters per core, summed on scrape into the
//! Prometheus text exposition format at `GET /metrics` on `--metrics-listen`.
//!
//! It renders what it is given ([`render`]: the cores' [`Stats`], resource [`Gauges`],
//! [`RaftFigures`], the node's [`Live`] objects and [`Identity`]) and imports nothing of the
//! layers above it; the broker hands [`serve_metrics`] the function that gathers them. The
//! metrics server is a plain std thread (it never runs on an executor).
//!
//! # Layout
//! - this file: the per-core [`Stats`], the latency histograms, `/metrics` and the server;
//! - `rabbit.rs`: rabbitmq_prometheus's families (global counters, churn, identity and build
//!   info, message sizes, Raft), and the [`Churn`] of channels, consumers and publishers;
//! - `per_object.rs`: `/metrics/per-object`; `detailed.rs`: `/metrics/detailed?family=…`.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

mod detailed;
pub mod log;
mod per_object;
mod rabbit;
mod stages;
pub use detailed::render_detailed;
pub use per_object::render_per_object;
pub use rabbit::{Alive, Churn, Live, SizeHistogram, SIZE_BOUNDS};
pub use stages::{sample, sample_at, sample_delivery, SamplePoint, Side, Stage, StageInfo, Stages, SAMPLE_EVERY, STAGES, STAGE_COUNT};

/// A latency histogram with power-of-two buckets from 1 µs to about 35 min, in the shape
/// of a Prometheus histogram. Written by one core, read on scrape (relaxed atomics).
#[derive(Debug)]
pub struct Histogram {
    /// `buckets[i]` counts samples ≤ 2^i µs (and above 2^(i-1) µs).
    buckets: [AtomicU64; Histogram::BUCKETS],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: std::array::from_fn(|_| AtomicU64::new(0)), sum_ns: AtomicU64::new(0), count: AtomicU64::new(0) }
    }
}

impl Histogram {
    /// Number of buckets (the last one also takes everything larger).
    pub const BUCKETS: usize = 32;

    /// Records one sample.
    pub fn record(&self, d: std::time::Duration) {
        let us = d.as_micros() as u64;
        let i = if us <= 1 { 0 } else { (64 - (us - 1).leading_zeros()) as usize }.min(Self::BUCKETS - 1);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

impl Histogram {
    /// The counts now (relaxed loads): per bucket, in all, and the sum in ns.
    pub fn counts(&self) -> HistogramCounts {
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
        HistogramCounts { buckets: self.buckets.iter().map(load).collect(), count: load(&self.count), sum_ns: load(&self.sum_ns) }
    }
}

/// A [`Histogram`]'s figures at one moment, to send across threads or sum.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HistogramCounts {
    /// Samples per bucket: `buckets[i]` counts those ≤ 2^i µs and above 2^(i-1) µs (the
    /// last one also everything larger); [`Histogram::BUCKETS`] entries, or none when empty.
    pub buckets: Vec<u64>,
    /// Samples in all.
    pub count: u64,
    /// Sum of the samples, ns.
    pub sum_ns: u64,
}

impl HistogramCounts {
    /// Adds `other`'s samples to these.
    pub fn add(&mut self, other: &HistogramCounts) {
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), 0);
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.count += other.count;
        self.sum_ns += other.sum_ns;
    }
}

/// The node's stage histograms: every core's summed, in [`STAGES`] order.
pub fn stage_counts(stats: &[Stats]) -> [HistogramCounts; STAGE_COUNT] {
    let mut sum: [HistogramCounts; STAGE_COUNT] = Default::default();
    for s in stats {
        for (acc, h) in sum.iter_mut().zip(s.stages.counts()) {
            acc.add(&h);
        }
    }
    sum
}

/// Counters of one core. Relaxed atomics: written by their core only, read on scrape.
/// Aligned to 128 bytes (two cache lines, as the adjacent-line prefetcher pairs them), so
/// that one core's counters never share a line with the next core's in `Vec<Stats>`.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct Stats {
    /// The latency of this core's sampled messages, per stage (`stages.rs`).
    pub stages: Stages,
    /// fdatasync calls of queue shards and unacked indexes (group commits).
    pub queue_syncs: AtomicU64,
    /// Connections accepted.
    pub connections_opened: AtomicU64,
    /// Connections closed.
    pub connections_closed: AtomicU64,
    /// Connections that moved to the core of the queue they publish to.
    pub connections_moved: AtomicU64,
    /// Messages published (basic.publish received).
    pub published: AtomicU64,
    /// Messages delivered (basic.deliver and basic.get-ok sent).
    pub delivered: AtomicU64,
    /// Deliveries acknowledged.
    pub acked: AtomicU64,
    /// Deliveries requeued.
    pub requeued: AtomicU64,
    /// Publisher confirms sent (basic.ack to publishers, per message).
    pub confirmed: AtomicU64,
    /// Unroutable mandatory messages returned.
    pub returned: AtomicU64,
    /// Publishes a queue could not store (disk full, store failed): nacked.
    pub store_refused: AtomicU64,
    /// Confirm-mode publishes left unanswered for `amqp::channel::CONFIRM_LIMIT` and nacked
    /// by their connection.
    pub confirms_given_up: AtomicU64,
    /// Queues whose store failed and were reopened from disk.
    pub store_reopens: AtomicU64,
    /// basic.deliver sent to consumers that acknowledge (no_ack false).
    pub delivered_consume_manual_ack: AtomicU64,
    /// basic.deliver sent to consumers with no_ack.
    pub delivered_consume_auto_ack: AtomicU64,
    /// basic.get-ok sent on basic.get with no_ack false.
    pub delivered_get_manual_ack: AtomicU64,
    /// basic.get-ok sent on basic.get with no_ack.
    pub delivered_get_auto_ack: AtomicU64,
    /// basic.get-empty sent.
    pub get_empty: AtomicU64,
    /// Deliveries (basic.deliver, basic.get-ok) with the redelivered flag.
    pub redelivered: AtomicU64,
    /// Publishes routed to at least one queue.
    pub routed: AtomicU64,
    /// Publishes routed to no queue and not mandatory: dropped.
    pub unroutable_dropped: AtomicU64,
    /// Publishes received on channels in confirm mode.
    pub received_confirm: AtomicU64,
    /// queue.declare (and the management API's declares) answered, passive or not.
    pub queues_declared: AtomicU64,
    /// Queues created by those declares.
    pub queues_created: AtomicU64,
    /// Queues deleted (queue.delete, the management API, auto-delete) on this node.
    pub queues_deleted: AtomicU64,
    /// Body sizes of the messages published.
    pub message_sizes: SizeHistogram,
}

impl Stats {
    /// Adds `n` to a counter of this core's `Stats`.
    ///
    /// A load and a store, not an atomic add: every counter has one writer, its core's
    /// thread, so no increment can be lost, and a `lock`-prefixed add per publish and per
    /// delivery was 2-3 % of a saturated core (`perf annotate` of the 16 B row). Scrapes
    /// read a value that is at most a few increments old.
    pub fn add(c: &AtomicU64, n: u64) {
        c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }
}

/// Resource gauges at scrape time (from the broker's alarms).
#[derive(Clone, Copy, Debug, Default)]
pub struct Gauges {
    /// Open file descriptors of the process.
    pub open_fds: u64,
    /// The open-files limit in force.
    pub max_fds: u64,
    /// Free bytes on the data directory's filesystem.
    pub disk_free_bytes: u64,
    /// The disk alarm threshold, bytes.
    pub disk_free_limit: u64,
    /// The free-disk alarm is raised.
    pub disk_alarm: bool,
    /// The file-descriptor alarm is raised.
    pub fd_alarm: bool,
    /// Resident memory of the process, bytes.
    pub memory_used: u64,
    /// The memory alarm threshold, bytes (0 = off).
    pub memory_limit: u64,
    /// The memory alarm is raised.
    pub memory_alarm: bool,
    /// Connections closed at accept because descriptors ran low (a counter).
    pub connections_refused: u64,
}

/// The metadata group's figures at scrape time.
#[derive(Clone, Debug, Default)]
pub struct RaftFigures {
    /// Raft entries appended by this node.
    pub entries_appended: u64,
    /// fdatasync calls of the Raft log.
    pub fsyncs: u64,
    /// Metadata commands applied.
    pub commands_applied: u64,
    /// This node leads the metadata group.
    pub is_leader: bool,
    /// Current Raft term.
    pub term: u64,
    /// Current leader's node id (0: none known).
    pub leader: u64,
    /// This node's role: "leader", "follower", "candidate" or "pre_candidate".
    pub role: &'static str,
    /// Highest committed log index known here.
    pub commit_index: u64,
    /// Highest log index applied here.
    pub applied_index: u64,
    /// Index of the last entry written to this node's log.
    pub last_index: u64,
    /// Index of the snapshot this node's log starts after.
    pub snapshot_index: u64,
    /// Request → applied time of this node's latest proposal, µs.
    pub commit_latency_us: u64,
    /// Times the known leader changed since start.
    pub leader_changes: u64,
    /// Every member of the cluster but this node (empty for a single node).
    pub peers: Vec<PeerFigures>,
    /// Voters of the group, this node included.
    pub members: u64,
    /// Replica sets being grown: queues being copied to a node (`meta::grow`).
    pub replica_grows: u64,
    /// Replicated queues whose replica set is smaller than their size.
    pub queues_below_replicas: u64,
}

/// One other member of the cluster at scrape time.
#[derive(Clone, Debug, Default)]
pub struct PeerFigures {
    /// Its node id.
    pub id: u64,
    /// The node-to-node link to it is up.
    pub up: bool,
    /// Raft entries it lacks (leader only; `None` elsewhere).
    pub lag: Option<u64>,
}

/// One queue's figures at scrape time, for `/metrics/per-object` and the node's totals.
#[derive(Clone, Debug, Default)]
pub struct QueueSample {
    /// Its vhost.
    pub vhost: String,
    /// Its name.
    pub name: String,
    /// Ready messages.
    pub ready: u64,
    /// Delivered, unsettled messages.
    pub unacked: u64,
    /// Consumers.
    pub consumers: u64,
    /// Messages enqueued since it opened in this run.
    pub published: u64,
    /// Deliveries (consumers and basic.get) since it opened in this run.
    pub delivered: u64,
    /// Acknowledgements since it opened in this run.
    pub acked: u64,
    /// Its stage histograms, in [`STAGES`] order (the per-node-only stages stay empty).
    pub stages: [HistogramCounts; STAGE_COUNT],
}

/// Who this node is, for `rabbitmq_identity_info` and `rabbitmq_build_info`.
#[derive(Clone, Debug, Default)]
pub struct Identity {
    /// The node's name (`ringmq@<id>`).
    pub node: String,
    /// The cluster's name, the same on every node.
    pub cluster: String,
    /// The cluster's permanent id (a UUID), the same on every node.
    pub cluster_permanent_id: String,
    /// The RabbitMQ version this broker answers as.
    pub rabbitmq_version: String,
    /// Open connections on this node.
    pub connections: u64,
    /// Time since the broker started, ms.
    pub uptime_ms: u64,
}

/// The role names of [`RaftFigures::role`], one `ringmq_raft_role` series each.
const ROLES: [&str; 4] = ["leader", "follower", "candidate", "pre_candidate"];

/// A latency histogram summed over the cores at scrape time.
#[derive(Debug, Clone)]
struct HistogramSnapshot {
    /// Non-cumulative count per bucket, by upper bound in seconds (2^i µs).
    buckets: Vec<(f64, u64)>,
    sum_seconds: f64,
    count: u64,
}

impl HistogramSnapshot {
    fn of_counts(h: &HistogramCounts) -> HistogramSnapshot {
        let mut buckets: Vec<(f64, u64)> =
            (0..Histogram::BUCKETS).map(|i| ((1u64 << i) as f64 / 1e6, h.buckets.get(i).copied().unwrap_or(0))).collect();
        // The last bucket already takes everything larger: +Inf adds nothing to it.
        buckets.push((f64::MAX, 0));
        HistogramSnapshot { buckets, sum_seconds: h.sum_ns as f64 / 1e9, count: h.count }
    }
}

/// Everything one scrape reports, read once (relaxed loads) and handed to the encoder.
#[derive(Debug)]
struct Snapshot {
    /// (name without `_total`, help, value); the encoder appends `_total`.
    counters: Vec<(&'static str, &'static str, u64)>,
    /// (name, help, value).
    gauges: Vec<(&'static str, &'static str, i64)>,
    /// (stage label, histogram) of `ringmq_stage_latency_seconds`.
    stages: Vec<(&'static str, HistogramSnapshot)>,
    /// Gauges with labels.
    labeled: Vec<rabbit::Labeled>,
}

impl prometheus_client::collector::Collector for Snapshot {
    fn encode(&self, mut encoder: prometheus_client::encoding::DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::{EncodeMetric, NoLabelSet};
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        for &(name, help, v) in &self.counters {
            let c = ConstCounter::new(v);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        for &(name, help, v) in &self.gauges {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        encode_labeled(&mut encoder, &self.labeled)?;
        let help = "Per-stage latency of sampled messages (one in 16 per core); the stages are described in the management API at /api/ringmq/latency.";
        let mut family = encoder.encode_descriptor("ringmq_stage_latency_seconds", help, None, MetricType::Histogram)?;
        for (stage, h) in &self.stages {
            let labels = [("stage", *stage)];
            family.encode_family(&labels)?.encode_histogram::<NoLabelSet>(h.sum_seconds, h.count, &h.buckets, None)?;
        }
        Ok(())
    }
}

/// Encodes gauges with labels, one family each.
fn encode_labeled(
    encoder: &mut prometheus_client::encoding::DescriptorEncoder,
    labeled: &[rabbit::Labeled],
) -> Result<(), std::fmt::Error> {
    use prometheus_client::encoding::EncodeMetric;
    use prometheus_client::metrics::gauge::ConstGauge;
    for (name, help, series) in labeled {
        let mut family = encoder.encode_descriptor(name, help, None, prometheus_client::metrics::MetricType::Gauge)?;
        for (labels, v) in series {
            let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
            ConstGauge::new(*v).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// Encodes `registry` and puts `extra` (families written by hand, in the text format) before
/// the closing `# EOF`.
fn encode_with(registry: &prometheus_client::registry::Registry, extra: &str) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    if let Some(at) = out.rfind("# EOF") {
        out.insert_str(at, extra);
    }
    out
}

/// Renders every core's counters and histograms (summed), the resource gauges, the
/// metadata group's figures and this node's objects (`live`) in the OpenMetrics text format
/// (prometheus-client's encoder; Prometheus reads it as it reads its own text format):
/// ringmq's own families and rabbitmq_prometheus's (`rabbit.rs`).
pub fn render(stats: &[Stats], a: &Gauges, raft: &RaftFigures, queues: &[QueueSample], id: &Identity, live: &Live) -> String {
    let sum = |f: fn(&Stats) -> &AtomicU64| stats.iter().map(|s| f(s).load(Ordering::Relaxed)).sum::<u64>();
    let mut counters = rabbit::counters(stats, live);
    counters.extend([
        ("ringmq_connections_opened", "Connections accepted.", sum(|s| &s.connections_opened)),
        ("ringmq_connections_closed", "Connections closed.", sum(|s| &s.connections_closed)),
        ("ringmq_connections_moved", "Connections moved to the core of the queue they publish to.", sum(|s| &s.connections_moved)),
        ("ringmq_messages_published", "Messages received by basic.publish.", sum(|s| &s.published)),
        ("ringmq_messages_delivered", "Messages sent by basic.deliver or basic.get-ok.", sum(|s| &s.delivered)),
        ("ringmq_messages_acked", "Deliveries acknowledged.", sum(|s| &s.acked)),
        ("ringmq_messages_requeued", "Deliveries requeued.", sum(|s| &s.requeued)),
        ("ringmq_messages_confirmed", "Publisher confirms sent.", sum(|s| &s.confirmed)),
        ("ringmq_messages_returned", "Unroutable mandatory messages returned.", sum(|s| &s.returned)),
        ("ringmq_queue_syncs", "Group commits (fdatasync) of queue shards and unacked indexes.", sum(|s| &s.queue_syncs)),
        ("ringmq_messages_store_refused", "Publishes a queue could not store (nacked).", sum(|s| &s.store_refused)),
        ("ringmq_confirms_given_up", "Publishes nacked by their connection after 30 s without an answer.", sum(|s| &s.confirms_given_up)),
        ("ringmq_queue_store_reopens", "Queues reopened from disk after their store failed.", sum(|s| &s.store_reopens)),
        ("ringmq_connections_refused", "Connections closed at accept: file descriptors low.", a.connections_refused),
        ("ringmq_log_lines_dropped", "Log lines not written to stderr (its reader gone or too slow).", log::dropped()),
        ("ringmq_raft_entries", "Raft entries appended by this node.", raft.entries_appended),
        ("ringmq_raft_fsyncs", "fdatasync calls of the Raft log.", raft.fsyncs),
        ("ringmq_raft_commands", "Metadata commands applied.", raft.commands_applied),
        ("ringmq_raft_leader_changes", "Times the metadata group's known leader changed.", raft.leader_changes),
    ]);
    // Resource gauges under rabbitmq_prometheus's names, so existing dashboards read them.
    let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let mut gauges = rabbit::gauges(queues, id, live, raft);
    gauges.extend([
        ("rabbitmq_process_open_fds", "Open file descriptors.", g(a.open_fds)),
        ("rabbitmq_process_max_fds", "Open file descriptors limit.", g(a.max_fds)),
        ("rabbitmq_disk_space_available_bytes", "Disk space available in bytes.", g(a.disk_free_bytes)),
        ("rabbitmq_disk_space_available_limit_bytes", "Free disk space low watermark in bytes.", g(a.disk_free_limit)),
        ("rabbitmq_alarms_free_disk_space_watermark", "is 1 if free disk space watermark alarm is in effect", a.disk_alarm as i64),
        ("rabbitmq_alarms_file_descriptor_limit", "is 1 if file descriptor limit alarm is in effect", a.fd_alarm as i64),
        ("rabbitmq_alarms_memory_used_watermark", "is 1 if VM memory watermark alarm is in effect", a.memory_alarm as i64),
        ("rabbitmq_process_resident_memory_bytes", "Memory used in bytes", g(a.memory_used)),
        ("rabbitmq_resident_memory_limit_bytes", "Memory high watermark in bytes", g(a.memory_limit)),
        ("ringmq_raft_is_leader", "1 when this node leads the metadata group.", raft.is_leader as i64),
        ("ringmq_raft_term", "Current Raft term of the metadata group.", g(raft.term)),
        ("ringmq_raft_leader_id", "Node id of the metadata group's leader (0: none known).", g(raft.leader)),
        ("ringmq_raft_commit_index", "Highest metadata log index known committed.", g(raft.commit_index)),
        ("ringmq_raft_applied_index", "Highest metadata log index applied here.", g(raft.applied_index)),
        ("ringmq_cluster_members", "Voters of the metadata group, this node included.", g(raft.members)),
        ("ringmq_cluster_replica_grows", "Queues being copied to a node joining their replica set.", g(raft.replica_grows)),
        (
            "ringmq_cluster_queues_below_replicas",
            "Replicated queues whose replica set is smaller than their size (they grow back onto live nodes).",
            g(raft.queues_below_replicas),
        ),
    ]);
    let one = |label: &'static str, value: String, v: i64| (vec![(label, value)], v);
    let mut labeled = rabbit::info(id, "aggregated");
    labeled.extend([
        (
            "ringmq_raft_role",
            "1 for this node's role in the metadata group.",
            ROLES.iter().map(|r| one("role", r.to_string(), (*r == raft.role) as i64)).collect(),
        ),
        (
            "ringmq_cluster_peer_up",
            "1 while the link to that peer is up.",
            raft.peers.iter().map(|p| one("peer", p.id.to_string(), p.up as i64)).collect(),
        ),
        (
            "ringmq_raft_replication_lag_entries",
            "Metadata log entries a peer lacks (reported by the leader).",
            raft.peers.iter().filter_map(|p| Some(one("peer", p.id.to_string(), g(p.lag?)))).collect(),
        ),
    ]);
    let stages = STAGES.iter().zip(&stage_counts(stats)).map(|(stage, h)| (stage.name, HistogramSnapshot::of_counts(h))).collect();
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(Snapshot { counters, gauges, stages, labeled }));
    encode_with(&registry, &(rabbit::message_sizes(stats) + &rabbit::commit_latency(raft)))
}

/// The Content-Type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Most scrapes served at once.
const MAX_SCRAPES: u64 = 16;

/// Answers one HTTP request on `stream` (2 s read timeout).
fn answer(mut stream: std::net::TcpStream, render: &(dyn Fn(&str, &str) -> Option<String> + Send + Sync)) {
    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(2)));
    let mut line = String::new();
    let Ok(clone) = stream.try_clone() else { return };
    let mut reader = BufReader::new(clone);
    if reader.read_line(&mut line).is_err() {
        return;
    }
    // Drain headers (bounded).
    for _ in 0..100 {
        let mut h = String::new();
        match reader.read_line(&mut h) {
            Ok(0) | Err(_) => break,
            Ok(_) if h == "\r\n" || h == "\n" => break,
            Ok(_) => {}
        }
    }
    // "GET /metrics/detailed?family=x HTTP/1.1" → ("/metrics/detailed", "family=x").
    let target = line.strip_prefix("GET ").and_then(|r| r.split_whitespace().next());
    let (status, body) = match target.and_then(|t| {
        let (path, query) = t.split_once('?').unwrap_or((t, ""));
        render(path, query)
    }) {
        Some(text) => ("200 OK", text),
        None => ("404 Not Found", "not found; try /metrics, /metrics/per-object or /metrics/detailed?family=…\n".to_string()),
    };
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// The function a scrape calls with the request's path (`/metrics`, `/metrics/per-object`,
/// `/metrics/detailed`) and query string (without `?`; empty when none) for the exposition
/// text; `None` for a path it does not serve (404).
pub type RenderFn = Arc<dyn Fn(&str, &str) -> Option<String> + Send + Sync>;

/// Serves `GET /metrics` (and whatever else `render` answers) on `addr` from a background
/// thread, answering each scrape with `render(path, query)`. Returns the address it listens on; `None` when it could not bind (logged:
/// metrics stay off, the broker still runs, and its ready line says so).
pub fn serve_metrics(addr: SocketAddr, render: RenderFn) -> Option<SocketAddr> {
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "metrics endpoint disabled: cannot bind");
            return None;
        }
    };
    let bound = listener.local_addr().unwrap_or(addr);
    let busy = Arc::new(AtomicU64::new(0));
    let spawned = std::thread::Builder::new().name("ringmq-metrics".into()).spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            // One short-lived thread per scrape, at most MAX_SCRAPES at once: a client that
            // connects and sends nothing must not hold up the others.
            if busy.load(Ordering::Relaxed) >= MAX_SCRAPES {
                continue;
            }
            busy.fetch_add(1, Ordering::Relaxed);
            let (render, busy) = (render.clone(), busy.clone());
            let started = std::thread::Builder::new().name("ringmq-scrape".into()).spawn(move || {
                answer(stream, &*render);
                busy.fetch_sub(1, Ordering::Relaxed);
            });
            if started.is_err() {
                tracing::warn!("metrics: could not start a scrape thread");
            }
        }
    });
    match spawned {
        Ok(_) => Some(bound),
        Err(e) => {
            tracing::warn!(error = %e, "metrics thread did not start");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn buckets_are_cumulative_powers_of_two() {
        let s = Stats::default();
        s.stages.record(Stage::WrittenToAcked, Duration::from_nanos(500)); // ≤ 1 µs
        s.stages.record(Stage::WrittenToAcked, Duration::from_micros(3)); // ≤ 4 µs
        s.stages.record(Stage::WrittenToAcked, Duration::from_micros(4)); // ≤ 4 µs
        s.stages.record(Stage::WrittenToAcked, Duration::from_secs(100_000)); // last bucket
        Stats::add(&s.published, 7);
        let q = QueueSample { ready: 3, unacked: 1, consumers: 2, ..Default::default() };
        s.message_sizes.record(100);
        s.message_sizes.record(5_000_000);
        let id = Identity {
            node: "ringmq@1".into(),
            cluster: "prod".into(),
            cluster_permanent_id: "u".into(),
            connections: 4,
            ..Default::default()
        };
        let live = Live::default();
        let (_channel, _consumer) = (live.channels.enter(), live.consumers.enter());
        drop(live.channels.enter());
        let out = render(&[s], &Gauges { disk_alarm: true, ..Default::default() }, &RaftFigures::default(), &[q.clone(), q], &id, &live);
        let series = |name: &str| -> Option<f64> {
            out.lines().find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.parse().ok()))
        };
        let bucket = |le: &str| series(&format!("ringmq_stage_latency_seconds_bucket{{le=\"{le}\",stage=\"written_to_acked\"}}"));
        assert_eq!(bucket("1e-6").or(bucket("0.000001")), Some(1.0), "{out}");
        assert_eq!(bucket("4e-6").or(bucket("0.000004")), Some(3.0), "{out}");
        assert_eq!(bucket("+Inf"), Some(4.0), "{out}");
        assert_eq!(series("ringmq_stage_latency_seconds_count{stage=\"written_to_acked\"}"), Some(4.0), "{out}");
        assert_eq!(series("ringmq_messages_published_total"), Some(7.0), "{out}");
        assert_eq!(series("rabbitmq_alarms_free_disk_space_watermark"), Some(1.0), "{out}");
        assert_eq!(series("rabbitmq_global_messages_received_total"), Some(7.0), "{out}");
        assert_eq!(series("rabbitmq_queue_messages_ready"), Some(6.0), "summed over the queues: {out}");
        assert_eq!(series("rabbitmq_queue_messages"), Some(8.0), "{out}");
        assert_eq!(series("rabbitmq_queues"), Some(2.0), "{out}");
        assert_eq!(series("rabbitmq_connections"), Some(4.0), "{out}");
        let identity = r#"rabbitmq_identity_info{rabbitmq_node="ringmq@1",rabbitmq_cluster="prod",rabbitmq_cluster_permanent_id="u",rabbitmq_endpoint="aggregated"}"#;
        assert_eq!(series(identity), Some(1.0), "{out}");
        assert_eq!(series("rabbitmq_channels"), Some(1.0), "one of two channels still open: {out}");
        assert_eq!(series("rabbitmq_channels_opened_total"), Some(2.0), "{out}");
        assert_eq!(series("rabbitmq_channels_closed_total"), Some(1.0), "{out}");
        assert_eq!(series("rabbitmq_consumers"), Some(1.0), "{out}");
        assert_eq!(series("rabbitmq_message_size_bytes_bucket{protocol=\"amqp091\",le=\"100.0\"}"), Some(1.0), "{out}");
        assert_eq!(series("rabbitmq_message_size_bytes_bucket{protocol=\"amqp091\",le=\"1e+06\"}"), Some(1.0), "{out}");
        assert_eq!(series("rabbitmq_message_size_bytes_bucket{protocol=\"amqp091\",le=\"1e+07\"}"), Some(2.0), "{out}");
        assert_eq!(series("rabbitmq_message_size_bytes_count{protocol=\"amqp091\"}"), Some(2.0), "{out}");
        assert!(out.contains("# TYPE ringmq_messages_published counter"), "{out}");
        assert!(out.trim_end().ends_with("# EOF"), "{out}");
    }
}
