"""miLLM's extension objects of a /v1 request (``steering``, ``return_sae_activations``,
``monitoring``, ``capture``, ``analyze``, ``probes``): strict models, a misspelt key refused. The requests
that carry them are in ``inference.protocol``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gpu_engine.api.fields import MAX_STEERING_STRENGTH
from gpu_engine.api.steering import MAX_CLAMP_BOUND
from gpu_engine.api.vectors import as_float32
from inference.protocol_base import MAX_ACTIVATION_FEATURES, MAX_ACTIVATION_TOP_K, _Strict
from steering.rules import ControlInput


class SteeringFeature(ControlInput):
    """``{index, strength}`` adds ``strength · W_dec[index]`` at every position (the
    original shape); ``mode`` (add | clamp | scale | ablate) with ``value``, ``phase``
    (all | prompt | completion), ``window`` ``{start, end}`` and ``condition``
    ``{feature, threshold}`` steer otherwise (docs/steering.md, "Modes"). The one control
    schema of every surface (``steering.rules.ControlInput``); the resolver takes each as
    the engine's ``FeatureControl`` (``control()``)."""


class PackedVector:
    """A decoded inline vector (``gpu_engine.api.vectors.unpack``): its dtype, the bytes as
    sent and its width. Built by ``inference.steering_aliases`` from the request's packed
    ``{dtype, shape, data}`` (or a JSON list), which names a malformed one's field."""

    __slots__ = ("dtype", "raw", "width")

    def __init__(self, dtype: str, raw: bytes, width: int) -> None:
        self.dtype, self.raw, self.width = dtype, raw, width

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        # the wire form it is decoded from, for /api/schema (an instance check has none)
        return {
            "oneOf": [
                {
                    "type": "object",
                    "required": ["dtype", "shape", "data"],
                    "properties": {
                        "dtype": {"type": "string", "enum": ["float32", "float16", "bfloat16"]},
                        "shape": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                        "data": {"type": "string", "contentEncoding": "base64"},
                    },
                },
                {"type": "array", "items": {"type": "number"}},
            ]
        }


MAX_INLINE_VECTORS = 64


class InlineVector(_Strict):
    """``{data, layer?, hook?, strength?, phase?, mode?, min?, max?, value?}``:
    ``strength · data`` added at the attachment whose hook is at ``layer`` (``hook``:
    resid_post, the default, or resid_pre; the attachment the steering object names when
    no layer is given), on the rows ``phase`` selects; ``mode: clamp`` holds the row's
    projection on the unit direction within ``[min, max]`` (``value``: both), blended by
    ``strength`` in [0, 1] (docs/steering.md, "Inline vectors")."""

    model_config = {**_Strict.model_config, "arbitrary_types_allowed": True}

    data: PackedVector
    layer: int | None = Field(default=None, ge=0, le=100_000)
    hook: Literal["resid_post", "resid_pre"] = "resid_post"
    strength: float = Field(default=1.0, ge=-MAX_STEERING_STRENGTH, le=MAX_STEERING_STRENGTH)
    phase: Literal["all", "prompt", "completion"] = "all"
    # a clamp of the projection on the vector's unit direction (docs/steering.md, "Inline vectors")
    mode: Literal["add", "clamp"] = "add"
    min: float | None = Field(default=None, ge=-MAX_CLAMP_BOUND, le=MAX_CLAMP_BOUND)
    max: float | None = Field(default=None, ge=-MAX_CLAMP_BOUND, le=MAX_CLAMP_BOUND)
    value: float | None = Field(default=None, ge=-MAX_CLAMP_BOUND, le=MAX_CLAMP_BOUND)

    @field_validator("data", mode="before")
    @classmethod
    def _decoded(cls, value: Any) -> Any:
        if not isinstance(value, PackedVector):
            # ``inference.steering_aliases`` decodes every vector before validation
            raise ValueError("a vector is {dtype, shape, data} (base64) or a list of numbers")
        return value

    @model_validator(mode="after")
    def _clamp(self) -> InlineVector:
        """``value`` is ``min = max = value``; bounds belong to a clamp."""
        if self.mode == "add":
            if self.min is not None or self.max is not None or self.value is not None:
                raise ValueError("min, max and value bound a clamp: send mode clamp")
            return self
        if self.value is not None:
            if self.min is not None or self.max is not None:
                raise ValueError("a clamp takes value or min/max, not both")
            self.min = self.max = self.value
            self.value = None
        if self.min is None and self.max is None:
            raise ValueError("a clamp needs min, max or value")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError("min is above max")
        if not 0 <= self.strength <= 1:
            raise ValueError("a clamp's strength lies in [0, 1]")
        if not any(as_float32(self.data.dtype, self.data.raw, "data")):
            raise ValueError("a clamp's direction must be non-zero")
        return self


class InlineSteering(_Strict):
    """``{sae_id?, layer?, features: [{index, strength} | {index, mode, value, phase,
    window, condition}], vectors?: [{data, layer?, hook?, strength?, phase?}]}``;
    ``features: []`` (and no vectors) = explicitly unsteered. ``layer`` picks the
    attachment at that layer where several are attached (the shapes of other tools name
    their SAE by layer)."""

    sae_id: str | None = Field(default=None, min_length=1, max_length=200)
    layer: int | None = Field(default=None, ge=0, le=100_000)
    features: list[SteeringFeature] = Field(default_factory=list, max_length=4096)
    vectors: list[InlineVector] = Field(default_factory=list, max_length=MAX_INLINE_VECTORS)

    @model_validator(mode="before")
    @classmethod
    def _asks(cls, data: Any) -> Any:
        if isinstance(data, dict) and "features" not in data and "vectors" not in data:
            raise ValueError("steering needs features (or vectors); features: [] runs unsteered")
        return data


class PositionRange(_Strict):
    start: int = Field(ge=0)
    end: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> PositionRange:
        if self.end <= self.start:
            raise ValueError("positions.end must be greater than positions.start")
        return self


class ReturnSaeActivations(_Strict):
    sae_id: str | None = Field(default=None, min_length=1, max_length=200)
    features: list[int] | None = Field(default=None, max_length=MAX_ACTIVATION_FEATURES)
    top_k: int = Field(default=0, ge=0, le=MAX_ACTIVATION_TOP_K)
    positions: Literal["last", "prompt", "completion", "all"] | PositionRange = "completion"
    read_point: Literal["pre_steering", "post_steering"] = "post_steering"

    @field_validator("features")
    @classmethod
    def _non_negative(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            if any(i < 0 for i in value):
                raise ValueError("feature indices must be >= 0")
            if len(set(value)) != len(value):
                raise ValueError("features names an index twice")
        return value

    @model_validator(mode="after")
    def _asks_something(self) -> ReturnSaeActivations:
        if not self.top_k and not self.features:
            raise ValueError("return_sae_activations asks for nothing: give top_k or features")
        return self


class MonitoringRequest(_Strict):
    """``monitoring``: ``{"fidelity": true, "sae_id"?, "layer"?}`` reports how well the
    attached SAEs (those ``sae_id`` and ``layer`` name; every attached SAE when neither is
    given) reconstruct the residual rows this request reads, under
    ``millm.sae_fidelity`` (``inference.fidelity``)."""

    fidelity: bool = False
    sae_id: str | None = Field(default=None, min_length=1, max_length=200)
    layer: int | None = Field(default=None, ge=0, le=100_000)

    @model_validator(mode="after")
    def _asks_something(self) -> MonitoringRequest:
        if not self.fidelity:
            raise ValueError('monitoring asks for nothing: send "fidelity": true')
        return self


CapturePositions = Literal["last", "all", "prompt", "completion", "last_prompt"]


def _non_negative(value: list[int] | None, what: str) -> list[int] | None:
    if value is not None and any(i < 0 for i in value):
        raise ValueError(f"{what} must be >= 0")
    return value


class AttentionCaptureRequest(_Strict):
    """``capture.attention``: Q and K of these layers' attention, as it uses them
    (``gpu_engine.api.protocol.AttentionCaptureSpec``); K rows at ``positions``, Q rows at
    ``q_positions`` (the same when omitted)."""

    layers: list[int] = Field(min_length=1, max_length=1024)
    heads: list[int] | None = Field(default=None, min_length=1, max_length=4096)
    positions: CapturePositions = "prompt"
    q_positions: CapturePositions | None = None

    _layers = field_validator("layers")(classmethod(lambda cls, v: _non_negative(v, "layers")))
    _heads = field_validator("heads")(classmethod(lambda cls, v: _non_negative(v, "heads")))


class CaptureRequest(_Strict):
    """``capture``: hidden states of these decoder blocks' outputs (after their steering)
    at ``positions``, and/or attention Q/K (``attention``), returned under
    ``millm.capture`` (docs/capture.md)."""

    layers: list[int] = Field(default_factory=list, max_length=1024)
    positions: CapturePositions = "last"
    attention: AttentionCaptureRequest | None = None

    _layers = field_validator("layers")(classmethod(lambda cls, v: _non_negative(v, "layers")))

    @model_validator(mode="after")
    def _asks_something(self) -> CaptureRequest:
        if not self.layers and self.attention is None:
            raise ValueError("capture asks for nothing: give layers or attention")
        return self


MAX_ANALYZERS = 16


class AnalyzeRequest(_Strict):
    """One ``analyze`` entry: an analyzer of the registry by name and its params
    (docs/capture.md, "Analyzers"); its result comes back under ``millm.analysis``."""

    name: str = Field(min_length=1, max_length=100)
    params: dict[str, Any] = Field(default_factory=dict)


MAX_PROBES = 8


class ProbeAsk(_Strict):
    """One ``probes`` entry: a probe by id or name (docs/monitoring.md, "Probes"), read at
    its own positions or at ``positions`` (``last``, ``mean`` or ``max`` over the
    completion rows; over the input's rows in ``POST /api/probes/score``)."""

    name: str = Field(min_length=1, max_length=120)
    positions: Literal["last", "mean", "max"] | None = None
