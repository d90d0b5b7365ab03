//! Behaviour of the public API: append/sync/read/delete, reopen, segment
//! roll and removal, coalesced syncs, the sequential reader, errors.

mod common;

use std::rc::Rc;

use bytes::Bytes;
use common::*;
use ringmq_shards::{free_disk_bytes, Shard, ShardConfig, StoreError};

/// The IOPOLL trap (DESIGN.md): a fresh executor thread, an empty directory,
/// write then read back from disk (cache disabled) must not fail with os error 95.
#[test]
fn empty_dir_write_then_read_back_from_disk() {
    let dir = tmpdir();
    let path = dir.path().join("fresh/shard");
    run(move || async move {
        let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!((rep.records, s.next_offset(), s.start_offset(), s.len()), (0, 0, 0, 0));
        for _ in 0..10 {
            put(&s, 100);
        }
        let synced = s.sync().await.unwrap();
        assert_eq!(synced.upto(), 10);
        assert!(s.read_cached(3).is_none(), "cache_bytes = 0: written records are evicted");
        for o in 0..10 {
            check(&s.read(o).await.unwrap().expect("record"), o, 100);
        }
        s.close().await.unwrap();
        let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!(rep.records, 10);
        assert!(rep.dropped.is_empty(), "{rep:?}");
        check(&s.read(9).await.unwrap().unwrap(), 9, 100);
    });
}

#[test]
fn many_segments_reopen_and_big_records() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    run(move || async move {
        let sizes = |o: u64| match o % 50 {
            0 => 200_000, // bigger than a 64 KiB segment: a segment of its own
            7 => 5000,
            _ => (o % 300) as usize,
        };
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        for o in 0..600u64 {
            assert_eq!(put(&s, sizes(o)), o);
            if o % 97 == 0 {
                s.sync().await.unwrap();
            }
        }
        assert!(s.segment_count() > 10, "segments: {}", s.segment_count());
        s.close().await.unwrap();
        assert!(matches!(s.append(0, b"", &Bytes::new()), Err(StoreError::Closed { .. })));
        let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!((rep.records, rep.deleted), (600, 0));
        assert!(rep.dropped.is_empty() && rep.warnings.is_empty(), "{rep:?}");
        assert_eq!(s.next_offset(), 600);
        for o in 0..600 {
            check(&s.read(o).await.unwrap().unwrap(), o, sizes(o));
        }
        // Appends continue after reopen in the same tail segment.
        for _ in 0..5 {
            put(&s, 10);
        }
        s.sync().await.unwrap();
        s.close().await.unwrap();
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!(s.next_offset(), 605);
        check(&s.read(604).await.unwrap().unwrap(), 604, 10);
        check(&s.read(599).await.unwrap().unwrap(), 599, sizes(599));
    });
}

#[test]
fn deletes_segment_removal_and_start_offset() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    run(move || async move {
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        for _ in 0..1000 {
            put(&s, 500);
        }
        s.sync().await.unwrap();
        let segs = s.segment_count();
        assert!(segs >= 7);
        // Delete the first 600 in reverse order, plus some duplicates and unknowns.
        let mut del: Vec<u64> = (0..600).rev().collect();
        del.extend([3, 5, 10_000, u64::MAX]);
        s.delete_by_offsets(&del).unwrap();
        assert_eq!((s.len(), s.start_offset()), (400, 600));
        assert!(!s.is_live(0) && s.is_live(600) && !s.is_live(1000));
        assert_eq!(s.read(10).await.unwrap(), None);
        s.sync().await.unwrap();
        assert!(s.segment_count() < segs, "fully deleted segments are removed");
        let files = std::fs::read_dir(&path).unwrap().count();
        assert_eq!(files, 1 + 3 * s.segment_count(), "format + 3 files per segment");
        s.delete_by_offsets(&[700, 650]).unwrap();
        s.sync().await.unwrap();
        s.close().await.unwrap();
        let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!(rep.records, 398);
        assert_eq!(s.start_offset(), 600);
        let live = s.live_offsets();
        assert_eq!(live.len(), 398);
        assert!(live.windows(2).all(|w| w[0] < w[1]));
        assert!(!live.contains(&650) && live.contains(&651));
        // Delete everything: the tail segment stays, next_offset does not move back.
        s.delete_by_offsets(&live).unwrap();
        s.sync().await.unwrap();
        assert_eq!((s.len(), s.start_offset(), s.next_offset()), (0, 1000, 1000));
        s.close().await.unwrap();
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!((s.len(), s.start_offset(), s.next_offset()), (0, 1000, 1000));
        assert_eq!(put(&s, 1), 1000);
    });
}

#[test]
fn concurrent_appends_and_syncs_coalesce() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    run(move || async move {
        let (s, _) = Shard::open(&path, ShardConfig::default()).await.unwrap();
        let s = Rc::new(s);
        let mut tasks = Vec::new();
        for t in 0..8u8 {
            let s = s.clone();
            tasks.push(glommio::spawn_local(async move {
                let mut mine = Vec::new();
                for i in 0..50u32 {
                    let o = s.append(t, &[t], &Bytes::from(i.to_le_bytes().to_vec())).unwrap();
                    let synced = s.sync().await.unwrap();
                    assert!(synced.upto() > o, "sync covers my append");
                    mine.push((o, i));
                }
                mine
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await);
        }
        assert_eq!(all.len(), 400);
        let s = Rc::try_unwrap(s).unwrap();
        s.close().await.unwrap();
        let (s, rep) = Shard::open(&path, ShardConfig::default()).await.unwrap();
        assert_eq!(rep.records, 400);
        for (o, i) in all {
            assert_eq!(&s.read(o).await.unwrap().unwrap().body[..], &i.to_le_bytes());
        }
    });
}

#[test]
fn sequential_reader_mixes_disk_and_cache() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    run(move || async move {
        let cfg = ShardConfig { segment_bytes: 64 << 10, cache_bytes: 20_000, verify_on_open: false };
        let (s, _) = Shard::open(&path, cfg).await.unwrap();
        for _ in 0..2000 {
            put(&s, 100);
        }
        s.sync().await.unwrap();
        assert!(s.read_cached(1999).is_some() && s.read_cached(0).is_none());
        assert!(s.cached_bytes() <= 20_000);
        let gone: Vec<u64> = (0..2000).filter(|o| o % 3 == 0).collect();
        s.delete_by_offsets(&gone).unwrap();
        let mut r = s.reader(500);
        let mut seen = Vec::new();
        while let Some(rec) = r.next().await.unwrap() {
            check(&rec, rec.offset, 100);
            seen.push(rec.offset);
        }
        let want: Vec<u64> = (500..2000).filter(|o| o % 3 != 0).collect();
        assert_eq!(seen, want);
    });
}

#[test]
fn a_reader_that_stops_hands_over_the_rest_of_its_disk_read() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    run(move || async move {
        let cfg = ShardConfig { segment_bytes: 4 << 20, cache_bytes: 4_000, verify_on_open: false };
        let (s, _) = Shard::open(&path, cfg).await.unwrap();
        // More than one 1 MiB read window of records.
        for _ in 0..12_000 {
            put(&s, 100);
        }
        s.sync().await.unwrap();
        assert!(s.read_cached(0).is_none(), "the first records left the cache");
        s.delete_by_offsets(&[5, 6]).unwrap();
        let mut r = s.reader(0);
        let first = r.next().await.unwrap().unwrap();
        assert_eq!(first.offset, 0);
        // The rest of that disk read, live records only, in order, without another read.
        let rest: Vec<u64> = std::iter::from_fn(|| r.next_buffered())
            .map(|rec| {
                check(&rec, rec.offset, 100);
                rec.offset
            })
            .collect();
        assert!(rest.len() > 100, "a disk read of a 1 MiB window holds more than 100 records of 100 bytes: {}", rest.len());
        let want: Vec<u64> = (1..=*rest.last().unwrap()).filter(|o| *o != 5 && *o != 6).collect();
        assert_eq!(rest, want);
        assert!(r.next_buffered().is_none());
        // The reader goes on after them.
        assert_eq!(r.next().await.unwrap().unwrap().offset, rest.last().unwrap() + 1);
    });
}

#[test]
fn errors_are_clear() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    run(move || async move {
        let bad = ShardConfig { segment_bytes: 100, ..Default::default() };
        let e = Shard::open(&path, bad).await.unwrap_err();
        assert!(e.to_string().contains("segment_bytes"), "{e}");
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        let huge = Bytes::from(vec![0u8; (128 << 20) + 1]);
        let e = s.append(0, b"", &huge).unwrap_err();
        assert!(e.to_string().contains("record too large"), "{e}");
        assert_eq!(s.next_offset(), 0);
        s.close().await.unwrap();
        std::fs::write(path.join("format"), b"something else\n").unwrap();
        let e = Shard::open(&path, small_cfg()).await.unwrap_err();
        assert!(matches!(e, StoreError::Format { .. }) && e.to_string().contains("format"), "{e}");
        assert!(free_disk_bytes(&path).unwrap() > 0);
        assert!(free_disk_bytes(&path.join("missing")).is_err());
    });
}

/// A directory that vanishes under a live shard: the roll to a new segment
/// fails with an error naming the path; records already stored stay readable.
#[test]
fn vanished_directory_fails_cleanly() {
    let dir = tmpdir();
    let path = dir.path().join("s");
    run(move || async move {
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        for _ in 0..10 {
            put(&s, 100);
        }
        s.sync().await.unwrap();
        std::fs::remove_dir_all(&path).unwrap();
        let mut err = None;
        for _ in 0..1000 {
            let o = s.next_offset();
            match s.append(0, &header(o), &body(o, 1000)) {
                Ok(_) => {}
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        let e = err.expect("the segment roll must fail");
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        assert!(matches!(e, StoreError::Io { .. }), "{e:?}");
        check(&s.read(3).await.unwrap().unwrap(), 3, 100);
        s.delete_by_offsets(&[3]).unwrap();
        assert!(!s.is_live(3));
    });
}

#[test]
fn destroy_removes_everything() {
    let dir = tmpdir();
    let path = dir.path().join("q");
    run(move || async move {
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        for _ in 0..300 {
            put(&s, 1000);
        }
        s.sync().await.unwrap();
        s.destroy().await.unwrap();
        assert!(!path.exists());
    });
}

/// The IOPOLL trap with the worst start: the only segment file is empty (a
/// crash right after it was created), so recovery opens an empty file with
/// direct I/O. The marker opened first keeps the probe honest.
#[test]
fn empty_segment_file_left_by_a_crash() {
    let dir = tmpdir();
    let path = dir.path().join("s");
    std::fs::create_dir_all(&path).unwrap();
    std::fs::write(path.join("00000000000000000000.seg"), b"").unwrap();
    run(move || async move {
        let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!((rep.records, s.next_offset()), (0, 0));
        for _ in 0..20 {
            put(&s, 3000);
        }
        s.sync().await.unwrap();
        for o in 0..20 {
            check(&s.read(o).await.unwrap().unwrap(), o, 3000);
        }
        s.close().await.unwrap();
        let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!(rep.records, 20);
        check(&s.read(19).await.unwrap().unwrap(), 19, 3000);
    });
}

/// A queue that syncs after every record (a persistent publisher with confirms, one
/// at a time) writes through the small first buffer, into full-size ones and across a
/// segment roll; every record reads back from disk, also after reopening. `prepare`
/// creates the first segment before any append, and is a no-op afterwards.
#[test]
fn sync_per_record_across_buffer_sizes_and_prepare() {
    let dir = tmpdir();
    let path = dir.path().join("synced");
    run(move || async move {
        let cfg = ShardConfig { segment_bytes: 4 << 20, cache_bytes: 0, verify_on_open: true };
        let (s, _) = Shard::open(&path, cfg.clone()).await.unwrap();
        assert!(seg_files(&path).is_empty());
        s.prepare().await.unwrap();
        assert_eq!(seg_files(&path).len(), 1, "prepare creates the first segment");
        s.prepare().await.unwrap();
        assert_eq!((s.next_offset(), seg_files(&path).len()), (0, 1));
        // 5 MiB in 3,000-byte records (not block-aligned): past the 64 KiB first buffer,
        // past several 1 MiB buffers and past the 4 MiB segment.
        let n = 5 * (1 << 20) / 3000;
        for k in 0..n {
            let o = put(&s, 3000);
            assert_eq!(s.sync().await.unwrap().upto(), o + 1);
            if k % 500 == 0 {
                check(&s.read(o).await.unwrap().expect("record"), o, 3000);
            }
        }
        assert!(seg_files(&path).len() >= 2, "rolled to a second segment");
        for o in 0..n as u64 {
            check(&s.read(o).await.unwrap().expect("record"), o, 3000);
        }
        s.close().await.unwrap();
        let (s, rep) = Shard::open(&path, cfg).await.unwrap();
        assert_eq!(rep.records, n as u64);
        assert!(rep.dropped.is_empty(), "{rep:?}");
        for o in (0..n as u64).step_by(97) {
            check(&s.read(o).await.unwrap().expect("record"), o, 3000);
        }
        // After the reopen, appends continue from the recovered tail.
        let o = put(&s, 10);
        s.sync().await.unwrap();
        check(&s.read(o).await.unwrap().unwrap(), o, 10);
        s.close().await.unwrap();
    });
}

/// `skip_to` leaves offsets without records (a replica's copy of a store whose records were
/// deleted): the gap is not live, not readable, survives a reopen, and appends go on past it.
#[test]
fn skip_to_leaves_a_gap_that_survives_reopen() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    run(move || async move {
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        s.prepare().await.unwrap();
        s.skip_to(1000).unwrap();
        assert_eq!((s.next_offset(), s.len(), s.start_offset()), (1000, 0, 1000));
        for want in 1000..1005 {
            assert_eq!(put(&s, 300), want);
        }
        s.skip_to(3).unwrap();
        assert_eq!(s.next_offset(), 1005, "a skip backwards changes nothing");
        s.skip_to(5000).unwrap();
        for want in 5000..5003 {
            assert_eq!(put(&s, 300), want);
        }
        s.delete_by_offsets(&[1001]).unwrap();
        assert!(!s.is_live(500) && !s.is_live(3000) && s.is_live(1000) && s.is_live(5002));
        assert_eq!(s.read(3000).await.unwrap(), None);
        let mut r = s.reader(0);
        let mut seen = Vec::new();
        while let Some(rec) = r.next().await.unwrap() {
            check(&rec, rec.offset, 300);
            seen.push(rec.offset);
        }
        assert_eq!(seen, vec![1000, 1002, 1003, 1004, 5000, 5001, 5002]);
        s.sync().await.unwrap();
        s.skip_to(9000).unwrap();
        s.close().await.unwrap();
        let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert!(rep.dropped.is_empty(), "{rep:?}");
        assert_eq!(s.live_offsets(), vec![1000, 1002, 1003, 1004, 5000, 5001, 5002]);
        assert_eq!((s.start_offset(), s.next_offset()), (1000, 9000));
        check(&s.read(5001).await.unwrap().unwrap(), 5001, 300);
        assert_eq!(put(&s, 300), 9000);
    });
}
