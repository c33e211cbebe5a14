// The SAE page's fidelity panel: the chosen SAE's newest complete corpus fidelity (GET
// /api/saes/{id}/fidelity: mean L0, MSE, explained variance, loss recovered, dead and dense
// features) and "Measure fidelity", which starts a fidelity experiment over the offline
// sample (POST /api/experiments/fidelity) and follows it with a progress bar: it moves on
// `experiment:progress`, and the run is also polled (GET /api/experiments/{id}) while it
// is not finished, so a missed event cannot freeze it. When the run ends the figures are
// read again.

import { get, post } from "./api.js";
import { $, badge, busy, config, el, fmtDateTime, fmtNumber, notice, numberFrom, showError } from "./dom.js";
import { featureHref } from "./heat.js";
import * as events from "./events.js";

const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const KIND = { queued: "", running: "warn", cancelling: "warn", completed: "ok", failed: "bad", cancelled: "bad" };
const POLL_MS = 1500;

let saes = [];
let run = null;      // the fidelity run this panel follows (started here or found running)
let polling = false;

const saeId = () => $("#fid-sae").value;
const fmt = (v, digits = 4) => (v === null || v === undefined ? "—" : Number(v).toPrecision(digits));

function featureLinks(sae, indices, limit = 20) {
  if (!indices?.length) return [];
  return [...indices.slice(0, limit).flatMap((i, k) => [k ? ", " : "",
    el("a", { href: featureHref(sae, i), class: "mono" }, String(i))]), indices.length > limit ? ` … (${indices.length})` : ""];
}

async function showFigures() {
  const id = saeId();
  const figures = $("#fid-figures");
  if (!id) { figures.classList.add("hidden"); $("#fid-note").textContent = "No SAE registered."; return; }
  try {
    const data = await get(`/api/saes/${encodeURIComponent(id)}/fidelity`);
    if (id !== saeId()) return;
    const f = data.fidelity;
    figures.classList.toggle("hidden", !f);
    figures.dataset.runId = data.run_id || "";
    $("#fid-run").textContent = data.run_id || "";
    if (!f) {
      $("#fid-note").textContent = "No fidelity measured yet for this SAE: measure it below.";
      $("#fid-detail").replaceChildren();
      return;
    }
    const c = data.corpus || {};
    $("#fid-note").textContent = `From run ${data.run_id} at layer ${data.layer} (${fmtDateTime(data.finished_at)}): ` +
      `${fmtNumber(f.tokens)} tokens of the ${c.corpus === "file" ? `file ${c.file_id}` : "sample corpus"}, ` +
      `${fmtNumber(f.rows)} rows read.`;
    const set = (sel, value, raw) => { $(sel).textContent = value; $(sel).dataset.value = raw ?? ""; };
    set("#fid-l0", fmt(f.l0), f.l0);
    set("#fid-mse", fmt(f.mse), f.mse);
    set("#fid-ev", fmt(f.explained_variance), f.explained_variance);
    set("#fid-lr", fmt(f.loss_recovered), f.loss_recovered);
    set("#fid-dead", fmtNumber(f.dead_count), f.dead_count);
    set("#fid-dense", fmtNumber(f.dense_count), f.dense_count);
    const losses = `Next-token loss: clean ${fmt(f.loss_clean)}, spliced ${fmt(f.loss_spliced)}, zero-ablated ${fmt(f.loss_zero)}` +
      ` (nats per token, ${fmtNumber(f.loss_tokens)} tokens).`;
    $("#fid-detail").replaceChildren(losses,
      f.loss_recovered_unavailable ? el("span", { class: "muted" }, ` Loss recovered: ${f.loss_recovered_unavailable}.`) : "",
      f.dense_count ? el("div", {}, `Dense (on more than ${100 * f.dense_threshold}% of the rows): `, ...featureLinks(id, f.dense_features)) : "",
      f.dead_count ? el("div", {}, "Dead (never fired): ", ...featureLinks(id, f.dead_features)) : "");
  } catch (err) {
    $("#fid-note").textContent = "";
    showError(err, "Fidelity");
  }
}

function showRun() {
  const box = $("#fid-progress");
  if (!run || run.sae_id !== saeId()) { box.replaceChildren(); return; }
  const pct = run.status === "completed" ? 100 : run.total ? Math.floor((100 * run.done) / run.total) : 0;
  box.replaceChildren(el("div", { class: "progress-cell", dataset: { runId: run.id, status: run.status, done: run.done, total: run.total } },
    el("div", { class: "small" }, `Run `, el("span", { class: "mono" }, run.id), " ", badge(run.status, KIND[run.status] || ""),
      run.error?.code ? el("span", { class: "status-text bad" }, ` ${run.error.code}: ${run.error.message}`) : ""),
    el("progress", { max: 100, value: pct, "aria-label": `Fidelity run ${run.id} progress` }),
    el("span", { class: "small muted", "aria-hidden": "true" }, `${fmtNumber(run.done)} of ${run.total ? fmtNumber(run.total) : "?"} · ${pct}%`)));
}

function follow(data) {
  const id = data.run_id || data.id;
  if (!run || id !== run.id || TERMINAL.has(run.status)) return;
  if (!TERMINAL.has(data.status) && (data.done ?? 0) < run.done) return;  // counts only grow
  run = { ...run, ...Object.fromEntries(Object.entries(data).filter(([k]) => k !== "run_id")) };
  showRun();
  if (TERMINAL.has(run.status)) {
    // the figures (and a failure's error) are in the run, not in the event
    get(`/api/experiments/${encodeURIComponent(run.id)}`).then((r) => { run = r; showRun(); }).catch(() => {});
    if (run.status === "completed") showFigures();
  }
}

setInterval(async () => {
  if (polling || document.hidden || !run || TERMINAL.has(run.status)) return;
  polling = true;
  try { follow(await get(`/api/experiments/${encodeURIComponent(run.id)}`)); } catch { /* next tick */ } finally { polling = false; }
}, POLL_MS);

/** A fidelity run of this SAE that is still going (one started elsewhere, or before a reload). */
async function findRunning() {
  try {
    const { runs } = await get(`/api/experiments?kind=fidelity&sae_id=${encodeURIComponent(saeId())}&limit=5`);
    run = runs.find((r) => !TERMINAL.has(r.status)) || (run?.sae_id === saeId() ? run : null);
  } catch { run = null; }
  showRun();
}

async function loadSAEs() {
  try {
    saes = (await get("/api/saes")).saes.filter((s) => s.format !== "vector");
    const sel = $("#fid-sae");
    const keep = sel.value;
    sel.replaceChildren(...(saes.length
      ? saes.map((s) => el("option", { value: s.id },
        `${s.name}${s.attached_layers?.length ? ` · layer ${s.attached_layers.join(", ")}` : " · not attached"}`))
      : [el("option", { value: "" }, "no SAE registered")]));
    const attached = saes.find((s) => s.attached_layers?.length);
    if (keep && saes.some((s) => s.id === keep)) sel.value = keep;
    else if (attached) sel.value = attached.id;
    onChoose();
  } catch (err) { showError(err, "Fidelity"); }
}

function onChoose() {
  const sae = saes.find((s) => s.id === saeId());
  $("#fid-start").disabled = !sae?.attached_layers?.length;
  $("#fid-start").title = sae?.attached_layers?.length ? "" : "Attach the SAE first: fidelity is measured at its hook";
  showFigures();
  findRunning();
}

export function fidelityPanel() {
  const cfg = config();
  if (cfg.max_tokens) $("#fid-budget").max = cfg.max_tokens;
  $("#fid-sae").addEventListener("change", onChoose);
  $("#fid-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    busy($("#fid-start"), async () => {
      const sae = saes.find((s) => s.id === saeId());
      if (!sae) throw new Error("No SAE chosen");
      const body = {
        sae_id: sae.id,
        layer: sae.attached_layers?.[0] ?? null,
        corpus: "sample",
        token_budget: numberFrom($("#fid-budget"), { integer: true }),
        context_tokens: numberFrom($("#fid-context"), { integer: true }),
      };
      const out = await post("/api/experiments/fidelity", body);
      run = out.run || out;
      notice(`Started fidelity run ${run.id} (${run.status})`, "ok");
      showRun();
    }, "Measure fidelity");
  });
  events.on("experiment:progress", follow);
  events.on("experiment:complete", (d) => follow({ ...d, status: "completed" }));
  events.on("experiment:error", (d) => {
    if (run && d.run_id === run.id) notice(`Fidelity run ${d.run_id} failed: ${d.code}: ${d.message}`, "error");
    follow({ ...d, status: "failed" });
  });
  events.on("sae:attached", loadSAEs);
  events.on("sae:detached", loadSAEs);
  events.onReconnect(loadSAEs);
  loadSAEs();
}
