//! The memory cache of recent records: a window `[base, base + len)` of offsets
//! ending at the newest append, bounded by bytes.

use std::collections::VecDeque;

use crate::{format::Offset, Record};

/// Bytes charged per cached record on top of its header and body.
pub(crate) const RECORD_OVERHEAD: usize = 96;

/// Recent records, by offset. A slot is `None` once deleted.
#[derive(Default)]
pub(crate) struct Cache {
    base: Offset,
    slots: VecDeque<Option<Record>>,
    bytes: usize,
}

fn cost(r: &Record) -> usize {
    r.header.len() + r.body.len() + RECORD_OVERHEAD
}

impl Cache {
    /// An empty cache whose next push is `next`.
    pub(crate) fn starting_at(next: Offset) -> Cache {
        Cache { base: next, slots: VecDeque::new(), bytes: 0 }
    }

    /// Bytes charged now.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Adds the newest record (its offset must be `base + len`).
    pub(crate) fn push(&mut self, r: Record) {
        debug_assert_eq!(r.offset, self.base + self.slots.len() as u64);
        self.bytes += cost(&r);
        self.slots.push_back(Some(r));
    }

    /// The record at `offset`, if cached and not deleted.
    pub(crate) fn get(&self, offset: Offset) -> Option<&Record> {
        let i = offset.checked_sub(self.base)?;
        self.slots.get(i as usize)?.as_ref()
    }

    /// Drops the record at `offset` (deleted).
    pub(crate) fn remove(&mut self, offset: Offset) {
        let Some(i) = offset.checked_sub(self.base) else { return };
        if let Some(slot) = self.slots.get_mut(i as usize) {
            if let Some(r) = slot.take() {
                self.bytes -= cost(&r);
            }
        }
    }

    /// Evicts the oldest records while over `limit` bytes, never evicting offsets
    /// `>= keep_from` (not yet on disk); also drops deleted slots at the front.
    pub(crate) fn evict(&mut self, limit: usize, keep_from: Offset) {
        while let Some(front) = self.slots.front() {
            let deleted = front.is_none();
            if !deleted && (self.bytes <= limit || self.base >= keep_from) {
                break;
            }
            if let Some(Some(r)) = self.slots.pop_front() {
                self.bytes -= cost(&r);
            }
            self.base += 1;
        }
        if self.slots.is_empty() {
            self.slots.shrink_to(1024);
        }
    }

    /// Forgets everything at and above `from` (records lost in a failed write).
    #[allow(dead_code)]
    pub(crate) fn truncate_from(&mut self, from: Offset) {
        while self.base + (self.slots.len() as u64) > from {
            match self.slots.pop_back() {
                Some(Some(r)) => self.bytes -= cost(&r),
                Some(None) => {}
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn rec(o: u64, n: usize) -> Record {
        Record { offset: o, flags: 0, header: Bytes::new(), body: Bytes::from(vec![1u8; n]) }
    }

    #[test]
    fn evicts_oldest_but_keeps_unwritten() {
        let mut c = Cache::starting_at(10);
        for o in 10..20 {
            c.push(rec(o, 100));
        }
        c.evict(3 * (100 + RECORD_OVERHEAD), 12);
        assert!(c.get(11).is_none() && c.get(12).is_some());
        c.evict(3 * (100 + RECORD_OVERHEAD), 20);
        assert!(c.get(16).is_none() && c.get(17).is_some());
        c.remove(18);
        assert!(c.get(18).is_none());
        assert_eq!(c.bytes(), 2 * (100 + RECORD_OVERHEAD));
        c.evict(0, 100);
        assert_eq!(c.bytes(), 0);
    }
}
