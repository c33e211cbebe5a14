"""A batch while it runs and when it ends: one runner at a time (``batch_take_over``,
``batch_heartbeat``), its lines claimed, requeued and answered (each at most once), the
output and error files written at its end (``batch_finalize``), and ``batch:progress``
over /ws/events."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import structlog
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from batches.files import CHUNK_BYTES, new_id
from batches.models import Batch, BatchLine, File, FileChunk
from core.events import OWNER_FIELD, publish

log = structlog.get_logger(__name__)

PROGRESS_EVERY_S = 0.5  # batch:progress while lines are answered, at most this often
FINALIZE_BEAT_S = 1.0  # a finalizer's heartbeat while it writes the output

_progress_sent: dict[str, float] = {}


def runner_stale(batch: Batch) -> bool:
    """The batch's runner sent no heartbeat for BATCH_RUNNER_STALE_S (or has none)."""
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
        if batch.runner not in (None, runner) and not force and not runner_stale(batch):
            return "wait", batch
        now = timezone.now()
        batch.runner, batch.runner_seen_at = runner, now
        fields = ["runner", "runner_seen_at"]
        if batch.status == Batch.Status.VALIDATING:
            batch.status, batch.in_progress_at = Batch.Status.IN_PROGRESS, now
            fields += ["status", "in_progress_at"]
        batch.save(update_fields=fields)
        requeued = BatchLine.objects.filter(batch=batch, status=BatchLine.Status.RUNNING).update(
            status=BatchLine.Status.PENDING, runner=None
        )
    if requeued:
        log.info("batch_lines_requeued", batch_id=batch_id, lines=requeued)
    batch_progress(batch=batch, force=True)
    return "run", batch


def batch_heartbeat(*, batch_id: str, runner: str) -> str | None:
    """The batch's status, or None when this runner no longer holds it."""
    if not Batch.objects.filter(id=batch_id, runner=runner).update(runner_seen_at=timezone.now()):
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
        if (
            not Batch.objects.select_for_update()
            .filter(id=batch_id, runner=runner, status=Batch.Status.IN_PROGRESS, expires_at__gt=timezone.now())
            .values_list("id", flat=True)
            .first()
        ):
            return []
        query = BatchLine.objects.filter(batch_id=batch_id, status=BatchLine.Status.PENDING).order_by("line")
        if connection.features.has_select_for_update_skip_locked:
            query = query.select_for_update(skip_locked=True)
        lines = list(query.values("id", "line", "custom_id", "request_id", "body")[:n])
        BatchLine.objects.filter(id__in=[x["id"] for x in lines]).update(
            status=BatchLine.Status.RUNNING, runner=runner, attempts=F("attempts") + 1
        )
    return lines


def batch_line_requeue(*, line_id: int, runner: str) -> None:
    """A line the engine could not take now (model not resident, busy): back in line."""
    BatchLine.objects.filter(id=line_id, runner=runner, status=BatchLine.Status.RUNNING).update(
        status=BatchLine.Status.PENDING, runner=None
    )


def batch_line_answer(*, line_id: int, status_code: int, response: dict[str, Any], headers: dict[str, str]) -> bool:
    """Record a line's answer; False (and nothing written) if it already has one."""
    usage = response.get("usage") if isinstance(response, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    ok = 200 <= status_code < 300
    with transaction.atomic():
        line = BatchLine.objects.select_for_update().filter(id=line_id).exclude(status=BatchLine.Status.DONE).first()
        if line is None:
            return False
        line.status, line.status_code = BatchLine.Status.DONE, status_code
        line.response, line.headers, line.answered_at = response, headers, timezone.now()
        line.save(update_fields=["status", "status_code", "response", "headers", "answered_at"])
        counts: dict[str, Any] = {"completed" if ok else "failed": F("completed" if ok else "failed") + 1}
        if ok:
            counts["input_tokens"] = F("input_tokens") + int(usage.get("prompt_tokens") or 0)
            counts["output_tokens"] = F("output_tokens") + int(usage.get("completion_tokens") or 0)
        Batch.objects.filter(id=line.batch_id).update(**counts)
    return True


def _output_entry(line: dict[str, Any]) -> dict[str, Any]:
    if line["status_code"] is None:
        return {"id": line["request_id"], "custom_id": line["custom_id"], "response": None, "error": line["error"]}
    return {
        "id": line["request_id"],
        "custom_id": line["custom_id"],
        "response": {
            "status_code": line["status_code"],
            "request_id": line["request_id"],
            "body": line["response"],
            "headers": line["headers"] or {},
        },
        "error": None,
    }


class _OutputWriter:
    """One output file of a batch, written a chunk at a time; created with its first
    line, ``complete`` (listed and readable) only when the batch ends."""

    def __init__(self, batch: Batch, kind: str) -> None:
        self.batch = batch
        self.filename = f"{batch.id}_{kind}.jsonl"
        self.file: File | None = None
        self.buffer = bytearray()
        self.index = 0
        self.bytes = 0
        self.lines = 0

    def add(self, entry: bytes) -> None:
        if self.file is None:
            self.file = File.objects.create(
                id=new_id("file-"),
                owner=self.batch.owner,
                filename=self.filename,
                purpose=File.Purpose.BATCH_OUTPUT,
                bytes=0,
                lines=0,
                complete=False,
            )
        self.buffer += entry
        self.buffer += b"\n"
        self.lines += 1
        self.bytes += len(entry) + 1
        if len(self.buffer) >= CHUNK_BYTES:
            self.flush()

    def flush(self) -> None:
        while self.buffer:
            data = bytes(self.buffer[:CHUNK_BYTES])
            del self.buffer[:CHUNK_BYTES]
            FileChunk.objects.create(file=self.file, index=self.index, data=data)
            self.index += 1
            if len(self.buffer) < CHUNK_BYTES:
                break

    def close(self) -> str | None:
        """Write what is left; the file's id (None if no line went to it)."""
        if self.file is None:
            return None
        while self.buffer:
            data = bytes(self.buffer[:CHUNK_BYTES])
            del self.buffer[:CHUNK_BYTES]
            FileChunk.objects.create(file=self.file, index=self.index, data=data)
            self.index += 1
        File.objects.filter(id=self.file.id).update(bytes=self.bytes, lines=self.lines)
        return self.file.id

    def discard(self) -> None:
        if self.file is not None:
            File.objects.filter(id=self.file.id).delete()


def batch_finalize(*, batch_id: str, outcome: str, error: dict[str, Any] | None = None) -> Batch:
    """End the batch (``completed``, ``expired``, ``cancelled``, or ``failed`` when its
    runners kept dying): the answered lines go to the output file (2xx) or the error file
    (the rest), lines never answered to the error file with ``batch_expired`` /
    ``batch_cancelled`` / ``batch_failed``, in input order. A batch that is ``cancelling``
    ends ``cancelled`` whatever outcome was asked for.

    The files are written a chunk at a time while this finalizer holds the batch (its
    ``runner``, with a heartbeat per chunk); one that dies leaves the batch
    ``finalizing`` with a stale heartbeat, and the sweeper finalizes it again (this
    function can be run again from any point: the half-written files of an earlier try
    are deleted first)."""
    now = timezone.now()
    me = f"finalize:{uuid.uuid4().hex[:12]}"
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(id=batch_id)
        if batch.terminal:
            return batch
        if batch.status == Batch.Status.CANCELLING or batch.cancelling_at is not None:
            # a cancel recorded before the end wins over what the runner saw (OpenAI:
            # a cancelled batch ends ``cancelled``, whatever was answered meanwhile)
            outcome = Batch.Status.CANCELLED
        code = {Batch.Status.EXPIRED: "batch_expired", Batch.Status.CANCELLED: "batch_cancelled"}.get(
            outcome, "batch_failed"
        )
        unanswered = (
            BatchLine.objects.filter(batch_id=batch_id)
            .exclude(status=BatchLine.Status.DONE)
            .update(
                status=BatchLine.Status.DONE,
                answered_at=now,
                error={"code": code, "message": f"The batch ended before this request ran ({outcome})"},
            )
        )
        batch.status = Batch.Status.FINALIZING
        batch.finalizing_at = batch.finalizing_at or now
        batch.failed += unanswered
        batch.runner, batch.runner_seen_at = me, now
        if error is not None:
            batch.errors = [error]
        batch.save(update_fields=["status", "finalizing_at", "failed", "runner", "runner_seen_at", "errors"])
        # an earlier finalizer's half-written files
        File.objects.filter(
            filename__in=[f"{batch_id}_output.jsonl", f"{batch_id}_errors.jsonl"], complete=False
        ).delete()
    writers = {True: _OutputWriter(batch, "output"), False: _OutputWriter(batch, "errors")}
    seen = time.monotonic()
    try:
        for line in (
            BatchLine.objects.filter(batch_id=batch_id)
            .order_by("line")
            .values("request_id", "custom_id", "status_code", "response", "headers", "error")
            .iterator(chunk_size=100)
        ):
            ok = line["status_code"] is not None and 200 <= line["status_code"] < 300
            writers[ok].add(json.dumps(_output_entry(line), separators=(",", ":")).encode())
            if time.monotonic() - seen >= FINALIZE_BEAT_S:
                seen = time.monotonic()
                if not Batch.objects.filter(id=batch_id, runner=me).update(runner_seen_at=timezone.now()):
                    raise _Lost()
        out, err = writers[True].close(), writers[False].close()
        with transaction.atomic():
            batch = Batch.objects.select_for_update().get(id=batch_id)
            if batch.runner != me or batch.status != Batch.Status.FINALIZING:
                raise _Lost()
            File.objects.filter(id__in=[x for x in (out, err) if x]).update(complete=True)
            batch.output_file_id, batch.error_file_id = out, err
            batch.status = outcome
            setattr(batch, f"{outcome}_at", timezone.now())
            batch.runner = None
            batch.save()
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    _progress_sent.pop(batch.id, None)
    log.info("batch_finalized", batch_id=batch.id, status=outcome, completed=batch.completed, failed=batch.failed)
    batch_progress(batch=batch, force=True)
    return batch


class _Lost(Exception):
    """Another finalizer (the sweeper's) took the batch over: this one's files go."""


def batch_progress(*, batch: Batch | None = None, batch_id: str | None = None, force: bool = False) -> None:
    """``batch:progress`` over /ws/events (ids, status and counts, never a prompt), to the
    batch's owner and admin sockets only; while lines are answered at most every
    PROGRESS_EVERY_S per batch."""
    key = batch.id if batch is not None else batch_id
    now = time.monotonic()
    if not force and now - _progress_sent.get(key, 0.0) < PROGRESS_EVERY_S:
        return
    _progress_sent[key] = now
    if batch is None:
        batch = Batch.objects.filter(id=key).first()
        if batch is None:
            return
    publish(
        "batch:progress",
        {
            "batch_id": batch.id,
            "status": batch.status,
            "model": batch.model,
            "endpoint": batch.endpoint,
            "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
            OWNER_FIELD: batch.owner,
        },
    )
