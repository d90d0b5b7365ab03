//! connection-churn and queue-churn: how fast a broker opens and closes connections, or
//! declares and deletes queues. --producers workers run in parallel for --duration.

use crate::amqp::{self, within, OP_TIMEOUT};
use crate::cli::{Config, Scenario};
use crate::clock::now_ns;
use crate::error::BenchError;
use crate::procfs;
use crate::report::{Outcome, Window};
use crate::signal::Signal;
use crate::stats::{fmt_us, Stats};
use lapin::options::QueueDeleteOptions;
use std::rc::Rc;
use std::time::Duration;

/// Runs connection-churn or queue-churn.
///
/// # Errors
/// Only when the very first connection fails (the broker is unreachable); later
/// failures are counted as errors in the figures.
pub async fn run(cfg: Config, interrupt: Rc<Signal>) -> Result<Outcome, BenchError> {
    // Probe once so an unreachable broker is an error, not a run of zero operations.
    let probe = amqp::connect(&cfg.uri, "ringmq-bench churn probe").await?;
    let pid = amqp::broker_pid(&cfg);
    let cfg = Rc::new(cfg);
    let stats = Rc::new(Stats::default());
    let stop = Rc::new(Signal::default());
    let mut w = Window::start(pid);
    let deadline = now_ns() + (cfg.duration_s * 1e9) as u64;
    let mut tasks = Vec::new();
    for wi in 0..cfg.producers.max(1) {
        let (cfg, stats, stop) = (cfg.clone(), stats.clone(), stop.clone());
        tasks.push(tokio::task::spawn_local(async move {
            match cfg.scenario {
                Scenario::ConnectionChurn => connection_worker(&cfg, &stats, &stop, deadline).await,
                _ => queue_worker(&cfg, &stats, &stop, deadline, wi).await,
            }
        }));
    }
    let mut rss_max = 0u64;
    let mut prev_ops = 0u64;
    let int_id = interrupt.register();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + Duration::from_secs(1), Duration::from_secs(1));
    let t0 = now_ns();
    while now_ns() < deadline {
        tokio::select! {
            _ = tick.tick() => {}
            _ = interrupt.fired(int_id) => break,
        }
        let [_, _, p99] = stats.roll_tick();
        if let Some(p) = pid {
            rss_max = rss_max.max(procfs::rss_bytes(p).unwrap_or(0));
        }
        if !cfg.quiet {
            let ops = stats.ops.get();
            eprintln!(
                "[{:>4.0}s] {:>7}/s  p99 {}  errors {}",
                (now_ns() - t0) as f64 / 1e9,
                ops - prev_ops,
                p99.map(fmt_us).unwrap_or("-".into()),
                stats.errors.get()
            );
            prev_ops = ops;
        }
    }
    stop.fire();
    let _ = tokio::time::timeout(Duration::from_secs(15), async {
        for t in tasks.iter_mut() {
            let _ = t.await;
        }
    })
    .await;
    w.finish();
    stats.roll_tick();
    amqp::close(&probe).await;
    let what = if cfg.scenario == Scenario::ConnectionChurn { "connections opened+closed" } else { "queues declared+deleted" };
    Ok(Outcome::from_churn(&cfg, &stats, &w, what, rss_max))
}

async fn connection_worker(cfg: &Config, stats: &Stats, stop: &Signal, deadline: u64) {
    while now_ns() < deadline && !stop.is_fired() {
        let t = now_ns();
        let res = async {
            let c = amqp::connect(&cfg.uri, "ringmq-bench churn").await.map_err(|e| e.to_string())?;
            let ch = amqp::channel(&c).await.map_err(|e| e.to_string());
            amqp::close(&c).await;
            ch.map(|_| ())
        }
        .await;
        match res {
            Ok(()) => {
                Stats::bump(&stats.ops, 1);
                stats.record_op(now_ns() - t);
            }
            Err(e) => {
                stats.error(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn queue_worker(cfg: &Config, stats: &Stats, stop: &Signal, deadline: u64, wi: u32) {
    let conn = match amqp::connect(&cfg.uri, &format!("ringmq-bench queue-churn {wi}")).await {
        Ok(c) => c,
        Err(e) => return stats.error(e),
    };
    let mut ch = None;
    let opts = amqp::queue_options(cfg);
    let mut i = 0u64;
    while now_ns() < deadline && !stop.is_fired() {
        if ch.is_none() {
            match amqp::channel(&conn).await {
                Ok(c) => ch = Some(c),
                Err(e) => {
                    stats.error(e);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
        }
        let c = ch.as_ref().expect("opened above");
        let name = format!("ringmq-bench-churn-{}-{wi}-{i}", std::process::id());
        i += 1;
        let t = now_ns();
        let res = async {
            within(OP_TIMEOUT, "queue.declare", c.queue_declare(name.as_str().into(), opts, cfg.queue_args.clone())).await?;
            within(OP_TIMEOUT, "queue.delete", c.queue_delete(name.as_str().into(), QueueDeleteOptions::default())).await
        }
        .await;
        match res {
            Ok(_) => {
                Stats::bump(&stats.ops, 1);
                stats.record_op(now_ns() - t);
            }
            Err(e) => {
                stats.error(e);
                ch = None; // a failed method closes the channel
            }
        }
    }
    amqp::close(&conn).await;
}
