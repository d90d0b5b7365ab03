//! The memory cache of recent records: a window `[base, base + len)` of offsets
//! ending at the newest append, bounded by bytes.

use std::collections::VecDeque;

use crate::{format::Offset, Record};

/// Bytes charged per cached record on top of its header and body.
pub(crate) const RECORD_OVERHEAD: usize = 96;

/// Recent records, by offset: one window of consecutive offsets, or more after
/// [`Cache::skip_to`] (oldest first, ascending, not overlapping). A slot is `None` once
/// deleted.
pub(crate) struct Cache {
    windows: VecDeque<Window>,
    bytes: usize,
}

/// Consecutive offsets `[base, base + slots.len())`.
struct Window {
    base: Offset,
    slots: VecDeque<Option<Record>>,
}

impl Default for Cache {
    fn default() -> Cache {
        Cache::starting_at(0)
    }
}

fn cost(r: &Record) -> usize {
    r.header.len() + r.body.len() + RECORD_OVERHEAD
}

impl Cache {
    /// An empty cache whose next push is `next`.
    pub(crate) fn starting_at(next: Offset) -> Cache {
        Cache { windows: VecDeque::from([Window { base: next, slots: VecDeque::new() }]), bytes: 0 }
    }

    /// Bytes charged now.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    fn newest(&mut self) -> &mut Window {
        self.windows.back_mut().expect("the cache always has a window")
    }

    /// Adds the newest record (its offset must follow the newest one, or a skip).
    pub(crate) fn push(&mut self, r: Record) {
        self.bytes += cost(&r);
        let w = self.newest();
        debug_assert_eq!(r.offset, w.base + w.slots.len() as u64);
        w.slots.push_back(Some(r));
    }

    /// The next push is `next` (past the newest offset): offsets in between hold nothing.
    pub(crate) fn skip_to(&mut self, next: Offset) {
        let w = self.newest();
        if w.slots.iter().all(Option::is_none) {
            w.slots.clear();
            w.base = next;
        } else {
            self.windows.push_back(Window { base: next, slots: VecDeque::new() });
        }
    }

    /// The window that would hold `offset`: the newest one starting at or below it.
    fn window_of(&self, offset: Offset) -> Option<(usize, usize)> {
        let k = self.windows.iter().rposition(|w| w.base <= offset)?;
        Some((k, (offset - self.windows[k].base) as usize))
    }

    /// The record at `offset`, if cached and not deleted.
    pub(crate) fn get(&self, offset: Offset) -> Option<&Record> {
        let (k, i) = self.window_of(offset)?;
        self.windows[k].slots.get(i)?.as_ref()
    }

    /// Drops the record at `offset` (deleted).
    pub(crate) fn remove(&mut self, offset: Offset) {
        let Some((k, i)) = self.window_of(offset) else { return };
        if let Some(slot) = self.windows[k].slots.get_mut(i) {
            if let Some(r) = slot.take() {
                self.bytes -= cost(&r);
            }
        }
    }

    /// Evicts the oldest records while over `limit` bytes, never evicting offsets
    /// `>= keep_from` (not yet on disk); also drops deleted slots at the front.
    pub(crate) fn evict(&mut self, limit: usize, keep_from: Offset) {
        loop {
            let several = self.windows.len() > 1;
            let w = self.windows.front_mut().expect("the cache always has a window");
            let Some(front) = w.slots.front() else {
                if several {
                    self.windows.pop_front();
                    continue;
                }
                break;
            };
            let deleted = front.is_none();
            if !deleted && (self.bytes <= limit || w.base >= keep_from) {
                break;
            }
            if let Some(Some(r)) = w.slots.pop_front() {
                self.bytes -= cost(&r);
            }
            w.base += 1;
        }
        if self.windows.len() == 1 && self.windows[0].slots.is_empty() {
            self.windows[0].slots.shrink_to(1024);
        }
    }

    /// Forgets everything at and above `from` (records lost in a failed write).
    #[allow(dead_code)]
    pub(crate) fn truncate_from(&mut self, from: Offset) {
        while let Some(w) = self.windows.back_mut() {
            while w.base + (w.slots.len() as u64) > from {
                match w.slots.pop_back() {
                    Some(Some(r)) => self.bytes -= cost(&r),
                    Some(None) => {}
                    None => break,
                }
            }
            if w.base >= from && self.windows.len() > 1 {
                self.windows.pop_back();
            } else {
                break;
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

    #[test]
    fn a_skip_starts_a_new_window_and_eviction_crosses_it() {
        let mut c = Cache::starting_at(0);
        c.skip_to(50);
        c.push(rec(50, 10));
        c.push(rec(51, 10));
        c.skip_to(1000);
        c.push(rec(1000, 10));
        assert!(c.get(51).is_some() && c.get(52).is_none() && c.get(999).is_none() && c.get(1000).is_some());
        c.remove(50);
        assert!(c.get(50).is_none());
        c.evict(0, 1000);
        assert!(c.get(51).is_none() && c.get(1000).is_some(), "evicted up to the unwritten record");
        c.push(rec(1001, 10));
        c.truncate_from(1000);
        assert!(c.get(1000).is_none() && c.bytes() == 0);
        // Everything deleted: the skip moves the window instead of adding one.
        c.skip_to(5000);
        c.push(rec(5000, 10));
        assert!(c.get(5000).is_some());
    }
}
