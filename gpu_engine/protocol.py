"""Jobs, results and events exchanged with the engine — plain dataclasses, JSON-safe.

Every type round-trips through ``to_dict()``/``from_dict()`` with JSON-native values only
(no tuple keys, no tensors), so the same objects travel in-process or over Redis Streams.
Value validation (ranges, types) happens in ``__post_init__`` and raises
``InvalidParameter`` naming the offending field; checks that need the loaded model (vocab,
context window, d_sae) happen in the engine.  This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from .errors import InvalidParameter

MAX_STEERING_STRENGTH = 200.0
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
READ_POINTS = ("pre_steering", "post_steering")
POSITION_KEYWORDS = ("last", "prompt", "completion", "all")
POOLINGS = ("mean", "last", "cls")
FINISH_REASONS = ("stop", "length", "cancelled", "error")


def _num(value: Any, param: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidParameter(f"{param} must be a finite number, got {value!r}", param=param)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise InvalidParameter(f"{param} must be {'>' if lo_open else '>='} {lo}, got {value}", param=param)
    if hi is not None and value > hi:
        raise InvalidParameter(f"{param} must be <= {hi}, got {value}", param=param)
    return float(value)


def _int(value: Any, param: str, *, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(f"{param} must be an integer, got {value!r}", param=param)
    if lo is not None and value < lo:
        raise InvalidParameter(f"{param} must be >= {lo}, got {value}", param=param)
    if hi is not None and value > hi:
        raise InvalidParameter(f"{param} must be <= {hi}, got {value}", param=param)
    return value


class _Wire:
    """asdict-based serialisation; classes with nested or non-JSON fields override."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):  # type: ignore[no-untyped-def]
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})


# --------------------------------------------------------------------------- sampling

@dataclass
class SamplingParams(_Wire):
    """Per-request decoding parameters (OpenAI/vLLM semantics).

    ``temperature == 0`` is greedy. ``top_k <= 0`` disables top-k.  Presence/frequency
    penalties act on generated tokens, the repetition penalty on prompt + generated tokens
    (as vLLM does).  ``max_tokens=None`` means "up to the context window".
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _int(self.max_tokens, "max_tokens", lo=1)
        self.temperature = _num(self.temperature, "temperature", lo=0.0, hi=100.0)
        self.top_p = _num(self.top_p, "top_p", lo=0.0, hi=1.0, lo_open=True)
        _int(self.top_k, "top_k", lo=-1)
        if self.seed is not None:
            _int(self.seed, "seed", lo=-(2**63), hi=2**64 - 1)
        self.repetition_penalty = _num(self.repetition_penalty, "repetition_penalty", lo=0.0, hi=10.0, lo_open=True)
        self.presence_penalty = _num(self.presence_penalty, "presence_penalty", lo=-2.0, hi=2.0)
        self.frequency_penalty = _num(self.frequency_penalty, "frequency_penalty", lo=-2.0, hi=2.0)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise InvalidParameter(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed", param="stop")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameter("stop sequences must be non-empty strings", param="stop")
        self.stop_token_ids = [_int(t, "stop_token_ids", lo=0) for t in (self.stop_token_ids or [])]
        _int(self.top_logprobs, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)


# --------------------------------------------------------------------------- steering

AttachmentKey = tuple[str, int]


@dataclass
class SteeringEntry:
    """Feature strengths for one attachment: ``delta = Σ strength · W_dec[index]``."""

    sae_id: str
    layer: int
    features: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.sae_id, str) or not self.sae_id:
            raise InvalidParameter("steering sae_id must be a non-empty string", param="steering.sae_id")
        _int(self.layer, "steering.layer", lo=0)
        clean: dict[int, float] = {}
        for index, strength in dict(self.features).items():
            if isinstance(index, str) and index.lstrip("-").isdigit():
                index = int(index)
            _int(index, "steering.features.index", lo=0)
            clean[index] = _num(
                strength, "steering.features.strength", lo=-MAX_STEERING_STRENGTH, hi=MAX_STEERING_STRENGTH
            )
        self.features = clean

    @property
    def key(self) -> AttachmentKey:
        return (self.sae_id, self.layer)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sae_id": self.sae_id,
            "layer": self.layer,
            "features": [{"index": i, "strength": s} for i, s in self.features.items()],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SteeringEntry:
        feats = data.get("features") or []
        if isinstance(feats, Mapping):
            features = dict(feats)
        else:
            features = {}
            for f in feats:
                features[f["index"]] = f["strength"]
        return cls(sae_id=data["sae_id"], layer=data["layer"], features=features)


@dataclass
class SteeringSpec:
    """A request's resolved steering.  Empty means explicitly unsteered."""

    entries: list[SteeringEntry] = field(default_factory=list)

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
        return not any(e.features for e in self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [e.to_dict() for e in self.entries]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | list[Any]) -> SteeringSpec:
        entries = data if isinstance(data, list) else data.get("entries", [])
        return cls([SteeringEntry.from_dict(e) for e in entries])


# --------------------------------------------------------------------------- monitoring

@dataclass(frozen=True)
class PositionRange:
    """Residual rows ``start <= position < end`` (``end=None``: to the last row)."""

    start: int = 0
    end: int | None = None

    def __post_init__(self) -> None:
        _int(self.start, "positions.start", lo=0)
        if self.end is not None:
            _int(self.end, "positions.end", lo=self.start)


Positions = str | PositionRange


@dataclass
class MonitorEntry:
    """What to read from one attachment.

    Positions index *residual rows* of the full sequence: rows ``0..P-1`` are the prompt;
    the completion token ``i`` is produced from row ``P-1+i`` and its record travels with
    that token.  ``completion`` = those rows, ``last`` = the last row computed, ``all`` =
    every row computed.  ``top_k`` features are the largest non-zero activations;
    ``features`` are always reported (zero included).

    ``stream=False`` (default): rows are encoded in one batch when the request ends and
    every record arrives in the ``FinishEvent`` (cheapest: the encoder is read once).
    ``stream=True``: each step is encoded as it runs and a completion row's record travels
    with its ``TokenEvent`` (``positions="last"`` is always delivered at the end).
    """

    sae_id: str
    layer: int
    top_k: int = 0
    features: list[int] = field(default_factory=list)
    read_point: str = "post_steering"
    positions: Positions = "completion"
    stream: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.sae_id, str) or not self.sae_id:
            raise InvalidParameter("monitor sae_id must be a non-empty string", param="monitor.sae_id")
        _int(self.layer, "monitor.layer", lo=0)
        _int(self.top_k, "monitor.top_k", lo=0, hi=1024)
        self.features = [_int(f, "monitor.features", lo=0) for f in self.features]
        if self.read_point not in READ_POINTS:
            raise InvalidParameter(f"read_point must be one of {READ_POINTS}", param="monitor.read_point")
        if isinstance(self.positions, Mapping):
            self.positions = PositionRange(**self.positions)
        if isinstance(self.positions, str) and self.positions not in POSITION_KEYWORDS:
            raise InvalidParameter(f"positions must be one of {POSITION_KEYWORDS} or {{start, end}}", param="monitor.positions")
        if not self.top_k and not self.features:
            raise InvalidParameter("monitor entry asks for nothing: give top_k or features", param="monitor")

    @property
    def key(self) -> AttachmentKey:
        return (self.sae_id, self.layer)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if isinstance(self.positions, PositionRange):
            d["positions"] = {"start": self.positions.start, "end": self.positions.end}
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MonitorEntry:
        return cls(**{k: v for k, v in data.items() if k in {f.name for f in fields(cls)}})


@dataclass
class MonitorSpec:
    entries: list[MonitorEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        seen: set[tuple[str, int, str]] = set()
        for e in self.entries:
            k = (e.sae_id, e.layer, e.read_point)
            if k in seen:
                raise InvalidParameter(f"duplicate monitor entry for {k}", param="monitor")
            seen.add(k)

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [e.to_dict() for e in self.entries]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | list[Any]) -> MonitorSpec:
        entries = data if isinstance(data, list) else data.get("entries", [])
        return cls([MonitorEntry.from_dict(e) for e in entries])


@dataclass
class FeatureActivation(_Wire):
    feature_index: int
    activation: float


@dataclass
class ActivationRecord:
    sae_id: str
    layer: int
    read_point: str
    position: int
    token_index: int | None = None  # completion token index, None for prompt-only rows
    top_k: list[FeatureActivation] = field(default_factory=list)
    features: list[FeatureActivation] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ActivationRecord:
        d = dict(data)
        d["top_k"] = [FeatureActivation.from_dict(x) for x in d.get("top_k", [])]
        d["features"] = [FeatureActivation.from_dict(x) for x in d.get("features", [])]
        return cls(**d)


# --------------------------------------------------------------------------- jobs

@dataclass
class GenerationJob:
    """One generation request.  Exactly one of prompt / prompt_token_ids / messages.

    ``steering=None`` and an empty spec both mean unsteered: live steering set by an
    operator is resolved by the caller into this field.
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    steering: SteeringSpec | None = None
    monitor: MonitorSpec | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise InvalidParameter("give exactly one of prompt, prompt_token_ids, messages", param="prompt")
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise InvalidParameter("prompt_token_ids is empty", param="prompt")
            self.prompt_token_ids = [_int(t, "prompt", lo=0) for t in self.prompt_token_ids]
        if self.messages is not None and not self.messages:
            raise InvalidParameter("messages is empty", param="messages")

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "messages": self.messages,
            "sampling": self.sampling.to_dict(),
            "steering": self.steering.to_dict() if self.steering is not None else None,
            "monitor": self.monitor.to_dict() if self.monitor is not None else None,
            "add_generation_prompt": self.add_generation_prompt,
            "add_special_tokens": self.add_special_tokens,
            "chat_template_kwargs": self.chat_template_kwargs,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationJob:
        d = dict(data)
        d["sampling"] = SamplingParams.from_dict(d.get("sampling") or {})
        d["steering"] = SteeringSpec.from_dict(d["steering"]) if d.get("steering") is not None else None
        d["monitor"] = MonitorSpec.from_dict(d["monitor"]) if d.get("monitor") is not None else None
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in fields(cls)}})


@dataclass
class EmbedJob(_Wire):
    request_id: str
    inputs: list[Any] = field(default_factory=list)  # str or list[int] each
    pooling: str = "mean"
    normalize: bool = True

    def __post_init__(self) -> None:
        if not self.inputs:
            raise InvalidParameter("inputs is empty", param="input")
        if self.pooling not in POOLINGS:
            raise InvalidParameter(f"pooling must be one of {POOLINGS}", param="pooling")


@dataclass
class ScoreJob(_Wire):
    """Next-token log-probabilities after a prompt (never steered or monitored)."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    top_k: int = 0
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: bool = False
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise InvalidParameter("give exactly one of prompt, prompt_token_ids", param="prompt")
        _int(self.top_k, "top_k", lo=0)


@dataclass
class LoadModelJob(_Wire):
    model_id: str
    path: str
    dtype: str = "float32"
    device: str = "auto"
    trust_remote_code: bool = False
    max_context_length: int | None = None
    # CPU float32: repack linear weights for oneDNN at load (backends/transformers/cpu_kernels.py)
    pack_cpu_weights: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidParameter("dtype must be float32, bfloat16 or float16", param="dtype")
        if not (self.device in ("cpu", "cuda", "auto") or self.device.startswith("cuda:")):
            raise InvalidParameter("device must be cpu, cuda, cuda:N or auto", param="device")


@dataclass
class BatchingOptions(_Wire):
    """How the engine runs generations (an ``Engine`` constructor option).

    ``enabled=False``: the serial backend, one generation at a time in arrival order.
    ``enabled=True``: continuous batching — requests join the running batch between
    decode steps (up to ``max_batch_size`` rows) and leave it when they finish, each with
    its own sampling, seed, stops, steering and monitoring.  ``max_queue_size`` bounds the
    requests waiting for a row (more are refused with ``engine_busy``).  Each scheduler
    iteration prefills waiting requests until ``prefill_budget_tokens`` prompt tokens
    have been spent (always at least one), so a burst of long prompts does not stall the
    running rows for long.  ``force_serial_monitoring`` runs requests that monitor
    anything alone (the old CBM_FORCE_SERIAL_MONITORING; attribution is exact either way).
    """

    enabled: bool = False
    max_batch_size: int = 16
    max_queue_size: int = 256
    prefill_budget_tokens: int = 512
    force_serial_monitoring: bool = False

    def __post_init__(self) -> None:
        _int(self.max_batch_size, "max_batch_size", lo=1, hi=4096)
        _int(self.max_queue_size, "max_queue_size", lo=1)
        _int(self.prefill_budget_tokens, "prefill_budget_tokens", lo=1)


@dataclass
class AttachSpec(_Wire):
    sae_id: str
    path: str
    layer: int
    layout: str | None = None

    def __post_init__(self) -> None:
        if not self.sae_id:
            raise InvalidParameter("sae_id must be non-empty", param="sae_id")
        _int(self.layer, "layer", lo=0)


# --------------------------------------------------------------------------- results & events

@dataclass
class Usage(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass
class LogprobEntry(_Wire):
    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top_logprobs: list[LogprobEntry] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenLogprob:
        d = dict(data)
        d["top_logprobs"] = [LogprobEntry.from_dict(x) for x in d.get("top_logprobs", [])]
        return cls(**d)


@dataclass
class SteeringCount(_Wire):
    sae_id: str
    layer: int
    count: int


@dataclass
class AttachResult(_Wire):
    sae_id: str
    layer: int
    layer_module_path: str
    d_in: int
    d_sae: int
    activation: str
    layout: str
    warnings: list[str] = field(default_factory=list)


@dataclass
class AttachmentStatus(_Wire):
    sae_id: str
    layer: int
    layer_module_path: str
    d_in: int
    d_sae: int
    activation: str
    layout: str
    path: str
    steering_apply_count: int = 0


@dataclass
class EngineStatus:
    state: str  # "empty" | "ready"
    backend: str = "transformers"
    model_id: str | None = None
    model_path: str | None = None
    dtype: str | None = None
    device: str | None = None
    context_length: int | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    attachments: list[AttachmentStatus] = field(default_factory=list)
    in_flight: int = 0
    queued: int = 0
    # the generation backend's mode and capabilities (``Engine.batching_status()``)
    batching: dict[str, Any] = field(default_factory=dict)
    # which matmul kernels the model runs on: "onednn_packed" (CPU float32, weights
    # prepacked at load) or "default" (PyTorch's own); None while no model is loaded
    kernels: str | None = None
    # "unloading" or "loading" while the engine drains the work already accepted before
    # it changes the model: new work is refused (engine_busy) until it is done
    draining: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineStatus:
        d = dict(data)
        d["attachments"] = [AttachmentStatus.from_dict(a) for a in d.get("attachments", [])]
        return cls(**d)


@dataclass
class EmbedResult(_Wire):
    request_id: str
    embeddings: list[list[float]]
    usage: Usage

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EmbedResult:
        return cls(data["request_id"], data["embeddings"], Usage.from_dict(data["usage"]))


@dataclass
class ScoreResult:
    request_id: str
    prompt_tokens: int
    top: list[LogprobEntry] = field(default_factory=list)
    allowed: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScoreResult:
        d = dict(data)
        d["top"] = [LogprobEntry.from_dict(x) for x in d.get("top", [])]
        d["allowed"] = [LogprobEntry.from_dict(x) for x in d.get("allowed", [])]
        return cls(**d)


@dataclass
class TokenEvent:
    """One generated token; ``text`` is the text delta it releases (may be empty while a
    multi-byte character or a possible stop-sequence prefix is held back)."""

    type: ClassVar[str] = "token"
    request_id: str
    index: int
    token_id: int
    text: str
    logprob: TokenLogprob | None = None
    activations: list[ActivationRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "request_id": self.request_id,
            "index": self.index,
            "token_id": self.token_id,
            "text": self.text,
            "logprob": self.logprob.to_dict() if self.logprob else None,
            "activations": [a.to_dict() for a in self.activations],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenEvent:
        return cls(
            request_id=data["request_id"],
            index=data["index"],
            token_id=data["token_id"],
            text=data["text"],
            logprob=TokenLogprob.from_dict(data["logprob"]) if data.get("logprob") else None,
            activations=[ActivationRecord.from_dict(a) for a in data.get("activations", [])],
        )


@dataclass
class FinishEvent:
    """Last event of a successful (or cancelled) generation."""

    type: ClassVar[str] = "finish"
    request_id: str
    finish_reason: str
    text: str
    token_ids: list[int]
    usage: Usage
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    # records not delivered with a token event: prompt rows that produced no token, and
    # the single record of ``positions="last"``
    activations: list[ActivationRecord] = field(default_factory=list)
    steering_apply_count: list[SteeringCount] = field(default_factory=list)
    forward_passes: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["type"] = self.type
        d["usage"] = self.usage.to_dict()
        d["activations"] = [a.to_dict() for a in self.activations]
        d["steering_apply_count"] = [c.to_dict() for c in self.steering_apply_count]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FinishEvent:
        d = {k: v for k, v in data.items() if k != "type"}
        d["usage"] = Usage.from_dict(d["usage"])
        d["activations"] = [ActivationRecord.from_dict(a) for a in d.get("activations", [])]
        d["steering_apply_count"] = [SteeringCount.from_dict(c) for c in d.get("steering_apply_count", [])]
        return cls(**d)


@dataclass
class ErrorEvent:
    type: ClassVar[str] = "error"
    request_id: str
    code: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "request_id": self.request_id, "code": self.code,
                "message": self.message, "details": self.details}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ErrorEvent:
        return cls(data["request_id"], data["code"], data["message"], dict(data.get("details") or {}))

    def to_exception(self):  # type: ignore[no-untyped-def]
        from .errors import error_from_dict

        return error_from_dict({"code": self.code, "message": self.message, "details": self.details})


@dataclass
class EngineEvent(_Wire):
    """Something operators should hear about (``sae:detached`` after an OOM, …)."""

    name: str
    data: dict[str, Any] = field(default_factory=dict)


GenerationEvent = TokenEvent | FinishEvent | ErrorEvent
_EVENT_TYPES: dict[str, Any] = {"token": TokenEvent, "finish": FinishEvent, "error": ErrorEvent}


def event_from_dict(data: Mapping[str, Any]) -> GenerationEvent:
    try:
        cls = _EVENT_TYPES[data["type"]]
    except KeyError:
        raise ValueError(f"unknown generation event type {data.get('type')!r}") from None
    return cls.from_dict(data)


@dataclass
class GenerationResult:
    """A whole generation, gathered from its events (what a non-streaming caller wants)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    activations: list[ActivationRecord] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    steering_apply_count: list[SteeringCount] = field(default_factory=list)
    forward_passes: int = 0

    @classmethod
    def from_events(cls, events: Iterable[GenerationEvent]) -> GenerationResult:
        tokens: list[TokenEvent] = []
        for ev in events:
            if isinstance(ev, ErrorEvent):
                raise ev.to_exception()
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
            elif isinstance(ev, FinishEvent):
                activations = list(ev.activations)
                for t in tokens:
                    activations.extend(t.activations)
                activations.sort(key=lambda a: (a.sae_id, a.layer, a.read_point, a.position))
                return cls(
                    request_id=ev.request_id,
                    text=ev.text,
                    token_ids=list(ev.token_ids),
                    finish_reason=ev.finish_reason,
                    usage=ev.usage,
                    logprobs=[t.logprob for t in tokens],
                    activations=activations,
                    prompt_logprobs=ev.prompt_logprobs,
                    steering_apply_count=ev.steering_apply_count,
                    forward_passes=ev.forward_passes,
                )
        raise RuntimeError("generation ended without a finish event")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationResult:
        d = dict(data)
        d["usage"] = Usage.from_dict(d["usage"])
        d["logprobs"] = [TokenLogprob.from_dict(x) if x else None for x in d.get("logprobs", [])]
        d["activations"] = [ActivationRecord.from_dict(a) for a in d.get("activations", [])]
        d["steering_apply_count"] = [SteeringCount.from_dict(c) for c in d.get("steering_apply_count", [])]
        return cls(**d)
