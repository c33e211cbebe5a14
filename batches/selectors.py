"""Reads of the Batch API: files and batches by id, and their pages.

Every read is the caller's (``core.auth.Principal``): a file or batch of another owner
is not found (404, as if it did not exist) and is never listed; an admin principal (an
admin key, or keys off) sees them all. A file being written (an upload under way, a
batch's output while it finalizes) is neither listed nor read."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Q, QuerySet

from batches.errors import BatchNotFound, FileNotFound
from batches.models import Batch, File, FileChunk
from core.auth import Principal


def _visible(query: QuerySet, principal: Principal) -> QuerySet:
    return query if principal.admin else query.filter(owner=principal.owner)


def _files(principal: Principal) -> QuerySet:
    return _visible(File.objects.filter(complete=True), principal)


def file_get(*, file_id: str, principal: Principal) -> File:
    file = _files(principal).filter(id=file_id).first()
    if file is None:
        raise FileNotFound(f"No file with id {file_id!r}", details={"param": "file_id"})
    return file


def file_chunk_ids(*, file_id: str, principal: Principal) -> list[int]:
    """The file's chunks, in order (read each with ``file_chunk``)."""
    file = file_get(file_id=file_id, principal=principal)
    return list(FileChunk.objects.filter(file=file).order_by("index").values_list("pk", flat=True))


def file_chunk(*, chunk_id: int) -> bytes:
    data = FileChunk.objects.filter(pk=chunk_id).values_list("data", flat=True).first()
    return b"" if data is None else bytes(data)


def file_content(*, file_id: str, principal: Principal) -> Iterator[bytes]:
    """The file's bytes, a chunk at a time."""
    for pk in file_chunk_ids(file_id=file_id, principal=principal):
        yield file_chunk(chunk_id=pk)


def batch_get(*, batch_id: str, principal: Principal) -> Batch:
    batch = _visible(Batch.objects.all(), principal).filter(id=batch_id).first()
    if batch is None:
        raise BatchNotFound(f"No batch with id {batch_id!r}", details={"param": "batch_id"})
    return batch


def _page(
    query: QuerySet, *, after: str | None, limit: int, newest_first: bool, missing: type[Exception]
) -> tuple[list, bool]:
    query = query.order_by(*(("-created_at", "-id") if newest_first else ("created_at", "id")))
    if after:
        # the cursor is one of the listed objects: another owner's id is not found
        cursor = query.filter(id=after).values("created_at", "id").first()
        if cursor is None:
            raise missing(f"No object with id {after!r} to list after", details={"param": "after"})
        when, pk = cursor["created_at"], cursor["id"]
        if newest_first:
            query = query.filter(Q(created_at__lt=when) | Q(created_at=when, id__lt=pk))
        else:
            query = query.filter(Q(created_at__gt=when) | Q(created_at=when, id__gt=pk))
    items = list(query[: limit + 1])
    return items[:limit], len(items) > limit


def files_page(
    *, purpose: str | None, after: str | None, limit: int, order: str, principal: Principal
) -> tuple[list[File], bool]:
    query = _files(principal)
    if purpose:
        query = query.filter(purpose=purpose)
    return _page(query, after=after, limit=limit, newest_first=order == "desc", missing=FileNotFound)


def batches_page(*, after: str | None, limit: int, principal: Principal) -> tuple[list[Batch], bool]:
    return _page(
        _visible(Batch.objects.all(), principal), after=after, limit=limit, newest_first=True, missing=BatchNotFound
    )
