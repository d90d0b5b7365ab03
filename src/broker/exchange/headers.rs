//! Headers exchange (spec 3.1.3.4, RabbitMQ docs "Headers Exchange"): the binding's
//! arguments are compared with the message headers. `x-match` is `all` (default), `any`,
//! `all-with-x` or `any-with-x`; binding arguments starting with `x-` are ignored unless
//! the `-with-x` variant is used. An argument of type void matches on presence alone.

use amq_protocol::types::{AMQPValue, FieldTable};

use crate::broker::router::{int_value, str_value};

/// Does a headers binding with `args` match a message with `headers`?
pub fn matches(args: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let (any, with_x) = match args.inner().get("x-match").and_then(str_value) {
        Some(b"any") => (true, false),
        Some(b"all-with-x") => (false, true),
        Some(b"any-with-x") => (true, true),
        _ => (false, false),
    };
    let empty = FieldTable::default();
    let headers = headers.unwrap_or(&empty);
    let mut considered = 0usize;
    let mut matched = 0usize;
    for (k, v) in args.inner() {
        let key = k.as_str();
        if key == "x-match" || (!with_x && key.starts_with("x-")) {
            continue;
        }
        considered += 1;
        let hit = match (v, headers.inner().get(k)) {
            (_, None) => false,
            (AMQPValue::Void, Some(_)) => true,
            (v, Some(h)) => values_equal(v, h),
        };
        if hit {
            matched += 1;
            if any {
                return true;
            }
        } else if !any {
            return false;
        }
    }
    // any: nothing matched (an empty `any` binding matches nothing); all: every one matched.
    !any && matched == considered
}

/// Equality that treats the string types and the integer types as the same kind of value,
/// as RabbitMQ does when comparing header values.
fn values_equal(a: &AMQPValue, b: &AMQPValue) -> bool {
    if let (Some(x), Some(y)) = (str_value(a), str_value(b)) {
        return x == y;
    }
    if let (Some(x), Some(y)) = (int_value(a), int_value(b)) {
        return x == y;
    }
    a == b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }
    fn s(v: &str) -> AMQPValue {
        AMQPValue::LongString(v.into())
    }

    #[test]
    fn all_and_any() {
        let msg = table(&[("a", s("1")), ("b", AMQPValue::LongInt(2))]);
        assert!(matches(&table(&[("a", s("1")), ("b", AMQPValue::ShortShortInt(2))]), Some(&msg)));
        assert!(!matches(&table(&[("a", s("1")), ("c", s("3"))]), Some(&msg)));
        assert!(matches(&table(&[("x-match", s("any")), ("a", s("1")), ("c", s("3"))]), Some(&msg)));
        assert!(!matches(&table(&[("x-match", s("any")), ("c", s("3"))]), Some(&msg)));
        assert!(!matches(&table(&[("x-match", s("any"))]), Some(&msg)));
        assert!(matches(&table(&[]), None));
    }

    #[test]
    fn with_x() {
        let msg = table(&[("x-k", s("v"))]);
        assert!(matches(&table(&[("x-k", s("nope"))]), Some(&msg)));
        assert!(!matches(&table(&[("x-match", s("all-with-x")), ("x-k", s("nope"))]), Some(&msg)));
        assert!(matches(&table(&[("x-match", s("any-with-x")), ("x-k", s("v"))]), Some(&msg)));
    }
}
