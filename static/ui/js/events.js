// The /ws/events socket: one connection per page, reconnecting with backoff. Handlers are
// registered by exact event name, by prefix ("model:"), or "*" for everything. Events are
// deltas: after a reconnect, pages read their state back from the REST routes
// (onReconnect).

import { apiKey, keyMissing } from "./api.js";

const handlers = [];
const reconnectHandlers = new Set();
let socket = null;
let attempts = 0;
let everOpened = false;
let openedAt = null;
let statusEl = null;
let stopped = false;

function setStatus(text, cls) {
  if (!statusEl) return;
  statusEl.textContent = `events: ${text}`;
  statusEl.className = `pill ${cls || ""}`;
}

export function on(pattern, fn) {
  handlers.push({ pattern, fn });
  return () => handlers.splice(handlers.findIndex((h) => h.fn === fn), 1);
}

export function onReconnect(fn) { reconnectHandlers.add(fn); }

/** When the socket opened (ms since the epoch), or null while it is not open. */
export function openSince() {
  return socket && socket.readyState === WebSocket.OPEN ? openedAt : null;
}

function dispatch(message) {
  for (const { pattern, fn } of handlers.slice()) {
    const name = message.event || "";
    if (pattern === "*" || pattern === name || (pattern.endsWith(":") && name.startsWith(pattern))) {
      try { fn(message.data || {}, name); } catch (err) { console.warn("event handler failed", err); }
    }
  }
}

export function connect(el) {
  statusEl = el || statusEl;
  if (socket && socket.readyState <= 1) return;
  if (keyMissing()) { setStatus("API key needed", "bad"); return; }
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const key = apiKey();
  const query = key ? `?api_key=${encodeURIComponent(key)}` : "";
  setStatus("connecting", "warn");
  socket = new WebSocket(`${scheme}://${location.host}/ws/events${query}`);
  socket.addEventListener("open", () => {
    openedAt = Date.now();
    setStatus("live", "ok");
    if (everOpened) reconnectHandlers.forEach((fn) => fn());
    everOpened = true;
    attempts = 0;
  });
  socket.addEventListener("message", (ev) => {
    try { dispatch(JSON.parse(ev.data)); } catch (err) { console.warn("bad event", err); }
  });
  socket.addEventListener("close", (ev) => {
    if (stopped) return;
    setStatus(ev.code === 4401 ? "API key needed" : "reconnecting", "bad");
    attempts += 1;
    const delay = Math.min(15000, 500 * 2 ** Math.min(attempts, 5));
    setTimeout(() => connect(), delay);
  });
}

/** Reconnect now (after the API key changed). */
export function reconnect() {
  if (socket) {
    const old = socket;
    socket = null;
    old.close();
  }
  connect();
}

window.addEventListener("pagehide", () => { stopped = true; socket?.close(); });
