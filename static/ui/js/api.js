// Calls to /api (the envelope), /v1 (OpenAI errors, SSE streams) and the UI's own support
// routes. With MILLM_API_KEYS set the key the user typed (sessionStorage, this tab only)
// goes along as Authorization: Bearer.

const KEY_STORE = "millm.apiKey";
const listeners = new Set();

export function apiKey() {
  try { return sessionStorage.getItem(KEY_STORE) || ""; } catch { return ""; }
}

export function setApiKey(key) {
  try {
    if (key) sessionStorage.setItem(KEY_STORE, key); else sessionStorage.removeItem(KEY_STORE);
  } catch { /* storage disabled: the key lives until the page is left */ }
}

/** Called with the error whenever the server refuses for want of a key (401). */
export function onUnauthorized(fn) { listeners.add(fn); return () => listeners.delete(fn); }

export class ApiError extends Error {
  constructor(status, code, message, details = {}, retryAfter = null) {
    super(message || code || `HTTP ${status}`);
    this.status = status;
    this.code = code;
    this.details = details || {};
    this.retryAfter = retryAfter;
  }
}

/** Whether the server wants a key this tab does not have (then nothing is sent). */
export function keyMissing() {
  const node = document.getElementById("ui-config");
  const required = node ? JSON.parse(node.textContent).api_keys_required : false;
  return Boolean(required) && !apiKey();
}

function noKey() {
  const error = new ApiError(401, "UNAUTHORIZED", "This server requires an API key: enter it with the API key button");
  listeners.forEach((fn) => fn(error));
  return error;
}

function headers(extra = {}) {
  const out = { Accept: "application/json", ...extra };
  const key = apiKey();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

async function parse(response) {
  const text = await response.text();
  if (!text) return null;
  try { return JSON.parse(text); } catch { return { raw: text }; }
}

function refusal(response, body) {
  const retry = response.headers.get("Retry-After");
  let error;
  if (body && body.error && typeof body.error === "object") {
    // /api: {code, message, details}; /v1: {message, type, param, code}
    const e = body.error;
    error = new ApiError(response.status, e.code || e.type, e.message,
      e.details || (e.param ? { param: e.param } : {}), retry);
  } else {
    error = new ApiError(response.status, `HTTP_${response.status}`,
      (body && (body.error || body.detail || body.raw)) || response.statusText, {}, retry);
  }
  if (response.status === 401) listeners.forEach((fn) => fn(error));
  return error;
}

/** An /api call: resolves to the envelope's `data`, rejects with ApiError. */
export async function api(method, path, body, { signal, extraHeaders } = {}) {
  if (keyMissing()) throw noKey();
  const init = { method, headers: headers(extraHeaders), signal };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  const data = await parse(response);
  if (!response.ok || (data && data.success === false)) throw refusal(response, data);
  return data && "success" in data ? data.data : data;
}

export const get = (path, opts) => api("GET", path, undefined, opts);
export const post = (path, body, opts) => api("POST", path, body === undefined ? {} : body, opts);
export const put = (path, body, opts) => api("PUT", path, body, opts);
export const patch = (path, body, opts) => api("PATCH", path, body, opts);
export const del = (path, opts) => api("DELETE", path, undefined, opts);

/** Lease ids this tab took or was given, per model (sessionStorage; shown once by the server). */
export function leaseId(modelId) {
  try { return sessionStorage.getItem(`millm.lease.${modelId}`) || ""; } catch { return ""; }
}
export function setLeaseId(modelId, id) {
  try {
    if (id) sessionStorage.setItem(`millm.lease.${modelId}`, id);
    else sessionStorage.removeItem(`millm.lease.${modelId}`);
  } catch { /* storage disabled */ }
}
/** The X-miLLM-Lease header for a model, when this tab holds its lease. */
export function leaseHeaders(modelId) {
  const id = modelId === null || modelId === undefined ? "" : leaseId(modelId);
  return id ? { "X-miLLM-Lease": id } : {};
}

/** Plain JSON GET of a non-envelope route (the UI's support routes). */
export async function getJSON(path) {
  if (keyMissing()) throw noKey();
  const response = await fetch(path, { headers: headers() });
  const data = await parse(response);
  if (!response.ok) throw refusal(response, data);
  return data;
}

// Feature labels per SAE, from its folder's feature_labels.json (none: {}), read once.
const labelCache = new Map();

/** The SAE's feature labels (GET /ui/saes/{id}/labels), read once per SAE; none on a refusal. */
export function labelsOf(saeId) {
  if (!saeId) return Promise.resolve({});
  if (!labelCache.has(saeId)) {
    labelCache.set(saeId, getJSON(`/ui/saes/${encodeURIComponent(saeId)}/labels`)
      .then((d) => d.labels || {}).catch(() => ({})));
  }
  return labelCache.get(saeId);
}

/**
 * POST to a /v1 route with `stream: true` and hand each SSE `data:` payload to onChunk.
 * Resolves with {headers} when `[DONE]` arrives; an error frame rejects with ApiError.
 */
export async function streamV1(path, body, { onChunk, signal } = {}) {
  if (keyMissing()) throw noKey();
  const response = await fetch(path, {
    method: "POST", signal,
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify({ ...body, stream: true }),
  });
  if (!response.ok) throw refusal(response, await parse(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return { headers: response.headers };
      const chunk = JSON.parse(data);
      if (chunk.error) {
        throw new ApiError(response.status, chunk.error.code || chunk.error.type,
          chunk.error.message, { param: chunk.error.param });
      }
      onChunk?.(chunk);
    }
  }
  return { headers: response.headers };
}

/** POST a JSON document as the exact text the user gave (imports keep it verbatim). */
export async function postText(path, text, method = "POST") {
  if (keyMissing()) throw noKey();
  const response = await fetch(path, {
    method, headers: headers({ "Content-Type": "application/json" }), body: text,
  });
  const data = await parse(response);
  if (!response.ok || (data && data.success === false)) throw refusal(response, data);
  return data && "success" in data ? data.data : data;
}

/** GET a route that answers plain text (the documents' exports). */
export async function getText(path) {
  if (keyMissing()) throw noKey();
  const response = await fetch(path, { headers: headers() });
  const text = await response.text();
  if (!response.ok) {
    let body = null;
    try { body = JSON.parse(text); } catch { /* not JSON */ }
    throw refusal(response, body);
  }
  return text;
}

/** GET a binary file (a capture's safetensors) as an ArrayBuffer. */
export async function getBytes(path, { signal } = {}) {
  if (keyMissing()) throw noKey();
  // */*: DRF's content negotiation answers 406 to Accept: application/octet-stream
  const response = await fetch(path, { headers: headers({ Accept: "*/*" }), signal });
  if (!response.ok) throw refusal(response, await parse(response));
  return response.arrayBuffer();
}
