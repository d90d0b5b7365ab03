//! Disks for the tests that need a filesystem of their own: a small ext4 image, loop-mounted
//! ([`LoopMount`], to fill it), or one whose writes can be made to fail with EIO
//! ([`FaultyDisk`]). They need root, e2fsprogs (`mkfs.ext4`, `chattr`) and a loop device;
//! without them a test prints "SKIPPED: ..." and passes, except in CI (env `CI` set) as root
//! with the tools present, where a failure to set the disk up fails the test.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// True (with a printed SKIPPED note) against an external broker: these disks hold the data
/// of a ringmq the test starts itself.
fn skip_external(test: &str) -> bool {
    if std::env::var_os("RINGMQ_TEST_BROKER").is_some() {
        eprintln!("SKIPPED: {test}: needs a ringmq the test starts itself (RINGMQ_TEST_BROKER is set)");
        return true;
    }
    false
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `name` on PATH or in /sbin, /usr/sbin (not always on a user's PATH).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")]).map(|d| d.join(name)).find(|p| p.is_file())
}

/// Run a command, bounded by `limit`; Err with its output when it fails.
pub fn run_cmd(program: impl AsRef<OsStr>, args: &[&OsStr], limit: Duration) -> Result<(), String> {
    let program = program.as_ref();
    let what = format!("{} {}", program.to_string_lossy(), args.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" "));
    let log = tempfile::tempfile().map_err(|e| format!("{what}: temp file: {e}"))?;
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log.try_clone().unwrap())
        .spawn()
        .map_err(|e| format!("{what}: {e}"))?;
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| format!("{what}: {e}"))? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{what}: killed after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if status.success() {
        return Ok(());
    }
    let mut text = String::new();
    let mut log = log;
    use std::io::{Read, Seek};
    let _ = log.seek(std::io::SeekFrom::Start(0));
    let _ = log.read_to_string(&mut text);
    Err(format!("{what}: {status}: {}", text.trim()))
}

/// A sparse image file with an ext4 filesystem, loop-mounted on a temp dir; unmounted on drop
/// (the broker using it must be stopped first: declare the broker after the mount, so that it
/// is dropped before it), then the image and its directory are removed.
pub struct LoopMount {
    _dir: tempfile::TempDir,
    mnt: PathBuf,
    mounted: bool,
}

impl LoopMount {
    pub fn new(mkfs: &Path, size_mib: u64) -> Result<LoopMount, String> {
        let dir = tempfile::Builder::new().prefix("ringmq-disk-").tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let image = dir.path().join("fs.img");
        File::create(&image).and_then(|f| f.set_len(size_mib * MIB)).map_err(|e| format!("create {}: {e}", image.display()))?;
        // -m 0: no blocks reserved for root (the broker runs as root here): "free" and
        // "available" are then the same figure, and "full" means full for the broker too.
        run_cmd(mkfs, &["-q".as_ref(), "-F".as_ref(), "-m".as_ref(), "0".as_ref(), image.as_os_str()], Duration::from_secs(30))?;
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).map_err(|e| format!("create {}: {e}", mnt.display()))?;
        run_cmd("mount", &["-o".as_ref(), "loop".as_ref(), image.as_os_str(), mnt.as_os_str()], Duration::from_secs(30))?;
        Ok(LoopMount { _dir: dir, mnt, mounted: true })
    }

    pub fn path(&self) -> &Path {
        &self.mnt
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        if !self.mounted {
            return;
        }
        unmount(&self.mnt);
    }
}

/// Unmounts `mnt`: 10 tries 300 ms apart (a process that just died may still hold it),
/// then a lazy unmount.
pub fn unmount(mnt: &Path) {
    for _ in 0..10 {
        match run_cmd("umount", &[mnt.as_os_str()], Duration::from_secs(20)) {
            Ok(()) => return,
            Err(e) => {
                eprintln!("umount {}: {e}; retrying", mnt.display());
                std::thread::sleep(Duration::from_millis(300));
            }
        }
    }
    if let Err(e) = run_cmd("umount", &["-l".as_ref(), mnt.as_os_str()], Duration::from_secs(20)) {
        eprintln!("umount -l {}: {e}", mnt.display());
    }
}

/// mkfs.ext4's path where this test may make an ext4 image (`why` says what for), or None
/// with a printed SKIPPED note: tests with external tools skipped, not root, or no mkfs.ext4.
fn ext4_tools(test: &str, why: &str) -> Option<PathBuf> {
    if skip_external(test) {
        return None;
    }
    if !is_root() {
        eprintln!("SKIPPED: {test}: needs root {why}");
        return None;
    }
    let mkfs = find_program("mkfs.ext4");
    if mkfs.is_none() {
        eprintln!("SKIPPED: {test}: mkfs.ext4 not found (package e2fsprogs)");
    }
    mkfs
}

/// A loop-mounted ext4 filesystem of `size_mib` MiB, or None (with a printed SKIPPED note) where this
/// machine cannot make one. In CI, as root with mkfs.ext4 present, a failure fails the test.
pub fn loop_disk(test: &str, size_mib: u64) -> Option<LoopMount> {
    let mkfs = ext4_tools(test, "to loop-mount an ext4 image")?;
    match LoopMount::new(&mkfs, size_mib) {
        Ok(m) => Some(m),
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("{test}: CI runs as root with mkfs.ext4, yet the ext4 loop mount failed: {e}")
        }
        Err(e) => {
            eprintln!("SKIPPED: {test}: cannot loop-mount an ext4 image: {e}");
            None
        }
    }
}

/// An ext4 image without a journal, loop-mounted with `errors=continue`, whose writes can
/// be made to fail with EIO and to work again. The image lives in the test's temp dir on the
/// host filesystem; `chattr +i` on it makes every write the loop driver passes on fail (ext4
/// and tmpfs refuse writes to an immutable file even through a descriptor opened before, with
/// EPERM, which the loop device reports to the filesystem on it as an I/O error: EIO for the
/// broker's writes and fdatasyncs); `chattr -i` ends the fault. No journal: with one, the first
/// failed journal write aborts it and ext4 stays read-only until unmounted ("emergency_ro").
/// Unmounted on drop (after `chattr -i`; the broker using it must be stopped first: declare
/// the broker after the disk), then the image and its directory are removed.
pub struct FaultyDisk {
    _dir: tempfile::TempDir,
    image: PathBuf,
    mnt: PathBuf,
    chattr: PathBuf,
    mounted: bool,
    failing: bool,
    probes: u32,
    /// Directories under the mount given a tmpfs of their own ([`FaultyDisk::keep_apart`]).
    apart: Vec<PathBuf>,
}

impl FaultyDisk {
    /// Make, mount and try the fault once (on and off), so that a machine where it does not
    /// work is found before the test starts.
    pub fn new(mkfs: &Path, chattr: &Path, size_mib: u64) -> Result<FaultyDisk, String> {
        let dir = tempfile::Builder::new().prefix("ringmq-eio-").tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let image = dir.path().join("fs.img");
        File::create(&image).and_then(|f| f.set_len(size_mib * MIB)).map_err(|e| format!("create {}: {e}", image.display()))?;
        let o = |s: &'static str| -> &OsStr { s.as_ref() };
        run_cmd(mkfs, &[o("-q"), o("-F"), o("-m"), o("0"), o("-O"), o("^has_journal"), image.as_os_str()], Duration::from_secs(30))?;
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).map_err(|e| format!("create {}: {e}", mnt.display()))?;
        run_cmd("mount", &[o("-o"), o("loop,errors=continue"), image.as_os_str(), mnt.as_os_str()], Duration::from_secs(30))?;
        let mut d =
            FaultyDisk { _dir: dir, image, mnt, chattr: chattr.to_path_buf(), mounted: true, failing: false, probes: 0, apart: Vec::new() };
        d.fail_writes()?;
        d.heal()?;
        Ok(d)
    }

    pub fn path(&self) -> &Path {
        &self.mnt
    }

    /// Gives `dir` (under the mount; created) a small tmpfs of its own, unmounted on drop before
    /// the disk: what is kept there never fails. For a test of a queue store's failure, the
    /// data directory's `meta/`: a failed metadata log ends the broker (`tests/bad_disks.rs`).
    pub fn keep_apart(&mut self, dir: &Path) -> Result<(), String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let o = |s: &'static str| -> &OsStr { s.as_ref() };
        run_cmd("mount", &[o("-t"), o("tmpfs"), o("-o"), o("size=64m"), o("tmpfs"), dir.as_os_str()], Duration::from_secs(30))?;
        self.apart.push(dir.to_path_buf());
        Ok(())
    }

    /// Write 64 KiB to a new file on the mounted filesystem and fdatasync it; the file is
    /// removed again.
    fn probe(&mut self) -> std::io::Result<()> {
        self.probes += 1;
        let p = self.mnt.join(format!("probe-{}", self.probes));
        let r = File::create(&p).and_then(|mut f| {
            f.write_all(&[7u8; 64 << 10])?;
            f.sync_data()
        });
        let _ = std::fs::remove_file(&p);
        r
    }

    /// Start the fault: from now on every write to the device fails (checked: a probe's
    /// fdatasync gets EIO).
    pub fn fail_writes(&mut self) -> Result<(), String> {
        run_cmd(&self.chattr, &["+i".as_ref(), self.image.as_os_str()], Duration::from_secs(10))?;
        self.failing = true;
        match self.probe() {
            Err(e) if e.raw_os_error() == Some(libc::EIO) => {
                println!(
                    "store fault on: {} is immutable, a probe's fdatasync on {} failed: {e}",
                    self.image.display(),
                    self.mnt.display()
                );
                Ok(())
            }
            Err(e) => Err(format!("with {} immutable a probe write on its loop mount failed with {e}, not EIO", self.image.display())),
            Ok(()) => Err(format!("with {} immutable a probe write and fdatasync on its loop mount still succeeded", self.image.display())),
        }
    }

    /// End the fault: writes work again (checked: a probe is written and synced; a few tries
    /// over up to 5 s, as buffers that failed during the fault are written again first).
    pub fn heal(&mut self) -> Result<(), String> {
        run_cmd(&self.chattr, &["-i".as_ref(), self.image.as_os_str()], Duration::from_secs(10))?;
        self.failing = false;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.probe() {
                Ok(()) => {
                    println!("store fault off: {} writable again, a probe was written and synced", self.image.display());
                    return Ok(());
                }
                Err(e) if Instant::now() > deadline => {
                    return Err(format!(
                        "{} writable again, yet a probe on its loop mount still fails after 5 s: {e}",
                        self.image.display()
                    ))
                }
                Err(e) => {
                    println!("probe after the fault ended: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(250));
                }
            }
        }
    }
}

impl Drop for FaultyDisk {
    fn drop(&mut self) {
        if self.failing {
            if let Err(e) = run_cmd(&self.chattr, &["-i".as_ref(), self.image.as_os_str()], Duration::from_secs(10)) {
                eprintln!("chattr -i {}: {e} (the image cannot be removed while immutable)", self.image.display());
            }
        }
        for dir in self.apart.drain(..).rev() {
            unmount(&dir);
        }
        if !self.mounted {
            return;
        }
        unmount(&self.mnt);
    }
}

/// A [`FaultyDisk`], or None (with a printed SKIPPED note) where this machine cannot make one.
/// In CI, as root with mkfs.ext4 and chattr present (both e2fsprogs), a failure to mount it or
/// to make its writes fail fails the test.
pub fn faulty_disk(test: &str, size_mib: u64) -> Option<FaultyDisk> {
    let mkfs = ext4_tools(test, "to loop-mount an ext4 image and make it immutable")?;
    let Some(chattr) = find_program("chattr") else {
        eprintln!("SKIPPED: {test}: chattr not found (package e2fsprogs)");
        return None;
    };
    match FaultyDisk::new(&mkfs, &chattr, size_mib) {
        Ok(d) => Some(d),
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("{test}: CI runs as root with mkfs.ext4 and chattr, yet the failing loop disk could not be set up: {e}")
        }
        Err(e) => {
            eprintln!("SKIPPED: {test}: cannot make a loop-mounted ext4 whose writes fail with EIO: {e}");
            None
        }
    }
}
