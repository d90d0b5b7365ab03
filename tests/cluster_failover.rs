//! Replicated queues and failover, as a user sees them: three real ringmq processes on
//! loopback; a durable queue's node is killed with SIGKILL under a publisher and a
//! consumer on other nodes; a survivor serves the queue with every confirmed message, the
//! restarted node catches up, and a second failover (to any node, the restarted one
//! included) still has every message.
//!
//! With five nodes and `--replicas 3`, a queue is stored on three of them, and fails over
//! only to one of those.
//!
//! The tests run one at a time (three brokers each on a 2-core machine); every wait is bounded.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::cluster::{channel, confirming, drain_distinct, durable_queue, persistent, publish_all, run, Cluster};
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

/// Publishes `body` until it is confirmed (a nack, an error, or a closed channel: again, on a
/// fresh channel when needed), at most until `limit`; returns when it was confirmed.
async fn publish_until_confirmed(conn: &Connection, ch: &mut Channel, queue: &str, body: &str, limit: Instant) -> Option<Instant> {
    while Instant::now() < limit {
        if !ch.status().connected() {
            *ch = confirming(conn).await;
        }
        let sent = ch.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), body.as_bytes(), persistent()).await;
        if let Ok(pc) = sent {
            if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(15), pc).await {
                if c.is_ack() {
                    return Some(Instant::now());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Node index (0-based) serving `queue`: the one whose log says it took the queue over, else
/// `default`.
fn serving_node(c: &Cluster, queue: &str, default: usize) -> usize {
    (0..c.len()).rev().find(|&i| c.log(i).lines().any(|l| l.contains("queue leader moved here") && l.contains(queue))).unwrap_or(default)
}

#[test]
fn a_killed_queue_node_fails_over_with_every_confirmed_message() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("replicated");
        durable_queue(&n1, &q).await;

        // 100 confirmed messages from node 2 to node 1's queue.
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let mut pub2 = confirming(&n2).await;
        let mut confirmed: BTreeSet<String> = publish_all(&pub2, &q, "a", 100).await.into_iter().collect();
        // A consumer on node 3 takes 30 and acks 10 of them; 20 stay delivered, unacked.
        let n3 = connect_uri(&c.amqp_uri(2)).await;
        let c3 = channel(&n3).await;
        t("basic.qos", c3.basic_qos(30, BasicQosOptions::default())).await.unwrap();
        let mut sub =
            t("basic.consume", c3.basic_consume(q.as_str().into(), "held".into(), BasicConsumeOptions::default(), FieldTable::default()))
                .await
                .unwrap();
        let (mut acked, mut held) = (BTreeSet::new(), BTreeSet::new());
        for i in 0..30 {
            let d = next_delivery(&mut sub, Duration::from_secs(10)).await;
            if i >= 10 {
                held.insert(String::from_utf8_lossy(&d.data).into_owned());
            } else {
                acked.insert(String::from_utf8_lossy(&d.data).into_owned());
                t("basic.ack", d.ack(BasicAckOptions::default())).await.unwrap();
            }
        }
        // Let the acks reach the log: an ack lost with the node is a redelivery, allowed, which
        // would blur the check of what comes back.
        tokio::time::sleep(Duration::from_millis(500)).await;

        let killed = Instant::now();
        c.kill9(0);
        // A publisher on node 2 gets confirms again within 10 s of the kill.
        let first = publish_until_confirmed(&n2, &mut pub2, &q, "b-0", killed + Duration::from_secs(20)).await;
        let first = first.expect("no confirm within 20 s of killing the queue's node");
        let after = first.duration_since(killed);
        eprintln!("first confirm {} ms after the kill", after.as_millis());
        assert!(after < Duration::from_secs(10), "first confirm {after:?} after the kill");
        confirmed.insert("b-0".into());
        for i in 1..50 {
            let body = format!("b-{i}");
            let ok = publish_until_confirmed(&n2, &mut pub2, &q, &body, Instant::now() + Duration::from_secs(15)).await;
            assert!(ok.is_some(), "publish {body} to the moved queue never confirmed");
            confirmed.insert(body);
        }

        // Node 1 comes back and catches up; publishes through it reach the new server.
        c.start_node(0);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let mut pub1 = confirming(&n1).await;
        for i in 0..50 {
            let body = format!("c-{i}");
            let ok = publish_until_confirmed(&n1, &mut pub1, &q, &body, Instant::now() + Duration::from_secs(15)).await;
            assert!(ok.is_some(), "publish {body} through the restarted node never confirmed");
            confirmed.insert(body);
        }

        // Second failover: kill whichever node serves the queue now (never node 1, which was
        // down when the queue moved).
        let server = serving_node(&c, &q, 1);
        assert_ne!(server, 0, "the queue moved to the node that was killed");
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.kill9(server);
        let survivor = (0..3).find(|&i| i != server && i != 0).unwrap();
        let conn = connect_uri(&c.amqp_uri(survivor)).await;
        let mut p = confirming(&conn).await;
        let ok = publish_until_confirmed(&conn, &mut p, &q, "d-0", Instant::now() + Duration::from_secs(20)).await;
        assert!(ok.is_some(), "no confirm within 20 s of the second kill");
        confirmed.insert("d-0".into());

        // The consumer on node 3 followed the queue through the failovers (unless node 3 went
        // down with it), holding up to 30 deliveries unread: closing its channel gives them
        // back. Every confirmed message not acked is there, on a survivor; the 20 delivered
        // before the first kill come back flagged.
        drop(sub);
        let _ = tokio::time::timeout(Duration::from_secs(10), c3.close(200, "done".into())).await;
        let want: BTreeSet<String> = confirmed.difference(&acked).cloned().collect();
        let (got, redelivered) = drain_distinct(&conn, &q, want.len(), Duration::from_secs(60)).await;
        let lost: Vec<&String> = want.difference(&got).take(10).collect();
        assert!(lost.is_empty(), "{} confirmed messages lost, e.g. {lost:?}", want.difference(&got).count());
        let unflagged: Vec<&String> = held.iter().filter(|b| !redelivered.contains(*b)).collect();
        assert!(unflagged.is_empty(), "delivered before the kill but not redelivered=true after it: {unflagged:?}");
    });
}

/// A consumer on `conn` with prefetch `n` takes `n` deliveries of `queue` and acks none of
/// them (each must be a first delivery); returns the consumer, its channel and the bodies.
async fn take_burst(conn: &Connection, queue: &str, n: u16) -> (lapin::Consumer, Channel, BTreeSet<String>) {
    let ch = channel(conn).await;
    t("basic.qos", ch.basic_qos(n, BasicQosOptions::default())).await.unwrap();
    let mut sub = t("basic.consume", ch.basic_consume(queue.into(), "burst".into(), BasicConsumeOptions::default(), FieldTable::default()))
        .await
        .unwrap();
    let mut held = BTreeSet::new();
    while held.len() < usize::from(n) {
        let d = next_delivery(&mut sub, Duration::from_secs(10)).await;
        assert!(!d.redelivered, "first delivery flagged redelivered");
        held.insert(String::from_utf8_lossy(&d.data).into_owned());
    }
    (sub, ch, held)
}

/// Asserts that every confirmed body came back (`got`) and that each one `held` before the
/// kill came back redelivered=true.
fn assert_kept_and_flagged(confirmed: &BTreeSet<String>, got: &BTreeSet<String>, held: &BTreeSet<String>, redelivered: &BTreeSet<String>) {
    let lost: Vec<&String> = confirmed.difference(got).take(10).collect();
    assert!(lost.is_empty(), "{} confirmed messages lost, e.g. {lost:?}", confirmed.difference(got).count());
    let unflagged: Vec<&String> = held.iter().filter(|b| !redelivered.contains(*b)).collect();
    assert!(
        unflagged.is_empty(),
        "{} handed out before the kill but not redelivered=true after it, e.g. {:?}",
        unflagged.len(),
        &unflagged[..unflagged.len().min(5)]
    );
}

/// The rule 4 to the letter: the messages a server handed out in its last
/// milliseconds, with no cursor commit after them, come again redelivered=true from the node
/// that takes the queue over (the delivery reservation, `queue/replica.rs` step 5).
#[test]
fn what_a_killed_server_handed_out_last_comes_again_flagged() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("last-ms");
        durable_queue(&n1, &q).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let confirmed: BTreeSet<String> = publish_all(&confirming(&n2).await, &q, "m", 300).await.into_iter().collect();

        // A consumer on node 3 takes 200 in one burst; node 1 (the server) dies the moment
        // the 200th arrives: far sooner than a cursor commit (every 20 ms at most) follows.
        let n3 = connect_uri(&c.amqp_uri(2)).await;
        let (sub, ch, held) = take_burst(&n3, &q, 200).await;
        c.kill9(0);
        // That consumer would follow the queue to its next server and take its 200 again:
        // its channel closes, so that the drain below gets them.
        drop(sub);
        t("channel.close", ch.close(200, "done".into())).await.unwrap();

        // Every message is there on a survivor, and each of the 200 comes back flagged.
        let (got, redelivered) = drain_distinct(&n2, &q, confirmed.len(), Duration::from_secs(60)).await;
        assert_kept_and_flagged(&confirmed, &got, &held, &redelivered);
        eprintln!("flagged {} of 300 ({} handed out before the kill)", redelivered.len(), held.len());
    });
}

/// A consumer whose channel closed while its queue's server was frozen (the close unread
/// there) is gone for good: when that server is then killed, the consumer does not follow the
/// queue to its next server, where it would take messages for a channel that no longer exists
/// (they would sit unacked as long as its connection lives). Every message is drained from the
/// next server, the 50 it held flagged, with that connection still open.
#[test]
fn a_consumer_closed_while_its_server_was_frozen_does_not_follow_the_queue() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("closed-frozen");
        durable_queue(&n1, &q).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let confirmed: BTreeSet<String> = publish_all(&confirming(&n2).await, &q, "m", 300).await.into_iter().collect();
        let n3 = connect_uri(&c.amqp_uri(2)).await;
        let (sub, ch, held) = take_burst(&n3, &q, 50).await;
        let pid = c.pid(0).expect("node 1 runs") as libc::pid_t;
        // SAFETY: signals a child process this test's harness started (by its PID).
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        drop(sub);
        t("channel.close while the server is frozen", ch.close(200, "done".into())).await.expect("close");
        c.kill9(0);
        let (got, redelivered) = drain_distinct(&n2, &q, confirmed.len(), Duration::from_secs(60)).await;
        assert_kept_and_flagged(&confirmed, &got, &held, &redelivered);
        assert!(!c.log(2).contains("a consumer of a moved queue follows it"), "a closed channel's consumer followed the queue");
        drop(n3);
    });
}

/// A replicated queue keeps no unacked index (its delivery reservation stands in for it,
/// `queue/replica.rs` step 5): when the whole cluster is killed with SIGKILL the moment a
/// consumer got 150 messages, and started again, no node took the queue over, and its own
/// server flags those 150 from its reservation (capped at the queue's tail: what is published
/// after the restart is not flagged); every confirmed message is still there.
#[test]
fn a_whole_cluster_killed_mid_delivery_flags_what_its_server_handed_out() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("whole-kill");
        durable_queue(&n1, &q).await;
        let confirmed: BTreeSet<String> = publish_all(&confirming(&n1).await, &q, "m", 250).await.into_iter().collect();
        // Declared through node 1: node 1 serves it.
        let server = 0;
        let conn = connect_uri(&c.amqp_uri(server)).await;
        let (sub, ch, held) = take_burst(&conn, &q, 150).await;
        for i in 0..3 {
            c.kill9(i);
        }
        drop((sub, ch, conn, n1));
        c.start_all_again();
        c.wait_one_leader(Duration::from_secs(30));
        assert_eq!(serving_node(&c, &q, server), server, "the queue moved while every node was down");

        let again = connect_uri(&c.amqp_uri(server)).await;
        // Published after the restart: never handed out before, so never flagged.
        let fresh = publish_all(&confirming(&again).await, &q, "n", 50).await;
        let (got, redelivered) = drain_distinct(&again, &q, confirmed.len() + fresh.len(), Duration::from_secs(60)).await;
        let flagged_fresh: Vec<&String> = fresh.iter().filter(|b| redelivered.contains(*b)).collect();
        assert!(flagged_fresh.is_empty(), "published after the restart yet redelivered=true: {flagged_fresh:?}");
        assert_kept_and_flagged(&confirmed, &got, &held, &redelivered);
        eprintln!("flagged {} of 250 ({} handed out before the kill)", redelivered.len(), held.len());
    });
}

#[test]
fn a_node_cut_off_from_the_majority_confirms_and_delivers_nothing() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("alone");
        durable_queue(&n1, &q).await;
        let p1 = confirming(&n1).await;
        publish_all(&p1, &q, "m", 5).await;
        c.kill9(1);
        c.kill9(2);
        // Node 1 alone learns within an election timeout that it has no leader.
        let deadline = Instant::now() + Duration::from_secs(15);
        while c.metric(0, "ringmq_raft_leader_id", None) != Some(0.0) {
            assert!(Instant::now() < deadline, "node 1 alone still names a metadata leader after 15 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // It delivers nothing of its queue...
        let ch = channel(&n1).await;
        let mut sub =
            t("basic.consume", ch.basic_consume(q.as_str().into(), "alone".into(), BasicConsumeOptions::default(), FieldTable::default()))
                .await
                .expect("basic.consume on the cut-off node");
        assert_no_delivery(&mut sub, Duration::from_secs(3), "a node without a majority delivered a replicated queue's message").await;
        // ...and confirms nothing: the publish is nacked (or its channel fails), never acked.
        let sent = p1.basic_publish("".into(), q.as_str().into(), BasicPublishOptions::default(), b"lonely", persistent()).await;
        if let Ok(pc) = sent {
            match tokio::time::timeout(Duration::from_secs(30), pc).await {
                Ok(Ok(conf)) => assert!(!conf.is_ack(), "a node without a majority confirmed a publish"),
                Ok(Err(_)) => {}
                Err(_) => panic!("a publish on a node without a majority was neither acked nor nacked within 30 s"),
            }
        }
        // With a majority again it delivers what it held.
        c.start_node(1);
        let d = next_delivery(&mut sub, Duration::from_secs(30)).await;
        assert_eq!(d.data, b"m-0", "the first message, once a majority is back");
    });
}

/// `<data>/queues/<hex(vhost)>.<hex(name)>`, where a node keeps a durable queue's store.
fn queue_dir(data: &std::path::Path, vhost: &str, name: &str) -> std::path::PathBuf {
    let hex = |s: &str| s.bytes().map(|b| format!("{b:02x}")).collect::<String>();
    data.join("queues").join(format!("{}.{}", hex(vhost), hex(name)))
}

#[test]
fn every_node_stores_a_durable_queue_and_drops_it_with_the_queue() {
    run(async {
        let c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("copies");
        durable_queue(&n1, &q).await;
        let p1 = confirming(&n1).await;
        publish_all(&p1, &q, "m", 3).await;
        let dirs: Vec<_> = (0..3).map(|i| queue_dir(&c.data_dir(i), "/", &q)).collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !dirs.iter().all(|d| d.exists()) {
            assert!(Instant::now() < deadline, "not every node holds a copy of the durable queue: {dirs:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Deleted through node 2: every copy goes.
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let deleted = t("queue.delete", channel(&n2).await.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await.unwrap();
        assert_eq!(deleted, 3);
        let deadline = Instant::now() + Duration::from_secs(10);
        while dirs.iter().any(|d| d.exists()) {
            assert!(
                Instant::now() < deadline,
                "a deleted queue's copy stayed on disk: {:?}",
                dirs.iter().filter(|d| d.exists()).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

#[test]
fn a_frozen_queue_node_fails_over_too() {
    run(async {
        let c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("frozen");
        durable_queue(&n1, &q).await;
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let mut pub2 = confirming(&n2).await;
        let mut confirmed: BTreeSet<String> = publish_all(&pub2, &q, "f", 20).await.into_iter().collect();
        // SIGSTOP: the process is alive and its kernel still answers TCP, but it says nothing.
        let pid = c.pid(0).expect("node 1 runs") as libc::pid_t;
        // SAFETY: signals a child process this test's harness started (by its PID).
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        let frozen = Instant::now();
        let first = publish_until_confirmed(&n2, &mut pub2, &q, "g-0", frozen + Duration::from_secs(40)).await;
        // SAFETY: as above; the harness kills it with SIGKILL on drop either way.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        let first = first.expect("no confirm within 40 s of freezing the queue's node");
        eprintln!("first confirm {} ms after the freeze", first.duration_since(frozen).as_millis());
        assert!(
            first.duration_since(frozen) < Duration::from_secs(15),
            "first confirm {:?} after the freeze",
            first.duration_since(frozen)
        );
        confirmed.insert("g-0".into());
        let n3 = connect_uri(&c.amqp_uri(2)).await;
        let (got, _) = drain_distinct(&n3, &q, confirmed.len(), Duration::from_secs(30)).await;
        let lost: Vec<&String> = confirmed.difference(&got).collect();
        assert!(lost.is_empty(), "confirmed messages lost after the freeze: {lost:?}");
    });
}

/// Indexes (0-based) of the nodes holding a store of durable queue `q`.
fn stores_of(c: &Cluster, q: &str) -> Vec<usize> {
    (0..c.len()).filter(|&i| queue_dir(&c.data_dir(i), "/", q).exists()).collect()
}

/// Waits (bounded by 15 s) until `want` nodes hold a store of `q`, then 1 s more to see no
/// other node make one; returns them.
async fn settled_stores(c: &Cluster, q: &str, want: usize) -> Vec<usize> {
    let deadline = Instant::now() + Duration::from_secs(15);
    while stores_of(c, q).len() < want {
        assert!(Instant::now() < deadline, "queue {q} is stored on {:?}, not on {want} nodes", stores_of(c, q));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stores = stores_of(c, q);
    assert_eq!(stores.len(), want, "queue {q} is stored on {stores:?}");
    stores
}

#[test]
fn with_five_nodes_a_queue_lives_on_its_replica_set_and_fails_over_inside_it() {
    run(async {
        let mut c = Cluster::start_with_args(5, &["--replicas", "3"]);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("three-of-five");
        durable_queue(&n1, &q).await;
        // Published through a node that may or may not store it; every message confirmed.
        let n5 = connect_uri(&c.amqp_uri(4)).await;
        let mut pub5 = confirming(&n5).await;
        let mut confirmed: BTreeSet<String> = publish_all(&pub5, &q, "a", 200).await.into_iter().collect();
        let stores = settled_stores(&c, &q, 3).await;
        assert!(stores.contains(&0), "the declaring node does not store its queue: {stores:?}");

        // The argument overrides the flag; a bad value is refused the way RabbitMQ does.
        let single = uniq("one-of-five");
        let mut args = FieldTable::default();
        args.insert("x-quorum-initial-group-size".into(), lapin::types::AMQPValue::LongInt(1));
        let ch = channel(&n5).await;
        t("queue.declare", ch.queue_declare(single.as_str().into(), QueueDeclareOptions::durable(), args)).await.unwrap();
        publish_all(&pub5, &single, "s", 5).await;
        assert_eq!(settled_stores(&c, &single, 1).await, vec![4], "x-quorum-initial-group-size=1 on node 5");
        let mut bad = FieldTable::default();
        bad.insert("x-quorum-initial-group-size".into(), lapin::types::AMQPValue::LongInt(0));
        let refused = channel(&n5).await.queue_declare(uniq("zero").as_str().into(), QueueDeclareOptions::durable(), bad).await;
        assert_code(refused, 406, "x-quorum-initial-group-size=0");

        // Kill the queue's node: it moves to another node of its set, with every message.
        c.kill9(0);
        let killed = Instant::now();
        let first = publish_until_confirmed(&n5, &mut pub5, &q, "b-0", killed + Duration::from_secs(20)).await;
        let after = first.expect("no confirm within 20 s of killing the queue's node").duration_since(killed);
        eprintln!("first confirm {} ms after the kill", after.as_millis());
        assert!(after < Duration::from_secs(10), "first confirm {after:?} after the kill");
        confirmed.insert("b-0".into());
        let server = serving_node(&c, &q, 0);
        assert!(server != 0 && stores.contains(&server), "the queue moved to node {} outside its replica set {stores:?}", server + 1);
        assert_eq!(stores_of(&c, &q), stores, "a node outside the replica set made a store of the queue");

        // Drained through a node outside the set (forwarded to the server): nothing lost.
        let outside = (1..5).find(|i| !stores.contains(i)).expect("two nodes are outside a set of three");
        let conn = connect_uri(&c.amqp_uri(outside)).await;
        let (got, _) = drain_distinct(&conn, &q, confirmed.len(), Duration::from_secs(60)).await;
        let lost: Vec<&String> = confirmed.difference(&got).take(10).collect();
        assert!(lost.is_empty(), "{} confirmed messages lost, e.g. {lost:?}", confirmed.difference(&got).count());
    });
}

#[test]
fn a_node_joins_a_running_cluster_and_a_dead_one_is_forgotten() {
    run(async {
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let old = uniq("before-join");
        durable_queue(&n1, &old).await;
        publish_all(&confirming(&n1).await, &old, "a", 20).await;

        // Node 4 joins with --join (its --peers: the three and itself; theirs unchanged).
        let four = c.add_node(&["--join"]);
        c.wait_members(&[0, 1, 2, four], 4.0).await;
        assert!(c.log(four).contains("added to the cluster"), "node 4's log does not say it was added");
        let n4 = connect_uri(&c.amqp_uri(four)).await;
        // It serves the queue declared before it came (forwarded to its node)...
        let opts = QueueDeclareOptions { passive: true, ..Default::default() };
        let q =
            t("passive queue.declare", channel(&n4).await.queue_declare(old.as_str().into(), opts, FieldTable::default())).await.unwrap();
        assert_eq!(q.message_count(), 20);
        // ...and stores a queue of four replicas declared on it.
        let new = uniq("after-join");
        let mut args = FieldTable::default();
        args.insert("x-quorum-initial-group-size".into(), lapin::types::AMQPValue::LongInt(4));
        t("queue.declare", channel(&n4).await.queue_declare(new.as_str().into(), QueueDeclareOptions::durable(), args)).await.unwrap();
        let mut p4 = confirming(&n4).await;
        publish_all(&p4, &new, "b", 10).await;
        assert_eq!(settled_stores(&c, &new, 4).await, vec![0, 1, 2, four]);

        // Node 3 dies for good and is forgotten with the one-shot --forget-node.
        c.kill9(2);
        let out = std::process::Command::new(broker_binary())
            .args(["--forget-node", "3", "--peers", &c.all_peers()])
            .output()
            .expect("run ringmq --forget-node");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "--forget-node 3 failed: {stdout} {}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("node 3 is no longer a member"), "{stdout}");
        c.wait_members(&[0, 1, four], 3.0).await;
        // The others stop dialing it: it leaves their peer list.
        for i in [0, 1, four] {
            assert_eq!(c.metric(i, "ringmq_cluster_peer_up", Some(("peer", "3"))), None, "node {} still lists the forgotten node 3", i + 1);
        }
        // Started again on its old data dir, node 3 learns from the others that it is no
        // member and refuses at once (not after the 5-minute start timeout).
        c.spawn(2);
        let deadline = Instant::now() + Duration::from_secs(45);
        while c.is_running(2) {
            assert!(Instant::now() < deadline, "the forgotten node 3 still runs 45 s after its start");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(c.log(2).contains("node 3 is not a member of the cluster"), "node 3's log does not say why it stopped");
        eprintln!("the forgotten node refused {} ms after its start", (Instant::now() + Duration::from_secs(45) - deadline).as_millis());

        // Three voters now: with node 2 gone as well, nodes 1 and 4 are a majority and confirm.
        c.kill9(1);
        for (queue, body) in [(&new, "c-new"), (&old, "c-old")] {
            let ok = publish_until_confirmed(&n4, &mut p4, queue, body, Instant::now() + Duration::from_secs(30)).await;
            assert!(ok.is_some(), "no confirm for {queue} with nodes 1 and 4 of the three voters left");
        }
        let (got, _) = drain_distinct(&n4, &new, 11, Duration::from_secs(30)).await;
        assert_eq!(got.len(), 11, "the four-replica queue lost messages: {got:?}");
    });
}

/// The body of message `i` of the grow test: its number, then padding to about 4 KiB, so the
/// copy takes several batches (1 MiB each).
fn grow_body(i: usize) -> String {
    format!("grow-{i}|{}", "x".repeat(4000))
}

/// The number in a body made by [`grow_body`].
fn grow_number(body: &str) -> usize {
    body.trim_start_matches("grow-").split('|').next().and_then(|n| n.parse().ok()).expect("a grow test body")
}

/// Publishes the bodies of `range` ([`grow_body`]) to `queue`, `window` at a time in flight,
/// asserting each is confirmed.
async fn publish_grow_bodies(ch: &Channel, queue: &str, range: std::ops::Range<usize>, window: usize, confirm_limit: Duration) {
    for chunk in range.collect::<Vec<_>>().chunks(window) {
        let mut pending = Vec::new();
        for &i in chunk {
            let body = grow_body(i);
            let sent = ch.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), body.as_bytes(), persistent());
            pending.push(t("basic.publish", sent).await.expect("publish"));
        }
        for pc in pending {
            assert!(tt("confirm", confirm_limit, pc).await.expect("confirm").is_ack(), "a publish was not confirmed");
        }
    }
}

/// Consumes `n` messages of `queue` on `ch` (prefetch 100), acking each, then closes the
/// channel (its close-ok follows the acks); returns their numbers ([`grow_number`]).
async fn consume_and_ack(ch: Channel, queue: &str, n: usize) -> BTreeSet<usize> {
    t("basic.qos", ch.basic_qos(100, BasicQosOptions::default())).await.expect("qos");
    let mut sub =
        t("basic.consume", ch.basic_consume(queue.into(), "grow-acker".into(), BasicConsumeOptions::default(), FieldTable::default()))
            .await
            .expect("consume");
    let mut acked = BTreeSet::new();
    while acked.len() < n {
        // The joining node is killed and restarted meanwhile (an election if it led the
        // metadata group, a slow two-core machine): deliveries may pause as long as confirms.
        let d = tt("a delivery", Duration::from_secs(60), sub.next()).await.expect("a delivery").expect("a delivery, not an error");
        t("basic.ack", d.ack(BasicAckOptions::default())).await.expect("ack");
        acked.insert(grow_number(&String::from_utf8_lossy(&d.data)));
    }
    t("channel.close", ch.close(200, "done".into())).await.expect("close");
    acked
}

/// The node a queue's server copied it to, from its log line (1-based id), once it appears
/// (bounded by 30 s).
async fn copy_target(c: &Cluster, server: usize, queue: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = c.log(server);
        let line = log.lines().find(|l| l.contains("copying the queue to a node joining its replica set") && l.contains(queue));
        if let Some(node) =
            line.and_then(|l| l.split("node=").nth(1)).and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok())
        {
            return node;
        }
        assert!(Instant::now() < deadline, "node {} never started copying {queue}", server + 1);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn a_replica_set_grows_back_after_a_node_is_forgotten_and_the_copy_survives_kill_9() {
    run(async {
        // Four nodes, two replicas per queue: the queue lives on node 1 (its server) and one other.
        let mut c = Cluster::start_with_args(4, &["--replicas", "2"]);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let q = uniq("grow");
        durable_queue(&n1, &q).await;

        // A backlog of 10,000 messages of 4 KiB, confirmed.
        const N: usize = 10_000;
        const MORE: usize = 2_000;
        let pub1 = confirming(&n1).await;
        publish_grow_bodies(&pub1, &q, 0..N, 500, STEP_TIMEOUT).await;
        let first = settled_stores(&c, &q, 2).await;
        let other = *first.iter().find(|&&i| i != 0).expect("a second replica");
        // Gaps in the offsets: of the first 600, the even ones are acked, the odd ones go back.
        let getter = channel(&n1).await;
        let mut taken = Vec::new();
        for _ in 0..600 {
            let m = t("basic.get", getter.basic_get(q.as_str().into(), BasicGetOptions::default()))
                .await
                .expect("basic.get")
                .expect("a message");
            taken.push((grow_number(&String::from_utf8_lossy(&m.delivery.data)), m.delivery.delivery_tag));
        }
        for &(n, tag) in &taken {
            let done = if n % 2 == 0 {
                getter.basic_ack(tag, BasicAckOptions::default()).await
            } else {
                getter.basic_nack(tag, BasicNackOptions { requeue: true, ..Default::default() }).await
            };
            done.expect("settle");
        }
        t("channel.close", getter.close(200, "done".into())).await.expect("close");

        // The second replica dies for good and is forgotten: the set is node 1 alone, below
        // its size, and the leader grows it to one of the two other nodes.
        c.kill9(other);
        let gone = c.node_id(other).to_string();
        let out = std::process::Command::new(broker_binary())
            .args(["--forget-node", &gone, "--peers", &c.all_peers()])
            .output()
            .expect("run ringmq --forget-node");
        assert!(out.status.success(), "--forget-node failed: {}", String::from_utf8_lossy(&out.stderr));
        // Publishing and consuming go on while the queue is copied: the copy chases the tail,
        // and acks race it (settles of offsets the copy has not reached yet).
        let publisher = {
            let (pub1, q) = (pub1.clone(), q.clone());
            // A node killed once it joined is one of the two replicas that must both store a
            // message before it is confirmed: confirms wait for its restart (as long as the
            // join may take below).
            tokio::spawn(async move { publish_grow_bodies(&pub1, &q, N..N + MORE, 20, Duration::from_secs(60)).await })
        };
        let consumer = {
            let (ch, q) = (channel(&n1).await, q.clone());
            tokio::spawn(async move { consume_and_ack(ch, &q, 2_000).await })
        };
        let target = copy_target(&c, 0, &q).await;
        let ti = (target - 1) as usize;
        // kill -9 the receiving node as the copy runs, and start it again.
        c.kill9(ti);
        let mid_copy = !c.log(ti).contains("joined the queue's replica set with a complete copy");
        eprintln!("node {target} killed {} the copy", if mid_copy { "during" } else { "after" });
        c.start_node(ti);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !c.log(0).contains("queue replica set grown") || !c.log(ti).contains("joined the queue's replica set") {
            assert!(Instant::now() < deadline, "node {target} never joined the replica set of {q}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        t("the publisher during the copy", publisher).await.expect("publisher task");
        let consumed = t("the consumer during the copy", consumer).await.expect("consumer task");
        for (name, want) in
            [("ringmq_cluster_replica_grows", 0.0), ("ringmq_cluster_queues_below_replicas", 0.0), ("ringmq_cluster_members", 3.0)]
        {
            assert_eq!(c.metric(0, name, None), Some(want), "{name} on node 1 after the grow");
        }
        eprintln!("{}", c.log(0).lines().find(|l| l.contains("queue replica set grown")).unwrap_or_default());
        // (The acks' settles are proposed as the acks arrive: a second is ample to commit them.)
        tokio::time::sleep(Duration::from_secs(1)).await;
        // The server dies: the queue's only other replica is the grown one, which serves it
        // with every message that was confirmed and not acked, and none that was acked.
        c.kill9(0);
        let survivor = (0..4).find(|&i| i != 0 && i != other && i != ti).expect("a third live node");
        let conn = connect_uri(&c.amqp_uri(survivor)).await;
        let want: BTreeSet<usize> = (0..N + MORE).filter(|&i| (i >= 600 || i % 2 == 1) && !consumed.contains(&i)).collect();
        let (got, _) = drain_distinct(&conn, &q, want.len(), Duration::from_secs(90)).await;
        let numbers: BTreeSet<usize> = got.iter().map(|b| grow_number(b)).collect();
        let missing: Vec<usize> = want.difference(&numbers).copied().take(10).collect();
        let acked: Vec<usize> = numbers.difference(&want).copied().take(10).collect();
        assert!(
            missing.is_empty() && acked.is_empty(),
            "grown copy: {} messages, missing {missing:?}…, acked ones back {acked:?}…",
            numbers.len()
        );
        assert!(c.log(ti).contains("queue leader moved here"), "node {target} did not take the queue over");
    });
}
