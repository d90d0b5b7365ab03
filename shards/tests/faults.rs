//! Crash-point tests: a fault-injecting file layer fails or tears a write at
//! each named point (append, sync, fdatasync, delete, segment roll, segment
//! removal); the shard is then dropped as by kill -9 and reopened, and the
//! reopened shard must hold every synced record (minus synced deletes), with
//! correct contents, and stay usable.

mod common;

use std::{collections::BTreeSet, path::Path};

use common::*;
use ringmq_shards::{FaultAction, FaultPoint, Faults, Shard, ShardConfig};

fn size(o: u64) -> usize {
    ((o * 7919) % 20_000) as usize
}

struct Outcome {
    synced: u64,
    appended: u64,
    deleted_synced: BTreeSet<u64>,
    deleted_any: BTreeSet<u64>,
    errors: Vec<String>,
}

/// Appends ~4 MB in 400 records over many 64 KiB segments, deleting records 30
/// behind the head (so old segments die and are removed) and syncing every 10
/// records, except for a 2.7 MB stretch that fills whole write chunks.
async fn workload(s: &Shard, faults: &Faults, keep_going_on_append_error: bool) -> Outcome {
    let mut out = Outcome { synced: 0, appended: 0, deleted_synced: BTreeSet::new(), deleted_any: BTreeSet::new(), errors: Vec::new() };
    let mut pending = Vec::new();
    for step in 0..400u64 {
        let o = s.next_offset();
        match s.append((o % 256) as u8, &header(o), &body(o, size(o))) {
            Ok(got) => {
                assert_eq!(got, o);
                out.appended = o + 1;
            }
            Err(e) => {
                out.errors.push(e.to_string());
                if keep_going_on_append_error && !faults.crashed() {
                    continue;
                }
                break;
            }
        }
        if o >= 30 && (o < 200 || !o.is_multiple_of(5)) {
            s.delete_by_offsets(&[o - 30]).unwrap();
            pending.push(o - 30);
            out.deleted_any.insert(o - 30);
        }
        if step % 10 == 9 && !(60..330).contains(&step) {
            match s.sync().await {
                Ok(sy) => {
                    out.synced = sy.upto();
                    out.deleted_synced.extend(pending.drain(..));
                }
                Err(e) => {
                    out.errors.push(e.to_string());
                    break;
                }
            }
        }
        if step % 16 == 0 {
            s.throttle().await;
        }
        if faults.crashed() {
            break;
        }
    }
    out
}

async fn crash_and_check(path: &Path, point: FaultPoint, after: u32, action: FaultAction) {
    let faults = Faults::new();
    faults.arm(point, after, action);
    // Chunks (1 MiB) only fill up inside segments larger than a chunk.
    let cfg = if point == FaultPoint::Append { ShardConfig { segment_bytes: 2 << 20, ..small_cfg() } } else { small_cfg() };
    let (s, _) = Shard::open_with_faults(path, cfg.clone(), faults.clone()).await.unwrap();
    let keep_going = point == FaultPoint::SegmentRoll && action == FaultAction::Fail;
    let out = workload(&s, &faults, keep_going).await;
    assert_eq!(faults.fired().len(), 1, "{point:?}/{action:?} must fire (hits: {})", faults.hits(point));
    if action == FaultAction::Fail && point != FaultPoint::SegmentRemove && point != FaultPoint::SegmentRoll {
        assert!(!out.errors.is_empty(), "{point:?} Fail must surface as an error");
    }
    if keep_going {
        assert!(out.errors.len() == 1 && out.appended > 300, "a failed roll only fails that append: {:?}", out.errors);
    }
    s.abandon().await;

    let (s, rep) = Shard::open(path, cfg.clone()).await.unwrap();
    let next = s.next_offset();
    assert!(next >= out.synced, "{point:?}/{action:?}: lost synced records: next {next} < synced {}; {rep:?}", out.synced);
    assert!(next <= out.appended, "more records than appended");
    for o in 0..next {
        let live = s.is_live(o);
        if out.deleted_synced.contains(&o) {
            assert!(!live, "{point:?}/{action:?}: synced delete of {o} lost");
        } else if o < out.synced && !out.deleted_any.contains(&o) {
            assert!(live, "{point:?}/{action:?}: synced record {o} lost; {rep:?}");
        }
        if live {
            match s.read(o).await {
                Ok(Some(r)) => check(&r, o, size(o)),
                other => panic!("{point:?}/{action:?}: record {o} unreadable: {other:?}"),
            }
        }
    }
    // Usable afterwards: append, sync, reopen.
    let o = put(&s, 777);
    s.sync().await.unwrap();
    s.close().await.unwrap();
    let (s, rep2) = Shard::open(path, cfg).await.unwrap();
    assert!(rep2.dropped.is_empty(), "second reopen is clean: {rep2:?}");
    check(&s.read(o).await.unwrap().unwrap(), o, 777);
    s.close().await.unwrap();
}

fn cases(point: FaultPoint, list: &[(u32, FaultAction)]) {
    let list = list.to_vec();
    run(move || async move {
        for (i, (after, action)) in list.into_iter().enumerate() {
            let dir = tmpdir();
            let path = dir.path().join(format!("c{i}"));
            crash_and_check(&path, point, after, action).await;
        }
    });
}

#[test]
fn append_write_fault() {
    cases(
        FaultPoint::Append,
        &[
            (0, FaultAction::Fail),
            (0, FaultAction::Tear { keep_bytes: 5000 }),
            (1, FaultAction::Tear { keep_bytes: 700_000 }),
            (1, FaultAction::Crash),
        ],
    );
}

#[test]
fn sync_write_fault() {
    cases(
        FaultPoint::Sync,
        &[
            (3, FaultAction::Fail),
            (5, FaultAction::Tear { keep_bytes: 1000 }),
            (7, FaultAction::Tear { keep_bytes: 0 }),
            (2, FaultAction::Crash),
        ],
    );
}

#[test]
fn fdatasync_fault() {
    cases(FaultPoint::Fdatasync, &[(4, FaultAction::Fail), (4, FaultAction::Crash)]);
}

#[test]
fn delete_flush_fault() {
    cases(FaultPoint::Delete, &[(2, FaultAction::Fail), (3, FaultAction::Crash)]);
}

#[test]
fn segment_roll_fault() {
    cases(FaultPoint::SegmentRoll, &[(3, FaultAction::Fail), (4, FaultAction::Tear { keep_bytes: 512 }), (5, FaultAction::Crash)]);
}

#[test]
fn segment_removal_fault() {
    cases(FaultPoint::SegmentRemove, &[(0, FaultAction::Fail), (1, FaultAction::Crash)]);
}

/// Deletes of records lost in a crash must not stick to the offsets reused
/// after recovery (the bitmap page may reach disk before the data does).
#[test]
fn reused_offsets_are_not_born_deleted() {
    let dir = tmpdir();
    let path = dir.path().to_path_buf();
    run(move || async move {
        let faults = Faults::new();
        let (s, _) = Shard::open_with_faults(&path, small_cfg(), faults.clone()).await.unwrap();
        for _ in 0..10 {
            put(&s, 100);
        }
        s.sync().await.unwrap();
        faults.arm(FaultPoint::Sync, faults.hits(FaultPoint::Sync), FaultAction::Crash);
        for _ in 0..5 {
            put(&s, 100);
        }
        s.delete_by_offsets(&[10, 11, 12, 13, 14]).unwrap();
        assert!(s.sync().await.is_err());
        s.abandon().await;
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        assert_eq!(s.next_offset(), 10);
        assert_eq!(put(&s, 5), 10);
        assert!(s.is_live(10));
        s.sync().await.unwrap();
        s.close().await.unwrap();
        let (s, _) = Shard::open(&path, small_cfg()).await.unwrap();
        check(&s.read(10).await.unwrap().unwrap(), 10, 5);
    });
}
