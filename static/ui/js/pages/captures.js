// Captures: the stored /api/captures list (delete with confirmation), a form that sends one
// prompt with `capture` through /v1 (an inline answer is shown without being stored); a
// chosen capture's sidecar, its per-layer hidden-state norms (an SVG plot and a table)
// and, when it holds Q/K, the attention of one layer and head as a token-by-token heat
// map. Everything is computed here from the downloaded safetensors file
// (static/ui/js/safetensors.js), so the page shows exactly what the file holds; every
// value is also in the DOM (data-norm, data-value) at full precision.

import { del, get, getBytes, post } from "../api.js";
import { attentionMap, layerNorms, sequenceTokens } from "../capture.js";
import { $, boot, busy, el, fillRows, fmtBytes, fmtDateTime, notice, numberFrom, showError } from "../dom.js";
import * as events from "../events.js";
import { parseSafetensors } from "../safetensors.js";
import { engineNote, loadedModels } from "../loaded.js";

boot();

const SVG = "http://www.w3.org/2000/svg";
// A heat map this many rows/columns wide is still readable; beyond it the page shows the
// last rows and keys (the note says so) rather than a table nobody can scroll.
const MAX_MAP = 160;
// Faint per-token lines only while they stay lines, not a grey block.
const MAX_TOKEN_LINES = 200;

let captures = [];
let selected = null;   // {id, detail, tensors, norms}
let loading = 0;       // the latest load wins when rows are clicked quickly

const shortHash = (h) => (h ? `${h.slice(0, 12)}…` : "—");

async function refresh() {
  try {
    const data = await get("/api/captures?limit=200");
    captures = data.captures;
    $("#captures-total").textContent = `${data.total} stored`;
    render();
    if (selected && !selected.inline && !captures.some((c) => c.id === selected.id)) clearDetail();
  } catch (err) { showError(err, "Captures"); }
}

function render() {
  fillRows($("#captures"), captures.map((c) => {
    const act = (label, fn, cls = "secondary small") => el("button", { type: "button", class: cls,
      "aria-label": `${label} capture ${c.id}`, onclick: (ev) => busy(ev.currentTarget, fn, `${label} ${c.id}`) }, label);
    return el("tr", { dataset: { captureId: c.id }, class: selected && selected.id === c.id ? "selected" : null },
      el("td", { class: "small" }, fmtDateTime(c.created_at)),
      el("td", { class: "mono small", title: c.id }, c.id.slice(0, 12)),
      el("td", { class: "mono small", title: c.request_id }, c.request_id),
      el("td", { class: "small" }, c.model, el("div", { class: "muted small" }, `${c.backend} · ${c.dtype}`)),
      el("td", { class: "mono small" }, (c.layers || []).join(", ") || "—"),
      el("td", { class: "small" }, c.positions),
      el("td", { class: "num" }, c.rows),
      el("td", { class: "num", dataset: { bytes: c.bytes } }, fmtBytes(c.bytes)),
      el("td", { class: "mono small", title: c.steering_hash || "unsteered" }, shortHash(c.steering_hash)),
      el("td", {}, el("div", { class: "actions" },
        act("Open", () => open(c.id), "small"),
        el("a", { class: "small", href: c.url, download: `${c.id}.safetensors`,
          "aria-label": `Download capture ${c.id}` }, "Download"),
        act("Delete", () => remove(c), "danger small"))));
  }), "No stored captures: send a /v1 request with capture (see above).", 10);
}

async function remove(c) {
  if (!window.confirm(`Delete capture ${c.id} (request ${c.request_id}) and its files?`)) return;
  await del(`/api/captures/${c.id}`);
  notice(`Deleted capture ${c.id}`, "ok");
  if (selected && selected.id === c.id) clearDetail();
  await refresh();
}

function clearDetail() {
  selected = null;
  $("#detail").classList.add("hidden");
  render();
}

/** Show a capture: a stored one by id, or an inline one from a /v1 answer ({detail, bytes}). */
async function open(id, inline = null) {
  const mine = ++loading;
  $("#detail").classList.remove("hidden");
  $("#detail").dataset.state = "loading";
  $("#detail-id").textContent = inline ? `${id} (inline, not stored)` : id;
  $("#detail-note").textContent = "Downloading the artifact…";
  let detail; let tensors;
  try {
    const [d, bytes] = inline ? [inline.detail, inline.bytes]
      : await Promise.all([get(`/api/captures/${id}`), getBytes(`/api/captures/${id}/download`)]);
    detail = d;
    ({ tensors } = parseSafetensors(bytes));
  } catch (err) {
    if (mine === loading) { $("#detail-note").textContent = "Could not read this capture."; $("#detail").dataset.state = "error"; }
    throw err;
  }
  if (mine !== loading) return;
  selected = { id, detail, tensors, meta: detail.metadata, norms: layerNorms(tensors), inline: Boolean(inline) };
  render();
  showDetail();
  $("#detail").dataset.state = "ready";
  $("#detail").dataset.captureId = id;
}

function showDetail() {
  const { detail, meta, tensors, inline } = selected;
  // an inline capture lives in this page only: it has no row to keep or expire
  const kept = inline ? " · not stored: gone on reload"
    : detail.expires_at ? ` · expires ${fmtDateTime(detail.expires_at)}` : " · kept until deleted";
  $("#detail-note").textContent = `${fmtBytes(detail.bytes)} · ${Object.keys(tensors).length} tensors · created ${fmtDateTime(detail.created_at)}${kept}`;
  const fig = (label, value, cls = "small") => el("div", {}, el("dt", {}, label), el("dd", { class: cls }, value ?? "—"));
  const att = meta.attention;
  $("#detail-figures").replaceChildren(
    fig("Request", detail.request_id), fig("Engine request", meta.request_id), fig("Model", `${meta.model} (${meta.backend})`),
    fig("Layers", (meta.layers || []).join(", ") || "—"), fig("Positions", meta.positions),
    fig("Rows × hidden", `${meta.rows} × ${meta.hidden_size} (${meta.dtype})`),
    fig("Prompt / completion", `${(meta.prompt_token_ids || []).length} / ${(meta.completion_token_ids || []).length} tokens`),
    fig("Steering hash", meta.steering_hash || "unsteered"), fig("Read point", meta.read_point),
    att ? fig("Q/K", `layers ${att.layers.join(", ")} · heads ${att.heads.join(", ")} of ${att.num_heads} (KV ${att.kv_heads.join(", ")} of ${att.num_kv_heads}) · q ${att.q_positions}, k ${att.positions}`) : null);
  $("#detail-json").textContent = JSON.stringify(meta, null, 2);
  showNorms();
  showAttentionControls();
}

// --- norms -------------------------------------------------------------------------------

function rowLabel(i) {
  const { meta } = selected;
  const pos = (meta.row_positions || [])[i];
  const tok = (meta.token_ids || [])[i];
  return `position ${pos} · token ${tok}`;
}

function showNorms() {
  const { norms } = selected;
  const body = $("#norms-body");
  if (!norms.layers.length) {
    body.classList.add("hidden");
    $("#norms-h").textContent = "No hidden states captured (attention only)";
    return;
  }
  body.classList.remove("hidden");
  $("#norms-h").textContent = "Hidden-state L2 norm per layer";
  const rows = norms.norms[norms.layers[0]].length;
  const sel = $("#norm-token");
  sel.replaceChildren(el("option", { value: "" }, "mean over rows only"),
    ...Array.from({ length: rows }, (_, i) => el("option", { value: String(i) }, `row ${i}: ${rowLabel(i)}`)));
  sel.value = rows ? String(rows - 1) : "";
  normTable();
  plotNorms();
}

function normTable() {
  const { norms } = selected;
  const table = $("#norm-table");
  const rows = norms.norms[norms.layers[0]].length;
  table.tHead.replaceChildren(el("tr", {}, el("th", { scope: "col", class: "num" }, "Row"),
    el("th", { scope: "col", class: "num" }, "Position"), el("th", { scope: "col", class: "num" }, "Token id"),
    ...norms.layers.map((l) => el("th", { scope: "col", class: "num" }, `Layer ${l}`))));
  const { meta } = selected;
  table.tBodies[0].replaceChildren(...Array.from({ length: rows }, (_, i) => el("tr", { dataset: { row: i } },
    el("th", { scope: "row", class: "num" }, i),
    el("td", { class: "num" }, (meta.row_positions || [])[i] ?? "—"),
    el("td", { class: "num mono" }, (meta.token_ids || [])[i] ?? "—"),
    ...norms.layers.map((l) => el("td", { class: "num", dataset: { layer: l, norm: String(norms.norms[l][i]) } },
      norms.norms[l][i].toFixed(4))))));
  table.tFoot.replaceChildren(el("tr", { dataset: { row: "mean" } },
    el("th", { scope: "row", colspan: 3 }, "mean over rows"),
    ...norms.layers.map((l) => el("td", { class: "num", dataset: { layer: l, norm: String(norms.mean[l]) } },
      norms.mean[l].toFixed(4)))));
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  node.append(...children);
  return node;
}

function plotNorms() {
  const { norms } = selected;
  const layers = norms.layers;
  const rows = norms.norms[layers[0]].length;
  const chosen = $("#norm-token").value === "" ? null : Number($("#norm-token").value);
  const W = 640; const H = 280; const L = 56; const R = 16; const T = 14; const B = 40;
  let max = 0;
  for (const l of layers) for (const v of norms.norms[l]) max = Math.max(max, v);
  max = max > 0 ? max * 1.05 : 1;
  const x = (i) => L + (layers.length === 1 ? (W - L - R) / 2 : (i * (W - L - R)) / (layers.length - 1));
  const y = (v) => T + (H - T - B) * (1 - v / max);
  const path = (values) => layers.map((_, i) => `${i ? "L" : "M"}${x(i).toFixed(1)},${y(values[i]).toFixed(1)}`).join(" ");
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
    "aria-label": `L2 norm of the hidden state per layer: mean over ${rows} rows${chosen === null ? "" : ` and ${rowLabel(chosen)}`}` });
  // axes and ticks
  root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  for (let t = 0; t <= 4; t += 1) {
    const v = (max * t) / 4;
    root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid-line" }),
      svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, v.toFixed(v < 10 ? 2 : 1)));
  }
  layers.forEach((l, i) => root.append(svg("text", { x: x(i), y: H - B + 16, "text-anchor": "middle" }, String(l))));
  root.append(svg("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle" }, "layer"),
    svg("text", { x: 14, y: (T + H - B) / 2, "text-anchor": "middle", transform: `rotate(-90 14 ${(T + H - B) / 2})` }, "‖h‖₂"));
  if (rows <= MAX_TOKEN_LINES) {
    for (let r = 0; r < rows; r += 1) {
      if (r === chosen) continue;
      root.append(svg("path", { d: path(layers.map((l) => norms.norms[l][r])), class: "line token" }));
    }
  }
  const series = [{ name: "mean", values: layers.map((l) => norms.mean[l]), cls: "mean" }];
  if (chosen !== null) series.push({ name: rowLabel(chosen), values: layers.map((l) => norms.norms[l][chosen]), cls: "chosen" });
  for (const s of series) {
    root.append(svg("path", { d: path(s.values), class: `line ${s.cls}`, "data-series": s.cls }));
    s.values.forEach((v, i) => root.append(svg("circle", { cx: x(i), cy: y(v), r: 3.5, class: `dot ${s.cls}`,
      "data-layer": layers[i], "data-norm": String(v) }, svg("title", {}, `${s.name}, layer ${layers[i]}: ${v.toFixed(4)}`))));
  }
  $("#norm-plot").replaceChildren(root);
  $("#norm-legend").replaceChildren(el("span", { class: "line-key mean" }), " mean over rows",
    chosen === null ? "" : el("span", {}, " ", el("span", { class: "line-key chosen" }), ` ${rowLabel(chosen)}`),
    rows <= MAX_TOKEN_LINES ? el("span", {}, " ", el("span", { class: "line-key token" }), " every row") : "");
}

// --- attention -----------------------------------------------------------------------------

function showAttentionControls() {
  const att = selected.meta.attention;
  const box = $("#attention");
  if (!att || !att.layers.length) { box.classList.add("hidden"); return; }
  box.classList.remove("hidden");
  $("#att-layer").replaceChildren(...att.layers.map((l) => el("option", { value: String(l) }, `layer ${l}`)));
  $("#att-head").replaceChildren(...att.heads.map((h) => el("option", { value: String(h) }, `head ${h}`)));
  drawAttention();
}

function drawAttention() {
  const att = selected.meta.attention;
  const layer = Number($("#att-layer").value);
  const head = Number($("#att-head").value);
  const map = $("#att-map");
  let result;
  try {
    result = attentionMap(selected.tensors, att, layer, head);
  } catch (err) {
    map.replaceChildren();
    $("#att-note").textContent = err.message;
    return;
  }
  const tokens = sequenceTokens(selected.meta);
  const label = (p) => `${tokens[p] ?? "?"}@${p}`;
  const qFrom = Math.max(0, result.qPositions.length - MAX_MAP);
  const kFrom = Math.max(0, result.kPositions.length - MAX_MAP);
  const cut = qFrom || kFrom ? ` · showing the last ${MAX_MAP} rows/keys` : "";
  $("#att-note").textContent = `query head ${head} reads KV head ${result.kvHead} · scale ${result.scale.toPrecision(6)}` +
    (result.recorded ? "" : " (not recorded: 1/√head_dim)") + ` · ${result.qPositions.length} queries × ${result.kPositions.length} keys${cut}`;
  const keys = result.kPositions.slice(kFrom);
  map.dataset.layer = layer;
  map.dataset.head = head;
  const head_row = el("tr", {}, el("th", { scope: "col" }, "q \\ k"),
    ...keys.map((p) => el("th", { scope: "col", class: "key", title: `key token ${tokens[p] ?? "?"} at position ${p}` },
      el("span", {}, label(p)))));
  const body = [];
  for (let i = qFrom; i < result.qPositions.length; i += 1) {
    const qp = result.qPositions[i];
    const cells = [];
    for (let j = kFrom; j < result.kPositions.length; j += 1) {
      const w = result.weights[i][j];
      if (Number.isNaN(w)) {
        cells.push(el("td", { class: "masked", "aria-label": "masked (after the query)" }));
        continue;
      }
      const text = `query ${label(qp)} → key ${label(result.kPositions[j])}: ${w.toFixed(4)}`;
      cells.push(el("td", { title: text, "aria-label": text,
        dataset: { q: qp, k: result.kPositions[j], value: String(w) },
        style: `background: rgba(var(--pos), ${(0.03 + 0.92 * w).toFixed(3)})` }));
    }
    body.push(el("tr", { dataset: { q: qp } }, el("th", { scope: "row", class: "mono" }, label(qp)), ...cells));
  }
  map.replaceChildren(el("thead", {}, head_row), el("tbody", {}, ...body));
}

// --- capture a prompt ----------------------------------------------------------------------

function indices(text, what) {
  const parts = text.split(/[\s,]+/).filter(Boolean).map(Number);
  if (parts.some((n) => !Number.isInteger(n) || n < 0)) throw new Error(`${what} must be indices (0, 1, 2…)`);
  return parts;
}

async function loadModels() {
  try {
    const [models, registry] = await Promise.all([get("/v1/models"), get("/api/models")]);
    // every engine's loaded models (the default engine's first), each on a non-default
    // engine named in its option
    const all = loadedModels(registry);
    loadedByName = new Map(all.map((m) => [m.name, m]));
    const sel = $("#c-model");
    const keep = sel.value;
    sel.replaceChildren(...models.data.map((m) => el("option", { value: m.id }, `${m.id}${engineNote(loadedByName.get(m.id))}`)));
    if (keep && models.data.some((m) => m.id === keep)) sel.value = keep;
    else if (all.length) sel.value = all[0].name;
    fillLayers();
  } catch (err) { showError(err, "Models"); }
}

let loadedByName = new Map();
let filledLayers = "";  // the layer list last filled in for the chosen model (not typed)

/** All the chosen model's layers, unless the layers field holds something typed. */
function fillLayers() {
  const loaded = loadedByName.get($("#c-model").value);
  const field = $("#c-layers");
  if (loaded && loaded.num_layers && (!field.value || field.value === filledLayers)) {
    field.value = filledLayers = Array.from({ length: loaded.num_layers }, (_, i) => i).join(", ");
  }
}
$("#c-model").addEventListener("change", fillLayers);

async function capturePrompt() {
  const layers = indices($("#c-layers").value, "Layers");
  const attention = indices($("#c-att-layers").value, "Q/K layers");
  if (!layers.length && !attention.length) throw new Error("Give hidden-state layers, Q/K layers or both");
  const maxTokens = numberFrom($("#c-max"), { integer: true }); // said here, never replaced
  const capture = { ...(layers.length ? { layers, positions: $("#c-positions").value } : {}),
    ...(attention.length ? { attention: { layers: attention, positions: "prompt" } } : {}) };
  const answer = await post("/v1/chat/completions", {
    model: $("#c-model").value, max_tokens: maxTokens, temperature: 0,
    messages: [{ role: "user", content: $("#c-prompt").value }], capture });
  const obj = answer.millm.capture;
  $("#c-result").textContent = `${answer.id}: ${JSON.stringify(answer.choices[0].message.content)} · capture ${obj.id}, ` +
    `${fmtBytes(obj.bytes)}, ${obj.inline ? "inline (at most CAPTURE_INLINE_MAX_BYTES: shown, not stored)" : "stored"}`;
  if (obj.inline) {
    const bytes = Uint8Array.from(atob(obj.data), (c) => c.charCodeAt(0)).buffer;
    await open(obj.id, { bytes, detail: { id: obj.id, request_id: answer.id, bytes: obj.bytes,
      created_at: new Date(obj.metadata.created_at * 1000).toISOString(), expires_at: null, metadata: obj.metadata } });
  } else {
    await refresh();
    await open(obj.id);
  }
}

$("#new-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  busy($("#c-send"), capturePrompt, "Capture");
});
$("#norm-token").addEventListener("change", plotNorms);
$("#att-layer").addEventListener("change", drawAttention);
$("#att-head").addEventListener("change", drawAttention);
$("#refresh").addEventListener("click", (ev) => busy(ev.currentTarget, refresh, "Refresh"));
events.onReconnect(refresh);
events.on("model:load:complete", loadModels);
loadModels();

// a link may name the capture to open: /captures/#<id>
await refresh();
const wanted = location.hash.slice(1);
if (wanted && captures.some((c) => c.id === wanted)) busy(null, () => open(wanted), "Open");
