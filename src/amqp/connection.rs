//! One client connection on the core that accepted it.
//!
//! Two halves run in one task: the **reader** parses frames and carries out methods, and
//! the **writer** drains the connection's event channel ([`ClientEvent`]s from the reader
//! and from queues on any core) into one socket write per batch, assigning delivery tags
//! and coalescing publisher confirms on the way. Whichever half ends first ends the
//! connection; then every channel is closed (requeueing what it held) and exclusive queues
//! are deleted.
//!
//! Handshake (spec 2.2.4): protocol header → start/start-ok (PLAIN, AMQPLAIN) →
//! tune/tune-ok → open/open-ok. Errors are reported as the spec assigns: channel errors
//! with channel.close, connection errors with connection.close, after which only
//! connection.close-ok (or close) is read, for at most [`CLOSE_WAIT`].

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{basic, channel as chan, connection as conn, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::BytesMut;
use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream;

use super::channel::{Channel, ChannelState};
use super::codec::{self, decode_frame, encode_heartbeat, encode_method, Frame, PROTOCOL_HEADER};
use super::error::{AmqpError, Scope};
use super::methods;
use super::unacked::Unacked;
use crate::broker::message::split_header;
use crate::broker::node::Node;
use crate::broker::{ClientEvent, ClientTx, ConnId, QueueOp, QueueRef};
use crate::observe::Stats;

/// How long the server waits for connection.close-ok after sending connection.close.
pub const CLOSE_WAIT: Duration = Duration::from_secs(1);
/// Limit for the whole handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest message body accepted, bytes (RabbitMQ's default max_message_size, 128 MiB).
pub const MAX_MESSAGE_BYTES: u64 = 128 << 20;

/// Mutable state of a connection.
pub struct ConnState {
    /// Virtual host opened.
    pub vhost: Rc<str>,
    /// Logged-in user.
    pub user: String,
    /// Negotiated frame_max, bytes.
    pub frame_max: u32,
    /// Negotiated channel_max.
    pub channel_max: u16,
    /// Negotiated heartbeat, seconds (0 = off).
    pub heartbeat: u16,
    /// Open channels.
    pub channels: rustc_hash::FxHashMap<u16, Channel>,
    /// The client announced consumer_cancel_notify.
    pub cancel_notify: bool,
    /// The server sent connection.close and waits for close-ok (until this instant).
    pub closing: Option<Instant>,
    /// The writer should flush what it has and end the connection.
    pub finish: bool,
    /// Exclusive queues declared by this connection.
    pub exclusive_queues: Vec<QueueRef>,
    /// Completed publisher confirms to send: (channel, seq, ok).
    pub confirms_ready: Vec<(u16, u64, bool)>,
    /// The client announced the `connection.blocked` capability.
    pub blocked_notify: bool,
    /// This connection has sent basic.publish: the disk alarm blocks it.
    pub published: bool,
    /// Blocked by the disk alarm: the reader takes no more frames until it clears.
    pub blocked: bool,
}

/// A connection: its core, id, event channel and state.
pub struct Session {
    /// The core it lives on.
    pub core: Rc<Node>,
    /// Connection id.
    pub id: ConnId,
    /// Its event channel (queues send deliveries here).
    pub tx: ClientTx,
    /// Body bytes queues handed to this connection and the writer has not yet written
    /// (backpressure for its consumers, see `broker::queue::consumer::MAX_PENDING_BYTES`).
    pub pending_bytes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Mutable state (never borrowed across an `.await`).
    pub st: RefCell<ConnState>,
    /// Wakes the reader when the connection is unblocked (or closing).
    unblocked: flume::Sender<()>,
    unblocked_rx: flume::Receiver<()>,
}

struct Tuned {
    vhost: String,
    user: String,
    frame_max: u32,
    channel_max: u16,
    heartbeat: u16,
    cancel_notify: bool,
    blocked_notify: bool,
    leftover: BytesMut,
}

/// Serves one accepted socket until it closes.
pub async fn serve(core: Rc<Node>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok();
    Stats::add(&core.stats().connections_opened, 1);
    // One deadline for the whole handshake (a client dribbling bytes must not hold a
    // connection open forever).
    let bounded = futures_lite::future::or(handshake(&core, &mut stream, peer), async {
        glommio::timer::sleep(HANDSHAKE_TIMEOUT).await;
        Err(AmqpError::connection_forced("handshake not completed in time"))
    });
    let tuned = match bounded.await {
        Ok(t) => t,
        Err(e) => {
            tracing::debug!(?peer, error = %e, "handshake ended");
            Stats::add(&core.stats().connections_closed, 1);
            return;
        }
    };
    let id = core.shared.next_id();
    let (tx, rx) = flume::unbounded();
    core.conns.borrow_mut().insert(id, tx.clone());
    let hb = tuned.heartbeat;
    let _ = stream.set_read_timeout(if hb > 0 { Some(Duration::from_secs(hb as u64 * 2)) } else { None });
    let (unblocked_tx, unblocked_rx) = flume::bounded(1);
    let session = Rc::new(Session {
        core: core.clone(),
        id,
        tx,
        pending_bytes: Default::default(),
        st: RefCell::new(ConnState {
            vhost: Rc::from(tuned.vhost.as_str()),
            user: tuned.user,
            frame_max: tuned.frame_max,
            channel_max: tuned.channel_max,
            heartbeat: hb,
            channels: Default::default(),
            cancel_notify: tuned.cancel_notify,
            closing: None,
            finish: false,
            exclusive_queues: Vec::new(),
            confirms_ready: Vec::new(),
            blocked_notify: tuned.blocked_notify,
            published: false,
            blocked: false,
        }),
        unblocked: unblocked_tx,
        unblocked_rx,
    });
    tracing::debug!(?peer, id, "connection open");
    let (r, w) = futures_lite::io::split(stream);
    futures_lite::future::or(reader(session.clone(), r, tuned.leftover), writer(session.clone(), rx, w)).await;
    session.teardown();
    core.conns.borrow_mut().remove(&id);
    Stats::add(&core.stats().connections_closed, 1);
    tracing::debug!(?peer, id, "connection closed");
}

/// Reads one frame during the handshake.
async fn read_frame(stream: &mut TcpStream, buf: &mut BytesMut, frame_max: u32) -> Result<Frame, AmqpError> {
    let mut tmp = [0u8; 4096];
    loop {
        if let Some(f) = decode_frame(buf, frame_max)? {
            return Ok(f);
        }
        let n = stream.read(&mut tmp).await.map_err(|e| AmqpError::connection_forced(format!("read: {e}")))?;
        if n == 0 {
            return Err(AmqpError::connection_forced("peer closed during handshake"));
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

/// Reads the next method frame during the handshake, skipping heartbeats.
async fn read_method(stream: &mut TcpStream, buf: &mut BytesMut, frame_max: u32) -> Result<AMQPClass, AmqpError> {
    loop {
        match read_frame(stream, buf, frame_max).await? {
            Frame::Heartbeat { .. } => continue,
            Frame::Method { channel: 0, method } => return Ok(*method),
            _ => return Err(AmqpError::unexpected_frame("expected a connection method on channel 0 during the handshake")),
        }
    }
}

async fn write_close(stream: &mut TcpStream, buf: &mut BytesMut, e: &AmqpError) {
    let mut out = Vec::new();
    encode_method(&mut out, 0, &close_method(e));
    if stream.write_all(&out).await.is_ok() {
        // Wait briefly for close-ok, then drop the socket.
        let _ = stream.set_read_timeout(Some(CLOSE_WAIT));
        let _ = read_frame(stream, buf, 131_072).await;
    }
}

fn close_method(e: &AmqpError) -> AMQPClass {
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

async fn handshake(core: &Rc<Node>, stream: &mut TcpStream, peer: Option<SocketAddr>) -> Result<Tuned, AmqpError> {
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let mut header = [0u8; 8];
    stream.read_exact(&mut header).await.map_err(|e| AmqpError::connection_forced(format!("read header: {e}")))?;
    if &header != PROTOCOL_HEADER {
        // Spec 4.2.2: answer with the protocol header we support, then close.
        let _ = stream.write_all(PROTOCOL_HEADER).await;
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
            mechanisms: LongString::from("PLAIN AMQPLAIN"),
            locales: LongString::from("en_US"),
        })),
    );
    stream.write_all(&out).await.map_err(|e| AmqpError::connection_forced(format!("write: {e}")))?;
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
    let mechanism = start_ok.mechanism.as_str().to_owned();
    let creds = credentials(&mechanism, start_ok.response.as_bytes());
    let loopback = peer.map(|p| p.ip().is_loopback()).unwrap_or(false);
    let user = match creds {
        Some((u, p)) => match cfg.users.iter().find(|x| x.name == u && x.password == p) {
            Some(x) if x.loopback_only && !loopback => {
                let e = AmqpError::login_refused(format!("user '{u}' can only connect via localhost"));
                write_close(stream, &mut buf, &e).await;
                return Err(e);
            }
            Some(x) => x.name.clone(),
            None => {
                let e = AmqpError::login_refused(format!(
                    "Login was refused using authentication mechanism {mechanism}. For details see the broker logfile."
                ));
                write_close(stream, &mut buf, &e).await;
                return Err(e);
            }
        },
        None => {
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
    stream.write_all(&out).await.map_err(|e| AmqpError::connection_forced(format!("write: {e}")))?;
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
    if !core.shared.meta.topology().vhosts.contains(&vhost) {
        let e = AmqpError::not_allowed(format!("vhost {vhost} not found"));
        write_close(stream, &mut buf, &e).await;
        return Err(e);
    }
    out.clear();
    encode_method(&mut out, 0, &AMQPClass::Connection(conn::AMQPMethod::OpenOk(conn::OpenOk {})));
    stream.write_all(&out).await.map_err(|e| AmqpError::connection_forced(format!("write: {e}")))?;
    Ok(Tuned { vhost, user, frame_max, channel_max, heartbeat, cancel_notify, blocked_notify, leftover: buf })
}

async fn reader<R: futures_lite::AsyncRead + Unpin>(s: Rc<Session>, mut r: R, mut buf: BytesMut) {
    let mut tmp = vec![0u8; 64 * 1024];
    loop {
        loop {
            // Blocked by the disk alarm: take no frame, not even from the buffer, until
            // unblocked (the socket is not read either, so the client's TCP window closes).
            s.wait_unblocked().await;
            let frame_max = s.st.borrow().frame_max;
            match decode_frame(&mut buf, frame_max) {
                Ok(Some(frame)) => {
                    if let Err(e) = s.on_frame(frame).await {
                        s.fail(e);
                    }
                    if s.st.borrow().finish {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    // The stream can no longer be framed: report and end (spec 4.2.3).
                    s.fail(e);
                    s.finish();
                    break;
                }
            }
        }
        if s.st.borrow().finish {
            // The writer flushes and ends the connection.
            std::future::pending::<()>().await;
        }
        s.wait_unblocked().await;
        match r.read(&mut tmp).await {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
            Err(e) => {
                if e.kind() == std::io::ErrorKind::TimedOut {
                    tracing::info!(conn = s.id, "missed heartbeats from client, closing TCP connection");
                }
                return;
            }
        }
    }
}

async fn writer<W: futures_lite::AsyncWrite + Unpin>(s: Rc<Session>, rx: flume::Receiver<ClientEvent>, mut w: W) {
    let mut out: Vec<u8> = Vec::with_capacity(64 * 1024);
    let hb = s.st.borrow().heartbeat;
    let mut last_write = Instant::now();
    loop {
        let closing = s.st.borrow().closing;
        let mut wait: Option<Duration> = None;
        if hb > 0 {
            wait = Some((last_write + Duration::from_millis(hb as u64 * 500)).saturating_duration_since(Instant::now()));
        }
        if let Some(deadline) = closing {
            let d = deadline.saturating_duration_since(Instant::now());
            wait = Some(wait.map_or(d, |w| w.min(d)));
        }
        let ev = match wait {
            None => rx.recv_async().await.ok(),
            Some(d) => {
                futures_lite::future::or(async { rx.recv_async().await.ok() }, async {
                    glommio::timer::sleep(d).await;
                    None
                })
                .await
            }
        };
        let mut delivered_bytes = 0usize;
        if let Some(ev) = ev {
            delivered_bytes += delivery_bytes(&ev);
            s.on_event(ev, &mut out);
            for _ in 0..crate::core::BATCH {
                match rx.try_recv() {
                    Ok(ev) => {
                        delivered_bytes += delivery_bytes(&ev);
                        s.on_event(ev, &mut out)
                    }
                    Err(_) => break,
                }
            }
        }
        s.flush_confirms(&mut out);
        let closing = s.st.borrow().closing;
        if closing.is_some_and(|deadline| Instant::now() >= deadline) {
            s.finish();
        }
        if out.is_empty() && hb > 0 && last_write.elapsed() >= Duration::from_millis(hb as u64 * 500) {
            encode_heartbeat(&mut out);
        }
        if !out.is_empty() {
            if w.write_all(&out).await.is_err() {
                return;
            }
            last_write = Instant::now();
            out.clear();
            if out.capacity() > 4 << 20 {
                out.shrink_to(64 * 1024);
            }
        }
        if delivered_bytes > 0 {
            // Written, or dropped for a closed channel: no longer pending either way.
            s.pending_bytes.fetch_sub(delivered_bytes, std::sync::atomic::Ordering::Relaxed);
        }
        if s.st.borrow().finish {
            let _ = w.flush().await;
            let _ = w.close().await;
            return;
        }
    }
}

/// What a delivery event weighs in `Session::pending_bytes` (added by its queue).
fn delivery_bytes(ev: &ClientEvent) -> usize {
    match ev {
        ClientEvent::Deliver(d) => crate::broker::queue::consumer::pending_weight(d.message.body.len()),
        _ => 0,
    }
}

impl Session {
    /// Queues already-encoded frames for the writer.
    pub fn send_frames(&self, frames: Vec<u8>) {
        let _ = self.tx.send(ClientEvent::Frames(frames));
    }

    /// Queues one method frame.
    pub fn send_method(&self, channel: u16, method: &AMQPClass) {
        let mut out = Vec::with_capacity(64);
        encode_method(&mut out, channel, method);
        self.send_frames(out);
    }

    /// Asks the writer to flush and end the connection.
    pub fn finish(&self) {
        self.st.borrow_mut().finish = true;
        self.send_frames(Vec::new());
    }

    /// The vhost of this connection.
    pub fn vhost(&self) -> Rc<str> {
        self.st.borrow().vhost.clone()
    }

    /// Sends an operation to a queue's owner core.
    pub fn queue_send(&self, queue: &QueueRef, op: QueueOp) {
        self.core.send_from_connection(queue, op);
    }

    /// Reports a connection error: connection.close, then only close-ok (or close) is read
    /// for [`CLOSE_WAIT`]. Channel errors go through [`Session::fail_channel`]; one that
    /// reached here anyway closes the connection rather than the process.
    pub fn fail(&self, e: AmqpError) {
        let mut st = self.st.borrow_mut();
        if st.closing.is_some() || st.finish {
            return;
        }
        tracing::debug!(conn = self.id, error = %e, "connection error");
        st.closing = Some(Instant::now() + CLOSE_WAIT);
        drop(st);
        self.send_method(0, &close_method(&e));
    }

    /// Closes channel `ch` with a soft error: channel.close, then its deliveries are
    /// requeued and its consumers cancelled at once (RabbitMQ behaviour).
    pub fn fail_channel(&self, ch: u16, e: AmqpError, out: Option<&mut Vec<u8>>) {
        let mut st = self.st.borrow_mut();
        let Some(c) = st.channels.get_mut(&ch) else { return };
        if c.state != ChannelState::Open {
            return;
        }
        tracing::debug!(conn = self.id, channel = ch, error = %e, "channel error");
        c.state = ChannelState::Closing;
        let effects = close_effects(c);
        drop(st);
        self.apply_close_effects(effects);
        let m = AMQPClass::Channel(chan::AMQPMethod::Close(chan::Close {
            reply_code: e.code,
            reply_text: e.text.as_str().into(),
            class_id: e.class_id,
            method_id: e.method_id,
        }));
        match out {
            Some(out) => encode_method(out, ch, &m),
            None => self.send_method(ch, &m),
        }
    }

    /// Tells every queue a channel touched that it is gone (they requeue what it held and
    /// drop its consumers).
    pub fn apply_close_effects(&self, effects: (u64, Vec<QueueRef>)) {
        let (uid, queues) = effects;
        for q in queues {
            self.queue_send(&q, QueueOp::ChannelClosed { chan_uid: uid });
        }
    }

    /// Closes every channel (requeueing what they hold) and deletes the connection's
    /// exclusive queues; returns the replies of those deletions.
    fn close_all(&self) -> Vec<flume::Receiver<Result<u32, crate::broker::QueueError>>> {
        let mut st = self.st.borrow_mut();
        let channels: Vec<Channel> = st.channels.drain().map(|(_, c)| c).collect();
        let exclusive = std::mem::take(&mut st.exclusive_queues);
        drop(st);
        for mut c in channels {
            if c.state == ChannelState::Open {
                let effects = close_effects(&mut c);
                self.apply_close_effects(effects);
            }
        }
        let mut replies = Vec::new();
        for q in exclusive {
            let (reply, rx) = crate::broker::reply_channel();
            self.queue_send(&q, QueueOp::Delete { if_unused: false, if_empty: false, reply });
            replies.push(rx);
        }
        replies
    }

    /// [`Session::close_all`], waiting (at most 2 s) until the exclusive queues are deleted.
    async fn release(&self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        for rx in self.close_all() {
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = futures_lite::future::or(async { rx.recv_async().await.ok() }, async {
                glommio::timer::sleep(left).await;
                None
            })
            .await;
        }
    }

    fn teardown(&self) {
        let _ = self.close_all();
    }

    async fn on_frame(self: &Rc<Self>, frame: Frame) -> Result<(), AmqpError> {
        let closing = self.st.borrow().closing.is_some();
        match frame {
            Frame::Heartbeat { channel: 0 } => Ok(()),
            Frame::Heartbeat { channel } => Err(AmqpError::frame_error(format!("heartbeat frame on channel {channel}"))),
            Frame::Method { channel: 0, method } => {
                let m = *method;
                match m {
                    AMQPClass::Connection(conn::AMQPMethod::Close(c)) => {
                        tracing::debug!(conn = self.id, code = c.reply_code, text = %c.reply_text, "client closed connection");
                        // As RabbitMQ: by close-ok, the channels are closed (their deliveries
                        // requeued) and the exclusive queues are gone.
                        self.release().await;
                        self.send_method(0, &AMQPClass::Connection(conn::AMQPMethod::CloseOk(conn::CloseOk {})));
                        self.finish();
                        Ok(())
                    }
                    AMQPClass::Connection(conn::AMQPMethod::CloseOk(_)) => {
                        self.finish();
                        Ok(())
                    }
                    _ if closing => Ok(()),
                    AMQPClass::Connection(conn::AMQPMethod::Blocked(_) | conn::AMQPMethod::Unblocked(_)) => Ok(()),
                    AMQPClass::Connection(m) => {
                        let id = AMQPClass::Connection(m.clone()).get_amqp_method_id();
                        Err(AmqpError::command_invalid("connection method not valid after the handshake").on_method(10, id))
                    }
                    other => {
                        let (c, mth) = (other.get_amqp_class_id(), other.get_amqp_method_id());
                        Err(AmqpError::channel_error("non-connection method on channel 0").on_method(c, mth))
                    }
                }
            }
            _ if closing => Ok(()),
            Frame::Method { channel, method } => self.on_method(channel, *method).await,
            Frame::Header { channel, class_id, body_size, properties, raw_properties } => {
                let mut st = self.st.borrow_mut();
                let Some(c) = st.channels.get_mut(&channel) else {
                    return Err(AmqpError::channel_error(format!("content header on channel {channel}, which is not open")));
                };
                if c.state == ChannelState::Closing {
                    return Ok(());
                }
                let Some(p) = c.publish.as_mut().filter(|p| p.body_size.is_none()) else {
                    return Err(AmqpError::unexpected_frame(format!("content header on channel {channel} without basic.publish")));
                };
                if class_id != 60 {
                    return Err(AmqpError::unexpected_frame(format!("content header of class {class_id}, expected 60")));
                }
                p.body_size = Some(body_size);
                p.properties = Some(properties);
                p.raw_properties = raw_properties;
                if body_size > MAX_MESSAGE_BYTES {
                    c.publish = None;
                    drop(st);
                    // Later body frames of this message land on a closing channel and are dropped.
                    self.fail_channel(
                        channel,
                        AmqpError::precondition_failed(format!("message size {body_size} is larger than the maximum {MAX_MESSAGE_BYTES}"))
                            .on_method(60, 40),
                        None,
                    );
                    return Ok(());
                }
                if body_size == 0 {
                    drop(st);
                    return self.publish_complete(channel);
                }
                Ok(())
            }
            Frame::Body { channel, payload } => {
                let mut st = self.st.borrow_mut();
                let Some(c) = st.channels.get_mut(&channel) else {
                    return Err(AmqpError::channel_error(format!("content body on channel {channel}, which is not open")));
                };
                if c.state == ChannelState::Closing {
                    return Ok(());
                }
                let Some(p) = c.publish.as_mut().filter(|p| p.body_size.is_some()) else {
                    return Err(AmqpError::unexpected_frame(format!("content body on channel {channel} without a content header")));
                };
                let size = p.body_size.unwrap_or(0);
                if p.received + payload.len() as u64 > size {
                    return Err(AmqpError::frame_error(format!("content body larger than the declared {size} bytes")));
                }
                p.push_body(payload);
                if p.received == size {
                    drop(st);
                    return self.publish_complete(channel);
                }
                Ok(())
            }
        }
    }

    fn publish_complete(self: &Rc<Self>, channel: u16) -> Result<(), AmqpError> {
        let p = {
            let mut st = self.st.borrow_mut();
            st.channels.get_mut(&channel).and_then(|c| c.publish.take())
        };
        let Some(p) = p else { return Ok(()) };
        let first = !std::mem::replace(&mut self.st.borrow_mut().published, true);
        if first && self.core.shared.alarms.disk_alarm() {
            self.set_blocked(true, None);
        }
        if let Err(e) = methods::basic::publish(self, channel, p) {
            return self.on_error(channel, e.on_method(60, 40));
        }
        Ok(())
    }

    /// Blocks (the disk alarm was raised, and this connection publishes) or unblocks it:
    /// connection.blocked / connection.unblocked to a client that announced the capability
    /// (RabbitMQ's reason text), and the reader stops or goes on. Into `out` when the
    /// writer calls it, else through the event channel.
    fn set_blocked(&self, blocked: bool, out: Option<&mut Vec<u8>>) {
        let mut st = self.st.borrow_mut();
        if st.blocked == blocked || (blocked && !st.published) {
            return;
        }
        st.blocked = blocked;
        let notify = st.blocked_notify;
        drop(st);
        if blocked {
            tracing::info!(conn = self.id, "connection blocked: disk alarm");
        } else {
            let _ = self.unblocked.try_send(());
        }
        if notify {
            let m = if blocked {
                AMQPClass::Connection(conn::AMQPMethod::Blocked(conn::Blocked { reason: "low on disk space".into() }))
            } else {
                AMQPClass::Connection(conn::AMQPMethod::Unblocked(conn::Unblocked {}))
            };
            match out {
                Some(out) => encode_method(out, 0, &m),
                None => self.send_method(0, &m),
            }
        }
    }

    /// Returns once the connection is not blocked by the disk alarm (or is closing).
    async fn wait_unblocked(&self) {
        for _ in 0..u64::MAX {
            {
                let st = self.st.borrow();
                if !st.blocked || st.finish || st.closing.is_some() {
                    return;
                }
            }
            let _ = self.unblocked_rx.recv_async().await;
        }
    }

    fn on_error(&self, channel: u16, e: AmqpError) -> Result<(), AmqpError> {
        match e.scope {
            Scope::Connection => Err(e),
            Scope::Channel => {
                self.fail_channel(channel, e, None);
                Ok(())
            }
        }
    }

    async fn on_method(self: &Rc<Self>, channel: u16, method: AMQPClass) -> Result<(), AmqpError> {
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        {
            let st = self.st.borrow();
            match st.channels.get(&channel) {
                None => {
                    drop(st);
                    return match method {
                        AMQPClass::Channel(chan::AMQPMethod::Open(_)) => methods::channel::open(self, channel),
                        // A close-ok for a channel we already forgot is harmless.
                        AMQPClass::Channel(chan::AMQPMethod::CloseOk(_)) => Ok(()),
                        _ => Err(AmqpError::channel_error(format!("expecting 'channel.open' for channel {channel}"))
                            .on_method(class_id, method_id)),
                    };
                }
                Some(c) if c.state == ChannelState::Closing => {
                    drop(st);
                    return match method {
                        AMQPClass::Channel(chan::AMQPMethod::CloseOk(_)) => {
                            self.st.borrow_mut().channels.remove(&channel);
                            Ok(())
                        }
                        AMQPClass::Channel(chan::AMQPMethod::Close(_)) => {
                            self.st.borrow_mut().channels.remove(&channel);
                            self.send_method(channel, &AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})));
                            Ok(())
                        }
                        _ => Ok(()),
                    };
                }
                Some(c) if c.publish.is_some() => {
                    return Err(AmqpError::unexpected_frame(format!(
                        "method frame on channel {channel} while content of basic.publish was expected"
                    ))
                    .on_method(class_id, method_id));
                }
                Some(_) => {}
            }
        }
        let r = match method {
            AMQPClass::Channel(m) => methods::channel::handle(self, channel, m).await,
            AMQPClass::Exchange(m) => methods::exchange::handle(self, channel, m).await,
            AMQPClass::Queue(m) => methods::queue::handle(self, channel, m).await,
            AMQPClass::Basic(m) => methods::basic::handle(self, channel, m).await,
            AMQPClass::Confirm(m) => methods::confirm::handle(self, channel, m),
            AMQPClass::Tx(m) => methods::tx::handle(self, channel, m),
            AMQPClass::Access(_) => {
                self.send_method(
                    channel,
                    &AMQPClass::Access(amq_protocol::protocol::access::AMQPMethod::RequestOk(amq_protocol::protocol::access::RequestOk {})),
                );
                Ok(())
            }
            AMQPClass::Connection(_) => Err(AmqpError::command_invalid("connection method on a non-zero channel")),
        };
        match r {
            Ok(()) => Ok(()),
            Err(mut e) => {
                if e.class_id == 0 {
                    e = e.on_method(class_id, method_id);
                }
                self.on_error(channel, e)
            }
        }
    }

    /// Writer side: turns one event into frames.
    fn on_event(&self, ev: ClientEvent, out: &mut Vec<u8>) {
        match ev {
            ClientEvent::Frames(f) => out.extend_from_slice(&f),
            ClientEvent::Deliver(d) => {
                let mut st = self.st.borrow_mut();
                let frame_max = st.frame_max;
                let Some(c) = st.channels.get_mut(&d.channel).filter(|c| c.uid == d.chan_uid && c.state == ChannelState::Open) else {
                    // The channel is gone; its ChannelClosed requeues this delivery.
                    return;
                };
                let tag = c.take_tag();
                if d.track {
                    c.ledger.insert(tag, Unacked { queue: d.queue, offset: d.offset });
                }
                let (exchange, rk, props) = split_header(&d.message.header);
                codec::encode_deliver(out, d.channel, &d.consumer_tag, tag, d.redelivered, exchange, rk);
                codec::encode_content(out, d.channel, props, &d.message.body, frame_max);
                Stats::add(&self.core.stats().delivered, 1);
            }
            ClientEvent::ConsumeOk { channel, consumer_tag } => {
                if self.channel_open(channel) {
                    encode_method(
                        out,
                        channel,
                        &AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk { consumer_tag: consumer_tag.as_ref().into() })),
                    );
                }
            }
            ClientEvent::CancelOk { channel, consumer_tag } => {
                if self.channel_open(channel) {
                    encode_method(
                        out,
                        channel,
                        &AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk { consumer_tag: consumer_tag.as_ref().into() })),
                    );
                }
            }
            ClientEvent::Cancelled { channel, consumer_tag } => {
                let mut st = self.st.borrow_mut();
                if let Some(c) = st.channels.get_mut(&channel).filter(|c| c.state == ChannelState::Open) {
                    if c.consumers.remove(&consumer_tag).is_some() {
                        encode_method(
                            out,
                            channel,
                            &AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                                consumer_tag: consumer_tag.as_ref().into(),
                                nowait: true,
                            })),
                        );
                    }
                }
            }
            ClientEvent::Stored { channel, seq, ok } => {
                let mut st = self.st.borrow_mut();
                let done = st.channels.get_mut(&channel).and_then(|c| c.confirms.stored(seq, ok));
                if let Some(ok) = done {
                    st.confirms_ready.push((channel, seq, ok));
                }
            }
            ClientEvent::AckTimeout { channel, chan_uid, timeout_ms } => {
                let matches = self.st.borrow().channels.get(&channel).is_some_and(|c| c.uid == chan_uid);
                if matches {
                    self.fail_channel(
                        channel,
                        AmqpError::precondition_failed(format!(
                            "delivery acknowledgement on channel {channel} timed out. Timeout value used: {timeout_ms} ms"
                        )),
                        Some(out),
                    );
                }
            }
            ClientEvent::Shutdown => {
                let e = AmqpError::connection_forced("broker shutdown");
                let mut st = self.st.borrow_mut();
                if st.closing.is_none() && !st.finish {
                    st.closing = Some(Instant::now() + CLOSE_WAIT);
                    drop(st);
                    encode_method(out, 0, &close_method(&e));
                    // A blocked reader must see the close-ok.
                    let _ = self.unblocked.try_send(());
                }
            }
            ClientEvent::DiskAlarm(raised) => self.set_blocked(raised, Some(out)),
        }
    }

    fn channel_open(&self, channel: u16) -> bool {
        self.st.borrow().channels.get(&channel).is_some_and(|c| c.state == ChannelState::Open)
    }

    /// Writes the publisher confirms completed in this batch: one basic.ack with
    /// multiple=true for every completed publish below the lowest one still pending,
    /// single acks above it, and single nacks.
    fn flush_confirms(&self, out: &mut Vec<u8>) {
        let mut st = self.st.borrow_mut();
        if st.confirms_ready.is_empty() {
            return;
        }
        let mut ready = std::mem::take(&mut st.confirms_ready);
        ready.sort_unstable();
        let mut i = 0;
        let mut n = 0u64;
        while i < ready.len() {
            let ch = ready[i].0;
            let j = ready[i..].iter().position(|r| r.0 != ch).map_or(ready.len(), |k| i + k);
            let group = &ready[i..j];
            let low = st.channels.get(&ch).and_then(|c| c.confirms.lowest_pending());
            let any_nack = group.iter().any(|r| !r.2);
            let below: Vec<u64> = group.iter().filter(|r| r.2 && !any_nack && low.is_none_or(|l| r.1 < l)).map(|r| r.1).collect();
            if let Some(&max) = below.last() {
                let multiple = below.len() > 1;
                encode_method(out, ch, &AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack { delivery_tag: max, multiple })));
            }
            for &(_, seq, ok) in group {
                if below.contains(&seq) {
                    continue;
                }
                let m = if ok {
                    basic::AMQPMethod::Ack(basic::Ack { delivery_tag: seq, multiple: false })
                } else {
                    basic::AMQPMethod::Nack(basic::Nack { delivery_tag: seq, multiple: false, requeue: false })
                };
                encode_method(out, ch, &AMQPClass::Basic(m));
            }
            n += group.len() as u64;
            i = j;
        }
        Stats::add(&self.core.stats().confirmed, n);
    }
}

/// Marks a channel closed for the queues: returns its uid and every queue it touched.
pub fn close_effects(c: &mut Channel) -> (u64, Vec<QueueRef>) {
    c.publish = None;
    c.consumers.clear();
    let _ = c.ledger.drain();
    (c.uid, c.touched.drain().collect())
}
