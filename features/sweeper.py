"""The dashboards sweeper: ``services.dashboards_sweep`` every BATCH_SWEEP_INTERVAL_S, on a
daemon thread of each process that runs dashboards — the embedded server (started with the
application, millm_site/asgi.py) and every Celery worker of the ``dashboards`` queue
(features/tasks.py). So a run whose runner's task ended without ending it is resumed from
its last checkpoint, and a cancel recorded while no runner held the run still ends it."""

from __future__ import annotations

import structlog

from features.services import RUNS, dashboards_sweep

log = structlog.get_logger(__name__)

_sweeper = RUNS.sweeper(dashboards_sweep, log=log)

# one sweep (None, and a log line, when it failed: the next one tries again)
sweep_once = _sweeper.once
# start this process's sweeper once (a later call returns the running thread)
sweeper_start = _sweeper.start
