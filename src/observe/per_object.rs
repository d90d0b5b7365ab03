//! `GET /metrics/per-object`: rabbitmq_prometheus's per-object queue figures, one series per
//! queue with `vhost` and `queue` labels (the names its dashboards read), and ringmq's own
//! per-queue figures beside them: deliveries, acknowledgements and the per-stage latency
//! histogram `ringmq_queue_stage_latency_seconds{vhost,queue,stage}`, so a latency profile
//! can be taken of one queue (a stage with no sample yet has no series). Each node reports the queues it serves.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use super::{HistogramSnapshot, QueueSample, STAGES};

/// The samples and the node's identity (`rabbitmq_endpoint="per-object"`), encoded on scrape.
#[derive(Debug)]
struct PerObject(Vec<QueueSample>, Vec<super::rabbit::Labeled>);

type Pick = fn(&QueueSample) -> u64;

impl prometheus_client::collector::Collector for PerObject {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let gauges: [(&str, &str, Pick); 4] = [
            ("rabbitmq_queue_messages_ready", "Messages ready to be delivered to consumers", |q| q.ready),
            ("rabbitmq_queue_messages_unacked", "Messages delivered to consumers but not yet acknowledged", |q| q.unacked),
            ("rabbitmq_queue_messages", "Sum of ready and unacknowledged messages - total queue depth", |q| q.ready + q.unacked),
            ("rabbitmq_queue_consumers", "Consumers on a queue", |q| q.consumers),
        ];
        for (name, help, pick) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for q in &self.0 {
                let labels = [("vhost", q.vhost.as_str()), ("queue", q.name.as_str())];
                ConstGauge::new(i64::try_from(pick(q)).unwrap_or(i64::MAX)).encode(family.encode_family(&labels)?)?;
            }
        }
        let counters: [(&str, &str, Pick); 3] = [
            ("rabbitmq_queue_messages_published", "Messages published to queues", |q| q.published),
            ("ringmq_queue_messages_delivered", "Messages delivered to consumers or by basic.get since the queue opened", |q| q.delivered),
            ("ringmq_queue_messages_acked", "Deliveries acknowledged since the queue opened", |q| q.acked),
        ];
        for (name, help, pick) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for q in &self.0 {
                let labels = [("vhost", q.vhost.as_str()), ("queue", q.name.as_str())];
                ConstCounter::new(pick(q)).encode(family.encode_family(&labels)?)?;
            }
        }
        let help = "Per-stage latency of one queue's sampled messages (the stages measured per queue; /api/ringmq/latency describes them).";
        let mut family = encoder.encode_descriptor("ringmq_queue_stage_latency_seconds", help, None, MetricType::Histogram)?;
        for q in &self.0 {
            for (stage, h) in STAGES.iter().zip(&q.stages) {
                let h = HistogramSnapshot::of_counts(h);
                if h.count == 0 {
                    // A stage nothing passed through yet has no series: 1,000 idle queues
                    // would otherwise add ~12 MB of empty buckets to every scrape.
                    continue;
                }
                let labels = [("vhost", q.vhost.as_str()), ("queue", q.name.as_str()), ("stage", stage.name)];
                family.encode_family(&labels)?.encode_histogram::<NoLabelSet>(h.sum_seconds, h.count, &h.buckets, None)?;
            }
        }
        super::encode_labeled(&mut encoder, &self.1)
    }
}

/// Renders `queues` and this node's `rabbitmq_identity_info` and `rabbitmq_build_info` in
/// the OpenMetrics text format (as [`super::render`]).
pub fn render_per_object(queues: Vec<QueueSample>, id: &super::Identity) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(PerObject(queues, super::rabbit::info(id, "per-object"))));
    super::encode_with(&registry, "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::Histogram;

    #[test]
    fn each_queue_is_a_labelled_series() {
        let h = Histogram::default();
        h.record(std::time::Duration::from_micros(3));
        let q = QueueSample {
            vhost: "/".into(),
            name: "jobs".into(),
            ready: 5,
            unacked: 2,
            consumers: 1,
            published: 9,
            delivered: 4,
            acked: 2,
            stages: std::array::from_fn(|i| if i == 1 { h.counts() } else { Default::default() }),
        };
        let out = render_per_object(vec![q], &crate::observe::Identity::default());
        for line in [
            r#"rabbitmq_queue_messages_ready{vhost="/",queue="jobs"} 5"#,
            r#"rabbitmq_queue_messages_unacked{vhost="/",queue="jobs"} 2"#,
            r#"rabbitmq_queue_messages{vhost="/",queue="jobs"} 7"#,
            r#"rabbitmq_queue_consumers{vhost="/",queue="jobs"} 1"#,
            r#"rabbitmq_queue_messages_published_total{vhost="/",queue="jobs"} 9"#,
            r#"ringmq_queue_stage_latency_seconds_count{vhost="/",queue="jobs",stage="publish_to_stored"} 1"#,
        ] {
            assert!(out.lines().any(|l| l == line), "no {line:?} in:\n{out}");
        }
        assert!(!out.contains(r#"stage="enqueued_to_taken""#), "an empty stage has no series:\n{out}");
        assert!(out.trim_end().ends_with("# EOF"));
    }
}
