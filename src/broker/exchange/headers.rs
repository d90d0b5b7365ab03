//! Headers exchange (spec 3.1.3.4, RabbitMQ docs "Headers Exchange"): the binding's
//! arguments are compared with the message headers. `x-match` is `all` (default), `any`,
//! `all-with-x` or `any-with-x`; binding arguments starting with `x-` are ignored unless
//! the `-with-x` variant is used. An argument of type void matches on presence alone.

use amq_protocol::types::{AMQPValue, FieldTable};

/// Does a headers binding with `args` match a message with `headers`?
pub fn matches(args: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let mode = match args.inner().get("x-match") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(s)) => s.as_str().to_owned(),
        _ => "all".to_owned(),
    };
    let (any, with_x) = match mode.as_str() {
        "any" => (true, false),
        "all-with-x" => (false, true),
        "any-with-x" => (true, true),
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
    fn as_str(v: &AMQPValue) -> Option<Vec<u8>> {
        match v {
            AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
            AMQPValue::ShortString(s) => Some(s.as_str().as_bytes().to_vec()),
            _ => None,
        }
    }
    fn as_int(v: &AMQPValue) -> Option<i128> {
        Some(match *v {
            AMQPValue::ShortShortInt(i) => i as i128,
            AMQPValue::ShortShortUInt(i) => i as i128,
            AMQPValue::ShortInt(i) => i as i128,
            AMQPValue::ShortUInt(i) => i as i128,
            AMQPValue::LongInt(i) => i as i128,
            AMQPValue::LongUInt(i) => i as i128,
            AMQPValue::LongLongInt(i) => i as i128,
            AMQPValue::Timestamp(i) => i as i128,
            _ => return None,
        })
    }
    if let (Some(x), Some(y)) = (as_str(a), as_str(b)) {
        return x == y;
    }
    if let (Some(x), Some(y)) = (as_int(a), as_int(b)) {
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
