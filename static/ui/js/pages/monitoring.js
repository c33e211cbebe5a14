// Monitoring: configure what /v1 generations record, live top features from
// monitoring:activation events, statistics (top by a metric), history grouped by request.

import { del, get, labelsOf, post } from "../api.js";
import { $, badge, boot, busy, el, fillRows, fmtTime, notice, showError } from "../dom.js";
import * as events from "../events.js";

boot();

const WINDOW = 20;
const recent = [];     // top_k lists of the last WINDOW generations
let selectedRequest = null;
let history = [];

const fmt = (v, d = 3) => (v === null || v === undefined ? "—" : Number(v).toFixed(d));

/** One bar per item; `digits` for the figure beside it (0 for counts). */
function bars(list, items, valueOf, labels = {}, digits = 2) {
  const max = Math.max(1e-9, ...items.map(valueOf));
  list.replaceChildren(...items.map((it) => {
    const index = it.feature_index ?? it.feature_idx;
    return el("li", { dataset: { feature: index } },
      el("span", { class: "mono" }, `#${index}`),
      el("span", { class: "small muted feature-label" }, labels[String(index)] || ""),
      el("span", { "aria-hidden": "true" }, el("span", { class: "bar", style: `display:block; width:${(100 * valueOf(it) / max).toFixed(1)}%` })),
      el("span", { class: "num small" }, fmt(valueOf(it), digits)));
  }));
}

function noteCount(state) {
  $("#h-note").textContent = `${state.history_count} record(s) kept (at most ${state.history_size})`;
}

/** Only the count of kept records: a live event must not reset the configuration form. */
async function loadCount() {
  try { noteCount(await get("/api/monitoring")); } catch { /* the next full read shows it */ }
}

async function loadState() {
  try {
    const [state, atts] = await Promise.all([get("/api/monitoring"), get("/api/saes/attachments")]);
    $("#mon-state").replaceChildren(state.enabled ? badge("recording", "ok") : badge("off"));
    $("#m-enabled").checked = state.enabled;
    const sel = $("#m-target");
    sel.replaceChildren(...(atts.entries.length
      ? atts.entries.map((a) => el("option", { value: `${a.sae_id}@${a.layer}` }, `${a.sae_id} @ layer ${a.layer}`))
      : [el("option", { value: "" }, "no SAE attached")]));
    if (state.sae_id) sel.value = `${state.sae_id}@${state.layer}`;
    $("#m-features").value = (state.monitored_features || []).join(", ");
    $("#m-topk").value = state.top_k;
    $("#m-history").value = state.history_size;
    $("#m-positions").value = state.positions;
    noteCount(state);
  } catch (err) { showError(err, "Monitoring"); }
}

async function loadStats() {
  try {
    const top = await post("/api/monitoring/statistics/top", { k: Number($("#s-k").value) || 15, metric: $("#s-metric").value });
    $("#s-note").textContent = `${top.total_activations} record(s)${top.since ? " since " + fmtTime(top.since) : ""}; top ${top.k} by ${top.metric}`;
    fillRows($("#stats"), top.features.map((f) => el("tr", {},
      el("td", { class: "num mono" }, f.feature_idx), el("td", { class: "num" }, f.count),
      el("td", { class: "num" }, fmt(f.mean)), el("td", { class: "num" }, fmt(f.std)),
      el("td", { class: "num" }, fmt(f.max)), el("td", { class: "num" }, f.active_ratio === null ? "—" : `${(100 * f.active_ratio).toFixed(0)}%`))),
    "Nothing recorded yet.", 6);
  } catch (err) { showError(err, "Statistics"); }
}

async function loadHistory() {
  try {
    history = (await get("/api/monitoring/history?limit=500")).records;
  } catch (err) { showError(err, "History"); return; }
  if (!recent.length && history.length) {
    const last = history[0];
    $("#live-note").textContent = `Latest recorded: ${fmtTime(last.timestamp)} · request ${String(last.request_id).slice(0, 24)} · position ${last.token_position}`;
    const labels = await labelsOf(last.sae_id);
    if (!recent.length) {
      bars($("#live-top"), (last.top_k || []).slice().sort((a, b) => b.activation - a.activation), (t) => t.activation, labels);
    }
  }
  const byRequest = new Map();
  for (const r of history) {
    if (!byRequest.has(r.request_id)) byRequest.set(r.request_id, []);
    byRequest.get(r.request_id).push(r);
  }
  const list = $("#requests");
  list.replaceChildren(...[...byRequest.entries()].map(([id, rows]) => el("li", {},
    el("button", { type: "button", class: `secondary small${id === selectedRequest ? " selected" : ""}`, style: "width:100%; text-align:left",
      "aria-pressed": id === selectedRequest ? "true" : "false",
      onclick: () => { selectedRequest = id; loadHistory(); } },
    `${fmtTime(rows[0].timestamp)} · ${id.slice(0, 22)} · ${rows.length} record(s)`))));
  if (!byRequest.size) list.replaceChildren(el("li", { class: "empty" }, "No history yet: enable recording and send a /v1 request."));
  if (!selectedRequest && byRequest.size) selectedRequest = [...byRequest.keys()][0];
  const rows = (byRequest.get(selectedRequest) || []).slice().sort((a, b) => a.token_position - b.token_position);
  $("#records-caption").textContent = selectedRequest ? `Request ${selectedRequest} (SAE ${rows[0]?.sae_id ?? "?"} @ layer ${rows[0]?.layer ?? "?"})` : "Choose a request";
  const pairs = (list) => (list || []).map((p) => `#${p.feature_index} ${fmt(p.activation, 2)}`).join(" · ");
  fillRows($("#records"), rows.map((r) => el("tr", {},
    el("td", { class: "num" }, r.token_position), el("td", { class: "num" }, r.completion_token_index ?? "—"),
    el("td", { class: "small mono" }, pairs(r.top_k)), el("td", { class: "small mono" }, pairs(r.activations)))),
  "No records for this request.", 4);
}

async function onActivation(data) {
  $("#live-note").textContent = `${fmtTime(data.timestamp)} · request ${String(data.request_id).slice(0, 24)} · ${data.records} record(s) · position ${data.token_position}`;
  const top = (data.top_k || []).slice().sort((a, b) => b.activation - a.activation);
  recent.push(top);
  const labels = await labelsOf(data.sae_id);
  bars($("#live-top"), top, (t) => t.activation, labels);
  while (recent.length > WINDOW) recent.shift();
  const counts = new Map();
  for (const list of recent) for (const t of list) counts.set(t.feature_index, (counts.get(t.feature_index) || 0) + 1);
  $("#window-n").textContent = recent.length;
  bars($("#live-freq"), [...counts.entries()].sort((a, b) => b[1] - a[1]).slice(0, 8).map(([feature_index, n]) => ({ feature_index, n })),
    (t) => t.n, labels, 0);
  refreshSoon();
}

let timer = null;
function refreshSoon() { clearTimeout(timer); timer = setTimeout(() => { loadStats(); loadHistory(); loadCount(); }, 500); }

$("#config-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("#m-features").value.trim();
  const features = text ? text.split(/[\s,]+/).filter(Boolean).map(Number) : null;
  if (features && features.some((f) => !Number.isInteger(f) || f < 0)) { notice("Features must be indices (0, 1, 2…)", "error"); return; }
  const [sae_id, layer] = ($("#m-target").value || "@").split("@");
  busy($("#m-save"), async () => {
    await post("/api/monitoring/configure", {
      enabled: $("#m-enabled").checked, features, top_k: Number($("#m-topk").value),
      history_size: Number($("#m-history").value), positions: $("#m-positions").value,
      ...(sae_id ? { sae_id, layer: Number(layer) } : {}) });
    notice("Monitoring configured", "ok");
    await loadState();
  }, "Configure");
});
$("#m-enabled").addEventListener("change", (ev) => busy(null, async () => {
  await post("/api/monitoring/enable", { enabled: ev.target.checked });
  await loadState();
}, "Enable"));
$("#s-metric").addEventListener("change", loadStats);
$("#s-k").addEventListener("change", loadStats);
$("#s-reset").addEventListener("click", (ev) => busy(ev.currentTarget, async () => { await del("/api/monitoring/statistics"); await loadStats(); }, "Reset"));
$("#h-clear").addEventListener("click", (ev) => busy(ev.currentTarget, async () => {
  if (!window.confirm("Clear the whole activation history?")) return;
  await del("/api/monitoring/history");
  selectedRequest = null;
  await Promise.all([loadHistory(), loadState(), loadStats()]);
}, "Clear"));

events.on("monitoring:activation", onActivation);
events.on("monitoring:state", loadState);
events.on("sae:attached", loadState);
events.on("sae:detached", loadState);
events.onReconnect(() => { loadState(); loadStats(); loadHistory(); });
loadState();
loadStats();
loadHistory();
