//! [`MetaHandle`], the handle to the metadata group that every core holds.
//!
//! One dedicated `std::thread` ("ringmq-meta") owns the `RawNode<DiskStorage>` and runs the
//! raft-rs Ready loop; everything else talks to it through a flume channel. Handles are
//! `Send + Sync + Clone` and their `async` methods are runtime-agnostic (flume futures), so any
//! glommio executor can await them; the driver wakes the awaiting task from its own thread.
//!
//! The driver itself (its loop, group commit, persistence) is in `driver.rs`.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::driver::{Driver, Request, Shared};
use super::net::{ClusterFigures, ClusterSpec, NetInboxRx};
use super::state::{Command, MetaState, Outcome};
use super::topology::{NodeId, Topology};
use super::{Counters, MetaConfig, MetaError, MetaStats};

/// How long a single voter's start waits (it needs no peer; the bound only guards a bug).
const START_WAIT: Duration = Duration::from_secs(30);

/// Commands handed to the driver ([`MetaHandle::submit_batch`]) whose outcomes are not known
/// yet.
pub struct Proposal {
    rx: flume::Receiver<Result<Vec<Outcome>, MetaError>>,
    shared: Arc<Shared>,
}

impl Proposal {
    /// Resolves after the commands' entry is fdatasync'ed, committed and applied here, with
    /// their outcomes in order. Errors as [`MetaHandle::propose`].
    pub async fn outcomes(self) -> Result<Vec<Outcome>, MetaError> {
        match self.rx.recv_async().await {
            Ok(r) => r,
            Err(_) => Err(self.shared.stopped_error()),
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
    /// Calls `hook` once with the error when the driver stops on a fatal one (its log cannot
    /// be written or read: an I/O error, a full disk that a write hit), on the driver's
    /// thread; at once when it has already. The group does nothing after such an error: a
    /// server ends the process there, so that its supervisor restarts it from what is on the
    /// disk (`server::start_meta`), instead of serving with a metadata group that is gone.
    pub fn on_failure(&self, hook: impl FnOnce(String) + Send + 'static) {
        let mut slot = self.shared.on_failure.lock();
        let failed = self.shared.failure.lock().clone();
        match failed {
            Some(why) => {
                drop(slot);
                hook(why);
            }
            None => *slot = Some(Box::new(hook)),
        }
    }

    /// Tests: makes this node's log writer wait `ms` before each group of writes (0: none).
    #[cfg(test)]
    pub(super) fn stall_disk(&self, ms: u64) {
        self.shared.disk_stall_ms.store(ms, Ordering::Relaxed);
    }

    /// Starts the Raft node on a dedicated thread: replays `dir` (created when missing; a torn
    /// log tail is truncated with a warning), becomes leader (single voter: campaigns at once),
    /// applies `NodeBoot { node }` and returns. Blocks the calling thread (call it before the
    /// executors start, or from a plain thread).
    ///
    /// Errors: [`MetaError::Io`], [`MetaError::CorruptLog`], [`MetaError::CorruptSnapshot`],
    /// [`MetaError::CorruptEntry`], [`MetaError::Raft`] (node id 0, raft-rs refusing the stored
    /// state), [`MetaError::Membership`] (the directory belongs to a cluster).
    pub fn start(dir: &Path, node: NodeId) -> Result<MetaHandle, MetaError> {
        Self::start_with(dir, node, MetaConfig::default())
    }

    /// [`MetaHandle::start`] with explicit tunables.
    pub fn start_with(dir: &Path, node: NodeId, config: MetaConfig) -> Result<MetaHandle, MetaError> {
        let (_, rx) = super::net::inbox();
        Self::launch(dir, node, config, None, rx, START_WAIT)
    }

    /// Starts this node as one voter of a cluster's metadata group: `spec.voters` at the first
    /// start in `dir` (then the voters stored there, which must be the same set), raft-rs's
    /// messages out through `spec.net`, peers' messages in through the [`NetInbox`] paired with
    /// `inbox`. Returns once a leader exists and this node's `NodeBoot` is applied, which needs
    /// a majority of the voters up; waits at most `wait` for that (logging every 5 s).
    ///
    /// Errors: as [`MetaHandle::start`], and [`MetaError::NoQuorum`] when no majority answered
    /// within `wait`.
    pub fn start_cluster(
        dir: &Path,
        node: NodeId,
        config: MetaConfig,
        spec: ClusterSpec,
        inbox: NetInboxRx,
        wait: Duration,
    ) -> Result<MetaHandle, MetaError> {
        Self::launch(dir, node, config, Some(spec), inbox, wait)
    }

    fn launch(
        dir: &Path,
        node: NodeId,
        config: MetaConfig,
        cluster: Option<ClusterSpec>,
        inbox: NetInboxRx,
        wait: Duration,
    ) -> Result<MetaHandle, MetaError> {
        if node == 0 {
            return Err(MetaError::Raft("node id 0 is reserved by raft-rs".into()));
        }
        let counters = Arc::new(Counters::default());
        let shared = Arc::new(Shared::new(node, cluster.is_some(), counters.clone()));
        let net = cluster.as_ref().map(|c| c.net.clone());
        let NetInboxRx { tx, rx, reports } = inbox;
        let (init_tx, init_rx) = flume::bounded::<Result<(), MetaError>>(1);
        let dir = dir.to_owned();
        let drv_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ringmq-meta".into())
            .spawn(move || {
                let mut driver = match Driver::open(&dir, drv_shared.clone(), counters, config, cluster, Instant::now()) {
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
                driver.run(rx, reports);
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
        match handle.boot(wait, net.as_deref()) {
            Ok(epoch) => {
                handle.shared.boot_epoch.store(epoch, Ordering::Release);
                tracing::info!(node, epoch, "metadata group started");
                Ok(handle)
            }
            Err(e) => {
                handle.shutdown();
                Err(e)
            }
        }
    }

    /// Applies `NodeBoot` and returns the new epoch, retrying while no quorum answers (for at
    /// most `wait`). In a cluster the command carries the epoch read here before the first
    /// attempt, so however many copies are applied (a timed-out attempt applied late, a copy
    /// re-sent after a leader change) the boot counts once. (Only this node proposes its own
    /// boot, and it applied its last one before serving, so its own log, applied here first,
    /// has the latest epoch.) While no quorum answers, a cluster node asks the others whom
    /// the group counts (`net`): [`MetaError::NotAMember`] when that leaves it out.
    fn boot(&self, wait: Duration, net: Option<&dyn super::RaftNet>) -> Result<u64, MetaError> {
        let node = self.shared.node;
        // The epoch this node booted from is in its own log: read it once the log is applied
        // (the driver opened with the snapshot's state only).
        let replayed = Instant::now() + wait.min(Duration::from_secs(30));
        let replay_to = self.shared.replay_to.load(Ordering::Acquire);
        while self.with_state(|s| s.applied_index) < replay_to && Instant::now() < replayed && !self.shared.stopped.load(Ordering::Acquire)
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        let before = self.with_state(|s| s.boot_epochs.get(&node).copied().unwrap_or(0));
        let boot = Command::NodeBoot { node, cluster: self.shared.cluster.then_some(before) };
        let deadline = Instant::now() + wait;
        let mut last_log = Instant::now();
        loop {
            match self.propose_blocking(vec![boot.clone()]) {
                Ok(outcomes) => {
                    return match outcomes.first() {
                        Some(Outcome::Epoch(epoch)) => Ok(*epoch),
                        other => Err(MetaError::Raft(format!("NodeBoot gave {other:?}"))),
                    };
                }
                Err(MetaError::NoQuorum { .. }) if Instant::now() < deadline => {
                    if let Some(voters) = net.and_then(|n| n.voters_elsewhere()) {
                        if !voters.is_empty() && !voters.contains(&node) {
                            return Err(MetaError::NotAMember { node, voters });
                        }
                    }
                    if last_log.elapsed() >= Duration::from_secs(5) {
                        let f = self.cluster_figures();
                        tracing::warn!(node, voters = ?f.voters, leader = f.leader, "waiting for a majority of the metadata group to answer");
                        last_log = Instant::now();
                    }
                }
                Err(e) => return Err(e),
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
        self.submit_batch(cmds).await?.outcomes().await
    }

    /// Hands several commands to the driver as [`MetaHandle::propose_batch`] does, but resolves
    /// as soon as they are queued for it: the returned [`Proposal`] resolves with the outcomes.
    /// Batches submitted one after another by one task reach the log in that order (the
    /// driver takes its queue in order, proposes to raft-rs in order, and proposes again in
    /// order what a changed leader may have lost), so a caller can keep several batches in
    /// flight without reordering them; one lost with no leader change fails at the timeout
    /// while later ones may be applied. Errors: [`MetaError::Stopped`] /
    /// [`MetaError::Failed`] when the driver is gone.
    pub async fn submit_batch(&self, cmds: Vec<Command>) -> Result<Proposal, MetaError> {
        let (reply, rx) = flume::bounded(1);
        if cmds.is_empty() {
            let _ = reply.send(Ok(Vec::new()));
            return Ok(Proposal { rx, shared: self.shared.clone() });
        }
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(self.shared.stopped_error());
        }
        if self.tx.send_async(Request::Propose { cmds, reply }).await.is_err() {
            return Err(self.shared.stopped_error());
        }
        Ok(Proposal { rx, shared: self.shared.clone() })
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

    /// Changes the group's voters (`members.rs`): resolves once the change is committed and
    /// applied on this node. Blocks the calling thread: for plain threads (the transport's
    /// admin handler, tests), never a glommio executor.
    ///
    /// # Errors
    /// [`MetaError::NoQuorum`] when no leader is known or the change was not applied within the
    /// proposal timeout (raft-rs drops a change proposed while another is pending: retry),
    /// [`MetaError::Raft`] when raft-rs refuses it, [`MetaError::Stopped`] /
    /// [`MetaError::Failed`].
    pub fn change_members_blocking(&self, change: super::MemberChange) -> Result<(), MetaError> {
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(self.shared.stopped_error());
        }
        let (reply, rx) = flume::bounded(1);
        if self.tx.send(Request::ChangeMembers { change, reply }).is_err() {
            return Err(self.shared.stopped_error());
        }
        rx.recv().unwrap_or_else(|_| Err(self.shared.stopped_error()))
    }

    /// The voters the group was formed with: what a joining node starts from
    /// ([`super::ClusterSpec::joining`]). The current voters while no change ever applied.
    pub fn initial_voters(&self) -> Vec<NodeId> {
        let recorded = self.shared.state.lock().initial_voters.clone();
        if recorded.is_empty() {
            self.cluster_figures().voters
        } else {
            recorded
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

    /// A read barrier: resolves once this node has applied everything the group had committed
    /// when it was called (raft-rs's ReadIndex through the leader), so a read that follows sees
    /// every write acknowledged anywhere before the call. Immediate on a single voter. Costs a
    /// round trip to the leader: call it when a lookup missed, not on every lookup. Errors:
    /// [`MetaError::NoQuorum`] (no leader with a majority within 10 s), [`MetaError::Stopped`],
    /// [`MetaError::Failed`].
    pub async fn sync(&self) -> Result<(), MetaError> {
        if !self.shared.cluster {
            return Ok(());
        }
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(self.shared.stopped_error());
        }
        let (reply, rx) = flume::bounded(1);
        if self.tx.send_async(Request::ReadIndex { reply }).await.is_err() {
            return Err(self.shared.stopped_error());
        }
        match rx.recv_async().await {
            Ok(r) => r,
            Err(_) => Err(self.shared.stopped_error()),
        }
    }

    /// True when this node is one voter of several (started with
    /// [`MetaHandle::start_cluster`]).
    pub fn is_cluster(&self) -> bool {
        self.shared.cluster
    }

    /// The group's current figures (term, leader, role, indexes, per-peer progress on the
    /// leader), as of the driver's last loop iteration (at most 100 ms old).
    pub fn cluster_figures(&self) -> ClusterFigures {
        self.shared.figures.lock().clone()
    }

    /// Attaches the stores of replicated queues (`data.rs`): applied `Enqueue`/`Settle` data
    /// held since the start (a replay of the log, entries received meanwhile) goes to `sink`
    /// first, in order, then everything applied from now on.
    pub fn attach_data_sink(&self, sink: std::sync::Arc<dyn super::data::DataSink>) {
        self.shared.data.attach(sink);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::state::tests::{bind, exchange, queue};
    use crate::meta::storage::LOG_FILE;
    use crate::meta::topology::{DestKind, ExchangeKind};
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
        assert!(dir.path().join(crate::meta::snapshot::SNAP_FILE).exists());
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
