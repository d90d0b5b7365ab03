//! Partitions, as a user sees them: three ringmq processes whose links to each other pass
//! through proxies (`common::proxy`), cut and healed under a client's publishes.
//!
//! The tests run one at a time (three brokers each on a 2-core machine); every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{confirming, drain_distinct, durable_queue, persistent, publish_all, run, Cluster};
use common::proxy::Mode;
use common::raw::{be_u64, RawConn};
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

/// The confirms `raw` reads until `until` or until it has `max`: (delivery tag, ack,
/// multiple). Anything else on the connection fails the test.
fn read_confirms(raw: &mut RawConn, until: Instant, max: usize) -> Vec<(u64, bool, bool)> {
    let mut got = Vec::new();
    // Bounded: each read waits at most the socket's read timeout.
    for _ in 0..10_000 {
        if Instant::now() >= until || got.len() >= max {
            break;
        }
        let Some(f) = raw.read_frame() else { continue };
        match f.method_id() {
            Some((60, 80)) => got.push((be_u64(&f.payload[4..12]), true, f.payload[12] & 1 != 0)),
            Some((60, 120)) => got.push((be_u64(&f.payload[4..12]), false, f.payload[12] & 1 != 0)),
            other => panic!("unexpected frame on the publishing connection: {other:?} {f:?}"),
        }
    }
    got
}

/// The nemesis's seed 2 (a confirmed message lost): a publish in flight to a queue's server
/// when that server froze (every link of it stalled, bytes held, none lost) is sent on to the
/// queue's next server once the queue moves, and confirmed from there; when the links flow
/// again, the old server answers it as well. That late answer reached the client as a second
/// confirm of the same delivery tag, and a client that waits for one confirm per publish
/// (pika's blocking channel) then took each later confirm for the next publish: a publish
/// the broker never stored was "confirmed" by its predecessor's ack. Every delivery tag is
/// confirmed exactly once.
#[test]
fn a_late_answer_from_a_queues_old_server_is_not_a_second_confirm() {
    run(async {
        let mut c = Cluster::start_linked(3, &[]);
        let leader = c.wait_one_leader(Duration::from_secs(30));
        // As in the nemesis run: the publisher on the metadata leader, which moves the queue.
        let (server, client) = ((leader + 1) % 3, leader);
        let q = uniq("late");
        durable_queue(&connect_uri(&c.amqp_uri(server)).await, &q).await;
        let mut raw = RawConn::open(c.amqp_addr(client));
        raw.open_channel(1);
        raw.durable_queue_in_confirm_mode(1, &q);
        // Short reads, so that `read_confirms` keeps its deadlines.
        raw.sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        raw.write(&RawConn::persistent_publish_frames(1, "", &q, b"before"));
        assert_eq!(
            read_confirms(&mut raw, Instant::now() + Duration::from_secs(45), 1),
            vec![(1, true, false)],
            "the first publish is confirmed"
        );

        // The server freezes: nothing flows between it and the two other nodes.
        for other in [leader, client] {
            c.partition(server, other, Mode::Stall);
        }
        raw.write(&RawConn::persistent_publish_frames(1, "", &q, b"in-flight"));
        let frozen = Instant::now();
        // The queue moves off the frozen server after DOWN_AFTER (2 s); the links flow again
        // before the 5 s a data lane may stay silent, so the old server's lanes survive and
        // carry its late answer.
        let mut first = read_confirms(&mut raw, frozen + Duration::from_millis(4_500), 1);
        eprintln!("publish in flight at the freeze answered {:.1} s after it: {first:?}", frozen.elapsed().as_secs_f64());
        for other in [leader, client] {
            c.partition(server, other, Mode::Pass);
        }
        if first.is_empty() {
            first = read_confirms(&mut raw, Instant::now() + Duration::from_secs(45), 1);
        }
        assert_eq!(first, vec![(2, true, false)], "the publish in flight is confirmed by the queue's next server");
        let late = read_confirms(&mut raw, Instant::now() + Duration::from_secs(15), usize::MAX);
        assert!(late.is_empty(), "a publish confirmed once was confirmed again after the heal: {late:?}");
        // Later publishes are confirmed once each, with their own tags.
        for i in 3..=5u64 {
            raw.write(&RawConn::persistent_publish_frames(1, "", &q, format!("after-{i}").as_bytes()));
            assert_eq!(
                read_confirms(&mut raw, Instant::now() + Duration::from_secs(45), 1),
                vec![(i, true, false)],
                "publish {i} after the heal"
            );
        }
        let extra = read_confirms(&mut raw, Instant::now() + Duration::from_secs(2), usize::MAX);
        assert!(extra.is_empty(), "confirms nobody asked for: {extra:?}");
    });
}

/// The nemesis's seed 1 (a publish never answered): publishes in flight to a queue's server
/// as its links are cut (reset) are held by the nodes that sent them, and sent on once the
/// queue moves, to another node or to their own node, which then serves it. Each is
/// answered once, within the 30 s a client may wait, and the queue holds every one.
#[test]
fn publishes_in_flight_when_their_server_is_cut_off_are_answered_once() {
    run(async {
        let mut c = Cluster::start_linked(3, &[]);
        let leader = c.wait_one_leader(Duration::from_secs(30));
        let server = (leader + 1) % 3;
        let others = [leader, (leader + 2) % 3];
        let on_server = connect_uri(&c.amqp_uri(server)).await;
        let q = uniq("cut");
        durable_queue(&on_server, &q).await;
        // A publisher on each other node: the queue moves to one of them.
        let mut raws: Vec<RawConn> = others
            .iter()
            .map(|&i| {
                let mut raw = RawConn::open(c.amqp_addr(i));
                raw.open_channel(1);
                raw.durable_queue_in_confirm_mode(1, &q);
                raw.sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
                raw
            })
            .collect();
        for (k, raw) in raws.iter_mut().enumerate() {
            raw.write(&RawConn::persistent_publish_frames(1, "", &q, format!("before-{k}").as_bytes()));
            assert_eq!(read_confirms(raw, Instant::now() + Duration::from_secs(45), 1), vec![(1, true, false)]);
        }
        for round in 0..3u64 {
            // A queue of its own each round, served by the node cut off.
            let q = format!("{q}-{round}");
            durable_queue(&on_server, &q).await;
            for (k, raw) in raws.iter_mut().enumerate() {
                raw.write(&RawConn::persistent_publish_frames(1, "", &q, format!("cut-{round}-{k}").as_bytes()));
            }
            for &other in &others {
                c.partition(server, other, Mode::Reset);
            }
            let cut = Instant::now();
            for (k, raw) in raws.iter_mut().enumerate() {
                let got = read_confirms(raw, cut + Duration::from_secs(30), 1);
                assert_eq!(
                    got,
                    vec![(round + 2, true, false)],
                    "round {round}: the publish in flight on node {} at the cut",
                    others[k] + 1
                );
            }
            eprintln!("round {round}: publishes in flight at the cut confirmed {:.1} s after it", cut.elapsed().as_secs_f64());
            for &other in &others {
                c.partition(server, other, Mode::Pass);
            }
            for raw in raws.iter_mut() {
                let late = read_confirms(raw, Instant::now() + Duration::from_secs(3), usize::MAX);
                assert!(late.is_empty(), "round {round}: confirmed again: {late:?}");
            }
            let (seen, _) = drain_distinct(&connect_uri(&c.amqp_uri(leader)).await, &q, 2, Duration::from_secs(30)).await;
            for k in 0..2 {
                assert!(seen.contains(&format!("cut-{round}-{k}")), "round {round}: confirmed but not in {q}: {seen:?}");
            }
        }
    });
}

/// Lines of node `i`'s log where its data link to node `peer` (an index) changed, as
/// (up, count so far): the last state and how many times it went down.
fn data_link(c: &Cluster, i: usize, peer: usize) -> (Option<bool>, usize) {
    let (up, down) = (format!("data link to peer up peer={}", peer + 1), format!("data link to peer down peer={}", peer + 1));
    let log = c.log(i);
    let mut last = None;
    let mut downs = 0;
    for l in log.lines() {
        if l.contains(&up) {
            last = Some(true);
        } else if l.contains(&down) {
            last = Some(false);
            downs += 1;
        }
    }
    (last, downs)
}

/// A link that flaps (reset, back, blackholed, back: each for 150-650 ms, for 8 s) settles
/// once healed: the
/// data link between the two nodes comes up on both and stays up, and a publish from one to
/// the other's queue is confirmed (the faults issue's defect 2: the two sides paired each
/// other's stale lanes and took the link down about once a second for minutes).
#[test]
fn a_flapping_link_settles_once_healed() {
    run(async {
        let mut c = Cluster::start_linked(3, &[]);
        c.wait_one_leader(Duration::from_secs(30));
        let (a, b) = (0, 1);
        let q = uniq("flap");
        durable_queue(&connect_uri(&c.amqp_uri(b)).await, &q).await;
        // A fixed sequence of hold times (a linear congruential generator, seed 40).
        let mut x: u64 = 40;
        let flapping = Instant::now();
        let modes = [Mode::Reset, Mode::Pass, Mode::Blackhole, Mode::Pass];
        let mut turn = 0;
        while flapping.elapsed() < Duration::from_secs(8) {
            c.partition(a, b, modes[turn % modes.len()]);
            turn += 1;
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            std::thread::sleep(Duration::from_millis(150 + (x >> 33) % 500));
        }
        c.partition(a, b, Mode::Pass);
        // Settled: up on both sides and no change for 6 s, within 45 s of the heal (a lane
        // blackholed at the heal carries a gap in its bytes and is dropped once more).
        let healed = Instant::now();
        let state = |c: &Cluster| (data_link(c, a, b), data_link(c, b, a));
        loop {
            assert!(
                healed.elapsed() < Duration::from_secs(45),
                "the data link between nodes {} and {} did not settle: {:?}",
                a + 1,
                b + 1,
                state(&c)
            );
            let before = state(&c);
            std::thread::sleep(Duration::from_secs(6));
            if before == state(&c) && before.0 .0 == Some(true) && before.1 .0 == Some(true) {
                break;
            }
        }
        eprintln!("data link settled {:.1} s after the heal", healed.elapsed().as_secs_f64() - 6.0);
        let conn = connect_uri(&c.amqp_uri(a)).await;
        publish_all(&confirming(&conn).await, &q, "after", 10).await;
    });
}
