//! The `ringmq` binary: parse the configuration, open the metadata, start the cores.

use std::sync::Arc;

/// mimalloc: the broker allocates and frees small buffers per message on every core;
/// glibc malloc spent about a quarter of the broker's CPU on that in `ringmq-bench
/// throughput` (perf), mimalloc's per-thread free lists much less.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::io::Write;

use clap::Parser;
use ringmq::config::{Cli, Config};
use ringmq::meta::MetaHandle;

fn main() {
    let config = match Config::load(Cli::parse()) {
        Ok(c) => c,
        Err(e) => {
            ringmq::observe::log::stderr_line(&format!("ringmq: {e}"));
            std::process::exit(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&config.log).unwrap_or_else(|e| {
        ringmq::observe::log::stderr_line(&format!("ringmq: invalid --log filter {:?} ({e}); using \"info\"", config.log));
        tracing_subscriber::EnvFilter::new("info")
    });
    use std::io::IsTerminal;
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(std::io::stderr().is_terminal()).log_internal_errors(false);
    // Lines go to stderr through one writer thread that drops and counts what it cannot write
    // (observe::log): a closed log pipe must not take the broker down.
    match ringmq::observe::log::stderr_sink() {
        Ok(sink) => fmt.with_writer(sink).init(),
        Err(_) => fmt.with_writer(std::io::stderr).init(),
    }
    ringmq::core::fatal::install_panic_hook();
    if let Some(id) = config.forget_node {
        let (line, code) = ringmq::membership::forget(&config, id);
        // A closed stdout must not turn the outcome into a panic.
        let _ = writeln!(std::io::stdout(), "{line}");
        ringmq::observe::log::flush(std::time::Duration::from_secs(1));
        std::process::exit(code);
    }
    if let Err(e) = run(config) {
        ringmq::observe::log::stderr_line(&format!("ringmq: {e}"));
        std::process::exit(1);
    }
    ringmq::observe::log::flush(std::time::Duration::from_secs(1));
}

fn run(mut config: Config) -> Result<(), Box<dyn std::error::Error>> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    if config.cores > cpus {
        // Each core is a pinned executor that expects a CPU of its own: more of them than
        // CPUs share CPUs and take turns, which costs latency and buys nothing.
        tracing::warn!(cores = config.cores, cpus, "--cores is above the CPUs this process may use; cores will share CPUs");
    }
    let data = config.data_dir.clone();
    at(&data, "creating the data directory", ringmq_shards::create_dir_all_durable(&data))?;
    // Absolute from here on: glommio opens directories relative to no directory at all.
    config.data_dir = at(&data, "resolving the data directory", std::fs::canonicalize(&data))?;
    let _lock = lock_data_dir(&config.data_dir)?;
    // Non-durable queues do not survive a restart: their shards go with the old run.
    let transient = config.transient_dir();
    if transient.exists() {
        at(&transient, "emptying", std::fs::remove_dir_all(&transient))?;
    }
    at(&transient, "creating", std::fs::create_dir_all(&transient))?;
    let durable = config.durable_dir();
    at(&durable, "creating", ringmq_shards::create_dir_all_durable(&durable))?;
    let (meta, cluster) = ringmq::server::start_meta(&config)?;
    seed(&config, &meta)?;
    at(&durable, "removing shards of deleted queues in", remove_orphan_shards(&config, &meta))?;
    let (stop_tx, stop_rx) = flume::bounded(1);
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])?;
    std::thread::Builder::new().name("ringmq-signals".into()).spawn(move || {
        for signal in signals.forever() {
            if signal == SIGHUP {
                // Log rotation tools send it; the log goes to standard error, which the
                // service manager owns: nothing to reopen, and no reason to stop.
                tracing::info!("SIGHUP ignored: ringmq logs to standard error and has no file to reopen");
                continue;
            }
            let _ = stop_tx.send(());
            break;
        }
    })?;
    ringmq::server::start(Arc::new(config), meta, cluster, stop_rx)?;
    Ok(())
}

/// `r` with its error naming what was being done to which path ("creating /srv/ringmq:
/// Read-only file system (os error 30)"): an operator sees which directory to fix.
fn at<T>(path: &std::path::Path, doing: &str, r: std::io::Result<T>) -> Result<T, String> {
    r.map_err(|e| format!("{doing} {}: {e}", path.display()))
}

/// Seeds a fresh data directory with the configuration's vhosts, users, permissions and
/// policies (`broker::access::seed_commands`): only while the metadata has never held a user,
/// so what was changed at run time is never overwritten by the file; and names the cluster
/// while it has no name (`broker::cluster_name::seed`). In a cluster, first
/// catches up with the group (a node joining late must not reset another node's changes).
fn seed(config: &Config, meta: &MetaHandle) -> Result<(), Box<dyn std::error::Error>> {
    if meta.is_cluster() {
        if let Err(e) = futures_lite::future::block_on(meta.sync()) {
            tracing::warn!(error = %e, "could not catch up with the metadata group before seeding users");
        }
    }
    if !meta.topology().access.initialized {
        let cmds = ringmq::broker::access::seed_commands(config)?;
        tracing::info!(users = config.users.len(), vhosts = config.vhosts.len(), "seeding users, vhosts, permissions and policies");
        meta.propose_blocking(cmds)?;
    }
    ringmq::broker::cluster_name::seed(meta, config.cluster_name.as_deref())?;
    Ok(())
}

/// Takes an exclusive lock on `<data>/LOCK` for the life of the process: two brokers on one
/// data directory would interleave their writes to the metadata log and damage it.
///
/// # Errors
/// When another process holds the lock, or the file cannot be opened.
fn lock_data_dir(dir: &std::path::Path) -> Result<std::fs::File, Box<dyn std::error::Error>> {
    let path = dir.join("LOCK");
    let f = at(&path, "opening", std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path))?;
    // flock(LOCK_EX | LOCK_NB) through std: released when the process ends, however it ends.
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => {
            Err(format!("data directory {} is in use by another ringmq (lock {} is held)", dir.display(), path.display()).into())
        }
        Err(std::fs::TryLockError::Error(e)) => Err(format!("cannot lock {}: {e}", path.display()).into()),
    }
}

/// Removes shard directories of durable queues the metadata no longer has (a delete that
/// crashed between the metadata commit and the file removal), or whose replica set no longer
/// names this node (a queue of the name declared again while this node was down) and that
/// are not being copied to it (`meta::grow`).
fn remove_orphan_shards(config: &Config, meta: &MetaHandle) -> std::io::Result<()> {
    let topo = meta.topology();
    let me = meta.node_id();
    let known: std::collections::HashSet<String> = topo
        .queues
        .values()
        .filter(|q| q.stored_on(me) || meta.with_state(|s| s.growing_to(&q.vhost, &q.name, me)))
        .map(|q| ringmq::config::queue_dir_name(&q.vhost, &q.name))
        .collect();
    for entry in std::fs::read_dir(config.durable_dir())? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !known.contains(&name) {
            tracing::info!(dir = %entry.path().display(), "removing shard of a deleted queue");
            std::fs::remove_dir_all(entry.path())?;
        }
    }
    Ok(())
}
