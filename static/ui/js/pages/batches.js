// Batches: the Batch API's jobs (GET /v1/batches), each with its status, request counts and
// a progress bar. The rows move on `batch:progress` events (ids, status and counts, never
// a prompt) without re-reading the list; an event for a batch this page has not listed
// yet, and a reconnect, read the list again. Cancel asks first, then
// POST /v1/batches/{id}/cancel. Every figure is also in the row's data attributes.

import { get, post } from "../api.js";
import { $, badge, boot, busy, el, fillRows, notice, showError } from "../dom.js";
import * as events from "../events.js";

boot();

const LIMIT = 100;  // the newest batches (GET /v1/batches answers at most 100 a page)
const TERMINAL = new Set(["completed", "failed", "expired", "cancelled"]);
const KIND = {
  validating: "", in_progress: "warn", finalizing: "warn", cancelling: "warn",
  completed: "ok", failed: "bad", expired: "bad", cancelled: "bad",
};

let batches = [];
let reading = null;

const fmtCreated = (seconds) => new Date(seconds * 1000).toLocaleString();
const short = (id) => (id.length > 18 ? `${id.slice(0, 18)}…` : id);  // the whole id in its title

async function refresh() {
  if (reading) return reading;
  reading = (async () => {
    try {
      const data = await get(`/v1/batches?limit=${LIMIT}`);
      batches = data.data;
      $("#batches-total").textContent = `${batches.length}${data.has_more ? "+" : ""} listed`;
      render();
    } catch (err) { showError(err, "Batches"); } finally { reading = null; }
  })();
  return reading;
}

function percentOf(counts) {
  const done = counts.completed + counts.failed;
  return counts.total ? Math.floor((100 * done) / counts.total) : 0;
}

function progressCell(b) {
  const c = b.request_counts;
  const done = c.completed + c.failed;
  return el("div", { class: "progress-cell" },
    el("progress", { max: 100, value: percentOf(c), "aria-label": `Batch ${b.id} progress` }),
    el("span", { class: "small muted", "aria-hidden": "true" }, `${done} of ${c.total} · ${percentOf(c)}%`));
}

function files(b) {
  const out = [];
  if (b.output_file_id) out.push(el("div", { class: "mono small", title: b.output_file_id,
    dataset: { file: "output" } }, `output ${short(b.output_file_id)}`));
  if (b.error_file_id) out.push(el("div", { class: "mono small status-text bad", title: b.error_file_id,
    dataset: { file: "errors" } }, `errors ${short(b.error_file_id)}`));
  return out.length ? out : "—";
}

function row(b) {
  const c = b.request_counts;
  const cancel = TERMINAL.has(b.status) || b.status === "cancelling" ? null
    : el("button", { type: "button", class: "danger small", "aria-label": `Cancel batch ${b.id}`,
      onclick: (ev) => busy(ev.currentTarget, () => cancelBatch(b), `Cancel ${b.id}`) }, "Cancel");
  return el("tr", { dataset: { batchId: b.id, status: b.status, completed: c.completed,
    failed: c.failed, total: c.total } },
    el("td", { class: "small" }, fmtCreated(b.created_at)),
    el("td", { class: "mono small", title: b.id }, short(b.id)),
    el("td", { class: "mono small" }, b.endpoint),
    el("td", { class: "small" }, b.model || "—"),
    el("td", { class: "status" }, badge(b.status, KIND[b.status] || "")),
    el("td", { class: "num completed" }, c.completed),
    el("td", { class: "num failed" }, c.failed),
    el("td", { class: "num total" }, c.total),
    el("td", {}, progressCell(b)),
    el("td", {}, files(b)),
    el("td", {}, el("div", { class: "actions" }, cancel)));
}

function render() {
  fillRows($("#batches"), batches.map(row),
    "No batches yet: upload a JSONL file to /v1/files and create one with POST /v1/batches.", 11);
}

async function cancelBatch(b) {
  const c = b.request_counts;
  if (!window.confirm(`Cancel batch ${b.id}? ${c.total - c.completed - c.failed} of ${c.total} requests are not answered yet; answered ones are kept.`)) return;
  const out = await post(`/v1/batches/${b.id}/cancel`);
  notice(`Batch ${b.id} is ${out.status}`, "ok");
  update({ batch_id: out.id, status: out.status, request_counts: out.request_counts });
}

/** Apply a batch:progress payload (or a cancel answer) to its row in place. */
function update(data) {
  const i = batches.findIndex((b) => b.id === data.batch_id);
  if (i < 0) { refresh(); return; }
  const b = batches[i];
  const old = b.request_counts;
  const next = data.request_counts;
  // counts only grow within a batch: an event overtaken by a later one changes nothing
  if (next.completed + next.failed < old.completed + old.failed && !TERMINAL.has(data.status)) return;
  batches[i] = { ...b, status: data.status, request_counts: next };
  const tr = $(`#batches tr[data-batch-id="${CSS.escape(b.id)}"]`);
  if (tr) tr.replaceWith(row(batches[i]));
  // a finished batch's files are named by the list (the event carries only counts)
  if (TERMINAL.has(data.status) && !TERMINAL.has(b.status)) refresh();
}

events.on("batch:progress", update);
events.onReconnect(refresh);
$("#refresh").addEventListener("click", (ev) => busy(ev.currentTarget, refresh, "Refresh"));
refresh();
