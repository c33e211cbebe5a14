// Dashboard: resident model, attachments per layer, queue, tokens/s, recent events.
// Events trigger a re-read of the state they change. The figures come from the
// system:metrics events the server pushes on the open socket; /api/health/metrics is
// polled only while the socket is not open, or when it has been open a while without
// one (the push is off: METRICS_PUSH_INTERVAL_S=0).

import { get } from "../api.js";
import { $, badge, boot, el, fillRows, fmtNumber, showError, statusBadge } from "../dom.js";
import * as events from "../events.js";

boot();

const MAX_EVENTS = 60;
const RATE_WINDOW_MS = 10000;
const POLL_MS = 2000;
const PUSH_SILENCE_MS = 10000; // open, but no system:metrics for this long: poll
const samples = [];          // [time ms, tokens_generated]
let lastMetricsEvent = 0;
let modelCache = { id: null, data: null };
let steeringByKey = new Map();
let lastTokens = null;       // tokens_generated of the last figures seen

function set(id, value) { $(`#${id}`).textContent = value; }

async function refreshHealth() {
  let detailed;
  try {
    detailed = await get("/api/health/detailed");
  } catch (err) {
    showError(err, "Health");
    return;
  }
  $("#health-status").replaceChildren(statusBadge(detailed.status === "healthy" ? "ready" : detailed.status));
  fillRows($("#components"), detailed.components.map((c) => el("tr", {},
    el("td", {}, c.name.replaceAll("_", " ")),
    el("td", {}, badge(c.status, c.status === "healthy" ? "ok" : c.status === "degraded" ? "warn" : "bad"),
      " ", el("span", { class: "small muted" }, c.message || c.backend || c.vendor || "")))), "—", 2);
  set("model-device", detailed.model_loaded ? `${detailed.device || "?"} · ${detailed.dtype || "?"}` : "—");
  set("model-backend", detailed.inference?.backend
    ? `${detailed.inference.backend}${detailed.inference.continuous_batching ? " · batching" : " · serial"}` : "—");
  queueFigures(detailed.inference || {});
  await modelFigures(detailed);
  await attachments(detailed.attachments || []);
}

async function modelFigures(detailed) {
  const id = detailed.model_id;
  if (!detailed.model_loaded || id === null) {
    set("model-name", "none");
    set("model-arch", "—");
    set("model-layers", "—");
    $("#model-status").replaceChildren(badge("no model", "warn"));
    $("#model-note").replaceChildren("No model is resident. ", el("a", { href: "/models/" }, "Load one"),
      " (or send a /v1 request naming a registered model).");
    return;
  }
  if (modelCache.id !== id) {
    try { modelCache = { id, data: await get(`/api/models/${id}`) }; } catch { modelCache = { id, data: null }; }
  }
  const m = modelCache.data;
  set("model-name", detailed.model_name || (m && m.name) || String(id));
  set("model-arch", m?.architecture || "—");
  set("model-layers", m?.num_layers ?? "—");
  $("#model-status").replaceChildren(statusBadge("loaded"), m?.locked ? " " : "", m?.locked ? badge("locked", "accent") : "");
  const lease = detailed.lease ? ` · leased by ${detailed.lease.holder} until ${new Date(detailed.lease.expires_at).toLocaleTimeString()}` : "";
  $("#model-note").textContent = (m ? `${m.params || ""} parameters · hidden size ${m.hidden_size ?? "?"} · context ${fmtNumber(m.context_length)}` : "") + lease;
}

async function attachments(rows) {
  steeringByKey = new Map();
  await Promise.all(rows.map(async (a) => {
    try {
      const q = `sae_id=${encodeURIComponent(a.sae_id)}&layer=${a.layer}`;
      steeringByKey.set(`${a.sae_id}@${a.layer}`, await get(`/api/saes/steering?${q}`));
    } catch { /* shown as unknown */ }
  }));
  const sorted = rows.slice().sort((a, b) => a.layer - b.layer);
  fillRows($("#attachments"), sorted.map((a) => {
    const s = steeringByKey.get(`${a.sae_id}@${a.layer}`);
    return el("tr", {},
      el("td", { class: "mono" }, a.layer),
      el("td", { class: "mono" }, a.sae_id),
      el("td", { class: "mono small" }, badge(a.hook_point || "resid_post", "accent"), " ", a.layer_module_path),
      el("td", {}, s ? (s.enabled ? badge(`on · ${s.active_count ?? Object.keys(s.values || {}).length} features`, "ok") : badge("off")) : badge("—")),
      el("td", { class: "num" }, fmtNumber(a.steering_apply_count)));
  }), "No SAE attached.", 5);
}

function queueFigures(q) {
  set("q-inflight", fmtNumber(q.in_flight));
  set("q-waiting", fmtNumber(q.waiting));
  set("q-slots", q.slots !== undefined ? `${q.slots} · ${q.max_pending}` : "—");
  set("q-wait", q.estimated_wait_seconds === null || q.estimated_wait_seconds === undefined
    ? "—" : `${Number(q.estimated_wait_seconds).toFixed(1)} s`);
  set("q-refused", fmtNumber(q.refused_total));
}

function tokenFigures(total) {
  const now = Date.now();
  samples.push([now, total]);
  while (samples.length > 2 && now - samples[0][0] > RATE_WINDOW_MS) samples.shift();
  set("tok-total", fmtNumber(total));
  if (samples.length >= 2) {
    const [t0, n0] = samples[0];
    const rate = (total - n0) / Math.max(0.001, (now - t0) / 1000);
    set("tok-rate", rate > 0 ? rate.toFixed(1) : "0");
  }
}

function metricsFigures(m) {
  if (m.queue) queueFigures(m.queue);
  if (m.tokens_generated !== undefined) {
    tokenFigures(m.tokens_generated);
    // something was generated: the attachments' steered-pass counts moved with it
    if (lastTokens !== null && m.tokens_generated !== lastTokens) refreshSoon();
    lastTokens = m.tokens_generated;
  }
  if (m.requests) {
    // the counter has every HTTP request (pages, static files, the admin); only its
    // surface split says which were /v1 — errors have no such split, so they are labelled
    // as counting every route
    set("req-v1", fmtNumber(m.requests.by_surface?.v1 ?? 0));
    set("req-errors", fmtNumber(m.requests.errors));
  }
}

function pushing() {
  const since = events.openSince();
  return since !== null && Date.now() - Math.max(since, lastMetricsEvent) < PUSH_SILENCE_MS;
}

async function pollMetrics() {
  if (pushing() || document.hidden) return;
  try { metricsFigures(await get("/api/health/metrics")); } catch { /* shown by health */ }
}

function logEvent(data, name) {
  if (name === "system:metrics" || name === "monitoring:activation") return; // too chatty
  const list = $("#event-log");
  $("#events-empty").classList.add("hidden");
  const summary = Object.entries(data)
    .filter(([, v]) => v !== null && typeof v !== "object")
    .map(([k, v]) => `${k}=${v}`).join(" ");
  list.prepend(el("li", {},
    el("time", { datetime: new Date().toISOString() }, new Date().toLocaleTimeString()),
    el("span", { class: "name" }, name),
    el("span", { class: "data", title: summary }, summary)));
  while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
}

let refreshTimer = null;
function refreshSoon() {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refreshHealth, 250);
}

events.on("*", logEvent);
events.on("model:", (data, name) => {
  if (name.endsWith(":progress")) return;
  refreshSoon();
});
events.on("model:load:progress", (data) => {
  $("#model-status").replaceChildren(badge(`loading ${data.percent ?? data.progress ?? 0}%`, "warn"));
});
events.on("sae:attached", refreshSoon);
events.on("sae:detached", refreshSoon);
events.on("steering:update", refreshSoon);
events.on("system:metrics", (data) => { lastMetricsEvent = Date.now(); metricsFigures(data); });
events.onReconnect(refreshHealth);

refreshHealth();
pollMetrics();
setInterval(pollMetrics, POLL_MS);
setInterval(() => { if (!document.hidden) refreshHealth(); }, 15000);
