//! Processes for the power-loss rounds: a `ringmq-lazyfs` mount and a `ringmq` broker on it, each
//! owned by a guard that kills it by PID (and unmounts) on every exit path, panics included.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a mount may take to answer its control socket.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a broker on the mount may take to be ready (recovery through FUSE is slower).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The `ringmq-lazyfs` binary cargo built for this test.
pub fn lazyfs_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ringmq-lazyfs"))
}

/// The `ringmq` binary: `RINGMQ_BIN`, else the one beside `ringmq-lazyfs` in the same target
/// dir (`cargo test --workspace` builds every package's binaries before any test runs).
pub fn broker_binary() -> PathBuf {
    if let Ok(p) = std::env::var("RINGMQ_BIN") {
        return PathBuf::from(p);
    }
    let p = lazyfs_binary().with_file_name("ringmq");
    assert!(
        p.exists(),
        "no ringmq binary at {}: build it first (`cargo build -j 2 -p ringmq`, or run `cargo test --workspace`), or set RINGMQ_BIN",
        p.display()
    );
    p
}

/// Why this machine cannot mount FUSE here (not root, no /dev/fuse), if it cannot.
pub fn cannot_mount() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("the power-loss rounds mount FUSE with mount(2): they need root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("the power-loss rounds need /dev/fuse".into());
    }
    None
}

/// A free loopback port (bind 0, read it, release it).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0").local_addr().unwrap().port()
}

/// A `ringmq-lazyfs` mount of `backing` at `mount`.
pub struct Lazy {
    child: Option<Child>,
    mount: PathBuf,
    control: PathBuf,
    log: PathBuf,
}

impl Lazy {
    /// Mounts `backing` at `mount` (both exist) with a control socket at `control`; waits until
    /// the socket answers `status`. `log` collects the layer's stderr (appended).
    pub fn mount(backing: &Path, mount: &Path, control: &Path, log: &Path) -> Lazy {
        let err = std::fs::File::options().create(true).append(true).open(log).expect("lazyfs log");
        let child = Command::new(lazyfs_binary())
            .arg("--backing")
            .arg(backing)
            .arg("--mount")
            .arg(mount)
            .arg("--control")
            .arg(control)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .expect("spawn ringmq-lazyfs");
        let mut lazy = Lazy { child: Some(child), mount: mount.to_owned(), control: control.to_owned(), log: log.to_owned() };
        let deadline = Instant::now() + MOUNT_TIMEOUT;
        loop {
            if let Ok(answer) = lazy.command("status") {
                if answer.contains("pending") {
                    return lazy;
                }
            }
            if let Some(st) = lazy.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                lazy.child = None;
                panic!("ringmq-lazyfs exited at start ({st}); its log:\n{}", lazy.log());
            }
            assert!(Instant::now() < deadline, "ringmq-lazyfs did not answer in {MOUNT_TIMEOUT:?}; its log:\n{}", lazy.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends a control command; returns the answer (up to its `ok`).
    pub fn command(&self, cmd: &str) -> std::io::Result<String> {
        let mut s = UnixStream::connect(&self.control)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        writeln!(s, "{cmd}")?;
        let mut out = String::new();
        for line in BufReader::new(s).lines() {
            let line = line?;
            let done = line == "ok" || line.starts_with("error");
            out.push_str(&line);
            out.push('\n');
            if done {
                break;
            }
        }
        Ok(out)
    }

    /// The power loss: drops what is not durable and waits (bounded) for the layer to unmount
    /// and exit. Returns its report.
    pub fn crash(&mut self) -> String {
        let report = self.command("crash").unwrap_or_else(|e| panic!("lazyfs crash command: {e}; log:\n{}", self.log()));
        self.reap();
        report
    }

    /// Waits (bounded) for the layer to exit, killing it after 10 s; makes sure it is unmounted.
    /// Does nothing the second time (the mount point may hold a new mount by then).
    fn reap(&mut self) {
        if let Some(mut c) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
            unmount(&self.mount);
        }
    }

    /// The layer's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Lazy {
    fn drop(&mut self) {
        self.reap();
    }
}

/// `umount -l` of `mount` if it is mounted (errors ignored: it may be gone already).
pub fn unmount(mount: &Path) {
    let Ok(c) = std::ffi::CString::new(mount.as_os_str().as_bytes()) else { return };
    // SAFETY: a valid C string; MNT_DETACH needs nothing else.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
}

/// A ringmq broker process on `data_dir`.
pub struct Node {
    child: Option<Child>,
    /// AMQP address.
    pub addr: SocketAddr,
    args: Vec<String>,
    log: PathBuf,
}

impl Node {
    /// Starts ringmq with `--data-dir data_dir` on free loopback ports and waits until ready.
    pub fn start(data_dir: &Path, log: &Path) -> Node {
        let port = free_port();
        let mut args = vec!["--listen".to_owned(), format!("127.0.0.1:{port}")];
        args.extend(Node::side_args(data_dir));
        args.extend(["--cores".to_owned(), "2".to_owned()]);
        let mut n = Node::new(SocketAddr::from(([127, 0, 0, 1], port)), args, log);
        n.spawn();
        n
    }

    /// `--data-dir data_dir` and free loopback ports for the metrics and management listeners.
    pub fn side_args(data_dir: &Path) -> Vec<String> {
        vec![
            "--data-dir".to_owned(),
            data_dir.display().to_string(),
            "--metrics-listen".to_owned(),
            format!("127.0.0.1:{}", free_port()),
            "--management-listen".to_owned(),
            format!("127.0.0.1:{}", free_port()),
        ]
    }

    /// A broker run with `args` (which make it listen for AMQP on `addr`), output appended to
    /// `log`; not started ([`Node::launch`], [`Node::spawn`]).
    pub fn new(addr: SocketAddr, args: Vec<String>, log: &Path) -> Node {
        Node { child: None, addr, args, log: log.to_owned() }
    }

    /// Starts the process again with the same flags; panics (with the log) when it exits or is
    /// not ready in time.
    pub fn spawn(&mut self) {
        let before = self.launch();
        self.wait_ready(before);
    }

    /// Starts the process without waiting; returns what [`Node::wait_ready`] takes (the
    /// count of ready lines in the log before it).
    pub fn launch(&mut self) -> usize {
        let before = self.log().matches("ringmq ready:").count();
        let err = std::fs::File::options().create(true).append(true).open(&self.log).expect("broker log");
        let child = Command::new(broker_binary())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(err.try_clone().unwrap())
            .stderr(err)
            .spawn()
            .expect("spawn ringmq");
        self.child = Some(child);
        before
    }

    /// Waits until the process [`Node::launch`] started (`before` ready lines earlier) is ready;
    /// panics (with the log) when it exits or is not ready in time.
    pub fn wait_ready(&mut self, before: usize) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if self.log().matches("ringmq ready:").count() > before && accepts(self.addr) {
                return;
            }
            if let Some(st) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                panic!("ringmq exited during start-up ({st}); log tail:\n{}", tail(&self.log(), 80));
            }
            assert!(Instant::now() < deadline, "ringmq not ready in {START_TIMEOUT:?}; log tail:\n{}", tail(&self.log(), 80));
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `amqp://guest:guest@ADDR/%2f`.
    pub fn uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// SIGKILL by PID (not yet reaped: [`Node::reap`]).
    pub fn kill9(&mut self) {
        if let Some(c) = &self.child {
            // SAFETY: signalling our own child by its PID.
            unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
        }
    }

    /// Waits for the killed process.
    pub fn reap(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The broker's output so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.reap();
    }
}

/// True when something listens on `addr` (and it is not the kernel's self-connection).
fn accepts(addr: SocketAddr) -> bool {
    match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
        Ok(s) => s.local_addr().ok() != s.peer_addr().ok(),
        Err(_) => false,
    }
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// xorshift64*: a tiny seeded generator; the same seed gives the same numbers.
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (0 becomes 1).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    /// A number in `lo..hi` (`hi > lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        lo + self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % (hi - lo)
    }
}

/// A u64 from the environment variable `var`, else `default`.
pub fn env_u64(var: &str, default: u64) -> u64 {
    std::env::var(var).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(default)
}
