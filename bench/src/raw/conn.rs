//! One raw-engine connection: its socket, its read and write buffers, its channels, and the
//! loop that drives them (see `raw/mod.rs` for the shape).

use super::CLOSE_TIMEOUT;
use crate::body::{self, Tag};
use crate::clock::{now_ns, Pacer, Schedule};
use crate::run::{target, Env};
use crate::stats::Stats;
use crate::wire::{frame, method, Reader, FRAME_BODY, FRAME_HEADER, FRAME_METHOD, FRAME_OVERHEAD};
use amq_protocol::frame::{gen_frame, AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, channel, connection, parse_class, AMQPClass};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::io::ErrorKind;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use tokio::net::TcpStream;

/// Publishes one producer encodes per pass of the loop.
const BATCH: usize = 512;
/// Unwritten bytes above which no producer encodes more (the connection's pipeline).
const OUT_CAP: usize = 1 << 20;
/// Unwritten bytes above which a pass stops encoding and writes.
const WRITE_CHUNK: usize = 256 << 10;
/// Reads per pass before the loop turns to writing and publishing.
const READS_PER_PASS: usize = 16;
/// Passes per poll before the task yields to the other connections' tasks.
const PASSES_PER_POLL: usize = 32;
/// Read buffer size, bytes.
const READ_BUFFER: usize = 256 << 10;

/// What a channel does.
pub enum Role {
    /// Not set up yet.
    Idle,
    /// Consumes from queue index `qi`; `pending` deliveries are not acked yet, the last
    /// one's tag is `last_tag`.
    Consumer { qi: usize, pending: u32, last_tag: u64 },
    /// Publishes.
    Producer(Box<Producer>),
}

impl Role {
    /// A consumer of queue index `qi`.
    pub fn consumer(qi: usize) -> Self {
        Role::Consumer { qi, pending: 0, last_tag: 0 }
    }
}

/// Content frames expected next on a channel, after basic.deliver or basic.return.
enum Content {
    None,
    /// A delivery: its tag, redelivered flag, body size and bytes still due (u64::MAX
    /// until the content header), and the body's first bytes when it spans frames.
    Deliver {
        tag: u64,
        redelivered: bool,
        size: u64,
        left: u64,
        head: [u8; body::HEADER_LEN],
        have: usize,
    },
    /// A returned message: its bytes are skipped.
    Skip {
        left: u64,
    },
}

/// One channel of the connection.
struct Chan {
    role: Role,
    content: Content,
    /// False once the broker closed it.
    open: bool,
}

/// One producer's state.
pub struct Producer {
    index: u16,
    /// publish + content header + zero body frames, one per priority (one when
    /// --priorities is 0).
    templates: Vec<Vec<u8>>,
    /// Offset of the body's first byte in a template.
    body_at: usize,
    sent: u64,
    /// Its fixed-rate schedule (set by [`Conn::start_publishing`]; unused at unlimited rate).
    schedule: Schedule,
    /// Confirm mode: intended send time (ns) and "settled" of each unconfirmed publish,
    /// oldest first; the oldest has publish sequence number `base`.
    window: VecDeque<(u64, bool)>,
    base: u64,
    /// Drain deadline (ns), once it stopped publishing.
    stop_at: Option<u64>,
    done: bool,
}

/// Everything of a connection but its socket and read buffer (so frames borrowed from the
/// read buffer can be handled with `&mut State`).
struct State {
    env: Rc<Env>,
    chans: Vec<Chan>,
    channel_max: u16,
    frame_max: u32,
    out: Vec<u8>,
    written: usize,
    /// When the bytes being handled were read (ns).
    now: u64,
    /// A reply to a setup call: channel and method, or why the channel closed.
    reply: Option<(u16, Result<AMQPClass, String>)>,
    /// Why the connection is over.
    dead: Option<String>,
    close_ok: bool,
    /// The load is running (`Conn::drive`): a channel closed by the broker is an error of
    /// the run, no longer the answer to a setup call.
    driving: bool,
    /// Called once per producer when it finishes.
    finished: Option<Rc<dyn Fn()>>,
}

/// A raw-engine connection.
pub struct Conn {
    stream: TcpStream,
    rd: Reader,
    st: State,
}

/// What a publishing pass leaves to wait for.
#[derive(Default)]
struct Plan {
    /// A producer has more to send now (it filled its batch, or the write buffer was
    /// full): run again as soon as the write buffer has room.
    more: bool,
    /// Earliest time (ns) a paced producer has a message due.
    due: Option<u64>,
    /// Earliest drain deadline (ns) of a stopping producer.
    deadline: Option<u64>,
    /// A stopping producer without confirms is done once the write buffer is written: run
    /// again then (nothing else would wake the connection before its drain deadline).
    flushing: bool,
}

fn earliest(a: Option<u64>, b: u64) -> Option<u64> {
    Some(a.map_or(b, |a| a.min(b)))
}

impl Conn {
    /// A connection over `stream`, accepting frames up to `max_frame` bytes until tuned.
    pub fn new(env: Rc<Env>, stream: TcpStream, max_frame: usize) -> Self {
        let st = State {
            env,
            chans: Vec::new(),
            channel_max: u16::MAX,
            frame_max: 4096,
            out: Vec::with_capacity(WRITE_CHUNK * 2),
            written: 0,
            now: now_ns(),
            reply: None,
            dead: None,
            close_ok: false,
            driving: false,
            finished: None,
        };
        Conn { stream, rd: Reader::new(READ_BUFFER, max_frame), st }
    }

    /// Queues raw bytes (the protocol header).
    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.st.out.extend_from_slice(bytes);
    }

    /// The write buffer.
    pub fn out_mut(&mut self) -> &mut Vec<u8> {
        &mut self.st.out
    }

    /// Applies connection.tune's frame-max (bytes) and channel-max.
    pub fn set_limits(&mut self, frame_max: u32, channel_max: u16) {
        self.st.frame_max = frame_max;
        self.st.channel_max = channel_max;
        self.rd.set_max_frame(frame_max as usize);
    }

    /// The next free channel number, `None` past channel-max.
    pub fn next_channel(&mut self) -> Option<u16> {
        let n = u16::try_from(self.st.chans.len() + 1).ok().filter(|&n| n <= self.st.channel_max)?;
        self.st.chans.push(Chan { role: Role::Idle, content: Content::None, open: true });
        Some(n)
    }

    /// Sets what channel `ch` does.
    pub fn set_role(&mut self, ch: u16, role: Role) {
        self.st.chans[usize::from(ch) - 1].role = role;
    }

    /// Makes channel `ch` producer `index`: encodes its publish templates.
    pub fn add_producer(&mut self, ch: u16, index: u16) {
        let cfg = &self.st.env.cfg;
        let (rk, props) = target(cfg, usize::from(index));
        let publish =
            basic::Publish { exchange: cfg.exchange.name.as_str().into(), routing_key: rk, mandatory: cfg.mandatory, immediate: false };
        let mut head = Vec::new();
        method(&mut head, ch, &AMQPClass::Basic(basic::AMQPMethod::Publish(publish)));
        let chunk = (self.st.frame_max as usize).saturating_sub(FRAME_OVERHEAD).max(body::HEADER_LEN);
        let mut bodies = Vec::with_capacity(cfg.size + cfg.size / chunk * FRAME_OVERHEAD + FRAME_OVERHEAD);
        let zeros = vec![0u8; chunk.min(cfg.size)];
        let mut left = cfg.size;
        while left > 0 {
            let n = left.min(chunk);
            frame(&mut bodies, FRAME_BODY, ch, &zeros[..n]);
            left -= n;
        }
        let variants = u16::from(cfg.priorities).max(1);
        let mut templates = Vec::with_capacity(usize::from(variants));
        let mut body_at = 0;
        for p in 0..variants {
            let props = if cfg.priorities > 0 { props.clone().with_priority(p as u8) } else { props.clone() };
            let header = AMQPFrame::Header(ch, AMQPContentHeader { class_id: 60, body_size: cfg.size as u64, properties: props });
            let mut t = head.clone();
            t = cookie_factory::gen_simple(gen_frame(&header), t).expect("encode a content header");
            body_at = t.len() + 7;
            t.extend_from_slice(&bodies);
            templates.push(t);
        }
        let window = VecDeque::with_capacity(cfg.confirm as usize);
        let schedule = Schedule::new(0, index, 1, 0.0);
        let p = Producer { index, templates, body_at, sent: 0, schedule, window, base: 1, stop_at: None, done: false };
        self.set_role(ch, Role::Producer(Box::new(p)));
    }

    /// Arms every producer: fixed-rate schedules start at `schedule_start` (ns), each
    /// producer's shifted by its share of one interval; `finished` is called once per
    /// producer when it is done.
    pub fn start_publishing(&mut self, schedule_start: u64, finished: Rc<dyn Fn()>) {
        let cfg = &self.st.env.cfg;
        for c in &mut self.st.chans {
            if let Role::Producer(p) = &mut c.role {
                p.schedule = Schedule::new(schedule_start, p.index, cfg.producers, cfg.rate);
            }
        }
        self.st.finished = Some(finished);
    }

    /// Waits for the next setup reply on channel `ch`, handling every other frame (such as
    /// deliveries on channels already consuming) on the way.
    pub async fn reply(&mut self, ch: u16) -> Result<AMQPClass, String> {
        poll_fn(|cx| loop {
            if let Some((c, r)) = self.st.reply.take() {
                if c == ch {
                    return Poll::Ready(r);
                }
            }
            if let Some(e) = &self.st.dead {
                return Poll::Ready(Err(e.clone()));
            }
            if let Err(e) = self.poll_write(cx) {
                return Poll::Ready(Err(e));
            }
            match self.poll_read(cx) {
                Ok(true) => continue,
                Ok(false) => return Poll::Pending,
                Err(e) => return Poll::Ready(Err(e)),
            }
        })
        .await
    }

    /// Writes what the buffer holds until the socket would block.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Result<(), String> {
        let st = &mut self.st;
        while st.written < st.out.len() {
            match self.stream.poll_write_ready(cx) {
                Poll::Pending => break,
                Poll::Ready(Err(e)) => return Err(format!("write: {e}")),
                Poll::Ready(Ok(())) => {}
            }
            match self.stream.try_write(&st.out[st.written..]) {
                Ok(n) => st.written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(format!("write: {e}")),
            }
        }
        if st.written == st.out.len() {
            st.out.clear();
            st.written = 0;
        } else if st.written >= OUT_CAP {
            st.out.drain(..st.written);
            st.written = 0;
        }
        Ok(())
    }

    /// Reads (up to [`READS_PER_PASS`] times) and handles every whole frame; true when
    /// anything was read. Registers the task for readability once the socket is drained;
    /// when it returns true the socket may hold more, and the caller must call again.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Result<bool, String> {
        let mut any = false;
        for _ in 0..READS_PER_PASS {
            match self.stream.poll_read_ready(cx) {
                Poll::Pending => return Ok(any),
                Poll::Ready(Err(e)) => return Err(format!("read: {e}")),
                Poll::Ready(Ok(())) => {}
            }
            match self.stream.try_read(self.rd.spare()) {
                Ok(0) => return Err("the broker closed the socket".into()),
                Ok(n) => {
                    any = true;
                    self.rd.filled(n);
                    self.st.now = now_ns();
                    while let Some(f) = self.rd.next()? {
                        self.st.on_frame(f.kind, f.channel, f.payload)?;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(format!("read: {e}")),
            }
        }
        Ok(any)
    }

    /// Drives the connection until consumers stop (then closes it) or it fails. Errors are
    /// counted in the run's figures.
    pub async fn drive(mut self) {
        let env = self.st.env.clone();
        self.st.driving = true;
        let stop_producing = env.stop_producing.register();
        let stop_consuming = env.stop_consuming.register();
        let mut pacer: Option<Pacer> = None;
        let mut timer: Option<Pin<Box<tokio::time::Sleep>>> = None;
        let mut closing_until: Option<u64> = None;
        poll_fn(|cx| {
            for _ in 0..PASSES_PER_POLL {
                let read = self.poll_read(cx);
                let unread = matches!(read, Ok(true)); // more may wait in the socket
                if closing_until.is_some() && (self.st.close_ok || read.is_err()) {
                    return Poll::Ready(());
                }
                if let Err(e) = read {
                    self.st.dead.get_or_insert(e);
                }
                if let Some(why) = self.st.dead.take() {
                    env.stats.error(why);
                    self.st.finish_all();
                    let _ = self.poll_write(cx); // a close-ok, if the broker closed
                    return Poll::Ready(());
                }
                if closing_until.is_none() && env.stop_consuming.poll_fired(stop_consuming, cx).is_ready() {
                    self.st.flush_acks();
                    self.st.finish_all();
                    let close = connection::Close { reply_code: 200, reply_text: "bench done".into(), class_id: 0, method_id: 0 };
                    method(&mut self.st.out, 0, &AMQPClass::Connection(connection::AMQPMethod::Close(close)));
                    closing_until = Some(now_ns() + CLOSE_TIMEOUT.as_nanos() as u64);
                }
                let stopping = env.stop_producing.poll_fired(stop_producing, cx).is_ready();
                let plan = if closing_until.is_none() { self.st.publish(now_ns(), stopping) } else { Plan::default() };
                if let Err(e) = self.poll_write(cx) {
                    self.st.dead = Some(e);
                    continue;
                }
                if unread || (plan.more && self.st.out.len() - self.st.written < OUT_CAP) {
                    continue;
                }
                if plan.flushing && self.st.out.len() == self.st.written {
                    continue; // written now: the stopping producer is done
                }
                // (with the buffer full, the socket's write readiness wakes us)
                // Nothing to do before the socket, a confirm, the pacer or a deadline.
                if let Some(due) = plan.due {
                    let p = match &mut pacer {
                        Some(p) => p,
                        None => match Pacer::new() {
                            Ok(p) => pacer.insert(p),
                            Err(e) => {
                                self.st.dead = Some(format!("timerfd: {e}"));
                                continue;
                            }
                        },
                    };
                    if p.poll_until(cx, due).is_ready() {
                        continue;
                    }
                }
                if let Some(at) = plan.deadline.into_iter().chain(closing_until).min() {
                    let when = tokio::time::Instant::now() + std::time::Duration::from_nanos(at.saturating_sub(now_ns()));
                    let t = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(when)));
                    if t.deadline() != when {
                        t.as_mut().reset(when);
                    }
                    if t.as_mut().poll(cx).is_ready() {
                        if closing_until.is_some_and(|c| now_ns() >= c) {
                            return Poll::Ready(());
                        }
                        continue;
                    }
                }
                return Poll::Pending;
            }
            // Busy: let the other connections run.
            cx.waker().wake_by_ref();
            Poll::Pending
        })
        .await;
    }
}

impl State {
    /// Handles one frame read from the broker.
    fn on_frame(&mut self, kind: u8, ch: u16, payload: &[u8]) -> Result<(), String> {
        if ch == 0 {
            if kind == FRAME_METHOD {
                return self.on_slow_method(0, payload);
            }
            return Ok(()); // heartbeats
        }
        let Some(c) = self.chans.get_mut(usize::from(ch) - 1) else {
            return Err(format!("frame on channel {ch}, which was never opened"));
        };
        match kind {
            FRAME_METHOD => {
                if payload.len() < 4 {
                    return Err(format!("method frame of {} bytes on channel {ch}", payload.len()));
                }
                let id = (u16::from_be_bytes([payload[0], payload[1]]), u16::from_be_bytes([payload[2], payload[3]]));
                let args = &payload[4..];
                match id {
                    (60, 60) => {
                        let (tag, redelivered) = parse_deliver(args).ok_or("malformed basic.deliver")?;
                        let head = [0; body::HEADER_LEN];
                        c.content = Content::Deliver { tag, redelivered, size: 0, left: u64::MAX, head, have: 0 };
                    }
                    (60, 80) | (60, 120) if args.len() >= 9 => {
                        let tag = u64::from_be_bytes(args[..8].try_into().expect("8 bytes"));
                        if let Role::Producer(p) = &mut c.role {
                            p.settle(&self.env.stats, tag, args[8] & 1 != 0, id.1 == 80, self.now);
                        }
                    }
                    (60, 50) => {
                        c.content = Content::Skip { left: u64::MAX };
                        Stats::bump(&self.env.stats.returned, 1);
                        if self.env.producers_done.get() {
                            self.env.check_drained();
                        }
                    }
                    _ => return self.on_slow_method(ch, payload),
                }
            }
            FRAME_HEADER if payload.len() >= 12 => {
                let size = u64::from_be_bytes(payload[4..12].try_into().expect("8 bytes"));
                match &mut c.content {
                    Content::Deliver { size: s, left, .. } => {
                        (*s, *left) = (size, size);
                        if size == 0 {
                            self.complete(ch, &[]);
                        }
                    }
                    Content::Skip { left } => {
                        *left = size;
                        if size == 0 {
                            c.content = Content::None;
                        }
                    }
                    Content::None => return Err(format!("content header without a method on channel {ch}")),
                }
            }
            FRAME_BODY => match &mut c.content {
                Content::Deliver { left, head, have, .. } => {
                    let n = payload.len() as u64;
                    if *left == u64::MAX || n > *left {
                        return Err(format!("body frame beyond the content's size on channel {ch}"));
                    }
                    *left -= n;
                    if *have == 0 && *left == 0 {
                        self.complete(ch, payload); // the whole body in one frame: read in place
                    } else {
                        let take = (head.len() - *have).min(payload.len());
                        head[*have..*have + take].copy_from_slice(&payload[..take]);
                        *have += take;
                        if *left == 0 {
                            let (head, have) = (*head, *have);
                            self.complete(ch, &head[..have]);
                        }
                    }
                }
                Content::Skip { left } => {
                    *left = left.saturating_sub(payload.len() as u64);
                    if *left == 0 {
                        c.content = Content::None;
                    }
                }
                Content::None => return Err(format!("body frame without a method on channel {ch}")),
            },
            _ => {}
        }
        Ok(())
    }

    /// A delivery on `ch` is complete; `head` is its body or the body's first bytes.
    fn complete(&mut self, ch: u16, head: &[u8]) {
        let c = &mut self.chans[usize::from(ch) - 1];
        let Content::Deliver { tag, redelivered, size, .. } = std::mem::replace(&mut c.content, Content::None) else { return };
        let Role::Consumer { qi, pending, last_tag } = &mut c.role else { return };
        self.env.on_delivery(*qi, head, size, redelivered, self.now);
        if !self.env.cfg.auto_ack {
            *pending += 1;
            *last_tag = tag;
            let every = self.env.cfg.multi_ack_every;
            if *pending >= every {
                *pending = 0;
                basic_ack(&mut self.out, ch, tag, every > 1);
            }
        }
    }

    /// Methods off the hot path, decoded by amq-protocol.
    fn on_slow_method(&mut self, ch: u16, payload: &[u8]) -> Result<(), String> {
        use AMQPClass as C;
        let Ok((_, m)) = parse_class(payload) else {
            return Err(format!("undecodable method on channel {ch}"));
        };
        match m {
            C::Connection(connection::AMQPMethod::Close(c)) => {
                method(&mut self.out, 0, &C::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})));
                self.dead = Some(format!("the broker closed the connection: {} {}", c.reply_code, c.reply_text.as_str()));
            }
            C::Connection(connection::AMQPMethod::CloseOk(_)) => self.close_ok = true,
            C::Connection(connection::AMQPMethod::Blocked(_) | connection::AMQPMethod::Unblocked(_)) => {}
            C::Channel(channel::AMQPMethod::Close(_)) if ch == 0 => return Err("channel.close on channel 0".into()),
            C::Channel(channel::AMQPMethod::Close(c)) => {
                method(&mut self.out, ch, &C::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})));
                let why = format!("the broker closed channel {ch}: {} {}", c.reply_code, c.reply_text.as_str());
                let chan = &mut self.chans[usize::from(ch) - 1];
                chan.open = false;
                if let Role::Producer(p) = &mut chan.role {
                    p.finish(self.finished.as_ref());
                }
                if !self.driving {
                    self.reply = Some((ch, Err(why))); // during setup: the call fails
                } else {
                    self.env.stats.error(why);
                }
            }
            C::Basic(basic::AMQPMethod::Cancel(c)) => {
                self.env.stats.error(format!("the broker cancelled consumer {}", c.consumer_tag.as_str()));
            }
            m => self.reply = Some((ch, Ok(m))),
        }
        Ok(())
    }

    /// Acks what every consumer has not acked yet (multiple=true).
    fn flush_acks(&mut self) {
        for (i, c) in self.chans.iter_mut().enumerate() {
            if let (Role::Consumer { pending, last_tag, .. }, true) = (&mut c.role, c.open) {
                if *pending > 0 && !self.env.cfg.auto_ack {
                    *pending = 0;
                    basic_ack(&mut self.out, i as u16 + 1, *last_tag, true);
                }
            }
        }
    }

    /// Marks every producer done (reporting each once).
    fn finish_all(&mut self) {
        for c in &mut self.chans {
            if let Role::Producer(p) = &mut c.role {
                p.finish(self.finished.as_ref());
            }
        }
    }

    /// One publishing pass over every producer at `now` (ns); `stopping` once the run's
    /// publishing phase is over.
    fn publish(&mut self, now: u64, stopping: bool) -> Plan {
        let mut plan = Plan::default();
        if self.finished.is_none() {
            return plan; // consumers' connection, or producers not started
        }
        let env = &*self.env;
        let cfg = &env.cfg;
        let stats = &env.stats;
        let rate = cfg.rate;
        let window = cfg.confirm as usize;
        let limit = cfg.message_limit();
        for c in &mut self.chans {
            let Role::Producer(p) = &mut c.role else { continue };
            if p.done {
                continue;
            }
            if stopping || p.sent >= limit {
                let stop_at = *p.stop_at.get_or_insert_with(|| {
                    if rate > 0.0 {
                        Stats::bump(&stats.behind_schedule, p.schedule.behind_at_stop(now, p.sent, limit));
                    }
                    now + (cfg.drain_timeout_s * 1e9) as u64
                });
                let flushed = p.window.is_empty() && (window > 0 || self.out.len() == self.written);
                if flushed || now >= stop_at {
                    p.finish(self.finished.as_ref());
                } else {
                    plan.deadline = earliest(plan.deadline, stop_at);
                    plan.flushing |= window == 0;
                }
                continue;
            }
            let mut budget = BATCH.min((limit - p.sent) as usize);
            if window > 0 {
                budget = budget.min(window.saturating_sub(p.window.len()));
            }
            if rate > 0.0 {
                let next = p.schedule.intended_at(p.sent);
                if next > now {
                    plan.due = earliest(plan.due, next);
                    continue;
                }
                budget = budget.min(p.schedule.due_by(now).saturating_sub(p.sent) as usize);
            }
            if self.out.len() - self.written >= OUT_CAP {
                plan.more = true; // once the socket took some of it
                continue;
            }
            let sent_before = p.sent;
            for _ in 0..budget {
                let intended = if rate > 0.0 {
                    let t = p.schedule.intended_at(p.sent);
                    stats.send_lag.borrow_mut().record_ns(now.saturating_sub(t));
                    t
                } else {
                    now
                };
                let t = &p.templates[if cfg.priorities > 0 { (p.sent % u64::from(cfg.priorities)) as usize } else { 0 }];
                let at = self.out.len() + p.body_at;
                self.out.extend_from_slice(t);
                if cfg.size >= body::HEADER_LEN {
                    let tag = Tag { run: env.run_id, producer: p.index, seq: p.sent as u32 };
                    body::encode(&mut self.out[at..at + body::HEADER_LEN], tag, intended);
                }
                if window > 0 {
                    p.window.push_back((intended, false));
                }
                p.sent += 1;
                if self.out.len() - self.written >= WRITE_CHUNK {
                    break;
                }
            }
            Stats::bump(&stats.sent, p.sent - sent_before);
            if p.sent < limit && (window == 0 || p.window.len() < window) {
                if rate > 0.0 {
                    plan.due = earliest(plan.due, p.schedule.intended_at(p.sent));
                } else {
                    plan.more = true;
                }
            } else if p.sent >= limit && window == 0 {
                // Its last message is encoded: once written, the next pass finishes it.
                plan.flushing = true;
            }
        }
        plan
    }
}

impl Producer {
    /// Marks it done and reports that to the run (`finished`) once, however many of the
    /// paths that end a producer (drained, channel closed, connection over) it takes.
    fn finish(&mut self, finished: Option<&Rc<dyn Fn()>>) {
        if !std::mem::replace(&mut self.done, true) {
            if let Some(f) = finished {
                f();
            }
        }
    }

    /// A basic.ack (`ack`) or basic.nack from the broker for publish `tag` (and all before
    /// it when `multiple`), seen at `now` (ns).
    fn settle(&mut self, stats: &Stats, tag: u64, multiple: bool, ack: bool, now: u64) {
        let one = |intended: u64| {
            if ack {
                Stats::bump(&stats.confirmed, 1);
                stats.record_confirm(now.saturating_sub(intended));
            } else {
                Stats::bump(&stats.nacked, 1);
            }
        };
        if multiple {
            while self.base <= tag {
                let Some((intended, settled)) = self.window.pop_front() else { break };
                if !settled {
                    one(intended);
                }
                self.base += 1;
            }
        } else if let Some(e) = tag.checked_sub(self.base).and_then(|i| self.window.get_mut(i as usize)) {
            if !e.1 {
                e.1 = true;
                one(e.0);
            }
        }
        while self.window.front().is_some_and(|e| e.1) {
            self.window.pop_front();
            self.base += 1;
        }
    }
}

/// basic.deliver's delivery-tag and redelivered flag (the arguments after class and method
/// ids: consumer-tag, delivery-tag, redelivered, exchange, routing-key).
fn parse_deliver(args: &[u8]) -> Option<(u64, bool)> {
    let ctag = usize::from(*args.first()?);
    let rest = args.get(1 + ctag..)?;
    let tag = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
    Some((tag, rest.get(8)? & 1 != 0))
}

/// Appends basic.ack (spec 1.8.3.13) without going through the generic encoder.
fn basic_ack(out: &mut Vec<u8>, ch: u16, tag: u64, multiple: bool) {
    let mut p = [0u8; 13];
    p[..4].copy_from_slice(&[0, 60, 0, 80]);
    p[4..12].copy_from_slice(&tag.to_be_bytes());
    p[12] = u8::from(multiple);
    frame(out, FRAME_METHOD, ch, &p);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn producer() -> Producer {
        Producer {
            index: 0,
            templates: Vec::new(),
            body_at: 0,
            sent: 0,
            schedule: Schedule::new(0, 0, 1, 0.0),
            window: VecDeque::new(),
            base: 1,
            stop_at: None,
            done: false,
        }
    }

    #[test]
    fn confirms_settle_each_publish_once_in_any_order() {
        let stats = Stats::default();
        let mut p = producer();
        p.window.extend((0..6).map(|i| (i * 10, false))); // publishes 1..=6
        p.settle(&stats, 3, false, true, 100); // 3 alone: 1 and 2 stay
        assert_eq!((p.base, p.window.len(), stats.confirmed.get()), (1, 6, 1));
        p.settle(&stats, 2, false, false, 100); // 2 nacked
        p.settle(&stats, 4, true, true, 100); // 1..=4: only 1 and 4 are new
        assert_eq!((stats.confirmed.get(), stats.nacked.get()), (3, 1));
        assert_eq!((p.base, p.window.len()), (5, 2));
        p.settle(&stats, 4, true, true, 100); // a repeat changes nothing
        p.settle(&stats, 99, false, true, 100); // nor a tag never published
        assert_eq!((stats.confirmed.get(), p.base), (3, 5));
        p.settle(&stats, 6, true, true, 100);
        assert_eq!((stats.confirmed.get(), p.base, p.window.len()), (5, 7, 0));
    }

    #[test]
    fn deliver_arguments_are_read_in_place() {
        let mut args = vec![3, b'a', b'b', b'c'];
        args.extend_from_slice(&77u64.to_be_bytes());
        args.push(1);
        args.extend_from_slice(&[0, 1, b'q']);
        assert_eq!(parse_deliver(&args), Some((77, true)));
        assert_eq!(parse_deliver(&args[..8]), None, "cut short");
        assert_eq!(parse_deliver(&[200]), None);
    }
}
