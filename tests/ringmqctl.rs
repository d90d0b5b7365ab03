//! `ringmqctl` (issue 13, item 6) against a started ringmq's management API, as an operator
//! runs it: every listing with default and chosen columns, in table and JSON form; purge,
//! delete, close_connection; the definitions round trip (export, delete, import, same
//! topology); the unacked deliveries of a queue; the exit codes scripts rely on.

mod common;

use std::time::Duration;

use common::http::ringmqctl as ctl;
use common::*;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, ExchangeKind};

/// ringmqctl that must succeed: its stdout.
#[track_caller]
fn ok(port: u16, args: &[&str]) -> String {
    let (code, out, err) = ctl(port, args);
    assert_eq!(code, 0, "ringmqctl {args:?} failed: {err}{out}");
    out
}

/// The rows of a `--format json` listing.
#[track_caller]
fn rows(port: u16, args: &[&str]) -> Vec<serde_json::Value> {
    let mut a = args.to_vec();
    a.extend(["--format", "json"]);
    let out = ok(port, &a);
    serde_json::from_str::<serde_json::Value>(&out)
        .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out}"))
        .as_array()
        .cloned()
        .expect("array")
}

#[tokio::test]
async fn ringmqctl_lists_changes_and_round_trips_definitions() {
    let b = Broker::start();
    require_own_broker!(b, "ringmqctl talks to ringmq's management API");
    let port = b.management_port();
    let (c, ch) = connect_ch(&b).await;
    let q = declare_queue(&ch, &uniq("ctl-jobs"), QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await;
    let x = uniq("ctl-x");
    t(
        "exchange",
        ch.exchange_declare(
            x.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions { durable: true, ..Default::default() },
            FieldTable::default(),
        ),
    )
    .await
    .unwrap();
    t("bind", ch.queue_bind(q.as_str().into(), x.as_str().into(), "jobs.#".into(), QueueBindOptions::default(), FieldTable::default()))
        .await
        .unwrap();
    for i in 0..5u8 {
        t(
            "publish",
            ch.basic_publish(x.as_str().into(), "jobs.a".into(), BasicPublishOptions::default(), &[i], BasicProperties::default()),
        )
        .await
        .unwrap();
    }
    assert_eq!(wait_ready(&ch, &q, 5, Duration::from_secs(10)).await, 5);

    // status and cluster_status
    let status = ok(port, &["status"]);
    assert!(status.contains("ringmq@1") && status.contains("Queues"), "{status}");
    let cluster = ok(port, &["cluster_status"]);
    assert!(cluster.contains("ringmq@1") && cluster.contains("true"), "{cluster}");

    // list_queues: the default columns as a table, chosen ones as JSON.
    let table = ok(port, &["list_queues"]);
    assert!(table.lines().next().unwrap_or("").starts_with("name"), "{table}");
    assert!(table.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == [q.as_str(), "5"]), "{table}");
    let qs = rows(port, &["list_queues", "name", "messages_ready", "durable", "consumers"]);
    let mine = qs.iter().find(|r| r["name"] == q.as_str()).expect("the queue is listed");
    assert_eq!((mine["messages_ready"].as_u64(), mine["durable"].as_bool(), mine["consumers"].as_u64()), (Some(5), Some(true), Some(0)));
    assert_eq!(mine.as_object().unwrap().keys().count(), 4, "only the asked columns: {mine}");

    // list_exchanges, list_bindings (rabbitmqctl's column names).
    assert!(rows(port, &["list_exchanges"]).iter().any(|r| r["name"] == x.as_str() && r["type"] == "topic"));
    let binds = rows(port, &["list_bindings"]);
    assert!(
        binds.iter().any(|r| r["source_name"] == x.as_str()
            && r["destination_name"] == q.as_str()
            && r["destination_kind"] == "queue"
            && r["routing_key"] == "jobs.#"),
        "{binds:?}"
    );

    // A consumer holding deliveries: connections, channels, consumers, unacked.
    let consumer_conn = connect(&b).await;
    let cch = t("channel", consumer_conn.create_channel()).await.unwrap();
    let mut cons =
        t("consume", cch.basic_consume(q.as_str().into(), "ctl-tag".into(), BasicConsumeOptions::default(), FieldTable::default()))
            .await
            .unwrap();
    let first = next_delivery(&mut cons, Duration::from_secs(10)).await;
    for _ in 1..5 {
        next_delivery(&mut cons, Duration::from_secs(10)).await;
    }
    let conns = rows(port, &["list_connections", "name", "user", "state"]);
    assert!(conns.len() >= 2 && conns.iter().all(|r| r["user"] == "guest"), "{conns:?}");
    let consumers = rows(port, &["list_consumers"]);
    assert!(
        consumers.iter().any(|r| r["queue_name"] == q.as_str() && r["consumer_tag"] == "ctl-tag" && r["ack_required"] == true),
        "{consumers:?}"
    );
    assert!(rows(port, &["list_channels"]).iter().any(|r| r["consumer_count"] == 1));
    let unacked = rows(port, &["list_unacked", &q]);
    assert_eq!(unacked.len(), 5, "{unacked:?}");
    assert!(
        unacked.iter().any(|r| r["delivery_tag"].as_u64() == Some(first.delivery_tag) && r["consumer_tag"] == "ctl-tag"),
        "{unacked:?}"
    );

    // close_connection: the consumer's connection ends, its deliveries come back.
    let name = conns
        .iter()
        .map(|r| r["name"].as_str().unwrap_or_default().to_string())
        .find(|n| {
            let (_, out, _) = ctl(port, &["list_unacked", &q, "connection_name", "--format", "json"]);
            out.contains(n.as_str())
        })
        .expect("the consumer's connection");
    ok(port, &["close_connection", &name, "maintenance"]);
    assert_eq!(wait_ready(&ch, &q, 5, Duration::from_secs(10)).await, 5, "the closed connection's deliveries are requeued");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while consumer_conn.status().connected() {
        assert!(std::time::Instant::now() < deadline, "the connection was not closed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Definitions round trip: export, delete queue and exchange, import, same topology.
    let file = tempfile::NamedTempFile::new().unwrap();
    let path = file.path().to_str().unwrap();
    ok(port, &["export_definitions", path]);
    let defs: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(defs["queues"].as_array().unwrap().iter().any(|d| d["name"] == q.as_str()), "{defs}");
    ok(port, &["purge_queue", &q]);
    assert_eq!(ready_count(&ch, &q).await, 0, "purged");
    ok(port, &["delete_queue", &q]);
    assert!(!rows(port, &["list_queues"]).iter().any(|r| r["name"] == q.as_str()), "deleted");
    ok(port, &["import_definitions", path]);
    assert!(rows(port, &["list_queues"]).iter().any(|r| r["name"] == q.as_str()), "imported back");
    assert!(
        rows(port, &["list_bindings"]).iter().any(|r| r["source_name"] == x.as_str() && r["destination_name"] == q.as_str()),
        "binding back"
    );
    publish(&ch, &x, "jobs.b", b"after import").await;
    assert_eq!(wait_ready(&ch, &q, 1, Duration::from_secs(10)).await, 1, "the imported binding routes");

    // delete_queue --if-empty refuses a queue with messages (400 → 65), keeps it.
    let (code, _, err) = ctl(port, &["delete_queue", &q, "--if-empty"]);
    assert_eq!(code, 65, "{err}");
    assert_eq!(ready_count(&ch, &q).await, 1);
    let _ = c.close(200, "".into()).await;
}

#[test]
fn ringmqctl_exit_codes_tell_scripts_what_went_wrong() {
    let b = Broker::start();
    require_own_broker!(b, "ringmqctl talks to ringmq's management API");
    let port = b.management_port();
    let (code, _, err) = ctl(port, &["purge_queue", "no-such-queue"]);
    assert_eq!(code, 1, "not found: {err}");
    assert!(err.contains("404"), "{err}");
    let (code, _, err) = ctl(port, &["--password", "wrong", "list_queues"]);
    assert_eq!(code, 77, "refused login: {err}");
    let (code, _, err) = ctl(free_port(), &["status"]);
    assert_eq!(code, 69, "nothing listens: {err}");
    let (code, _, _) = ctl(port, &["list_quues"]);
    assert_eq!(code, 64, "usage");
    let bad = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(bad.path(), "{not json").unwrap();
    let (code, _, err) = ctl(port, &["import_definitions", bad.path().to_str().unwrap()]);
    assert_eq!(code, 65, "{err}");
    let (code, _, _) = ctl(port, &["import_definitions", "/nonexistent/defs.json"]);
    assert_eq!(code, 66);
    let (code, out, _) = ctl(port, &["--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("list_queues") && out.contains("Exit codes"), "{out}");
}
