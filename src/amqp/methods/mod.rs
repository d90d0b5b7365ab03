//! One handler file per AMQP class (spec 1.x "Class and method reference").
//!
//! Handlers check their arguments, talk to the metadata group or to queues, and queue
//! their reply frames on the connection's event channel. They return an [`AmqpError`]
//! for the connection to report; they never write to the socket themselves.
//!
//! [`AmqpError`]: super::error::AmqpError

pub mod basic;
pub mod channel;
pub mod confirm;
pub mod exchange;
pub mod queue;
pub mod tx;

use super::error::AmqpError;
use crate::amqp::connection::Session;
use crate::broker::access::{Perm, Resource};

/// Checks `perm` on the queue or exchange `name` for the connection's user in its vhost
/// (RabbitMQ's permission model, `broker::access`), from the core's topology copy: no
/// metadata round trip, regular expressions compiled once per change.
///
/// # Errors
/// 403 ACCESS_REFUSED (channel), `access to queue 'q' in vhost '/' refused for user 'u'`.
pub fn authorize(s: &Session, perm: Perm, kind: Resource, name: &str) -> Result<(), AmqpError> {
    let router = s.core.router();
    let checked = s.st.borrow_mut().grant.check(router.version, &router.topology, perm, kind, name);
    checked.map_err(AmqpError::access_refused)
}

/// A short random-looking suffix for server-generated names (`amq.gen-…`, `amq.ctag-…`):
/// URL-safe base64 of a unique id mixed with the clock; unique within a run.
pub fn unique_suffix(id: u64) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ nanos.rotate_left(17);
    let mut y = nanos.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ id;
    let mut s = String::with_capacity(22);
    for i in 0..22 {
        let v = if i < 11 { &mut x } else { &mut y };
        s.push(ALPHABET[(*v & 63) as usize] as char);
        *v = v.rotate_right(6) ^ (*v >> 3);
    }
    s
}
