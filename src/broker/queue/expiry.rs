//! Queue TTL: `x-expires` (RabbitMQ's "queue expiry", docs "Time-To-Live and Expiration").
//!
//! A queue declared with `x-expires = N` (ms, ≥ 1) is deleted once it has been unused for
//! N ms: no consumer attached, no basic.get, and no queue.declare of it (active or passive,
//! as RabbitMQ's `stat` renews the lease) in that time. It applies to durable queues as to
//! transient ones, and the lease starts again when the queue opens after a restart (a
//! durable queue is opened at start for this: `Node::open_expiring_queues`), as RabbitMQ's
//! does on recovery.
//!
//! # Rules
//! 1. The queue is unused since the later of its last use (basic.get, queue.declare) and the
//!    moment its last consumer left ([`super::consumer::Consumers::emptied`]).
//! 2. One task per such queue sleeps until that moment + N, looks again, and deletes the
//!    queue only if it is still unused then; the deletion is queue.delete with if-unused,
//!    so a consumer that attaches on the way keeps it.
//! 3. Nothing of this runs for a queue without the argument.

use std::cell::RefCell;
use std::rc::Weak;
use std::time::{Duration, Instant};

use super::Queue;

/// A queue's lease (rule 1).
#[derive(Debug, Clone, Copy)]
pub struct Expiry {
    /// x-expires.
    pub ttl: Duration,
    /// Last basic.get or queue.declare (or the queue's open).
    pub used: Instant,
}

impl Expiry {
    /// The lease of a queue declared with `x-expires = ms` (`None` without one, or ≤ 0).
    pub fn from_arg(ms: Option<i64>) -> Option<Expiry> {
        ms.filter(|v| *v > 0).map(|v| Expiry { ttl: Duration::from_millis(v as u64), used: Instant::now() })
    }

    /// When the queue expires if nothing uses it meanwhile: `None` while it has consumers,
    /// else the later of its last use and `emptied` (when its last consumer left), plus the TTL.
    pub fn due(&self, has_consumers: bool, emptied: Option<Instant>) -> Option<Instant> {
        if has_consumers {
            return None;
        }
        Some(emptied.map_or(self.used, |e| e.max(self.used)) + self.ttl)
    }
}

/// Rule 2: the task that deletes the queue once its lease ran out; ends with the queue.
pub(super) async fn expire_when_unused(q: Weak<RefCell<Queue>>) {
    loop {
        let due = {
            let Some(cell) = q.upgrade() else { return };
            let q = cell.borrow();
            let Some(e) = q.expiry.filter(|_| !q.deleted) else { return };
            e.due(!q.consumers.is_empty(), q.consumers.emptied()).unwrap_or_else(|| Instant::now() + e.ttl)
        };
        let now = Instant::now();
        if due > now {
            glommio::timer::sleep(due - now).await;
            continue;
        }
        let Some(cell) = q.upgrade() else { return };
        let mut q = cell.borrow_mut();
        let (env, key) = (q.env.clone(), q.qref.key.clone());
        let Some(e) = q.expiry.as_mut() else { return };
        tracing::info!(queue = %key.name, vhost = %key.vhost, expires_ms = e.ttl.as_millis() as u64, "queue unused for its x-expires: deleting it");
        // Looked at again only a lease later: by then the deletion went through (the task
        // ends with the queue), or a consumer that attached on the way kept it.
        e.used = now;
        drop(q);
        env.auto_delete(&key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_runs_from_the_last_use_or_the_last_consumer_leaving() {
        let t0 = Instant::now();
        let e = Expiry { ttl: Duration::from_millis(100), used: t0 };
        assert_eq!(e.due(false, None), Some(t0 + Duration::from_millis(100)));
        assert_eq!(e.due(true, None), None, "a queue with consumers does not expire");
        let later = t0 + Duration::from_millis(40);
        assert_eq!(e.due(false, Some(later)), Some(later + Duration::from_millis(100)));
        let earlier = Expiry { ttl: e.ttl, used: later };
        assert_eq!(earlier.due(false, Some(t0)), Some(later + Duration::from_millis(100)));
        assert!(Expiry::from_arg(Some(0)).is_none() && Expiry::from_arg(None).is_none());
        assert_eq!(Expiry::from_arg(Some(1500)).map(|e| e.ttl), Some(Duration::from_millis(1500)));
    }
}
