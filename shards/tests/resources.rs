//! Resource exhaustion is an error value, never a signal or a lost record. A full disk
//! (ENOSPC, EDQUOT) or the open-files limit (EMFILE) is injected at each open (`Open`),
//! allocation (`Allocate`) and write point (`Append`, `Sync`, `Fdatasync`); each test checks
//! what a user of the store notices: the error kind, that a refused append appends nothing
//! (same next offset, the next append gets it), that the shard stays writable or turns
//! read-only as documented, and that a reopen finds every synced record with its bytes and
//! nothing refused. The last two tests fill a real, loop-mounted ext4 filesystem.

mod common;

use std::{
    collections::BTreeSet,
    ffi::OsStr,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use common::*;
use libc::{EDQUOT, EIO, EMFILE, ENOSPC};
use ringmq_shards::{FaultAction, FaultPoint as P, Faults, RecoveryReport, Shard, ShardConfig, StoreError};

/// What a test appended (body size per offset), what a sync covered, what it deleted.
#[derive(Default)]
struct Log {
    sizes: Vec<usize>,
    synced: u64,
    /// Deletes covered by a sync: gone after a reopen.
    gone: BTreeSet<u64>,
    /// Deletes not (yet) covered by a sync: either way after a reopen.
    pending: BTreeSet<u64>,
}

impl Log {
    /// Appends the record of the next offset with an `n`-byte body. A refused append must
    /// change nothing: same next offset, same segments, no record at that offset.
    fn put(&mut self, s: &Shard, n: usize) -> Result<u64, StoreError> {
        let (o, segs) = (s.next_offset(), s.segment_count());
        assert_eq!(o, self.sizes.len() as u64);
        let r = s.append((o % 256) as u8, &header(o), &body(o, n));
        match &r {
            Ok(got) => {
                assert_eq!(*got, o);
                self.sizes.push(n);
            }
            Err(e) => {
                assert_eq!((s.next_offset(), s.segment_count()), (o, segs), "a refused append changed the shard: {e}");
                assert!(!s.is_live(o) && s.read_cached(o).is_none(), "refused record {o} is there");
            }
        }
        r
    }

    fn puts(&mut self, s: &Shard, count: usize, n: usize) {
        for _ in 0..count {
            self.put(s, n).expect("append");
        }
    }

    async fn commit(&mut self, s: &Shard, count: usize, n: usize) {
        self.puts(s, count, n);
        self.sync(s).await.expect("sync");
    }

    fn delete(&mut self, s: &Shard, offsets: &[u64]) {
        s.delete_by_offsets(offsets).expect("delete");
        let kept: Vec<u64> = offsets.iter().copied().filter(|&o| s.is_live(o)).collect();
        assert!(
            kept.is_empty(),
            "delete_by_offsets returned Ok, yet {} of {} records are still live: {:?}..",
            kept.len(),
            offsets.len(),
            &kept[..kept.len().min(5)]
        );
        self.pending.extend(offsets);
    }

    async fn sync(&mut self, s: &Shard) -> Result<(), StoreError> {
        let synced = s.sync().await?;
        assert_eq!(synced.upto(), self.sizes.len() as u64, "a sync covers every accepted append");
        self.synced = synced.upto();
        self.gone.append(&mut self.pending);
        Ok(())
    }

    /// Every live record reads back with its bytes (from memory or disk).
    async fn check_reads(&self, s: &Shard) {
        for o in (0..s.next_offset()).filter(|&o| s.is_live(o)) {
            let r = s.read(o).await.unwrap_or_else(|e| panic!("reading {o}: {e}"));
            check(&r.unwrap_or_else(|| panic!("live record {o} reads as missing")), o, self.sizes[o as usize]);
        }
    }

    /// Reopens `path`: every synced record not deleted by a sync is there with its bytes, no
    /// synced delete is undone, nothing past the accepted appends. Then takes the reopened
    /// shard as the truth (records lost unsynced are forgotten).
    async fn reopen(&mut self, path: &Path, cfg: &ShardConfig) -> (Shard, RecoveryReport) {
        let (s, rep) = Shard::open(path, cfg.clone()).await.expect("reopen");
        let next = s.next_offset();
        let (synced, accepted) = (self.synced, self.sizes.len() as u64);
        assert!(next >= synced && next <= accepted, "next offset {next}: {synced} synced, {accepted} accepted; {rep:?}");
        for o in 0..next {
            let live = s.is_live(o);
            assert!(!(live && self.gone.contains(&o)), "synced delete of {o} undone");
            assert!(live || o >= synced || self.gone.contains(&o) || self.pending.contains(&o), "synced record {o} lost; {rep:?}");
        }
        self.check_reads(&s).await;
        self.sizes.truncate(next as usize);
        self.synced = next;
        let pending = std::mem::take(&mut self.pending);
        self.gone.extend(pending.into_iter().filter(|&o| o < next && !s.is_live(o)));
        (s, rep)
    }

    /// [`Log::reopen`] where nothing may be missing (every accepted record was synced); closes it.
    async fn reopen_exact(&mut self, path: &Path, cfg: &ShardConfig) -> RecoveryReport {
        let accepted = self.sizes.len() as u64;
        let (s, rep) = self.reopen(path, cfg).await;
        assert!(rep.dropped.is_empty() && s.next_offset() == accepted, "{rep:?}");
        s.close().await.unwrap();
        rep
    }
}

fn fail(errno: i32) -> FaultAction {
    FaultAction::FailWith { errno }
}

/// Appends `n`-byte records with a sync every 16 (a throttle every 4) until one of them
/// fails (at most `max` records): which one, and its error.
async fn until_error(s: &Shard, log: &mut Log, n: usize, max: usize) -> Option<(&'static str, StoreError)> {
    for i in 0..max {
        if let Err(e) = log.put(s, n) {
            return Some(("append", e));
        }
        if i % 16 == 15 {
            if let Err(e) = log.sync(s).await {
                return Some(("sync", e));
            }
        }
        if i % 4 == 3 {
            s.throttle().await;
        }
    }
    None
}

/// Arms `point` to fail with `errno` on its `k`-th hit from now on (0: the next one).
fn arm_next(f: &Faults, point: P, k: u32, errno: i32) {
    f.arm(point, f.hits(point) + k, fail(errno));
}

/// The error a user gets for `errno`: DiskFull for ENOSPC/EDQUOT, out-of-files for EMFILE.
fn assert_resource(e: &StoreError, errno: i32) {
    assert!(e.is_resource(), "not a resource error: {e:?}");
    match errno {
        EMFILE => assert!(e.is_out_of_files() && !e.is_disk_full(), "expected EMFILE: {e:?}"),
        _ => assert!(e.is_disk_full() && !e.is_out_of_files(), "expected DiskFull: {e:?}"),
    }
}

/// A new shard in a temp dir, with a fault plan.
async fn fresh(cfg: &ShardConfig) -> (tempfile::TempDir, PathBuf, Shard, Faults, Log) {
    let dir = tmpdir();
    let path = dir.path().join("s");
    let f = Faults::new();
    let (s, _) = Shard::open_with_faults(&path, cfg.clone(), f.clone()).await.expect("open");
    (dir, path, s, f, Log::default())
}

/// Appends `n`-byte records until one rolls a new segment.
fn roll_once(log: &mut Log, s: &Shard, n: usize) {
    let segs = s.segment_count();
    for _ in 0..1000 {
        log.put(s, n).unwrap();
        if s.segment_count() > segs {
            return;
        }
    }
    panic!("no roll");
}

/// A roll refused at an open (`.idx`, `.del`, `.seg`: Open hits 0, 1, 2 of the roll) or at the
/// fallocate of the new `.seg` (Allocate): that append fails with the resource error and
/// appends nothing, no file of the refused segment is left, the next append gets the same
/// offset and rolls, and a reopen finds exactly the accepted records.
#[test]
fn refused_roll_appends_nothing_and_the_shard_stays_writable() {
    run(|| async {
        let cases = [
            (P::Open, 0, EMFILE),
            (P::Open, 1, EMFILE),
            (P::Open, 2, EMFILE),
            (P::Open, 1, ENOSPC),
            (P::Allocate, 0, ENOSPC),
            (P::Allocate, 0, EDQUOT),
        ];
        for (point, k, errno) in cases {
            let cfg = small_cfg();
            let (_dir, path, s, f, mut log) = fresh(&cfg).await;
            log.commit(&s, 100, 1000).await;
            let segs = s.segment_count();
            arm_next(&f, point, k, errno);
            // No await until the refusal: the roll is the only open or allocation on the way.
            let e = (0..100).find_map(|_| log.put(&s, 1000).err()).expect("the roll must be refused");
            assert_eq!(f.fired(), [(point, fail(errno))]);
            assert_resource(&e, errno);
            let base = format!("{:020}", s.next_offset());
            let left = std::fs::read_dir(&path).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&base));
            assert_eq!(left.count(), 0, "{point:?}/{k}: files of the refused segment are left");
            // The resource is back: the same offset rolls (another size, told from the refused one).
            log.put(&s, 1500).unwrap();
            assert_eq!(s.segment_count(), segs + 1);
            log.commit(&s, 150, 1000).await;
            s.abandon().await;
            log.reopen_exact(&path, &cfg).await;
        }
    });
}

/// Side-file pages are allocated for 1024.. slots at a time before they are touched: a full
/// disk at the `.idx` (Allocate hit 0) or the `.del` step (hit 1) refuses the 1025th record of
/// a segment with DiskFull; the retry takes that offset, and later steps and rolls work.
#[test]
fn refused_side_page_allocation() {
    run(|| async {
        for k in [0, 1] {
            let cfg = small_cfg();
            let (_dir, path, s, f, mut log) = fresh(&cfg).await;
            log.puts(&s, 1024, 8);
            assert_eq!(s.segment_count(), 1, "1024 small records fit in one segment");
            log.sync(&s).await.unwrap();
            arm_next(&f, P::Allocate, k, ENOSPC);
            let e = log.put(&s, 8).unwrap_err();
            assert_eq!(f.fired(), [(P::Allocate, fail(ENOSPC))]);
            assert_resource(&e, ENOSPC);
            assert_eq!(log.put(&s, 9).unwrap(), 1024);
            log.puts(&s, 1500, 8);
            assert_eq!(s.segment_count(), 2);
            log.sync(&s).await.unwrap();
            s.abandon().await;
            log.reopen_exact(&path, &cfg).await;
            assert_eq!(log.sizes.len(), 2525);
        }
    });
}

/// The `.seg` room (3 MiB segments: 2 MiB allocated at the roll). Appends that outrun it
/// allocate in `append` (`make_room`): a full disk there refuses that append with DiskFull,
/// the retry succeeds. A full disk at the background step (the writer, past half of the room)
/// is seen by nobody: appends and syncs go on, a later write or append takes the blocks.
#[test]
fn segment_room_allocation() {
    run(|| async {
        let cfg = ShardConfig { segment_bytes: 3 << 20, ..small_cfg() };
        let (_dir, path, s, f, mut log) = fresh(&cfg).await;
        log.put(&s, 16 << 10).unwrap();
        log.sync(&s).await.unwrap();
        // No await: the writer does not run, so nothing extends the room in the background.
        arm_next(&f, P::Allocate, 0, ENOSPC);
        let e = (0..200).find_map(|_| log.put(&s, 16 << 10).err()).expect("the append past 2 MiB allocates");
        assert_eq!(f.fired(), [(P::Allocate, fail(ENOSPC))]);
        assert_resource(&e, ENOSPC);
        assert!(log.sizes.len() > 120, "refused at the end of the room, not before");
        log.put(&s, 20 << 10).unwrap();
        roll_once(&mut log, &s, 16 << 10);
        log.sync(&s).await.unwrap();
        // A new segment: its writes pass 1 MiB, the background step fails.
        arm_next(&f, P::Allocate, 0, ENOSPC);
        log.commit(&s, 90, 16 << 10).await;
        glommio::timer::sleep(Duration::from_millis(50)).await;
        assert_eq!(f.fired().len(), 2, "the background step ran and failed");
        log.commit(&s, 60, 16 << 10).await;
        assert_eq!(s.segment_count(), 2);
        s.abandon().await;
        log.reopen_exact(&path, &cfg).await;
    });
}

/// The writer opens a new `.seg` for direct I/O at the first write after the roll. One EMFILE
/// there is retried and invisible; one that lasts (50 tries, about a second) turns the shard
/// read-only: appends and syncs fail with Failed, reads and deletes work, a reopen has every
/// synced record and nothing of the never-written segment, and is writable.
#[test]
fn writer_open_out_of_files() {
    run(|| async {
        for lasting in [false, true] {
            let cfg = small_cfg();
            let (_dir, path, s, f, mut log) = fresh(&cfg).await;
            log.commit(&s, 30, 1000).await;
            roll_once(&mut log, &s, 1000);
            let base = s.next_offset() - 1; // of the new segment
            let (h, tries) = (f.hits(P::Open), if lasting { 50 } else { 1 });
            (0..tries).for_each(|i| f.arm(P::Open, h + i, fail(EMFILE)));
            let r = log.sync(&s).await;
            if !lasting {
                r.unwrap();
                assert_eq!(f.hits(P::Open), h + 3, "the failed open, its retry, the seal of the full segment");
                log.commit(&s, 100, 1000).await;
            } else {
                assert!(matches!(r, Err(StoreError::Failed { .. })), "{r:?}");
                assert_eq!(f.fired().len(), 50);
                assert!(matches!(log.put(&s, 1000), Err(StoreError::Failed { .. })));
                assert!(matches!(s.sync().await, Err(StoreError::Failed { .. })));
                log.check_reads(&s).await;
                log.delete(&s, &[0, 1]);
            }
            s.abandon().await;
            let (s, _) = log.reopen(&path, &cfg).await;
            assert!(!lasting || s.next_offset() <= base, "nothing of the never-written segment");
            log.put(&s, 100).unwrap();
            log.sync(&s).await.unwrap();
            s.close().await.unwrap();
        }
    });
}

/// A `.del` that cannot be opened for the sync's fdatasync (EMFILE) leaves its deletes to the
/// next sync, which fdatasyncs it even with nothing new; the sync returns Ok for the appends.
#[test]
fn del_open_out_of_files_defers_the_deletes() {
    run(|| async {
        let cfg = small_cfg();
        let (_dir, path, s, f, mut log) = fresh(&cfg).await;
        log.commit(&s, 200, 1000).await;
        let segs = s.segment_count();
        log.delete(&s, &(10..20).collect::<Vec<_>>()); // segment 0
        log.delete(&s, &[70, 71]); // segment 1
        log.puts(&s, 3, 1000);
        assert_eq!(s.segment_count(), segs, "no roll: the bitmaps are this sync's only opens");
        let h = f.hits(P::Open);
        f.arm(P::Open, h, fail(EMFILE));
        log.sync(&s).await.unwrap(); // covers the appends (checked in Log::sync)
        assert_eq!(f.fired(), [(P::Open, fail(EMFILE))]);
        assert_eq!(f.hits(P::Open), h + 2, "both bitmaps were opened");
        assert!((10..20).all(|o| !s.is_live(o)), "the deletes hold in memory");
        let h = f.hits(P::Open);
        s.sync().await.unwrap();
        assert_eq!(f.hits(P::Open), h + 1, "the next sync fdatasyncs the deferred bitmap");
        let h = f.hits(P::Open);
        s.sync().await.unwrap();
        assert_eq!(f.hits(P::Open), h, "and then nothing is left to do");
        s.close().await.unwrap();
        let (s, _) = log.reopen(&path, &cfg).await;
        assert_eq!(s.len(), 203 - 12);
        s.close().await.unwrap();
    });
}

/// An EMFILE opening the `.idx` to fdatasync a seal skips that fdatasync (no retry, no error);
/// the data and later seals are fine and the reopen is clean.
#[test]
fn seal_open_out_of_files_skips_that_fdatasync() {
    run(|| async {
        let cfg = small_cfg();
        let (_dir, path, s, f, mut log) = fresh(&cfg).await;
        log.commit(&s, 30, 1000).await;
        roll_once(&mut log, &s, 1000);
        // This sync's opens: the writer's open of the new `.seg`, then the full segment's `.idx`.
        let h = f.hits(P::Open);
        f.arm(P::Open, h + 1, fail(EMFILE));
        log.sync(&s).await.unwrap();
        assert_eq!(f.fired(), [(P::Open, fail(EMFILE))]);
        assert_eq!(f.hits(P::Open), h + 2, "the writer's open succeeded, the seal's was not retried");
        log.commit(&s, 150, 1000).await;
        s.close().await.unwrap();
        let rep = log.reopen_exact(&path, &cfg).await;
        assert!(rep.warnings.is_empty(), "{rep:?}");
    });
}

/// `Shard::open` out of descriptors (or disk) at the `format` file (Open hit 0) or a segment
/// (hits 1..=n): an error, no panic, nothing changed; a plain open then finds everything.
#[test]
fn open_out_of_files_is_an_error() {
    run(|| async {
        let cfg = small_cfg();
        let (_dir, path, s, _, mut log) = fresh(&cfg).await;
        log.puts(&s, 200, 1000);
        log.delete(&s, &[5, 6]);
        log.sync(&s).await.unwrap();
        s.close().await.unwrap();
        let n = seg_files(&path).len() as u32;
        assert!(n >= 3);
        for (k, errno) in [(0, EMFILE), (1, EMFILE), (2, EMFILE), (n, EMFILE), (2, ENOSPC)] {
            let f = Faults::new();
            f.arm(P::Open, k, fail(errno));
            let e = Shard::open_with_faults(&path, cfg.clone(), f.clone()).await.expect_err("open must fail");
            assert_eq!(f.fired(), [(P::Open, fail(errno))]);
            assert_resource(&e, errno);
        }
        log.reopen_exact(&path, &cfg).await;
        assert_eq!((log.sizes.len(), log.gone.len()), (200, 2));
    });
}

/// A failed write (a full chunk: Append; a sync's cut: Sync) or fdatasync, with ENOSPC or EIO,
/// turns the shard read-only: the failing append or sync returns an error, then appends and
/// syncs return Failed; reads and deletes work; a reopen recovers every synced record and is
/// writable.
#[test]
fn failed_write_or_fdatasync_turns_read_only() {
    run(|| async {
        let points = [(P::Append, 1), (P::Sync, 3), (P::Fdatasync, 3)];
        for ((point, k), errno) in points.into_iter().flat_map(|p| [(p, ENOSPC), (p, EIO)]) {
            // Full 1 MiB chunks only fill up in segments larger than a chunk.
            let seg = if point == P::Append { 2 << 20 } else { 64 << 10 };
            let cfg = ShardConfig { segment_bytes: seg, ..small_cfg() };
            let (_dir, path, s, f, mut log) = fresh(&cfg).await;
            f.arm(point, k, fail(errno));
            let (what, e) =
                until_error(&s, &mut log, 8000, 400).await.unwrap_or_else(|| panic!("{point:?}/{errno}: the fault must surface"));
            assert_eq!(f.fired(), [(point, fail(errno))]);
            match (point, errno) {
                // The failing sync returns its fdatasync's error; the shard is read-only after it.
                (P::Fdatasync, ENOSPC) => assert!(what == "sync" && e.is_disk_full(), "{e:?}"),
                (P::Fdatasync, _) => {
                    assert!(what == "sync" && matches!(&e, StoreError::Io { source, .. } if source.raw_os_error() == Some(EIO)), "{e:?}")
                }
                _ => assert!(matches!(e, StoreError::Failed { .. }), "{point:?}/{errno}: {what}: {e:?}"),
            }
            assert!(matches!(log.put(&s, 10), Err(StoreError::Failed { .. })), "{point:?}: appends refused");
            assert!(matches!(s.sync().await, Err(StoreError::Failed { .. })), "{point:?}: syncs refused");
            assert!(log.synced > 0);
            log.check_reads(&s).await;
            log.delete(&s, &[0, log.synced - 1]);
            s.abandon().await;
            let (s, _) = log.reopen(&path, &cfg).await;
            log.commit(&s, 20, 8000).await;
            s.close().await.unwrap();
            let (s, rep) = log.reopen(&path, &cfg).await;
            assert!(rep.dropped.is_empty(), "{point:?}/{errno}: second reopen is clean: {rep:?}");
            s.close().await.unwrap();
        }
    });
}

/// Runs `prog args` (killed after 60 s); Err with its stderr if it fails.
fn cmd(prog: &str, args: &[&OsStr]) -> Result<(), String> {
    let out = Command::new("timeout").arg("-s").arg("KILL").arg("60").arg(prog).args(args).stdin(Stdio::null()).output();
    match out.map_err(|e| format!("timeout {prog}: {e}"))? {
        o if o.status.success() => Ok(()),
        o => Err(format!("{prog} {args:?}: {}: {}", o.status, String::from_utf8_lossy(&o.stderr).trim())),
    }
}

/// An 8 MiB ext4 image (`mkfs.ext4` defaults: 1 KiB blocks) loop-mounted on a temp dir;
/// unmounted and removed on drop.
struct LoopDisk {
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl LoopDisk {
    /// None (with a "SKIPPED" line) without root or a working loop mount; a failed mount
    /// panics in CI (env CI) as root with mkfs.ext4 present.
    fn mount(test: &str) -> Option<LoopDisk> {
        // SAFETY: plain syscall.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: {test}: needs root to loop-mount an ext4 image");
            return None;
        }
        let has_mkfs = Command::new("mkfs.ext4").arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
        let dir = tmpdir();
        let (img, mnt) = (dir.path().join("img"), dir.path().join("mnt"));
        let mounted = std::fs::File::create(&img)
            .and_then(|f| f.set_len(8 << 20)) // truncate -s 8M
            .and_then(|_| std::fs::create_dir(&mnt))
            .map_err(|e| e.to_string())
            .and_then(|_| cmd("mkfs.ext4", &["-q".as_ref(), "-F".as_ref(), img.as_os_str()]))
            .and_then(|_| cmd("mount", &["-o".as_ref(), "loop".as_ref(), img.as_os_str(), mnt.as_os_str()]));
        match mounted {
            Ok(()) => Some(LoopDisk { mnt, _dir: dir }),
            Err(e) if std::env::var_os("CI").is_some() && has_mkfs => {
                panic!("{test}: CI, root and mkfs.ext4, yet the loop mount failed: {e}")
            }
            Err(e) => {
                eprintln!("SKIPPED: {test}: cannot loop-mount an ext4 image: {e}");
                None
            }
        }
    }
}

impl Drop for LoopDisk {
    fn drop(&mut self) {
        let m = self.mnt.as_os_str();
        for _ in 0..20 {
            match cmd("umount", &[m]) {
                Ok(()) => return,
                Err(e) => eprintln!("{e}; retrying"),
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let _ = cmd("umount", &["-l".as_ref(), m]).map_err(|e| eprintln!("lazy {e}"));
    }
}

/// A real full disk (the loop mount, 256 KiB segments). 4 KiB records, a sync every 16, until
/// DiskFull, which must come from `append` (writes go to allocated blocks: a failing sync would
/// turn the shard read-only); the process is alive (no SIGBUS), the accepted records sync and
/// read back. A filler file takes the last blocks: an append is still only DiskFull. With
/// `reopen_first`, the shard closes and reopens on the full disk, with every record. Then
/// every record is deleted (the deletes must hold) and synced: the fully deleted segments are
/// removed and their space takes new appends (the filler stays); a reopen has exactly those.
fn real_disk(test: &str, reopen_first: bool) {
    let Some(disk) = LoopDisk::mount(test) else { return };
    let mnt = disk.mnt.clone();
    run(move || async move {
        // This thread's buffer file (the first `format` it opens, held open to the end of the
        // thread) is kept off the loop mount, so that it unmounts.
        let other = tmpdir();
        Shard::open(other.path(), small_cfg()).await.unwrap().0.close().await.unwrap();
        let (path, cfg) = (mnt.join("shard"), ShardConfig { segment_bytes: 256 << 10, ..small_cfg() });
        let (mut s, _) = Shard::open(&path, cfg.clone()).await.unwrap();
        let mut log = Log::default();
        let (what, e) = until_error(&s, &mut log, 4096, 4096).await.expect("16 MiB fill an 8 MiB filesystem");
        assert!(e.is_disk_full() && what == "append", "the full disk showed in {what}: {e:?}");
        log.sync(&s).await.unwrap();
        log.check_reads(&s).await;
        let mut filler = std::fs::File::create(mnt.join("filler")).unwrap();
        for n in [64 << 10, 1024] {
            let block = vec![0x5au8; n];
            let _ = (0..(16 << 20) / n).try_for_each(|_| filler.write_all(&block));
        }
        let _ = filler.sync_all();
        assert!(log.put(&s, 4096).unwrap_err().is_disk_full());
        if reopen_first {
            s.close().await.unwrap();
            let rep;
            (s, rep) = log.reopen(&path, &cfg).await;
            assert!(rep.dropped.is_empty() && s.next_offset() == log.sizes.len() as u64, "{rep:?}");
        }
        let free = ringmq_shards::free_disk_bytes(&mnt).unwrap();
        log.delete(&s, &s.live_offsets());
        log.sync(&s).await.unwrap();
        assert_eq!(s.segment_count(), 1, "every full, fully deleted segment is removed");
        let freed = ringmq_shards::free_disk_bytes(&mnt).unwrap();
        assert!(freed > free + (1 << 20), "free bytes {free} -> {freed}");
        log.commit(&s, 100, 4096).await;
        s.close().await.unwrap();
        let (s, _) = log.reopen(&path, &cfg).await;
        assert_eq!((s.len(), s.next_offset()), (100, log.sizes.len() as u64));
        s.close().await.unwrap();
    });
    drop(disk);
}

#[test]
fn real_full_disk() {
    real_disk("real_full_disk", false);
}

/// Reopened on the full disk before it is drained.
#[test]
fn real_full_disk_reopened_then_drained() {
    real_disk("real_full_disk_reopened_then_drained", true);
}
