// ringmq's management UI: plain JavaScript over the management API (the same JSON that
// rabbitmqadmin and ringmqctl read). Pages by URL fragment: #/overview, #/queues,
// #/queues/<vhost>/<name> (RabbitMQ's form; #/queue/… too), #/exchanges,
// #/exchanges/<vhost>/<name>, #/connections, #/connections/<name>, #/channels, #/latency.
// Credentials: a login form (kept in sessionStorage), or a #/login/<user>/<password> link
// as RabbitMQ's UI takes (optionally followed by the page to open, e.g. /queues).
"use strict";

const POLL_MS = 5000;        // tables and totals
const LATENCY_MS = 2000;     // the live latency view
const HISTORY = 150;         // points kept per plotted series (5 min at 2 s)
// Whose time a stage is (the API's stage_info "side"), as the latency view groups them.
const SIDES = [
  ["broker", "Broker", "the broker's own work"],
  ["queue", "Waiting in the queue", "set by the consumers' capacity, not the broker's speed"],
  ["client", "Client", "the consumer's processing and the network"],
  ["round_trip", "Round trip", "broker and client together, as the queue sees it"],
];
const QUANTILES = [[0.5, "p50", "--s1"], [0.9, "p90", "--s2"], [0.99, "p99", "--s3"], [0.999, "p99.9", "--s4"]];

let auth = sessionStorage.getItem("ringmq-auth");
let timer = null;
let page = null;          // the current page's refresh function
const rateHistory = [];   // overview: [{t, publish, deliver, ack}]
let latencyState = null;  // latency page: {key, last, series}

const $ = (sel) => document.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const seg = (s) => encodeURIComponent(s);
const num = (n) => (n === undefined || n === null ? "" : Number(n).toLocaleString("en-US"));
const rate = (o, k) => { const d = o && o.message_stats && o.message_stats[k + "_details"]; return d ? d.rate.toFixed(1) : "0.0"; };

async function api(path, opts = {}) {
  const headers = Object.assign({ "Authorization": "Basic " + auth, "X-Requested-With": "XMLHttpRequest" }, opts.body ? { "Content-Type": "application/json" } : {}, opts.headers || {});
  const r = await fetch("/api" + path, Object.assign({}, opts, { headers }));
  if (r.status === 401) { showLogin("Login failed"); throw new Error("401"); }
  const text = await r.text();
  const body = text ? JSON.parse(text) : null;
  if (!r.ok) throw new Error((body && (body.reason || body.error)) || r.status);
  return body;
}

function showLogin(msg) {
  clearInterval(timer);
  sessionStorage.removeItem("ringmq-auth");
  auth = null;
  $("#main").hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = msg || "";
}

$("#login").addEventListener("submit", async (e) => {
  e.preventDefault();
  const f = new FormData(e.target);
  if (await login(f.get("user"), f.get("password"))) navigate();
});

async function login(user, password) {
  auth = btoa(unescape(encodeURIComponent(user + ":" + password)));
  try {
    const me = await api("/whoami");
    sessionStorage.setItem("ringmq-auth", auth);
    $("#login").hidden = true;
    $("#main").hidden = false;
    $("#who").innerHTML = esc(me.name) + ' <button id="logout">Log out</button>';
    $("#logout").onclick = () => { showLogin(""); location.hash = "#/overview"; };
    return true;
  } catch (e) {
    if (e.message !== "401") showLogin(String(e.message));
    return false;
  }
}

function table(cols, rows) {
  const head = cols.map((c) => `<th class="${c.num ? "num" : ""}">${esc(c.h)}</th>`).join("");
  const body = rows.length
    ? rows.map((r) => "<tr>" + cols.map((c) => `<td class="${c.num ? "num" : ""}">${c.html ? c.v(r) : esc(c.v(r))}</td>`).join("") + "</tr>").join("")
    : `<tr><td colspan="${cols.length}" class="muted">none</td></tr>`;
  return `<table><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
}

function cards(items) {
  return '<div class="cards">' + items.map(([l, n]) => `<div class="card"><div class="n">${esc(n)}</div><div class="l">${esc(l)}</div></div>`).join("") + "</div>";
}

// The canvas sized to its box at the screen's pixel ratio and cleared: its context and size.
function clearCanvas(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  return { g, w, h };
}

// A line chart on a canvas: series = [{name, color, points: [[t, v], ...]}]; log = log10 y.
function lineChart(canvas, series, opts = {}) {
  const { g, w, h } = clearCanvas(canvas);
  const pad = { l: 58, r: 8, t: 8, b: 18 };
  const all = series.flatMap((s) => s.points);
  g.strokeStyle = "#dde1e7"; g.fillStyle = "#6b7380"; g.font = "11px system-ui";
  if (!all.length) { g.fillText("no samples yet", pad.l, h / 2); return; }
  const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]), t0 + 1);
  const f = opts.log ? (v) => Math.log10(Math.max(v, 1e-7)) : (v) => v;
  let y0 = Math.min(...all.map((p) => f(p[1]))), y1 = Math.max(...all.map((p) => f(p[1])));
  if (opts.log) { y0 = Math.floor(y0); y1 = Math.ceil(y1); } else { y0 = 0; y1 = y1 > 0 ? y1 * 1.1 : 1; }
  if (y1 <= y0) y1 = y0 + 1;
  const X = (t) => pad.l + ((t - t0) / (t1 - t0)) * (w - pad.l - pad.r);
  const Y = (v) => h - pad.b - ((f(v) - y0) / (y1 - y0)) * (h - pad.t - pad.b);
  const ticks = opts.log ? Array.from({ length: y1 - y0 + 1 }, (_, i) => Math.pow(10, y0 + i)) : [0, 0.25, 0.5, 0.75, 1].map((k) => k * y1);
  for (const v of ticks) {
    const y = opts.log ? h - pad.b - ((Math.log10(v) - y0) / (y1 - y0)) * (h - pad.t - pad.b) : Y(v);
    g.beginPath(); g.moveTo(pad.l, y); g.lineTo(w - pad.r, y); g.stroke();
    g.fillText(opts.fmt ? opts.fmt(v) : v.toFixed(0), 4, y + 4);
  }
  g.fillText(new Date(t1).toLocaleTimeString(), w - pad.r - 60, h - 4);
  for (const s of series) {
    g.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue(s.color) || s.color;
    g.lineWidth = 1.6; g.beginPath();
    s.points.forEach(([t, v], i) => (i ? g.lineTo(X(t), Y(v)) : g.moveTo(X(t), Y(v))));
    g.stroke();
  }
}

// Bars of a latency histogram: counts per power-of-two bucket (upper bound 2^i µs).
function barChart(canvas, counts) {
  const { g, w, h } = clearCanvas(canvas);
  g.font = "11px system-ui"; g.fillStyle = "#6b7380";
  const first = counts.findIndex((c) => c > 0);
  if (first < 0) { g.fillText("no samples yet", 10, h / 2); return; }
  let last = counts.length - 1;
  while (last > first && counts[last] === 0) last--;
  const lo = Math.max(0, first - 1), hi = Math.min(counts.length - 1, last + 1);
  const n = hi - lo + 1, max = Math.max(...counts), bw = (w - 10) / n;
  for (let i = lo; i <= hi; i++) {
    const bh = (counts[i] / max) * (h - 30);
    g.fillStyle = "#2563eb";
    g.fillRect(5 + (i - lo) * bw + 1, h - 18 - bh, bw - 2, bh);
    if ((i - lo) % Math.ceil(n / 8) === 0) { g.fillStyle = "#6b7380"; g.fillText("≤" + fmtUs(Math.pow(2, i)), 5 + (i - lo) * bw, h - 4); }
  }
}

function fmtUs(us) {
  if (us >= 1e6) return (us / 1e6).toFixed(us >= 1e7 ? 0 : 1) + " s";
  if (us >= 1e3) return (us / 1e3).toFixed(us >= 1e4 ? 0 : 1) + " ms";
  return us.toFixed(0) + " µs";
}

// The q-quantile of a bucket histogram (bucket i holds samples ≤ 2^i µs), interpolated
// linearly inside its bucket; null without samples.
function quantile(counts, q) {
  const total = counts.reduce((a, b) => a + b, 0);
  if (!total) return null;
  let want = q * total, seen = 0;
  for (let i = 0; i < counts.length; i++) {
    if (seen + counts[i] >= want && counts[i] > 0) {
      const lo = i ? Math.pow(2, i - 1) : 0, hi = Math.pow(2, i);
      return lo + ((want - seen) / counts[i]) * (hi - lo);
    }
    seen += counts[i];
  }
  return Math.pow(2, counts.length - 1);
}

// ---------- pages ----------

async function overview() {
  const [o, nodes] = await Promise.all([api("/overview"), api("/nodes")]);
  const t = o.object_totals || {}, qt = o.queue_totals || {};
  rateHistory.push({ t: Date.now(), publish: +rate(o, "publish"), deliver: +rate(o, "deliver_get"), ack: +rate(o, "ack") });
  while (rateHistory.length > HISTORY) rateHistory.shift();
  $("#main").innerHTML = `<h1>Overview <span class="muted">${esc(o.node)} · ${esc(o.product_name || "ringmq")} ${esc(o.product_version || "")}</span></h1>`
    + cards([["Connections", num(t.connections)], ["Channels", num(t.channels)], ["Queues", num(t.queues)], ["Consumers", num(t.consumers)],
      ["Ready", num(qt.messages_ready)], ["Unacked", num(qt.messages_unacknowledged)], ["Publish /s", rate(o, "publish")], ["Deliver /s", rate(o, "deliver_get")], ["Ack /s", rate(o, "ack")]])
    + `<h2>Message rates</h2><div class="chart"><div class="legend"><span><i style="background:var(--s1)"></i>publish</span><span><i style="background:var(--s2)"></i>deliver</span><span><i style="background:var(--s3)"></i>ack</span></div><canvas id="rates"></canvas></div>`
    + `<h2>Nodes</h2>` + table([
      { h: "Name", v: (n) => n.name }, { h: "Running", html: true, v: (n) => n.running ? '<span class="pill ok">running</span>' : '<span class="pill bad">down</span>' },
      { h: "File descriptors", num: true, v: (n) => n.fd_used !== undefined ? `${num(n.fd_used)} / ${num(n.fd_total)}` : "" },
      { h: "Disk free", num: true, v: (n) => n.disk_free !== undefined ? `${(n.disk_free / 1e9).toFixed(1)} GB` : "" },
      { h: "Alarms", html: true, v: (n) => (n.disk_free_alarm || n.mem_alarm) ? '<span class="pill bad">alarm</span>' : '<span class="pill ok">none</span>' },
      { h: "Uptime", num: true, v: (n) => n.uptime !== undefined ? `${Math.round(n.uptime / 60000)} min` : "" },
    ], nodes);
  const pts = (k) => rateHistory.map((p) => [p.t, p[k]]);
  lineChart($("#rates"), [{ color: "--s1", points: pts("publish") }, { color: "--s2", points: pts("deliver") }, { color: "--s3", points: pts("ack") }], { fmt: (v) => v.toFixed(0) + "/s" });
}

async function queues() {
  const qs = await api("/queues");
  $("#main").innerHTML = `<h1>Queues <span class="muted">${qs.length}</span></h1>` + table([
    { h: "Vhost", v: (q) => q.vhost },
    { h: "Name", html: true, v: (q) => `<a href="#/queues/${seg(q.vhost)}/${seg(q.name)}">${esc(q.name)}</a>` },
    { h: "Type", v: (q) => q.type }, { h: "State", v: (q) => q.state },
    { h: "Ready", num: true, v: (q) => num(q.messages_ready) }, { h: "Unacked", num: true, v: (q) => num(q.messages_unacknowledged) },
    { h: "Total", num: true, v: (q) => num(q.messages) }, { h: "Consumers", num: true, v: (q) => num(q.consumers) },
    { h: "Publish /s", num: true, v: (q) => rate(q, "publish") }, { h: "Deliver /s", num: true, v: (q) => rate(q, "deliver_get") }, { h: "Ack /s", num: true, v: (q) => rate(q, "ack") },
    { h: "", html: true, v: (q) => `<button data-purge="${esc(q.vhost)}|${esc(q.name)}">Purge</button> <button class="danger" data-delete="${esc(q.vhost)}|${esc(q.name)}">Delete</button>` },
  ], qs);
  document.querySelectorAll("[data-purge]").forEach((b) => (b.onclick = () => act(b.dataset.purge, "Purge", (v, n) => api(`/queues/${seg(v)}/${seg(n)}/contents`, { method: "DELETE" }))));
  document.querySelectorAll("[data-delete]").forEach((b) => (b.onclick = () => act(b.dataset.delete, "Delete", (v, n) => api(`/queues/${seg(v)}/${seg(n)}`, { method: "DELETE" }))));
}

async function act(key, what, f) {
  const [v, n] = key.split("|");
  if (!confirm(`${what} queue '${n}' in vhost '${v}'?`)) return;
  try { await f(v, n); } catch (e) { alert(`${what} failed: ${e.message}`); }
  refresh();
}

const kv = (pairs) => '<dl class="kv">' + pairs.map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("") + "</dl>";
const connLink = (name, label) => name ? `<a href="#/connections/${seg(name)}">${esc(label || name)}</a>` : "";

async function queueDetail(vhost, name) {
  const [q, unacked] = await Promise.all([api(`/queues/${seg(vhost)}/${seg(name)}`), api(`/queues/${seg(vhost)}/${seg(name)}/unacked`).catch(() => [])]);
  const quorum = q.type === "quorum" ? [["leader", q.leader], ["members", (q.members || []).join(", ")], ["online", (q.online || []).join(", ")]] : [];
  $("#main").innerHTML = `<h1>Queue ${esc(name)} <span class="muted">vhost ${esc(vhost)}</span></h1>`
    + cards([["Ready", num(q.messages_ready)], ["Unacked", num(q.messages_unacknowledged)], ["Consumers", num(q.consumers)], ["Publish /s", rate(q, "publish")], ["Deliver /s", rate(q, "deliver_get")], ["Ack /s", rate(q, "ack")]])
    + "<h2>Properties</h2>" + kv([["type", q.type], ["state", q.state], ["durable", q.durable], ["auto_delete", q.auto_delete], ["exclusive", q.exclusive], ["node", q.node]].concat(quorum,
      [["arguments", JSON.stringify(q.arguments || {})], ["policy", q.policy || ""], ["operator policy", q.operator_policy || ""], ["effective policy definition", JSON.stringify(q.effective_policy_definition || {})]]))
    + "<h2>Consumers</h2>" + table([{ h: "Tag", v: (c) => c.consumer_tag },
      { h: "Connection", html: true, v: (c) => { const d = c.channel_details || {}; return connLink(d.connection_name, d.user_provided_name || d.connection_name); } },
      { h: "Channel", v: (c) => (c.channel_details || {}).number }, { h: "Ack", v: (c) => c.ack_required }, { h: "Exclusive", v: (c) => c.exclusive },
      { h: "Prefetch", num: true, v: (c) => c.prefetch_count }, { h: "Arguments", v: (c) => JSON.stringify(c.arguments || {}) }], q.consumer_details || [])
    + `<h2>Unacknowledged deliveries <span class="muted">${unacked.length}</span></h2>` + table(Object.keys(unacked[0] || { delivery_tag: 0 }).map((k) => ({ h: k, v: (r) => typeof r[k] === "object" ? JSON.stringify(r[k]) : r[k] })), unacked.slice(0, 200))
    + `<h2>Latency</h2><p><a href="#/latency/${seg(vhost)}/${seg(name)}">Live latency of this queue →</a></p>`;
}

async function exchanges() {
  const [xs, bs] = await Promise.all([api("/exchanges"), api("/bindings")]);
  $("#main").innerHTML = `<h1>Exchanges <span class="muted">${xs.length}</span></h1>` + table([
    { h: "Vhost", v: (x) => x.vhost }, { h: "Name", html: true, v: (x) => `<a href="#/exchanges/${seg(x.vhost)}/${seg(x.name || "amq.default")}">${esc(x.name || "(AMQP default)")}</a>` }, { h: "Type", v: (x) => x.type },
    { h: "Durable", v: (x) => x.durable }, { h: "Auto-delete", v: (x) => x.auto_delete }, { h: "Arguments", v: (x) => JSON.stringify(x.arguments || {}) },
  ], xs) + `<h2>Bindings <span class="muted">${bs.length}</span></h2>` + table([
    { h: "Vhost", v: (b) => b.vhost }, { h: "Source", v: (b) => b.source || "(AMQP default)" }, { h: "Destination", v: (b) => `${b.destination_type} ${b.destination}` },
    { h: "Routing key", v: (b) => b.routing_key }, { h: "Arguments", v: (b) => JSON.stringify(b.arguments || {}) },
  ], bs);
}

async function exchangeDetail(vhost, name) {
  const path = `/exchanges/${seg(vhost)}/${seg(name)}`;
  const [x, bs] = await Promise.all([api(path), api(path + "/bindings/source")]);
  $("#main").innerHTML = `<h1>Exchange ${esc(x.name || "(AMQP default)")} <span class="muted">vhost ${esc(vhost)}</span></h1>`
    + "<h2>Properties</h2>" + kv([["type", x.type], ["durable", x.durable], ["auto_delete", x.auto_delete], ["internal", x.internal], ["arguments", JSON.stringify(x.arguments || {})], ["policy", x.policy || ""]])
    + `<h2>Bindings from it <span class="muted">${bs.length}</span></h2>` + table([
      { h: "Destination", html: true, v: (b) => b.destination_type === "queue" ? `queue <a href="#/queues/${seg(b.vhost)}/${seg(b.destination)}">${esc(b.destination)}</a>` : `exchange ${esc(b.destination)}` },
      { h: "Routing key", v: (b) => b.routing_key }, { h: "Arguments", v: (b) => JSON.stringify(b.arguments || {}) }], bs);
}

async function connectionDetail(name) {
  const [c, chans] = await Promise.all([api(`/connections/${seg(name)}`), api("/channels")]);
  const p = c.client_properties || {};
  $("#main").innerHTML = `<h1>Connection ${esc(c.user_provided_name || c.name)} <span class="muted">${esc(c.name)}</span></h1>`
    + "<h2>Properties</h2>" + kv([["user", c.user], ["vhost", c.vhost], ["state", c.state], ["node", c.node], ["client", [p.product, p.version].filter(Boolean).join(" ")], ["platform", p.platform || ""],
      ["heartbeat (s)", c.timeout], ["frame_max", c.frame_max], ["channel_max", c.channel_max], ["connected at", new Date(c.connected_at).toLocaleString()]])
    + "<h2>Client properties</h2><pre>" + esc(JSON.stringify(p, null, 2)) + "</pre>"
    + "<h2>Channels</h2>" + table([{ h: "Channel", v: (ch) => ch.number }, { h: "Mode", v: (ch) => ch.confirm ? "confirm" : (ch.transactional ? "tx" : "") },
      { h: "Consumers", num: true, v: (ch) => ch.consumer_count }, { h: "Prefetch", num: true, v: (ch) => ch.prefetch_count }, { h: "Unacked", num: true, v: (ch) => ch.messages_unacknowledged }],
      chans.filter((ch) => (ch.connection_details || {}).name === c.name));
}

async function connections() {
  const cs = await api("/connections");
  $("#main").innerHTML = `<h1>Connections <span class="muted">${cs.length}</span></h1>` + table([
    { h: "Name", html: true, v: (c) => connLink(c.name) + (c.user_provided_name ? ` <span class="muted">${esc(c.user_provided_name)}</span>` : "") }, { h: "User", v: (c) => c.user }, { h: "Vhost", v: (c) => c.vhost }, { h: "State", v: (c) => c.state },
    { h: "Channels", num: true, v: (c) => c.channels }, { h: "Client", v: (c) => { const p = c.client_properties || {}; return [p.product, p.version].filter(Boolean).join(" "); } },
    { h: "", html: true, v: (c) => `<button class="danger" data-close="${esc(c.name)}">Close</button>` },
  ], cs);
  document.querySelectorAll("[data-close]").forEach((b) => (b.onclick = async () => {
    if (!confirm(`Close connection ${b.dataset.close}?`)) return;
    try { await api(`/connections/${seg(b.dataset.close)}`, { method: "DELETE", headers: { "X-Reason": "closed from the management UI" } }); } catch (e) { alert(e.message); }
    refresh();
  }));
}

async function channels() {
  const cs = await api("/channels");
  $("#main").innerHTML = `<h1>Channels <span class="muted">${cs.length}</span></h1>` + table([
    { h: "Name", v: (c) => c.name }, { h: "User", v: (c) => c.user }, { h: "Mode", v: (c) => c.confirm ? "confirm" : (c.transactional ? "tx" : "") },
    { h: "Consumers", num: true, v: (c) => c.consumer_count }, { h: "Prefetch", num: true, v: (c) => c.prefetch_count }, { h: "Unacked", num: true, v: (c) => c.messages_unacknowledged },
  ], cs);
}

// The live latency view: every LATENCY_MS, the per-stage histograms of the node (or one
// queue); percentiles of what arrived since the previous poll are plotted over time, and the
// histogram of the last interval drawn beside them. The stages, their meaning and whose time
// they are come from the API (stage_info), grouped by side: broker, queue wait, client.
async function latency(vhost, name) {
  const key = vhost === undefined ? "node" : vhost + "|" + name;
  const path = vhost === undefined ? "/ringmq/latency" : `/ringmq/latency/${seg(vhost)}/${seg(name)}`;
  const [data, qs] = await Promise.all([api(path), api("/queues").catch(() => [])]);
  const stages = data.stages || {};
  const info = (data.stage_info || []).filter((i) => stages[i.name]);
  const names = info.map((i) => i.name);
  if (!latencyState || latencyState.key !== key) {
    latencyState = { key, last: null, series: {} };
    const opts = ['<option value="">the node (every queue)</option>'].concat(qs.map((q) => {
      const v = `${q.vhost}|${q.name}`;
      return `<option value="${esc(v)}" ${v === key ? "selected" : ""}>${esc(q.vhost)} / ${esc(q.name)}</option>`;
    }));
    const every = data.sample_every || 16;
    const chart = (i) => `<div class="chart" id="stage-${i.name}"><h3>${esc(i.name.replace(/_to_/, " → ").replace(/_/g, " "))} <span class="muted" id="sum-${i.name}"></span></h3>`
      + `<p class="muted meaning">${esc(i.meaning)}</p>`
      + '<div class="legend">' + QUANTILES.map(([, l, c]) => `<span><i style="background:var(${c})"></i>${l}</span>`).join("") + "</div>"
      + `<canvas id="line-${i.name}"></canvas><canvas id="bars-${i.name}" style="height:110px"></canvas></div>`;
    const groups = SIDES.map(([side, title, what]) => {
      const mine = info.filter((i) => i.side === side);
      return mine.length ? `<h2 class="side" id="side-${side}">${title} <span class="muted">${what}</span></h2><div class="charts">${mine.map(chart).join("")}</div>` : "";
    }).join("");
    const queueNote = vhost === undefined ? ""
      : '<p class="muted">publish → confirmed, taken → written and written → acked are measured by connections, for every queue at once: see the node view.</p>';
    $("#main").innerHTML = `<h1>Latency <span class="muted">${vhost === undefined ? "node" : esc(vhost) + " / " + esc(name)}</span></h1>`
      + `<p>Scope <select id="scope">${opts.join("")}</select> <span class="muted">percentiles of the last ${LATENCY_MS / 1000} s; updated live</span></p>`
      + `<p class="muted">Sampled: one published message in ${every} per core for the publish stages, one delivery in ${every} per core for the delivery stages; `
      + "counts are of samples. The stages are not one pipeline: after basic.publish, enqueued, stored and confirmed run side by side, and a consumer may get a message before it is stored.</p>"
      + queueNote + groups;
    $("#scope").onchange = (e) => {
      const v = e.target.value;
      location.hash = v ? "#/latency/" + v.split("|").map(seg).join("/") : "#/latency";
    };
  }
  const now = Date.now();
  for (const s of names) {
    if (!$("#line-" + s)) continue;
    const cur = (stages[s] && stages[s].buckets) || [];
    const prev = latencyState.last && latencyState.last[s] ? latencyState.last[s] : null;
    const delta = prev ? cur.map((c, i) => Math.max(0, c - (prev[i] || 0))) : cur;
    const series = (latencyState.series[s] = latencyState.series[s] || QUANTILES.map(() => []));
    if (prev) {
      QUANTILES.forEach(([q], i) => {
        const v = quantile(delta, q);
        if (v !== null) series[i].push([now, v]);
        while (series[i].length > HISTORY) series[i].shift();
      });
    }
    const total = delta.reduce((a, b) => a + b, 0);
    const p99 = quantile(delta, 0.99);
    $("#sum-" + s).textContent = total ? `${num(total)} samples, p99 ${fmtUs(p99)}` : (prev ? "no samples in the last interval" : "");
    lineChart($("#line-" + s), QUANTILES.map(([, l, c], i) => ({ name: l, color: c, points: series[i] })), { log: true, fmt: (v) => fmtUs(v) });
    barChart($("#bars-" + s), delta);
  }
  latencyState.last = Object.fromEntries(names.map((s) => [s, ((stages[s] && stages[s].buckets) || []).slice()]));
}

// ---------- routing ----------

function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  if (parts[0] === "login" && parts.length >= 2) {
    // #/login/<user>/<password>[/<page>…]: RabbitMQ's login link, then that page.
    return { login: [parts[1], parts[2] || ""], next: parts.slice(3) };
  }
  const name = parts[0] || "overview";
  document.querySelectorAll("#nav a").forEach((a) => a.classList.toggle("active", a.dataset.page === name || (name === "queue" && a.dataset.page === "queues")));
  // An object's page: RabbitMQ's #/queues/<vhost>/<name>, #/exchanges/<vhost>/<name>,
  // #/connections/<name> (and ringmq's older #/queue/<vhost>/<name>).
  const one = parts.length >= 3 ? [parts[1], parts.slice(2).join("/")] : null;
  switch (name) {
    case "queues": return one ? { f: () => queueDetail(...one), every: POLL_MS } : { f: queues, every: POLL_MS };
    case "queue": return { f: () => queueDetail(parts[1], parts.slice(2).join("/")), every: POLL_MS };
    case "exchanges": return one ? { f: () => exchangeDetail(...one), every: POLL_MS } : { f: exchanges, every: POLL_MS };
    case "connections": return parts.length >= 2 && parts[1] ? { f: () => connectionDetail(parts.slice(1).join("/")), every: POLL_MS } : { f: connections, every: POLL_MS };
    case "channels": return { f: channels, every: POLL_MS };
    case "latency": return parts.length >= 3 ? { f: () => latency(parts[1], parts.slice(2).join("/")), every: LATENCY_MS } : { f: () => latency(), every: LATENCY_MS };
    default: return { f: overview, every: POLL_MS };
  }
}

async function refresh() {
  if (!page || !auth) return;
  try {
    await page();
    $("#status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    if (e.message !== "401") $("#status").textContent = "error: " + e.message;
  }
}

async function navigate() {
  clearInterval(timer);
  const r = route();
  if (r.login) {
    if (await login(r.login[0], r.login[1])) location.replace("#/" + (r.next.length ? r.next.map(seg).join("/") : "overview"));
    return;
  }
  if (!auth) { showLogin(""); page = r.f; return; }
  if (!$("#who").textContent && !(await login(...atob(auth).split(/:(.*)/s).slice(0, 2)))) return;
  page = r.f;
  await refresh();
  timer = setInterval(refresh, r.every);
}

window.addEventListener("hashchange", navigate);
navigate();
