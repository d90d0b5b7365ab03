//! Torn and zeroed tails of the metadata files (issue 14 item 6): `meta.log` cut at every
//! offset or with its last bytes zeroed, and `meta.snap` cut or zeroed. Opening never panics
//! and never hangs: the log is recovered (every entry written wholly before the damage kept,
//! the group serving: it takes a new proposal and reopens clean), and a damaged snapshot,
//! which no log can stand in for, is refused with [`MetaError::CorruptSnapshot`] naming the
//! file.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::handle::MetaHandle;
use super::snapshot::SNAP_FILE;
use super::state::tests::queue;
use super::state::{Command, Outcome};
use super::storage::{DiskStorage, LOG_FILE};
use super::{Counters, MetaConfig, MetaError};

/// Queues declared one proposal each; `ends[k]` is the log's length once `q{k}` committed.
const QUEUES: usize = 12;

/// xorshift64*: the seed is printed, `META_TORN_SEED` replays it.
struct Rng(u64);

impl Rng {
    fn seeded() -> Rng {
        let s = std::env::var("META_TORN_SEED").ok().and_then(|s| s.parse().ok());
        let s = s.unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1);
        eprintln!("meta torn-tail seed: {s} (META_TORN_SEED={s} replays it)");
        Rng(s.max(1))
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }
}

fn log_len(dir: &Path) -> u64 {
    std::fs::metadata(dir.join(LOG_FILE)).unwrap().len()
}

/// A metadata dir with the vhost and `QUEUES` durable queues, one proposal each; returns the
/// log length after each queue's proposal.
fn filled(dir: &Path) -> Vec<u64> {
    let h = MetaHandle::start(dir, 1).unwrap();
    h.propose_blocking(vec![Command::DeclareVhost { name: "/".into() }]).unwrap();
    let mut ends = Vec::new();
    for k in 0..QUEUES {
        assert_eq!(h.propose_blocking(vec![Command::DeclareQueue(queue(&format!("q{k}"), true, None))]).unwrap(), [Outcome::Created]);
        ends.push(log_len(dir));
    }
    h.shutdown();
    ends
}

/// [`MetaHandle::start`] on a thread, bounded: a hang fails the test.
fn start_bounded(dir: &Path) -> Result<MetaHandle, MetaError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(MetaHandle::start(&d, 1));
    });
    rx.recv_timeout(Duration::from_secs(20)).unwrap_or_else(|_| panic!("MetaHandle::start on {} did not return in 20 s", dir.display()))
}

/// Starts on the damaged copy in `dir`: every queue whose proposal ended before `intact`
/// bytes is there, a new proposal commits, and a second start finds the log clean.
fn check_recovers(dir: &Path, ends: &[u64], intact: u64, what: &str) {
    let h = start_bounded(dir).unwrap_or_else(|e| panic!("{what}: refused to start: {e}"));
    let topo = h.topology();
    for (k, _) in ends.iter().enumerate().filter(|(_, &end)| end <= intact) {
        assert!(topo.queue("/", &format!("q{k}")).is_some(), "{what}: q{k} lost (it ended at byte {})", ends[k]);
    }
    let vhost = h.propose_blocking(vec![Command::DeclareVhost { name: "/".into() }]);
    assert!(vhost.is_ok(), "{what}: the group does not serve: {vhost:?}");
    let out = h.propose_blocking(vec![Command::DeclareQueue(queue("after", true, None))]).unwrap();
    assert_eq!(out, [Outcome::Created], "{what}");
    h.shutdown();
    let h = start_bounded(dir).unwrap_or_else(|e| panic!("{what}: refused the second start: {e}"));
    assert!(h.topology().queue("/", "after").is_some(), "{what}: the proposal after the repair is lost");
    h.shutdown();
}

fn copy_of(template: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(template).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

#[test]
fn the_log_cut_at_any_offset_opens_without_panic() {
    let template = tempfile::tempdir().unwrap();
    let ends = filled(template.path());
    let bytes = std::fs::read(template.path().join(LOG_FILE)).unwrap();
    // Every cut through the storage layer (fast): open or a clear error, never a panic.
    for cut in 0..=bytes.len() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOG_FILE), &bytes[..cut]).unwrap();
        match DiskStorage::open(dir.path(), Arc::new(Counters::default())) {
            Ok(_) => {}
            Err(e) => panic!("cut at byte {cut} of {} refused: {e}", bytes.len()),
        }
    }
    // Seeded cuts through the whole group: recovered and serving.
    let mut rng = Rng::seeded();
    for _ in 0..12 {
        let cut = 8 + rng.below(bytes.len() as u64 - 8);
        let dir = copy_of(template.path());
        std::fs::OpenOptions::new().write(true).open(dir.path().join(LOG_FILE)).unwrap().set_len(cut).unwrap();
        check_recovers(dir.path(), &ends, cut, &format!("log cut at byte {cut} of {}", bytes.len()));
    }
}

#[test]
fn a_zeroed_log_tail_opens_without_panic() {
    let template = tempfile::tempdir().unwrap();
    let ends = filled(template.path());
    let bytes = std::fs::read(template.path().join(LOG_FILE)).unwrap();
    let zeroed = |n: usize| {
        let dir = copy_of(template.path());
        let mut damaged = bytes.clone();
        damaged[bytes.len() - n..].fill(0);
        std::fs::write(dir.path().join(LOG_FILE), &damaged).unwrap();
        (dir, format!("log with its last {n} of {} bytes zeroed", bytes.len()))
    };
    // Every length (the magic kept) through the storage layer, seeded ones through the group.
    for n in 1..bytes.len() - 8 {
        let (dir, what) = zeroed(n);
        if let Err(e) = DiskStorage::open(dir.path(), Arc::new(Counters::default())) {
            panic!("{what}: refused: {e}");
        }
    }
    let mut rng = Rng::seeded();
    for _ in 0..12 {
        let n = 1 + rng.below(bytes.len() as u64 - 9) as usize;
        let (dir, what) = zeroed(n);
        check_recovers(dir.path(), &ends, (bytes.len() - n) as u64, &what);
    }
}

/// A metadata dir whose log was compacted into `meta.snap` (and a short log after it).
fn compacted(dir: &Path) {
    let config = MetaConfig { compact_entries: 10, ..MetaConfig::default() };
    let h = MetaHandle::start_with(dir, 1, config).unwrap();
    h.propose_blocking(vec![Command::DeclareVhost { name: "/".into() }]).unwrap();
    for k in 0..30 {
        h.propose_blocking(vec![Command::DeclareQueue(queue(&format!("q{k}"), true, None))]).unwrap();
    }
    assert!(h.stats().snapshots >= 1, "{:?}", h.stats());
    h.shutdown();
    assert!(dir.join(SNAP_FILE).exists());
}

#[test]
fn a_torn_or_zeroed_snapshot_is_refused_by_name_never_a_panic() {
    let template = tempfile::tempdir().unwrap();
    compacted(template.path());
    let snap = std::fs::read(template.path().join(SNAP_FILE)).unwrap();
    let mut rng = Rng::seeded();
    for case in 0..16 {
        let dir = copy_of(template.path());
        let damaged = if case % 2 == 0 {
            snap[..rng.below(snap.len() as u64) as usize].to_vec()
        } else {
            let mut z = snap.clone();
            let n = 1 + rng.below(snap.len() as u64) as usize;
            let from = snap.len() - n;
            z[from..].fill(0);
            z
        };
        std::fs::write(dir.path().join(SNAP_FILE), &damaged).unwrap();
        match start_bounded(dir.path()) {
            Err(e @ MetaError::CorruptSnapshot { .. }) => assert!(e.to_string().contains(SNAP_FILE), "{e}"),
            Err(e) => panic!("case {case}: expected CorruptSnapshot, got {e}"),
            Ok(h) => {
                h.shutdown();
                panic!("case {case}: a damaged snapshot ({} of {} bytes) was accepted", damaged.len(), snap.len());
            }
        }
    }
}
