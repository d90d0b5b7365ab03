//! Consumer priorities (`x-priority` on basic.consume, issue 12 item 4) through lapin, as
//! RabbitMQ documents them: deliveries go to the highest-priority consumer that can take one;
//! a lower one gets messages only while the higher ones are blocked by their prefetch; a
//! non-integer priority is 406. Runs against RabbitMQ too (`RINGMQ_TEST_BROKER=host:port`).

mod common;

use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use std::time::Duration;

fn priority(p: i32) -> FieldTable {
    let mut a = FieldTable::default();
    a.insert("x-priority".into(), AMQPValue::LongInt(p));
    a
}

/// Takes what `c` got within `quiet` of silence; the delivery tags, acked unless `hold`.
async fn take_all(c: &mut lapin::Consumer, quiet: Duration, hold: bool) -> Vec<u64> {
    use futures_lite::StreamExt;
    let mut tags = Vec::new();
    while let Ok(Some(Ok(d))) = tokio::time::timeout(quiet, c.next()).await {
        tags.push(d.delivery_tag);
        if !hold {
            t("ack", d.ack(BasicAckOptions::default())).await.unwrap();
        }
    }
    tags
}

#[tokio::test]
async fn the_higher_priority_consumer_gets_every_message_it_can_take() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "cprio").await;
    let (hch, lch) = (t("channel.open", c.create_channel()).await.unwrap(), t("channel.open", c.create_channel()).await.unwrap());
    // Low first, so that attach order would favour it in a plain round-robin.
    let mut low = t("consume low", lch.basic_consume(q.as_str().into(), "low".into(), Default::default(), priority(1))).await.unwrap();
    let mut high = t("consume high", hch.basic_consume(q.as_str().into(), "high".into(), Default::default(), priority(10))).await.unwrap();
    for i in 0..30 {
        publish(&ch, "", &q, format!("m{i}").as_bytes()).await;
    }
    let quiet = Duration::from_millis(400);
    assert_eq!(take_all(&mut high, quiet, false).await.len(), 30, "the high-priority consumer (no prefetch limit) gets all");
    assert!(take_all(&mut low, Duration::from_millis(100), false).await.is_empty(), "the low-priority consumer got messages");

    // With prefetch 2 the high one is blocked after two: the low one gets the rest.
    t("qos", hch.basic_qos(2, BasicQosOptions::default())).await.unwrap();
    let mut high2 =
        t("consume high2", hch.basic_consume(q.as_str().into(), "high2".into(), Default::default(), priority(10))).await.unwrap();
    t("cancel high", hch.basic_cancel("high".into(), BasicCancelOptions::default())).await.unwrap();
    for i in 0..10 {
        publish(&ch, "", &q, format!("n{i}").as_bytes()).await;
    }
    let held = take_all(&mut high2, quiet, true).await;
    assert_eq!(held.len(), 2, "the blocked high-priority consumer holds its prefetch");
    assert_eq!(take_all(&mut low, quiet, false).await.len(), 8, "the low-priority consumer gets what the high one cannot take");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn a_priority_that_is_not_an_integer_is_406() {
    let b = Broker::start();
    let (c, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "cprio-bad").await;
    let mut args = FieldTable::default();
    args.insert("x-priority".into(), AMQPValue::LongString("high".into()));
    let r = t("consume", ch.basic_consume(q.as_str().into(), "".into(), Default::default(), args)).await;
    assert_code(r, 406, "x-priority as a string");
    assert!(c.status().connected(), "the connection stays open");
    let _ = t("close", c.close(200, "".into())).await;
}
