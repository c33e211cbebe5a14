"""What the engine answers: results of commands, the events of a generation, its status."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import msgspec
import numpy as np

from .capabilities import Capabilities, capabilities_of
from .capture import CaptureResult
from .errors import EngineError, SAEIncompatible, error_from_dict
from .monitoring import ActivationRecord, PackedRows

FINISH_REASONS = ("stop", "length", "cancelled", "error")


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
    # why the resident model cannot serve although loaded (its backend's engine died:
    # vLLM's engine core process exited), None while it can; every command is refused
    # (engine_shutdown) until the model is unloaded or loaded again
    failure: str | None = None

    @property
    def capabilities(self) -> Capabilities | None:
        """The loaded backend's capabilities (``batching["capabilities"]``, JSON on the wire)
        read as attributes; None while no model is loaded."""
        return capabilities_of(self.batching.get("capabilities"))


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


class TokenizeResult(msgspec.Struct):
    """``token_ids[i]``: the ids of ``TokenizeJob.texts[i]``."""

    request_id: str
    token_ids: list[list[int]]


class FeatureLogitsResult(msgspec.Struct):
    """Per feature (``features[j]``, in the job's order, or every index ascending): its
    ``top_n`` highest logit effects in descending order (``top_ids``/``top_values``) and its
    lowest in ascending order (``bottom_*``), with each token's text as the tokenizer
    decodes that single id (``*_tokens``)."""

    request_id: str
    features: list[int]
    top_ids: list[list[int]]
    top_values: list[list[float]]
    bottom_ids: list[list[int]]
    bottom_values: list[list[float]]
    top_tokens: list[list[str]]
    bottom_tokens: list[list[str]]


class Distributions(msgspec.Struct):
    """The model's full next-token log-softmax at prompt rows (``GenerationJob.
    distributions_from``): little-endian float32 ``logprobs``, ``rows`` × ``vocab``; row
    ``r`` predicts prompt token ``start + r`` (it is computed from residual row
    ``start + r - 1``). ``unpack_distributions`` reads it as a numpy array."""

    start: int
    rows: int
    vocab: int
    logprobs: bytes


def unpack_distributions(d: Distributions) -> np.ndarray:
    """``d``'s log-probabilities as a read-only ``[rows, vocab]`` float32 array; a
    ``ValueError`` where its sizes and bytes disagree."""
    if d.start < 1 or d.rows < 0 or d.vocab < 1:
        raise ValueError(f"distributions do not agree: start {d.start}, {d.rows} rows, vocab {d.vocab}")
    if len(d.logprobs) != d.rows * d.vocab * 4:
        raise ValueError(
            f"distributions do not agree: {d.rows} rows × {d.vocab} vocab needs "
            f"{d.rows * d.vocab * 4} bytes, got {len(d.logprobs)}"
        )
    return np.frombuffer(d.logprobs, dtype="<f4").reshape(d.rows, d.vocab)


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
    # with ``GenerationJob.distributions_from``: the full log-softmax at those prompt rows
    distributions: Distributions | None = None


class ErrorEvent(msgspec.Struct, tag="error", tag_field="type"):
    type: ClassVar[str] = "error"
    request_id: str
    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)

    def to_exception(self) -> EngineError:
        return error_from_dict({"code": self.code, "message": self.message, "details": self.details})


class EngineEvent(msgspec.Struct):
    """Something operators should hear about (``sae:detached`` after an OOM, …)."""

    name: str
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class ResultEvent(msgspec.Struct, tag="result", tag_field="type"):
    """The one reply to a command that is not a generation (load, attach, embed, ...):
    ``result`` is the command's declared result type as JSON, decoded by the caller who
    knows that type (``gpu_engine.api.commands``)."""

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
    distributions: Distributions | None = None

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
                    distributions=ev.distributions,
                )
        raise RuntimeError("generation ended without a finish event")


@dataclass(frozen=True)
class CompatibilityReport:
    """Can this SAE be attached to that model at that layer (``check_sae``'s result; built by
    ``gpu_engine.sae.compat.check_compatibility``)?  ``errors`` make attaching impossible,
    ``warnings`` flag an SAE trained somewhere else."""

    compatible: bool
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def raise_for_errors(self, sae_id: str = "") -> None:
        if self.errors:
            label = f"SAE {sae_id!r}" if sae_id else "SAE"
            raise SAEIncompatible(f"{label} is incompatible: " + "; ".join(self.errors), details=self.to_dict())


class AttributionFeature(msgspec.Struct):
    """One feature's attribution to the target logit: ``attribution`` summed over the
    prompt's positions, its activation summed likewise (``activation_sum``), the position
    with the largest attribution by magnitude (``max_position``, its value
    ``max_attribution``), and for the first ``AttributionJob.ablate_top`` features the
    logit with the feature zeroed at every position minus the clean logit
    (``ablation_delta``; None where not checked)."""

    index: int
    attribution: float
    activation_sum: float
    max_position: int
    max_attribution: float
    ablation_delta: float | None = None


class AttributionResult(msgspec.Struct):
    """An ``AttributionJob``'s answer: the prompt's ids, the target token and its clean logit
    at the last position, every non-zero ``activation * gradient`` (``attributions``: row p
    = prompt position p, ``gpu_engine.api.monitoring.unpack`` reads it) and the ``top_n``
    features by the magnitude of their summed attribution (``top``, largest first), with
    each prompt token's and the target's text as the tokenizer decodes that one id
    (``prompt_tokens``, ``target_token``: what a heat strip over the prompt shows)."""

    request_id: str
    prompt_token_ids: list[int]
    target_token_id: int
    target_logit: float
    attributions: PackedRows
    top: list[AttributionFeature] = msgspec.field(default_factory=list)
    prompt_tokens: list[str] = msgspec.field(default_factory=list)
    target_token: str = ""


__all__ = [
    "FINISH_REASONS",
    "AttachResult",
    "AttachmentStatus",
    "AttributionFeature",
    "AttributionResult",
    "CompatibilityReport",
    "Distributions",
    "EmbedResult",
    "EngineEvent",
    "EngineStatus",
    "ErrorEvent",
    "FeatureLogitsResult",
    "FinishEvent",
    "GenerationEvent",
    "GenerationResult",
    "HiddenStatesResult",
    "LogprobEntry",
    "ResultEvent",
    "ScoreResult",
    "SpeculativeStats",
    "SteeringCount",
    "SteeringFired",
    "StreamEvent",
    "TokenEvent",
    "TokenLogprob",
    "TokenizeResult",
    "Usage",
    "unpack_distributions",
]
