"""The job lifecycle: a ``Job`` row per download, load or unload — created, claimed by
exactly one worker, its progress recorded on the row and pushed as ``<kind>:progress``
events, finished or cancelled."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from audit.services import audited, job_finished
from core import events
from registry.errors import JobFinished
from registry.models import SAE, Job, Model

_JOB_EVENT_PREFIX = {
    Job.Kind.MODEL_DOWNLOAD: "model:download",
    Job.Kind.SAE_DOWNLOAD: "sae:download",
    Job.Kind.MODEL_LOAD: "model:load",
}


def _job_payload(job: Job) -> dict[str, Any]:
    return {
        "job_id": job.id,
        "kind": job.kind,
        "model_id": job.model_id,
        "sae_id": job.sae_id,
        "status": job.status,
        "progress": job.progress,
        "percent": job.progress,
        "stage": job.stage,
        "bytes_done": job.bytes_done,
        "bytes_total": job.bytes_total,
    }


def job_create(*, kind: str, target: str, model: Model | None = None, sae: SAE | None = None) -> Job:
    return Job.objects.create(kind=kind, target=target, model=model, sae=sae)


def job_claim(*, job: Job, stage: str = "") -> bool:
    """Move a queued job to running, atomically: False when another worker (a redelivered
    task, a second dispatch) already has it or it has ended, and then nothing is run."""
    now = timezone.now()
    claimed = Job.objects.filter(pk=job.pk, status=Job.Status.QUEUED, cancel_requested=False).update(
        status=Job.Status.RUNNING, started_at=now, stage=stage, updated_at=now
    )
    if claimed:
        job.status, job.started_at, job.stage = Job.Status.RUNNING, now, stage
    return bool(claimed)


def job_start(*, job: Job, stage: str = "") -> Job:
    job.status = Job.Status.RUNNING
    job.started_at = timezone.now()
    job.stage = stage
    job.save(update_fields=["status", "started_at", "stage", "updated_at"])
    return job


def job_progress(
    *, job: Job, progress: int, stage: str | None = None, bytes_done: int | None = None, bytes_total: int | None = None
) -> Job:
    """Record progress on the row and push it to WebSocket listeners."""
    job.progress = max(0, min(100, int(progress)))
    fields = ["progress", "updated_at"]
    if stage is not None:
        job.stage = stage
        fields.append("stage")
    if bytes_done is not None:
        job.bytes_done = bytes_done
        fields.append("bytes_done")
    if bytes_total is not None:
        job.bytes_total = bytes_total
        fields.append("bytes_total")
    job.save(update_fields=fields)
    prefix = _JOB_EVENT_PREFIX.get(job.kind)
    if prefix:
        events.publish(f"{prefix}:progress", _job_payload(job))
    return job


def job_finish(*, job: Job, status: str, error: str = "", code: str = "") -> Job:
    """End a job; ``code`` is its error's code, kept as the result of the audit entry of
    the request that asked for it (``audit.services.job_finished``)."""
    if status not in Job.FINISHED:
        raise ValueError(f"{status} is not a final job status")
    job.status = status
    job.error = error
    job.finished_at = timezone.now()
    if status == Job.Status.SUCCEEDED:
        job.progress = 100
    job.save(update_fields=["status", "error", "finished_at", "progress", "updated_at"])
    job_finished(job_id=job.id, status=status, error=error, code=code)
    prefix = _JOB_EVENT_PREFIX.get(job.kind)
    if prefix:
        suffix = "complete" if status == Job.Status.SUCCEEDED else "error"
        events.publish(f"{prefix}:{suffix}", {**_job_payload(job), "error": error})
    return job


@transaction.atomic
@audited("job.cancel", lambda kw, r: ("job", getattr(kw.get("job"), "pk", ""), getattr(kw.get("job"), "kind", "")))
def job_cancel(*, job: Job) -> Job:
    """Ask a running job to stop; a queued one is cancelled at once."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.status in Job.FINISHED:
        raise JobFinished(f"Job {job.id} already {job.status}", details={"job_id": job.id, "status": job.status})
    job.cancel_requested = True
    if job.status == Job.Status.QUEUED:
        job.status = Job.Status.CANCELLED
        job.finished_at = timezone.now()
    job.save(update_fields=["cancel_requested", "status", "finished_at", "updated_at"])
    if job.status == Job.Status.CANCELLED:
        job_finished(job_id=job.id, status=job.status)
    return job
