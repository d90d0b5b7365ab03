//! Any node serves any queue, as a user sees it: three real ringmq processes on loopback, a
//! queue declared on one node, clients on the others publishing, getting, consuming, acking,
//! nacking, purging and deleting; and what happens to a client's deliveries when the client's
//! node or the queue's node is killed with SIGKILL.
//!
//! The tests run one at a time (three brokers each on a 2-core machine); every wait is bounded.
//! Against an external broker (RINGMQ_TEST_BROKER) they are skipped.

mod common;

use std::time::Duration;

use common::cluster::{channel, confirming, durable_queue, persistent, publish_all, run, Cluster};
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

/// (message_count, consumer_count) from a passive queue.declare on a fresh channel.
async fn counts(conn: &Connection, name: &str) -> Result<(u32, u32), lapin::Error> {
    let ch = channel(conn).await;
    let opts = QueueDeclareOptions { passive: true, ..Default::default() };
    let q = t("passive queue.declare", ch.queue_declare(name.into(), opts, FieldTable::default())).await?;
    Ok((q.message_count(), q.consumer_count()))
}

async fn consumer(ch: &Channel, queue: &str, tag: &str) -> lapin::Consumer {
    t("basic.consume", ch.basic_consume(queue.into(), tag.into(), BasicConsumeOptions::default(), FieldTable::default()))
        .await
        .expect("basic.consume")
}

#[test]
fn a_queue_is_served_by_every_node() {
    run(async {
        let c = Cluster::start(3);
        let (n1, n2, n3) = (connect_uri(&c.amqp_uri(0)).await, connect_uri(&c.amqp_uri(1)).await, connect_uri(&c.amqp_uri(2)).await);
        let q = uniq("anywhere");
        durable_queue(&n1, &q).await;

        // Published on node 2 (routed there), stored on node 1, confirmed by node 1's queue.
        let p2 = confirming(&n2).await;
        publish_all(&p2, &q, "m", 3).await;
        assert_eq!(counts(&n3, &q).await.expect("declare-ok on node 3"), (3, 0), "node 3 reads node 1's counts");
        assert_eq!(counts(&n1, &q).await.unwrap(), (3, 0));

        // basic.get on node 3, manual ack.
        let g3 = channel(&n3).await;
        let got = t("basic.get", g3.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("a message");
        assert_eq!(got.delivery.data, b"m-0");
        t("basic.ack", got.delivery.ack(BasicAckOptions::default())).await.unwrap();

        // A consumer on node 2: nack(requeue) comes back redelivered, then ack.
        let c2 = channel(&n2).await;
        t("basic.qos", c2.basic_qos(10, BasicQosOptions::default())).await.unwrap();
        let mut sub = consumer(&c2, &q, "on-node-2").await;
        let first = next_delivery(&mut sub, Duration::from_secs(10)).await;
        assert_eq!((first.data.as_slice(), first.redelivered), (&b"m-1"[..], false));
        let second = next_delivery(&mut sub, Duration::from_secs(10)).await;
        assert_eq!(second.data, b"m-2");
        t("basic.nack", first.nack(BasicNackOptions { requeue: true, ..Default::default() })).await.unwrap();
        let again = next_delivery(&mut sub, Duration::from_secs(10)).await;
        assert_eq!((again.data.as_slice(), again.redelivered), (&b"m-1"[..], true), "requeued in place, flagged");
        t("basic.ack", again.ack(BasicAckOptions::default())).await.unwrap();
        t("basic.ack", second.ack(BasicAckOptions::default())).await.unwrap();
        assert_eq!(counts(&n1, &q).await.unwrap(), (0, 1), "acked on node 2 = deleted on node 1; one consumer");

        // An unknown tag is still 406 on the client's own channel.
        let close = close_watch(&c2).await;
        let _ = c2.basic_ack(999, BasicAckOptions::default()).await;
        assert_eq!(close.code("ack of an unknown tag").await, 406);

        // Purge and delete from node 3.
        publish_all(&p2, &q, "p", 2).await;
        let ch3 = channel(&n3).await;
        let purged = t("queue.purge", ch3.queue_purge(q.as_str().into(), QueuePurgeOptions::default())).await.unwrap();
        assert_eq!(purged, 2);
        let deleted = t("queue.delete", ch3.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await.unwrap();
        assert_eq!(deleted, 0);
        assert_code(counts(&n1, &q).await, 404, "the queue deleted from node 3 is gone on node 1");

        // Dead-lettering across nodes: a queue on node 1 whose dead letters go to a queue that
        // lives on node 2, rejected by a consumer on node 3.
        let dlq = uniq("dead-letters");
        durable_queue(&n2, &dlq).await;
        let src = uniq("rejecting");
        let mut args = FieldTable::default();
        args.insert("x-dead-letter-exchange".into(), lapin::types::AMQPValue::LongString("".into()));
        args.insert("x-dead-letter-routing-key".into(), lapin::types::AMQPValue::LongString(dlq.as_str().into()));
        declare_queue(&channel(&n1).await, &src, QueueDeclareOptions::durable(), args).await;
        publish_all(&p2, &src, "d", 2).await;
        let r3 = channel(&n3).await;
        for _ in 0..2 {
            let got = t("basic.get", r3.basic_get(src.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("a message");
            t("basic.reject", got.delivery.reject(BasicRejectOptions { requeue: false })).await.unwrap();
        }
        let mut moved = (0, 0);
        for _ in 0..50 {
            moved = counts(&n1, &dlq).await.unwrap();
            if moved.0 == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(moved, (2, 0), "both rejected messages reached the dead-letter queue on node 2");
        assert_eq!(counts(&n3, &src).await.unwrap(), (0, 0), "and left their queue on node 1");
        let first = get_body(&channel(&n3).await, &dlq).await;
        assert_eq!(first.as_deref(), Some(&b"d-0"[..]));
    });
}

#[test]
fn a_killed_clients_node_gives_its_deliveries_back_at_once() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("orphans");
        durable_queue(&n1, &q).await;
        publish_all(&confirming(&n1).await, &q, "o", 5).await;

        // Node 3's consumer holds all five, unacked; then node 3 dies.
        let n3 = connect_uri(&c.amqp_uri(2)).await;
        let c3 = channel(&n3).await;
        let mut sub = consumer(&c3, &q, "doomed").await;
        for _ in 0..5 {
            next_delivery(&mut sub, Duration::from_secs(10)).await;
        }
        assert_eq!(counts(&n1, &q).await.unwrap(), (0, 1));
        c.kill9(2);

        // Node 1 learns it from the link, not from a timeout: all five are ready again.
        let mut ready = (0, 0);
        for _ in 0..100 {
            ready = counts(&n1, &q).await.unwrap();
            if ready == (5, 0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(ready, (5, 0), "within 10 s of the kill the dead node's deliveries are ready again");
        // A consumer on node 2 gets them, redelivered.
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let c2 = channel(&n2).await;
        let mut sub2 = consumer(&c2, &q, "heir").await;
        for i in 0..5 {
            let d = next_delivery(&mut sub2, Duration::from_secs(10)).await;
            assert!(d.redelivered, "message {i} came back without redelivered=true");
            assert_eq!(d.data, format!("o-{i}").into_bytes(), "original order");
            t("basic.ack", d.ack(BasicAckOptions::default())).await.unwrap();
        }
    });
}

#[test]
fn a_killed_queue_node_cancels_remote_consumers_and_nacks_publishes() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("homeless");
        durable_queue(&n1, &q).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let c2 = channel(&n2).await;
        let mut sub = consumer(&c2, &q, "watcher").await;
        let p2 = confirming(&n2).await;
        publish_all(&p2, &q, "h", 1).await;
        let d = next_delivery(&mut sub, Duration::from_secs(10)).await;
        t("basic.ack", d.ack(BasicAckOptions::default())).await.unwrap();
        // The ack is on its way to node 1 (a round trip on the channel, then a moment for the
        // forwarded settle): an ack not yet applied when a node is killed costs a redelivery,
        // which would make the count after the restart below 1, not 0.
        t("basic.qos", c2.basic_qos(0, BasicQosOptions::default())).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;

        c.kill9(0);
        // The consumer on node 2 is cancelled (basic.cancel: lapin ends the stream).
        let ended = tokio::time::timeout(Duration::from_secs(15), async {
            loop {
                match sub.next().await {
                    None => return true,
                    Some(Ok(_)) => continue,
                    Some(Err(_)) => return true,
                }
            }
        })
        .await;
        assert_eq!(ended, Ok(true), "the consumer of the dead node's queue was not cancelled within 15 s");
        // A publish to it is nacked, not left hanging.
        let confirm = publish_confirmed(&p2, "", &q, b"nowhere", persistent()).await;
        assert!(confirm.is_nack(), "a publish to a dead node's queue was confirmed: {confirm:?}");

        // Node 2 publishes on while node 1 restarts: every publish is answered (ack or nack,
        // never silence, also in the moment the lane is up and node 1 is still starting), and
        // acks come back once the queue is served again (by a survivor after failover, or by
        // node 1 back).
        let back = confirming(&n2).await;
        let queue = q.clone();
        let publisher = tokio::spawn(async move {
            let (mut acks, mut nacks) = (0, 0);
            for i in 0..3000 {
                let body = format!("r-{i}");
                if publish_confirmed(&back, "", &queue, body.as_bytes(), persistent()).await.is_ack() {
                    acks += 1;
                    if acks == 20 {
                        break;
                    }
                } else {
                    nacks += 1;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (acks, nacks)
        });
        c.start_node(0);
        let (acks, nacks) = publisher.await.expect("publisher task");
        eprintln!("publishes during the restart: {nacks} nacked, then {acks} acked");
        let ok = acks == 20;
        // Its queue is as it was, plus what was acked since (a nack means "not known to be
        // stored": one sent just before a link drops may be stored all the same).
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let (ready, _) = counts(&n1, &q).await.unwrap();
        assert!((20..=20 + nacks).contains(&ready), "{ready} ready after {acks} acks and {nacks} nacks");
        assert!(ok, "node 2 never served the restarted node's queue again");
    });
}

/// Issue 12 item 3 on a replicated queue: drop-head and reject-publish decided by the serving
/// member, the drops carried to every member through the queue's settle, so the member that
/// takes over after a kill -9 of the server holds only the kept messages and goes on
/// enforcing the limit.
#[test]
fn a_replicated_queue_keeps_its_length_limit_across_a_failover() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let limited = |overflow: &str| {
            let mut args = FieldTable::default();
            args.insert("x-max-length".into(), lapin::types::AMQPValue::LongLongInt(2));
            args.insert("x-overflow".into(), lapin::types::AMQPValue::LongString(overflow.into()));
            args
        };
        let (q, rq) = (uniq("maxlen-replicated"), uniq("reject-replicated"));
        declare_queue(&channel(&n1).await, &q, QueueDeclareOptions::durable(), limited("drop-head")).await;
        declare_queue(&channel(&n1).await, &rq, QueueDeclareOptions::durable(), limited("reject-publish")).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let p2 = confirming(&n2).await;
        publish_all(&p2, &q, "m", 5).await;
        assert_eq!(counts(&n2, &q).await.unwrap(), (2, 0), "drop-head on the replicated queue");
        publish_all(&p2, &rq, "r", 2).await;
        let refused = publish_confirmed(&p2, "", &rq, b"r-2", persistent()).await;
        assert!(refused.is_nack(), "reject-publish on the replicated queue: {refused:?}");
        assert_eq!(counts(&n2, &rq).await.unwrap(), (2, 0));

        // Let the settles reach the log, then kill the serving node.
        tokio::time::sleep(Duration::from_millis(500)).await;
        c.kill9(0);
        let deadline = std::time::Instant::now() + Duration::from_secs(40);
        let mut answered = None;
        while answered.is_none() && std::time::Instant::now() < deadline {
            let ch = channel(&n2).await;
            let opts = QueueDeclareOptions { passive: true, ..Default::default() };
            if let Ok(Ok(ok)) =
                tokio::time::timeout(Duration::from_secs(3), ch.queue_declare(q.as_str().into(), opts, FieldTable::default())).await
            {
                answered = Some(ok.message_count());
            } else {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        assert_eq!(answered, Some(2), "the new server holds only the kept messages");
        // The new server enforces the limit too.
        let p2 = confirming(&n2).await;
        publish_all(&p2, &q, "n", 1).await;
        assert_eq!(counts(&n2, &q).await.unwrap(), (2, 0));
        let ch = channel(&n2).await;
        assert_eq!(drain(&ch, &q, 10).await, [b"m-4".to_vec(), b"n-0".to_vec()]);
        let refused = publish_confirmed(&p2, "", &rq, b"r-3", persistent()).await;
        assert!(refused.is_nack(), "reject-publish after the failover: {refused:?}");
        assert_eq!(drain(&ch, &rq, 10).await, [b"r-0".to_vec(), b"r-1".to_vec()]);
    });
}

/// Issue 12's `delivery_limit` on a replicated quorum queue served by node 1, its client on
/// node 2: each nack(requeue) from node 2 is counted by the serving member, the redelivery
/// reaching node 2 carries `x-delivery-count`, and the return past the limit dead-letters the
/// message into a queue that node 3 reads.
#[test]
fn a_delivery_limit_counts_the_returns_of_a_client_on_another_node() {
    run(async {
        let c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let (q, dlq) = (uniq("poison-replicated"), uniq("poison-dlq"));
        durable_queue(&n1, &dlq).await;
        let mut args = FieldTable::default();
        for (k, v) in [("x-queue-type", "quorum"), ("x-dead-letter-exchange", ""), ("x-dead-letter-routing-key", dlq.as_str())] {
            args.insert(k.into(), lapin::types::AMQPValue::LongString(v.into()));
        }
        args.insert("x-delivery-limit".into(), lapin::types::AMQPValue::LongLongInt(1));
        declare_queue(&channel(&n1).await, &q, QueueDeclareOptions::durable(), args).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        publish_all(&confirming(&n2).await, &q, "p", 1).await;
        let g2 = channel(&n2).await;
        let mut counts_seen = Vec::new();
        for _ in 0..2 {
            let got = t("basic.get", g2.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("the message");
            let count = got.delivery.properties.headers().as_ref().and_then(|h| h.inner().get("x-delivery-count").cloned());
            counts_seen.push(count);
            t("basic.nack", got.delivery.nack(BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
        }
        assert_eq!(counts_seen, [None, Some(lapin::types::AMQPValue::LongLongInt(1))], "x-delivery-count as seen on node 2");
        let n3 = connect_uri(&c.amqp_uri(2)).await;
        let ch3 = channel(&n3).await;
        assert_eq!(wait_ready(&ch3, &dlq, 1, Duration::from_secs(10)).await, 1, "dead-lettered past the limit");
        assert_eq!(drain(&ch3, &dlq, 10).await, [b"p-0".to_vec()]);
        assert_eq!(counts(&n3, &q).await.unwrap(), (0, 0), "gone from the source queue");
    });
}

/// basic.get with manual ack on a fresh channel of `conn`, retried (bounded) while a failover
/// makes the queue unanswerable: (delivery, the channel to settle it on).
async fn get_when_served(conn: &Connection, queue: &str, limit: Duration) -> (lapin::message::BasicGetMessage, Channel) {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        let ch = channel(conn).await;
        let r = tokio::time::timeout(Duration::from_secs(3), ch.basic_get(queue.into(), BasicGetOptions::default())).await;
        if let Ok(Ok(Some(m))) = r {
            return (m, ch);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("no message from {queue} within {limit:?}");
}

/// The return counts of a replicated queue are in the metadata log (`Return`), stored by
/// every member of its set: when its server is killed with SIGKILL, the node that takes the
/// queue over counts on from them, and the limit holds across the failover.
#[test]
fn return_counts_survive_the_failover_of_a_replicated_queue() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let (q, dlq) = (uniq("poison-failover"), uniq("poison-failover-dlq"));
        durable_queue(&n1, &dlq).await;
        let mut args = FieldTable::default();
        for (k, v) in [("x-queue-type", "quorum"), ("x-dead-letter-exchange", ""), ("x-dead-letter-routing-key", dlq.as_str())] {
            args.insert(k.into(), lapin::types::AMQPValue::LongString(v.into()));
        }
        args.insert("x-delivery-limit".into(), lapin::types::AMQPValue::LongLongInt(2));
        declare_queue(&channel(&n1).await, &q, QueueDeclareOptions::durable(), args).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let p2 = confirming(&n2).await;
        publish_all(&p2, &q, "p", 1).await;
        let count_of = |m: &lapin::message::BasicGetMessage| {
            m.delivery.properties.headers().as_ref().and_then(|h| h.inner().get("x-delivery-count").cloned())
        };
        for returns in 0..2 {
            let (m, _ch) = get_when_served(&n2, &q, Duration::from_secs(10)).await;
            let want = (returns > 0).then_some(lapin::types::AMQPValue::LongLongInt(returns));
            assert_eq!(count_of(&m), want, "x-delivery-count before the kill");
            t("basic.nack", m.delivery.nack(BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
        }
        // A confirmed publish after the nacks: node 2 forwards both on one ordered link and the
        // server hands the counts to the log before this publish, so its confirm means they
        // are committed.
        publish_all(&p2, &q, "barrier", 1).await;
        c.kill9(0);
        let (m, _ch) = get_when_served(&n2, &q, Duration::from_secs(30)).await;
        assert_eq!(String::from_utf8_lossy(&m.delivery.data), "p-0");
        assert_eq!(count_of(&m), Some(lapin::types::AMQPValue::LongLongInt(2)), "the two returns, counted by the new server");
        t("basic.nack", m.delivery.nack(BasicNackOptions { multiple: false, requeue: true })).await.unwrap();
        let n3 = connect_uri(&c.amqp_uri(2)).await;
        let ch3 = channel(&n3).await;
        assert_eq!(wait_ready(&ch3, &dlq, 1, Duration::from_secs(10)).await, 1, "the third return is over the limit of 2");
        assert_eq!(drain(&ch3, &dlq, 10).await, [b"p-0".to_vec()]);
    });
}
