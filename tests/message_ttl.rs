//! Message TTL (issue 12 item 1) through lapin, as RabbitMQ documents it ("Time-To-Live and
//! Expiration"): `x-message-ttl` and the per-message `expiration` (the smaller wins); an
//! expired message is never delivered, is dead-lettered with reason `expired` (its
//! `expiration` moved to the x-death's `original-expiration`) and leaves the queue's depth at
//! the head on a timer, with no consumer too; a message behind a longer-lived head goes when
//! it reaches the head; TTL 0 reaches only a consumer ready at once; a requeue keeps the
//! deadline; the deadline survives a restart and a kill -9 (the message expires while the
//! broker is down, and is dead-lettered once it is up). Runs against RabbitMQ too
//! (`RINGMQ_TEST_BROKER=host:port`), except the restart cases.

mod common;

use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use std::time::{Duration, Instant};

fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut a = FieldTable::default();
    for (k, v) in pairs {
        a.insert((*k).into(), v.clone());
    }
    a
}

fn long_str(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Arguments of a queue with `x-message-ttl` `ttl` (when given) dead-lettering into queue `dlq`
/// through the default exchange (when given).
fn ttl_args(ttl: Option<i64>, dlq: Option<&str>) -> FieldTable {
    let mut a = FieldTable::default();
    if let Some(ttl) = ttl {
        a.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
    }
    if let Some(dlq) = dlq {
        a.insert("x-dead-letter-exchange".into(), long_str(""));
        a.insert("x-dead-letter-routing-key".into(), long_str(dlq));
    }
    a
}

fn expiring(ms: &str) -> BasicProperties {
    BasicProperties::default().with_expiration(ShortString::from(ms))
}

/// The reply text of a channel.close carried by a lapin error.
fn reply_text(e: &lapin::Error) -> String {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => p.get_message().to_string(),
        other => panic!("not a protocol error: {other:?}"),
    }
}

fn str_of(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        other => panic!("expected a string, got {other:?}"),
    }
}

/// The newest x-death entry of a dead-lettered message.
fn newest_death(props: &BasicProperties) -> FieldTable {
    let h = props.headers().as_ref().expect("headers on a dead-lettered message");
    let AMQPValue::FieldArray(a) = h.inner().get("x-death").expect("x-death") else { panic!("x-death is not an array") };
    let AMQPValue::FieldTable(e) = &a.as_slice()[0] else { panic!("x-death entry is not a table") };
    e.clone()
}

fn count_of(v: Option<&AMQPValue>) -> i64 {
    match v {
        Some(AMQPValue::LongLongInt(c)) => *c,
        Some(AMQPValue::LongInt(c)) => i64::from(*c),
        other => panic!("x-death count: {other:?}"),
    }
}

/// Checks a copy dead-lettered for expiry from `queue`: reason `expired`, count 1, the queue,
/// exchange "" and routing key `queue`; `original-expiration` and no `expiration` when the
/// message had `expiration` = `original`.
fn assert_expired_copy(props: &BasicProperties, queue: &str, original: Option<&str>) {
    let d = newest_death(props);
    let f = |k: &str| str_of(d.inner().get(k).unwrap_or_else(|| panic!("no {k} in x-death: {d:?}")));
    assert_eq!(f("reason"), "expired");
    assert_eq!(f("queue"), queue);
    assert_eq!(f("exchange"), "");
    assert_eq!(count_of(d.inner().get("count")), 1);
    let AMQPValue::FieldArray(keys) = d.inner().get("routing-keys").expect("routing-keys") else { panic!("routing-keys") };
    assert_eq!(keys.as_slice().iter().map(str_of).collect::<Vec<_>>(), vec![queue.to_string()]);
    assert_eq!(d.inner().get("original-expiration").map(str_of).as_deref(), original, "original-expiration");
    assert_eq!(props.expiration().as_ref().map(|e| e.as_str().to_string()), None, "a dead-lettered copy keeps no expiration");
    let h = props.headers().as_ref().unwrap();
    assert_eq!(h.inner().get("x-first-death-reason").map(str_of).as_deref(), Some("expired"));
}

/// basic.get (manual ack, acked) of the next message: (body, properties).
async fn get_msg(ch: &Channel, queue: &str) -> Option<(Vec<u8>, BasicProperties)> {
    let got = t("basic.get", ch.basic_get(queue.into(), BasicGetOptions { no_ack: true })).await.expect("basic.get")?;
    Some((got.delivery.data.clone(), got.delivery.properties.clone()))
}

async fn chan(c: &Connection) -> Channel {
    t("channel.open", c.create_channel()).await.expect("channel.open")
}

/// Polls (bounded) until the queue holds `n` ready messages; asserts it does.
async fn expect_ready(ch: &Channel, queue: &str, n: u32, limit: Duration, what: &str) {
    let got = wait_ready(ch, queue, n, limit).await;
    assert_eq!(got, n, "{what}: {queue} holds {got} ready messages, expected {n}");
}

#[tokio::test]
async fn invalid_ttl_arguments_get_rabbitmqs_406_and_text() {
    let b = Broker::start();
    let c = connect(&b).await;
    let q = uniq("ttl-bad-arg");
    let cases: [(AMQPValue, String); 4] = [
        (AMQPValue::LongLongInt(-1), "{value_negative,-1}".into()),
        (long_str("abc"), "\"expected integer, got longstr\"".into()),
        (AMQPValue::Boolean(true), "\"expected integer, got bool\"".into()),
        (AMQPValue::LongLongInt(315_360_000_001), "{value_too_large,315360000001}".into()),
    ];
    for (v, why) in cases {
        let ch = chan(&c).await;
        let r =
            t("queue.declare", ch.queue_declare(q.as_str().into(), QueueDeclareOptions::default(), args(&[("x-message-ttl", v.clone())])))
                .await;
        let e = r.expect_err(&format!("x-message-ttl {v:?} was accepted"));
        assert_eq!(reply_code(&e), Some(406), "x-message-ttl {v:?}: {e}");
        let want = format!("PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue '{q}' in vhost '/': {why}");
        assert_eq!(reply_text(&e), want);
    }
    // 0 and the largest (ten years) are valid.
    let ch = chan(&c).await;
    for ttl in [0, 315_360_000_000] {
        let name = uniq("ttl-ok-arg");
        let opts = QueueDeclareOptions { exclusive: true, ..Default::default() };
        declare_queue(&ch, &name, opts, ttl_args(Some(ttl), None)).await;
    }
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn an_invalid_expiration_closes_the_channel_with_rabbitmqs_406_and_text() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    let q = plain_queue(&ch, "ttl-bad-exp").await;
    for (exp, why) in [
        ("abc", "no_integer".to_string()),
        ("", "no_integer".into()),
        ("-1", "{value_negative,-1}".into()),
        ("10x", "{leftover_string,\"x\"}".into()),
        ("315360000001", "{value_too_large,315360000001}".into()),
    ] {
        let ch = chan(&c).await;
        confirm_mode(&ch).await;
        let sent = t("basic.publish", ch.basic_publish("".into(), q.as_str().into(), Default::default(), b"x", expiring(exp))).await;
        let e = match sent {
            Ok(pc) => t("confirm", pc).await.expect_err(&format!("expiration {exp:?} was confirmed")),
            Err(e) => e,
        };
        assert_eq!(reply_code(&e), Some(406), "expiration {exp:?}: {e}");
        assert_eq!(reply_text(&e), format!("PRECONDITION_FAILED - invalid expiration '{exp}': {why}"));
    }
    // Valid: digits, with a sign too; nothing stored of the refused ones.
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    for exp in ["60000", "+60000"] {
        assert!(publish_confirmed(&ch, "", &q, exp.as_bytes(), expiring(exp)).await.is_ack());
    }
    assert_eq!(ready_count(&ch, &q).await, 2);
    let (_, props) = get_msg(&ch, &q).await.expect("a message");
    assert_eq!(props.expiration().as_ref().map(|e| e.as_str()), Some("60000"), "the expiration is delivered as published");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn queue_ttl_expires_with_no_consumer_into_the_dead_letter_queue() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let dlq = plain_queue(&ch, "ttl-dlq").await;
    let q = declare_queue(&ch, &uniq("ttl-q"), Default::default(), ttl_args(Some(400), Some(&dlq))).await;
    assert!(publish_confirmed(&ch, "", &q, b"plain", Default::default()).await.is_ack());
    assert!(publish_confirmed(&ch, "", &q, b"with-expiration", expiring("60000")).await.is_ack());
    assert_eq!(ready_count(&ch, &q).await, 2, "not expired yet");
    // No consumer, no get on `q`: the copies reach the dead-letter queue on the timer alone.
    expect_ready(&ch, &dlq, 2, Duration::from_secs(5), "dead-lettered on the timer").await;
    assert_eq!(ready_count(&ch, &q).await, 0, "the depth dropped");
    let (body, props) = get_msg(&ch, &dlq).await.unwrap();
    assert_eq!(body, b"plain");
    assert_expired_copy(&props, &q, None);
    let (body, props) = get_msg(&ch, &dlq).await.unwrap();
    assert_eq!(body, b"with-expiration");
    assert_expired_copy(&props, &q, Some("60000"));
    // Without a dead-letter exchange, an expired message is simply gone.
    let lone = declare_queue(&ch, &uniq("ttl-lone"), Default::default(), ttl_args(Some(200), None)).await;
    assert!(publish_confirmed(&ch, "", &lone, b"gone", Default::default()).await.is_ack());
    expect_ready(&ch, &lone, 0, Duration::from_secs(5), "expired without a consumer").await;
    assert_eq!(get_msg(&ch, &lone).await, None);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn the_smaller_of_queue_ttl_and_expiration_wins_and_get_never_returns_an_expired_message() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let dlq = plain_queue(&ch, "ttl-min-dlq").await;
    // Queue TTL 10 s, message 300 ms: the message's wins.
    let q = declare_queue(&ch, &uniq("ttl-min"), Default::default(), ttl_args(Some(10_000), Some(&dlq))).await;
    assert!(publish_confirmed(&ch, "", &q, b"short", expiring("300")).await.is_ack());
    assert!(publish_confirmed(&ch, "", &q, b"long", expiring("60000")).await.is_ack());
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (body, props) = get_msg(&ch, &q).await.expect("the long-lived message");
    assert_eq!(body, b"long", "basic.get returned an expired message");
    assert_eq!(props.expiration().as_ref().map(|e| e.as_str()), Some("60000"));
    expect_ready(&ch, &dlq, 1, Duration::from_secs(5), "the short one dead-lettered").await;
    let (body, props) = get_msg(&ch, &dlq).await.unwrap();
    assert_eq!(body, b"short");
    assert_expired_copy(&props, &q, Some("300"));
    // Queue TTL 300 ms, message 60 s: the queue's wins.
    let q2 = declare_queue(&ch, &uniq("ttl-min2"), Default::default(), ttl_args(Some(300), None)).await;
    assert!(publish_confirmed(&ch, "", &q2, b"x", expiring("60000")).await.is_ack());
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(get_msg(&ch, &q2).await, None, "basic.get returned a message past the queue's TTL");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn a_short_lived_message_behind_a_long_lived_head_goes_when_it_reaches_the_head() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let q = plain_queue(&ch, "ttl-head").await;
    assert!(publish_confirmed(&ch, "", &q, b"head", expiring("60000")).await.is_ack());
    assert!(publish_confirmed(&ch, "", &q, b"behind", expiring("100")).await.is_ack());
    tokio::time::sleep(Duration::from_millis(500)).await;
    // RabbitMQ expires at the head only: the expired one still counts.
    assert_eq!(ready_count(&ch, &q).await, 2);
    assert_eq!(get_msg(&ch, &q).await.map(|(b, _)| b), Some(b"head".to_vec()));
    assert_eq!(get_msg(&ch, &q).await, None, "an expired message was returned once it reached the head");
    assert_eq!(ready_count(&ch, &q).await, 0);
    // A consumer never sees an expired message either.
    assert!(publish_confirmed(&ch, "", &q, b"dies", expiring("100")).await.is_ack());
    assert!(publish_confirmed(&ch, "", &q, b"lives", Default::default()).await.is_ack());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let cch = chan(&c).await;
    let mut sub = t(
        "consume",
        cch.basic_consume(
            q.as_str().into(),
            "ttl".into(),
            BasicConsumeOptions { no_ack: true, ..Default::default() },
            FieldTable::default(),
        ),
    )
    .await
    .unwrap();
    let d = next_delivery(&mut sub, Duration::from_secs(5)).await;
    assert_eq!(d.data, b"lives");
    assert_no_delivery(&mut sub, Duration::from_millis(300), "after the live message").await;
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn ttl_zero_reaches_only_a_consumer_ready_at_once() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let dlq = plain_queue(&ch, "ttl0-dlq").await;
    let q = declare_queue(&ch, &uniq("ttl0"), Default::default(), ttl_args(Some(0), Some(&dlq))).await;
    // No consumer: expired at once, dead-lettered.
    assert!(publish_confirmed(&ch, "", &q, b"nobody", Default::default()).await.is_ack());
    expect_ready(&ch, &dlq, 1, Duration::from_secs(3), "TTL 0 with no consumer").await;
    assert_eq!(ready_count(&ch, &q).await, 0);
    let (body, props) = get_msg(&ch, &dlq).await.unwrap();
    assert_eq!(body, b"nobody");
    assert_expired_copy(&props, &q, None);
    // expiration "0" on a queue without TTL: the same.
    let plain = plain_queue(&ch, "exp0").await;
    assert!(publish_confirmed(&ch, "", &plain, b"nobody", expiring("0")).await.is_ack());
    expect_ready(&ch, &plain, 0, Duration::from_secs(3), "expiration 0 with no consumer").await;
    // A consumer with credit: delivered.
    let cch = chan(&c).await;
    t("qos", cch.basic_qos(10, BasicQosOptions::default())).await.unwrap();
    let mut sub = t("consume", cch.basic_consume(q.as_str().into(), "ttl0".into(), BasicConsumeOptions::default(), FieldTable::default()))
        .await
        .unwrap();
    for i in 0..5 {
        let body = format!("taken-{i}");
        assert!(publish_confirmed(&ch, "", &q, body.as_bytes(), Default::default()).await.is_ack());
        let d = next_delivery(&mut sub, Duration::from_secs(5)).await;
        assert_eq!(d.data, body.as_bytes());
        t("ack", d.ack(BasicAckOptions::default())).await.unwrap();
    }
    assert_eq!(ready_count(&ch, &dlq).await, 0, "a message a consumer could take was dead-lettered");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn a_requeued_message_keeps_its_deadline() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let dlq = plain_queue(&ch, "ttl-rq-dlq").await;
    let q = declare_queue(&ch, &uniq("ttl-rq"), Default::default(), ttl_args(Some(1500), Some(&dlq))).await;
    let published = Instant::now();
    assert!(publish_confirmed(&ch, "", &q, b"requeued", Default::default()).await.is_ack());
    let got = t("basic.get", ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: false })).await.unwrap().expect("a message");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    t("nack", got.delivery.nack(BasicNackOptions { requeue: true, ..Default::default() })).await.unwrap();
    // Ready again, with its first deadline: gone 1.5 s after the publish, not 1.5 s after
    // the requeue.
    expect_ready(&ch, &dlq, 1, Duration::from_millis(1300), "the requeued message expired by its first deadline").await;
    assert!(published.elapsed() < Duration::from_millis(2400), "expired {:?} after the publish", published.elapsed());
    let (body, props) = get_msg(&ch, &dlq).await.unwrap();
    assert_eq!(body, b"requeued");
    assert_expired_copy(&props, &q, None);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn length_limits_and_x_expires_still_hold_on_a_ttl_queue() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let dlq = plain_queue(&ch, "ttl-lim-dlq").await;
    let mut a = ttl_args(Some(600), Some(&dlq));
    a.insert("x-max-length".into(), AMQPValue::LongLongInt(2));
    let q = declare_queue(&ch, &uniq("ttl-lim"), Default::default(), a).await;
    for body in ["a", "b", "c"] {
        assert!(publish_confirmed(&ch, "", &q, body.as_bytes(), Default::default()).await.is_ack());
    }
    // "a" went at the limit (maxlen); "b" and "c" expire.
    expect_ready(&ch, &dlq, 3, Duration::from_secs(5), "one maxlen and two expired copies").await;
    let mut reasons = Vec::new();
    while let Some((body, props)) = get_msg(&ch, &dlq).await {
        let d = newest_death(&props);
        reasons.push((String::from_utf8(body).unwrap(), str_of(d.inner().get("reason").unwrap())));
    }
    assert_eq!(reasons, [("a", "maxlen"), ("b", "expired"), ("c", "expired")].map(|(b, r)| (b.to_string(), r.to_string())));
    // x-expires with x-message-ttl: the queue goes when unused, its messages expire before.
    let mut a = ttl_args(Some(100), None);
    a.insert("x-expires".into(), AMQPValue::LongLongInt(800));
    let short = declare_queue(&ch, &uniq("ttl-exp"), Default::default(), a).await;
    assert!(publish_confirmed(&ch, "", &short, b"x", Default::default()).await.is_ack());
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!queue_exists(&c, &short).await, "x-expires did not delete the TTL queue");
    t("close", c.close(200, "".into())).await.unwrap();
}

/// A durable TTL queue and its durable dead-letter queue; one persistent message with a short
/// TTL, one persistent with a long one, one transient with a long one, then `down` (a graceful
/// stop or a kill -9), a wait past the short deadline, a start: the expired one is not
/// delivered and lands in the dead-letter queue; the long-lived persistent one is kept; the
/// transient one is dropped as at any restart.
async fn expires_while_down(kill: bool) {
    let probe = Broker::start();
    require_own_broker!(probe, "restarts the broker");
    drop(probe);
    let dir = tempfile::Builder::new().prefix("ringmq-ttl-").tempdir().unwrap();
    let mut b = OwnBroker::start_in(dir.path(), &[], &[]);
    let uri = format!("amqp://guest:guest@{}:{}/%2f", b.host(), b.port());
    let c = connect_uri(&uri).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let dlq = declare_queue(&ch, &uniq("ttl-down-dlq"), QueueDeclareOptions::durable(), FieldTable::default()).await;
    let q = declare_queue(&ch, &uniq("ttl-down"), QueueDeclareOptions::durable(), ttl_args(Some(60_000), Some(&dlq))).await;
    let persistent = BasicProperties::default().with_delivery_mode(2);
    assert!(publish_confirmed(&ch, "", &q, b"short", persistent.clone().with_expiration("800".into())).await.is_ack());
    assert!(publish_confirmed(&ch, "", &q, b"long", persistent.clone()).await.is_ack());
    assert!(publish_confirmed(&ch, "", &q, b"transient", Default::default()).await.is_ack());
    assert_eq!(ready_count(&ch, &q).await, 3);
    let _ = t("close", c.close(200, "".into())).await;
    let down = Instant::now();
    if kill {
        b.kill9();
    } else {
        b.stop();
    }
    tokio::time::sleep(Duration::from_millis(1200).saturating_sub(down.elapsed())).await;
    b.start();
    let c = connect_uri(&uri).await;
    let ch = chan(&c).await;
    // Nobody touches `q`: it opens at start and its head expires on the timer.
    expect_ready(&ch, &dlq, 1, Duration::from_secs(5), "expired while down, dead-lettered after the start").await;
    let (body, props) = get_msg(&ch, &dlq).await.unwrap();
    assert_eq!(body, b"short");
    assert_expired_copy(&props, &q, Some("800"));
    assert_eq!(ready_count(&ch, &q).await, 1, "the long-lived persistent message stays, the transient one goes");
    let (body, _) = get_msg(&ch, &q).await.expect("the long-lived message");
    assert_eq!(body, b"long");
    let _ = t("close", c.close(200, "".into())).await;
}

#[tokio::test]
async fn a_message_that_expires_during_a_graceful_stop_is_dead_lettered_after_the_start() {
    expires_while_down(false).await;
}

#[tokio::test]
async fn a_message_that_expires_during_a_kill_9_is_dead_lettered_after_the_start() {
    expires_while_down(true).await;
}

/// A consumer attached after the start never sees what expired while the broker was down, on
/// a queue whose TTL comes from `expiration` alone (no queue TTL); a queue of such messages
/// empties with no consumer.
#[tokio::test]
async fn a_consumer_after_a_restart_never_gets_what_expired_meanwhile() {
    let mut b = Broker::start();
    require_own_broker!(b, "restarts the broker");
    let c = connect(&b).await;
    let ch = chan(&c).await;
    confirm_mode(&ch).await;
    let q = declare_queue(&ch, &uniq("exp-restart"), QueueDeclareOptions::durable(), FieldTable::default()).await;
    let persistent = BasicProperties::default().with_delivery_mode(2);
    for i in 0..50 {
        let p = if i % 2 == 0 { persistent.clone().with_expiration("300".into()) } else { persistent.clone() };
        assert!(publish_confirmed(&ch, "", &q, format!("m-{i}").as_bytes(), p).await.is_ack());
    }
    // A queue of such messages only: after the restart they go with no consumer too.
    let only = declare_queue(&ch, &uniq("exp-only"), QueueDeclareOptions::durable(), FieldTable::default()).await;
    for i in 0..3 {
        assert!(publish_confirmed(&ch, "", &only, format!("e-{i}").as_bytes(), persistent.clone().with_expiration("300".into()))
            .await
            .is_ack());
    }
    let _ = t("close", c.close(200, "".into())).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    b.kill9_restart();
    let c = connect(&b).await;
    let ch = chan(&c).await;
    expect_ready(&ch, &only, 0, Duration::from_secs(3), "expired while down, no queue TTL, no consumer").await;
    let mut sub = t(
        "consume",
        ch.basic_consume(
            q.as_str().into(),
            "after".into(),
            BasicConsumeOptions { no_ack: true, ..Default::default() },
            FieldTable::default(),
        ),
    )
    .await
    .unwrap();
    for i in (1..50).step_by(2) {
        let d = next_delivery(&mut sub, Duration::from_secs(5)).await;
        assert_eq!(String::from_utf8_lossy(&d.data), format!("m-{i}"), "an expired message was delivered after the restart");
    }
    assert_no_delivery(&mut sub, Duration::from_millis(300), "after the live messages").await;
    let _ = t("close", c.close(200, "".into())).await;
}
