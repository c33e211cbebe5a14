"""Profile services: CRUD (unique names), save-current, activate/deactivate, export and
import in a versioned JSON that round-trips losslessly.

A profile may also hold controls (a feature clamped, scaled or ablated, or steered only in
a phase, a window or where a trigger fires: ``rules.controls_parse``), stored beside the
plain map; the export carries them as ``controls`` only when there are some, so a profile
without any exports exactly as before.

Activation replaces the whole live steering with the profile's values, scaled by its
intensity λ and clamped to ±200 per value (controls: ``rules.dial_controls``); everything
is validated (attachment present, indices within d_sae, model) before anything changes,
then one locked transaction makes the change. An empty profile is a supported way back to
a clean, unsteered state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import structlog
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from audit.services import audited, kwargs_of, of_kwarg
from core.errors import SAENotAttached, ValidationFailed
from core.ids import ascii_int, get_by_pk_or_name
from gpu_engine.api.protocol import MAX_STEERING_STRENGTH, FeatureControl
from registry.models import SAE, Attachment
from steering import live, rules
from steering.documents import PROFILE_VERSION, refuse_cluster_as_profile
from steering.errors import ProfileAlreadyExists, ProfileIncompatible, ProfileNotFound
from steering.models import LiveSteering, Profile
from steering.selectors import attachment_choices, model_for_repo, sae_for_reference

log = structlog.get_logger(__name__)

MAX_INTENSITY = 2.0


def profile_get(*, profile_id: int | str) -> Profile:
    """By id or by name."""
    try:
        return get_by_pk_or_name(Profile.objects.all(), profile_id)
    except Profile.DoesNotExist:
        raise ProfileNotFound(f"Profile {profile_id!r} not found", details={"profile_id": profile_id}) from None


def steering_map(raw: Any, *, param: str = "steering") -> dict[int, float]:
    """``{"<index>": strength}`` (or ``[{index, strength}]``) → ints and floats, every value
    set directly so within ±200; VALIDATION_ERROR naming the bad keys otherwise."""
    if isinstance(raw, list):
        pairs, bad = [], []
        for i, item in enumerate(raw):
            if isinstance(item, Mapping) and "index" in item and "strength" in item:
                pairs.append((item["index"], item["strength"]))
            else:
                bad.append(str(i))
        if bad:
            raise ValidationFailed(
                f"{param}: entries {', '.join(bad)} are not {{index, strength}}",
                details={"invalid_keys": bad, "fields": {param: bad}},
            )
    elif isinstance(raw, Mapping):
        pairs = list(raw.items())
    else:
        raise ValidationFailed(
            f"{param} must be an object of index → strength", details={"fields": {param: ["not an object"]}}
        )
    values: dict[int, float] = {}
    bad: list[str] = []
    for key, value in pairs:
        try:
            if isinstance(key, bool) or isinstance(value, bool):
                raise ValueError
            index = int(key)
            if str(index) != str(key).strip() and not isinstance(key, int):
                raise ValueError
            strength = float(value)
        except (TypeError, ValueError):
            bad.append(str(key))
            continue
        if index < 0 or not math.isfinite(strength) or abs(strength) > MAX_STEERING_STRENGTH:
            bad.append(str(key))
            continue
        values[index] = strength
    if bad:
        raise ValidationFailed(
            f"{param}: entries that are not index → strength within ±{MAX_STEERING_STRENGTH:g}: {', '.join(bad)}",
            details={"invalid_keys": bad, "fields": {param: [f"invalid keys: {bad}"]}},
        )
    return values


def _intensity(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = float("nan")
    if not (0 <= out <= MAX_INTENSITY):
        raise ValidationFailed(
            f"intensity must lie in [0, {MAX_INTENSITY:g}]",
            details={"fields": {"intensity": [f"0..{MAX_INTENSITY:g}"]}},
        )
    return out


def _features(steering: Any, controls: Any, *, param: str = "steering") -> rules.FeatureSet:
    """A profile's strengths and controls from the wire, all or none.  The list form of
    ``steering`` (``[{index, strength}]``) may hold controls too (the inline /v1 shape)."""
    extra: list[FeatureControl] = []
    if isinstance(steering, list) and any(
        isinstance(item, Mapping) and set(item) - {"index", "strength"} for item in steering
    ):
        extra = rules.controls_parse(steering, param=param)
        steering = {}
    values = steering_map(steering, param=param)
    return rules.feature_set(values, [*extra, *rules.controls_parse(controls)], param="controls")


def _binding(sae_id: str | None, layer: int | None, values: Any) -> tuple[str, int | None]:
    """Where a profile's values apply: as given, else the only attachment (a profile with
    values must name one; an empty profile may stay unbound)."""
    if sae_id:
        if layer is None:
            rows = list(Attachment.objects.filter(sae_id=sae_id))
            if len(rows) == 1:
                layer = rows[0].layer
            else:
                raise ValidationFailed(
                    "layer is required with sae_id (the SAE is not attached at exactly one layer)",
                    details={"fields": {"layer": ["required"]}},
                )
        return sae_id, int(layer)
    if not values:
        return "", None
    attachment = live.attachment_choose(layer=layer)
    return attachment.sae_id, attachment.layer


# The fixed words of /api/profiles/<word> (steering/urls.py): a profile named one of them
# would be shadowed by its route, so no profile may take one.
ROUTE_WORDS = ("active", "import", "save-current")


def _name_problem(name: str) -> str | None:
    """Why ``name`` could not be reached as ``/api/profiles/{name}``, or None."""
    if ascii_int(name) is not None:
        return "a name of digits only reads as an id in /api/profiles/{id}"
    if name in ROUTE_WORDS:
        return f"{name!r} is a route of /api/profiles ({', '.join(ROUTE_WORDS)})"
    if "/" in name:
        return "a name with '/' cannot be a path segment of /api/profiles/{name}"
    if "@" in name:
        return "a name with '@' cannot be picked as /v1's model '<model>@<profile>'"
    return None


def _check_fits(sae_id: str, features: rules.FeatureSet, *, param: str = "steering") -> None:
    """Every index (and trigger) within the d_sae of the SAE a profile binds to, when that
    SAE is registered here; one that is not yet is checked when the profile activates."""
    if not sae_id or not features:
        return
    d_sae = SAE.objects.filter(pk=sae_id).values_list("d_sae", flat=True).first()
    if d_sae is not None:
        rules.check_features(sae_id=sae_id, d_sae=d_sae, features=features, param=param)


def _unique_name(name: str, *, exclude: int | None = None) -> str:
    name = (name or "").strip()
    if not name or len(name) > 200:
        raise ValidationFailed("name must be 1-200 characters", details={"fields": {"name": ["1-200 characters"]}})
    if problem := _name_problem(name):
        raise ValidationFailed(
            f"Profile name {name!r} is not allowed: {problem}", details={"name": name, "fields": {"name": [problem]}}
        )
    if Profile.objects.filter(name=name).exclude(pk=exclude).exists():
        raise ProfileAlreadyExists(f"A profile named {name!r} already exists", details={"name": name})
    return name


@audited(
    "profile.create",
    lambda kw, r: ("profile", getattr(r, "pk", ""), getattr(r, "name", "") or str(kw.get("name") or "")),
    params=kwargs_of("sae_id", "layer", "intensity"),
)
@transaction.atomic
def profile_create(
    *,
    name: str,
    steering: Any,
    controls: Any = None,
    sae_id: str | None = None,
    layer: int | None = None,
    model_name: str = "",
    description: str = "",
    intensity: float = 1.0,
) -> Profile:
    """Save a profile; strengths and control values are set directly, so they must lie in
    [-200, 200]."""
    features = _features(steering, controls)
    sae_id, layer = _binding(sae_id, layer, features.indices())
    _check_fits(sae_id, features)
    try:
        with transaction.atomic():
            return Profile.objects.create(
                name=_unique_name(name),
                sae_id=sae_id,
                layer=layer,
                steering=features.stored_values(),
                controls=features.stored_controls(),
                model_name=model_name or "",
                description=description or "",
                intensity=_intensity(intensity),
            )
    except IntegrityError:
        raise ProfileAlreadyExists(f"A profile named {name!r} already exists", details={"name": name}) from None


@audited("profile.update", of_kwarg("profile", "profile"))
@transaction.atomic
def profile_update(*, profile: Profile, data: Mapping[str, Any]) -> Profile:
    """Partial update; ``steering`` and ``controls``, when given, replace the map and the
    list. The live steering of an active profile is not changed: activate it again to
    apply."""
    profile = Profile.objects.select_for_update().get(pk=profile.pk)
    if "name" in data:
        profile.name = _unique_name(data["name"], exclude=profile.pk)
    if "description" in data:
        profile.description = data["description"] or ""
    if "model_id" in data or "model_name" in data:
        profile.model_name = data.get("model_id", data.get("model_name")) or ""
    if "intensity" in data:
        profile.intensity = _intensity(data["intensity"])
    features = _features(
        data["steering"] if "steering" in data else profile.steering,
        data["controls"] if "controls" in data else profile.controls,
    )
    profile.steering = features.stored_values()
    profile.controls = features.stored_controls()
    changed = "steering" in data or "controls" in data
    if "sae_id" in data or "layer" in data or (changed and not profile.sae_id):
        profile.sae_id, profile.layer = _binding(
            data.get("sae_id", profile.sae_id), data.get("layer", profile.layer), features.indices()
        )
    if changed or "sae_id" in data or "layer" in data:
        _check_fits(profile.sae_id, features)
    profile.save()
    return profile


@transaction.atomic
def profile_save_current(
    *, name: str, description: str = "", sae_id: str | None = None, layer: int | None = None
) -> Profile:
    """The live steering of one attachment, saved as a profile (with its SAE, layer and
    the loaded model)."""
    attachment = live.attachment_choose(sae_id=sae_id, layer=layer)
    state = live.live_state(attachment=attachment)
    return profile_create(
        name=name,
        steering=state["values"],
        controls=state["controls"],
        sae_id=attachment.sae_id,
        layer=attachment.layer,
        model_name=attachment.model.name,
        description=description,
    )


def profile_features(profile: Profile) -> rules.FeatureSet:
    """What a stored profile steers (PROFILE_INCOMPATIBLE when a row holds what the rules
    refuse, e.g. written around the services)."""
    try:
        return _features(profile.steering, profile.controls or [])
    except ValidationFailed as exc:
        raise ProfileIncompatible(
            f"Profile {profile.name!r} holds invalid steering: {exc.message}", details={"profile": profile.name}
        ) from None


@audited("profile.activate", of_kwarg("profile", "profile"), params=kwargs_of("intensity"))
def profile_activate(*, profile: Profile, intensity: float | None = None) -> Profile:
    """Make the profile the live steering (replacing all of it), validated first."""
    lam = profile.intensity if intensity is None else _intensity(intensity)
    features = profile_features(profile)
    entries: dict[Attachment, rules.FeatureSet] = {}
    if features:
        attachment = (
            Attachment.objects.select_related("sae", "model").filter(sae_id=profile.sae_id, layer=profile.layer).first()
        )
        if attachment is None:
            raise SAENotAttached(
                f"Profile {profile.name!r} steers SAE {profile.sae_id!r} at layer "
                f"{profile.layer}, which is not attached",
                details={
                    "profile": profile.name,
                    "sae_id": profile.sae_id,
                    "layer": profile.layer,
                    "choices": attachment_choices(Attachment.objects.all()),
                },
            )
        if profile.model_name and attachment.model.name != profile.model_name:
            raise ProfileIncompatible(
                f"Profile {profile.name!r} was made for model {profile.model_name!r}, not {attachment.model.name!r}",
                details={"profile": profile.name, "model": attachment.model.name},
            )
        live.check_features(attachment=attachment, features=features, param="steering")
        entries[attachment] = features.dialled(lam)
    with transaction.atomic():
        live.steering_lock()
        live.documents_deactivate(keep_profile=profile)
        live.live_replace_all(entries=entries, source=LiveSteering.Source.PROFILE)
        Profile.objects.filter(pk=profile.pk).update(is_active=True, intensity=lam, updated_at=timezone.now())
    profile.refresh_from_db()
    log.info("profile_activated", profile=profile.name, intensity=lam)
    return profile


@audited("profile.deactivate", of_kwarg("profile", "profile"), params=kwargs_of("clear_steering"))
def profile_deactivate(*, profile: Profile, clear_steering: bool = True) -> Profile:
    with transaction.atomic():
        live.steering_lock()
        was_active = Profile.objects.filter(pk=profile.pk, is_active=True).update(is_active=False)
        if was_active and clear_steering:
            live.live_replace_all(entries={}, source=LiveSteering.Source.MANUAL, reason="deactivate")
    profile.refresh_from_db()
    return profile


@audited("profile.delete", of_kwarg("profile", "profile"))
def profile_delete(*, profile: Profile) -> None:
    if profile.is_active:
        profile_deactivate(profile=profile)
    Profile.objects.filter(pk=profile.pk).delete()


# --------------------------------------------------------------------------- export/import


def _iso(value: datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")


def profile_export(*, profile: Profile) -> dict[str, Any]:
    out = {
        "version": PROFILE_VERSION,
        "name": profile.name,
        "description": profile.description,
        "model_id": profile.model_name or None,
        "sae_id": profile.sae_id or None,
        "layer": profile.layer,
        "steering": {str(k): float(v) for k, v in sorted(profile.steering.items(), key=lambda kv: int(kv[0]))},
    }
    if profile.controls:  # absent when empty: a profile without controls exports as before
        out["controls"] = list(profile.controls)
    return {
        **out,
        "intensity": profile.intensity,
        "created_at": _iso(profile.created_at),
        "updated_at": _iso(profile.updated_at),
    }


def _time(value: Any, param: str) -> datetime | None:
    if value in (None, ""):
        return None
    parsed = parse_datetime(str(value)) if isinstance(value, str) else None
    if parsed is None:
        raise ValidationFailed(
            f"{param} is not an ISO-8601 time", details={"fields": {param: ["not an ISO-8601 time"]}}
        )
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _text(value: Any, param: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValidationFailed(f"{param} must be a string", details={"fields": {param: ["not a string"]}})
    return value.strip() or None


def _document_sae(data: Mapping[str, Any], sae: Mapping[str, Any], layer: int | None) -> tuple[str | None, int | None]:
    """The SAE (and layer) an imported profile steers: its ``sae_id`` (this server's
    export, kept as written), else the original's ``sae`` object — ``{id, layer}`` or
    ``{repo_id, layer, file_path?}`` — resolved against the registered SAEs
    (``selectors.sae_for_reference``: SAE_NOT_FOUND when nothing matches)."""
    if sae_id := _text(data.get("sae_id"), "sae_id"):
        return sae_id, layer
    ref = _text(sae.get("id"), "sae.id") or _text(sae.get("sae_id"), "sae.sae_id")
    repo_id = _text(sae.get("repo_id"), "sae.repo_id")
    if not ref and not repo_id:
        return None, layer
    row = sae_for_reference(
        sae_id=ref,
        repo_id=None if ref else repo_id,
        layer=None if ref else layer,
        file_path=None if ref else _text(sae.get("file_path"), "sae.file_path"),
    )
    return row.id, layer if layer is not None else row.trained_on_layer


def _document_model(data: Mapping[str, Any], model: Mapping[str, Any]) -> str:
    """The registered model name an imported profile is made for: ``model_id`` (this
    server's export) or ``model.name`` as written, else the original's ``model.repo_id``
    resolved against the registered models; empty for any model."""
    if name := _text(data.get("model_id"), "model_id") or _text(model.get("name"), "model.name"):
        return name
    if repo_id := _text(model.get("repo_id"), "model.repo_id"):
        return model_for_repo(repo_id=repo_id, quantization=_text(model.get("quantization"), "model.quantization")).name
    return ""


def _free_name(name: str) -> str:
    base, n = name, 2
    while Profile.objects.filter(name=name).exists():
        name, n = f"{base} ({n})", n + 1
    return name


@audited(
    "profile.import",
    lambda kw, r: ("profile", getattr(r, "pk", ""), getattr(r, "name", "") or str(kw.get("name") or "")),
    params=kwargs_of("on_conflict"),
)
@transaction.atomic
def profile_import(*, document: Mapping[str, Any], on_conflict: str = "fail") -> Profile:
    """A profile from its export (or the ``features: [{index, strength}]`` form, or the
    original's export: ``model: {repo_id, quantization?}``, ``sae: {repo_id, layer,
    file_path?}`` or ``sae: {id, layer}``, resolved against the registry). Times are kept,
    so export → import → export gives the same document."""
    data = dict(document)
    refuse_cluster_as_profile(data)
    version = data.get("version", PROFILE_VERSION)
    if str(version) not in ("1", "1.0"):
        raise ValidationFailed(
            f"Unsupported profile version {version!r} (this server reads {PROFILE_VERSION})",
            details={"fields": {"version": ["unsupported"]}},
        )
    if "steering" in data and data["steering"] is not None:
        features = _features(data["steering"], data.get("controls"))
    elif "features" in data:
        features = _features(data["features"], data.get("controls"), param="features")
    else:
        features = _features({}, data.get("controls"))
    sae = data.get("sae") if isinstance(data.get("sae"), Mapping) else {}
    model = data.get("model") if isinstance(data.get("model"), Mapping) else {}
    layer = data.get("layer", sae.get("layer"))
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise ValidationFailed(
            "layer must be a non-negative integer", details={"fields": {"layer": ["non-negative integer"]}}
        )
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValidationFailed("name is required", details={"fields": {"name": ["required"]}})
    if on_conflict == "rename":
        name = _free_name(name.strip())
    sae_id, layer = _document_sae(data, sae, layer)
    if features and not sae_id:
        raise ValidationFailed(
            "A profile with steering values must name its SAE (sae_id, or an sae object with id or repo_id)",
            details={"fields": {"sae_id": ["required"]}},
        )
    model_name = _document_model(data, model)
    created, updated = _time(data.get("created_at"), "created_at"), _time(data.get("updated_at"), "updated_at")
    profile = profile_create(
        name=name,
        steering=features.values,
        controls=features.stored_controls(),
        sae_id=sae_id,
        layer=layer if sae_id else None,
        model_name=model_name,
        description=data.get("description") or "",
        intensity=data.get("intensity", 1.0) if data.get("intensity") is not None else 1.0,
    )
    stamps = {k: v for k, v in (("created_at", created), ("updated_at", updated)) if v}
    if stamps:
        # update() skips auto_now, so the document's own times are what the row keeps
        Profile.objects.filter(pk=profile.pk).update(**stamps)
        profile.refresh_from_db()
    return profile
