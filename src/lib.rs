//! # ringmq
//!
//! An AMQP 0-9-1 broker for Linux: io_uring thread-per-core (glommio), messages in
//! append-only segment files (`ringmq-shards`), metadata and queue cursors in an embedded
//! Raft group. Existing AMQP clients connect to it as they would to RabbitMQ.
//!
//! # Layout (arrows point down only)
//! `main.rs → server → {amqp, mgmt} → broker → {meta, cluster, observe, core, shards, config}`
//! - [`server`]: the wiring — puts [`broker::node::Node`] and [`amqp::connection::serve`] on
//!   the runtime; the only module naming every layer. [`membership`] beside it: `--join`
//!   and `--forget-node`, admin requests on the cluster transport turned into metadata
//!   membership changes.
//! - [`amqp`]: the protocol (codec, connection, channels, unacked ledger, one handler per
//!   class). Never touches a file; maps [`broker::QueueError`] to reply codes.
//! - [`broker`]: the domain (each core's queue registry and tick, exchanges, routing,
//!   queues, consumers, the ack path, dead-lettering, alarms, `broker::remote`: serving
//!   other nodes' queues and ours to them, `broker::replicas` with `queue/replica.rs`:
//!   replicated durable queues and failover in a cluster, and `broker::grow` with
//!   `queue/copy.rs`: growing replica sets back; `broker::access`: logins, RabbitMQ's
//!   permission checks and the users/vhosts/permissions API; `broker::policy`: policies and
//!   a queue's effective arguments). Never touches a socket and names nothing of `amqp`.
//! - [`core`]: the thread-per-core runtime (executors, typed inboxes, accept threads,
//!   placement, fatal errors). Names no protocol and no queue.
//! - [`meta`]: the Raft metadata group (topology with users, permissions and policies
//!   (`meta/access.rs`), cursors, boot epochs, and in a cluster the
//!   messages and settlements of replicated queues, `meta/data.rs`, and the copies that
//!   grow their replica sets, `meta/grow.rs`).
//! - [`cluster`]: the node-to-node TCP transport (plain threads; imports nothing else of the
//!   crate): raft-rs messages, snapshots, and the data lane of `broker::remote`.
//! - [`observe`]: counters, latency histograms (per core and per queue) and the Prometheus
//!   endpoint (`/metrics`, `/metrics/per-object`, rabbitmq_prometheus's names); renders what
//!   it is given (`broker/figures.rs` gathers the queues' figures on scrape).
//! - [`mgmt`]: the RabbitMQ-compatible management HTTP API (plain threads beside the cores):
//!   reads the metadata and asks queues and connections by message passing; writes through
//!   `broker::topology`, the code the AMQP methods use; users, permissions and policies
//!   through `broker::access` and `broker::policy`; serves the web UI (`mgmt/ui/`) and its
//!   live latency view. Only `server` starts it. The `ringmqctl` binary
//!   (`src/bin/ringmqctl/`) is a client of this API and imports nothing of the crate.
//! - [`config`]: flags, TOML file, defaults.
//!
//! # Publish → deliver → ack, step by step
//! 1. A client's socket is accepted on some core (`core/accept.rs`) and served there
//!    (`amqp/connection.rs`: handshake, then a reader and a writer half; on an amqps
//!    listener the rustls handshake first, `serve_tls`, with the config of `config/tls.rs`).
//! 2. basic.publish + header + body frames are decoded (`amqp/codec.rs`) and completed
//!    (`amqp/methods/basic.rs`, `publish`); the route comes from that core's copy of the
//!    routing tables (`broker/router.rs`, `broker/exchange/`). A transactional channel holds
//!    the routed publish until tx.commit (`amqp/transaction.rs`); a reply to a direct
//!    reply-to name goes to the requester's channel, no queue (`broker/reply_to.rs`).
//! 3. The message (`broker/message.rs`, shared `Bytes`) goes to each target queue's owner
//!    core as a `QueueOp::Publish` (`broker/node.rs`: directly on this core, else through
//!    the owner's inbox, `core/mesh.rs`; a queue of another node: over the cluster's data
//!    lane to that node, `broker/remote/`, which does the same there).
//! 4. The queue appends it to its shard (`broker/queue/mod.rs`, `Queue::publish` →
//!    `ringmq-shards`) and puts the offset in its ready set (`broker/queue/ready.rs`); a
//!    persistent message in a durable queue is confirmed after the group commit's sync
//!    (`broker/queue/durability.rs`, `group_commit`), others at once. In a cluster a durable
//!    queue proposes it to the metadata group instead (`broker/queue/replica.rs`): confirmed
//!    once committed on a majority, appended by every member when it applies the entry.
//!    A queue with `x-max-length(-bytes)` refuses the publish first (`reject-publish*`,
//!    basic.nack) or drops its oldest ready messages after (`drop-head`):
//!    `broker/queue/limits.rs`. A message with a TTL (`expiration`, set at step 2;
//!    `x-message-ttl`, set here) carries its deadline in its record; it expires at the
//!    queue's head on a timer and is never handed out after it: `broker/queue/ttl.rs`.
//! 5. The dispatcher (`broker/queue/dispatch.rs`) claims the lowest ready offset for a
//!    consumer with credit, records its holder (`settle::Held`), appends an unacked-index
//!    record when the delivery is tracked and durable, and sends the delivery once that
//!    record is synced (`durability`, `Queue::flush_unsynced`).
//! 6. The consumer's connection assigns the delivery tag and records it in the channel's
//!    ledger (`amqp/unacked.rs`) as it writes basic.deliver.
//! 7. basic.ack/nack/reject resolves tags to offsets in the ledger (406 for unknown ones)
//!    and sends `QueueOp::Settle` to the queue, which settles them
//!    (`broker/queue/settle.rs`, `Queue::settle`): delete, requeue or dead-letter.
//!
//! # Invariants (DESIGN.md, "The ack path", with its numbers; each holds in `broker::queue`)
//! 1. One consumer at a time: `settle::Held::hold`, `Held::settle` (only the holder settles).
//! 2. Index before cursor: `dispatch` `Queue::index_delivery`, `durability::cursor_cas`
//!    (consumes an `IndexSynced`).
//! 3. New copy before old delete: `Queue::dead_letter` (`settle.rs`).
//! 4. Ack is two deletes: `Queue::delete`, then `durability::release_index_records`
//!    (needs a `MessagesSynced`).
//! 5. One requeue primitive: `Queue::requeue`, behind `Queue::settle`,
//!    `Queue::channel_closed`, `Queue::redeliver` and `settle::scan`; order:
//!    `ready::ReadySet::take_next`.
//! 6. Index coverage equals durability: `Queue::index_delivery`.
//! 7. Crash recovery: `settle::scan` (leader only, at open), `Queue::timed_out_holders`.
//! 8. Errors as the protocol says: `amqp::unacked` (406 for unknown or settled tags).
//! 9. Confirms after store (and sync): `durability::group_commit`; nack on failure.
//! 10. Prefetch: `Queue::release`, `consumer::Consumers::next_with_credit`.

pub mod amqp;
pub mod broker;
pub mod cluster;
pub mod config;
pub mod core;
pub mod membership;
pub mod meta;
pub mod mgmt;
pub mod observe;
pub mod server;
