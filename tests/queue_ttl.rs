//! Queue TTL (`x-expires`, issue 12 item 2) through lapin, as RabbitMQ documents it: a queue
//! unused for its x-expires (no consumer, no basic.get, no queue.declare) is deleted, durable
//! or not; a consumer, a get or a redeclare renews the lease, which starts again when the last
//! consumer leaves and when the broker restarts. Runs against RabbitMQ too
//! (`RINGMQ_TEST_BROKER=host:port`), except the restart case.
//!
//! A passive declare renews the lease itself, so the checks that a queue went wait longer
//! than its x-expires between looks.

mod common;

use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use std::time::{Duration, Instant};

fn expires(ms: i64) -> FieldTable {
    let mut a = FieldTable::default();
    a.insert("x-expires".into(), AMQPValue::LongLongInt(ms));
    a
}

/// Looks every `every` (longer than the queue's x-expires) until the queue is gone; false if
/// it is still there after `limit`.
async fn gone_within(c: &lapin::Connection, q: &str, every: Duration, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        tokio::time::sleep(every).await;
        if !queue_exists(c, q).await {
            return true;
        }
    }
    false
}

#[tokio::test]
async fn an_unused_queue_goes_after_its_x_expires_and_a_used_one_stays() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    let idle = uniq("ttl-idle");
    let polled = uniq("ttl-polled");
    declare_queue(&ch, &idle, QueueDeclareOptions::default(), expires(400)).await;
    declare_queue(&ch, &polled, QueueDeclareOptions::default(), expires(1000)).await;
    publish(&ch, "", &idle, b"kept until the queue goes").await;
    // basic.get every 200 ms for 2.4 s keeps `polled`, whose lease is 1 s.
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = get_body(&ch, &polled).await;
    }
    assert!(!queue_exists(&c, &idle).await, "a queue unused for 2.4 s with x-expires 400 ms is still there");
    assert!(queue_exists(&c, &polled).await, "basic.get did not renew the lease");
    assert!(gone_within(&c, &polled, Duration::from_millis(1500), Duration::from_secs(8)).await, "not deleted once unused");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn a_consumer_keeps_the_queue_and_the_lease_starts_when_it_leaves() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    let q = uniq("ttl-consumed");
    declare_queue(&ch, &q, QueueDeclareOptions::default(), expires(2000)).await;
    let cons = t("consume", ch.basic_consume(q.as_str().into(), "held".into(), BasicConsumeOptions::default(), FieldTable::default()))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(3000)).await;
    t("cancel", ch.basic_cancel(cons.tag(), BasicCancelOptions::default())).await.unwrap();
    // The lease runs from the cancel, not from the declare 3 s ago: 1.5 s after the cancel
    // the queue is still there.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(queue_exists(&c, &q).await, "deleted before its lease from the last consumer's leaving ran out");
    assert!(gone_within(&c, &q, Duration::from_millis(2500), Duration::from_secs(10)).await, "not deleted once its consumer left");
    // A redeclare renews the lease too.
    let q2 = uniq("ttl-redeclared");
    declare_queue(&ch, &q2, QueueDeclareOptions::default(), expires(1000)).await;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        declare_queue(&ch, &q2, QueueDeclareOptions::default(), expires(1000)).await;
    }
    assert!(queue_exists(&c, &q2).await, "queue.declare did not renew the lease");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_queue_expires_after_a_restart_with_nobody_touching_it() {
    let mut b = Broker::start();
    require_own_broker!(b, "restarts ringmq");
    let q = uniq("ttl-durable");
    let kept = uniq("ttl-durable-kept");
    {
        let (c, ch) = connect_ch(&b).await;
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        declare_queue(&ch, &q, durable, expires(1500)).await;
        declare_queue(&ch, &kept, durable, FieldTable::default()).await;
        publish(&ch, "", &q, b"x").await;
        t("close", c.close(200, "".into())).await.unwrap();
    }
    tokio::task::block_in_place(|| b.kill9_restart());
    let c = connect(&b).await;
    // Nothing names the queue after the restart; it must go by itself (the lease starts at
    // the start), while the queue without x-expires stays.
    tokio::time::sleep(Duration::from_millis(4000)).await;
    assert!(!queue_exists(&c, &q).await, "a durable x-expires queue nobody used since the restart is still there");
    assert!(queue_exists(&c, &kept).await, "a durable queue without x-expires went");
    t("close", c.close(200, "".into())).await.unwrap();
}
