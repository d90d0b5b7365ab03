//! Thin helpers over lapin: bounded-time connect, topology declare/inspect/delete.

use crate::cli::{redact, Config, ExchangeType};
use crate::error::BenchError;
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use std::future::Future;
use std::time::Duration;

/// Longest a connect (TCP + AMQP handshake) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest one topology operation may take.
pub const OP_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the whole teardown (close, inspect, delete) may take.
pub const TEARDOWN: Duration = Duration::from_secs(8);
/// Longest one teardown operation may take; after the first timeout the rest is skipped.
const TEARDOWN_OP: Duration = Duration::from_secs(3);

/// Runs `f` for at most `d`; a timeout becomes an error string.
pub async fn within<T>(d: Duration, what: &str, f: impl Future<Output = lapin::Result<T>>) -> Result<T, String> {
    match tokio::time::timeout(d, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {d:?}")),
    }
}

/// Opens a connection named `name` (shown in the broker's connection list).
///
/// # Errors
/// [`BenchError::Connect`] on refusal, authentication failure or after [`CONNECT_TIMEOUT`].
pub async fn connect(uri: &str, name: &str) -> Result<Connection, BenchError> {
    let props = ConnectionProperties::default().with_connection_name(LongString::from(name.to_string()));
    within(CONNECT_TIMEOUT, "connect", Connection::connect(uri, props))
        .await
        .map_err(|reason| BenchError::Connect { uri: redact(uri), reason })
}

/// Opens a channel on `conn`.
///
/// # Errors
/// [`BenchError::Setup`] when the broker refuses or does not answer.
pub async fn channel(conn: &Connection) -> Result<Channel, BenchError> {
    within(OP_TIMEOUT, "channel.open", conn.create_channel()).await.map_err(BenchError::Setup)
}

/// Queue declare options for this run: durable when persistent or when the queue type
/// requires it (quorum, stream).
pub fn queue_options(cfg: &Config) -> QueueDeclareOptions {
    let typed = cfg.queue_args_text.iter().any(|kv| kv.starts_with("x-queue-type=") && !kv.ends_with("=classic"));
    QueueDeclareOptions { durable: cfg.persistent || typed, ..QueueDeclareOptions::default() }
}

/// Declares the exchange (when the bench owns it), declares and purges every queue and
/// binds it. Nothing happens with --predeclared.
///
/// # Errors
/// [`BenchError::Setup`] with the broker's reply (e.g. 406 when a queue exists with
/// other arguments).
pub async fn declare_topology(ch: &Channel, cfg: &Config) -> Result<(), BenchError> {
    if cfg.predeclared {
        return Ok(());
    }
    let ex = &cfg.exchange;
    if ex.declare {
        let kind = match ex.kind {
            ExchangeType::Direct => ExchangeKind::Direct,
            ExchangeType::Fanout => ExchangeKind::Fanout,
            ExchangeType::Topic => ExchangeKind::Topic,
            ExchangeType::Headers => ExchangeKind::Headers,
        };
        let opts = ExchangeDeclareOptions { durable: cfg.persistent, ..Default::default() };
        within(OP_TIMEOUT, "exchange.declare", ch.exchange_declare(ex.name.as_str().into(), kind, opts, FieldTable::default()))
            .await
            .map_err(BenchError::Setup)?;
    }
    if cfg.consumers_declare {
        // Each consumer's connection declares and binds its queue (`raw::start_consumers`).
        return Ok(());
    }
    let opts = queue_options(cfg);
    for q in &cfg.queues {
        within(OP_TIMEOUT, "queue.declare", ch.queue_declare(q.as_str().into(), opts, cfg.queue_args.clone()))
            .await
            .map_err(BenchError::Setup)?;
        within(OP_TIMEOUT, "queue.purge", ch.queue_purge(q.as_str().into(), QueuePurgeOptions::default()))
            .await
            .map_err(BenchError::Setup)?;
        if !ex.name.is_empty() {
            let (key, args) = binding(ex.kind, q);
            within(
                OP_TIMEOUT,
                "queue.bind",
                ch.queue_bind(q.as_str().into(), ex.name.as_str().into(), key, QueueBindOptions::default(), args),
            )
            .await
            .map_err(BenchError::Setup)?;
        }
    }
    Ok(())
}

/// Binding key and arguments of `queue` on an exchange of type `kind`.
pub(crate) fn binding(kind: ExchangeType, queue: &str) -> (ShortString, FieldTable) {
    match kind {
        ExchangeType::Fanout => ("".into(), FieldTable::default()),
        ExchangeType::Headers => ("".into(), headers_for(queue, true)),
        ExchangeType::Direct | ExchangeType::Topic => (queue.into(), FieldTable::default()),
    }
}

/// Header table routing to `queue` through a headers exchange (with `x-match=all` for
/// the binding side).
pub fn headers_for(queue: &str, binding: bool) -> FieldTable {
    let mut t = FieldTable::default();
    if binding {
        t.insert("x-match".into(), AMQPValue::LongString(LongString::from("all".to_string())));
    }
    t.insert("queue".into(), AMQPValue::LongString(LongString::from(queue.to_string())));
    t
}

/// Messages ready in each queue (passive queue.declare); `None` for a queue that could
/// not be inspected. Stops at the first failure or timeout (3 s).
pub async fn queue_depths(ch: &Channel, queues: &[String]) -> Vec<Option<u64>> {
    let mut out = vec![None; queues.len()];
    let opts = QueueDeclareOptions { passive: true, ..Default::default() };
    for (i, q) in queues.iter().enumerate() {
        match within(TEARDOWN_OP, "queue.declare passive", ch.queue_declare(q.as_str().into(), opts, FieldTable::default())).await {
            Ok(q) => out[i] = Some(u64::from(q.message_count())),
            Err(_) => break, // the channel is closed or the broker stalled: stop asking
        }
    }
    out
}

/// Deletes the queues and the bench's exchange (best effort; stops at the first failure).
pub async fn delete_topology(ch: &Channel, cfg: &Config) {
    for q in &cfg.queues {
        if within(TEARDOWN_OP, "queue.delete", ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await.is_err() {
            return;
        }
    }
    if cfg.exchange.declare {
        let _ =
            within(TEARDOWN_OP, "exchange.delete", ch.exchange_delete(cfg.exchange.name.as_str().into(), ExchangeDeleteOptions::default()))
                .await;
    }
}

/// Closes a connection, waiting at most 3 s for the broker's close-ok.
pub async fn close(conn: &Connection) {
    let _ = tokio::time::timeout(Duration::from_secs(3), conn.close(200, "bench done".into())).await;
}

/// The local PID of the broker: `--broker-pid`, else the process listening on the URI's
/// port when the host is loopback.
pub fn broker_pid(cfg: &Config) -> Option<u32> {
    if cfg.broker_pid.is_some() {
        return cfg.broker_pid;
    }
    if cfg.scenario == crate::cli::Scenario::Floor {
        // The relay is this process: no broker to measure.
        return None;
    }
    let uri: lapin::uri::AMQPUri = cfg.uri.parse().ok()?;
    let host = uri.authority.host.as_str();
    let local = matches!(host, "localhost" | "127.0.0.1" | "::1" | "[::1]") || host.starts_with("127.");
    if !local {
        return None;
    }
    crate::procfs::pid_listening_on(uri.authority.port)
}
