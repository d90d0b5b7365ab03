//! [`Transport`]: start, send, send_data, status, shutdown; and [`Shared`], the state its
//! threads share (peers and their queues, the stop signal, the registry of open sockets).

use std::collections::{BTreeMap, HashMap};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use raft::eraftpb::{Message, MessageType};
use tracing::{debug, info, warn};

use super::data::{self, DataLink};
use super::frame::MAX_CHUNK_DATA;
use super::link::LinkError;
use super::{inbound, outbound, DataError, NodeId, OnData, OnLink, PeerStatus, Report, TransportConfig, TransportError};

/// How long [`Transport::shutdown`] waits for its threads before leaving them detached.
const JOIN_TIMEOUT: Duration = Duration::from_millis(1500);
/// Capacity of each peer's snapshot queue, in messages (raft-rs has at most one snapshot in
/// flight per peer; a few more cover a retry racing a report).
const SNAPSHOT_QUEUE: usize = 4;

/// The callback receiving every message from a peer.
pub(super) type OnMessage = Arc<dyn Fn(Message) + Send + Sync>;
/// The callback receiving every [`Report`].
pub(super) type OnReport = Arc<dyn Fn(Report) + Send + Sync>;

/// The cluster transport of this node: one listener, and per peer a raft-lane writer, a
/// snapshot sender and a data-lane writer (module doc, "Lanes"). `Send + Sync`; dropping it
/// shuts it down.
pub struct Transport {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    /// A clone of the listening socket, shut down (2) on shutdown to wake the listener thread.
    listener: TcpListener,
    /// Listener, writer, snapshot and data threads (reader threads are in `Shared::readers`).
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// What every transport thread sees.
pub(super) struct Shared {
    pub(super) me: NodeId,
    /// Every peer but this node; [`Transport::add_peer`] adds more (none ever leaves).
    pub(super) peers: RwLock<BTreeMap<NodeId, Arc<Peer>>>,
    /// Answers admin requests ([`super::OnAdmin`]); `None` until [`Transport::on_admin`].
    pub(super) on_admin: RwLock<Option<super::OnAdmin>>,
    pub(super) on_message: OnMessage,
    pub(super) on_report: OnReport,
    pub(super) on_data: OnData,
    pub(super) on_link: OnLink,
    pub(super) stop: Stop,
    pub(super) sockets: Sockets,
    /// Snapshot chunk size, bytes (1..=MAX_CHUNK_DATA).
    pub(super) chunk_bytes: usize,
    /// Raft-lane queue capacity of each peer, messages.
    queue_capacity: usize,
    /// Data-lane queue capacity of each peer, payloads.
    data_queue_capacity: usize,
    /// Reader threads of accepted connections (the listener adds, shutdown joins).
    pub(super) readers: Mutex<Vec<JoinHandle<()>>>,
    /// Accepted connections alive now (bounded by `inbound::MAX_INBOUND`).
    pub(super) inbound: AtomicUsize,
    /// The current inbound raft lane per peer: the socket id in `sockets` (invariant 5).
    pub(super) inbound_raft: Mutex<HashMap<NodeId, u64>>,
    /// Set (under the write lock) once shutdown has drained the snapshot queues: after it,
    /// `send` fails snapshots itself, so none is lost without a report.
    snapshots_closed: RwLock<bool>,
}

/// One peer: its address, queues and counters.
pub(super) struct Peer {
    pub(super) id: NodeId,
    pub(super) addr: SocketAddr,
    raft_tx: flume::Sender<Message>,
    snap_tx: flume::Sender<Message>,
    /// Kept so shutdown can fail what is still queued (the sender thread holds a clone).
    snap_rx: flume::Receiver<Message>,
    pub(super) stats: PeerStats,
    /// The data lane: queue, link state, counters.
    pub(super) data: DataLink,
}

/// Counters and the link flag behind [`PeerStatus`].
#[derive(Default)]
pub(super) struct PeerStats {
    pub(super) connected: AtomicBool,
    pub(super) sent: AtomicU64,
    pub(super) writes: AtomicU64,
    pub(super) dropped: AtomicU64,
    pub(super) snapshots_sent: AtomicU64,
    pub(super) snapshots_failed: AtomicU64,
}

impl PeerStats {
    pub(super) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

impl Shared {
    pub(super) fn report(&self, report: Report) {
        (self.on_report)(report);
    }

    /// Peer `id`, if it is one (a peer removed at run time is none).
    pub(super) fn find_peer(&self, id: NodeId) -> Option<Arc<Peer>> {
        self.peers.read().get(&id).cloned()
    }
}

/// The stop signal: a flag, and a channel whose only sender is dropped on stop so that every
/// thread waiting on it (a backoff, an idle queue) wakes at once.
pub(super) struct Stop {
    flag: AtomicBool,
    tx: Mutex<Option<flume::Sender<()>>>,
    rx: flume::Receiver<()>,
}

impl Stop {
    fn new() -> Stop {
        let (tx, rx) = flume::bounded(1);
        Stop { flag: AtomicBool::new(false), tx: Mutex::new(Some(tx)), rx }
    }

    pub(super) fn is_set(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Sets the signal; true for the first caller only.
    fn set(&self) -> bool {
        let first = !self.flag.swap(true, Ordering::AcqRel);
        self.tx.lock().take();
        first
    }

    /// Sleeps up to `dur`; true when stopped (at once if already stopped).
    pub(super) fn wait(&self, dur: Duration) -> bool {
        self.is_set() || matches!(self.rx.recv_timeout(dur), Err(flume::RecvTimeoutError::Disconnected))
    }

    /// Disconnected (a receive returns an error) once stopped; for `flume::Selector`.
    pub(super) fn receiver(&self) -> &flume::Receiver<()> {
        &self.rx
    }
}

/// Every socket a transport thread may block on, so shutdown can shut them down (2) and wake
/// those threads; a socket registered after shutdown is refused.
pub(super) struct Sockets {
    inner: Mutex<SocketsInner>,
}

struct SocketsInner {
    closed: bool,
    next: u64,
    open: HashMap<u64, TcpStream>,
}

/// A registered socket; deregisters on drop.
pub(super) struct Registered<'a> {
    sockets: &'a Sockets,
    pub(super) id: u64,
}

impl Sockets {
    fn new() -> Sockets {
        Sockets { inner: Mutex::new(SocketsInner { closed: false, next: 1, open: HashMap::new() }) }
    }

    /// Registers a clone of `stream`.
    ///
    /// # Errors
    /// [`LinkError::Stopped`] after shutdown, [`LinkError::Io`] if the socket cannot be cloned.
    pub(super) fn register(&self, stream: &TcpStream) -> Result<Registered<'_>, LinkError> {
        let clone = stream.try_clone()?;
        let mut inner = self.inner.lock();
        if inner.closed {
            return Err(LinkError::Stopped);
        }
        let id = inner.next;
        inner.next += 1;
        inner.open.insert(id, clone);
        Ok(Registered { sockets: self, id })
    }

    /// Shuts down (both ways) the socket registered as `id`, if it is still open.
    pub(super) fn shutdown_one(&self, id: u64) {
        if let Some(stream) = self.inner.lock().open.get(&id) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Whether the socket registered as `id` is known to be finished: closed or reset by
    /// the peer, or never registered / gone (`link::check_open`, without blocking).
    pub(super) fn finished(&self, id: u64) -> bool {
        self.inner.lock().open.get(&id).is_none_or(|stream| super::link::check_open(stream).is_err())
    }

    fn close_all(&self) {
        let mut inner = self.inner.lock();
        inner.closed = true;
        for stream in inner.open.values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.sockets.inner.lock().open.remove(&self.id);
    }
}

impl Transport {
    /// [`Transport::start_with_data`] with data callbacks that ignore what they hear: the data
    /// lanes still come up (a peer may use them), their payloads are discarded.
    ///
    /// # Errors
    /// As [`Transport::start_with_data`].
    pub fn start(
        cfg: TransportConfig,
        on_message: Arc<dyn Fn(Message) + Send + Sync>,
        on_report: Arc<dyn Fn(Report) + Send + Sync>,
    ) -> Result<Transport, TransportError> {
        Transport::start_with_data(cfg, on_message, on_report, Arc::new(|_, _| {}), Arc::new(|_, _| {}))
    }

    /// Binds `cfg.listen` and spawns the listener thread and, per peer, a raft-lane writer
    /// thread and a data-lane writer thread (each connects at once and reconnects with a
    /// 100 ms → 1 s backoff) and a snapshot sender thread. `on_message` gets every message
    /// peers send to this node (on a reader thread; blocking in it is backpressure on that
    /// lane); `on_report` gets every [`Report`] (on transport threads, or inside
    /// [`Transport::send`]); `on_data` every data payload ([`OnData`]); `on_link` every change
    /// of a peer's data link ([`OnLink`]).
    ///
    /// # Errors
    /// [`TransportError::Config`] when `me` is 0 or not in `peers`, a peer id is 0,
    /// `queue_capacity` or `data_queue_capacity` is 0, or `snapshot_chunk_bytes` is 0 or above
    /// [`MAX_CHUNK_DATA`](super::frame::MAX_CHUNK_DATA); [`TransportError::Bind`] when the
    /// address is taken or not local; [`TransportError::Spawn`] when a thread cannot start
    /// (what was started is shut down).
    pub fn start_with_data(
        cfg: TransportConfig,
        on_message: Arc<dyn Fn(Message) + Send + Sync>,
        on_report: Arc<dyn Fn(Report) + Send + Sync>,
        on_data: OnData,
        on_link: OnLink,
    ) -> Result<Transport, TransportError> {
        validate(&cfg)?;
        let listener = TcpListener::bind(cfg.listen).map_err(|source| TransportError::Bind { addr: cfg.listen, source })?;
        let local_addr = listener.local_addr().map_err(|source| TransportError::Bind { addr: cfg.listen, source })?;

        let shared = Arc::new(Shared {
            me: cfg.me,
            peers: RwLock::new(BTreeMap::new()),
            on_admin: RwLock::new(None),
            on_message,
            on_report,
            on_data,
            on_link,
            stop: Stop::new(),
            sockets: Sockets::new(),
            chunk_bytes: cfg.snapshot_chunk_bytes,
            queue_capacity: cfg.queue_capacity,
            data_queue_capacity: cfg.data_queue_capacity,
            readers: Mutex::new(Vec::new()),
            inbound: AtomicUsize::new(0),
            inbound_raft: Mutex::new(HashMap::new()),
            snapshots_closed: RwLock::new(false),
        });
        let wake = listener.try_clone().map_err(|source| TransportError::Bind { addr: cfg.listen, source })?;
        let transport = Transport { shared: shared.clone(), local_addr, listener: wake, threads: Mutex::new(Vec::new()) };
        let started = (|| {
            let s = shared.clone();
            transport.spawn("cluster-listen".into(), Box::new(move || inbound::run_listener(s, listener)))?;
            for (&id, &addr) in cfg.peers.iter().filter(|(&id, _)| id != cfg.me) {
                transport.start_peer(id, addr)?;
            }
            Ok(())
        })();
        if let Err(err) = started {
            transport.shutdown();
            return Err(err);
        }
        info!(me = cfg.me, listen = %local_addr, peers = shared.peers.read().len(), "cluster transport started");
        Ok(transport)
    }

    fn spawn(&self, name: String, body: Box<dyn FnOnce() + Send>) -> Result<(), TransportError> {
        match std::thread::Builder::new().name(name.clone()).spawn(body) {
            Ok(handle) => {
                self.threads.lock().push(handle);
                Ok(())
            }
            Err(source) => Err(TransportError::Spawn { name, source }),
        }
    }

    /// Registers peer `id` at `addr` and spawns its raft-lane writer, snapshot sender and
    /// data-lane writer.
    fn start_peer(&self, id: NodeId, addr: SocketAddr) -> Result<(), TransportError> {
        let shared = &self.shared;
        let (raft_tx, raft_rx) = flume::bounded(shared.queue_capacity);
        let (snap_tx, snap_rx) = flume::bounded(SNAPSHOT_QUEUE);
        let (data, data_rx) = DataLink::new(shared.data_queue_capacity);
        let peer = Peer { id, addr, raft_tx, snap_tx, snap_rx: snap_rx.clone(), stats: PeerStats::default(), data };
        shared.peers.write().insert(id, Arc::new(peer));
        let s = shared.clone();
        self.spawn(format!("cluster-raft-{id}"), Box::new(move || outbound::run_raft_writer(s, id, raft_rx)))?;
        let s = shared.clone();
        self.spawn(format!("cluster-snap-{id}"), Box::new(move || outbound::run_snapshot_sender(s, id, snap_rx)))?;
        let s = shared.clone();
        self.spawn(format!("cluster-data-{id}"), Box::new(move || data::run_data_writer(s, id, data_rx)))
    }

    /// Adds peer `id` at `addr` at run time (a node that joined the cluster): its lanes come
    /// up as a starting peer's do. Returns false, changing nothing, when `id` is this node or
    /// a peer already (with another address: logged, the known one kept) or the transport is
    /// shut down.
    ///
    /// # Errors
    /// [`TransportError::Config`] for id 0, [`TransportError::Spawn`] when a thread cannot
    /// start.
    pub fn add_peer(&self, id: NodeId, addr: SocketAddr) -> Result<bool, TransportError> {
        if id == 0 {
            return Err(TransportError::Config("peer id 0 is not a raft-rs node id".into()));
        }
        if id == self.shared.me || self.shared.stop.is_set() {
            return Ok(false);
        }
        if let Some(known) = self.shared.find_peer(id) {
            if known.addr != addr {
                warn!(peer = id, known = %known.addr, given = %addr, "cluster: peer already known at another address; keeping it");
            }
            return Ok(false);
        }
        self.start_peer(id, addr)?;
        info!(peer = id, %addr, "cluster: peer added");
        Ok(true)
    }

    /// Stops talking to peer `id` (a node the group removed): it leaves [`Transport::peers`]
    /// at once, nothing more is sent to it or dialed, its raft messages are refused (the lane
    /// closes), and connections it opens are refused (but on the admin lane). Returns false
    /// when it was no peer.
    pub fn remove_peer(&self, id: NodeId) -> bool {
        let removed = self.shared.peers.write().remove(&id).is_some();
        if removed {
            info!(peer = id, "cluster: peer removed");
        }
        removed
    }

    /// Sets what answers admin requests (`Lane::Admin`, [`super::OnAdmin`]); until then they
    /// are answered with an empty payload.
    pub fn on_admin(&self, f: super::OnAdmin) {
        *self.shared.on_admin.write() = Some(f);
    }

    /// This node's id.
    pub fn me(&self) -> NodeId {
        self.shared.me
    }

    /// The address the listener is bound to (the actual port when `listen` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Queues `msg` for `msg.to`; never blocks.
    ///
    /// A `MsgSnapshot` goes to the peer's snapshot lane and later yields exactly one
    /// [`Report::SnapshotFinished`] or [`Report::SnapshotFailed`] (at once when the snapshot
    /// queue is full or the transport is shut down). Any other message is queued on the raft
    /// lane, or — when the lane is down, the queue (`queue_capacity`) is full, the transport
    /// is shut down, or `to` is no peer — dropped and reported as [`Report::Unreachable`]
    /// (raft-rs's driver contract: the caller then calls `report_unreachable`).
    pub fn send(&self, msg: Message) {
        let to = msg.to;
        let is_snapshot = msg.msg_type == MessageType::MsgSnapshot;
        let Some(peer) = self.shared.find_peer(to) else {
            debug!(to, msg_type = ?msg.msg_type, "cluster: message to an unknown peer dropped");
            self.shared.report(if is_snapshot { Report::SnapshotFailed(to) } else { Report::Unreachable(to) });
            return;
        };
        if is_snapshot {
            let queued = {
                let closed = self.shared.snapshots_closed.read();
                !*closed && peer.snap_tx.try_send(msg).is_ok()
            };
            if !queued {
                warn!(peer = to, "cluster: snapshot not queued (queue full or transport stopped)");
                PeerStats::add(&peer.stats.snapshots_failed, 1);
                self.shared.report(Report::SnapshotFailed(to));
            }
            return;
        }
        let up = peer.stats.connected.load(Ordering::Acquire) && !self.shared.stop.is_set();
        if !up || peer.raft_tx.try_send(msg).is_err() {
            PeerStats::add(&peer.stats.dropped, 1);
            self.shared.report(Report::Unreachable(to));
        }
    }

    /// [`Transport::send`] for each message, in order.
    pub fn send_all(&self, msgs: Vec<Message>) {
        for msg in msgs {
            self.send(msg);
        }
    }

    /// Queues one opaque payload (at most [`MAX_FRAME_BYTES`](super::frame::MAX_FRAME_BYTES)
    /// bytes) for `to`'s data lane; never blocks. The peer's `on_data` gets it once, whole and
    /// in order — unless the lane goes down first (then it is dropped and counted in
    /// [`PeerStatus::data_dropped`]; the `on_link(to, false)` that follows says so).
    ///
    /// # Errors
    /// Nothing is queued on any error: [`DataError::UnknownPeer`] when `to` is no peer,
    /// [`DataError::TooLarge`] for a payload over the frame limit, [`DataError::Down`] when the
    /// outbound data lane to `to` is not up (or the transport is shut down),
    /// [`DataError::Full`] when `data_queue_capacity` payloads are already queued for `to`.
    pub fn send_data(&self, to: NodeId, payload: Vec<u8>) -> Result<(), DataError> {
        let Some(peer) = self.shared.find_peer(to) else { return Err(DataError::UnknownPeer) };
        if self.shared.stop.is_set() {
            return Err(DataError::Down);
        }
        peer.data.send(payload)
    }

    /// Whether the outbound data lane to `to` is up (false for no peer).
    pub fn data_up(&self, to: NodeId) -> bool {
        !self.shared.stop.is_set() && self.shared.find_peer(to).is_some_and(|p| p.data.out_up())
    }

    /// The state of the links to every peer (this node excluded), by id.
    pub fn peers(&self) -> Vec<PeerStatus> {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        self.shared
            .peers
            .read()
            .values()
            .map(|p| PeerStatus {
                id: p.id,
                addr: p.addr,
                connected: p.stats.connected.load(Ordering::Acquire),
                sent: load(&p.stats.sent),
                writes: load(&p.stats.writes),
                dropped: load(&p.stats.dropped),
                snapshots_sent: load(&p.stats.snapshots_sent),
                snapshots_failed: load(&p.stats.snapshots_failed),
                data_up: p.data.out_up(),
                data_link: p.data.link_up(),
                data_sent: load(&p.data.sent),
                data_writes: load(&p.data.writes),
                data_dropped: load(&p.data.dropped),
            })
            .collect()
    }

    /// Stops every thread and closes every socket: the listener stops accepting, links close,
    /// queued raft messages and data payloads are dropped (no reports), queued snapshots are
    /// reported [`Report::SnapshotFailed`], and each data link that was up is reported down
    /// (`on_link(peer, false)`, from the thread that saw it go). Idempotent. Waits up to 1.5 s for the threads (a thread
    /// still inside a callback past that is left to finish on its own, with a warning).
    pub fn shutdown(&self) {
        if !self.shared.stop.set() {
            return;
        }
        self.shared.sockets.close_all();
        // Linux: shutdown(2) on a listening socket makes a blocked accept return EINVAL.
        let _ = socket2::SockRef::from(&self.listener).shutdown(Shutdown::Both);
        let mut handles: Vec<JoinHandle<()>> = std::mem::take(&mut *self.threads.lock());
        handles.append(&mut self.shared.readers.lock());
        // The listener may accept (and spawn) one more reader while stopping; it sees the stop
        // flag and the closed registry, and the second sweep joins it.
        let deadline = Instant::now() + JOIN_TIMEOUT;
        join_all(handles, deadline);
        join_all(std::mem::take(&mut *self.shared.readers.lock()), deadline);

        *self.shared.snapshots_closed.write() = true;
        let peers: Vec<Arc<Peer>> = self.shared.peers.read().values().cloned().collect();
        for peer in peers {
            while peer.snap_rx.try_recv().is_ok() {
                PeerStats::add(&peer.stats.snapshots_failed, 1);
                self.shared.report(Report::SnapshotFailed(peer.id));
            }
        }
        info!(me = self.shared.me, "cluster transport stopped");
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn join_all(handles: Vec<JoinHandle<()>>, deadline: Instant) {
    let current = std::thread::current().id();
    for handle in handles {
        if handle.thread().id() == current {
            continue; // shutdown called from a callback on a transport thread
        }
        while !handle.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        if !handle.is_finished() {
            warn!(thread = handle.thread().name().unwrap_or("?"), "cluster: thread did not stop in time; left detached");
            continue;
        }
        if handle.join().is_err() {
            warn!("cluster: a transport thread panicked");
        }
    }
}

fn validate(cfg: &TransportConfig) -> Result<(), TransportError> {
    let bad = |why: String| Err(TransportError::Config(why));
    if cfg.me == 0 || !cfg.peers.contains_key(&cfg.me) {
        return bad(format!("node id {} must be non-zero and listed in peers", cfg.me));
    }
    if cfg.peers.contains_key(&0) {
        return bad("peer id 0 is not a raft-rs node id".into());
    }
    if cfg.queue_capacity == 0 {
        return bad("queue_capacity must be at least 1".into());
    }
    if cfg.data_queue_capacity == 0 {
        return bad("data_queue_capacity must be at least 1".into());
    }
    if cfg.snapshot_chunk_bytes == 0 || cfg.snapshot_chunk_bytes > MAX_CHUNK_DATA {
        return bad(format!("snapshot_chunk_bytes must be in 1..={MAX_CHUNK_DATA}, not {}", cfg.snapshot_chunk_bytes));
    }
    Ok(())
}
