//! Configuration: command-line flags (clap) over an optional TOML file over defaults.
//!
//! Defaults are what a RabbitMQ user expects of a fresh node: AMQP on 127.0.0.1:5672,
//! data in ./data, user guest/guest allowed from loopback only, vhost `/`, metrics on
//! 127.0.0.1:15692/metrics.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use serde::Deserialize;

/// Command-line flags. Every flag can also be set in the TOML file given by `--config`
/// (same names with `_` for `-`); a flag given on the command line wins.
#[derive(Parser, Debug, Default)]
#[command(name = "ringmq", version, about = "ringmq: an AMQP 0-9-1 broker (io_uring, thread-per-core)")]
pub struct Cli {
    /// AMQP listen address [default: 127.0.0.1:5672]
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<SocketAddr>,
    /// Data directory (metadata and queue segments) [default: ./data]
    #[arg(long, value_name = "PATH")]
    pub data_dir: Option<PathBuf>,
    /// Number of cores (executors) [default: all available]
    #[arg(long, value_name = "N")]
    pub cores: Option<u32>,
    /// Prometheus metrics listen address, serving /metrics [default: 127.0.0.1:15692]
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_listen: Option<SocketAddr>,
    /// TOML configuration file
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Heartbeat interval offered to clients, in seconds (0 disables) [default: 60]
    #[arg(long, value_name = "SECONDS")]
    pub heartbeat: Option<u16>,
    /// Largest frame offered to clients, in bytes [default: 131072]
    #[arg(long, value_name = "BYTES")]
    pub frame_max: Option<u32>,
    /// Most channels per connection [default: 2047]
    #[arg(long, value_name = "N")]
    pub channel_max: Option<u16>,
    /// Delivery acknowledgement timeout, in ms (per queue: x-consumer-timeout) [default: 1800000]
    #[arg(long, value_name = "MS")]
    pub consumer_timeout_ms: Option<u64>,
    /// Queue segment file size, in bytes [default: 67108864]
    #[arg(long, value_name = "BYTES")]
    pub segment_bytes: Option<u64>,
    /// Idle µs a core polls before it sleeps in io_uring (0 = sleep at once) [default: 0].
    /// Spinning trades CPU for wake-up latency: for machines whose cores are the broker's alone.
    #[arg(long, value_name = "US")]
    pub spin_before_park_us: Option<u64>,
    /// Free bytes on the data directory's filesystem below which the disk alarm is raised:
    /// publishing connections are blocked (connection.blocked) until space is back [default: 50000000]
    #[arg(long, value_name = "BYTES")]
    pub disk_free_limit: Option<u64>,
    /// Log filter (tracing env-filter syntax, e.g. "info" or "ringmq=debug") [default: info]
    #[arg(long, value_name = "FILTER")]
    pub log: Option<String>,
}

/// Default disk alarm threshold, bytes (RabbitMQ's `disk_free_limit` default, 50 MB).
pub const DEFAULT_DISK_FREE_LIMIT: u64 = 50_000_000;

/// A user allowed to log in.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct User {
    /// User name.
    pub name: String,
    /// Password (PLAIN / AMQPLAIN).
    pub password: String,
    /// Only from loopback addresses (RabbitMQ's loopback_users; true for guest).
    #[serde(default)]
    pub loopback_only: bool,
}

/// Idle time a core polls its rings before it sleeps, µs: 0, off by default. Measured on
/// 2 cores shared with the load generator: at 1,000 msgs/s (`ringmq-bench latency`) 30 µs
/// lowered e2e p99 from 359 to 298 µs, confirm p99 from 401 to 269 µs and CPU per message
/// (each sleep costs a membarrier IPI and a context switch); flat out (`run --size 1024
/// --confirm 100 --prefetch 100`) it took the CPU from the clients and cut throughput from
/// 140k to 84k msgs/s. Turn it on where the broker has its cores to itself.
pub const DEFAULT_SPIN_BEFORE_PARK_US: u64 = 0;

/// The TOML file's shape: every field optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    data_dir: Option<PathBuf>,
    cores: Option<u32>,
    metrics_listen: Option<SocketAddr>,
    heartbeat: Option<u16>,
    frame_max: Option<u32>,
    channel_max: Option<u16>,
    consumer_timeout_ms: Option<u64>,
    segment_bytes: Option<u64>,
    spin_before_park_us: Option<u64>,
    disk_free_limit: Option<u64>,
    log: Option<String>,
    users: Option<Vec<User>>,
    vhosts: Option<Vec<String>>,
}

/// Effective configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// AMQP listen address.
    pub listen: SocketAddr,
    /// Data directory.
    pub data_dir: PathBuf,
    /// Executors.
    pub cores: u32,
    /// Metrics listen address.
    pub metrics_listen: SocketAddr,
    /// Heartbeat offered, seconds.
    pub heartbeat: u16,
    /// frame_max offered, bytes (≥ 4096).
    pub frame_max: u32,
    /// channel_max offered.
    pub channel_max: u16,
    /// Default delivery acknowledgement timeout, ms.
    pub consumer_timeout_ms: u64,
    /// Segment size, bytes.
    pub segment_bytes: u64,
    /// Idle time a core polls before sleeping, µs (0 = no spinning).
    pub spin_before_park_us: u64,
    /// Disk alarm threshold: free bytes on the data directory's filesystem (RabbitMQ's
    /// `disk_free_limit`, default 50 MB; 0 = never).
    pub disk_free_limit: u64,
    /// Log filter.
    pub log: String,
    /// Users.
    pub users: Vec<User>,
    /// Vhosts created at start.
    pub vhosts: Vec<String>,
    /// This node's Raft id.
    pub node_id: u64,
}

/// Configuration errors.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The TOML file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The TOML file did not parse.
    #[error("bad config file {path}: {source}")]
    Parse {
        /// File.
        path: PathBuf,
        /// Cause.
        source: toml::de::Error,
    },
    /// A value is out of range.
    #[error("invalid setting: {0}")]
    Invalid(String),
}

impl Config {
    /// Merges flags over the file named by `--config` over defaults.
    ///
    /// # Errors
    /// [`ConfigError`] for an unreadable or malformed file or out-of-range values.
    pub fn load(cli: Cli) -> Result<Config, ConfigError> {
        let file = match &cli.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.clone(), source })?;
                toml::from_str::<FileConfig>(&text).map_err(|source| ConfigError::Parse { path: path.clone(), source })?
            }
            None => FileConfig::default(),
        };
        let cpus = std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1);
        let c = Config {
            listen: cli.listen.or(file.listen).unwrap_or_else(|| "127.0.0.1:5672".parse().expect("literal")),
            data_dir: cli.data_dir.or(file.data_dir).unwrap_or_else(|| PathBuf::from("data")),
            cores: cli.cores.or(file.cores).unwrap_or(cpus),
            metrics_listen: cli.metrics_listen.or(file.metrics_listen).unwrap_or_else(|| "127.0.0.1:15692".parse().expect("literal")),
            heartbeat: cli.heartbeat.or(file.heartbeat).unwrap_or(60),
            frame_max: cli.frame_max.or(file.frame_max).unwrap_or(131_072),
            channel_max: cli.channel_max.or(file.channel_max).unwrap_or(2047),
            consumer_timeout_ms: cli.consumer_timeout_ms.or(file.consumer_timeout_ms).unwrap_or(30 * 60 * 1000),
            segment_bytes: cli.segment_bytes.or(file.segment_bytes).unwrap_or(64 << 20),
            spin_before_park_us: cli.spin_before_park_us.or(file.spin_before_park_us).unwrap_or(DEFAULT_SPIN_BEFORE_PARK_US),
            disk_free_limit: cli.disk_free_limit.or(file.disk_free_limit).unwrap_or(DEFAULT_DISK_FREE_LIMIT),
            log: cli.log.or(file.log).unwrap_or_else(|| std::env::var("RINGMQ_LOG").unwrap_or_else(|_| "info".into())),
            users: file.users.unwrap_or_else(|| vec![User { name: "guest".into(), password: "guest".into(), loopback_only: true }]),
            vhosts: file.vhosts.unwrap_or_else(|| vec!["/".into()]),
            node_id: 1,
        };
        if c.cores == 0 || c.cores > 1024 {
            return Err(ConfigError::Invalid(format!("cores must be 1..=1024, got {}", c.cores)));
        }
        if c.frame_max < 4096 {
            return Err(ConfigError::Invalid(format!("frame_max must be at least 4096, got {}", c.frame_max)));
        }
        if c.channel_max == 0 {
            return Err(ConfigError::Invalid("channel_max must be at least 1".into()));
        }
        if c.segment_bytes < (1 << 20) {
            return Err(ConfigError::Invalid(format!("segment_bytes must be at least 1 MiB, got {}", c.segment_bytes)));
        }
        Ok(c)
    }

    /// Directory of the Raft metadata.
    pub fn meta_dir(&self) -> PathBuf {
        self.data_dir.join("meta")
    }

    /// Directory of durable queues' shards.
    pub fn durable_dir(&self) -> PathBuf {
        self.data_dir.join("queues")
    }

    /// Directory of non-durable queues' shards (emptied at every start).
    pub fn transient_dir(&self) -> PathBuf {
        self.data_dir.join("transient")
    }

    /// The directory of queue `name` in `vhost`: `queues/` when its files outlive the run
    /// (`durable`), else `transient/`, then `<hex(vhost)>.<hex(name)>` (names may hold any
    /// byte). It holds the `messages/` shard and, for a durable queue, the `unacked/` index
    /// shard.
    pub fn queue_dir(&self, vhost: &str, name: &str, durable: bool) -> PathBuf {
        let base = if durable { self.durable_dir() } else { self.transient_dir() };
        base.join(queue_dir_name(vhost, name))
    }
}

/// `<hex(vhost)>.<hex(name)>`.
pub fn queue_dir_name(vhost: &str, name: &str) -> String {
    fn hex(s: &str) -> String {
        s.bytes().map(|b| format!("{b:02x}")).collect()
    }
    format!("{}.{}", hex(vhost), hex(name))
}
