"""/v1/files and /v1/batches: OpenAI's Files and Batch API (the parts a batch needs).

Thin async views: each reads its input, calls a service or selector on a pool thread
(``off_view_thread``: a 200 MiB upload must not hold the one thread of sync views) and
answers OpenAI's object shapes; every failure leaves in OpenAI's error shape.

Every object is its caller's (``core.auth.principal``): another owner's file or batch is
a 404 and is never listed; an admin key (or keys off) sees all. A file's content is
streamed a chunk at a time.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse

from batches import selectors, services
from batches.errors import FileTooLarge
from batches.models import Batch, File
from core.auth import principal
from inference.errors import OpenAIError, openai_view
from inference.planning import off_view_thread

MULTIPART_SLACK_BYTES = 64 * 1024  # the form's own bytes around the file


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_object(file: File) -> dict[str, Any]:
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": _ts(file.created_at),
        "expires_at": None,
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(batch: Batch) -> dict[str, Any]:
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model or None,
        "errors": ({"object": "list", "data": batch.errors} if batch.errors else None),
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": _ts(batch.created_at),
        "in_progress_at": _ts(batch.in_progress_at),
        "expires_at": _ts(batch.expires_at),
        "finalizing_at": _ts(batch.finalizing_at),
        "completed_at": _ts(batch.completed_at),
        "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at),
        "cancelling_at": _ts(batch.cancelling_at),
        "cancelled_at": _ts(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "usage": {
            "input_tokens": batch.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": batch.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": batch.input_tokens + batch.output_tokens,
        },
        "metadata": batch.metadata,
    }


def _list(items: list[dict[str, Any]], has_more: bool) -> JsonResponse:
    return JsonResponse(
        {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
            "has_more": has_more,
        }
    )


def _limit(request: HttpRequest, default: int, most: int) -> int:
    raw = request.GET.get("limit")
    try:
        value = default if raw is None else int(raw)
    except ValueError:
        value = -1
    if not 1 <= value <= most:
        raise OpenAIError(
            f"limit must be an integer from 1 to {most}", status=400, code="invalid_parameter", param="limit"
        )
    return value


def _json(request: HttpRequest) -> dict[str, Any]:
    try:
        data = json.loads(request.body.decode("utf-8") or "{}")
    except (UnicodeDecodeError, ValueError, RequestDataTooBig):
        raise OpenAIError("The body is not valid JSON", status=400, code="invalid_json") from None
    if not isinstance(data, dict):
        raise OpenAIError("The body must be a JSON object", status=400, code="invalid_json")
    return data


def _upload(request: HttpRequest) -> File:
    """Store the multipart form's file for the caller (on a pool thread). The declared
    size is checked against the limits and quotas before the body is read."""
    owner = principal(request).owner
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > settings.BATCH_MAX_FILE_BYTES + MULTIPART_SLACK_BYTES:
        raise FileTooLarge(
            f"The upload is {declared} bytes; a batch input file may have "
            f"at most {settings.BATCH_MAX_FILE_BYTES} bytes",
            details={"param": "file"},
        )
    services.file_check_quota(owner=owner, size=max(declared - MULTIPART_SLACK_BYTES, 0))
    if not (request.content_type or "").startswith("multipart/form-data"):
        raise OpenAIError(
            "Upload a file as multipart/form-data with the fields file and purpose",
            status=415,
            code="unsupported_media_type",
        )
    upload = request.FILES.get("file")
    if upload is None:
        raise OpenAIError("The form has no file field", status=400, code="missing_required_parameter", param="file")
    purpose = request.POST.get("purpose")
    if not purpose:
        raise OpenAIError(
            "The form has no purpose field", status=400, code="missing_required_parameter", param="purpose"
        )
    if upload.size > settings.BATCH_MAX_FILE_BYTES:
        raise FileTooLarge(
            f"The file is {upload.size} bytes; a batch input file may have "
            f"at most {settings.BATCH_MAX_FILE_BYTES} bytes",
            details={"param": "file"},
        )
    upload.seek(0)
    return services.file_create(
        filename=upload.name or "upload.jsonl", purpose=purpose, content=upload, size=upload.size, owner=owner
    )


@openai_view("GET", "POST")
async def files(request: HttpRequest):
    if request.method == "POST":
        return JsonResponse(file_object(await off_view_thread(_upload)(request)))
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError("order must be asc or desc", status=400, code="invalid_parameter", param="order")
    rows, more = await off_view_thread(selectors.files_page)(
        purpose=request.GET.get("purpose"),
        after=request.GET.get("after"),
        limit=_limit(request, 10000, 10000),
        order=order,
        principal=principal(request),
    )
    return _list([file_object(f) for f in rows], more)


@openai_view("GET", "DELETE")
async def file_detail(request: HttpRequest, file_id: str):
    file = await off_view_thread(selectors.file_get)(file_id=file_id, principal=principal(request))
    if request.method == "DELETE":
        await off_view_thread(services.file_delete)(file=file)
        return JsonResponse({"id": file_id, "object": "file", "deleted": True})
    return JsonResponse(file_object(file))


@openai_view("GET")
async def file_content(request: HttpRequest, file_id: str):
    chunks = await off_view_thread(selectors.file_chunk_ids)(file_id=file_id, principal=principal(request))

    async def content():
        for chunk_id in chunks:
            yield await off_view_thread(selectors.file_chunk)(chunk_id=chunk_id)

    return StreamingHttpResponse(content(), content_type="application/octet-stream")


@openai_view("GET", "POST")
async def batches(request: HttpRequest):
    if request.method == "POST":
        data = _json(request)
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(data.get(name), str):
                raise OpenAIError(
                    f"{name} is required (a string)", status=400, code="missing_required_parameter", param=name
                )
        batch = await off_view_thread(services.batch_create)(
            input_file_id=data["input_file_id"],
            endpoint=data["endpoint"],
            completion_window=data["completion_window"],
            metadata=data.get("metadata"),
            principal=principal(request),
        )
        return JsonResponse(batch_object(batch))
    rows, more = await off_view_thread(selectors.batches_page)(
        after=request.GET.get("after"), limit=_limit(request, 20, 100), principal=principal(request)
    )
    return _list([batch_object(b) for b in rows], more)


@openai_view("GET")
async def batch_detail(request: HttpRequest, batch_id: str):
    return JsonResponse(
        batch_object(await off_view_thread(selectors.batch_get)(batch_id=batch_id, principal=principal(request)))
    )


@openai_view("POST")
async def batch_cancel(request: HttpRequest, batch_id: str):
    await off_view_thread(selectors.batch_get)(batch_id=batch_id, principal=principal(request))
    return JsonResponse(batch_object(await off_view_thread(services.batch_cancel)(batch_id=batch_id)))
