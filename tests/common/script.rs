//! Helpers of the resource tests (tests/resources.rs): pika scripts run to completion or
//! driven line by line while they run, and /metrics series read from an [`OwnBroker`].

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::python::{clients_dir, python, run_bounded};
use super::*;

// ----- running the pika scripts -----

/// Run tests/clients/SCRIPT HOST PORT args…, killed after `limit`; assert it exited 0 and
/// printed a PASS line; return its output.
/// When it fails and the broker is gone, the failure names the broker's exit status instead.
pub fn run_script(script: &str, b: &mut OwnBroker, args: &[&str], limit: Duration) -> String {
    let (ok, out) = try_script(script, b, args, limit);
    if !ok {
        b.assert_running(&format!("{script} {args:?} failed:\n{out}\nand"));
    }
    assert!(ok, "{script} {args:?} failed:\n{out}");
    out
}

/// Like [`run_script`], without the assertion: (exited 0 with a PASS line, output).
pub fn try_script(script: &str, b: &OwnBroker, args: &[&str], limit: Duration) -> (bool, String) {
    let py = python();
    let path = clients_dir().join(script);
    let port = b.port().to_string();
    let host = b.host();
    let mut all = vec![path.to_str().unwrap(), host.as_str(), port.as_str()];
    all.extend_from_slice(args);
    let started = Instant::now();
    let (ok, out) = run_bounded(&py, &all, limit);
    println!("{script} {args:?} ({:.1} s):\n{out}", started.elapsed().as_secs_f64());
    (ok && out.lines().any(|l| l.starts_with("PASS ")), out)
}

/// A pika script the test talks to while it runs: its stdout and stderr lines arrive on a
/// channel (read by two threads), lines can be written to its stdin. Killed by its PID on drop.
pub struct Script {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    transcript: Vec<String>,
}

impl Script {
    pub fn spawn(script: &str, b: &OwnBroker, args: &[&str]) -> Script {
        let py = python();
        let mut child = Command::new(&py)
            .arg("-u")
            .arg(clients_dir().join(script))
            .arg(b.host())
            .arg(b.port().to_string())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {py} {script}: {e}"));
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(l) = line else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(l) = line else { break };
                if tx2.send(format!("stderr: {l}")).is_err() {
                    break;
                }
            }
        });
        Script { name: script.to_string(), stdin: child.stdin.take(), child, lines: rx, transcript: Vec::new() }
    }

    pub fn output(&self) -> String {
        self.transcript.join("\n")
    }

    pub fn take_line(&mut self, line: String) {
        println!("  {}| {line}", self.name);
        self.transcript.push(line);
    }

    /// Wait (bounded) for a line starting with `prefix`; a FAIL line, the script's end or the
    /// deadline fails the test.
    pub fn expect(&mut self, prefix: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.take_line(line.clone());
                    if line.starts_with(prefix) {
                        return line;
                    }
                    if line.starts_with("FAIL") {
                        self.drain_lines(Duration::from_secs(2));
                        panic!("{} failed while the test waited for {prefix:?}:\n{}", self.name, self.output());
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("{}: no line starting with {prefix:?} within {limit:?}; output:\n{}", self.name, self.output())
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("{}: ended before printing {prefix:?}; output:\n{}", self.name, self.output())
                }
            }
        }
    }

    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("script stdin");
        writeln!(stdin, "{line}").and_then(|_| stdin.flush()).unwrap_or_else(|e| panic!("write to {}: {e}", self.name));
    }

    /// Collect what is left of the output (until both pipes close, bounded).
    pub fn drain_lines(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.take_line(line),
                Err(_) => return,
            }
        }
    }

    /// Wait (bounded) for the script to exit; assert exit 0 and a PASS line; its output.
    pub fn finish(mut self, limit: Duration) -> String {
        self.stdin = None;
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("wait script") {
                break Some(s);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            // keep the transcript current (and printed) while waiting
            if let Ok(line) = self.lines.recv_timeout(Duration::from_millis(50)) {
                self.take_line(line);
            }
        };
        self.drain_lines(Duration::from_secs(3));
        let out = self.output();
        match status {
            None => panic!("{} did not finish within {limit:?}; output:\n{out}", self.name),
            Some(s) => assert!(s.success() && self.transcript.iter().any(|l| l.starts_with("PASS ")), "{} failed ({s}):\n{out}", self.name),
        }
        out
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ----- metrics -----

pub fn scrape(b: &OwnBroker) -> String {
    b.metrics().unwrap_or_else(|e| panic!("GET /metrics: {e}; log:\n{}", b.log()))
}

#[track_caller]
pub fn series(text: &str, name: &str) -> f64 {
    metric_value(text, name).unwrap_or_else(|| {
        panic!("no series {name} in /metrics ({} lines); its rabbitmq_* series:\n{}", text.lines().count(), resource_lines(text))
    })
}

/// The resource series of a metrics text, for the test's output.
pub fn resource_lines(text: &str) -> String {
    text.lines().filter(|l| l.starts_with("rabbitmq_")).collect::<Vec<_>>().join("\n")
}
