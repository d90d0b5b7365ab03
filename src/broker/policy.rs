//! Policies and operator policies (RabbitMQ's "Policies", issue 13 item 3): the run-time API,
//! which policy applies to a queue or an exchange, and the one function that computes a
//! queue's effective arguments from its declared ones and the policies that match it.
//!
//! # Precedence (RabbitMQ's, as its "Policies" guide states it)
//! 1. Of the policies of a vhost whose pattern matches the name (unanchored regex search) and
//!    whose `apply-to` covers the object, the one of highest priority applies (ties: the
//!    greatest name); likewise, separately, of the operator policies. Definitions of several
//!    policies are never merged.
//! 2. A queue's own `x-` argument wins over the policy's key.
//! 3. The operator policy then caps the result: for `max-length`, `max-length-bytes`,
//!    `message-ttl`, `expires` and `delivery-limit` the smaller of the two values wins;
//!    its other keys apply only where neither the queue nor the policy set the key.
//!
//! # Where it applies
//! [`effective_queue_arguments`] is the one point where a queue's effective arguments are
//! computed: the queue reads every `x-` argument from its result when it opens
//! (`broker/queue/mod.rs`). A policy's `alternate-exchange` is read by every core's router,
//! rebuilt at each topology change ([`exchange_alternates`]), so it applies at once to
//! existing exchanges. The queue keys apply to a queue already open when it next opens
//! (a restart of its node, a failover, a reopen after a store error); see
//! docs/ARCHITECTURE.md, "Users, permissions and policies", for the keys applied live.

use std::collections::HashMap;

use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use regex::Regex;

use super::access::{check_regex, AccessError};
use super::router::int_arg;
use crate::meta::access::{Access, ApplyTo, PolicyDef};
use crate::meta::{Command, MetaHandle, Outcome, QueueDef, Topology};

/// The queue keys a policy may set (RabbitMQ's names, without `x-`).
pub const QUEUE_KEYS: [&str; 9] = [
    "message-ttl",
    "expires",
    "max-length",
    "max-length-bytes",
    "overflow",
    "dead-letter-exchange",
    "dead-letter-routing-key",
    "delivery-limit",
    "consumer-timeout",
];

/// The exchange keys a policy may set.
pub const EXCHANGE_KEYS: [&str; 1] = ["alternate-exchange"];

/// Keys where the operator policy's smaller value wins over the queue's and the policy's.
pub const STRICTER_KEYS: [&str; 5] = ["max-length", "max-length-bytes", "message-ttl", "expires", "delivery-limit"];

/// What a policy is matched against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A queue; `quorum` for `x-queue-type=quorum`.
    Queue {
        /// A quorum queue.
        quorum: bool,
    },
    /// An exchange.
    Exchange,
}

fn covers(apply_to: ApplyTo, target: Target) -> bool {
    match (apply_to, target) {
        (ApplyTo::All, _) => true,
        (ApplyTo::Queues, Target::Queue { .. }) | (ApplyTo::Exchanges, Target::Exchange) => true,
        (ApplyTo::ClassicQueues, Target::Queue { quorum }) => !quorum,
        (ApplyTo::QuorumQueues, Target::Queue { quorum }) => quorum,
        _ => false,
    }
}

/// The policy (`operator` false) or operator policy that applies to object `name` of kind
/// `target` in `vhost`: the highest priority among those that match (precedence rule 1).
/// Compiles the matching candidates' patterns (a queue open, a router rebuild: not per
/// message).
pub fn matching<'a>(access: &'a Access, vhost: &str, name: &str, target: Target, operator: bool) -> Option<&'a PolicyDef> {
    access
        .policies
        .values()
        .filter(|p| p.vhost == vhost && p.operator == operator)
        .filter(|p| covers(p.apply_to, target))
        .filter(|p| Regex::new(&p.pattern).is_ok_and(|re| re.is_match(name)))
        .max_by(|a, b| a.priority.cmp(&b.priority).then_with(|| a.name.cmp(&b.name)))
}

/// A definition's value as a queue argument: integers as `long`, strings as `longstr`,
/// booleans as `bool`; anything else is not carried.
fn to_amqp(v: &serde_json::Value) -> Option<AMQPValue> {
    match v {
        serde_json::Value::Number(n) => n.as_i64().map(AMQPValue::LongLongInt),
        serde_json::Value::String(s) => Some(AMQPValue::LongString(LongString::from(s.as_str()))),
        serde_json::Value::Bool(b) => Some(AMQPValue::Boolean(*b)),
        _ => None,
    }
}

fn definition(p: Option<&PolicyDef>) -> serde_json::Map<String, serde_json::Value> {
    match p.map(|p| serde_json::from_str::<serde_json::Value>(&p.definition)) {
        Some(Ok(serde_json::Value::Object(m))) => m,
        _ => serde_json::Map::new(),
    }
}

/// Merges a queue's declared arguments with the policy and the operator policy that apply to
/// it, by the module's precedence. Pure. The result holds every declared argument, plus the
/// policies' queue keys as `x-<key>` arguments.
pub fn merge_queue_arguments(declared: &FieldTable, policy: Option<&PolicyDef>, operator: Option<&PolicyDef>) -> FieldTable {
    let mut out = declared.clone();
    for (k, v) in definition(policy) {
        let key = format!("x-{k}");
        if QUEUE_KEYS.contains(&k.as_str()) && !out.inner().contains_key(key.as_str()) {
            if let Some(v) = to_amqp(&v) {
                out.insert(key.into(), v);
            }
        }
    }
    for (k, v) in definition(operator) {
        let key = format!("x-{k}");
        if !QUEUE_KEYS.contains(&k.as_str()) {
            continue;
        }
        let Some(v) = to_amqp(&v) else { continue };
        let current = out.inner().get(key.as_str()).is_some().then(|| int_arg(&out, &key));
        match current {
            None => {
                out.insert(key.into(), v);
            }
            Some(cur) if STRICTER_KEYS.contains(&k.as_str()) => {
                let op = match v {
                    AMQPValue::LongLongInt(n) => n,
                    _ => continue,
                };
                if cur.is_none_or(|c| op < c) {
                    out.insert(key.into(), AMQPValue::LongLongInt(op));
                }
            }
            Some(_) => {}
        }
    }
    out
}

/// The effective arguments of queue `def`: [`merge_queue_arguments`] of its declared ones
/// with the policy and operator policy of `topology` that apply to it. The one point where
/// they are computed.
pub fn effective_queue_arguments(topology: &Topology, def: &QueueDef) -> FieldTable {
    if topology.access.policies.is_empty() {
        return def.arguments.clone();
    }
    let (policy, operator) = queue_policies(topology, def);
    merge_queue_arguments(&def.arguments, policy, operator)
}

/// The policy and the operator policy of `topology` that apply to queue `def` (rule 1; a
/// queue is a quorum queue for `apply-to` when declared with `x-queue-type=quorum`), as
/// [`effective_queue_arguments`] merges them: what the management API reports as the
/// queue's `policy` and `operator_policy`.
pub fn queue_policies<'a>(topology: &'a Topology, def: &QueueDef) -> (Option<&'a PolicyDef>, Option<&'a PolicyDef>) {
    let access = &topology.access;
    if access.policies.is_empty() {
        return (None, None);
    }
    let quorum = super::router::string_arg(&def.arguments, "x-queue-type") == Some("quorum");
    let target = Target::Queue { quorum };
    (matching(access, &def.vhost, &def.name, target, false), matching(access, &def.vhost, &def.name, target, true))
}

/// RabbitMQ's `effective_policy_definition` of an object that `policy` and `operator`
/// apply to: the policy's keys, then the operator policy's (queue keys only): where both set
/// one of [`STRICTER_KEYS`] to an integer, the smaller wins; any other key the policy set
/// keeps the policy's value (rule 3, without the object's own arguments). Pure.
pub fn effective_definition(policy: Option<&PolicyDef>, operator: Option<&PolicyDef>) -> serde_json::Map<String, serde_json::Value> {
    let mut out = definition(policy);
    for (k, v) in definition(operator) {
        if !QUEUE_KEYS.contains(&k.as_str()) {
            continue;
        }
        match out.get(&k).map(serde_json::Value::as_i64) {
            None => {
                out.insert(k, v);
            }
            Some(Some(mine)) if STRICTER_KEYS.contains(&k.as_str()) => {
                if v.as_i64().is_some_and(|op| op < mine) {
                    out.insert(k, v);
                }
            }
            Some(_) => {}
        }
    }
    out
}

/// Applies the current policies to this core's open queues (`queue/reapply.rs` lists the
/// keys applied live), when the policies changed since this core last looked: called by the
/// core's tick on every topology change. `default_timeout_ms`: `--consumer-timeout-ms`.
pub fn reapply_to_open_queues(topology: &Topology, queues: &[super::queue::QueueCell], default_timeout_ms: u64) {
    thread_local! {
        /// The policies this core's queues were last given (cores are threads).
        static SEEN: std::cell::RefCell<Option<Access>> = const { std::cell::RefCell::new(None) };
    }
    let changed = SEEN.with(|seen| {
        let mut seen = seen.borrow_mut();
        let same = seen.as_ref().is_some_and(|s| s.policies == topology.access.policies);
        if !same {
            *seen = Some(Access { policies: topology.access.policies.clone(), ..Access::default() });
        }
        !same
    });
    if !changed {
        return;
    }
    for cell in queues {
        let args = effective_queue_arguments(topology, &cell.borrow().def);
        cell.borrow_mut().reapply_arguments(&args, default_timeout_ms);
    }
}

/// True when queue `def`'s effective arguments carry `x-expires` or `x-message-ttl` (a core
/// opens such queues at start, so they expire with no client: `Node::open_expiring_queues`).
/// Cheap without policies (no copy of the arguments).
pub fn is_timed(topology: &Topology, def: &QueueDef) -> bool {
    let timed = |args: &FieldTable| ["x-expires", "x-message-ttl"].iter().any(|k| int_arg(args, k).is_some());
    if topology.access.policies.is_empty() {
        timed(&def.arguments)
    } else {
        timed(&effective_queue_arguments(topology, def))
    }
}

/// True when queue `def`'s effective arguments limit its body bytes (`x-max-length-bytes`):
/// its opening then reads the body lengths of its stored messages.
pub fn counts_bytes(topology: &Topology, def: &QueueDef) -> bool {
    effective_queue_arguments(topology, def).inner().contains_key("x-max-length-bytes")
}

/// The alternate exchanges policies give, by `(vhost, exchange)`: for each exchange declared
/// without an `alternate-exchange` argument whose applying policy sets one. Empty (and
/// cheap) when no policy sets the key. Read by the router on an unroutable publish.
pub fn exchange_alternates(topology: &Topology) -> HashMap<(String, String), String> {
    let access = &topology.access;
    let mut out = HashMap::new();
    if !access.policies.values().any(|p| p.definition.contains("\"alternate-exchange\"")) {
        return out;
    }
    for ((vhost, name), def) in &topology.exchanges {
        if def.arguments.inner().contains_key("alternate-exchange") {
            continue;
        }
        let d = definition(matching(access, vhost, name, Target::Exchange, false));
        if let Some(serde_json::Value::String(alt)) = d.get("alternate-exchange") {
            out.insert((vhost.clone(), name.clone()), alt.clone());
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The run-time API (management API `PUT/DELETE /api/policies/{vhost}/{name}`, ringmqctl
// `set_policy`/`clear_policy`/`list_policies`, and the operator-policy variants).

/// Checks a definition: a JSON object whose keys are known queue or exchange keys (operator
/// policies: queue keys only), numbers non-negative integers, strings where strings are
/// expected. Returns its compact form (keys sorted).
///
/// # Errors
/// [`AccessError::Invalid`] naming the key.
pub fn check_definition(definition: &serde_json::Value, operator: bool) -> Result<String, AccessError> {
    let serde_json::Value::Object(m) = definition else {
        return Err(AccessError::Invalid("a policy definition is a JSON object".into()));
    };
    if m.is_empty() {
        return Err(AccessError::Invalid("a policy definition sets at least one key".into()));
    }
    for (k, v) in m {
        let known = QUEUE_KEYS.contains(&k.as_str()) || (!operator && EXCHANGE_KEYS.contains(&k.as_str()));
        if !known {
            return Err(AccessError::Invalid(format!("{k} is not a recognised policy key")));
        }
        let string_key = ["overflow", "dead-letter-exchange", "dead-letter-routing-key", "alternate-exchange"].contains(&k.as_str());
        let ok = if string_key { v.is_string() } else { v.as_i64().is_some_and(|n| n >= 0 || k == "delivery-limit") };
        if !ok {
            return Err(AccessError::Invalid(format!("{k}: bad value {v}")));
        }
        if k == "overflow" && !["drop-head", "reject-publish", "reject-publish-dlx"].contains(&v.as_str().unwrap_or("")) {
            return Err(AccessError::Invalid(format!("overflow: {v} is not drop-head, reject-publish or reject-publish-dlx")));
        }
    }
    Ok(serde_json::to_string(definition).unwrap_or_default())
}

/// A policy to set (both kinds).
#[derive(Clone, Debug, PartialEq)]
pub struct PolicySpec<'a> {
    /// Vhost.
    pub vhost: &'a str,
    /// Name.
    pub name: &'a str,
    /// Regex matched against names.
    pub pattern: &'a str,
    /// What it applies to.
    pub apply_to: ApplyTo,
    /// Priority (highest applies).
    pub priority: i64,
    /// The definition (a JSON object, checked by [`check_definition`]).
    pub definition: &'a serde_json::Value,
}

async fn set(meta: &MetaHandle, spec: &PolicySpec<'_>, operator: bool) -> Result<(), AccessError> {
    check_regex(spec.pattern)?;
    let definition = check_definition(spec.definition, operator)?;
    let p = PolicyDef {
        vhost: spec.vhost.into(),
        name: spec.name.into(),
        pattern: spec.pattern.into(),
        apply_to: spec.apply_to,
        priority: spec.priority,
        definition,
        operator,
    };
    match meta.propose(Command::SetPolicy(p)).await? {
        Outcome::NotFound => Err(AccessError::NotFound(format!("vhost '{}'", spec.vhost))),
        _ => Ok(()),
    }
}

async fn clear(meta: &MetaHandle, vhost: &str, name: &str, operator: bool) -> Result<(), AccessError> {
    match meta.propose(Command::ClearPolicy { vhost: vhost.into(), name: name.into(), operator }).await? {
        Outcome::NotFound => Err(AccessError::NotFound(format!("policy '{name}' in vhost '{vhost}'"))),
        _ => Ok(()),
    }
}

/// Sets (creates or replaces) a policy (`rabbitmqctl set_policy`).
///
/// # Errors
/// [`AccessError::Invalid`] (pattern or definition), [`AccessError::NotFound`] (vhost),
/// metadata errors.
pub async fn set_policy(meta: &MetaHandle, spec: &PolicySpec<'_>) -> Result<(), AccessError> {
    set(meta, spec, false).await
}

/// Clears a policy (`clear_policy`).
///
/// # Errors
/// [`AccessError::NotFound`], metadata errors.
pub async fn clear_policy(meta: &MetaHandle, vhost: &str, name: &str) -> Result<(), AccessError> {
    clear(meta, vhost, name, false).await
}

/// Every policy, by (vhost, name).
pub fn policies(meta: &MetaHandle) -> Vec<PolicyDef> {
    meta.topology().access.policies.values().filter(|p| !p.operator).cloned().collect()
}

/// Sets an operator policy (`set_operator_policy`; queue keys only).
///
/// # Errors
/// As [`set_policy`].
pub async fn set_operator_policy(meta: &MetaHandle, spec: &PolicySpec<'_>) -> Result<(), AccessError> {
    set(meta, spec, true).await
}

/// Clears an operator policy (`clear_operator_policy`).
///
/// # Errors
/// [`AccessError::NotFound`], metadata errors.
pub async fn clear_operator_policy(meta: &MetaHandle, vhost: &str, name: &str) -> Result<(), AccessError> {
    clear(meta, vhost, name, true).await
}

/// Every operator policy, by (vhost, name).
pub fn operator_policies(meta: &MetaHandle) -> Vec<PolicyDef> {
    meta.topology().access.policies.values().filter(|p| p.operator).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pol(name: &str, pattern: &str, priority: i64, definition: &str, operator: bool) -> PolicyDef {
        PolicyDef {
            vhost: "/".into(),
            name: name.into(),
            pattern: pattern.into(),
            apply_to: ApplyTo::Queues,
            priority,
            definition: definition.into(),
            operator,
        }
    }

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    #[test]
    fn the_effective_definition_takes_the_stricter_operator_value() {
        let policy = pol("p", ".*", 0, r#"{"max-length":100,"message-ttl":5000,"dead-letter-exchange":"dlx"}"#, false);
        let operator = pol("o", ".*", 0, r#"{"max-length":10,"message-ttl":60000,"expires":1000,"overflow":"drop-head"}"#, true);
        let d = effective_definition(Some(&policy), Some(&operator));
        let want = serde_json::json!({"max-length": 10, "message-ttl": 5000, "dead-letter-exchange": "dlx", "expires": 1000, "overflow": "drop-head"});
        assert_eq!(serde_json::Value::Object(d), want);
        assert!(effective_definition(None, None).is_empty());
        assert_eq!(serde_json::Value::Object(effective_definition(None, Some(&operator)))["max-length"], 10);
    }

    #[test]
    fn the_highest_priority_matching_policy_applies() {
        let mut a = Access::default();
        for p in [pol("low", "^lim", 1, "{}", false), pol("high", "^lim\\.", 5, "{}", false), pol("other", "^x", 9, "{}", false)] {
            a.policies.insert((p.vhost.clone(), p.name.clone(), false), p);
        }
        let ex = PolicyDef { apply_to: ApplyTo::Exchanges, ..pol("ex", ".*", 99, "{}", false) };
        a.policies.insert(("/".into(), "ex".into(), false), ex);
        let q = Target::Queue { quorum: false };
        assert_eq!(matching(&a, "/", "lim.q", q, false).map(|p| p.name.as_str()), Some("high"));
        assert_eq!(matching(&a, "/", "limit", q, false).map(|p| p.name.as_str()), Some("low"));
        assert_eq!(matching(&a, "/", "zz", q, false), None, "the exchange policy does not apply to queues");
        assert_eq!(matching(&a, "/", "zz", Target::Exchange, false).map(|p| p.name.as_str()), Some("ex"));
        assert_eq!(matching(&a, "/", "lim.q", q, true), None, "operator policies are apart");
        assert_eq!(matching(&a, "v", "lim.q", q, false), None);
    }

    #[test]
    fn queue_arguments_win_over_a_policy_and_the_operator_policy_caps() {
        let policy =
            pol("p", ".*", 0, r#"{"max-length":5,"message-ttl":1000,"dead-letter-exchange":"dlx","overflow":"reject-publish"}"#, false);
        let op = pol("o", ".*", 0, r#"{"max-length":3,"message-ttl":60000,"expires":9000,"overflow":"drop-head"}"#, true);
        let declared = table(&[("x-max-length", AMQPValue::LongInt(10)), ("x-dead-letter-exchange", AMQPValue::LongString("mine".into()))]);
        let m = merge_queue_arguments(&declared, Some(&policy), Some(&op));
        assert_eq!(int_arg(&m, "x-max-length"), Some(3), "the operator policy's smaller cap wins over the argument");
        assert_eq!(int_arg(&m, "x-message-ttl"), Some(1000), "the policy's smaller TTL stays");
        assert_eq!(int_arg(&m, "x-expires"), Some(9000), "set by the operator policy alone");
        assert_eq!(super::super::router::string_arg(&m, "x-dead-letter-exchange"), Some("mine"), "the argument wins over the policy");
        assert_eq!(
            super::super::router::string_arg(&m, "x-overflow"),
            Some("reject-publish"),
            "a non-numeric operator key only fills gaps"
        );
        let small = table(&[("x-max-length", AMQPValue::ShortShortUInt(1))]);
        assert_eq!(int_arg(&merge_queue_arguments(&small, None, Some(&op)), "x-max-length"), Some(1), "the argument is stricter");
        assert_eq!(merge_queue_arguments(&declared, None, None), declared);
    }

    #[test]
    fn definitions_are_checked_and_kept_compact() {
        let ok = serde_json::json!({"max-length": 2, "overflow": "reject-publish"});
        assert_eq!(check_definition(&ok, false).unwrap(), r#"{"max-length":2,"overflow":"reject-publish"}"#);
        assert!(check_definition(&serde_json::json!({"alternate-exchange": "ae"}), true).is_err(), "operator: queue keys only");
        assert!(check_definition(&serde_json::json!({"max-length": -1}), false).is_err());
        assert!(check_definition(&serde_json::json!({"max-length": "2"}), false).is_err());
        assert!(check_definition(&serde_json::json!({"nope": 1}), false).is_err());
        assert!(check_definition(&serde_json::json!([1]), false).is_err());
        assert!(check_definition(&serde_json::json!({"overflow": "sideways"}), false).is_err());
    }

    #[test]
    fn policies_give_alternate_exchanges_to_exchanges_without_one() {
        let mut t = Topology::default();
        t.vhosts.insert("/".into());
        for name in ["a", "b"] {
            let mut args = FieldTable::default();
            if name == "b" {
                args.insert("alternate-exchange".into(), AMQPValue::LongString("own".into()));
            }
            let def = crate::meta::ExchangeDef {
                vhost: "/".into(),
                name: name.into(),
                kind: crate::meta::ExchangeKind::Direct,
                durable: true,
                auto_delete: false,
                internal: false,
                arguments: args,
            };
            t.exchanges.insert(("/".into(), name.into()), def);
        }
        assert!(exchange_alternates(&t).is_empty());
        let p = PolicyDef { apply_to: ApplyTo::Exchanges, ..pol("ae", ".*", 0, r#"{"alternate-exchange":"ae"}"#, false) };
        t.access.policies.insert(("/".into(), "ae".into(), false), p);
        let alts = exchange_alternates(&t);
        assert_eq!(alts.get(&("/".into(), "a".into())).map(String::as_str), Some("ae"));
        assert!(!alts.contains_key(&("/".to_string(), "b".to_string())), "the declared argument wins");
    }
}
