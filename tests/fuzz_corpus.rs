//! Replays the fuzz corpus (`fuzz/corpus/<target>/`) and the kept crashes
//! (`fuzz/regressions/<target>/`) through `ringmq::amqp::fuzz`, the functions the cargo-fuzz
//! targets call: every input the fuzzer kept as interesting, and every one that once
//! crashed, must still return with its property holding. `fuzz/run.sh` grows the corpus.

use std::path::{Path, PathBuf};

use amq_protocol::types::{AMQPValue, FieldTable};
use ringmq::amqp::fuzz::{run, TARGETS};
use ringmq::meta::codec::encode_batch;
use ringmq::meta::state::Command;
use ringmq::meta::topology::{Binding, DestKind, QueueDef};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join(kind).join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries.map(|e| e.expect("a corpus entry").path()).filter(|p| p.is_file()).collect();
    files.sort();
    files
}

#[test]
fn every_corpus_and_regression_input_passes_its_target() {
    let mut total = 0;
    for target in TARGETS {
        let corpus = inputs("corpus", target);
        // Seeds alone are a handful; a corpus grown by fuzz/run.sh has many more.
        assert!(corpus.len() >= 4, "fuzz/corpus/{target} holds {} inputs: was it deleted?", corpus.len());
        for path in corpus.iter().chain(inputs("regressions", target).iter()) {
            let data = std::fs::read(path).expect("read a corpus input");
            // A panic names the target; the file is in the test's output through this line.
            eprintln!("{}", path.display());
            assert!(run(target, &data));
            total += 1;
        }
    }
    eprintln!("replayed {total} inputs");
}

#[test]
fn an_unknown_target_is_refused() {
    assert!(!run("no_such_target", b""));
}

fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

/// Writes the raft_entry seeds (run once, by hand: `cargo test --test fuzz_corpus --
/// --ignored write_raft_seeds`); the AMQP seeds come from fuzz/seeds.py.
#[test]
#[ignore]
fn write_raft_seeds() {
    let args = table(&[("x-message-ttl", AMQPValue::LongLongInt(1000)), ("x-queue-type", AMQPValue::LongString("quorum".into()))]);
    let queue = QueueDef {
        vhost: "/".into(),
        name: "q".into(),
        durable: true,
        auto_delete: false,
        exclusive_owner: None,
        arguments: args.clone(),
        owner_node: 2,
        owner_core: 1,
        owner_epoch: 7,
        replicas: vec![1, 2, 3],
        incarnation: 99,
    };
    let bind = Binding {
        vhost: "/".into(),
        source: "amq.headers".into(),
        dest_kind: DestKind::Queue,
        dest: "q".into(),
        routing_key: "a.#".into(),
        arguments: table(&[("x-match", AMQPValue::LongString("any".into()))]),
    };
    let seeds: Vec<(&str, Vec<Command>)> = vec![
        ("vhost", vec![Command::DeclareVhost { name: "v".into() }]),
        ("queue", vec![Command::DeclareQueue(queue)]),
        ("bind", vec![Command::Bind(bind.clone()), Command::Unbind(bind)]),
        ("cas", vec![Command::CursorCas { vhost: "/".into(), queue: "q".into(), expected: 5, new: 9 }]),
        ("boot", vec![Command::NodeBoot { node: 3, cluster: Some(4) }, Command::NodeBoot { node: 1, cluster: None }]),
        (
            "enqueue",
            vec![Command::Enqueue {
                vhost: "/".into(),
                queue: "q".into(),
                flags: 1,
                header: bytes::Bytes::from_static(b"\x00\x01q\x00"),
                body: bytes::Bytes::from_static(b"hello"),
            }],
        ),
        ("settle", vec![Command::Settle { vhost: "/".into(), queue: "q".into(), offsets: vec![1, 2, 300] }]),
        ("delete", vec![Command::DeleteQueue { vhost: "/".into(), name: "q".into() }]),
    ];
    let dir = fuzz_dir().join("corpus/raft_entry");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, cmds) in seeds {
        let mut out = Vec::new();
        encode_batch(cmds.len(), cmds.iter(), &mut out);
        std::fs::write(dir.join(format!("seed-{name}")), out).unwrap();
    }
}
