// Server room, dashboard client: reads /dashboard/stream (SSE) and draws the pool and charts on canvas.
"use strict";

const CLEAN = 0, CACHED = 1, USED = 2;
const COLORS = { clean: "#e9ecf1", cached: "#a9b4c2", decode: "#3b82f6", prefill: "#f59e0b",
  running: "#059669", waiting: "#dc2626", orphan: "#6b7280" };
const SERIES_SECONDS = 120;  // time-series window
const STEP_WINDOW = 240;     // steps shown in the scheduler charts

// Everything the page knows; also read by the browser test (window.fantaiDash).
const dash = {
  numBlocks: 0, blockSize: 0, states: new Uint8Array(0), refs: new Map(), owners: [],
  requests: [], hoverId: null, messages: 0, drawnBlocks: 0, signature: "",
  signatures: new Set(), samples: [], steps: [], prev: null, cell: 10, cols: 1,
};
window.fantaiDash = dash;

const $ = (id) => document.getElementById(id);

// ---- colours ------------------------------------------------------------------------------
function requestColor(id, alpha = 1) {
  const hue = (Number(id) * 137.508) % 360;  // golden angle: neighbours' colours stay apart
  return `hsla(${hue.toFixed(1)}, 68%, 52%, ${alpha})`;
}

// ---- stream -------------------------------------------------------------------------------
function connect() {
  const source = new EventSource("/dashboard/stream");
  source.addEventListener("hello", (e) => {
    const info = JSON.parse(e.data);
    dash.numBlocks = info.num_blocks || 0;
    dash.blockSize = info.block_size || 0;
    $("model").textContent = `${info.model} · ${dash.numBlocks} blocks × ${dash.blockSize} tokens`;
  });
  source.onmessage = (e) => onSnapshot(JSON.parse(e.data));
  source.onopen = () => setConn("live", "live");
  source.onerror = () => setConn("down", "reconnecting…");  // EventSource retries by itself
}

function setConn(cls, text) {
  const el = $("conn");
  el.className = `conn ${cls}`;
  el.textContent = text;
}

function onSnapshot(msg) {
  dash.messages += 1;
  const stats = msg.stats;
  dash.numBlocks = stats.num_total_blocks;
  dash.blockSize = stats.block_size;
  if (msg.blocks) applyBlocks(msg.blocks, msg.shared || [], msg.requests || []);
  else if (dash.states.length !== dash.numBlocks) dash.states = new Uint8Array(dash.numBlocks);
  for (const s of msg.steps || []) dash.steps.push(s);
  if (dash.steps.length > STEP_WINDOW) dash.steps.splice(0, dash.steps.length - STEP_WINDOW);
  addSample(msg);
  render(stats);
}

function applyBlocks(runs, shared, requests) {
  const n = dash.numBlocks;
  const states = new Uint8Array(n);
  for (let i = 0; i < runs.starts.length; i++) {
    const end = i + 1 < runs.starts.length ? runs.starts[i + 1] : n;
    states.fill(runs.values[i], runs.starts[i], end);
  }
  dash.states = states;
  dash.refs = new Map(shared.map(([b, r]) => [b, r]));
  // owners[b]: [[request id, logical index], ...] from every live block table
  const owners = new Array(n);
  for (const r of requests) {
    r.block_table.forEach((b, i) => { (owners[b] = owners[b] || []).push([r.id, i]); });
  }
  dash.owners = owners;
  dash.requests = requests;
  dash.signature = signature(states, requests);
  dash.signatures.add(dash.signature);
}

function signature(states, requests) {
  let h = 0;
  for (let i = 0; i < states.length; i++) h = (h * 31 + states[i] + 1) | 0;
  for (const r of requests) h = (h * 31 + r.block_table.length * 7 + r.num_tokens) | 0;
  return `${h}:${requests.length}`;
}

// ---- time series ----------------------------------------------------------------------------
function addSample(msg) {
  const s = msg.stats, prev = dash.prev;
  const sample = { t: msg.time, genRate: null, promptRate: null, hitRate: null,
    kvBlocks: s.num_total_blocks ? s.num_used_blocks / s.num_total_blocks : 0,
    kvUtil: s.kv_utilization, ttft: msg.latency.ttft, tpot: msg.latency.tpot };
  if (prev) {
    const dt = Math.max(msg.time - prev.time, 1e-3);
    sample.genRate = (s.generation_tokens - prev.stats.generation_tokens) / dt;
    sample.promptRate = (s.prompt_tokens - prev.stats.prompt_tokens) / dt;
    const q = s.prefix_cache_queries - prev.stats.prefix_cache_queries;
    sample.hitRate = q > 0 ? (s.prefix_cache_hits - prev.stats.prefix_cache_hits) / q : null;
  }
  dash.prev = msg;
  dash.samples.push(sample);
  while (dash.samples.length && msg.time - dash.samples[0].t > SERIES_SECONDS) dash.samples.shift();
}

// ---- canvas helpers --------------------------------------------------------------------------
function fitCanvas(canvas, cssHeight) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.parentElement.clientWidth;
  const h = cssHeight || canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  return { ctx, w, h };
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e4) return `${(v / 1e3).toFixed(0)}k`;
  if (a >= 100) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1);
  return v.toFixed(2);
}

// Axes, horizontal grid lines and a legend; returns the plot box.
function frame(ctx, w, h, yMax, legend) {
  const box = { x: 44, y: 18, w: w - 52, h: h - 36 };
  ctx.font = "11px system-ui, sans-serif";
  ctx.strokeStyle = "#e5e7eb";
  ctx.fillStyle = "#6b7280";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = box.y + box.h - (box.h * i) / 4;
    ctx.beginPath(); ctx.moveTo(box.x, y + 0.5); ctx.lineTo(box.x + box.w, y + 0.5); ctx.stroke();
    ctx.fillText(fmt((yMax * i) / 4), box.x - 5, y);
  }
  let lx = box.x;
  ctx.textAlign = "left";
  for (const [label, color] of legend) {
    ctx.fillStyle = color; ctx.fillRect(lx, 4, 10, 8);
    ctx.fillStyle = "#374151"; ctx.fillText(label, lx + 13, 8);
    lx += ctx.measureText(label).width + 26;
  }
  return box;
}

// Line chart over the time-series samples; series: [label, color, sample -> value|null].
function lineChart(canvas, series, opts = {}) {
  const { ctx, w, h } = fitCanvas(canvas);
  const samples = dash.samples;
  let top = opts.yMax || 0;
  if (!opts.yMax) for (const [, , get] of series) for (const s of samples) top = Math.max(top, get(s) || 0);
  const yMax = opts.yMax || niceMax(top);
  const box = frame(ctx, w, h, yMax, series.map(([l, c]) => [l, c]));
  if (samples.length < 1) return;
  // The window fills the width from the first sample until it is SERIES_SECONDS long.
  const t1 = samples[samples.length - 1].t, t0 = Math.max(samples[0].t, t1 - SERIES_SECONDS);
  const span = Math.max(t1 - t0, 1);
  const xOf = (t) => box.x + ((t - t0) / span) * box.w;
  const yOf = (v) => box.y + box.h - (Math.min(v, yMax) / yMax) * box.h;
  ctx.lineWidth = 1.6;
  for (const [, color, get] of series) {
    ctx.strokeStyle = color;
    ctx.beginPath();
    let pen = false;
    for (const s of samples) {
      const v = get(s);
      if (v === null || v === undefined) { pen = false; continue; }
      if (pen) ctx.lineTo(xOf(s.t), yOf(v)); else ctx.moveTo(xOf(s.t), yOf(v));
      pen = true;
    }
    ctx.stroke();
  }
  ctx.fillStyle = "#9ca3af"; ctx.textAlign = "right";
  ctx.fillText(`-${span.toFixed(0)} s … now`, box.x + box.w, box.y + box.h + 11);
}

// ---- scheduler charts -----------------------------------------------------------------------
function batchChart(canvas) {
  const { ctx, w, h } = fitCanvas(canvas);
  const steps = dash.steps;
  const yMax = niceMax(Math.max(1, ...steps.map((s) => s.decode_tokens + s.prefill_tokens)));
  const box = frame(ctx, w, h, yMax, [["decode", COLORS.decode], ["prefill", COLORS.prefill]]);
  const bw = box.w / STEP_WINDOW;
  steps.forEach((s, i) => {
    const x = box.x + i * bw;
    const hd = (s.decode_tokens / yMax) * box.h, hp = (s.prefill_tokens / yMax) * box.h;
    ctx.fillStyle = COLORS.decode; ctx.fillRect(x, box.y + box.h - hd, Math.max(bw - 0.5, 1), hd);
    ctx.fillStyle = COLORS.prefill; ctx.fillRect(x, box.y + box.h - hd - hp, Math.max(bw - 0.5, 1), hp);
  });
  stepAxis(ctx, box);
}

function stepAxis(ctx, box) {
  const steps = dash.steps;
  if (!steps.length) return;
  ctx.fillStyle = "#9ca3af"; ctx.textAlign = "left";
  ctx.fillText(`step ${steps[0].step}`, box.x, box.y + box.h + 11);
  ctx.textAlign = "right";
  ctx.fillText(`step ${steps[steps.length - 1].step}`, box.x + (steps.length / STEP_WINDOW) * box.w, box.y + box.h + 11);
}

function queueChart(canvas) {
  const { ctx, w, h } = fitCanvas(canvas);
  const steps = dash.steps;
  const yMax = niceMax(Math.max(1, ...steps.map((s) => Math.max(s.num_running, s.num_waiting))));
  const box = frame(ctx, w, h, yMax, [["running", COLORS.running], ["waiting", COLORS.waiting]]);
  const bw = box.w / STEP_WINDOW;
  const yOf = (v) => box.y + box.h - (v / yMax) * box.h;
  for (const [key, color] of [["num_running", COLORS.running], ["num_waiting", COLORS.waiting]]) {
    ctx.strokeStyle = color; ctx.lineWidth = 1.6; ctx.beginPath();
    steps.forEach((s, i) => { const x = box.x + (i + 0.5) * bw; i ? ctx.lineTo(x, yOf(s[key])) : ctx.moveTo(x, yOf(s[key])); });
    ctx.stroke();
  }
  steps.forEach((s, i) => {
    const x = box.x + (i + 0.5) * bw;
    if (s.num_preempted) marker(ctx, "▲", x, box.y + 8, COLORS.waiting);
    if (s.num_finished) marker(ctx, "●", x, box.y + box.h - 6, "#111827");
    if (s.num_joined) marker(ctx, "◆", x, box.y + box.h - 16, COLORS.decode);
  });
  stepAxis(ctx, box);
}

function marker(ctx, glyph, x, y, color) {
  ctx.fillStyle = color; ctx.textAlign = "center"; ctx.font = "9px system-ui, sans-serif";
  ctx.fillText(glyph, x, y);
  ctx.font = "11px system-ui, sans-serif";
}

// ---- the block grid -------------------------------------------------------------------------
function layoutGrid(width) {
  const n = Math.max(dash.numBlocks, 1);
  // Cells as large as fit in ~420 px of height, between 4 and 24 px.
  let cell = Math.floor(Math.sqrt((width * 420) / n));
  cell = Math.max(4, Math.min(24, cell));
  dash.cell = cell;
  dash.cols = Math.max(1, Math.floor(width / cell));
  return Math.ceil(n / dash.cols) * cell;
}

function blockColor(b) {
  const st = dash.states[b];
  if (st === CLEAN) return COLORS.clean;
  if (st === CACHED) return COLORS.cached;
  const own = dash.owners[b];
  return own ? requestColor(own[0][0]) : COLORS.orphan;
}

function drawGrid() {
  const canvas = $("grid");
  const width = $("grid-wrap").clientWidth;
  const { ctx } = fitCanvas(canvas, layoutGrid(width));
  canvas.style.height = `${canvas.height / (window.devicePixelRatio || 1)}px`;
  const { cell, cols } = dash;
  const hot = dash.hoverId;
  const gap = cell >= 8 ? 1 : 0;
  ctx.font = `${Math.max(8, cell - 9)}px system-ui, sans-serif`;
  ctx.textAlign = "center"; ctx.textBaseline = "middle";
  for (let b = 0; b < dash.numBlocks; b++) {
    const x = (b % cols) * cell, y = Math.floor(b / cols) * cell;
    const own = dash.owners[b];
    const mine = hot !== null && own && own.find(([id]) => id === hot);
    ctx.globalAlpha = hot !== null && !mine ? 0.25 : 1;
    ctx.fillStyle = blockColor(b);
    ctx.fillRect(x, y, cell - gap, cell - gap);
    const refs = dash.refs.get(b);
    if (refs) sharedMark(ctx, x, y, cell - gap, refs);
    if (mine && cell >= 14) {
      // Logical index; bottom-left when the top-right corner holds a ref-count badge.
      const [tx, ty] = refs ? [x + cell * 0.36, y + cell * 0.62] : [x + cell / 2, y + cell / 2];
      ctx.fillStyle = "#fff";
      ctx.fillText(String(mine[1]), tx, ty);
    }
  }
  ctx.globalAlpha = 1;
  dash.drawnBlocks = dash.numBlocks;
  canvas.dataset.blocks = String(dash.numBlocks);
}

function sharedMark(ctx, x, y, size, refs) {
  ctx.strokeStyle = "#111827"; ctx.lineWidth = Math.max(1, size / 8);
  ctx.strokeRect(x + ctx.lineWidth / 2, y + ctx.lineWidth / 2, size - ctx.lineWidth, size - ctx.lineWidth);
  if (size < 14) return;
  // The ref count sits in a corner badge so a highlighted block's logical index stays readable.
  const r = Math.max(4, size / 4);
  ctx.fillStyle = "#111827";
  ctx.fillRect(x + size - 2 * r, y, 2 * r, 2 * r);
  ctx.fillStyle = "#fff";
  const font = ctx.font;
  ctx.font = `${Math.round(r * 1.5)}px system-ui, sans-serif`;
  ctx.fillText(String(refs), x + size - r, y + r + 0.5);
  ctx.font = font;
}

function blockAt(ev) {
  const rect = $("grid").getBoundingClientRect();
  const col = Math.floor((ev.clientX - rect.left) / dash.cell);
  const row = Math.floor((ev.clientY - rect.top) / dash.cell);
  const b = row * dash.cols + col;
  return col >= 0 && col < dash.cols && b >= 0 && b < dash.numBlocks ? b : -1;
}

function showTip(ev) {
  const tip = $("tip"), b = blockAt(ev);
  if (b < 0) { tip.hidden = true; return; }
  const st = ["free (clean)", "cached prefix (free, evictable)", "in use"][dash.states[b]] || "?";
  const own = (dash.owners[b] || []).map(([id, i]) => `request ${id}: logical block ${i}`);
  const refs = dash.refs.get(b) || (dash.states[b] === USED ? 1 : 0);
  tip.textContent = [`physical block ${b}: ${st}`, `ref count ${refs}`, ...own].join("\n");
  const wrap = $("grid-wrap").getBoundingClientRect();
  tip.style.left = `${Math.min(ev.clientX - wrap.left + 12, wrap.width - 220)}px`;
  tip.style.top = `${ev.clientY - wrap.top + 12}px`;
  tip.hidden = false;
}

// ---- request table --------------------------------------------------------------------------
function drawRequests() {
  const body = $("requests").tBodies[0];
  const rows = dash.requests.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.id = r.id;
    if (r.id === dash.hoverId) tr.className = "hot";
    const kv = `${r.num_computed_tokens}/${r.num_tokens}`;
    const cells = [`<span class="dot" style="background:${requestColor(r.id)}"></span>`, r.id,
      r.status + (r.num_preemptions ? ` (preempted ×${r.num_preemptions})` : ""),
      r.num_tokens, kv, r.block_table.length];
    tr.innerHTML = cells.map((c) => `<td>${c}</td>`).join("");
    return tr;
  });
  body.replaceChildren(...rows);
  const running = dash.requests.filter((r) => r.status === "running").length;
  $("req-summary").textContent = `${running} running, ${dash.requests.length - running} waiting`;
  drawMapping();
}

function drawMapping() {
  const r = dash.requests.find((q) => q.id === dash.hoverId);
  $("mapping").textContent = r
    ? `request ${r.id} block table (logical → physical):\n` + r.block_table.map((b, i) => `${i}→${b}`).join("  ")
    : "";
}

function setHover(id) {
  if (dash.hoverId === id) return;
  dash.hoverId = id;
  for (const tr of $("requests").tBodies[0].rows) tr.classList.toggle("hot", Number(tr.dataset.id) === id);
  drawGrid();
  drawMapping();
}

// ---- frame ----------------------------------------------------------------------------------
function render(stats) {
  if (dash.hoverId !== null && !dash.requests.some((r) => r.id === dash.hoverId)) dash.hoverId = null;
  drawGrid();
  drawRequests();
  const used = stats.num_used_blocks, cached = stats.num_cached_blocks;
  $("kv-summary").textContent = `${dash.numBlocks} blocks × ${dash.blockSize} tokens`;
  $("kv-counts").textContent = `in use ${used} · cached ${cached} · clean ${dash.numBlocks - used - cached} · shared ${dash.refs.size}`;
  $("step-summary").textContent = `step ${stats.num_steps}, last batch ${stats.last_batch_decode_tokens} decode + ${stats.last_batch_prefill_tokens} prefill tokens, ${stats.num_preemptions} preemptions`;
  batchChart($("chart-batch"));
  queueChart($("chart-queues"));
  drawSeries();
}

function drawSeries() {
  const ms = (v) => (v === null || v === undefined ? null : v * 1e3);
  lineChart($("chart-throughput"), [["generated", COLORS.decode, (s) => s.genRate], ["prompt", COLORS.prefill, (s) => s.promptRate]]);
  lineChart($("chart-ttft"), [["p50", "#0ea5e9", (s) => ms(s.ttft.p50)], ["p90", "#8b5cf6", (s) => ms(s.ttft.p90)], ["p99", "#ef4444", (s) => ms(s.ttft.p99)]]);
  lineChart($("chart-tpot"), [["p50", "#0ea5e9", (s) => ms(s.tpot.p50)], ["p90", "#8b5cf6", (s) => ms(s.tpot.p90)], ["p99", "#ef4444", (s) => ms(s.tpot.p99)]]);
  lineChart($("chart-kv"), [["blocks in use", "#7c3aed", (s) => s.kvBlocks], ["slot utilization", "#059669", (s) => s.kvUtil]], { yMax: 1 });
  lineChart($("chart-prefix"), [["hit rate", "#0d9488", (s) => s.hitRate]], { yMax: 1 });
}

function init() {
  const grid = $("grid");
  grid.addEventListener("mousemove", (ev) => {
    showTip(ev);
    const own = dash.owners[blockAt(ev)];
    setHover(own ? own[0][0] : null);
  });
  grid.addEventListener("mouseleave", () => { $("tip").hidden = true; setHover(null); });
  const body = $("requests").tBodies[0];
  body.addEventListener("mouseover", (ev) => {
    const tr = ev.target.closest("tr");
    if (tr) setHover(Number(tr.dataset.id));
  });
  body.addEventListener("mouseleave", () => setHover(null));
  window.addEventListener("resize", () => dash.messages && render(dash.prev.stats));
  connect();
}

init();
