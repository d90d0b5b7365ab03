//! A channel's unacked ledger: delivery tag → where the message lives.
//!
//! Pure (no I/O): settling splits the ledger into settled and remaining, or fails with
//! 406 PRECONDITION_FAILED "unknown delivery tag" exactly as RabbitMQ's channel does
//! (AMQP 0-9-1 spec 1.8.3.13 basic.ack: "multiple … up to and including"; tag 0 with
//! multiple settles everything outstanding).

use std::collections::BTreeMap;

use super::error::AmqpError;
use crate::broker::QueueRef;

/// Where a delivered, unsettled message lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unacked {
    /// Its queue.
    pub queue: QueueRef,
    /// Its offset in the queue's shard.
    pub offset: u64,
}

/// Delivery tag → [`Unacked`], ordered by tag.
#[derive(Debug, Default)]
pub struct Ledger {
    map: BTreeMap<u64, Unacked>,
}

impl Ledger {
    /// Records a delivery under `tag` (tags only grow, so this appends).
    pub fn insert(&mut self, tag: u64, u: Unacked) {
        self.map.insert(tag, u);
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
    pub fn settle(&mut self, tag: u64, multiple: bool) -> Result<Vec<Unacked>, AmqpError> {
        if multiple && tag == 0 {
            return Ok(std::mem::take(&mut self.map).into_values().collect());
        }
        if !self.map.contains_key(&tag) {
            return Err(AmqpError::precondition_failed(format!("unknown delivery tag {tag}")));
        }
        if multiple {
            let rest = self.map.split_off(&(tag + 1));
            let done = std::mem::replace(&mut self.map, rest);
            Ok(done.into_values().collect())
        } else {
            Ok(vec![self.map.remove(&tag).expect("checked above")])
        }
    }

    /// Removes and returns everything (channel close, recover).
    pub fn drain(&mut self) -> Vec<Unacked> {
        std::mem::take(&mut self.map).into_values().collect()
    }
}

/// Groups settled deliveries by queue, keeping offset order within each queue.
pub fn by_queue(items: Vec<Unacked>) -> Vec<(QueueRef, Vec<u64>)> {
    let mut out: Vec<(QueueRef, Vec<u64>)> = Vec::new();
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
        Unacked { queue: QueueRef { key: QueueKey::new("/", "q"), owner_core: 0, durable: false }, offset: off }
    }

    #[test]
    fn single_multiple_and_zero() {
        let mut l = Ledger::default();
        for t in 1..=5 {
            l.insert(t, u(t * 10));
        }
        assert_eq!(l.settle(3, true).unwrap().iter().map(|x| x.offset).collect::<Vec<_>>(), vec![10, 20, 30]);
        assert_eq!(l.settle(3, false).unwrap_err().code, 406);
        assert_eq!(l.settle(3, true).unwrap_err().code, 406);
        assert_eq!(l.settle(0, false).unwrap_err().code, 406);
        assert_eq!(l.settle(5, false).unwrap()[0].offset, 50);
        assert_eq!(l.settle(0, true).unwrap().len(), 1);
        assert!(l.settle(0, true).unwrap().is_empty());
    }

    proptest! {
        /// Whatever the sequence of settles, every delivery is settled at most once and the
        /// ledger plus everything settled is exactly what was delivered.
        #[test]
        fn each_delivery_settles_once(n in 1u64..40, ops in proptest::collection::vec((0u64..45, any::<bool>()), 0..40)) {
            let mut l = Ledger::default();
            for t in 1..=n { l.insert(t, u(t)); }
            let mut settled = Vec::new();
            for (tag, multiple) in ops {
                let before = l.len();
                match l.settle(tag, multiple) {
                    Ok(v) => settled.extend(v.into_iter().map(|x| x.offset)),
                    Err(e) => { prop_assert_eq!(e.code, 406); prop_assert_eq!(l.len(), before); }
                }
            }
            let mut all = settled.clone();
            all.extend(l.drain().into_iter().map(|x| x.offset));
            all.sort();
            prop_assert_eq!(all, (1..=n).collect::<Vec<_>>());
        }
    }
}
