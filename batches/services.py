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

This module creates, cancels and sweeps batches; a file's storage is ``batches.files``,
a running batch's lines and its end ``batches.running`` (both re-exported here).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta
from typing import Any

import structlog
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from audit.services import audited
from batches.errors import BatchNotCancellable, FileNotFound, InvalidBatchRequest
from batches.files import (  # noqa: F401 - re-exported: the files' mutations
    CHUNK_BYTES,
    QUOTA_LOCK_KEY,
    UPLOAD_ABANDONED_S,
    _file_chunks,
    _numbered_lines,
    file_check_quota,
    file_create,
    file_delete,
    files_bytes,
    files_sweep_uploads,
    new_id,
)
from batches.models import Batch, BatchLine, File
from batches.running import (  # noqa: F401 - re-exported: a running batch's mutations
    FINALIZE_BEAT_S,
    PROGRESS_EVERY_S,
    batch_claim_lines,
    batch_finalize,
    batch_heartbeat,
    batch_line_answer,
    batch_line_requeue,
    batch_progress,
    batch_take_over,
    runner_stale,
)
from core.auth import ANONYMOUS, Principal
from core.jobs import enqueue
from steering.live import scope_snapshot

log = structlog.get_logger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/probes/score")
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
CUSTOM_ID_MAX_CHARS = 512
ERRORS_SHOWN = 100  # of a failed validation; the rest are counted in the last message
MODELS_NAMED = 8  # models named by a mismatched_model error, at most


# --------------------------------------------------------------------------- batches


def _custom_id_key(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "big")


class _LineReader:
    """Check a batch's lines as they stream in and write the good ones in bounded
    groups; the first ERRORS_SHOWN errors are kept, the rest counted."""

    def __init__(self, batch: Batch, endpoint: str) -> None:
        self.batch = batch
        self.endpoint = endpoint
        self.errors: list[dict[str, Any]] = []
        self.more_errors = 0
        self.models: set[str] = set()
        self.seen: set[int] = set()  # 8-byte digests of the custom_ids (a hit is re-checked)
        self.rows: list[BatchLine] = []
        self.row_bytes = 0
        self.total = 0

    def err(self, number: int, code: str, message: str, param: str | None = None) -> None:
        if len(self.errors) < ERRORS_SHOWN:
            self.errors.append({"code": code, "message": message, "param": param, "line": number})
        else:
            self.more_errors += 1

    def flush(self) -> None:
        if self.rows and not self.errors:
            BatchLine.objects.bulk_create(self.rows)
        self.rows, self.row_bytes = [], 0

    def duplicate(self, custom_id: str) -> bool:
        key = _custom_id_key(custom_id)
        if key not in self.seen:
            self.seen.add(key)
            return False
        # the same digest: the same id, unless two ids collide (then both are kept)
        if any(row.custom_id == custom_id for row in self.rows):
            return True
        if self.errors:  # nothing is written once a line failed: ask no table
            return True
        return BatchLine.objects.filter(batch=self.batch, custom_id=custom_id).exists()

    def add(self, number: int, raw: bytes) -> None:
        try:
            item = json.loads(raw)
        except ValueError:
            item = None
        if not isinstance(item, dict):
            return self.err(number, "invalid_json_line", "The line is not a JSON object")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > CUSTOM_ID_MAX_CHARS:
            return self.err(
                number,
                "invalid_custom_id",
                f"custom_id must be a string of 1-{CUSTOM_ID_MAX_CHARS} characters",
                "custom_id",
            )
        if self.duplicate(custom_id):
            return self.err(
                number,
                "duplicate_custom_id",
                f"custom_id {custom_id!r} appears more than once in the file",
                "custom_id",
            )
        if item.get("method") != "POST":
            return self.err(number, "invalid_method", "method must be POST", "method")
        if item.get("url") != self.endpoint:
            return self.err(
                number,
                "invalid_url",
                f"url must be the batch's endpoint {self.endpoint} (got {item.get('url')!r})",
                "url",
            )
        body = item.get("body")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return self.err(number, "invalid_body", "body must be a JSON object naming a model", "body")
        if body.get("stream"):
            return self.err(number, "invalid_body", "stream is not available in a batch", "body.stream")
        if len(self.models) < MODELS_NAMED:
            self.models.add(body["model"])
        elif body["model"] not in self.models:
            self.models.add("…")
        self.total += 1
        if self.errors:
            return None  # the batch fails: only the errors matter now
        self.rows.append(
            BatchLine(batch=self.batch, line=number, custom_id=custom_id, request_id=new_id("batch_req_"), body=body)
        )
        self.row_bytes += len(raw)
        if self.row_bytes >= CHUNK_BYTES or len(self.rows) >= 1000:
            self.flush()
        return None

    def finish(self) -> None:
        self.flush()
        if not self.errors and len(self.models) > 1:
            self.err(
                0,
                "mismatched_model",
                f"The lines of one batch must name one model (found {', '.join(sorted(self.models))})",
                "body.model",
            )
        if self.more_errors:
            last = self.errors[-1]
            self.errors[-1] = {**last, "message": last["message"] + f" ({self.more_errors} more errors not shown)"}


def batch_create(
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None = None,
    principal: Principal = ANONYMOUS,
) -> Batch:
    """A batch of the file's lines, queued for a runner; or, if lines are malformed, a
    ``failed`` batch whose ``errors`` name them (OpenAI's behaviour). The file is read a
    chunk at a time and its lines written in bounded groups. The batch is the caller's
    (``principal.owner``); the file must be one the caller may read."""
    if endpoint not in ENDPOINTS:
        raise InvalidBatchRequest(
            f"endpoint must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})", details={"param": "endpoint"}
        )
    if completion_window not in COMPLETION_WINDOWS:
        raise InvalidBatchRequest("completion_window must be '24h'", details={"param": "completion_window"})
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or any(
            not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512 for k, v in metadata.items()
        )
    ):
        raise InvalidBatchRequest(
            "metadata is at most 16 string pairs (keys up to 64, values up to 512 characters)",
            details={"param": "metadata"},
        )
    query = File.objects.filter(id=input_file_id, complete=True)
    if not principal.admin:
        query = query.filter(owner=principal.owner)
    file = query.first()
    if file is None:
        raise FileNotFound(f"No file with id {input_file_id!r}", details={"param": "input_file_id"})
    if file.purpose != File.Purpose.BATCH:
        raise InvalidBatchRequest(
            f"File {input_file_id} has purpose {file.purpose!r}, not 'batch'", details={"param": "input_file_id"}
        )
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.create(
            id=new_id("batch_"),
            owner=principal.owner,
            endpoint=endpoint,
            input_file_id=file.id,
            completion_window=completion_window,
            metadata=metadata,
            expires_at=now + COMPLETION_WINDOWS[completion_window],
            # what its lines without steering of their own run: the key's scope as of now
            live_steering=scope_snapshot(principal.owner),
        )
        reader = _LineReader(batch, endpoint)
        with transaction.atomic():  # a savepoint: the lines go if one of them is bad
            for number, raw in _numbered_lines(_file_chunks(file.id)):
                reader.add(number, raw)
            reader.finish()
            if reader.errors:
                BatchLine.objects.filter(batch=batch).delete()
        if reader.errors:
            batch.errors = reader.errors
            batch.status = Batch.Status.FAILED
            batch.failed_at = now
            batch.save(update_fields=["errors", "status", "failed_at"])
        else:
            batch.total = reader.total
            batch.model = next(iter(reader.models))
            batch.save(update_fields=["total", "model"])
            enqueue("batches.tasks.batch_run_task", batch.id, queue="batches")
    log.info("batch_created", batch_id=batch.id, lines=reader.total, failed=bool(reader.errors), owner=principal.owner)
    batch_progress(batch=batch, force=True)
    return batch


@audited("batch.cancel", lambda kw, r: ("batch", kw.get("batch_id", ""), ""))
def batch_cancel(*, batch_id: str) -> Batch:
    """``cancelling``: the runner sends no new line and ends the batch ``cancelled`` once
    the lines at the engine are answered; a batch no live runner holds ends at once."""
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(id=batch_id)
        if batch.status in (Batch.Status.CANCELLING, Batch.Status.CANCELLED):
            return batch
        if batch.terminal or batch.status == Batch.Status.FINALIZING:
            raise BatchNotCancellable(
                f"Batch {batch.id} is {batch.status} and cannot be cancelled", details={"status": batch.status}
            )
        batch.status = Batch.Status.CANCELLING
        batch.cancelling_at = timezone.now()
        batch.save(update_fields=["status", "cancelling_at"])
        live = batch.runner is not None and not runner_stale(batch)
    batch_progress(batch=batch, force=True)
    if not live:
        batch_finalize(batch_id=batch.id, outcome=Batch.Status.CANCELLED)
        batch.refresh_from_db()
    return batch


# --------------------------------------------------------------------------- sweeping


def _stale_before() -> datetime:
    return timezone.now() - timedelta(seconds=float(settings.BATCH_RUNNER_STALE_S))


def batches_sweep() -> dict[str, int]:
    """End or resume every batch nobody runs (issue 31, item 11), so every batch ends:

    - past its completion window (``expires_at``) with no live runner: ``expired`` (or
      ``cancelled`` if a cancel was recorded), answered lines kept;
    - ``cancelling`` with no live runner: ``cancelled``;
    - ``in_progress`` whose runner's heartbeat is older than BATCH_RUNNER_STALE_S (its
      worker was killed, a database error ended it): queued for a new runner, which
      re-runs only the lines that were never answered; after BATCH_MAX_RESUMES such
      resumes it ends ``failed`` (its answered lines kept);
    - ``finalizing`` whose finalizer stopped: finalized again.

    A batch with no runner at all is waiting in the queue: only its expiry concerns the
    sweeper. Returns how many batches each rule handled. Run by the embedded process and
    by every Celery worker of the ``batches`` queue (batches/sweeper.py), every
    BATCH_SWEEP_INTERVAL_S; safe to run anywhere at once (each decision is made under the
    batch's row lock)."""
    done = {"expired": 0, "cancelled": 0, "resumed": 0, "failed": 0, "finalized": 0, "uploads": files_sweep_uploads()}
    now = timezone.now()
    stale = _stale_before()
    dead = Q(runner__isnull=True) | Q(runner_seen_at__isnull=True) | Q(runner_seen_at__lt=stale)
    candidates = (
        Batch.objects.exclude(status__in=Batch.TERMINAL)
        .filter(dead | Q(expires_at__lte=now))
        .values_list("id", flat=True)
    )
    for batch_id in list(candidates):
        action = None
        with transaction.atomic():
            batch = Batch.objects.select_for_update(skip_locked=True).filter(id=batch_id).first()
            if batch is None or batch.terminal:
                continue
            gone = batch.runner is not None and (batch.runner_seen_at is None or batch.runner_seen_at < _stale_before())
            alive = batch.runner is not None and not gone
            if alive:
                continue  # a live runner ends its batch itself (expiry included)
            if batch.status == Batch.Status.FINALIZING:
                action = "finalized"
            elif batch.expires_at <= timezone.now():
                action = "expired"
            elif batch.status == Batch.Status.CANCELLING:
                action = "cancelled"
            elif gone and batch.resumes >= int(settings.BATCH_MAX_RESUMES):
                action = "failed"
            elif gone:
                batch.runner, batch.runner_seen_at = None, None
                batch.resumes += 1
                batch.save(update_fields=["runner", "runner_seen_at", "resumes"])
                enqueue("batches.tasks.batch_run_task", batch.id, queue="batches")
                action = "resumed"
        if action is None:
            continue
        log.warning("batch_swept", batch_id=batch_id, action=action)
        done[action] += 1
        if action == "expired":
            batch_finalize(batch_id=batch_id, outcome=Batch.Status.EXPIRED)
        elif action == "cancelled":
            batch_finalize(batch_id=batch_id, outcome=Batch.Status.CANCELLED)
        elif action == "failed":
            batch_finalize(
                batch_id=batch_id,
                outcome=Batch.Status.FAILED,
                error={
                    "code": "batch_runner_failed",
                    "param": None,
                    "line": None,
                    "message": f"The batch's runner stopped {batch.resumes + 1} times without "
                    f"finishing it (BATCH_MAX_RESUMES={settings.BATCH_MAX_RESUMES}); "
                    "the lines answered are in the output and error files",
                },
            )
        elif action == "finalized":
            batch_finalize(batch_id=batch_id, outcome=_outcome_of(batch))
    return done


def _outcome_of(batch: Batch) -> str:
    """What a batch left ``finalizing`` was ending as."""
    if batch.cancelling_at is not None:
        return Batch.Status.CANCELLED
    if batch.errors and any(e.get("code") == "batch_runner_failed" for e in batch.errors):
        return Batch.Status.FAILED
    if batch.finalizing_at is not None and batch.finalizing_at >= batch.expires_at:
        return Batch.Status.EXPIRED
    return Batch.Status.COMPLETED
