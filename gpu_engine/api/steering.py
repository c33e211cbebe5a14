"""A request's steering: per-attachment strengths and controls, and the canonical hash of
what they add (docs/steering.md, "The steering hash")."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec
import numpy as np

from .errors import InvalidParameter
from .fields import (
    CONDITION_THRESHOLD,
    MAX_STEERING_STRENGTH,
    STEERING_STRENGTH,
    AttachmentKey,
    Index,
    Name,
    PositionRange,
    check_fields,
)
from .vectors import ITEMSIZE, VECTOR_DTYPES, as_float32

STEERING_MODES = ("add", "clamp", "scale", "ablate")
STEERING_PHASES = ("all", "prompt", "completion")
VECTOR_MODES = ("add", "clamp")
# the widest bound a vector clamp may hold its projection to
MAX_CLAMP_BOUND = 1e6
# what reads a feature's activation, and so needs an encoder (a raw vector has none)
ENCODER_MODES = ("clamp", "scale")
# ``SteeringEntry.splice``: every row at the hook replaced by the SAE's reconstruction, or by zeros
SPLICE_MODES = ("reconstruction", "zero")


class SteeringCondition(msgspec.Struct, frozen=True):
    """Steer a position only where feature ``feature`` of the same SAE, encoded from the
    residual arriving at the hook (before this attachment's delta), is above ``threshold``."""

    _where = "steering.condition."

    feature: Index
    threshold: Annotated[float, CONDITION_THRESHOLD.meta] = 0.0

    def __post_init__(self) -> None:
        check_fields(self)


class FeatureControl(msgspec.Struct, omit_defaults=True):
    """One feature steered otherwise than "add this strength at every position"
    (docs/steering.md, "Modes"): with ``x`` the residual row arriving at the hook,
    ``a`` = feature ``index``'s activation there and ``d`` = ``W_dec[index]``:

    - ``add``: ``value · d``;
    - ``clamp``: ``(value − a) · d`` (the feature set to ``value``);
    - ``scale``: ``(value − 1) · a · d`` (the feature multiplied by ``value``);
    - ``ablate``: ``−(x · d̂) d̂`` with ``d̂ = d / ‖d‖`` (``value`` must be 0).

    Each applies only where its gate is open: the ``phase`` (``prompt`` = rows below the
    prompt length, ``completion`` = the rows of generated tokens), the ``window`` of row
    positions, and the ``condition``.
    """

    _where = "steering.features."

    index: Index
    mode: Literal[STEERING_MODES] = "add"  # type: ignore[valid-type]
    value: Annotated[float, STEERING_STRENGTH.meta] = 0.0
    phase: Literal[STEERING_PHASES] = "all"  # type: ignore[valid-type]
    window: PositionRange | None = None
    condition: SteeringCondition | None = None

    def __post_init__(self) -> None:
        if isinstance(self.window, Mapping):
            self.window = PositionRange(**self.window)
        if isinstance(self.condition, Mapping):
            self.condition = SteeringCondition(**self.condition)
        check_fields(self)
        if self.mode == "ablate" and self.value != 0:
            raise InvalidParameter("ablate takes no value", param="steering.features.value")

    @property
    def plain(self) -> bool:
        """An add at every position: the same as a ``features`` strength."""
        return self.mode == "add" and self.phase == "all" and self.window is None and self.condition is None

    @property
    def no_op(self) -> bool:
        """Changes nothing whatever the residual: an add of 0, a scale by 1."""
        return (self.mode == "add" and self.value == 0) or (self.mode == "scale" and self.value == 1)

    def canonical_line(self, sae_id: str, layer: int) -> str:
        """Its line of ``SteeringSpec.canonical_text``."""
        fields = [sae_id, str(layer), str(self.index), f"mode={self.mode}"]
        if self.mode != "ablate":
            fields.append(f"value={_bits(self.value)}")
        if self.phase != "all":
            fields.append(f"phase={self.phase}")
        if self.window is not None:
            end = "" if self.window.end is None else str(self.window.end)
            fields.append(f"window={self.window.start}:{end}")
        if self.condition is not None:
            fields.append(f"if={self.condition.feature}>{_bits(self.condition.threshold)}")
        return "\t".join(fields) + "\n"


class SteeringVector(msgspec.Struct, omit_defaults=True):
    """A raw vector sent with the request, applied at its attachment's hook point on the
    rows its ``phase`` selects (``all``: every row; ``prompt``; ``completion``).
    ``data``: the vector's bytes, little-endian ``dtype`` (``gpu_engine.api.vectors``);
    its width is checked against the hook's by the plan builder.

    - ``add`` (default): ``strength · v``;
    - ``clamp``: the projection ``c = x · u`` on the unit direction ``u = v / ‖v‖`` held
      within ``[min, max]`` (``None``: unbounded on that side), blended by ``strength``
      in [0, 1]: ``strength · (clip(c, min, max) − c) · u``."""

    _where = "steering.vectors."

    data: bytes
    dtype: Literal[VECTOR_DTYPES] = "float32"  # type: ignore[valid-type]
    strength: Annotated[float, STEERING_STRENGTH.meta] = 1.0
    phase: Literal[STEERING_PHASES] = "all"  # type: ignore[valid-type]
    mode: Literal[VECTOR_MODES] = "add"  # type: ignore[valid-type]
    min: float | None = None
    max: float | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.data:
            raise InvalidParameter("steering.vectors.data is empty", param="steering.vectors.data")
        values = as_float32(self.dtype, self.data, "steering.vectors.data")  # whole values, finite
        if self.mode == "add":
            if self.min is not None or self.max is not None:
                raise InvalidParameter("min and max bound a clamp: send mode clamp", param="steering.vectors.mode")
            return
        check_clamp(values, self.min, self.max, self.strength)

    @property
    def projects(self) -> bool:
        """Reads the row's projection on the vector (a clamp): runs per row."""
        return self.mode == "clamp"

    @property
    def width(self) -> int:
        return len(self.data) // ITEMSIZE[self.dtype]

    @property
    def no_op(self) -> bool:
        return self.strength == 0

    def canonical_line(self, sae_id: str, layer: int) -> str:
        """Its line of ``SteeringSpec.canonical_text``: the vector named by the SHA-256 of
        its bytes as sent, with their dtype."""
        digest = hashlib.sha256(self.data).hexdigest()
        fields = [sae_id, str(layer), "vector", f"dtype={self.dtype}", f"sha256={digest}"]
        fields.append(f"strength={_bits(self.strength)}")
        if self.mode != "add":
            fields.append(f"mode={self.mode}")
            if self.min is not None:
                fields.append(f"min={_bits(self.min)}")
            if self.max is not None:
                fields.append(f"max={_bits(self.max)}")
        if self.phase != "all":
            fields.append(f"phase={self.phase}")
        return "\t".join(fields) + "\n"


def check_clamp(
    values: np.ndarray, lo: float | None, hi: float | None, strength: float, where: str = "steering.vectors"
) -> None:
    """A clamp's direction, bounds and strength, each refusal naming its field under
    ``where``: a direction of zero length, no bound, ``min > max``, a non-finite bound,
    a strength outside [0, 1]."""
    norm = float(np.linalg.norm(values.astype(np.float64)))
    if not np.isfinite(norm) or norm == 0:
        raise InvalidParameter(f"{where}.data: a clamp's direction must be non-zero", param=f"{where}.data")
    for name, bound in (("min", lo), ("max", hi)):
        if bound is not None and not (math.isfinite(bound) and abs(bound) <= MAX_CLAMP_BOUND):
            raise InvalidParameter(
                f"{where}.{name} must be a finite number in [-{MAX_CLAMP_BOUND:g}, {MAX_CLAMP_BOUND:g}]",
                param=f"{where}.{name}",
            )
    if lo is None and hi is None:
        raise InvalidParameter(f"{where}: a clamp needs min, max or value", param=f"{where}.min")
    if lo is not None and hi is not None and lo > hi:
        raise InvalidParameter(f"{where}.min ({lo:g}) is above max ({hi:g})", param=f"{where}.min")
    if not 0 <= strength <= 1:
        raise InvalidParameter(f"{where}.strength: a clamp's strength lies in [0, 1]", param=f"{where}.strength")


def _bits(value: float) -> str:
    """16 hex digits of the IEEE-754 binary64 bits, big-endian (-0.0 written as 0)."""
    return struct.pack(">d", float(value) + 0.0).hex()


class SteeringEntry(msgspec.Struct, omit_defaults=True):
    """Steering at one attachment.

    ``features``: strengths added at every position, ``delta = Σ strength · W_dec[index]``
    (on the wire a JSON object keyed by the feature index, ``{"3": 5.0}``).
    ``controls``: features steered in another mode or only where a gate is open
    (``FeatureControl``); a plain add given as a control moves to ``features``.  A feature
    index appears once in the entry.
    ``splice``: every row at the attachment's hook replaced by the SAE's reconstruction
    ``decode(encode(x))`` (``"reconstruction"``) or by zeros (``"zero"``), on every
    forward; it takes no features, controls or vectors in the same entry.
    """

    _where = "steering."
    _names = {"features.key": "steering.features.index", "features.value": "steering.features.strength"}

    sae_id: Name
    layer: Index
    features: dict[Index, Annotated[float, STEERING_STRENGTH.meta]] = msgspec.field(default_factory=dict)
    controls: list[FeatureControl] = msgspec.field(default_factory=list)
    vectors: list[SteeringVector] = msgspec.field(default_factory=list)
    splice: Literal[SPLICE_MODES] | None = None  # type: ignore[valid-type]

    def __post_init__(self) -> None:
        self.vectors = [SteeringVector(**v) if isinstance(v, Mapping) else v for v in self.vectors]
        # a mapping built from JSON-native values keys its indices by their text
        self.features = {
            int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v for k, v in dict(self.features).items()
        }
        check_fields(self)
        clean = self.features
        controls: list[FeatureControl] = []
        for c in self.controls:
            c = FeatureControl(**c) if isinstance(c, Mapping) else c
            if c.index in clean or any(o.index == c.index for o in controls):
                raise InvalidParameter(
                    f"steering names feature {c.index} twice", param="steering.features", details={"index": c.index}
                )
            if c.plain:
                clean[c.index] = c.value
            else:
                controls.append(c)
        self.features = clean
        self.controls = controls
        if self.splice is not None and (self.features or self.controls or self.vectors):
            raise InvalidParameter(
                "steering.splice replaces every row at the hook: give no features, controls or "
                "vectors in the same entry",
                param="steering.splice",
                details={"sae_id": self.sae_id, "layer": self.layer, "splice": self.splice},
            )

    def is_empty(self) -> bool:
        return (
            self.splice is None
            and not self.features
            and not any(not c.no_op for c in self.controls)
            and not any(not v.no_op for v in self.vectors)
        )

    @property
    def key(self) -> AttachmentKey:
        return (self.sae_id, self.layer)


class SteeringSpec(msgspec.Struct):
    """A request's resolved steering.  Empty means explicitly unsteered."""

    entries: list[SteeringEntry] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        seen: set[AttachmentKey] = set()
        for e in self.entries:
            if e.key in seen:
                raise InvalidParameter(f"duplicate steering entry for {e.key}", param="steering")
            seen.add(e.key)

    @classmethod
    def from_mapping(cls, mapping: Mapping[AttachmentKey, Mapping[int, float]]) -> SteeringSpec:
        return cls([SteeringEntry(sae_id, layer, dict(f)) for (sae_id, layer), f in mapping.items()])

    def as_mapping(self) -> dict[AttachmentKey, dict[int, float]]:
        return {e.key: dict(e.features) for e in self.entries}

    def is_empty(self) -> bool:
        return all(e.is_empty() for e in self.entries)

    def has_controls(self) -> bool:
        # a vector gated to a phase, or clamping, runs as a control (per row)
        return any(e.controls or any(v.phase != "all" or v.projects for v in e.vectors) for e in self.entries)

    def canonical_text(self) -> str:
        """The applied set, one line per feature that changes something, in a form every
        language can write exactly (docs/steering.md, "The steering hash"):
        ``<sae_id>\t<layer>\t<index>\t<strength as 16 hex digits of its IEEE-754 binary64
        bits, big-endian>\n`` for a plain add, and for a control
        ``<sae_id>\t<layer>\t<index>\tmode=<mode>[\tvalue=<bits>][\tphase=<phase>]``
        ``[\twindow=<start>:<end or empty>][\tif=<feature>><threshold bits>]\n``; a splice
        ``<sae_id>\t<layer>\tsplice=<reconstruction|zero>\n``; lines sorted by (sae_id as
        UTF-8 bytes, layer, index), a splice first and a vector next in its attachment.  An
        add of 0 or a scale by 1 changes nothing and writes no line; -0.0 is 0."""
        lines = []
        for e in self.entries:
            if e.splice is not None:
                lines.append((e.sae_id.encode(), e.layer, -2, f"{e.sae_id}\t{e.layer}\tsplice={e.splice}\n"))
            for index, strength in e.features.items():
                if strength == 0:
                    continue
                line = f"{e.sae_id}\t{e.layer}\t{index}\t{_bits(strength)}\n"
                lines.append((e.sae_id.encode(), e.layer, index, line))
            for c in e.controls:
                if not c.no_op:
                    lines.append((e.sae_id.encode(), e.layer, c.index, c.canonical_line(e.sae_id, e.layer)))
            for v in e.vectors:
                if not v.no_op:  # sorted before the features of their attachment
                    lines.append((e.sae_id.encode(), e.layer, -1, v.canonical_line(e.sae_id, e.layer)))
        return "".join(line for *_, line in sorted(lines))

    def canonical_hash(self) -> str:
        """``sha256:<hex>`` of ``canonical_text()`` (UTF-8): equal for two specs that add the
        same deltas, whatever their order or spelling; an empty set hashes the empty text."""
        return "sha256:" + hashlib.sha256(self.canonical_text().encode()).hexdigest()


def refuse_encoder_controls(entry: SteeringEntry) -> None:
    """A raw steering vector has decoder rows only: add and ablate work on it; clamp,
    scale and conditions (which read an activation) are refused, naming the field. The
    engine asks it of every entry on an attachment without an encoder; ``manage.py
    capture`` of every line's entries on a vector before it runs anything."""
    for c in entry.controls:
        if c.mode in ENCODER_MODES:
            raise InvalidParameter(
                f"{entry.sae_id!r} is a raw steering vector: mode {c.mode!r} reads a "
                "feature's activation, which a vector has no encoder for (use add or ablate)",
                param="steering.features.mode",
                details={"sae_id": entry.sae_id, "index": c.index, "mode": c.mode},
            )
        if c.condition is not None:
            raise InvalidParameter(
                f"{entry.sae_id!r} is a raw steering vector: a condition reads its "
                "trigger's activation, which a vector has no encoder for",
                param="steering.features.condition",
                details={"sae_id": entry.sae_id, "index": c.index},
            )


__all__ = [
    "ENCODER_MODES",
    "MAX_STEERING_STRENGTH",
    "STEERING_MODES",
    "STEERING_PHASES",
    "SPLICE_MODES",
    "AttachmentKey",
    "FeatureControl",
    "SteeringCondition",
    "SteeringEntry",
    "SteeringSpec",
    "SteeringVector",
    "MAX_CLAMP_BOUND",
    "VECTOR_MODES",
    "check_clamp",
    "refuse_encoder_controls",
]
