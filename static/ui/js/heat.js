// The per-token heat strip: one cell per generated token, its background the activation
// at the position that produced the token (row `completion_token_index` of
// millm.sae_activations), either one chosen feature or that position's top feature.

import { el } from "./dom.js";

function rowsByToken(acts) {
  const rows = new Map();
  for (const row of acts.positions || []) {
    if (row.completion_token_index !== null && row.completion_token_index !== undefined) {
      rows.set(row.completion_token_index, row);
    }
  }
  return rows;
}

/** [{token, value, feature, row}] for one answer. */
export function cellsOf({ tokens, acts, feature }) {
  const rows = rowsByToken(acts);
  const count = tokens.length || rows.size;
  const out = [];
  for (let i = 0; i < count; i += 1) {
    const row = rows.get(i) || null;
    let value = 0;
    let index = feature;
    if (row && feature !== null && feature !== undefined) {
      value = (row.features.find((f) => f.feature_index === feature) || { activation: 0 }).activation;
    } else if (row && row.top_k.length) {
      value = row.top_k[0].activation;
      index = row.top_k[0].feature_index;
    }
    out.push({ token: tokens[i] ?? row?.token ?? "", value, feature: index, row });
  }
  return out;
}

export function stripScale(entries) {
  let max = 0;
  for (const e of entries) for (const c of cellsOf(e)) max = Math.max(max, c.value);
  return max > 0 ? max : 1;
}

function shown(token) {
  if (token === "") return "∅";
  return token.replace(/\n/g, "⏎").replace(/\t/g, "⇥");
}

/**
 * Keyboard: the strip is one Tab stop (its current cell); the arrow keys, Home and End move
 * between cells. A focused or hovered cell's values show in the readout below the strip
 * (a title shows on hover only) and are announced from its aria-label.
 */
function wireCells(strip, readout) {
  const cells = () => [...strip.querySelectorAll(".heat-cell")];
  const show = (cell) => { readout.textContent = cell.getAttribute("aria-label"); };
  strip.addEventListener("focusin", (ev) => {
    const cell = ev.target.closest(".heat-cell");
    if (!cell) return;
    for (const c of cells()) c.tabIndex = c === cell ? 0 : -1;
    show(cell);
  });
  strip.addEventListener("mouseover", (ev) => {
    const cell = ev.target.closest(".heat-cell");
    if (cell) show(cell);
  });
  strip.addEventListener("keydown", (ev) => {
    const all = cells();
    const at = all.indexOf(document.activeElement);
    if (at < 0) return;
    const to = { ArrowRight: at + 1, ArrowDown: at + 1, ArrowLeft: at - 1, ArrowUp: at - 1,
      Home: 0, End: all.length - 1 }[ev.key];
    if (to === undefined) return;
    ev.preventDefault();
    all[Math.max(0, Math.min(all.length - 1, to))].focus();
  });
}

export function heatStrip(entry, scale) {
  const cells = cellsOf(entry);
  const what = entry.feature !== null && entry.feature !== undefined ? `feature ${entry.feature}` : "the top feature of each token";
  const strip = el("div", {
    class: "heat-strip", role: "list",
    "aria-label": `Activation of ${what} per generated token (${cells.length} tokens; scale 0 to ${scale.toFixed(2)}; arrow keys move between tokens)`,
    dataset: { cells: cells.length },
  });
  for (const [i, c] of cells.entries()) {
    const alpha = Math.max(0, Math.min(1, c.value / scale));
    const top = c.row ? c.row.top_k.map((t) => `${t.feature_index}: ${t.activation.toFixed(2)}`).join(", ") : "";
    const label = `token ${i + 1} ${JSON.stringify(c.token)}: feature ${c.feature ?? "—"} = ${c.value.toFixed(3)}` +
      (top ? ` (top: ${top})` : "");
    strip.append(el("span", {
      class: "heat-cell", role: "listitem", title: label, "aria-label": label, tabindex: i === 0 ? "0" : "-1",
      dataset: { value: c.value.toFixed(4), feature: c.feature ?? "" },
      style: `background: rgba(var(--pos), ${(0.04 + 0.91 * alpha).toFixed(3)}); color: ${alpha > 0.55 ? "#fff" : "inherit"}`,
    }, shown(c.token)));
  }
  const readout = el("div", { class: "heat-readout", "aria-hidden": "true" });
  wireCells(strip, readout);
  return el("div", {}, strip, readout,
    el("div", { class: "heat-legend", "aria-hidden": "true" },
      "0", el("span", { class: "ramp" }), scale.toFixed(2), ` · ${what}`));
}
