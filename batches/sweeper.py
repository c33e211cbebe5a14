"""The batch sweeper: ``services.batches_sweep`` every BATCH_SWEEP_INTERVAL_S, on a
daemon thread of the process that runs batches — the embedded server (started with the
application, millm_site/asgi.py) and every Celery worker that consumes the ``batches``
queue (started when it is ready, batches/tasks.py). So a batch whose runner died is
resumed or failed, and a batch past its completion window ends ``expired``, even when no
runner holds it. The same sweep deletes stored responses older than
RESPONSES_RETENTION_DAYS and resumes or fails the background responses whose runner died
(``inference.responses_store.responses_sweep``), and the audit entries older than
AUDIT_RETENTION_DAYS (``audit.services.audit_prune``); a worker of the ``responses``
queue starts it too.

The thread holds no database connection between sweeps: a Celery prefork worker forks
its children from this process, and a child must not inherit a live connection.
"""

from __future__ import annotations

import threading

import structlog
from django.conf import settings

from audit.services import audit_prune
from batches.services import batches_sweep
from inference.responses_store import responses_sweep
from core.periodic import Periodic

log = structlog.get_logger(__name__)


def _sweep() -> dict[str, int]:
    done = batches_sweep()
    # stored responses past RESPONSES_RETENTION_DAYS, background ones whose runner died
    done.update({f"responses_{k}": v for k, v in responses_sweep().items()})
    # audit entries past AUDIT_RETENTION_DAYS
    done.update({f"audit_{k}": v for k, v in audit_prune().items()})
    return done


_sweeper = Periodic(
    "millm-batch-sweeper",
    _sweep,
    interval=lambda: float(settings.BATCH_SWEEP_INTERVAL_S),
    at_once=False,
    log=log,
    started="batches_sweeper_started",
    failed="batches_sweep_failed",
    done="batches_swept",
)


def sweep_once() -> dict[str, int] | None:
    """One sweep; None (and a log line) when it failed: the next one tries again."""
    return _sweeper.once()


def sweeper_start(stop: threading.Event | None = None) -> threading.Thread:
    """Start this process's sweeper once (a later call returns the running thread); the
    first sweep is one interval after the start."""
    return _sweeper.start(stop)
