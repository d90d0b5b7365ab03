//! The Prometheus endpoint (issue 5 item 6: per-stage latency histograms; issue 39 item 5:
//! rabbitmq_prometheus's families, `/metrics/detailed`, one cluster name on every node) and
//! the auto-delete exchange lifecycle, through lapin and ringmqctl.

mod common;

use std::io::{Read, Write};

use common::cluster::{labelled_metric_value, run, Cluster};
use common::http::{get_json, ringmqctl};
use common::*;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::ExchangeKind;

fn scrape(port: u16) -> String {
    scrape_path(port, "/metrics")
}

fn scrape_path(port: u16, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics port");
    s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_messages_and_stage_latencies() {
    let b = Broker::start();
    require_own_broker!(b, "reads ringmq's metrics endpoint");
    let (c, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "metrics").await;
    confirm_mode(&ch).await;
    for i in 0..64u8 {
        assert!(publish_confirmed(&ch, "", &q, &[i], Default::default()).await.is_ack());
    }
    let mut cons = t("consume", ch.basic_consume(q.as_str().into(), "".into(), Default::default(), FieldTable::default())).await.unwrap();
    for _ in 0..64 {
        let d = next_delivery(&mut cons, std::time::Duration::from_secs(5)).await;
        t("ack", d.ack(Default::default())).await.unwrap();
    }
    // The acks reach the queue's core after the client sent them: scrape (bounded) until
    // every one is counted.
    let port = b.metrics_port();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let text = loop {
        let text = tokio::task::spawn_blocking(move || scrape(port)).await.unwrap();
        let acked = text.lines().find_map(|l| l.strip_prefix("ringmq_messages_acked_total ").and_then(|v| v.trim().parse::<f64>().ok()));
        if acked.is_some_and(|n| n >= 64.0) || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(value(&text, "ringmq_messages_published_total") >= 64.0);
    assert!(value(&text, "ringmq_messages_delivered_total") >= 64.0);
    assert!(value(&text, "ringmq_messages_acked_total") >= 64.0);
    assert!(value(&text, "ringmq_messages_confirmed_total") >= 64.0);
    // Every stage samples one message (or delivery) in 16 per core, and only those: 64
    // publishes and 64 acknowledged deliveries give 4 each (2 to 8 with two cores sharing
    // them). A transient message has no publish_to_stored step.
    let stages =
        ["publish_to_enqueued", "publish_to_confirmed", "enqueued_to_taken", "taken_to_written", "written_to_acked", "taken_to_acked"];
    for stage in stages {
        let n = value(&text, &format!("ringmq_stage_latency_seconds_count{{stage=\"{stage}\"}}"));
        assert!((2.0..=8.0).contains(&n), "stage {stage}: {n} samples of 64");
        let inf = value(&text, &format!("ringmq_stage_latency_seconds_bucket{{le=\"+Inf\",stage=\"{stage}\"}}"));
        assert_eq!(inf, n, "+Inf bucket equals the count");
    }
    assert_eq!(value(&text, "ringmq_stage_latency_seconds_count{stage=\"publish_to_stored\"}"), 0.0, "transient messages are never stored");
    // Persistent messages in a durable queue: stored once synced.
    let durable = declare_queue(&ch, &uniq("metrics-durable"), QueueDeclareOptions::durable(), FieldTable::default()).await;
    let persistent = lapin::BasicProperties::default().with_delivery_mode(2);
    for i in 0..32u8 {
        assert!(publish_confirmed(&ch, "", &durable, &[i], persistent.clone()).await.is_ack());
    }
    let text = tokio::task::spawn_blocking(move || scrape(port)).await.unwrap();
    let stored = value(&text, "ringmq_stage_latency_seconds_count{stage=\"publish_to_stored\"}");
    assert!((1.0..=4.0).contains(&stored), "publish_to_stored: {stored} samples of 32 persistent messages");
    assert_eq!(value(&text, "ringmq_raft_is_leader"), 1.0);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_delete_exchange_goes_with_its_last_binding() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    let x = uniq("adx");
    let opts = ExchangeDeclareOptions { auto_delete: true, ..Default::default() };
    t("declare x", ch.exchange_declare(x.as_str().into(), ExchangeKind::Fanout, opts, FieldTable::default())).await.unwrap();
    let q = plain_queue(&ch, "adq").await;
    t("bind", ch.queue_bind(q.as_str().into(), x.as_str().into(), "".into(), Default::default(), FieldTable::default())).await.unwrap();
    assert!(exchange_exists(&c, &x).await, "auto-delete exchange with a binding exists");
    t("unbind", ch.queue_unbind(q.as_str().into(), x.as_str().into(), "".into(), FieldTable::default())).await.unwrap();
    assert!(!exchange_exists(&c, &x).await, "auto-delete exchange deleted with its last binding");
    t("close", c.close(200, "".into())).await.unwrap();
}

/// rabbitmq_prometheus's names, on /metrics summed over the node's queues and on
/// /metrics/per-object one series per queue (with ringmq's per-queue stage histograms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_object_metrics_name_each_queue_with_rabbitmqs_series() {
    let b = Broker::start();
    require_own_broker!(b, "reads ringmq's metrics endpoint");
    let (_c, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "per-object").await;
    let idle = plain_queue(&ch, "per-object-idle").await;
    confirm_mode(&ch).await;
    for i in 0..40u8 {
        assert!(publish_confirmed(&ch, "", &q, &[i], Default::default()).await.is_ack());
    }
    // 8 of them held by a consumer, unacknowledged.
    t("qos", ch.basic_qos(8, Default::default())).await.unwrap();
    let mut cons = t("consume", ch.basic_consume(q.as_str().into(), "".into(), Default::default(), FieldTable::default())).await.unwrap();
    for _ in 0..8 {
        next_delivery(&mut cons, std::time::Duration::from_secs(5)).await;
    }
    let port = b.metrics_port();
    let labels = |name: &str| format!("{{vhost=\"/\",queue=\"{name}\"}}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let text = loop {
        let text = tokio::task::spawn_blocking(move || scrape_path(port, "/metrics/per-object")).await.unwrap();
        let unacked = format!("rabbitmq_queue_messages_unacked{}", labels(&q));
        if text.lines().any(|l| l == format!("{unacked} 8")) || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(value(&text, &format!("rabbitmq_queue_messages_ready{}", labels(&q))), 32.0);
    assert_eq!(value(&text, &format!("rabbitmq_queue_messages_unacked{}", labels(&q))), 8.0);
    assert_eq!(value(&text, &format!("rabbitmq_queue_messages{}", labels(&q))), 40.0);
    assert_eq!(value(&text, &format!("rabbitmq_queue_consumers{}", labels(&q))), 1.0);
    assert_eq!(value(&text, &format!("rabbitmq_queue_messages_published_total{}", labels(&q))), 40.0);
    assert_eq!(value(&text, &format!("rabbitmq_queue_messages{}", labels(&idle))), 0.0);
    let enqueued = format!("ringmq_queue_stage_latency_seconds_count{{vhost=\"/\",queue=\"{q}\",stage=\"publish_to_enqueued\"}}");
    assert!(value(&text, &enqueued) >= 1.0, "40 publishes, one in 16 sampled");
    assert!(!text.contains("stage=\"written_to_acked\""), "a stage measured by connections has no per-queue series");
    // The node's totals under the same names.
    let total = tokio::task::spawn_blocking(move || scrape(port)).await.unwrap();
    assert_eq!(value(&total, "rabbitmq_queues"), 2.0);
    assert_eq!(value(&total, "rabbitmq_queue_messages_ready"), 32.0);
    assert_eq!(value(&total, "rabbitmq_queue_messages_unacked"), 8.0);
    assert!(value(&total, "rabbitmq_global_messages_received_total") >= 40.0);
    assert_eq!(value(&total, "rabbitmq_connections"), 1.0);
    assert_eq!(labelled_metric_value(&total, "rabbitmq_identity_info", "rabbitmq_node", "ringmq@1"), Some(1.0), "{total}");
    let missing = tokio::task::spawn_blocking(move || scrape_path(port, "/nope")).await.unwrap();
    assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
}

/// Every series of `text` (one scrape) as `name{labels}` → value.
fn series(text: &str) -> std::collections::HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// What the client did, counted by rabbitmq_prometheus's families (as the RabbitMQ-Overview
/// dashboard reads them): each one moves by exactly what the client did between two scrapes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_families_count_what_the_client_did() {
    let b = Broker::start();
    require_own_broker!(b, "reads ringmq's metrics endpoint");
    let port = b.metrics_port();
    let scrape_now = || async move { series(&tokio::task::spawn_blocking(move || scrape(port)).await.unwrap()) };
    let before = scrape_now().await;
    let c = connect(&b).await;
    let (publisher, consumer) = (t("channel", c.create_channel()).await.unwrap(), t("channel", c.create_channel()).await.unwrap());
    let q = plain_queue(&publisher, "families").await;
    confirm_mode(&publisher).await;
    for i in 0..5u8 {
        assert!(publish_confirmed(&publisher, "", &q, &[i; 200], Default::default()).await.is_ack());
    }
    // One unroutable dropped, one unroutable returned (mandatory).
    assert!(publish_confirmed(&publisher, "", "no-such-queue", b"x", Default::default()).await.is_ack());
    let mandatory = BasicPublishOptions { mandatory: true, ..Default::default() };
    let pc = t("publish", publisher.basic_publish("".into(), "no-such-queue".into(), mandatory, b"y", Default::default())).await.unwrap();
    t("confirm", pc).await.unwrap();
    // Five deliveries with manual ack; two nacked back and redelivered; all five acked.
    let mut cons =
        t("consume", consumer.basic_consume(q.as_str().into(), "".into(), Default::default(), FieldTable::default())).await.unwrap();
    let first: Vec<_> = {
        let mut v = Vec::new();
        for _ in 0..5 {
            v.push(next_delivery(&mut cons, std::time::Duration::from_secs(5)).await);
        }
        v
    };
    for d in &first[..2] {
        t("nack", d.nack(BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
    }
    for d in &first[2..] {
        t("ack", d.ack(Default::default())).await.unwrap();
    }
    for _ in 0..2 {
        let d = next_delivery(&mut cons, std::time::Duration::from_secs(5)).await;
        assert!(d.redelivered);
        t("ack", d.ack(Default::default())).await.unwrap();
    }
    // basic.get: one empty, one with auto-ack, one with manual ack.
    let getter = t("channel", c.create_channel()).await.unwrap();
    let q2 = plain_queue(&getter, "families-get").await;
    assert!(get_body(&getter, &q2).await.is_none());
    publish(&getter, "", &q2, b"a").await;
    publish(&getter, "", &q2, b"b").await;
    wait_ready(&getter, &q2, 2, std::time::Duration::from_secs(5)).await;
    assert!(get_body(&getter, &q2).await.is_some());
    let g = t("get", getter.basic_get(q2.as_str().into(), BasicGetOptions { no_ack: false })).await.unwrap().expect("a message");
    t("ack", g.delivery.ack(Default::default())).await.unwrap();
    t("delete", getter.queue_delete(q2.as_str().into(), Default::default())).await.unwrap();
    // Scrape (bounded) until the last ack is counted.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let after = loop {
        let s = scrape_now().await;
        let acked = s.get("rabbitmq_global_messages_acknowledged_total").copied().unwrap_or(0.0);
        if acked - before.get("rabbitmq_global_messages_acknowledged_total").copied().unwrap_or(0.0) >= 6.0
            || std::time::Instant::now() > deadline
        {
            break s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let moved = |name: &str| after.get(name).copied().unwrap_or(f64::NAN) - before.get(name).copied().unwrap_or(0.0);
    for (name, n) in [
        ("rabbitmq_global_messages_received_total", 9.0),
        ("rabbitmq_global_messages_received_confirm_total", 7.0),
        ("rabbitmq_global_messages_routed_total", 7.0),
        ("rabbitmq_global_messages_confirmed_total", 7.0),
        ("rabbitmq_global_messages_unroutable_dropped_total", 1.0),
        ("rabbitmq_global_messages_unroutable_returned_total", 1.0),
        ("rabbitmq_global_messages_delivered_consume_manual_ack_total", 7.0),
        ("rabbitmq_global_messages_delivered_consume_auto_ack_total", 0.0),
        ("rabbitmq_global_messages_delivered_get_auto_ack_total", 1.0),
        ("rabbitmq_global_messages_delivered_get_manual_ack_total", 1.0),
        ("rabbitmq_global_messages_get_empty_total", 1.0),
        ("rabbitmq_global_messages_redelivered_total", 2.0),
        ("rabbitmq_global_messages_acknowledged_total", 6.0),
        ("rabbitmq_channel_messages_published_total", 9.0),
        ("rabbitmq_channel_messages_confirmed_total", 7.0),
        ("rabbitmq_channel_messages_delivered_ack_total", 7.0),
        ("rabbitmq_channel_messages_redelivered_total", 2.0),
        ("rabbitmq_channel_messages_acked_total", 6.0),
        ("rabbitmq_channel_messages_unroutable_dropped_total", 1.0),
        ("rabbitmq_channel_messages_unroutable_returned_total", 1.0),
        ("rabbitmq_channel_get_total", 1.0),
        ("rabbitmq_channel_get_ack_total", 1.0),
        ("rabbitmq_channel_get_empty_total", 1.0),
        ("rabbitmq_channels_opened_total", 3.0),
        ("rabbitmq_channels_closed_total", 0.0),
        ("rabbitmq_queues_declared_total", 2.0),
        ("rabbitmq_queues_created_total", 2.0),
        ("rabbitmq_queues_deleted_total", 1.0),
        ("rabbitmq_message_size_bytes_count{protocol=\"amqp091\"}", 9.0),
        ("rabbitmq_message_size_bytes_bucket{protocol=\"amqp091\",le=\"100.0\"}", 4.0),
        ("rabbitmq_message_size_bytes_bucket{protocol=\"amqp091\",le=\"1000.0\"}", 9.0),
    ] {
        assert_eq!(moved(name), n, "{name}");
    }
    // The harness's own readiness probe may be counted too (a TCP connection).
    assert!(moved("rabbitmq_connections_opened_total") >= 1.0);
    for (name, n) in [
        ("rabbitmq_connections", 1.0),
        ("rabbitmq_channels", 3.0),
        ("rabbitmq_consumers", 1.0),
        ("rabbitmq_channel_consumers", 1.0),
        ("rabbitmq_global_consumers", 1.0),
        ("rabbitmq_global_publishers", 2.0),
        ("rabbitmq_queues", 1.0),
    ] {
        assert_eq!(after.get(name).copied(), Some(n), "{name}");
    }
    let text = tokio::task::spawn_blocking(move || scrape(port)).await.unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let default = format!("ringmq@{}", host.trim());
    assert_eq!(labelled_metric_value(&text, "rabbitmq_identity_info", "rabbitmq_cluster", &default), Some(1.0), "{text}");
    assert_eq!(labelled_metric_value(&text, "rabbitmq_identity_info", "rabbitmq_endpoint", "aggregated"), Some(1.0), "{text}");
    assert_eq!(labelled_metric_value(&text, "rabbitmq_build_info", "product_name", "ringmq"), Some(1.0), "{text}");
    // The channels and the consumer end with the connection.
    t("close", c.close(200, "".into())).await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = scrape_now().await;
        let gone = ["rabbitmq_channels", "rabbitmq_consumers", "rabbitmq_global_publishers", "rabbitmq_connections"]
            .iter()
            .all(|n| s.get(*n) == Some(&0.0));
        if gone {
            assert_eq!(
                s.get("rabbitmq_channels_closed_total").copied().unwrap_or(0.0)
                    - before.get("rabbitmq_channels_closed_total").copied().unwrap_or(0.0),
                3.0
            );
            break;
        }
        assert!(std::time::Instant::now() < deadline, "channels, consumers or publishers left after the close: {s:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // /metrics/detailed: the queue families asked for, in the vhost asked for.
    let path = "/metrics/detailed?family=queue_coarse_metrics&family=queue_consumer_count&vhost=%2F".to_string();
    let detailed = tokio::task::spawn_blocking(move || scrape_path(port, &path)).await.unwrap();
    assert!(detailed.starts_with("HTTP/1.1 200"), "{detailed}");
    let labels = format!("{{vhost=\"/\",queue=\"{q}\"}}");
    assert_eq!(value(&detailed, &format!("rabbitmq_detailed_queue_messages{labels}")), 0.0);
    assert_eq!(value(&detailed, &format!("rabbitmq_detailed_queue_consumers{labels}")), 0.0);
    assert_eq!(labelled_metric_value(&detailed, "rabbitmq_identity_info", "rabbitmq_endpoint", "detailed"), Some(1.0), "{detailed}");
    let other =
        tokio::task::spawn_blocking(move || scrape_path(port, "/metrics/detailed?family=queue_coarse_metrics&vhost=other")).await.unwrap();
    assert!(!other.contains("rabbitmq_detailed_queue_messages{"), "vhost other has no queue: {other}");
}

/// One name for the whole cluster: every node of a real 3-node cluster reports the same
/// default name and permanent id; `ringmqctl set_cluster_name` on one node renames it on
/// all of them, in the management API and in `rabbitmq_identity_info`, the permanent id kept.
#[test]
fn one_cluster_name_on_every_node_set_by_ringmqctl() {
    run(async {
        let c = Cluster::start(3);
        let identity = |i: usize, label: &str| -> Option<String> {
            let text = c.try_metrics(i).ok()?;
            let line = text.lines().find(|l| l.starts_with("rabbitmq_identity_info{"))?;
            let want = format!("{label}=\"");
            let start = line.find(&want)? + want.len();
            Some(line[start..].split('"').next()?.to_string())
        };
        let names: Vec<_> = (0..3).map(|i| identity(i, "rabbitmq_cluster")).collect();
        let ids: Vec<_> = (0..3).map(|i| identity(i, "rabbitmq_cluster_permanent_id")).collect();
        assert!(names[0].as_deref().is_some_and(|n| n.starts_with("ringmq@")), "{names:?}");
        assert!(names.iter().all(|n| *n == names[0]), "one default name: {names:?}");
        assert!(ids[0].as_deref().is_some_and(|id| id.len() == 36) && ids.iter().all(|id| *id == ids[0]), "one permanent id: {ids:?}");
        let (code, out, err) = ringmqctl(c.management_port(1), &["set_cluster_name", "prod-eu-1"]);
        assert_eq!(code, 0, "set_cluster_name: {out}{err}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        for i in 0..3 {
            loop {
                let (api, over) = (get_json(c.management_port(i), "/api/cluster-name"), get_json(c.management_port(i), "/api/overview"));
                let seen = (
                    api["name"].as_str().map(str::to_owned),
                    over["cluster_name"].as_str().map(str::to_owned),
                    identity(i, "rabbitmq_cluster"),
                );
                let want = Some("prod-eu-1".to_string());
                if seen == (want.clone(), want.clone(), want) {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "node {i} reports {seen:?}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            assert_eq!(identity(i, "rabbitmq_cluster_permanent_id"), ids[0], "the permanent id stays");
        }
        // The management API's own form, and a refused name.
        let r =
            common::http::request(c.management_port(2), "PUT", "/api/cluster-name", Some(r#"{"name":"prod-eu-2"}"#), common::http::GUEST);
        assert_eq!(r.status, 204, "{r:?}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while get_json(c.management_port(0), "/api/cluster-name")["name"] != "prod-eu-2" {
            assert!(std::time::Instant::now() < deadline, "node 0 never saw the name set on node 2");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let r = common::http::request(c.management_port(0), "PUT", "/api/cluster-name", Some(r#"{"name":""}"#), common::http::GUEST);
        assert_eq!(r.status, 400, "{r:?}");
    });
}
