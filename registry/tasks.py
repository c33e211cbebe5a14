"""Background tasks of the registry. Each takes ids (never rows), records its outcome on
its ``Job`` row and calls the same service functions the API and commands call.

Retries are named, not blanket: transient hub errors are retried inside the hub client
(tenacity) and a dropped transfer is resumed by huggingface_hub; anything else ends the
job with its error code on the row, where the API and the admin show it.
Loads, unloads and attaches are ``orchestration.tasks``.
"""

from __future__ import annotations

import structlog
from celery import shared_task

from registry import download_run, job_lifecycle
from registry.models import Job

log = structlog.get_logger(__name__)


def finish_unexpected(job_id: int, exc: BaseException) -> None:
    job = Job.objects.filter(pk=job_id).first()
    if job is not None and job.status not in Job.FINISHED:
        job_lifecycle.job_finish(job=job, status=Job.Status.FAILED, error=f"Unexpected error: {type(exc).__name__}")


@shared_task(name="registry.tasks.model_download_task")
def model_download_task(job_id: int, hf_token: str | None = None, commit: str | None = None) -> str:
    try:
        model = download_run.model_download_run(job_id=job_id, hf_token=hf_token, commit=commit)
    except BaseException as exc:
        finish_unexpected(job_id, exc)
        raise
    return "succeeded" if model is not None else "ended"


@shared_task(name="registry.tasks.sae_download_task")
def sae_download_task(job_id: int, hf_token: str | None = None, commit: str | None = None) -> str:
    try:
        sae = download_run.sae_download_run(job_id=job_id, hf_token=hf_token, commit=commit)
    except BaseException as exc:
        finish_unexpected(job_id, exc)
        raise
    return "succeeded" if sae is not None else "ended"
