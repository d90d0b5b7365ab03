//! Microbenchmarks of the segment store (`cargo bench -p ringmq-shards`).
//!
//! Prints one markdown table row per case, measured beside
//! `dd if=/dev/zero of=FILE bs=1M count=1024 oflag=direct` and the fdatasync
//! latency of the same disk. Set `BENCH_DIR` to choose the disk (default: the
//! target dir's tmp) and `BENCH_QUICK=1` for a short run, `BENCH_ONLY=append1024-0,append1024-p1024,delete,...`
//! to pick cases (`appendSIZE-K`: a sync every K records, 0 = none; `-pK`: pipelined).

use std::{
    collections::VecDeque,
    io::Write,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    rc::Rc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use ringmq_shards::{Shard, ShardConfig, Synced};

fn bench_dir() -> PathBuf {
    let base = std::env::var_os("BENCH_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    let d = base.join(format!("shard-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn quick() -> bool {
    std::env::var_os("BENCH_QUICK").is_some()
}

/// dd's direct-I/O write rate on `dir`, in MB/s (10^6 bytes).
fn dd_mbps(dir: &Path) -> f64 {
    let f = dir.join("dd.tmp");
    let out = std::process::Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", f.display()))
        .args(["bs=1M", "count=1024", "oflag=direct"])
        .output()
        .expect("run dd");
    let _ = std::fs::remove_file(&f);
    let text = String::from_utf8_lossy(&out.stderr);
    // "1073741824 bytes (1.1 GB, 1.0 GiB) copied, 0.355256 s, 3.0 GB/s"
    let secs: f64 = text
        .split("copied,")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("cannot parse dd output: {text}"));
    1073741824.0 / secs / 1e6
}

/// (median, p99) of 4 KiB pwrite + fdatasync on `dir`, in µs.
fn fdatasync_us(dir: &Path) -> (f64, f64) {
    let p = dir.join("fsync.tmp");
    let f = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(&p).unwrap();
    let buf = vec![1u8; 4096];
    let mut v = Vec::new();
    for i in 0..300u64 {
        f.write_all_at(&buf, (i % 16) * 4096).unwrap();
        let t = Instant::now();
        f.sync_data().unwrap();
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let _ = std::fs::remove_file(&p);
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[v.len() / 2], v[v.len() * 99 / 100])
}

fn row(case: &str, figure: String, note: String) {
    println!("| {case} | {figure} | {note} |");
    let _ = std::io::stdout().flush();
}

/// Most syncs outstanding in the pipelined cases.
const PIPELINE: usize = 4;

/// Appends `size`-byte bodies. With `sync_every = Some(k)`, a sync per `k`
/// records: awaited before appending more, or with `pipelined` started in its
/// own task (as the broker does for publisher confirms) while appending goes
/// on, at most `PIPELINE` outstanding.
async fn append_case(dir: &Path, size: usize, sync_every: Option<u64>, pipelined: bool, dd: f64) {
    let path = dir.join(format!("append-{size}-{sync_every:?}-{pipelined}"));
    let (s, _) = Shard::open(&path, ShardConfig::default()).await.unwrap();
    let s = Rc::new(s);
    let mut pending: VecDeque<glommio::task::JoinHandle<Synced>> = VecDeque::new();
    let body = Bytes::from(vec![0xabu8; size]);
    let max_bytes: u64 = if quick() { 256 << 20 } else { 1 << 30 };
    let max_time = Duration::from_secs(if quick() { 1 } else { 3 });
    let n_max = (max_bytes / size as u64).max(1);
    let t = Instant::now();
    let mut n = 0u64;
    let mut syncs = 0u64;
    while n < n_max {
        s.append(1, b"", &body).unwrap();
        n += 1;
        if n.is_multiple_of(256) {
            // The broker's event loop yields between batches; so does this loop.
            s.throttle().await;
        }
        if let Some(k) = sync_every {
            if n.is_multiple_of(k) {
                if pipelined {
                    let s2 = s.clone();
                    pending.push_back(glommio::spawn_local(async move { s2.sync().await.unwrap() }).detach());
                    if pending.len() > PIPELINE {
                        pending.pop_front().unwrap().await.unwrap();
                    }
                } else {
                    s.sync().await.unwrap();
                }
                syncs += 1;
            }
        }
        if (n.is_multiple_of(4096) || sync_every.is_some_and(|k| k < 4096 && n.is_multiple_of(k))) && t.elapsed() > max_time {
            break;
        }
    }
    for h in pending {
        h.await.unwrap();
    }
    s.sync().await.unwrap();
    let secs = t.elapsed().as_secs_f64();
    let mbps = (n * size as u64) as f64 / secs / 1e6;
    let policy = match sync_every {
        None => "no sync (one at the end)".to_string(),
        Some(k) if pipelined => format!("sync every {k}, pipelined (≤ {PIPELINE} outstanding; {syncs} syncs)"),
        Some(k) => format!("sync every {k} ({syncs} syncs, {:.0} µs/sync)", secs * 1e6 / syncs.max(1) as f64),
    };
    row(
        &format!("append {size} B, {policy}"),
        format!("{mbps:.0} MB/s, {:.0} krec/s", n as f64 / secs / 1e3),
        format!("{:.0}% of dd; {n} records", mbps / dd * 100.0),
    );
    let Ok(s) = Rc::try_unwrap(s) else { panic!("sync tasks still hold the shard") };
    s.destroy().await.unwrap();
    settle().await;
}

/// Lets the filesystem finish freeing (discard) and writeback from the previous case.
async fn settle() {
    let _ = glommio::executor()
        .spawn_blocking(|| {
            let _ = std::process::Command::new("sync").status();
            std::thread::sleep(Duration::from_millis(500));
        })
        .await;
}

async fn delete_case(dir: &Path) {
    let path = dir.join("delete");
    let cfg = ShardConfig { cache_bytes: 1 << 20, ..Default::default() };
    let (s, _) = Shard::open(&path, cfg).await.unwrap();
    let n: u64 = if quick() { 1 << 20 } else { 4 << 20 };
    let body = Bytes::from_static(&[7u8; 16]);
    for i in 0..n {
        s.append(0, b"", &body).unwrap();
        if i % 256 == 0 {
            s.throttle().await;
        }
    }
    s.sync().await.unwrap();
    // Shuffled order (xorshift Fisher-Yates), batches of 1024 offsets.
    let mut offs: Vec<u64> = (0..n).collect();
    let mut x = 0x9e3779b97f4a7c15u64;
    for i in (1..offs.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        offs.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let t = Instant::now();
    for chunk in offs.chunks(1024) {
        s.delete_by_offsets(chunk).unwrap();
    }
    let ns = t.elapsed().as_secs_f64() * 1e9 / n as f64;
    row(
        "delete_by_offsets, random order, batches of 1024",
        format!("{ns:.1} ns/offset"),
        format!("{n} offsets of 16 B records, {} segments", s.segment_count()),
    );
    let t = Instant::now();
    s.sync().await.unwrap();
    row(
        "sync after deleting all (bitmap fdatasync + segment removal)",
        format!("{:.1} ms", t.elapsed().as_secs_f64() * 1e3),
        String::new(),
    );
    s.destroy().await.unwrap();
}

async fn read_cases(dir: &Path) {
    let path = dir.join("read");
    let n: u64 = if quick() { 100_000 } else { 500_000 };
    let cfg = ShardConfig { cache_bytes: 1 << 30, ..Default::default() };
    let (s, _) = Shard::open(&path, cfg).await.unwrap();
    let body = Bytes::from(vec![1u8; 1024]);
    for i in 0..n {
        s.append(0, b"hdr", &body).unwrap();
        if i % 256 == 0 {
            s.throttle().await;
        }
    }
    s.sync().await.unwrap();
    let t = Instant::now();
    let mut sum = 0usize;
    for o in 0..n {
        sum += s.read_cached(o).unwrap().body.len();
    }
    row("read_cached 1 KiB", format!("{:.0} ns/record", t.elapsed().as_secs_f64() * 1e9 / n as f64), format!("{n} records, {sum} bytes"));
    s.close().await.unwrap();
    drop(s);
    let cfg = ShardConfig { cache_bytes: 0, ..Default::default() };
    let (s, _) = Shard::open(&path, cfg).await.unwrap();
    let reads = if quick() { 2000 } else { 10_000 };
    let mut x = 88172645463325252u64;
    let t = Instant::now();
    for _ in 0..reads {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let r = s.read(x % n).await.unwrap().unwrap();
        assert_eq!(r.body.len(), 1024);
    }
    row(
        "read 1 KiB from disk, random offsets, one at a time",
        format!("{:.1} µs/record", t.elapsed().as_secs_f64() * 1e6 / reads as f64),
        "direct I/O, no page cache".into(),
    );
    let t = Instant::now();
    let mut r = s.reader(0);
    let mut got = 0u64;
    while let Some(rec) = r.next().await.unwrap() {
        assert_eq!(rec.body.len(), 1024);
        got += 1;
    }
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(got, n);
    row(
        "sequential reader 1 KiB from disk",
        format!("{:.0} MB/s, {:.0} krec/s", (n * 1027) as f64 / secs / 1e6, n as f64 / secs / 1e3),
        "1 MiB reads".into(),
    );
    s.destroy().await.unwrap();
}

async fn recovery_case(dir: &Path) {
    let path = dir.join("recover");
    let gib: u64 = if quick() { 256 << 20 } else { 1 << 30 };
    let (s, _) = Shard::open(&path, ShardConfig::default()).await.unwrap();
    let body = Bytes::from(vec![3u8; 1024]);
    let n = gib / 1048;
    for i in 0..n {
        // flags 1 (the broker's persistent flag) on every record: see open_retaining below
        s.append(1, b"", &body).unwrap();
        if i % 256 == 0 {
            s.throttle().await;
        }
    }
    s.close().await.unwrap();
    drop(s);
    for verify in [false, true] {
        let cfg = ShardConfig { verify_on_open: verify, ..Default::default() };
        let t = Instant::now();
        let (s, rep) = Shard::open(&path, cfg).await.unwrap();
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(rep.records, n);
        row(
            &format!("reopen {:.2} GiB shard (1 KiB records), verify_on_open={verify}", gib as f64 / (1u64 << 30) as f64),
            format!("{:.0} ms ({:.2} s/GiB)", secs * 1e3, secs / (gib as f64 / (1u64 << 30) as f64)),
            format!("{n} records, {} segments; tail segment always scanned", s.segment_count()),
        );
        s.close().await.unwrap();
    }
    // A restart of a durable queue: keep bit 0 (every record has it: the seals say so, so
    // no sealed segment is read), then keep bit 1 (no record has it: every sealed segment's
    // record heads are read, and everything is deleted, synced and its segments removed).
    for (keep, note) in [(1u8, "all kept: sealed segments skipped by their flags summary"), (2, "none kept: heads read, all deleted")] {
        let t = Instant::now();
        let (s, rep) = Shard::open_retaining(&path, ShardConfig::default(), keep).await.unwrap();
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(rep.records + rep.discarded, n);
        row(
            &format!("open_retaining {:.2} GiB shard (1 KiB records), keep={keep}", gib as f64 / (1u64 << 30) as f64),
            format!("{:.0} ms", secs * 1e3),
            format!("{note}; {} discarded", rep.discarded),
        );
        s.close().await.unwrap();
    }
    let (s, _) = Shard::open(&path, ShardConfig::default()).await.unwrap();
    s.destroy().await.unwrap();
}

fn want(case: &str) -> bool {
    std::env::var("BENCH_ONLY").map(|o| o.split(',').any(|x| case.starts_with(x))).unwrap_or(true)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = bench_dir();
    println!("shard microbenchmarks in {} ({} cores)", dir.display(), std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0));
    let dd = dd_mbps(&dir);
    let (fmed, fp99) = fdatasync_us(&dir);
    println!();
    println!("| case | figure | note |");
    println!("|---|---|---|");
    row("dd bs=1M count=1024 oflag=direct", format!("{dd:.0} MB/s"), "same disk, same run".into());
    row("fdatasync after a 4 KiB write", format!("{fmed:.0} µs median"), format!("p99 {fp99:.0} µs"));
    let d2 = dir.clone();
    glommio::LocalExecutorBuilder::default()
        .spawn(move || async move {
            for size in [16usize, 1024, 65536] {
                for sync in [None, Some(1), Some(64), Some(1024)] {
                    if want(&format!("append{size}-{}", sync.unwrap_or(0))) {
                        append_case(&d2, size, sync, false, dd).await;
                    }
                }
                if want(&format!("append{size}-p1024")) {
                    append_case(&d2, size, Some(1024), true, dd).await;
                }
            }
            if want("delete") {
                delete_case(&d2).await;
            }
            if want("read") {
                read_cases(&d2).await;
            }
            if want("recover") {
                recovery_case(&d2).await;
            }
        })
        .unwrap()
        .join()
        .unwrap();
    let dd2 = dd_mbps(&dir);
    row("dd again at the end", format!("{dd2:.0} MB/s"), String::new());
    let _ = std::fs::remove_dir_all(&dir);
}
