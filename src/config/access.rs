//! The TOML seeds of users, vhosts, permissions and policies (`[[users]]`, `vhosts`,
//! `[[permissions]]`, `[[policies]]`, `[[operator_policies]]`): written into a fresh data
//! directory's metadata at first boot (`main.rs`), ignored afterwards (the metadata is then
//! changed at run time through `broker::access` and `broker::policy`).
//!
//! Checked at load: user names unique, each user with a password or a hash but not both,
//! permissions and policies naming configured users and vhosts, regular expressions that
//! compile, `apply_to` one of RabbitMQ's names.

use serde::Deserialize;

use super::ConfigError;

/// A user allowed to log in (`[[users]]`).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct User {
    /// User name.
    pub name: String,
    /// Password in clear (PLAIN / AMQPLAIN); hashed before it is stored.
    #[serde(default)]
    pub password: Option<String>,
    /// Password hash in RabbitMQ's `rabbit_password_hashing_sha256` form (base64 of salt ‖
    /// SHA-256(salt ‖ password)), as a definitions export has it; instead of `password`.
    #[serde(default)]
    pub password_hash: Option<String>,
    /// Tags (`administrator`, `monitoring`, `management`, …): a list, or one text with the
    /// tags separated by commas (`"administrator,monitoring"`, as RabbitMQ's definitions
    /// files have them).
    #[serde(default, deserialize_with = "tag_list")]
    pub tags: Vec<String>,
    /// Only from loopback addresses (RabbitMQ's loopback_users; true for guest).
    #[serde(default)]
    pub loopback_only: bool,
}

/// `tags` as a list or as one comma-separated text (empty entries dropped).
///
/// # Errors
/// A value that is neither.
fn tag_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Tags {
        List(Vec<String>),
        Text(String),
    }
    Ok(match Tags::deserialize(d)? {
        Tags::List(l) => l,
        Tags::Text(t) => t.split(',').map(str::trim).filter(|t| !t.is_empty()).map(str::to_string).collect(),
    })
}

/// A user's permissions in a vhost (`[[permissions]]`; RabbitMQ's `set_permissions`).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PermissionSeed {
    /// User name (a configured user).
    pub user: String,
    /// Vhost (a configured vhost; default `/`).
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// Configure regex.
    pub configure: String,
    /// Write regex.
    pub write: String,
    /// Read regex.
    pub read: String,
}

/// A policy (`[[policies]]`) or operator policy (`[[operator_policies]]`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PolicySeed {
    /// Vhost (default `/`).
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// Policy name.
    pub name: String,
    /// Regex matched against queue and exchange names.
    pub pattern: String,
    /// `all` (default), `queues`, `exchanges`, `classic_queues`, `quorum_queues`.
    #[serde(default = "default_apply_to")]
    pub apply_to: String,
    /// Priority (default 0).
    #[serde(default)]
    pub priority: i64,
    /// Definition: a TOML table (`definition = { max-length = 2 }`).
    pub definition: toml::Table,
}

fn default_vhost() -> String {
    "/".into()
}

fn default_apply_to() -> String {
    "all".into()
}

/// The apply-to names a policy may give.
pub const APPLY_TO_NAMES: [&str; 5] = ["all", "queues", "exchanges", "classic_queues", "quorum_queues"];

impl PolicySeed {
    /// The definition as a compact JSON object (keys sorted).
    pub fn definition_json(&self) -> String {
        serde_json::to_string(&self.definition).unwrap_or_else(|_| "{}".into())
    }
}

/// The default users when the file names none: guest/guest, loopback only, administrator.
pub fn default_users() -> Vec<User> {
    vec![User {
        name: "guest".into(),
        password: Some("guest".into()),
        password_hash: None,
        tags: vec!["administrator".into()],
        loopback_only: true,
    }]
}

/// Checks the seeds against each other (the module doc's list).
pub fn check(
    users: &[User],
    vhosts: &[String],
    permissions: Option<&[PermissionSeed]>,
    policies: &[&PolicySeed],
) -> Result<(), ConfigError> {
    let invalid = |m: String| Err(ConfigError::Invalid(m));
    let mut seen = std::collections::BTreeSet::new();
    for u in users {
        if !seen.insert(u.name.as_str()) {
            return invalid(format!("user {:?} is configured twice: user names must be unique", u.name));
        }
        if u.password.is_some() && u.password_hash.is_some() {
            return invalid(format!("user {:?} has both password and password_hash: give one", u.name));
        }
    }
    let regex = |what: &str, re: &str| match regex::Regex::new(re) {
        Ok(_) => Ok(()),
        Err(e) => Err(ConfigError::Invalid(format!("{what}: bad regular expression {re:?}: {e}"))),
    };
    for p in permissions.unwrap_or_default() {
        if !seen.contains(p.user.as_str()) {
            return invalid(format!("permissions for {:?}: no such user in the configuration", p.user));
        }
        if !vhosts.contains(&p.vhost) {
            return invalid(format!("permissions for {:?} in vhost {:?}: no such vhost in the configuration", p.user, p.vhost));
        }
        for re in [&p.configure, &p.write, &p.read] {
            regex(&format!("permissions for {:?}", p.user), re)?;
        }
    }
    for p in policies {
        if !vhosts.contains(&p.vhost) {
            return invalid(format!("policy {:?} in vhost {:?}: no such vhost in the configuration", p.name, p.vhost));
        }
        if !APPLY_TO_NAMES.contains(&p.apply_to.as_str()) {
            return invalid(format!("policy {:?}: apply_to must be one of {APPLY_TO_NAMES:?}, got {:?}", p.name, p.apply_to));
        }
        regex(&format!("policy {:?}", p.name), &p.pattern)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::tests::{load, refused};

    #[test]
    fn tags_as_a_list_or_as_rabbitmqs_comma_separated_text() {
        let c = load(&[], "[[users]]\nname = \"a\"\npassword = \"x\"\ntags = \"administrator, monitoring\"\n").unwrap();
        assert_eq!(c.users[0].tags, ["administrator", "monitoring"]);
        let c = load(&[], "[[users]]\nname = \"a\"\npassword = \"x\"\ntags = \"administrator\"\n").unwrap();
        assert_eq!(c.users[0].tags, ["administrator"]);
        let c = load(&[], "[[users]]\nname = \"a\"\npassword = \"x\"\ntags = [\"monitoring\"]\n").unwrap();
        assert_eq!(c.users[0].tags, ["monitoring"]);
    }

    #[test]
    fn duplicate_user_names_are_refused() {
        let m = refused(&[], "[[users]]\nname = \"a\"\npassword = \"x\"\n[[users]]\nname = \"a\"\npassword = \"y\"\n");
        assert!(m.contains("\"a\" is configured twice"), "{m}");
    }

    #[test]
    fn seeds_parse_and_are_checked() {
        let file = r#"
vhosts = ["/", "v"]
[[users]]
name = "app"
password = "pw"
tags = ["monitoring"]
[[permissions]]
user = "app"
vhost = "v"
configure = "^app\\."
write = ".*"
read = ""
[[policies]]
name = "lim"
pattern = "^lim\\."
apply_to = "queues"
priority = 3
definition = { max-length = 2, overflow = "reject-publish" }
[[operator_policies]]
name = "cap"
pattern = ".*"
definition = { max-length = 10 }
"#;
        let c = load(&[], file).unwrap();
        assert_eq!(c.users[0].tags, ["monitoring"]);
        assert_eq!(c.permissions.as_ref().unwrap()[0].configure, "^app\\.");
        assert_eq!(c.policies[0].definition_json(), r#"{"max-length":2,"overflow":"reject-publish"}"#);
        assert_eq!((c.policies[0].vhost.as_str(), c.operator_policies[0].apply_to.as_str()), ("/", "all"));
        let m = refused(
            &[],
            "[[users]]\nname = \"a\"\npassword = \"x\"\n[[permissions]]\nuser = \"b\"\nconfigure = \"\"\nwrite = \"\"\nread = \"\"\n",
        );
        assert!(m.contains("no such user"), "{m}");
        let m = refused(&[], "[[policies]]\nname = \"p\"\npattern = \"(\"\ndefinition = {}\n");
        assert!(m.contains("bad regular expression"), "{m}");
        let m = refused(&[], "[[policies]]\nname = \"p\"\npattern = \"a\"\napply_to = \"queue\"\ndefinition = {}\n");
        assert!(m.contains("apply_to"), "{m}");
    }

    #[test]
    fn the_default_user_is_guest_on_loopback() {
        let c = load(&[], "").unwrap();
        assert_eq!(c.users.len(), 1);
        assert!(c.users[0].loopback_only && c.users[0].password.as_deref() == Some("guest"));
        assert!(c.permissions.is_none());
    }
}
