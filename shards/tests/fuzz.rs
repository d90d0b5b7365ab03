//! Op-fuzz: random append / delete / sync / reopen / crash / read sequences
//! against an in-memory model (proptest, bounded cases).

mod common;

use std::collections::BTreeMap;

use bytes::Bytes;
use common::*;
use proptest::prelude::*;
use ringmq_shards::{Shard, ShardConfig};

#[derive(Clone, Debug)]
enum Op {
    Append { size: usize, flags: u8, n: u8 },
    Delete(Vec<prop::sample::Index>),
    DeleteOldest(u8),
    Sync,
    Reopen,
    Crash,
    Read(prop::sample::Index),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prop_oneof![0usize..64, 500usize..4000, 30_000usize..70_000], any::<u8>(), 1u8..20)
            .prop_map(|(size, flags, n)| Op::Append { size, flags, n }),
        3 => prop::collection::vec(any::<prop::sample::Index>(), 1..8).prop_map(Op::Delete),
        1 => (1u8..60).prop_map(Op::DeleteOldest),
        3 => Just(Op::Sync),
        1 => Just(Op::Reopen),
        1 => Just(Op::Crash),
        2 => any::<prop::sample::Index>().prop_map(Op::Read),
    ]
}

fn cfg() -> ShardConfig {
    ShardConfig { segment_bytes: 64 << 10, cache_bytes: 8 << 10, verify_on_open: false }
}

#[derive(Default)]
struct Model {
    live: BTreeMap<u64, (u8, Bytes)>,
    next: u64,
    synced: u64,
    deleted_unsynced: BTreeMap<u64, (u8, Bytes)>,
}

fn body_for(o: u64, size: usize) -> Bytes {
    body(o, size)
}

async fn full_check(s: &Shard, m: &Model) {
    assert_eq!(s.next_offset(), m.next);
    assert_eq!(s.len(), m.live.len() as u64);
    assert_eq!(s.live_offsets(), m.live.keys().copied().collect::<Vec<_>>());
    assert_eq!(s.start_offset(), m.live.keys().next().copied().unwrap_or(m.next));
    for (&o, (flags, b)) in &m.live {
        let r = s.read(o).await.unwrap().unwrap_or_else(|| panic!("record {o} missing"));
        assert_eq!((r.flags, &r.header[..], &r.body), (*flags, &header(o)[..], b), "record {o}");
    }
    let mut rd = s.reader(0);
    let mut n = 0;
    while let Some(r) = rd.next().await.unwrap() {
        assert!(m.live.contains_key(&r.offset));
        n += 1;
    }
    assert_eq!(n, m.live.len());
}

async fn run_ops(ops: Vec<Op>) {
    let dir = tmpdir();
    let path = dir.path().join("s");
    let (mut s, _) = Shard::open(&path, cfg()).await.unwrap();
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Append { size, flags, n } => {
                for _ in 0..n {
                    let o = s.append(flags, &header(m.next), &body_for(m.next, size)).unwrap();
                    assert_eq!(o, m.next);
                    m.live.insert(o, (flags, body_for(o, size)));
                    m.next += 1;
                }
                s.throttle().await;
            }
            Op::Delete(picks) => {
                if m.next == 0 {
                    continue;
                }
                let offs: Vec<u64> = picks.iter().map(|i| i.index(m.next as usize + 2) as u64).collect();
                s.delete_by_offsets(&offs).unwrap();
                for o in offs {
                    if let Some(v) = m.live.remove(&o) {
                        m.deleted_unsynced.insert(o, v);
                    }
                }
            }
            Op::DeleteOldest(k) => {
                let offs: Vec<u64> = m.live.keys().take(k as usize).copied().collect();
                s.delete_by_offsets(&offs).unwrap();
                for o in offs {
                    let v = m.live.remove(&o).unwrap();
                    m.deleted_unsynced.insert(o, v);
                }
            }
            Op::Sync => {
                let sy = s.sync().await.unwrap();
                assert_eq!(sy.upto(), m.next);
                m.synced = m.next;
                m.deleted_unsynced.clear();
            }
            Op::Reopen => {
                s.close().await.unwrap();
                drop(s);
                let (s2, rep) = Shard::open(&path, cfg()).await.unwrap();
                assert!(rep.dropped.is_empty(), "clean reopen drops nothing: {rep:?}");
                s = s2;
                m.synced = m.next;
                m.deleted_unsynced.clear();
                full_check(&s, &m).await;
            }
            Op::Crash => {
                s.abandon().await;
                let (s2, _) = Shard::open(&path, cfg()).await.unwrap();
                s = s2;
                let n = s.next_offset();
                assert!(n >= m.synced && n <= m.next, "next {n} outside [{}, {}]", m.synced, m.next);
                m.live.retain(|&o, _| o < n);
                m.deleted_unsynced.retain(|&o, _| o < n);
                // An unsynced delete may or may not have survived.
                for (o, v) in std::mem::take(&mut m.deleted_unsynced) {
                    if s.is_live(o) {
                        m.live.insert(o, v);
                    }
                }
                m.next = n;
                m.synced = n;
                full_check(&s, &m).await;
            }
            Op::Read(i) => {
                if m.next == 0 {
                    continue;
                }
                let o = i.index(m.next as usize) as u64;
                let r = s.read(o).await.unwrap();
                match m.live.get(&o) {
                    Some((flags, b)) => {
                        let r = r.expect("live record");
                        assert_eq!((r.flags, &r.body), (*flags, b));
                    }
                    None => assert!(r.is_none(), "deleted record {o} readable"),
                }
            }
        }
        assert_eq!(s.len(), m.live.len() as u64);
        assert_eq!(s.next_offset(), m.next);
    }
    full_check(&s, &m).await;
    s.destroy().await.unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, max_shrink_iters: 64, ..ProptestConfig::default() })]
    #[test]
    fn ops_match_the_model(ops in prop::collection::vec(op(), 1..40)) {
        run(move || run_ops(ops));
    }
}
