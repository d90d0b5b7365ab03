//! A deterministic simulator of the metadata group (tests only): N real [`Driver`]s, each on
//! its own temp directory, stepped by [`Driver::turn`] on a simulated clock, talking through a
//! simulated network that delays, drops, duplicates and reorders messages and partitions
//! nodes, with nodes restarted from their disk, clients proposing read-modify-write cursor
//! CAS loops and topology changes, and the invariants below checked after every step.
//!
//! # Layout
//! - `sim.rs`: the PRNG, the nodes (open, crash, turn), the message moves, one step, the tests.
//! - `sim/net.rs`: the simulated network.
//! - `sim/workload.rs`: the clients and every proposal's reply.
//! - `sim/phase.rs`: chaos (the faults) and calm (the liveness check).
//! - `sim/check.rs`: the invariants and the model they compare with.
//!
//! The driver records what it applies for the checks (`Driver::applied_log`, tests only).
//!
//! # One step
//! 1. The clock advances 10–50 ms.
//! 2. The phase moves on (see "Phases"); in chaos a fault may strike: isolate a node, split
//!    the group (a minority from a majority), cut one direction of one link, heal, restart a
//!    node (drop its `Driver`, reopen its directory with a fresh `Shared`), or crash one for a
//!    while, or pause one (no turns while its inbox fills: a stalled process). Half the faults
//!    strike the leader. Every (re)opened node proposes its `NodeBoot`.
//! 3. Messages due are delivered to their node's inbox. One due on a cut link or to a down
//!    node is dropped and reported to its sender (`Unreachable`), as the real transport does;
//!    a `MsgSnapshot` always ends in exactly one `SnapshotDone` (ok when delivered).
//! 4. Clients (`workload.rs`) poll their replies (`try_recv`) and start operations.
//! 5. Every live node, in a random order, runs one `turn` with its inbox; its messages enter
//!    the network (`net.rs`), which drops some at once (reported, or silently lost). Before
//!    the turn its disk makes the log writes queued (`writer.rs`, run by hand here): usually
//!    all, one turn in ten none, one in ten a prefix. A crash loses the writes not made, so
//!    a node that told raft-rs too early that a Ready was durable breaks invariant 2 or 4.
//!
//! # Invariants (`check.rs`; a failure panics with the seed, the step and the last events)
//! 1. At most one leader per term, over the (term, leader) every node reports.
//! 2. One committed log: every node that applies index `i` applies the same term, commands
//!    and outcomes there; a model replaying that log gives the same outcomes; and every
//!    node's whole state (snapshot JSON digest) equals the model's at its applied index —
//!    which covers snapshots installed from a leader and restarts from a node's own snapshot.
//!    No publisher body is enqueued twice: an entry proposed again after a leader change
//!    applies once, whichever copy comes first (the other is applied as nothing by every node).
//! 3. A live node's applied index never decreases; a restarted node starts at its snapshot
//!    or above, never below it.
//! 4. A proposal answered `Ok` is in the log after the index its node had applied when it was
//!    proposed, with exactly those outcomes; no two proposers win a CAS from the same
//!    `expected`; at the end every node that applied a winning CAS's index holds its cursor or
//!    more. A live driver answers every proposal and read barrier by its first turn
//!    `PROPOSE_TIMEOUT` after the turn that took it, and never drops one unanswered.
//! 5. Liveness: 10 s after the network healed and every node came up, one leader is known to
//!    every node at one term, and a probe proposed on every node commits and is visible on
//!    every node within 5 s. The network stops dropping messages for the probes (it still
//!    delays, duplicates and reorders): a follower's proposal travels to the leader as one
//!    `MsgPropose` that nobody retransmits, so one lost message holds it for the whole
//!    `PROPOSE_TIMEOUT` (10 s, then `NoQuorum`) — the real transport (TCP) loses messages
//!    only with their connection.
//! 6. A read barrier (`ReadIndex`) answered `Ok` has applied every index committed on any node
//!    when it was asked, and sees every CAS answered before then.
//!
//! # Phases
//! Chaos (10–25 s of simulated time with faults), then calm: heal, restart the crashed nodes,
//! 10 s without faults, the liveness check (invariant 5); again until the step budget is
//! spent, and always a last calm phase, so every seed ends checked for liveness.
//!
//! # Determinism
//! All randomness comes from one seeded PRNG. raft-rs draws election timeouts from
//! `thread_rng`; the simulator overrides the timeout whenever a node's (term, role) changed,
//! which is when raft-rs redraws it. The end-of-seed line prints a fingerprint of the final
//! state; the same seed gives the same fingerprint.
//!
//! # Running
//! `cargo test --lib meta::sim` runs 20 seeds × 3,000 steps on 3 nodes and 8 on 5 nodes
//! (about 0.4 s and 1 s of CPU a seed in a debug build; the nodes' directories are on tmpfs,
//! see [`sim_dir`]). The environment:
//! - `RINGMQ_SIM_SEED=<seed>` reruns one seed (a failure prints the line to rerun it);
//! - `RINGMQ_SIM_SEEDS=<n>` runs seeds 1..=n, `RINGMQ_SIM_STEPS=<n>` sets the steps per seed;
//! - `RINGMQ_SIM_TRACE=1` prints every event as it happens, `=2` every message sent too;
//! - `RINGMQ_SIM_DIR=<dir>` puts the nodes' directories there.
//!
//! The end-of-seed line (`--nocapture`) counts, among others, the proposals answered
//! `NoQuorum` whose entry the log already held: the proposer was cut off from the leader's
//! appends for the whole `PROPOSE_TIMEOUT`, so its outcome is unknown to it.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use raft::eraftpb::MessageType;
use raft::StateRole;

use super::driver::{Driver, Request, Shared};
use super::net::{ClusterSpec, RaftNet};
use super::topology::NodeId;
use super::writer::LogWriter;
use super::{Counters, MetaConfig};

mod check;
mod net;
mod phase;
mod publisher;
mod workload;

/// Simulated time, milliseconds since the start of the run.
type Ms = u64;

/// The simulator's PRNG: splitmix64 to spread the seed, xorshift64* after.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            xs.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// One simulated node: its directory outlives its drivers.
struct Node {
    id: NodeId,
    dir: tempfile::TempDir,
    /// None while crashed.
    driver: Option<Driver>,
    /// Requests for its next turn (messages, reports, proposals, read barriers).
    inbox: Vec<Request>,
    /// (term, role) when its election timeout was last set (see "Determinism").
    timeout_key: Option<(u64, StateRole)>,
    /// Applied index after its last turn (invariant 3).
    applied: u64,
    /// Its snapshot index when it last crashed: a restart may not start below it.
    floor: u64,
    /// Bumped at every open: replies from an older driver are not checked against it.
    incarnation: u32,
    down_until: Option<Ms>,
    /// Paused (a stalled process: no turns; its inbox fills) until then.
    paused_until: Option<Ms>,
    /// When its current driver last ran a turn.
    last_turn: Option<Ms>,
}

enum Phase {
    Chaos { until: Ms },
    Calm { since: Ms },
    Probe { since: Ms, probes: Vec<(workload::Pending, bool)>, names: Vec<String> },
}

#[derive(Default)]
struct Stats {
    restarts: u64,
    calm_checks: u64,
    /// Writes left queued at a turn (a slow disk), summed over turns.
    writes_held: u64,
    /// Queued writes a crash threw away.
    writes_lost: u64,
}

struct Sim {
    test: &'static str,
    seed: u64,
    steps: u64,
    step: u64,
    t: Ms,
    base: Instant,
    rng: Rng,
    config: MetaConfig,
    nodes: Vec<Node>,
    outbox: Arc<net::Outbox>,
    net: net::Network,
    /// Per mille of chaos steps that strike a fault.
    fault_pm: u64,
    phase: Phase,
    done: bool,
    work: workload::Workload,
    check: check::Checker,
    /// The last events, printed on a failure.
    trace: VecDeque<String>,
    /// `RINGMQ_SIM_TRACE`: 1 prints every event as it happens, 2 every message sent too.
    verbose: u64,
    stats: Stats,
}

const TRACE_EVENTS: usize = 80;
/// Quiet time after healing before the liveness check, and the bound for the probes (ms).
const CALM_MS: Ms = 10_000;
const PROBE_MS: Ms = 5_000;
/// Longest pause of a node (ms).
const MAX_PAUSE_MS: Ms = 3_000;

impl Sim {
    fn new(test: &'static str, n: u64, seed: u64, steps: u64) -> Sim {
        let mut rng = Rng::new(seed);
        let profile = net::Profile::draw(&mut rng);
        let fault_pm = rng.range(10, 40);
        let nodes = (1..=n)
            .map(|id| Node {
                id,
                dir: tempfile::tempdir_in(sim_dir()).expect("temp dir"),
                driver: None,
                inbox: Vec::new(),
                timeout_key: None,
                applied: 0,
                floor: 0,
                incarnation: 0,
                down_until: None,
                paused_until: None,
                last_turn: None,
            })
            .collect();
        let first_chaos = rng.range(5_000, 20_000);
        let mut sim = Sim {
            test,
            seed,
            steps,
            step: 0,
            t: 0,
            base: Instant::now(),
            rng,
            config: MetaConfig { compact_entries: 20, ..MetaConfig::default() },
            nodes,
            outbox: Arc::new(net::Outbox::default()),
            net: net::Network::new(profile),
            fault_pm,
            phase: Phase::Chaos { until: first_chaos },
            done: false,
            work: workload::Workload::new(),
            check: check::Checker::new(),
            trace: VecDeque::new(),
            verbose: env_u64("RINGMQ_SIM_TRACE").unwrap_or(0),
            stats: Stats::default(),
        };
        sim.event(format!("network {profile:?}, faults {fault_pm}‰ of chaos steps"));
        for i in 0..sim.nodes.len() {
            if let Err(e) = sim.open(i) {
                sim.fail(&e);
            }
        }
        sim
    }

    fn now(&self) -> Instant {
        self.base + Duration::from_millis(self.t)
    }

    fn event(&mut self, what: String) {
        if self.trace.len() == TRACE_EVENTS {
            self.trace.pop_front();
        }
        let line = format!("step {} t={}ms: {what}", self.step, self.t);
        if self.verbose > 0 {
            eprintln!("{line}");
        }
        self.trace.push_back(line);
    }

    fn fail(&self, what: &str) -> ! {
        let steps = if self.steps == DEFAULT_STEPS { String::new() } else { format!("RINGMQ_SIM_STEPS={} ", self.steps) };
        let mut msg = format!(
            "meta sim: {what}\n  {} nodes, seed {}, step {}, t = {} ms\n  rerun: RINGMQ_SIM_SEED={} {steps}cargo test --lib meta::sim::{}\n  last events:\n",
            self.nodes.len(),
            self.seed,
            self.step,
            self.t,
            self.seed,
            self.test
        );
        for e in &self.trace {
            msg.push_str("    ");
            msg.push_str(e);
            msg.push('\n');
        }
        panic!("{msg}");
    }

    /// Runs every step, then the last liveness check and the end checks; returns the run's
    /// fingerprint.
    fn run(&mut self) -> u64 {
        // Bounded: the phase ends the run once the budget is spent and the last probe passed;
        // a probe that does not pass within PROBE_MS fails the run.
        while !self.done {
            let r = catch_unwind(AssertUnwindSafe(|| self.step()));
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => self.fail(&e),
                Err(p) => {
                    let why = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                    self.fail(&format!("panic: {}", why.unwrap_or_default()));
                }
            }
        }
        if let Err(e) = self.finish() {
            self.fail(&e);
        }
        self.fingerprint()
    }

    /// What a replay of the seed must reproduce: the final state, the log length, the terms,
    /// the steps and the messages sent.
    fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (check::digest(self.check.model()), self.check.model_index(), self.check.terms(), self.step, self.t, self.net.stats.sent)
            .hash(&mut h);
        h.finish()
    }

    fn step(&mut self) -> Result<(), String> {
        self.step += 1;
        self.t += self.rng.range(10, 50);
        self.phase_step()?;
        self.revive()?;
        self.deliver();
        self.clients_step()?;
        let mut order: Vec<usize> = (0..self.nodes.len()).collect();
        self.rng.shuffle(&mut order);
        for i in order {
            let node = &mut self.nodes[i];
            if node.paused_until.is_some_and(|t| t <= self.t) {
                node.paused_until = None;
            }
            if node.driver.is_some() && node.paused_until.is_none() {
                self.turn(i)?;
            }
        }
        Ok(())
    }

    /// Opens node `i`'s driver on its directory (first start or restart).
    fn open(&mut self, i: usize) -> Result<(), String> {
        let voters: Vec<NodeId> = self.nodes.iter().map(|n| n.id).collect();
        let net: Arc<dyn RaftNet> = self.outbox.clone();
        let now = self.now();
        let node = &mut self.nodes[i];
        let counters = Arc::new(Counters::default());
        let shared = Arc::new(Shared::new(node.id, true, counters.clone()));
        let spec = ClusterSpec { voters, joining: false, net };
        let mut d = Driver::open(node.dir.path(), shared, counters, self.config, Some(spec), now)
            .map_err(|e| format!("node {} does not reopen: {e}", node.id))?;
        d.applied_log = Some(Vec::new());
        d.writer = LogWriter::manual(d.counters.clone(), d.net.clone());
        let applied = d.shared.state.lock().applied_index;
        if applied < node.floor {
            return Err(format!("node {} restarted at index {applied}, below its snapshot at {}", node.id, node.floor));
        }
        node.applied = applied;
        node.timeout_key = None;
        node.incarnation += 1;
        node.down_until = None;
        node.paused_until = None;
        node.last_turn = None;
        node.inbox.clear();
        node.driver = Some(d);
        let id = node.id;
        self.fix_timeout(i);
        let state = self.nodes[i].driver.as_ref().map(|d| d.shared.state.lock().clone()).unwrap_or_default();
        self.check.state_matches(id, &state)?;
        self.event(format!("node {id} opened at applied index {applied}"));
        self.boot(i);
        Ok(())
    }

    /// Drops node `i`'s driver; it reopens at once (`down_for` None) or after `down_for` ms.
    fn crash(&mut self, i: usize, down_for: Option<Ms>) -> Result<(), String> {
        let Some(d) = self.nodes[i].driver.take() else { return Ok(()) };
        self.nodes[i].floor = d.raw.store().snapshot_index();
        self.stats.writes_lost += d.writer.queued() as u64;
        drop(d);
        self.nodes[i].inbox.clear();
        self.stats.restarts += 1;
        let id = self.nodes[i].id;
        match down_for {
            None => {
                self.event(format!("node {id} restarts"));
                self.open(i)
            }
            Some(ms) => {
                self.event(format!("node {id} crashes for {ms} ms"));
                self.nodes[i].down_until = Some(self.t + ms);
                Ok(())
            }
        }
    }

    fn revive(&mut self) -> Result<(), String> {
        for i in 0..self.nodes.len() {
            if self.nodes[i].down_until.is_some_and(|t| t <= self.t) {
                self.open(i)?;
            }
        }
        Ok(())
    }

    /// Sets raft-rs's randomized election timeout from the simulator's PRNG when raft-rs has
    /// redrawn it (its (term, role) changed).
    fn fix_timeout(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let Some(d) = node.driver.as_mut() else { return };
        let r = &mut d.raw.raft;
        let key = (r.term, r.state);
        if node.timeout_key != Some(key) {
            let et = r.election_timeout() as u64;
            r.set_randomized_election_timeout((et + self.rng.below(et)) as usize);
            node.timeout_key = Some(key);
        }
    }

    /// One turn of node `i`, its checks (invariants 1–3), and its messages into the network.
    fn turn(&mut self, i: usize) -> Result<(), String> {
        let now = self.now();
        let node = &mut self.nodes[i];
        let id = node.id;
        let reqs = std::mem::take(&mut node.inbox);
        let d = node.driver.as_mut().ok_or("turn of a down node")?;
        node.last_turn = Some(self.t);
        // The disk: usually every queued write lands before the turn; sometimes none or a
        // prefix (a slow fdatasync), so raft-rs runs ahead of its own durable log.
        let queued = d.writer.queued();
        let land = match self.rng.below(10) {
            0 => 0,
            1 => self.rng.below(queued as u64 + 1) as usize,
            _ => queued,
        };
        self.stats.writes_held += (queued - land) as u64;
        d.writer.run_manual(land).map_err(|e| format!("node {id}: log write failed: {e}"))?;
        match d.turn(reqs, now) {
            Ok(false) => {}
            Ok(true) => return Err(format!("node {id} asked to stop")),
            Err(e) => return Err(format!("node {id}: driver error: {e}")),
        }
        self.fix_timeout(i);
        let d = self.nodes[i].driver.as_mut().ok_or("driver vanished")?;
        let (term, leader, role) = (d.raw.raft.term, d.raw.raft.leader_id, d.raw.raft.state);
        let log = d.applied_log.as_mut().map(std::mem::take).unwrap_or_default();
        if leader != 0 && self.check.leader_seen(id, term, leader)? {
            self.event(format!("node {id} sees leader {leader} in term {term} (role {role:?})"));
        }
        for (index, term, cmds, outcomes) in log {
            self.check.applied(id, index, term, cmds, outcomes)?;
        }
        let node = &mut self.nodes[i];
        let d = node.driver.as_ref().ok_or("driver vanished")?;
        let state = d.shared.state.lock();
        if state.applied_index < node.applied {
            return Err(format!("node {id}'s applied index went back from {} to {}", node.applied, state.applied_index));
        }
        if state.applied_index != node.applied {
            node.applied = state.applied_index;
            self.check.state_matches(id, &state)?;
        }
        drop(state);
        self.send_out();
        Ok(())
    }

    /// Moves every message the last turn sent into the network.
    fn send_out(&mut self) {
        let msgs = std::mem::take(&mut *self.outbox.0.lock());
        for msg in msgs {
            if self.verbose > 1 {
                eprintln!(
                    "t={} {:?} {}->{} term {} index {} log_term {} commit {} entries {} reject {} hint {}",
                    self.t,
                    msg.get_msg_type(),
                    msg.from,
                    msg.to,
                    msg.term,
                    msg.index,
                    msg.log_term,
                    msg.commit,
                    msg.entries.len(),
                    msg.reject,
                    msg.reject_hint
                );
            }
            let (from, to) = (msg.from, msg.to);
            let snapshot = msg.get_msg_type() == MessageType::MsgSnapshot;
            if let net::Sent::Dropped = self.net.send(&mut self.rng, self.t, msg) {
                self.report(from, if snapshot { Request::SnapshotDone { to, ok: false } } else { Request::Unreachable(to) });
            }
        }
    }

    /// A transport report to `to`'s driver (lost when it is down).
    fn report(&mut self, to: NodeId, req: Request) {
        if let Some(node) = self.nodes.iter_mut().find(|n| n.id == to && n.driver.is_some()) {
            node.inbox.push(req);
        }
    }

    fn deliver(&mut self) {
        for msg in self.net.due(self.t) {
            let (from, to) = (msg.from, msg.to);
            let snapshot = msg.get_msg_type() == MessageType::MsgSnapshot;
            let up = self.nodes.iter().position(|n| n.id == to && n.driver.is_some());
            let ok = up.is_some() && !self.net.is_cut(from, to);
            if let (Some(i), true) = (up, ok) {
                self.nodes[i].inbox.push(Request::Step(Box::new(msg)));
            }
            if snapshot {
                self.report(from, Request::SnapshotDone { to, ok });
            } else if !ok {
                self.report(from, Request::Unreachable(to));
            }
        }
    }

    /// End checks: every answered winning CAS is held by every node that applied its index
    /// (invariant 4), and a summary line.
    fn finish(&mut self) -> Result<(), String> {
        for (queue, new, index) in &self.check.wins {
            for n in &self.nodes {
                let Some(d) = n.driver.as_ref() else { continue };
                let st = d.shared.state.lock();
                if st.applied_index >= *index && st.cursor("/", queue).is_none_or(|c| c < *new) {
                    return Err(format!("node {}: CAS {queue} ->{new} won at {index}, cursor {:?}", n.id, st.cursor("/", queue)));
                }
            }
        }
        let s = &self.net.stats;
        eprintln!(
            "meta sim {} nodes seed {}: {} steps, {:.1} s, {} entries, {} terms, {} restarts ({} writes lost), {} writes held, {} calm checks, {} CAS won, {} grows joined, {} enqueued in order, {} answered ({} failed, {} of them committed), {} reads, net {} sent {} dropped {} dup {} snapshots, {} states compared ({} ahead), fingerprint {:016x}",
            self.nodes.len(),
            self.seed,
            self.step,
            self.t as f64 / 1000.0,
            self.check.model_index(),
            self.check.terms(),
            self.stats.restarts,
            self.stats.writes_lost,
            self.stats.writes_held,
            self.stats.calm_checks,
            self.check.wins.len(),
            self.work.joins,
            self.work.publisher.enqueued,
            self.work.answered,
            self.work.failed,
            self.work.committed_but_failed,
            self.work.reads,
            s.sent,
            s.dropped,
            s.duplicated,
            s.snapshots,
            self.check.compared,
            self.check.ahead,
            self.fingerprint()
        );
        Ok(())
    }
}

const DEFAULT_STEPS: u64 = 3_000;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Where the nodes' directories go: `RINGMQ_SIM_DIR`, else `/dev/shm` when it exists, else
/// the system temp dir. The simulator restarts processes, it does not cut power: what a node
/// wrote survives whether or not it was fsynced, so tmpfs loses nothing and spares the
/// ~2,000 fsyncs of a seed (0.25 ms each on an idle disk, several ms on a busy one).
fn sim_dir() -> std::path::PathBuf {
    if let Ok(dir) = std::env::var("RINGMQ_SIM_DIR") {
        return dir.into();
    }
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// Runs the seeds the environment asks for (see "Running") on `n` nodes.
fn run_seeds(test: &'static str, n: u64, default_seeds: u64) {
    let steps = env_u64("RINGMQ_SIM_STEPS").unwrap_or(DEFAULT_STEPS);
    let seeds: Vec<u64> = match env_u64("RINGMQ_SIM_SEED") {
        Some(seed) => vec![seed],
        None => (1..=env_u64("RINGMQ_SIM_SEEDS").unwrap_or(default_seeds)).collect(),
    };
    for seed in seeds {
        Sim::new(test, n, seed, steps).run();
    }
}

#[test]
fn three_nodes() {
    run_seeds("three_nodes", 3, 20);
}

#[test]
fn five_nodes() {
    run_seeds("five_nodes", 5, 8);
}

#[test]
fn a_seed_replays_the_same_run() {
    let a = Sim::new("a_seed_replays_the_same_run", 3, 77, 800).run();
    let b = Sim::new("a_seed_replays_the_same_run", 3, 77, 800).run();
    assert_eq!(a, b, "seed 77 gave two different final states");
}
