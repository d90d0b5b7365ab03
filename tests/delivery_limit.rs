//! Poison-message handling through lapin: `x-delivery-limit` (issue 12, item 5's
//! `delivery_limit` reason), as RabbitMQ's quorum queues have it: every return of a delivery
//! (nack or reject with requeue, a channel that closes holding it) counts; a delivery of a
//! returned message carries `x-delivery-count`; the return past the limit dead-letters it with
//! reason `delivery_limit` (or drops it without a dead-letter exchange); quorum queues default
//! to 20 (RabbitMQ 4.x) and -1 turns that off. The cases that RabbitMQ 3.10 shares pass
//! against it too (`RINGMQ_TEST_BROKER`).

mod common;

use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(5);

fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions { durable: true, ..Default::default() }
}

/// A durable dead-letter queue and the arguments that send a queue's dead letters to it
/// through the default exchange, plus `extra`.
async fn with_dlq(ch: &Channel, extra: &[(&str, AMQPValue)]) -> (String, FieldTable) {
    let dlq = declare_queue(ch, &uniq("dl-target"), durable(), FieldTable::default()).await;
    let mut pairs = vec![("x-dead-letter-exchange", text("")), ("x-dead-letter-routing-key", text(&dlq))];
    pairs.extend(extra.iter().cloned());
    (dlq, args(&pairs))
}

fn quorum() -> (&'static str, AMQPValue) {
    ("x-queue-type", text("quorum"))
}

/// basic.get with manual ack: (delivery tag, redelivered, body, x-delivery-count).
async fn get(ch: &Channel, queue: &str) -> Option<(u64, bool, String, Option<i64>)> {
    let m = t("basic.get", ch.basic_get(queue.into(), BasicGetOptions { no_ack: false })).await.expect("basic.get")?;
    let count = delivery_count(&m.delivery.properties);
    Some((m.delivery.delivery_tag, m.delivery.redelivered, String::from_utf8(m.delivery.data.clone()).unwrap(), count))
}

fn delivery_count(p: &BasicProperties) -> Option<i64> {
    match p.headers().as_ref()?.inner().get("x-delivery-count")? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        other => panic!("x-delivery-count is not an integer: {other:?}"),
    }
}

async fn nack_requeue(ch: &Channel, tag: u64) {
    t("basic.nack", ch.basic_nack(tag, BasicNackOptions { multiple: false, requeue: true })).await.expect("basic.nack");
}

/// The dead-lettered copies in `dlq` (auto-ack): (body, newest x-death's reason, queue,
/// count, the copy's own x-delivery-count).
async fn dead_letters(ch: &Channel, dlq: &str, n: u32) -> Vec<(String, String, String, i64, Option<i64>)> {
    assert_eq!(wait_ready(ch, dlq, n, WAIT).await, n, "dead letters in {dlq}");
    let mut out = Vec::new();
    while let Some(m) = t("basic.get", ch.basic_get(dlq.into(), BasicGetOptions { no_ack: true })).await.expect("basic.get") {
        let p = &m.delivery.properties;
        let h = p.headers().as_ref().expect("headers on a dead letter");
        let Some(AMQPValue::FieldArray(deaths)) = h.inner().get("x-death") else { panic!("no x-death array") };
        let Some(AMQPValue::FieldTable(e)) = deaths.as_slice().first() else { panic!("empty x-death") };
        let s = |k: &str| match e.inner().get(k) {
            Some(AMQPValue::LongString(v)) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
            other => panic!("x-death {k}: {other:?}"),
        };
        let count = match e.inner().get("count") {
            Some(AMQPValue::LongLongInt(n)) => *n,
            other => panic!("x-death count: {other:?}"),
        };
        out.push((String::from_utf8(m.delivery.data.clone()).unwrap(), s("reason"), s("queue"), count, delivery_count(p)));
    }
    out
}

#[tokio::test]
async fn the_return_past_the_limit_dead_letters_with_reason_delivery_limit() {
    let b = Broker::start();
    let (_c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let (dlq, a) = with_dlq(&ch, &[quorum(), ("x-delivery-limit", AMQPValue::LongLongInt(1))]).await;
    let q = declare_queue(&ch, &uniq("poison"), durable(), a).await;
    for body in ["m1", "m2"] {
        assert!(publish_confirmed(&ch, "", &q, body.as_bytes(), BasicProperties::default()).await.is_ack());
    }
    let (tag, redelivered, body, count) = get(&ch, &q).await.expect("m1");
    assert_eq!((redelivered, body.as_str()), (false, "m1"));
    assert!(count.unwrap_or(0) == 0, "a first delivery has no return counted: {count:?}");
    nack_requeue(&ch, tag).await;
    let (tag, redelivered, body, count) = get(&ch, &q).await.expect("m1 again");
    assert_eq!((redelivered, body.as_str(), count), (true, "m1", Some(1)), "returned once, back at the head");
    nack_requeue(&ch, tag).await;
    let dead = dead_letters(&ch, &dlq, 1).await;
    assert_eq!(dead.len(), 1);
    let (body, reason, queue, n, copy_count) = &dead[0];
    assert_eq!((body.as_str(), reason.as_str(), queue.as_str(), *n), ("m1", "delivery_limit", q.as_str(), 1));
    assert_eq!(*copy_count, None, "the dead-lettered copy carries no x-delivery-count");
    let (_, redelivered, body, _) = get(&ch, &q).await.expect("m2 still there");
    assert_eq!((redelivered, body.as_str()), (false, "m2"), "the other message is untouched");
}

#[tokio::test]
async fn a_channel_that_closes_holding_the_message_counts_as_a_return() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let (dlq, a) = with_dlq(&ch, &[quorum(), ("x-delivery-limit", AMQPValue::LongLongInt(0))]).await;
    let q = declare_queue(&ch, &uniq("poison-close"), durable(), a).await;
    assert!(publish_confirmed(&ch, "", &q, b"crashes-its-consumer", BasicProperties::default()).await.is_ack());
    let consumer_ch = t("channel.open", c.create_channel()).await.expect("channel.open");
    let mut consumer =
        t("basic.consume", consumer_ch.basic_consume(q.as_str().into(), "c".into(), BasicConsumeOptions::default(), FieldTable::default()))
            .await
            .expect("basic.consume");
    let d = next_delivery(&mut consumer, WAIT).await;
    assert_eq!(&d.data[..], b"crashes-its-consumer");
    // The consumer "fails" without settling: its channel goes.
    t("channel.close", consumer_ch.close(200, "bye".into())).await.expect("channel.close");
    let dead = dead_letters(&ch, &dlq, 1).await;
    assert_eq!((dead[0].0.as_str(), dead[0].1.as_str()), ("crashes-its-consumer", "delivery_limit"));
    assert_eq!(ready_count(&ch, &q).await, 0, "not requeued past the limit");
}

#[tokio::test]
async fn a_quorum_queue_drops_a_message_after_twenty_returns_unless_the_limit_is_off() {
    let b = Broker::start();
    require_own_broker!(b, "RabbitMQ 3.10 has no default delivery limit (4.0 brought 20)");
    let (_c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let limited = declare_queue(&ch, &uniq("qq-default"), durable(), args(&[quorum()])).await;
    let unlimited =
        declare_queue(&ch, &uniq("qq-unlimited"), durable(), args(&[quorum(), ("x-delivery-limit", AMQPValue::LongLongInt(-1))])).await;
    for q in [&limited, &unlimited] {
        assert!(publish_confirmed(&ch, "", q, b"poison", BasicProperties::default()).await.is_ack());
    }
    for returns in 0..20 {
        let (tag, _, _, count) = get(&ch, &limited).await.expect("still within the limit");
        assert_eq!(count.unwrap_or(0), returns, "x-delivery-count counts the returns so far");
        nack_requeue(&ch, tag).await;
    }
    let (tag, _, _, count) = get(&ch, &limited).await.expect("the 21st delivery");
    assert_eq!(count, Some(20));
    nack_requeue(&ch, tag).await;
    assert_eq!(wait_ready(&ch, &limited, 0, WAIT).await, 0, "the 21st return drops it (no dead-letter exchange)");
    assert!(get(&ch, &limited).await.is_none());
    for _ in 0..25 {
        let (tag, _, _, _) = get(&ch, &unlimited).await.expect("-1: never dropped");
        nack_requeue(&ch, tag).await;
    }
    let (_, _, _, count) = get(&ch, &unlimited).await.expect("still there after 25 returns");
    assert_eq!(count, None, "no limit, no count");
}

#[tokio::test]
async fn a_classic_queue_without_a_limit_adds_no_header() {
    let b = Broker::start();
    let (_c, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "no-limit").await;
    publish(&ch, "", &q, b"m").await;
    assert_eq!(wait_ready(&ch, &q, 1, WAIT).await, 1);
    for _ in 0..3 {
        let (tag, _, _, count) = get(&ch, &q).await.expect("requeued, never dropped");
        assert_eq!(count, None, "a classic queue counts nothing");
        nack_requeue(&ch, tag).await;
    }
}

#[tokio::test]
async fn a_classic_queue_declared_with_a_limit_keeps_it() {
    let b = Broker::start();
    require_own_broker!(b, "RabbitMQ ignores x-delivery-limit on classic queues; ringmq applies it");
    let (_c, ch) = connect_ch(&b).await;
    let q =
        declare_queue(&ch, &uniq("classic-limit"), QueueDeclareOptions::default(), args(&[("x-delivery-limit", AMQPValue::LongInt(1))]))
            .await;
    publish(&ch, "", &q, b"m").await;
    assert_eq!(wait_ready(&ch, &q, 1, WAIT).await, 1);
    let (tag, _, _, _) = get(&ch, &q).await.expect("first");
    t("basic.reject", ch.basic_reject(tag, BasicRejectOptions { requeue: true })).await.expect("basic.reject");
    let (tag, _, _, count) = get(&ch, &q).await.expect("second");
    assert_eq!(count, Some(1));
    t("basic.reject", ch.basic_reject(tag, BasicRejectOptions { requeue: true })).await.expect("basic.reject");
    assert_eq!(wait_ready(&ch, &q, 0, WAIT).await, 0, "dropped on its second return");
}

#[tokio::test]
async fn a_limit_below_minus_one_or_not_an_integer_is_406() {
    let b = Broker::start();
    require_own_broker!(b, "RabbitMQ 3.10 accepts any x-delivery-limit");
    let c = connect(&b).await;
    for bad in [AMQPValue::LongLongInt(-2), text("five")] {
        let ch = t("channel.open", c.create_channel()).await.expect("channel.open");
        let r = t(
            "queue.declare",
            ch.queue_declare(uniq("bad-limit").as_str().into(), durable(), args(&[quorum(), ("x-delivery-limit", bad)])),
        )
        .await;
        assert_code(r, 406, "x-delivery-limit out of range");
    }
}

/// The counts are kept in the queue's unacked index (`delivery_limit.rs`, behaviour 5): a
/// graceful restart and then a kill -9 with the message outstanding keep every return counted
/// before them, so the limit holds across runs, not per run.
#[tokio::test]
async fn return_counts_survive_a_restart_and_a_kill_9() {
    let mut b = Broker::start();
    require_own_broker!(b, "restarts the broker");
    let persistent = BasicProperties::default().with_delivery_mode(2);
    let (dlq, q) = {
        let (c, ch) = connect_ch(&b).await;
        confirm_mode(&ch).await;
        let (dlq, a) = with_dlq(&ch, &[quorum(), ("x-delivery-limit", AMQPValue::LongLongInt(3))]).await;
        let q = declare_queue(&ch, &uniq("poison-restart"), durable(), a).await;
        assert!(publish_confirmed(&ch, "", &q, b"poison", persistent.clone()).await.is_ack());
        assert!(publish_confirmed(&ch, "", &q, b"fine", persistent.clone()).await.is_ack());
        for returns in 0..2 {
            let (tag, _, body, count) = get(&ch, &q).await.expect("the poison message");
            assert_eq!((body.as_str(), count.unwrap_or(0)), ("poison", returns));
            nack_requeue(&ch, tag).await;
        }
        let _ = t("connection.close", c.close(200, "".into())).await;
        (dlq, q)
    };
    b.restart();
    {
        let (_c, ch) = connect_ch(&b).await;
        let (tag, redelivered, body, count) = get(&ch, &q).await.expect("kept across the restart");
        assert_eq!((redelivered, body.as_str(), count), (true, "poison", Some(2)), "two returns counted before the restart");
        nack_requeue(&ch, tag).await;
        // Held, unsettled, when the broker is killed: the answer to this basic.get came after
        // the unacked index (which holds the counts) was synced.
        let (_, _, body, count) = get(&ch, &q).await.expect("the poison message again");
        assert_eq!((body.as_str(), count), ("poison", Some(3)));
        b.kill9_restart();
    }
    let (_c, ch) = connect_ch(&b).await;
    let (tag, redelivered, body, count) = get(&ch, &q).await.expect("kept across the kill");
    assert_eq!((redelivered, body.as_str(), count), (true, "poison", Some(3)), "the crash's own requeue is not counted");
    nack_requeue(&ch, tag).await;
    let dead = dead_letters(&ch, &dlq, 1).await;
    assert_eq!((dead[0].0.as_str(), dead[0].1.as_str()), ("poison", "delivery_limit"), "the fourth return, over the limit of 3");
    let (_, redelivered, body, count) = get(&ch, &q).await.expect("the other message");
    assert_eq!((redelivered, body.as_str(), count), (false, "fine", None));
}
