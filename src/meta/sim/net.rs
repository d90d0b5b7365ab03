//! The simulated network: every message gets a random delay (FIFO per directed link, except
//! the few it reorders), some are dropped, a few duplicated, and cut links (partitions) drop
//! everything. Times are simulated milliseconds.

use std::collections::{BTreeMap, BTreeSet};

use parking_lot::Mutex;
use raft::eraftpb::{Message, MessageType};

use super::Rng;
use crate::meta::net::RaftNet;
use crate::meta::topology::NodeId;

/// Every node's outbound side: raft-rs's messages wait here (in send order, `from` naming the
/// sender) until the simulator takes them after the node's turn.
#[derive(Default)]
pub(super) struct Outbox(pub(super) Mutex<Vec<Message>>);

impl RaftNet for Outbox {
    fn send(&self, msgs: Vec<Message>) {
        self.0.lock().extend(msgs);
    }
}

/// How unreliable the network is, per mille of messages (drawn per seed).
#[derive(Clone, Copy, Debug)]
pub(super) struct Profile {
    /// Dropped at send.
    pub(super) drop_pm: u64,
    /// Of the dropped ones, lost without an unreachable report (a write lost with its
    /// connection).
    pub(super) silent_pm: u64,
    /// Sent twice.
    pub(super) dup_pm: u64,
    /// Not held behind earlier messages on its link.
    pub(super) reorder_pm: u64,
    /// Slow (50–300 ms instead of 1–20 ms).
    pub(super) slow_pm: u64,
}

impl Profile {
    pub(super) fn draw(rng: &mut Rng) -> Profile {
        Profile {
            drop_pm: rng.range(0, 80),
            silent_pm: rng.range(0, 500),
            dup_pm: rng.range(0, 30),
            reorder_pm: rng.range(0, 50),
            slow_pm: rng.range(0, 60),
        }
    }
}

/// What became of a message handed to [`Network::send`].
pub(super) enum Sent {
    /// Queued for delivery.
    Queued,
    /// Dropped; the sender should hear of it (unreachable, or a failed snapshot).
    Dropped,
    /// Dropped without a word.
    Lost,
}

/// Counters for the end-of-seed line.
#[derive(Debug, Default)]
pub(super) struct NetStats {
    pub(super) sent: u64,
    pub(super) dropped: u64,
    pub(super) duplicated: u64,
    pub(super) snapshots: u64,
}

pub(super) struct Network {
    pub(super) profile: Profile,
    /// In flight, by (due time, send sequence).
    queue: BTreeMap<(u64, u64), Message>,
    seq: u64,
    /// Cut directed links (from, to).
    cut: BTreeSet<(NodeId, NodeId)>,
    /// Due time of the last message queued per link (FIFO).
    last_due: BTreeMap<(NodeId, NodeId), u64>,
    pub(super) stats: NetStats,
    /// No random drops (the liveness probes' window; see sim.rs, invariant 5).
    pub(super) lossless: bool,
}

impl Network {
    pub(super) fn new(profile: Profile) -> Network {
        Network {
            profile,
            queue: BTreeMap::new(),
            seq: 0,
            cut: BTreeSet::new(),
            last_due: BTreeMap::new(),
            stats: NetStats::default(),
            lossless: false,
        }
    }

    /// Hands one message to the network at time `now`.
    pub(super) fn send(&mut self, rng: &mut Rng, now: u64, msg: Message) -> Sent {
        self.stats.sent += 1;
        let link = (msg.from, msg.to);
        let snapshot = msg.get_msg_type() == MessageType::MsgSnapshot;
        if snapshot {
            self.stats.snapshots += 1;
        }
        if self.cut.contains(&link) || !self.lossless && rng.chance(self.profile.drop_pm) {
            self.stats.dropped += 1;
            // A snapshot always ends in a report.
            return if !snapshot && rng.chance(self.profile.silent_pm) { Sent::Lost } else { Sent::Dropped };
        }
        if !snapshot && rng.chance(self.profile.dup_pm) {
            self.stats.duplicated += 1;
            let due = now + self.delay(rng);
            self.push(due, msg.clone());
        }
        let mut due = now + self.delay(rng);
        let last = self.last_due.entry(link).or_insert(0);
        if !rng.chance(self.profile.reorder_pm) {
            due = due.max(*last);
        }
        *last = (*last).max(due);
        self.push(due, msg);
        Sent::Queued
    }

    fn delay(&self, rng: &mut Rng) -> u64 {
        if rng.chance(self.profile.slow_pm) {
            rng.range(50, 300)
        } else {
            rng.range(1, 20)
        }
    }

    fn push(&mut self, due: u64, msg: Message) {
        self.seq += 1;
        self.queue.insert((due, self.seq), msg);
    }

    /// Takes every message due at `now`, in due order.
    pub(super) fn due(&mut self, now: u64) -> Vec<Message> {
        let later = self.queue.split_off(&(now + 1, 0));
        std::mem::replace(&mut self.queue, later).into_values().collect()
    }

    pub(super) fn is_cut(&self, from: NodeId, to: NodeId) -> bool {
        self.cut.contains(&(from, to))
    }

    pub(super) fn any_cut(&self) -> bool {
        !self.cut.is_empty()
    }

    /// Cuts every link between a node of `a` and a node of `b`, both ways.
    pub(super) fn split(&mut self, a: &[NodeId], b: &[NodeId]) {
        for &x in a {
            for &y in b {
                self.cut.insert((x, y));
                self.cut.insert((y, x));
            }
        }
    }

    /// Cuts one direction of one link (an asymmetric partition).
    pub(super) fn cut_one(&mut self, from: NodeId, to: NodeId) {
        self.cut.insert((from, to));
    }

    pub(super) fn heal(&mut self) {
        self.cut.clear();
    }

    pub(super) fn describe_cuts(&self) -> String {
        let links: Vec<String> = self.cut.iter().map(|(a, b)| format!("{a}->{b}")).collect();
        links.join(" ")
    }
}
