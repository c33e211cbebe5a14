"""The dashboards sweeper: ``services.dashboards_sweep`` every BATCH_SWEEP_INTERVAL_S, on a
daemon thread of each process that runs dashboards — the embedded server (started with the
application, millm_site/asgi.py) and every Celery worker of the ``dashboards`` queue
(features/tasks.py). So a run whose runner's task ended without ending it is resumed from
its last checkpoint, and a cancel recorded while no runner held the run still ends it."""

from __future__ import annotations

import threading

import structlog
from django.conf import settings

from core.periodic import Periodic
from features.services import dashboards_sweep

log = structlog.get_logger(__name__)

_sweeper = Periodic(
    "millm-dashboards-sweeper",
    dashboards_sweep,
    interval=lambda: float(settings.BATCH_SWEEP_INTERVAL_S),
    at_once=False,
    log=log,
    started="dashboards_sweeper_started",
    failed="dashboards_sweep_failed",
    done="dashboards_swept",
)


def sweep_once() -> dict[str, int] | None:
    """One sweep; None (and a log line) when it failed: the next one tries again."""
    return _sweeper.once()


def sweeper_start(stop: threading.Event | None = None) -> threading.Thread:
    """Start this process's sweeper once (a later call returns the running thread)."""
    return _sweeper.start(stop)
