//! The nemesis, short form: `bench/nemesis/nemesis.py` against the debug binary for about
//! 100 s of load with a fixed seed — every fault kind at least once (isolate, isolate the
//! leader, bridge, one-way cut, flapping link, kill -9, SIGSTOP of the leader, delays; the
//! partitions in blackhole, stall and reset modes) under pika publishers and consumers on
//! every node. It passes when the checker does: no confirmed message lost, no confirm from a
//! node cut from the majority, every publish answered within the README's 30 s, no node
//! exiting on its own. Speed (time to an ack after each fault) is printed, never asserted.
//!
//! Needs Python with pika (env PYTHON, as the other client tests). The whole run is bounded:
//! SIGTERM after 6 minutes (the nemesis then stops its nodes), SIGKILL 30 s later.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::python::python;
use common::{broker_binary, uniq};

const SEED: &str = "7";
const LIMIT: Duration = Duration::from_secs(360);
const KINDS: [&str; 8] = ["isolate", "isolate-leader", "bridge", "one-way", "flap", "kill", "pause-leader", "delay"];

/// Runs `program args…` with stdout to `stdout` and stderr inherited (progress shows live
/// under --nocapture); SIGTERM after `limit`, SIGKILL 30 s later. Returns whether it exited 0.
fn run_bounded_term(program: &str, args: &[&str], stdout: &Path, limit: Duration) -> bool {
    let out = std::fs::File::create(stdout).expect("stdout file");
    let mut child =
        Command::new(program).args(args).stdin(Stdio::null()).stdout(out).spawn().unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    let start = Instant::now();
    let mut termed = false;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status.success();
        }
        if !termed && start.elapsed() > limit {
            eprintln!("nemesis still running after {limit:?}: SIGTERM");
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
            termed = true;
        }
        if start.elapsed() > limit + Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn nemesis_short_form_loses_no_confirmed_message() {
    let py = python();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/nemesis/nemesis.py");
    let out_dir = std::env::temp_dir().join(uniq("ringmq-nemesis-ci"));
    let stdout = out_dir.with_extension("json");
    let binary = broker_binary();
    let args = [
        script.to_str().unwrap(),
        "--seed",
        SEED,
        "--duration",
        "100",
        "--warmup",
        "6",
        "--gap",
        "3:5",
        "--hold",
        "3:5",
        "--rate",
        "30",
        "--ringmq",
        binary.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
    ];
    let ok = run_bounded_term(&py, &args, &stdout, LIMIT);
    let summary = std::fs::read_to_string(&stdout).unwrap_or_default();
    println!("nemesis summary (history, plan and report.html in {}):\n{summary}", out_dir.display());
    assert!(ok, "the nemesis failed (its stderr above says why); {}", out_dir.display());
    let parsed: serde_json::Value = serde_json::from_str(summary.trim()).expect("one JSON summary line");
    for kind in KINDS {
        assert!(parsed["kinds"][kind].as_u64().unwrap_or(0) >= 1, "no {kind} fault in the short form: {summary}");
    }
    for zero in ["lost", "minority_confirms", "double_confirms", "unanswered"] {
        assert_eq!(parsed[zero].as_u64(), Some(0), "{zero}: {summary}");
    }
    let _ = std::fs::remove_dir_all(&out_dir);
    let _ = std::fs::remove_file(&stdout);
}
