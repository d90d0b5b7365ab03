//! The web UI (static files compiled into the binary, served at `/` of the management
//! port without login: the page logs in to the API itself) and the API behind its live
//! latency view, `GET /api/ringmq/latency[/{vhost}/{queue}]`.
//!
//! The latency answer, for the node (every core's histograms summed) or one queue this node
//! serves: `{"scope", "node", "sample_every", "bucket_upper_bounds_us": [1, 2, 4, …],
//! "stages": {"publish_to_enqueued": {"buckets": [n, …], "count": n, "sum_us": n}, …},
//! "stage_info": [{"name", "side": "broker"|"queue"|"client"|"round_trip", "per_queue",
//! "meaning"}, …]}` (`observe::STAGES`, in the order a message meets them). A queue's answer
//! holds only the stages measured per queue.
//! `buckets[i]` counts the sampled messages whose stage took at most 2^i µs (and more than
//! 2^(i-1) µs; the last bucket also everything longer), since the node started (the node)
//! or the queue opened in this run (a queue). The page plots the percentiles of the
//! difference between two answers, so what it shows is the last interval's latency.

use serde_json::{json, Value};

use super::{Api, ApiError, Reply};
use crate::observe::{Histogram, HistogramCounts, SAMPLE_EVERY, STAGES, STAGE_COUNT};

/// The file at `path` of the UI: (Content-Type, body); `None` for any other path.
pub(crate) fn asset(path: &str) -> Option<(&'static str, &'static str)> {
    match path {
        "/" | "/index.html" => Some(("text/html; charset=utf-8", include_str!("ui/index.html"))),
        "/ui/app.js" => Some(("text/javascript; charset=utf-8", include_str!("ui/app.js"))),
        "/ui/style.css" => Some(("text/css; charset=utf-8", include_str!("ui/style.css"))),
        _ => None,
    }
}

/// The histograms of the stages `queue` picks (a queue: those measured per queue).
fn stages_json(stages: &[HistogramCounts; STAGE_COUNT], queue: bool) -> Value {
    let mut out = serde_json::Map::new();
    for (info, h) in STAGES.iter().zip(stages).filter(|(i, _)| i.per_queue || !queue) {
        let mut buckets = h.buckets.clone();
        buckets.resize(Histogram::BUCKETS, 0);
        out.insert(info.name.to_owned(), json!({"buckets": buckets, "count": h.count, "sum_us": h.sum_ns / 1000}));
    }
    Value::Object(out)
}

/// What each stage of `stages_json` measures.
fn stage_info(queue: bool) -> Value {
    STAGES
        .iter()
        .filter(|i| i.per_queue || !queue)
        .map(|i| json!({"name": i.name, "side": i.side.name(), "per_queue": i.per_queue, "meaning": i.meaning}))
        .collect()
}

impl Api {
    /// `GET /api/ringmq/latency`: the node's stage histograms (every core summed).
    pub(crate) fn latency_node(&self) -> Result<Reply, ApiError> {
        let sum = crate::observe::stage_counts(&self.shared.stats);
        Ok(Reply::ok(self.latency_json(json!({"kind": "node"}), &sum, false)))
    }

    /// `GET /api/ringmq/latency/{vhost}/{queue}`: one queue's stage histograms, from the core
    /// that serves it on this node. 404 for an unknown queue; a queue another node serves
    /// has no figures here (`"stages": {}` with `"served_by"`: ask that node).
    pub(crate) fn latency_queue(&self, vhost: &str, name: &str) -> Result<Reply, ApiError> {
        let topo = self.shared.meta.topology();
        let def = topo.queues.values().find(|q| q.vhost == vhost && q.name == name).ok_or_else(ApiError::not_found)?;
        let scope = json!({"kind": "queue", "vhost": vhost, "name": name});
        if def.owner_node != self.shared.meta.node_id() {
            let mut v = self.latency_json(scope, &Default::default(), true);
            v["stages"] = json!({});
            v["served_by"] = json!(self.node_name(def.owner_node));
            return Ok(Reply::ok(v));
        }
        let figures = self.figures(&[def], false);
        let info = figures.first().and_then(|f| f.info.as_ref()).ok_or_else(|| ApiError::unavailable("the queue did not answer"))?;
        Ok(Reply::ok(self.latency_json(scope, &info.stages, true)))
    }

    fn latency_json(&self, scope: Value, stages: &[HistogramCounts; STAGE_COUNT], queue: bool) -> Value {
        json!({
            "scope": scope,
            "node": self.node_name(self.shared.meta.node_id()),
            "sample_every": SAMPLE_EVERY,
            "bucket_upper_bounds_us": (0..Histogram::BUCKETS).map(|i| 1u64 << i).collect::<Vec<_>>(),
            "stages": stages_json(stages, queue),
            "stage_info": stage_info(queue),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ui_files_are_served_and_nothing_else() {
        let (ct, body) = asset("/").expect("index");
        assert!(ct.starts_with("text/html") && body.contains("/ui/app.js"));
        assert!(asset("/ui/app.js").is_some_and(|(_, b)| b.contains("/ringmq/latency")));
        assert!(asset("/ui/style.css").is_some());
        assert!(asset("/ui/../Cargo.toml").is_none() && asset("/etc/passwd").is_none());
    }

    #[test]
    fn stages_have_every_bucket_and_microsecond_sums() {
        let h = Histogram::default();
        h.record(std::time::Duration::from_micros(3));
        let v = stages_json(&std::array::from_fn(|i| if i == 0 { h.counts() } else { HistogramCounts::default() }), false);
        let b = v["publish_to_enqueued"]["buckets"].as_array().unwrap();
        assert_eq!(b.len(), Histogram::BUCKETS);
        assert_eq!(b[2], json!(1), "3 µs is in the ≤ 4 µs bucket");
        assert_eq!(v["publish_to_enqueued"]["sum_us"], json!(3));
        assert_eq!(v["written_to_acked"]["buckets"].as_array().unwrap().len(), Histogram::BUCKETS);
    }

    #[test]
    fn a_queue_answers_only_the_stages_it_measures_each_with_its_meaning() {
        let v = stages_json(&Default::default(), true);
        let info = stage_info(true);
        let names: Vec<&str> = info.as_array().unwrap().iter().map(|i| i["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["publish_to_enqueued", "publish_to_stored", "enqueued_to_taken", "taken_to_acked"]);
        assert_eq!(v.as_object().unwrap().len(), names.len());
        let node = stage_info(false);
        let client: Vec<&Value> = node.as_array().unwrap().iter().filter(|i| i["side"] == "client").collect();
        assert_eq!(client.len(), 1, "{node}");
        assert_eq!(client[0]["name"], "written_to_acked");
        assert!(node.as_array().unwrap().iter().all(|i| i["meaning"].as_str().is_some_and(|m| m.len() > 40)), "{node}");
    }
}
