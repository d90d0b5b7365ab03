//! The GET endpoints about clients, in RabbitMQ's shapes: connections (with the client's
//! properties and `user_provided_name`), channels, and consumers (`/api/consumers`, and a
//! queue's `consumer_details`).
//!
//! Connections are this node's (`broker::clients`: what was fixed at open, then each
//! connection asked for its channels); consumers are those of the queues this node serves,
//! from each queue's [`QueueOp::Info`] answer.
//!
//! [`QueueOp::Info`]: crate::broker::QueueOp::Info

use serde_json::{json, Value};

use super::json::table_to_json;
use super::{Api, ApiError, Reply};
use crate::broker::clients::{ClientInfo, Clients, ConnDescription};
use crate::broker::ConsumerInfo;
use crate::meta::state::QueueDef;

impl Api {
    /// This node's connections with their channels' descriptions.
    fn described_connections(&self) -> Vec<(ClientInfo, ConnDescription)> {
        let conns = self.shared.clients.list();
        let described = Clients::describe(&conns);
        conns.into_iter().zip(described).collect()
    }

    /// A connection in RabbitMQ's shape: `name` as RabbitMQ forms it (`"<peer> -> <local>"`),
    /// `client_properties` as the client's connection.start-ok sent them, and
    /// `user_provided_name` from their `connection_name` (absent when the client gave none,
    /// as RabbitMQ leaves it out).
    fn connection_json(&self, c: &ClientInfo, d: &ConnDescription) -> Value {
        let (peer, local) = (c.peer, c.local);
        let mut v = json!({
            "name": c.name(),
            "node": self.node_name(self.shared.meta.node_id()),
            // ringmq's own: the core serving the connection.
            "core": c.core,
            "user": c.user,
            "vhost": c.vhost,
            "protocol": "AMQP 0-9-1",
            "type": "network",
            "state": if d.state.is_empty() { "running" } else { d.state },
            "channels": d.channels.len(),
            "channel_max": c.channel_max,
            "frame_max": c.frame_max,
            "timeout": c.heartbeat,
            "connected_at": c.connected_at_ms,
            "peer_host": peer.map(|a| a.ip().to_string()),
            "peer_port": peer.map(|a| a.port()),
            "host": local.map(|a| a.ip().to_string()),
            "port": local.map(|a| a.port()),
            "ssl": false,
            "auth_mechanism": "PLAIN",
            "client_properties": table_to_json(&c.client_properties),
        });
        if let (Some(name), Value::Object(m)) = (c.user_provided_name(), &mut v) {
            m.insert("user_provided_name".into(), json!(name));
        }
        v
    }

    /// `GET /api/connections`: this node's client connections.
    pub(crate) fn connections(&self) -> Result<Reply, ApiError> {
        let list = self.described_connections().iter().map(|(c, d)| self.connection_json(c, d)).collect();
        Ok(Reply::ok(Value::Array(list)))
    }

    /// `GET /api/connections/username/{user}`: this node's connections of `user` (RabbitMQ
    /// 3.10.7+).
    pub(crate) fn connections_of_user(&self, user: &str) -> Result<Reply, ApiError> {
        let list = self.described_connections().iter().filter(|(c, _)| c.user == user).map(|(c, d)| self.connection_json(c, d)).collect();
        Ok(Reply::ok(Value::Array(list)))
    }

    /// `GET /api/connections/{name}`.
    pub(crate) fn connection(&self, name: &str) -> Result<Reply, ApiError> {
        let all = self.described_connections();
        let (c, d) = all.iter().find(|(c, _)| c.name() == name).ok_or_else(ApiError::not_found)?;
        Ok(Reply::ok(self.connection_json(c, d)))
    }

    /// `GET /api/channels`: the channels of this node's connections.
    pub(crate) fn channels(&self) -> Result<Reply, ApiError> {
        let me = self.node_name(self.shared.meta.node_id());
        let mut list = Vec::new();
        for (c, d) in self.described_connections() {
            for ch in &d.channels {
                let mut details =
                    json!({"name": c.name(), "peer_host": c.peer.map(|a| a.ip().to_string()), "peer_port": c.peer.map(|a| a.port())});
                if let (Some(name), Value::Object(m)) = (c.user_provided_name(), &mut details) {
                    m.insert("user_provided_name".into(), json!(name));
                }
                list.push(json!({
                    "name": format!("{} ({})", c.name(), ch.number),
                    "number": ch.number,
                    "node": me,
                    "user": c.user,
                    "vhost": c.vhost,
                    "state": "running",
                    "confirm": ch.confirm,
                    "transactional": ch.transactional,
                    "prefetch_count": ch.prefetch,
                    "consumer_count": ch.consumers.len(),
                    "messages_unacknowledged": ch.unacked.len(),
                    "connection_details": details,
                }));
            }
        }
        Ok(Reply::ok(Value::Array(list)))
    }

    /// One consumer of queue `d` in RabbitMQ's shape (`/api/consumers` and a queue's
    /// `consumer_details`): its channel described from `conns` (this node's connections;
    /// a consumer on another node's connection has its channel number only).
    pub(crate) fn consumer_json(&self, d: &QueueDef, c: &ConsumerInfo, conns: &[ClientInfo]) -> Value {
        let conn = conns.iter().find(|k| k.id == c.conn);
        let arguments = if c.priority != 0 { json!({"x-priority": c.priority}) } else { json!({}) };
        json!({
            "consumer_tag": &*c.tag,
            "queue": {"name": d.name, "vhost": d.vhost},
            "channel_details": {
                "name": conn.map(|k| format!("{} ({})", k.name(), c.channel.0)),
                "number": c.channel.0,
                "connection_name": conn.map(ClientInfo::name),
                "user_provided_name": conn.and_then(ClientInfo::user_provided_name),
                "node": self.node_name(self.shared.meta.node_id()),
                "peer_host": conn.and_then(|k| k.peer).map(|a| a.ip().to_string()),
                "peer_port": conn.and_then(|k| k.peer).map(|a| a.port()),
                "user": conn.map(|k| k.user.clone()),
            },
            "ack_required": !c.no_ack,
            "exclusive": c.exclusive,
            "prefetch_count": c.prefetch,
            "priority": c.priority,
            "active": true,
            "activity_status": "up",
            "arguments": arguments,
        })
    }

    /// `GET /api/consumers[/{vhost}]`: the consumers of the queues this node serves.
    pub(crate) fn consumers(&self, vhost: Option<&str>) -> Result<Reply, ApiError> {
        if let Some(v) = vhost {
            self.check_vhost(v)?;
        }
        let here = self.shared.meta.node_id();
        let defs: Vec<QueueDef> = self.queue_defs(vhost).into_iter().filter(|d| d.owner_node == here).collect();
        let refs: Vec<&QueueDef> = defs.iter().collect();
        let figures = self.figures(&refs, false);
        let conns = self.shared.clients.list();
        let mut list = Vec::new();
        for (d, f) in defs.iter().zip(&figures) {
            for c in f.info.iter().flat_map(|i| i.consumers.iter()) {
                list.push(self.consumer_json(d, c, &conns));
            }
        }
        Ok(Reply::ok(Value::Array(list)))
    }
}
