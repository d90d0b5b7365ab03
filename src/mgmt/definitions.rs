//! `GET`/`POST /api/definitions[/{vhost}]`: the topology in RabbitMQ's definitions format
//! (vhosts, queues, exchanges, bindings), so a RabbitMQ export imports here and ours there.
//!
//! Users (with RabbitMQ's password hashes, so an export logs in elsewhere), permissions,
//! policies and operator policies are exported and imported too, through `broker::access`
//! and `broker::policy`; parameters (federation, shovels) are not kept and are skipped with
//! a warning.
//!
//! Exclusive queues (a connection's) and the predeclared exchanges (`""`, `amq.*`) are left
//! out, as RabbitMQ does.

use serde_json::{json, Value};

use super::json::{json_to_table, str_field, table_to_json};
use super::write::{exchange_declare_of, queue_declare_of};
use super::{Api, ApiError, Reply, Request, RABBITMQ_COMPAT_VERSION};
use crate::broker::topology::{self, binding, Caller};
use crate::meta::state::DestKind;

impl Api {
    /// `GET /api/definitions[/{vhost}]`.
    pub(crate) fn definitions(&self, vhost: Option<&str>) -> Result<Reply, ApiError> {
        if let Some(v) = vhost {
            self.check_vhost(v)?;
        }
        let topo = self.shared.meta.topology();
        let here = |v: &String| vhost.is_none_or(|o| o == v.as_str());
        let queues: Vec<Value> = topo
            .queues
            .values()
            .filter(|q| here(&q.vhost) && q.exclusive_owner.is_none())
            .map(|q| {
                json!({"name": q.name, "vhost": q.vhost, "durable": q.durable, "auto_delete": q.auto_delete, "arguments": table_to_json(&q.arguments)})
            })
            .collect();
        let exchanges: Vec<Value> = topo
            .exchanges
            .values()
            .filter(|x| here(&x.vhost) && !x.name.is_empty() && !x.name.starts_with("amq."))
            .map(|x| {
                json!({"name": x.name, "vhost": x.vhost, "type": x.kind.as_str(), "durable": x.durable,
                       "auto_delete": x.auto_delete, "internal": x.internal, "arguments": table_to_json(&x.arguments)})
            })
            .collect();
        let bindings: Vec<Value> = topo
            .all_bindings()
            .filter(|b| here(&b.vhost))
            .map(|b| {
                json!({"source": b.source, "vhost": b.vhost, "destination": b.dest,
                       "destination_type": if b.dest_kind == DestKind::Queue { "queue" } else { "exchange" },
                       "routing_key": b.routing_key, "arguments": table_to_json(&b.arguments)})
            })
            .collect();
        let strip_vhost = |mut list: Vec<Value>| {
            if vhost.is_some() {
                for v in &mut list {
                    if let Value::Object(m) = v {
                        m.remove("vhost");
                    }
                }
            }
            list
        };
        let mut out = json!({
            "rabbit_version": RABBITMQ_COMPAT_VERSION,
            "rabbitmq_version": RABBITMQ_COMPAT_VERSION,
            "product_name": "ringmq",
            "product_version": env!("CARGO_PKG_VERSION"),
            "queues": strip_vhost(queues),
            "exchanges": strip_vhost(exchanges),
            "bindings": strip_vhost(bindings),
            "policies": policies(&crate::broker::policy::policies(&self.shared.meta)),
            "parameters": [],
        });
        if vhost.is_none() {
            if let Value::Object(m) = &mut out {
                m.insert("users".into(), self.users_json());
                let vhosts: Vec<Value> =
                    topo.vhosts.iter().map(|v| json!({"name": v, "limits": [], "metadata": {"description": "", "tags": []}})).collect();
                m.insert("vhosts".into(), Value::Array(vhosts));
                let perms = crate::broker::access::permissions(&self.shared.meta);
                m.insert("permissions".into(), Value::Array(perms.iter().map(super::access::permission_json).collect()));
                m.insert("operator_policies".into(), policies(&crate::broker::policy::operator_policies(&self.shared.meta)));
                m.insert("topic_permissions".into(), json!([]));
                m.insert("global_parameters".into(), json!([]));
            }
        }
        Ok(Reply::ok(out))
    }

    /// `POST /api/definitions[/{vhost}]`: declares the vhosts, exchanges, queues and bindings
    /// of a definitions document, in that order, through the broker's own declare and bind
    /// (an existing equivalent object is left as it is). Stops at the first refusal (400
    /// with its reason); 204 when all went in.
    pub(crate) fn import(&self, rq: &Request<'_>, vhost: Option<&str>) -> Result<Reply, ApiError> {
        let doc = rq.json()?;
        if !doc.is_object() {
            return Err(ApiError::bad_request("definitions must be a JSON object"));
        }
        if let Some(v) = vhost {
            self.check_vhost(v)?;
        }
        let list = |key: &str| doc.get(key).and_then(Value::as_array).cloned().unwrap_or_default();
        let vhost_of = |item: &Value| -> Result<String, ApiError> {
            match vhost {
                Some(v) => Ok(v.to_owned()),
                None => Ok(str_field(item, "vhost", "/")?.to_owned()),
            }
        };
        import_skipped(&doc);
        if vhost.is_none() {
            for v in list("vhosts") {
                self.declare_vhost(str_field(&v, "name", "")?.to_owned())?;
            }
            // Before the queues, so that their policies apply as they are declared.
            self.import_access(&doc)?;
        }
        for x in list("exchanges") {
            let name = str_field(&x, "name", "")?;
            if name.is_empty() || name.starts_with("amq.") {
                continue;
            }
            let req = exchange_declare_of(&x, &vhost_of(&x)?, name)?;
            self.check_vhost(&req.vhost)?;
            self.on_core(move |node| async move { topology::exchange_declare(&node, req, false).await })??;
        }
        for q in list("queues") {
            let req = queue_declare_of(&q, &vhost_of(&q)?, str_field(&q, "name", "")?)?;
            self.check_vhost(&req.vhost)?;
            self.on_core(move |node| async move { topology::queue_declare(&node, req).await })??;
        }
        for b in list("bindings") {
            let kind = if str_field(&b, "destination_type", "queue")? == "exchange" { DestKind::Exchange } else { DestKind::Queue };
            let v = vhost_of(&b)?;
            let source = str_field(&b, "source", "")?;
            if source.is_empty() {
                continue;
            }
            let b = binding(
                &v,
                source,
                kind,
                str_field(&b, "destination", "")?,
                str_field(&b, "routing_key", "")?,
                &json_to_table(b.get("arguments"))?,
            );
            self.on_core(move |node| async move { topology::bind(&node, b, Caller::Operator).await })??;
        }
        Ok(Reply::empty(204))
    }
}

/// The parts of an imported definitions document this broker does not keep (topic
/// permissions, parameters), counted in the log.
fn import_skipped(doc: &Value) {
    let count = |key: &str| doc.get(key).and_then(Value::as_array).map_or(0, Vec::len);
    let (topic_permissions, parameters) = (count("topic_permissions"), count("parameters") + count("global_parameters"));
    if topic_permissions + parameters > 0 {
        tracing::warn!(topic_permissions, parameters, "definitions import: topic permissions and parameters are not kept here; skipped");
    }
}

/// Policies in RabbitMQ's shape.
fn policies(list: &[crate::meta::access::PolicyDef]) -> Value {
    Value::Array(list.iter().map(super::access::policy_json).collect())
}
