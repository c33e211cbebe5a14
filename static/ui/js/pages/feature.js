// One feature's page: GET /api/saes/{id}/features/{index} — its label and explanations
// (score, source, provenance), the newest complete dashboard's top contexts and lower
// quantile samples as heat strips (one scale: the feature's max), the density and the
// histogram of its non-zero activations as small plots, and its logit effects as two token
// lists. "Steer with it" opens the playground with the feature preset; "Add to a profile"
// adds {index: strength} to a profile through PATCH /api/profiles/{id} (the server's
// refusal is shown and nothing changes).

import { get, patch } from "../api.js";
import { $, boot, busy, describeError, el, fillRows, fmtDateTime, fmtNumber, notice, showError } from "../dom.js";
import { contextStrip, heatLegend } from "../heat.js";
import { densitySVG, fmtDensity, histogramSVG } from "../plots.js";
import * as events from "../events.js";

const cfg = boot();
const saeId = cfg.sae_id;
const index = Number(cfg.index);
let profiles = [];

document.querySelector("h1").textContent = `Feature ${index}`;
document.title = `Feature ${index} of ${saeId} · miLLM`;
$("#f-lead").replaceChildren(`Feature ${index} of `, el("span", { class: "mono" }, saeId),
  " (", el("a", { href: `/features/?sae_id=${encodeURIComponent(saeId)}` }, "search its features"), ").");

function shown(token) { return token === "" ? "∅" : String(token).replace(/\n/g, "⏎").replace(/\t/g, "⇥"); }

function provenance(x) {
  const bits = [];
  if (x.explainer_model) bits.push(`model ${x.explainer_model}`);
  if (x.created_by) bits.push(`by ${x.created_by}`);
  if (x.created_at) bits.push(fmtDateTime(x.created_at));
  const p = x.provenance && typeof x.provenance === "object" ? x.provenance : {};
  for (const [k, v] of Object.entries(p)) bits.push(`${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`);
  return bits.join(" · ") || "—";
}

function renderExplanations(list) {
  fillRows($("#explanations"), list.map((x) => el("tr", { dataset: { source: x.source || "", score: x.score ?? "" } },
    el("td", { class: "description" }, x.description),
    el("td", { class: "num score" }, x.score === null || x.score === undefined ? "—" : fmtNumber(x.score, 3)),
    el("td", { class: "small source" }, x.source || "—"),
    el("td", { class: "small muted provenance" }, provenance(x)))),
  "No explanation yet (import some, or generate them: docs/features.md).", 4);
}

function tokenList(node, rows) {
  node.replaceChildren(...(rows || []).map((t) => el("li", { dataset: { tokenId: t.token_id, value: String(t.value) } },
    el("span", { class: "tok", title: JSON.stringify(t.token) }, shown(t.token)),
    el("span", { class: "num" }, Number(t.value).toFixed(3)))));
  if (!node.children.length) node.append(el("li", { class: "empty" }, "not computed"));
}

function renderDashboard(d, runId) {
  $("#no-dashboard").classList.toggle("hidden", Boolean(d));
  if (!d) {
    $("#top-contexts").replaceChildren();
    $("#quantiles").replaceChildren(el("p", { class: "empty" }, "No dashboard yet."));
    $("#f-run").replaceChildren("No dashboard yet: ", el("a", { href: `/dashboards/?sae_id=${encodeURIComponent(saeId)}` }, "build one"), ".");
    for (const id of ["#density-plot", "#hist-plot", "#legend"]) $(id).replaceChildren();
    tokenList($("#logit-top"), []);
    tokenList($("#logit-bottom"), []);
    return;
  }
  $("#f-density").textContent = fmtDensity(d.density);
  $("#f-count").textContent = fmtNumber(d.count);
  $("#f-mean").textContent = fmtNumber(d.mean, 3);
  $("#f-max").textContent = fmtNumber(d.max, 3);
  $("#f-run").replaceChildren("From run ", el("a", { class: "mono", href: `/dashboards/?sae_id=${encodeURIComponent(saeId)}` }, runId || "—"), ".");
  const contexts = d.top_contexts || [];
  const bands = d.quantile_samples || [];
  let scale = Number(d.max) || 0;
  for (const c of [...contexts, ...bands.flatMap((b) => b.contexts || [])]) scale = Math.max(scale, Number(c.max_activation) || 0);
  if (!(scale > 0)) scale = 1;
  $("#top-contexts").replaceChildren(...(contexts.length
    ? contexts.map((c, k) => contextStrip(c, scale, { feature: index, name: `Top context ${k + 1}` }))
    : [el("p", { class: "empty" }, "The feature never fired in this run's corpus.")]));
  $("#quantiles").replaceChildren(...(bands.length
    ? bands.map((b, k) => el("div", { class: "band", dataset: { band: k } },
      el("h4", { class: "small" }, `Activations from ${Number(b.band?.[0] ?? 0).toFixed(3)} to ${Number(b.band?.[1] ?? 0).toFixed(3)}`),
      ...(b.contexts || []).map((c, j) => contextStrip(c, scale, { feature: index, name: `Band ${k + 1} sample ${j + 1}` }))))
    : [el("p", { class: "empty" }, "No samples below the top contexts.")]));
  $("#legend").replaceChildren(heatLegend(scale, `feature ${index}; the outlined token is each context's max`));
  $("#density-plot").replaceChildren(densitySVG(d.density));
  $("#hist-plot").replaceChildren(d.histogram?.counts?.length
    ? histogramSVG(d.histogram, { label: `Histogram of feature ${index}'s non-zero activations: ${d.histogram.counts.length} bins` })
    : el("p", { class: "empty" }, "No non-zero activation."));
  tokenList($("#logit-top"), d.logit_top);
  tokenList($("#logit-bottom"), d.logit_bottom);
}

async function load() {
  try {
    const data = await get(`/api/saes/${encodeURIComponent(saeId)}/features/${index}`);
    $("#f-label").className = data.label ? "" : "muted";
    $("#f-label").textContent = data.label || "No label yet.";
    renderExplanations(data.explanations || []);
    renderDashboard(data.dashboard, data.run_id);
  } catch (err) {
    $("#f-label").textContent = describeError(err);
    showError(err, `Feature ${index}`);
  }
}

function strength() {
  const text = $("#u-strength").value.trim();
  const v = Number(text);
  if (text === "" || !Number.isFinite(v)) throw new Error(`Strength must be a number (it is “${text}”)`);
  return v;
}

function steerHref() {
  const q = new URLSearchParams({ sae_id: saeId, feature: String(index), strength: $("#u-strength").value.trim() || "10" });
  $("#steer-link").href = `/playground/?${q}`;
}

async function loadProfiles() {
  try {
    profiles = (await get("/api/profiles")).profiles;
    const sel = $("#u-profile");
    const keep = sel.value;
    sel.replaceChildren(...(profiles.length
      ? profiles.map((p) => el("option", { value: p.id, disabled: Boolean(p.sae_id && p.sae_id !== saeId) },
        `${p.name}${p.sae_id && p.sae_id !== saeId ? ` (steers ${p.sae_id})` : ""}`))
      : [el("option", { value: "" }, "no profiles saved")]));
    const first = profiles.find((p) => !p.sae_id || p.sae_id === saeId);
    if (keep && profiles.some((p) => p.id === keep)) sel.value = keep;
    else if (first) sel.value = first.id;
  } catch (err) { showError(err, "Profiles"); }
}

$("#profile-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const status = $("#u-status");
  busy($("#u-add"), async () => {
    status.textContent = "";
    status.className = "small";
    const id = $("#u-profile").value;
    if (!id) throw new Error("No profile chosen (save one on the Steering or Profiles page)");
    const value = strength();
    const profile = await get(`/api/profiles/${encodeURIComponent(id)}`);
    const body = { steering: { ...profile.steering, [String(index)]: value } };
    if (!profile.sae_id) body.sae_id = saeId;
    try {
      const saved = await patch(`/api/profiles/${encodeURIComponent(id)}`, body);
      status.textContent = `Added feature ${index} at ${value} to ${saved.name} (${Object.keys(saved.steering).length} values).`;
      status.classList.add("ok");
      notice(status.textContent, "ok");
    } catch (err) {
      status.textContent = `Not added: ${describeError(err)}`;
      status.classList.add("status-text", "bad");
      throw err;
    }
  }, "Add to a profile");
});

$("#u-strength").addEventListener("input", steerHref);
steerHref();
events.on("dashboard:complete", (d) => { if (d.sae_id === saeId) load(); });
events.on("steering:update", loadProfiles);
events.onReconnect(() => { load(); loadProfiles(); });
load();
loadProfiles();
