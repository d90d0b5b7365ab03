//! PUT, POST and DELETE: each runs the broker's own code (`broker::topology`, the queue
//! operations, the router) on a core through [`Api::on_core`], as the AMQP methods do, so
//! both answer alike. Status codes as RabbitMQ's API: 201 when created, 204 when it existed
//! or was deleted, 404 for a missing object, 400 for a refused precondition.

use std::rc::Rc;

use base64::Engine as _;
use serde_json::{json, Value};

use super::json::{bool_field, int_field, json_to_properties, json_to_table, properties_to_json, str_field};
use super::read::{exchange_name, names_binding, properties_key};
use super::{Api, ApiError, Reply, Request};
use crate::broker::message::{decode_properties, encode_properties, Message};
use crate::broker::node::Node;
use crate::broker::topology::{self, binding, Caller, ExchangeDeclare, QueueDeclare};
use crate::broker::{reply_channel, ChannelId, ClientEvent, ConfirmTo, ConnId, Holder, QueueOp, QueueRef};
use crate::meta::state::{Command, DestKind};

/// Most messages one `POST …/get` takes.
const MAX_GET: i64 = 10_000;

impl Api {
    /// `PUT /api/vhosts/{name}` creates a vhost (with its `amq.*` exchanges); `DELETE` is not
    /// there yet (405).
    pub(crate) fn vhost_write(&self, rq: &Request<'_>, name: &str) -> Result<Reply, ApiError> {
        if rq.method != "PUT" {
            return Err(ApiError::method_not_allowed());
        }
        rq.json()?;
        let existed = self.shared.meta.topology().vhosts.contains(name);
        self.declare_vhost(name.to_owned())?;
        Ok(Reply::empty(if existed { 204 } else { 201 }))
    }

    /// Creates vhost `name` (with its `amq.*` exchanges) unless it exists.
    pub(crate) fn declare_vhost(&self, name: String) -> Result<(), ApiError> {
        if name.is_empty() {
            return Err(ApiError::bad_request("a vhost name is required"));
        }
        self.on_core(move |node| async move {
            node.shared.meta.propose(Command::DeclareVhost { name }).await.map_err(topology::meta_error)?;
            Ok::<_, topology::TopologyError>(())
        })??;
        Ok(())
    }

    /// `PUT /api/queues/{vhost}/{name}` (declare: `durable`, `auto_delete`, `arguments`;
    /// an existing queue must be equivalent, else 400) and `DELETE` (with `if-unused`,
    /// `if-empty` query flags: 400 when they do not hold).
    pub(crate) fn queue_write(&self, rq: &Request<'_>, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        self.check_vhost(vhost)?;
        match rq.method {
            "PUT" => {
                let req = queue_declare_of(&rq.json()?, vhost, name)?;
                let declared = self.on_core(move |node| async move { topology::queue_declare(&node, req).await })??;
                Ok(Reply::empty(if declared.created.is_some() { 201 } else { 204 }))
            }
            "DELETE" => {
                self.shared.meta.topology().queue(vhost, name).ok_or_else(ApiError::not_found)?;
                let (if_unused, if_empty) = (rq.flag("if-unused"), rq.flag("if-empty"));
                let (v, n) = (vhost.to_owned(), name.to_owned());
                self.on_core(
                    move |node| async move { topology::queue_delete(&node, &v, &n, Caller::Operator, if_unused, if_empty).await },
                )??;
                Ok(Reply::empty(204))
            }
            _ => Err(ApiError::method_not_allowed()),
        }
    }

    /// `DELETE /api/queues/{vhost}/{name}/contents`: queue.purge.
    pub(crate) fn queue_purge(&self, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        self.shared.meta.topology().queue(vhost, name).ok_or_else(ApiError::not_found)?;
        let (v, n) = (vhost.to_owned(), name.to_owned());
        self.on_core(move |node| async move { topology::queue_purge(&node, &v, &n, Caller::Operator).await })??;
        Ok(Reply::empty(204))
    }

    /// `POST /api/queues/{vhost}/{name}/get`: takes up to `count` messages as basic.get
    /// does. `ackmode`: `ack_requeue_false` (auto-ack: they are gone), `ack_requeue_true` or
    /// `reject_requeue_true` (they are requeued, redelivered=true, as RabbitMQ does);
    /// `reject_requeue_false` drops them (dead-lettered when the queue has a DLX).
    /// `encoding`: `auto` (the payload as a string when it is UTF-8, else base64) or
    /// `base64`; `truncate`: at most that many payload bytes returned.
    pub(crate) fn queue_get(&self, rq: &Request<'_>, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        let body = rq.json()?;
        let count = int_field(&body, "count", 1)?.clamp(0, MAX_GET) as usize;
        let ackmode = str_field(&body, "ackmode", "ack_requeue_true")?.to_owned();
        let (requeue, no_ack) = match ackmode.as_str() {
            "ack_requeue_true" | "reject_requeue_true" => (true, false),
            "ack_requeue_false" => (false, true),
            "reject_requeue_false" => (false, false),
            other => return Err(ApiError::bad_request(format!("unknown ackmode '{other}'"))),
        };
        let base64 = match str_field(&body, "encoding", "auto")? {
            "auto" => false,
            "base64" => true,
            other => return Err(ApiError::bad_request(format!("unknown encoding '{other}'"))),
        };
        let truncate = match body.get("truncate") {
            None | Some(Value::Null) => None,
            Some(_) => Some(int_field(&body, "truncate", 0)?.max(0) as usize),
        };
        self.shared.meta.topology().queue(vhost, name).ok_or_else(ApiError::not_found)?;
        let (v, n) = (vhost.to_owned(), name.to_owned());
        let got = self.on_core(move |node| async move { get_messages(&node, &v, &n, count, no_ack, requeue).await })??;
        let list = got
            .into_iter()
            .map(|(m, redelivered, left)| {
                let (exchange, routing_key, raw) = m.parts();
                let props = decode_properties(raw).map(|p| properties_to_json(&p)).unwrap_or_else(|| json!({}));
                let bytes = &m.body[..truncate.unwrap_or(usize::MAX).min(m.body.len())];
                let (payload, encoding) = match (base64, std::str::from_utf8(bytes)) {
                    (false, Ok(s)) => (s.to_owned(), "string"),
                    _ => (base64::engine::general_purpose::STANDARD.encode(bytes), "base64"),
                };
                json!({
                    "payload_bytes": m.body.len(),
                    "redelivered": redelivered,
                    "exchange": exchange,
                    "routing_key": routing_key,
                    "message_count": left,
                    "properties": props,
                    "payload": payload,
                    "payload_encoding": encoding,
                })
            })
            .collect();
        Ok(Reply::ok(Value::Array(list)))
    }

    /// `PUT /api/exchanges/{vhost}/{name}` (declare: `type`, `durable`, `auto_delete`,
    /// `internal`, `arguments`) and `DELETE` (with the `if-unused` query flag).
    pub(crate) fn exchange_write(&self, rq: &Request<'_>, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        self.check_vhost(vhost)?;
        let name = exchange_name(name).to_owned();
        match rq.method {
            "PUT" => {
                let req = exchange_declare_of(&rq.json()?, vhost, &name)?;
                let existed = self.shared.meta.topology().exchange(vhost, &name).is_some();
                self.on_core(move |node| async move { topology::exchange_declare(&node, req, false).await })??;
                Ok(Reply::empty(if existed { 204 } else { 201 }))
            }
            "DELETE" => {
                self.shared.meta.topology().exchange(vhost, &name).ok_or_else(ApiError::not_found)?;
                let if_unused = rq.flag("if-unused");
                let v = vhost.to_owned();
                self.on_core(move |node| async move { topology::exchange_delete(&node, &v, &name, if_unused).await })??;
                Ok(Reply::empty(204))
            }
            _ => Err(ApiError::method_not_allowed()),
        }
    }

    /// `POST /api/exchanges/{vhost}/{name}/publish`: publishes one message (`routing_key`,
    /// `payload`, `payload_encoding` `string` or `base64`, `properties`) and answers
    /// `{"routed": bool}` once every queue it was routed to stored it (synced when it is
    /// persistent in a durable queue), as a publisher confirm would.
    pub(crate) fn publish(&self, rq: &Request<'_>, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        let body = rq.json()?;
        let exchange = exchange_name(name).to_owned();
        let routing_key = str_field(&body, "routing_key", "")?.to_owned();
        let payload = str_field(&body, "payload", "")?;
        let payload = match str_field(&body, "payload_encoding", "string")? {
            "string" => payload.as_bytes().to_vec(),
            "base64" => base64::engine::general_purpose::STANDARD
                .decode(payload)
                .map_err(|e| ApiError::bad_request(format!("payload is not base64: {e}")))?,
            other => return Err(ApiError::bad_request(format!("unknown payload_encoding '{other}'"))),
        };
        let props = json_to_properties(body.get("properties"))?;
        {
            let topo = self.shared.meta.topology();
            let x = topo.exchange(vhost, &exchange).ok_or_else(ApiError::not_found)?;
            if x.internal {
                return Err(ApiError::bad_request(format!("cannot publish to internal exchange '{exchange}' in vhost '{vhost}'")));
            }
        }
        let persistent = *props.delivery_mode() == Some(2);
        let message = Message::new(&exchange, &routing_key, &encode_properties(&props), payload.into(), persistent);
        let v = vhost.to_owned();
        let (routed, stored) = self.on_core(move |node| async move {
            let headers = props.headers().clone();
            let queues = node.router().route(&v, &exchange, &routing_key, headers.as_ref()).queues;
            publish_to(&node, queues, message).await
        })?;
        if !stored {
            return Err(ApiError::internal("a queue could not store the message"));
        }
        Ok(Reply::ok(json!({ "routed": routed })))
    }

    /// `POST /api/bindings/{vhost}/e/{source}/{q|e}/{dest}` (`routing_key`, `arguments`):
    /// 201 with the new binding's path in `Location`.
    pub(crate) fn bind(&self, rq: &Request<'_>, vhost: &str, source: &str, kind: &str, dest: &str) -> Result<Reply, ApiError> {
        self.check_vhost(vhost)?;
        let body = rq.json()?;
        let dest_kind = if kind == "q" { DestKind::Queue } else { DestKind::Exchange };
        let b = binding(
            vhost,
            exchange_name(source),
            dest_kind,
            dest,
            str_field(&body, "routing_key", "")?,
            &json_to_table(body.get("arguments"))?,
        );
        let props = properties_key(&b);
        self.on_core(move |node| async move { topology::bind(&node, b, Caller::Operator).await })??;
        let mut reply = Reply::empty(201);
        reply.headers.push(("Location", props));
        Ok(reply)
    }

    /// `DELETE /api/bindings/{vhost}/e/{source}/{q|e}/{dest}/{props}`.
    pub(crate) fn unbind(&self, vhost: &str, source: &str, kind: &str, dest: &str, props: &str) -> Result<Reply, ApiError> {
        let list = self.bindings_matching(vhost, source, kind, dest)?;
        let b = list.into_iter().find(|b| names_binding(b, props) && !b.source.is_empty()).ok_or_else(ApiError::not_found)?;
        self.on_core(move |node| async move { topology::unbind(&node, b, Caller::Operator).await })??;
        Ok(Reply::empty(204))
    }

    /// `DELETE /api/connections/{name}`: closes it with 320 CONNECTION_FORCED and the
    /// `X-Reason` header's text (RabbitMQ's "Closed via management plugin" without one).
    pub(crate) fn close_connection(&self, rq: &Request<'_>, name: &str) -> Result<Reply, ApiError> {
        let reason = rq.reason.as_deref().unwrap_or("Closed via management plugin");
        if self.shared.clients.close(name, reason) {
            Ok(Reply::empty(204))
        } else {
            Err(ApiError::not_found())
        }
    }

    /// `DELETE /api/connections/username/{user}`: closes this node's connections of `user`
    /// with 320 CONNECTION_FORCED and the `X-Reason` text; 204 even when there were none, as
    /// RabbitMQ answers.
    pub(crate) fn close_user_connections(&self, rq: &Request<'_>, user: &str) -> Result<Reply, ApiError> {
        let reason = rq.reason.as_deref().unwrap_or("Closed via management plugin");
        self.shared.clients.close_user(user, reason);
        Ok(Reply::empty(204))
    }
}

/// The queue.declare a JSON object of RabbitMQ's asks for (`durable`, default true;
/// `auto_delete`; `arguments`), by the operator.
///
/// # Errors
/// 400 for an empty name, an `exclusive` queue (a connection's only), or a field of the wrong
/// type.
pub(crate) fn queue_declare_of(body: &Value, vhost: &str, name: &str) -> Result<QueueDeclare, ApiError> {
    if name.is_empty() {
        return Err(ApiError::bad_request("a queue name is required"));
    }
    if bool_field(body, "exclusive", false)? {
        return Err(ApiError::bad_request("an exclusive queue belongs to a connection: declare it over AMQP"));
    }
    Ok(QueueDeclare {
        vhost: vhost.to_owned(),
        name: name.to_owned(),
        server_named: false,
        durable: bool_field(body, "durable", true)?,
        auto_delete: bool_field(body, "auto_delete", false)?,
        exclusive: false,
        arguments: json_to_table(body.get("arguments"))?,
        caller: Caller::Operator,
    })
}

/// The exchange.declare a JSON object of RabbitMQ's asks for (`type`, required; `durable`,
/// default true; `auto_delete`; `internal`; `arguments`).
///
/// # Errors
/// 400 without a type, or for a field of the wrong type.
pub(crate) fn exchange_declare_of(body: &Value, vhost: &str, name: &str) -> Result<ExchangeDeclare, ApiError> {
    let kind = str_field(body, "type", "")?.to_owned();
    if kind.is_empty() {
        return Err(ApiError::bad_request("exchange type is required (\"type\")"));
    }
    Ok(ExchangeDeclare {
        vhost: vhost.to_owned(),
        name: name.to_owned(),
        kind,
        durable: bool_field(body, "durable", true)?,
        auto_delete: bool_field(body, "auto_delete", false)?,
        internal: bool_field(body, "internal", false)?,
        arguments: json_to_table(body.get("arguments"))?,
    })
}

/// Hands `message` to each of `queues` with a confirm ticket and waits for every answer:
/// (routed, stored everywhere).
pub(crate) async fn publish_to(node: &Rc<Node>, queues: Vec<QueueRef>, message: Message) -> (bool, bool) {
    if queues.is_empty() {
        return (false, true);
    }
    crate::observe::Stats::add(&node.stats().published, 1);
    let (tx, rx) = flume::unbounded();
    let uid = node.shared.next_id();
    for (seq, q) in queues.iter().enumerate() {
        let confirm = ConfirmTo { tx: tx.clone(), conn: ConnId(uid), channel: ChannelId(0), chan_uid: uid, seq: seq as u64 };
        node.send_from_connection(q, QueueOp::Publish { message: message.clone(), confirm: Some(confirm), published: None, credit: None });
    }
    drop(tx);
    let mut ok = true;
    for _ in 0..queues.len() {
        match rx.recv_async().await {
            Ok(ClientEvent::Stored { ok: stored, .. }) => ok &= stored,
            Ok(_) => {}
            Err(_) => return (true, false),
        }
    }
    (true, ok)
}

/// Takes up to `count` messages from the queue as basic.get does, for a holder of its own
/// (a channel incarnation no connection has); then settles them: requeued with `requeue`,
/// else rejected (dropped or dead-lettered); with `no_ack` they were settled on delivery.
/// Returns (message, redelivered, messages left).
async fn get_messages(
    node: &Rc<Node>,
    vhost: &str,
    name: &str,
    count: usize,
    no_ack: bool,
    requeue: bool,
) -> Result<Vec<(Message, bool, u32)>, topology::TopologyError> {
    let (q, _) = topology::queue_lookup(node, vhost, name, Caller::Operator).await?;
    let (tx, _events) = flume::unbounded();
    let uid = node.shared.next_id();
    let holder = Holder { conn: ConnId(uid), channel: ChannelId(0), chan_uid: uid, tx };
    let mut out = Vec::new();
    let mut offsets = Vec::new();
    while out.len() < count {
        let (reply, rx) = reply_channel();
        node.send_from_connection(&q, QueueOp::Get { no_ack, holder: holder.clone(), reply });
        let got = rx.recv_async().await.map_err(|_| crate::broker::QueueError::InternalError("queue did not answer".into()))??;
        let Some(got) = got else { break };
        crate::observe::Stats::add(&node.stats().delivered, 1);
        offsets.push(got.offset);
        out.push((got.message, got.redelivered, got.message_count));
    }
    if !no_ack && !offsets.is_empty() {
        let (requeued, rejected) = if requeue { (offsets, Vec::new()) } else { (Vec::new(), offsets) };
        node.send_from_connection(&q, QueueOp::Settle { chan_uid: uid, ack: Vec::new(), requeue: requeued, reject: rejected });
    }
    Ok(out)
}

impl Api {
    /// `PUT /api/ringmq/nodes/{node}/{setting}` with `{"value": …}`: sets this node's
    /// `vm_memory_high_watermark` (a fraction such as `0.4` or bytes such as `"512MiB"`) or
    /// `disk_free_limit` (bytes, `"50MB"`) until it restarts, as RabbitMQ's
    /// `rabbitmqctl set_vm_memory_high_watermark` / `set_disk_free_limit` do. The alarm is
    /// re-evaluated within 10 ms. 204 when set.
    ///
    /// # Errors
    /// 404 for an unknown node or setting; 400 for another node of the cluster (each node
    /// sets its own, through its own API) or a value that does not parse.
    pub(crate) fn node_setting(&self, rq: &Request<'_>, node: &str, setting: &str) -> Result<Reply, ApiError> {
        if rq.method != "PUT" {
            return Err(ApiError::method_not_allowed());
        }
        let me = self.node_name(self.shared.meta.node_id());
        if node != me {
            self.node(node)?;
            return Err(ApiError::bad_request(format!("{node} is another node: set it through that node's management API (this is {me})")));
        }
        let body = rq.json()?;
        let value = match body.get("value") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => return Err(ApiError::bad_request("a \"value\" (number or string) is required")),
        };
        let alarms = &self.shared.alarms;
        match setting {
            "vm_memory_high_watermark" => {
                let w = crate::config::Watermark::parse(&value).map_err(ApiError::bad_request)?;
                let limit = w.bytes(crate::broker::alarms::available_memory().unwrap_or(0));
                alarms.set_memory_limit(limit);
                tracing::info!(user = %rq.user.name, watermark = %w, limit_bytes = limit, "memory high watermark set");
            }
            "disk_free_limit" => {
                let bytes = crate::config::Watermark::parse_bytes(&value).map_err(ApiError::bad_request)?;
                alarms.set_disk_free_limit(bytes);
                tracing::info!(user = %rq.user.name, limit_bytes = bytes, "disk free limit set");
            }
            _ => return Err(ApiError::not_found()),
        }
        Ok(Reply::empty(204))
    }
}
