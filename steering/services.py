"""Resolving a request's steering into the engine's per-request ``SteeringSpec``.

``steering_resolve_request`` is the single place where a request's steering is decided:
inline features, a saved profile (or cluster) scaled by an intensity dial, or — when the
request brings none — the live steering set through /api (profiles, clusters and circuits
activate into it). Every surface that generates asks this function and the engine only
ever sees the resolved spec.

The mutations of the steering documents live in ``steering.live``, ``steering.profiles``,
``steering.clusters`` and ``steering.circuits``; they are re-exported here, so callers
have one namespace.

Rules (SPEC §3): values set directly must lie in [-200, 200] (refused otherwise, which the
/v1 schema and ``SteeringEntry`` both check); values derived from a dial (profile × λ) are
clamped to ±200 per feature.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from gpu_engine.api.fields import prechecked
from gpu_engine.api.protocol import (
    AttachmentStatus,
    FeatureControl,
    SteeringEntry,
    SteeringSpec,
)
from steering import live, rules
from steering.errors import ProfileIncompatible, ProfileNotFound, SteeringInvalid
from steering.inline_vectors import VectorAsk, place_vectors
from steering.models import Cluster, Profile
from steering.selectors import attachment_choices, attachment_pick, profile_get_by_name

MAX_INTENSITY = 2.0


@dataclass(frozen=True)
class ResolvedSteering:
    """What a request will run with. ``spec=None`` means the request said nothing (the
    engine runs it unsteered); an empty spec means explicitly unsteered."""

    mode: str  # "none" | "inline" | "profile" | "live"
    spec: SteeringSpec | None
    header: str
    profile: str | None = None
    intensity: float | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def steered(self) -> bool:
        return self.spec is not None and not self.spec.is_empty()

    @property
    def hash(self) -> str | None:
        """The canonical hash of the set that runs (``SteeringSpec.canonical_hash``; None
        when nothing is steered)."""
        return self.spec.canonical_hash() if self.steered else None  # type: ignore[union-attr]

    @property
    def header_value(self) -> str:
        """``X-miLLM-Steering``: the description, with ``hash="sha256:…"`` when steered."""
        digest = self.hash
        return self.header if digest is None else f'{self.header};hash="{digest}"'

    def summary(self) -> dict[str, Any]:
        """The ``millm.steering`` object of a /v1 response: what actually ran."""
        return {
            "mode": self.mode,
            "description": self.header,
            "profile": self.profile,
            "intensity": self.intensity,
            "entries": self.entries,
            "hash": self.hash,
        }


NONE = ResolvedSteering(mode="none", spec=None, header="none")
EXPLICITLY_UNSTEERED = ResolvedSteering(mode="none", spec=SteeringSpec([]), header="none")


def _header_value(text: str) -> str:
    # header values must be ASCII, and ';' / '=' separate our fields
    return quote(text, safe="-_.~:@/")


def _fmt(value: float) -> str:
    return f"{value:g}"


def _check_indices(att: AttachmentStatus, indices: Sequence[int], param: str) -> None:
    rules.check_indices(sae_id=att.sae_id, d_sae=att.d_sae, indices=indices, param=param)


def _resolved(
    mode: str,
    att: AttachmentStatus,
    features: dict[int, float],
    header: str,
    *,
    profile: str | None = None,
    intensity: float | None = None,
    controls: Sequence[FeatureControl] = (),
) -> ResolvedSteering:
    entry = SteeringEntry(att.sae_id, att.layer, features, list(controls))
    return ResolvedSteering(
        mode=mode,
        spec=SteeringSpec([entry]),
        header=header,
        profile=profile,
        intensity=intensity,
        entries=[_entry_summary(entry)],
    )


def _entry_summary(entry: SteeringEntry) -> dict[str, Any]:
    """An entry as /v1 requests write it (``features: [{index, strength}]``, and a
    control's ``{index, mode, value, phase, window, condition}``)."""
    return {
        "sae_id": entry.sae_id,
        "layer": entry.layer,
        "features": [{"index": i, "strength": s} for i, s in entry.features.items()]
        + [rules.control_json(c) for c in entry.controls],
    }


def _inline(
    *,
    attachments: Sequence[AttachmentStatus],
    sae_id: str | None,
    features: Sequence[tuple[int, float] | FeatureControl],
    intensity: float | None,
    check_indices: bool,
    layer: int | None = None,
    vectors: Sequence[VectorAsk] = (),
    sae_param: str = "steering.sae_id",
) -> ResolvedSteering:
    """Inline features: (index, strength) adds and ``FeatureControl``s.  The dial λ scales
    what is added (plain and gated adds, and inline vectors); clamp targets, scale factors
    and ablations are levels, not amounts, and run as written."""
    if vectors:
        return _with_vectors(
            attachments=attachments,
            sae_id=sae_id,
            layer=layer,
            features=features,
            vectors=vectors,
            intensity=intensity,
            check_indices=check_indices,
            sae_param=sae_param,
        )
    if not features:
        return EXPLICITLY_UNSTEERED
    # a plain add (an add at every position) counts as a feature, not a control
    plain = [
        (f.index, f.value) if isinstance(f, FeatureControl) else f
        for f in features
        if not isinstance(f, FeatureControl) or f.plain
    ]
    controls = [f for f in features if isinstance(f, FeatureControl) and not f.plain]
    indices = [index for index, _ in plain] + [c.index for c in controls]
    if len(set(indices)) != len(indices):
        raise SteeringInvalid("steering.features names a feature index twice", details={"param": "steering.features"})
    att = attachment_pick(attachments=attachments, sae_id=sae_id, layer=layer, param=sae_param)
    if check_indices or intensity == 0:
        # the engine's plan check is otherwise the one range check of these indices (against
        # the SAE it holds): refuse here what it would refuse, where it will not see them
        _check_indices(att, indices, "steering.features")
        _check_indices(
            att,
            [c.condition.feature for c in controls if c.condition is not None],
            "steering.features.condition.feature",
        )
    if intensity == 0:
        return EXPLICITLY_UNSTEERED
    values = {index: (strength if intensity is None else rules.dial(strength, intensity)) for index, strength in plain}
    if intensity is not None:
        controls = rules.dial_controls(controls, intensity)
    header = f"inline;sae={_header_value(att.sae_id)};layer={att.layer};features={len(values) + len(controls)}"
    if controls:
        header += f";controls={len(controls)}"
    if intensity is not None:
        header += f";intensity={_fmt(intensity)}"
    # the values' ranges were checked where the request was read (or dialled into them)
    with prechecked():
        return _resolved("inline", att, values, header, intensity=intensity, controls=controls)


def _with_vectors(
    *,
    attachments: Sequence[AttachmentStatus],
    sae_id: str | None,
    layer: int | None,
    features: Sequence[tuple[int, float] | FeatureControl],
    vectors: Sequence[VectorAsk],
    intensity: float | None,
    check_indices: bool,
    sae_param: str,
) -> ResolvedSteering:
    """Inline features (at the attachment the object names) and raw vectors (at theirs,
    ``steering.inline_vectors``) as one spec: an entry per attachment."""
    placed = place_vectors(
        attachments=attachments, asks=vectors, sae_id=sae_id, layer=layer, sae_param=sae_param, intensity=intensity
    )
    if intensity == 0:
        return EXPLICITLY_UNSTEERED
    entries: dict[tuple[str, int], SteeringEntry] = {}
    if features:
        base = _inline(
            attachments=attachments,
            sae_id=sae_id,
            layer=layer,
            features=features,
            intensity=intensity,
            check_indices=check_indices,
            sae_param=sae_param,
        )
        entries.update({e.key: e for e in base.spec.entries} if base.spec is not None else {})
    with prechecked():
        for key, found in placed.items():
            e = entries.get(key)
            entries[key] = (
                SteeringEntry(key[0], key[1], dict(e.features), list(e.controls), found)
                if e
                else SteeringEntry(key[0], key[1], vectors=found)
            )
    spec = SteeringSpec(list(entries.values()))
    header = f"inline;vectors={len(vectors)};features={len(features)}"
    if intensity is not None:
        header += f";intensity={_fmt(intensity)}"
    summaries = [_entry_summary(e) for e in spec.entries]
    for summary, e in zip(summaries, spec.entries, strict=True):
        summary["vectors"] = [
            {
                "dtype": v.dtype,
                "width": v.width,
                "strength": v.strength,
                "phase": v.phase,
                "sha256": hashlib.sha256(v.data).hexdigest(),
                # a clamp's bounds (docs/steering.md, "Inline vectors")
                **({"mode": v.mode, "min": v.min, "max": v.max} if v.projects else {}),
            }
            for v in e.vectors
        ]
    return ResolvedSteering(mode="inline", spec=spec, header=header, intensity=intensity, entries=summaries)


def _cluster_as_profile(name: str) -> Profile | None:
    """A cluster named where a profile is expected (``profile`` on /v1): its members by
    the sign rule at λ = 1 (and its controls), on the attachment it is bound to; the dial
    scales them."""
    cluster = Cluster.objects.filter(name=name).first()
    if cluster is None:
        return None

    features = cluster_features(cluster, 1.0)
    return Profile(
        name=name,
        sae_id=cluster.sae_id,
        layer=cluster.layer,
        steering=features.stored_values(),
        controls=features.stored_controls(),
        intensity=cluster.intensity,
        model_name="",
    )


def _profile_document(name: str) -> Profile:
    """The profile a request's ``profile`` names, else the cluster of that name (as a
    profile); ``PROFILE_NOT_FOUND`` when neither exists."""
    try:
        return profile_get_by_name(name=name)
    except ProfileNotFound:
        profile = _cluster_as_profile(name)
        if profile is None:
            raise
        return profile


def steering_profile_binding(*, name: str) -> tuple[str, int] | None:
    """The attachment ``(sae_id, layer)`` the profile (or cluster) a request names steers,
    found as the resolver finds it; None when it is bound to none (a cluster not yet
    activated). ``manage.py capture`` attaches it to its own engine."""
    profile = _profile_document(name)
    return (profile.sae_id, int(profile.layer)) if profile.sae_id and profile.layer is not None else None


def _profile(
    *, attachments: Sequence[AttachmentStatus], name: str, model_name: str | None, intensity: float | None
) -> ResolvedSteering:
    profile = _profile_document(name)
    # the request's λ, else the document's own (a profile's or cluster's stored dial)
    dial = float(profile.intensity) if intensity is None else intensity
    if dial == 0:
        return EXPLICITLY_UNSTEERED
    if profile.model_name and model_name and profile.model_name != model_name:
        raise ProfileIncompatible(
            f"Profile {name!r} was made for model {profile.model_name!r}, not {model_name!r}",
            details={"profile": name, "model": model_name, "profile_model": profile.model_name},
        )

    features = profile_features(profile)
    if not features:
        return EXPLICITLY_UNSTEERED
    if not attachments:
        # The documented contract: with no SAE attached a profile request runs unsteered
        # (and says so in X-miLLM-Steering) rather than failing.
        return NONE
    if not profile.sae_id:
        raise ProfileIncompatible(
            f"{name!r} is not bound to an SAE attachment (a cluster binds when it is activated)",
            details={"profile": name},
        )
    att = next((a for a in attachments if a.sae_id == profile.sae_id and a.layer == profile.layer), None)
    if att is None:
        raise ProfileIncompatible(
            f"Profile {name!r} steers SAE {profile.sae_id!r} at layer {profile.layer}, "
            f"which is not attached (attached: {', '.join(attachment_choices(attachments))})",
            details={
                "profile": name,
                "sae_id": profile.sae_id,
                "layer": profile.layer,
                "choices": attachment_choices(attachments),
            },
        )
    rules.check_features(sae_id=att.sae_id, d_sae=att.d_sae, features=features, param="profile")
    scaled = features.dialled(dial)
    header = f"profile;name={_header_value(name)};intensity={_fmt(dial)}"
    if scaled.controls:
        header += f";controls={len(scaled.controls)}"
    return _resolved("profile", att, scaled.values, header, profile=name, intensity=dial, controls=scaled.controls)


def _live(
    *,
    attachments: Sequence[AttachmentStatus],
    intensity: float | None,
    values: live.LiveScopes | None,
    scope: str | None = None,
    show_scope: bool = False,
) -> ResolvedSteering:
    """The live steering of the attachments the engine holds (rows for attachments it
    does not hold, e.g. during a detach, are skipped), dialled by the request's λ.
    ``values``: every scope's, this process's copy (``live.live_copy``); None reads the
    database. ``scope``: the request's key's scope (run when it holds live steering, else
    the global one); ``show_scope``: the header names the scope that ran (keys on)."""
    held = {(a.sae_id, a.layer) for a in attachments}
    applied, source = (live.live_values() if values is None else values).pick(scope)
    rows = [e for e in source if e.key in held]
    if not rows:
        return NONE
    if intensity == 0:
        return EXPLICITLY_UNSTEERED
    entries = []
    for row in rows:
        scaled = rules.FeatureSet(dict(row.features), list(row.controls))
        if intensity is not None:
            scaled = scaled.dialled(intensity)
        entries.append(SteeringEntry(row.sae_id, row.layer, scaled.values, scaled.controls))
    count = sum(len(e.features) + len(e.controls) for e in entries)
    controls = sum(len(e.controls) for e in entries)
    circuits = getattr(source, "circuits", ())
    if circuits:
        # serving circuits set all of it: the original's form, each circuit's own λ; a
        # request's dial multiplies on top of it
        header = (
            f"circuit;id={','.join(str(i) for i, _ in circuits)};intensity={','.join(_fmt(lam) for _, lam in circuits)}"
        )
        if intensity is not None:
            header += f";dial={_fmt(intensity)}"
    else:
        if len(entries) == 1:
            header = f"live;sae={_header_value(entries[0].sae_id)};layer={entries[0].layer};features={count}"
        else:
            header = f"live;attachments={len(entries)};features={count}"
        if controls:
            header += f";controls={controls}"
        if intensity is not None:
            header += f";intensity={_fmt(intensity)}"
    if show_scope:
        header += f";scope={_header_value(applied)}"
    return ResolvedSteering(
        mode="live",
        spec=SteeringSpec(entries),
        header=header,
        intensity=intensity,
        entries=[_entry_summary(e) for e in entries],
    )


def steering_resolve_request(
    *,
    attachments: Sequence[AttachmentStatus],
    model_name: str | None = None,
    inline_sae_id: str | None = None,
    inline_features: Sequence[tuple[int, float] | FeatureControl] | None = None,
    inline_layer: int | None = None,
    inline_vectors: Sequence[VectorAsk] = (),
    sae_param: str = "steering.sae_id",
    profile: str | None = None,
    intensity: float | None = None,
    live_values: live.LiveScopes | None = None,
    live_scope: str | None = None,
    show_scope: bool = False,
    check_indices: bool = False,
) -> ResolvedSteering:
    """Resolve one request's steering against the attachments the engine holds now.

    ``inline_features=None`` means the request sent no ``steering`` object; ``[]`` means
    it asked to run unsteered. ``intensity`` (λ in [0, 2]) scales whichever base the
    request names; 0 turns steering off for the request. ``live_values``: the live
    steering as this process holds it (``steering.live.live_copy``), so that a request
    without steering of its own reads no database; None reads it. ``live_scope``: the
    calling key's scope (``steering.live.key_scope``), run instead of the global one when
    it holds live steering; ``show_scope`` names the scope that ran in the header. An inline request's
    feature indices are range-checked once, by the engine against the SAE it holds (its
    ``invalid_feature_index`` names the field); ``check_indices=True`` checks them here
    too, for a caller that refuses a whole list before any of it runs (``manage.py
    capture``), and they are checked here whenever nothing reaches the engine (a dial of 0).
    """
    if intensity is not None and not (0 <= intensity <= MAX_INTENSITY):
        raise SteeringInvalid(
            f"steering_intensity must lie in [0, {MAX_INTENSITY:g}]", details={"param": "steering_intensity"}
        )
    if inline_features is not None and profile is not None:
        raise SteeringInvalid("Give either steering or a profile, not both", details={"param": "profile"})
    if inline_features is not None:
        return _inline(
            attachments=attachments,
            sae_id=inline_sae_id,
            features=inline_features,
            intensity=intensity,
            check_indices=check_indices,
            layer=inline_layer,
            vectors=inline_vectors,
            sae_param=sae_param,
        )
    if profile is not None:
        return _profile(attachments=attachments, name=profile, model_name=model_name, intensity=intensity)
    # Nothing asked for: the live steering set through /api.
    return _live(
        attachments=attachments, intensity=intensity, values=live_values, scope=live_scope, show_scope=show_scope
    )


# --------------------------------------------------------------------------- re-exports
# One namespace for the steering mutations (views, admin, commands and tests import these).

from steering.circuits import (
    circuit_claims,
    circuit_deactivate,
    circuit_delete,
    circuit_get,
    circuit_import,
    circuit_replace,
    circuit_set_active_intensity,
    circuit_set_intensity,
    circuits_active,
)
from steering.clusters import (
    cluster_activate,
    cluster_active,
    cluster_deactivate,
    cluster_delete,
    cluster_features,
    cluster_get,
    cluster_import,
    cluster_set_active_intensity,
    cluster_set_intensity,
    cluster_update,
)
from steering.forget import live_forget
from steering.live import (
    attachment_choose,
    live_clear,
    live_enable,
    live_remove,
    live_set,
    live_state,
)
from steering.profiles import (
    profile_activate,
    profile_create,
    profile_deactivate,
    profile_delete,
    profile_export,
    profile_features,
    profile_get,
    profile_import,
    profile_save_current,
    profile_update,
)

__all__ = [
    "EXPLICITLY_UNSTEERED",
    "NONE",
    "ResolvedSteering",
    "attachment_choose",
    "circuit_claims",
    "circuit_deactivate",
    "circuit_delete",
    "circuit_replace",
    "circuit_get",
    "circuit_import",
    "circuit_set_active_intensity",
    "circuit_set_intensity",
    "circuits_active",
    "cluster_activate",
    "cluster_active",
    "cluster_deactivate",
    "cluster_delete",
    "cluster_get",
    "cluster_import",
    "cluster_set_active_intensity",
    "cluster_set_intensity",
    "cluster_update",
    "live_clear",
    "live_enable",
    "live_forget",
    "live_remove",
    "live_set",
    "live_state",
    "profile_activate",
    "profile_create",
    "profile_deactivate",
    "profile_delete",
    "profile_export",
    "profile_get",
    "profile_import",
    "profile_save_current",
    "profile_update",
    "steering_profile_binding",
    "steering_resolve_request",
]
