//! Users, permissions and policies through a real client (lapin) over loopback: a broker
//! seeded from a TOML file with a restricted user, a user without permissions in `/`, a
//! policy and an operator policy (issue 13, items 2, 3 and 8).
//!
//! What a user notices: 403 ACCESS_REFUSED with RabbitMQ's text outside the granted patterns
//! and success inside; a wrong password refused; no permission in the vhost → 530 at
//! connection.open; guest from loopback as before; users and permissions surviving kill -9
//! (from the metadata, not the file: the file seeds a fresh data directory only); a policy's
//! max-length on a queue declared after start, and an operator policy capping a queue's own
//! argument.

mod common;

use std::time::Duration;

use common::python::run_client;
use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

const CONFIG: &str = r#"
[[users]]
name = "guest"
password = "guest"
loopback_only = true
tags = ["administrator"]

[[users]]
name = "app"
password = "app-secret"

[[users]]
name = "outsider"
password = "outsider-secret"

[[permissions]]
user = "guest"
configure = ".*"
write = ".*"
read = ".*"

# app: only its own queues, plus the server-named ones a client declares for itself.
[[permissions]]
user = "app"
configure = "^(app\\..*|amq\\.gen-.*)$"
write = "^(app\\..*|amq\\.default)$"
read = "^(app\\..*|amq\\.gen-.*)$"

[[policies]]
name = "limit"
pattern = "^lim\\."
apply_to = "queues"
definition = { max-length = 2 }

[[policies]]
name = "fallback"
pattern = "^ae\\.in"
apply_to = "exchanges"
definition = { alternate-exchange = "ae.fallback" }

[[operator_policies]]
name = "cap"
pattern = "^cap\\."
definition = { max-length = 3 }
"#;

/// A broker started with [`CONFIG`] (written to a file that lives as long as the broker).
fn broker(config: &str) -> (Broker, tempfile::NamedTempFile) {
    let file = tempfile::Builder::new().suffix(".toml").tempfile().expect("config file");
    std::fs::write(file.path(), config).expect("write config");
    let path = file.path().to_str().expect("utf-8 path").to_owned();
    (Broker::start_with_args(&["--config", &path]), file)
}

/// A name starting with `prefix.` (the patterns above anchor at the start), unique in this run.
fn named(prefix: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    format!("{prefix}.{}.{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

fn uri(b: &Broker, user: &str, password: &str) -> String {
    format!("amqp://{user}:{password}@{}:{}/%2f", b.host(), b.port())
}

async fn channel(c: &Connection) -> lapin::Channel {
    t("channel.open", c.create_channel()).await.expect("channel.open")
}

/// The text of the close a lapin error carries.
fn reply_text(e: &lapin::Error) -> String {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => p.get_message().to_string(),
        other => format!("{other:?}"),
    }
}

/// The restricted user: declare, publish, get, consume inside its patterns succeed; outside
/// them each is refused with 403 and RabbitMQ's text, on a channel of its own.
async fn check_app_permissions(b: &Broker) {
    let guest = connect(b).await;
    let gch = channel(&guest).await;
    let foreign = named("guest.q");
    t("guest declare", gch.queue_declare(foreign.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())).await.unwrap();

    let app = connect_uri(&uri(b, "app", "app-secret")).await;
    let ch = channel(&app).await;
    let mine = named("app.q");
    t("declare inside", ch.queue_declare(mine.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())).await.unwrap();
    publish(&ch, "", &mine, b"inside").await;
    assert_eq!(wait_ready(&ch, &mine, 1, Duration::from_secs(3)).await, 1);
    assert_eq!(get_body(&ch, &mine).await, Some(b"inside".to_vec()));

    let ch = channel(&app).await;
    let r = t("declare outside", ch.queue_declare("other.q".into(), QueueDeclareOptions::default(), FieldTable::default())).await;
    let e = r.expect_err("declare outside the configure pattern");
    assert_eq!(reply_code(&e), Some(403));
    assert!(reply_text(&e).contains("access to queue 'other.q' in vhost '/' refused for user 'app'"), "{}", reply_text(&e));

    // A dead-letter exchange needs write on it.
    let ch = channel(&app).await;
    let mut dlx = FieldTable::default();
    dlx.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("amq.fanout".into()));
    let r = t("declare with a DLX outside", ch.queue_declare(named("app.dl").as_str().into(), QueueDeclareOptions::default(), dlx)).await;
    assert_code(r.map(|_| ()), 403, "x-dead-letter-exchange outside the write pattern");

    // So does an alternate exchange.
    let ch = channel(&app).await;
    let mut ae = FieldTable::default();
    ae.insert("alternate-exchange".into(), AMQPValue::LongString("amq.fanout".into()));
    let opts = ExchangeDeclareOptions::default();
    let r =
        t("declare with an AE outside", ch.exchange_declare(named("app.x").as_str().into(), lapin::ExchangeKind::Direct, opts, ae)).await;
    assert_code(r.map(|_| ()), 403, "alternate-exchange outside the write pattern");
    let ch = channel(&app).await;
    t("declare inside", ch.exchange_declare(named("app.x").as_str().into(), lapin::ExchangeKind::Direct, opts, FieldTable::default()))
        .await
        .unwrap();

    let ch = channel(&app).await;
    let r = t("get outside", ch.basic_get(foreign.as_str().into(), BasicGetOptions { no_ack: true })).await;
    assert_code(r.map(|_| ()), 403, "basic.get outside the read pattern");

    let ch = channel(&app).await;
    let r =
        t("consume outside", ch.basic_consume(foreign.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()))
            .await;
    assert_code(r.map(|_| ()), 403, "basic.consume outside the read pattern");

    let ch = channel(&app).await;
    let r = t("purge outside", ch.queue_purge(foreign.as_str().into(), QueuePurgeOptions::default())).await;
    assert_code(r.map(|_| ()), 403, "queue.purge outside the read pattern");

    let ch = channel(&app).await;
    let r = t(
        "bind from amq.direct",
        ch.queue_bind(mine.as_str().into(), "amq.direct".into(), "k".into(), QueueBindOptions::default(), FieldTable::default()),
    )
    .await;
    assert_code(r.map(|_| ()), 403, "queue.bind needs read on the source exchange");

    // A publish outside the write pattern closes the channel with 403; nothing is stored.
    let ch = channel(&app).await;
    let watch = close_watch(&ch).await;
    publish(&ch, "amq.fanout", "", b"outside").await;
    assert_eq!(watch.code("publish outside the write pattern").await, 403);
    assert_eq!(ready_count(&gch, &foreign).await, 0);
    t("close app", app.close(200, "bye".into())).await.unwrap();
    t("close guest", guest.close(200, "bye".into())).await.unwrap();
}

/// Logins: wrong password and unknown user 403; no permission in `/` 530 with RabbitMQ's
/// text; guest from loopback works.
async fn check_logins(b: &Broker) {
    let r = t("wrong password", Connection::connect(&uri(b, "app", "nope"), ConnectionProperties::default())).await;
    assert_code(r.map(|_| ()), 403, "wrong password");
    let r = t("outsider", Connection::connect(&uri(b, "outsider", "outsider-secret"), ConnectionProperties::default())).await;
    let e = r.map(|_| ()).expect_err("a user without permissions in the vhost");
    assert_eq!(reply_code(&e), Some(530), "{e}");
    assert!(reply_text(&e).contains("access to vhost '/' refused for user 'outsider'"), "{}", reply_text(&e));
    let (c, _ch) = connect_ch(b).await;
    t("close", c.close(200, "bye".into())).await.unwrap();
}

#[tokio::test]
async fn permissions_refuse_outside_the_patterns_and_survive_kill9() {
    let (mut b, file) = broker(CONFIG);
    require_own_broker!(b, "seeds users from a ringmq TOML file");
    check_logins(&b).await;
    check_app_permissions(&b).await;
    assert!(b.log().contains("login refused") && b.log().contains("user=app"), "the failed login is logged with the user:\n{}", b.log());

    // The file seeds a fresh data directory only: after a crash the users and permissions come
    // from the metadata, even with the file reduced to the default.
    std::fs::write(file.path(), "").expect("rewrite config");
    b.kill9_restart();
    check_logins(&b).await;
    check_app_permissions(&b).await;
}

#[tokio::test]
async fn a_policy_limits_queues_declared_after_start_and_the_operator_policy_caps_arguments() {
    let (b, _file) = broker(CONFIG);
    require_own_broker!(b, "seeds policies from a ringmq TOML file");
    let (c, ch) = connect_ch(&b).await;
    confirm_mode(&ch).await;
    let long = |n: i64| {
        let mut t = FieldTable::default();
        t.insert("x-max-length".into(), AMQPValue::LongLongInt(n));
        t
    };
    // (queue, its own x-max-length, messages published, ready expected)
    let cases = [
        (named("lim.q"), None, 4, 2),        // the policy's max-length 2
        (named("lim.own"), Some(3), 5, 3),   // the queue's argument wins over the policy
        (named("cap.q"), Some(10), 6, 3),    // the operator policy's smaller cap wins
        (named("cap.small"), Some(1), 4, 1), // the argument is stricter than the operator policy
        (named("free.q"), None, 4, 4),       // no policy matches
    ];
    for (q, own, published, ready) in &cases {
        let args = own.map(long).unwrap_or_default();
        t("declare", ch.queue_declare(q.as_str().into(), QueueDeclareOptions::default(), args)).await.unwrap();
        for i in 0..*published {
            publish_confirmed(&ch, "", q, format!("m{i}").as_bytes(), Default::default()).await;
        }
        assert_eq!(ready_count(&ch, q).await, *ready, "{q}: {published} published");
    }
    // drop-head: the newest stay.
    assert_eq!(drain(&ch, &cases[0].0, 10).await, [b"m2".to_vec(), b"m3".to_vec()]);

    // A policy's alternate-exchange: what an exchange declared without one cannot route goes
    // to the policy's exchange.
    let opts = ExchangeDeclareOptions::default();
    t("declare fallback", ch.exchange_declare("ae.fallback".into(), lapin::ExchangeKind::Fanout, opts, FieldTable::default()))
        .await
        .unwrap();
    t("declare ae.in", ch.exchange_declare("ae.in".into(), lapin::ExchangeKind::Direct, opts, FieldTable::default())).await.unwrap();
    let caught = named("caught");
    t("declare caught", ch.queue_declare(caught.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())).await.unwrap();
    t(
        "bind caught",
        ch.queue_bind(caught.as_str().into(), "ae.fallback".into(), "".into(), QueueBindOptions::default(), FieldTable::default()),
    )
    .await
    .unwrap();
    publish_confirmed(&ch, "ae.in", "nowhere", b"unroutable", Default::default()).await;
    assert_eq!(drain(&ch, &caught, 10).await, [b"unroutable".to_vec()]);
    t("close", c.close(200, "bye".into())).await.unwrap();
}

/// The same denials through pika (tests/clients/permissions.py).
#[test]
fn pika_meets_the_same_denials() {
    let (b, _file) = broker(CONFIG);
    require_own_broker!(b, "seeds users from a ringmq TOML file");
    run_client("permissions.py", &b.host(), b.port(), &[]);
}
