// The live cluster page: polls the gateway's JSON and redraws. No framework, no build step;
// the charts are charts.js over the vendored uPlot.
// Data from the server only ever reaches the page through textContent, never as markup.
"use strict";

const KEY_STORE = "orchard-api-key";
const params = new URLSearchParams(location.search);
const EVERY_MS = Math.max(250, Number(params.get("every")) || 1000);

class NeedsKey extends Error {}

let updates = 0;

// A key given once as ?key=... moves into this tab's sessionStorage and out of the address bar.
function takeKeyFromUrl() {
  const key = params.get("key");
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  params.delete("key");
  const rest = params.toString();
  history.replaceState(null, "", location.pathname + (rest ? "?" + rest : ""));
}

async function getJson(path) {
  const key = sessionStorage.getItem(KEY_STORE);
  const headers = key ? { Authorization: "Bearer " + key } : {};
  const resp = await fetch(path, { headers, cache: "no-store" });
  if (resp.status === 401) throw new NeedsKey("this server needs an API key");
  if (!resp.ok) {
    let message = resp.statusText;
    try { message = (await resp.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(`${resp.status}: ${message}`);
  }
  return resp.json();
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function setText(id, text) { document.getElementById(id).textContent = text; }

const pct = (x) => (100 * x).toFixed(1) + " %";
const num = (x) => (x === null || x === undefined ? "–" : Number(x).toLocaleString("en-US"));
const rate = (x) => (x ? Number(x).toFixed(1) : "–");

function gib(bytes) {
  return bytes ? (bytes / 2 ** 30).toFixed(1) + " GiB" : "–";
}

function kvCell(used, total) {
  const td = el("td");
  td.append(el("div", `${num(used)} / ${num(total)}`));
  const bar = el("div", null, "bar");
  const fill = el("div");
  fill.style.width = total ? `${Math.min(100, (100 * used) / total)}%` : "0";
  bar.append(fill);
  td.append(bar);
  return td;
}

function nodeRow(node, clusterModel) {
  const tr = el("tr");
  tr.dataset.node = node.node;
  const state = node.status || "alive";
  const memory = node.memory_bytes || node.memory_total_bytes;
  const cells = [
    el("td", node.node), el("td", node.hostname || "–"), el("td", node.chip || node.device || "–"),
    el("td", gib(memory)), el("td", node.model || clusterModel), el("td", state, "state-" + state),
  ];
  cells.forEach((c) => tr.append(c));
  tr.append(kvCell(node.kv_blocks_used, node.kv_blocks_total));
  tr.append(el("td", pct(node.prefix_cache_hit_rate || 0)));
  tr.append(el("td", `${num(node.running)} / ${num(node.waiting)}`));
  const requests = el("td", num(node.requests_total));
  requests.className = "requests";
  tr.append(requests);
  tr.append(el("td", rate(node.decode_tokens_per_s)));
  return tr;
}

function renderCluster(info) {
  setText("model", info.model || "");
  const alive = info.nodes.filter((n) => (n.status || "alive") === "alive").length;
  setText("sum-nodes", `${alive} / ${info.nodes.length}`);
  const used = info.kv_blocks_used, total = info.kv_blocks_total;
  setText("sum-kv", total ? `${num(used)} / ${num(total)} (${pct(used / total)})` : "–");
  document.getElementById("sum-kv-bar").style.width = total ? `${(100 * used) / total}%` : "0";
  setText("sum-hit", pct(info.prefix_cache_hit_rate || 0));
  setText("sum-queue", num(info.queue_depth));
  setText("policy", info.coordinator ? `(policy: ${info.coordinator.policy})` : "");
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren(...info.nodes.map((n) => nodeRow(n, info.model)));
}

function decisionRow(d) {
  const tr = el("tr");
  const when = d.decided_at ? new Date(d.decided_at * 1000).toLocaleTimeString("en-GB") : "–";
  const reason = el("span", d.reason, "reason reason-" + d.reason);
  const migration = d.migration ? `${num(d.migration.num_blocks)} blocks from ${d.migration.source}` : "–";
  [el("td", when), el("td", d.request_id || "–"), el("td", d.node_id)].forEach((c) => tr.append(c));
  const reasonCell = el("td");
  reasonCell.append(reason);
  tr.append(reasonCell);
  [el("td", num(d.cached_blocks)), el("td", migration), el("td", num(d.num_candidates))].forEach((c) => tr.append(c));
  return tr;
}

function renderActivity(activity) {
  setText("sum-requests", num(activity.completed_requests));
  const newestFirst = [...activity.decisions].reverse();
  document.querySelector("#decisions tbody").replaceChildren(...newestFirst.map(decisionRow));
  document.getElementById("no-decisions").hidden = activity.decisions.length > 0;
}

function prefixRow(route) {
  const tr = el("tr");
  tr.dataset.prefix = route.prefix;
  const served = Object.entries(route.served).sort((a, b) => b[1] - a[1]).map(([node, n]) => `${node} × ${n}`).join(", ");
  const when = new Date(route.last_at * 1000).toLocaleTimeString("en-GB");
  [el("td", route.prefix, "prefix"), el("td", served, "served"), el("td", route.last_node)].forEach((c) => tr.append(c));
  const reasonCell = el("td");
  reasonCell.append(el("span", route.last_reason, "reason reason-" + route.last_reason));
  tr.append(reasonCell);
  [el("td", num(route.cached_blocks)), el("td", when)].forEach((c) => tr.append(c));
  return tr;
}

function renderHistory(history) {
  renderCharts(history);
  const throughput = latestThroughput(history);
  setText("sum-throughput", throughput === null ? "–" : `${throughput.toFixed(1)} tok/s`);
  document.querySelector("#prefixes tbody").replaceChildren(...history.prefixes.map(prefixRow));
  document.getElementById("no-prefixes").hidden = history.prefixes.length > 0;
}

function showState(state, message) {
  document.body.dataset.state = state;
  setText("status", message);
  document.getElementById("key-form").hidden = state !== "needs-key";
  document.getElementById("forget-key").hidden = !sessionStorage.getItem(KEY_STORE);
}

async function refresh() {
  try {
    const [info, activity, history] = await Promise.all(
      [getJson("v1/cluster"), getJson("v1/cluster/activity"), getJson("v1/cluster/history")]);
    renderCluster(info);
    renderActivity(activity);
    renderHistory(history);
    updates += 1;
    document.body.dataset.updates = String(updates);
    showState("live", "live · updated " + new Date().toLocaleTimeString("en-GB"));
  } catch (err) {
    if (err instanceof NeedsKey) showState("needs-key", "API key needed");
    else showState("error", "cannot read the cluster: " + err.message);
  }
}

async function loop() {
  await refresh();
  setTimeout(loop, EVERY_MS);
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = document.getElementById("key-input").value.trim();
  if (key) sessionStorage.setItem(KEY_STORE, key);
  refresh();
});

document.getElementById("forget-key").addEventListener("click", (event) => {
  event.preventDefault();
  sessionStorage.removeItem(KEY_STORE);
  refresh();
});

takeKeyFromUrl();
loop();
