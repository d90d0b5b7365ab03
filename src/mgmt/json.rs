//! AMQP values to and from JSON, as RabbitMQ's management API writes them: field tables as
//! objects, strings as strings, numbers as numbers, byte arrays as base64 strings.

use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use base64::Engine as _;
use serde_json::{json, Map, Value};

use super::ApiError;

/// A field table as a JSON object.
pub fn table_to_json(t: &FieldTable) -> Value {
    Value::Object(t.inner().iter().map(|(k, v)| (k.as_str().to_owned(), value_to_json(v))).collect())
}

/// One field value as JSON.
pub fn value_to_json(v: &AMQPValue) -> Value {
    use AMQPValue as V;
    match v {
        V::Boolean(b) => json!(b),
        V::ShortShortInt(n) => json!(n),
        V::ShortShortUInt(n) => json!(n),
        V::ShortInt(n) => json!(n),
        V::ShortUInt(n) => json!(n),
        V::LongInt(n) => json!(n),
        V::LongUInt(n) => json!(n),
        V::LongLongInt(n) => json!(n),
        V::Float(n) => json!(n),
        V::Double(n) => json!(n),
        V::DecimalValue(d) => json!(f64::from(d.value) / 10f64.powi(i32::from(d.scale))),
        V::ShortString(s) => json!(s.as_str()),
        V::LongString(s) => json!(String::from_utf8_lossy(s.as_bytes())),
        V::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_to_json).collect()),
        V::Timestamp(t) => json!(t),
        V::FieldTable(t) => table_to_json(t),
        V::ByteArray(b) => json!(base64::engine::general_purpose::STANDARD.encode(b.as_slice())),
        V::Void => Value::Null,
    }
}

/// A JSON object as a field table (`null` and a missing value are an empty table).
///
/// # Errors
/// 400 when `v` is not an object.
pub fn json_to_table(v: Option<&Value>) -> Result<FieldTable, ApiError> {
    let mut t = FieldTable::default();
    match v {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (k, v) in m {
                t.insert(ShortString::from(k.clone()), json_to_value(v));
            }
        }
        Some(other) => return Err(ApiError::bad_request(format!("arguments must be an object, not {other}"))),
    }
    Ok(t)
}

/// One JSON value as a field value: integers as long-long, other numbers as double, strings
/// as long strings (RabbitMQ's choices).
pub fn json_to_value(v: &Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(0.0)),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s.clone())),
        Value::Array(a) => AMQPValue::FieldArray(FieldArray::from(a.iter().map(json_to_value).collect::<Vec<_>>())),
        Value::Object(_) => AMQPValue::FieldTable(json_to_table(Some(v)).unwrap_or_default()),
    }
}

/// A boolean field of a request body: `true`/`false`, or the strings `"true"`/`"false"`
/// (rabbitmqadmin sends strings); `default` when absent.
///
/// # Errors
/// 400 for anything else.
pub fn bool_field(body: &Value, name: &str, default: bool) -> Result<bool, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s == "true" => Ok(true),
        Some(Value::String(s)) if s == "false" => Ok(false),
        Some(other) => Err(ApiError::bad_request(format!("{name} must be a boolean, not {other}"))),
    }
}

/// An integer field of a request body, as a number or a string of digits; `default` when
/// absent.
///
/// # Errors
/// 400 for anything else.
pub fn int_field(body: &Value, name: &str, default: i64) -> Result<i64, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Number(n)) if n.as_i64().is_some() => Ok(n.as_i64().unwrap_or(default)),
        Some(Value::String(s)) if s.parse::<i64>().is_ok() => Ok(s.parse().unwrap_or(default)),
        Some(other) => Err(ApiError::bad_request(format!("{name} must be an integer, not {other}"))),
    }
}

/// A string field of a request body; `default` when absent.
///
/// # Errors
/// 400 when it is not a string.
pub fn str_field<'a>(body: &'a Value, name: &str, default: &'a str) -> Result<&'a str, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(ApiError::bad_request(format!("{name} must be a string, not {other}"))),
    }
}

/// Message properties as RabbitMQ's API shows them (only those set).
pub fn properties_to_json(p: &AMQPProperties) -> Value {
    let mut m = Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_owned(), v);
    };
    if let Some(v) = p.content_type() {
        put("content_type", json!(v.as_str()));
    }
    if let Some(v) = p.content_encoding() {
        put("content_encoding", json!(v.as_str()));
    }
    if let Some(v) = p.headers() {
        put("headers", table_to_json(v));
    }
    if let Some(v) = p.delivery_mode() {
        put("delivery_mode", json!(v));
    }
    if let Some(v) = p.priority() {
        put("priority", json!(v));
    }
    if let Some(v) = p.correlation_id() {
        put("correlation_id", json!(v.as_str()));
    }
    if let Some(v) = p.reply_to() {
        put("reply_to", json!(v.as_str()));
    }
    if let Some(v) = p.expiration() {
        put("expiration", json!(v.as_str()));
    }
    if let Some(v) = p.message_id() {
        put("message_id", json!(v.as_str()));
    }
    if let Some(v) = p.timestamp() {
        put("timestamp", json!(v));
    }
    if let Some(v) = p.kind() {
        put("type", json!(v.as_str()));
    }
    if let Some(v) = p.user_id() {
        put("user_id", json!(v.as_str()));
    }
    if let Some(v) = p.app_id() {
        put("app_id", json!(v.as_str()));
    }
    Value::Object(m)
}

/// Message properties from a publish request's `properties` object.
///
/// # Errors
/// 400 for a field of the wrong type.
pub fn json_to_properties(v: Option<&Value>) -> Result<AMQPProperties, ApiError> {
    let mut p = AMQPProperties::default();
    let Some(Value::Object(m)) = v else {
        return match v {
            None | Some(Value::Null) => Ok(p),
            Some(other) => Err(ApiError::bad_request(format!("properties must be an object, not {other}"))),
        };
    };
    let obj = Value::Object(m.clone());
    let text = |k: &str| -> Result<Option<ShortString>, ApiError> {
        Ok(match obj.get(k) {
            None | Some(Value::Null) => None,
            Some(_) => Some(ShortString::from(str_field(&obj, k, "")?.to_owned())),
        })
    };
    if let Some(v) = text("content_type")? {
        p = p.with_content_type(v);
    }
    if let Some(v) = text("content_encoding")? {
        p = p.with_content_encoding(v);
    }
    if obj.get("headers").is_some() {
        p = p.with_headers(json_to_table(obj.get("headers"))?);
    }
    if obj.get("delivery_mode").is_some() {
        p = p.with_delivery_mode(int_field(&obj, "delivery_mode", 1)?.clamp(0, 255) as u8);
    }
    if obj.get("priority").is_some() {
        p = p.with_priority(int_field(&obj, "priority", 0)?.clamp(0, 255) as u8);
    }
    if let Some(v) = text("correlation_id")? {
        p = p.with_correlation_id(v);
    }
    if let Some(v) = text("reply_to")? {
        p = p.with_reply_to(v);
    }
    if let Some(v) = text("expiration")? {
        p = p.with_expiration(v);
    }
    if let Some(v) = text("message_id")? {
        p = p.with_message_id(v);
    }
    if obj.get("timestamp").is_some() {
        p = p.with_timestamp(int_field(&obj, "timestamp", 0)?.max(0) as u64);
    }
    if let Some(v) = text("type")? {
        p = p.with_type(v);
    }
    if let Some(v) = text("user_id")? {
        p = p.with_user_id(v);
    }
    if let Some(v) = text("app_id")? {
        p = p.with_app_id(v);
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_round_trip_through_json() {
        let v = json!({"x-message-ttl": 1000, "x-dead-letter-exchange": "dlx", "flag": true, "list": [1, "a"], "nested": {"k": 2.5}});
        let t = json_to_table(Some(&v)).expect("table");
        assert_eq!(table_to_json(&t), v);
        assert!(json_to_table(Some(&json!([1]))).is_err());
    }

    #[test]
    fn booleans_and_integers_take_rabbitmqadmin_strings() {
        let body = json!({"durable": "false", "auto_delete": true, "count": "3"});
        assert_eq!(bool_field(&body, "durable", true), Ok(false));
        assert_eq!(bool_field(&body, "auto_delete", false), Ok(true));
        assert_eq!(bool_field(&body, "absent", true), Ok(true));
        assert_eq!(int_field(&body, "count", 1), Ok(3));
        assert!(bool_field(&json!({"durable": "yes"}), "durable", true).is_err());
    }

    #[test]
    fn properties_round_trip_through_json() {
        let v = json!({"delivery_mode": 2, "content_type": "text/plain", "headers": {"a": "b"}, "priority": 3});
        let p = json_to_properties(Some(&v)).expect("properties");
        assert_eq!(properties_to_json(&p), v);
    }
}
