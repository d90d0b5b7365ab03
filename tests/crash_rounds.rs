//! kill -9 round after round under a mixed load (issue 14 item 6; acceptance: 100 rounds, the
//! broker alive and serving at the end of each). ringmq only: the harness must own the process.
//!
//! # The load (each round, on new connections to the running broker)
//! - a publisher with confirms (window 32) of persistent messages into two durable queues:
//!   `work` (x-dead-letter-exchange: a durable fanout exchange bound to the durable `dlq`) and,
//!   for every 8th id, `ttl` (x-message-ttl 250 ms, the same dead-letter exchange, no consumer);
//! - three competing consumers of `work` with manual ack and prefetch 5–30, each delivery
//!   acked, nacked with requeue, rejected without requeue (dead-lettered into `dlq`) or held a
//!   while, as the seeded generator picks; in about half the rounds one of them closes its
//!   channel while holding deliveries (the broker requeues them to the others) and opens another;
//! - a basic.get poller on `work` with manual ack.
//!
//! At a seeded random moment the broker is killed (SIGKILL, by PID) and started again on the
//! same data dir; it must then serve a declare + publish (confirmed) + get round trip.
//!
//! # What is checked
//! - **0 confirmed messages lost.** At the end `ttl`, `work` and `dlq` are drained. Every
//!   confirmed message was acked by a client (an ack sent, or attempted on a connection that
//!   died: an ack the crash undid brings the message back redelivered, and the drain finds
//!   it), found in `dlq`, or drained. A reject settles nothing: the message must be in `dlq`,
//!   or back in `work`.
//! - **Never outstanding to two holders.** A delivery (consume or get) of a message that
//!   another holder (a channel) still holds unsettled is a violation. A holder gives a
//!   message up just before it sends its settlement or closes its channel, and every holder
//!   of a round is gone once the broker is killed.
//! - **Redelivered flag.** A message of `work` or `ttl` delivered again without
//!   redelivered=true is a violation (a delivery of a persistent message leaves a durable
//!   unacked-index record first).
//! - **Dead-letter copies.** A `dlq` copy's newest x-death names its queue and reason
//!   (`rejected` and `work` for a message a client rejected, `expired` and `ttl`); a body that
//!   is no id published here is a violation.
//! - The broker log holds no panic and no fatal error; the process is alive before each kill.
//!
//! `RINGMQ_CRASH_ROUNDS` sets the number of rounds (default 12: under a minute on a debug
//! build; `tests/crash-rounds.sh` runs 100 against a release build). `RINGMQ_CRASH_ROUNDS_SEED`
//! replays a printed seed: the same kill moments and client choices (not the same timing).

mod common;

use common::rounds::{count_from_env, log_tail, panic_lines, process_alive, seed_from_env, serves, Rng};
use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Rounds when `RINGMQ_CRASH_ROUNDS` is not set (the CI form).
const DEFAULT_ROUNDS: u32 = 12;
/// Time-to-live of the `ttl` queue's messages (ms).
const TTL_MS: i64 = 250;
/// The publisher waits while `work` holds about this many messages not yet settled.
const MAX_BACKLOG: i64 = 3_000;
/// Bound on a client's wait for one delivery or one settlement.
const CLIENT_STEP: Duration = Duration::from_secs(3);

/// Every 8th message id goes to the `ttl` queue, the others to `work`.
fn to_ttl(id: u32) -> bool {
    id.is_multiple_of(8)
}

/// The message id a body carries (4 bytes, big-endian), if it is one.
fn body_id(body: &[u8]) -> Option<u32> {
    body.try_into().ok().map(u32::from_be_bytes)
}

/// The queues and the dead-letter exchange of the run.
struct Names {
    work: String,
    ttl: String,
    dlx: String,
    dlq: String,
}

/// A channel that holds deliveries; unique over the run.
type Holder = u64;

fn new_holder() -> Holder {
    static N: AtomicU64 = AtomicU64::new(1);
    N.fetch_add(1, Ordering::Relaxed)
}

/// What the clients saw and did, shared by every task of every round.
#[derive(Default)]
struct Ledger {
    /// Highest message id handed to the publisher so far.
    published: u32,
    confirmed: HashSet<u32>,
    /// Publishes the broker answered with basic.nack.
    broker_nacks: u64,
    /// Ids a client sent (or tried to send) basic.ack for.
    acked: HashSet<u32>,
    /// Ids a client sent (or tried to send) basic.reject(requeue=false) for.
    rejected: HashSet<u32>,
    /// basic.nack(requeue=true) sent.
    requeues: u64,
    /// Ids of `work` and `ttl` delivered at least once (consume, get or the final drain).
    delivered: HashSet<u32>,
    deliveries: u64,
    redeliveries: u64,
    /// Deliveries of an id a client had acked before (the crash undid the ack).
    undone_acks: u64,
    /// Message id → the holder it is outstanding to.
    outstanding: HashMap<u32, Holder>,
    violations: Vec<String>,
    violation_count: u64,
    /// The round under way (0 before the first, `rounds + 1` in the drain).
    round: u32,
    /// The broker of this round has been killed.
    killed: bool,
    /// Per message id: what happened to it, in order (round, after its kill, event, holder),
    /// for a violation's report.
    history: HashMap<u32, Vec<(u32, bool, &'static str, Holder)>>,
}

impl Ledger {
    /// Round `round` starts: every holder of the last one went with the killed broker.
    fn start_round(&mut self, round: u32) {
        (self.round, self.killed) = (round, false);
        self.outstanding.clear();
    }

    fn note(&mut self, id: u32, event: &'static str, holder: Holder) {
        let (round, killed) = (self.round, self.killed);
        self.history.entry(id).or_default().push((round, killed, event, holder));
    }

    /// The history of `id` as text.
    fn history_of(&self, id: u32) -> String {
        let events = self.history.get(&id).map(Vec::as_slice).unwrap_or_default();
        let at = |r: &u32, k: &bool| format!("r{r}{}", if *k { "+killed" } else { "" });
        events.iter().map(|(r, k, e, h)| format!("{}:{e}@{h}", at(r, k))).collect::<Vec<_>>().join(" ")
    }

    fn violation(&mut self, what: String) {
        eprintln!("VIOLATION: {what}");
        self.violation_count += 1;
        if self.violations.len() < 100 {
            self.violations.push(what);
        }
    }

    /// A delivery of `id` (from `work` or `ttl`) to `holder`; `how`: consume, get, drain.
    fn delivered(&mut self, holder: Holder, id: u32, redelivered: bool, how: &str) {
        self.deliveries += 1;
        self.redeliveries += u64::from(redelivered);
        if id == 0 || id > self.published {
            self.violation(format!("{how}: message {id} was never published"));
        }
        if !self.delivered.insert(id) && !redelivered {
            let seen = self.history_of(id);
            self.violation(format!("{how}: message {id} delivered again without redelivered=true (to {holder}; before: {seen})"));
        }
        self.note(id, if redelivered { "redelivered" } else { "delivered" }, holder);
        if self.acked.contains(&id) {
            self.undone_acks += 1;
        }
        if let Some(other) = self.outstanding.insert(id, holder) {
            self.violation(format!("{how}: message {id} delivered to holder {holder} while outstanding to holder {other}"));
        }
    }

    /// `holder` settles `id` (called before the settlement is sent).
    fn settle(&mut self, holder: Holder, id: u32, how: Settle) {
        if self.outstanding.get(&id) == Some(&holder) {
            self.outstanding.remove(&id);
        }
        self.note(id, how.name(), holder);
        match how {
            Settle::Ack => {
                self.acked.insert(id);
            }
            Settle::Requeue => self.requeues += 1,
            Settle::Reject => {
                self.rejected.insert(id);
            }
        }
    }

    /// Messages of `work` published and not yet settled by an ack or a reject (about).
    fn backlog(&self) -> i64 {
        let work = i64::from(self.published) - i64::from(self.published / 8);
        work - self.acked.len() as i64 - self.rejected.len() as i64
    }

    /// `holder` closes its channel or lost it: it holds nothing from now on.
    fn holder_gone(&mut self, holder: Holder) {
        let held: Vec<u32> = self.outstanding.iter().filter(|(_, h)| **h == holder).map(|(id, _)| *id).collect();
        for id in held {
            self.outstanding.remove(&id);
            self.note(id, "given-up", holder);
        }
    }
}

/// How a client settles a delivery.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Settle {
    Ack,
    Requeue,
    Reject,
}

impl Settle {
    fn name(self) -> &'static str {
        match self {
            Settle::Ack => "ack",
            Settle::Requeue => "requeue",
            Settle::Reject => "reject",
        }
    }
}

/// A client's pick for a delivery: 70% ack, 12% nack(requeue), 10% reject, 8% hold (then ack).
fn pick(rng: &mut Rng) -> Option<Settle> {
    match rng.range(0, 100) {
        0..70 => Some(Settle::Ack),
        70..82 => Some(Settle::Requeue),
        82..92 => Some(Settle::Reject),
        _ => None,
    }
}

/// Sends the settlement `how` of delivery `tag` (message `id`) held by `holder` on `ch`,
/// bounded; the ledger hears of it first. False when the channel is gone.
async fn settle(ch: &Channel, ledger: &Mutex<Ledger>, holder: Holder, (tag, id): (u64, u32), how: Settle) -> bool {
    ledger.lock().unwrap().settle(holder, id, how);
    let sent = match how {
        Settle::Ack => tokio::time::timeout(CLIENT_STEP, ch.basic_ack(tag, BasicAckOptions::default())).await,
        Settle::Requeue => tokio::time::timeout(CLIENT_STEP, ch.basic_nack(tag, BasicNackOptions { multiple: false, requeue: true })).await,
        Settle::Reject => tokio::time::timeout(CLIENT_STEP, ch.basic_reject(tag, BasicRejectOptions { requeue: false })).await,
    };
    matches!(sent, Ok(Ok(())))
}

/// Counts a client as attached (or given up) when dropped.
struct Ready(Arc<AtomicUsize>);

impl Drop for Ready {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// What every client task of a round gets.
struct Client {
    uri: String,
    names: Arc<Names>,
    ledger: Arc<Mutex<Ledger>>,
    seed: u64,
    ready: Ready,
}

async fn connect_client(uri: &str) -> Option<Connection> {
    tokio::time::timeout(CLIENT_STEP, Connection::connect(uri, Default::default())).await.ok()?.ok()
}

/// Publishes persistent messages with confirms (window 32) until its connection dies.
async fn publisher(c: Client) {
    let Some(conn) = connect_client(&c.uri).await else { return };
    let Ok(ch) = conn.create_channel().await else { return };
    if ch.confirm_select(Default::default()).await.is_err() {
        return;
    }
    drop(c.ready);
    let props = BasicProperties::default().with_delivery_mode(2);
    for _ in 0..100_000 {
        // Keeps `work` a few thousand deep (the consumers, not the drain, see most messages).
        for _ in 0..200 {
            if c.ledger.lock().unwrap().backlog() < MAX_BACKLOG {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut window = Vec::new();
        for _ in 0..32 {
            let id = {
                let mut l = c.ledger.lock().unwrap();
                l.published += 1;
                l.published
            };
            let queue = if to_ttl(id) { &c.names.ttl } else { &c.names.work };
            let body = id.to_be_bytes();
            let sent = ch.basic_publish("".into(), queue.as_str().into(), Default::default(), &body, props.clone());
            match tokio::time::timeout(CLIENT_STEP, sent).await {
                Ok(Ok(pc)) => window.push((id, pc)),
                _ => return,
            }
        }
        for (id, pc) in window {
            match tokio::time::timeout(CLIENT_STEP * 2, pc).await {
                Ok(Ok(conf)) if conf.is_ack() => {
                    c.ledger.lock().unwrap().confirmed.insert(id);
                }
                Ok(Ok(_)) => c.ledger.lock().unwrap().broker_nacks += 1,
                _ => return,
            }
        }
    }
}

/// A consumer of `work` until its connection dies; with `closer`, it closes its channel now
/// and then while holding deliveries, and consumes on a new one.
async fn consumer(c: Client, closer: bool) {
    let Some(conn) = connect_client(&c.uri).await else { return };
    let mut rng = Rng::new(c.seed);
    let mut ready = Some(c.ready);
    for _ in 0..1_000 {
        let holder = new_holder();
        let again = consume_on_channel(&conn, &c.names, &c.ledger, holder, &mut rng, closer, &mut ready).await;
        c.ledger.lock().unwrap().holder_gone(holder);
        if !again {
            return;
        }
    }
}

/// One channel's life as `holder`; true when it closed the channel on purpose.
async fn consume_on_channel(
    conn: &Connection,
    names: &Names,
    ledger: &Mutex<Ledger>,
    holder: Holder,
    rng: &mut Rng,
    closer: bool,
    ready: &mut Option<Ready>,
) -> bool {
    let Ok(ch) = conn.create_channel().await else { return false };
    let prefetch = rng.range(5, 31) as u16;
    if ch.basic_qos(prefetch, Default::default()).await.is_err() {
        return false;
    }
    let consume = ch.basic_consume(names.work.as_str().into(), "".into(), Default::default(), FieldTable::default());
    let Ok(mut cons) = consume.await else { return false };
    ready.take();
    let close_after = if closer { rng.range(10, 150) } else { u64::MAX };
    let mut held: VecDeque<(u64, u32)> = VecDeque::new();
    for n in 0..1_000_000u64 {
        if n == close_after {
            // Gives up what it holds, then closes: the broker requeues it to the others.
            ledger.lock().unwrap().holder_gone(holder);
            let _ = tokio::time::timeout(CLIENT_STEP, ch.close(200, "closing with deliveries held".into())).await;
            return true;
        }
        let Ok(Some(Ok(d))) = tokio::time::timeout(CLIENT_STEP * 2, cons.next()).await else { return false };
        let Some(id) = body_id(&d.data) else {
            ledger.lock().unwrap().violation(format!("consume: a body of {} bytes is no message id", d.data.len()));
            continue;
        };
        ledger.lock().unwrap().delivered(holder, id, d.redelivered, "consume");
        let ok = match pick(rng) {
            Some(how) => settle(&ch, ledger, holder, (d.delivery_tag, id), how).await,
            None => {
                held.push_back((d.delivery_tag, id));
                true
            }
        };
        if !ok {
            return false;
        }
        if held.len() > 3 || (!held.is_empty() && rng.chance(10)) {
            let oldest = held.pop_front().unwrap();
            if !settle(&ch, ledger, holder, oldest, Settle::Ack).await {
                return false;
            }
        }
        if rng.chance(5) {
            tokio::time::sleep(Duration::from_millis(rng.range(1, 20))).await;
        }
    }
    false
}

/// basic.get (manual ack) on `work` until its connection dies.
async fn getter(c: Client) {
    let Some(conn) = connect_client(&c.uri).await else { return };
    let Ok(ch) = conn.create_channel().await else { return };
    drop(c.ready);
    let mut rng = Rng::new(c.seed);
    let holder = new_holder();
    for _ in 0..1_000_000 {
        match tokio::time::timeout(CLIENT_STEP, ch.basic_get(c.names.work.as_str().into(), BasicGetOptions { no_ack: false })).await {
            Ok(Ok(Some(m))) => {
                let Some(id) = body_id(&m.delivery.data) else {
                    c.ledger.lock().unwrap().violation("get: a body that is no message id".into());
                    continue;
                };
                c.ledger.lock().unwrap().delivered(holder, id, m.delivery.redelivered, "get");
                let how = pick(&mut rng).unwrap_or(Settle::Ack);
                if !settle(&ch, &c.ledger, holder, (m.delivery.delivery_tag, id), how).await {
                    break;
                }
            }
            Ok(Ok(None)) => tokio::time::sleep(Duration::from_millis(rng.range(1, 20))).await,
            _ => break,
        }
    }
    c.ledger.lock().unwrap().holder_gone(holder);
}

fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut a = FieldTable::default();
    for (k, v) in pairs {
        a.insert((*k).into(), v.clone());
    }
    a
}

/// Declares the run's durable exchange and queues.
async fn declare(b: &Broker, names: &Names) {
    let (c, ch) = connect_ch(b).await;
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    t("dlx", ch.exchange_declare(names.dlx.as_str().into(), ExchangeKind::Fanout, durable, FieldTable::default())).await.unwrap();
    declare_queue(&ch, &names.dlq, QueueDeclareOptions::durable(), FieldTable::default()).await;
    t(
        "bind dlq",
        ch.queue_bind(names.dlq.as_str().into(), names.dlx.as_str().into(), "".into(), Default::default(), FieldTable::default()),
    )
    .await
    .unwrap();
    let dlx = ("x-dead-letter-exchange", AMQPValue::LongString(LongString::from(names.dlx.as_str())));
    declare_queue(&ch, &names.work, QueueDeclareOptions::durable(), args(std::slice::from_ref(&dlx))).await;
    let ttl = ("x-message-ttl", AMQPValue::LongLongInt(TTL_MS));
    declare_queue(&ch, &names.ttl, QueueDeclareOptions::durable(), args(&[dlx, ttl])).await;
    t("close", c.close(200, "".into())).await.unwrap();
}

/// A drained message: its id, redelivered flag and newest x-death (queue, reason), if any.
struct Drained {
    id: Option<u32>,
    redelivered: bool,
    death: Option<(String, String)>,
}

fn death_of(props: &BasicProperties) -> Option<(String, String)> {
    let text = |v: Option<&AMQPValue>| match v {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(s)) => s.as_str().to_owned(),
        _ => String::new(),
    };
    let AMQPValue::FieldArray(deaths) = props.headers().as_ref()?.inner().get("x-death")? else { return None };
    let AMQPValue::FieldTable(newest) = deaths.as_slice().first()? else { return None };
    Some((text(newest.inner().get("queue")), text(newest.inner().get("reason"))))
}

/// Consumes `queue` with manual ack until nothing arrives for 2 s (at most `max` messages),
/// then checks by a passive declare that it is empty.
async fn drain(b: &Broker, queue: &str, max: usize) -> Vec<Drained> {
    let (c, ch) = connect_ch(b).await;
    t("qos", ch.basic_qos(200, Default::default())).await.unwrap();
    let mut cons = t("consume", ch.basic_consume(queue.into(), "".into(), Default::default(), FieldTable::default())).await.unwrap();
    let mut out = Vec::new();
    while out.len() < max {
        let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_secs(2), cons.next()).await else { break };
        out.push(Drained { id: body_id(&d.data), redelivered: d.redelivered, death: death_of(&d.properties) });
        t("ack", d.ack(Default::default())).await.unwrap();
    }
    t("cancel", ch.basic_cancel(cons.tag(), Default::default())).await.unwrap();
    assert_eq!(ready_count(&ch, queue).await, 0, "{queue} not empty after its drain of {} messages", out.len());
    t("close", c.close(200, "".into())).await.unwrap();
    out
}

/// Figures of the ledger, for a round's line and the summary.
#[derive(Clone, Copy, Default)]
struct Figures {
    published: u64,
    confirmed: u64,
    acked: u64,
    rejected: u64,
    requeues: u64,
    deliveries: u64,
}

impl Figures {
    fn of(l: &Ledger) -> Figures {
        Figures {
            published: u64::from(l.published),
            confirmed: l.confirmed.len() as u64,
            acked: l.acked.len() as u64,
            rejected: l.rejected.len() as u64,
            requeues: l.requeues,
            deliveries: l.deliveries,
        }
    }
}

/// Kills the broker at a random moment of a mixed load, round after round; see the module doc.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill9_rounds_under_a_mixed_load_lose_nothing_confirmed() {
    let mut b = Broker::start();
    require_own_broker!(b, "needs kill -9 of ringmq");
    let rounds = count_from_env("RINGMQ_CRASH_ROUNDS", DEFAULT_ROUNDS).max(1);
    let seed = seed_from_env("RINGMQ_CRASH_ROUNDS_SEED");
    eprintln!("crash rounds: {rounds} rounds, seed {seed} (RINGMQ_CRASH_ROUNDS_SEED={seed} replays it)");
    let budget = Duration::from_secs(60 + 15 * u64::from(rounds));
    let mut rng = Rng::new(seed);
    let names = Arc::new(Names { work: uniq("work"), ttl: uniq("ttl"), dlx: uniq("dlx"), dlq: uniq("dlq") });
    declare(&b, &names).await;
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let started = Instant::now();
    let mut aborted_clients = 0;
    for round in 1..=rounds {
        assert!(started.elapsed() < budget, "over the time budget of {budget:?} after {} rounds; seed {seed}", round - 1);
        ledger.lock().unwrap().start_round(round);
        let before = Figures::of(&ledger.lock().unwrap());
        let attached = Arc::new(AtomicUsize::new(0));
        let client =
            |seed: u64| Client { uri: b.uri(), names: names.clone(), ledger: ledger.clone(), seed, ready: Ready(attached.clone()) };
        let closer = rng.chance(50);
        let mut tasks = vec![tokio::spawn(publisher(client(rng.next())))];
        for k in 0..3 {
            tasks.push(tokio::spawn(consumer(client(rng.next()), closer && k == 0)));
        }
        tasks.push(tokio::spawn(getter(client(rng.next()))));
        let attach_by = Instant::now() + Duration::from_secs(10);
        while attached.load(Ordering::SeqCst) < tasks.len() && Instant::now() < attach_by {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let delay = rng.range(50, 1500);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        ledger.lock().unwrap().killed = true;
        let pid = b.pid().expect("broker pid");
        assert!(process_alive(pid), "round {round}: the broker died before its kill; seed {seed}; log:\n{}", log_tail(&b.log(), 60));
        let killed = Instant::now();
        tokio::task::block_in_place(|| b.kill9_restart());
        let restart = killed.elapsed();
        for task in tasks {
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(15), task).await.is_err() {
                abort.abort();
                aborted_clients += 1;
            }
        }
        let served = serves(&b.uri()).await.unwrap_or_else(|e| {
            panic!("round {round}: the broker does not serve after its restart: {e}; seed {seed}; log:\n{}", log_tail(&b.log(), 60))
        });
        let now = Figures::of(&ledger.lock().unwrap());
        eprintln!(
            "round {round}/{rounds}: killed after {delay} ms{}; +{} published, +{} confirmed, +{} acked, +{} rejected, +{} requeued, \
             +{} deliveries; restart {} ms, round trip {} ms",
            if closer { " (a consumer closed its channel)" } else { "" },
            now.published - before.published,
            now.confirmed - before.confirmed,
            now.acked - before.acked,
            now.rejected - before.rejected,
            now.requeues - before.requeues,
            now.deliveries - before.deliveries,
            restart.as_millis(),
            served.as_millis(),
        );
    }
    let in_rounds = Figures::of(&ledger.lock().unwrap());
    ledger.lock().unwrap().start_round(rounds + 1);
    // The drain: `ttl` first (what it still holds), then `work`, then `dlq`, where both send.
    let max = ledger.lock().unwrap().published as usize * 4 + 1000;
    let mut drained = HashSet::new();
    for queue in [&names.ttl, &names.work] {
        let holder = new_holder();
        for m in drain(&b, queue, max).await {
            let mut l = ledger.lock().unwrap();
            let Some(id) = m.id else {
                l.violation(format!("drain of {queue}: a body that is no message id"));
                continue;
            };
            if to_ttl(id) != (queue == &names.ttl) {
                l.violation(format!("drain of {queue}: message {id} was published to the other queue"));
            }
            l.delivered(holder, id, m.redelivered, "drain");
            l.settle(holder, id, Settle::Ack);
            drained.insert(id);
        }
    }
    let mut dead = HashSet::new();
    let mut dead_copies = 0u64;
    for m in drain(&b, &names.dlq, max).await {
        let mut l = ledger.lock().unwrap();
        dead_copies += 1;
        let Some(id) = m.id.filter(|&id| id > 0 && id <= l.published) else {
            l.violation("drain of dlq: a body that is no message id published here".into());
            continue;
        };
        let (queue, reason) = m.death.unwrap_or_default();
        let want = if to_ttl(id) { (&names.ttl, "expired") } else { (&names.work, "rejected") };
        if (&queue, reason.as_str()) != want {
            l.violation(format!("dlq: message {id} dead-lettered from {queue:?} for {reason:?}, expected {want:?}"));
        }
        if !to_ttl(id) && !l.rejected.contains(&id) {
            l.violation(format!("dlq: message {id} of work dead-lettered though no client rejected it"));
        }
        dead.insert(id);
    }
    let l = ledger.lock().unwrap();
    let lost: Vec<u32> =
        l.confirmed.iter().copied().filter(|id| !l.acked.contains(id) && !dead.contains(id) && !drained.contains(id)).collect();
    let panics = panic_lines(&b.log());
    eprintln!(
        "crash-rounds summary: rounds={rounds} seed={seed} published={} confirmed={} broker_nacks={} acked={} rejected={} requeues={} \
         dead_lettered={} dead_letter_copies={dead_copies} drained={} deliveries={} redeliveries={} undone_acks={} \
         aborted_clients={aborted_clients} lost={} violations={} panics={} duration_s={:.1}",
        l.published,
        l.confirmed.len(),
        l.broker_nacks,
        in_rounds.acked,
        in_rounds.rejected,
        in_rounds.requeues,
        dead.len(),
        drained.len(),
        l.deliveries,
        l.redeliveries,
        l.undone_acks,
        lost.len(),
        l.violation_count,
        panics.len(),
        started.elapsed().as_secs_f64(),
    );
    assert!(panics.is_empty(), "the broker log holds panics or fatal errors: {:?}; seed {seed}", &panics[..panics.len().min(5)]);
    assert!(
        l.violations.is_empty(),
        "{} violations, e.g. {:?}; seed {seed}",
        l.violation_count,
        &l.violations[..l.violations.len().min(5)]
    );
    let mut some_lost = lost.clone();
    some_lost.sort_unstable();
    some_lost.truncate(10);
    assert!(
        lost.is_empty(),
        "{} confirmed messages lost (not acked, not dead-lettered, not drained), e.g. {some_lost:?}; seed {seed}",
        lost.len()
    );
    // The load meant something: each kind of event happened.
    assert!(l.confirmed.len() as u64 > 50 * u64::from(rounds), "too little load: {} confirmed in {rounds} rounds", l.confirmed.len());
    assert!(in_rounds.acked > 0 && in_rounds.requeues > 0 && in_rounds.rejected > 0, "no ack, requeue or reject happened");
    assert!(dead.iter().any(|&id| to_ttl(id)), "no message expired into the dead-letter queue");
    assert!(dead.iter().any(|&id| !to_ttl(id)), "no rejected message reached the dead-letter queue");
}
