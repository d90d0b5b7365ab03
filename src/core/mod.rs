//! Thread-per-core glue: one glommio executor per core, the queue registry of each core,
//! and the cross-core inboxes. The only module that knows there are several cores.
//!
//! # Layout
//! - [`start`]: spawns the pinned executors; each core binds the AMQP port with
//!   SO_REUSEPORT, so the kernel spreads connections over cores (accepted by a small
//!   blocking thread per core, see `listen`).
//! - [`Core`]: a core's own state (its queues, its routing copy, its connections).
//! - [`CoreMsg`]: what one core sends another; queue operations travel as
//!   [`QueueOp`]s in [`CoreMsg::Queue`] to the queue's owner core.
//! - [`placement`]: which core owns a queue.
//!
//! # Invariants
//! - A queue's state is only touched on its owner core (`owner_core` in its metadata modulo
//!   the core count).
//! - Operations a queue sends (dead-lettering, auto-delete) go through the owner's inbox,
//!   even on the same core, so a queue never re-enters a queue that is being modified.
//!   Connections call a queue on their own core directly
//!   ([`Core::send_from_connection`]); a connection's operations on one queue run in the
//!   order it sent them either way.
//! - The inbox loop drains up to [`BATCH`] messages per tick: that is the batching of
//!   cross-core messages.
//!
//! # Assumptions
//! A core never blocks: no std::fs on an executor after start-up (the Raft metadata runs
//! on its own thread; shards use io_uring).

pub mod fatal;
pub mod placement;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::{FromRawFd, IntoRawFd};

use glommio::{LocalExecutorBuilder, Placement};

use crate::amqp::error::AmqpError;
use crate::broker::alarms::Alarms;
use crate::broker::queue::{read_index, Queue, QueueCell, QueueEnv, Recovered};
use crate::broker::router::{Route, Router};
use crate::broker::{ClientEvent, ClientTx, ConnId, Mesh, QueueKey, QueueOp, QueueRef};
use crate::config::Config;
use crate::meta::state::Command;
use crate::meta::MetaHandle;
use crate::observe::Stats;

/// Most inbox messages handled per tick before yielding.
pub const BATCH: usize = 1024;

/// Stack of a core thread, bytes (virtual; pages are committed only when touched). The
/// AMQP field-table parser recurses once per nesting level, and a frame of 128 KiB can nest
/// about 26,000 levels: far beyond a default 2 MiB thread stack. Frames that nest deeper
/// than [`crate::amqp::codec::MAX_TABLE_DEPTH`] are refused after parsing.
pub const CORE_STACK_BYTES: usize = 256 << 20;

/// State shared by all cores (Send + Sync).
pub struct Shared {
    /// Effective configuration.
    pub config: Arc<Config>,
    /// The Raft metadata group.
    pub meta: MetaHandle,
    /// Inbox of each core, by core index.
    pub inboxes: Vec<flume::Sender<CoreMsg>>,
    /// Number of cores.
    pub cores: u32,
    next_id: AtomicU64,
    /// Set when shutdown begins.
    pub shutting_down: AtomicBool,
    /// Counters for metrics, one block per core.
    pub stats: Vec<Stats>,
    /// Disk and file-descriptor alarms (`broker::alarms`).
    pub alarms: Arc<Alarms>,
}

impl Shared {
    /// A fresh id for a connection or consumer (unique within this run).
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// A message from one core to another.
pub enum CoreMsg {
    /// An operation for a queue this core owns.
    Queue {
        /// Target queue.
        queue: QueueRef,
        /// What to do.
        op: QueueOp,
    },
    /// The disk alarm was raised (true) or cleared: tell every connection of this core.
    DiskAlarm(bool),
    /// Stop: close connections with 320, sync and close shards, then reply.
    Shutdown {
        /// Answered when this core is done.
        done: flume::Sender<()>,
    },
}

enum Slot {
    Open(QueueCell),
    Opening(Vec<QueueOp>),
    Deleting,
}

/// One core's state. Lives on its executor only (`Rc`).
pub struct Core {
    /// Core index.
    pub id: u32,
    /// Shared state.
    pub shared: Arc<Shared>,
    queues: RefCell<rustc_hash::FxHashMap<QueueKey, Slot>>,
    router: RefCell<Rc<Router>>,
    /// Open connections on this core and their event channels.
    pub conns: RefCell<HashMap<ConnId, ClientTx>>,
    me: RefCell<std::rc::Weak<Core>>,
}

impl Core {
    fn new(id: u32, shared: Arc<Shared>) -> Rc<Core> {
        let router = Router::new(shared.meta.topology(), shared.meta.topology_version(), shared.cores);
        let core = Rc::new(Core {
            id,
            shared,
            queues: RefCell::new(Default::default()),
            router: RefCell::new(Rc::new(router)),
            conns: RefCell::new(HashMap::new()),
            me: RefCell::new(std::rc::Weak::new()),
        });
        *core.me.borrow_mut() = Rc::downgrade(&core);
        core
    }

    /// This core's counters.
    pub fn stats(&self) -> &Stats {
        &self.shared.stats[self.id as usize]
    }

    /// The current routing table (refreshed when the metadata's topology moved).
    pub fn router(&self) -> Rc<Router> {
        let v = self.shared.meta.topology_version();
        if self.router.borrow().version != v {
            let r = Router::new(self.shared.meta.topology(), v, self.shared.cores);
            *self.router.borrow_mut() = Rc::new(r);
        }
        self.router.borrow().clone()
    }

    /// Handles one message; returns the reply channel of a shutdown request, which the
    /// executor's root task carries out.
    fn handle(self: &Rc<Self>, msg: CoreMsg) -> Option<flume::Sender<()>> {
        match msg {
            CoreMsg::Queue { queue, op } => {
                self.queue_op(queue, op);
                None
            }
            CoreMsg::DiskAlarm(raised) => {
                for tx in self.conns.borrow().values() {
                    let _ = tx.send(ClientEvent::DiskAlarm(raised));
                }
                None
            }
            CoreMsg::Shutdown { done } => Some(done),
        }
    }

    fn queue_op(self: &Rc<Self>, qref: QueueRef, op: QueueOp) {
        let mut queues = self.queues.borrow_mut();
        match queues.get_mut(&qref.key) {
            Some(Slot::Open(cell)) => {
                let cell = cell.clone();
                drop(queues);
                self.run_op(&cell, op);
            }
            Some(Slot::Opening(pending)) => pending.push(op),
            Some(Slot::Deleting) => refuse(&qref.key, op),
            None => {
                let topo = self.router();
                let Some(def) = topo.topology.queue(&qref.key.vhost, &qref.key.name).cloned() else {
                    drop(queues);
                    refuse(&qref.key, op);
                    return;
                };
                queues.insert(qref.key.clone(), Slot::Opening(vec![op]));
                drop(queues);
                let me = self.clone();
                let qref = topo.queue_ref(&qref.key.vhost, &qref.key.name).unwrap_or(qref);
                glommio::spawn_local(async move {
                    let opened = me.open_queue(&def, &qref).await;
                    let pending = match me.queues.borrow_mut().remove(&qref.key) {
                        Some(Slot::Opening(p)) => p,
                        _ => Vec::new(),
                    };
                    match opened {
                        Ok((shard, index, recovered)) => {
                            let env: Rc<dyn QueueEnv> = me.clone();
                            let timeout = me.shared.config.consumer_timeout_ms;
                            let cell = Queue::start(def, qref.clone(), shard, index, recovered, timeout, env);
                            me.queues.borrow_mut().insert(qref.key.clone(), Slot::Open(cell.clone()));
                            for op in pending {
                                me.run_op(&cell, op);
                            }
                        }
                        Err(e) => {
                            if e.is_disk_full() {
                                me.shared.alarms.disk_full_seen();
                            }
                            tracing::error!(queue = %qref.key.name, error = %e, "cannot open queue store");
                            let err = if e.is_resource() {
                                AmqpError::resource_error(format!("cannot open the store of queue '{}': {e}", qref.key.name))
                            } else {
                                AmqpError::internal_error(format!("cannot open the store of queue '{}': {e}", qref.key.name))
                            };
                            for op in pending {
                                if matches!(op, QueueOp::Publish { .. }) {
                                    Stats::add(&me.stats().store_refused, 1);
                                }
                                refuse_unstored(op, err.clone());
                            }
                        }
                    }
                })
                .detach();
            }
        }
    }

    /// Opens a queue's message shard and, for a durable queue, its unacked index, and
    /// reads what recovery needs (the committed cursor and the index records).
    async fn open_queue(
        &self,
        def: &crate::meta::state::QueueDef,
        qref: &QueueRef,
    ) -> Result<(ringmq_shards::Shard, Option<ringmq_shards::Shard>, Recovered), ringmq_shards::StoreError> {
        let dir = self.shared.config.queue_dir(def);
        let cfg = || ringmq_shards::ShardConfig { segment_bytes: self.shared.config.segment_bytes, ..Default::default() };
        let (shard, report) = ringmq_shards::Shard::open(&dir.join("messages"), cfg()).await?;
        shard.prepare().await?;
        for (from, to, why) in &report.dropped {
            tracing::warn!(queue = %qref.key.name, from, to, why, "recovery dropped message records");
        }
        if !qref.durable {
            return Ok((shard, None, Recovered::default()));
        }
        let index_cfg = ringmq_shards::ShardConfig { segment_bytes: 4 << 20, cache_bytes: 1 << 20, ..Default::default() };
        let (index, _) = ringmq_shards::Shard::open(&dir.join("unacked"), index_cfg).await?;
        let held = read_index(&index).await?;
        let cursor = self.shared.meta.cursor(&qref.key.vhost, &qref.key.name).unwrap_or(0);
        Ok((shard, Some(index), Recovered { cursor, held }))
    }

    fn run_op(self: &Rc<Self>, cell: &QueueCell, op: QueueOp) {
        match op {
            QueueOp::Delete { if_unused, if_empty, reply } => {
                let checked = cell.borrow().check_delete(if_unused, if_empty);
                match checked {
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                    Ok(n) => {
                        let key = cell.borrow().qref.key.clone();
                        let (shard, index) = cell.borrow_mut().tear_down();
                        let dir = self.shared.config.queue_dir(&cell.borrow().def);
                        self.queues.borrow_mut().insert(key.clone(), Slot::Deleting);
                        let me = self.clone();
                        glommio::spawn_local(async move {
                            let cmd = Command::DeleteQueue { vhost: key.vhost.to_string(), name: key.name.to_string() };
                            if let Err(e) = me.shared.meta.propose(cmd).await {
                                tracing::error!(error = %e, "metadata delete of queue failed");
                            }
                            for shard in [Some(shard), index].into_iter().flatten() {
                                if let Ok(shard) = Rc::try_unwrap(shard) {
                                    if let Err(e) = shard.destroy().await {
                                        tracing::warn!(error = %e, "removing queue files failed");
                                    }
                                }
                            }
                            // The (now empty) queue directory: one small unlink.
                            let _ = std::fs::remove_dir(&dir);
                            me.queues.borrow_mut().remove(&key);
                            let _ = reply.send(Ok(n));
                        })
                        .detach();
                    }
                }
            }
            op => Queue::handle(cell, op),
        }
    }

    async fn shutdown(self: &Rc<Self>) {
        for tx in self.conns.borrow().values() {
            let _ = tx.send(ClientEvent::Close(AmqpError::connection_forced("broker shutdown")));
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while !self.conns.borrow().is_empty() && Instant::now() < deadline {
            glommio::timer::sleep(Duration::from_millis(20)).await;
        }
        for c in self.open_queues() {
            let (shard, index) = (c.borrow().shard.clone(), c.borrow().index.clone());
            for s in [Some(shard), index].into_iter().flatten() {
                if let Err(e) = s.close().await {
                    tracing::error!(error = %e, "closing a shard failed");
                }
            }
        }
    }

    /// Retires a queue whose store failed ([`Queue::retire`]) and closes its shards; the
    /// next operation on it opens it again from disk (what was synced is there).
    async fn reopen_failed(&self, cell: &QueueCell, why: &str) {
        let key = cell.borrow().qref.key.clone();
        tracing::warn!(queue = %key.name, vhost = %key.vhost, reason = why, "reopening a queue whose store failed");
        let (shard, index) = cell.borrow_mut().retire();
        self.queues.borrow_mut().remove(&key);
        for s in [Some(shard), index].into_iter().flatten() {
            let _ = s.close().await;
        }
        Stats::add(&self.stats().store_reopens, 1);
    }

    /// The queues of this core that are open (not opening or being deleted).
    fn open_queues(&self) -> Vec<QueueCell> {
        self.queues.borrow().values().filter_map(|s| if let Slot::Open(c) = s { Some(c.clone()) } else { None }).collect()
    }

    /// Once a second: syncs queues with unsynced deletes, sends every channel that holds
    /// a delivery past its queue's acknowledgement timeout an [`ClientEvent::AckTimeout`],
    /// and reopens queues whose store failed once the disk alarm is clear.
    async fn ack_timeouts(self: Rc<Self>) {
        loop {
            glommio::timer::sleep(Duration::from_secs(1)).await;
            let now = Instant::now();
            for c in self.open_queues() {
                let failure = c.borrow().store_failure();
                if let Some(why) = failure {
                    // Reopened only once writing works again: until then the queue keeps
                    // serving what it holds (a reopen would fail and leave nothing to read).
                    let dir = self.shared.config.queue_dir(&c.borrow().def);
                    if !self.shared.alarms.disk_alarm() && writable(dir).await {
                        self.reopen_failed(&c, &why).await;
                    }
                    continue;
                }
                Queue::sync_if_dirty(&c);
                let q = c.borrow();
                let ms = q.consumer_timeout_ms;
                for h in q.timed_out_holders(now) {
                    let _ = h.tx.send(ClientEvent::AckTimeout { channel: h.channel, chan_uid: h.chan_uid, timeout_ms: ms });
                }
            }
        }
    }
}

/// True when a 4 KiB write and fdatasync of a probe file in `dir` succeed (on the blocking
/// thread): the filesystem takes writes again.
async fn writable(dir: std::path::PathBuf) -> bool {
    glommio::executor()
        .spawn_blocking(move || {
            use std::io::Write;
            let p = dir.join(".write-probe");
            let ok = std::fs::File::create(&p).and_then(|mut f| f.write_all(&[0u8; 4096]).and_then(|_| f.sync_data())).is_ok();
            let _ = std::fs::remove_file(&p);
            ok
        })
        .await
}

/// Answers an operation on a queue that does not exist (any more).
fn refuse(key: &QueueKey, op: QueueOp) {
    refuse_with(op, AmqpError::not_found(format!("no queue '{}' in vhost '{}'", key.name, key.vhost)))
}

fn refuse_with(op: QueueOp, err: AmqpError) {
    match op {
        QueueOp::Publish { confirm: Some(c), .. } => {
            // RabbitMQ confirms a message whose queue vanished while it was routed.
            let _ = c.tx.send(ClientEvent::Stored { channel: c.channel, seq: c.seq, ok: true });
        }
        op => refuse_unstored(op, err),
    }
}

/// Answers an operation on a queue whose store cannot be opened: a publish is nacked
/// (DESIGN.md rule 9: never a confirm for what is not stored), the rest get `err`.
fn refuse_unstored(op: QueueOp, err: AmqpError) {
    match op {
        QueueOp::Publish { confirm: Some(c), .. } => {
            let _ = c.tx.send(ClientEvent::Stored { channel: c.channel, seq: c.seq, ok: false });
        }
        QueueOp::Get { reply, .. } => drop(reply.send(Err(err))),
        QueueOp::Consume { reply, .. } => drop(reply.send(Err(err))),
        QueueOp::Stats { reply } => drop(reply.send(Err(err))),
        QueueOp::Purge { reply } => drop(reply.send(Err(err))),
        QueueOp::Delete { reply, .. } => drop(reply.send(Ok(0))),
        _ => {}
    }
}

impl Core {
    /// Sends `op` from a connection: a queue on this core gets it at once (no inbox hop),
    /// a queue elsewhere through its core's inbox. A connection's operations on one queue
    /// keep their order either way. Never call this from inside a queue (a queue that
    /// dead-letters to itself would re-enter itself): queues use [`Mesh::send`].
    pub fn send_from_connection(self: &Rc<Self>, queue: &QueueRef, op: QueueOp) {
        if queue.owner_core % self.shared.cores == self.id {
            self.queue_op(queue.clone(), op);
        } else {
            self.send(queue, op);
        }
    }
}

impl Mesh for Core {
    fn send(&self, queue: &QueueRef, op: QueueOp) {
        let core = (queue.owner_core % self.shared.cores) as usize;
        if self.shared.inboxes[core].send(CoreMsg::Queue { queue: queue.clone(), op }).is_err() {
            tracing::warn!("core {core} inbox closed (shutting down)");
        }
    }
}

impl QueueEnv for Core {
    fn route(&self, vhost: &str, exchange: &str, routing_key: &str, headers: Option<&amq_protocol::types::FieldTable>) -> Route {
        self.router().route(vhost, exchange, routing_key, headers)
    }

    fn meta(&self) -> &MetaHandle {
        &self.shared.meta
    }

    fn stats(&self) -> &Stats {
        Core::stats(self)
    }

    fn disk_full(&self) {
        self.shared.alarms.disk_full_seen();
    }

    fn auto_delete(&self, key: &QueueKey) {
        let qref = QueueRef { key: key.clone(), owner_core: self.id, durable: false };
        let (reply, _rx) = crate::broker::reply_channel();
        self.send(&qref, QueueOp::Delete { if_unused: true, if_empty: false, reply });
    }
}

/// Waits (up to 10 s) until no other socket listens on `addr`.
///
/// Every core binds with SO_REUSEPORT, which would also let us share the port with a
/// listener that is still alive, for instance one of a killed ringmq whose io_uring the
/// kernel has not torn down yet: the kernel would then hand part of the new connections
/// to that dead listener, and they would be reset. A plain bind (SO_REUSEADDR only) fails
/// while any listener exists, so it tells us when the port is really ours.
fn wait_port_free(addr: std::net::SocketAddr) -> std::io::Result<()> {
    if addr.port() == 0 {
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match std::net::TcpListener::bind(addr) {
            Ok(probe) => {
                drop(probe);
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}"))),
        }
    }
}

/// Binds core `core`'s listening socket on `addr` (SO_REUSEPORT, so the kernel spreads
/// connections over the cores' sockets) and starts its accept thread, which hands each
/// accepted connection to the core through the returned channel.
///
/// Accepting happens on a plain thread with accept(2), not through io_uring: a listening
/// socket with an accept pending in an io_uring outlives a killed process until the kernel
/// tears the ring down (seen here taking over 10 s after kill -9 under load), and with
/// SO_REUSEPORT a restarted broker would share the port with it and see connections reset.
fn listen(core: usize, addr: std::net::SocketAddr, alarms: Arc<Alarms>) -> std::io::Result<flume::Receiver<std::net::TcpStream>> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    let listener: std::net::TcpListener = socket.into();
    let (tx, rx) = flume::unbounded();
    let mut last_warned: Option<Instant> = None;
    std::thread::Builder::new().name(format!("ringmq-accept-{core}")).spawn(move || loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                if alarms.refuse_connections() {
                    // Descriptors are nearly gone: keep them for the connections and queues
                    // there are (RabbitMQ's file-descriptor limit). The client sees the
                    // socket closed before the protocol header.
                    if last_warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                        let (open, max) = (alarms.open_fds.load(Ordering::Relaxed), alarms.max_fds.load(Ordering::Relaxed));
                        tracing::warn!(%peer, open_fds = open, max_fds = max, "connection refused: file descriptors nearly exhausted");
                        last_warned = Some(Instant::now());
                    }
                    alarms.connections_refused.fetch_add(1, Ordering::Relaxed);
                    drop(stream);
                    continue;
                }
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                if tx.send(stream).is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    })?;
    Ok(rx)
}

/// Runs the broker: starts `config.cores` executors and blocks until they stop.
///
/// `shutdown` fires when the process should stop (SIGINT/SIGTERM).
///
/// # Errors
/// Fails when an executor cannot start or the AMQP port cannot be bound.
pub fn start(config: Arc<Config>, meta: MetaHandle, shutdown: flume::Receiver<()>) -> std::io::Result<()> {
    let cores = config.cores.max(1);
    wait_port_free(config.listen)?;
    let mut inboxes = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..cores {
        let (tx, rx) = flume::unbounded();
        inboxes.push(tx);
        receivers.push(rx);
    }
    let alarms = Arc::new(Alarms::new(config.disk_free_limit));
    let (soft_before, soft, hard) = crate::broker::alarms::raise_fd_limit();
    alarms.max_fds.store(soft, Ordering::Relaxed);
    if soft < 4096 {
        tracing::warn!(
            soft_before,
            soft,
            hard,
            "open-files limit is low: each durable queue holds 2 descriptors or more; raise the hard limit (LimitNOFILE=) for many queues"
        );
    } else {
        tracing::info!(soft_before, soft, hard, "open-files limit raised to the hard limit");
    }
    let shared = Arc::new(Shared {
        config: config.clone(),
        meta,
        inboxes,
        cores,
        next_id: AtomicU64::new(1),
        shutting_down: AtomicBool::new(false),
        stats: (0..cores).map(|_| Stats::default()).collect(),
        alarms: alarms.clone(),
    });
    {
        let inboxes = shared.inboxes.clone();
        crate::broker::alarms::start_monitor(alarms, config.data_dir.clone(), move |raised| {
            for inbox in &inboxes {
                let _ = inbox.send(CoreMsg::DiskAlarm(raised));
            }
        })?;
    }
    crate::observe::serve_metrics(config.metrics_listen, shared.clone());
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut handles = Vec::new();
    for (i, rx) in receivers.into_iter().enumerate() {
        let shared = shared.clone();
        let accepted = listen(i, config.listen, shared.alarms.clone())?;
        let placement = if (cores as usize) <= cpus { Placement::Fixed(i) } else { Placement::Unbound };
        let name = format!("ringmq-core-{i}");
        let h = std::thread::Builder::new().name(name.clone()).stack_size(CORE_STACK_BYTES).spawn(move || {
            let mut builder = LocalExecutorBuilder::new(placement).name(&name);
            if shared.config.spin_before_park_us > 0 {
                builder = builder.spin_before_park(Duration::from_micros(shared.config.spin_before_park_us));
            }
            let ex = match builder.make() {
                Ok(ex) => ex,
                Err(e) => crate::core::fatal::fatal(&format!("cannot start executor {name}: {e}")),
            };
            ex.run(async move {
                let core = Core::new(i as u32, shared.clone());
                let inbox = {
                    let core = core.clone();
                    glommio::spawn_local(async move {
                        while let Ok(msg) = rx.recv_async().await {
                            if let Some(done) = core.handle(msg) {
                                return Some(done);
                            }
                            for _ in 0..BATCH {
                                match rx.try_recv() {
                                    Ok(m) => {
                                        if let Some(done) = core.handle(m) {
                                            return Some(done);
                                        }
                                    }
                                    Err(_) => break,
                                }
                            }
                            glommio::yield_if_needed().await;
                        }
                        None
                    })
                };
                glommio::spawn_local(core.clone().ack_timeouts()).detach();
                let accept = {
                    let core = core.clone();
                    glommio::spawn_local(async move {
                        while let Ok(stream) = accepted.recv_async().await {
                            if core.shared.shutting_down.load(Ordering::Relaxed) {
                                continue;
                            }
                            // SAFETY: the fd comes from a std TcpStream we own and give up here.
                            let stream = unsafe { glommio::net::TcpStream::from_raw_fd(stream.into_raw_fd()) };
                            glommio::spawn_local(crate::amqp::connection::serve(core.clone(), stream)).detach();
                        }
                    })
                };
                if let Some(done) = inbox.await {
                    drop(accept);
                    core.shutdown().await;
                    let _ = done.send(());
                }
            })
        })?;
        handles.push(h);
    }
    tracing::info!(
        "ringmq ready: AMQP 0-9-1 on {}, {} core{}, data in {}, metrics on http://{}/metrics",
        config.listen,
        cores,
        if cores == 1 { "" } else { "s" },
        config.data_dir.display(),
        config.metrics_listen
    );
    let _ = shutdown.recv();
    tracing::info!("shutting down");
    shared.shutting_down.store(true, Ordering::Relaxed);
    let (done_tx, done_rx) = flume::unbounded();
    for inbox in &shared.inboxes {
        let _ = inbox.send(CoreMsg::Shutdown { done: done_tx.clone() });
    }
    for _ in 0..cores {
        let _ = done_rx.recv_timeout(Duration::from_secs(10));
    }
    shared.meta.shutdown();
    tracing::info!("ringmq stopped");
    // Executors may still hold sockets of clients that ignored connection.close; the
    // process exits right after this returns, which closes them.
    drop(handles);
    Ok(())
}
