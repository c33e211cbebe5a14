// Job progress for the models and SAEs pages: events (…:download:progress,
// model:load:progress) update a progress cell in place; while something is moving, the
// running jobs are also polled so a missed event (a reconnect) cannot freeze a bar; the
// dashboards and experiments pages poll their unfinished runs the same way (pollMoving).

import { get } from "./api.js";
import { el, fmtBytes } from "./dom.js";

/** A progress cell: <progress> + a line of text, found again by its key. */
export function progressCell(key, label, { percent = 0, text = "" } = {}) {
  return el("div", { class: "progress-cell", dataset: { progressKey: key } },
    el("progress", { max: 100, value: percent, "aria-label": label, id: `progress-${key}` }),
    el("span", { class: "small muted", "aria-hidden": "true" }, text || `${percent}%`));
}

export function describeJob(job) {
  const pct = job.percent ?? job.progress ?? 0;
  const bytes = job.bytes_total ? ` · ${fmtBytes(job.bytes_done)} of ${fmtBytes(job.bytes_total)}` : "";
  const stage = job.stage ? ` · ${job.stage}` : "";
  return { percent: pct, text: `${pct}%${bytes}${stage}` };
}

export function updateProgress(key, job) {
  const cell = document.querySelector(`[data-progress-key="${CSS.escape(key)}"]`);
  if (!cell) return false;
  const { percent, text } = describeJob(job);
  const bar = cell.querySelector("progress");
  // progress only moves forward within one job (events and polls may interleave)
  if (Number(bar.dataset.job) !== job.job_id || percent >= Number(bar.value)) {
    bar.value = percent;
    bar.dataset.job = job.job_id ?? "";
    cell.querySelector("span").textContent = text;
  }
  return true;
}

/** Poll running jobs every `ms` while `active()` says something moves. */
export function pollRunning(onJob, active, ms = 1500) {
  let running = false;
  setInterval(async () => {
    if (running || document.hidden || !active()) return;
    running = true;
    try {
      const data = await get("/api/jobs?status=running&limit=50");
      for (const job of data.jobs) onJob({ ...job, job_id: job.id, percent: job.progress });
    } catch { /* the next tick tries again */ } finally { running = false; }
  }, ms);
}

/**
 * Every `ms`, `refresh` each run `moving()` lists (those not finished), one after another,
 * so a missed event cannot freeze a run's bar; an error waits for the next tick.
 */
export function pollMoving(moving, refresh, ms = 1500) {
  let polling = false;
  setInterval(async () => {
    if (polling || document.hidden) return;
    const list = moving();
    if (!list.length) return;
    polling = true;
    try {
      for (const r of list) await refresh(r);
    } catch { /* the next tick tries again */ } finally { polling = false; }
  }, ms);
}

export function jobRow(job) {
  const finished = ["succeeded", "failed", "cancelled"].includes(job.status);
  const { percent, text } = describeJob({ ...job, job_id: job.id });
  return el("tr", {},
    el("td", { class: "mono small" }, `#${job.id} ${job.kind.replace("_", " ")}`),
    el("td", { class: "small" }, job.target),
    el("td", {}, el("span", { class: `badge ${job.status === "succeeded" ? "ok" : job.status === "failed" ? "bad" : finished ? "" : "warn"}` }, job.status),
      job.error ? el("div", { class: "small status-text bad" }, job.error) : null),
    el("td", {}, finished ? el("span", { class: "small muted" }, job.status === "succeeded" ? "done" : "—")
      : progressCell(`job-${job.id}`, `Job ${job.id} progress`, { percent, text })));
}
