// Dashboards: start a dashboard run over a corpus (POST /api/saes/{id}/dashboards), list an
// SAE's runs (GET /api/saes/{id}/dashboards) with a progress bar each, cancel one, and show
// a complete run's corpus-wide figures (tokens, dead and dense features, the L0
// histogram). Bars move on `dashboard:progress` events; while a run is not finished the
// page also polls GET /api/dashboards/{id}, so a missed event cannot freeze a bar.
// `dashboard:complete` and `dashboard:error` read the list again.

import { get, post } from "../api.js";
import { $, badge, boot, busy, el, fillRows, fmtDateTime, fmtNumber, notice, numberFrom, showError } from "../dom.js";
import { featureHref } from "../heat.js";
import { pollMoving } from "../jobs.js";
import { histogramSVG } from "../plots.js";
import * as events from "../events.js";

const cfg = boot();

const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const KIND = { queued: "", running: "warn", cancelling: "warn", completed: "ok", failed: "bad", cancelled: "bad" };
const POLL_MS = 1500;

let runs = [];
let reading = null;
let chosen = null;  // the run whose figures show (null: the newest complete one)

const saeId = () => $("#d-sae").value;
const short = (id) => (id.length > 14 ? `${id.slice(0, 14)}…` : id);

function percentOf(run) {
  if (run.complete || run.status === "completed") return 100;
  return run.contexts_total ? Math.floor((100 * run.contexts_done) / run.contexts_total) : 0;
}

function progressCell(run) {
  const pct = percentOf(run);
  const text = `${fmtNumber(run.contexts_done)} of ${run.contexts_total ? fmtNumber(run.contexts_total) : "?"} contexts`
    + ` · ${fmtNumber(run.tokens_done)} tokens · ${pct}%`;
  return el("div", { class: "progress-cell" },
    el("progress", { max: 100, value: pct, "aria-label": `Run ${run.id} progress` }),
    el("span", { class: "small muted", "aria-hidden": "true" }, text));
}

function actions(run) {
  const out = [];
  if (!TERMINAL.has(run.status) && run.status !== "cancelling") {
    out.push(el("button", { type: "button", class: "danger small", "aria-label": `Cancel run ${run.id}`,
      onclick: (ev) => busy(ev.currentTarget, () => cancelRun(run), `Cancel ${run.id}`) }, "Cancel"));
  }
  if (run.complete) {
    out.push(el("button", { type: "button", class: "secondary small", "aria-label": `Figures of run ${run.id}`,
      onclick: () => { chosen = run.id; renderSummary(); } }, "Figures"),
    el("a", { class: "small", href: `/features/?sae_id=${encodeURIComponent(run.sae_id)}` }, "Search its features"));
  }
  return out;
}

function row(run) {
  const error = run.error ? el("div", { class: "small status-text bad" }, `${run.error.code}: ${run.error.message}`) : null;
  return el("tr", { dataset: { runId: run.id, status: run.status, complete: run.complete ? "1" : "0",
    contextsDone: run.contexts_done, contextsTotal: run.contexts_total, tokensDone: run.tokens_done } },
    el("td", { class: "small" }, fmtDateTime(run.created_at)),
    el("td", { class: "mono small", title: run.id }, short(run.id)),
    el("td", { class: "num" }, run.layer),
    el("td", { class: "small" }, run.corpus === "file" ? el("span", { class: "mono" }, run.corpus_file_id) : "sample"),
    el("td", { class: "num" }, fmtNumber(run.token_budget)),
    el("td", { class: "status" }, badge(run.status, KIND[run.status] || ""), error),
    el("td", {}, progressCell(run)),
    el("td", {}, el("div", { class: "actions" }, actions(run))));
}

function render() {
  fillRows($("#runs"), runs.map(row), "No dashboard runs for this SAE yet: start one.", 8);
  renderSummary();
}

function renderSummary() {
  const run = runs.find((r) => r.id === chosen && r.complete) || runs.find((r) => r.complete);
  const s = run?.summary;
  $("#summary").classList.toggle("hidden", !s);
  $("#l0-h").classList.toggle("hidden", !s?.l0?.histogram);
  $("#summary-run").textContent = run ? run.id : "";
  $("#summary-note").textContent = run ? `From run ${run.id} (${fmtDateTime(run.finished_at)}).`
    : "No complete run yet: a complete run's figures show here.";
  if (!s) { $("#s-dense-list").replaceChildren(); $("#l0-plot").replaceChildren(); return; }
  $("#s-tokens").textContent = fmtNumber(s.tokens);
  $("#s-contexts").textContent = fmtNumber(s.contexts);
  $("#s-dead").textContent = `${fmtNumber(s.dead)} (${(100 * (s.dead_share ?? 0)).toFixed(1)}%)`;
  $("#s-dense").textContent = fmtNumber((s.dense || []).length);
  $("#s-l0").textContent = fmtNumber(s.l0?.mean, 2);
  const dense = s.dense || [];
  $("#s-dense-list").replaceChildren(...(dense.length
    ? ["Dense: ", ...dense.slice(0, 50).flatMap((i, k) => [k ? ", " : "",
      el("a", { href: featureHref(run.sae_id, i), class: "mono" }, String(i))]), dense.length > 50 ? ` … (${dense.length})` : ""]
    : []));
  $("#l0-plot").replaceChildren(s.l0?.histogram
    ? histogramSVG(s.l0.histogram, { xLabel: "active features per token", yLabel: "tokens", width: 720,
      label: `L0 histogram of run ${run.id}: mean ${fmtNumber(s.l0.mean, 2)} active features per token` })
    : "");
}

async function refresh() {
  if (!saeId()) { runs = []; render(); return undefined; }
  if (reading) return reading;
  reading = (async () => {
    try {
      const data = await get(`/api/saes/${encodeURIComponent(saeId())}/dashboards`);
      runs = data.runs;
      $("#runs-total").textContent = `${data.total} run(s)`;
      render();
    } catch (err) { showError(err, "Runs"); } finally { reading = null; }
  })();
  return reading;
}

/** Apply a run's figures (an event's or a poll's) to its row in place. */
function update(data) {
  const i = runs.findIndex((r) => r.id === data.run_id);
  if (i < 0) { if (data.sae_id === saeId()) refresh(); return; }
  const old = runs[i];
  if (TERMINAL.has(old.status)) return;  // a late event after the end changes nothing
  // within a run the counts only grow: an event overtaken by a later poll changes nothing
  if (!TERMINAL.has(data.status) && (data.contexts_done ?? 0) < old.contexts_done) return;
  runs[i] = { ...old, ...Object.fromEntries(Object.entries(data).filter(([k]) => k !== "run_id")) };
  const tr = $(`#runs tr[data-run-id="${CSS.escape(old.id)}"]`);
  if (tr) tr.replaceWith(row(runs[i]));
  // the stored figures (summary, complete) are in the run, not in the event
  if (TERMINAL.has(data.status)) {
    if ("summary" in data) renderSummary(); else refresh();
  }
}

pollMoving(() => runs.filter((r) => !TERMINAL.has(r.status)), async (r) => {
  const run = await get(`/api/dashboards/${encodeURIComponent(r.id)}`);
  update({ ...run, run_id: run.id });
}, POLL_MS);

async function cancelRun(run) {
  if (!window.confirm(`Cancel dashboard run ${run.id}? Nothing of it is stored.`)) return;
  const out = await post(`/api/dashboards/${encodeURIComponent(run.id)}/cancel`);
  const next = out.run || out;
  notice(`Run ${run.id} is ${next.status}`, "ok");
  update({ ...next, run_id: next.id });
}

function corpus() { return document.querySelector("input[name=corpus]:checked").value; }

$("#start-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  busy($("#d-start"), async () => {
    if (!saeId()) throw new Error("No SAE chosen");
    const body = {
      corpus: corpus(),
      token_budget: numberFrom($("#d-budget"), { integer: true }),
      context_tokens: numberFrom($("#d-context"), { integer: true }),
    };
    if (body.corpus === "file") {
      body.file_id = $("#d-file").value.trim();
      body.text_field = $("#d-text-field").value.trim() || "text";
    }
    const out = await post(`/api/saes/${encodeURIComponent(saeId())}/dashboards`, body);
    const run = out.run || out;
    notice(`Started run ${run.id} (${run.status})`, "ok");
    chosen = null;
    await refresh();
  }, "Start");
});

for (const radio of document.querySelectorAll("input[name=corpus]")) {
  radio.addEventListener("change", () => $("#file-fields").classList.toggle("hidden", corpus() !== "file"));
}
$("#d-sae").addEventListener("change", () => { chosen = null; refresh(); });
$("#refresh").addEventListener("click", (ev) => busy(ev.currentTarget, refresh, "Refresh"));
if (cfg.max_tokens) {
  $("#d-budget").max = cfg.max_tokens;
  $("#d-budget-hint").textContent = `At most ${fmtNumber(cfg.max_tokens)} tokens (DASHBOARD_MAX_TOKENS).`;
}

async function loadSAEs() {
  try {
    const { saes } = await get("/api/saes");
    const sel = $("#d-sae");
    const want = sel.value || new URLSearchParams(location.search).get("sae_id");
    sel.replaceChildren(...(saes.length
      ? saes.map((s) => el("option", { value: s.id },
        `${s.name} (${s.id})${s.attached_layers?.length ? ` · layer ${s.attached_layers.join(", ")}` : " · not attached"}`))
      : [el("option", { value: "" }, "no SAE registered")]));
    const attached = saes.find((s) => s.attached_layers?.length);
    if (want && saes.some((s) => s.id === want)) sel.value = want;
    else if (attached) sel.value = attached.id;
    await refresh();
  } catch (err) { showError(err, "Dashboards"); }
}

events.on("dashboard:progress", update);
events.on("dashboard:complete", (d) => { if (d.sae_id === saeId()) refresh(); });
events.on("dashboard:error", (d) => {
  if (d.sae_id !== saeId()) return;
  notice(`Run ${d.run_id} failed: ${d.code}: ${d.message}`, "error");
  refresh();
});
events.on("sae:attached", loadSAEs);
events.on("sae:detached", loadSAEs);
events.onReconnect(loadSAEs);
loadSAEs();
