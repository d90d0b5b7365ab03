//! The cluster's one name and permanent id (RabbitMQ's `cluster_name`, set with `rabbitmqctl
//! set_cluster_name` or `PUT /api/cluster-name`, and `persistent_cluster_id`), kept in the
//! replicated metadata ([`ClusterIdentity`]) so every node reports the same ones: in
//! `GET /api/overview`, `GET /api/cluster-name` and the `rabbitmq_cluster` and
//! `rabbitmq_cluster_permanent_id` labels of `rabbitmq_identity_info`.
//!
//! Every node's start proposes its default ([`seed`]): `--cluster-name` when given, else
//! `ringmq@<this host's name>` (RabbitMQ's default is `rabbit@<host of the first node>`), with
//! a fresh random id, applied only while the cluster has no name. So the first node to start
//! names the cluster, once, and a metadata log from before this existed gets its name at
//! the next start.

use crate::meta::{ClusterIdentity, Command, MetaHandle, Outcome, Topology};

use super::access::AccessError;

/// Longest name accepted, bytes (it travels in every scrape's labels).
pub const MAX_NAME_BYTES: usize = 255;

/// `ringmq@<host>`: the host name from the kernel (`/proc/sys/kernel/hostname`), or
/// `localhost` when it cannot be read.
pub fn default_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default();
    format!("ringmq@{}", if host.is_empty() { "localhost" } else { &host })
}

/// A new permanent id: a random UUID (version 4, RFC 9562), as RabbitMQ's
/// `persistent_cluster_id`. Falls back to one made of the time and process id when the
/// kernel gives no random bytes.
pub fn new_permanent_id() -> String {
    let mut b = [0u8; 16];
    if getrandom::getrandom(&mut b).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        b = (t ^ u128::from(std::process::id()) << 64).to_le_bytes();
    }
    b[6] = b[6] & 0x0f | 0x40;
    b[8] = b[8] & 0x3f | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// The cluster's identity as `topology` has it; before any node set it (a moment at the
/// first start), this node's default name and no id.
pub fn identity(topology: &Topology) -> ClusterIdentity {
    topology.cluster.clone().unwrap_or_else(|| ClusterIdentity { name: default_name(), permanent_id: String::new() })
}

/// Checks a name given by an operator: not empty, at most [`MAX_NAME_BYTES`], no control
/// character.
///
/// # Errors
/// [`AccessError::Invalid`] saying which rule it breaks.
pub fn check_name(name: &str) -> Result<(), AccessError> {
    if name.trim().is_empty() {
        return Err(AccessError::Invalid("the cluster name must not be empty".into()));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(AccessError::Invalid(format!("the cluster name is longer than {MAX_NAME_BYTES} bytes")));
    }
    if name.chars().any(char::is_control) {
        return Err(AccessError::Invalid("the cluster name must not hold control characters".into()));
    }
    Ok(())
}

/// Names the cluster unless it has a name: `configured` (`--cluster-name`), else
/// [`default_name`]. Blocks until applied (call it at start, off the executors).
///
/// # Errors
/// [`AccessError::Invalid`] for a configured name [`check_name`] refuses; metadata errors.
pub fn seed(meta: &MetaHandle, configured: Option<&str>) -> Result<(), AccessError> {
    if meta.topology().cluster.is_some() {
        return Ok(());
    }
    let name = match configured {
        Some(n) => {
            check_name(n)?;
            n.to_owned()
        }
        None => default_name(),
    };
    meta.propose_blocking(vec![Command::SetClusterName { name, permanent_id: new_permanent_id(), initial: true }])?;
    Ok(())
}

/// Renames the cluster (`set_cluster_name`); true when the name changed. The permanent id
/// stays.
///
/// # Errors
/// [`AccessError::Invalid`] for a name [`check_name`] refuses; metadata errors.
pub async fn set(meta: &MetaHandle, name: &str) -> Result<bool, AccessError> {
    check_name(name)?;
    let cmd = Command::SetClusterName { name: name.to_owned(), permanent_id: new_permanent_id(), initial: false };
    Ok(matches!(meta.propose(cmd).await?, Outcome::Created | Outcome::Updated))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_version_4_uuids_and_differ() {
        let (a, b) = (new_permanent_id(), new_permanent_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36, "{a}");
        assert_eq!(a.as_bytes()[14], b'4', "{a}");
        assert!(matches!(a.as_bytes()[19], b'8' | b'9' | b'a' | b'b'), "{a}");
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("prod-eu").is_ok());
        assert!(check_name(" ").is_err());
        assert!(check_name(&"x".repeat(MAX_NAME_BYTES + 1)).is_err());
        assert!(check_name("a\nb").is_err());
        assert!(default_name().starts_with("ringmq@"));
    }
}
