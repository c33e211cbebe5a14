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

import hashlib
import io
import json
import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any, BinaryIO

import structlog
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from batches.errors import (
    BatchNotCancellable,
    FileNotFound,
    FilesQuotaExceeded,
    FileTooLarge,
    InsufficientStorage,
    InvalidBatchRequest,
    InvalidFile,
    LineTooLarge,
    TooManyLines,
)
from batches.models import Batch, BatchLine, File, FileChunk
from core.auth import ANONYMOUS, Principal
from core.events import OWNER_FIELD, publish
from core.jobs import enqueue

log = structlog.get_logger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/probes/score")
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
CUSTOM_ID_MAX_CHARS = 512
ERRORS_SHOWN = 100  # of a failed validation; the rest are counted in the last message
PROGRESS_EVERY_S = 0.5  # batch:progress while lines are answered, at most this often
CHUNK_BYTES = 256 * 1024  # a FileChunk row; what a file is read and written by
MODELS_NAMED = 8  # models named by a mismatched_model error, at most
QUOTA_LOCK_KEY = 0x6D696C6C6D5F6631  # pg_advisory_xact_lock of the files quota
UPLOAD_ABANDONED_S = 3600.0  # an upload unfinished this long died with its process
FINALIZE_BEAT_S = 1.0  # a finalizer's heartbeat while it writes the output

_progress_sent: dict[str, float] = {}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- files
#
# A file's bytes are FileChunk rows of at most CHUNK_BYTES: an upload is read, checked and
# stored a chunk at a time, a batch's lines are read from its file the same way, and its
# output is written so; no file is ever whole in memory (issue 31, item 7).

def _numbered_lines(chunks: Iterable[bytes], *, max_line: int | None = None
                    ) -> Iterator[tuple[int, bytes]]:
    """``(number, line)`` of a stream of chunks, 1-based, without the newline; blank
    lines at the end are dropped (a trailing newline ends the last line, it does not add
    one). With ``max_line``, a line longer than that raises LineTooLarge as soon as its
    bytes pass it, before the rest of it is read."""
    number = 0
    blanks: list[bytes] = []  # blank lines not yet known to be followed by a line
    partial = b""

    def emit(raw: bytes) -> Iterator[tuple[int, bytes]]:
        nonlocal number
        if not raw.strip():
            blanks.append(raw)
            return
        for blank in blanks:
            number += 1
            yield number, blank
        blanks.clear()
        number += 1
        yield number, raw

    def too_large(size: int) -> LineTooLarge:
        at = number + len(blanks) + 1
        return LineTooLarge(f"Line {at} is {size} bytes or more; a line may have at most "
                            f"{max_line} bytes", details={"param": "file", "line": at})

    for chunk in chunks:
        pieces = chunk.split(b"\n")
        pieces[0] = partial + pieces[0]
        partial = pieces.pop()
        for raw in pieces:
            if max_line is not None and len(raw) > max_line:
                raise too_large(len(raw))
            yield from emit(raw)
        if max_line is not None and len(partial) > max_line:
            raise too_large(len(partial))
    if partial:
        yield from emit(partial)


def _file_chunks(file_id: str) -> Iterator[bytes]:
    """The file's bytes, a chunk (one row) at a time."""
    for pk in list(FileChunk.objects.filter(file_id=file_id).order_by("index")
                   .values_list("pk", flat=True)):
        data = FileChunk.objects.filter(pk=pk).values_list("data", flat=True).first()
        if data is not None:
            yield bytes(data)


def _read_chunks(stream: BinaryIO) -> Iterator[bytes]:
    while True:
        data = stream.read(CHUNK_BYTES)
        if not data:
            return
        yield data


def files_bytes(*, owner: str | None = None) -> int:
    """Bytes the Files API holds (for ``owner``, or in all): inputs, outputs and uploads
    under way."""
    query = File.objects.all() if owner is None else File.objects.filter(owner=owner)
    return int(query.aggregate(total=Sum("bytes"))["total"] or 0)


def file_check_quota(*, owner: str, size: int) -> None:
    """Whether ``size`` more bytes fit the owner's quota (FILES_MAX_BYTES_PER_OWNER, 413
    ``files_quota_exceeded``) and the server's (FILES_MAX_BYTES_TOTAL, 507
    ``insufficient_storage``); 0 means no limit."""
    per_owner = int(settings.FILES_MAX_BYTES_PER_OWNER)
    total = int(settings.FILES_MAX_BYTES_TOTAL)
    if per_owner:
        used = files_bytes(owner=owner)
        if used + size > per_owner:
            raise FilesQuotaExceeded(
                f"This file ({size} bytes) does not fit your files quota: you hold {used} "
                f"of {per_owner} bytes (FILES_MAX_BYTES_PER_OWNER); delete files you no "
                "longer need", details={"param": "file"})
    if total:
        used = files_bytes()
        if used + size > total:
            raise InsufficientStorage(
                f"The server's file storage is full: this file ({size} bytes) does not fit "
                f"the {total} bytes all files may hold (FILES_MAX_BYTES_TOTAL); "
                f"{max(total - used, 0)} bytes are free", details={"param": "file"})


def _quota_lock() -> None:
    """One quota check and reservation at a time (PostgreSQL: a transaction-scoped
    advisory lock; SQLite serializes every write anyway)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [QUOTA_LOCK_KEY])


def file_create(*, filename: str, purpose: str, content: bytes | BinaryIO,
                owner: str = "anonymous", size: int | None = None) -> File:
    """Store a batch input file for ``owner``: its size is checked against the limits
    and quotas before any byte is stored, then it is read, checked (BATCH_MAX_FILE_LINES,
    BATCH_MAX_LINE_BYTES, one JSON object a line) and stored a chunk at a time. Any
    refusal leaves nothing stored."""
    if purpose != File.Purpose.BATCH:
        raise InvalidFile(f"purpose must be 'batch' (got {purpose!r}): this server stores "
                          "files for the Batch API only", details={"param": "purpose"})
    stream = io.BytesIO(content) if isinstance(content, bytes | bytearray) else content
    if size is None:
        size = stream.seek(0, io.SEEK_END)
        stream.seek(0)
    if size > settings.BATCH_MAX_FILE_BYTES:
        raise FileTooLarge(
            f"The file is {size} bytes; a batch input file may have at most "
            f"{settings.BATCH_MAX_FILE_BYTES} bytes", details={"param": "file"})
    with transaction.atomic():
        _quota_lock()
        file_check_quota(owner=owner, size=size)
        # the reservation: counted by every later quota check, never listed nor read
        file = File.objects.create(id=new_id("file-"), owner=owner,
                                   filename=filename[:255] or "upload.jsonl", purpose=purpose,
                                   bytes=size, lines=0, complete=False)
    try:
        with transaction.atomic():
            stored, lines = _store_input(file, stream)
            File.objects.filter(id=file.id).update(bytes=stored, lines=lines, complete=True)
    except BaseException:
        File.objects.filter(id=file.id).delete()
        raise
    file.bytes, file.lines, file.complete = stored, lines, True
    return file


def _store_input(file: File, stream: BinaryIO) -> tuple[int, int]:
    """Check and store the upload chunk by chunk; its size and number of lines."""
    stored = 0
    index = 0

    def chunks() -> Iterator[bytes]:
        nonlocal stored, index
        for data in _read_chunks(stream):
            stored += len(data)
            if stored > settings.BATCH_MAX_FILE_BYTES:
                raise FileTooLarge(f"The file is more than {settings.BATCH_MAX_FILE_BYTES} "
                                   "bytes; a batch input file may have at most that",
                                   details={"param": "file"})
            FileChunk.objects.create(file=file, index=index, data=data)
            index += 1
            yield data

    lines = 0
    for number, raw in _numbered_lines(chunks(), max_line=settings.BATCH_MAX_LINE_BYTES):
        if number > settings.BATCH_MAX_FILE_LINES:
            raise TooManyLines(f"The file has more than {settings.BATCH_MAX_FILE_LINES} "
                               "lines; a batch input file may have at most "
                               f"{settings.BATCH_MAX_FILE_LINES} requests",
                               details={"param": "file"})
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise InvalidFile(f"Line {number} is not a JSON object; a batch input file is "
                              "JSONL, one request object per line",
                              details={"param": "file", "line": number})
        lines = number
    if not lines:
        raise InvalidFile("The file is empty; a batch input file has one JSON request "
                          "per line", details={"param": "file"})
    return stored, lines


def file_delete(*, file: File) -> None:
    """The batches that used it keep their lines (copied at creation) and their results."""
    file.delete()


def files_sweep_uploads(*, older_than_s: float = UPLOAD_ABANDONED_S) -> int:
    """Delete the reservations of uploads that never finished (their process died)."""
    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    deleted, _ = File.objects.filter(purpose=File.Purpose.BATCH, complete=False,
                                     created_at__lt=cutoff).delete()
    return deleted


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
            self.errors.append({"code": code, "message": message, "param": param,
                                "line": number})
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
        if not isinstance(custom_id, str) or not custom_id \
                or len(custom_id) > CUSTOM_ID_MAX_CHARS:
            return self.err(number, "invalid_custom_id", "custom_id must be a string of 1-"
                            f"{CUSTOM_ID_MAX_CHARS} characters", "custom_id")
        if self.duplicate(custom_id):
            return self.err(number, "duplicate_custom_id",
                            f"custom_id {custom_id!r} appears more than once in the file",
                            "custom_id")
        if item.get("method") != "POST":
            return self.err(number, "invalid_method", "method must be POST", "method")
        if item.get("url") != self.endpoint:
            return self.err(number, "invalid_url", f"url must be the batch's endpoint "
                            f"{self.endpoint} (got {item.get('url')!r})", "url")
        body = item.get("body")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return self.err(number, "invalid_body", "body must be a JSON object naming a "
                            "model", "body")
        if body.get("stream"):
            return self.err(number, "invalid_body", "stream is not available in a batch",
                            "body.stream")
        if len(self.models) < MODELS_NAMED:
            self.models.add(body["model"])
        elif body["model"] not in self.models:
            self.models.add("…")
        self.total += 1
        if self.errors:
            return None  # the batch fails: only the errors matter now
        self.rows.append(BatchLine(batch=self.batch, line=number, custom_id=custom_id,
                                   request_id=new_id("batch_req_"), body=body))
        self.row_bytes += len(raw)
        if self.row_bytes >= CHUNK_BYTES or len(self.rows) >= 1000:
            self.flush()
        return None

    def finish(self) -> None:
        self.flush()
        if not self.errors and len(self.models) > 1:
            self.err(0, "mismatched_model", "The lines of one batch must name one model "
                     f"(found {', '.join(sorted(self.models))})", "body.model")
        if self.more_errors:
            last = self.errors[-1]
            self.errors[-1] = {**last, "message": last["message"] +
                               f" ({self.more_errors} more errors not shown)"}


def batch_create(*, input_file_id: str, endpoint: str, completion_window: str,
                 metadata: dict[str, str] | None = None,
                 principal: Principal = ANONYMOUS) -> Batch:
    """A batch of the file's lines, queued for a runner; or, if lines are malformed, a
    ``failed`` batch whose ``errors`` name them (OpenAI's behaviour). The file is read a
    chunk at a time and its lines written in bounded groups. The batch is the caller's
    (``principal.owner``); the file must be one the caller may read."""
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
    query = File.objects.filter(id=input_file_id, complete=True)
    if not principal.admin:
        query = query.filter(owner=principal.owner)
    file = query.first()
    if file is None:
        raise FileNotFound(f"No file with id {input_file_id!r}",
                           details={"param": "input_file_id"})
    if file.purpose != File.Purpose.BATCH:
        raise InvalidBatchRequest(f"File {input_file_id} has purpose {file.purpose!r}, not "
                                  "'batch'", details={"param": "input_file_id"})
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.create(
            id=new_id("batch_"), owner=principal.owner, endpoint=endpoint,
            input_file_id=file.id, completion_window=completion_window, metadata=metadata,
            expires_at=now + COMPLETION_WINDOWS[completion_window])
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
    log.info("batch_created", batch_id=batch.id, lines=reader.total,
             failed=bool(reader.errors), owner=principal.owner)
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


def _output_entry(line: dict[str, Any]) -> dict[str, Any]:
    if line["status_code"] is None:
        return {"id": line["request_id"], "custom_id": line["custom_id"], "response": None,
                "error": line["error"]}
    return {"id": line["request_id"], "custom_id": line["custom_id"],
            "response": {"status_code": line["status_code"], "request_id": line["request_id"],
                         "body": line["response"], "headers": line["headers"] or {}},
            "error": None}


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
                id=new_id("file-"), owner=self.batch.owner, filename=self.filename,
                purpose=File.Purpose.BATCH_OUTPUT, bytes=0, lines=0, complete=False)
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


def batch_finalize(*, batch_id: str, outcome: str, error: dict[str, Any] | None = None
                   ) -> Batch:
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
        code = {Batch.Status.EXPIRED: "batch_expired",
                Batch.Status.CANCELLED: "batch_cancelled"}.get(outcome, "batch_failed")
        unanswered = BatchLine.objects.filter(batch_id=batch_id).exclude(
            status=BatchLine.Status.DONE).update(
            status=BatchLine.Status.DONE, answered_at=now,
            error={"code": code, "message": f"The batch ended before this request ran "
                                            f"({outcome})"})
        batch.status = Batch.Status.FINALIZING
        batch.finalizing_at = batch.finalizing_at or now
        batch.failed += unanswered
        batch.runner, batch.runner_seen_at = me, now
        if error is not None:
            batch.errors = [error]
        batch.save(update_fields=["status", "finalizing_at", "failed", "runner",
                                  "runner_seen_at", "errors"])
        # an earlier finalizer's half-written files
        File.objects.filter(filename__in=[f"{batch_id}_output.jsonl",
                                          f"{batch_id}_errors.jsonl"],
                            complete=False).delete()
    writers = {True: _OutputWriter(batch, "output"), False: _OutputWriter(batch, "errors")}
    seen = time.monotonic()
    try:
        for line in BatchLine.objects.filter(batch_id=batch_id).order_by("line").values(
                "request_id", "custom_id", "status_code", "response", "headers", "error"
                ).iterator(chunk_size=100):
            ok = line["status_code"] is not None and 200 <= line["status_code"] < 300
            writers[ok].add(json.dumps(_output_entry(line), separators=(",", ":")).encode())
            if time.monotonic() - seen >= FINALIZE_BEAT_S:
                seen = time.monotonic()
                if not Batch.objects.filter(id=batch_id, runner=me).update(
                        runner_seen_at=timezone.now()):
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
    log.info("batch_finalized", batch_id=batch.id, status=outcome, completed=batch.completed,
             failed=batch.failed)
    batch_progress(batch=batch, force=True)
    return batch


class _Lost(Exception):
    """Another finalizer (the sweeper's) took the batch over: this one's files go."""


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
    done = {"expired": 0, "cancelled": 0, "resumed": 0, "failed": 0, "finalized": 0,
            "uploads": files_sweep_uploads()}
    now = timezone.now()
    stale = _stale_before()
    dead = Q(runner__isnull=True) | Q(runner_seen_at__isnull=True) | Q(runner_seen_at__lt=stale)
    candidates = Batch.objects.exclude(status__in=Batch.TERMINAL).filter(
        dead | Q(expires_at__lte=now)).values_list("id", flat=True)
    for batch_id in list(candidates):
        action = None
        with transaction.atomic():
            batch = Batch.objects.select_for_update(skip_locked=True).filter(
                id=batch_id).first()
            if batch is None or batch.terminal:
                continue
            gone = batch.runner is not None and (batch.runner_seen_at is None
                                                 or batch.runner_seen_at < _stale_before())
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
            batch_finalize(batch_id=batch_id, outcome=Batch.Status.FAILED, error={
                "code": "batch_runner_failed", "param": None, "line": None,
                "message": f"The batch's runner stopped {batch.resumes + 1} times without "
                           f"finishing it (BATCH_MAX_RESUMES={settings.BATCH_MAX_RESUMES}); "
                           "the lines answered are in the output and error files"})
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


def batch_progress(*, batch: Batch | None = None, batch_id: str | None = None,
                   force: bool = False) -> None:
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
    publish("batch:progress", {
        "batch_id": batch.id, "status": batch.status, "model": batch.model,
        "endpoint": batch.endpoint,
        "request_counts": {"total": batch.total, "completed": batch.completed,
                           "failed": batch.failed},
        OWNER_FIELD: batch.owner})
