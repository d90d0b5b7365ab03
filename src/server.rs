//! The wiring: puts the broker's per-core state ([`broker::node::Node`]) and the protocol
//! ([`amqp::connection::serve`]) on the thread-per-core runtime ([`crate::core`]), starts
//! the alarm monitor and the metrics endpoint, and runs until a shutdown signal. The only
//! module that names every layer; nothing imports it but `main.rs`.

use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::broker::alarms::{self, Alarms};
use crate::broker::node::{Node, NodeMsg, PeerLinks, Shared};
use crate::broker::remote::{DataNet, Remote, RemoteSlot};
use crate::cluster::{Report, Transport, TransportConfig};
use crate::config::Config;
use crate::core::{accept, mesh, Runtime};
use crate::meta::{ClusterSpec, MetaConfig, MetaHandle, RaftNet};
use crate::{amqp, core, observe};

use futures_rustls::TlsAcceptor;

/// Sockets a core's accept threads hand it.
type Accepted = flume::Receiver<std::net::TcpStream>;

/// How long a cluster node waits at start for a majority of its peers (RabbitMQ retries
/// its peers for 5 minutes by default: 10 × 30 s).
pub const CLUSTER_START_WAIT: Duration = Duration::from_secs(300);

/// A cluster node's parts that outlive [`start_meta`]: the transport, and the slot its data
/// callbacks read the node's [`Remote`] from once [`start`] made it.
pub struct ClusterParts {
    transport: Arc<Transport>,
    slot: Arc<RemoteSlot>,
}

/// The data lane of the cluster transport, as `broker::remote` sends on it.
struct DataLane(Arc<Transport>);

impl DataNet for DataLane {
    fn send(&self, to: u64, payload: Vec<u8>) -> Result<(), String> {
        self.0.send_data(to, payload).map_err(|e| e.to_string())
    }
}

/// Opens the metadata group: a single voter without `--peers`; with them, one voter of the
/// cluster, its node-to-node transport listening on `--cluster-listen`. Returns the handle and,
/// in a cluster, the parts [`start`] needs to serve other nodes' queues. Blocks until this
/// node's boot is applied (a cluster: until a majority answers, at most
/// [`CLUSTER_START_WAIT`]).
///
/// # Errors
/// The metadata group's errors ([`crate::meta::MetaError`]); the transport's
/// ([`crate::cluster::TransportError`]: the cluster port is taken).
pub fn start_meta(config: &Config) -> Result<(MetaHandle, Option<ClusterParts>), Box<dyn std::error::Error>> {
    let (meta, parts) = start_meta_group(config)?;
    // A node whose metadata log fails (EIO, a disk gone read-only) can commit nothing again:
    // it ends, and a restart recovers from what the disk holds (PostgreSQL's lesson: after a
    // failed fsync the page cache is no longer to be trusted, so nothing is retried).
    meta.on_failure(|why| {
        crate::core::fatal::fatal(&format!("the metadata group stopped: {why}; a restart recovers from the data on disk"))
    });
    Ok((meta, parts))
}

/// [`start_meta`] without the failure hook.
fn start_meta_group(config: &Config) -> Result<(MetaHandle, Option<ClusterParts>), Box<dyn std::error::Error>> {
    if !config.is_cluster() {
        return Ok((MetaHandle::start(&config.meta_dir(), config.node_id)?, None));
    }
    let me = config.node_id;
    let listen = config.cluster_listen.unwrap_or(config.peers[&me]);
    let (inbox, inbox_rx) = crate::meta::net::inbox();
    let on_message = {
        let inbox = inbox.clone();
        Arc::new(move |m| inbox.step(m))
    };
    let on_report = Arc::new(move |r| match r {
        Report::Unreachable(id) => inbox.unreachable(id),
        Report::SnapshotFinished(id) => inbox.snapshot_done(id, true),
        Report::SnapshotFailed(id) => inbox.snapshot_done(id, false),
    });
    let slot: Arc<RemoteSlot> = Default::default();
    let on_data = {
        let slot = slot.clone();
        Arc::new(move |from, payload| slot.payload(from, payload))
    };
    let on_link = {
        let slot = slot.clone();
        Arc::new(move |peer, up| slot.link(peer, up))
    };
    let tcfg = TransportConfig::new(me, listen, config.peers.clone());
    let transport = Arc::new(Transport::start_with_data(tcfg, on_message, on_report, on_data, on_link)?);
    struct Net(Arc<Transport>);
    impl RaftNet for Net {
        fn send(&self, msgs: Vec<raft::eraftpb::Message>) {
            self.0.send_all(msgs);
        }

        fn retain_peers(&self, voters: &[u64]) {
            for p in self.0.peers() {
                if !voters.contains(&p.id) {
                    self.0.remove_peer(p.id);
                }
            }
        }

        fn voters_elsewhere(&self) -> Option<Vec<u64>> {
            crate::membership::voters_named_by_peers(self.0.peers().into_iter().map(|p| (p.id, p.addr)), self.0.me())
        }

        fn add_peer(&self, id: u64, addr: &str) {
            match addr.parse() {
                Ok(addr) => {
                    if let Err(e) = self.0.add_peer(id, addr) {
                        tracing::error!(node = id, %addr, error = %e, "cannot add a node that joined to the transport");
                    }
                }
                Err(_) => tracing::error!(node = id, addr, "a node joined with an address that does not parse"),
            }
        }
    }
    // A node that joins starts from the group's first voters, once a running node added it.
    let (voters, joining) = if config.join {
        (crate::membership::join(config, CLUSTER_START_WAIT)?, true)
    } else {
        (config.peers.keys().copied().collect::<Vec<u64>>(), false)
    };
    tracing::info!(node = me, cluster_listen = %listen, ?voters, joining, "joining the cluster's metadata group");
    let spec = ClusterSpec { voters, joining, net: Arc::new(Net(transport.clone())) };
    let meta = MetaHandle::start_cluster(&config.meta_dir(), me, MetaConfig::default(), spec, inbox_rx, CLUSTER_START_WAIT)?;
    transport.on_admin(crate::membership::admin_handler(meta.clone()));
    Ok((meta, Some(ClusterParts { transport, slot })))
}

/// The AMQP addresses to bind, once each is free: `config.listen`, but for a default address
/// the host does not have (IPv6 disabled: no ::1), skipped with a warning.
///
/// # Errors
/// An address still taken after 10 s, or one that cannot be bound (given explicitly).
fn listen_addrs(config: &Config) -> std::io::Result<Vec<std::net::SocketAddr>> {
    let mut out = Vec::new();
    for &addr in &config.listen {
        match accept::wait_port_free(addr) {
            Ok(()) => out.push(addr),
            Err(e) if config.listen_optional.contains(&addr) && e.kind() != std::io::ErrorKind::AddrInUse => {
                tracing::warn!(%addr, error = %e, "not listening on the IPv6 loopback (this host has none); IPv4 only");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Runs the broker: starts `config.cores` executors and blocks until they stop.
///
/// `shutdown` fires when the process should stop (SIGINT/SIGTERM): every core then closes
/// its connections with 320 and its shards (up to 10 s per core), and the metadata group
/// stops.
///
/// `cluster` (a cluster node only): its transport, for `/metrics` and for serving other nodes'
/// queues ([`Remote`]).
///
/// # Errors
/// Fails when an executor cannot start, the AMQP port cannot be bound, or the alarm
/// monitor cannot start.
pub fn start(config: Arc<Config>, meta: MetaHandle, cluster: Option<ClusterParts>, shutdown: flume::Receiver<()>) -> std::io::Result<()> {
    let cores = config.cores.max(1);
    let listen = listen_addrs(&config)?;
    let tls_listen = match &config.tls {
        Some(tls) => {
            for &addr in &tls.listen {
                accept::wait_port_free(addr)?;
            }
            tls.listen.clone()
        }
        None => Vec::new(),
    };
    let (inboxes, receivers) = mesh::Inboxes::<NodeMsg>::new(cores);
    let alarms = Arc::new(Alarms::new(config.disk_free_limit));
    let (soft_before, soft, hard) = alarms::raise_fd_limit();
    alarms.max_fds.store(soft, Ordering::Relaxed);
    if soft < 4096 {
        tracing::warn!(
            soft_before,
            soft,
            hard,
            "open-files limit is low: each durable queue holds 2 descriptors or more; raise the hard limit (LimitNOFILE=) for many queues"
        );
    } else if soft > soft_before {
        tracing::info!(soft_before, soft, hard, "open-files limit raised to the hard limit");
    } else {
        tracing::info!(soft, hard, "open-files limit");
    }
    let mut shared = Shared::new(config.clone(), meta.clone(), inboxes.clone(), alarms.clone());
    if let Some(parts) = cluster {
        let transport = parts.transport.clone();
        let links: PeerLinks = Arc::new(move || transport.peers().into_iter().map(|p| (p.id, p.connected)).collect());
        shared.peer_links = Some(links);
        let remote =
            Arc::new(Remote::new(config.node_id, Arc::new(DataLane(parts.transport)), meta, inboxes, cores, shared.reply_to.clone()));
        parts.slot.set(remote.clone());
        shared.remote = Some(remote);
    }
    let shared = Arc::new(shared);
    crate::broker::replicas::attach(&shared);
    {
        let inboxes = shared.inboxes.clone();
        let available = alarms::available_memory().unwrap_or(0);
        let limit = config.memory_high_watermark.bytes(available);
        alarms.memory_limit.store(limit, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            watermark = %config.memory_high_watermark,
            limit_bytes = limit,
            available_bytes = available,
            "memory alarm threshold (0 = off)"
        );
        alarms::start_monitor(alarms, config.data_dir.clone(), move |blocked| inboxes.send_all(|| NodeMsg::ResourceAlarm(blocked)))?;
    }
    let metrics = {
        let shared = shared.clone();
        let render = move |path: &str, query: &str| match path {
            "/metrics" => Some(shared.metrics_text()),
            "/metrics/per-object" => Some(observe::render_per_object(shared.queue_samples(), &shared.identity())),
            "/metrics/detailed" => {
                Some(observe::render_detailed(query, shared.queue_samples(), &shared.stats, &shared.live, &shared.identity()))
            }
            _ => None,
        };
        match observe::serve_metrics(config.metrics_listen, Arc::new(render)) {
            Some(addr) => format!("metrics on http://{addr}/metrics"),
            None => format!("metrics off (cannot bind {})", config.metrics_listen),
        }
    };
    // The management API (plain and HTTPS): logins against the metadata's users, as the AMQP
    // handshake's.
    let management = if config.management_listen.is_none() && config.management_tls.is_none() {
        "management API off".to_owned()
    } else {
        let users = Arc::new(crate::broker::auth::MetaUsers { meta: shared.meta.clone(), config: config.clone() });
        match crate::mgmt::serve(config.management_listen, config.management_tls.as_ref(), shared.clone(), users) {
            Ok(bound) => management_line(&config, &bound),
            Err(e) => {
                tracing::warn!(error = %e, "management API disabled: its thread cannot start");
                format!("management API off ({e})")
            }
        }
    };
    // Each core takes its own inbox and accept channel out of these once.
    let mut per_core = Vec::new();
    for (i, rx) in receivers.into_iter().enumerate() {
        let admit: accept::Admit = {
            let alarms = shared.alarms.clone();
            Arc::new(move |peer| alarms.admit(peer))
        };
        let tls = match &config.tls {
            Some(tls) => Some((accept::listen(i as u32, &tls_listen, admit.clone())?, TlsAcceptor::from(tls.server.clone()))),
            None => None,
        };
        per_core.push(Some((rx, accept::listen(i as u32, &listen, admit)?, tls)));
    }
    let per_core = Mutex::new(per_core);
    let rt = Runtime { cores, spin_before_park_us: config.spin_before_park_us };
    let handles = {
        let shared = shared.clone();
        core::spawn_cores(rt, move |i| {
            let taken = per_core.lock().ok().and_then(|mut v| v[i as usize].take());
            let shared = shared.clone();
            async move {
                let Some((inbox, accepted, tls)) = taken else { core::fatal::fatal("a core started twice") };
                run_core(Node::new(i, shared), inbox, accepted, tls).await
            }
        })?
    };
    let tls = match tls_listen.is_empty() {
        true => String::new(),
        false => format!(", AMQP over TLS on {}", tls_listen.iter().map(ToString::to_string).collect::<Vec<_>>().join(" and ")),
    };
    tracing::info!(
        "ringmq ready: AMQP 0-9-1 on {}{tls}, {} core{}, data in {}, {metrics}, {management}",
        listen.iter().map(ToString::to_string).collect::<Vec<_>>().join(" and "),
        cores,
        if cores == 1 { "" } else { "s" },
        config.data_dir.display(),
    );
    let _ = shutdown.recv();
    tracing::info!("shutting down");
    shared.shutting_down.store(true, Ordering::Relaxed);
    let (done_tx, done_rx) = flume::unbounded();
    shared.inboxes.send_all(|| NodeMsg::Shutdown { done: done_tx.clone() });
    for _ in 0..cores {
        let _ = done_rx.recv_timeout(Duration::from_secs(10));
    }
    shared.meta.shutdown();
    tracing::info!("ringmq stopped");
    // Executors may still hold sockets of clients that ignored connection.close; the
    // process exits right after this returns, which closes them.
    drop(handles);
    Ok(())
}

/// The ready line's words for the management listeners of `config`: each one's web UI URL
/// (the API is under its `/api/`), or why it is off (a bind failure is also logged at warn here).
fn management_line(config: &Config, bound: &crate::mgmt::Bound) -> String {
    let describe =
        |listener: &Option<std::io::Result<std::net::SocketAddr>>, asked: Option<std::net::SocketAddr>, name: &str, scheme: &str| {
            let asked = asked.map_or_else(String::new, |a| a.to_string());
            match listener {
                None => None,
                // The UI's URL (what an operator opens; RabbitMQ's log names it too).
                Some(Ok(addr)) => Some(format!("{} on {scheme}://{addr}/ (its HTTP API under /api/)", name.replace("API", "UI"))),
                Some(Err(e)) => {
                    tracing::warn!(addr = %asked, error = %e, "{name} disabled: cannot bind");
                    Some(format!("{name} off (cannot bind {asked}: {e})"))
                }
            }
        };
    let https = config.management_tls.as_ref().map(|t| t.listen);
    let parts = [
        describe(&bound.http, config.management_listen, "management API", "http"),
        describe(&bound.https, https, "management API over TLS", "https"),
    ];
    parts.into_iter().flatten().collect::<Vec<_>>().join(", ")
}

/// One core's life: its inbox loop, its tick, and a connection task per accepted socket
/// (`accepted`: the AMQP listeners'; `tls`: the amqps listeners' and the acceptor that runs
/// their TLS handshakes), until a shutdown message; then the node's shutdown and the reply.
async fn run_core(node: std::rc::Rc<Node>, inbox: flume::Receiver<NodeMsg>, accepted: Accepted, tls: Option<(Accepted, TlsAcceptor)>) {
    let inbox = {
        let node = node.clone();
        glommio::spawn_local(async move {
            mesh::drain(inbox, |msg| match node.handle(msg) {
                Some(done) => ControlFlow::Break(done),
                None => ControlFlow::Continue(()),
            })
            .await
        })
    };
    crate::core::spawn_soon(node.clone().tick());
    let accept = {
        let node = node.clone();
        glommio::spawn_local(async move {
            while let Ok(stream) = accepted.recv_async().await {
                if node.shared.shutting_down.load(Ordering::Relaxed) {
                    continue;
                }
                glommio::spawn_local(amqp::connection::serve(node.clone(), accept::into_glommio(stream))).detach();
            }
        })
    };
    let accept_tls = tls.map(|(accepted, acceptor)| {
        let node = node.clone();
        glommio::spawn_local(async move {
            while let Ok(stream) = accepted.recv_async().await {
                if node.shared.shutting_down.load(Ordering::Relaxed) {
                    continue;
                }
                let serve = amqp::connection::serve_tls(node.clone(), acceptor.clone(), accept::into_glommio(stream));
                glommio::spawn_local(serve).detach();
            }
        })
    });
    if let Some(done) = inbox.await {
        drop(accept);
        drop(accept_tls);
        node.shutdown().await;
        let _ = done.send(());
    }
}
