"""Mutations of the Batch API: files, batches, and the answer of each line.

The limits of an input file (BATCH_MAX_FILE_BYTES, BATCH_MAX_FILE_LINES,
BATCH_MAX_LINE_BYTES; OpenAI's 200 MB and 50,000 requests, and the 1 MiB line of the
original's batch description) are checked at upload, where a client can still fix the
file; what a line asks for is checked when the batch is created (a batch whose lines are
malformed is created ``failed`` with ``errors``, as OpenAI does), and each line's body is
validated when it runs, by the same pydantic models as the synchronous route (a bad body
is that line's 400 in the error file).

A batch is run by one runner at a time (``batch_take_over``); a line is answered at most
once (``batch_line_answer`` writes only a line not answered yet): the line's request id
is its idempotency key.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta
from typing import Any

import structlog
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from batches.errors import (
    BatchNotCancellable,
    FileTooLarge,
    InvalidBatchRequest,
    InvalidFile,
    LineTooLarge,
    TooManyLines,
)
from batches.models import Batch, BatchLine, File
from core.events import publish
from core.jobs import enqueue

log = structlog.get_logger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/probes/score")
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
CUSTOM_ID_MAX_CHARS = 512
ERRORS_SHOWN = 100  # of a failed validation; the rest are counted in the last message
PROGRESS_EVERY_S = 0.5  # batch:progress while lines are answered, at most this often

_progress_sent: dict[str, float] = {}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- files

def _split_lines(content: bytes) -> list[bytes]:
    lines = content.split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()  # a trailing newline ends the last line, it does not add one
    return lines


def file_check_batch_input(*, content: bytes) -> int:
    """The number of requests in a batch input file, or the limit or format it breaks."""
    if len(content) > settings.BATCH_MAX_FILE_BYTES:
        raise FileTooLarge(
            f"The file is {len(content)} bytes; a batch input file may have at most "
            f"{settings.BATCH_MAX_FILE_BYTES} bytes", details={"param": "file"})
    lines = _split_lines(content)
    if not lines:
        raise InvalidFile("The file is empty; a batch input file has one JSON request "
                          "per line", details={"param": "file"})
    if len(lines) > settings.BATCH_MAX_FILE_LINES:
        raise TooManyLines(f"The file has {len(lines)} lines; a batch input file may have "
                           f"at most {settings.BATCH_MAX_FILE_LINES} requests",
                           details={"param": "file"})
    for number, raw in enumerate(lines, start=1):
        if len(raw) > settings.BATCH_MAX_LINE_BYTES:
            raise LineTooLarge(f"Line {number} is {len(raw)} bytes; a line may have at most "
                               f"{settings.BATCH_MAX_LINE_BYTES} bytes",
                               details={"param": "file", "line": number})
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise InvalidFile(f"Line {number} is not a JSON object; a batch input file is "
                              "JSONL, one request object per line",
                              details={"param": "file", "line": number})
    return len(lines)


def file_create(*, filename: str, purpose: str, content: bytes) -> File:
    if purpose != File.Purpose.BATCH:
        raise InvalidFile(f"purpose must be 'batch' (got {purpose!r}): this server stores "
                          "files for the Batch API only", details={"param": "purpose"})
    lines = file_check_batch_input(content=content)
    return File.objects.create(id=new_id("file-"), filename=filename[:255] or "upload.jsonl",
                               purpose=purpose, bytes=len(content), lines=lines,
                               content=content)


def file_delete(*, file: File) -> None:
    """The batches that used it keep their lines (copied at creation) and their results."""
    file.delete()


# --------------------------------------------------------------------------- batches

def _line_errors(lines: list[bytes], endpoint: str) -> tuple[list[dict[str, Any]], str,
                                                             list[BatchLine]]:
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    models: set[str] = set()
    rows: list[BatchLine] = []

    def err(number: int, code: str, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": number})

    for number, raw in enumerate(lines, start=1):
        try:
            item = json.loads(raw)
        except ValueError:
            item = None
        if not isinstance(item, dict):
            err(number, "invalid_json_line", "The line is not a JSON object")
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id \
                or len(custom_id) > CUSTOM_ID_MAX_CHARS:
            err(number, "invalid_custom_id", "custom_id must be a string of 1-"
                f"{CUSTOM_ID_MAX_CHARS} characters", "custom_id")
            continue
        if custom_id in seen:
            err(number, "duplicate_custom_id",
                f"custom_id {custom_id!r} appears more than once in the file", "custom_id")
            continue
        seen.add(custom_id)
        if item.get("method") != "POST":
            err(number, "invalid_method", "method must be POST", "method")
            continue
        if item.get("url") != endpoint:
            err(number, "invalid_url", f"url must be the batch's endpoint {endpoint} "
                f"(got {item.get('url')!r})", "url")
            continue
        body = item.get("body")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            err(number, "invalid_body", "body must be a JSON object naming a model",
                "body")
            continue
        if body.get("stream"):
            err(number, "invalid_body", "stream is not available in a batch", "body.stream")
            continue
        models.add(body["model"])
        rows.append(BatchLine(line=number, custom_id=custom_id,
                              request_id=new_id("batch_req_"), body=body))
    if not errors and len(models) > 1:
        err(0, "mismatched_model", "The lines of one batch must name one model (found "
            f"{', '.join(sorted(models))})", "body.model")
    model = next(iter(models)) if len(models) == 1 else ""
    return errors, model, rows


def batch_create(*, input_file_id: str, endpoint: str, completion_window: str,
                 metadata: dict[str, str] | None = None) -> Batch:
    """A batch of the file's lines, queued for a runner; or, if lines are malformed, a
    ``failed`` batch whose ``errors`` name them (OpenAI's behaviour)."""
    if endpoint not in ENDPOINTS:
        raise InvalidBatchRequest(f"endpoint must be one of {', '.join(ENDPOINTS)} "
                                  f"(got {endpoint!r})", details={"param": "endpoint"})
    if completion_window not in COMPLETION_WINDOWS:
        raise InvalidBatchRequest("completion_window must be '24h'",
                                  details={"param": "completion_window"})
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or any(
            not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512
            for k, v in metadata.items())):
        raise InvalidBatchRequest("metadata is at most 16 string pairs (keys up to 64, "
                                  "values up to 512 characters)", details={"param": "metadata"})
    file = File.objects.filter(id=input_file_id).first()
    if file is None:
        from batches.errors import FileNotFound

        raise FileNotFound(f"No file with id {input_file_id!r}",
                           details={"param": "input_file_id"})
    if file.purpose != File.Purpose.BATCH:
        raise InvalidBatchRequest(f"File {input_file_id} has purpose {file.purpose!r}, not "
                                  "'batch'", details={"param": "input_file_id"})
    errors, model, rows = _line_errors(_split_lines(bytes(file.content)), endpoint)
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.create(
            id=new_id("batch_"), endpoint=endpoint, model=model, input_file_id=file.id,
            completion_window=completion_window, metadata=metadata,
            expires_at=now + COMPLETION_WINDOWS[completion_window])
        if errors:
            shown = errors[:ERRORS_SHOWN]
            if len(errors) > ERRORS_SHOWN:
                shown[-1] = {**shown[-1], "message": shown[-1]["message"] +
                             f" ({len(errors) - ERRORS_SHOWN} more errors not shown)"}
            batch.errors = shown
            batch.status = Batch.Status.FAILED
            batch.failed_at = now
            batch.save(update_fields=["errors", "status", "failed_at"])
        else:
            for row in rows:
                row.batch = batch
            BatchLine.objects.bulk_create(rows, batch_size=2000)
            batch.total = len(rows)
            batch.save(update_fields=["total"])
            from batches.tasks import batch_run_task

            enqueue(batch_run_task, batch.id, queue="batches")
    log.info("batch_created", batch_id=batch.id, lines=len(rows), failed=bool(errors))
    batch_progress(batch=batch, force=True)
    return batch


def batch_cancel(*, batch_id: str) -> Batch:
    """``cancelling``: the runner sends no new line and ends the batch ``cancelled`` once
    the lines at the engine are answered; a batch no live runner holds ends at once."""
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(id=batch_id)
        if batch.status in (Batch.Status.CANCELLING, Batch.Status.CANCELLED):
            return batch
        if batch.terminal or batch.status == Batch.Status.FINALIZING:
            raise BatchNotCancellable(f"Batch {batch.id} is {batch.status} and cannot be "
                                      "cancelled", details={"status": batch.status})
        batch.status = Batch.Status.CANCELLING
        batch.cancelling_at = timezone.now()
        batch.save(update_fields=["status", "cancelling_at"])
        live = batch.runner is not None and not _stale(batch)
    batch_progress(batch=batch, force=True)
    if not live:
        batch_finalize(batch_id=batch.id, outcome=Batch.Status.CANCELLED)
        batch.refresh_from_db()
    return batch


# --------------------------------------------------------------------------- running

def _stale(batch: Batch) -> bool:
    seen = batch.runner_seen_at
    return seen is None or (timezone.now() - seen).total_seconds() > settings.BATCH_RUNNER_STALE_S


def batch_take_over(*, batch_id: str, runner: str, force: bool = False) -> tuple[str, Batch | None]:
    """Become the batch's runner: ``("run", batch)``, ``("wait", batch)`` while another
    runner's heartbeat is fresh, ``("done", None)`` for a batch that needs no runner.
    Taking over puts the lines another runner had at the engine but never answered back
    in the queue (their answer, if it ever comes, is refused as a second answer)."""
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(id=batch_id).first()
        if batch is None or batch.terminal:
            return "done", None
        if batch.runner not in (None, runner) and not force and not _stale(batch):
            return "wait", batch
        now = timezone.now()
        batch.runner, batch.runner_seen_at = runner, now
        fields = ["runner", "runner_seen_at"]
        if batch.status == Batch.Status.VALIDATING:
            batch.status, batch.in_progress_at = Batch.Status.IN_PROGRESS, now
            fields += ["status", "in_progress_at"]
        batch.save(update_fields=fields)
        requeued = BatchLine.objects.filter(batch=batch, status=BatchLine.Status.RUNNING
                                            ).update(status=BatchLine.Status.PENDING,
                                                     runner=None)
    if requeued:
        log.info("batch_lines_requeued", batch_id=batch_id, lines=requeued)
    batch_progress(batch=batch, force=True)
    return "run", batch


def batch_heartbeat(*, batch_id: str, runner: str) -> str | None:
    """The batch's status, or None when this runner no longer holds it."""
    if not Batch.objects.filter(id=batch_id, runner=runner).update(
            runner_seen_at=timezone.now()):
        return None
    return Batch.objects.values_list("status", flat=True).get(id=batch_id)


def batch_claim_lines(*, batch_id: str, runner: str, n: int) -> list[dict[str, Any]]:
    """Up to ``n`` unanswered lines, in file order, marked as at the engine; none once
    the batch is no longer ``in_progress`` (a cancel recorded, the window over, taken
    over by another runner): the batch's row is read in the same transaction, so no line
    is claimed after the cancel is committed."""
    if n <= 0:
        return []
    with transaction.atomic():
        # the row locked: a cancel (which locks it too) waits for the claim, or the claim
        # for the cancel and then reads the status the cancel left
        if not Batch.objects.select_for_update().filter(
                id=batch_id, runner=runner, status=Batch.Status.IN_PROGRESS,
                expires_at__gt=timezone.now()).values_list("id", flat=True).first():
            return []
        query = BatchLine.objects.filter(batch_id=batch_id, status=BatchLine.Status.PENDING
                                         ).order_by("line")
        if connection.features.has_select_for_update_skip_locked:
            query = query.select_for_update(skip_locked=True)
        lines = list(query.values("id", "line", "custom_id", "request_id", "body")[:n])
        BatchLine.objects.filter(id__in=[x["id"] for x in lines]).update(
            status=BatchLine.Status.RUNNING, runner=runner, attempts=F("attempts") + 1)
    return lines


def batch_line_requeue(*, line_id: int, runner: str) -> None:
    """A line the engine could not take now (model not resident, busy): back in line."""
    BatchLine.objects.filter(id=line_id, runner=runner, status=BatchLine.Status.RUNNING
                             ).update(status=BatchLine.Status.PENDING, runner=None)


def batch_line_answer(*, line_id: int, status_code: int, response: dict[str, Any],
                      headers: dict[str, str]) -> bool:
    """Record a line's answer; False (and nothing written) if it already has one."""
    usage = response.get("usage") if isinstance(response, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    ok = 200 <= status_code < 300
    with transaction.atomic():
        line = BatchLine.objects.select_for_update().filter(id=line_id).exclude(
            status=BatchLine.Status.DONE).first()
        if line is None:
            return False
        line.status, line.status_code = BatchLine.Status.DONE, status_code
        line.response, line.headers, line.answered_at = response, headers, timezone.now()
        line.save(update_fields=["status", "status_code", "response", "headers",
                                 "answered_at"])
        counts: dict[str, Any] = {"completed" if ok else "failed": F("completed" if ok
                                                                      else "failed") + 1}
        if ok:
            counts["input_tokens"] = F("input_tokens") + int(usage.get("prompt_tokens") or 0)
            counts["output_tokens"] = F("output_tokens") + int(
                usage.get("completion_tokens") or 0)
        Batch.objects.filter(id=line.batch_id).update(**counts)
    return True


def _output_entry(line: BatchLine) -> dict[str, Any]:
    if line.status_code is None:
        return {"id": line.request_id, "custom_id": line.custom_id, "response": None,
                "error": line.error}
    return {"id": line.request_id, "custom_id": line.custom_id,
            "response": {"status_code": line.status_code, "request_id": line.request_id,
                         "body": line.response, "headers": line.headers or {}},
            "error": None}


def batch_finalize(*, batch_id: str, outcome: str) -> Batch:
    """End the batch (``completed``, ``expired`` or ``cancelled``): the answered lines go
    to the output file (2xx) or the error file (the rest), lines never answered to the
    error file with ``batch_expired`` / ``batch_cancelled``, in input order."""
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(id=batch_id)
        if batch.terminal:
            return batch
        if batch.status == Batch.Status.CANCELLING:
            # a cancel recorded before the end wins over what the runner saw (OpenAI:
            # a cancelled batch ends ``cancelled``, whatever was answered meanwhile)
            outcome = Batch.Status.CANCELLED
        batch.status, batch.finalizing_at = Batch.Status.FINALIZING, now
        batch.save(update_fields=["status", "finalizing_at"])
    code = {Batch.Status.EXPIRED: "batch_expired",
            Batch.Status.CANCELLED: "batch_cancelled"}.get(outcome)
    out: list[bytes] = []
    err: list[bytes] = []
    unanswered = 0
    for line in BatchLine.objects.filter(batch_id=batch_id).order_by("line").iterator(
            chunk_size=1000):
        if line.status != BatchLine.Status.DONE:
            unanswered += 1
            line.error = {"code": code or "batch_failed",
                          "message": "The batch ended before this request ran "
                                     f"({outcome})"}
            line.status, line.answered_at = BatchLine.Status.DONE, now
            line.save(update_fields=["error", "status", "answered_at"])
        entry = json.dumps(_output_entry(line), separators=(",", ":")).encode()
        ok = line.status_code is not None and 200 <= line.status_code < 300
        (out if ok else err).append(entry)
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(id=batch_id)
        if out:
            batch.output_file_id = _output_file(batch.id, "output", out).id
        if err:
            batch.error_file_id = _output_file(batch.id, "errors", err).id
        batch.failed += unanswered
        batch.status = outcome
        setattr(batch, f"{outcome}_at", timezone.now())
        batch.runner = None
        batch.save()
    _progress_sent.pop(batch.id, None)
    log.info("batch_finalized", batch_id=batch.id, status=outcome, completed=batch.completed,
             failed=batch.failed)
    batch_progress(batch=batch, force=True)
    return batch


def _output_file(batch_id: str, kind: str, lines: list[bytes]) -> File:
    content = b"\n".join(lines) + b"\n"
    return File.objects.create(id=new_id("file-"), filename=f"{batch_id}_{kind}.jsonl",
                               purpose=File.Purpose.BATCH_OUTPUT, bytes=len(content),
                               lines=len(lines), content=content)


def batch_progress(*, batch: Batch | None = None, batch_id: str | None = None,
                   force: bool = False) -> None:
    """``batch:progress`` over /ws/events (ids, status and counts, never a prompt); while
    lines are answered at most every PROGRESS_EVERY_S per batch."""
    key = batch.id if batch is not None else batch_id
    now = time.monotonic()
    if not force and now - _progress_sent.get(key, 0.0) < PROGRESS_EVERY_S:
        return
    _progress_sent[key] = now
    if batch is None:
        batch = Batch.objects.filter(id=key).first()
        if batch is None:
            return
    publish("batch:progress", {
        "batch_id": batch.id, "status": batch.status, "model": batch.model,
        "endpoint": batch.endpoint,
        "request_counts": {"total": batch.total, "completed": batch.completed,
                           "failed": batch.failed}})
