//! The broker outlives its log sink (issue 39 item 2): `ringmq … 2>&1 | head -3`, a `tee` or
//! a log driver that restarts once killed the broker at its next log line (the log writer's
//! report of the failed write panicked on EPIPE). Here the broker's stderr is a pipe whose
//! reader goes away after the ready line; then every refused login logs a line the broker can
//! no longer write, and each client must still get its 403, a good client must still be
//! served, and the lost lines are counted in the metrics.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::raw::{capabilities, longstr, shortstr, RawConn};
use common::*;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;

/// A login with a wrong password by a client that announces authentication_failure_close:
/// the connection.close reply code the broker answers with (None: the socket just closed).
fn refused_login_code(addr: SocketAddr) -> Option<u16> {
    let mut c = RawConn::tcp(addr);
    c.write(b"AMQP\x00\x00\x09\x01");
    let start = c.read_method();
    assert_eq!(start.method_id(), Some((10, 10)), "expected connection.start");
    let props = capabilities(&["authentication_failure_close"]);
    let mut a = Vec::new();
    a.extend_from_slice(&(props.len() as u32).to_be_bytes());
    a.extend_from_slice(&props);
    shortstr(&mut a, "PLAIN");
    longstr(&mut a, b"\0guest\0not-the-password");
    shortstr(&mut a, "en_US");
    c.send_method(0, 10, 11, &a);
    c.expect_close().code()
}

#[tokio::test]
async fn a_broker_whose_log_reader_is_gone_keeps_serving() {
    let port = free_port();
    let metrics = free_port();
    let data = tempfile::tempdir().unwrap();
    let mut child = Command::new(broker_binary())
        .args(["--listen", &format!("127.0.0.1:{port}"), "--metrics-listen", &format!("127.0.0.1:{metrics}")])
        .args(["--management-listen", "off", "--cores", "2", "--data-dir"])
        .arg(data.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ringmq");
    let pid = child.id();
    // Read the log until the ready line, then close the pipe's only reader.
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    let ready = lines.by_ref().map_while(Result::ok).any(|l| l.contains("ringmq ready:"));
    assert!(ready && Instant::now() < deadline, "no ready line");
    drop(lines);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    for i in 0..20 {
        assert_eq!(refused_login_code(addr), Some(403), "refused login {i}: 403 ACCESS_REFUSED, not a dropped connection");
        assert!(child.try_wait().unwrap().is_none(), "the broker died after refused login {i}");
    }
    // A client with the right password is served as before.
    let conn = t("connect", lapin::Connection::connect(&format!("amqp://guest:guest@127.0.0.1:{port}/%2f"), Default::default()))
        .await
        .expect("connect");
    let ch = t("channel", conn.create_channel()).await.unwrap();
    t("declare", ch.queue_declare("after-the-pipe".into(), QueueDeclareOptions::default(), FieldTable::default())).await.unwrap();
    t("confirm", ch.confirm_select(ConfirmSelectOptions::default())).await.unwrap();
    let confirm = t(
        "publish",
        ch.basic_publish("".into(), "after-the-pipe".into(), BasicPublishOptions::default(), b"still here", BasicProperties::default()),
    )
    .await
    .unwrap();
    assert!(t("confirm", confirm).await.unwrap().is_ack());
    let got = t("get", ch.basic_get("after-the-pipe".into(), BasicGetOptions { no_ack: true })).await.unwrap();
    assert_eq!(got.map(|m| m.delivery.data), Some(b"still here".to_vec()));
    t("close", conn.close(200, "".into())).await.unwrap();
    // The lines it could not write are counted.
    let text = common::http::http_get(metrics, "/metrics").expect("metrics");
    let dropped = text
        .lines()
        .find_map(|l| l.strip_prefix("ringmq_log_lines_dropped_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no ringmq_log_lines_dropped_total in\n{text}"));
    assert!(dropped >= 20.0, "each refused login's log line counted as dropped: {dropped}");
    // And it still stops cleanly.
    let _ = Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
    let deadline = Instant::now() + STOP_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("no exit on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status after SIGTERM with the log pipe closed: {status}");
}
