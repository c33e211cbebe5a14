"""The batch runner as a Celery task (queue ``batches``), and, in a worker of that queue,
resuming batches when it starts and the sweeper (batches/sweeper.py) while it runs.

``acks_late`` with ``reject_on_worker_lost``: a runner whose worker child is killed
(SIGKILL, the OOM killer) is not lost with it; its message goes back in the queue and the
next runner takes the batch over once the dead one's heartbeat is stale
(BATCH_RUNNER_STALE_S). The sweeper does the same for a runner that ended any other way
(a database error) and ends a batch whose runner keeps dying (BATCH_MAX_RESUMES)."""

from __future__ import annotations

from celery import shared_task
from celery.signals import worker_ready

from batches.runner import batch_run, batches_resume
from batches.sweeper import sweeper_start

# a batch runs up to its 24 h completion window; the default limits are a download's
WINDOW_S = 24 * 3600


@shared_task(
    name="batches.tasks.batch_run_task",
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=WINDOW_S + 600,
    time_limit=WINDOW_S + 900,
)
def batch_run_task(batch_id: str, force: bool = False) -> str:
    return batch_run(batch_id=batch_id, force=force)


def _consumes(sender, queue: str) -> bool:  # noqa: ANN001
    consumer = getattr(sender, "task_consumer", None)
    queues = getattr(consumer, "queues", None) or []
    return any(getattr(q, "name", None) == queue for q in queues)


@worker_ready.connect
def _resume_batches(sender=None, **kwargs) -> None:  # noqa: ANN001
    """A starting worker of the ``batches`` queue queues a runner for every unfinished
    batch (a batch whose runner died with its worker is taken over once its heartbeat is
    stale; a batch whose runner is alive keeps it, the extra task ends ``held``) and
    starts the sweeper."""
    import structlog
    from django.db import connections

    from inference.responses_store import responses_resume

    batches, responses = _consumes(sender, "batches"), _consumes(sender, "responses")
    if sender is not None and not (batches or responses):
        return
    try:
        if sender is None or batches:
            batches_resume(force=False)
        if sender is None or responses:
            responses_resume(force=False)  # background responses (POST /v1/responses)
    except Exception:  # noqa: BLE001 - a worker must start even if this fails
        structlog.get_logger(__name__).exception("batches_resume_failed")
    finally:
        connections.close_all()  # the children are forked from this process
    sweeper_start()
