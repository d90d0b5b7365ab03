//! Class `basic` (spec 1.8): qos, consume, cancel, publish, get, ack, reject, nack,
//! recover; with RabbitMQ's extensions (basic.nack, consumer cancel notification,
//! per-consumer prefetch).

use std::rc::Rc;
use std::sync::Arc;

use amq_protocol::protocol::{basic, AMQPClass};

use super::queue::lookup;
use super::unique_suffix;
use crate::amqp::channel::{ChannelConsumer, PendingPublish};
use crate::amqp::codec::{encode_content, encode_method};
use crate::amqp::connection::Session;
use crate::amqp::error::{code, AmqpError};
use crate::amqp::unacked::{by_queue, DeliveryTag, Unacked};
use crate::broker::message::{split_header, Message};
use crate::broker::{reply_channel, ChannelId, ConfirmTo, ConsumerSpec, ConsumerTag, Holder, QueueOp};
use crate::observe::Stats;

/// Dispatches a basic method (publish starts content assembly; see [`publish`]).
pub async fn handle(s: &Rc<Session>, channel: u16, m: basic::AMQPMethod) -> Result<(), AmqpError> {
    match m {
        basic::AMQPMethod::Publish(p) => {
            if p.immediate {
                // As RabbitMQ 3.x: the immediate flag is not supported (hard 540).
                return Err(AmqpError::not_implemented("immediate=true"));
            }
            let mut st = s.st.borrow_mut();
            if let Some(c) = st.channels.get_mut(&channel) {
                c.publish = Some(PendingPublish {
                    exchange: p.exchange.to_string(),
                    routing_key: p.routing_key.to_string(),
                    mandatory: p.mandatory,
                    body_size: None,
                    properties: None,
                    raw_properties: Default::default(),
                    first: None,
                    body: Default::default(),
                    received: 0,
                });
            }
            Ok(())
        }
        basic::AMQPMethod::Qos(q) => {
            let mut wake = Vec::new();
            if let Some(c) = s.st.borrow_mut().channels.get_mut(&channel) {
                if q.global {
                    // RabbitMQ: global=true limits the channel as a whole, at once.
                    c.credit.limit.store(q.prefetch_count as u32, std::sync::atomic::Ordering::Relaxed);
                    wake.extend(c.consumers.values().map(|x| x.queue.clone()));
                } else {
                    c.prefetch = q.prefetch_count as u32;
                }
            }
            for queue in wake {
                s.queue_send(&queue, QueueOp::Wake);
            }
            s.send_method(channel, &AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})));
            Ok(())
        }
        basic::AMQPMethod::Consume(c) => consume(s, channel, c).await,
        basic::AMQPMethod::Cancel(c) => {
            let tag: Arc<str> = Arc::from(c.consumer_tag.as_str());
            let found = s.st.borrow_mut().channels.get_mut(&channel).and_then(|ch| ch.consumers.remove(&tag));
            match found {
                Some(cons) => s.queue_send(&cons.queue, QueueOp::Cancel { consumer: cons.id, send_ok: !c.nowait }),
                None if !c.nowait => s.send_method(
                    channel,
                    &AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk { consumer_tag: c.consumer_tag.clone() })),
                ),
                None => {}
            }
            Ok(())
        }
        basic::AMQPMethod::Get(g) => get(s, channel, g).await,
        basic::AMQPMethod::Ack(a) => {
            let done = settle(s, channel, DeliveryTag(a.delivery_tag), a.multiple)?;
            Stats::add(&s.core.stats().acked, done.len() as u64);
            let settled = by_queue(done);
            wake_channel_queues(s, channel, &settled);
            let chan_uid = chan_uid(s, channel);
            for (q, offs) in settled {
                s.queue_send(&q, QueueOp::Settle { chan_uid, ack: offs, requeue: Vec::new(), reject: Vec::new() });
            }
            Ok(())
        }
        basic::AMQPMethod::Reject(r) => {
            let done = settle(s, channel, DeliveryTag(r.delivery_tag), false)?;
            reject_or_requeue(s, channel, done, r.requeue);
            Ok(())
        }
        basic::AMQPMethod::Nack(n) => {
            let done = settle(s, channel, DeliveryTag(n.delivery_tag), n.multiple)?;
            reject_or_requeue(s, channel, done, n.requeue);
            Ok(())
        }
        basic::AMQPMethod::Recover(r) => {
            recover(s, channel, r.requeue);
            s.send_method(channel, &AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})));
            Ok(())
        }
        basic::AMQPMethod::RecoverAsync(r) => {
            recover(s, channel, r.requeue);
            Ok(())
        }
        _ => Err(AmqpError::command_invalid("this basic method is sent by the server")),
    }
}

/// The incarnation of `channel` (0 when it is not open: then nothing is settled).
fn chan_uid(s: &Session, channel: u16) -> u64 {
    s.st.borrow().channels.get(&channel).map_or(0, |c| c.uid)
}

/// Settles (tag, multiple) in the channel's ledger.
///
/// # Errors
/// 406 PRECONDITION_FAILED "unknown delivery tag" (spec 1.8.3.13; DESIGN.md rule 8).
fn settle(s: &Session, channel: u16, tag: DeliveryTag, multiple: bool) -> Result<Vec<Unacked>, AmqpError> {
    let mut st = s.st.borrow_mut();
    let c = st.channels.get_mut(&channel).ok_or_else(|| AmqpError::channel_error("channel not open"))?;
    c.ledger.settle(tag, multiple)
}

/// With a channel-wide window (global prefetch), credit freed by settling in one queue may
/// let the channel's consumers on *other* queues go on: wake those queues.
fn wake_channel_queues(s: &Session, channel: u16, settled: &[(crate::broker::QueueRef, Vec<crate::broker::Offset>)]) {
    let st = s.st.borrow();
    let Some(c) = st.channels.get(&channel) else { return };
    if c.credit.limit.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        return;
    }
    let mut others: Vec<crate::broker::QueueRef> = Vec::new();
    for cons in c.consumers.values() {
        if !settled.iter().any(|(q, _)| *q == cons.queue) && !others.contains(&cons.queue) {
            others.push(cons.queue.clone());
        }
    }
    drop(st);
    for q in others {
        s.queue_send(&q, QueueOp::Wake);
    }
}

fn reject_or_requeue(s: &Session, channel: u16, done: Vec<Unacked>, requeue: bool) {
    if requeue {
        Stats::add(&s.core.stats().requeued, done.len() as u64);
    }
    let settled = by_queue(done);
    wake_channel_queues(s, channel, &settled);
    let chan_uid = chan_uid(s, channel);
    for (q, offs) in settled {
        let op = if requeue {
            QueueOp::Settle { chan_uid, ack: Vec::new(), requeue: offs, reject: Vec::new() }
        } else {
            QueueOp::Settle { chan_uid, ack: Vec::new(), requeue: Vec::new(), reject: offs }
        };
        s.queue_send(&q, op);
    }
}

/// basic.recover: requeue=true puts every unacked delivery of the channel back in its
/// queue (redelivered, original position); requeue=false redelivers each to the consumer
/// that holds it, under a new delivery tag.
fn recover(s: &Session, channel: u16, requeue: bool) {
    let (held, chan_uid) = match s.st.borrow_mut().channels.get_mut(&channel) {
        Some(c) => (c.ledger.drain(), c.uid),
        None => return,
    };
    for (q, offs) in by_queue(held) {
        let op = if requeue {
            QueueOp::Settle { chan_uid, ack: Vec::new(), requeue: offs, reject: Vec::new() }
        } else {
            QueueOp::Redeliver { offsets: offs }
        };
        s.queue_send(&q, op);
    }
}

async fn consume(s: &Rc<Session>, channel: u16, c: basic::Consume) -> Result<(), AmqpError> {
    let (q, _) = lookup(s, c.queue.as_str()).await?;
    let tag: Arc<str> = if c.consumer_tag.as_str().is_empty() {
        Arc::from(format!("amq.ctag-{}", unique_suffix(s.core.shared.next_id())))
    } else {
        Arc::from(c.consumer_tag.as_str())
    };
    let id = s.core.shared.next_id();
    let spec = {
        let mut st = s.st.borrow_mut();
        let cancel_notify = st.cancel_notify;
        let ch = st.channels.get_mut(&channel).ok_or_else(|| AmqpError::channel_error("channel not open"))?;
        if ch.consumers.contains_key(&tag) {
            return Err(AmqpError::not_allowed(format!("attempt to reuse consumer tag '{tag}'")));
        }
        ch.consumers.insert(tag.clone(), ChannelConsumer { id, queue: q.clone() });
        ch.touched.insert(q.clone());
        ConsumerSpec {
            id,
            conn: s.id,
            channel: ChannelId(channel),
            chan_uid: ch.uid,
            tag: ConsumerTag(tag.clone()),
            no_ack: c.no_ack,
            exclusive: c.exclusive,
            prefetch: ch.prefetch,
            channel_credit: ch.credit.clone(),
            cancel_notify,
            send_consume_ok: !c.nowait,
            tx: s.tx.clone(),
            pending_bytes: s.pending_bytes.clone(),
        }
    };
    let (reply, rx) = reply_channel();
    s.queue_send(&q, QueueOp::Consume { consumer: spec, reply });
    let r = rx.recv_async().await.map_err(|_| AmqpError::internal_error("queue did not answer"))?;
    if let Err(e) = r {
        if let Some(ch) = s.st.borrow_mut().channels.get_mut(&channel) {
            ch.consumers.remove(&tag);
        }
        return Err(e.into());
    }
    Ok(())
}

async fn get(s: &Rc<Session>, channel: u16, g: basic::Get) -> Result<(), AmqpError> {
    let (q, _) = lookup(s, g.queue.as_str()).await?;
    let holder = {
        let mut st = s.st.borrow_mut();
        let ch = st.channels.get_mut(&channel).ok_or_else(|| AmqpError::channel_error("channel not open"))?;
        ch.touched.insert(q.clone());
        Holder { conn: s.id, channel: ChannelId(channel), chan_uid: ch.uid, tx: s.tx.clone() }
    };
    let (reply, rx) = reply_channel();
    s.queue_send(&q, QueueOp::Get { no_ack: g.no_ack, holder, reply });
    let r = rx.recv_async().await.map_err(|_| AmqpError::internal_error("queue did not answer"))??;
    let mut out = Vec::new();
    match r {
        None => encode_method(&mut out, channel, &AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {}))),
        Some(got) => {
            let mut st = s.st.borrow_mut();
            let frame_max = st.frame_max;
            let Some(ch) = st.channels.get_mut(&channel) else {
                // Closed meanwhile: the queue requeues it on ChannelClosed.
                return Ok(());
            };
            let tag = ch.take_tag();
            if !g.no_ack {
                ch.ledger.insert(tag, Unacked { queue: q.clone(), offset: got.offset });
            }
            let (exchange, rk, props) = split_header(&got.message.header);
            encode_method(
                &mut out,
                channel,
                &AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                    delivery_tag: tag.0,
                    redelivered: got.redelivered,
                    exchange: exchange.into(),
                    routing_key: rk.into(),
                    message_count: got.message_count,
                })),
            );
            encode_content(&mut out, channel, props, &got.message.body, frame_max);
            Stats::add(&s.core.stats().delivered, 1);
        }
    }
    s.send_frames(out);
    Ok(())
}

/// A basic.publish whose content is complete: route it and hand it to every target
/// queue's owner core. Unroutable mandatory messages come back with basic.return 312
/// NO_ROUTE before their confirm (DESIGN.md rule 9).
///
/// # Errors
/// 404 NOT_FOUND for a missing exchange; 403 ACCESS_REFUSED for an internal one.
pub fn publish(s: &Rc<Session>, channel: u16, mut p: PendingPublish) -> Result<(), AmqpError> {
    Stats::add(&s.core.stats().published, 1);
    let vhost = s.vhost();
    let router = s.core.router();
    if !p.exchange.is_empty() {
        match router.exchange(&vhost, &p.exchange) {
            None => return Err(AmqpError::not_found(format!("no exchange '{}' in vhost '{vhost}'", p.exchange))),
            Some(x) if x.internal => {
                return Err(AmqpError::access_refused(format!("cannot publish to internal exchange '{}' in vhost '{vhost}'", p.exchange)))
            }
            Some(_) => {}
        }
    }
    let props = p.properties.take().unwrap_or_default();
    let headers = props.headers().as_ref();
    let route = router.route(&vhost, &p.exchange, &p.routing_key, headers);
    let persistent = *props.delivery_mode() == Some(2);
    let body = p.take_body();
    let message = Message::new(&p.exchange, &p.routing_key, &p.raw_properties, body, persistent);
    let seq = {
        let mut st = s.st.borrow_mut();
        let c = st.channels.get_mut(&channel).ok_or_else(|| AmqpError::channel_error("channel not open"))?;
        if c.confirms.enabled {
            let seq = c.confirms.next_seq;
            c.confirms.next_seq += 1;
            if !route.queues.is_empty() {
                c.confirms.pending.insert(seq, (route.queues.len() as u32, false));
            }
            Some(seq)
        } else {
            None
        }
    };
    if route.queues.is_empty() {
        if p.mandatory {
            Stats::add(&s.core.stats().returned, 1);
            let frame_max = s.st.borrow().frame_max;
            let mut out = Vec::new();
            let (_, _, raw) = message.parts();
            encode_method(
                &mut out,
                channel,
                &AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                    reply_code: code::NO_ROUTE,
                    reply_text: "NO_ROUTE".into(),
                    exchange: p.exchange.as_str().into(),
                    routing_key: p.routing_key.as_str().into(),
                })),
            );
            encode_content(&mut out, channel, raw, &message.body, frame_max);
            s.send_frames(out);
        }
        if let Some(seq) = seq {
            // After the return, through the same channel: the writer confirms it.
            let _ = s.tx.send(crate::broker::ClientEvent::Stored {
                channel: ChannelId(channel),
                chan_uid: chan_uid(s, channel),
                seq,
                ok: true,
            });
        }
        return Ok(());
    }
    let published = crate::observe::sample().then(std::time::Instant::now);
    let last = route.queues.len() - 1;
    let mut message = Some(message);
    for (i, q) in route.queues.iter().enumerate() {
        let m = if i == last { message.take().expect("once") } else { message.clone().expect("present") };
        let chan_uid = chan_uid(s, channel);
        let confirm = seq.map(|seq| ConfirmTo { tx: s.tx.clone(), conn: s.id, channel: ChannelId(channel), chan_uid, seq });
        s.queue_send(q, QueueOp::Publish { message: m, confirm, published });
    }
    Ok(())
}
