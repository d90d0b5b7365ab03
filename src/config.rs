//! Configuration: command-line flags (clap) over an optional TOML file over defaults.
//!
//! Defaults are what a RabbitMQ user expects of a fresh node: AMQP on 127.0.0.1:5672,
//! data in ./data, user guest/guest allowed from loopback only, vhost `/`, metrics on
//! 127.0.0.1:15692/metrics, the management API on 127.0.0.1:15672 (`off` turns it off).
//!
//! # Cluster
//! `--peers` (TOML: a `[peers]` table) lists every node of the cluster as `id=ADDR:PORT`, the
//! address each node's Raft transport listens on and the others dial; `--node-id` says which
//! entry is this node, and `--cluster-listen` may bind another IP than the advertised one (e.g.
//! `0.0.0.0`) but on the same port. No peers: a single node, exactly as before clustering.
//!
//! # Invariants
//! A loaded [`Config`] with peers names its own node in them, has no two nodes on one id or one
//! address, and its `cluster_listen` is `Some`, on this node's port in `peers`, and on neither
//! the AMQP, the metrics nor the management address. Without peers, `cluster_listen` is `None`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::Parser;
use serde::Deserialize;

mod access;
mod listen;
mod memory;
pub use listen::ListenAddr;
pub use memory::{Watermark, DEFAULT_MEMORY_HIGH_WATERMARK};
mod management_tls;
mod tls;
pub use access::{PermissionSeed, PolicySeed, User, APPLY_TO_NAMES};
pub use management_tls::{ManagementTls, ManagementTlsSettings};
pub use tls::{Tls, TlsArgs, TlsSettings};

/// Command-line flags. Every flag can also be set in the TOML file given by `--config`
/// (same names with `_` for `-`); a flag given on the command line wins.
#[derive(Parser, Debug, Default)]
#[command(name = "ringmq", version, about = "ringmq: an AMQP 0-9-1 broker (io_uring, thread-per-core)")]
pub struct Cli {
    /// AMQP listen address or host name with port; give it more than once to listen on several
    /// (e.g. `0.0.0.0:5672` and `[::]:5672`; `localhost:5672` is every address of localhost)
    /// [default: 127.0.0.1:5672 and [::1]:5672, loopback in both families]
    #[arg(long, value_name = "ADDR:PORT", action = clap::ArgAction::Append)]
    pub listen: Vec<ListenAddr>,
    /// The TLS listeners' flags (amqps and the management API's HTTPS).
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Data directory (metadata and queue segments) [default: ./data]
    #[arg(long, value_name = "PATH")]
    pub data_dir: Option<PathBuf>,
    /// Number of cores (executors) [default: all available]
    #[arg(long, value_name = "N")]
    pub cores: Option<u32>,
    /// Prometheus metrics listen address, serving /metrics [default: 127.0.0.1:15692]
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_listen: Option<SocketAddr>,
    /// The cluster's name on a fresh cluster (later: `ringmqctl set_cluster_name`)
    /// [default: ringmq@<host of the first node to start>]
    #[arg(long, value_name = "NAME")]
    pub cluster_name: Option<String>,
    /// Management HTTP API listen address (RabbitMQ-compatible, /api/…), or `off`
    /// [default: 127.0.0.1:15672]
    #[arg(long, value_name = "ADDR:PORT|off")]
    pub management_listen: Option<String>,
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
    /// Largest message body accepted, in bytes; a larger publish closes its channel with 406
    /// (RabbitMQ's max_message_size) [default: 134217728, at most 536870912]
    #[arg(long, value_name = "BYTES")]
    pub max_message_size: Option<u64>,
    /// Delivery acknowledgement timeout, in ms; 0 turns it off (per queue: x-consumer-timeout, 0 off there too) [default: 1800000]
    #[arg(long, value_name = "MS")]
    pub consumer_timeout_ms: Option<u64>,
    /// Queue segment file size, in bytes [default: 67108864]
    #[arg(long, value_name = "BYTES")]
    pub segment_bytes: Option<u64>,
    /// Idle µs a core polls before it sleeps in io_uring (0 = sleep at once) [default: 0].
    /// Spinning trades CPU for wake-up latency: for machines whose cores are the broker's alone.
    #[arg(long, value_name = "US")]
    pub spin_before_park_us: Option<u64>,
    /// Move a connection whose publishes all go to queues of another core to that core, and a
    /// connection that only consumes from queues of another core to that core, so a flow
    /// stays on one core [default: true]
    #[arg(long, value_name = "BOOL")]
    pub move_publishers: Option<bool>,
    /// Free bytes on the data directory's filesystem below which the disk alarm is raised:
    /// publishing connections are blocked (connection.blocked) until space is back; bytes,
    /// with an optional unit (50MB, 1GiB) [default: 50000000]
    #[arg(long, value_name = "BYTES", value_parser = Watermark::parse_bytes)]
    pub disk_free_limit: Option<u64>,
    /// Resident memory above which the memory alarm blocks publishing connections: a
    /// fraction of the memory available (RAM, or the cgroup limit when lower) such as 0.4, or
    /// bytes such as 536870912 or 512MiB; 0 turns it off [default: 0.4]
    #[arg(long, value_name = "FRACTION|BYTES")]
    pub memory_high_watermark: Option<String>,
    /// Log filter (tracing env-filter syntax, e.g. "info" or "ringmq=debug") [default: info]
    #[arg(long, value_name = "FILTER")]
    pub log: Option<String>,
    /// This node's id in the cluster, at least 1; must be one of the ids in --peers [default: 1]
    #[arg(long, value_name = "N")]
    pub node_id: Option<u64>,
    /// Node-to-node (Raft) listen address; its port must be this node's port in --peers.
    /// Only with --peers [default: this node's address in --peers]
    #[arg(long, value_name = "ADDR:PORT")]
    pub cluster_listen: Option<SocketAddr>,
    /// Every node of the cluster, this one included, as comma-separated ID=IP:PORT entries
    /// (the address its Raft transport listens on), e.g.
    /// 1=127.0.0.1:25672,2=127.0.0.1:25673,3=127.0.0.1:25674. The same list on every node
    /// [default: none: a single node]
    #[arg(long, value_name = "ID=ADDR:PORT,...")]
    pub peers: Option<String>,
    /// Nodes that store each replicated (durable) queue, the serving one included; capped at
    /// the cluster size. Per queue: the x-quorum-initial-group-size argument. Only with
    /// --peers [default: 3]
    #[arg(long, value_name = "N")]
    pub replicas: Option<u32>,
    /// Join a running cluster: start this node (an id the cluster does not have, listed with
    /// its address in --peers beside the nodes already running) and ask those nodes to add
    /// it as a voter. Needed only the first time; harmless afterwards
    #[arg(long)]
    pub join: bool,
    /// Do not start a broker: ask the cluster in --peers to forget node ID (stopped for good,
    /// or its data directory lost: RabbitMQ's forget_cluster_node), print the outcome, exit
    /// (0 when done)
    #[arg(long, value_name = "ID")]
    pub forget_node: Option<u64>,
}

/// A TOML scalar as the command line would give it (`0.4`, `536870912`, `"512MiB"`).
fn toml_scalar(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Default disk alarm threshold, bytes (RabbitMQ's `disk_free_limit` default, 50 MB).
pub const DEFAULT_DISK_FREE_LIMIT: u64 = 50_000_000;

/// Nodes that store each replicated queue by default (RabbitMQ's quorum queue initial group
/// size is the cluster size; 3 keeps a majority through one loss at the cost of three copies).
pub const DEFAULT_REPLICAS: u32 = 3;

/// Default largest message body, bytes (RabbitMQ's default max_message_size, 128 MiB).
pub const DEFAULT_MAX_MESSAGE_SIZE: u64 = 128 << 20;

/// Highest max_message_size accepted, bytes (RabbitMQ's cap, 512 MiB).
pub const MAX_MESSAGE_SIZE_CAP: u64 = 512 << 20;

/// Idle time a core polls its rings before it sleeps, µs: 0, off by default. Measured on
/// 2 cores shared with the load generator: at 1,000 msgs/s (`ringmq-bench latency`) 30 µs
/// lowered e2e p99 from 359 to 298 µs, confirm p99 from 401 to 269 µs and CPU per message
/// (each sleep costs a membarrier IPI and a context switch); flat out (`run --size 1024
/// --confirm 100 --prefetch 100`) it took the CPU from the clients and cut throughput from
/// 140k to 84k msgs/s. Turn it on where the broker has its cores to itself.
pub const DEFAULT_SPIN_BEFORE_PARK_US: u64 = 0;

/// `listen` in the TOML file: one address (or host name with port), or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(ListenAddr),
    Many(Vec<ListenAddr>),
}

/// The default AMQP listen addresses: loopback in both families, as RabbitMQ's default
/// listener (`localhost` resolves to ::1 first for Node and some other clients). The IPv6 one
/// is skipped, with a warning, where the host has no ::1.
pub const DEFAULT_LISTEN: [&str; 2] = ["127.0.0.1:5672", "[::1]:5672"];

/// The TOML file's shape: every field optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<OneOrMany>,
    tls_listen: Option<OneOrMany>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_ca: Option<PathBuf>,
    tls_fail_if_no_peer_cert: Option<bool>,
    management_tls_listen: Option<SocketAddr>,
    management_tls_cert: Option<PathBuf>,
    management_tls_key: Option<PathBuf>,
    management_tls_ca: Option<PathBuf>,
    management_tls_fail_if_no_peer_cert: Option<bool>,
    data_dir: Option<PathBuf>,
    cores: Option<u32>,
    metrics_listen: Option<SocketAddr>,
    cluster_name: Option<String>,
    management_listen: Option<String>,
    heartbeat: Option<u16>,
    frame_max: Option<u32>,
    channel_max: Option<u16>,
    max_message_size: Option<u64>,
    consumer_timeout_ms: Option<u64>,
    segment_bytes: Option<u64>,
    spin_before_park_us: Option<u64>,
    move_publishers: Option<bool>,
    #[serde(default, deserialize_with = "memory::bytes_or_text")]
    disk_free_limit: Option<u64>,
    memory_high_watermark: Option<toml::Value>,
    log: Option<String>,
    users: Option<Vec<User>>,
    vhosts: Option<Vec<String>>,
    permissions: Option<Vec<PermissionSeed>>,
    policies: Option<Vec<PolicySeed>>,
    operator_policies: Option<Vec<PolicySeed>>,
    node_id: Option<u64>,
    cluster_listen: Option<SocketAddr>,
    /// `[peers]` table: `1 = "127.0.0.1:25672"` (TOML keys are strings; parsed like `--peers`).
    peers: Option<BTreeMap<String, String>>,
    replicas: Option<u32>,
    join: Option<bool>,
}

/// Effective configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// AMQP listen addresses (at least one; [`DEFAULT_LISTEN`] unless given).
    pub listen: Vec<SocketAddr>,
    /// `listen` is [`DEFAULT_LISTEN`].
    pub listen_is_default: bool,
    /// Addresses of `listen` skipped with a warning where the host cannot bind them (no
    /// IPv6): the default's `[::1]`, and the IPv6 addresses of a host name that also resolved
    /// to IPv4 (`localhost`).
    pub listen_optional: Vec<SocketAddr>,
    /// The amqps listener, its certificate and client verification; `None` without
    /// `--tls-listen`.
    pub tls: Option<Tls>,
    /// Data directory.
    pub data_dir: PathBuf,
    /// Executors.
    pub cores: u32,
    /// Metrics listen address.
    pub metrics_listen: SocketAddr,
    /// The name a fresh cluster gets (`--cluster-name`, TOML `cluster_name`); `None`:
    /// `ringmq@<host>` (`broker::cluster_name`).
    pub cluster_name: Option<String>,
    /// Management API listen address; `None` when turned off (`--management-listen off`).
    pub management_listen: Option<SocketAddr>,
    /// The management API's HTTPS listener; `None` without `--management-tls-listen`.
    pub management_tls: Option<ManagementTls>,
    /// Heartbeat offered, seconds.
    pub heartbeat: u16,
    /// frame_max offered, bytes (≥ 4096).
    pub frame_max: u32,
    /// channel_max offered.
    pub channel_max: u16,
    /// Largest message body accepted, bytes (1..=[`MAX_MESSAGE_SIZE_CAP`]).
    pub max_message_size: u64,
    /// Default delivery acknowledgement timeout, ms.
    pub consumer_timeout_ms: u64,
    /// Segment size, bytes.
    pub segment_bytes: u64,
    /// Idle time a core polls before sleeping, µs (0 = no spinning).
    pub spin_before_park_us: u64,
    /// A connection whose publishes all go to queues of another core moves there
    /// (`amqp::connection::handoff`).
    pub move_publishers: bool,
    /// Disk alarm threshold: free bytes on the data directory's filesystem (RabbitMQ's
    /// `disk_free_limit`, default 50 MB; 0 = never).
    pub disk_free_limit: u64,
    /// Memory alarm threshold (RabbitMQ's `vm_memory_high_watermark`).
    pub memory_high_watermark: Watermark,
    /// Log filter.
    pub log: String,
    /// Users seeded into a fresh data directory (names unique); those with `loopback_only`
    /// log in only from loopback addresses, whatever the metadata says of them later.
    pub users: Vec<User>,
    /// Vhosts seeded into a fresh data directory.
    pub vhosts: Vec<String>,
    /// Permissions seeded into a fresh data directory; `None` (no `[[permissions]]` in the
    /// file): every seeded user gets `.*` `.*` `.*` on every seeded vhost.
    pub permissions: Option<Vec<PermissionSeed>>,
    /// Policies seeded into a fresh data directory.
    pub policies: Vec<PolicySeed>,
    /// Operator policies seeded into a fresh data directory.
    pub operator_policies: Vec<PolicySeed>,
    /// This node's Raft id (≥ 1; 1 for a single node).
    pub node_id: u64,
    /// Where the node-to-node (Raft) transport listens: `Some` exactly when `peers` is not
    /// empty (by default this node's address in `peers`).
    pub cluster_listen: Option<SocketAddr>,
    /// Every node of the cluster by id, this one included: the address its Raft transport
    /// listens on. Empty for a single node.
    pub peers: BTreeMap<u64, SocketAddr>,
    /// How many nodes store each replicated queue (≥ 1; [`DEFAULT_REPLICAS`]), capped at the
    /// cluster size when a queue is declared; a queue's `x-quorum-initial-group-size` wins.
    pub replicas: u32,
    /// Ask the nodes in `peers` to add this one as a voter at start (`--join`).
    pub join: bool,
    /// The one-shot `--forget-node ID` request instead of a broker (command line only).
    pub forget_node: Option<u64>,
}

/// The management API's default listen address (RabbitMQ's management port, loopback).
pub const DEFAULT_MANAGEMENT_LISTEN: &str = "127.0.0.1:15672";

/// `--management-listen`: an address, or `off` (`None`); the default when not given.
///
/// # Errors
/// [`ConfigError::Invalid`] for anything else.
fn parse_management_listen(v: Option<&str>) -> Result<Option<SocketAddr>, ConfigError> {
    match v {
        None => Ok(Some(DEFAULT_MANAGEMENT_LISTEN.parse().expect("literal"))),
        Some("off") => Ok(None),
        Some(a) => {
            a.parse().map(Some).map_err(|_| ConfigError::Invalid(format!("management_listen {a:?} is neither ADDR:PORT nor \"off\"")))
        }
    }
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
    /// [`ConfigError`] for an unreadable or malformed file, out-of-range values, or cluster
    /// settings that do not fit together (the module's `# Invariants`).
    pub fn load(cli: Cli) -> Result<Config, ConfigError> {
        let file = match &cli.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.clone(), source })?;
                toml::from_str::<FileConfig>(&text).map_err(|source| ConfigError::Parse { path: path.clone(), source })?
            }
            None => FileConfig::default(),
        };
        Self::merge(cli, file)
    }

    /// Flags over `file` over defaults, then the checks [`Config::load`] documents.
    fn merge(cli: Cli, file: FileConfig) -> Result<Config, ConfigError> {
        let cpus = std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1);
        let (tls, management_tls) = tls::load(cli.tls, &file)?;
        // The flag's list replaces the file's table as a whole.
        let peers = match (cli.peers, file.peers) {
            (Some(list), _) => parse_peer_list(&list)?,
            (None, Some(table)) => collect_peers(table.iter().map(|(id, addr)| peer_entry(id, addr)))?,
            (None, None) => BTreeMap::new(),
        };
        let given = match (cli.listen, file.listen) {
            (given, _) if !given.is_empty() => given,
            (_, Some(OneOrMany::One(a))) => vec![a],
            (_, Some(OneOrMany::Many(list))) if !list.is_empty() => list,
            (_, Some(OneOrMany::Many(_))) => return Err(ConfigError::Invalid("listen is an empty list: give at least one address".into())),
            (_, None) => Vec::new(),
        };
        let listen_is_default = given.is_empty();
        let default: Vec<SocketAddr> = DEFAULT_LISTEN.iter().map(|a| a.parse().expect("literal")).collect();
        let mut c = Config {
            listen: if listen_is_default { default.clone() } else { given.iter().flat_map(|l| l.addrs.iter().copied()).collect() },
            listen_optional: if listen_is_default {
                default.into_iter().filter(SocketAddr::is_ipv6).collect()
            } else {
                listen::optional_ipv6(&given)
            },
            listen_is_default,
            tls,
            data_dir: cli.data_dir.or(file.data_dir).unwrap_or_else(|| PathBuf::from("data")),
            cores: cli.cores.or(file.cores).unwrap_or(cpus),
            metrics_listen: cli.metrics_listen.or(file.metrics_listen).unwrap_or_else(|| "127.0.0.1:15692".parse().expect("literal")),
            cluster_name: cli.cluster_name.or(file.cluster_name),
            management_listen: parse_management_listen(cli.management_listen.or(file.management_listen).as_deref())?,
            management_tls,
            heartbeat: cli.heartbeat.or(file.heartbeat).unwrap_or(60),
            frame_max: cli.frame_max.or(file.frame_max).unwrap_or(131_072),
            channel_max: cli.channel_max.or(file.channel_max).unwrap_or(2047),
            max_message_size: cli.max_message_size.or(file.max_message_size).unwrap_or(DEFAULT_MAX_MESSAGE_SIZE),
            consumer_timeout_ms: cli.consumer_timeout_ms.or(file.consumer_timeout_ms).unwrap_or(30 * 60 * 1000),
            segment_bytes: cli.segment_bytes.or(file.segment_bytes).unwrap_or(64 << 20),
            spin_before_park_us: cli.spin_before_park_us.or(file.spin_before_park_us).unwrap_or(DEFAULT_SPIN_BEFORE_PARK_US),
            move_publishers: cli.move_publishers.or(file.move_publishers).unwrap_or(true),
            disk_free_limit: cli.disk_free_limit.or(file.disk_free_limit).unwrap_or(DEFAULT_DISK_FREE_LIMIT),
            memory_high_watermark: match cli.memory_high_watermark.or_else(|| file.memory_high_watermark.map(|v| toml_scalar(&v))) {
                Some(s) => Watermark::parse(&s).map_err(|e| ConfigError::Invalid(format!("--memory-high-watermark {e}")))?,
                None => DEFAULT_MEMORY_HIGH_WATERMARK,
            },
            log: cli.log.or(file.log).unwrap_or_else(|| std::env::var("RINGMQ_LOG").unwrap_or_else(|_| "info".into())),
            users: file.users.unwrap_or_else(access::default_users),
            vhosts: file.vhosts.unwrap_or_else(|| vec!["/".into()]),
            permissions: file.permissions,
            policies: file.policies.unwrap_or_default(),
            operator_policies: file.operator_policies.unwrap_or_default(),
            node_id: cli.node_id.or(file.node_id).unwrap_or(1),
            cluster_listen: cli.cluster_listen.or(file.cluster_listen),
            peers,
            replicas: cli.replicas.or(file.replicas).unwrap_or(DEFAULT_REPLICAS),
            join: cli.join || file.join.unwrap_or(false),
            forget_node: cli.forget_node,
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
        if c.max_message_size == 0 || c.max_message_size > MAX_MESSAGE_SIZE_CAP {
            return Err(ConfigError::Invalid(format!(
                "max_message_size must be 1..={MAX_MESSAGE_SIZE_CAP} bytes, got {}",
                c.max_message_size
            )));
        }
        if c.segment_bytes < (1 << 20) {
            return Err(ConfigError::Invalid(format!("segment_bytes must be at least 1 MiB, got {}", c.segment_bytes)));
        }
        if c.replicas == 0 {
            return Err(ConfigError::Invalid("replicas must be at least 1".into()));
        }
        tls::check_addresses(&c)?;
        let policies: Vec<&PolicySeed> = c.policies.iter().chain(&c.operator_policies).collect();
        access::check(&c.users, &c.vhosts, c.permissions.as_deref(), &policies)?;
        c.cluster_listen = c.check_cluster()?;
        if (c.join || c.forget_node.is_some()) && !c.is_cluster() {
            return Err(ConfigError::Invalid("--join and --forget-node need --peers (the cluster's nodes and their addresses)".into()));
        }
        Ok(c)
    }

    /// Checks `node_id`, `peers` and `cluster_listen` together; returns the effective
    /// `cluster_listen` (this node's entry in `peers` when none was given; `None` without
    /// peers).
    fn check_cluster(&self) -> Result<Option<SocketAddr>, ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.node_id == 0 {
            return invalid("node_id must be at least 1 (raft-rs reserves 0)".into());
        }
        if self.peers.is_empty() {
            return match self.cluster_listen {
                Some(addr) => invalid(format!(
                    "cluster_listen {addr} is set but peers is empty: name every node of the cluster in peers, or drop cluster_listen to run a single node"
                )),
                None => Ok(None),
            };
        }
        let Some(&own) = self.peers.get(&self.node_id) else {
            let ids: Vec<String> = self.peers.keys().map(u64::to_string).collect();
            return invalid(format!("peers do not name this node (node_id {}); they name {}", self.node_id, ids.join(", ")));
        };
        let cluster = match self.cluster_listen {
            Some(addr) if addr.port() != own.port() => {
                return invalid(format!(
                    "cluster_listen {addr} is not on this node's port in peers ({}={own}): the other nodes dial port {}",
                    self.node_id,
                    own.port()
                ));
            }
            Some(addr) => addr,
            None => own,
        };
        if let Some(amqp) = self.listen.iter().find(|a| same_socket(cluster, **a)) {
            return invalid(format!("the cluster address {cluster} is also the AMQP listen address {amqp}"));
        }
        if self.management_listen.is_some_and(|m| same_socket(cluster, m)) {
            return invalid(format!("the cluster address {cluster} is also the management listen address"));
        }
        if let Some(m) = self.management_tls.as_ref().map(|m| m.listen).filter(|&m| same_socket(cluster, m)) {
            return invalid(format!("the cluster address {cluster} is also the management TLS listen address {m}"));
        }
        if same_socket(cluster, self.metrics_listen) {
            return invalid(format!("the cluster address {cluster} is also the metrics listen address {}", self.metrics_listen));
        }
        Ok(Some(cluster))
    }

    /// True when this node is one of several (`peers` is not empty): the metadata group has a
    /// voter per peer and the node-to-node transport listens on `cluster_listen`.
    pub fn is_cluster(&self) -> bool {
        !self.peers.is_empty()
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

/// Two listen addresses that cannot both be bound: one port, and one IP or either unspecified
/// (`0.0.0.0` / `::` takes the port on every address).
fn same_socket(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// Parses `--peers`: comma-separated `ID=IP:PORT` entries (spaces around them ignored); an empty
/// or blank list is no peers.
///
/// # Errors
/// [`ConfigError::Invalid`] naming the first bad entry, or a repeated id or address.
fn parse_peer_list(list: &str) -> Result<BTreeMap<u64, SocketAddr>, ConfigError> {
    if list.trim().is_empty() {
        return Ok(BTreeMap::new());
    }
    collect_peers(list.split(',').enumerate().map(|(i, entry)| {
        let entry = entry.trim();
        if entry.is_empty() {
            return Err(ConfigError::Invalid(format!("peers entry {} of {list:?} is empty (expected ID=ADDR:PORT)", i + 1)));
        }
        match entry.split_once('=') {
            Some((id, addr)) => peer_entry(id, addr),
            None => Err(ConfigError::Invalid(format!("peers entry {entry:?} is not ID=ADDR:PORT (e.g. 2=127.0.0.1:25673)"))),
        }
    }))
}

/// One peer, `id` and `addr` as written (`--peers` entry `id=addr`, or TOML `id = "addr"`).
fn peer_entry(id: &str, addr: &str) -> Result<(u64, SocketAddr), ConfigError> {
    let (id, addr) = (id.trim(), addr.trim());
    let entry = format!("{id}={addr}");
    let bad = |why: String| Err(ConfigError::Invalid(format!("peers entry {entry:?}: {why}")));
    let n = match id.parse::<u64>() {
        Ok(0) => return bad("node id 0 is reserved by raft-rs (ids start at 1)".into()),
        Ok(n) => n,
        Err(_) => return bad(format!("node id {id:?} is not a whole number of at least 1")),
    };
    if addr.is_empty() {
        return bad("no address (expected ID=ADDR:PORT, e.g. 2=127.0.0.1:25673)".into());
    }
    match addr.parse::<SocketAddr>() {
        Ok(a) if a.port() == 0 => bad("port 0 cannot be dialled".into()),
        Ok(a) => Ok((n, a)),
        Err(_) if addr.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().is_ok() => {
            bad(format!("address {addr:?} has no port (expected ADDR:PORT)"))
        }
        Err(_) => bad(format!("address {addr:?} is not IP:PORT (host names are not resolved)")),
    }
}

/// Collects parsed peers, refusing a repeated id or address.
fn collect_peers(entries: impl Iterator<Item = Result<(u64, SocketAddr), ConfigError>>) -> Result<BTreeMap<u64, SocketAddr>, ConfigError> {
    let mut peers = BTreeMap::new();
    for entry in entries {
        let (id, addr) = entry?;
        if let Some(first) = peers.get(&id) {
            return Err(ConfigError::Invalid(format!("peers name node {id} twice ({id}={first} and {id}={addr})")));
        }
        if let Some(other) = peers.iter().find_map(|(&o, &a)| (a == addr).then_some(o)) {
            return Err(ConfigError::Invalid(format!("peers give one address {addr} to node {other} and node {id}")));
        }
        peers.insert(id, addr);
    }
    Ok(peers)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const PEERS: &str = "1=127.0.0.1:25672,2=127.0.0.1:25673,3=127.0.0.1:25674";

    /// `Config::merge` of these flags (after "ringmq") over the TOML text `file`.
    pub(crate) fn load(flags: &[&str], file: &str) -> Result<Config, ConfigError> {
        let cli = Cli::try_parse_from(std::iter::once("ringmq").chain(flags.iter().copied())).expect("flags parse");
        Config::merge(cli, toml::from_str(file).expect("toml parses"))
    }

    /// The `Invalid` message of a refused configuration.
    #[track_caller]
    pub(crate) fn refused(flags: &[&str], file: &str) -> String {
        match load(flags, file) {
            Err(ConfigError::Invalid(m)) => m,
            other => panic!("expected ConfigError::Invalid for {flags:?} / {file:?}, got {other:?}"),
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn management_listen_defaults_takes_an_address_or_off() {
        assert_eq!(load(&[], "").unwrap().management_listen, Some(addr("127.0.0.1:15672")));
        assert_eq!(load(&["--management-listen", "0.0.0.0:15000"], "").unwrap().management_listen, Some(addr("0.0.0.0:15000")));
        assert_eq!(load(&["--management-listen", "off"], "").unwrap().management_listen, None);
        assert_eq!(load(&[], "management_listen = \"off\"").unwrap().management_listen, None);
        assert_eq!(
            load(&["--management-listen", "127.0.0.1:1"], "management_listen = \"off\"").unwrap().management_listen,
            Some(addr("127.0.0.1:1"))
        );
        assert!(refused(&["--management-listen", "nowhere"], "").contains("neither ADDR:PORT nor"));
    }

    #[test]
    fn amqp_listens_on_loopback_in_both_families_unless_told_otherwise() {
        let c = load(&[], "").unwrap();
        assert_eq!((c.listen.clone(), c.listen_is_default), (vec![addr("127.0.0.1:5672"), addr("[::1]:5672")], true));
        // The flag, once or more, replaces the defaults (and the file).
        let c = load(&["--listen", "0.0.0.0:5680"], "listen = \"127.0.0.1:1\"").unwrap();
        assert_eq!((c.listen.clone(), c.listen_is_default), (vec![addr("0.0.0.0:5680")], false));
        let c = load(&["--listen", "0.0.0.0:5680", "--listen", "[::]:5680"], "").unwrap();
        assert_eq!(c.listen, vec![addr("0.0.0.0:5680"), addr("[::]:5680")]);
        // The file: one address, or a list.
        assert_eq!(load(&[], "listen = \"10.0.0.1:5672\"").unwrap().listen, vec![addr("10.0.0.1:5672")]);
        let c = load(&[], "listen = [\"10.0.0.1:5672\", \"[fd00::1]:5672\"]").unwrap();
        assert_eq!(c.listen, vec![addr("10.0.0.1:5672"), addr("[fd00::1]:5672")]);
        assert!(refused(&[], "listen = []").contains("at least one address"));
    }

    #[test]
    fn no_peers_is_a_single_node_as_before() {
        let c = load(&[], "").unwrap();
        assert_eq!((c.node_id, c.cluster_listen, c.peers.len(), c.is_cluster()), (1, None, 0, false));
        let c = load(&["--peers", "", "--node-id", "7"], "").unwrap();
        assert_eq!((c.node_id, c.is_cluster()), (7, false));
    }

    #[test]
    fn peers_flag_and_default_cluster_listen() {
        let c = load(&["--node-id", "2", "--peers", PEERS], "").unwrap();
        assert!(c.is_cluster());
        assert_eq!(c.node_id, 2);
        assert_eq!(c.cluster_listen, Some(addr("127.0.0.1:25673")));
        let want: BTreeMap<u64, SocketAddr> =
            [(1, addr("127.0.0.1:25672")), (2, addr("127.0.0.1:25673")), (3, addr("127.0.0.1:25674"))].into();
        assert_eq!(c.peers, want);
        // spaces around entries, IPv6, another bind IP on the same port
        let c = load(&["--peers", " 1=[::1]:25672 , 2=10.0.0.2:25672", "--cluster-listen", "0.0.0.0:25672"], "").unwrap();
        assert_eq!(c.peers[&1], addr("[::1]:25672"));
        assert_eq!(c.cluster_listen, Some(addr("0.0.0.0:25672")));
    }

    #[test]
    fn peers_table_in_the_file_and_the_flag_wins() {
        let file = "node_id = 3\ncluster_listen = \"127.0.0.1:25674\"\n[peers]\n1 = \"127.0.0.1:25672\"\n2 = \"127.0.0.1:25673\"\n3 = \"127.0.0.1:25674\"\n";
        let c = load(&[], file).unwrap();
        assert_eq!((c.node_id, c.cluster_listen, c.peers.len()), (3, Some(addr("127.0.0.1:25674")), 3));
        let c = load(&["--node-id", "1", "--peers", "1=127.0.0.1:26000,3=127.0.0.1:26001", "--cluster-listen", "127.0.0.1:26000"], file)
            .unwrap();
        assert_eq!(c.node_id, 1);
        assert_eq!(c.peers.keys().copied().collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(c.cluster_listen, Some(addr("127.0.0.1:26000")));
        // a bad TOML entry is reported like a bad flag entry
        let m = refused(&[], "[peers]\n1 = \"127.0.0.1:25672\"\nx = \"1.2.3.4:5\"\n");
        assert!(m.contains("\"x=1.2.3.4:5\""), "{m}");
    }

    #[test]
    fn peers_in_a_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ringmq.toml");
        std::fs::write(&path, "node_id = 2\n[peers]\n1 = \"127.0.0.1:25672\"\n2 = \"127.0.0.1:25673\"\n").unwrap();
        let c = Config::load(Cli::try_parse_from(["ringmq", "--config", path.to_str().unwrap()]).unwrap()).unwrap();
        assert_eq!((c.node_id, c.cluster_listen), (2, Some(addr("127.0.0.1:25673"))));
    }

    #[test]
    fn node_id_zero_is_refused() {
        assert!(refused(&["--node-id", "0"], "").contains("node_id must be at least 1"));
        assert!(refused(&[], "node_id = 0").contains("node_id must be at least 1"));
        let m = refused(&["--peers", "0=127.0.0.1:25672,1=127.0.0.1:25673"], "");
        assert!(m.contains("\"0=127.0.0.1:25672\"") && m.contains("reserved"), "{m}");
    }

    #[test]
    fn duplicate_ids_are_refused() {
        let m = refused(&["--peers", "1=127.0.0.1:25672,2=127.0.0.1:25673,2=127.0.0.1:25674"], "");
        assert!(m.contains("node 2 twice"), "{m}");
        // "2" and "02" are one id
        let m = refused(&[], "[peers]\n1 = \"127.0.0.1:25672\"\n2 = \"127.0.0.1:25673\"\n02 = \"127.0.0.1:25674\"\n");
        assert!(m.contains("node 2 twice"), "{m}");
    }

    #[test]
    fn duplicate_addresses_are_refused() {
        let m = refused(&["--peers", "1=127.0.0.1:25672,2=127.0.0.1:25672"], "");
        assert!(m.contains("127.0.0.1:25672 to node 1 and node 2"), "{m}");
    }

    #[test]
    fn peers_must_name_this_node() {
        let m = refused(&["--node-id", "4", "--peers", PEERS], "");
        assert!(m.contains("do not name this node (node_id 4)") && m.contains("1, 2, 3"), "{m}");
        // the default node id 1 must be listed too
        let m = refused(&["--peers", "2=127.0.0.1:25673,3=127.0.0.1:25674"], "");
        assert!(m.contains("node_id 1"), "{m}");
    }

    #[test]
    fn cluster_listen_needs_peers() {
        let m = refused(&["--cluster-listen", "127.0.0.1:25672"], "");
        assert!(m.contains("cluster_listen 127.0.0.1:25672") && m.contains("peers is empty"), "{m}");
    }

    #[test]
    fn cluster_listen_must_be_on_this_nodes_port() {
        let m = refused(&["--node-id", "2", "--peers", PEERS, "--cluster-listen", "127.0.0.1:25672"], "");
        assert!(m.contains("not on this node's port in peers (2=127.0.0.1:25673)") && m.contains("dial port 25673"), "{m}");
    }

    #[test]
    fn cluster_address_must_not_be_the_amqp_or_metrics_address() {
        let m = refused(&["--peers", "1=127.0.0.1:5672,2=127.0.0.1:5673"], "");
        assert!(m.contains("cluster address 127.0.0.1:5672 is also the AMQP listen address"), "{m}");
        let m = refused(&["--peers", PEERS, "--metrics-listen", "127.0.0.1:25672"], "");
        assert!(m.contains("is also the metrics listen address 127.0.0.1:25672"), "{m}");
        // 0.0.0.0 takes the port on every address
        let m = refused(&["--peers", PEERS, "--listen", "0.0.0.0:25672"], "");
        assert!(m.contains("AMQP listen address 0.0.0.0:25672"), "{m}");
        let m = refused(&["--peers", PEERS, "--cluster-listen", "0.0.0.0:25672", "--listen", "127.0.0.1:25672"], "");
        assert!(m.contains("cluster address 0.0.0.0:25672"), "{m}");
    }

    #[test]
    fn malformed_entries_are_named() {
        let cases = [
            ("1=127.0.0.1:25672,2=", "\"2=\": no address"),
            ("1=127.0.0.1:25672,x=1.2.3.4:5", "\"x=1.2.3.4:5\": node id \"x\""),
            ("1=127.0.0.1:25672,2=127.0.0.1", "\"2=127.0.0.1\": address \"127.0.0.1\" has no port"),
            ("1=127.0.0.1:25672,2=[::1]", "has no port"),
            ("1=127.0.0.1:25672,2=localhost:25673", "\"2=localhost:25673\": address \"localhost:25673\" is not IP:PORT"),
            ("1=127.0.0.1:25672,2=127.0.0.1:0", "\"2=127.0.0.1:0\": port 0"),
            ("1=127.0.0.1:25672,127.0.0.1:25673", "\"127.0.0.1:25673\" is not ID=ADDR:PORT"),
            ("1=127.0.0.1:25672,,2=127.0.0.1:25673", "entry 2 of"),
            ("1=127.0.0.1:25672,-1=127.0.0.1:25673", "\"-1=127.0.0.1:25673\""),
        ];
        for (list, want) in cases {
            let m = refused(&["--peers", list], "");
            assert!(m.contains(want), "--peers {list:?}: {m:?} does not contain {want:?}");
        }
    }

    #[test]
    fn tls_is_off_by_default_and_checked_when_asked_for() {
        assert!(load(&[], "").unwrap().tls.is_none());
        assert!(refused(&["--tls-listen", "127.0.0.1:5671"], "").contains("needs tls_cert"));
        assert!(refused(&[], "tls_listen = \"127.0.0.1:5671\"\ntls_cert = \"/nonexistent/c.pem\"\ntls_key = \"k.pem\"")
            .contains("/nonexistent/c.pem"));
        assert!(refused(&["--tls-ca", "ca.pem"], "").contains("tls_ca is used by no listener: it needs tls_listen"));
        let m = refused(&["--listen", "127.0.0.1:5671", "--tls-listen", "0.0.0.0:5671", "--tls-cert", "c", "--tls-key", "k"], "");
        assert!(m.contains("cannot read c"), "files are read first: {m}");
    }
}
