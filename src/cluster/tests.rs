//! Transports over loopback: exchange, snapshots beside heartbeats, unreachable and late
//! peers, refused handshakes, shutdown. Every wait is bounded (≤ 10 s).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use raft::eraftpb::{Entry, Message, MessageType, Snapshot};

use super::frame::{self, Hello, Lane, HEADER_LEN, HELLO_LEN, VERSION};
use super::*;

pub(super) const WAIT: Duration = Duration::from_secs(10);

/// `n` loopback addresses whose ports were free a moment ago.
pub(super) fn free_addrs(n: usize) -> Vec<SocketAddr> {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    listeners.iter().map(|l| l.local_addr().unwrap()).collect()
}

pub(super) fn peer_map(addrs: &[SocketAddr]) -> BTreeMap<NodeId, SocketAddr> {
    addrs.iter().enumerate().map(|(i, a)| (i as NodeId + 1, *a)).collect()
}

type Hook = Arc<dyn Fn(&Message) + Send + Sync>;

/// A started transport with what it delivered and reported.
struct Node {
    t: Transport,
    inbox: flume::Receiver<Message>,
    reports: flume::Receiver<Report>,
}

fn start_with(cfg: TransportConfig, hook: Option<Hook>) -> Node {
    let (in_tx, inbox) = flume::unbounded();
    let (rep_tx, reports) = flume::unbounded();
    let on_message = Arc::new(move |m: Message| {
        if let Some(hook) = &hook {
            hook(&m);
        }
        let _ = in_tx.send(m);
    });
    let on_report = Arc::new(move |r: Report| {
        let _ = rep_tx.send(r);
    });
    Node { t: Transport::start(cfg, on_message, on_report).unwrap(), inbox, reports }
}

fn start(me: NodeId, addrs: &[SocketAddr]) -> Node {
    start_with(TransportConfig::new(me, addrs[me as usize - 1], peer_map(addrs)), None)
}

pub(super) fn heartbeat(from: NodeId, to: NodeId, term: u64) -> Message {
    Message { msg_type: MessageType::MsgHeartbeat, from, to, term, commit: term * 10, ..Default::default() }
}

fn append(from: NodeId, to: NodeId, term: u64, n: u64) -> Message {
    let entries: Vec<Entry> = (1..=n)
        .map(|i| Entry { term, index: 100 + i, data: format!("entry {i} of term {term}").into_bytes().into(), ..Default::default() })
        .collect();
    Message {
        msg_type: MessageType::MsgAppend,
        from,
        to,
        term,
        log_term: term,
        index: 100,
        commit: 99,
        entries: entries.into(),
        ..Default::default()
    }
}

pub(super) fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn wait_connected(node: &Node, peer: NodeId) {
    wait_until(&format!("link {} -> {peer}", node.t.me()), || node.t.peers().iter().any(|p| p.id == peer && p.connected));
}

pub(super) fn recv(rx: &flume::Receiver<Message>) -> Message {
    rx.recv_timeout(WAIT).expect("a message within 10 s")
}

fn status(node: &Node, peer: NodeId) -> PeerStatus {
    node.t.peers().into_iter().find(|p| p.id == peer).unwrap()
}

#[test]
fn two_transports_exchange_messages_both_ways() {
    let addrs = free_addrs(2);
    let (a, b) = (start(1, &addrs), start(2, &addrs));
    wait_connected(&a, 2);
    wait_connected(&b, 1);

    let sent = append(1, 2, 7, 3);
    a.t.send(sent.clone());
    let got = recv(&b.inbox);
    assert_eq!((got.from, got.to, got.term, got.msg_type), (1, 2, 7, MessageType::MsgAppend));
    assert_eq!(got, sent, "every field survives, entries included");
    assert_eq!(got.entries[2].data.as_ref(), b"entry 3 of term 7");

    b.t.send(heartbeat(2, 1, 7));
    let got = recv(&a.inbox);
    assert_eq!((got.from, got.to, got.term, got.commit), (2, 1, 7, 70));

    // A burst goes out in batches and arrives complete and in order.
    a.t.send_all((1..=2000).map(|i| heartbeat(1, 2, i)).collect());
    for i in 1..=2000 {
        assert_eq!(recv(&b.inbox).term, i);
    }
    wait_until("counters", || status(&a, 2).sent == 2001);
    let st = status(&a, 2);
    assert_eq!(st.dropped, 0);
    // The writer drains what is queued into one write: far fewer writes than messages.
    assert!(st.writes < 500, "{} writes for {} messages", st.writes, st.sent);
    eprintln!("batching: {} messages in {} writes", st.sent, st.writes);
    assert!(a.reports.try_recv().is_err(), "no reports on a healthy link");
}

#[test]
fn three_nodes_full_mesh() {
    let addrs = free_addrs(3);
    let nodes: Vec<Node> = (1..=3).map(|id| start(id, &addrs)).collect();
    for n in &nodes {
        for peer in (1..=3).filter(|&p| p != n.t.me()) {
            wait_connected(n, peer);
        }
    }
    for n in &nodes {
        let me = n.t.me();
        n.t.send_all((1..=3).filter(|&p| p != me).map(|p| heartbeat(me, p, me)).collect());
    }
    for n in &nodes {
        let mut froms: Vec<NodeId> = (0..2).map(|_| recv(&n.inbox).from).collect();
        froms.sort_unstable();
        assert_eq!(froms, (1..=3).filter(|&p| p != n.t.me()).collect::<Vec<_>>());
    }
}

#[test]
fn snapshot_arrives_whole_while_heartbeats_keep_flowing() {
    let addrs = free_addrs(2);
    let mut cfg = TransportConfig::new(1, addrs[0], peer_map(&addrs));
    cfg.snapshot_chunk_bytes = 1 << 20;
    let a = start_with(cfg, None);
    // Node 2's driver is slow with the snapshot: on_message holds it until the test opens the
    // gate. Heartbeats must keep arriving meanwhile (their lane and reader are separate), and
    // the sender's report must wait for the receiver.
    let (gate_tx, gate_rx) = flume::bounded::<()>(1);
    let (snap_tx, snap_rx) = flume::unbounded();
    let hook: Hook = Arc::new(move |m: &Message| {
        if m.msg_type == MessageType::MsgSnapshot {
            let _ = snap_tx.send(m.clone());
            let _ = gate_rx.recv_timeout(WAIT);
        }
    });
    let b = start_with(TransportConfig::new(2, addrs[1], peer_map(&addrs)), Some(hook));
    wait_connected(&a, 2);

    let data: Vec<u8> = (0..5u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let mut snap = Snapshot { data: data.clone().into(), ..Default::default() };
    snap.mut_metadata().index = 500;
    snap.mut_metadata().term = 9;
    snap.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
    let msg = Message { msg_type: MessageType::MsgSnapshot, from: 1, to: 2, term: 9, snapshot: Some(snap).into(), ..Default::default() };
    a.t.send(msg.clone());

    let got = snap_rx.recv_timeout(WAIT).expect("snapshot delivered");
    assert_eq!(got.get_snapshot().get_metadata().index, 500);
    assert_eq!(got.get_snapshot().get_metadata().get_conf_state().voters, vec![1, 2, 3]);
    assert!(got.get_snapshot().data.as_ref() == &data[..], "5 MiB intact");
    assert_eq!(got, msg);

    // While node 2 sits on the snapshot: 20 heartbeats go through, no snapshot report yet.
    for i in 1..=20 {
        a.t.send(heartbeat(1, 2, i));
        let hb = recv(&b.inbox);
        assert_eq!((hb.msg_type, hb.term), (MessageType::MsgHeartbeat, i));
    }
    assert!(a.reports.try_recv().is_err(), "no report before the receiver took the snapshot");
    gate_tx.send(()).unwrap();
    assert_eq!(a.reports.recv_timeout(WAIT), Ok(Report::SnapshotFinished(2)));
    assert_eq!(recv(&b.inbox).msg_type, MessageType::MsgSnapshot);
    std::thread::sleep(Duration::from_millis(200));
    assert!(a.reports.try_recv().is_err(), "exactly one report per snapshot");
    let st = status(&a, 2);
    assert_eq!((st.snapshots_sent, st.snapshots_failed, st.dropped), (1, 0, 0));
}

#[test]
fn a_down_peer_is_reported_unreachable_and_send_never_blocks() {
    let addrs = free_addrs(2); // nobody listens on node 2's port
    let a = start(1, &addrs);
    let began = Instant::now();
    for i in 0..1000 {
        a.t.send(heartbeat(1, 2, i));
    }
    assert!(began.elapsed() < Duration::from_secs(1), "1,000 sends took {:?}", began.elapsed());
    for _ in 0..1000 {
        assert_eq!(a.reports.recv_timeout(WAIT), Ok(Report::Unreachable(2)));
    }
    let st = status(&a, 2);
    assert!(!st.connected);
    assert_eq!((st.sent, st.dropped), (0, 1000));

    // A snapshot to a down peer fails, once.
    a.t.send(Message { msg_type: MessageType::MsgSnapshot, from: 1, to: 2, ..Default::default() });
    assert_eq!(a.reports.recv_timeout(WAIT), Ok(Report::SnapshotFailed(2)));
    // A message to no peer at all is reported too.
    a.t.send(heartbeat(1, 9, 1));
    assert_eq!(a.reports.recv_timeout(WAIT), Ok(Report::Unreachable(9)));
    std::thread::sleep(Duration::from_millis(100));
    assert!(a.reports.try_recv().is_err());
}

#[test]
fn a_late_peer_is_connected_and_a_restarted_one_reconnected() {
    let addrs = free_addrs(2);
    let a = start(1, &addrs);
    std::thread::sleep(Duration::from_millis(700)); // a few failed connects: backoff grows
    assert!(!status(&a, 2).connected);

    let b = start(2, &addrs);
    let began = Instant::now();
    wait_connected(&a, 2);
    assert!(began.elapsed() < Duration::from_millis(2500), "backoff is capped at 1 s: {:?}", began.elapsed());
    a.t.send(heartbeat(1, 2, 1));
    assert_eq!(recv(&b.inbox).term, 1);

    // Node 2 restarts on the same port: node 1 notices, reconnects, and messages flow again.
    b.t.shutdown();
    drop(b);
    wait_until("link down noticed", || !status(&a, 2).connected);
    let b = start(2, &addrs);
    wait_connected(&a, 2);
    a.t.send(heartbeat(1, 2, 2));
    assert_eq!(recv(&b.inbox).term, 2);
    wait_connected(&b, 1);
    b.t.send(heartbeat(2, 1, 3));
    assert_eq!(recv(&a.inbox).term, 3);
}

/// Opens a raw connection to `addr` and sends `bytes`.
pub(super) fn raw(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(bytes).unwrap();
    s
}

fn hello(from: NodeId, to: NodeId) -> Vec<u8> {
    let mut out = Vec::new();
    frame::encode_hello(&Hello { version: VERSION, lane: Lane::Raft, from, to }, &mut out);
    out
}

/// Reads until the peer closes; the bytes it sent before.
pub(super) fn read_to_close(mut s: TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("connection not closed: {e}"),
        }
    }
}

#[test]
fn bad_handshakes_and_bad_frames_are_dropped_and_the_transport_keeps_working() {
    let addrs = free_addrs(2);
    let a = start(1, &addrs);
    let at = addrs[0];

    assert!(read_to_close(raw(at, &hello(2, 3))).is_empty(), "wrong `to`: closed unanswered");
    assert!(read_to_close(raw(at, &hello(9, 1))).is_empty(), "unknown `from`: closed unanswered");
    assert!(read_to_close(raw(at, &hello(1, 1))).is_empty(), "`from` myself: closed unanswered");
    assert!(read_to_close(raw(at, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")).is_empty(), "garbage");
    let mut bad_version = hello(2, 1);
    bad_version[HEADER_LEN + 4] = 0xff;
    assert!(read_to_close(raw(at, &bad_version)).is_empty(), "other version");

    // A good hello is answered; then a frame longer than the limit closes the connection.
    let mut oversized = hello(2, 1);
    oversized.extend_from_slice(&u32::MAX.to_be_bytes());
    oversized.push(frame::Kind::Raft as u8);
    let answer = read_to_close(raw(at, &oversized));
    assert_eq!(answer.len(), HEADER_LEN + HELLO_LEN, "answered the good hello");
    assert_eq!(
        frame::decode(&answer).unwrap().unwrap().0,
        frame::Frame::Hello(Hello { version: VERSION, lane: Lane::Raft, from: 1, to: 2 })
    );

    // A message whose `from` is not the handshake's peer closes the lane; nothing is delivered.
    let mut spoofed = hello(2, 1);
    frame::encode_raft(&heartbeat(3, 1, 1), &mut spoofed).unwrap();
    read_to_close(raw(at, &spoofed));
    // A snapshot chunk on a raft lane, and a hello then silence cut short, also close.
    let mut wrong_kind = hello(2, 1);
    frame::encode_ack(1, &mut wrong_kind);
    read_to_close(raw(at, &wrong_kind));
    drop(raw(at, &hello(2, 1)[..10]));
    assert!(a.inbox.try_recv().is_err(), "nothing delivered from bad connections");

    // The transport still works: the real node 2 connects both ways.
    let b = start(2, &addrs);
    wait_connected(&a, 2);
    wait_connected(&b, 1);
    b.t.send(heartbeat(2, 1, 5));
    assert_eq!(recv(&a.inbox).term, 5);
    a.t.send(heartbeat(1, 2, 6));
    assert_eq!(recv(&b.inbox).term, 6);
}

#[test]
fn a_peer_address_pointing_back_at_this_node_never_comes_up() {
    // Misconfiguration: node 2's address is node 1's own listener. Node 1's dial reaches
    // itself, sends "from 1 to 2", and its own listener refuses it (`to` is not 1).
    let addr = free_addrs(1)[0];
    let peers: BTreeMap<NodeId, SocketAddr> = [(1, addr), (2, addr)].into();
    let a = start_with(TransportConfig::new(1, addr, peers), None);
    std::thread::sleep(Duration::from_millis(500));
    assert!(!status(&a, 2).connected);
    a.t.send(heartbeat(1, 2, 1));
    assert_eq!(a.reports.recv_timeout(WAIT), Ok(Report::Unreachable(2)));
    assert!(a.inbox.try_recv().is_err());
}

#[test]
fn shutdown_is_prompt_idempotent_and_frees_the_port() {
    let addrs = free_addrs(3); // node 3 never starts: its writer is in backoff
    let (a, b) = (start(1, &addrs), start(2, &addrs));
    wait_connected(&a, 2);
    wait_connected(&b, 1);
    let began = Instant::now();
    a.t.shutdown();
    assert!(began.elapsed() < Duration::from_millis(1200), "shutdown took {:?}", began.elapsed());
    eprintln!("shutdown took {:?}", began.elapsed());
    a.t.shutdown();
    assert!(a.t.peers().iter().all(|p| !p.connected));

    a.t.send(heartbeat(1, 2, 1));
    assert_eq!(a.reports.recv_timeout(WAIT), Ok(Report::Unreachable(2)));
    a.t.send(Message { msg_type: MessageType::MsgSnapshot, from: 1, to: 2, ..Default::default() });
    assert_eq!(a.reports.recv_timeout(WAIT), Ok(Report::SnapshotFailed(2)));
    TcpListener::bind(addrs[0]).expect("port released");
    wait_until("node 2 sees the link down", || !status(&b, 1).connected);
    drop(b);
}

#[test]
fn start_refuses_a_taken_port_and_bad_configs() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let peers: BTreeMap<NodeId, SocketAddr> = [(1, addr), (2, addr)].into();
    let noop_msg = Arc::new(|_: Message| {});
    let noop_rep = Arc::new(|_: Report| {});
    let err = Transport::start(TransportConfig::new(1, addr, peers.clone()), noop_msg.clone(), noop_rep.clone()).err().unwrap();
    assert!(matches!(err, TransportError::Bind { .. }), "{err}");

    let free = free_addrs(1)[0];
    let bad = [
        TransportConfig::new(3, free, peers.clone()),
        TransportConfig { queue_capacity: 0, ..TransportConfig::new(1, free, peers.clone()) },
        TransportConfig { snapshot_chunk_bytes: 0, ..TransportConfig::new(1, free, peers.clone()) },
        TransportConfig { snapshot_chunk_bytes: frame::MAX_CHUNK_DATA + 1, ..TransportConfig::new(1, free, peers) },
    ];
    for cfg in bad {
        let err = Transport::start(cfg, noop_msg.clone(), noop_rep.clone()).err().unwrap();
        assert!(matches!(err, TransportError::Config(_)), "{err}");
    }
}

#[test]
fn a_newer_raft_lane_from_a_peer_replaces_the_older_one() {
    let addrs = free_addrs(2);
    let a = start(1, &addrs);
    let answer_len = HEADER_LEN + HELLO_LEN;
    let mut old = raw(addrs[0], &hello(2, 1));
    let mut buf = vec![0u8; answer_len];
    old.read_exact(&mut buf).unwrap();
    let mut new = raw(addrs[0], &hello(2, 1));
    new.read_exact(&mut buf).unwrap();
    assert!(read_to_close(old).is_empty(), "the older lane is closed");

    let mut frames = Vec::new();
    frame::encode_raft(&heartbeat(2, 1, 42), &mut frames).unwrap();
    frame::encode_raft(&append(2, 1, 42, 2), &mut frames).unwrap();
    new.write_all(&frames).unwrap();
    assert_eq!(recv(&a.inbox), heartbeat(2, 1, 42));
    assert_eq!(recv(&a.inbox), append(2, 1, 42, 2));
}

#[test]
fn a_snapshot_whose_receiver_goes_away_fails_exactly_once() {
    let addrs = free_addrs(2);
    let a = start(1, &addrs);
    let (gate_tx, gate_rx) = flume::bounded::<()>(1);
    let (seen_tx, seen_rx) = flume::unbounded();
    let hook: Hook = Arc::new(move |m: &Message| {
        if m.msg_type == MessageType::MsgSnapshot {
            let _ = seen_tx.send(());
            let _ = gate_rx.recv_timeout(WAIT);
        }
    });
    let b = start_with(TransportConfig::new(2, addrs[1], peer_map(&addrs)), Some(hook));
    let mut snap = Snapshot { data: vec![7u8; 3 << 20].into(), ..Default::default() };
    snap.mut_metadata().index = 10;
    a.t.send(Message { msg_type: MessageType::MsgSnapshot, from: 1, to: 2, snapshot: Some(snap).into(), ..Default::default() });
    seen_rx.recv_timeout(WAIT).expect("snapshot reached node 2");

    // Node 2 stops while its driver still holds the snapshot: no ack ever comes.
    std::thread::scope(|s| {
        s.spawn(|| b.t.shutdown());
        assert_eq!(a.reports.recv_timeout(WAIT), Ok(Report::SnapshotFailed(2)));
        gate_tx.send(()).unwrap();
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(a.reports.try_iter().all(|r| r == Report::Unreachable(2)), "one snapshot report only");
    let st = status(&a, 2);
    assert_eq!((st.snapshots_sent, st.snapshots_failed), (0, 1));
}

#[test]
fn transport_is_send_and_sync() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Transport>();
}

#[test]
fn a_peer_added_at_run_time_links_up_and_a_stranger_may_only_ask_on_the_admin_lane() {
    let addrs = free_addrs(3);
    // Nodes 1 and 2 start as a pair; node 3 starts knowing both, and asks node 1 to join.
    let first = &addrs[..2];
    let n1 = start(1, first);
    let n2 = start(2, first);
    let n3 = start(3, &addrs);
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let s = seen.clone();
    n1.t.on_admin(Arc::new(move |from, req| {
        s.lock().push((from, req.clone()));
        [b"ok: ".as_slice(), &req].concat()
    }));
    // A stranger's raft message never reaches node 1.
    n3.t.send(heartbeat(3, 1, 1));
    std::thread::sleep(Duration::from_millis(300));
    assert!(n1.inbox.try_recv().is_err(), "node 1 took a raft message from a node that is no peer");
    // But its admin request is answered, as node 3 or as a tool (node 0).
    let answer = admin_request(addrs[0], 3, 1, b"add 3", WAIT).unwrap();
    assert_eq!(answer, b"ok: add 3");
    assert_eq!(admin_request(addrs[0], 0, 1, b"status", WAIT).unwrap(), b"ok: status");
    assert_eq!(*seen.lock(), vec![(3, b"add 3".to_vec()), (0, b"status".to_vec())]);
    // Node 2 has no handler: an empty answer. The wrong node at an address: an error.
    assert_eq!(admin_request(addrs[1], 3, 2, b"add 3", WAIT).unwrap(), b"");
    assert!(admin_request(addrs[1], 3, 1, b"add 3", WAIT).is_err(), "node 2 answered as node 1");
    // Added at run time, node 3 links up with node 1 both ways, and raft messages flow.
    assert!(n1.t.add_peer(3, addrs[2]).unwrap());
    assert!(!n1.t.add_peer(3, addrs[2]).unwrap(), "a second add is no change");
    assert!(!n1.t.add_peer(1, addrs[0]).unwrap(), "this node is no peer of itself");
    wait_connected(&n1, 3);
    // Node 3's own lane to node 1 was refused until the add and comes up after its backoff:
    // a message sent before that is dropped, as for any lane that is down.
    wait_connected(&n3, 1);
    n3.t.send(heartbeat(3, 1, 2));
    let got = n1.inbox.recv_timeout(WAIT).expect("node 3's heartbeat after the add");
    assert_eq!((got.from, got.term), (3, 2));
    n1.t.send(heartbeat(1, 3, 2));
    assert_eq!(n3.inbox.recv_timeout(WAIT).expect("node 1's heartbeat to node 3").from, 1);
    assert!(n1.t.peers().iter().any(|p| p.id == 3 && p.addr == addrs[2]));
    // Removed again (the group forgot it): no longer listed, sent to, or let in.
    assert!(n1.t.remove_peer(3));
    assert!(!n1.t.remove_peer(3), "a second remove is no change");
    assert!(n1.t.peers().iter().all(|p| p.id != 3), "a removed peer is still listed");
    n1.t.send(heartbeat(1, 3, 3));
    assert!(n3.inbox.recv_timeout(Duration::from_millis(300)).is_err(), "a message reached a removed peer");
    n3.t.send(heartbeat(3, 1, 4));
    std::thread::sleep(Duration::from_millis(300));
    assert!(n1.inbox.try_iter().all(|m| m.from != 3), "a removed peer's raft message was taken");
    drop(n2);
}
