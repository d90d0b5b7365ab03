//! Bad disks in a cluster, as a user sees them: three ringmq processes on loopback, one of
//! which keeps its data on a disk whose writes can be made to fail with EIO
//! (`common::disk::FaultyDisk`). Needs root and e2fsprogs (see `common::disk`).
//!
//! The tests run one at a time (three brokers each on a 2-core machine); every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{confirming, drain_distinct, durable_queue, persistent, publish_all, run, Cluster};
use common::disk::faulty_disk;
use common::*;

/// A node whose disk fails (every write EIO: its metadata log can take no entry) ends with a
/// fatal error instead of lingering with a metadata group that is gone; the other two keep
/// confirming; once the disk works again, a restart (what its supervisor does) brings it back
/// into the cluster, and every confirmed message is in the queue.
#[test]
fn a_node_whose_disk_fails_ends_and_comes_back_once_restarted() {
    let test = "a_node_whose_disk_fails_ends_and_comes_back_once_restarted";
    let Some(mut disk) = faulty_disk(test, 256) else { return };
    let data = disk.path().join("data");
    run(async move {
        // Declared after the disk: the nodes are killed before it is unmounted.
        let mut c = Cluster::unstarted(3, &["--segment-bytes", "1048576", "--disk-free-limit", "0"]);
        let bad = 2;
        c.put_data_in(bad, data);
        c.start_all_again();
        let q = uniq("bad-disk");
        let conn = connect_uri(&c.amqp_uri(0)).await;
        durable_queue(&conn, &q).await;
        let ch = confirming(&conn).await;
        let mut bodies = publish_all(&ch, &q, "before", 50).await;

        disk.fail_writes().expect("the disk's writes fail");
        let failed = Instant::now();
        // The two good nodes confirm while the bad one fails (publishes go on meanwhile).
        let mut n = 0;
        let status = loop {
            let body = format!("during-{n}");
            let confirm = publish_confirmed(&ch, "", &q, body.as_bytes(), persistent()).await;
            assert!(confirm.is_ack(), "{body} not confirmed by the two good nodes: {confirm:?}");
            bodies.push(body);
            n += 1;
            if let Some(status) = c.wait_exit(bad, Duration::from_millis(100)) {
                break status;
            }
            assert!(failed.elapsed() < Duration::from_secs(30), "node {} still runs 30 s after its disk failed", bad + 1);
        };
        eprintln!(
            "node {} ended {:.1} s after its disk failed ({status}), {n} publishes confirmed meanwhile",
            bad + 1,
            failed.elapsed().as_secs_f64()
        );
        assert_eq!(status.code(), Some(70), "a fatal error's exit status");
        assert!(c.log(bad).contains("fatal: the metadata group stopped"), "the log says why the node ended");
        bodies.extend(publish_all(&ch, &q, "alone", 50).await);

        // The disk works again; the supervisor restarts the node.
        disk.heal().expect("the disk works again");
        c.start_node(bad);
        let back = connect_uri(&c.amqp_uri(bad)).await;
        bodies.extend(publish_all(&confirming(&back).await, &q, "after", 20).await);
        let (seen, _) = drain_distinct(&back, &q, bodies.len(), Duration::from_secs(60)).await;
        let missing: Vec<&String> = bodies.iter().filter(|b| !seen.contains(*b)).collect();
        assert!(missing.is_empty(), "{} confirmed messages not delivered: {missing:?}", missing.len());
    });
}
