//! Property tests of the metadata state machine together with its two serialized forms: random
//! command sequences keep [`MetaState`]'s invariants and match a model of the cursors, every
//! command survives the entry codec (`codec.rs`), the state survives the snapshot JSON, and
//! replaying the encoded log is deterministic.

use std::collections::BTreeMap;

use amq_protocol::types::{AMQPValue, FieldTable};
use proptest::prelude::*;

use super::access::{ApplyTo, Permission, PolicyDef, UserDef};
use super::codec::{decode_batch, encode_batch};
use super::state::tests::args;
use super::state::{Command, MetaState, Outcome};
use super::topology::{Binding, DestKind, ExchangeDef, ExchangeKind, QueueDef};

fn name() -> impl Strategy<Value = String> {
    prop_oneof![Just("a"), Just("b"), Just("c"), Just("amq.direct")].prop_map(String::from)
}

fn table() -> impl Strategy<Value = FieldTable> {
    prop_oneof![
        3 => Just(FieldTable::default()),
        1 => (0i64..3).prop_map(|n| args(&[("x-n", AMQPValue::LongLongInt(n))])),
        1 => Just(args(&[("x-match", AMQPValue::LongString("any".into()))])),
    ]
}

fn kind() -> impl Strategy<Value = ExchangeKind> {
    prop_oneof![Just(ExchangeKind::Direct), Just(ExchangeKind::Fanout), Just(ExchangeKind::Topic), Just(ExchangeKind::Headers)]
}

fn binding() -> impl Strategy<Value = Binding> {
    let vhost = prop_oneof![4 => Just("/".to_string()), 1 => Just("v2".to_string())];
    (vhost, name(), prop_oneof![Just(DestKind::Queue), Just(DestKind::Exchange)], name(), prop_oneof![Just("k"), Just("#")], table())
        .prop_map(|(vhost, source, dest_kind, dest, key, arguments)| Binding {
            vhost,
            source,
            dest_kind,
            dest,
            routing_key: key.into(),
            arguments,
        })
}

fn command() -> impl Strategy<Value = Command> {
    let vhost = prop_oneof![4 => Just("/".to_string()), 1 => Just("v2".to_string())];
    let exch = (vhost.clone(), name(), kind(), any::<bool>(), any::<bool>(), table()).prop_map(
        |(vhost, name, kind, durable, internal, arguments)| {
            Command::DeclareExchange(ExchangeDef { vhost, name, kind, durable, auto_delete: false, internal, arguments })
        },
    );
    let replicas = proptest::collection::btree_set(1u64..6, 0..4).prop_map(|s| s.into_iter().collect::<Vec<u64>>());
    let queue = (vhost.clone(), name(), any::<bool>(), proptest::option::of(0u64..3), table(), replicas, any::<u64>()).prop_map(
        |(vhost, name, durable, exclusive_owner, arguments, replicas, incarnation)| {
            Command::DeclareQueue(QueueDef {
                vhost,
                name,
                durable,
                auto_delete: false,
                exclusive_owner,
                arguments,
                owner_node: 1,
                owner_core: 3,
                owner_epoch: 2,
                replicas,
                incarnation,
            })
        },
    );
    prop_oneof![
        1 => vhost.clone().prop_map(|name| Command::DeclareVhost { name }),
        3 => exch,
        2 => (vhost.clone(), name(), any::<bool>())
            .prop_map(|(vhost, name, if_unused)| Command::DeleteExchange { vhost, name, if_unused }),
        3 => queue,
        2 => (vhost.clone(), name()).prop_map(|(vhost, name)| Command::DeleteQueue { vhost, name }),
        4 => binding().prop_map(Command::Bind),
        2 => binding().prop_map(Command::Unbind),
        6 => (vhost.clone(), name(), 0u64..4, 0u64..4)
            .prop_map(|(vhost, queue, expected, new)| Command::CursorCas { vhost, queue, expected, new }),
        1 => (1u64..3, proptest::option::of(0u64..3)).prop_map(|(node, cluster)| Command::NodeBoot { node, cluster }),
        1 => (vhost.clone(), name(), 1u64..3, 0u64..8)
            .prop_map(|(vhost, queue, node, until)| Command::Reserve { vhost, queue, node, until }),
        1 => (vhost.clone(), name(), 1u64..6, 0u64..3)
            .prop_map(|(vhost, queue, node, id)| Command::GrowReplicaSet { vhost, queue, node, id }),
        1 => (vhost.clone(), name(), 0u64..3, 0u64..3, 0u64..4).prop_map(|(vhost, queue, id, from, to)| Command::CopyMessages {
            vhost,
            queue,
            id,
            from,
            to,
            messages: Vec::new()
        }),
        1 => (vhost.clone(), name(), 0u64..3, 0u64..3).prop_map(|(vhost, queue, id, tail)| Command::JoinReplicaSet { vhost, queue, id, tail }),
        1 => (vhost.clone(), name(), proptest::collection::vec((0u64..8, any::<u32>()), 0..3))
            .prop_map(|(vhost, queue, counts)| Command::Return { vhost, queue, counts }),
        1 => ("[a-c]{1,2}", "[xy]", any::<bool>())
            .prop_map(|(name, permanent_id, initial)| Command::SetClusterName { name, permanent_id, initial }),
        1 => (0u64..8).prop_map(|index| Command::LogCompacted { index }),
        4 => access_command(vhost),
    ]
}

/// Users, permissions, policies and vhost deletes (`access.rs`).
fn access_command(vhost: impl Strategy<Value = String> + Clone) -> impl Strategy<Value = Command> {
    let user = prop_oneof![Just("u1"), Just("u2"), Just("guest")].prop_map(String::from);
    let regex = prop_oneof![Just(""), Just(".*"), Just("^amq\\."), Just("^a$")].prop_map(String::from);
    let tags = proptest::collection::vec(prop_oneof![Just("administrator"), Just("monitoring")].prop_map(String::from), 0..3);
    let apply_to = prop_oneof![Just(ApplyTo::All), Just(ApplyTo::Queues), Just(ApplyTo::Exchanges), Just(ApplyTo::QuorumQueues)];
    let definition = prop_oneof![Just("{}"), Just("{\"max-length\":2}")].prop_map(String::from);
    prop_oneof![
        2 => (user.clone(), prop_oneof![Just(""), Just("c2FsdA==")], tags)
            .prop_map(|(name, h, tags)| Command::PutUser(UserDef { name, password_hash: h.into(), tags })),
        1 => user.clone().prop_map(|name| Command::DeleteUser { name }),
        2 => (user.clone(), vhost.clone(), regex.clone(), regex.clone(), regex).prop_map(|(user, vhost, configure, write, read)| {
            Command::SetPermission(Permission { user, vhost, configure, write, read })
        }),
        1 => (user, vhost.clone()).prop_map(|(user, vhost)| Command::ClearPermission { user, vhost }),
        2 => (vhost.clone(), name(), apply_to, -3i64..3, definition, any::<bool>()).prop_map(
            |(vhost, name, apply_to, priority, definition, operator)| Command::SetPolicy(PolicyDef {
                vhost,
                name,
                pattern: "^a".into(),
                apply_to,
                priority: priority * (i64::MAX / 4),
                definition,
                operator,
            })
        ),
        1 => (vhost.clone(), name(), any::<bool>()).prop_map(|(vhost, name, operator)| Command::ClearPolicy { vhost, name, operator }),
        1 => vhost.prop_map(|name| Command::DeleteVhost { name }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Invariants hold after every command; CAS applies exactly when the model's cursor
    /// equals `expected`; cascades leave no dangling binding or cursor; every command
    /// survives the entry codec; the state survives JSON; replay is deterministic.
    #[test]
    fn apply_keeps_invariants_and_matches_the_cursor_model(
        cmds in proptest::collection::vec(command(), 1..60)
    ) {
        let mut st = MetaState::default();
        let mut model: BTreeMap<(String, String), u64> = BTreeMap::new();
        for cmd in &cmds {
            let before = st.clone();
            let out = st.apply(cmd);
            prop_assert_eq!(st.check_invariants(), Ok(()), "after {:?}", cmd);
            match (cmd, &out) {
                (Command::CursorCas { vhost, queue, expected, new }, _) => {
                    let key = (vhost.clone(), queue.clone());
                    match model.get_mut(&key) {
                        Some(cur) if *cur == *expected => {
                            prop_assert_eq!(&out, &Outcome::CasApplied);
                            *cur = *new;
                        }
                        Some(cur) => prop_assert_eq!(&out, &Outcome::CasRejected { current: Some(*cur) }),
                        None => prop_assert_eq!(&out, &Outcome::CasRejected { current: None }),
                    }
                    prop_assert_eq!(&st.topology, &before.topology);
                }
                (Command::DeclareQueue(q), Outcome::Created) => {
                    model.insert((q.vhost.clone(), q.name.clone()), 0);
                }
                _ => {}
            }
            if let (Command::DeleteVhost { name }, Outcome::Deleted) = (cmd, &out) {
                let gone = |v: &String| v == name;
                prop_assert!(!st.topology.queues.keys().any(|k| gone(&k.0)) && !st.topology.exchanges.keys().any(|k| gone(&k.0)));
                prop_assert!(!st.topology.access.permissions.keys().any(|k| gone(&k.1)));
                prop_assert!(!st.topology.access.policies.keys().any(|k| gone(&k.0)));
            }
            if !cmd.changed_topology(&out) {
                prop_assert_eq!(&st.topology, &before.topology, "no-op changed topology");
            }
            // Queues deleted by DeleteQueue/NodeBoot drop out of the model.
            model.retain(|k, _| st.topology.queues.contains_key(k));
            prop_assert_eq!(&st.cursors, &model);

            let mut buf = Vec::new();
            encode_batch(1, [cmd], &mut buf);
            prop_assert_eq!(decode_batch(&buf).unwrap(), vec![cmd.clone()]);
        }
        let json = serde_json::to_vec(&st).unwrap();
        let back: MetaState = serde_json::from_slice(&json).unwrap();
        prop_assert_eq!(&back, &st);

        let mut again = MetaState::default();
        let mut buf = Vec::new();
        encode_batch(cmds.len(), &cmds, &mut buf);
        for cmd in decode_batch(&buf).unwrap() {
            again.apply(&cmd);
        }
        prop_assert_eq!(&again, &st);
    }
}
