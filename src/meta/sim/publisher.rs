//! The simulation's pipelined publisher: what a replicated queue's enqueuer does
//! (`broker/queue/replica.rs`, step 1). It proposes single `Enqueue`s of queue [`PUBLISHED`]
//! to one node, up to [`IN_FLIGHT`] waiting at once, and checks the promise that design rests
//! on (`MetaHandle::submit_batch`): of the proposals one driver took in order, those answered
//! `Enqueued` got offsets in that same order, whatever leader changes, restarts and lost
//! messages happened meanwhile. When its node's driver goes, it starts a new session on
//! another node (the order is promised per driver only).

use std::collections::{BTreeMap, HashMap};

use super::workload::{Answer, Pending};
use super::Sim;
use crate::meta::state::{Command, Outcome};

/// The queue the publisher enqueues to (declared by the clients' setup).
pub(super) const PUBLISHED: &str = "p0";
/// Most proposals waiting for their answer at once (the enqueuer's `MAX_BATCHES_IN_FLIGHT`).
const IN_FLIGHT: usize = 4;

/// A session: a node's index and the incarnation of its driver.
type Session = (usize, u32);

#[derive(Default)]
pub(super) struct Publisher {
    session: Option<Session>,
    next_seq: u64,
    /// (session, sequence in it, proposal).
    in_flight: Vec<(Session, u64, Pending)>,
    /// Per session, the offsets answered so far by sequence.
    answered: HashMap<Session, BTreeMap<u64, u64>>,
    /// Enqueues answered `Enqueued`.
    pub(super) enqueued: u64,
}

impl Sim {
    /// Polls the publisher's proposals, checks their order, and proposes more (step 4 of a
    /// simulation step, beside the clients).
    pub(super) fn publisher_step(&mut self) -> Result<(), String> {
        let mut p = std::mem::take(&mut self.work.publisher);
        let r = self.publish(&mut p);
        self.work.publisher = p;
        r
    }

    fn publish(&mut self, p: &mut Publisher) -> Result<(), String> {
        for (session, seq, mut pending) in std::mem::take(&mut p.in_flight) {
            match self.poll(&mut pending)? {
                None => p.in_flight.push((session, seq, pending)),
                Some(Answer::Ok(outcomes)) => {
                    let Some(Outcome::Enqueued { offset }) = outcomes.first() else { continue };
                    let seen = p.answered.entry(session).or_default();
                    let before = seen.range(..seq).next_back();
                    let after = seen.range(seq + 1..).next();
                    if before.is_some_and(|(_, o)| o >= offset) || after.is_some_and(|(_, o)| o <= offset) {
                        return Err(format!(
                            "node {}: enqueue {seq} got offset {offset}, out of proposal order (before it {before:?}, after it {after:?})",
                            self.nodes[session.0].id
                        ));
                    }
                    seen.insert(seq, *offset);
                    p.enqueued += 1;
                }
                Some(Answer::Failed(_)) => {}
            }
        }
        if !self.work_ready() {
            return Ok(());
        }
        if !p.session.is_some_and(|(i, inc)| self.same_driver(i, inc)) {
            p.session = self.up_node().map(|i| (i, self.nodes[i].incarnation));
        }
        let Some(session) = p.session else { return Ok(()) };
        while p.in_flight.iter().filter(|(s, _, _)| *s == session).count() < IN_FLIGHT {
            let seq = p.next_seq;
            p.next_seq += 1;
            let cmd = Command::Enqueue {
                vhost: "/".into(),
                queue: PUBLISHED.into(),
                flags: 1,
                header: bytes::Bytes::new(),
                // Distinct bodies: the check finds each answer's own entry in the log.
                body: bytes::Bytes::from(seq.to_le_bytes().to_vec()),
            };
            let pending = self.propose(session.0, vec![cmd]);
            p.in_flight.push((session, seq, pending));
        }
        Ok(())
    }
}
