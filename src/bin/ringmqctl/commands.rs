//! Each command as management API requests (RabbitMQ's HTTP API paths and JSON shapes),
//! returning what to print.

use serde_json::{json, Value};

use crate::http::{seg, Client, CtlError};
use crate::table::{self, Aliases, Source};
use crate::{Cli, Cmd, Format};

/// A listing: the API path, the default columns and the column aliases.
struct Listing {
    path: String,
    defaults: &'static [&'static str],
    aliases: Aliases,
}

const NO_ALIASES: Aliases = &[];

/// Runs `cli.command` against `client`: the text to print on success.
///
/// # Errors
/// [`CtlError`] of the failed request, or of a bad argument or file.
pub fn run(cli: &Cli, client: &Client) -> Result<String, CtlError> {
    let v = seg(&cli.vhost);
    let json = cli.format == Format::Json;
    let done = |line: String| -> Result<String, CtlError> { Ok(if cli.quiet || json { String::new() } else { line + "\n" }) };
    match &cli.command {
        Cmd::Status => status(client, json),
        Cmd::ClusterStatus => cluster_status(client, json),
        Cmd::ListQueues { columns } => {
            let l = Listing { path: format!("/api/queues/{v}"), defaults: &["name", "messages"], aliases: NO_ALIASES };
            list(client, &l, columns, json)
        }
        Cmd::ListExchanges { columns } => {
            let l = Listing { path: format!("/api/exchanges/{v}"), defaults: &["name", "type"], aliases: NO_ALIASES };
            list(client, &l, columns, json)
        }
        Cmd::ListBindings { columns } => {
            const A: Aliases = &[
                ("source_name", Source::Field("source")),
                ("source_kind", Source::Const("exchange")),
                ("destination_name", Source::Field("destination")),
                ("destination_kind", Source::Field("destination_type")),
            ];
            let defaults = &["source_name", "source_kind", "destination_name", "destination_kind", "routing_key", "arguments"];
            list(client, &Listing { path: format!("/api/bindings/{v}"), defaults, aliases: A }, columns, json)
        }
        Cmd::ListConnections { columns } => {
            let defaults = &["user", "peer_host", "peer_port", "state"];
            list(client, &Listing { path: "/api/connections".into(), defaults, aliases: NO_ALIASES }, columns, json)
        }
        Cmd::ListChannels { columns } => {
            const A: Aliases = &[("pid", Source::Field("name")), ("connection", Source::Field("connection_details.name"))];
            let defaults = &["name", "user", "consumer_count", "messages_unacknowledged"];
            list(client, &Listing { path: "/api/channels".into(), defaults, aliases: A }, columns, json)
        }
        Cmd::ListConsumers { columns } => {
            const A: Aliases = &[
                ("queue_name", Source::Field("queue.name")),
                ("channel_pid", Source::Field("channel_details.name")),
                ("connection", Source::Field("channel_details.connection_name")),
            ];
            let defaults = &["queue_name", "channel_pid", "consumer_tag", "ack_required", "prefetch_count", "active", "arguments"];
            list(client, &Listing { path: format!("/api/consumers/{v}"), defaults, aliases: A }, columns, json)
        }
        Cmd::ListUnacked { queue, columns } => {
            let defaults = &["delivery_tag", "consumer_tag", "connection_name", "channel", "redelivered", "age_ms"];
            let l = Listing { path: format!("/api/queues/{v}/{}/unacked", seg(queue)), defaults, aliases: NO_ALIASES };
            list(client, &l, columns, json)
        }
        Cmd::ListUsers { columns } => {
            const A: Aliases = &[("user", Source::Field("name"))];
            list(client, &Listing { path: "/api/users".into(), defaults: &["user", "tags"], aliases: A }, columns, json)
        }
        Cmd::ListVhosts { columns } => {
            list(client, &Listing { path: "/api/vhosts".into(), defaults: &["name"], aliases: NO_ALIASES }, columns, json)
        }
        Cmd::ListPermissions { columns } => {
            let l = Listing {
                path: format!("/api/vhosts/{v}/permissions"),
                defaults: &["user", "configure", "write", "read"],
                aliases: NO_ALIASES,
            };
            list(client, &l, columns, json)
        }
        Cmd::ListUserPermissions { user } => {
            let l = Listing {
                path: format!("/api/users/{}/permissions", seg(user)),
                defaults: &["vhost", "configure", "write", "read"],
                aliases: NO_ALIASES,
            };
            list(client, &l, &[], json)
        }
        Cmd::ListPolicies { columns } => {
            let defaults = &["vhost", "name", "pattern", "apply-to", "definition", "priority"];
            list(client, &Listing { path: format!("/api/policies/{v}"), defaults, aliases: NO_ALIASES }, columns, json)
        }
        Cmd::ListOperatorPolicies { columns } => {
            let defaults = &["vhost", "name", "pattern", "apply-to", "definition", "priority"];
            list(client, &Listing { path: format!("/api/operator-policies/{v}"), defaults, aliases: NO_ALIASES }, columns, json)
        }
        Cmd::AddUser { user, password } => {
            client.put(&format!("/api/users/{}", seg(user)), &json!({"password": password, "tags": ""}))?;
            done(format!("Adding user \"{user}\" ..."))
        }
        Cmd::DeleteUser { user } => {
            client.delete(&format!("/api/users/{}", seg(user)), &[])?;
            done(format!("Deleting user \"{user}\" ..."))
        }
        Cmd::ChangePassword { user, password } => {
            let tags = user_tags(client, user)?;
            client.put(&format!("/api/users/{}", seg(user)), &json!({"password": password, "tags": tags}))?;
            done(format!("Changing password for user \"{user}\" ..."))
        }
        Cmd::ClearPassword { user } => {
            let tags = user_tags(client, user)?;
            client.put(&format!("/api/users/{}", seg(user)), &json!({"password_hash": "", "tags": tags}))?;
            done(format!("Clearing password for user \"{user}\" ..."))
        }
        Cmd::SetUserTags { user, tags } => {
            let path = format!("/api/users/{}", seg(user));
            let current = client.get(&path)?;
            let hash = current.get("password_hash").cloned().unwrap_or(Value::String(String::new()));
            let mut body = json!({"password_hash": hash, "tags": tags.join(",")});
            if let Some(alg) = current.get("hashing_algorithm") {
                body["hashing_algorithm"] = alg.clone();
            }
            client.put(&path, &body)?;
            done(format!("Setting tags for user \"{user}\" to [{}] ...", tags.join(", ")))
        }
        Cmd::AuthenticateUser { user, password } => {
            let probe = Client::new(&cli.management, user, password, std::time::Duration::from_secs(cli.timeout.max(1)));
            probe.get("/api/whoami")?;
            done(format!("Authenticating user \"{user}\" ...\nSuccess"))
        }
        Cmd::SetClusterName { name } => {
            client.put("/api/cluster-name", &json!({"name": name}))?;
            done(format!("Setting cluster name to {name} ..."))
        }
        Cmd::AddVhost { name } => {
            client.put(&format!("/api/vhosts/{}", seg(name)), &json!({}))?;
            done(format!("Adding vhost \"{name}\" ..."))
        }
        Cmd::DeleteVhost { name } => {
            client.delete(&format!("/api/vhosts/{}", seg(name)), &[])?;
            done(format!("Deleting vhost \"{name}\" ..."))
        }
        Cmd::SetPermissions { user, configure, write, read } => {
            let body = json!({"configure": configure, "write": write, "read": read});
            client.put(&format!("/api/permissions/{v}/{}", seg(user)), &body)?;
            done(format!("Setting permissions for user \"{user}\" in vhost \"{}\" ...", cli.vhost))
        }
        Cmd::ClearPermissions { user } => {
            client.delete(&format!("/api/permissions/{v}/{}", seg(user)), &[])?;
            done(format!("Clearing permissions for user \"{user}\" in vhost \"{}\" ...", cli.vhost))
        }
        Cmd::SetPolicy { name, pattern, definition, priority, apply_to } => {
            put_policy(client, "policies", &v, name, pattern, definition, *priority, apply_to)?;
            done(format!(
                "Setting policy \"{name}\" for pattern \"{pattern}\" to \"{definition}\" with priority \"{priority}\" for vhost \"{}\" ...",
                cli.vhost
            ))
        }
        Cmd::ClearPolicy { name } => {
            client.delete(&format!("/api/policies/{v}/{}", seg(name)), &[])?;
            done(format!("Clearing policy \"{name}\" on vhost \"{}\" ...", cli.vhost))
        }
        Cmd::SetOperatorPolicy { name, pattern, definition, priority, apply_to } => {
            put_policy(client, "operator-policies", &v, name, pattern, definition, *priority, apply_to)?;
            done(format!("Setting operator policy override \"{name}\" for pattern \"{pattern}\" to \"{definition}\" with priority \"{priority}\" for vhost \"{}\" ...", cli.vhost))
        }
        Cmd::ClearOperatorPolicy { name } => {
            client.delete(&format!("/api/operator-policies/{v}/{}", seg(name)), &[])?;
            done(format!("Clearing operator policy \"{name}\" on vhost \"{}\" ...", cli.vhost))
        }
        Cmd::PurgeQueue { queue } => {
            client.delete(&format!("/api/queues/{v}/{}/contents", seg(queue)), &[])?;
            done(format!("Purging queue '{queue}' in vhost '{}' ...", cli.vhost))
        }
        Cmd::DeleteQueue { queue, if_empty, if_unused } => {
            let mut query = Vec::new();
            if *if_empty {
                query.push("if-empty=true");
            }
            if *if_unused {
                query.push("if-unused=true");
            }
            let q = if query.is_empty() { String::new() } else { format!("?{}", query.join("&")) };
            client.delete(&format!("/api/queues/{v}/{}{q}", seg(queue)), &[])?;
            done(format!("Deleting queue '{queue}' on vhost '{}' ...", cli.vhost))
        }
        Cmd::CloseConnection { name, explanation } => {
            client.delete(&format!("/api/connections/{}", seg(name)), &[("X-Reason", explanation)])?;
            done(format!("Closing connection {name}, reason: {explanation}..."))
        }
        Cmd::CloseAllUserConnections { user, explanation } => {
            client.delete(&format!("/api/connections/username/{}", seg(user)), &[("X-Reason", explanation)])?;
            done(format!("Closing connections of user {user}, reason: {explanation}..."))
        }
        Cmd::SetVmMemoryHighWatermark { value } => {
            let v = match value.as_slice() {
                [f] => f.clone(),
                [kind, bytes] if kind == "absolute" => bytes.clone(),
                _ => return Err(CtlError::Usage("expected FRACTION or `absolute BYTES`".into())),
            };
            set_node_setting(client, "vm_memory_high_watermark", &v)?;
            done(format!("Setting memory threshold on this node to {}", value.join(" ")))
        }
        Cmd::SetDiskFreeLimit { bytes } => {
            set_node_setting(client, "disk_free_limit", bytes)?;
            done(format!("Setting disk free limit on this node to {bytes} bytes"))
        }
        Cmd::ExportDefinitions { file } => {
            let defs = client.get("/api/definitions")?;
            let text = serde_json::to_string_pretty(&defs).unwrap_or_default() + "\n";
            if file == "-" {
                return Ok(text);
            }
            std::fs::write(file, text).map_err(|e| CtlError::Software(format!("writing {file}: {e}")))?;
            done(format!("Exported definitions for all virtual hosts to \"{file}\""))
        }
        Cmd::ImportDefinitions { file } => {
            let text = if file == "-" {
                std::io::read_to_string(std::io::stdin()).map_err(|e| CtlError::NoInput(format!("reading standard input: {e}")))?
            } else {
                std::fs::read_to_string(file).map_err(|e| CtlError::NoInput(format!("reading {file}: {e}")))?
            };
            let defs: Value = serde_json::from_str(&text).map_err(|e| CtlError::Data(format!("{file} is not JSON: {e}")))?;
            if !defs.is_object() {
                return Err(CtlError::Data(format!("{file}: definitions are a JSON object")));
            }
            let answer = client.post("/api/definitions", &defs)?;
            // The broker's report of what it skipped (a binding to an absent queue…), each
            // with its reason, after the line rabbitmqctl prints.
            let skipped: Vec<String> = answer["skipped"]
                .as_array()
                .map(|l| {
                    l.iter()
                        .map(|s| format!("\nskipped {}: {}", s["kind"].as_str().unwrap_or("object"), s["reason"].as_str().unwrap_or("")))
                        .collect()
                })
                .unwrap_or_default();
            done(format!("Imported definitions for all virtual hosts from \"{file}\"{}", skipped.concat()))
        }
    }
}

/// GET a listing and print `columns` (the listing's defaults when none are given).
fn list(client: &Client, l: &Listing, columns: &[String], json: bool) -> Result<String, CtlError> {
    let answer = client.get(&l.path)?;
    let rows = match answer {
        Value::Array(rows) => rows,
        Value::Null => Vec::new(),
        other => return Err(CtlError::Software(format!("GET {}: expected a JSON array, got {other}", l.path))),
    };
    let columns: Vec<String> = if columns.is_empty() { l.defaults.iter().map(|s| s.to_string()).collect() } else { columns.to_vec() };
    Ok(table::render(&rows, &columns, l.aliases, json))
}

/// A user's tags as the API's PUT takes them (comma-separated), from its current record.
fn user_tags(client: &Client, user: &str) -> Result<String, CtlError> {
    let u = client.get(&format!("/api/users/{}", seg(user)))?;
    Ok(match u.get("tags") {
        Some(Value::Array(t)) => t.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(","),
        Some(Value::String(s)) => s.clone(),
        _ => String::new(),
    })
}

/// PUT a policy or operator policy (`kind` is the API's collection name).
#[allow(clippy::too_many_arguments)]
fn put_policy(
    client: &Client,
    kind: &str,
    vhost: &str,
    name: &str,
    pattern: &str,
    definition: &str,
    priority: i64,
    apply_to: &str,
) -> Result<Value, CtlError> {
    let def: Value = serde_json::from_str(definition).map_err(|e| CtlError::Data(format!("the definition is not JSON: {e}")))?;
    if !def.is_object() {
        return Err(CtlError::Data("the definition must be a JSON object, e.g. '{\"max-length\":1000}'".into()));
    }
    if !matches!(apply_to, "queues" | "exchanges" | "all" | "classic_queues" | "quorum_queues") {
        return Err(CtlError::Usage(format!("--apply-to {apply_to}: one of queues, exchanges, all")));
    }
    let body = json!({"pattern": pattern, "definition": def, "priority": priority, "apply-to": apply_to});
    client.put(&format!("/api/{kind}/{vhost}/{}", seg(name)), &body)
}

/// `status`: the overview and this node's entry of /api/nodes.
/// PUTs `setting` = `value` on the node whose API `client` talks to.
fn set_node_setting(client: &Client, setting: &str, value: &str) -> Result<(), CtlError> {
    let o = client.get("/api/overview")?;
    let node = o.get("node").and_then(Value::as_str).unwrap_or_default().to_string();
    client.put(&format!("/api/ringmq/nodes/{}/{setting}", seg(&node)), &json!({ "value": value }))?;
    Ok(())
}

fn status(client: &Client, json: bool) -> Result<String, CtlError> {
    let o = client.get("/api/overview")?;
    let nodes = client.get("/api/nodes")?;
    let me = o.get("node").and_then(Value::as_str).unwrap_or_default().to_string();
    let node = nodes.as_array().and_then(|n| n.iter().find(|x| x.get("name").and_then(Value::as_str) == Some(&me))).cloned();
    if json {
        let out = json!({"overview": o, "node": node});
        return Ok(serde_json::to_string_pretty(&out).unwrap_or_default() + "\n");
    }
    let s = |v: &Value, path: &str| {
        let mut x = v;
        for p in path.split('.') {
            x = match x.get(p) {
                Some(n) => n,
                None => return None,
            };
        }
        Some(table::cell(x))
    };
    let mut pairs: Vec<(&str, String)> = Vec::new();
    let mut add = |label: &'static str, v: Option<String>| {
        if let Some(v) = v {
            pairs.push((label, v));
        }
    };
    add("Node", Some(me.clone()));
    add("Product", s(&o, "product_name"));
    add("Version", s(&o, "product_version").or_else(|| s(&o, "rabbitmq_version")));
    add("Cluster name", s(&o, "cluster_name"));
    if let Some(ls) = o.get("listeners").and_then(Value::as_array) {
        let l: Vec<String> = ls
            .iter()
            .filter(|l| l.get("node").and_then(Value::as_str).is_none_or(|n| n == me))
            .map(|l| format!("{}:{} ({})", table::cell(&l["ip_address"]), table::cell(&l["port"]), table::cell(&l["protocol"])))
            .collect();
        add("Listeners", Some(l.join(", ")));
    }
    for (label, path) in [
        ("Connections", "object_totals.connections"),
        ("Channels", "object_totals.channels"),
        ("Exchanges", "object_totals.exchanges"),
        ("Queues", "object_totals.queues"),
        ("Consumers", "object_totals.consumers"),
        ("Messages", "queue_totals.messages"),
        ("Messages ready", "queue_totals.messages_ready"),
        ("Messages unacked", "queue_totals.messages_unacknowledged"),
    ] {
        add(label, s(&o, path));
    }
    if let Some(n) = &node {
        add("Uptime (ms)", s(n, "uptime"));
        add("File descriptors", s(n, "fd_used").map(|u| format!("{u} of {}", s(n, "fd_total").unwrap_or_default())));
        add("Disk free (bytes)", s(n, "disk_free").map(|f| format!("{f} (limit {})", s(n, "disk_free_limit").unwrap_or_default())));
        add("Memory used (bytes)", s(n, "mem_used"));
        let alarms: Vec<&str> = [("disk_free_alarm", "disk"), ("mem_alarm", "memory")]
            .iter()
            .filter(|(k, _)| n.get(*k).and_then(Value::as_bool) == Some(true))
            .map(|(_, name)| *name)
            .collect();
        add("Alarms", Some(if alarms.is_empty() { "(none)".into() } else { alarms.join(", ") }));
    }
    Ok(table::key_values(&pairs))
}

/// `cluster_status`: the cluster's name and every node with whether it runs.
fn cluster_status(client: &Client, json: bool) -> Result<String, CtlError> {
    let o = client.get("/api/overview")?;
    let nodes = client.get("/api/nodes")?;
    let rows = nodes.as_array().cloned().unwrap_or_default();
    if json {
        let out = json!({"cluster_name": o.get("cluster_name"), "nodes": rows});
        return Ok(serde_json::to_string_pretty(&out).unwrap_or_default() + "\n");
    }
    let name = o.get("cluster_name").map(table::cell).unwrap_or_default();
    let cols: Vec<String> = ["name", "type", "running"].iter().map(|s| s.to_string()).collect();
    Ok(format!("Cluster name: {name}\n\n{}", table::render(&rows, &cols, &[], false)))
}
