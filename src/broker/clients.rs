//! This node's client connections, as the management API lists them: what is fixed at open
//! (peer, user, vhost, tuning) in a registry written once at open and once at close, and
//! what changes (channels, their consumers and outstanding deliveries) asked of the
//! connection itself by message passing ([`ClientEvent::Describe`]), so nothing on the
//! message path takes a lock or keeps a second copy.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use amq_protocol::types::{AMQPValue, FieldTable};

use super::{ClientEvent, ClientTx, ConnId, QueueKey, Reply};
use crate::meta::topology::Topology;

/// A connection as it was opened.
#[derive(Clone, Debug)]
pub struct ClientInfo {
    /// Its id on this node.
    pub id: ConnId,
    /// The core serving it.
    pub core: u32,
    /// The client's address.
    pub peer: Option<SocketAddr>,
    /// The broker's address it connected to.
    pub local: Option<SocketAddr>,
    /// The user it logged in as.
    pub user: String,
    /// Its vhost.
    pub vhost: String,
    /// When it opened, ms since the Unix epoch.
    pub connected_at_ms: u64,
    /// Negotiated heartbeat, s.
    pub heartbeat: u16,
    /// Negotiated frame_max, bytes.
    pub frame_max: u32,
    /// Negotiated channel_max.
    pub channel_max: u16,
    /// The client's properties as its connection.start-ok sent them (product, version,
    /// platform, capabilities, `connection_name`: AMQP 0-9-1 §1.4.2.2, RabbitMQ's
    /// "Connection Client Properties").
    pub client_properties: FieldTable,
    /// Its event channel (to ask it for a [`ConnDescription`] or close it).
    pub tx: ClientTx,
}

impl ClientInfo {
    /// RabbitMQ's connection name: `"<peer> -> <local>"`.
    pub fn name(&self) -> String {
        let addr = |a: Option<SocketAddr>| a.map_or_else(|| "unknown".to_owned(), |a| a.to_string());
        format!("{} -> {}", addr(self.peer), addr(self.local))
    }

    /// The name the client gave its connection: its `connection_name` client property
    /// (pika, the Java client, aio-pika and lapin set it), as RabbitMQ's
    /// `user_provided_name`; `None` when absent or not a string.
    pub fn user_provided_name(&self) -> Option<String> {
        match self.client_properties.inner().get("connection_name")? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            _ => None,
        }
    }
}

/// One open channel of a connection, as the connection describes it.
#[derive(Clone, Debug, Default)]
pub struct ChannelDescription {
    /// Channel number.
    pub number: u16,
    /// Publisher confirms on.
    pub confirm: bool,
    /// tx.select received.
    pub transactional: bool,
    /// basic.qos prefetch_count for new consumers (0 = unlimited).
    pub prefetch: u32,
    /// Its consumers: (consumer tag, queue).
    pub consumers: Vec<(String, QueueKey)>,
    /// Its outstanding deliveries: (delivery tag, queue, offset in the queue's shard).
    pub unacked: Vec<(u64, QueueKey, u64)>,
}

/// A connection's answer to [`ClientEvent::Describe`].
#[derive(Clone, Debug, Default)]
pub struct ConnDescription {
    /// Its open channels, by number.
    pub channels: Vec<ChannelDescription>,
    /// RabbitMQ's connection state: "running", "flow" (its reader waits for publish credit,
    /// `broker::credit`), "blocked" (a resource alarm holds it) or "blocking" (an alarm is
    /// raised and it has not published yet); empty when it did not answer.
    pub state: &'static str,
}

/// The registry of this node's open connections.
#[derive(Debug, Default)]
pub struct Clients {
    map: Mutex<BTreeMap<ConnId, ClientInfo>>,
}

impl Clients {
    /// Records a connection that completed its handshake.
    pub fn opened(&self, info: ClientInfo) {
        self.lock().insert(info.id, info);
    }

    /// Records that a connection now lives on `core` (it moved there,
    /// `amqp::connection::handoff`).
    pub fn moved(&self, id: ConnId, core: u32) {
        if let Some(c) = self.lock().get_mut(&id) {
            c.core = core;
        }
    }

    /// Forgets a connection that closed.
    pub fn closed(&self, id: ConnId) {
        self.lock().remove(&id);
    }

    /// Every open connection, by id.
    pub fn list(&self) -> Vec<ClientInfo> {
        self.lock().values().cloned().collect()
    }

    /// Asks each of `conns` for its channels and waits for the answers (up to 2 s in all);
    /// a connection that closed meanwhile answers nothing and gets an empty description.
    pub fn describe(conns: &[ClientInfo]) -> Vec<ConnDescription> {
        let asked: Vec<_> = conns
            .iter()
            .map(|c| {
                let (reply, rx): (Reply<ConnDescription>, _) = flume::bounded(1);
                let _ = c.tx.send(ClientEvent::Describe(reply));
                rx
            })
            .collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        asked.into_iter().map(|rx| rx.recv_deadline(deadline).unwrap_or_default()).collect()
    }

    /// Closes the connection named `name` ([`ClientInfo::name`]) with 320 CONNECTION_FORCED
    /// and `reason`. Returns false when there is none.
    pub fn close(&self, name: &str, reason: &str) -> bool {
        let found = self.lock().values().find(|c| c.name() == name).cloned();
        match found {
            Some(c) => c.tx.send(ClientEvent::Close(reason.to_owned())).is_ok(),
            None => false,
        }
    }

    /// Closes, with 320 CONNECTION_FORCED, every connection whose user or vhost `topology`
    /// no longer has (RabbitMQ 3.7+: "user 'u' is deleted", "vhost 'v' is deleted"); returns
    /// how many were asked to close. Run by one core of each node when the topology
    /// changes, so a user deleted on any node loses its connections on every node.
    pub fn close_revoked(&self, topology: &Topology) -> usize {
        let revoked: Vec<(ClientInfo, String)> = self
            .lock()
            .values()
            .filter_map(|c| {
                if !topology.access.users.contains_key(&c.user) {
                    Some((c.clone(), format!("user '{}' is deleted", c.user)))
                } else if !topology.vhosts.contains(&c.vhost) {
                    Some((c.clone(), format!("vhost '{}' is deleted", c.vhost)))
                } else {
                    None
                }
            })
            .collect();
        for (c, why) in &revoked {
            tracing::info!(connection = %c.name(), "closing connection: {why}");
            let _ = c.tx.send(ClientEvent::Close(why.clone()));
        }
        revoked.len()
    }

    /// Closes every connection of `user` with 320 CONNECTION_FORCED and `reason`; returns
    /// how many (RabbitMQ's `DELETE /api/connections/username/{user}`).
    pub fn close_user(&self, user: &str, reason: &str) -> usize {
        let conns: Vec<ClientInfo> = self.lock().values().filter(|c| c.user == user).cloned().collect();
        for c in &conns {
            let _ = c.tx.send(ClientEvent::Close(reason.to_owned()));
        }
        conns.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<ConnId, ClientInfo>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}
