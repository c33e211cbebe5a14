"""Recording the audit log (docs/security.md, "Audit log").

Every service that changes state records one entry: who (``audit.context``), when, the
action, its target, a small JSON of parameters (never a secret) and the result — ``ok``,
the refusal's error code, or ``pending`` for work a job finishes (downloads, loads,
unloads: the entry carries the job's id and ``job_finished`` sets its result). Recording
never breaks nor slows the action: one INSERT (in a savepoint inside a transaction, so a
failure cannot poison it), and a failure is logged, never raised.

``audited`` wraps a service function: only the outermost audited call records (a profile
activation that sets live steering is one entry, ``profile.activate``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import Any

import structlog
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from audit.context import current_actor
from audit.models import AuditEntry

log = structlog.get_logger(__name__)

Target = tuple[str, Any, str]  # (kind, id, name)

# names of parameters that are never recorded, whatever a caller passes
SECRET_WORDS = ("token", "secret", "password", "api_key", "apikey", "authorization", "credential")
MAX_STRING = 200
MAX_ITEMS = 50
MAX_DEPTH = 4

_INSIDE: ContextVar[bool] = ContextVar("millm_audit_inside", default=False)


def _small(value: Any, depth: int = 0) -> Any:
    """A JSON-able, bounded copy: strings cut, lists and dicts at most MAX_ITEMS, secrets
    (by key name) dropped."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value if len(value) <= MAX_STRING else value[:MAX_STRING] + "…"
    if depth >= MAX_DEPTH:
        return "…"
    if isinstance(value, dict):
        out = {}
        for key, item in list(value.items())[:MAX_ITEMS]:
            name = str(key)
            if any(word in name.lower() for word in SECRET_WORDS):
                continue
            out[name[:MAX_STRING]] = _small(item, depth + 1)
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_small(item, depth + 1) for item in list(value)[:MAX_ITEMS]]
    return _small(str(value), depth)


def error_code(exc: BaseException) -> str:
    """The code a refusal answers with (the /api envelope's, or /v1's)."""
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        return code[:64]
    # a DRF refusal (the envelope names it by its status, core.api)
    status = getattr(exc, "status_code", None)
    by_status = {
        400: "VALIDATION_ERROR",
        401: "UNAUTHORIZED",
        403: "FORBIDDEN",
        404: "NOT_FOUND",
        422: "VALIDATION_ERROR",
    }
    if type(exc).__name__ == "ValidationError":
        return "VALIDATION_ERROR"
    return by_status.get(status, "INTERNAL_ERROR") if isinstance(status, int) else "INTERNAL_ERROR"


def record(
    action: str,
    *,
    target: Target = ("", "", ""),
    params: dict[str, Any] | None = None,
    result: str = AuditEntry.OK,
    message: str = "",
    job_id: int | None = None,
) -> int | None:
    """Write one entry; its id, or None when it could not be written (logged)."""
    try:
        actor, kind = current_actor()
        kind_, target_id, name = target
        entry = AuditEntry(
            actor=str(actor)[:150],
            actor_kind=kind,
            action=action[:64],
            target_kind=str(kind_ or "")[:32],
            target_id="" if target_id is None else str(target_id)[:200],
            target_name=str(name or "")[:300],
            params=_small(params or {}),
            result=result[:64],
            message=str(message or "")[:500],
            job_id=job_id,
        )
        if connection.in_atomic_block:
            with transaction.atomic():
                entry.save(force_insert=True)
        else:
            entry.save(force_insert=True)
        return entry.id
    except Exception as exc:  # noqa: BLE001 - the audit never breaks the action it records
        # one line, no traceback: a refused command (an unmigrated database in a fresh
        # process) must still end on its own one-line refusal
        log.error("audit_record_failed", action=action, error=f"{type(exc).__name__}: {exc}"[:500])
        return None


def job_finished(*, job_id: int, status: str, error: str = "", code: str = "") -> None:
    """The result of the entries a job finishes: ``ok`` when it succeeded, else the
    error's code (``code``; ``CANCELLED``, or ``JOB_FAILED`` when none is known)."""
    if status == "succeeded":
        result = AuditEntry.OK
    elif status == "cancelled":
        result = code or "CANCELLED"
    else:
        result = code or "JOB_FAILED"
    try:
        AuditEntry.objects.filter(job_id=job_id, result=AuditEntry.PENDING).update(
            result=result[:64], message=str(error or "")[:500], finished_at=timezone.now()
        )
    except Exception:  # noqa: BLE001
        log.exception("audit_finish_failed", job_id=job_id)


def audited(
    action: str,
    target: Callable[[dict[str, Any], Any], Target],
    *,
    params: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    job: Callable[[Any], Any] | None = None,
    skip: Callable[[dict[str, Any]], bool] | None = None,
) -> Callable:
    """Record each call of a keyword-argument service function as ``action``.

    ``target(kwargs, result)`` names what it acts on (``result`` is None when it raised);
    ``params(kwargs)`` the parameters worth keeping; ``job(result)`` the job that finishes
    it (the entry is then ``pending`` until that job ends); ``skip(kwargs)`` true for a
    call that is not recorded (a job's own run of what its request already recorded).
    """

    def wrap(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def inner(*args: Any, **given: Any) -> Any:
            kwargs = given
            if args:  # positional arguments by their names, for the describers
                try:
                    kwargs = dict(signature.bind_partial(*args, **given).arguments)
                except TypeError:
                    kwargs = given
            if _INSIDE.get() or (skip is not None and skip(kwargs)):
                return fn(*args, **given)
            before = _describe(target, kwargs, None)  # a deleted row's id is gone afterwards
            token = _INSIDE.set(True)
            try:
                result = fn(*args, **given)
            except BaseException as exc:
                _INSIDE.reset(token)
                _record_call(action, before, target, params, kwargs, None, error_code(exc), str(exc), None)
                raise
            _INSIDE.reset(token)
            job_row = job(result) if job is not None else None
            outcome, job_id = AuditEntry.OK, None
            if job_row is not None:
                job_id = getattr(job_row, "id", None)
                status = getattr(job_row, "status", "")
                outcome = AuditEntry.PENDING if status in ("queued", "running") else _job_result(job_row)
            _record_call(action, before, target, params, kwargs, result, outcome, "", job_id)
            return result

        return inner

    return wrap


def _job_result(job_row: Any) -> str:
    status = getattr(job_row, "status", "")
    if status == "succeeded":
        return AuditEntry.OK
    return "CANCELLED" if status == "cancelled" else "JOB_FAILED"


def _describe(target, kwargs, result) -> Target:  # noqa: ANN001
    try:
        return target(kwargs, result)
    except Exception:  # noqa: BLE001
        log.exception("audit_describe_failed")
        return ("", "", "")


def _record_call(action, before, target, params, kwargs, result, outcome, message, job_id) -> None:  # noqa: ANN001
    after = _describe(target, kwargs, result)
    named = tuple(a if a not in (None, "") else b for a, b in zip(after, before))
    try:
        kept = params(kwargs) if params is not None else {}
    except Exception:  # noqa: BLE001
        log.exception("audit_describe_failed", action=action)
        kept = {}
    record(action, target=named, params=kept, result=outcome, message=message, job_id=job_id)


def row_target(kind: str, name_field: str = "name") -> Callable[[Any], Target]:
    """A target from a model row (its id and name)."""

    def of(row: Any) -> Target:
        if row is None:
            return (kind, "", "")
        return (kind, getattr(row, "pk", ""), getattr(row, name_field, "") or "")

    return of


def of_kwarg(kind: str, key: str, name_field: str = "name") -> Callable[[dict[str, Any], Any], Target]:
    """A target from the row passed as keyword ``key`` (its pk and name)."""

    def target(kwargs: dict[str, Any], _result: Any) -> Target:
        row = kwargs.get(key)
        return (kind, getattr(row, "pk", ""), getattr(row, name_field, "") or "")

    return target


def kwargs_of(*names: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The parameters ``names`` as given (those given)."""
    return lambda kwargs: {n: kwargs[n] for n in names if n in kwargs}


# --- reading -------------------------------------------------------------------------


def audit_query(
    *,
    action: str | None = None,
    actor: str | None = None,
    target: str | None = None,
    result: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
):
    """Entries matching the filters, newest first. ``action`` matches a whole action or
    a prefix ending in a dot (``model.``); ``target`` a target id, name or ``kind:id``."""
    rows = AuditEntry.objects.all()
    if action:
        rows = rows.filter(action__startswith=action) if action.endswith(".") else rows.filter(action=action)
    if actor:
        rows = rows.filter(actor=actor)
    if target:
        kind, sep, ident = target.partition(":")
        if sep and kind and ident:
            rows = rows.filter(target_kind=kind, target_id=ident)
        else:
            from django.db.models import Q

            rows = rows.filter(Q(target_id=target) | Q(target_name=target))
    if result:
        rows = rows.filter(result=result)
    if since is not None:
        rows = rows.filter(created_at__gte=since)
    if until is not None:
        rows = rows.filter(created_at__lt=until)
    return rows.order_by("-created_at", "-id")


def entry_out(row: AuditEntry) -> dict[str, Any]:
    return {
        "id": row.id,
        "created_at": row.created_at.isoformat().replace("+00:00", "Z"),
        "actor": row.actor,
        "actor_kind": row.actor_kind,
        "action": row.action,
        "target": {"kind": row.target_kind, "id": row.target_id, "name": row.target_name},
        "params": row.params,
        "result": row.result,
        "message": row.message,
        "job_id": row.job_id,
        "finished_at": row.finished_at.isoformat().replace("+00:00", "Z") if row.finished_at else None,
    }


# --- retention -----------------------------------------------------------------------


def audit_prune(*, now: datetime | None = None) -> dict[str, int]:
    """Delete the entries older than AUDIT_RETENTION_DAYS (0 keeps them forever); run
    by the batch sweeper beside the stored responses' retention."""
    days = int(getattr(settings, "AUDIT_RETENTION_DAYS", 90))
    if days <= 0:
        return {"pruned": 0}
    cutoff = (now or timezone.now()) - timedelta(days=days)
    deleted, _ = AuditEntry.objects.filter(created_at__lt=cutoff).delete()
    return {"pruned": deleted}
