//! The simulation's clients: read-modify-write CAS loops on a few queues (reading the cursor
//! behind a read barrier or straight from a node's state, retrying on a rejection), exchange
//! declarations and bindings, a replica-set cycle on one queue (enqueue, grow, copy, join,
//! leave: `grow.rs`), each sent to a random node; plus the system proposals (the
//! queues' setup, every node's `NodeBoot`, the liveness probes). Every reply is polled with
//! `try_recv` and checked (invariants 4 and 6); a client gives up waiting after 3 s, but the
//! reply is still polled and checked when it comes.

use amq_protocol::types::FieldTable;
use flume::TryRecvError;

use super::{Ms, Sim};
use crate::meta::driver::{Request, PROPOSE_TIMEOUT};
use crate::meta::state::tests::{bind, exchange, queue};
use crate::meta::state::{Command, Outcome};
use crate::meta::topology::{DestKind, ExchangeKind, QueueDef};
use crate::meta::MetaError;

/// Clients, each with one operation at a time.
const CLIENTS: usize = 6;
/// The queues the clients move cursors on.
const QUEUES: [&str; 3] = ["q0", "q1", "q2"];
/// Exchange names the clients declare and bind (`x0`..).
const EXCHANGES: u64 = 12;
/// The queue whose replica set the clients shrink and grow (`grow.rs`): declared with the set
/// `[1]`, enqueued to, copied to a node outside the set, joined, left again.
const GROWN: &str = "g0";
/// A client stops waiting for a reply after this long (the reply is still checked).
const PATIENCE_MS: Ms = 3_000;
/// A live driver answers every proposal and read barrier at its first turn this long after
/// the turn that took it.
const TIMEOUT_MS: Ms = PROPOSE_TIMEOUT.as_millis() as Ms;
/// CAS retries after a rejection before a client goes idle.
const CAS_RETRIES: u32 = 8;

/// A proposal waiting for its reply.
pub(super) struct Pending {
    /// Index of the node it was proposed to.
    node: usize,
    incarnation: u32,
    pub(super) cmds: Vec<Command>,
    rx: flume::Receiver<Result<Vec<Outcome>, MetaError>>,
    since: Ms,
    /// The time of the node's turn that took it.
    taken: Option<Ms>,
    /// The node's applied index when proposed: the entry comes after it.
    after: u64,
}

/// A read barrier waiting for its reply.
struct Read {
    node: usize,
    incarnation: u32,
    queue: usize,
    rx: flume::Receiver<Result<(), MetaError>>,
    since: Ms,
    taken: Option<Ms>,
    /// The highest cursor answered on this queue when it was asked (invariant 6).
    floor: u64,
    /// The highest commit index on any node when it was asked: the node must have applied
    /// that much when it answers.
    floor_index: u64,
}

pub(super) enum Answer {
    /// Answered Ok (and found in the log).
    Ok(Vec<Outcome>),
    /// Answered with an error, or its driver was dropped.
    Failed(String),
}

enum Wait {
    Idle(Ms),
    Read(Read),
    Propose(Pending, u32),
}

#[derive(Default)]
pub(super) struct Workload {
    clients: Vec<Wait>,
    /// Proposals nobody waits for any more, and the system ones: still checked.
    others: Vec<Pending>,
    /// Read barriers nobody waits for any more: still checked.
    other_reads: Vec<Read>,
    setup: Option<Pending>,
    ready: bool,
    pub(super) answered: u64,
    pub(super) failed: u64,
    /// CAS answered `NoQuorum` though the log already held them (outcome lost).
    pub(super) committed_but_failed: u64,
    /// Read barriers answered and checked.
    pub(super) reads: u64,
    /// Grows of [`GROWN`] answered joined.
    pub(super) joins: u64,
    /// The pipelined publisher (`publisher.rs`).
    pub(super) publisher: super::publisher::Publisher,
}

impl Workload {
    pub(super) fn new() -> Workload {
        Workload { clients: (0..CLIENTS).map(|_| Wait::Idle(0)).collect(), ..Workload::default() }
    }
}

fn cas(q: usize, expected: u64, new: u64) -> Command {
    Command::CursorCas { vhost: "/".into(), queue: QUEUES[q].into(), expected, new }
}

impl Sim {
    /// Proposes `cmds` on node `i` (taken at its next turn).
    pub(super) fn propose(&mut self, i: usize, cmds: Vec<Command>) -> Pending {
        let (reply, rx) = flume::unbounded();
        let node = &mut self.nodes[i];
        node.inbox.push(Request::Propose { cmds: cmds.clone(), reply });
        Pending { node: i, incarnation: node.incarnation, cmds, rx, since: self.t, taken: None, after: node.applied }
    }

    /// Node `i` just opened: it proposes its boot (its outcome is checked, nobody waits).
    pub(super) fn boot(&mut self, i: usize) {
        let id = self.nodes[i].id;
        // The epoch it boots from, as its own state has it (MetaHandle::boot does the same).
        let before = self.nodes[i].driver.as_ref().map_or(0, |d| d.shared.state.lock().boot_epochs.get(&id).copied().unwrap_or(0));
        let p = self.propose(i, vec![Command::NodeBoot { node: id, cluster: Some(before) }]);
        self.work.others.push(p);
    }

    pub(super) fn probe(&mut self, i: usize, name: &str) -> Pending {
        self.propose(i, vec![Command::DeclareExchange(exchange(name, ExchangeKind::Fanout, true))])
    }

    /// True while node `i` runs the driver `incarnation`.
    pub(super) fn same_driver(&self, i: usize, incarnation: u32) -> bool {
        self.nodes[i].incarnation == incarnation && self.nodes[i].driver.is_some()
    }

    /// True once node `i` has run a turn `PROPOSE_TIMEOUT` after the one that took a request
    /// made at `since` (`taken` remembers that turn): its driver has answered it by then.
    fn overdue(&self, i: usize, since: Ms, taken: &mut Option<Ms>) -> bool {
        let last = self.nodes[i].last_turn;
        if taken.is_none() && last.is_some_and(|t| t >= since) {
            *taken = last;
        }
        matches!((*taken, last), (Some(t0), Some(t)) if t >= t0 + TIMEOUT_MS)
    }

    /// Polls one proposal; an Ok answer is checked against the log (invariant 4).
    pub(super) fn poll(&mut self, p: &mut Pending) -> Result<Option<Answer>, String> {
        let live = self.same_driver(p.node, p.incarnation);
        let overdue = self.overdue(p.node, p.since, &mut p.taken);
        match p.rx.try_recv() {
            Ok(Ok(outcomes)) => {
                self.check.answered(&p.cmds, &outcomes, p.after)?;
                self.work.answered += 1;
                Ok(Some(Answer::Ok(outcomes)))
            }
            Ok(Err(e)) => {
                self.work.failed += 1;
                if matches!(e, MetaError::NoQuorum { .. }) && p.cmds.len() == 1 && self.check.cas_won_after(&p.cmds[0], p.after) {
                    self.work.committed_but_failed += 1;
                    let what = format!(
                        "node {} answered {e} to {:?} (proposed at {} ms after index {}), which the log holds",
                        self.nodes[p.node].id, p.cmds, p.since, p.after
                    );
                    self.event(what);
                }
                Ok(Some(Answer::Failed(e.to_string())))
            }
            Err(TryRecvError::Empty) if live && overdue => {
                Err(format!("node {} has not answered {:?}, proposed at {} ms", self.nodes[p.node].id, p.cmds, p.since))
            }
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) if live => {
                Err(format!("node {} dropped the reply of {:?} without an answer", self.nodes[p.node].id, p.cmds))
            }
            Err(TryRecvError::Disconnected) => Ok(Some(Answer::Failed("its driver was dropped".into()))),
        }
    }

    /// Polls one read barrier: `Some(Some(cursor))` answered Ok and checked (invariant 6),
    /// `Some(None)` failed (or its driver was dropped), `None` not answered yet.
    fn poll_read(&mut self, r: &mut Read) -> Result<Option<Option<u64>>, String> {
        let live = self.same_driver(r.node, r.incarnation);
        let overdue = self.overdue(r.node, r.since, &mut r.taken);
        let id = self.nodes[r.node].id;
        match r.rx.try_recv() {
            Ok(Ok(())) if live => {
                let (applied, cursor) = self.nodes[r.node]
                    .driver
                    .as_ref()
                    .map(|d| {
                        let st = d.shared.state.lock();
                        (st.applied_index, st.cursor("/", QUEUES[r.queue]))
                    })
                    .unwrap_or_default();
                if applied < r.floor_index {
                    return Err(format!(
                        "stale read on node {id}: applied {applied} behind a barrier, {} was committed before it",
                        r.floor_index
                    ));
                }
                if cursor.is_none_or(|c| c < r.floor) {
                    return Err(format!(
                        "stale read on node {id}: {} is {cursor:?} behind a barrier, {} was answered before it",
                        QUEUES[r.queue], r.floor
                    ));
                }
                self.work.reads += 1;
                Ok(Some(Some(cursor.unwrap_or(0))))
            }
            Ok(_) => Ok(Some(None)),
            Err(TryRecvError::Disconnected) if live => Err(format!("node {id} dropped a read barrier without an answer")),
            Err(TryRecvError::Disconnected) => Ok(Some(None)),
            Err(TryRecvError::Empty) if live && overdue => {
                Err(format!("node {id} has not answered a read barrier asked at {} ms", r.since))
            }
            Err(TryRecvError::Empty) => Ok(None),
        }
    }

    /// A random node that is up.
    pub(super) fn up_node(&mut self) -> Option<usize> {
        let up: Vec<usize> = (0..self.nodes.len()).filter(|&i| self.nodes[i].driver.is_some()).collect();
        if up.is_empty() {
            return None;
        }
        Some(up[self.rng.below(up.len() as u64) as usize])
    }

    /// Polls every reply and moves every client on (step 4 of a simulation step).
    pub(super) fn clients_step(&mut self) -> Result<(), String> {
        if !self.work.ready {
            self.setup_step()?;
        }
        let mut clients = std::mem::take(&mut self.work.clients);
        let mut r = Ok(());
        for c in clients.iter_mut() {
            let wait = std::mem::replace(c, Wait::Idle(0));
            match self.client_step(wait) {
                Ok(next) => *c = next,
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        self.work.clients = clients;
        r?;
        self.publisher_step()?;
        for mut r in std::mem::take(&mut self.work.other_reads) {
            if self.poll_read(&mut r)?.is_none() {
                self.work.other_reads.push(r);
            }
        }
        let others = std::mem::take(&mut self.work.others);
        for p in others {
            let mut p = p;
            if self.poll(&mut p)?.is_none() {
                self.work.others.push(p);
            }
        }
        Ok(())
    }

    /// True once the clients' setup (vhost, queues) was answered.
    pub(super) fn work_ready(&self) -> bool {
        self.work.ready
    }

    /// Declares the vhost and the queues (retried until answered Ok).
    fn setup_step(&mut self) -> Result<(), String> {
        if let Some(mut p) = self.work.setup.take() {
            match self.poll(&mut p)? {
                None => self.work.setup = Some(p),
                Some(Answer::Ok(_)) => {
                    self.work.ready = true;
                    self.event("setup answered".into());
                }
                Some(Answer::Failed(_)) => {}
            }
            return Ok(());
        }
        if let Some(i) = self.up_node() {
            let mut cmds = vec![Command::DeclareVhost { name: "/".into() }];
            cmds.extend(QUEUES.iter().map(|q| Command::DeclareQueue(queue(q, true, None))));
            cmds.push(Command::DeclareQueue(QueueDef { replicas: vec![1], ..queue(GROWN, true, None) }));
            cmds.push(Command::DeclareQueue(queue(super::publisher::PUBLISHED, true, None)));
            self.work.setup = Some(self.propose(i, cmds));
        }
        Ok(())
    }

    fn client_step(&mut self, wait: Wait) -> Result<Wait, String> {
        let t = self.t;
        match wait {
            Wait::Idle(until) if t < until || !self.work.ready => Ok(Wait::Idle(until)),
            Wait::Idle(_) => Ok(self.start_op()),
            Wait::Read(mut r) => match self.poll_read(&mut r)? {
                Some(Some(c)) => {
                    let new = c + self.rng.range(1, 1_000);
                    Ok(Wait::Propose(self.propose(r.node, vec![cas(r.queue, c, new)]), 0))
                }
                Some(None) => Ok(Wait::Idle(t + 100)),
                None if t > r.since + PATIENCE_MS => {
                    self.work.other_reads.push(r);
                    Ok(Wait::Idle(t))
                }
                None => Ok(Wait::Read(r)),
            },
            Wait::Propose(mut p, attempt) => match self.poll(&mut p)? {
                None if t > p.since + PATIENCE_MS => {
                    self.work.others.push(p);
                    Ok(Wait::Idle(t))
                }
                None => Ok(Wait::Propose(p, attempt)),
                Some(Answer::Ok(outcomes)) => Ok(self.after_answer(&p, &outcomes, attempt)),
                Some(Answer::Failed(_)) => Ok(Wait::Idle(t + self.rng.range(50, 300))),
            },
        }
    }

    /// The read-modify-write loop: a rejected CAS is retried from the current cursor.
    fn after_answer(&mut self, p: &Pending, outcomes: &[Outcome], attempt: u32) -> Wait {
        let t = self.t;
        if let (Some(Command::JoinReplicaSet { .. }), Some(Outcome::Moved)) = (p.cmds.first(), outcomes.first()) {
            self.work.joins += 1;
        }
        if let (Some(Command::CursorCas { queue, .. }), Some(Outcome::CasRejected { current: Some(c) })) =
            (p.cmds.first(), outcomes.first())
        {
            if attempt < CAS_RETRIES {
                let q = QUEUES.iter().position(|x| x == queue).unwrap_or(0);
                if let Some(i) = self.up_node() {
                    let new = c + self.rng.range(1, 1_000);
                    return Wait::Propose(self.propose(i, vec![cas(q, *c, new)]), attempt + 1);
                }
            }
        }
        Wait::Idle(t + self.rng.range(0, 150))
    }

    /// The next step of the replica-set cycle of [`GROWN`], from node `i`'s state: enqueue,
    /// start a grow to a node outside the set, copy the next range (stale, repeated or
    /// out-of-order proposals are refused by the state machine), join at the tail, or leave
    /// a full set again. `None` before the setup applied there.
    fn grow_step(&mut self, i: usize) -> Option<Vec<Command>> {
        let key = ("/".to_string(), GROWN.to_string());
        let (set, grow, next) = self.nodes[i].driver.as_ref().and_then(|d| {
            let st = d.shared.state.lock();
            let def = st.topology.queues.get(&key)?;
            Some((def.replicas.clone(), st.growing.get(&key).cloned(), st.next_offsets.get(&key).copied().unwrap_or(0)))
        })?;
        let ids: Vec<u64> = self.nodes.iter().map(|n| n.id).collect();
        let (vhost, queue) = ("/".to_string(), GROWN.to_string());
        let cmd = match grow {
            _ if self.rng.chance(300) => {
                Command::Enqueue { vhost, queue, flags: 1, header: bytes::Bytes::new(), body: bytes::Bytes::from_static(b"m") }
            }
            Some(g) if g.copied < next && !self.rng.chance(200) => {
                let to = (g.copied + self.rng.range(1, 4)).min(next);
                Command::CopyMessages { vhost, queue, id: g.id, from: g.copied, to, messages: Vec::new() }
            }
            Some(g) => Command::JoinReplicaSet { vhost, queue, id: g.id, tail: g.copied },
            None if set.len() < ids.len() => {
                let outside: Vec<u64> = ids.iter().copied().filter(|n| !set.contains(n)).collect();
                let node = outside[self.rng.below(outside.len() as u64) as usize];
                Command::GrowReplicaSet { vhost, queue, node, id: self.rng.range(1, 1 << 40) }
            }
            None => Command::LeaveReplicaSet { vhost, queue, node: set[self.rng.below(set.len() as u64) as usize] },
        };
        Some(vec![cmd])
    }

    fn start_op(&mut self) -> Wait {
        let t = self.t;
        let Some(i) = self.up_node() else { return Wait::Idle(t + 100) };
        let roll = self.rng.below(100);
        if roll < 70 {
            let q = self.rng.below(QUEUES.len() as u64) as usize;
            if self.rng.chance(400) {
                let (reply, rx) = flume::unbounded();
                self.nodes[i].inbox.push(Request::ReadIndex { reply });
                let floor = self.check.answered_max.get(QUEUES[q]).copied().unwrap_or(0);
                let floor_index =
                    self.nodes.iter().filter_map(|n| n.driver.as_ref()).map(|d| d.raw.raft.raft_log.committed).max().unwrap_or(0);
                let incarnation = self.nodes[i].incarnation;
                return Wait::Read(Read { node: i, incarnation, queue: q, rx, since: t, taken: None, floor, floor_index });
            }
            let cursor = self.nodes[i].driver.as_ref().and_then(|d| d.shared.state.lock().cursor("/", QUEUES[q]));
            let Some(c) = cursor else { return Wait::Idle(t + 200) };
            let new = c + self.rng.range(1, 1_000);
            return Wait::Propose(self.propose(i, vec![cas(q, c, new)]), 0);
        }
        if roll < 78 {
            return match self.grow_step(i) {
                Some(cmds) => Wait::Propose(self.propose(i, cmds), 0),
                None => Wait::Idle(t + 100),
            };
        }
        let x = format!("x{}", self.rng.below(EXCHANGES));
        let q = QUEUES[self.rng.below(QUEUES.len() as u64) as usize];
        let key = format!("k{}", self.rng.below(3));
        let cmds = if roll < 88 {
            let kinds = [ExchangeKind::Direct, ExchangeKind::Fanout, ExchangeKind::Topic, ExchangeKind::Headers];
            let kind = kinds[self.rng.below(4) as usize];
            let mut def = exchange(&x, kind, self.rng.chance(500));
            def.arguments = FieldTable::default();
            let mut cmds = vec![Command::DeclareExchange(def)];
            if self.rng.chance(300) {
                cmds.push(Command::Bind(bind(&x, DestKind::Queue, q, &key)));
            }
            cmds
        } else if roll < 95 {
            vec![Command::Bind(bind(&x, DestKind::Queue, q, &key))]
        } else {
            vec![Command::Unbind(bind(&x, DestKind::Queue, q, &key))]
        };
        Wait::Propose(self.propose(i, cmds), 0)
    }
}
