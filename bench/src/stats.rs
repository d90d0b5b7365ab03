//! Counters and latency histograms of one run, shared by all tasks of the single-threaded
//! runtime (hence `Cell`/`RefCell`, no atomics), and the once-a-second progress line.

use hdrhistogram::Histogram;
use serde_json::{Map, Value};
use std::cell::{Cell, RefCell};

/// Highest latency a histogram records: 1 hour in ns (larger values saturate).
const MAX_NS: u64 = 3_600_000_000_000;

/// An HDR histogram of latencies in ns, 3 significant digits.
pub struct Latency {
    hist: Histogram<u64>,
}

impl Default for Latency {
    fn default() -> Self {
        Latency { hist: Histogram::new_with_bounds(1, MAX_NS, 3).expect("valid bounds") }
    }
}

impl Latency {
    /// Records one latency in ns (0 is recorded as 1 ns; above 1 h saturates).
    pub fn record_ns(&mut self, ns: u64) {
        self.hist.saturating_record(ns.max(1));
    }

    /// Number of samples.
    pub fn len(&self) -> u64 {
        self.hist.len()
    }

    /// Quantile `q` (0..=1) in µs, `None` when empty.
    pub fn quantile_us(&self, q: f64) -> Option<f64> {
        (!self.hist.is_empty()).then(|| self.hist.value_at_quantile(q) as f64 / 1000.0)
    }

    /// Adds every sample of `other`.
    pub fn add(&mut self, other: &Latency) {
        let _ = self.hist.add(&other.hist);
    }

    /// Forgets all samples.
    pub fn reset(&mut self) {
        self.hist.reset();
    }

    /// Writes `<prefix>_p50_us` … `<prefix>_p999_us`, `<prefix>_max_us` (µs, 1 decimal;
    /// null when empty) into `out`.
    pub fn to_json(&self, prefix: &str, out: &mut Map<String, Value>) {
        for (name, q) in QUANTILES {
            out.insert(format!("{prefix}_{name}_us"), round1(self.quantile_us(q)));
        }
    }
}

/// Reported quantiles: name and value.
pub const QUANTILES: [(&str, f64); 6] = [("p50", 0.5), ("p75", 0.75), ("p95", 0.95), ("p99", 0.99), ("p999", 0.999), ("max", 1.0)];

/// Rounds to one decimal, `None` → null.
pub fn round1(v: Option<f64>) -> Value {
    match v {
        Some(x) if x.is_finite() => Value::from((x * 10.0).round() / 10.0),
        _ => Value::Null,
    }
}

/// µs with a unit that stays readable from 1 µs to minutes.
pub fn fmt_us(us: f64) -> String {
    if us >= 1_000_000.0 {
        format!("{:.2}s", us / 1_000_000.0)
    } else if us >= 10_000.0 {
        format!("{:.1}ms", us / 1000.0)
    } else if us >= 1000.0 {
        format!("{:.2}ms", us / 1000.0)
    } else {
        format!("{us:.0}µs")
    }
}

/// Counters of one run (message counts unless said otherwise).
#[derive(Default)]
pub struct Stats {
    /// basic.publish calls handed to the client library.
    pub sent: Cell<u64>,
    /// Publisher confirms (basic.ack from the broker).
    pub confirmed: Cell<u64>,
    /// basic.nack from the broker.
    pub nacked: Cell<u64>,
    /// Fixed rate: messages due by the schedule but not sent when publishing stopped.
    pub behind_schedule: Cell<u64>,
    /// basic.return (mandatory, unroutable).
    pub returned: Cell<u64>,
    /// Deliveries received, duplicates and foreign messages included.
    pub received: Cell<u64>,
    /// Body bytes received.
    pub received_bytes: Cell<u64>,
    /// Deliveries flagged redelivered=true by the broker.
    pub redelivered: Cell<u64>,
    /// Deliveries without this run's tag (leftovers, other publishers, short bodies).
    pub foreign: Cell<u64>,
    /// Client-side errors (channel or connection closed, failed operations).
    pub errors: Cell<u64>,
    /// First error message, for the summary.
    pub first_error: RefCell<Option<String>>,
    /// CLOCK_MONOTONIC ns of the last delivery.
    pub last_receive_ns: Cell<u64>,
    /// Operations done by churn scenarios (connections or queues opened and closed).
    pub ops: Cell<u64>,
    /// End-to-end latency: intended send time in the body → delivery seen by the consumer.
    pub e2e: RefCell<Latency>,
    /// Confirm latency: intended send time → publisher confirm seen by the producer.
    pub confirm: RefCell<Latency>,
    /// Churn scenarios: duration of one operation.
    pub op: RefCell<Latency>,
    /// Fixed rate: how late the bench handed a message to the client library, relative
    /// to its intended send time. Large values mean the bench (or its CPU) is the limit.
    pub send_lag: RefCell<Latency>,
    /// Same three, reset every second for the progress line.
    pub e2e_tick: RefCell<Latency>,
    /// See `e2e_tick`.
    pub confirm_tick: RefCell<Latency>,
    /// See `e2e_tick`.
    pub op_tick: RefCell<Latency>,
}

impl Stats {
    /// Adds `n` to a counter.
    pub fn bump(c: &Cell<u64>, n: u64) {
        c.set(c.get() + n);
    }

    /// Counts an error and keeps the first message.
    pub fn error(&self, what: impl std::fmt::Display) {
        Self::bump(&self.errors, 1);
        let mut first = self.first_error.borrow_mut();
        if first.is_none() {
            *first = Some(what.to_string());
        }
    }

    /// Records an end-to-end latency (ns).
    pub fn record_e2e(&self, ns: u64) {
        self.e2e_tick.borrow_mut().record_ns(ns);
    }

    /// Records a confirm latency (ns).
    pub fn record_confirm(&self, ns: u64) {
        self.confirm_tick.borrow_mut().record_ns(ns);
    }

    /// Records an operation latency (ns).
    pub fn record_op(&self, ns: u64) {
        self.op_tick.borrow_mut().record_ns(ns);
    }

    /// Folds the per-second histograms into the totals and resets them. Returns the
    /// tick's p99 (µs) of e2e, confirm and op latency.
    pub fn roll_tick(&self) -> [Option<f64>; 3] {
        let mut out = [None; 3];
        for (i, (tick, total)) in
            [(&self.e2e_tick, &self.e2e), (&self.confirm_tick, &self.confirm), (&self.op_tick, &self.op)].into_iter().enumerate()
        {
            let mut t = tick.borrow_mut();
            out[i] = t.quantile_us(0.99);
            total.borrow_mut().add(&t);
            t.reset();
        }
        out
    }
}

/// Counter values at one instant, to print per-second rates.
#[derive(Clone, Copy, Default)]
pub struct Snapshot {
    /// See [`Stats`].
    pub sent: u64,
    /// See [`Stats`].
    pub confirmed: u64,
    /// See [`Stats`].
    pub nacked: u64,
    /// See [`Stats`].
    pub returned: u64,
    /// See [`Stats`].
    pub received: u64,
    /// See [`Stats`].
    pub received_bytes: u64,
    /// See [`Stats`].
    pub errors: u64,
}

impl Snapshot {
    /// Reads the counters now.
    pub fn of(s: &Stats) -> Self {
        Snapshot {
            sent: s.sent.get(),
            confirmed: s.confirmed.get(),
            nacked: s.nacked.get(),
            returned: s.returned.get(),
            received: s.received.get(),
            received_bytes: s.received_bytes.get(),
            errors: s.errors.get(),
        }
    }
}
