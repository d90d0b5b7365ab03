//! The simulator's invariants (sim.rs module doc, "Invariants"): one leader per term, one
//! committed log, every node's state equal to a model that replays that log, answered
//! proposals in the log, no CAS won twice. Each check returns the broken rule as text; the
//! simulator adds the seed, the step and its trace.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use crate::meta::state::{Command, MetaState, Outcome};
use crate::meta::topology::NodeId;

/// One applied entry: its term, commands and their outcomes (empty for a leader's no-op).
struct Applied {
    term: u64,
    cmds: Vec<Command>,
    outcomes: Vec<Outcome>,
    /// The node that applied it first.
    by: NodeId,
}

#[derive(Default)]
pub(super) struct Checker {
    /// The leader of each term, as any node reported it.
    leaders: BTreeMap<u64, NodeId>,
    /// The committed log as first applied by any node, by index.
    canon: BTreeMap<u64, Applied>,
    /// The state machine replaying `canon` in index order; `digests[i]` is its digest after
    /// index `i` (`digests[0]`: the empty state).
    model: MetaState,
    digests: Vec<u64>,
    /// The CAS that won in `canon`, by (queue, expected): (new, index).
    cas_won: HashMap<(String, u64), (u64, u64)>,
    /// Each body enqueued in `canon` to the publisher's queue (each of its `Enqueue`s carries its
    /// own), with the index that enqueued it.
    enqueued: HashMap<(String, bytes::Bytes), u64>,
    /// The CAS answered `CasApplied` to a proposer, by (queue, expected): new.
    cas_answered: HashMap<(String, u64), u64>,
    /// Highest cursor answered `CasApplied` per queue, with the entry index.
    pub(super) answered_max: BTreeMap<String, u64>,
    /// Every answered winning CAS: (queue, new, index) — checked on every node at the end.
    pub(super) wins: Vec<(String, u64, u64)>,
    /// Node states compared with the model, and the ones past the model (not comparable yet).
    pub(super) compared: u64,
    pub(super) ahead: u64,
}

/// Digest of a state (its snapshot JSON), without its record of applied proposals (the model
/// applies commands only; the nodes' agreement on what they skipped is checked entry by entry).
pub(super) fn digest(state: &MetaState) -> u64 {
    let mut state = state.clone();
    state.applied_proposals.clear();
    let json = serde_json::to_vec(&state).unwrap_or_default();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    json.hash(&mut h);
    h.finish()
}

impl Checker {
    pub(super) fn new() -> Checker {
        let model = MetaState::default();
        Checker { digests: vec![digest(&model)], model, ..Checker::default() }
    }

    /// Last index of the model (every index up to it is in `canon`).
    pub(super) fn model_index(&self) -> u64 {
        self.model.applied_index
    }

    pub(super) fn model(&self) -> &MetaState {
        &self.model
    }

    /// Invariant 1: `node` sees `leader` as the leader of `term`.
    pub(super) fn leader_seen(&mut self, node: NodeId, term: u64, leader: NodeId) -> Result<bool, String> {
        match self.leaders.get(&term) {
            Some(&l) if l == leader => Ok(false),
            Some(&l) => Err(format!("two leaders in term {term}: {l} and {leader} (seen by node {node})")),
            None => {
                self.leaders.insert(term, leader);
                Ok(true)
            }
        }
    }

    pub(super) fn terms(&self) -> usize {
        self.leaders.len()
    }

    /// Invariant 2: `node` applied entry `index`; it must match what every other node applied
    /// there. Advances the model over every index now contiguous.
    pub(super) fn applied(
        &mut self,
        node: NodeId,
        index: u64,
        term: u64,
        cmds: Vec<Command>,
        outcomes: Vec<Outcome>,
    ) -> Result<(), String> {
        if let Some(c) = self.canon.get(&index) {
            if c.term != term || c.cmds != cmds {
                return Err(format!(
                    "index {index}: node {node} applied term {term} {cmds:?}, node {} applied term {} {:?}",
                    c.by, c.term, c.cmds
                ));
            }
            if c.outcomes != outcomes {
                return Err(format!("index {index}: node {node} got {outcomes:?}, node {} got {:?} from {cmds:?}", c.by, c.outcomes));
            }
            return Ok(());
        }
        if index <= self.model_index() {
            return Err(format!("index {index} applied by node {node} is below the model ({}) but not recorded", self.model_index()));
        }
        self.canon.insert(index, Applied { term, cmds, outcomes, by: node });
        // Bounded: one iteration per recorded index.
        while let Some(c) = self.canon.get(&(self.model_index() + 1)) {
            let index = self.model_index() + 1;
            if c.cmds.len() != c.outcomes.len() {
                return Err(format!("index {index}: {} commands, {} outcomes", c.cmds.len(), c.outcomes.len()));
            }
            for (cmd, got) in c.cmds.iter().zip(&c.outcomes) {
                let want = self.model.apply(cmd);
                if want != *got {
                    return Err(format!("index {index}: node {} got {got:?} from {cmd:?}, the model {want:?}", c.by));
                }
                // A proposal copied to a new leader (`driver.rs`, `repropose`) may reach the log
                // beside its original: only the first may apply, or a message is stored twice.
                if let (Command::Enqueue { queue, body, .. }, Outcome::Enqueued { .. }) = (cmd, got) {
                    if queue != super::publisher::PUBLISHED {
                        continue;
                    }
                    if let Some(i) = self.enqueued.insert((queue.clone(), body.clone()), index) {
                        return Err(format!("{queue}: the body {body:?} was enqueued at {i} and again at {index}"));
                    }
                }
                if let (Command::CursorCas { queue, expected, new, .. }, Outcome::CasApplied) = (cmd, got) {
                    if let Some((n, i)) = self.cas_won.insert((queue.clone(), *expected), (*new, index)) {
                        return Err(format!("CAS {queue} {expected}->{new} won at {index} and {expected}->{n} at {i}"));
                    }
                }
            }
            self.model.applied_index = index;
            self.model.check_invariants().map_err(|e| format!("model after index {index}: {e}"))?;
            self.digests.push(digest(&self.model));
        }
        Ok(())
    }

    /// Invariant 2 on whole states: `state` (of `node`) equals the model at its applied index.
    pub(super) fn state_matches(&mut self, node: NodeId, state: &MetaState) -> Result<(), String> {
        let index = state.applied_index;
        let Some(&want) = self.digests.get(index as usize) else {
            self.ahead += 1;
            return Ok(());
        };
        self.compared += 1;
        if digest(state) == want {
            return Ok(());
        }
        Err(format!("node {node}'s state at index {index} differs from the committed log's: {state:?}"))
    }

    /// True when `cmd`, a CAS, won in the log after index `after`.
    pub(super) fn cas_won_after(&self, cmd: &Command, after: u64) -> bool {
        let Command::CursorCas { queue, expected, new, .. } = cmd else { return false };
        self.cas_won.get(&(queue.clone(), *expected)).is_some_and(|&(n, i)| n == *new && i > after)
    }

    /// Invariant 4: a proposal of `cmds` made after index `after` was answered `outcomes`; its
    /// entry (those commands, consecutive, with those outcomes) must be in the log. Returns
    /// the entry's index.
    pub(super) fn answered(&mut self, cmds: &[Command], outcomes: &[Outcome], after: u64) -> Result<u64, String> {
        if cmds.len() != outcomes.len() {
            return Err(format!("{cmds:?} answered {outcomes:?}"));
        }
        let found = self
            .canon
            .range(after + 1..)
            .find(|(_, c)| c.cmds.windows(cmds.len()).zip(c.outcomes.windows(cmds.len())).any(|(cw, ow)| cw == cmds && ow == outcomes));
        let Some((&index, _)) = found else {
            return Err(format!("{cmds:?} answered {outcomes:?}, but no entry after {after} holds that"));
        };
        for (cmd, out) in cmds.iter().zip(outcomes) {
            if let (Command::CursorCas { queue, expected, new, .. }, Outcome::CasApplied) = (cmd, out) {
                let key = (queue.clone(), *expected);
                if let Some(other) = self.cas_answered.insert(key, *new) {
                    return Err(format!("two proposers won CAS {queue} from {expected}: ->{other} and ->{new}"));
                }
                if self.cas_won.get(&(queue.clone(), *expected)) != Some(&(*new, index)) {
                    return Err(format!(
                        "CAS {queue} {expected}->{new} answered at {index}, the log has {:?}",
                        self.cas_won.get(&(queue.clone(), *expected))
                    ));
                }
                let max = self.answered_max.entry(queue.clone()).or_insert(0);
                *max = (*max).max(*new);
                self.wins.push((queue.clone(), *new, index));
            }
        }
        Ok(index)
    }
}
