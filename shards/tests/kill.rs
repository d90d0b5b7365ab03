//! A child process appends and syncs until it is killed with SIGKILL in the
//! middle of its appends; the reopened shard must hold every record the child
//! reported as synced (by `sync` or `sync_appends`), with the right contents.
//! Three kill/reopen rounds.

mod common;

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::*;
use ringmq_shards::{Shard, ShardConfig};

const CHILD_ENV: &str = "RINGMQ_SHARDS_KILL_CHILD_DIR";

fn size(o: u64) -> usize {
    ((o * 2654435761) % 9000) as usize
}

fn cfg() -> ShardConfig {
    ShardConfig { segment_bytes: 1 << 20, cache_bytes: 1 << 20, verify_on_open: false }
}

/// The child's role (a no-op unless started by `sigkill_mid_append`).
#[test]
fn kill_child_role() {
    let Ok(dir) = std::env::var(CHILD_ENV) else { return };
    run(move || async move {
        let (s, rep) = Shard::open(std::path::Path::new(&dir), cfg()).await.unwrap();
        println!("opened {} {}", s.next_offset(), rep.dropped.len());
        let start = Instant::now();
        for i in 0..2_000_000u64 {
            let o = s.next_offset();
            s.append((o % 256) as u8, &header(o), &body(o, size(o))).unwrap();
            if i % 37 == 36 {
                // Every other sync is append-only (publisher confirms use it): its records
                // must survive the kill just the same.
                let sy = if (i / 37) % 2 == 0 { s.sync().await.unwrap() } else { s.sync_appends().await.unwrap() };
                println!("synced {}", sy.upto());
            } else if i % 8 == 0 {
                s.throttle().await;
            }
            if start.elapsed() > Duration::from_secs(60) {
                break;
            }
        }
    });
}

#[test]
fn sigkill_mid_append() {
    let dir = tmpdir();
    let path = dir.path().join("killed");
    let exe = std::env::current_exe().unwrap();
    let mut total_synced = 0;
    for round in 0..3 {
        let mut child = Command::new(&exe)
            .args(["--exact", "kill_child_role", "--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn child");
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut synced = 0u64;
        let mut syncs = 0;
        let deadline = Instant::now() + Duration::from_secs(30);
        for line in out.lines() {
            let line = line.unwrap();
            if let Some(v) = line.strip_prefix("synced ") {
                synced = v.trim().parse().unwrap();
                syncs += 1;
                // Kill somewhere in the middle of the next batch of appends.
                if syncs >= 40 + round * 13 || Instant::now() > deadline {
                    break;
                }
            }
        }
        child.kill().expect("SIGKILL the child");
        child.wait().unwrap();
        assert!(synced > total_synced, "round {round}: the child made progress");
        total_synced = synced;
        let p = path.clone();
        run(move || async move {
            let (s, rep) = Shard::open(&p, cfg()).await.unwrap();
            let next = s.next_offset();
            assert!(next >= synced, "round {round}: next {next} < synced {synced}; {rep:?}");
            for o in 0..next {
                let r = s.read(o).await.unwrap().unwrap_or_else(|| panic!("round {round}: record {o} missing; {rep:?}"));
                check(&r, o, size(o));
            }
            s.close().await.unwrap();
        });
    }
}
