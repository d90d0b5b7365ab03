//! The pika (Python) client scripts of tests/clients/, driven against a started broker.
//!
//! Covers issue 2 item 8 (pika script set) and "Done when" (first bullet): 10,000 persistent
//! messages with confirms to a durable queue, consumed with manual ack, each exactly once and in
//! order; and the two-phase version across a broker restart (ringmq-only: the harness restarts
//! the broker between the phases): the durable queue and its unconsumed messages survive, the
//! non-durable queue is gone. Also issue 12 item 3 (queue length limits: drop-head with a
//! dead-letter exchange, reject-publish's basic.nack, a bad x-overflow → 406).
//! Needs python3 with pika (`python3 -m pip install pika`).

mod common;

use common::python::run_client;
use common::*;

#[test]
fn pika_basics() {
    let b = Broker::start();
    run_client("basics.py", &b.host(), b.port(), &[]);
}

/// Transactions as pika applications use them (issue 12 item 6).
#[test]
fn pika_transactions() {
    let b = Broker::start();
    run_client("tx.py", &b.host(), b.port(), &[]);
}

/// basic.recover(requeue=false) as the spec reads it (RabbitMQ refuses it with 540; README,
/// "basic.qos"): each unacked delivery goes again to the consumer that held it, redelivered,
/// under a new tag, and a consumer of the queue on another channel gets none of them.
#[test]
fn pika_recover_without_requeue() {
    let b = Broker::start();
    run_client("recover.py", &b.host(), b.port(), &[]);
}

#[test]
fn pika_length_limits() {
    let b = Broker::start();
    run_client("length_limits.py", &b.host(), b.port(), &[]);
}

#[test]
fn pika_acceptance_10000_persistent_confirmed_in_order() {
    let b = Broker::start();
    run_client("acceptance.py", &b.host(), b.port(), &[]);
}

#[test]
fn pika_acceptance_across_restart() {
    let mut b = Broker::start();
    require_own_broker!(b, "the two-phase acceptance run restarts ringmq between phases");
    let prefix = uniq("pika-restart");
    run_client("acceptance.py", &b.host(), b.port(), &["publish", &prefix]);
    b.restart();
    run_client("acceptance.py", &b.host(), b.port(), &["check", &prefix]);
}
