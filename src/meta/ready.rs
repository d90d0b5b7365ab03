//! The driver's Ready handling (raft-rs's steps, in raft-rs's order) and applying committed
//! entries to the state machine (driver.rs module doc, steps 4 and 5).

use std::sync::atomic::Ordering;

use protobuf::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeV2, Entry, EntryType, Message};
use raft::StateRole;

use super::codec::decode_batch;
use super::data::DataOp;
use super::driver::Driver;
use super::net::{ClusterFigures, PeerProgress, Role};
use super::state::{Command, Outcome};
use super::MetaError;

/// Most Ready rounds handled per loop iteration (each round needs fresh raft-rs work).
const MAX_READY_ROUNDS: usize = 64;

impl Driver {
    /// Hands messages to the network (a single voter has none to send).
    fn send(&self, msgs: Vec<Message>) {
        if msgs.is_empty() {
            return;
        }
        match &self.net {
            Some(net) => net.send(msgs),
            None => tracing::trace!(n = msgs.len(), "raft messages dropped (single voter)"),
        }
    }

    /// raft-rs's Ready handling, repeated while raft-rs has work.
    pub(super) fn on_ready(&mut self) -> Result<(), MetaError> {
        for _ in 0..MAX_READY_ROUNDS {
            if !self.raw.has_ready() {
                break;
            }
            let mut rd = self.raw.ready();
            // A leader may send before its own write (raft-rs, "Ready" step 1).
            self.send(rd.take_messages());
            if !rd.snapshot().is_empty() {
                let state = self.raw.mut_store().install_snapshot(rd.snapshot())?;
                tracing::info!(index = state.applied_index, "metadata snapshot installed from the leader");
                self.shared.data.skipped_to(state.applied_index);
                let mut st = self.shared.state.lock();
                *st = state;
                self.shared.version.fetch_add(1, Ordering::AcqRel);
            }
            for rs in rd.take_read_states() {
                self.read_state(rs.index, &rs.request_ctx);
            }
            let committed = rd.take_committed_entries();
            self.apply_entries(committed)?;
            let entries = rd.take_entries();
            let hs = rd.hs().cloned();
            let sync = rd.must_sync();
            self.raw.mut_store().append(&entries, hs.as_ref(), sync)?;
            // Votes and appends answered only once they are on disk.
            self.send(rd.take_persisted_messages());
            let mut light = self.raw.advance(rd);
            if let Some(commit) = light.commit_index() {
                self.raw.mut_store().set_commit(commit);
            }
            self.send(light.take_messages());
            let committed = light.take_committed_entries();
            self.apply_entries(committed)?;
            self.raw.advance_apply();
        }
        self.resolve_reads();
        self.note_leader();
        Ok(())
    }

    /// A read index arrived for barrier `ctx`: it resolves once applied reaches `index`.
    fn read_state(&mut self, index: u64, ctx: &[u8]) {
        let Ok(id) = <[u8; 8]>::try_from(ctx).map(u64::from_le_bytes) else { return };
        if let Some((since, reply)) = self.reads.remove(&id) {
            self.reads_at.push((index, since, reply));
        }
    }

    fn resolve_reads(&mut self) {
        if self.reads_at.is_empty() {
            return;
        }
        let applied = self.shared.state.lock().applied_index;
        self.reads_at.retain(|(index, _, reply)| {
            if *index <= applied {
                let _ = reply.send(Ok(()));
                false
            } else {
                true
            }
        });
    }

    /// Publishes raft-rs's leader and logs a change (the log says plainly when it moves).
    fn note_leader(&mut self) {
        let leader = self.raw.raft.leader_id;
        self.shared.leader.store(leader, Ordering::Release);
        if leader == self.last_leader {
            return;
        }
        if self.last_leader != 0 || self.net.is_some() {
            self.leader_changes += 1;
        }
        let term = self.raw.raft.term;
        match leader {
            0 => tracing::warn!(node = self.shared.node, term, previous = self.last_leader, "metadata group has no leader"),
            l if l == self.shared.node => tracing::info!(node = l, term, "this node now leads the metadata group"),
            l => tracing::info!(leader = l, term, "metadata group leader is node {l}"),
        }
        self.last_leader = leader;
    }

    /// Refreshes [`ClusterFigures`] for handles (metrics).
    pub(super) fn publish_figures(&self) {
        let r = &self.raw.raft;
        let role = match r.state {
            StateRole::Leader => Role::Leader,
            StateRole::Candidate => Role::Candidate,
            StateRole::PreCandidate => Role::PreCandidate,
            StateRole::Follower => Role::Follower,
        };
        let mut peers = Vec::new();
        if role == Role::Leader {
            let last = r.raft_log.last_index();
            for (id, pr) in r.prs().iter() {
                if *id != self.shared.node {
                    peers.push(PeerProgress {
                        id: *id,
                        matched: pr.matched,
                        lag: last.saturating_sub(pr.matched),
                        recent_active: pr.recent_active,
                    });
                }
            }
            peers.sort_by_key(|p| p.id);
        }
        let figures = ClusterFigures {
            voters: self.voters.clone(),
            term: r.term,
            leader: r.leader_id,
            role,
            commit_index: r.raft_log.committed,
            applied_index: r.raft_log.applied,
            leader_changes: self.leader_changes,
            peers,
        };
        *self.shared.figures.lock() = figures;
    }

    /// Applies committed entries to the state and resolves their waiters (driver.rs module
    /// doc, step 5).
    fn apply_entries(&mut self, entries: Vec<Entry>) -> Result<(), MetaError> {
        for e in entries {
            match e.get_entry_type() {
                EntryType::EntryNormal => self.apply_normal(&e)?,
                EntryType::EntryConfChange | EntryType::EntryConfChangeV2 => {
                    let bad = |err: protobuf::ProtobufError| MetaError::Raft(format!("conf change: {err}"));
                    let applied = if e.get_entry_type() == EntryType::EntryConfChange {
                        let cc = ConfChange::parse_from_bytes(&e.data).map_err(bad)?;
                        self.raw.apply_conf_change(&cc)
                    } else {
                        let cc = ConfChangeV2::parse_from_bytes(&e.data).map_err(bad)?;
                        self.raw.apply_conf_change(&cc)
                    };
                    let cs = applied.map_err(|err| MetaError::Raft(format!("apply conf change: {err}")))?;
                    tracing::info!(voters = ?cs.voters, "metadata group membership changed");
                    self.voters = cs.voters.clone();
                    self.raw.mut_store().set_conf_state(cs)?;
                    self.shared.state.lock().applied_index = e.index;
                }
            }
        }
        Ok(())
    }

    fn apply_normal(&mut self, e: &Entry) -> Result<(), MetaError> {
        if e.data.is_empty() {
            // A new leader's no-op.
            self.shared.state.lock().applied_index = e.index;
            #[cfg(test)]
            if let Some(log) = &mut self.applied_log {
                log.push((e.index, e.term, Vec::new(), Vec::new()));
            }
            return Ok(());
        }
        let cmds = decode_batch(&e.data).map_err(|source| MetaError::CorruptEntry { index: e.index, source })?;
        let mut outcomes = Vec::with_capacity(cmds.len());
        let mut dropped_cores = Vec::new();
        {
            let mut st = self.shared.state.lock();
            let mut changed = false;
            for cmd in &cmds {
                if let Command::DeleteQueue { vhost, name } = cmd {
                    // The core of a deleted queue's store, for its `DataOp::Dropped`.
                    dropped_cores.push(st.topology.queue(vhost, name).map(|d| d.owner_core).unwrap_or(0));
                }
                let o = st.apply(cmd);
                changed |= cmd.changed_topology(&o);
                outcomes.push(o);
            }
            st.applied_index = e.index;
            if changed {
                self.shared.version.fetch_add(1, Ordering::AcqRel);
            }
        }
        self.counters.commands_applied.add(cmds.len() as u64);
        self.shared.data.push(e.index, data_ops(&cmds, &outcomes, &dropped_cores));
        #[cfg(test)]
        if let Some(log) = &mut self.applied_log {
            log.push((e.index, e.term, cmds.clone(), outcomes.clone()));
        }
        let ctx: &[u8] = &e.context;
        if ctx.len() == 16 && ctx[..8] == self.nonce.to_le_bytes() {
            let seq = u64::from_le_bytes(ctx[8..].try_into().unwrap_or_default());
            if let Some(f) = self.in_flight.remove(&seq) {
                let mut rest = outcomes.into_iter();
                for w in f.waiters {
                    let mine: Vec<Outcome> = rest.by_ref().take(w.count).collect();
                    let _ = w.reply.send(Ok(mine));
                }
            }
        }
        Ok(())
    }
}

/// The replicated-queue data of an applied entry (`data.rs`), in order.
/// `dropped_cores`: the owner core of each `DeleteQueue` of the entry, in order.
fn data_ops(cmds: &[Command], outcomes: &[Outcome], dropped_cores: &[u32]) -> Vec<DataOp> {
    let mut ops = Vec::new();
    let mut cores = dropped_cores.iter();
    for (cmd, o) in cmds.iter().zip(outcomes) {
        match (cmd, o) {
            (Command::Enqueue { vhost, queue, flags, header, body }, Outcome::Enqueued { offset }) => ops.push(DataOp::Enqueue {
                vhost: vhost.clone(),
                queue: queue.clone(),
                offset: *offset,
                flags: *flags,
                header: header.clone(),
                body: body.clone(),
            }),
            (Command::Settle { vhost, queue, offsets }, Outcome::Settled) => {
                ops.push(DataOp::Settle { vhost: vhost.clone(), queue: queue.clone(), offsets: offsets.clone() })
            }
            (Command::DeleteQueue { vhost, name }, o) => {
                let owner_core = cores.next().copied().unwrap_or(0);
                if *o == Outcome::Deleted {
                    ops.push(DataOp::Dropped { vhost: vhost.clone(), queue: name.clone(), owner_core });
                }
            }
            _ => {}
        }
    }
    ops
}
