"""The batch runner as a Celery task (queue ``batches``), and resuming batches when a
worker starts."""

from __future__ import annotations

from celery import shared_task
from celery.signals import worker_ready

# a batch runs up to its 24 h completion window; the default limits are a download's
WINDOW_S = 24 * 3600


@shared_task(name="batches.tasks.batch_run_task", acks_late=True,
             soft_time_limit=WINDOW_S + 600, time_limit=WINDOW_S + 900)
def batch_run_task(batch_id: str, force: bool = False) -> str:
    from batches.runner import batch_run

    return batch_run(batch_id=batch_id, force=force)


@worker_ready.connect
def _resume_batches(**kwargs) -> None:
    """A starting worker queues a runner for every unfinished batch: a batch whose runner
    died with its worker is taken over once its heartbeat is stale, and a batch whose
    runner is alive keeps it (the extra task ends ``held``)."""
    import structlog

    from batches.runner import batches_resume

    try:
        batches_resume(force=False)
    except Exception:  # noqa: BLE001 - a worker must start even if this fails
        structlog.get_logger(__name__).exception("batches_resume_failed")
