// Playground: streamed chat against /v1/chat/completions. The left column runs with the
// chosen steering (live, a profile, or inline features, dialled by λ); the right one with
// `steering: {features: []}` (explicitly unsteered). Both ask for
// `return_sae_activations` over the completion and for per-token logprobs, which carry
// each generated token's text, so every token gets one heat-strip cell. Inline steering
// may carry controls (mode, phase, window, condition); under a steered answer the page
// shows what ran: per-mode apply counts, the steering hash, and where conditional
// controls fired. A strip's focused cell links each of its features to its feature page
// ("open its dashboard"). The URL may preset one feature to steer with (the feature page's
// "Steer with it"): ?sae_id=…&feature=…&strength=…[&layer=…] selects "these features"
// with that line, and colours the heat strip by that feature of that SAE.

import { get, labelsOf, streamV1 } from "../api.js";
import { $, boot, describeError, el, notice, numberFrom, presetFromURL, showError } from "../dom.js";
import { controlEntries, controlRow, steeringReport } from "../controls.js";
import { heatStrip, stripScale } from "../heat.js";
import * as events from "../events.js";
import { engineNote, loadedModels } from "../loaded.js";

boot();

const columns = {
  steered: { transcript: $("#transcript-steered"), history: [], strips: [] },
  plain: { transcript: $("#transcript-plain"), history: [], strips: [] },
};
let controller = null;
let attachments = [];

function steerMode() { return document.querySelector("input[name=steer-mode]:checked").value; }

function parseInline(text) {
  const features = [];
  for (const raw of text.split(/[\n,;]+/)) {
    const line = raw.trim();
    if (!line) continue;
    const m = line.match(/^(\d+)\s*[:=\s]\s*(-?\d+(?:\.\d+)?)$/);
    if (!m) throw new Error(`Cannot read “${line}”: write index: strength, e.g. 0: 10`);
    const strength = Number(m[2]);
    if (Math.abs(strength) > 200) throw new Error(`Strength ${strength} is outside −200…200`);
    features.push({ index: Number(m[1]), strength });
  }
  return features;
}

/** The request settings of the side panel, each checked (see numberFrom). */
function requestSettings() {
  return {
    max_tokens: numberFrom($("#max-tokens"), { integer: true }),
    temperature: numberFrom($("#temperature")),
    seed: numberFrom($("#seed"), { integer: true, empty: 0 }),
  };
}

function heatRequest() {
  const saeId = $("#heat-sae").value;
  if (!saeId) return null;
  const [sae_id, layer] = saeId.split("@");
  const req = { sae_id, top_k: 3, positions: "completion" };
  if ($("#heat-mode").value === "feature") req.features = [numberFrom($("#heat-feature"), { integer: true })];
  return { req, layer: Number(layer) };
}

function steeringFields() {
  const mode = steerMode();
  const lambda = Number($("#intensity").value);
  const out = {};
  if (mode === "profile") {
    if (!$("#profile").value) throw new Error("No profile chosen (save one on the Steering page)");
    out.profile = $("#profile").value;
  } else if (mode === "inline") {
    const features = [...parseInline($("#inline-features").value), ...controlEntries($("#controls"))];
    const sae = $("#heat-sae").value.split("@")[0];
    out.steering = { features, ...(sae && attachments.length > 1 ? { sae_id: sae } : {}) };
  }
  // λ dials whatever the left column runs, the live steering included (docs/api-v1.md)
  if (lambda !== 1) out.steering_intensity = lambda;
  return out;
}

function turn(who, text = "") {
  const body = el("div", { class: "text" }, text);
  const node = el("div", { class: `turn ${who}` }, el("div", { class: "who" }, who), body);
  return { node, body };
}

async function runColumn(key, userText, extra, settings, heat, signal) {
  const col = columns[key];
  const messages = [];
  const system = $("#system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...col.history, { role: "user", content: userText });
  const reply = turn("assistant");
  reply.node.classList.add("streaming");
  const meta = el("div", { class: "meta" }, "waiting for the first token…");
  reply.node.append(meta);
  col.transcript.append(reply.node);
  const tokens = [];
  let text = "";
  let millm = null;
  const started = performance.now();
  let first = null;
  const body = { model: $("#model").value, messages, ...settings, logprobs: true, ...extra };
  if (heat) body.return_sae_activations = heat.req;
  try {
    const { headers } = await streamV1("/v1/chat/completions", body, {
      signal,
      onChunk: (chunk) => {
        if (chunk.millm) millm = chunk.millm;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        if (choice.delta && choice.delta.content) {
          if (first === null) first = performance.now();
          text += choice.delta.content;
          reply.body.textContent = text;
          col.transcript.scrollTop = col.transcript.scrollHeight;
        }
        for (const lp of choice.logprobs?.content || []) tokens.push(lp.token);
      },
    });
    reply.node.classList.remove("streaming");
    col.history.push({ role: "user", content: userText }, { role: "assistant", content: text });
    const elapsed = (performance.now() - started) / 1000;
    const n = tokens.length;
    const steering = headers.get("X-miLLM-Steering") || millm?.steering?.description || "—";
    meta.textContent = `${n} tokens in ${elapsed.toFixed(2)} s` +
      (first !== null && n > 1 ? ` · ${((n - 1) / Math.max(0.001, (performance.now() - first) / 1000)).toFixed(1)} tok/s` : "") +
      ` · steering: ${decodeURIComponent(steering)}`;
    if (key === "steered") {
      $("#steered-desc").textContent = decodeURIComponent(steering).split(";")[0];
      if (millm) reply.node.append(steeringReport(millm, tokens));
    }
    const acts = millm?.sae_activations;
    if (acts) {
      const saeId = acts.sae_id || heat?.req.sae_id;
      const entry = { node: el("div"), tokens, acts, feature: heat?.req.features?.[0] ?? null,
        saeId, labels: await labelsOf(saeId) };
      col.strips.push(entry);
      reply.node.append(entry.node);
      redrawStrips();
    }
  } catch (err) {
    reply.node.classList.remove("streaming");
    if (err.name === "AbortError") { meta.textContent = "stopped"; return; }
    meta.replaceChildren(el("span", { class: "status-text bad" }, describeError(err)));
    throw err;
  }
}

/** Both columns share one colour scale, so steered and unsteered strips compare. */
function redrawStrips() {
  const all = [...columns.steered.strips, ...columns.plain.strips];
  const scale = stripScale(all);
  for (const s of all) s.node.replaceWith(s.node = heatStrip(s, scale));
}

$("#chat-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const text = $("#message").value.trim();
  if (!text) return;
  let extra, settings, heat;
  try { extra = steeringFields(); } catch (err) { showError(err, "Steering"); return; }
  try { settings = requestSettings(); heat = heatRequest(); } catch (err) { showError(err, "Settings"); return; }
  $("#message").value = "";
  controller = new AbortController();
  $("#send").disabled = true;
  $("#stop").disabled = false;
  const compare = $("#compare").checked;
  for (const key of compare ? ["steered", "plain"] : ["steered"]) {
    const user = turn("user", text);
    columns[key].transcript.append(user.node);
  }
  // The two requests run concurrently: with one generation slot the second waits in the
  // server's queue and starts as soon as the first ends.
  const runs = [runColumn("steered", text, extra, settings, heat, controller.signal)];
  if (compare) runs.push(runColumn("plain", text, { steering: { features: [] } }, settings, heat, controller.signal));
  const results = await Promise.allSettled(runs);
  for (const r of results) if (r.status === "rejected" && r.reason?.name !== "AbortError") showError(r.reason, "Chat");
  $("#send").disabled = false;
  $("#stop").disabled = true;
  $("#message").focus();
});

$("#message").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) {
    ev.preventDefault();
    $("#chat-form").requestSubmit();
  }
});
$("#stop").addEventListener("click", () => controller?.abort());
$("#clear").addEventListener("click", () => {
  for (const col of Object.values(columns)) { col.history = []; col.strips = []; col.transcript.replaceChildren(); }
});
$("#compare").addEventListener("change", () => {
  $("#col-plain").classList.toggle("hidden", !$("#compare").checked);
  $("#columns").classList.toggle("single", !$("#compare").checked);
});
for (const radio of document.querySelectorAll("input[name=steer-mode]")) {
  radio.addEventListener("change", () => {
    $("#steer-profile").classList.toggle("hidden", steerMode() !== "profile");
    $("#steer-inline").classList.toggle("hidden", steerMode() !== "inline");
  });
}
$("#add-control").addEventListener("click", () => {
  const row = controlRow();
  $("#controls").append(row);
  row.querySelector("input").focus();
});
$("#intensity").addEventListener("input", () => { $("#intensity-out").value = Number($("#intensity").value).toFixed(2); });
$("#heat-mode").addEventListener("change", () => { $("#heat-feature").disabled = $("#heat-mode").value !== "feature"; });

async function loadChoices() {
  try {
    const [models, atts, profiles] = await Promise.all([
      get("/v1/models").catch(() => ({ data: [] })),
      get("/api/saes/attachments"),
      get("/api/profiles").catch(() => ({ profiles: [] })),
    ]);
    const modelSel = $("#model");
    const keep = modelSel.value;
    // every engine's loaded models (the default engine's first), each on a non-default
    // engine named in its option
    const loaded = await get("/api/models").then(loadedModels).catch(() => []);
    const byName = new Map(loaded.map((m) => [m.name, m]));
    modelSel.replaceChildren(...models.data.map((m) => el("option", { value: m.id }, `${m.id}${engineNote(byName.get(m.id))}`)));
    if (keep && models.data.some((m) => m.id === keep)) modelSel.value = keep;
    else if (loaded.length) modelSel.value = loaded[0].name;
    attachments = atts.entries;
    const saeSel = $("#heat-sae");
    const keepSae = saeSel.value;
    saeSel.replaceChildren(...(attachments.length
      ? attachments.map((a) => el("option", { value: `${a.sae_id}@${a.layer}` }, `${a.sae_id} @ layer ${a.layer}`))
      : [el("option", { value: "" }, "no SAE attached: no heat strip")]));
    if (keepSae && attachments.some((a) => `${a.sae_id}@${a.layer}` === keepSae)) saeSel.value = keepSae;
    const d = attachments[0]?.d_sae;
    if (d) $("#heat-feature").max = d - 1;
    $("#profile").replaceChildren(...(profiles.profiles.length
      ? profiles.profiles.map((p) => el("option", { value: p.name }, p.name))
      : [el("option", { value: "" }, "no profiles saved")]));
    if (!models.data.length) notice("No model can serve: register and load one on the Models page.");
  } catch (err) { showError(err, "Playground"); }
}

function applyPreset(preset) {
  document.querySelector("input[name=steer-mode][value=inline]").checked = true;
  document.querySelector("input[name=steer-mode][value=inline]").dispatchEvent(new Event("change"));
  $("#inline-features").value = `${preset.feature}: ${preset.strength}`;
  const match = attachments.find((a) => a.sae_id === preset.saeId
    && (preset.layer === null || String(a.layer) === preset.layer));
  if (preset.saeId && !match) {
    notice(`SAE ${preset.saeId} is not attached: attach it on the SAEs page to steer with feature ${preset.feature}.`, "error");
    return;
  }
  if (match) $("#heat-sae").value = `${match.sae_id}@${match.layer}`;
  $("#heat-mode").value = "feature";
  $("#heat-feature").disabled = false;
  $("#heat-feature").value = String(preset.feature);
  $("#preset-note").textContent = `Preset from the link: feature ${preset.feature} of ${preset.saeId || "the attached SAE"} at strength ${preset.strength}.`;
}

/** "Open in experiments": the first `index: strength` line of these features, with the
 * heat strip's SAE, as the experiments page's preset (?sae_id=…&layer=…&feature=…&strength=…). */
function experimentsHref() {
  const q = new URLSearchParams();
  const [saeId, layer] = $("#heat-sae").value.split("@");
  if (saeId) { q.set("sae_id", saeId); q.set("layer", layer); }
  const m = steerMode() === "inline" && $("#inline-features").value.match(/^\s*(\d+)\s*[:=\s]\s*(-?\d+(?:\.\d+)?)/m);
  if (m) { q.set("feature", m[1]); q.set("strength", m[2]); }
  const qs = q.toString();
  $("#exp-link").href = `/experiments/${qs ? `?${qs}` : ""}`;
}
for (const id of ["#inline-features", "#heat-sae"]) $(id).addEventListener("input", experimentsHref);
$("#heat-sae").addEventListener("change", experimentsHref);
for (const radio of document.querySelectorAll("input[name=steer-mode]")) radio.addEventListener("change", experimentsHref);

events.on("sae:attached", loadChoices);
events.on("sae:detached", loadChoices);
events.on("model:load:complete", loadChoices);
events.onReconnect(loadChoices);
const preset = presetFromURL("feature preset");
loadChoices().then(() => { if (preset) applyPreset(preset); experimentsHref(); });
