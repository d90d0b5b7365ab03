//! Where a queue lives (issue 15 item 3): a queue declared by a client connection is owned by
//! the core serving that connection (RabbitMQ's `client-local` locator, for the cores of a
//! node), so its deliveries to that connection never cross cores; while the cores stay
//! balanced. One connection declaring a whole topology still spreads it over the cores.
//! `x-queue-leader-locator=balanced` (RabbitMQ's argument) asks for the spread of the name
//! hash instead. `GET /api/queues` and `GET /api/connections` show ringmq's `core` of each.
//!
//! ringmq only (the core is ringmq's notion); every wait is bounded.

mod common;

use std::collections::HashMap;

use common::http::get_json;
use common::raw::RawConn;
use common::*;
use serde_json::Value;

/// `core` of every listed object, by `key`.
fn cores_by(list: &Value, key: &str) -> HashMap<String, u64> {
    list.as_array().expect("a JSON array").iter().map(|o| (o[key].to_string(), o["core"].as_u64().expect("a core"))).collect()
}

#[test]
fn a_queue_lives_on_the_core_of_the_connection_that_declares_it() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's cores");
    let port = b.management_port();
    // Connections until both cores serve one (the kernel picks the core; 16 at most).
    let mut conns: Vec<(u16, String, RawConn)> = Vec::new();
    for k in 0..16 {
        let mut c = RawConn::open(b.addr());
        c.open_channel(1);
        let q = uniq(&format!("placed-{k}"));
        c.queue_declare(1, &q);
        conns.push((c.sock.local_addr().unwrap().port(), q, c));
        let by_port = cores_by(&get_json(port, "/api/connections"), "peer_port");
        let seen: std::collections::HashSet<u64> = conns.iter().filter_map(|(p, _, _)| by_port.get(&p.to_string()).copied()).collect();
        if seen.len() == 2 && k >= 3 {
            break;
        }
    }
    let by_port = cores_by(&get_json(port, "/api/connections"), "peer_port");
    let by_queue = cores_by(&get_json(port, "/api/queues"), "name");
    let mut cores = std::collections::HashSet::new();
    for (p, q, _) in &conns {
        let conn_core = by_port[&p.to_string()];
        cores.insert(conn_core);
        assert_eq!(by_queue[&format!("\"{q}\"")], conn_core, "queue {q} and the connection that declared it (port {p})");
    }
    assert_eq!(cores.len(), 2, "16 connections all on one core: {by_port:?}");
}

#[test]
fn one_connection_declaring_many_queues_spreads_them_over_the_cores() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's cores");
    let mut c = RawConn::open(b.addr());
    c.open_channel(1);
    for k in 0..200 {
        c.queue_declare(1, &uniq(&format!("spread-{k}")));
    }
    let by_queue = cores_by(&get_json(b.management_port(), "/api/queues"), "name");
    assert_eq!(by_queue.len(), 200);
    let on0 = by_queue.values().filter(|&&c| c == 0).count();
    let on1 = by_queue.len() - on0;
    // The declaring core takes queues until it is more than the slack ahead (16, or a
    // quarter of the average per core: 25 here), then the other does.
    assert!(on0.abs_diff(on1) <= 26, "{on0} on core 0, {on1} on core 1");
    assert!(on0.min(on1) >= 80, "{on0} on core 0, {on1} on core 1");
}

#[test]
fn the_balanced_leader_locator_spreads_one_connections_queues() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's cores");
    let mut c = RawConn::open(b.addr());
    c.open_channel(1);
    let (local, balanced) = (uniq("local"), uniq("balanced"));
    // 16 queues each way: within the slack, client-local puts all of them on this core.
    let mut table = Vec::new();
    common::raw::shortstr(&mut table, "x-queue-leader-locator");
    table.push(b'S');
    common::raw::longstr(&mut table, b"balanced");
    // The client-local ones first: the balanced ones then count toward the slack.
    for k in 0..16 {
        c.queue_declare(1, &format!("{local}-{k}"));
    }
    for k in 0..16 {
        c.send_method(1, 50, 10, &common::raw::queue_declare_args(&format!("{balanced}-{k}"), &table));
        assert_eq!(c.read_method().method_id(), Some((50, 11)), "declare-ok with x-queue-leader-locator");
    }
    let by_queue = cores_by(&get_json(b.management_port(), "/api/queues"), "name");
    let cores_of = |prefix: &str| -> std::collections::HashSet<u64> {
        by_queue.iter().filter(|(n, _)| n.starts_with(&format!("\"{prefix}-"))).map(|(_, &c)| c).collect()
    };
    assert_eq!(cores_of(&local).len(), 1, "client-local: all on the declaring connection's core: {by_queue:?}");
    assert_eq!(cores_of(&balanced).len(), 2, "balanced: over both cores: {by_queue:?}");
}
