// Features: search one SAE's features (GET /api/saes/{id}/features?q=…&token=…) by their
// labels, explanations and dashboard tokens, or by a token of their logit effects and top
// contexts; each result links to its feature page. The SAE, the query and the token are
// kept in the URL (?sae_id=…&q=…&token=…), so a search can be linked to.

import { get } from "../api.js";
import { $, boot, busy, el, fillRows, fmtNumber, numberFrom, showError } from "../dom.js";
import { featureHref } from "../heat.js";
import { fmtDensity } from "../plots.js";
import * as events from "../events.js";

boot();

const LIMIT = 50;
let shown = 0;
let total = 0;
let last = null;

function matchedText(m) {
  if (typeof m === "string") return m;
  if (m && typeof m === "object") return m.token ?? m.text ?? m.field ?? JSON.stringify(m);
  return String(m);
}

function row(saeId, f) {
  return el("tr", { dataset: { index: f.index, density: f.density ?? "", max: f.max ?? "" } },
    el("td", { class: "num" }, el("a", { href: featureHref(saeId, f.index), class: "mono",
      "aria-label": `Feature ${f.index}${f.label ? `: ${f.label}` : ""}` }, String(f.index))),
    el("td", { class: "label" }, f.label || el("span", { class: "muted" }, "—")),
    el("td", { class: "num density" }, fmtDensity(f.density)),
    el("td", { class: "num max" }, f.max === null || f.max === undefined ? "—" : fmtNumber(f.max, 3)),
    el("td", { class: "small matched" }, (f.matched || []).map(matchedText).join(", ") || "—"));
}

async function search({ more = false } = {}) {
  const saeId = $("#f-sae").value;
  if (!saeId) return;
  const q = $("#f-q").value.trim();
  const token = $("#f-token").value;
  const params = new URLSearchParams({ limit: String(LIMIT), offset: String(more ? shown : 0) });
  if (q) params.set("q", q);
  if (token.trim()) params.set("token", token.trim());
  const url = new URL(location.href);
  url.search = new URLSearchParams({ sae_id: saeId, ...(q ? { q } : {}), ...(token.trim() ? { token: token.trim() } : {}) });
  history.replaceState(null, "", url);
  const data = await get(`/api/saes/${encodeURIComponent(saeId)}/features?${params}`);
  const rows = data.features.map((f) => row(saeId, f));
  if (more) $("#f-results").append(...rows);
  else fillRows($("#f-results"), rows, q || token.trim()
    ? "No feature matches." : "No feature has a label, an explanation or a dashboard yet.", 5);
  shown = (more ? shown : 0) + data.features.length;
  total = data.total;
  last = { saeId, q, token };
  $("#f-total").textContent = `${shown} of ${total}`;
  $("#f-more").classList.toggle("hidden", shown >= total);
}

async function loadSAEs() {
  try {
    const { saes } = await get("/api/saes");
    const sel = $("#f-sae");
    const want = sel.value || new URLSearchParams(location.search).get("sae_id");
    sel.replaceChildren(...(saes.length
      ? saes.map((s) => el("option", { value: s.id },
        `${s.name} (${s.id})${s.attached_layers?.length ? ` · layer ${s.attached_layers.join(", ")}` : ""}`))
      : [el("option", { value: "" }, "no SAE registered")]));
    const attached = saes.find((s) => s.attached_layers?.length);
    if (want && saes.some((s) => s.id === want)) sel.value = want;
    else if (attached) sel.value = attached.id;
    if (!last || last.saeId !== sel.value) await search();
  } catch (err) { showError(err, "Features"); }
}

const initial = new URLSearchParams(location.search);
$("#f-q").value = initial.get("q") || "";
$("#f-token").value = initial.get("token") || "";
$("#search-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  busy($("#f-search"), () => search(), "Search");
});
$("#f-sae").addEventListener("change", () => busy(null, () => search(), "Search"));
$("#f-more").addEventListener("click", (ev) => busy(ev.currentTarget, () => search({ more: true }), "Search"));
$("#open-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  try {
    const index = numberFrom($("#f-index"), { integer: true });
    if (!$("#f-sae").value) throw new Error("No SAE chosen");
    location.href = featureHref($("#f-sae").value, index);
  } catch (err) { showError(err, "Open"); }
});
// a completed run changes what the search finds
events.on("dashboard:complete", (d) => { if (d.sae_id === $("#f-sae").value) busy(null, () => search(), "Search"); });
events.on("sae:attached", loadSAEs);
events.on("sae:detached", loadSAEs);
events.onReconnect(loadSAEs);
loadSAEs();
