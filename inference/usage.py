"""Usage per key and day (docs/api.md, "Usage"): what every /v1 request used, recorded
when it ends, in ``KeyUsage`` (one row per key and UTC day).

``request_ended`` is called once per answered generation from
``inference.shaping.count_usage`` (chat, completions, /v1/responses, Batch API lines: the
one place every answer's usage passes), ``charge_embeddings`` by the embeddings route.
Both hand the counts to one writer thread that folds what arrived meanwhile into one
upsert per key and day (``INSERT … ON CONFLICT DO UPDATE``, PostgreSQL and SQLite alike),
so the request never waits on the database; they also charge the request's quota ticket
(``inference.quotas``) its real tokens.
"""

from __future__ import annotations

import datetime as dt
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

log = structlog.get_logger(__name__)

_LOCK = threading.Lock()
# (owner, day) -> [requests, prompt_tokens, completion_tokens, steered_requests]
_PENDING: dict[tuple[str, dt.date], list[int]] = {}
_SCHEDULED = False
_WRITER = ThreadPoolExecutor(1, thread_name_prefix="millm-usage")


def record(*, owner: str, prompt_tokens: int, completion_tokens: int, steered: bool, requests: int = 1) -> None:
    """Count one request of ``owner`` today (UTC); written by the writer thread."""
    global _SCHEDULED
    day = dt.datetime.now(dt.UTC).date()
    with _LOCK:
        row = _PENDING.setdefault((owner, day), [0, 0, 0, 0])
        row[0] += requests
        row[1] += max(0, int(prompt_tokens))
        row[2] += max(0, int(completion_tokens))
        row[3] += requests if steered else 0
        if _SCHEDULED:
            return
        _SCHEDULED = True
    try:
        _WRITER.submit(_write)
    except RuntimeError:  # the interpreter is shutting down
        pass


def flush(timeout_s: float = 10.0) -> None:
    """Wait until everything recorded so far is written (tests, shutdown)."""
    _WRITER.submit(lambda: None).result(timeout=timeout_s)


def _write() -> None:
    global _SCHEDULED
    from django.db import connection, transaction
    from django.utils import timezone

    from inference.models import KeyUsage

    with _LOCK:
        rows, _SCHEDULED = dict(_PENDING), False
        _PENDING.clear()
    if not rows:
        return
    table = connection.ops.quote_name(KeyUsage._meta.db_table)
    sql = (
        f"INSERT INTO {table} (owner, day, requests, prompt_tokens, completion_tokens, steered_requests, updated_at) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (owner, day) DO UPDATE SET "
        f"requests = {table}.requests + excluded.requests, "
        f"prompt_tokens = {table}.prompt_tokens + excluded.prompt_tokens, "
        f"completion_tokens = {table}.completion_tokens + excluded.completion_tokens, "
        f"steered_requests = {table}.steered_requests + excluded.steered_requests, "
        "updated_at = excluded.updated_at"
    )
    now = timezone.now()
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.executemany(sql, [(owner, day, *counts, now) for (owner, day), counts in sorted(rows.items())])
    except Exception as exc:  # noqa: BLE001 - accounting must never fail a request; say so
        log.error("usage_write_failed", rows=len(rows), error=str(exc))
    finally:
        # the thread keeps no connection between writes (a test database can be dropped,
        # a pooled connection can go stale)
        connection.close()


def request_ended(plan: Any, *, prompt_tokens: int, completion_tokens: int) -> None:
    """A generation request (or Batch API line) ended with this usage: recorded for its
    owner, and charged to its quota ticket (if it was admitted on one)."""
    if plan.quota is not None:
        plan.quota.charge(prompt_tokens + completion_tokens)
    record(
        owner=plan.scope.owner,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        steered=bool(plan.steering.steered),
    )


def charge_embeddings(request: Any, body: dict[str, Any]) -> None:
    """The embeddings route's request: its prompt tokens, for its caller."""
    from core.auth import principal
    from inference.quotas import current_ticket

    tokens = int(((body or {}).get("usage") or {}).get("prompt_tokens") or 0)
    ticket = current_ticket()
    if ticket is not None:
        ticket.charge(tokens)
    record(owner=principal(request).owner, prompt_tokens=tokens, completion_tokens=0, steered=False)


# ------------------------------------------------------------------ reading


def label_of(owner: str) -> str:
    return owner.removeprefix("key:")


def rows(*, owners: list[str] | None, start: dt.date, end: dt.date) -> list[dict[str, Any]]:
    """Usage rows from ``start`` to ``end`` (both included), by day then key; ``owners``
    None: every owner."""
    from inference.models import KeyUsage

    qs = KeyUsage.objects.filter(day__gte=start, day__lte=end)
    if owners is not None:
        qs = qs.filter(owner__in=owners)
    out = []
    for row in qs.order_by("day", "owner"):
        out.append(
            {
                "key": label_of(row.owner),
                "date": row.day.isoformat(),
                "requests": row.requests,
                "prompt_tokens": row.prompt_tokens,
                "completion_tokens": row.completion_tokens,
                "total_tokens": row.prompt_tokens + row.completion_tokens,
                "steered_requests": row.steered_requests,
                "steered_share": round(row.steered_requests / row.requests, 4) if row.requests else 0.0,
            }
        )
    return out


def totals(items: list[dict[str, Any]]) -> dict[str, Any]:
    out = {name: sum(r[name] for r in items) for name in ("requests", "prompt_tokens", "completion_tokens")}
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    out["steered_requests"] = sum(r["steered_requests"] for r in items)
    out["steered_share"] = round(out["steered_requests"] / out["requests"], 4) if out["requests"] else 0.0
    return out


CSV_FIELDS = (
    "key",
    "date",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "steered_requests",
    "steered_share",
)


def as_csv(items: list[dict[str, Any]]) -> str:
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for item in items:
        writer.writerow(item)
    return buffer.getvalue()
