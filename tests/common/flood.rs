//! Floods and drains for the flow-control and memory tests: publishers without confirms that
//! send as fast as the socket takes, and a consumer that counts what arrives.

use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Event};

use super::t;

/// Publishes `count` bodies of `size` bytes with `props` to `queue` on a connection of its
/// own to `uri`, without confirms (what floods a broker), allowing each publish `limit` to
/// leave; returns the connection.blocked reasons the broker sent meanwhile.
pub async fn flood(uri: String, queue: String, count: usize, size: usize, props: BasicProperties, limit: Duration) -> Vec<String> {
    let conn = t("connect", lapin::Connection::connect(&uri, lapin::ConnectionProperties::default())).await.expect("connect");
    let mut events = conn.events_listener();
    let ch = t("channel", conn.create_channel()).await.expect("channel");
    let body = vec![b'f'; size];
    let started = Instant::now();
    for i in 0..count {
        let sent = ch.basic_publish("".into(), queue.as_str().into(), Default::default(), &body, props.clone());
        let r = tokio::time::timeout(limit, sent).await;
        assert!(matches!(r, Ok(Ok(_))), "publish {i} of {count} to {queue}: {r:?} after {:?}", started.elapsed());
    }
    let mut reasons = Vec::new();
    while let Some(Some(e)) = futures_lite::future::poll_once(events.next()).await {
        if let Event::ConnectionBlocked(r) = e {
            reasons.push(r);
        }
    }
    t("connection.close", conn.close(200, "done".into())).await.expect("close");
    reasons
}

/// Consumes `queue` (auto-ack) until `n` messages arrived or 30 s pass without one, checking
/// each body is `size` bytes when given; how many arrived.
pub async fn consume_all(ch: &Channel, queue: &str, n: usize, size: Option<usize>) -> usize {
    let opts = BasicConsumeOptions { no_ack: true, ..Default::default() };
    let mut sub = t("basic.consume", ch.basic_consume(queue.into(), "".into(), opts, FieldTable::default())).await.expect("consume");
    let mut got = 0;
    while got < n {
        match tokio::time::timeout(Duration::from_secs(30), sub.next()).await {
            Ok(Some(Ok(d))) => {
                if let Some(size) = size {
                    assert_eq!(d.data.len(), size, "a whole body");
                }
                got += 1;
            }
            _ => break,
        }
    }
    got
}
