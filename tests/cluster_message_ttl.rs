//! Message TTL on a replicated queue (issue 12 item 1, its cluster half), with three real
//! ringmq processes: the deadline is fixed once by the queue's server and stored with the
//! message in every replica, so after the server is killed with SIGKILL the node that takes
//! the queue over expires the messages by their original deadline — not early, not later,
//! not never — and dead-letters them with reason `expired`.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{channel, confirming, publish_all, run, Cluster};
use common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::Connection;

/// The ready count of `queue` through `conn` (a fresh channel each time), or None while the
/// node cannot answer for it (a failover under way).
async fn count_on(conn: &Connection, queue: &str) -> Option<u32> {
    let ch = tt("channel.open", Duration::from_secs(5), conn.create_channel()).await.ok()?;
    let opts = QueueDeclareOptions { passive: true, ..Default::default() };
    let r = tokio::time::timeout(Duration::from_secs(3), ch.queue_declare(queue.into(), opts, FieldTable::default())).await;
    let n = r.ok()?.ok()?.message_count();
    let _ = tokio::time::timeout(Duration::from_secs(2), ch.close(200, "".into())).await;
    Some(n)
}

/// Polls until `queue` holds `n` ready messages or `until`; the instant it did.
async fn reaches(conn: &Connection, queue: &str, n: u32, until: Instant) -> Option<Instant> {
    while Instant::now() < until {
        if count_on(conn, queue).await == Some(n) {
            return Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

#[test]
fn a_replicated_ttl_queue_expires_by_the_original_deadline_after_its_server_is_killed() {
    run(async {
        const TTL: Duration = Duration::from_millis(6000);
        let mut c = Cluster::start(3);
        let n1 = connect_uri(&c.amqp_uri(0)).await;
        let ch = channel(&n1).await;
        let (q, dlq) = (uniq("ttl-repl"), uniq("ttl-repl-dlq"));
        declare_queue(&ch, &dlq, QueueDeclareOptions::durable(), FieldTable::default()).await;
        let mut a = FieldTable::default();
        a.insert("x-message-ttl".into(), AMQPValue::LongLongInt(TTL.as_millis() as i64));
        a.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(LongString::from("")));
        a.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(LongString::from(dlq.as_str())));
        declare_queue(&ch, &q, QueueDeclareOptions::durable(), a).await;

        // 20 confirmed persistent messages from node 2; the deadline runs from here.
        let n2 = connect_uri(&c.amqp_uri(1)).await;
        let p2 = confirming(&n2).await;
        let start = Instant::now();
        publish_all(&p2, &q, "m", 20).await;
        let published = Instant::now();
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.kill9(0);
        let killed = Instant::now();

        // The new server holds them until their deadline: nothing expired early.
        let seen = reaches(&n2, &q, 20, start + TTL - Duration::from_millis(500)).await;
        let seen = seen.unwrap_or_else(|| panic!("the moved queue did not show its 20 messages before their deadline"));
        eprintln!("queue served again {} ms after the kill", seen.duration_since(killed).as_millis());

        // ...and expires them by it, into the dead-letter queue.
        let dead = reaches(&n2, &dlq, 20, published + TTL + Duration::from_secs(10)).await;
        let dead = dead.expect("the expired messages never reached the dead-letter queue");
        let late = dead.saturating_duration_since(published + TTL);
        eprintln!("dead-lettered {} ms after the deadline", late.as_millis());
        assert!(dead >= start + TTL, "expired before the deadline");
        assert!(late < Duration::from_millis(2000), "expired {late:?} after the original deadline (a new deadline at the failover?)");
        assert_eq!(count_on(&n2, &q).await, Some(0), "the expired messages are still counted in the queue");
        let ch = channel(&n2).await;
        let got = t("basic.get", ch.basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: true })).await.unwrap().expect("a copy");
        let h = got.delivery.properties.headers().clone().expect("headers");
        let Some(AMQPValue::FieldArray(deaths)) = h.inner().get("x-death") else { panic!("no x-death: {h:?}") };
        let Some(AMQPValue::FieldTable(d)) = deaths.as_slice().first() else { panic!("empty x-death") };
        let s = |k: &str| match d.inner().get(k) {
            Some(AMQPValue::LongString(v)) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
            other => panic!("x-death {k}: {other:?}"),
        };
        assert_eq!((s("reason"), s("queue")), ("expired".to_string(), q.clone()));
    });
}
