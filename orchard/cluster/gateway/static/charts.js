// The dashboard's charts: the last minutes from /v1/cluster/history, drawn with uPlot
// (vendored as uPlot.iife.min.js, MIT; see VENDORED.md). Loaded before dashboard.js.
"use strict";

const PALETTE = ["#2f7d4a", "#2a6fdb", "#b5561b", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d", "#d4a017"];
const orchardCharts = {}; // chart element id -> {plot, key}; read by the browser test too
window.orchardCharts = orchardCharts;

// `top`: the least the y axis shows, so an idle chart still has readable ticks.
function chartOptions(box, names, format, top) {
  return {
    width: Math.max(240, box.clientWidth - 8),
    height: 170,
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max((hi || 0) * 1.1, top)] } },
    axes: [{ stroke: "#6b7480" }, { stroke: "#6b7480", size: 66, values: (u, ticks) => ticks.map(format) }],
    series: [{}, ...names.map((name, i) => ({
      label: name, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true,
      value: (u, v) => (v === null || v === undefined ? "–" : format(v)),
    }))],
  };
}

// Draws `columns` (one array per series, aligned with `xs`) in the element `id`; a new set of
// series (a node joined or left) makes a new chart, otherwise only the data changes.
function drawChart(id, names, xs, columns, format, top) {
  const box = document.getElementById(id);
  const key = names.join("\n");
  let entry = orchardCharts[id];
  if (!entry || entry.key !== key) {
    if (entry) entry.plot.destroy();
    entry = orchardCharts[id] = { key, plot: new uPlot(chartOptions(box, names, format, top), [xs, ...columns], box) };
  } else {
    entry.plot.setData([xs, ...columns]);
  }
  box.dataset.points = String(xs.length);
}

const perSecond = (v) => (v >= 100 ? v.toFixed(0) : v.toFixed(1));
const seconds = (v) => (v >= 1 ? v.toFixed(2) + " s" : (1000 * v).toFixed(0) + " ms");
const percent = (v) => v.toFixed(0) + " %";
const count = (v) => (Number.isInteger(v) ? String(v) : v.toFixed(1));

function nodesOf(points, field) {
  const names = new Set();
  points.forEach((p) => Object.keys(p[field]).forEach((n) => names.add(n)));
  return [...names].sort();
}

function column(points, pick) {
  return points.map((p) => { const v = pick(p); return v === undefined ? null : v; });
}

function renderCharts(history) {
  const points = history.points;
  const xs = points.map((p) => p.t);
  const nodes = nodesOf(points, "tokens_per_s");
  drawChart("chart-throughput", nodes, xs, nodes.map((n) => column(points, (p) => p.tokens_per_s[n])), perSecond, 1);
  drawChart("chart-ttft", ["p50", "p99"], xs, [column(points, (p) => p.ttft_p50), column(points, (p) => p.ttft_p99)], seconds, 0.01);
  const kvNodes = nodesOf(points, "kv_use");
  drawChart("chart-kv", kvNodes, xs, kvNodes.map((n) => column(points, (p) => (p.kv_use[n] ?? null) === null ? null : 100 * p.kv_use[n])), percent, 100);
  const hitNodes = nodesOf(points, "hit_rate");
  drawChart("chart-hit", hitNodes, xs, hitNodes.map((n) => column(points, (p) => (p.hit_rate[n] ?? null) === null ? null : 100 * p.hit_rate[n])), percent, 100);
  drawChart("chart-errors", ["errors"], xs, [column(points, (p) => p.errors)], count, 1);
}

function latestThroughput(history) {
  const last = history.points[history.points.length - 1];
  return last ? Object.values(last.tokens_per_s).reduce((a, b) => a + b, 0) : null;
}
