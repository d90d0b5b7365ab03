//! Egress before ingress (`broker/queue/egress.rs`, issue 15): a queue may hold its
//! publishers' credit while its consumer falls behind on a saturated core, but never for a
//! consumer that is slow on its own: a publisher keeps publishing into a queue whose
//! consumer reads nothing, and the queue takes the messages. Nor for a consumer whose
//! prefetch window opens only now and then: one that acks slowly keeps counting as taking,
//! so its publisher may be held, but never for longer than a hold lasts.
//!
//! Every wait is bounded; each publish may take at most 10 s to leave.

mod common;

use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;

use common::flood::flood;
use common::raw::RawConn;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_reads_nothing_never_stops_its_publisher() {
    let b = Broker::start();
    let (_conn, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "reads-nothing").await;
    // A consumer without a prefetch limit whose client never reads its socket: deliveries
    // pile up in its connection until the broker stops giving it more.
    let mut stuck = RawConn::open(b.addr());
    stuck.open_channel(1);
    stuck.basic_consume(1, &q, "never-reads");
    const N: usize = 150_000;
    let started = Instant::now();
    flood(b.uri(), q.clone(), N, 1024, Default::default(), Duration::from_secs(10)).await;
    let published_in = started.elapsed();
    // What the consumer's connection did not take waits in the queue.
    let deadline = Instant::now() + Duration::from_secs(30);
    let ready = loop {
        let ready = ready_count(&ch, &q).await;
        if ready as usize >= N / 2 || Instant::now() > deadline {
            break ready;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        ready as usize >= N / 2,
        "{ready} of {N} ready after the flood ({published_in:?}): the stuck consumer took more than its connection's bound"
    );
    drop(stuck);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_acks_slowly_never_stops_its_publisher() {
    let b = Broker::start();
    let (_conn, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "acks-slowly").await;
    // Prefetch 10, one ack every 2 ms: its window is full at nearly every check, but it
    // settles, so it counts as taking while the flood saturates the broker's core.
    let (_cconn, cch) = connect_ch(&b).await;
    cch.basic_qos(10, BasicQosOptions::default()).await.expect("qos");
    let mut consumer =
        cch.basic_consume(q.as_str().into(), "slow".into(), BasicConsumeOptions::default(), FieldTable::default()).await.expect("consume");
    let acker = tokio::spawn(async move {
        let mut acked = 0u32;
        while let Some(Ok(d)) = consumer.next().await {
            tokio::time::sleep(Duration::from_millis(2)).await;
            d.acker.ack(BasicAckOptions::default()).await.expect("ack");
            acked += 1;
        }
        acked
    });
    const N: usize = 150_000;
    let started = Instant::now();
    // Each publish must leave within 10 s (a hold lasts at most 100 ms, then none for 1 s).
    // Checked to fail with holds that never run out: a publish then waited 10 s.
    flood(b.uri(), q.clone(), N, 1024, Default::default(), Duration::from_secs(10)).await;
    let published_in = started.elapsed();
    let ready = ready_count(&ch, &q).await;
    assert!(
        ready as usize >= N / 2,
        "{ready} of {N} ready after the flood ({published_in:?}): a consumer of 500 msgs/s cannot have taken the rest"
    );
    acker.abort();
}
