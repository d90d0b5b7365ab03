//! Sequence tracking on the consuming side: which (queue, producer, sequence) triples
//! arrived, so the bench can report duplicates during the run and lost messages at the
//! end. One bit per expected message per queue (1.25 MB per 10 M messages).

use std::collections::HashMap;

/// Growable bitset indexed by sequence number.
#[derive(Default)]
struct Bits {
    words: Vec<u64>,
}

impl Bits {
    /// Sets bit `i`; returns true if it was clear.
    fn insert(&mut self, i: u32) -> bool {
        let (w, b) = ((i / 64) as usize, i % 64);
        if w >= self.words.len() {
            self.words.resize((w + 1).max(self.words.len() * 2), 0);
        }
        let mask = 1u64 << b;
        let fresh = self.words[w] & mask == 0;
        self.words[w] |= mask;
        fresh
    }
}

/// Arrivals per queue index, per producer.
pub struct Tracker {
    queues: Vec<HashMap<u16, Bits>>,
    /// Distinct (queue, producer, seq) received.
    pub unique: u64,
    /// Receipts of a (queue, producer, seq) already received.
    pub duplicates: u64,
}

impl Tracker {
    /// A tracker for `queues` queues.
    pub fn new(queues: usize) -> Self {
        Tracker { queues: (0..queues).map(|_| HashMap::new()).collect(), unique: 0, duplicates: 0 }
    }

    /// Records one receipt on queue index `queue`; returns false for a duplicate.
    pub fn record(&mut self, queue: usize, producer: u16, seq: u32) -> bool {
        let fresh = self.queues[queue].entry(producer).or_default().insert(seq);
        if fresh {
            self.unique += 1;
        } else {
            self.duplicates += 1;
        }
        fresh
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_duplicates_per_queue_not_across_queues() {
        let mut t = Tracker::new(2);
        assert!(t.record(0, 3, 1_000_000));
        assert!(t.record(1, 3, 1_000_000)); // fanout: same message in another queue
        assert!(!t.record(0, 3, 1_000_000));
        assert!(t.record(0, 4, 1_000_000));
        assert_eq!((t.unique, t.duplicates), (3, 1));
    }
}
