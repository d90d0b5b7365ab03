//! The management web UI in a real browser (issue 13, item 7): headless Chromium loads the
//! pages from a started ringmq, logs in through RabbitMQ's `#/login/<user>/<password>` link,
//! and the rendered DOM shows the queue this test declared with its depth. A screenshot of
//! the queues page is written under `target/ui-screenshots/` and its path printed (CI keeps
//! it in its log). Also the live latency endpoint behind the UI's latency view, over HTTP.
//!
//! Needs Chromium (Debian's `chromium`; `CHROMIUM` to point elsewhere): without it the
//! browser test is skipped with a note, except in CI (env `CI` set), where it fails.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::http::{get_json, request};
use common::python::run_bounded;
use common::*;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;

/// The Chromium binary: env CHROMIUM, else `chromium` or `chromium-browser` on the PATH.
fn chromium() -> Option<String> {
    if let Ok(c) = std::env::var("CHROMIUM") {
        return Some(c);
    }
    ["chromium", "chromium-browser"].iter().find_map(|name| {
        let ok = Command::new(name).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        ok.then(|| name.to_string())
    })
}

/// Chromium, headless, on a fresh profile, loading `url`: `mode` is `--dump-dom` or
/// `--screenshot=PATH`. Bounded to 60 s. Returns its stdout (the DOM for `--dump-dom`).
fn browse(chrome: &str, url: &str, mode: &str) -> String {
    let profile = tempfile::tempdir().expect("profile dir");
    let profile_flag = format!("--user-data-dir={}", profile.path().display());
    let args = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,900",
        "--virtual-time-budget=10000",
        &profile_flag,
        mode,
        url,
    ];
    let (ok, out) = run_bounded(chrome, &args, Duration::from_secs(60));
    assert!(ok, "chromium failed on {url}:\n{out}");
    out
}

#[tokio::test]
async fn the_ui_shows_a_declared_queue_and_its_depth_in_a_real_browser() {
    let Some(chrome) = chromium() else {
        skip_unless_ci("CI needs chromium for the UI test (.ci/run installs it, or set CHROMIUM)");
        return;
    };
    let b = Broker::start();
    require_own_broker!(b, "the management UI is ringmq's");
    let (_c, ch) = connect_ch(&b).await;
    let q = declare_queue(&ch, &uniq("ui-shown"), QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await;
    for i in 0..7u8 {
        t("publish", ch.basic_publish("".into(), q.as_str().into(), BasicPublishOptions::default(), &[i], BasicProperties::default()))
            .await
            .unwrap();
    }
    assert_eq!(wait_ready(&ch, &q, 7, Duration::from_secs(10)).await, 7);
    let base = format!("http://127.0.0.1:{}/", b.management_port());

    // The queues page lists it with 7 ready.
    let dom = browse(&chrome, &format!("{base}#/login/guest/guest/queues"), "--dump-dom");
    let row = dom.split("<tr>").find(|r| r.contains(&format!(">{q}</a>"))).unwrap_or_else(|| panic!("no row for {q} in:\n{dom}"));
    assert!(row.contains(">7</td>"), "the row of {q} does not show its 7 messages: {row}");

    // The queue's own page shows its depth and properties.
    let dom = browse(&chrome, &format!("{base}#/login/guest/guest/queue/%2F/{q}"), "--dump-dom");
    assert!(dom.contains(&format!("Queue {q}")), "{dom}");
    assert!(dom.contains(r#"<div class="n">7</div><div class="l">Ready</div>"#), "{dom}");

    // The overview counts it; a wrong password shows the login form instead.
    let dom = browse(&chrome, &format!("{base}#/login/guest/guest"), "--dump-dom");
    assert!(dom.contains("<h1>Overview"), "{dom}");
    let dom = browse(&chrome, &format!("{base}#/login/guest/wrong/queues"), "--dump-dom");
    assert!(dom.contains("Login failed") && !dom.contains(&q), "{dom}");

    // The latency view groups the stages by whose time they are and says what each measures.
    let dom = browse(&chrome, &format!("{base}#/login/guest/guest/latency"), "--dump-dom");
    for id in ["side-broker", "side-queue", "side-client", "stage-written_to_acked", "stage-publish_to_confirmed"] {
        assert!(dom.contains(&format!("id=\"{id}\"")), "no {id} on the latency page:\n{dom}");
    }
    let client = &dom[dom.find("id=\"side-client\"").expect("client group")..];
    let end = client.find("id=\"side-round_trip\"").unwrap_or(client.len());
    assert!(client[..end].contains("written → acked"), "written → acked is not under Client:\n{dom}");
    assert!(dom.contains("the consumer's processing and the network both ways"), "no meaning shown:\n{dom}");

    // A screenshot for the log.
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target").join("ui-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    let png = dir.join("queues.png");
    let _ = std::fs::remove_file(&png);
    browse(&chrome, &format!("{base}#/login/guest/guest/queues"), &format!("--screenshot={}", png.display()));
    let size = std::fs::metadata(&png).map(|m| m.len()).unwrap_or(0);
    assert!(size > 1000, "no screenshot at {}", png.display());
    println!("UI screenshot: {} ({size} bytes)", png.display());
}

#[tokio::test]
async fn the_latency_view_reads_per_stage_histograms_of_the_node_and_of_one_queue() {
    let b = Broker::start();
    require_own_broker!(b, "the latency endpoint is ringmq's");
    let (_c, ch) = connect_ch(&b).await;
    t("confirm", ch.confirm_select(ConfirmSelectOptions::default())).await.unwrap();
    let q =
        declare_queue(&ch, &uniq("ui-latency"), QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await;
    let other = plain_queue(&ch, "ui-latency-other").await;
    // Enough messages that the 1-in-16 sample catches some of each stage.
    for i in 0..400u32 {
        let props = BasicProperties::default().with_delivery_mode(2);
        let c = t("publish", ch.basic_publish("".into(), q.as_str().into(), BasicPublishOptions::default(), &i.to_le_bytes(), props))
            .await
            .unwrap();
        t("confirm", c).await.unwrap();
    }
    for _ in 0..400 {
        let m = t("get", ch.basic_get(q.as_str().into(), BasicGetOptions::default())).await.unwrap().expect("a message");
        t("ack", m.delivery.ack(BasicAckOptions::default())).await.unwrap();
    }
    let port = b.management_port();
    let queue = get_json(port, &format!("/api/ringmq/latency/%2F/{q}"));
    let node = get_json(port, "/api/ringmq/latency");
    let count = |v: &serde_json::Value, stage: &str| v["stages"][stage]["count"].as_u64().unwrap_or(0);
    for stage in ["publish_to_enqueued", "publish_to_stored", "enqueued_to_taken", "taken_to_acked"] {
        let buckets: u64 = queue["stages"][stage]["buckets"].as_array().expect("buckets").iter().filter_map(|n| n.as_u64()).sum();
        assert!(count(&queue, stage) > 0, "no {stage} samples for {q}: {queue}");
        assert!(count(&queue, stage) <= 400 / 16 + 1, "{stage}: more samples than one in 16: {queue}");
        assert_eq!(buckets, count(&queue, stage), "{stage}: the buckets hold every sample");
        assert!(count(&node, stage) >= count(&queue, stage), "{stage}: the node sums every queue");
    }
    // What connections measure is the node's only; a get-ok is not timed from its queue.
    for stage in ["publish_to_confirmed", "written_to_acked"] {
        assert!(count(&node, stage) > 0, "no {stage} samples on the node: {node}");
        assert!(queue["stages"].get(stage).is_none(), "{stage} is not measured per queue: {queue}");
    }
    assert_eq!(count(&node, "taken_to_written"), 0, "basic.get only: {node}");
    // Each stage says what it measures and whose time it is.
    let info = node["stage_info"].as_array().expect("stage_info");
    let side = |name: &str| info.iter().find(|i| i["name"] == name).map(|i| i["side"].clone());
    assert_eq!(side("written_to_acked"), Some(serde_json::json!("client")), "{node}");
    assert_eq!(side("enqueued_to_taken"), Some(serde_json::json!("queue")), "{node}");
    assert_eq!(side("publish_to_confirmed"), Some(serde_json::json!("broker")), "{node}");
    let idle = get_json(port, &format!("/api/ringmq/latency/%2F/{other}"));
    assert_eq!(idle["stages"]["taken_to_acked"]["count"], 0, "a queue without traffic has no samples: {idle}");
    let missing = request(port, "GET", "/api/ringmq/latency/%2F/no-such-queue", None, Some(("guest", "guest")));
    assert_eq!(missing.status, 404);
    let anonymous = request(port, "GET", "/api/ringmq/latency", None, None);
    assert_eq!(anonymous.status, 401, "the data needs a login, the page itself does not");
    assert_eq!(request(port, "GET", "/", None, None).status, 200);
}

/// RabbitMQ's UI links (`#/queues/%2F/<name>`, `#/exchanges/%2F/<name>`,
/// `#/connections/<name>`, issue 39 item 7) open that object's page, not the list: the
/// queue's page lists its consumer (from `consumer_details`) with the connection's given
/// name, the connection's page shows its client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmqs_url_forms_land_on_the_objects_page() {
    let Some(chrome) = chromium() else {
        skip_unless_ci("CI needs chromium for the UI test (.ci/run installs it, or set CHROMIUM)");
        return;
    };
    let b = Broker::start();
    require_own_broker!(b, "the management UI is ringmq's");
    let props = lapin::ConnectionProperties::default().with_connection_name("ui-named-client".into());
    let conn = t("connect", lapin::Connection::connect(&b.uri(), props)).await.unwrap();
    let ch = t("channel", conn.create_channel()).await.unwrap();
    let q = declare_queue(&ch, &uniq("ui-url"), QueueDeclareOptions::default(), FieldTable::default()).await;
    let _consumer =
        t("consume", ch.basic_consume(q.as_str().into(), "ui-tag".into(), Default::default(), FieldTable::default())).await.unwrap();
    let base = format!("http://127.0.0.1:{}/", b.management_port());
    let port = b.management_port();
    let name =
        tokio::task::spawn_blocking(move || get_json(port, "/api/connections")[0]["name"].as_str().unwrap().to_owned()).await.unwrap();

    let dom = browse(&chrome, &format!("{base}#/login/guest/guest/queues/%2F/{q}"), "--dump-dom");
    assert!(dom.contains(&format!("Queue {q}")), "the queue's page, not the list:\n{dom}");
    assert!(dom.contains(">ui-tag</td>") && dom.contains("ui-named-client</a>"), "its consumer, with the connection's name:\n{dom}");

    let dom = browse(&chrome, &format!("{base}#/login/guest/guest/exchanges/%2F/amq.direct"), "--dump-dom");
    assert!(dom.contains("Exchange amq.direct"), "the exchange's page:\n{dom}");

    let encoded: String =
        name.bytes().map(|c| if c.is_ascii_alphanumeric() { (c as char).to_string() } else { format!("%{c:02X}") }).collect();
    let dom = browse(&chrome, &format!("{base}#/login/guest/guest/connections/{encoded}"), "--dump-dom");
    assert!(dom.contains("Connection ui-named-client"), "the connection's page:\n{dom}");
    assert!(dom.contains("lapin"), "its client:\n{dom}");
}
