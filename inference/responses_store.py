"""Stored responses of the Responses API: what ``POST /v1/responses`` keeps (``store``,
OpenAI's default), owned by the caller's key, and what GET, DELETE, cancel and input_items
read and change (docs/api-v1.md, "Responses API: stored responses").

- ``save_response``: the Response object as answered and the request's own input items,
  owned by ``scope.owner``; ``store=false`` keeps nothing. At most
  RESPONSES_MAX_STORED_BYTES a response (400 ``response_too_large``).
- ``load_chain``: the conversation a ``previous_response_id`` continues, oldest first;
  another key's response is a 404 exactly as an unknown one (never reveal existence).
- ``start_background``: a ``background: true`` request, stored ``queued`` and handed to a
  runner (``inference.responses_runner``) on the job machinery the batches use.
- ``responses_sweep``: the retention (RESPONSES_RETENTION_DAYS) and the background
  responses whose runner died (resumed as batches are, or failed).

An inference key sees only its own responses; an admin key, and everyone when keys are
off, sees all (``monitoring.ownership.Scope``).
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import structlog
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from audit.services import audited
from core.jobs import enqueue
from inference.errors import OpenAIError
from inference.models import StoredResponse
from monitoring.ownership import Scope

log = structlog.get_logger(__name__)

CHAIN_MAX_DEPTH = 100  # previous_response_id links one request may follow
LIST_LIMIT_MAX = 100  # input_items' limit, as OpenAI (1-100, default 20)
LIST_LIMIT_DEFAULT = 20
RUN_TASK = "inference.tasks.response_run_task"
QUEUE = "responses"

# the id prefix of a stored item, by its type (OpenAI's: msg_, fc_, ...)
_ITEM_PREFIX = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "reasoning": "rs_",
}


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _item_id(item: dict[str, Any]) -> str:
    return f"{_ITEM_PREFIX.get(str(item.get('type') or 'message'), 'item_')}{uuid.uuid4().hex}"


def _not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(f"No response with id {response_id!r} found", status=404, code="response_not_found", param=param)


def input_items_of(value: Any) -> list[dict[str, Any]]:
    """A request's ``input`` (a string, or a list of items as the client sent them) as the
    input items stored for it: a string is one user ``message`` with ``input_text``
    content, an item without ``type`` a ``message``; every item gets an ``id`` if it has
    none (what ``input_items`` lists and pages by)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    items = []
    for raw in value:
        item = dict(raw.model_dump(exclude_none=True) if hasattr(raw, "model_dump") else raw)
        item.setdefault("type", "message")
        if not item.get("id"):
            item["id"] = _item_id(item)
        items.append(item)
    return items


def _size(body: dict[str, Any], items: list[dict[str, Any]]) -> int:
    return len(json.dumps(body, separators=(",", ":"))) + len(json.dumps(items, separators=(",", ":")))


def _check_size(size: int) -> None:
    cap = int(settings.RESPONSES_MAX_STORED_BYTES)
    if cap and size > cap:
        raise OpenAIError(
            f"The response and its input are {size} bytes, more than a stored response may hold "
            f"(RESPONSES_MAX_STORED_BYTES={cap}); send it with store=false, or a shorter input",
            status=400,
            code="response_too_large",
            param="input",
        )


# --------------------------------------------------------------------------- saving


def save_response_sync(
    response: dict[str, Any], input_items: list[dict[str, Any]], scope: Scope, *, store: bool
) -> StoredResponse | None:
    """``save_response`` for sync callers; the row (None when ``store`` is false)."""
    if not store:
        return None
    items = input_items_of(input_items)
    body = {**response, "store": True}
    size = _size(body, items)
    _check_size(size)
    row = StoredResponse.objects.create(
        id=str(body["id"]),
        owner=scope.owner,
        status=str(body.get("status") or StoredResponse.Status.COMPLETED),
        model=str(body.get("model") or "")[:255],
        body=body,
        input_items=items,
        previous_response_id=body.get("previous_response_id") or None,
        bytes=size,
    )
    log.info("response_stored", response_id=row.id, owner=row.owner, status=row.status, bytes=size)
    return row


async def save_response(
    response: dict[str, Any], input_items: list[dict[str, Any]], scope: Scope, *, store: bool
) -> None:
    """Keep the Response object and this request's own input items (not the chain's),
    owned by ``scope.owner``; ``store=False`` keeps nothing (OpenAI's ``store: false``).
    Raises 400 ``response_too_large`` past RESPONSES_MAX_STORED_BYTES."""
    if store:
        await sync_to_async(save_response_sync)(response, input_items, scope, store=store)


# --------------------------------------------------------------------------- chaining


def load_chain_sync(previous_response_id: str, scope: Scope) -> list[dict[str, Any]]:
    """``load_chain`` for sync callers."""
    param = "previous_response_id"
    rows: list[StoredResponse] = []
    next_id: str | None = previous_response_id
    while next_id:
        if len(rows) >= CHAIN_MAX_DEPTH:
            raise OpenAIError(
                f"previous_response_id {previous_response_id!r} continues a conversation of more than "
                f"{CHAIN_MAX_DEPTH} responses; start a new one with the whole input",
                status=400,
                code="invalid_parameter",
                param=param,
            )
        row = scope.filter(StoredResponse.objects.filter(id=str(next_id))).first()
        if row is None:
            raise _not_found(str(next_id), param)
        if not row.terminal:
            raise OpenAIError(
                f"Response {row.id} is still {row.status}; continue it once it has ended",
                status=400,
                code="invalid_parameter",
                param=param,
            )
        rows.append(row)
        next_id = row.previous_response_id
    items: list[dict[str, Any]] = []
    for row in reversed(rows):
        items.extend(row.input_items or [])
        items.extend((row.body or {}).get("output") or [])
    return items


async def load_chain(previous_response_id: str, scope: Scope) -> list[dict[str, Any]]:
    """The stored conversation ``previous_response_id`` continues, oldest first: each
    response's input items, then its output items. An unknown, deleted or expired id, and
    another key's, are one 404 ``response_not_found`` (param ``previous_response_id``);
    past CHAIN_MAX_DEPTH links, or a response still running, a 400."""
    return await sync_to_async(load_chain_sync)(previous_response_id, scope)


# --------------------------------------------------------------------------- reading


def response_get(response_id: str, scope: Scope) -> dict[str, Any]:
    row = scope.filter(StoredResponse.objects.filter(id=response_id)).first()
    if row is None:
        raise _not_found(response_id)
    return row.body


@audited("response.delete", lambda kw, r: ("response", kw.get("response_id", ""), ""))
def response_delete(response_id: str, scope: Scope) -> dict[str, Any]:
    """Delete a stored response (a background one still running is cancelled first: its
    runner sees the row gone and stops)."""
    deleted, _ = scope.filter(StoredResponse.objects.filter(id=response_id)).delete()
    if not deleted:
        raise _not_found(response_id)
    log.info("response_deleted", response_id=response_id, owner=scope.owner)
    return {"id": response_id, "object": "response", "deleted": True}


def response_input_items(
    response_id: str, scope: Scope, *, limit: Any = None, order: Any = None, after: Any = None
) -> dict[str, Any]:
    """The stored input items of a response, in OpenAI's list shape: ``order`` ``desc``
    (the default) or ``asc``, ``limit`` 1-100 (20), ``after`` an item id of the list."""
    row = scope.filter(StoredResponse.objects.filter(id=response_id)).only("input_items").first()
    if row is None:
        raise _not_found(response_id)
    n = _limit(limit)
    order = "desc" if order in (None, "") else order
    if order not in ("asc", "desc"):
        raise OpenAIError("order must be 'asc' or 'desc'", status=400, code="invalid_parameter", param="order")
    items = list(row.input_items or [])
    if order == "desc":
        items.reverse()
    if after not in (None, ""):
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise OpenAIError(
                f"No input item with id {after!r} in response {response_id}",
                status=400,
                code="invalid_parameter",
                param="after",
            )
        items = items[ids.index(after) + 1 :]
    page = items[:n]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > n,
    }


def _limit(value: Any) -> int:
    if value in (None, ""):
        return LIST_LIMIT_DEFAULT
    text = str(value)
    if not (text.isascii() and text.isdecimal()) or not 1 <= int(text) <= LIST_LIMIT_MAX:
        raise OpenAIError(
            f"limit must be a whole number from 1 to {LIST_LIMIT_MAX}",
            status=400,
            code="invalid_parameter",
            param="limit",
        )
    return int(text)


# --------------------------------------------------------------------------- background


def _set_status(row: StoredResponse, status: str, **fields: Any) -> None:
    """``status`` on the row and in its body, with the body's extra ``fields``."""
    row.status = status
    row.body = {**row.body, **fields, "status": status}


def start_background_sync(
    data: dict[str, Any],
    response: dict[str, Any],
    input_items: list[dict[str, Any]],
    scope: Scope,
    *,
    policy: str = "",
    lease: str | None = None,
) -> dict[str, Any]:
    """``start_background`` for sync callers."""
    if data.get("store") is False:
        raise OpenAIError(
            "background responses must be stored: send store=true (the default) with background=true",
            status=400,
            code="invalid_parameter",
            param="background",
        )
    if data.get("stream"):
        raise OpenAIError(
            "stream=true with background=true is not available: poll GET /v1/responses/{id}",
            status=400,
            code="invalid_parameter",
            param="stream",
        )
    # no usage until the run ends: OpenAI's Response has it as an object or absent, never null
    body = {**response, "status": StoredResponse.Status.QUEUED, "background": True, "output": []}
    body.pop("usage", None)
    with transaction.atomic():
        row = save_response_sync(body, input_items, scope, store=True)
        assert row is not None
        row.background, row.request = True, data
        row.policy, row.lease = policy or "", lease or ""
        row.save(update_fields=["background", "request", "policy", "lease"])
        enqueue(RUN_TASK, row.id, queue=QUEUE)
    log.info("response_queued", response_id=row.id, owner=row.owner)
    return row.body


async def start_background(
    data: dict[str, Any],
    response: dict[str, Any],
    input_items: list[dict[str, Any]],
    scope: Scope,
    *,
    policy: str = "",
    lease: str | None = None,
) -> dict[str, Any]:
    """Store a ``background: true`` request's response ``queued`` and queue its run; the
    Response object to answer at once. ``data``: the request as the client sent it (the
    runner validates it again); ``response``: the Response object's skeleton. 400 (param
    ``background``) with ``store: false``, as OpenAI; 400 with ``stream: true``."""
    return await sync_to_async(start_background_sync)(data, response, input_items, scope, policy=policy, lease=lease)


def response_cancel(response_id: str, scope: Scope) -> dict[str, Any]:
    """Cancel a background response: ``queued`` or ``in_progress`` ends ``cancelled`` now
    (its runner sees it at its next heartbeat and cancels the engine job; nothing it
    answers afterwards is kept); a cancelled one is answered as it is. A response that was
    not created with ``background`` (OpenAI: only those can be cancelled), or that ended
    otherwise, is a 400."""
    with transaction.atomic():
        row = scope.filter(StoredResponse.objects.select_for_update().filter(id=response_id)).first()
        if row is None:
            raise _not_found(response_id)
        if not row.background:
            raise OpenAIError(
                "Only responses created with background=true can be cancelled",
                status=400,
                code="invalid_parameter",
                param="response_id",
            )
        if row.status == StoredResponse.Status.CANCELLED:
            return row.body
        if row.terminal:
            raise OpenAIError(
                f"Response {row.id} is already {row.status} and cannot be cancelled",
                status=400,
                code="invalid_parameter",
                param="response_id",
            )
        _set_status(row, StoredResponse.Status.CANCELLED)
        row.save(update_fields=["status", "body", "updated_at"])
    log.info("response_cancelled", response_id=row.id, owner=row.owner)
    return row.body


def responses_resume(*, force: bool) -> int:
    """Queue a runner for every background response not finished (start-up: embedded,
    this process was the only runner, ``force``; a worker of the responses queue, the
    runner of one whose heartbeat stopped is presumed dead once it is stale)."""
    ids = list(
        StoredResponse.objects.filter(
            background=True, status__in=(StoredResponse.Status.QUEUED, StoredResponse.Status.IN_PROGRESS)
        ).values_list("id", flat=True)
    )
    for response_id in ids:
        enqueue(RUN_TASK, response_id, force=force, queue=QUEUE)
    if ids:
        log.info("responses_resumed", responses=len(ids))
    return len(ids)


def _stale_before() -> Any:
    return timezone.now() - timedelta(seconds=float(settings.BATCH_RUNNER_STALE_S))


def responses_sweep() -> dict[str, int]:
    """Delete the stored responses older than RESPONSES_RETENTION_DAYS (0 keeps them),
    and end or resume the background responses nobody runs: one whose runner's heartbeat
    is older than BATCH_RUNNER_STALE_S (its worker or the server died) is queued again
    from the start (nothing of it was kept), after BATCH_MAX_RESUMES such resumes it ends
    ``failed`` (``response_runner_failed``). A queued response no runner has taken is
    waiting in the queue. Safe to run anywhere at once (row locks)."""
    done = {"expired": 0, "resumed": 0, "failed": 0}
    days = int(settings.RESPONSES_RETENTION_DAYS)
    if days > 0:
        cutoff = timezone.now() - timedelta(days=days)
        old = StoredResponse.objects.filter(created_at__lt=cutoff, status__in=StoredResponse.TERMINAL)
        done["expired"], _ = old.delete()
    dead = Q(runner_seen_at__isnull=True) | Q(runner_seen_at__lt=_stale_before())
    candidates = (
        StoredResponse.objects.filter(
            background=True, status__in=(StoredResponse.Status.QUEUED, StoredResponse.Status.IN_PROGRESS)
        )
        .filter(runner__isnull=False)
        .filter(dead)
        .values_list("id", flat=True)
    )
    for response_id in list(candidates):
        with transaction.atomic():
            row = StoredResponse.objects.select_for_update(skip_locked=True).filter(id=response_id).first()
            if row is None or row.terminal or row.runner is None:
                continue
            if row.runner_seen_at is not None and row.runner_seen_at >= _stale_before():
                continue
            if row.resumes >= int(settings.BATCH_MAX_RESUMES):
                _set_status(
                    row,
                    StoredResponse.Status.FAILED,
                    error={
                        "code": "response_runner_failed",
                        "message": f"The response's runner stopped {row.resumes + 1} times without finishing it "
                        f"(BATCH_MAX_RESUMES={settings.BATCH_MAX_RESUMES})",
                    },
                )
                row.runner, row.runner_seen_at = None, None
                row.save(update_fields=["status", "body", "runner", "runner_seen_at", "updated_at"])
                done["failed"] += 1
                action = "failed"
            else:
                _set_status(row, StoredResponse.Status.QUEUED)
                row.runner, row.runner_seen_at = None, None
                row.resumes += 1
                row.save(update_fields=["status", "body", "runner", "runner_seen_at", "resumes", "updated_at"])
                enqueue(RUN_TASK, row.id, queue=QUEUE)
                done["resumed"] += 1
                action = "resumed"
        log.warning("response_swept", response_id=response_id, action=action)
    return done
