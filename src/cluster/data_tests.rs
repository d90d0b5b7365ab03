//! The data lane over loopback: payloads both ways beside raft, a blocked receiver, a down
//! peer, link transitions (shutdown, restart, drop, replacement), throughput. Every wait is
//! bounded (≤ 10 s).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use raft::eraftpb::Message;

use super::frame::{self, Hello, Lane, HEADER_LEN, HELLO_LEN, MAX_FRAME_BYTES, VERSION};
use super::tests::{free_addrs, heartbeat, peer_map, raw, read_to_close, recv, wait_until, WAIT};
use super::*;

type DataHook = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// A started transport with what it delivered: raft messages, data payloads, link reports.
struct DNode {
    t: Transport,
    inbox: flume::Receiver<Message>,
    data: flume::Receiver<(NodeId, Vec<u8>)>,
    links: flume::Receiver<(NodeId, bool)>,
}

fn dstart_with(cfg: TransportConfig, hook: Option<DataHook>) -> DNode {
    let (in_tx, inbox) = flume::unbounded();
    let (data_tx, data) = flume::unbounded();
    let (link_tx, links) = flume::unbounded();
    let on_message = Arc::new(move |m: Message| {
        let _ = in_tx.send(m);
    });
    let on_data: OnData = Arc::new(move |from, p: Vec<u8>| {
        if let Some(hook) = &hook {
            hook(&p);
        }
        let _ = data_tx.send((from, p));
    });
    let on_link: OnLink = Arc::new(move |peer, up| {
        let _ = link_tx.send((peer, up));
    });
    let t = Transport::start_with_data(cfg, on_message, Arc::new(|_| {}), on_data, on_link).unwrap();
    DNode { t, inbox, data, links }
}

fn dstart(me: NodeId, addrs: &[SocketAddr]) -> DNode {
    dstart_with(TransportConfig::new(me, addrs[me as usize - 1], peer_map(addrs)), None)
}

fn link_event(node: &DNode) -> (NodeId, bool) {
    node.links.recv_timeout(WAIT).expect("a link report within 10 s")
}

fn no_link_events(node: &DNode, what: &str) {
    let extra: Vec<_> = node.links.try_iter().collect();
    assert!(extra.is_empty(), "{what}: unexpected link reports {extra:?}");
}

/// Waits for the raft lane to `peer` (the data link says nothing of it).
fn wait_raft(node: &DNode, peer: NodeId) {
    wait_until("raft lane up", || data_status(node, peer).connected);
}

fn data_status(node: &DNode, peer: NodeId) -> PeerStatus {
    node.t.peers().into_iter().find(|p| p.id == peer).unwrap()
}

/// Payload `seq` of `len` bytes (≥ 4): the sequence number, then a pattern that depends on it.
fn payload(seq: u32, len: usize) -> Vec<u8> {
    let mut p = seq.to_be_bytes().to_vec();
    p.extend((4..len).map(|i| (i as u32).wrapping_mul(31).wrapping_add(seq) as u8));
    p
}

/// Sends `make()`, waiting out a full queue (bounded; `send_data` consumes the payload, so
/// each attempt makes it anew).
fn send_retrying(t: &Transport, to: NodeId, make: impl Fn() -> Vec<u8>) {
    let deadline = Instant::now() + WAIT;
    loop {
        match t.send_data(to, make()) {
            Ok(()) => return,
            Err(DataError::Full) if Instant::now() < deadline => std::thread::sleep(Duration::from_micros(50)),
            Err(err) => panic!("send_data: {err}"),
        }
    }
}

/// The sizes of the 10,003 payloads each way: small ones, and at three points a big one.
fn sizes() -> Vec<usize> {
    let mut sizes: Vec<usize> = (0..10_000).map(|i| 4 + i % 300).collect();
    for (at, mib) in [(2500, 3), (5000, 5), (7500, 9)] {
        sizes.insert(at, mib << 20);
    }
    sizes
}

#[test]
fn payloads_flow_both_ways_intact_and_in_order_while_raft_keeps_flowing() {
    let addrs = free_addrs(2);
    let (a, b) = (dstart(1, &addrs), dstart(2, &addrs));
    assert_eq!(link_event(&a), (2, true));
    assert_eq!(link_event(&b), (1, true));
    assert!(a.t.data_up(2) && b.t.data_up(1));
    wait_raft(&a, 2);
    wait_raft(&b, 1);

    let sizes = sizes();
    std::thread::scope(|s| {
        for (from, to) in [(&a, 2), (&b, 1)] {
            let sizes = &sizes;
            s.spawn(move || {
                for (seq, &len) in sizes.iter().enumerate() {
                    send_retrying(&from.t, to, || payload(seq as u32, len));
                }
            });
        }
        // Raft keeps flowing both ways meanwhile.
        for i in 1..=50 {
            a.t.send(heartbeat(1, 2, i));
            b.t.send(heartbeat(2, 1, i));
            assert_eq!(recv(&b.inbox).term, i);
            assert_eq!(recv(&a.inbox).term, i);
        }
        for (node, from) in [(&b, 1), (&a, 2)] {
            for (seq, &len) in sizes.iter().enumerate() {
                let (got_from, got) = node.data.recv_timeout(WAIT).expect("a payload within 10 s");
                assert_eq!(got_from, from);
                assert_eq!(got.len(), len, "payload {seq} from {from}");
                assert!(got == payload(seq as u32, len), "payload {seq} from {from} intact");
            }
        }
    });
    for (node, peer) in [(&a, 2), (&b, 1)] {
        let st = data_status(node, peer);
        assert_eq!((st.data_sent, st.data_dropped, st.data_up, st.data_link), (sizes.len() as u64, 0, true, true));
        assert!(st.data_writes < st.data_sent, "batched: {} writes for {} payloads", st.data_writes, st.data_sent);
        eprintln!("data lane {} -> {peer}: {} payloads in {} writes", node.t.me(), st.data_sent, st.data_writes);
        assert_eq!(st.dropped, 0, "no raft message dropped");
    }
    no_link_events(&a, "healthy link");
    no_link_events(&b, "healthy link");
}

#[test]
fn a_blocked_receiver_is_backpressure_fills_a_tiny_queue_and_leaves_raft_alone() {
    let addrs = free_addrs(2);
    let cfg = TransportConfig { data_queue_capacity: 4, ..TransportConfig::new(1, addrs[0], peer_map(&addrs)) };
    let a = dstart_with(cfg, None);
    // Node 2's on_data holds the first payload until the gate opens.
    let (gate_tx, gate_rx) = flume::bounded::<()>(1);
    let (seen_tx, seen_rx) = flume::bounded::<()>(1);
    let first = AtomicBool::new(true);
    let hook: DataHook = Arc::new(move |_| {
        if first.swap(false, Ordering::Relaxed) {
            let _ = seen_tx.send(());
            let _ = gate_rx.recv_timeout(WAIT);
        }
    });
    let b = dstart_with(TransportConfig::new(2, addrs[1], peer_map(&addrs)), Some(hook));
    assert_eq!(link_event(&a), (2, true));
    assert_eq!(link_event(&b), (1, true));
    wait_raft(&a, 2);

    // For 300 ms, send what the lane takes: the socket buffers fill, then the writer blocks
    // and the queue of 4 stays full. send_data says Full, at once.
    a.t.send_data(2, payload(0, 256 << 10)).unwrap();
    seen_rx.recv_timeout(WAIT).expect("node 2 is inside on_data");
    let (mut accepted, mut fulls) = (1u32, 0u32);
    let began = Instant::now();
    while began.elapsed() < Duration::from_millis(300) {
        match a.t.send_data(2, payload(accepted, 256 << 10)) {
            Ok(()) => accepted += 1,
            Err(DataError::Full) => fulls += 1,
            Err(err) => panic!("send_data: {err}"),
        }
    }
    let t = Instant::now();
    assert_eq!(a.t.send_data(2, vec![1; 100]), Err(DataError::Full), "the writer is stalled");
    assert!(t.elapsed() < Duration::from_millis(50), "Full is immediate");
    eprintln!("stalled after {accepted} payloads of 256 KiB ({fulls} refused as Full)");
    assert!(fulls > 0 && accepted < 1000, "{accepted} accepted: backpressure holds");

    // For 2 s (under DATA_LINK_TIMEOUT) the receiver blocks: heartbeats still arrive at once,
    // and the link stays up.
    let mut worst = Duration::ZERO;
    let blocked = Instant::now();
    let mut term = 0;
    while blocked.elapsed() < Duration::from_secs(2) {
        term += 1;
        let sent = Instant::now();
        a.t.send(heartbeat(1, 2, term));
        assert_eq!(recv(&b.inbox).term, term);
        worst = worst.max(sent.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("{term} heartbeats beside a blocked data lane, worst latency {worst:?}");
    assert!(worst < Duration::from_millis(500), "a heartbeat took {worst:?}");
    no_link_events(&a, "blocked but healthy receiver");
    assert!(a.t.data_up(2));

    gate_tx.send(()).unwrap();
    for seq in 0..accepted {
        let (from, got) = b.data.recv_timeout(WAIT).expect("every accepted payload arrives");
        assert_eq!(from, 1);
        assert!(got == payload(seq, 256 << 10), "payload {seq}");
    }
    wait_until("all sent", || data_status(&a, 2).data_sent == u64::from(accepted));
    assert_eq!(data_status(&a, 2).data_dropped, 0);
    a.t.send_data(2, vec![7; 10]).expect("the queue drained");
    assert_eq!(b.data.recv_timeout(WAIT).unwrap(), (1, vec![7; 10]));
    no_link_events(&a, "after the block");
    no_link_events(&b, "after the block");
}

#[test]
fn send_data_to_a_down_or_unknown_peer_fails_at_once() {
    let addrs = free_addrs(2); // nobody listens on node 2's port
    let a = dstart(1, &addrs);
    std::thread::sleep(Duration::from_millis(300)); // a few failed connects
    let began = Instant::now();
    for i in 0..10_000 {
        assert_eq!(a.t.send_data(2, payload(i, 64)), Err(DataError::Down));
    }
    assert!(began.elapsed() < Duration::from_secs(1), "10,000 refusals took {:?}", began.elapsed());
    assert!(!a.t.data_up(2));
    assert_eq!(a.t.send_data(9, vec![1]), Err(DataError::UnknownPeer));
    assert!(!a.t.data_up(9));
    assert_eq!(a.t.send_data(2, vec![0; MAX_FRAME_BYTES + 1]), Err(DataError::TooLarge));
    let st = data_status(&a, 2);
    assert_eq!((st.data_up, st.data_link, st.data_sent, st.data_dropped), (false, false, 0, 0));
    no_link_events(&a, "never up");

    a.t.shutdown();
    assert_eq!(a.t.send_data(2, vec![1]), Err(DataError::Down));
}

#[test]
fn on_link_reports_each_transition_once_and_a_dead_peer_promptly() {
    let addrs = free_addrs(2);
    let a = dstart(1, &addrs);
    let b = dstart(2, &addrs);
    assert_eq!(link_event(&a), (2, true));
    assert_eq!(link_event(&b), (1, true));
    a.t.send_data(2, b"hello".to_vec()).unwrap();
    assert_eq!(b.data.recv_timeout(WAIT).unwrap(), (1, b"hello".to_vec()));

    // Node 2 shuts down: node 1 hears it at once; node 2 reports its side going too.
    let began = Instant::now();
    b.t.shutdown();
    assert_eq!(link_event(&a), (2, false));
    let noticed = began.elapsed();
    eprintln!("link down noticed {noticed:?} after the peer's shutdown");
    assert!(noticed < Duration::from_secs(3), "{noticed:?}");
    assert_eq!(link_event(&b), (1, false));
    assert_eq!(a.t.send_data(2, vec![1]), Err(DataError::Down), "the session's lanes are closed");
    drop(b);

    // It comes back on the same port: one `true` each.
    let b = dstart(2, &addrs);
    assert_eq!(link_event(&a), (2, true));
    assert_eq!(link_event(&b), (1, true));
    b.t.send_data(1, b"again".to_vec()).unwrap();
    assert_eq!(a.data.recv_timeout(WAIT).unwrap(), (2, b"again".to_vec()));

    // Its process dies (the transport is dropped, its sockets close).
    let began = Instant::now();
    drop(b);
    assert_eq!(link_event(&a), (2, false));
    eprintln!("link down noticed {:?} after the peer was dropped", began.elapsed());
    assert!(began.elapsed() < Duration::from_secs(3));
    std::thread::sleep(Duration::from_millis(300));
    no_link_events(&a, "exactly one report per transition");
    assert!(!data_status(&a, 2).data_link);
}

/// A stand-in for node `me` listening at `listener`: answers every hello and reads (and
/// discards) what follows; hands over each data lane it accepts.
fn fake_peer(listener: TcpListener, me: NodeId) -> flume::Receiver<TcpStream> {
    let (tx, rx) = flume::unbounded();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut offer = [0u8; HEADER_LEN + HELLO_LEN];
            if stream.read_exact(&mut offer).is_err() {
                continue;
            }
            let Ok(Some((frame::Frame::Hello(hello), _))) = frame::decode(&offer) else { continue };
            let mut answer = Vec::new();
            frame::encode_hello(&Hello { version: VERSION, lane: hello.lane, from: me, to: hello.from }, &mut answer);
            if stream.write_all(&answer).is_err() {
                continue;
            }
            if hello.lane == Lane::Data {
                let _ = tx.send(stream.try_clone().unwrap());
            }
            std::thread::spawn(move || std::io::copy(&mut stream, &mut std::io::sink()));
        }
    });
    rx
}

fn data_hello(from: NodeId, to: NodeId) -> Vec<u8> {
    let mut out = Vec::new();
    frame::encode_hello(&Hello { version: VERSION, lane: Lane::Data, from, to }, &mut out);
    out
}

fn answered(mut s: TcpStream) -> TcpStream {
    let mut answer = [0u8; HEADER_LEN + HELLO_LEN];
    s.read_exact(&mut answer).unwrap();
    assert_eq!(
        frame::decode(&answer).unwrap().unwrap().0,
        frame::Frame::Hello(Hello { version: VERSION, lane: Lane::Data, from: 1, to: 2 })
    );
    s
}

fn data_frames(payloads: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in payloads {
        frame::encode_data(p, &mut out).unwrap();
    }
    out
}

/// Waits until `s` is closed by the other end (EOF or reset on a read).
fn wait_closed(s: &TcpStream) {
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match (&*s).read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("not closed: {e}"),
        }
    }
}

/// Node 1 started against a fake node 2 ([`fake_peer`]): its outbound data lane is up (the
/// fake holds `out1`), no inbound one yet, so no link. Returns the addresses, the fake's
/// later lanes from node 1, node 1 and `out1`.
fn dialing_a_fake_peer() -> (Vec<SocketAddr>, flume::Receiver<TcpStream>, DNode, TcpStream) {
    let addrs = free_addrs(2);
    let fake = TcpListener::bind(addrs[1]).unwrap();
    let fake_lanes = fake_peer(fake, 2);
    let a = dstart(1, &addrs);
    let out1 = fake_lanes.recv_timeout(WAIT).expect("node 1 dials node 2's data lane");
    wait_until("data lane up", || a.t.data_up(2));
    no_link_events(&a, "outbound only");
    (addrs, fake_lanes, a, out1)
}

#[test]
fn a_newer_data_lane_replaces_the_older_one_and_ends_the_session() {
    let (addrs, fake_lanes, a, out1) = dialing_a_fake_peer();

    // An inbound lane from "node 2" completes the link.
    let mut old = answered(raw(addrs[0], &data_hello(2, 1)));
    assert_eq!(link_event(&a), (2, true));
    // An empty frame is a heartbeat (`data::SILENCE_LIMIT`): read, never delivered.
    old.write_all(&data_frames(&[b"one", b"", b"two"])).unwrap();
    for want in [&b"one"[..], b"two"] {
        assert_eq!(a.data.recv_timeout(WAIT).unwrap(), (2, want.to_vec()));
    }

    // A newer lane from node 2 replaces it: the session ends (both its lanes close), a new
    // one starts with node 1's next dial.
    let mut new = answered(raw(addrs[0], &data_hello(2, 1)));
    assert_eq!(link_event(&a), (2, false));
    assert!(read_to_close(old).is_empty(), "the older lane is closed");
    wait_closed(&out1);
    let _out2 = fake_lanes.recv_timeout(WAIT).expect("node 1 dials again");
    assert_eq!(link_event(&a), (2, true));
    new.write_all(&data_frames(&[b"three"])).unwrap();
    assert_eq!(a.data.recv_timeout(WAIT).unwrap(), (2, b"three".to_vec()));

    // A raft frame on a data lane is a protocol error: the lane closes, the link goes down.
    let mut wrong = Vec::new();
    frame::encode_raft(&heartbeat(2, 1, 1), &mut wrong).unwrap();
    new.write_all(&wrong).unwrap();
    assert!(read_to_close(new).is_empty());
    assert_eq!(link_event(&a), (2, false));
    assert!(a.data.try_recv().is_err() && a.inbox.try_recv().is_err(), "nothing delivered from it");
}

/// The peer ends its session by closing node 1's outbound lane and at once dials a new
/// inbound lane, before node 1's writer (which only writes, and looks for a close after
/// `IDLE_CHECK` idle) noticed. The link comes up with a fresh outbound lane and stays up; it
/// used to pair the closed lane with the fresh inbound one, go down at the writer's next
/// check and close the peer's fresh lane in turn: after a flapping partition two nodes
/// brought their link up and down every second for minutes (issue 40 item 2).
#[test]
fn an_outbound_lane_the_peer_closed_is_never_paired_with_its_fresh_inbound_lane() {
    let (addrs, fake_lanes, a, out1) = dialing_a_fake_peer();

    out1.shutdown(Shutdown::Both).unwrap();
    let mut inbound = answered(raw(addrs[0], &data_hello(2, 1)));
    let _out2 = fake_lanes.recv_timeout(WAIT).expect("node 1 dials a fresh outbound lane");
    assert_eq!(link_event(&a), (2, true));
    let flaps: Vec<_> = a.links.recv_timeout(Duration::from_secs(2)).into_iter().collect();
    assert!(flaps.is_empty(), "the link did not stay up: {flaps:?}");
    inbound.write_all(&data_frames(&[b"after"])).unwrap();
    assert_eq!(a.data.recv_timeout(WAIT).unwrap(), (2, b"after".to_vec()));
    assert!(data_status(&a, 2).data_link);
}

#[test]
fn start_refuses_a_zero_data_queue() {
    let free = free_addrs(1)[0];
    let peers: BTreeMap<NodeId, SocketAddr> = [(1, free), (2, free)].into();
    let cfg = TransportConfig { data_queue_capacity: 0, ..TransportConfig::new(1, free, peers) };
    let err = Transport::start(cfg, Arc::new(|_| {}), Arc::new(|_| {})).err().unwrap();
    assert!(matches!(err, TransportError::Config(_)), "{err}");
}

#[test]
fn data_lane_throughput_of_1_kib_payloads() {
    const N: u64 = 200_000;
    const LEN: usize = 1024;
    let addrs = free_addrs(2);
    let a = dstart(1, &addrs);
    let (done_tx, done_rx) = flume::bounded::<()>(1);
    let got = Arc::new(AtomicU64::new(0));
    let hook: DataHook = {
        let got = got.clone();
        Arc::new(move |p: &[u8]| {
            let seq = got.fetch_add(1, Ordering::Relaxed);
            assert_eq!(u32::from_be_bytes(p[..4].try_into().unwrap()), seq as u32, "in order");
            if seq + 1 == N {
                let _ = done_tx.send(());
            }
        })
    };
    let b = dstart_with(TransportConfig::new(2, addrs[1], peer_map(&addrs)), Some(hook));
    assert_eq!(link_event(&a), (2, true));
    // The receiver keeps only the count: drain its channel.
    let drain = std::thread::spawn(move || while b.data.recv_timeout(Duration::from_millis(500)).is_ok() {});

    let template = payload(0, LEN);
    let began = Instant::now();
    for seq in 0..N {
        send_retrying(&a.t, 2, || {
            let mut p = template.clone();
            p[..4].copy_from_slice(&(seq as u32).to_be_bytes());
            p
        });
    }
    done_rx.recv_timeout(WAIT).expect("every payload within 10 s");
    let secs = began.elapsed().as_secs_f64();
    let st = data_status(&a, 2);
    eprintln!(
        "data lane throughput ({} build): {N} payloads of {LEN} B in {secs:.3} s = {:.0} payloads/s, {:.1} MB/s ({} writes, {:.0} payloads/write)",
        if cfg!(debug_assertions) { "debug" } else { "release" },
        N as f64 / secs,
        (N as f64 * LEN as f64) / secs / 1e6,
        st.data_writes,
        st.data_sent as f64 / st.data_writes.max(1) as f64
    );
    assert_eq!(got.load(Ordering::Relaxed), N);
    drop(b.t);
    drop(a);
    drain.join().unwrap();
}

/// A silent peer (its packets vanish: no close, no reset) is reported down within about
/// [`DATA_LINK_TIMEOUT`]. Needs a network namespace of its own, where it takes the loopback
/// interface down, so it is ignored by default; run it as root with
/// `unshare -n sh -c 'ip link set lo up && <test binary> --ignored silent_peer'`.
#[test]
#[ignore = "needs a private network namespace (unshare -n) and root"]
fn a_silent_peer_is_reported_down_within_the_data_link_timeout() {
    let ip = |state: &str| {
        let ok = std::process::Command::new("ip").args(["link", "set", "lo", state]).status().map(|s| s.success());
        assert_eq!(ok.ok(), Some(true), "ip link set lo {state}");
    };
    let addrs = free_addrs(2);
    let (a, b) = (dstart(1, &addrs), dstart(2, &addrs));
    assert_eq!(link_event(&a), (2, true));
    assert_eq!(link_event(&b), (1, true));
    a.t.send_data(2, vec![1; 1000]).unwrap();
    b.data.recv_timeout(WAIT).unwrap();

    let began = Instant::now();
    ip("down");
    // Keep data in flight one way so both the idle (keepalive) and busy (retransmit) cases run.
    let _ = a.t.send_data(2, vec![2; 1000]);
    let (ea, eb) = (link_event(&a), link_event(&b));
    let noticed = began.elapsed();
    ip("up");
    eprintln!("silent peer: link down noticed after {noticed:?} ({ea:?}, {eb:?})");
    assert_eq!((ea, eb), ((2, false), (1, false)));
    assert!(noticed < DATA_LINK_TIMEOUT + Duration::from_secs(2), "{noticed:?}");
    assert_eq!(link_event(&a), (2, true), "back once the network is");
    assert_eq!(link_event(&b), (1, true));
}

/// The other side of the backpressure bound: a receiver that reads nothing for longer than
/// [`DATA_LINK_TIMEOUT`] while the sender has data waiting makes the sender's kernel drop the
/// connection (Linux applies TCP_USER_TIMEOUT to a zero window), and the link goes down.
/// Ignored by default: it takes [`DATA_LINK_TIMEOUT`] and then some.
#[test]
#[ignore = "slow: waits out DATA_LINK_TIMEOUT"]
fn a_receiver_blocked_past_the_data_link_timeout_loses_the_link() {
    let addrs = free_addrs(2);
    let a = dstart(1, &addrs);
    let (gate_tx, gate_rx) = flume::bounded::<()>(1);
    let first = AtomicBool::new(true);
    let hook: DataHook = Arc::new(move |_| {
        if first.swap(false, Ordering::Relaxed) {
            let _ = gate_rx.recv_timeout(Duration::from_secs(30));
        }
    });
    let b = dstart_with(TransportConfig::new(2, addrs[1], peer_map(&addrs)), Some(hook));
    assert_eq!(link_event(&a), (2, true));
    assert_eq!(link_event(&b), (1, true));
    let began = Instant::now();
    let mut seq = 0;
    while began.elapsed() < Duration::from_millis(300) {
        if a.t.send_data(2, payload(seq, 256 << 10)).is_ok() {
            seq += 1;
        }
    }
    let event = a.links.recv_timeout(DATA_LINK_TIMEOUT + WAIT).expect("the link goes down");
    eprintln!("receiver blocked: link down after {:?}", began.elapsed());
    assert_eq!(event, (2, false));
    assert!(began.elapsed() >= DATA_LINK_TIMEOUT - Duration::from_millis(500));
    gate_tx.send(()).unwrap();
}

#[test]
fn a_peer_that_sends_not_even_heartbeats_loses_the_link() {
    let addrs = free_addrs(2);
    let fake = TcpListener::bind(addrs[1]).unwrap();
    let fake_lanes = fake_peer(fake, 2);
    let a = dstart(1, &addrs);
    let _out = fake_lanes.recv_timeout(WAIT).expect("node 1 dials node 2's data lane");
    wait_until("data lane up", || a.t.data_up(2));
    // "Node 2" answers the handshake and then says nothing, as a frozen process whose
    // kernel still holds the connection open would.
    let mut silent = answered(raw(addrs[0], &data_hello(2, 1)));
    assert_eq!(link_event(&a), (2, true));
    let up = Instant::now();
    silent.write_all(&data_frames(&[b"", b"x"])).unwrap();
    assert_eq!(a.data.recv_timeout(WAIT).unwrap(), (2, b"x".to_vec()));
    let down = a.links.recv_timeout(data::SILENCE_LIMIT + WAIT).expect("the link goes down after the silence");
    assert_eq!(down, (2, false));
    let after = up.elapsed();
    assert!(after >= data::SILENCE_LIMIT - Duration::from_millis(200), "down after {after:?}, before the silence limit");
}
