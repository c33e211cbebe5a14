"""Lease mutations: grant, renew, release, end, and the check every model change makes.

Rules (the original's, kept): only the resident (``loaded``) model can be leased, one live
lease at a time; ``ttl_seconds`` is 1..LEASE_MAX_TTL_SECONDS (refused outside, never
clamped); renew sets ``expires_at = now + ttl``; a lease ends on expiry, release, or the
model leaving memory (``model_unloaded``). A lease blocks loading another model, unloading
and swapping for anyone without its id; it never blocks using the model.

Beyond the original (which kept leases in one process's memory): rows in the database, so a
lease survives a web restart and holds across several web workers. Expiry is applied when a
lease is read or checked, so no background sweeper is needed.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import Any

import structlog
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.services import audited, kwargs_of, of_kwarg
from core.engines import current_engine, several_engines
from core.errors import ModelBusy
from leases.errors import (
    LEASE_HEADER,
    InvalidLeaseRequest,
    LeaseExpired,
    LeaseNotFound,
    ModelLeased,
    ModelNotResident,
)
from leases.models import Lease
from registry.models import Job, Model

log = structlog.get_logger(__name__)

# States in which a model still counts as resident for its lease: an unload in progress
# (the holder's own) ends the lease when it completes, not when it starts.
_RESIDENT_STATES = (Model.Status.LOADED, Model.Status.UNLOADING)


def lease_hash(lease_id: str) -> str:
    return hashlib.sha256(lease_id.encode()).hexdigest()


def _text(value: Any, *, param: str, limit: int) -> str:
    text = value.strip() if isinstance(value, str) else ""
    if not text or len(text) > limit:
        raise InvalidLeaseRequest(
            f"{param} must be 1-{limit} characters after stripping", details={"param": param, "max_chars": limit}
        )
    return text


def _ttl(value: Any) -> int:
    limit = int(settings.LEASE_MAX_TTL_SECONDS)
    if value is None:
        return int(settings.LEASE_DEFAULT_TTL_SECONDS)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise InvalidLeaseRequest(
            f"ttl_seconds must be an integer from 1 to {limit} (got {value!r}); it is refused, never clamped",
            details={"param": "ttl_seconds", "min": 1, "max": limit},
        )
    return value


def _need_id(lease_id: str | None) -> str:
    if not lease_id or not lease_id.strip():
        raise InvalidLeaseRequest(f"Present the lease id in the {LEASE_HEADER} header", details={"param": LEASE_HEADER})
    return lease_id.strip()


def _end(qs, reason: str) -> int:
    return qs.filter(ended_at__isnull=True).update(ended_at=timezone.now(), end_reason=reason)


def _prune_ended() -> None:
    """Keep the newest LEASE_ENDED_MEMORY ended leases; older ones are forgotten (a renew
    of their id then answers 404 LEASE_NOT_FOUND)."""
    keep = int(settings.LEASE_ENDED_MEMORY)
    ended = Lease.objects.filter(ended_at__isnull=False)
    stale = list(ended.order_by("-ended_at", "-id").values_list("id", flat=True)[keep:])
    if stale:
        Lease.objects.filter(id__in=stale).delete()


def lease_expire_due() -> int:
    """End live leases past their expiry (``expired``) and those whose model is no longer
    resident (``model_unloaded``: an engine restart that dropped it, a row changed
    elsewhere). Called by every read and check, so expiry needs no sweeper."""
    live = Lease.objects.filter(ended_at__isnull=True)
    ended = _end(live.filter(expires_at__lte=timezone.now()), Lease.EndReason.EXPIRED)
    ended += _end(live.exclude(model__status__in=_RESIDENT_STATES), Lease.EndReason.MODEL_UNLOADED)
    if ended:
        _prune_ended()
    return ended


def lease_end_for_model(*, model_id: int, reason: str = Lease.EndReason.MODEL_UNLOADED) -> int:
    """End the model's live lease (the model left memory). Called by the registry when it
    records an unload or a replacement, and by whoever notices an engine restart dropped
    the model."""
    ended = _end(Lease.objects.filter(model_id=model_id), reason)
    if ended:
        _prune_ended()
        log.info("lease_ended", model_id=model_id, end_reason=reason)
    return ended


def _busy(model: Model) -> bool:
    if Model.objects.filter(status__in=(Model.Status.LOADING, Model.Status.UNLOADING)).exists():
        return True
    return Job.objects.filter(
        kind__in=(Job.Kind.MODEL_LOAD, Job.Kind.MODEL_UNLOAD), status__in=(Job.Status.QUEUED, Job.Status.RUNNING)
    ).exists()


def leased_details(lease: Lease) -> dict[str, Any]:
    return {
        "holder": lease.holder,
        "reason": lease.reason,
        "expires_at": lease.expires_at.isoformat().replace("+00:00", "Z"),
        "leased_model_id": lease.model_id,
        "leased_model_name": lease.model.name,
    }


@audited(
    "lease.grant",
    of_kwarg("model", "model"),
    params=lambda kw: {"holder": kw.get("holder"), "reason": kw.get("reason"), "ttl_seconds": kw.get("ttl_seconds")},
)
def lease_grant(*, model: Model, holder: Any, reason: Any, ttl_seconds: Any = None) -> tuple[Lease, str]:
    """Lease the resident model. Returns the row and the lease id — the only time the id
    exists outside the caller; the row keeps its sha256."""
    holder = _text(holder, param="holder", limit=int(settings.LEASE_HOLDER_MAX_CHARS))
    reason = _text(reason, param="reason", limit=int(settings.LEASE_REASON_MAX_CHARS))
    ttl = _ttl(ttl_seconds)
    lease_expire_due()
    model.refresh_from_db()
    if model.status != Model.Status.LOADED:
        raise ModelNotResident(
            f"Model {model.name!r} is not resident (status {model.status}); only the loaded model can be leased",
            details={"model_id": model.id, "status": model.status},
        )
    if _busy(model):
        raise ModelBusy(
            f"A model load or unload is in progress; lease {model.name!r} once it ends",
            details={"model_id": model.id},
            retry_after=settings.RETRY_AFTER_LOAD_S,
        )
    lease_id = f"lease_{secrets.token_urlsafe(32)}"
    now = timezone.now()
    try:
        # The partial unique index decides races: on PostgreSQL a second insert waits for
        # the first transaction and then fails, so exactly one grant wins.
        with transaction.atomic():
            lease = Lease.objects.create(
                model=model,
                id_hash=lease_hash(lease_id),
                holder=holder,
                reason=reason,
                ttl_seconds=ttl,
                acquired_at=now,
                renewed_at=now,
                expires_at=now + timedelta(seconds=ttl),
            )
    except IntegrityError:
        live = Lease.objects.select_related("model").filter(model=model, ended_at__isnull=True).first()
        details = leased_details(live) if live else {"leased_model_id": model.id}
        raise ModelLeased(
            f"Model {model.name!r} is already leased" + (f" by {live.holder!r}" if live else ""),
            details={**details, "operation": "lease", "target_model_id": model.id},
        ) from None
    log.info("lease_granted", model_id=model.id, holder=holder, ttl_seconds=ttl)
    return lease, lease_id


def _find(*, model: Model, lease_id: str | None) -> Lease:
    """The row ``lease_id`` names on this model: live, or refused with why not."""
    lease_id = _need_id(lease_id)
    lease_expire_due()
    lease = Lease.objects.select_related("model").filter(id_hash=lease_hash(lease_id)).first()
    if lease is None or lease.model_id != model.id:
        raise LeaseNotFound("Unknown lease for this model", details={"model_id": model.id})
    if lease.ended_at is not None:
        raise LeaseExpired(
            f"The lease ended ({lease.end_reason})",
            details={
                "model_id": model.id,
                "end_reason": lease.end_reason,
                "ended_at": lease.ended_at.isoformat().replace("+00:00", "Z"),
            },
        )
    return lease


@audited("lease.renew", of_kwarg("model", "model"), params=kwargs_of("ttl_seconds"))
@transaction.atomic
def lease_renew(*, model: Model, lease_id: str | None, ttl_seconds: Any = None) -> Lease:
    ttl = _ttl(ttl_seconds)
    lease = _find(model=model, lease_id=lease_id)
    now = timezone.now()
    updated = Lease.objects.filter(pk=lease.pk, ended_at__isnull=True).update(
        renewed_at=now, expires_at=now + timedelta(seconds=ttl), ttl_seconds=ttl
    )
    if not updated:  # ended between the read and the write
        return lease_renew(model=model, lease_id=lease_id, ttl_seconds=ttl)
    lease.refresh_from_db()
    return lease


@audited("lease.release", of_kwarg("model", "model"))
@transaction.atomic
def lease_release(*, model: Model, lease_id: str | None) -> Lease:
    lease = _find(model=model, lease_id=lease_id)
    _end(Lease.objects.filter(pk=lease.pk), Lease.EndReason.RELEASED)
    _prune_ended()
    lease.refresh_from_db()
    log.info("lease_released", model_id=model.id)
    return lease


@audited("lease.revoke", lambda kw, r: ("lease", getattr(kw.get("lease"), "pk", ""), ""))
def lease_revoke(*, lease: Lease) -> Lease:
    """End a live lease without its id (the admin's action)."""
    _end(Lease.objects.filter(pk=lease.pk), Lease.EndReason.REVOKED)
    _prune_ended()
    lease.refresh_from_db()
    return lease


def lease_check_change(*, operation: str, target_model: Model | None = None, lease_id: str | None = None) -> None:
    """Refuse a model change (``load`` of another model, ``unload``) under a live lease
    the caller does not present (409 MODEL_LEASED). Using the model is never checked."""
    lease_expire_due()
    live = Lease.objects.select_related("model").filter(ended_at__isnull=True)
    if several_engines():  # a lease holds its model's engine (core.engines), not the others
        live = live.filter(model__engine=current_engine())
    live = live.first()
    if live is None:
        return
    if lease_id and lease_hash(lease_id.strip()) == live.id_hash:
        return
    raise ModelLeased(
        f"Model {live.model.name!r} is leased by {live.holder!r} until "
        f"{live.expires_at.isoformat()} ({live.reason}); present that lease in "
        f"{LEASE_HEADER} to {operation}",
        details={
            **leased_details(live),
            "operation": operation,
            "target_model_id": target_model.id if target_model else None,
        },
    )
