//! A connection's state and its reader half.
//!
//! Holds [`Session`] (what methods and queues see of a connection) with its mutable
//! [`ConnState`], the reader loop, the blocked/unblocked state of the resource alarms, error
//! reporting, and channel/connection teardown.
//!
//! Invariants:
//! - `Session::st` is never borrowed across an `.await`.
//! - A connection error is reported once: after connection.close only close-ok (or
//!   close) is acted upon, for at most [`CLOSE_WAIT`] (spec 1.4.2.9, 2.2.4).
//! - A channel error closes only that channel (spec 1.5.2.5): its deliveries are
//!   requeued and its consumers cancelled at once, and frames for it are dropped until
//!   channel.close-ok.
//! - While blocked by a resource alarm (memory, disk) the reader starts nothing: it takes no
//!   method frame, not even from its buffer, and reads the socket only to finish the content
//!   of a basic.publish already begun (RabbitMQ's `connection.blocked` extension; a message
//!   held half-received would keep its memory for the whole alarm); closing always wakes it.
//! - Flow control: the reader takes no frame while the connection's publish credit is used up
//!   (`broker::credit`); queues give it back as they take the messages.
//! - Every channel still open when the connection ends is closed for its queues, and the
//!   connection's exclusive queues are deleted (spec 1.7.2.1 `exclusive`).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{channel as chan, connection as conn, AMQPClass};
use bytes::BytesMut;
use futures_lite::io::AsyncReadExt;

use super::handshake::close_method;
use super::CLOSE_WAIT;
use crate::amqp::channel::{Channel, ChannelState};
use crate::amqp::codec::{decode_frame, encode_method};
use crate::amqp::error::AmqpError;
use crate::broker::node::Node;
use crate::broker::{ClientEvent, ClientTx, ConnId, QueueOp, QueueRef};

/// Mutable state of a connection.
pub struct ConnState {
    /// Virtual host opened.
    pub vhost: Arc<str>,
    /// Logged-in user.
    pub user: String,
    /// The client connected from a loopback address.
    pub loopback: bool,
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
    /// basic.qos(global=false) limits the channel at once, as the spec reads it
    /// (`handshake::spec_qos_client`: py-amqp, so kombu and Celery); else RabbitMQ's reading.
    pub spec_qos: bool,
    /// The server sent connection.close and waits for close-ok (until this instant).
    pub closing: Option<Instant>,
    /// The writer should flush what it has and end the connection.
    pub finish: bool,
    /// The client closed the connection (connection.close, answered close-ok): as RabbitMQ,
    /// the socket is left for the client to close first (the reader reads to its EOF), for
    /// at most [`CLOSE_WAIT`], so a client does not read EOF where it waits for close-ok.
    pub linger: bool,
    /// The reader ended (the client's EOF, a read error, missed heartbeats): nothing more
    /// comes in; the writer flushes what is queued and ends the connection.
    pub peer_gone: bool,
    /// Exclusive queues declared by this connection.
    pub exclusive_queues: Vec<QueueRef>,
    /// Names of the queues (in this connection's vhost) a queue.delete of this connection is
    /// deleting, delete-ok not yet sent: the basic.cancel of their consumers on this
    /// connection waits in `held_cancels` until it is, so the client reads queue.delete-ok
    /// first, as RabbitMQ sends them (`methods::queue`).
    pub deleting: Vec<crate::broker::QueueName>,
    /// basic.cancel notices held back by `deleting`: (channel, consumer tag, queue name).
    pub held_cancels: Vec<(u16, crate::broker::ConsumerTag, crate::broker::QueueName)>,
    /// Completed publisher confirms to send: (channel, seq, ok).
    pub confirms_ready: Vec<(u16, u64, bool)>,
    /// A confirm-mode publish may be waiting for its answer: the writer reads the channels'
    /// publish clocks (`Confirms::mark`) while it is set, and clears it when none waits. Set
    /// by the reader (with a wake-up for an idle writer) when it finds it clear.
    pub confirm_clock: bool,
    /// The client announced the `connection.blocked` capability.
    pub blocked_notify: bool,
    /// This connection has sent basic.publish: a resource alarm blocks it.
    pub published: bool,
    /// Blocked by a resource alarm: the reader takes no more frames until it clears.
    pub blocked: bool,
    /// The user's permissions in the vhost, compiled (`broker::access::Grant`): every
    /// permission check of this connection reads it.
    pub grant: crate::broker::access::Grant,
    /// Where its publishes go, and whether it is moving to that core (`handoff`).
    pub handoff: super::handoff::Handoff,
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
    /// Publish credit: bytes of publishes queues have not yet taken (`broker::credit`); the
    /// reader takes no frame while it is used up.
    pub credit: std::sync::Arc<crate::broker::credit::PublishCredit>,
    /// Mutable state (never borrowed across an `.await`).
    pub st: RefCell<ConnState>,
    /// Wakes the reader when the connection is unblocked (or closing).
    pub(super) unblocked: flume::Sender<()>,
    pub(super) unblocked_rx: flume::Receiver<()>,
    /// Its transport can be handed to another core (a plain socket; not TLS).
    pub(super) movable: bool,
}

/// Bytes of the first read of a connection's socket, and of its largest (see [`reader`]).
const READ_MIN: usize = 4 * 1024;
const READ_MAX: usize = 64 * 1024;

/// How the reader half ended.
pub(super) enum ReaderEnd {
    /// The client's EOF, a read error, missed heartbeats, or the connection finished.
    Closed,
    /// The connection moves to another core (`handoff`): the bytes read and not yet taken.
    Move(BytesMut),
}

/// The reader half: frames from the socket, carried out one by one.
pub(super) async fn reader<R: futures_lite::AsyncRead + Unpin>(s: Rc<Session>, mut r: R, mut buf: BytesMut) -> ReaderEnd {
    // Holders of the session when nothing else runs for this connection (`handoff`).
    let holders = Rc::strong_count(&s);
    // Reads start at 4 KiB and double (to 64 KiB) while they fill it: an idle connection
    // keeps 4 KiB here instead of 64 (10,000 connections: 600 MB less resident).
    let mut tmp = vec![0u8; READ_MIN];
    loop {
        loop {
            // Blocked by a resource alarm: take no frame that starts anything, not even from
            // the buffer, until unblocked (the socket is not read either, so the client's TCP
            // window closes). Content frames of a message already begun are taken: its body
            // goes to the store instead of staying in memory for the whole alarm.
            if !continues_content(&buf) {
                s.wait_unblocked().await;
            }
            // Flow control: queues have not taken what this connection published yet.
            s.credit.wait().await;
            let frame_max = s.st.borrow().frame_max;
            match decode_frame(&mut buf, frame_max) {
                Ok(Some(frame)) => {
                    let done = match s.on_frame_now(frame) {
                        Ok(Some(frame)) => s.on_frame(frame).await,
                        other => other.map(|_| ()),
                    };
                    if let Err(e) = done {
                        s.fail(e);
                    }
                    if s.st.borrow().finish {
                        break;
                    }
                    if s.st.borrow().handoff.due() && s.start_move(holders) {
                        return ReaderEnd::Move(buf);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    // The stream can no longer be framed: report it (spec 4.2.3) and read on,
                    // dropping what comes, until the client closes or the writer's close
                    // wait ends the connection. Closing with unread bytes would send the
                    // client a reset that can destroy the connection.close before it reads it.
                    s.fail(e);
                    loop {
                        match r.read(&mut tmp).await {
                            Ok(0) | Err(_) => return ReaderEnd::Closed,
                            Ok(_) => {}
                        }
                    }
                }
            }
        }
        if s.st.borrow().finish {
            if s.st.borrow().linger {
                // After close-ok: what the client still sends is dropped until it closes the
                // socket (then the connection ends) or the writer's linger runs out.
                loop {
                    match r.read(&mut tmp).await {
                        Ok(0) | Err(_) => return ReaderEnd::Closed,
                        Ok(_) => {}
                    }
                }
            }
            // The writer flushes and ends the connection.
            std::future::pending::<()>().await;
        }
        if s.st.borrow().blocked && !s.content_in_progress() {
            s.wait_unblocked().await;
        }
        match r.read(&mut tmp).await {
            Ok(0) => return ReaderEnd::Closed,
            Ok(n) => {
                buf.extend_from_slice(&tmp[..n]);
                if n == tmp.len() && n < READ_MAX {
                    tmp = vec![0u8; n * 2];
                }
            }
            Err(e) => {
                if e.kind() == std::io::ErrorKind::TimedOut {
                    tracing::info!(conn = %s.id, "missed heartbeats from client, closing TCP connection");
                }
                return ReaderEnd::Closed;
            }
        }
    }
}

/// Whether the next frame in `buf` is a content header or body frame (spec 4.2.3: frame types
/// 2 and 3), which can only continue a basic.publish already taken.
fn continues_content(buf: &[u8]) -> bool {
    matches!(buf.first(), Some(2 | 3))
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

    /// The reader ended: the writer flushes what is queued and ends the connection without
    /// lingering for the client's EOF (it came).
    pub(super) fn peer_gone(&self) {
        let mut st = self.st.borrow_mut();
        st.peer_gone = true;
        st.finish = true;
        drop(st);
        self.send_frames(Vec::new());
    }

    /// The vhost of this connection.
    pub fn vhost(&self) -> Arc<str> {
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
        tracing::debug!(conn = %self.id, error = %e, "connection error");
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
        tracing::debug!(conn = %self.id, channel = ch, error = %e, "channel error");
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
    /// drop its consumers), and ends its direct reply-to consumer.
    pub fn apply_close_effects(&self, effects: CloseEffects) {
        if let Some(token) = effects.reply_token {
            self.core.shared.reply_to.unregister(token);
        }
        for q in effects.queues {
            self.queue_send(&q, QueueOp::ChannelClosed { chan_uid: effects.uid });
        }
    }

    /// Closes every channel (requeueing what they hold) and deletes the connection's
    /// exclusive queues; returns the replies of those deletions and the queues the channels
    /// touched (each told `ChannelClosed`).
    fn close_all(&self) -> (Vec<flume::Receiver<Result<u32, crate::broker::QueueError>>>, Vec<QueueRef>) {
        let mut st = self.st.borrow_mut();
        let channels: Vec<Channel> = st.channels.drain().map(|(_, c)| c).collect();
        let exclusive = std::mem::take(&mut st.exclusive_queues);
        drop(st);
        let mut touched: Vec<QueueRef> = Vec::new();
        for mut c in channels {
            if c.state == ChannelState::Open {
                let effects = close_effects(&mut c);
                for q in &effects.queues {
                    if !touched.iter().any(|t| t.key == q.key) {
                        touched.push(q.clone());
                    }
                }
                self.apply_close_effects(effects);
            }
        }
        let mut replies = Vec::new();
        for q in exclusive {
            let (reply, rx) = crate::broker::reply_channel();
            self.queue_send(&q, QueueOp::Delete { if_unused: false, if_empty: false, reply });
            replies.push(rx);
        }
        (replies, touched)
    }

    /// [`Session::close_all`], waiting (at most 2 s in all) until the exclusive queues are
    /// deleted and every touched queue has carried out its `ChannelClosed` (a `Stats` sent
    /// after it is answered): by connection.close-ok, as in RabbitMQ, the deliveries are
    /// requeued and an auto-delete queue that lost its last consumer is going, so a client
    /// that redeclares it next finds it gone rather than about to go.
    pub(super) async fn release(&self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        let (deleted, touched) = self.close_all();
        for rx in deleted {
            bounded_wait(deadline, rx.recv_async()).await;
        }
        self.await_queues(&touched, deadline).await;
    }

    /// [`Session::apply_close_effects`] for a channel the client closed, then waits (at most
    /// 2 s) until each queue has carried out its `ChannelClosed`: as RabbitMQ, by
    /// channel.close-ok the channel's unacknowledged deliveries are requeued, so a basic.get
    /// on another channel right after finds them (aio-pika's `test_no_ack_redelivery`).
    pub async fn apply_close_effects_and_wait(&self, effects: CloseEffects) {
        let queues = effects.queues.clone();
        self.apply_close_effects(effects);
        self.await_queues(&queues, Instant::now() + Duration::from_secs(2)).await;
    }

    /// Waits until `deadline` at the latest for each queue to carry out what this connection
    /// sent it before, and for a queue that then deleted itself (auto-delete, its last
    /// consumer gone) to leave the metadata. Two rounds of `Stats`: a queue answers in the
    /// order it takes operations from this core, and the delete it sends itself on the way
    /// (through its core's inbox) is taken before the second round (through that inbox too),
    /// which it answers 404 (RabbitMQ deletes such a queue,
    /// and an auto-delete exchange that loses its last binding with it, before close-ok).
    async fn await_queues(&self, queues: &[QueueRef], deadline: Instant) {
        let mut going = Vec::new();
        for round in 0..2 {
            let answers: Vec<_> = queues
                .iter()
                .map(|q| {
                    let (reply, rx) = crate::broker::reply_channel();
                    if round == 0 {
                        self.queue_send(q, QueueOp::Stats { reply });
                    } else {
                        // Through the owner core's inbox even when it is this core: behind
                        // the delete the queue sent itself there.
                        crate::broker::Mesh::send(&*self.core, q, QueueOp::Stats { reply });
                    }
                    rx
                })
                .collect();
            for (q, rx) in queues.iter().zip(answers) {
                let left = deadline.saturating_duration_since(Instant::now());
                let answer = futures_lite::future::or(async { rx.recv_async().await.ok() }, async {
                    glommio::timer::sleep(left).await;
                    None
                })
                .await;
                if round == 1 && matches!(answer, Some(Err(crate::broker::QueueError::NotFound(_)))) {
                    going.push(q);
                }
            }
        }
        for q in going {
            let (vhost, name) = (q.key.vhost.to_string(), q.key.name.to_string());
            while self.core.router().queue_ref(&vhost, &name).is_some() && Instant::now() < deadline {
                glommio::timer::sleep(Duration::from_millis(2)).await;
            }
        }
    }

    pub(super) fn teardown(&self) {
        let _ = self.close_all();
    }

    /// Blocks (a resource alarm was raised, and this connection publishes) or unblocks it:
    /// connection.blocked / connection.unblocked to a client that announced the capability
    /// (RabbitMQ's reason text), and the reader stops or goes on. Into `out` when the
    /// writer calls it, else through the event channel.
    pub(super) fn set_blocked(&self, blocked: bool, out: Option<&mut Vec<u8>>) {
        let mut st = self.st.borrow_mut();
        // A raise that is already over (the alarm cleared before this connection saw it) is
        // stale: its clear follows.
        if st.blocked == blocked || (blocked && (!st.published || !self.core.shared.alarms.publishers_blocked())) {
            return;
        }
        st.blocked = blocked;
        let notify = st.blocked_notify;
        drop(st);
        let reason = self.core.shared.alarms.block_reason();
        if blocked {
            tracing::info!(conn = %self.id, reason, "connection blocked by a resource alarm");
        } else {
            let _ = self.unblocked.try_send(());
        }
        if notify {
            let m = if blocked {
                AMQPClass::Connection(conn::AMQPMethod::Blocked(conn::Blocked { reason: reason.into() }))
            } else {
                AMQPClass::Connection(conn::AMQPMethod::Unblocked(conn::Unblocked {}))
            };
            match out {
                Some(out) => encode_method(out, 0, &m),
                None => self.send_method(0, &m),
            }
        }
    }

    /// True while some channel has a basic.publish whose content is not complete.
    fn content_in_progress(&self) -> bool {
        self.st.borrow().channels.values().any(|c| c.publish.is_some())
    }

    /// Returns once the connection is not blocked by a resource alarm (or is closing).
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
}

/// What closing a channel leaves to do outside it ([`Session::apply_close_effects`]).
pub struct CloseEffects {
    /// The channel's incarnation.
    uid: u64,
    /// Every queue it consumed or got from.
    queues: Vec<QueueRef>,
    /// Its direct reply-to consumer's token (`broker::reply_to`).
    reply_token: Option<u64>,
}

/// Marks a channel closed: returns what its queues and the reply-to registry must be told.
pub fn close_effects(c: &mut Channel) -> CloseEffects {
    c.publish = None;
    // An open transaction is discarded (crate::amqp::transaction rule 5).
    c.tx = None;
    c.consumers.clear();
    let _ = c.ledger.drain();
    CloseEffects { uid: c.uid, queues: c.touched.drain().collect(), reply_token: c.reply_to.take().map(|r| r.token) }
}

/// Awaits `f` until `deadline` at the latest.
async fn bounded_wait<T>(deadline: Instant, f: impl std::future::Future<Output = T>) {
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = futures_lite::future::or(async { Some(f.await) }, async {
        glommio::timer::sleep(left).await;
        None
    })
    .await;
}
