//! Faults a test injects into a debug build through the environment, where no outside
//! means (a killed process, a cut link, a full disk) produces them. A release build has
//! none: each check is a constant `false` there.
//!
//! - `RINGMQ_FAILPOINT_UNANSWERED_QUEUE=NAME`: the queue named NAME (any vhost) stores what
//!   is published to it but never answers a publisher confirm for it, as a queue whose server
//!   lost track of a publish would; the connection's own limit (`amqp::channel::CONFIRM_LIMIT`)
//!   is what answers the publisher then.

/// Whether publishes to queue `name` go unanswered (`RINGMQ_FAILPOINT_UNANSWERED_QUEUE`).
#[cfg(debug_assertions)]
pub fn unanswered_queue(name: &str) -> bool {
    static NAME: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    NAME.get_or_init(|| std::env::var("RINGMQ_FAILPOINT_UNANSWERED_QUEUE").ok()).as_deref() == Some(name)
}

/// Whether publishes to queue `name` go unanswered: never, in a release build.
#[cfg(not(debug_assertions))]
#[inline(always)]
pub fn unanswered_queue(_name: &str) -> bool {
    false
}
