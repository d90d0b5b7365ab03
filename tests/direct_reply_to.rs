//! Direct reply-to (`amq.rabbitmq.reply-to`, issue 12 item 9) through lapin, as RabbitMQ
//! documents it and aio-pika's and the Java client's RPC helpers use it: the requester
//! consumes from the pseudo-queue in no-ack mode and publishes with `reply_to` set to it; the
//! responder sees a rewritten `amq.rabbitmq.reply-to.…` name and publishes its reply there
//! through the default exchange; the reply reaches the requester's channel with no queue.
//! Also the errors (406), replies after the consumer is gone, and a requester and responder
//! on two nodes of a cluster. The single-node tests run against RabbitMQ too
//! (`RINGMQ_TEST_BROKER=host:port`).

mod common;

use common::cluster::{run, Cluster};
use common::*;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use std::time::Duration;

const PSEUDO: &str = "amq.rabbitmq.reply-to";

/// A no-ack consumer on the pseudo-queue.
async fn reply_consumer(ch: &Channel) -> lapin::Consumer {
    let opts = BasicConsumeOptions { no_ack: true, ..Default::default() };
    t("consume reply-to", ch.basic_consume(PSEUDO.into(), "".into(), opts, FieldTable::default()))
        .await
        .expect("consume amq.rabbitmq.reply-to")
}

/// Serves `n` requests from `queue` on `conn`: each reply is "re:<request>" with the
/// request's correlation id, published to the request's reply_to. Returns the reply_to names seen.
async fn serve(conn: &Connection, queue: &str, n: usize) -> Vec<String> {
    let ch = t("channel.open", conn.create_channel()).await.unwrap();
    let mut requests =
        t("consume requests", ch.basic_consume(queue.into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()))
            .await
            .unwrap();
    let mut seen = Vec::new();
    for _ in 0..n {
        let d = next_delivery(&mut requests, Duration::from_secs(5)).await;
        let reply_to = d.properties.reply_to().as_ref().expect("request without reply_to").to_string();
        let corr = d.properties.correlation_id().clone().expect("request without correlation_id");
        let body = [b"re:".as_slice(), &d.data].concat();
        let props = BasicProperties::default().with_correlation_id(corr);
        t("publish reply", ch.basic_publish("".into(), reply_to.as_str().into(), Default::default(), &body, props)).await.unwrap();
        t("ack request", d.ack(BasicAckOptions::default())).await.unwrap();
        seen.push(reply_to);
    }
    seen
}

/// Sends `n` requests "q<i>" to `queue` on `ch` (which consumes replies) and checks every reply.
async fn call(ch: &Channel, replies: &mut lapin::Consumer, queue: &str, n: usize) {
    for i in 0..n {
        let props = BasicProperties::default().with_reply_to(PSEUDO.into()).with_correlation_id(format!("c{i}").into());
        t("publish request", ch.basic_publish("".into(), queue.into(), Default::default(), format!("q{i}").as_bytes(), props))
            .await
            .unwrap();
        let d = next_delivery(replies, Duration::from_secs(5)).await;
        assert_eq!(d.data, format!("re:q{i}").into_bytes(), "reply {i}");
        assert_eq!(d.properties.correlation_id().as_ref().map(|c| c.to_string()), Some(format!("c{i}")));
        assert!(d.routing_key.as_str().starts_with("amq.rabbitmq.reply-to."), "reply routing key {}", d.routing_key);
        assert!(d.exchange.as_str().is_empty() && !d.redelivered);
    }
}

#[tokio::test]
async fn replies_reach_the_requesting_channel_without_a_queue() {
    let b = Broker::start();
    let requester = connect(&b).await;
    let responder = connect(&b).await;
    let ch = t("channel.open", requester.create_channel()).await.unwrap();
    let queue = plain_queue(&ch, "rpc").await;
    // The pseudo-queue can be declared passively, as clients that check it do.
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    t("passive declare", ch.queue_declare(PSEUDO.into(), passive, FieldTable::default()))
        .await
        .expect("passive declare of amq.rabbitmq.reply-to");
    let mut replies = reply_consumer(&ch).await;
    let server = {
        let queue = queue.clone();
        tokio::spawn(async move { (serve(&responder, &queue, 50).await, responder) })
    };
    call(&ch, &mut replies, &queue, 50).await;
    let (names, responder) = t("responder", server).await.unwrap();
    assert!(names.iter().all(|n| n.starts_with("amq.rabbitmq.reply-to.") && n.len() > PSEUDO.len() + 1), "names {names:?}");
    assert!(names.windows(2).all(|w| w[0] == w[1]), "one channel, one name: {names:?}");
    t("close", requester.close(200, "".into())).await.unwrap();
    t("close", responder.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn direct_reply_to_errors_are_406() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    let acking =
        t("consume with acks", ch.basic_consume(PSEUDO.into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())).await;
    assert_code(acking, 406, "a reply consumer that acknowledges");
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    let q = plain_queue(&ch, "rpc-no-consumer").await;
    let watch = close_watch(&ch).await;
    let props = BasicProperties::default().with_reply_to(PSEUDO.into());
    // The channel may be closed before lapin reports the publish as sent.
    let _ = t("publish", ch.basic_publish("".into(), q.as_str().into(), Default::default(), b"req", props)).await;
    assert_eq!(watch.code("a request for a direct reply on a channel without the reply consumer").await, 406);
    assert_eq!(ready_count(&t("channel.open", c.create_channel()).await.unwrap(), &q).await, 0, "the refused request was stored");
    assert!(c.status().connected(), "the connection stays open");
    // lapin refuses to close a connection whose channel it still sees closing.
    let _ = t("close", c.close(200, "".into())).await;
}

#[tokio::test]
async fn a_reply_after_the_consumer_went_is_dropped_and_a_mandatory_one_returned() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    let q = plain_queue(&ch, "rpc-late").await;
    let replies = reply_consumer(&ch).await;
    let props = BasicProperties::default().with_reply_to(PSEUDO.into());
    t("publish", ch.basic_publish("".into(), q.as_str().into(), Default::default(), b"req", props)).await.unwrap();
    let other = t("channel.open", c.create_channel()).await.unwrap();
    let got = t("get", other.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().expect("request");
    let name = got.delivery.properties.reply_to().as_ref().unwrap().to_string();
    t("cancel", ch.basic_cancel(replies.tag(), BasicCancelOptions::default())).await.unwrap();
    confirm_mode(&other).await;
    let mandatory = BasicPublishOptions { mandatory: true, ..Default::default() };
    let pc = t("publish late reply", other.basic_publish("".into(), name.as_str().into(), mandatory, b"late", Default::default()))
        .await
        .unwrap();
    let confirm = t("confirm", pc).await.unwrap();
    assert!(confirm.is_ack(), "the late reply was nacked: {confirm:?}");
    let returned = confirm.take_message().expect("a mandatory reply to a gone consumer comes back (basic.return)");
    assert_eq!(returned.reply_code, 312);
    // Not mandatory: confirmed and dropped; the channel stays usable.
    let pc = t("publish late reply", other.basic_publish("".into(), name.as_str().into(), Default::default(), b"late", Default::default()))
        .await
        .unwrap();
    assert!(t("confirm", pc).await.unwrap().is_ack());
    ready_count(&ch, &q).await;
    t("close", c.close(200, "".into())).await.unwrap();
}

/// The requester on node 1, the request queue and its responder on node 2: the reply crosses
/// back to node 1's channel.
#[test]
fn replies_cross_the_cluster_to_the_requesting_node() {
    run(async {
        let c = Cluster::start(3);
        let requester = connect_uri(&c.amqp_uri(0)).await;
        let responder = connect_uri(&c.amqp_uri(1)).await;
        let queue = uniq("rpc-cluster");
        let rch = t("channel.open", responder.create_channel()).await.unwrap();
        declare_queue(&rch, &queue, QueueDeclareOptions::default(), FieldTable::default()).await;
        let ch = t("channel.open", requester.create_channel()).await.unwrap();
        let mut replies = reply_consumer(&ch).await;
        let server = {
            let queue = queue.clone();
            tokio::spawn(async move { serve(&responder, &queue, 20).await })
        };
        call(&ch, &mut replies, &queue, 20).await;
        let names = t("responder", server).await.unwrap();
        assert!(names[0].starts_with(&format!("{PSEUDO}.{}.", c.node_id(0))), "a name of the requester's node: {}", names[0]);
    });
}
