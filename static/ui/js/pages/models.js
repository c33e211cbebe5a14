// Models: list with live progress bars, download / register, load, unload, lock, delete.

import { del, get, leaseHeaders, leaseId, post, setLeaseId } from "../api.js";
import { $, badge, boot, busy, el, fillRows, fmtMB, fmtNumber, notice, showError, statusBadge } from "../dom.js";
import * as events from "../events.js";
import { describeJob, jobRow, pollRunning, progressCell, updateProgress } from "../jobs.js";

boot();

let models = [];
const progress = new Map();   // model id -> last progress payload

const MOVING = new Set(["downloading", "loading", "unloading"]);

function actions(m) {
  const act = (label, fn, cls = "secondary small", title) => el("button", {
    type: "button", class: cls, title, "aria-label": `${label} ${m.name}`,
    onclick: (ev) => busy(ev.currentTarget, fn, `${label} ${m.name}`),
  }, label);
  const out = [];
  const resident = models.find((x) => x.status === "loaded");
  const lease = { extraHeaders: leaseHeaders(resident?.id) };
  if (m.status === "ready") out.push(act("Load", async () => { await post(`/api/models/${m.id}/load`, undefined, lease); notice(`Loading ${m.name}…`); await refresh(); }, "small"));
  if (m.status === "loaded") out.push(act("Unload", async () => { await post(`/api/models/${m.id}/unload`, undefined, lease); notice(`Unloading ${m.name}…`); await refresh(); }));
  if (m.status === "downloading") out.push(act("Cancel", async () => { await post(`/api/models/${m.id}/cancel`); await refresh(); }));
  if (["ready", "loaded"].includes(m.status)) {
    out.push(m.locked
      ? act("Unlock", async () => { await post(`/api/models/${m.id}/unlock`); await refresh(); })
      : act("Lock", async () => { await post(`/api/models/${m.id}/lock`); await refresh(); }, "secondary small",
        "Refuse unload, delete and swaps while steering experiments run"));
  }
  if (!["loaded", "loading", "unloading"].includes(m.status)) {
    out.push(act("Delete", async () => {
      if (!window.confirm(`Delete ${m.name}? Files miLLM downloaded are removed too.`)) return;
      await del(`/api/models/${m.id}`);
      notice(`Deleted ${m.name}`, "ok");
      await refresh();
    }, "danger small"));
  }
  return el("div", { class: "actions" }, out);
}

function statusCell(m) {
  const parts = [statusBadge(m.status)];
  if (m.locked) parts.push(" ", badge("locked", "accent"));
  // several engines (ENGINE_MODELS): which one holds it; the default engine goes unsaid
  if (m.engine && m.engine !== "default") parts.push(el("div", { class: "small" }, `on engine ${m.engine}`));
  if (MOVING.has(m.status)) {
    const last = progress.get(m.id) || { percent: m.download_progress ?? 0 };
    const label = m.status === "downloading" ? `Download of ${m.name}` : `${m.status} ${m.name}`;
    parts.push(progressCell(`model-${m.id}`, label, describeJob(last)));
  }
  if (m.error_message) parts.push(el("div", { class: "small status-text bad" }, m.error_message));
  return el("td", {}, parts);
}

function render() {
  fillRows($("#models"), models.map((m) => el("tr", { dataset: { modelId: m.id } },
    el("th", { scope: "row" }, m.name),
    el("td", { class: "small" }, m.repo_id ? `${m.repo_id}${m.revision && m.revision !== "main" ? "@" + m.revision : ""}` : el("span", { class: "mono", title: m.local_path }, "local")),
    el("td", { class: "small" }, m.architecture || "—"),
    el("td", { class: "num" }, m.params || "—"),
    el("td", { class: "num" }, fmtNumber(m.num_layers)),
    el("td", {}, m.quantization),
    el("td", { class: "num" }, fmtMB(m.disk_size_mb)),
    statusCell(m),
    el("td", {}, actions(m)))), "No models registered yet: download or register one below.", 9);
}

async function refreshJobs() {
  try {
    const data = await get("/api/jobs?limit=8");
    fillRows($("#jobs"), data.jobs.filter((j) => j.kind.startsWith("model")).map(jobRow), "No jobs yet.", 4);
  } catch (err) { showError(err, "Jobs"); }
}

async function refresh() {
  try {
    models = (await get("/api/models")).models;
    render();
  } catch (err) { showError(err, "Models"); }
  refreshJobs();
  refreshLease();
  refreshEngines();
}

// --- the engines (ENGINE_MODELS) and what each holds -------------------------------------

// GET /api/engines is for admin keys: another key's 403 (or 401) hides the panel, unsaid,
// and the page stops asking
let enginesRefused = false;

/** What an engine holds: the model its status names, and what the registry records on it
 * when the two differ (a load or unload on its way, or a row the engine no longer holds). */
function holdsCell(e) {
  const recorded = e.recorded || [];
  const parts = [e.model ? el("span", { class: "mono" }, e.model) : el("span", { class: "muted" }, "nothing")];
  const same = e.model ? recorded.length === 1 && recorded[0] === e.model : recorded.length === 0;
  if (!same) {
    parts.push(el("div", { class: "small status-text warn" },
      `registry records: ${recorded.length ? recorded.join(", ") : "nothing"}`));
  }
  return el("td", { class: "engine-holds" }, parts);
}

function renderEngines(engines) {
  // one engine: the models table says it all
  $("#engines-panel").hidden = engines.length < 2;
  $("#engines-panel").dataset.state = engines.length < 2 ? "one" : "shown";
  fillRows($("#engines"), engines.map((e) => el("tr", { dataset: { engine: e.name } },
    el("th", { scope: "row" }, e.name),
    el("td", {}, e.alive ? badge("alive", "ok") : badge(e.phase || "down", "bad")),
    el("td", {}, e.state || "—"),
    holdsCell(e),
    el("td", { class: "small mono" }, (e.models_allowed || []).join(", ") || "—"))), "No engines.", 5);
}

async function refreshEngines() {
  if (enginesRefused) return;
  try {
    renderEngines((await get("/api/engines")).engines);
  } catch (err) {
    if (err.status === 401 || err.status === 403) {
      enginesRefused = true;
      $("#engines-panel").hidden = true;
      $("#engines-panel").dataset.state = "refused";
      return;
    }
    showError(err, "Engines");
  }
}

// --- the lease of the resident model ------------------------------------------------------

// several engines (ENGINE_MODELS) hold a model each: the select picks whose lease is shown
const loadedModels = () => models.filter((m) => m.status === "loaded");
const residentModel = () => {
  const loaded = loadedModels();
  return loaded.find((m) => String(m.id) === $("#lease-model").value) || loaded[0] || null;
};

function leaseChoices() {
  const loaded = loadedModels();
  const keep = $("#lease-model").value;
  $("#lease-model").replaceChildren(...loaded.map((m) => el("option", { value: String(m.id) }, m.engine ? `${m.name} (engine ${m.engine})` : m.name)));
  if (loaded.some((m) => String(m.id) === keep)) $("#lease-model").value = keep;
  $("#lease-model-field").hidden = loaded.length < 2;
}

async function refreshLease() {
  leaseChoices();
  const m = residentModel();
  const controls = ["#lease-holder", "#lease-reason", "#lease-ttl", "#lease-take", "#lease-id", "#lease-renew", "#lease-release"];
  for (const sel of controls) $(sel).disabled = !m;
  if (!m) { $("#lease-state").textContent = "No model is resident: only the resident model can be leased."; $("#lease-badge").replaceChildren(); return; }
  if (document.activeElement?.id !== "lease-id") $("#lease-id").value = leaseId(m.id);
  try {
    const out = await get(`/api/models/${m.id}/lease`);
    const l = out.lease;
    if (l) {
      $("#lease-badge").replaceChildren(badge("leased", "warn"));
      $("#lease-state").textContent = `${m.name} is leased by “${l.holder}” (${l.reason}) until ${new Date(l.expires_at).toLocaleString()} · ${Math.round(l.seconds_remaining / 60)} min left.${leaseId(m.id) ? " This tab holds its id." : ""}`;
    } else {
      $("#lease-badge").replaceChildren(badge("not leased"));
      const ended = out.last_ended ? ` The last lease (${out.last_ended.holder}) ended: ${out.last_ended.end_reason}.` : "";
      $("#lease-state").textContent = `${m.name} is not leased.${ended}`;
    }
  } catch (err) { showError(err, "Lease"); }
}

$("#lease-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const m = residentModel();
  if (!m) return;
  busy($("#lease-take"), async () => {
    const l = await post(`/api/models/${m.id}/lease`, { holder: $("#lease-holder").value.trim(),
      reason: $("#lease-reason").value.trim(), ttl_seconds: 60 * Number($("#lease-ttl").value || 60) });
    setLeaseId(m.id, l.lease_id);
    $("#lease-id").value = l.lease_id;
    notice(`Leased ${m.name} until ${new Date(l.expires_at).toLocaleTimeString()}; this tab keeps the lease id.`, "ok");
    await refreshLease();
  }, "Lease");
});
$("#lease-model").addEventListener("change", () => refreshLease());
$("#lease-id").addEventListener("change", () => { const m = residentModel(); if (m) setLeaseId(m.id, $("#lease-id").value.trim()); refreshLease(); });
$("#lease-renew").addEventListener("click", (ev) => {
  const m = residentModel();
  if (!m || !leaseId(m.id)) { notice("This tab holds no lease id for the resident model: paste it first.", "error"); return; }
  busy(ev.currentTarget, async () => {
    await post(`/api/models/${m.id}/lease/renew`, { ttl_seconds: 60 * Number($("#lease-ttl").value || 60) }, { extraHeaders: leaseHeaders(m.id) });
    notice("Lease renewed", "ok");
    await refreshLease();
  }, "Renew");
});
$("#lease-release").addEventListener("click", (ev) => {
  const m = residentModel();
  if (!m || !leaseId(m.id)) { notice("This tab holds no lease id for the resident model: paste it first.", "error"); return; }
  busy(ev.currentTarget, async () => {
    await del(`/api/models/${m.id}/lease`, { extraHeaders: leaseHeaders(m.id) });
    setLeaseId(m.id, "");
    $("#lease-id").value = "";
    notice("Lease released", "ok");
    await refreshLease();
  }, "Release");
});

function onProgress(data) {
  if (data.model_id === undefined || data.model_id === null) return;
  progress.set(data.model_id, data);
  if (!updateProgress(`model-${data.model_id}`, data)) refreshSoon();
  if (data.job_id !== undefined) updateProgress(`job-${data.job_id}`, data);
}

let timer = null;
function refreshSoon() { clearTimeout(timer); timer = setTimeout(refresh, 200); }

events.on("model:download:progress", onProgress);
events.on("model:load:progress", onProgress);
for (const name of ["model:download:complete", "model:download:error", "model:load:complete",
  "model:load:error", "model:unload:complete"]) {
  events.on(name, (data) => {
    if (name.endsWith(":error")) notice(`${name}: ${data.error || "failed"}`, "error");
    refreshSoon();
  });
}
events.onReconnect(refresh);
pollRunning((job) => {
  if (job.model_id !== null && job.kind.startsWith("model")) onProgress(job);
}, () => models.some((m) => MOVING.has(m.status)));

function formBody(form) {
  const data = Object.fromEntries(new FormData(form).entries());
  for (const [k, v] of Object.entries(data)) if (v === "") delete data[k];
  return data;
}

$("#download-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const form = ev.currentTarget;
  const body = { ...formBody(form), source: "huggingface", trust_remote_code: $("#dl-trust").checked };
  busy(form.querySelector("button[type=submit]"), async () => {
    const out = await post("/api/models", body);
    notice(`Downloading ${out.model.name} (job ${out.job?.id})`, "ok");
    $("#dl-token").value = "";
    await refresh();
  }, "Download");
});

$("#dl-preview").addEventListener("click", (ev) => {
  const form = $("#download-form");
  const body = formBody(form);
  if (!body.repo_id) { $("#dl-repo").focus(); return; }
  busy(ev.currentTarget, async () => {
    const p = await post("/api/models/preview", { repo_id: body.repo_id, revision: body.revision, hf_token: body.hf_token });
    const est = p.estimated_sizes || {};
    $("#preview-out").replaceChildren(
      el("p", {}, `${p.repo_id}: ${p.architecture || "?"} · ${p.params || "?"} parameters · ${fmtNumber(p.num_layers)} layers · ${fmtMB(p.disk_size_mb)} to download (${p.files.length} files)`),
      p.requires_trust_remote_code ? el("p", { class: "status-text warn" }, "This repository ships its own model code: tick “trust remote code” to download it.") : "",
      p.is_gated ? el("p", { class: "status-text warn" }, "Gated repository: a hub token with access is needed.") : "",
      Object.keys(est).length ? el("p", { class: "muted" }, "Memory when loaded: " + Object.entries(est).map(([q, v]) => `${q} ${fmtMB(v.memory_mb)}`).join(" · ")) : "");
  }, "Preview");
});

$("#local-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const form = ev.currentTarget;
  busy(form.querySelector("button[type=submit]"), async () => {
    const out = await post("/api/models", { ...formBody(form), source: "local" });
    notice(`Registered ${out.model.name}`, "ok");
    form.reset();
    await refresh();
  }, "Register");
});

refresh();
