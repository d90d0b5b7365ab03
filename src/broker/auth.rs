//! Who may log in, and with which tags: the seam between the broker's user store and what
//! authenticates against it (the management API's HTTP basic auth today).
//!
//! [`UserStore`] is the trait a store implements. [`ConfigUsers`] is today's store: the
//! `users` of the configuration, each counted as an `administrator` (RabbitMQ's tag for
//! full access to the management API), since the configuration has no tags. A store backed
//! by the metadata group's users (with RabbitMQ's tags and hashed passwords) plugs in by
//! implementing [`UserStore`] and being handed to `mgmt::serve` in `server.rs` instead.
//!
//! # Invariants
//! - A user marked loopback-only (RabbitMQ's `loopback_users`, guest by default) is refused
//!   from any other address, whatever its password: [`AuthError::LoopbackOnly`].

use crate::config::User;

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

/// The configuration's users, every one an `administrator`.
#[derive(Clone, Debug)]
pub struct ConfigUsers(pub Vec<User>);

impl UserStore for ConfigUsers {
    fn authenticate(&self, name: &str, password: &str, loopback: bool) -> Result<AuthUser, AuthError> {
        let user = self.0.iter().find(|u| u.name == name && u.password == password).ok_or(AuthError::InvalidCredentials)?;
        if user.loopback_only && !loopback {
            return Err(AuthError::LoopbackOnly(name.to_owned()));
        }
        Ok(AuthUser { name: user.name.clone(), tags: vec![ADMINISTRATOR.to_owned()] })
    }

    fn users(&self) -> Vec<AuthUser> {
        let mut v: Vec<AuthUser> = self.0.iter().map(|u| AuthUser { name: u.name.clone(), tags: vec![ADMINISTRATOR.to_owned()] }).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> ConfigUsers {
        ConfigUsers(vec![
            User { name: "guest".into(), password: "guest".into(), loopback_only: true },
            User { name: "app".into(), password: "secret".into(), loopback_only: false },
        ])
    }

    #[test]
    fn configured_users_are_administrators() {
        let u = store().authenticate("app", "secret", false).expect("login");
        assert!(u.may_write() && u.may_read());
        assert_eq!(store().users().iter().map(|u| u.name.as_str()).collect::<Vec<_>>(), ["app", "guest"]);
    }

    #[test]
    fn wrong_password_and_remote_guest_are_refused() {
        assert_eq!(store().authenticate("app", "nope", true), Err(AuthError::InvalidCredentials));
        assert_eq!(store().authenticate("nobody", "x", true), Err(AuthError::InvalidCredentials));
        assert_eq!(store().authenticate("guest", "guest", false), Err(AuthError::LoopbackOnly("guest".into())));
        assert!(store().authenticate("guest", "guest", true).is_ok());
    }
}
