"""The experiment runner as a Celery task (queue ``experiments``), and, in a worker of
that queue, resuming the runs not ended when it starts (``core.jobs.LongRuns``).

``acks_late`` with ``reject_on_worker_lost`` (``core.jobs.long_run_task``): a runner whose
worker child is killed is not lost with it; its message goes back in the queue and the
next runner takes the run over once the dead one's heartbeat is stale
(BATCH_RUNNER_STALE_S), resuming from the points the run stored. A starting worker of the
queue queues a runner for every run not ended and starts the experiments sweeper."""

from __future__ import annotations

from experiments.runner import experiment_run
from experiments.services import RUNS, experiments_resume
from experiments.sweeper import sweeper_start

# a sweep of EXPERIMENT_MAX_POINTS long generations on a slow backend may take hours
RUN_LIMIT_S = 24 * 3600

experiment_run_task = RUNS.celery_task(experiment_run, limit_s=RUN_LIMIT_S)
_resume_experiments = RUNS.on_worker_ready(resume=experiments_resume, start_sweeper=sweeper_start)
