//! The clients README.md names beside pika and lapin — the Java client, php-amqplib, Bunny
//! (Ruby) and rabbitmq-c (the library and its command-line tools) — each run a smoke test
//! through its own API against a started broker (issue 39 item 9).
//!
//! Each program under tests/clients/ (`java/Smoke.java`, `smoke.php`, `smoke.rb`, `smoke.c`)
//! declares a queue, publishes with publisher confirms and waits for the ack, consumes with
//! manual ack, nacks with requeue and sees the message again with redelivered set, acks it,
//! meets a channel error (passive declare of a missing queue: 404 NOT_FOUND as the client's
//! own exception) and carries on with a new channel, then closes cleanly; it prints its steps
//! and `PASS <client>`. `amqp-tools.sh` does what the tools can (declare, publish, consume
//! with ack, get, a consume from a missing queue refused with 404, delete).
//!
//! The clients come from Debian packages (`.ci/run` installs them): `librabbitmq-client-java`
//! with a JDK (`default-jdk-headless`), `php-cli` and `php-amqplib`, `ruby-bunny`,
//! `librabbitmq-dev` with a C compiler, `amqp-tools`. A client whose toolchain is missing is
//! skipped with a note outside CI and fails the test in CI (env `CI` set), as tests/cases.rs
//! does for the shared cases.
//! Runs against RabbitMQ too (`RINGMQ_TEST_BROKER=host:port cargo test --test clients_other`).

mod common;

use common::python::{clients_dir, run_bounded};
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one client program may run (each of its waits is bounded to 10 s).
const CLIENT_LIMIT: Duration = Duration::from_secs(60);

/// Whether `program args…` runs and exits 0 (output discarded).
fn runs(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Whether the client's toolchain is here: `missing` lists what is absent, `packages` the
/// Debian packages that bring it. Absent outside CI: prints "skipped: …" and returns false;
/// absent in CI (env `CI` set): panics.
fn toolchain_present(client: &str, missing: &[&str], packages: &str) -> bool {
    if missing.is_empty() {
        return true;
    }
    let note = format!("the {client} smoke test needs {} (apt-get install -y {packages})", missing.join(", "));
    skip_unless_ci(&note);
    false
}

/// A fresh scratch directory for a client's build output; removed by the caller.
fn scratch(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ringmq-{}-{}", std::process::id(), uniq(what)));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Run a build step (bounded); panic with its output when it fails.
fn build(what: &str, program: &str, args: &[&str]) {
    let (ok, out) = run_bounded(program, args, Duration::from_secs(120));
    assert!(ok, "{what} failed:\n{out}");
}

/// Run a client program `program args… HOST PORT` against `b`; assert it exited 0 and printed
/// `PASS <client>`.
fn run_smoke(client: &str, b: &Broker, program: &str, args: &[&str]) {
    let port = b.port().to_string();
    let host = b.host();
    let mut all = args.to_vec();
    all.extend_from_slice(&[host.as_str(), port.as_str()]);
    let started = Instant::now();
    let (ok, out) = run_bounded(program, &all, CLIENT_LIMIT);
    println!("{client} smoke test ({:.1} s):\n{out}", started.elapsed().as_secs_f64());
    let pass = format!("PASS {client}");
    assert!(ok && out.lines().any(|l| l.trim() == pass), "the {client} smoke test failed:\n{out}");
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// The RabbitMQ Java client (5.x) compiled with javac and run on its jar and slf4j's.
#[test]
fn java_client_smoke() {
    let jars = ["/usr/share/java/amqp-client.jar", "/usr/share/java/slf4j-api.jar", "/usr/share/java/slf4j-nop.jar"];
    let mut missing: Vec<&str> = jars.iter().copied().filter(|j| !Path::new(j).exists()).collect();
    if !runs("javac", &["-version"]) {
        missing.push("javac");
    }
    if !toolchain_present("java", &missing, "librabbitmq-client-java default-jdk-headless") {
        return;
    }
    let b = Broker::start();
    let out = scratch("java-smoke");
    let classpath = jars.join(":");
    let source = clients_dir().join("java").join("Smoke.java");
    build("javac Smoke.java", "javac", &["-cp", &classpath, "-d", path_str(&out), path_str(&source)]);
    let run_classpath = format!("{}:{classpath}", path_str(&out));
    run_smoke("java", &b, "java", &["-cp", &run_classpath, "Smoke"]);
    let _ = std::fs::remove_dir_all(&out);
}

/// php-amqplib (3.x) from Debian's autoloader.
#[test]
fn php_amqplib_smoke() {
    let autoload = "/usr/share/php/PhpAmqpLib/autoload.php";
    let mut missing = Vec::new();
    if !runs("php", &["-v"]) {
        missing.push("php");
    }
    if !Path::new(autoload).exists() {
        missing.push(autoload);
    }
    if !toolchain_present("php", &missing, "php-cli php-amqplib") {
        return;
    }
    let b = Broker::start();
    run_smoke("php", &b, "php", &[path_str(&clients_dir().join("smoke.php"))]);
}

/// Bunny (2.x), the Ruby client.
#[test]
fn ruby_bunny_smoke() {
    if !toolchain_present("ruby", if runs("ruby", &["-e", "require 'bunny'"]) { &[] } else { &["ruby with bunny"] }, "ruby-bunny") {
        return;
    }
    let b = Broker::start();
    run_smoke("ruby", &b, "ruby", &[path_str(&clients_dir().join("smoke.rb"))]);
}

/// rabbitmq-c (librabbitmq) through a C program compiled against it.
#[test]
fn rabbitmq_c_smoke() {
    let mut missing = Vec::new();
    if !runs("cc", &["--version"]) {
        missing.push("cc");
    }
    if !Path::new("/usr/include/amqp.h").exists() {
        missing.push("/usr/include/amqp.h");
    }
    if !toolchain_present("c", &missing, "librabbitmq-dev build-essential") {
        return;
    }
    let b = Broker::start();
    let out = scratch("c-smoke");
    let exe = out.join("smoke");
    let source = clients_dir().join("smoke.c");
    build("cc smoke.c -lrabbitmq", "cc", &["-Wall", "-Werror", "-o", path_str(&exe), path_str(&source), "-lrabbitmq"]);
    run_smoke("c", &b, path_str(&exe), &[]);
    let _ = std::fs::remove_dir_all(&out);
}

/// rabbitmq-c's command-line tools (amqp-declare-queue, amqp-publish, amqp-consume, amqp-get,
/// amqp-delete-queue).
#[test]
fn amqp_tools_smoke() {
    let tools = ["amqp-declare-queue", "amqp-publish", "amqp-consume", "amqp-get", "amqp-delete-queue"];
    let missing: Vec<&str> = tools.iter().copied().filter(|t| !runs(t, &["--help"])).collect();
    if !toolchain_present("amqp-tools", &missing, "amqp-tools") {
        return;
    }
    let b = Broker::start();
    run_smoke("amqp-tools", &b, "bash", &[path_str(&clients_dir().join("amqp-tools.sh"))]);
}
