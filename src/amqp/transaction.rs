//! A transactional channel's state (AMQP 0-9-1 class `tx`, spec 1.9, with RabbitMQ's
//! semantics): what tx.select holds until tx.commit, and which commits are complete.
//!
//! Pure: no I/O, no executor. `methods::tx` and `methods::basic` fill it, the connection's
//! writer completes commits as the queues answer.
//!
//! # Rules (RabbitMQ's `rabbit_channel`, which the clients' test suites assume)
//! 1. A publish on a transactional channel is checked and routed when it arrives (a missing
//!    exchange is 404 at once) and held; nothing reaches a queue before tx.commit.
//! 2. basic.ack, basic.nack and basic.reject are checked against the channel's ledger when
//!    they arrive (an unknown tag is 406 at once) and held, in order; the deliveries leave
//!    the ledger, so settling the same tag again in the transaction is an unknown tag.
//! 3. tx.commit hands the held publishes to their queues first, then carries out the held
//!    settlements in their order, and sends tx.commit-ok once every queue answered for
//!    every publish of the commit (persistent messages in durable queues synced, as for a
//!    publisher confirm). A queue that could not store one fails the commit: 406
//!    PRECONDITION_FAILED "partial tx completion" (RabbitMQ's words). Commits complete in
//!    the order they were sent.
//! 4. tx.rollback drops the held publishes and gives the held deliveries back to the ledger
//!    under their tags (they are outstanding again and can be settled again).
//! 5. A channel closed with a transaction open (by the client, by an error or with its
//!    connection) discards it: the held publishes are never delivered, and the queues
//!    requeue what the channel held, the deliveries of held acks included.
//! 6. tx and confirm mode exclude each other (406 either way); tx.commit and tx.rollback on
//!    a channel without tx.select are 406 "channel is not transactional".

use std::collections::VecDeque;

use super::unacked::{DeliveryTag, Unacked};
use crate::broker::message::Message;
use crate::broker::QueueRef;

/// A basic.publish whose content is complete, checked and routed (rule 1). `Q` holds its
/// target queues: shared with the core's router (`Router::route_shared`) as routed, owned
/// while a transaction holds it ([`Held`]), as a channel's state must be able to move to
/// another core with its connection.
#[derive(Debug)]
pub struct Routed<Q = std::rc::Rc<[QueueRef]>> {
    /// Exchange it was published to ("" = the default exchange).
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// basic.publish mandatory flag (an unroutable one comes back with basic.return).
    pub mandatory: bool,
    /// The message as queues store it.
    pub message: Message,
    /// Target queues, each once (empty: unroutable).
    pub queues: Q,
}

/// A publish held until tx.commit.
pub type Held = Routed<Vec<QueueRef>>;

impl Routed {
    /// The publish as a transaction holds it.
    pub fn held(self) -> Held {
        let Routed { exchange, routing_key, mandatory, message, queues } = self;
        Routed { exchange, routing_key, mandatory, message, queues: queues.to_vec() }
    }
}

impl Held {
    /// The publish as tx.commit hands it to its queues.
    pub fn committed(self) -> Routed {
        let Routed { exchange, routing_key, mandatory, message, queues } = self;
        Routed { exchange, routing_key, mandatory, message, queues: queues.into() }
    }
}

/// What a settlement does to the deliveries it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SettleKind {
    /// basic.ack: delete.
    Ack,
    /// basic.nack or basic.reject with requeue=true: back to the queue, redelivered.
    Requeue,
    /// basic.nack or basic.reject with requeue=false: dead-lettered or dropped.
    Reject,
}

/// The held work and the commits in flight of a channel after tx.select.
#[derive(Debug, Default)]
pub struct Tx {
    /// Publishes held until tx.commit, in arrival order.
    pub publishes: Vec<Held>,
    /// Settlements held until tx.commit, in arrival order, each with the tags it took
    /// from the ledger (for tx.rollback).
    pub settles: Vec<(SettleKind, Vec<(DeliveryTag, Unacked)>)>,
    /// Commits sent to the queues and not yet answered to the client, oldest first: the
    /// highest publish sequence number the commit used, and whether a queue failed one.
    committing: VecDeque<(u64, bool)>,
}

impl Tx {
    /// Records a commit whose publishes used sequence numbers up to `last_seq` (its own
    /// and, for a commit without publishes, the previous one's), and returns the outcomes
    /// of the commits complete now (see [`Tx::complete`]).
    pub fn committed(&mut self, last_seq: u64, lowest_pending: Option<u64>) -> Vec<bool> {
        self.committing.push_back((last_seq, false));
        self.complete(lowest_pending)
    }

    /// Every queue answered for publish `seq` (`ok`: all stored it). Returns the outcomes
    /// (true: tx.commit-ok; false: "partial tx completion") of the commits complete now,
    /// oldest first.
    pub fn stored(&mut self, seq: u64, ok: bool, lowest_pending: Option<u64>) -> Vec<bool> {
        if !ok {
            if let Some(c) = self.committing.iter_mut().find(|c| c.0 >= seq) {
                c.1 = true;
            }
        }
        self.complete(lowest_pending)
    }

    /// Pops the commits none of whose publishes is still pending: a commit is complete
    /// when the lowest publish still waiting for a queue (`lowest_pending`) lies above its
    /// last sequence number. Commits complete in order (rule 3).
    fn complete(&mut self, lowest_pending: Option<u64>) -> Vec<bool> {
        let mut done = Vec::new();
        while let Some(&(last, failed)) = self.committing.front() {
            if lowest_pending.is_some_and(|low| low <= last) {
                break;
            }
            self.committing.pop_front();
            done.push(!failed);
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::channel::Confirms;
    use proptest::prelude::*;

    #[test]
    fn a_commit_without_publishes_completes_at_once() {
        let mut tx = Tx::default();
        assert_eq!(tx.committed(0, None), vec![true]);
    }

    #[test]
    fn a_commit_waits_for_its_last_publish_and_a_nack_fails_it() {
        let mut tx = Tx::default();
        assert!(tx.committed(3, Some(1)).is_empty());
        assert!(tx.stored(1, true, Some(2)).is_empty());
        assert!(tx.stored(2, false, Some(3)).is_empty());
        assert_eq!(tx.stored(3, true, None), vec![false]);
    }

    #[test]
    fn a_later_commit_waits_for_an_earlier_one() {
        let mut tx = Tx::default();
        assert!(tx.committed(2, Some(1)).is_empty());
        // The second commit has no publishes of its own, but follows the first.
        assert!(tx.committed(2, Some(1)).is_empty());
        assert_eq!(tx.stored(1, true, None), vec![true, true]);
    }

    proptest! {
        /// Commits of 0–3 publishes each, each publish to 1–3 queues answering in any order
        /// (some failing): every commit gets exactly one outcome, in commit order, only
        /// once all its publishes are answered, and it is false exactly when one of its
        /// publishes failed somewhere.
        #[test]
        fn every_commit_completes_once_in_order_with_its_outcome(
            commits in proptest::collection::vec(proptest::collection::vec((1u32..4, any::<u8>()), 0..4), 1..8),
            order in any::<u64>(),
        ) {
            let mut confirms = Confirms::starting(false, 1);
            let mut tx = Tx::default();
            let mut answers: Vec<(u64, bool)> = Vec::new();
            let mut expected = Vec::new();
            let mut last_of: Vec<u64> = Vec::new();
            let mut outcomes: Vec<bool> = Vec::new();
            let mut answered: std::collections::BTreeSet<u64> = Default::default();
            for publishes in &commits {
                let mut failed = false;
                for &(queues, fail) in publishes {
                    let seq = confirms.next_seq;
                    confirms.next_seq += 1;
                    confirms.pending.insert(seq, (queues, false));
                    for q in 0..queues {
                        let ok = fail & (1 << q) == 0;
                        failed |= !ok;
                        answers.push((seq, ok));
                    }
                }
                expected.push(!failed);
                last_of.push(confirms.next_seq - 1);
                let done = tx.committed(confirms.next_seq - 1, confirms.lowest_pending());
                for &last in &last_of[outcomes.len()..outcomes.len() + done.len()] {
                    prop_assert!((1..=last).all(|s| answered.contains(&s)), "a commit up to {} completed early", last);
                }
                outcomes.extend(done);
            }
            let mut x = order;
            while !answers.is_empty() {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let (seq, ok) = answers.swap_remove((x >> 33) as usize % answers.len());
                if let Some(ok) = confirms.stored(seq, ok) {
                    answered.insert(seq);
                    let done = tx.stored(seq, ok, confirms.lowest_pending());
                    for &last in &last_of[outcomes.len()..outcomes.len() + done.len()] {
                        // Complete only once every publish up to its last one is answered.
                        prop_assert!((1..=last).all(|s| answered.contains(&s)), "a commit up to {} completed early", last);
                    }
                    outcomes.extend(done);
                }
            }
            prop_assert_eq!(outcomes, expected);
        }
    }
}
