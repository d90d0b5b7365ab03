//! The shared acknowledgement scenarios (../shared/cases, pika scripts taken from bugs users
//! reported in AMQP brokers) run against a started broker; every case must pass.
//!
//! Covers issue 4 items 4, 7, 8 and 9 from the outside (double ack, nack-requeue redelivered,
//! close requeues, multiple and tag 0, dead-lettering, confirms with unroutable messages,
//! competing consumers, requeue to the original position).
//! The cases directory is env RINGMQ_CASES_DIR, or `<repo>/../shared/cases`; outside CI a
//! directory missing at build time marks the test ignored (build.rs), so `cargo test`
//! reports it skipped; one missing at run time skips it with a note; in CI (env CI set) a
//! missing directory fails it.
//! Needs python3 with pika.

mod common;

use common::python::{python, run_bounded};
use common::*;
use std::path::PathBuf;
use std::time::Duration;

#[test]
#[cfg_attr(ringmq_no_shared_cases, ignore = "no ../shared/cases at build time: set RINGMQ_CASES_DIR and rebuild")]
fn shared_ack_cases_all_pass() {
    let dir = std::env::var("RINGMQ_CASES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("shared").join("cases"));
    let run_sh = dir.join("run.sh");
    if !run_sh.exists() && std::env::var_os("CI").is_none() {
        // A clone outside the team's workspace has no shared cases; CI always has them
        // (there, a missing directory fails the test below).
        eprintln!("NOTE: skipping the shared ack cases: no {} (set RINGMQ_CASES_DIR)", run_sh.display());
        return;
    }
    assert!(run_sh.exists(), "no {} (set RINGMQ_CASES_DIR)", run_sh.display());
    let _ = python(); // fails early with advice when pika is missing
    let b = Broker::start();
    let port = b.port().to_string();
    // run.sh bounds each case to 12 s
    let (ok, out) = run_bounded("bash", &[run_sh.to_str().unwrap(), &b.host(), &port], Duration::from_secs(240));
    println!("{out}");
    let summary = out.lines().rev().find(|l| l.contains(" passed, ")).unwrap_or("");
    assert!(summary.ends_with(" 0 failed"), "cases failed: {summary:?}\n{out}");
    assert!(ok, "run.sh exited non-zero:\n{out}");
}
