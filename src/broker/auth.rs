//! Who may log in, and with which tags: the seam between the broker's user store and what
//! authenticates against it (the management API's HTTP basic auth today).
//!
//! [`UserStore`] is the trait a store implements. [`MetaUsers`] is the broker's: the
//! metadata group's users (`broker::access`), with RabbitMQ's tags and hashed passwords, the
//! same the AMQP handshake checks.
//!
//! # Invariants
//! - A user marked loopback-only (RabbitMQ's `loopback_users`, guest by default) is refused
//!   from any other address, whatever its password: [`AuthError::LoopbackOnly`].

use std::sync::Arc;

use crate::broker::access::{self, AccessError};
use crate::config::Config;
use crate::meta::MetaHandle;

/// RabbitMQ's tag for full access (every management API call, writes included).
pub const ADMINISTRATOR: &str = "administrator";
/// RabbitMQ's tag for read access to everything (no writes).
pub const MONITORING: &str = "monitoring";

/// A user who logged in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthUser {
    /// User name.
    pub name: String,
    /// RabbitMQ's user tags (`administrator`, `monitoring`, `management`, …).
    pub tags: Vec<String>,
}

impl AuthUser {
    /// Whether the user has tag `tag`.
    pub fn has_tag(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }

    /// Whether the user may change things (`administrator`).
    pub fn may_write(&self) -> bool {
        self.has_tag(ADMINISTRATOR)
    }

    /// Whether the user may read everything (`administrator` or `monitoring`).
    pub fn may_read(&self) -> bool {
        self.may_write() || self.has_tag(MONITORING)
    }
}

/// Why a login was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// Unknown user or wrong password (never says which).
    #[error("login refused: invalid credentials")]
    InvalidCredentials,
    /// The user may only log in from a loopback address.
    #[error("user '{0}' can only connect via localhost")]
    LoopbackOnly(String),
}

/// A user store that checks passwords.
pub trait UserStore: Send + Sync {
    /// Checks `name`/`password` for a client that connects from a loopback address
    /// (`loopback`) or not.
    ///
    /// # Errors
    /// [`AuthError`] when the login is refused.
    fn authenticate(&self, name: &str, password: &str, loopback: bool) -> Result<AuthUser, AuthError>;

    /// Every user with its tags (no passwords), in name order.
    fn users(&self) -> Vec<AuthUser>;
}

/// The metadata group's users (`broker::access`): RabbitMQ's salted SHA-256 hashes and
/// tags, changed at run time through the management API or ringmqctl; loopback-only as the
/// configuration says (guest unless the file lets it out).
#[derive(Clone)]
pub struct MetaUsers {
    /// The metadata handle (users are read from its topology copy).
    pub meta: MetaHandle,
    /// The configuration (which users are loopback-only).
    pub config: Arc<Config>,
}

impl UserStore for MetaUsers {
    fn authenticate(&self, name: &str, password: &str, loopback: bool) -> Result<AuthUser, AuthError> {
        match access::authenticate(&self.meta.topology(), &self.config, name, password, loopback) {
            Ok(u) => Ok(AuthUser { name: u.name, tags: u.tags }),
            Err(AccessError::LoopbackOnly { user }) => Err(AuthError::LoopbackOnly(user)),
            Err(_) => Err(AuthError::InvalidCredentials),
        }
    }

    fn users(&self) -> Vec<AuthUser> {
        let mut v: Vec<AuthUser> = access::users(&self.meta).into_iter().map(|u| AuthUser { name: u.name, tags: u.tags }).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }
}
