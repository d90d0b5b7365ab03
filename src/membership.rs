//! Joining and forgetting cluster nodes, as an operator does it: `--join` on a new node, and
//! the one-shot `--forget-node ID`. Both are admin requests on the cluster transport
//! (`cluster::admin_request`, one request, one answer) that a running node turns into a
//! metadata membership change (`meta::MemberChange`). Wiring, like `server.rs`: it names the
//! transport and the metadata group.
//!
//! # Requests (UTF-8 text)
//! - `join <id> <addr>` → `ok <v1,v2,…>` (the voters the group was formed with: where the
//!   joiner starts from) once node `id` is a voter; at once when it is one already.
//! - `forget <id>` → `ok` once node `id` is no voter; refused for the answering node itself
//!   (ask another one).
//! - `voters` → `ok <v1,v2,…>`: the group's voters, from a node that knows a leader (a node
//!   waiting for a majority at start asks, so a forgotten one refuses at once).
//! - Anything else, or a failure → `error <why>`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::cluster::{admin_request, OnAdmin};
use crate::config::Config;
use crate::meta::{MemberChange, MetaHandle, NodeId};

/// How long one admin request may take: a membership change commits within the proposal
/// timeout (10 s) unless the group has no majority.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Pause between rounds of asking every peer.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// The answer of a running node to admin requests, given its metadata handle.
pub fn admin_handler(meta: MetaHandle) -> OnAdmin {
    std::sync::Arc::new(move |from, request| answer(&meta, from, &String::from_utf8_lossy(&request)).into_bytes())
}

fn answer(meta: &MetaHandle, from: NodeId, request: &str) -> String {
    let words: Vec<&str> = request.split_whitespace().collect();
    let voters = || meta.cluster_figures().voters;
    let result = match words.as_slice() {
        ["join", id, addr] => match (id.parse::<NodeId>(), addr.parse::<SocketAddr>()) {
            (Ok(0), _) => Err("node id 0 is reserved".to_string()),
            (Ok(id), Ok(_)) if voters().contains(&id) => Ok(()),
            (Ok(id), Ok(_)) => {
                tracing::info!(node = id, %addr, asked_by = from, "adding a node to the cluster");
                meta.change_members_blocking(MemberChange::Add { id, addr: addr.to_string() }).map_err(|e| e.to_string())
            }
            _ => Err(format!("bad join request {request:?}: expected 'join <id> <ip:port>'")),
        }
        .map(|()| format!("ok {}", voter_list(&meta.initial_voters()))),
        ["forget", id] => match id.parse::<NodeId>() {
            Ok(id) if id == meta.node_id() => Err(format!("node {id} cannot forget itself: ask another node")),
            Ok(id) if !voters().contains(&id) => Ok("ok".to_string()),
            Ok(id) => {
                tracing::info!(node = id, asked_by = from, "forgetting a node of the cluster");
                meta.change_members_blocking(MemberChange::Remove { id }).map(|()| "ok".to_string()).map_err(|e| e.to_string())
            }
            Err(_) => Err(format!("bad forget request {request:?}: expected 'forget <id>'")),
        },
        ["voters"] => match meta.leader_id() {
            Some(_) => Ok(format!("ok {}", voter_list(&voters()))),
            None => Err("no metadata leader known here".to_string()),
        },
        _ => Err(format!("unknown admin request {request:?}")),
    };
    result.unwrap_or_else(|why| format!("error {why}"))
}

/// Sends `request` as node `me` to each node of `config.peers` but `me` and `skip`, in
/// turn, round after round, until one answers `ok…` (its answer after `ok`) or `limit`
/// passes (every answer seen, joined).
fn ask_peers(config: &Config, me: NodeId, skip: NodeId, request: &str, limit: Duration) -> Result<String, String> {
    let deadline = Instant::now() + limit;
    let mut errors = Vec::new();
    loop {
        for (&id, &addr) in config.peers.iter().filter(|(&id, _)| id != me && id != skip) {
            match admin_request(addr, me, id, request.as_bytes(), REQUEST_TIMEOUT) {
                Ok(reply) => {
                    let reply = String::from_utf8_lossy(&reply).into_owned();
                    if let Some(rest) = reply.strip_prefix("ok") {
                        return Ok(rest.trim().to_string());
                    }
                    errors.push(format!("node {id}: {}", if reply.is_empty() { "not ready" } else { reply.as_str() }));
                }
                Err(e) => errors.push(format!("node {id} at {addr}: {e}")),
            }
        }
        if Instant::now() >= deadline {
            errors.dedup();
            return Err(errors.join("; "));
        }
        std::thread::sleep(RETRY_PAUSE);
        errors.clear();
    }
}

/// A list of voters as the answers carry it: `1,2,3`.
fn voter_list(voters: &[NodeId]) -> String {
    voters.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

/// The node ids of a [`voter_list`] (what does not parse is left out).
fn parse_voter_list(list: &str) -> Vec<NodeId> {
    list.split(',').filter_map(|v| v.trim().parse().ok()).collect()
}

/// The voters the first of `peers` (id, cluster address) that knows a metadata leader names,
/// asked as node `me`; one round, a few seconds per node at most. `None` when none answered.
pub fn voters_named_by_peers(peers: impl IntoIterator<Item = (NodeId, SocketAddr)>, me: NodeId) -> Option<Vec<NodeId>> {
    peers.into_iter().filter(|(id, _)| *id != me).find_map(|(id, addr)| {
        let reply = admin_request(addr, me, id, b"voters", Duration::from_secs(3)).ok()?;
        Some(parse_voter_list(String::from_utf8_lossy(&reply).strip_prefix("ok")?))
    })
}

/// `--join`: asks the other nodes of `--peers` to add this node, until one has (bounded by
/// `limit`); returns the voters the group was formed with.
///
/// # Errors
/// What the nodes answered, when none added it in time.
pub fn join(config: &Config, limit: Duration) -> Result<Vec<NodeId>, String> {
    let me = config.node_id;
    let addr = config.peers[&me];
    tracing::info!(node = me, %addr, "asking the cluster to add this node (--join)");
    let first = ask_peers(config, me, me, &format!("join {me} {addr}"), limit)?;
    let voters = parse_voter_list(&first);
    if voters.is_empty() {
        return Err(format!("a node answered the join without the group's voters: {first:?}"));
    }
    tracing::info!(node = me, first_voters = ?voters, "added to the cluster: catching up");
    Ok(voters)
}

/// `--forget-node ID`: asks the nodes of `--peers` (but `id`) to forget node `id`; the line to
/// print and the exit code.
pub fn forget(config: &Config, id: NodeId) -> (String, i32) {
    match ask_peers(config, 0, id, &format!("forget {id}"), REQUEST_TIMEOUT * 2) {
        Ok(_) => (format!("node {id} is no longer a member of the cluster"), 0),
        Err(why) => (format!("could not forget node {id}: {why}"), 1),
    }
}
