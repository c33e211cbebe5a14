"""Jobs, results and events exchanged with the engine: typed ``msgspec`` structs.

The same objects travel in-process (embedded) or as JSON over Redis Streams; their
serialisation is msgspec's own (``to_json`` / ``from_json`` here, typed by the declared
field types), never hand-written. Value validation (ranges, cross-field rules) happens in
``__post_init__`` — which runs on construction and on decoding alike — and raises
``InvalidParameter`` naming the offending field; a decoded value of the wrong type is
refused as ``InvalidParameter`` too. Checks that need the loaded model (vocab, context
window, d_sae) happen in the engine. This module imports no torch.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import msgspec

from .errors import InvalidParameter

T = TypeVar("T")

MAX_STEERING_STRENGTH = 200.0
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: a bias lies in [-100, 100]
READ_POINTS = ("pre_steering", "post_steering")
POSITION_KEYWORDS = ("last", "prompt", "completion", "all")
POOLINGS = ("mean", "last", "cls")
FINISH_REASONS = ("stop", "length", "cancelled", "error")
# "interactive": a /v1 request someone waits on; "batch": a Batch API line, admitted only
# when no interactive request waits and only into the rows batch work may hold
PRIORITIES = ("interactive", "batch")


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


# --------------------------------------------------------------------------- serialisation

def _enc_hook(value: Any) -> Any:
    # numpy / torch scalars (np.float64 and friends) that slip into a result: their value
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    # anything else in a message is a programming error, named as such
    raise TypeError(f"{type(value).__name__} is not a protocol value")


_ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)
_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


def to_json(obj: Any) -> bytes:
    """JSON bytes of a protocol value (a struct, a list of them, a builtin)."""
    return _ENCODER.encode(obj)


def from_json(data: bytes | str, type_: type[T] | Any) -> T:
    """The typed value ``type_`` decoded from JSON; unknown fields are ignored (a web
    process and an engine of another build can still talk). A value of the wrong shape
    is refused as ``InvalidParameter`` naming where it is (``sampling.top_p``)."""
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None
    except msgspec.DecodeError as exc:
        raise InvalidParameter(f"not valid JSON: {exc}", param="json") from None


def to_builtins(obj: Any) -> Any:
    """A protocol value as JSON-native Python values (dicts, lists, str, numbers)."""
    return msgspec.to_builtins(obj, enc_hook=_enc_hook)


def from_builtins(data: Any, type_: type[T] | Any) -> T:
    """The typed value ``type_`` from JSON-native Python values (``json.loads`` output)."""
    try:
        # not strict: after json.loads, integer dict keys (feature indices) are strings
        return msgspec.convert(data, type_, strict=False)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: msgspec.ValidationError) -> InvalidParameter:
    match = _PATH.search(str(exc))
    return InvalidParameter(str(exc), param=(match.group("path") if match else "") or "job")


# --------------------------------------------------------------------------- sampling

STRUCTURED_TYPES = ("json_object", "json_schema", "tool_call")
# how a chat template writes a tool call (``capabilities()["tool_call_format"]``):
# ``hermes`` <tool_call>\n{"name": …, "arguments": {…}}\n</tool_call> (Hermes, Qwen, SmolLM3),
# ``json`` a bare {"name": …, "arguments": {…}} object
TOOL_CALL_FORMATS = ("hermes", "json")
# tool_choice "required" (or a named function): exactly one call and nothing else;
# "auto": free text, where each call the model opens is constrained (hermes only);
# "auto_single": the same with at most one call, the output ending after it
TOOL_CALL_MODES = ("required", "auto", "auto_single")


class StructuredOutput(msgspec.Struct, frozen=True):
    """Constrained decoding of a request's output (/v1 ``response_format``): a JSON object
    (``json_object``), or JSON valid against ``schema`` (``json_schema``; the schema as
    JSON text, which is also the key compiled grammars are cached by).  Whether the schema
    is inside the supported subset is checked by the web tier before anything runs and by
    the backend's grammar compiler (``response_format_unsupported``).

    ``tool_call`` (/v1 ``tools`` with ``tool_choice``): ``schema`` is the JSON text of the
    functions ``[{"name", "parameters"}]``, ``tool_format`` how the template writes a call
    and ``tool_mode`` whether only a call may come (``TOOL_CALL_MODES``)."""

    type: str
    schema: str = ""
    tool_format: str = ""
    tool_mode: str = ""

    def __post_init__(self) -> None:
        if self.type not in STRUCTURED_TYPES:
            raise InvalidParameter(f"structured.type must be one of {', '.join(STRUCTURED_TYPES)}, "
                                   f"got {self.type!r}", param="response_format")
        if (self.type in ("json_schema", "tool_call")) != bool(self.schema):
            raise InvalidParameter("structured.schema is given exactly when the type is json_schema or tool_call",
                                   param="response_format")
        if self.type == "tool_call":
            if self.tool_format not in TOOL_CALL_FORMATS or self.tool_mode not in TOOL_CALL_MODES:
                raise InvalidParameter(f"a tool_call grammar needs tool_format in {TOOL_CALL_FORMATS} and "
                                       f"tool_mode in {TOOL_CALL_MODES}", param="tool_choice")
            if self.tool_format == "json" and self.tool_mode != "required":
                # a bare JSON call has no opening marker to constrain from
                raise InvalidParameter("tool_mode auto needs the hermes tool_format", param="tool_choice")
        elif self.tool_format or self.tool_mode:
            raise InvalidParameter("tool_format and tool_mode belong to the tool_call type", param="tool_choice")
        if self.schema:
            try:
                msgspec.json.decode(self.schema)
            except msgspec.DecodeError as exc:
                raise InvalidParameter(f"structured.schema is not JSON: {exc}", param="response_format") from None


class SamplingParams(msgspec.Struct):
    """Per-request decoding parameters (OpenAI/vLLM semantics).

    ``temperature == 0`` is greedy. ``top_k <= 0`` disables top-k.  Presence/frequency
    penalties act on generated tokens, the repetition penalty on prompt + generated tokens
    (as vLLM does).  ``logit_bias`` (token id -> bias in [-100, 100]) is added to the
    model's logits before the penalties and before any token is chosen, greedy included.
    ``max_tokens=None`` means "up to the context window", or up to ``max_tokens_default``
    when that is set and smaller (a server default that never refuses a request: a long
    prompt gets what room is left).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    # on the JSON wire the ids are object keys ("5"); the vocabulary is checked by the engine
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    # the prompt tokens' own log-probabilities (FinishEvent.prompt_logprobs) and, with
    # prompt_top_logprobs > 0, the top alternatives at every prompt position
    # (FinishEvent.prompt_top_logprobs), all read from the request's own prefill: steered
    # as the request is, one forward whatever the prompt's length
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0
    # the text of every prompt and completion token (FinishEvent.prompt_tokens/tokens)
    # and of the whole prompt (TokenEvent.prompt_text on the first token, and
    # FinishEvent.prompt_text): the tokenizer is the engine's, never the web tier's
    token_texts: bool = False
    max_tokens_default: int | None = None
    # response_format: the output is constrained to this grammar (backends reporting
    # ``structured_output``); EOS is allowed only where the grammar is complete
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _int(self.max_tokens, "max_tokens", lo=1)
        if self.max_tokens_default is not None:
            _int(self.max_tokens_default, "max_tokens_default", lo=1)
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
        self.logit_bias = {_int(t, "logit_bias", lo=0): _num(b, "logit_bias", lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
                           for t, b in (self.logit_bias or {}).items()}
        _int(self.top_logprobs, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
        _int(self.prompt_top_logprobs, "prompt_top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
        if self.prompt_top_logprobs and not self.prompt_logprobs:
            raise InvalidParameter("prompt_top_logprobs needs prompt_logprobs", param="prompt_top_logprobs")


# --------------------------------------------------------------------------- steering

AttachmentKey = tuple[str, int]


STEERING_MODES = ("add", "clamp", "scale", "ablate")
STEERING_PHASES = ("all", "prompt", "completion")


class SteeringCondition(msgspec.Struct, frozen=True):
    """Steer a position only where feature ``feature`` of the same SAE, encoded from the
    residual arriving at the hook (before this attachment's delta), is above ``threshold``."""

    feature: int
    threshold: float = 0.0

    def __post_init__(self) -> None:
        _int(self.feature, "steering.condition.feature", lo=0)
        _num(self.threshold, "steering.condition.threshold", lo=-1e6, hi=1e6)


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

    index: int
    mode: str = "add"
    value: float = 0.0
    phase: str = "all"
    window: PositionRange | None = None
    condition: SteeringCondition | None = None

    def __post_init__(self) -> None:
        _int(self.index, "steering.features.index", lo=0)
        if self.mode not in STEERING_MODES:
            raise InvalidParameter(f"steering mode must be one of {', '.join(STEERING_MODES)}, got {self.mode!r}",
                                   param="steering.features.mode")
        if self.phase not in STEERING_PHASES:
            raise InvalidParameter(f"steering phase must be one of {', '.join(STEERING_PHASES)}, got {self.phase!r}",
                                   param="steering.features.phase")
        self.value = _num(self.value, "steering.features.value", lo=-MAX_STEERING_STRENGTH, hi=MAX_STEERING_STRENGTH)
        if self.mode == "ablate" and self.value != 0:
            raise InvalidParameter("ablate takes no value", param="steering.features.value")
        if isinstance(self.window, Mapping):
            self.window = PositionRange(**self.window)
        if isinstance(self.condition, Mapping):
            self.condition = SteeringCondition(**self.condition)

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
    """

    sae_id: str
    layer: int
    features: dict[int, float] = msgspec.field(default_factory=dict)
    controls: list[FeatureControl] = msgspec.field(default_factory=list)

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
        controls = []
        for c in self.controls:
            c = FeatureControl(**c) if isinstance(c, Mapping) else c
            if c.index in clean or any(o.index == c.index for o in controls):
                raise InvalidParameter(f"steering names feature {c.index} twice", param="steering.features",
                                       details={"index": c.index})
            if c.plain:
                clean[c.index] = c.value
            else:
                controls.append(c)
        self.features = clean
        self.controls = controls

    def indices(self) -> list[int]:
        """Every feature index the entry reads or writes (conditions' triggers included)."""
        out = list(self.features)
        for c in self.controls:
            out.append(c.index)
            if c.condition is not None:
                out.append(c.condition.feature)
        return out

    def is_empty(self) -> bool:
        return not self.features and not any(not c.no_op for c in self.controls)

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
        return any(e.controls for e in self.entries)

    def canonical_text(self) -> str:
        """The applied set, one line per feature that changes something, in a form every
        language can write exactly (docs/steering.md, "The steering hash"):
        ``<sae_id>\t<layer>\t<index>\t<strength as 16 hex digits of its IEEE-754 binary64
        bits, big-endian>\n`` for a plain add, and for a control
        ``<sae_id>\t<layer>\t<index>\tmode=<mode>[\tvalue=<bits>][\tphase=<phase>]``
        ``[\twindow=<start>:<end or empty>][\tif=<feature>><threshold bits>]\n``; lines
        sorted by (sae_id as UTF-8 bytes, layer, index).  An add of 0 or a scale by 1
        changes nothing and writes no line; -0.0 is 0."""
        lines = []
        for e in self.entries:
            for index, strength in e.features.items():
                if strength == 0:
                    continue
                lines.append((e.sae_id.encode(), e.layer, index, f"{e.sae_id}\t{e.layer}\t{index}\t{_bits(strength)}\n"))
            for c in e.controls:
                if not c.no_op:
                    lines.append((e.sae_id.encode(), e.layer, c.index, c.canonical_line(e.sae_id, e.layer)))
        return "".join(line for *_, line in sorted(lines))

    def canonical_hash(self) -> str:
        """``sha256:<hex>`` of ``canonical_text()`` (UTF-8): equal for two specs that add the
        same deltas, whatever their order or spelling; an empty set hashes the empty text."""
        return "sha256:" + hashlib.sha256(self.canonical_text().encode()).hexdigest()


# --------------------------------------------------------------------------- monitoring

class PositionRange(msgspec.Struct, frozen=True):
    """Residual rows ``start <= position < end`` (``end=None``: to the last row)."""

    start: int = 0
    end: int | None = None

    def __post_init__(self) -> None:
        _int(self.start, "positions.start", lo=0)
        if self.end is not None:
            _int(self.end, "positions.end", lo=self.start)


Positions = str | PositionRange


class MonitorEntry(msgspec.Struct):
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
    features: list[int] = msgspec.field(default_factory=list)
    read_point: str = "post_steering"
    positions: Positions = "completion"
    stream: bool = False
    # who asked (``""``: the request itself): entries of the same attachment and read
    # point with different tags are read apart, and each record carries its entry's tag
    # (probes and sensing ride on monitors without colliding with the request's own)
    tag: str = ""

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


class MonitorSpec(msgspec.Struct):
    entries: list[MonitorEntry] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        seen: set[tuple[str, int, str, str]] = set()
        for e in self.entries:
            k = (e.sae_id, e.layer, e.read_point, e.tag)
            if k in seen:
                raise InvalidParameter(f"duplicate monitor entry for {k}", param="monitor")
            seen.add(k)


class FeatureActivation(msgspec.Struct):
    feature_index: int
    activation: float


class ActivationRecord(msgspec.Struct):
    sae_id: str
    layer: int
    read_point: str
    position: int
    token_index: int | None = None  # completion token index, None for prompt-only rows
    top_k: list[FeatureActivation] = msgspec.field(default_factory=list)
    features: list[FeatureActivation] = msgspec.field(default_factory=list)
    tag: str = ""  # the entry's ``MonitorEntry.tag``


# --------------------------------------------------------------------------- capture

CAPTURE_POSITIONS = ("last", "all", "prompt", "completion", "last_prompt")


def _positions(value: Any, param: str) -> str:
    if value not in CAPTURE_POSITIONS:
        raise InvalidParameter(f"{param} must be one of {CAPTURE_POSITIONS}", param=param)
    return value


class AttentionCaptureSpec(msgspec.Struct):
    """Attention queries and keys to capture (``gpu_engine.capture``), as the attention
    uses them: after the model's position encoding (rotary), per query head for Q and per
    KV head for K.

    ``heads``: query heads (``None``: all); K keeps the KV heads they read
    (``h // (num_heads // num_kv_heads)``).  ``positions``: K rows, ``q_positions`` Q rows
    (``None``: the same), in the modes of ``CaptureSpec.positions``.
    """

    layers: list[int]
    heads: list[int] | None = None
    positions: str = "prompt"
    q_positions: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, list) or not self.layers:
            raise InvalidParameter("capture.attention.layers must list at least one layer",
                                   param="capture.attention.layers")
        self.layers = sorted({_int(x, "capture.attention.layers", lo=0) for x in self.layers})
        if self.heads is not None:
            if not isinstance(self.heads, list) or not self.heads:
                raise InvalidParameter("capture.attention.heads must list at least one head (or be null: all)",
                                       param="capture.attention.heads")
            self.heads = sorted({_int(x, "capture.attention.heads", lo=0) for x in self.heads})
        _positions(self.positions, "capture.attention.positions")
        if self.q_positions is not None:
            _positions(self.q_positions, "capture.attention.q_positions")

    @property
    def query_positions(self) -> str:
        return self.q_positions if self.q_positions is not None else self.positions


class CaptureSpec(msgspec.Struct):
    """Hidden states (and attention Q/K) to capture for one request (``gpu_engine.capture``).

    ``layers``: decoder blocks whose output is captured, after every steering on that
    block (what block ``layer + 1`` reads).  ``positions`` index residual rows as
    ``MonitorEntry`` does: ``prompt`` = rows ``0..P-1``, ``completion`` = the rows that
    produced each generated token (``P-1+i``), ``all`` = every row computed, ``last`` = the
    last row computed, ``last_prompt`` = row ``P-1`` (the prompt's last token).
    ``attention``: Q/K of chosen layers and heads (``AttentionCaptureSpec``); a spec asks
    for hidden states, attention or both.  ``max_bytes`` (0: no limit) refuses, before
    anything runs, a capture whose worst case is larger; an artifact of at most
    ``inline_max_bytes`` comes back in the ``FinishEvent``, a larger one is written under
    ``directory`` (inline when unset). ``store_max_bytes`` (None: no quota) is the room
    left under the directory's quota: a capture whose worst case could be stored and is
    larger is refused (``capture_store_full``) before anything runs.
    """

    layers: list[int] = msgspec.field(default_factory=list)
    positions: str = "last"
    max_bytes: int = 0
    inline_max_bytes: int = 0
    directory: str | None = None
    store_max_bytes: int | None = None
    model: str = ""  # the name the sidecar records (the engine's model id when empty)
    attention: AttentionCaptureSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, list) or (not self.layers and self.attention is None):
            raise InvalidParameter("capture.layers must list at least one layer (or give capture.attention)",
                                   param="capture.layers")
        self.layers = sorted({_int(x, "capture.layers", lo=0) for x in self.layers})
        _positions(self.positions, "capture.positions")
        _int(self.max_bytes, "capture.max_bytes", lo=0)
        _int(self.inline_max_bytes, "capture.inline_max_bytes", lo=0)


class CaptureResult(msgspec.Struct):
    """A finished request's capture: the safetensors file's bytes (``data``, inline) or
    its file name under the spec's directory (``file``, stored), and its sidecar."""

    capture_id: str
    nbytes: int
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    data: bytes | None = None
    file: str | None = None


# --------------------------------------------------------------------------- jobs

# chat_template_kwargs keys that would replace what the engine itself passes when it
# renders a chat template (the conversation, the generation prompt, the request's tools,
# the special tokens) or change what rendering returns (tokenize, return_*, padding, …):
# refused by name. Every other key is a variable of the template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
})


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """``chat_template_kwargs`` without a key of ``RESERVED_TEMPLATE_KWARGS``."""
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidParameter(f"chat_template_kwargs.{key} is set by the server and cannot be given",
                                   param=f"chat_template_kwargs.{key}")


class GenerationJob(msgspec.Struct):
    """One generation request.  Exactly one of prompt / prompt_token_ids / messages.

    ``steering=None`` and an empty spec both mean unsteered: live steering set by an
    operator is resolved by the caller into this field.
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    steering: SteeringSpec | None = None
    monitor: MonitorSpec | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    priority: str = "interactive"  # PRIORITIES
    capture: CaptureSpec | None = None
    # function tools as chat templates take them ({"type": "function", "function": {name,
    # description?, parameters}}), rendered by the template (backends reporting
    # ``tool_calling``); None: the template is applied without tools
    tools: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise InvalidParameter(f"priority must be one of {PRIORITIES}", param="priority")
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise InvalidParameter("give exactly one of prompt, prompt_token_ids, messages", param="prompt")
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise InvalidParameter("prompt_token_ids is empty", param="prompt")
            self.prompt_token_ids = [_int(t, "prompt", lo=0) for t in self.prompt_token_ids]
        if self.messages is not None and not self.messages:
            raise InvalidParameter("messages is empty", param="messages")
        check_template_kwargs(self.chat_template_kwargs)


class EmbedJob(msgspec.Struct):
    request_id: str
    inputs: list[str | list[int]] = msgspec.field(default_factory=list)  # text or token ids
    pooling: str = "mean"
    normalize: bool = True
    priority: str = "interactive"  # PRIORITIES: batch embeddings wait behind interactive work

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise InvalidParameter(f"priority must be one of {PRIORITIES}", param="priority")
        if not self.inputs:
            raise InvalidParameter("inputs is empty", param="input")
        if self.pooling not in POOLINGS:
            raise InvalidParameter(f"pooling must be one of {POOLINGS}", param="pooling")


class ScoreJob(msgspec.Struct):
    """Next-token log-probabilities after a prompt (never steered or monitored): a
    prompt's text, its token ids, or chat ``messages`` rendered with the model's template
    (a generation prompt added)."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    top_k: int = 0
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: bool = False
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)) != 1:
            raise InvalidParameter("give exactly one of prompt, prompt_token_ids, messages", param="prompt")
        _int(self.top_k, "top_k", lo=0)
        check_template_kwargs(self.chat_template_kwargs)


HIDDEN_POOLINGS = ("last", "mean")


class HiddenStatesJob(msgspec.Struct):
    """The residual stream after decoder blocks ``layers`` (``resid_post``: each block's
    output, where a vector attached at that layer is added) for each input, pooled over
    its tokens: ``last`` (the last token) or ``mean``.  Never steered or monitored.  What
    computing a steering vector from contrastive prompt pairs reads."""

    request_id: str
    inputs: list[str | list[int]] = msgspec.field(default_factory=list)  # text or token ids
    layers: list[int] = msgspec.field(default_factory=list)
    pooling: str = "last"
    add_special_tokens: bool = True
    priority: str = "interactive"  # PRIORITIES

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise InvalidParameter(f"priority must be one of {PRIORITIES}", param="priority")
        if not self.inputs:
            raise InvalidParameter("inputs is empty", param="inputs")
        if not self.layers:
            raise InvalidParameter("layers is empty", param="layers")
        self.layers = [_int(layer, "layers", lo=0) for layer in self.layers]
        if len(set(self.layers)) != len(self.layers):
            raise InvalidParameter("layers names a layer twice", param="layers")
        if self.pooling not in HIDDEN_POOLINGS:
            raise InvalidParameter(f"pooling must be one of {HIDDEN_POOLINGS}", param="pooling")


class LoadModelJob(msgspec.Struct):
    model_id: str
    path: str
    dtype: str = "float32"
    device: str = "auto"
    trust_remote_code: bool = False
    max_context_length: int | None = None
    # the registered backend that loads and runs it (``gpu_engine.backends``)
    backend: str = "transformers"
    # that backend's own load options, checked against its registry entry at load
    options: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidParameter("dtype must be float32, bfloat16 or float16", param="dtype")
        if not (self.device in ("cpu", "cuda", "auto") or self.device.startswith("cuda:")):
            raise InvalidParameter("device must be cpu, cuda, cuda:N or auto", param="device")


class BatchingOptions(msgspec.Struct):
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

    ``batch_rows``: rows beyond ``max_batch_size`` that only ``priority="batch"`` work may
    hold (Batch API lines), so interactive requests always find one of their own
    ``max_batch_size`` rows free; 0 lets batch work take free interactive rows instead.
    Batch work is admitted only in an iteration where no interactive request waits.

    ``gather_ms``: when requests reach an idle batch while the serving tier still prepares
    others it has announced (``Engine.arriving``), the first prefill waits for them, at
    most this long, so a burst is prefilled in one pass rather than the late ones behind
    the early ones' prefill (0: never wait).
    """

    enabled: bool = False
    max_batch_size: int = 16
    max_queue_size: int = 256
    prefill_budget_tokens: int = 512
    force_serial_monitoring: bool = False
    batch_rows: int = 0
    gather_ms: int = 50

    def __post_init__(self) -> None:
        _int(self.max_batch_size, "max_batch_size", lo=1, hi=4096)
        _int(self.gather_ms, "gather_ms", lo=0, hi=10_000)
        _int(self.batch_rows, "batch_rows", lo=0, hi=4096)
        _int(self.max_queue_size, "max_queue_size", lo=1)
        _int(self.prefill_budget_tokens, "prefill_budget_tokens", lo=1)


class AttachSpec(msgspec.Struct):
    sae_id: str
    path: str
    layer: int
    layout: str | None = None

    def __post_init__(self) -> None:
        if not self.sae_id:
            raise InvalidParameter("sae_id must be non-empty", param="sae_id")
        _int(self.layer, "layer", lo=0)


# --------------------------------------------------------------------------- results & events

class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class LogprobEntry(msgspec.Struct):
    token_id: int
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct):
    token_id: int
    token: str
    logprob: float
    top_logprobs: list[LogprobEntry] = msgspec.field(default_factory=list)


class SteeringCount(msgspec.Struct):
    """Forward passes in which a request's steering at an attachment was added, in all
    (``count``) and per mode (``modes``: ``add`` for plain strengths, and each control
    mode the request used)."""

    sae_id: str
    layer: int
    count: int
    modes: dict[str, int] = msgspec.field(default_factory=dict)


class SteeringFired(msgspec.Struct):
    """The row positions where a conditional control's trigger opened its gate."""

    sae_id: str
    layer: int
    index: int
    mode: str
    positions: list[int] = msgspec.field(default_factory=list)


class AttachResult(msgspec.Struct):
    sae_id: str
    layer: int
    layer_module_path: str
    d_in: int
    d_sae: int
    activation: str
    layout: str
    warnings: list[str] = msgspec.field(default_factory=list)
    # where the SAE reads and writes (``gpu_engine.sae.hookpoints.HOOK_POINTS``)
    hook_point: str = "resid_post"


class AttachmentStatus(msgspec.Struct):
    sae_id: str
    layer: int
    layer_module_path: str
    d_in: int
    d_sae: int
    activation: str
    layout: str
    path: str
    steering_apply_count: int = 0
    hook_point: str = "resid_post"


class EngineStatus(msgspec.Struct):
    state: str  # "empty" | "ready"
    # the loaded model's backend (None while empty)
    backend: str | None = None
    model_id: str | None = None
    model_path: str | None = None
    dtype: str | None = None
    device: str | None = None
    context_length: int | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    attachments: list[AttachmentStatus] = msgspec.field(default_factory=list)
    in_flight: int = 0
    queued: int = 0
    # the generation backend's mode and capabilities (``Engine.batching_status()``)
    batching: dict[str, Any] = msgspec.field(default_factory=dict)
    # which matmul kernels the model runs on: "onednn_packed" (CPU float32, weights
    # prepacked at load) or "default" (PyTorch's own); None while no model is loaded
    kernels: str | None = None
    # what the resident weights are and what they take in memory: ``quantization`` (Q8/Q4
    # applied at load, else None), ``checkpoint_quantization`` (a pre-quantized
    # checkpoint's own method, loaded as it is), ``quantized_layers``, ``bytes`` and
    # ``bytes_by_dtype`` (parameters and buffers, each tensor once); empty while no model
    # is loaded or when the backend does not say
    weights: dict[str, Any] = msgspec.field(default_factory=dict)
    # "unloading" or "loading" while the engine drains the work already accepted before
    # it changes the model: new work is refused (engine_busy) until it is done
    draining: str | None = None
    # every registered backend: whether it can load on this engine's host, and how to
    # install it (``gpu_engine.backends.backends_report``)
    backends: list[dict[str, Any]] = msgspec.field(default_factory=list)
    # the memory the backend keeps between requests (``cached_bytes``: the batched KV slab
    # and capture stages) and TRANSFORMERS_IDLE_CACHE_RELEASE_S's releases of it
    # (``Engine.memory_status()``); empty while no model is loaded
    memory: dict[str, Any] = msgspec.field(default_factory=dict)


class EmbedResult(msgspec.Struct):
    request_id: str
    embeddings: list[list[float]]
    usage: Usage


class ScoreResult(msgspec.Struct):
    request_id: str
    prompt_tokens: int
    top: list[LogprobEntry] = msgspec.field(default_factory=list)
    allowed: list[LogprobEntry] = msgspec.field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None


class HiddenStatesResult(msgspec.Struct):
    """``states[i][j]``: input i's pooled residual after block ``layers[j]`` (float32
    values, d_model of them)."""

    request_id: str
    layers: list[int]
    states: list[list[list[float]]]
    usage: Usage


class TokenEvent(msgspec.Struct, tag="token", tag_field="type"):
    """One generated token; ``text`` is the text delta it releases (may be empty while a
    multi-byte character or a possible stop-sequence prefix is held back)."""

    type: ClassVar[str] = "token"
    request_id: str
    index: int
    token_id: int
    text: str
    logprob: TokenLogprob | None = None
    activations: list[ActivationRecord] = msgspec.field(default_factory=list)
    prompt_text: str | None = None  # on the first token, with ``sampling.token_texts``


class SpeculativeStats(msgspec.Struct):
    """Speculative decoding of one generation (SPECULATIVE_MODEL): whether it ran, and if
    not why (``sampling``, ``response_format``, ``capture``, ``conditional_steering``);
    the draft tokens proposed and the ones the main model accepted."""

    used: bool
    source: str = ""
    num_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    reason: str | None = None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class FinishEvent(msgspec.Struct, tag="finish", tag_field="type"):
    """Last event of a successful (or cancelled) generation."""

    type: ClassVar[str] = "finish"
    request_id: str
    finish_reason: str
    text: str
    token_ids: list[int]
    usage: Usage
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    # records not delivered with a token event: prompt rows that produced no token, and
    # the single record of ``positions="last"``
    activations: list[ActivationRecord] = msgspec.field(default_factory=list)
    steering_apply_count: list[SteeringCount] = msgspec.field(default_factory=list)
    forward_passes: int = 0
    # with ``sampling.token_texts``: the prompt's text and each token's own text
    prompt_text: str | None = None
    prompt_tokens: list[str] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    # where conditional steering controls fired (``SteeringFired``)
    steering_fired: list[SteeringFired] = msgspec.field(default_factory=list)
    capture: CaptureResult | None = None  # GenerationJob.capture's artifact
    # set when the loaded model decodes speculatively (SPECULATIVE_MODEL)
    speculative: SpeculativeStats | None = None
    # with ``sampling.prompt_top_logprobs``: the top alternatives at each prompt position
    # (None at position 0, as ``prompt_logprobs``), from the prefill's logits
    prompt_top_logprobs: list[list[LogprobEntry] | None] | None = None


class ErrorEvent(msgspec.Struct, tag="error", tag_field="type"):
    type: ClassVar[str] = "error"
    request_id: str
    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)

    def to_exception(self):  # type: ignore[no-untyped-def]
        from .errors import error_from_dict

        return error_from_dict({"code": self.code, "message": self.message, "details": self.details})


class EngineEvent(msgspec.Struct):
    """Something operators should hear about (``sae:detached`` after an OOM, …)."""

    name: str
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class ResultEvent(msgspec.Struct, tag="result", tag_field="type"):
    """The one reply to a command that is not a generation (load, attach, embed, ...):
    ``result`` is the command's declared result type as JSON, decoded by the caller who
    knows that type (``gpu_engine.commands``)."""

    type: ClassVar[str] = "result"
    request_id: str
    result: msgspec.Raw = msgspec.Raw(b"null")


GenerationEvent = TokenEvent | FinishEvent | ErrorEvent
# what a request's (or command's) own stream carries
StreamEvent = TokenEvent | FinishEvent | ErrorEvent | ResultEvent


class GenerationResult(msgspec.Struct):
    """A whole generation, gathered from its events (what a non-streaming caller wants)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob | None] = msgspec.field(default_factory=list)
    activations: list[ActivationRecord] = msgspec.field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    steering_apply_count: list[SteeringCount] = msgspec.field(default_factory=list)
    forward_passes: int = 0
    steering_fired: list[SteeringFired] = msgspec.field(default_factory=list)
    capture: CaptureResult | None = None
    speculative: SpeculativeStats | None = None
    prompt_top_logprobs: list[list[LogprobEntry] | None] | None = None

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
                    steering_fired=ev.steering_fired,
                    forward_passes=ev.forward_passes,
                    capture=ev.capture,
                    speculative=ev.speculative,
                    prompt_top_logprobs=ev.prompt_top_logprobs,
                )
        raise RuntimeError("generation ended without a finish event")
