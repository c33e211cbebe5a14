"""Background tasks of the registry. Each takes ids (never rows), records its outcome on
its ``Job`` row and calls the same service functions the API and commands call.

Retries are named, not blanket: transient hub errors are retried inside the hub client
(tenacity) and a dropped transfer is resumed by huggingface_hub; anything else ends the
job with its error code on the row, where the API and the admin show it.

Loads run where the engine is: in embedded mode the in-process ``loads`` pool is in the
engine's process. In distributed mode the load command reaches the engine over Redis
(the engine client's transport, a later part of the server).
"""

from __future__ import annotations

import structlog
from celery import shared_task

from millm_site.errors import MillmError
from registry import downloads, services
from registry.models import Job

log = structlog.get_logger(__name__)


def _finish_unexpected(job_id: int, exc: BaseException) -> None:
    job = Job.objects.filter(pk=job_id).first()
    if job is not None and job.status not in Job.FINISHED:
        services.job_finish(job=job, status=Job.Status.FAILED,
                            error=f"Unexpected error: {type(exc).__name__}")


@shared_task(name="registry.tasks.model_download_task")
def model_download_task(job_id: int, hf_token: str | None = None, commit: str | None = None
                        ) -> str:
    try:
        model = downloads.model_download_run(job_id=job_id, hf_token=hf_token, commit=commit)
    except BaseException as exc:
        _finish_unexpected(job_id, exc)
        raise
    return "succeeded" if model is not None else "ended"


@shared_task(name="registry.tasks.sae_download_task")
def sae_download_task(job_id: int, hf_token: str | None = None, commit: str | None = None
                      ) -> str:
    try:
        sae = downloads.sae_download_run(job_id=job_id, hf_token=hf_token, commit=commit)
    except BaseException as exc:
        _finish_unexpected(job_id, exc)
        raise
    return "succeeded" if sae is not None else "ended"


@shared_task(name="registry.tasks.model_load_task")
def model_load_task(job_id: int) -> str:
    job = Job.objects.select_related("model").get(pk=job_id)
    if job.model is None or not services.job_claim(job=job, stage="starting"):
        return "skipped"
    try:
        services.model_load(model=job.model, job=job)
    except MillmError as exc:
        # recorded on the job and the row by the service; nothing to retry
        log.warning("model_load_failed", job_id=job_id, code=exc.code, message=exc.message)
        return "failed"
    except BaseException as exc:
        _finish_unexpected(job_id, exc)
        raise
    return "succeeded"


@shared_task(name="registry.tasks.model_unload_task")
def model_unload_task(job_id: int) -> str:
    job = Job.objects.select_related("model").get(pk=job_id)
    if job.model is None or not services.job_claim(job=job, stage="starting"):
        return "skipped"
    try:
        services.model_unload(model=job.model, job=job)
    except MillmError as exc:
        job.refresh_from_db()
        if job.status not in Job.FINISHED:
            services.job_finish(job=job, status=Job.Status.FAILED, error=exc.message)
        log.warning("model_unload_failed", job_id=job_id, code=exc.code, message=exc.message)
        return "failed"
    except BaseException as exc:
        _finish_unexpected(job_id, exc)
        raise
    return "succeeded"


@shared_task(name="registry.tasks.auto_attach_task")
def auto_attach_task(load_job_id: int | None) -> str:
    from django.conf import settings

    from registry import maintenance

    try:
        results = maintenance.auto_attach(load_job_id=load_job_id,
                                          timeout_s=settings.DOWNLOAD_TIMEOUT)
    except MillmError as exc:
        log.warning("auto_attach_failed", code=exc.code, message=exc.message)
        return "failed"
    return "attached" if results else "skipped"
