//! Regressions found by running the clients' own public test suites against ringmq and
//! RabbitMQ (issue 12; docs/client-suites.md), each restated through lapin with the
//! behaviour the suite relies on.
//!
//! - amqp091-go's `ExampleConnection_reconnect`: an auto-delete queue whose only consumer's
//!   connection just closed is redeclared at once by the next connection; the declare and the
//!   consume that follow work (RabbitMQ: by connection.close-ok the queue is gone, so the
//!   declare creates it anew).
//! - amqp091-go's `TestConcurrentClose`: 32 goroutines call `Close` at once, so several
//!   connection.close frames go out; the client must read connection.close-ok, not EOF. As
//!   RabbitMQ, the broker leaves the socket to the client to close after close-ok (ringmq for
//!   at most 1 s; RabbitMQ up to 30 s).
//! - aio-pika's `test_no_ack_redelivery`: a channel gets two messages, acks the second and
//!   closes; a basic.get on a new channel right after channel.close-ok gets the first one back
//!   (RabbitMQ: the requeue is done by close-ok).
//! - aio-pika's tests share an auto-delete exchange named `direct`: one test's queue goes with
//!   its connection, taking the exchange's last binding; the next test's exchange.declare and
//!   queue.bind right after must not meet the exchange about to go (404 on the bind).
//! - aio-pika's suite crashed ringmq once (`queue exists` panic in the queue lookup: the
//!   topology changed between two reads of it while another core deleted the queue): a
//!   lookup racing deletes answers 404 and the broker stays up.
//!
//! - kombu's `test_ack_from_another_thread` deletes the queue on the channel consuming from
//!   it: py-amqp raises `ConsumerCancelled` out of `queue_delete` when the consumer's
//!   basic.cancel comes before queue.delete-ok. RabbitMQ sends delete-ok first, on the
//!   consumer's own channel and to the connection's other channels.
//!
//! amqplib's and pika's `updateSecret` tests are in tests/connection.rs
//! (`update_secret_is_accepted_and_the_connection_goes_on`).
//! Runs against RabbitMQ too (`RINGMQ_TEST_BROKER=host:port cargo test --test client_suites`).

mod common;

use std::io::Read;
use std::time::Duration;

use common::raw::{frame, method, shortstr, RawConn, FRAME_METHOD};
use common::*;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;

/// amqp091-go's reconnect example: a publisher connection declares an auto-delete queue and
/// keeps publishing to it; each round a new consumer connection declares the same queue,
/// consumes one message, acks it and closes. The next round's declare must not meet the
/// queue half-deleted (404 on its declare or consume) and its message must arrive.
#[tokio::test]
async fn auto_delete_queue_is_redeclared_right_after_its_consumers_connection_closes() {
    let b = Broker::start();
    let q = uniq("reconnect");
    let opts = QueueDeclareOptions { auto_delete: true, ..Default::default() };
    let (pc, pub_ch) = connect_ch(&b).await;
    t("declare", pub_ch.queue_declare(q.as_str().into(), opts, FieldTable::default())).await.expect("publisher's declare");
    for round in 1..=12u32 {
        let (cc, ch) = connect_ch(&b).await;
        t("declare", ch.queue_declare(q.as_str().into(), opts, FieldTable::default()))
            .await
            .unwrap_or_else(|e| panic!("round {round}: the consumer's declare failed: {e}"));
        t("qos", ch.basic_qos(1, BasicQosOptions::default())).await.unwrap();
        let mut consumer =
            t("consume", ch.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()))
                .await
                .unwrap_or_else(|e| panic!("round {round}: basic.consume failed: {e}"));
        let body = round.to_string();
        t(
            "publish",
            pub_ch.basic_publish("".into(), q.as_str().into(), BasicPublishOptions::default(), body.as_bytes(), BasicProperties::default()),
        )
        .await
        .unwrap();
        let d = next_delivery(&mut consumer, Duration::from_secs(5)).await;
        assert_eq!(d.data, body.as_bytes(), "round {round}: another message arrived");
        t("ack", d.ack(BasicAckOptions::default())).await.unwrap();
        t("close", cc.close(200, "".into())).await.expect("connection.close-ok");
    }
    assert!(pc.status().connected(), "the publisher's connection closed");
    t("close", pc.close(200, "".into())).await.unwrap();
}

/// amqp091-go's concurrent close: connection.close sent three times back to back is answered
/// with connection.close-ok (RabbitMQ answers each), and the socket stays open for the client to close (a read
/// after close-ok does not meet EOF); one the client does not close, the broker closes itself.
#[test]
fn after_close_ok_the_client_closes_the_socket_first() {
    let b = Broker::start();
    let addr = b.addr();
    let external = b.is_external();
    let h = std::thread::spawn(move || {
        let mut c = RawConn::open(addr);
        let mut args = Vec::new();
        args.extend_from_slice(&200u16.to_be_bytes());
        shortstr(&mut args, "bye");
        args.extend_from_slice(&[0, 0, 0, 0]);
        let close = frame(FRAME_METHOD, 0, &method(10, 50, &args));
        c.write(&[close.clone(), close.clone(), close].concat());
        let ok = c.read_method();
        assert_eq!(ok.method_id(), Some((10, 51)), "expected connection.close-ok, got {ok:?}");
        // RabbitMQ answers a repeated close with another close-ok; ringmq with none.
        let close_ok = frame(FRAME_METHOD, 0, &method(10, 51, &[]));
        c.sock.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut tmp = [0u8; 64];
        for _ in 0..4 {
            match c.sock.read(&mut tmp) {
                Ok(0) => panic!("the broker closed the socket before the client did"),
                Ok(n) => {
                    assert!(tmp[..n].chunks(close_ok.len()).all(|f| f == close_ok), "more than close-ok after close-ok: {:?}", &tmp[..n])
                }
                Err(e) => {
                    assert!(
                        matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                        "the socket failed after close-ok: {e}"
                    );
                    break;
                }
            }
        }
        if !external {
            // ringmq does not wait for ever (RabbitMQ's 30 s is longer than this read's bound).
            c.sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            assert!(matches!(c.sock.read(&mut tmp), Ok(0)), "the broker kept the socket of a client that did not close it");
        }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !h.is_finished() {
        assert!(std::time::Instant::now() < deadline, "raw test did not finish within 30 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Err(e) = h.join() {
        std::panic::resume_unwind(e);
    }
}

/// aio-pika's no-ack redelivery: what a closed channel held is back in the queue by
/// channel.close-ok, so a basic.get on the next channel finds it at once (several rounds, as
/// the requeue raced the close-ok before).
#[tokio::test]
async fn a_closed_channels_unacked_message_is_back_by_close_ok() {
    let b = Broker::start();
    let c = connect(&b).await;
    let setup = t("channel.open", c.create_channel()).await.unwrap();
    let q = plain_queue(&setup, "redeliver").await;
    confirm_mode(&setup).await;
    for round in 0..10u32 {
        for n in 0..2u32 {
            let body = format!("{round}.{n}");
            publish_confirmed(&setup, "", &q, body.as_bytes(), BasicProperties::default()).await;
        }
        let ch = t("channel.open", c.create_channel()).await.unwrap();
        let first = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("first message");
        let second = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("second message");
        t("ack", second.delivery.ack(BasicAckOptions::default())).await.unwrap();
        t("channel.close", ch.close(200, "".into())).await.unwrap();
        let ch2 = t("channel.open", c.create_channel()).await.unwrap();
        let again = t("get", ch2.basic_get(q.as_str().into(), BasicGetOptions::default()))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("round {round}: the unacked message was not back by channel.close-ok"));
        assert_eq!(again.delivery.data, first.delivery.data, "round {round}: another message came back");
        assert!(again.delivery.redelivered, "round {round}: the message back is not marked redelivered");
        t("ack", again.delivery.ack(BasicAckOptions::default())).await.unwrap();
        t("channel.close", ch2.close(200, "".into())).await.unwrap();
    }
    t("close", c.close(200, "".into())).await.unwrap();
}

/// A queue looked up (basic.get) on one connection while another declares and deletes it in a
/// loop: each basic.get is answered (a message, empty, or 404 closing its channel), and the
/// broker stays up (the lookup read the topology twice and panicked when a delete committed
/// in between).
#[tokio::test]
async fn lookups_racing_deletes_get_404_and_the_broker_stays_up() {
    let b = Broker::start();
    let q = uniq("churn");
    let (dc, dch) = connect_ch(&b).await;
    let lc = connect(&b).await;
    let churn = {
        let q = q.clone();
        async move {
            for _ in 0..300 {
                t("declare", dch.queue_declare(q.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())).await.unwrap();
                t("delete", dch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await.unwrap();
            }
        }
    };
    let look = async {
        let mut ch = t("channel.open", lc.create_channel()).await.unwrap();
        for _ in 0..300 {
            match t("get", ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await {
                Ok(_) => {}
                Err(e) => {
                    assert_eq!(reply_code(&e), Some(404), "basic.get on a churning queue: {e}");
                    ch = t("channel.open", lc.create_channel()).await.expect("the connection survives the 404");
                }
            }
        }
    };
    tokio::join!(churn, look);
    assert!(lc.status().connected() && dc.status().connected(), "a connection was lost");
    let (c2, _ch2) = connect_ch(&b).await;
    t("close", c2.close(200, "".into())).await.expect("the broker still serves new connections");
}

/// aio-pika's shared auto-delete exchange: a connection binds its auto-delete queue to an
/// auto-delete exchange, consumes and closes; the next connection's exchange.declare and
/// queue.bind right after succeed (the exchange is gone by close-ok, or still there, never in
/// between).
#[tokio::test]
async fn auto_delete_exchange_redeclared_right_after_the_connection_that_bound_it_closes() {
    let b = Broker::start();
    let x = uniq("direct");
    let xopts = ExchangeDeclareOptions { auto_delete: true, ..Default::default() };
    for round in 0..12u32 {
        let (c, ch) = connect_ch(&b).await;
        t("exchange.declare", ch.exchange_declare(x.as_str().into(), lapin::ExchangeKind::Direct, xopts, FieldTable::default()))
            .await
            .unwrap_or_else(|e| panic!("round {round}: exchange.declare failed: {e}"));
        let q = uniq("bound");
        let qopts = QueueDeclareOptions { auto_delete: true, ..Default::default() };
        t("declare", ch.queue_declare(q.as_str().into(), qopts, FieldTable::default())).await.unwrap();
        t("bind", ch.queue_bind(q.as_str().into(), x.as_str().into(), "k".into(), QueueBindOptions::default(), FieldTable::default()))
            .await
            .unwrap_or_else(|e| panic!("round {round}: queue.bind failed: {e}"));
        let _consumer = t("consume", ch.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()))
            .await
            .unwrap();
        t("close", c.close(200, "".into())).await.expect("connection.close-ok");
    }
}

/// kombu's `test_ack_from_another_thread`: queue.delete on a channel that consumes from the
/// queue, with a second consumer of it on another channel of the connection. On the wire,
/// queue.delete-ok comes before either consumer's basic.cancel (RabbitMQ's order).
#[test]
fn queue_delete_ok_comes_before_its_consumers_basic_cancel() {
    let b = Broker::start();
    for round in 0..5 {
        let q = uniq("delete-order");
        let mut c = RawConn::open_notify(b.addr());
        c.open_channel(1);
        c.open_channel(2);
        c.queue_declare(1, &q);
        c.basic_consume(1, &q, "on-1");
        c.basic_consume(2, &q, "on-2");
        let mut a = Vec::new();
        a.extend_from_slice(&0u16.to_be_bytes());
        shortstr(&mut a, &q);
        a.push(0); // if-unused, if-empty, nowait: all false
        c.send_method(1, 50, 40, &a);
        let mut seen = Vec::new();
        while seen.len() < 3 {
            let f = c.read_frame().unwrap_or_else(|| panic!("round {round}: the broker sent only {seen:?}"));
            match f.method_id() {
                Some((50, 41)) => seen.push(format!("delete-ok on {}", f.channel)),
                Some((60, 30)) => seen.push(format!("cancel on {}", f.channel)),
                other => panic!("round {round}: unexpected {other:?} on channel {} after {seen:?}", f.channel),
            }
        }
        assert_eq!(seen[0], "delete-ok on 1", "round {round}: delete-ok must come first: {seen:?}");
        seen[1..].sort();
        assert_eq!(seen[1..], ["cancel on 1".to_string(), "cancel on 2".to_string()], "round {round}");
    }
}
