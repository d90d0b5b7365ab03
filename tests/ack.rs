//! The acknowledgement path, through lapin (and raw sockets for a dropped connection).
//!
//! Covers issue 4 item 4 (every entry point of the one requeue primitive: nack/reject with
//! requeue, basic.recover, channel close, connection close, dropped TCP socket; redelivered
//! flag; original-position order; basic.cancel does not requeue), item 6 (x-consumer-timeout
//! closes the channel with 406 and requeues — ringmq-only, see the test), item 7 (double ack and
//! wrong-channel ack → 406 PRECONDITION_FAILED, multiple=true with tag 0, auto-ack never
//! redelivered, consumer_cancel_notify on queue deletion), item 8 (dead-lettering on
//! reject/nack(requeue=false) with x-death as RabbitMQ writes it, dead-letter chains) and item 9
//! (competing consumers and concurrent basic.get callers over several connections: no message
//! outstanding twice, none lost). Also issue 2 item 5 (ack/nack/reject with multiple/requeue).
//! Validated against RabbitMQ 3.10 except where marked ringmq-only.

mod common;

use common::raw::RawConn;
use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(5);

async fn fill(ch: &Channel, q: &str, bodies: &[&str]) {
    confirm_mode(ch).await;
    for b in bodies {
        let c = publish_confirmed(ch, "", q, b.as_bytes(), BasicProperties::default().with_message_id((*b).into())).await;
        assert!(c.is_ack());
    }
}

async fn consume(ch: &Channel, q: &str, no_ack: bool) -> lapin::Consumer {
    t("basic.consume", ch.basic_consume(q.into(), "".into(), BasicConsumeOptions { no_ack, ..Default::default() }, FieldTable::default()))
        .await
        .expect("basic.consume")
}

async fn take(c: &mut lapin::Consumer, n: usize) -> Vec<lapin::message::Delivery> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(next_delivery(c, WAIT).await);
    }
    v
}

fn bodies(v: &[lapin::message::Delivery]) -> Vec<String> {
    v.iter().map(|d| String::from_utf8(d.data.clone()).unwrap()).collect()
}

fn flags(v: &[lapin::message::Delivery]) -> Vec<bool> {
    v.iter().map(|d| d.redelivered).collect()
}

/// Open a channel on `c`.
async fn chan(c: &Connection) -> Channel {
    t("channel.open", c.create_channel()).await.expect("channel.open")
}

#[tokio::test]
async fn ack_nack_reject_with_multiple_and_requeue() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = plain_queue(&admin, "settle").await;
    fill(&admin, &q, &["m1", "m2", "m3", "m4", "m5", "m6", "m7"]).await;
    let ch = chan(&c).await;
    let mut cons = consume(&ch, &q, false).await;
    let d = take(&mut cons, 7).await;
    assert_eq!(bodies(&d), ["m1", "m2", "m3", "m4", "m5", "m6", "m7"]);
    assert_eq!(flags(&d), [false; 7]);
    // ack m1, ack multiple up to m3 (settles m2, m3)
    t("ack", ch.basic_ack(d[0].delivery_tag, BasicAckOptions::default())).await.unwrap();
    t("ack multiple", ch.basic_ack(d[2].delivery_tag, BasicAckOptions { multiple: true })).await.unwrap();
    // reject m4 without requeue: dropped (no DLX)
    t("reject", ch.basic_reject(d[3].delivery_tag, BasicRejectOptions { requeue: false })).await.unwrap();
    // nack m5..m6 multiple with requeue → redelivered, in order
    t("nack multiple requeue", ch.basic_nack(d[5].delivery_tag, BasicNackOptions { multiple: true, requeue: true })).await.unwrap();
    let again = take(&mut cons, 2).await;
    assert_eq!(bodies(&again), ["m5", "m6"]);
    assert_eq!(flags(&again), [true, true]);
    assert!(again[0].delivery_tag > d[6].delivery_tag, "delivery tags only grow");
    // reject m5 with requeue → redelivered again
    t("reject requeue", ch.basic_reject(again[0].delivery_tag, BasicRejectOptions { requeue: true })).await.unwrap();
    let third = take(&mut cons, 1).await;
    assert_eq!(bodies(&third), ["m5"]);
    assert!(third[0].redelivered);
    // nack without requeue (single) drops m6
    t("nack drop", ch.basic_nack(again[1].delivery_tag, BasicNackOptions { multiple: false, requeue: false })).await.unwrap();
    // m7 and m5 remain unacked; ack them
    t("ack", ch.basic_ack(third[0].delivery_tag, BasicAckOptions::default())).await.unwrap();
    t("ack", ch.basic_ack(d[6].delivery_tag, BasicAckOptions::default())).await.unwrap();
    assert_no_delivery(&mut cons, Duration::from_millis(300), "after settling everything").await;
    t("close ch", ch.close(200, "".into())).await.unwrap();
    assert_eq!(ready_count(&admin, &q).await, 0, "nothing left after settling everything");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn requeue_returns_to_original_position() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = plain_queue(&admin, "origpos").await;
    fill(&admin, &q, &["a", "b", "c", "d", "e"]).await;
    let ch = chan(&c).await;
    t("qos", ch.basic_qos(3, Default::default())).await.unwrap();
    let mut cons = consume(&ch, &q, false).await;
    let d = take(&mut cons, 3).await;
    assert_eq!(bodies(&d), ["a", "b", "c"]);
    // requeue b, c, then a (out of order): like RabbitMQ, requeued messages go back to their
    // original position, so the queue reads a, b, c (redelivered) before d, e.
    t("cancel", ch.basic_cancel(cons.tag(), Default::default())).await.unwrap();
    t("nack b", ch.basic_nack(d[1].delivery_tag, BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
    t("nack c", ch.basic_nack(d[2].delivery_tag, BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
    t("nack a", ch.basic_nack(d[0].delivery_tag, BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
    assert_eq!(wait_ready(&admin, &q, 5, WAIT).await, 5);
    let ch2 = chan(&c).await;
    let mut cons2 = consume(&ch2, &q, true).await;
    let all = take(&mut cons2, 5).await;
    assert_eq!(bodies(&all), ["a", "b", "c", "d", "e"], "requeued messages go back to their original position");
    assert_eq!(flags(&all), [true, true, true, false, false]);
    // properties unchanged by the requeue
    assert_eq!(all[0].properties.message_id().as_ref().map(|s| s.as_str()), Some("a"));
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn basic_cancel_does_not_requeue_unacked() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = plain_queue(&admin, "cancelkeep").await;
    fill(&admin, &q, &["x", "y"]).await;
    let ch = chan(&c).await;
    let mut cons = consume(&ch, &q, false).await;
    let d = take(&mut cons, 2).await;
    t("cancel", ch.basic_cancel(cons.tag(), Default::default())).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(ready_count(&admin, &q).await, 0, "basic.cancel must not requeue unacked messages");
    // still ackable on the channel after cancel
    t("ack", ch.basic_ack(d[1].delivery_tag, BasicAckOptions { multiple: true })).await.unwrap();
    t("qos", ch.basic_qos(0, Default::default())).await.unwrap();
    t("close", c.close(200, "".into())).await.unwrap();
    assert_eq!(ready_count(&chan(&connect(&b).await).await, &q).await, 0);
}

#[tokio::test]
async fn requeue_on_channel_close_and_connection_close() {
    let b = Broker::start();
    let admin_c = connect(&b).await;
    let admin = chan(&admin_c).await;
    let q = plain_queue(&admin, "closereq").await;
    fill(&admin, &q, &["a", "b", "c"]).await;
    let c = connect(&b).await;
    let ch = chan(&c).await;
    let mut cons = consume(&ch, &q, false).await;
    let d = take(&mut cons, 3).await;
    t("ack a", ch.basic_ack(d[0].delivery_tag, Default::default())).await.unwrap();
    t("channel close", ch.close(200, "".into())).await.unwrap();
    assert_eq!(wait_ready(&admin, &q, 2, WAIT).await, 2, "channel.close requeues unacked");
    let ch = chan(&c).await;
    let mut cons = consume(&ch, &q, false).await;
    let d = take(&mut cons, 2).await;
    assert_eq!(bodies(&d), ["b", "c"]);
    assert_eq!(flags(&d), [true, true]);
    t("connection close", c.close(200, "".into())).await.unwrap();
    assert_eq!(wait_ready(&admin, &q, 2, WAIT).await, 2, "connection.close requeues unacked");
    let m = get_body(&admin, &q).await.unwrap();
    assert_eq!(m, b"b");
    t("close", admin_c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn requeue_on_dropped_socket() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = plain_queue(&admin, "dropreq").await;
    fill(&admin, &q, &["p", "q", "r"]).await;
    let q2 = q.clone();
    let addr = b.addr();
    let got = tokio::task::spawn_blocking(move || {
        let mut raw = RawConn::open(addr);
        raw.open_channel(1);
        raw.basic_consume(1, &q2, "raw-consumer");
        let mut got = Vec::new();
        for _ in 0..3 {
            got.push(raw.read_delivery().expect("delivery on raw socket"));
        }
        // ack the first, then vanish without any close handshake
        let mut a = Vec::new();
        a.extend_from_slice(&got[0].delivery_tag.to_be_bytes());
        a.push(0);
        raw.send_method(1, 60, 80, &a);
        let _ = raw.sock.shutdown(std::net::Shutdown::Both);
        got
    })
    .await
    .unwrap();
    assert_eq!(got.iter().map(|d| d.body.clone()).collect::<Vec<_>>(), [b"p".to_vec(), b"q".to_vec(), b"r".to_vec()]);
    assert_eq!(wait_ready(&admin, &q, 2, WAIT).await, 2, "a dropped socket requeues unacked messages");
    let ch = chan(&c).await;
    let mut cons = consume(&ch, &q, true).await;
    let d = take(&mut cons, 2).await;
    assert_eq!(bodies(&d), ["q", "r"]);
    assert_eq!(flags(&d), [true, true]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn basic_recover_requeue_redelivers() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = plain_queue(&admin, "recover").await;
    fill(&admin, &q, &["r1", "r2"]).await;
    let ch = chan(&c).await;
    let mut cons = consume(&ch, &q, false).await;
    let d = take(&mut cons, 2).await;
    assert_eq!(flags(&d), [false, false]);
    t("recover", ch.basic_recover(BasicRecoverOptions { requeue: true })).await.unwrap();
    let again = take(&mut cons, 2).await;
    assert_eq!(bodies(&again), ["r1", "r2"]);
    assert_eq!(flags(&again), [true, true]);
    assert!(again[0].delivery_tag > d[1].delivery_tag);
    // the old tags are gone: acking the new ones settles everything
    t("ack", ch.basic_ack(again[1].delivery_tag, BasicAckOptions { multiple: true })).await.unwrap();
    t("close ch", ch.close(200, "".into())).await.unwrap();
    assert_eq!(ready_count(&admin, &q).await, 0);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn double_ack_unknown_tag_and_wrong_channel_are_precondition_failed() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = plain_queue(&admin, "badack").await;
    fill(&admin, &q, &["1", "2", "3", "4"]).await;

    // double ack → 406, and the unacked message of the closed channel is requeued
    let ch = chan(&c).await;
    let w = close_watch(&ch).await;
    let g = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().unwrap();
    let g2 = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().unwrap();
    t("ack", ch.basic_ack(g.delivery.delivery_tag, Default::default())).await.unwrap();
    t("ack again", ch.basic_ack(g.delivery.delivery_tag, Default::default())).await.unwrap();
    assert_eq!(w.code("double ack").await, 406);
    assert_eq!(wait_ready(&admin, &q, 3, WAIT).await, 3, "the message still unacked on the closed channel is requeued");
    let _ = g2;

    // unknown tag → 406
    let ch = chan(&c).await;
    let w = close_watch(&ch).await;
    t("ack unknown", ch.basic_ack(999, Default::default())).await.unwrap();
    assert_eq!(w.code("ack of an unknown tag").await, 406);
    let ch = chan(&c).await;
    let w = close_watch(&ch).await;
    t("reject unknown", ch.basic_reject(77, BasicRejectOptions { requeue: true })).await.unwrap();
    assert_eq!(w.code("reject of an unknown tag").await, 406);
    let ch = chan(&c).await;
    let w = close_watch(&ch).await;
    t("nack unknown", ch.basic_nack(55, BasicNackOptions { multiple: true, requeue: true })).await.unwrap();
    assert_eq!(w.code("nack multiple of an unknown tag").await, 406);

    // settlement on another channel → unknown tag there → 406; the original delivery is fine
    let ch_a = chan(&c).await;
    let ch_b = chan(&c).await;
    let w = close_watch(&ch_b).await;
    let g = t("get", ch_a.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().unwrap();
    t("ack on wrong channel", ch_b.basic_ack(g.delivery.delivery_tag, Default::default())).await.unwrap();
    assert_eq!(w.code("ack on the wrong channel").await, 406);
    t("ack on right channel", ch_a.basic_ack(g.delivery.delivery_tag, Default::default())).await.unwrap();
    t("qos", ch_a.basic_qos(0, Default::default())).await.unwrap();
    assert_eq!(ready_count(&admin, &q).await, 2);

    // ack after a nack-requeue of the same tag → 406
    let ch = chan(&c).await;
    let w = close_watch(&ch).await;
    let g = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().unwrap();
    t("nack", ch.basic_nack(g.delivery.delivery_tag, BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
    t("ack after nack", ch.basic_ack(g.delivery.delivery_tag, Default::default())).await.unwrap();
    assert_eq!(w.code("ack after nack").await, 406);
    assert_eq!(wait_ready(&admin, &q, 2, WAIT).await, 2);
    // the connection survives all of this
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn multiple_with_tag_zero_settles_everything() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = plain_queue(&admin, "tag0").await;
    fill(&admin, &q, &["1", "2", "3", "4", "5", "6"]).await;
    let ch = chan(&c).await;
    t("qos", ch.basic_qos(3, Default::default())).await.unwrap();
    let mut cons = consume(&ch, &q, false).await;
    let _d = take(&mut cons, 3).await;
    // nack(0, multiple, requeue) requeues everything outstanding...
    t("cancel", ch.basic_cancel(cons.tag(), Default::default())).await.unwrap();
    let mut tags = Vec::new();
    for _ in 0..3 {
        let g = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().unwrap();
        tags.push(g.delivery.delivery_tag);
    }
    assert_eq!(ready_count(&admin, &q).await, 0);
    t("nack all", ch.basic_nack(0, BasicNackOptions { multiple: true, requeue: true })).await.unwrap();
    assert_eq!(wait_ready(&admin, &q, 6, WAIT).await, 6, "nack(0, multiple) requeues all outstanding");
    // ...and ack(0, multiple) acks everything outstanding (consume + get share the tag space)
    t("qos", ch.basic_qos(0, Default::default())).await.unwrap();
    let mut cons = consume(&ch, &q, false).await;
    let d = take(&mut cons, 6).await;
    assert!(d.iter().all(|d| d.delivery_tag > tags[2]));
    t("ack all", ch.basic_ack(0, BasicAckOptions { multiple: true })).await.unwrap();
    t("qos", ch.basic_qos(0, Default::default())).await.unwrap();
    t("close ch", ch.close(200, "".into())).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(ready_count(&admin, &q).await, 0, "ack(0, multiple) settled all six");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn auto_ack_is_never_redelivered() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = plain_queue(&admin, "autoack").await;
    fill(&admin, &q, &["1", "2", "3"]).await;
    let ch = chan(&c).await;
    let mut cons = consume(&ch, &q, true).await;
    let _ = take(&mut cons, 3).await;
    t("recover", ch.basic_recover(BasicRecoverOptions { requeue: true })).await.unwrap();
    assert_no_delivery(&mut cons, Duration::from_millis(300), "auto-ack deliveries after recover").await;
    t("close ch", ch.close(200, "".into())).await.unwrap();
    let g = t("get noack", admin.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap();
    assert!(g.is_none(), "auto-ack message came back");
    // acking an auto-ack delivery's tag is an unknown tag → 406
    fill(&admin, &q, &["4"]).await;
    let ch = chan(&c).await;
    let w = close_watch(&ch).await;
    let g = t("get noack", ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().unwrap();
    t("ack auto-acked", ch.basic_ack(g.delivery.delivery_tag, Default::default())).await.unwrap();
    assert_eq!(w.code("ack of an auto-ack delivery").await, 406);
    assert_eq!(ready_count(&admin, &q).await, 0);
    t("close", c.close(200, "".into())).await.unwrap();
}

fn str_of(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        other => panic!("expected a string, got {other:?}"),
    }
}

fn get<'a>(t: &'a FieldTable, k: &str) -> &'a AMQPValue {
    t.inner().get(k).unwrap_or_else(|| panic!("missing {k} in {t:?}"))
}

/// The x-death entries of a dead-lettered message, newest first.
fn x_death(props: &BasicProperties) -> Vec<FieldTable> {
    let h = props.headers().as_ref().expect("headers on a dead-lettered message");
    match get(h, "x-death") {
        AMQPValue::FieldArray(a) => a
            .as_slice()
            .iter()
            .map(|v| match v {
                AMQPValue::FieldTable(t) => t.clone(),
                other => panic!("x-death entry is not a table: {other:?}"),
            })
            .collect(),
        other => panic!("x-death is not an array: {other:?}"),
    }
}

/// Check one x-death entry as RabbitMQ writes it: queue, reason, count (long), exchange,
/// routing-keys (array of strings), time (timestamp).
fn check_death(e: &FieldTable, queue: &str, reason: &str, count: i64, exchange: &str, keys: &[&str]) {
    assert_eq!(str_of(get(e, "queue")), queue);
    assert_eq!(str_of(get(e, "reason")), reason);
    assert_eq!(str_of(get(e, "exchange")), exchange);
    match get(e, "count") {
        AMQPValue::LongLongInt(n) => assert_eq!(*n, count),
        other => panic!("x-death count should be a long (type l): {other:?}"),
    }
    match get(e, "routing-keys") {
        AMQPValue::FieldArray(a) => {
            let ks: Vec<String> = a.as_slice().iter().map(str_of).collect();
            assert_eq!(ks, keys);
        }
        other => panic!("routing-keys should be an array: {other:?}"),
    }
    assert!(matches!(get(e, "time"), AMQPValue::Timestamp(ts) if *ts > 1_600_000_000), "time: {:?}", get(e, "time"));
}

#[tokio::test]
async fn dead_letter_on_reject_and_nack_with_x_death() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    confirm_mode(&admin).await;
    let dlx = uniq("dlx");
    t("dlx", admin.exchange_declare(dlx.as_str().into(), lapin::ExchangeKind::Direct, Default::default(), FieldTable::default()))
        .await
        .unwrap();
    let dlq = plain_queue(&admin, "dlq").await;
    t("bind", admin.queue_bind(dlq.as_str().into(), dlx.as_str().into(), "dead".into(), Default::default(), FieldTable::default()))
        .await
        .unwrap();
    let dlq_rk = plain_queue(&admin, "dlq-origkey").await;
    let src_x = uniq("src-x");
    t("src x", admin.exchange_declare(src_x.as_str().into(), lapin::ExchangeKind::Direct, Default::default(), FieldTable::default()))
        .await
        .unwrap();
    // q1: dead-letters with routing key "dead"; q2: keeps the original routing key
    let mut a1 = FieldTable::default();
    a1.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(dlx.as_str().into()));
    a1.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString("dead".into()));
    let q1 = declare_queue(&admin, &uniq("dl-src1"), Default::default(), a1).await;
    let mut a2 = FieldTable::default();
    a2.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(dlx.as_str().into()));
    let q2 = declare_queue(&admin, &uniq("dl-src2"), Default::default(), a2).await;
    t("bind", admin.queue_bind(q1.as_str().into(), src_x.as_str().into(), "orig-key".into(), Default::default(), FieldTable::default()))
        .await
        .unwrap();
    t("bind", admin.queue_bind(q2.as_str().into(), src_x.as_str().into(), "orig2".into(), Default::default(), FieldTable::default()))
        .await
        .unwrap();
    t("bind", admin.queue_bind(dlq_rk.as_str().into(), dlx.as_str().into(), "orig2".into(), Default::default(), FieldTable::default()))
        .await
        .unwrap();

    let mut h = FieldTable::default();
    h.insert("app".into(), AMQPValue::LongString("kept".into()));
    let props = BasicProperties::default().with_message_id("dl-1".into()).with_correlation_id("corr".into()).with_headers(h);
    for body in ["rejected", "nacked-1", "nacked-2"] {
        publish_confirmed(&admin, &src_x, "orig-key", body.as_bytes(), props.clone()).await;
    }
    publish_confirmed(&admin, &src_x, "orig2", b"to-orig2", props.clone()).await;

    let ch = chan(&c).await;
    let mut cons = consume(&ch, &q1, false).await;
    let d = take(&mut cons, 3).await;
    t("reject", ch.basic_reject(d[0].delivery_tag, BasicRejectOptions { requeue: false })).await.unwrap();
    t("nack multiple", ch.basic_nack(d[2].delivery_tag, BasicNackOptions { multiple: true, requeue: false })).await.unwrap();
    let g = t("get", ch.basic_get(q2.as_str().into(), BasicGetOptions::default())).await.unwrap().unwrap();
    t("nack", ch.basic_nack(g.delivery.delivery_tag, BasicNackOptions { multiple: false, requeue: false })).await.unwrap();

    assert_eq!(wait_ready(&admin, &dlq, 3, WAIT).await, 3);
    assert_eq!(wait_ready(&admin, &q1, 0, WAIT).await, 0, "dead-lettered messages leave the source queue");
    let dch = chan(&c).await;
    let mut dc = consume(&dch, &dlq, true).await;
    let dead = take(&mut dc, 3).await;
    assert_eq!(bodies(&dead), ["rejected", "nacked-1", "nacked-2"]);
    for m in &dead {
        assert_eq!(m.routing_key.as_str(), "dead", "x-dead-letter-routing-key replaces the key");
        assert_eq!(m.exchange.as_str(), dlx);
        assert!(!m.redelivered);
        assert_eq!(m.properties.message_id().as_ref().unwrap().as_str(), "dl-1");
        assert_eq!(m.properties.correlation_id().as_ref().unwrap().as_str(), "corr");
        let h = m.properties.headers().as_ref().unwrap();
        assert_eq!(str_of(get(h, "app")), "kept");
        let deaths = x_death(&m.properties);
        assert_eq!(deaths.len(), 1);
        check_death(&deaths[0], &q1, "rejected", 1, &src_x, &["orig-key"]);
        assert_eq!(str_of(get(h, "x-first-death-queue")), q1);
        assert_eq!(str_of(get(h, "x-first-death-reason")), "rejected");
        assert_eq!(str_of(get(h, "x-first-death-exchange")), src_x);
    }
    let m = t("get", admin.basic_get(dlq_rk.as_str().into(), BasicGetOptions { no_ack: true }))
        .await
        .unwrap()
        .expect("dead-lettered with original key");
    assert_eq!(m.delivery.data, b"to-orig2");
    assert_eq!(m.delivery.routing_key.as_str(), "orig2", "without x-dead-letter-routing-key the original key is kept");
    check_death(&x_death(&m.delivery.properties)[0], &q2, "rejected", 1, &src_x, &["orig2"]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn dead_letter_chain_and_cycle_count() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    confirm_mode(&admin).await;
    // q_a --reject--> (default exchange, key q_b) q_b --reject--> (default exchange, key q_c) q_c
    let q_c = plain_queue(&admin, "chain-c").await;
    let mut ab = FieldTable::default();
    ab.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
    ab.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(q_c.as_str().into()));
    let q_b = declare_queue(&admin, &uniq("chain-b"), Default::default(), ab).await;
    let mut aa = FieldTable::default();
    aa.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
    aa.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(q_b.as_str().into()));
    let q_a = declare_queue(&admin, &uniq("chain-a"), Default::default(), aa).await;
    publish_confirmed(&admin, "", &q_a, b"hop", BasicProperties::default()).await;

    let ch = chan(&c).await;
    for q in [&q_a, &q_b] {
        let mut g = None;
        for _ in 0..50 {
            g = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap();
            if g.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let g = g.unwrap_or_else(|| panic!("message never reached {q}"));
        t("reject", ch.basic_reject(g.delivery.delivery_tag, BasicRejectOptions { requeue: false })).await.unwrap();
    }
    assert_eq!(wait_ready(&admin, &q_c, 1, WAIT).await, 1);
    let m = t("get", admin.basic_get(q_c.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().unwrap();
    assert_eq!(m.delivery.data, b"hop");
    let deaths = x_death(&m.delivery.properties);
    assert_eq!(deaths.len(), 2, "one x-death entry per (queue, reason): {deaths:?}");
    // newest first
    check_death(&deaths[0], &q_b, "rejected", 1, "", &[&q_b]);
    check_death(&deaths[1], &q_a, "rejected", 1, "", &[&q_a]);
    let h = m.delivery.properties.headers().as_ref().unwrap();
    assert_eq!(str_of(get(h, "x-first-death-queue")), q_a);
    if !b.is_external() {
        // RabbitMQ 3.13+ (3.10, the external reference, predates them): the latest death.
        assert_eq!(str_of(get(h, "x-last-death-queue")), q_b);
        assert_eq!(str_of(get(h, "x-last-death-reason")), "rejected");
        assert_eq!(str_of(get(h, "x-last-death-exchange")), "");
    }

    // Dead-lettering the same message from the same queue again increments count in place.
    // Route q_c back to q_a via a DLX on a fresh queue pair: q_x rejects into q_y twice.
    let q_y = plain_queue(&admin, "cnt-y").await;
    let mut ax = FieldTable::default();
    ax.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
    ax.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(q_y.as_str().into()));
    let q_x = declare_queue(&admin, &uniq("cnt-x"), Default::default(), ax).await;
    publish_confirmed(&admin, "", &q_x, b"twice", BasicProperties::default()).await;
    let g = t("get", ch.basic_get(q_x.as_str().into(), BasicGetOptions::default())).await.unwrap().unwrap();
    t("reject", ch.basic_reject(g.delivery.delivery_tag, BasicRejectOptions { requeue: false })).await.unwrap();
    assert_eq!(wait_ready(&admin, &q_y, 1, WAIT).await, 1);
    let once = t("get", ch.basic_get(q_y.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().unwrap();
    // republish it, x-death included, to q_x and dead-letter it again
    publish_confirmed(&admin, "", &q_x, b"twice", once.delivery.properties.clone()).await;
    let g = t("get", ch.basic_get(q_x.as_str().into(), BasicGetOptions::default())).await.unwrap().unwrap();
    t("reject", ch.basic_reject(g.delivery.delivery_tag, BasicRejectOptions { requeue: false })).await.unwrap();
    assert_eq!(wait_ready(&admin, &q_y, 1, WAIT).await, 1);
    let twice = t("get", ch.basic_get(q_y.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().unwrap();
    let deaths = x_death(&twice.delivery.properties);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    check_death(&deaths[0], &q_x, "rejected", 2, "", &[&q_x]);
    t("close", c.close(200, "".into())).await.unwrap();
}

/// A queue with x-consumer-timeout 1 s (classic, or a durable quorum queue) holding "slow1"
/// and "slow2".
async fn slow_queue(admin: &Channel, quorum: bool) -> String {
    let mut args = FieldTable::default();
    args.insert("x-consumer-timeout".into(), AMQPValue::LongLongInt(1000));
    if quorum {
        args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    }
    let q = declare_queue(admin, &uniq("ctimeout"), QueueDeclareOptions { durable: quorum, ..Default::default() }, args).await;
    fill(admin, &q, &["slow1", "slow2"]).await;
    q
}

/// ringmq-only: RabbitMQ 3.10 has no per-queue x-consumer-timeout argument, and checks its
/// global consumer_timeout only about once a minute.
#[tokio::test]
async fn consumer_timeout_closes_channel_406_and_requeues() {
    let b = Broker::start();
    require_own_broker!(b, "x-consumer-timeout is ringmq-only (RabbitMQ 3.10 lacks the queue argument)");
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = slow_queue(&admin, false).await;
    let ch = chan(&c).await;
    let w = close_watch(&ch).await;
    let mut cons = consume(&ch, &q, false).await;
    let d = take(&mut cons, 2).await;
    t("ack first", ch.basic_ack(d[0].delivery_tag, Default::default())).await.unwrap();
    // hold the second past the timeout: the broker closes the channel with 406
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let code = tt("consumer timeout", Duration::from_secs(15), w.code("delivery held past x-consumer-timeout")).await;
    assert_eq!(code, 406, "a delivery held past x-consumer-timeout closes the channel with 406");
    assert_eq!(wait_ready(&admin, &q, 1, WAIT).await, 1, "the held message is requeued");
    let m = t("get", admin.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().unwrap();
    assert_eq!(m.delivery.data, b"slow2");
    assert!(m.delivery.redelivered);
    assert!(c.status().connected(), "only the channel is closed");
    t("close", c.close(200, "".into())).await.unwrap();
}

/// Issue 12 item 13, the quorum-queue way (RabbitMQ 4.3): past x-consumer-timeout, a
/// consumer whose client announced consumer_cancel_notify (lapin does) gets basic.cancel, its
/// unacked messages are requeued, and its channel stays open.
#[tokio::test]
async fn consumer_timeout_on_a_quorum_queue_cancels_the_consumer_and_keeps_the_channel() {
    let b = Broker::start();
    require_own_broker!(b, "x-consumer-timeout is ringmq-only (RabbitMQ 3.10 lacks the queue argument)");
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = slow_queue(&admin, true).await;
    let ch = chan(&c).await;
    let mut cons = consume(&ch, &q, false).await;
    let d = take(&mut cons, 2).await;
    t("ack first", ch.basic_ack(d[0].delivery_tag, Default::default())).await.unwrap();
    // Held past the timeout: the consumer is cancelled (its stream ends)...
    use futures_lite::StreamExt;
    let end = tokio::time::timeout(Duration::from_secs(15), cons.next()).await.expect("consumer not cancelled within 15 s");
    assert!(end.is_none(), "expected basic.cancel to end the consumer, got {end:?}");
    // ...the held message is ready again, flagged, and the channel still works.
    assert_eq!(wait_ready(&admin, &q, 1, WAIT).await, 1, "the held message is requeued");
    let m = t("get on the same channel", ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().unwrap();
    assert_eq!(m.delivery.data, b"slow2");
    assert!(m.delivery.redelivered);
    assert!(ch.status().connected(), "the channel was closed");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn consumer_cancel_notify_on_queue_delete() {
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = plain_queue(&admin, "cancelnotify").await;
    let ch = chan(&c).await;
    let mut cons = consume(&ch, &q, false).await;
    t("delete", admin.queue_delete(q.as_str().into(), Default::default())).await.unwrap();
    use futures_lite::StreamExt;
    let end = tokio::time::timeout(WAIT, cons.next()).await.expect("consumer not cancelled within 5 s");
    assert!(end.is_none(), "expected the stream to end on broker basic.cancel, got {end:?}");
    // the channel stays open
    t("qos after cancel", ch.basic_qos(1, Default::default())).await.unwrap();
    t("close", c.close(200, "".into())).await.unwrap();
}

/// Several consumer connections (manual ack, prefetch, occasional nack-requeue) and several
/// basic.get callers compete for one queue. A shared ledger records every message from delivery
/// until the client settles it: a message must never be outstanding twice, and every message is
/// finally acked exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn competing_consumers_and_getters_never_share_a_message() {
    const N: u32 = 3000;
    let b = Broker::start();
    let c = connect(&b).await;
    let admin = chan(&c).await;
    let q = plain_queue(&admin, "compete").await;
    let outstanding = Arc::new(Mutex::new(HashSet::<u32>::new()));
    let acked = Arc::new(Mutex::new(HashMap::<u32, u32>::new()));
    let violations = Arc::new(Mutex::new(Vec::<String>::new()));

    let record = |id: u32, who: &str, out: &Arc<Mutex<HashSet<u32>>>, vio: &Arc<Mutex<Vec<String>>>| {
        if !out.lock().unwrap().insert(id) {
            vio.lock().unwrap().push(format!("message {id} outstanding twice (second to {who})"));
        }
    };

    let mut tasks = Vec::new();
    for w in 0..3u32 {
        let (uri, q) = (b.uri(), q.clone());
        let (out, ack, vio) = (outstanding.clone(), acked.clone(), violations.clone());
        tasks.push(tokio::spawn(async move {
            let conn = connect_uri(&uri).await;
            let ch = conn.create_channel().await.unwrap();
            ch.basic_qos(10, Default::default()).await.unwrap();
            let mut cons = ch.basic_consume(q.as_str().into(), "".into(), Default::default(), FieldTable::default()).await.unwrap();
            let mut n = 0u32;
            use futures_lite::StreamExt;
            while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_secs(3), cons.next()).await {
                let id = u32::from_be_bytes(d.data[..4].try_into().unwrap());
                record(id, &format!("consumer {w}"), &out, &vio);
                n += 1;
                let requeue = n.is_multiple_of(13) && !d.redelivered;
                out.lock().unwrap().remove(&id);
                if requeue {
                    d.nack(BasicNackOptions { multiple: false, requeue: true }).await.unwrap();
                } else {
                    *ack.lock().unwrap().entry(id).or_default() += 1;
                    d.ack(Default::default()).await.unwrap();
                }
                if ack.lock().unwrap().len() as u32 >= N {
                    break;
                }
            }
            let _ = conn.close(200, "".into()).await;
        }));
    }
    for w in 0..2u32 {
        let (uri, q) = (b.uri(), q.clone());
        let (out, ack, vio) = (outstanding.clone(), acked.clone(), violations.clone());
        tasks.push(tokio::spawn(async move {
            let conn = connect_uri(&uri).await;
            let ch = conn.create_channel().await.unwrap();
            let mut empty_streak = 0;
            for _ in 0..(4 * N) {
                match ch.basic_get(q.as_str().into(), BasicGetOptions::default()).await.unwrap() {
                    Some(m) => {
                        empty_streak = 0;
                        let id = u32::from_be_bytes(m.delivery.data[..4].try_into().unwrap());
                        record(id, &format!("getter {w}"), &out, &vio);
                        out.lock().unwrap().remove(&id);
                        *ack.lock().unwrap().entry(id).or_default() += 1;
                        m.delivery.ack(Default::default()).await.unwrap();
                    }
                    None => {
                        empty_streak += 1;
                        if empty_streak > 60 || ack.lock().unwrap().len() as u32 >= N {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            let _ = conn.close(200, "".into()).await;
        }));
    }
    // publish while they compete
    confirm_mode(&admin).await;
    for i in 0..N {
        let pc = admin
            .basic_publish("".into(), q.as_str().into(), Default::default(), &i.to_be_bytes(), BasicProperties::default())
            .await
            .unwrap();
        if i % 500 == 499 {
            t("confirm", pc).await.unwrap();
        }
    }
    t("confirms", admin.wait_for_confirms()).await.unwrap();
    for task in tasks {
        tt("workers", Duration::from_secs(60), task).await.unwrap();
    }
    {
        let v = violations.lock().unwrap();
        assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), v.iter().take(5).collect::<Vec<_>>());
        let acked = acked.lock().unwrap();
        let missing: Vec<u32> = (0..N).filter(|i| !acked.contains_key(i)).take(10).collect();
        assert!(missing.is_empty(), "{} messages never delivered, e.g. {missing:?}", N as usize - acked.len());
        let dup: Vec<(&u32, &u32)> = acked.iter().filter(|(_, n)| **n != 1).take(10).collect();
        assert!(dup.is_empty(), "messages acked more than once: {dup:?}");
    }
    assert_eq!(ready_count(&admin, &q).await, 0);
    t("close", c.close(200, "".into())).await.unwrap();
}
