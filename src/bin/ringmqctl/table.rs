//! Output: rows of management API objects cut to the asked columns, as an aligned table
//! (default) or a JSON array of objects (`--format json`, as rabbitmqctl's json formatter).

use serde_json::Value;

/// How a column is read from an API object.
#[derive(Clone, Copy, Debug)]
pub enum Source {
    /// A field, by path (`message_stats.publish` reads a nested one).
    Field(&'static str),
    /// A constant (e.g. bindings' `source_kind`, always `exchange`).
    Const(&'static str),
}

/// rabbitmqctl's column name → where the API keeps it, for one listing. Columns not named
/// here are read as a field of that name.
pub type Aliases = &'static [(&'static str, Source)];

/// The value of `column` in `obj`.
pub fn pick(obj: &Value, column: &str, aliases: Aliases) -> Value {
    let source = aliases.iter().find(|(c, _)| *c == column).map(|(_, s)| *s).unwrap_or(Source::Field(""));
    match source {
        Source::Const(v) => Value::String(v.to_string()),
        Source::Field("") => field(obj, column),
        Source::Field(path) => field(obj, path),
    }
}

fn field(obj: &Value, path: &str) -> Value {
    let mut v = obj;
    for part in path.split('.') {
        match v.get(part) {
            Some(next) => v = next,
            None => return Value::Null,
        }
    }
    v.clone()
}

/// One cell as text: strings bare, numbers and booleans as JSON writes them, lists joined
/// by `,` (user tags), objects as compact JSON (arguments), null as nothing.
pub fn cell(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(items) if items.iter().all(|i| !i.is_object() && !i.is_array()) => {
            items.iter().map(cell).collect::<Vec<_>>().join(",")
        }
        other => other.to_string(),
    }
}

/// `rows` cut to `columns` (aliases applied), rendered: the JSON text of an array of
/// objects, or a table whose first line names the columns and whose cells are padded to the
/// widest of their column (the last column unpadded). No rows: the header alone.
pub fn render(rows: &[Value], columns: &[String], aliases: Aliases, json: bool) -> String {
    if json {
        // One object per line, its keys in column order (a serde_json map would sort them).
        let objects: Vec<String> = rows
            .iter()
            .map(|r| {
                let fields: Vec<String> = columns.iter().map(|c| format!("{}:{}", Value::String(c.clone()), pick(r, c, aliases))).collect();
                format!("{{{}}}", fields.join(","))
            })
            .collect();
        return if objects.is_empty() { "[]\n".into() } else { format!("[\n{}\n]\n", objects.join(",\n")) };
    }
    let mut lines: Vec<Vec<String>> = vec![columns.to_vec()];
    lines.extend(rows.iter().map(|r| columns.iter().map(|c| cell(&pick(r, c, aliases))).collect()));
    let widths: Vec<usize> = (0..columns.len()).map(|i| lines.iter().map(|l| l[i].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for l in &lines {
        let mut line = String::new();
        for (i, c) in l.iter().enumerate() {
            if i + 1 == l.len() {
                line.push_str(c);
            } else {
                line.push_str(c);
                line.push_str(&" ".repeat(widths[i] - c.chars().count() + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// An object as `key: value` lines in the order given (status output).
pub fn key_values(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    pairs.iter().map(|(k, v)| format!("{k:width$}  {v}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_table_aligns_columns_and_reads_aliases_and_nested_fields() {
        let rows = [json!({"name": "jobs", "messages": 12, "message_stats": {"publish": 3}, "tags": ["a", "b"]}), json!({"name": "q"})];
        let cols: Vec<String> = ["name", "messages", "published", "kind", "tags"].iter().map(|s| s.to_string()).collect();
        let aliases: Aliases = &[("published", Source::Field("message_stats.publish")), ("kind", Source::Const("queue"))];
        let out = render(&rows, &cols, aliases, false);
        assert_eq!(
            out,
            "name  messages  published  kind   tags\njobs  12        3          queue  a,b\nq                          queue\n"
        );
        let js: Value = serde_json::from_str(&render(&rows, &cols, aliases, true)).unwrap();
        assert_eq!(js[0]["published"], json!(3));
        assert_eq!(js[1]["messages"], Value::Null);
        let text = render(&rows[..1], &cols[..2], aliases, true);
        assert_eq!(text, "[\n{\"name\":\"jobs\",\"messages\":12}\n]\n", "keys in column order");
        assert_eq!(render(&[], &cols, aliases, true), "[]\n");
    }

    #[test]
    fn cells_render_objects_as_json() {
        assert_eq!(cell(&json!({"x-max-length": 2})), r#"{"x-max-length":2}"#);
        assert_eq!(cell(&json!(true)), "true");
    }
}
