//! Recovery from damaged files: a CRC-corrupt record in a sealed segment is
//! reported and skipped without losing its neighbours; a torn or garbage tail
//! is truncated and reported; recovery never panics.

mod common;

use std::{
    fs::OpenOptions,
    io::{Seek, SeekFrom, Write},
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use common::*;
use ringmq_shards::{Shard, ShardConfig, StoreError};

/// Writes 300 records of 1000 bytes (many 64 KiB segments) and closes.
fn fill(path: PathBuf) {
    run(move || async move {
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        for _ in 0..300 {
            put(&s, 1000);
        }
        s.close().await.unwrap();
    });
}

/// Byte position of record `k` of a segment whose records are all 1000-byte
/// bodies with `h{o}` headers (24-byte head).
fn record_pos(base: u64, k: u64) -> u64 {
    let mut pos = 4096;
    for o in base..base + k {
        pos += 24 + header(o).len() as u64 + 1000;
    }
    pos
}

fn base_of(p: &Path) -> u64 {
    p.file_stem().unwrap().to_str().unwrap().parse().unwrap()
}

#[test]
fn corrupt_record_in_sealed_segment_is_skipped() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    fill(path.clone());
    let segs = seg_files(&path);
    let victim = &segs[1];
    let base = base_of(victim);
    let bad = base + 5;
    let f = OpenOptions::new().write(true).open(victim).unwrap();
    f.write_all_at(b"XX", record_pos(base, 5) + 100).unwrap();
    drop(f);
    run(move || async move {
        // verify_on_open: reported at open, neighbours intact.
        let cfg = ShardConfig { verify_on_open: true, ..small_cfg() };
        let (s, rep) = Shard::open(&path, cfg).await.unwrap();
        assert_eq!(rep.dropped.len(), 1, "{rep:?}");
        assert_eq!((rep.dropped[0].0, rep.dropped[0].1), (bad, bad + 1));
        assert!(rep.dropped[0].2.contains("CRC"), "{rep:?}");
        assert_eq!(rep.records, 299);
        assert!(!s.is_live(bad));
        for o in [bad - 1, bad + 1] {
            check(&s.read(o).await.unwrap().unwrap(), o, 1000);
        }
        s.close().await.unwrap();
    });
    // Without verify_on_open: found on read, reported as Corrupt, then gone.
    let dir2 = tmpdir();
    let path2 = dir2.path().to_path_buf();
    fill(path2.clone());
    let victim = seg_files(&path2)[1].clone();
    let f = OpenOptions::new().write(true).open(&victim).unwrap();
    f.write_all_at(b"XX", record_pos(base, 5) + 100).unwrap();
    drop(f);
    run(move || async move {
        let (s, rep) = Shard::open(&path2, small_cfg()).await.unwrap();
        assert!(rep.dropped.is_empty());
        let e = s.read(bad).await.unwrap_err();
        assert!(matches!(e, StoreError::Corrupt { offset, .. } if offset == bad), "{e}");
        assert!(e.to_string().contains("CRC"), "{e}");
        assert_eq!(s.read(bad).await.unwrap(), None);
        check(&s.read(bad + 1).await.unwrap().unwrap(), bad + 1, 1000);
        // The sequential reader skips it too.
        let mut r = s.reader(bad - 2);
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(r.next().await.unwrap().unwrap().offset);
        }
        assert_eq!(seen, vec![bad - 2, bad - 1, bad + 1, bad + 2]);
    });
}

#[test]
fn torn_and_garbage_tails_are_truncated() {
    for damage in 0..4 {
        let dir = tmpdir();
        let path = dir.path().to_path_buf();
        fill(path.clone());
        let tail = seg_files(&path).pop().unwrap();
        let base = base_of(&tail);
        let f = OpenOptions::new().write(true).open(&tail).unwrap();
        let len = f.metadata().unwrap().len();
        let last = 299 - base; // index of the last record in the tail segment
        match damage {
            // A torn last record: its second half zeroed.
            0 => f.write_all_at(&[0u8; 600], record_pos(base, last) + 500).unwrap(),
            // A flipped byte in the last record.
            1 => f.write_all_at(b"!", record_pos(base, last) + 30).unwrap(),
            // Random garbage appended after the records.
            2 => {
                let mut g = f;
                g.seek(SeekFrom::Start(len)).unwrap();
                g.write_all(&[0x5a; 10_000]).unwrap();
            }
            // File cut in the middle of the last record.
            _ => f.set_len(record_pos(base, last) + 100).unwrap(),
        }
        run(move || async move {
            let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
            let expect_next = if damage == 2 { 300 } else { 299 };
            assert_eq!(s.next_offset(), expect_next, "damage {damage}: {rep:?}");
            assert_eq!(rep.dropped.len(), 1, "damage {damage}: {rep:?}");
            assert_eq!(rep.dropped[0].0, expect_next);
            assert!(rep.dropped[0].2.contains("torn tail"), "{rep:?}");
            check(&s.read(expect_next - 1).await.unwrap().unwrap(), expect_next - 1, 1000);
            // Appending after the repair works and survives a reopen.
            let o = put(&s, 1000);
            s.close().await.unwrap();
            let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
            assert!(rep.dropped.is_empty(), "repaired tail reopens clean: {rep:?}");
            check(&s.read(o).await.unwrap().unwrap(), o, 1000);
        });
    }
}

#[test]
fn garbage_side_files_and_headers_do_not_panic() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    fill(path.clone());
    let segs = seg_files(&path);
    // Trash an index and a bitmap of sealed segments, and a segment header.
    std::fs::write(segs[0].with_extension("idx"), b"garbage").unwrap();
    std::fs::write(segs[1].with_extension("del"), vec![0xff; 9000]).unwrap();
    let f = OpenOptions::new().write(true).open(&segs[2]).unwrap();
    f.write_all_at(&[0xee; 64], 0).unwrap();
    drop(f);
    run(move || async move {
        let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert!(!rep.warnings.is_empty(), "{rep:?}");
        // Segment 0 is rescanned (index rebuilt), segment 1 keeps its records
        // (bitmap recreated: all live), segment 2's header is rewritten.
        assert_eq!(rep.records, 300, "{rep:?}");
        for o in 0..300 {
            check(&s.read(o).await.unwrap().unwrap(), o, 1000);
        }
        s.close().await.unwrap();
        let (_, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!(rep.records, 300);
    });
}

/// The tail segment cut exactly at a record boundary (a cut the records alone cannot tell
/// from their end), or zeroed from one: the loss is reported, with the offsets the index
/// listed, and the repaired shard reopens with nothing to say.
#[test]
fn a_tail_cut_or_zeroed_at_a_record_boundary_is_reported() {
    for zero in [false, true] {
        let dir = tmpdir();
        let path = dir.path().to_path_buf();
        fill(path.clone());
        let tail = seg_files(&path).pop().unwrap();
        let base = base_of(&tail);
        let kept = (299 - base) - 3;
        let at = record_pos(base, kept);
        assert!(!at.is_multiple_of(4096), "the cut is not on a block boundary: {at}");
        let f = OpenOptions::new().write(true).open(&tail).unwrap();
        if zero {
            f.write_all_at(&vec![0u8; (record_pos(base, 300 - base) - at) as usize], at).unwrap();
        } else {
            f.set_len(at).unwrap();
        }
        drop(f);
        run(move || async move {
            let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
            assert_eq!(s.next_offset(), base + kept, "{rep:?}");
            let lost = format!("offsets {}..300", base + kept);
            if zero {
                // Zeros after whole records are also what a crash leaves of unsynced appends.
                assert!(rep.dropped.is_empty(), "{rep:?}");
                assert!(rep.warnings.iter().any(|w| w.contains(&lost)), "zero: {rep:?}");
            } else {
                assert_eq!(rep.dropped.len(), 1, "cut: {rep:?}");
                assert_eq!((rep.dropped[0].0, rep.dropped[0].1), (base + kept, 300), "{rep:?}");
                assert!(rep.dropped[0].2.contains("cut short"), "{rep:?}");
            }
            check(&s.read(base + kept - 1).await.unwrap().unwrap(), base + kept - 1, 1000);
            s.close().await.unwrap();
            let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
            assert!(rep.dropped.is_empty() && rep.warnings.is_empty(), "said once: {rep:?}");
            let o = put(&s, 1000);
            assert_eq!(o, base + kept);
            s.close().await.unwrap();
            let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
            assert!(rep.dropped.is_empty() && rep.warnings.is_empty(), "{rep:?}");
            check(&s.read(o).await.unwrap().unwrap(), o, 1000);
            s.close().await.unwrap();
        });
    }
}
