//! Queue priorities (`x-max-priority` on queue.declare and the message `priority` property,
//! issue 12 item 4) through lapin, as RabbitMQ 3.13/4.x documents them ("Priority Support"):
//! higher priorities go first, FIFO within one; no priority is 0, above the maximum is the
//! maximum; a requeued message returns to its place within its priority; basic.get and
//! consumers share the order; drop-head drops the message that would go next (the highest
//! priority's oldest, as RabbitMQ); bad `x-max-priority` values are 406 in RabbitMQ's words.
//! The order, the contents and the redelivered flags survive a graceful restart and kill -9,
//! and a replicated queue's new leader delivers in the same order after its leader is killed.
//!
//! Runs against RabbitMQ too (`RINGMQ_TEST_BROKER=127.0.0.1:5699`), the restarts and the
//! cluster excepted.

mod common;

use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use std::time::Duration;

fn max_priority(v: AMQPValue) -> FieldTable {
    let mut a = FieldTable::default();
    a.insert("x-max-priority".into(), v);
    a
}

fn prio(p: Option<u8>) -> BasicProperties {
    match p {
        Some(p) => BasicProperties::default().with_priority(p),
        None => BasicProperties::default(),
    }
}

/// Publishes (body, priority) pairs with confirms: once this returns, all are queued.
async fn publish_prioritised(ch: &Channel, queue: &str, msgs: &[(String, Option<u8>)], props: BasicProperties) {
    for (body, p) in msgs {
        let props = match p {
            Some(p) => props.clone().with_priority(*p),
            None => props.clone(),
        };
        let c = publish_confirmed(ch, "", queue, body.as_bytes(), props).await;
        assert!(c.is_ack(), "publish {body} not confirmed: {c:?}");
    }
}

/// The order RabbitMQ delivers `msgs` (published in this order) from a queue of maximum
/// `max`: by priority (absent = 0, clamped to `max`) descending, then publish order.
fn expected_order(msgs: &[(String, Option<u8>)], max: u8) -> Vec<String> {
    let mut v: Vec<(usize, &(String, Option<u8>))> = msgs.iter().enumerate().collect();
    v.sort_by_key(|(i, (_, p))| (std::cmp::Reverse(p.unwrap_or(0).min(max)), *i));
    v.into_iter().map(|(_, (b, _))| b.clone()).collect()
}

/// basic.get (no auto-ack, acked at once) until empty: (body, redelivered, priority property).
async fn get_all(ch: &Channel, queue: &str) -> Vec<(String, bool, Option<u8>)> {
    let mut out = Vec::new();
    for _ in 0..1000 {
        let Some(m) = t("basic.get", ch.basic_get(queue.into(), BasicGetOptions { no_ack: false })).await.expect("basic.get") else {
            break;
        };
        t("ack", m.delivery.ack(BasicAckOptions::default())).await.unwrap();
        out.push((String::from_utf8_lossy(&m.delivery.data).into_owned(), m.delivery.redelivered, *m.delivery.properties.priority()));
    }
    out
}

fn bodies(got: &[(String, bool, Option<u8>)]) -> Vec<String> {
    got.iter().map(|g| g.0.clone()).collect()
}

/// 60 messages over ten levels (0–9), then 5 without a priority (level 0) and 5 above the
/// maximum of 10 (level 10).
fn ten_levels() -> Vec<(String, Option<u8>)> {
    let mut msgs: Vec<(String, Option<u8>)> = (0..60).map(|i| (format!("m{i}-p{}", i % 10), Some((i % 10) as u8))).collect();
    msgs.extend((0..5).map(|i| (format!("none{i}"), None)));
    msgs.extend((0..5).map(|i| (format!("over{i}-p{}", 11 + i * 50), Some((11 + i * 50) as u8))));
    msgs
}

#[tokio::test]
async fn a_consumer_gets_higher_priorities_first_and_fifo_within_one() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let q = declare_queue(&ch, &uniq("prio"), Default::default(), max_priority(AMQPValue::LongInt(10))).await;
    let msgs = ten_levels();
    publish_prioritised(&ch, &q, &msgs, BasicProperties::default()).await;
    let want = expected_order(&msgs, 10);
    assert_eq!(&want[..5], ["over0-p11", "over1-p61", "over2-p111", "over3-p161", "over4-p211"], "above the maximum is the maximum");

    let cch = t("channel.open", c.create_channel()).await.unwrap();
    t("qos", cch.basic_qos(5, BasicQosOptions::default())).await.unwrap();
    let mut cons = t("consume", cch.basic_consume(q.as_str().into(), "".into(), Default::default(), FieldTable::default())).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..msgs.len() {
        let d = next_delivery(&mut cons, Duration::from_secs(5)).await;
        assert!(!d.redelivered);
        got.push(String::from_utf8_lossy(&d.data).into_owned());
        t("ack", d.ack(BasicAckOptions::default())).await.unwrap();
    }
    assert_eq!(got, want);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn basic_get_follows_the_priority_order_and_keeps_the_property() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let q = declare_queue(&ch, &uniq("prio-get"), Default::default(), max_priority(AMQPValue::ShortShortUInt(10))).await;
    let msgs = ten_levels();
    publish_prioritised(&ch, &q, &msgs, BasicProperties::default()).await;
    let got = get_all(&ch, &q).await;
    assert_eq!(bodies(&got), expected_order(&msgs, 10));
    let over = got.iter().find(|g| g.0 == "over4-p211").unwrap();
    assert_eq!(over.2, Some(211), "the priority property is delivered as published");
    assert_eq!(got.iter().find(|g| g.0 == "none0").unwrap().2, None);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn a_requeued_message_returns_to_its_place_within_its_priority() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let q = declare_queue(&ch, &uniq("prio-requeue"), Default::default(), max_priority(AMQPValue::LongInt(9))).await;
    let first: Vec<(String, Option<u8>)> =
        [("a1", 5), ("a2", 5), ("b1", 1), ("b2", 1)].iter().map(|(b, p)| (b.to_string(), Some(*p))).collect();
    publish_prioritised(&ch, &q, &first, BasicProperties::default()).await;

    // One channel takes a1 and a2; more arrive meanwhile, at their level and above.
    let holder = t("channel.open", c.create_channel()).await.unwrap();
    t("qos", holder.basic_qos(2, BasicQosOptions::default())).await.unwrap();
    let mut cons =
        t("consume", holder.basic_consume(q.as_str().into(), "".into(), Default::default(), FieldTable::default())).await.unwrap();
    let a1 = next_delivery(&mut cons, Duration::from_secs(5)).await;
    let a2 = next_delivery(&mut cons, Duration::from_secs(5)).await;
    assert_eq!((a1.data.as_slice(), a2.data.as_slice()), (&b"a1"[..], &b"a2"[..]));
    let later: Vec<(String, Option<u8>)> = [("a3", 5), ("c1", 9), ("b3", 1)].iter().map(|(b, p)| (b.to_string(), Some(*p))).collect();
    publish_prioritised(&ch, &q, &later, BasicProperties::default()).await;
    // a2 by nack(requeue), a1 by the channel's close.
    t("cancel", holder.basic_cancel(cons.tag(), BasicCancelOptions::default())).await.unwrap();
    t("nack", a2.nack(BasicNackOptions { requeue: true, ..Default::default() })).await.unwrap();
    t("channel.close", holder.close(200, "".into())).await.unwrap();

    let got = get_all(&ch, &q).await;
    let want: Vec<(String, bool)> = [("c1", false), ("a1", true), ("a2", true), ("a3", false), ("b1", false), ("b2", false), ("b3", false)]
        .iter()
        .map(|(b, r)| (b.to_string(), *r))
        .collect();
    assert_eq!(got.iter().map(|g| (g.0.clone(), g.1)).collect::<Vec<_>>(), want, "(body, redelivered)");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn drop_head_drops_the_next_message_to_go() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let mut args = max_priority(AMQPValue::LongInt(10));
    args.insert("x-max-length".into(), AMQPValue::LongInt(3));
    let q = declare_queue(&ch, &uniq("prio-maxlen"), Default::default(), args).await;
    let msgs: Vec<(String, Option<u8>)> = [1, 5, 9, 5, 1].iter().enumerate().map(|(i, p)| (format!("m{i}-p{p}"), Some(*p))).collect();
    publish_prioritised(&ch, &q, &msgs, BasicProperties::default()).await;
    // As RabbitMQ: the head is the highest priority's oldest (m2-p9 went, then m1-p5).
    assert_eq!(bodies(&get_all(&ch, &q).await), ["m3-p5", "m0-p1", "m4-p1"]);
    t("close", c.close(200, "".into())).await.unwrap();
}

/// The reply text of a channel.close carried by a lapin error.
fn reply_text(e: &lapin::Error) -> String {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => p.get_message().to_string(),
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_bad_max_priority_is_406_in_rabbitmqs_words() {
    let b = Broker::start();
    let c = connect(&b).await;
    let name = uniq("prio-bad");
    let cases = [
        (AMQPValue::LongInt(256), "{max_value_exceeded,256}".to_string()),
        (AMQPValue::LongInt(-1), "{value_negative,-1}".to_string()),
        (AMQPValue::LongString("x".into()), "\"expected integer, got longstr\"".to_string()),
    ];
    for (v, why) in cases {
        let ch = t("channel.open", c.create_channel()).await.unwrap();
        let r = t("declare", ch.queue_declare(name.as_str().into(), Default::default(), max_priority(v.clone()))).await;
        let e = r.expect_err("a bad x-max-priority was accepted");
        assert_eq!(reply_code(&e), Some(406), "{v:?}: {e}");
        let text = reply_text(&e);
        assert_eq!(text, format!("PRECONDITION_FAILED - invalid arg 'x-max-priority' for queue '{name}' in vhost '/': {why}"));
    }
    // 0 and 255 are accepted; a redeclare with another maximum is 406.
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    for v in [0, 255] {
        declare_queue(&ch, &name, Default::default(), max_priority(AMQPValue::LongInt(v))).await;
        t("delete", ch.queue_delete(name.as_str().into(), Default::default())).await.unwrap();
    }
    declare_queue(&ch, &name, Default::default(), max_priority(AMQPValue::LongInt(5))).await;
    let r = t("redeclare", ch.queue_declare(name.as_str().into(), Default::default(), max_priority(AMQPValue::LongInt(6)))).await;
    assert_code(r, 406, "a redeclare with another x-max-priority");
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    t("delete", ch.queue_delete(name.as_str().into(), Default::default())).await.unwrap();
    t("close", c.close(200, "".into())).await.unwrap();
}

/// A durable priority queue of persistent messages: 20 at priority 1, then 10 at priority 8.
/// Three of the priority-8 ones are held unacked on a channel when the broker stops (or is
/// killed). After the restart every message is there with its contents, in the same order:
/// the three held first and flagged redelivered, then the other seven priority-8 ones, then
/// the twenty priority-1 ones, none of them flagged (they were never handed out, though
/// higher offsets were).
async fn order_survives_a_restart(crash: bool) {
    let mut b = Broker::start();
    require_own_broker!(b, "restarts the broker");
    let q = uniq("prio-durable");
    let mut msgs: Vec<(String, Option<u8>)> = (0..20).map(|i| (format!("low{i}"), Some(1))).collect();
    msgs.extend((0..10).map(|i| (format!("high{i}"), Some(8))));
    let mut h = FieldTable::default();
    h.insert("k".into(), AMQPValue::LongString("v".into()));
    let props = BasicProperties::default().with_delivery_mode(2).with_headers(h).with_content_type("text/plain".into());
    {
        let (c, ch) = connect_ch(&b).await;
        confirm_mode(&ch).await;
        declare_queue(&ch, &q, QueueDeclareOptions { durable: true, ..Default::default() }, max_priority(AMQPValue::LongInt(10))).await;
        publish_prioritised(&ch, &q, &msgs, props.clone()).await;
        let holder = t("channel.open", c.create_channel()).await.unwrap();
        for i in 0..3 {
            let m = t("get", holder.basic_get(q.as_str().into(), BasicGetOptions { no_ack: false })).await.unwrap().expect("a message");
            assert_eq!(m.delivery.data, format!("high{i}").as_bytes());
        }
        // A round trip, and time for the cursor commit a wrong cursor would make.
        ready_count(&ch, &q).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        if crash {
            tokio::task::block_in_place(|| b.kill9_restart());
        } else {
            tokio::task::block_in_place(|| b.restart());
        }
        drop(c);
    }
    let (c, ch) = connect_ch(&b).await;
    let got = get_all(&ch, &q).await;
    let mut want: Vec<(String, bool)> = (0..3).map(|i| (format!("high{i}"), true)).collect();
    want.extend((3..10).map(|i| (format!("high{i}"), false)));
    want.extend((0..20).map(|i| (format!("low{i}"), false)));
    assert_eq!(got.iter().map(|g| (g.0.clone(), g.1)).collect::<Vec<_>>(), want, "(body, redelivered) after the restart");
    assert!(got.iter().all(|g| g.2 == Some(if g.0.starts_with("high") { 8 } else { 1 })), "priorities kept");
    // Contents: properties as published.
    let ch2 = t("channel.open", c.create_channel()).await.unwrap();
    confirm_mode(&ch2).await;
    publish_prioritised(&ch2, &q, &[("again".to_string(), Some(3))], props.clone()).await;
    let m = t("get", ch2.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().expect("a message");
    assert_eq!(m.delivery.properties.content_type().as_ref().map(|s| s.as_str()), Some("text/plain"));
    assert_eq!(m.delivery.properties.delivery_mode(), &Some(2));
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_and_flags_survive_a_graceful_restart() {
    order_survives_a_restart(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_and_flags_survive_kill_9() {
    order_survives_a_restart(true).await;
}

/// A replicated (durable) priority queue on a three-node cluster: 40 persistent messages at
/// four priorities; its node is killed with SIGKILL; the node that takes it over delivers
/// every message, in priority order.
#[test]
fn a_new_leader_delivers_in_priority_order_after_a_kill() {
    use common::cluster::{channel, run, Cluster};
    run(async {
        let mut c = Cluster::start(3);
        let q = uniq("prio-replicated");
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let ch1 = channel(&n1).await;
        declare_queue(&ch1, &q, QueueDeclareOptions { durable: true, ..Default::default() }, max_priority(AMQPValue::LongInt(5))).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let pub2 = channel(&n2).await;
        confirm_mode(&pub2).await;
        let msgs: Vec<(String, Option<u8>)> = (0..40).map(|i| (format!("m{i}"), [Some(0), Some(3), None, Some(5)][i % 4])).collect();
        publish_prioritised(&pub2, &q, &msgs, BasicProperties::default().with_delivery_mode(2)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.kill9(0);

        // Node 2 serves the queue again once a survivor took it over (bounded wait).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let got = loop {
            assert!(std::time::Instant::now() < deadline, "the queue was not served again within 60 s");
            let ch = channel(&n2).await;
            let opts = QueueDeclareOptions { passive: true, ..Default::default() };
            let ready = ch.queue_declare(q.as_str().into(), opts, FieldTable::default()).await.map(|d| d.message_count());
            if ready.ok() == Some(40) {
                break get_all(&ch, &q).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(bodies(&got), expected_order(&msgs, 5));
        assert!(got.iter().all(|g| !g.1), "nothing was handed out before the kill");
    });
}

#[tokio::test]
async fn an_ordinary_queue_ignores_the_priority_property() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let q = plain_queue(&ch, "no-prio").await;
    let msgs: Vec<(String, Option<u8>)> = (0..10).map(|i| (format!("m{i}"), Some((i * 3 % 10) as u8))).collect();
    publish_prioritised(&ch, &q, &msgs, prio(None)).await;
    assert_eq!(bodies(&get_all(&ch, &q).await), msgs.iter().map(|m| m.0.clone()).collect::<Vec<_>>());
    t("close", c.close(200, "".into())).await.unwrap();
}
