// Experiments (docs/experiments.md): build a sweep from the playground's controls (an
// attachment, features, modes, strengths, prompts) and start it (POST
// /api/experiments/sweep); calibrate a strength to a KL budget (POST
// /api/experiments/calibrate); the key's runs (GET /api/experiments) with a progress bar
// each that moves on `experiment:progress` (and a poll of GET /api/experiments/{id} while a
// run is not finished, so a missed event cannot freeze a bar), cancel after a confirmation.
// An opened sweep's points (GET /api/experiments/{id}/points) are drawn as KL and the target
// feature's activation (before and after steering) against strength, one line per variant,
// with the generated texts side by side (steered and the prompt's default) and download
// links; a calibration as its curve and the strength found. Attribution (POST
// /api/experiments/attribution) is a signed heat strip over the prompt's tokens with the top
// features listed, each with its ablation check and a link to its feature page.
// The URL may preset a feature (the playground's "open in experiments"):
// ?sae_id=…&layer=…&feature=…&strength=…; ?run=<id> opens that run (the page keeps the
// opened run's id there).

import { apiKey, get, labelsOf, post } from "../api.js";
import { $, badge, boot, busy, describeError, el, fillRows, fmtDateTime, fmtNumber, notice, numberFrom, presetFromURL, showError } from "../dom.js";
import { featureHref, signedStrip } from "../heat.js";
import { pollMoving } from "../jobs.js";
import { lineSVG } from "../plots.js";
import * as events from "../events.js";

const cfg = boot();
const MAX_STRENGTH = cfg.max_strength || 200;
const MAX_POINTS = cfg.max_points || 256;
const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const KIND = { queued: "", running: "warn", cancelling: "warn", completed: "ok", failed: "bad", cancelled: "bad" };
const POLL_MS = 1500;
const FORMATS = ["jsonl", "csv", "parquet"];

let attachments = [];
let runs = [];
let opened = null;      // {run, points} of the run whose results show
let reading = null;

const short = (id) => (id.length > 14 ? `${id.slice(0, 14)}…` : id);
const attachmentOf = (select) => {
  const [sae_id, layer] = (select.value || "").split("@");
  if (!sae_id) throw new Error("No SAE attached: attach one on the SAEs page");
  return { sae_id, layer: Number(layer) };
};

/** Numbers from a comma-separated field, each checked; the field named on a refusal. */
function numbersFrom(input, { integer = false, min = null, max = null } = {}) {
  const label = input.labels?.[0]?.textContent.trim() || input.id;
  const parts = input.value.split(/[\s,;]+/).filter(Boolean);
  const bad = (why) => {
    input.setAttribute("aria-invalid", "true");
    return new Error(`${label}: ${why}`);
  };
  if (!parts.length) throw bad("give at least one");
  const out = parts.map((p) => {
    const v = Number(p);
    if (!Number.isFinite(v) || (integer && !Number.isInteger(v))) throw bad(`“${p}” is not ${integer ? "a whole number" : "a number"}`);
    if ((min !== null && v < min) || (max !== null && v > max)) throw bad(`${p} is outside ${min}…${max}`);
    return v;
  });
  if (new Set(out).size !== out.length) throw bad("a value is given twice");
  input.removeAttribute("aria-invalid");
  return out;
}

function promptsFrom(input) {
  const prompts = input.value.split("\n").map((p) => p.trim()).filter(Boolean);
  if (!prompts.length) {
    input.setAttribute("aria-invalid", "true");
    throw new Error("Prompts: give at least one (one per line)");
  }
  input.removeAttribute("aria-invalid");
  return prompts;
}

function modes() {
  const out = [...document.querySelectorAll("input[name=x-mode]:checked")].map((c) => c.value);
  if (!out.length) throw new Error("Modes: tick at least one");
  return out;
}

/** The prompts as the API takes them: texts, or one user message each. */
function promptFields(prompts) {
  return { prompts: $("#x-chat").checked ? prompts.map((p) => ({ messages: [{ role: "user", content: p }] })) : prompts };
}

function sweepBody() {
  const { sae_id, layer } = attachmentOf($("#x-sae"));
  const features = numbersFrom($("#x-features"), { integer: true, min: 0, max: dSae() - 1 });
  const strengths = numbersFrom($("#x-strengths"), { min: -MAX_STRENGTH, max: MAX_STRENGTH });
  const variants = features.flatMap((index) => modes().map((mode) => ({ sae_id, layer, index, mode })));
  return {
    ...promptFields(promptsFrom($("#x-prompts"))),
    variants,
    strengths,
    max_tokens: numberFrom($("#x-max-tokens"), { integer: true }),
    seed: numberFrom($("#x-seed"), { integer: true, empty: 0 }),
  };
}

function dSae() {
  const a = attachments.find((x) => `${x.sae_id}@${x.layer}` === $("#x-sae").value);
  return a?.d_sae || Infinity;
}

/** "P prompts × V variants × S strengths + P defaults = N points" under the form. */
function countHint() {
  const out = $("#x-count");
  try {
    const p = $("#x-prompts").value.split("\n").filter((l) => l.trim()).length;
    const f = $("#x-features").value.split(/[\s,;]+/).filter(Boolean).length;
    const m = document.querySelectorAll("input[name=x-mode]:checked").length;
    const s = $("#x-strengths").value.split(/[\s,;]+/).filter(Boolean).length;
    const n = p * f * m * s + p;
    out.textContent = `${p} prompt(s) × ${f * m} variant(s) × ${s} strength(s) + ${p} default(s) = ${n} points` +
      ` (at most ${MAX_POINTS}, EXPERIMENT_MAX_POINTS)`;
    out.classList.toggle("status-text", n > MAX_POINTS);
    out.classList.toggle("bad", n > MAX_POINTS);
  } catch { out.textContent = ""; }
  featureNote();
}

async function featureNote() {
  const note = $("#x-features-note");
  const saeId = $("#x-sae").value.split("@")[0];
  const labels = await labelsOf(saeId);
  const named = $("#x-features").value.split(/[\s,;]+/).filter(Boolean)
    .filter((f) => labels[f]).map((f) => `${f}: ${labels[f]}`);
  note.textContent = named.length ? named.join(" · ") : "";
}

// --- runs --------------------------------------------------------------------------------

function percentOf(run) {
  if (run.status === "completed") return 100;
  return run.total ? Math.floor((100 * run.done) / run.total) : 0;
}

function describeRun(run) {
  const s = run.spec || {};
  const n = (s.prompts || []).length;
  if (run.kind === "sweep") {
    const variants = (s.variants || []).map(variantName);
    return `${variants.join(", ") || "—"} · ${(s.strengths || []).length} strength(s) · ${n} prompt(s)`;
  }
  if (run.kind === "calibration") return `${variantName(s.variant, 0)} · target KL ${s.target_kl ?? "?"} · ${n} prompt(s)`;
  if (run.kind === "fidelity") return `${run.sae_id || ""}${run.layer !== null && run.layer !== undefined ? ` @ layer ${run.layer}` : ""}`;
  return "—";
}

function progressCell(run) {
  const pct = percentOf(run);
  return el("div", { class: "progress-cell" },
    el("progress", { max: 100, value: pct, "aria-label": `Run ${run.id} progress` }),
    el("span", { class: "small muted", "aria-hidden": "true" },
      `${fmtNumber(run.done)} of ${run.total ? fmtNumber(run.total) : "?"} · ${pct}%${run.partial ? " · partial" : ""}`));
}

function actions(run) {
  const out = [];
  if (!TERMINAL.has(run.status) && run.status !== "cancelling") {
    out.push(el("button", { type: "button", class: "danger small", "aria-label": `Cancel run ${run.id}`,
      onclick: (ev) => busy(ev.currentTarget, () => cancelRun(run), `Cancel ${run.id}`) }, "Cancel"));
  }
  if (run.kind !== "fidelity") {
    out.push(el("button", { type: "button", class: "secondary small", "aria-label": `Open run ${run.id}`,
      onclick: (ev) => busy(ev.currentTarget, () => openRun(run.id), `Open ${run.id}`) }, "Open"));
  } else if (run.spec?.sae_id) {
    out.push(el("a", { class: "small", href: "/saes/" }, "SAE page"));
  }
  return out;
}

function row(run) {
  const error = run.error?.code ? el("div", { class: "small status-text bad" }, `${run.error.code}: ${run.error.message}`) : null;
  return el("tr", { dataset: { runId: run.id, status: run.status, kind: run.kind, done: run.done ?? 0,
    total: run.total ?? 0, partial: run.partial ? "1" : "0" } },
    el("td", { class: "small" }, fmtDateTime(run.created_at)),
    el("td", { class: "mono small", title: run.id }, short(run.id)),
    el("td", { class: "small" }, run.kind),
    el("td", { class: "small" }, describeRun(run)),
    el("td", { class: "status" }, badge(run.status, KIND[run.status] || ""),
      run.partial ? el("span", { class: "badge warn" }, "partial") : null, error),
    el("td", {}, progressCell(run)),
    el("td", {}, el("div", { class: "actions" }, actions(run))));
}

function render() {
  fillRows($("#runs"), runs.map(row), "No experiments yet: start one.", 7);
}

async function refresh() {
  if (reading) return reading;
  reading = (async () => {
    try {
      const data = await get("/api/experiments?limit=50");
      runs = data.runs || [];
      $("#runs-total").textContent = `${data.total ?? runs.length} run(s)`;
      render();
    } catch (err) { showError(err, "Runs"); } finally { reading = null; }
  })();
  return reading;
}

/** Apply a run's figures (an event's or a poll's) to its row in place. */
function update(data) {
  const id = data.run_id || data.id;
  const i = runs.findIndex((r) => r.id === id);
  if (i < 0) { refresh(); return; }
  const old = runs[i];
  if (TERMINAL.has(old.status)) return;  // a late event after the end changes nothing
  if (!TERMINAL.has(data.status) && (data.done ?? 0) < (old.done ?? 0)) return;  // counts only grow
  runs[i] = { ...old, ...Object.fromEntries(Object.entries(data).filter(([k]) => k !== "run_id")) };
  const tr = $(`#runs tr[data-run-id="${CSS.escape(id)}"]`);
  if (tr) tr.replaceWith(row(runs[i]));
  if (TERMINAL.has(runs[i].status)) {
    refresh();
    if (opened?.run.id === id || pendingOpen === id) openRun(id);
  }
}

pollMoving(() => runs.filter((r) => !TERMINAL.has(r.status)),
  async (r) => update(await get(`/api/experiments/${encodeURIComponent(r.id)}`)), POLL_MS);

async function cancelRun(run) {
  if (!window.confirm(`Cancel experiment ${run.id}? The points already done are kept, marked partial.`)) return;
  const out = await post(`/api/experiments/${encodeURIComponent(run.id)}/cancel`);
  const next = out.run || out;
  notice(`Run ${run.id} is ${next.status}`, "ok");
  update({ ...next, run_id: next.id });
}

// --- one run's results ---------------------------------------------------------------------

let pendingOpen = null;  // a run started here: opened when it ends

async function openRun(id) {
  const run = await get(`/api/experiments/${encodeURIComponent(id)}`);
  let points = [];
  if (run.kind === "sweep") {
    // a page at a time (at most 1000 a call) until every stored point is in
    for (;;) {
      const data = await get(`/api/experiments/${encodeURIComponent(id)}/points?limit=1000&offset=${points.length}`);
      points = points.concat(data.points);
      if (!data.points.length || points.length >= data.total) break;
    }
  }
  opened = { run, points };
  // the URL names the opened run, so a reload (or a shared link) opens it again
  const q = new URLSearchParams(location.search);
  if (q.get("run") !== id) history.replaceState(null, "", `?${new URLSearchParams({ run: id })}`);
  renderResult();
}

/** A variant in a few words: its label, or "#3 add @L1" (an inline vector: "vector"). */
function variantName(v, k) {
  if (!v) return `variant ${k + 1}`;
  if (v.label) return v.label;
  const what = v.vector ? "vector" : `#${v.index ?? "?"}`;
  const mode = v.mode || v.vector?.mode || "add";
  const layer = v.layer ?? v.vector?.layer;
  return `${what} ${mode}${layer !== undefined && layer !== null ? ` @L${layer}` : ""}`;
}

const mean = (xs) => {
  const ys = xs.filter((x) => x !== null && x !== undefined && Number.isFinite(Number(x))).map(Number);
  return ys.length ? ys.reduce((a, b) => a + b, 0) / ys.length : null;
};

/** Per variant and strength, the mean over prompts of `field` of the steered points. */
function seriesOf(points, variants, field, { dashed = false, suffix = "" } = {}) {
  return variants.map((v, k) => {
    const mine = points.filter((p) => !p.is_default && p.variant_index === k);
    const strengths = [...new Set(mine.map((p) => p.strength))].sort((a, b) => a - b);
    return { name: `${variantName(v, k)}${suffix}`, key: k, dashed,
      points: strengths.map((s) => ({ x: s, y: mean(mine.filter((p) => p.strength === s).map((p) => p[field])) })) };
  });
}

function downloadLinks(run) {
  return ["Download: ", ...FORMATS.flatMap((f, k) => [k ? " · " : "", el("a", {
    href: `/api/experiments/${encodeURIComponent(run.id)}/download?format=${f}`, class: "download",
    dataset: { format: f }, download: `${run.id}.${f}`, onclick: keyedDownload }, f)])];
}

/** With an API key the link alone would carry none: fetch with the key, save the blob. */
async function keyedDownload(ev) {
  if (!apiKey()) return;
  ev.preventDefault();
  const link = ev.currentTarget;
  try {
    const response = await fetch(link.href, { headers: { Authorization: `Bearer ${apiKey()}` } });
    if (!response.ok) throw new Error(`${link.dataset.format}: HTTP ${response.status}`);
    const url = URL.createObjectURL(await response.blob());
    const a = el("a", { href: url, download: link.getAttribute("download") });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  } catch (err) { showError(err, "Download"); }
}

function renderResult() {
  const { run, points } = opened;
  $("#result-run").textContent = run.id;
  const partial = run.partial ? " Partial: cancelled before every point was done; these are the points done." : "";
  const unavailable = run.result?.kl_unavailable ? ` KL not computed: ${run.result.kl_unavailable}.` : "";
  $("#result-note").textContent = `${run.kind} · ${run.status} · ${fmtNumber(run.done)} of ${fmtNumber(run.total)} points.${partial}${unavailable}`;
  $("#sweep-result").classList.toggle("hidden", run.kind !== "sweep");
  $("#cal-result").classList.toggle("hidden", run.kind !== "calibration");
  $("#downloads").replaceChildren(...(run.kind === "sweep" ? downloadLinks(run) : []));
  if (run.kind === "sweep") renderSweep(run, points);
  if (run.kind === "calibration") renderCalibration(run);
}

function renderSweep(run, points) {
  const variants = run.spec?.variants || [];
  $("#kl-plot").replaceChildren(lineSVG(seriesOf(points, variants, "kl_mean"),
    { yLabel: "KL (nats)", label: `Mean KL against strength, ${variants.length} variant(s)` }));
  const after = seriesOf(points, variants, "target_after", { suffix: " after" });
  const before = seriesOf(points, variants, "target_before", { dashed: true, suffix: " before" });
  $("#act-plot").replaceChildren(lineSVG([...after, ...before],
    { yLabel: "activation", label: `Target feature's mean activation against strength, before and after steering` }));
  $("#series-legend").replaceChildren(...variants.map((v, k) =>
    el("span", {}, el("span", { class: `series-key series-${k % 6}`, "aria-hidden": "true" }), variantName(v, k))));
  const prompts = run.spec?.prompts || (run.spec?.messages || []).map((m) => m[m.length - 1]?.content ?? "");
  const keepP = $("#t-prompt").value;
  const keepV = $("#t-variant").value;
  $("#t-prompt").replaceChildren(...prompts.map((p, i) => el("option", { value: i }, `${i + 1}: ${p.slice(0, 60)}`)));
  $("#t-variant").replaceChildren(...variants.map((v, k) => el("option", { value: k }, variantName(v, k))));
  if (keepP && Number(keepP) < prompts.length) $("#t-prompt").value = keepP;
  if (keepV && Number(keepV) < variants.length) $("#t-variant").value = keepV;
  renderTexts();
}

function renderTexts() {
  if (!opened || opened.run.kind !== "sweep") return;
  const p = Number($("#t-prompt").value || 0);
  const v = Number($("#t-variant").value || 0);
  const { points } = opened;
  const fallback = points.find((x) => x.is_default && x.prompt_index === p);
  const rows = points.filter((x) => !x.is_default && x.prompt_index === p && x.variant_index === v)
    .sort((a, b) => a.strength - b.strength)
    .map((x) => {
      const base = points.find((d) => d.is_default && d.prompt_index === x.prompt_index) || fallback;
      return el("tr", { dataset: { ordinal: x.ordinal, strength: x.strength, kl: x.kl_mean ?? "" } },
        el("td", { class: "num" }, fmtNumber(x.strength, 3)),
        el("td", { class: "gen steered-text" }, x.text ?? ""),
        el("td", { class: "gen default-text" }, base?.text ?? "—"),
        el("td", { class: "num" }, x.kl_mean === null || x.kl_mean === undefined ? "—" : Number(x.kl_mean).toPrecision(4)),
        el("td", { class: "num small" }, `${fmt(x.target_before)} → ${fmt(x.target_after)}`));
    });
  fillRows($("#texts"), rows, "No points for this prompt and variant (yet).", 5);
}

const fmt = (v) => (v === null || v === undefined ? "—" : Number(v).toPrecision(3));

function renderCalibration(run) {
  const r = run.result || {};
  const s = run.spec || {};
  const curve = (r.curve || []).map((c) => ({ x: Number(c.strength), y: c.kl }));
  const found = r.strength === undefined || r.strength === null ? null : Number(r.strength);
  $("#cal-strength").textContent = found === null ? "—" : String(Number(found.toPrecision(6)));
  $("#cal-strength").dataset.value = found ?? "";
  $("#cal-kl").textContent = fmt(r.kl);
  $("#cal-kl").dataset.value = r.kl ?? "";
  $("#cal-target").textContent = fmt(s.target_kl);
  $("#cal-outcome").textContent = run.status !== "completed" ? "" : r.converged
    ? `Converged after ${r.iterations} iteration(s): within ${r.tolerance} of the target.`
    : `Not converged${r.reason ? `: ${r.reason}` : ""}; the closest strength measured is shown.`;
  if (r.profile) $("#cal-outcome").append(` Saved into profile ${r.profile.name ?? r.profile}.`);
  $("#cal-plot").replaceChildren(lineSVG([{ name: "mean KL", key: 0, points: curve }], {
    yLabel: "KL (nats)", label: `Mean KL at the ${curve.length} strengths tried; target ${s.target_kl}`,
    hline: s.target_kl !== undefined ? { y: Number(s.target_kl), label: "target KL" } : null,
    vline: found !== null ? { x: found, label: "strength found" } : null,
  }));
}

// --- starting ---------------------------------------------------------------------------

async function started(out, what) {
  const run = out.run || out;
  notice(`Started ${what} ${run.id} (${run.status})`, "ok");
  pendingOpen = run.id;
  await refresh();
  if (TERMINAL.has(run.status)) openRun(run.id);
}

$("#sweep-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  busy($("#x-start"), async () => {
    const body = sweepBody();
    await started(await post("/api/experiments/sweep", body), "sweep");
  }, "Sweep");
});

$("#cal-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  busy($("#c-start"), async () => {
    const { sae_id, layer } = attachmentOf($("#x-sae"));
    const body = {
      ...promptFields(promptsFrom($("#x-prompts"))),
      variant: { sae_id, layer, index: numberFrom($("#c-feature"), { integer: true }), mode: $("#c-mode").value },
      target_kl: numberFrom($("#c-target")),
      bounds: [0, numberFrom($("#c-max"))],
      max_tokens: numberFrom($("#x-max-tokens"), { integer: true }),
      seed: numberFrom($("#x-seed"), { integer: true, empty: 0 }),
    };
    const profile = $("#c-profile").value.trim();
    if (profile) body.save_profile = profile;
    await started(await post("/api/experiments/calibrate", body), "calibration");
  }, "Calibrate");
});

// --- attribution ------------------------------------------------------------------------

let attribution = null;

/** The target: blank for the greedy next token, digits for a token id, else one token's text. */
function targetToken() {
  const text = $("#a-token").value;
  if (text.trim() === "") return null;
  return /^\s*\d+\s*$/.test(text) ? Number(text) : text;
}

$("#attr-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  busy($("#a-run"), async () => {
    const { sae_id, layer } = attachmentOf($("#a-sae"));
    const prompt = $("#a-prompt").value;
    if (!prompt.trim()) throw new Error("Prompt: give one");
    const body = { prompt, sae_id, layer, top_n: numberFrom($("#a-top"), { integer: true }),
      target_token: targetToken() };
    body.ablate_top = numberFrom($("#a-ablate"), { integer: true });
    if (body.ablate_top > body.top_n) {
      $("#a-ablate").setAttribute("aria-invalid", "true");
      throw new Error(`Ablation checks must be at most Top features (${body.top_n})`);
    }
    $("#attr-note").textContent = "Running…";
    try {
      attribution = await post("/api/experiments/attribution", body);
    } catch (err) {
      $("#attr-note").textContent = describeError(err);
      throw err;
    }
    renderAttribution();
  }, "Attribution");
});

const named = (f) => `feature ${f.index}${f.label ? `: ${f.label}` : ""}`;

function renderAttribution() {
  const a = attribution;
  const t = a.target;
  $("#attr-target").textContent = `${JSON.stringify(t.text)} (id ${t.id}${t.greedy ? ", the greedy next token" : ""}), ` +
    `logit ${Number(t.logit).toPrecision(4)}`;
  $("#attr-note").textContent = `${a.tokens.length} prompt tokens; the top ${a.features.length} feature(s) of ` +
    `${a.sae_id} at layer ${a.layer} (${a.backend}). Attribution = activation × ∂logit/∂activation; ` +
    `the ablation check zeroes a feature at every position and gives the logit's change.`;
  $("#attr-show").disabled = false;
  drawAttributionStrip();
  $("#attr-table").classList.remove("hidden");
  fillRows($("#attr-top"), a.features.map((f) => el("tr", { dataset: { index: f.index, attribution: f.attribution,
    ablation: f.ablation_delta ?? "" } },
    el("td", {}, el("a", { href: f.dashboard || featureHref(a.sae_id, f.index), class: "feature-link",
      dataset: { feature: f.index }, "aria-label": `Open the dashboard of ${named(f)}` }, named(f))),
    el("td", { class: "num" }, Number(f.attribution).toPrecision(4)),
    el("td", { class: "num" }, Number(f.activation_sum).toPrecision(4)),
    el("td", { class: "num" }, `${f.max_position + 1} ${JSON.stringify(a.tokens[f.max_position]?.text ?? "")} ` +
      `(${Number(f.max_attribution).toPrecision(3)})`),
    el("td", { class: "num ablation" }, f.ablation_delta === null || f.ablation_delta === undefined
      ? "not checked" : Number(f.ablation_delta).toPrecision(4)))),
  "No feature is active on this prompt.", 5);
}

function drawAttributionStrip() {
  const a = attribution;
  if (!a) return;
  const magnitude = $("#attr-show").value === "total";
  const values = a.heat.map((h) => (magnitude ? h.total : h.sum));
  $("#attr-strip").replaceChildren(signedStrip(a.tokens.map((t) => t.text), values, {
    name: magnitude ? "Sum of |attribution| over features" : "Attribution summed over features",
    describe: (i) => {
      const top = a.heat[i]?.top || [];
      return top.length ? ` (top: ${top.map((f) => `${f.index}${f.label ? ` ${f.label}` : ""}: ${Number(f.attribution).toPrecision(3)}`).join(", ")})` : "";
    },
  }));
}
$("#attr-show").addEventListener("change", drawAttributionStrip);

// --- choices and the URL preset ---------------------------------------------------------

async function loadAttachments() {
  try {
    attachments = (await get("/api/saes/attachments")).entries;
    for (const sel of [$("#x-sae"), $("#a-sae")]) {
      const keep = sel.value;
      sel.replaceChildren(...(attachments.length
        ? attachments.map((a) => el("option", { value: `${a.sae_id}@${a.layer}` }, `${a.sae_id} @ layer ${a.layer}`))
        : [el("option", { value: "" }, "no SAE attached")]));
      if (keep && attachments.some((a) => `${a.sae_id}@${a.layer}` === keep)) sel.value = keep;
    }
    const d = attachments.find((a) => `${a.sae_id}@${a.layer}` === $("#x-sae").value)?.d_sae;
    if (d) $("#c-feature").max = d - 1;
    countHint();
  } catch (err) { showError(err, "Attachments"); }
}

/** The strengths of a preset: 0, half, the strength, double (those within the bound). */
function presetStrengths(s) {
  const out = [0, s / 2, s, 2 * s].filter((v) => Math.abs(v) <= MAX_STRENGTH);
  return [...new Set(out)].join(", ");
}

function applyPreset(p) {
  const match = attachments.find((a) => a.sae_id === p.saeId && (p.layer === null || String(a.layer) === p.layer));
  if (p.saeId && !match) {
    notice(`SAE ${p.saeId} is not attached: attach it on the SAEs page to sweep feature ${p.feature}.`, "error");
  } else if (match) {
    $("#x-sae").value = `${match.sae_id}@${match.layer}`;
    $("#a-sae").value = $("#x-sae").value;
  }
  $("#x-features").value = String(p.feature);
  $("#x-strengths").value = presetStrengths(p.strength);
  $("#c-feature").value = String(p.feature);
  countHint();
}

for (const id of ["#x-features", "#x-strengths", "#x-prompts"]) $(id).addEventListener("input", countHint);
// the calibration's feature follows the sweep's first until it is edited itself
let calEdited = false;
$("#c-feature").addEventListener("input", () => { calEdited = true; });
$("#x-features").addEventListener("input", () => {
  const first = $("#x-features").value.split(/[\s,;]+/).find((f) => /^\d+$/.test(f));
  if (!calEdited && first !== undefined) $("#c-feature").value = first;
});
for (const c of document.querySelectorAll("input[name=x-mode]")) c.addEventListener("change", countHint);
$("#x-sae").addEventListener("change", countHint);
$("#t-prompt").addEventListener("change", renderTexts);
$("#t-variant").addEventListener("change", renderTexts);
$("#refresh").addEventListener("click", (ev) => busy(ev.currentTarget, refresh, "Refresh"));

events.on("experiment:progress", update);
events.on("experiment:complete", (d) => update({ ...d, status: d.status || "completed" }));
events.on("experiment:error", (d) => {
  notice(`Experiment ${d.run_id} failed: ${d.code}: ${d.message}`, "error");
  update({ ...d, status: d.status || "failed" });
});
events.on("sae:attached", loadAttachments);
events.on("sae:detached", loadAttachments);
events.onReconnect(() => { loadAttachments(); refresh(); });

const preset = presetFromURL();
loadAttachments().then(() => { if (preset) applyPreset(preset); });
refresh().then(() => {
  const q = new URLSearchParams(location.search);
  if (q.get("run")) openRun(q.get("run")).catch((err) => showError(err, "Open"));
});
