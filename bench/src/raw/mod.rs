//! The raw load engine (`--engine raw`, the default for amqp:// URIs): ringmq-bench's own
//! AMQP 0-9-1 client, built to cost far less per message than the broker it measures
//! (lapin spends 3.5-7 µs per message, more than ringmq does).
//!
//! # Shape
//! One task per connection, on the bench's single-threaded runtime, drives every channel of
//! its connection itself (`conn.rs`): no task, future, allocation or lock per message.
//! - A publish is one copy of a per-producer template (basic.publish, content header and
//!   body frames, encoded once at setup by amq-protocol); only the body's 16-byte tag and
//!   send time are written per message (`body.rs`).
//! - Publishes of all the connection's producers leave in one write per batch (up to 512
//!   per producer or 256 KiB), and encoding stops while 1 MiB is unwritten (the socket, not
//!   a message count, is the pipeline).
//! - Deliveries are parsed in place in the read buffer (`wire::Reader`): the delivery tag and
//!   redelivered flag of basic.deliver, the body size of the content header, the first 16
//!   body bytes; nothing is copied.
//! - Acks (one every --multi-ack-every deliveries, multiple=true when that is above 1) go into
//!   the same write buffer and leave with the next write.
//!
//! Setup (handshake, channel.open, confirm.select, basic.qos, basic.consume) and the closing
//! handshake go through the same frame handler as the load, so deliveries that arrive while
//! later channels are being opened are counted, never dropped.
//!
//! The figures are the lapin engine's: the same `Env` (counters, HDR histograms, tracker),
//! the same fixed-rate schedule without coordinated omission, the same stop and drain rules.
//!
//! # Limits
//! Plain TCP only (amqps:// needs `--engine lapin`); heartbeats are declined in
//! connection.tune-ok; PLAIN authentication.

mod conn;

use crate::error::BenchError;
use crate::run::Env;
use crate::wire::{method, FRAME_OVERHEAD};
use amq_protocol::protocol::{basic, channel, confirm, connection, queue, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use conn::{Conn, Role};
use std::rc::Rc;
use std::time::Duration;
use tokio::net::TcpStream;

/// Largest frame-max the engine asks for, bytes (RabbitMQ's default; a broker offering
/// less gets its own value).
const FRAME_MAX: u32 = 131_072;

/// A connection whose channels are open and set up, ready to be driven.
pub struct Ready(Conn);

/// Opens the consumers' connections (up to --channels-per-connection consumers each),
/// sets up their channels (basic.qos, basic.consume) and starts driving them; deliveries
/// are counted from the moment basic.consume is sent.
///
/// # Errors
/// [`BenchError::Connect`] when the broker cannot be reached or refuses the login,
/// [`BenchError::Setup`] when a channel cannot be opened or a consume is refused.
pub async fn start_consumers(env: &Rc<Env>) -> Result<Vec<tokio::task::JoinHandle<()>>, BenchError> {
    let cfg = &env.cfg;
    let mut tasks = Vec::new();
    for first in (0..cfg.consumers as usize).step_by(cfg.channels_per_connection as usize) {
        let (mut c, chans) = open_connection(env, "consumer", first, cfg.consumers).await?;
        for (i, ch) in chans {
            let qi = i % cfg.queues.len();
            if !cfg.auto_ack && cfg.prefetch > 0 {
                let qos = basic::Qos { prefetch_count: cfg.prefetch, global: false };
                c.call(ch, AMQPClass::Basic(basic::AMQPMethod::Qos(qos)), "basic.qos").await?;
            }
            if cfg.consumers_declare {
                declare_own_queue(&mut c, ch, cfg, qi).await?;
            }
            c.set_role(ch, Role::consumer(qi));
            let consume = basic::Consume {
                queue: cfg.queues[qi].as_str().into(),
                consumer_tag: format!("ringmq-bench-{i}").into(),
                no_local: false,
                no_ack: cfg.auto_ack,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            };
            c.call(ch, AMQPClass::Basic(basic::AMQPMethod::Consume(consume)), "basic.consume").await?;
        }
        tasks.push(tokio::task::spawn_local(c.drive()));
    }
    Ok(tasks)
}

/// `--consumers-declare`: queue `qi` declared (with the bench's options and arguments) and
/// bound to the bench's exchange on the consumer's own channel `ch`.
async fn declare_own_queue(c: &mut Conn, ch: u16, cfg: &crate::cli::Config, qi: usize) -> Result<(), BenchError> {
    let q = cfg.queues[qi].as_str();
    let opts = crate::amqp::queue_options(cfg);
    let declare = queue::Declare {
        queue: q.into(),
        passive: false,
        durable: opts.durable,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: cfg.queue_args.clone(),
    };
    c.call(ch, AMQPClass::Queue(queue::AMQPMethod::Declare(declare)), "queue.declare").await?;
    if !cfg.exchange.name.is_empty() {
        let (routing_key, arguments) = crate::amqp::binding(cfg.exchange.kind, q);
        let bind = queue::Bind { queue: q.into(), exchange: cfg.exchange.name.as_str().into(), routing_key, nowait: false, arguments };
        c.call(ch, AMQPClass::Queue(queue::AMQPMethod::Bind(bind)), "queue.bind").await?;
    }
    Ok(())
}

/// Opens the producers' connections (up to --channels-per-connection producers each) and
/// their channels (confirm.select with --confirm); nothing is published until
/// [`start_producers`].
///
/// # Errors
/// As [`start_consumers`].
pub async fn open_producers(env: &Rc<Env>) -> Result<Vec<Ready>, BenchError> {
    let cfg = &env.cfg;
    let mut out = Vec::new();
    for first in (0..cfg.producers as usize).step_by(cfg.channels_per_connection as usize) {
        let (mut c, chans) = open_connection(env, "producer", first, cfg.producers).await?;
        for (i, ch) in chans {
            if cfg.confirm > 0 {
                let select = confirm::Select { nowait: false };
                c.call(ch, AMQPClass::Confirm(confirm::AMQPMethod::Select(select)), "confirm.select").await?;
            }
            c.add_producer(ch, i as u16);
        }
        out.push(Ready(c));
    }
    Ok(out)
}

/// Starts publishing on every producer of `conns`. A fixed-rate schedule starts at
/// `schedule_start` (CLOCK_MONOTONIC ns). `finished` is called once per producer when it
/// has stopped and its confirms are in (or the drain timeout passed). The tasks end when
/// consumers stop (`Env::stop_consuming`), after closing their connections.
pub fn start_producers(conns: Vec<Ready>, schedule_start: u64, finished: Rc<dyn Fn()>) -> Vec<tokio::task::JoinHandle<()>> {
    conns
        .into_iter()
        .map(|Ready(mut c)| {
            c.start_publishing(schedule_start, finished.clone());
            tokio::task::spawn_local(c.drive())
        })
        .collect()
}

/// Opens the connection of `role`'s users `first..` (at most --channels-per-connection of
/// the `users` there are) and one channel each: the connection and (user index, channel).
async fn open_connection(env: &Rc<Env>, role: &str, first: usize, users: u32) -> Result<(Conn, Vec<(usize, u16)>), BenchError> {
    let per = env.cfg.channels_per_connection as usize;
    let mut c = connect(env, &format!("ringmq-bench {role} {}", first / per)).await?;
    let mut chans = Vec::new();
    for i in first..(first + per).min(users as usize) {
        chans.push((i, c.open_channel().await?));
    }
    Ok((c, chans))
}

/// TCP connect, AMQP handshake (PLAIN login, tune, connection.open), bounded by
/// [`crate::amqp::CONNECT_TIMEOUT`] as a whole.
async fn connect(env: &Rc<Env>, name: &str) -> Result<Conn, BenchError> {
    let failed = |reason: String| BenchError::Connect { uri: crate::cli::redact(&env.cfg.uri), reason };
    let uri: lapin::uri::AMQPUri = env.cfg.uri.parse().map_err(|e| failed(format!("bad URI: {e}")))?;
    let handshake = async {
        let stream = TcpStream::connect((uri.authority.host.as_str(), uri.authority.port)).await.map_err(|e| e.to_string())?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let mut c = Conn::new(env.clone(), stream, FRAME_MAX as usize + FRAME_OVERHEAD);
        c.send_raw(b"AMQP\x00\x00\x09\x01");
        c.expect(0, "connection.start").await.map_err(|e| e.to_string())?;
        let start_ok = connection::StartOk {
            client_properties: client_properties(name),
            mechanism: "PLAIN".into(),
            response: LongString::from(format!("\0{}\0{}", uri.authority.userinfo.username, uri.authority.userinfo.password)),
            locale: "en_US".into(),
        };
        let tune = c.call(0, AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)), "connection.start-ok").await;
        let Ok(AMQPClass::Connection(connection::AMQPMethod::Tune(tune))) = tune else {
            return Err(format!("login refused or no connection.tune: {}", tune.err().map(|e| e.to_string()).unwrap_or_default()));
        };
        let frame_max = match (tune.frame_max, uri.query.frame_max) {
            (0, q) => q.unwrap_or(FRAME_MAX),
            (s, q) => s.min(q.unwrap_or(FRAME_MAX)),
        };
        let channel_max = if tune.channel_max == 0 { u16::MAX } else { tune.channel_max };
        let ok = connection::TuneOk { channel_max, frame_max, heartbeat: 0 };
        c.send(0, &AMQPClass::Connection(connection::AMQPMethod::TuneOk(ok)));
        c.set_limits(frame_max, channel_max);
        let open = connection::Open { virtual_host: uri.vhost.as_str().into() };
        c.call(0, AMQPClass::Connection(connection::AMQPMethod::Open(open)), "connection.open").await.map_err(|e| e.to_string())?;
        Ok(c)
    };
    match tokio::time::timeout(crate::amqp::CONNECT_TIMEOUT, handshake).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(reason)) => Err(failed(reason)),
        Err(_) => Err(failed(format!("no answer within {:?}", crate::amqp::CONNECT_TIMEOUT))),
    }
}

/// connection.start-ok's client-properties: product, connection name, capabilities.
fn client_properties(name: &str) -> FieldTable {
    let text = |s: &str| AMQPValue::LongString(LongString::from(s.to_string()));
    let mut caps = FieldTable::default();
    for cap in ["publisher_confirms", "consumer_cancel_notify", "basic.nack", "connection.blocked"] {
        caps.insert(cap.into(), AMQPValue::Boolean(true));
    }
    let mut t = FieldTable::default();
    t.insert("product".into(), text("ringmq-bench raw engine"));
    t.insert("version".into(), text(env!("CARGO_PKG_VERSION")));
    t.insert("connection_name".into(), text(name));
    t.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    t
}

impl Conn {
    /// Opens the next channel; returns its number.
    async fn open_channel(&mut self) -> Result<u16, BenchError> {
        let ch = self.next_channel().ok_or_else(|| BenchError::Setup("channel.open: channel-max reached".into()))?;
        self.call(ch, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})), "channel.open").await?;
        Ok(ch)
    }

    /// Sends `m` on `ch` and waits (at most [`crate::amqp::OP_TIMEOUT`]) for the broker's
    /// reply on that channel.
    ///
    /// # Errors
    /// [`BenchError::Setup`] naming `what` when the broker closes the channel or the
    /// connection, the socket fails, or no reply comes in time.
    async fn call(&mut self, ch: u16, m: AMQPClass, what: &str) -> Result<AMQPClass, BenchError> {
        self.send(ch, &m);
        self.expect(ch, what).await
    }

    /// Waits for the next reply method on `ch` (see [`Conn::call`]).
    async fn expect(&mut self, ch: u16, what: &str) -> Result<AMQPClass, BenchError> {
        match tokio::time::timeout(crate::amqp::OP_TIMEOUT, self.reply(ch)).await {
            Ok(Ok(m)) => Ok(m),
            Ok(Err(e)) => Err(BenchError::Setup(format!("{what}: {e}"))),
            Err(_) => Err(BenchError::Setup(format!("{what}: no answer within {:?}", crate::amqp::OP_TIMEOUT))),
        }
    }

    /// Appends one method frame to the write buffer.
    fn send(&mut self, ch: u16, m: &AMQPClass) {
        method(self.out_mut(), ch, m);
    }
}

/// Longest the closing handshake may take before the socket is just dropped.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use crate::cli::{Cli, Command, Config, Scenario};
    use clap::Parser;
    use serde_json::Value;

    /// Runs the floor scenario with `flags` (the raw engine against the bench's relay, over
    /// loopback sockets) and returns the JSON figures.
    fn floor(flags: &[&str]) -> serde_json::Map<String, Value> {
        let args = ["ringmq-bench", "floor", "--quiet", "--drain-timeout", "5"].iter().chain(flags);
        let Command::Floor(f) = Cli::try_parse_from(args).expect("flags").command else { unreachable!("floor") };
        let mut cfg = Config::resolve(Scenario::Floor, f).expect("config");
        cfg.uri = format!("amqp://guest:guest@{}/%2f", crate::floor::start().expect("relay"));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let out = tokio::task::LocalSet::new().block_on(&rt, crate::run::run(cfg, Default::default())).expect("ran");
        assert_eq!(out.json["engine"], "raw");
        out.json
    }

    fn n(j: &serde_json::Map<String, Value>, k: &str) -> u64 {
        j[k].as_u64().unwrap_or_else(|| panic!("{k} = {}", j[k]))
    }

    #[test]
    fn every_publish_is_confirmed_and_delivered_once_with_its_latency() {
        let j = floor(&["--duration", "1", "--rate", "3000", "--size", "1024", "--multi-ack-every", "7"]);
        let sent = n(&j, "sent");
        assert!(sent > 2000, "about 3,000 due in 1 s, sent {sent}");
        assert_eq!((n(&j, "confirmed"), n(&j, "received")), (sent, sent));
        assert_eq!((n(&j, "lost"), n(&j, "duplicates"), n(&j, "errors"), n(&j, "foreign")), (0, 0, 0, 0));
        assert!(j["e2e_p50_us"].as_f64().is_some_and(|us| us > 0.0), "e2e latency recorded: {}", j["e2e_p50_us"]);
        assert!(j["confirm_p99_us"].as_f64().is_some_and(|us| us > 0.0), "confirm latency recorded");
    }

    #[test]
    fn bodies_larger_than_a_frame_are_split_and_read_back_whole() {
        // 300,000 B bodies: three body frames each at the relay's frame-max of 128 KiB.
        let j = floor(&["--duration", "1", "--rate", "200", "--size", "300000", "--confirm", "5"]);
        let sent = n(&j, "sent");
        assert!(sent > 100, "sent {sent}");
        assert_eq!((n(&j, "received"), n(&j, "lost"), n(&j, "duplicates"), n(&j, "foreign")), (sent, 0, 0, 0));
        assert_eq!(j["recv_mb_s"].as_f64().map(|_| ()), Some(()));
    }

    #[test]
    fn unlimited_rate_publishes_flow_until_the_stop_and_all_arrive() {
        let j = floor(&["--duration", "1", "--rate", "0", "--confirm", "0", "--auto-ack", "--size", "16", "--producers", "2"]);
        let sent = n(&j, "sent");
        assert!(sent > 10_000, "sent {sent}");
        assert_eq!((n(&j, "received"), n(&j, "lost"), n(&j, "duplicates"), n(&j, "errors")), (sent, 0, 0, 0));
    }
}
