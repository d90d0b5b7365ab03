//! Class `basic` (spec 1.8): qos, consume, cancel, publish, get, ack, reject, nack,
//! recover; with RabbitMQ's extensions (basic.nack, consumer cancel notification,
//! per-consumer prefetch).

use std::rc::Rc;
use std::sync::Arc;

use amq_protocol::protocol::{basic, AMQPClass};

use super::queue::lookup;
use super::{authorize, unique_suffix};
use crate::amqp::channel::{ChannelConsumer, PendingPublish};
use crate::amqp::codec::{encode_content, encode_method, plain_delivery_mode};
use crate::amqp::connection::Session;
use crate::amqp::error::{code, AmqpError};
use crate::amqp::transaction::{Routed, SettleKind};
use crate::amqp::unacked::{by_queue, DeliveryTag, Unacked};
use crate::broker::access::{Perm, Resource};
use crate::broker::message::{encode_properties, parse_expiration, Message};
use crate::broker::reply_to;
use crate::broker::{reply_channel, CancelOkTo, ChannelId, ConfirmTo, ConsumerSpec, ConsumerTag, Holder, QueueOp};
use crate::observe::Stats;

/// How long after qos-ok a py-amqp client's raise of its channel window reaches its running
/// consumers (see the basic.qos arm of [`handle`]).
const SPEC_QOS_RAISE_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

/// basic.publish (spec 1.8.3.7): the channel awaits the content (`PendingPublish`).
///
/// # Errors
/// 540 NOT_IMPLEMENTED for immediate=true (as RabbitMQ 3.x).
pub fn publish_started(s: &Session, channel: u16, p: basic::Publish) -> Result<(), AmqpError> {
    if p.immediate {
        // As RabbitMQ 3.x: the immediate flag is not supported (hard 540).
        return Err(AmqpError::not_implemented("immediate=true"));
    }
    let mut st = s.st.borrow_mut();
    if let Some(c) = st.channels.get_mut(&channel) {
        c.publish = Some(PendingPublish {
            exchange: p.exchange.into(),
            routing_key: p.routing_key.into(),
            mandatory: p.mandatory,
            body_size: None,
            properties: None,
            raw_properties: Default::default(),
            first: None,
            body: Default::default(),
            received: 0,
            reserved: None,
        });
    }
    Ok(())
}

/// basic.ack (spec 1.8.3.13): settles the delivery `a.delivery_tag` (and, with `multiple`,
/// every earlier one) of `channel`.
///
/// # Errors
/// 406 PRECONDITION_FAILED for an unknown delivery tag (`settle`).
pub fn ack(s: &Rc<Session>, channel: u16, a: basic::Ack) -> Result<(), AmqpError> {
    if let Some(done) = settle(s, channel, DeliveryTag(a.delivery_tag), a.multiple, SettleKind::Ack)? {
        apply_settle(s, channel, SettleKind::Ack, done);
    }
    Ok(())
}

/// Dispatches a basic method (publish starts content assembly; see [`publish`]).
pub async fn handle(s: &Rc<Session>, channel: u16, m: basic::AMQPMethod) -> Result<(), AmqpError> {
    match m {
        basic::AMQPMethod::Publish(p) => publish_started(s, channel, p),
        basic::AMQPMethod::Qos(q) => {
            // (spec_qos, the channel's window and the queues its consumers read) when the
            // window is what this qos sets; None when it sets the next consumers' prefetch.
            let channel_wide = {
                let mut st = s.st.borrow_mut();
                let spec_qos = st.spec_qos;
                let Some(c) = st.channels.get_mut(&channel) else { return Ok(()) };
                if q.global || spec_qos {
                    // RabbitMQ: global=true limits the channel as a whole, at once; so does
                    // global=false for a client that reads the spec (`ConnState::spec_qos`).
                    Some((spec_qos, c.credit.clone(), c.consumers.values().map(|x| x.queue.clone()).collect::<Vec<_>>()))
                } else {
                    c.prefetch = q.prefetch_count as u32;
                    None
                }
            };
            let qos_ok = AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {}));
            let Some((spec_qos, credit, wake)) = channel_wide else {
                s.send_method(channel, &qos_ok);
                return Ok(());
            };
            let limit = q.prefetch_count as u32;
            let raise = limit == 0 || limit > credit.limit.load(std::sync::atomic::Ordering::Relaxed);
            if spec_qos && raise && !wake.is_empty() {
                // py-amqp under Celery: kombu's event loop (its hub) reads a delivery that
                // reaches the socket before it polls again, then sleeps until its next timer
                // (up to a countdown away) before it raises the window further. A raise for
                // its running consumers takes effect a moment after qos-ok (RabbitMQ's own
                // deliveries come that much later), so the deliveries it lets through wake
                // the loop's poll.
                s.send_method(channel, &qos_ok);
                glommio::timer::sleep(SPEC_QOS_RAISE_DELAY).await;
                credit.limit.store(limit, std::sync::atomic::Ordering::Relaxed);
                wake.iter().for_each(|queue| s.queue_send(queue, QueueOp::Wake));
                return Ok(());
            }
            credit.limit.store(limit, std::sync::atomic::Ordering::Relaxed);
            wake.iter().for_each(|queue| s.queue_send(queue, QueueOp::Wake));
            s.send_method(channel, &qos_ok);
            Ok(())
        }
        basic::AMQPMethod::Consume(c) => consume(s, channel, c).await,
        basic::AMQPMethod::Cancel(c) => {
            let tag: Arc<str> = Arc::from(c.consumer_tag.as_str());
            let (found, reply) = match s.st.borrow_mut().channels.get_mut(&channel) {
                Some(ch) => {
                    let reply = ch.reply_to.take_if(|r| r.tag == tag);
                    (ch.consumers.remove(&tag), reply)
                }
                None => (None, None),
            };
            if let Some(r) = &reply {
                s.core.shared.reply_to.unregister(r.token);
            }
            match found {
                Some(cons) => {
                    let ok =
                        (!c.nowait).then(|| CancelOkTo::new(s.tx.clone(), ChannelId(channel), ConsumerTag::from(c.consumer_tag.as_str())));
                    s.queue_send(&cons.queue, QueueOp::Cancel { consumer: cons.id, ok })
                }
                None if !c.nowait => s.send_method(
                    channel,
                    &AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk { consumer_tag: c.consumer_tag.clone() })),
                ),
                None => {}
            }
            Ok(())
        }
        basic::AMQPMethod::Get(g) => get(s, channel, g).await,
        basic::AMQPMethod::Ack(a) => ack(s, channel, a),
        basic::AMQPMethod::Reject(r) => {
            let kind = if r.requeue { SettleKind::Requeue } else { SettleKind::Reject };
            if let Some(done) = settle(s, channel, DeliveryTag(r.delivery_tag), false, kind)? {
                apply_settle(s, channel, kind, done);
            }
            Ok(())
        }
        basic::AMQPMethod::Nack(n) => {
            let kind = if n.requeue { SettleKind::Requeue } else { SettleKind::Reject };
            if let Some(done) = settle(s, channel, DeliveryTag(n.delivery_tag), n.multiple, kind)? {
                apply_settle(s, channel, kind, done);
            }
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

/// Settles (tag, multiple) in the channel's ledger. On a transactional channel the
/// settled deliveries are held until tx.commit (`crate::amqp::transaction` rule 2) and
/// `None` comes back; otherwise they are returned for [`apply_settle`].
///
/// # Errors
/// 406 PRECONDITION_FAILED "unknown delivery tag" (spec 1.8.3.13; DESIGN.md rule 8).
fn settle(s: &Session, channel: u16, tag: DeliveryTag, multiple: bool, kind: SettleKind) -> Result<Option<Vec<Unacked>>, AmqpError> {
    let mut st = s.st.borrow_mut();
    let c = st.channels.get_mut(&channel).ok_or_else(|| AmqpError::channel_error("channel not open"))?;
    match c.tx.as_mut() {
        None => c.ledger.settle(tag, multiple).map(Some),
        Some(tx) => {
            tx.settles.push((kind, c.ledger.settle_tagged(tag, multiple)?));
            Ok(None)
        }
    }
}

/// Carries out a settlement of deliveries taken from the channel's ledger: each queue
/// gets one `Settle` with its offsets (acked, requeued or rejected), and with a
/// channel-wide window the channel's other queues are woken.
pub fn apply_settle(s: &Session, channel: u16, kind: SettleKind, done: Vec<Unacked>) {
    let stats = s.core.stats();
    if kind == SettleKind::Ack {
        let now = std::time::Instant::now();
        for at in done.iter().filter_map(|u| u.written) {
            stats.stages.record(crate::observe::Stage::WrittenToAcked, now.duration_since(at));
        }
    }
    match kind {
        SettleKind::Ack => Stats::add(&stats.acked, done.len() as u64),
        SettleKind::Requeue => Stats::add(&stats.requeued, done.len() as u64),
        SettleKind::Reject => {}
    }
    let settled = by_queue(done);
    wake_channel_queues(s, channel, &settled);
    let chan_uid = chan_uid(s, channel);
    for (q, offs) in settled {
        let op = match kind {
            SettleKind::Ack => QueueOp::Settle { chan_uid, ack: offs, requeue: Vec::new(), reject: Vec::new() },
            SettleKind::Requeue => QueueOp::Settle { chan_uid, ack: Vec::new(), requeue: offs, reject: Vec::new() },
            SettleKind::Reject => QueueOp::Settle { chan_uid, ack: Vec::new(), requeue: Vec::new(), reject: offs },
        };
        s.queue_send(&q, op);
    }
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
    let tag: Arc<str> = if c.consumer_tag.as_str().is_empty() {
        Arc::from(format!("amq.ctag-{}", unique_suffix(s.core.shared.next_id())))
    } else {
        Arc::from(c.consumer_tag.as_str())
    };
    if c.queue.as_str() == reply_to::PSEUDO_QUEUE {
        return consume_replies(s, channel, tag, &c);
    }
    authorize(s, Perm::Read, Resource::Queue, c.queue.as_str())?;
    let (q, _) = lookup(s, c.queue.as_str()).await?;
    let priority = consumer_priority(&c.arguments)?;
    let id = s.core.shared.next_id();
    let spec = {
        let mut st = s.st.borrow_mut();
        let cancel_notify = st.cancel_notify;
        let ch = st.channels.get_mut(&channel).ok_or_else(|| AmqpError::channel_error("channel not open"))?;
        if ch.consumers.contains_key(&tag) {
            return Err(AmqpError::not_allowed(format!("attempt to reuse consumer tag '{tag}'")));
        }
        let live = Some(s.core.shared.live.consumers.enter());
        ch.consumers.insert(tag.clone(), ChannelConsumer { id, queue: q.clone(), live });
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
            priority,
            tx: s.tx.clone(),
            pending_bytes: s.pending_bytes.clone(),
            remote: false,
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

/// The `x-priority` argument of basic.consume (RabbitMQ's consumer priorities; 0 without
/// one).
///
/// # Errors
/// 406 PRECONDITION_FAILED for a value that is not an integer of 32 bits.
fn consumer_priority(args: &amq_protocol::types::FieldTable) -> Result<i32, AmqpError> {
    if !args.inner().contains_key("x-priority") {
        return Ok(0);
    }
    crate::broker::router::int_arg(args, "x-priority")
        .and_then(|p| i32::try_from(p).ok())
        .ok_or_else(|| AmqpError::precondition_failed("invalid arg 'x-priority' for basic.consume: expected an integer"))
}

/// basic.consume on `amq.rabbitmq.reply-to` (`broker::reply_to`, step 1): registers the
/// channel's direct reply-to name.
///
/// # Errors
/// 406 PRECONDITION_FAILED without no-ack ("reply consumer cannot acknowledge") or when the
/// channel already has one ("reply consumer already set"); 530 NOT_ALLOWED for a consumer
/// tag in use on the channel.
fn consume_replies(s: &Rc<Session>, channel: u16, tag: Arc<str>, c: &basic::Consume) -> Result<(), AmqpError> {
    if !c.no_ack {
        return Err(AmqpError::precondition_failed("reply consumer cannot acknowledge"));
    }
    let token = s.core.shared.next_id().wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ unique_token_salt();
    {
        let mut st = s.st.borrow_mut();
        let ch = st.channels.get_mut(&channel).ok_or_else(|| AmqpError::channel_error("channel not open"))?;
        if ch.reply_to.is_some() {
            return Err(AmqpError::precondition_failed("reply consumer already set"));
        }
        if ch.consumers.contains_key(&tag) {
            return Err(AmqpError::not_allowed(format!("attempt to reuse consumer tag '{tag}'")));
        }
        let consumer = reply_to::ReplyConsumer {
            channel: ChannelId(channel),
            chan_uid: ch.uid,
            consumer_tag: ConsumerTag(tag.clone()),
            tx: s.tx.clone(),
            pending_bytes: s.pending_bytes.clone(),
        };
        let name = s.core.shared.reply_to.register(s.core.shared.meta.node_id(), token, consumer);
        ch.reply_to = Some(crate::amqp::channel::ReplyTo { tag: tag.clone(), name, token });
    }
    if !c.nowait {
        s.send_method(channel, &AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk { consumer_tag: tag.as_ref().into() })));
    }
    Ok(())
}

/// Clock bits that make a reply-to token hard to guess from the ids before it.
fn unique_token_salt() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    nanos.rotate_left(29) ^ (std::process::id() as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

async fn get(s: &Rc<Session>, channel: u16, g: basic::Get) -> Result<(), AmqpError> {
    authorize(s, Perm::Read, Resource::Queue, g.queue.as_str())?;
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
    let stats = s.core.stats();
    match r {
        None => {
            Stats::add(&stats.get_empty, 1);
            encode_method(&mut out, channel, &AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})))
        }
        Some(got) => {
            let mut st = s.st.borrow_mut();
            let frame_max = st.frame_max;
            let Some(ch) = st.channels.get_mut(&channel) else {
                // Closed meanwhile: the queue requeues it on ChannelClosed.
                return Ok(());
            };
            let tag = ch.take_tag();
            if !g.no_ack {
                // A sampled get-ok's written_to_acked starts as it is written (its way here
                // from the queue is not timed).
                let written = crate::observe::sample_at(crate::observe::SamplePoint::Hand).then(std::time::Instant::now);
                ch.ledger.insert(tag, Unacked { queue: q.clone(), offset: got.offset, written });
            }
            let (exchange, rk, props) = got.message.parts();
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
            Stats::add(&stats.delivered, 1);
            Stats::add(if g.no_ack { &stats.delivered_get_auto_ack } else { &stats.delivered_get_manual_ack }, 1);
            Stats::add(&stats.redelivered, got.redelivered as u64);
        }
    }
    s.send_frames(out);
    Ok(())
}

/// A basic.publish whose content is complete: route it and hand it to every target
/// queue's owner core (on a transactional channel: hold it until tx.commit). Unroutable
/// mandatory messages come back with basic.return 312 NO_ROUTE before their confirm
/// (DESIGN.md rule 9).
///
/// # Errors
/// 404 NOT_FOUND for a missing exchange; 403 ACCESS_REFUSED for an internal one.
pub fn publish(s: &Rc<Session>, channel: u16, p: PendingPublish) -> Result<(), AmqpError> {
    let routed = route(s, channel, p)?;
    let seq = {
        let mut st = s.st.borrow_mut();
        let st = &mut *st;
        let c = st.channels.get_mut(&channel).ok_or_else(|| AmqpError::channel_error("channel not open"))?;
        if c.publisher.is_none() {
            c.publisher = Some(s.core.shared.live.publishers.enter());
        }
        if let Some(tx) = c.tx.as_mut() {
            tx.publishes.push(routed.held());
            return Ok(());
        }
        if !c.confirms.enabled {
            None
        } else {
            Stats::add(&s.core.stats().received_confirm, 1);
            // Unroutable: it waits for the answer sent below, after the basic.return.
            let seq = c.confirms.take_seq(routed.queues.len().max(1));
            if !routed.queues.is_empty() && !std::mem::replace(&mut st.confirm_clock, true) {
                // The writer starts the publish clock (`outbound::give_up_overdue`), waking
                // if idle: an answer that never comes is given up after CONFIRM_LIMIT.
                let _ = s.tx.send(crate::broker::ClientEvent::PublishesTaken);
            }
            Some(seq)
        }
    };
    let unroutable = routed.queues.is_empty();
    s.publish_routed(&routed.queues);
    deliver(s, channel, routed, seq);
    if let (true, Some(seq)) = (unroutable, seq) {
        // After the return, through the same channel: the writer confirms it.
        let _ =
            s.tx.send(crate::broker::ClientEvent::Stored { channel: ChannelId(channel), chan_uid: chan_uid(s, channel), seq, ok: true });
    }
    Ok(())
}

/// Checks a complete basic.publish on `channel` against the core's routing copy and routes
/// it. A request whose `reply_to` is `amq.rabbitmq.reply-to` gets the channel's direct
/// reply-to name instead; a reply to such a name routes to it (`broker::reply_to`).
///
/// # Errors
/// 404 NOT_FOUND for a missing exchange; 403 ACCESS_REFUSED for an internal one; 406
/// PRECONDITION_FAILED "fast reply consumer does not exist" (RabbitMQ's words) for a
/// request to be answered by direct reply-to on a channel that does not consume from it,
/// and "invalid expiration '<value>': <why>" (RabbitMQ's words) for an `expiration` that is
/// not a TTL ([`parse_expiration`]).
pub fn route(s: &Session, channel: u16, mut p: PendingPublish) -> Result<Routed, AmqpError> {
    Stats::add(&s.core.stats().published, 1);
    let vhost = s.vhost();
    let router = s.core.router();
    // Write on the exchange, before it is looked up (RabbitMQ's order).
    let checked = s.st.borrow_mut().grant.check(router.version, &router.topology, Perm::Write, Resource::Exchange, &p.exchange);
    checked.map_err(AmqpError::access_refused)?;
    if !p.exchange.is_empty() {
        match router.exchange(&vhost, &p.exchange) {
            None => return Err(AmqpError::not_found(format!("no exchange '{}' in vhost '{vhost}'", p.exchange))),
            Some(x) if x.internal => {
                return Err(AmqpError::access_refused(format!("cannot publish to internal exchange '{}' in vhost '{vhost}'", p.exchange)))
            }
            Some(_) => {}
        }
    }
    // `None`: a plain header, no property but perhaps `delivery_mode` (`codec::plain_properties`).
    let mut props = p.properties.take();
    // A per-message TTL (RabbitMQ's `check_expiration_header`): its deadline is fixed here,
    // at publish, and goes with the message (`broker::queue::ttl`).
    let expires_in = match props.as_ref().and_then(|p| p.expiration().as_ref()) {
        None => None,
        Some(e) => {
            Some(parse_expiration(e.as_str()).map_err(|why| AmqpError::precondition_failed(format!("invalid expiration '{e}': {why}")))?)
        }
    };
    if let Some(props) = props.as_mut().filter(|p| p.reply_to().as_ref().is_some_and(|r| r.as_str() == reply_to::PSEUDO_QUEUE)) {
        let name = s.st.borrow().channels.get(&channel).and_then(|c| c.reply_to.as_ref().map(|r| r.name.clone()));
        let name = name.ok_or_else(|| AmqpError::precondition_failed("fast reply consumer does not exist"))?;
        **props = std::mem::take(&mut **props).with_reply_to(name.as_str().into());
        p.raw_properties = encode_properties(props).into();
    }
    let headers = props.as_ref().and_then(|p| p.headers().as_ref());
    let queues: Rc<[crate::broker::QueueRef]> = match p.exchange.is_empty().then(|| reply_to::target(&vhost, &p.routing_key)).flatten() {
        // A reply to a name of this node that is no longer consumed is unroutable (a
        // mandatory one comes back); another node's name is that node's to judge.
        Some(t) if t.owner_node == s.core.shared.meta.node_id() && !s.core.shared.reply_to.serves(&t.key.name) => Rc::new([]),
        Some(t) => Rc::new([t]),
        None => router.route_shared(&vhost, &p.exchange, &p.routing_key, headers),
    };
    let persistent = match &props {
        Some(props) => *props.delivery_mode() == Some(2),
        None => plain_delivery_mode(&p.raw_properties) == Some(2),
    };
    let body = p.take_body();
    s.core.stats().message_sizes.record(body.len() as u64);
    let mut message = Message::new(&p.exchange, &p.routing_key, &p.raw_properties, body, persistent);
    if let Some(ttl) = expires_in {
        message = message.with_deadline(crate::broker::queue::index::now_ms() + ttl);
    }
    Ok(Routed { exchange: p.exchange, routing_key: p.routing_key, mandatory: p.mandatory, message, queues })
}

/// Hands a routed publish to its queues, with confirm ticket `seq` (taken with
/// `Confirms::take_seq`) when the channel confirms or commits; an unroutable mandatory
/// one comes back with basic.return.
pub fn deliver(s: &Session, channel: u16, r: Routed, seq: Option<u64>) {
    let Routed { exchange, routing_key, mandatory, message, queues } = r;
    let stats = s.core.stats();
    if queues.is_empty() {
        Stats::add(if mandatory { &stats.returned } else { &stats.unroutable_dropped }, 1);
        if mandatory {
            let frame_max = s.st.borrow().frame_max;
            let mut out = Vec::new();
            let (_, _, raw) = message.parts();
            encode_method(
                &mut out,
                channel,
                &AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                    reply_code: code::NO_ROUTE,
                    reply_text: "NO_ROUTE".into(),
                    exchange: exchange.as_str().into(),
                    routing_key: routing_key.as_str().into(),
                })),
            );
            encode_content(&mut out, channel, raw, &message.body, frame_max);
            s.send_frames(out);
        }
        return;
    }
    Stats::add(&stats.routed, 1);
    let published = crate::observe::sample().then(std::time::Instant::now);
    if let (Some(at), Some(seq)) = (published, seq) {
        if let Some(c) = s.st.borrow_mut().channels.get_mut(&channel) {
            c.confirms.sample(seq, at);
        }
    }
    let chan_uid = chan_uid(s, channel);
    let bytes = message.body.len() + message.header.len();
    if let [q] = &queues[..] {
        let confirm = seq.map(|seq| ConfirmTo { tx: s.tx.clone(), conn: s.id, channel: ChannelId(channel), chan_uid, seq });
        s.core.publish_from_connection(q, message, confirm, published, &s.credit, bytes);
        return;
    }
    let last = queues.len() - 1;
    // One credit for the message, whatever the fanout (`broker::credit`).
    let mut credit = Some(s.credit.take(bytes));
    let mut message = Some(message);
    for (i, q) in queues.iter().enumerate() {
        // The last queue gets the message and the credit themselves: no reference counted.
        let (m, c) = if i == last { (message.take(), credit.take()) } else { (message.clone(), credit.clone()) };
        let confirm = seq.map(|seq| ConfirmTo { tx: s.tx.clone(), conn: s.id, channel: ChannelId(channel), chan_uid, seq });
        s.queue_send(q, QueueOp::Publish { message: m.expect("until the last queue"), confirm, published, credit: c });
    }
}
