//! `ringmq-lazyfs`: a FUSE passthrough over a backing directory that models a disk with a
//! volatile write cache, and can lose that cache on command — a power loss (the idea of Jepsen's
//! LazyFS). ringmq's power-loss rounds (`lazyfs/tests/power_loss.rs`) run the broker on it.
//!
//! ```text
//! ringmq-lazyfs --backing DIR --mount DIR [--control SOCKET]
//! ```
//!
//! # Layout
//! - `model.rs`: the disk model ([`model::Disk`]): what is durable, what a crash takes back;
//!   unit-tested without FUSE (`model_tests.rs`).
//! - `fs.rs`: the FUSE requests ([`fs::LazyFs`], on the `fuser` crate's pure-Rust mount: as root
//!   it calls mount(2) itself, no fusermount binary or libfuse needed).
//! - this file: the command line, the control socket and the signals.
//!
//! # What it models
//! - **File data.** A write, truncate or fallocate is not durable until an `fsync` or
//!   `fdatasync` of that file (any handle). `sync_file_range` is not durable (FUSE does not even
//!   pass it on). `O_DIRECT` writes are accepted (the backing file is opened without it) and are
//!   held like any other until an fsync, as a disk's volatile cache would. Shared `mmap` works (no
//!   FUSE direct I/O is asked for): dirty pages reach the layer as writes at msync, fsync or
//!   writeback, and are durable at the next fsync (which msync(MS_SYNC) is, on FUSE).
//! - **Names.** A create, mkdir, unlink, rmdir or rename is not durable until its directory is
//!   fsynced (both directories for a rename across two). A file's own fsync does not make its
//!   name durable: the conservative reading of POSIX (ext4's journal usually does, in practice).
//! - Everything is applied to the backing directory at once; the model keeps in memory what is
//!   needed to take back what is not durable (the old bytes of overwritten ranges, the durable
//!   size, and removed or replaced entries moved into a hidden `.lazyfs-trash`). Reads and
//!   directory listings therefore see every write, as on a real machine before a power loss.
//!
//! # The crash
//! On `crash` (control socket) or SIGUSR1 the layer, under the lock every request takes:
//! writes back the saved bytes and cuts every file to its durable size, undoes the name changes
//! that are not durable (newest first), prints one line per dropped item to stderr
//! ("ringmq-lazyfs: crash: dropped 3 writes (12288 bytes) of q/0.seg: ..."), fails every later
//! request with EIO, unmounts (lazily, MNT_DETACH) and exits 0. The backing directory is then
//! what a power loss would have left; mount it again with a new `ringmq-lazyfs` to go on.
//!
//! # The control socket
//! A Unix stream socket at `--control`: one command line per connection, answered by lines and a
//! final `ok` (or `error: ...`):
//! - `status`: `pending files=N names=M` (files with unsynced writes, name changes not durable);
//! - `crash`: the crash above; the answer lists what was dropped;
//! - `unmount`: unmount without a crash (nothing is lost) and exit.
//!
//! SIGTERM and SIGINT unmount without a crash, as `unmount` does. An unmount from outside
//! (`umount`) ends the process too.
//!
//! # Assumptions
//! - Runs as root (mount(2) without fusermount); `/dev/fuse` exists.
//! - Nothing else changes the backing directory while it is mounted.
//! - One crash point per run: the loss is all-or-nothing per file since its last fsync (a real
//!   disk may keep some unsynced writes and not others; this layer tests the fsyncs, not torn
//!   sectors).
//! - Hard links, symlinks, special files and extended attributes are not supported (ringmq uses
//!   none of them).

mod fs;
mod model;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;

/// The command line.
#[derive(Parser, Debug)]
#[command(name = "ringmq-lazyfs", about = "A FUSE passthrough that loses unsynced writes on a simulated power loss")]
struct Args {
    /// The directory that holds the files (the "disk").
    #[arg(long)]
    backing: PathBuf,
    /// Where to mount the filesystem (an existing empty directory).
    #[arg(long)]
    mount: PathBuf,
    /// A Unix socket path for the control commands (status, crash, unmount).
    #[arg(long)]
    control: Option<PathBuf>,
    /// FUSE worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

/// The last signal received (0: none), set by the handler and read by the main loop.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("ringmq-lazyfs: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> std::io::Result<()> {
    let disk = model::Disk::open(&args.backing)?;
    let fs = fs::LazyFs::new(disk);
    let model = fs.model();
    let mut config = fuser::Config::default();
    config.mount_options = vec![fuser::MountOption::FSName("ringmq-lazyfs".into())];
    config.n_threads = Some(args.threads.max(1));
    let mount = std::fs::canonicalize(&args.mount)?;
    let session = fuser::spawn_mount(fs, &mount, &config)?;
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGUSR1] {
        // SAFETY: the handler only stores into an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    let listener = match &args.control {
        Some(p) => {
            let _ = std::fs::remove_file(p);
            let l = UnixListener::bind(p)?;
            l.set_nonblocking(true)?;
            Some(l)
        }
        None => None,
    };
    eprintln!("ringmq-lazyfs: {} mounted over {}", mount.display(), args.backing.display());
    loop {
        if session.guard.is_finished() {
            eprintln!("ringmq-lazyfs: unmounted from outside");
            return Ok(());
        }
        match SIGNAL.swap(0, Ordering::SeqCst) {
            0 => {}
            libc::SIGUSR1 => {
                for line in crash(&model) {
                    eprintln!("ringmq-lazyfs: crash: {line}");
                }
                leave(&mount, "crashed");
            }
            _ => leave(&mount, "stopped by a signal"),
        }
        if let Some(l) = &listener {
            match l.accept() {
                Ok((conn, _)) => serve(conn, &model, &mount),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => eprintln!("ringmq-lazyfs: control socket: {e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The crash: drops what is not durable; returns the report's lines.
fn crash(model: &Arc<Mutex<model::Disk>>) -> Vec<String> {
    let r = model.lock().unwrap_or_else(|p| p.into_inner()).crash();
    let mut lines = r.lines;
    lines.push(format!(
        "summary: {} files lost {} unsynced writes, {} name changes undone, {} undo failures",
        r.files, r.writes, r.names, r.failures
    ));
    lines
}

/// Answers one control connection.
fn serve(conn: UnixStream, model: &Arc<Mutex<model::Disk>>, mount: &Path) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut line = String::new();
    let Ok(mut w) = conn.try_clone() else { return };
    if BufReader::new(conn).read_line(&mut line).is_err() {
        return;
    }
    match line.trim() {
        "status" => {
            let (files, names) = model.lock().unwrap_or_else(|p| p.into_inner()).pending();
            let _ = writeln!(w, "pending files={files} names={names}\nok");
        }
        "crash" => {
            let lines = crash(model);
            for l in &lines {
                eprintln!("ringmq-lazyfs: crash: {l}");
                let _ = writeln!(w, "{l}");
            }
            let _ = writeln!(w, "ok");
            drop(w);
            leave(mount, "crashed");
        }
        "unmount" => {
            let _ = writeln!(w, "ok");
            drop(w);
            leave(mount, "unmounted");
        }
        other => {
            let _ = writeln!(w, "error: unknown command {other:?} (status, crash, unmount)");
        }
    }
}

/// Unmounts (lazily: a process that still has files open keeps them until it closes them, and
/// gets errors from them once this process is gone) and exits 0.
fn leave(mount: &Path, why: &str) -> ! {
    let path = std::ffi::CString::new(mount.as_os_str().as_bytes()).expect("mount path without NUL");
    // SAFETY: a valid C string; MNT_DETACH needs nothing else.
    let r = unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
    if r != 0 {
        eprintln!("ringmq-lazyfs: umount {}: {}", mount.display(), std::io::Error::last_os_error());
    }
    eprintln!("ringmq-lazyfs: {why}; exiting");
    std::process::exit(0)
}
