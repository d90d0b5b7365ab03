//! Preallocated segment files: the active segment is fallocated to
//! `segment_bytes` when created, so its tail is zeros (unwritten extents).
//! After a crash that zero tail reads as the end of the log, never as damage;
//! non-zero bytes in it are a torn tail (reported, truncated); a sealed
//! segment gives its unused preallocation back.

mod common;

use std::{
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use common::*;
use ringmq_shards::{Shard, ShardConfig};

const SEG: u64 = 1 << 20;

fn cfg() -> ShardConfig {
    ShardConfig { segment_bytes: SEG, cache_bytes: 0, verify_on_open: false }
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

/// Appends `n` records of 1000 bytes, syncs, then appends `unsynced` more
/// without a sync and stops as kill -9 would. Returns the synced count.
fn crash_after(path: PathBuf, n: usize, unsynced: usize) -> u64 {
    let (tx, rx) = std::sync::mpsc::channel();
    run(move || async move {
        let (s, rep) = Shard::open(&path, cfg()).await.unwrap();
        assert!(rep.dropped.is_empty());
        for _ in 0..n {
            put(&s, 1000);
        }
        let synced = s.sync().await.unwrap().upto();
        for _ in 0..unsynced {
            put(&s, 1000);
        }
        s.abandon().await;
        tx.send(synced).unwrap();
    });
    rx.recv().unwrap()
}

#[test]
fn preallocated_tail_reads_as_end_of_log_after_crash() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    // 100 records (~100 KiB) in a 1 MiB segment; 50 more never written.
    let synced = crash_after(path.clone(), 100, 50);
    assert_eq!(synced, 100);
    let segs = seg_files(&path);
    assert_eq!(segs.len(), 1);
    assert_eq!(file_len(&segs[0]), SEG, "the active segment is preallocated");
    let p2 = path.clone();
    run(move || async move {
        let (s, rep) = Shard::open(&p2, cfg()).await.unwrap();
        assert!(rep.dropped.is_empty(), "a zero tail is not damage: {rep:?}");
        // The 50 appends the crash cut are named once (their index entries said so).
        assert_eq!(rep.warnings.len(), 1, "{rep:?}");
        assert!(rep.warnings[0].contains("offsets 100..150 were appended before the crash but are not in the file"), "{rep:?}");
        assert_eq!(rep.records, 100);
        assert_eq!(s.next_offset(), 100);
        for o in 0..100 {
            check(&s.read(o).await.unwrap().unwrap(), o, 1000);
        }
        // Appending continues in the preallocated space and survives a crash.
        let o = put(&s, 1000);
        assert_eq!(o, 100);
        s.sync().await.unwrap();
        put(&s, 1000);
        s.abandon().await;
        let (s, rep) = Shard::open(&p2, cfg()).await.unwrap();
        assert!(rep.dropped.is_empty(), "{rep:?}");
        assert_eq!(rep.warnings.len(), 1, "the one unsynced append: {rep:?}");
        assert!(rep.warnings[0].contains("offsets 101..102"), "{rep:?}");
        assert_eq!(s.next_offset(), 101);
        check(&s.read(100).await.unwrap().unwrap(), 100, 1000);
        s.close().await.unwrap();
    });
    assert_eq!(file_len(&seg_files(&path)[0]), SEG, "still preallocated after recovery");
}

#[test]
fn garbage_in_preallocated_tail_is_a_torn_tail() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    crash_after(path.clone(), 100, 0);
    let seg = seg_files(&path).pop().unwrap();
    // A write that landed far past the end of the records (e.g. a later chunk
    // written before an earlier one when the crash hit).
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    f.write_all_at(&[0x5a; 4096], 512 << 10).unwrap();
    drop(f);
    let p2 = path.clone();
    run(move || async move {
        let (s, rep) = Shard::open(&p2, cfg()).await.unwrap();
        assert_eq!(s.next_offset(), 100, "{rep:?}");
        assert_eq!(rep.dropped.len(), 1, "{rep:?}");
        assert_eq!(rep.dropped[0].0, 100);
        assert!(rep.dropped[0].2.contains("torn tail"), "{rep:?}");
        check(&s.read(99).await.unwrap().unwrap(), 99, 1000);
        let o = put(&s, 1000);
        s.close().await.unwrap();
        let (s, rep) = Shard::open(&p2, cfg()).await.unwrap();
        assert!(rep.dropped.is_empty(), "repaired tail reopens clean: {rep:?}");
        check(&s.read(o).await.unwrap().unwrap(), o, 1000);
        s.close().await.unwrap();
    });
    let mut buf = vec![0u8; 4096];
    let f = std::fs::File::open(seg_files(&path).pop().unwrap()).unwrap();
    f.read_exact_at(&mut buf, 512 << 10).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "the garbage is gone");
}

#[test]
fn sealed_segments_give_back_their_preallocation() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    let p2 = path.clone();
    // Record sizes: 100 small ones, then two of 950 KB (each too large for the
    // rest of the current segment), then 10 small ones.
    let size = |o: u64| if o == 100 || o == 101 { 950_000 } else { 1000 };
    run(move || async move {
        let (s, _) = Shard::open(&p2, cfg()).await.unwrap();
        for o in 0..112 {
            put(&s, size(o));
        }
        // The sync after the rolls seals the two full segments.
        s.sync().await.unwrap();
        assert_eq!(s.segment_count(), 3);
        s.close().await.unwrap();
    });
    let segs = seg_files(&path);
    assert_eq!(segs.len(), 3);
    for (p, max) in [(&segs[0], 200 << 10), (&segs[1], 940 << 10)] {
        let n = file_len(p);
        assert!(n <= max && n.is_multiple_of(4096), "{}: {n} bytes", p.display());
    }
    assert_eq!(file_len(&segs[2]), SEG, "the active segment keeps its preallocation");
    run(move || async move {
        let cfg = ShardConfig { verify_on_open: true, ..cfg() };
        let (s, rep) = Shard::open(&path, cfg).await.unwrap();
        assert!(rep.dropped.is_empty() && rep.warnings.is_empty(), "{rep:?}");
        assert_eq!(rep.records, 112);
        for o in 0..112 {
            check(&s.read(o).await.unwrap().unwrap(), o, size(o));
        }
    });
}

/// Bytes of disk the files of `dir` take (allocated blocks).
fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().metadata().unwrap().blocks() * 512).sum()
}

/// A prepared, empty shard takes its header page, not a preallocation step; once every
/// record is deleted, `shrink_if_empty` gives the grown segment back and offsets go on.
#[test]
fn an_empty_shard_takes_little_disk_and_shrinks_back_when_drained() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    let big = || ShardConfig { segment_bytes: 64 << 20, ..cfg() };
    let p = path.clone();
    run(move || async move {
        let (s, _) = Shard::open(&p, big()).await.unwrap();
        s.prepare().await.unwrap();
        assert!(disk_bytes(&p) <= 32 * 1024, "a prepared shard takes {} bytes", disk_bytes(&p));
        let offsets: Vec<u64> = (0..500).map(|_| put(&s, 1000)).collect();
        s.sync().await.unwrap();
        assert!(disk_bytes(&p) >= 1 << 20, "500 KB of records preallocate a step");
        s.shrink_if_empty().await.unwrap();
        assert_eq!(seg_files(&p).len(), 1, "nothing shrinks while records are live");
        s.delete_by_offsets(&offsets).unwrap();
        s.sync().await.unwrap();
        s.shrink_if_empty().await.unwrap();
        assert!(disk_bytes(&p) <= 32 * 1024, "a drained shard takes {} bytes", disk_bytes(&p));
        assert_eq!(put(&s, 10), 500, "offsets go on after the shrink");
        s.close().await.unwrap();
    });
    run(move || async move {
        let (s, rep) = Shard::open(&path, big()).await.unwrap();
        assert!(rep.dropped.is_empty(), "{rep:?}");
        assert_eq!(s.live_offsets(), vec![500]);
        assert_eq!(s.read(500).await.unwrap().unwrap().body.len(), 10);
    });
}
