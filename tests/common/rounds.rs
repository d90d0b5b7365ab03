//! Helpers for the kill -9 rounds (`tests/crash_rounds.rs`) and the torn-tail tests
//! (`tests/torn_tails.rs`): a seeded generator whose seed is printed for a replay, a check by
//! PID that the broker process still runs, and the round trip that says a broker serves.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lapin::options::{BasicGetOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// xorshift64*: a tiny seeded generator (no dependency); the same seed gives the same numbers.
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (0 is replaced by 1: xorshift never leaves 0).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `lo..hi` (`hi > lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.range(0, 100) < percent
    }
}

/// The seed in the environment variable `var` (a decimal u64), or one from the clock.
pub fn seed_from_env(var: &str) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 | 1)
}

/// A count from the environment variable `var`, or `default` when unset or not a number.
pub fn count_from_env(var: &str, default: u32) -> u32 {
    std::env::var(var).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(default)
}

/// True while process `pid` runs: `/proc/<pid>/stat` exists and its state is not Z (exited,
/// not yet reaped) or X. The harness reaps only at a kill, so a broker that exited by
/// itself shows as a zombie here.
pub fn process_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // The state follows the command name in parentheses, which may itself hold spaces.
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
    !matches!(state, None | Some("Z") | Some("X"))
}

/// Bound on each step of [`serves`].
const SERVE_STEP: Duration = Duration::from_secs(5);

/// One bounded step of [`serves`]: its value, or what went wrong.
async fn step<T, E: std::fmt::Display>(what: &str, f: impl std::future::Future<Output = Result<T, E>>) -> Result<T, String> {
    match tokio::time::timeout(SERVE_STEP, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer in {SERVE_STEP:?}")),
    }
}

/// The broker at `uri` serves: on a new connection, declare a queue, publish a persistent
/// message with a confirm, get it back with basic.get, delete the queue. Each step is
/// bounded ([`SERVE_STEP`]); returns the time it took, or which step failed.
pub async fn serves(uri: &str) -> Result<Duration, String> {
    let started = Instant::now();
    let conn = step("connect", Connection::connect(uri, ConnectionProperties::default())).await?;
    let ch = step("channel.open", conn.create_channel()).await?;
    let q = super::uniq("serves");
    step("queue.declare", ch.queue_declare(q.as_str().into(), QueueDeclareOptions::default(), Default::default())).await?;
    step("confirm.select", ch.confirm_select(ConfirmSelectOptions::default())).await?;
    let props = BasicProperties::default().with_delivery_mode(2);
    let confirm = step("basic.publish", ch.basic_publish("".into(), q.as_str().into(), Default::default(), b"alive?", props)).await?;
    let confirm = step("publisher confirm", confirm).await?;
    if !confirm.is_ack() {
        return Err(format!("publish not confirmed: {confirm:?}"));
    }
    match step("basic.get", ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })).await? {
        Some(m) if m.delivery.data == b"alive?" => {}
        other => return Err(format!("basic.get returned {:?}", other.map(|m| m.delivery.data))),
    }
    step("queue.delete", ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await?;
    let _ = step("connection.close", conn.close(200, "ok".into())).await;
    Ok(started.elapsed())
}

/// The last `n` lines of a broker log (for a failure message).
pub fn log_tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Lines of a broker log that say it panicked or died of a fatal error.
pub fn panic_lines(log: &str) -> Vec<String> {
    log.lines().filter(|l| l.contains("panicked at") || l.contains("ringmq: fatal")).map(str::to_owned).collect()
}
