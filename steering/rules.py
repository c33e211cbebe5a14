"""The value rules of steering, decided here once for every surface (/api, /v1, documents,
admin): a value set directly is finite and within ±MAX_STEERING_STRENGTH or it is refused;
a value derived from a dial (profile, cluster or circuit intensity λ) is clamped to that
range; a feature index lies in [0, d_sae) of the SAE it steers through.

A feature may also be a *control* (docs/steering.md, "Modes"): a mode (add, clamp, scale,
ablate) with its value, a phase, a window and a condition. Live steering, profiles,
clusters and circuits store them as a list of ``control_json`` objects beside their plain
``{index: strength}`` maps, which stay exactly as before; ``controls_parse`` reads that
list with the refusals inline /v1 steering makes, and ``FeatureSet`` is the pair a
document or an attachment's live steering steers with. The dial λ scales what is added
(plain strengths and ``add`` controls) and leaves clamp targets, scale factors and
ablations as written — they are levels, not amounts; λ = 0 turns the whole set off.

The wire schemas (the /v1 pydantic models, the /api serializers) call these same functions,
so a refusal reads the same wherever it comes from; which attachments exist, and their
d_sae, is the engine's word (``AttachmentStatus``) or the registry row that records it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from core.errors import InvalidFeatureIndex, ValidationFailed
from gpu_engine.api.fields import prechecked
from gpu_engine.api.protocol import (
    CONDITION_THRESHOLD,
    MAX_STEERING_STRENGTH,
    FeatureControl,
    PositionRange,
    SteeringCondition,
)

LIMIT = f"{MAX_STEERING_STRENGTH:g}"


def strength_problem(value: float) -> str | None:
    """Why a directly set value is refused, or None when it is allowed."""
    if not math.isfinite(value) or abs(value) > MAX_STEERING_STRENGTH:
        return f"value must lie in [-{LIMIT}, {LIMIT}] (got {value!r})"
    return None


def check_strength(value: float) -> float:
    """For wire validators: the value, or ValueError with the rule's message."""
    problem = strength_problem(float(value))
    if problem:
        raise ValueError(problem)
    return float(value)


def check_direct(values: Mapping[int, float], param: str) -> dict[int, float]:
    """Values set directly, all or none: refused (never clamped) when one breaks the rule."""
    out: dict[int, float] = {}
    for index, value in values.items():
        problem = strength_problem(float(value))
        if problem:
            raise ValidationFailed(
                f"Steering value {float(value)!r} for feature {index} is outside [-{LIMIT}, {LIMIT}]",
                details={"param": param, "fields": {param: [f"feature {index}: {problem}"]}},
            )
        out[int(index)] = float(value)
    return out


def dial(value: float, intensity: float) -> float:
    """A value derived from a dial: scaled, then clamped to ±MAX_STEERING_STRENGTH."""
    return max(-MAX_STEERING_STRENGTH, min(MAX_STEERING_STRENGTH, value * intensity))


def check_indices(*, sae_id: str, d_sae: int | None, indices: Iterable[int], param: str) -> None:
    """Every index inside the SAE's feature space (d_sae unknown: only ≥ 0)."""
    for index in indices:
        if index < 0 or (d_sae is not None and index >= d_sae):
            raise InvalidFeatureIndex(
                f"Feature index {index} is out of range for SAE {sae_id!r} (d_sae={d_sae})",
                details={"param": param, "feature_idx": index, "sae_id": sae_id, "d_sae": d_sae},
            )


# --------------------------------------------------------------------------- controls


def mode_value_problem(mode: str, strength: float | None, value: float | None) -> str | None:
    """Which of ``strength`` / ``value`` a mode takes, or why the pair is refused."""
    if strength is not None and value is not None:
        return "give strength or value, not both"
    if mode == "add" and strength is None and value is None:
        return "an add needs a strength (or value)"
    if mode in ("clamp", "scale") and value is None:
        what = "target activation" if mode == "clamp" else "factor"
        return f"{mode} needs a value (the {what})"
    if mode in ("clamp", "scale") and strength is not None:
        return f"{mode} takes value, not strength"
    if mode == "ablate" and (strength is not None or value is not None):
        return "ablate takes no strength or value"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class WindowInput(_Strict):
    start: int = Field(default=0, ge=0, strict=True)
    end: int | None = Field(default=None, gt=0, strict=True)

    @model_validator(mode="after")
    def _ordered(self) -> WindowInput:
        if self.end is not None and self.end <= self.start:
            raise ValueError("window.end must be greater than window.start")
        return self


class ConditionInput(_Strict):
    feature: int = Field(ge=0, le=2**31, strict=True)
    threshold: float = Field(default=0.0, **CONDITION_THRESHOLD.bounds(), strict=True)


class ControlInput(_Strict):
    """One stored or sent control, the shape inline /v1 steering takes:
    ``{index, mode, value | strength, phase, window, condition}``."""

    index: int = Field(ge=0, le=2**31, strict=True)
    mode: Literal["add", "clamp", "scale", "ablate"] = "add"
    # JSON numbers only: lax floats read true as 1.0 and "5" as 5.0
    strength: float | None = Field(default=None, strict=True)
    value: float | None = Field(default=None, strict=True)
    phase: Literal["all", "prompt", "completion"] = "all"
    window: WindowInput | None = None
    condition: ConditionInput | None = None

    @field_validator("strength", "value")
    @classmethod
    def _direct(cls, value: float | None) -> float | None:
        return None if value is None else check_strength(value)

    @model_validator(mode="after")
    def _one_value(self) -> ControlInput:
        problem = mode_value_problem(self.mode, self.strength, self.value)
        if problem:
            raise ValueError(problem)
        return self

    def control(self) -> FeatureControl:
        """The engine's ``FeatureControl``: its ranges were checked here (the same
        declarations), so building it checks them no second time (``prechecked``)."""
        amount = self.strength if self.strength is not None else self.value
        with prechecked():
            return FeatureControl(
                self.index,
                mode=self.mode,
                value=float(amount or 0.0),
                phase=self.phase,
                window=(PositionRange(self.window.start, self.window.end) if self.window is not None else None),
                condition=(
                    SteeringCondition(self.condition.feature, self.condition.threshold)
                    if self.condition is not None
                    else None
                ),
            )


def _loc(param: str, loc: Sequence[Any]) -> str:
    out = param
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _refusal(fields: dict[str, list[str]]) -> ValidationFailed:
    first, problems = next(iter(fields.items()))
    return ValidationFailed(
        f"Invalid steering control: {first}: {problems[0]}", details={"param": first, "fields": fields}
    )


def _parse(item: Any, prefix: str, fields: dict[str, list[str]]) -> FeatureControl | None:
    try:
        return ControlInput.model_validate(item).control()
    except ValidationError as exc:
        for err in exc.errors(include_url=False, include_input=False):
            # the whole-entry checks are all about which value a mode takes
            where = _loc(prefix, err.get("loc", ()) or ("value",)).lstrip(".")
            fields.setdefault(where, []).append(str(err.get("msg", "invalid")).removeprefix("Value error, "))
        return None


def control_parse(item: Any) -> FeatureControl:
    """One control given as a request's own fields (``{index, mode, value, …}`` at the top
    of a body): VALIDATION_ERROR naming the field (``details.param: "mode"``)."""
    fields: dict[str, list[str]] = {}
    control = _parse(item, "", fields)
    if control is None:
        raise _refusal(fields)
    return control


def controls_parse(raw: Any, *, param: str = "controls") -> list[FeatureControl]:
    """A list of controls as sent or stored, all or none: VALIDATION_ERROR naming the
    first bad field in ``details.param`` (``controls[2].mode``) and every one in
    ``details.fields``. Indices are checked against an SAE by ``check_features``."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValidationFailed(
            f"{param} must be a list of controls", details={"param": param, "fields": {param: ["not a list"]}}
        )
    out: list[FeatureControl] = []
    fields: dict[str, list[str]] = {}
    for i, item in enumerate(raw):
        control = _parse(item, f"{param}[{i}]", fields)
        if control is not None:
            out.append(control)
    if fields:
        raise _refusal(fields)
    return out


def control_json(c: FeatureControl) -> dict[str, Any]:
    """A control as it is stored and shown (the inline /v1 shape; defaults left out)."""
    out: dict[str, Any] = {"index": c.index, "mode": c.mode}
    if c.mode != "ablate":
        out["value"] = c.value
    if c.phase != "all":
        out["phase"] = c.phase
    if c.window is not None:
        out["window"] = {"start": c.window.start, "end": c.window.end}
    if c.condition is not None:
        out["condition"] = {"feature": c.condition.feature, "threshold": c.condition.threshold}
    return out


def dial_controls(controls: Iterable[FeatureControl], intensity: float) -> list[FeatureControl]:
    """Controls under a dial: ``add`` values scaled (and clamped), the other modes as
    written; λ = 0 is off, so nothing is left."""
    if intensity == 0:
        return []
    with prechecked():  # a dialled value is clamped into the range
        return [msgspec.structs.replace(c, value=dial(c.value, intensity)) if c.mode == "add" else c for c in controls]


@dataclass(frozen=True)
class FeatureSet:
    """What one attachment steers: plain strengths and controls, each index once."""

    values: dict[int, float] = field(default_factory=dict)
    controls: list[FeatureControl] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.values or self.controls)

    def indices(self) -> list[int]:
        return list(self.values) + [c.index for c in self.controls]

    def triggers(self) -> list[int]:
        return [c.condition.feature for c in self.controls if c.condition is not None]

    def dialled(self, intensity: float) -> FeatureSet:
        return FeatureSet(
            {i: dial(v, intensity) for i, v in self.values.items()}, dial_controls(self.controls, intensity)
        )

    def merged(self, other: FeatureSet) -> FeatureSet:
        """``other``'s features replace this set's entries for the same indices."""
        replaced = set(other.indices())
        values = {i: v for i, v in self.values.items() if i not in replaced}
        values.update(other.values)
        controls = [c for c in self.controls if c.index not in replaced] + list(other.controls)
        return FeatureSet(values, sorted(controls, key=lambda c: c.index))

    def without(self, index: int) -> FeatureSet:
        return FeatureSet(
            {i: v for i, v in self.values.items() if i != index}, [c for c in self.controls if c.index != index]
        )

    def stored_values(self) -> dict[str, float]:
        return {str(k): float(v) for k, v in sorted(self.values.items())}

    def stored_controls(self) -> list[dict[str, Any]]:
        return [control_json(c) for c in sorted(self.controls, key=lambda c: c.index)]


def feature_set(
    values: Mapping[int, float], controls: Iterable[FeatureControl], *, param: str = "controls"
) -> FeatureSet:
    """Strengths and controls as one set: a plain add given as a control is a strength
    (the same request, the same hash), and a feature named twice is refused."""
    out = {int(k): float(v) for k, v in values.items()}
    kept: list[FeatureControl] = []
    for c in controls:
        if c.index in out or any(k.index == c.index for k in kept):
            raise ValidationFailed(
                f"Feature {c.index} is named twice",
                details={
                    "param": param,
                    "feature_idx": c.index,
                    "fields": {param: [f"feature {c.index} is named twice"]},
                },
            )
        if c.plain:
            out[c.index] = c.value
        else:
            kept.append(c)
    return FeatureSet(out, sorted(kept, key=lambda c: c.index))


def check_features(
    *, sae_id: str, d_sae: int | None, features: FeatureSet, param: str, trigger_param: str | None = None
) -> None:
    """``check_indices`` for a set: its features, then its controls' triggers."""
    check_indices(sae_id=sae_id, d_sae=d_sae, indices=features.indices(), param=param)
    check_indices(
        sae_id=sae_id, d_sae=d_sae, indices=features.triggers(), param=trigger_param or f"{param}.condition.feature"
    )
