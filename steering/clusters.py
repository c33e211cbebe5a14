"""Cluster services: import (``mistudio.cluster-definition/v1`` documents and bundles),
binding to an attachment, activation with the intensity dial, export.

A definition imports *bound* when an attached SAE fits its declared feature space (same
``n_features`` as the SAE's d_sae, every member index inside it), with warnings when the
declared model or layer differ; otherwise it imports *unbound* with the reason, and
activation refuses it with that reason until an SAE that fits is attached (then it binds).

Member values follow the sign rule (a negative strength is already directional; otherwise
``sign × strength``), are stored as authored (λ = 1) and scaled by the cluster's λ when
applied, each clamped to ±200. A member with a mode, phase, window or condition runs as
a control (``documents.members_features``: the dial scales an add's amount and leaves
clamp targets, scale factors and ablations as written). The export is the imported
document, unchanged.
"""

from __future__ import annotations

from typing import Any

import structlog
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.services import audited, kwargs_of, of_kwarg
from core.errors import MillmError, SAENotAttached, ValidationFailed
from core.ids import get_by_pk_or_name
from registry.models import Attachment
from steering import live, rules
from steering.documents import (
    ClusterDefinition,
    Member,
    document_text,
    members_features,
    parse_cluster_document,
    validate_cluster,
)
from steering.errors import (
    AmbiguousSAE,
    ClusterNotFound,
    IncompatibleFeatureSpace,
    NoActiveCluster,
)
from steering.models import Cluster, LiveSteering
from steering.names import check_name
from steering.selectors import attachment_choices

log = structlog.get_logger(__name__)

ON_CONFLICT = ("rename", "fail")


class ClusterAlreadyExists(MillmError):
    code, status = "CLUSTER_ALREADY_EXISTS", 409


def cluster_get(*, cluster_id: int | str) -> Cluster:
    try:
        return get_by_pk_or_name(Cluster.objects.all(), cluster_id)
    except Cluster.DoesNotExist:
        raise ClusterNotFound(f"Cluster {cluster_id!r} not found", details={"cluster_id": cluster_id}) from None


def cluster_members(cluster: Cluster) -> list[Member]:
    return [Member.model_validate(m) for m in cluster.members]


def cluster_features(cluster: Cluster, intensity: float | None = None) -> rules.FeatureSet:
    """What the cluster steers at λ: the sign rule, scaled, each clamped to ±200; members
    with a mode or a gate as controls."""
    lam = cluster.intensity if intensity is None else intensity
    return members_features(cluster_members(cluster), lam)


def _indices(members: list[Member]) -> list[int]:
    return [i for m in members for i in m.indices()]


def check_intensity(value: Any, intensity_range: list[float] | None) -> float:
    """λ within the definition's declared range (0 is always allowed), else within [0, 2]."""
    try:
        lam = float(value)
    except (TypeError, ValueError):
        lam = float("nan")
    low, high = intensity_range or (0.0, 2.0)
    if lam == 0 or low <= lam <= min(high, 2.0):
        return lam
    raise ValidationFailed(
        f"intensity must be 0 or lie in [{low:g}, {min(high, 2.0):g}] (got {value!r})",
        details={"fields": {"intensity": [f"0 or {low:g}..{high:g}"]}, "intensity_range": [low, high]},
    )


def _fit(
    *,
    sae_ref: dict[str, Any],
    n_features: int | None,
    indices: list[int],
    model_ref: str = "",
    sae_id: str | None = None,
    layer: int | None = None,
) -> tuple[Attachment, list[str]]:
    """The attachment a definition steers through, or the reason it cannot (raised)."""
    rows = list(Attachment.objects.select_related("sae", "model").order_by("layer", "sae_id"))
    if not rows:
        raise SAENotAttached("No SAE is attached: the cluster cannot bind until one is", details={"param": "sae_id"})
    ref, declared_layer = sae_ref.get("ref"), sae_ref.get("layer")
    candidates = rows
    if sae_id is not None or layer is not None:
        candidates = [a for a in rows if (sae_id is None or a.sae_id == sae_id) and (layer is None or a.layer == layer)]
        if not candidates:
            raise SAENotAttached(
                f"No attachment matches sae_id={sae_id!r} layer={layer!r}",
                details={"choices": attachment_choices(rows)},
            )
    else:
        if ref and any(a.sae_id == ref for a in candidates):
            candidates = [a for a in candidates if a.sae_id == ref]
        if declared_layer is not None and any(a.layer == declared_layer for a in candidates):
            candidates = [a for a in candidates if a.layer == declared_layer]
    if len(candidates) > 1:
        raise AmbiguousSAE(
            f"Several SAEs could serve the cluster; name one with sae_id and "
            f"layer: {', '.join(attachment_choices(candidates))}",
            details={"choices": attachment_choices(candidates)},
        )
    att = candidates[0]
    d_sae = att.sae.d_sae
    if n_features is not None and d_sae is not None and n_features != d_sae:
        raise IncompatibleFeatureSpace(
            f"The definition declares {n_features} features; SAE {att.sae_id} at layer "
            f"{att.layer} has {d_sae}, so its indices name other features",
            details={"n_features": n_features, "d_sae": d_sae, "sae_id": att.sae_id, "layer": att.layer},
        )
    rules.check_indices(sae_id=att.sae_id, d_sae=d_sae, indices=indices, param="members")
    warnings = []
    if declared_layer is not None and declared_layer != att.layer:
        warnings.append(f"the definition was made at layer {declared_layer}; bound to layer {att.layer}")
    if model_ref and model_ref not in (att.model.name, att.model.repo_id):
        warnings.append(f"the definition was made for model {model_ref!r}; the loaded model is {att.model.name!r}")
    return att, warnings


def _free_name(name: str) -> str:
    base, n = name, 2
    while Cluster.objects.filter(name=name).exists():
        name, n = f"{base} ({n})", n + 1
    return name


def _create(definition: ClusterDefinition, text: str, *, on_conflict: str) -> Cluster:
    name = definition.name.strip()
    check_name(name, collection="clusters", what="Cluster")
    if Cluster.objects.filter(name=name).exists():
        if on_conflict == "fail":
            raise ClusterAlreadyExists(f"A cluster named {name!r} already exists", details={"name": name})
        name = _free_name(name)
    budget = definition.budget
    fields: dict[str, Any] = {
        "name": name,
        "narrative": definition.narrative or "",
        "document": text,
        "members": [m.row() for m in definition.members],
        "model_ref": definition.model.hf_id or definition.model.mistudio_model_id or "",
        "sae_ref": definition.sae.row(),
        "n_features": definition.sae.n_features,
        "intensity": budget.intensity if budget else 1.0,
        "intensity_range": budget.intensity_range if budget else None,
    }
    try:
        att, warnings = _fit(
            sae_ref=fields["sae_ref"],
            n_features=fields["n_features"],
            indices=_indices(definition.members),
            model_ref=fields["model_ref"],
        )
        fields.update(sae_id=att.sae_id, layer=att.layer, warnings=warnings)
    except MillmError as exc:
        fields.update(unbound_reason=exc.message[:500])
    try:
        with transaction.atomic():
            return Cluster.objects.create(**fields)
    except IntegrityError:
        raise ClusterAlreadyExists(f"A cluster named {name!r} already exists", details={"name": name}) from None


def _error(exc: MillmError) -> dict[str, Any]:
    return {"code": exc.code, "message": exc.message, "details": exc.details}


@audited(
    "cluster.import",
    lambda kw, r: ("cluster", "", str((kw.get("document") or {}).get("name") or "")),
    params=kwargs_of("on_conflict", "activate"),
)
def cluster_import(
    *, document: dict[str, Any], text: str | None = None, on_conflict: str = "rename", activate: bool = False
) -> dict[str, Any]:
    """Import one definition or a bundle. Bundle items import independently (one bad
    definition never blocks the rest); a single bad definition refuses the request."""
    if on_conflict not in ON_CONFLICT:
        raise ValidationFailed(
            "on_conflict must be rename or fail", details={"fields": {"on_conflict": list(ON_CONFLICT)}}
        )
    items = parse_cluster_document(document)
    single = items[0] is document
    results: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        try:
            definition = validate_cluster(item)
            stored = text if single and text is not None else document_text(item)
            cluster = _create(definition, stored, on_conflict=on_conflict)
        except MillmError as exc:
            if single:
                raise
            results.append({"index": index, "status": "failed", "cluster": None, "error": _error(exc)})
            continue
        results.append(
            {
                "index": index,
                "cluster": cluster,
                "error": None,
                "status": "imported" if cluster.sae_id else "imported_unbound",
            }
        )
    out: dict[str, Any] = {
        "results": results,
        "imported": sum(r["status"] != "failed" for r in results),
        "failed": sum(r["status"] == "failed" for r in results),
    }
    if single and activate and results and results[0]["cluster"] is not None:
        try:
            results[0]["cluster"] = cluster_activate(cluster=results[0]["cluster"])
            out["activated"] = True
        except MillmError as exc:
            out["activated"], out["activation_error"] = False, _error(exc)
    log.info("clusters_imported", imported=out["imported"], failed=out["failed"])
    return out


@audited("cluster.activate", of_kwarg("cluster", "cluster"), params=kwargs_of("intensity", "sae_id", "layer"))
def cluster_activate(
    *, cluster: Cluster, intensity: Any = None, sae_id: str | None = None, layer: int | None = None
) -> Cluster:
    """Every member steers together (replacing the live steering), at λ; refused — with
    nothing changed — when the cluster cannot bind to an attached SAE."""
    lam = cluster.intensity if intensity is None else check_intensity(intensity, cluster.intensity_range)
    members = cluster_members(cluster)
    bound = None
    if cluster.sae_id and sae_id is None and layer is None:
        bound = (
            Attachment.objects.select_related("sae", "model").filter(sae_id=cluster.sae_id, layer=cluster.layer).first()
        )
    if bound is not None:
        live.check_indices(attachment=bound, indices=_indices(members), param="members")
        warnings = list(cluster.warnings)
    else:
        bound, warnings = _fit(
            sae_ref=cluster.sae_ref,
            n_features=cluster.n_features,
            indices=_indices(members),
            model_ref=cluster.model_ref,
            sae_id=sae_id,
            layer=layer,
        )
    values = members_features(members, lam)
    with transaction.atomic():
        live.steering_lock()
        live.documents_deactivate(keep_cluster=cluster)
        live.live_replace_all(entries={bound: values}, source=LiveSteering.Source.CLUSTER)
        Cluster.objects.filter(pk=cluster.pk).update(
            is_active=True,
            intensity=lam,
            sae_id=bound.sae_id,
            layer=bound.layer,
            unbound_reason="",
            warnings=warnings,
            updated_at=timezone.now(),
        )
    cluster.refresh_from_db()
    log.info("cluster_activated", cluster=cluster.name, intensity=lam)
    return cluster


@audited("cluster.deactivate", of_kwarg("cluster", "cluster"), params=kwargs_of("clear_steering"))
def cluster_deactivate(*, cluster: Cluster, clear_steering: bool = True) -> Cluster:
    with transaction.atomic():
        live.steering_lock()
        was_active = Cluster.objects.filter(pk=cluster.pk, is_active=True).update(is_active=False)
        if was_active and clear_steering:
            live.live_replace_all(entries={}, source=LiveSteering.Source.MANUAL, reason="deactivate")
    cluster.refresh_from_db()
    return cluster


@audited("cluster.intensity", of_kwarg("cluster", "cluster"), params=kwargs_of("intensity", "reapply"))
def cluster_set_intensity(*, cluster: Cluster, intensity: Any, reapply: bool = True) -> tuple[Cluster, bool]:
    """Set λ; an active cluster re-applies at once (in one transaction, so a failure
    leaves the old λ and the old values). Returns the cluster and whether it re-applied."""
    lam = check_intensity(intensity, cluster.intensity_range)
    with transaction.atomic():
        live.steering_lock()
        cluster = Cluster.objects.get(pk=cluster.pk)
        reapplied = False
        if cluster.is_active and reapply:
            attachment = (
                Attachment.objects.select_related("sae").filter(sae_id=cluster.sae_id, layer=cluster.layer).first()
            )
            if attachment is not None:
                live.live_replace_all(
                    entries={attachment: cluster_features(cluster, lam)}, source=LiveSteering.Source.CLUSTER
                )
                reapplied = True
        Cluster.objects.filter(pk=cluster.pk).update(intensity=lam, updated_at=timezone.now())
    cluster.refresh_from_db()
    return cluster, reapplied


def cluster_active() -> Cluster | None:
    return Cluster.objects.filter(is_active=True).first()


def cluster_set_active_intensity(*, intensity: Any, reapply: bool = True) -> tuple[Cluster, bool]:
    cluster = cluster_active()
    if cluster is None:
        raise NoActiveCluster("No cluster is active", details={})
    return cluster_set_intensity(cluster=cluster, intensity=intensity, reapply=reapply)


@audited("cluster.update", of_kwarg("cluster", "cluster"), params=kwargs_of("name"))
def cluster_update(*, cluster: Cluster, name: str | None = None, narrative: str | None = None) -> Cluster:
    """Name and narrative only: the members are the document's (edit the definition and
    import it again; adjust strength with the dial)."""
    if name is not None:
        name = name.strip()
        if not name or len(name) > 200:
            raise ValidationFailed("name must be 1-200 characters", details={"fields": {"name": ["1-200 characters"]}})
        check_name(name, collection="clusters", what="Cluster")
        if Cluster.objects.filter(name=name).exclude(pk=cluster.pk).exists():
            raise ClusterAlreadyExists(f"A cluster named {name!r} already exists", details={"name": name})
        cluster.name = name
    if narrative is not None:
        cluster.narrative = narrative
    cluster.save()
    return cluster


@audited("cluster.delete", of_kwarg("cluster", "cluster"))
def cluster_delete(*, cluster: Cluster) -> None:
    if cluster.is_active:
        cluster_deactivate(cluster=cluster)
    Cluster.objects.filter(pk=cluster.pk).delete()
