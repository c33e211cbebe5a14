// Circuits: list with rungs, layer claims, a layer diagram of members and edges,
// activation through the two gates (rung acknowledgement, layer contention), the λ dial,
// import, export, delete; create and edit in the page (circuit_editor.js).

import { ApiError, del, get, getText, post, put } from "../api.js";
import { $, badge, boot, busy, describeError, el, fillRows, notice, showError } from "../dom.js";
import { circuitEditor, editCircuit, offerSaes } from "../circuit_editor.js";
import { dial, exportTo, importForm } from "../documents.js";
import * as events from "../events.js";

const cfg = boot();
const MAX = cfg.max_strength || 200;
const RUNGS = { 0: "associated", 1: "suggested (attribution-supported)", 2: "causally validated (edge)", 3: "faithfulness-tested (circuit)" };
const SVG = "http://www.w3.org/2000/svg";
let circuits = [];
let selected = null;

const signed = (m) => (m.strength < 0 ? m.strength : (m.sign ?? 1) * m.strength);
const atLambda = (m, lam) => Math.max(-MAX, Math.min(MAX, signed(m) * lam));

async function refresh() {
  try {
    const [list, claims, saes] = await Promise.all([get("/api/circuits"), get("/api/circuits/claims"),
      get("/api/saes").catch(() => ({ saes: [] }))]);
    circuits = list.circuits;
    offerSaes(saes.saes);
    render();
    fillRows($("#claims"), claims.claims.map((c) => el("tr", {},
      el("td", { class: "num" }, c.layer), el("td", {}, c.circuit_name),
      el("td", { class: "mono small" }, c.sae_id), el("td", {}, c.composed ? badge("composed", "warn") : "no"))),
      "No layer is claimed: no circuit is serving.", 4);
    if (selected && !circuits.some((c) => c.id === selected)) {
      // deleted elsewhere, or replaced by an edit (a new id): nothing left to show
      selected = null;
      $("#detail").classList.add("hidden");
    }
    if (selected) {
      try { await show(selected, false); } catch (err) {
        if (!(err instanceof ApiError && err.status === 404)) throw err;
        selected = null;  // gone between the list and its detail
        $("#detail").classList.add("hidden");
      }
    }
  } catch (err) { showError(err, "Circuits"); }
}

function rungBadge(rung) {
  return badge(`${rung} · ${RUNGS[rung]}`, rung >= 2 ? "ok" : "warn");
}

function render() {
  fillRows($("#circuits"), circuits.map((c) => {
    const act = (label, fn, cls = "secondary small") => el("button", { type: "button", class: cls,
      "aria-label": `${label} ${c.name}`, onclick: (ev) => busy(ev.currentTarget, fn, `${label} ${c.name}`) }, label);
    return el("tr", { dataset: { circuitId: c.id } },
      el("th", { scope: "row" }, c.name),
      el("td", {}, rungBadge(c.rung)),
      el("td", { class: "small" }, c.layers.join(", ")),
      el("td", { class: "num" }, `${c.member_count} · ${c.edge_count}`),
      el("td", {}, c.is_active ? badge(`serving · λ ${c.intensity}`, "ok") : badge(`λ ${c.intensity}`)),
      el("td", {}, el("div", { class: "actions" },
        c.is_active
          ? act("Deactivate", async () => { await post(`/api/circuits/${c.id}/deactivate`); notice(`${c.name} released its layers`, "ok"); await refresh(); })
          : act("Activate", async () => { await show(c.id, true); await activate(c, {}); }, "small"),
        act("Open", async () => show(c.id, true)),
        act("Edit", async () => editCircuit(c)),
        act("Export", async () => exportTo(`/api/circuits/${c.id}/export`, `${c.name}.circuit.json`)),
        act("Delete", async () => {
          if (!window.confirm(`Delete circuit ${c.name}?`)) return;
          await del(`/api/circuits/${c.id}`);
          if (selected === c.id) { selected = null; $("#detail").classList.add("hidden"); }
          await refresh();
        }, "danger small"))));
  }), "No circuits yet: import a circuit definition.", 6);
}

/** Activate, and when a gate refuses, explain it and offer what the refusal allows. */
async function activate(c, flags) {
  const gate = $("#gate");
  gate.classList.add("hidden");
  try {
    await post(`/api/circuits/${c.id}/activate`, flags);
    notice(`${c.name} is serving`, "ok");
    await refresh();
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    if (err.code === "UNVALIDATED_CIRCUIT") {
      gateOffer(c, flags, err, "acknowledge_unvalidated",
        `This circuit's weakest edge is rung ${err.details.rung ?? c.rung} (“${err.details.rung_language || RUNGS[c.rung]}”): it is not causally validated.`,
        "I acknowledge that this circuit is not causally validated");
    } else if (err.code === "CIRCUIT_LAYER_CONTENTION" && err.details.overridable) {
      const who = (err.details.incumbents || []).map((i) => i.circuit_name || i.name || i.circuit_id).join(", ");
      gateOffer(c, flags, err, "allow_layer_overlap",
        `Layers ${(err.details.layers || []).join(", ")} are steered by ${who || "another active circuit"}. ${err.details.measured_hazard?.note || ""}`,
        "Compose onto those layers (deltas add up)");
    } else if (err.code === "CIRCUIT_LAYER_CONTENTION") {
      gate.className = "notice error";
      gate.replaceChildren(el("span", {}, `Refused: ${err.message} This cannot be overridden; deactivate the other circuit first.`));
    } else {
      throw err;
    }
  }
}

function gateOffer(c, flags, err, flag, why, consent) {
  const gate = $("#gate");
  const box = el("input", { type: "checkbox", id: "gate-consent" });
  const go = el("button", { type: "button", class: "small", disabled: true,
    onclick: (ev) => busy(ev.currentTarget, () => activate(c, { ...flags, [flag]: true }), "Activate") }, "Activate anyway");
  box.addEventListener("change", () => { go.disabled = !box.checked; });
  gate.className = "notice error";
  gate.replaceChildren(el("div", {},
    el("strong", {}, `${err.code}: `), why,
    el("div", { class: "row", style: "margin-top:0.4rem" },
      el("label", { class: "inline", for: "gate-consent" }, box, consent), go)));
  box.focus();
}

function node(tag, attrs, ...children) {
  const n = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
  for (const child of children) n.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return n;
}

/** Layers as columns, members as boxes, edges as curves styled by their rung. */
function diagram(c, edges) {
  const layers = Object.keys(c.members).map(Number).sort((a, b) => a - b);
  const W = 168, H = 40, GAP_X = 88, GAP_Y = 10, TOP = 46, PAD = 14;
  const rows = Math.max(1, ...layers.map((l) => c.members[String(l)].length));
  const width = PAD * 2 + layers.length * W + (layers.length - 1) * GAP_X;
  const height = TOP + rows * (H + GAP_Y) + PAD;
  const pos = new Map();
  const svg = node("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-labelledby": "diagram-title diagram-desc" });
  svg.append(node("title", { id: "diagram-title" }, `Layer diagram of ${c.name}`),
    node("desc", { id: "diagram-desc" }, `${layers.length} layers, ${c.member_count} members, ${edges.length} edges; the member and edge tables below list the same.`));
  layers.forEach((layer, i) => {
    const x = PAD + i * (W + GAP_X);
    svg.append(node("rect", { class: "layer-band", x: x - 6, y: 4, width: W + 12, height: height - 8, rx: 6 }),
      node("text", { x: x + W / 2, y: 22, "text-anchor": "middle", "font-weight": "600" }, `Layer ${layer}`),
      node("text", { x: x + W / 2, y: 37, "text-anchor": "middle", class: "small", fill: "#55606e" }, (c.serving?.[String(layer)] || c.saes?.find?.((s) => s.layer === layer)?.ref || "").slice(0, 22)));
    c.members[String(layer)].forEach((m, j) => {
      const y = TOP + j * (H + GAP_Y);
      const v = signed(m);
      pos.set(`${layer}:${m.feature_idx}`, { x, y });
      const g = node("g", {});
      g.append(node("rect", { class: `node${v < 0 ? " neg" : ""}`, x, y, width: W, height: H, rx: 5 }),
        node("text", { x: x + 8, y: y + 16, "font-weight": "600" }, `#${m.feature_idx}  ${v > 0 ? "+" : ""}${v}`),
        node("text", { x: x + 8, y: y + 32, fill: "#55606e" }, (m.label || "").slice(0, 24)));
      g.append(node("title", {}, `Layer ${layer}, feature ${m.feature_idx}${m.label ? " (" + m.label + ")" : ""}: strength ${m.strength}, sign ${m.sign ?? 1}`));
      svg.append(g);
    });
    if (!pos.has(`${layer}:null`)) pos.set(`${layer}:null`, { x, y: TOP - 30, header: true });
  });
  for (const e of edges) {
    const a = pos.get(`${e.up.layer}:${e.up.feature_idx ?? null}`) || pos.get(`${e.up.layer}:null`);
    const b = pos.get(`${e.down.layer}:${e.down.feature_idx ?? null}`) || pos.get(`${e.down.layer}:null`);
    if (!a || !b) continue;
    const x1 = a.x + W, y1 = a.y + H / 2, x2 = b.x, y2 = b.y + H / 2;
    const mid = (x1 + x2) / 2;
    const rung = e.rung ?? 0;
    const path = node("path", { class: "edge", d: `M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2 - 6},${y2}`,
      "stroke-width": rung >= 3 ? 3 : rung === 2 ? 2 : 1.5,
      "stroke-dasharray": rung === 0 ? "2 4" : rung === 1 ? "6 4" : "none",
      stroke: rung >= 2 ? "#1f4e79" : "#8a5300", "marker-end": "url(#arrow)" });
    path.append(node("title", {}, `L${e.up.layer} #${e.up.feature_idx ?? "*"} → L${e.down.layer} #${e.down.feature_idx ?? "*"}: rung ${rung} (${RUNGS[rung]})`));
    svg.append(path, node("text", { x: mid, y: (y1 + y2) / 2 - 4, "text-anchor": "middle", fill: rung >= 2 ? "#1f4e79" : "#8a5300", "font-size": 11 }, `r${rung}`));
  }
  svg.prepend(node("defs", {}, node("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
    node("path", { d: "M0,0 L10,5 L0,10 z", fill: "#55606e" }))));
  return svg;
}

async function show(id, focus) {
  const c = await get(`/api/circuits/${id}`);
  let edges = [];
  try { edges = JSON.parse(await getText(`/api/circuits/${id}/export`)).edges || []; } catch { edges = []; }
  selected = c.id;
  $("#detail").classList.remove("hidden");
  $("#detail-h").replaceChildren(`Circuit: ${c.name} `, rungBadge(c.rung), " ", c.is_active ? badge("serving", "ok") : badge("inactive"));
  $("#d-summary").textContent = `${c.narrative ? c.narrative + " · " : ""}layers ${c.layers.join(", ")} · ${c.member_count} members on ${c.saes.length} SAE(s) · ${c.edge_count} edges${c.composed_layers?.length ? " · composed on layers " + c.composed_layers.join(", ") : ""}`;
  $("#diagram").replaceChildren(diagram(c, edges));
  $("#diagram-caption").textContent = "Solid blue edges are causally validated (rung ≥ 2); dashed amber ones are not (rung 1 dashed, rung 0 dotted). Red boxes steer negatively.";
  const members = [];
  for (const layer of Object.keys(c.members).map(Number).sort((a, b) => a - b)) {
    for (const m of c.members[String(layer)]) members.push({ layer, ...m });
  }
  const drawMembers = (lam) => fillRows($("#members"), members.map((m) => el("tr", {},
    el("td", { class: "num" }, m.layer), el("td", { class: "num mono" }, m.feature_idx),
    el("td", {}, m.label || el("span", { class: "muted" }, "—")),
    el("td", { class: "num" }, signed(m)), el("td", { class: "num" }, atLambda(m, lam).toFixed(2)))), "No members.", 5);
  drawMembers(c.intensity);
  fillRows($("#edges"), edges.map((e) => el("tr", {},
    el("td", { class: "mono small" }, `L${e.up.layer} #${e.up.feature_idx ?? "*"}`),
    el("td", { class: "mono small" }, `L${e.down.layer} #${e.down.feature_idx ?? "*"}`),
    el("td", {}, rungBadge(e.rung ?? 0), e.tested_and_failed?.length ? el("div", { class: "small status-text bad" }, `failed at rung ${e.tested_and_failed.join(", ")}`) : null),
    el("td", { class: "small" }, e.type || "computed"))), "No edges: the circuit's rung is 0.", 4);
  if (!$("#d-dial").contains(document.activeElement)) $("#d-dial").replaceChildren(dial({
    id: "circuit-lambda", label: `Intensity of ${c.name}`, value: c.intensity, range: c.intensity_range,
    onCommit: async (v) => {
      drawMembers(v);
      try {
        const out = await put(`/api/circuits/${c.id}/intensity`, { intensity: v, reapply: true,
          acknowledge_unvalidated: Boolean($("#gate-consent")?.checked) });
        notice(`λ = ${out.intensity}${out.reapplied ? " (re-applied)" : ""}`, "ok");
        await refresh();
      } catch (err) {
        if (err instanceof ApiError && err.code === "UNVALIDATED_CIRCUIT") {
          notice(`${describeError(err)} — activate it again with the acknowledgement to re-dial it.`, "error");
        } else showError(err, "Intensity");
      }
    },
  }));
  if (focus) $("#detail").scrollIntoView({ block: "start" });
}

importForm($("#import-form"), "/api/circuits/import?on_conflict=rename", async (c) => {
  notice(`Imported ${c.name} (rung ${c.rung}: ${c.rung_language})`, "ok");
  await refresh();
  await show(c.id, true);
});

circuitEditor({
  onSaved: async (c, was) => {
    notice(was ? `Saved ${c.name} (rung ${c.rung}: ${c.rung_language})` : `Created ${c.name} (rung ${c.rung}: ${c.rung_language})`, "ok");
    await refresh();
    await show(c.id, false);
  },
});

events.on("steering:update", () => refresh());
events.on("sae:attached", () => refresh());
events.on("sae:detached", () => refresh());
events.onReconnect(refresh);
refresh();
