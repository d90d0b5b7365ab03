//! Any node serves any queue, as a user sees it: three real ringmq processes on loopback, a
//! queue declared on one node, clients on the others publishing, getting, consuming, acking,
//! nacking, purging and deleting; and what happens to a client's deliveries when the client's
//! node or the queue's node is killed with SIGKILL.
//!
//! The tests run one at a time (three brokers each on a 2-core machine); every wait is bounded.
//! Against an external broker (RINGMQ_TEST_BROKER) they are skipped.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

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
fn a_killed_queue_node_cancels_consumers_of_its_transient_queue_and_holds_publishes_to_its_replicated_one() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("homeless");
        durable_queue(&n1, &q).await;
        // A transient queue lives on node 1 alone: it has no other member to move to.
        let transient = uniq("transient");
        declare_queue(&channel(&n1).await, &transient, QueueDeclareOptions::default(), FieldTable::default()).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let c2 = channel(&n2).await;
        let mut sub = consumer(&c2, &transient, "watcher").await;
        let p2 = confirming(&n2).await;
        publish_all(&p2, &transient, "h", 1).await;
        let d = next_delivery(&mut sub, Duration::from_secs(10)).await;
        t("basic.ack", d.ack(BasicAckOptions::default())).await.unwrap();

        c.kill9(0);
        // The consumer on node 2 of the transient queue is cancelled (basic.cancel: lapin
        // ends the stream); one of a replicated queue would follow it (the test below).
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
        // A publish to the transient queue is nacked at once, not left hanging.
        let confirm = publish_confirmed(&p2, "", &transient, b"nowhere", persistent()).await;
        assert!(confirm.is_nack(), "a publish to a dead node's transient queue was confirmed: {confirm:?}");
        // One to the replicated queue waits for the failover and is confirmed (RabbitMQ's
        // quorum queues do the same across a leader election): never a nack while the
        // cluster has a majority, unlike before, when the dead node's queue nacked it until
        // the failover was done.
        let sent = Instant::now();
        let pc =
            t("basic.publish", p2.basic_publish("".into(), q.as_str().into(), Default::default(), b"held", persistent())).await.unwrap();
        let confirm = tt("confirm across the failover", Duration::from_secs(15), pc).await.expect("confirm");
        assert!(confirm.is_ack(), "a publish to a replicated queue whose node died was not confirmed after the failover: {confirm:?}");
        eprintln!("a publish held across the failover confirmed {} ms after it was sent", sent.elapsed().as_millis());

        // Node 2 publishes on while node 1 restarts: every publish is answered (ack or nack,
        // never silence, also in the moment the lane is up and node 1 is still starting).
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
        assert!((21..=21 + nacks).contains(&ready), "{ready} ready after {} acks and {nacks} nacks", acks + 1);
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

/// Invariant 6 of `broker::remote`: a publisher on node 2 goes on publishing, 20 publishes in
/// flight, through the kill -9 of node 1, which serves its replicated queue. What was in
/// flight to node 1 and what it publishes while the queue has no server waits on node 2 and
/// is confirmed once a survivor serves the queue: not one nack, and every confirmed message
/// comes out of the queue in publish order (a publish in flight at the kill may come twice:
/// node 1 may have stored it before it died).
#[test]
fn publishes_through_the_kill_of_the_queues_node_are_held_then_confirmed_in_order() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("through");
        durable_queue(&n1, &q).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let p2 = confirming(&n2).await;
        let (mut acked, mut nacked, mut killed_at, mut slowest) = (Vec::new(), Vec::new(), None, Duration::ZERO);
        let mut in_flight = std::collections::VecDeque::new();
        for i in 0..200_000u32 {
            if killed_at.is_none() && acked.len() >= 300 {
                c.kill9(0);
                killed_at = Some(Instant::now());
            }
            if killed_at.is_some_and(|k| k.elapsed() > Duration::from_secs(8)) {
                break;
            }
            let body = format!("m-{i}");
            let pc = t("basic.publish", p2.basic_publish("".into(), q.as_str().into(), Default::default(), body.as_bytes(), persistent()))
                .await
                .unwrap();
            in_flight.push_back((i, Instant::now(), pc));
            while in_flight.len() >= 20 {
                let (n, sent, pc) = in_flight.pop_front().unwrap();
                let confirm = tt("publisher confirm", Duration::from_secs(15), pc).await.expect("confirm");
                slowest = slowest.max(sent.elapsed());
                if confirm.is_ack() {
                    acked.push(n)
                } else {
                    nacked.push(n)
                }
            }
        }
        for (n, _, pc) in in_flight {
            let confirm = tt("publisher confirm", Duration::from_secs(15), pc).await.expect("confirm");
            if confirm.is_ack() {
                acked.push(n)
            } else {
                nacked.push(n)
            }
        }
        let few = &nacked[..nacked.len().min(10)];
        eprintln!("{} confirmed, {} nacked {few:?}, the slowest confirm took {} ms", acked.len(), nacked.len(), slowest.as_millis());
        assert!(killed_at.is_some(), "300 confirms never came before the kill");
        assert!(nacked.is_empty(), "{} publishes nacked while the queue failed over, e.g. {few:?}", nacked.len());
        assert!(slowest >= Duration::from_secs(1), "no publish waited for the failover ({slowest:?}): the test did not test it");

        // Every confirmed message is in the queue, in publish order, served by a survivor.
        let n3 = connect_uri(&c.amqp_uri(2)).await;
        let c3 = channel(&n3).await;
        let mut sub = consumer(&c3, &q, "order").await;
        let mut got: Vec<u32> = Vec::new();
        while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_secs(5), sub.next()).await {
            let body = String::from_utf8_lossy(&d.data).into_owned();
            got.push(body.trim_start_matches("m-").parse().expect("a body of this test"));
            t("basic.ack", d.ack(BasicAckOptions::default())).await.unwrap();
        }
        let mut first: Vec<u32> = Vec::new();
        let mut seen = BTreeSet::new();
        for &n in &got {
            if seen.insert(n) {
                first.push(n);
            }
        }
        let lost: Vec<&u32> = acked.iter().filter(|i| !seen.contains(i)).take(10).collect();
        assert!(lost.is_empty(), "confirmed messages lost: {lost:?} ({} received)", got.len());
        let twice = got.len() - first.len();
        eprintln!("{} delivered, {twice} of them a second copy", got.len());
        assert!(twice <= 20, "{twice} second copies: more than were in flight at the kill");
        assert!(first.windows(2).all(|w| w[0] < w[1]), "deliveries out of publish order: {:?}", &first[..first.len().min(50)]);
    });
}

/// Invariant 6 for consumers: manual-ack consumers on nodes 2 and 3 of a replicated queue
/// that node 1 serves are not cancelled when node 1 is killed with SIGKILL. The queue moves
/// to node 2 or 3, so one consumer follows it to its own node and the other to a peer; both
/// go on receiving, and every confirmed message arrives, the ones they held unacked at the
/// kill again with redelivered=true. RabbitMQ's quorum queue consumers live through a leader
/// change the same way.
#[test]
fn consumers_on_other_nodes_follow_their_queue_through_a_failover() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("follow");
        durable_queue(&n1, &q).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let p2 = confirming(&n2).await;
        let mut confirmed: BTreeSet<String> = publish_all(&p2, &q, "a", 50).await.into_iter().collect();
        let mut subs = Vec::new();
        let mut held = BTreeSet::new();
        for (i, conn) in [&n2, &connect_uri(&c.amqp_uri(2)).await].into_iter().enumerate() {
            let ch = channel(conn).await;
            t("basic.qos", ch.basic_qos(10, BasicQosOptions::default())).await.unwrap();
            let mut sub = consumer(&ch, &q, &format!("follower-{i}")).await;
            for _ in 0..10 {
                let d = next_delivery(&mut sub, Duration::from_secs(10)).await;
                held.insert(String::from_utf8_lossy(&d.data).into_owned());
            }
            subs.push((ch, sub, 0));
        }

        c.kill9(0);
        // Publishing on through the failover (held, then confirmed: the test above).
        confirmed.extend(publish_all(&p2, &q, "b", 50).await);
        let (mut got, mut redelivered) = (BTreeSet::new(), BTreeSet::new());
        let deadline = Instant::now() + Duration::from_secs(30);
        while !confirmed.is_subset(&got) && Instant::now() < deadline {
            for (i, (_, sub, after)) in subs.iter_mut().enumerate() {
                match tokio::time::timeout(Duration::from_millis(200), sub.next()).await {
                    Ok(Some(Ok(d))) => {
                        let body = String::from_utf8_lossy(&d.data).into_owned();
                        if d.redelivered {
                            redelivered.insert(body.clone());
                        }
                        got.insert(body);
                        *after += 1;
                        t("basic.ack", d.ack(BasicAckOptions::default())).await.unwrap();
                    }
                    Ok(None) | Ok(Some(Err(_))) => panic!("consumer {i} was cancelled by the failover ({} received)", got.len()),
                    Err(_) => {}
                }
            }
        }
        let missing: Vec<&String> = confirmed.difference(&got).take(10).collect();
        assert!(missing.is_empty(), "not delivered after the failover: {missing:?} ({} received)", got.len());
        let unflagged: Vec<&String> = held.iter().filter(|b| !redelivered.contains(*b)).collect();
        assert!(unflagged.is_empty(), "held at the kill but not redelivered=true after it: {unflagged:?}");
        for (i, (ch, _, after)) in subs.iter().enumerate() {
            eprintln!("consumer {i} (node {}) received {after} after the kill", i + 2);
            assert!(*after > 0, "consumer {i} received nothing after the failover");
            assert!(ch.status().connected(), "consumer {i}'s channel was closed");
        }
    });
}
