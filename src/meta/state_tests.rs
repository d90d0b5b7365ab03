//! Unit tests of the state machine (`state.rs`), and the helpers other tests of `meta` build
//! commands with.

use super::*;
use amq_protocol::types::{AMQPValue, FieldTable};

pub(crate) fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

pub(crate) fn exchange(name: &str, kind: ExchangeKind, durable: bool) -> ExchangeDef {
    ExchangeDef {
        vhost: "/".into(),
        name: name.into(),
        kind,
        durable,
        auto_delete: false,
        internal: false,
        arguments: FieldTable::default(),
    }
}

pub(crate) fn queue(name: &str, durable: bool, exclusive_owner: Option<u64>) -> QueueDef {
    QueueDef {
        vhost: "/".into(),
        name: name.into(),
        durable,
        auto_delete: false,
        exclusive_owner,
        arguments: FieldTable::default(),
        owner_node: 1,
        owner_core: 0,
        owner_epoch: 1,
        replicas: Vec::new(),
        incarnation: 0,
    }
}

pub(crate) fn bind(source: &str, dest_kind: DestKind, dest: &str, key: &str) -> Binding {
    Binding {
        vhost: "/".into(),
        source: source.into(),
        dest_kind,
        dest: dest.into(),
        routing_key: key.into(),
        arguments: FieldTable::default(),
    }
}

pub(crate) fn cas(queue: &str, expected: u64, new: u64) -> Command {
    Command::CursorCas { vhost: "/".into(), queue: queue.into(), expected, new }
}

fn applied(st: &mut MetaState, cmd: Command) -> Outcome {
    let o = st.apply(&cmd);
    st.check_invariants().unwrap();
    o
}

#[test]
fn auto_delete_exchange_goes_with_its_last_binding() {
    let mut st = MetaState::default();
    applied(&mut st, Command::DeclareVhost { name: "/".into() });
    let mut x = exchange("ad", ExchangeKind::Fanout, false);
    x.auto_delete = true;
    let mut x2 = exchange("ad2", ExchangeKind::Fanout, false);
    x2.auto_delete = true;
    applied(&mut st, Command::DeclareExchange(x));
    applied(&mut st, Command::DeclareExchange(x2));
    applied(&mut st, Command::DeclareQueue(queue("q1", false, None)));
    applied(&mut st, Command::DeclareQueue(queue("q2", false, None)));
    applied(&mut st, Command::Bind(bind("ad", DestKind::Queue, "q1", "")));
    applied(&mut st, Command::Bind(bind("ad", DestKind::Queue, "q2", "")));
    applied(&mut st, Command::Bind(bind("ad2", DestKind::Exchange, "ad", "")));
    // a binding left: the exchange stays
    applied(&mut st, Command::Unbind(bind("ad", DestKind::Queue, "q1", "")));
    assert!(st.topology.exchange("/", "ad").is_some());
    // the last binding goes with its queue: the exchange goes, and so does ad2, whose
    // only binding pointed at it
    applied(&mut st, Command::DeleteQueue { vhost: "/".into(), name: "q2".into() });
    assert!(st.topology.exchange("/", "ad").is_none());
    assert!(st.topology.exchange("/", "ad2").is_none());
    // a new auto-delete exchange with no binding yet stays
    let mut x3 = exchange("ad3", ExchangeKind::Direct, false);
    x3.auto_delete = true;
    applied(&mut st, Command::DeclareExchange(x3));
    applied(&mut st, Command::Unbind(bind("ad3", DestKind::Queue, "q1", "")));
    assert!(st.topology.exchange("/", "ad3").is_some());
}

#[test]
fn vhost_declare_creates_predeclared_exchanges() {
    let mut st = MetaState::default();
    assert_eq!(applied(&mut st, Command::DeclareVhost { name: "/".into() }), Outcome::Created);
    assert_eq!(applied(&mut st, Command::DeclareVhost { name: "/".into() }), Outcome::Existed);
    for (name, kind) in PREDECLARED_EXCHANGES {
        let ex = st.topology.exchange("/", name).unwrap();
        assert_eq!((ex.kind, ex.durable), (kind, true));
    }
    assert_eq!(st.topology.exchanges.len(), 6);
}

#[test]
fn exchange_declare_returns_existing_definition() {
    let mut st = MetaState::default();
    let x = exchange("logs", ExchangeKind::Fanout, true);
    assert_eq!(applied(&mut st, Command::DeclareExchange(x.clone())), Outcome::Created);
    let mut other = x.clone();
    other.kind = ExchangeKind::Topic;
    assert_eq!(applied(&mut st, Command::DeclareExchange(other)), Outcome::ExchangeExists(x.clone()));
    assert_eq!(st.topology.exchange("/", "logs"), Some(&x));
}

#[test]
fn exchange_delete_if_unused_and_cascade() {
    let mut st = MetaState::default();
    applied(&mut st, Command::DeclareExchange(exchange("a", ExchangeKind::Direct, true)));
    applied(&mut st, Command::DeclareExchange(exchange("b", ExchangeKind::Direct, true)));
    applied(&mut st, Command::DeclareQueue(queue("q", true, None)));
    assert_eq!(applied(&mut st, Command::Bind(bind("a", DestKind::Queue, "q", "k"))), Outcome::Created);
    assert_eq!(applied(&mut st, Command::Bind(bind("b", DestKind::Exchange, "a", "k"))), Outcome::Created);
    let del = |name: &str, if_unused| Command::DeleteExchange { vhost: "/".into(), name: name.into(), if_unused };
    assert_eq!(applied(&mut st, del("a", true)), Outcome::InUse);
    assert_eq!(applied(&mut st, del("nope", false)), Outcome::NotFound);
    // Deleting `a` removes a->q (a is source) and b->a (a is destination).
    assert_eq!(applied(&mut st, del("a", false)), Outcome::Deleted);
    assert_eq!(st.topology.binding_count(), 0);
    // `b` is now unused.
    assert_eq!(applied(&mut st, del("b", true)), Outcome::Deleted);
    assert!(st.topology.exchanges.is_empty());
}

#[test]
fn queue_declare_starts_cursor_at_zero_and_returns_existing() {
    let mut st = MetaState::default();
    let q = queue("q", true, None);
    assert_eq!(applied(&mut st, Command::DeclareQueue(q.clone())), Outcome::Created);
    assert_eq!(st.cursor("/", "q"), Some(0));
    let mut other = q.clone();
    other.durable = false;
    assert_eq!(applied(&mut st, Command::DeclareQueue(other)), Outcome::QueueExists(q));
}

#[test]
fn queue_delete_removes_bindings_and_cursor() {
    let mut st = MetaState::default();
    applied(&mut st, Command::DeclareExchange(exchange("x", ExchangeKind::Topic, true)));
    applied(&mut st, Command::DeclareQueue(queue("q", true, None)));
    applied(&mut st, Command::DeclareQueue(queue("r", true, None)));
    applied(&mut st, Command::Bind(bind("x", DestKind::Queue, "q", "a.*")));
    applied(&mut st, Command::Bind(bind("x", DestKind::Queue, "r", "a.*")));
    applied(&mut st, cas("q", 0, 7));
    let del = Command::DeleteQueue { vhost: "/".into(), name: "q".into() };
    assert_eq!(applied(&mut st, del.clone()), Outcome::Deleted);
    assert_eq!(applied(&mut st, del), Outcome::NotFound);
    assert_eq!(st.cursor("/", "q"), None);
    let left: Vec<_> = st.topology.bindings_from("/", "x").map(|b| b.dest.as_str()).collect();
    assert_eq!(left, ["r"]);
    // Redeclared, it starts over at 0.
    applied(&mut st, Command::DeclareQueue(queue("q", true, None)));
    assert_eq!(st.cursor("/", "q"), Some(0));
}

#[test]
fn bind_and_unbind() {
    let mut st = MetaState::default();
    let b = bind("x", DestKind::Queue, "q", "k");
    assert_eq!(applied(&mut st, Command::Bind(b.clone())), Outcome::NotFound);
    applied(&mut st, Command::DeclareExchange(exchange("x", ExchangeKind::Direct, true)));
    assert_eq!(applied(&mut st, Command::Bind(b.clone())), Outcome::NotFound, "no queue");
    applied(&mut st, Command::DeclareQueue(queue("q", true, None)));
    assert_eq!(applied(&mut st, Command::Bind(b.clone())), Outcome::Created);
    assert_eq!(applied(&mut st, Command::Bind(b.clone())), Outcome::Existed);
    // Same key, other arguments: a different binding.
    let mut b2 = b.clone();
    b2.arguments = args(&[("x-match", AMQPValue::LongString("all".into()))]);
    assert_eq!(applied(&mut st, Command::Unbind(b2.clone())), Outcome::NotFound);
    assert_eq!(applied(&mut st, Command::Bind(b2.clone())), Outcome::Created);
    assert_eq!(st.topology.bindings_from("/", "x").count(), 2);
    assert_eq!(st.topology.bindings_to("/", DestKind::Queue, "q").count(), 2);
    assert_eq!(applied(&mut st, Command::Unbind(b.clone())), Outcome::Deleted);
    assert_eq!(applied(&mut st, Command::Unbind(b)), Outcome::NotFound);
    assert_eq!(applied(&mut st, Command::Unbind(b2)), Outcome::Deleted);
    assert!(st.topology.bindings.is_empty());
}

#[test]
fn cursor_cas_accepts_rejects_and_reports_current() {
    let mut st = MetaState::default();
    assert_eq!(applied(&mut st, cas("q", 0, 1)), Outcome::CasRejected { current: None });
    applied(&mut st, Command::DeclareQueue(queue("q", true, None)));
    assert_eq!(applied(&mut st, cas("q", 0, 10)), Outcome::CasApplied);
    // A proposer that read 0 before the write above is stale now.
    assert_eq!(applied(&mut st, cas("q", 0, 5)), Outcome::CasRejected { current: Some(10) });
    assert_eq!(st.cursor("/", "q"), Some(10));
    // It re-reads and retries.
    assert_eq!(applied(&mut st, cas("q", 10, 15)), Outcome::CasApplied);
    assert_eq!(st.cursor("/", "q"), Some(15));
}

#[test]
fn node_boot_keeps_durable_and_drops_the_rest() {
    let mut st = MetaState::default();
    applied(&mut st, Command::DeclareVhost { name: "/".into() });
    applied(&mut st, Command::DeclareExchange(exchange("dx", ExchangeKind::Direct, true)));
    applied(&mut st, Command::DeclareExchange(exchange("tx", ExchangeKind::Direct, false)));
    applied(&mut st, Command::DeclareQueue(queue("dq", true, None)));
    applied(&mut st, Command::DeclareQueue(queue("tq", false, None)));
    applied(&mut st, Command::DeclareQueue(queue("xq", true, Some(9))));
    for b in [
        bind("dx", DestKind::Queue, "dq", "k"),
        bind("dx", DestKind::Queue, "tq", "k"),
        bind("dx", DestKind::Queue, "xq", "k"),
        bind("tx", DestKind::Queue, "dq", "k"),
        bind("dx", DestKind::Exchange, "tx", "k"),
        bind("amq.direct", DestKind::Exchange, "dx", "k"),
    ] {
        assert_eq!(applied(&mut st, Command::Bind(b)), Outcome::Created);
    }
    applied(&mut st, cas("dq", 0, 3));
    assert_eq!(applied(&mut st, Command::NodeBoot { node: 1, cluster: None }), Outcome::Epoch(1));
    assert_eq!(applied(&mut st, Command::NodeBoot { node: 2, cluster: None }), Outcome::Epoch(1));
    assert_eq!(applied(&mut st, Command::NodeBoot { node: 1, cluster: None }), Outcome::Epoch(2));
    let t = &st.topology;
    assert!(t.queue("/", "dq").is_some());
    assert!(t.queue("/", "tq").is_none() && t.queue("/", "xq").is_none());
    assert!(t.exchange("/", "dx").is_some() && t.exchange("/", "tx").is_none());
    assert_eq!(t.exchanges.len(), 7, "6 predeclared + dx");
    let left: Vec<_> = t.all_bindings().cloned().collect();
    assert_eq!(left, [bind("amq.direct", DestKind::Exchange, "dx", "k"), bind("dx", DestKind::Queue, "dq", "k")]);
    assert_eq!(st.cursor("/", "dq"), Some(3));
    assert_eq!(st.cursor("/", "tq"), None);
    assert_eq!(st.boot_epochs.get(&1), Some(&2));
}

#[test]
fn a_cluster_node_boot_removes_only_its_own_transient_queues() {
    let mut st = MetaState::default();
    applied(&mut st, Command::DeclareVhost { name: "/".into() });
    applied(&mut st, Command::DeclareExchange(exchange("tx", ExchangeKind::Fanout, false)));
    let on = |name: &str, node: NodeId, durable: bool| QueueDef { owner_node: node, ..queue(name, durable, None) };
    for q in [on("t1", 1, false), on("t2", 2, false), on("d2", 2, true)] {
        assert_eq!(applied(&mut st, Command::DeclareQueue(q)), Outcome::Created);
    }
    assert_eq!(applied(&mut st, Command::Bind(bind("tx", DestKind::Queue, "t1", ""))), Outcome::Created);
    assert_eq!(applied(&mut st, Command::NodeBoot { node: 2, cluster: Some(0) }), Outcome::Epoch(1));
    // The same boot again (a re-sent proposal) is counted once.
    let before = st.clone();
    assert_eq!(applied(&mut st, Command::NodeBoot { node: 2, cluster: Some(0) }), Outcome::Epoch(1));
    assert_eq!(st, before);
    let t = &st.topology;
    assert!(t.queue("/", "t1").is_some(), "node 1's transient queue went with node 2's restart");
    assert!(t.queue("/", "t2").is_none() && t.queue("/", "d2").is_some());
    assert!(t.exchange("/", "tx").is_some(), "a transient exchange lives as long as the cluster");
    assert_eq!(t.bindings_from("/", "tx").count(), 1);
    assert_eq!(applied(&mut st, Command::NodeBoot { node: 1, cluster: Some(0) }), Outcome::Epoch(1));
    assert!(st.topology.queue("/", "t1").is_none());
    assert_eq!(st.topology.bindings_from("/", "tx").count(), 0);
}
