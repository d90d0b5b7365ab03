//! The query parameters RabbitMQ's API takes on every listing: `name` (filter, a substring,
//! or a regular expression… here a substring only: `use_regex` is refused), `sort` and
//! `sort_reverse`, `columns` (keep only these fields, dotted paths for nested ones), and
//! `page` / `page_size` (which turn the answer into RabbitMQ's page object).

use std::collections::HashMap;

use serde_json::{json, Map, Value};

use super::ApiError;

/// Largest `page_size` (RabbitMQ's).
const MAX_PAGE_SIZE: usize = 500;

/// Applies the listing parameters of `query` to `list` (a JSON array of objects).
///
/// # Errors
/// 400 for a `page` or `page_size` that is not a positive integer, a page past the end, or
/// `use_regex=true`.
pub fn shape(list: Vec<Value>, query: &HashMap<String, String>) -> Result<Value, ApiError> {
    let total = list.len();
    let mut items = list;
    if let Some(name) = query.get("name").filter(|n| !n.is_empty()) {
        if query.get("use_regex").is_some_and(|v| v == "true") {
            return Err(ApiError::bad_request("use_regex is not supported: name filters by substring"));
        }
        items.retain(|v| v.get("name").and_then(Value::as_str).is_some_and(|n| n.contains(name.as_str())));
    }
    if let Some(key) = query.get("sort").filter(|k| !k.is_empty()) {
        items.sort_by(|a, b| compare(lookup(a, key), lookup(b, key)));
        if query.get("sort_reverse").is_some_and(|v| v == "true") {
            items.reverse();
        }
    }
    if let Some(cols) = query.get("columns").filter(|c| !c.is_empty()) {
        let cols: Vec<&str> = cols.split(',').map(str::trim).filter(|c| !c.is_empty()).collect();
        items = items.into_iter().map(|v| keep_columns(&v, &cols)).collect();
    }
    let Some(page) = query.get("page") else { return Ok(Value::Array(items)) };
    let positive = |name: &str, v: &str| {
        v.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| ApiError::bad_request(format!("{name} must be a positive integer")))
    };
    let page = positive("page", page)?;
    let page_size = query.get("page_size").map(|v| positive("page_size", v)).transpose()?.unwrap_or(100).min(MAX_PAGE_SIZE);
    let filtered = items.len();
    let page_count = filtered.div_ceil(page_size).max(1);
    if page > page_count {
        return Err(ApiError::bad_request(format!("page {page} is past the last page ({page_count})")));
    }
    let items: Vec<Value> = items.into_iter().skip((page - 1) * page_size).take(page_size).collect();
    Ok(json!({
        "filtered_count": filtered,
        "item_count": items.len(),
        "items": items,
        "page": page,
        "page_count": page_count,
        "page_size": page_size,
        "total_count": total,
    }))
}

/// The value at dotted path `key` (`message_stats.publish`).
fn lookup<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    key.split('.').try_fold(v, |v, k| v.get(k))
}

fn compare(a: Option<&Value>, b: Option<&Value>) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    match (a, b) {
        (Some(Value::Number(x)), Some(Value::Number(y))) => x.as_f64().partial_cmp(&y.as_f64()).unwrap_or(Ordering::Equal),
        (Some(Value::String(x)), Some(Value::String(y))) => x.cmp(y),
        (Some(x), Some(y)) => x.to_string().cmp(&y.to_string()),
        (None, Some(_)) => Ordering::Less,
        (Some(_), None) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    }
}

/// `v` with only the fields named by `cols` (dotted paths keep the nesting).
fn keep_columns(v: &Value, cols: &[&str]) -> Value {
    let mut out = Value::Object(Map::new());
    for col in cols {
        let Some(found) = lookup(v, col) else { continue };
        let mut at = &mut out;
        let parts: Vec<&str> = col.split('.').collect();
        for (i, part) in parts.iter().enumerate() {
            let Value::Object(m) = at else { break };
            if i + 1 == parts.len() {
                m.insert((*part).to_owned(), found.clone());
                break;
            }
            at = m.entry((*part).to_owned()).or_insert_with(|| Value::Object(Map::new()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn queues() -> Vec<Value> {
        (0..5).map(|i| json!({"name": format!("q{i}"), "messages": 10 - i, "message_stats": {"publish": i}})).collect()
    }

    #[test]
    fn filters_sorts_and_keeps_columns() {
        let v = shape(queues(), &q(&[("sort", "messages"), ("columns", "name,message_stats.publish")])).unwrap();
        assert_eq!(v[0], json!({"name": "q4", "message_stats": {"publish": 4}}));
        let v = shape(queues(), &q(&[("sort", "name"), ("sort_reverse", "true"), ("name", "q")])).unwrap();
        assert_eq!(v[0]["name"], "q4");
        assert_eq!(shape(queues(), &q(&[("name", "q3")])).unwrap().as_array().unwrap().len(), 1);
    }

    #[test]
    fn pages_as_rabbitmq_does() {
        let v = shape(queues(), &q(&[("page", "2"), ("page_size", "2")])).unwrap();
        assert_eq!(v["items"].as_array().unwrap().len(), 2);
        assert_eq!(v["items"][0]["name"], "q2");
        assert_eq!((v["page_count"].as_u64(), v["total_count"].as_u64(), v["filtered_count"].as_u64()), (Some(3), Some(5), Some(5)));
        assert_eq!(shape(queues(), &q(&[("page", "4"), ("page_size", "2")])).map_err(|e| e.status), Err(400));
        assert_eq!(shape(queues(), &q(&[("page", "0")])).map_err(|e| e.status), Err(400));
        assert_eq!(shape(Vec::new(), &q(&[("page", "1")])).unwrap()["page_count"], 1);
    }
}
