//! Users, permissions, vhost deletion, policies and operator policies over the management
//! API, in RabbitMQ's shapes, through `broker::access` and `broker::policy` (the metadata
//! group: durable, replicated, seen by every node's next login and permission check).
//!
//! - `GET /api/users`, `GET|PUT|DELETE /api/users/{name}` (PUT: `password` or
//!   `password_hash` — RabbitMQ's salted SHA-256 — and `tags` as a comma-separated string or
//!   a list; 201 created, 204 changed), `GET /api/users/{name}/permissions`;
//! - `GET /api/permissions`, `GET /api/vhosts/{vhost}/permissions`,
//!   `GET|PUT|DELETE /api/permissions/{vhost}/{user}` (`configure`, `write`, `read`);
//! - `DELETE /api/vhosts/{vhost}`: its queues are deleted as queue.delete does (consumers
//!   cancelled, stores removed), then the vhost with its exchanges, bindings, permissions
//!   and policies;
//! - `GET|PUT /api/cluster-name` (`{"name": …}`): the cluster's one name
//!   (`broker::cluster_name`);
//! - `GET /api/policies[/{vhost}[/{name}]]`, `PUT|DELETE /api/policies/{vhost}/{name}`
//!   (`pattern`, `definition`, `priority`, `apply-to`), and the same under
//!   `/api/operator-policies`.

use serde_json::{json, Value};

use super::{Api, ApiError, Reply, Request};
use crate::broker::access::{self, AccessError, Password};
use crate::broker::policy::{self, PolicySpec};
use crate::broker::topology::{self, Caller};
use crate::meta::access::{ApplyTo, Permission, PolicyDef, UserDef};

/// The hashing algorithm RabbitMQ names for the hashes this broker stores.
const HASHING: &str = "rabbit_password_hashing_sha256";

impl From<AccessError> for ApiError {
    /// 404 for a missing user, vhost, permission or policy; 400 for a bad argument or a
    /// duplicate; 403 for a refusal; 503 when the metadata has no quorum or disk; else 500.
    fn from(e: AccessError) -> ApiError {
        match e {
            AccessError::NotFound(_) => ApiError::not_found(),
            AccessError::Invalid(r) => ApiError::bad_request(r),
            AccessError::AlreadyExists(_) => ApiError::bad_request(e.to_string()),
            AccessError::Meta(m) => topology::meta_error(m).into(),
            other => ApiError { status: 403, error: "access_refused", reason: other.to_string() },
        }
    }
}

/// A user in RabbitMQ's shape.
pub(crate) fn user_json(u: &UserDef) -> Value {
    json!({"name": u.name, "password_hash": u.password_hash, "hashing_algorithm": HASHING, "tags": u.tags, "limits": {}})
}

/// A permission in RabbitMQ's shape.
pub(crate) fn permission_json(p: &Permission) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read})
}

/// A policy in RabbitMQ's shape (the definition as a JSON object).
pub(crate) fn policy_json(p: &PolicyDef) -> Value {
    let definition: Value = serde_json::from_str(&p.definition).unwrap_or_else(|_| json!({}));
    json!({"vhost": p.vhost, "name": p.name, "pattern": p.pattern, "apply-to": p.apply_to.as_str(), "definition": definition, "priority": p.priority})
}

/// Tags as RabbitMQ's API takes them: `"a,b"` or `["a", "b"]`; absent: none.
fn tags_of(body: &Value) -> Result<Vec<String>, ApiError> {
    match body.get("tags") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(s.split(',').map(str::trim).filter(|t| !t.is_empty()).map(str::to_owned).collect()),
        Some(Value::Array(a)) => {
            a.iter().map(|t| t.as_str().map(str::to_owned).ok_or_else(|| ApiError::bad_request("tags must be strings"))).collect()
        }
        Some(_) => Err(ApiError::bad_request("tags must be a string or a list")),
    }
}

fn string_of<'a>(body: &'a Value, key: &str) -> Result<&'a str, ApiError> {
    body.get(key).and_then(Value::as_str).ok_or_else(|| ApiError::bad_request(format!("{key} is required (a string)")))
}

impl Api {
    /// `GET /api/cluster-name`: `{"name": …}`, the one name of the whole cluster.
    pub(crate) fn cluster_name(&self) -> Reply {
        Reply::ok(json!({"name": crate::broker::cluster_name::identity(&self.shared.meta.topology()).name}))
    }

    /// `PUT /api/cluster-name` with `{"name": …}` (RabbitMQ's `set_cluster_name`): renames
    /// the cluster on every node; 204. 400 for a missing or refused name
    /// (`broker::cluster_name::check_name`).
    pub(crate) fn cluster_name_write(&self, rq: &Request<'_>) -> Result<Reply, ApiError> {
        let name = string_of(&rq.json()?, "name")?.to_owned();
        crate::broker::cluster_name::check_name(&name)?;
        self.on_core(move |node| async move { crate::broker::cluster_name::set(&node.shared.meta, &name).await })??;
        Ok(Reply::empty(204))
    }

    /// `GET /api/users[/{name}]`.
    pub(crate) fn list_users(&self, name: Option<&str>) -> Result<Reply, ApiError> {
        let meta = &self.shared.meta;
        match name {
            None => Ok(Reply::ok(Value::Array(access::users(meta).iter().map(user_json).collect()))),
            Some(n) => access::user(meta, n).map(|u| Reply::ok(user_json(&u))).ok_or_else(ApiError::not_found),
        }
    }

    /// `PUT` / `DELETE /api/users/{name}`.
    pub(crate) fn user_write(&self, method: &str, body: &Value, name: &str) -> Result<Reply, ApiError> {
        let name = name.to_owned();
        if method == "DELETE" {
            self.on_core(move |node| async move { access::delete_user(&node.shared.meta, &name).await })??;
            return Ok(Reply::empty(204));
        }
        if method != "PUT" {
            return Err(ApiError::method_not_allowed());
        }
        let tags = tags_of(body)?;
        if let Some(alg) = body.get("hashing_algorithm").and_then(Value::as_str) {
            if alg != HASHING {
                return Err(ApiError::bad_request(format!("hashing_algorithm {alg} is not supported (only {HASHING})")));
            }
        }
        let password = match (body.get("password").and_then(Value::as_str), body.get("password_hash").and_then(Value::as_str)) {
            (Some(p), _) => Some(Password::Clear(p.to_owned())),
            (None, Some("")) => Some(Password::None),
            (None, Some(h)) => Some(Password::Hash(h.to_owned())),
            (None, None) => None,
        };
        let created = match password {
            Some(p) => self.on_core(move |node| async move { access::put_user(&node.shared.meta, &name, p, tags).await })??,
            None => {
                // RabbitMQ: a new user needs one of them; an existing one keeps its password.
                if access::user(&self.shared.meta, &name).is_none() {
                    return Err(ApiError::bad_request("password or password_hash must be set"));
                }
                self.on_core(move |node| async move { access::set_user_tags(&node.shared.meta, &name, tags).await })??;
                false
            }
        };
        Ok(Reply::empty(if created { 201 } else { 204 }))
    }

    /// `GET /api/permissions`, `/api/users/{user}/permissions`, `/api/vhosts/{vhost}/permissions`
    /// and `/api/permissions/{vhost}/{user}` (one: 404 when there is none).
    pub(crate) fn permissions(&self, vhost: Option<&str>, user: Option<&str>) -> Result<Reply, ApiError> {
        if let Some(u) = user {
            if access::user(&self.shared.meta, u).is_none() {
                return Err(ApiError::not_found());
            }
        }
        if let Some(v) = vhost {
            self.check_vhost(v)?;
        }
        let all = access::permissions(&self.shared.meta);
        let list: Vec<Value> =
            all.iter().filter(|p| vhost.is_none_or(|v| p.vhost == v) && user.is_none_or(|u| p.user == u)).map(permission_json).collect();
        if let (Some(_), Some(_)) = (vhost, user) {
            return list.into_iter().next().map(Reply::ok).ok_or_else(ApiError::not_found);
        }
        Ok(Reply::ok(Value::Array(list)))
    }

    /// `PUT` / `DELETE /api/permissions/{vhost}/{user}`.
    pub(crate) fn permission_write(&self, method: &str, body: &Value, vhost: &str, user: &str) -> Result<Reply, ApiError> {
        self.check_vhost(vhost)?;
        if access::user(&self.shared.meta, user).is_none() {
            return Err(ApiError::bad_request(format!("user '{user}' does not exist")));
        }
        let (vhost, user) = (vhost.to_owned(), user.to_owned());
        match method {
            "PUT" => {
                let existed = access::permissions(&self.shared.meta).iter().any(|p| p.vhost == vhost && p.user == user);
                let c = string_of(body, "configure")?.to_owned();
                let w = string_of(body, "write")?.to_owned();
                let r = string_of(body, "read")?.to_owned();
                self.on_core(move |node| async move { access::set_permissions(&node.shared.meta, &user, &vhost, &c, &w, &r).await })??;
                Ok(Reply::empty(if existed { 204 } else { 201 }))
            }
            "DELETE" => {
                self.on_core(move |node| async move { access::clear_permissions(&node.shared.meta, &user, &vhost).await })??;
                Ok(Reply::empty(204))
            }
            _ => Err(ApiError::method_not_allowed()),
        }
    }

    /// `DELETE /api/vhosts/{vhost}`: its queues first (as queue.delete: consumers cancelled,
    /// stores removed), then the vhost and everything else in it.
    pub(crate) fn vhost_delete(&self, vhost: &str) -> Result<Reply, ApiError> {
        self.check_vhost(vhost)?;
        let queues: Vec<String> =
            self.shared.meta.topology().queues.values().filter(|q| q.vhost == vhost).map(|q| q.name.clone()).collect();
        for name in queues {
            let v = vhost.to_owned();
            self.on_core(move |node| async move { topology::queue_delete(&node, &v, &name, Caller::Operator, false, false).await })??;
        }
        let v = vhost.to_owned();
        self.on_core(move |node| async move { access::delete_vhost(&node.shared.meta, &v).await })??;
        Ok(Reply::empty(204))
    }

    /// `GET /api/policies[/{vhost}[/{name}]]` (or `/api/operator-policies…`).
    pub(crate) fn policies(&self, operator: bool, vhost: Option<&str>, name: Option<&str>) -> Result<Reply, ApiError> {
        if let Some(v) = vhost {
            self.check_vhost(v)?;
        }
        let all = if operator { policy::operator_policies(&self.shared.meta) } else { policy::policies(&self.shared.meta) };
        let list: Vec<Value> =
            all.iter().filter(|p| vhost.is_none_or(|v| p.vhost == v) && name.is_none_or(|n| p.name == n)).map(policy_json).collect();
        if name.is_some() {
            return list.into_iter().next().map(Reply::ok).ok_or_else(ApiError::not_found);
        }
        Ok(Reply::ok(Value::Array(list)))
    }

    /// `PUT` / `DELETE /api/policies/{vhost}/{name}` (or `/api/operator-policies/…`).
    pub(crate) fn policy_write(&self, rq: &Request<'_>, operator: bool, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        self.check_vhost(vhost)?;
        let (v, n) = (vhost.to_owned(), name.to_owned());
        match rq.method {
            "PUT" => {
                let body = rq.json()?;
                let meta = &self.shared.meta;
                let all = if operator { policy::operator_policies(meta) } else { policy::policies(meta) };
                let existed = all.iter().any(|p| p.vhost == vhost && p.name == name);
                self.put_policy(operator, &v, &n, &body)?;
                Ok(Reply::empty(if existed { 204 } else { 201 }))
            }
            "DELETE" => {
                self.on_core(move |node| async move {
                    let meta = &node.shared.meta;
                    if operator {
                        policy::clear_operator_policy(meta, &v, &n).await
                    } else {
                        policy::clear_policy(meta, &v, &n).await
                    }
                })??;
                Ok(Reply::empty(204))
            }
            _ => Err(ApiError::method_not_allowed()),
        }
    }

    /// Sets a policy from RabbitMQ's body (`pattern`, `definition`, `priority`, `apply-to`).
    pub(crate) fn put_policy(&self, operator: bool, vhost: &str, name: &str, body: &Value) -> Result<(), ApiError> {
        let pattern = string_of(body, "pattern")?.to_owned();
        let definition = body.get("definition").cloned().ok_or_else(|| ApiError::bad_request("definition is required"))?;
        let priority = body.get("priority").and_then(Value::as_i64).unwrap_or(0);
        let apply = body.get("apply-to").and_then(Value::as_str).unwrap_or(if operator { "queues" } else { "all" });
        let apply_to = ApplyTo::from_name(apply).ok_or_else(|| {
            ApiError::bad_request(format!("apply-to '{apply}' is not one of all, queues, exchanges, classic_queues, quorum_queues"))
        })?;
        let (v, n) = (vhost.to_owned(), name.to_owned());
        self.on_core(move |node| async move {
            let spec = PolicySpec { vhost: &v, name: &n, pattern: &pattern, apply_to, priority, definition: &definition };
            if operator {
                policy::set_operator_policy(&node.shared.meta, &spec).await
            } else {
                policy::set_policy(&node.shared.meta, &spec).await
            }
        })??;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_come_as_a_string_or_a_list() {
        assert_eq!(tags_of(&json!({"tags": "administrator, monitoring"})).unwrap(), ["administrator", "monitoring"]);
        assert_eq!(tags_of(&json!({"tags": ["management"]})).unwrap(), ["management"]);
        assert_eq!(tags_of(&json!({"tags": ""})).unwrap(), Vec::<String>::new());
        assert_eq!(tags_of(&json!({})).unwrap(), Vec::<String>::new());
        assert_eq!(tags_of(&json!({"tags": 3})).unwrap_err().status, 400);
    }

    #[test]
    fn a_policy_reads_back_in_rabbitmqs_shape() {
        let p = PolicyDef {
            vhost: "/".into(),
            name: "lim".into(),
            pattern: "^lim\\.".into(),
            apply_to: ApplyTo::Queues,
            priority: 3,
            definition: r#"{"max-length":2}"#.into(),
            operator: false,
        };
        assert_eq!(
            policy_json(&p),
            json!({"vhost": "/", "name": "lim", "pattern": "^lim\\.", "apply-to": "queues", "definition": {"max-length": 2}, "priority": 3})
        );
    }
}
