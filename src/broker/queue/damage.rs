//! A queue whose store lost records to damage: a record that failed its CRC or framing
//! check when read (the store drops it and reports it: `Shard::take_corrupt`), or a range
//! its recovery dropped below where the store continues (a flipped bit or a hole in a
//! sealed segment; not a torn tail, which the Raft log's replay writes again).
//!
//! # Rules
//! 1. A damaged record is never served: the store hands out only records that pass their
//!    check, so the damage shows as a message missing from this copy.
//! 2. A replicated copy that misses a message is incomplete: the node leaves the queue's
//!    replica set, and when it serves the queue it first moves it to another member
//!    (`copy.rs`, receiving step 3), which serves every message this copy lost (their
//!    settles were never proposed). Leaving drops the copy here (`broker/replicas.rs`), and
//!    the metadata leader grows the set back with a fresh copy from the server: the damage
//!    is repaired from the other replicas.
//! 3. A damaged server copies nothing more to a node growing into the set (its copier stops
//!    at the damage): a copy made from it would be incomplete too.
//! 4. An unreplicated queue has no other copy: the message is lost (the store logged which
//!    one and where); the queue serves the rest.
//!
//! 5. The mark lasts until the copy is dropped: a replicated copy found damaged gets a
//!    [`DAMAGE_FILE`] in its directory, so the copy reopened in another role (it stepped
//!    aside), or after a restart, is still known damaged, and the node drops it even when a
//!    grow to it began (a grow stores its copy over what the store holds, which would keep
//!    the loss: `broker/replicas.rs`).
//!
//! Damage is looked for where the store is read: at open (recovery and the record scan),
//! by the dispatcher's reads, basic.get, the copier and dead-lettering. A member that does
//! not serve reads nothing, so its damage is found when it starts serving.

use std::io::Write;
use std::path::Path;

use super::{Queue, Recovered};

/// File in a replicated queue's directory saying its copy is damaged (rule 5): it holds the
/// reason, one line.
pub const DAMAGE_FILE: &str = "damaged";

impl Recovered {
    /// The damage recovery `report` names below `next` (the store's next offset after it):
    /// a range dropped there cannot be written again, unlike a torn tail (dropped from where
    /// the store continues, which a replicated copy's log replay writes again).
    /// Also damage: a [`DAMAGE_FILE`] in the queue's directory (`queue_dir`), left by a run
    /// that found this copy damaged (rule 5).
    pub fn damage_of(report: &ringmq_shards::RecoveryReport, next: u64, queue_dir: &Path) -> Option<String> {
        let below: Vec<String> =
            report.dropped.iter().filter(|(from, _, _)| *from < next).map(|(from, to, why)| format!("{from}..{to}: {why}")).collect();
        if !below.is_empty() {
            return Some(format!("recovery dropped records {}", below.join("; ")));
        }
        let marked = std::fs::read_to_string(queue_dir.join(DAMAGE_FILE)).ok()?;
        Some(format!("found damaged by an earlier run ({})", marked.trim()))
    }
}

impl Queue {
    /// Whether this queue's copy was found damaged (rule 2: it is leaving, or left, its
    /// replica set); always false for an unreplicated queue.
    pub fn damaged(&self) -> bool {
        self.repl.as_ref().is_some_and(|r| r.grow.damaged)
    }

    /// Takes what the store's reads dropped since the last call (`Shard::take_corrupt`) and
    /// applies rules 2 and 4; returns [`Queue::damaged`].
    pub(super) fn check_damage(&mut self) -> bool {
        let lost = self.shard.take_corrupt();
        if !lost.is_empty() {
            let shown: Vec<u64> = lost.iter().copied().take(8).collect();
            self.lost_to_damage(&format!("{} record(s) failed their check when read (offsets {shown:?})", lost.len()));
        } else if self.repl.as_ref().is_some_and(|r| r.grow.damaged && !r.grow.leaving) {
            // The proposal to leave failed (no quorum): again, at this later read.
            self.leave_replica_set("its store is damaged (leaving again)");
        }
        self.damaged()
    }

    /// Rules 2 and 4 for damage described by `why`.
    pub(super) fn lost_to_damage(&mut self, why: &str) {
        let Some(r) = self.repl_mut() else {
            tracing::error!(queue = %self.qref.key.name, vhost = %self.qref.key.vhost, reason = why,
                "messages lost to a damaged store (the queue is not replicated: no copy to repair them from)");
            return;
        };
        if !r.grow.damaged {
            r.grow.damaged = true;
            if let Some(dir) = self.shard.dir().parent() {
                mark_damaged(dir, why);
            }
        }
        self.leave_replica_set(&format!("its store is damaged: {why}"));
    }
}

/// Writes [`DAMAGE_FILE`] in `queue_dir` and syncs it with its directory (rule 5), on the
/// core's thread: a rare path, and the mark must be down before the copy reopens. A failure
/// is logged: the copy is still dropped in this run, only a crash before that would keep it.
fn mark_damaged(queue_dir: &Path, why: &str) {
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(queue_dir.join(DAMAGE_FILE))?;
        writeln!(f, "{why}")?;
        f.sync_all()?;
        std::fs::File::open(queue_dir)?.sync_all()
    };
    if let Err(e) = write() {
        tracing::error!(dir = %queue_dir.display(), error = %e, "could not mark the queue's copy damaged");
    }
}
