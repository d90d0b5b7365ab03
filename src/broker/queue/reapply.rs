//! A policy change applied to a queue that is already open (`broker::policy`): the keys that
//! are cheap to change in place take their new effective values at once.
//!
//! Applied live: `max-length`, `overflow`, `max-length-bytes` (only where the queue already
//! counted body bytes: one that did not must reopen to read its messages' lengths),
//! `dead-letter-exchange`, `dead-letter-routing-key`, `consumer-timeout`, `expires` (the
//! lease task starts, changes or ends), `message-ttl` (for messages published after the
//! change: a message's deadline is fixed when it is published), `delivery-limit` (a queue
//! that had none counts returns from the change on). A queue over a new length limit drops
//! its head at once (`limits.rs`, behaviour 2).

use super::{delivery_limit::DeliveryLimit, expiry, limits::Limits, Queue};
use crate::broker::router::{int_arg, string_arg};
use amq_protocol::types::FieldTable;

impl Queue {
    /// Takes the effective arguments `args` (`broker::policy::effective_queue_arguments`)
    /// for the keys of the module doc. Runs on the queue's core; never awaits.
    /// `default_timeout_ms`: the broker's consumer timeout (`--consumer-timeout-ms`).
    pub fn reapply_arguments(&mut self, args: &FieldTable, default_timeout_ms: u64) {
        if self.deleted {
            return;
        }
        let quorum = string_arg(args, "x-queue-type") == Some("quorum");
        self.limits = limits_after(self.limits, args, quorum);
        self.dead_letter_exchange = string_arg(args, "x-dead-letter-exchange").map(str::to_owned);
        self.dead_letter_routing_key = string_arg(args, "x-dead-letter-routing-key").map(str::to_owned);
        self.consumer_timeout_ms = int_arg(args, "x-consumer-timeout").filter(|v| *v > 0).map(|v| v as u64).unwrap_or(default_timeout_ms);
        match (self.expiry.as_mut(), expiry::Expiry::from_arg(int_arg(args, "x-expires"))) {
            (Some(old), Some(new)) => old.ttl = new.ttl,
            (None, Some(new)) => {
                self.expiry = Some(new);
                crate::core::spawn_soon(expiry::expire_when_unused(self.me.clone()));
            }
            (_, None) => self.expiry = None,
        }
        let message_ttl = int_arg(args, "x-message-ttl").and_then(|v| u64::try_from(v).ok());
        if message_ttl.is_some() || self.ttl.is_some() {
            self.ttl_mut().queue_ttl = message_ttl;
        }
        match (self.delivery_limit.as_mut(), DeliveryLimit::from_arguments(args, quorum)) {
            (Some(old), Some(new)) => old.set_limit(new.limit()),
            (None, Some(new)) => self.delivery_limit = Some(new),
            (_, None) => self.delivery_limit = None,
        }
        if self.limits.is_some() {
            self.drop_head();
        }
    }
}

/// The length limits a queue with limits `old` takes from effective arguments `args`: all of
/// them, but a byte limit only where `old` already counted bytes (the module doc).
fn limits_after(old: Option<Limits>, args: &FieldTable, quorum: bool) -> Option<Limits> {
    let counted_bytes = old.is_some_and(|l| l.counts_bytes());
    Limits::from_arguments(args, quorum)
        .map(|l| if l.counts_bytes() && !counted_bytes { Limits { max_length_bytes: None, ..l } } else { l })
        .filter(|l| l.max_length.is_some() || l.max_length_bytes.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::AMQPValue;

    fn args(pairs: &[(&str, i64)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), AMQPValue::LongLongInt(*v));
        }
        t
    }

    #[test]
    fn a_byte_limit_applies_live_only_where_bytes_were_counted() {
        let none = limits_after(None, &args(&[("x-max-length-bytes", 10)]), false);
        assert_eq!(none, None, "the queue never counted bytes: needs a reopen");
        let both = limits_after(None, &args(&[("x-max-length", 2), ("x-max-length-bytes", 10)]), false).unwrap();
        assert_eq!((both.max_length, both.max_length_bytes), (Some(2), None));
        let counting = Limits::from_arguments(&args(&[("x-max-length-bytes", 99)]), false);
        let changed = limits_after(counting, &args(&[("x-max-length-bytes", 10)]), false).unwrap();
        assert_eq!(changed.max_length_bytes, Some(10));
        assert_eq!(limits_after(counting, &args(&[]), false), None, "a cleared policy lifts the limit");
    }
}
