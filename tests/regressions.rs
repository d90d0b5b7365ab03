//! Regressions found by trying ringmq as a new user and trying to break it (each test names
//! the fault it guards against). Issue 2 items 6 and 7.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::raw::{self, longstr, queue_declare_args, shortstr, Closed, RawConn};
use common::*;

/// Runs the broker binary with `args` in `cwd`; returns the child.
fn spawn_in(cwd: &std::path::Path, args: &[&str]) -> std::process::Child {
    Command::new(broker_binary())
        .current_dir(cwd)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ringmq")
}

fn wait_accepting(port: u16, child: &mut std::process::Child) {
    // stderr is piped (read at the end), so the port accepting for 1 s in a row counts.
    wait_started(child, std::net::SocketAddr::from(([127, 0, 0, 1], port)), String::new).unwrap_or_else(|e| panic!("{e}"));
}

fn stop(mut child: std::process::Child) -> String {
    let _ = child.kill();
    let out = child.wait_with_output().expect("wait ringmq");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A relative --data-dir (the README's default `./data`) used to make the first durable
/// write fail (glommio opened directories relative to no directory) and the broker exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relative_data_dir_serves_durable_queues() {
    if std::env::var_os("RINGMQ_TEST_BROKER").is_some() {
        return eprintln!("NOTE: ringmq-only test skipped");
    }
    let cwd = tempfile::tempdir().unwrap();
    let (port, mport) = (free_port(), free_port());
    let listen = format!("127.0.0.1:{port}");
    let metrics = format!("127.0.0.1:{mport}");
    let mut child = spawn_in(cwd.path(), &["--listen", &listen, "--metrics-listen", &metrics, "--data-dir", "data", "--cores", "2"]);
    tokio::task::block_in_place(|| wait_accepting(port, &mut child));
    let uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let c = connect_uri(&uri).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    let q = declare_queue(&ch, &uniq("reldir"), lapin::options::QueueDeclareOptions::durable(), Default::default()).await;
    confirm_mode(&ch).await;
    for _ in 0..5 {
        assert!(publish_confirmed(&ch, "", &q, b"x", lapin::BasicProperties::default().with_delivery_mode(2)).await.is_ack());
    }
    assert_eq!(get_body(&ch, &q).await.as_deref(), Some(&b"x"[..]));
    assert!(child.try_wait().unwrap().is_none(), "broker still running");
    drop(c);
    stop(child);
    assert!(cwd.path().join("data").join("queues").is_dir());
}

/// Two brokers on one data directory used to interleave their metadata log writes and
/// leave a log that refused every later start. The second must refuse to start.
#[test]
fn second_broker_on_the_same_data_dir_is_refused() {
    if std::env::var_os("RINGMQ_TEST_BROKER").is_some() {
        return eprintln!("NOTE: ringmq-only test skipped");
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let (p1, m1, p2, m2) = (free_port(), free_port(), free_port(), free_port());
    let (l1, l2) = (format!("127.0.0.1:{p1}"), format!("127.0.0.1:{p2}"));
    let (ml1, ml2) = (format!("127.0.0.1:{m1}"), format!("127.0.0.1:{m2}"));
    let mut first = spawn_in(dir.path(), &["--listen", &l1, "--metrics-listen", &ml1, "--data-dir", d, "--cores", "1"]);
    wait_accepting(p1, &mut first);
    let mut second = spawn_in(dir.path(), &["--listen", &l2, "--metrics-listen", &ml2, "--data-dir", d, "--cores", "1"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = second.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "second broker neither started nor exited");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "the second broker must refuse the data dir");
    let err = stop(second);
    assert!(err.contains("in use by another ringmq"), "{err}");
    assert!(first.try_wait().unwrap().is_none(), "the first broker keeps running");
    stop(first);
    // the data dir still opens cleanly
    let p3 = free_port();
    let (l3, ml3) = (format!("127.0.0.1:{p3}"), format!("127.0.0.1:{}", free_port()));
    let mut third = spawn_in(dir.path(), &["--listen", &l3, "--metrics-listen", &ml3, "--data-dir", d, "--cores", "1"]);
    wait_accepting(p3, &mut third);
    stop(third);
}

/// A client that never answers connection.close used to crash the broker (a RefCell borrow
/// held across the close deadline).
#[test]
fn silent_client_after_connection_error_does_not_crash_the_broker() {
    let b = Broker::start();
    let mut c = RawConn::open(b.addr());
    c.send_method(9, 50, 10, &[0, 0, 1, b'q', 0, 0, 0, 0, 0]); // queue.declare on an unopened channel
    std::thread::sleep(Duration::from_millis(1600)); // past the 1 s close-ok wait, saying nothing
    let mut d = RawConn::open(b.addr());
    d.open_channel(1);
    drop(c);
}

/// A field array nested 20,000 deep (about 100 KB) in the start-ok client properties used to
/// overflow a core's stack before authentication and abort the broker.
#[test]
fn deeply_nested_tables_are_refused_not_fatal() {
    let b = Broker::start();
    // queue.declare arguments nested far deeper than the limit
    let mut c = RawConn::open(b.addr());
    c.open_channel(1);
    let depth = 20_000;
    let mut value = vec![b'S'];
    longstr(&mut value, b"x");
    for _ in 0..depth {
        let mut arr = vec![b'A'];
        arr.extend_from_slice(&(value.len() as u32).to_be_bytes());
        arr.extend_from_slice(&value);
        value = arr;
    }
    let mut table = Vec::new();
    shortstr(&mut table, "deep");
    table.extend_from_slice(&value);
    c.send_method(1, 50, 10, &queue_declare_args(&uniq("deep"), &table));
    match c.expect_close() {
        Closed::Connection { code, .. } => assert_eq!(code, 502, "deep field table"),
        other => panic!("expected connection.close 502, got {other:?}"),
    }
    // the broker is alive
    let mut d = RawConn::open(b.addr());
    d.open_channel(1);
}

/// basic.publish with immediate=true: RabbitMQ 3.x answers 540 NOT_IMPLEMENTED (the flag
/// was removed); ringmq used to accept it silently.
#[test]
fn publish_immediate_is_not_implemented() {
    let b = Broker::start();
    let mut c = RawConn::open(b.addr());
    c.open_channel(1);
    let mut args = Vec::new();
    args.extend_from_slice(&0u16.to_be_bytes());
    shortstr(&mut args, "");
    shortstr(&mut args, "nowhere");
    args.push(0b10); // immediate
    c.send_method(1, 60, 40, &args);
    match c.expect_close() {
        Closed::Connection { code, .. } => assert_eq!(code, 540, "immediate=true"),
        other => panic!("expected connection.close 540, got {other:?}"),
    }
}

/// Confirms belong to one incarnation of a channel. Persistent publishes to a durable queue
/// are pipelined in confirm mode, then the channel is closed and reopened under the same
/// number without confirm mode, in the same write: the old publishes' confirms that the
/// queue's group commit answers after the reopen must not reach the new channel (it used to
/// get basic.ack frames it never asked for; a reopened channel in confirm mode could see
/// its own publish N confirmed by the old publish N's answer, before its queue stored it).
#[test]
fn confirms_of_a_closed_channel_never_reach_its_reopened_number() {
    let b = Broker::start();
    let mut c = RawConn::open(b.addr());
    c.open_channel(1);
    c.durable_queue_in_confirm_mode(1, "confirm-incarnations");
    // 5,000 persistent publishes (delivery-mode 2), channel.close, channel.open: one write.
    let mut burst = Vec::new();
    const N: usize = 5_000;
    for _ in 0..N {
        burst.extend(RawConn::persistent_publish_frames(1, "", "confirm-incarnations", b"x"));
    }
    let mut close = Vec::new();
    close.extend_from_slice(&200u16.to_be_bytes());
    shortstr(&mut close, "bye");
    close.extend_from_slice(&0u16.to_be_bytes());
    close.extend_from_slice(&0u16.to_be_bytes());
    burst.extend(raw::frame(1, 1, &raw::method(20, 40, &close)));
    let mut open = Vec::new();
    shortstr(&mut open, "");
    burst.extend(raw::frame(1, 1, &raw::method(20, 10, &open)));
    c.write(&burst);
    // Until open-ok: the old incarnation's confirms, then close-ok.
    let (mut acked, mut reopened) = (0usize, false);
    for _ in 0..(N + 10) {
        let f = c.read_frame().expect("frames until channel.open-ok");
        match f.method_id() {
            Some((60, 80)) | Some((60, 120)) => acked += 1,
            Some((20, 11)) => {
                reopened = true;
                break;
            }
            _ => {}
        }
    }
    assert!(reopened, "no channel.open-ok");
    // Give the group commits time to answer the rest, then a round trip on the new channel.
    std::thread::sleep(Duration::from_millis(500));
    c.send_method(1, 60, 10, &[0, 0, 0, 0, 0, 1, 0]); // basic.qos prefetch 1
    let mut stray = Vec::new();
    for _ in 0..(N + 10) {
        let f = c.read_frame().expect("frames until basic.qos-ok");
        match f.method_id() {
            Some((60, 11)) => break,
            Some(id @ ((60, 80) | (60, 120))) if f.channel == 1 => stray.push(id),
            _ => {}
        }
    }
    assert!(stray.is_empty(), "{} confirms of the closed channel reached the reopened one ({acked} before the close)", stray.len());
}

/// Nothing follows a channel.close on its channel (AMQP 0-9-1 §1.5.2.5: after channel.close
/// the sender discards everything but close-ok): persistent publishes are pipelined in
/// confirm mode and then one to a missing exchange (404 closes the channel); confirms the
/// group commit completes after that close are not written (they used to be, after it).
#[test]
fn no_confirm_follows_the_channel_close() {
    let b = Broker::start();
    let mut c = RawConn::open(b.addr());
    c.open_channel(1);
    c.durable_queue_in_confirm_mode(1, "confirm-after-close");
    let mut burst = Vec::new();
    const N: usize = 5_000;
    for _ in 0..N {
        burst.extend(RawConn::persistent_publish_frames(1, "", "confirm-after-close", b"x"));
    }
    burst.extend(RawConn::persistent_publish_frames(1, "no-such-exchange", "k", b"x"));
    c.write(&burst);
    let mut closed = false;
    for _ in 0..(N + 10) {
        let f = c.read_frame().expect("frames until channel.close");
        if f.method_id() == Some((20, 40)) && f.channel == 1 {
            closed = true;
            break;
        }
    }
    assert!(closed, "no channel.close for the publish to a missing exchange");
    // Let the group commits finish, then a round trip on another channel.
    std::thread::sleep(Duration::from_millis(500));
    let mut open = Vec::new();
    shortstr(&mut open, "");
    c.send_method(2, 20, 10, &open);
    let mut after = Vec::new();
    for _ in 0..(N + 10) {
        let f = c.read_frame().expect("frames until channel.open-ok");
        if f.method_id() == Some((20, 11)) && f.channel == 2 {
            break;
        }
        if f.channel == 1 {
            after.push(f.method_id());
        }
    }
    assert!(after.is_empty(), "{} frames on channel 1 after its channel.close: {:?}", after.len(), &after[..after.len().min(5)]);
}
