"""Circuit services: import (``mistudio.circuit-definition/v1``), activation across several
SAE attachments, the layer claims that keep circuits from silently summing on one layer,
one intensity λ across layers, export.

Activation, in order, with nothing changed until every check passed:
1. the evidence gate: a circuit below rung 2 (``causally validated (edge)``) activates only
   with ``acknowledge_unvalidated`` (else UNVALIDATED_CIRCUIT);
2. every referenced SAE must be registered and ready, its declared feature space must
   match and member indices fit (SAE_SET_INCOMPLETE / INCOMPATIBLE_FEATURE_SPACE /
   INVALID_FEATURE_INDEX);
3. layer claims: an active circuit already steering one of these layers refuses the
   activation with CIRCUIT_LAYER_CONTENTION — overridable with ``allow_layer_overlap``
   when the features differ, never when the same (layer, feature) would be steered twice;
4. ``orchestration.services.sae_attach_set`` attaches every member SAE, all or nothing;
5. one locked transaction makes the live steering the union of the active circuits.

A circuit's layers are claimed while it is active; the claims are derived from the active
circuits, so none can outlive a deactivation.

Members with a mode, phase, window or condition run as controls on their layer's
attachment (``documents.members_features``). Composition treats a control like a strength:
the same (layer, feature) from two circuits collides whatever the modes (never
overridable); different features compose, and every control of one attachment reads the
same residual — the one arriving at the hook, before any circuit's delta — so a clamp from
one circuit sets its feature's activation as read there, and another circuit's adds on the
same layer are added beside it, not before it.
"""

from __future__ import annotations

from typing import Any

import structlog
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.services import audited, kwargs_of, of_kwarg
from core.errors import (
    MillmError,
    ModelNotLoaded,
    ValidationFailed,
)
from core.ids import get_by_pk_or_name
from registry.models import SAE, Attachment, Model
from steering import live, rules
from steering.clusters import check_intensity
from steering.documents import (
    RUNG_LANGUAGE,
    VALIDATED_RUNG,
    Member,
    circuit_rung,
    document_text,
    members_features,
    validate_circuit,
)
from steering.errors import (
    AmbiguousActiveCircuit,
    CircuitLayerContention,
    DocumentNotFound,
    IncompatibleFeatureSpace,
    NoActiveCircuit,
    SAESetIncomplete,
    UnvalidatedCircuit,
)
from steering.models import Circuit, LiveSteering
from steering.names import check_name

log = structlog.get_logger(__name__)

HAZARD = {
    "note": "Deltas on one layer add up (x + Σ sᵢ·W_dec[i]); the ±200 clamp bounds "
    "each member, nothing bounds the sum. Two circuits composed on one layer "
    "can push the residual stream further than either was validated for."
}


class CircuitServing(MillmError):
    """A serving circuit's document cannot be replaced under it."""

    code, status = "CIRCUIT_SERVING", 409


class CircuitAlreadyExists(MillmError):
    code, status = "CIRCUIT_ALREADY_EXISTS", 409


def circuit_get(*, circuit_id: int | str) -> Circuit:
    try:
        return get_by_pk_or_name(Circuit.objects.all(), circuit_id)
    except Circuit.DoesNotExist:
        raise DocumentNotFound(f"Circuit {circuit_id!r} not found", details={"circuit_id": circuit_id}) from None


def rung_language(rung: int) -> str:
    return RUNG_LANGUAGE[rung]


def layer_members(circuit: Circuit) -> dict[int, list[Member]]:
    return {int(layer): [Member.model_validate(m) for m in members] for layer, members in circuit.members.items()}


def layer_values(circuit: Circuit, intensity: float | None = None) -> dict[int, rules.FeatureSet]:
    """Per layer, what the circuit steers at λ (one λ for every layer; sign rule; each
    value clamped to ±200; members with a mode or a gate as controls)."""
    lam = circuit.intensity if intensity is None else intensity
    return {layer: members_features(members, lam) for layer, members in layer_members(circuit).items()}


# --------------------------------------------------------------------------- import


def _free_name(name: str) -> str:
    base, n = name, 2
    while Circuit.objects.filter(name=name).exists():
        name, n = f"{base} ({n})", n + 1
    return name


@audited(
    "circuit.import",
    lambda kw, r: ("circuit", getattr(r, "pk", ""), getattr(r, "name", "")),
    params=kwargs_of("on_conflict"),
)
def circuit_import(*, document: dict[str, Any], text: str | None = None, on_conflict: str = "rename") -> Circuit:
    """Store a circuit definition. Import never activates: the evidence gate is always a
    separate, explicit step."""
    if on_conflict not in ("rename", "fail"):
        raise ValidationFailed(
            "on_conflict must be rename or fail", details={"fields": {"on_conflict": ["rename", "fail"]}}
        )
    definition, layers = validate_circuit(document)
    name = definition.name.strip()
    check_name(name, collection="circuits", what="Circuit")
    if Circuit.objects.filter(name=name).exists():
        if on_conflict == "fail":
            raise CircuitAlreadyExists(f"A circuit named {name!r} already exists", details={"name": name})
        name = _free_name(name)
    budget = definition.budget
    try:
        with transaction.atomic():
            circuit = Circuit.objects.create(
                name=name,
                narrative=definition.narrative or "",
                document=text if text is not None else document_text(document),
                saes=[s.row() for s in definition.saes],
                members={str(layer): [m.row() for m in members] for layer, members in sorted(layers.items())},
                edges_count=len(definition.edges),
                rung=circuit_rung(definition),
                intensity=budget.intensity if budget else 1.0,
                intensity_range=budget.intensity_range if budget else None,
            )
    except IntegrityError:
        raise CircuitAlreadyExists(f"A circuit named {name!r} already exists", details={"name": name}) from None
    log.info("circuit_imported", circuit=circuit.name, rung=circuit.rung)
    return circuit


@audited("circuit.replace", of_kwarg("circuit", "circuit"))
@transaction.atomic
def circuit_replace(*, circuit: Circuit, document: dict[str, Any], text: str | None = None) -> Circuit:
    """Replace a stored circuit's document in place: the same id, the new name, narrative,
    SAEs, members, edges and budget (the page's editor saves through this). A serving
    circuit is refused (its layers run the old members: deactivate it first); so is a name
    another circuit holds; a document that does not validate changes nothing."""
    circuit = Circuit.objects.select_for_update().get(pk=circuit.pk)
    if circuit.is_active:
        raise CircuitServing(
            f"Circuit {circuit.name!r} is serving: deactivate it before replacing its document",
            details={"circuit_id": circuit.pk},
        )
    definition, layers = validate_circuit(document)
    name = definition.name.strip()
    check_name(name, collection="circuits", what="Circuit")
    if Circuit.objects.filter(name=name).exclude(pk=circuit.pk).exists():
        raise CircuitAlreadyExists(f"A circuit named {name!r} already exists", details={"name": name})
    budget = definition.budget
    circuit.name = name
    circuit.narrative = definition.narrative or ""
    circuit.document = text if text is not None else document_text(document)
    circuit.saes = [s.row() for s in definition.saes]
    circuit.members = {str(layer): [m.row() for m in members] for layer, members in sorted(layers.items())}
    circuit.edges_count = len(definition.edges)
    circuit.rung = circuit_rung(definition)
    circuit.intensity = budget.intensity if budget else 1.0
    circuit.intensity_range = budget.intensity_range if budget else None
    circuit.save()
    log.info("circuit_replaced", circuit=circuit.name, id=circuit.pk, rung=circuit.rung)
    return circuit


# --------------------------------------------------------------------------- activation


def _resolve_sae(ref: dict[str, Any]) -> SAE | None:
    """The registered SAE a definition's reference names: its id here (or its name), or
    ``source_hint: "hf:<repo>/<path>"`` matching a downloaded SAE."""
    name = ref.get("ref")
    if name:
        sae = SAE.objects.filter(pk=name).first() or SAE.objects.filter(name=name).first()
        if sae is not None:
            return sae
    hint = (ref.get("source_hint") or "").strip()
    if hint.startswith("hf:"):
        parts = hint[3:].strip("/").split("/")
        if len(parts) >= 2:
            repo, path = "/".join(parts[:2]), "/".join(parts[2:])
            return SAE.objects.filter(repository_id=repo, file_path__in=(path, path + "/")).first()
    return None


def _member_saes(circuit: Circuit) -> list[tuple[SAE, int]]:
    members = layer_members(circuit)
    offenders: list[dict[str, Any]] = []
    items: list[tuple[SAE, int]] = []
    for ref in circuit.saes:
        layer = int(ref["layer"])
        features = members.get(layer, [])
        sae = _resolve_sae(ref)
        reason = None
        if sae is None:
            reason = "not registered on this server"
        elif sae.status not in (SAE.Status.READY, SAE.Status.ATTACHED) or not sae.local_path:
            reason = f"not ready to attach (status {sae.status})"
        if reason:
            offenders += [
                {"feature_idx": m.feature_idx, "layer": layer, "sae_id": ref.get("ref"), "reason": reason}
                for m in features
            ] or [{"feature_idx": None, "layer": layer, "sae_id": ref.get("ref"), "reason": reason}]
            continue
        if ref.get("n_features") and sae.d_sae and ref["n_features"] != sae.d_sae:
            raise IncompatibleFeatureSpace(
                f"Layer {layer}: the circuit declares {ref['n_features']} features; SAE {sae.id} has {sae.d_sae}",
                details={"layer": layer, "sae_id": sae.id, "n_features": ref["n_features"], "d_sae": sae.d_sae},
            )
        rules.check_indices(
            sae_id=sae.id, d_sae=sae.d_sae, param=f"layers.{layer}", indices=[i for m in features for i in m.indices()]
        )
        items.append((sae, layer))
    if offenders:
        raise SAESetIncomplete(
            f"{len({o['layer'] for o in offenders})} of the circuit's SAEs cannot be "
            "attached; the circuit is not served",
            details={"offenders": offenders},
        )
    return items


def _contention(circuit: Circuit, allow_layer_overlap: bool) -> list[int]:
    """Refuse a claim on a layer another active circuit steers; the composed layers when
    the override is given."""
    mine = {layer: set(f.indices()) for layer, f in layer_values(circuit).items()}
    incumbents, colliding, shared = [], [], set()
    for other in Circuit.objects.filter(is_active=True).exclude(pk=circuit.pk):
        theirs = {layer: set(f.indices()) for layer, f in layer_values(other).items()}
        layers = sorted(set(mine) & set(theirs))
        if not layers:
            continue
        shared.update(layers)
        incumbents.append({"circuit_id": other.pk, "circuit_name": other.name, "layers": layers})
        colliding += [
            {"layer": layer, "feature_idx": idx, "circuit_id": other.pk}
            for layer in layers
            for idx in sorted(mine[layer] & theirs[layer])
        ]
    if colliding:
        raise CircuitLayerContention(
            "The circuit would steer a (layer, feature) another active circuit steers; one "
            "strength would overwrite the other. This cannot be overridden.",
            details={"overridable": False, "incumbents": incumbents, "colliding_keys": colliding},
        )
    if incumbents and not allow_layer_overlap:
        raise CircuitLayerContention(
            f"Layers {sorted(shared)} are steered by another active circuit; re-send with "
            "allow_layer_overlap=true to compose onto them",
            details={
                "overridable": True,
                "override_param": "allow_layer_overlap",
                "incumbents": incumbents,
                "layers": sorted(shared),
                "measured_hazard": HAZARD,
            },
        )
    return sorted(shared)


def _attachments(serving: dict[str, str]) -> dict[int, Attachment]:
    rows = {(a.sae_id, a.layer): a for a in Attachment.objects.select_related("sae")}
    return {int(layer): rows[(sae_id, int(layer))] for layer, sae_id in serving.items() if (sae_id, int(layer)) in rows}


def _union(circuits: list[Circuit]) -> dict[Attachment, rules.FeatureSet]:
    """Per attachment, the active circuits' features together (contention keeps every
    (layer, feature) to one circuit)."""
    entries: dict[Attachment, rules.FeatureSet] = {}
    for c in circuits:
        values = layer_values(c)
        for layer, attachment in _attachments(c.serving).items():
            entries[attachment] = entries.get(attachment, rules.FeatureSet()).merged(
                values.get(layer, rules.FeatureSet())
            )
    return entries


def _gate(circuit: Circuit, acknowledge_unvalidated: bool) -> None:
    if circuit.rung < VALIDATED_RUNG and not acknowledge_unvalidated:
        raise UnvalidatedCircuit(
            f"Circuit {circuit.name!r} is at rung {circuit.rung} "
            f"({rung_language(circuit.rung)}); activating it needs "
            "acknowledge_unvalidated=true",
            details={
                "rung": circuit.rung,
                "rung_language": rung_language(circuit.rung),
                "param": "acknowledge_unvalidated",
            },
        )


def circuit_activation_plan(
    *, circuit: Circuit, acknowledge_unvalidated: bool = False, allow_layer_overlap: bool = False, intensity: Any = None
) -> tuple[list[tuple[SAE, int]], float]:
    """Checks 1–3 of an activation, nothing changed: the (SAE, layer) pairs to attach and
    the intensity λ. ``orchestration.services.circuit_activate`` attaches them and then
    calls ``circuit_mark_active``."""
    _gate(circuit, acknowledge_unvalidated)
    lam = circuit.intensity if intensity is None else check_intensity(intensity, circuit.intensity_range)
    if not Model.objects.filter(status=Model.Status.LOADED).exists():
        raise ModelNotLoaded("No model is loaded; a circuit steers the loaded model")
    items = _member_saes(circuit)
    _contention(circuit, allow_layer_overlap)
    return items, lam


def circuit_set_incomplete(items: list[tuple[SAE, int]], exc: MillmError) -> SAESetIncomplete:
    """The refusal when the member SAEs could not all be attached."""
    return SAESetIncomplete(
        f"The circuit's SAEs could not all be attached: {exc.message}",
        details={"offenders": [{"layer": layer, "sae_id": sae.id, "reason": exc.message} for sae, layer in items]},
    )


def circuit_mark_active(
    *, circuit: Circuit, items: list[tuple[SAE, int]], intensity: float, allow_layer_overlap: bool = False
) -> Circuit:
    """Step 5, once the member SAEs are attached: the circuit is active and the live
    steering is the union of the active circuits, in one locked transaction."""
    lam = intensity
    serving = {str(layer): sae.id for sae, layer in items}
    with transaction.atomic():
        live.steering_lock()
        composed = _contention(circuit, allow_layer_overlap)  # again, under the lock
        live.documents_deactivate(keep_circuits=True)
        Circuit.objects.filter(pk=circuit.pk).update(
            is_active=True, serving=serving, composed_layers=composed, intensity=lam, updated_at=timezone.now()
        )
        for other in Circuit.objects.filter(is_active=True).exclude(pk=circuit.pk):
            shared = sorted(set(other.composed_layers) | ({int(k) for k in other.serving} & set(composed)))
            Circuit.objects.filter(pk=other.pk).update(composed_layers=shared)
        active = list(Circuit.objects.filter(is_active=True))
        live.live_replace_all(entries=_union(active), source=LiveSteering.Source.CIRCUIT)
    circuit.refresh_from_db()
    log.info("circuit_activated", circuit=circuit.name, rung=circuit.rung, intensity=lam, composed_layers=composed)
    return circuit


def _reapply(circuit_attachments: dict[int, Attachment]) -> None:
    """Set the live steering of these attachments to what the active circuits steer there
    (nothing, if none). Inside the locked transaction."""
    union = _union(list(Circuit.objects.filter(is_active=True)))
    for attachment in circuit_attachments.values():
        values = union.get(attachment, rules.FeatureSet())
        existing = LiveSteering.objects.filter(attachment=attachment, scope=live.GLOBAL)
        if values:
            live._save(attachment, values, enabled=True, source=LiveSteering.Source.CIRCUIT)
        else:
            existing.delete()
        live._on_commit_publish(attachment, reason="circuit")


@audited("circuit.deactivate", of_kwarg("circuit", "circuit"))
def circuit_deactivate(*, circuit: Circuit) -> Circuit:
    """Stop serving: release the layer claims and remove the circuit's values from the
    live steering (other circuits on the same layers keep theirs)."""
    with transaction.atomic():
        live.steering_lock()
        circuit = Circuit.objects.get(pk=circuit.pk)
        if circuit.is_active:
            attachments = _attachments(circuit.serving)
            Circuit.objects.filter(pk=circuit.pk).update(is_active=False, serving={}, composed_layers=[])
            for other in Circuit.objects.filter(is_active=True):
                still = sorted(set(other.composed_layers) & set(_shared_with_others(other)))
                Circuit.objects.filter(pk=other.pk).update(composed_layers=still)
            _reapply(attachments)
    circuit.refresh_from_db()
    return circuit


def _shared_with_others(circuit: Circuit) -> list[int]:
    mine = {int(k) for k in circuit.serving}
    others = set()
    for other in Circuit.objects.filter(is_active=True).exclude(pk=circuit.pk):
        others |= {int(k) for k in other.serving}
    return sorted(mine & others)


@audited(
    "circuit.intensity",
    of_kwarg("circuit", "circuit"),
    params=kwargs_of("intensity", "reapply", "acknowledge_unvalidated"),
)
def circuit_set_intensity(
    *, circuit: Circuit, intensity: Any, reapply: bool = True, acknowledge_unvalidated: bool = False
) -> tuple[Circuit, bool]:
    """One λ for every layer. An active circuit re-applies at once — and re-passes the
    evidence gate, since a stronger dial is a new decision to serve it."""
    lam = check_intensity(intensity, circuit.intensity_range)
    if circuit.is_active and reapply:
        _gate(circuit, acknowledge_unvalidated)
    with transaction.atomic():
        live.steering_lock()
        circuit = Circuit.objects.get(pk=circuit.pk)
        Circuit.objects.filter(pk=circuit.pk).update(intensity=lam, updated_at=timezone.now())
        reapplied = False
        if circuit.is_active and reapply:
            _reapply(_attachments(circuit.serving))
            reapplied = True
    circuit.refresh_from_db()
    return circuit, reapplied


def circuits_active() -> list[Circuit]:
    return list(Circuit.objects.filter(is_active=True).order_by("name"))


def circuit_set_active_intensity(
    *, intensity: Any, reapply: bool = True, acknowledge_unvalidated: bool = False
) -> tuple[Circuit, bool]:
    active = circuits_active()
    if not active:
        raise NoActiveCircuit("No circuit is active", details={})
    if len(active) > 1:
        raise AmbiguousActiveCircuit(
            "Several circuits are serving, so there is no single active circuit to dial",
            details={"active_circuits": [{"id": c.pk, "name": c.name} for c in active]},
        )
    return circuit_set_intensity(
        circuit=active[0], intensity=intensity, reapply=reapply, acknowledge_unvalidated=acknowledge_unvalidated
    )


def circuit_claims() -> list[dict[str, Any]]:
    """Who holds which layer: one row per (layer, active circuit)."""
    rows = []
    for circuit in circuits_active():
        values = layer_values(circuit)
        for layer in sorted(int(k) for k in circuit.serving):
            rows.append(
                {
                    "layer": layer,
                    "circuit_id": circuit.pk,
                    "circuit_name": circuit.name,
                    "sae_id": circuit.serving[str(layer)],
                    "composed": layer in circuit.composed_layers,
                    "steering_keys": sorted(values.get(layer, rules.FeatureSet()).indices()),
                }
            )
    return sorted(rows, key=lambda r: (r["layer"], r["circuit_id"]))


@audited("circuit.delete", of_kwarg("circuit", "circuit"))
def circuit_delete(*, circuit: Circuit) -> None:
    if circuit.is_active:
        circuit_deactivate(circuit=circuit)
    Circuit.objects.filter(pk=circuit.pk).delete()
