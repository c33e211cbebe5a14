// Inline steering controls for the playground (docs/steering.md, "Modes"): one row per
// `steering.features` entry with mode, value, phase, window and condition, sent exactly as
// written so the server, not the page, decides what is valid. And the report under a
// steered answer: per-mode apply counts, the steering hash, and the generated tokens with
// the ones where a conditional control fired highlighted.

import { el } from "./dom.js";

const MODES = ["add", "clamp", "scale", "ablate"];
const PHASES = ["all", "prompt", "completion"];
const VALUE_LABEL = { add: "Strength", clamp: "Target activation", scale: "Factor", ablate: "Value (none)" };
// one colour per conditional control, cycled (the legend names them)
const FIRED_COLOURS = ["#f2b134", "#6cc3a0", "#e07b91", "#8aa9e8"];

let serial = 0;

function field(label, control) {
  return el("label", { class: "control-field" }, el("span", { class: "small muted" }, label), control);
}

/** A control row; `onRemove` is called after it leaves the page. */
export function controlRow(initial = {}) {
  serial += 1;
  const n = serial;
  const num = (name, attrs = {}) => el("input", { type: "number", name, step: "any", ...attrs });
  const mode = el("select", { name: "mode" }, MODES.map((m) => el("option", { value: m }, m)));
  const phase = el("select", { name: "phase" }, PHASES.map((p) => el("option", { value: p }, p)));
  const inputs = {
    index: num("index", { min: 0, step: 1, required: true }), mode,
    value: num("value"), phase,
    start: num("start", { min: 0, step: 1, placeholder: "0" }),
    end: num("end", { min: 1, step: 1, placeholder: "open" }),
    feature: num("cond-feature", { min: 0, step: 1, placeholder: "none" }),
    threshold: num("cond-threshold", { placeholder: "0" }),
  };
  for (const [k, v] of Object.entries(initial)) if (inputs[k] && v !== undefined) inputs[k].value = String(v);
  const valueLabel = el("span", { class: "small muted" }, VALUE_LABEL[mode.value]);
  const sync = () => {
    valueLabel.textContent = VALUE_LABEL[mode.value];
    inputs.value.disabled = mode.value === "ablate";
  };
  mode.addEventListener("change", sync);
  const box = el("fieldset", { class: "control", dataset: { control: n } },
    el("legend", {}, `Control ${n}`),
    el("div", { class: "control-grid" },
      field("Feature", inputs.index), field("Mode", mode),
      el("label", { class: "control-field" }, valueLabel, inputs.value), field("Phase", phase),
      field("Window start", inputs.start), field("Window end", inputs.end),
      field("If feature", inputs.feature), field("is above", inputs.threshold)),
    el("button", { type: "button", class: "secondary small", "aria-label": `Remove control ${n}`,
      onclick: () => box.remove() }, "Remove"));
  box.inputs = inputs;
  sync();
  return box;
}

const given = (input) => input.value.trim() !== "";
// a field the browser cannot read as a number is sent as its text, for the server to refuse
const number = (input) => (Number.isFinite(input.valueAsNumber) ? input.valueAsNumber : input.value);

/** The rows as `steering.features` entries (nothing dropped, nothing checked here). */
export function controlEntries(container) {
  return [...container.querySelectorAll("fieldset.control")].map((box) => {
    const i = box.inputs;
    const entry = { index: given(i.index) ? number(i.index) : null, mode: i.mode.value };
    if (i.mode.value !== "ablate" && given(i.value)) entry.value = number(i.value);
    if (i.phase.value !== "all") entry.phase = i.phase.value;
    if (given(i.start) || given(i.end)) {
      entry.window = { start: given(i.start) ? number(i.start) : 0 };
      if (given(i.end)) entry.window.end = number(i.end);
    }
    if (given(i.feature) || given(i.threshold)) {
      entry.condition = { feature: given(i.feature) ? number(i.feature) : null,
        threshold: given(i.threshold) ? number(i.threshold) : 0 };
    }
    return entry;
  });
}

function shown(token) {
  if (token === "") return "∅";
  return token.replace(/\n/g, "⏎").replace(/\t/g, "⇥");
}

/** A stored control (live steering, a profile) in a few words: "clamp · 3 · in the
 * completion · rows 0…4 · where #2 > 0.5". */
export function controlSummary(c) {
  const parts = [c.mode];
  if (c.mode !== "ablate") parts.push(String(c.value));
  if (c.phase && c.phase !== "all") parts.push(`in the ${c.phase}`);
  if (c.window) parts.push(`rows ${c.window.start}…${c.window.end ?? "end"}`);
  if (c.condition) parts.push(`where #${c.condition.feature} > ${c.condition.threshold}`);
  return parts.join(" · ");
}

/** What a count of values and controls says: "2 values, 1 control". */
export function steeringCount(values, controls) {
  const n = Object.keys(values || {}).length;
  const m = (controls || []).length;
  return `${n} value${n === 1 ? "" : "s"}, ${m} control${m === 1 ? "" : "s"}`;
}

function describeControl(f) {
  return `${f.mode} #${f.index} at ${f.sae_id}@${f.layer}`;
}

/**
 * What ran, under a steered answer: `millm.steering_apply_count[].modes`,
 * `millm.steering.hash`, and, per conditional control of choice 0, where it fired
 * (`steering_fired[].token_indices` highlighted among the generated tokens, and
 * the prompt rows it fired at from `positions`).
 */
export function steeringReport(millm, tokens) {
  const counts = millm?.steering_apply_count || [];
  const hash = millm?.steering?.hash || null;
  const fired = (millm?.steering_fired || []).filter((f) => (f.choice ?? 0) === 0);
  const report = el("div", { class: "steering-report" });
  report.append(el("div", { class: "small apply-counts" }, "Applied: ",
    counts.length ? counts.map((c, k) => el("span", { class: "apply-count", dataset: { sae: c.sae_id, layer: c.layer } },
      k ? " · " : "", `${c.sae_id}@${c.layer} ${c.count} passes`,
      Object.keys(c.modes || {}).length ? " (" : "",
      Object.entries(c.modes || {}).map(([mode, n], j) => el("span", { class: "mode-count", dataset: { mode, count: n } },
        j ? ", " : "", `${mode} ${n}`)),
      Object.keys(c.modes || {}).length ? ")" : ""))
      : el("span", { class: "muted" }, "nothing (no delta was added)")));
  report.append(el("div", { class: "small" }, "Steering hash: ",
    hash ? el("code", { class: "steering-hash" }, hash) : el("span", { class: "muted steering-hash" }, "none (unsteered)")));
  if (!fired.length) return report;

  const lastRow = new Map(); // token index → the controls (their numbers) that fired there
  fired.forEach((f, k) => {
    for (const t of f.token_indices || []) {
      if (!lastRow.has(t)) lastRow.set(t, []);
      lastRow.get(t).push(k);
    }
  });
  const strip = el("div", { class: "fired-strip", role: "list",
    "aria-label": `Generated tokens; the ${[...lastRow.keys()].length} where conditional steering fired are highlighted` });
  tokens.forEach((token, i) => {
    const by = lastRow.get(i) || [];
    const label = `token ${i} ${JSON.stringify(token)}: ` + (by.length
      ? `conditional steering fired (${by.map((k) => describeControl(fired[k])).join("; ")})` : "not fired");
    strip.append(el("span", {
      class: `fired-tok${by.length ? " fired" : ""}`, role: "listitem", title: label, "aria-label": label,
      dataset: { tokenIndex: i, controls: by.join(" ") },
      style: by.length ? `background: ${FIRED_COLOURS[by[0] % FIRED_COLOURS.length]}` : null,
    }, shown(token)));
  });
  const legend = el("ul", { class: "fired-legend small" }, fired.map((f, k) => {
    // rows P−1+i produce token i; the rows before P−1 produced no token: prompt rows
    const rows = [...(f.positions || [])].sort((a, b) => a - b);
    const prompt = rows.slice(0, Math.max(0, rows.length - (f.token_indices || []).length));
    const beyond = (f.token_indices || []).filter((t) => t >= tokens.length);
    return el("li", { class: "fired-control", dataset: {
      positions: (f.positions || []).join(","), tokenIndices: (f.token_indices || []).join(",") } },
      el("span", { class: "swatch", style: `background: ${FIRED_COLOURS[k % FIRED_COLOURS.length]}`, "aria-hidden": "true" }),
      `${describeControl(f)} fired at ${(f.token_indices || []).length} generated token(s)` +
        ((f.token_indices || []).length ? ` (${f.token_indices.join(", ")})` : "") +
        ` · ${prompt.length} prompt row(s)${prompt.length ? " (" + prompt.join(", ") + ")" : ""}` +
        (beyond.length ? ` · ${beyond.length} past the last shown token` : ""));
  }));
  report.append(el("div", { class: "small", style: "margin-top:0.3rem" }, "Where conditional steering fired:"), strip, legend);
  return report;
}
