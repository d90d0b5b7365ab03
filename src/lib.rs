//! # ringmq
//!
//! An AMQP 0-9-1 broker for Linux: io_uring thread-per-core (glommio), messages in
//! append-only segment files (`ringmq-shards`), metadata and queue cursors in an embedded
//! Raft group. Existing AMQP clients connect to it as they would to RabbitMQ.
//!
//! # Layout
//! - [`amqp`]: the protocol (codec, connection, channels, unacked ledger, one handler per
//!   class). Never touches a file.
//! - [`broker`]: the domain (exchanges, routing, queues, consumers, settlement,
//!   dead-lettering). Never touches a socket.
//! - [`core`]: executors, per-core queue registries, cross-core inboxes, placement,
//!   fatal errors. The only module that knows there are several cores.
//! - [`meta`]: the Raft metadata group (topology, cursors, boot epochs).
//! - [`observe`]: counters and the Prometheus endpoint.
//! - [`config`]: flags, TOML file, defaults.
//!
//! # Request flow
//! A connection lives on the core that accepted it. A basic.publish is routed there
//! with that core's copy of the routing tables, then each target queue's owner core
//! appends it to the queue's shard and wakes the queue's dispatcher, which sends
//! deliveries to consumers' connections (possibly on other cores). Acks travel back to
//! the owner core as offsets and delete the message from its shard.
//!
//! # Invariants (DESIGN.md, "The ack path"; see `broker::queue::settle` for where each holds)
//! 1. A message is outstanding to at most one channel at a time.
//! 2. Index before cursor (see docs/ARCHITECTURE.md for its status).
//! 3. A moved message (dead-letter) is stored in its new place before the old copy goes.
//! 4. An ack deletes the message from its shard.
//! 5. One requeue primitive behind nack, reject, recover, channel/connection close and the
//!    acknowledgement timeout; requeued messages come back first, flagged redelivered.
//! 8. Unknown or settled delivery tags are 406 PRECONDITION_FAILED.
//! 9. Publisher confirms go out only after every target queue stored (and, when
//!    persistent and durable, synced) the message; basic.return precedes the confirm.
//! 10. prefetch_count bounds each consumer's unacked deliveries.

pub mod amqp;
pub mod broker;
pub mod config;
pub mod core;
pub mod meta;
pub mod observe;
pub mod server;
