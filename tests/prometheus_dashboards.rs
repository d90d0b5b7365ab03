//! A real Prometheus (Debian's `prometheus`, started here on a free port with a temporary
//! configuration, ended by its pid) scrapes a ringmq node while a client works, and answers
//! the kind of query every panel of RabbitMQ's Grafana dashboards (RabbitMQ-Overview,
//! RabbitMQ-Quorum-Queues-Raft) sends: the family joined on
//! `rabbitmq_identity_info{rabbitmq_cluster="<the cluster's name>", namespace="",
//! rabbitmq_endpoint="aggregated"}` by `instance` and `job`, summed by `rabbitmq_node`, rated
//! for the counters. Each must give a series (issue 39, item 5).
//!
//! Skipped when `prometheus` is not installed, except in CI (`CI` set), where `.ci/run`
//! installs it.

mod common;

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use lapin::options::*;
use lapin::types::FieldTable;

/// The Prometheus process; killed (by its pid) and reaped when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus scraping `127.0.0.1:<target>` every second; `None` when the binary
    /// is not there.
    fn start(target: u16) -> Option<Prometheus> {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("prometheus.yml");
        let text = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: ringmq\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
        );
        std::fs::write(&config, text).expect("write the configuration");
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .ok()?;
        Some(Prometheus { child, port, _dir: dir })
    }

    /// `GET /api/v1/query?query=<expr>`: the result list, or why not (HTTP/1.0: one plain body).
    fn query(&self, expr: &str) -> Result<Vec<serde_json::Value>, String> {
        let q = percent_encoding::utf8_percent_encode(expr, percent_encoding::NON_ALPHANUMERIC);
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
        write!(s, "GET /api/v1/query?query={q} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").map_err(|e| format!("write: {e}"))?;
        let mut out = String::new();
        s.read_to_string(&mut out).map_err(|e| format!("read: {e}"))?;
        let body = out.split_once("\r\n\r\n").map(|(_, b)| b).ok_or_else(|| format!("no body: {out}"))?;
        let v: serde_json::Value = serde_json::from_str(body).map_err(|e| format!("{e}: {body}"))?;
        v["data"]["result"].as_array().cloned().ok_or_else(|| format!("no result: {body}"))
    }
}

/// The dashboards' join: `expr` per node of cluster `cluster`.
fn joined(expr: &str, cluster: &str) -> String {
    format!(
        "sum({expr} * on(instance, job) group_left(rabbitmq_cluster, rabbitmq_node) rabbitmq_identity_info{{rabbitmq_cluster=\"{cluster}\", namespace=\"\", rabbitmq_endpoint=\"aggregated\"}}) by(rabbitmq_node)"
    )
}

/// Gauges the two dashboards' panels read.
const GAUGES: [&str; 17] = [
    "rabbitmq_queue_messages_ready",
    "rabbitmq_queue_messages_unacked",
    "rabbitmq_global_publishers",
    "rabbitmq_global_consumers",
    "rabbitmq_connections",
    "rabbitmq_channels",
    "rabbitmq_queues",
    "rabbitmq_resident_memory_limit_bytes",
    "rabbitmq_process_resident_memory_bytes",
    "(rabbitmq_disk_space_available_bytes - rabbitmq_disk_space_available_limit_bytes)",
    "(rabbitmq_process_max_fds - rabbitmq_process_open_fds)",
    "rabbitmq_raft_last_written_index",
    "rabbitmq_raft_snapshot_index",
    "rabbitmq_raft_commit_latency_seconds",
    "(rabbitmq_raft_last_written_index - rabbitmq_raft_commit_index)",
    "(rabbitmq_erlang_uptime_seconds * on(instance, job) group_left(rabbitmq_version, erlang_version) rabbitmq_build_info)",
    "increase(rabbitmq_message_size_bytes_bucket{le=\"1000.0\"}[1m])",
];

/// Counters the panels rate.
const COUNTERS: [&str; 25] = [
    "rabbitmq_global_messages_received_total",
    "rabbitmq_global_messages_received_confirm_total",
    "rabbitmq_global_messages_routed_total",
    "rabbitmq_global_messages_confirmed_total",
    "rabbitmq_global_messages_unroutable_dropped_total",
    "rabbitmq_global_messages_unroutable_returned_total",
    "rabbitmq_global_messages_delivered_total",
    "rabbitmq_global_messages_delivered_consume_auto_ack_total",
    "rabbitmq_global_messages_delivered_consume_manual_ack_total",
    "rabbitmq_global_messages_delivered_get_auto_ack_total",
    "rabbitmq_global_messages_delivered_get_manual_ack_total",
    "rabbitmq_global_messages_get_empty_total",
    "rabbitmq_global_messages_redelivered_total",
    "rabbitmq_global_messages_acknowledged_total",
    "rabbitmq_queues_declared_total",
    "rabbitmq_queues_created_total",
    "rabbitmq_queues_deleted_total",
    "rabbitmq_channels_opened_total",
    "rabbitmq_channels_closed_total",
    "rabbitmq_connections_opened_total",
    "rabbitmq_connections_closed_total",
    "rabbitmq_raft_commit_index",
    "rabbitmq_raft_term",
    "rabbitmq_message_size_bytes_sum",
    "rabbitmq_message_size_bytes_count",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_answers_the_dashboards_queries() {
    let b = Broker::start();
    require_own_broker!(b, "reads ringmq's metrics endpoint");
    let Some(prom) = Prometheus::start(b.metrics_port()) else {
        skip_unless_ci("prometheus is not installed (.ci/run installs it)");
        return;
    };
    // Work for every family: publish with confirms (one unroutable, one returned), consume
    // with acks and a requeue, basic.get (empty, auto and manual ack), a queue deleted, a
    // channel and a connection closed.
    let (c, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "dash").await;
    confirm_mode(&ch).await;
    for i in 0..20u8 {
        assert!(publish_confirmed(&ch, "", &q, &[i; 64], Default::default()).await.is_ack());
    }
    publish_confirmed(&ch, "", "nowhere", b"x", Default::default()).await;
    let mandatory = BasicPublishOptions { mandatory: true, ..Default::default() };
    let pc = t("publish", ch.basic_publish("".into(), "nowhere".into(), mandatory, b"y", Default::default())).await.unwrap();
    t("confirm", pc).await.unwrap();
    let consumer = t("channel", c.create_channel()).await.unwrap();
    let mut cons =
        t("consume", consumer.basic_consume(q.as_str().into(), "".into(), Default::default(), FieldTable::default())).await.unwrap();
    let d = next_delivery(&mut cons, Duration::from_secs(5)).await;
    t("nack", d.nack(BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
    for _ in 0..10 {
        let d = next_delivery(&mut cons, Duration::from_secs(5)).await;
        t("ack", d.ack(Default::default())).await.unwrap();
    }
    let getter = t("channel", c.create_channel()).await.unwrap();
    let polled = plain_queue(&getter, "dash-get").await;
    publish(&getter, "", &polled, b"a").await;
    publish(&getter, "", &polled, b"b").await;
    wait_ready(&getter, &polled, 2, Duration::from_secs(5)).await;
    assert!(get_body(&getter, &polled).await.is_some());
    let g = t("get", getter.basic_get(polled.as_str().into(), BasicGetOptions { no_ack: false })).await.unwrap().expect("a message");
    t("ack", g.delivery.ack(Default::default())).await.unwrap();
    let gone = plain_queue(&getter, "dash-gone").await;
    assert!(get_body(&getter, &gone).await.is_none());
    t("delete", getter.queue_delete(gone.as_str().into(), Default::default())).await.unwrap();
    t("close", getter.close(200, "".into())).await.unwrap();
    let other = connect(&b).await;
    t("close", other.close(200, "".into())).await.unwrap();
    // The cluster's name, as Grafana's variable reads it, once Prometheus has a few scrapes.
    let deadline = Instant::now() + Duration::from_secs(30);
    let cluster = loop {
        let scrapes = prom.query("count_over_time(rabbitmq_identity_info[1m])").ok().and_then(|r| {
            let v = r.first()?["value"][1].as_str()?.parse::<f64>().ok()?;
            Some((v, r[0]["metric"]["rabbitmq_cluster"].as_str()?.to_string()))
        });
        match scrapes {
            Some((n, name)) if n >= 4.0 => break name,
            _ => assert!(Instant::now() < deadline, "Prometheus has not scraped ringmq 4 times: {scrapes:?}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(cluster.starts_with("ringmq@"), "{cluster}");
    let mut empty = Vec::new();
    let counted = |expr: &str| format!("rate({expr}[15s])");
    let queries: Vec<String> = GAUGES
        .iter()
        .map(|g| joined(g, &cluster))
        .chain(COUNTERS.iter().map(|c| joined(&counted(c), &cluster)))
        .chain([format!("count(rabbitmq_identity_info{{namespace=\"\",rabbitmq_cluster=\"{cluster}\",rabbitmq_endpoint=\"aggregated\"}})")])
        .collect();
    for expr in &queries {
        match prom.query(expr) {
            Ok(r) if !r.is_empty() => {}
            other => empty.push(format!("{expr}: {other:?}")),
        }
    }
    assert!(empty.is_empty(), "{} of {} queries gave no series:\n{}", empty.len(), queries.len(), empty.join("\n"));
    t("close", c.close(200, "".into())).await.unwrap();
}
