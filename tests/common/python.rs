//! Running the Python (pika) client scripts from tests, bounded in time.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// tests/clients/ of this package.
pub fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("clients")
}

/// The Python interpreter (env PYTHON, default python3); panics with advice if pika is missing.
pub fn python() -> String {
    let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let ok = Command::new(&py)
        .args(["-c", "import pika"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "{py} with pika is needed: python3 -m pip install pika (or set PYTHON)");
    py
}

/// Run `program args…`, killing it after `limit`; returns (exit success, stdout + stderr).
pub fn run_bounded(program: &str, args: &[&str], limit: Duration) -> (bool, String) {
    let dir = std::env::temp_dir().join(format!("ringmq-py-{}-{}", std::process::id(), crate::common::uniq("out")));
    let out = std::fs::File::create(&dir).expect("output file");
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&dir).unwrap_or_default();
    let _ = std::fs::remove_file(&dir);
    match status {
        Some(s) => (s.success(), text),
        None => (false, format!("{text}\n[killed after {limit:?}]")),
    }
}

/// Run tests/clients/SCRIPT HOST PORT [extra…]; assert it printed PASS and exited 0.
pub fn run_client(script: &str, host: &str, port: u16, extra: &[&str]) {
    let py = python();
    let path = clients_dir().join(script);
    let port = port.to_string();
    let mut args = vec![path.to_str().unwrap(), host, port.as_str()];
    args.extend_from_slice(extra);
    let (ok, out) = run_bounded(&py, &args, Duration::from_secs(40));
    println!("{script} {extra:?}:\n{out}");
    assert!(ok && out.lines().any(|l| l.starts_with("PASS ")), "{script} {extra:?} failed:\n{out}");
}
