//! Issue 14, item 5: many nearly empty durable queues (one per device) cost little. A durable
//! queue that holds nothing and goes unused for 10 s is closed (`broker/idle.rs`): it keeps no
//! file descriptor, its files take well under 64 KB of disk, the management API still lists it
//! (with its message counters) without opening it, and its next operation opens it again.
//!
//! - `idle_durable_queues_hold_no_descriptor_and_little_disk`: 60 durable queues declared,
//!   one published to and drained; within 40 s the broker's open descriptors fall back to what
//!   the idle broker held; each queue's directory takes ≤ 64 KB; /api/queues lists all of them,
//!   the used one with its counters; a queue that holds a message stays open and keeps it; a
//!   publish and a get on a closed queue work; after a restart all of them are still there.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::http::get_json;
use common::*;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// Bytes of disk a directory tree takes (allocated blocks, as `du` counts them).
fn disk_bytes(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::symlink_metadata(p) else { return 0 };
    let own = m.blocks() * 512;
    if !m.is_dir() {
        return own;
    }
    own + std::fs::read_dir(p).map(|d| d.filter_map(|e| e.ok()).map(|e| disk_bytes(&e.path())).sum()).unwrap_or(0)
}

async fn get_one(ch: &lapin::Channel, q: &str) -> Option<Vec<u8>> {
    for _ in 0..200 {
        if let Some(m) = t("basic.get", ch.basic_get(q.into(), BasicGetOptions { no_ack: true })).await.unwrap() {
            return Some(m.delivery.data.clone());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_durable_queues_hold_no_descriptor_and_little_disk() {
    const QUEUES: usize = 60;
    let mut b = Broker::start();
    require_own_broker!(b, "reads the broker's descriptors and data directory");
    let pid = b.pid().expect("own broker");
    let (c, ch) = connect_ch(&b).await;
    t("confirm.select", ch.confirm_select(Default::default())).await.unwrap();
    // What the broker holds with one client and no queue: listeners, its files, this socket.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let baseline = open_fds(pid);
    let prefix = uniq("device");
    let names: Vec<String> = (0..QUEUES).map(|i| format!("{prefix}-{i:03}")).collect();
    for n in &names {
        declare_queue(&ch, n, QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await;
    }
    let props = BasicProperties::default().with_delivery_mode(2);
    let pc = t("publish", ch.basic_publish("".into(), names[0].as_str().into(), Default::default(), b"used", props.clone())).await.unwrap();
    assert!(t("publish done", pc).await.unwrap().is_ack());
    assert_eq!(get_one(&ch, &names[0]).await.as_deref(), Some(&b"used"[..]));
    // One queue keeps a message: it must stay open and keep it.
    let keeper = format!("{prefix}-keeper");
    declare_queue(&ch, &keeper, QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await;
    let pc = t("publish", ch.basic_publish("".into(), keeper.as_str().into(), Default::default(), b"kept", props.clone())).await.unwrap();
    assert!(t("publish done", pc).await.unwrap().is_ack());
    let declared = open_fds(pid);
    assert!(declared >= baseline + QUEUES, "{QUEUES} open queues hold {declared} descriptors (idle broker: {baseline})");

    // Closed within the idle period plus a few ticks.
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut now_open = declared;
    while Instant::now() < deadline {
        now_open = open_fds(pid);
        if now_open <= baseline + 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(now_open <= baseline + 4, "idle queues still hold descriptors: {now_open} open, {baseline} before the declares");

    let data = b.data_dir().expect("own broker").to_path_buf();
    let dirs: Vec<_> = std::fs::read_dir(data.join("queues")).unwrap().filter_map(|e| e.ok()).map(|e| e.path()).collect();
    assert!(dirs.len() > QUEUES, "{} queue directories", dirs.len());
    for d in &dirs {
        let used = disk_bytes(d);
        assert!(
            used <= 64 * 1024 || d.ends_with(ringmq::config::queue_dir_name("/", &keeper)),
            "{} takes {used} bytes of disk",
            d.display()
        );
    }

    // Listed without being opened again, counters kept.
    let port = b.management_port();
    let listed = get_json(port, "/api/queues");
    let mine: Vec<&serde_json::Value> =
        listed.as_array().unwrap().iter().filter(|q| q["name"].as_str().unwrap_or("").starts_with(&prefix)).collect();
    assert_eq!(mine.len(), QUEUES + 1);
    let used = mine.iter().find(|q| q["name"] == names[0].as_str()).unwrap();
    assert_eq!(used["messages"], 0);
    assert_eq!(used["message_stats"]["publish"], 1, "{used}");
    let kept = mine.iter().find(|q| q["name"] == keeper.as_str()).unwrap();
    assert_eq!(kept["messages"], 1, "{kept}");
    assert!(open_fds(pid) <= baseline + 4, "listing the queues opened them again");

    // A closed queue serves its next operation.
    let pc = t("publish", ch.basic_publish("".into(), names[7].as_str().into(), Default::default(), b"again", props)).await.unwrap();
    assert!(t("publish done", pc).await.unwrap().is_ack());
    assert_eq!(get_one(&ch, &names[7]).await.as_deref(), Some(&b"again"[..]));
    assert_eq!(get_one(&ch, &keeper).await.as_deref(), Some(&b"kept"[..]));
    t("close", c.close(200, "".into())).await.unwrap();

    b.restart();
    let (_c, ch) = connect_ch(&b).await;
    for n in names.iter().step_by(7) {
        let q = t(
            "passive declare",
            ch.queue_declare(n.as_str().into(), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default()),
        )
        .await
        .unwrap();
        assert_eq!(q.message_count(), 0);
    }
}
