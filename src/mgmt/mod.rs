//! The management HTTP API, compatible with RabbitMQ's for the fields tools read
//! (rabbitmqadmin, monitoring agents, Kubernetes probes), on `--management-listen` and, over
//! HTTPS, on `--management-tls-listen`.
//!
//! # Layout
//! - this file: basic auth, routing, errors; [`http`]: the HTTP/1.1 transport (hyper);
//!   [`tls`]: the HTTPS listener's TLS handshake (rustls);
//! - [`read`]: the GET endpoints (overview, nodes, vhosts, queues, exchanges, bindings,
//!   health checks) and the figures they gather from the cores;
//! - [`connections`]: the GET endpoints about clients (connections, channels, consumers);
//! - [`write`]: PUT, POST and DELETE (declare, delete, purge, bind, get, publish);
//! - [`access`]: users, permissions, vhost deletion, policies and operator policies;
//! - [`definitions`]: `GET /api/definitions` (RabbitMQ's definitions format); [`import`]:
//!   `POST /api/definitions`, planned and checked whole before anything is applied;
//! - [`json`]: AMQP field tables and properties to and from JSON;
//! - [`ui`]: the web UI's files at `/` and its live latency endpoint;
//! - [`listing`]: the listing parameters (`name`, `sort`, `columns`, `page`, `page_size`).
//!
//! # Threads, reads and writes
//! The server runs on its own threads (`http`: one for the sockets, a pool for the
//! handlers), never on a core. Reads take the topology from
//! the metadata (every node has all of it) and ask each queue for its figures by message
//! passing: a [`QueueOp::Info`] (or, for a queue another node serves, [`QueueOp::Stats`],
//! forwarded there) into its owner core's inbox, answered on a channel. Writes run the
//! broker's own code (`broker::topology`, the same the AMQP methods call) on a core, handed
//! over as a [`NodeMsg::Run`] closure; the thread waits for its answer. No lock of the hot
//! path is taken.
//!
//! # Authentication
//! HTTP basic auth against a [`UserStore`] (the metadata's users, `broker::auth::MetaUsers`,
//! with their RabbitMQ tags): 401 with `WWW-Authenticate` when absent or wrong (none to a
//! script's request); a loopback-only user (guest) from another address is refused as for
//! AMQP. Writes need `administrator`, reads
//! `administrator` or `monitoring`.
//!
//! [`QueueOp::Info`]: crate::broker::QueueOp::Info
//! [`QueueOp::Stats`]: crate::broker::QueueOp::Stats
//! [`NodeMsg::Run`]: crate::broker::node::NodeMsg::Run

mod access;
mod connections;
mod definitions;
pub(crate) mod http;
mod import;
mod json;
mod listing;
mod read;
mod tls;
mod ui;
mod write;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::broker::auth::{AuthError, AuthUser, UserStore};
use crate::broker::node::{Node, NodeMsg, OnCore, Shared};
use crate::broker::topology::TopologyError;
use crate::broker::QueueError;
use crate::config::ManagementTls;

/// Largest request body read, bytes (a definitions import of many thousand objects fits).
const MAX_BODY: u64 = 64 << 20;

/// How long a request waits for the cores' answer.
const CORE_WAIT: Duration = Duration::from_secs(30);

/// Rate samples kept before those not asked for in 10 minutes are dropped.
const MAX_RATE_SAMPLES: usize = 16_384;

/// The RabbitMQ version whose management API this one follows (reported as
/// `rabbitmq_version` / `management_version`, which tools read to pick features; defined
/// in `broker`, where the metrics' `rabbitmq_build_info` reads it too).
pub const RABBITMQ_COMPAT_VERSION: &str = crate::broker::RABBITMQ_COMPAT_VERSION;

/// The API's state, shared by its threads.
pub struct Api {
    shared: Arc<Shared>,
    users: Arc<dyn UserStore>,
    /// Last sample of each counter a rate is reported for: name → (when, value, rate/s).
    rates: Mutex<HashMap<String, (Instant, u64, f64)>>,
    /// Round robin over the cores for the work handed to them.
    next_core: AtomicUsize,
    /// When the API started (the node's uptime).
    started: Instant,
}

/// Where the API listens: each listener's bound address, or why it could not bind; `None`
/// for a listener not asked for.
#[derive(Debug)]
pub struct Bound {
    /// The plain HTTP listener (`--management-listen`).
    pub http: Option<std::io::Result<SocketAddr>>,
    /// The HTTPS listener (`--management-tls-listen`, RabbitMQ's `management.ssl.port`).
    pub https: Option<std::io::Result<SocketAddr>>,
}

/// Starts the API with `users` for logins on `http` (plain) and `https` (TLS, its rustls
/// configuration built at load), either or both; one thread serves both (the transport:
/// `http`, the handshake: `tls`). A listener that cannot bind is reported in [`Bound`] and
/// leaves the other serving.
///
/// # Errors
/// The server thread or its runtime cannot start.
pub fn serve(
    http: Option<SocketAddr>,
    https: Option<&ManagementTls>,
    shared: Arc<Shared>,
    users: Arc<dyn UserStore>,
) -> std::io::Result<Bound> {
    let api = Arc::new(Api { shared, users, rates: Mutex::new(HashMap::new()), next_core: AtomicUsize::new(0), started: Instant::now() });
    http::start(http::Listeners { http, https }, api)
}

/// An HTTP answer as the transport sends it: status, headers, body bytes.
pub(super) struct Answer {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: bytes::Bytes,
}

impl Answer {
    /// RabbitMQ's error body `{"error": …, "reason": …}` with `status`; a 401 carries a
    /// Basic challenge unless the request came from a `script`.
    pub(super) fn error(status: u16, error: &str, reason: String, script: bool) -> Answer {
        let mut headers = vec![("Content-Type", "application/json".to_owned()), ("Cache-Control", "no-cache".to_owned())];
        if status == 401 && !script {
            headers.push(("WWW-Authenticate", "Basic realm=\"RabbitMQ Management\"".into()));
        }
        Answer { status, headers, body: json!({"error": error, "reason": reason}).to_string().into() }
    }
}

/// An answer: status, JSON body (none for 204) and extra headers.
pub(crate) struct Reply {
    status: u16,
    body: Option<Value>,
    headers: Vec<(&'static str, String)>,
}

impl Reply {
    /// 200 with `body`.
    pub(crate) fn ok(body: Value) -> Reply {
        Reply { status: 200, body: Some(body), headers: Vec::new() }
    }
    /// `status` with no body (201 Created, 204 No Content).
    pub(crate) fn empty(status: u16) -> Reply {
        Reply { status, body: None, headers: Vec::new() }
    }
    /// `status` with `body`.
    pub(crate) fn with(status: u16, body: Value) -> Reply {
        Reply { status, body: Some(body), headers: Vec::new() }
    }
}

/// A refused request: HTTP status and RabbitMQ's `{"error": …, "reason": …}` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    status: u16,
    error: &'static str,
    reason: String,
}

impl ApiError {
    /// 404 as RabbitMQ answers an unknown object.
    pub(crate) fn not_found() -> ApiError {
        ApiError { status: 404, error: "Object Not Found", reason: "Not Found".into() }
    }
    /// 400 with `reason`.
    pub(crate) fn bad_request(reason: impl Into<String>) -> ApiError {
        ApiError { status: 400, error: "bad_request", reason: reason.into() }
    }
    /// 405 for a method this path does not take.
    pub(crate) fn method_not_allowed() -> ApiError {
        ApiError { status: 405, error: "Method Not Allowed", reason: "Method Not Allowed".into() }
    }
    /// 500 with `reason`.
    pub(crate) fn internal(reason: impl Into<String>) -> ApiError {
        ApiError { status: 500, error: "internal_error", reason: reason.into() }
    }
    /// 503 with `reason` (shutting down, no quorum).
    pub(crate) fn unavailable(reason: impl Into<String>) -> ApiError {
        ApiError { status: 503, error: "service_unavailable", reason: reason.into() }
    }
}

impl From<TopologyError> for ApiError {
    /// RabbitMQ's statuses for the broker's refusals: 404 for a missing object, 400 for a
    /// precondition (inequivalent arguments, if-unused / if-empty), 403 for a reserved name,
    /// 503 for a resource (no quorum, no disk), 500 otherwise.
    fn from(e: TopologyError) -> ApiError {
        let (status, error) = match &e {
            TopologyError::Queue(QueueError::NotFound(_)) => (404, "Object Not Found"),
            TopologyError::Queue(QueueError::AccessRefused(_)) => (403, "access_refused"),
            TopologyError::Queue(QueueError::PreconditionFailed(_)) => (400, "bad_request"),
            TopologyError::Queue(QueueError::ResourceError(_)) => (503, "resource_error"),
            TopologyError::Queue(QueueError::InternalError(_)) => (500, "internal_error"),
            TopologyError::ResourceLocked(_) => (405, "resource_locked"),
            TopologyError::CommandInvalid(_) => (400, "bad_request"),
        };
        ApiError { status, error, reason: e.to_string() }
    }
}

impl From<QueueError> for ApiError {
    fn from(e: QueueError) -> ApiError {
        TopologyError::Queue(e).into()
    }
}

/// What a handler gets: the method, the decoded path segments after `/api`, the query
/// string's pairs, the body and the user.
pub(crate) struct Request<'a> {
    method: &'a str,
    path: Vec<String>,
    query: HashMap<String, String>,
    body: String,
    /// The `X-Reason` header (a connection close's text).
    reason: Option<String>,
    user: AuthUser,
}

/// What a request carries besides its method, URL and credentials.
struct Incoming {
    body: String,
    reason: Option<String>,
}

impl Request<'_> {
    /// The body as JSON (an empty body is `{}`).
    ///
    /// # Errors
    /// 400 when it does not parse.
    pub(crate) fn json(&self) -> Result<Value, ApiError> {
        if self.body.trim().is_empty() {
            return Ok(json!({}));
        }
        serde_json::from_str(&self.body).map_err(|e| ApiError::bad_request(format!("body is not valid JSON: {e}")))
    }

    /// A query flag given as `true`.
    pub(crate) fn flag(&self, name: &str) -> bool {
        self.query.get(name).is_some_and(|v| v == "true")
    }
}

/// Decodes `%XX` escapes (and `+` as a space only in query strings).
fn decode(s: &str, plus_is_space: bool) -> String {
    let s = if plus_is_space { s.replace('+', " ") } else { s.to_owned() };
    percent_encoding::percent_decode_str(&s).decode_utf8_lossy().into_owned()
}

impl Api {
    /// Answers one request: a UI file, or an API call.
    pub(super) fn answer(&self, head: &http::RequestHead, body: &[u8]) -> Answer {
        if head.method == "GET" {
            if let Some((content_type, file)) = ui::asset(head.url.split('?').next().unwrap_or("")) {
                return Answer {
                    status: 200,
                    headers: vec![("Content-Type", content_type.to_owned())],
                    body: bytes::Bytes::from_static(file.as_bytes()),
                };
            }
        }
        let Ok(body) = String::from_utf8(body.to_vec()) else {
            return Answer::error(400, "bad_request", "the body is not UTF-8".into(), head.script);
        };
        let incoming = Incoming { body, reason: head.reason.clone() };
        match self.handle(&head.method, &head.url, head.authorization.as_deref(), head.loopback, incoming) {
            Err(e) => Answer::error(e.status, e.error, e.reason, head.script),
            Ok(reply) => {
                let mut headers = reply.headers;
                if reply.body.is_some() {
                    headers.push(("Content-Type", "application/json".into()));
                }
                headers.push(("Cache-Control", "no-cache".into()));
                let body = reply.body.as_ref().map(|b| b.to_string()).unwrap_or_default();
                Answer { status: reply.status, headers, body: body.into() }
            }
        }
    }

    fn handle(&self, method: &str, url: &str, auth: Option<&str>, loopback: bool, incoming: Incoming) -> Result<Reply, ApiError> {
        let (path, query) = url.split_once('?').unwrap_or((url, ""));
        let mut segments: Vec<String> = path.split('/').skip(1).map(|s| decode(s, false)).collect();
        if segments.last().is_some_and(String::is_empty) {
            segments.pop();
        }
        if segments.first().map(String::as_str) != Some("api") {
            return Err(ApiError::not_found());
        }
        segments.remove(0);
        let user = self.login(auth, loopback)?;
        authorize(&user, method, segments.first().map_or("", String::as_str))?;
        let query = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (decode(k, true), decode(v, true))
            })
            .collect();
        let rq = Request { method, path: segments, query, body: incoming.body, reason: incoming.reason, user };
        let mut reply = self.route(&rq)?;
        if !rq.query.is_empty() && matches!(method, "GET" | "HEAD") {
            reply.body = match reply.body.take() {
                Some(Value::Array(list)) => Some(listing::shape(list, &rq.query)?),
                other => other,
            };
        }
        Ok(reply)
    }

    /// Checks the `Authorization: Basic …` header against the user store.
    fn login(&self, auth: Option<&str>, loopback: bool) -> Result<AuthUser, ApiError> {
        use base64::Engine as _;
        let refused = |reason: &str| ApiError { status: 401, error: "not_authorized", reason: reason.into() };
        let Some(b64) = auth.and_then(|a| a.strip_prefix("Basic ").or_else(|| a.strip_prefix("basic "))) else {
            return Err(refused("Not_Authorized"));
        };
        let creds = base64::engine::general_purpose::STANDARD.decode(b64.trim()).ok().and_then(|b| String::from_utf8(b).ok());
        let Some((name, password)) = creds.as_deref().and_then(|c| c.split_once(':')) else {
            return Err(refused("Not_Authorized"));
        };
        match self.users.authenticate(name, password, loopback) {
            Ok(u) => Ok(u),
            Err(e) => {
                // Logged at the default level, as RabbitMQ's "HTTP access denied" lines.
                tracing::warn!(user = name, reason = %e, "management API login refused");
                Err(refused(match e {
                    AuthError::InvalidCredentials => "Login failed",
                    AuthError::LoopbackOnly(_) => "User can only log in via localhost",
                }))
            }
        }
    }

    fn route(&self, rq: &Request<'_>) -> Result<Reply, ApiError> {
        let p: Vec<&str> = rq.path.iter().map(String::as_str).collect();
        let m = rq.method;
        let get = m == "GET" || m == "HEAD";
        match (p.as_slice(), get) {
            (["overview"], true) => self.overview(),
            (["cluster-name"], true) => Ok(self.cluster_name()),
            (["cluster-name"], false) if m == "PUT" => self.cluster_name_write(rq),
            (["nodes"], true) => self.nodes(),
            (["nodes", name], true) => self.node(name),
            (["ringmq", "latency"], true) => self.latency_node(),
            (["ringmq", "latency", v, q], true) => self.latency_queue(v, q),
            (["ringmq", "nodes", n, setting], false) => self.node_setting(rq, n, setting),
            (["whoami"], true) => Ok(Reply::ok(json!({"name": rq.user.name, "tags": rq.user.tags}))),
            (["health", "checks", "alarms"] | ["health", "checks", "local-alarms"], true) => Ok(self.health_alarms()),
            (["health", "checks", "ready"], true) => Ok(self.health_ready()),
            // RabbitMQ's older node health check, still in some probes.
            (["healthchecks", "node"] | ["healthchecks", "node", _], true) => Ok(self.health_ready()),
            (["vhosts"], true) => self.vhosts(None),
            (["vhosts", v], true) => self.vhosts(Some(v)),
            (["vhosts", v], false) if m == "DELETE" => self.vhost_delete(v),
            (["vhosts", v], false) => self.vhost_write(rq, v),
            (["vhosts", v, "permissions"], true) => self.permissions(Some(v), None),
            (["queues"], true) => self.queues(None),
            (["queues", v], true) => self.queues(Some(v)),
            (["queues", v, q], true) => self.queue(v, q),
            (["queues", v, q], false) => self.queue_write(rq, v, q),
            (["queues", v, q, "bindings"], true) => self.bindings_to_queue(v, q),
            (["queues", v, q, "contents"], false) if m == "DELETE" => self.queue_purge(v, q),
            (["queues", v, q, "get"], false) if m == "POST" => self.queue_get(rq, v, q),
            (["queues", v, q, "unacked"], true) => self.queue_unacked(v, q),
            (["exchanges"], true) => self.exchanges(None),
            (["exchanges", v], true) => self.exchanges(Some(v)),
            (["exchanges", v, x], true) => self.exchange(v, x),
            (["exchanges", v, x], false) => self.exchange_write(rq, v, x),
            (["exchanges", v, x, "publish"], false) if m == "POST" => self.publish(rq, v, x),
            (["exchanges", v, x, "bindings", dir @ ("source" | "destination")], true) => self.bindings_of_exchange(v, x, dir),
            (["bindings"], true) => self.bindings(None),
            (["bindings", v], true) => self.bindings(Some(v)),
            (["bindings", v, "e", s, kind @ ("q" | "e"), d], true) => self.bindings_between(v, s, kind, d),
            (["bindings", v, "e", s, kind @ ("q" | "e"), d], false) if m == "POST" => self.bind(rq, v, s, kind, d),
            (["bindings", v, "e", s, kind @ ("q" | "e"), d, props], true) => self.binding(v, s, kind, d, props),
            (["bindings", v, "e", s, kind @ ("q" | "e"), d, props], false) if m == "DELETE" => self.unbind(v, s, kind, d, props),
            (["connections"], true) => self.connections(),
            (["connections", name], true) => self.connection(name),
            (["connections", name], false) if m == "DELETE" => self.close_connection(rq, name),
            (["connections", "username", u], true) => self.connections_of_user(u),
            (["connections", "username", u], false) if m == "DELETE" => self.close_user_connections(rq, u),
            (["channels"], true) => self.channels(),
            (["consumers"], true) => self.consumers(None),
            (["consumers", v], true) => self.consumers(Some(v)),
            (["definitions"], true) => self.definitions(None),
            (["definitions", v], true) => self.definitions(Some(v)),
            (["definitions"], false) if m == "POST" => self.import(rq, None),
            (["definitions", v], false) if m == "POST" => self.import(rq, Some(v)),
            (["users"], true) => self.list_users(None),
            (["users", u], true) => self.list_users(Some(u)),
            (["users", u], false) => self.user_write(m, &rq.json()?, u),
            (["users", u, "permissions"], true) => self.permissions(None, Some(u)),
            (["permissions"], true) => self.permissions(None, None),
            (["permissions", v, u], true) => self.permissions(Some(v), Some(u)),
            (["permissions", v, u], false) => self.permission_write(m, &rq.json()?, v, u),
            (["policies"], true) => self.policies(false, None, None),
            (["policies", v], true) => self.policies(false, Some(v), None),
            (["policies", v, n], true) => self.policies(false, Some(v), Some(n)),
            (["policies", v, n], false) => self.policy_write(rq, false, v, n),
            (["operator-policies"], true) => self.policies(true, None, None),
            (["operator-policies", v], true) => self.policies(true, Some(v), None),
            (["operator-policies", v, n], true) => self.policies(true, Some(v), Some(n)),
            (["operator-policies", v, n], false) => self.policy_write(rq, true, v, n),
            // Objects of RabbitMQ's API this node does not keep: empty lists to read.
            (["parameters"] | ["global-parameters"], true) => Ok(Reply::ok(json!([]))),
            (["vhost-limits"] | ["feature-flags"] | ["extensions"], true) => Ok(Reply::ok(json!([]))),
            (_, true) => Err(ApiError::not_found()),
            (_, false) if known_path(&p) => Err(ApiError::method_not_allowed()),
            (_, false) => Err(ApiError::not_found()),
        }
    }

    /// Runs `f` on a core (round robin) with its [`Node`] and waits for its answer.
    ///
    /// # Errors
    /// 503 while the broker shuts down; 500 when no answer comes within [`CORE_WAIT`].
    pub(crate) fn on_core<T, F, Fut>(&self, f: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(Rc<Node>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T> + 'static,
    {
        let (tx, rx) = flume::bounded(1);
        let cores = self.shared.cores.max(1) as usize;
        let core = self.next_core.fetch_add(1, Ordering::Relaxed) % cores;
        let work = OnCore(Box::new(move |node: &Rc<Node>| {
            let node = node.clone();
            crate::core::spawn_soon(async move {
                let _ = tx.send(f(node).await);
            });
        }));
        if self.shared.shutting_down.load(Ordering::Relaxed) || self.shared.inboxes.send(core, NodeMsg::Run(work)).is_err() {
            return Err(ApiError::unavailable("the broker is shutting down"));
        }
        rx.recv_timeout(CORE_WAIT).map_err(|_| ApiError::internal("the broker did not answer in time"))
    }

    /// The rate per second of counter `name` now at `value`: from the sample taken at least
    /// 1 s before (the previous rate until a second has passed), 0 at the first call.
    pub(crate) fn rate(&self, name: String, value: u64) -> f64 {
        let now = Instant::now();
        let mut rates = self.rates.lock().unwrap_or_else(|e| e.into_inner());
        if rates.len() > MAX_RATE_SAMPLES {
            // Counters of deleted queues: forgotten once nobody asked for them for 10 min.
            rates.retain(|_, (at, _, _)| now.duration_since(*at) < Duration::from_secs(600));
        }
        let entry = rates.entry(name).or_insert((now, value, 0.0));
        let dt = now.duration_since(entry.0).as_secs_f64();
        if dt >= 1.0 {
            let r = value.saturating_sub(entry.1) as f64 / dt;
            *entry = (now, value, (r * 10.0).round() / 10.0);
        }
        entry.2
    }

    /// Every user in RabbitMQ's shape (with its password hash, as an export has it).
    pub(crate) fn users_json(&self) -> Value {
        Value::Array(crate::broker::access::users(&self.shared.meta).iter().map(access::user_json).collect())
    }

    /// This node's name as the API reports it (`ringmq@<node id>`).
    pub(crate) fn node_name(&self, id: u64) -> String {
        format!("ringmq@{id}")
    }
}

/// Whether `user` may call `method` on a path starting with `first` (after `/api/`): any
/// method needs `administrator` except GET and HEAD, which `monitoring` may call too, and
/// `whoami`, which any user who logged in may call. A `POST …/get` counts as a write (it
/// takes messages).
///
/// # Errors
/// 403 `not_authorized` otherwise.
fn authorize(user: &AuthUser, method: &str, first: &str) -> Result<(), ApiError> {
    let reads = matches!(method, "GET" | "HEAD");
    let allowed = if reads { user.may_read() || first == "whoami" } else { user.may_write() };
    if allowed {
        Ok(())
    } else {
        let reason = if reads { "Not monitoring or administrator user" } else { "Not administrator user" };
        Err(ApiError { status: 403, error: "not_authorized", reason: reason.into() })
    }
}

/// True for the paths the API knows (a method it does not take there is 405, not 404).
fn known_path(p: &[&str]) -> bool {
    matches!(
        p.first().copied(),
        Some(
            "overview"
                | "cluster-name"
                | "nodes"
                | "whoami"
                | "health"
                | "vhosts"
                | "queues"
                | "exchanges"
                | "bindings"
                | "connections"
                | "channels"
                | "consumers"
                | "definitions"
                | "users"
                | "permissions"
                | "policies"
                | "operator-policies"
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(tags: &[&str]) -> AuthUser {
        AuthUser { name: "u".into(), tags: tags.iter().map(|t| t.to_string()).collect() }
    }

    #[test]
    fn administrators_write_monitoring_reads_others_only_whoami() {
        let (admin, monitor, none) = (user(&["administrator"]), user(&["monitoring"]), user(&["management"]));
        for m in ["GET", "PUT", "POST", "DELETE"] {
            assert!(authorize(&admin, m, "queues").is_ok(), "{m}");
        }
        assert!(authorize(&monitor, "GET", "queues").is_ok());
        assert_eq!(authorize(&monitor, "PUT", "queues").map_err(|e| e.status), Err(403));
        assert_eq!(authorize(&monitor, "POST", "queues").map_err(|e| e.status), Err(403), "get takes messages");
        assert_eq!(authorize(&none, "GET", "queues").map_err(|e| e.status), Err(403));
        assert!(authorize(&none, "GET", "whoami").is_ok());
    }

    #[test]
    fn topology_refusals_map_to_rabbitmq_statuses() {
        let status = |e: TopologyError| ApiError::from(e).status;
        assert_eq!(status(TopologyError::Queue(QueueError::NotFound("x".into()))), 404);
        assert_eq!(status(TopologyError::Queue(QueueError::PreconditionFailed("x".into()))), 400);
        assert_eq!(status(TopologyError::Queue(QueueError::AccessRefused("x".into()))), 403);
        assert_eq!(status(TopologyError::Queue(QueueError::ResourceError("x".into()))), 503);
        assert_eq!(status(TopologyError::ResourceLocked("x".into())), 405);
        assert_eq!(status(TopologyError::CommandInvalid("x".into())), 400);
    }

    #[test]
    fn path_segments_are_percent_decoded() {
        assert_eq!(decode("%2F", false), "/");
        assert_eq!(decode("a+b", false), "a+b");
        assert_eq!(decode("a+b%21", true), "a b!");
    }
}
