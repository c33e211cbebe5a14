"""The dashboard runner as a Celery task (queue ``dashboards``), and, in a worker of that
queue, resuming the runs not ended when it starts (``core.jobs.LongRuns``).

``acks_late`` with ``reject_on_worker_lost`` (``core.jobs.long_run_task``): a runner whose
worker child is killed is not lost with it; its message goes back in the queue and the
next runner takes the run over once the dead one's heartbeat is stale
(BATCH_RUNNER_STALE_S), resuming from the run's last checkpoint under DASHBOARD_DIR (a
folder every worker of the queue shares). A starting worker of the queue queues a runner
for every run not ended and starts the dashboards sweeper."""

from __future__ import annotations

from features.runner import dashboard_run
from features.services import RUNS, dashboards_resume
from features.sweeper import sweeper_start

# a run over DASHBOARD_MAX_TOKENS on a slow backend may take hours; the default limits are
# a download's
RUN_LIMIT_S = 24 * 3600

dashboard_run_task = RUNS.celery_task(dashboard_run, limit_s=RUN_LIMIT_S)
_resume_dashboards = RUNS.on_worker_ready(resume=dashboards_resume, start_sweeper=sweeper_start)
