// Small DOM helpers shared by the pages: element building, notices, formatting, and the
// page boot (API key dialog, event socket status).

import { ApiError, apiKey, onUnauthorized, setApiKey } from "./api.js";
import * as events from "./events.js";

/** el("button", {class: "small", onclick: fn}, "text", child…) */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
    else if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "text") node.textContent = value;
    else if (key in node && typeof value !== "string") node[key] = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => [...root.querySelectorAll(sel)];

export function config() {
  const node = document.getElementById("ui-config");
  return node ? JSON.parse(node.textContent) : {};
}

export function describeError(err) {
  if (err instanceof ApiError) {
    const retry = err.retryAfter ? ` (retry in ${err.retryAfter} s)` : "";
    // the field messages the message does not already say (it often quotes them)
    const extra = Object.entries(err.details?.fields || {})
      .map(([k, v]) => [k, [].concat(v).filter((m) => !err.message.includes(String(m)))])
      .filter(([, v]) => v.length)
      .map(([k, v]) => `${k} ${v.join(" ")}`);
    const fields = extra.length ? ": " + extra.join("; ") : "";
    const lease = err.details && err.details.holder
      ? ` (leased by ${err.details.holder} until ${new Date(err.details.expires_at).toLocaleString()})` : "";
    // /v1 refusals name the offending field (`param`); say which, so nothing looks ignored
    const param = err.details && err.details.param && !err.message.includes(err.details.param)
      ? ` (param: ${err.details.param})` : "";
    return `${err.code ? err.code + ": " : ""}${err.message}${param}${fields}${lease}${retry}`;
  }
  return err && err.message ? err.message : String(err);
}

/** A notice in the page's live region; errors stay until dismissed, others fade. */
export function notice(message, kind = "info", { timeout } = {}) {
  const box = document.getElementById("notices");
  if (!box) return null;
  const item = el("div", { class: `notice ${kind}`, role: kind === "error" ? "alert" : null },
    el("span", {}, message),
    el("button", { type: "button", class: "secondary small", "aria-label": "Dismiss",
      onclick: () => item.remove() }, "×"));
  box.append(item);
  while (box.children.length > 4) box.firstElementChild.remove();
  const ttl = timeout ?? (kind === "error" ? 0 : 5000);
  if (ttl) setTimeout(() => item.remove(), ttl);
  return item;
}

export function showError(err, context = "") {
  notice(`${context ? context + ": " : ""}${describeError(err)}`, "error");
}

/** Run an async action from a button: disabled while it runs, errors shown as notices. */
export async function busy(button, fn, context) {
  if (button) button.disabled = true;
  try {
    return await fn();
  } catch (err) {
    showError(err, context);
    return undefined;
  } finally {
    if (button) button.disabled = false;
  }
}

/**
 * A number field's value, checked against the input's own min and max (and whole when
 * `integer`): a value the server would refuse, or one the page would have to replace, is
 * said here instead, naming the field, and nothing is sent. `empty` is what a blank means
 * where a blank is allowed.
 */
export function numberFrom(input, { integer = false, empty } = {}) {
  const label = input.labels?.[0]?.textContent.trim() || input.id;
  const text = input.value.trim();
  const min = input.min === "" ? null : Number(input.min);
  const max = input.max === "" ? null : Number(input.max);
  const v = text === "" ? empty ?? NaN : Number(text);
  const bad = !Number.isFinite(v) || (min !== null && v < min) || (max !== null && v > max)
    || (integer && !Number.isInteger(v));
  if (!bad) { input.removeAttribute("aria-invalid"); return v; }
  input.setAttribute("aria-invalid", "true");
  const range = max === null ? `${min} or more` : `from ${min} to ${max}`;
  throw new Error(`${label} must be ${integer ? "a whole number " : ""}${range}` +
    ` (it is ${text === "" ? "empty" : `“${text}”`})`);
}

/**
 * The feature preset a page's URL carries (?sae_id=…&feature=…&strength=…[&layer=…]; the
 * strength 10 when absent), or null; one that is not a feature index and a strength is
 * said (the link's `name`) and ignored.
 */
export function presetFromURL(name = "preset") {
  const q = new URLSearchParams(location.search);
  if (!q.has("feature")) return null;
  const feature = Number(q.get("feature"));
  const strength = q.has("strength") ? Number(q.get("strength")) : 10;
  if (!Number.isInteger(feature) || feature < 0 || !Number.isFinite(strength)) {
    notice(`The link's ${name} (feature=${q.get("feature")}, strength=${q.get("strength")}) is not a feature index and a strength: ignored.`, "error");
    return null;
  }
  return { saeId: q.get("sae_id") || "", layer: q.get("layer"), feature, strength };
}

export function fmtNumber(value, digits = 0) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

export function fmtMB(mb) {
  if (mb === null || mb === undefined) return "—";
  if (mb >= 1024) return `${(mb / 1024).toFixed(2)} GB`;
  if (mb >= 1) return `${mb.toFixed(1)} MB`;
  return `${(mb * 1024).toFixed(0)} KB`;
}

export function fmtBytes(bytes) {
  if (bytes === null || bytes === undefined) return "—";
  return fmtMB(bytes / 2 ** 20);
}

export function fmtTime(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? iso : d.toLocaleTimeString();
}

export function fmtDateTime(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? iso : d.toLocaleString();
}

export function badge(text, kind = "") { return el("span", { class: `badge ${kind}` }, text); }

const STATUS_KIND = {
  loaded: "ok", ready: "accent", attached: "ok", downloading: "warn", loading: "warn",
  unloading: "warn", error: "bad", failed: "bad", cancelled: "bad", running: "warn",
  queued: "", succeeded: "ok", active: "ok",
};
export const statusBadge = (status) => badge(status, STATUS_KIND[status] || "");

/** Fill a tbody with rows, or one "empty" row spanning the table. */
export function fillRows(tbody, rows, emptyText, columns) {
  tbody.replaceChildren();
  if (!rows.length) {
    tbody.append(el("tr", {}, el("td", { class: "empty", colspan: columns }, emptyText)));
    return;
  }
  tbody.append(...rows);
}

/** Download `data` as a JSON file named `name`. */
export function saveJSON(name, data) {
  const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
  const url = URL.createObjectURL(blob);
  const link = el("a", { href: url, download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

/** Read a file the user picked as JSON. */
export async function readJSONFile(file) {
  return JSON.parse(await file.text());
}

export function debounce(fn, ms) {
  let timer = null;
  const wrapped = (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
  wrapped.flush = (...args) => { clearTimeout(timer); fn(...args); };
  return wrapped;
}

/** Every page calls this first: API key dialog, event socket, config. */
export function boot() {
  const cfg = config();
  const dialog = document.getElementById("api-key-dialog");
  const input = document.getElementById("api-key-input");
  const state = document.getElementById("api-key-state");
  const button = document.getElementById("api-key-button");
  const describe = () => {
    const needed = cfg.api_keys_required;
    state.textContent = needed
      ? (apiKey() ? "This server requires a key; one is stored for this tab." : "This server requires a key and none is stored yet.")
      : "This server has no API keys configured: no key is needed.";
    button.textContent = needed && !apiKey() ? "API key needed" : "API key";
    button.classList.toggle("warn", needed && !apiKey());
  };
  const open = () => { describe(); input.value = ""; dialog.showModal(); input.focus(); };
  button.addEventListener("click", open);
  dialog.addEventListener("close", () => {
    if (dialog.returnValue === "save" && input.value.trim()) {
      setApiKey(input.value.trim());
      events.reconnect();
      notice("API key stored for this tab; reloading data…", "ok");
      setTimeout(() => location.reload(), 400);
    } else if (dialog.returnValue === "clear") {
      setApiKey("");
      events.reconnect();
    }
    describe();
  });
  let prompted = false;
  onUnauthorized(() => {
    if (!prompted && !dialog.open) { prompted = true; open(); }
  });
  describe();
  if (cfg.api_keys_required && !apiKey()) open();
  events.connect(document.getElementById("ws-status"));
  return cfg;
}
