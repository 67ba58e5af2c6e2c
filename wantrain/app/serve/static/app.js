// wantrain serve: the runs list and the live run page. Plain JavaScript, no build step; charts by uPlot (vendored).
"use strict";

const TOKEN = (document.querySelector('meta[name="wantrain-token"]') || {}).content || "";
const READ_ONLY = ((document.querySelector('meta[name="wantrain-read-only"]') || {}).content || "") === "true";
const POLL_MS = 500;       // live: new points, samples and events within one poll of being written
const MAX_POINTS = 2000;   // per metric on load (the server downsamples); reloaded past twice that
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"];
// the LR finder's suggestion names as the console and the chart write them (wantrain.observers.lr_finder.math.LABELS)
const LR_LABELS = {minimum: "minimum / 10"};
const $ = (sel) => document.querySelector(sel);

// Chart groups: which metrics each chart shows. `match` returns a label for a metric of the group, or null.
const GROUPS = [
  {id: "loss", title: "Training loss per expert (raw and smoothed)", smooth: true, log: false,
    match: (k, keys) => (m => m ? m[1] : (k === "train/loss" && !keys.some(x => x.startsWith("train/loss/")) ? "loss" : null))(k.match(/^train\/loss\/(.+)$/))},
  {id: "lr", title: "Learning rate", log: true,
    match: (k, keys) => (m => m ? m[1] : (k === "train/lr" && !keys.some(x => x.startsWith("train/lr/")) ? "lr" : null))(k.match(/^train\/lr\/(.+)$/))},
  {id: "alpha", title: "LoRA alpha per expert (bands: phases)", bands: true,
    match: (k) => (m => m ? m[1] : null)(k.match(/^alpha\/linear_alpha\/(.+)$/))},
  {id: "norms", title: "Gradient and parameter norms", log: true,
    match: (k) => /^train\/(grad_norm|param_norm|total_param_norm)/.test(k) ? k.replace(/^train\//, "") : null},
  {id: "val", title: "Validation loss (per timestep and expert)",
    match: (k) => k.startsWith("val/") ? k.replace(/^val\//, "") : null},
  {id: "memory", title: "Memory (GiB): RAM and VRAM",
    match: (k) => k.startsWith("memory/") ? k.replace(/^memory\//, "") : null},
  {id: "time", title: "Seconds per optimizer step",
    match: (k) => k === "train/step_time_s" ? "step time" : null},
];

const state = {
  run: null, rows: 0, events: 0, series: {}, timeline: [], charts: {}, switches: [], timer: null, runsTimer: null,
  zoom: null, summary: null, samplesKey: "", checkpointsKey: "", lrFinderShown: false, generation: 0,
};

async function api(path, options) {
  const res = await fetch(path, options);
  const body = await res.json().catch(() => ({error: res.statusText}));
  if (!res.ok) throw Object.assign(new Error(body.error || res.statusText), {status: res.status});
  return body;
}

function fmt(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  // as Python's "{:.4g}" (the console and `wantrain report`): no trailing zeros
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : String(Number(v.toPrecision(digits)));
}
function duration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.round(s);
  if (s < 90) return s + " s";
  if (s < 5400) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c));
  return e;
}
// axis ticks: the fewest significant digits (3 at least) that tell every tick apart ("0.5612 0.5613", not "0.561 0.561")
function tickLabels(vals) {
  const shown = vals.filter(v => v != null);
  for (let digits = 3; digits <= 10; digits++) {
    const labels = vals.map(v => v == null ? "" : fmt(v, digits));
    if (new Set(labels.filter((l, i) => vals[i] != null)).size === shown.length) return labels;
  }
  return vals.map(v => v == null ? "" : String(v));
}
// the x range of a chart: one step alone is centred in a range of a few steps, not 0..100
function xRange(u, min, max) {
  const xs = u.data && u.data[0];
  if (xs && xs.length === 1) return [xs[0] - 2, xs[0] + 2];  // uPlot hands one point 0..2x
  if (min == null || max == null) return [0, 1];
  return min === max ? [min - 2, max + 2] : [min, max];
}
function badge(status) { return el("span", {class: "badge " + status}, status); }
function connection(ok) { $("#connection").hidden = ok; }

// ---- the runs list --------------------------------------------------------------------------------------------
async function showRuns() {
  stopPolling();
  $("#runs-view").hidden = false; $("#run-view").hidden = true; $("#data-view").hidden = true;
  const refresh = async () => {
    try {
      const data = await api("/api/runs");
      connection(true);
      $("#root").textContent = data.root;
      showFolders(data.data || []);
      const body = $("#runs tbody");
      body.replaceChildren(...data.runs.map(r => {
        const tr = el("tr", {"data-run": r.id, onclick: () => { location.hash = "#/run/" + encodeURIComponent(r.id); }},
          el("td", {}, el("a", {href: "#/run/" + encodeURIComponent(r.id)}, r.id)), el("td", {}, r.name || "–"),
          el("td", {}, r.kind === "lr_finder" ? "LR finder" : "training"), el("td", {}, badge(r.status)),
          el("td", {}, `${r.step} / ${r.total_steps ?? "?"}`), el("td", {}, duration(r.eta_s)),
          el("td", {}, fmt(r.last_loss)), el("td", {}, duration(r.age_s) + " ago"));
        return tr;
      }));
      $("#no-runs").hidden = data.runs.length > 0;
    } catch (e) { connection(false); }
  };
  await refresh();
  state.runsTimer = setInterval(refresh, 2000);
}

function stopPolling() {
  clearInterval(state.runsTimer); clearTimeout(state.timer);
  state.runsTimer = state.timer = null;
}

// ---- one run --------------------------------------------------------------------------------------------------
async function showRun(id) {
  stopPolling();
  Object.values(state.charts).forEach(c => c.plot.destroy());
  Object.assign(state, {run: id, rows: 0, events: 0, series: {}, timeline: [], charts: {}, switches: [], zoom: null,
    samplesKey: "", checkpointsKey: "", lrFinderShown: false});
  $("#runs-view").hidden = true; $("#run-view").hidden = false; $("#data-view").hidden = true;
  $("#run-title").textContent = id;
  $("#charts").replaceChildren(); $("#events tbody").replaceChildren(); $("#samples").replaceChildren();
  $("#lr-finder").hidden = true; $("#control-msg").textContent = "";
  tab("charts");
  try {
    const info = await api(`/api/runs/${encodeURIComponent(id)}`);
    state.generation = info.generation;
    showDetails(info);
    await loadSeries();
  } catch (e) { showProblem(e.message); return; }
  poll();
}

async function loadSeries() {
  const id = encodeURIComponent(state.run);
  let query = `max=${MAX_POINTS}`;
  if (state.zoom) query += `&lo=${state.zoom[0]}&hi=${state.zoom[1]}`;
  const data = await api(`/api/runs/${id}/series?${query}`);
  state.series = {};
  for (const [k, s] of Object.entries(data.series)) state.series[k] = {x: s.x, y: s.y};
  state.rows = data.rows;
  state.switches = data.switches;
  if (data.generation !== state.generation) {  // read again since the page last looked: so is the timeline
    Object.assign(state, {generation: data.generation, events: 0, timeline: []});
    $("#events tbody").replaceChildren();
    renderEvents();
  }
  drawCharts(true);
}

async function poll() {
  if (!state.run) return;
  const id = state.run;
  try {
    const data = await api(`/api/runs/${encodeURIComponent(id)}/poll?m=${state.rows}&e=${state.events}`);
    if (state.run !== id) return;
    connection(true);
    if (data.generation !== state.generation) await reloadRun();  // a resume rewrote the logs
    else await applyPoll(data);
  } catch (e) {
    if (e.status === 404) { showProblem(e.message); showSummary(null); return; }  // the run directory is gone
    connection(false);
  }
  state.timer = setTimeout(poll, POLL_MS);
}

async function reloadRun() {
  // a resume cut the run's logs back and the server read them again: load the series afresh (loadSeries then
  // drops the timeline, since the generation differs)
  Object.assign(state, {rows: 0, series: {}});
  await loadSeries();
}

async function applyPoll(data) {
  showSummary(data.summary);
  let grew = false, tooMany = false;
  for (const [k, p] of Object.entries(data.points)) {
    const s = state.series[k] || (state.series[k] = {x: [], y: []});
    s.x.push(...p.x); s.y.push(...p.y); grew = true;
    if (s.x.length > 2 * MAX_POINTS) tooMany = true;
  }
  state.rows = data.rows;
  if (data.events.length) { addEvents(data.events); grew = true; }
  state.events = data.event_count;
  showCheckpoints(data.checkpoints);
  showSamples(data.samples);
  if (tooMany) await loadSeries(); else if (grew) drawCharts(false);
}

function showProblem(message) {
  $("#problems").hidden = false;
  $("#problems").textContent = message;
}

function showSummary(s) {
  state.summary = s;
  const running = s && s.status === "running";
  for (const b of document.querySelectorAll(".controls button")) {
    b.disabled = !running || READ_ONLY;
    b.title = READ_ONLY ? "the server is read-only" : (running ? "" : "the run is not running");
  }
  const status = s ? s.status : "gone";
  $("#run-status").className = "badge " + status;
  $("#run-status").textContent = status;
  if (!s) return;
  $("#run-step").textContent = `step ${s.step} / ${s.total_steps ?? "?"}`;
  $("#run-eta").textContent = s.eta_s != null ? `ETA ${duration(s.eta_s)}` : "";
  $("#run-loss").textContent = s.last_loss != null ? `loss ${fmt(s.last_loss)}` : "";
  const problems = [...(s.problems || [])];
  if (s.reason && s.status !== "completed") problems.unshift(`${s.status}: ${s.reason}`);
  $("#problems").hidden = problems.length === 0;
  $("#problems").textContent = problems.join("\n");
}

function showCheckpoints(list) {
  const key = JSON.stringify(list);
  if (key === state.checkpointsKey) return;
  state.checkpointsKey = key;
  const items = list.filter(c => c.complete).map(c => el("span", {class: "file", "data-file": c.name}, c.name));
  $("#checkpoints").replaceChildren(...(items.length ? items : ["none yet"]));
}

// ---- controls -----------------------------------------------------------------------------------------------------
async function control(action) {
  if (action === "stop" && !confirm("Stop the run? It saves the LoRA and a checkpoint, then ends (resumable).")) return;
  $("#control-msg").textContent = `asking the run to ${action}…`;
  try {
    const r = await api(`/api/runs/${encodeURIComponent(state.run)}/control`, {
      method: "POST", headers: {"Content-Type": "application/json", "X-Wantrain-Token": TOKEN},
      body: JSON.stringify({action}),
    });
    $("#control-msg").textContent = `${action}: requested (${r.request_id}); the run acts after its current step`;
  } catch (e) { $("#control-msg").textContent = `${action}: refused: ${e.message}`; }
}

// ---- charts -------------------------------------------------------------------------------------------------------
function ema(ys, alpha) {
  const out = []; let m = null;
  for (const y of ys) {
    if (y === null || y === undefined) { out.push(null); continue; }
    m = m === null ? y : alpha * m + (1 - alpha) * y;
    out.push(m);  // an exponential moving average started at the first value
  }
  return out;
}

function chartData(group) {
  const keys = Object.keys(state.series);
  const members = keys.map(k => [k, group.match(k, keys)]).filter(([, label]) => label !== null);
  members.sort((a, b) => a[1].localeCompare(b[1]));
  const xs = new Set();
  for (const [k] of members) state.series[k].x.forEach(x => xs.add(x));
  const x = [...xs].sort((a, b) => a - b);
  const index = new Map(x.map((v, i) => [v, i]));
  const columns = [], labels = [];
  for (const [k, label] of members) {
    const col = new Array(x.length).fill(null);
    const s = state.series[k];
    for (let i = 0; i < s.x.length; i++) col[index.get(s.x[i])] = s.y[i];
    columns.push(col); labels.push(label);
    if (group.smooth) { columns.push(ema(col, group.smoothing ?? 0.9)); labels.push(label + " (smoothed)"); }
  }
  return {x, columns, labels, keys: members.map(m => m[0])};
}

function bandsOf(x) {
  // alpha phase bands from alpha/phase/<expert>: a new band where any expert's phase index changes
  const bands = [];
  for (const [k, s] of Object.entries(state.series)) {
    if (!k.startsWith("alpha/phase/")) continue;
    let start = null, phase = null;
    for (let i = 0; i < s.x.length; i++) {
      if (s.y[i] !== phase) { if (phase !== null) bands.push([start, s.x[i], phase, k]); start = s.x[i]; phase = s.y[i]; }
    }
    if (phase !== null && s.x.length) bands.push([start, s.x[s.x.length - 1], phase, k]);
  }
  return bands;
}

function overlays(group) {
  return {
    draw: [u => {
      const ctx = u.ctx, top = u.bbox.top, height = u.bbox.height;
      ctx.save();
      if (group.bands) {
        for (const [a, b, phase] of bandsOf()) {
          const x0 = u.valToPos(a, "x", true), x1 = u.valToPos(b, "x", true);
          ctx.fillStyle = ["rgba(31,119,180,0.06)", "rgba(255,127,14,0.10)", "rgba(44,160,44,0.10)", "rgba(148,103,189,0.10)"][phase % 4];
          ctx.fillRect(x0, top, Math.max(1, x1 - x0), height);
        }
      }
      ctx.strokeStyle = "rgba(80,80,80,0.45)"; ctx.setLineDash([4, 4]); ctx.lineWidth = 1;
      for (const step of state.switches) {
        const px = u.valToPos(step, "x", true);
        if (px < u.bbox.left || px > u.bbox.left + u.bbox.width) continue;
        ctx.beginPath(); ctx.moveTo(px, top); ctx.lineTo(px, top + height); ctx.stroke();
      }
      ctx.restore();
    }],
    setSelect: [u => {
      if (u.select.width < 5) return;
      const lo = u.posToVal(u.select.left, "x"), hi = u.posToVal(u.select.left + u.select.width, "x");
      state.zoom = [lo, hi];
      loadSeries();  // the zoomed range at full detail (downsampled again only past MAX_POINTS)
      u.setSelect({left: 0, width: 0, top: 0, height: 0}, false);
    }],
  };
}

function makeChart(group, data) {
  const box = el("div", {class: "chart-box", id: "chart-" + group.id});
  const logBox = el("input", {type: "checkbox"});
  logBox.checked = !!group.log;
  const head = el("div", {class: "chart-head"}, el("h3", {}, group.title),
    el("span", {}, el("label", {}, logBox, " log scale")));
  if (group.smooth) {
    const slider = el("input", {type: "range", min: "0", max: "0.99", step: "0.01", value: "0.9"});
    slider.addEventListener("input", () => { group.smoothing = +slider.value; drawCharts(false); });
    head.lastChild.prepend(el("label", {}, "smoothing ", slider));
  }
  const target = el("div", {class: "chart"});
  box.append(head, target);
  $("#charts").append(box);
  const width = Math.max(400, box.clientWidth - 16);
  const series = [{label: "step"}, ...data.labels.map((label, i) => ({
    label, stroke: COLORS[Math.floor(group.smooth ? i / 2 : i) % COLORS.length], width: group.smooth && i % 2 === 1 ? 2 : 1,
    alpha: group.smooth && i % 2 === 0 ? 0.35 : 1, spanGaps: true,
  }))];
  const opts = {
    width, height: 260, series, cursor: {drag: {x: true, y: false}},
    scales: {x: {time: false, range: xRange}, y: {distr: logBox.checked ? 3 : 1}},
    axes: [{label: "step"}, {size: 70, values: (u, vals) => tickLabels(vals)}], hooks: overlays(group),
  };
  const plot = new uPlot(opts, [data.x, ...data.columns], target);
  target.addEventListener("dblclick", () => { state.zoom = null; loadSeries(); });
  logBox.addEventListener("change", () => { group.log = logBox.checked; plot.destroy(); box.remove(); delete state.charts[group.id]; drawCharts(true); });
  return {plot, box, labels: data.labels.join("|")};
}

function drawCharts(rebuild) {
  for (const group of GROUPS) {
    const data = chartData(group);
    let chart = state.charts[group.id];
    if (!data.labels.length) { if (chart) { chart.plot.destroy(); chart.box.remove(); delete state.charts[group.id]; } continue; }
    if (chart && (chart.labels !== data.labels.join("|"))) { chart.plot.destroy(); chart.box.remove(); chart = null; }
    if (!chart) { state.charts[group.id] = makeChart(group, data); continue; }
    chart.plot.setData([data.x, ...data.columns], !state.zoom);
    if (state.zoom) chart.plot.setScale("x", {min: state.zoom[0], max: state.zoom[1]});
  }
  // keep the groups in their order; each box says how many steps it shows (data-points)
  for (const group of GROUPS) {
    const c = state.charts[group.id];
    if (c) { c.box.dataset.points = String(c.plot.data[0].length); $("#charts").append(c.box); }
  }
}

// ---- the LR finder ------------------------------------------------------------------------------------------------
function showLrFinder(lr) {
  if (!lr || !Object.keys(lr.curves).length) return;
  $("#lr-finder").hidden = false;
  const experts = Object.keys(lr.curves);
  const lrs = [...new Set(experts.flatMap(e => lr.curves[e].lr))].filter(v => v > 0).sort((a, b) => a - b);
  const index = new Map(lrs.map((v, i) => [v, i]));
  const columns = [], series = [{label: "LR"}];
  experts.forEach((e, j) => {
    for (const [field, width] of [["raw", 1], ["smoothed", 2]]) {
      const col = new Array(lrs.length).fill(null);
      lr.curves[e].lr.forEach((v, i) => { if (index.has(v)) col[index.get(v)] = lr.curves[e][field][i]; });
      columns.push(col);
      series.push({label: `${e || "loss"} ${field}`, stroke: COLORS[j % COLORS.length], width, alpha: field === "raw" ? 0.4 : 1, spanGaps: true});
    }
  });
  const suggestions = [];
  const list = $("#lr-suggestions");
  list.replaceChildren();
  for (const [expert, s] of Object.entries((lr.summary || {}).experts || {})) {
    for (const [name, value] of Object.entries(s.suggestions || {})) {
      const label = LR_LABELS[name] || name;
      if (value) suggestions.push([value, experts.length > 1 ? `${label} (${expert})` : label, expert]);
    }
    list.append(el("li", {}, `${expert}: suggested LR ${fmt(s.suggested_lr, 3)} (${s.default})`,
      ...Object.entries(s.suggestions || {}).map(([n, v]) => ` · ${LR_LABELS[n] || n} ${fmt(v, 3)}`),
      ...(s.warnings || []).map(w => el("div", {class: "warning"}, "⚠ " + w))));
  }
  const draw = u => {
    const ctx = u.ctx; ctx.save(); ctx.font = "11px sans-serif"; ctx.setLineDash([3, 3]);
    suggestions.forEach(([value, name], i) => {
      const px = u.valToPos(value, "x", true);
      ctx.strokeStyle = "rgba(200,40,40,0.6)"; ctx.beginPath(); ctx.moveTo(px, u.bbox.top); ctx.lineTo(px, u.bbox.top + u.bbox.height); ctx.stroke();
      ctx.fillStyle = "#a11"; ctx.fillText(name, px + 3, u.bbox.top + 12 + 13 * (i % 6));
    });
    ctx.restore();
  };
  new uPlot({width: Math.max(400, $("#tab-charts").clientWidth - 20), height: 300, series,
    scales: {x: {time: false, distr: 3}}, axes: [{label: "learning rate", values: (u, vals) => vals.map(v => v == null ? "" : fmt(v, 2))}, {size: 70, values: (u, vals) => vals.map(v => v == null ? "" : fmt(v, 3))}], hooks: {draw: [draw]}},
    [lrs, ...columns], $("#lr-finder-chart"));
}

// ---- samples, events, config ---------------------------------------------------------------------------------------
// the motion of a sample (samples/motion/NN, pixels per frame) and the round's ratio to the training clips
function motionAt(index, step) {
  const at = name => { const s = state.series[name]; const i = s ? s.x.indexOf(step) : -1; return i < 0 ? null : s.y[i]; };
  const m = at(`samples/motion/${String(index).padStart(2, "0")}`), r = at("samples/motion_ratio");
  return m === null ? "" : `motion ${m.toFixed(3)} px/frame` + (r === null ? "" : `, ${r.toFixed(2)}x the clips`);
}

function showSamples(samples) {
  const motion = samples.map(s => motionAt(s.index, s.step));
  const key = JSON.stringify([samples, motion]);
  if (key === state.samplesKey) return;
  state.samplesKey = key;
  const steps = [...new Set(samples.map(s => s.step))].sort((a, b) => a - b);
  const prompts = [...new Set(samples.map(s => s.index))].sort((a, b) => a - b);
  const text = new Map(samples.map(s => [s.index, s.prompt]));  // the prompt's text, from the run's config
  if (!samples.length) { $("#samples").replaceChildren(el("p", {}, "No samples yet.")); return; }
  const file = p => `/files/${encodeURIComponent(state.run)}/${p}`;
  const table = el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "prompt"), ...steps.map(s => el("th", {}, `step ${s}`)))));
  const body = el("tbody");
  for (const p of prompts) {
    const label = text.get(p) || `prompt ${p}`;
    body.append(el("tr", {}, el("td", {class: "prompt", title: label}, label), ...steps.map(step => {
      const cell = el("td");
      for (const s of samples.filter(s => s.step === step && s.index === p)) {
        cell.append(s.kind === "mp4" ? el("video", {src: file(s.path), controls: "", loop: "", muted: "", preload: "metadata"})
          : el("img", {src: file(s.path), alt: `latents, step ${step}`, title: "denoised latents"}));
      }
      if (motionAt(p, step)) cell.append(el("div", {class: "motion"}, motionAt(p, step)));
      return cell;
    })));
  }
  table.append(body);
  $("#samples").replaceChildren(table);
}

function addEvents(items) {
  for (const item of items) {
    state.timeline.push(item);
    if (item.type === "ExpertSwitched" && !state.switches.includes(item.step)) state.switches.push(item.step);
  }
  const select = $("#event-type");
  const known = new Set([...select.options].map(o => o.value));
  for (const t of new Set(items.map(i => i.type))) if (!known.has(t)) select.append(el("option", {value: t}, t));
  renderEvents();
}

function renderEvents() {
  const type = $("#event-type").value, from = $("#event-from").value, to = $("#event-to").value;
  const warnings = $("#event-warnings").checked;
  const shown = state.timeline.filter(i => (!type || i.type === type) && (!warnings || i.level !== "info")
    && (from === "" || (i.step ?? 0) >= +from) && (to === "" || (i.step ?? 0) <= +to));
  const rows = shown.slice(-2000).reverse().map(i => el("tr", {class: i.level},
    el("td", {}, i.step ?? "–"), el("td", {}, i.time ? new Date(i.time * 1000).toLocaleTimeString() : "–"),
    el("td", {}, i.type), el("td", {class: "detail"}, describe(i.detail))));
  $("#events tbody").replaceChildren(...rows);
  $("#event-count").textContent = `${shown.length} of ${state.timeline.length} events` + (shown.length > 2000 ? " (latest 2000 shown)" : "");
}

function describe(detail) {
  // a value that is an object (MetricsLogged's values) shows its first six entries
  const short = v => {
    if (v === null || typeof v !== "object" || Array.isArray(v)) return typeof v === "number" ? fmt(v) : JSON.stringify(v);
    const entries = Object.entries(v);
    const shown = entries.slice(0, 6).map(([k, x]) => `${k}: ${typeof x === "number" ? fmt(x) : JSON.stringify(x)}`);
    return "{" + shown.join(", ") + (entries.length > 6 ? `, … +${entries.length - 6}` : "") + "}";
  };
  return Object.entries(detail || {}).filter(([, v]) => v !== null && !(Array.isArray(v) && !v.length))
    .map(([k, v]) => `${k}=${typeof v === "string" ? v : short(v)}`).join("  ").slice(0, 600);
}

function showDetails(info) {
  showSummary(info.summary);
  $("#config").textContent = info.config || "(no config.toml)";
  const pre = info.preflight;
  const parts = [];
  if (pre && pre.buckets) {
    parts.push(el("h3", {}, "Buckets"), el("table", {}, el("thead", {}, el("tr", {}, ...["width", "height", "frames", "clips", "batches"].map(h => el("th", {}, h)))),
      el("tbody", {}, ...pre.buckets.map(b => el("tr", {}, ...["width", "height", "frames", "clips", "batches"].map(h => el("td", {}, String(b[h] ?? "–"))))))));
  }
  if (pre && pre.skipped) parts.push(el("h3", {}, `Skipped files (${pre.skipped.length})`),
    el("ul", {}, ...pre.skipped.map(s => el("li", {}, typeof s === "object" ? `${s.path || ""}: ${s.reason || JSON.stringify(s)}` : String(s)))));
  if (pre) {
    if (info.memory) parts.push(el("h3", {}, "Memory plan"), el("pre", {}, info.memory));  // the lines `check` prints
    parts.push(el("details", {}, el("summary", {}, "the whole report (preflight.json)"), el("pre", {}, JSON.stringify(pre, null, 2))));
  }
  $("#preflight").replaceChildren(...(parts.length ? parts : [el("p", {}, "(no preflight.json)")]));
  $("#keep").textContent = (info.keep || []).join("\n"); $("#keep").hidden = !info.keep;
  showSamples(info.samples); showCheckpoints(info.checkpoints);
  if (info.lr_finder) showLrFinder(info.lr_finder);
}

// ---- wiring -------------------------------------------------------------------------------------------------------
function route() {
  const m = location.hash.match(/^#\/run\/(.+)$/), d = location.hash.match(/^#\/data\/(\d+)$/);
  if (m) showRun(decodeURIComponent(m[1])); else if (d) showFolder(Number(d[1])); else showRuns();
}

function tab(name) {
  for (const a of document.querySelectorAll(".tabs a")) a.classList.toggle("active", a.dataset.tab === name);
  for (const t of document.querySelectorAll(".tab")) t.hidden = t.id !== "tab-" + name;
  if (name === "charts") drawCharts(false);
  if (name === "data" && state.run) showClips({run: state.run}, $("#run-clips"));  // data.js
}

document.addEventListener("DOMContentLoaded", () => {
  $("#read-only").hidden = !READ_ONLY;
  for (const b of document.querySelectorAll(".controls button")) b.addEventListener("click", () => control(b.dataset.action));
  for (const a of document.querySelectorAll(".tabs a")) a.addEventListener("click", ev => { ev.preventDefault(); tab(a.dataset.tab); });
  for (const id of ["#event-type", "#event-from", "#event-to", "#event-warnings"]) $(id).addEventListener("input", renderEvents);
  $("#play-all").addEventListener("click", () => document.querySelectorAll("#samples video").forEach(v => { v.currentTime = 0; v.play(); }));
  window.addEventListener("hashchange", route);
  route();
});
