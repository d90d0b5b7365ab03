//! Figures of a finished run: the measurement window (times, CPU), the human summary,
//! the one-line JSON, and `report`, which compares two sets of JSON lines by median.

use crate::cli::Config;
use crate::clock::now_ns;
use crate::procfs;
use crate::run::Env;
use crate::stats::{fmt_us, round1, Stats};
use serde_json::{json, Map, Value};
use std::path::Path;

/// CPU times (µs) of the broker (if local) and of the bench at one instant.
pub type CpuMark = (Option<u64>, u64);

/// The measurement window of a run: CLOCK_MONOTONIC ns and CPU times at its edges.
pub struct Window {
    /// Broker process.
    pub broker_pid: Option<u32>,
    /// Start: producers about to start.
    pub t0_ns: u64,
    /// Publishing stopped.
    pub send_end_ns: u64,
    /// Drain finished (or timed out).
    pub end_ns: u64,
    /// CPU at t0.
    pub cpu0: CpuMark,
    /// CPU at end.
    pub cpu1: CpuMark,
    /// Backlog: end of the fill phase, when the broker reported the whole backlog queued
    /// (polled every 200 ms), not when the last publish left the bench.
    pub fill_end_ns: Option<u64>,
    /// Backlog: consumers start.
    pub drain_start_ns: Option<u64>,
    /// Backlog: CPU at drain start.
    pub drain_cpu0: Option<CpuMark>,
}

impl Window {
    /// Opens the window now.
    pub fn start(broker_pid: Option<u32>) -> Self {
        let t0 = now_ns();
        let cpu0 = Self::cpu_now(broker_pid);
        Window {
            broker_pid,
            t0_ns: t0,
            send_end_ns: t0,
            end_ns: t0,
            cpu0,
            cpu1: cpu0,
            fill_end_ns: None,
            drain_start_ns: None,
            drain_cpu0: None,
        }
    }

    /// CPU times now.
    pub fn cpu_now(broker_pid: Option<u32>) -> CpuMark {
        (broker_pid.and_then(|p| procfs::process_cpu_us(p).ok()), procfs::self_cpu_us())
    }

    /// Closes the window now.
    pub fn finish(&mut self) {
        self.end_ns = now_ns();
        self.cpu1 = Self::cpu_now(self.broker_pid);
    }
}

/// A finished run's figures.
pub struct Outcome {
    /// Flat JSON object (see README, "Figures").
    pub json: Map<String, Value>,
    /// Multi-line human summary.
    pub human: String,
    /// The run did what a smoke test checks: it received messages (churn: did operations).
    pub ok: bool,
    /// Lost, duplicated or errored (for --strict).
    pub integrity_issue: bool,
}

fn secs(a: u64, b: u64) -> f64 {
    b.saturating_sub(a) as f64 / 1e9
}

fn per_sec(n: u64, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

fn thousands(n: f64) -> String {
    let s = format!("{:.0}", n.max(0.0));
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn setup_json(cfg: &Config, j: &mut Map<String, Value>) {
    j.insert("scenario".into(), json!(cfg.scenario.name()));
    j.insert("label".into(), json!(cfg.label));
    j.insert("engine".into(), json!(cfg.engine.name()));
    j.insert("uri".into(), json!(cfg.uri_redacted()));
    j.insert("producers".into(), json!(cfg.producers));
    j.insert("consumers".into(), json!(cfg.consumers));
    j.insert("queues".into(), json!(cfg.queues.len()));
    j.insert("size_bytes".into(), json!(cfg.size));
    j.insert("rate_per_producer".into(), json!(cfg.rate));
    j.insert("confirm_window".into(), json!(cfg.confirm));
    j.insert("mandatory".into(), json!(cfg.mandatory));
    j.insert("persistent".into(), json!(cfg.persistent));
    j.insert("priorities".into(), json!(cfg.priorities));
    j.insert("expiration_ms".into(), json!(cfg.expiration));
    j.insert("auto_ack".into(), json!(cfg.auto_ack));
    j.insert("multi_ack_every".into(), json!(if cfg.auto_ack { Value::Null } else { json!(cfg.multi_ack_every) }));
    j.insert("prefetch".into(), json!(cfg.prefetch));
    j.insert("exchange".into(), json!(cfg.exchange.name));
    j.insert("exchange_type".into(), json!(cfg.exchange.kind.name()));
    j.insert("queue_args".into(), json!(cfg.queue_args_text));
}

fn setup_human(cfg: &Config) -> String {
    format!(
        "{} producer(s), {} consumer(s), {} queue(s), {} B, rate {}, confirm {}, {}, prefetch {}, {}{}, exchange {:?} ({}), engine {}",
        cfg.producers,
        cfg.consumers,
        cfg.queues.len(),
        cfg.size,
        if cfg.rate > 0.0 { format!("{}/s per producer", cfg.rate) } else { "unlimited".into() },
        if cfg.confirm > 0 { format!("window {}", cfg.confirm) } else { "off".into() },
        if cfg.auto_ack { "auto-ack".to_string() } else { format!("manual ack every {}", cfg.multi_ack_every) },
        cfg.prefetch,
        if cfg.persistent { "persistent" } else { "transient" },
        if cfg.mandatory { ", mandatory" } else { "" },
        cfg.exchange.name,
        cfg.exchange.kind.name(),
        cfg.engine.name(),
    )
}

/// What the CPU figures are computed from.
struct CpuSpan {
    /// CPU at the start and end of the span.
    marks: (CpuMark, CpuMark),
    /// Messages (or operations) the CPU time is divided by.
    per: u64,
    /// "msg" or "op".
    unit: &'static str,
    /// Largest broker RSS seen, bytes.
    rss_max: u64,
    /// Broker process.
    pid: Option<u32>,
}

fn cpu_figures(span: CpuSpan, j: &mut Map<String, Value>, h: &mut String) {
    let CpuSpan { marks: (w_cpu0, w_cpu1), per, unit, rss_max, pid } = span;
    let broker = match (w_cpu0.0, w_cpu1.0) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    let me = w_cpu1.1.saturating_sub(w_cpu0.1);
    let per_msg = |us: u64| (per > 0).then(|| us as f64 / per as f64);
    j.insert("broker_pid".into(), json!(pid));
    j.insert("broker_cpu_s".into(), round2(broker.map(|b| b as f64 / 1e6)));
    j.insert(format!("broker_cpu_us_per_{unit}"), round2(broker.and_then(per_msg)));
    j.insert("bench_cpu_s".into(), round2(Some(me as f64 / 1e6)));
    j.insert(format!("bench_cpu_us_per_{unit}"), round2(per_msg(me)));
    j.insert("broker_rss_max_mb".into(), if rss_max > 0 { json!((rss_max as f64 / 1e6).round()) } else { Value::Null });
    match broker {
        Some(b) => h.push_str(&format!(
            "  broker CPU {:.2} s = {} µs/{unit} (pid {}, RSS max {} MB)\n",
            b as f64 / 1e6,
            per_msg(b).map(|x| format!("{x:.2}")).unwrap_or("-".into()),
            pid.unwrap_or(0),
            rss_max / 1_000_000
        )),
        None => h.push_str(
            "  broker CPU unknown (no local broker process: a remote one, or the floor's relay in this process; else pass --broker-pid)\n",
        ),
    }
    h.push_str(&format!(
        "  bench  CPU {:.2} s = {} µs/{unit}\n",
        me as f64 / 1e6,
        per_msg(me).map(|x| format!("{x:.2}")).unwrap_or("-".into())
    ));
}

fn round2(v: Option<f64>) -> Value {
    match v {
        Some(x) if x.is_finite() => Value::from((x * 100.0).round() / 100.0),
        _ => Value::Null,
    }
}

impl Outcome {
    /// Figures of a publish/consume run; `depths` are the queues' ready counts at the end.
    pub fn from_pubsub(env: &Env, w: &Window, depths: &[Option<u64>]) -> Self {
        let cfg = &env.cfg;
        let s = &env.stats;
        let mut j = Map::new();
        let mut h = String::new();
        setup_json(cfg, &mut j);
        h.push_str(&format!("ringmq-bench {} — {}\n  setup      {}\n", cfg.scenario.name(), cfg.uri_redacted(), setup_human(cfg)));

        let (sent, received) = (s.sent.get(), s.received.get());
        let recv_from = w.drain_start_ns.unwrap_or(w.t0_ns);
        let send_s = secs(w.t0_ns, w.fill_end_ns.unwrap_or(w.send_end_ns));
        let last_rx = s.last_receive_ns.get().max(recv_from);
        let recv_s = secs(recv_from, last_rx);
        let depths_known = depths.iter().all(Option::is_some);
        let left: u64 = depths.iter().flatten().sum();
        let expected = env.expected();
        let arrived = env.arrived();
        // Unknown depth (broker stalled or channel closed): loss cannot be told from
        // messages still queued, so it is not reported as loss.
        // With auto-ack, deliveries the client library still held when a timed-out drain
        // stopped the consumers are in neither `arrived` nor the queues: loss cannot be told.
        let missing = expected.saturating_sub(arrived + left);
        let drain_cut = cfg.auto_ack && !env.drained.is_fired() && missing > 0;
        let lost = (depths_known && !drain_cut).then_some(missing);
        let unconfirmed = (cfg.confirm > 0).then(|| sent.saturating_sub(s.confirmed.get() + s.nacked.get()));
        let tracked = env.tracking;
        let dup = env.tracker.borrow().duplicates;

        j.insert("duration_s".into(), round1(Some(send_s)));
        j.insert("elapsed_s".into(), round1(Some(secs(w.t0_ns, w.end_ns))));
        j.insert("sent".into(), json!(sent));
        j.insert("confirmed".into(), json!(s.confirmed.get()));
        j.insert("unconfirmed".into(), json!(unconfirmed));
        j.insert("nacked".into(), json!(s.nacked.get()));
        j.insert("returned".into(), json!(s.returned.get()));
        j.insert("received".into(), json!(received));
        j.insert("lost".into(), if tracked { json!(lost) } else { Value::Null });
        j.insert("duplicates".into(), if tracked { json!(dup) } else { Value::Null });
        j.insert("redelivered".into(), json!(s.redelivered.get()));
        j.insert("left_in_queues".into(), if depths_known { json!(left) } else { Value::Null });
        j.insert("behind_schedule".into(), json!(s.behind_schedule.get()));
        j.insert("foreign".into(), json!(s.foreign.get()));
        j.insert("errors".into(), json!(s.errors.get()));
        j.insert("first_error".into(), json!(*s.first_error.borrow()));
        j.insert("send_rate".into(), json!(per_sec(sent, send_s).round()));
        j.insert("confirm_rate".into(), json!(per_sec(s.confirmed.get(), send_s).round()));
        j.insert("recv_rate".into(), json!(per_sec(received, recv_s).round()));
        j.insert("recv_mb_s".into(), round2(Some(per_sec(s.received_bytes.get(), recv_s) / 1e6)));
        s.e2e.borrow().to_json("e2e", &mut j);
        s.confirm.borrow().to_json("confirm", &mut j);
        if cfg.rate > 0.0 {
            j.insert("send_lag_p99_us".into(), round1(s.send_lag.borrow().quantile_us(0.99)));
        }

        h.push_str(&format!(
            "  published  {} in {:.1} s = {} msgs/s; confirmed {}, nacked {}, returned {}{}\n",
            thousands(sent as f64),
            send_s,
            thousands(per_sec(sent, send_s)),
            s.confirmed.get(),
            s.nacked.get(),
            s.returned.get(),
            unconfirmed.map(|u| format!(", unconfirmed {u}")).unwrap_or_default()
        ));
        if s.behind_schedule.get() > 0 {
            h.push_str(&format!(
                "  SCHEDULE   {} messages were due but not sent when publishing stopped (broker or bench stalled)\n",
                s.behind_schedule.get()
            ));
        }
        h.push_str(&format!(
            "  consumed   {} in {:.1} s = {} msgs/s, {:.2} MB/s\n",
            thousands(received as f64),
            recv_s,
            thousands(per_sec(received, recv_s)),
            per_sec(s.received_bytes.get(), recv_s) / 1e6
        ));
        if let (Some(fill_end), Some(ds)) = (w.fill_end_ns, w.drain_start_ns) {
            let fill_s = secs(w.t0_ns, fill_end);
            let drain_s = secs(ds, last_rx);
            j.insert("fill_rate".into(), json!(per_sec(sent, fill_s).round()));
            j.insert("drain_rate".into(), json!(per_sec(received, drain_s).round()));
            j.insert("drain_s".into(), round1(Some(drain_s)));
            h.push_str(&format!(
                "  backlog    filled at {} msgs/s, drained {} in {:.1} s = {} msgs/s\n",
                thousands(per_sec(sent, fill_s)),
                thousands(received as f64),
                drain_s,
                thousands(per_sec(received, drain_s))
            ));
        }
        if tracked {
            let unknown = || "unknown".to_string();
            h.push_str(&format!(
                "  integrity  lost {}, duplicates {dup}, redelivered {}, left in queues {}, foreign {}, errors {}\n",
                lost.map(|l| l.to_string()).unwrap_or_else(unknown),
                s.redelivered.get(),
                if depths_known { left.to_string() } else { unknown() },
                s.foreign.get(),
                s.errors.get()
            ));
        } else {
            h.push_str(&format!("  integrity  not tracked (size < 16 B); left in queues {left}, errors {}\n", s.errors.get()));
        }
        if drain_cut {
            h.push_str(&format!(
                "  DRAIN      timed out after {:.0} s with {} messages not received: auto-ack deliveries the client held unread are gone from the broker, so loss is unknown (raise --drain-timeout)\n",
                cfg.drain_timeout_s, missing
            ));
        }
        if let Some(e) = &*s.first_error.borrow() {
            h.push_str(&format!("  first error {e}\n"));
        }
        h.push_str(&format!("  e2e        {}\n", with_units(&s.e2e.borrow())));
        h.push_str(&format!("  confirm    {}\n", with_units(&s.confirm.borrow())));
        if cfg.rate > 0.0 {
            h.push_str(&format!(
                "  send lag   {}  (bench lateness vs schedule; included in the above)\n",
                with_units(&s.send_lag.borrow())
            ));
        }
        let rss = env.broker_rss_max.get().max(env.broker_pid.and_then(procfs::rss_bytes).unwrap_or(0));
        if let Some(cpu0) = w.drain_cpu0 {
            // Backlog: CPU per message of the drain phase, and of the whole run below.
            let mut jj = Map::new();
            let mut hh = String::new();
            cpu_figures(CpuSpan { marks: (cpu0, w.cpu1), per: received, unit: "msg", rss_max: rss, pid: env.broker_pid }, &mut jj, &mut hh);
            for (k, v) in jj {
                if k.ends_with("per_msg") {
                    j.insert(format!("drain_{k}"), v);
                }
            }
            h.push_str(&hh.replace("  broker CPU", "  drain broker CPU").replace("  bench  CPU", "  drain bench  CPU"));
        }
        let per = if received > 0 { received } else { sent };
        cpu_figures(CpuSpan { marks: (w.cpu0, w.cpu1), per, unit: "msg", rss_max: rss, pid: env.broker_pid }, &mut j, &mut h);
        let integrity_issue = s.errors.get() > 0 || (tracked && (lost.unwrap_or(0) > 0 || dup > 0));
        Outcome { json: j, human: h, ok: received > 0, integrity_issue }
    }

    /// Figures of a churn run (`ops` operations, op latency in `stats.op`).
    pub fn from_churn(cfg: &Config, stats: &Stats, w: &Window, what: &str, rss: u64) -> Self {
        let mut j = Map::new();
        let mut h = String::new();
        j.insert("scenario".into(), json!(cfg.scenario.name()));
        j.insert("label".into(), json!(cfg.label));
        j.insert("uri".into(), json!(cfg.uri_redacted()));
        j.insert("workers".into(), json!(cfg.producers));
        j.insert("persistent".into(), json!(cfg.persistent));
        j.insert("queue_args".into(), json!(cfg.queue_args_text));
        let el = secs(w.t0_ns, w.end_ns);
        let ops = stats.ops.get();
        j.insert("duration_s".into(), round1(Some(el)));
        j.insert("ops".into(), json!(ops));
        j.insert("ops_rate".into(), json!(per_sec(ops, el).round()));
        j.insert("errors".into(), json!(stats.errors.get()));
        j.insert("first_error".into(), json!(*stats.first_error.borrow()));
        stats.op.borrow().to_json("op", &mut j);
        h.push_str(&format!("ringmq-bench {} — {}\n", cfg.scenario.name(), cfg.uri_redacted()));
        h.push_str(&format!(
            "  {what}: {} in {:.1} s = {}/s with {} worker(s), errors {}\n",
            thousands(ops as f64),
            el,
            thousands(per_sec(ops, el)),
            cfg.producers,
            stats.errors.get()
        ));
        if let Some(e) = &*stats.first_error.borrow() {
            h.push_str(&format!("  first error {e}\n"));
        }
        h.push_str(&format!("  latency    {}\n", with_units(&stats.op.borrow())));
        cpu_figures(CpuSpan { marks: (w.cpu0, w.cpu1), per: ops, unit: "op", rss_max: rss, pid: w.broker_pid }, &mut j, &mut h);
        Outcome { json: j, human: h, ok: ops > 0, integrity_issue: stats.errors.get() > 0 }
    }
}

fn with_units(l: &crate::stats::Latency) -> String {
    if l.len() == 0 {
        return "-".into();
    }
    let parts: Vec<String> =
        crate::stats::QUANTILES.iter().map(|(n, q)| format!("{n} {}", fmt_us(l.quantile_us(*q).unwrap_or(0.0)))).collect();
    format!("{}  (n={})", parts.join("  "), l.len())
}

/// Reads the JSON objects of a file of lines (other lines are skipped).
fn read_lines(p: &Path) -> std::io::Result<Vec<Map<String, Value>>> {
    let text = std::fs::read_to_string(p)?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .filter_map(|v| match v {
            Value::Object(m) => Some(m),
            _ => None,
        })
        .collect())
}

/// Median of the numbers among `vals`, `None` if none.
pub fn median(vals: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = vals.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// Prints, for each numeric figure, the median of A's rounds, of B's, and A/B.
///
/// # Errors
/// Unreadable files.
pub fn compare(a: &Path, b: &Path, label_a: &str, label_b: &str) -> std::io::Result<bool> {
    let ra = read_lines(a)?;
    let rb = read_lines(b)?;
    println!("{:<28} {:>14} {:>14} {:>9}", "figure (median)", label_a, label_b, "A/B");
    println!("{:<28} {:>14} {:>14} {:>9}", "rounds", ra.len(), rb.len(), "");
    let Some(first) = ra.first().or(rb.first()) else {
        println!("no JSON lines in either file");
        return Ok(false);
    };
    // Settings, not figures: identical on both sides by construction.
    const SKIP: [&str; 10] = [
        "broker_pid",
        "producers",
        "consumers",
        "queues",
        "size_bytes",
        "workers",
        "rate_per_producer",
        "confirm_window",
        "multi_ack_every",
        "prefetch",
    ];
    for key in first.keys() {
        if SKIP.contains(&key.as_str()) {
            continue;
        }
        let nums = |rows: &[Map<String, Value>]| -> Vec<f64> { rows.iter().filter_map(|r| r.get(key).and_then(Value::as_f64)).collect() };
        let (va, vb) = (nums(&ra), nums(&rb));
        if va.is_empty() && vb.is_empty() {
            continue;
        }
        let (ma, mb) = (median(&va), median(&vb));
        let fmt = |m: Option<f64>| m.map(|x| if x.abs() >= 100.0 { format!("{x:.0}") } else { format!("{x:.2}") }).unwrap_or("-".into());
        let ratio = match (ma, mb) {
            (Some(x), Some(y)) if y != 0.0 => format!("{:.2}", x / y),
            _ => "-".into(),
        };
        println!("{:<28} {:>14} {:>14} {:>9}", key, fmt(ma), fmt(mb), ratio);
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(1234567.0), "1,234,567");
        assert_eq!(thousands(12.0), "12");
    }
}
