"""The capture pruner: ``services.capture_prune`` every CAPTURE_PRUNE_INTERVAL_S on a
daemon thread of every process that serves the application (millm_site/asgi.py), in
embedded and distributed mode alike (the web tier sees CAPTURE_DIR: it serves the files).
So captures past CAPTURE_RETENTION_S, and artifacts no row names, leave the disk without
anyone running ``manage.py prune_captures``. Several web processes may prune at once: a
prune deletes rows by id and files with ``missing_ok``, so they never conflict.

The thread holds no database connection between prunes.
"""

from __future__ import annotations

import threading

import structlog
from django.conf import settings

from core.periodic import Periodic
from monitoring.services import capture_prune

log = structlog.get_logger(__name__)


def _prune() -> dict[str, int]:
    return capture_prune()


_pruner = Periodic(
    "millm-capture-pruner",
    _prune,
    interval=lambda: float(settings.CAPTURE_PRUNE_INTERVAL_S),
    at_once=True,
    log=log,
    started="capture_pruner_started",
    failed="capture_prune_failed",
    done="captures_pruned",
)


def prune_once() -> dict[str, int] | None:
    """One prune; None (and a log line) when it failed: the next one tries again."""
    return _pruner.once()


def pruner_start(stop: threading.Event | None = None) -> threading.Thread:
    """Start this process's pruner once (a later call returns the running thread); the
    first prune runs at once, so what expired while the server was down goes at start."""
    return _pruner.start(stop)
