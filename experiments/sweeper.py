"""The experiments sweeper: ``services.experiments_sweep`` every BATCH_SWEEP_INTERVAL_S, on
a daemon thread of each process that runs experiments — the embedded server (started with
the application, millm_site/asgi.py) and every Celery worker of the ``experiments`` queue
(experiments/tasks.py). So a run whose runner's task ended without ending it is resumed
from the points it stored, and a cancel recorded while no runner held the run still ends
it."""

from __future__ import annotations

import threading

import structlog
from django.conf import settings

from core.periodic import Periodic
from experiments.services import experiments_sweep

log = structlog.get_logger(__name__)

_sweeper = Periodic(
    "millm-experiments-sweeper",
    experiments_sweep,
    interval=lambda: float(settings.BATCH_SWEEP_INTERVAL_S),
    at_once=False,
    log=log,
    started="experiments_sweeper_started",
    failed="experiments_sweep_failed",
    done="experiments_swept",
)


def sweep_once() -> dict[str, int] | None:
    """One sweep; None (and a log line) when it failed: the next one tries again."""
    return _sweeper.once()


def sweeper_start(stop: threading.Event | None = None) -> threading.Thread:
    """Start this process's sweeper once (a later call returns the running thread)."""
    return _sweeper.start(stop)
