//! The AMQP 0-9-1 protocol: frames, connections, channels, the unacked ledger, publisher
//! confirms, and one handler file per class. Never touches a file.
//!
//! # Layout
//! - [`codec`]: frame splitting and writing (amq-protocol for method fields).
//! - [`connection`]: handshake, the reader/writer pair of a connection, error reporting;
//!   its submodules hold the handshake, the session and reader, frame dispatch, the writer,
//!   and the pure delivery-tag assignment and publisher-confirm coalescing; `transport`:
//!   the plain or TLS stream a connection runs on (amqps, `connection::serve_tls`).
//! - [`x509`]: a client certificate's subject common name, for the EXTERNAL mechanism (pure).
//! - [`channel`]: per-channel state (delivery tags, ledger, consumers, confirms).
//! - [`unacked`]: the pure ledger of unsettled deliveries.
//! - [`transaction`]: the pure state of a transactional channel (class `tx`).
//! - [`methods`]: one file per AMQP class.
//! - [`fuzz`]: the fuzz targets (`fuzz/`), replayed over their corpus by `cargo test`.
//! - [`error`]: [`error::AmqpError`], reply codes and scopes.

pub mod channel;
pub mod codec;
pub mod connection;
pub mod error;
pub mod fuzz;
pub mod methods;
pub mod transaction;
pub mod unacked;
pub mod x509;
