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

fn user(name: &str, tags: &[&str]) -> crate::meta::access::UserDef {
    crate::meta::access::UserDef { name: name.into(), password_hash: "aGFzaA==".into(), tags: tags.iter().map(|t| t.to_string()).collect() }
}

fn perm(user: &str, vhost: &str, re: &str) -> crate::meta::access::Permission {
    crate::meta::access::Permission { user: user.into(), vhost: vhost.into(), configure: re.into(), write: re.into(), read: re.into() }
}

fn policy(vhost: &str, name: &str, operator: bool) -> crate::meta::access::PolicyDef {
    crate::meta::access::PolicyDef {
        vhost: vhost.into(),
        name: name.into(),
        pattern: "^lim\\.".into(),
        apply_to: crate::meta::access::ApplyTo::Queues,
        priority: 1,
        definition: "{\"max-length\":2}".into(),
        operator,
    }
}

#[test]
fn users_and_permissions_need_each_other_and_go_together() {
    let mut st = MetaState::default();
    applied(&mut st, Command::DeclareVhost { name: "/".into() });
    assert!(!st.topology.access.initialized);
    assert_eq!(applied(&mut st, Command::SetPermission(perm("u", "/", ".*"))), Outcome::NotFound, "no such user");
    assert_eq!(applied(&mut st, Command::PutUser(user("u", &[]))), Outcome::Created);
    assert!(st.topology.access.initialized);
    assert_eq!(applied(&mut st, Command::PutUser(user("u", &[]))), Outcome::Existed);
    let v = st.topology.clone();
    assert!(!Command::PutUser(user("u", &[])).changed_topology(&Outcome::Existed));
    assert_eq!(st.topology, v);
    assert_eq!(applied(&mut st, Command::PutUser(user("u", &["administrator"]))), Outcome::Updated);
    assert!(Command::PutUser(user("u", &[])).changed_topology(&Outcome::Updated));
    assert_eq!(applied(&mut st, Command::SetPermission(perm("u", "nope", ".*"))), Outcome::NotFound, "no such vhost");
    assert_eq!(applied(&mut st, Command::SetPermission(perm("u", "/", ".*"))), Outcome::Created);
    assert_eq!(applied(&mut st, Command::SetPermission(perm("u", "/", "^a"))), Outcome::Updated);
    assert_eq!(st.topology.access.permission("u", "/").map(|p| p.read.as_str()), Some("^a"));
    assert_eq!(applied(&mut st, Command::DeleteUser { name: "u".into() }), Outcome::Deleted);
    assert!(st.topology.access.permissions.is_empty(), "a deleted user's permissions go with it");
    assert!(st.topology.access.initialized, "never unset: the config seed runs once");
    assert_eq!(applied(&mut st, Command::DeleteUser { name: "u".into() }), Outcome::NotFound);
    assert_eq!(applied(&mut st, Command::ClearPermission { user: "u".into(), vhost: "/".into() }), Outcome::NotFound);
}

#[test]
fn deleting_a_vhost_removes_everything_in_it_and_nothing_else() {
    let mut st = MetaState::default();
    for v in ["/", "v2"] {
        applied(&mut st, Command::DeclareVhost { name: v.into() });
    }
    applied(&mut st, Command::PutUser(user("u", &[])));
    for v in ["/", "v2"] {
        applied(&mut st, Command::SetPermission(perm("u", v, ".*")));
        assert_eq!(applied(&mut st, Command::SetPolicy(policy(v, "p", false))), Outcome::Created);
        assert_eq!(applied(&mut st, Command::SetPolicy(policy(v, "p", true))), Outcome::Created, "operator policies are apart");
        applied(&mut st, Command::DeclareQueue(QueueDef { vhost: v.into(), ..queue("q", true, None) }));
        applied(&mut st, Command::Bind(Binding { vhost: v.into(), ..bind("amq.direct", DestKind::Queue, "q", "k") }));
    }
    assert_eq!(applied(&mut st, Command::SetPolicy(policy("nope", "p", false))), Outcome::NotFound);
    assert_eq!(applied(&mut st, Command::DeleteVhost { name: "v2".into() }), Outcome::Deleted);
    let t = &st.topology;
    assert!(!t.vhosts.contains("v2") && t.exchange("v2", "amq.direct").is_none() && t.queue("v2", "q").is_none());
    assert_eq!(st.cursor("v2", "q"), None);
    assert!(t.access.permission("u", "v2").is_none() && t.access.policies_in("v2", false).next().is_none());
    assert!(t.queue("/", "q").is_some() && t.access.permission("u", "/").is_some() && t.bindings_from("/", "amq.direct").count() == 1);
    assert_eq!(t.access.policies_in("/", true).count(), 1);
    assert_eq!(applied(&mut st, Command::ClearPolicy { vhost: "/".into(), name: "p".into(), operator: true }), Outcome::Deleted);
    assert_eq!(st.topology.access.policies_in("/", false).count(), 1);
    assert_eq!(applied(&mut st, Command::DeleteVhost { name: "v2".into() }), Outcome::NotFound);
}

#[test]
fn access_commands_survive_the_codec_and_the_snapshot() {
    let cmds = vec![
        Command::DeclareVhost { name: "/".into() },
        Command::PutUser(user("ü", &["administrator", "monitoring"])),
        Command::SetPermission(perm("ü", "/", "^(a|b)$")),
        Command::SetPolicy(crate::meta::access::PolicyDef { priority: -7, ..policy("/", "p", true) }),
        Command::SetPolicy(crate::meta::access::PolicyDef { priority: i64::MIN, ..policy("/", "p", false) }),
        Command::ClearPolicy { vhost: "/".into(), name: "x".into(), operator: true },
        Command::ClearPermission { user: "x".into(), vhost: "/".into() },
        Command::DeleteUser { name: "x".into() },
        Command::DeleteVhost { name: "x".into() },
    ];
    let mut buf = Vec::new();
    crate::meta::codec::encode_batch(cmds.len(), &cmds, &mut buf);
    assert_eq!(crate::meta::codec::decode_batch(&buf).unwrap(), cmds);
    let mut st = MetaState::default();
    for c in &cmds {
        st.apply(c);
    }
    let json = serde_json::to_string(&st).unwrap();
    let back: MetaState = serde_json::from_str(&json).unwrap();
    assert_eq!(back, st);
    // A snapshot from before users lived in the metadata loads, with nothing in them.
    let old = json.replace(&format!(",\"access\":{}", serde_json::to_string(&st.topology.access).unwrap()), "");
    assert!(!old.contains("\"access\""));
    let back: MetaState = serde_json::from_str(&old).unwrap();
    assert!(back.topology.access.users.is_empty() && !back.topology.access.initialized);
}

/// A driver's entry context: its nonce and a batch sequence (`driver.rs`).
fn ctx(nonce: u64, seq: u64) -> Vec<u8> {
    [nonce.to_le_bytes(), seq.to_le_bytes()].concat()
}

#[test]
fn a_copy_of_an_applied_entry_is_skipped_whatever_its_order_and_after_a_snapshot() {
    let mut st = MetaState::default();
    assert!(st.first_application(&ctx(7, 2), 10), "the original");
    assert!(st.first_application(&ctx(7, 1), 11), "an earlier sequence that never applied (lost, then proposed again)");
    assert!(!st.first_application(&ctx(7, 2), 12), "the copy proposed again after a leader change");
    assert!(st.first_application(&ctx(8, 2), 13), "another driver's sequence 2");
    assert!(st.first_application(&[], 14) && st.first_application(&[], 15), "entries without a driver's context always apply");
    // What a snapshot carries decides the same way after it is installed.
    let mut back: MetaState = serde_json::from_slice(&serde_json::to_vec(&st).unwrap()).unwrap();
    assert!(!back.first_application(&ctx(7, 1), 16) && !back.first_application(&ctx(8, 2), 16));
    assert!(back.first_application(&ctx(7, 3), 16));
}

#[test]
fn the_record_of_applied_entries_stays_bounded() {
    let mut st = MetaState::default();
    let n = MAX_APPLIED_PER_PROPOSER as u64;
    for seq in 0..n + 10 {
        assert!(st.first_application(&ctx(1, seq), seq));
    }
    assert_eq!(st.applied_proposals[&1].seqs.len(), MAX_APPLIED_PER_PROPOSER);
    assert!(!st.first_application(&ctx(1, 3), n + 20), "older than the window: taken as applied, never applied twice");
    for nonce in 2..MAX_PROPOSERS as u64 + 5 {
        st.first_application(&ctx(nonce, 0), n + 100 + nonce);
    }
    assert_eq!(st.applied_proposals.len(), MAX_PROPOSERS);
    assert!(!st.applied_proposals.contains_key(&1), "the proposer whose last entry is oldest is forgotten first");
}

#[test]
fn the_cluster_is_named_once_then_renamed_keeping_its_id() {
    let mut st = MetaState::default();
    let name = |n: &str, id: &str, initial: bool| Command::SetClusterName { name: n.into(), permanent_id: id.into(), initial };
    assert_eq!(st.apply(&name("ringmq@a", "id-a", true)), Outcome::Created);
    // Another node's start: its default does not replace the first.
    assert_eq!(st.apply(&name("ringmq@b", "id-b", true)), Outcome::Existed);
    assert_eq!(st.apply(&name("prod", "id-c", false)), Outcome::Updated);
    assert_eq!(st.apply(&name("prod", "id-d", false)), Outcome::Existed);
    let c = st.topology.cluster.clone().expect("named");
    assert_eq!((c.name.as_str(), c.permanent_id.as_str()), ("prod", "id-a"));
    assert!(name("x", "y", false).changed_topology(&Outcome::Updated));
    // A snapshot from before the name existed reads as unnamed.
    let mut json = serde_json::to_value(MetaState::default()).unwrap();
    json["topology"].as_object_mut().unwrap().remove("cluster");
    let old: MetaState = serde_json::from_value(json).unwrap();
    assert_eq!(old.topology.cluster, None);
}
