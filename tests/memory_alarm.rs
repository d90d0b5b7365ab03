//! Issue 14 (reliability), the memory alarm: RabbitMQ's `vm_memory_high_watermark` as
//! `--memory-high-watermark` and `ringmqctl set_vm_memory_high_watermark`. While the broker's
//! resident memory is above the threshold, connections that publish get `connection.blocked`
//! ("low on memory") and are not read; consumers keep draining; once it is below again they get
//! `connection.unblocked` and what they had sent is confirmed. Nothing is lost either way.
//!
//! - `memory_alarm_blocks_publishers_consumers_drain_and_nothing_is_lost`: the threshold is
//!   moved at run time (as an operator does with rabbitmqctl): an absolute threshold of 1 byte is
//!   below any resident size, and the alarm comes from the same resident memory reading as in
//!   production; the states in /api/connections, /metrics and the health check.
//! - `publishers_faster_than_the_store_are_held_back`: flow control (`broker::credit`) without
//!   the alarm: three connections publish 1.5 GiB of 1 MiB messages with no consumer, and the
//!   broker's resident memory grows by less than 640 MiB (before it, one such publisher took
//!   the broker to 3.6 GB); every message is then delivered.
//! - `a_real_flood_raises_the_alarm_and_it_clears`: six connections publish 24 MiB messages at
//!   once against a watermark 128 MiB above the idle broker's resident size: the alarm blocks
//!   them, clears as memory goes back, and every message is stored and delivered (the alarm
//!   never outlives what holds the memory).

mod common;

use std::time::{Duration, Instant};

use common::flood::{consume_all, flood};
use common::http::{get_json, http_get, ringmqctl as ctl};
use common::rss::{rss_of, PeakRss};
use common::*;
use futures_lite::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Event};

/// The next blocked/unblocked event of a connection within `limit` (other events skipped).
async fn next_block_event(events: &mut (impl futures_lite::Stream<Item = Event> + Unpin), limit: Duration) -> Option<Event> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(e @ (Event::ConnectionBlocked(_) | Event::ConnectionUnblocked))) => return Some(e),
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return None,
        }
    }
}

fn memory_alarm_metric(b: &Broker) -> f64 {
    let m = http_get(b.metrics_port(), "/metrics").expect("scrape /metrics");
    metric_value(&m, "rabbitmq_alarms_memory_used_watermark").expect("rabbitmq_alarms_memory_used_watermark in /metrics")
}

#[tokio::test]
async fn memory_alarm_blocks_publishers_consumers_drain_and_nothing_is_lost() {
    let b = Broker::start_with_args(&["--memory-high-watermark", "0.4"]);
    require_own_broker!(b, "moves ringmq's memory threshold through its management API");
    let mport = b.management_port();

    // At start: no alarm, a threshold of 0.4 of the memory available, the resident size shown.
    let m = http_get(b.metrics_port(), "/metrics").expect("scrape");
    assert_eq!(metric_value(&m, "rabbitmq_alarms_memory_used_watermark"), Some(0.0));
    let limit = metric_value(&m, "rabbitmq_resident_memory_limit_bytes").expect("limit metric");
    let rss = metric_value(&m, "rabbitmq_process_resident_memory_bytes").expect("resident metric");
    assert!(rss > 1e6 && limit > rss, "resident {rss} B, limit {limit} B");

    let publisher = connect(&b).await;
    let mut events = publisher.events_listener();
    let pch = t("channel", publisher.create_channel()).await.expect("channel");
    confirm_mode(&pch).await;
    let q = uniq("mem-alarm");
    declare_queue(&pch, &q, QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await;
    let persistent = BasicProperties::default().with_delivery_mode(2);
    for i in 0..50u32 {
        let c = publish_confirmed(&pch, "", &q, format!("before-{i}").as_bytes(), persistent.clone()).await;
        assert!(c.is_ack(), "message {i} before the alarm: {c:?}");
    }

    // A consumer on its own connection, which never publishes.
    let consumer = connect(&b).await;
    let cch = t("channel", consumer.create_channel()).await.expect("channel");
    let mut deliveries =
        t("consume", cch.basic_consume(q.as_str().into(), "drainer".into(), BasicConsumeOptions::default(), FieldTable::default()))
            .await
            .expect("basic.consume");

    // Raise the alarm: any resident size is above 1 byte.
    let (code, out, err) = ctl(mport, &["set_vm_memory_high_watermark", "absolute", "1"]);
    assert_eq!(code, 0, "set_vm_memory_high_watermark: {out}{err}");
    match next_block_event(&mut events, Duration::from_secs(5)).await {
        Some(Event::ConnectionBlocked(reason)) => assert_eq!(reason, "low on memory"),
        other => panic!("expected connection.blocked (low on memory), got {other:?}"),
    }
    assert_eq!(memory_alarm_metric(&b), 1.0, "the alarm in /metrics");
    let node = get_json(mport, "/api/nodes").as_array().cloned().unwrap_or_default();
    assert!(node.iter().any(|n| n["mem_alarm"] == true), "mem_alarm in /api/nodes: {node:?}");
    let conns = get_json(mport, "/api/connections").as_array().cloned().unwrap_or_default();
    let states: Vec<&str> = conns.iter().filter_map(|c| c["state"].as_str()).collect();
    assert!(states.contains(&"blocked"), "the publisher shows as blocked in /api/connections: {states:?}");
    assert!(states.iter().any(|s| *s == "blocking" || *s == "running"), "the consumer is not blocked: {states:?}");
    let health = common::http::request(mport, "GET", "/api/health/checks/alarms", None, Some(("guest", "guest")));
    assert_eq!(health.status, 503, "health check during the alarm: {}", health.body);

    // What the blocked publisher sends now waits, unconfirmed, while consumers drain.
    // (lapin itself holds frames while blocked: the publish runs in a task of its own.)
    let held = {
        let (pch, q, props) = (pch.clone(), q.clone(), persistent.clone());
        tokio::spawn(async move {
            let pc = pch.basic_publish("".into(), q.as_str().into(), Default::default(), b"held", props).await?;
            pc.await
        })
    };
    for i in 0..50u32 {
        let d = next_delivery(&mut deliveries, Duration::from_secs(10)).await;
        assert_eq!(d.data, format!("before-{i}").as_bytes(), "delivery {i} during the alarm");
        t("ack", d.ack(BasicAckOptions::default())).await.expect("basic.ack during the alarm");
    }
    assert_no_delivery(&mut deliveries, Duration::from_millis(500), "the held message is not read while blocked").await;
    // A connection that never published still declares and consumes (RabbitMQ blocks publishers only).
    let other =
        t("channel", cch.queue_declare(uniq("mem-side").as_str().into(), QueueDeclareOptions::default(), FieldTable::default())).await;
    assert!(other.is_ok(), "queue.declare on a consuming connection during the alarm: {other:?}");

    assert!(!held.is_finished(), "the publish sent while blocked was confirmed during the alarm");

    // Clear it: a fraction again.
    let started = Instant::now();
    let (code, out, err) = ctl(mport, &["set_vm_memory_high_watermark", "0.4"]);
    assert_eq!(code, 0, "set_vm_memory_high_watermark 0.4: {out}{err}");
    assert!(
        matches!(next_block_event(&mut events, Duration::from_secs(5)).await, Some(Event::ConnectionUnblocked)),
        "expected connection.unblocked"
    );
    println!("unblocked {} ms after the threshold was raised", started.elapsed().as_millis());
    let c = t("confirm of the held message", held).await.expect("task").expect("confirm");
    assert!(c.is_ack(), "the message sent while blocked: {c:?}");
    let d = next_delivery(&mut deliveries, Duration::from_secs(10)).await;
    assert_eq!(d.data, b"held");
    t("ack", d.ack(BasicAckOptions::default())).await.expect("ack");
    assert_eq!(memory_alarm_metric(&b), 0.0, "the alarm cleared in /metrics");
    let c = publish_confirmed(&pch, "", &q, b"after", persistent).await;
    assert!(c.is_ack(), "a publish after the alarm: {c:?}");
    let d = next_delivery(&mut deliveries, Duration::from_secs(10)).await;
    assert_eq!(d.data, b"after");
}

#[tokio::test]
async fn ringmqctl_refuses_thresholds_that_do_not_parse() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let mport = b.management_port();
    for bad in [
        &["set_vm_memory_high_watermark", "1.5"][..],
        &["set_vm_memory_high_watermark", "absolute", "lots"],
        &["set_disk_free_limit", "0.5"],
    ] {
        let (code, out, err) = ctl(mport, bad);
        assert_eq!(code, 65, "{bad:?} should be refused as bad data: {out}{err}");
        assert!(err.contains("expected"), "{bad:?}: the error says what is expected: {err}");
    }
    let (code, out, err) = ctl(mport, &["set_disk_free_limit", "60MB"]);
    assert_eq!(code, 0, "{out}{err}");
    let m = http_get(b.metrics_port(), "/metrics").expect("scrape");
    assert_eq!(metric_value(&m, "rabbitmq_disk_space_available_limit_bytes"), Some(60_000_000.0));
    // Another node's name is refused with a reason, an unknown one is 404.
    let r = common::http::request(
        mport,
        "PUT",
        "/api/ringmq/nodes/nobody@nowhere/disk_free_limit",
        Some(r#"{"value":"1GB"}"#),
        Some(("guest", "guest")),
    );
    assert_eq!(r.status, 404, "{}", r.body);
}

#[tokio::test]
async fn publishers_faster_than_the_store_are_held_back() {
    const QUEUES: usize = 3;
    const EACH: usize = 512;
    const SIZE: usize = 1 << 20;
    let b = Broker::start_with_args(&["--memory-high-watermark", "0"]);
    require_own_broker!(b, "reads the broker process's resident memory");
    let pid = b.pid().expect("pid");
    let (conn, ch) = connect_ch(&b).await;
    let queues: Vec<String> = (0..QUEUES).map(|i| uniq(&format!("flow-{i}"))).collect();
    for q in &queues {
        declare_queue(&ch, q, QueueDeclareOptions::default(), FieldTable::default()).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let baseline = rss_of(pid);
    let sampler = PeakRss::start(pid);
    let floods: Vec<_> = queues
        .iter()
        .map(|q| tokio::spawn(flood(b.uri(), q.clone(), EACH, SIZE, BasicProperties::default(), Duration::from_secs(60))))
        .collect();
    for f in floods {
        f.await.expect("flood task");
    }
    for q in &queues {
        assert_eq!(wait_ready(&ch, q, EACH as u32, Duration::from_secs(30)).await, EACH as u32, "{q}: every message stored");
    }
    let peak = sampler.finish();
    let published = (QUEUES * EACH * SIZE) as u64;
    println!("resident: {} MiB idle, peak {} MiB while {} MiB were published", baseline >> 20, peak >> 20, published >> 20);
    // Each queue may cache 64 MiB of what it stored and have 16 MiB waiting for its writer,
    // each connection 16 MiB in flight, and freed pages wait for their core's next collection
    // (`core::memory`): bounded, and far below what was sent (1.5 GiB).
    assert!(
        peak.saturating_sub(baseline) < 640 << 20,
        "resident memory grew by {} MiB for {} MiB published",
        (peak - baseline) >> 20,
        published >> 20
    );
    for q in &queues {
        assert_eq!(consume_all(&ch, q, EACH, None).await, EACH, "{q}: every message delivered");
    }
    drop(conn);
}

#[tokio::test]
async fn a_real_flood_raises_the_alarm_and_it_clears() {
    const CONNS: usize = 6;
    const EACH: usize = 8;
    const SIZE: usize = 24 << 20;
    let b = Broker::start_with_args(&["--memory-high-watermark", "0"]);
    require_own_broker!(b, "moves ringmq's memory threshold and reads its resident memory");
    let (pid, mport) = (b.pid().expect("pid"), b.management_port());
    let (conn, ch) = connect_ch(&b).await;
    let q = uniq("mem-flood");
    declare_queue(&ch, &q, QueueDeclareOptions::default(), FieldTable::default()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let baseline = rss_of(pid);
    let watermark = baseline + (128 << 20);
    let (code, out, err) = ctl(mport, &["set_vm_memory_high_watermark", "absolute", &watermark.to_string()]);
    assert_eq!(code, 0, "{out}{err}");
    let sampler = PeakRss::start(pid);
    let floods: Vec<_> = (0..CONNS)
        .map(|_| tokio::spawn(flood(b.uri(), q.clone(), EACH, SIZE, BasicProperties::default(), Duration::from_secs(120))))
        .collect();
    let mut reasons = Vec::new();
    for f in floods {
        reasons.extend(f.await.expect("flood task"));
    }
    let peak = sampler.finish();
    assert_eq!(wait_ready(&ch, &q, (CONNS * EACH) as u32, Duration::from_secs(30)).await, (CONNS * EACH) as u32, "every message stored");
    let log = b.log();
    let raised = log.matches("memory alarm raised").count();
    println!(
        "resident: {} MiB idle, watermark {} MiB, peak {} MiB; alarm raised {raised} times; connection.blocked seen {} times",
        baseline >> 20,
        watermark >> 20,
        peak >> 20,
        reasons.len()
    );
    assert!(raised >= 1, "the flood raised the memory alarm");
    assert!(reasons.iter().all(|r| r == "low on memory"), "{reasons:?}");
    // Raised last as the final messages came in, it clears once they are stored and the
    // queue's cache and the freed pages go back.
    let deadline = Instant::now() + Duration::from_secs(10);
    while memory_alarm_metric(&b) != 0.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(memory_alarm_metric(&b), 0.0, "the alarm cleared within 10 s of the flood's end");
    assert_eq!(consume_all(&ch, &q, CONNS * EACH, None).await, CONNS * EACH, "every message delivered");
    drop(conn);
}
