"""The dashboard runner as a Celery task (queue ``dashboards``), and, in a worker of that
queue, resuming the runs not ended when it starts.

``acks_late`` with ``reject_on_worker_lost`` (``core.jobs.long_run_task``): a runner whose
worker child is killed is not lost with it; its message goes back in the queue and the
next runner takes the run over once the dead one's heartbeat is stale
(BATCH_RUNNER_STALE_S), resuming from the run's last checkpoint under DASHBOARD_DIR (a
folder every worker of the queue shares)."""

from __future__ import annotations

from celery.signals import worker_ready

from core.jobs import long_run_task
from features.runner import dashboard_run

# a run over DASHBOARD_MAX_TOKENS on a slow backend may take hours; the default limits are
# a download's
RUN_LIMIT_S = 24 * 3600


@long_run_task("features.tasks.dashboard_run_task", limit_s=RUN_LIMIT_S)
def dashboard_run_task(run_id: str, force: bool = False) -> str:
    return dashboard_run(run_id=run_id, force=force)


@worker_ready.connect
def _resume_dashboards(sender=None, **kwargs) -> None:  # noqa: ANN001
    """A starting worker of the ``dashboards`` queue queues a runner for every run not
    ended and starts the dashboards sweeper (``LongRuns.worker_ready``)."""
    from features.services import RUNS, dashboards_resume
    from features.sweeper import sweeper_start

    RUNS.worker_ready(sender, resume=dashboards_resume, start_sweeper=sweeper_start)
