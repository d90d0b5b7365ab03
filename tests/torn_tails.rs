//! Torn and zeroed tails through the real binary (issue 14 item 6): after a kill -9 with data
//! written, a queue's segment file or the metadata Raft log (`meta/meta.log`) is cut at a
//! seeded random offset, or has its last bytes zeroed; the broker must start (ringmq repairs
//! both: no refusal, no panic, no hang), keep everything written wholly before the damage,
//! say in its log what a segment lost, and serve. The store-level tests of every file kind
//! are `shards/tests/torn.rs` and `src/meta/torn_tests.rs`.
//!
//! `RINGMQ_TORN_SEED` replays a printed seed. ringmq only (the harness owns the process).

mod common;

use common::rounds::{panic_lines, seed_from_env, serves, Rng};
use common::*;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, ExchangeKind};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Messages published before the kill.
const MESSAGES: u32 = 200;

#[derive(Clone, Copy, Debug)]
enum Damage {
    /// The file cut at this byte.
    Cut(u64),
    /// Bytes from here to the end of the data zeroed.
    Zero(u64),
}

impl Damage {
    fn at(self) -> u64 {
        match self {
            Damage::Cut(at) | Damage::Zero(at) => at,
        }
    }

    /// A seeded damage at a byte in `from..end` of a file whose data ends at `end`.
    fn pick(rng: &mut Rng, zero: bool, from: u64, end: u64) -> Damage {
        let at = rng.range(from, end);
        if zero {
            Damage::Zero(at)
        } else {
            Damage::Cut(at)
        }
    }

    fn apply(self, path: &Path, end: u64) {
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        match self {
            Damage::Cut(at) => f.set_len(at).unwrap(),
            Damage::Zero(from) => f.write_all_at(&vec![0u8; (end - from) as usize], from).unwrap(),
        }
        f.sync_all().unwrap();
    }
}

fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

fn body(id: u32) -> Vec<u8> {
    let mut b = id.to_be_bytes().to_vec();
    b.extend((0..300u32).map(|i| (i + id) as u8));
    b
}

/// The directory of durable queue `name` in vhost `/`.
fn queue_dir(data: &Path, name: &str) -> PathBuf {
    data.join("queues").join(format!("2f.{}", name.bytes().map(|c| format!("{c:02x}")).collect::<String>()))
}

/// End positions of the records of a segment file (a little-endian u32 length at each
/// record's start from byte 4096, 0 after the last).
fn record_ends(seg: &Path) -> Vec<u64> {
    let bytes = std::fs::read(seg).unwrap();
    let (mut pos, mut ends) = (4096usize, Vec::new());
    while pos + 4 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        if len == 0 || pos + len > bytes.len() {
            break;
        }
        pos += len;
        ends.push(pos as u64);
    }
    ends
}

/// A started broker on a fresh data dir, its AMQP URI, and the dir (kept by the TempDir).
fn fresh() -> (OwnBroker, String, tempfile::TempDir) {
    let work = tempfile::Builder::new().prefix("ringmq-torn-").tempdir().expect("temp dir");
    let b = tokio::task::block_in_place(|| OwnBroker::start_in(&work.path().join("data"), &[], &[]));
    let uri = format!("amqp://guest:guest@{}:{}/%2f", b.host(), b.port());
    (b, uri, work)
}

/// Declares durable queue `q` and publishes `MESSAGES` confirmed persistent messages.
async fn publish_all(uri: &str, q: &str) {
    let conn = connect_uri(uri).await;
    let ch = conn.create_channel().await.unwrap();
    declare_queue(&ch, q, QueueDeclareOptions::durable(), FieldTable::default()).await;
    confirm_mode(&ch).await;
    for id in 0..MESSAGES {
        assert!(publish_confirmed(&ch, "", q, &body(id), persistent()).await.is_ack(), "confirm of {id}");
    }
    conn.close(200, "bye".into()).await.unwrap();
}

/// A segment of a durable queue damaged after a kill -9.
async fn segment_tail(zero: bool) {
    if std::env::var_os("RINGMQ_TEST_BROKER").is_some() {
        eprintln!("SKIPPED against an external broker: this test damages ringmq's files");
        return;
    }
    let seed = seed_from_env("RINGMQ_TORN_SEED");
    eprintln!("torn segment seed: {seed} (RINGMQ_TORN_SEED={seed} replays it)");
    let mut rng = Rng::new(seed);
    let (mut b, uri, _work) = fresh();
    let q = uniq("torn-seg");
    publish_all(&uri, &q).await;
    tokio::task::block_in_place(|| b.kill9());
    let dir = queue_dir(b.data_dir(), &q).join("messages");
    let mut segs: Vec<PathBuf> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "seg")).collect();
    segs.sort();
    let seg = segs.pop().expect("a segment file");
    let ends = record_ends(&seg);
    assert_eq!(ends.len(), MESSAGES as usize, "every confirmed message is in {}", seg.display());
    let end = *ends.last().unwrap();
    let damage = Damage::pick(&mut rng, zero, 4096, end);
    damage.apply(&seg, end);
    let intact = ends.iter().filter(|&&e| e <= damage.at()).count() as u32;
    eprintln!("{damage:?} on {} (records end at byte {end}): {intact} records before it", seg.display());
    tokio::task::block_in_place(|| b.start());
    let conn = connect_uri(&uri).await;
    let ch = conn.create_channel().await.unwrap();
    let got = drain(&ch, &q, MESSAGES as usize + 10).await;
    for (k, m) in got.iter().enumerate() {
        assert_eq!(m, &body(k as u32), "message {k} after the repair ({damage:?})");
    }
    assert!(got.len() as u32 >= intact, "{damage:?}: {} messages back, {intact} were wholly before the damage", got.len());
    if (got.len() as u32) < MESSAGES {
        // A cut is damage ("dropped records"); zeros after whole records are also what a
        // crash leaves of unsynced appends (a warning naming the offsets). Either says so.
        assert!(b.log().contains("shard recovered with losses"), "{damage:?} lost messages without a log line saying so");
    }
    conn.close(200, "bye".into()).await.unwrap();
    serves(&uri).await.unwrap_or_else(|e| panic!("{damage:?}: the broker does not serve: {e}"));
    // The repaired segment takes new messages, and a restart finds them.
    publish_all(&uri, &q).await;
    tokio::task::block_in_place(|| b.kill9());
    tokio::task::block_in_place(|| b.start());
    let conn = connect_uri(&uri).await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(ready_count(&ch, &q).await, MESSAGES, "{damage:?}: messages published after the repair");
    conn.close(200, "bye".into()).await.unwrap();
    assert!(panic_lines(&b.log()).is_empty(), "the broker panicked: {:?}", panic_lines(&b.log()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segment_cut_at_a_random_offset_after_kill9_is_repaired() {
    segment_tail(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segment_with_a_zeroed_tail_after_kill9_is_repaired() {
    segment_tail(true).await;
}

/// The metadata log damaged after a kill -9, past the queue's declaration.
async fn raft_log_tail(zero: bool) {
    if std::env::var_os("RINGMQ_TEST_BROKER").is_some() {
        eprintln!("SKIPPED against an external broker: this test damages ringmq's files");
        return;
    }
    const FILLERS: usize = 10;
    let seed = seed_from_env("RINGMQ_TORN_SEED");
    eprintln!("torn raft log seed: {seed} (RINGMQ_TORN_SEED={seed} replays it)");
    let mut rng = Rng::new(seed);
    let (mut b, uri, _work) = fresh();
    let log = b.data_dir().join("meta").join("meta.log");
    let q = uniq("torn-log");
    publish_all(&uri, &q).await;
    let kept = std::fs::metadata(&log).unwrap().len();
    // Durable exchanges declared one by one after the queue: the damage falls among them.
    let names: Vec<String> = (0..FILLERS).map(|k| uniq(&format!("filler{k}"))).collect();
    {
        let conn = connect_uri(&uri).await;
        let ch = conn.create_channel().await.unwrap();
        for x in &names {
            let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
            t("exchange.declare", ch.exchange_declare(x.as_str().into(), ExchangeKind::Direct, durable, FieldTable::default()))
                .await
                .unwrap();
        }
        conn.close(200, "bye".into()).await.unwrap();
    }
    tokio::task::block_in_place(|| b.kill9());
    let end = std::fs::metadata(&log).unwrap().len();
    assert!(end > kept, "the fillers wrote to {}", log.display());
    let damage = Damage::pick(&mut rng, zero, kept, end);
    damage.apply(&log, end);
    eprintln!("{damage:?} on {} ({end} bytes; the queue's entries end by byte {kept})", log.display());
    tokio::task::block_in_place(|| b.start());
    let conn = connect_uri(&uri).await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(ready_count(&ch, &q).await, MESSAGES, "{damage:?}: the queue's messages after the repair");
    let present: Vec<bool> = {
        let mut v = Vec::new();
        for x in &names {
            v.push(exchange_exists(&conn, x).await);
        }
        v
    };
    // Raft order: what survives is a prefix of what was declared.
    assert!(present.windows(2).all(|w| w[0] || !w[1]), "{damage:?}: surviving exchanges are no prefix: {present:?}");
    conn.close(200, "bye".into()).await.unwrap();
    serves(&uri).await.unwrap_or_else(|e| panic!("{damage:?}: the broker does not serve: {e}"));
    // The repaired log takes new entries, and a restart keeps them.
    let again = uniq("torn-log-after");
    publish_all(&uri, &again).await;
    tokio::task::block_in_place(|| b.kill9());
    tokio::task::block_in_place(|| b.start());
    let conn = connect_uri(&uri).await;
    assert!(queue_exists(&conn, &again).await, "{damage:?}: a queue declared after the repair is lost");
    conn.close(200, "bye".into()).await.unwrap();
    assert!(panic_lines(&b.log()).is_empty(), "the broker panicked: {:?}", panic_lines(&b.log()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_raft_log_cut_at_a_random_offset_after_kill9_is_repaired() {
    raft_log_tail(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_raft_log_with_a_zeroed_tail_after_kill9_is_repaired() {
    raft_log_tail(true).await;
}
