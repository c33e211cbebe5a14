"""The Batch API's files: an upload read, checked and stored, its quota, deletion, and
the sweep of uploads their process never finished.

A file's bytes are FileChunk rows of at most CHUNK_BYTES: an upload is read, checked and
stored a chunk at a time, a batch's lines are read from its file the same way, and its
output is written so; no file is ever whole in memory (issue 31, item 7).
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import BinaryIO

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Sum
from django.utils import timezone

from audit.services import audited, of_kwarg
from batches.errors import (
    FilesQuotaExceeded,
    FileTooLarge,
    InsufficientStorage,
    InvalidFile,
    LineTooLarge,
    TooManyLines,
)
from batches.models import File, FileChunk

CHUNK_BYTES = 256 * 1024  # a FileChunk row; what a file is read and written by
QUOTA_LOCK_KEY = 0x6D696C6C6D5F6631  # pg_advisory_xact_lock of the files quota
UPLOAD_ABANDONED_S = 3600.0  # an upload unfinished this long died with its process


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _numbered_lines(chunks: Iterable[bytes], *, max_line: int | None = None) -> Iterator[tuple[int, bytes]]:
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
        return LineTooLarge(
            f"Line {at} is {size} bytes or more; a line may have at most {max_line} bytes",
            details={"param": "file", "line": at},
        )

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
    for pk in list(FileChunk.objects.filter(file_id=file_id).order_by("index").values_list("pk", flat=True)):
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
                "longer need",
                details={"param": "file"},
            )
    if total:
        used = files_bytes()
        if used + size > total:
            raise InsufficientStorage(
                f"The server's file storage is full: this file ({size} bytes) does not fit "
                f"the {total} bytes all files may hold (FILES_MAX_BYTES_TOTAL); "
                f"{max(total - used, 0)} bytes are free",
                details={"param": "file"},
            )


def _quota_lock() -> None:
    """One quota check and reservation at a time (PostgreSQL: a transaction-scoped
    advisory lock; SQLite serializes every write anyway)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [QUOTA_LOCK_KEY])


def file_create(
    *, filename: str, purpose: str, content: bytes | BinaryIO, owner: str = "anonymous", size: int | None = None
) -> File:
    """Store a batch input file (or a ``user_data`` text file) for ``owner``: its size is
    checked against the limits and quotas before any byte is stored, then it is read,
    checked (BATCH_MAX_FILE_LINES, BATCH_MAX_LINE_BYTES; a batch input holds one JSON
    object a line, a user_data file UTF-8 text) and stored a chunk at a time. Any refusal
    leaves nothing stored."""
    if purpose not in (File.Purpose.BATCH, File.Purpose.USER_DATA):
        raise InvalidFile(
            f"purpose must be 'batch' (Batch API input) or 'user_data' (UTF-8 text, e.g. a "
            f"feature-dashboard corpus), got {purpose!r}",
            details={"param": "purpose"},
        )
    stream = io.BytesIO(content) if isinstance(content, bytes | bytearray) else content
    if size is None:
        size = stream.seek(0, io.SEEK_END)
        stream.seek(0)
    if size > settings.BATCH_MAX_FILE_BYTES:
        raise FileTooLarge(
            f"The file is {size} bytes; a batch input file may have at most {settings.BATCH_MAX_FILE_BYTES} bytes",
            details={"param": "file"},
        )
    with transaction.atomic():
        _quota_lock()
        file_check_quota(owner=owner, size=size)
        # the reservation: counted by every later quota check, never listed nor read
        file = File.objects.create(
            id=new_id("file-"),
            owner=owner,
            filename=filename[:255] or "upload.jsonl",
            purpose=purpose,
            bytes=size,
            lines=0,
            complete=False,
        )
    try:
        with transaction.atomic():
            stored, lines = _store_input(file, stream, text_only=purpose == File.Purpose.USER_DATA)
            File.objects.filter(id=file.id).update(bytes=stored, lines=lines, complete=True)
    except BaseException:
        File.objects.filter(id=file.id).delete()
        raise
    file.bytes, file.lines, file.complete = stored, lines, True
    return file


def _store_input(file: File, stream: BinaryIO, *, text_only: bool = False) -> tuple[int, int]:
    """Check and store the upload chunk by chunk; its size and number of lines.
    ``text_only``: each line must be UTF-8 text (no NUL), not a JSON request."""
    stored = 0
    index = 0

    def chunks() -> Iterator[bytes]:
        nonlocal stored, index
        for data in _read_chunks(stream):
            stored += len(data)
            if stored > settings.BATCH_MAX_FILE_BYTES:
                raise FileTooLarge(
                    f"The file is more than {settings.BATCH_MAX_FILE_BYTES} "
                    "bytes; a batch input file may have at most that",
                    details={"param": "file"},
                )
            FileChunk.objects.create(file=file, index=index, data=data)
            index += 1
            yield data

    lines = 0
    for number, raw in _numbered_lines(chunks(), max_line=settings.BATCH_MAX_LINE_BYTES):
        if number > settings.BATCH_MAX_FILE_LINES:
            raise TooManyLines(
                f"The file has more than {settings.BATCH_MAX_FILE_LINES} "
                "lines; a batch input file may have at most "
                f"{settings.BATCH_MAX_FILE_LINES} requests",
                details={"param": "file"},
            )
        if text_only:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "\x00"
            if "\x00" in text:
                raise InvalidFile(
                    f"Line {number} is not UTF-8 text; a user_data file is text",
                    details={"param": "file", "line": number},
                )
            lines = number
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise InvalidFile(
                f"Line {number} is not a JSON object; a batch input file is JSONL, one request object per line",
                details={"param": "file", "line": number},
            )
        lines = number
    if not lines:
        what = (
            "a user_data file has at least one line of text"
            if text_only
            else "a batch input file has one JSON request per line"
        )
        raise InvalidFile(f"The file is empty; {what}", details={"param": "file"})
    return stored, lines


@audited("file.delete", of_kwarg("file", "file", "filename"))
def file_delete(*, file: File) -> None:
    """The batches that used it keep their lines (copied at creation) and their results."""
    file.delete()


def files_sweep_uploads(*, older_than_s: float = UPLOAD_ABANDONED_S) -> int:
    """Delete the reservations of uploads that never finished (their process died)."""
    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    deleted, _ = File.objects.filter(purpose=File.Purpose.BATCH, complete=False, created_at__lt=cutoff).delete()
    return deleted
