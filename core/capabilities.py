"""Refusing at once what the loaded backend reports it cannot run, where a setting would
otherwise be accepted and then fail every later request that runs it (a live control on
llama.cpp in its control_vector_swap mode, say). The request path refuses the same in its own words; an
engine that cannot be asked is not a reason to refuse here."""

from __future__ import annotations

from core.errors import ValidationFailed
from core.runtime import runtime


def require_capability(capability: str, *, what: str, param: str) -> None:
    """422 VALIDATION_ERROR naming ``param`` when the loaded backend reports
    ``capability`` off (``/api/health/inference``'s ``capabilities``)."""
    try:
        status = runtime().engine.status()
    except Exception:  # noqa: BLE001 - no engine to ask: the request path decides
        return
    caps = status.capabilities
    if caps is not None and getattr(caps, capability) is False:
        raise ValidationFailed(
            f"The {status.backend} backend as loaded cannot run {what} ({capability} is off "
            "in /api/health/inference); it would fail every request that runs it",
            details={
                "param": param,
                "backend": status.backend,
                "capability": capability,
                "fields": {param: [f"{capability} is off on this backend"]},
            },
        )
