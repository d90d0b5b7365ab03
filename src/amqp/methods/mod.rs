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

use amq_protocol::types::FieldTable;

use super::error::AmqpError;
use crate::amqp::connection::Session;
use crate::broker::access::{Perm, Resource};
use crate::meta::MetaError;

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

/// Maps a metadata failure to a reply code: 506 RESOURCE_ERROR (a channel error: the
/// request may succeed later) when the metadata log has no disk space or the cluster has no
/// quorum (a minority side, or an election under way), else 541 INTERNAL_ERROR.
pub fn meta_error(e: MetaError) -> AmqpError {
    match e {
        MetaError::DiskFull { .. } | MetaError::NoQuorum { .. } | MetaError::NotLeader { .. } => {
            AmqpError::resource_error(format!("metadata store: {e}"))
        }
        e => AmqpError::internal_error(format!("metadata store: {e}")),
    }
}

/// Looks a name up in the core's routing copy with `find`; on a miss in a cluster, waits for
/// a metadata read barrier and looks again, so a name declared on another node a moment ago
/// (declare-ok already sent there) is found here too. A hit costs nothing extra.
///
/// # Errors
/// 506 RESOURCE_ERROR when the barrier finds no quorum (see [`meta_error`]).
pub async fn find_synced<T>(
    s: &crate::amqp::connection::Session,
    find: impl Fn(&crate::broker::router::Router) -> Option<T>,
) -> Result<Option<T>, AmqpError> {
    if let Some(hit) = find(&s.core.router()) {
        return Ok(Some(hit));
    }
    if !s.core.shared.meta.is_cluster() {
        return Ok(None);
    }
    s.core.shared.meta.sync().await.map_err(meta_error)?;
    Ok(find(&s.core.router()))
}

/// Whether two argument tables are equivalent for a redeclare (RabbitMQ compares the
/// tables; key order does not matter, the table is sorted).
pub fn args_equivalent(a: &FieldTable, b: &FieldTable) -> bool {
    a == b
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
