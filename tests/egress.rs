//! Egress before ingress (`broker/queue/egress.rs`, issue 15): a queue may hold its
//! publishers' credit while its consumer falls behind on a saturated core, but never for a
//! consumer that is slow on its own: a publisher keeps publishing into a queue whose
//! consumer reads nothing, and the queue takes the messages.
//!
//! Every wait is bounded; each publish may take at most 10 s to leave.

mod common;

use std::time::{Duration, Instant};

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
