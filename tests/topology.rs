//! Exchanges, queues and bindings through lapin.
//!
//! Covers issue 2 item 4 (topology): direct, fanout, topic (`*`, `#`), headers (x-match all,
//! any, all-with-x, any-with-x) exchanges; the default exchange; predeclared amq.direct,
//! amq.fanout, amq.topic, amq.headers, amq.match; exchange-to-exchange bindings;
//! alternate-exchange; exchange.declare passive/redeclare/amq.-prefix errors; exchange.delete
//! if_unused; queue.declare server-named/passive/redeclare/exclusive (405 RESOURCE_LOCKED);
//! exclusive queues die with their connection, auto-delete queues with their last consumer;
//! DeclareOk message/consumer counts; queue.purge; queue.delete if_empty/if_unused; unbind;
//! bind to a missing queue or exchange.
//! Validated against RabbitMQ 3.10.

mod common;

use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};
use std::time::Duration;

fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

fn s(v: &str) -> AMQPValue {
    AMQPValue::LongString(v.into())
}

async fn exchange(ch: &Channel, tag: &str, kind: ExchangeKind, args: FieldTable) -> String {
    let x = uniq(tag);
    t("exchange.declare", ch.exchange_declare(x.as_str().into(), kind, ExchangeDeclareOptions::default(), args))
        .await
        .unwrap_or_else(|e| panic!("exchange.declare {x}: {e}"));
    x
}

async fn bind(ch: &Channel, q: &str, x: &str, key: &str, args: FieldTable) {
    t("queue.bind", ch.queue_bind(q.into(), x.into(), key.into(), QueueBindOptions::default(), args))
        .await
        .unwrap_or_else(|e| panic!("queue.bind {q} {x} {key}: {e}"));
}

/// Publish with confirms and a header table, to `x` with `key`.
async fn pub_h(ch: &Channel, x: &str, key: &str, body: &str, headers: Option<FieldTable>) {
    let mut p = lapin::BasicProperties::default();
    if let Some(h) = headers {
        p = p.with_headers(h);
    }
    let c = publish_confirmed(ch, x, key, body.as_bytes(), p).await;
    assert!(c.is_ack(), "publish not confirmed: {c:?}");
}

fn strs(v: Vec<Vec<u8>>) -> Vec<String> {
    v.into_iter().map(|b| String::from_utf8(b).unwrap()).collect()
}

async fn setup(b: &Broker) -> (lapin::Connection, Channel) {
    let (c, ch) = connect_ch(b).await;
    confirm_mode(&ch).await;
    (c, ch)
}

#[tokio::test]
async fn direct_exchange_routes_by_exact_key() {
    let b = Broker::start();
    let (c, ch) = setup(&b).await;
    let x = exchange(&ch, "direct", ExchangeKind::Direct, FieldTable::default()).await;
    let q1 = plain_queue(&ch, "d1").await;
    let q2 = plain_queue(&ch, "d2").await;
    bind(&ch, &q1, &x, "red", FieldTable::default()).await;
    bind(&ch, &q2, &x, "green", FieldTable::default()).await;
    bind(&ch, &q2, &x, "red", FieldTable::default()).await;
    for (k, body) in [("red", "r"), ("green", "g"), ("blue", "b"), ("Red", "R")] {
        pub_h(&ch, &x, k, body, None).await;
    }
    assert_eq!(strs(drain(&ch, &q1, 10).await), ["r"]);
    assert_eq!(strs(drain(&ch, &q2, 10).await), ["r", "g"]);
    // unbind stops routing
    t("unbind", ch.queue_unbind(q2.as_str().into(), x.as_str().into(), "red".into(), FieldTable::default())).await.unwrap();
    pub_h(&ch, &x, "red", "r2", None).await;
    assert_eq!(strs(drain(&ch, &q2, 10).await), Vec::<String>::new());
    assert_eq!(strs(drain(&ch, &q1, 10).await), ["r2"]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn fanout_exchange_copies_to_every_queue() {
    let b = Broker::start();
    let (c, ch) = setup(&b).await;
    let x = exchange(&ch, "fanout", ExchangeKind::Fanout, FieldTable::default()).await;
    let qs = [plain_queue(&ch, "f1").await, plain_queue(&ch, "f2").await, plain_queue(&ch, "f3").await];
    for q in &qs {
        bind(&ch, q, &x, "ignored", FieldTable::default()).await;
    }
    pub_h(&ch, &x, "anything", "m1", None).await;
    pub_h(&ch, &x, "", "m2", None).await;
    for q in &qs {
        assert_eq!(strs(drain(&ch, q, 10).await), ["m1", "m2"], "queue {q}");
    }
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn topic_exchange_star_and_hash() {
    let b = Broker::start();
    let (c, ch) = setup(&b).await;
    let x = exchange(&ch, "topic", ExchangeKind::Topic, FieldTable::default()).await;
    let patterns = ["a.*.c", "a.#", "#", "*.x", "#.z.#", "a.b.c"];
    let mut qs = Vec::new();
    for p in patterns {
        let q = plain_queue(&ch, "t").await;
        bind(&ch, &q, &x, p, FieldTable::default()).await;
        qs.push(q);
    }
    let keys = ["a.b.c", "a", "a.b.b.c", "b.x", "x", "z", "q.z.r.z", "a.c", ""];
    for k in keys {
        pub_h(&ch, &x, k, k, None).await;
    }
    let expect: [&[&str]; 6] = [
        &["a.b.c"],                                                        // a.*.c
        &["a.b.c", "a", "a.b.b.c", "a.c"],                                 // a.#
        &["a.b.c", "a", "a.b.b.c", "b.x", "x", "z", "q.z.r.z", "a.c", ""], // #
        &["b.x"],                                                          // *.x
        &["z", "q.z.r.z"],                                                 // #.z.#
        &["a.b.c"],                                                        // a.b.c
    ];
    for (i, q) in qs.iter().enumerate() {
        assert_eq!(strs(drain(&ch, q, 20).await), expect[i], "pattern {}", patterns[i]);
    }
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn headers_exchange_all_any_and_with_x() {
    let b = Broker::start();
    let (c, ch) = setup(&b).await;
    let x = exchange(&ch, "headers", ExchangeKind::Headers, FieldTable::default()).await;
    let q_all = plain_queue(&ch, "h-all").await;
    let q_any = plain_queue(&ch, "h-any").await;
    let q_allx = plain_queue(&ch, "h-allx").await;
    let q_anyx = plain_queue(&ch, "h-anyx").await;
    let q_void = plain_queue(&ch, "h-void").await;
    bind(&ch, &q_all, &x, "", table(&[("x-match", s("all")), ("a", s("1")), ("b", s("2")), ("x-k", s("v"))])).await;
    bind(&ch, &q_any, &x, "", table(&[("x-match", s("any")), ("a", s("1")), ("b", s("2")), ("x-k", s("v"))])).await;
    bind(&ch, &q_allx, &x, "", table(&[("x-match", s("all-with-x")), ("a", s("1")), ("x-k", s("v"))])).await;
    bind(&ch, &q_anyx, &x, "", table(&[("x-match", s("any-with-x")), ("x-k", s("v"))])).await;
    // A binding value of type void matches on key presence alone.
    bind(&ch, &q_void, &x, "", table(&[("x-match", s("all")), ("p", AMQPValue::Void)])).await;

    pub_h(&ch, &x, "", "ab", Some(table(&[("a", s("1")), ("b", s("2"))]))).await;
    pub_h(&ch, &x, "", "a", Some(table(&[("a", s("1"))]))).await;
    pub_h(&ch, &x, "", "a-wrong-b", Some(table(&[("a", s("1")), ("b", s("3"))]))).await;
    pub_h(&ch, &x, "", "ax", Some(table(&[("a", s("1")), ("x-k", s("v"))]))).await;
    pub_h(&ch, &x, "", "x-only", Some(table(&[("x-k", s("v"))]))).await;
    pub_h(&ch, &x, "", "p", Some(table(&[("p", AMQPValue::LongLongInt(5))]))).await;
    pub_h(&ch, &x, "", "none", None).await;
    // The key and routing key are irrelevant to a headers exchange.
    pub_h(&ch, &x, "some.key", "ab-key", Some(table(&[("b", s("2")), ("a", s("1"))]))).await;

    // all: a=1 and b=2 required; x- keys of the binding are ignored.
    assert_eq!(strs(drain(&ch, &q_all, 20).await), ["ab", "ab-key"]);
    // any: a=1 or b=2; x- keys of the binding are ignored (so "x-only" does not match).
    assert_eq!(strs(drain(&ch, &q_any, 20).await), ["ab", "a", "a-wrong-b", "ax", "ab-key"]);
    // all-with-x: a=1 and x-k=v
    assert_eq!(strs(drain(&ch, &q_allx, 20).await), ["ax"]);
    // any-with-x: x-k=v counts
    assert_eq!(strs(drain(&ch, &q_anyx, 20).await), ["ax", "x-only"]);
    assert_eq!(strs(drain(&ch, &q_void, 20).await), ["p"]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn default_exchange_routes_by_queue_name_and_refuses_bindings() {
    let b = Broker::start();
    let (c, ch) = setup(&b).await;
    let q = plain_queue(&ch, "dflt").await;
    pub_h(&ch, "", &q, "hello", None).await;
    pub_h(&ch, "", &format!("{q}-not"), "lost", None).await;
    assert_eq!(strs(drain(&ch, &q, 10).await), ["hello"]);
    // Binding to (or unbinding from) the default exchange is refused: 403 ACCESS_REFUSED.
    let r = t("bind default", ch.queue_bind(q.as_str().into(), "".into(), "k".into(), QueueBindOptions::default(), FieldTable::default()))
        .await;
    assert_code(r, 403, "queue.bind to the default exchange");
    let ch2 = t("channel", c.create_channel()).await.unwrap();
    let r = t("delete default", ch2.exchange_delete("".into(), ExchangeDeleteOptions::default())).await;
    assert_code(r, 403, "exchange.delete of the default exchange");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn predeclared_amq_exchanges_exist_and_route() {
    let b = Broker::start();
    let (c, ch) = setup(&b).await;
    for (x, kind) in [
        ("amq.direct", ExchangeKind::Direct),
        ("amq.fanout", ExchangeKind::Fanout),
        ("amq.topic", ExchangeKind::Topic),
        ("amq.headers", ExchangeKind::Headers),
        ("amq.match", ExchangeKind::Headers),
    ] {
        assert!(exchange_exists(&c, x).await, "{x} missing");
        // Redeclaring with the same type and durable=true is allowed (they are durable).
        let opts = ExchangeDeclareOptions { durable: true, ..Default::default() };
        t("redeclare amq.*", ch.exchange_declare(x.into(), kind, opts, FieldTable::default()))
            .await
            .unwrap_or_else(|e| panic!("redeclare {x}: {e}"));
    }
    let q = plain_queue(&ch, "amqdirect").await;
    bind(&ch, &q, "amq.direct", "k1", FieldTable::default()).await;
    bind(&ch, &q, "amq.topic", "t.#", FieldTable::default()).await;
    pub_h(&ch, "amq.direct", "k1", "d", None).await;
    pub_h(&ch, "amq.topic", "t.1.2", "t", None).await;
    assert_eq!(strs(drain(&ch, &q, 10).await), ["d", "t"]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn exchange_to_exchange_bindings() {
    let b = Broker::start();
    let (c, ch) = setup(&b).await;
    let src = exchange(&ch, "e2e-src", ExchangeKind::Topic, FieldTable::default()).await;
    let mid = exchange(&ch, "e2e-mid", ExchangeKind::Direct, FieldTable::default()).await;
    let fan = exchange(&ch, "e2e-fan", ExchangeKind::Fanout, FieldTable::default()).await;
    let q1 = plain_queue(&ch, "e2e1").await;
    let q2 = plain_queue(&ch, "e2e2").await;
    // src --(a.*)--> mid --(a.x)--> q1 ; src --(#)--> fan --> q2
    t(
        "x bind",
        ch.exchange_bind(mid.as_str().into(), src.as_str().into(), "a.*".into(), ExchangeBindOptions::default(), FieldTable::default()),
    )
    .await
    .unwrap();
    t(
        "x bind",
        ch.exchange_bind(fan.as_str().into(), src.as_str().into(), "#".into(), ExchangeBindOptions::default(), FieldTable::default()),
    )
    .await
    .unwrap();
    bind(&ch, &q1, &mid, "a.x", FieldTable::default()).await;
    bind(&ch, &q2, &fan, "", FieldTable::default()).await;
    // q1 also bound directly to src: a message reaching it by two paths is delivered once
    bind(&ch, &q1, &src, "a.x", FieldTable::default()).await;
    for k in ["a.x", "a.y", "b"] {
        pub_h(&ch, &src, k, k, None).await;
    }
    assert_eq!(strs(drain(&ch, &q1, 10).await), ["a.x"]);
    assert_eq!(strs(drain(&ch, &q2, 10).await), ["a.x", "a.y", "b"]);
    t(
        "x unbind",
        ch.exchange_unbind(fan.as_str().into(), src.as_str().into(), "#".into(), ExchangeUnbindOptions::default(), FieldTable::default()),
    )
    .await
    .unwrap();
    pub_h(&ch, &src, "b", "b2", None).await;
    assert!(drain(&ch, &q2, 10).await.is_empty());
    // exchange.bind with a missing source → 404
    let r = t(
        "bind missing",
        ch.exchange_bind(
            mid.as_str().into(),
            uniq("nosrc").as_str().into(),
            "".into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(r, 404, "exchange.bind with a missing source");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn alternate_exchange_gets_unroutable_messages() {
    let b = Broker::start();
    let (c, ch) = setup(&b).await;
    let ae = exchange(&ch, "ae", ExchangeKind::Fanout, FieldTable::default()).await;
    let x = exchange(&ch, "with-ae", ExchangeKind::Direct, table(&[("alternate-exchange", s(&ae))])).await;
    let q_main = plain_queue(&ch, "ae-main").await;
    let q_ae = plain_queue(&ch, "ae-catch").await;
    bind(&ch, &q_main, &x, "known", FieldTable::default()).await;
    bind(&ch, &q_ae, &ae, "", FieldTable::default()).await;
    pub_h(&ch, &x, "known", "k", None).await;
    pub_h(&ch, &x, "unknown", "u", None).await;
    // mandatory + routed via the AE: not returned
    let pc = t(
        "publish",
        ch.basic_publish(
            x.as_str().into(),
            "other".into(),
            BasicPublishOptions { mandatory: true, ..Default::default() },
            b"m",
            Default::default(),
        ),
    )
    .await
    .unwrap();
    let conf = t("confirm", pc).await.unwrap();
    assert!(conf.is_ack());
    assert!(conf.take_message().is_none(), "message routed via alternate-exchange must not be returned");
    assert_eq!(strs(drain(&ch, &q_main, 10).await), ["k"]);
    assert_eq!(strs(drain(&ch, &q_ae, 10).await), ["u", "m"]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn exchange_declare_errors() {
    let b = Broker::start();
    let c = connect(&b).await;
    // passive on a missing exchange → 404 NOT_FOUND
    assert!(!exchange_exists(&c, &uniq("nox")).await);
    // redeclare with a different type → 406 PRECONDITION_FAILED
    let ch = t("channel", c.create_channel()).await.unwrap();
    let x = exchange(&ch, "retype", ExchangeKind::Direct, FieldTable::default()).await;
    let r = t(
        "redeclare",
        ch.exchange_declare(x.as_str().into(), ExchangeKind::Fanout, ExchangeDeclareOptions::default(), FieldTable::default()),
    )
    .await;
    assert_code(r, 406, "exchange redeclared with another type");
    // redeclare with different durability → 406
    let ch = t("channel", c.create_channel()).await.unwrap();
    let r = t(
        "redeclare",
        ch.exchange_declare(
            x.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions { durable: true, ..Default::default() },
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(r, 406, "exchange redeclared with another durability");
    // same declaration again is fine
    let ch = t("channel", c.create_channel()).await.unwrap();
    t(
        "same redeclare",
        ch.exchange_declare(x.as_str().into(), ExchangeKind::Direct, ExchangeDeclareOptions::default(), FieldTable::default()),
    )
    .await
    .unwrap();
    // a name starting with amq. → 403 ACCESS_REFUSED
    let r = t(
        "amq.foo",
        ch.exchange_declare(
            format!("amq.{}", uniq("foo")).as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(r, 403, "exchange.declare amq.*");
    // unknown exchange type → 503 COMMAND_INVALID (connection error in RabbitMQ, as in the spec)
    let c2 = connect(&b).await;
    let ch2 = t("channel", c2.create_channel()).await.unwrap();
    let r = t(
        "bad type",
        ch2.exchange_declare(
            uniq("badtype").as_str().into(),
            ExchangeKind::Custom("no-such-type".into()),
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(r, 503, "exchange.declare with an unknown type");
    // exchange.delete of a missing exchange is OK in RabbitMQ 3.10 (idempotent delete)
    let ch = t("channel", c.create_channel()).await.unwrap();
    t("delete missing", ch.exchange_delete(uniq("nodel").as_str().into(), ExchangeDeleteOptions::default())).await.unwrap();
    t("delete", ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())).await.unwrap();
    assert!(!exchange_exists(&c, &x).await);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn exchange_delete_if_unused() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    let x = exchange(&ch, "ifunused", ExchangeKind::Direct, FieldTable::default()).await;
    let q = plain_queue(&ch, "ifunused-q").await;
    bind(&ch, &q, &x, "k", FieldTable::default()).await;
    let r =
        t("delete if_unused", ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions { if_unused: true, ..Default::default() })).await;
    assert_code(r, 406, "exchange.delete if_unused on a bound exchange");
    let ch = t("channel", c.create_channel()).await.unwrap();
    t("unbind", ch.queue_unbind(q.as_str().into(), x.as_str().into(), "k".into(), FieldTable::default())).await.unwrap();
    t("delete if_unused", ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions { if_unused: true, ..Default::default() }))
        .await
        .unwrap();
    assert!(!exchange_exists(&c, &x).await);
    // deleting a queue removes its bindings: publishing to the old key routes nowhere
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn queue_declare_variants_and_errors() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    // server-named
    let q = t("server-named", ch.queue_declare("".into(), QueueDeclareOptions::exclusive(), FieldTable::default())).await.unwrap();
    assert!(q.name().as_str().starts_with("amq.gen-"), "{}", q.name());
    assert_eq!((q.message_count(), q.consumer_count()), (0, 0));
    // passive on missing → 404
    assert!(!queue_exists(&c, &uniq("noq")).await);
    // redeclare with different durable → 406
    let name = plain_queue(&ch, "redecl").await;
    let r = t("redeclare", ch.queue_declare(name.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())).await;
    assert_code(r, 406, "queue redeclared with another durability");
    // redeclare with different arguments → 406
    let ch = t("channel", c.create_channel()).await.unwrap();
    let r = t(
        "redeclare args",
        ch.queue_declare(name.as_str().into(), QueueDeclareOptions::default(), table(&[("x-dead-letter-exchange", s("elsewhere"))])),
    )
    .await;
    assert_code(r, 406, "queue redeclared with other arguments");
    // identical redeclare is fine
    let ch = t("channel", c.create_channel()).await.unwrap();
    declare_queue(&ch, &name, QueueDeclareOptions::default(), FieldTable::default()).await;
    // amq. prefix → 403
    let r =
        t("amq.q", ch.queue_declare(format!("amq.{}", uniq("q")).as_str().into(), QueueDeclareOptions::default(), FieldTable::default()))
            .await;
    assert_code(r, 403, "queue.declare amq.*");
    let ch = t("channel", c.create_channel()).await.unwrap();
    t("delete", ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default())).await.unwrap();
    assert!(!queue_exists(&c, &name).await);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn exclusive_queue_is_locked_and_dies_with_its_connection() {
    let b = Broker::start();
    let owner = connect(&b).await;
    let och = t("channel", owner.create_channel()).await.unwrap();
    let q = declare_queue(&och, &uniq("excl"), QueueDeclareOptions::exclusive(), FieldTable::default()).await;
    let other = connect(&b).await;
    for what in ["declare", "declare shared", "passive", "consume", "get", "delete", "purge", "bind", "unbind"] {
        let ch = t("channel", other.create_channel()).await.unwrap();
        let r: Result<(), lapin::Error> = match what {
            "declare" => {
                t(what, ch.queue_declare(q.as_str().into(), QueueDeclareOptions::exclusive(), FieldTable::default())).await.map(|_| ())
            }
            "declare shared" => {
                t(what, ch.queue_declare(q.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())).await.map(|_| ())
            }
            "unbind" => t(what, ch.queue_unbind(q.as_str().into(), "amq.direct".into(), "k".into(), FieldTable::default())).await,
            "passive" => t(
                what,
                ch.queue_declare(q.as_str().into(), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default()),
            )
            .await
            .map(|_| ()),
            "consume" => t(what, ch.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()))
                .await
                .map(|_| ()),
            "get" => t(what, ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.map(|_| ()),
            "delete" => t(what, ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await.map(|_| ()),
            "purge" => t(what, ch.queue_purge(q.as_str().into(), QueuePurgeOptions::default())).await.map(|_| ()),
            _ => {
                t(
                    what,
                    ch.queue_bind(q.as_str().into(), "amq.direct".into(), "k".into(), QueueBindOptions::default(), FieldTable::default()),
                )
                .await
            }
        };
        assert_code(r, 405, &format!("{what} on another connection's exclusive queue"));
    }
    // the owner can use it
    publish(&och, "", &q, b"mine").await;
    assert_eq!(wait_ready(&och, &q, 1, Duration::from_secs(3)).await, 1);
    t("close owner", owner.close(200, "".into())).await.unwrap();
    // gone with its connection
    let mut gone = false;
    for _ in 0..40 {
        if !queue_exists(&other, &q).await {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "exclusive queue survived its connection");
    t("close", other.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn auto_delete_queue_dies_with_last_consumer() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    let q =
        declare_queue(&ch, &uniq("autodel"), QueueDeclareOptions { auto_delete: true, ..Default::default() }, FieldTable::default()).await;
    // no consumer yet: it stays
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(queue_exists(&c, &q).await, "auto-delete queue deleted before any consumer");
    let c1 = t("consume", ch.basic_consume(q.as_str().into(), "c1".into(), BasicConsumeOptions::default(), FieldTable::default()))
        .await
        .unwrap();
    let c2 = t("consume", ch.basic_consume(q.as_str().into(), "c2".into(), BasicConsumeOptions::default(), FieldTable::default()))
        .await
        .unwrap();
    let dk = t(
        "passive",
        ch.queue_declare(q.as_str().into(), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default()),
    )
    .await
    .unwrap();
    assert_eq!(dk.consumer_count(), 2);
    t("cancel", ch.basic_cancel(c1.tag(), BasicCancelOptions::default())).await.unwrap();
    assert!(queue_exists(&c, &q).await, "deleted while a consumer remains");
    t("cancel", ch.basic_cancel(c2.tag(), BasicCancelOptions::default())).await.unwrap();
    let mut gone = false;
    for _ in 0..40 {
        if !queue_exists(&c, &q).await {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "auto-delete queue survived its last consumer");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn declare_ok_counts_purge_and_delete_conditions() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    confirm_mode(&ch).await;
    let q = plain_queue(&ch, "counts").await;
    for i in 0..5 {
        pub_h(&ch, "", &q, &format!("m{i}"), None).await;
    }
    let dk = t("redeclare", ch.queue_declare(q.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())).await.unwrap();
    assert_eq!((dk.message_count(), dk.consumer_count()), (5, 0));
    // if_empty on a non-empty queue → 406
    let r = t("delete if_empty", ch.queue_delete(q.as_str().into(), QueueDeleteOptions { if_empty: true, ..Default::default() })).await;
    assert_code(r, 406, "queue.delete if_empty on a non-empty queue");
    let ch = t("channel", c.create_channel()).await.unwrap();
    assert_eq!(t("purge", ch.queue_purge(q.as_str().into(), QueuePurgeOptions::default())).await.unwrap(), 5);
    assert_eq!(ready_count(&ch, &q).await, 0);
    assert_eq!(t("purge again", ch.queue_purge(q.as_str().into(), QueuePurgeOptions::default())).await.unwrap(), 0);
    // if_unused with a consumer → 406
    let cch = t("channel", c.create_channel()).await.unwrap();
    let _cons =
        t("consume", cch.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())).await.unwrap();
    let dk = t(
        "passive",
        ch.queue_declare(q.as_str().into(), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default()),
    )
    .await
    .unwrap();
    assert_eq!((dk.message_count(), dk.consumer_count()), (0, 1));
    let r = t("delete if_unused", ch.queue_delete(q.as_str().into(), QueueDeleteOptions { if_unused: true, ..Default::default() })).await;
    assert_code(r, 406, "queue.delete if_unused on a queue with a consumer");
    // plain delete returns the message count
    let ch = t("channel", c.create_channel()).await.unwrap();
    confirm_mode(&ch).await;
    let q2 = plain_queue(&ch, "delcount").await;
    for i in 0..3 {
        pub_h(&ch, "", &q2, &format!("m{i}"), None).await;
    }
    assert_eq!(t("delete", ch.queue_delete(q2.as_str().into(), QueueDeleteOptions::default())).await.unwrap(), 3);
    // queue.delete of a missing queue is OK in RabbitMQ 3.10 (idempotent delete)
    assert_eq!(t("delete missing", ch.queue_delete(q2.as_str().into(), QueueDeleteOptions::default())).await.unwrap(), 0);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn bind_to_missing_queue_or_exchange_is_not_found() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    let r = t(
        "bind missing q",
        ch.queue_bind(uniq("noq").as_str().into(), "amq.direct".into(), "k".into(), QueueBindOptions::default(), FieldTable::default()),
    )
    .await;
    assert_code(r, 404, "queue.bind of a missing queue");
    let ch = t("channel", c.create_channel()).await.unwrap();
    let q = plain_queue(&ch, "bindmiss").await;
    let r = t(
        "bind missing x",
        ch.queue_bind(q.as_str().into(), uniq("nox").as_str().into(), "k".into(), QueueBindOptions::default(), FieldTable::default()),
    )
    .await;
    assert_code(r, 404, "queue.bind to a missing exchange");
    let ch = t("channel", c.create_channel()).await.unwrap();
    t("delete", ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await.unwrap();
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn quorum_queues_follow_rabbitmqs_rules() {
    let b = Broker::start();
    let conn = connect(&b).await;
    let quorum = || {
        let mut a = FieldTable::default();
        a.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
        a
    };
    // Durable and shared: declared, and it takes and gives back messages.
    let ch = conn.create_channel().await.unwrap();
    let q = declare_queue(&ch, &uniq("qq"), QueueDeclareOptions::durable(), quorum()).await;
    confirm_mode(&ch).await;
    publish_confirmed(&ch, "", &q, b"m", BasicProperties::default().with_delivery_mode(2)).await;
    let got = ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap().expect("a message");
    assert_eq!(got.delivery.data, b"m");
    // What contradicts a quorum queue is refused with 406, each on a channel of its own.
    let refused = [
        ("non-durable", QueueDeclareOptions::default()),
        ("exclusive", QueueDeclareOptions { durable: true, exclusive: true, ..Default::default() }),
        ("auto-delete", QueueDeclareOptions { durable: true, auto_delete: true, ..Default::default() }),
    ];
    for (what, opts) in refused {
        let ch = conn.create_channel().await.unwrap();
        assert_code(ch.queue_declare(uniq("qq-bad").as_str().into(), opts, quorum()).await, 406, &format!("a {what} quorum queue"));
    }
    let mut bogus = FieldTable::default();
    bogus.insert("x-queue-type".into(), AMQPValue::LongString("no-such-type".into()));
    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.queue_declare(uniq("qq-bogus").as_str().into(), QueueDeclareOptions::durable(), bogus).await,
        406,
        "an unknown x-queue-type",
    );
}

#[tokio::test]
async fn unbind_of_what_does_not_exist_is_ok_as_in_rabbitmq() {
    // RabbitMQ answers unbind-ok since 3.2 whatever is missing (clients' cleanup relies on it).
    let b = Broker::start();
    let (c, ch) = setup(&b).await;
    let q = plain_queue(&ch, "unb").await;
    let x = exchange(&ch, "unb-x", ExchangeKind::Direct, FieldTable::default()).await;
    let none = uniq("missing");
    let unbind = |q: String, x: String| {
        let ch = ch.clone();
        async move { ch.queue_unbind(q.as_str().into(), x.as_str().into(), "k".into(), FieldTable::default()).await }
    };
    t("unbind, no binding", unbind(q.clone(), x.clone())).await.expect("unbind of a binding that does not exist");
    t("unbind, no exchange", unbind(q.clone(), none.clone())).await.expect("unbind from an exchange that does not exist");
    t("unbind, no queue", unbind(none.clone(), x.clone())).await.expect("unbind of a queue that does not exist");
    let opts = ExchangeUnbindOptions::default();
    t("x unbind, no destination", ch.exchange_unbind(none.as_str().into(), x.as_str().into(), "k".into(), opts, FieldTable::default()))
        .await
        .expect("exchange.unbind of a destination that does not exist");
    // The channel is still open and the existing binding still works and goes.
    bind(&ch, &q, &x, "k", FieldTable::default()).await;
    pub_h(&ch, &x, "k", "routed", None).await;
    assert_eq!(strs(drain(&ch, &q, 10).await), ["routed"]);
    t("unbind", unbind(q.clone(), x.clone())).await.unwrap();
    pub_h(&ch, &x, "k", "dropped", None).await;
    assert!(drain(&ch, &q, 1).await.is_empty(), "routed after the unbind");
    // The default exchange is still refused.
    let ch2 = t("channel", c.create_channel()).await.unwrap();
    let r = ch2.queue_unbind(q.as_str().into(), "".into(), "k".into(), FieldTable::default()).await;
    assert_code(r, 403, "queue.unbind from the default exchange");
    t("close", c.close(200, "".into())).await.unwrap();
}
