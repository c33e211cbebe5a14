"""Dispatch of background tasks: Celery in distributed mode, an in-process pool embedded.

Embedded mode has no broker, and ``task_always_eager`` would run a download inside the
request that asked for it; a small thread pool keeps the request fast while still running
the very same Celery task function (``task.apply``) so both modes share one code path.
Dispatch always happens after the surrounding transaction commits, so a task never looks
for a row that is not there yet.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog
from django.conf import settings
from django.db import close_old_connections, connections, transaction

log = structlog.get_logger(__name__)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=settings.MAX_DOWNLOAD_WORKERS,
                                       thread_name_prefix="millm-task")
        return _pool


def _run_in_process(task: Any, args: tuple, kwargs: dict, future: Future) -> None:
    close_old_connections()
    try:
        result = task.apply(args=args, kwargs=kwargs)
        future.set_result(result.result)
    except BaseException as exc:  # noqa: BLE001 - surfaced through the future and the log
        log.exception("in_process_task_failed", task=task.name)
        future.set_exception(exc)
    finally:
        # Pool threads outlive the task: a connection left open here would pin a
        # PostgreSQL session (and block dropping the test database).
        connections.close_all()


def enqueue(task: Any, *args: Any, **kwargs: Any) -> Future:
    """Run ``task(*args, **kwargs)`` in the background once the transaction commits."""
    future: Future = Future()

    def dispatch() -> None:
        if settings.MILLM_TASKS_IN_PROCESS:
            _executor().submit(_run_in_process, task, args, kwargs, future)
        else:
            task.apply_async(args=args, kwargs=kwargs)
            future.set_result(None)

    transaction.on_commit(dispatch)
    return future
