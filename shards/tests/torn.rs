//! Torn and zeroed tails of every file kind of a shard (ringmq issue 14 item 6): the segment
//! file (`.seg`), its offset index (`.idx`) and its deletion bitmap (`.del`), each of the last
//! segment and of a sealed one, cut at a random offset or with the last bytes of what it holds
//! zeroed, after records were written, some deleted, and synced.
//!
//! Opening the shard must never panic. It recovers: every record written wholly before the
//! damage is read back intact (all of them when the damage is in an index, which is rebuilt,
//! or in a bitmap, which may bring back deleted records: a duplicate, never a loss), no read
//! returns wrong contents (a record in the damage is dropped at open, or reported Corrupt and
//! gone when read), and the repaired shard takes an append and reopens with nothing dropped.
//!
//! Offsets come from a seeded generator; `SHARD_TORN_SEED` replays a printed seed.

mod common;

use std::{
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use common::*;
use ringmq_shards::{Shard, StoreError};

/// Records written (a few 64 KiB segments: the last one unsealed).
const RECORDS: u64 = 150;
/// Every `DELETED_EVERY`th offset is deleted before the damage.
const DELETED_EVERY: u64 = 5;
/// Seeded cases per (file kind, segment, damage).
const CASES: u32 = 6;

fn size(o: u64) -> usize {
    200 + ((o * 2_654_435_761) % 1200) as usize
}

/// xorshift64*, seeded from `SHARD_TORN_SEED` or the clock.
struct Rng(u64);

impl Rng {
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        lo + self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % (hi - lo).max(1)
    }
}

fn seed() -> u64 {
    let s = std::env::var("SHARD_TORN_SEED").ok().and_then(|s| s.parse().ok());
    let s = s.unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1);
    eprintln!("torn-tail seed: {s} (SHARD_TORN_SEED={s} replays it)");
    s.max(1)
}

/// Writes the records, deletes every 5th, syncs and closes.
fn fill(path: PathBuf) {
    run(move || async move {
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        for o in 0..RECORDS {
            let n = size(o);
            assert_eq!(s.append((o % 256) as u8, &header(o), &body(o, n)).unwrap(), o);
        }
        let deleted: Vec<u64> = (0..RECORDS).filter(|o| o % DELETED_EVERY == 0).collect();
        s.delete_by_offsets(&deleted).unwrap();
        s.sync().await.unwrap();
        s.close().await.unwrap();
    });
}

/// `(offset, start, end)` byte positions of the records of a segment file (framing: a
/// little-endian u32 length at each record's start, 0 after the last).
fn record_spans(seg: &Path) -> Vec<(u64, u64, u64)> {
    let bytes = std::fs::read(seg).unwrap();
    let base: u64 = seg.file_stem().unwrap().to_str().unwrap().parse().unwrap();
    let mut out = Vec::new();
    let mut pos = 4096usize;
    while pos + 4 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        if len == 0 || pos + len > bytes.len() {
            break;
        }
        out.push((base + out.len() as u64, pos as u64, (pos + len) as u64));
        pos += len;
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Seg,
    Idx,
    Del,
}

#[derive(Clone, Copy, Debug)]
enum Damage {
    /// The file cut at this byte.
    Cut(u64),
    /// Bytes from here to the end of what the file holds set to zero.
    Zero(u64),
}

/// Bytes of the file that hold data: a segment's records end, an index's entries end, a
/// bitmap's bits end (the rest of a preallocated or sparse file reads as zeros anyway).
fn used_end(kind: Kind, path: &Path, records: u64) -> u64 {
    match kind {
        Kind::Seg => record_spans(path).last().map_or(4096, |r| r.2),
        Kind::Idx => 4096 + records * 4,
        Kind::Del => 4096 + records.div_ceil(8),
    }
}

fn apply(path: &Path, damage: Damage, end: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    match damage {
        Damage::Cut(at) => f.set_len(at).unwrap(),
        Damage::Zero(from) => f.write_all_at(&vec![0u8; (end - from) as usize], from).unwrap(),
    }
    f.sync_all().unwrap();
}

/// One case: a copy of the filled shard, `kind` of segment `which` (0: the first, sealed;
/// `last`: the unsealed one) damaged, then opened and checked as the module doc says.
fn case(template: &Path, which_last: bool, kind: Kind, damage_of: impl FnOnce(u64) -> Damage) {
    let dir = tmpdir();
    let path = dir.path().join("shard");
    std::fs::create_dir_all(&path).unwrap();
    for e in std::fs::read_dir(template).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), path.join(e.file_name())).unwrap();
    }
    let segs = seg_files(&path);
    assert!(segs.len() >= 2, "the fill makes a sealed segment and a last one: {segs:?}");
    let seg = if which_last { segs.last().unwrap().clone() } else { segs[0].clone() };
    let spans = record_spans(&seg);
    let target = seg.with_extension(match kind {
        Kind::Seg => "seg",
        Kind::Idx => "idx",
        Kind::Del => "del",
    });
    let end = used_end(kind, &target, spans.len() as u64);
    let damage = damage_of(end);
    apply(&target, damage, end);
    // Records that must come back intact: all live ones, but in the damaged segment file
    // only those that end before the damage.
    let cut_at = match damage {
        Damage::Cut(at) | Damage::Zero(at) => at,
    };
    let must: Vec<u64> = (0..RECORDS)
        .filter(|o| o % DELETED_EVERY != 0)
        .filter(|o| kind != Kind::Seg || !spans.iter().any(|&(ro, _, e)| ro == *o && e > cut_at))
        .collect();
    let what = format!("{kind:?} of the {} segment, {damage:?} (used end {end})", if which_last { "last" } else { "first" });
    run(move || async move {
        let (s, rep) = match Shard::open(&path, small_cfg()).await {
            Ok(v) => v,
            Err(e) => panic!("{what}: open failed: {e}"),
        };
        let (mut readable, mut corrupt) = (Vec::new(), false);
        for o in 0..s.next_offset() {
            match s.read(o).await {
                Ok(Some(r)) => {
                    check(&r, o, size(o));
                    readable.push(o);
                }
                Ok(None) => {}
                Err(StoreError::Corrupt { .. }) if kind == Kind::Seg => corrupt = true,
                Err(e) => panic!("{what}: read of {o}: {e}"),
            }
        }
        let missing: Vec<u64> = must.iter().copied().filter(|o| !readable.contains(o)).collect();
        assert!(missing.is_empty(), "{what}: records lost: {missing:?}; report {rep:?}");
        // Whatever live record is gone was said to be: in the report, or by its read.
        let gone = (0..RECORDS).filter(|o| o % DELETED_EVERY != 0).any(|o| !readable.contains(&o));
        assert!(!gone || corrupt || !rep.dropped.is_empty() || !rep.warnings.is_empty(), "{what}: records gone silently: {rep:?}");
        if kind == Kind::Idx && !which_last {
            // A rebuilt index loses nothing and brings back nothing deleted.
            assert_eq!(readable, must, "{what}: {rep:?}");
        }
        // The repair holds: an append, then a clean reopen with the same records.
        let o = s.next_offset();
        s.append((o % 256) as u8, &header(o), &body(o, 300)).unwrap();
        s.sync().await.unwrap();
        s.close().await.unwrap();
        let (s, rep) = Shard::open(&path, small_cfg()).await.unwrap();
        assert!(rep.dropped.is_empty(), "{what}: the repaired shard reopens with drops: {rep:?}");
        check(&s.read(o).await.unwrap().unwrap(), o, 300);
        for &k in &readable {
            if kind == Kind::Seg {
                // A record reported Corrupt on its first read is gone, the others stay.
                if let Ok(Some(r)) = s.read(k).await {
                    check(&r, k, size(k));
                }
            } else {
                check(&s.read(k).await.unwrap().unwrap_or_else(|| panic!("{what}: {k} gone after the reopen")), k, size(k));
            }
        }
        s.close().await.unwrap();
    });
}

fn every_kind(cut: bool) {
    let mut rng = Rng(seed());
    let template = tmpdir();
    fill(template.path().to_path_buf());
    for kind in [Kind::Seg, Kind::Idx, Kind::Del] {
        for which_last in [false, true] {
            for _ in 0..CASES {
                let pick = rng.range(0, u64::MAX);
                case(template.path(), which_last, kind, |end| {
                    let at = pick % end.max(1);
                    if cut {
                        Damage::Cut(at)
                    } else {
                        // The last 1..=8192 bytes of what the file holds.
                        Damage::Zero(end - (1 + pick % 8192).min(end))
                    }
                });
            }
        }
    }
}

#[test]
fn a_file_cut_at_a_random_offset_is_recovered_without_panic() {
    every_kind(true);
}

#[test]
fn a_zeroed_tail_is_recovered_without_panic() {
    every_kind(false);
}
