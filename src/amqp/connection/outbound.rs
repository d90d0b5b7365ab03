//! The writer half of a connection: [`ClientEvent`]s (from the reader and from queues on
//! any core) become frames, written once per batch.
//!
//! Each batch is one blocking receive plus up to `crate::core::BATCH` more, then the
//! batch's publisher confirms, then one socket write. Heartbeats (spec 4.2.7) go out when
//! nothing was written for half the negotiated interval.
//!
//! Invariants:
//! - Events are written in arrival order; a delivery gets its tag here, as it is encoded
//!   (`tags`, spec 1.8.3.9), so tags reach the client in the order they were assigned
//!   among deliveries.
//! - Frames for a channel that is closing or gone are dropped (spec 1.5.2.5); a dropped
//!   delivery is requeued by its queue on `ChannelClosed`.
//! - Confirms completed in a batch are written in that batch, after its other frames
//!   (`confirms`), so a basic.return always precedes its publish's confirm.
//! - A delivery's bytes leave `Session::pending_bytes` once written or dropped.

use std::rc::Rc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{basic, tx, AMQPClass};
use futures_lite::io::AsyncWriteExt;

use super::handshake::close_method;
use super::session::ConnState;
use super::{confirms, tags, Session, CLOSE_WAIT};
use crate::amqp::channel::{ChannelState, CONFIRM_LIMIT, MARK_EVERY};
use crate::amqp::codec::{self, encode_heartbeat, encode_method};
use crate::amqp::error::AmqpError;
use crate::amqp::unacked::Unacked;
use crate::broker::{ChannelId, ClientEvent, ConsumerTag};
use crate::observe::Stats;

/// How the writer half ended.
pub(super) enum WriterEnd {
    /// The connection ended (or its socket failed).
    Ended,
    /// It wrote what it had and stopped for a move to another core (`handoff`).
    Paused,
}

/// The writer half: drains the event channel into the socket until the connection ends or
/// moves. `flush`: the transport buffers writes (TLS), so each batch is flushed once written.
pub(super) async fn writer<W: futures_lite::AsyncWrite + Unpin>(
    s: Rc<Session>,
    rx: flume::Receiver<ClientEvent>,
    mut w: W,
    flush: bool,
) -> WriterEnd {
    // Grows with the batches it carries (a burst of deliveries) and keeps what it grew to up
    // to 4 MiB; an idle connection holds 4 KiB here (10,000 connections: 600 MB less).
    let mut out: Vec<u8> = Vec::with_capacity(4 * 1024);
    let hb = s.st.borrow().heartbeat;
    let mut last_write = Instant::now();
    // The last look at the publishes waiting for their confirms, and whether any waited.
    // (A connection that moved here may hold some: it looks at once.)
    let (mut last_check, mut confirms_waiting) = (last_write, s.st.borrow().confirm_clock);
    loop {
        let closing = s.st.borrow().closing;
        let mut wait: Option<Duration> = None;
        if hb > 0 {
            wait = Some((last_write + Duration::from_millis(hb as u64 * 500)).saturating_duration_since(Instant::now()));
        }
        if confirms_waiting {
            let d = (last_check + MARK_EVERY).saturating_duration_since(Instant::now());
            wait = Some(wait.map_or(d, |w| w.min(d)));
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
        let armed = s.st.borrow().confirm_clock;
        if armed {
            let now = Instant::now();
            if !confirms_waiting || now.duration_since(last_check) >= MARK_EVERY {
                last_check = now;
                confirms_waiting = s.give_up_overdue(now);
                s.st.borrow_mut().confirm_clock = confirms_waiting;
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
            if w.write_all(&out).await.is_err() || (flush && w.flush().await.is_err()) {
                return WriterEnd::Ended;
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
            // Whatever was queued before the end goes out too (the replies to a burst of
            // methods, then connection.close-ok), bounded by what is queued now and by
            // CLOSE_WAIT for a peer that stopped reading.
            for _ in 0..rx.len() {
                let Ok(ev) = rx.try_recv() else { break };
                s.on_event(ev, &mut out);
            }
            s.flush_confirms(&mut out);
            let _ = futures_lite::future::or(
                async {
                    if !out.is_empty() {
                        let _ = w.write_all(&out).await;
                    }
                    let _ = w.flush().await;
                },
                glommio::timer::sleep(CLOSE_WAIT),
            )
            .await;
            // After the client's connection.close: wait for its EOF (the reader reports it
            // through `peer_gone`), at most CLOSE_WAIT.
            let deadline = Instant::now() + CLOSE_WAIT;
            while s.st.borrow().linger && !s.st.borrow().peer_gone {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let _ = futures_lite::future::or(async { rx.recv_async().await.ok().map(drop) }, async {
                    glommio::timer::sleep(left).await;
                    None
                })
                .await;
            }
            let _ = w.close().await;
            return WriterEnd::Ended;
        }
        if s.st.borrow().handoff.pausing() {
            // What is still queued goes out on the new core.
            return WriterEnd::Paused;
        }
    }
}

/// For a sampled delivery (`taken` set), records its `taken_to_written` and returns the
/// moment it was written (its frames go out in this batch's socket write; a wait for room
/// in the socket of a client that does not read counts as the client's time).
fn sampled_write(s: &Session, taken: Option<Instant>) -> Option<Instant> {
    let taken = taken?;
    let now = Instant::now();
    s.core.stats().stages.record(crate::observe::Stage::TakenToWritten, now.duration_since(taken));
    Some(now)
}

/// What a delivery event weighs in `Session::pending_bytes` (added by its queue).
fn delivery_bytes(ev: &ClientEvent) -> usize {
    match ev {
        ClientEvent::Deliver(d) => crate::broker::queue::consumer::pending_weight(d.message.body.len()),
        ClientEvent::Deliveries(b) => b.items.iter().map(|(_, _, m, _)| crate::broker::queue::consumer::pending_weight(m.body.len())).sum(),
        _ => 0,
    }
}

impl Session {
    /// Writer side: turns one event into frames.
    fn on_event(&self, ev: ClientEvent, out: &mut Vec<u8>) {
        match ev {
            ClientEvent::Frames(f) => out.extend_from_slice(&f),
            ClientEvent::Deliver(d) => {
                let mut st = self.st.borrow_mut();
                let frame_max = st.frame_max;
                self.delivered_from(&mut st, &d.queue, 1);
                let written = sampled_write(self, d.taken);
                let unacked = d.track.then_some(Unacked { queue: d.queue, offset: d.offset, written });
                let Some(tag) = tags::assign_delivery_tag(&mut st.channels, d.channel.0, d.chan_uid, unacked) else {
                    // The channel is gone; its ChannelClosed requeues this delivery.
                    return;
                };
                let (exchange, rk, props) = d.message.wire_parts();
                codec::encode_deliver(out, d.channel.0, &d.consumer_tag, tag.0, d.redelivered, exchange, rk);
                codec::encode_content(out, d.channel.0, props, &d.message.body, frame_max);
                let stats = self.core.stats();
                Stats::add(&stats.delivered, 1);
                Stats::add(if d.track { &stats.delivered_consume_manual_ack } else { &stats.delivered_consume_auto_ack }, 1);
                Stats::add(&stats.redelivered, d.redelivered as u64);
            }
            ClientEvent::Deliveries(b) => {
                let mut st = self.st.borrow_mut();
                self.delivered_from(&mut st, &b.queue, b.items.len() as u32);
                let frame_max = st.frame_max;
                let (mut n, mut again) = (0, 0);
                for (offset, redelivered, message, taken) in &b.items {
                    let written = sampled_write(self, *taken);
                    let unacked = b.track.then(|| Unacked { queue: b.queue.clone(), offset: *offset, written });
                    let Some(tag) = tags::assign_delivery_tag(&mut st.channels, b.channel.0, b.chan_uid, unacked) else {
                        // The channel is gone; its ChannelClosed requeues these deliveries.
                        break;
                    };
                    let (exchange, rk, props) = message.wire_parts();
                    codec::encode_deliver(out, b.channel.0, &b.consumer_tag, tag.0, *redelivered, exchange, rk);
                    codec::encode_content(out, b.channel.0, props, &message.body, frame_max);
                    n += 1;
                    again += *redelivered as u64;
                }
                let stats = self.core.stats();
                Stats::add(&stats.delivered, n);
                Stats::add(if b.track { &stats.delivered_consume_manual_ack } else { &stats.delivered_consume_auto_ack }, n);
                Stats::add(&stats.redelivered, again);
            }
            ClientEvent::ConsumeOk { channel: ChannelId(channel), consumer_tag } => {
                if self.channel_open(channel) {
                    encode_method(
                        out,
                        channel,
                        &AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk { consumer_tag: consumer_tag.as_str().into() })),
                    );
                }
            }
            ClientEvent::CancelOk { channel: ChannelId(channel), consumer_tag } => {
                if self.channel_open(channel) {
                    encode_method(
                        out,
                        channel,
                        &AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk { consumer_tag: consumer_tag.as_str().into() })),
                    );
                }
            }
            ClientEvent::Cancelled { channel: ChannelId(channel), consumer_tag } => {
                let mut st = self.st.borrow_mut();
                let st = &mut *st;
                let queue =
                    st.channels.get(&channel).and_then(|c| c.consumers.get(consumer_tag.as_str())).map(|c| c.queue.key.name.clone());
                match queue.filter(|q| st.deleting.contains(q)) {
                    // This connection is deleting the queue: its delete-ok goes first.
                    Some(queue) => st.held_cancels.push((channel, consumer_tag, queue)),
                    None => write_cancel(st, out, channel, &consumer_tag),
                }
            }
            ClientEvent::Deleted { frames, queue } => {
                out.extend_from_slice(&frames);
                let mut st = self.st.borrow_mut();
                let st = &mut *st;
                if let Some(i) = st.deleting.iter().position(|q| *q == queue) {
                    st.deleting.swap_remove(i);
                }
                if !st.deleting.contains(&queue) {
                    let (held, kept): (Vec<_>, Vec<_>) =
                        std::mem::take(&mut st.held_cancels).into_iter().partition(|(_, _, q)| *q == queue);
                    st.held_cancels = kept;
                    for (channel, tag, _) in held {
                        write_cancel(st, out, channel, &tag);
                    }
                }
            }
            ClientEvent::Stored { channel: ChannelId(channel), chan_uid, seq, ok } => {
                let mut st = self.st.borrow_mut();
                // Only the incarnation that published, and only while it is open (DESIGN.md
                // rule 9: a confirm names a stored message of this channel, never one of a
                // channel closed since; spec 1.5.2.5: nothing follows a channel.close).
                let Some(c) = st.channels.get_mut(&channel).filter(|c| c.uid == chan_uid && c.state == ChannelState::Open) else {
                    return;
                };
                let Some(ok) = c.confirms.stored(seq, ok) else { return };
                let low = c.confirms.lowest_pending();
                let sampled = c.confirms.take_sample(seq);
                match c.tx.as_mut() {
                    None => {
                        // Its confirm is encoded in this batch (`flush_confirms`).
                        if let Some(at) = sampled {
                            self.core.stats().stages.record(crate::observe::Stage::PublishToConfirmed, at.elapsed());
                        }
                        st.confirms_ready.push((channel, seq, ok))
                    }
                    // A transactional channel: the commits this answer completes.
                    Some(tx) => {
                        let done = tx.stored(seq, ok, low);
                        drop(st);
                        for ok in done {
                            if !ok {
                                self.fail_channel(channel, crate::amqp::methods::tx::partial_completion(), Some(out));
                                break;
                            }
                            encode_method(out, channel, &AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})));
                        }
                    }
                }
            }
            ClientEvent::AckTimeout { channel: ChannelId(channel), chan_uid, timeout_ms } => {
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
            ClientEvent::Describe(reply) => drop(reply.send(self.describe())),
            // `methods::basic::publish` waking an idle writer to start the publish clock (a peer's
            // credit announcement never comes here).
            ClientEvent::PublishesTaken => {}
            ClientEvent::Shutdown | ClientEvent::Close(_) => {
                let e = match ev {
                    ClientEvent::Close(reason) => AmqpError::connection_forced(reason),
                    _ => AmqpError::connection_forced("broker shutdown"),
                };
                let mut st = self.st.borrow_mut();
                if st.closing.is_none() && !st.finish {
                    st.closing = Some(Instant::now() + CLOSE_WAIT);
                    drop(st);
                    encode_method(out, 0, &close_method(&e));
                    // A blocked reader must see the close-ok.
                    let _ = self.unblocked.try_send(());
                }
            }
            ClientEvent::ResourceAlarm(raised) => self.set_blocked(raised, Some(out)),
        }
    }

    /// This connection's channels for the management API ([`ClientEvent::Describe`]).
    fn describe(&self) -> crate::broker::clients::ConnDescription {
        let st = self.st.borrow();
        let mut channels: Vec<_> = st
            .channels
            .values()
            .map(|c| crate::broker::clients::ChannelDescription {
                number: c.id,
                confirm: c.confirms.enabled,
                transactional: c.tx.is_some(),
                prefetch: c.prefetch,
                consumers: c.consumers.iter().map(|(tag, cc)| (tag.to_string(), cc.queue.key.clone())).collect(),
                unacked: c.ledger.iter().map(|(tag, u)| (tag.0, u.queue.key.clone(), u.offset.0)).collect(),
            })
            .collect();
        channels.sort_by_key(|c| c.number);
        let state = if st.blocked {
            "blocked"
        } else if self.credit.exhausted() {
            "flow"
        } else if self.core.shared.alarms.publishers_blocked() {
            "blocking"
        } else {
            "running"
        };
        crate::broker::clients::ConnDescription { channels, state }
    }

    fn channel_open(&self, channel: u16) -> bool {
        self.st.borrow().channels.get(&channel).is_some_and(|c| c.state == ChannelState::Open)
    }

    /// Reads the publish clock of every confirming channel and nacks each publish that has
    /// waited [`CONFIRM_LIMIT`] without an answer (a queue that never answers, a link that
    /// flaps, a node paused): a publisher is always answered. Returns whether publishes still
    /// wait (the writer then looks again within [`MARK_EVERY`]).
    fn give_up_overdue(&self, now: Instant) -> bool {
        let mut st = self.st.borrow_mut();
        let st = &mut *st;
        let mut waiting = false;
        for (&channel, c) in st.channels.iter_mut() {
            if !c.confirms.enabled || c.tx.is_some() || c.state != ChannelState::Open {
                continue;
            }
            c.confirms.mark(now);
            let late = c.confirms.overdue(now, CONFIRM_LIMIT);
            if !late.is_empty() {
                tracing::warn!(
                    conn = self.id.0,
                    channel,
                    count = late.len(),
                    first = late[0],
                    "publishes unanswered for {} s: nacked (not known to be stored)",
                    CONFIRM_LIMIT.as_secs()
                );
                Stats::add(&self.core.stats().confirms_given_up, late.len() as u64);
                st.confirms_ready.extend(late.into_iter().map(|seq| (channel, seq, false)));
            }
            waiting |= c.confirms.waiting();
        }
        waiting
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
        // A channel that closed since its confirms completed gets none (spec 1.5.2.5).
        ready.retain(|(ch, _, _)| st.channels.get(ch).is_some_and(|c| c.state == ChannelState::Open));
        let n = ready.len() as u64;
        let channels = &st.channels;
        for c in confirms::coalesce(ready, |ch| channels.get(&ch).and_then(|c| c.confirms.lowest_pending())) {
            encode_method(out, c.channel, &c.method());
        }
        Stats::add(&self.core.stats().confirmed, n);
    }
}

/// basic.cancel (nowait) to consumer `tag` of `channel`, whose queue cancelled it, if the
/// channel is open and still has it (the consumer is forgotten here).
fn write_cancel(st: &mut ConnState, out: &mut Vec<u8>, channel: u16, tag: &ConsumerTag) {
    if let Some(c) = st.channels.get_mut(&channel).filter(|c| c.state == ChannelState::Open) {
        if c.consumers.remove(tag.as_str()).is_some() {
            encode_method(
                out,
                channel,
                &AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel { consumer_tag: tag.as_str().into(), nowait: true })),
            );
        }
    }
}
