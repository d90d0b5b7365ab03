//! The management HTTP API (issue 13, items 1 and 4) as its users meet it: raw HTTP for the
//! endpoints, status codes and shapes; lapin clients for what the API must show and close;
//! Debian's `rabbitmqadmin` (the reference client) for its commands; and a 3-node cluster
//! where any node's API lists every queue with its depth.
//!
//! Every broker runs on free loopback ports; every wait is bounded. Against an external
//! broker (RINGMQ_TEST_BROKER) the tests are skipped.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::http::{get_json, request, try_request, try_request_with, wait_json, GUEST};
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use serde_json::{json, Value};

/// `%2F`-encoded default vhost.
const V: &str = "%2F";

fn put(port: u16, path: &str, body: Value) -> u16 {
    request(port, "PUT", path, Some(&body.to_string()), GUEST).status
}

#[test]
fn basic_auth_is_required_and_checked() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let r = request(port, "GET", "/api/overview", None, None);
    assert_eq!(r.status, 401, "{r:?}");
    assert!(r.header("www-authenticate").is_some_and(|h| h.starts_with("Basic")), "{r:?}");
    assert_eq!(r.json()["error"], "not_authorized");
    let r = request(port, "GET", "/api/overview", None, Some(("guest", "wrong")));
    assert_eq!(r.status, 401, "{r:?}");
    let r = request(port, "GET", "/api/whoami", None, GUEST);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json(), json!({"name": "guest", "tags": ["administrator"]}));
    assert!(b.log().contains("management API login refused"), "a refused login is logged:\n{}", b.log());
}

#[test]
fn overview_nodes_vhosts_and_health_have_rabbitmq_shapes() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let o = get_json(port, "/api/overview");
    for key in ["rabbitmq_version", "management_version", "cluster_name", "node"] {
        assert!(o[key].is_string(), "overview.{key}: {o}");
    }
    assert_eq!(o["object_totals"]["exchanges"], 6, "the default and amq.* exchanges: {o}");
    assert!(o["queue_totals"]["messages"].is_u64(), "{o}");
    assert!(o["message_stats"]["publish_details"]["rate"].is_number(), "{o}");
    let amqp = o["listeners"].as_array().unwrap().iter().any(|l| l["protocol"] == "amqp" && l["port"] == b.port());
    assert!(amqp, "the AMQP listener is listed: {o}");
    let nodes = get_json(port, "/api/nodes");
    assert_eq!(nodes.as_array().unwrap().len(), 1, "{nodes}");
    assert_eq!(nodes[0]["running"], true);
    assert!(nodes[0]["fd_used"].as_u64().unwrap() > 0, "{nodes}");
    let paged = get_json(port, "/api/exchanges?page=1&page_size=2&sort=name&columns=name,type");
    assert_eq!(paged["total_count"], 6, "{paged}");
    assert_eq!(paged["page_count"], 3);
    assert_eq!(paged["items"], json!([{"name": "", "type": "direct"}, {"name": "amq.direct", "type": "direct"}]));
    let vhosts = get_json(port, "/api/vhosts");
    assert_eq!(vhosts[0]["name"], "/", "{vhosts}");
    assert_eq!(get_json(port, &format!("/api/vhosts/{V}"))["name"], "/");
    assert_eq!(put(port, "/api/vhosts/staging", json!({})), 201);
    assert_eq!(put(port, "/api/vhosts/staging", json!({})), 204);
    assert_eq!(get_json(port, "/api/vhosts").as_array().unwrap().len(), 2);
    for path in ["/api/health/checks/alarms", "/api/health/checks/local-alarms", "/api/health/checks/ready"] {
        assert_eq!(get_json(port, path), json!({"status": "ok"}), "{path}");
    }
}

#[test]
fn unknown_objects_bad_json_and_other_methods_get_json_errors() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    for path in [format!("/api/queues/{V}/nope"), format!("/api/exchanges/{V}/nope"), "/api/queues/nope".into(), "/api/nonsense".into()] {
        let r = request(port, "GET", &path, None, GUEST);
        assert_eq!(r.status, 404, "{path}: {r:?}");
        assert_eq!(r.json(), json!({"error": "Object Not Found", "reason": "Not Found"}), "{path}");
    }
    let r = request(port, "PUT", &format!("/api/queues/{V}/q"), Some("{not json"), GUEST);
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(r.json()["error"], "bad_request");
    let r = request(port, "POST", "/api/overview", Some("{}"), GUEST);
    assert_eq!(r.status, 405, "{r:?}");
    assert!(r.json()["error"].is_string());
    let r = request(port, "DELETE", &format!("/api/queues/{V}/nope"), None, GUEST);
    assert_eq!(r.status, 404, "{r:?}");
    // The broker still serves after all that.
    assert_eq!(get_json(port, "/api/whoami")["name"], "guest");
}

#[test]
fn queues_declare_publish_get_purge_and_delete() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let q = format!("/api/queues/{V}/jobs");
    assert_eq!(put(port, &q, json!({"durable": true, "arguments": {"x-max-length": 100}})), 201);
    assert_eq!(put(port, &q, json!({"durable": true, "arguments": {"x-max-length": 100}})), 204, "redeclare");
    let r = request(port, "PUT", &q, Some(&json!({"durable": false}).to_string()), GUEST);
    assert_eq!(r.status, 400, "inequivalent redeclare: {r:?}");
    assert!(r.json()["reason"].as_str().unwrap().contains("inequivalent arg 'durable'"), "{r:?}");
    let r = request(port, "PUT", &format!("/api/queues/{V}/amq.x"), Some("{}"), GUEST);
    assert_eq!(r.status, 403, "reserved prefix, as queue.declare: {r:?}");
    let publish = |body: &str| {
        let msg = json!({"routing_key": "jobs", "payload": body, "payload_encoding": "string", "properties": {"delivery_mode": 2, "headers": {"h": 1}}});
        request(port, "POST", &format!("/api/exchanges/{V}/amq.default/publish"), Some(&msg.to_string()), GUEST).json()
    };
    for i in 0..3 {
        assert_eq!(publish(&format!("m{i}")), json!({"routed": true}));
    }
    let nowhere = json!({"routing_key": "no-such-queue", "payload": "x", "payload_encoding": "string", "properties": {}});
    let r = request(port, "POST", &format!("/api/exchanges/{V}/amq.default/publish"), Some(&nowhere.to_string()), GUEST);
    assert_eq!(r.json(), json!({"routed": false}));
    let info = wait_json(port, &q, |v| v["messages"] == 3);
    assert_eq!(info["messages"], 3, "{info}");
    assert_eq!(info["messages_ready"], 3);
    assert_eq!(info["messages_unacknowledged"], 0);
    assert_eq!(info["durable"], true);
    assert_eq!(info["arguments"], json!({"x-max-length": 100}));
    assert_eq!(info["state"], "running");
    assert_eq!(info["message_stats"]["publish"], 3, "{info}");
    // get: requeued (redelivered next time), then consumed for good.
    let get = |body: Value| request(port, "POST", &format!("{q}/get"), Some(&body.to_string()), GUEST).json();
    let got = get(json!({"count": 2, "ackmode": "ack_requeue_true", "encoding": "auto"}));
    assert_eq!(got.as_array().unwrap().len(), 2, "{got}");
    assert_eq!(got[0]["payload"], "m0");
    assert_eq!(got[0]["properties"]["headers"], json!({"h": 1}));
    assert_eq!(got[0]["redelivered"], false);
    let got = get(json!({"count": 1, "ackmode": "ack_requeue_false", "encoding": "base64"}));
    assert_eq!(got[0]["payload_encoding"], "base64");
    assert_eq!(got[0]["payload"], "bTA=", "m0 in base64: {got}");
    assert_eq!(got[0]["redelivered"], true, "requeued by the first get");
    assert_eq!(wait_json(port, &q, |v| v["messages"] == 2)["messages"], 2);
    let got = get(json!({"count": 1, "ackmode": "ack_requeue_true", "encoding": "auto", "truncate": 1}));
    assert_eq!(got[0]["payload"], "m", "truncated to 1 byte: {got}");
    assert_eq!(got[0]["payload_bytes"], 2);
    // delete if-empty refuses; purge; then it goes.
    let r = request(port, "DELETE", &format!("{q}?if-empty=true"), None, GUEST);
    assert_eq!(r.status, 400, "if-empty on a queue with messages: {r:?}");
    assert_eq!(request(port, "DELETE", &format!("{q}/contents"), None, GUEST).status, 204);
    assert_eq!(wait_json(port, &q, |v| v["messages"] == 0)["messages"], 0);
    assert_eq!(request(port, "DELETE", &format!("{q}?if-empty=true"), None, GUEST).status, 204);
    assert_eq!(request(port, "GET", &q, None, GUEST).status, 404);
}

#[test]
fn exchanges_and_bindings_round_trip() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    assert_eq!(put(port, &format!("/api/exchanges/{V}/events"), json!({"type": "topic", "durable": "true"})), 201);
    assert_eq!(put(port, &format!("/api/exchanges/{V}/fan"), json!({"type": "fanout"})), 201);
    let r = request(port, "PUT", &format!("/api/exchanges/{V}/events"), Some(&json!({"type": "direct"}).to_string()), GUEST);
    assert_eq!(r.status, 400, "inequivalent type: {r:?}");
    assert_eq!(put(port, &format!("/api/queues/{V}/audit"), json!({})), 201);
    let x = get_json(port, &format!("/api/exchanges/{V}/events"));
    assert_eq!((x["type"].as_str(), x["durable"].as_bool()), (Some("topic"), Some(true)), "{x}");
    let bind = request(port, "POST", &format!("/api/bindings/{V}/e/events/q/audit"), Some(r#"{"routing_key":"user.#"}"#), GUEST);
    assert_eq!(bind.status, 201, "{bind:?}");
    assert_eq!(bind.header("location"), Some("user.%23"));
    let e2e = request(port, "POST", &format!("/api/bindings/{V}/e/events/e/fan"), Some(r#"{"routing_key":"x"}"#), GUEST);
    assert_eq!(e2e.status, 201, "{e2e:?}");
    let list = get_json(port, &format!("/api/bindings/{V}/e/events/q/audit"));
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list[0]["routing_key"], "user.#");
    assert_eq!(list[0]["properties_key"], "user.%23");
    let all = get_json(port, &format!("/api/bindings/{V}"));
    let rows: Vec<(String, String, String)> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["source"].as_str().unwrap().into(),
                b["destination"].as_str().unwrap().into(),
                b["destination_type"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert!(rows.contains(&("".into(), "audit".into(), "queue".into())), "default binding listed: {rows:?}");
    assert!(rows.contains(&("events".into(), "fan".into(), "exchange".into())), "e2e binding listed: {rows:?}");
    // Routed through the binding: publish to the exchange lands in the queue.
    let msg = json!({"routing_key": "user.created", "payload": "u1", "payload_encoding": "string", "properties": {}});
    let r = request(port, "POST", &format!("/api/exchanges/{V}/events/publish"), Some(&msg.to_string()), GUEST);
    assert_eq!(r.json(), json!({"routed": true}));
    assert_eq!(wait_json(port, &format!("/api/queues/{V}/audit"), |v| v["messages"] == 1)["messages"], 1);
    // Unbind by properties key; a missing key is 404.
    let path = format!("/api/bindings/{V}/e/events/q/audit/other.%2523");
    assert_eq!(request(port, "DELETE", &path, None, GUEST).status, 404, "a key that names no binding");
    let one = format!("/api/bindings/{V}/e/events/q/audit/user.%2523");
    assert_eq!(get_json(port, &one)["routing_key"], "user.#", "the key as listed, quoted once more in the URL");
    assert_eq!(request(port, "DELETE", &one, None, GUEST).status, 204);
    assert_eq!(get_json(port, &format!("/api/bindings/{V}/e/events/q/audit")), json!([]));
    let r = request(port, "DELETE", &format!("/api/exchanges/{V}/events?if-unused=true"), None, GUEST);
    assert_eq!(r.status, 400, "still the source of the e2e binding: {r:?}");
    assert_eq!(request(port, "DELETE", &format!("/api/exchanges/{V}/events"), None, GUEST).status, 204);
    assert_eq!(request(port, "GET", &format!("/api/exchanges/{V}/events"), None, GUEST).status, 404);
    let r = request(port, "DELETE", &format!("/api/exchanges/{V}/amq.direct"), None, GUEST);
    assert_eq!(r.status, 403, "predeclared exchanges stay: {r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_channels_consumers_and_unacked_deliveries() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let (conn, ch) = connect_ch(&b).await;
    let q = plain_queue(&ch, "mgmt-unacked").await;
    confirm_mode(&ch).await;
    for i in 0..3u8 {
        assert!(publish_confirmed(&ch, "", &q, &[b'a' + i], Default::default()).await.is_ack());
    }
    t("qos", ch.basic_qos(2, Default::default())).await.unwrap();
    let mut cons =
        t("consume", ch.basic_consume(q.as_str().into(), "watcher".into(), Default::default(), FieldTable::default())).await.unwrap();
    let first = next_delivery(&mut cons, Duration::from_secs(5)).await;
    let _second = next_delivery(&mut cons, Duration::from_secs(5)).await;
    t("ack first", first.ack(Default::default())).await.unwrap();
    let qpath = format!("/api/queues/{V}/{q}");
    let info = tokio::task::spawn_blocking(move || {
        wait_json(port, &qpath, |v| v["messages_unacknowledged"] == 2 && v["message_stats"]["ack"] == 1)
    })
    .await
    .unwrap();
    assert_eq!(info["consumers"], 1, "{info}");
    assert_eq!(info["messages_unacknowledged"], 2, "prefetch 2, one acked, one more delivered: {info}");
    assert_eq!(info["message_stats"]["ack"], 1, "{info}");
    let q2 = q.clone();
    let (conns, chans, consumers, unacked) = tokio::task::spawn_blocking(move || {
        (
            get_json(port, "/api/connections"),
            get_json(port, "/api/channels"),
            get_json(port, "/api/consumers"),
            get_json(port, &format!("/api/queues/{V}/{q2}/unacked")),
        )
    })
    .await
    .unwrap();
    assert_eq!(conns.as_array().unwrap().len(), 1, "{conns}");
    assert_eq!(conns[0]["user"], "guest");
    assert_eq!(conns[0]["channels"], 1);
    assert_eq!(chans[0]["consumer_count"], 1, "{chans}");
    assert_eq!(chans[0]["confirm"], true);
    assert_eq!(chans[0]["messages_unacknowledged"], 2);
    assert_eq!(consumers[0]["consumer_tag"], "watcher", "{consumers}");
    assert_eq!(consumers[0]["queue"]["name"], q.as_str());
    assert_eq!(consumers[0]["prefetch_count"], 2);
    let rows = unacked.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{unacked}");
    let tags: Vec<u64> = rows.iter().map(|r| r["delivery_tag"].as_u64().expect("a delivery tag")).collect();
    assert!(tags.contains(&2) && tags.contains(&3), "tags 2 and 3 outstanding (1 acked): {unacked}");
    for r in rows {
        assert_eq!(r["consumer_tag"], "watcher");
        assert_eq!(r["channel"], 1);
        assert_eq!(r["redelivered"], false);
        assert_eq!(r["connection_name"], conns[0]["name"]);
        assert!(r["age_ms"].as_u64().is_some(), "{r}");
    }
    // Closing the connection through the API: the client sees 320 CONNECTION_FORCED with the
    // X-Reason text.
    let name = conns[0]["name"].as_str().unwrap().to_owned();
    let encoded: String = percent_encode(&name);
    let status = tokio::task::spawn_blocking(move || {
        let path = format!("/api/connections/{encoded}");
        try_request_with(port, "DELETE", &path, None, GUEST, &[("X-Reason", "maintenance window")]).unwrap().status
    })
    .await
    .unwrap();
    assert_eq!(status, 204);
    let err = tt("the consumer sees the close", Duration::from_secs(5), async {
        loop {
            match cons.next().await {
                Some(Err(e)) => break format!("{e:?}"),
                Some(Ok(_)) => continue,
                None => break "the consumer ended without an error".to_owned(),
            }
        }
    })
    .await;
    assert!(err.contains("320") || err.contains("CONNECTION_FORCED"), "{err}");
    assert!(err.contains("maintenance window"), "{err}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while conn.status().connected() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!conn.status().connected(), "the connection was closed");
    let left = tokio::task::spawn_blocking(move || wait_json(port, "/api/connections", |v| v.as_array().is_some_and(|a| a.is_empty())))
        .await
        .unwrap();
    assert_eq!(left, json!([]));
}

/// Percent-encodes every byte but letters and digits (for a path segment).
fn percent_encode(s: &str) -> String {
    s.bytes().map(|c| if c.is_ascii_alphanumeric() { (c as char).to_string() } else { format!("%{c:02X}") }).collect()
}

#[test]
fn definitions_export_delete_import_gives_the_same_topology() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    assert_eq!(
        put(port, &format!("/api/exchanges/{V}/orders"), json!({"type": "direct", "arguments": {"alternate-exchange": "amq.fanout"}})),
        201
    );
    assert_eq!(put(port, &format!("/api/queues/{V}/orders.new"), json!({"arguments": {"x-message-ttl": 60000}})), 201);
    assert_eq!(
        request(port, "POST", &format!("/api/bindings/{V}/e/orders/q/orders.new"), Some(r#"{"routing_key":"new"}"#), GUEST).status,
        201
    );
    let before = get_json(port, "/api/definitions");
    let topology = |d: &Value| (d["queues"].clone(), d["exchanges"].clone(), d["bindings"].clone());
    assert_eq!(before["queues"].as_array().unwrap().len(), 1, "{before}");
    assert_eq!(before["exchanges"].as_array().unwrap().len(), 1, "amq.* and the default are left out: {before}");
    assert_eq!(before["bindings"][0]["routing_key"], "new");
    assert_eq!(before["users"][0]["name"], "guest");
    assert_eq!(request(port, "DELETE", &format!("/api/queues/{V}/orders.new"), None, GUEST).status, 204);
    assert_eq!(request(port, "DELETE", &format!("/api/exchanges/{V}/orders"), None, GUEST).status, 204);
    assert_eq!(get_json(port, "/api/definitions")["queues"], json!([]));
    let r = request(port, "POST", "/api/definitions", Some(&before.to_string()), GUEST);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["skipped"], json!([]), "{r:?}");
    assert_eq!(topology(&get_json(port, "/api/definitions")), topology(&before));
    // A RabbitMQ export (its field names, a vhost of its own, users and policies) imports.
    let rabbit = json!({
        "rabbit_version": "3.13.7",
        // The hash RabbitMQ 3.10 stored for password "secret" (its API's GET /api/users/admin).
        "users": [{"name": "admin", "password_hash": "rIb9tl/EuE4Z5e3BkZlfZA4BGKaVOE3A4CtKZniTJVB/usxA", "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ["administrator"], "limits": {}}],
        "vhosts": [{"name": "prod", "limits": [], "metadata": {"description": "", "tags": []}}],
        "permissions": [{"user": "admin", "vhost": "prod", "configure": ".*", "write": ".*", "read": ".*"}],
        "policies": [],
        "queues": [{"name": "q.prod", "vhost": "prod", "durable": true, "auto_delete": false, "arguments": {"x-queue-type": "classic"}}],
        "exchanges": [{"name": "x.prod", "vhost": "prod", "type": "fanout", "durable": true, "auto_delete": false, "internal": false, "arguments": {}}],
        "bindings": [{"source": "x.prod", "vhost": "prod", "destination": "q.prod", "destination_type": "queue", "routing_key": "", "arguments": {}}]
    });
    let r = request(port, "POST", "/api/definitions", Some(&rabbit.to_string()), GUEST);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(get_json(port, "/api/queues/prod/q.prod")["durable"], true);
    assert_eq!(get_json(port, "/api/bindings/prod/e/x.prod/q/q.prod").as_array().unwrap().len(), 1);
    // RabbitMQ's user logs in here with its password, and has its permission.
    let me = request(port, "GET", "/api/whoami", None, Some(("admin", "secret")));
    assert_eq!((me.status, me.json()["tags"].clone()), (200, json!(["administrator"])), "{me:?}");
    assert_eq!(request(port, "GET", "/api/whoami", None, Some(("admin", "wrong"))).status, 401);
    assert_eq!(get_json(port, "/api/permissions/prod/admin")["configure"], ".*");
    let r = request(port, "POST", "/api/definitions", Some("[1, 2]"), GUEST);
    assert_eq!(r.status, 400, "{r:?}");
}

#[test]
fn a_taken_management_port_is_reported_off_not_claimed() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let b = Broker::start_with_args(&["--management-listen", &addr.to_string()]);
    require_own_broker!(b, "ringmq's start-up line");
    let log = b.log();
    let ready = log.lines().find(|l| l.contains("ringmq ready")).expect("a ready line");
    assert!(ready.contains(&format!("management API off (cannot bind {addr}")), "{ready}");
    assert!(!ready.contains(&format!("http://{addr}")), "never claims a URL it does not own: {ready}");
    // A management port it holds: the ready line gives the web UI's URL (issue 39 item 7).
    let ui = Broker::start();
    let ready = ui.log().lines().find(|l| l.contains("ringmq ready")).map(str::to_owned).expect("a ready line");
    assert!(ready.contains(&format!("management UI on http://127.0.0.1:{}/ ", ui.management_port())), "{ready}");
    assert!(!ready.contains("/api/ "), "the URL is the UI's, not the API's: {ready}");
    let off = Broker::start_with_args(&["--management-listen", "off"]);
    assert!(off.log().lines().any(|l| l.contains("ringmq ready") && l.contains("management API off")), "{}", off.log());
}

/// Runs `rabbitmqadmin` against the broker's management port; (success, stdout + stderr).
fn rabbitmqadmin(port: u16, args: &[&str]) -> (bool, String) {
    let out = Command::new("rabbitmqadmin")
        .args(["-H", "127.0.0.1", "-P", &port.to_string(), "-u", "guest", "-p", "guest"])
        .args(args)
        .output()
        .expect("run rabbitmqadmin");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn rabbitmqadmin_commands_work_against_ringmq() {
    if Command::new("rabbitmqadmin").arg("--version").output().is_err() {
        eprintln!("skipped: rabbitmqadmin is not installed (Debian package rabbitmq-server; .ci/run installs it)");
        return;
    }
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let run = |args: &[&str]| {
        let (ok, out) = rabbitmqadmin(port, args);
        assert!(ok, "rabbitmqadmin {args:?} failed:\n{out}\nbroker log:\n{}", b.log());
        out
    };
    run(&["declare", "queue", "name=tasks", "durable=true"]);
    run(&["declare", "exchange", "name=work", "type=topic"]);
    run(&["declare", "binding", "source=work", "destination=tasks", "routing_key=job.*"]);
    assert!(run(&["list", "queues"]).contains("tasks"));
    assert!(run(&["list", "exchanges"]).contains("work"));
    assert!(run(&["list", "bindings"]).contains("job.*"));
    assert!(run(&["list", "vhosts"]).contains('/'));
    assert!(run(&["list", "nodes"]).contains("ringmq@1"));
    assert!(run(&["-f", "tsv", "show", "overview"]).contains("3.13.7"));
    run(&["publish", "exchange=work", "routing_key=job.a", "payload=first"]);
    run(&["publish", "exchange=amq.default", "routing_key=tasks", "payload=second"]);
    let depth = wait_json(port, &format!("/api/queues/{V}/tasks"), |v| v["messages"] == 2);
    assert_eq!(depth["messages"], 2, "{depth}");
    let got = run(&["-f", "tsv", "get", "queue=tasks", "count=2", "ackmode=ack_requeue_true"]);
    assert!(got.contains("first") && got.contains("second"), "{got}");
    let listed = run(&["-f", "tsv", "-q", "list", "queues", "name", "messages"]);
    assert!(listed.lines().any(|l| l == "tasks\t2"), "requeued by the get: {listed}");
    run(&["purge", "queue", "name=tasks"]);
    assert_eq!(wait_json(port, &format!("/api/queues/{V}/tasks"), |v| v["messages"] == 0)["messages"], 0);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("defs.json");
    let file = file.to_str().unwrap();
    run(&["export", file]);
    run(&["delete", "binding", "source=work", "destination_type=queue", "destination=tasks", "properties_key=job.*"]);
    assert!(!run(&["list", "bindings"]).contains("job.*"), "binding deleted");
    run(&["delete", "queue", "name=tasks"]);
    run(&["delete", "exchange", "name=work"]);
    assert!(!run(&["list", "queues"]).contains("tasks"));
    run(&["import", file]);
    assert!(run(&["list", "queues"]).contains("tasks"), "imported back");
    assert!(run(&["list", "bindings"]).contains("job.*"), "binding imported back");
    let (ok, out) = rabbitmqadmin(port, &["-p", "wrong", "list", "queues"]);
    assert!(!ok && out.contains("Access refused"), "{out}");
}

#[test]
fn any_cluster_node_lists_every_queue_with_its_depth() {
    common::cluster::run(async {
        let c = common::cluster::Cluster::start(3);
        let conn = connect_uri(&c.amqp_uri(0)).await;
        let ch = t("channel", conn.create_channel()).await.unwrap();
        let q =
            declare_queue(&ch, "cluster-depth", QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await;
        confirm_mode(&ch).await;
        for i in 0..5u8 {
            assert!(publish_confirmed(&ch, "", &q, &[i], Default::default()).await.is_ack());
        }
        let port = c.management_port(2);
        let path = format!("/api/queues/{V}/{q}");
        let info = tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                let r = try_request(port, "GET", &path, None, GUEST);
                if let Ok(r) = &r {
                    if r.status == 200 && r.json()["messages"] == 5 {
                        return r.json();
                    }
                }
                assert!(Instant::now() < deadline, "node 3 never listed the queue with 5 messages: {r:?}");
                std::thread::sleep(Duration::from_millis(200));
            }
        })
        .await
        .unwrap();
        assert_eq!(info["node"], "ringmq@1", "served by the declaring node: {info}");
        assert_eq!(info["messages_ready"], 5);
        // A cluster's durable queue is replicated: reported as RabbitMQ reports its quorum
        // queues, with its leader and members (issue 39 item 7).
        assert_eq!(info["type"], "quorum", "{info}");
        assert_eq!(info["leader"], "ringmq@1", "{info}");
        assert_eq!(info["members"], json!(["ringmq@1", "ringmq@2", "ringmq@3"]), "{info}");
        assert_eq!(info["online"], json!(["ringmq@1", "ringmq@2", "ringmq@3"]), "{info}");
        let transient = declare_queue(&ch, "cluster-transient", QueueDeclareOptions::default(), FieldTable::default()).await;
        let tpath = format!("/api/queues/{V}/{transient}");
        let kind = tokio::task::spawn_blocking(move || wait_json(port, &tpath, |v| v["type"].is_string())).await.unwrap();
        assert_eq!(kind["type"], "classic", "a transient queue is not replicated: {kind}");
        let list = tokio::task::spawn_blocking(move || get_json(port, "/api/queues")).await.unwrap();
        assert!(list.as_array().unwrap().iter().any(|x| x["name"] == q.as_str() && x["messages"] == 5), "{list}");
        // A get through node 3's API takes from the queue node 1 serves.
        let get_path = format!("/api/queues/{V}/{q}/get");
        let got = tokio::task::spawn_blocking(move || {
            request(port, "POST", &get_path, Some(r#"{"count":2,"ackmode":"ack_requeue_false","encoding":"auto"}"#), GUEST).json()
        })
        .await
        .unwrap();
        assert_eq!(got.as_array().map(Vec::len), Some(2), "{got}");
        let path = format!("/api/queues/{V}/{q}");
        let after = tokio::task::spawn_blocking(move || wait_json(port, &path, |v| v["messages"] == 3)).await.unwrap();
        assert_eq!(after["messages"], 3, "two taken for good: {after}");
        let nodes = tokio::task::spawn_blocking(move || get_json(port, "/api/nodes")).await.unwrap();
        assert_eq!(nodes.as_array().unwrap().len(), 3, "{nodes}");
        assert!(nodes.as_array().unwrap().iter().all(|n| n["running"] == true), "{nodes}");
        t("close", conn.close(200, "".into())).await.unwrap();
    });
}

/// Many keep-alive connections at once (a browser, agents, `curl --parallel`): every one is
/// served, however many others sit idle. The thread-per-connection server used before left
/// some unserved for minutes when more connections arrived together than it had threads.
#[test]
fn many_keep_alive_connections_at_once_are_all_served() {
    use std::io::{Read, Write};
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let auth = "Basic Z3Vlc3Q6Z3Vlc3Q="; // guest:guest
    for round in 0..5 {
        // 24 connections opened together, each sends a request and keeps its connection.
        let mut conns: Vec<std::net::TcpStream> = (0..24)
            .map(|_| {
                let s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                s
            })
            .collect();
        for s in &mut conns {
            write!(s, "GET /api/overview HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n").unwrap();
        }
        for (i, s) in conns.iter_mut().enumerate() {
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).unwrap_or_else(|e| panic!("round {round}: connection {i} not answered: {e}"));
                assert!(n > 0, "round {round}: connection {i} closed unanswered");
                got.extend_from_slice(&buf[..n]);
            }
            assert!(got.starts_with(b"HTTP/1.1 200"), "round {round}: {}", String::from_utf8_lossy(&got));
        }
    }
}
