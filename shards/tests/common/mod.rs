//! Helpers shared by the shard tests.
#![allow(dead_code)]

use std::future::Future;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use ringmq_shards::{Record, Shard, ShardConfig};

/// Runs `f` on a fresh glommio executor thread (fresh IOPOLL probe state).
pub fn run<F, Fut>(f: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    glommio::LocalExecutorBuilder::default().spawn(f).expect("spawn executor").join().expect("executor thread");
}

/// A temp dir on the same filesystem as the target dir (not tmpfs), so direct
/// I/O and the IOPOLL probe behave as in production.
pub fn tmpdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("shard-test").tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir")
}

/// Small segments and no cache: every path (roll, removal, disk reads) runs.
pub fn small_cfg() -> ShardConfig {
    ShardConfig { segment_bytes: 64 << 10, cache_bytes: 0, verify_on_open: false }
}

/// Deterministic body for offset `o`, `n` bytes.
pub fn body(o: u64, n: usize) -> Bytes {
    Bytes::from((0..n).map(|i| (o as usize * 31 + i * 7) as u8).collect::<Vec<u8>>())
}

/// Deterministic header for offset `o`.
pub fn header(o: u64) -> Vec<u8> {
    format!("h{o}").into_bytes()
}

/// Asserts that `r` is the record `check_append` would have written at `o`.
pub fn check(r: &Record, o: u64, n: usize) {
    assert_eq!(r.offset, o);
    assert_eq!(&r.header[..], &header(o)[..], "header of {o}");
    assert_eq!(r.body, body(o, n), "body of {o}");
    assert_eq!(r.flags, (o % 256) as u8);
}

/// Appends the deterministic record for the next offset.
pub fn put(s: &Shard, n: usize) -> u64 {
    let o = s.next_offset();
    let got = s.append((o % 256) as u8, &header(o), &body(o, n)).expect("append");
    assert_eq!(got, o);
    o
}

/// The segment files (`*.seg`) of a shard directory, sorted by name (= base offset).
pub fn seg_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "seg")).collect();
    v.sort();
    v
}
