//! A publishing connection moves to the core of the queue it publishes to, and a consuming
//! one to the core of the queue it consumes from (issue 15 item 3,
//! `amqp::connection::handoff`): the client (lapin) sees nothing, every message arrives
//! once and in order, every confirm comes, deliveries left unacked before the move are acked
//! after it; a connection that publishes and consumes, or a broker started with
//! `--move-publishers false`, stays where the kernel put it.
//!
//! ringmq only (cores are ringmq's notion); every wait is bounded.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::http::{get_json, http_get};
use common::*;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};

/// Names of the open connections (`"<peer> -> <local>"`).
fn connection_names(port: u16) -> HashSet<String> {
    let list = get_json(port, "/api/connections");
    list.as_array().expect("a JSON array").iter().map(|c| c["name"].as_str().expect("a name").to_owned()).collect()
}

/// The core serving connection `name`, or of queue `name` (`what`: "connections" or "queues").
fn core_of(port: u16, what: &str, name: &str) -> u64 {
    let list = get_json(port, &format!("/api/{what}"));
    let found = list.as_array().expect("a JSON array").iter().find(|o| o["name"] == name).cloned();
    found.unwrap_or_else(|| panic!("{name} not in /api/{what}: {list}"))["core"].as_u64().expect("a core")
}

/// Opens lapin connections until one is served by a core other than `not` (the kernel picks
/// the core: 32 tries at most); returns it, its name and a channel on it. The others are
/// closed.
async fn connection_off_core(b: &Broker, not: u64) -> (Connection, String, lapin::Channel) {
    let port = b.management_port();
    for _ in 0..32 {
        let before = connection_names(port);
        let c = connect(b).await;
        let name = connection_names(port).difference(&before).next().cloned().expect("the new connection is listed");
        if core_of(port, "connections", &name) != not {
            let ch = t("channel", c.create_channel()).await.unwrap();
            return (c, name, ch);
        }
        let _ = c.close(200, "wrong core".into()).await;
    }
    panic!("32 connections all on core {not}");
}

fn moved(b: &Broker) -> f64 {
    let text = http_get(b.metrics_port(), "/metrics").expect("GET /metrics");
    metric_value(&text, "ringmq_connections_moved_total").expect("ringmq_connections_moved_total in /metrics")
}

/// Publishes bodies `from..to` (4-byte big-endian) to `queue` with confirms, all in flight
/// at once, and waits for every confirm.
async fn publish_run(ch: &lapin::Channel, queue: &str, from: u32, to: u32) {
    let mut pending = Vec::new();
    for i in from..to {
        let pc = ch
            .basic_publish("".into(), queue.into(), BasicPublishOptions::default(), &i.to_be_bytes(), BasicProperties::default())
            .await
            .expect("basic.publish");
        pending.push(pc);
    }
    for pc in pending {
        let c = tt("publisher confirm", Duration::from_secs(10), pc).await.expect("confirm");
        assert!(c.is_ack(), "confirm {c:?}");
    }
}

/// A connection and channel that declare a queue (which then lives on that connection's
/// core, as a consumer's does); returns them, the queue and its core.
async fn consumer_queue(b: &Broker, tag: &str) -> (Connection, lapin::Channel, String, u64) {
    let (c, ch) = connect_ch(b).await;
    let q = plain_queue(&ch, tag).await;
    let core = core_of(b.management_port(), "queues", &q);
    (c, ch, q, core)
}

#[tokio::test]
async fn a_publisher_moves_to_its_queues_core_and_the_client_sees_nothing() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's cores");
    let port = b.management_port();
    let (_cc, cch, q, q_core) = consumer_queue(&b, "handoff").await;
    let (pc, p_name, pch) = connection_off_core(&b, q_core).await;
    confirm_mode(&pch).await;
    assert_eq!(moved(&b), 0.0);

    publish_run(&pch, &q, 0, 2_000).await;
    // Still the same connection (lapin saw no error), now on the queue's core.
    assert_eq!(core_of(port, "connections", &p_name), q_core, "the publisher's connection after 2,000 publishes");
    assert_eq!(moved(&b), 1.0, "one move");
    assert!(pc.status().connected(), "lapin still connected");
    // It goes on publishing there.
    publish_run(&pch, &q, 2_000, 3_000).await;

    let mut consumer = t(
        "basic.consume",
        cch.basic_consume(q.as_str().into(), "c".into(), BasicConsumeOptions { no_ack: true, ..Default::default() }, FieldTable::default()),
    )
    .await
    .unwrap();
    for i in 0..3_000u32 {
        let d = next_delivery(&mut consumer, Duration::from_secs(10)).await;
        assert_eq!(d.data, i.to_be_bytes(), "message {i} in order, once");
        assert!(!d.redelivered);
    }
    assert_no_delivery(&mut consumer, Duration::from_millis(300), "after 3,000").await;
    assert_eq!(ready_count(&cch, &q).await, 0);
}

#[tokio::test]
async fn a_consumer_moves_to_its_queues_core_with_its_unacked_deliveries() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's cores");
    let port = b.management_port();
    // The queue is declared by a setup connection, on that connection's core.
    let (_sc, sch, q, q_core) = consumer_queue(&b, "follow").await;
    let (cc, c_name, cch) = connection_off_core(&b, q_core).await;
    t("basic.qos", cch.basic_qos(100, BasicQosOptions::default())).await.unwrap();
    let mut consumer =
        t("basic.consume", cch.basic_consume(q.as_str().into(), "c".into(), BasicConsumeOptions::default(), FieldTable::default()))
            .await
            .unwrap();
    confirm_mode(&sch).await;
    publish_run(&sch, &q, 0, 2_000).await;
    assert_eq!(moved(&b), 0.0);

    // The first 10 stay unacked across the move; the rest are acked as they come.
    let mut kept = Vec::new();
    for i in 0..2_000u32 {
        let d = next_delivery(&mut consumer, Duration::from_secs(10)).await;
        assert_eq!(d.data, i.to_be_bytes(), "message {i} in order, once");
        assert!(!d.redelivered, "message {i}");
        if i < 10 {
            kept.push(d.delivery_tag);
        } else {
            t("basic.ack", cch.basic_ack(d.delivery_tag, BasicAckOptions::default())).await.unwrap();
        }
    }
    assert_eq!(core_of(port, "connections", &c_name), q_core, "the consumer's connection after 2,000 deliveries");
    assert_eq!(moved(&b), 1.0, "one move");
    for tag in kept {
        t("basic.ack", cch.basic_ack(tag, BasicAckOptions::default())).await.unwrap();
    }
    // Deliveries go on on the new core, and every ack took: nothing comes back when the
    // consumer's connection closes.
    publish_run(&sch, &q, 2_000, 2_100).await;
    for i in 2_000..2_100u32 {
        let d = next_delivery(&mut consumer, Duration::from_secs(10)).await;
        assert_eq!(d.data, i.to_be_bytes(), "message {i} after the move");
        t("basic.ack", cch.basic_ack(d.delivery_tag, BasicAckOptions::default())).await.unwrap();
    }
    assert!(cc.status().connected(), "lapin still connected");
    t("close", cc.close(200, "done".into())).await.unwrap();
    assert_eq!(ready_count(&sch, &q).await, 0, "no delivery came back: every ack, before and after the move, took");
}

#[tokio::test]
async fn a_connection_that_consumes_or_spreads_its_publishes_stays() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's cores");
    let port = b.management_port();
    let (_cc, _cch, q, q_core) = consumer_queue(&b, "stay").await;

    // A consumer on the publishing connection ties it to its core.
    let (pc, p_name, first) = connection_off_core(&b, q_core).await;
    let own_core = core_of(port, "connections", &p_name);
    let own = plain_queue(&first, "own").await;
    let consuming = t("channel", pc.create_channel()).await.unwrap();
    let _consumer =
        t("basic.consume", consuming.basic_consume(own.as_str().into(), "mine".into(), Default::default(), FieldTable::default()))
            .await
            .unwrap();
    let pch = t("channel", pc.create_channel()).await.unwrap();
    confirm_mode(&pch).await;
    publish_run(&pch, &q, 0, 1_000).await;
    assert_eq!(core_of(port, "connections", &p_name), own_core, "a consuming connection stays");

    // Publishes alternating between a queue of each core never make a run long enough.
    let (_pc2, p2_name, ch2) = connection_off_core(&b, q_core).await;
    let p2_core = core_of(port, "connections", &p2_name);
    let here = plain_queue(&ch2, "here").await;
    assert_eq!(core_of(port, "queues", &here), p2_core);
    confirm_mode(&ch2).await;
    for i in 0..500u32 {
        publish_run(&ch2, if i % 2 == 0 { &q } else { &here }, i, i + 1).await;
    }
    assert_eq!(core_of(port, "connections", &p2_name), p2_core, "publishes to both cores: it stays");
    assert_eq!(moved(&b), 0.0);
}

#[tokio::test]
async fn with_move_publishers_false_a_publisher_stays() {
    let b = Broker::start_with_args(&["--move-publishers", "false"]);
    require_own_broker!(b, "ringmq's cores");
    let port = b.management_port();
    let (_cc, _cch, q, q_core) = consumer_queue(&b, "off").await;
    let (_pc, p_name, pch) = connection_off_core(&b, q_core).await;
    confirm_mode(&pch).await;
    publish_run(&pch, &q, 0, 1_000).await;
    assert_ne!(core_of(port, "connections", &p_name), q_core);
    assert_eq!(moved(&b), 0.0);
}
