//! Shared harness for ringmq's black-box integration tests.
//!
//! [`Broker::start`] runs the real `ringmq` binary on a free loopback port with a fresh temp data
//! dir (`--listen 127.0.0.1:PORT --data-dir DIR --metrics-listen 127.0.0.1:PORT2
//! --management-listen 127.0.0.1:PORT3 --cores 2`), waits (at most 10 s) until the AMQP port
//! accepts, and kills the process by its PID on drop.
//! The broker's stderr goes to a file that is printed when the owning test panics.
//!
//! With `RINGMQ_TEST_BROKER=host:port` set, the harness uses that external broker instead (this is
//! how the suite is validated against RabbitMQ); tests that need to restart or kill the broker
//! then print a note and return early (see [`require_own_broker!`]).
//!
//! Everything here is bounded: every wait has a deadline, and [`t`] wraps a test step in a
//! timeout so that a silent broker fails the test instead of hanging it.
#![allow(dead_code)]

use lapin::{Channel, Connection, ConnectionProperties};
use std::fs::File;
use std::future::Future;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub mod cluster;
pub mod disk;
pub mod flood;
pub mod http;
pub mod pki;
pub mod proxy;
pub mod python;
pub mod raw;
pub mod rounds;
pub mod rss;
pub mod script;

/// How long the broker gets to accept its first connection after being spawned.
pub const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a graceful (SIGTERM) shutdown may take before the test fails.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// Default per-step timeout used by [`t`].
pub const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// The ringmq binary: `RINGMQ_BIN` when set (tests/crash-rounds.sh), else cargo's for these tests.
pub fn broker_binary() -> PathBuf {
    if let Ok(p) = std::env::var("RINGMQ_BIN") {
        return PathBuf::from(p);
    }
    match option_env!("CARGO_BIN_EXE_ringmq") {
        Some(p) => PathBuf::from(p),
        None => panic!("no ringmq binary: set RINGMQ_BIN or RINGMQ_TEST_BROKER"),
    }
}

/// A tool or client a test needs is missing. In CI (env `CI` set: `.ci/run` installs it) the
/// test fails with `why`; elsewhere `why` is printed as a note and the caller skips.
#[track_caller]
pub fn skip_unless_ci(why: &str) {
    assert!(std::env::var_os("CI").is_none(), "{why}");
    eprintln!("NOTE: skipped: {why}");
}

/// A free TCP port on 127.0.0.1 (bind port 0, read it, release it), never one this test
/// process handed out before: the kernel may give a released port to the next bind(0), and
/// two brokers of parallel tests on one port made one test talk to the other's broker.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    for _ in 0..1000 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = l.local_addr().unwrap().port();
        let mut given = GIVEN.lock().unwrap();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
    panic!("no unused loopback port after 1000 tries");
}

/// How many times a broker log says "ringmq ready" (once per start).
fn ready_lines(log: &str) -> usize {
    log.matches("ringmq ready:").count()
}

/// When a started broker is ready: its AMQP port accepts and its log has a new "ringmq ready"
/// line (logged once every core listens). The port alone is not enough: the first core's
/// socket may accept while the second's (SO_REUSEPORT, bound a moment later) does not listen
/// yet, and a connect hashed to it is refused. With the info line filtered out of the log
/// (`RINGMQ_LOG`), the port accepting for 1 s in a row counts.
struct StartWatch {
    before: usize,
    accepting_since: Option<Instant>,
}

impl StartWatch {
    fn new(before: usize) -> StartWatch {
        StartWatch { before, accepting_since: None }
    }

    fn ready(&mut self, addr: SocketAddr, log: &str) -> bool {
        if !accepts(addr) {
            self.accepting_since = None;
            return false;
        }
        let since = *self.accepting_since.get_or_insert_with(Instant::now);
        ready_lines(log) > self.before || since.elapsed() >= Duration::from_secs(1)
    }
}

/// True when something listens on `addr`: a TCP connection is established and is not the
/// kernel's self-connection (connecting to a loopback port in the ephemeral range while
/// nothing listens there can pick that same port as the source and "connect" to itself,
/// which made a start-up wait return before the broker listened).
pub fn accepts(addr: SocketAddr) -> bool {
    match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
        Ok(s) => s.local_addr().ok() != s.peer_addr().ok(),
        Err(_) => false,
    }
}

/// Waits (up to [`START_TIMEOUT`]) until a broker we spawned is ready on `addr`: its port
/// accepts and `log()` (its log so far; empty when not captured) has a "ringmq ready" line, or
/// the port has accepted for 1 s in a row (see `StartWatch`).
///
/// # Errors
/// The broker exited, or was not ready in time (then the caller still owns `child`); the
/// text carries the log.
pub fn wait_started(child: &mut Child, addr: SocketAddr, log: impl Fn() -> String) -> Result<(), String> {
    let deadline = Instant::now() + START_TIMEOUT;
    let mut watch = StartWatch::new(0);
    while !watch.ready(addr, &log()) {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("ringmq exited during start-up ({status}); log:\n{}", log()));
        }
        if Instant::now() > deadline {
            return Err(format!("ringmq was not ready on {addr} within {START_TIMEOUT:?}; log:\n{}", log()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A broker under test: either a ringmq child process we own, or an external broker.
pub struct Broker {
    addr: SocketAddr,
    metrics_port: u16,
    management_port: u16,
    child: Option<Child>,
    data_dir: Option<tempfile::TempDir>,
    log_path: Option<PathBuf>,
    external: bool,
    /// Extra command-line flags passed at every start (e.g. a config file).
    extra_args: Vec<String>,
}

impl Broker {
    /// Start a fresh ringmq (or attach to `RINGMQ_TEST_BROKER`).
    pub fn start() -> Broker {
        Self::start_with_args(&[])
    }

    /// Like [`Broker::start`] with extra flags for ringmq (ignored for an external broker);
    /// `{port}` in a flag becomes the broker's AMQP port.
    pub fn start_with_args(extra: &[&str]) -> Broker {
        if let Ok(ext) = std::env::var("RINGMQ_TEST_BROKER") {
            let addr = ext
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .unwrap_or_else(|| panic!("RINGMQ_TEST_BROKER={ext:?} is not host:port"));
            return Broker {
                addr,
                metrics_port: 0,
                management_port: 0,
                child: None,
                data_dir: None,
                log_path: None,
                external: true,
                extra_args: Vec::new(),
            };
        }
        let data_dir = tempfile::Builder::new().prefix("ringmq-test-").tempdir().expect("temp data dir");
        let port = free_port();
        let mut b = Broker {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            metrics_port: free_port(),
            management_port: free_port(),
            child: None,
            log_path: Some(data_dir.path().with_extension("stderr.log")),
            data_dir: Some(data_dir),
            external: false,
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
        };
        b.spawn();
        b
    }

    /// True when the tests run against an external broker (e.g. RabbitMQ).
    pub fn is_external(&self) -> bool {
        self.external
    }

    pub fn host(&self) -> String {
        self.addr.ip().to_string()
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Metrics port (ringmq only; 0 for an external broker).
    pub fn metrics_port(&self) -> u16 {
        self.metrics_port
    }

    /// Waits (bounded by [`STEP_TIMEOUT`]) until the broker's log contains `text`; panics
    /// with `what` and the log otherwise.
    pub fn wait_for_log(&self, text: &str, what: &str) {
        let deadline = Instant::now() + STEP_TIMEOUT;
        while !self.log().contains(text) {
            assert!(Instant::now() < deadline, "no log line for {what}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The broker process's PID (None for an external broker).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Management API port (ringmq only; 0 for an external broker).
    pub fn management_port(&self) -> u16 {
        self.management_port
    }

    /// The broker's data directory (ringmq only).
    pub fn data_dir(&self) -> Option<&std::path::Path> {
        self.data_dir.as_ref().map(|d| d.path())
    }

    /// `amqp://guest:guest@HOST:PORT/%2f` plus an optional query (`"heartbeat=5"`).
    pub fn uri_with(&self, query: &str) -> String {
        let q = if query.is_empty() { String::new() } else { format!("?{query}") };
        format!("amqp://guest:guest@{}:{}/%2f{}", self.host(), self.port(), q)
    }

    pub fn uri(&self) -> String {
        self.uri_with("")
    }

    fn spawn(&mut self) {
        let dir = self.data_dir.as_ref().unwrap().path().to_path_buf();
        let log = self.log_path.clone().unwrap();
        let stderr = File::options().create(true).append(true).open(&log).expect("broker log file");
        let stdout = stderr.try_clone().unwrap();
        let mut cmd = Command::new(broker_binary());
        cmd.arg("--listen")
            .arg(self.addr.to_string())
            .arg("--data-dir")
            .arg(&dir)
            .arg("--metrics-listen")
            .arg(format!("127.0.0.1:{}", self.metrics_port))
            .args(
                (!self.extra_args.iter().any(|a| a == "--management-listen"))
                    .then(|| ["--management-listen".to_owned(), format!("127.0.0.1:{}", self.management_port)])
                    .into_iter()
                    .flatten(),
            )
            .arg("--cores")
            .arg("2")
            .args(self.extra_args.iter().map(|a| a.replace("{port}", &self.addr.port().to_string())))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        let before = ready_lines(&self.log());
        let child = cmd.spawn().expect("spawn ringmq");
        self.child = Some(child);
        self.wait_accepting(before);
    }

    /// Wait until the broker is ready ([`StartWatch`]; bounded by [`START_TIMEOUT`]); `before`:
    /// the "ringmq ready" lines its log had before this start.
    fn wait_accepting(&mut self, before: usize) {
        let deadline = Instant::now() + START_TIMEOUT;
        let mut watch = StartWatch::new(before);
        loop {
            if watch.ready(self.addr, &self.log()) {
                return;
            }
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    panic!("ringmq exited during start-up ({status}); log:\n{}", self.log());
                }
            }
            if Instant::now() > deadline {
                panic!("ringmq did not accept on {} within {:?}; log:\n{}", self.addr, START_TIMEOUT, self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The broker's captured stdout/stderr so far.
    pub fn log(&self) -> String {
        let mut s = String::new();
        if let Some(p) = &self.log_path {
            if let Ok(mut f) = File::open(p) {
                let _ = f.read_to_string(&mut s);
            }
        }
        s
    }

    /// Graceful restart: SIGTERM, wait (bounded) for exit status 0, start again on the same
    /// port and data dir. Panics for an external broker (guard with [`require_own_broker!`]).
    pub fn restart(&mut self) {
        assert!(!self.external, "restart() needs a ringmq started by the harness");
        let mut child = self.child.take().expect("broker not running");
        sigterm_and_wait(&mut child, || self.log());
        self.spawn_on_same_port();
    }

    /// Crash restart: SIGKILL, reap, start again on the same port and data dir.
    pub fn kill9_restart(&mut self) {
        assert!(!self.external, "kill9_restart() needs a ringmq started by the harness");
        let mut child = self.child.take().expect("broker not running");
        let _ = child.kill();
        let _ = child.wait();
        self.spawn_on_same_port();
    }

    /// The old process has exited; the port may still be briefly unavailable for binding, so a
    /// start that dies at once is retried a few times (bounded).
    fn spawn_on_same_port(&mut self) {
        for attempt in 0..20 {
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.spawn()));
            match res {
                Ok(()) => return,
                Err(e) if attempt == 19 => std::panic::resume_unwind(e),
                Err(_) => std::thread::sleep(Duration::from_millis(250)),
            }
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() && !self.external {
            eprintln!("----- ringmq log ({}) -----\n{}\n----- end of ringmq log -----", self.addr, self.log());
        }
        if let Some(p) = &self.log_path {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// SIGTERM to `child` by its PID, then wait (bounded by [`STOP_TIMEOUT`]) for exit status 0;
/// panics with `log()` otherwise (after SIGKILL when it did not exit in time).
fn sigterm_and_wait(child: &mut Child, log: impl Fn() -> String) {
    let pid = child.id();
    let st = Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
    assert!(st.map(|s| s.success()).unwrap_or(false), "kill -TERM {pid} failed");
    let deadline = Instant::now() + STOP_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait ringmq") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("ringmq did not exit within {STOP_TIMEOUT:?} of SIGTERM; log:\n{}", log());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "ringmq exited with {status} after SIGTERM; log:\n{}", log());
}

/// Return early from a test (with a printed note) when it needs a broker the harness can
/// restart or kill, or that is ringmq itself.
#[macro_export]
macro_rules! require_own_broker {
    ($b:expr, $why:expr) => {
        if $b.is_external() {
            eprintln!("SKIPPED against external broker: {}", $why);
            return;
        }
    };
}

/// Run one async test step with the default [`STEP_TIMEOUT`]; a timeout fails the test.
pub async fn t<F: Future>(what: &str, f: F) -> F::Output {
    tt(what, STEP_TIMEOUT, f).await
}

/// Run one async test step with an explicit timeout; a timeout fails the test.
pub async fn tt<F: Future>(what: &str, limit: Duration, f: F) -> F::Output {
    match tokio::time::timeout(limit, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {limit:?}: {what}"),
    }
}

/// A name no other test (or earlier run against an external broker) uses.
pub fn uniq(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos();
    format!("ringmq-test.{prefix}.{}.{n}.{nanos:x}", std::process::id())
}

/// Connect as guest/guest to vhost `/`.
pub async fn connect(b: &Broker) -> Connection {
    connect_uri(&b.uri()).await
}

pub async fn connect_uri(uri: &str) -> Connection {
    t("connect", Connection::connect(uri, ConnectionProperties::default())).await.unwrap_or_else(|e| panic!("connect {uri}: {e}"))
}

/// Connect and open one channel.
pub async fn connect_ch(b: &Broker) -> (Connection, Channel) {
    let c = connect(b).await;
    let ch = t("channel.open", c.create_channel()).await.expect("channel.open");
    (c, ch)
}

/// The AMQP reply code carried by a lapin error (channel.close / connection.close), if any.
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => Some(p.get_id()),
        _ => None,
    }
}

/// Assert that a lapin result failed with the AMQP reply `code`.
#[track_caller]
pub fn assert_code<T: std::fmt::Debug>(r: Result<T, lapin::Error>, code: u16, what: &str) {
    match r {
        Ok(v) => panic!("{what}: expected reply {code}, got success {v:?}"),
        Err(e) => assert_eq!(reply_code(&e), Some(code), "{what}: expected reply {code}, got error {e}"),
    }
}

/// Watches a channel for a broker-side channel.close, keeping its reply code.
///
/// lapin reports a channel.close to later calls only as "invalid channel state", without the
/// code; the code reaches the channel's consumers, so the watch holds a consumer on a private
/// server-named queue. Create it *before* the action that should close the channel.
pub struct CloseWatch {
    ch: Channel,
    consumer: lapin::Consumer,
}

pub async fn close_watch(ch: &Channel) -> CloseWatch {
    let q = t("watch queue", ch.queue_declare("".into(), lapin::options::QueueDeclareOptions::exclusive(), Default::default()))
        .await
        .expect("declare watch queue");
    let consumer = t(
        "watch consume",
        ch.basic_consume(
            q.name().clone(),
            "".into(),
            lapin::options::BasicConsumeOptions { no_ack: true, ..Default::default() },
            Default::default(),
        ),
    )
    .await
    .expect("consume watch queue");
    CloseWatch { ch: ch.clone(), consumer }
}

impl CloseWatch {
    /// Force round trips until the broker's channel.close shows up (bounded: ~3 s); return its
    /// reply code. Panics if the channel stays usable or closes without a code.
    pub async fn code(mut self, what: &str) -> u16 {
        use futures_lite::StreamExt;
        for _ in 0..30 {
            if let Err(e) = t(what, self.ch.basic_qos(0, lapin::options::BasicQosOptions::default())).await {
                if let Some(c) = reply_code(&e) {
                    return c;
                }
                break; // closing: the code is delivered to the consumer below
            }
            if let Ok(r) = tokio::time::timeout(Duration::from_millis(100), self.consumer.next()).await {
                match r {
                    Some(Err(e)) => return reply_code(&e).unwrap_or_else(|| panic!("{what}: channel closed without a reply code: {e}")),
                    Some(Ok(d)) => panic!("{what}: unexpected delivery on the watch queue: {d:?}"),
                    None => panic!("{what}: channel closed without an error"),
                }
            }
        }
        match tt(what, Duration::from_secs(3), self.consumer.next()).await {
            Some(Err(e)) => reply_code(&e).unwrap_or_else(|| panic!("{what}: channel closed without a reply code: {e}")),
            other => panic!("{what}: expected the broker to close the channel, got {other:?}"),
        }
    }
}

/// Declare a queue with the given options and arguments; return its name.
pub async fn declare_queue(ch: &Channel, name: &str, opts: lapin::options::QueueDeclareOptions, args: lapin::types::FieldTable) -> String {
    let q = t("queue.declare", ch.queue_declare(name.into(), opts, args)).await.unwrap_or_else(|e| panic!("queue.declare {name}: {e}"));
    q.name().as_str().to_string()
}

/// Declare a plain (non-durable, non-exclusive, non-auto-delete) queue named uniquely.
pub async fn plain_queue(ch: &Channel, tag: &str) -> String {
    declare_queue(ch, &uniq(tag), Default::default(), Default::default()).await
}

/// Put `ch` in confirm mode (idempotent).
pub async fn confirm_mode(ch: &Channel) {
    t("confirm.select", ch.confirm_select(lapin::options::ConfirmSelectOptions::default())).await.expect("confirm.select");
}

/// Publish and wait for the publisher confirm (the channel must be in confirm mode).
/// Returns the confirmation (Ack/Nack, with a returned message when unroutable + mandatory).
pub async fn publish_confirmed(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: lapin::BasicProperties,
) -> lapin::Confirmation {
    let pc = t("basic.publish", ch.basic_publish(exchange.into(), routing_key.into(), Default::default(), body, props))
        .await
        .expect("basic.publish");
    t("publisher confirm", pc).await.expect("confirm")
}

/// Publish (no confirm wait) with default properties.
pub async fn publish(ch: &Channel, exchange: &str, routing_key: &str, body: &[u8]) {
    t("basic.publish", ch.basic_publish(exchange.into(), routing_key.into(), Default::default(), body, Default::default()))
        .await
        .expect("basic.publish");
}

/// basic.get with auto-ack; the body, or None on get-empty.
pub async fn get_body(ch: &Channel, queue: &str) -> Option<Vec<u8>> {
    t("basic.get", ch.basic_get(queue.into(), lapin::options::BasicGetOptions { no_ack: true }))
        .await
        .expect("basic.get")
        .map(|m| m.delivery.data)
}

/// Drain a queue with auto-ack basic.get (at most `max` messages); bodies in order.
pub async fn drain(ch: &Channel, queue: &str, max: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for _ in 0..max {
        match get_body(ch, queue).await {
            Some(b) => out.push(b),
            None => break,
        }
    }
    out
}

/// Ready-message count of a queue, by passive queue.declare.
pub async fn ready_count(ch: &Channel, queue: &str) -> u32 {
    let opts = lapin::options::QueueDeclareOptions { passive: true, ..Default::default() };
    t("passive queue.declare", ch.queue_declare(queue.into(), opts, Default::default()))
        .await
        .unwrap_or_else(|e| panic!("passive declare {queue}: {e}"))
        .message_count()
}

/// Poll (bounded by `limit`) until the queue holds `n` ready messages; return the last count.
pub async fn wait_ready(ch: &Channel, queue: &str, n: u32, limit: Duration) -> u32 {
    let deadline = Instant::now() + limit;
    loop {
        let c = ready_count(ch, queue).await;
        if c == n || Instant::now() > deadline {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Does the queue exist? (passive declare on a throwaway channel of `conn`)
pub async fn queue_exists(conn: &Connection, queue: &str) -> bool {
    let ch = t("channel.open", conn.create_channel()).await.expect("channel.open");
    let opts = lapin::options::QueueDeclareOptions { passive: true, ..Default::default() };
    match t("passive queue.declare", ch.queue_declare(queue.into(), opts, Default::default())).await {
        Ok(_) => {
            let _ = t("channel.close", ch.close(200, "ok".into())).await;
            true
        }
        Err(e) => {
            assert_eq!(reply_code(&e), Some(404), "passive declare {queue}: {e}");
            false
        }
    }
}

/// Does the exchange exist? (passive declare on a throwaway channel of `conn`)
pub async fn exchange_exists(conn: &Connection, exchange: &str) -> bool {
    let ch = t("channel.open", conn.create_channel()).await.expect("channel.open");
    let opts = lapin::options::ExchangeDeclareOptions { passive: true, ..Default::default() };
    match t("passive exchange.declare", ch.exchange_declare(exchange.into(), lapin::ExchangeKind::Direct, opts, Default::default())).await {
        Ok(_) => {
            let _ = t("channel.close", ch.close(200, "ok".into())).await;
            true
        }
        Err(e) => {
            assert_eq!(reply_code(&e), Some(404), "passive declare exchange {exchange}: {e}");
            false
        }
    }
}

/// Receive the next delivery from a consumer within `limit`; panics on timeout or cancel.
pub async fn next_delivery(c: &mut lapin::Consumer, limit: Duration) -> lapin::message::Delivery {
    use futures_lite::StreamExt;
    match tokio::time::timeout(limit, c.next()).await {
        Ok(Some(Ok(d))) => d,
        Ok(Some(Err(e))) => panic!("consumer error: {e}"),
        Ok(None) => panic!("consumer cancelled"),
        Err(_) => panic!("no delivery within {limit:?}"),
    }
}

/// Expect no delivery on `c` for `quiet` (used after settling to check nothing extra arrives).
pub async fn assert_no_delivery(c: &mut lapin::Consumer, quiet: Duration, what: &str) {
    use futures_lite::StreamExt;
    if let Ok(Some(Ok(d))) = tokio::time::timeout(quiet, c.next()).await {
        panic!("{what}: unexpected delivery {:?} tag {}", String::from_utf8_lossy(&d.data), d.delivery_tag);
    }
}

// ---------------------------------------------------------------------------------------------
// Added for tests/resources.rs (issue 9): a broker on a caller-chosen data dir, optionally run
// under a command prefix, restartable with another prefix or other flags.
// ---------------------------------------------------------------------------------------------

/// A ringmq child process on a data dir the caller chooses (e.g. on a loop-mounted filesystem),
/// optionally started under a command prefix such as `prlimit --nofile=256:256 --` (prlimit
/// execs the broker, so the child's PID is the broker's). The prefix and the extra flags may be
/// changed between stops and starts; port, metrics port and data dir stay. The broker is killed
/// by its PID on drop. Its log goes to a file in the temp dir (never the data dir, which may be
/// on a full filesystem) and is printed when the owning test panics. Never an external broker.
pub struct OwnBroker {
    addr: SocketAddr,
    metrics_port: u16,
    data_dir: PathBuf,
    prefix: Vec<String>,
    args: Vec<String>,
    child: Option<Child>,
    log_path: PathBuf,
}

impl OwnBroker {
    /// Start ringmq on `data_dir` (created if missing) under `prefix` (empty: none) with the
    /// harness flags plus `args`; waits (bounded) until it accepts.
    pub fn start_in(data_dir: &std::path::Path, prefix: &[&str], args: &[&str]) -> OwnBroker {
        std::fs::create_dir_all(data_dir).unwrap_or_else(|e| panic!("create {}: {e}", data_dir.display()));
        let log_path = std::env::temp_dir().join(format!("{}.stderr.log", uniq("own-broker")));
        let mut b = OwnBroker {
            addr: SocketAddr::from(([127, 0, 0, 1], free_port())),
            metrics_port: free_port(),
            data_dir: data_dir.to_path_buf(),
            prefix: prefix.iter().map(|s| s.to_string()).collect(),
            args: args.iter().map(|s| s.to_string()).collect(),
            child: None,
            log_path,
        };
        b.start();
        b
    }

    pub fn host(&self) -> String {
        self.addr.ip().to_string()
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn metrics_port(&self) -> u16 {
        self.metrics_port
    }

    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }

    /// The running child's PID (None when stopped).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Command prefix for the next [`OwnBroker::start`] (empty: run the broker directly).
    pub fn set_prefix(&mut self, prefix: &[&str]) {
        self.prefix = prefix.iter().map(|s| s.to_string()).collect();
    }

    /// Extra flags for the next [`OwnBroker::start`] (replacing the previous ones).
    pub fn set_args(&mut self, args: &[&str]) {
        self.args = args.iter().map(|s| s.to_string()).collect();
    }

    /// The broker's captured stdout/stderr so far (every start appends).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Panics (with the log) unless the broker process is still running.
    #[track_caller]
    pub fn assert_running(&mut self, when: &str) {
        let child = self.child.as_mut().unwrap_or_else(|| panic!("{when}: broker not started"));
        if let Ok(Some(status)) = child.try_wait() {
            self.child = None;
            panic!("{when}: ringmq is no longer running ({status}); log:\n{}", self.log());
        }
    }

    /// Start (after [`OwnBroker::stop`] or [`OwnBroker::kill9`]) on the same ports and data dir
    /// with the current prefix and flags. A start that dies at once (the port briefly not
    /// bindable after the previous process) is retried a few times; bounded.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "start(): the broker is already running");
        for attempt in 0..20 {
            match self.spawn_and_wait() {
                Ok(()) => return,
                Err(e) if attempt == 19 => panic!("{e}; log:\n{}", self.log()),
                Err(_) => std::thread::sleep(Duration::from_millis(250)),
            }
        }
    }

    fn spawn_and_wait(&mut self) -> Result<(), String> {
        let log = File::options().create(true).append(true).open(&self.log_path).expect("broker log file");
        let out = log.try_clone().unwrap();
        let mut cmd = match self.prefix.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(broker_binary());
                c
            }
            None => Command::new(broker_binary()),
        };
        cmd.arg("--listen")
            .arg(self.addr.to_string())
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--metrics-listen")
            .arg(format!("127.0.0.1:{}", self.metrics_port))
            .arg("--cores")
            .arg("2")
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(log);
        let before = ready_lines(&self.log());
        let mut child = cmd.spawn().map_err(|e| format!("spawn ringmq ({:?}): {e}", self.prefix))?;
        let deadline = Instant::now() + START_TIMEOUT;
        let mut watch = StartWatch::new(before);
        loop {
            if watch.ready(self.addr, &self.log()) {
                self.child = Some(child);
                return Ok(());
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("ringmq exited during start-up ({status})"));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("ringmq did not accept on {} within {START_TIMEOUT:?}", self.addr));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Graceful stop: SIGTERM to the PID, wait (bounded by [`STOP_TIMEOUT`]) for exit status 0.
    pub fn stop(&mut self) {
        let mut child = self.child.take().expect("stop(): broker not running");
        sigterm_and_wait(&mut child, || self.log());
    }

    /// Crash stop: SIGKILL to the PID, reap.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("kill9(): broker not running");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// GET /metrics (plain HTTP over a TcpStream, bounded to 5 s); the whole response text.
    pub fn metrics(&self) -> Result<String, String> {
        http::http_get(self.metrics_port, "/metrics")
    }
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(Some(status)) = child.try_wait() {
                eprintln!("ringmq ({}) had already exited: {status}", self.addr);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            // the last 200 lines: a broker at a resource limit may log an error per request
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            let skip = lines.len().saturating_sub(200);
            let note = if skip > 0 { format!("({skip} earlier lines left out)\n") } else { String::new() };
            eprintln!("----- ringmq log ({}) -----\n{note}{}\n----- end of ringmq log -----", self.addr, lines[skip..].join("\n"));
        }
        let _ = std::fs::remove_file(&self.log_path);
    }
}

/// The value of an unlabelled Prometheus series (`name value`) in a metrics text, if present.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        if !rest.starts_with(' ') {
            return None; // a longer name with this prefix, or a labelled series
        }
        rest.split_whitespace().next()?.parse().ok()
    })
}
