"""Live steering: what runs on /v1 requests that bring no steering of their own.

One ``LiveSteering`` row per attachment (values + enabled), in the database so that every
web worker resolves the same default and a restart keeps it. Every change takes the
``SteeringState`` row lock first, so changes from several workers apply one at a time,
and publishes ``steering:update``. Requests resolve their spec when they are planned, so a
change applies to every generation planned after it commits; a generation already running
keeps the spec it started with (its tokens stay attributable to one spec).

Rules (SPEC §3, the original's contract): values set directly lie in [-200, 200] (refused
otherwise, by the input serializers and again here); indices are checked against the SAE's
d_sae (INVALID_FEATURE_INDEX); setting a value enables steering; removing the last value
or clearing disables it, so the reported ``enabled`` is what runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import structlog
from django.db import transaction

from core import events
from core.errors import ValidationFailed
from core.process_copy import ProcessCopy
from gpu_engine.protocol import AttachmentKey
from registry.models import Attachment
from steering import rules
from steering.models import Circuit, Cluster, LiveSteering, Profile, SteeringState
from steering.selectors import attachment_pick

log = structlog.get_logger(__name__)

MAX_BATCH = 1000


# --------------------------------------------------------------------------- reads

def attachment_choose(*, sae_id: str | None = None, layer: int | None = None,
                      param: str = "sae_id") -> Attachment:
    """The attachment row a management call acts on (``attachment_pick``'s rule)."""
    rows = list(Attachment.objects.select_related("sae", "model").order_by("layer", "sae_id"))
    return attachment_pick(attachments=rows, sae_id=sae_id, layer=layer, param=param)


def values_out(values: Mapping[str, float]) -> dict[str, float]:
    return {str(k): float(values[k]) for k in sorted(values, key=int)}


def live_state(*, attachment: Attachment) -> dict[str, Any]:
    row = LiveSteering.objects.filter(attachment=attachment).first()
    values = values_out(row.values) if row else {}
    return {"sae_id": attachment.sae_id, "layer": attachment.layer,
            "enabled": bool(row and row.enabled and values), "values": values,
            "active_count": len(values) if row and row.enabled else 0,
            "source": row.source if row else LiveSteering.Source.MANUAL}


def live_rows() -> list[LiveSteering]:
    """Every attachment's live steering that runs (enabled, with values)."""
    return [r for r in LiveSteering.objects.select_related("attachment").filter(enabled=True)
            .order_by("attachment__layer", "attachment__sae_id") if r.values]


def _read_live_values() -> list[tuple[AttachmentKey, dict[int, float]]]:
    return [((r.attachment.sae_id, r.attachment.layer),
             {int(k): float(v) for k, v in r.values.items()}) for r in live_rows()]


# The live steering every /v1 request without its own runs, as ((sae_id, layer), values)
# pairs, kept in this process (core.process_copy): every change takes steering_lock(),
# which drops the copy when its transaction commits.
live_copy: ProcessCopy[list[tuple[AttachmentKey, dict[int, float]]]] = ProcessCopy(
    _read_live_values)


def live_values() -> list[tuple[AttachmentKey, dict[int, float]]]:
    """The live steering that runs, read from the database (and kept in ``live_copy``)."""
    return live_copy.read()


# --------------------------------------------------------------------------- checks

def check_indices(*, attachment: Attachment, indices: Iterable[int], param: str) -> None:
    """``rules.check_indices`` against an attachment row's SAE."""
    rules.check_indices(sae_id=attachment.sae_id, d_sae=attachment.sae.d_sae, indices=indices,
                        param=param)



# --------------------------------------------------------------------------- writes

def steering_lock() -> SteeringState:
    """Serialise live-steering changes across workers (call inside a transaction)."""
    state, _ = SteeringState.objects.select_for_update().get_or_create(pk=1)
    SteeringState.objects.filter(pk=1).update(version=state.version + 1)
    transaction.on_commit(live_copy.invalidate)
    return state


def _publish(attachment: Attachment, row: LiveSteering | None, *, reason: str) -> None:
    values = values_out(row.values) if row else {}
    enabled = bool(row and row.enabled and values)
    events.publish("steering:update", {
        "sae_id": attachment.sae_id, "layer": attachment.layer, "enabled": enabled,
        "values": values, "active_count": len(values) if enabled else 0,
        "source": row.source if row else LiveSteering.Source.MANUAL, "reason": reason})


def _on_commit_publish(attachment: Attachment, *, reason: str) -> None:
    def send() -> None:
        _publish(attachment, LiveSteering.objects.filter(attachment=attachment).first(),
                 reason=reason)

    transaction.on_commit(send)


def _save(attachment: Attachment, values: Mapping[int, float], *, enabled: bool,
          source: str) -> LiveSteering:
    stored = {str(k): float(v) for k, v in sorted(values.items())}
    row, _ = LiveSteering.objects.update_or_create(
        attachment=attachment,
        defaults={"values": stored, "enabled": bool(enabled and stored), "source": source})
    return row


@transaction.atomic
def live_set(*, attachment: Attachment, values: Mapping[int, float],
             source: str = LiveSteering.Source.MANUAL) -> dict[str, Any]:
    """Set feature values (merged into the attachment's live values) and enable steering.
    All or nothing: one bad index or value refuses the whole call."""
    if len(values) > MAX_BATCH:
        raise ValidationFailed(f"At most {MAX_BATCH} features per call (got {len(values)})",
                               details={"fields": {"steering": [f"at most {MAX_BATCH}"]}})
    values = rules.check_direct(values, "steering")
    check_indices(attachment=attachment, indices=values, param="feature_idx")
    steering_lock()
    row = LiveSteering.objects.filter(attachment=attachment).first()
    merged = {int(k): float(v) for k, v in (row.values if row else {}).items()}
    merged.update(values)
    _save(attachment, merged, enabled=True, source=source)
    _on_commit_publish(attachment, reason="set")
    return live_state(attachment=attachment)


@transaction.atomic
def live_remove(*, attachment: Attachment, index: int) -> dict[str, Any]:
    """Remove one feature; removing the last one disables steering."""
    steering_lock()
    row = LiveSteering.objects.filter(attachment=attachment).first()
    if row is not None and str(index) in row.values:
        values = {int(k): float(v) for k, v in row.values.items() if k != str(index)}
        _save(attachment, values, enabled=row.enabled, source=row.source)
        _on_commit_publish(attachment, reason="remove")
    return live_state(attachment=attachment)


@transaction.atomic
def live_clear(*, attachment: Attachment) -> dict[str, Any]:
    """Remove every value and disable."""
    steering_lock()
    _save(attachment, {}, enabled=False, source=LiveSteering.Source.MANUAL)
    _on_commit_publish(attachment, reason="clear")
    return live_state(attachment=attachment)


@transaction.atomic
def live_enable(*, attachment: Attachment, enabled: bool) -> dict[str, Any]:
    """Apply (or stop applying) the configured values; with no values nothing runs, so
    steering stays reported disabled."""
    steering_lock()
    row = LiveSteering.objects.filter(attachment=attachment).first()
    values = {int(k): float(v) for k, v in (row.values if row else {}).items()}
    _save(attachment, values, enabled=enabled,
          source=row.source if row else LiveSteering.Source.MANUAL)
    _on_commit_publish(attachment, reason="enable" if enabled else "disable")
    return live_state(attachment=attachment)


def live_replace_all(*, entries: Mapping[Attachment, Mapping[int, float]], source: str,
                     keep: Iterable[Attachment] = ()) -> None:
    """Make ``entries`` the whole live steering (every other attachment cleared, except
    those in ``keep``). Call inside a transaction holding ``steering_lock``; values are
    already validated."""
    keep_ids = {a.pk for a in keep}
    touched: list[Attachment] = []
    for row in LiveSteering.objects.select_related("attachment").exclude(
            attachment_id__in=[a.pk for a in entries] + list(keep_ids)):
        if row.values or row.enabled:
            touched.append(row.attachment)
        row.delete()
    for attachment, values in entries.items():
        _save(attachment, values, enabled=True, source=source)
        touched.append(attachment)
    for attachment in touched:
        _on_commit_publish(attachment, reason="activate")


def live_forget(*, attachments: Iterable[Attachment]) -> None:
    """An attachment is going away (detach, OOM): its live steering goes with it."""
    attachments = list(attachments)
    if not attachments:
        return
    with transaction.atomic():
        steering_lock()
        rows = LiveSteering.objects.filter(attachment__in=attachments)
        had = {r.attachment_id for r in rows if r.values or r.enabled}
        rows.delete()
        for attachment in attachments:
            if attachment.pk in had:
                sae_id, layer = attachment.sae_id, attachment.layer
                transaction.on_commit(lambda s=sae_id, lay=layer: events.publish(
                    "steering:update", {"sae_id": s, "layer": lay, "enabled": False,
                                        "values": {}, "active_count": 0,
                                        "source": LiveSteering.Source.MANUAL,
                                        "reason": "detach"}))


def documents_deactivate(*, keep_profile: Profile | None = None,
                         keep_cluster: Cluster | None = None,
                         keep_circuits: bool = False) -> None:
    """One active steering configuration at a time: a profile or cluster activation ends
    every other profile, cluster and circuit (circuits may share the live steering among
    themselves). Inside the locked transaction."""
    Profile.objects.filter(is_active=True).exclude(
        pk=keep_profile.pk if keep_profile else None).update(is_active=False)
    Cluster.objects.filter(is_active=True).exclude(
        pk=keep_cluster.pk if keep_cluster else None).update(is_active=False)
    if not keep_circuits:
        Circuit.objects.filter(is_active=True).update(is_active=False, serving={},
                                                      composed_layers=[])
