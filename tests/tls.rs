//! AMQP over TLS (issue 14 item 3): the amqps listener (`--tls-listen`, `--tls-cert`,
//! `--tls-key`, `--tls-ca`, `--tls-fail-if-no-peer-cert`) and the EXTERNAL mechanism.
//!
//! A CA, a server certificate for 127.0.0.1/localhost and client certificates are made at
//! test time (rcgen) into a temp dir. Real clients: pika with Python's ssl module
//! (tests/clients/tls.py), a blocking rustls client speaking raw AMQP frames, and a plain TCP
//! socket on the TLS port. Needs python3 with pika.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::pki::{client_config, path, Pem, Pki};
use common::python::{clients_dir, python, run_bounded};
use common::raw::{frame, longstr, method, shortstr};
use common::*;
use futures_rustls::rustls;
use rustls::pki_types::ServerName;

/// The amqps broker of a test PKI.
trait AmqpsBroker {
    fn broker(&self, verify: bool, extra: &[&str]) -> (Broker, SocketAddr);
}

impl AmqpsBroker for Pki {
    /// A broker with an amqps listener on a free port (and `--tls-ca` when `verify`).
    fn broker(&self, verify: bool, extra: &[&str]) -> (Broker, SocketAddr) {
        let tls: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let (tls_s, cert, key, ca) = (tls.to_string(), path(&self.server.cert), path(&self.server.key), path(&self.ca));
        let mut args = vec!["--tls-listen", &tls_s, "--tls-cert", &cert, "--tls-key", &key];
        if verify {
            args.extend(["--tls-ca", &ca]);
        }
        args.extend_from_slice(extra);
        let b = Broker::start_with_args(&args);
        assert!(b.log().contains(&format!("AMQP over TLS on {tls}")), "ready line names the TLS listener:\n{}", b.log());
        (b, tls)
    }
}

/// tests/clients/tls.py MODE against `tls`, with the client certificate `client`.
fn pika(tls: SocketAddr, mode: &str, ca: &Path, client: Option<&Pem>) -> (bool, String) {
    let script = clients_dir().join("tls.py");
    let (port, ca) = (tls.port().to_string(), path(ca));
    let mut args = vec![path(&script), "127.0.0.1".into(), port, mode.into(), ca];
    if let Some(c) = client {
        args.extend([path(&c.cert), path(&c.key)]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out) = run_bounded(&python(), &args, Duration::from_secs(40));
    println!("tls.py {mode}:\n{out}");
    (ok && out.lines().any(|l| l.starts_with("PASS ")), out)
}

/// A blocking rustls client to `tls` trusting `ca`, presenting `client` if given.
fn tls_client(tls: SocketAddr, ca: &Path, client: Option<&Pem>) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let config = client_config(ca, client, &[]);
    let conn = rustls::ClientConnection::new(config, ServerName::try_from("localhost").expect("name")).expect("client");
    let tcp = TcpStream::connect_timeout(&tls, Duration::from_secs(5)).expect("connect");
    tcp.set_read_timeout(Some(STEP_TIMEOUT)).expect("timeout");
    rustls::StreamOwned::new(conn, tcp)
}

/// Reads one AMQP frame: (type, payload).
fn read_frame(s: &mut impl Read) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 7];
    s.read_exact(&mut head)?;
    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
    let mut payload = vec![0u8; size + 1];
    s.read_exact(&mut payload)?;
    payload.pop();
    Ok((head[0], payload))
}

/// Sends the protocol header and reads connection.start: its mechanisms.
fn start(s: &mut (impl Read + Write)) -> String {
    s.write_all(b"AMQP\x00\x00\x09\x01").expect("header");
    s.flush().expect("flush");
    let (ty, p) = read_frame(s).expect("connection.start");
    assert_eq!((ty, &p[..4]), (1, &[0, 10, 0, 10][..]), "connection.start");
    let table = u32::from_be_bytes([p[6], p[7], p[8], p[9]]) as usize;
    let at = 10 + table;
    let len = u32::from_be_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]]) as usize;
    String::from_utf8(p[at + 4..at + 4 + len].to_vec()).expect("mechanisms")
}

/// Sends connection.start-ok with `mechanism` and an empty response; the next method's
/// (class, method, reply code if connection.close).
fn start_ok(s: &mut (impl Read + Write), mechanism: &str) -> (u16, u16, Option<u16>) {
    let mut args = vec![0, 0, 0, 0];
    shortstr(&mut args, mechanism);
    longstr(&mut args, b"");
    shortstr(&mut args, "en_US");
    s.write_all(&frame(1, 0, &method(10, 11, &args))).expect("start-ok");
    s.flush().expect("flush");
    let (_, p) = read_frame(s).expect("answer to start-ok");
    let (class, meth) = (u16::from_be_bytes([p[0], p[1]]), u16::from_be_bytes([p[2], p[3]]));
    (class, meth, ((class, meth) == (10, 50)).then(|| u16::from_be_bytes([p[4], p[5]])))
}

/// Reads until EOF or an error; how long it took (panics past `limit`).
fn wait_closed(s: &mut TcpStream, limit: Duration) -> Duration {
    let t0 = Instant::now();
    s.set_read_timeout(Some(limit)).expect("timeout");
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return t0.elapsed(),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("the broker did not close the socket within {limit:?}")
            }
            Err(_) => return t0.elapsed(),
        }
        assert!(t0.elapsed() < limit, "the broker did not close the socket within {limit:?}");
    }
}

#[test]
fn pika_publishes_and_gets_over_tls_and_the_plain_listener_is_unchanged() {
    let pki = Pki::new();
    let (b, tls) = pki.broker(false, &[]);
    let (ok, out) = pika(tls, "plain", &pki.ca, None);
    assert!(ok, "pika over TLS:\n{out}\nbroker log:\n{}", b.log());
    common::python::run_client("basics.py", &b.host(), b.port(), &[]);
    // Without --tls-ca no client certificate is asked for, and EXTERNAL is not offered.
    let mut s = tls_client(tls, &pki.ca, None);
    assert_eq!(start(&mut s), "PLAIN AMQPLAIN");
}

#[test]
fn a_plaintext_client_on_the_tls_port_is_closed_promptly_and_the_broker_serves_on() {
    let pki = Pki::new();
    let (b, tls) = pki.broker(false, &[]);
    let mut s = TcpStream::connect_timeout(&tls, Duration::from_secs(5)).expect("connect");
    s.write_all(b"AMQP\x00\x00\x09\x01").expect("header");
    let took = wait_closed(&mut s, Duration::from_secs(5));
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
    b.wait_for_log("TLS handshake failed", "the failed TLS handshake");
    assert!(b.log().contains("peer=127.0.0.1:"), "the log line names the peer:\n{}", b.log());
    let (ok, out) = pika(tls, "plain", &pki.ca, None);
    assert!(ok, "TLS after the plaintext client:\n{out}");
}

#[test]
fn a_silent_connection_on_the_tls_port_is_closed_by_the_handshake_deadline() {
    let pki = Pki::new();
    let (b, tls) = pki.broker(false, &[]);
    let mut s = TcpStream::connect_timeout(&tls, Duration::from_secs(5)).expect("connect");
    let took = wait_closed(&mut s, Duration::from_secs(15));
    assert!(took >= Duration::from_secs(8), "closed after {took:?}, before the 10 s handshake deadline");
    b.wait_for_log("TLS handshake", "the stalled TLS handshake");
}

#[test]
fn external_logs_in_as_the_certificates_common_name() {
    let pki = Pki::new();
    let (b, tls) = pki.broker(true, &[]);
    let (ok, out) = pika(tls, "external", &pki.ca, Some(&pki.guest));
    assert!(ok, "pika EXTERNAL as guest:\n{out}\nbroker log:\n{}", b.log());
    // PLAIN still works over TLS without a client certificate (fail_if_no_peer_cert is off).
    let (ok, out) = pika(tls, "plain", &pki.ca, None);
    assert!(ok, "pika PLAIN without a client certificate:\n{out}");
    // A verified certificate: EXTERNAL offered and accepted (connection.tune follows).
    let mut s = tls_client(tls, &pki.ca, Some(&pki.guest));
    assert_eq!(start(&mut s), "PLAIN AMQPLAIN EXTERNAL");
    assert_eq!(start_ok(&mut s, "EXTERNAL"), (10, 30, None), "connection.tune");
    // A verified certificate for a user that does not exist: 403.
    let mut s = tls_client(tls, &pki.ca, Some(&pki.nobody));
    assert!(start(&mut s).contains("EXTERNAL"));
    assert_eq!(start_ok(&mut s, "EXTERNAL").2, Some(403), "CN=nobody is no user");
    // No certificate: EXTERNAL is not offered, and refused if asked for anyway.
    let mut s = tls_client(tls, &pki.ca, None);
    assert_eq!(start(&mut s), "PLAIN AMQPLAIN");
    assert_eq!(start_ok(&mut s, "EXTERNAL").2, Some(403), "EXTERNAL without a certificate");
    // And on the plain listener.
    let mut s = TcpStream::connect_timeout(&b.addr(), Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(STEP_TIMEOUT)).expect("timeout");
    assert_eq!(start(&mut s), "PLAIN AMQPLAIN");
    assert_eq!(start_ok(&mut s, "EXTERNAL").2, Some(403), "EXTERNAL on the plain listener");
}

#[test]
fn a_client_certificate_from_another_ca_is_refused() {
    let pki = Pki::new();
    let (b, tls) = pki.broker(true, &[]);
    let (ok, out) = pika(tls, "refused", &pki.ca, Some(&pki.rogue));
    assert!(ok, "pika with a certificate of another CA:\n{out}\nbroker log:\n{}", b.log());
    b.wait_for_log("TLS handshake failed", "the refused certificate");
    let (ok, out) = pika(tls, "external", &pki.ca, Some(&pki.guest));
    assert!(ok, "a good certificate after the bad one:\n{out}");
}

#[test]
fn fail_if_no_peer_cert_refuses_a_client_without_one() {
    let pki = Pki::new();
    let (_b, tls) = pki.broker(true, &["--tls-fail-if-no-peer-cert"]);
    let mut s = tls_client(tls, &pki.ca, None);
    // TLS 1.3: the client learns of the refusal at its first read.
    let refused = s.write_all(b"AMQP\x00\x00\x09\x01").and_then(|_| s.flush()).and_then(|_| read_frame(&mut s));
    assert!(refused.is_err(), "a client without a certificate got {refused:?}");
    let mut s = tls_client(tls, &pki.ca, Some(&pki.guest));
    assert!(start(&mut s).contains("EXTERNAL"));
}

#[test]
fn a_missing_certificate_file_stops_the_start_naming_its_path() {
    let pki = Pki::new();
    let data = tempfile::tempdir().expect("tempdir");
    let missing = pki.ca.with_file_name("missing.crt");
    let tls = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(broker_binary())
        .args(["--tls-listen", &tls, "--tls-cert", &path(&missing), "--tls-key", &path(&pki.server.key)])
        .args(["--listen", &format!("127.0.0.1:{}", free_port()), "--data-dir", &path(data.path())])
        .args(["--metrics-listen", &format!("127.0.0.1:{}", free_port()), "--management-listen", "off"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ringmq");
    let deadline = Instant::now() + STEP_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("ringmq kept running with a missing certificate file");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut err).expect("read");
    child.stdout.take().expect("stdout").read_to_string(&mut err).expect("read");
    assert!(!status.success(), "exit status {status}");
    assert!(err.contains(&path(&missing)), "the error names the file:\n{err}");
}

/// The heartbeat deadline (a read timeout on the TCP stream under the TLS one) still closes a
/// silent client: heartbeat 1 s negotiated, then nothing sent, closed after about 2 s.
#[test]
fn missed_heartbeats_close_a_tls_connection() {
    let pki = Pki::new();
    let (_b, tls) = pki.broker(false, &["--heartbeat", "1"]);
    let mut s = tls_client(tls, &pki.ca, None);
    start(&mut s);
    let mut args = vec![0, 0, 0, 0];
    shortstr(&mut args, "PLAIN");
    longstr(&mut args, b"\0guest\0guest");
    shortstr(&mut args, "en_US");
    s.write_all(&frame(1, 0, &method(10, 11, &args))).expect("start-ok");
    s.flush().expect("flush");
    let (_, tune) = read_frame(&mut s).expect("connection.tune");
    assert_eq!(&tune[..4], &[0, 10, 0, 30], "connection.tune");
    // tune-ok: channel_max 0, frame_max 0, heartbeat 1; then open "/".
    s.write_all(&frame(1, 0, &method(10, 31, &[0, 0, 0, 0, 0, 0, 0, 1]))).expect("tune-ok");
    let mut open = Vec::new();
    shortstr(&mut open, "/");
    shortstr(&mut open, "");
    open.push(0);
    s.write_all(&frame(1, 0, &method(10, 40, &open))).expect("open");
    s.flush().expect("flush");
    let (_, open_ok) = read_frame(&mut s).expect("connection.open-ok");
    assert_eq!(&open_ok[..4], &[0, 10, 0, 41], "connection.open-ok");
    let t0 = Instant::now();
    let mut heartbeats = 0;
    let end = loop {
        match read_frame(&mut s) {
            Ok((8, _)) => heartbeats += 1,
            Ok((ty, p)) => break format!("frame type {ty} {:?}", &p[..p.len().min(8)]),
            Err(e) => break e.to_string(),
        }
        assert!(t0.elapsed() < Duration::from_secs(8), "still open after {:?}", t0.elapsed());
    };
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(1500) && took < Duration::from_secs(8), "closed after {took:?} ({end})");
    assert!(heartbeats >= 1, "the broker sent no heartbeat over TLS before closing ({end})");
}
