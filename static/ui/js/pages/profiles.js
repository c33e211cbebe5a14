// Profiles: list, edit (name, description, SAE/layer, feature map), activate with λ,
// deactivate, import, export, delete.

import { del, get, patch, post } from "../api.js";
import { $, badge, boot, busy, el, fillRows, notice, showError } from "../dom.js";
import { controlSummary, steeringCount } from "../controls.js";
import { dial, exportTo, importForm } from "../documents.js";
import * as events from "../events.js";

const cfg = boot();
const MAX = cfg.max_strength || 200;
let profiles = [];
let editing = null;   // profile id, or "new"
const lambdas = new Map();

async function refresh() {
  try {
    profiles = (await get("/api/profiles")).profiles;
    render();
  } catch (err) { showError(err, "Profiles"); }
}

// A re-render while the user types into a row's dial would swap the input under them:
// wait until focus leaves the table.
let renderDeferred = false;
$("#profiles").addEventListener("focusout", () => {
  if (renderDeferred) { renderDeferred = false; setTimeout(render, 0); }
});

function render() {
  if ($("#profiles").contains(document.activeElement)) { renderDeferred = true; return; }
  const active = profiles.find((p) => p.is_active);
  $("#active-profile").replaceChildren(active ? badge(`active: ${active.name}`, "ok") : badge("none active"));
  fillRows($("#profiles"), profiles.map((p) => {
    const act = (label, fn, cls = "secondary small") => el("button", { type: "button", class: cls,
      "aria-label": `${label} ${p.name}`, onclick: (ev) => busy(ev.currentTarget, fn, `${label} ${p.name}`) }, label);
    return el("tr", { dataset: { profileId: p.id } },
      el("th", { scope: "row" }, p.name, p.description ? el("div", { class: "small muted" }, p.description) : null),
      el("td", { class: "mono small" }, p.sae_id ? `${p.sae_id} @ ${p.layer ?? "?"}` : "—"),
      el("td", { class: "small" }, p.model_id || "—"),
      el("td", { class: "num small" }, steeringCount(p.steering, p.controls)),
      el("td", {}, dial({ id: `lambda-${p.id}`, label: `Intensity of ${p.name}`, value: lambdas.get(p.id) ?? p.intensity ?? 1,
        onCommit: async (v) => {
          lambdas.set(p.id, v);
          if (p.is_active) {
            try { await post(`/api/profiles/${p.id}/activate`, { intensity: v }); notice(`${p.name} re-applied at λ = ${v}`, "ok"); }
            catch (err) { showError(err, "Intensity"); }
          }
        } })),
      el("td", {}, p.is_active ? badge("active", "ok") : badge("inactive")),
      el("td", {}, el("div", { class: "actions" },
        p.is_active
          ? act("Deactivate", async () => { await post(`/api/profiles/${p.id}/deactivate`); await refresh(); })
          : act("Activate", async () => {
            await post(`/api/profiles/${p.id}/activate`, { intensity: lambdas.get(p.id) ?? p.intensity ?? 1 });
            notice(`Activated ${p.name}: it is now the live steering`, "ok");
            await refresh();
          }, "small"),
        act("Edit", async () => startEdit(p)),
        act("Export", async () => exportTo(`/api/profiles/${p.id}/export`, `${p.name}.profile.json`)),
        act("Delete", async () => {
          if (!window.confirm(`Delete profile ${p.name}?`)) return;
          await del(`/api/profiles/${p.id}`);
          if (editing === p.id) startEdit(null);
          await refresh();
        }, "danger small"))));
  }), "No profiles yet: save the current steering on the Steering page, or import one.", 7);
}

function featureEditRow(index = "", strength = "") {
  const row = el("li", { class: "feature-row", style: "grid-template-columns: 7rem 7rem auto" },
    el("input", { type: "number", min: 0, value: index, "aria-label": "Feature index", class: "p-index", required: true }),
    el("input", { type: "number", min: -MAX, max: MAX, step: 0.1, value: strength, "aria-label": "Strength", class: "p-strength", required: true }),
    el("button", { type: "button", class: "secondary small", "aria-label": "Remove this feature", onclick: () => row.remove() }, "Remove"));
  return row;
}

function startEdit(p) {
  editing = p ? p.id : "new";
  $("#edit-empty").classList.add("hidden");
  $("#edit-name").textContent = p ? p.name : "new profile";
  $("#p-name").value = p?.name || "";
  $("#p-desc").value = p?.description || "";
  $("#p-sae").value = p?.sae_id || "";
  $("#p-layer").value = p?.layer ?? "";
  $("#p-features").replaceChildren(...Object.entries(p?.steering || {}).map(([i, s]) => featureEditRow(i, s)));
  // controls are shown, not edited here: a save sends no `controls`, so they are kept
  const controls = p?.controls || [];
  $("#p-controls").replaceChildren(...controls.map((c) => el("li", { class: "control-row", dataset: { index: c.index, mode: c.mode } },
    el("span", { class: "index" }, `#${c.index}`), " ", el("span", { class: "control-desc" }, controlSummary(c)))));
  $("#p-controls-box").classList.toggle("hidden", !controls.length);
  $("#p-name").focus();
}

$("#p-add").addEventListener("click", () => {
  const row = featureEditRow();
  $("#p-features").append(row);
  row.querySelector("input").focus();
});
$("#p-new").addEventListener("click", () => startEdit(null));
$("#edit-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  if (!editing) { startEdit(null); return; }
  // two rows for one feature would merge into one key, the last row winning: say so first
  const rowsOf = new Map();
  for (const row of $("#p-features").children) {
    const index = String(Number(row.querySelector(".p-index").value));
    rowsOf.set(index, [...(rowsOf.get(index) || []), row]);
  }
  const twice = [...rowsOf].filter(([, rows]) => rows.length > 1);
  for (const row of $("#p-features").children) {
    const input = row.querySelector(".p-index");
    if (twice.some(([, rows]) => rows.includes(row))) input.setAttribute("aria-invalid", "true");
    else input.removeAttribute("aria-invalid");
  }
  if (twice.length) {
    notice(`${twice.map(([i, rows]) => `Feature ${i} is listed ${rows.length} times`).join("; ")}: ` +
      "keep one row per feature. Nothing was saved.", "error");
    twice[0][1][1].querySelector(".p-index").focus();
    return;
  }
  const steering = {};
  for (const row of $("#p-features").children) {
    steering[row.querySelector(".p-index").value] = Number(row.querySelector(".p-strength").value);
  }
  const body = { name: $("#p-name").value.trim(), description: $("#p-desc").value, steering,
    sae_id: $("#p-sae").value.trim() || null, layer: $("#p-layer").value === "" ? null : Number($("#p-layer").value) };
  busy($("#p-save"), async () => {
    const saved = editing === "new" ? await post("/api/profiles", body) : await patch(`/api/profiles/${editing}`, body);
    notice(`Saved ${saved.name}`, "ok");
    editing = saved.id;
    $("#edit-name").textContent = saved.name;
    await refresh();
  }, "Save");
});

importForm($("#import-form"), "/api/profiles/import?on_conflict=rename", async (p) => {
  notice(`Imported ${p.name}`, "ok");
  await refresh();
});

events.on("steering:update", () => refresh());
events.onReconnect(refresh);
refresh();
