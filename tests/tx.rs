//! Transactions (class `tx`, AMQP 0-9-1 spec 1.9) through lapin, with RabbitMQ's semantics
//! (issue 12 item 6): publishes and settlements of a transactional channel are held until
//! tx.commit, tx.rollback discards the publishes and gives the settled deliveries back to the
//! channel, a channel closed with a transaction open discards it, commit-ok means stored
//! (it survives kill -9), and tx and confirm mode exclude each other (406).
//! Runs against RabbitMQ too (`RINGMQ_TEST_BROKER=host:port`), except the kill -9 case.

mod common;

use common::*;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use std::time::Duration;

/// basic.get with manual ack: (delivery tag, redelivered, body).
async fn get_manual(ch: &lapin::Channel, q: &str) -> (u64, bool, Vec<u8>) {
    let m = t("basic.get", ch.basic_get(q.into(), BasicGetOptions { no_ack: false }))
        .await
        .expect("basic.get")
        .unwrap_or_else(|| panic!("{q} is empty"));
    (m.delivery.delivery_tag, m.delivery.redelivered, m.delivery.data)
}

/// A queue holding `n` messages "m0".."m{n-1}", published with confirms on a channel of its own.
async fn queue_with(c: &lapin::Connection, tag: &str, n: usize) -> String {
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    let q = plain_queue(&ch, tag).await;
    confirm_mode(&ch).await;
    for i in 0..n {
        publish_confirmed(&ch, "", &q, format!("m{i}").as_bytes(), BasicProperties::default()).await;
    }
    q
}

#[tokio::test]
async fn publishes_of_a_transaction_reach_their_queues_only_at_commit() {
    let b = Broker::start();
    let (c, tx) = connect_ch(&b).await;
    let other = t("channel.open", c.create_channel()).await.unwrap();
    let q1 = plain_queue(&other, "tx-pub-a").await;
    let q2 = plain_queue(&other, "tx-pub-b").await;
    t("tx.select", tx.tx_select()).await.expect("tx.select");
    for i in 0..100 {
        publish(&tx, "", if i % 2 == 0 { &q1 } else { &q2 }, format!("m{i}").as_bytes()).await;
    }
    // Round trips on the transactional channel itself: everything before them was read.
    ready_count(&tx, &q1).await;
    assert_eq!((ready_count(&other, &q1).await, ready_count(&other, &q2).await), (0, 0), "publishes visible before tx.commit");
    t("tx.commit", tx.tx_commit()).await.expect("tx.commit");
    // commit-ok comes once the queues stored them: no waiting needed.
    assert_eq!((ready_count(&other, &q1).await, ready_count(&other, &q2).await), (50, 50));
    let want: Vec<Vec<u8>> = (0..100).step_by(2).map(|i| format!("m{i}").into_bytes()).collect();
    assert_eq!(drain(&other, &q1, 100).await, want, "committed publishes keep their order");
    // The channel stays transactional: the next transaction starts at once.
    publish(&tx, "", &q1, b"second").await;
    t("tx.rollback", tx.tx_rollback()).await.expect("tx.rollback");
    publish(&tx, "", &q1, b"third").await;
    t("tx.commit", tx.tx_commit()).await.expect("tx.commit");
    assert_eq!(drain(&other, &q1, 10).await, vec![b"third".to_vec()], "a rolled-back publish was delivered");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn acks_nacks_and_rejects_of_a_transaction_take_effect_at_commit() {
    let b = Broker::start();
    let c = connect(&b).await;
    let q = queue_with(&c, "tx-settle", 3).await;
    let tx = t("channel.open", c.create_channel()).await.unwrap();
    let other = t("channel.open", c.create_channel()).await.unwrap();
    t("tx.select", tx.tx_select()).await.unwrap();
    let (t0, _, _) = get_manual(&tx, &q).await;
    let (t1, _, _) = get_manual(&tx, &q).await;
    let (t2, _, _) = get_manual(&tx, &q).await;
    t("ack", tx.basic_ack(t0, BasicAckOptions::default())).await.unwrap();
    t("nack requeue", tx.basic_nack(t1, BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
    t("reject", tx.basic_reject(t2, BasicRejectOptions { requeue: false })).await.unwrap();
    ready_count(&tx, &q).await;
    assert_eq!(ready_count(&other, &q).await, 0, "a held nack requeued before tx.commit");
    t("tx.commit", tx.tx_commit()).await.expect("tx.commit");
    assert_eq!(wait_ready(&other, &q, 1, Duration::from_secs(5)).await, 1, "only the nacked message is back after commit");
    let (_, redelivered, body) = get_manual(&other, &q).await;
    assert_eq!((redelivered, body.as_slice()), (true, b"m1".as_slice()));
    // The acked and the rejected one are gone for good: closing the channel returns nothing.
    t("close tx channel", tx.close(200, "".into())).await.unwrap();
    t("close other", other.close(200, "".into())).await.unwrap();
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    assert_eq!(wait_ready(&ch, &q, 1, Duration::from_secs(5)).await, 1, "only m1 (requeued by the other channel's close)");
    assert_eq!(drain(&ch, &q, 10).await, vec![b"m1".to_vec()]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn rollback_gives_the_settled_deliveries_back_to_the_channel() {
    let b = Broker::start();
    let c = connect(&b).await;
    let q = queue_with(&c, "tx-rollback", 3).await;
    let tx = t("channel.open", c.create_channel()).await.unwrap();
    let other = t("channel.open", c.create_channel()).await.unwrap();
    t("tx.select", tx.tx_select()).await.unwrap();
    let tags = [get_manual(&tx, &q).await.0, get_manual(&tx, &q).await.0, get_manual(&tx, &q).await.0];
    t("ack multiple", tx.basic_ack(tags[1], BasicAckOptions { multiple: true })).await.unwrap();
    t("nack", tx.basic_nack(tags[2], BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
    t("tx.rollback", tx.tx_rollback()).await.expect("tx.rollback");
    assert_eq!(ready_count(&other, &q).await, 0, "a rolled-back nack requeued");
    // The three are outstanding on the channel again, under their tags: acking the second
    // one again is valid (an unknown tag would close the channel with 406 and fail the commit).
    t("ack again", tx.basic_ack(tags[1], BasicAckOptions::default())).await.unwrap();
    t("tx.commit", tx.tx_commit()).await.expect("tx.commit after re-acking a rolled-back tag");
    // Closing the channel requeues the two never acked, in their original order.
    t("close tx channel", tx.close(200, "".into())).await.unwrap();
    assert_eq!(wait_ready(&other, &q, 2, Duration::from_secs(5)).await, 2);
    assert_eq!(drain(&other, &q, 10).await, vec![b"m0".to_vec(), b"m2".to_vec()]);
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn a_channel_closed_with_a_transaction_open_discards_it() {
    let b = Broker::start();
    let c = connect(&b).await;
    let q = queue_with(&c, "tx-close", 1).await;
    let tx = t("channel.open", c.create_channel()).await.unwrap();
    t("tx.select", tx.tx_select()).await.unwrap();
    let (tag, _, _) = get_manual(&tx, &q).await;
    t("ack", tx.basic_ack(tag, BasicAckOptions::default())).await.unwrap();
    publish(&tx, "", &q, b"never").await;
    t("close tx channel", tx.close(200, "".into())).await.unwrap();
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    assert_eq!(wait_ready(&ch, &q, 1, Duration::from_secs(5)).await, 1);
    let (_, redelivered, body) = get_manual(&ch, &q).await;
    assert_eq!((redelivered, body.as_slice()), (true, b"m0".as_slice()), "the uncommitted ack was applied or the publish delivered");
    assert_eq!(ready_count(&ch, &q).await, 0, "an uncommitted publish was delivered");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test]
async fn tx_and_confirm_mode_exclude_each_other_and_commit_needs_select() {
    let b = Broker::start();
    let c = connect(&b).await;
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    confirm_mode(&ch).await;
    assert_code(t("tx.select", ch.tx_select()).await, 406, "tx.select on a confirm channel");
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    t("tx.select", ch.tx_select()).await.unwrap();
    t("tx.select again", ch.tx_select()).await.expect("tx.select twice is fine");
    assert_code(t("confirm.select", ch.confirm_select(ConfirmSelectOptions::default())).await, 406, "confirm.select on a tx channel");
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    assert_code(t("tx.commit", ch.tx_commit()).await, 406, "tx.commit without tx.select");
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    assert_code(t("tx.rollback", ch.tx_rollback()).await, 406, "tx.rollback without tx.select");
    // A missing exchange is refused at publish time, not at commit (404 closes the channel).
    let ch = t("channel.open", c.create_channel()).await.unwrap();
    t("tx.select", ch.tx_select()).await.unwrap();
    let watch = close_watch(&ch).await;
    publish(&ch, &uniq("no-such-x"), "rk", b"x").await;
    assert_eq!(watch.code("publish to a missing exchange in a transaction").await, 404);
    assert!(c.status().connected(), "the connection stays open");
    t("close", c.close(200, "".into())).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_transaction_of_persistent_messages_survives_kill_9() {
    let mut b = Broker::start();
    require_own_broker!(b, "kills ringmq");
    let q = uniq("tx-durable");
    {
        let (c, ch) = connect_ch(&b).await;
        declare_queue(&ch, &q, QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await;
        t("tx.select", ch.tx_select()).await.unwrap();
        for round in 0..5 {
            for i in 0..100 {
                let props = BasicProperties::default().with_delivery_mode(2);
                let body = format!("r{round}-{i}");
                t("publish", ch.basic_publish("".into(), q.as_str().into(), Default::default(), body.as_bytes(), props)).await.unwrap();
            }
            t("tx.commit", ch.tx_commit()).await.expect("tx.commit");
        }
        // An uncommitted tail is not stored.
        publish(&ch, "", &q, b"uncommitted").await;
        tokio::task::block_in_place(|| b.kill9_restart());
        drop(c);
    }
    let (c, ch) = connect_ch(&b).await;
    assert_eq!(ready_count(&ch, &q).await, 500, "every committed message survives kill -9, nothing else");
    let want: Vec<Vec<u8>> = (0..5).flat_map(|r| (0..100).map(move |i| format!("r{r}-{i}").into_bytes())).collect();
    assert_eq!(drain(&ch, &q, 600).await, want);
    t("close", c.close(200, "".into())).await.unwrap();
}

/// A transaction on node 1 whose publishes and acks go to a queue served by node 2: commit-ok
/// comes once node 2 stored them, and a rollback's acks stay undone there too.
#[test]
fn a_transaction_commits_to_a_queue_on_another_node() {
    common::cluster::run(async {
        let c = common::cluster::Cluster::start(3);
        let here = connect_uri(&c.amqp_uri(0)).await;
        let there = connect_uri(&c.amqp_uri(1)).await;
        let q = uniq("tx-remote");
        let tch = t("channel.open", there.create_channel()).await.unwrap();
        declare_queue(&tch, &q, QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await;
        let tx = t("channel.open", here.create_channel()).await.unwrap();
        t("tx.select", tx.tx_select()).await.unwrap();
        for i in 0..20 {
            let props = BasicProperties::default().with_delivery_mode(2);
            t("publish", tx.basic_publish("".into(), q.as_str().into(), Default::default(), format!("m{i}").as_bytes(), props))
                .await
                .unwrap();
        }
        assert_eq!(ready_count(&tch, &q).await, 0, "publishes visible on the queue's node before tx.commit");
        t("tx.commit", tx.tx_commit()).await.expect("tx.commit");
        assert_eq!(ready_count(&tch, &q).await, 20, "commit-ok before the queue's node stored the publishes");
        let (tag, _, body) = get_manual(&tx, &q).await;
        assert_eq!(body, b"m0");
        t("ack", tx.basic_ack(tag, BasicAckOptions::default())).await.unwrap();
        t("tx.rollback", tx.tx_rollback()).await.unwrap();
        t("close tx channel", tx.close(200, "".into())).await.unwrap();
        // The rolled-back ack left m0 outstanding; the close requeued it on node 2.
        assert_eq!(wait_ready(&tch, &q, 20, Duration::from_secs(10)).await, 20);
        let (_, redelivered, body) = get_manual(&tch, &q).await;
        assert_eq!((redelivered, body.as_slice()), (true, b"m0".as_slice()));
    });
}
