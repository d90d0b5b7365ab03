//! The driver's Ready handling (raft-rs's steps, in raft-rs's order) and applying committed
//! entries to the state machine (driver.rs module doc, steps 4 and 5).

use std::sync::atomic::Ordering;

use protobuf::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeV2, Entry, EntryType, Message};
use raft::StateRole;

use super::codec::decode_batch;
use super::data::DataOp;
use super::driver::{Driver, Unpersisted};
use super::net::{ClusterFigures, PeerProgress, Role};
use super::state::{Command, Outcome};
use super::MetaError;

/// Most Ready rounds handled per loop iteration (each round needs fresh raft-rs work).
const MAX_READY_ROUNDS: usize = 64;

/// How long a read barrier waits for its read index before it is asked for again
/// ([`Driver::ask_reads_again`]): a quarter of an election timeout.
const READ_ASK_AGAIN: std::time::Duration = std::time::Duration::from_millis(250);

/// A read barrier handed to raft-rs whose read index is not known yet.
pub(super) struct PendingRead {
    /// When it was asked (its `PROPOSE_TIMEOUT` runs from here).
    pub(super) since: std::time::Instant,
    /// When it was last handed to raft-rs.
    sent: std::time::Instant,
    pub(super) reply: flume::Sender<Result<(), MetaError>>,
}

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

    /// raft-rs's Ready handling, repeated while raft-rs has work. A Ready's write goes to the
    /// log writer (`writer.rs`) and raft-rs takes it with `advance_append_async`; the Ready is
    /// durable, and its persisted messages go out, in [`Driver::on_persisted`].
    pub(super) fn on_ready(&mut self) -> Result<(), MetaError> {
        for _ in 0..MAX_READY_ROUNDS {
            if !self.raw.has_ready() {
                break;
            }
            let mut rd = self.raw.ready();
            // A leader may send before its own write (raft-rs, "Ready" step 1).
            self.send(rd.take_messages());
            let snapshot = !rd.snapshot().is_empty();
            if snapshot {
                // Installing replaces `meta.log`: every write in flight lands first.
                self.writer.wait_idle()?;
                let state = self.raw.mut_store().install_snapshot(rd.snapshot())?;
                tracing::info!(index = state.applied_index, "metadata snapshot installed from the leader");
                self.shared.data.skipped_to(state.applied_index);
                self.voters = rd.snapshot().get_metadata().get_conf_state().voters.clone();
                super::members::sync_peers(self.net.as_ref(), &state, Some(&self.voters));
                let old = std::mem::replace(&mut *self.shared.state.lock(), state);
                self.shared.version.fetch_add(1, Ordering::AcqRel);
                // This node's copies of the queues enqueued to meanwhile lack those messages:
                // it leaves their replica sets (`data.rs`, invariant 4).
                let missed = {
                    let st = self.shared.state.lock();
                    super::data::missed_queues(&old, &st, self.shared.node)
                };
                if !missed.is_empty() {
                    tracing::warn!(
                        queues = missed.len(),
                        "this node missed messages of the queues it stores (a snapshot replaced its log): it leaves their replica sets"
                    );
                    let me = self.shared.node;
                    self.propose_own(
                        missed.into_iter().map(|(vhost, queue)| Command::LeaveReplicaSet { vhost, queue, node: me }).collect(),
                    );
                }
            }
            for rs in rd.take_read_states() {
                self.read_state(rs.index, &rs.request_ctx);
            }
            // raft-rs hands out only entries that are committed and durable here.
            let committed = rd.take_committed_entries();
            self.apply_entries(committed)?;
            let entries = rd.take_entries();
            let staged = self.raw.mut_store().stage(&entries, rd.hs(), rd.must_sync())?;
            // Votes and appends are answered only once they are on disk: the writer sends them
            // after the write (and every earlier one) lands.
            let msgs = rd.take_persisted_messages();
            let write = match staged {
                Some(mut w) => {
                    w.msgs = msgs;
                    Some(self.writer.submit(w)?)
                }
                None if !msgs.is_empty() && self.writer.poll()? < self.writer.submitted() => {
                    let mut w = self.raw.store().empty_write();
                    w.msgs = msgs;
                    Some(self.writer.submit(w)?)
                }
                None => {
                    self.send(msgs);
                    None
                }
            };
            let number = rd.number();
            self.raw.advance_append_async(rd);
            self.unpersisted.push_back(Unpersisted { number, write });
            if snapshot {
                // raft-rs moves its applied index to the snapshot's below, which it allows only
                // once the snapshot's Ready is durable.
                self.writer.wait_idle()?;
            }
            self.release_durable()?;
            self.raw.advance_apply();
        }
        self.resolve_reads();
        self.note_leader();
        Ok(())
    }

    /// Takes the log writer's news and handles what durable Readys released (commits,
    /// appends to followers). Errors: a failed write (fatal).
    pub(super) fn on_persisted(&mut self) -> Result<(), MetaError> {
        if self.release_durable()? {
            self.on_ready()?;
        }
        Ok(())
    }

    /// Tells raft-rs which Readys are durable (in Ready order: a Ready that wrote nothing is
    /// durable once the ones before it are); true when one was. Their messages went out from
    /// the writer. Errors: a failed write (fatal).
    fn release_durable(&mut self) -> Result<bool, MetaError> {
        let durable = self.writer.poll()?;
        let mut through = None;
        while let Some(u) = self.unpersisted.front() {
            if u.write.is_some_and(|n| n > durable) {
                break;
            }
            through = self.unpersisted.pop_front().map(|u| u.number);
        }
        let Some(number) = through else { return Ok(false) };
        self.raw.on_persist_ready(number);
        Ok(true)
    }

    /// Hands a read barrier to raft-rs (its context: a fresh request id).
    pub(super) fn ask_read(&mut self, reply: flume::Sender<Result<(), MetaError>>) {
        let id = self.next_read;
        self.next_read += 1;
        self.raw.read_index(id.to_le_bytes().to_vec());
        self.reads.insert(id, PendingRead { since: self.now, sent: self.now, reply });
    }

    /// Asks again, under the same id, for every read barrier without a read index after
    /// [`READ_ASK_AGAIN`]: raft-rs drops a read request, telling nobody, on a follower that knows
    /// no leader and on a leader that has not committed an entry of its term yet (its first
    /// moments), so a node that synced right after an election waited out the whole
    /// `PROPOSE_TIMEOUT` (seen at start: "could not catch up with the metadata group", 10 s).
    /// Whichever answer comes first resolves it; a later one finds no entry.
    pub(super) fn ask_reads_again(&mut self) {
        let now = self.now;
        let mut due: Vec<u64> =
            self.reads.iter().filter(|(_, r)| now.saturating_duration_since(r.sent) >= READ_ASK_AGAIN).map(|(id, _)| *id).collect();
        // In id order: the simulator replays a seed exactly.
        due.sort_unstable();
        for id in due {
            if let Some(r) = self.reads.get_mut(&id) {
                r.sent = now;
            }
            self.raw.read_index(id.to_le_bytes().to_vec());
        }
    }

    /// A read index arrived for barrier `ctx`: it resolves once applied reaches `index`.
    fn read_state(&mut self, index: u64, ctx: &[u8]) {
        let Ok(id) = <[u8; 8]>::try_from(ctx).map(u64::from_le_bytes) else { return };
        if let Some(r) = self.reads.remove(&id) {
            self.reads_at.push((index, r.since, r.reply));
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
            l if l == self.shared.node => {
                tracing::info!(node = l, term, "this node now leads the metadata group");
                self.became_leader_for_load();
            }
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
            last_index: r.raft_log.last_index(),
            snapshot_index: self.raw.store().snapshot_index(),
            commit_latency_us: self.commit_latency_us,
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
                    let mut v1 = None;
                    let applied = if e.get_entry_type() == EntryType::EntryConfChange {
                        let cc = ConfChange::parse_from_bytes(&e.data).map_err(bad)?;
                        let applied = self.raw.apply_conf_change(&cc);
                        v1 = Some(cc);
                        applied
                    } else {
                        let cc = ConfChangeV2::parse_from_bytes(&e.data).map_err(bad)?;
                        self.raw.apply_conf_change(&cc)
                    };
                    let cs = applied.map_err(|err| MetaError::Raft(format!("apply conf change: {err}")))?;
                    tracing::info!(voters = ?cs.voters, "metadata group membership changed");
                    let before = std::mem::replace(&mut self.voters, cs.voters.clone());
                    let w = self.raw.mut_store().stage_conf_state(cs);
                    self.writer.submit(w)?;
                    if let Some(cc) = v1 {
                        self.applied_member_change(&e, &cc, &before);
                    }
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
        // Per command: this node stores the data it carries (`grow::stored_by`).
        let mut stored = Vec::with_capacity(cmds.len());
        {
            let mut st = self.shared.state.lock();
            if !st.first_application(&e.context, e.index) {
                // A copy proposed again after a leader change, whose original was applied
                // (`Driver::repropose`): its commands took effect once already.
                st.applied_index = e.index;
                drop(st);
                tracing::debug!(index = e.index, "skipped a second copy of an applied entry");
                #[cfg(test)]
                if let Some(log) = &mut self.applied_log {
                    log.push((e.index, e.term, Vec::new(), Vec::new()));
                }
                return Ok(());
            }
            let mut changed = false;
            for cmd in &cmds {
                if let Command::DeleteQueue { vhost, name } = cmd {
                    // The core of a deleted queue's store, for its `DataOp::Dropped`.
                    dropped_cores.push(st.topology.queue(vhost, name).map(|d| d.owner_core).unwrap_or(0));
                }
                stored.push(super::grow::stored_by(&st, cmd, self.shared.node));
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
        self.shared.data.push(e.index, data_ops(&cmds, &outcomes, &stored, &dropped_cores));
        #[cfg(test)]
        if let Some(log) = &mut self.applied_log {
            log.push((e.index, e.term, cmds.clone(), outcomes.clone()));
        }
        if let Some((_, seq)) = super::state::proposal_context(&e.context).filter(|(nonce, _)| *nonce == self.nonce) {
            if let Some(f) = self.in_flight.remove(&seq) {
                self.commit_latency_us = self.now.saturating_duration_since(f.since).as_micros() as u64;
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
/// `stored`: per command, whether this node stores the data it carries, as decided when it
/// applied (`grow::stored_by`): a replay at start hands the stores exactly what it did live.
/// `dropped_cores`: the owner core of each `DeleteQueue` of the entry, in order.
fn data_ops(cmds: &[Command], outcomes: &[Outcome], stored: &[bool], dropped_cores: &[u32]) -> Vec<DataOp> {
    let mut ops = Vec::new();
    let mut cores = dropped_cores.iter();
    for ((cmd, o), here) in cmds.iter().zip(outcomes).zip(stored) {
        match (cmd, o) {
            (Command::Enqueue { vhost, queue, flags, header, body }, Outcome::Enqueued { offset }) if *here => ops.push(DataOp::Enqueue {
                vhost: vhost.clone(),
                queue: queue.clone(),
                offset: *offset,
                flags: *flags,
                header: header.clone(),
                body: body.clone(),
            }),
            (Command::Settle { vhost, queue, offsets }, Outcome::Settled) if *here => {
                ops.push(DataOp::Settle { vhost: vhost.clone(), queue: queue.clone(), offsets: offsets.clone() })
            }
            (Command::Return { vhost, queue, counts }, Outcome::Settled) if *here => {
                ops.push(DataOp::Returned { vhost: vhost.clone(), queue: queue.clone(), counts: counts.clone() })
            }
            (Command::MoveQueue { vhost, queue, to, .. }, Outcome::Moved) => {
                ops.push(DataOp::Moved { vhost: vhost.clone(), queue: queue.clone(), to: *to })
            }
            (Command::CopyMessages { vhost, queue, id, from, to, messages }, Outcome::Copied { .. }) if *here => ops.push(DataOp::Copy {
                vhost: vhost.clone(),
                queue: queue.clone(),
                id: *id,
                from: *from,
                to: *to,
                messages: messages.clone(),
            }),
            (Command::JoinReplicaSet { vhost, queue, id, tail }, Outcome::Moved) if *here => {
                ops.push(DataOp::Joined { vhost: vhost.clone(), queue: queue.clone(), id: *id, tail: *tail })
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
