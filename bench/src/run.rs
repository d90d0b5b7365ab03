//! The publish/consume engine behind throughput, latency, fanout, many-queues and backlog.
//!
//! # Shape of a run
//! 1. Connect, declare (and purge) the topology, register consumers (backlog: later).
//! 2. t0: read broker and bench CPU time; producers start.
//! 3. Producers stop at --duration, at --messages, or on Ctrl-C, then wait for their
//!    outstanding confirms (bounded by --drain-timeout).
//! 4. Consumers drain until every message published (minus nacked/returned) arrived, or
//!    --drain-timeout passes. t_end: CPU times read again.
//! 5. Consumers flush their acks, connections close, the queues' remaining depth is read
//!    (so "lost" excludes what is merely still queued), the topology is deleted.
//!
//! Every wait is bounded: a stalled broker cannot keep the bench alive past
//! setup + duration + drain + teardown (and main.rs adds a watchdog on top).
//!
//! # Assumptions
//! Single-threaded runtime: all tasks share `Env` through `Rc` without locks. lapin runs
//! one I/O thread per connection; those threads are the only other bench threads.

use crate::amqp::{self, within};
use crate::body::{self, Tag};
use crate::cli::{Config, Engine, ExchangeType, Scenario};
use crate::clock::{now_ns, Pacer, Schedule};
use crate::error::BenchError;
use crate::procfs;
use crate::report::{Outcome, Window};
use crate::signal::Signal;
use crate::stats::{fmt_us, Snapshot, Stats};
use crate::tracker::Tracker;
use futures_lite::Stream;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::rc::Rc;
use std::task::Poll;
use std::time::Duration;

/// Publishes sent per poll before a producer yields to other tasks.
const BATCH: usize = 64;
/// Without confirms, check for basic.return every this many publishes.
const RETURN_CHECK_EVERY: u32 = 1024;

/// State shared by every task of one run.
pub struct Env {
    /// Resolved flags.
    pub cfg: Config,
    /// Counters and histograms.
    pub stats: Stats,
    /// Arrivals, for loss and duplicates.
    pub tracker: RefCell<Tracker>,
    /// Random id in every body of this run.
    pub run_id: u16,
    /// Producers stop sending.
    pub stop_producing: Signal,
    /// Consumers stop consuming.
    pub stop_consuming: Signal,
    /// Every expected message arrived.
    pub drained: Signal,
    /// Ctrl-C.
    pub interrupt: Rc<Signal>,
    /// All producers have finished: the expected count is final.
    pub producers_done: Cell<bool>,
    /// Progress ticker stops.
    pub stop_ticker: Signal,
    /// Broker process, if local.
    pub broker_pid: Option<u32>,
    /// Largest broker RSS seen (bytes).
    pub broker_rss_max: Cell<u64>,
    /// Bodies carry tag and timestamp (size ≥ 16).
    pub tracking: bool,
}

impl Env {
    /// Copies of each message the queues should receive in total: publishes minus nacked
    /// and returned, times the number of queues each reaches.
    pub fn expected(&self) -> u64 {
        let s = &self.stats;
        let per = if self.cfg.fanout { self.cfg.queues.len() as u64 } else { 1 };
        s.sent.get().saturating_sub(s.nacked.get() + s.returned.get()) * per
    }

    /// Messages of this run received at least once.
    pub fn arrived(&self) -> u64 {
        if self.tracking {
            self.tracker.borrow().unique
        } else {
            self.stats.received.get()
        }
    }

    /// Fires `drained` once producers are done and every expected message arrived.
    pub(crate) fn check_drained(&self) {
        if self.producers_done.get() && self.arrived() >= self.expected() {
            self.drained.fire();
        }
    }

    /// Accounts one delivery of `len` body bytes seen at `now` (ns) on queue index `qi`;
    /// `head` is the body or its first [`body::HEADER_LEN`] bytes.
    pub(crate) fn on_delivery(&self, qi: usize, head: &[u8], len: u64, redelivered: bool, now: u64) {
        let s = &self.stats;
        Stats::bump(&s.received, 1);
        Stats::bump(&s.received_bytes, len);
        s.last_receive_ns.set(now);
        if redelivered {
            Stats::bump(&s.redelivered, 1);
        }
        if self.tracking {
            match body::decode(head) {
                Some((tag, sent)) if tag.run == self.run_id => {
                    s.record_e2e(now.saturating_sub(sent));
                    self.tracker.borrow_mut().record(qi, tag.producer, tag.seq);
                }
                _ => Stats::bump(&s.foreign, 1),
            }
        }
        if self.producers_done.get() {
            self.check_drained();
        }
    }
}

/// Runs a publish/consume scenario and returns its figures.
///
/// # Errors
/// Connect and setup failures; everything after setup is counted in the figures instead.
pub async fn run(cfg: Config, interrupt: Rc<Signal>) -> Result<Outcome, BenchError> {
    let run_id = (now_ns() ^ (u64::from(std::process::id()) << 20)) as u16 | 1;
    let setup_conn = amqp::connect(&cfg.uri, "ringmq-bench setup").await?;
    let setup_ch = amqp::channel(&setup_conn).await?;
    amqp::declare_topology(&setup_ch, &cfg).await?;
    let env = Rc::new(Env {
        broker_pid: amqp::broker_pid(&cfg),
        tracker: RefCell::new(Tracker::new(cfg.queues.len())),
        tracking: cfg.size >= body::HEADER_LEN,
        cfg,
        stats: Stats::default(),
        run_id,
        stop_producing: Signal::default(),
        stop_consuming: Signal::default(),
        drained: Signal::default(),
        interrupt,
        producers_done: Cell::new(false),
        stop_ticker: Signal::default(),
        broker_rss_max: Cell::new(0),
    });
    let cfg = &env.cfg;
    if !env.tracking {
        eprintln!("note: --size {} < {}: no latency, loss or duplicate figures", cfg.size, body::HEADER_LEN);
    }
    let backlog = cfg.scenario == Scenario::Backlog;

    let raw = cfg.engine == Engine::Raw;
    let mut conns: Vec<Connection> = Vec::new();
    let mut consumer_tasks = Vec::new();
    if !backlog {
        consumer_tasks = start_consumers(&env, &mut conns).await?;
    }
    let (producers, raw_producers) =
        if raw { (Vec::new(), crate::raw::open_producers(&env).await?) } else { (open_producers(&env, &mut conns).await?, Vec::new()) };

    let mut w = Window::start(env.broker_pid);
    let ticker = tokio::task::spawn_local(ticker(env.clone(), w.t0_ns));
    let n_producers = if raw { cfg.producers as usize } else { producers.len() };
    let finished = Rc::new(Cell::new(0usize));
    let all_finished = Rc::new(Signal::default());
    let return_channels: Rc<RefCell<Vec<Channel>>> = Rc::default();
    // Fixed rate: every producer's schedule starts at one instant, a little after all of
    // them are spawned (20 ms + 20 µs per producer), so that setting up 1,000 producers
    // is not reported as the first messages' latency.
    let schedule_start = now_ns() + 20_000_000 + 20_000 * n_producers as u64;
    let (f, done) = (finished.clone(), all_finished.clone());
    let on_finished: Rc<dyn Fn()> = Rc::new(move || {
        f.set(f.get() + 1);
        if f.get() == n_producers {
            done.fire();
        }
    });
    for (i, (ch, ex, rk, props)) in producers.into_iter().enumerate() {
        let (env, on_finished, return_channels) = (env.clone(), on_finished.clone(), return_channels.clone());
        tokio::task::spawn_local(async move {
            if let Some(ch) = producer(env, ch, i as u16, schedule_start, ex, rk, props).await {
                return_channels.borrow_mut().push(ch);
            }
            on_finished();
        });
    }
    // Raw producer connections live until consumers stop (they count late returns), and
    // are awaited with the consumers.
    let mut producer_tasks = crate::raw::start_producers(raw_producers, schedule_start, on_finished);
    if n_producers == 0 {
        all_finished.fire();
    }

    // Publishing phase: until --duration, all producers done, or Ctrl-C.
    let drain = Duration::from_secs_f64(cfg.drain_timeout_s);
    let finished_id = all_finished.register();
    {
        let interrupted = env.interrupt.fired(env.interrupt.register());
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs_f64(cfg.duration_s)) => {}
            _ = all_finished.fired(finished_id) => {}
            _ = interrupted => {}
        }
    }
    env.stop_producing.fire();
    w.send_end_ns = now_ns();
    // Producers now wait for outstanding confirms, each bounded by the drain timeout.
    let _ = tokio::time::timeout(drain + Duration::from_secs(1), all_finished.fired(finished_id)).await;
    env.producers_done.set(true);

    if backlog {
        wait_backlog_stored(&env, &setup_ch).await;
        w.fill_end_ns = Some(now_ns());
        eprintln!("backlog: {} messages published, draining", env.stats.sent.get());
        w.drain_start_ns = Some(now_ns());
        w.drain_cpu0 = Some(Window::cpu_now(env.broker_pid));
        consumer_tasks = start_consumers(&env, &mut conns).await?;
    }
    consumer_tasks.append(&mut producer_tasks);

    // Drain. Producers without confirms but with --mandatory hand back their channel so
    // late basic.return frames are still counted (they lower the expected count).
    let return_channels = return_channels.borrow().clone();
    let drained_id = env.drained.register();
    let drain_deadline = tokio::time::Instant::now() + drain;
    loop {
        for ch in &return_channels {
            poll_fn(|cx| {
                count_returns(ch, &env.stats, cx);
                Poll::Ready(())
            })
            .await;
        }
        env.check_drained();
        if env.drained.is_fired() || tokio::time::Instant::now() >= drain_deadline {
            break;
        }
        let step = if return_channels.is_empty() { drain } else { Duration::from_millis(50) };
        let _ = tokio::time::timeout_at(drain_deadline.min(tokio::time::Instant::now() + step), env.drained.fired(drained_id)).await;
    }
    w.finish();

    env.stop_consuming.fire();
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        for t in consumer_tasks.iter_mut() {
            let _ = t.await;
        }
    })
    .await;
    env.stop_ticker.fire();
    let _ = tokio::time::timeout(Duration::from_secs(2), ticker).await;
    env.stats.roll_tick();

    // Teardown, bounded as a whole: a stalled broker costs at most TEARDOWN more.
    let mut depths = vec![None; cfg.queues.len()];
    let _ = tokio::time::timeout(amqp::TEARDOWN, async {
        let closes: Vec<_> = conns.into_iter().map(|c| tokio::task::spawn_local(async move { amqp::close(&c).await })).collect();
        for c in closes {
            let _ = c.await;
        }
        depths = amqp::queue_depths(&setup_ch, &cfg.queues).await;
        if !cfg.predeclared && !cfg.keep_queues {
            amqp::delete_topology(&setup_ch, cfg).await;
        }
        amqp::close(&setup_conn).await;
    })
    .await;
    Ok(Outcome::from_pubsub(&env, &w, &depths))
}

/// Backlog: waits until the broker reports the whole backlog queued (or it stops
/// growing for 2 s; at most 120 s).
async fn wait_backlog_stored(env: &Env, ch: &Channel) {
    let expected = env.expected();
    let mut last = 0u64;
    let mut same = 0;
    let deadline = now_ns() + 120_000_000_000;
    while now_ns() < deadline && !env.interrupt.is_fired() {
        let depth: u64 = amqp::queue_depths(ch, &env.cfg.queues).await.into_iter().flatten().sum();
        if depth >= expected {
            return;
        }
        same = if depth == last { same + 1 } else { 0 };
        if same >= 10 {
            eprintln!("backlog: queue depth stuck at {depth} of {expected}");
            return;
        }
        last = depth;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Opens channels on connections shared by up to --channels-per-connection users.
async fn channels_for(env: &Env, conns: &mut Vec<Connection>, role: &str, n: u32) -> Result<Vec<Channel>, BenchError> {
    let per = env.cfg.channels_per_connection as usize;
    let mut out = Vec::with_capacity(n as usize);
    let mut current: Option<usize> = None;
    for i in 0..n as usize {
        if i % per == 0 {
            let c = amqp::connect(&env.cfg.uri, &format!("ringmq-bench {role} {}", i / per)).await?;
            conns.push(c);
            current = Some(conns.len() - 1);
        }
        let conn = &conns[current.expect("set at i = 0")];
        out.push(amqp::channel(conn).await?);
    }
    Ok(out)
}

type Target = (Channel, ShortString, ShortString, BasicProperties);

async fn open_producers(env: &Env, conns: &mut Vec<Connection>) -> Result<Vec<Target>, BenchError> {
    let cfg = &env.cfg;
    let chans = channels_for(env, conns, "producer", cfg.producers).await?;
    let mut out = Vec::with_capacity(chans.len());
    for (i, ch) in chans.into_iter().enumerate() {
        if cfg.confirm > 0 {
            within(amqp::OP_TIMEOUT, "confirm.select", ch.confirm_select(ConfirmSelectOptions::default()))
                .await
                .map_err(BenchError::Setup)?;
        }
        let (rk, props) = target(cfg, i);
        out.push((ch, cfg.exchange.name.as_str().into(), rk, props));
    }
    Ok(out)
}

/// Routing key and properties of producer `i`'s publishes (its queue is `i` modulo the
/// queue count).
pub(crate) fn target(cfg: &Config, i: usize) -> (ShortString, BasicProperties) {
    let queue = &cfg.queues[i % cfg.queues.len()];
    let mut props = BasicProperties::default();
    if cfg.persistent {
        props = props.with_delivery_mode(2);
    }
    if let Some(ms) = cfg.expiration {
        props = props.with_expiration(ms.to_string().into());
    }
    let rk: ShortString = match cfg.exchange.kind {
        ExchangeType::Fanout => "".into(),
        ExchangeType::Headers => {
            props = props.with_headers(amqp::headers_for(queue, false));
            "".into()
        }
        _ => queue.as_str().into(),
    };
    (rk, props)
}

async fn start_consumers(env: &Rc<Env>, conns: &mut Vec<Connection>) -> Result<Vec<tokio::task::JoinHandle<()>>, BenchError> {
    let cfg = &env.cfg;
    if (cfg.consumers as usize) < cfg.queues.len() {
        eprintln!("note: {} queues but {} consumers: some queues are not drained", cfg.queues.len(), cfg.consumers);
    }
    if cfg.engine == Engine::Raw {
        return crate::raw::start_consumers(env).await;
    }
    let chans = channels_for(env, conns, "consumer", cfg.consumers).await?;
    let mut tasks = Vec::with_capacity(chans.len());
    for (i, ch) in chans.into_iter().enumerate() {
        let qi = i % cfg.queues.len();
        if !cfg.auto_ack && cfg.prefetch > 0 {
            within(amqp::OP_TIMEOUT, "basic.qos", ch.basic_qos(cfg.prefetch, BasicQosOptions::default()))
                .await
                .map_err(BenchError::Setup)?;
        }
        let opts = BasicConsumeOptions { no_ack: cfg.auto_ack, ..Default::default() };
        let consumer = within(
            amqp::OP_TIMEOUT,
            "basic.consume",
            ch.basic_consume(cfg.queues[qi].as_str().into(), format!("ringmq-bench-{i}").into(), opts, FieldTable::default()),
        )
        .await
        .map_err(BenchError::Setup)?;
        tasks.push(tokio::task::spawn_local(consume(env.clone(), ch, consumer, qi)));
    }
    Ok(tasks)
}

/// One consumer: counts deliveries, records e2e latency, acks every N (multiple=true
/// when N > 1). Acks are written without waiting for the client library to flush them
/// (the frame is queued on the first poll), so acking costs no round trip to its I/O
/// thread; the final ack is awaited.
async fn consume(env: Rc<Env>, ch: Channel, mut consumer: lapin::Consumer, qi: usize) {
    let stop_id = env.stop_consuming.register();
    let every = env.cfg.multi_ack_every;
    let manual = !env.cfg.auto_ack;
    let mut pending = 0u32;
    let mut last_tag = 0u64;
    loop {
        let next = poll_fn(|cx| {
            if env.stop_consuming.poll_fired(stop_id, cx).is_ready() {
                return Poll::Ready(None);
            }
            Pin::new(&mut consumer).poll_next(cx)
        })
        .await;
        let d = match next {
            None => break,
            Some(Err(e)) => {
                env.stats.error(format!("consumer {qi}: {e}"));
                break;
            }
            Some(Ok(d)) => d,
        };
        env.on_delivery(qi, &d.data, d.data.len() as u64, d.redelivered, now_ns());
        if manual {
            pending += 1;
            last_tag = d.delivery_tag;
            if pending >= every {
                pending = 0;
                let f = ch.basic_ack(last_tag, BasicAckOptions { multiple: every > 1 });
                if let Some(Err(e)) = futures_lite::future::poll_once(f).await {
                    env.stats.error(format!("basic.ack: {e}"));
                    break;
                }
            }
        }
    }
    if manual && pending > 0 {
        if let Err(e) = within(Duration::from_secs(2), "basic.ack", ch.basic_ack(last_tag, BasicAckOptions { multiple: true })).await {
            env.stats.error(e);
        }
    }
}

type PublishFuture<'a> = Pin<Box<dyn Future<Output = lapin::Result<PublisherConfirm>> + 'a>>;

/// One basic.publish owning its body (lapin copies the body into frames on first poll;
/// the future resolves once the frames are written to the socket).
fn publish<'a>(
    ch: &'a Channel,
    ex: ShortString,
    rk: ShortString,
    opts: BasicPublishOptions,
    body: Vec<u8>,
    props: BasicProperties,
) -> PublishFuture<'a> {
    Box::pin(async move { ch.basic_publish(ex, rk, opts, &body, props).await })
}

/// Most body bytes one producer keeps in flight inside lapin (caps `--pipeline`).
pub const PIPELINE_BYTES: usize = 64 << 20;

/// One producer, as one hand-written state machine:
/// - up to --pipeline publishes are in flight inside lapin (written in order),
/// - with --confirm N, at most N messages are unconfirmed (confirms resolve in order),
/// - with --rate R, message k is due at start + k/R and carries that *intended* time,
///   so a stall delays the timestamps it should (no coordinated omission); when late it
///   catches up at full speed.
///
/// `schedule_start`: CLOCK_MONOTONIC ns at which a fixed-rate schedule starts (all producers).
async fn producer(
    env: Rc<Env>,
    ch: Channel,
    index: u16,
    schedule_start: u64,
    ex: ShortString,
    rk: ShortString,
    props: BasicProperties,
) -> Option<Channel> {
    let cfg = &env.cfg;
    let stats = &env.stats;
    let stop_id = env.stop_producing.register();
    let rate = cfg.rate;
    let mut pacer = if rate > 0.0 {
        match Pacer::new() {
            Ok(p) => Some(p),
            Err(e) => {
                stats.error(format!("timerfd: {e}"));
                return None;
            }
        }
    } else {
        None
    };
    let schedule = Schedule::new(schedule_start, index, cfg.producers, rate);
    let limit = cfg.message_limit();
    let opts = BasicPublishOptions { mandatory: cfg.mandatory, immediate: false };
    let template = vec![0u8; cfg.size];
    let window = cfg.confirm as usize;
    // At most PIPELINE_BYTES of bodies in flight inside the client library, whatever
    // --pipeline says (256 × 10 MB bodies would be 2.5 GB).
    let pipeline = (cfg.pipeline as usize).min((PIPELINE_BYTES / cfg.size.max(1)).max(1));
    let return_check = cfg.mandatory && window == 0;
    let drain = Duration::from_secs_f64(cfg.drain_timeout_s);
    let mut writes: VecDeque<(u64, PublishFuture<'_>)> = VecDeque::with_capacity(pipeline);
    let mut confirms: VecDeque<(u64, PublisherConfirm)> = VecDeque::with_capacity(window);
    let mut sent: u64 = 0;
    let mut since_return_check = 0u32;
    let mut counted_behind = false;
    let mut drain_sleep: Option<Pin<Box<tokio::time::Sleep>>> = None;

    let result: lapin::Result<()> = poll_fn(|cx| loop {
        // 1. Publishes whose frames are written: their confirm futures join the window.
        while let Some((intended, fut)) = writes.front_mut() {
            match fut.as_mut().poll(cx) {
                Poll::Ready(Ok(mut pc)) => {
                    let intended = *intended;
                    writes.pop_front();
                    if window > 0 {
                        confirms.push_back((intended, pc));
                    } else {
                        let _ = Pin::new(&mut pc).poll(cx); // resolves at once: NotRequested
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => break,
            }
        }
        // 2. Confirms, oldest first.
        while let Some((intended, pc)) = confirms.front_mut() {
            match Pin::new(pc).poll(cx) {
                Poll::Ready(Ok(c)) => {
                    let now = now_ns();
                    match c {
                        Confirmation::Ack(ret) => {
                            Stats::bump(&stats.confirmed, 1);
                            stats.record_confirm(now.saturating_sub(*intended));
                            if ret.is_some() {
                                Stats::bump(&stats.returned, 1);
                            }
                        }
                        Confirmation::Nack(ret) => {
                            Stats::bump(&stats.nacked, 1);
                            if ret.is_some() {
                                Stats::bump(&stats.returned, 1);
                            }
                        }
                        Confirmation::NotRequested => {}
                    }
                    confirms.pop_front();
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => break,
            }
        }
        // 3. Stopping: wait for what is outstanding, at most the drain timeout.
        if env.stop_producing.poll_fired(stop_id, cx).is_ready() || sent >= limit {
            if let (Some(_), false) = (pacer.as_ref(), counted_behind) {
                // Fixed rate: messages that were due but never sent (a stall blocked the
                // window) are reported, not silently dropped from the latency picture.
                counted_behind = true;
                Stats::bump(&stats.behind_schedule, schedule.behind_at_stop(now_ns(), sent, limit));
            }
            if return_check {
                count_returns(&ch, stats, cx);
            }
            if writes.is_empty() && confirms.is_empty() {
                return Poll::Ready(Ok(()));
            }
            let sleep = drain_sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(drain)));
            if sleep.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(())); // outstanding ones are reported as unconfirmed
            }
            return Poll::Pending;
        }
        // 4. How many may go now.
        let mut budget = pipeline.saturating_sub(writes.len());
        if window > 0 {
            budget = budget.min(window.saturating_sub(writes.len() + confirms.len()));
        }
        budget = budget.min((limit - sent) as usize).min(BATCH);
        if let Some(p) = pacer.as_mut() {
            let now = now_ns();
            let next = schedule.intended_at(sent);
            if next > now {
                match p.poll_until(cx, next) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(()) => continue,
                }
            }
            budget = budget.min(schedule.due_by(now).saturating_sub(sent) as usize);
        }
        if budget == 0 {
            return Poll::Pending; // a pending write or confirm holds our waker
        }
        // 5. Send. Frames are queued in poll order, so sequence numbers go out in order.
        for _ in 0..budget {
            let intended = if pacer.is_some() {
                let t = schedule.intended_at(sent);
                stats.send_lag.borrow_mut().record_ns(now_ns().saturating_sub(t));
                t
            } else {
                now_ns()
            };
            let mut body = template.clone();
            body::encode(&mut body, Tag { run: env.run_id, producer: index, seq: sent as u32 }, intended);
            let props = match cfg.priorities {
                0 => props.clone(),
                n => props.clone().with_priority((sent % u64::from(n)) as u8),
            };
            let mut fut = publish(&ch, ex.clone(), rk.clone(), opts, body, props);
            sent += 1;
            Stats::bump(&stats.sent, 1);
            match fut.as_mut().poll(cx) {
                Poll::Ready(Ok(pc)) => {
                    if window > 0 {
                        confirms.push_back((intended, pc));
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => writes.push_back((intended, fut)),
            }
        }
        if return_check {
            since_return_check += budget as u32;
            if since_return_check >= RETURN_CHECK_EVERY {
                since_return_check = 0;
                count_returns(&ch, stats, cx);
            }
        }
        // Let consumers and the ticker run between batches.
        cx.waker().wake_by_ref();
        return Poll::Pending;
    })
    .await;
    if let Err(e) = result {
        stats.error(format!("producer {index}: {e}"));
    }
    // Unconfirmed futures left here are dropped; lapin keeps them for wait_for_confirms.
    drop(writes);
    drop(confirms);
    return_check.then_some(ch)
}

/// Counts messages returned (mandatory, unroutable) on a channel without confirms.
fn count_returns(ch: &Channel, stats: &Stats, cx: &mut std::task::Context<'_>) {
    let f = ch.wait_for_confirms();
    let mut f = std::pin::pin!(f);
    if let Poll::Ready(Ok(returned)) = f.as_mut().poll(cx) {
        Stats::bump(&stats.returned, returned.len() as u64);
    }
}

/// Prints a progress line every second (stderr) and folds the per-second histograms.
async fn ticker(env: Rc<Env>, t0_ns: u64) {
    let stop_id = env.stop_ticker.register();
    let mut prev = Snapshot::default();
    let mut prev_t = t0_ns;
    let mut prev_broker = env.broker_pid.and_then(|p| procfs::process_cpu_us(p).ok());
    let mut prev_self = procfs::self_cpu_us();
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + Duration::from_secs(1), Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = env.stop_ticker.fired(stop_id) => break,
        }
        let now = now_ns();
        let dt = (now - prev_t) as f64 / 1e9;
        let s = Snapshot::of(&env.stats);
        let [e2e99, conf99, _] = env.stats.roll_tick();
        let rate = |a: u64, b: u64| (a - b) as f64 / dt;
        let broker = env.broker_pid.and_then(|p| procfs::process_cpu_us(p).ok());
        let me = procfs::self_cpu_us();
        let mut broker_txt = String::new();
        if let (Some(pid), Some(b)) = (env.broker_pid, broker) {
            let rss = procfs::rss_bytes(pid).unwrap_or(0);
            env.broker_rss_max.set(env.broker_rss_max.get().max(rss));
            let pct = prev_broker.map(|p| (b - p) as f64 / 1e4 / dt).unwrap_or(0.0);
            broker_txt = format!(" | broker {pct:.0}% cpu {} MB", rss / 1_000_000);
        }
        prev_broker = broker;
        if !env.cfg.quiet {
            eprintln!(
                "[{:>4.0}s] sent {:>9.0}/s conf {:>9.0}/s ret {} nack {} | recv {:>9.0}/s {:>7.2} MB/s | p99 e2e {} conf {}{} | bench {:.0}% cpu{}",
                (now - t0_ns) as f64 / 1e9,
                rate(s.sent, prev.sent),
                rate(s.confirmed, prev.confirmed),
                s.returned,
                s.nacked,
                rate(s.received, prev.received),
                rate(s.received_bytes, prev.received_bytes) / 1e6,
                e2e99.map(fmt_us).unwrap_or_else(|| "-".into()),
                conf99.map(fmt_us).unwrap_or_else(|| "-".into()),
                broker_txt,
                (me - prev_self) as f64 / 1e4 / dt,
                if s.errors > prev.errors { format!(" | errors {}", s.errors) } else { String::new() },
            );
        }
        prev_self = me;
        prev = s;
        prev_t = now;
    }
}
