//! Observability: one [`Stats`] block of plain counters per core, summed on scrape into the
//! Prometheus text exposition format at `GET /metrics` on `--metrics-listen`.
//!
//! It renders what it is given ([`render`]: the cores' [`Stats`], resource [`Gauges`] and
//! [`RaftFigures`]) and imports nothing of the layers above it; the broker hands
//! [`serve_metrics`] the function that gathers them. The metrics server is a plain std
//! thread (it never runs on an executor).

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A latency histogram with power-of-two buckets from 1 µs to about 35 min, in the shape
/// of a Prometheus histogram. Written by one core, read on scrape (relaxed atomics).
#[derive(Debug)]
pub struct Histogram {
    /// `buckets[i]` counts samples ≤ 2^i µs (and above 2^(i-1) µs).
    buckets: [AtomicU64; Histogram::BUCKETS],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: std::array::from_fn(|_| AtomicU64::new(0)), sum_ns: AtomicU64::new(0), count: AtomicU64::new(0) }
    }
}

impl Histogram {
    /// Number of buckets (the last one also takes everything larger).
    pub const BUCKETS: usize = 32;

    /// Records one sample.
    pub fn record(&self, d: std::time::Duration) {
        let us = d.as_micros() as u64;
        let i = if us <= 1 { 0 } else { (64 - (us - 1).leading_zeros()) as usize }.min(Self::BUCKETS - 1);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether this message's stage timings are recorded: one in [`SAMPLE_EVERY`] per thread,
/// so the hot path reads the clock for few messages.
pub fn sample() -> bool {
    thread_local! {
        static N: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    N.with(|n| {
        let v = n.get().wrapping_add(1);
        n.set(v);
        v % SAMPLE_EVERY == 0
    })
}

/// One message in this many gets its publish→stored and stored→delivered times recorded.
pub const SAMPLE_EVERY: u32 = 16;

/// Renders the per-core histograms of one stage, summed, as a Prometheus histogram in
/// seconds with label `stage`.
fn render_histogram(out: &mut String, name: &str, stage: &str, parts: &[&Histogram]) {
    let mut cumulative = 0u64;
    for i in 0..Histogram::BUCKETS {
        cumulative += parts.iter().map(|h| h.buckets[i].load(Ordering::Relaxed)).sum::<u64>();
        let le = (1u64 << i) as f64 / 1e6;
        out.push_str(&format!("{name}_bucket{{stage=\"{stage}\",le=\"{le}\"}} {cumulative}\n"));
    }
    let count: u64 = parts.iter().map(|h| h.count.load(Ordering::Relaxed)).sum();
    let sum: u64 = parts.iter().map(|h| h.sum_ns.load(Ordering::Relaxed)).sum();
    out.push_str(&format!("{name}_bucket{{stage=\"{stage}\",le=\"+Inf\"}} {count}\n"));
    out.push_str(&format!("{name}_sum{{stage=\"{stage}\"}} {}\n", sum as f64 / 1e9));
    out.push_str(&format!("{name}_count{{stage=\"{stage}\"}} {count}\n"));
}

/// Counters of one core. Relaxed atomics: written by their core only, read on scrape.
#[derive(Debug, Default)]
pub struct Stats {
    /// End of basic.publish → the queue stored the message (appended; for a persistent
    /// message in a durable queue: synced).
    pub publish_to_stored: Histogram,
    /// Stored → handed to a consumer or a basic.get (first deliveries only).
    pub stored_to_delivered: Histogram,
    /// Delivered → acknowledged (manual ack only).
    pub delivered_to_acked: Histogram,
    /// fdatasync calls of queue shards and unacked indexes (group commits).
    pub queue_syncs: AtomicU64,
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
    /// Publishes a queue could not store (disk full, store failed): nacked.
    pub store_refused: AtomicU64,
    /// Queues whose store failed and were reopened from disk.
    pub store_reopens: AtomicU64,
}

impl Stats {
    /// Adds `n` to a counter.
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

fn counter(out: &mut String, name: &str, help: &str, v: u64) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}\n"));
}

fn gauge(out: &mut String, name: &str, help: &str, v: u64) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}\n"));
}

/// Resource gauges at scrape time (from the broker's alarms).
#[derive(Clone, Copy, Debug, Default)]
pub struct Gauges {
    /// Open file descriptors of the process.
    pub open_fds: u64,
    /// The open-files limit in force.
    pub max_fds: u64,
    /// Free bytes on the data directory's filesystem.
    pub disk_free_bytes: u64,
    /// The disk alarm threshold, bytes.
    pub disk_free_limit: u64,
    /// The free-disk alarm is raised.
    pub disk_alarm: bool,
    /// The file-descriptor alarm is raised.
    pub fd_alarm: bool,
    /// Connections closed at accept because descriptors ran low (a counter).
    pub connections_refused: u64,
}

/// The metadata group's figures at scrape time.
#[derive(Clone, Copy, Debug, Default)]
pub struct RaftFigures {
    /// Raft entries appended by this node.
    pub entries_appended: u64,
    /// fdatasync calls of the Raft log.
    pub fsyncs: u64,
    /// Metadata commands applied.
    pub commands_applied: u64,
    /// This node leads the metadata group.
    pub is_leader: bool,
}

/// Renders every core's counters and histograms (summed), the resource gauges and the
/// metadata group's figures, in the Prometheus text format (version 0.0.4).
pub fn render(stats: &[Stats], a: &Gauges, raft: &RaftFigures) -> String {
    let sum = |f: fn(&Stats) -> &AtomicU64| stats.iter().map(|s| f(s).load(Ordering::Relaxed)).sum::<u64>();
    let mut out = String::new();
    let o = &mut out;
    counter(o, "ringmq_connections_opened_total", "Connections accepted.", sum(|s| &s.connections_opened));
    counter(o, "ringmq_connections_closed_total", "Connections closed.", sum(|s| &s.connections_closed));
    counter(o, "ringmq_messages_published_total", "Messages received by basic.publish.", sum(|s| &s.published));
    counter(o, "ringmq_messages_delivered_total", "Messages sent by basic.deliver or basic.get-ok.", sum(|s| &s.delivered));
    counter(o, "ringmq_messages_acked_total", "Deliveries acknowledged.", sum(|s| &s.acked));
    counter(o, "ringmq_messages_requeued_total", "Deliveries requeued.", sum(|s| &s.requeued));
    counter(o, "ringmq_messages_confirmed_total", "Publisher confirms sent.", sum(|s| &s.confirmed));
    counter(o, "ringmq_messages_returned_total", "Unroutable mandatory messages returned.", sum(|s| &s.returned));
    counter(o, "ringmq_queue_syncs_total", "Group commits (fdatasync) of queue shards and unacked indexes.", sum(|s| &s.queue_syncs));
    counter(o, "ringmq_messages_store_refused_total", "Publishes a queue could not store (nacked).", sum(|s| &s.store_refused));
    counter(o, "ringmq_queue_store_reopens_total", "Queues reopened from disk after their store failed.", sum(|s| &s.store_reopens));
    // Resource gauges under rabbitmq_prometheus's names, so existing dashboards read them.
    counter(o, "ringmq_connections_refused_total", "Connections closed at accept: file descriptors low.", a.connections_refused);
    gauge(o, "rabbitmq_process_open_fds", "Open file descriptors.", a.open_fds);
    gauge(o, "rabbitmq_process_max_fds", "Open file descriptors limit.", a.max_fds);
    gauge(o, "rabbitmq_disk_space_available_bytes", "Disk space available in bytes.", a.disk_free_bytes);
    gauge(o, "rabbitmq_disk_space_available_limit_bytes", "Free disk space low watermark in bytes.", a.disk_free_limit);
    gauge(o, "rabbitmq_alarms_free_disk_space_watermark", "is 1 if free disk space watermark alarm is in effect", a.disk_alarm as u64);
    gauge(o, "rabbitmq_alarms_file_descriptor_limit", "is 1 if file descriptor limit alarm is in effect", a.fd_alarm as u64);
    let name = "ringmq_stage_latency_seconds";
    o.push_str(&format!(
        "# HELP {name} Per-stage message latency: publish_to_stored, stored_to_delivered, delivered_to_acked.\n# TYPE {name} histogram\n"
    ));
    type Pick = fn(&Stats) -> &Histogram;
    let stages: [(&str, Pick); 3] = [
        ("publish_to_stored", |s| &s.publish_to_stored),
        ("stored_to_delivered", |s| &s.stored_to_delivered),
        ("delivered_to_acked", |s| &s.delivered_to_acked),
    ];
    for (stage, pick) in stages {
        let parts: Vec<&Histogram> = stats.iter().map(pick).collect();
        render_histogram(o, name, stage, &parts);
    }
    counter(o, "ringmq_raft_entries_total", "Raft entries appended by this node.", raft.entries_appended);
    counter(o, "ringmq_raft_fsyncs_total", "fdatasync calls of the Raft log.", raft.fsyncs);
    counter(o, "ringmq_raft_commands_total", "Metadata commands applied.", raft.commands_applied);
    o.push_str(&format!(
        "# HELP ringmq_raft_is_leader 1 when this node leads the metadata group.\n# TYPE ringmq_raft_is_leader gauge\nringmq_raft_is_leader {}\n",
        raft.is_leader as u8
    ));
    out
}

/// Most scrapes served at once.
const MAX_SCRAPES: u64 = 16;

/// Answers one HTTP request on `stream` (2 s read timeout).
fn answer(mut stream: std::net::TcpStream, render: &(dyn Fn() -> String + Send + Sync)) {
    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(2)));
    let mut line = String::new();
    let Ok(clone) = stream.try_clone() else { return };
    let mut reader = BufReader::new(clone);
    if reader.read_line(&mut line).is_err() {
        return;
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
    let (status, body) =
        if line.starts_with("GET /metrics") { ("200 OK", render()) } else { ("404 Not Found", "not found; try /metrics\n".to_string()) };
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// The function a scrape calls for the exposition text.
pub type RenderFn = Arc<dyn Fn() -> String + Send + Sync>;

/// Serves `GET /metrics` on `addr` from a background thread, answering each scrape with
/// `render()`. A bind failure is logged and metrics stay off (the broker still runs).
pub fn serve_metrics(addr: SocketAddr, render: RenderFn) {
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "metrics endpoint disabled: cannot bind");
            return;
        }
    };
    let busy = Arc::new(AtomicU64::new(0));
    let spawned = std::thread::Builder::new().name("ringmq-metrics".into()).spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            // One short-lived thread per scrape, at most MAX_SCRAPES at once: a client that
            // connects and sends nothing must not hold up the others.
            if busy.load(Ordering::Relaxed) >= MAX_SCRAPES {
                continue;
            }
            busy.fetch_add(1, Ordering::Relaxed);
            let (render, busy) = (render.clone(), busy.clone());
            let started = std::thread::Builder::new().name("ringmq-scrape".into()).spawn(move || {
                answer(stream, &*render);
                busy.fetch_sub(1, Ordering::Relaxed);
            });
            if started.is_err() {
                tracing::warn!("metrics: could not start a scrape thread");
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "metrics thread did not start");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn buckets_are_cumulative_powers_of_two() {
        let h = Histogram::default();
        h.record(Duration::from_nanos(500)); // ≤ 1 µs
        h.record(Duration::from_micros(3)); // ≤ 4 µs
        h.record(Duration::from_micros(4)); // ≤ 4 µs
        h.record(Duration::from_secs(100_000)); // last bucket
        let mut out = String::new();
        render_histogram(&mut out, "x", "s", &[&h]);
        assert!(out.contains("x_bucket{stage=\"s\",le=\"0.000001\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{stage=\"s\",le=\"0.000002\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{stage=\"s\",le=\"0.000004\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{stage=\"s\",le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_count{stage=\"s\"} 4\n"), "{out}");
    }
}
