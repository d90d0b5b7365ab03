//! The embedded Raft metadata group (DESIGN.md, "Metadata and the embedded Raft group").
//!
//! Owns the durable metadata — vhosts, exchanges, queues (arguments, durability, owner node,
//! core and epoch), bindings, one shared cursor per queue, and every node's boot epoch — as one
//! Raft group built on raft-rs (`RawNode`). Single voter by default: no network, the node
//! campaigns at once and is its own leader. More voters are the same group with a transport
//! added to the driver (see `driver.rs`, "Adding voters").
//!
//! # Layout
//! - `topology.rs`: the topology types: vhosts, exchanges, queues, bindings, [`Topology`] (what
//!   routers read), and their serde forms.
//! - `state.rs`: the pure state machine ([`MetaState::apply`]) with its [`Command`]s and
//!   [`Outcome`]s.
//! - `access.rs`: users, permissions, policies and operator policies (data, apply, codec of
//!   tags 32 and up).
//! - `codec.rs`: the binary form of a command batch (the data of one Raft entry).
//! - `wire.rs`: byte-level primitives shared by the binary formats (varints, strings, field
//!   tables, a bounds-checked reader, [`DecodeError`]).
//! - `storage.rs`: the durable log + snapshot files ([`storage::DiskStorage`], a `raft::Storage`):
//!   open and replay, append, disk room.
//! - `record.rs`: the record format of `meta.log`.
//! - `snapshot.rs`: `meta.snap` and log compaction.
//! - `writer.rs`: the log writer thread (every Ready's write and fdatasync, off the driver).
//! - `handle.rs`: [`MetaHandle`], the handle every core holds.
//! - `driver.rs`: the driver thread (the raft-rs Ready loop, group commit, applying entries).
//! - `proptests.rs` (tests only): property tests of the state machine with the codec and the
//!   snapshot JSON.
//!
//! # Invariants
//! 1. A proposal resolves only after its Raft entry is written and fdatasync'ed, committed, and
//!    applied to the in-memory state; the topology version is bumped before it resolves.
//! 2. Group commit: every proposal waiting when the driver wakes rides in one Raft entry
//!    (bounded by `driver::MAX_ENTRY_BYTES`); one Ready costs one write, and the log writer
//!    covers every write waiting when it wakes with one fdatasync (`writer.rs`).
//! 3. `apply` is pure: replaying the same log yields the same state on every node and after
//!    every restart.
//! 4. Leader check: this node is the leader exactly when raft-rs's current leader id equals its
//!    own id ([`MetaHandle::is_leader`]); no other election exists.
//!
//! # Assumptions
//! - One process per metadata directory (nothing locks the directory).
//! - Blocking file I/O happens only on the driver and log-writer threads, never on a glommio
//!   executor; the driver's own I/O is opening, compaction and installing a snapshot.
//! - Callers on executors use the `async` methods; [`MetaHandle::propose_blocking`] is for
//!   plain threads (startup, tests).

pub mod access;
mod balance;
#[cfg(test)]
mod cluster_tests;
pub mod codec;
pub mod data;
pub mod driver;
pub mod grow;
pub mod handle;
mod members;
pub mod net;
#[cfg(test)]
mod proptests;
mod raftlog;
mod ready;
pub mod record;
#[cfg(test)]
mod sim;
pub mod snapshot;
pub mod state;
pub mod storage;
pub mod topology;
#[cfg(test)]
mod torn_tests;
pub mod wire;
pub mod writer;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

// `meta::MetaHandle` is used outside src/meta (main.rs, core, broker::queue); `meta::MetaError`
// is defined below, not re-exported. The other names below have no caller outside src/meta
// today; they keep the `meta::` paths they had before the split (then via `state.rs`).
pub use balance::LeaderBalance;
pub use handle::{MetaHandle, Proposal};
pub use members::MemberChange;
pub use net::{ClusterFigures, ClusterSpec, NetInbox, NetInboxRx, RaftNet, Role};
pub use state::{Command, MetaState, Outcome};
pub use topology::{Binding, ClusterIdentity, DestKind, ExchangeDef, ExchangeKind, NodeId, QueueDef, Topology, PREDECLARED_EXCHANGES};
pub use wire::DecodeError;

/// Errors of the metadata group.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// A file operation in the metadata directory failed. Fatal for the driver after a failed
    /// write or fsync (the page cache state is unknown): it stops and later calls get
    /// [`MetaError::Failed`].
    #[error("metadata storage: {what} {}: {source}", path.display())]
    Io {
        /// The operation ("fdatasync log", "rename temp file", ...).
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `meta.log` is damaged somewhere other than its tail (or has a bad header).
    #[error("corrupt metadata log {} at byte {offset}: {why}", path.display())]
    CorruptLog {
        /// The log file.
        path: PathBuf,
        /// Byte offset of the bad record.
        offset: u64,
        /// What was wrong.
        why: &'static str,
    },
    /// `meta.snap` fails its checksum or does not parse.
    #[error("corrupt metadata snapshot {}: {why}", path.display())]
    CorruptSnapshot {
        /// The snapshot file.
        path: PathBuf,
        /// What was wrong.
        why: String,
    },
    /// A committed entry does not decode as a command batch.
    #[error("corrupt metadata entry at raft index {index}: {source}")]
    CorruptEntry {
        /// Raft index of the entry.
        index: u64,
        /// The decoding failure.
        #[source]
        source: DecodeError,
    },
    /// raft-rs returned an error (or a bad argument such as node id 0).
    #[error("raft: {0}")]
    Raft(String),
    /// The driver thread has stopped ([`MetaHandle::shutdown`] or all handles dropped).
    #[error("metadata group stopped")]
    Stopped,
    /// The driver stopped after a fatal error (the message says which); the broker should exit.
    #[error("metadata group failed: {0}")]
    Failed(String),
    /// The metadata log cannot get the disk blocks this proposal needs (the filesystem is
    /// full): nothing was proposed, the group goes on, and the same call may succeed once
    /// space is back.
    #[error("metadata log {}: no disk space for {bytes} more bytes", path.display())]
    DiskFull {
        /// The log file.
        path: PathBuf,
        /// Bytes the proposal needed.
        bytes: u64,
    },
    /// This node is not the leader, so it cannot propose (multi-voter groups only).
    #[error("not the metadata leader (leader: {leader:?})")]
    NotLeader {
        /// The current leader, if one is known.
        leader: Option<NodeId>,
    },
    /// The proposal or read barrier was not answered in time: no leader is known, or the
    /// leader has no majority behind it. A proposal may still be applied later (its outcome
    /// is unknown); a retry is safe for every command (a cluster's `NodeBoot` carries the epoch it
    /// boots from and applies once).
    #[error("metadata group unavailable: no quorum answered within {waited_ms} ms (leader: {leader:?})")]
    NoQuorum {
        /// How long it waited, ms.
        waited_ms: u64,
        /// The leader known at the time, if any.
        leader: Option<NodeId>,
    },
    /// The data directory's stored voters do not fit how this node was started: a single
    /// node's directory started with `--peers`, or a cluster's without (membership changes go
    /// through Raft, never through a different list).
    #[error("the metadata group in this data directory has voters {stored:?}, but this node was started with {given:?}: a single node's data directory does not become a cluster node through --peers, nor a cluster node's a single node; start it as it was formed (a new node of a running cluster: an empty data directory and --join)")]
    Membership {
        /// Voters recorded in the log or snapshot.
        stored: Vec<NodeId>,
        /// Voters given at start.
        given: Vec<NodeId>,
    },
    /// This node's data directory belongs to a cluster whose voters no longer include it
    /// (it was forgotten: its own log says so, or a running node did at start): it must not
    /// vote or serve with that state.
    #[error("node {node} is not a member of the cluster (voters {voters:?}): it was removed (--forget-node); start it from an empty data directory with --join, under a new --node-id, to add it again")]
    NotAMember {
        /// This node.
        node: NodeId,
        /// The voters recorded in the log or snapshot.
        voters: Vec<NodeId>,
    },
}

/// Tunables of the metadata group; [`MetaConfig::default`] is what [`MetaHandle::start`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaConfig {
    /// Compact (snapshot + fresh log) once the log holds more entries than this since the last
    /// snapshot. Default 10,000.
    pub compact_entries: u64,
    /// ...or once `meta.log` is larger than this many bytes. Default 16 MiB.
    pub compact_bytes: u64,
    /// A proposal or read barrier not answered within this fails with
    /// [`MetaError::NoQuorum`]. Default 10 s ([`driver::PROPOSE_TIMEOUT`]).
    pub propose_timeout: std::time::Duration,
    /// When the leader moves to the node that proposes most (`balance.rs`); `None`: never.
    /// Used in a cluster only. Default: [`LeaderBalance::default`].
    pub leader_balance: Option<LeaderBalance>,
}

impl Default for MetaConfig {
    fn default() -> Self {
        MetaConfig {
            compact_entries: snapshot::COMPACT_ENTRIES,
            compact_bytes: snapshot::COMPACT_BYTES,
            propose_timeout: driver::PROPOSE_TIMEOUT,
            leader_balance: Some(LeaderBalance::default()),
        }
    }
}

/// Counters of the metadata group since start (for metrics and the bench note).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaStats {
    /// Raft entries appended to the log (proposal batches + leader no-ops).
    pub entries_appended: u64,
    /// fdatasync/fsync calls on the log, snapshot and directory.
    pub fsyncs: u64,
    /// Commands applied to the state machine (including replay at start).
    pub commands_applied: u64,
    /// Proposal requests received (one per `propose` / `propose_batch` call).
    pub proposals: u64,
    /// Bytes written to the log and snapshot files.
    pub log_bytes_written: u64,
    /// Snapshots written (log compactions).
    pub snapshots: u64,
    /// Snapshots received from the leader and installed (this node was too far behind, or
    /// joined past a compaction).
    pub snapshots_installed: u64,
}

/// One monotonically increasing counter.
#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The counters behind [`MetaStats`], shared by the driver, the storage and the handles.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) entries_appended: Counter,
    pub(crate) fsyncs: Counter,
    pub(crate) commands_applied: Counter,
    pub(crate) proposals: Counter,
    pub(crate) log_bytes_written: Counter,
    pub(crate) snapshots: Counter,
    pub(crate) snapshots_installed: Counter,
}

impl Counters {
    pub(crate) fn stats(&self) -> MetaStats {
        MetaStats {
            entries_appended: self.entries_appended.get(),
            fsyncs: self.fsyncs.get(),
            commands_applied: self.commands_applied.get(),
            proposals: self.proposals.get(),
            log_bytes_written: self.log_bytes_written.get(),
            snapshots: self.snapshots.get(),
            snapshots_installed: self.snapshots_installed.get(),
        }
    }
}
