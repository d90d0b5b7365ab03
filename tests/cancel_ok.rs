//! basic.cancel is always answered with cancel-ok (RabbitMQ answers it for an unknown tag
//! too), even when the queue no longer holds the consumer: a client's close waits for it
//! (pika's `close()` cancels its consumers first and waited > 100 s, issue 40 item 4).
//!
//! Raw clients over loopback, so the test controls whether the client announced
//! `consumer_cancel_notify` (without it the broker sends no basic.cancel when the queue goes,
//! and the channel still holds the consumer when the client cancels it).

mod common;

use common::cluster::{my_turn, Cluster};
use common::raw::{shortstr, RawConn};
use common::*;

/// basic.cancel of `tag` on `channel` (not nowait).
fn basic_cancel(c: &mut RawConn, channel: u16, tag: &str) {
    let mut a = Vec::new();
    shortstr(&mut a, tag);
    a.push(0);
    c.send_method(channel, 60, 30, &a);
}

/// queue.delete of `queue` on `channel`, waiting for delete-ok.
fn delete_queue(c: &mut RawConn, channel: u16, queue: &str) {
    let mut a = Vec::new();
    a.extend_from_slice(&0u16.to_be_bytes());
    shortstr(&mut a, queue);
    a.push(0); // not if-unused, not if-empty, wait
    c.send_method(channel, 50, 40, &a);
    let ok = c.read_method();
    assert_eq!(ok.method_id(), Some((50, 41)), "expected queue.delete-ok, got {ok:?}");
}

/// A consumer whose queue another connection deleted (the client never heard of it: no
/// consumer_cancel_notify) is cancelled: cancel-ok comes, then the channel and the
/// connection close cleanly. Before the fix the cancel reached no queue and was dropped.
#[test]
fn a_cancel_of_a_consumer_whose_queue_was_deleted_is_answered() {
    let b = Broker::start();
    let queue = uniq("cancel-gone");
    let mut consumer = RawConn::open(b.addr());
    consumer.open_channel(1);
    consumer.queue_declare(1, &queue);
    consumer.basic_consume(1, &queue, "tag-1");

    let mut other = RawConn::open(b.addr());
    other.open_channel(1);
    delete_queue(&mut other, 1, &queue);

    basic_cancel(&mut consumer, 1, "tag-1");
    // `read_method` fails the test after its socket timeout when nothing comes.
    let answer = consumer.read_method();
    assert_eq!(answer.method_id(), Some((60, 31)), "expected basic.cancel-ok, got {answer:?}");

    // connection.close is answered too.
    let mut a = Vec::new();
    a.extend_from_slice(&200u16.to_be_bytes());
    shortstr(&mut a, "bye");
    a.extend_from_slice(&0u32.to_be_bytes());
    consumer.send_method(0, 10, 50, &a);
    let close_ok = consumer.read_method();
    assert_eq!(close_ok.method_id(), Some((10, 51)), "expected connection.close-ok, got {close_ok:?}");
}

/// The same across nodes: a consumer on node 2 of a queue node 1 serves, deleted through node
/// 1; the cancel goes to node 1, which no longer has the queue (before the fix it answered
/// nothing), and comes back as cancel-ok.
#[test]
fn a_cancel_reaching_a_node_without_the_consumer_is_answered() {
    let Some(_turn) = my_turn() else { return };
    let c = Cluster::start(3);
    let queue = uniq("cancel-remote");
    let mut owner = RawConn::open(c.amqp_addr(0));
    owner.open_channel(1);
    owner.queue_declare(1, &queue);
    let mut consumer = RawConn::open(c.amqp_addr(1));
    consumer.open_channel(1);
    consumer.basic_consume(1, &queue, "tag-remote");
    delete_queue(&mut owner, 1, &queue);

    basic_cancel(&mut consumer, 1, "tag-remote");
    let answer = consumer.read_method();
    assert_eq!(answer.method_id(), Some((60, 31)), "expected basic.cancel-ok, got {answer:?}");
}
