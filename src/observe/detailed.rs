//! `GET /metrics/detailed?family=…[&family=…][&vhost=…]`: rabbitmq_prometheus's detailed
//! endpoint, for the families a node has figures of, under its `rabbitmq_detailed_` names:
//! - `queue_coarse_metrics`: `queue_messages_ready`, `queue_messages_unacked`,
//!   `queue_messages`, per queue (`vhost`, `queue` labels);
//! - `queue_consumer_count` and `queue_metrics`: `queue_consumers` per queue (of
//!   `queue_metrics` only that one: ringmq keeps no memory or per-queue byte figures);
//! - `queue_delivery_metrics`: `queue_messages_acked_total` per queue (the deliveries are
//!   not counted per ack mode and queue);
//! - `connection_churn_metrics`: connections, channels and queues opened/closed,
//!   declared/created/deleted on this node.
//!
//! `vhost` keeps the queues of those vhosts only. Families this node does not have (the
//! per-channel ones, `exchange_*`, `ra_metrics`…) are left out, as rabbitmq_prometheus
//! leaves out an unknown family; `rabbitmq_identity_info{rabbitmq_endpoint="detailed"}` and
//! `rabbitmq_build_info` come with every answer.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use super::rabbit::{self, Labeled};
use super::{Identity, Live, QueueSample, Stats};

/// The families and vhosts a request asks for.
#[derive(Debug, Default, PartialEq, Eq)]
struct Query {
    families: Vec<String>,
    vhosts: Vec<String>,
}

impl Query {
    /// Reads `family=a&family=b&vhost=%2F` (percent-decoded; other keys ignored).
    fn parse(query: &str) -> Query {
        let mut q = Query::default();
        for pair in query.split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_encoding::percent_decode_str(&v.replace('+', " ")).decode_utf8_lossy().into_owned();
            match k {
                "family" => q.families.push(v),
                "vhost" => q.vhosts.push(v),
                _ => {}
            }
        }
        q
    }

    fn wants(&self, family: &str) -> bool {
        self.families.iter().any(|f| f == family)
    }
}

type Pick = fn(&QueueSample) -> u64;

/// Everything one answer holds.
#[derive(Debug)]
struct Detailed {
    /// (name, help, per queue value) gauges.
    queue_gauges: Vec<(&'static str, &'static str, Pick)>,
    /// (name without `_total`, help, per queue value) counters.
    queue_counters: Vec<(&'static str, &'static str, Pick)>,
    queues: Vec<QueueSample>,
    /// Node-wide counters (name without `_total`).
    churn: Vec<(String, &'static str, u64)>,
    info: Vec<Labeled>,
}

impl prometheus_client::collector::Collector for Detailed {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, pick) in &self.queue_gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for q in &self.queues {
                let labels = [("vhost", q.vhost.as_str()), ("queue", q.name.as_str())];
                ConstGauge::new(i64::try_from(pick(q)).unwrap_or(i64::MAX)).encode(family.encode_family(&labels)?)?;
            }
        }
        for (name, help, pick) in &self.queue_counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for q in &self.queues {
                let labels = [("vhost", q.vhost.as_str()), ("queue", q.name.as_str())];
                ConstCounter::new(pick(q)).encode(family.encode_family(&labels)?)?;
            }
        }
        for (name, help, v) in &self.churn {
            let c = ConstCounter::new(*v);
            c.encode(encoder.encode_descriptor(name, help, None, MetricType::Counter)?)?;
        }
        super::encode_labeled(&mut encoder, &self.info)
    }
}

/// Renders the families `query` asks for (the request's query string, without `?`) from
/// this node's queues, counters and live objects, in the OpenMetrics text format.
pub fn render_detailed(query: &str, mut queues: Vec<QueueSample>, stats: &[Stats], live: &Live, id: &Identity) -> String {
    let q = Query::parse(query);
    if !q.vhosts.is_empty() {
        queues.retain(|s| q.vhosts.contains(&s.vhost));
    }
    let mut queue_gauges: Vec<(&'static str, &'static str, Pick)> = Vec::new();
    if q.wants("queue_coarse_metrics") {
        queue_gauges.extend([
            ("rabbitmq_detailed_queue_messages_ready", "Messages ready to be delivered to consumers", (|s: &QueueSample| s.ready) as Pick),
            ("rabbitmq_detailed_queue_messages_unacked", "Messages delivered to consumers but not yet acknowledged", |s| s.unacked),
            ("rabbitmq_detailed_queue_messages", "Sum of ready and unacknowledged messages - total queue depth", |s| s.ready + s.unacked),
        ]);
    }
    if q.wants("queue_consumer_count") || q.wants("queue_metrics") {
        queue_gauges.push(("rabbitmq_detailed_queue_consumers", "Consumers on a queue", |s| s.consumers));
    }
    let mut queue_counters: Vec<(&'static str, &'static str, Pick)> = Vec::new();
    if q.wants("queue_delivery_metrics") {
        queue_counters.push((
            "rabbitmq_detailed_queue_messages_acked",
            "Total number of messages acknowledged by consumers on a queue",
            |s| s.acked,
        ));
    }
    let mut churn = Vec::new();
    if q.wants("connection_churn_metrics") {
        const CHURN: [&str; 7] = [
            "rabbitmq_connections_opened",
            "rabbitmq_connections_closed",
            "rabbitmq_channels_opened",
            "rabbitmq_channels_closed",
            "rabbitmq_queues_declared",
            "rabbitmq_queues_created",
            "rabbitmq_queues_deleted",
        ];
        churn = rabbit::counters(stats, live)
            .into_iter()
            .filter(|(name, _, _)| CHURN.contains(name))
            .map(|(name, help, v)| (name.replacen("rabbitmq_", "rabbitmq_detailed_", 1), help, v))
            .collect();
    }
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(Detailed { queue_gauges, queue_counters, queues, churn, info: rabbit::info(id, "detailed") }));
    super::encode_with(&registry, "")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(vhost: &str, name: &str) -> QueueSample {
        QueueSample { vhost: vhost.into(), name: name.into(), ready: 3, unacked: 1, consumers: 2, acked: 5, ..Default::default() }
    }

    #[test]
    fn families_and_vhosts_select_the_series() {
        assert_eq!(
            Query::parse("family=queue_coarse_metrics&vhost=%2F&x=1"),
            Query { families: vec!["queue_coarse_metrics".into()], vhosts: vec!["/".into()] }
        );
        let stats = [Stats::default()];
        let live = Live::default();
        let _alive = live.channels.enter();
        let id = Identity { node: "ringmq@1".into(), cluster: "c".into(), ..Default::default() };
        let qs = || vec![sample("/", "a"), sample("v", "b")];
        let out = render_detailed("family=queue_coarse_metrics&family=queue_consumer_count&vhost=%2F", qs(), &stats, &live, &id);
        for line in [
            r#"rabbitmq_detailed_queue_messages_ready{vhost="/",queue="a"} 3"#,
            r#"rabbitmq_detailed_queue_messages{vhost="/",queue="a"} 4"#,
            r#"rabbitmq_detailed_queue_consumers{vhost="/",queue="a"} 2"#,
        ] {
            assert!(out.lines().any(|l| l == line), "no {line:?} in:\n{out}");
        }
        assert!(!out.contains(r#"queue="b""#), "vhost v is filtered out:\n{out}");
        assert!(out.contains(r#"rabbitmq_endpoint="detailed""#), "{out}");
        let out = render_detailed("family=connection_churn_metrics&family=queue_delivery_metrics", qs(), &stats, &live, &id);
        assert!(out.lines().any(|l| l == "rabbitmq_detailed_channels_opened_total 1"), "{out}");
        assert!(out.lines().any(|l| l == r#"rabbitmq_detailed_queue_messages_acked_total{vhost="v",queue="b"} 5"#), "{out}");
        let none = render_detailed("", qs(), &stats, &live, &id);
        assert!(!none.contains("rabbitmq_detailed_queue"), "{none}");
        assert!(none.trim_end().ends_with("# EOF"));
    }
}
