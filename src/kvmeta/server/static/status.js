// kvmeta status page: polls /v1/status every 2 s and draws the tables and three SVG charts.
// No libraries; the browser's Basic credentials (any user, the token as password) are reused
// by fetch on the same origin.
"use strict";
const COLORS = ["#3b6fd8", "#e0562b", "#2e8540", "#9c27b0", "#f0a830", "#00838f", "#777"];
const WINDOW_SECONDS = 300;
// A poll every POLL_MS; one that has no answer after POLL_MS counts as the server gone (a
// stopped or wedged server accepts the connection and never answers: without a deadline the
// page would wait forever, showing its last numbers as if they were live).
const POLL_MS = 2000;
let updates = 0;
let lastAnswer = null; // Date of the last good answer
let downSince = null; // Date of the first failed poll of the current outage

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
const pct = (v) => (v === null || v === undefined ? "-" : (v * 100).toFixed(1) + "%");
const rate = (v) => (v === null || v === undefined ? "-" : v.toFixed(1));
const num = (v) => (v === null || v === undefined ? "-" : String(v));
function age(s) {
  if (s === null || s === undefined) return "-";
  return s < 120 ? s.toFixed(1) + " s ago" : (s / 60).toFixed(1) + " min ago";
}

function chart(id, legendId, t, series, fixedMax) {
  const svg = document.getElementById(id);
  const W = 360, H = 140, L = 34, B = 14, T = 6;
  const names = Object.keys(series);
  let max = fixedMax || 0;
  if (!fixedMax) for (const n of names) for (const v of series[n]) if (v !== null && v > max) max = v;
  if (max <= 0) max = 1;
  // A fixed window ending at the newest sample, so the lines grow in from the right.
  const t1 = t.length ? t[t.length - 1] : 0, span = WINDOW_SECONDS, t0 = t1 - span;
  const x = (tv) => L + ((tv - t0) / span) * (W - L - 4);
  const y = (v) => T + (1 - v / max) * (H - T - B);
  let out = `<line class="axis" x1="${L}" y1="${H - B}" x2="${W}" y2="${H - B}"/>` +
    `<line class="axis" x1="${L}" y1="${T}" x2="${L}" y2="${H - B}"/>` +
    `<text x="2" y="${T + 8}">${+max.toPrecision(3)}</text><text x="2" y="${H - B}">0</text>` +
    `<text x="${L}" y="${H - 2}">-${Math.round(span)} s</text><text x="${W - 24}" y="${H - 2}">now</text>`;
  const legend = document.getElementById(legendId);
  legend.textContent = "";
  let points = 0;
  names.forEach((n, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = [];
    series[n].forEach((v, j) => { if (v !== null) pts.push(`${x(t[j]).toFixed(1)},${y(v).toFixed(1)}`); });
    points += pts.length;
    out += `<polyline stroke="${color}" points="${pts.join(" ")}"/>`;
    const item = el("span");
    const swatch = el("i");
    swatch.style.background = color;
    item.append(swatch, n);
    legend.append(item);
  });
  svg.innerHTML = out;
  svg.dataset.points = String(points);
}

function renderBackend(s) {
  const b = s.backend, srv = s.server;
  const rows = [
    ["backend", b.describe], ["ready", b.ready ? "yes" : "NO: " + (b.reason || "")],
    ["epoch", b.epoch], ["version", srv.version], ["auth / tls", (srv.auth ? "on" : "off") + " / " + (srv.tls ? "on" : "off")],
  ];
  if (b.data_dir !== null) {
    rows.push(["fsync mode", b.fsync], ["last fsync", b.last_fsync_seconds_ago === null ? "- (none seen yet)" : "within " + age(b.last_fsync_seconds_ago)],
      ["journal segment", b.journal_segment_bytes === null ? "-" : (b.journal_segment_bytes / 1024).toFixed(1) + " KiB"],
      ["snapshot age", age(b.snapshot_age_seconds)], ["journal failed", b.journal_failed ? "YES" : "no"]);
    if (b.durability && b.durability.reserve_waits !== undefined) {
      const waits = b.durability.reserve_waits, secs = b.durability.reserve_wait_seconds || 0;
      rows.push(["reserves that waited for the disk", waits]);
      rows.push(["mean reserve wait for the disk", waits ? (1000 * secs / waits).toFixed(2) + " ms" : "-"]);
    }
  }
  if (b.role !== null) rows.push(["role", b.role]);
  if (b.replicas !== null) rows.push(["replicas", num(b.replicas)]);
  const body = document.querySelector("#backend tbody");
  body.textContent = "";
  for (const [k, v] of rows) { const tr = el("tr"); tr.append(el("th", k), el("td", num(v))); body.append(tr); }
}

function renderPools(pools) {
  const body = document.querySelector("#pools tbody");
  body.textContent = "";
  document.getElementById("pool-count").textContent = "(" + pools.length + ")";
  for (const p of pools) {
    const tr = el("tr");
    tr.dataset.pool = `${p.dialect}/${p.rank}/${p.namespace}`;
    const n = p.num_pages || 1;
    const bar = el("span", undefined, "bar");
    const stored = el("b"), held = el("s");
    stored.style.width = (100 * p.stored / n) + "%";
    held.style.left = stored.style.width;
    held.style.width = (100 * p.reserved / n) + "%";
    bar.append(stored, held);
    const occ = el("td");
    occ.append(bar, " " + (p.occupancy * 100).toFixed(1) + "%");
    occ.dataset.field = "occupancy";
    tr.append(el("td", p.tenant ? p.tenant : "-"), el("td", p.dialect === "v" ? "vllm" : "sglang"),
      el("td", String(p.rank)), el("td", p.namespace));
    for (const f of ["num_pages", "free", "cooling", "reserved", "stored"]) {
      const td = el("td", String(p[f]), "n");
      td.dataset.field = f;
      tr.append(td);
    }
    tr.append(occ);
    for (const [f, v] of [["hit_rate", pct(p.hit_rate)], ["exists_hit_rate", pct(p.exists_hit_rate)],
      ["evictions_per_s", rate(p.evictions_per_s)], ["refused_per_s", rate(p.refused_per_s)]]) {
      const td = el("td", v, "n");
      td.dataset.field = f;
      tr.append(td);
    }
    body.append(tr);
  }
}

const clock = (d) => d.toLocaleTimeString([], { hour12: false });

// The server is not answering (refused, timed out, or a 5xx): say so at the top and grey the
// numbers, keeping them, so nobody reads the last values as current.
function showDown(reason) {
  if (downSince === null) downSince = new Date();
  const banner = document.getElementById("disconnected");
  banner.textContent = `disconnected since ${clock(downSince)}: ${reason}` +
    (lastAnswer ? ` · numbers below are from ${clock(lastAnswer)}` : "") +
    ` · retrying every ${POLL_MS / 1000} s`;
  banner.hidden = false;
  document.body.classList.add("stale");
  const state = document.getElementById("state");
  state.textContent = "DISCONNECTED";
  state.className = "badge bad";
}

function showUp() {
  downSince = null;
  lastAnswer = new Date();
  document.getElementById("disconnected").hidden = true;
  document.body.classList.remove("stale");
}

// Why a request failed, in words: fetch reports a refused connection only as a TypeError.
function why(e) {
  if (e.name === "TimeoutError" || e.name === "AbortError") return `no answer within ${POLL_MS / 1000} s`;
  if (e.name === "TypeError") return "cannot reach the server";
  return String(e.message || e);
}

async function poll() {
  const error = document.getElementById("error");
  let r, body;
  try {
    // An absolute URL without user:password: a page opened as http://user:token@host/ui
    // would otherwise resolve "/v1/status" with the credentials in it, which fetch refuses;
    // the browser still sends the Basic credentials it signed in with.
    const url = location.protocol + "//" + location.host + "/v1/status";
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(new DOMException("timed out", "TimeoutError")), POLL_MS);
    try {
      r = await fetch(url, { cache: "no-store", credentials: "same-origin", signal: ctl.signal });
      if (r.status >= 500) {
        const text = (await r.text()).slice(0, 200);
        throw new Error(`/v1/status answered ${r.status}${text ? ": " + text : ""}`);
      }
      body = r.ok ? await r.json() : await r.text();
    } finally {
      clearTimeout(timer);
    }
  } catch (e) {
    showDown(why(e));
    return;
  }
  // The server answered: it is there, whatever it said.
  showUp();
  try {
    if (!r.ok) throw new Error("/v1/status answered " + r.status + ": " + body);
    const s = body;
    const srv = s.server;
    document.getElementById("server-line").textContent =
      `${srv.version} · ${s.backend.describe} · up ${Math.round(s.uptime_seconds)} s`;
    const state = document.getElementById("state");
    state.textContent = s.backend.ready ? "ready" : "NOT READY";
    state.className = "badge " + (s.backend.ready ? "ok" : "bad");
    renderBackend(s);
    renderPools(s.pools);
    const h = s.history;
    chart("chart-rps", "legend-rps", h.t, h.rps);
    chart("chart-latency", "legend-latency", h.t, { p50: h.p50_ms, p99: h.p99_ms });
    chart("chart-hits", "legend-hits", h.t, { get: h.hit_ratio, exists: h.exists_hit_ratio }, 1);
    document.body.dataset.samples = String(h.taken);
    document.body.dataset.updated = String(++updates);
    error.hidden = true;
  } catch (e) {
    // Answered, but not with the numbers (a 4xx: say the token is wrong): they are stale.
    document.body.classList.add("stale");
    error.textContent = String(e);
    error.hidden = false;
  }
}

// One poll at a time, every POLL_MS from the start of the last (a poll ends within POLL_MS).
async function loop() {
  const started = Date.now();
  await poll();
  setTimeout(loop, Math.max(0, POLL_MS - (Date.now() - started)));
}

loop();
