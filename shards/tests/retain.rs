//! `Shard::open_retaining`: at open, live records whose flags lack the kept bits are deleted
//! (bitmap bits, durable before the open returns) and the segments they empty are removed;
//! the others, their order and their bytes stay; records appended later are untouched until
//! the next such open. Sealed segments are sifted from their record heads (or skipped when
//! their seal says every record has the flags), unsealed ones during the recovery scan,
//! with or without `verify_on_open`, and after a crash (kill -9, `abandon`).

mod common;

use std::{os::unix::fs::FileExt, path::Path};

use common::*;
use ringmq_shards::{Shard, ShardConfig};

/// The flag the broker keeps (`FLAG_PERSISTENT`); other bits ride along.
const KEEP: u8 = 1;

/// Flags of record `o` in [`fill`]: mixed 0..200 (odd offsets kept), all discarded
/// 200..400 (whole segments), all kept 400..600 (with another bit set), mixed again 600..650
/// (the newest, unsealed segment).
fn flags(o: u64) -> u8 {
    match o {
        200..400 => 0b10,
        400..600 => KEEP | 0b100,
        _ if o % 2 == 1 => KEEP,
        _ => 0,
    }
}

const BODY: usize = 1000;
const N: u64 = 650;
/// Deleted before the close: kept ones (11, 13) and discarded ones (10, 250) alike.
const DELETED: [u64; 4] = [10, 11, 13, 250];

/// Appends the 650 records of [`flags`] (1000-byte bodies, 64 KiB segments: ~60 a
/// segment), deletes [`DELETED`], syncs and closes.
fn fill(path: &Path) {
    let path = path.to_path_buf();
    run(move || async move {
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        for o in 0..N {
            assert_eq!(s.append(flags(o), &header(o), &body(o, BODY)).unwrap(), o);
        }
        s.delete_by_offsets(&DELETED).unwrap();
        s.close().await.unwrap();
    });
}

fn kept(o: u64) -> bool {
    flags(o) & KEEP == KEEP && !DELETED.contains(&o)
}

fn expected_live() -> Vec<u64> {
    (0..N).filter(|&o| kept(o)).collect()
}

fn expected_discarded() -> u64 {
    (0..N).filter(|&o| flags(o) & KEEP != KEEP && !DELETED.contains(&o)).count() as u64
}

/// Opens with `open_retaining` and checks what is left, record by record.
fn open_and_check(path: &Path, cfg: ShardConfig) {
    let path = path.to_path_buf();
    let segs_before = seg_files(&path).len();
    run(move || async move {
        let (s, rep) = Shard::open_retaining(&path, cfg.clone(), KEEP).await.unwrap();
        assert!(rep.dropped.is_empty() && rep.warnings.is_empty(), "{rep:?}");
        assert_eq!(rep.discarded, expected_discarded(), "{rep:?}");
        assert_eq!(rep.records, expected_live().len() as u64, "{rep:?}");
        assert_eq!(s.live_offsets(), expected_live());
        assert_eq!(s.len(), expected_live().len() as u64);
        assert_eq!(s.next_offset(), N, "offsets go on after the discarded ones");
        for o in 0..N {
            match s.read(o).await.unwrap() {
                Some(r) => {
                    assert!(kept(o), "record {o} (flags {:#b}) should be gone", flags(o));
                    assert_eq!((r.flags, &r.header[..], r.body.clone()), (flags(o), &header(o)[..], body(o, BODY)));
                }
                None => assert!(!kept(o), "record {o} lost"),
            }
        }
        let mut r = s.reader(0);
        let mut seen = Vec::new();
        for _ in 0..N {
            match r.next().await.unwrap() {
                Some(rec) => seen.push(rec.offset),
                None => break,
            }
        }
        assert_eq!(seen, expected_live(), "the reader yields the kept records in order");
        // The segments of 200..400 were all discarded: retired before open returned.
        let segs_after = seg_files(&path).len();
        assert!(segs_after + 2 <= segs_before, "segments before {segs_before}, after {segs_after}");
        s.close().await.unwrap();
        // The deletes are durable: a plain open sees the same records.
        let (s, rep) = Shard::open(&path, cfg.clone()).await.unwrap();
        assert_eq!((rep.records, rep.discarded), (expected_live().len() as u64, 0));
        assert_eq!(s.live_offsets(), expected_live());
        // Records appended later are kept by a plain open and go at the next open_retaining.
        for o in N..N + 10 {
            assert_eq!(s.append(flags(o), &header(o), &body(o, BODY)).unwrap(), o);
        }
        s.close().await.unwrap();
        let (s, rep) = Shard::open(&path, cfg.clone()).await.unwrap();
        assert_eq!(rep.records, expected_live().len() as u64 + 10);
        s.close().await.unwrap();
        let (s, rep) = Shard::open_retaining(&path, cfg, KEEP).await.unwrap();
        assert_eq!(rep.discarded, 5, "{rep:?}");
        let mut want = expected_live();
        want.extend((N..N + 10).filter(|o| o % 2 == 1));
        assert_eq!(s.live_offsets(), want);
        s.close().await.unwrap();
    });
}

#[test]
fn open_retaining_deletes_records_lacking_the_flags() {
    let dir = tmpdir();
    fill(dir.path());
    let path = dir.path().to_path_buf();
    run(move || async move {
        // A plain open, and one keeping no flag, keep everything.
        let all: Vec<u64> = (0..N).filter(|o| !DELETED.contains(o)).collect();
        let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!((rep.discarded, s.live_offsets()), (0, all.clone()));
        s.close().await.unwrap();
        let (s, rep) = Shard::open_retaining(&path, small_cfg(), 0).await.unwrap();
        assert_eq!((rep.discarded, s.live_offsets()), (0, all));
        s.close().await.unwrap();
    });
    open_and_check(dir.path(), small_cfg());
}

#[test]
fn open_retaining_with_verify_on_open() {
    let dir = tmpdir();
    fill(dir.path());
    open_and_check(dir.path(), ShardConfig { verify_on_open: true, ..small_cfg() });
}

/// After kill -9 (no close, the tail unsynced): whatever survived, nothing lacking the flags.
#[test]
fn open_retaining_after_a_crash() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    run(move || async move {
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        for o in 0..300 {
            s.append(flags(o), &header(o), &body(o, BODY)).unwrap();
        }
        let synced = s.sync().await.unwrap().upto();
        for o in 300..320 {
            s.append(flags(o), &header(o), &body(o, BODY)).unwrap();
        }
        s.abandon().await;
        let (s, rep) = Shard::open_retaining(&path, small_cfg(), KEEP).await.unwrap();
        let live = s.live_offsets();
        assert!(live.iter().all(|&o| flags(o) & KEEP == KEEP), "{live:?}");
        let want: Vec<u64> = (0..synced).filter(|&o| flags(o) & KEEP == KEEP).collect();
        assert_eq!(&live[..want.len()], &want[..], "every synced kept record is there");
        assert!(rep.discarded >= (0..synced).filter(|&o| flags(o) & KEEP != KEEP).count() as u64, "{rep:?}");
        s.close().await.unwrap();
    });
}

/// The seal's summary of a segment's flags: a sealed segment whose records all have the
/// kept flags is not read at open; an index sealed without the summary (an older version)
/// is sifted from the record heads. Shown with a record head changed on disk after the seal.
#[test]
fn sealed_segments_are_read_only_without_a_summary_that_rules_them_out() {
    let dir = tmpdir();
    fill(dir.path());
    let path = dir.path().to_path_buf();
    // A sealed segment inside 400..600 (all kept): its first record's flags byte cleared.
    let seg = seg_files(&path).into_iter().find(|p| (400..=530).contains(&base_of(p))).expect("a segment in 400..600");
    let base = base_of(&seg);
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    f.write_all_at(&[0], 4096 + 16).unwrap();
    drop(f);
    let idx = seg.with_extension("idx");
    let p2 = path.clone();
    run(move || async move {
        // The summary says all kept: the changed head is not read (found by a later read).
        let (s, rep) = Shard::open_retaining(&p2, small_cfg(), KEEP).await.unwrap();
        assert_eq!(rep.discarded, expected_discarded(), "{rep:?}");
        assert!(s.is_live(base));
        s.close().await.unwrap();
    });
    // Now as an older version sealed it: no summary bit (bit 1 of the flags at 12..16).
    let mut h = vec![0u8; 56];
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&idx).unwrap();
    f.read_exact_at(&mut h, 0).unwrap();
    assert_eq!(u32::from_le_bytes(h[12..16].try_into().unwrap()) & 3, 3, "sealed with a summary");
    h[12..16].copy_from_slice(&1u32.to_le_bytes());
    let crc = crc32fast::hash(&h[0..52]);
    h[52..56].copy_from_slice(&crc.to_le_bytes());
    f.write_all_at(&h, 0).unwrap();
    drop(f);
    run(move || async move {
        let (s, rep) = Shard::open_retaining(&path, small_cfg(), KEEP).await.unwrap();
        assert_eq!(rep.discarded, 1, "the head read says flags 0: {rep:?}");
        assert!(!s.is_live(base));
        assert!(s.is_live(base + 1));
        s.close().await.unwrap();
    });
}

fn base_of(p: &Path) -> u64 {
    p.file_stem().unwrap().to_str().unwrap().parse().unwrap()
}
