//! Publishing, getting and consuming through lapin.
//!
//! Covers issue 2 item 5 (messages): every basic property and header field type comes back
//! identical through basic.consume and basic.get; mandatory unroutable → basic.return 312
//! NO_ROUTE before the confirm; basic.get / get-empty with message counts; server-generated
//! consumer tags; exclusive consumers (403 ACCESS_REFUSED for others); round-robin between
//! consumers; basic.cancel; basic.qos prefetch_count (per consumer, and global=true per
//! channel); publisher confirms (every publish acked, in order). Also issue 4 item 7
//! (confirms with mandatory returns, prefetch bounds).
//! Validated against RabbitMQ 3.10.

mod common;

use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, DecimalValue, FieldArray, FieldTable};
use lapin::BasicProperties;
use std::time::Duration;

fn all_types_table() -> FieldTable {
    let mut inner = FieldTable::default();
    inner.insert("deep".into(), AMQPValue::LongString("nested value".into()));
    inner.insert("n".into(), AMQPValue::LongLongInt(-1));
    let mut inner2 = FieldTable::default();
    inner2.insert("inner".into(), AMQPValue::FieldTable(inner.clone()));
    let arr = FieldArray::from(vec![
        AMQPValue::LongString("a".into()),
        AMQPValue::LongInt(7),
        AMQPValue::Boolean(false),
        AMQPValue::FieldTable(inner.clone()),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Double(2.5), AMQPValue::Void])),
    ]);
    let mut h = FieldTable::default();
    h.insert("bool".into(), AMQPValue::Boolean(true));
    h.insert("i8".into(), AMQPValue::ShortShortInt(-8));
    h.insert("u8".into(), AMQPValue::ShortShortUInt(200));
    h.insert("i16".into(), AMQPValue::ShortInt(-1600));
    h.insert("u16".into(), AMQPValue::ShortUInt(60000));
    h.insert("i32".into(), AMQPValue::LongInt(-320000));
    h.insert("u32".into(), AMQPValue::LongUInt(4_000_000_000));
    h.insert("i64".into(), AMQPValue::LongLongInt(-6_400_000_000_000));
    h.insert("f32".into(), AMQPValue::Float(1.5));
    h.insert("f64".into(), AMQPValue::Double(-0.125));
    h.insert("dec".into(), AMQPValue::DecimalValue(DecimalValue { scale: 2, value: 12345 }));
    h.insert("str".into(), AMQPValue::LongString("héllo wörld \u{1F600}".into()));
    h.insert("empty".into(), AMQPValue::LongString("".into()));
    h.insert("bin".into(), AMQPValue::LongString(lapin::types::LongString::from(vec![0u8, 1, 2, 255, 0])));
    h.insert("ts".into(), AMQPValue::Timestamp(1_700_000_000));
    h.insert("bytes".into(), AMQPValue::ByteArray(vec![9u8, 8, 7, 0].into()));
    h.insert("void".into(), AMQPValue::Void);
    h.insert("table".into(), AMQPValue::FieldTable(inner2));
    h.insert("array".into(), AMQPValue::FieldArray(arr));
    h.insert("empty-array".into(), AMQPValue::FieldArray(FieldArray::default()));
    h.insert("empty-table".into(), AMQPValue::FieldTable(FieldTable::default()));
    h
}

fn full_props() -> BasicProperties {
    BasicProperties::default()
        .with_content_type("application/x-test".into())
        .with_content_encoding("identity".into())
        .with_headers(all_types_table())
        .with_delivery_mode(2)
        .with_priority(7)
        .with_correlation_id("corr-42".into())
        .with_reply_to("reply.queue".into())
        .with_expiration("3600000".into())
        .with_message_id("msg-1".into())
        .with_timestamp(1_650_000_000)
        .with_type("test.type".into())
        // RabbitMQ validates user_id against the login: it must be the connecting user.
        .with_user_id("guest".into())
        .with_app_id("ringmq-tests".into())
}

#[tokio::test]
async fn properties_and_headers_roundtrip_get_and_consume() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let q = plain_queue(&ch, "props").await;
    let props = full_props();
    for body in [&b"first"[..], &b""[..]] {
        let conf = publish_confirmed(&ch, "", &q, body, props.clone()).await;
        assert!(conf.is_ack());
    }
    // a message with no properties at all stays without properties
    publish_confirmed(&ch, "", &q, b"bare", BasicProperties::default()).await;

    let got = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().expect("message");
    assert_eq!(got.delivery.data, b"first");
    assert_eq!(got.delivery.properties, props, "properties changed through basic.get");
    assert_eq!(got.delivery.routing_key.as_str(), q);
    assert_eq!(got.delivery.exchange.as_str(), "");
    assert!(!got.delivery.redelivered);
    assert_eq!(got.message_count, 2);

    let mut cons = t(
        "consume",
        ch.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions { no_ack: true, ..Default::default() }, FieldTable::default()),
    )
    .await
    .unwrap();
    let d = next_delivery(&mut cons, Duration::from_secs(5)).await;
    assert_eq!(d.data, b"", "empty body");
    assert_eq!(d.properties, props, "properties changed through basic.deliver");
    let d = next_delivery(&mut cons, Duration::from_secs(5)).await;
    assert_eq!(d.data, b"bare");
    assert_eq!(d.properties, BasicProperties::default());
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn mandatory_unroutable_is_returned_before_confirm() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let x = uniq("noroute");
    t("x", ch.exchange_declare(x.as_str().into(), lapin::ExchangeKind::Direct, Default::default(), FieldTable::default())).await.unwrap();
    let props = BasicProperties::default().with_message_id("ret-1".into());
    let pc = t(
        "publish",
        ch.basic_publish(
            x.as_str().into(),
            "nowhere".into(),
            BasicPublishOptions { mandatory: true, ..Default::default() },
            b"unroutable",
            props.clone(),
        ),
    )
    .await
    .unwrap();
    let conf = t("confirm", pc).await.unwrap();
    assert!(conf.is_ack(), "unroutable message is still confirmed (ack): {conf:?}");
    let ret = conf.take_message().expect("basic.return before the confirm");
    assert_eq!(ret.reply_code, 312, "NO_ROUTE");
    assert_eq!(ret.delivery.data, b"unroutable");
    assert_eq!(ret.delivery.exchange.as_str(), x);
    assert_eq!(ret.delivery.routing_key.as_str(), "nowhere");
    assert_eq!(ret.delivery.properties, props);
    // not mandatory: silently dropped, still confirmed, nothing returned
    let pc = t(
        "publish",
        ch.basic_publish(x.as_str().into(), "nowhere".into(), BasicPublishOptions::default(), b"dropped", BasicProperties::default()),
    )
    .await
    .unwrap();
    let conf = t("confirm", pc).await.unwrap();
    assert!(conf.is_ack());
    assert!(conf.take_message().is_none());
    // mandatory to the default exchange with no such queue is returned too
    let pc = t(
        "publish",
        ch.basic_publish(
            "".into(),
            uniq("noq").as_str().into(),
            BasicPublishOptions { mandatory: true, ..Default::default() },
            b"x",
            BasicProperties::default(),
        ),
    )
    .await
    .unwrap();
    let conf = t("confirm", pc).await.unwrap();
    assert_eq!(conf.take_message().expect("returned").reply_code, 312);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn publish_to_missing_exchange_closes_channel_404() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    let w = close_watch(&ch).await;
    publish(&ch, &uniq("nox"), "k", b"x").await;
    assert_eq!(w.code("publish to a missing exchange").await, 404);
    let ch2 = t("channel", c.create_channel()).await.unwrap();
    t("qos", ch2.basic_qos(1, Default::default())).await.unwrap();
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn basic_get_and_get_empty() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let q = plain_queue(&ch, "get").await;
    assert!(t("get empty", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().is_none());
    for i in 0..3 {
        publish_confirmed(&ch, "", &q, format!("m{i}").as_bytes(), BasicProperties::default()).await;
    }
    let mut tags = Vec::new();
    for i in 0..3u32 {
        let m = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("message");
        assert_eq!(m.delivery.data, format!("m{i}").as_bytes());
        assert_eq!(m.message_count, 2 - i, "messages remaining after get {i}");
        tags.push(m.delivery.delivery_tag);
    }
    assert!(tags.windows(2).all(|w| w[0] < w[1]), "delivery tags grow: {tags:?}");
    assert!(t("get empty", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().is_none());
    t("ack all", ch.basic_ack(*tags.last().unwrap(), BasicAckOptions { multiple: true })).await.unwrap();
    assert_eq!(ready_count(&ch, &q).await, 0);
    // get on a missing queue → 404
    let r = t("get missing", ch.basic_get(uniq("noq").as_str().into(), BasicGetOptions::default())).await;
    assert_code(r.map(|_| ()), 404, "basic.get on a missing queue");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn consumer_tags_and_exclusive_consumers() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    let q = plain_queue(&ch, "ctag").await;
    let c1 =
        t("consume", ch.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())).await.unwrap();
    let c2 =
        t("consume", ch.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())).await.unwrap();
    assert!(c1.tag().as_str().starts_with("amq.ctag-"), "server-generated tag: {}", c1.tag());
    assert_ne!(c1.tag(), c2.tag());
    // reusing a tag on the same channel → 530 NOT_ALLOWED (a connection error, as in the spec)
    let cx = connect(&b).await;
    let chx = t("channel", cx.create_channel()).await.unwrap();
    t("consume", chx.basic_consume(q.as_str().into(), "dup".into(), BasicConsumeOptions::default(), FieldTable::default())).await.unwrap();
    let r = t("dup tag", chx.basic_consume(q.as_str().into(), "dup".into(), BasicConsumeOptions::default(), FieldTable::default())).await;
    assert_code(r.map(|_| ()), 530, "basic.consume reusing a consumer tag");
    // exclusive consume while others consume → 403
    let ch2 = t("channel", c.create_channel()).await.unwrap();
    let r = t(
        "exclusive",
        ch2.basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions { exclusive: true, ..Default::default() },
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(r.map(|_| ()), 403, "exclusive basic.consume on a queue with consumers");
    // once exclusive, others get 403
    let q2 = plain_queue(&ch, "excl-cons").await;
    let _ex = t(
        "exclusive",
        ch.basic_consume(
            q2.as_str().into(),
            "".into(),
            BasicConsumeOptions { exclusive: true, ..Default::default() },
            FieldTable::default(),
        ),
    )
    .await
    .unwrap();
    let other = connect(&b).await;
    let och = t("channel", other.create_channel()).await.unwrap();
    let r =
        t("second consumer", och.basic_consume(q2.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())).await;
    assert_code(r.map(|_| ()), 403, "basic.consume on a queue with an exclusive consumer");
    // consume on a missing queue → 404
    let och = t("channel", other.create_channel()).await.unwrap();
    let r = t("missing", och.basic_consume(uniq("noq").as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()))
        .await;
    assert_code(r.map(|_| ()), 404, "basic.consume on a missing queue");
    let ch3 = t("channel", c.create_channel()).await.unwrap();
    for q in [&q, &q2] {
        t("delete", ch3.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await.unwrap();
    }
    t("close", c.close(200, "".into())).await.unwrap();
}

/// `x-single-active-consumer=true` (issue 12 item 8): one consumer receives everything; when
/// its channel closes its unacked messages are requeued and the next consumer, in attach
/// order, takes over (RabbitMQ's single active consumer). A non-boolean value is 406.
#[tokio::test]
async fn a_single_active_consumer_gets_everything_and_the_next_takes_over() {
    let b = Broker::start();
    let c = connect(&b).await;
    let pch = t("channel", c.create_channel()).await.unwrap();
    confirm_mode(&pch).await;
    let mut args = FieldTable::default();
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    let q = declare_queue(&pch, &uniq("sac"), QueueDeclareOptions::default(), args).await;
    let (ch1, ch2) = (t("channel", c.create_channel()).await.unwrap(), t("channel", c.create_channel()).await.unwrap());
    let manual = BasicConsumeOptions::default();
    let mut c1 = t("consume", ch1.basic_consume(q.as_str().into(), "first".into(), manual, FieldTable::default())).await.unwrap();
    let mut c2 = t("consume", ch2.basic_consume(q.as_str().into(), "second".into(), manual, FieldTable::default())).await.unwrap();
    for i in 0..6 {
        publish_confirmed(&pch, "", &q, format!("m{i}").as_bytes(), BasicProperties::default()).await;
    }
    for i in 0..6 {
        let d = next_delivery(&mut c1, Duration::from_secs(5)).await;
        assert_eq!(d.data, format!("m{i}").as_bytes(), "the active consumer gets every message, in order");
    }
    assert_no_delivery(&mut c2, Duration::from_millis(300), "the second consumer while the first is active").await;
    // The active consumer's channel closes unacked: the next takes over, with them first.
    t("close first", ch1.close(200, "".into())).await.unwrap();
    publish_confirmed(&pch, "", &q, b"m6", BasicProperties::default()).await;
    for i in 0..7 {
        let d = next_delivery(&mut c2, Duration::from_secs(5)).await;
        assert_eq!(d.data, format!("m{i}").as_bytes());
        assert_eq!(d.redelivered, i < 6, "m{i}: requeued from the first consumer or new");
        t("ack", d.ack(BasicAckOptions::default())).await.unwrap();
    }
    let mut bad = FieldTable::default();
    bad.insert("x-single-active-consumer".into(), AMQPValue::LongString("yes".into()));
    let r = pch.queue_declare(uniq("sac-bad").as_str().into(), QueueDeclareOptions::default(), bad).await;
    assert_code(r, 406, "a non-boolean x-single-active-consumer");
}

#[tokio::test]
async fn round_robin_between_consumers() {
    let b = Broker::start();
    let c = connect(&b).await;
    let pch = t("channel", c.create_channel()).await.unwrap();
    confirm_mode(&pch).await;
    let q = plain_queue(&pch, "rr").await;
    let ch1 = t("channel", c.create_channel()).await.unwrap();
    let ch2 = t("channel", c.create_channel()).await.unwrap();
    let mut c1 = t(
        "consume",
        ch1.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions { no_ack: true, ..Default::default() }, FieldTable::default()),
    )
    .await
    .unwrap();
    let mut c2 = t(
        "consume",
        ch2.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions { no_ack: true, ..Default::default() }, FieldTable::default()),
    )
    .await
    .unwrap();
    for i in 0..20 {
        publish_confirmed(&pch, "", &q, format!("{i}").as_bytes(), BasicProperties::default()).await;
    }
    let mut got1 = Vec::new();
    let mut got2 = Vec::new();
    for _ in 0..10 {
        got1.push(String::from_utf8(next_delivery(&mut c1, Duration::from_secs(5)).await.data).unwrap());
        got2.push(String::from_utf8(next_delivery(&mut c2, Duration::from_secs(5)).await.data).unwrap());
    }
    assert_no_delivery(&mut c1, Duration::from_millis(300), "c1 after 10").await;
    assert_no_delivery(&mut c2, Duration::from_millis(100), "c2 after 10").await;
    let mut all: Vec<u32> = got1.iter().chain(got2.iter()).map(|s| s.parse().unwrap()).collect();
    all.sort();
    assert_eq!(all, (0..20).collect::<Vec<_>>(), "each message to exactly one consumer");
    // each consumer sees its share in publish order
    for g in [&got1, &got2] {
        let v: Vec<u32> = g.iter().map(|s| s.parse().unwrap()).collect();
        assert!(v.windows(2).all(|w| w[0] < w[1]), "per-consumer order: {v:?}");
    }
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn basic_cancel_stops_deliveries_without_requeue_of_ready() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let q = plain_queue(&ch, "cancel").await;
    let cch = t("channel", c.create_channel()).await.unwrap();
    let mut cons = t(
        "consume",
        cch.basic_consume(
            q.as_str().into(),
            "my-tag".into(),
            BasicConsumeOptions { no_ack: true, ..Default::default() },
            FieldTable::default(),
        ),
    )
    .await
    .unwrap();
    assert_eq!(cons.tag().as_str(), "my-tag");
    publish_confirmed(&ch, "", &q, b"one", BasicProperties::default()).await;
    assert_eq!(next_delivery(&mut cons, Duration::from_secs(5)).await.data, b"one");
    t("cancel", cch.basic_cancel("my-tag".into(), BasicCancelOptions::default())).await.unwrap();
    publish_confirmed(&ch, "", &q, b"two", BasicProperties::default()).await;
    // the stream ends; "two" stays in the queue
    let end = tokio::time::timeout(Duration::from_secs(2), cons.next()).await;
    assert!(matches!(end, Ok(None)), "consumer stream should end after cancel");
    assert_eq!(ready_count(&ch, &q).await, 1);
    // cancelling an unknown tag is not an error
    t("cancel unknown", cch.basic_cancel("no-such-tag".into(), BasicCancelOptions::default())).await.unwrap();
    t("qos", cch.basic_qos(1, Default::default())).await.unwrap();
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn prefetch_bounds_unacked_per_consumer_and_per_channel() {
    let b = Broker::start();
    let c = connect(&b).await;
    let pch = t("channel", c.create_channel()).await.unwrap();
    confirm_mode(&pch).await;
    let q = plain_queue(&pch, "prefetch").await;
    for i in 0..10 {
        publish_confirmed(&pch, "", &q, format!("{i}").as_bytes(), BasicProperties::default()).await;
    }
    let ch = t("channel", c.create_channel()).await.unwrap();
    t("qos", ch.basic_qos(3, BasicQosOptions::default())).await.unwrap();
    let mut cons =
        t("consume", ch.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())).await.unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(next_delivery(&mut cons, Duration::from_secs(5)).await);
    }
    assert_no_delivery(&mut cons, Duration::from_millis(500), "prefetch 3 with 3 unacked").await;
    assert_eq!(ready_count(&pch, &q).await, 7, "nothing beyond the prefetch window is claimed");
    // ack one → exactly one more
    t("ack", held[0].ack(BasicAckOptions::default())).await.unwrap();
    let d = next_delivery(&mut cons, Duration::from_secs(5)).await;
    assert_eq!(d.data, b"3");
    assert_no_delivery(&mut cons, Duration::from_millis(400), "prefetch 3 after one ack").await;
    // ack multiple up to the last → three more
    t("ack multiple", ch.basic_ack(d.delivery_tag, BasicAckOptions { multiple: true })).await.unwrap();
    let mut next = Vec::new();
    for _ in 0..3 {
        next.push(String::from_utf8(next_delivery(&mut cons, Duration::from_secs(5)).await.data).unwrap());
    }
    assert_eq!(next, ["4", "5", "6"]);
    assert_no_delivery(&mut cons, Duration::from_millis(400), "prefetch 3 after multiple ack").await;

    // global=true: the limit is shared by all consumers on the channel
    let q2 = plain_queue(&pch, "prefetch-global").await;
    for i in 0..10 {
        publish_confirmed(&pch, "", &q2, format!("{i}").as_bytes(), BasicProperties::default()).await;
    }
    let gch = t("channel", c.create_channel()).await.unwrap();
    t("qos global", gch.basic_qos(4, BasicQosOptions { global: true })).await.unwrap();
    let mut g1 = t("consume", gch.basic_consume(q2.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()))
        .await
        .unwrap();
    let mut g2 = t("consume", gch.basic_consume(q2.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()))
        .await
        .unwrap();
    let mut n = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while tokio::time::Instant::now() < deadline {
        tokio::select! {
            Some(Ok(_)) = g1.next() => n += 1,
            Some(Ok(_)) = g2.next() => n += 1,
            _ = tokio::time::sleep(Duration::from_millis(300)) => { if n >= 4 { break; } }
        }
    }
    assert_eq!(n, 4, "channel-wide prefetch 4 shared by two consumers");
    assert_eq!(ready_count(&pch, &q2).await, 6);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn confirms_ack_every_publish_in_order() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let q = plain_queue(&ch, "confirms").await;
    let mut pending = Vec::new();
    for i in 0..500u32 {
        let props = BasicProperties::default().with_delivery_mode(if i % 2 == 0 { 2 } else { 1 });
        pending.push(
            t("publish", ch.basic_publish("".into(), q.as_str().into(), BasicPublishOptions::default(), &i.to_be_bytes(), props))
                .await
                .unwrap(),
        );
    }
    for (i, pc) in pending.into_iter().enumerate() {
        let conf = t("confirm", pc).await.unwrap();
        assert!(conf.is_ack(), "publish {i} not acked: {conf:?}");
    }
    t("wait_for_confirms", ch.wait_for_confirms()).await.unwrap();
    assert_eq!(ready_count(&ch, &q).await, 500);
    let bodies = drain(&ch, &q, 600).await;
    let got: Vec<u32> = bodies.iter().map(|b| u32::from_be_bytes(b[..4].try_into().unwrap())).collect();
    assert_eq!(got, (0..500).collect::<Vec<_>>());
    t("close", c.close(200, "".into())).await.unwrap();
}

/// A backlog handed out in long stretches (the dispatcher sends a consumer's share of a
/// stretch as one batch): an auto-ack consumer and a manual-ack one (prefetch 50) on two
/// connections get every message exactly once, each in queue order, with delivery tags
/// 1, 2, 3 … on each channel, and the queue is empty once the manual ones are acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_reaches_competing_consumers_once_each_in_order() {
    const N: usize = 3000;
    let b = Broker::start();
    let (_c, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "backlog").await;
    confirm_mode(&ch).await;
    for k in 0..N {
        t(
            "basic.publish",
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                k.to_string().as_bytes(),
                BasicProperties::default(),
            ),
        )
        .await
        .unwrap();
    }
    assert!(t("confirms", ch.wait_for_confirms()).await.unwrap().is_empty(), "every publish confirmed");
    assert_eq!(wait_ready(&ch, &q, N as u32, Duration::from_secs(10)).await, N as u32);
    let (ca, cb) = (connect(&b).await, connect(&b).await);
    let (cha, chb) = (ca.create_channel().await.unwrap(), cb.create_channel().await.unwrap());
    t("basic.qos", chb.basic_qos(50, BasicQosOptions::default())).await.unwrap();
    let opts = |no_ack| BasicConsumeOptions { no_ack, ..Default::default() };
    // The manual one first: an auto-ack consumer alone would take the whole backlog at once.
    let mut manual =
        t("basic.consume", chb.basic_consume(q.as_str().into(), "manual".into(), opts(false), FieldTable::default())).await.unwrap();
    let mut auto =
        t("basic.consume", cha.basic_consume(q.as_str().into(), "auto".into(), opts(true), FieldTable::default())).await.unwrap();
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while got_a.len() + got_b.len() < N && std::time::Instant::now() < deadline {
        tokio::select! {
            Some(Ok(d)) = auto.next() => got_a.push((d.delivery_tag, String::from_utf8(d.data).unwrap().parse::<usize>().unwrap())),
            Some(Ok(d)) = manual.next() => {
                d.acker.ack(BasicAckOptions::default()).await.unwrap();
                got_b.push((d.delivery_tag, String::from_utf8(d.data).unwrap().parse::<usize>().unwrap()));
            }
            _ = tokio::time::sleep(Duration::from_secs(5)) => break,
        }
    }
    for (who, got) in [("auto-ack", &got_a), ("manual", &got_b)] {
        let tags: Vec<u64> = got.iter().map(|&(tag, _)| tag).collect();
        assert_eq!(tags, (1..=got.len() as u64).collect::<Vec<_>>(), "{who}: delivery tags one by one");
        assert!(got.windows(2).all(|w| w[0].1 < w[1].1), "{who}: in queue order");
    }
    let mut all: Vec<usize> = got_a.iter().chain(&got_b).map(|&(_, k)| k).collect();
    all.sort_unstable();
    assert_eq!(all, (0..N).collect::<Vec<_>>(), "every message once ({} auto-ack, {} manual)", got_a.len(), got_b.len());
    assert!(!got_a.is_empty() && !got_b.is_empty(), "both consumers took part");
    assert_eq!(wait_ready(&ch, &q, 0, Duration::from_secs(5)).await, 0, "nothing left once acked");
}
