//! Start-up as an operator meets it (issue 39 item 10): a port another program holds is
//! refused at once, naming that program (it took 10 s and named nobody); `--listen` takes a
//! host name (`localhost:5672`, refused before).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// ringmq with `args` plus a free metrics port, no management API, a temp data dir; stderr
/// to `log`.
fn spawn(args: &[&str], data: &std::path::Path, log: &std::path::Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    Command::new(broker_binary())
        .args(args)
        .args(["--metrics-listen", &format!("127.0.0.1:{}", free_port()), "--management-listen", "off", "--cores", "2", "--data-dir"])
        .arg(data)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn ringmq")
}

/// Waits up to `limit` for `child` to exit; its status, or None (then it is killed).
fn exit_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

#[test]
fn a_port_held_by_another_program_is_refused_naming_it() {
    // Another program listening on the AMQP port: a python3 listener (the harness's own
    // process would be excluded: the broker names other processes only).
    let port = free_port();
    let mut holder = Command::new("python3")
        .args(["-c", &format!("import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True); time.sleep(60)")])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 listener");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.take().unwrap()), &mut line).unwrap();
    assert_eq!(line.trim(), "up");
    let data = tempfile::tempdir().unwrap();
    let log = data.path().with_extension("log");
    let mut b = spawn(&["--listen", &format!("127.0.0.1:{port}")], data.path(), &log);
    // Refused well before the 10 s a dead listener is waited for.
    let status = exit_within(&mut b, Duration::from_secs(8));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = holder.kill();
    let _ = holder.wait();
    let status = status.unwrap_or_else(|| panic!("still starting after 8 s with the port taken:\n{text}"));
    assert!(!status.success(), "{text}");
    let owner = format!("in use by pid {} (", holder.id());
    assert!(text.contains(&owner), "the error names the program holding the port ({owner}):\n{text}");
}

#[tokio::test]
async fn listen_takes_a_host_name() {
    let port = free_port();
    let data = tempfile::tempdir().unwrap();
    let log = data.path().with_extension("log");
    let mut b = spawn(&["--listen", &format!("localhost:{port}")], data.path(), &log);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_started(&mut b, addr, log_text).unwrap_or_else(|e| panic!("{e}"));
    let conn = t("connect", lapin::Connection::connect(&format!("amqp://guest:guest@127.0.0.1:{port}/%2f"), Default::default()))
        .await
        .unwrap_or_else(|e| panic!("a client connects through localhost's IPv4 address: {e:?}; log:\n{}", log_text()));
    t("close", conn.close(200, "".into())).await.unwrap();
    let _ = Command::new("kill").arg("-TERM").arg(b.id().to_string()).status();
    let status = exit_within(&mut b, STOP_TIMEOUT).expect("stops on SIGTERM");
    assert!(status.success());
}
