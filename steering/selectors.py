"""Steering reads: profiles, the registered SAE or model a document names, and picking
the attachment a request means."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from core.errors import SAENotAttached
from registry.errors import AmbiguousModelName, ModelNotFound, SAENotFound
from registry.models import SAE, Model
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


def sae_for_reference(
    *, sae_id: str | None = None, repo_id: str | None = None, layer: int | None = None, file_path: str | None = None
) -> SAE:
    """The registered SAE a document names: by its id here, else by its hub repository
    (``SAE.repository_id``), narrowed to the layer it was trained at and its file in the
    repository when the document gives them. SAE_NOT_FOUND naming what was looked for
    when none matches; AMBIGUOUS_SAE listing the candidates (``sae_id@layer``) when
    several do."""
    if sae_id:
        sae = SAE.objects.filter(pk=sae_id).first()
        if sae is None:
            raise SAENotFound(f"SAE {sae_id!r} is not registered on this server", details={"sae": {"id": sae_id}})
        return sae
    looked_for: dict[str, Any] = {"repo_id": repo_id}
    rows = SAE.objects.filter(repository_id=repo_id)
    if layer is not None:
        looked_for["layer"] = layer
        rows = rows.filter(trained_on_layer=layer)
    if file_path:
        looked_for["file_path"] = file_path
        path = file_path.strip("/")
        rows = rows.filter(file_path__in=(path, path + "/"))
    found = list(rows.order_by("id")[:21])
    what = ", ".join(f"{k}={v!r}" for k, v in looked_for.items())
    if not found:
        raise SAENotFound(
            f"No registered SAE matches {what}; download or register it first", details={"sae": looked_for}
        )
    if len(found) > 1:
        choices = [f"{s.id}@{s.trained_on_layer}" for s in found]
        raise AmbiguousSAE(
            f"Several registered SAEs match {what}; name one with sae.id or sae.file_path: {', '.join(choices)}",
            details={"param": "sae", "sae": looked_for, "choices": choices},
        )
    return found[0]


def model_for_repo(*, repo_id: str, quantization: str | None = None) -> Model:
    """The registered model a document names by hub repository (``Model.repo_id``, else a
    model registered under that name); the document's quantization picks among several.
    MODEL_NOT_FOUND or AMBIGUOUS_MODEL_NAME (``details.choices``) otherwise."""
    rows = list(Model.objects.filter(repo_id=repo_id).order_by("name")) or list(Model.objects.filter(name=repo_id))
    if len(rows) > 1 and quantization:
        rows = [m for m in rows if m.quantization == quantization] or rows
    if not rows:
        raise ModelNotFound(
            f"No registered model comes from {repo_id!r}; register it first", details={"model": {"repo_id": repo_id}}
        )
    if len(rows) > 1:
        choices = [m.name for m in rows]
        raise AmbiguousModelName(
            f"Several registered models come from {repo_id!r}; name one with model_id: {', '.join(choices)}",
            details={"param": "model_id", "choices": choices},
        )
    return rows[0]


def attachment_choices(attachments: Iterable[Any]) -> list[str]:
    return [f"{a.sae_id}@{a.layer}" for a in attachments]


def attachment_pick(
    *, attachments: Sequence[Any], sae_id: str | None = None, layer: int | None = None, param: str = "sae_id"
) -> Any:
    """The one rule for which attachment a call means, for every surface: the one named by
    ``sae_id`` (and ``layer``), else the only one attached. ``attachments`` are registry
    rows or the engine's ``AttachmentStatus`` (anything with ``sae_id`` and ``layer``).

    None attached, or none matching, is ``SAE_NOT_ATTACHED``; several matching (several
    SAEs and none named, or one SAE at several layers and no layer) is ``AMBIGUOUS_SAE``;
    both name the choices as ``sae_id@layer``.
    """
    if not attachments:
        raise SAENotAttached("No SAE is attached; attach one first", details={"param": param})
    matches = [a for a in attachments if (sae_id is None or a.sae_id == sae_id) and (layer is None or a.layer == layer)]
    if not matches:
        named = f"sae_id={sae_id!r}" + ("" if layer is None else f" layer={layer}")
        raise SAENotAttached(
            f"No attachment matches {named}; attached: {', '.join(attachment_choices(attachments))}",
            details={"param": param, "sae_id": sae_id, "layer": layer, "choices": attachment_choices(attachments)},
        )
    if len(matches) > 1:
        raise AmbiguousSAE(
            f"Several attachments match; name one with {param}"
            + ("" if param.endswith("layer") else " (and layer)")
            + ": "
            f"{', '.join(attachment_choices(matches))}",
            details={"param": param, "choices": attachment_choices(matches)},
        )
    return matches[0]
