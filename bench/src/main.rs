//! ringmq-bench: a load generator for any AMQP 0-9-1 broker (ringmq, RabbitMQ, LavinMQ…).
//!
//! # Layout
//! - `cli`      flags, scenarios and their defaults
//! - `run`      publish/consume engine (throughput, latency, fanout, many-queues, backlog)
//! - `churn`    connection-churn and queue-churn
//! - `amqp`     connect and topology helpers over lapin
//! - `raw`      the raw engine: the bench's own AMQP client for producers and consumers
//! - `wire`     AMQP framing shared by `raw` and `floor`
//! - `floor`    the relay behind `floor`: publish in, deliver out, no broker logic
//! - `body`     message body layout: run, producer, sequence number, send time
//! - `clock`    CLOCK_MONOTONIC ns and the timerfd pacer of fixed-rate mode
//! - `stats`    counters and HDR histograms; `tracker` sequence tracking
//! - `procfs`   CPU time and RSS of the broker and of the bench, broker PID by port
//! - `report`   summary, JSON line, and `report` (medians of two JSON files)
//!
//! # Invariants
//! - Every run ends by itself: each wait is bounded, and a watchdog thread exits the
//!   process at setup + duration + drain + teardown time even if the runtime is stuck.
//! - Latency is measured from the intended send time (fixed rate) or the actual send
//!   time (unlimited rate), never from when a stalled producer got around to sending.
//!
//! Exit status: 0 ran and received messages (churn: did operations); 1 usage, connect or
//! setup error; 2 ran but received nothing; 3 watchdog; 4 with --strict, messages lost or
//! duplicated or client errors.

mod amqp;
mod body;
mod churn;
mod cli;
mod clock;
mod error;
mod floor;
mod procfs;
mod raw;
mod report;
mod run;
mod signal;
mod stats;
mod tracker;
mod wire;

use clap::Parser;
use cli::{Cli, Command, Config, Flags, Scenario};
use std::rc::Rc;
use std::time::Duration;

/// Seconds allowed for connecting, declaring and tearing down, beyond duration + drain.
const SETUP_AND_TEARDOWN_S: f64 = 90.0;

fn main() {
    // Usage errors exit 1 as documented (clap's own default would be 2, the code for "ran but
    // received nothing"); --help and --version exit 0.
    let cli = Cli::try_parse().unwrap_or_else(|e| {
        let _ = e.print();
        std::process::exit(if e.use_stderr() { 1 } else { 0 })
    });
    let (scenario, flags): (Scenario, Flags) = match cli.command {
        Command::Report(r) => match report::compare(&r.a, &r.b, &r.label_a, &r.label_b) {
            Ok(true) => std::process::exit(0),
            Ok(false) => std::process::exit(2),
            Err(e) => {
                eprintln!("report: {e}");
                std::process::exit(1)
            }
        },
        Command::Run(f) => (Scenario::Run, f),
        Command::Throughput(f) => (Scenario::Throughput, f),
        Command::Latency(f) => (Scenario::Latency, f),
        Command::Floor(f) => (Scenario::Floor, f),
        Command::Fanout(f) => (Scenario::Fanout, f),
        Command::ManyQueues(f) => (Scenario::ManyQueues, f),
        Command::Backlog(f) => (Scenario::Backlog, f),
        Command::ConnectionChurn(f) => (Scenario::ConnectionChurn, f),
        Command::QueueChurn(f) => (Scenario::QueueChurn, f),
        Command::TtlDlx(f) => (Scenario::TtlDlx, f),
    };
    let mut cfg = match Config::resolve(scenario, flags) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1)
        }
    };
    if scenario == Scenario::Floor {
        match floor::start() {
            Ok(addr) => cfg.uri = format!("amqp://guest:guest@{addr}/%2f"),
            Err(e) => {
                eprintln!("floor: cannot start the relay: {e}");
                std::process::exit(1)
            }
        }
    }
    prepare_process();
    start_watchdog(cfg.duration_s + cfg.drain_timeout_s * 2.0 + SETUP_AND_TEARDOWN_S);

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let local = tokio::task::LocalSet::new();
    let json = cfg.json;
    let strict = cfg.strict;
    let result = local.block_on(&rt, async move {
        let interrupt = Rc::new(signal::Signal::default());
        let i2 = interrupt.clone();
        tokio::task::spawn_local(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("interrupted: stopping producers, draining");
                i2.fire();
            }
        });
        match scenario {
            Scenario::ConnectionChurn | Scenario::QueueChurn => churn::run(cfg, interrupt).await,
            _ => run::run(cfg, interrupt).await,
        }
    });
    let code = match result {
        Ok(out) => {
            if json {
                eprint!("{}", out.human);
                println!("{}", serde_json::Value::Object(out.json));
            } else {
                print!("{}", out.human);
            }
            if !out.ok {
                eprintln!("nothing received: exit 2");
                2
            } else if strict && out.integrity_issue {
                eprintln!("--strict: lost/duplicated messages or client errors: exit 4");
                4
            } else {
                0
            }
        }
        Err(e) => {
            eprintln!("ringmq-bench: {e}");
            if json {
                println!("{}", serde_json::json!({ "error": e.to_string() }));
            }
            1
        }
    };
    // Do not wait for lapin's I/O threads: the run is over and its figures printed.
    std::process::exit(code);
}

/// Precise timers (1 ns slack instead of 50 µs) and as many fds as allowed (one socket
/// per connection, one timerfd per fixed-rate producer).
fn prepare_process() {
    // SAFETY: prctl and get/setrlimit with valid arguments have no memory effects.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Exits the process with status 3 after `secs` whatever the runtime is doing.
fn start_watchdog(secs: f64) {
    std::thread::Builder::new()
        .name("ringmq-bench-watchdog".into())
        .spawn(move || {
            std::thread::sleep(Duration::from_secs_f64(secs));
            eprintln!("ringmq-bench: watchdog: run exceeded {secs:.0} s, exiting");
            println!("{}", serde_json::json!({ "error": "watchdog" }));
            std::process::exit(3);
        })
        .expect("spawn watchdog");
}
