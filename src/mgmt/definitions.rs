//! `GET /api/definitions[/{vhost}]`: the topology in RabbitMQ's definitions format (vhosts,
//! queues, exchanges, bindings), so a RabbitMQ export imports here and ours there.
//!
//! Users (with RabbitMQ's password hashes, so an export logs in elsewhere), permissions,
//! policies and operator policies are exported and imported too, through `broker::access`
//! and `broker::policy`; parameters (federation, shovels) are not kept.
//!
//! Export (this file): exclusive queues (a connection's) and the predeclared exchanges
//! (`""`, `amq.*`) are left out, as RabbitMQ does, and so are the bindings to a queue left
//! out (a Celery worker's pidbox and reply queues are exclusive and bound to exchanges that
//! are exported): nothing in an export names an object the export does not hold or every
//! broker has. Import: [`super::import`].

use serde_json::{json, Value};

use super::json::table_to_json;
use super::{Api, ApiError, Reply, RABBITMQ_COMPAT_VERSION};
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
        // A binding is exported when its destination is: an exchange, or a queue exported.
        let exported_queue = |vhost: &str, name: &str| topo.queue(vhost, name).is_some_and(|q| q.exclusive_owner.is_none());
        let bindings: Vec<Value> = topo
            .all_bindings()
            .filter(|b| here(&b.vhost))
            .filter(|b| b.dest_kind == DestKind::Exchange || exported_queue(&b.vhost, &b.dest))
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
}

/// Policies in RabbitMQ's shape.
fn policies(list: &[crate::meta::access::PolicyDef]) -> Value {
    Value::Array(list.iter().map(super::access::policy_json).collect())
}
