"""Lease reads. Every read applies expiry first, so what it returns is current."""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from leases.models import Lease
from leases.services import lease_expire_due
from registry.models import Model


def _iso(value) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def lease_out(lease: Lease) -> dict[str, Any]:
    """A lease as the API shows it: everything but the id."""
    remaining = max(0, int((lease.expires_at - timezone.now()).total_seconds())) if lease.ended_at is None else 0
    out = {
        "model_id": lease.model_id,
        "model_name": lease.model.name,
        "holder": lease.holder,
        "reason": lease.reason,
        "acquired_at": _iso(lease.acquired_at),
        "renewed_at": _iso(lease.renewed_at),
        "expires_at": _iso(lease.expires_at),
        "ttl_seconds": lease.ttl_seconds,
        "seconds_remaining": remaining,
    }
    if lease.ended_at is not None:
        out.update(end_reason=lease.end_reason, ended_at=_iso(lease.ended_at))
    return out


def lease_live(*, model: Model | None = None) -> Lease | None:
    """The live lease (of ``model``, or of whichever model holds one)."""
    lease_expire_due()
    qs = Lease.objects.select_related("model").filter(ended_at__isnull=True)
    if model is not None:
        qs = qs.filter(model=model)
    return qs.first()


def lease_status(*, model: Model) -> dict[str, Any]:
    """``{lease, last_ended}`` of ``GET /api/models/{id}/lease``."""
    live = lease_live(model=model)
    ended = (
        Lease.objects.select_related("model")
        .filter(model=model, ended_at__isnull=False)
        .order_by("-ended_at", "-id")
        .first()
    )
    return {"lease": lease_out(live) if live else None, "last_ended": lease_out(ended) if ended else None}
