//! The connection handshake (AMQP 0-9-1 spec 2.2.4, 4.2.2; methods of class
//! `connection`, spec 1.4.2): protocol header → connection.start / start-ok (PLAIN,
//! AMQPLAIN, and EXTERNAL for a TLS client whose certificate verified) → connection.tune /
//! tune-ok → connection.open / open-ok.
//!
//! Invariants:
//! - A wrong protocol header is answered with the header we support, then the socket is
//!   closed (spec 4.2.2); nothing else is written.
//! - Every refusal after the header (wrong method, failed login, frame_max below 4096,
//!   unknown vhost, a vhost the user has no permission in) is a connection.close with the
//!   spec's reply code, after which the server waits at most [`CLOSE_WAIT`] for close-ok;
//!   logins and vhost access are checked against the metadata's users and permissions
//!   (`broker::access`), and a refused login is logged at WARN with user and peer.
//! - EXTERNAL is offered, and accepted, only on a connection whose client certificate
//!   verified against `--tls-ca` ([`PeerCert`]); it logs in as the certificate's subject
//!   common name (RabbitMQ's `ssl_cert_login_from = common_name`), which must be a user; no
//!   password is checked. Anywhere else EXTERNAL is refused with 403 like a failed login.
//! - Negotiated limits never exceed the configured ones: a client's 0 means "the
//!   server's value", anything else is capped by it (spec 1.4.2.6 tune-ok).
//! - Only the capabilities the server announces in `server_properties` are honoured
//!   from the client's (`consumer_cancel_notify`, `connection.blocked`).
//!
//! [`credentials`] and [`server_properties`] are pure; the rest reads and writes the
//! socket and is bounded by [`HANDSHAKE_TIMEOUT`] (set in `serve`).

use std::net::SocketAddr;
use std::rc::Rc;

use amq_protocol::protocol::{connection as conn, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::BytesMut;
use futures_lite::io::{AsyncReadExt, AsyncWriteExt};

use super::{PeerCert, Transport, CLOSE_WAIT, HANDSHAKE_TIMEOUT};
use crate::amqp::codec::{decode_frame, encode_method, Frame, PROTOCOL_HEADER};
use crate::amqp::error::AmqpError;
use crate::broker::access::{self, AccessError};
use crate::broker::node::Node;

/// What the handshake settled: who logged in, to which vhost, with which limits and
/// capabilities, and the bytes read past connection.open.
pub(super) struct Tuned {
    pub(super) vhost: String,
    pub(super) user: String,
    pub(super) frame_max: u32,
    pub(super) channel_max: u16,
    pub(super) heartbeat: u16,
    pub(super) cancel_notify: bool,
    pub(super) blocked_notify: bool,
    /// basic.qos with global=false limits the channel as a whole, at once (the spec's reading),
    /// not each later consumer (RabbitMQ's): see [`spec_qos_client`].
    pub(super) spec_qos: bool,
    /// The client connected from a loopback address (for users allowed only there).
    pub(super) loopback: bool,
    /// The start-ok's client properties (for the management API's connection listing).
    pub(super) client_properties: FieldTable,
    pub(super) leftover: BytesMut,
}

/// Reads one frame during the handshake. A frame that cannot be decoded is answered with
/// connection.close and the spec's code (501, 502, 540) before the error is returned; a
/// failed read or the peer's EOF is returned as 320 with nothing written.
async fn read_frame<S: Transport>(stream: &mut S, buf: &mut BytesMut, frame_max: u32) -> Result<Frame, AmqpError> {
    let mut tmp = [0u8; 4096];
    loop {
        match decode_frame(buf, frame_max) {
            Ok(Some(f)) => return Ok(f),
            Ok(None) => {}
            Err(e) => {
                write_close(stream, buf, &e).await;
                return Err(e);
            }
        }
        let n = stream.read(&mut tmp).await.map_err(|e| AmqpError::connection_forced(format!("read: {e}")))?;
        if n == 0 {
            return Err(AmqpError::connection_forced("peer closed during handshake"));
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

/// Reads the next method frame during the handshake, skipping heartbeats on channel 0.
/// Any frame on another channel, and a content frame, is answered with 505
/// UNEXPECTED_FRAME (as RabbitMQ does before connection.open-ok) and returned as the error.
async fn read_method<S: Transport>(stream: &mut S, buf: &mut BytesMut, frame_max: u32) -> Result<AMQPClass, AmqpError> {
    loop {
        let e = match read_frame(stream, buf, frame_max).await? {
            Frame::Heartbeat { channel: 0 } => continue,
            Frame::Method { channel: 0, method } => return Ok(*method),
            Frame::Heartbeat { channel } => {
                AmqpError::unexpected_frame(format!("heartbeat frame on channel {channel} during the handshake"))
            }
            _ => AmqpError::unexpected_frame("expected a connection method on channel 0 during the handshake"),
        };
        write_close(stream, buf, &e).await;
        return Err(e);
    }
}

/// Sends connection.close for `e`, then waits at most [`CLOSE_WAIT`] for the peer's answer
/// (whatever it is: the socket is dropped after).
async fn write_close<S: Transport>(stream: &mut S, buf: &mut BytesMut, e: &AmqpError) {
    let mut out = Vec::new();
    encode_method(&mut out, 0, &close_method(e));
    if send(stream, &out).await.is_ok() {
        // Wait briefly for close-ok (or anything, or EOF), then drop the socket.
        let _ = stream.tcp().set_read_timeout(Some(CLOSE_WAIT));
        let mut tmp = [0u8; 4096];
        let deadline = std::time::Instant::now() + CLOSE_WAIT;
        buf.clear();
        while std::time::Instant::now() < deadline {
            match stream.read(&mut tmp).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    buf.extend_from_slice(&tmp[..n]);
                    if matches!(decode_frame(buf, 131_072), Ok(Some(Frame::Method { .. })) | Err(_)) {
                        break;
                    }
                }
            }
        }
    }
}

/// Writes `bytes` and flushes them (a TLS stream may hold them otherwise).
async fn send<S: Transport>(stream: &mut S, bytes: &[u8]) -> Result<(), AmqpError> {
    let io = |e: std::io::Error| AmqpError::connection_forced(format!("write: {e}"));
    stream.write_all(bytes).await.map_err(io)?;
    stream.flush().await.map_err(io)
}

/// Sends connection.open-ok, the handshake's last frame. The caller registers the
/// connection first, so a client that has open-ok finds it listed by the management API.
/// Errors: 320 CONNECTION_FORCED when the write fails.
pub(super) async fn send_open_ok<S: Transport>(stream: &mut S) -> Result<(), AmqpError> {
    let mut out = Vec::with_capacity(12);
    encode_method(&mut out, 0, &AMQPClass::Connection(conn::AMQPMethod::OpenOk(conn::OpenOk {})));
    send(stream, &out).await
}

pub(super) fn close_method(e: &AmqpError) -> AMQPClass {
    AMQPClass::Connection(conn::AMQPMethod::Close(conn::Close {
        reply_code: e.code,
        reply_text: e.text.as_str().into(),
        class_id: e.class_id,
        method_id: e.method_id,
    }))
}

fn server_properties() -> FieldTable {
    let mut caps = FieldTable::default();
    for c in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "authentication_failure_close",
        "per_consumer_qos",
        "connection.blocked",
        "direct_reply_to",
        "consumer_priorities",
    ] {
        caps.insert(c.into(), AMQPValue::Boolean(true));
    }
    let mut p = FieldTable::default();
    p.insert("product".into(), AMQPValue::LongString("ringmq".into()));
    p.insert("version".into(), AMQPValue::LongString(env!("CARGO_PKG_VERSION").into()));
    p.insert("platform".into(), AMQPValue::LongString("Rust / Linux io_uring".into()));
    p.insert("information".into(), AMQPValue::LongString("AMQP 0-9-1 broker, thread-per-core".into()));
    p.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    p
}

/// Extracts (user, password) from a start-ok response (PLAIN: `authzid \0 user \0 pass`;
/// AMQPLAIN: a field table without its length prefix holding LOGIN and PASSWORD).
fn credentials(mechanism: &str, response: &[u8]) -> Option<(String, String)> {
    match mechanism {
        "PLAIN" => {
            let mut parts = response.split(|b| *b == 0);
            let _authzid = parts.next()?;
            let user = String::from_utf8(parts.next()?.to_vec()).ok()?;
            let pass = String::from_utf8(parts.next()?.to_vec()).ok()?;
            Some((user, pass))
        }
        "AMQPLAIN" => {
            let mut framed = (response.len() as u32).to_be_bytes().to_vec();
            framed.extend_from_slice(response);
            let (_, t) = amq_protocol::types::parsing::parse_field_table(&framed[..]).ok()?;
            let get = |k: &str| match t.inner().get(k)? {
                AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
                AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
                _ => None,
            };
            Some((get("LOGIN")?, get("PASSWORD")?))
        }
        _ => None,
    }
}

/// `check` against this core's copy of the users and permissions; in a cluster, a refusal is
/// checked once more behind a metadata read barrier (a user or permission just added on
/// another node may not have reached this copy yet).
async fn synced<T>(core: &Node, check: impl Fn(&crate::meta::Topology) -> Result<T, AccessError>) -> Result<T, AccessError> {
    let first = check(&core.router().topology);
    if first.is_err() && core.shared.meta.is_cluster() && core.shared.meta.sync().await.is_ok() {
        return check(&core.router().topology);
    }
    first
}

/// The mechanisms connection.start offers: EXTERNAL too when the client presented a
/// verified certificate.
fn mechanisms(peer_cert: Option<&PeerCert>) -> &'static str {
    match peer_cert {
        Some(_) => "PLAIN AMQPLAIN EXTERNAL",
        None => "PLAIN AMQPLAIN",
    }
}

/// Who a start-ok logs in as, before any check against the users: PLAIN and AMQPLAIN's
/// user and password, or EXTERNAL's certificate common name (no password). `None` for an
/// unknown mechanism, a malformed response, or EXTERNAL without a verified certificate
/// with a common name.
fn login(mechanism: &str, response: &[u8], peer_cert: Option<&PeerCert>) -> Option<Login> {
    match mechanism {
        "EXTERNAL" => peer_cert?.common_name.clone().map(Login::Certificate),
        _ => credentials(mechanism, response).map(|(user, password)| Login::Password { user, password }),
    }
}

/// A login as the start-ok asked for it.
#[derive(Debug, PartialEq, Eq)]
enum Login {
    /// PLAIN or AMQPLAIN.
    Password { user: String, password: String },
    /// EXTERNAL: the verified certificate's subject common name.
    Certificate(String),
}

/// Runs the handshake on a fresh socket up to connection.open, checked; on success the
/// caller registers the connection and sends open-ok ([`send_open_ok`]). `peer_cert`:
/// the client's verified TLS certificate, if any (EXTERNAL is offered only with one).
pub(super) async fn handshake<S: Transport>(
    core: &Rc<Node>,
    stream: &mut S,
    peer: Option<SocketAddr>,
    peer_cert: Option<&PeerCert>,
) -> Result<Tuned, AmqpError> {
    let _ = stream.tcp().set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let mut header = [0u8; 8];
    stream.read_exact(&mut header).await.map_err(|e| AmqpError::connection_forced(format!("read header: {e}")))?;
    if &header != PROTOCOL_HEADER {
        // Spec 4.2.2: answer with the protocol header we support, then close.
        let _ = send(stream, PROTOCOL_HEADER).await;
        return Err(AmqpError::connection_forced("bad protocol header"));
    }
    let cfg = core.shared.config.clone();
    let mut buf = BytesMut::with_capacity(4096);
    let mut out = Vec::new();
    encode_method(
        &mut out,
        0,
        &AMQPClass::Connection(conn::AMQPMethod::Start(conn::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: server_properties(),
            mechanisms: LongString::from(mechanisms(peer_cert)),
            locales: LongString::from("en_US"),
        })),
    );
    send(stream, &out).await?;
    let start_ok = match read_method(stream, &mut buf, cfg.frame_max).await? {
        AMQPClass::Connection(conn::AMQPMethod::StartOk(s)) => s,
        _ => {
            let e = AmqpError::command_invalid("expected connection.start-ok");
            write_close(stream, &mut buf, &e).await;
            return Err(e);
        }
    };
    let capability = |name: &str| match start_ok.client_properties.inner().get("capabilities") {
        Some(AMQPValue::FieldTable(c)) => matches!(c.inner().get(name), Some(AMQPValue::Boolean(true))),
        _ => false,
    };
    let (cancel_notify, blocked_notify) = (capability("consumer_cancel_notify"), capability("connection.blocked"));
    let spec_qos = spec_qos_client(&start_ok.client_properties);
    let mechanism = start_ok.mechanism.as_str().to_owned();
    let creds = login(&mechanism, start_ok.response.as_bytes(), peer_cert);
    let loopback = peer.map(|p| p.ip().is_loopback()).unwrap_or(false);
    let peer_text = peer.map(|p| p.to_string()).unwrap_or_else(|| "unknown".into());
    let user = match creds {
        Some(login) => match synced(core, |t| match &login {
            Login::Password { user, password } => access::authenticate(t, &cfg, user, password, loopback),
            Login::Certificate(user) => access::authenticate_external(t, &cfg, user, loopback),
        })
        .await
        {
            Ok(user) => user.name,
            Err(err) => {
                // Logged at the default level, as RabbitMQ does: its client text sends the
                // operator here.
                let u = match &login {
                    Login::Password { user, .. } | Login::Certificate(user) => user,
                };
                tracing::warn!(user = %u, peer = %peer_text, mechanism = %mechanism, reason = %err, "login refused");
                let e = match err {
                    AccessError::LoopbackOnly { .. } => AmqpError::login_refused(err),
                    _ => AmqpError::login_refused(format!(
                        "Login was refused using authentication mechanism {mechanism}. For details see the broker logfile."
                    )),
                };
                write_close(stream, &mut buf, &e).await;
                return Err(e);
            }
        },
        None if mechanism == "EXTERNAL" => {
            let why = match peer_cert {
                None => "no verified TLS client certificate",
                Some(_) => "the client certificate's subject has no common name",
            };
            tracing::warn!(peer = %peer_text, mechanism = %mechanism, "login refused: {why}");
            let e = AmqpError::login_refused(format!("EXTERNAL login refused: {why}"));
            write_close(stream, &mut buf, &e).await;
            return Err(e);
        }
        None => {
            tracing::warn!(peer = %peer_text, mechanism = %mechanism, "login refused: unsupported mechanism or malformed response");
            let e = AmqpError::login_refused(format!("unsupported authentication mechanism or malformed response ({mechanism})"));
            write_close(stream, &mut buf, &e).await;
            return Err(e);
        }
    };
    out.clear();
    encode_method(
        &mut out,
        0,
        &AMQPClass::Connection(conn::AMQPMethod::Tune(conn::Tune {
            channel_max: cfg.channel_max,
            frame_max: cfg.frame_max,
            heartbeat: cfg.heartbeat,
        })),
    );
    send(stream, &out).await?;
    let tune_ok = match read_method(stream, &mut buf, cfg.frame_max).await? {
        AMQPClass::Connection(conn::AMQPMethod::TuneOk(t)) => t,
        _ => {
            let e = AmqpError::command_invalid("expected connection.tune-ok");
            write_close(stream, &mut buf, &e).await;
            return Err(e);
        }
    };
    let frame_max = match tune_ok.frame_max {
        0 => cfg.frame_max,
        f if f < 4096 => {
            let e = AmqpError::syntax_error(format!("frame_max {f} is below the minimum 4096"));
            write_close(stream, &mut buf, &e).await;
            return Err(e);
        }
        f => f.min(cfg.frame_max),
    };
    let channel_max = match tune_ok.channel_max {
        0 => cfg.channel_max,
        c => c.min(cfg.channel_max),
    };
    let heartbeat = tune_ok.heartbeat;
    let open = match read_method(stream, &mut buf, frame_max).await? {
        AMQPClass::Connection(conn::AMQPMethod::Open(o)) => o,
        _ => {
            let e = AmqpError::command_invalid("expected connection.open");
            write_close(stream, &mut buf, &e).await;
            return Err(e);
        }
    };
    let vhost = open.virtual_host.as_str().to_owned();
    if let Err(err) = synced(core, |t| access::check_vhost_access(t, &user, &vhost)).await {
        // 530 NOT_ALLOWED in both cases, with RabbitMQ's texts.
        let e = match err {
            AccessError::NotFound(_) => AmqpError::not_allowed(format!("vhost {vhost} not found")),
            _ => AmqpError::not_allowed(err),
        };
        tracing::warn!(user = %user, peer = %peer_text, vhost = %vhost, reason = %e.text, "connection.open refused");
        write_close(stream, &mut buf, &e).await;
        return Err(e);
    }
    let client_properties = start_ok.client_properties;
    Ok(Tuned {
        vhost,
        user,
        frame_max,
        channel_max,
        heartbeat,
        cancel_notify,
        blocked_notify,
        spec_qos,
        loopback,
        client_properties,
        leftover: buf,
    })
}

/// Whether the client reads basic.qos as the AMQP 0-9-1 spec does (spec 1.8.3.1: global=false
/// limits "the current channel", at once) rather than as RabbitMQ does since 3.3 (global=false:
/// a limit for each consumer started afterwards; global=true: the channel).
///
/// py-amqp, the client of kombu and Celery: kombu sends RabbitMQ 3.3-3.x global=true and every
/// other server global=false (`qos_semantics_matches_spec`, decided by the server's `product`),
/// and Celery's worker raises its prefetch while it holds ETA/countdown tasks through that one
/// call on its running consumer. Read as RabbitMQ reads global=false, the raise would never
/// reach the consumer, and a worker holding countdown tasks would stop taking work until they
/// ran. Every other client gets RabbitMQ's reading (README, "basic.qos").
pub(super) fn spec_qos_client(client_properties: &FieldTable) -> bool {
    matches!(client_properties.inner().get("product"), Some(AMQPValue::LongString(p)) if p.as_bytes() == b"py-amqp")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_response_is_authzid_user_password() {
        assert_eq!(credentials("PLAIN", b"\0guest\0secret"), Some(("guest".into(), "secret".into())));
        assert_eq!(credentials("PLAIN", b"admin\0guest\0secret"), Some(("guest".into(), "secret".into())));
        assert_eq!(credentials("PLAIN", b"\0guest"), None);
        assert_eq!(credentials("PLAIN", b"\0gu\xffest\0secret"), None);
    }

    /// A field table's wire form without its 4-byte length, as AMQPLAIN sends it.
    fn unframed(t: &FieldTable) -> Vec<u8> {
        let framed = amq_protocol::types::generation::gen_field_table(t)(Vec::new().into()).expect("table").write;
        framed[4..].to_vec()
    }

    #[test]
    fn amqplain_response_is_a_table_without_its_length() {
        let mut t = FieldTable::default();
        t.insert("LOGIN".into(), AMQPValue::LongString("guest".into()));
        t.insert("PASSWORD".into(), AMQPValue::LongString("secret".into()));
        assert_eq!(credentials("AMQPLAIN", &unframed(&t)), Some(("guest".into(), "secret".into())));
        let mut only_login = FieldTable::default();
        only_login.insert("LOGIN".into(), AMQPValue::LongString("guest".into()));
        assert_eq!(credentials("AMQPLAIN", &unframed(&only_login)), None);
    }

    #[test]
    fn external_is_offered_and_taken_only_with_a_verified_certificate() {
        let alice = PeerCert { common_name: Some("alice".into()) };
        let nameless = PeerCert { common_name: None };
        assert_eq!(mechanisms(None), "PLAIN AMQPLAIN");
        assert_eq!(mechanisms(Some(&alice)), "PLAIN AMQPLAIN EXTERNAL");
        assert_eq!(login("EXTERNAL", b"", Some(&alice)), Some(Login::Certificate("alice".into())));
        assert_eq!(login("EXTERNAL", b"\0bob\0pw", None), None, "no certificate: nothing to log in as");
        assert_eq!(login("EXTERNAL", b"", Some(&nameless)), None);
        let by_password = Some(Login::Password { user: "bob".into(), password: "pw".into() });
        assert_eq!(login("PLAIN", b"\0bob\0pw", Some(&alice)), by_password, "a certificate does not change PLAIN");
    }

    #[test]
    fn unknown_mechanism_has_no_credentials() {
        assert_eq!(credentials("EXTERNAL", b"\0guest\0guest"), None);
    }

    #[test]
    fn only_py_amqp_gets_the_spec_reading_of_basic_qos() {
        let props = |product: &str| {
            let mut p = FieldTable::default();
            p.insert("product".into(), AMQPValue::LongString(product.into()));
            p
        };
        assert!(spec_qos_client(&props("py-amqp")), "kombu's and Celery's client");
        for other in ["pika", "RabbitMQ", "amqp-client", "py-amqp-fork"] {
            assert!(!spec_qos_client(&props(other)), "{other} gets RabbitMQ's reading");
        }
        assert!(!spec_qos_client(&FieldTable::default()), "no product: RabbitMQ's reading");
    }

    #[test]
    fn server_announces_the_capabilities_it_implements() {
        let p = server_properties();
        let Some(AMQPValue::FieldTable(caps)) = p.inner().get("capabilities") else { panic!("no capabilities") };
        for c in [
            "publisher_confirms",
            "exchange_exchange_bindings",
            "basic.nack",
            "consumer_cancel_notify",
            "authentication_failure_close",
            "per_consumer_qos",
            "connection.blocked",
            "direct_reply_to",
            "consumer_priorities",
        ] {
            assert_eq!(caps.inner().get(c), Some(&AMQPValue::Boolean(true)), "{c}");
        }
        assert_eq!(caps.inner().len(), 9);
        assert!(matches!(p.inner().get("product"), Some(AMQPValue::LongString(s)) if s.as_bytes() == b"ringmq"));
    }

    #[test]
    fn close_method_carries_the_error() {
        let e = AmqpError::not_allowed("vhost x not found");
        let AMQPClass::Connection(conn::AMQPMethod::Close(c)) = close_method(&e) else { panic!("not connection.close") };
        assert_eq!((c.reply_code, c.reply_text.as_str(), c.class_id, c.method_id), (e.code, e.text.as_str(), e.class_id, e.method_id));
    }
}
