//! Egress before ingress on a saturated core: a queue whose consumer cannot keep up because
//! the queue's core has no time left keeps its publishers' credit (`broker::credit`) until
//! the consumer has caught up.
//!
//! # Why
//! A publisher, its queue and its consumer usually share one core (`core::placement`, the
//! publisher's hand-off). When the publisher sends faster than that core can both store and
//! deliver, the core's time goes to whichever side asks more often, and that is the
//! publisher: its reader takes a 64 KiB read of publishes per turn. The consumer's
//! connection falls behind, the queue grows, its messages leave the store's cache, and every
//! delivery then costs a read back from disk as well: the consumer falls further behind.
//! Measured (`ringmq-bench throughput`, 16 B, one core doing all of it): 1.0 M msgs/s
//! consumed at a fixed 1 M msgs/s publish rate, but 0.50-0.72 M unthrottled, with e2e p50 in
//! seconds.
//!
//! # Rules
//! 1. The queue starts holding when at least [`HOLD_READY`] messages are ready, a consumer
//!    of this node takes whatever it is given (no prefetch window stops it: auto-ack, or
//!    room in its window, or a full window it settled from since the last check, and so
//!    within the last [`TAKING_GRACE`]; `Consumers::taking`), and the queue's core was busy for at least
//!    90 % of its last window (`core::load::saturated`). The dispatcher checks while it
//!    delivers, while it reads a backlog back from disk, and while the consumers'
//!    connections are behind on writing; the publish path every 256th publish.
//! 2. While holding, every publish's credit stays in the queue, so each publisher stops
//!    after its credit's worth (`credit::MAX_IN_FLIGHT_BYTES`: 16 MiB, ~30,000 small messages).
//! 3. It gives all of it back once fewer than [`RELEASE_READY`] messages are ready or
//!    [`RELEASE_READY`] fewer than when the hold began (so a large backlog is worked off in
//!    short holds, each taking back more than it let in), when no such consumer is left,
//!    when it has nothing to deliver (no message, no consumer, deleted) or stops on a failed
//!    disk read, and at the latest after [`MAX_HOLD`] (a timer makes sure of it while the
//!    dispatcher waits for a full window to open); a hold that ran out is not begun again for
//!    [`QUIET_AFTER_TIMEOUT`].
//!
//! A consumer that is slow because its client reads slowly leaves the queue's core idle:
//! rule 1's last condition keeps its publishers at full speed, and the queue absorbs the
//! difference, as in RabbitMQ. Should the core be saturated by other work meanwhile, such a
//! consumer takes nothing during a hold, which then runs out: rule 3 costs its publishers at
//! most [`MAX_HOLD`] per [`QUIET_AFTER_TIMEOUT`] (`tests/egress.rs`). A consumer of another
//! node (`remote`) never holds a publisher.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Queue;
use crate::broker::credit::CreditHeld;

/// Messages ready from which a queue whose consumer falls behind on a saturated core holds
/// its publishers' credit (rule 1).
pub const HOLD_READY: u32 = 16_384;
/// Messages ready below which held credit goes back; also how many fewer than when the
/// hold began (rule 3).
pub const RELEASE_READY: u32 = 4_096;
/// Longest hold (rule 3): a consumer that drains fast needs a few tens of ms to take what
/// the publishers' credit let through (measured: 20-30 ms at 16 B).
pub const MAX_HOLD: Duration = Duration::from_millis(100);
/// How long a consumer counts as taking after a check found it so (rules 1 and 3): a
/// prefetch-limited consumer's full window opens with each settle, between checks.
pub const TAKING_GRACE: Duration = Duration::from_millis(10);
/// How long a hold that ran out keeps the queue from holding again (rule 3).
pub const QUIET_AFTER_TIMEOUT: Duration = Duration::from_secs(1);

/// A queue's hold (see the module doc).
#[derive(Debug, Default)]
pub struct Egress {
    /// When the hold began; `None` while not holding.
    since: Option<Instant>,
    /// No hold begins before this (rule 3).
    quiet_until: Option<Instant>,
    /// Messages ready when the hold began.
    ready_at_start: u32,
    /// The credit held.
    held: Vec<Arc<CreditHeld>>,
    /// Publishes since the publish path last checked (rule 1).
    publishes: u8,
    /// A timer will check rule 3 ([`Queue::egress_idle`]).
    timer_armed: bool,
    /// When a check last found a consumer taking.
    taking_seen: Option<Instant>,
}

impl Egress {
    /// No credit is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Rules 1 and 3 at `now`, with `ready` messages ready and `taking` when a consumer of
    /// this node takes whatever it is given; `saturated` is asked only when a hold could
    /// begin. Returns the credit to give back (empty when none).
    pub fn check(&mut self, ready: u32, taking: bool, saturated: impl FnOnce() -> bool, now: Instant) -> Vec<Arc<CreditHeld>> {
        if taking {
            self.taking_seen = Some(now);
        }
        // A consumer's window fills and opens again with each settle: it takes while a check
        // in the last TAKING_GRACE found it taking.
        let taking = self.taking_seen.is_some_and(|t| now.saturating_duration_since(t) < TAKING_GRACE);
        match self.since {
            Some(since) if now.saturating_duration_since(since) >= MAX_HOLD => {
                self.quiet_until = Some(now + QUIET_AFTER_TIMEOUT);
                self.release()
            }
            Some(_) if ready < RELEASE_READY || ready + RELEASE_READY <= self.ready_at_start || !taking => self.release(),
            Some(_) => Vec::new(),
            None => {
                if ready >= HOLD_READY && taking && self.quiet_until.is_none_or(|q| now >= q) && saturated() {
                    self.since = Some(now);
                    self.ready_at_start = ready;
                }
                Vec::new()
            }
        }
    }

    /// Whether a hold is on (rule 2).
    pub fn holding(&self) -> bool {
        self.since.is_some()
    }

    /// Keeps `credit` while holding (rule 2); gives it back to the caller otherwise.
    pub fn hold(&mut self, credit: Arc<CreditHeld>) -> Option<Arc<CreditHeld>> {
        if self.since.is_none() {
            return Some(credit);
        }
        self.held.push(credit);
        None
    }

    /// Ends the hold (if any); returns the credit to give back.
    pub fn release(&mut self) -> Vec<Arc<CreditHeld>> {
        self.since = None;
        std::mem::take(&mut self.held)
    }
}

impl Queue {
    /// Rules 1 and 3, checked by the dispatcher while it delivers (every 256 deliveries),
    /// reads a backlog back from disk, or finds its consumers' connections behind.
    pub(super) fn check_egress(&mut self) {
        let (ready, taking) = (self.message_count(), self.consumers.taking());
        drop(self.egress.check(ready, taking, crate::core::load::saturated, Instant::now()));
    }

    /// Rules 1 and 3 from the publish path, every 256th publish: a publisher's reader may
    /// keep the core for many reads in a row (its socket always has more), and the
    /// dispatcher, which checks between deliveries, gets no turn meanwhile (measured: 300,000
    /// messages went past a queue that had just released its hold).
    pub(super) fn check_egress_on_publish(&mut self) {
        self.egress.publishes = self.egress.publishes.wrapping_add(1);
        if self.egress.publishes == 0 {
            self.check_egress();
        }
    }

    /// The dispatcher has nothing to deliver (rule 3). With no message or no consumer (or
    /// deleted) the hold ends. When only full prefetch windows stop it, the rules are checked
    /// as between deliveries: such a consumer's settles wake the dispatcher, which delivers
    /// one or a few and comes back here, so this is where its hold ends (ending it on every
    /// full window let a confirming publisher outrun a prefetch-100 consumer 1.3:1). A timer
    /// then ends a hold that no later check would reach within [`MAX_HOLD`] (a consumer
    /// that stopped settling).
    pub(super) fn egress_idle(&mut self, cell: &super::QueueCell) {
        if self.deleted || self.message_count() == 0 || self.consumers.is_empty() {
            drop(self.egress.release());
            return;
        }
        self.check_egress();
        let Some(since) = self.egress.since else { return };
        if std::mem::replace(&mut self.egress.timer_armed, true) {
            return;
        }
        let weak = std::rc::Rc::downgrade(cell);
        crate::core::spawn_soon(async move {
            // Until no hold is left: one that began after this timer's hold ended (another
            // idle found the timer armed) gets its own deadline here.
            let mut since = since;
            loop {
                glommio::timer::sleep((since + MAX_HOLD).saturating_duration_since(Instant::now())).await;
                let Some(cell) = weak.upgrade() else { return };
                let mut q = cell.borrow_mut();
                q.check_egress();
                match q.egress.since {
                    Some(s) => since = s,
                    None => {
                        q.egress.timer_armed = false;
                        return;
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::credit::PublishCredit;

    /// A publisher's credit pool and one held publish of 1,000 bytes from it.
    fn publish(pool: &Arc<PublishCredit>) -> Arc<CreditHeld> {
        pool.take(1000)
    }

    #[test]
    fn a_hold_begins_only_with_a_backlog_a_taking_consumer_and_a_saturated_core() {
        let now = Instant::now();
        let pool = PublishCredit::new(1);
        let mut e = Egress::default();
        e.check(HOLD_READY, false, || true, now);
        e.check(HOLD_READY - 1, true, || true, now);
        e.check(HOLD_READY, true, || false, now);
        assert!(e.hold(publish(&pool)).is_some(), "no hold: the credit goes back");
        e.check(HOLD_READY, true, || true, now);
        assert!(e.hold(publish(&pool)).is_none(), "held");
        assert!(pool.in_flight() > 0, "the publisher's credit is still taken");
    }

    #[test]
    fn held_credit_goes_back_when_the_backlog_drained_or_the_consumer_left() {
        let now = Instant::now();
        let pool = PublishCredit::new(1);
        let mut e = Egress::default();
        e.check(HOLD_READY, true, || true, now);
        assert!(e.hold(publish(&pool)).is_none());
        assert!(e.check(HOLD_READY + 30_000, true, || true, now).is_empty(), "what the credit let through arrives");
        assert!(e.check(HOLD_READY - RELEASE_READY + 1, true, || true, now).is_empty(), "not yet taken back more than it let in");
        drop(e.check(HOLD_READY - RELEASE_READY, true, || true, now));
        assert_eq!(pool.in_flight(), 0, "given back once RELEASE_READY fewer are ready than at the start");
        assert!(e.hold(publish(&pool)).is_some(), "the hold ended");

        e.check(10 * HOLD_READY, true, || true, now);
        assert!(e.hold(publish(&pool)).is_none());
        drop(e.check(10 * HOLD_READY - RELEASE_READY, true, || true, now));
        assert_eq!(pool.in_flight(), 0, "a large backlog is worked off in short holds");

        e.check(HOLD_READY, true, || true, now);
        assert!(e.hold(publish(&pool)).is_none());
        assert!(e.check(HOLD_READY, false, || true, now + TAKING_GRACE / 2).is_empty(), "a full window that just opened");
        drop(e.check(HOLD_READY, false, || true, now + TAKING_GRACE));
        assert_eq!(pool.in_flight(), 0, "given back when no consumer took for TAKING_GRACE");
    }

    #[test]
    fn a_hold_that_runs_out_is_not_begun_again_for_a_while() {
        let t0 = Instant::now();
        let pool = PublishCredit::new(1);
        let mut e = Egress::default();
        e.check(HOLD_READY * 4, true, || true, t0);
        assert!(e.hold(publish(&pool)).is_none());
        assert!(e.check(HOLD_READY * 4, true, || true, t0 + MAX_HOLD / 2).is_empty());
        assert_eq!(e.check(HOLD_READY * 4, true, || true, t0 + MAX_HOLD).len(), 1, "the longest hold ran out");
        assert_eq!(pool.in_flight(), 0);
        let t1 = t0 + MAX_HOLD;
        e.check(HOLD_READY * 4, true, || panic!("not asked while quiet"), t1 + QUIET_AFTER_TIMEOUT / 2);
        assert!(e.hold(publish(&pool)).is_some(), "quiet: no hold");
        e.check(HOLD_READY * 4, true, || true, t1 + QUIET_AFTER_TIMEOUT);
        assert!(e.hold(publish(&pool)).is_none(), "holding again after the quiet time");
    }
}
