"""The batch sweeper: ``services.batches_sweep`` every BATCH_SWEEP_INTERVAL_S, on a
daemon thread of the process that runs batches — the embedded server (started with the
application, millm_site/asgi.py) and every Celery worker that consumes the ``batches``
queue (started when it is ready, batches/tasks.py). So a batch whose runner died is
resumed or failed, and a batch past its completion window ends ``expired``, even when no
runner holds it.

The thread holds no database connection between sweeps: a Celery prefork worker forks
its children from this process, and a child must not inherit a live connection.
"""

from __future__ import annotations

import threading

import structlog
from django.conf import settings
from django.db import close_old_connections, connections

log = structlog.get_logger(__name__)

_started: threading.Thread | None = None
_lock = threading.Lock()


def sweep_once() -> dict[str, int] | None:
    """One sweep; None (and a log line) when it failed: the next one tries again."""
    from batches.services import batches_sweep

    close_old_connections()
    try:
        return batches_sweep()
    except Exception:  # noqa: BLE001 - a sweep that fails must not end the sweeper
        log.exception("batches_sweep_failed")
        return None
    finally:
        connections.close_all()


def sweeper_start(stop: threading.Event | None = None) -> threading.Thread:
    """Start this process's sweeper once (a later call returns the running thread)."""
    global _started
    with _lock:
        if _started is not None and _started.is_alive():
            return _started
        stop = stop or threading.Event()

        def loop() -> None:
            log.info("batches_sweeper_started",
                     interval_s=float(settings.BATCH_SWEEP_INTERVAL_S))
            while not stop.wait(float(settings.BATCH_SWEEP_INTERVAL_S)):
                done = sweep_once()
                if done and any(done.values()):
                    log.info("batches_swept", **done)

        _started = threading.Thread(target=loop, name="millm-batch-sweeper", daemon=True)
        _started.start()
        return _started
