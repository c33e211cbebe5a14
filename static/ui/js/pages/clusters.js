// Clusters: list, detail (members, narrative), activate, deactivate, λ dial, import,
// export, delete.

import { del, get, patch, post, put } from "../api.js";
import { $, badge, boot, busy, el, fillRows, notice, showError } from "../dom.js";
import { dial, exportTo, importForm } from "../documents.js";
import * as events from "../events.js";

const cfg = boot();
const MAX = cfg.max_strength || 200;
let clusters = [];
let selected = null;

const signed = (m) => (m.strength < 0 ? m.strength : (m.sign ?? 1) * m.strength);
const steered = (m, lam) => Math.max(-MAX, Math.min(MAX, signed(m) * lam));

async function refresh() {
  try {
    clusters = (await get("/api/clusters")).clusters;
    render();
    if (selected) await show(selected, false);
  } catch (err) { showError(err, "Clusters"); }
}

function render() {
  const active = clusters.find((c) => c.is_active);
  $("#active-cluster").replaceChildren(active ? badge(`active: ${active.name}`, "ok") : badge("none active"));
  fillRows($("#clusters"), clusters.map((c) => {
    const act = (label, fn, cls = "secondary small") => el("button", { type: "button", class: cls,
      "aria-label": `${label} ${c.name}`, onclick: (ev) => busy(ev.currentTarget, fn, `${label} ${c.name}`) }, label);
    return el("tr", { dataset: { clusterId: c.id } },
      el("th", { scope: "row" }, c.name, c.narrative ? el("div", { class: "small muted" }, c.narrative.slice(0, 120)) : null),
      el("td", { class: "small" }, c.bound ? el("span", { class: "mono" }, `${c.sae_id} @ ${c.layer}`)
        : el("span", { class: "status-text warn" }, c.unbound_reason || "not bound to an attached SAE")),
      el("td", { class: "num" }, c.member_count),
      el("td", {}, c.is_active ? badge(`active · λ ${c.intensity}`, "ok") : badge(`λ ${c.intensity}`)),
      el("td", {}, el("div", { class: "actions" },
        c.is_active
          ? act("Deactivate", async () => { await post(`/api/clusters/${c.id}/deactivate`); await refresh(); })
          : act("Activate", async () => {
            await post(`/api/clusters/${c.id}/activate`, {});
            notice(`Activated ${c.name}: its members are now the live steering`, "ok");
            await refresh();
          }, "small"),
        act("Open", async () => show(c.id, true)),
        act("Export", async () => exportTo(`/api/clusters/${c.id}/export`, `${c.name}.cluster.json`)),
        act("Delete", async () => {
          if (!window.confirm(`Delete cluster ${c.name}?`)) return;
          await del(`/api/clusters/${c.id}`);
          if (selected === c.id) { selected = null; $("#detail").classList.add("hidden"); }
          await refresh();
        }, "danger small"))));
  }), "No clusters yet: import a cluster definition or bundle.", 5);
}

async function show(id, focus) {
  const c = await get(`/api/clusters/${id}`);
  selected = c.id;
  $("#detail").classList.remove("hidden");
  $("#detail-h").textContent = `Cluster: ${c.name}`;
  if (focus || document.activeElement?.id !== "c-name") $("#c-name").value = c.name;
  if (focus || document.activeElement?.id !== "c-narrative") $("#c-narrative").value = c.narrative || "";
  $("#c-binding").replaceChildren(
    c.bound ? `Steers ${c.sae_id} at layer ${c.layer}` : `Not bound: ${c.unbound_reason || "no matching SAE attached"}`,
    c.declared_sae?.ref ? ` · declared SAE ${c.declared_sae.ref}` : "",
    ...(c.warnings || []).map((w) => el("div", { class: "status-text warn" }, `Warning: ${typeof w === "string" ? w : JSON.stringify(w)}`)));
  const members = c.member_details || [];
  const drawMembers = (lam) => fillRows($("#members"), members.map((m) => el("tr", {},
    el("td", { class: "num mono" }, m.feature_idx),
    el("td", {}, m.label || el("span", { class: "muted" }, "—")),
    el("td", { class: "num" }, m.strength),
    el("td", { class: "num" }, m.sign ?? 1),
    el("td", { class: "num" }, steered(m, lam).toFixed(2)))), "No members.", 5);
  drawMembers(c.intensity);
  if (!$("#c-dial").contains(document.activeElement)) $("#c-dial").replaceChildren(dial({
    id: "cluster-lambda", label: `Intensity of ${c.name}`, value: c.intensity, range: c.intensity_range,
    onCommit: async (v) => {
      drawMembers(v);
      try {
        const out = await put(`/api/clusters/${c.id}/intensity`, { intensity: v, reapply: true });
        notice(`λ = ${out.intensity}${out.reapplied ? " (re-applied to the live steering)" : ""}`, "ok");
        await refresh();
      } catch (err) { showError(err, "Intensity"); }
    },
  }));
  if (focus) $("#detail").scrollIntoView({ block: "start" });
}

$("#detail-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  busy($("#c-save"), async () => {
    await patch(`/api/clusters/${selected}`, { name: $("#c-name").value.trim(), narrative: $("#c-narrative").value });
    notice("Saved", "ok");
    await refresh();
  }, "Save");
});

importForm($("#import-form"), "/api/clusters/import?on_conflict=rename", async (out) => {
  const results = out.results || [];
  const ok = results.filter((r) => r.cluster);
  notice(`Imported ${ok.length} of ${results.length} definition(s)`, ok.length ? "ok" : "error");
  for (const r of results.filter((x) => !x.cluster)) notice(`${r.name || "definition"}: ${r.error?.message || r.error?.code || "refused"}`, "error");
  await refresh();
});

events.on("steering:update", () => refresh());
events.on("sae:attached", () => refresh());
events.on("sae:detached", () => refresh());
events.onReconnect(refresh);
refresh();
