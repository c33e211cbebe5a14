"""Background tasks that change what the engine holds: load, unload, and the start-up
attach. Each takes ids, records its outcome on its ``Job`` row and calls the same
orchestration services the API and commands call.

Loads run where the engine is reached from: in embedded mode the in-process ``loads``
pool is in the engine's process; in distributed mode a Celery worker on the ``loads``
queue sends the command to the engine over Redis.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog
from celery import shared_task
from django.conf import settings

from core.errors import MillmError
from orchestration import services, startup
from registry.job_lifecycle import job_claim, job_finish
from registry.models import Job
from registry.tasks import finish_unexpected

log = structlog.get_logger(__name__)


class _Heartbeat:
    """While a load or unload runs on a Celery worker, its job row's ``updated_at`` is
    touched every ``services.JOB_HEARTBEAT_S``: a row that stops being touched belongs to a
    worker that died, and ``services.model_jobs_reap`` ends it (embedded mode: the job runs
    in the server's own process, which a restart reconciles)."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> _Heartbeat:
        if not settings.EMBEDDED:
            self.thread = threading.Thread(target=self._beat, name=f"job-{self.job_id}-beat", daemon=True)
            self.thread.start()
        return self

    def _beat(self) -> None:
        from django.db import connection
        from django.utils import timezone

        try:
            while not self.stop.wait(services.JOB_HEARTBEAT_S):
                Job.objects.filter(pk=self.job_id, status=Job.Status.RUNNING).update(updated_at=timezone.now())
        except Exception:  # noqa: BLE001 - a missed beat is the reaper's business
            log.warning("job_heartbeat_failed", job_id=self.job_id, exc_info=True)
        finally:
            connection.close()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)


def _run_model_job(job_id: int, operation: Callable[..., object], name: str) -> str:
    """A load or unload job: claimed by exactly one worker, its outcome on the job row
    (the service records it; a refusal it did not record is recorded here)."""
    job = Job.objects.select_related("model").get(pk=job_id)
    if job.model is None or not job_claim(job=job, stage="starting"):
        return "skipped"
    try:
        with _Heartbeat(job_id):
            operation(model=job.model, job=job)
    except MillmError as exc:  # a named refusal: nothing to retry
        job.refresh_from_db()
        if job.status not in Job.FINISHED:
            job_finish(job=job, status=Job.Status.FAILED, error=exc.message, code=exc.code)
        log.warning(f"{name}_failed", job_id=job_id, code=exc.code, message=exc.message)
        return "failed"
    except BaseException as exc:
        finish_unexpected(job_id, exc)
        raise
    return "succeeded"


@shared_task(name="orchestration.tasks.model_load_task")
def model_load_task(job_id: int) -> str:
    return _run_model_job(job_id, services.model_load, "model_load")


@shared_task(name="orchestration.tasks.model_unload_task")
def model_unload_task(job_id: int) -> str:
    return _run_model_job(job_id, services.model_unload, "model_unload")


@shared_task(name="orchestration.tasks.auto_attach_task")
def auto_attach_task(load_job_id: int | None) -> str:
    try:
        results = startup.auto_attach(load_job_id=load_job_id, timeout_s=settings.DOWNLOAD_TIMEOUT)
    except MillmError as exc:
        log.warning("auto_attach_failed", code=exc.code, message=exc.message)
        return "failed"
    return "attached" if results else "skipped"
