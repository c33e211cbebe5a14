"""Dispatch of background tasks: Celery in distributed mode, in-process pools embedded.

Embedded mode has no broker, and ``task_always_eager`` would run a download inside the
request that asked for it; small thread pools keep the request fast while still running
the very same Celery task function (``task.apply``) so both modes share one code path.
There is one pool per queue, each sized from its setting: ``downloads``
(MAX_DOWNLOAD_WORKERS), ``loads`` (MAX_LOAD_WORKERS; the engine lives in this process, so
loads belong here), ``maintenance``, ``batches`` (one Batch API runner at a time, each
keeping BATCH_ENGINE_ROWS lines at the engine) and ``responses`` (background responses of
POST /v1/responses, RESPONSES_BACKGROUND_WORKERS at once) and ``dashboards`` (feature
dashboard runs, DASHBOARD_WORKERS at once). In distributed mode the queue names route the task
to the Celery workers that consume them.

Dispatch always happens after the surrounding transaction commits, so a task never looks
for a row that is not there yet.

The long runs these tasks start (a batch's runner, a background response's) share their
runner id (``new_runner_id``) and their run-scoped executor (``run_with_closing_pool``).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import structlog
from django.conf import settings
from django.db import close_old_connections, connections, transaction

from core.runtime import runtime

log = structlog.get_logger(__name__)

QUEUES = ("downloads", "loads", "maintenance", "batches", "responses", "dashboards")
RUN_EXECUTOR_THREADS = 4

T = TypeVar("T")


def _pool_size(queue: str) -> int:
    if queue == "loads":
        return int(settings.MAX_LOAD_WORKERS)
    if queue == "downloads":
        return int(settings.MAX_DOWNLOAD_WORKERS)
    if queue == "responses":
        return int(settings.RESPONSES_BACKGROUND_WORKERS)
    if queue == "dashboards":
        return int(settings.DASHBOARD_WORKERS)
    return 1


def _run_in_process(task: Any, args: tuple, kwargs: dict, future: Future) -> None:
    close_old_connections()
    try:
        result = task.apply(args=args, kwargs=kwargs)
        if result.failed():
            raise result.result
        future.set_result(result.result)
    except BaseException as exc:  # noqa: BLE001 - surfaced through the future and the log
        log.error("in_process_task_failed", task=task.name, error=repr(exc))
        future.set_exception(exc)
    finally:
        # Pool threads outlive the task: a connection left open here would pin a
        # PostgreSQL session (and block dropping the test database).
        connections.close_all()


def resolve_task(task: Any) -> Any:
    """The Celery task ``task`` names, or ``task`` itself when it is one already.

    Services enqueue their own tasks by name (``"orchestration.tasks.model_load_task"``):
    the task module imports the service it runs, and a service importing its task back
    would close a circle. A task's name is its module path and function name (each
    ``@shared_task(name=...)`` says so); the module is imported here, at dispatch.
    """
    if not isinstance(task, str):
        return task
    module, _, attr = task.rpartition(".")
    found = getattr(importlib.import_module(module), attr, None) if module else None
    if found is None or getattr(found, "name", None) != task:
        raise ValueError(f"no task named {task!r}")
    return found


class JobDispatch:
    """The process's task dispatch (a runtime part: ``runtime().jobs``): Celery in
    distributed mode, one in-process pool per queue embedded, created on first use."""

    def __init__(self) -> None:
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def executor(self, queue: str) -> ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(queue)
            if pool is None:
                pool = ThreadPoolExecutor(max_workers=_pool_size(queue), thread_name_prefix=f"millm-{queue}")
                self._pools[queue] = pool
            return pool

    def enqueue(
        self,
        task: Any,
        *args: Any,
        queue: str = "maintenance",
        secret_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Future:
        """Run ``task(*args, **kwargs)`` in the background once the transaction commits;
        ``task`` is a task or its name (``resolve_task``).

        ``secret_kwargs`` (a per-request hub token) reach the task but never its logged or
        inspected representation: in process they stay in memory, and Celery is told to
        show them masked (``kwargsrepr``).
        """
        if queue not in QUEUES:
            raise ValueError(f"unknown queue {queue!r}")
        task = resolve_task(task)
        future: Future = Future()
        secrets = {k: v for k, v in (secret_kwargs or {}).items() if v is not None}
        all_kwargs = {**kwargs, **secrets}

        def dispatch() -> None:
            if settings.MILLM_TASKS_IN_PROCESS:
                self.executor(queue).submit(_run_in_process, task, args, all_kwargs, future)
            else:
                shown = {**kwargs, **{k: "***" for k in secrets}}
                task.apply_async(args=args, kwargs=all_kwargs, queue=queue, argsrepr=repr(args), kwargsrepr=repr(shown))
                future.set_result(None)

        transaction.on_commit(dispatch)
        return future

    def shutdown(self, wait: bool = False) -> None:
        """Stop the in-process pools (tests, process exit)."""
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.shutdown(wait=wait, cancel_futures=True)


def enqueue(
    task: Any, *args: Any, queue: str = "maintenance", secret_kwargs: dict[str, Any] | None = None, **kwargs: Any
) -> Future:
    """``runtime().jobs.enqueue``: ``task`` in the background once the transaction commits."""
    return runtime().jobs.enqueue(task, *args, queue=queue, secret_kwargs=secret_kwargs, **kwargs)


def shutdown(wait: bool = False) -> None:
    """Stop the in-process pools of this process's dispatch, if it has one yet."""
    dispatch = runtime().built("jobs")
    if dispatch is not None:
        dispatch.shutdown(wait=wait)


# --------------------------------------------------------------------------- long runs


def new_runner_id() -> str:
    """A runner's id for a long run's heartbeat (a batch's, a background response's): the
    host, the process and a random tail, so two runners never share one."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def take_over_run(
    take_over: Callable[..., tuple[str, Any]], *, force: bool, what: str, run_id: str
) -> tuple[str, Any, str]:
    """Become the runner of a long run (a batch, a dashboard): call ``take_over(runner=,
    force=)`` until it answers other than ``"wait"`` (another runner's heartbeat is
    fresh). ``(verdict, row, runner)``; the verdict is ``"held"`` once that other runner
    kept its heartbeat through two stale periods (BATCH_RUNNER_STALE_S): it is alive."""
    runner = new_runner_id()
    stale_s = float(settings.BATCH_RUNNER_STALE_S)
    deadline = time.monotonic() + 2 * stale_s
    while True:
        close_old_connections()
        verdict, row = take_over(runner=runner, force=force)
        if verdict != "wait":
            return verdict, row, runner
        if time.monotonic() > deadline:
            log.info(f"{what}_held_elsewhere", run_id=run_id, runner=row.runner)
            return "held", row, runner
        time.sleep(min(stale_s / 3, 5.0))


async def run_with_closing_pool(main: Callable[[], Awaitable[T]], *, thread_name_prefix: str) -> T:
    """``await main()`` with the loop's default executor a pool of this run, whose threads
    close their database connections before it ends: a thread that ended with one open
    would pin a PostgreSQL session. What the run hands the default executor
    (``run_in_executor(None, ...)``) runs on this pool."""
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=RUN_EXECUTOR_THREADS, thread_name_prefix=thread_name_prefix)
    loop.set_default_executor(pool)
    try:
        return await main()
    finally:
        barrier = threading.Barrier(RUN_EXECUTOR_THREADS)

        def close() -> None:
            barrier.wait(timeout=30)  # one call on each thread of the pool
            connections.close_all()

        await asyncio.gather(
            *(loop.run_in_executor(pool, close) for _ in range(RUN_EXECUTOR_THREADS)), return_exceptions=True
        )
