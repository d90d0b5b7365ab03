//! The management API over HTTPS (issue 14 item 3): `--management-tls-listen` (RabbitMQ's
//! `management.ssl.port`) with its own `--management-tls-cert/-key/-ca` or the amqps
//! listener's `--tls-cert/--tls-key/--tls-ca`, and `--management-tls-fail-if-no-peer-cert`.
//!
//! Certificates are made at test time (tests/common/pki.rs). Clients: a blocking rustls
//! client writing HTTP/1.1 by hand (it trusts the test CA only and checks the name
//! `localhost`), plain TCP sockets on the HTTPS port (plain HTTP, silence, half a
//! handshake), and, when installed, curl and rabbitmqadmin with `--ssl`.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use common::http::{get_json, parse, Response};
use common::pki::{client_config, path, Pem, Pki};
use common::python::run_bounded;
use common::*;
use futures_rustls::rustls;
use rustls::pki_types::ServerName;

/// The broker's handshake deadline on the HTTPS port (the amqps listener's).
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

/// A broker with the management API over HTTPS on a free port, and its port. `files`: the
/// certificate flags (and any other).
fn broker(files: &[&str]) -> (Broker, u16) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let b = Broker::start_with_args(&[&["--management-tls-listen", listen.as_str()], files].concat());
    let ready = format!("management UI over TLS on https://{listen}/ (its HTTP API under /api/)");
    b.wait_for_log(&ready, "the ready line naming the HTTPS listener");
    (b, port)
}

/// `--tls-cert/--tls-key` of `pki`'s server certificate (the amqps flags, lent to the HTTPS
/// listener).
fn amqps_files(pki: &Pki) -> [String; 4] {
    ["--tls-cert".into(), path(&pki.server.cert), "--tls-key".into(), path(&pki.server.key)]
}

/// `GET path` over HTTPS to 127.0.0.1:`port` as `auth`, trusting `ca` for the name
/// `localhost`, presenting `client`; offers ALPN h2 and http/1.1. The answer and the ALPN
/// protocol agreed, or why it failed (the handshake's error included). Bounded: 5 s to
/// connect, 10 s per read or write.
fn https_get(
    port: u16,
    ca: &Path,
    client: Option<&Pem>,
    path: &str,
    auth: Option<(&str, &str)>,
) -> Result<(Response, Option<String>), String> {
    use base64::Engine as _;
    let config = client_config(ca, client, &[b"h2", b"http/1.1"]);
    let conn = rustls::ClientConnection::new(config, ServerName::try_from("localhost").expect("name")).map_err(|e| e.to_string())?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| format!("connect {addr}: {e}"))?;
    tcp.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    tcp.set_write_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut s = rustls::StreamOwned::new(conn, tcp);
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some((u, p)) = auth {
        head.push_str(&format!("Authorization: Basic {}\r\n", base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).and_then(|()| s.flush()).map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    match s.read_to_end(&mut raw) {
        Ok(_) => {}
        // A close without close_notify after a whole answer.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(format!("read: {e}")),
    }
    let alpn = s.conn.alpn_protocol().map(|p| String::from_utf8_lossy(p).into_owned());
    Ok((parse(&raw)?, alpn))
}

/// Reads until the broker closes `s`; how long that took. Panics past `limit`.
fn wait_closed(s: &mut TcpStream, limit: Duration) -> (Duration, Vec<u8>) {
    let t0 = Instant::now();
    s.set_read_timeout(Some(limit)).expect("timeout");
    let (mut buf, mut got) = ([0u8; 4096], Vec::new());
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (t0.elapsed(), got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("the broker did not close the socket within {limit:?}")
            }
            Err(_) => return (t0.elapsed(), got),
        }
        assert!(t0.elapsed() < limit, "the broker did not close the socket within {limit:?}");
    }
}

/// Runs ringmq with `args` (loopback ports of its own, management API off) expecting it to
/// refuse to start: its output.
fn refused_start(args: &[&str]) -> String {
    let data = tempfile::tempdir().expect("tempdir");
    let (listen, metrics) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let dir = path(data.path());
    let base = ["--listen", &listen, "--metrics-listen", &metrics, "--management-listen", "off", "--data-dir", &dir];
    let (ok, out) = run_bounded(&path(&broker_binary()), &[&base[..], args].concat(), STEP_TIMEOUT);
    assert!(!ok, "ringmq started (or hung) with {args:?}:\n{out}");
    out
}

#[test]
fn overview_over_https_with_basic_auth_beside_the_plain_port() {
    let pki = Pki::new();
    let (b, port) = broker(&amqps_files(&pki).each_ref().map(String::as_str));
    require_own_broker!(b, "ringmq's HTTPS listener");
    assert!(b.log().contains("certificate=\"tls_cert\""), "the amqps certificate is used:\n{}", b.log());
    // The certificate verifies against the test CA for localhost (the client trusts nothing
    // else), ALPN settles on HTTP/1.1, and basic auth as guest reads the overview.
    let (r, alpn) = https_get(port, &pki.ca, None, "/api/overview", Some(("guest", "guest"))).expect("GET over HTTPS");
    assert_eq!(r.status, 200, "{r:?}");
    let overview = r.json();
    assert!(overview["management_version"].is_string() && overview["node"].is_string(), "{overview}");
    assert_eq!(alpn.as_deref(), Some("http/1.1"));
    // The same API: no credentials is 401, and the plain port answers beside it.
    let (r, _) = https_get(port, &pki.ca, None, "/api/overview", None).expect("GET without auth");
    assert_eq!(r.status, 401, "{r:?}");
    assert_eq!(get_json(b.management_port(), "/api/overview")["node"], overview["node"]);
    // A client that trusts another CA refuses the broker's certificate.
    let other = tempfile::tempdir().expect("tempdir");
    let other_ca = other.path().join("other-ca.crt");
    std::fs::write(&other_ca, rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("cert").cert.pem()).expect("write");
    let e = https_get(port, &other_ca, None, "/api/overview", Some(("guest", "guest"))).expect_err("an untrusted server certificate");
    assert!(e.contains("certificate") || e.contains("UnknownIssuer"), "{e}");
}

#[test]
fn plain_http_on_the_https_port_is_answered_400_and_closed_and_the_broker_serves_on() {
    let pki = Pki::new();
    let (b, port) = broker(&amqps_files(&pki).each_ref().map(String::as_str));
    require_own_broker!(b, "ringmq's HTTPS listener");
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.write_all(b"GET /api/overview HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").expect("write");
    let (took, answer) = wait_closed(&mut s, Duration::from_secs(5));
    let answer = String::from_utf8_lossy(&answer);
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
    assert!(answer.starts_with("HTTP/1.1 400") && answer.contains("use https://"), "{answer:?}");
    b.wait_for_log("plain HTTP on the HTTPS port", "the plain HTTP client");
    assert!(b.log().contains("peer=127.0.0.1:"), "the log line names the peer:\n{}", b.log());
    // Bytes that are neither TLS nor text (an SSLv2-style hello): rustls refuses them, and
    // the socket is closed at once too.
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.write_all(&[0x80, 0x2e, 0x01, 0x00, 0x02, 0x00, 0x15]).expect("write");
    let (took, _) = wait_closed(&mut s, Duration::from_secs(5));
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
    b.wait_for_log("management API: TLS handshake failed", "the non-TLS client");
    let (r, _) = https_get(port, &pki.ca, None, "/api/whoami", Some(("guest", "guest"))).expect("HTTPS after them");
    assert_eq!(r.status, 200, "{r:?}");
}

#[test]
fn silent_and_stalled_handshakes_are_closed_by_the_deadline_without_holding_others() {
    let pki = Pki::new();
    let (b, port) = broker(&amqps_files(&pki).each_ref().map(String::as_str));
    require_own_broker!(b, "ringmq's HTTPS listener");
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut silent = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    // Half a TLS record: a handshake header announcing 512 bytes, then nothing.
    let mut stalled = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    stalled.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).expect("write");
    // Meanwhile other clients are served.
    let t0 = Instant::now();
    let (r, _) = https_get(port, &pki.ca, None, "/api/overview", Some(("guest", "guest"))).expect("HTTPS beside the silent ones");
    assert_eq!(r.status, 200, "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(3), "served after {:?}", t0.elapsed());
    let limit = HANDSHAKE_DEADLINE + Duration::from_secs(5);
    let (took, _) = wait_closed(&mut silent, limit);
    assert!(took >= HANDSHAKE_DEADLINE - Duration::from_secs(2), "closed after {took:?}, before the 10 s deadline");
    let (left, _) = wait_closed(&mut stalled, Duration::from_secs(3));
    assert!(left < Duration::from_secs(3), "the stalled handshake outlived the silent one by {left:?}");
    b.wait_for_log("management API: TLS handshake not completed in time", "the stalled handshakes");
}

#[test]
fn own_files_with_a_ca_and_fail_if_no_peer_cert_refuse_a_client_without_a_certificate() {
    let pki = Pki::new();
    let (cert, key, ca) = (path(&pki.server.cert), path(&pki.server.key), path(&pki.ca));
    let own = ["--management-tls-cert", &cert, "--management-tls-key", &key, "--management-tls-ca", &ca];
    let (b, port) = broker(&[&own[..], &["--management-tls-fail-if-no-peer-cert", "--management-listen", "off"]].concat());
    require_own_broker!(b, "ringmq's HTTPS listener");
    assert!(b.log().contains("certificate=\"management_tls_cert\" verify_peer=true"), "{}", b.log());
    assert!(!b.log().contains("management UI on http://"), "--management-listen off: HTTPS only:\n{}", b.log());
    // No certificate: the handshake fails (TLS 1.3: the client learns it at its first read).
    let e = https_get(port, &pki.ca, None, "/api/overview", Some(("guest", "guest"))).expect_err("no client certificate");
    assert!(e.contains("CertificateRequired") || e.contains("certificate"), "{e}");
    b.wait_for_log("management API: TLS handshake failed", "the client without a certificate");
    // One of another CA: refused too.
    let e = https_get(port, &pki.ca, Some(&pki.rogue), "/api/overview", Some(("guest", "guest"))).expect_err("another CA's certificate");
    assert!(!e.is_empty());
    // A verified certificate gets through TLS; the API still wants basic auth.
    let (r, _) = https_get(port, &pki.ca, Some(&pki.guest), "/api/overview", Some(("guest", "guest"))).expect("verified client");
    assert_eq!(r.status, 200, "{r:?}");
    let (r, _) = https_get(port, &pki.ca, Some(&pki.guest), "/api/overview", None).expect("verified client, no auth");
    assert_eq!(r.status, 401, "{r:?}");
}

#[test]
fn with_a_ca_alone_the_client_certificate_is_optional_but_verified() {
    let pki = Pki::new();
    let files = amqps_files(&pki);
    let ca = path(&pki.ca);
    let (b, port) = broker(&[&files.each_ref().map(String::as_str)[..], &["--tls-ca", &ca]].concat());
    require_own_broker!(b, "ringmq's HTTPS listener");
    assert!(b.log().contains("verify_peer=true"), "tls_ca is inherited:\n{}", b.log());
    let (r, _) = https_get(port, &pki.ca, None, "/api/whoami", Some(("guest", "guest"))).expect("no client certificate");
    assert_eq!(r.status, 200, "{r:?}");
    let (r, _) = https_get(port, &pki.ca, Some(&pki.guest), "/api/whoami", Some(("guest", "guest"))).expect("verified certificate");
    assert_eq!(r.status, 200, "{r:?}");
    https_get(port, &pki.ca, Some(&pki.rogue), "/api/whoami", Some(("guest", "guest"))).expect_err("another CA's certificate");
    b.wait_for_log("management API: TLS handshake failed", "the refused certificate");
}

#[test]
fn a_start_without_certificate_or_with_a_missing_file_is_refused_naming_it() {
    let pki = Pki::new();
    let listen = format!("127.0.0.1:{}", free_port());
    let out = refused_start(&["--management-tls-listen", &listen]);
    assert!(out.contains("management_tls_cert and management_tls_key, or tls_cert and tls_key"), "{out}");
    let missing = path(&pki.ca.with_file_name("missing.crt"));
    let out = refused_start(&[
        "--management-tls-listen",
        &listen,
        "--management-tls-cert",
        &missing,
        "--management-tls-key",
        &path(&pki.server.key),
    ]);
    assert!(out.contains(&missing), "the error names the file:\n{out}");
    let out = refused_start(&["--management-tls-listen", &listen, "--management-tls-cert", &path(&pki.server.cert)]);
    assert!(out.contains("management_tls_cert needs management_tls_key"), "{out}");
}

/// curl and rabbitmqadmin (`--ssl`) against the HTTPS port, each skipped when not installed.
#[test]
fn curl_and_rabbitmqadmin_over_https() {
    let pki = Pki::new();
    let (b, port) = broker(&amqps_files(&pki).each_ref().map(String::as_str));
    require_own_broker!(b, "ringmq's HTTPS listener");
    let ca = path(&pki.ca);
    let found = |tool: &str| std::process::Command::new("which").arg(tool).output().is_ok_and(|o| o.status.success());
    if found("curl") {
        let url = format!("https://127.0.0.1:{port}/api/overview");
        let (ok, out) =
            run_bounded("curl", &["-sS", "--max-time", "10", "--cacert", &ca, "-u", "guest:guest", &url], Duration::from_secs(20));
        assert!(ok && out.contains("\"management_version\""), "curl --cacert:\n{out}");
        // Without the CA curl refuses the certificate.
        let (ok, out) = run_bounded("curl", &["-sS", "--max-time", "10", "-u", "guest:guest", &url], Duration::from_secs(20));
        assert!(!ok, "curl trusted the test certificate without --cacert:\n{out}");
    } else {
        eprintln!("SKIPPED curl: not installed");
    }
    if !found("rabbitmqadmin") {
        eprintln!("SKIPPED rabbitmqadmin: not installed (Debian: the rabbitmq-server package ships it)");
        return;
    }
    let port_s = port.to_string();
    let admin = |args: &[&str]| {
        let base = ["-H", "127.0.0.1", "-P", &port_s, "--ssl", "--ssl-ca-cert-file", &ca, "-u", "guest", "-p", "guest"];
        let (ok, out) = run_bounded("rabbitmqadmin", &[&base[..], args].concat(), Duration::from_secs(30));
        assert!(ok, "rabbitmqadmin --ssl {args:?}:\n{out}\nbroker log:\n{}", b.log());
        out
    };
    let queue = uniq("mgmt-tls");
    admin(&["declare", "queue", &format!("name={queue}"), "durable=false"]);
    let out = admin(&["list", "queues", "name"]);
    assert!(out.contains(&queue), "the queue declared over HTTPS is listed:\n{out}");
    let out = admin(&["list", "vhosts", "name"]);
    assert!(out.contains("| /"), "{out}");
    admin(&["delete", "queue", &format!("name={queue}")]);
}
