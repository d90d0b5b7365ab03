//! Definitions export and import (issue 39 item 6) as operators move them between brokers:
//! an export taken while a Celery worker runs (its pidbox and reply queues are exclusive and
//! bound to exchanges that are exported) imports into a fresh ringmq, over the API and with
//! Debian's `rabbitmqadmin export`/`import`; a definitions file with a binding to an absent
//! queue imports with that binding skipped (logged, and listed in the answer) and the rest
//! applied; a RabbitMQ export with fields and policy keys ringmq does not keep imports; an
//! import either applies whole or says exactly what it applied.
//!
//! Every broker runs on free loopback ports; every wait is bounded. Against an external
//! broker (RINGMQ_TEST_BROKER) the tests are skipped.

mod common;

use std::process::Command;

use common::http::{get_json, request, GUEST};
use common::*;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use serde_json::{json, Value};

/// `%2F`-encoded default vhost.
const V: &str = "%2F";

/// `rabbitmqadmin` against the management API on `port`: (success, stdout + stderr); `None`
/// when it is not installed (CI installs it: Debian's rabbitmq-server package).
fn rabbitmqadmin(port: u16, args: &[&str]) -> Option<(bool, String)> {
    let out = Command::new("rabbitmqadmin")
        .args(["-H", "127.0.0.1", "-P", &port.to_string(), "-u", "guest", "-p", "guest"])
        .args(args)
        .output()
        .ok()?;
    Some((out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))))
}

/// The (source, destination, routing key) of every binding of a definitions document.
fn bindings(defs: &Value) -> Vec<(String, String, String)> {
    let s = |b: &Value, k: &str| b[k].as_str().unwrap_or("").to_owned();
    defs["bindings"].as_array().unwrap().iter().map(|b| (s(b, "source"), s(b, "destination"), s(b, "routing_key"))).collect()
}

fn names(list: &Value) -> Vec<String> {
    list.as_array().unwrap().iter().map(|o| o["name"].as_str().unwrap().to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_taken_beside_a_celery_worker_imports_into_a_fresh_broker() {
    let a = Broker::start();
    require_own_broker!(a, "two brokers of our own");
    // What a Celery worker declares: its task queue (durable, bound to a direct exchange),
    // and its pidbox and reply queues (exclusive), bound to fanout exchanges.
    let (_conn, ch) = connect_ch(&a).await;
    let declare_x = |name: &'static str, kind: lapin::ExchangeKind| {
        let ch = ch.clone();
        async move {
            let opts = ExchangeDeclareOptions { durable: true, ..Default::default() };
            t("exchange.declare", ch.exchange_declare(name.into(), kind, opts, FieldTable::default())).await.unwrap();
        }
    };
    declare_x("celery", lapin::ExchangeKind::Direct).await;
    declare_x("celery.pidbox", lapin::ExchangeKind::Fanout).await;
    declare_x("celeryev", lapin::ExchangeKind::Topic).await;
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    let exclusive = QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() };
    declare_queue(&ch, "celery", durable, FieldTable::default()).await;
    declare_queue(&ch, "celery@worker1.celery.pidbox", exclusive, FieldTable::default()).await;
    declare_queue(&ch, "celeryev.6f1c", exclusive, FieldTable::default()).await;
    for (q, x, rk) in
        [("celery", "celery", "celery"), ("celery@worker1.celery.pidbox", "celery.pidbox", ""), ("celeryev.6f1c", "celeryev", "worker.#")]
    {
        t("queue.bind", ch.queue_bind(q.into(), x.into(), rk.into(), QueueBindOptions::default(), FieldTable::default())).await.unwrap();
    }

    // The export leaves out the exclusive queues and the bindings to them, nothing else.
    let defs = get_json(a.management_port(), "/api/definitions");
    assert_eq!(names(&defs["queues"]), ["celery"], "{defs}");
    assert_eq!(bindings(&defs), [("celery".to_owned(), "celery".to_owned(), "celery".to_owned())], "{defs}");
    let mut exchanges = names(&defs["exchanges"]);
    exchanges.sort();
    assert_eq!(exchanges, ["celery", "celery.pidbox", "celeryev"], "{defs}");

    // It imports whole into a fresh broker, nothing skipped.
    let b = Broker::start();
    let r = request(b.management_port(), "POST", "/api/definitions", Some(&defs.to_string()), GUEST);
    assert_eq!(r.status, 200, "{r:?}\n{}", b.log());
    assert_eq!(r.json()["skipped"], json!([]), "{r:?}");
    assert_eq!(r.json()["applied"]["bindings"].as_array().map(Vec::len), Some(1), "{r:?}");
    let there = get_json(b.management_port(), &format!("/api/bindings/{V}/e/celery/q/celery"));
    assert_eq!(there.as_array().map(Vec::len), Some(1), "{there}");

    // The same through rabbitmqadmin export / import.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("defs.json");
    let file = file.to_str().unwrap();
    let Some((ok, out)) = rabbitmqadmin(a.management_port(), &["export", file]) else {
        skip_unless_ci("CI needs rabbitmqadmin (.ci/run installs it)");
        return;
    };
    assert!(ok, "rabbitmqadmin export: {out}");
    let c = Broker::start();
    let (ok, out) = rabbitmqadmin(c.management_port(), &["import", file]).unwrap();
    assert!(ok, "rabbitmqadmin import: {out}\n{}", c.log());
    let imported = get_json(c.management_port(), "/api/definitions");
    assert_eq!(names(&imported["queues"]), ["celery"], "{imported}");
    assert_eq!(bindings(&imported), bindings(&defs), "{imported}");
}

#[test]
fn a_binding_to_an_absent_queue_is_skipped_with_a_warning_and_the_rest_imported() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's import report");
    let port = b.management_port();
    // An export of the kind an older broker made: the binding to a left-out exclusive queue
    // comes first, the bindings after it must still go in.
    let defs = json!({
        "rabbit_version": "3.13.7",
        "queues": [{"name": "jobs", "vhost": "/", "durable": true, "auto_delete": false, "arguments": {}},
                   {"name": "audit", "vhost": "/", "durable": true, "auto_delete": false, "arguments": {}}],
        "exchanges": [{"name": "work", "vhost": "/", "type": "topic", "durable": true, "auto_delete": false, "internal": false, "arguments": {}}],
        "bindings": [
            {"source": "work", "vhost": "/", "destination": "celery@gone.celery.pidbox", "destination_type": "queue", "routing_key": "", "arguments": {}},
            {"source": "work", "vhost": "/", "destination": "jobs", "destination_type": "queue", "routing_key": "job.*", "arguments": {}},
            {"source": "nowhere", "vhost": "/", "destination": "jobs", "destination_type": "queue", "routing_key": "x", "arguments": {}},
            {"source": "amq.topic", "vhost": "/", "destination": "audit", "destination_type": "queue", "routing_key": "#", "arguments": {}}
        ]
    });
    let r = request(port, "POST", "/api/definitions", Some(&defs.to_string()), GUEST);
    assert_eq!(r.status, 200, "{r:?}");
    let report = r.json();
    let skipped = report["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 2, "{report}");
    assert_eq!(skipped[0]["kind"], "binding");
    assert_eq!(skipped[0]["destination"], "celery@gone.celery.pidbox");
    assert_eq!(skipped[0]["reason"], "destination queue 'celery@gone.celery.pidbox' does not exist", "{report}");
    assert_eq!(skipped[1]["reason"], "source exchange 'nowhere' does not exist", "{report}");
    assert_eq!(report["applied"]["queues"], json!([{"vhost": "/", "name": "jobs"}, {"vhost": "/", "name": "audit"}]), "{report}");
    assert_eq!(report["applied"]["bindings"].as_array().map(Vec::len), Some(2), "{report}");
    assert_eq!(get_json(port, &format!("/api/bindings/{V}/e/work/q/jobs"))[0]["routing_key"], "job.*");
    assert_eq!(get_json(port, &format!("/api/bindings/{V}/e/amq.topic/q/audit"))[0]["routing_key"], "#");
    assert!(b.log().contains("definitions import: skipped"), "the skip is logged:\n{}", b.log());
}

#[test]
fn an_import_applies_whole_or_reports_what_it_applied() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's import report");
    let port = b.management_port();
    // Malformed (a binding without a destination, after a good queue): nothing is applied.
    let bad = json!({"queues": [{"name": "first", "vhost": "/", "durable": true}], "bindings": [{"source": "amq.direct", "vhost": "/"}]});
    let r = request(port, "POST", "/api/definitions", Some(&bad.to_string()), GUEST);
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(request(port, "GET", &format!("/api/queues/{V}/first"), None, GUEST).status, 404, "nothing applied");
    // A refusal while applying (an existing queue declared otherwise): the answer lists what
    // went in before it.
    assert_eq!(request(port, "PUT", &format!("/api/queues/{V}/second"), Some(r#"{"durable":false}"#), GUEST).status, 201);
    let clash = json!({"queues": [{"name": "first", "vhost": "/", "durable": true}, {"name": "second", "vhost": "/", "durable": true}],
                       "bindings": [{"source": "amq.direct", "vhost": "/", "destination": "first", "destination_type": "queue", "routing_key": "k"}]});
    let r = request(port, "POST", "/api/definitions", Some(&clash.to_string()), GUEST);
    assert_eq!(r.status, 400, "{r:?}");
    let report = r.json();
    assert!(report["reason"].as_str().unwrap().contains("inequivalent arg 'durable'"), "{report}");
    assert_eq!(report["applied"]["queues"], json!([{"vhost": "/", "name": "first"}]), "{report}");
    assert_eq!(report["applied"]["bindings"], json!([]), "{report}");
}

#[test]
fn a_rabbitmq_export_with_fields_ringmq_does_not_keep_imports() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's import");
    let port = b.management_port();
    // The shape of a RabbitMQ 3.13 export: vhost metadata and default queue type, user
    // limits, a classic-mirroring policy (ha-* keys: RabbitMQ 3's, not applied here) beside a
    // key that applies, cluster_name, topic permissions, a quorum queue.
    let defs = json!({
        "rabbit_version": "3.13.7", "rabbitmq_version": "3.13.7", "product_name": "RabbitMQ", "product_version": "3.13.7",
        "users": [{"name": "app", "password_hash": "rIb9tl/EuE4Z5e3BkZlfZA4BGKaVOE3A4CtKZniTJVB/usxA",
                   "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": [], "limits": {"max-connections": 10}}],
        "vhosts": [{"name": "shop", "description": "orders", "tags": ["prod"], "default_queue_type": "quorum",
                    "metadata": {"description": "orders", "tags": ["prod"], "default_queue_type": "quorum"}, "limits": []}],
        "permissions": [{"user": "app", "vhost": "shop", "configure": ".*", "write": ".*", "read": ".*"}],
        "topic_permissions": [{"user": "app", "vhost": "shop", "exchange": "amq.topic", "write": ".*", "read": ".*"}],
        "parameters": [],
        "global_parameters": [{"name": "cluster_name", "value": "rabbit@prod-1"}, {"name": "internal_cluster_id", "value": "rabbitmq-cluster-id-x"}],
        "policies": [{"vhost": "shop", "name": "ha-all", "pattern": "^orders", "apply-to": "queues", "priority": 0,
                      "definition": {"ha-mode": "all", "ha-sync-mode": "automatic", "max-length": 1000}}],
        "queues": [{"name": "orders", "vhost": "shop", "durable": true, "auto_delete": false, "arguments": {"x-queue-type": "quorum"}}],
        "exchanges": [{"name": "orders", "vhost": "shop", "type": "direct", "durable": true, "auto_delete": false, "internal": false, "arguments": {}}],
        "bindings": [{"source": "orders", "vhost": "shop", "destination": "orders", "destination_type": "queue", "routing_key": "new", "arguments": {}}]
    });
    let r = request(port, "POST", "/api/definitions", Some(&defs.to_string()), GUEST);
    assert_eq!(r.status, 200, "{r:?}\n{}", b.log());
    let skipped: Vec<String> = r.json()["skipped"].as_array().unwrap().iter().map(|s| s["kind"].as_str().unwrap().to_owned()).collect();
    assert_eq!(skipped, ["topic_permissions", "global_parameters", "policy keys"], "{r:?}");
    let policy = get_json(port, "/api/policies/shop/ha-all");
    assert_eq!(policy["definition"], json!({"max-length": 1000}), "the key that applies is kept: {policy}");
    assert_eq!(get_json(port, "/api/queues/shop/orders")["durable"], true);
    assert_eq!(get_json(port, "/api/bindings/shop/e/orders/q/orders")[0]["routing_key"], "new");
    assert_eq!(get_json(port, "/api/permissions/shop/app")["configure"], ".*");
}
