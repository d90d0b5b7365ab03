//! Publisher-confirm coalescing: the publishes a writer batch completed become
//! basic.ack / basic.nack frames (pure: no I/O, no executor).
//!
//! RabbitMQ's confirm extension (confirm.select; basic.ack and basic.nack from server to
//! client, delivery tag = the publish's sequence number on its channel, `multiple` =
//! "up to and including", as for basic.ack in AMQP 0-9-1 spec 1.8.3.13).
//!
//! Invariants, per channel and batch:
//! - Every completed publish is confirmed exactly once, in the batch that completed it.
//! - One basic.ack with multiple=true covers every ack of the batch below the channel's
//!   lowest publish still pending, but only when the batch holds no nack: everything up
//!   to its tag is then confirmed (in this batch or an earlier one), so it never covers
//!   a pending publish or a nack.
//! - Everything else goes out as single frames (multiple=false), nacks always; tags
//!   ascend within a channel, channels in ascending order.

use amq_protocol::protocol::{basic, AMQPClass};

/// One confirm frame for the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Confirm {
    /// Publishing channel.
    pub channel: u16,
    /// Sequence number confirmed (with `multiple`, the highest one covered).
    pub delivery_tag: u64,
    /// Covers every sequence number up to and including `delivery_tag`.
    pub multiple: bool,
    /// basic.ack (stored) rather than basic.nack (failed).
    pub ack: bool,
}

impl Confirm {
    /// The method to send: basic.ack, or basic.nack with requeue=false.
    pub fn method(&self) -> AMQPClass {
        let m = if self.ack {
            basic::AMQPMethod::Ack(basic::Ack { delivery_tag: self.delivery_tag, multiple: self.multiple })
        } else {
            basic::AMQPMethod::Nack(basic::Nack { delivery_tag: self.delivery_tag, multiple: self.multiple, requeue: false })
        };
        AMQPClass::Basic(m)
    }
}

/// Turns the publishes completed in one writer batch, `(channel, seq, ok)`, into confirm
/// frames: for each channel, one basic.ack with multiple=true for every completed publish
/// below the lowest one still pending (`lowest_pending(channel)`, looked up after the
/// batch), single acks above it, and single nacks; no multiple at all when the batch
/// holds a nack for that channel.
pub fn coalesce(mut ready: Vec<(u16, u64, bool)>, lowest_pending: impl Fn(u16) -> Option<u64>) -> Vec<Confirm> {
    let mut frames = Vec::new();
    ready.sort_unstable();
    let mut i = 0;
    while i < ready.len() {
        let ch = ready[i].0;
        let j = ready[i..].iter().position(|r| r.0 != ch).map_or(ready.len(), |k| i + k);
        let group = &ready[i..j];
        let low = lowest_pending(ch);
        let any_nack = group.iter().any(|r| !r.2);
        let below: Vec<u64> = group.iter().filter(|r| r.2 && !any_nack && low.is_none_or(|l| r.1 < l)).map(|r| r.1).collect();
        if let Some(&max) = below.last() {
            let multiple = below.len() > 1;
            frames.push(Confirm { channel: ch, delivery_tag: max, multiple, ack: true });
        }
        for &(_, seq, ok) in group {
            if below.contains(&seq) {
                continue;
            }
            frames.push(Confirm { channel: ch, delivery_tag: seq, multiple: false, ack: ok });
        }
        i = j;
    }
    frames
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;
    use crate::amqp::channel::Confirms;
    use proptest::prelude::*;

    fn ack(channel: u16, tag: u64, multiple: bool) -> Confirm {
        Confirm { channel, delivery_tag: tag, multiple, ack: true }
    }
    fn nack(channel: u16, tag: u64) -> Confirm {
        Confirm { channel, delivery_tag: tag, multiple: false, ack: false }
    }

    #[test]
    fn nothing_ready_nothing_sent() {
        assert!(coalesce(Vec::new(), |_| None).is_empty());
    }

    #[test]
    fn one_ack_is_a_single_ack() {
        assert_eq!(coalesce(vec![(1, 1, true)], |_| None), vec![ack(1, 1, false)]);
    }

    #[test]
    fn a_run_of_acks_with_nothing_pending_is_one_multiple_ack() {
        assert_eq!(coalesce(vec![(1, 3, true), (1, 1, true), (1, 2, true)], |_| None), vec![ack(1, 3, true)]);
    }

    #[test]
    fn acks_above_the_lowest_pending_go_single() {
        let got = coalesce(vec![(1, 5, true), (1, 1, true), (1, 2, true), (1, 7, true)], |_| Some(4));
        assert_eq!(got, vec![ack(1, 2, true), ack(1, 5, false), ack(1, 7, false)]);
    }

    #[test]
    fn one_ack_below_the_pending_one_is_single() {
        assert_eq!(coalesce(vec![(1, 1, true), (1, 3, true)], |_| Some(2)), vec![ack(1, 1, false), ack(1, 3, false)]);
    }

    #[test]
    fn a_nack_makes_every_frame_of_its_channel_single() {
        let got = coalesce(vec![(1, 1, true), (1, 2, false), (1, 3, true), (2, 1, true), (2, 2, true)], |_| None);
        assert_eq!(got, vec![ack(1, 1, false), nack(1, 2), ack(1, 3, false), ack(2, 2, true)]);
    }

    #[test]
    fn nacks_are_never_multiple_and_ascend() {
        assert_eq!(coalesce(vec![(1, 3, false), (1, 1, false), (1, 2, false)], |_| None), vec![nack(1, 1), nack(1, 2), nack(1, 3)]);
    }

    #[test]
    fn channels_are_coalesced_separately_in_ascending_order() {
        let low = |ch: u16| if ch == 3 { Some(2) } else { None };
        let got = coalesce(vec![(3, 1, true), (3, 4, true), (1, 1, true), (1, 2, true)], low);
        assert_eq!(got, vec![ack(1, 2, true), ack(3, 1, false), ack(3, 4, false)]);
    }

    #[test]
    fn methods_are_ack_and_nack_without_requeue() {
        assert_eq!(ack(1, 7, true).method(), AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack { delivery_tag: 7, multiple: true })));
        assert_eq!(
            nack(1, 7).method(),
            AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack { delivery_tag: 7, multiple: false, requeue: false }))
        );
    }

    /// One step of the model: a publish, a queue's answer reaching the event channel, or
    /// a writer batch.
    #[derive(Clone, Debug)]
    enum Step {
        /// basic.publish on a channel to `queues` queues (0: unroutable), the ones whose
        /// bit is set in `fail` failing to store it.
        Publish { channel: u16, queues: u32, fail: u8 },
        /// The `pick`-th outstanding queue answer is sent to the connection.
        Answer { pick: usize },
        /// The `pick`-th answer sent so far of a publish confirmed already is sent again (a
        /// queue's old server answering a publish that its next server answered).
        Again { pick: usize },
        /// The writer takes up to `n` events, then flushes confirms.
        Batch { n: usize },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u16..3, 0u32..4, any::<u8>()).prop_map(|(channel, queues, fail)| Step::Publish { channel, queues, fail }),
            any::<usize>().prop_map(|pick| Step::Answer { pick }),
            any::<usize>().prop_map(|pick| Step::Again { pick }),
            (1usize..6).prop_map(|n| Step::Batch { n }),
        ]
    }

    /// What the client sees: the publishes not yet confirmed, per channel.
    #[derive(Default)]
    struct Client {
        outstanding: BTreeMap<u16, BTreeSet<u64>>,
        /// Outcome of every confirmed publish, as the client read it.
        outcome: BTreeMap<(u16, u64), bool>,
    }

    /// Runs the writer's part on one batch: `Confirms::stored` per event (as the writer's
    /// `ClientEvent::Stored` does), then [`coalesce`], then checks the frames against the
    /// client's view. `done` is every publish completed so far with its outcome.
    fn batch(
        confirms: &mut BTreeMap<u16, Confirms>,
        events: Vec<(u16, u64, bool)>,
        done: &mut BTreeMap<(u16, u64), bool>,
        client: &mut Client,
    ) -> Result<(), TestCaseError> {
        let mut ready = Vec::new();
        for (ch, seq, ok) in events {
            if let Some(ok) = confirms.get_mut(&ch).and_then(|c| c.stored(seq, ok)) {
                ready.push((ch, seq, ok));
            }
        }
        let completed: BTreeSet<(u16, u64)> = ready.iter().map(|r| (r.0, r.1)).collect();
        prop_assert_eq!(completed.len(), ready.len(), "a publish completed twice");
        for &(ch, seq, ok) in &ready {
            done.insert((ch, seq), ok);
        }
        let frames = coalesce(ready, |ch| confirms.get(&ch).and_then(|c| c.lowest_pending()));
        let mut last: Option<(u16, u64)> = None;
        for f in frames {
            prop_assert!(last.is_none_or(|l| l < (f.channel, f.delivery_tag)), "frames out of order: {:?} then {:?}", last, f);
            last = Some((f.channel, f.delivery_tag));
            let out = client.outstanding.entry(f.channel).or_default();
            let covered: Vec<u64> = if f.multiple { out.range(..=f.delivery_tag).copied().collect() } else { vec![f.delivery_tag] };
            prop_assert!(!f.multiple || f.ack, "multiple nack {:?}", f);
            prop_assert!(!f.multiple || covered.len() > 1, "multiple over fewer than two publishes: {:?}", f);
            for seq in covered {
                prop_assert!(out.remove(&seq), "{:?} confirms {} which is not outstanding", f, seq);
                // Only completed publishes, and with their own outcome: a multiple ack
                // never spans a pending publish or a nack.
                prop_assert_eq!(done.get(&(f.channel, seq)), Some(&f.ack), "{:?} covers {}", f, seq);
                client.outcome.insert((f.channel, seq), f.ack);
            }
        }
        // Every publish completed so far is confirmed (none left for a later batch).
        for (&(ch, seq), &ok) in done.iter() {
            prop_assert_eq!(client.outcome.get(&(ch, seq)), Some(&ok), "publish {} on {} not confirmed", seq, ch);
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Publishes on two confirm-mode channels to 0–3 queues each, queue answers in any
        /// order, some sent again once answered, writer batches of any size: the client gets
        /// every publish confirmed exactly once with its outcome, in ascending order within a batch, and a multiple
        /// ack only over a run of completed acks.
        #[test]
        fn confirms_cover_every_publish_once(steps in proptest::collection::vec(step(), 0..120)) {
            let mut confirms: BTreeMap<u16, Confirms> =
                (1u16..3).map(|ch| (ch, Confirms::starting(true, 1))).collect();
            let mut client = Client::default();
            let mut done = BTreeMap::new();
            // Queue answers not yet sent, and the connection's event channel (FIFO).
            let mut answers: Vec<(u16, u64, bool)> = Vec::new();
            let mut events: std::collections::VecDeque<(u16, u64, bool)> = Default::default();
            let mut sent: Vec<(u16, u64, bool)> = Vec::new();
            for s in steps {
                match s {
                    Step::Publish { channel, queues, fail } => {
                        // As basic.publish does: take the sequence number, pending for its
                        // queues' answers, or, unroutable, for the one the channel sends itself.
                        let c = confirms.get_mut(&channel).expect("channel");
                        let seq = c.take_seq(queues.max(1) as usize);
                        client.outstanding.entry(channel).or_default().insert(seq);
                        if queues == 0 {
                            events.push_back((channel, seq, true));
                        } else {
                            for q in 0..queues {
                                answers.push((channel, seq, fail & (1 << q) == 0));
                            }
                        }
                    }
                    Step::Answer { pick } if !answers.is_empty() => {
                        let a = answers.swap_remove(pick % answers.len());
                        events.push_back(a);
                        sent.push(a);
                    }
                    Step::Answer { .. } => {}
                    Step::Again { pick } => {
                        // Of a publish answered already (a duplicate within a publish that
                        // still waits is the remote side's to drop: `remote::client`).
                        let over: Vec<_> = sent.iter().filter(|a| done.contains_key(&(a.0, a.1))).collect();
                        if !over.is_empty() {
                            events.push_back(*over[pick % over.len()]);
                        }
                    }
                    Step::Batch { n } => {
                        let n = n.min(events.len());
                        let taken: Vec<_> = events.drain(..n).collect();
                        batch(&mut confirms, taken, &mut done, &mut client)?;
                    }
                }
            }
            // Everything answers, the writer drains the channel: nothing stays unconfirmed.
            events.extend(answers.drain(..));
            while !events.is_empty() {
                let taken: Vec<_> = events.drain(..events.len().min(3)).collect();
                batch(&mut confirms, taken, &mut done, &mut client)?;
            }
            for (ch, out) in &client.outstanding {
                prop_assert!(out.is_empty(), "channel {} never confirmed {:?}", ch, out);
            }
        }
    }
}
