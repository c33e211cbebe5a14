"""The dashboard runner as a Celery task (queue ``dashboards``), and, in a worker of that
queue, resuming the runs not ended when it starts.

``acks_late`` with ``reject_on_worker_lost``: a runner whose worker child is killed is not
lost with it; its message goes back in the queue and the next runner takes the run over
once the dead one's heartbeat is stale (BATCH_RUNNER_STALE_S), resuming from the run's
last checkpoint under DASHBOARD_DIR (a folder every worker of the queue shares)."""

from __future__ import annotations

from celery import shared_task
from celery.signals import worker_ready

from features.runner import dashboard_run

# a run over DASHBOARD_MAX_TOKENS on a slow backend may take hours; the default limits are
# a download's
RUN_LIMIT_S = 24 * 3600


@shared_task(
    name="features.tasks.dashboard_run_task",
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=RUN_LIMIT_S,
    time_limit=RUN_LIMIT_S + 300,
)
def dashboard_run_task(run_id: str, force: bool = False) -> str:
    return dashboard_run(run_id=run_id, force=force)


def _consumes(sender, queue: str) -> bool:  # noqa: ANN001
    consumer = getattr(sender, "task_consumer", None)
    queues = getattr(consumer, "queues", None) or []
    return any(getattr(q, "name", None) == queue for q in queues)


@worker_ready.connect
def _resume_dashboards(sender=None, **kwargs) -> None:  # noqa: ANN001
    """A starting worker of the ``dashboards`` queue queues a runner for every run not
    ended (a run whose runner died with its worker is taken over once its heartbeat is
    stale; one whose runner is alive keeps it, the extra task ends ``held``) and starts the
    dashboards sweeper."""
    import structlog
    from django.db import connections

    from features.services import dashboards_resume

    if sender is not None and not _consumes(sender, "dashboards"):
        return
    try:
        dashboards_resume(force=False)
    except Exception:  # noqa: BLE001 - a worker must start even if this fails
        structlog.get_logger(__name__).exception("dashboards_resume_failed")
    finally:
        connections.close_all()  # the children are forked from this process
    from features.sweeper import sweeper_start

    sweeper_start()
