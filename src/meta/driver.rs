//! The Raft driver: the thread that owns the `RawNode<DiskStorage>` and runs raft-rs's Ready
//! loop, and the state it shares with every [`MetaHandle`](super::MetaHandle) (`handle.rs`).
//! The Ready handling and applying entries are in `ready.rs`.
//!
//! # The driver loop (one iteration, [`Driver::turn`], in this order)
//! 1. Wait for a request or for the log writer's news (`writer.rs`), at most until the next
//!    tick (100 ms); then drain every request already waiting (at most `MAX_DRAIN`):
//!    proposals, read barriers, and (in a cluster) messages from peers, unreachable reports and
//!    snapshot reports from the transport.
//! 2. Tick raft-rs when 100 ms have passed.
//! 3. Group commit: encode all drained commands into one entry (a new entry only past
//!    `MAX_ENTRY_BYTES`), propose it with a 16-byte context (driver nonce, batch sequence) that
//!    finds its waiters when it is applied. On a follower raft-rs forwards the proposal to the
//!    leader (`MsgPropose`); the context travels in the entry, so the proposer's waiters resolve
//!    when the proposer itself applies the entry (it reads its own writes). With no leader
//!    known, proposals wait (up to `PROPOSE_TIMEOUT`) for one. Entries in flight to a leader
//!    that changed are proposed again first, in their order, then the waiting ones, then the
//!    new ones (a leader elected again in a later term counts as changed): proposals from one
//!    thread reach the log in the order they were made, but for one lost on the way with no
//!    leader change (a dropped message, a leader transfer): it fails at the timeout while
//!    later ones may be applied.
//! 4. Ready loop (`ready.rs`), raft-rs's asynchronous steps: send the leader's messages;
//!    install a received snapshot; apply committed entries (raft-rs hands out only those
//!    durable here); stage new entries and the HardState in memory and hand their one write
//!    (one fdatasync when `must_sync`) to the log writer; `advance_append_async`. The driver
//!    never waits for that write: when the writer says it is durable, `on_persist_ready` tells
//!    raft-rs, the messages that had to wait for it (votes, append responses) go out, and a new
//!    Ready carries what that released (the commit, the next appends). Resolve read barriers.
//!    Compaction and installing a snapshot replace `meta.log`, so they wait for the writer
//!    first (rare: one per 10,000 entries or 16 MiB).
//! 5. Applying an entry locks the state, applies each command, bumps the topology version when
//!    the topology changed, unlocks, then resolves the entry's waiters with their outcomes (in
//!    proposal order).
//! 6. Fail proposals and read barriers older than the propose timeout (10 s,
//!    [`MetaError::NoQuorum`]); compact when the log passed 10,000 entries or 16 MiB
//!    (`snapshot.rs`); a leader takes the state then and writes it once every follower has
//!    its index (at most until twice that), then proposes `LogCompacted`; a follower writes
//!    its state once a leader compacted past it, so a new leader still has what a node
//!    briefly behind lacks.
//!
//! # Cluster (raft-rs's driver contract)
//! `check_quorum` and `pre_vote` are on in a cluster: a leader cut off from a majority steps
//! down within an election timeout (1 s), and a node that rejoins does not disrupt the term.
//! Failed sends reach [`RawNode::report_unreachable`], every sent snapshot
//! [`RawNode::report_snapshot`]. The voters come from the static `--peers` list at the first
//! start and from the log and snapshot after that.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use raft::eraftpb::{Message, MessageType};
use raft::{Config, RawNode, SnapshotStatus, StateRole};

use super::codec::encode_batch;
use super::net::{ClusterFigures, ClusterSpec, RaftNet};
use super::raftlog::TracingDrain;
use super::state::{Command, MetaState, Outcome};
use super::storage::DiskStorage;
use super::topology::{NodeId, Topology};
use super::writer::LogWriter;
use super::{Counters, MetaConfig, MetaError};

/// Raft logical clock period.
pub(super) const TICK: Duration = Duration::from_millis(100);
/// Most requests drained from the channel per loop iteration.
const MAX_DRAIN: usize = 16_384;
/// A new entry is started once the current one's data passes this size (bytes).
pub const MAX_ENTRY_BYTES: usize = 1 << 20;
/// How long `start` waits for a single voter to become leader.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// A proposal or read barrier not answered within this time fails with
/// [`MetaError::NoQuorum`] (no leader, or no majority behind it); the default of
/// [`MetaConfig::propose_timeout`].
pub const PROPOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How many times the compaction thresholds a leader's log may grow while it waits for a
/// lagging follower, once the log carries replicated queue data (64 × 16 MiB = 1 GiB).
pub const LAGGING_FOLLOWER_FACTOR: u64 = 64;
/// Election timeout in ticks (1 s; raft-rs randomizes it in [1 s, 2 s)).
const ELECTION_TICKS: usize = 10;

/// A request to the driver: from handles (proposals, read barriers, shutdown) or from the
/// transport (messages and reports).
pub(super) enum Request {
    Propose {
        cmds: Vec<Command>,
        reply: flume::Sender<Result<Vec<Outcome>, MetaError>>,
    },
    /// A read barrier: resolves once this node has applied everything committed when it was
    /// asked (raft-rs's ReadIndex).
    ReadIndex {
        reply: flume::Sender<Result<(), MetaError>>,
    },
    /// A membership change (`members.rs`): resolves once applied here.
    ChangeMembers {
        change: super::members::MemberChange,
        reply: flume::Sender<Result<(), MetaError>>,
    },
    Step(Box<Message>),
    Unreachable(NodeId),
    SnapshotDone {
        to: NodeId,
        ok: bool,
    },
    Shutdown {
        done: flume::Sender<()>,
    },
}

/// What [`super::MetaHandle::on_failure`] registers.
pub(super) type FailureHook = Box<dyn FnOnce(String) + Send>;

/// State shared by the driver thread and every handle.
pub(super) struct Shared {
    pub(super) node: NodeId,
    /// True in a multi-voter group (started with peers).
    pub(super) cluster: bool,
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
    /// Called once with that error, on the driver's thread ([`super::MetaHandle::on_failure`]).
    pub(super) on_failure: Mutex<Option<FailureHook>>,
    /// The group's figures, refreshed by the driver after every loop iteration.
    pub(super) figures: Mutex<ClusterFigures>,
    /// Applied replicated-queue data, on its way to the stores (`data.rs`).
    pub(super) data: super::data::DataFeed,
    /// The commit index the log held when the driver opened it: the node has replayed its
    /// own log once `state.applied_index` reaches it.
    pub(super) replay_to: AtomicU64,
    /// Fault injection for tests: the log writer waits this many ms before each group of
    /// writes (a stalling disk). Always 0 outside tests.
    pub(super) disk_stall_ms: Arc<AtomicU64>,
}

impl Shared {
    pub(super) fn new(node: NodeId, cluster: bool, counters: Arc<Counters>) -> Shared {
        Shared {
            node,
            cluster,
            state: Mutex::new(MetaState::default()),
            version: AtomicU64::new(0),
            topo_cache: Mutex::new((u64::MAX, Arc::new(Topology::default()))),
            leader: AtomicU64::new(0),
            boot_epoch: AtomicU64::new(0),
            counters,
            stopped: AtomicBool::new(false),
            failure: Mutex::new(None),
            on_failure: Mutex::new(None),
            figures: Mutex::new(ClusterFigures::default()),
            data: Default::default(),
            replay_to: AtomicU64::new(0),
            disk_stall_ms: Arc::new(AtomicU64::new(0)),
        }
    }

    pub(super) fn stopped_error(&self) -> MetaError {
        match &*self.failure.lock() {
            Some(why) => MetaError::Failed(why.clone()),
            None => MetaError::Stopped,
        }
    }
}

/// Where a read barrier is answered.
pub(super) type ReadReply = flume::Sender<Result<(), MetaError>>;

/// Requests drained in one loop iteration, packed into entries.
pub(super) struct Waiter {
    /// How many of the entry's commands (consecutive, in order) are this waiter's.
    pub(super) count: usize,
    pub(super) reply: flume::Sender<Result<Vec<Outcome>, MetaError>>,
}

/// A proposed entry waiting to be applied.
pub(super) struct InFlight {
    /// When its first request arrived.
    pub(super) since: Instant,
    pub(super) waiters: Vec<Waiter>,
    /// The entry as proposed, to propose again when the leader changes before it is applied
    /// (a follower's proposal forwarded to a leader that died is lost). When both copies
    /// reach the log, the second is skipped by its context (`MetaState::first_application`).
    ctx: Vec<u8>,
    data: Vec<u8>,
    /// The leader it was proposed to, and that leader's term: a leader killed and elected
    /// again (same id, a later term) lost what was forwarded to it before its crash.
    leader: (NodeId, u64),
}

pub(super) struct PendingEntry {
    cmds: Vec<Command>,
    waiters: Vec<Waiter>,
    bytes_estimate: usize,
    /// When its first request arrived.
    since: Instant,
}

/// A Ready handed to raft-rs with `advance_append_async` whose write is not known durable
/// yet (or that waits behind one that is not).
pub(super) struct Unpersisted {
    /// raft-rs's Ready number.
    pub(super) number: u64,
    /// The number of its write at the log writer, which also sends its persisted messages
    /// (None: it wrote nothing and had no message to hold).
    pub(super) write: Option<u64>,
}

/// Tests only: an applied entry as the simulator reads it: (index, term, commands, outcomes).
#[cfg(test)]
pub(super) type AppliedEntry = (u64, u64, Vec<Command>, Vec<Outcome>);

pub(super) struct Driver {
    pub(super) raw: RawNode<DiskStorage>,
    /// Makes the log's writes and fdatasyncs off this thread (`writer.rs`).
    pub(super) writer: LogWriter,
    /// Readys whose write is in flight, in Ready order (`ready.rs`).
    pub(super) unpersisted: VecDeque<Unpersisted>,
    pub(super) shared: Arc<Shared>,
    pub(super) counters: Arc<Counters>,
    /// Where raft-rs's messages go (None: a single voter, no network).
    pub(super) net: Option<Arc<dyn RaftNet>>,
    /// Identifies this driver's proposals in entry contexts (differs across restarts).
    pub(super) nonce: u64,
    pub(super) next_seq: u64,
    /// Proposed entries not applied yet, by batch sequence.
    pub(super) in_flight: HashMap<u64, InFlight>,
    /// Proposals made while no leader was known, retried each iteration.
    awaiting_leader: Vec<PendingEntry>,
    /// Read barriers sent to raft-rs whose read index is not known yet, by request id.
    pub(super) reads: HashMap<u64, super::ready::PendingRead>,
    /// Read barriers whose read index is known: resolved once applied reaches it.
    /// (read index, when asked, reply).
    pub(super) reads_at: Vec<(u64, Instant, ReadReply)>,
    pub(super) next_read: u64,
    /// The clock of the last `turn` (the simulator drives it).
    pub(super) now: Instant,
    last_tick: Instant,
    /// Last leader seen (for the leader-change log line and counter).
    pub(super) last_leader: NodeId,
    pub(super) leader_changes: u64,
    /// Request → applied time of this node's latest applied proposal, µs (metrics).
    pub(super) commit_latency_us: u64,
    /// No compaction before this instant (set after a failed one).
    pub(super) compact_after: Option<Instant>,
    /// The state a compaction waits to write (taken when the log first wanted it).
    pub(super) compact_state: Option<MetaState>,
    /// A node joined while the log was compacted already: compact once more, past its join,
    /// so that the snapshot it is sent names it (`members.rs`, step 3).
    pub(super) compact_for_join: bool,
    /// The stores' sync that a compaction waits for (`data.rs`, invariant 2).
    pub(super) flushing: Option<super::data::FlushWait>,
    /// When leadership moves to the node that proposes most (`balance.rs`); `None`: never.
    pub(super) balance: Option<super::balance::LeaderBalance>,
    /// This leader's proposal load over the current window (`balance.rs`).
    pub(super) load: super::balance::Load,
    pub(super) shutdown_done: Vec<flume::Sender<()>>,
    pub(super) voters: Vec<NodeId>,
    /// Membership changes proposed here, not applied yet, by sequence (`members.rs`).
    pub(super) conf_waiters: HashMap<u64, super::members::ConfWaiter>,
    /// [`MetaConfig::propose_timeout`].
    pub(super) propose_timeout: Duration,
    /// Tests only (the simulator, `sim.rs`): when set, every applied normal entry; a leader's
    /// no-op has no commands.
    #[cfg(test)]
    pub(super) applied_log: Option<Vec<AppliedEntry>>,
}

impl Driver {
    /// Opens the storage in `dir` and builds the raft-rs node. A fresh directory gets the
    /// voters of `cluster` (or this node alone); an existing one keeps its stored voters,
    /// which must be the same set. Errors: those of `DiskStorage::open`,
    /// [`MetaError::Membership`], [`MetaError::Raft`].
    pub(super) fn open(
        dir: &Path,
        shared: Arc<Shared>,
        counters: Arc<Counters>,
        meta_config: MetaConfig,
        cluster: Option<ClusterSpec>,
        now: Instant,
    ) -> Result<Driver, MetaError> {
        let node = shared.node;
        let (mut store, rec) = DiskStorage::open(dir, counters.clone())?;
        store.set_compaction(meta_config.compact_entries, meta_config.compact_bytes);
        let mut wanted: Vec<NodeId> = match &cluster {
            Some(spec) => spec.voters.clone(),
            None => vec![node],
        };
        wanted.sort_unstable();
        wanted.dedup();
        let joining = cluster.as_ref().is_some_and(|c| c.joining);
        let empty = store.conf_state().voters.is_empty() && store.conf_state().learners.is_empty();
        if rec.fresh || empty {
            // A joining node starts with the group's first voters, itself not among them
            // (`members.rs`, step 3).
            let cs = raft::eraftpb::ConfState { voters: wanted.clone(), ..Default::default() };
            store.set_conf_state(cs)?;
        } else {
            // The stored voters are the group's: `--peers` only names addresses now.
            let mut stored = store.conf_state().voters.clone();
            stored.sort_unstable();
            let single = |v: &[NodeId]| v == [node];
            if single(&stored) != single(&wanted) || cluster.is_none() && stored != wanted {
                return Err(MetaError::Membership { stored, given: wanted });
            }
            if !stored.contains(&node) && !joining {
                return Err(MetaError::NotAMember { node, voters: stored });
            }
            if stored != wanted && !joining {
                tracing::info!(node, voters = ?stored, peers = ?wanted, "the metadata group's voters (from the log) differ from --peers: the log's are used");
            }
            wanted = stored;
        }
        let voters = wanted;
        let applied = store.snapshot_index();
        shared.replay_to.store(store.hard_state().commit, Ordering::Release);
        // The transport talks to the group's voters and the nodes that joined; a node that
        // joins is no voter yet and learns the removals from the log.
        let net = cluster.as_ref().map(|c| &c.net);
        let keep = (!joining).then_some(voters.as_slice());
        match rec.state {
            Some(state) => {
                super::members::sync_peers(net, &state, keep);
                *shared.state.lock() = state;
            }
            None => super::members::sync_peers(net, &super::state::MetaState::default(), keep),
        }
        tracing::debug!(node, snapshot_index = applied, log_entries = rec.entries, torn_bytes = rec.torn_bytes, "metadata log replayed");
        let config = Config {
            id: node,
            election_tick: ELECTION_TICKS,
            heartbeat_tick: 1,
            applied,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            pre_vote: true,
            check_quorum: cluster.is_some(),
            ..Config::default()
        };
        config.validate().map_err(|e| MetaError::Raft(e.to_string()))?;
        let logger = slog::Logger::root(TracingDrain, slog::o!("raft_id" => node));
        let raw = RawNode::new(&config, store, &logger).map_err(|e| MetaError::Raft(e.to_string()))?;
        let clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        let nonce = clock ^ (u64::from(std::process::id()) << 32) ^ node.rotate_left(48) ^ NONCES.fetch_add(1, Ordering::Relaxed) << 56;
        // A single voter has no heartbeats to keep: it writes on this thread (`writer.rs`).
        let writer = match &cluster {
            Some(c) => LogWriter::thread(counters.clone(), Some(c.net.clone()), shared.disk_stall_ms.clone())?,
            None => LogWriter::inline(counters.clone()),
        };
        Ok(Driver {
            raw,
            writer,
            unpersisted: VecDeque::new(),
            shared,
            counters,
            net: cluster.map(|c| c.net),
            nonce,
            next_seq: 1,
            in_flight: HashMap::new(),
            awaiting_leader: Vec::new(),
            reads: HashMap::new(),
            reads_at: Vec::new(),
            next_read: 1,
            now,
            last_tick: now,
            last_leader: 0,
            leader_changes: 0,
            commit_latency_us: 0,
            compact_after: None,
            compact_state: None,
            compact_for_join: false,
            flushing: None,
            balance: meta_config.leader_balance,
            load: super::balance::Load::new(now),
            shutdown_done: Vec::new(),
            voters,
            conf_waiters: HashMap::new(),
            propose_timeout: meta_config.propose_timeout,
            #[cfg(test)]
            applied_log: None,
        })
    }

    /// Single voter: campaigns (wins at once) and runs Ready rounds until this node leads.
    /// In a cluster this returns at once: the loop elects a leader with the peers, and
    /// proposals wait for one.
    pub(super) fn become_leader(&mut self) -> Result<(), MetaError> {
        if self.voters != [self.shared.node] {
            return Ok(());
        }
        self.raw.campaign().map_err(|e| MetaError::Raft(e.to_string()))?;
        let deadline = Instant::now() + START_TIMEOUT;
        // Bounded: each round waits for the log writer; a round without leadership waits a tick.
        while Instant::now() < deadline {
            self.on_ready()?;
            self.writer.wait_idle()?;
            self.on_persisted()?;
            let log = &self.raw.raft.raft_log;
            if self.raw.raft.state == StateRole::Leader {
                // Done once everything committed so far is applied (the leader's no-op commits
                // the old log).
                if log.applied >= log.committed && !self.raw.has_ready() && self.writer.idle() {
                    return Ok(());
                }
                continue;
            }
            std::thread::sleep(TICK);
            self.raw.tick();
        }
        Err(MetaError::NotLeader { leader: self.leader() })
    }

    pub(super) fn leader(&self) -> Option<NodeId> {
        match self.raw.raft.leader_id {
            0 => None,
            id => Some(id),
        }
    }

    /// The driver thread's body: [`Driver::turn`] until shutdown or a fatal error.
    pub(super) fn run(&mut self, rx: flume::Receiver<Request>, reports: flume::Receiver<Request>) {
        if let Err(e) = self.run_loop(&rx, &reports) {
            let why = e.to_string();
            tracing::error!(error = %why, "metadata driver stopped on a fatal error");
            *self.shared.failure.lock() = Some(why.clone());
            self.shared.stopped.store(true, Ordering::Release);
            let hook = self.shared.on_failure.lock().take();
            if let Some(hook) = hook {
                hook(why.clone());
            }
            self.fail_all(|| MetaError::Failed(why.clone()));
            // Fail whatever is still queued (bounded by the channel's capacity).
            let queued: Vec<Request> = rx.drain().collect();
            for req in queued {
                match req {
                    Request::Propose { reply, .. } => {
                        let _ = reply.send(Err(MetaError::Failed(why.clone())));
                    }
                    Request::ReadIndex { reply } | Request::ChangeMembers { reply, .. } => {
                        let _ = reply.send(Err(MetaError::Failed(why.clone())));
                    }
                    Request::Shutdown { done } => self.shutdown_done.push(done),
                    Request::Step(_) | Request::Unreachable(_) | Request::SnapshotDone { .. } => {}
                }
            }
        }
        for done in self.shutdown_done.drain(..) {
            let _ = done.send(());
        }
    }

    fn run_loop(&mut self, rx: &flume::Receiver<Request>, reports: &flume::Receiver<Request>) -> Result<(), MetaError> {
        // Runs until a Shutdown request or until every handle is dropped.
        loop {
            let wait = TICK.saturating_sub(self.last_tick.elapsed());
            let mut reqs: Vec<Request> = reports.try_iter().collect();
            let mut disconnected = false;
            // Wakes for a request, for the log writer's news, or for the tick.
            let woke = match self.writer.reports() {
                Some(done) => {
                    flume::Selector::new().recv(rx, Wake::Request).recv(done, Wake::Written).wait_timeout(wait).unwrap_or(Wake::Tick)
                }
                None => rx.recv_timeout(wait).map_or(Wake::Tick, |r| Wake::Request(Ok(r))),
            };
            match woke {
                Wake::Request(Ok(req)) => reqs.push(req),
                Wake::Request(Err(_)) => disconnected = true,
                Wake::Written(Ok(r)) => self.writer.note(r)?,
                Wake::Written(Err(_)) => return Err(MetaError::Failed("the metadata log writer stopped".into())),
                Wake::Tick => {}
            }
            reqs.extend(rx.try_iter().take(MAX_DRAIN));
            let stopping = self.turn(reqs, Instant::now())? || disconnected;
            if stopping {
                // Requests sent before `stopped` was visible are still served.
                let queued: Vec<Request> = rx.drain().collect();
                self.turn(queued, Instant::now())?;
                self.writer.wait_idle()?;
                self.on_persisted()?;
                self.raw.mut_store().flush()?;
                self.fail_all(|| MetaError::Stopped);
                return Ok(());
            }
        }
    }

    /// One loop iteration (module doc, steps 1–6) on `reqs` at time `now`; returns true when
    /// a shutdown was requested. Errors are fatal (a failed write or fsync of the log).
    pub(super) fn turn(&mut self, reqs: Vec<Request>, now: Instant) -> Result<bool, MetaError> {
        self.now = now;
        let mut stopping = false;
        let mut batch = Vec::new();
        for req in reqs {
            stopping |= self.take(req, &mut batch);
        }
        if now.saturating_duration_since(self.last_tick) >= TICK {
            self.raw.tick();
            self.last_tick = now;
        }
        // Entries proposed to a leader that is gone go again before the new ones: a queue
        // keeps several `Enqueue` batches in flight and their offsets follow the publish order.
        self.repropose();
        let retry = std::mem::take(&mut self.awaiting_leader);
        self.propose_entries(retry.into_iter().chain(batch).collect());
        self.on_ready()?;
        self.on_persisted()?;
        self.repropose();
        self.ask_reads_again();
        self.expire();
        self.expire_member_changes();
        self.balance_leadership();
        self.publish_figures();
        self.compact_when_due(now)?;
        Ok(stopping)
    }

    /// Proposes `cmds` on this driver's own account (nobody waits for the outcome) at the
    /// next turn, once a leader is known.
    pub(super) fn propose_own(&mut self, cmds: Vec<Command>) {
        let bytes_estimate = cmds.iter().map(estimate_bytes).sum();
        self.awaiting_leader.push(PendingEntry { cmds, waiters: Vec::new(), bytes_estimate, since: self.now });
    }

    /// Files one request; returns true for a shutdown request.
    fn take(&mut self, req: Request, batch: &mut Vec<PendingEntry>) -> bool {
        match req {
            Request::Shutdown { done } => {
                self.shutdown_done.push(done);
                return true;
            }
            Request::Propose { cmds, reply } => {
                self.counters.proposals.add(1);
                let estimate: usize = cmds.iter().map(estimate_bytes).sum();
                let start_new = match batch.last() {
                    None => true,
                    Some(e) => e.bytes_estimate + estimate > MAX_ENTRY_BYTES,
                };
                if start_new {
                    batch.push(PendingEntry { cmds: Vec::new(), waiters: Vec::new(), bytes_estimate: 0, since: self.now });
                }
                if let Some(entry) = batch.last_mut() {
                    entry.waiters.push(Waiter { count: cmds.len(), reply });
                    entry.cmds.extend(cmds);
                    entry.bytes_estimate += estimate;
                }
            }
            Request::ReadIndex { reply } => {
                if self.net.is_none() {
                    // A single voter's state is the committed state.
                    let _ = reply.send(Ok(()));
                } else {
                    self.ask_read(reply);
                }
            }
            Request::ChangeMembers { change, reply } => self.propose_member_change(change, reply),
            Request::Step(msg) => self.step(*msg),
            Request::Unreachable(to) => self.raw.report_unreachable(to),
            Request::SnapshotDone { to, ok } => {
                let status = if ok { SnapshotStatus::Finish } else { SnapshotStatus::Failure };
                self.raw.report_snapshot(to, status);
            }
        }
        false
    }

    /// Steps a message from a peer. A forwarded proposal must find disk room here first, as a
    /// local one does; without it the proposal is dropped (its proposer times out).
    fn step(&mut self, msg: Message) {
        if msg.get_msg_type() == MessageType::MsgPropose && self.raw.raft.state == StateRole::Leader {
            let bytes: u64 = msg.get_entries().iter().map(|e| e.data.len() as u64 + e.context.len() as u64 + 128).sum();
            self.note_load(msg.from, bytes);
            if let Err(e) = self.raw.mut_store().reserve_log(bytes) {
                tracing::warn!(from = msg.from, error = %e, "forwarded metadata proposal dropped: disk full");
                return;
            }
        }
        if let Err(e) = self.raw.step(msg) {
            // A message from a node outside the group, or for a stale term: nothing to do.
            tracing::debug!(error = %e, "raft message not stepped");
        }
    }

    /// Proposes each pending entry to raft-rs (all reach the disk in the next Ready).
    fn propose_entries(&mut self, batch: Vec<PendingEntry>) {
        for entry in batch {
            if self.raw.raft.leader_id == 0 || self.raw.raft.state != StateRole::Leader && self.net.is_none() {
                self.awaiting_leader.push(entry);
                continue;
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            // Read back by `state::proposal_context`.
            let mut ctx = Vec::with_capacity(16);
            ctx.extend_from_slice(&self.nonce.to_le_bytes());
            ctx.extend_from_slice(&seq.to_le_bytes());
            let mut data = Vec::with_capacity(entry.bytes_estimate + 8);
            encode_batch(entry.cmds.len(), &entry.cmds, &mut data);
            // The entry's record (and its HardState) must find disk blocks: on a full disk the
            // proposal is refused here, before raft-rs takes it.
            let bytes = data.len() as u64 + ctx.len() as u64 + 128;
            if let Err(e) = self.raw.mut_store().reserve_log(bytes) {
                tracing::warn!(error = %e, "metadata proposal refused: disk full");
                for w in entry.waiters {
                    let _ = w.reply.send(Err(match &e {
                        MetaError::DiskFull { path, bytes } => MetaError::DiskFull { path: path.clone(), bytes: *bytes },
                        other => MetaError::Raft(other.to_string()),
                    }));
                }
                continue;
            }
            match self.raw.propose(ctx.clone(), data.clone()) {
                Ok(()) => {
                    let leader = (self.raw.raft.leader_id, self.raw.raft.term);
                    if self.raw.raft.state == StateRole::Leader {
                        self.note_load(self.raw.raft.id, bytes);
                    }
                    self.in_flight.insert(seq, InFlight { since: entry.since, waiters: entry.waiters, ctx, data, leader });
                }
                Err(raft::Error::ProposalDropped) => {
                    // Leadership is moving (or the leader just vanished): try again next turn.
                    self.awaiting_leader.push(entry);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metadata proposal dropped by raft");
                    for w in entry.waiters {
                        let _ = w.reply.send(Err(MetaError::Raft(e.to_string())));
                    }
                }
            }
        }
    }

    /// Proposes again, in proposal order, every in-flight entry proposed to another leader than
    /// the current one, or to the same node in an earlier term (module doc, step 3): it may
    /// have died with the old leader, or with the leader's own run when it was killed and
    /// elected again (seen in CI: a grow's copy batches and a queue's enqueues stalled 10 s,
    /// then nacked, behind proposals forwarded to a leader killed just before). The entry
    /// keeps its context, so whichever copy is applied first resolves its waiters.
    fn repropose(&mut self) {
        let leader = (self.raw.raft.leader_id, self.raw.raft.term);
        if leader.0 == 0 || self.net.is_none() {
            return;
        }
        let mut stale: Vec<u64> = self.in_flight.iter().filter(|(_, f)| f.leader != leader).map(|(seq, _)| *seq).collect();
        stale.sort_unstable();
        for seq in stale {
            let Some(f) = self.in_flight.get_mut(&seq) else { continue };
            if self.raw.propose(f.ctx.clone(), f.data.clone()).is_ok() {
                f.leader = leader;
            }
        }
    }

    /// Fails proposals and read barriers older than [`PROPOSE_TIMEOUT`] (module doc, step 6).
    fn expire(&mut self) {
        let now = self.now;
        let timeout = self.propose_timeout;
        let old = |since: Instant| now.saturating_duration_since(since) >= timeout;
        let waited = timeout.as_millis() as u64;
        let leader = self.leader();
        let (late, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.awaiting_leader).into_iter().partition(|e| old(e.since));
        self.awaiting_leader = keep;
        for entry in late {
            for w in entry.waiters {
                let _ = w.reply.send(Err(MetaError::NoQuorum { waited_ms: waited, leader }));
            }
        }
        let late: Vec<u64> = self.in_flight.iter().filter(|(_, f)| old(f.since)).map(|(seq, _)| *seq).collect();
        for seq in late {
            if let Some(f) = self.in_flight.remove(&seq) {
                for w in f.waiters {
                    let _ = w.reply.send(Err(MetaError::NoQuorum { waited_ms: waited, leader }));
                }
            }
        }
        let late: Vec<u64> = self.reads.iter().filter(|(_, r)| old(r.since)).map(|(id, _)| *id).collect();
        for id in late {
            if let Some(r) = self.reads.remove(&id) {
                let _ = r.reply.send(Err(MetaError::NoQuorum { waited_ms: waited, leader }));
            }
        }
        // A barrier whose index is known but not applied in time (this node cut off since).
        self.reads_at.retain(|(_, since, reply)| {
            let late = old(*since);
            if late {
                let _ = reply.send(Err(MetaError::NoQuorum { waited_ms: waited, leader }));
            }
            !late
        });
    }

    /// Answers every waiter with `err()` (shutdown, fatal error).
    fn fail_all(&mut self, err: impl Fn() -> MetaError) {
        for (_, f) in self.in_flight.drain() {
            for w in f.waiters {
                let _ = w.reply.send(Err(err()));
            }
        }
        for entry in self.awaiting_leader.drain(..) {
            for w in entry.waiters {
                let _ = w.reply.send(Err(err()));
            }
        }
        for reply in self.reads.drain().map(|(_, r)| r.reply) {
            let _ = reply.send(Err(err()));
        }
        for (_, _, reply) in self.reads_at.drain(..) {
            let _ = reply.send(Err(err()));
        }
        for (_, w) in self.conf_waiters.drain() {
            let _ = w.reply.send(Err(err()));
        }
    }
}

/// What woke the driver loop.
enum Wake {
    Request(Result<Request, flume::RecvError>),
    /// The log writer's news: the number of the last durable write, or its failure.
    Written(Result<Result<u64, MetaError>, flume::RecvError>),
    Tick,
}

/// Distinguishes drivers started in the same nanosecond in one process (tests, the simulator).
static NONCES: AtomicU64 = AtomicU64::new(0);

/// Rough encoded size of a command (bytes), to bound entry sizes.
fn estimate_bytes(cmd: &Command) -> usize {
    match cmd {
        Command::CursorCas { vhost, queue, .. } => 24 + vhost.len() + queue.len(),
        Command::DeclareVhost { name } => 8 + name.len(),
        Command::DeleteExchange { vhost, name, .. } | Command::DeleteQueue { vhost, name } => 8 + vhost.len() + name.len(),
        Command::NodeBoot { .. } => 12,
        Command::Enqueue { vhost, queue, header, body, .. } => 16 + vhost.len() + queue.len() + header.len() + body.len(),
        Command::Settle { vhost, queue, offsets } => 8 + vhost.len() + queue.len() + 5 * offsets.len(),
        Command::Return { vhost, queue, counts } => 8 + vhost.len() + queue.len() + 8 * counts.len(),
        Command::MoveQueue { vhost, queue, .. }
        | Command::LeaveReplicaSet { vhost, queue, .. }
        | Command::Reserve { vhost, queue, .. }
        | Command::GrowReplicaSet { vhost, queue, .. }
        | Command::JoinReplicaSet { vhost, queue, .. } => 24 + vhost.len() + queue.len(),
        Command::CopyMessages { vhost, queue, messages, .. } => {
            32 + vhost.len() + queue.len() + messages.iter().map(|m| 16 + m.header.len() + m.body.len()).sum::<usize>()
        }
        // Definitions carry field tables; a generous flat guess keeps this cheap.
        Command::DeclareExchange(d) => 64 + d.vhost.len() + d.name.len() + 32 * d.arguments.inner().len(),
        Command::DeclareQueue(d) => 80 + d.vhost.len() + d.name.len() + 32 * d.arguments.inner().len() + 10 * d.replicas.len(),
        Command::Bind(b) | Command::Unbind(b) => {
            64 + b.vhost.len() + b.source.len() + b.dest.len() + b.routing_key.len() + 32 * b.arguments.inner().len()
        }
        // Users, permissions, policies, vhost deletes: rare and small, measured by encoding.
        other => super::access::encoded_len(other),
    }
}
