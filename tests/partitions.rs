//! Partitions, as a user sees them: three ringmq processes whose links to each other pass
//! through proxies (`common::proxy`), cut and healed under a client's publishes.
//!
//! The tests run one at a time (three brokers each on a 2-core machine); every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{confirming, drain_distinct, durable_queue, persistent, publish_all, run, Cluster};
use common::proxy::Mode;
use common::*;
use lapin::options::BasicPublishOptions;

/// A bridge: the node serving a queue loses the Raft leader but not the client's node. The
/// queue moves to a node in the majority within seconds; the publishes the client's node had
/// in flight to the old server (which can commit nothing: it has no leader) are sent to the
/// new one and confirmed from there, not nacked when the old one's proposals time out (the
/// faults issue's defect 5); after the heal every message is in the queue.
#[test]
fn a_bridge_partition_sends_the_publishes_in_flight_to_the_queues_new_server() {
    run(async {
        let mut c = Cluster::start_linked(3, &[]);
        let leader = c.wait_one_leader(Duration::from_secs(30));
        let (server, client) = ((leader + 1) % 3, (leader + 2) % 3);
        let q = uniq("bridge");
        // Declared through the server's node: that node serves the queue.
        let on_server = connect_uri(&c.amqp_uri(server)).await;
        durable_queue(&on_server, &q).await;
        let conn = connect_uri(&c.amqp_uri(client)).await;
        let ch = confirming(&conn).await;
        let mut bodies = publish_all(&ch, &q, "before", 20).await;

        // The server and the leader cannot reach each other; both still reach the client's node.
        c.partition(server, leader, Mode::Reset);
        let cut = Instant::now();
        let mut confirms = Vec::new();
        for i in 0..50 {
            let body = format!("during-{i}");
            let sent = ch.basic_publish("".into(), q.as_str().into(), BasicPublishOptions::default(), body.as_bytes(), persistent());
            confirms.push(t("basic.publish", sent).await.expect("basic.publish"));
            bodies.push(body);
        }
        for (i, pc) in confirms.into_iter().enumerate() {
            let confirm = tt("a confirm during the bridge", Duration::from_secs(40), pc).await.expect("confirm");
            assert!(confirm.is_ack(), "publish during-{i} nacked during the bridge: {confirm:?}");
        }
        eprintln!("50 publishes in flight at the cut confirmed {:.1} s after it", cut.elapsed().as_secs_f64());

        c.partition(server, leader, Mode::Pass);
        let (seen, _) = drain_distinct(&conn, &q, bodies.len(), Duration::from_secs(60)).await;
        let missing: Vec<&String> = bodies.iter().filter(|b| !seen.contains(*b)).collect();
        assert!(missing.is_empty(), "confirmed but not in the queue after the heal: {missing:?}");
    });
}
