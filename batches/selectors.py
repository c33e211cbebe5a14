"""Reads of the Batch API: files and batches by id, and their pages."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from batches.errors import BatchNotFound, FileNotFound
from batches.models import Batch, File


def file_get(*, file_id: str) -> File:
    file = File.objects.filter(id=file_id).defer("content").first()
    if file is None:
        raise FileNotFound(f"No file with id {file_id!r}", details={"param": "file_id"})
    return file


def file_content(*, file_id: str) -> bytes:
    content = File.objects.filter(id=file_id).values_list("content", flat=True).first()
    if content is None:
        raise FileNotFound(f"No file with id {file_id!r}", details={"param": "file_id"})
    return bytes(content)


def batch_get(*, batch_id: str) -> Batch:
    batch = Batch.objects.filter(id=batch_id).first()
    if batch is None:
        raise BatchNotFound(f"No batch with id {batch_id!r}", details={"param": "batch_id"})
    return batch


def _page(query: QuerySet, *, after: str | None, limit: int, newest_first: bool,
          missing: type[Exception]) -> tuple[list, bool]:
    query = query.order_by(*(("-created_at", "-id") if newest_first else ("created_at", "id")))
    if after:
        cursor = query.model.objects.filter(id=after).values("created_at", "id").first()
        if cursor is None:
            raise missing(f"No object with id {after!r} to list after",
                          details={"param": "after"})
        when, pk = cursor["created_at"], cursor["id"]
        if newest_first:
            query = query.filter(Q(created_at__lt=when) | Q(created_at=when, id__lt=pk))
        else:
            query = query.filter(Q(created_at__gt=when) | Q(created_at=when, id__gt=pk))
    items = list(query[:limit + 1])
    return items[:limit], len(items) > limit


def files_page(*, purpose: str | None, after: str | None, limit: int, order: str
               ) -> tuple[list[File], bool]:
    query = File.objects.defer("content")
    if purpose:
        query = query.filter(purpose=purpose)
    return _page(query, after=after, limit=limit, newest_first=order == "desc",
                 missing=FileNotFound)


def batches_page(*, after: str | None, limit: int) -> tuple[list[Batch], bool]:
    return _page(Batch.objects.all(), after=after, limit=limit, newest_first=True,
                 missing=BatchNotFound)
