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
from django.db import close_old_connections, connections

log = structlog.get_logger(__name__)

_started: threading.Thread | None = None
_lock = threading.Lock()


def prune_once() -> dict[str, int] | None:
    """One prune; None (and a log line) when it failed: the next one tries again."""
    from monitoring.services import capture_prune

    close_old_connections()
    try:
        return capture_prune()
    except Exception:  # noqa: BLE001 - a prune that fails must not end the pruner
        log.exception("capture_prune_failed")
        return None
    finally:
        connections.close_all()


def pruner_start(stop: threading.Event | None = None) -> threading.Thread:
    """Start this process's pruner once (a later call returns the running thread); the
    first prune runs at once, so what expired while the server was down goes at start."""
    global _started
    with _lock:
        if _started is not None and _started.is_alive():
            return _started
        stop = stop or threading.Event()

        def loop() -> None:
            interval = float(settings.CAPTURE_PRUNE_INTERVAL_S)
            log.info("capture_pruner_started", interval_s=interval)
            while True:
                done = prune_once()
                if done and any(done.values()):
                    log.info("captures_pruned", **done)
                if stop.wait(interval):
                    return

        _started = threading.Thread(target=loop, name="millm-capture-pruner", daemon=True)
        _started.start()
        return _started
