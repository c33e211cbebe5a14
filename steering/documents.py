"""The portable document formats, parsed and checked (no database here).

- ``mistudio.cluster-definition/v1`` and ``mistudio.cluster-bundle/v1``: one or up to 50
  cluster definitions of 1-20 members each;
- ``mistudio.circuit-definition/v1``: members on up to 16 SAEs (≤ 20 per layer), up to 200
  edges with evidence rungs 0-3;
- the profile export ``{version, name, description, model_id, sae_id, layer, steering,
  controls?, intensity, created_at, updated_at}`` (import also takes ``features: [{index,
  strength}]``).

A member of a cluster or circuit is ``{feature_idx, strength, sign, label}`` as authored;
it may also carry a mode (``mode`` add | clamp | scale | ablate with ``value``), a
``phase``, a ``window`` and a ``condition`` — the fields inline /v1 steering takes, checked
by the same rules (``steering.rules``). A member without them is what it always was.

Definitions are data: a document is at most 1 MB, nothing in it is executed or opened,
and an SAE reference that is a filesystem path is refused. Unknown fields are allowed
(newer producers add some) and kept, because the stored document is the imported text.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from core.errors import ValidationFailed
from gpu_engine.api.protocol import FeatureControl, PositionRange, SteeringCondition
from steering import rules
from steering.errors import IsClusterDocument, PayloadTooLarge, UnknownKind

MAX_DOCUMENT_BYTES = 1_000_000
MAX_CLUSTER_MEMBERS = 20
MAX_BUNDLE_DEFINITIONS = 50
MAX_CIRCUIT_SAES = 16
MAX_CIRCUIT_MEMBERS_PER_LAYER = 20
MAX_CIRCUIT_EDGES = 200
CLUSTER_KIND = "mistudio.cluster-definition"
BUNDLE_KIND = "mistudio.cluster-bundle"
CIRCUIT_KIND = "mistudio.circuit-definition"
PROFILE_VERSION = "1.0"

# The evidence ladder, rendered verbatim from the producer's vocabulary: below rung 2
# nothing is described as causal.
RUNG_LANGUAGE = {
    0: "associated",
    1: "suggested (attribution-supported)",
    2: "causally validated (edge)",
    3: "faithfulness-tested (circuit)",
}
VALIDATED_RUNG = 2

_PATHLIKE = re.compile(r"^(/|~|\\|[A-Za-z]:[\\/]|file:)")


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow", strict=False)


class Member(_Doc):
    feature_idx: int = Field(ge=0, strict=True)
    strength: float | None = Field(default=None, ge=-300, le=300)
    sign: Literal[1, -1] = 1
    label: str | None = None
    # a member steered otherwise than "add the strength everywhere" (absent: as before)
    mode: Literal["add", "clamp", "scale", "ablate"] | None = None
    value: float | None = None
    phase: Literal["all", "prompt", "completion"] | None = None
    window: rules.WindowInput | None = None
    condition: rules.ConditionInput | None = None

    @field_validator("strength")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("strength must be finite")
        return value

    @field_validator("value")
    @classmethod
    def _direct(cls, value: float | None) -> float | None:
        return None if value is None else rules.check_strength(value)

    @model_validator(mode="after")
    def _one_value(self) -> Member:
        problem = rules.mode_value_problem(self.mode or "add", self.strength, self.value)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def plain(self) -> bool:
        return (
            self.mode in (None, "add")
            and self.phase in (None, "all")
            and self.window is None
            and self.condition is None
        )

    def signed(self) -> float:
        """The sign rule: a negative strength is already directional; otherwise the
        member's direction comes from ``sign``. (What an add adds; 0 for other modes.)"""
        if self.mode not in (None, "add"):
            return 0.0
        amount = self.strength if self.strength is not None else float(self.value or 0.0)
        return amount if amount < 0 else self.sign * amount

    def control(self, intensity: float) -> FeatureControl | None:
        """The member as a control at the dial λ (``rules.dial_controls``' rule: an add's
        amount is scaled, a clamp target, scale factor or ablation runs as written; λ = 0
        is off), or None for a plain member, which is a strength."""
        if self.plain or intensity == 0:
            return None
        mode = self.mode or "add"
        value = rules.dial(self.signed(), intensity) if mode == "add" else float(self.value or 0.0)
        return FeatureControl(
            self.feature_idx,
            mode=mode,
            value=value,
            phase=self.phase or "all",
            window=(PositionRange(self.window.start, self.window.end) if self.window is not None else None),
            condition=(
                SteeringCondition(self.condition.feature, self.condition.threshold)
                if self.condition is not None
                else None
            ),
        )

    def indices(self) -> list[int]:
        """The feature it steers and the trigger it reads."""
        return [self.feature_idx] + ([self.condition.feature] if self.condition is not None else [])

    def row(self) -> dict[str, Any]:
        out = {"feature_idx": self.feature_idx, "strength": self.strength, "sign": self.sign, "label": self.label}
        for key in ("mode", "value", "phase", "window", "condition"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value.model_dump() if isinstance(value, BaseModel) else value
        return out


def members_features(members: list[Member], intensity: float) -> rules.FeatureSet:
    """What members steer at the dial λ: plain members as strengths (sign rule, scaled,
    each clamped to ±200), the others as controls."""
    values, controls = {}, []
    for m in members:
        control = m.control(intensity)
        if control is not None:
            controls.append(control)
        elif m.plain:
            values[m.feature_idx] = rules.dial(m.signed(), intensity)
    return rules.FeatureSet(values, controls)


class SAERef(_Doc):
    mistudio_sae_id: str | None = None
    sae_id: str | None = None  # the name other tools use for the same value
    layer: int | None = Field(default=None, ge=0)
    n_features: int | None = Field(default=None, ge=1)
    d_model: int | None = None
    hook_type: str | None = None
    source_hint: str | None = None

    @field_validator("source_hint")
    @classmethod
    def _not_a_path(cls, value: str | None) -> str | None:
        if value and _PATHLIKE.match(value.strip()):
            raise ValueError("source_hint must not be a filesystem path (use 'hf:repo/path')")
        return value

    @property
    def ref(self) -> str | None:
        return self.mistudio_sae_id or self.sae_id

    def row(self) -> dict[str, Any]:
        return {"ref": self.ref, "layer": self.layer, "n_features": self.n_features, "source_hint": self.source_hint}


class ModelRef(_Doc):
    hf_id: str | None = None
    mistudio_model_id: str | None = None


def _intensity_range(value: list[float] | None) -> list[float] | None:
    if value in (None, []):
        return None
    if len(value) != 2 or not (0 <= value[0] <= value[1]) or not all(math.isfinite(v) for v in value):
        raise ValueError("intensity_range must be [low, high] with 0 <= low <= high")
    return [float(value[0]), float(value[1])]


class Budget(_Doc):
    intensity: float = Field(default=1.0, ge=0.0, le=2.0)
    intensity_range: list[float] | None = None

    @field_validator("intensity_range")
    @classmethod
    def _range(cls, value: list[float] | None) -> list[float] | None:
        return _intensity_range(value)


class Provenance(_Doc):
    source_note: str | None = Field(default=None, max_length=500)


class _Versioned(_Doc):
    schema_version: str = "1"

    @field_validator("schema_version", mode="before")
    @classmethod
    def _v1(cls, value: Any) -> str:
        if str(value) != "1":
            raise ValueError("only schema_version 1 is supported")
        return "1"


class ClusterDefinition(_Versioned):
    kind: str = CLUSTER_KIND
    name: str = Field(min_length=1, max_length=120)
    narrative: str | None = Field(default=None, max_length=10000)
    members: list[Member] = Field(min_length=1, max_length=MAX_CLUSTER_MEMBERS)
    model: ModelRef = Field(default_factory=ModelRef)
    sae: SAERef = Field(default_factory=SAERef)
    budget: Budget | None = None
    provenance: Provenance | None = None

    @field_validator("members")
    @classmethod
    def _unique(cls, members: list[Member]) -> list[Member]:
        seen = [m.feature_idx for m in members]
        if len(set(seen)) != len(seen):
            raise ValueError("a feature_idx appears twice among the members")
        return members


class ClusterBundle(_Versioned):
    kind: str = BUNDLE_KIND
    definitions: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_BUNDLE_DEFINITIONS)


class CircuitMember(_Doc):
    layer: int = Field(ge=0)
    member_kind: Literal["feature_ref", "cluster_ref"] = "feature_ref"
    feature: Member | None = None
    expanded_members: list[Member] | None = Field(default=None, max_length=MAX_CIRCUIT_MEMBERS_PER_LAYER)

    def features(self) -> list[Member]:
        if self.member_kind == "feature_ref":
            if self.feature is None:
                raise ValueError(f"a feature_ref member at layer {self.layer} has no feature")
            return [self.feature]
        if not self.expanded_members:
            raise ValueError(f"a cluster_ref member at layer {self.layer} has no expanded_members to steer")
        return list(self.expanded_members)


class NodeRef(_Doc):
    layer: int = Field(ge=0)
    feature_idx: int | None = Field(default=None, ge=0)
    kind: Literal["feature", "cluster"] = "feature"


class Edge(_Doc):
    up: NodeRef
    down: NodeRef
    rung: Literal[0, 1, 2, 3] = 0
    tested_and_failed: list[Literal[0, 1, 2, 3]] = Field(default_factory=list)
    type: Literal["computed", "persistence", "attention_mediated"] = "computed"


class CircuitBudget(_Doc):
    intensity: float = Field(default=1.0, ge=0.0, le=2.0)
    intensity_range: list[float] | None = None

    @field_validator("intensity_range")
    @classmethod
    def _range(cls, value: list[float] | None) -> list[float] | None:
        return _intensity_range(value)


class CircuitDefinition(_Versioned):
    kind: str = CIRCUIT_KIND
    name: str = Field(min_length=1, max_length=120)
    narrative: str | None = Field(default=None, max_length=10000)
    saes: list[SAERef] = Field(min_length=1, max_length=MAX_CIRCUIT_SAES)
    members: list[CircuitMember] = Field(min_length=1)
    edges: list[Edge] = Field(default_factory=list, max_length=MAX_CIRCUIT_EDGES)
    model: ModelRef = Field(default_factory=ModelRef)
    budget: CircuitBudget | None = None
    provenance: Provenance | None = None


# --------------------------------------------------------------------------- parsing


def _kind(data: dict[str, Any]) -> str | None:
    kind = data.get("kind")
    if kind is None:
        if "definitions" in data:
            return BUNDLE_KIND
        if "saes" in data:
            return CIRCUIT_KIND
        if "members" in data:
            return CLUSTER_KIND
        return None
    if not isinstance(kind, str):
        return "?"
    return kind.removesuffix("/v1")


def _fields(exc: ValidationError) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for err in exc.errors(include_url=False, include_input=False):
        loc = ".".join(str(p) for p in err.get("loc", ())) or "document"
        out.setdefault(loc, []).append(str(err.get("msg", "invalid")).removeprefix("Value error, "))
    return out


def invalid(exc: ValidationError | ValueError, what: str) -> ValidationFailed:
    if isinstance(exc, ValidationError):
        fields = _fields(exc)
        first = next(iter(fields.items()))
        return ValidationFailed(f"Invalid {what}: {first[0]}: {first[1][0]}", details={"fields": fields})
    return ValidationFailed(f"Invalid {what}: {exc}", details={"fields": {"document": [str(exc)]}})


def load_document(raw: bytes | str | dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The JSON object of an import body and its exact text (None when it came parsed);
    PAYLOAD_TOO_LARGE above 1 MB."""
    if isinstance(raw, dict):
        text = None
        size = len(json.dumps(raw, ensure_ascii=False).encode())
        data = raw
    else:
        size = len(raw if isinstance(raw, bytes) else raw.encode())
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        data = None
    if size > MAX_DOCUMENT_BYTES:
        raise PayloadTooLarge(
            f"The document is {size} bytes; the limit is {MAX_DOCUMENT_BYTES}",
            details={"bytes": size, "limit": MAX_DOCUMENT_BYTES},
        )
    if data is None:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValidationFailed(
                f"The document is not JSON: {exc}", details={"fields": {"document": [str(exc)]}}
            ) from None
    if not isinstance(data, dict):
        raise ValidationFailed(
            "The document must be a JSON object", details={"fields": {"document": ["not an object"]}}
        )
    return data, text


def document_text(data: dict[str, Any]) -> str:
    """How a definition that arrived inside a bundle (or parsed) is stored and exported:
    its keys in their order, every field kept."""
    return json.dumps(data, ensure_ascii=False, indent=2)


def parse_cluster_document(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The definitions an import body carries (one, or a bundle's), still unvalidated:
    bundle items are validated one by one so one bad definition does not block the rest."""
    kind = _kind(data)
    if kind == CLUSTER_KIND:
        return [data]
    if kind == BUNDLE_KIND:
        try:
            bundle = ClusterBundle.model_validate(data)
        except ValidationError as exc:
            raise invalid(exc, "cluster bundle") from None
        return bundle.definitions
    raise UnknownKind(
        f"Not a cluster definition or bundle (kind {data.get('kind')!r})"
        + ("; import circuits at /api/circuits/import" if kind == CIRCUIT_KIND else ""),
        details={"kind": data.get("kind"), "accepted": [CLUSTER_KIND, BUNDLE_KIND]},
    )


def validate_cluster(data: Any) -> ClusterDefinition:
    if not isinstance(data, dict) or _kind(data) != CLUSTER_KIND:
        raise UnknownKind(
            "A bundle item is not a cluster definition",
            details={"kind": data.get("kind") if isinstance(data, dict) else None},
        )
    try:
        return ClusterDefinition.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc, "cluster definition") from None


def validate_circuit(data: dict[str, Any]) -> tuple[CircuitDefinition, dict[int, list[Member]]]:
    """The circuit and its members grouped by layer, or VALIDATION_ERROR naming the first
    problem (UNKNOWN_KIND for another kind of document)."""
    kind = _kind(data)
    if kind != CIRCUIT_KIND:
        raise UnknownKind(
            f"Not a circuit definition (kind {data.get('kind')!r})",
            details={"kind": data.get("kind"), "accepted": [CIRCUIT_KIND]},
        )
    try:
        circuit = CircuitDefinition.model_validate(data)
        layers: dict[int, list[Member]] = {}
        for member in circuit.members:
            layers.setdefault(member.layer, []).extend(member.features())
    except ValidationError as exc:
        raise invalid(exc, "circuit definition") from None
    except ValueError as exc:
        raise invalid(exc, "circuit definition") from None
    sae_layers: dict[int, SAERef] = {}
    for i, sae in enumerate(circuit.saes):
        if sae.layer is None:
            raise invalid(ValueError(f"saes[{i}] names no layer"), "circuit definition")
        if not sae.ref and not sae.source_hint:
            raise invalid(
                ValueError(f"saes[{i}] names no SAE (mistudio_sae_id, sae_id or source_hint)"), "circuit definition"
            )
        if sae.layer in sae_layers:
            raise invalid(ValueError(f"two SAEs are named for layer {sae.layer}"), "circuit definition")
        sae_layers[sae.layer] = sae
    for layer, members in layers.items():
        if layer not in sae_layers:
            raise invalid(ValueError(f"members at layer {layer} have no SAE in saes"), "circuit definition")
        if len(members) > MAX_CIRCUIT_MEMBERS_PER_LAYER:
            raise invalid(
                ValueError(f"layer {layer} has {len(members)} members; the limit is {MAX_CIRCUIT_MEMBERS_PER_LAYER}"),
                "circuit definition",
            )
        indices = [m.feature_idx for m in members]
        if len(set(indices)) != len(indices):
            raise invalid(ValueError(f"a feature_idx appears twice at layer {layer}"), "circuit definition")
    return circuit, layers


def circuit_rung(circuit: CircuitDefinition) -> int:
    """A chain is as strong as its weakest link: the minimum over the edges (0 without)."""
    return min((e.rung for e in circuit.edges), default=0)


def refuse_cluster_as_profile(data: dict[str, Any]) -> None:
    if _kind(data) in (CLUSTER_KIND, BUNDLE_KIND):
        raise IsClusterDocument(
            "This is a cluster definition; import it at /api/clusters/import", details={"kind": data.get("kind")}
        )
    if _kind(data) == CIRCUIT_KIND:
        raise UnknownKind(
            "This is a circuit definition; import it at /api/circuits/import", details={"kind": data.get("kind")}
        )
