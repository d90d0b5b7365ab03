//! The Prometheus endpoint (issue 5 item 6: per-stage latency histograms) and the
//! auto-delete exchange lifecycle, through lapin.

mod common;

use std::io::{Read, Write};

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
    // publish→stored and stored→delivered are sampled (one message in 16); every ack counts
    for (stage, least) in [("publish_to_stored", 2.0), ("stored_to_delivered", 2.0), ("delivered_to_acked", 64.0)] {
        let n = value(&text, &format!("ringmq_stage_latency_seconds_count{{stage=\"{stage}\"}}"));
        assert!(n >= least, "stage {stage}: {n} samples");
        let inf = value(&text, &format!("ringmq_stage_latency_seconds_bucket{{le=\"+Inf\",stage=\"{stage}\"}}"));
        assert_eq!(inf, n, "+Inf bucket equals the count");
    }
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
    let stored = format!("ringmq_queue_stage_latency_seconds_count{{vhost=\"/\",queue=\"{q}\",stage=\"publish_to_stored\"}}");
    assert!(value(&text, &stored) >= 1.0, "40 publishes, one in 16 sampled");
    // The node's totals under the same names.
    let total = tokio::task::spawn_blocking(move || scrape(port)).await.unwrap();
    assert_eq!(value(&total, "rabbitmq_queues"), 2.0);
    assert_eq!(value(&total, "rabbitmq_queue_messages_ready"), 32.0);
    assert_eq!(value(&total, "rabbitmq_queue_messages_unacked"), 8.0);
    assert!(value(&total, "rabbitmq_global_messages_received_total") >= 40.0);
    assert_eq!(value(&total, "rabbitmq_connections"), 1.0);
    assert_eq!(value(&total, "rabbitmq_identity_info{rabbitmq_node=\"ringmq@1\"}"), 1.0);
    let missing = tokio::task::spawn_blocking(move || scrape_path(port, "/nope")).await.unwrap();
    assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
}
