//! Growing a replicated queue's replica set: a node that is not in the set (one that left it
//! after a snapshot, a node that joined the cluster, or the set of a queue declared smaller than
//! its target) receives a copy of the queue's live messages through the Raft log and then
//! joins the set (RabbitMQ's `rabbitmq-queues grow`, and its continuous membership
//! reconciliation, which grows quorum queues back to their target size by itself).
//!
//! # Steps (each a command, applied in log order on every node)
//! 1. [`Command::GrowReplicaSet`] records a grow (`MetaState::growing`: the node, a random id
//!    and how far the copy got, `copied`, from 0). From here on the node applies the queue's
//!    `Settle`s too (as deletes, or as tombstones for offsets its copy has not reached), but
//!    not its `Enqueue`s: those are below the tail the copy will reach.
//! 2. The queue's server copies its live messages in offset order as
//!    [`Command::CopyMessages`]: the messages of `[from, to)` (absent offsets were settled),
//!    applied only when `from` is where the copy got (`copied`, compare-and-set, so a batch
//!    proposed twice or out of order is refused), and stored only by the growing node.
//! 3. The server holds its enqueuer (no `Enqueue` of the queue in flight), copies the rest up
//!    to the queue's next offset and proposes, in the same entry, [`Command::JoinReplicaSet`]
//!    with that offset as `tail`. It applies only when the copy reached `tail` and `tail` is
//!    still the queue's next offset: then the node is in the set and applies every `Enqueue`
//!    after it, at the offsets its copy continues from. Otherwise the server copies what was
//!    enqueued meanwhile and proposes the join again.
//!
//! # Invariants
//! 1. At most one grow per queue; its node is not in the queue's replica set, which is an
//!    explicit one (an empty set already means every member).
//! 2. A node joins a set only with a copy of every message below the queue's next offset
//!    that no settle deleted: `copied == tail == next_offsets[queue]` when the join applies.
//! 3. A grow ends with the join, or is dropped when its premise goes: the queue is deleted
//!    or moves to another server (the copier was the old server), the node leaves the set
//!    or the cluster (`LeaveReplicaSet`, `RemoveNode`). The copy it left is discarded
//!    where it is stored (`broker/replicas.rs`).

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::state::{MetaState, Outcome};
use super::topology::NodeId;

/// A grow under way (`MetaState::growing`, by `(vhost, queue)`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grow {
    /// The node receiving the copy.
    pub node: NodeId,
    /// Random id given by the proposer: copies and the join name it, so those of an earlier
    /// grow of the same queue are refused.
    pub id: u64,
    /// Queue offset the copy reached: every live message below it was copied.
    pub copied: u64,
}

/// A message of a [`super::state::Command::CopyMessages`] batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CopiedMessage {
    /// Queue offset (as on the server's store).
    pub offset: u64,
    /// Record flags, as the shard stores them.
    pub flags: u8,
    /// Stored header (`broker::message` form).
    pub header: Bytes,
    /// Body.
    pub body: Bytes,
}

/// Applies `GrowReplicaSet` (step 1) → `Created` | `Existed` (a grow of the queue is under way,
/// `node` is in the set, or the set is every member) | `NotFound`.
pub(super) fn grow(st: &mut MetaState, vhost: &str, queue: &str, node: NodeId, id: u64) -> Outcome {
    let key = (vhost.to_owned(), queue.to_owned());
    let Some(def) = st.topology.queues.get(&key) else {
        return Outcome::NotFound;
    };
    if def.replicas.is_empty() || def.replicas.contains(&node) || st.growing.contains_key(&key) {
        return Outcome::Existed;
    }
    st.growing.insert(key, Grow { node, id, copied: 0 });
    Outcome::Created
}

/// Applies `CopyMessages` (step 2) → `Copied { upto: to }` | `Existed` (no grow `id` of the
/// queue) | `CasRejected { current: Some(copied) }` (`from` is not where the copy got, or the
/// range is backwards).
pub(super) fn copy(st: &mut MetaState, vhost: &str, queue: &str, id: u64, from: u64, to: u64) -> Outcome {
    let key = (vhost.to_owned(), queue.to_owned());
    match st.growing.get_mut(&key) {
        Some(g) if g.id == id => {
            if g.copied != from || to < from {
                return Outcome::CasRejected { current: Some(g.copied) };
            }
            g.copied = to;
            Outcome::Copied { upto: to }
        }
        _ => Outcome::Existed,
    }
}

/// Applies `JoinReplicaSet` (step 3, invariant 2) → `Moved` (the node is in the set) |
/// `Existed` (no grow `id` of the queue) | `CasRejected { current: Some(next offset) }` (the
/// copy has not reached the queue's next offset).
pub(super) fn join(st: &mut MetaState, vhost: &str, queue: &str, id: u64, tail: u64) -> Outcome {
    let key = (vhost.to_owned(), queue.to_owned());
    let next = st.next_offsets.get(&key).copied().unwrap_or(0);
    let node = match st.growing.get(&key) {
        Some(g) if g.id == id => {
            if g.copied != tail || tail != next {
                return Outcome::CasRejected { current: Some(next) };
            }
            g.node
        }
        _ => return Outcome::Existed,
    };
    st.growing.remove(&key);
    let Some(def) = st.topology.queues.get_mut(&key) else {
        return Outcome::NotFound;
    };
    if !def.replicas.contains(&node) {
        def.replicas.push(node);
        def.replicas.sort_unstable();
    }
    Outcome::Moved
}

/// Whether `node` stores the data `cmd` carries, read before `cmd` applies: an `Enqueue` or
/// a `Settle` when `node` is in the queue's replica set, a `Settle` too when the queue is
/// being copied to `node` (step 1), a copy or a join only then; true for any other command.
/// Decided as the entry applies, so a replay at start hands over exactly what it did live.
pub(super) fn stored_by(st: &MetaState, cmd: &super::state::Command, node: NodeId) -> bool {
    use super::state::Command;
    let (vhost, queue) = match cmd {
        Command::Enqueue { vhost, queue, .. }
        | Command::Settle { vhost, queue, .. }
        | Command::Return { vhost, queue, .. }
        | Command::CopyMessages { vhost, queue, .. }
        | Command::JoinReplicaSet { vhost, queue, .. } => (vhost, queue),
        _ => return true,
    };
    let member = || st.topology.queue(vhost, queue).is_some_and(|q| q.stored_on(node));
    let copying = || st.growing_to(vhost, queue, node);
    match cmd {
        Command::Enqueue { .. } => member(),
        Command::Settle { .. } | Command::Return { .. } => member() || copying(),
        _ => copying(),
    }
}

impl MetaState {
    /// True when queue `vhost`/`name` is being copied to `node` (step 1).
    pub fn growing_to(&self, vhost: &str, name: &str, node: NodeId) -> bool {
        !self.growing.is_empty() && self.growing.get(&(vhost.to_owned(), name.to_owned())).is_some_and(|g| g.node == node)
    }
}

/// Drops the grow of `key` if `node` receives it (invariant 3); true when one was dropped.
pub(super) fn drop_grow_to(growing: &mut BTreeMap<(String, String), Grow>, key: &(String, String), node: NodeId) -> bool {
    if growing.get(key).is_some_and(|g| g.node == node) {
        growing.remove(key);
        return true;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::codec::{decode_batch, encode_batch};
    use crate::meta::state::tests::queue;
    use crate::meta::state::Command;
    use crate::meta::topology::QueueDef;

    fn declared(set: Vec<NodeId>) -> MetaState {
        let mut st = MetaState::default();
        st.apply(&Command::DeclareVhost { name: "/".into() });
        st.apply(&Command::DeclareQueue(QueueDef { replicas: set, ..queue("q", true, None) }));
        st
    }

    fn enqueue(st: &mut MetaState) {
        let cmd = Command::Enqueue { vhost: "/".into(), queue: "q".into(), flags: 1, header: Bytes::new(), body: Bytes::from_static(b"m") };
        assert!(matches!(st.apply(&cmd), Outcome::Enqueued { .. }));
    }

    fn grow_cmd(node: NodeId, id: u64) -> Command {
        Command::GrowReplicaSet { vhost: "/".into(), queue: "q".into(), node, id }
    }

    fn copy_cmd(id: u64, from: u64, to: u64) -> Command {
        let messages =
            (from..to).map(|o| CopiedMessage { offset: o, flags: 1, header: Bytes::new(), body: Bytes::from_static(b"m") }).collect();
        Command::CopyMessages { vhost: "/".into(), queue: "q".into(), id, from, to, messages }
    }

    fn join_cmd(id: u64, tail: u64) -> Command {
        Command::JoinReplicaSet { vhost: "/".into(), queue: "q".into(), id, tail }
    }

    #[test]
    fn a_node_joins_only_once_its_copy_reached_the_tail() {
        let mut st = declared(vec![1, 2]);
        for _ in 0..5 {
            enqueue(&mut st);
        }
        assert_eq!(st.apply(&grow_cmd(2, 7)), Outcome::Existed, "already in the set");
        assert_eq!(st.apply(&grow_cmd(3, 7)), Outcome::Created);
        assert!(grow_cmd(3, 7).changed_topology(&Outcome::Created));
        assert_eq!(st.apply(&grow_cmd(4, 8)), Outcome::Existed, "one grow per queue");
        assert_eq!(st.apply(&copy_cmd(8, 0, 3)), Outcome::Existed, "another grow's copy");
        assert_eq!(st.apply(&copy_cmd(7, 1, 3)), Outcome::CasRejected { current: Some(0) }, "a gap in the copy");
        assert_eq!(st.apply(&copy_cmd(7, 0, 3)), Outcome::Copied { upto: 3 });
        assert_eq!(st.apply(&copy_cmd(7, 0, 3)), Outcome::CasRejected { current: Some(3) }, "the same batch twice");
        assert_eq!(st.apply(&join_cmd(7, 3)), Outcome::CasRejected { current: Some(5) }, "the copy is behind the tail");
        assert_eq!(st.apply(&copy_cmd(7, 3, 5)), Outcome::Copied { upto: 5 });
        enqueue(&mut st);
        assert_eq!(st.apply(&join_cmd(7, 5)), Outcome::CasRejected { current: Some(6) }, "enqueued meanwhile");
        assert_eq!(st.apply(&copy_cmd(7, 5, 6)), Outcome::Copied { upto: 6 });
        assert_eq!(st.apply(&join_cmd(7, 6)), Outcome::Moved);
        assert!(join_cmd(7, 6).changed_topology(&Outcome::Moved));
        assert_eq!(st.topology.queue("/", "q").unwrap().replicas, vec![1, 2, 3]);
        assert!(st.growing.is_empty());
        assert_eq!(st.apply(&join_cmd(7, 6)), Outcome::Existed, "once");
        assert_eq!(st.check_invariants(), Ok(()));
    }

    #[test]
    fn a_grow_is_dropped_with_its_premise() {
        // Moving the queue to another server drops the grow (the copier was the old server).
        let mut st = declared(vec![1, 2]);
        st.apply(&grow_cmd(3, 1));
        let mv = Command::MoveQueue { vhost: "/".into(), queue: "q".into(), from: 1, to: 2, to_epoch: 1 };
        assert_eq!(st.apply(&mv), Outcome::Moved);
        assert!(st.growing.is_empty());
        assert_eq!(st.apply(&copy_cmd(1, 0, 0)), Outcome::Existed);
        // The node leaving the set (a snapshot made it miss the copy) drops it too.
        st.apply(&grow_cmd(3, 2));
        let leave = |node| Command::LeaveReplicaSet { vhost: "/".into(), queue: "q".into(), node };
        assert_eq!(st.apply(&leave(4)), Outcome::Existed);
        assert_eq!(st.growing.len(), 1);
        assert_eq!(st.apply(&leave(3)), Outcome::Moved);
        assert!(st.growing.is_empty());
        // Deleting the queue drops it.
        st.apply(&grow_cmd(3, 3));
        st.apply(&Command::DeleteQueue { vhost: "/".into(), name: "q".into() });
        assert!(st.growing.is_empty());
        assert_eq!(st.check_invariants(), Ok(()));
        // A queue stored on every member (no explicit set) has nothing to grow.
        let mut every = declared(Vec::new());
        assert_eq!(every.apply(&grow_cmd(3, 1)), Outcome::Existed);
        assert_eq!(every.apply(&Command::GrowReplicaSet { vhost: "/".into(), queue: "x".into(), node: 3, id: 1 }), Outcome::NotFound);
    }

    #[test]
    fn a_snapshot_over_a_copy_or_a_join_makes_the_node_leave() {
        let mut old = declared(vec![1, 2]);
        enqueue(&mut old);
        old.apply(&grow_cmd(3, 5));
        // Nothing copied yet: nothing missed.
        let mut new = old.clone();
        assert!(crate::meta::data::missed_queues(&old, &new, 3).is_empty());
        // The copy moved on inside the snapshot: node 3's copy lacks that batch.
        new.apply(&copy_cmd(5, 0, 1));
        let key = ("/".to_string(), "q".to_string());
        assert_eq!(crate::meta::data::missed_queues(&old, &new, 3), vec![key.clone()]);
        assert!(crate::meta::data::missed_queues(&old, &new, 4).is_empty());
        // The join inside the snapshot: node 3 is in the set with a copy it never received.
        new.apply(&join_cmd(5, 1));
        assert_eq!(crate::meta::data::missed_queues(&old, &new, 3), vec![key]);
        let leave = Command::LeaveReplicaSet { vhost: "/".into(), queue: "q".into(), node: 3 };
        assert_eq!(new.apply(&leave), Outcome::Moved);
        assert_eq!(new.topology.queue("/", "q").unwrap().replicas, vec![1, 2]);
    }

    #[test]
    fn grows_survive_the_codec_and_the_snapshot() {
        let mut st = declared(vec![1, 2]);
        st.apply(&grow_cmd(3, u64::MAX));
        let json = serde_json::to_vec(&st).unwrap();
        let back: MetaState = serde_json::from_slice(&json).unwrap();
        assert_eq!(back, st);
        let cmds = vec![grow_cmd(3, u64::MAX), copy_cmd(9, 1 << 40, (1 << 40) + 2), copy_cmd(9, 5, 5), join_cmd(9, 1 << 41)];
        let mut buf = Vec::new();
        encode_batch(cmds.len(), &cmds, &mut buf);
        assert_eq!(decode_batch(&buf).unwrap(), cmds);
        // A copy claiming more messages than the entry holds is refused, not allocated.
        let mut bad = Vec::new();
        encode_batch(1, [&copy_cmd(9, 0, 0)], &mut bad);
        let at = bad.len() - 1;
        bad[at] = 0x7f;
        assert!(decode_batch(&bad).is_err());
    }
}
