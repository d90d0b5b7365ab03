//! The Raft driver thread and [`MetaHandle`].
//!
//! One dedicated `std::thread` ("ringmq-meta") owns the `RawNode<DiskStorage>` and runs the
//! raft-rs Ready loop; everything else talks to it through a flume channel. Handles are
//! `Send + Sync + Clone` and their `async` methods are runtime-agnostic (flume futures), so any
//! glommio executor can await them; the driver wakes the awaiting task from its own thread.
//!
//! # The driver loop (one iteration, in this order)
//! 1. Wait for a request, at most until the next tick (100 ms); then drain every request already
//!    waiting (at most `MAX_DRAIN`).
//! 2. Tick raft-rs when 100 ms have passed.
//! 3. Group commit: encode all drained commands into one entry (a new entry only past
//!    `MAX_ENTRY_BYTES`), propose it with a 16-byte context (driver nonce, batch sequence) that
//!    finds its waiters when it is applied.
//! 4. Ready loop, raft-rs's steps: install a received snapshot; apply committed entries; write
//!    new entries and the HardState in one write, one fdatasync when `must_sync`; advance; record
//!    the commit index; apply the newly committed entries; advance apply.
//! 5. Applying an entry locks the state, applies each command, bumps the topology version when
//!    the topology changed, unlocks, then resolves the entry's waiters with their outcomes (in
//!    proposal order).
//! 6. Compact when the log passed 10,000 entries or 16 MiB (storage.rs).
//!
//! # Adding voters
//! The group configuration is raft-rs's `ConfState`, persisted in the log and the snapshot;
//! ConfChange entries are applied in step 4. What a cluster adds: a transport that delivers
//! `Ready::messages` / `persisted_messages` to peers and `RawNode::step`s the incoming ones
//! (both points are marked `TRANSPORT` below), and forwarding of proposals to the leader
//! (today a non-leader answers [`MetaError::NotLeader`]).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use protobuf::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeV2, Entry, EntryType};
use raft::{Config, RawNode, StateRole};

use super::state::{decode_batch, encode_batch, Command, MetaState, NodeId, Outcome, Topology};
use super::storage::DiskStorage;
use super::{Counters, MetaConfig, MetaError, MetaStats};

/// Raft logical clock period.
const TICK: Duration = Duration::from_millis(100);
/// Most requests drained from the channel per loop iteration.
const MAX_DRAIN: usize = 16_384;
/// A new entry is started once the current one's data passes this size (bytes).
pub const MAX_ENTRY_BYTES: usize = 1 << 20;
/// Most Ready rounds handled per loop iteration (each round needs fresh raft-rs work).
const MAX_READY_ROUNDS: usize = 64;
/// How long `start` waits for the driver to become leader (single voter: immediate).
const START_TIMEOUT: Duration = Duration::from_secs(30);

enum Request {
    Propose { cmds: Vec<Command>, reply: flume::Sender<Result<Vec<Outcome>, MetaError>> },
    Shutdown { done: flume::Sender<()> },
}

/// State shared by the driver thread and every handle.
struct Shared {
    node: NodeId,
    /// The state machine; the driver locks it per applied entry, readers briefly.
    state: Mutex<MetaState>,
    /// Bumped (under the `state` lock) whenever an applied entry changed the topology.
    version: AtomicU64,
    /// Last published topology and the version it was built at (built lazily by readers).
    topo_cache: Mutex<(u64, Arc<Topology>)>,
    /// raft-rs's current leader id (0: none known).
    leader: AtomicU64,
    boot_epoch: AtomicU64,
    counters: Arc<Counters>,
    /// Set by `shutdown` and on a fatal driver error.
    stopped: AtomicBool,
    /// The fatal error that stopped the driver, if any.
    failure: Mutex<Option<String>>,
}

impl Shared {
    fn stopped_error(&self) -> MetaError {
        match &*self.failure.lock() {
            Some(why) => MetaError::Failed(why.clone()),
            None => MetaError::Stopped,
        }
    }
}

/// Handle to the metadata group: cheap to clone, `Send + Sync`, usable from every executor.
#[derive(Clone)]
pub struct MetaHandle {
    shared: Arc<Shared>,
    tx: flume::Sender<Request>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl std::fmt::Debug for MetaHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaHandle")
            .field("node", &self.shared.node)
            .field("leader", &self.shared.leader.load(Ordering::Relaxed))
            .field("topology_version", &self.topology_version())
            .finish()
    }
}

impl MetaHandle {
    /// Starts the Raft node on a dedicated thread: replays `dir` (created when missing; a torn
    /// log tail is truncated with a warning), becomes leader (single voter: campaigns at once),
    /// applies `NodeBoot { node }` and returns. Blocks the calling thread (call it before the
    /// executors start, or from a plain thread).
    ///
    /// Errors: [`MetaError::Io`], [`MetaError::CorruptLog`], [`MetaError::CorruptSnapshot`],
    /// [`MetaError::CorruptEntry`], [`MetaError::Raft`] (node id 0, raft-rs refusing the stored
    /// state), [`MetaError::NotLeader`] (no leader within 30 s: only in a multi-voter group).
    pub fn start(dir: &Path, node: NodeId) -> Result<MetaHandle, MetaError> {
        Self::start_with(dir, node, MetaConfig::default())
    }

    /// [`MetaHandle::start`] with explicit tunables.
    pub fn start_with(dir: &Path, node: NodeId, config: MetaConfig) -> Result<MetaHandle, MetaError> {
        if node == 0 {
            return Err(MetaError::Raft("node id 0 is reserved by raft-rs".into()));
        }
        let counters = Arc::new(Counters::default());
        let shared = Arc::new(Shared {
            node,
            state: Mutex::new(MetaState::default()),
            version: AtomicU64::new(0),
            topo_cache: Mutex::new((u64::MAX, Arc::new(Topology::default()))),
            leader: AtomicU64::new(0),
            boot_epoch: AtomicU64::new(0),
            counters: counters.clone(),
            stopped: AtomicBool::new(false),
            failure: Mutex::new(None),
        });
        let (tx, rx) = flume::bounded::<Request>(1 << 16);
        let (init_tx, init_rx) = flume::bounded::<Result<(), MetaError>>(1);
        let dir = dir.to_owned();
        let drv_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ringmq-meta".into())
            .spawn(move || {
                let mut driver = match Driver::open(&dir, drv_shared.clone(), rx, counters, config) {
                    Ok(d) => d,
                    Err(e) => {
                        drv_shared.stopped.store(true, Ordering::Release);
                        let _ = init_tx.send(Err(e));
                        return;
                    }
                };
                match driver.become_leader() {
                    Ok(()) => {
                        let _ = init_tx.send(Ok(()));
                    }
                    Err(e) => {
                        drv_shared.stopped.store(true, Ordering::Release);
                        let _ = init_tx.send(Err(e));
                        return;
                    }
                }
                driver.run();
            })
            .map_err(|e| MetaError::Raft(format!("spawn the metadata thread: {e}")))?;
        let handle = MetaHandle { shared, tx, thread: Arc::new(Mutex::new(Some(thread))) };
        match init_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                handle.join();
                return Err(e);
            }
            Err(_) => {
                handle.join();
                return Err(MetaError::Failed("metadata thread exited during start".into()));
            }
        }
        match handle.propose_blocking(vec![Command::NodeBoot { node }]) {
            Ok(outcomes) => match outcomes.first() {
                Some(Outcome::Epoch(epoch)) => {
                    handle.shared.boot_epoch.store(*epoch, Ordering::Release);
                    tracing::info!(node, epoch, "metadata group started");
                    Ok(handle)
                }
                other => {
                    handle.shutdown();
                    Err(MetaError::Raft(format!("NodeBoot gave {other:?}")))
                }
            },
            Err(e) => {
                handle.shutdown();
                Err(e)
            }
        }
    }

    /// Proposes one command; resolves after its entry is fdatasync'ed, committed and applied,
    /// with the command's [`Outcome`]. Commands waiting together share one Raft entry and one
    /// fdatasync (group commit). Dropping the future does not withdraw the command: once sent it
    /// is applied, only its outcome is lost. Errors: [`MetaError::Stopped`],
    /// [`MetaError::Failed`], [`MetaError::NotLeader`].
    pub async fn propose(&self, cmd: Command) -> Result<Outcome, MetaError> {
        let mut out = self.propose_batch(vec![cmd]).await?;
        out.pop().ok_or_else(|| MetaError::Raft("empty outcome list".into()))
    }

    /// Proposes several commands in one entry, applied in order with nothing in between; the
    /// outcomes come back in the same order. Errors as [`MetaHandle::propose`].
    pub async fn propose_batch(&self, cmds: Vec<Command>) -> Result<Vec<Outcome>, MetaError> {
        if cmds.is_empty() {
            return Ok(Vec::new());
        }
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(self.shared.stopped_error());
        }
        let (reply, rx) = flume::bounded(1);
        if self.tx.send_async(Request::Propose { cmds, reply }).await.is_err() {
            return Err(self.shared.stopped_error());
        }
        match rx.recv_async().await {
            Ok(r) => r,
            Err(_) => Err(self.shared.stopped_error()),
        }
    }

    /// [`MetaHandle::propose_batch`] for plain threads: blocks the calling thread. Never call it
    /// on a glommio executor.
    pub fn propose_blocking(&self, cmds: Vec<Command>) -> Result<Vec<Outcome>, MetaError> {
        if cmds.is_empty() {
            return Ok(Vec::new());
        }
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(self.shared.stopped_error());
        }
        let (reply, rx) = flume::bounded(1);
        if self.tx.send(Request::Propose { cmds, reply }).is_err() {
            return Err(self.shared.stopped_error());
        }
        match rx.recv() {
            Ok(r) => r,
            Err(_) => Err(self.shared.stopped_error()),
        }
    }

    /// The current topology: an `Arc` clone under a short lock. Rebuilt (one clone of the
    /// topology) only on the first call after a change. A proposal that changed the topology
    /// is visible here before that proposal resolves.
    pub fn topology(&self) -> Arc<Topology> {
        let mut cache = self.shared.topo_cache.lock();
        if cache.0 == self.shared.version.load(Ordering::Acquire) {
            return cache.1.clone();
        }
        let state = self.shared.state.lock();
        // Read under the state lock: the driver bumps the version while holding it.
        let version = self.shared.version.load(Ordering::Acquire);
        let topo = Arc::new(state.topology.clone());
        drop(state);
        *cache = (version, topo.clone());
        topo
    }

    /// Topology version: bumps on every applied topology change (cursor writes do not bump it).
    /// Cores poll it and refresh their routing copy when it moved.
    pub fn topology_version(&self) -> u64 {
        self.shared.version.load(Ordering::Acquire)
    }

    /// The committed cursor of queue `queue` in `vhost` (a queue offset); `None` when the queue
    /// does not exist.
    pub fn cursor(&self, vhost: &str, queue: &str) -> Option<u64> {
        self.shared.state.lock().cursor(vhost, queue)
    }

    /// Runs `f` on the current state under its lock (keep `f` short: it blocks the driver).
    pub fn with_state<R>(&self, f: impl FnOnce(&MetaState) -> R) -> R {
        f(&self.shared.state.lock())
    }

    /// True when raft-rs's current leader id equals this node's id (DESIGN.md, "Leader check").
    pub fn is_leader(&self) -> bool {
        self.shared.leader.load(Ordering::Acquire) == self.shared.node
    }

    /// The current leader as raft-rs reports it; `None` when unknown.
    pub fn leader_id(&self) -> Option<NodeId> {
        match self.shared.leader.load(Ordering::Acquire) {
            0 => None,
            id => Some(id),
        }
    }

    /// This node's Raft id.
    pub fn node_id(&self) -> NodeId {
        self.shared.node
    }

    /// This node's boot epoch after `start` (1 on the first start in a data directory, then +1
    /// per restart).
    pub fn boot_epoch(&self) -> u64 {
        self.shared.boot_epoch.load(Ordering::Acquire)
    }

    /// Counters since start.
    pub fn stats(&self) -> MetaStats {
        self.shared.counters.stats()
    }

    /// Stops the driver after it has handled every request already queued and synced the log,
    /// then joins its thread. Idempotent; later proposals fail with [`MetaError::Stopped`].
    /// Blocks the calling thread for at most one Ready round.
    pub fn shutdown(&self) {
        self.shared.stopped.store(true, Ordering::Release);
        let (done, rx) = flume::bounded(1);
        if self.tx.send(Request::Shutdown { done }).is_ok() {
            let _ = rx.recv();
        }
        self.join();
    }

    fn join(&self) {
        let thread = self.thread.lock().take();
        if let Some(t) = thread {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// Requests drained in one loop iteration, packed into entries.
struct Waiter {
    /// How many of the entry's commands (consecutive, in order) are this waiter's.
    count: usize,
    reply: flume::Sender<Result<Vec<Outcome>, MetaError>>,
}

struct PendingEntry {
    cmds: Vec<Command>,
    waiters: Vec<Waiter>,
    bytes_estimate: usize,
}

struct Driver {
    raw: RawNode<DiskStorage>,
    shared: Arc<Shared>,
    rx: flume::Receiver<Request>,
    counters: Arc<Counters>,
    /// Identifies this driver's proposals in entry contexts (differs across restarts).
    nonce: u64,
    next_seq: u64,
    /// Waiters per proposed entry, by batch sequence.
    in_flight: HashMap<u64, Vec<Waiter>>,
    last_tick: Instant,
    /// No compaction before this instant (set after a failed one).
    compact_after: Option<Instant>,
    shutdown_done: Vec<flume::Sender<()>>,
}

impl Driver {
    fn open(
        dir: &Path,
        shared: Arc<Shared>,
        rx: flume::Receiver<Request>,
        counters: Arc<Counters>,
        meta_config: MetaConfig,
    ) -> Result<Driver, MetaError> {
        let node = shared.node;
        let (mut store, rec) = DiskStorage::open(dir, counters.clone())?;
        store.set_compaction(meta_config.compact_entries, meta_config.compact_bytes);
        if rec.fresh || store.conf_state().voters.is_empty() && store.conf_state().learners.is_empty() {
            // A new single-voter group. (A node joining a cluster would start empty instead and
            // wait for the leader's snapshot: TRANSPORT.)
            let cs = raft::eraftpb::ConfState { voters: vec![node], ..Default::default() };
            store.set_conf_state(cs)?;
        }
        let applied = store.snapshot_index();
        if let Some(state) = rec.state {
            *shared.state.lock() = state;
        }
        tracing::debug!(node, snapshot_index = applied, log_entries = rec.entries, torn_bytes = rec.torn_bytes, "metadata log replayed");
        let config = Config {
            id: node,
            election_tick: 10,
            heartbeat_tick: 1,
            applied,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            pre_vote: true,
            ..Config::default()
        };
        config.validate().map_err(|e| MetaError::Raft(e.to_string()))?;
        let logger = slog::Logger::root(TracingDrain, slog::o!("raft_id" => node));
        let raw = RawNode::new(&config, store, &logger).map_err(|e| MetaError::Raft(e.to_string()))?;
        let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
            ^ (u64::from(std::process::id()) << 32);
        Ok(Driver {
            raw,
            shared,
            rx,
            counters,
            nonce,
            next_seq: 1,
            in_flight: HashMap::new(),
            last_tick: Instant::now(),
            compact_after: None,
            shutdown_done: Vec::new(),
        })
    }

    /// Campaigns (single voter: wins at once) and runs Ready rounds until this node leads.
    fn become_leader(&mut self) -> Result<(), MetaError> {
        let single_voter = {
            let cs = self.raw.store().conf_state();
            cs.voters == [self.shared.node] && cs.voters_outgoing.is_empty()
        };
        if single_voter {
            self.raw.campaign().map_err(|e| MetaError::Raft(e.to_string()))?;
        }
        let deadline = Instant::now() + START_TIMEOUT;
        // Bounded: one round per tick until the deadline.
        while Instant::now() < deadline {
            self.on_ready()?;
            if self.raw.raft.state == StateRole::Leader {
                // Apply everything committed so far (the leader's no-op commits the old log).
                self.on_ready()?;
                return Ok(());
            }
            std::thread::sleep(TICK);
            self.raw.tick();
        }
        Err(MetaError::NotLeader { leader: self.leader() })
    }

    fn leader(&self) -> Option<NodeId> {
        match self.raw.raft.leader_id {
            0 => None,
            id => Some(id),
        }
    }

    fn run(&mut self) {
        if let Err(e) = self.run_loop() {
            let why = e.to_string();
            tracing::error!(error = %why, "metadata driver stopped on a fatal error");
            *self.shared.failure.lock() = Some(why.clone());
            self.shared.stopped.store(true, Ordering::Release);
            for (_, waiters) in self.in_flight.drain() {
                for w in waiters {
                    let _ = w.reply.send(Err(MetaError::Failed(why.clone())));
                }
            }
            // Fail whatever is still queued (bounded by the channel's capacity).
            let queued: Vec<Request> = self.rx.drain().collect();
            for req in queued {
                match req {
                    Request::Propose { reply, .. } => {
                        let _ = reply.send(Err(MetaError::Failed(why.clone())));
                    }
                    Request::Shutdown { done } => self.shutdown_done.push(done),
                }
            }
        }
        for done in self.shutdown_done.drain(..) {
            let _ = done.send(());
        }
    }

    fn run_loop(&mut self) -> Result<(), MetaError> {
        let mut stopping = false;
        // Runs until a Shutdown request or until every handle is dropped.
        loop {
            let wait = TICK.saturating_sub(self.last_tick.elapsed());
            let mut batch = Vec::new();
            match self.rx.recv_timeout(wait) {
                Ok(req) => {
                    stopping |= self.take(req, &mut batch);
                    for _ in 0..MAX_DRAIN {
                        match self.rx.try_recv() {
                            Ok(req) => stopping |= self.take(req, &mut batch),
                            Err(_) => break,
                        }
                    }
                }
                Err(flume::RecvTimeoutError::Timeout) => {}
                Err(flume::RecvTimeoutError::Disconnected) => stopping = true,
            }
            if self.last_tick.elapsed() >= TICK {
                self.raw.tick();
                self.last_tick = Instant::now();
            }
            self.propose_entries(batch);
            self.on_ready()?;
            if self.raw.store().wants_compaction() && self.compact_after.is_none_or(|t| Instant::now() >= t) {
                let state = self.shared.state.lock().clone();
                // A failed compaction (no disk space for the snapshot or the new log) leaves
                // the old log in use, consistent with memory: retried later, not fatal.
                match self.raw.mut_store().compact(&state) {
                    Ok(()) => self.compact_after = None,
                    Err(e) => {
                        tracing::warn!(error = %e, "metadata compaction failed; retried in 10 s");
                        self.compact_after = Some(Instant::now() + Duration::from_secs(10));
                    }
                }
            }
            if stopping {
                // Requests sent before `stopped` was visible are still served.
                let mut batch = Vec::new();
                let queued: Vec<Request> = self.rx.drain().collect();
                for req in queued {
                    self.take(req, &mut batch);
                }
                self.propose_entries(batch);
                self.on_ready()?;
                self.raw.mut_store().flush()?;
                for (_, waiters) in self.in_flight.drain() {
                    for w in waiters {
                        let _ = w.reply.send(Err(MetaError::Stopped));
                    }
                }
                return Ok(());
            }
        }
    }

    /// Files one request into the batch; returns true for a shutdown request.
    fn take(&mut self, req: Request, batch: &mut Vec<PendingEntry>) -> bool {
        match req {
            Request::Shutdown { done } => {
                self.shutdown_done.push(done);
                true
            }
            Request::Propose { cmds, reply } => {
                self.counters.proposals.add(1);
                let estimate: usize = cmds.iter().map(estimate_bytes).sum();
                let start_new = match batch.last() {
                    None => true,
                    Some(e) => e.bytes_estimate + estimate > MAX_ENTRY_BYTES,
                };
                if start_new {
                    batch.push(PendingEntry { cmds: Vec::new(), waiters: Vec::new(), bytes_estimate: 0 });
                }
                if let Some(entry) = batch.last_mut() {
                    entry.waiters.push(Waiter { count: cmds.len(), reply });
                    entry.cmds.extend(cmds);
                    entry.bytes_estimate += estimate;
                }
                false
            }
        }
    }

    /// Proposes each pending entry to raft-rs (all reach the disk in the next Ready).
    fn propose_entries(&mut self, batch: Vec<PendingEntry>) {
        for entry in batch {
            if self.raw.raft.state != StateRole::Leader {
                let leader = self.leader();
                for w in entry.waiters {
                    let _ = w.reply.send(Err(MetaError::NotLeader { leader }));
                }
                continue;
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            let mut ctx = Vec::with_capacity(16);
            ctx.extend_from_slice(&self.nonce.to_le_bytes());
            ctx.extend_from_slice(&seq.to_le_bytes());
            let mut data = Vec::with_capacity(entry.bytes_estimate + 8);
            encode_batch(entry.cmds.len(), &entry.cmds, &mut data);
            // The entry's record (and its HardState) must find disk blocks: on a full disk the
            // proposal is refused here, before raft-rs takes it.
            if let Err(e) = self.raw.mut_store().reserve_log(data.len() as u64 + ctx.len() as u64 + 128) {
                tracing::warn!(error = %e, "metadata proposal refused: disk full");
                for w in entry.waiters {
                    let _ = w.reply.send(Err(match &e {
                        MetaError::DiskFull { path, bytes } => MetaError::DiskFull { path: path.clone(), bytes: *bytes },
                        other => MetaError::Raft(other.to_string()),
                    }));
                }
                continue;
            }
            match self.raw.propose(ctx, data) {
                Ok(()) => {
                    self.in_flight.insert(seq, entry.waiters);
                }
                Err(e) => {
                    let leader = self.leader();
                    tracing::warn!(error = %e, "metadata proposal dropped by raft");
                    for w in entry.waiters {
                        let _ = w.reply.send(Err(match e {
                            raft::Error::ProposalDropped => MetaError::NotLeader { leader },
                            ref e => MetaError::Raft(e.to_string()),
                        }));
                    }
                }
            }
        }
    }

    /// raft-rs's Ready handling (module doc, step 4), repeated while raft-rs has work.
    fn on_ready(&mut self) -> Result<(), MetaError> {
        for _ in 0..MAX_READY_ROUNDS {
            if !self.raw.has_ready() {
                break;
            }
            let mut rd = self.raw.ready();
            // TRANSPORT: rd.take_messages() go to peers here. A single voter has none.
            if !rd.messages().is_empty() {
                tracing::trace!(n = rd.messages().len(), "raft messages dropped (no transport)");
            }
            if !rd.snapshot().is_empty() {
                let state = self.raw.mut_store().install_snapshot(rd.snapshot())?;
                let mut st = self.shared.state.lock();
                *st = state;
                self.shared.version.fetch_add(1, Ordering::AcqRel);
            }
            let committed = rd.take_committed_entries();
            self.apply_entries(committed)?;
            let entries = rd.take_entries();
            let hs = rd.hs().cloned();
            let sync = rd.must_sync();
            self.raw.mut_store().append(&entries, hs.as_ref(), sync)?;
            // TRANSPORT: rd.take_persisted_messages() go to peers here.
            let mut light = self.raw.advance(rd);
            if let Some(commit) = light.commit_index() {
                self.raw.mut_store().set_commit(commit);
            }
            let committed = light.take_committed_entries();
            self.apply_entries(committed)?;
            self.raw.advance_apply();
        }
        self.shared.leader.store(self.raw.raft.leader_id, Ordering::Release);
        Ok(())
    }

    /// Applies committed entries to the state and resolves their waiters (module doc, step 5).
    fn apply_entries(&mut self, entries: Vec<Entry>) -> Result<(), MetaError> {
        for e in entries {
            match e.get_entry_type() {
                EntryType::EntryNormal => self.apply_normal(&e)?,
                EntryType::EntryConfChange | EntryType::EntryConfChangeV2 => {
                    let bad = |err: protobuf::ProtobufError| MetaError::Raft(format!("conf change: {err}"));
                    let applied = if e.get_entry_type() == EntryType::EntryConfChange {
                        let cc = ConfChange::parse_from_bytes(&e.data).map_err(bad)?;
                        self.raw.apply_conf_change(&cc)
                    } else {
                        let cc = ConfChangeV2::parse_from_bytes(&e.data).map_err(bad)?;
                        self.raw.apply_conf_change(&cc)
                    };
                    let cs = applied.map_err(|err| MetaError::Raft(format!("apply conf change: {err}")))?;
                    self.raw.mut_store().set_conf_state(cs)?;
                    self.shared.state.lock().applied_index = e.index;
                }
            }
        }
        Ok(())
    }

    fn apply_normal(&mut self, e: &Entry) -> Result<(), MetaError> {
        if e.data.is_empty() {
            // A new leader's no-op.
            self.shared.state.lock().applied_index = e.index;
            return Ok(());
        }
        let cmds = decode_batch(&e.data).map_err(|source| MetaError::CorruptEntry { index: e.index, source })?;
        let mut outcomes = Vec::with_capacity(cmds.len());
        {
            let mut st = self.shared.state.lock();
            let mut changed = false;
            for cmd in &cmds {
                let o = st.apply(cmd);
                changed |= cmd.changed_topology(&o);
                outcomes.push(o);
            }
            st.applied_index = e.index;
            if changed {
                self.shared.version.fetch_add(1, Ordering::AcqRel);
            }
        }
        self.counters.commands_applied.add(cmds.len() as u64);
        let ctx: &[u8] = &e.context;
        if ctx.len() == 16 && ctx[..8] == self.nonce.to_le_bytes() {
            let seq = u64::from_le_bytes(ctx[8..].try_into().unwrap_or_default());
            if let Some(waiters) = self.in_flight.remove(&seq) {
                let mut rest = outcomes.into_iter();
                for w in waiters {
                    let mine: Vec<Outcome> = rest.by_ref().take(w.count).collect();
                    let _ = w.reply.send(Ok(mine));
                }
            }
        }
        Ok(())
    }
}

/// Rough encoded size of a command (bytes), to bound entry sizes.
fn estimate_bytes(cmd: &Command) -> usize {
    match cmd {
        Command::CursorCas { vhost, queue, .. } => 24 + vhost.len() + queue.len(),
        Command::DeclareVhost { name } => 8 + name.len(),
        Command::DeleteExchange { vhost, name, .. } | Command::DeleteQueue { vhost, name } => 8 + vhost.len() + name.len(),
        Command::NodeBoot { .. } => 12,
        // Definitions carry field tables; a generous flat guess keeps this cheap.
        Command::DeclareExchange(d) => 64 + d.vhost.len() + d.name.len() + 32 * d.arguments.inner().len(),
        Command::DeclareQueue(d) => 64 + d.vhost.len() + d.name.len() + 32 * d.arguments.inner().len(),
        Command::Bind(b) | Command::Unbind(b) => {
            64 + b.vhost.len() + b.source.len() + b.dest.len() + b.routing_key.len() + 32 * b.arguments.inner().len()
        }
    }
}

/// Forwards raft-rs's slog records to `tracing` (target `ringmq::meta::raft`); raft-rs's info
/// lines (elections, role changes) become debug events.
struct TracingDrain;

struct KvText(String);

impl slog::Serializer for KvText {
    fn emit_arguments(&mut self, key: slog::Key, val: &std::fmt::Arguments<'_>) -> slog::Result {
        let _ = write!(self.0, " {key}={val}");
        Ok(())
    }
}

impl slog::Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &slog::Record<'_>, values: &slog::OwnedKVList) -> Result<(), slog::Never> {
        use slog::KV as _;
        let mut kv = KvText(String::new());
        let _ = record.kv().serialize(record, &mut kv);
        let _ = values.serialize(record, &mut kv);
        match record.level() {
            slog::Level::Critical | slog::Level::Error => {
                tracing::error!(target: "ringmq::meta::raft", "{}{}", record.msg(), kv.0)
            }
            slog::Level::Warning => {
                tracing::warn!(target: "ringmq::meta::raft", "{}{}", record.msg(), kv.0)
            }
            slog::Level::Info | slog::Level::Debug => {
                tracing::debug!(target: "ringmq::meta::raft", "{}{}", record.msg(), kv.0)
            }
            slog::Level::Trace => {
                tracing::trace!(target: "ringmq::meta::raft", "{}{}", record.msg(), kv.0)
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::state::tests::{bind, exchange, queue};
    use crate::meta::state::{DestKind, ExchangeKind};
    use crate::meta::storage::LOG_FILE;
    use std::io::Write as _;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        futures_lite::future::block_on(f)
    }

    fn cas(q: &str, expected: u64, new: u64) -> Command {
        Command::CursorCas { vhost: "/".into(), queue: q.into(), expected, new }
    }

    /// Declares a mix of durable and transient objects; returns nothing, asserts outcomes.
    fn declare_mix(h: &MetaHandle) {
        let cmds = vec![
            Command::DeclareVhost { name: "/".into() },
            Command::DeclareExchange(exchange("dx", ExchangeKind::Topic, true)),
            Command::DeclareExchange(exchange("tx", ExchangeKind::Fanout, false)),
            Command::DeclareQueue(queue("dq", true, None)),
            Command::DeclareQueue(queue("tq", false, None)),
            Command::DeclareQueue(queue("xq", true, Some(42))),
            Command::Bind(bind("dx", DestKind::Queue, "dq", "a.#")),
            Command::Bind(bind("dx", DestKind::Queue, "tq", "a.#")),
            Command::Bind(bind("tx", DestKind::Queue, "dq", "")),
            Command::Bind(bind("amq.topic", DestKind::Exchange, "dx", "#")),
        ];
        let out = block_on(h.propose_batch(cmds)).unwrap();
        assert!(out.iter().all(|o| *o == Outcome::Created), "{out:?}");
        assert_eq!(block_on(h.propose(cas("dq", 0, 17))).unwrap(), Outcome::CasApplied);
    }

    #[test]
    fn restart_keeps_durable_objects_and_drops_transient_ones() {
        let dir = tempfile::tempdir().unwrap();
        let h = MetaHandle::start(dir.path(), 1).unwrap();
        assert!(h.is_leader());
        assert_eq!((h.node_id(), h.leader_id(), h.boot_epoch()), (1, Some(1), 1));
        let v0 = h.topology_version();
        declare_mix(&h);
        // Visible as soon as the proposals resolved.
        assert!(h.topology_version() > v0);
        let topo = h.topology();
        assert!(topo.queue("/", "tq").is_some() && topo.exchange("/", "tx").is_some());
        assert_eq!(topo.bindings_from("/", "dx").count(), 2);
        assert_eq!(h.cursor("/", "dq"), Some(17));
        // A cursor write does not bump the topology version.
        let v1 = h.topology_version();
        assert_eq!(block_on(h.propose(cas("dq", 17, 20))).unwrap(), Outcome::CasApplied);
        assert_eq!(h.topology_version(), v1);
        assert!(Arc::ptr_eq(&topo, &h.topology()), "unchanged topology is not rebuilt");
        h.shutdown();
        h.shutdown(); // idempotent
        assert!(matches!(block_on(h.propose(cas("dq", 20, 21))), Err(MetaError::Stopped)));

        let h = MetaHandle::start(dir.path(), 1).unwrap();
        assert_eq!(h.boot_epoch(), 2);
        let topo = h.topology();
        assert!(topo.vhosts.contains("/"));
        assert!(topo.queue("/", "dq").is_some());
        assert!(topo.queue("/", "tq").is_none(), "transient queue survived");
        assert!(topo.queue("/", "xq").is_none(), "exclusive queue survived");
        assert!(topo.exchange("/", "dx").is_some() && topo.exchange("/", "tx").is_none());
        assert!(topo.exchange("/", "amq.fanout").is_some());
        let left: Vec<_> = topo.all_bindings().cloned().collect();
        assert_eq!(left, [bind("amq.topic", DestKind::Exchange, "dx", "#"), bind("dx", DestKind::Queue, "dq", "a.#")]);
        assert_eq!(h.cursor("/", "dq"), Some(20));
        assert_eq!(h.cursor("/", "tq"), None);
        // Stale expected value after restart is still rejected.
        assert_eq!(h.propose_blocking(vec![cas("dq", 17, 30)]).unwrap(), [Outcome::CasRejected { current: Some(20) }]);
        h.shutdown();
        let h = MetaHandle::start(dir.path(), 1).unwrap();
        assert_eq!(h.boot_epoch(), 3);
        h.shutdown();
    }

    #[test]
    fn concurrent_proposals_share_entries_and_fsyncs() {
        let dir = tempfile::tempdir().unwrap();
        let h = MetaHandle::start(dir.path(), 1).unwrap();
        const THREADS: u64 = 16;
        const PER_THREAD: u64 = 100;
        let mut setup = vec![Command::DeclareVhost { name: "/".into() }];
        for t in 0..THREADS {
            setup.push(Command::DeclareQueue(queue(&format!("q{t}"), true, None)));
        }
        h.propose_blocking(setup).unwrap();
        let before = h.stats();
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let h = h.clone();
                s.spawn(move || {
                    let q = format!("q{t}");
                    for i in 0..PER_THREAD {
                        let out = block_on(h.propose(cas(&q, i, i + 1))).unwrap();
                        assert_eq!(out, Outcome::CasApplied);
                    }
                });
            }
        });
        let after = h.stats();
        let proposals = THREADS * PER_THREAD;
        assert_eq!(after.proposals - before.proposals, proposals);
        assert_eq!(after.commands_applied - before.commands_applied, proposals);
        let entries = after.entries_appended - before.entries_appended;
        let fsyncs = after.fsyncs - before.fsyncs;
        assert!(entries < proposals, "no grouping: {entries} entries for {proposals} proposals");
        assert!(fsyncs < proposals, "no grouping: {fsyncs} fsyncs for {proposals} proposals");
        for t in 0..THREADS {
            assert_eq!(h.cursor("/", &format!("q{t}")), Some(PER_THREAD));
        }
        eprintln!("group commit: {proposals} proposals from {THREADS} threads -> {entries} entries, {fsyncs} fsyncs");
        h.shutdown();
    }

    #[test]
    fn competing_cas_on_one_cursor_never_double_claims() {
        // Several proposers race on one queue's cursor: each read-CAS-retry loop claims a range
        // of 5; every claimed range must be disjoint and together cover 0..total.
        let dir = tempfile::tempdir().unwrap();
        let h = MetaHandle::start(dir.path(), 1).unwrap();
        h.propose_blocking(vec![Command::DeclareQueue(queue("q", true, None))]).unwrap();
        let claimed = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    // Bounded: 50 claims, each retried at most 1000 times.
                    for _ in 0..50 {
                        let mut cur = h.cursor("/", "q").unwrap();
                        for attempt in 0.. {
                            assert!(attempt < 1000, "CAS never succeeded");
                            match block_on(h.propose(cas("q", cur, cur + 5))).unwrap() {
                                Outcome::CasApplied => break,
                                Outcome::CasRejected { current: Some(c) } => cur = c,
                                other => panic!("{other:?}"),
                            }
                        }
                        mine.push(cur);
                    }
                    claimed.lock().extend(mine);
                });
            }
        });
        let mut starts = claimed.into_inner();
        starts.sort_unstable();
        let expected: Vec<u64> = (0..200).map(|i| i * 5).collect();
        assert_eq!(starts, expected);
        assert_eq!(h.cursor("/", "q"), Some(1000));
        h.shutdown();
    }

    #[test]
    fn torn_log_tail_is_truncated_and_survived() {
        let dir = tempfile::tempdir().unwrap();
        let h = MetaHandle::start(dir.path(), 1).unwrap();
        declare_mix(&h);
        h.shutdown();
        let log = dir.path().join(LOG_FILE);
        let good_len = std::fs::metadata(&log).unwrap().len();
        // A record header that promises more bytes than follow: an interrupted append.
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        f.write_all(&200u32.to_le_bytes()).unwrap();
        f.write_all(&[0xAB; 4]).unwrap();
        f.write_all(&[1, 2, 3, 4, 5, 6, 7]).unwrap();
        drop(f);

        let h = MetaHandle::start(dir.path(), 1).unwrap();
        assert_eq!(h.boot_epoch(), 2);
        assert!(h.topology().queue("/", "dq").is_some());
        assert_eq!(h.cursor("/", "dq"), Some(17));
        h.shutdown();
        // The garbage is gone (the file was cut back, then appended to).
        let bytes = std::fs::read(&log).unwrap();
        assert!(bytes.len() as u64 >= good_len);
        assert!(!bytes.windows(4).any(|w| w == [0xAB; 4]), "torn bytes still in the log");

        // Cut the log in the middle of its last record: the prefix survives.
        let len = std::fs::metadata(&log).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&log).unwrap().set_len(len - 3).unwrap();
        let h = MetaHandle::start(dir.path(), 1).unwrap();
        assert!(h.topology().queue("/", "dq").is_some());
        assert_eq!(h.cursor("/", "dq"), Some(17));
        h.shutdown();
    }

    #[test]
    fn damage_in_the_middle_of_the_log_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let h = MetaHandle::start(dir.path(), 1).unwrap();
        declare_mix(&h);
        h.shutdown();
        let log = dir.path().join(LOG_FILE);
        let mut bytes = std::fs::read(&log).unwrap();
        // Flip a byte in the middle of the log; valid records follow the damaged one.
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xFF;
        std::fs::write(&log, &bytes).unwrap();
        match MetaHandle::start(dir.path(), 1) {
            Err(MetaError::CorruptLog { offset, .. }) => assert!(offset <= mid as u64),
            other => panic!("expected CorruptLog, got {other:?}"),
        }
    }

    #[test]
    fn compaction_writes_a_snapshot_and_restart_uses_it() {
        let dir = tempfile::tempdir().unwrap();
        let config = MetaConfig { compact_entries: 20, ..MetaConfig::default() };
        let h = MetaHandle::start_with(dir.path(), 1, config).unwrap();
        declare_mix(&h);
        for i in 0..100 {
            let out = h.propose_blocking(vec![cas("dq", 17 + i, 18 + i)]).unwrap();
            assert_eq!(out, [Outcome::CasApplied]);
        }
        assert!(h.stats().snapshots >= 4, "{:?}", h.stats());
        let before = h.with_state(|s| s.clone());
        h.shutdown();
        assert!(dir.path().join(crate::meta::storage::SNAP_FILE).exists());
        let log_len = std::fs::metadata(dir.path().join(LOG_FILE)).unwrap().len();
        assert!(log_len < 4096, "log not compacted: {log_len} bytes");

        let h = MetaHandle::start_with(dir.path(), 1, config).unwrap();
        assert_eq!(h.cursor("/", "dq"), Some(117));
        let after = h.with_state(|s| s.clone());
        assert_eq!(after.topology.queues.len(), 1, "dq only: tq and xq went at restart");
        assert_eq!(after.topology.queue("/", "dq"), before.topology.queue("/", "dq"));
        assert_eq!(after.topology.bindings.len(), 2, "{:?}", after.topology.bindings);
        assert!(after.applied_index > before.applied_index);
        h.shutdown();
    }

    #[test]
    fn node_id_zero_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(MetaHandle::start(dir.path(), 0), Err(MetaError::Raft(_))));
    }

    #[test]
    fn handle_is_send_sync_clone() {
        fn check<T: Send + Sync + Clone + 'static>() {}
        check::<MetaHandle>();
    }
}
