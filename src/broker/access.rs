//! Users, vhosts and permissions: authentication, RabbitMQ's permission model, and the
//! run-time API the management API and ringmqctl call (issue 13, item 2).
//!
//! The data lives in the metadata group (`meta::access`, replicated and durable); every core
//! reads it from its own copy of the [`Topology`] (the router's), so a login or a permission
//! check never crosses cores. Changes are metadata proposals through the [`MetaHandle`]
//! every core and thread holds; they resolve once applied here, and every core sees them
//! at its next topology refresh.
//!
//! # The permission model (RabbitMQ's "Access Control")
//! A user has, per vhost, three regular expressions: configure, write, read. Each is matched
//! unanchored against the resource's name (RabbitMQ anchors with `^…$` when it wants to); an
//! empty expression matches nothing; the default exchange `""` is checked as `amq.default`.
//! - configure: queue.declare (not passive), queue.delete, exchange.declare (not passive),
//!   exchange.delete;
//! - write: basic.publish (the exchange), queue.bind/unbind (the queue),
//!   exchange.bind/unbind (the destination exchange);
//! - read: basic.consume, basic.get, queue.purge (the queue), and the source exchange of a
//!   binding.
//!
//! A refusal is 403 ACCESS_REFUSED, text `access to queue 'q' in vhost '/' refused for user
//! 'u'`; a user without permissions in a vhost cannot open it (530 NOT_ALLOWED, `access to
//! vhost '/' refused for user 'u'`).
//!
//! # Invariants
//! 1. Passwords are stored only hashed ([`hash_password`]), in RabbitMQ's
//!    `rabbit_password_hashing_sha256` form, so definitions exported by RabbitMQ log in here.
//! 2. A connection's [`Grant`] compiles its regular expressions once per change of its
//!    permission, never per check: the publish path does a version compare and, unless the
//!    pattern is `.*`, one regex search.

use std::fmt;

use base64::Engine as _;
use regex::Regex;
use sha2::{Digest, Sha256};

use crate::config::Config;
use crate::meta::access::{Permission, UserDef};
use crate::meta::{Command, MetaError, MetaHandle, Outcome, Topology};

/// A logged-in user: name and tags (`administrator`, `monitoring`, …).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    /// User name.
    pub name: String,
    /// Tags, as stored.
    pub tags: Vec<String>,
}

/// What a permission allows (RabbitMQ's configure/write/read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Perm {
    /// Declare and delete.
    Configure,
    /// Publish to an exchange; be a binding's destination.
    Write,
    /// Consume, get, purge; be a binding's source.
    Read,
}

/// The kind of resource checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    /// A queue.
    Queue,
    /// An exchange.
    Exchange,
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Resource::Queue => "queue",
            Resource::Exchange => "exchange",
        })
    }
}

/// Errors of authentication, authorization and the run-time API. The texts are RabbitMQ's
/// where a client sees them.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    /// Unknown user or wrong password (the client gets RabbitMQ's text, which names neither).
    #[error("login refused for user '{user}': unknown user or wrong password")]
    LoginRefused {
        /// The user name given.
        user: String,
    },
    /// A loopback-only user connected from elsewhere.
    #[error("user '{user}' can only connect via localhost")]
    LoopbackOnly {
        /// The user name.
        user: String,
    },
    /// No permissions in the vhost (530 NOT_ALLOWED at connection.open).
    #[error("access to vhost '{vhost}' refused for user '{user}'")]
    VhostRefused {
        /// The vhost.
        vhost: String,
        /// The user.
        user: String,
    },
    /// A permission check failed (403 ACCESS_REFUSED on the channel).
    #[error("access to {kind} '{name}' in vhost '{vhost}' refused for user '{user}'")]
    Refused {
        /// Queue or exchange.
        kind: Resource,
        /// Its name (`amq.default` for the default exchange).
        name: String,
        /// The vhost.
        vhost: String,
        /// The user.
        user: String,
    },
    /// The user, vhost, permission or policy named does not exist.
    #[error("{0} not found")]
    NotFound(String),
    /// `add_user` / `add_vhost` of a name that exists.
    #[error("{0} already exists")]
    AlreadyExists(String),
    /// A malformed argument (a regular expression that does not compile, a bad definition).
    #[error("invalid: {0}")]
    Invalid(String),
    /// The metadata proposal failed.
    #[error(transparent)]
    Meta(#[from] MetaError),
}

// ---------------------------------------------------------------------------------------------
// Passwords

/// Hashes `password` with a fresh random 4-byte salt into RabbitMQ's
/// `rabbit_password_hashing_sha256` form: base64(salt ‖ SHA-256(salt ‖ password)).
pub fn hash_password(password: &str) -> String {
    let mut salt = [0u8; 4];
    if getrandom::getrandom(&mut salt).is_err() {
        // No entropy source: a time-derived salt still differs per call.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        salt = (t.subsec_nanos() ^ t.as_secs() as u32).to_le_bytes();
    }
    hash_password_with_salt(salt, password)
}

/// [`hash_password`] with a given salt (deterministic; for tests and imports).
pub fn hash_password_with_salt(salt: [u8; 4], password: &str) -> String {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let mut raw = salt.to_vec();
    raw.extend_from_slice(&h.finalize());
    base64::engine::general_purpose::STANDARD.encode(raw)
}

/// True when `password` matches `hash` (RabbitMQ's sha256 form; an empty or malformed hash
/// matches nothing). Compares the digests without an early exit.
pub fn check_password(hash: &str, password: &str) -> bool {
    let Ok(raw) = base64::engine::general_purpose::STANDARD.decode(hash) else { return false };
    if raw.len() != 4 + 32 {
        return false;
    }
    let salt: [u8; 4] = raw[..4].try_into().expect("4 bytes");
    let mut h = Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let digest = h.finalize();
    digest.iter().zip(&raw[4..]).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

// ---------------------------------------------------------------------------------------------
// Authentication and authorization

/// Checks a login against the metadata's users: `user` must exist, `password` match its hash,
/// and a [`loopback_only`] user connect from a loopback address.
///
/// # Errors
/// [`AccessError::LoginRefused`] (unknown user, wrong password, no password), or
/// [`AccessError::LoopbackOnly`].
pub fn authenticate(topology: &Topology, config: &Config, user: &str, password: &str, from_loopback: bool) -> Result<User, AccessError> {
    let refused = || AccessError::LoginRefused { user: user.to_owned() };
    let u = topology.access.users.get(user).ok_or_else(refused)?;
    if !check_password(&u.password_hash, password) {
        return Err(refused());
    }
    if !from_loopback && loopback_only(config, user) {
        return Err(AccessError::LoopbackOnly { user: user.to_owned() });
    }
    Ok(User { name: u.name.clone(), tags: u.tags.clone() })
}

/// Checks a login whose identity a verified TLS client certificate vouches for (the
/// EXTERNAL mechanism, RabbitMQ's rabbitmq_auth_mechanism_ssl): `user` (the certificate's
/// subject common name) must exist, and a [`loopback_only`] user connect from a loopback
/// address; no password is checked. Verifying the certificate is the caller's part.
///
/// # Errors
/// [`AccessError::LoginRefused`] (unknown user), or [`AccessError::LoopbackOnly`].
pub fn authenticate_external(topology: &Topology, config: &Config, user: &str, from_loopback: bool) -> Result<User, AccessError> {
    let u = topology.access.users.get(user).ok_or_else(|| AccessError::LoginRefused { user: user.to_owned() })?;
    if !from_loopback && loopback_only(config, user) {
        return Err(AccessError::LoopbackOnly { user: user.to_owned() });
    }
    Ok(User { name: u.name.clone(), tags: u.tags.clone() })
}

/// True when `user` may log in only from a loopback address (RabbitMQ's `loopback_users`):
/// as the configuration file says of it, and for `guest` when the file does not name it (so a
/// guest created at run time is no way in from outside either).
pub fn loopback_only(config: &Config, user: &str) -> bool {
    match config.users.iter().find(|c| c.name == user) {
        Some(c) => c.loopback_only,
        None => user == "guest",
    }
}

/// Checks that `user` may open `vhost`: it exists and the user has permissions in it.
///
/// # Errors
/// [`AccessError::NotFound`] (no such vhost: RabbitMQ's `vhost … not found`), or
/// [`AccessError::VhostRefused`].
pub fn check_vhost_access(topology: &Topology, user: &str, vhost: &str) -> Result<(), AccessError> {
    if !topology.vhosts.contains(vhost) {
        return Err(AccessError::NotFound(format!("vhost {vhost}")));
    }
    if topology.access.permission(user, vhost).is_none() {
        return Err(AccessError::VhostRefused { vhost: vhost.to_owned(), user: user.to_owned() });
    }
    Ok(())
}

/// One compiled permission expression.
#[derive(Debug)]
enum Matcher {
    /// `""`: matches nothing.
    Nothing,
    /// `.*` (or `^.*$`, `^.*`): matches everything, no regex run.
    Everything,
    /// Anything else.
    Re(Regex),
}

impl Matcher {
    fn new(re: &str) -> Matcher {
        match re {
            "" => Matcher::Nothing,
            ".*" | "^.*$" | "^.*" | ".*$" => Matcher::Everything,
            // A pattern that does not compile (checked when set, so only a hand-made one)
            // matches nothing.
            _ => Regex::new(re).map(Matcher::Re).unwrap_or(Matcher::Nothing),
        }
    }

    fn is_match(&self, name: &str) -> bool {
        match self {
            Matcher::Nothing => false,
            Matcher::Everything => true,
            Matcher::Re(r) => r.is_match(name),
        }
    }
}

/// A connection's permissions in its vhost, compiled: what every check on that connection
/// reads. Refreshed from the core's topology copy when its version moves, recompiled only
/// when the permission itself changed (invariant 2).
#[derive(Debug)]
pub struct Grant {
    user: String,
    vhost: String,
    /// Topology version last looked at.
    version: u64,
    /// The permission compiled (`None`: none in the vhost, everything refused).
    current: Option<(Permission, [Matcher; 3])>,
}

impl Grant {
    /// A grant for `user` in `vhost`, filled at the first check.
    pub fn new(user: &str, vhost: &str) -> Grant {
        Grant { user: user.to_owned(), vhost: vhost.to_owned(), version: u64::MAX, current: None }
    }

    /// Checks `perm` on resource `kind` named `name` against `topology` (taken at metadata
    /// topology `version`: the core's router copy).
    ///
    /// # Errors
    /// [`AccessError::Refused`], with RabbitMQ's text.
    pub fn check(&mut self, version: u64, topology: &Topology, perm: Perm, kind: Resource, name: &str) -> Result<(), AccessError> {
        if version != self.version {
            self.refresh(topology);
            self.version = version;
        }
        let name = if kind == Resource::Exchange && name.is_empty() { "amq.default" } else { name };
        let allowed = self.current.as_ref().is_some_and(|(_, m)| {
            m[match perm {
                Perm::Configure => 0,
                Perm::Write => 1,
                Perm::Read => 2,
            }]
            .is_match(name)
        });
        if allowed {
            Ok(())
        } else {
            Err(AccessError::Refused { kind, name: name.to_owned(), vhost: self.vhost.clone(), user: self.user.clone() })
        }
    }

    fn refresh(&mut self, topology: &Topology) {
        let now = topology.access.permission(&self.user, &self.vhost);
        if now == self.current.as_ref().map(|(p, _)| p) {
            return;
        }
        self.current = now.map(|p| (p.clone(), [Matcher::new(&p.configure), Matcher::new(&p.write), Matcher::new(&p.read)]));
    }
}

// ---------------------------------------------------------------------------------------------
// The run-time API (management API, ringmqctl)

/// A password to store: in clear (hashed here), already hashed (RabbitMQ's sha256 form, as a
/// definitions file carries it), or none (the user cannot log in with a password).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Password {
    /// In clear.
    Clear(String),
    /// `rabbit_password_hashing_sha256` hash (base64).
    Hash(String),
    /// No password.
    None,
}

impl Password {
    fn hashed(self) -> Result<String, AccessError> {
        match self {
            Password::Clear(p) => Ok(hash_password(&p)),
            Password::Hash(h) => {
                let ok = base64::engine::general_purpose::STANDARD.decode(&h).is_ok_and(|raw| raw.len() == 36);
                if ok {
                    Ok(h)
                } else {
                    Err(AccessError::Invalid("password_hash is not a base64 salted SHA-256 hash (36 bytes)".into()))
                }
            }
            Password::None => Ok(String::new()),
        }
    }
}

/// Checks that `re` compiles (the `regex` crate's syntax).
///
/// # Errors
/// [`AccessError::Invalid`] naming the expression.
pub fn check_regex(re: &str) -> Result<(), AccessError> {
    Regex::new(re).map(|_| ()).map_err(|e| AccessError::Invalid(format!("bad regular expression {re:?}: {e}")))
}

/// Every user, by name.
pub fn users(meta: &MetaHandle) -> Vec<UserDef> {
    meta.topology().access.users.values().cloned().collect()
}

/// The user `name`, if it exists.
pub fn user(meta: &MetaHandle, name: &str) -> Option<UserDef> {
    meta.topology().access.users.get(name).cloned()
}

/// Creates a user (RabbitMQ's `add_user`).
///
/// # Errors
/// [`AccessError::AlreadyExists`], [`AccessError::Invalid`] (bad hash), metadata errors.
pub async fn add_user(meta: &MetaHandle, name: &str, password: Password, tags: Vec<String>) -> Result<(), AccessError> {
    if user(meta, name).is_some() {
        return Err(AccessError::AlreadyExists(format!("user '{name}'")));
    }
    put_user(meta, name, password, tags).await.map(|_| ())
}

/// Creates or replaces a user (the management API's `PUT /api/users/{name}`); returns true
/// when it was created.
///
/// # Errors
/// [`AccessError::Invalid`] (bad hash), metadata errors.
pub async fn put_user(meta: &MetaHandle, name: &str, password: Password, tags: Vec<String>) -> Result<bool, AccessError> {
    let password_hash = password.hashed()?;
    let out = meta.propose(Command::PutUser(UserDef { name: name.to_owned(), password_hash, tags })).await?;
    Ok(out == Outcome::Created)
}

async fn update_user(
    meta: &MetaHandle,
    name: &str,
    change: impl FnOnce(&mut UserDef) -> Result<(), AccessError>,
) -> Result<(), AccessError> {
    let mut u = user(meta, name).ok_or_else(|| AccessError::NotFound(format!("user '{name}'")))?;
    change(&mut u)?;
    meta.propose(Command::PutUser(u)).await?;
    Ok(())
}

/// Sets a user's password (RabbitMQ's `change_password`).
///
/// # Errors
/// [`AccessError::NotFound`], metadata errors.
pub async fn change_password(meta: &MetaHandle, name: &str, password: &str) -> Result<(), AccessError> {
    let hash = hash_password(password);
    update_user(meta, name, |u| {
        u.password_hash = hash;
        Ok(())
    })
    .await
}

/// Removes a user's password: it can no longer log in with one (`clear_password`).
///
/// # Errors
/// [`AccessError::NotFound`], metadata errors.
pub async fn clear_password(meta: &MetaHandle, name: &str) -> Result<(), AccessError> {
    update_user(meta, name, |u| {
        u.password_hash.clear();
        Ok(())
    })
    .await
}

/// Replaces a user's tags (`set_user_tags`).
///
/// # Errors
/// [`AccessError::NotFound`], metadata errors.
pub async fn set_user_tags(meta: &MetaHandle, name: &str, tags: Vec<String>) -> Result<(), AccessError> {
    update_user(meta, name, |u| {
        u.tags = tags;
        Ok(())
    })
    .await
}

/// Deletes a user and its permissions (`delete_user`). Its open connections stay open;
/// their next permission check finds no permission and is refused.
///
/// # Errors
/// [`AccessError::NotFound`], metadata errors.
pub async fn delete_user(meta: &MetaHandle, name: &str) -> Result<(), AccessError> {
    match meta.propose(Command::DeleteUser { name: name.to_owned() }).await? {
        Outcome::NotFound => Err(AccessError::NotFound(format!("user '{name}'"))),
        _ => Ok(()),
    }
}

/// Every vhost, by name.
pub fn vhosts(meta: &MetaHandle) -> Vec<String> {
    meta.topology().vhosts.iter().cloned().collect()
}

/// Creates a vhost with its predeclared exchanges (`add_vhost`); true when created, false
/// when it existed.
///
/// # Errors
/// Metadata errors.
pub async fn add_vhost(meta: &MetaHandle, name: &str) -> Result<bool, AccessError> {
    Ok(meta.propose(Command::DeclareVhost { name: name.to_owned() }).await? == Outcome::Created)
}

/// Deletes a vhost and, in the metadata, everything in it: exchanges, bindings, queues,
/// permissions, policies (`delete_vhost`). Callers that can (the management API) delete the
/// vhost's queues first through queue.delete, so their consumers are cancelled and their
/// stores removed at once; a queue left is dropped from the metadata here and its store
/// removed at the next start of each node (`main.rs`, orphan shards).
///
/// # Errors
/// [`AccessError::NotFound`], metadata errors.
pub async fn delete_vhost(meta: &MetaHandle, name: &str) -> Result<(), AccessError> {
    match meta.propose(Command::DeleteVhost { name: name.to_owned() }).await? {
        Outcome::NotFound => Err(AccessError::NotFound(format!("vhost '{name}'"))),
        _ => Ok(()),
    }
}

/// Every permission, by (user, vhost).
pub fn permissions(meta: &MetaHandle) -> Vec<Permission> {
    meta.topology().access.permissions.values().cloned().collect()
}

/// Sets `user`'s permissions in `vhost` (`set_permissions`): three regular expressions.
///
/// # Errors
/// [`AccessError::Invalid`] (an expression does not compile), [`AccessError::NotFound`] (no
/// such user or vhost), metadata errors.
pub async fn set_permissions(
    meta: &MetaHandle,
    user: &str,
    vhost: &str,
    configure: &str,
    write: &str,
    read: &str,
) -> Result<(), AccessError> {
    for re in [configure, write, read] {
        check_regex(re)?;
    }
    let p = Permission { user: user.into(), vhost: vhost.into(), configure: configure.into(), write: write.into(), read: read.into() };
    match meta.propose(Command::SetPermission(p)).await? {
        Outcome::NotFound => Err(AccessError::NotFound(format!("user '{user}' or vhost '{vhost}'"))),
        _ => Ok(()),
    }
}

/// Clears `user`'s permissions in `vhost` (`clear_permissions`).
///
/// # Errors
/// [`AccessError::NotFound`], metadata errors.
pub async fn clear_permissions(meta: &MetaHandle, user: &str, vhost: &str) -> Result<(), AccessError> {
    match meta.propose(Command::ClearPermission { user: user.into(), vhost: vhost.into() }).await? {
        Outcome::NotFound => Err(AccessError::NotFound(format!("permissions of user '{user}' in vhost '{vhost}'"))),
        _ => Ok(()),
    }
}

/// The commands that seed a fresh data directory from the configuration (`main.rs` proposes
/// them once, while the metadata has never held a user): vhosts, users (passwords hashed
/// here), permissions (without `[[permissions]]`: every user `.*` on every vhost), policies and
/// operator policies.
///
/// # Errors
/// [`AccessError::Invalid`] for a `password_hash` that is not RabbitMQ's sha256 form or a
/// policy definition [`check_definition`](super::policy::check_definition) refuses, naming
/// the user or policy (the rest of the file was checked when it was loaded).
pub fn seed_commands(config: &Config) -> Result<Vec<Command>, AccessError> {
    let mut cmds: Vec<Command> = config.vhosts.iter().map(|v| Command::DeclareVhost { name: v.clone() }).collect();
    for u in &config.users {
        let password = match (&u.password, &u.password_hash) {
            (_, Some(h)) => Password::Hash(h.clone()),
            (Some(p), None) => Password::Clear(p.clone()),
            (None, None) => Password::None,
        };
        let password_hash = password.hashed().map_err(|e| AccessError::Invalid(format!("user '{}': {e}", u.name)))?;
        cmds.push(Command::PutUser(UserDef { name: u.name.clone(), password_hash, tags: u.tags.clone() }));
    }
    match &config.permissions {
        Some(list) => cmds.extend(list.iter().map(|p| {
            Command::SetPermission(Permission {
                user: p.user.clone(),
                vhost: p.vhost.clone(),
                configure: p.configure.clone(),
                write: p.write.clone(),
                read: p.read.clone(),
            })
        })),
        None => {
            for u in &config.users {
                for v in &config.vhosts {
                    let all = ".*".to_string();
                    cmds.push(Command::SetPermission(Permission {
                        user: u.name.clone(),
                        vhost: v.clone(),
                        configure: all.clone(),
                        write: all.clone(),
                        read: all,
                    }));
                }
            }
        }
    }
    for (list, operator) in [(&config.policies, false), (&config.operator_policies, true)] {
        for p in list {
            let definition = serde_json::to_value(&p.definition).unwrap_or_default();
            let definition = super::policy::check_definition(&definition, operator)
                .map_err(|e| AccessError::Invalid(format!("policy '{}' in the configuration: {e}", p.name)))?;
            cmds.push(Command::SetPolicy(crate::meta::access::PolicyDef {
                vhost: p.vhost.clone(),
                name: p.name.clone(),
                pattern: p.pattern.clone(),
                apply_to: crate::meta::access::ApplyTo::from_name(&p.apply_to).unwrap_or(crate::meta::access::ApplyTo::All),
                priority: p.priority,
                definition,
                operator,
            }));
        }
    }
    Ok(cmds)
}

#[cfg(test)]
#[path = "access_tests.rs"]
mod tests;
