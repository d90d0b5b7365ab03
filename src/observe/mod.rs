//! Observability: one [`Stats`] block of plain counters per core, summed on scrape into the
//! Prometheus text exposition format at `GET /metrics` on `--metrics-listen`.
//!
//! The metrics server is a plain std thread (it never runs on an executor).

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::core::Shared;

/// Counters of one core. Relaxed atomics: written by their core only, read on scrape.
#[derive(Debug, Default)]
pub struct Stats {
    /// Connections accepted.
    pub connections_opened: AtomicU64,
    /// Connections closed.
    pub connections_closed: AtomicU64,
    /// Messages published (basic.publish received).
    pub published: AtomicU64,
    /// Messages delivered (basic.deliver and basic.get-ok sent).
    pub delivered: AtomicU64,
    /// Deliveries acknowledged.
    pub acked: AtomicU64,
    /// Deliveries requeued.
    pub requeued: AtomicU64,
    /// Publisher confirms sent (basic.ack to publishers, per message).
    pub confirmed: AtomicU64,
    /// Unroutable mandatory messages returned.
    pub returned: AtomicU64,
}

impl Stats {
    /// Adds `n` to a counter.
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Renders every core's counters (summed) and the metadata group's figures.
pub fn render(shared: &Shared) -> String {
    let sum = |f: fn(&Stats) -> &AtomicU64| shared.stats.iter().map(|s| f(s).load(Ordering::Relaxed)).sum::<u64>();
    let mut out = String::new();
    let mut counter = |name: &str, help: &str, v: u64| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}\n"));
    };
    counter("ringmq_connections_opened_total", "Connections accepted.", sum(|s| &s.connections_opened));
    counter("ringmq_connections_closed_total", "Connections closed.", sum(|s| &s.connections_closed));
    counter("ringmq_messages_published_total", "Messages received by basic.publish.", sum(|s| &s.published));
    counter("ringmq_messages_delivered_total", "Messages sent by basic.deliver or basic.get-ok.", sum(|s| &s.delivered));
    counter("ringmq_messages_acked_total", "Deliveries acknowledged.", sum(|s| &s.acked));
    counter("ringmq_messages_requeued_total", "Deliveries requeued.", sum(|s| &s.requeued));
    counter("ringmq_messages_confirmed_total", "Publisher confirms sent.", sum(|s| &s.confirmed));
    counter("ringmq_messages_returned_total", "Unroutable mandatory messages returned.", sum(|s| &s.returned));
    let m = shared.meta.stats();
    counter("ringmq_raft_entries_total", "Raft entries appended by this node.", m.entries_appended);
    counter("ringmq_raft_fsyncs_total", "fdatasync calls of the Raft log.", m.fsyncs);
    counter("ringmq_raft_commands_total", "Metadata commands applied.", m.commands_applied);
    out.push_str(&format!(
        "# HELP ringmq_raft_is_leader 1 when this node leads the metadata group.\n# TYPE ringmq_raft_is_leader gauge\nringmq_raft_is_leader {}\n",
        shared.meta.is_leader() as u8
    ));
    out
}

/// Serves `GET /metrics` on `addr` from a background thread. A bind failure is logged
/// and metrics stay off (the broker still runs).
pub fn serve_metrics(addr: SocketAddr, shared: Arc<Shared>) {
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "metrics endpoint disabled: cannot bind");
            return;
        }
    };
    let spawned = std::thread::Builder::new().name("ringmq-metrics".into()).spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(2)));
            let mut line = String::new();
            let mut reader = BufReader::new(match stream.try_clone() {
                Ok(s) => s,
                Err(_) => continue,
            });
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            // Drain headers (bounded).
            for _ in 0..100 {
                let mut h = String::new();
                match reader.read_line(&mut h) {
                    Ok(0) | Err(_) => break,
                    Ok(_) if h == "\r\n" || h == "\n" => break,
                    Ok(_) => {}
                }
            }
            let (status, body) = if line.starts_with("GET /metrics") {
                ("200 OK", render(&shared))
            } else {
                ("404 Not Found", "not found; try /metrics\n".to_string())
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "metrics thread did not start");
    }
}
