"""The experiment runner as a Celery task (queue ``experiments``), and, in a worker of
that queue, resuming the runs not ended when it starts.

``acks_late`` with ``reject_on_worker_lost``: a runner whose worker child is killed is not
lost with it; its message goes back in the queue and the next runner takes the run over
once the dead one's heartbeat is stale (BATCH_RUNNER_STALE_S), resuming from the points
the run stored."""

from __future__ import annotations

from celery import shared_task
from celery.signals import worker_ready

from experiments.runner import experiment_run

# a sweep of EXPERIMENT_MAX_POINTS long generations on a slow backend may take hours
RUN_LIMIT_S = 24 * 3600


@shared_task(
    name="experiments.tasks.experiment_run_task",
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=RUN_LIMIT_S,
    time_limit=RUN_LIMIT_S + 300,
)
def experiment_run_task(run_id: str, force: bool = False) -> str:
    return experiment_run(run_id=run_id, force=force)


def _consumes(sender, queue: str) -> bool:  # noqa: ANN001
    consumer = getattr(sender, "task_consumer", None)
    queues = getattr(consumer, "queues", None) or []
    return any(getattr(q, "name", None) == queue for q in queues)


@worker_ready.connect
def _resume_experiments(sender=None, **kwargs) -> None:  # noqa: ANN001
    """A starting worker of the ``experiments`` queue queues a runner for every run not
    ended (one whose runner died with its worker is taken over once its heartbeat is
    stale; one whose runner is alive keeps it, the extra task ends ``held``) and starts
    the experiments sweeper."""
    import structlog
    from django.db import connections

    from experiments.services import experiments_resume

    if sender is not None and not _consumes(sender, "experiments"):
        return
    try:
        experiments_resume(force=False)
    except Exception:  # noqa: BLE001 - a worker must start even if this fails
        structlog.get_logger(__name__).exception("experiments_resume_failed")
    finally:
        connections.close_all()  # the children are forked from this process
    from experiments.sweeper import sweeper_start

    sweeper_start()
