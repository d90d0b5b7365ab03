//! Replicated queue data: the commands that carry a replicated queue's messages and
//! settlements through the Raft log, what applying them does to [`MetaState`], and the feed
//! that hands applied data to the broker's stores.
//!
//! # Model
//! In a cluster, a durable queue's messages live on every node of its replica set
//! (`QueueDef::replicas`). A publish is proposed as [`Command::Enqueue`]; applying it gives
//! the message the queue's next offset (a counter in the state, so every node computes the
//! same offset) and hands it, with that offset, to the [`DataSink`] of the node, which
//! appends it to the queue's shard on the queue's core if the node is in the set. A
//! publisher confirm waits for the proposal's outcome: the entry is then fdatasync'ed in the
//! Raft log of a majority (DESIGN.md rule 9 in a cluster). Acks, drops, dead-letter moves and
//! purges are proposed as [`Command::Settle`], applied as deletes on every member.
//! [`Command::MoveQueue`] changes the node that serves a queue (its `owner_node`) when that
//! node is gone.
//!
//! # Invariants
//! 1. A queue's offsets are handed out by `apply` only, one per applied `Enqueue`, from
//!    `next_offsets` (starting at 0 when the queue is declared); a store applies an offset at
//!    most once (a replay after a restart hands the same offsets again: a store skips the
//!    offsets it already holds).
//! 2. The log is compacted past an index only after every store of this node has synced
//!    everything applied up to it ([`DataFeed::flush`], polled by the driver without waiting;
//!    the state it compacts to was taken before the flush began); entries after a snapshot are applied
//!    again at the next start.
//! 3. `MoveQueue` applies only while the queue is still served by `from` (compare-and-set, as
//!    cursors are): two leaders of the metadata group in a row cannot move a queue twice.
//!    It moves a queue only to a node of its replica set (`QueueDef::replicas`): only those
//!    store its messages (a member outside the set skips its `Enqueue` and `Settle` data).
//! 4. A node sent a snapshot never applies the entries inside it, so its copies lack the
//!    messages enqueued in them. It takes itself out of those queues' replica sets
//!    (`LeaveReplicaSet`, proposed by its driver as it installs the snapshot), so failover
//!    never makes an incomplete copy the server. The set's last node and the server stay.
//! 5. The serving node hands out a message only below the queue's *reservation*
//!    ([`Command::Reserve`], applied only for the node that serves the queue, renewed ahead of
//!    the deliveries so they never wait for it). `MoveQueue` raises the cursor to the old
//!    server's reservation, capped at the queue's next offset (the old server applies the
//!    log in order, so it never held a message enqueued after the move), and the new server
//!    flags what lies below it redelivered=true: every message a dead server may have handed
//!    out, plus at most the reserved but undelivered rest (a flag too many, never one too
//!    few). A `Reserve` proposed by the old server and ordered after the move is refused.

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

use super::state::{MetaState, Outcome};
use super::topology::NodeId;

/// What applying a data command hands to the stores, in log order.
#[derive(Clone, Debug, PartialEq)]
pub enum DataOp {
    /// Store the message at `offset` of the queue (skip it if the store holds that offset).
    Enqueue {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// Offset given by the state machine (invariant 1).
        offset: u64,
        /// Record flags (persistent...), as the shard stores them.
        flags: u8,
        /// Stored header (exchange, routing key, properties), `broker::message` form.
        header: Bytes,
        /// Message body.
        body: Bytes,
    },
    /// Delete these offsets of the queue (an offset already deleted is skipped).
    Settle {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// Queue offsets.
        offsets: Vec<u64>,
    },
    /// Raise the return counts of these offsets of the queue to the ones given (`Return`
    /// applied; an offset no longer stored is skipped).
    Returned {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// (queue offset, returns counted so far).
        counts: Vec<(u64, u32)>,
    },
    /// Another node serves the queue from this point of the log on (`MoveQueue` applied):
    /// the old server hands out nothing more (invariant 5), before it applies what follows.
    Moved {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// The node that serves it now.
        to: NodeId,
    },
    /// Messages copied to this node, which is growing into the queue's replica set
    /// (`grow.rs`, step 2): the store takes those of `[from, to)` it lacks; an offset of the
    /// range that is not among them has no message (it was settled).
    Copy {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// The grow's id.
        id: u64,
        /// First queue offset the batch covers.
        from: u64,
        /// Queue offset after the last one it covers.
        to: u64,
        /// The live messages of `[from, to)`, ascending offsets.
        messages: Vec<super::grow::CopiedMessage>,
    },
    /// This node joined the queue's replica set (`grow.rs`, step 3): its store holds every
    /// live message below `tail`, and the queue's next `Enqueue` gets offset `tail`.
    Joined {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// The grow's id.
        id: u64,
        /// The queue's next offset when it joined.
        tail: u64,
    },
    /// The queue was deleted: its store goes, before any op of a queue declared again
    /// under the name.
    Dropped {
        /// Vhost name.
        vhost: String,
        /// Queue name.
        queue: String,
        /// The queue's core (`owner_core` of its definition, which is gone now).
        owner_core: u32,
    },
}

impl DataOp {
    /// The queue the op is for: (vhost, queue).
    pub fn queue(&self) -> (&str, &str) {
        match self {
            DataOp::Enqueue { vhost, queue, .. }
            | DataOp::Settle { vhost, queue, .. }
            | DataOp::Returned { vhost, queue, .. }
            | DataOp::Moved { vhost, queue, .. }
            | DataOp::Copy { vhost, queue, .. }
            | DataOp::Joined { vhost, queue, .. }
            | DataOp::Dropped { vhost, queue, .. } => (vhost, queue),
        }
    }
}

/// The broker's side of the feed: takes applied data and makes it durable on demand.
/// Called on the metadata driver's thread: `applied` must not block.
pub trait DataSink: Send + Sync {
    /// Applied data ops of one entry at Raft index `index`, in order.
    fn applied(&self, index: u64, ops: Vec<DataOp>);
    /// Asks every store to sync every op applied so far; the returned [`FlushWait`] says
    /// when they did (or could not: the log is then not compacted). Called before a
    /// compaction, on the driver thread: must not block.
    fn flush(&self) -> FlushWait;
    /// A snapshot from the leader replaced this node's state at `index`: the ops between
    /// what this node applied and `index` never reach its stores.
    fn skipped_to(&self, index: u64);
}

/// A flush of the stores in progress ([`DataSink::flush`]): one answer per store, due
/// before a deadline.
pub struct FlushWait {
    answers: Vec<flume::Receiver<bool>>,
    deadline: std::time::Instant,
    failed: bool,
}

impl FlushWait {
    /// Waits for `answers` (each `true` once its store synced) until `deadline`.
    pub fn new(answers: Vec<flume::Receiver<bool>>, deadline: std::time::Instant) -> FlushWait {
        FlushWait { answers, deadline, failed: false }
    }

    /// A flush already over: synced (`true`) or not.
    pub fn done(ok: bool) -> FlushWait {
        FlushWait { answers: Vec::new(), deadline: std::time::Instant::now(), failed: !ok }
    }

    /// `Some(true)` once every store answered that it synced, `Some(false)` once one could
    /// not (or the deadline passed), `None` while answers are due. Never blocks.
    pub fn poll(&mut self) -> Option<bool> {
        let mut i = 0;
        while i < self.answers.len() && !self.failed {
            match self.answers[i].try_recv() {
                Ok(true) => {
                    self.answers.swap_remove(i);
                }
                Ok(false) | Err(flume::TryRecvError::Disconnected) => self.failed = true,
                Err(flume::TryRecvError::Empty) => i += 1,
            }
        }
        if self.failed {
            return Some(false);
        }
        if self.answers.is_empty() {
            return Some(true);
        }
        (std::time::Instant::now() >= self.deadline).then_some(false)
    }
}

/// Where the driver puts applied data: held here until a [`DataSink`] is attached (the
/// broker's cores start after the metadata group, and a restart replays the log first).
#[derive(Default)]
pub struct DataFeed {
    inner: Mutex<FeedState>,
}

#[derive(Default)]
struct FeedState {
    sink: Option<Arc<dyn DataSink>>,
    held: Vec<(u64, Vec<DataOp>)>,
}

impl DataFeed {
    /// Hands one entry's ops on (or keeps them until a sink is attached).
    pub fn push(&self, index: u64, ops: Vec<DataOp>) {
        if ops.is_empty() {
            return;
        }
        let mut st = self.inner.lock();
        match &st.sink {
            Some(sink) => {
                let sink = sink.clone();
                drop(st);
                sink.applied(index, ops);
            }
            None => st.held.push((index, ops)),
        }
    }

    /// Attaches the sink and gives it what was held, in order.
    pub fn attach(&self, sink: Arc<dyn DataSink>) {
        let mut st = self.inner.lock();
        for (index, ops) in std::mem::take(&mut st.held) {
            sink.applied(index, ops);
        }
        st.sink = Some(sink);
    }

    /// True once replicated queue data was applied since the start (a sink attached also
    /// counts: this node holds replicated queues).
    pub fn carries_data(&self) -> bool {
        let st = self.inner.lock();
        st.sink.is_some() || !st.held.is_empty()
    }

    /// Starts syncing everything applied in its store (no sink and nothing held: done).
    pub fn flush(&self) -> FlushWait {
        let sink = {
            let st = self.inner.lock();
            match &st.sink {
                Some(sink) => sink.clone(),
                None => return FlushWait::done(st.held.is_empty()),
            }
        };
        sink.flush()
    }

    /// See [`DataSink::skipped_to`].
    pub fn skipped_to(&self, index: u64) {
        let sink = {
            let mut st = self.inner.lock();
            st.held.clear();
            st.sink.clone()
        };
        match sink {
            Some(s) => s.skipped_to(index),
            None => tracing::warn!(index, "a metadata snapshot replaced replicated queue data this node had not stored"),
        }
    }
}

/// Applies `Enqueue`: the next offset of the queue, or `NotFound`.
/// (A queue from a snapshot older than the counters starts at 0: no message of it was
/// replicated then.)
pub(super) fn enqueue(st: &mut MetaState, vhost: &str, queue: &str) -> Outcome {
    let key = (vhost.to_owned(), queue.to_owned());
    if !st.topology.queues.contains_key(&key) {
        return Outcome::NotFound;
    }
    let next = st.next_offsets.entry(key).or_insert(0);
    let offset = *next;
    *next += 1;
    Outcome::Enqueued { offset }
}

/// Applies `LeaveReplicaSet` (invariant 4).
pub(super) fn leave_replica_set(st: &mut MetaState, vhost: &str, queue: &str, node: NodeId) -> Outcome {
    let key = (vhost.to_owned(), queue.to_owned());
    let Some(def) = st.topology.queues.get_mut(&key) else {
        return Outcome::NotFound;
    };
    // A copy under way to the node is as incomplete (`grow.rs`, invariant 3).
    if super::grow::drop_grow_to(&mut st.growing, &key, node) {
        return Outcome::Moved;
    }
    if def.replicas.len() < 2 || !def.replicas.contains(&node) || def.owner_node == node {
        return Outcome::Existed;
    }
    def.replicas.retain(|n| *n != node);
    Outcome::Moved
}

/// The replicated queues whose messages `node` missed when a snapshot replaced its state
/// `old` with `new` (invariant 4): those stored on `node` (by an explicit set) whose offset
/// counter moved in between, or that it joined in between (it missed their copy, `grow.rs`),
/// and those being copied to it whose copy moved on in between.
pub(super) fn missed_queues(old: &MetaState, new: &MetaState, node: NodeId) -> Vec<(String, String)> {
    let counter = |st: &MetaState, key: &(String, String)| st.next_offsets.get(key).copied().unwrap_or(0);
    let was_member = |key: &(String, String)| old.topology.queues.get(key).is_some_and(|q| q.replicas.contains(&node));
    let stored = new
        .topology
        .queues
        .iter()
        .filter(|(_, q)| q.survives_restart() && q.replicas.len() > 1 && q.replicas.contains(&node) && q.owner_node != node)
        .filter(|(key, _)| counter(new, key) > counter(old, key) || (!was_member(key) && counter(new, key) > 0))
        .map(|(key, _)| key.clone());
    let copying = new
        .growing
        .iter()
        .filter(|(key, g)| g.node == node && g.copied > 0 && old.growing.get(*key) != Some(*g))
        .map(|(key, _)| key.clone());
    stored.chain(copying).collect()
}

/// Applies `MoveQueue` (invariants 3 and 5).
pub(super) fn move_queue(st: &mut MetaState, vhost: &str, queue: &str, from: NodeId, to: NodeId, to_epoch: u64) -> Outcome {
    let key = (vhost.to_owned(), queue.to_owned());
    let Some(def) = st.topology.queues.get_mut(&key) else {
        return Outcome::NotFound;
    };
    // A node outside the replica set holds none of the queue's messages.
    if def.owner_node != from || !def.stored_on(to) {
        return Outcome::Existed;
    }
    def.owner_node = to;
    def.owner_epoch = to_epoch;
    // The grow's copier was the old server (`grow.rs`, invariant 3).
    st.growing.remove(&key);
    // What `from` may have handed out: below its reservation, and only what it had applied.
    let reserved = st.reservations.remove(&key).unwrap_or(0);
    let tail = st.next_offsets.get(&key).copied().unwrap_or(0);
    if let Some(cursor) = st.cursors.get_mut(&key) {
        *cursor = (*cursor).max(reserved.min(tail));
    }
    Outcome::Moved
}

/// Applies `Reserve` (invariant 5).
pub(super) fn reserve(st: &mut MetaState, vhost: &str, queue: &str, node: NodeId, until: u64) -> Outcome {
    let key = (vhost.to_owned(), queue.to_owned());
    let Some(def) = st.topology.queues.get(&key) else {
        return Outcome::NotFound;
    };
    if def.owner_node != node {
        return Outcome::Existed;
    }
    let stored = st.reservations.entry(key).or_insert(0);
    *stored = (*stored).max(until);
    Outcome::Reserved { until: *stored }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::codec::{decode_batch, encode_batch};
    use crate::meta::state::tests::queue;
    use crate::meta::state::Command;
    use crate::meta::topology::QueueDef;

    fn enqueue(q: &str, body: &'static [u8]) -> Command {
        Command::Enqueue { vhost: "/".into(), queue: q.into(), flags: 1, header: Bytes::from_static(b"h"), body: Bytes::from_static(body) }
    }

    fn declared(names: &[&str]) -> MetaState {
        let mut st = MetaState::default();
        st.apply(&Command::DeclareVhost { name: "/".into() });
        for n in names {
            st.apply(&Command::DeclareQueue(queue(n, true, None)));
        }
        st
    }

    #[test]
    fn offsets_are_handed_out_per_queue_in_apply_order_and_restart_after_a_redeclare() {
        let mut st = declared(&["a", "b"]);
        let got: Vec<Outcome> = [enqueue("a", b"1"), enqueue("b", b"2"), enqueue("a", b"3")].iter().map(|c| st.apply(c)).collect();
        assert_eq!(got, vec![Outcome::Enqueued { offset: 0 }, Outcome::Enqueued { offset: 0 }, Outcome::Enqueued { offset: 1 }]);
        assert_eq!(st.apply(&enqueue("nope", b"x")), Outcome::NotFound);
        // A queue deleted and declared again starts over (its store was dropped).
        st.apply(&Command::DeleteQueue { vhost: "/".into(), name: "a".into() });
        assert_eq!(st.apply(&enqueue("a", b"x")), Outcome::NotFound);
        st.apply(&Command::DeclareQueue(queue("a", true, None)));
        assert_eq!(st.apply(&enqueue("a", b"x")), Outcome::Enqueued { offset: 0 });
        // Every replica computes the same offsets: the counters survive a snapshot.
        let json = serde_json::to_vec(&st).unwrap();
        let mut back: MetaState = serde_json::from_slice(&json).unwrap();
        assert_eq!(back.apply(&enqueue("b", b"y")), Outcome::Enqueued { offset: 1 });
        assert_eq!(st.apply(&enqueue("b", b"y")), Outcome::Enqueued { offset: 1 });
    }

    #[test]
    fn a_snapshot_from_before_the_counters_starts_them_at_zero() {
        let st = declared(&["a"]);
        let mut json: serde_json::Value = serde_json::to_value(&st).unwrap();
        json.as_object_mut().unwrap().remove("next_offsets");
        let mut old: MetaState = serde_json::from_value(json).unwrap();
        assert!(old.next_offsets.is_empty());
        assert_eq!(old.apply(&enqueue("a", b"x")), Outcome::Enqueued { offset: 0 });
    }

    #[test]
    fn a_move_applies_only_while_the_queue_is_served_by_from() {
        let mut st = declared(&["a"]);
        let mv = |from, to| Command::MoveQueue { vhost: "/".into(), queue: "a".into(), from, to, to_epoch: 7 };
        assert_eq!(st.apply(&mv(2, 3)), Outcome::Existed, "served by node 1, not 2");
        assert_eq!(st.apply(&mv(1, 3)), Outcome::Moved);
        assert!(mv(1, 3).changed_topology(&Outcome::Moved));
        let def = st.topology.queue("/", "a").unwrap();
        assert_eq!((def.owner_node, def.owner_epoch), (3, 7));
        // A second leader proposing the same move (it saw node 1 gone too) changes nothing.
        assert_eq!(st.apply(&mv(1, 2)), Outcome::Existed);
        assert_eq!(st.topology.queue("/", "a").unwrap().owner_node, 3);
        let missing = Command::MoveQueue { vhost: "/".into(), queue: "zz".into(), from: 1, to: 2, to_epoch: 1 };
        assert_eq!(st.apply(&missing), Outcome::NotFound);
    }

    #[test]
    fn a_node_that_missed_messages_leaves_only_those_sets_and_never_the_last_place() {
        let mut old = MetaState::default();
        old.apply(&Command::DeclareVhost { name: "/".into() });
        for (name, set) in [("busy", vec![1, 2, 3]), ("idle", vec![1, 2, 3]), ("elsewhere", vec![1, 2]), ("alone", vec![3])] {
            old.apply(&Command::DeclareQueue(QueueDef { replicas: set, ..queue(name, true, None) }));
        }
        let mut new = old.clone();
        for q in ["busy", "elsewhere", "alone"] {
            new.apply(&enqueue(q, b"m"));
        }
        new.apply(&Command::DeclareQueue(QueueDef { replicas: vec![1, 2, 3], ..queue("born", true, None) }));
        new.apply(&enqueue("born", b"m"));
        let mut missed = missed_queues(&old, &new, 3);
        missed.sort();
        assert_eq!(missed, vec![("/".to_string(), "born".to_string()), ("/".to_string(), "busy".to_string())]);
        let leave = |q: &str| Command::LeaveReplicaSet { vhost: "/".into(), queue: q.into(), node: 3 };
        assert_eq!(new.apply(&leave("busy")), Outcome::Moved);
        assert!(leave("busy").changed_topology(&Outcome::Moved));
        assert_eq!(new.topology.queue("/", "busy").unwrap().replicas, vec![1, 2]);
        assert_eq!(new.apply(&leave("busy")), Outcome::Existed, "once");
        assert_eq!(new.apply(&leave("alone")), Outcome::Existed, "the last copy stays");
        let served = Command::LeaveReplicaSet { vhost: "/".into(), queue: "idle".into(), node: 1 };
        assert_eq!(new.apply(&served), Outcome::Existed, "the server stays");
        assert_eq!(new.apply(&leave("gone")), Outcome::NotFound);
    }

    #[test]
    fn a_move_goes_only_to_a_node_of_the_replica_set() {
        let mut st = MetaState::default();
        st.apply(&Command::DeclareVhost { name: "/".into() });
        st.apply(&Command::DeclareQueue(QueueDef { replicas: vec![1, 2, 4], ..queue("a", true, None) }));
        let mv = |from, to| Command::MoveQueue { vhost: "/".into(), queue: "a".into(), from, to, to_epoch: 7 };
        assert_eq!(st.apply(&mv(1, 3)), Outcome::Existed, "node 3 stores none of its messages");
        assert_eq!(st.topology.queue("/", "a").unwrap().owner_node, 1);
        assert_eq!(st.apply(&mv(1, 4)), Outcome::Moved);
        assert_eq!(st.topology.queue("/", "a").unwrap().owner_node, 4);
    }

    #[test]
    fn a_move_flags_what_the_old_server_had_reserved_up_to_the_tail() {
        let mut st = declared(&["a"]);
        let reserve = |node, until| Command::Reserve { vhost: "/".into(), queue: "a".into(), node, until };
        let mv = |from, to| Command::MoveQueue { vhost: "/".into(), queue: "a".into(), from, to, to_epoch: 2 };
        assert_eq!(st.apply(&reserve(2, 10)), Outcome::Existed, "only the server reserves");
        assert_eq!(st.apply(&reserve(1, 10)), Outcome::Reserved { until: 10 });
        assert_eq!(st.apply(&reserve(1, 4)), Outcome::Reserved { until: 10 }, "a reservation never shrinks");
        for _ in 0..6 {
            st.apply(&enqueue("a", b"m"));
        }
        // Reserved up to 10, but only offsets 0..6 existed when the queue moved: those are
        // flagged, and what is enqueued after the move is not.
        assert_eq!(st.apply(&mv(1, 2)), Outcome::Moved);
        assert_eq!(st.cursor("/", "a"), Some(6));
        assert_eq!(st.reservation("/", "a"), 0, "the new server reserves for itself");
        assert_eq!(st.apply(&reserve(1, 20)), Outcome::Existed, "the old server's late reservation is refused");
        st.apply(&enqueue("a", b"m"));
        assert_eq!(st.apply(&reserve(2, 3)), Outcome::Reserved { until: 3 });
        // A cursor already past the reservation stays.
        st.apply(&Command::CursorCas { vhost: "/".into(), queue: "a".into(), expected: 6, new: 7 });
        assert_eq!(st.apply(&mv(2, 1)), Outcome::Moved);
        assert_eq!(st.cursor("/", "a"), Some(7));
        st.apply(&Command::DeleteQueue { vhost: "/".into(), name: "a".into() });
        assert_eq!(st.check_invariants(), Ok(()));
    }

    #[test]
    fn data_commands_survive_the_codec() {
        let cmds = vec![
            enqueue("a", b"body bytes \x00\xff"),
            Command::Settle { vhost: "/".into(), queue: "a".into(), offsets: vec![0, 5, 1 << 40] },
            Command::Return { vhost: "/".into(), queue: "a".into(), counts: vec![(0, 1), (1 << 40, u32::MAX)] },
            Command::MoveQueue { vhost: "v".into(), queue: "q".into(), from: 1, to: 3, to_epoch: 9 },
            Command::LeaveReplicaSet { vhost: "v".into(), queue: "q".into(), node: 2 },
            Command::Reserve { vhost: "v".into(), queue: "q".into(), node: 3, until: 1 << 33 },
        ];
        let mut buf = Vec::new();
        encode_batch(cmds.len(), &cmds, &mut buf);
        assert_eq!(decode_batch(&buf).unwrap(), cmds);
        // A settle claiming more offsets than the entry holds is refused, not allocated.
        let mut bad = Vec::new();
        encode_batch(1, [&Command::Settle { vhost: "/".into(), queue: "a".into(), offsets: vec![1] }], &mut bad);
        let at = bad.len() - 2;
        bad[at] = 0x7f;
        assert!(decode_batch(&bad).is_err());
    }

    struct Recorder {
        got: Mutex<Vec<(u64, Vec<DataOp>)>>,
        synced: bool,
    }

    impl DataSink for Recorder {
        fn applied(&self, index: u64, ops: Vec<DataOp>) {
            self.got.lock().push((index, ops));
        }
        fn flush(&self) -> FlushWait {
            FlushWait::done(self.synced)
        }
        fn skipped_to(&self, _index: u64) {}
    }

    fn settle(o: u64) -> DataOp {
        DataOp::Settle { vhost: "/".into(), queue: "a".into(), offsets: vec![o] }
    }

    #[test]
    fn the_feed_holds_what_was_applied_before_the_sink_and_hands_it_over_in_order() {
        let feed = DataFeed::default();
        assert_eq!(feed.flush().poll(), Some(true), "nothing applied: compaction may go on");
        feed.push(3, vec![settle(1)]);
        feed.push(4, Vec::new());
        feed.push(5, vec![settle(2), settle(3)]);
        assert_eq!(feed.flush().poll(), Some(false), "held data not yet in any store: no compaction");
        let sink = Arc::new(Recorder { got: Mutex::new(Vec::new()), synced: true });
        feed.attach(sink.clone());
        feed.push(6, vec![settle(4)]);
        let got = sink.got.lock().clone();
        assert_eq!(got, vec![(3, vec![settle(1)]), (5, vec![settle(2), settle(3)]), (6, vec![settle(4)])]);
        assert_eq!(feed.flush().poll(), Some(true));
        let failing = DataFeed::default();
        failing.attach(Arc::new(Recorder { got: Mutex::new(Vec::new()), synced: false }));
        assert_eq!(failing.flush().poll(), Some(false), "a store that could not sync keeps the log");
    }

    #[test]
    fn a_flush_is_over_when_every_store_answered_and_failed_by_one_no_or_the_deadline() {
        let far = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let (a, ra) = flume::bounded(1);
        let (b, rb) = flume::bounded(1);
        let mut w = FlushWait::new(vec![ra, rb], far);
        assert_eq!(w.poll(), None, "no store answered yet");
        a.send(true).unwrap();
        assert_eq!(w.poll(), None, "one store still syncing");
        b.send(true).unwrap();
        assert_eq!(w.poll(), Some(true));

        let (a, ra) = flume::bounded(1);
        let (b, rb) = flume::bounded::<bool>(1);
        let mut w = FlushWait::new(vec![ra, rb], far);
        a.send(false).unwrap();
        assert_eq!(w.poll(), Some(false), "a store that could not sync fails the flush at once");
        drop(b);

        let (_keep, ra) = flume::bounded::<bool>(1);
        let (b, rb) = flume::bounded::<bool>(1);
        drop(b);
        assert_eq!(FlushWait::new(vec![ra, rb], far).poll(), Some(false), "a store gone fails the flush");

        let (_keep, ra) = flume::bounded::<bool>(1);
        assert_eq!(FlushWait::new(vec![ra], std::time::Instant::now()).poll(), Some(false), "past the deadline");
    }
}
