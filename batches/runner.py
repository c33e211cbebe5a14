"""Running a batch: one runner per batch, BATCH_ENGINE_ROWS lines at the engine at once.

The runner is a Celery task in distributed mode and a job of the in-process ``batches``
pool embedded (``core.jobs``); either way it is this one function, ``batch_run``. It takes
the batch over (``services.batch_take_over``: a batch has one runner; a runner whose
heartbeat is older than BATCH_RUNNER_STALE_S is presumed dead and its unanswered lines go
back in the queue), then loops:

- claim unanswered lines in file order while fewer than BATCH_ENGINE_ROWS are at the
  engine, answer each one (``batches.lines``) and record the answer in PostgreSQL as soon
  as it is known (``batch_line_answer``: at most once per line);
- a line the engine cannot take now (the model is not resident, it is being swapped,
  the engine restarts) goes back in the queue and the batch pauses for the Retry-After the
  refusal named: a batch waits for its model, it never loads one;
- heartbeat, and read the batch's status: ``cancelling`` stops the claims; the
  completion window's end (``expires_at``) too. The claim itself reads the batch's row
  in its transaction and claims nothing once a cancel is recorded, so no line starts
  after the cancel whatever the heartbeat last saw;
- when nothing is left at the engine: finalize (``completed``, ``cancelled`` or
  ``expired``), which writes the output and error files; a batch that is ``cancelling``
  in the database ends ``cancelled`` whatever outcome the runner asked for.

A web worker, Celery worker or engine that dies mid-batch loses no line and repeats none:
the answered lines are in the database, the lines at the engine have no answer yet and are
run again by the next runner (the engine job gets a fresh id; the line keeps its
``batch_req_…`` id, the idempotency key of its answer).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from django.conf import settings
from django.db import close_old_connections, connections
from django.utils import timezone

from batches import services
from batches.lines import Answer, Unavailable, answer_line
from batches.models import Batch, BatchLine
from core.jobs import enqueue, run_with_closing_pool, take_over_run
from inference.errors import OpenAIError
from monitoring.ownership import ANONYMOUS, Scope
from steering.live import snapshot_scopes

log = structlog.get_logger(__name__)

HEARTBEAT_S = 1.0
MAX_PAUSE_S = 30.0


def batch_run(*, batch_id: str, force: bool = False, stop: threading.Event | None = None) -> str:
    """Run the batch to its end; ``force`` takes it over even from a runner that looks
    alive (embedded start-up: this process is the only runner there is). ``stop`` ends
    the run abruptly, as a crash would (tests). Returns how it ended."""
    verdict, batch, runner = take_over_run(
        functools.partial(services.batch_take_over, batch_id=batch_id), force=force, what="batch", run_id=batch_id
    )
    if verdict != "run":
        return verdict
    log.info("batch_run_start", batch_id=batch_id, runner=runner)
    return asyncio.run(_main(_Runner(batch, runner, stop)))


async def _main(runner: _Runner) -> str:
    # the planning's database reads run on the loop's default executor: a pool of this run
    # that closes its connections before it ends
    return await run_with_closing_pool(runner.run, thread_name_prefix="millm-batch")


class _Runner:
    def __init__(self, batch: Batch, runner: str, stop: threading.Event | None) -> None:
        self.batch_id = batch.id
        self.endpoint = batch.endpoint
        # the batch owner's: what its lines capture or record (monitoring.ownership)
        self.scope = Scope(owner=getattr(batch, "owner", ANONYMOUS), all=False)
        # its key's live steering as of creation (keys on); None: the global one as of each line
        snapshot = getattr(batch, "live_steering", None)
        self.live_pinned = snapshot_scopes(snapshot) if snapshot is not None else None
        self.expires_at = batch.expires_at
        self.runner = runner
        self.rows = int(settings.BATCH_ENGINE_ROWS)
        self.stop = stop
        # one thread for the database: the rows are written in the order they happen,
        # and its connection is closed when the run ends
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="millm-batch-db")

    async def db(self, fn: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            close_old_connections()
            return fn(**kwargs)

        return await asyncio.get_running_loop().run_in_executor(self._db, call)

    async def run(self) -> str:
        try:
            return await self._loop()
        finally:
            await asyncio.get_running_loop().run_in_executor(self._db, connections.close_all)
            self._db.shutdown(wait=True)

    async def _loop(self) -> str:
        at_engine: dict[asyncio.Task, dict[str, Any]] = {}
        paused_until = 0.0
        beat = 0.0
        status: str | None = Batch.Status.IN_PROGRESS
        while True:
            if self.stop is not None and self.stop.is_set():
                for task in at_engine:
                    task.cancel()  # as a crash would: nothing answered, nothing released
                log.warning("batch_run_stopped", batch_id=self.batch_id)
                return "stopped"
            now = time.monotonic()
            if now - beat >= HEARTBEAT_S:
                beat = now
                status = await self.db(services.batch_heartbeat, batch_id=self.batch_id, runner=self.runner)
                if status is None:  # taken over (this runner was presumed dead)
                    for task in at_engine:
                        task.cancel()
                    return "lost"
            cancelling = status == Batch.Status.CANCELLING
            expired = timezone.now() >= self.expires_at
            if not cancelling and not expired and now >= paused_until:
                want = self.rows - len(at_engine)
                lines = await self.db(services.batch_claim_lines, batch_id=self.batch_id, runner=self.runner, n=want)
                for line in lines:
                    at_engine[asyncio.ensure_future(self._answer(line))] = line
                if want > 0 and not lines and not at_engine:
                    beat = 0.0  # nothing claimed: read the status now (a cancel, a take-over)
            if not at_engine:
                outcome = Batch.Status.CANCELLED if cancelling else Batch.Status.EXPIRED if expired else None
                if outcome is None and not await self.db(self._pending):
                    outcome = Batch.Status.COMPLETED
                if outcome is not None:
                    await self.db(services.batch_finalize, batch_id=self.batch_id, outcome=outcome)
                    return outcome
                await asyncio.sleep(min(max(paused_until - time.monotonic(), 0.05), HEARTBEAT_S))
                continue
            done, _ = await asyncio.wait(at_engine, timeout=HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                at_engine.pop(task)
                wait_s = task.result()
                if wait_s:
                    paused_until = max(paused_until, time.monotonic() + wait_s)

    def _pending(self) -> bool:
        return BatchLine.objects.filter(batch_id=self.batch_id).exclude(status=BatchLine.Status.DONE).exists()

    async def _answer(self, line: dict[str, Any]) -> float:
        """Answer one line; the seconds to pause the batch when the engine cannot take
        it now (the line is back in the queue), else 0."""
        try:
            answer = await answer_line(self.endpoint, line["body"], scope=self.scope, live_pinned=self.live_pinned)
        except Unavailable as exc:
            log.info(
                "batch_line_waits",
                batch_id=self.batch_id,
                line=line["line"],
                code=exc.error.code,
                retry_after=exc.retry_after,
            )
            await self.db(services.batch_line_requeue, line_id=line["id"], runner=self.runner)
            return min(float(exc.retry_after), MAX_PAUSE_S)
        except Exception as exc:  # noqa: BLE001 - a line's failure is its answer
            log.error("batch_line_failed", batch_id=self.batch_id, line=line["line"], error=repr(exc))
            error = OpenAIError(
                "The server had an error while processing this request.",
                status=500,
                code="internal_error",
                type="server_error",
            )
            answer = Answer(500, error.body())
        await self.db(
            services.batch_line_answer,
            line_id=line["id"],
            status_code=answer.status_code,
            response=answer.body,
            headers=answer.headers,
        )
        await self.db(services.batch_progress, batch_id=self.batch_id)
        return 0.0


def batches_resume(*, force: bool) -> int:
    """Queue a runner for every batch not finished (a start-up: embedded, this process was
    the runner, ``force``; a Celery worker, the runner of a batch whose heartbeat stops is
    presumed dead once it is stale). Returns how many were queued."""
    ids = list(Batch.objects.exclude(status__in=Batch.TERMINAL).values_list("id", flat=True))
    for batch_id in ids:
        enqueue("batches.tasks.batch_run_task", batch_id, force=force, queue="batches")
    if ids:
        log.info("batches_resumed", batches=len(ids))
    return len(ids)
