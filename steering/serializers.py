"""Wire shapes of the steering routes: input validation and the output fields. No logic:
views call services and selectors, ``*_out`` functions only arrange what they return."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rest_framework import serializers

from core.schema import MAX_INDEX, MAX_LAYER
from registry.labels import labels_for, labels_for_many
from steering.documents import RUNG_LANGUAGE
from steering.models import Circuit, Cluster, Profile
from steering.rules import strength_problem


def _iso(value) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


class JSONIntegerField(serializers.IntegerField):
    """A whole number sent as a JSON number: DRF's field also reads ``true`` as 1 and
    ``"1"`` as 1, which a JSON body only sends by mistake. (Query strings, where every
    value is text, keep the plain field.)"""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, (bool, str)):
            self.fail("invalid")
        return super().to_internal_value(data)


class JSONFloatField(serializers.FloatField):
    """A number sent as a JSON number (not ``true`` nor ``"5"``, which DRF reads as 1.0
    and 5.0)."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, (bool, str)):
            self.fail("invalid")
        return super().to_internal_value(data)


class TargetInput(serializers.Serializer):
    """The attachment a live-steering call acts on (else the only one attached)."""

    sae_id = serializers.CharField(required=False, allow_null=True, max_length=40)
    layer = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_LAYER)


def _strength(value: float) -> None:
    """The one rule for values set directly (steering.rules)."""
    problem = strength_problem(value)
    if problem:
        raise serializers.ValidationError(problem)


class ScopedTargetInput(TargetInput):
    """A live-steering call's attachment and scope (docs/steering.md, Scopes)."""

    scope = serializers.CharField(
        required=False,
        allow_null=True,
        max_length=80,
        help_text="`global` (default) or `key:<label>`; an inference key may name only its own",
    )


class SteeringSetInput(ScopedTargetInput):
    """One feature: ``{feature_idx, value}`` adds everywhere (the original shape); ``mode``
    and the gates make it a control (checked by ``steering.rules.control_parse``)."""

    feature_idx = JSONIntegerField(min_value=0, max_value=MAX_INDEX)
    value = JSONFloatField(
        required=False,
        allow_null=True,
        validators=[_strength],
        help_text="the strength (add), target activation (clamp) or factor (scale); none for ablate",
    )
    mode = serializers.CharField(required=False, help_text="add (default) | clamp | scale | ablate")
    phase = serializers.CharField(required=False, help_text="all (default) | prompt | completion")
    window = serializers.JSONField(required=False, help_text="{start, end?}: row positions")
    condition = serializers.JSONField(required=False, help_text="{feature, threshold}: only where the trigger is above")


class SteeringBatchInput(ScopedTargetInput):
    steering = serializers.DictField(
        child=serializers.JSONField(),
        required=False,
        default=dict,
        help_text='{"<index>": value}, at most 1000, all or none',
    )
    controls = serializers.JSONField(
        required=False,
        default=list,
        help_text="[{index, mode, value, phase, window, condition}], with steering at most 1000",
    )


class SteeringStateOutput(serializers.Serializer):
    sae_id = serializers.CharField(allow_null=True)
    layer = serializers.IntegerField(allow_null=True)
    enabled = serializers.BooleanField()
    values = serializers.DictField(child=serializers.FloatField())
    controls = serializers.ListField(child=serializers.DictField())
    active_count = serializers.IntegerField()
    source = serializers.CharField()
    scope = serializers.CharField(required=False, help_text="present for a key's scope only (`key:<label>`)")


class ProfileInput(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    description = serializers.CharField(required=False, allow_blank=True, allow_null=True)
    steering = serializers.JSONField(required=False, default=dict)
    controls = serializers.JSONField(
        required=False, default=list, help_text="[{index, mode, value, phase, window, condition}]"
    )
    sae_id = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=40)
    layer = JSONIntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_LAYER)
    model_id = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=200)
    intensity = JSONFloatField(required=False, min_value=0, max_value=2, default=1.0)


class ProfileUpdateInput(serializers.Serializer):
    name = serializers.CharField(required=False, max_length=200)
    description = serializers.CharField(required=False, allow_blank=True, allow_null=True)
    steering = serializers.JSONField(required=False)
    controls = serializers.JSONField(required=False)
    sae_id = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=40)
    layer = JSONIntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_LAYER)
    model_id = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=200)
    intensity = JSONFloatField(required=False, min_value=0, max_value=2)


class SaveCurrentInput(TargetInput):
    name = serializers.CharField(max_length=200)
    description = serializers.CharField(required=False, allow_blank=True, default="")


class IntensityInput(serializers.Serializer):
    intensity = serializers.FloatField(required=False, allow_null=True)


class ActivateInput(IntensityInput):
    sae_id = serializers.CharField(required=False, allow_null=True, max_length=40)
    layer = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_LAYER)


class DialInput(serializers.Serializer):
    intensity = serializers.FloatField()
    reapply = serializers.BooleanField(required=False, default=True)
    acknowledge_unvalidated = serializers.BooleanField(required=False, default=False)


class CircuitActivateInput(IntensityInput):
    acknowledge_unvalidated = serializers.BooleanField(required=False, default=False)
    allow_layer_overlap = serializers.BooleanField(required=False, default=False)


class ImportQuery(serializers.Serializer):
    on_conflict = serializers.ChoiceField(choices=["rename", "fail"], required=False)
    activate = serializers.BooleanField(required=False, default=False)


class ClusterUpdateInput(serializers.Serializer):
    name = serializers.CharField(required=False, max_length=200)
    narrative = serializers.CharField(required=False, allow_blank=True)


def profile_out(profile: Profile) -> dict[str, Any]:
    return {
        "id": profile.pk,
        "name": profile.name,
        "description": profile.description,
        "model_id": profile.model_name or None,
        "sae_id": profile.sae_id or None,
        "layer": profile.layer,
        "steering": {str(k): float(v) for k, v in sorted(profile.steering.items(), key=lambda kv: int(kv[0]))},
        "controls": list(profile.controls or []),
        "intensity": profile.intensity,
        "is_active": profile.is_active,
        "source_kind": "manual",
        "created_at": _iso(profile.created_at),
        "updated_at": _iso(profile.updated_at),
    }


def cluster_out(cluster: Cluster, *, full: bool = False) -> dict[str, Any]:
    out = {
        "id": cluster.pk,
        "name": cluster.name,
        "narrative": cluster.narrative,
        "source_kind": "cluster",
        "model_ref": cluster.model_ref or None,
        "declared_sae": cluster.sae_ref,
        "n_features": cluster.n_features,
        "bound": bool(cluster.sae_id),
        "sae_id": cluster.sae_id or None,
        "layer": cluster.layer,
        "unbound_reason": cluster.unbound_reason or None,
        "warnings": cluster.warnings,
        "intensity": cluster.intensity,
        "intensity_range": cluster.intensity_range,
        "is_active": cluster.is_active,
        "member_count": len(cluster.members),
        "members": [[m["feature_idx"], m.get("label"), m["strength"]] for m in cluster.members[:20]],
        "created_at": _iso(cluster.created_at),
        "updated_at": _iso(cluster.updated_at),
    }
    if full:
        out["member_details"] = cluster.members
    return out


def circuit_out(circuit: Circuit, *, full: bool = False) -> dict[str, Any]:
    layers = sorted(int(k) for k in circuit.members)
    out = {
        "id": circuit.pk,
        "name": circuit.name,
        "narrative": circuit.narrative,
        "rung": circuit.rung,
        "rung_language": RUNG_LANGUAGE[circuit.rung],
        "layers": layers,
        "saes": circuit.saes,
        "edge_count": circuit.edges_count,
        "member_count": sum(len(v) for v in circuit.members.values()),
        "intensity": circuit.intensity,
        "intensity_range": circuit.intensity_range,
        "is_active": circuit.is_active,
        "serving_mode": "full" if circuit.is_active else None,
        "serving": {str(k): v for k, v in sorted(circuit.serving.items(), key=lambda kv: int(kv[0]))},
        "composed_layers": circuit.composed_layers,
        "created_at": _iso(circuit.created_at),
        "updated_at": _iso(circuit.updated_at),
    }
    if full:
        out["members"] = circuit.members
    return out


def labels_map(sae_id: str | None, indices: Iterable[Any]) -> dict[str, str]:
    """``{"<index>": label}`` of the features a detail answer lists that have a label
    (``registry.labels``: one query), for the SAE they belong to; {} without one."""
    if not sae_id:
        return {}
    wanted = [int(i) for i in indices if str(i).isdigit()]
    return {str(i): label for i, label in sorted(labels_for(sae_id, wanted).items())} if wanted else {}


def profile_detail_out(profile: Profile) -> dict[str, Any]:
    out = profile_out(profile)
    out["labels"] = labels_map(profile.sae_id, profile.steering.keys())
    return out


def cluster_detail_out(cluster: Cluster) -> dict[str, Any]:
    out = cluster_out(cluster, full=True)
    out["labels"] = labels_map(cluster.sae_id, (m.get("feature_idx") for m in cluster.members))
    return out


def circuit_detail_out(circuit: Circuit) -> dict[str, Any]:
    """With ``labels`` by layer for a serving circuit (the SAE each layer is bound to)."""
    out = circuit_out(circuit, full=True)
    serving = {layer: sae_id for layer, sae_id in (circuit.serving or {}).items() if isinstance(sae_id, str)}
    listed = {
        layer: sorted(
            {m["feature_idx"] for m in circuit.members.get(layer, []) if isinstance(m.get("feature_idx"), int)}
        )
        for layer in serving
    }
    wanted: dict[str, set[int]] = {}
    for layer, sae_id in serving.items():
        wanted.setdefault(sae_id, set()).update(listed[layer])
    found = labels_for_many(wanted) if wanted else {}
    out["labels"] = {
        layer: {str(i): found[sae_id][i] for i in listed[layer] if i in found.get(sae_id, {})}
        for layer, sae_id in sorted(serving.items())
    }
    return out
