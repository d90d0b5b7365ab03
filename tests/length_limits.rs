//! Queue length limits through lapin: `x-max-length`, `x-max-length-bytes` and `x-overflow`
//! (issue 12, item 3), as RabbitMQ 3.13/4.x documents them ("Queue Length Limit"): drop-head
//! by count and by body bytes (only ready messages count, unacked ones are never dropped, a
//! requeue over the limit drops the head), dead-lettering with reason `maxlen`,
//! reject-publish (basic.nack, nothing stored), reject-publish-dlx, bad arguments → 406,
//! and the limits across a kill -9 restart (the byte count is rebuilt from the store).
//! The replicated-queue case is in tests/cluster_queues.rs.

mod common;

use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(5);

fn limit_args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

fn long(v: i64) -> AMQPValue {
    AMQPValue::LongLongInt(v)
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

async fn chan(c: &lapin::Connection) -> Channel {
    t("channel.open", c.create_channel()).await.expect("channel.open")
}

/// Publishes each body to `queue` (default exchange) and returns whether each was acked.
async fn publish_each(ch: &Channel, queue: &str, bodies: &[&str], props: BasicProperties) -> Vec<bool> {
    let mut acks = Vec::new();
    for b in bodies {
        acks.push(publish_confirmed(ch, "", queue, b.as_bytes(), props.clone()).await.is_ack());
    }
    acks
}

async fn drained(ch: &Channel, queue: &str) -> Vec<String> {
    drain(ch, queue, 100).await.into_iter().map(|b| String::from_utf8(b).unwrap()).collect()
}

fn str_of(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        other => panic!("expected a string, got {other:?}"),
    }
}

/// (queue, reason, exchange, routing keys) of the newest x-death entry.
fn newest_death(props: &BasicProperties) -> (String, String, String, Vec<String>) {
    let h = props.headers().as_ref().expect("headers on a dead-lettered message");
    let AMQPValue::FieldArray(a) = h.inner().get("x-death").expect("x-death") else { panic!("x-death is not an array") };
    let AMQPValue::FieldTable(e) = &a.as_slice()[0] else { panic!("x-death entry is not a table") };
    let f = |k: &str| str_of(e.inner().get(k).unwrap_or_else(|| panic!("no {k} in x-death")));
    let AMQPValue::FieldArray(keys) = e.inner().get("routing-keys").expect("routing-keys") else { panic!("routing-keys") };
    (f("queue"), f("reason"), f("exchange"), keys.as_slice().iter().map(str_of).collect())
}

#[tokio::test]
async fn drop_head_by_count_keeps_the_newest() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let q = declare_queue(&ch, &uniq("maxlen"), Default::default(), limit_args(&[("x-max-length", long(3))])).await;
    let acks = publish_each(&ch, &q, &["m1", "m2", "m3", "m4", "m5"], Default::default()).await;
    assert!(acks.iter().all(|a| *a), "drop-head confirms every publish: {acks:?}");
    assert_eq!(ready_count(&ch, &q).await, 3);
    assert_eq!(drained(&ch, &q).await, ["m3", "m4", "m5"], "the oldest went");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn drop_head_counts_only_ready_messages_and_never_drops_unacked_ones() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let q = declare_queue(&ch, &uniq("maxlen-unacked"), Default::default(), limit_args(&[("x-max-length", long(2))])).await;
    publish_each(&ch, &q, &["m1"], Default::default()).await;
    let getter = chan(&c).await;
    let held = t("get", getter.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("m1");
    assert_eq!(held.delivery.data, b"m1");
    publish_each(&ch, &q, &["m2", "m3", "m4"], Default::default()).await;
    // m1 is delivered-unacked: it does not count, so only m2 had to go.
    assert_eq!(ready_count(&ch, &q).await, 2);
    // Requeued, m1 is at the head again and the queue over its limit: the head (m1) goes, as
    // RabbitMQ's requeue does (maybe_drop_head).
    t("nack requeue", held.delivery.nack(BasicNackOptions { requeue: true, ..Default::default() })).await.unwrap();
    assert_eq!(ready_count(&ch, &q).await, 2);
    assert_eq!(drained(&ch, &q).await, ["m3", "m4"]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn drop_head_by_body_bytes() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let q = declare_queue(&ch, &uniq("maxbytes"), Default::default(), limit_args(&[("x-max-length-bytes", long(10))])).await;
    // Headers do not count: only body bytes.
    let mut h = FieldTable::default();
    h.insert("padding".into(), text(&"x".repeat(200)));
    let props = BasicProperties::default().with_headers(h);
    publish_each(&ch, &q, &["aaaa", "bbbb", "cc"], props.clone()).await;
    assert_eq!(ready_count(&ch, &q).await, 3, "10 body bytes fit");
    publish_each(&ch, &q, &["ddd"], props.clone()).await;
    assert_eq!(ready_count(&ch, &q).await, 3, "13 bytes: the head (4) went");
    let getter = chan(&c).await;
    let held = t("get", getter.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("bbbb");
    assert_eq!(held.delivery.data, b"bbbb");
    // Ready now: cc, ddd (5 bytes); bbbb is unacked and does not count.
    publish_each(&ch, &q, &["eeeee"], props.clone()).await;
    assert_eq!(ready_count(&ch, &q).await, 3, "cc + ddd + eeeee = 10 bytes");
    // A message larger than the limit empties the queue, itself included.
    publish_each(&ch, &q, &["fffffffffff"], props).await;
    assert_eq!(ready_count(&ch, &q).await, 0);
    t("ack", held.delivery.ack(BasicAckOptions::default())).await.unwrap();
    assert_eq!(drained(&ch, &q).await, Vec::<String>::new());
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn drop_head_dead_letters_with_reason_maxlen() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let dlq = plain_queue(&ch, "maxlen-dlq").await;
    let src = uniq("maxlen-src");
    let args = limit_args(&[("x-max-length", long(1)), ("x-dead-letter-exchange", text("")), ("x-dead-letter-routing-key", text(&dlq))]);
    declare_queue(&ch, &src, Default::default(), args).await;
    publish_each(&ch, &src, &["m1", "m2", "m3"], BasicProperties::default().with_message_id("id".into())).await;
    assert_eq!(wait_ready(&ch, &dlq, 2, WAIT).await, 2, "the two oldest were dead-lettered");
    assert_eq!(ready_count(&ch, &src).await, 1);
    assert_eq!(drained(&ch, &src).await, ["m3"]);
    for want in ["m1", "m2"] {
        let g = t("get", ch.basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().expect("dead letter");
        assert_eq!(g.delivery.data, want.as_bytes());
        assert_eq!(g.delivery.properties.message_id().as_ref().map(|s| s.as_str()), Some("id"), "properties kept");
        assert_eq!(newest_death(&g.delivery.properties), (src.clone(), "maxlen".into(), "".into(), vec![src.clone()]));
    }
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn a_maxlen_queue_dead_lettering_into_itself_is_a_cycle_and_stops() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let q = uniq("maxlen-self");
    let args = limit_args(&[("x-max-length", long(1)), ("x-dead-letter-exchange", text("")), ("x-dead-letter-routing-key", text(&q))]);
    declare_queue(&ch, &q, Default::default(), args).await;
    publish_each(&ch, &q, &["m1", "m2"], Default::default()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // RabbitMQ drops a dead letter that would come back to a queue it died in with no
    // rejection in between; without that, m1 and m2 would push each other out for ever.
    assert_eq!(ready_count(&ch, &q).await, 1);
    assert_eq!(drained(&ch, &q).await, ["m2"]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn reject_publish_nacks_and_stores_nothing() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let args = limit_args(&[("x-max-length", long(2)), ("x-overflow", text("reject-publish"))]);
    let q = declare_queue(&ch, &uniq("reject"), QueueDeclareOptions::durable(), args).await;
    let persistent = BasicProperties::default().with_delivery_mode(2);
    let acks = publish_each(&ch, &q, &["m1", "m2", "m3"], persistent.clone()).await;
    assert_eq!(acks, [true, true, false], "the publish over the limit is nacked");
    assert_eq!(ready_count(&ch, &q).await, 2);
    // A publisher without confirms loses it silently; its channel stays open.
    let plain = chan(&c).await;
    publish(&plain, "", &q, b"m4").await;
    assert_eq!(ready_count(&plain, &q).await, 2);
    // Unacked messages do not count: with one delivered, one more fits.
    let held = t("get", plain.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("m1");
    assert_eq!(publish_each(&ch, &q, &["m5", "m6"], persistent.clone()).await, [true, false]);
    t("ack", held.delivery.ack(BasicAckOptions::default())).await.unwrap();
    assert_eq!(drained(&ch, &q).await, ["m2", "m5"]);
    // By bytes too.
    let args = limit_args(&[("x-max-length-bytes", long(6)), ("x-overflow", text("reject-publish"))]);
    let qb = declare_queue(&ch, &uniq("reject-bytes"), Default::default(), args).await;
    assert_eq!(publish_each(&ch, &qb, &["aaa", "bbb", "c", ""], Default::default()).await, [true, true, false, true]);
    assert_eq!(drained(&ch, &qb).await, ["aaa", "bbb", ""]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn reject_publish_dlx_dead_letters_the_refused_message() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let dlq = plain_queue(&ch, "reject-dlq").await;
    let src = uniq("reject-dlx");
    let args = limit_args(&[
        ("x-max-length", long(1)),
        ("x-overflow", text("reject-publish-dlx")),
        ("x-dead-letter-exchange", text("")),
        ("x-dead-letter-routing-key", text(&dlq)),
    ]);
    declare_queue(&ch, &src, Default::default(), args).await;
    assert_eq!(publish_each(&ch, &src, &["m1", "m2"], Default::default()).await, [true, false]);
    assert_eq!(wait_ready(&ch, &dlq, 1, WAIT).await, 1);
    assert_eq!(ready_count(&ch, &src).await, 1);
    let g = t("get", ch.basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().expect("dead letter");
    assert_eq!(g.delivery.data, b"m2", "the refused message, not the stored one");
    assert_eq!(newest_death(&g.delivery.properties), (src.clone(), "maxlen".into(), "".into(), vec![src.clone()]));
    assert_eq!(drained(&ch, &src).await, ["m1"]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn zero_is_a_valid_limit() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let q = declare_queue(&ch, &uniq("zero"), Default::default(), limit_args(&[("x-max-length", long(0))])).await;
    assert_eq!(publish_each(&ch, &q, &["m1", "m2"], Default::default()).await, [true, true]);
    assert_eq!(ready_count(&ch, &q).await, 0, "drop-head at 0 drops every message");
    let args = limit_args(&[("x-max-length", long(0)), ("x-overflow", text("reject-publish"))]);
    let q = declare_queue(&ch, &uniq("zero-reject"), Default::default(), args).await;
    assert_eq!(publish_each(&ch, &q, &["m1"], Default::default()).await, [false]);
    assert_eq!(ready_count(&ch, &q).await, 0);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn bad_length_arguments_are_precondition_failed() {
    let b = Broker::start();
    let c = connect(&b).await;
    let cases: Vec<(&str, AMQPValue)> = vec![
        ("x-max-length", long(-1)),
        ("x-max-length", text("ten")),
        ("x-max-length-bytes", long(-5)),
        ("x-max-length-bytes", AMQPValue::Boolean(true)),
        ("x-overflow", text("drop-tail")),
        ("x-overflow", text("")),
        ("x-overflow", long(1)),
    ];
    for (key, value) in cases {
        let ch = chan(&c).await;
        let what = format!("{key} = {value:?}");
        let mut args = limit_args(&[("x-max-length", long(5))]);
        args.insert(key.into(), value);
        let r = t("queue.declare", ch.queue_declare(uniq("bad").as_str().into(), Default::default(), args)).await;
        assert_code(r, 406, &what);
    }
    // The valid spellings are accepted.
    for overflow in ["drop-head", "reject-publish", "reject-publish-dlx"] {
        let ch = chan(&c).await;
        let args = limit_args(&[("x-max-length", long(5)), ("x-overflow", text(overflow))]);
        declare_queue(&ch, &uniq("good"), Default::default(), args).await;
    }
    // lapin may still be closing the refused channels: the close's own result does not matter.
    let _ = t("close", c.close(200, "".into())).await;
}

#[tokio::test]
async fn limits_hold_across_kill9() {
    let mut b = Broker::start();
    require_own_broker!(b, "kill -9 and restart");
    let persistent = BasicProperties::default().with_delivery_mode(2);
    let (q, qb, qr) = (uniq("maxlen-durable"), uniq("maxbytes-durable"), uniq("maxlen-reopen"));
    {
        let c = connect(&b).await;
        let ch = chan(&c).await;
        confirm_mode(&ch).await;
        declare_queue(&ch, &q, QueueDeclareOptions::durable(), limit_args(&[("x-max-length", long(3))])).await;
        declare_queue(&ch, &qb, QueueDeclareOptions::durable(), limit_args(&[("x-max-length-bytes", long(10))])).await;
        declare_queue(&ch, &qr, QueueDeclareOptions::durable(), limit_args(&[("x-max-length", long(2))])).await;
        let acks = publish_each(&ch, &q, &["m1", "m2", "m3", "m4", "m5", "m6"], persistent.clone()).await;
        assert!(acks.iter().all(|a| *a));
        assert!(publish_each(&ch, &qb, &["aaaa", "bbbb"], persistent.clone()).await.iter().all(|a| *a));
        assert_eq!(ready_count(&ch, &q).await, 3);
        // r1 stays delivered-unacked when the broker dies: it comes back ready at the restart,
        // three ready messages in a queue of two.
        publish_each(&ch, &qr, &["r1"], persistent.clone()).await;
        let getter = chan(&c).await;
        let held = t("get", getter.basic_get(qr.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("r1");
        assert_eq!(held.delivery.data, b"r1");
        publish_each(&ch, &qr, &["r2", "r3"], persistent.clone()).await;
        assert_eq!(ready_count(&ch, &qr).await, 2);
    }
    b.kill9_restart();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    assert_eq!(ready_count(&ch, &q).await, 3, "dropped messages stay dropped, kept ones stay");
    // The byte count is rebuilt from the store: 8 bytes stored, 4 more take it over 10.
    assert!(publish_each(&ch, &qb, &["cccc"], persistent.clone()).await[0]);
    assert_eq!(ready_count(&ch, &qb).await, 2);
    assert_eq!(drained(&ch, &q).await, ["m4", "m5", "m6"]);
    assert_eq!(drained(&ch, &qb).await, ["bbbb", "cccc"]);
    // Opened over its limit, the queue drops its head (r1, back at its original position), as
    // RabbitMQ's init_max_length does.
    assert_eq!(drained(&ch, &qr).await, ["r2", "r3"]);
    t("close", c.close(200, "".into())).await.unwrap();
}
