// The monitor's page: one server-sent event per reading (/api/events), drawn into the page.
// Every number shown keeps its exact value in data-value; the text is for people.
"use strict";

const JOB = decodeURIComponent((location.pathname.match(/^\/jobs\/([^/]+)/) || [])[1] || "");
const Q = JOB ? "?job=" + encodeURIComponent(JOB) : "";

function byPath(data, path) {
  return path.split(".").reduce((value, key) => (value == null ? undefined : value[key]), data);
}

function count(n) {
  return n == null ? "–" : Number(n).toLocaleString("en-US");
}

function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let value = Number(n), unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return (unit ? value.toFixed(value < 10 ? 2 : 1) : String(value)) + " " + units[unit];
}

function duration(s) {
  if (s == null) return "–";
  if (s < 10) return (Math.round(s * 10) / 10) + "s";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (h) return h + "h" + String(m).padStart(2, "0") + "m";
  return m ? m + "m" + String(sec).padStart(2, "0") + "s" : sec + "s";
}

function clock(t) {
  if (t == null) return "–";
  const d = new Date(t * 1000);
  const sameDay = d.toDateString() === new Date().toDateString();
  return (sameDay ? "" : d.toLocaleDateString() + " ") + d.toLocaleTimeString();
}

function rate(n, digits) {
  return n == null ? "–" : Number(n).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function text(path, value) {
  if (value == null) return "–";
  if (path.endsWith("_s") && (path === "eta_s" || path === "elapsed_s")) return duration(value);
  if (path === "projected_end" || path === "finished_at") return clock(value);
  if (path.includes("bytes")) return bytes(value);
  if (path.startsWith("rates.")) return rate(value, path.includes("tokens") ? 0 : 2);
  if (path === "progress.percent") return rate(value, 1);
  if (Array.isArray(value)) return value.join(", ");
  if (typeof value === "number") return count(value);
  return String(value);
}

function fields(data) {
  for (const el of document.querySelectorAll("[data-field]")) {
    const path = el.dataset.field;
    const value = byPath(data, path);
    el.dataset.value = value == null ? "" : Array.isArray(value) ? value.join(",") : String(value);
    el.textContent = text(path, value);
  }
}

function cell(row, value, cls, title) {
  const td = row.insertCell();
  td.textContent = value;
  if (cls) td.className = cls;
  if (title) td.title = title;
  return td;
}

function workers(data) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren();
  for (const w of data.workers) {
    const row = body.insertRow();
    row.dataset.instance = w.instance;
    row.dataset.state = w.state;
    row.className = w.silent ? "silent" : w.degraded ? "degraded" : "";
    cell(row, w.instance, "", w.service);
    cell(row, w.node);
    cell(row, w.device || (w.service === "uploader" ? "uploader" : "–"));
    cell(row, w.state + (w.silent ? " (was " + w.last_state + ")" : ""), "state", w.detail || "");
    cell(row, w.kernels || "–");
    cell(row, w.compiled == null ? "–" : w.compiled ? "yes" : "no");
    cell(row, w.samples_per_s == null ? "–" : rate(w.samples_per_s, 2), "num");
    cell(row, w.in_hand == null ? "–" : count(w.in_hand), "num", w.service === "uploader" ? "files" : "batches");
    cell(row, w.busy == null ? "–" : Math.round(100 * w.busy) + "%", "num", "share of wall time in the forward");
    cell(row, w.gpu_utilization == null ? "–" : Math.round(w.gpu_utilization) + "%", "num");
    cell(row, w.gpu_memory_used == null ? "–" : bytes(w.gpu_memory_used) + " / " + bytes(w.gpu_memory_total), "num");
    cell(row, duration(w.heartbeat_age_s) + " ago", "num");
  }
  const silent = data.workers.filter((w) => w.silent).length;
  const degraded = data.workers.filter((w) => w.degraded).length;
  document.getElementById("workers-count").textContent =
    data.workers.length + " shown" + (silent ? ", " + silent + " silent" : "") + (degraded ? ", " + degraded + " degraded" : "");
}

function nodes(data) {
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren();
  for (const n of data.nodes) {
    const row = body.insertRow();
    row.dataset.node = n.node;
    const full = n.high_water_bytes != null && n.spool_bytes != null && n.spool_bytes >= n.high_water_bytes;
    cell(row, n.node);
    cell(row, count(n.spool_files), "num");
    cell(row, bytes(n.spool_bytes), "num" + (full ? " bad" : ""));
    cell(row, bytes(n.high_water_bytes), "num");
    cell(row, bytes(n.free_bytes), "num");
    cell(row, count(n.files_waiting), "num");
  }
}

function dead(data) {
  const list = document.getElementById("dead-errors");
  list.replaceChildren();
  for (const e of data.dead.errors) {
    const li = document.createElement("li");
    li.textContent = e.letters + " × " + e.error;
    list.appendChild(li);
  }
  const indices = data.dead.sample_indices;
  document.getElementById("dead-indices").textContent = indices.length
    ? "(samples " + indices.join(", ") + (data.dead.samples > indices.length ? ", …" : "") + ")" : "";
  document.getElementById("dead-retry").hidden = !data.dead.retry;
  document.getElementById("dead-section").classList.toggle("alarm", data.dead.letters > 0);
}

function room(data) {
  const d = data.destination;
  let said = d.projected_bytes == null ? "not known before the first batch is written" : bytes(d.projected_bytes);
  if (d.still_to_store_bytes != null) said += ", " + bytes(d.still_to_store_bytes) + " still to store";
  if (d.free_bytes != null) said += "; destination has " + bytes(d.free_bytes) + " free" + (d.fits === false ? ": NOT ENOUGH" : "");
  else said += "; the destination's free space is not known (object store)";
  const el = document.getElementById("room");
  el.textContent = said;
  el.className = d.fits === false ? "bad" : "";
}

const SVG = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, parent) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

// One plot: rows of [time, ...values], two series (columns) drawn as lines over time.
function plot(svg, rows, series, label, digits) {
  const width = svg.clientWidth || 560, height = svg.clientHeight || 200;
  const left = 64, right = 12, top = 22, bottom = 26;
  svg.setAttribute("viewBox", "0 0 " + width + " " + height);
  svg.replaceChildren();
  svgEl("text", { x: left, y: 14, class: "plot-title" }, svg).textContent = label;
  let lx = left + 150;
  for (const s of series) {
    svgEl("line", { x1: lx, x2: lx + 18, y1: 10, y2: 10, class: "line " + s.cls }, svg);
    svgEl("text", { x: lx + 22, y: 14, class: "legend" }, svg).textContent = s.name;
    lx += 110;
  }
  if (rows.length < 2) {
    svgEl("text", { x: left, y: height / 2, class: "legend" }, svg).textContent = "a rate needs two readings";
    return;
  }
  const t0 = rows[0][0], t1 = rows[rows.length - 1][0];
  let ymax = 0;
  for (const r of rows) for (const s of series) ymax = Math.max(ymax, r[s.col]);
  ymax = ymax > 0 ? ymax * 1.1 : 1;
  const x = (t) => left + ((t - t0) / Math.max(1e-9, t1 - t0)) * (width - left - right);
  const y = (v) => top + (1 - v / ymax) * (height - top - bottom);
  for (let i = 0; i <= 4; i++) {
    const v = (ymax * i) / 4;
    svgEl("line", { x1: left, x2: width - right, y1: y(v), y2: y(v), class: "grid-line" }, svg);
    svgEl("text", { x: left - 6, y: y(v) + 4, class: "tick", "text-anchor": "end" }, svg).textContent = rate(v, digits);
  }
  const anchors = ["start", "middle", "end"];
  [t0, (t0 + t1) / 2, t1].forEach((t, i) => {
    const short = t1 - t0 < 600;  // a short span: its seconds tell the ticks apart
    const at = new Date(t * 1000).toLocaleTimeString([], short
      ? { hour: "2-digit", minute: "2-digit", second: "2-digit" } : { hour: "2-digit", minute: "2-digit" });
    svgEl("text", { x: x(t), y: height - 8, class: "tick", "text-anchor": anchors[i] }, svg).textContent = at;
  });
  for (const s of series) {
    const points = rows.map((r) => x(r[0]).toFixed(1) + "," + y(r[s.col]).toFixed(1)).join(" ");
    svgEl("polyline", { points, class: "line " + s.cls }, svg);
  }
}

function plots(data) {
  plot(document.getElementById("plot-samples"), data.history,
    [{ col: 1, name: "written", cls: "written" }, { col: 2, name: "uploaded", cls: "uploaded" }], "samples/s", 2);
  plot(document.getElementById("plot-tokens"), data.history,
    [{ col: 3, name: "written", cls: "written" }, { col: 4, name: "uploaded", cls: "uploaded" }], "tokens/s", 0);
}

function jobs(data) {
  const select = document.getElementById("jobs");
  const names = data.jobs.length ? data.jobs : [data.job];
  if (select.dataset.names === names.join(",")) return;
  select.dataset.names = names.join(",");
  select.replaceChildren();
  for (const name of names) {
    const option = document.createElement("option");
    option.value = name;
    option.textContent = name;
    option.selected = name === data.job;
    select.appendChild(option);
  }
}

function draw(data) {
  const began = performance.now();
  document.title = "hsx " + data.job + ": " + data.state + " " + data.progress.percent.toFixed(1) + "%";
  document.getElementById("job").textContent = data.job;
  const state = document.getElementById("state");
  state.className = "badge " + data.state.replace(/ /g, "-");
  fields(data);
  const p = data.progress;
  document.getElementById("bar-uploaded").style.width = (p.samples_total ? (100 * p.samples_uploaded) / p.samples_total : 0) + "%";
  document.getElementById("bar-written").style.width =
    (p.samples_total ? (100 * Math.max(0, p.samples_written - p.samples_uploaded)) / p.samples_total : 0) + "%";
  document.getElementById("updated").textContent = "as of " + clock(data.as_of);
  document.getElementById("ends").hidden = data.done;
  document.getElementById("ended").hidden = !data.done;
  document.getElementById("plan").textContent = p.plan_complete ? "all published"
    : "being published" + (p.rounds_published ? " (" + p.rounds_published + " rounds so far)" : "");
  document.getElementById("dest-error").hidden = !data.destination.error;
  workers(data);
  nodes(data);
  dead(data);
  room(data);
  plots(data);
  jobs(data);
  document.body.dataset.asOf = String(data.as_of);
  document.body.dataset.readings = String(Number(document.body.dataset.readings || 0) + 1);
  // For bench/web.py: how long a draw takes, and when the first one ended (since navigation).
  window.hsxDrawMs = performance.now() - began;
  if (window.hsxFirstDrawnAt === undefined) window.hsxFirstDrawnAt = performance.now();
}

function connect() {
  const events = new EventSource("/api/events" + Q);
  events.onmessage = (message) => {
    document.getElementById("connection").hidden = true;
    draw(JSON.parse(message.data));
  };
  events.onerror = () => { document.getElementById("connection").hidden = false; };
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("status-link").href = "/api/status" + Q;
  document.getElementById("jobs").addEventListener("change", (event) => {
    location.href = "/jobs/" + encodeURIComponent(event.target.value);
  });
  connect();
});
