"""The experiments sweeper: ``services.experiments_sweep`` every BATCH_SWEEP_INTERVAL_S, on
a daemon thread of each process that runs experiments — the embedded server (started with
the application, millm_site/asgi.py) and every Celery worker of the ``experiments`` queue
(experiments/tasks.py). So a run whose runner's task ended without ending it is resumed
from the points it stored, and a cancel recorded while no runner held the run still ends
it."""

from __future__ import annotations

import structlog

from experiments.services import RUNS, experiments_sweep

log = structlog.get_logger(__name__)

_sweeper = RUNS.sweeper(experiments_sweep, log=log)

# one sweep (None, and a log line, when it failed: the next one tries again)
sweep_once = _sweeper.once
# start this process's sweeper once (a later call returns the running thread)
sweeper_start = _sweeper.start
