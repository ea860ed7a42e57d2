// The mmad dashboard: reads the daemon's public GET endpoints (and the repository index) once a
// second, and follows each running training job's Server-Sent Events for its loss curve.
// Paths are relative, so the page also works behind a proxy that serves the daemon under a prefix.
"use strict";

const POLL_MS = 1000;
const FINISHED = new Set(["done", "cancelled", "failed"]);
const $ = (id) => document.getElementById(id);
const jobs = new Map(); // job id -> {card, points: [[step, loss]], checkpoints: [step], source}
let lastCounts = null; // {time, rows: {model: inference_count}} of the previous poll, for rows/s

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
  const tbody = $("devices");
  tbody.replaceChildren();
  const chosen = `${report.selected.backend}:${report.selected.variant}`;
  for (const d of report.rows) {
    const name = `${d.backend}:${d.variant}`;
    row(tbody, [[name === chosen ? "▶" : ""], [name], [d.device || "–"],
      [d.available ? "yes" : `no: ${d.reason}`, d.available ? "ready" : "muted"], [d.software || ""]]);
  }
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

function watch(status) {
  const job = {card: jobCard(status), points: [], checkpoints: [], source: null};
  jobs.set(status.job, job);
  showStatus(job, status);
  const url = `v2/models/${encodeURIComponent(status.model_name)}/jobs/${status.job}/events`;
  job.source = new EventSource(url);
  job.source.addEventListener("progress", (e) => {
    const p = JSON.parse(e.data);
    if (p.loss !== null && p.loss > 0) job.points.push([p.step, p.loss]);
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
}

// The loss curve: step on x, loss on a log scale on y (losses fall by decades while training),
// versions written marked as ticks on the x axis.
function draw(job) {
  const canvas = job.card.querySelector("canvas");
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, L = 56, R = 10, T = 10, B = 24;
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, W, H);
  ctx.strokeStyle = "#c7ccd4";
  ctx.strokeRect(L, T, W - L - R, H - T - B);
  if (job.points.length < 2) return;
  const steps = job.points.map((p) => p[0]);
  const logs = job.points.map((p) => Math.log10(p[1]));
  const x0 = steps[0], x1 = Math.max(steps[steps.length - 1], x0 + 1);
  let y0 = Math.min(...logs), y1 = Math.max(...logs);
  if (y1 - y0 < 1e-6) { y0 -= 0.5; y1 += 0.5; }
  const X = (s) => L + (s - x0) / (x1 - x0) * (W - L - R);
  const Y = (v) => T + (y1 - v) / (y1 - y0) * (H - T - B);
  ctx.fillStyle = "#6b7280";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(fmt(10 ** y1), 4, T + 10);
  ctx.fillText(fmt(10 ** y0), 4, H - B);
  ctx.fillText(`step ${x0}`, L, H - 8);
  const last = `step ${steps[steps.length - 1]}`;
  ctx.fillText(last, W - R - ctx.measureText(last).width, H - 8);
  ctx.strokeStyle = "#9aa3b2";
  for (const s of job.checkpoints) {
    if (s < x0) continue;
    ctx.beginPath();
    ctx.moveTo(X(s), H - B);
    ctx.lineTo(X(s), H - B - 6);
    ctx.stroke();
  }
  ctx.strokeStyle = "#2563eb";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  job.points.forEach(([s], i) => (i ? ctx.lineTo(X(s), Y(logs[i])) : ctx.moveTo(X(s), Y(logs[i]))));
  ctx.stroke();
  ctx.lineWidth = 1;
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

async function poll() {
  try {
    await Promise.all([showModels(), showJobs()]);
    $("error").hidden = true;
  } catch (err) {
    $("error").textContent = `The daemon did not answer: ${err.message}`;
    $("error").hidden = false;
  }
  setTimeout(poll, POLL_MS);
}

async function start() {
  try {
    const meta = await api("v2");
    $("server").textContent = `version ${meta.version}`;
    await showDevices();
  } catch (err) {
    $("error").textContent = `The daemon did not answer: ${err.message}`;
    $("error").hidden = false;
  }
  poll();
}

start();
