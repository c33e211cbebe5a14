"""Running a background response (``POST /v1/responses`` with ``background: true``).

The run is a job of the in-process ``responses`` pool embedded and a Celery task of the
``responses`` queue distributed (``core.jobs``; ``inference.tasks``), as a batch's runner
is; either way it is this one function, ``response_run``:

- take the response over (one runner at a time, as ``batches.running.batch_take_over``):
  ``queued`` becomes ``in_progress``; a response that ended (cancelled while queued,
  deleted) needs no runner;
- answer it as the synchronous route would (``answer_response`` of the Responses API
  module, imported lazily), while a heartbeat every HEARTBEAT_S says the runner is alive
  and reads the row: a cancel (``cancelled``) or a delete cancels the engine job, and
  nothing the run answers afterwards is kept;
- store the answer under the queued response's id (``completed``, ``incomplete``,
  ``failed`` with OpenAI's ``error``), only if the row is still this runner's and
  ``in_progress`` — so a cancel recorded before the end always wins.

A runner whose process dies leaves a stale heartbeat: the sweeper queues the response
again from the start (nothing of the dead run was kept) or, after BATCH_MAX_RESUMES, ends
it ``failed`` (``inference.responses_store.responses_sweep``); an embedded start-up
re-queues every response not finished (``responses_resume``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import structlog
from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import close_old_connections, transaction
from django.utils import timezone

from core.jobs import new_runner_id, run_with_closing_pool
from inference.errors import OpenAIError, openai_error_from_exception
from inference.models import StoredResponse
from inference.responses_store import _set_status
from monitoring.ownership import Scope

log = structlog.get_logger(__name__)

HEARTBEAT_S = 1.0


def _api() -> tuple[Any, Any]:
    """``parse_responses_request`` and ``answer_response`` of the Responses API, imported
    at run time (their modules import this package's store, not the other way round)."""
    from inference.responses import parse_responses_request
    from inference.responses_answer import answer_response

    return parse_responses_request, answer_response


def _stale(row: StoredResponse) -> bool:
    seen = row.runner_seen_at
    return seen is None or (timezone.now() - seen).total_seconds() > float(settings.BATCH_RUNNER_STALE_S)


def take_over(*, response_id: str, runner: str, force: bool = False) -> StoredResponse | None:
    """Become the response's runner (``in_progress``); None when it needs none (ended,
    deleted) or another runner's heartbeat is fresh."""
    with transaction.atomic():
        row = StoredResponse.objects.select_for_update().filter(id=response_id, background=True).first()
        if row is None or row.terminal:
            return None
        if row.runner not in (None, runner) and not force and not _stale(row):
            return None
        row.runner, row.runner_seen_at = runner, timezone.now()
        _set_status(row, StoredResponse.Status.IN_PROGRESS)
        row.save(update_fields=["runner", "runner_seen_at", "status", "body", "updated_at"])
    return row


def heartbeat(*, response_id: str, runner: str) -> str | None:
    """The response's status, or None when this runner no longer holds it (deleted,
    taken over)."""
    if not StoredResponse.objects.filter(id=response_id, runner=runner).update(runner_seen_at=timezone.now()):
        return None
    return StoredResponse.objects.values_list("status", flat=True).filter(id=response_id).first()


def release(*, response_id: str, runner: str) -> None:
    """This runner no longer runs the response (it was cancelled): it says so, so nothing
    waits for its heartbeat."""
    StoredResponse.objects.filter(id=response_id, runner=runner).update(runner=None, runner_seen_at=None)


def finish(*, response_id: str, runner: str, body: dict[str, Any]) -> bool:
    """Store the run's answer; False (nothing written but the end of this runner's claim)
    when the response is no longer this runner's or no longer ``in_progress`` (cancelled
    meanwhile)."""
    with transaction.atomic():
        row = (
            StoredResponse.objects.select_for_update()
            .filter(id=response_id, runner=runner, status=StoredResponse.Status.IN_PROGRESS)
            .first()
        )
        if row is None:
            # cancelled (or deleted) while the answer came: nothing is kept, and the claim
            # goes, so nothing waits for this runner's heartbeat
            StoredResponse.objects.filter(id=response_id, runner=runner).update(runner=None, runner_seen_at=None)
            return False
        status = str(body.get("status") or StoredResponse.Status.COMPLETED)
        if status not in StoredResponse.TERMINAL:
            status = StoredResponse.Status.COMPLETED
        body = {
            **body,
            "id": row.id,
            "created_at": row.body.get("created_at", body.get("created_at")),
            "background": True,
            "store": True,
        }
        if status == StoredResponse.Status.COMPLETED and not body.get("completed_at"):
            body["completed_at"] = int(time.time())
        row.body, row.status, row.runner, row.runner_seen_at = body, status, None, None
        row.save(update_fields=["body", "status", "runner", "runner_seen_at", "updated_at"])
    return True


def _failed_body(row: StoredResponse, error: OpenAIError) -> dict[str, Any]:
    return {
        **row.body,
        "status": StoredResponse.Status.FAILED,
        "error": {"code": error.code or "server_error", "message": error.message},
    }


def response_run(*, response_id: str, force: bool = False, stop: threading.Event | None = None) -> str:
    """Run the background response to its end; ``force`` takes it over even from a
    runner that looks alive (embedded start-up: this process is the only runner).
    ``stop`` ends the run abruptly, as a crash would (tests). Returns how it ended."""
    runner = new_runner_id()
    close_old_connections()
    row = take_over(response_id=response_id, runner=runner, force=force)
    if row is None:
        return "done"
    log.info("response_run_start", response_id=response_id, runner=runner)
    # async_to_sync, not asyncio.run: the route's thread-sensitive database calls
    # (sync_to_async) then run on this thread, whose connection its pool closes when the
    # job ends, instead of on asgiref's process-wide thread, which would keep one open
    return async_to_sync(_main)(row, runner, stop)


async def _main(row: StoredResponse, runner: str, stop: threading.Event | None) -> str:
    # the route's database reads run on the loop's default executor: a pool of this run
    # that closes its connections before it ends
    return await run_with_closing_pool(lambda: _run(row, runner, stop), thread_name_prefix="millm-response")


async def _db(fn: Any, **kwargs: Any) -> Any:
    def call() -> Any:
        close_old_connections()
        return fn(**kwargs)

    return await asyncio.get_running_loop().run_in_executor(None, call)


async def _answer(row: StoredResponse) -> dict[str, Any]:
    """The response's final body: the route's answer, or ``failed`` with its error."""
    scope = Scope(owner=row.owner, all=False)
    try:
        parse, answer_response = _api()
        req, ignored = parse(dict(row.request or {}))
        body, _headers = await answer_response(
            req,
            scope=scope,
            policy=row.policy or "refuse",
            lease=row.lease or None,
            ignored=ignored,
            response_id=row.id,
            created_at=row.body.get("created_at"),
        )
        return body
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is the response's error
        error = openai_error_from_exception(exc)
        log.warning("response_run_failed", response_id=row.id, code=error.code, error=repr(exc))
        return _failed_body(row, error)


async def _run(row: StoredResponse, runner: str, stop: threading.Event | None) -> str:
    task = asyncio.ensure_future(_answer(row))
    while True:
        done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_S)
        if done:
            break
        if stop is not None and stop.is_set():
            task.cancel()  # as a crash would: nothing stored, the heartbeat stops
            log.warning("response_run_stopped", response_id=row.id)
            return "stopped"
        status = await _db(heartbeat, response_id=row.id, runner=runner)
        if status != StoredResponse.Status.IN_PROGRESS:
            # cancelled, deleted or taken over: the engine job is cancelled with the task
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await _db(release, response_id=row.id, runner=runner)
            log.info("response_run_ended", response_id=row.id, status=status or "gone")
            return str(status or "gone")
    body = task.result()
    kept = await _db(finish, response_id=row.id, runner=runner, body=body)
    outcome = str(body.get("status") or "completed") if kept else "discarded"
    log.info("response_run_done", response_id=row.id, outcome=outcome)
    return outcome
