// SAEs: list with download progress, attach (layer picker + compatibility check first),
// detach, download from the hub; an SAE's corpus fidelity (fidelity.js).

import { del, get, post } from "../api.js";
import { $, badge, boot, busy, describeError, el, fillRows, fmtMB, notice, showError, statusBadge } from "../dom.js";
import * as events from "../events.js";
import { describeJob, pollRunning, progressCell, updateProgress } from "../jobs.js";
import { fidelityPanel } from "../fidelity.js";
import { attachTarget, engineNote, loadedModels } from "../loaded.js";

boot();
fidelityPanel();

let saes = [];
let resident = null;          // the loaded model the chosen SAE attaches to, or null
let loaded = [];              // every engine's loaded model row, the default engine's first
let registry = null;          // GET /api/models
let hooks = new Map();        // "<sae_id>@<layer>" → its attachment (hook point, module)
const progress = new Map();

async function refresh() {
  try {
    const [list, models, atts] = await Promise.all([get("/api/saes"), get("/api/models"),
      get("/api/saes/attachments")]);
    saes = list.saes;
    hooks = new Map(atts.entries.map((a) => [`${a.sae_id}@${a.layer}`, a]));
    registry = models;
    loaded = loadedModels(models);
    resident = attachTarget(loaded, registry, saes.find((s) => s.id === $("#attach-sae").value));
    render();
    renderAttachForm();
  } catch (err) { showError(err, "SAEs"); }
}

function detachButton(sae, layer) {
  return el("button", {
    type: "button", class: "secondary small", "aria-label": `Detach ${sae.name} from layer ${layer}`,
    onclick: (ev) => busy(ev.currentTarget, async () => {
      await post(`/api/saes/${sae.id}/detach`, { layer });
      notice(`Detached ${sae.name} from layer ${layer}`, "ok");
      await refresh();
    }, "Detach"),
  }, `L${layer} ×`);
}

/** Where an attachment hooks: its hook point and the module it lands on. */
function hookNote(a) {
  if (!a) return null;
  return el("span", { class: "small hook", title: "hook point · hooked module" },
    badge(a.hook_point || "resid_post", "accent"), " ", el("span", { class: "mono" }, a.layer_module_path));
}

function render() {
  fillRows($("#saes"), saes.map((s) => {
    const status = [statusBadge(s.status)];
    if (s.status === "downloading") {
      status.push(progressCell(`sae-${s.id}`, `Download of ${s.name}`,
        describeJob(progress.get(s.id) || { percent: s.download_progress ?? 0 })));
    }
    if (s.error_message) status.push(el("div", { class: "small status-text bad" }, s.error_message));
    const attached = s.attached_layers.length
      ? el("div", {}, s.attached_layers.map((l) => el("div", { class: "actions attached-at" },
        detachButton(s, l), hookNote(hooks.get(`${s.id}@${l}`)))))
      : el("span", { class: "muted small" }, "—");
    return el("tr", { dataset: { saeId: s.id } },
      el("th", { scope: "row" }, el("div", {}, s.name), el("div", { class: "mono small muted" }, s.id)),
      el("td", { class: "small" }, `${s.format || "?"} · ${s.activation}${s.topk_k ? " k=" + s.topk_k : ""}`),
      el("td", { class: "num small" }, `${s.d_in ?? "?"} × ${s.d_sae ?? "?"}`, el("div", { class: "muted" }, fmtMB(s.memory_usage_mb))),
      el("td", { class: "num" }, s.trained_layer ?? "—"),
      el("td", {}, status),
      el("td", {}, attached),
      el("td", {}, el("div", { class: "actions" },
        ["ready", "attached"].includes(s.status) ? el("button", { type: "button", class: "small", "aria-label": `Attach ${s.name}…`,
          onclick: () => { $("#attach-sae").value = s.id; onSaeChange(); $("#attach-layer").focus(); } }, "Attach…") : null,
        s.status === "downloading" ? el("button", { type: "button", class: "secondary small",
          onclick: (ev) => busy(ev.currentTarget, async () => { await post(`/api/saes/${s.id}/cancel`); await refresh(); }, "Cancel") }, "Cancel") : null,
        !s.attached_layers.length && s.status !== "downloading" ? el("button", { type: "button", class: "danger small", "aria-label": `Delete ${s.name}`,
          onclick: (ev) => busy(ev.currentTarget, async () => {
            if (!window.confirm(`Delete SAE ${s.name}?`)) return;
            await del(`/api/saes/${s.id}`);
            await refresh();
          }, "Delete") }, "Delete") : null)));
  }), "No SAEs registered yet: download one.", 7);
}

function renderAttachForm() {
  const select = $("#attach-sae");
  const keep = select.value;
  const ready = saes.filter((s) => ["ready", "attached"].includes(s.status));
  select.replaceChildren(...ready.map((s) => el("option", { value: s.id },
    `${s.name} (d_in ${s.d_in}${s.trained_layer !== null ? ", trained at L" + s.trained_layer : ""})`)));
  if (ready.some((s) => s.id === keep)) select.value = keep;
  resident = registry ? attachTarget(loaded, registry, saes.find((s) => s.id === select.value)) : null;
  describeResident();
  const layers = $("#attach-layer");
  const previous = layers.value;
  layers.replaceChildren(...Array.from({ length: resident?.num_layers || 0 }, (_, i) => el("option", { value: i }, `Layer ${i}`)));
  if (previous && Number(previous) < (resident?.num_layers || 0)) layers.value = previous;
  const disabled = !resident || !ready.length;
  for (const node of [select, layers, $("#check-button"), $("#attach-button")]) node.disabled = disabled;
  if (!disabled && !previous) onSaeChange();
}

/** The model the chosen SAE attaches to; with several engines, every loaded model too. */
function describeResident() {
  const line = (m) => `${m.name}${engineNote(m)} (${m.num_layers} layers, hidden size ${m.hidden_size})`;
  $("#attach-model").textContent = resident
    ? `Resident model: ${line(resident)}`
    : "No model is loaded: load one on the Models page to attach an SAE.";
  if (loaded.length > 1) {
    $("#attach-model").append(el("span", { class: "loaded-models" },
      ` · loaded: ${loaded.map((m) => `${m.name}${engineNote(m)}`).join(", ")}`));
  }
}

function onSaeChange() {
  const sae = saes.find((s) => s.id === $("#attach-sae").value);
  if (registry) {
    const target = attachTarget(loaded, registry, sae);
    if (target !== resident) {
      resident = target;
      describeResident();
      const layers = $("#attach-layer");
      layers.replaceChildren(...Array.from({ length: resident?.num_layers || 0 }, (_, i) => el("option", { value: i }, `Layer ${i}`)));
    }
  }
  if (sae && sae.trained_layer !== null && resident && sae.trained_layer < resident.num_layers) {
    $("#attach-layer").value = String(sae.trained_layer);
  }
  check();
}

let checkSeq = 0;
async function check() {
  const saeId = $("#attach-sae").value;
  const layer = $("#attach-layer").value;
  const out = $("#compat");
  if (!saeId || layer === "") { out.textContent = ""; return null; }
  const seq = ++checkSeq;
  // the compatibility route judges shapes and layers, not what is attached already: an
  // attach where this SAE already hooks would be refused, so say so here instead
  const here = hooks.get(`${saeId}@${layer}`);
  if (here) {
    out.replaceChildren(badge("already attached here", "warn"),
      el("div", { class: "status-text warn" }, `This SAE is already attached at layer ${layer} ` +
        `(${here.layer_module_path}): choose another layer, or detach it first.`));
    $("#attach-button").disabled = true;
    return { compatible: false, errors: [], warnings: [] };
  }
  out.textContent = "Checking…";
  try {
    const report = await get(`/api/saes/${saeId}/compatibility?layer=${layer}`);
    if (seq !== checkSeq) return report;
    out.replaceChildren(
      report.compatible ? badge("compatible", "ok") : badge("incompatible", "bad"),
      ...report.errors.map((e) => el("div", { class: "status-text bad" }, e)),
      ...report.warnings.map((w) => el("div", { class: "status-text warn" }, `Warning: ${w}`)));
    $("#attach-button").disabled = !report.compatible;
    return report;
  } catch (err) {
    if (seq === checkSeq) out.replaceChildren(el("span", { class: "status-text bad" }, describeError(err)));
    return null;
  }
}

$("#attach-sae").addEventListener("change", onSaeChange);
$("#attach-layer").addEventListener("change", check);
$("#check-button").addEventListener("click", check);
$("#attach-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  busy($("#attach-button"), async () => {
    const report = await check();
    if (!report || !report.compatible) return;
    const saeId = $("#attach-sae").value;
    const layer = Number($("#attach-layer").value);
    const out = await post(`/api/saes/${saeId}/attach`, { layer });
    notice(`Attached ${saeId} at layer ${out.layer} (${out.hook_point} · ${out.layer_module_path})`, "ok");
    for (const w of out.warnings || []) notice(`Warning: ${w}`);
    await refresh();
  }, "Attach");
});

function onProgress(data) {
  if (!data.sae_id) return;
  progress.set(data.sae_id, data);
  if (!updateProgress(`sae-${data.sae_id}`, data)) refreshSoon();
}
let timer = null;
function refreshSoon() { clearTimeout(timer); timer = setTimeout(refresh, 200); }

events.on("sae:download:progress", onProgress);
events.on("sae:download:complete", refreshSoon);
events.on("sae:download:error", (d) => { notice(`SAE download failed: ${d.error || ""}`, "error"); refreshSoon(); });
events.on("sae:attached", refreshSoon);
events.on("sae:detached", (d) => {
  if (d.reason === "out_of_memory") notice(`SAE ${d.sae_id} was detached from layer ${d.layer}: out of memory`, "error");
  refreshSoon();
});
events.on("model:", (d, name) => { if (!name.endsWith(":progress")) refreshSoon(); });
events.onReconnect(refresh);
pollRunning((job) => { if (job.sae_id && job.kind === "sae_download") onProgress(job); },
  () => saes.some((s) => s.status === "downloading"));

function formBody(form) {
  const data = Object.fromEntries(new FormData(form).entries());
  for (const [k, v] of Object.entries(data)) if (v === "") delete data[k];
  return data;
}

$("#sae-download-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const form = ev.currentTarget;
  busy(form.querySelector("button[type=submit]"), async () => {
    const out = await post("/api/saes/download", formBody(form));
    notice(`${out.sae_id}: ${out.message}`, "ok");
    $("#sd-token").value = "";
    await refresh();
  }, "Download");
});

$("#sd-preview").addEventListener("click", (ev) => {
  const body = formBody($("#sae-download-form"));
  if (!body.repository_id) { $("#sd-repo").focus(); return; }
  busy(ev.currentTarget, async () => {
    const p = await post("/api/saes/preview", { repository_id: body.repository_id, revision: body.revision, hf_token: body.hf_token });
    $("#sae-preview").replaceChildren(p.files.length ? el("table", {},
      el("caption", {}, `${p.total_files} SAE file(s) in ${p.repository_id}`),
      el("thead", {}, el("tr", {}, el("th", { scope: "col" }, "Path"), el("th", { scope: "col" }, "Layer"), el("th", { scope: "col" }, "Width"), el("th", { scope: "col" }, ""))),
      el("tbody", {}, p.files.map((f) => el("tr", {},
        el("td", { class: "mono small" }, f.path), el("td", {}, f.layer ?? "—"), el("td", {}, f.width ?? "—"),
        el("td", {}, el("button", { type: "button", class: "secondary small", "aria-label": `Use ${f.path}`,
          onclick: () => { $("#sd-path").value = f.path.replace(/\/[^/]+$/, ""); $("#sd-path").focus(); } }, "Use"))))))
      : el("p", { class: "muted" }, "No SAE files (params.npz or sae_weights.safetensors) in that repository."));
  }, "Preview");
});

refresh();
