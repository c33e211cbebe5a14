// Live steering of one attachment: sliders and numeric inputs per feature, find by index
// or label, enable/disable, clear, save as a profile. Every change is one call to
// /api/saes/steering*, and the page redraws from the state the server answers.

import { del, get, getJSON, post } from "../api.js";
import { controlEntries, controlRow, controlSummary as describe, steeringCount } from "../controls.js";
import { $, badge, boot, busy, debounce, el, notice, showError } from "../dom.js";
import * as events from "../events.js";

const cfg = boot();
const MAX = cfg.max_strength || 200;

let attachments = [];
let current = null;        // {sae_id, layer, d_sae}
let state = null;          // the server's live state
let labels = {};
const pending = new Set(); // indices added here but not set yet (value 0 until moved)

const target = () => ({ sae_id: current.sae_id, layer: current.layer });
const query = () => `sae_id=${encodeURIComponent(current.sae_id)}&layer=${current.layer}`;

/** Put the server's value back in a feature's row (0 for one added here and not set yet):
 * after a refusal the row must show what runs, not what was refused. */
function restoreRow(index) {
  const row = $(`#features li[data-index="${index}"]`);
  if (!row) return;
  const v = Number(state?.values?.[String(index)] ?? 0);
  const slider = row.querySelector("input[type=range]");
  slider.value = v;
  slider.setAttribute("aria-valuetext", String(v));
  row.querySelector("input[type=number]").value = v;
  row.classList.toggle("neg", v < 0);
}

// One call in flight per feature, and only the newest value waits behind it, so the server
// ends at the value the slider shows however the responses interleave.
const queues = new Map();   // index -> {running, next}

async function setValue(index, value) {
  const q = queues.get(index) || { running: false, next: null };
  queues.set(index, q);
  q.next = value;
  if (q.running) return;
  q.running = true;
  try {
    while (q.next !== null) {
      const v = q.next;
      q.next = null;
      try {
        state = await post("/api/saes/steering", { ...target(), feature_idx: index, value: v });
        pending.delete(index);
      } catch (err) {
        showError(err, `Feature ${index}`);
        await loadState();
        restoreRow(index); // renderState leaves a focused row as typed
        return;
      }
    }
    renderState();
  } finally { q.running = false; }
}

const senders = new Map();
function sender(index) {
  if (!senders.has(index)) senders.set(index, debounce((v) => setValue(index, v), 200));
  return senders.get(index);
}

function featureRow(index, value) {
  const label = labels[String(index)] || "";
  const id = `f-${index}`;
  const slider = el("input", {
    type: "range", id: `${id}-range`, min: -MAX, max: MAX, step: 1, value,
    "aria-label": `Strength of feature ${index}${label ? " (" + label + ")" : ""}`,
    "aria-valuetext": `${value}`,
  });
  const number = el("input", {
    type: "number", id: `${id}-value`, min: -MAX, max: MAX, step: 0.1, value,
    "aria-label": `Value of feature ${index}`,
  });
  const row = el("li", { class: `feature-row${value < 0 ? " neg" : ""}`, dataset: { index } },
    el("span", { class: "index" }, `#${index}`),
    el("span", { class: "label", title: label }, label || el("span", { class: "muted" }, "no label")),
    slider, number,
    el("button", { type: "button", class: "secondary small", "aria-label": `Remove feature ${index}`,
      onclick: (ev) => busy(ev.currentTarget, async () => {
        pending.delete(index);
        state = await del(`/api/saes/steering/${index}?${query()}`);
        renderState();
      }, "Remove") }, "Remove"));
  slider.addEventListener("input", () => {
    number.value = slider.value;
    slider.setAttribute("aria-valuetext", slider.value);
    row.classList.toggle("neg", Number(slider.value) < 0);
    sender(index)(Number(slider.value));
  });
  slider.addEventListener("change", () => sender(index).flush(Number(slider.value)));
  number.addEventListener("change", () => {
    const v = Number(number.value);
    if (number.value.trim() === "" || !Number.isFinite(v) || Math.abs(v) > MAX) {
      const kept = Number(state?.values?.[String(index)] ?? 0);
      notice(`Feature ${index}: a value must lie in −${MAX}…${MAX}; it stays at ${kept}`, "error");
      restoreRow(index);
      return;
    }
    slider.value = v;
    sender(index).flush(v);
  });
  return row;
}

function renderState() {
  const list = $("#features");
  const values = { ...(state?.values || {}) };
  for (const index of pending) if (!(String(index) in values)) values[String(index)] = 0;
  const indices = Object.keys(values).map(Number).sort((a, b) => a - b);
  // Update rows in place: a slider being dragged or typed into keeps its node and value.
  const existing = new Map([...list.children].map((li) => [Number(li.dataset.index), li]));
  const rows = indices.map((i) => {
    const row = existing.get(i);
    if (!row) return featureRow(i, values[String(i)]);
    const busyHere = row.contains(document.activeElement);
    if (!busyHere) {
      row.querySelector("input[type=range]").value = values[String(i)];
      row.querySelector("input[type=number]").value = values[String(i)];
      row.classList.toggle("neg", values[String(i)] < 0);
    }
    return row;
  });
  for (const [i, row] of existing) if (!indices.includes(i)) row.remove();
  rows.forEach((row, n) => { if (list.children[n] !== row) list.insertBefore(row, list.children[n] || null); });
  $("#features-empty").classList.toggle("hidden", indices.length > 0);
  renderControls();
  $("#enabled").checked = Boolean(state?.enabled);
  $("#enabled").disabled = !current;
  const source = state?.source && state.source !== "manual" ? ` · set by a ${state.source}` : "";
  $("#state-note").textContent = state
    ? `${state.enabled ? "on" : "off"} · ${state.active_count} feature(s) applied${source}` : "";
}

function renderControls() {
  const controls = state?.controls || [];
  $("#controls").replaceChildren(...controls.map((c) => el("li", { class: "control-row", dataset: { index: c.index, mode: c.mode } },
    el("span", { class: "index" }, `#${c.index}`),
    el("span", { class: "label" }, labels[String(c.index)] || ""),
    el("span", { class: "control-desc" }, describe(c)),
    el("button", { type: "button", class: "secondary small", "aria-label": `Remove control on feature ${c.index}`,
      onclick: (ev) => busy(ev.currentTarget, async () => {
        state = await del(`/api/saes/steering/${c.index}?${query()}`);
        renderState();
      }, "Remove") }, "Remove"))));
  $("#controls-empty").classList.toggle("hidden", controls.length > 0);
  for (const node of $("#control-form").querySelectorAll("input, select, button")) node.disabled = !current;
}

function freshControl() {
  $("#control-editor").replaceChildren(controlRow());
  $("#control-editor").querySelector("fieldset button")?.remove(); // one row: nothing to remove
}

$("#control-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  if (!current) return;
  const [entry] = controlEntries($("#control-editor"));
  const { index, ...rest } = entry;
  busy($("#control-set"), async () => {
    state = await post("/api/saes/steering", { ...target(), feature_idx: index, ...rest });
    notice(`Feature ${index}: ${describe({ ...rest, mode: rest.mode || "add" })} set`, "ok");
    freshControl();
    renderState();
  }, "Set control");
});
freshControl();

async function loadState() {
  if (!current) { state = null; renderState(); return; }
  try {
    state = await get(`/api/saes/steering?${query()}`);
    renderState();
  } catch (err) { showError(err, "Steering"); }
}

async function loadLabels() {
  labels = {};
  if (!current) return;
  try { labels = (await getJSON(`/ui/saes/${current.sae_id}/labels`)).labels || {}; } catch { labels = {}; }
  const n = Object.keys(labels).length;
  $("#labels-note").textContent = n
    ? `${n} labelled features (from the SAE's feature_labels.json); d_sae = ${current.d_sae}.`
    : `This SAE ships no feature labels: find features by index (0…${(current.d_sae || 1) - 1}).`;
  browse(0);
}

// Browsing: every feature in index order, the labelled ones first when the SAE has
// labels, a page at a time, so even a 16k-feature SAE lists quickly.
const PAGE = 12;
let browsePage = 0;
function browseOrder() {
  const total = current.d_sae || 0;
  const labelled = Object.keys(labels).map(Number)
    .filter((i) => Number.isInteger(i) && i >= 0 && i < total).sort((a, b) => a - b);
  if (!labelled.length) return null;
  const named = new Set(labelled);
  const rest = [];
  for (let i = 0; i < total; i += 1) if (!named.has(i)) rest.push(i);
  return [...labelled, ...rest];
}
function browse(page) {
  if (!current) { showResults([], ""); $("#browse-note").textContent = ""; return; }
  const order = browseOrder();
  const total = order ? order.length : current.d_sae || 0;
  const pages = Math.max(1, Math.ceil(total / PAGE));
  browsePage = Math.max(0, Math.min(pages - 1, page));
  const start = browsePage * PAGE;
  const indices = order ? order.slice(start, start + PAGE)
    : Array.from({ length: Math.min(PAGE, total - start) }, (_, i) => start + i);
  showResults(indices, `Features${order ? " (labelled first)" : ""}, page ${browsePage + 1} of ${pages}`);
  $("#browse-note").textContent = `${order ? "labelled first · " : ""}page ${browsePage + 1} of ${pages}`;
  $("#browse-prev").disabled = browsePage === 0;
  $("#browse-next").disabled = browsePage >= pages - 1;
}
$("#browse-prev").addEventListener("click", () => browse(browsePage - 1));
$("#browse-next").addEventListener("click", () => browse(browsePage + 1));

async function loadAttachments() {
  try {
    attachments = (await get("/api/saes/attachments")).entries;
  } catch (err) { showError(err, "Attachments"); return; }
  const select = $("#attachment");
  const keep = select.value;
  select.replaceChildren(...(attachments.length
    ? attachments.map((a) => el("option", { value: `${a.sae_id}@${a.layer}` }, `${a.sae_id} @ layer ${a.layer} (d_sae ${a.d_sae})`))
    : [el("option", { value: "" }, "no SAE attached")]));
  if (keep && attachments.some((a) => `${a.sae_id}@${a.layer}` === keep)) select.value = keep;
  await choose();
  if (!attachments.length) {
    $("#labels-note").replaceChildren("No SAE is attached: ", el("a", { href: "/saes/" }, "attach one"), " to steer.");
  }
}

async function choose() {
  const value = $("#attachment").value;
  const a = attachments.find((x) => `${x.sae_id}@${x.layer}` === value) || null;
  const changed = !current || !a || current.sae_id !== a.sae_id || current.layer !== a.layer;
  current = a ? { sae_id: a.sae_id, layer: a.layer, d_sae: a.d_sae } : null;
  $("#hook").replaceChildren(...(a ? ["hooks ", badge(a.hook_point || "resid_post", "accent"), " at ",
    el("code", {}, a.layer_module_path)] : []));
  for (const node of [$("#find"), $("#clear"), $("#save-form button")]) node.disabled = !current;
  if (changed) { pending.clear(); $("#features").replaceChildren(); await loadLabels(); }
  await loadState();
}

function showResults(indices, caption) {
  const list = $("#results");
  list.replaceChildren(...indices.map((i) => el("li", { class: "feature-row", style: "grid-template-columns: 4.5rem 1fr auto" },
    el("span", { class: "index" }, `#${i}`),
    el("span", { class: "label" }, labels[String(i)] || ""),
    el("button", { type: "button", class: "small", "aria-label": `Add feature ${i}`, onclick: () => addFeature(i) }, "Add"))));
  list.setAttribute("aria-label", caption || "Search results");
}

function addFeature(index) {
  if (!current) return;
  if (!Number.isInteger(index) || index < 0 || (current.d_sae && index >= current.d_sae)) {
    notice(`No feature ${index}: this SAE has features 0…${current.d_sae - 1}`, "error");
    return;
  }
  if (!(String(index) in (state?.values || {}))) pending.add(index);
  renderState();
  document.getElementById(`f-${index}-range`)?.focus();
}

$("#find-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("#find").value.trim();
  if (!text) return;
  if (/^\d+$/.test(text)) { addFeature(Number(text)); return; }
  const needle = text.toLowerCase();
  const hits = Object.entries(labels).filter(([, l]) => l.toLowerCase().includes(needle)).map(([i]) => Number(i));
  if (!Object.keys(labels).length) notice("This SAE has no labels: search by index.", "error");
  else if (!hits.length) notice(`No label contains “${text}”.`);
  showResults(hits.slice(0, 50), `Features whose label contains “${text}”`);
});

$("#attachment").addEventListener("change", choose);
$("#enabled").addEventListener("change", (ev) => {
  const on = ev.currentTarget.checked;
  busy(ev.currentTarget, async () => {
    state = await post(`/api/saes/steering/${on ? "enable" : "disable"}`, target());
    renderState();
    if (on && !state.enabled) notice("Nothing to apply yet: set a feature's value first.");
  }, on ? "Enable" : "Disable");
});
$("#clear").addEventListener("click", (ev) => busy(ev.currentTarget, async () => {
  pending.clear();
  state = await del(`/api/saes/steering?${query()}`);
  renderState();
}, "Clear"));
$("#save-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  busy(ev.currentTarget.querySelector("button"), async () => {
    const profile = await post("/api/profiles/save-current", {
      ...target(), name: $("#profile-name").value.trim(), description: $("#profile-desc").value.trim() });
    notice(`Saved profile “${profile.name}” (${steeringCount(profile.steering, profile.controls)})`, "ok");
    $("#save-form").reset();
  }, "Save profile");
});

events.on("steering:update", (data) => {
  if (!current || data.sae_id !== current.sae_id || data.layer !== current.layer) return;
  // a drag in progress here wins over the echo of its own earlier value
  if (document.activeElement?.type === "range") return;
  state = data;
  renderState();
});
events.on("sae:attached", loadAttachments);
events.on("sae:detached", loadAttachments);
events.onReconnect(loadAttachments);
loadAttachments();
