//! What an operator meets first (issue 13, item 8), through the real binary and lapin:
//! SIGHUP does not stop the broker; a taken metrics port is reported off in the ready line
//! rather than advertised; data-directory errors name the path; a consumer timeout of 0 is
//! off (flag and queue argument); `--max-message-size` closes the channel of a larger
//! publish with 406; `--cores` above the CPU count warns.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

/// The broker binary with `args`, its stderr in a temp file; killed by its PID on drop.
struct Raw {
    child: Child,
    log: std::path::PathBuf,
    _data: tempfile::TempDir,
}

impl Raw {
    /// Starts ringmq on a free AMQP port and a fresh data dir with `args` (which must not
    /// name `--listen` or `--data-dir`); returns it and its AMQP port, once its log has the
    /// ready line (bounded: 20 s).
    fn start(args: &[&str]) -> (Raw, u16) {
        let data = tempfile::Builder::new().prefix("ringmq-operator-").tempdir().expect("temp dir");
        let log = data.path().with_extension("stderr.log");
        let port = free_port();
        let err = std::fs::File::create(&log).expect("log file");
        let child = Command::new(broker_binary())
            .args(["--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
            .arg(data.path().join("d"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .expect("spawn ringmq");
        let mut raw = Raw { child, log, _data: data };
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let path = raw.log.clone();
        wait_started(&mut raw.child, addr, || std::fs::read_to_string(&path).unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
        (raw, port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn uri(port: u16) -> String {
        format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

fn metrics_flag() -> String {
    format!("127.0.0.1:{}", free_port())
}

#[tokio::test]
async fn sighup_is_logged_and_the_broker_keeps_serving() {
    let m = metrics_flag();
    let (mut b, port) = Raw::start(&["--metrics-listen", &m]);
    // SAFETY: kill(2) on the PID of the child this test started.
    assert_eq!(unsafe { libc::kill(b.child.id() as i32, libc::SIGHUP) }, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !b.log().contains("SIGHUP ignored") {
        assert!(Instant::now() < deadline, "no SIGHUP line; log:\n{}", b.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(b.child.try_wait().unwrap().is_none(), "SIGHUP stopped ringmq; log:\n{}", b.log());
    let c = connect_uri(&Raw::uri(port)).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    let q = plain_queue(&ch, "after-hup").await;
    publish(&ch, "", &q, b"still here").await;
    assert_eq!(get_body(&ch, &q).await.as_deref(), Some(&b"still here"[..]));
}

#[tokio::test]
async fn a_taken_metrics_port_is_reported_off_not_advertised() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().unwrap().to_string();
    let (b, port) = Raw::start(&["--metrics-listen", &addr]);
    let log = b.log();
    let ready = log.lines().find(|l| l.contains("ringmq ready:")).expect("ready line").to_string();
    assert!(ready.contains("metrics off") && ready.contains(&addr), "{ready}");
    assert!(!ready.contains(&format!("http://{addr}")), "the ready line advertises another process's port: {ready}");
    // The broker itself runs.
    let c = connect_uri(&Raw::uri(port)).await;
    assert!(c.status().connected());
}

#[test]
fn data_dir_errors_name_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let data = file.join("data");
    let out = Command::new(broker_binary())
        .args(["--listen", &format!("127.0.0.1:{}", free_port()), "--metrics-listen", &metrics_flag(), "--data-dir"])
        .arg(&data)
        .stdin(Stdio::null())
        .output()
        .expect("run ringmq");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started on a data dir under a file: {err}");
    assert!(err.contains(&data.display().to_string()), "the error does not name {}: {err}", data.display());
}

/// A consumer holding a delivery of `queue` on a fresh channel of `c`, with a watch on how
/// that channel closes.
async fn hold_one(c: &lapin::Connection, queue: &str) -> (lapin::Channel, CloseWatch, lapin::message::Delivery) {
    let ch = t("channel", c.create_channel()).await.unwrap();
    let w = close_watch(&ch).await;
    let mut cons =
        t("consume", ch.basic_consume(queue.into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())).await.unwrap();
    let d = next_delivery(&mut cons, Duration::from_secs(10)).await;
    (ch, w, d)
}

#[tokio::test]
async fn a_consumer_timeout_of_zero_is_off_for_the_flag_and_the_queue_argument() {
    // A broker default of 500 ms: a queue declared with x-consumer-timeout 0 never times out,
    // while one without the argument does (so the wait below is long enough to tell).
    let m = metrics_flag();
    let (_b, port) = Raw::start(&["--metrics-listen", &m, "--consumer-timeout-ms", "500"]);
    let c = connect_uri(&Raw::uri(port)).await;
    let admin = t("channel", c.create_channel()).await.unwrap();
    let mut off = FieldTable::default();
    off.insert("x-consumer-timeout".into(), AMQPValue::LongLongInt(0));
    let q_off = declare_queue(&admin, &uniq("timeout-off"), QueueDeclareOptions::default(), off).await;
    let q_on = declare_queue(&admin, &uniq("timeout-default"), QueueDeclareOptions::default(), FieldTable::default()).await;
    publish(&admin, "", &q_off, b"kept").await;
    publish(&admin, "", &q_on, b"timed").await;
    let (ch_off, _, d_off) = hold_one(&c, &q_off).await;
    let (_ch_on, w_on, _d_on) = hold_one(&c, &q_on).await;
    let code = tt("timeout", Duration::from_secs(15), w_on.code("delivery held past the 500 ms default")).await;
    assert_eq!(code, 406, "the default timeout applies to the queue without the argument");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    t("ack after the wait", ch_off.basic_ack(d_off.delivery_tag, BasicAckOptions::default())).await.unwrap();
    assert!(ch_off.status().connected(), "x-consumer-timeout 0 timed out");

    // The flag: --consumer-timeout-ms 0 turns the default off.
    let m = metrics_flag();
    let (_b0, port0) = Raw::start(&["--metrics-listen", &m, "--consumer-timeout-ms", "0"]);
    let c0 = connect_uri(&Raw::uri(port0)).await;
    let admin0 = t("channel", c0.create_channel()).await.unwrap();
    let q = plain_queue(&admin0, "timeout-flag-off").await;
    publish(&admin0, "", &q, b"kept").await;
    let (ch, _, d) = hold_one(&c0, &q).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    t("ack after the wait", ch.basic_ack(d.delivery_tag, BasicAckOptions::default())).await.unwrap();
    assert!(ch.status().connected(), "--consumer-timeout-ms 0 timed out");
    assert!(c0.status().connected());
}

#[tokio::test]
async fn max_message_size_closes_the_channel_of_a_larger_publish_with_406() {
    let m = metrics_flag();
    let (_b, port) = Raw::start(&["--metrics-listen", &m, "--max-message-size", "1000"]);
    let c = connect_uri(&Raw::uri(port)).await;
    let ch = t("channel", c.create_channel()).await.unwrap();
    let q = plain_queue(&ch, "max-size").await;
    publish(&ch, "", &q, &[7u8; 1000]).await;
    assert_eq!(get_body(&ch, &q).await.map(|b| b.len()), Some(1000), "a body of exactly the limit is taken");
    let w = close_watch(&ch).await;
    let _ = ch.basic_publish("".into(), q.as_str().into(), BasicPublishOptions::default(), &[7u8; 1001], BasicProperties::default()).await;
    let code = tt("close", Duration::from_secs(10), w.code("a 1001-byte publish")).await;
    assert_eq!(code, 406);
    assert!(c.status().connected(), "only the channel closes");
    let ch2 = t("channel", c.create_channel()).await.unwrap();
    assert_eq!(ready_count(&ch2, &q).await, 0, "the larger message was not stored");
}

#[test]
fn a_max_message_size_above_512_mib_is_refused_at_start() {
    let out = Command::new(broker_binary()).args(["--max-message-size", "536870913"]).stdin(Stdio::null()).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("max_message_size"), "{err}");
}

#[tokio::test]
async fn more_cores_than_cpus_warns() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let m = metrics_flag();
    let cores = (cpus + 1).to_string();
    let (b, _port) = Raw::start(&["--metrics-listen", &m, "--cores", &cores]);
    assert!(b.log().contains("--cores is above the CPUs"), "{}", b.log());
}
