//! A channel's unacked ledger: delivery tag → where the message lives.
//!
//! Pure (no I/O): settling splits the ledger into settled and remaining, or fails with
//! 406 PRECONDITION_FAILED "unknown delivery tag" exactly as RabbitMQ's channel does
//! (AMQP 0-9-1 spec 1.8.3.13 basic.ack: "multiple … up to and including"; tag 0 with
//! multiple settles everything outstanding).

use std::collections::BTreeMap;

use super::error::AmqpError;
use crate::broker::{Offset, QueueRef};

/// A delivery tag: per channel, assigned 1, 2, 3, … by the connection as it writes each
/// basic.deliver or basic.get-ok, never reused while the channel lives (AMQP 0-9-1
/// §1.8.3.9 basic.deliver "delivery-tag"; §4.2.8 "delivery tags are scoped per channel").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct DeliveryTag(pub u64);

impl std::fmt::Display for DeliveryTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Where a delivered, unsettled message lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unacked {
    /// Its queue.
    pub queue: QueueRef,
    /// Its offset in the queue's shard.
    pub offset: Offset,
    /// When it was written to the client, for a sampled delivery (its basic.ack records
    /// `observe::Stage::WrittenToAcked`); `None` for the others.
    pub written: Option<std::time::Instant>,
}

/// Delivery tag → [`Unacked`], ordered by tag.
#[derive(Debug, Default)]
pub struct Ledger {
    map: BTreeMap<DeliveryTag, Unacked>,
}

impl Ledger {
    /// Records a delivery under `tag` (tags only grow, so this appends).
    pub fn insert(&mut self, tag: DeliveryTag, u: Unacked) {
        self.map.insert(tag, u);
    }

    /// Every outstanding delivery, by tag.
    pub fn iter(&self) -> impl Iterator<Item = (&DeliveryTag, &Unacked)> + '_ {
        self.map.iter()
    }

    /// Outstanding deliveries.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Nothing outstanding.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Removes and returns the deliveries settled by (tag, multiple).
    ///
    /// `multiple` with tag 0 settles all; `multiple` with tag N settles every tag ≤ N and
    /// requires N itself to be outstanding; otherwise exactly tag N.
    ///
    /// # Errors
    /// 406 PRECONDITION_FAILED "unknown delivery tag N" when N is not outstanding (never
    /// delivered on this channel, or already settled); the ledger is unchanged then.
    pub fn settle(&mut self, tag: DeliveryTag, multiple: bool) -> Result<Vec<Unacked>, AmqpError> {
        self.settle_with(tag, multiple, |_, u| u)
    }

    /// [`Ledger::settle`], keeping each delivery's tag: what a transaction holds until
    /// tx.commit, and gives back with [`Ledger::restore`] on tx.rollback.
    ///
    /// # Errors
    /// As [`Ledger::settle`].
    pub fn settle_tagged(&mut self, tag: DeliveryTag, multiple: bool) -> Result<Vec<(DeliveryTag, Unacked)>, AmqpError> {
        self.settle_with(tag, multiple, |t, u| (t, u))
    }

    fn settle_with<T>(&mut self, tag: DeliveryTag, multiple: bool, f: impl Fn(DeliveryTag, Unacked) -> T) -> Result<Vec<T>, AmqpError> {
        if multiple && tag.0 == 0 {
            return Ok(std::mem::take(&mut self.map).into_iter().map(|(t, u)| f(t, u)).collect());
        }
        if !self.map.contains_key(&tag) {
            return Err(AmqpError::precondition_failed(format!("unknown delivery tag {tag}")));
        }
        if multiple {
            let rest = self.map.split_off(&DeliveryTag(tag.0 + 1));
            let done = std::mem::replace(&mut self.map, rest);
            Ok(done.into_iter().map(|(t, u)| f(t, u)).collect())
        } else {
            Ok(vec![f(tag, self.map.remove(&tag).expect("checked above"))])
        }
    }

    /// Puts settled deliveries back under their own tags (tx.rollback: the acks of the
    /// transaction are undone, the messages are outstanding on this channel again).
    pub fn restore(&mut self, items: impl IntoIterator<Item = (DeliveryTag, Unacked)>) {
        self.map.extend(items);
    }

    /// Removes and returns everything (channel close, recover).
    pub fn drain(&mut self) -> Vec<Unacked> {
        std::mem::take(&mut self.map).into_values().collect()
    }
}

/// Groups settled deliveries by queue, keeping offset order within each queue.
pub fn by_queue(items: Vec<Unacked>) -> Vec<(QueueRef, Vec<Offset>)> {
    let mut out: Vec<(QueueRef, Vec<Offset>)> = Vec::new();
    for u in items {
        match out.iter_mut().find(|(q, _)| *q == u.queue) {
            Some((_, v)) => v.push(u.offset),
            None => out.push((u.queue, vec![u.offset])),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::QueueKey;
    use proptest::prelude::*;

    fn u(off: u64) -> Unacked {
        Unacked {
            queue: QueueRef { key: QueueKey::new("/", "q"), owner_core: 0, owner_node: 1, durable: false },
            offset: Offset(off),
            written: None,
        }
    }

    #[test]
    fn single_multiple_and_zero() {
        let mut l = Ledger::default();
        for t in 1..=5 {
            l.insert(DeliveryTag(t), u(t * 10));
        }
        assert_eq!(l.settle(DeliveryTag(3), true).unwrap().iter().map(|x| x.offset.0).collect::<Vec<_>>(), vec![10, 20, 30]);
        assert_eq!(l.settle(DeliveryTag(3), false).unwrap_err().code, 406);
        assert_eq!(l.settle(DeliveryTag(3), true).unwrap_err().code, 406);
        assert_eq!(l.settle(DeliveryTag(0), false).unwrap_err().code, 406);
        assert_eq!(l.settle(DeliveryTag(5), false).unwrap()[0].offset, Offset(50));
        assert_eq!(l.settle(DeliveryTag(0), true).unwrap().len(), 1);
        assert!(l.settle(DeliveryTag(0), true).unwrap().is_empty());
    }

    proptest! {
        /// Whatever the sequence of settles, every delivery is settled at most once and the
        /// ledger plus everything settled is exactly what was delivered.
        #[test]
        fn each_delivery_settles_once(n in 1u64..40, ops in proptest::collection::vec((0u64..45, any::<bool>()), 0..40)) {
            let mut l = Ledger::default();
            for t in 1..=n { l.insert(DeliveryTag(t), u(t)); }
            let mut settled = Vec::new();
            for (tag, multiple) in ops {
                let before = l.len();
                match l.settle(DeliveryTag(tag), multiple) {
                    Ok(v) => settled.extend(v.into_iter().map(|x| x.offset.0)),
                    Err(e) => { prop_assert_eq!(e.code, 406); prop_assert_eq!(l.len(), before); }
                }
            }
            let mut all = settled.clone();
            all.extend(l.drain().into_iter().map(|x| x.offset.0));
            all.sort();
            prop_assert_eq!(all, (1..=n).collect::<Vec<_>>());
        }
    }
}
