//! Users, permissions and policies in the metadata (issue 13, items 2 and 3): the plain data
//! the commands carry, how [`MetaState::apply`](super::state::MetaState::apply) changes it, and
//! the binary form of those commands in a Raft entry (tags 32 and up; `codec.rs` hands them
//! here).
//!
//! Everything here is data: passwords arrive already hashed (the proposer salts them, since
//! `apply` must stay deterministic), regular expressions and policy definitions are kept as the
//! text they were given and compiled or parsed by the broker (`broker::access`,
//! `broker::policy`), once per change on each core.
//!
//! # Invariants (checked by [`Access::check`])
//! 1. Every permission names a user that exists and a vhost that exists; deleting either
//!    deletes the permission.
//! 2. Every policy (and operator policy) lives in a vhost that exists; deleting the vhost
//!    deletes it.
//! 3. Map keys equal the fields of the value they hold.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::state::{Command, Outcome};
use super::wire::{put_str, put_varint, DecodeError, Reader};

/// A user that may log in (RabbitMQ's internal user record).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserDef {
    /// User name.
    pub name: String,
    /// Password hash in RabbitMQ's `rabbit_password_hashing_sha256` form: base64 of a 4-byte
    /// salt followed by SHA-256(salt ‖ password). Empty: the user has no password and cannot
    /// log in with one (RabbitMQ's `clear_password`).
    pub password_hash: String,
    /// Tags (`administrator`, `monitoring`, `management`, `policymaker`, … or any string), in
    /// the order given.
    pub tags: Vec<String>,
}

/// A user's permissions in one vhost: three regular expressions (the `regex` crate's syntax,
/// matched unanchored against resource names as RabbitMQ does; `""` matches nothing).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Permission {
    /// User name.
    pub user: String,
    /// Vhost name.
    pub vhost: String,
    /// Declare and delete queues and exchanges whose names match.
    pub configure: String,
    /// Publish to exchanges, bind to queues and exchanges (as destination) whose names match.
    pub write: String,
    /// Consume, get and purge queues, bind from exchanges (as source) whose names match.
    pub read: String,
}

/// Which objects a policy applies to (RabbitMQ's `apply-to`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ApplyTo {
    /// Queues and exchanges.
    All,
    /// Queues of every type.
    Queues,
    /// Exchanges.
    Exchanges,
    /// Classic queues only.
    ClassicQueues,
    /// Quorum queues only.
    QuorumQueues,
}

impl ApplyTo {
    /// RabbitMQ's name (`"all"`, `"queues"`, `"exchanges"`, `"classic_queues"`,
    /// `"quorum_queues"`).
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyTo::All => "all",
            ApplyTo::Queues => "queues",
            ApplyTo::Exchanges => "exchanges",
            ApplyTo::ClassicQueues => "classic_queues",
            ApplyTo::QuorumQueues => "quorum_queues",
        }
    }

    /// Parses RabbitMQ's name; `None` for an unknown one.
    pub fn from_name(s: &str) -> Option<ApplyTo> {
        [ApplyTo::All, ApplyTo::Queues, ApplyTo::Exchanges, ApplyTo::ClassicQueues, ApplyTo::QuorumQueues]
            .into_iter()
            .find(|a| a.as_str() == s)
    }

    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(c: u8) -> Option<ApplyTo> {
        [ApplyTo::All, ApplyTo::Queues, ApplyTo::Exchanges, ApplyTo::ClassicQueues, ApplyTo::QuorumQueues]
            .into_iter()
            .find(|a| a.code() == c)
    }
}

/// A policy or an operator policy (RabbitMQ's `rabbitmqctl set_policy` /
/// `set_operator_policy`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyDef {
    /// Vhost name.
    pub vhost: String,
    /// Policy name (unique per vhost and kind).
    pub name: String,
    /// Regular expression matched (unanchored) against queue and exchange names.
    pub pattern: String,
    /// What it applies to.
    pub apply_to: ApplyTo,
    /// Of several matching policies of one kind, the highest priority applies (ties: the
    /// greatest name, deterministic).
    pub priority: i64,
    /// The definition: a JSON object in compact form (`{"max-length":2}`), keys sorted.
    pub definition: String,
    /// An operator policy (true) or a user policy (false).
    pub operator: bool,
}

/// Users, permissions and policies: the part of [`Topology`](super::topology::Topology) that
/// authentication and authorization read on every core.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Access {
    /// Users by name.
    pub users: BTreeMap<String, UserDef>,
    /// Permissions by `(user, vhost)`.
    #[serde(with = "keyed_permissions")]
    pub permissions: BTreeMap<(String, String), Permission>,
    /// Policies and operator policies by `(vhost, name, operator)`.
    #[serde(with = "keyed_policies")]
    pub policies: BTreeMap<(String, String, bool), PolicyDef>,
    /// True once a user was ever stored: the TOML seed runs only before that (a fresh data
    /// directory, or one from before users lived in the metadata).
    pub initialized: bool,
}

impl Access {
    /// The permission of `user` in `vhost`, if any.
    pub fn permission(&self, user: &str, vhost: &str) -> Option<&Permission> {
        self.permissions.get(&(user.to_owned(), vhost.to_owned()))
    }

    /// The policies (`operator` false) or operator policies (true) of `vhost`, in name order.
    pub fn policies_in<'a>(&'a self, vhost: &'a str, operator: bool) -> impl Iterator<Item = &'a PolicyDef> + 'a {
        self.policies.values().filter(move |p| p.vhost == vhost && p.operator == operator)
    }

    /// Checks the module's invariants against the set of `vhosts`; returns the first broken.
    pub fn check(&self, vhosts: &BTreeSet<String>) -> Result<(), String> {
        for ((user, vhost), p) in &self.permissions {
            if *user != p.user || *vhost != p.vhost {
                return Err(format!("permission key {user:?}/{vhost:?} != its value"));
            }
            if !self.users.contains_key(user) || !vhosts.contains(vhost) {
                return Err(format!("permission {user:?}/{vhost:?} names a missing user or vhost"));
            }
        }
        for ((vhost, name, operator), p) in &self.policies {
            if *vhost != p.vhost || *name != p.name || *operator != p.operator {
                return Err(format!("policy key {vhost:?}/{name:?} != its value"));
            }
            if !vhosts.contains(vhost) {
                return Err(format!("policy {vhost:?}/{name:?} in a missing vhost"));
            }
        }
        for (name, u) in &self.users {
            if *name != u.name {
                return Err(format!("user key {name:?} != its value"));
            }
        }
        Ok(())
    }

    /// Applies one of the access commands; `vhosts` is the topology's set. Called only by
    /// `MetaState::apply` (pure, deterministic).
    pub(super) fn apply(&mut self, vhosts: &BTreeSet<String>, cmd: &Command) -> Outcome {
        match cmd {
            Command::PutUser(u) => {
                self.initialized = true;
                match self.users.insert(u.name.clone(), u.clone()) {
                    None => Outcome::Created,
                    Some(old) if old == *u => Outcome::Existed,
                    Some(_) => Outcome::Updated,
                }
            }
            Command::DeleteUser { name } => {
                if self.users.remove(name).is_none() {
                    return Outcome::NotFound;
                }
                self.permissions.retain(|(user, _), _| user != name);
                Outcome::Deleted
            }
            Command::SetPermission(p) => {
                if !self.users.contains_key(&p.user) || !vhosts.contains(&p.vhost) {
                    return Outcome::NotFound;
                }
                match self.permissions.insert((p.user.clone(), p.vhost.clone()), p.clone()) {
                    None => Outcome::Created,
                    Some(old) if old == *p => Outcome::Existed,
                    Some(_) => Outcome::Updated,
                }
            }
            Command::ClearPermission { user, vhost } => match self.permissions.remove(&(user.clone(), vhost.clone())) {
                Some(_) => Outcome::Deleted,
                None => Outcome::NotFound,
            },
            Command::SetPolicy(p) => {
                if !vhosts.contains(&p.vhost) {
                    return Outcome::NotFound;
                }
                match self.policies.insert((p.vhost.clone(), p.name.clone(), p.operator), p.clone()) {
                    None => Outcome::Created,
                    Some(old) if old == *p => Outcome::Existed,
                    Some(_) => Outcome::Updated,
                }
            }
            Command::ClearPolicy { vhost, name, operator } => match self.policies.remove(&(vhost.clone(), name.clone(), *operator)) {
                Some(_) => Outcome::Deleted,
                None => Outcome::NotFound,
            },
            _ => unreachable!("Access::apply called with a command that is not an access command"),
        }
    }

    /// Forgets everything of a deleted vhost (its permissions and policies).
    pub(super) fn drop_vhost(&mut self, vhost: &str) {
        self.permissions.retain(|(_, v), _| v != vhost);
        self.policies.retain(|(v, _, _), _| v != vhost);
    }
}

// ---------------------------------------------------------------------------------------------
// Binary form (codec.rs delegates tags 32..=63 here).

pub(super) const TAG_PUT_USER: u8 = 32;
pub(super) const TAG_DELETE_USER: u8 = 33;
pub(super) const TAG_SET_PERMISSION: u8 = 34;
pub(super) const TAG_CLEAR_PERMISSION: u8 = 35;
pub(super) const TAG_SET_POLICY: u8 = 36;
pub(super) const TAG_CLEAR_POLICY: u8 = 37;
pub(super) const TAG_DELETE_VHOST: u8 = 38;

/// Appends the binary form of an access command (or `DeleteVhost`); false for any other.
pub(super) fn encode(cmd: &Command, out: &mut Vec<u8>) -> bool {
    match cmd {
        Command::PutUser(u) => {
            out.push(TAG_PUT_USER);
            put_str(out, &u.name);
            put_str(out, &u.password_hash);
            put_varint(out, u.tags.len() as u64);
            for t in &u.tags {
                put_str(out, t);
            }
        }
        Command::DeleteUser { name } => {
            out.push(TAG_DELETE_USER);
            put_str(out, name);
        }
        Command::SetPermission(p) => {
            out.push(TAG_SET_PERMISSION);
            for s in [&p.user, &p.vhost, &p.configure, &p.write, &p.read] {
                put_str(out, s);
            }
        }
        Command::ClearPermission { user, vhost } => {
            out.push(TAG_CLEAR_PERMISSION);
            put_str(out, user);
            put_str(out, vhost);
        }
        Command::SetPolicy(p) => {
            out.push(TAG_SET_POLICY);
            put_str(out, &p.vhost);
            put_str(out, &p.name);
            put_str(out, &p.pattern);
            out.push(p.apply_to.code() | (p.operator as u8) << 7);
            // Zigzag, so small negative priorities stay short.
            put_varint(out, ((p.priority << 1) ^ (p.priority >> 63)) as u64);
            put_str(out, &p.definition);
        }
        Command::ClearPolicy { vhost, name, operator } => {
            out.push(TAG_CLEAR_POLICY);
            put_str(out, vhost);
            put_str(out, name);
            out.push(*operator as u8);
        }
        Command::DeleteVhost { name } => {
            out.push(TAG_DELETE_VHOST);
            put_str(out, name);
        }
        _ => return false,
    }
    true
}

/// The encoded size of a command (bytes): for the driver's entry-size bound.
pub(super) fn encoded_len(cmd: &Command) -> usize {
    let mut out = Vec::new();
    super::codec::encode_batch(1, [cmd], &mut out);
    out.len()
}

/// Decodes the fields of an access command whose tag byte was already read.
pub(super) fn decode(tag: u8, r: &mut Reader<'_>) -> Result<Command, DecodeError> {
    Ok(match tag {
        TAG_PUT_USER => {
            let (name, password_hash) = (r.string()?, r.string()?);
            let n = r.varint()?;
            if n > r.buf.len() as u64 {
                return Err(r.err("tag count larger than the entry"));
            }
            let tags = (0..n).map(|_| r.string()).collect::<Result<Vec<_>, _>>()?;
            Command::PutUser(UserDef { name, password_hash, tags })
        }
        TAG_DELETE_USER => Command::DeleteUser { name: r.string()? },
        TAG_SET_PERMISSION => Command::SetPermission(Permission {
            user: r.string()?,
            vhost: r.string()?,
            configure: r.string()?,
            write: r.string()?,
            read: r.string()?,
        }),
        TAG_CLEAR_PERMISSION => Command::ClearPermission { user: r.string()?, vhost: r.string()? },
        TAG_SET_POLICY => {
            let (vhost, name, pattern) = (r.string()?, r.string()?, r.string()?);
            let flags = r.u8()?;
            let apply_to = ApplyTo::from_code(flags & 0x7f).ok_or_else(|| r.err("unknown apply-to"))?;
            let z = r.varint()?;
            let priority = ((z >> 1) as i64) ^ -((z & 1) as i64);
            Command::SetPolicy(PolicyDef { vhost, name, pattern, apply_to, priority, definition: r.string()?, operator: flags & 0x80 != 0 })
        }
        TAG_CLEAR_POLICY => Command::ClearPolicy { vhost: r.string()?, name: r.string()?, operator: r.u8()? != 0 },
        TAG_DELETE_VHOST => Command::DeleteVhost { name: r.string()? },
        _ => return Err(r.err("unknown command tag")),
    })
}

// serde: tuple-keyed maps become lists of their values (JSON map keys must be strings).

mod keyed_permissions {
    use super::*;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(m: &BTreeMap<(String, String), Permission>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.values())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<(String, String), Permission>, D::Error> {
        Ok(Vec::<Permission>::deserialize(d)?.into_iter().map(|p| ((p.user.clone(), p.vhost.clone()), p)).collect())
    }
}

mod keyed_policies {
    use super::*;
    use serde::{Deserializer, Serializer};

    type ByKey = BTreeMap<(String, String, bool), PolicyDef>;

    pub fn serialize<S: Serializer>(m: &ByKey, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.values())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ByKey, D::Error> {
        Ok(Vec::<PolicyDef>::deserialize(d)?.into_iter().map(|p| ((p.vhost.clone(), p.name.clone(), p.operator), p)).collect())
    }
}
