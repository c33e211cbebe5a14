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

/** The feature page of one SAE feature (its dashboard). */
export function featureHref(saeId, index) {
  return `/features/${encodeURIComponent(saeId)}/${index}/`;
}

/**
 * Keyboard: the strip is one Tab stop (its current cell); the arrow keys, Home and End move
 * between cells. A focused or hovered cell's values show in the readout below the strip
 * (a title shows on hover only) and are announced from its aria-label; with `links`, the
 * features of that cell get an "open its dashboard" link each in the line under it.
 */
function wireCells(strip, readout, links) {
  const cells = () => [...strip.querySelectorAll(".heat-cell")];
  const show = (cell) => {
    readout.textContent = cell.getAttribute("aria-label");
    if (links) links(cell);
  };
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

function cellNode(i, label, alpha, dataset, token, extraClass = "") {
  return el("span", {
    class: `heat-cell${extraClass}`, role: "listitem", title: label, "aria-label": label,
    tabindex: i === 0 ? "0" : "-1", dataset,
    style: `background: rgba(var(--pos), ${(0.04 + 0.91 * alpha).toFixed(3)}); color: ${alpha > 0.55 ? "#fff" : "inherit"}`,
  }, shown(token));
}

function legend(scale, what) {
  return el("div", { class: "heat-legend", "aria-hidden": "true" },
    "0", el("span", { class: "ramp" }), scale.toFixed(2), ` · ${what}`);
}

/**
 * The strip of one generated answer. With `entry.saeId`, the line under the readout links
 * each feature of the focused or hovered cell (the one it is coloured by and the
 * position's top features) to its feature page: "open its dashboard", with its label from
 * `entry.labels` ({index: label}) when it has one.
 */
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
    const features = [c.feature, ...(c.row ? c.row.top_k.map((t) => t.feature_index) : [])]
      .filter((f) => f !== null && f !== undefined && f !== "");
    strip.append(cellNode(i, label, alpha,
      { value: c.value.toFixed(4), feature: c.feature ?? "", features: [...new Set(features)].join(",") }, c.token));
  }
  const readout = el("div", { class: "heat-readout", "aria-hidden": "true" });
  let linkLine = null;
  let links = null;
  if (entry.saeId) {
    linkLine = el("div", { class: "heat-features small" });
    const label = (f) => (entry.labels?.[f] ? `: ${entry.labels[f]}` : "");
    links = (cell) => {
      const indices = (cell.dataset.features || "").split(",").filter(Boolean);
      const token = [...strip.children].indexOf(cell) + 1;
      linkLine.replaceChildren(...(indices.length
        ? [`Token ${token}'s features — open its dashboard: `, ...indices.flatMap((f, k) => [k ? " · " : "",
          el("a", { href: featureHref(entry.saeId, f), class: "feature-link", dataset: { feature: f },
            "aria-label": `Open the dashboard of feature ${f}${label(f)} (token ${token})` }, `feature ${f}${label(f)}`)])]
        : []));
    };
  }
  wireCells(strip, readout, links);
  return el("div", {}, strip, readout, linkLine, legend(scale, what));
}

/**
 * One stored context of a feature dashboard: a cell per token, its background the
 * feature's activation there on `scale` (the feature's max, shared by the page's strips),
 * the context's max token marked. `context` is {tokens, activations, max_position,
 * max_activation}.
 */
export function contextStrip(context, scale, { feature, name } = {}) {
  const tokens = context.tokens || [];
  const acts = context.activations || [];
  const strip = el("div", {
    class: "heat-strip context-strip", role: "list",
    "aria-label": `${name || "Context"}: activation of feature ${feature} per token (${tokens.length} tokens; ` +
      `max ${Number(context.max_activation ?? 0).toFixed(3)} at token ${(context.max_position ?? 0) + 1}; arrow keys move between tokens)`,
    dataset: { cells: tokens.length, maxPosition: context.max_position ?? "" },
  });
  for (const [i, token] of tokens.entries()) {
    const value = Number(acts[i] ?? 0);
    const isMax = i === context.max_position;
    const alpha = Math.max(0, Math.min(1, value / scale));
    const label = `token ${i + 1} ${JSON.stringify(token)}: feature ${feature} = ${value.toFixed(3)}${isMax ? " (max)" : ""}`;
    strip.append(cellNode(i, label, alpha, { value: String(value), index: i, ...(isMax ? { max: "1" } : {}) },
      token, isMax ? " max" : ""));
  }
  const readout = el("div", { class: "heat-readout", "aria-hidden": "true" });
  wireCells(strip, readout, null);
  return el("div", { class: "context" }, strip, readout);
}

export { legend as heatLegend };

/**
 * A strip of signed values over tokens (the experiments page's attribution over the prompt):
 * a cell per token, blue for a positive value and red for a negative one, its intensity
 * |value| / `scale`; `data-value` keeps the value exactly and the title and aria-label say
 * it. `describe(i)` may add to a cell's label (e.g. the position's top features).
 */
export function signedStrip(tokens, values, { name = "Values", scale, describe } = {}) {
  const top = scale || Math.max(1e-12, ...values.map((v) => Math.abs(Number(v) || 0)));
  const strip = el("div", {
    class: "heat-strip signed-strip", role: "list",
    "aria-label": `${name} per token (${tokens.length} tokens; scale ±${top.toPrecision(3)}; arrow keys move between tokens)`,
    dataset: { cells: tokens.length },
  });
  for (const [i, token] of tokens.entries()) {
    const value = Number(values[i] ?? 0);
    const alpha = Math.max(0, Math.min(1, Math.abs(value) / top));
    const label = `token ${i + 1} ${JSON.stringify(token)}: ${value.toPrecision(4)}${describe ? describe(i) : ""}`;
    const node = cellNode(i, label, alpha, { value: String(value), index: i }, token, value < 0 ? " neg" : "");
    if (value < 0) node.style.background = `rgba(var(--neg), ${(0.04 + 0.91 * alpha).toFixed(3)})`;
    strip.append(node);
  }
  const readout = el("div", { class: "heat-readout", "aria-hidden": "true" });
  wireCells(strip, readout, null);
  const legendNode = el("div", { class: "heat-legend", "aria-hidden": "true" },
    `−${top.toPrecision(3)}`, el("span", { class: "ramp signed" }), `+${top.toPrecision(3)}`);
  return el("div", { class: "context" }, strip, readout, legendNode);
}
