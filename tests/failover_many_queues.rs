//! Many replicated queues change server in one failover pass (issue 40 item 1): the new
//! server reopens its copies one after another, and an operation for a later queue that
//! arrives meanwhile (here: a consumer of that node following its queue) takes that queue
//! over. The pass must not open the queue a second time over it: that dropped the waiting
//! operations (the consumer was cancelled, "could not follow it"; applied enqueues were lost,
//! leaving the copy with a gap) and raced two opens on one store.
//!
//! Three real ringmq processes on loopback; node 1 (index 0) serves every queue and is killed
//! with SIGKILL; each survivor has a consumer on every queue. Every wait is bounded.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::{channel, confirming, durable_queue, persistent, run, Cluster};
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

/// Queues served by the killed node: enough that one survivor reopens several in a pass.
const QUEUES: usize = 16;
/// Messages published to each queue after the failover.
const AFTER: usize = 6;

/// What each consumer got, by (node index, queue), and which consumers the broker ended.
#[derive(Default)]
struct Seen {
    bodies: BTreeMap<(usize, String), Vec<String>>,
    ended: Vec<(usize, String)>,
}

/// A consumer (no-ack, tag `c<node>`) of `queue` on `conn` (node `node`) recording into
/// `seen`; returns its channel.
async fn consume(conn: &Connection, node: usize, queue: String, seen: Arc<Mutex<Seen>>) -> Channel {
    let ch = channel(conn).await;
    let opts = BasicConsumeOptions { no_ack: true, ..Default::default() };
    let mut sub =
        t("basic.consume", ch.basic_consume(queue.as_str().into(), format!("c{node}").as_str().into(), opts, FieldTable::default()))
            .await
            .expect("basic.consume");
    let kept = ch.clone();
    tokio::spawn(async move {
        let _ch = ch;
        while let Some(Ok(d)) = sub.next().await {
            let body = String::from_utf8_lossy(&d.data).into_owned();
            seen.lock().unwrap().bodies.entry((node, queue.clone())).or_default().push(body);
        }
        seen.lock().unwrap().ended.push((node, queue));
    });
    kept
}

/// Publishes `body` to `queue` until confirmed (bounded by `limit`), on fresh channels as needed.
async fn confirmed(conn: &Connection, ch: &mut Channel, queue: &str, body: &str, limit: Instant) -> bool {
    while Instant::now() < limit {
        if !ch.status().connected() {
            *ch = confirming(conn).await;
        }
        if let Ok(pc) = ch.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), body.as_bytes(), persistent()).await {
            if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(15), pc).await {
                if c.is_ack() {
                    return true;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[test]
fn queues_moving_together_keep_the_consumers_that_follow_them() {
    run(async {
        let mut c = Cluster::start(3);
        let n0 = connect_uri(&c.amqp_uri(0)).await;
        let queues: Vec<String> = (0..QUEUES).map(|i| uniq(&format!("together-{i}"))).collect();
        for q in &queues {
            durable_queue(&n0, q).await;
        }
        let seen = Arc::new(Mutex::new(Seen::default()));
        let survivors = [connect_uri(&c.amqp_uri(1)).await, connect_uri(&c.amqp_uri(2)).await];
        let mut consumers = Vec::new();
        for (i, conn) in survivors.iter().enumerate() {
            for q in &queues {
                consumers.push((i + 1, consume(conn, i + 1, q.clone(), seen.clone()).await));
            }
        }
        // Every consumer attached: one message per queue reaches one of its consumers.
        let mut p0 = confirming(&n0).await;
        for q in &queues {
            assert!(confirmed(&n0, &mut p0, q, &format!("{q}-before"), Instant::now() + Duration::from_secs(10)).await);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while seen.lock().unwrap().bodies.values().map(Vec::len).sum::<usize>() < QUEUES && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        c.kill9(0);
        // Every queue has a server again: a publish through node 2 is confirmed.
        let mut p1 = confirming(&survivors[0]).await;
        for q in &queues {
            let ok = confirmed(&survivors[0], &mut p1, q, &format!("{q}-first"), Instant::now() + Duration::from_secs(30)).await;
            assert!(ok, "no confirm for {q} within 30 s of the kill");
        }
        // The consumers have followed their queues (a follow is retried every 200 ms).
        tokio::time::sleep(Duration::from_secs(2)).await;
        for q in &queues {
            for k in 0..AFTER {
                let ok = confirmed(&survivors[0], &mut p1, q, &format!("{q}-after-{k}"), Instant::now() + Duration::from_secs(15)).await;
                assert!(ok, "publish {k} to {q} after the failover not confirmed");
            }
        }

        // Every confirmed message comes, and each consumer still consumes (round-robin gives
        // each of a queue's two consumers some of its messages).
        let want = |q: &String| (0..AFTER).map(|k| format!("{q}-after-{k}")).collect::<Vec<_>>();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (missing, idle) = {
                let s = seen.lock().unwrap();
                let got = |node: usize, q: &String| s.bodies.get(&(node, q.clone())).cloned().unwrap_or_default();
                let missing: Vec<String> = queues
                    .iter()
                    .flat_map(|q| want(q).into_iter().filter(|b| !got(1, q).contains(b) && !got(2, q).contains(b)).collect::<Vec<_>>())
                    .collect();
                let idle: Vec<(usize, String)> = queues
                    .iter()
                    .flat_map(|q| [1, 2].map(|n| (n, q.clone())))
                    .filter(|(n, q)| !got(*n, q).iter().any(|b| b.contains("-after-")))
                    .collect();
                (missing, idle)
            };
            if missing.is_empty() && idle.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let ended = seen.lock().unwrap().ended.clone();
                panic!(
                    "after the failover: {} confirmed messages never delivered (e.g. {:?}); {} consumers got none (e.g. {:?}); ended by the broker: {:?}",
                    missing.len(),
                    missing.iter().take(5).collect::<Vec<_>>(),
                    idle.len(),
                    idle.iter().take(5).collect::<Vec<_>>(),
                    ended
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let ended = seen.lock().unwrap().ended.clone();
        assert!(ended.is_empty(), "consumers cancelled by the failover: {ended:?}");

        // Every consumer, followed to its queue's new server or attached there, is cancelled
        // with a cancel-ok (issue 40 item 4: pika's close waited for it > 100 s).
        for (node, ch) in &consumers {
            let tag = format!("c{node}");
            let answered =
                tokio::time::timeout(Duration::from_secs(10), ch.basic_cancel(tag.as_str().into(), BasicCancelOptions::default())).await;
            assert!(matches!(answered, Ok(Ok(()))), "basic.cancel of {tag} after the failover: {answered:?}");
        }
    });
}
