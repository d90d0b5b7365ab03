//! Queue length limits: `x-max-length` (ready messages), `x-max-length-bytes` (the sum of
//! the ready messages' body bytes) and `x-overflow` (what happens at the limit), as RabbitMQ
//! 3.13/4.x documents them ("Queue Length Limit").
//!
//! # Behaviour (RabbitMQ's, with the choices where its docs leave room)
//! 1. **What counts.** Only *ready* messages and their body bytes count; delivered-unacked
//!    ones do not, and are never dropped (RabbitMQ: classic queues compare `len` and
//!    `message_bytes_ready`, quorum queues `messages_ready` and `msg_bytes_enqueue`).
//! 2. **`drop-head`** (the default): after a publish is appended, while the queue is over a
//!    limit, the oldest ready message (the head, requeued ones included: they sit at their
//!    original position) is taken out and dead-lettered with reason `maxlen` when the queue
//!    has `x-dead-letter-exchange` (rule 3: the original goes once the copy is stored), or
//!    deleted as an ack deletes (rule 4: it never comes back after a restart).
//!    `x-max-length` 0 drops every message at once — even with a consumer waiting, where
//!    RabbitMQ would hand it to that consumer first (here a publish always enters the queue).
//! 3. **`reject-publish`**: a publish that would take the queue over a limit (one more
//!    message, or its body bytes more) is refused before anything is stored: basic.nack to a
//!    confirming publisher, dropped silently otherwise. **`reject-publish-dlx`**: the same,
//!    and the refused message is dead-lettered with reason `maxlen` (RabbitMQ's reason for
//!    it). A quorum queue (`x-queue-type=quorum`) does not know `reject-publish-dlx`: RabbitMQ
//!    logs a warning and uses `drop-head` there, and so does ringmq.
//! 4. **Requeues** (nack/reject/recover with requeue, channel close) may take the queue over
//!    a limit: under `drop-head` the head is dropped then, as RabbitMQ's classic queue
//!    (`requeue_and_run` → `maybe_drop_head`) and quorum queue (`checkout` →
//!    `evaluate_limit`) do. Under `reject-publish*` a requeue is never refused. So does a
//!    queue that opens over its limit (RabbitMQ's `init_max_length`).
//! 5. **Replicated queues** (`replica.rs`): only the serving member decides; a drop goes
//!    through the queue's settle (`Settle` in the log), so every member deletes it.
//!
//! Argument validation (406 PRECONDITION_FAILED) is [`Overflow::parse`] and the integer checks
//! in `amqp::methods::queue`.

use amq_protocol::types::FieldTable;

use super::settle::DeathReason;
use super::Queue;
use crate::broker::message::Message;
use crate::broker::router::{int_arg, string_arg};
use crate::broker::ConfirmTo;

/// `x-overflow`: what a queue does when a publish takes it over a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overflow {
    /// `drop-head`: the oldest ready messages go (dead-lettered with reason `maxlen`).
    DropHead,
    /// `reject-publish`: the new message is refused (basic.nack when confirming).
    RejectPublish,
    /// `reject-publish-dlx`: refused as `reject-publish`, and dead-lettered (`maxlen`).
    RejectPublishDlx,
}

impl Overflow {
    /// The value of `x-overflow` as RabbitMQ spells it.
    ///
    /// # Errors
    /// The text of the 406 PRECONDITION_FAILED for any other string.
    pub fn parse(s: &str) -> Result<Overflow, String> {
        match s {
            "drop-head" => Ok(Overflow::DropHead),
            "reject-publish" => Ok(Overflow::RejectPublish),
            "reject-publish-dlx" => Ok(Overflow::RejectPublishDlx),
            other => Err(format!("unsupported value '{other}' (drop-head, reject-publish or reject-publish-dlx)")),
        }
    }
}

/// A queue's length limits. Exists only for a queue declared with `x-max-length` or
/// `x-max-length-bytes`, so that a queue without one pays a single branch per publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `x-max-length`: most ready messages.
    pub max_length: Option<u64>,
    /// `x-max-length-bytes`: most body bytes over the ready messages.
    pub max_length_bytes: Option<u64>,
    /// `x-overflow`.
    pub overflow: Overflow,
}

impl Limits {
    /// The limits a declaration's (already validated) arguments set; `None` without
    /// `x-max-length` and `x-max-length-bytes`. `quorum`: the queue is `x-queue-type=quorum`
    /// (behaviour 3 of the module doc).
    pub fn from_arguments(args: &FieldTable, quorum: bool) -> Option<Limits> {
        let limit = |key| int_arg(args, key).and_then(|v| u64::try_from(v).ok());
        let (max_length, max_length_bytes) = (limit("x-max-length"), limit("x-max-length-bytes"));
        if max_length.is_none() && max_length_bytes.is_none() {
            return None;
        }
        let overflow = match string_arg(args, "x-overflow").map(Overflow::parse) {
            Some(Ok(Overflow::RejectPublishDlx)) if quorum => {
                tracing::warn!("x-overflow 'reject-publish-dlx' is not supported by quorum queues: using 'drop-head'");
                Overflow::DropHead
            }
            Some(Ok(o)) => o,
            _ => Overflow::DropHead,
        };
        Some(Limits { max_length, max_length_bytes, overflow })
    }

    /// True when `ready` messages of `ready_bytes` body bytes are over a limit.
    pub fn exceeded(&self, ready: u64, ready_bytes: u64) -> bool {
        self.max_length.is_some_and(|m| ready > m) || self.max_length_bytes.is_some_and(|m| ready_bytes > m)
    }

    /// True when one more message of `body_len` bytes would take `ready` messages of
    /// `ready_bytes` body bytes over a limit (RabbitMQ's `will_overflow`).
    pub fn would_overflow(&self, ready: u64, ready_bytes: u64, body_len: u64) -> bool {
        self.exceeded(ready + 1, ready_bytes + body_len)
    }

    /// The byte limit is set: the ready set must count body bytes.
    pub fn counts_bytes(&self) -> bool {
        self.max_length_bytes.is_some()
    }

    /// Publishes are refused at the limit (`reject-publish` or `reject-publish-dlx`).
    pub fn rejects_publish(&self) -> bool {
        self.overflow != Overflow::DropHead
    }
}

impl Queue {
    /// Behaviour 3: under `reject-publish` or `reject-publish-dlx`, refuses a publish that
    /// would take the queue over a limit — basic.nack through `confirm`, and the dead-letter
    /// copy for `reject-publish-dlx` — and returns true; nothing is stored. A replicated
    /// queue counts the messages it proposed whose `Enqueue` it has not applied yet.
    pub(super) fn refuse_over_limit(&mut self, message: &Message, confirm: Option<&ConfirmTo>) -> bool {
        let Some(limits) = self.limits.filter(Limits::rejects_publish) else { return false };
        let (pending, pending_bytes) = self.repl.as_ref().map_or((0, 0), |r| r.unapplied());
        let ready = self.ready.len() as u64 + pending;
        let ready_bytes = self.ready.ready_bytes() + pending_bytes;
        if !limits.would_overflow(ready, ready_bytes, message.body.len() as u64) {
            if let Some(r) = &mut self.repl {
                r.admitted(message.body.len() as u64);
            }
            return false;
        }
        tracing::debug!(queue = %self.qref.key.name, ready, ready_bytes, "publish refused at the queue's length limit");
        if let Some(c) = confirm {
            c.answer(false);
        }
        if limits.overflow == Overflow::RejectPublishDlx {
            self.dead_letter_unstored(message.clone(), DeathReason::Maxlen);
        }
        true
    }

    /// Behaviours 2 and 4: under `drop-head`, while the queue is over a limit, its oldest
    /// ready messages go — dead-lettered (`maxlen`) with a dead-letter exchange, else
    /// deleted (rule 4; a replicated queue's serving member proposes the delete as its
    /// `Settle`, the other members decide nothing). Outstanding messages are never touched.
    pub(super) fn drop_head(&mut self) {
        let Some(limits) = self.limits.filter(|l| !l.rejects_publish()) else { return };
        if !self.serving() {
            return;
        }
        let mut dropped = Vec::new();
        while limits.exceeded(self.ready.len() as u64, self.ready.ready_bytes()) {
            let Some((offset, _)) = self.ready.take_next() else { break };
            // A replica's ready set may still name a message settled through the log.
            if !self.shard.is_live(offset) {
                continue;
            }
            self.paged.remove(&offset);
            dropped.push(offset);
        }
        if dropped.is_empty() {
            return;
        }
        tracing::debug!(queue = %self.qref.key.name, dropped = dropped.len(), "drop-head at the queue's length limit");
        if self.dead_letter_exchange.is_some() {
            self.dead_letter(dropped, DeathReason::Maxlen);
        } else {
            self.delete(&dropped);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use amq_protocol::types::{AMQPValue, LongString};

    /// A queue's arguments from (key, value) pairs (shared by the queue modules' tests).
    pub(in crate::broker::queue) fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    #[test]
    fn no_limit_no_state() {
        let a = args(&[("x-overflow", AMQPValue::LongString(LongString::from("reject-publish")))]);
        assert_eq!(Limits::from_arguments(&a, false), None);
    }

    #[test]
    fn defaults_to_drop_head_and_counts_ready_only() {
        let l = Limits::from_arguments(&args(&[("x-max-length", AMQPValue::LongInt(2))]), false).unwrap();
        assert_eq!(l.overflow, Overflow::DropHead);
        assert!(!l.exceeded(2, 1 << 40));
        assert!(l.exceeded(3, 0));
        assert!(l.would_overflow(2, 0, 0));
        assert!(!l.would_overflow(1, 0, 0));
        assert!(!l.counts_bytes());
    }

    #[test]
    fn bytes_limit_is_on_body_bytes() {
        let l = Limits::from_arguments(&args(&[("x-max-length-bytes", AMQPValue::LongLongInt(10))]), false).unwrap();
        assert!(!l.exceeded(1000, 10));
        assert!(l.exceeded(1, 11));
        assert!(l.would_overflow(0, 5, 6));
        assert!(!l.would_overflow(0, 5, 5));
        assert!(l.counts_bytes());
    }

    #[test]
    fn zero_refuses_everything() {
        let a = args(&[
            ("x-max-length", AMQPValue::ShortShortUInt(0)),
            ("x-overflow", AMQPValue::LongString(LongString::from("reject-publish-dlx"))),
        ]);
        let l = Limits::from_arguments(&a, false).unwrap();
        assert_eq!(l.overflow, Overflow::RejectPublishDlx);
        assert!(l.would_overflow(0, 0, 0));
        assert_eq!(Limits::from_arguments(&a, true).unwrap().overflow, Overflow::DropHead, "quorum: drop-head");
    }

    #[test]
    fn overflow_values_as_rabbitmq_spells_them() {
        assert_eq!(Overflow::parse("reject-publish"), Ok(Overflow::RejectPublish));
        assert!(Overflow::parse("drop_head").is_err());
        assert!(Overflow::parse("").is_err());
    }
}
