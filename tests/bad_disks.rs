//! Bad disks in a cluster, as a user sees them: three ringmq processes on loopback, one of
//! which keeps its data on a disk whose writes can be made to fail with EIO
//! (`common::disk::FaultyDisk`; needs root and e2fsprogs, see `common::disk`), or finds a bit
//! of a stored message flipped.
//!
//! The tests run one at a time (three brokers each on a 2-core machine); every wait is bounded.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::cluster::{confirming, drain_distinct, durable_queue, persistent, publish_all, run, Cluster};
use common::disk::faulty_disk;
use common::http::try_request;
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

/// Messages of the flipped-bit test, and their size (bytes): 800 of 4 KiB fill several 1 MiB
/// segments, so the damaged one is sealed (its records are not checked at open).
const FLIP_MESSAGES: usize = 800;
const FLIP_SIZE: usize = 4096;
/// The message whose stored copy gets a flipped bit on one member.
const FLIPPED: usize = 300;

/// The body of message `i`: its name, then filler up to [`FLIP_SIZE`].
fn flip_body(i: usize) -> String {
    let mut body = format!("flip-{i:04}-");
    body.extend(std::iter::repeat_n('x', FLIP_SIZE - body.len()));
    body
}

/// The 0-based index of the node serving `queue`, as node `ask`'s management API names it
/// (RabbitMQ's `leader` of a quorum queue); `None` while it does not answer or names none.
fn serving(c: &Cluster, ask: usize, queue: &str) -> Option<usize> {
    let path = format!("/api/queues/%2F/{queue}");
    let r = try_request(c.management_port(ask), "GET", &path, None, Some(("guest", "guest"))).ok().filter(|r| r.status == 200)?;
    let leader = r.json()["leader"].as_str()?.strip_prefix("ringmq@")?.parse::<usize>().ok()?;
    Some(leader - 1)
}

/// The members of `queue`'s replica set (0-based), as node `ask` names them.
fn members(c: &Cluster, ask: usize, queue: &str) -> Option<BTreeSet<usize>> {
    let path = format!("/api/queues/%2F/{queue}");
    let r = try_request(c.management_port(ask), "GET", &path, None, Some(("guest", "guest"))).ok().filter(|r| r.status == 200)?;
    let names = r.json()["members"].as_array()?.clone();
    names.iter().map(|n| n.as_str()?.strip_prefix("ringmq@")?.parse::<usize>().ok().map(|i| i - 1)).collect()
}

/// Kills the node serving `queue` (SIGKILL) and starts it again until node `want` serves it:
/// failover picks a live member by the queue's name, so at most two rounds.
fn make_serve(c: &mut Cluster, queue: &str, want: usize) {
    for _ in 0..3 {
        let deadline = Instant::now() + Duration::from_secs(30);
        let now = loop {
            if let Some(s) = serving(c, want, queue) {
                break s;
            }
            assert!(Instant::now() < deadline, "node {} names no server of {queue}", want + 1);
            std::thread::sleep(Duration::from_millis(200));
        };
        if now == want {
            return;
        }
        c.kill9(now);
        let deadline = Instant::now() + Duration::from_secs(30);
        while serving(c, want, queue).is_none_or(|s| s == now) {
            assert!(Instant::now() < deadline, "{queue} still served by killed node {} after 30 s", now + 1);
            std::thread::sleep(Duration::from_millis(200));
        }
        c.start_node(now);
    }
    panic!("node {} never came to serve {queue}", want + 1);
}

/// Flips one bit in the body of message [`FLIPPED`] in the segment file under `dir` that
/// holds it; that file.
fn flip_a_bit(dir: &Path) -> PathBuf {
    let marker = format!("flip-{FLIPPED:04}-");
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()) {
            if e.is_dir() {
                stack.push(e);
                continue;
            }
            if e.extension().is_none_or(|x| x != "seg") {
                continue;
            }
            let mut bytes = std::fs::read(&e).unwrap();
            if let Some(at) = bytes.windows(marker.len()).position(|w| w == marker.as_bytes()) {
                bytes[at + marker.len() + 100] ^= 0x04;
                std::fs::write(&e, &bytes).unwrap();
                return e;
            }
        }
    }
    panic!("message {FLIPPED} is in no segment file under {}", dir.display());
}

/// A flipped bit in one member's stored copy of a replicated queue (in a sealed segment,
/// whose records are not checked at open) is caught by the record's CRC when that member
/// serves the queue and reads it: the damaged message is never delivered, the member steps
/// aside so another one serves every confirmed message, leaves the replica set, and is grown
/// back with a complete copy, from which it serves the rest once it serves again.
#[test]
fn a_flipped_bit_in_one_members_copy_is_never_served_and_is_repaired_from_the_others() {
    run(async move {
        let mut c = Cluster::start_with_args(3, &["--segment-bytes", "1048576"]);
        let q = uniq("flipped");
        let conn = connect_uri(&c.amqp_uri(0)).await;
        durable_queue(&conn, &q).await;
        let ch = confirming(&conn).await;
        let bodies: Vec<String> = (0..FLIP_MESSAGES).map(flip_body).collect();
        for b in &bodies {
            let confirm = publish_confirmed(&ch, "", &q, b.as_bytes(), persistent()).await;
            assert!(confirm.is_ack(), "{} not confirmed: {confirm:?}", &b[..9]);
        }
        drop(ch);
        drop(conn);
        let server = serving(&c, 0, &q).expect("a server");
        let victim = (server + 1) % 3;
        // The members write their copies within the second (the shards' sync tick).
        tokio::time::sleep(Duration::from_secs(2)).await;
        c.kill9(victim);
        let seg = flip_a_bit(&c.data_dir(victim));
        eprintln!("flipped a bit of message {FLIPPED} in {} of node {}", seg.display(), victim + 1);
        c.start_node(victim);
        make_serve(&mut c, &q, victim);

        // The damaged member serves: its read-ahead meets the damage; 50 are taken.
        let first = connect_uri(&c.amqp_uri(victim)).await;
        let (taken, _) = drain_distinct(&first, &q, 50, Duration::from_secs(60)).await;
        drop(first);
        let log = c.log(victim);
        assert!(log.contains("its store is damaged"), "node {} did not report the damage:\n{log}", victim + 1);

        // It left the set and is grown back: all three are members again.
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let ask = (victim + 1) % 3;
            let m = members(&c, ask, &q);
            if m.as_ref().is_some_and(|m| m.len() == 3) && c.log(victim).contains("joined the queue's replica set with a complete copy") {
                break;
            }
            assert!(Instant::now() < deadline, "node {} not grown back into {q}'s set within 90 s: members {m:?}", victim + 1);
            tokio::time::sleep(Duration::from_millis(250)).await;
        }

        // Served from the repaired copy, every other confirmed message comes, intact.
        make_serve(&mut c, &q, victim);
        let rest = connect_uri(&c.amqp_uri(victim)).await;
        let (seen, _) = drain_distinct(&rest, &q, FLIP_MESSAGES - taken.len(), Duration::from_secs(90)).await;
        let all: BTreeSet<String> = taken.into_iter().chain(seen).collect();
        let want: BTreeSet<String> = bodies.into_iter().collect();
        let strange: Vec<&str> = all.iter().filter(|b| !want.contains(*b)).map(|b| &b[..9.min(b.len())]).collect();
        assert!(strange.is_empty(), "bodies that were never published (damaged copies served): {strange:?}");
        let missing: Vec<&str> = want.iter().filter(|b| !all.contains(*b)).map(|b| &b[..9]).collect();
        let log = c.log(victim);
        let story: Vec<&str> = log
            .lines()
            .filter(|l| ["damage", "corrupt", "replica set", "its copy", "leader moved"].iter().any(|w| l.contains(w)))
            .collect();
        eprintln!("node {}'s story:\n{}", victim + 1, story.join("\n"));
        assert!(missing.is_empty(), "{} confirmed messages not delivered: {missing:?}", missing.len());
    });
}
