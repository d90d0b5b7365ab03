//! `POST /api/definitions[/{vhost}]`: a definitions document (RabbitMQ's format) imported
//! in two steps, so an import applies whole or says exactly what it applied:
//!
//! 1. **Plan** ([`plan`], pure): every object of the document is read and checked against
//!    the topology as it is and the document itself. A malformed object (a field of the
//!    wrong type, a bad regex or policy value) refuses the import with 400 before anything
//!    is applied. What cannot be applied here is skipped with a warning, as RabbitMQ's
//!    import skips it: a binding whose source exchange or destination is neither in the
//!    broker nor in the document (an export's binding to a left-out exclusive queue, as a
//!    Celery worker's), an exclusive queue, an exchange of a type this broker has not, an
//!    object of a vhost that does not exist, a user whose password hash is of another
//!    algorithm, and a policy's keys this broker does not know (the policy is kept with
//!    the others, or skipped when none is left).
//! 2. **Apply** ([`Api::import`]): vhosts, users, permissions, policies, operator policies
//!    (before the queues they match), exchanges, queues and bindings, in that order, each
//!    through the broker's own declare and bind (an existing equivalent object is left as
//!    it is). 200 with `{"applied": {…}, "skipped": […]}`; a refusal while applying (an
//!    inequivalent existing queue, no quorum) stops there and answers its status with
//!    RabbitMQ's `{"error", "reason"}` and the same two lists: what was applied before it.
//!
//! Parts of a document this broker does not keep (topic permissions, parameters, global
//! parameters) are skipped with a warning; fields it does not read (vhost metadata and
//! limits, user limits, `rabbit_version`…) are ignored.

use serde_json::{json, Map, Value};

use super::json::{json_to_table, str_field};
use super::write::{exchange_declare_of, queue_declare_of};
use super::{Api, ApiError, Reply, Request};
use crate::broker::policy::{check_definition, EXCHANGE_KEYS, QUEUE_KEYS};
use crate::broker::topology::{self, binding, Caller, ExchangeDeclare, QueueDeclare};
use crate::meta::access::ApplyTo;
use crate::meta::state::{Binding, DestKind};
use crate::meta::{ExchangeKind, Topology, PREDECLARED_EXCHANGES};

/// The password hash this broker checks (RabbitMQ's default since 3.6).
const HASHING: &str = "rabbit_password_hashing_sha256";

/// A policy to set: (operator, vhost, name, its body with only the keys kept).
type PolicyPlan = (bool, String, String, Value);

/// What an import will apply, in order, and what it skips.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    vhosts: Vec<String>,
    /// (name, body as `PUT /api/users/{name}` takes it).
    users: Vec<(String, Value)>,
    /// (vhost, user, body).
    permissions: Vec<(String, String, Value)>,
    policies: Vec<PolicyPlan>,
    exchanges: Vec<ExchangeDeclare>,
    queues: Vec<QueueDeclare>,
    bindings: Vec<Binding>,
    /// Each skipped object (`kind`, what names it, `reason`).
    skipped: Vec<Value>,
}

impl Plan {
    fn skip(&mut self, kind: &str, mut what: Value, reason: String) {
        tracing::warn!(kind, object = %what, "definitions import: skipped: {reason}");
        if let Value::Object(m) = &mut what {
            m.insert("kind".into(), json!(kind));
            m.insert("reason".into(), json!(reason));
        }
        self.skipped.push(what);
    }

    fn has_vhost(&self, topo: &Topology, vhost: &str) -> bool {
        topo.vhosts.contains(vhost) || self.vhosts.iter().any(|v| v == vhost)
    }

    fn has_exchange(&self, topo: &Topology, vhost: &str, name: &str) -> bool {
        PREDECLARED_EXCHANGES.iter().any(|(n, _)| *n == name)
            || topo.exchange(vhost, name).is_some()
            || self.exchanges.iter().any(|x| x.vhost == vhost && x.name == name)
    }

    fn has_queue(&self, topo: &Topology, vhost: &str, name: &str) -> bool {
        topo.queue(vhost, name).is_some() || self.queues.iter().any(|q| q.vhost == vhost && q.name == name)
    }
}

/// The objects of `doc` under `key` (none when absent).
///
/// # Errors
/// 400 when `key` is not a list of objects.
fn objects<'a>(doc: &'a Value, key: &str) -> Result<Vec<&'a Value>, ApiError> {
    match doc.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) if list.iter().all(Value::is_object) => Ok(list.iter().collect()),
        Some(_) => Err(ApiError::bad_request(format!("definitions: {key} must be a list of objects"))),
    }
}

/// A required string field.
fn required<'a>(item: &'a Value, key: &str, what: &str) -> Result<&'a str, ApiError> {
    match str_field(item, key, "")? {
        "" => Err(ApiError::bad_request(format!("definitions: a {what} without {key}: {item}"))),
        s => Ok(s),
    }
}

/// Step 1: what importing `doc` into `topo` applies and skips (`scope`: the vhost of
/// `POST /api/definitions/{vhost}`, whose objects carry no vhost; its users, permissions
/// and policies are not read there). Pure.
///
/// # Errors
/// 400 naming the first malformed object; nothing is applied then.
pub(crate) fn plan(doc: &Value, scope: Option<&str>, topo: &Topology) -> Result<Plan, ApiError> {
    if !doc.is_object() {
        return Err(ApiError::bad_request("definitions must be a JSON object"));
    }
    let mut plan = Plan::default();
    let vhost_of = |item: &Value| -> Result<String, ApiError> {
        match scope {
            Some(v) => Ok(v.to_owned()),
            None => Ok(str_field(item, "vhost", "/")?.to_owned()),
        }
    };
    let kept = |key: &str| doc.get(key).and_then(Value::as_array).map_or(0, Vec::len);
    for key in ["topic_permissions", "parameters", "global_parameters"] {
        if kept(key) > 0 {
            plan.skip(key, json!({"count": kept(key)}), format!("{key} are not kept by this broker"));
        }
    }
    if scope.is_none() {
        for v in objects(doc, "vhosts")? {
            plan.vhosts.push(required(v, "name", "vhost")?.to_owned());
        }
        plan_access(doc, topo, &mut plan)?;
    }
    for x in objects(doc, "exchanges")? {
        let (vhost, name) = (vhost_of(x)?, str_field(x, "name", "")?);
        let what = json!({"vhost": vhost, "name": name});
        if name.is_empty() || name.starts_with("amq.") {
            plan.skip("exchange", what, "a predeclared exchange (every vhost has it)".into());
            continue;
        }
        let req = exchange_declare_of(x, &vhost, name)?;
        if !plan.has_vhost(topo, &vhost) {
            plan.skip("exchange", what, format!("vhost '{vhost}' does not exist"));
        } else if ExchangeKind::from_name(&req.kind).is_none() {
            plan.skip("exchange", what, format!("exchange type '{}' is not supported here", req.kind));
        } else {
            plan.exchanges.push(req);
        }
    }
    for q in objects(doc, "queues")? {
        let (vhost, name) = (vhost_of(q)?, required(q, "name", "queue")?);
        let what = json!({"vhost": vhost, "name": name});
        if super::json::bool_field(q, "exclusive", false)? {
            plan.skip("queue", what, "an exclusive queue belongs to a connection".into());
            continue;
        }
        let req = queue_declare_of(q, &vhost, name)?;
        if plan.has_vhost(topo, &vhost) {
            plan.queues.push(req);
        } else {
            plan.skip("queue", what, format!("vhost '{vhost}' does not exist"));
        }
    }
    for b in objects(doc, "bindings")? {
        let vhost = vhost_of(b)?;
        let (source, dest) = (str_field(b, "source", "")?, required(b, "destination", "binding")?);
        let exchange_dest = str_field(b, "destination_type", "queue")? == "exchange";
        let kind = if exchange_dest { DestKind::Exchange } else { DestKind::Queue };
        let routing_key = str_field(b, "routing_key", "")?;
        let what = json!({"vhost": vhost, "source": source, "destination": dest,
                          "destination_type": if exchange_dest { "exchange" } else { "queue" }, "routing_key": routing_key});
        let dest_exists = if exchange_dest { plan.has_exchange(topo, &vhost, dest) } else { plan.has_queue(topo, &vhost, dest) };
        let arguments = json_to_table(b.get("arguments"))?;
        if source.is_empty() {
            plan.skip("binding", what, "the default exchange's bindings are implicit".into());
        } else if !plan.has_vhost(topo, &vhost) {
            plan.skip("binding", what, format!("vhost '{vhost}' does not exist"));
        } else if !plan.has_exchange(topo, &vhost, source) {
            plan.skip("binding", what, format!("source exchange '{source}' does not exist"));
        } else if !dest_exists {
            let noun = if exchange_dest { "exchange" } else { "queue" };
            plan.skip("binding", what, format!("destination {noun} '{dest}' does not exist"));
        } else {
            plan.bindings.push(binding(&vhost, source, kind, dest, routing_key, &arguments));
        }
    }
    Ok(plan)
}

/// Step 1 for users, permissions, policies and operator policies.
fn plan_access(doc: &Value, topo: &Topology, plan: &mut Plan) -> Result<(), ApiError> {
    for u in objects(doc, "users")? {
        let name = required(u, "name", "user")?.to_owned();
        let alg = str_field(u, "hashing_algorithm", HASHING)?;
        if alg != HASHING {
            plan.skip("user", json!({"name": name}), format!("password hashing algorithm {alg} is not supported (only {HASHING})"));
            continue;
        }
        let mut body = u.clone();
        if body.get("password").is_none() && body.get("password_hash").is_none() {
            body["password_hash"] = json!("");
        }
        plan.users.push((name, body));
    }
    for p in objects(doc, "permissions")? {
        let (vhost, user) = (required(p, "vhost", "permission")?.to_owned(), required(p, "user", "permission")?.to_owned());
        for key in ["configure", "write", "read"] {
            str_field(p, key, "")?;
        }
        let what = json!({"vhost": vhost, "user": user});
        if !plan.has_vhost(topo, &vhost) {
            plan.skip("permission", what, format!("vhost '{vhost}' does not exist"));
        } else if !topo.access.users.contains_key(&user) && !plan.users.iter().any(|(n, _)| *n == user) {
            plan.skip("permission", what, format!("user '{user}' does not exist"));
        } else {
            plan.permissions.push((vhost, user, p.clone()));
        }
    }
    for (key, operator) in [("policies", false), ("operator_policies", true)] {
        for p in objects(doc, key)? {
            let (vhost, name) = (str_field(p, "vhost", "/")?.to_owned(), required(p, "name", "policy")?.to_owned());
            let kind = if operator { "operator_policy" } else { "policy" };
            crate::broker::access::check_regex(required(p, "pattern", "policy")?).map_err(|e| ApiError::bad_request(e.to_string()))?;
            let apply = str_field(p, "apply-to", "all")?;
            if ApplyTo::from_name(apply).is_none() {
                return Err(ApiError::bad_request(format!("policy '{name}': apply-to '{apply}' is not known")));
            }
            let Some(Value::Object(definition)) = p.get("definition") else {
                return Err(ApiError::bad_request(format!("policy '{name}': its definition must be an object")));
            };
            let known = |k: &str| QUEUE_KEYS.contains(&k) || (!operator && EXCHANGE_KEYS.contains(&k));
            let (kept, dropped): (Map<String, Value>, Map<String, Value>) =
                definition.clone().into_iter().partition(|(k, _)| known(k.as_str()));
            let what = json!({"vhost": vhost, "name": name});
            if !dropped.is_empty() {
                let keys: Vec<&String> = dropped.keys().collect();
                let mut w = what.clone();
                w["keys"] = json!(keys);
                plan.skip(&format!("{kind} keys"), w, "keys this broker does not apply".into());
            }
            if !plan.has_vhost(topo, &vhost) {
                plan.skip(kind, what, format!("vhost '{vhost}' does not exist"));
                continue;
            }
            if kept.is_empty() {
                plan.skip(kind, what, "none of its keys applies here".into());
                continue;
            }
            let kept = Value::Object(kept);
            check_definition(&kept, operator).map_err(|e| ApiError::bad_request(format!("policy '{name}': {e}")))?;
            let mut body = p.clone();
            body["definition"] = kept;
            plan.policies.push((operator, vhost, name, body));
        }
    }
    Ok(())
}

/// What an import applied so far, in RabbitMQ's names.
#[derive(Default)]
struct Applied {
    vhosts: Vec<Value>,
    users: Vec<Value>,
    permissions: Vec<Value>,
    policies: Vec<Value>,
    operator_policies: Vec<Value>,
    exchanges: Vec<Value>,
    queues: Vec<Value>,
    bindings: Vec<Value>,
}

impl Applied {
    fn json(self) -> Value {
        json!({"vhosts": self.vhosts, "users": self.users, "permissions": self.permissions, "policies": self.policies,
               "operator_policies": self.operator_policies, "exchanges": self.exchanges, "queues": self.queues, "bindings": self.bindings})
    }
}

impl Api {
    /// `POST /api/definitions[/{vhost}]`: the module's two steps. 200 with what was applied
    /// and skipped; 400 for a malformed document (nothing applied); a refusal while
    /// applying answers its own status with what was applied before it.
    pub(crate) fn import(&self, rq: &Request<'_>, vhost: Option<&str>) -> Result<Reply, ApiError> {
        let doc = rq.json()?;
        if let Some(v) = vhost {
            self.check_vhost(v)?;
        }
        let plan = plan(&doc, vhost, &self.shared.meta.topology())?;
        let skipped = plan.skipped.clone();
        let mut applied = Applied::default();
        match self.apply(plan, &mut applied) {
            Ok(()) => Ok(Reply::ok(json!({"applied": applied.json(), "skipped": skipped}))),
            Err(e) => {
                tracing::warn!(reason = %e.reason, "definitions import stopped part way");
                let body = json!({"error": e.error, "reason": e.reason, "applied": applied.json(), "skipped": skipped});
                Ok(Reply::with(e.status, body))
            }
        }
    }

    /// Step 2: applies `plan` in order, recording each object in `applied` once it is in.
    fn apply(&self, plan: Plan, applied: &mut Applied) -> Result<(), ApiError> {
        for v in plan.vhosts {
            self.declare_vhost(v.clone())?;
            applied.vhosts.push(json!({"name": v}));
        }
        for (name, body) in plan.users {
            self.user_write("PUT", &body, &name)?;
            applied.users.push(json!({"name": name}));
        }
        for (vhost, user, body) in plan.permissions {
            self.permission_write("PUT", &body, &vhost, &user)?;
            applied.permissions.push(json!({"vhost": vhost, "user": user}));
        }
        for (operator, vhost, name, body) in plan.policies {
            self.put_policy(operator, &vhost, &name, &body)?;
            let list = if operator { &mut applied.operator_policies } else { &mut applied.policies };
            list.push(json!({"vhost": vhost, "name": name}));
        }
        for req in plan.exchanges {
            let what = json!({"vhost": req.vhost, "name": req.name});
            self.on_core(move |node| async move { topology::exchange_declare(&node, req, false).await })??;
            applied.exchanges.push(what);
        }
        for req in plan.queues {
            let what = json!({"vhost": req.vhost, "name": req.name});
            self.on_core(move |node| async move { topology::queue_declare(&node, req).await })??;
            applied.queues.push(what);
        }
        for b in plan.bindings {
            let what = json!({"vhost": b.vhost, "source": b.source, "destination": b.dest,
                              "destination_type": if b.dest_kind == DestKind::Queue { "queue" } else { "exchange" }, "routing_key": b.routing_key});
            self.on_core(move |node| async move { topology::bind(&node, b, Caller::Operator).await })??;
            applied.bindings.push(what);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo() -> Topology {
        let mut t = Topology::default();
        t.vhosts.insert("/".into());
        t
    }

    #[test]
    fn a_binding_to_an_absent_queue_is_skipped_and_the_rest_planned() {
        let doc = json!({
            "queues": [{"name": "jobs", "vhost": "/", "durable": true, "arguments": {}},
                       {"name": "reply.1", "vhost": "/", "exclusive": true}],
            "exchanges": [{"name": "work", "vhost": "/", "type": "topic"}, {"name": "delayed", "vhost": "/", "type": "x-delayed-message"}],
            "bindings": [
                {"source": "work", "vhost": "/", "destination": "jobs", "destination_type": "queue", "routing_key": "a"},
                {"source": "work", "vhost": "/", "destination": "celery@host.pidbox", "destination_type": "queue", "routing_key": ""},
                {"source": "amq.direct", "vhost": "/", "destination": "jobs", "destination_type": "queue", "routing_key": "b"},
                {"source": "delayed", "vhost": "/", "destination": "jobs", "destination_type": "queue", "routing_key": "c"},
                {"source": "work", "vhost": "/", "destination": "reply.1", "destination_type": "queue", "routing_key": "d"}
            ],
            "parameters": [{"name": "x"}]
        });
        let p = plan(&doc, None, &topo()).unwrap();
        assert_eq!(p.queues.iter().map(|q| q.name.as_str()).collect::<Vec<_>>(), ["jobs"]);
        assert_eq!(p.exchanges.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(), ["work"]);
        assert_eq!(p.bindings.iter().map(|b| b.routing_key.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        let reasons: Vec<&str> = p.skipped.iter().filter_map(|s| s["reason"].as_str()).collect();
        assert_eq!(p.skipped.len(), 6, "{reasons:?}");
        assert!(reasons.contains(&"destination queue 'celery@host.pidbox' does not exist"), "{reasons:?}");
        assert!(reasons.contains(&"source exchange 'delayed' does not exist"), "{reasons:?}");
    }

    #[test]
    fn a_malformed_object_refuses_the_whole_import() {
        for doc in [
            json!({"queues": [{"name": "a"}, {"name": 3}]}),
            json!({"queues": [{"name": "a", "durable": "maybe"}]}),
            json!({"bindings": [{"source": "x"}]}),
            json!({"policies": [{"name": "p", "pattern": "(", "definition": {"max-length": 1}}]}),
            json!({"queues": {"name": "a"}}),
            json!([1, 2]),
        ] {
            assert_eq!(plan(&doc, None, &topo()).map(|_| ()).unwrap_err().status, 400, "{doc}");
        }
    }

    #[test]
    fn rabbitmq_fields_and_policy_keys_this_broker_ignores_do_not_fail_an_import() {
        let doc = json!({
            "rabbit_version": "3.13.7", "rabbitmq_version": "3.13.7", "product_name": "RabbitMQ",
            "vhosts": [{"name": "prod", "limits": [], "metadata": {"description": "d", "tags": ["t"]}, "default_queue_type": "quorum"}],
            "users": [{"name": "a", "password_hash": "x", "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ["administrator"], "limits": {}},
                      {"name": "b", "password_hash": "x", "hashing_algorithm": "rabbit_password_hashing_sha512", "tags": []}],
            "permissions": [{"user": "a", "vhost": "prod", "configure": ".*", "write": ".*", "read": ".*"},
                            {"user": "b", "vhost": "prod", "configure": ".*", "write": ".*", "read": ".*"}],
            "policies": [{"vhost": "prod", "name": "ha", "pattern": ".*", "apply-to": "queues", "priority": 0,
                          "definition": {"ha-mode": "all", "ha-sync-mode": "automatic", "max-length": 10}},
                         {"vhost": "prod", "name": "lazy", "pattern": ".*", "apply-to": "queues", "definition": {"queue-mode": "lazy"}}],
            "global_parameters": [{"name": "cluster_name", "value": "rabbit@x"}],
            "topic_permissions": []
        });
        let p = plan(&doc, None, &topo()).unwrap();
        assert_eq!(p.vhosts, ["prod"]);
        assert_eq!(p.users.len(), 1);
        assert_eq!(p.permissions.len(), 1, "b's permission goes with b");
        assert_eq!(p.policies.len(), 1);
        assert_eq!(p.policies[0].3["definition"], json!({"max-length": 10}));
    }
}
