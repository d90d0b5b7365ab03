//! A queue's ready set: the offsets waiting for delivery, in the order they are handed out.
//! Pure data (no I/O, no tasks): the queue moves offsets in and out of it.
//!
//! # Invariants
//! - `requeued` holds offsets delivered before and given back (and claimed offsets put
//!   back in front of `ready`); every one of them is lower than every offset in `ready`, so
//!   [`ReadySet::take_next`] always hands out the lowest ready offset: a requeued message
//!   returns at its original position, before messages never delivered (DESIGN.md rule 5,
//!   RabbitMQ's order).
//! - `ready` is in offset order (appends only grow offsets).
//! - `redelivered` flags every offset that was delivered before and is not deleted, wherever
//!   it is now (ready again or outstanding).
//! - `ready_at` holds (offset, stored at) of the sampled offsets among `ready`, in offset
//!   order (entries behind the head are dropped as it passes them).
//! - `bytes` (kept only for a queue with `x-max-length-bytes`: `limits.rs`) holds the body
//!   length of every live offset, ready or claimed, and `bytes.ready` is the sum over the
//!   ready ones.
//! - `prio` (kept only for a queue with `x-max-priority`: `priority.rs`) holds every ready
//!   offset then, and `ready`, `requeued` and `ready_at` stay empty: the order is the
//!   levels' (highest first, offset order within one, so a requeue returns to its place in
//!   its level). An ordinary queue pays one `Option` test per operation.
//!
//! # Priorities and the cursor
//! The shared cursor (`mod.rs`, [`super::Cursor`]) says "every offset below it was delivered
//! at least once", and a restart flags every live offset below it redelivered (rule 7). A
//! priority queue hands a high offset out before lower ones, so its cursor may not follow the
//! highest delivery: it moves to [`ReadySet::delivered_floor`], the lowest offset still ready
//! and never claimed (or one past the highest claimed). Whatever was delivered above that
//! floor is flagged after a crash the way every tracked delivery is, by its unacked-index
//! record (rule 2); an auto-ack delivery above it whose delete was not yet synced comes
//! back unflagged, the slack an ordinary queue has between a delivery and its cursor commit,
//! for longer. The cursor never passes a message that was never claimed (a message claimed
//! and put back undelivered, e.g. for a consumer gone meanwhile, is the known slack of both).

use std::collections::{BTreeSet, VecDeque};
use std::time::Instant;

use rustc_hash::{FxHashMap, FxHashSet};

use super::priority::{self, Levels};

/// See the module doc. Memory: 8 bytes per ready offset (`VecDeque<u64>`), more for the
/// requeued (B-tree) and flagged (hash set) ones.
#[derive(Debug, Default)]
pub struct ReadySet {
    ready: VecDeque<u64>,
    ready_at: VecDeque<(u64, Instant)>,
    requeued: BTreeSet<u64>,
    redelivered: FxHashSet<u64>,
    bytes: Option<Box<BodyBytes>>,
    prio: Option<Box<Levels>>,
}

/// Body lengths of a queue's live messages (see the module doc), for `x-max-length-bytes`.
#[derive(Debug, Default)]
struct BodyBytes {
    /// Offset → (body bytes, ready now).
    of: FxHashMap<u64, (u32, bool)>,
    /// Sum of the body bytes of the ready offsets.
    ready: u64,
}

impl BodyBytes {
    /// `offset` enters (`true`) or leaves (`false`) the ready set.
    fn set_ready(&mut self, offset: u64, ready: bool) {
        if let Some((len, was)) = self.of.get_mut(&offset) {
            if *was != ready {
                *was = ready;
                if ready {
                    self.ready += u64::from(*len);
                } else {
                    self.ready -= u64::from(*len);
                }
            }
        }
    }
}

impl ReadySet {
    /// The ready set of a queue that opens with `live` offsets (ascending), of which those
    /// in `delivered_before` were delivered in an earlier run (DESIGN.md rule 7).
    pub fn recovered(live: Vec<u64>, delivered_before: impl IntoIterator<Item = u64>) -> ReadySet {
        let ready: VecDeque<u64> = live.into();
        let redelivered = delivered_before.into_iter().collect();
        ReadySet { ready, redelivered, ..Default::default() }
    }

    /// Makes this the ready set of a priority queue of levels 0..=`max` (`priority.rs`):
    /// every offset ready now moves to its level, from `levels` (offset, message priority;
    /// an offset missing there is at 0). Called once, when the queue opens.
    pub fn prioritise(&mut self, max: u8, levels: impl IntoIterator<Item = (u64, u8)>) {
        let levels: FxHashMap<u64, u8> = levels.into_iter().collect();
        let mut l = Levels::new(max);
        let offs: Vec<u64> = self.ready.drain(..).chain(std::mem::take(&mut self.requeued)).collect();
        self.ready_at.clear();
        for o in offs {
            l.insert(o, levels.get(&o).copied().unwrap_or(0), !self.redelivered.contains(&o), None);
        }
        self.prio = Some(Box::new(l));
    }

    /// Whether this is a priority queue's ready set ([`ReadySet::prioritise`]).
    pub fn is_prioritised(&self) -> bool {
        self.prio.is_some()
    }

    /// For a priority queue: an offset below which every live message was claimed at least
    /// once (see the module doc); `None` for an ordinary queue, whose deliveries go in offset
    /// order.
    pub fn delivered_floor(&self) -> Option<u64> {
        self.prio.as_ref().map(|p| p.delivered_floor())
    }

    /// Starts counting body bytes (`x-max-length-bytes`), with the body lengths of the
    /// offsets live now, (offset, body bytes): every one of them is ready (a queue that opens
    /// has delivered nothing yet). Offsets pushed later bring their length with them.
    pub fn count_bytes(&mut self, lens: impl IntoIterator<Item = (u64, u32)>) {
        let mut b = BodyBytes::default();
        for (o, len) in lens {
            b.of.insert(o, (len, true));
            b.ready += u64::from(len);
        }
        self.bytes = Some(Box::new(b));
    }

    /// Sum of the ready messages' body bytes; 0 unless [`ReadySet::count_bytes`] was called.
    pub fn ready_bytes(&self) -> u64 {
        self.bytes.as_ref().map_or(0, |b| b.ready)
    }

    /// Messages ready for delivery.
    pub fn len(&self) -> usize {
        self.ready.len() + self.requeued.len() + self.prio.as_ref().map_or(0, |p| p.len())
    }

    /// No message is ready.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A new message of `body_len` body bytes was appended at `offset` (higher than any
    /// before); `stored_at` when its stored→delivered time is sampled.
    /// A priority queue places it at level 0 ([`ReadySet::push_message`] reads the level).
    pub fn push(&mut self, offset: u64, body_len: usize, stored_at: Option<Instant>) {
        self.push_at(offset, 0, body_len, stored_at);
    }

    /// [`ReadySet::push`] for a message stored with `header` (`message.rs` layout): a priority
    /// queue places it at the level of its `priority` property; an ordinary queue never reads
    /// the header.
    pub fn push_message(&mut self, offset: u64, header: &[u8], body_len: usize, stored_at: Option<Instant>) {
        let level = self.level_of(header);
        self.push_at(offset, level, body_len, stored_at);
    }

    /// The level a message stored with `header` gets (0 in an ordinary queue), for
    /// [`ReadySet::push_leveled`] once the message itself is gone into the store.
    pub fn level_of(&self, header: &[u8]) -> u8 {
        if self.prio.is_some() {
            priority::of_header(header)
        } else {
            0
        }
    }

    /// [`ReadySet::push_message`] with the level taken by [`ReadySet::level_of`].
    pub fn push_leveled(&mut self, offset: u64, level: u8, body_len: usize, stored_at: Option<Instant>) {
        self.push_at(offset, level, body_len, stored_at);
    }

    fn push_at(&mut self, offset: u64, level: u8, body_len: usize, stored_at: Option<Instant>) {
        if let Some(p) = &mut self.prio {
            p.insert(offset, level, true, stored_at);
        } else {
            self.ready.push_back(offset);
            if let Some(at) = stored_at {
                self.ready_at.push_back((offset, at));
            }
        }
        if let Some(b) = &mut self.bytes {
            let len = u32::try_from(body_len).unwrap_or(u32::MAX);
            b.of.insert(offset, (len, true));
            b.ready += u64::from(len);
        }
    }

    /// The offset [`ReadySet::take_next`] would claim, left in place.
    pub fn peek_next(&self) -> Option<u64> {
        if let Some(p) = &self.prio {
            return p.peek();
        }
        self.requeued.first().or(self.ready.front()).copied()
    }

    /// Claims the lowest ready offset (a priority queue: the lowest of the highest level);
    /// with it, when it was sampled and is delivered for
    /// the first time, the instant it was stored.
    pub fn take_next(&mut self) -> Option<(u64, Option<Instant>)> {
        let taken = self.take_next_unsized();
        if let (Some(b), Some((o, _))) = (&mut self.bytes, taken) {
            b.set_ready(o, false);
        }
        taken
    }

    fn take_next_unsized(&mut self) -> Option<(u64, Option<Instant>)> {
        if let Some(p) = &mut self.prio {
            return p.take();
        }
        if let Some(o) = self.requeued.pop_first() {
            return Some((o, None));
        }
        let o = self.ready.pop_front()?;
        let mut stored_at = None;
        while let Some(&(sampled, at)) = self.ready_at.front() {
            if sampled > o {
                break;
            }
            self.ready_at.pop_front();
            if sampled == o {
                stored_at = Some(at);
            }
        }
        Some((o, stored_at))
    }

    /// Puts a claimed but undelivered offset back at its original position; its
    /// redelivered flag does not change.
    pub fn unclaim(&mut self, offset: u64) {
        if let Some(b) = &mut self.bytes {
            b.set_ready(offset, true);
        }
        if let Some(p) = &mut self.prio {
            return p.give_back(offset, !self.redelivered.contains(&offset));
        }
        if self.ready.front().is_none_or(|f| offset < *f) {
            self.requeued.insert(offset);
        } else {
            self.ready.push_front(offset);
        }
    }

    /// A delivered offset comes back (rule 5): ready at its original position, flagged
    /// redelivered.
    pub fn requeue(&mut self, offset: u64) {
        if let Some(b) = &mut self.bytes {
            b.set_ready(offset, true);
        }
        self.redelivered.insert(offset);
        if let Some(p) = &mut self.prio {
            return p.give_back(offset, false);
        }
        self.requeued.insert(offset);
    }

    /// Flags an outstanding offset as delivered again (basic.recover with requeue=false).
    pub fn mark_redelivered(&mut self, offset: u64) {
        self.redelivered.insert(offset);
    }

    /// Whether `offset` was delivered before.
    pub fn is_redelivered(&self, offset: u64) -> bool {
        self.redelivered.contains(&offset)
    }

    /// `offset` is deleted: its flag (and its body length) goes.
    pub fn forget(&mut self, offset: u64) {
        if let Some(b) = &mut self.bytes {
            b.set_ready(offset, false);
            b.of.remove(&offset);
        }
        if let Some(p) = &mut self.prio {
            p.forget(offset);
        }
        self.redelivered.remove(&offset);
    }

    /// queue.purge: takes every ready offset out (ascending order not guaranteed) and drops
    /// their flags.
    pub fn drain(&mut self) -> Vec<u64> {
        let mut offs: Vec<u64> = self.ready.drain(..).collect();
        self.ready_at.clear();
        offs.extend(std::mem::take(&mut self.requeued));
        if let Some(p) = &mut self.prio {
            offs.extend(p.drain());
        }
        for o in &offs {
            self.redelivered.remove(o);
        }
        if let Some(b) = &mut self.bytes {
            for o in &offs {
                b.of.remove(o);
            }
            b.ready = 0;
        }
        offs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Clone, Debug)]
    enum Op {
        Push,
        Take,
        /// Give back the i-th claimed offset (mod count) as delivered (requeue) or not (unclaim).
        GiveBack(usize, bool),
        /// Delete the i-th claimed offset (ack).
        Ack(usize),
        Purge,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Push),
            3 => Just(Op::Take),
            2 => (any::<usize>(), any::<bool>()).prop_map(|(i, r)| Op::GiveBack(i, r)),
            1 => any::<usize>().prop_map(Op::Ack),
            1 => Just(Op::Purge),
        ]
    }

    proptest! {
        /// Whatever happens, the next message handed out is the lowest ready offset (original
        /// position), each offset is ready or claimed, never both, exactly the offsets
        /// given back as delivered carry the redelivered flag, and the ready bytes are the sum
        /// of the ready messages' body lengths (`x-max-length-bytes`).
        #[test]
        fn lowest_first_and_flags_follow_requeues(ops in proptest::collection::vec(op(), 1..200), sized in any::<bool>()) {
            let mut s = ReadySet::default();
            if sized {
                s.count_bytes([]);
            }
            let len_of = |o: u64| (o % 7) * 100;
            let mut next = 0u64;
            // Model: offset → delivered before; and the claimed offsets.
            let mut model: BTreeMap<u64, bool> = BTreeMap::new();
            let mut claimed: Vec<(u64, bool)> = Vec::new();
            for op in ops {
                match op {
                    Op::Push => {
                        s.push(next, len_of(next) as usize, None);
                        model.insert(next, false);
                        next += 1;
                    }
                    Op::Take => {
                        let got = s.take_next().map(|(o, _)| o);
                        let want = model.keys().next().copied();
                        prop_assert_eq!(got, want);
                        if let Some(o) = got {
                            prop_assert_eq!(s.is_redelivered(o), model.remove(&o).unwrap());
                            claimed.push((o, s.is_redelivered(o)));
                        }
                    }
                    Op::GiveBack(i, delivered) if !claimed.is_empty() => {
                        let (o, flagged) = claimed.remove(i % claimed.len());
                        if delivered { s.requeue(o) } else { s.unclaim(o) }
                        model.insert(o, delivered || flagged);
                    }
                    Op::Ack(i) if !claimed.is_empty() => {
                        let (o, _) = claimed.remove(i % claimed.len());
                        s.forget(o);
                        prop_assert!(!s.is_redelivered(o));
                    }
                    Op::Purge => {
                        let mut got = s.drain();
                        got.sort_unstable();
                        prop_assert_eq!(got, model.keys().copied().collect::<Vec<_>>());
                        model.clear();
                    }
                    _ => {}
                }
                prop_assert_eq!(s.len(), model.len());
                let want_bytes: u64 = if sized { model.keys().map(|o| len_of(*o)).sum() } else { 0 };
                prop_assert_eq!(s.ready_bytes(), want_bytes);
            }
        }
    }

    #[derive(Clone, Debug)]
    enum PrioOp {
        /// Publish at this priority (clamped to the maximum).
        Push(u8),
        Take,
        GiveBack(usize, bool),
        Ack(usize),
        Purge,
    }

    fn prio_op() -> impl Strategy<Value = PrioOp> {
        prop_oneof![
            3 => (0u8..14).prop_map(PrioOp::Push),
            3 => Just(PrioOp::Take),
            2 => (any::<usize>(), any::<bool>()).prop_map(|(i, r)| PrioOp::GiveBack(i, r)),
            1 => any::<usize>().prop_map(PrioOp::Ack),
            1 => Just(PrioOp::Purge),
        ]
    }

    proptest! {
        /// A priority queue's ready set (`priority.rs`) against a reference model — a map
        /// keyed (level descending, offset) — whatever the publishes, claims, requeues, acks
        /// and purges: the next message is the model's first (highest level, then original
        /// position), flags follow requeues, the queue opened again from its live offsets
        /// (restart) keeps the same order, and every live offset below the cursor floor was
        /// claimed at least once.
        #[test]
        fn highest_level_first_then_original_position(
            ops in proptest::collection::vec(prio_op(), 1..200),
            max in 1u8..12,
            reopen_at in any::<usize>(),
        ) {
            use std::cmp::Reverse;
            let mut s = ReadySet::default();
            s.prioritise(max, []);
            let mut next = 0u64;
            let mut level: BTreeMap<u64, u8> = BTreeMap::new();
            // Model: (level descending, offset) → delivered before; the claimed offsets; the
            // offsets ever claimed.
            let mut model: BTreeMap<(Reverse<u8>, u64), bool> = BTreeMap::new();
            let mut claimed: Vec<(u64, bool)> = Vec::new();
            let mut ever: std::collections::BTreeSet<u64> = Default::default();
            let reopen_at = reopen_at % ops.len();
            for (i, op) in ops.into_iter().enumerate() {
                if i == reopen_at {
                    // A restart: claimed offsets come back flagged, everything in the store
                    // takes its level again.
                    for (o, _) in claimed.drain(..) {
                        model.insert((Reverse(level[&o]), o), true);
                    }
                    let live: Vec<u64> = model.keys().map(|k| k.1).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
                    let flagged: Vec<u64> = model.iter().filter(|(_, d)| **d).map(|(k, _)| k.1).collect();
                    s = ReadySet::recovered(live.clone(), flagged);
                    s.prioritise(max, live.iter().map(|o| (*o, level[o])));
                    ever.clear();
                }
                match op {
                    PrioOp::Push(p) => {
                        let props = amq_protocol::protocol::basic::AMQPProperties::default().with_priority(p);
                        let m = crate::broker::message::Message::new("", "q", &crate::broker::message::encode_properties(&props), bytes::Bytes::new(), false);
                        s.push_message(next, &m.header, 0, None);
                        level.insert(next, p.min(max));
                        model.insert((Reverse(p.min(max)), next), false);
                        next += 1;
                    }
                    PrioOp::Take => {
                        let got = s.take_next().map(|(o, _)| o);
                        let want = model.keys().next().map(|k| k.1);
                        prop_assert_eq!(got, want);
                        if let Some(o) = got {
                            let d = model.remove(&(Reverse(level[&o]), o)).unwrap();
                            prop_assert_eq!(s.is_redelivered(o), d);
                            claimed.push((o, d));
                            ever.insert(o);
                        }
                    }
                    PrioOp::GiveBack(i, delivered) if !claimed.is_empty() => {
                        let (o, flagged) = claimed.remove(i % claimed.len());
                        if delivered { s.requeue(o) } else { s.unclaim(o) }
                        model.insert((Reverse(level[&o]), o), delivered || flagged);
                    }
                    PrioOp::Ack(i) if !claimed.is_empty() => {
                        let (o, _) = claimed.remove(i % claimed.len());
                        s.forget(o);
                        level.remove(&o);
                    }
                    PrioOp::Purge => {
                        let mut got = s.drain();
                        got.sort_unstable();
                        let mut want: Vec<u64> = model.keys().map(|k| k.1).collect();
                        want.sort_unstable();
                        prop_assert_eq!(got, want);
                        for k in std::mem::take(&mut model).into_keys() {
                            level.remove(&k.1);
                        }
                    }
                    _ => {}
                }
                prop_assert_eq!(s.len(), model.len());
                let floor = s.delivered_floor().expect("a priority queue has a floor");
                for (k, delivered) in &model {
                    if k.1 < floor {
                        prop_assert!(*delivered || ever.contains(&k.1), "offset {} below the floor {} was never claimed", k.1, floor);
                    }
                }
            }
        }
    }

    #[test]
    fn a_sampled_offset_reports_its_store_time_once() {
        let mut s = ReadySet::default();
        let t = Instant::now();
        s.push(0, 0, None);
        s.push(1, 0, Some(t));
        assert_eq!(s.take_next(), Some((0, None)));
        assert_eq!(s.take_next(), Some((1, Some(t))));
        s.requeue(1);
        assert_eq!(s.take_next(), Some((1, None)), "a redelivery is not a first delivery");
        assert!(s.is_redelivered(1));
    }
}
