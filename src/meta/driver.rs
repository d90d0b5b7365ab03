//! The Raft driver: the thread that owns the `RawNode<DiskStorage>` and runs raft-rs's Ready
//! loop, and the state it shares with every [`MetaHandle`](super::MetaHandle) (`handle.rs`).
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
//! 6. Compact when the log passed 10,000 entries or 16 MiB (`snapshot.rs`).
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
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use protobuf::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeV2, Entry, EntryType};
use raft::{Config, RawNode, StateRole};

use super::codec::{decode_batch, encode_batch};
use super::state::{Command, MetaState, Outcome};
use super::storage::DiskStorage;
use super::topology::{NodeId, Topology};
use super::{Counters, MetaConfig, MetaError};

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

pub(super) enum Request {
    Propose { cmds: Vec<Command>, reply: flume::Sender<Result<Vec<Outcome>, MetaError>> },
    Shutdown { done: flume::Sender<()> },
}

/// State shared by the driver thread and every handle.
pub(super) struct Shared {
    pub(super) node: NodeId,
    /// The state machine; the driver locks it per applied entry, readers briefly.
    pub(super) state: Mutex<MetaState>,
    /// Bumped (under the `state` lock) whenever an applied entry changed the topology.
    pub(super) version: AtomicU64,
    /// Last published topology and the version it was built at (built lazily by readers).
    pub(super) topo_cache: Mutex<(u64, Arc<Topology>)>,
    /// raft-rs's current leader id (0: none known).
    pub(super) leader: AtomicU64,
    pub(super) boot_epoch: AtomicU64,
    pub(super) counters: Arc<Counters>,
    /// Set by `shutdown` and on a fatal driver error.
    pub(super) stopped: AtomicBool,
    /// The fatal error that stopped the driver, if any.
    pub(super) failure: Mutex<Option<String>>,
}

impl Shared {
    pub(super) fn stopped_error(&self) -> MetaError {
        match &*self.failure.lock() {
            Some(why) => MetaError::Failed(why.clone()),
            None => MetaError::Stopped,
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

pub(super) struct Driver {
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
    pub(super) fn open(
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
    pub(super) fn become_leader(&mut self) -> Result<(), MetaError> {
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

    pub(super) fn run(&mut self) {
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
