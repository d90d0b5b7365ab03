//! A ringmq cluster of real processes on loopback, for the cluster tests.
//!
//! [`Cluster::start`] runs `n` `ringmq` processes, node index `i` (0-based) being node id
//! `i + 1`, each with its own temp dir (data in `<tmp>/data`, stdout and stderr in
//! `<tmp>/node.log`), its own free loopback ports for AMQP, metrics, the management API and
//! the cluster transport,
//! `--cores 1` (the test machine has 2 cores for 3 brokers and the test), and one `--peers`
//! list naming every node. It returns once every node is ready: its AMQP port answers the
//! protocol header with a frame and its `/metrics` answers 200 (a free loopback port can
//! "connect" to itself, so an accepted TCP connection alone proves nothing).
//!
//! # Invariants
//! - Every wait is bounded: [`CLUSTER_START_TIMEOUT`] for a start, 5 s per HTTP request.
//! - Processes are only ever signalled by the PID of a child this harness spawned:
//!   [`Cluster::kill9`] and `Drop` send SIGKILL to that PID and reap it.
//! - A node keeps its data dir and its three ports across [`Cluster::kill9`] and
//!   [`Cluster::start_node`], as a restarted machine would.
//!
//! [`Cluster::start_linked`] puts a proxy on every link between two nodes (`proxy.rs`), so
//! that a test can partition them ([`Cluster::partition`], [`Cluster::set_link`]).
//!
//! When the owning test panics, `Drop` prints the end of every node's log.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::future::Future;
use std::sync::{Mutex, MutexGuard};

use futures_lite::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};

use super::http::http_get;
use super::proxy::{Mode, Proxy};
use super::{broker_binary, confirm_mode, declare_queue, free_port, publish_confirmed, t};

/// How long a start (of the whole cluster, or of one node) may take until every started node
/// is ready.
pub const CLUSTER_START_TIMEOUT: Duration = Duration::from_secs(60);

/// Lines of each node's log printed when a test panics.
const LOG_TAIL_LINES: usize = 150;

/// One node: its ports and directory (fixed for the life of the cluster) and its process.
struct Node {
    /// Raft node id (index + 1).
    id: u64,
    /// AMQP listen address.
    amqp: SocketAddr,
    /// Metrics listen address.
    metrics: SocketAddr,
    /// Management API listen address.
    management: SocketAddr,
    /// Cluster (Raft transport) listen address, as listed in `--peers`.
    cluster: SocketAddr,
    /// Holds `data/` and `node.log`; removed on drop.
    dir: tempfile::TempDir,
    /// The running process, if any.
    child: Option<Child>,
    /// This node's own `--peers` and extra flags (a node added later), else the cluster's.
    own: Option<(String, Vec<String>)>,
    /// Its data directory when not `<dir>/data` ([`Cluster::put_data_in`]).
    data: Option<PathBuf>,
}

impl Node {
    /// Node index `i` (id `i + 1`): free loopback ports, a fresh temp dir, not started.
    fn fresh(i: usize) -> Node {
        let loopback = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        Node {
            id: i as u64 + 1,
            amqp: loopback(free_port()),
            metrics: loopback(free_port()),
            management: loopback(free_port()),
            cluster: loopback(free_port()),
            dir: tempfile::Builder::new().prefix(&format!("ringmq-cluster-n{}-", i + 1)).tempdir().expect("temp dir"),
            child: None,
            own: None,
            data: None,
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.data.clone().unwrap_or_else(|| self.dir.path().join("data"))
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("node.log")
    }
}

/// A cluster of ringmq processes on 127.0.0.1 (see the module doc).
pub struct Cluster {
    nodes: Vec<Node>,
    /// The `--peers` value every node gets.
    peers: String,
    /// Extra flags for every node at every start.
    extra_args: Vec<String>,
    /// The proxy of each directed link (from, to) when started by [`Cluster::start_linked`].
    links: HashMap<(usize, usize), Proxy>,
}

impl Cluster {
    /// Starts `n` nodes and waits (bounded by [`CLUSTER_START_TIMEOUT`]) until all are ready.
    pub fn start(n: usize) -> Cluster {
        Self::start_with_args(n, &[])
    }

    /// [`Cluster::start`] with extra flags given to every node at every start.
    pub fn start_with_args(n: usize, extra: &[&str]) -> Cluster {
        assert!(n >= 1, "a cluster has at least one node");
        let nodes: Vec<Node> = (0..n).map(Node::fresh).collect();
        Self::launch(nodes, HashMap::new(), extra)
    }

    /// [`Cluster::start_with_args`] with every link between two nodes through a proxy of its
    /// own (`proxy.rs`), so that a test can partition them: node i's `--peers` names node j
    /// at the proxy of link i→j.
    pub fn start_linked(n: usize, extra: &[&str]) -> Cluster {
        let mut nodes: Vec<Node> = (0..n).map(Node::fresh).collect();
        let listens: Vec<SocketAddr> = nodes.iter().map(|n| n.cluster).collect();
        let mut links = HashMap::new();
        for (i, node) in nodes.iter_mut().enumerate() {
            let mut peers = Vec::new();
            for (j, &listen) in listens.iter().enumerate() {
                let addr = if i == j { listen } else { links.entry((i, j)).or_insert_with(|| Proxy::start(listen)).addr() };
                peers.push(format!("{}={addr}", j + 1));
            }
            node.own = Some((peers.join(","), Vec::new()));
        }
        Self::launch(nodes, links, extra)
    }

    /// `n` nodes as [`Cluster::start_with_args`] makes them, none started: a test sets them up
    /// ([`Cluster::put_data_in`]) before [`Cluster::start_all_again`] starts them all.
    pub fn unstarted(n: usize, extra: &[&str]) -> Cluster {
        let nodes: Vec<Node> = (0..n).map(Node::fresh).collect();
        let peers = nodes.iter().map(|n| format!("{}={}", n.id, n.cluster)).collect::<Vec<_>>().join(",");
        Cluster { nodes, peers, extra_args: extra.iter().map(|s| s.to_string()).collect(), links: HashMap::new() }
    }

    /// Node `i` keeps its data in `dir` (e.g. on a disk of the test's own) from its next start.
    pub fn put_data_in(&mut self, i: usize, dir: PathBuf) {
        self.nodes[i].data = Some(dir);
    }

    /// Spawns `nodes` and waits until all are ready.
    fn launch(nodes: Vec<Node>, links: HashMap<(usize, usize), Proxy>, extra: &[&str]) -> Cluster {
        let n = nodes.len();
        let peers = nodes.iter().map(|n| format!("{}={}", n.id, n.cluster)).collect::<Vec<_>>().join(",");
        let mut c = Cluster { nodes, peers, extra_args: extra.iter().map(|s| s.to_string()).collect(), links };
        // All first, then wait: a node may not serve before a majority of its peers is up.
        for i in 0..n {
            c.spawn(i);
        }
        let all: Vec<usize> = (0..n).collect();
        if let Err(e) = c.wait_ready(&all, Instant::now() + CLUSTER_START_TIMEOUT) {
            panic!("cluster of {n} did not start: {e}");
        }
        c
    }

    /// Starts one more node (the next id) with `args` besides the usual flags and a `--peers`
    /// list of every node so far and itself (the others keep theirs), and waits until it is
    /// ready; returns its index. With `--join`, how a node joins a running cluster.
    pub fn add_node(&mut self, args: &[&str]) -> usize {
        let i = self.nodes.len();
        let node = Node::fresh(i);
        let peers = self.nodes.iter().chain([&node]).map(|n| format!("{}={}", n.id, n.cluster)).collect::<Vec<_>>().join(",");
        let node = Node { own: Some((peers, args.iter().map(|s| s.to_string()).collect())), ..node };
        self.nodes.push(node);
        self.start_node(i);
        i
    }

    /// The `--peers` list of every node, this cluster's and those added since.
    pub fn all_peers(&self) -> String {
        self.nodes.iter().map(|n| format!("{}={}", n.id, n.cluster)).collect::<Vec<_>>().join(",")
    }

    /// Node `i`'s management API port.
    pub fn management_port(&self, i: usize) -> u16 {
        self.nodes[i].management.port()
    }

    /// Sets the mode of the link from node `from` to node `to` (the connections `from` dials),
    /// of a cluster started by [`Cluster::start_linked`].
    pub fn set_link(&self, from: usize, to: usize, mode: Mode) {
        self.links.get(&(from, to)).unwrap_or_else(|| panic!("no proxied link {from} -> {to}")).set(mode);
    }

    /// Both links between nodes `a` and `b` in `mode` (`Mode::Pass` heals them).
    pub fn partition(&self, a: usize, b: usize, mode: Mode) {
        self.set_link(a, b, mode);
        self.set_link(b, a, mode);
    }

    /// Number of nodes (running or not).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Raft node id of node index `i` (`i + 1`).
    pub fn node_id(&self, i: usize) -> u64 {
        self.nodes[i].id
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f` of node `i`.
    pub fn amqp_uri(&self, i: usize) -> String {
        format!("amqp://guest:guest@{}/%2f", self.nodes[i].amqp)
    }

    /// AMQP address of node `i`.
    pub fn amqp_addr(&self, i: usize) -> SocketAddr {
        self.nodes[i].amqp
    }

    /// Cluster (Raft transport) address of node `i`.
    pub fn cluster_addr(&self, i: usize) -> SocketAddr {
        self.nodes[i].cluster
    }

    /// The `--peers` list every node was given.
    pub fn peers(&self) -> &str {
        &self.peers
    }

    /// The data directory of node `i`.
    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.nodes[i].data_dir()
    }

    /// PID of node `i`'s process (None when it is not running).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].child.as_ref().map(|c| c.id())
    }

    /// Is node `i`'s process running? (reaps it, and forgets it, if it exited)
    pub fn is_running(&mut self, i: usize) -> bool {
        let node = &mut self.nodes[i];
        match node.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(None)) => true,
            Some(_) => {
                node.child = None;
                false
            }
            None => false,
        }
    }

    /// Waits (polling every 50 ms, up to `limit`) for node `i`'s process to exit on its own;
    /// its exit status, or None while it still runs (it is left running).
    pub fn wait_exit(&mut self, i: usize, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            let child = self.nodes[i].child.as_mut()?;
            if let Ok(Some(status)) = child.try_wait() {
                self.nodes[i].child = None;
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Indexes of the nodes whose process runs.
    pub fn running(&mut self) -> Vec<usize> {
        (0..self.len()).filter(|&i| self.is_running(i)).collect()
    }

    /// GET /metrics on node `i`: the body. Panics (with the node's log) when it does not answer
    /// 200 within 5 s.
    pub fn metrics(&self, i: usize) -> String {
        self.try_metrics(i).unwrap_or_else(|e| panic!("node {}: {e}; log:\n{}", self.node_id(i), self.log_tail(i)))
    }

    /// GET /metrics on node `i`: the body, or why not.
    pub fn try_metrics(&self, i: usize) -> Result<String, String> {
        let resp = http_get(self.nodes[i].metrics.port(), "/metrics")?;
        let (head, body) = resp.split_once("\r\n\r\n").ok_or_else(|| format!("no end of headers in {resp:?}"))?;
        let status = head.lines().next().unwrap_or("");
        if status.split_whitespace().nth(1) != Some("200") {
            return Err(format!("GET /metrics on {}: {status:?}", self.nodes[i].metrics));
        }
        Ok(body.to_string())
    }

    /// The value of the series `name{label="value"}` (one label) in node `i`'s metrics, when it
    /// answers and has the series.
    pub fn metric(&self, i: usize, name: &str, label: Option<(&str, &str)>) -> Option<f64> {
        let text = self.try_metrics(i).ok()?;
        match label {
            None => super::metric_value(&text, name),
            Some((k, v)) => labelled_metric_value(&text, name, k, v),
        }
    }

    /// Polls (up to 20 s) until every node in `nodes` reports `ringmq_cluster_members` `n`.
    pub async fn wait_members(&self, nodes: &[usize], n: f64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let seen: Vec<Option<f64>> = nodes.iter().map(|&i| self.metric(i, "ringmq_cluster_members", None)).collect();
            if seen.iter().all(|v| *v == Some(n)) {
                return;
            }
            assert!(Instant::now() < deadline, "not every node of {nodes:?} counts {n} members: {seen:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Running nodes that report `ringmq_raft_is_leader 1` now.
    pub fn leaders(&mut self) -> Vec<usize> {
        self.running().into_iter().filter(|&i| self.metric(i, "ringmq_raft_is_leader", None) == Some(1.0)).collect()
    }

    /// Polls (every 50 ms, up to `limit`) until exactly one running node reports itself leader;
    /// returns its index. Panics with what each node reported otherwise.
    pub fn wait_one_leader(&mut self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            let leaders = self.leaders();
            if let [one] = leaders[..] {
                return one;
            }
            if Instant::now() > deadline {
                let seen: Vec<String> = self
                    .running()
                    .into_iter()
                    .map(|i| format!("node {}: {:?}", self.node_id(i), self.metric(i, "ringmq_raft_is_leader", None)))
                    .collect();
                panic!("not exactly one leader within {limit:?} (leaders: {leaders:?}); ringmq_raft_is_leader: {}", seen.join(", "));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL node `i` by its PID and reap it. Panics if it is not running.
    pub fn kill9(&mut self, i: usize) {
        let mut child = self.nodes[i].child.take().unwrap_or_else(|| panic!("kill9: node {} is not running", i + 1));
        let _ = child.kill(); // kill(pid, SIGKILL)
        let _ = child.wait();
    }

    /// Starts node `i` again (after [`Cluster::kill9`]) on the same data dir and ports, and waits
    /// (bounded by [`CLUSTER_START_TIMEOUT`]) until it is ready. A process that exits at once
    /// (a port not yet bindable after the previous one) is started again, a few times.
    pub fn start_node(&mut self, i: usize) {
        assert!(!self.is_running(i), "start_node: node {} is already running", i + 1);
        let deadline = Instant::now() + CLUSTER_START_TIMEOUT;
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.spawn(i);
            match self.wait_ready(&[i], deadline) {
                Ok(()) => return,
                Err(e) if attempt >= 20 || Instant::now() > deadline || self.is_running(i) => {
                    panic!("node {} did not start again (attempt {attempt}): {e}", i + 1)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(250)),
            }
        }
    }

    /// Starts every node again at once (after each was killed: alone, none would find the
    /// majority it waits for at start; or the first time, after [`Cluster::unstarted`]) and
    /// waits until all are ready.
    pub fn start_all_again(&mut self) {
        let all: Vec<usize> = (0..self.len()).collect();
        for &i in &all {
            assert!(!self.is_running(i), "start_all_again: node {} is still running", i + 1);
            self.spawn(i);
        }
        if let Err(e) = self.wait_ready(&all, Instant::now() + CLUSTER_START_TIMEOUT) {
            panic!("the cluster did not start again: {e}");
        }
    }

    /// Node `i`'s captured stdout and stderr (every start appends).
    pub fn log(&self, i: usize) -> String {
        let mut s = String::new();
        if let Ok(mut f) = File::open(self.nodes[i].log_path()) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// The last [`LOG_TAIL_LINES`] lines of node `i`'s log.
    fn log_tail(&self, i: usize) -> String {
        let log = self.log(i);
        let lines: Vec<&str> = log.lines().collect();
        let skip = lines.len().saturating_sub(LOG_TAIL_LINES);
        let note = if skip > 0 { format!("({skip} earlier lines left out)\n") } else { String::new() };
        format!("{note}{}", lines[skip..].join("\n"))
    }

    /// Starts node `i`'s process on its data dir and ports, without waiting for it.
    pub fn spawn(&mut self, i: usize) {
        let (peers, own_args) = match &self.nodes[i].own {
            Some((peers, args)) => (peers.clone(), args.clone()),
            None => (self.peers.clone(), Vec::new()),
        };
        let node = &mut self.nodes[i];
        let log = File::options().create(true).append(true).open(node.log_path()).expect("node log file");
        let out = log.try_clone().expect("dup log file");
        let child = Command::new(broker_binary())
            .arg("--node-id")
            .arg(node.id.to_string())
            .arg("--listen")
            .arg(node.amqp.to_string())
            .arg("--metrics-listen")
            .arg(node.metrics.to_string())
            .arg("--management-listen")
            .arg(node.management.to_string())
            .arg("--cluster-listen")
            .arg(node.cluster.to_string())
            .arg("--peers")
            .arg(&peers)
            .arg("--data-dir")
            .arg(node.data_dir())
            .arg("--cores")
            .arg("1")
            .args(&self.extra_args)
            .args(&own_args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn ringmq node {}: {e}", node.id));
        node.child = Some(child);
    }

    /// Waits until every node in `which` is ready (AMQP answers the protocol header, /metrics
    /// answers 200), or one of them exits, or `deadline` passes.
    fn wait_ready(&mut self, which: &[usize], deadline: Instant) -> Result<(), String> {
        let mut pending: Vec<usize> = which.to_vec();
        loop {
            let mut still = Vec::new();
            for &i in &pending {
                if !self.is_running(i) {
                    return Err(format!("node {} exited during start-up; log:\n{}", i + 1, self.log_tail(i)));
                }
                if !(amqp_answers(self.nodes[i].amqp) && self.try_metrics(i).is_ok()) {
                    still.push(i);
                }
            }
            pending = still;
            if pending.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let logs: Vec<String> = pending.iter().map(|&i| format!("----- node {} log -----\n{}", i + 1, self.log_tail(i))).collect();
                return Err(format!("nodes {:?} (0-based) not ready by the deadline\n{}", pending, logs.join("\n")));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        for i in 0..self.nodes.len() {
            if let Some(mut child) = self.nodes[i].child.take() {
                if let Ok(Some(status)) = child.try_wait() {
                    eprintln!("ringmq node {} had already exited: {status}", i + 1);
                }
                let _ = child.kill(); // by PID, SIGKILL
                let _ = child.wait();
            }
            if panicking {
                let n = &self.nodes[i];
                eprintln!(
                    "----- ringmq node {} (amqp {}, metrics {}, cluster {}) log -----\n{}\n----- end of node {} log -----",
                    n.id,
                    n.amqp,
                    n.metrics,
                    n.cluster,
                    self.log_tail(i),
                    n.id
                );
            }
        }
    }
}

/// True when `addr` is a real AMQP listener: it answers the 0-9-1 protocol header with a frame
/// (connection.start: frame type 1 on channel 0). A self-connected socket would echo the header
/// back instead. Bounded to about 1 s.
pub fn amqp_answers(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    if s.local_addr().ok() == s.peer_addr().ok() {
        return false;
    }
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
    if s.write_all(b"AMQP\x00\x00\x09\x01").is_err() {
        return false;
    }
    let mut head = [0u8; 3];
    s.read_exact(&mut head).is_ok() && head == [1, 0, 0]
}

/// The value of the series `name{...label="value"...}` in a Prometheus/OpenMetrics text.
pub fn labelled_metric_value(text: &str, name: &str, label: &str, value: &str) -> Option<f64> {
    let want = format!("{label}=\"{value}\"");
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?.strip_prefix('{')?;
        let (labels, tail) = rest.split_once('}')?;
        labels.split(',').any(|kv| kv.trim() == want).then_some(())?;
        tail.split_whitespace().next()?.parse().ok()
    })
}

/// One cluster at a time (three brokers per test already share two cores with the test): the
/// guard of the test's turn, or None (with a note) against an external broker.
pub fn my_turn() -> Option<MutexGuard<'static, ()>> {
    if std::env::var_os("RINGMQ_TEST_BROKER").is_some() {
        eprintln!("SKIPPED against an external broker: the cluster tests start their own ringmq nodes");
        return None;
    }
    static ONE: Mutex<()> = Mutex::new(());
    Some(ONE.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
}

/// Runs an async test body in its turn (see [`my_turn`]) on its own runtime: a multi-thread one,
/// so that the harness's blocking waits do not stall lapin's I/O.
pub fn run<F: Future<Output = ()>>(body: F) {
    let Some(_turn) = my_turn() else { return };
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime").block_on(body);
}

pub async fn channel(conn: &Connection) -> Channel {
    t("channel.open", conn.create_channel()).await.expect("channel.open")
}

/// Properties of a persistent message (delivery_mode 2).
pub fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

/// A durable queue `name` declared on a fresh channel of `conn`.
pub async fn durable_queue(conn: &Connection, name: &str) {
    let ch = channel(conn).await;
    declare_queue(&ch, name, QueueDeclareOptions::durable(), FieldTable::default()).await;
}

/// A confirm-mode channel on `conn`.
pub async fn confirming(conn: &Connection) -> Channel {
    let ch = channel(conn).await;
    confirm_mode(&ch).await;
    ch
}

/// Publishes `n` persistent messages "<prefix>-<i>" to `queue` through the default exchange,
/// asserts every one is confirmed (ack), and returns their bodies.
pub async fn publish_all(ch: &Channel, queue: &str, prefix: &str, n: usize) -> Vec<String> {
    let mut bodies = Vec::with_capacity(n);
    for i in 0..n {
        let body = format!("{prefix}-{i}");
        let c = publish_confirmed(ch, "", queue, body.as_bytes(), persistent()).await;
        assert!(c.is_ack(), "publish {body} to {queue} not confirmed: {c:?}");
        bodies.push(body);
    }
    bodies
}

/// Consumes from `queue` on `conn` until `want` distinct bodies arrived (bounded by `limit`);
/// acks each; returns (bodies, how many came redelivered=true).
pub async fn drain_distinct(conn: &Connection, queue: &str, want: usize, limit: Duration) -> (BTreeSet<String>, BTreeSet<String>) {
    let deadline = Instant::now() + limit;
    let (mut seen, mut redelivered) = (BTreeSet::new(), BTreeSet::new());
    while seen.len() < want && Instant::now() < deadline {
        let ch = channel(conn).await;
        let Ok(mut sub) =
            t("basic.consume", ch.basic_consume(queue.into(), "drain".into(), BasicConsumeOptions::default(), FieldTable::default())).await
        else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        while seen.len() < want {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left.min(Duration::from_secs(5)), sub.next()).await {
                Ok(Some(Ok(d))) => {
                    let body = String::from_utf8_lossy(&d.data).into_owned();
                    if d.redelivered {
                        redelivered.insert(body.clone());
                    }
                    seen.insert(body);
                    let _ = d.ack(BasicAckOptions::default()).await;
                }
                _ => break,
            }
        }
    }
    (seen, redelivered)
}
