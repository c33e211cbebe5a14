"""Live steering: what runs on /v1 requests that bring no steering of their own.

Live steering belongs to a scope (docs/steering.md, Scopes): ``global`` (what admin keys
set; with keys off the only one) or ``key:<label>``, one key's own. A /v1 request without
steering of its own runs its key's scope when that scope holds live steering, else the
global one; a batch runs its owner's scope as it was at creation (``scope_snapshot``).
Profiles, clusters and circuits activate into the global scope.

One ``LiveSteering`` row per attachment and scope (values, controls + enabled), in the database so that every
web worker resolves the same default and a restart keeps it. Every change takes the
``SteeringState`` row lock first, so changes from several workers apply one at a time,
and publishes ``steering:update``. Requests resolve their spec when they are planned, so a
change applies to every generation planned after it commits (in this process; other web
workers see it within ``core.process_copy.FRESH_S``); a generation already running keeps the
spec it started with (its tokens stay attributable to one spec).

Rules (SPEC §3, the original's contract): values set directly lie in [-200, 200] (refused
otherwise, by the input serializers and again here); indices are checked against the SAE's
d_sae (INVALID_FEATURE_INDEX); setting a value enables steering; removing the last value
or clearing disables it, so the reported ``enabled`` is what runs. A feature may instead be
a control (a mode, phase, window or condition: ``rules.controls_parse``), kept in the row's
``controls`` beside the plain ``values``; an index is in one or the other, never both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import structlog
from django.db import transaction

from audit.services import audited
from core import events
from core.auth import keys_enabled
from core.capabilities import require_capability
from core.engines import several_engines
from core.errors import ValidationFailed
from core.process_copy import ProcessCopy
from gpu_engine.api.protocol import FeatureControl, SteeringEntry
from registry.engines import addressing_model
from registry.models import Attachment
from steering import rules
from steering.models import Circuit, Cluster, LiveSteering, Profile, SteeringState
from steering.selectors import attachment_pick

log = structlog.get_logger(__name__)

MAX_BATCH = 1000
GLOBAL = "global"


# --------------------------------------------------------------------------- reads


def attachment_choose(*, sae_id: str | None = None, layer: int | None = None, param: str = "sae_id") -> Attachment:
    """The attachment row a management call acts on (``attachment_pick``'s rule)."""
    rows = list(Attachment.objects.select_related("sae", "model").order_by("layer", "sae_id"))
    return attachment_pick(attachments=rows, sae_id=sae_id, layer=layer, param=param)


def values_out(values: Mapping[str, float]) -> dict[str, float]:
    return {str(k): float(values[k]) for k in sorted(values, key=int)}


def row_features(row: LiveSteering | None) -> rules.FeatureSet:
    """A row's values and controls (written through the rules, so read as stored)."""
    if row is None:
        return rules.FeatureSet()
    return rules.FeatureSet({int(k): float(v) for k, v in row.values.items()}, rules.controls_parse(row.controls or []))


def _state(attachment: Attachment, row: LiveSteering | None, scope: str = GLOBAL) -> dict[str, Any]:
    features = row_features(row)
    enabled = bool(row and row.enabled and features)
    state = {
        "sae_id": attachment.sae_id,
        "layer": attachment.layer,
        "enabled": enabled,
        "values": values_out(row.values) if row else {},
        "controls": features.stored_controls(),
        "active_count": len(features.indices()) if row and row.enabled else 0,
        "source": row.source if row else LiveSteering.Source.MANUAL,
    }
    if scope != GLOBAL:  # the global scope's answer is what it was before scopes
        state["scope"] = scope
    return state


def _row(attachment: Attachment, scope: str) -> LiveSteering | None:
    return LiveSteering.objects.filter(attachment=attachment, scope=scope).first()


def live_state(*, attachment: Attachment, scope: str = GLOBAL) -> dict[str, Any]:
    return _state(attachment, _row(attachment, scope), scope)


def live_rows(scope: str | None = GLOBAL) -> list[LiveSteering]:
    """Every attachment's live steering that runs (enabled, with values or controls), in
    ``scope`` (None: every scope)."""
    rows = LiveSteering.objects.select_related("attachment").filter(enabled=True)
    if scope is not None:
        rows = rows.filter(scope=scope)
    return [r for r in rows.order_by("scope", "attachment__layer", "attachment__sae_id") if r.values or r.controls]


class LiveEntries(list):
    """The live steering, one ``SteeringEntry`` per attachment, and — when serving circuits
    set every running row — those circuits as ``(id, λ)`` (``X-miLLM-Steering``'s
    ``circuit;id=…;intensity=…`` form)."""

    circuits: tuple[tuple[int, float], ...] = ()


class LiveScopes(LiveEntries):
    """Every scope's running live steering: the global one's entries (the list itself, as
    before scopes) and ``keys``, ``{"key:<label>": LiveEntries}`` for keys' scopes that
    hold any."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.keys: dict[str, LiveEntries] = {}

    def pick(self, scope: str | None) -> tuple[str, LiveEntries]:
        """The scope a request of ``scope`` (``key:<label>``; None: no key) runs: its own
        when it holds live steering, else the global one."""
        if scope is not None and scope != GLOBAL and self.keys.get(scope):
            return scope, self.keys[scope]
        return GLOBAL, self


def _entries(rows: list[LiveSteering]) -> LiveEntries:
    return LiveEntries(SteeringEntry(r.attachment.sae_id, r.attachment.layer, *_values_controls(r)) for r in rows)


def _read_live_entries() -> LiveScopes:
    by_scope: dict[str, list[LiveSteering]] = {}
    for r in live_rows(scope=None):
        by_scope.setdefault(r.scope, []).append(r)
    rows = by_scope.pop(GLOBAL, [])
    out = LiveScopes(_entries(rows))
    out.keys = {scope: _entries(scoped) for scope, scoped in by_scope.items()}
    if rows and all(r.source == LiveSteering.Source.CIRCUIT for r in rows):
        out.circuits = tuple((c.pk, float(c.intensity)) for c in Circuit.objects.filter(is_active=True).order_by("pk"))
    return out


def _values_controls(row: LiveSteering) -> tuple[dict[int, float], list[FeatureControl]]:
    features = row_features(row)
    return features.values, features.controls


# The live steering every /v1 request without its own runs, per scope one SteeringEntry
# (values and controls) per attachment, kept in this process (core.process_copy): resolving
# a request's scope is a dict lookup; every change takes steering_lock(), which drops the
# copy when its transaction commits.
live_copy: ProcessCopy[LiveScopes] = ProcessCopy(_read_live_entries)


def live_values() -> LiveScopes:
    """The live steering that runs, every scope, read from the database (and kept in ``live_copy``)."""
    return live_copy.read()


def key_scope(owner: str | None) -> str | None:
    """The live-steering scope of a caller (``Principal.owner`` / ``Scope.owner``): its
    ``key:<label>`` with keys on, None with keys off (everything is global then)."""
    if owner and owner.startswith("key:") and keys_enabled():
        return owner
    return None


def scope_snapshot(owner: str | None) -> dict[str, Any] | None:
    """What a batch created now by ``owner`` runs on lines without steering of their own
    (kept with the batch): its key's scope as it is now (``entries`` empty: unsteered).
    None with keys off: the global live steering, as of each line, as before scopes."""
    scope = key_scope(owner)
    if scope is None:
        return None
    entries = [
        {
            "sae_id": r.attachment.sae_id,
            "layer": r.attachment.layer,
            "values": dict(r.values),
            "controls": list(r.controls or []),
        }
        for r in live_rows(scope)
    ]
    return {"scope": scope, "entries": entries}


def snapshot_scopes(snapshot: dict[str, Any]) -> LiveScopes:
    """A batch's snapshot as the ``LiveScopes`` its lines resolve against: only its key's
    scope (never the global one)."""
    out = LiveScopes()
    entries = LiveEntries()
    for e in snapshot.get("entries") or []:
        features = rules.FeatureSet(
            {int(k): float(v) for k, v in (e.get("values") or {}).items()},
            rules.controls_parse(e.get("controls") or []),
        )
        entries.append(SteeringEntry(e["sae_id"], int(e["layer"]), features.values, features.controls))
    if entries:
        out.keys[snapshot["scope"]] = entries
    return out


# --------------------------------------------------------------------------- checks


def check_indices(*, attachment: Attachment, indices: Iterable[int], param: str) -> None:
    """``rules.check_indices`` against an attachment row's SAE."""
    rules.check_indices(sae_id=attachment.sae_id, d_sae=attachment.sae.d_sae, indices=indices, param=param)


def check_features(
    *, attachment: Attachment, features: rules.FeatureSet, param: str, trigger_param: str | None = None
) -> None:
    """``rules.check_features`` (indices and triggers) against an attachment row's SAE,
    and controls against what the loaded backend can run."""
    rules.check_features(
        sae_id=attachment.sae_id,
        d_sae=attachment.sae.d_sae,
        features=features,
        param=param,
        trigger_param=trigger_param,
    )
    if features.controls:
        check_backend_runs_controls()


def check_backend_runs_controls() -> None:
    """Refuse controls the loaded backend reports it cannot run (llama.cpp and vLLM:
    ``steering_controls`` off) when they are set, rather than failing every request that
    would run them later."""
    require_capability("steering_controls", what="steering modes, phases, windows or conditions", param="mode")


# --------------------------------------------------------------------------- writes


def steering_lock() -> SteeringState:
    """Serialise live-steering changes across workers (call inside a transaction)."""
    state, _ = SteeringState.objects.select_for_update().get_or_create(pk=1)
    SteeringState.objects.filter(pk=1).update(version=state.version + 1)
    transaction.on_commit(live_copy.invalidate)
    return state


def publish_update(state: dict[str, Any], *, reason: str, scope: str = GLOBAL) -> None:
    """``steering:update``; a key's scope goes only to that key's sockets and admins."""
    data = {**state, "reason": reason}
    if scope != GLOBAL:
        data[events.OWNER_FIELD] = scope  # a key scope is its key's owner name
    events.publish("steering:update", data)


def _publish(attachment: Attachment, row: LiveSteering | None, *, reason: str, scope: str = GLOBAL) -> None:
    state = _state(attachment, row, scope)
    if not state["enabled"]:
        state["active_count"] = 0
    publish_update(state, reason=reason, scope=scope)


def _on_commit_publish(attachment: Attachment, *, reason: str, scope: str = GLOBAL) -> None:
    def send() -> None:
        _publish(attachment, _row(attachment, scope), reason=reason, scope=scope)

    transaction.on_commit(send)


def _save(
    attachment: Attachment, features: rules.FeatureSet, *, enabled: bool, source: str, scope: str = GLOBAL
) -> LiveSteering:
    if enabled and features:  # what every request without steering of its own will run
        # asked of the engine that holds the attachment's model (several engines)
        with addressing_model(attachment.model.name if several_engines() else None):
            require_capability("per_request_steering", what="steering", param="steering")
    row, _ = LiveSteering.objects.update_or_create(
        attachment=attachment,
        scope=scope,
        defaults={
            "values": features.stored_values(),
            "controls": features.stored_controls(),
            "enabled": bool(enabled and features),
            "source": source,
        },
    )
    return row


def _attachment(kwargs: dict[str, Any], _result: Any) -> tuple[str, Any, str]:
    row = kwargs.get("attachment")
    scope = kwargs.get("scope") or GLOBAL
    return ("attachment", f"{getattr(row, 'sae_id', '')}@{getattr(row, 'layer', '')}", "" if scope == GLOBAL else scope)


@audited(
    "steering.set",
    _attachment,
    params=lambda kw: {
        "values": {str(k): v for k, v in dict(kw.get("values") or {}).items()},
        "controls": len(list(kw.get("controls") or ())),
    },
)
@transaction.atomic
def live_set(
    *,
    attachment: Attachment,
    values: Mapping[int, float],
    controls: Iterable[FeatureControl] = (),
    source: str = LiveSteering.Source.MANUAL,
    scope: str = GLOBAL,
) -> dict[str, Any]:
    """Set feature values and controls (each replacing what the attachment's live steering
    had for that index) and enable steering. All or nothing: one bad index, value or
    control refuses the whole call."""
    controls = list(controls)
    if len(values) + len(controls) > MAX_BATCH:
        raise ValidationFailed(
            f"At most {MAX_BATCH} features per call (got {len(values) + len(controls)})",
            details={"fields": {"steering": [f"at most {MAX_BATCH}"]}},
        )
    values = rules.check_direct(values, "steering")
    given = rules.feature_set(values, controls, param="controls")
    check_features(attachment=attachment, features=given, param="feature_idx", trigger_param="condition.feature")
    steering_lock()
    row = _row(attachment, scope)
    _save(attachment, row_features(row).merged(given), enabled=True, source=source, scope=scope)
    _on_commit_publish(attachment, reason="set", scope=scope)
    return live_state(attachment=attachment, scope=scope)


@audited("steering.remove", _attachment, params=lambda kw: {"index": kw.get("index")})
@transaction.atomic
def live_remove(*, attachment: Attachment, index: int, scope: str = GLOBAL) -> dict[str, Any]:
    """Remove one feature (a value or a control); removing the last one disables."""
    steering_lock()
    row = _row(attachment, scope)
    features = row_features(row)
    if row is not None and index in features.indices():
        _save(attachment, features.without(index), enabled=row.enabled, source=row.source, scope=scope)
        _on_commit_publish(attachment, reason="remove", scope=scope)
    return live_state(attachment=attachment, scope=scope)


@audited("steering.clear", _attachment)
@transaction.atomic
def live_clear(*, attachment: Attachment, scope: str = GLOBAL) -> dict[str, Any]:
    """Remove every value and control, and disable."""
    steering_lock()
    _save(attachment, rules.FeatureSet(), enabled=False, source=LiveSteering.Source.MANUAL, scope=scope)
    _on_commit_publish(attachment, reason="clear", scope=scope)
    return live_state(attachment=attachment, scope=scope)


@audited("steering.enable", _attachment, params=lambda kw: {"enabled": kw.get("enabled")})
@transaction.atomic
def live_enable(*, attachment: Attachment, enabled: bool, scope: str = GLOBAL) -> dict[str, Any]:
    """Apply (or stop applying) the configured values; with no values nothing runs, so
    steering stays reported disabled."""
    steering_lock()
    row = _row(attachment, scope)
    source = row.source if row else LiveSteering.Source.MANUAL
    _save(attachment, row_features(row), enabled=enabled, source=source, scope=scope)
    _on_commit_publish(attachment, reason="enable" if enabled else "disable", scope=scope)
    return live_state(attachment=attachment, scope=scope)


def live_replace_all(
    *,
    entries: Mapping[Attachment, rules.FeatureSet],
    source: str,
    keep: Iterable[Attachment] = (),
    reason: str = "activate",
) -> None:
    """Make ``entries`` the whole global live steering (every other attachment cleared,
    except those in ``keep``; keys' own scopes untouched). Call inside a transaction holding
    ``steering_lock``; values and controls are already validated (and dialled)."""
    keep_ids = {a.pk for a in keep}
    touched: list[Attachment] = []
    for row in (
        LiveSteering.objects.select_related("attachment")
        .filter(scope=GLOBAL)
        .exclude(attachment_id__in=[a.pk for a in entries] + list(keep_ids))
    ):
        if row.values or row.controls or row.enabled:
            touched.append(row.attachment)
        row.delete()
    for attachment, features in entries.items():
        _save(attachment, features, enabled=True, source=source)
        touched.append(attachment)
    for attachment in touched:
        _on_commit_publish(attachment, reason=reason)


def documents_deactivate(
    *, keep_profile: Profile | None = None, keep_cluster: Cluster | None = None, keep_circuits: bool = False
) -> None:
    """One active steering configuration at a time: a profile or cluster activation ends
    every other profile, cluster and circuit (circuits may share the live steering among
    themselves). Inside the locked transaction."""
    Profile.objects.filter(is_active=True).exclude(pk=keep_profile.pk if keep_profile else None).update(is_active=False)
    Cluster.objects.filter(is_active=True).exclude(pk=keep_cluster.pk if keep_cluster else None).update(is_active=False)
    if not keep_circuits:
        Circuit.objects.filter(is_active=True).update(is_active=False, serving={}, composed_layers=[])
