//! Command line: one subcommand per scenario, the same flags for all of them (in the
//! spirit of RabbitMQ PerfTest and lavinmqperf), and the per-scenario defaults that fill
//! whatever the user left out.

use crate::error::BenchError;
use clap::{Args, Parser, Subcommand, ValueEnum};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use std::path::PathBuf;

/// Default broker: local, guest/guest, vhost "/".
pub const DEFAULT_URI: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// ringmq-bench: load generator for any AMQP 0-9-1 broker.
#[derive(Parser, Debug)]
#[command(name = "ringmq-bench", version, about, long_about = None)]
pub struct Cli {
    /// Scenario to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Scenarios. Each takes the same flags; a scenario only changes the defaults.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generic run: every flag at its plain default (1 → 1, 16 B, auto-ack, unlimited rate).
    Run(Flags),
    /// 1 producer → 1 queue → 1 consumer as fast as possible (16 B, auto-ack).
    Throughput(Flags),
    /// Fixed rate (1,000 msgs/s, 1 KiB, confirm window 100, manual ack, prefetch 100).
    Latency(Flags),
    /// The latency scenario (same defaults and flags) against the bench's own relay on
    /// loopback instead of --uri: publish in, deliver out, no broker logic — this machine's
    /// floor for every latency figure (`floor.rs`; `compare.sh --floor`).
    Floor(Flags),
    /// 1 producer → fanout exchange → 3 queues, one consumer each.
    Fanout(Flags),
    /// 1,000 queues × 10 msgs/s, one producer and one consumer per queue.
    ManyQueues(Flags),
    /// Fill one queue with --messages (default 1,000,000 × 16 B), then drain it.
    Backlog(Flags),
    /// Open a connection and a channel, close it; repeat (--producers workers in parallel).
    ConnectionChurn(Flags),
    /// Declare a queue, delete it; repeat (--producers workers in parallel).
    QueueChurn(Flags),
    /// A queue with a message TTL and a dead-letter exchange (x-message-ttl=60000,
    /// x-dead-letter-exchange=amq.fanout unless --queue-args says otherwise) under 1 KiB,
    /// confirm window 100, prefetch 100, basic.ack per message, unlimited rate: what the TTL
    /// path costs when nothing expires.
    TtlDlx(Flags),
    /// Median of each figure of two files of --json lines (A and B) and the ratio A/B.
    Report(ReportArgs),
}

/// Exchange type for --exchange-type.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExchangeType {
    /// Routing key = queue name (default exchange "" unless --exchange is given).
    Direct,
    /// Every bound queue gets a copy.
    Fanout,
    /// Bound with the queue name as binding key.
    Topic,
    /// Bound with x-match=all on header `queue`.
    Headers,
}

impl ExchangeType {
    /// AMQP name of the type.
    pub fn name(self) -> &'static str {
        match self {
            ExchangeType::Direct => "direct",
            ExchangeType::Fanout => "fanout",
            ExchangeType::Topic => "topic",
            ExchangeType::Headers => "headers",
        }
    }
}

/// The client that produces and consumes (--engine).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// ringmq-bench's own AMQP 0-9-1 client, built for load (`raw/`): 0.1-0.6 µs of CPU per
    /// message at full speed, where lapin takes 3.5-7. Plain TCP only.
    Raw,
    /// The lapin client: the cross-check, and the engine for amqps:// URIs.
    Lapin,
}

impl Engine {
    /// Name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Raw => "raw",
            Engine::Lapin => "lapin",
        }
    }
}

/// Flags shared by all scenarios. Unset options take the scenario's default.
#[derive(Args, Debug, Clone)]
pub struct Flags {
    /// Broker URI.
    #[arg(long, default_value = DEFAULT_URI)]
    pub uri: String,
    /// Number of producers (one channel each).
    #[arg(long)]
    pub producers: Option<u32>,
    /// Number of consumers (one channel each).
    #[arg(long)]
    pub consumers: Option<u32>,
    /// Queues: a count (`--queues 1000` → ringmq-bench-1 … ringmq-bench-1000), a pattern
    /// with %d numbered 1..=--queue-count, or one literal name. Producer i publishes to
    /// queue i mod Q, consumer i consumes queue i mod Q.
    #[arg(long)]
    pub queues: Option<String>,
    /// How many queues a %d pattern expands to.
    #[arg(long)]
    pub queue_count: Option<u32>,
    /// Message body size in bytes (≥ 16 to measure latency and loss).
    #[arg(long)]
    pub size: Option<usize>,
    /// Messages per second per producer; 0 = as fast as possible.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Publisher confirms with at most N messages outstanding per producer; 0 = off.
    #[arg(long)]
    pub confirm: Option<u32>,
    /// Publish with mandatory=true and count basic.return.
    #[arg(long)]
    pub mandatory: bool,
    /// delivery_mode=2 and durable queues.
    #[arg(long)]
    pub persistent: bool,
    /// Message priorities: message k of a producer carries priority k mod N (0..N-1);
    /// 0 = no priority property. Pair with `--queue-args x-max-priority=N`.
    #[arg(long, default_value_t = 0)]
    pub priorities: u8,
    /// Per-message TTL: every message carries `expiration` = this many ms (none if absent).
    #[arg(long)]
    pub expiration: Option<u64>,
    /// Consume with no_ack=true.
    #[arg(long, conflicts_with = "multi_ack_every")]
    pub auto_ack: bool,
    /// Manual ack: one basic.ack (multiple=true when N > 1) every N deliveries.
    #[arg(long)]
    pub multi_ack_every: Option<u32>,
    /// basic.qos prefetch count per consumer; 0 = unlimited.
    #[arg(long)]
    pub prefetch: Option<u16>,
    /// Exchange type; with direct and no --exchange the default exchange "" is used.
    #[arg(long, value_enum)]
    pub exchange_type: Option<ExchangeType>,
    /// Exchange name (default "" for direct, ringmq-bench-<type> otherwise).
    #[arg(long)]
    pub exchange: Option<String>,
    /// Bind N queues to a fanout exchange (implies --exchange-type fanout).
    #[arg(long)]
    pub fanout_queues: Option<u32>,
    /// Seconds of publishing (churn scenarios: seconds of churning).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Messages per producer, then stop (the run still ends at --duration).
    #[arg(long)]
    pub messages: Option<u64>,
    /// Queue arguments, `k=v` (repeat or comma-separate): integers and true/false are
    /// typed, anything else is a string (x-queue-type=quorum, x-max-length=1000).
    #[arg(long, value_delimiter = ',')]
    pub queue_args: Vec<String>,
    /// Queues (and exchange) already exist: neither declare, purge nor delete them.
    #[arg(long)]
    pub predeclared: bool,
    /// Each consumer declares (and binds) its queue on its own connection before consuming,
    /// as consumer applications written for RabbitMQ do, instead of the bench's setup
    /// connection (ringmq puts a queue on the core of the connection that declares it).
    /// Raw engine only; every queue needs a consumer.
    #[arg(long)]
    pub consumers_declare: bool,
    /// Print one JSON line with the result on stdout (the summary goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Seconds to wait, after publishing stops, for outstanding confirms and deliveries.
    #[arg(long)]
    pub drain_timeout: Option<f64>,
    /// PID of the broker, for its CPU time and RSS (default: the local process listening
    /// on the URI's port, if any).
    #[arg(long)]
    pub broker_pid: Option<u32>,
    /// Producer (and consumer) channels sharing one connection.
    #[arg(long)]
    pub channels_per_connection: Option<u32>,
    /// Publishes in flight inside the client library per producer (write pipelining;
    /// lapin engine: the raw engine stops encoding while 1 MiB is unwritten instead).
    #[arg(long, default_value_t = 256)]
    pub pipeline: u32,
    /// Client for producers and consumers [default: raw, lapin for amqps:// URIs]. Setup,
    /// teardown and the churn scenarios always use lapin.
    #[arg(long, value_enum)]
    pub engine: Option<Engine>,
    /// Free text copied into the JSON result (e.g. "ringmq fsync=batch").
    #[arg(long)]
    pub label: Option<String>,
    /// Do not delete the queues at the end.
    #[arg(long)]
    pub keep_queues: bool,
    /// No progress lines.
    #[arg(long)]
    pub quiet: bool,
    /// Exit 4 when a message was lost or duplicated or a client error occurred.
    #[arg(long)]
    pub strict: bool,
}

/// Arguments of `report`.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// JSON lines of side A (one per round).
    pub a: PathBuf,
    /// JSON lines of side B.
    pub b: PathBuf,
    /// Name of side A.
    #[arg(long, default_value = "A")]
    pub label_a: String,
    /// Name of side B.
    #[arg(long, default_value = "B")]
    pub label_b: String,
}

/// Which scenario a run is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// See [`Command::Run`].
    Run,
    /// See [`Command::Throughput`].
    Throughput,
    /// See [`Command::Latency`].
    Latency,
    /// See [`Command::Floor`].
    Floor,
    /// See [`Command::Fanout`].
    Fanout,
    /// See [`Command::ManyQueues`].
    ManyQueues,
    /// See [`Command::Backlog`].
    Backlog,
    /// See [`Command::ConnectionChurn`].
    ConnectionChurn,
    /// See [`Command::QueueChurn`].
    QueueChurn,
    /// See [`Command::TtlDlx`].
    TtlDlx,
}

impl Scenario {
    /// Subcommand name.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Run => "run",
            Scenario::Throughput => "throughput",
            Scenario::Latency => "latency",
            Scenario::Floor => "floor",
            Scenario::Fanout => "fanout",
            Scenario::ManyQueues => "many-queues",
            Scenario::Backlog => "backlog",
            Scenario::ConnectionChurn => "connection-churn",
            Scenario::QueueChurn => "queue-churn",
            Scenario::TtlDlx => "ttl-dlx",
        }
    }
}

/// Exchange the producers publish to.
#[derive(Clone, Debug)]
pub struct ExchangeSpec {
    /// Name ("" = default exchange).
    pub name: String,
    /// Type.
    pub kind: ExchangeType,
    /// Declared (and deleted) by the bench: not "", not amq.*, not --predeclared.
    pub declare: bool,
}

/// A fully resolved run configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// Scenario.
    pub scenario: Scenario,
    /// Broker URI.
    pub uri: String,
    /// Producers (churn: parallel workers).
    pub producers: u32,
    /// Consumers.
    pub consumers: u32,
    /// Queue names, in index order.
    pub queues: Vec<String>,
    /// Body size, bytes.
    pub size: usize,
    /// msgs/s per producer, 0 = unlimited.
    pub rate: f64,
    /// Confirm window per producer, 0 = no confirms.
    pub confirm: u32,
    /// mandatory flag on publish.
    pub mandatory: bool,
    /// delivery_mode 2 + durable queues.
    pub persistent: bool,
    /// Priority levels cycled through by each producer's messages (0 = no priority property).
    pub priorities: u8,
    /// Per-message `expiration`, ms.
    pub expiration: Option<u64>,
    /// no_ack consumers.
    pub auto_ack: bool,
    /// Ack every N deliveries (manual ack only).
    pub multi_ack_every: u32,
    /// basic.qos prefetch, 0 = unlimited.
    pub prefetch: u16,
    /// Exchange.
    pub exchange: ExchangeSpec,
    /// True when every queue gets every message (fanout).
    pub fanout: bool,
    /// Seconds of publishing.
    pub duration_s: f64,
    /// Messages per producer, `None` = until --duration.
    pub messages: Option<u64>,
    /// Queue arguments.
    pub queue_args: FieldTable,
    /// Queue arguments as given, for the report.
    pub queue_args_text: Vec<String>,
    /// Declare nothing, delete nothing.
    pub predeclared: bool,
    /// Queues are declared by their consumers' connections (`--consumers-declare`).
    pub consumers_declare: bool,
    /// Emit a JSON line.
    pub json: bool,
    /// Seconds allowed for the drain.
    pub drain_timeout_s: f64,
    /// Broker PID given by the user.
    pub broker_pid: Option<u32>,
    /// Channels per connection.
    pub channels_per_connection: u32,
    /// Publishes in flight in the client per producer.
    pub pipeline: u32,
    /// Client for producers and consumers.
    pub engine: Engine,
    /// Free text for the report.
    pub label: Option<String>,
    /// Keep queues at the end.
    pub keep_queues: bool,
    /// No progress lines.
    pub quiet: bool,
    /// Exit 4 on lost/duplicated messages or errors.
    pub strict: bool,
}

impl Config {
    /// Resolves flags with the defaults of `scenario`.
    ///
    /// # Errors
    /// [`BenchError::Usage`] for contradictory or out-of-range flags.
    pub fn resolve(scenario: Scenario, f: Flags) -> Result<Config, BenchError> {
        use Scenario::*;
        let usage = |m: String| Err(BenchError::Usage(m));
        // Per-scenario defaults: (producers, consumers, queues, size, rate, confirm,
        // manual-ack, prefetch, duration, messages, drain).
        let (dp, dc, dq, dsize, drate, dconf, dmanual, dpref, ddur, dmsgs, ddrain) = match scenario {
            Run | Throughput => (1, 1, 1, 16, 0.0, 0, false, 0, 10.0, None, 10.0),
            Latency | Floor => (1, 1, 1, 1024, 1000.0, 100, true, 100, 10.0, None, 10.0),
            Fanout => (1, 3, 3, 16, 0.0, 0, false, 0, 10.0, None, 10.0),
            ManyQueues => (1000, 1000, 1000, 16, 10.0, 0, false, 0, 10.0, None, 10.0),
            Backlog => (1, 1, 1, 16, 0.0, 0, false, 0, 600.0, Some(1_000_000), 600.0),
            ConnectionChurn | QueueChurn => (1, 0, 1, 16, 0.0, 0, false, 0, 10.0, None, 5.0),
            TtlDlx => (1, 1, 1, 1024, 0.0, 100, true, 100, 10.0, None, 10.0),
        };
        let fanout_queues = f.fanout_queues.or((scenario == Fanout).then_some(dq));
        let kind = match (f.exchange_type, fanout_queues) {
            (Some(t), Some(_)) if t != ExchangeType::Fanout => return usage("--fanout-queues needs --exchange-type fanout".into()),
            (Some(t), _) => t,
            (None, Some(_)) => ExchangeType::Fanout,
            (None, None) => ExchangeType::Direct,
        };
        let exchange_name = f.exchange.clone().unwrap_or_else(|| match kind {
            ExchangeType::Direct => String::new(),
            k => format!("ringmq-bench-{}", k.name()),
        });
        let exchange = ExchangeSpec {
            declare: !exchange_name.is_empty() && !exchange_name.starts_with("amq.") && !f.predeclared,
            name: exchange_name,
            kind,
        };
        let queue_count = fanout_queues.or(f.queue_count);
        let queues = queue_names(f.queues.as_deref(), queue_count, dq)?;
        if queues.is_empty() {
            return usage("no queue".into());
        }
        let manual = if f.auto_ack { false } else { f.multi_ack_every.is_some() || dmanual };
        let consumers = f.consumers.unwrap_or(if fanout_queues.is_some() { queues.len() as u32 } else { dc });
        let producers = f.producers.unwrap_or(dp);
        if producers > u32::from(u16::MAX) {
            return usage("at most 65535 producers".into());
        }
        let prefetch = f.prefetch.unwrap_or(dpref);
        let mut multi = f.multi_ack_every.unwrap_or(1).max(1);
        if manual && prefetch > 0 && multi > u32::from(prefetch) {
            eprintln!("note: --multi-ack-every {multi} > --prefetch {prefetch}: acking every {prefetch}");
            multi = u32::from(prefetch);
        }
        let rate = f.rate.unwrap_or(drate);
        if !(rate >= 0.0 && rate.is_finite()) {
            return usage("--rate must be ≥ 0".into());
        }
        let duration_s = f.duration.unwrap_or(if f.messages.is_some() { 600.0 } else { ddur });
        if !(duration_s > 0.0 && duration_s.is_finite()) {
            return usage("--duration must be > 0".into());
        }
        let tls = f.uri.starts_with("amqps:");
        let engine = match f.engine {
            Some(Engine::Raw) if tls => return usage("--engine raw speaks plain TCP only; use --engine lapin for amqps://".into()),
            Some(e) => e,
            None if tls => Engine::Lapin,
            None => Engine::Raw,
        };
        if f.consumers_declare && engine != Engine::Raw {
            return usage("--consumers-declare needs the raw engine".into());
        }
        let ttl_dlx = ["x-message-ttl=60000".to_string(), "x-dead-letter-exchange=amq.fanout".to_string()];
        let queue_args = if scenario == TtlDlx && f.queue_args.is_empty() { &ttl_dlx[..] } else { &f.queue_args[..] };
        let (queue_args, queue_args_text) = parse_queue_args(queue_args)?;
        Ok(Config {
            scenario,
            uri: f.uri,
            producers,
            consumers,
            size: f.size.unwrap_or(dsize),
            rate,
            confirm: f.confirm.unwrap_or(dconf),
            mandatory: f.mandatory,
            persistent: f.persistent,
            priorities: f.priorities,
            expiration: f.expiration,
            auto_ack: !manual,
            multi_ack_every: multi,
            prefetch,
            fanout: kind == ExchangeType::Fanout,
            exchange,
            queues,
            duration_s,
            messages: f.messages.or(dmsgs),
            queue_args,
            queue_args_text,
            predeclared: f.predeclared,
            consumers_declare: f.consumers_declare && !f.predeclared,
            json: f.json,
            drain_timeout_s: f.drain_timeout.unwrap_or(ddrain).max(0.0),
            broker_pid: f.broker_pid,
            channels_per_connection: f.channels_per_connection.unwrap_or(100).max(1),
            pipeline: f.pipeline.max(1),
            engine,
            label: f.label,
            keep_queues: f.keep_queues,
            quiet: f.quiet,
            strict: f.strict,
        })
    }

    /// Messages each producer sends at most: --messages, and never past 2^32 (a body's
    /// sequence number has 32 bits).
    pub fn message_limit(&self) -> u64 {
        self.messages.unwrap_or(u64::MAX).min(u64::from(u32::MAX) + 1)
    }

    /// The URI with its password replaced by `***`.
    pub fn uri_redacted(&self) -> String {
        redact(&self.uri)
    }
}

/// Replaces the password of an amqp:// URI by `***`.
pub fn redact(uri: &str) -> String {
    if let Some((scheme, rest)) = uri.split_once("://") {
        if let Some((userinfo, host)) = rest.split_once('@') {
            if let Some((user, _)) = userinfo.split_once(':') {
                return format!("{scheme}://{user}:***@{host}");
            }
        }
    }
    uri.to_string()
}

fn queue_names(spec: Option<&str>, count: Option<u32>, default_count: u32) -> Result<Vec<String>, BenchError> {
    let expand = |pattern: &str, n: u32| (1..=n).map(|i| pattern.replace("%d", &i.to_string())).collect();
    match spec {
        None => Ok(expand("ringmq-bench-%d", count.unwrap_or(default_count))),
        Some(s) => {
            if let Ok(n) = s.parse::<u32>() {
                Ok(expand("ringmq-bench-%d", n))
            } else if s.contains("%d") {
                Ok(expand(s, count.unwrap_or(default_count)))
            } else if count.unwrap_or(1) == 1 {
                Ok(vec![s.to_string()])
            } else {
                Err(BenchError::Usage(format!("--queues {s} names one queue; use a %d pattern for several")))
            }
        }
    }
}

fn parse_queue_args(args: &[String]) -> Result<(FieldTable, Vec<String>), BenchError> {
    let mut table = FieldTable::default();
    for kv in args {
        let (k, v) = kv.split_once('=').ok_or_else(|| BenchError::Usage(format!("--queue-args {kv}: expected k=v")))?;
        let value = if let Ok(i) = v.parse::<i64>() {
            AMQPValue::LongLongInt(i)
        } else if v == "true" || v == "false" {
            AMQPValue::Boolean(v == "true")
        } else {
            AMQPValue::LongString(LongString::from(v.to_string()))
        };
        table.insert(ShortString::from(k.to_string()), value);
    }
    Ok((table, args.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(extra: &[&str]) -> Flags {
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            f: Flags,
        }
        let mut argv = vec!["t"];
        argv.extend_from_slice(extra);
        T::parse_from(argv).f
    }

    #[test]
    fn queue_specs_expand() {
        let c = Config::resolve(Scenario::Run, flags(&["--queues", "3"])).unwrap();
        assert_eq!(c.queues, ["ringmq-bench-1", "ringmq-bench-2", "ringmq-bench-3"]);
        let c = Config::resolve(Scenario::Run, flags(&["--queues", "q.%d", "--queue-count", "2"])).unwrap();
        assert_eq!(c.queues, ["q.1", "q.2"]);
        let c = Config::resolve(Scenario::Run, flags(&["--queues", "orders"])).unwrap();
        assert_eq!(c.queues, ["orders"]);
    }

    #[test]
    fn latency_preset_is_manual_ack_with_confirms_and_flags_override() {
        let c = Config::resolve(Scenario::Latency, flags(&[])).unwrap();
        assert!(!c.auto_ack);
        assert_eq!((c.confirm, c.prefetch, c.size, c.rate), (100, 100, 1024, 1000.0));
        let c = Config::resolve(Scenario::Latency, flags(&["--auto-ack", "--rate", "5"])).unwrap();
        assert!(c.auto_ack);
        assert_eq!(c.rate, 5.0);
    }

    #[test]
    fn ttl_dlx_preset_declares_a_ttl_queue_with_a_dlx_unless_told_otherwise() {
        let c = Config::resolve(Scenario::TtlDlx, flags(&[])).unwrap();
        assert!(!c.auto_ack);
        assert_eq!((c.confirm, c.prefetch, c.size, c.rate), (100, 100, 1024, 0.0));
        assert_eq!(c.queue_args_text, ["x-message-ttl=60000", "x-dead-letter-exchange=amq.fanout"]);
        let c = Config::resolve(Scenario::TtlDlx, flags(&["--queue-args", "x-message-ttl=5"])).unwrap();
        assert_eq!(c.queue_args_text, ["x-message-ttl=5"]);
    }

    #[test]
    fn fanout_queues_get_one_consumer_each() {
        let c = Config::resolve(Scenario::Run, flags(&["--fanout-queues", "4"])).unwrap();
        assert!(c.fanout);
        assert_eq!((c.queues.len(), c.consumers), (4, 4));
        assert_eq!(c.exchange.name, "ringmq-bench-fanout");
    }

    #[test]
    fn multi_ack_is_clamped_to_prefetch() {
        let c = Config::resolve(Scenario::Run, flags(&["--multi-ack-every", "500", "--prefetch", "100"])).unwrap();
        assert_eq!(c.multi_ack_every, 100);
    }

    #[test]
    fn password_is_redacted() {
        assert_eq!(redact("amqp://guest:secret@h:1/%2f"), "amqp://guest:***@h:1/%2f");
    }
}
