//! Connection-level behaviour through lapin.
//!
//! Covers issue 2 item 3 (connection layer): SASL PLAIN and AMQPLAIN login, bad password →
//! 403 ACCESS_REFUSED on connection.close, unknown vhost → 530 NOT_ALLOWED, channel
//! open/close, heartbeat negotiation (the client's smaller value is honoured), bodies larger
//! than frame_max split over several body frames and reassembled intact.
//! Validated against RabbitMQ 3.10 (RINGMQ_TEST_BROKER=127.0.0.1:PORT cargo test --test connection).

mod common;

use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

#[tokio::test]
async fn plain_login_and_channel_roundtrip() {
    let b = Broker::start();
    let c = connect_uri(&b.uri_with("auth_mechanism=plain")).await;
    assert!(c.status().connected());
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    let q = t("declare", ch.queue_declare("".into(), QueueDeclareOptions::exclusive(), FieldTable::default())).await.unwrap();
    assert!(q.name().as_str().starts_with("amq.gen-"), "server-named queue: {}", q.name());
    t("close", c.close(200, "bye".into())).await.unwrap();
}

/// Listening in both families (`--listen` twice, as the default does on loopback): a client
/// that resolves `localhost` to ::1 (Node's amqplib does) reaches the same broker as one on
/// 127.0.0.1, and guest counts as a loopback user there too.
#[tokio::test]
async fn one_broker_answers_on_ipv4_and_ipv6_loopback() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("skipped: this host has no IPv6 loopback");
        return;
    }
    let b = Broker::start_with_args(&["--listen", "[::1]:{port}"]);
    if b.is_external() {
        return;
    }
    let v4 = connect_uri(&b.uri()).await;
    let v6 = connect_uri(&format!("amqp://guest:guest@[::1]:{}/%2f", b.port())).await;
    let q = uniq("both-families");
    let ch6 = t("channel.open", v6.create_channel()).await.unwrap();
    t("declare", ch6.queue_declare(q.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())).await.unwrap();
    t("publish", ch6.basic_publish("".into(), q.as_str().into(), BasicPublishOptions::default(), b"over ::1", BasicProperties::default()))
        .await
        .unwrap();
    let ch4 = t("channel.open", v4.create_channel()).await.unwrap();
    let got = t("basic.get", ch4.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap();
    assert_eq!(got.map(|m| m.delivery.data), Some(b"over ::1".to_vec()), "the message published over ::1, got over 127.0.0.1");
    assert!(b.log().contains(&format!("[::1]:{}", b.port())), "the ready line names the IPv6 address");
}

/// connection.update-secret (RabbitMQ's credential rotation, lapin's, pika's and amqplib's
/// `update_secret`): answered update-secret-ok and the connection goes on, whatever the new
/// secret, as RabbitMQ does for its internal users, whose login does not expire (amqplib's
/// suite rotates guest's secret to "new secret" and expects update-secret-ok).
#[tokio::test]
async fn update_secret_is_accepted_and_the_connection_goes_on() {
    let b = Broker::start();
    let c = connect_uri(&b.uri()).await;
    t("update-secret", c.update_secret("guest".into(), "rotation".into())).await.expect("the same password");
    let ch = t("channel.open", c.create_channel()).await.expect("the connection goes on after update-secret-ok");
    t("declare", ch.queue_declare("".into(), QueueDeclareOptions::exclusive(), FieldTable::default())).await.unwrap();
    t("update-secret", c.update_secret("new secret".into(), "rotation".into())).await.expect("another secret");
    let ch2 = t("channel.open", c.create_channel()).await.expect("the connection goes on after a second update-secret");
    t("declare", ch2.queue_declare("".into(), QueueDeclareOptions::exclusive(), FieldTable::default())).await.unwrap();
    assert!(c.status().connected(), "the connection closed after update-secret");
    if !b.is_external() {
        assert!(b.log().contains("user updated secret"), "the accepted update is not logged");
    }
}

#[tokio::test]
async fn amqplain_login() {
    let b = Broker::start();
    let c = connect_uri(&b.uri_with("auth_mechanism=amqplain")).await;
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    t("qos", ch.basic_qos(10, BasicQosOptions::default())).await.unwrap();
    t("close", c.close(200, "bye".into())).await.unwrap();
}

#[tokio::test]
async fn bad_password_is_access_refused() {
    let b = Broker::start();
    for mech in ["plain", "amqplain"] {
        let uri = format!("amqp://guest:wrong@{}:{}/%2f?auth_mechanism={mech}", b.host(), b.port());
        let r = t("connect with bad password", Connection::connect(&uri, ConnectionProperties::default())).await;
        // The broker advertises authentication_failure_close, so it must send connection.close
        // 403 ACCESS_REFUSED rather than just dropping the socket.
        assert_code(r.map(|_| ()), 403, &format!("bad password ({mech})"));
    }
    let uri = format!("amqp://nosuchuser:guest@{}:{}/%2f", b.host(), b.port());
    let r = t("connect unknown user", Connection::connect(&uri, ConnectionProperties::default())).await;
    assert_code(r.map(|_| ()), 403, "unknown user");
    // The broker is still fine for a good login.
    let (c, _ch) = connect_ch(&b).await;
    t("close", c.close(200, "bye".into())).await.unwrap();
}

#[tokio::test]
async fn unknown_vhost_is_not_allowed() {
    let b = Broker::start();
    let uri = format!("amqp://guest:guest@{}:{}/no-such-vhost-{}", b.host(), b.port(), std::process::id());
    let r = t("connect to unknown vhost", Connection::connect(&uri, ConnectionProperties::default())).await;
    assert_code(r.map(|_| ()), 530, "connection.open on an unknown vhost");
}

#[tokio::test]
async fn channels_open_close_independently() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch1 = t("open 1", c.create_channel()).await.unwrap();
    let ch2 = t("open 2", c.create_channel()).await.unwrap();
    assert_ne!(ch1.id(), ch2.id());
    let q = uniq("chan");
    t("declare", ch1.queue_declare(q.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())).await.unwrap();
    t("close ch1", ch1.close(200, "done".into())).await.unwrap();
    assert!(!ch1.status().connected());
    // ch2 unaffected; a new channel works too
    t("publish on ch2", ch2.basic_publish("".into(), q.as_str().into(), BasicPublishOptions::default(), b"x", BasicProperties::default()))
        .await
        .unwrap();
    let ch3 = t("open 3", c.create_channel()).await.unwrap();
    let got = t("get", ch3.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap();
    assert_eq!(got.expect("message published on ch2").data, b"x");
    // a soft error on ch3 does not touch ch2
    let r = t(
        "passive missing",
        ch3.queue_declare(
            uniq("missing").as_str().into(),
            QueueDeclareOptions { passive: true, ..Default::default() },
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(r, 404, "passive declare of missing queue");
    t("ch2 still usable", ch2.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await.unwrap();
    t("close", c.close(200, "bye".into())).await.unwrap();
}

#[tokio::test]
async fn heartbeat_client_smaller_value_honoured() {
    let b = Broker::start();
    // Servers propose 60 s by default; a client asking for 7 s must get 7 s.
    let c = connect_uri(&b.uri_with("heartbeat=7")).await;
    assert_eq!(c.configuration().heartbeat(), 7);
    let ch = t("channel", c.create_channel()).await.unwrap();
    // With a 1 s heartbeat the connection stays alive across several intervals when idle, as
    // both sides send heartbeats.
    let c1 = connect_uri(&b.uri_with("heartbeat=1")).await;
    assert_eq!(c1.configuration().heartbeat(), 1);
    let ch1 = t("channel", c1.create_channel()).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    assert!(c1.status().connected(), "connection with heartbeat=1 died while idle");
    t("qos after idle", ch1.basic_qos(1, BasicQosOptions::default())).await.unwrap();
    t("qos", ch.basic_qos(1, BasicQosOptions::default())).await.unwrap();
    t("close", c.close(200, "bye".into())).await.unwrap();
    t("close", c1.close(200, "bye".into())).await.unwrap();
}

#[tokio::test]
async fn frame_max_negotiated_and_large_body_intact() {
    let b = Broker::start();
    let c = connect(&b).await;
    let fm = c.configuration().frame_max();
    assert!(fm >= 4096, "frame_max {fm}");
    let ch = t("channel", c.create_channel()).await.unwrap();
    let q = uniq("big");
    t(
        "declare",
        ch.queue_declare(q.as_str().into(), QueueDeclareOptions { auto_delete: false, ..Default::default() }, FieldTable::default()),
    )
    .await
    .unwrap();
    // 1 MiB + 17 bytes, a pattern that would show any reordering or loss of a frame
    let body: Vec<u8> = (0..(1 << 20) + 17u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    for _ in 0..2 {
        t("publish", ch.basic_publish("".into(), q.as_str().into(), BasicPublishOptions::default(), &body, BasicProperties::default()))
            .await
            .unwrap();
    }
    let got = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().expect("big message");
    assert_eq!(got.data.len(), body.len());
    assert!(got.data == body, "1 MiB body corrupted via basic.get");
    let mut cons = t(
        "consume",
        ch.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions { no_ack: true, ..Default::default() }, FieldTable::default()),
    )
    .await
    .unwrap();
    let d = t("deliver", cons.next()).await.expect("stream").expect("delivery");
    assert!(d.data == body, "1 MiB body corrupted via basic.deliver");
    t("delete", ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await.unwrap();
    t("close", c.close(200, "bye".into())).await.unwrap();
}

#[tokio::test]
async fn connection_close_by_client_then_reconnect() {
    let b = Broker::start();
    for _ in 0..3 {
        let (c, ch) = connect_ch(&b).await;
        t("qos", ch.basic_qos(5, BasicQosOptions::default())).await.unwrap();
        t("close", c.close(200, "bye".into())).await.unwrap();
        assert!(!c.status().connected());
    }
}

/// RabbitMQ refuses channel.flow active=false from a client with 540 NOT_IMPLEMENTED (a
/// connection error); active=true is answered with flow-ok.
#[tokio::test]
async fn channel_flow_active_false_is_not_implemented() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    t("flow on", ch.channel_flow(ChannelFlowOptions { active: true })).await.unwrap();
    let r = t("flow off", ch.channel_flow(ChannelFlowOptions { active: false })).await;
    assert_code(r, 540, "channel.flow active=false");
    drop(c);
}
