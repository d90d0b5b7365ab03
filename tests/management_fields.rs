//! The management API fields operators read first (issue 39 item 7), through real clients:
//! a queue's `consumer_details`, a connection's `client_properties` and
//! `user_provided_name` (a lapin client that names its connection), and the `policy`,
//! `operator_policy` and `effective_policy_definition` of the queues and exchanges policies
//! apply to. (A cluster's replicated queues as `type: quorum`: tests/management.rs; the UI's
//! URL forms: tests/management_ui.rs.)
//!
//! Every broker runs on free loopback ports; every wait is bounded. Against an external
//! broker (RINGMQ_TEST_BROKER) the tests are skipped.

mod common;

use common::http::{get_json, request, wait_json, GUEST};
use common::*;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use serde_json::{json, Value};

/// `%2F`-encoded default vhost.
const V: &str = "%2F";

/// Percent-encodes every byte but letters and digits (for a path segment).
fn percent_encode(s: &str) -> String {
    s.bytes().map(|c| if c.is_ascii_alphanumeric() { (c as char).to_string() } else { format!("%{c:02X}") }).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_lists_its_consumers_and_a_connection_its_client_and_given_name() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let props = ConnectionProperties::default().with_connection_name("billing-worker-7".into());
    let conn = t("connect", Connection::connect(&b.uri(), props)).await.unwrap();
    let ch = t("channel", conn.create_channel()).await.unwrap();
    let q = plain_queue(&ch, "mgmt-consumers").await;
    t("qos", ch.basic_qos(5, BasicQosOptions::default())).await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-priority".into(), AMQPValue::LongInt(3));
    let _consumer =
        t("consume", ch.basic_consume(q.as_str().into(), "billing".into(), BasicConsumeOptions::default(), args)).await.unwrap();

    let path = format!("/api/queues/{V}/{q}");
    let (info, conns) = tokio::task::spawn_blocking(move || {
        (wait_json(port, &path, |v| v["consumer_details"].as_array().is_some_and(|l| !l.is_empty())), get_json(port, "/api/connections"))
    })
    .await
    .unwrap();
    let c = &conns[0];
    assert_eq!(c["user_provided_name"], "billing-worker-7", "{c}");
    assert_eq!(c["client_properties"]["connection_name"], "billing-worker-7", "{c}");
    assert!(c["client_properties"]["product"].is_string(), "the client's product: {c}");
    assert!(c["client_properties"]["capabilities"]["consumer_cancel_notify"] == true, "{c}");
    let name = c["name"].as_str().unwrap().to_owned();
    let peer_port = c["peer_port"].as_u64().unwrap();
    assert_eq!(name, format!("127.0.0.1:{peer_port} -> 127.0.0.1:{}", b.port()), "RabbitMQ's form: {c}");

    assert_eq!(info["consumers"], 1, "{info}");
    let d = &info["consumer_details"][0];
    assert_eq!(d["consumer_tag"], "billing", "{info}");
    assert_eq!(d["queue"], json!({"name": q, "vhost": "/"}));
    assert_eq!(d["ack_required"], true);
    assert_eq!(d["exclusive"], false);
    assert_eq!(d["active"], true);
    assert_eq!(d["prefetch_count"], 5);
    assert_eq!(d["arguments"], json!({"x-priority": 3}));
    let ch_d = &d["channel_details"];
    assert_eq!(ch_d["connection_name"], name.as_str(), "{d}");
    assert_eq!(ch_d["name"], format!("{name} (1)"));
    assert_eq!(ch_d["number"], 1);
    assert_eq!(ch_d["peer_host"], "127.0.0.1");
    assert_eq!(ch_d["peer_port"], peer_port);
    assert_eq!(ch_d["user"], "guest");

    // The connection's own page has the same.
    let one = tokio::task::spawn_blocking(move || get_json(port, &format!("/api/connections/{}", percent_encode(&name)))).await.unwrap();
    assert_eq!(one["user_provided_name"], "billing-worker-7", "{one}");
    // A client that gives no name has none (as RabbitMQ leaves the field out).
    let (_anon, _) = connect_ch(&b).await;
    let all = tokio::task::spawn_blocking(move || wait_json(port, "/api/connections", |v| v.as_array().is_some_and(|l| l.len() == 2)))
        .await
        .unwrap();
    assert_eq!(all.as_array().unwrap().iter().filter(|c| c.get("user_provided_name").is_none()).count(), 1, "{all}");
}

#[test]
fn the_policies_that_apply_are_named_on_queues_and_exchanges() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let put = |path: &str, body: Value| {
        let r = request(port, "PUT", path, Some(&body.to_string()), GUEST);
        assert!(r.status == 201 || r.status == 204, "PUT {path}: {r:?}");
    };
    put(
        &format!("/api/policies/{V}/limits"),
        json!({"pattern": "^pol\\.", "apply-to": "queues", "priority": 1, "definition": {"max-length": 100, "message-ttl": 5000}}),
    );
    put(
        &format!("/api/policies/{V}/weaker"),
        json!({"pattern": "^pol", "apply-to": "queues", "priority": 0, "definition": {"max-length": 7}}),
    );
    put(
        &format!("/api/operator-policies/{V}/cap"),
        json!({"pattern": ".*", "apply-to": "queues", "definition": {"max-length": 10, "expires": 600000}}),
    );
    put(
        &format!("/api/policies/{V}/ae"),
        json!({"pattern": "^polx", "apply-to": "exchanges", "definition": {"alternate-exchange": "amq.fanout"}}),
    );
    put(&format!("/api/queues/{V}/pol.q"), json!({"durable": true}));
    put(&format!("/api/queues/{V}/other"), json!({"durable": true}));
    put(&format!("/api/exchanges/{V}/polx.e"), json!({"type": "topic"}));

    let q = get_json(port, &format!("/api/queues/{V}/pol.q"));
    assert_eq!(q["policy"], "limits", "the highest priority applies: {q}");
    assert_eq!(q["operator_policy"], "cap", "{q}");
    assert_eq!(q["effective_policy_definition"], json!({"max-length": 10, "message-ttl": 5000, "expires": 600000}), "{q}");
    let other = get_json(port, &format!("/api/queues/{V}/other"));
    assert_eq!(other["policy"], Value::Null, "{other}");
    assert_eq!(other["operator_policy"], "cap", "{other}");
    let listed = get_json(port, &format!("/api/queues/{V}"));
    assert!(listed.as_array().unwrap().iter().any(|x| x["name"] == "pol.q" && x["policy"] == "limits"), "{listed}");
    assert_eq!(get_json(port, &format!("/api/exchanges/{V}/polx.e"))["policy"], "ae");
    assert_eq!(get_json(port, &format!("/api/exchanges/{V}/amq.direct"))["policy"], Value::Null);
}
