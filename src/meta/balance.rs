//! Leadership follows the load: the metadata group's leader hands its place to the follower
//! that proposes most.
//!
//! Every replicated queue's publishes, settles and reservations are proposed by the node
//! that serves it; on a follower raft-rs forwards each proposal to the leader, and the commit
//! comes back one more hop later. With one group for the whole cluster the leader can sit
//! next to only some of that traffic, so it sits next to most of it: over each window
//! ([`LeaderBalance::window`]) the leader adds up the bytes of the entries each follower
//! forwarded and of its own, and when one follower forwarded more than
//! [`LeaderBalance::factor`] times its own and more than [`LeaderBalance::min_bytes_per_s`],
//! it transfers leadership to it (raft-rs `transfer_leader`: the follower is caught up first,
//! then campaigns at once; proposals dropped meanwhile are proposed again when the leader
//! has changed, `driver.rs` step 3; should the transfer fail instead, raft-rs gives it up
//! after an election timeout and the proposals a follower forwarded meanwhile fail at their
//! timeout).
//! A node that became leader holds the leadership for [`LeaderBalance::hold`] before it
//! moves it (no flapping between loads that change fast).
//!
//! Measured on one 3-node cluster, one queue, the bench's client alternately on the leader's
//! node and on a follower's: 31.5k against 28.6k confirmed msgs/s (bench/README.md).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use raft::StateRole;

use super::driver::Driver;
use super::topology::NodeId;

/// When the leader moves to the follower that proposes most (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaderBalance {
    /// Length of a measuring window. Default 5 s.
    pub window: Duration,
    /// A follower must forward more than this many bytes of entries per second. Default
    /// 1 MiB/s (about 1,000 messages of 1 KiB a second).
    pub min_bytes_per_s: u64,
    /// ...and more than this many times the leader's own. Default 2.
    pub factor: u64,
    /// A leadership is held at least this long before it moves again. Default 10 s.
    pub hold: Duration,
}

impl Default for LeaderBalance {
    fn default() -> Self {
        LeaderBalance { window: Duration::from_secs(5), min_bytes_per_s: 1 << 20, factor: 2, hold: Duration::from_secs(10) }
    }
}

/// The leader's counts over the current window.
pub(super) struct Load {
    since: Instant,
    own: u64,
    forwarded: HashMap<NodeId, u64>,
    /// When this node last became leader.
    held_since: Instant,
}

impl Load {
    pub(super) fn new(now: Instant) -> Load {
        Load { since: now, own: 0, forwarded: HashMap::new(), held_since: now }
    }
}

impl Driver {
    /// Counts an entry's bytes this leader proposed itself (`from` = this node) or a follower
    /// forwarded.
    pub(super) fn note_load(&mut self, from: NodeId, bytes: u64) {
        if from == self.raw.raft.id {
            self.load.own += bytes;
        } else {
            *self.load.forwarded.entry(from).or_default() += bytes;
        }
    }

    /// Starts a new window when this node became leader (a leadership is held from then).
    pub(super) fn became_leader_for_load(&mut self) {
        self.load = Load::new(self.now);
    }

    /// At the end of each window, on the leader of a cluster: transfers the leadership to the
    /// follower that forwarded most, if it passes the thresholds (module doc).
    pub(super) fn balance_leadership(&mut self) {
        let Some(cfg) = self.balance else { return };
        let now = self.now;
        let elapsed = now.saturating_duration_since(self.load.since);
        if elapsed < cfg.window {
            return;
        }
        let held_since = self.load.held_since;
        let load = std::mem::replace(&mut self.load, Load { held_since, ..Load::new(now) });
        if self.net.is_none() || self.raw.raft.state != StateRole::Leader || self.raw.raft.lead_transferee.is_some() {
            return;
        }
        if now.saturating_duration_since(load.held_since) < cfg.hold {
            return;
        }
        let voters = &self.voters;
        let Some((&to, &bytes)) = load.forwarded.iter().filter(|(id, _)| voters.contains(id)).max_by_key(|(id, b)| (**b, **id)) else {
            return;
        };
        // One that stopped answering would only stall proposals until raft-rs gives up the
        // transfer (an election timeout).
        if !self.raw.raft.prs().get(to).is_some_and(|p| p.recent_active) {
            return;
        }
        let per_s = bytes as f64 / elapsed.as_secs_f64();
        if per_s < cfg.min_bytes_per_s as f64 || bytes <= cfg.factor.saturating_mul(load.own) {
            return;
        }
        tracing::info!(
            to,
            forwarded_mb_s = format!("{:.1}", per_s / 1e6),
            own_mb_s = format!("{:.1}", load.own as f64 / elapsed.as_secs_f64() / 1e6),
            "moving the metadata group's leadership to the node that proposes most"
        );
        self.raw.transfer_leader(to);
    }
}
