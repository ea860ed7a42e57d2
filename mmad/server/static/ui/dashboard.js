// The mmad dashboard: reads the daemon's public GET endpoints (and the repository index) once a
// second, draws each running training job's loss curve from the job's history and then its
// Server-Sent Events, and charts the daemon's request latency, rate and errors from /metrics.
// Paths are relative, so the page also works behind a proxy that serves the daemon under a prefix.
"use strict";

const POLL_MS = 1000;
const FINISHED = new Set(["done", "cancelled", "failed"]);
const $ = (id) => document.getElementById(id);
const SERVING_WINDOW_S = 300; // the span of the request charts
const jobs = new Map(); // job id -> {card, points: [[step, loss or null]], checkpoints: [step], source}
let lastCounts = null; // {time, rows: {model: inference_count}} of the previous poll, for rows/s
let lastMetrics = null; // {time, families} of the previous poll's /metrics, for rates and interval quantiles
const serving = {start: null, requests: new Map(), errors: new Map(), latency: new Map()}; // label -> [[time_s, value]]

async function api(path, options) {
  const response = await fetch(path, options);
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(`${path}: ${response.status} ${body.error || ""}`);
  return body;
}

function row(tbody, cells) {
  const tr = tbody.insertRow();
  for (const [text, cls] of cells) {
    const td = tr.insertCell();
    td.textContent = text;
    if (cls) td.className = cls;
  }
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (Math.abs(value) >= 1e4 || (Math.abs(value) < 1e-3 && value !== 0)) return value.toExponential(digits - 1);
  return value.toPrecision(digits);
}

async function showDevices() {
  const report = await api("v2/devices");
  const available = $("devices"), unavailable = $("unavailable-devices");
  available.replaceChildren();
  unavailable.replaceChildren();
  const chosen = `${report.selected.backend}:${report.selected.variant}`;
  for (const d of report.rows) {
    const name = `${d.backend}:${d.variant}`;
    if (d.available) {
      row(available, [[name === chosen ? "▶" : ""], [name], [d.device || "–"],
        [d.software ? "software renderer, on the CPU" : "", "muted"]]);
    } else {
      row(unavailable, [[name], [d.reason, "muted"]]);
    }
  }
  const folded = unavailable.rows.length;
  $("unavailable").hidden = folded === 0;
  $("unavailable").querySelector("summary").textContent =
    `${folded} backend${folded === 1 ? "" : "s"} not available here, and why`;
}

async function showModels() {
  const [index, stats] = await Promise.all([
    api("v2/repository/index", {method: "POST", headers: {"Content-Type": "application/json"}, body: "{}"}),
    api("v2/models/stats"),
  ]);
  const now = performance.now();
  const counts = Object.fromEntries(stats.model_stats.map((s) => [s.name, s.inference_count]));
  const metas = await Promise.all(index.map((m) =>
    m.state === "READY" ? api(`v2/models/${encodeURIComponent(m.name)}`).catch(() => null) : null));
  const tbody = $("models");
  tbody.replaceChildren();
  index.forEach((m, i) => {
    const meta = metas[i];
    let rate = "–";
    if (lastCounts && m.name in counts && m.name in lastCounts.rows) {
      rate = fmt((counts[m.name] - lastCounts.rows[m.name]) / ((now - lastCounts.time) / 1000));
    }
    row(tbody, [[m.name], [m.state, m.state === "READY" ? "ready" : "unavailable"], [m.version || "–"],
      [meta ? meta.versions.length : "–", "num"], [meta ? meta.step : "–", "num"],
      [meta ? meta.queued_requests : "–", "num"], [rate, "num"], [m.reason, "muted"]]);
  });
  lastCounts = {time: now, rows: counts};
}

function jobCard(status) {
  const card = document.createElement("div");
  card.className = "job";
  card.dataset.job = status.job;
  card.innerHTML = `<h3></h3><div class="figures"><span>step <b class="step">0</b> / <span class="steps"></span></span>
    <span>loss <b class="loss">–</b></span><span><b class="rate">–</b> rows/s</span><span class="state"></span></div>
    <canvas width="560" height="220"></canvas>`;
  card.querySelector("h3").textContent = `${status.model_name} · job ${status.job.slice(0, 8)} · ` +
    `dataset ${status.dataset.slice(0, 8)}, batch ${status.batch_size}`;
  $("jobs").prepend(card);
  return card;
}

function showStatus(job, s) {
  const q = (sel) => job.card.querySelector(sel);
  q(".step").textContent = s.step;
  if (s.steps !== undefined) q(".steps").textContent = s.steps;
  q(".loss").textContent = fmt(s.loss, 4);
  q(".rate").textContent = fmt(s.samples_per_s);
  if (s.state) q(".state").textContent = s.state + (s.error ? `: ${s.error}` : "");
}

const lastStep = (job) => (job.points.length ? job.points[job.points.length - 1][0] : 0);

function watch(status) {
  const job = {card: jobCard(status), points: [], checkpoints: [], source: null};
  jobs.set(status.job, job);
  showStatus(job, status);
  const base = `v2/models/${encodeURIComponent(status.model_name)}/jobs/${status.job}`;
  job.source = new EventSource(`${base}/events`);
  job.source.addEventListener("progress", (e) => {
    const p = JSON.parse(e.data);
    if (p.step > lastStep(job)) job.points.push([p.step, p.loss]);
    showStatus(job, {...p, state: "running"});
    draw(job);
  });
  job.source.addEventListener("checkpoint", (e) => {
    job.checkpoints.push(JSON.parse(e.data).step);
    draw(job);
  });
  for (const end of FINISHED) {
    job.source.addEventListener(end, (e) => {
      job.source.close(); // the stream ends here; EventSource would otherwise reconnect
      showStatus(job, JSON.parse(e.data));
    });
  }
  // the curve from the job's first step (the daemon keeps it), then the events that came since
  api(`${base}/losses`).then((history) => {
    const known = history.points.length ? history.points[history.points.length - 1][0] : 0;
    job.points = history.points.concat(job.points.filter((p) => p[0] > known));
    draw(job);
  }, showError);
}

// A chart on a canvas: lines of [x, y] points (y null: no value there, the line breaks), a log
// or linear y axis (linear from 0 with `fromZero`), x labels by `xText`, a tick on the x axis at
// each of `ticks`, and a red mark through the plot at each of `marks`. The canvas's data-points
// and data-max say how many values it drew and the largest.
function plot(canvas, lines, {log = false, fromZero = false, xRange = null, xText = String, ticks = [], marks = []}) {
  const ctx = canvas.getContext("2d");
  const legend = lines.some((line) => line.label);
  const W = canvas.width, H = canvas.height, L = 56, R = 10, T = legend ? 24 : 10, B = 24;
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, W, H);
  ctx.strokeStyle = "#c7ccd4";
  ctx.strokeRect(L, T, W - L - R, H - T - B);
  ctx.font = "11px system-ui, sans-serif";
  let legendX = 4;
  for (const line of lines.filter((l) => l.label)) { // a row above the plot
    ctx.fillStyle = line.color;
    ctx.fillRect(legendX, 7, 10, 3);
    ctx.fillText(line.label, legendX + 13, 13);
    legendX += 13 + ctx.measureText(line.label).width + 9;
  }
  const drawable = (p) => p[1] !== null && Number.isFinite(p[1]) && (!log || p[1] > 0);
  const values = lines.flatMap((line) => line.points.filter(drawable));
  canvas.dataset.points = values.length;
  canvas.dataset.max = values.length ? Math.max(...values.map((p) => p[1])) : "";
  const xs = lines.flatMap((line) => line.points.map((p) => p[0])).concat(marks);
  if (!values.length) {
    ctx.fillStyle = "#6b7280";
    ctx.font = "12px system-ui, sans-serif";
    ctx.fillText("no data yet", L + 8, T + 18);
  }
  if (!xs.length) return;
  const [x0, x1r] = xRange || [Math.min(...xs), Math.max(...xs)];
  const x1 = Math.max(x1r, x0 + 1e-9);
  const ys = values.map((p) => (log ? Math.log10(p[1]) : p[1]));
  let y0 = fromZero ? 0 : Math.min(...ys), y1 = Math.max(...ys, y0);
  if (y1 - y0 < 1e-9) { y0 -= fromZero ? 0 : 0.5; y1 += log ? 0.5 : Math.max(1, Math.abs(y1)); }
  const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = (y) => T + (y1 - (log ? Math.log10(y) : y)) / (y1 - y0) * (H - T - B);
  ctx.fillStyle = "#6b7280";
  ctx.font = "11px system-ui, sans-serif";
  if (values.length) {
    ctx.fillText(fmt(log ? 10 ** y1 : y1), 4, T + 10);
    ctx.fillText(fmt(log ? 10 ** y0 : y0), 4, H - B);
  }
  ctx.fillText(xText(x0), L, H - 8);
  const end = xText(x1r);
  ctx.fillText(end, W - R - ctx.measureText(end).width, H - 8);
  ctx.strokeStyle = "#9aa3b2";
  for (const x of ticks.filter((t) => t >= x0)) {
    ctx.beginPath();
    ctx.moveTo(X(x), H - B);
    ctx.lineTo(X(x), H - B - 6);
    ctx.stroke();
  }
  ctx.strokeStyle = "#dc2626";
  for (const x of marks) {
    ctx.beginPath();
    ctx.moveTo(X(x), T);
    ctx.lineTo(X(x), H - B);
    ctx.stroke();
  }
  ctx.lineWidth = 1.5;
  for (const line of lines) {
    ctx.strokeStyle = ctx.fillStyle = line.color;
    ctx.beginPath();
    line.points.forEach((p, j) => {
      if (!drawable(p)) return;
      const joined = j > 0 && drawable(line.points[j - 1]);
      if (joined) ctx.lineTo(X(p[0]), Y(p[1])); else ctx.moveTo(X(p[0]), Y(p[1]));
      const alone = !joined && !(j + 1 < line.points.length && drawable(line.points[j + 1]));
      if (alone) ctx.fillRect(X(p[0]) - 2, Y(p[1]) - 2, 4, 4); // a value with none beside it
    });
    ctx.stroke();
  }
  ctx.lineWidth = 1;
}

// The loss curve: step on x, loss on a log scale on y (losses fall by decades while training),
// versions written marked as ticks on the x axis, a NaN or Inf loss as a red mark at its step.
function draw(job) {
  const canvas = job.card.querySelector("canvas");
  canvas.dataset.first = job.points.length ? job.points[0][0] : "";
  plot(canvas, [{color: "#2563eb", points: job.points}], {
    log: true, xText: (s) => `step ${Math.round(s)}`, ticks: job.checkpoints,
    marks: job.points.filter((p) => p[1] === null).map((p) => p[0]),
  });
}

async function showJobs() {
  const {jobs: statuses} = await api("v2/jobs");
  for (const s of statuses) {
    const job = jobs.get(s.job);
    if (job) {
      if (FINISHED.has(s.state)) showStatus(job, s);
    } else if (!FINISHED.has(s.state)) {
      watch(s);
    }
  }
  $("no-jobs").hidden = jobs.size > 0;
}

// The Prometheus text of /metrics as [{name, labels, value}] (comments and blank lines skipped).
function parseMetrics(text) {
  const number = (v) => (v === "+Inf" ? Infinity : v === "-Inf" ? -Infinity : Number(v));
  const samples = [];
  for (const line of text.split("\n")) {
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const [, key, value] of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[key] = value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    samples.push({name: m[1], labels, value: number(m[3])});
  }
  return samples;
}

// One scrape's series of the families the charts read: name -> Map(series key -> {labels, value}).
const CHARTED = ["mmad_requests_total", "mmad_request_failures_total", "mmad_queue_seconds_bucket",
  "mmad_compute_seconds_bucket"];

function scrape(samples) {
  const families = new Map(CHARTED.map((name) => [name, new Map()]));
  for (const sample of samples) families.get(sample.name)?.set(JSON.stringify(sample.labels), sample);
  return families;
}

// What a family's series counted between two scrapes, summed by `by(labels)`: a series that is new
// counted all it has, and one whose count fell was reset (the daemon restarted), as Prometheus's
// increase() takes them.
function increase(now, before, name, by) {
  const sums = new Map();
  for (const [key, {labels, value}] of now.get(name)) {
    const previous = before.get(name).get(key);
    const delta = previous === undefined || value < previous.value ? value : value - previous.value;
    sums.set(by(labels), (sums.get(by(labels)) || 0) + delta);
  }
  return sums;
}

const sum = (values) => [...values].reduce((a, b) => a + b, 0);

// The q-quantile of a histogram's observations from its cumulative bucket counts (le -> count),
// interpolated linearly within its bucket as Prometheus's histogram_quantile does; null when none.
function quantile(q, buckets) {
  const bounds = [...buckets.keys()].sort((a, b) => a - b);
  const counts = bounds.map((le) => buckets.get(le));
  const n = counts[counts.length - 1];
  if (!(n > 0)) return null;
  const rank = q * n;
  let lower = 0, below = 0;
  for (let i = 0; i < bounds.length; i++) {
    if (counts[i] >= rank) {
      if (bounds[i] === Infinity) return lower; // above the highest bound: that bound, as Prometheus says
      return lower + (bounds[i] - lower) * (rank - below) / (counts[i] - below);
    }
    lower = bounds[i];
    below = counts[i];
  }
  return null;
}

function append(series, key, point) {
  if (!series.has(key)) series.set(key, []);
  const points = series.get(key);
  points.push(point);
  while (points.length && points[0][0] < point[0] - SERVING_WINDOW_S) points.shift();
}

const COLOURS = ["#2563eb", "#16a34a", "#9333ea", "#ea580c"];

async function showServing() {
  const response = await fetch("metrics");
  if (!response.ok) throw new Error(`metrics: ${response.status}`);
  const now = performance.now() / 1000;
  const families = scrape(parseMetrics(await response.text()));
  const failures = [...families.get("mmad_request_failures_total").values()];
  const byStatus = new Map();
  for (const {labels, value} of failures) byStatus.set(labels.status, (byStatus.get(labels.status) || 0) + value);
  const statuses = [...byStatus].filter(([, n]) => n > 0).sort().map(([status, n]) => `${status}: ${n}`);
  const errors = sum(failures.map((f) => f.value));
  $("errors-total").textContent = `${errors}${statuses.length ? ` (${statuses.join(", ")})` : ""}`;
  $("requests-total").textContent = sum([...families.get("mmad_requests_total").values()].map((r) => r.value));
  const before = lastMetrics;
  lastMetrics = {time: now, families};
  if (serving.start === null) serving.start = now;
  if (!before) return; // a rate needs two scrapes
  const dt = now - before.time;
  const counted = (name, by) => increase(families, before.families, name, by);
  for (const [endpoint, n] of counted("mmad_requests_total", (labels) => labels.endpoint)) {
    append(serving.requests, endpoint, [now, n / dt]);
  }
  append(serving.errors, "errors/s", [now, sum(counted("mmad_request_failures_total", () => "").values()) / dt]);
  for (const histogram of ["queue", "compute"]) {
    const le = (labels) => (labels.le === "+Inf" ? Infinity : Number(labels.le));
    const buckets = counted(`mmad_${histogram}_seconds_bucket`, le);
    for (const q of [0.5, 0.99]) {
      const seconds = quantile(q, buckets);
      append(serving.latency, `${histogram} p${q * 100}`, [now, seconds === null ? null : seconds * 1000]);
    }
  }
  const xRange = [Math.max(now - SERVING_WINDOW_S, serving.start), now];
  const xText = (t) => (t >= now - 0.5 ? "now" : `−${Math.round(now - t)} s`);
  const lines = (series) => [...series].map(([label, points], i) => ({label, points, color: COLOURS[i % 4]}));
  plot($("latency-chart"), lines(serving.latency), {log: true, xRange, xText});
  plot($("requests-chart"), lines(serving.requests), {fromZero: true, xRange, xText});
  plot($("errors-chart"), lines(serving.errors).map((line) => ({...line, color: "#dc2626"})),
    {fromZero: true, xRange, xText});
}

function showError(err) {
  $("error").textContent = `The daemon did not answer: ${err.message}`;
  $("error").hidden = false;
}

async function poll() {
  try {
    await Promise.all([showModels(), showJobs(), showServing()]);
    $("error").hidden = true;
  } catch (err) {
    showError(err);
  }
  setTimeout(poll, POLL_MS);
}

async function start() {
  try {
    const meta = await api("v2");
    $("server").textContent = `version ${meta.version}`;
    await showDevices();
  } catch (err) {
    showError(err);
  }
  poll();
}

start();
