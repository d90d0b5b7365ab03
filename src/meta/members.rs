//! Membership changes of the metadata group: a node joins (`Add`) or is forgotten (`Remove`)
//! through a Raft conf change (raft-rs's `ConfChange`, one at a time), never through another
//! `--peers` list.
//!
//! # Steps
//! 1. A member proposes the change ([`MetaHandle::change_members`]); the entry's context
//!    carries the proposer's nonce and sequence (to find its waiter) and, for `Add`, the
//!    joining node's cluster address. raft-rs forwards a follower's proposal to the leader and
//!    drops one made while another change is pending: its proposer times out and may retry.
//! 2. Every node applies it in log order ([`Driver::applied_member_change`]): raft-rs's
//!    voters change, the new conf state is written to the log, and [`MetaState`] records the
//!    change ([`MetaState::apply_member_change`]), so that it is in every snapshot. An added
//!    node's address goes to the transport ([`super::RaftNet::add_peer`]), on a replay too.
//! 3. A joining node starts with the voters the group was formed with
//!    ([`MetaState::initial_voters`]) and no vote of its own, and replays the log from the
//!    leader: every change applies there in the same order, its own `Add` included.
//!
//! # Invariants
//! 1. The state after a change is a pure function of the state before, the change, and the
//!    voters before it (every node computes the same).
//! 2. A queue's replica set never names a node that was removed, unless it was the set's only
//!    node (the queue is then gone with it); a queue whose set was "every member" (declared
//!    before replica sets) gets the voters before a join as its set, so a node that joins
//!    never stores a queue whose earlier messages it lacks.

use std::sync::Arc;
use std::time::Instant;

use raft::eraftpb::{ConfChange, ConfChangeType, Entry};

use super::driver::Driver;
use super::net::RaftNet;
use super::state::MetaState;
use super::topology::NodeId;
use super::MetaError;

/// A change of the metadata group's voters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemberChange {
    /// Node `id`, whose cluster transport listens at `addr` (`IP:PORT`), becomes a voter.
    Add {
        /// The joining node's id (not 0, not a voter yet).
        id: NodeId,
        /// Its cluster address, as the other nodes will dial it.
        addr: String,
    },
    /// Node `id` stops being a voter (it should be stopped: RabbitMQ's
    /// `forget_cluster_node`).
    Remove {
        /// The node to forget.
        id: NodeId,
    },
}

impl MemberChange {
    /// The node the change is about.
    pub fn id(&self) -> NodeId {
        match self {
            MemberChange::Add { id, .. } | MemberChange::Remove { id } => *id,
        }
    }
}

/// A proposed change waiting to be applied here.
pub(super) struct ConfWaiter {
    pub(super) since: Instant,
    pub(super) reply: flume::Sender<Result<(), MetaError>>,
}

/// Entry context of a change: nonce (8 bytes LE), sequence (8 bytes LE), then the address
/// (UTF-8, `Add` only).
fn encode_context(nonce: u64, seq: u64, addr: &str) -> Vec<u8> {
    let mut ctx = Vec::with_capacity(16 + addr.len());
    ctx.extend_from_slice(&nonce.to_le_bytes());
    ctx.extend_from_slice(&seq.to_le_bytes());
    ctx.extend_from_slice(addr.as_bytes());
    ctx
}

/// The context's (nonce, sequence, address); zeros and "" for a context that is not ours.
fn decode_context(ctx: &[u8]) -> (u64, u64, String) {
    if ctx.len() < 16 {
        return (0, 0, String::new());
    }
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default());
    (word(&ctx[..8]), word(&ctx[8..16]), String::from_utf8_lossy(&ctx[16..]).into_owned())
}

/// Hands `net` the address of every node that joined, as recorded in `state`, and drops the
/// peers that are no `voters` (removed): for a state loaded from a snapshot, at start or from
/// the leader (the changes after it come with their entries, step 2). `voters` is `None` for
/// a node that joins and is no voter yet (it learns the removals from the log).
pub(super) fn sync_peers(net: Option<&Arc<dyn RaftNet>>, state: &MetaState, voters: Option<&[NodeId]>) {
    if let Some(net) = net {
        for (id, addr) in &state.members {
            net.add_peer(*id, addr);
        }
        if let Some(voters) = voters {
            net.retain_peers(voters);
        }
    }
}

impl MetaState {
    /// Step 2: records `change` (invariants 1–2), `voters_before` being the voters before it.
    /// Returns true when the topology changed (a replica set did).
    pub fn apply_member_change(&mut self, change: &MemberChange, voters_before: &[NodeId]) -> bool {
        if self.initial_voters.is_empty() {
            self.initial_voters = voters_before.to_vec();
        }
        let mut changed = false;
        match change {
            MemberChange::Add { id, addr } => {
                if !addr.is_empty() {
                    self.members.insert(*id, addr.clone());
                }
                for q in self.topology.queues.values_mut() {
                    if q.replicas.is_empty() && q.survives_restart() && !voters_before.contains(id) {
                        q.replicas = voters_before.to_vec();
                        changed = true;
                    }
                }
            }
            MemberChange::Remove { id } => {
                self.members.remove(id);
                let before = self.growing.len();
                self.growing.retain(|_, g| g.node != *id);
                changed |= self.growing.len() != before;
                for q in self.topology.queues.values_mut() {
                    if q.replicas.len() > 1 && q.replicas.contains(id) {
                        q.replicas.retain(|n| n != id);
                        changed = true;
                    }
                }
            }
        }
        changed
    }
}

impl Driver {
    /// Step 1: proposes `change`; `reply` hears once it is applied here, or why not.
    pub(super) fn propose_member_change(&mut self, change: MemberChange, reply: flume::Sender<Result<(), MetaError>>) {
        if self.raw.raft.leader_id == 0 {
            let _ = reply.send(Err(MetaError::NoQuorum { waited_ms: 0, leader: None }));
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let (change_type, addr) = match &change {
            MemberChange::Add { addr, .. } => (ConfChangeType::AddNode, addr.as_str()),
            MemberChange::Remove { .. } => (ConfChangeType::RemoveNode, ""),
        };
        let cc = ConfChange { change_type, node_id: change.id(), ..Default::default() };
        match self.raw.propose_conf_change(encode_context(self.nonce, seq, addr), cc) {
            Ok(()) => {
                self.conf_waiters.insert(seq, ConfWaiter { since: self.now, reply });
            }
            Err(e) => {
                let _ = reply.send(Err(MetaError::Raft(format!("membership change not proposed: {e}"))));
            }
        }
    }

    /// Step 2, after raft-rs applied `cc` (entry `e`) and its voters went from `voters_before`.
    pub(super) fn applied_member_change(&mut self, e: &Entry, cc: &ConfChange, voters_before: &[NodeId]) {
        let (nonce, seq, addr) = decode_context(&e.context);
        let id = cc.node_id;
        let change = match cc.get_change_type() {
            ConfChangeType::AddNode => MemberChange::Add { id, addr: addr.clone() },
            ConfChangeType::RemoveNode => MemberChange::Remove { id },
            // Learners are never proposed here.
            ConfChangeType::AddLearnerNode => return,
        };
        {
            let mut state = self.shared.state.lock();
            if state.apply_member_change(&change, voters_before) {
                self.shared.version.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            }
        }
        match &change {
            MemberChange::Add { .. } => tracing::info!(node = id, %addr, "a node joined the cluster"),
            MemberChange::Remove { .. } => tracing::info!(node = id, "a node left the cluster (forgotten)"),
        }
        match (&change, &self.net) {
            (MemberChange::Add { .. }, Some(net)) if !addr.is_empty() => net.add_peer(id, &addr),
            (MemberChange::Remove { .. }, Some(net)) => {
                let voters: Vec<NodeId> = voters_before.iter().copied().filter(|v| *v != id).collect();
                net.retain_peers(&voters);
            }
            _ => {}
        }
        // The joiner learns the group from the log when it starts at index 1; past a
        // compaction it is sent the snapshot, which must be taken after this entry (raft-rs
        // refuses a snapshot whose voters do not name the node).
        if matches!(change, MemberChange::Add { .. }) && self.raw.store().snapshot_index() > 0 {
            self.compact_for_join = true;
            self.compact_state = None;
        }
        if nonce == self.nonce {
            if let Some(w) = self.conf_waiters.remove(&seq) {
                let _ = w.reply.send(Ok(()));
            }
        }
    }

    /// Fails changes not applied within the proposal timeout (dropped by raft-rs behind
    /// another pending change, or lost with a leader).
    pub(super) fn expire_member_changes(&mut self) {
        let (now, timeout) = (self.now, self.propose_timeout);
        let leader = self.leader();
        let late: Vec<u64> =
            self.conf_waiters.iter().filter(|(_, w)| now.saturating_duration_since(w.since) >= timeout).map(|(s, _)| *s).collect();
        for seq in late {
            if let Some(w) = self.conf_waiters.remove(&seq) {
                let _ = w.reply.send(Err(MetaError::NoQuorum { waited_ms: timeout.as_millis() as u64, leader }));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::state::tests::queue;
    use crate::meta::state::Command;
    use crate::meta::topology::QueueDef;

    #[test]
    fn contexts_round_trip_and_foreign_ones_are_not_ours() {
        assert_eq!(decode_context(&encode_context(7, 9, "127.0.0.1:25675")), (7, 9, "127.0.0.1:25675".to_string()));
        assert_eq!(decode_context(&encode_context(u64::MAX, 1, "")), (u64::MAX, 1, String::new()));
        assert_eq!(decode_context(b"short"), (0, 0, String::new()));
    }

    #[test]
    fn a_join_records_the_address_and_pins_every_member_sets_a_remove_shrinks_sets() {
        let mut st = MetaState::default();
        st.apply(&Command::DeclareVhost { name: "/".into() });
        st.apply(&Command::DeclareQueue(queue("legacy", true, None)));
        st.apply(&Command::DeclareQueue(QueueDef { replicas: vec![1, 2, 3], ..queue("set", true, None) }));
        st.apply(&Command::DeclareQueue(QueueDef { replicas: vec![3], ..queue("only3", true, None) }));
        st.apply(&Command::DeclareQueue(queue("transient", false, None)));

        let add = MemberChange::Add { id: 4, addr: "127.0.0.1:25675".into() };
        assert!(st.apply_member_change(&add, &[1, 2, 3]));
        assert_eq!(st.members.get(&4).map(String::as_str), Some("127.0.0.1:25675"));
        assert_eq!(st.initial_voters, vec![1, 2, 3]);
        let q = |st: &MetaState, n: &str| st.topology.queue("/", n).unwrap().replicas.clone();
        assert_eq!(q(&st, "legacy"), vec![1, 2, 3], "a queue stored on every member stays on the members that hold it");
        assert!(!st.topology.queue("/", "legacy").unwrap().stored_on(4));
        assert!(q(&st, "transient").is_empty(), "a transient queue has no replica set");

        assert!(st.apply_member_change(&MemberChange::Remove { id: 3 }, &[1, 2, 3, 4]));
        assert_eq!(q(&st, "set"), vec![1, 2]);
        assert_eq!(q(&st, "legacy"), vec![1, 2]);
        assert_eq!(q(&st, "only3"), vec![3], "a set of one keeps its node: the queue is gone with it");
        assert_eq!(st.initial_voters, vec![1, 2, 3], "recorded once, at the first change");
        assert!(!st.apply_member_change(&MemberChange::Remove { id: 9 }, &[1, 2, 4]));

        // Every node computes the same, and it survives a snapshot.
        let json = serde_json::to_vec(&st).unwrap();
        let back: MetaState = serde_json::from_slice(&json).unwrap();
        assert_eq!((back.members, back.initial_voters), (st.members.clone(), st.initial_voters.clone()));
    }
}
