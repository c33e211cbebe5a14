"""The value rules of steering, decided here once for every surface (/api, /v1, documents,
admin): a value set directly is finite and within ±MAX_STEERING_STRENGTH or it is refused;
a value derived from a dial (profile, cluster or circuit intensity λ) is clamped to that
range; a feature index lies in [0, d_sae) of the SAE it steers through.

The wire schemas (the /v1 pydantic models, the /api serializers) call these same functions,
so a refusal reads the same wherever it comes from; which attachments exist, and their
d_sae, is the engine's word (``AttachmentStatus``) or the registry row that records it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from core.errors import InvalidFeatureIndex, ValidationFailed
from gpu_engine.protocol import MAX_STEERING_STRENGTH

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
                f"Steering value {float(value)!r} for feature {index} is outside "
                f"[-{LIMIT}, {LIMIT}]",
                details={"param": param, "fields": {param: [f"feature {index}: {problem}"]}})
        out[int(index)] = float(value)
    return out


def dial(value: float, intensity: float) -> float:
    """A value derived from a dial: scaled, then clamped to ±MAX_STEERING_STRENGTH."""
    return max(-MAX_STEERING_STRENGTH, min(MAX_STEERING_STRENGTH, value * intensity))


def check_indices(*, sae_id: str, d_sae: int | None, indices: Iterable[int],
                  param: str) -> None:
    """Every index inside the SAE's feature space (d_sae unknown: only ≥ 0)."""
    for index in indices:
        if index < 0 or (d_sae is not None and index >= d_sae):
            raise InvalidFeatureIndex(
                f"Feature index {index} is out of range for SAE {sae_id!r} (d_sae={d_sae})",
                details={"param": param, "feature_idx": index, "sae_id": sae_id,
                         "d_sae": d_sae})
