//! Users, permissions, vhosts and policies changed at run time through the management API
//! (issue 13, items 2 and 3), as a client then meets them over AMQP (lapin): a new user
//! without permissions cannot open the vhost, with them it may do what its patterns allow;
//! a deleted user cannot log in; a policy set on running queues trims them at once and its
//! removal lifts the limit; deleting a vhost removes its queues. And ringmqctl for the same.

mod common;

use std::time::{Duration, Instant};

use common::http::{get_json, request};
use common::*;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde_json::json;

const GUEST: Option<(&str, &str)> = Some(("guest", "guest"));

fn put(port: u16, path: &str, body: serde_json::Value) -> u16 {
    let r = request(port, "PUT", path, Some(&body.to_string()), GUEST);
    assert!(r.status < 300, "PUT {path}: {r:?}");
    r.status
}

/// Resolves with the error lapin reports when the broker closes `c` (connection.close).
fn close_watch(c: &lapin::Connection) -> tokio::sync::oneshot::Receiver<lapin::Error> {
    use futures_lite::StreamExt;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut events = Box::pin(c.events_listener());
    tokio::spawn(async move {
        while let Some(ev) = events.next().await {
            if let lapin::Event::Error(e) = ev {
                let _ = tx.send(e);
                return;
            }
        }
    });
    rx
}

/// Waits (10 s at most) for the broker to close the watched connection with 320
/// CONNECTION_FORCED and a reason containing `text`.
async fn closed_forced(watch: tokio::sync::oneshot::Receiver<lapin::Error>, text: &str) {
    let e = tt("connection.close from the broker", Duration::from_secs(10), watch).await.expect("the watch was kept");
    assert_eq!(reply_code(&e), Some(320), "CONNECTION_FORCED: {e}");
    assert!(e.to_string().contains(text), "reason {text:?} in {e}");
}

#[tokio::test]
async fn users_and_permissions_changed_at_run_time_govern_amqp_logins_and_checks() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let uri = |user: &str, pw: &str| format!("amqp://{user}:{pw}@127.0.0.1:{}/%2f", b.port());

    assert_eq!(put(port, "/api/users/app", json!({"password": "pw1", "tags": "monitoring"})), 201);
    let users = get_json(port, "/api/users");
    let app = users.as_array().unwrap().iter().find(|u| u["name"] == "app").expect("listed").clone();
    assert_eq!(app["tags"], json!(["monitoring"]));
    assert!(app["password_hash"].as_str().is_some_and(|h| h.len() > 40), "stored hashed: {app}");
    // No permission in "/" yet: connection.open is refused.
    assert!(lapin::Connection::connect(&uri("app", "pw1"), Default::default()).await.is_err(), "no vhost access yet");

    assert_eq!(put(port, "/api/permissions/%2F/app", json!({"configure": "^app\\.", "write": ".*", "read": ".*"})), 201);
    assert_eq!(get_json(port, "/api/permissions/%2F/app")["configure"], "^app\\.");
    let c = connect_uri(&uri("app", "pw1")).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    declare_queue(&ch, "app.jobs", QueueDeclareOptions::default(), FieldTable::default()).await;
    let r = ch.queue_declare("other".into(), QueueDeclareOptions::default(), FieldTable::default()).await;
    assert_code(r, 403, "declare outside ^app\\.");

    // The monitoring tag reads the API and may not write it.
    assert_eq!(request(port, "GET", "/api/queues", None, Some(("app", "pw1"))).status, 200);
    assert_eq!(request(port, "PUT", "/api/queues/%2F/app.x", Some("{}"), Some(("app", "pw1"))).status, 403);

    // A new password; the old one is refused; then the user goes.
    assert_eq!(put(port, "/api/users/app", json!({"password": "pw2", "tags": ["monitoring"]})), 204);
    assert!(lapin::Connection::connect(&uri("app", "pw1"), Default::default()).await.is_err(), "old password");
    // RabbitMQ's DELETE /api/connections/username/{user} closes all of a user's connections.
    let (c1, c2) = (connect_uri(&uri("app", "pw2")).await, connect_uri(&uri("app", "pw2")).await);
    let (w1, w2) = (close_watch(&c1), close_watch(&c2));
    let by_user = get_json(port, "/api/connections/username/app");
    // The first connection, opened before the password changed, stays open (as in RabbitMQ).
    assert_eq!(by_user.as_array().map(Vec::len), Some(3), "{by_user}");
    let r = request(port, "DELETE", "/api/connections/username/app", None, GUEST);
    assert_eq!(r.status, 204, "{r:?}");
    closed_forced(w1, "Closed via management plugin").await;
    closed_forced(w2, "Closed via management plugin").await;
    // Deleting the user closes its open connections (RabbitMQ 3.7+).
    let c3 = connect_uri(&uri("app", "pw2")).await;
    let w3 = close_watch(&c3);
    assert_eq!(request(port, "DELETE", "/api/users/app", None, GUEST).status, 204);
    closed_forced(w3, "user 'app' is deleted").await;
    assert!(lapin::Connection::connect(&uri("app", "pw2"), Default::default()).await.is_err(), "deleted user");
    assert_eq!(request(port, "GET", "/api/users/app", None, GUEST).status, 404);
    assert_eq!(request(port, "GET", "/api/permissions/%2F/app", None, GUEST).status, 404, "its permissions went with it");
}

#[tokio::test]
async fn a_policy_set_at_run_time_trims_open_queues_and_its_removal_lifts_the_limit() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let (_c, ch) = connect_ch(&b).await;
    let q = declare_queue(&ch, &uniq("lim.live"), QueueDeclareOptions::default(), FieldTable::default()).await;
    let other = declare_queue(&ch, &uniq("unlimited"), QueueDeclareOptions::default(), FieldTable::default()).await;
    for i in 0..5u8 {
        publish(&ch, "", &q, &[i]).await;
        publish(&ch, "", &other, &[i]).await;
    }
    assert_eq!(wait_ready(&ch, &q, 5, Duration::from_secs(10)).await, 5);
    let policy = json!({"pattern": "^ringmq-test\\.lim\\.", "definition": {"max-length": 2}, "apply-to": "queues", "priority": 1});
    assert_eq!(put(port, "/api/policies/%2F/lim", policy), 201);
    assert_eq!(get_json(port, "/api/policies/%2F/lim")["definition"], json!({"max-length": 2}));
    // Reapplied to the open queue within the core's 1 s tick: drop-head keeps the newest two.
    let deadline = Instant::now() + Duration::from_secs(10);
    while ready_count(&ch, &q).await != 2 {
        assert!(Instant::now() < deadline, "the policy did not reach the open queue");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(drain(&ch, &q, 10).await, [vec![3u8], vec![4u8]], "the oldest were dropped");
    assert_eq!(ready_count(&ch, &other).await, 5, "a queue the pattern does not match keeps all");
    assert_eq!(request(port, "DELETE", "/api/policies/%2F/lim", None, GUEST).status, 204);
    assert_eq!(get_json(port, "/api/policies"), json!([]));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for i in 0..4u8 {
        publish(&ch, "", &q, &[i]).await;
    }
    assert_eq!(wait_ready(&ch, &q, 4, Duration::from_secs(10)).await, 4, "no limit once the policy is cleared");
}

#[tokio::test]
async fn deleting_a_vhost_removes_its_queues_and_exchanges() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    assert_eq!(put(port, "/api/vhosts/tmp", json!({})), 201);
    put(port, "/api/permissions/tmp/guest", json!({"configure": ".*", "write": ".*", "read": ".*"}));
    let c = connect_uri(&format!("amqp://guest:guest@127.0.0.1:{}/tmp", b.port())).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    declare_queue(&ch, "in-tmp", QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await;
    publish(&ch, "", "in-tmp", b"x").await;
    assert_eq!(wait_ready(&ch, "in-tmp", 1, Duration::from_secs(10)).await, 1);
    let watch = close_watch(&c);
    assert_eq!(request(port, "DELETE", "/api/vhosts/tmp", None, GUEST).status, 204);
    closed_forced(watch, "vhost 'tmp' is deleted").await;
    assert_eq!(request(port, "GET", "/api/vhosts/tmp", None, GUEST).status, 404);
    assert!(get_json(port, "/api/queues").as_array().unwrap().iter().all(|q| q["vhost"] != "tmp"));
    assert!(lapin::Connection::connect(&format!("amqp://guest:guest@127.0.0.1:{}/tmp", b.port()), Default::default()).await.is_err());
}

/// ringmqctl against `port`: (exit code, stdout + stderr).
fn ctl(port: u16, args: &[&str]) -> (i32, String) {
    let (code, out, err) = common::http::ringmqctl(port, args);
    (code, out + &err)
}

#[tokio::test]
async fn ringmqctl_manages_users_permissions_vhosts_and_policies() {
    let b = Broker::start();
    require_own_broker!(b, "ringmq's management API");
    let port = b.management_port();
    let ok = |args: &[&str]| {
        let (code, out) = ctl(port, args);
        assert_eq!(code, 0, "ringmqctl {args:?}: {out}");
        out
    };
    ok(&["add_vhost", "staging"]);
    ok(&["add_user", "ops", "s3cret"]);
    ok(&["set_user_tags", "ops", "administrator"]);
    ok(&["set_permissions", "-p", "staging", "ops", ".*", ".*", ".*"]);
    assert!(ok(&["list_users"]).lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["ops", "administrator"]));
    assert!(ok(&["list_vhosts"]).lines().any(|l| l.trim() == "staging"));
    assert!(ok(&["list_permissions", "-p", "staging"]).contains("ops"));
    assert!(ok(&["list_user_permissions", "ops"]).contains("staging"));
    assert_eq!(ctl(port, &["authenticate_user", "ops", "s3cret"]).0, 0);
    assert_eq!(ctl(port, &["authenticate_user", "ops", "nope"]).0, 77);
    ok(&["change_password", "ops", "n3w"]);
    assert_eq!(ctl(port, &["authenticate_user", "ops", "s3cret"]).0, 77);
    // ops may use the API as an administrator now, and AMQP in staging.
    assert_eq!(ctl(port, &["--username", "ops", "--password", "n3w", "list_queues", "-p", "staging"]).0, 0);
    let ops = connect_uri(&format!("amqp://ops:n3w@127.0.0.1:{}/staging", b.port())).await;
    let watch = close_watch(&ops);
    ok(&["close_all_user_connections", "ops", "rotating credentials"]);
    closed_forced(watch, "rotating credentials").await;

    ok(&["set_policy", "-p", "staging", "ttl", "^t\\.", r#"{"message-ttl":60000}"#, "--priority", "2", "--apply-to", "queues"]);
    let policies = ok(&["list_policies", "-p", "staging", "--format", "json"]);
    let p: serde_json::Value = serde_json::from_str(&policies).unwrap();
    assert_eq!((p[0]["name"].as_str(), p[0]["priority"].as_i64()), (Some("ttl"), Some(2)), "{policies}");
    ok(&["set_operator_policy", "-p", "staging", "cap", ".*", r#"{"max-length":1000}"#]);
    assert!(ok(&["list_operator_policies", "-p", "staging"]).contains("cap"));
    assert_eq!(ctl(port, &["set_policy", "bad", ".*", r#"{"no-such-key":1}"#]).0, 65, "an unknown key is refused");
    ok(&["clear_policy", "-p", "staging", "ttl"]);
    ok(&["clear_operator_policy", "-p", "staging", "cap"]);
    assert_eq!(ok(&["list_policies", "-p", "staging", "--format", "json"]).trim(), "[]");

    ok(&["clear_permissions", "-p", "staging", "ops"]);
    assert!(lapin::Connection::connect(&format!("amqp://ops:n3w@127.0.0.1:{}/staging", b.port()), Default::default()).await.is_err());
    ok(&["delete_user", "ops"]);
    assert_eq!(ctl(port, &["delete_user", "ops"]).0, 1, "gone");
    ok(&["delete_vhost", "staging"]);
    assert!(!ok(&["list_vhosts"]).contains("staging"));
}
