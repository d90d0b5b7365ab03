//! The GET endpoints, in RabbitMQ's shapes for the fields tools read.
//!
//! Queues come from the metadata (every node has every queue) with their figures from the
//! node serving each ([`Api::figures`]): counts, consumers and `message_stats` (publish,
//! deliver_get, ack: counts since the queue opened in this run, rates per second between
//! API calls at least 1 s apart). A queue another node serves reports its ready messages
//! and consumers only (asked through the cluster's data lane, as queue.declare does).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::json::table_to_json;
use super::{Api, ApiError, Reply, RABBITMQ_COMPAT_VERSION};
use crate::broker::clients::Clients;
use crate::broker::node::NodeMsg;
use crate::broker::policy::{self, Target};
use crate::broker::queue::Counters;
use crate::broker::{QueueInfo, QueueOp, QueueRef};
use crate::meta::state::{Binding, DestKind, ExchangeDef, QueueDef};
use crate::meta::Topology;

/// How long a listing waits for the queues' answers.
const FIGURES_WAIT: Duration = Duration::from_secs(5);

/// A queue's figures as one listing saw them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Figures {
    /// The answer of the queue's own node ([`QueueOp::Info`]); `None` for a peer's queue.
    pub info: Option<QueueInfo>,
    /// Ready messages.
    pub ready: u64,
    /// Delivered, unsettled messages.
    pub unacked: u64,
    /// Consumers.
    pub consumers: u64,
    /// The queue answered (else it reports "down", as RabbitMQ a queue it cannot reach).
    pub running: bool,
}

impl Api {
    /// The figures of each queue of `defs`, asked all at once (each queue's owner core, or
    /// the node serving it), waited for up to 5 s in all.
    pub(crate) fn figures(&self, defs: &[&QueueDef], with_unacked: bool) -> Vec<Figures> {
        enum Asked {
            Info(flume::Receiver<QueueInfo>),
            Stats(flume::Receiver<Result<(u32, u32), crate::broker::QueueError>>),
            Nothing,
        }
        let here = self.shared.meta.node_id();
        let cores = self.shared.cores;
        let asked: Vec<Asked> = defs
            .iter()
            .map(|d| {
                if d.owner_node == here {
                    return self.shared.ask_info(d, with_unacked).map_or(Asked::Nothing, Asked::Info);
                }
                let qref = QueueRef::of(d, cores);
                let (reply, rx) = flume::bounded(1);
                let op = QueueOp::Stats { reply };
                match self.shared.inboxes.send(qref.owner_core as usize, NodeMsg::Queue { queue: qref, op }) {
                    Ok(()) => Asked::Stats(rx),
                    Err(_) => Asked::Nothing,
                }
            })
            .collect();
        let deadline = Instant::now() + FIGURES_WAIT;
        asked
            .into_iter()
            .map(|a| match a {
                Asked::Info(rx) => match rx.recv_deadline(deadline) {
                    Ok(i) => Figures {
                        ready: i.messages_ready,
                        unacked: i.messages_unacked,
                        consumers: i.consumers.len() as u64,
                        running: true,
                        info: Some(i),
                    },
                    Err(_) => Figures::default(),
                },
                Asked::Stats(rx) => match rx.recv_deadline(deadline) {
                    Ok(Ok((ready, consumers))) => {
                        Figures { ready: u64::from(ready), consumers: u64::from(consumers), running: true, ..Figures::default() }
                    }
                    _ => Figures::default(),
                },
                Asked::Nothing => Figures::default(),
            })
            .collect()
    }

    /// The queues of `vhost` (all with `None`), sorted by vhost and name.
    pub(crate) fn queue_defs(&self, vhost: Option<&str>) -> Vec<QueueDef> {
        let topo = self.shared.meta.topology();
        topo.queues.values().filter(|q| vhost.is_none_or(|v| q.vhost == v)).cloned().collect()
    }

    /// 404 unless `vhost` exists.
    pub(crate) fn check_vhost(&self, vhost: &str) -> Result<(), ApiError> {
        if self.shared.meta.topology().vhosts.contains(vhost) {
            Ok(())
        } else {
            Err(ApiError::not_found())
        }
    }

    /// `{"rate": r}` for counter `key` at `value`.
    fn details(&self, key: String, value: u64) -> Value {
        json!({ "rate": self.rate(key, value) })
    }

    fn message_stats(&self, prefix: &str, c: &Counters) -> Value {
        json!({
            "publish": c.published,
            "publish_details": self.details(format!("{prefix}/publish"), c.published),
            "deliver_get": c.delivered,
            "deliver_get_details": self.details(format!("{prefix}/deliver_get"), c.delivered),
            "deliver": c.delivered,
            "deliver_details": self.details(format!("{prefix}/deliver"), c.delivered),
            "ack": c.acked,
            "ack_details": self.details(format!("{prefix}/ack"), c.acked),
        })
    }

    /// What every queue of a listing is reported against, read once per listing.
    fn queue_scope(&self) -> QueueScope {
        QueueScope { topology: self.shared.meta.topology(), cluster: self.shared.meta.is_cluster(), nodes: self.node_ids() }
    }

    /// A queue in RabbitMQ's shape. `type` is `quorum` for a queue declared so and for a
    /// cluster's replicated queue (durable, not exclusive: `broker::queue::replica`), with
    /// RabbitMQ's quorum queue fields `leader` (the node serving it), `members` (its replica
    /// set; every node when the set is empty) and `online` (the members this node sees up);
    /// `classic` otherwise. `policy`, `operator_policy` and `effective_policy_definition`
    /// name the policies that apply to it (`broker::policy::queue_policies`).
    pub(crate) fn queue_json(&self, scope: &QueueScope, d: &QueueDef, f: &Figures) -> Value {
        let declared_quorum = crate::broker::router::string_arg(&d.arguments, "x-queue-type") == Some("quorum");
        let quorum = declared_quorum || crate::broker::queue::replica::is_replicated(d, scope.cluster);
        let key = format!("queue/{}/{}", d.vhost, d.name);
        let stats = f.info.as_ref().map(|i| self.message_stats(&key, &i.counters)).unwrap_or_else(|| json!({}));
        let messages = f.ready + f.unacked;
        let members: Vec<u64> = if d.replicas.is_empty() { scope.nodes.iter().map(|(id, _)| *id).collect() } else { d.replicas.clone() };
        let online: Vec<String> =
            members.iter().filter(|m| scope.nodes.iter().any(|(id, up)| id == *m && *up)).map(|m| self.node_name(*m)).collect();
        let (policy, operator) = policy::queue_policies(&scope.topology, d);
        json!({
            "name": d.name,
            "vhost": d.vhost,
            "durable": d.durable,
            "auto_delete": d.auto_delete,
            "exclusive": d.exclusive_owner.is_some(),
            "arguments": table_to_json(&d.arguments),
            "node": self.node_name(d.owner_node),
            // ringmq's own: the core of that node that owns the queue (issue 15 item 3).
            "core": d.owner_core % self.shared.cores.max(1),
            "leader": self.node_name(d.owner_node),
            "members": members.iter().map(|n| self.node_name(*n)).collect::<Vec<_>>(),
            "online": online,
            "state": if f.running { "running" } else { "down" },
            "type": if quorum { "quorum" } else { "classic" },
            "messages": messages,
            "messages_details": self.details(format!("{key}/messages"), messages),
            "messages_ready": f.ready,
            "messages_ready_details": self.details(format!("{key}/ready"), f.ready),
            "messages_unacknowledged": f.unacked,
            "messages_unacknowledged_details": self.details(format!("{key}/unacked"), f.unacked),
            "consumers": f.consumers,
            "message_stats": stats,
            "policy": policy.map(|p| p.name.as_str()),
            "operator_policy": operator.map(|p| p.name.as_str()),
            "effective_policy_definition": policy::effective_definition(policy, operator),
            "exclusive_consumer_tag": null,
            "single_active_consumer_tag": null,
        })
    }

    /// `GET /api/queues[/{vhost}]`.
    pub(crate) fn queues(&self, vhost: Option<&str>) -> Result<Reply, ApiError> {
        if let Some(v) = vhost {
            self.check_vhost(v)?;
        }
        let defs = self.queue_defs(vhost);
        let refs: Vec<&QueueDef> = defs.iter().collect();
        let figures = self.figures(&refs, false);
        let scope = self.queue_scope();
        Ok(Reply::ok(Value::Array(defs.iter().zip(&figures).map(|(d, f)| self.queue_json(&scope, d, f)).collect())))
    }

    /// `GET /api/queues/{vhost}/{name}`: the queue with its `consumer_details` (RabbitMQ's
    /// shape, [`Api::consumer_json`]). A queue another node serves lists none here (its
    /// consumers are in that node's answer), though `consumers` counts them.
    pub(crate) fn queue(&self, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        let def = self.shared.meta.topology().queue(vhost, name).cloned().ok_or_else(ApiError::not_found)?;
        let f = self.figures(&[&def], false).pop().unwrap_or_default();
        let mut v = self.queue_json(&self.queue_scope(), &def, &f);
        let conns = self.shared.clients.list();
        let details: Vec<Value> = f.info.iter().flat_map(|i| i.consumers.iter()).map(|c| self.consumer_json(&def, c, &conns)).collect();
        if let Value::Object(m) = &mut v {
            m.insert("consumer_details".into(), Value::Array(details));
        }
        Ok(Reply::ok(v))
    }

    /// `GET /api/queues/{vhost}/{name}/unacked`: the queue's outstanding deliveries, oldest
    /// first, each with its connection, channel, consumer tag, delivery tag (asked of the
    /// holding connection's ledger), redelivered flag and age in ms. A queue another node
    /// serves: 400 naming the node to ask.
    pub(crate) fn queue_unacked(&self, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        let def = self.shared.meta.topology().queue(vhost, name).cloned().ok_or_else(ApiError::not_found)?;
        if def.owner_node != self.shared.meta.node_id() {
            return Err(ApiError::bad_request(format!(
                "queue '{name}' is served by node {}: ask that node's management API",
                def.owner_node
            )));
        }
        let f = self.figures(&[&def], true).pop().unwrap_or_default();
        let Some(info) = f.info else { return Err(ApiError::internal("the queue did not answer")) };
        let conns = self.shared.clients.list();
        let described = Clients::describe(&conns);
        let key = crate::broker::QueueKey::new(vhost, name);
        let rows: Vec<Value> = info
            .unacked
            .iter()
            .map(|u| {
                let conn = conns.iter().position(|c| c.id == u.conn);
                let tag = conn.and_then(|i| {
                    described[i]
                        .channels
                        .iter()
                        .filter(|c| c.number == u.channel.0)
                        .flat_map(|c| c.unacked.iter())
                        .find(|(_, q, off)| *q == key && *off == u.offset)
                        .map(|(tag, _, _)| *tag)
                });
                json!({
                    "consumer_tag": u.consumer_tag.as_deref(),
                    "connection_name": conn.map(|i| conns[i].name()),
                    "channel": u.channel.0,
                    "channel_name": conn.map(|i| format!("{} ({})", conns[i].name(), u.channel.0)),
                    "delivery_tag": tag,
                    "redelivered": u.redelivered,
                    "age_ms": u.age_ms,
                    "offset": u.offset,
                })
            })
            .collect();
        Ok(Reply::ok(Value::Array(rows)))
    }

    /// An exchange in RabbitMQ's shape; `policy` names the policy that applies to it.
    fn exchange_json(topology: &Topology, x: &ExchangeDef) -> Value {
        let policy = policy::matching(&topology.access, &x.vhost, &x.name, Target::Exchange, false);
        json!({
            "name": x.name,
            "vhost": x.vhost,
            "type": x.kind.as_str(),
            "durable": x.durable,
            "auto_delete": x.auto_delete,
            "internal": x.internal,
            "arguments": table_to_json(&x.arguments),
            "user_who_performed_action": "",
            "policy": policy.map(|p| p.name.as_str()),
        })
    }

    /// `GET /api/exchanges[/{vhost}]`.
    pub(crate) fn exchanges(&self, vhost: Option<&str>) -> Result<Reply, ApiError> {
        if let Some(v) = vhost {
            self.check_vhost(v)?;
        }
        let topo = self.shared.meta.topology();
        let list = topo.exchanges.values().filter(|x| vhost.is_none_or(|v| x.vhost == v)).map(|x| Api::exchange_json(&topo, x)).collect();
        Ok(Reply::ok(Value::Array(list)))
    }

    /// `GET /api/exchanges/{vhost}/{name}` (`amq.default` names the default exchange).
    pub(crate) fn exchange(&self, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        let topo = self.shared.meta.topology();
        let x = topo.exchange(vhost, exchange_name(name)).ok_or_else(ApiError::not_found)?;
        Ok(Reply::ok(Api::exchange_json(&topo, x)))
    }

    /// Every binding of `vhost` (all with `None`), the default exchange's implicit one to
    /// each queue first, as RabbitMQ lists them.
    fn all_bindings(&self, vhost: Option<&str>) -> Vec<Binding> {
        let topo = self.shared.meta.topology();
        let implicit = topo.queues.values().filter(|q| vhost.is_none_or(|v| q.vhost == v)).map(|q| Binding {
            vhost: q.vhost.clone(),
            source: String::new(),
            dest_kind: DestKind::Queue,
            dest: q.name.clone(),
            routing_key: q.name.clone(),
            arguments: Default::default(),
        });
        let explicit = topo.all_bindings().filter(|b| vhost.is_none_or(|v| b.vhost == v)).cloned();
        implicit.chain(explicit).collect()
    }

    /// `GET /api/bindings[/{vhost}]`.
    pub(crate) fn bindings(&self, vhost: Option<&str>) -> Result<Reply, ApiError> {
        if let Some(v) = vhost {
            self.check_vhost(v)?;
        }
        Ok(Reply::ok(Value::Array(self.all_bindings(vhost).iter().map(binding_json).collect())))
    }

    /// `GET /api/queues/{vhost}/{name}/bindings`.
    pub(crate) fn bindings_to_queue(&self, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        self.shared.meta.topology().queue(vhost, name).ok_or_else(ApiError::not_found)?;
        let list =
            self.all_bindings(Some(vhost)).iter().filter(|b| b.dest_kind == DestKind::Queue && b.dest == name).map(binding_json).collect();
        Ok(Reply::ok(Value::Array(list)))
    }

    /// `GET /api/exchanges/{vhost}/{name}/bindings/{source|destination}`.
    pub(crate) fn bindings_of_exchange(&self, vhost: &str, name: &str, dir: &str) -> Result<Reply, ApiError> {
        let name = exchange_name(name);
        self.shared.meta.topology().exchange(vhost, name).ok_or_else(ApiError::not_found)?;
        let list = self
            .all_bindings(Some(vhost))
            .iter()
            .filter(|b| if dir == "source" { b.source == name } else { b.dest_kind == DestKind::Exchange && b.dest == name })
            .map(binding_json)
            .collect();
        Ok(Reply::ok(Value::Array(list)))
    }

    /// The bindings from exchange `source` to `dest` (`kind` `q` or `e`).
    pub(crate) fn bindings_matching(&self, vhost: &str, source: &str, kind: &str, dest: &str) -> Result<Vec<Binding>, ApiError> {
        let topo = self.shared.meta.topology();
        let source = exchange_name(source);
        topo.exchange(vhost, source).ok_or_else(ApiError::not_found)?;
        let dest_kind = if kind == "q" { DestKind::Queue } else { DestKind::Exchange };
        let dest_exists = if kind == "q" { topo.queue(vhost, dest).is_some() } else { topo.exchange(vhost, dest).is_some() };
        if !dest_exists {
            return Err(ApiError::not_found());
        }
        Ok(self
            .all_bindings(Some(vhost))
            .into_iter()
            .filter(|b| b.source == source && b.dest_kind == dest_kind && b.dest == dest)
            .collect())
    }

    /// `GET /api/bindings/{vhost}/e/{source}/{q|e}/{dest}`.
    pub(crate) fn bindings_between(&self, vhost: &str, source: &str, kind: &str, dest: &str) -> Result<Reply, ApiError> {
        let list = self.bindings_matching(vhost, source, kind, dest)?;
        Ok(Reply::ok(Value::Array(list.iter().map(binding_json).collect())))
    }

    /// `GET /api/bindings/{vhost}/e/{source}/{q|e}/{dest}/{props}`.
    pub(crate) fn binding(&self, vhost: &str, source: &str, kind: &str, dest: &str, props: &str) -> Result<Reply, ApiError> {
        let list = self.bindings_matching(vhost, source, kind, dest)?;
        let b = list.iter().find(|b| names_binding(b, props)).ok_or_else(ApiError::not_found)?;
        Ok(Reply::ok(binding_json(b)))
    }

    /// `GET /api/overview`.
    pub(crate) fn overview(&self) -> Result<Reply, ApiError> {
        let topo = self.shared.meta.topology();
        let defs: Vec<&QueueDef> = topo.queues.values().collect();
        let figures = self.figures(&defs, false);
        let (ready, unacked) = (figures.iter().map(|f| f.ready).sum::<u64>(), figures.iter().map(|f| f.unacked).sum::<u64>());
        let consumers: u64 = figures.iter().map(|f| f.consumers).sum();
        let sum = |pick: fn(&crate::observe::Stats) -> &std::sync::atomic::AtomicU64| {
            self.shared.stats.iter().map(|s| pick(s).load(Ordering::Relaxed)).sum::<u64>()
        };
        let (published, delivered, acked) = (sum(|s| &s.published), sum(|s| &s.delivered), sum(|s| &s.acked));
        let (confirmed, returned) = (sum(|s| &s.confirmed), sum(|s| &s.returned));
        let conns = self.shared.clients.list();
        let channels: usize = Clients::describe(&conns).iter().map(|d| d.channels.len()).sum();
        let me = self.node_name(self.shared.meta.node_id());
        let cfg = &self.shared.config;
        let mut listeners: Vec<Value> = cfg
            .listen
            .iter()
            .map(|a| json!({"node": me, "protocol": "amqp", "ip_address": a.ip().to_string(), "port": a.port()}))
            .collect();
        listeners.push(json!({"node": me, "protocol": "prometheus", "ip_address": cfg.metrics_listen.ip().to_string(), "port": cfg.metrics_listen.port()}));
        if let Some(m) = cfg.management_listen {
            listeners.push(json!({"node": me, "protocol": "http", "ip_address": m.ip().to_string(), "port": m.port()}));
        }
        let messages = ready + unacked;
        let mut message_stats = self.message_stats("overview", &Counters { published, delivered, acked });
        if let Value::Object(m) = &mut message_stats {
            m.insert("confirm".into(), json!(confirmed));
            m.insert("confirm_details".into(), self.details("overview/confirm".into(), confirmed));
            m.insert("return_unroutable".into(), json!(returned));
            m.insert("return_unroutable_details".into(), self.details("overview/return".into(), returned));
        }
        let exchange_types: Vec<Value> =
            ["direct", "fanout", "topic", "headers"].iter().map(|t| json!({"name": t, "enabled": true})).collect();
        Ok(Reply::ok(json!({
            "management_version": RABBITMQ_COMPAT_VERSION,
            "rabbitmq_version": RABBITMQ_COMPAT_VERSION,
            "product_name": "ringmq",
            "product_version": env!("CARGO_PKG_VERSION"),
            "erlang_version": "none",
            "erlang_full_version": "none",
            "rates_mode": "basic",
            "cluster_name": crate::broker::cluster_name::identity(&self.shared.meta.topology()).name,
            "node": me,
            "disable_stats": false,
            "enable_queue_totals": true,
            "statistics_db_event_queue": 0,
            "listeners": listeners,
            "contexts": [],
            "exchange_types": exchange_types,
            "object_totals": {
                "connections": conns.len(),
                "channels": channels,
                "exchanges": topo.exchanges.len(),
                "queues": topo.queues.len(),
                "consumers": consumers,
            },
            "queue_totals": {
                "messages": messages,
                "messages_details": self.details("overview/messages".into(), messages),
                "messages_ready": ready,
                "messages_ready_details": self.details("overview/ready".into(), ready),
                "messages_unacknowledged": unacked,
                "messages_unacknowledged_details": self.details("overview/unacked".into(), unacked),
            },
            "message_stats": message_stats,
        })))
    }

    fn node_json(&self, id: u64, running: bool) -> Value {
        let here = id == self.shared.meta.node_id();
        let mut v = json!({"name": self.node_name(id), "type": "disc", "running": running, "being_drained": false, "partitions": []});
        if here {
            let a = &self.shared.alarms;
            // The alarm thread reads /proc every 10 ms; its figure is the one the alarm uses.
            let rss = a.memory_used.load(Ordering::Relaxed);
            let extra = json!({
                "uptime": self.started.elapsed().as_millis() as u64,
                "processors": self.shared.cores,
                "os_pid": std::process::id().to_string(),
                "fd_used": a.open_fds.load(Ordering::Relaxed),
                "fd_total": a.max_fds.load(Ordering::Relaxed),
                "disk_free": a.disk_free_bytes.load(Ordering::Relaxed),
                "disk_free_limit": a.disk_free_limit.load(Ordering::Relaxed),
                "disk_free_alarm": a.disk_alarm(),
                "mem_used": rss,
                "mem_limit": a.memory_limit.load(Ordering::Relaxed),
                "mem_alarm": a.memory_alarm(),
                "rates_mode": "basic",
            });
            if let (Value::Object(m), Value::Object(e)) = (&mut v, extra) {
                m.extend(e);
            }
        }
        v
    }

    /// The cluster's nodes: (id, running).
    fn node_ids(&self) -> Vec<(u64, bool)> {
        let me = self.shared.meta.node_id();
        let links = self.shared.peer_links.as_ref().map(|l| l()).unwrap_or_default();
        let mut voters = self.shared.meta.cluster_figures().voters;
        if !voters.contains(&me) {
            voters.push(me);
        }
        voters.sort_unstable();
        voters.into_iter().map(|id| (id, id == me || links.iter().any(|&(p, up)| p == id && up))).collect()
    }

    /// `GET /api/nodes`.
    pub(crate) fn nodes(&self) -> Result<Reply, ApiError> {
        Ok(Reply::ok(Value::Array(self.node_ids().into_iter().map(|(id, up)| self.node_json(id, up)).collect())))
    }

    /// `GET /api/nodes/{name}`.
    pub(crate) fn node(&self, name: &str) -> Result<Reply, ApiError> {
        let (id, up) = self.node_ids().into_iter().find(|(id, _)| self.node_name(*id) == name).ok_or_else(ApiError::not_found)?;
        Ok(Reply::ok(self.node_json(id, up)))
    }

    /// `GET /api/vhosts[/{name}]`, each with its queues' message totals.
    pub(crate) fn vhosts(&self, one: Option<&str>) -> Result<Reply, ApiError> {
        let topo = self.shared.meta.topology();
        if let Some(v) = one {
            self.check_vhost(v)?;
        }
        let names: Vec<&String> = topo.vhosts.iter().filter(|v| one.is_none_or(|o| o == v.as_str())).collect();
        let defs: Vec<&QueueDef> = topo.queues.values().filter(|q| names.iter().any(|v| **v == q.vhost)).collect();
        let figures = self.figures(&defs, false);
        let me = self.node_name(self.shared.meta.node_id());
        let list: Vec<Value> = names
            .iter()
            .map(|v| {
                let of = || defs.iter().zip(&figures).filter(|(d, _)| d.vhost == **v).map(|(_, f)| f);
                let (ready, unacked) = (of().map(|f| f.ready).sum::<u64>(), of().map(|f| f.unacked).sum::<u64>());
                json!({
                    "name": v,
                    "description": "",
                    "tags": [],
                    "metadata": {"description": "", "tags": []},
                    "default_queue_type": "classic",
                    "tracing": false,
                    "messages": ready + unacked,
                    "messages_ready": ready,
                    "messages_unacknowledged": unacked,
                    "cluster_state": {me.clone(): "running"},
                })
            })
            .collect();
        match one {
            Some(_) => Ok(Reply::ok(list.into_iter().next().unwrap_or(Value::Null))),
            None => Ok(Reply::ok(Value::Array(list))),
        }
    }

    /// `GET /api/health/checks/alarms` (and `local-alarms`): 200 `{"status":"ok"}` without a
    /// resource alarm, else 503 `{"status":"failed","reason":…,"alarms":[…]}`.
    pub(crate) fn health_alarms(&self) -> Reply {
        let a = &self.shared.alarms;
        let node = self.node_name(self.shared.meta.node_id());
        let mut alarms = Vec::new();
        if a.disk_alarm() {
            alarms.push(json!({"node": node, "resource": "disk"}));
        }
        if a.memory_alarm() {
            alarms.push(json!({"node": node, "resource": "memory"}));
        }
        if a.fd_alarm.load(Ordering::Relaxed) {
            alarms.push(json!({"node": node, "resource": "file_descriptor_limit"}));
        }
        if alarms.is_empty() {
            Reply::ok(json!({"status": "ok"}))
        } else {
            Reply::with(503, json!({"status": "failed", "reason": "resource alarm(s) in effect in the cluster", "alarms": alarms}))
        }
    }

    /// `GET /api/health/checks/ready`: 200 `{"status":"ok"}` when this node serves clients
    /// (not shutting down, and in a cluster a metadata leader is known), else 503
    /// `{"status":"failed","reason":…}`.
    pub(crate) fn health_ready(&self) -> Reply {
        let failed = |why: &str| Reply::with(503, json!({"status": "failed", "reason": why}));
        if self.shared.shutting_down.load(Ordering::Relaxed) {
            return failed("the node is shutting down");
        }
        if self.shared.meta.is_cluster() && self.shared.meta.cluster_figures().leader == 0 {
            return failed("no metadata leader is known (no quorum)");
        }
        Reply::ok(json!({"status": "ok"}))
    }
}

/// The exchange a URL segment names: `amq.default` is the default exchange (`""`).
pub(crate) fn exchange_name(segment: &str) -> &str {
    if segment == "amq.default" {
        ""
    } else {
        segment
    }
}

/// RabbitMQ's `properties_key` of a binding: its routing key (percent-encoded; `~` when
/// empty) when it has no arguments, else the routing key, `~` and a hash of the arguments.
pub(crate) fn properties_key(b: &Binding) -> String {
    // What a URL segment carries unescaped (RFC 3986's unreserved characters).
    const ESCAPED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');
    let rk = percent_encoding::utf8_percent_encode(&b.routing_key, ESCAPED).to_string();
    if b.arguments.inner().is_empty() {
        return if rk.is_empty() { "~".into() } else { rk };
    }
    let hash = crc32fast::hash(table_to_json(&b.arguments).to_string().as_bytes());
    format!("{rk}~{hash:08x}")
}

/// Whether a URL's `props` segment (decoded) names binding `b`: its [`properties_key`], or,
/// for a binding without arguments, its routing key as it is (clients that pass the key
/// through their own URL quoting once more, as rabbitmqadmin does, send either).
pub(crate) fn names_binding(b: &Binding, props: &str) -> bool {
    properties_key(b) == props || (b.arguments.inner().is_empty() && b.routing_key == props)
}

/// A binding in RabbitMQ's shape.
pub(crate) fn binding_json(b: &Binding) -> Value {
    json!({
        "source": b.source,
        "vhost": b.vhost,
        "destination": b.dest,
        "destination_type": if b.dest_kind == DestKind::Queue { "queue" } else { "exchange" },
        "routing_key": b.routing_key,
        "arguments": table_to_json(&b.arguments),
        "properties_key": properties_key(b),
    })
}

/// What a queue listing reports every queue against, read once per listing.
pub(crate) struct QueueScope {
    /// The topology (its policies).
    topology: std::sync::Arc<Topology>,
    /// This node is one of a cluster (durable queues are replicated).
    cluster: bool,
    /// The cluster's nodes: (id, seen up from here).
    nodes: Vec<(u64, bool)>,
}
