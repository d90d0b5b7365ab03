//! `ringmqctl`: ringmq's command-line tool, with rabbitmqctl's command names. It talks to
//! a node's management HTTP API (`--management`, default http://127.0.0.1:15672), so it
//! works from any host that reaches that port, and against any node of a cluster.
//!
//! Output is a table by default (`--format json`: a JSON array of objects). Exit codes, for
//! scripts: 0 done; 1 the named object does not exist (404); 64 usage error; 65 bad data
//! (a definitions file that is not JSON, a 400 from the broker); 66 a file to read is
//! missing; 69 the management API cannot be reached (or answered 503); 70 any other
//! failure; 77 the credentials were refused or lack the rights (401/403).

mod commands;
mod http;
mod table;

use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

/// Command-line arguments.
#[derive(Parser, Debug)]
#[command(
    name = "ringmqctl",
    version,
    about = "Manage a ringmq node through its management API (rabbitmqctl's command names).",
    after_help = "Exit codes: 0 done; 1 not found (404); 64 usage; 65 bad data (400, bad JSON); \
                  66 input file missing; 69 management API unreachable (or 503); 70 other failure; \
                  77 credentials refused or lacking rights (401/403)."
)]
pub struct Cli {
    /// Base URL of a node's management API.
    #[arg(long, global = true, env = "RINGMQCTL_MANAGEMENT", default_value = "http://127.0.0.1:15672")]
    pub management: String,
    /// User to log in as (needs the `administrator` tag for changes, `monitoring` to list).
    #[arg(long, short = 'u', global = true, env = "RINGMQCTL_USERNAME", default_value = "guest")]
    pub username: String,
    /// That user's password.
    #[arg(long, global = true, env = "RINGMQCTL_PASSWORD", default_value = "guest", hide_env_values = true)]
    pub password: String,
    /// Virtual host of the command (queues, exchanges, bindings, consumers, permissions,
    /// policies), as rabbitmqctl's `-p`.
    #[arg(long = "vhost", short = 'p', global = true, default_value = "/")]
    pub vhost: String,
    /// Output format.
    #[arg(long, global = true, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Print no informational lines (only listings and errors).
    #[arg(long, short = 'q', global = true)]
    pub quiet: bool,
    /// Seconds to wait for each answer of the management API.
    #[arg(long, short = 't', global = true, default_value_t = 30)]
    pub timeout: u64,
    #[command(subcommand)]
    pub command: Cmd,
}

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Aligned columns with a header line.
    Table,
    /// A JSON array of objects (one per row, keyed by column).
    Json,
}

/// The commands, named as rabbitmqctl names them.
#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// The node: version, listeners, object and message totals, resources, alarms.
    #[command(name = "status")]
    Status,
    /// The cluster's name and its nodes, running or not.
    #[command(name = "cluster_status")]
    ClusterStatus,
    /// Queues of the vhost [default columns: name messages].
    #[command(name = "list_queues")]
    ListQueues { columns: Vec<String> },
    /// Exchanges of the vhost [name type].
    #[command(name = "list_exchanges")]
    ListExchanges { columns: Vec<String> },
    /// Bindings of the vhost [source_name source_kind destination_name destination_kind routing_key arguments].
    #[command(name = "list_bindings")]
    ListBindings { columns: Vec<String> },
    /// Connections of every vhost [user peer_host peer_port state].
    #[command(name = "list_connections")]
    ListConnections { columns: Vec<String> },
    /// Channels [name user consumer_count messages_unacknowledged].
    #[command(name = "list_channels")]
    ListChannels { columns: Vec<String> },
    /// Consumers of the vhost [queue_name channel_pid consumer_tag ack_required prefetch_count active arguments].
    #[command(name = "list_consumers")]
    ListConsumers { columns: Vec<String> },
    /// Outstanding (delivered, unacknowledged) deliveries of one queue.
    #[command(name = "list_unacked")]
    ListUnacked { queue: String, columns: Vec<String> },
    /// Users [user tags].
    #[command(name = "list_users")]
    ListUsers { columns: Vec<String> },
    /// Virtual hosts [name].
    #[command(name = "list_vhosts")]
    ListVhosts { columns: Vec<String> },
    /// Permissions in the vhost [user configure write read].
    #[command(name = "list_permissions")]
    ListPermissions { columns: Vec<String> },
    /// One user's permissions in every vhost.
    #[command(name = "list_user_permissions")]
    ListUserPermissions { user: String },
    /// Policies of the vhost [vhost name pattern apply-to definition priority].
    #[command(name = "list_policies")]
    ListPolicies { columns: Vec<String> },
    /// Operator policies of the vhost.
    #[command(name = "list_operator_policies")]
    ListOperatorPolicies { columns: Vec<String> },
    /// Creates a user (no tags, no permissions).
    #[command(name = "add_user")]
    AddUser {
        user: String,
        #[arg(id = "new_password", value_name = "PASSWORD")]
        password: String,
    },
    /// Deletes a user and its permissions.
    #[command(name = "delete_user")]
    DeleteUser { user: String },
    /// Sets a user's password, keeping its tags.
    #[command(name = "change_password")]
    ChangePassword {
        user: String,
        #[arg(id = "new_password", value_name = "PASSWORD")]
        password: String,
    },
    /// Removes a user's password (it can no longer log in with one).
    #[command(name = "clear_password")]
    ClearPassword { user: String },
    /// Replaces a user's tags (none given: no tags).
    #[command(name = "set_user_tags")]
    SetUserTags { user: String, tags: Vec<String> },
    /// Checks a user's password: exit 0 when it logs in, 77 when refused.
    #[command(name = "authenticate_user")]
    AuthenticateUser {
        user: String,
        #[arg(id = "user_password", value_name = "PASSWORD")]
        password: String,
    },
    /// Names the cluster (every node reports the new name; its permanent id stays).
    #[command(name = "set_cluster_name")]
    SetClusterName { name: String },
    /// Creates a virtual host.
    #[command(name = "add_vhost")]
    AddVhost { name: String },
    /// Deletes a virtual host with everything in it.
    #[command(name = "delete_vhost")]
    DeleteVhost { name: String },
    /// Grants a user configure/write/read regular expressions in the vhost.
    #[command(name = "set_permissions")]
    SetPermissions { user: String, configure: String, write: String, read: String },
    /// Removes a user's permissions in the vhost.
    #[command(name = "clear_permissions")]
    ClearPermissions { user: String },
    /// Sets a policy: NAME PATTERN DEFINITION (a JSON object, e.g. '{"max-length":1000}').
    #[command(name = "set_policy")]
    SetPolicy {
        name: String,
        pattern: String,
        definition: String,
        /// Higher wins where several match.
        #[arg(long, default_value_t = 0)]
        priority: i64,
        /// queues, exchanges or all.
        #[arg(long = "apply-to", default_value = "all")]
        apply_to: String,
    },
    /// Removes a policy.
    #[command(name = "clear_policy")]
    ClearPolicy { name: String },
    /// Sets an operator policy (it caps what queues declare): NAME PATTERN DEFINITION.
    #[command(name = "set_operator_policy")]
    SetOperatorPolicy {
        name: String,
        pattern: String,
        definition: String,
        #[arg(long, default_value_t = 0)]
        priority: i64,
        #[arg(long = "apply-to", default_value = "queues")]
        apply_to: String,
    },
    /// Removes an operator policy.
    #[command(name = "clear_operator_policy")]
    ClearOperatorPolicy { name: String },
    /// Deletes every ready message of a queue.
    #[command(name = "purge_queue")]
    PurgeQueue { queue: String },
    /// Deletes a queue.
    #[command(name = "delete_queue")]
    DeleteQueue {
        queue: String,
        /// Only when it has no ready messages.
        #[arg(long = "if-empty", short = 'e')]
        if_empty: bool,
        /// Only when it has no consumers.
        #[arg(long = "if-unused", short = 'U')]
        if_unused: bool,
    },
    /// Closes a connection (by its name, as list_connections shows it with the `name` column).
    #[command(name = "close_connection")]
    CloseConnection { name: String, explanation: String },
    /// Closes every connection of USER (on the node the API runs on).
    #[command(name = "close_all_user_connections")]
    CloseAllUserConnections { user: String, explanation: String },
    /// Sets the memory alarm's threshold on the node the API runs on until it restarts: a
    /// fraction of the available memory (`0.4`), or `absolute BYTES` (`absolute 512MiB`).
    #[command(name = "set_vm_memory_high_watermark")]
    SetVmMemoryHighWatermark {
        /// `FRACTION`, or `absolute` and `BYTES`.
        #[arg(num_args = 1..=2, required = true)]
        value: Vec<String>,
    },
    /// Sets the disk alarm's free-space threshold on the node the API runs on until it
    /// restarts: BYTES, with an optional unit (`50MB`, `1GiB`).
    #[command(name = "set_disk_free_limit")]
    SetDiskFreeLimit { bytes: String },
    /// Writes every definition (vhosts, users, permissions, policies, queues, exchanges,
    /// bindings) to FILE in RabbitMQ's format; `-` for standard output.
    #[command(name = "export_definitions")]
    ExportDefinitions { file: String },
    /// Imports definitions from FILE (RabbitMQ's format; `-` for standard input).
    #[command(name = "import_definitions")]
    ImportDefinitions { file: String },
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let usage = e.use_stderr();
            let _ = e.print();
            std::process::exit(if usage { 64 } else { 0 });
        }
    };
    let client = http::Client::new(&cli.management, &cli.username, &cli.password, Duration::from_secs(cli.timeout.max(1)));
    match commands::run(&cli, &client) {
        Ok(out) => print!("{out}"),
        Err(e) => {
            eprintln!("Error: {e}");
            std::process::exit(e.exit_code());
        }
    }
}
