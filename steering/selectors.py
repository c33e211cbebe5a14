"""Steering reads: profiles, and picking the attachment a request means."""

from __future__ import annotations

from collections.abc import Sequence

from core.errors import SAENotAttached
from gpu_engine.protocol import AttachmentStatus
from steering.errors import ProfileNotFound, SteeringInvalid
from steering.models import Profile


def profile_get_by_name(*, name: str) -> Profile:
    try:
        return Profile.objects.get(name=name)
    except Profile.DoesNotExist:
        raise ProfileNotFound(f"Profile {name!r} not found", details={"profile": name}) from None


def attachment_choices(attachments: Sequence[AttachmentStatus]) -> list[str]:
    return [f"{a.sae_id}@{a.layer}" for a in attachments]


def attachment_pick(*, attachments: Sequence[AttachmentStatus], sae_id: str | None,
                    param: str) -> AttachmentStatus:
    """The attachment a request names by ``sae_id``, or the only one when it names none.

    An SAE attached at several layers is ambiguous without a layer, so it is refused the
    same way as several SAEs, naming the choices (``sae_id@layer``).
    """
    if sae_id is None:
        if len(attachments) == 1:
            return attachments[0]
        if not attachments:
            raise SAENotAttached("No SAE is attached", details={"param": param})
        raise SteeringInvalid(
            f"Several SAEs are attached; name one with {param}: "
            f"{', '.join(attachment_choices(attachments))}",
            details={"param": param, "choices": attachment_choices(attachments)})
    matches = [a for a in attachments if a.sae_id == sae_id]
    if not matches:
        raise SAENotAttached(
            f"SAE {sae_id!r} is not attached"
            + (f"; attached: {', '.join(attachment_choices(attachments))}" if attachments
               else "; no SAE is attached"),
            details={"param": param, "sae_id": sae_id,
                     "choices": attachment_choices(attachments)})
    if len(matches) > 1:
        raise SteeringInvalid(
            f"SAE {sae_id!r} is attached at several layers "
            f"({', '.join(attachment_choices(matches))}); this request cannot choose",
            details={"param": param, "choices": attachment_choices(matches)})
    return matches[0]


def live_steering_spec():
    """The live steering (every enabled attachment's values) as one ``SteeringSpec`` — for
    whoever restores or shows the state after an engine restart. Requests resolve their own
    spec per request, so a restarted engine needs nothing pushed to it."""
    from steering.live import live_steering_spec as spec

    return spec()
