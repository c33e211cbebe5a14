// The circuits page's editor: create a circuit, or edit one's name, narrative, SAEs per
// layer and members (feature, strength, sign, label), saved through the circuits API.
//
// A new circuit is imported (POST /api/circuits/import); an edit replaces the stored
// document in place (PUT /api/circuits/{id}: the same id; the server validates it and a
// refusal changes nothing). Edges, budget, model and unknown fields of the document are
// kept as imported. A serving circuit is refused by the server (409 CIRCUIT_SERVING):
// deactivate it first.

import { getText, postText } from "./api.js";
import { $, describeError, el } from "./dom.js";

const KIND = "mistudio.circuit-definition";
let editing = null;   // {id, name, document} of the circuit being edited, or null (new)
let serial = 0;

function cellInput(attrs, label) {
  return el("td", {}, el("input", { ...attrs, "aria-label": label }));
}

function removeButton(row, what) {
  return el("td", {}, el("button", { type: "button", class: "secondary small", "aria-label": `Remove ${what}`,
    onclick: () => row.remove() }, "×"));
}

function saeRow(ref = {}) {
  serial += 1;
  const row = el("tr", { class: "ce-sae" });
  row.original = ref.original || null;
  row.append(
    cellInput({ type: "number", name: "layer", min: 0, step: 1, value: ref.layer ?? "", style: "width:4.5rem" }, `SAE ${serial} layer`),
    cellInput({ name: "ref", list: "ce-sae-choices", value: ref.ref ?? "", style: "width:100%" }, `SAE ${serial} id or name`),
    removeButton(row, `SAE ${serial}`));
  return row;
}

function memberRow(m = {}) {
  serial += 1;
  const row = el("tr", { class: "ce-member" });
  row.origin = m.origin ?? null;     // index of the document member it came from
  row.original = m.original || null; // that member's feature object (fields kept)
  const sign = el("select", { name: "sign", "aria-label": `Member ${serial} sign` },
    el("option", { value: "1" }, "+1"), el("option", { value: "-1" }, "−1"));
  sign.value = String(m.sign ?? 1);
  row.append(
    cellInput({ type: "number", name: "layer", min: 0, step: 1, value: m.layer ?? "", style: "width:4.5rem" }, `Member ${serial} layer`),
    cellInput({ type: "number", name: "feature", min: 0, step: 1, value: m.feature_idx ?? "", style: "width:5.5rem" }, `Member ${serial} feature`),
    cellInput({ type: "number", name: "strength", step: "any", value: m.strength ?? "", style: "width:5.5rem" }, `Member ${serial} strength`),
    el("td", {}, sign),
    cellInput({ name: "label", value: m.label ?? "", style: "width:100%" }, `Member ${serial} label`),
    removeButton(row, `member ${serial}`));
  return row;
}

// numbers the browser cannot read go to the server as typed, for it to refuse
const val = (row, name) => row.querySelector(`[name=${name}]`).value.trim();
const num = (text) => (text === "" ? null : Number.isFinite(Number(text)) ? Number(text) : text);

/** The definition the form describes, built on the document being edited. */
function buildDocument() {
  const base = editing ? JSON.parse(JSON.stringify(editing.document)) : { kind: KIND, schema_version: "1" };
  const name = $("#ce-name").value.trim();
  const narrative = $("#ce-narrative").value.trim();
  const saes = [...$("#ce-saes").querySelectorAll("tr.ce-sae")].map((row) => {
    const ref = val(row, "ref");
    const layer = num(val(row, "layer"));
    const orig = row.original;
    if (orig && ref === (orig.mistudio_sae_id || orig.sae_id || "")) return { ...orig, layer };
    // another SAE: what the old entry declared about its SAE no longer applies
    return { sae_id: ref || null, layer };
  });
  const rows = [...$("#ce-members").querySelectorAll("tr.ce-member")].map((row) => {
    const label = val(row, "label");
    const feature = { ...(row.original || {}), feature_idx: num(val(row, "feature")),
      strength: num(val(row, "strength")), sign: Number(row.querySelector("[name=sign]").value) };
    if (label) feature.label = label; else delete feature.label;
    return { layer: num(val(row, "layer")), origin: row.origin, feature };
  });
  // rows of a cluster_ref member that stay on its layer stay inside it; every other row is
  // a feature_ref of its own
  const members = [];
  (base.members || []).forEach((m, i) => {
    if ((m.member_kind || "feature_ref") !== "cluster_ref") return;
    const kept = rows.filter((r) => r.origin === i && r.layer === m.layer);
    for (const r of kept) r.used = true;
    if (kept.length) members.push({ ...m, expanded_members: kept.map((r) => r.feature) });
  });
  for (const r of rows) {
    if (r.used) continue;
    const orig = r.origin !== null && (base.members || [])[r.origin];
    const keep = orig && (orig.member_kind || "feature_ref") === "feature_ref" ? orig : {};
    members.push({ ...keep, layer: r.layer, member_kind: "feature_ref", feature: r.feature });
  }
  const doc = { ...base, name, saes, members };
  if (narrative) doc.narrative = narrative; else delete doc.narrative;
  return doc;
}

function setStatus(message) {
  const box = $("#ce-status");
  box.classList.toggle("hidden", !message);
  box.textContent = message || "";
}

/** Fill the editor with a circuit (its exported document), or empty for a new one. */
export async function editCircuit(circuit) {
  setStatus("");
  $("#ce-saes").replaceChildren();
  $("#ce-members").replaceChildren();
  if (!circuit) {
    editing = null;
    $("#editor-h").textContent = "New circuit";
    $("#ce-name").value = "";
    $("#ce-narrative").value = "";
    $("#ce-saes").append(saeRow());
    $("#ce-members").append(memberRow());
    return;
  }
  const document = JSON.parse(await getText(`/api/circuits/${circuit.id}/export`));
  editing = { id: circuit.id, name: circuit.name, document, active: circuit.is_active };
  $("#editor-h").textContent = `Edit circuit: ${circuit.name}`;
  $("#ce-name").value = document.name ?? circuit.name;
  $("#ce-narrative").value = document.narrative ?? "";
  for (const s of document.saes || []) {
    $("#ce-saes").append(saeRow({ layer: s.layer, ref: s.mistudio_sae_id || s.sae_id || "", original: s }));
  }
  (document.members || []).forEach((m, i) => {
    const features = (m.member_kind || "feature_ref") === "cluster_ref" ? m.expanded_members || [] : [m.feature].filter(Boolean);
    for (const f of features) {
      $("#ce-members").append(memberRow({ layer: m.layer, feature_idx: f.feature_idx, strength: f.strength,
        sign: f.sign ?? 1, label: f.label, origin: i, original: f }));
    }
  });
  $("#editor").scrollIntoView({ block: "start" });
}

async function save() {
  const doc = buildDocument();
  const text = JSON.stringify(doc);
  if (!editing) return postText("/api/circuits/import?on_conflict=fail", text);
  return postText(`/api/circuits/${editing.id}`, text, "PUT");
}

/** Wire the editor; `onSaved(circuit)` after a save. */
export function circuitEditor({ onSaved }) {
  $("#ce-add-sae").addEventListener("click", () => { const r = saeRow(); $("#ce-saes").append(r); r.querySelector("input").focus(); });
  $("#ce-add-member").addEventListener("click", () => { const r = memberRow(); $("#ce-members").append(r); r.querySelector("input").focus(); });
  $("#ce-new").addEventListener("click", () => editCircuit(null));
  $("#circuit-editor").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const button = $("#ce-save");
    button.disabled = true;
    setStatus("");
    try {
      const saved = await save();
      const was = editing?.name;
      await editCircuit(saved);
      await onSaved(saved, was);
    } catch (err) {
      setStatus(`Not saved: ${describeError(err)}`);
    } finally {
      button.disabled = false;
    }
  });
  editCircuit(null);
}

/** The registered SAEs as suggestions for the SAE column. */
export function offerSaes(saes) {
  $("#ce-sae-choices").replaceChildren(...saes.flatMap((s) => [
    el("option", { value: s.id }, `${s.name} (${s.id})`),
  ]));
}
