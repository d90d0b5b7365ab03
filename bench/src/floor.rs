//! `ringmq-bench floor`: this machine's latency floor, measured the way a broker is.
//!
//! A relay in the bench process speaks just enough AMQP 0-9-1 for the bench's own client
//! (the handshake, channel.open, confirm.select, declares, binds, purges, basic.qos,
//! basic.consume) and does nothing a broker does with a message: a basic.publish's content
//! goes, as received, to a consumer of the queue its routing key names (round-robin), behind
//! a basic.deliver, and the publisher's confirm follows at once. No store, no routing table,
//! no unacked state (acks are read and dropped). What a run against it measures is what no
//! broker on this machine can beat: two loopback socket hops, the wake-ups of a thread on
//! each side, and the bench's own client. Every broker latency figure can then be read as a
//! ratio to it (`compare.sh --floor`).
//!
//! # Shape
//! One thread per accepted connection, blocking sockets with TCP_NODELAY: the thread reads
//! its connection's frames and answers them; a delivery is written by the publisher's thread
//! into the consumer's socket (each socket's writes go through one mutex, whole frames at a
//! time). Consumers are registered by queue name in one shared table.

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use amq_protocol::protocol::{basic, channel, confirm, connection, exchange, parse_class, queue, AMQPClass};
use amq_protocol::types::{FieldTable, LongString};

use crate::wire::{frame, method, FRAME_BODY, FRAME_HEADER, FRAME_METHOD};

/// frame_max offered in connection.tune, bytes (RabbitMQ's default).
const FRAME_MAX: u32 = 131_072;

/// A consumer as the relay knows it: where its deliveries go.
struct Consumer {
    out: Arc<Mutex<TcpStream>>,
    channel: u16,
    tag: String,
    /// Delivery tags of its channel.
    tags: Arc<AtomicU64>,
    /// Its connection's id (to forget it when the connection goes).
    conn: u64,
}

/// The consumers by queue name, and a round-robin position per queue.
#[derive(Default)]
struct Hub {
    queues: Mutex<HashMap<String, (Vec<Consumer>, usize)>>,
}

/// Starts the relay on a free loopback port (a thread accepting for the life of the
/// process); returns its address.
///
/// # Errors
/// Binding or reading the listener's address failed.
pub fn start() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let hub = Arc::new(Hub::default());
    std::thread::Builder::new().name("floor-accept".into()).spawn(move || {
        let mut next = 0u64;
        for stream in listener.incoming().flatten() {
            next += 1;
            let (hub, id) = (hub.clone(), next);
            let _ = std::thread::Builder::new().name(format!("floor-conn-{id}")).spawn(move || {
                // A connection that fails or closes only ends its own thread.
                let _ = serve(stream, &hub, id);
                hub.forget(id, None);
            });
        }
    })?;
    Ok(addr)
}

impl Hub {
    /// Drops the consumers of connection `conn` (of its `channel` only, when given).
    fn forget(&self, conn: u64, channel: Option<u16>) {
        for (list, _) in self.queues.lock().expect("hub lock").values_mut() {
            list.retain(|c| c.conn != conn || channel.is_some_and(|ch| c.channel != ch));
        }
    }

    /// Writes basic.deliver and the content frames (`header`: the content header's payload;
    /// `bodies`: the body frames' payloads) to the next consumer of `queue`; nothing when
    /// it has none.
    fn deliver(&self, queue: &str, exchange: &str, routing_key: &str, header: &[u8], bodies: &[Vec<u8>]) {
        let (out, channel, tag, delivery_tag) = {
            let mut queues = self.queues.lock().expect("hub lock");
            let Some((list, next)) = queues.get_mut(queue).filter(|(l, _)| !l.is_empty()) else { return };
            *next = (*next + 1) % list.len();
            let c = &list[*next];
            (c.out.clone(), c.channel, c.tag.clone(), c.tags.fetch_add(1, Ordering::Relaxed) + 1)
        };
        let mut buf = Vec::with_capacity(64 + header.len() + bodies.iter().map(|b| b.len() + 8).sum::<usize>());
        let deliver = basic::Deliver {
            consumer_tag: tag.into(),
            delivery_tag,
            redelivered: false,
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        };
        method(&mut buf, channel, &AMQPClass::Basic(basic::AMQPMethod::Deliver(deliver)));
        frame(&mut buf, FRAME_HEADER, channel, header);
        for b in bodies {
            frame(&mut buf, FRAME_BODY, channel, b);
        }
        let _ = out.lock().expect("socket lock").write_all(&buf);
    }
}

/// A publish being received on a channel: (exchange, routing key, content header payload,
/// body bytes still due, body frames so far).
type Incoming = (String, String, Vec<u8>, u64, Vec<Vec<u8>>);

/// Per channel: confirm mode with its last publish sequence number, the publish in progress.
#[derive(Default)]
struct Chan {
    confirm: Option<u64>,
    incoming: Option<Incoming>,
    tags: Arc<AtomicU64>,
}

/// Serves one connection until it closes or fails.
fn serve(stream: TcpStream, hub: &Hub, id: u64) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let out = Arc::new(Mutex::new(stream.try_clone()?));
    let mut rd = BufReader::with_capacity(64 << 10, stream);
    let mut proto = [0u8; 8];
    rd.read_exact(&mut proto)?;
    let reply = |m: AMQPClass, ch: u16| {
        let mut buf = Vec::new();
        method(&mut buf, ch, &m);
        out.lock().expect("socket lock").write_all(&buf)
    };
    let mut props = FieldTable::default();
    props.insert("product".into(), amq_protocol::types::AMQPValue::LongString(LongString::from("ringmq-bench floor relay")));
    let start = connection::Start {
        version_major: 0,
        version_minor: 9,
        server_properties: props,
        mechanisms: "PLAIN".into(),
        locales: "en_US".into(),
    };
    reply(AMQPClass::Connection(connection::AMQPMethod::Start(start)), 0)?;
    let mut chans: HashMap<u16, Chan> = HashMap::new();
    let mut head = [0u8; 7];
    loop {
        rd.read_exact(&mut head)?;
        let kind = head[0];
        let ch = u16::from_be_bytes([head[1], head[2]]);
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        let mut payload = vec![0u8; size + 1];
        rd.read_exact(&mut payload)?;
        payload.truncate(size);
        match kind {
            FRAME_METHOD => {
                let Ok((_, m)) = parse_class(&payload[..]) else { return Ok(()) };
                if !answer(m, ch, &mut chans, hub, id, &out, &reply)? {
                    return Ok(());
                }
            }
            FRAME_HEADER if size >= 12 => {
                let c = chans.entry(ch).or_default();
                if let Some(inc) = &mut c.incoming {
                    inc.3 = u64::from_be_bytes(payload[4..12].try_into().expect("8 bytes"));
                    inc.2 = payload;
                    if inc.3 == 0 {
                        complete(c, ch, hub, &reply)?;
                    }
                }
            }
            FRAME_BODY => {
                let c = chans.entry(ch).or_default();
                if let Some(inc) = &mut c.incoming {
                    inc.3 = inc.3.saturating_sub(payload.len() as u64);
                    inc.4.push(payload);
                    if inc.3 == 0 {
                        complete(c, ch, hub, &reply)?;
                    }
                }
            }
            _ => {} // heartbeats
        }
    }
}

/// A publish's content is complete: deliver it and confirm it.
fn complete(c: &mut Chan, ch: u16, hub: &Hub, reply: &impl Fn(AMQPClass, u16) -> std::io::Result<()>) -> std::io::Result<()> {
    let Some((exchange, rk, header, _, bodies)) = c.incoming.take() else { return Ok(()) };
    hub.deliver(&rk, &exchange, &rk, &header, &bodies);
    if let Some(seq) = &mut c.confirm {
        *seq += 1;
        let ack = basic::Ack { delivery_tag: *seq, multiple: false };
        reply(AMQPClass::Basic(basic::AMQPMethod::Ack(ack)), ch)?;
    }
    Ok(())
}

/// Answers one method; false once the connection is closed.
fn answer(
    m: AMQPClass,
    ch: u16,
    chans: &mut HashMap<u16, Chan>,
    hub: &Hub,
    id: u64,
    out: &Arc<Mutex<TcpStream>>,
    reply: &impl Fn(AMQPClass, u16) -> std::io::Result<()>,
) -> std::io::Result<bool> {
    use AMQPClass as C;
    let ok = match m {
        C::Connection(connection::AMQPMethod::StartOk(_)) => {
            let tune = connection::Tune { channel_max: 2047, frame_max: FRAME_MAX, heartbeat: 0 };
            Some(C::Connection(connection::AMQPMethod::Tune(tune)))
        }
        C::Connection(connection::AMQPMethod::Open(_)) => Some(C::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {}))),
        C::Connection(connection::AMQPMethod::Close(_)) => {
            reply(C::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})), 0)?;
            return Ok(false);
        }
        C::Channel(channel::AMQPMethod::Open(_)) => {
            chans.insert(ch, Chan::default());
            Some(C::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})))
        }
        C::Channel(channel::AMQPMethod::Close(_)) => {
            chans.remove(&ch);
            hub.forget(id, Some(ch));
            Some(C::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})))
        }
        C::Confirm(confirm::AMQPMethod::Select(s)) => {
            chans.entry(ch).or_default().confirm = Some(0);
            (!s.nowait).then_some(C::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})))
        }
        C::Exchange(exchange::AMQPMethod::Declare(d)) => {
            (!d.nowait).then_some(C::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})))
        }
        C::Exchange(exchange::AMQPMethod::Delete(d)) => {
            (!d.nowait).then_some(C::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})))
        }
        C::Queue(queue::AMQPMethod::Declare(d)) => {
            let ok = queue::DeclareOk { queue: d.queue, message_count: 0, consumer_count: 0 };
            (!d.nowait).then_some(C::Queue(queue::AMQPMethod::DeclareOk(ok)))
        }
        C::Queue(queue::AMQPMethod::Bind(b)) => (!b.nowait).then_some(C::Queue(queue::AMQPMethod::BindOk(queue::BindOk {}))),
        C::Queue(queue::AMQPMethod::Unbind(_)) => Some(C::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {}))),
        C::Queue(queue::AMQPMethod::Purge(p)) => {
            (!p.nowait).then_some(C::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk { message_count: 0 })))
        }
        C::Queue(queue::AMQPMethod::Delete(d)) => {
            (!d.nowait).then_some(C::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk { message_count: 0 })))
        }
        C::Basic(basic::AMQPMethod::Qos(_)) => Some(C::Basic(basic::AMQPMethod::QosOk(basic::QosOk {}))),
        C::Basic(basic::AMQPMethod::Consume(c)) => {
            let tag = if c.consumer_tag.as_str().is_empty() { format!("floor-{id}-{ch}") } else { c.consumer_tag.to_string() };
            let tags = chans.entry(ch).or_default().tags.clone();
            let consumer = Consumer { out: out.clone(), channel: ch, tag: tag.clone(), tags, conn: id };
            hub.queues.lock().expect("hub lock").entry(c.queue.to_string()).or_default().0.push(consumer);
            (!c.nowait).then_some(C::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk { consumer_tag: tag.into() })))
        }
        C::Basic(basic::AMQPMethod::Cancel(c)) => {
            for (list, _) in hub.queues.lock().expect("hub lock").values_mut() {
                list.retain(|k| !(k.conn == id && k.channel == ch && k.tag == c.consumer_tag.as_str()));
            }
            (!c.nowait).then_some(C::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk { consumer_tag: c.consumer_tag })))
        }
        C::Basic(basic::AMQPMethod::Publish(p)) => {
            let c = chans.entry(ch).or_default();
            c.incoming = Some((p.exchange.to_string(), p.routing_key.to_string(), Vec::new(), u64::MAX, Vec::new()));
            None
        }
        // Acks, nacks, tune-ok and the rest: nothing to answer.
        _ => None,
    };
    if let Some(m) = ok {
        reply(m, ch)?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use futures_lite::StreamExt;
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    use std::time::Duration;

    #[test]
    fn a_publish_reaches_the_consumer_of_its_queue_and_is_confirmed() {
        let addr = super::start().expect("relay");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let step = Duration::from_secs(10);
            let uri = format!("amqp://guest:guest@{addr}/%2f");
            let conn = tokio::time::timeout(step, Connection::connect(&uri, ConnectionProperties::default())).await.unwrap().unwrap();
            let ch = conn.create_channel().await.expect("channel");
            let q = ch.queue_declare("floor-q".into(), QueueDeclareOptions::default(), FieldTable::default()).await.expect("declare");
            assert_eq!(q.name().as_str(), "floor-q");
            let mut sub = ch
                .basic_consume("floor-q".into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
                .await
                .expect("consume");
            ch.confirm_select(ConfirmSelectOptions::default()).await.expect("confirm.select");
            for body in [&b"first"[..], &vec![7u8; 300_000][..]] {
                let confirm = ch
                    .basic_publish("".into(), "floor-q".into(), BasicPublishOptions::default(), body, BasicProperties::default())
                    .await
                    .expect("publish");
                assert!(tokio::time::timeout(step, confirm).await.unwrap().expect("confirm").is_ack());
                let d = tokio::time::timeout(step, sub.next()).await.unwrap().expect("a delivery").expect("not an error");
                assert_eq!((d.data.as_slice(), d.routing_key.as_str()), (body, "floor-q"), "the body as published, in frames");
                d.ack(BasicAckOptions::default()).await.expect("ack");
            }
            conn.close(200, "done".into()).await.expect("close");
        });
    }
}
