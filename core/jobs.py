"""Dispatch of background tasks: Celery in distributed mode, in-process pools embedded.

Embedded mode has no broker, and ``task_always_eager`` would run a download inside the
request that asked for it; small thread pools keep the request fast while still running
the very same Celery task function (``task.apply``) so both modes share one code path.
There is one pool per queue, each sized from its setting: ``downloads``
(MAX_DOWNLOAD_WORKERS), ``loads`` (MAX_LOAD_WORKERS; the engine lives in this process, so
loads belong here), ``maintenance``, ``batches`` (one Batch API runner at a time, each
keeping BATCH_ENGINE_ROWS lines at the engine) and ``responses`` (background responses of
POST /v1/responses, RESPONSES_BACKGROUND_WORKERS at once), ``dashboards`` (feature
dashboard runs, DASHBOARD_WORKERS at once) and ``experiments`` (sweeps, calibrations and
fidelity runs, EXPERIMENT_WORKERS at once). In distributed mode the queue names route the task
to the Celery workers that consume them.

Dispatch always happens after the surrounding transaction commits, so a task never looks
for a row that is not there yet.

The long runs these tasks start (a batch's runner, a background response's) share their
runner id (``new_runner_id``), their take-over wait (``take_over_run``), their
run-scoped executor (``run_with_closing_pool``), their database thread (``RunDatabase``),
their Celery task's options (``long_run_task``) and their throttled progress event
(``Progress``); ``LongRuns`` keeps the row of such a run (one runner at a time, its
heartbeat, a cancel, the sweep that resumes a run whose runner died, a starting worker's
resume) for any model with the fields it names: a feature dashboard run's and an
experiment's.
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

from core.errors import MillmError, from_engine_error
from core.events import OWNER_FIELD, publish
from core.periodic import Periodic
from core.runtime import runtime

log = structlog.get_logger(__name__)

QUEUES = ("downloads", "loads", "maintenance", "batches", "responses", "dashboards", "experiments")
RUN_EXECUTOR_THREADS = 4

T = TypeVar("T")


def pool_size(queue: str) -> int:
    """How many tasks of ``queue`` run at once: the embedded pool's size, and the Celery
    concurrency ``manage.py worker`` gives a worker of that queue."""
    if queue == "loads":
        return int(settings.MAX_LOAD_WORKERS)
    if queue == "downloads":
        return int(settings.MAX_DOWNLOAD_WORKERS)
    if queue == "responses":
        return int(settings.RESPONSES_BACKGROUND_WORKERS)
    if queue == "dashboards":
        return int(settings.DASHBOARD_WORKERS)
    if queue == "experiments":
        return int(settings.EXPERIMENT_WORKERS)
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
                pool = ThreadPoolExecutor(max_workers=pool_size(queue), thread_name_prefix=f"millm-{queue}")
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


class RunDatabase:
    """A long run's database thread: one thread, so the run's writes happen in the order
    they are made, whose connection is closed when the run ends (``async with``: a
    thread that ended with one open would pin a PostgreSQL session)."""

    def __init__(self, *, thread_name_prefix: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name_prefix)

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the run's database thread."""

        def call() -> T:
            close_old_connections()
            return fn(*args, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def __aenter__(self) -> RunDatabase:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, connections.close_all)
        self._pool.shutdown(wait=True)


def engine_command(fn: Callable[..., T], *args: Any) -> T:
    """A blocking engine command of a long run (``tokenize``, ``feature_logits``): an
    engine error is raised as the domain error of its code."""
    try:
        return fn(*args)
    except MillmError:
        raise
    except Exception as exc:
        if hasattr(exc, "code"):
            raise from_engine_error(exc) from exc
        raise


def run_error(exc: BaseException, *, internal: str) -> tuple[str, str]:
    """The error {code, message} a long run ends ``failed`` with for what ended it: a
    domain error's, an engine error's as the domain error of its code, else
    INTERNAL_ERROR with ``internal`` (the log says why)."""
    if isinstance(exc, MillmError):
        return exc.code, exc.message
    if hasattr(exc, "code") and isinstance(getattr(exc, "code", None), str):
        error = from_engine_error(exc)
        return error.code, error.message
    return "INTERNAL_ERROR", internal


def long_run_task(name: str, *, limit_s: int, grace_s: int = 300) -> Callable[[Callable[..., T]], Any]:
    """The Celery task of a long run's runner: ``acks_late`` with
    ``reject_on_worker_lost``, so a runner whose worker child is killed is not lost with
    it (its message goes back in the queue and the next runner takes the run over once
    the dead one's heartbeat is stale, BATCH_RUNNER_STALE_S); soft time limit
    ``limit_s``, hard ``grace_s`` later."""
    from celery import shared_task

    return shared_task(
        name=name,
        acks_late=True,
        reject_on_worker_lost=True,
        soft_time_limit=limit_s,
        time_limit=limit_s + grace_s,
    )


def consumes(sender: Any, queue: str) -> bool:
    """Whether the Celery worker ``sender`` (a ``worker_ready`` signal's) consumes ``queue``."""
    consumer = getattr(sender, "task_consumer", None)
    queues = getattr(consumer, "queues", None) or []
    return any(getattr(q, "name", None) == queue for q in queues)


class Progress:
    """A long run's progress over /ws/events: ``event`` with the run's id, its ``fields``
    (ids, status and counts, never the text it reads) and its owner, so only the owner's
    and admin sockets get it; called as ``progress(run=row)`` or ``progress(run_id=id)``:
    while the run runs at most every ``every_s`` per run unless ``force``; once it ended,
    its entry is forgotten."""

    def __init__(self, model: Any, event: str, fields: tuple[str, ...], *, every_s: float) -> None:
        self.model, self.event, self.fields, self.every_s = model, event, fields, every_s
        self._sent: dict[str, float] = {}

    def __call__(self, *, run: Any = None, run_id: str | None = None, force: bool = False) -> None:
        key = run.id if run is not None else run_id
        now = time.monotonic()
        if not force and now - self._sent.get(key, 0.0) < self.every_s:
            return
        self._sent[key] = now
        if run is None:
            run = self.model.objects.filter(id=key).first()
            if run is None:
                return
        if run.status in self.model.TERMINAL:
            self._sent.pop(key, None)
        fields = {name: getattr(run, name) for name in self.fields}
        publish(self.event, {"run_id": run.id, **fields, OWNER_FIELD: run.owner})


class LongRuns:
    """The row of a long run that one runner at a time holds (an experiment, a feature
    dashboard run; the model has ``status`` with the values queued, running, cancelling,
    cancelled, failed and completed, ``runner``, ``runner_seen_at``, ``resumes``,
    ``error``, ``started_at`` and ``finished_at``): its take-over, heartbeat, cancel and
    end, and the sweep and start-up resume that queue a runner for a run whose runner
    died.

    A runner whose heartbeat is older than BATCH_RUNNER_STALE_S is presumed dead; one
    taken over more than BATCH_MAX_RESUMES times ends ``failed`` with ``failed_code``
    (its message ending with ``failed_note``); ``label`` names one in a refused cancel's
    message. ``ending(row, status)`` may set fields of a row about to end and returns
    their names; ``ended(row)`` is told of every end (after its transaction) and of a
    take-over (the service publishes its progress there). ``what`` names the run in logs (``<what>_runner_dead``), the runner's
    threads (``millm-<what>``) and, plural, its sweeper (``<what>s_swept``)."""

    def __init__(
        self,
        model: Any,
        *,
        what: str,
        task: str,
        queue: str,
        failed_code: str,
        label: str,
        failed_note: str = "",
        ending: Callable[[Any, str], list[str]] | None = None,
        ended: Callable[[Any], None] | None = None,
    ) -> None:
        self.model, self.what, self.task, self.queue = model, what, task, queue
        self.runs = f"{what}s"
        self.failed_code, self.failed_note, self.label = failed_code, failed_note, label
        self._ending = ending or (lambda row, status: [])
        self._ended = ended or (lambda row: None)

    # ------------------------------------------------------------------ one row

    def stale(self, row: Any) -> bool:
        """The run's runner sent no heartbeat for BATCH_RUNNER_STALE_S (or has none)."""
        from django.utils import timezone

        seen = row.runner_seen_at
        return seen is None or (timezone.now() - seen).total_seconds() > float(settings.BATCH_RUNNER_STALE_S)

    def end(self, row: Any, status: str, *, extra: list[str] | tuple[str, ...] = ()) -> None:
        """End ``row`` (inside the caller's transaction): ``status``, ``finished_at``, no
        runner, and what ``ending`` sets."""
        from django.utils import timezone

        fields = self._ending(row, status)
        row.status = status
        row.finished_at = timezone.now()
        row.runner = None
        row.save(update_fields=["status", "finished_at", "runner", "error", *extra, *fields])

    def enqueue(self, run_id: str, *, force: bool = False) -> Future:
        return enqueue(self.task, run_id, force=force, queue=self.queue)

    def run(
        self,
        run_id: str,
        *,
        force: bool,
        main: Callable[[Any, str], Callable[[], Awaitable[str]]],
        describe: Callable[[Any], dict[str, Any]] | None = None,
    ) -> str:
        """A runner's task: take the run over (``take_over_run``; ``force`` even from a
        runner that looks alive) and ``await main(row, runner)()`` on a loop whose
        default executor is the run's own (``run_with_closing_pool``). How it ended, or
        the verdict of a take-over that did not run it; ``describe(row)``: more to log."""
        import functools

        verdict, row, runner = take_over_run(
            functools.partial(self.take_over, run_id=run_id), force=force, what=self.what, run_id=run_id
        )
        if verdict != "run":
            return verdict
        log.info(f"{self.what}_run_start", run_id=run_id, **(describe(row) if describe else {}), runner=runner)
        return asyncio.run(run_with_closing_pool(main(row, runner), thread_name_prefix=f"millm-{self.what}"))

    def take_over(self, *, run_id: str, runner: str, force: bool = False) -> tuple[str, Any]:
        """Become the run's runner: ``("run", row)``, ``("wait", row)`` while another
        runner's heartbeat is fresh, ``("done", None)`` for a run that needs no runner (it
        ended; a ``cancelling`` one nobody runs ends ``cancelled`` here; one taken over too
        often ends ``failed``)."""
        from django.utils import timezone

        with transaction.atomic():
            row = self.model.objects.select_for_update().filter(id=run_id).first()
            if row is None or row.status in self.model.TERMINAL:
                return "done", None
            if row.runner not in (None, runner) and not force and not self.stale(row):
                return "wait", row
            # a runner that held it and is gone (a crash, a killed worker, a restart)
            resumed = row.runner not in (None, runner)
            if row.status == "cancelling":
                self.end(row, "cancelled")
            elif resumed and row.resumes >= int(settings.BATCH_MAX_RESUMES):
                # a run that kills its runner every time must end rather than loop
                row.error = {
                    "code": self.failed_code,
                    "message": f"The run's runner stopped {row.resumes + 1} times without finishing it "
                    f"(BATCH_MAX_RESUMES={settings.BATCH_MAX_RESUMES}){self.failed_note}",
                }
                self.end(row, "failed")
            else:
                now = timezone.now()
                row.runner, row.runner_seen_at = runner, now
                row.status = "running"
                row.started_at = row.started_at or now
                row.resumes += int(resumed)
                row.save(update_fields=["runner", "runner_seen_at", "status", "started_at", "resumes"])
        if row.status in self.model.TERMINAL:
            log.warning(f"{self.what}_ended_at_take_over", run_id=run_id, status=row.status)
            self._ended(row)
            return "done", None
        self._ended(row)
        return "run", row

    def touch(self, *, run_id: str, runner: str, **fields: Any) -> bool:
        """Record this runner's heartbeat (and ``fields``: progress); False when this
        runner no longer holds the run."""
        from django.utils import timezone

        return bool(self.model.objects.filter(id=run_id, runner=runner).update(runner_seen_at=timezone.now(), **fields))

    def advance(self, *, run_id: str, runner: str, progress: Progress, force: bool = False, **fields: Any) -> bool:
        """Record the run's progress (``fields``; one that is None is left as it is) with
        this runner's heartbeat, then its ``progress`` event (at most every
        ``progress.every_s`` unless ``force``); False when this runner no longer holds it."""
        if not self.touch(run_id=run_id, runner=runner, **{k: v for k, v in fields.items() if v is not None}):
            return False
        progress(run_id=run_id, force=force)
        return True

    def heartbeat(self, *, run_id: str, runner: str, **fields: Any) -> str | None:
        """The run's status after recording this runner's heartbeat (and ``fields``:
        progress), or None when this runner no longer holds it."""
        if not self.touch(run_id=run_id, runner=runner, **fields):
            return None
        return self.model.objects.values_list("status", flat=True).get(id=run_id)

    def finish(
        self,
        *,
        run_id: str,
        runner: str,
        status: str,
        error: dict[str, str] | None = None,
        store: Callable[[Any], list[str]] | None = None,
        **fields: Any,
    ) -> Any:
        """End the run this runner holds ``status`` (a recorded cancel wins over a
        completion or a failure: ``cancelled``), with ``fields`` set; ``store(row)``
        (inside the transaction, only when no cancel won) writes what the end brings and
        names the row's fields it set. The row, or None when this runner no longer holds
        it."""
        with transaction.atomic():
            row = self.model.objects.select_for_update().filter(id=run_id, runner=runner).first()
            if row is None or row.status in self.model.TERMINAL:
                return None
            extra = list(fields)
            if row.status == "cancelling":
                status = "cancelled"
            else:
                if error is not None:
                    row.error = error
                if store is not None:
                    extra += store(row)
            for name, value in fields.items():
                setattr(row, name, value)
            self.end(row, status, extra=extra)
        self._ended(row)
        return row

    def cancel(self, row_id: str, *, not_cancellable: type[MillmError]) -> Any:
        """``cancelling`` (the runner sees it at its next heartbeat and ends the run
        ``cancelled``); a run no live runner holds (queued, or its runner dead) ends
        ``cancelled`` at once. ``not_cancellable`` (409) is raised for a run that ended."""
        with transaction.atomic():
            row = self.model.objects.select_for_update().get(id=row_id)
            if row.status in ("cancelling", "cancelled"):
                return row
            if row.status in self.model.TERMINAL:
                raise not_cancellable(
                    f"{self.label} {row.id} is {row.status} and cannot be cancelled",
                    details={"param": "run_id", "status": row.status},
                )
            if row.runner is not None and not self.stale(row):
                row.status = "cancelling"
                row.save(update_fields=["status"])
            else:
                self.end(row, "cancelled")
        self._ended(row)
        return row

    # ------------------------------------------------------------------ every row

    def sweep(self) -> dict[str, int]:
        """Every run nobody runs any more ends or goes on: ``cancelling`` with no live
        runner ends ``cancelled``; ``running`` whose runner's heartbeat is stale (the
        runner's task ended without ending the run) is released (no runner, so the runner
        queued takes it at once; its heartbeat set to now, so the next sweep waits a stale
        period before queuing another) and a runner is queued, which resumes it."""
        from datetime import timedelta

        from django.db.models import Q
        from django.utils import timezone

        stale_before = timezone.now() - timedelta(seconds=float(settings.BATCH_RUNNER_STALE_S))
        stale = Q(runner_seen_at=None) | Q(runner_seen_at__lt=stale_before)
        dead = Q(runner=None) | stale
        cancelled = resumed = 0
        for run_id in list(self.model.objects.filter(dead, status="cancelling").values_list("id", flat=True)):
            with transaction.atomic():
                row = self.model.objects.select_for_update().filter(dead, id=run_id, status="cancelling").first()
                if row is None:
                    continue
                self.end(row, "cancelled")
            self._ended(row)
            cancelled += 1
        for run_id in list(self.model.objects.filter(stale, status="running").values_list("id", flat=True)):
            with transaction.atomic():
                if not self.model.objects.filter(stale, id=run_id, status="running").update(
                    runner=None, runner_seen_at=timezone.now()
                ):
                    continue
                self.enqueue(run_id)
            log.warning(f"{self.what}_runner_dead", run_id=run_id)
            resumed += 1
        return {"cancelled": cancelled, "resumed": resumed}

    def resume(self, *, force: bool) -> int:
        """Queue a runner for every run not ended (a start-up: embedded, this process was
        the runner, ``force``; a worker of the queue takes over a run once its runner's
        heartbeat is stale). How many were queued."""
        ids = list(self.model.objects.exclude(status__in=self.model.TERMINAL).values_list("id", flat=True))
        for run_id in ids:
            self.enqueue(run_id, force=force)
        if ids:
            log.info(f"{self.runs}_resumed", runs=len(ids))
        return len(ids)

    def sweeper(self, work: Callable[[], dict[str, int]], *, log: Any) -> Periodic:
        """The runs' sweeper: ``work`` (the service's sweep, ``sweep``) every
        BATCH_SWEEP_INTERVAL_S, the first one interval after its start, on a daemon thread
        (``millm-<what>s-sweeper``) of each process that runs them; ``log``: the
        sweeper's logger."""
        return Periodic(
            f"millm-{self.runs}-sweeper",
            work,
            interval=lambda: float(settings.BATCH_SWEEP_INTERVAL_S),
            at_once=False,
            log=log,
            started=f"{self.runs}_sweeper_started",
            failed=f"{self.runs}_sweep_failed",
            done=f"{self.runs}_swept",
        )

    def celery_task(self, run: Callable[..., str], *, limit_s: int) -> Any:
        """The runner ``run(run_id=, force=)`` as the Celery task ``task`` names
        (``long_run_task``, on the runs' queue when ``enqueue`` sends it)."""
        module, _, name = self.task.rpartition(".")

        def run_task(run_id: str, force: bool = False) -> str:
            return run(run_id=run_id, force=force)

        run_task.__module__, run_task.__name__, run_task.__qualname__ = module, name, name
        return long_run_task(self.task, limit_s=limit_s)(run_task)

    def on_worker_ready(self, *, resume: Callable[..., int], start_sweeper: Callable[[], Any]) -> Callable[..., None]:
        """Connect (and return) the ``worker_ready`` receiver by which a starting Celery
        worker that consumes the runs' queue queues a runner for every run not ended
        (``resume(force=False)``: one whose runner died with its worker is taken over once
        its heartbeat is stale; one whose runner is alive keeps it, the extra task ends
        ``held``) and starts the runs' sweeper."""
        from celery.signals import worker_ready

        def ready(sender: Any = None, **kwargs: Any) -> None:
            if sender is not None and not consumes(sender, self.queue):
                return
            try:
                resume(force=False)
            except Exception:  # noqa: BLE001 - a worker must start even if this fails
                log.exception(f"{self.runs}_resume_failed")
            finally:
                connections.close_all()  # the children are forked from this process
            start_sweeper()

        worker_ready.connect(ready, weak=False, dispatch_uid=f"{self.task}.worker_ready")
        return ready
