"""Steering reads: profiles, and picking the attachment a request means."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from core.errors import SAENotAttached
from steering.errors import AmbiguousSAE, ProfileNotFound
from steering.models import Profile


def profile_get_by_name(*, name: str) -> Profile:
    try:
        return Profile.objects.get(name=name)
    except Profile.DoesNotExist:
        raise ProfileNotFound(f"Profile {name!r} not found", details={"profile": name}) from None


def profiles_for_model(*, model_name: str) -> list[Profile]:
    """The profiles a client may name as ``<model>@<profile>``: those made for this model
    and those made for any (an empty ``model_name``)."""
    return list(Profile.objects.filter(model_name__in=("", model_name)).order_by("name"))


def attachment_choices(attachments: Iterable[Any]) -> list[str]:
    return [f"{a.sae_id}@{a.layer}" for a in attachments]


def attachment_pick(*, attachments: Sequence[Any], sae_id: str | None = None,
                    layer: int | None = None, param: str = "sae_id") -> Any:
    """The one rule for which attachment a call means, for every surface: the one named by
    ``sae_id`` (and ``layer``), else the only one attached. ``attachments`` are registry
    rows or the engine's ``AttachmentStatus`` (anything with ``sae_id`` and ``layer``).

    None attached, or none matching, is ``SAE_NOT_ATTACHED``; several matching (several
    SAEs and none named, or one SAE at several layers and no layer) is ``AMBIGUOUS_SAE``;
    both name the choices as ``sae_id@layer``.
    """
    if not attachments:
        raise SAENotAttached("No SAE is attached; attach one first", details={"param": param})
    matches = [a for a in attachments if (sae_id is None or a.sae_id == sae_id)
               and (layer is None or a.layer == layer)]
    if not matches:
        named = f"sae_id={sae_id!r}" + ("" if layer is None else f" layer={layer}")
        raise SAENotAttached(
            f"No attachment matches {named}; attached: "
            f"{', '.join(attachment_choices(attachments))}",
            details={"param": param, "sae_id": sae_id, "layer": layer,
                     "choices": attachment_choices(attachments)})
    if len(matches) > 1:
        raise AmbiguousSAE(
            f"Several attachments match; name one with {param}"
            + ("" if param.endswith("layer") else " (and layer)") + ": "
            f"{', '.join(attachment_choices(matches))}",
            details={"param": param, "choices": attachment_choices(matches)})
    return matches[0]
