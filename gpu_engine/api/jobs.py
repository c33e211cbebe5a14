"""The work a client asks of the engine: generation, embedding, scoring and hidden-state
jobs, and the model load, attachment and batching options."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .capture import CaptureSpec
from .errors import InvalidParameter
from .fields import BATCH_SIZE, GATHER_MS, MAX_BATCH_ROWS, PRIORITIES, Index, Name, Positive, check_fields
from .monitoring import MonitorSpec
from .sampling import SamplingParams
from .steering import SteeringSpec

POOLINGS = ("mean", "last", "cls")
HIDDEN_POOLINGS = ("last", "mean")
Priority = Literal[PRIORITIES]  # type: ignore[valid-type]
# text or token ids, at least one
Inputs = Annotated[list[str | list[int]], msgspec.Meta(min_length=1)]

# chat_template_kwargs keys that would replace what the engine itself passes when it
# renders a chat template (the conversation, the generation prompt, the request's tools,
# the special tokens) or change what rendering returns (tokenize, return_*, padding, …):
# refused by name. Every other key is a variable of the template.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "bos_token",
        "eos_token",
    }
)


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """``chat_template_kwargs`` without a key of ``RESERVED_TEMPLATE_KWARGS``."""
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidParameter(
                f"chat_template_kwargs.{key} is set by the server and cannot be given",
                param=f"chat_template_kwargs.{key}",
            )


def check_prompt_job(job: GenerationJob | ScoreJob | AttributionJob) -> None:
    """A job given its prompt one way: exactly one of ``prompt``, ``prompt_token_ids``,
    ``messages`` (refused as ``prompt``), then its fields (``check_fields``) and its
    ``chat_template_kwargs`` (``check_template_kwargs``), in that order."""
    if sum(x is not None for x in (job.prompt, job.prompt_token_ids, job.messages)) != 1:
        raise InvalidParameter("give exactly one of prompt, prompt_token_ids, messages", param="prompt")
    check_fields(job)
    check_template_kwargs(job.chat_template_kwargs)


class GenerationJob(msgspec.Struct):
    """One generation request.  Exactly one of prompt / prompt_token_ids / messages.

    ``steering=None`` and an empty spec both mean unsteered: live steering set by an
    operator is resolved by the caller into this field.
    """

    _names = {"prompt_token_ids": "prompt"}

    request_id: str
    prompt: str | None = None
    prompt_token_ids: Annotated[list[Index], msgspec.Meta(min_length=1)] | None = None
    messages: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1)] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    steering: SteeringSpec | None = None
    monitor: MonitorSpec | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    priority: Priority = "interactive"
    capture: CaptureSpec | None = None
    # function tools as chat templates take them ({"type": "function", "function": {name,
    # description?, parameters}}), rendered by the template (backends reporting
    # ``tool_calling``); None: the template is applied without tools
    tools: list[dict[str, Any]] | None = None
    # the prefix cache's namespace (/v1's ``prompt_cache_key``): a request that names one
    # reuses only KV stored under the same name, and its own KV is reused only under it
    # (vLLM: its ``cache_salt``); None: the shared namespace
    cache_namespace: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    # teacher-forced distributions: the finish carries the full next-token log-softmax
    # (float32, ``Distributions``) at the prompt rows that predict prompt tokens
    # ``distributions_from .. P-1`` (1 <= it < P, the prompt's length in tokens), steered
    # and monitored as the job says; backends reporting ``prompt_distributions``
    distributions_from: Positive | None = None
    # the web request's span (OTEL_ENABLED), a W3C traceparent: the engine's span of this
    # job is its child (``gpu_engine.api.tracing``)
    traceparent: Annotated[str, msgspec.Meta(max_length=128)] | None = None

    def __post_init__(self) -> None:
        check_prompt_job(self)


class EmbedJob(msgspec.Struct):
    _names = {"inputs": "input"}

    request_id: str
    inputs: Inputs = msgspec.field(default_factory=list)
    pooling: Literal[POOLINGS] = "mean"  # type: ignore[valid-type]
    normalize: bool = True
    priority: Priority = "interactive"  # batch embeddings wait behind interactive work

    def __post_init__(self) -> None:
        check_fields(self)


class ScoreJob(msgspec.Struct):
    """Next-token log-probabilities after a prompt (never steered or monitored): a
    prompt's text, its token ids, or chat ``messages`` rendered with the model's template
    (a generation prompt added)."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    top_k: Index = 0
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: bool = False
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_prompt_job(self)


class HiddenStatesJob(msgspec.Struct):
    """The residual stream after decoder blocks ``layers`` (``resid_post``: each block's
    output, where a vector attached at that layer is added) for each input, pooled over
    its tokens: ``last`` (the last token) or ``mean``.  Never steered or monitored.  What
    computing a steering vector from contrastive prompt pairs reads."""

    request_id: str
    inputs: Inputs = msgspec.field(default_factory=list)
    layers: Annotated[list[Index], msgspec.Meta(min_length=1)] = msgspec.field(default_factory=list)
    pooling: Literal[HIDDEN_POOLINGS] = "last"  # type: ignore[valid-type]
    add_special_tokens: bool = True
    priority: Priority = "interactive"

    def __post_init__(self) -> None:
        check_fields(self)
        if len(set(self.layers)) != len(self.layers):
            raise InvalidParameter("layers names a layer twice", param="layers")


# at most this many texts in one ``TokenizeJob``, each at most this many characters
MAX_TOKENIZE_TEXTS = 4096
MAX_TOKENIZE_CHARS = 1_000_000
# at most this many top (and bottom) tokens per feature in a ``FeatureLogitsJob``
MAX_FEATURE_LOGITS_TOP_N = 100
# at most this many top features in an ``AttributionJob``, and ablation checks of them
MAX_ATTRIBUTION_TOP_N = 100
MAX_ATTRIBUTION_ABLATE = 20
# at most this many bytes of ``Distributions`` in one generation (rows × vocab × 4): a job
# asking for more is refused naming ``distributions_from`` (a Redis entry holds 512 MiB)
MAX_DISTRIBUTION_BYTES = 256 * 2**20


class TokenizeJob(msgspec.Struct):
    """The model tokenizer's ids of each text (what a generation of that text as a prompt
    would read); ``add_special_tokens`` adds the BOS and the like."""

    request_id: str
    texts: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=MAX_TOKENIZE_CHARS)]],
        msgspec.Meta(min_length=1, max_length=MAX_TOKENIZE_TEXTS),
    ]
    add_special_tokens: bool = False

    def __post_init__(self) -> None:
        check_fields(self)


class FeatureLogitsJob(msgspec.Struct):
    """The direct logit effect of SAE features: feature ``i``'s decoder row through the
    model's unembedding, ``W_dec[i] @ W_U.T`` (``W_U`` [vocab, d_model] as the checkpoint
    holds it, float32, no final norm), and its ``top_n`` highest and lowest entries.
    ``features`` None: every feature of the SAE attached at ``layer``."""

    request_id: str
    sae_id: Name
    layer: Index
    features: list[Index] | None = None
    top_n: Annotated[int, msgspec.Meta(ge=1, le=MAX_FEATURE_LOGITS_TOP_N)] = 10

    def __post_init__(self) -> None:
        check_fields(self)
        if self.features is not None and len(set(self.features)) != len(self.features):
            raise InvalidParameter("features names a feature twice", param="features")


class LoadModelJob(msgspec.Struct):
    model_id: str
    path: str
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Annotated[str, msgspec.Meta(pattern=r"^(cpu|cuda|auto|cuda:.+)$")] = "auto"
    trust_remote_code: bool = False
    max_context_length: int | None = None
    # the registered backend that loads and runs it (``gpu_engine.backends``)
    backend: str = "transformers"
    # that backend's own load options, checked against its registry entry at load
    options: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)


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

    ``follow_backend``: the operator left the rows to the backend (MAX_CONCURRENT_REQUESTS
    unset). A backend that runs a batch of its own (vLLM: its ``max_num_seqs`` load
    option, ``BackendEntry.rows``) then gets that many interactive rows; otherwise, and
    for a backend without one, ``max_batch_size`` stands, capped on such a backend by its
    own batch (``gpu_engine.backends.batch_rows``).
    """

    enabled: bool = False
    max_batch_size: Annotated[int, BATCH_SIZE.meta] = 16
    max_queue_size: Positive = 256
    prefill_budget_tokens: Positive = 512
    force_serial_monitoring: bool = False
    batch_rows: Annotated[int, msgspec.Meta(ge=0, le=MAX_BATCH_ROWS)] = 0
    gather_ms: Annotated[int, GATHER_MS.meta] = 50
    follow_backend: bool = False

    def __post_init__(self) -> None:
        check_fields(self)


class AttachSpec(msgspec.Struct):
    sae_id: Name
    path: str
    layer: Index
    layout: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)


class AttributionJob(msgspec.Struct):
    """Each feature of the SAE attached at ``layer`` attributed to one logit of the next
    token after a prompt (exactly one of prompt / prompt_token_ids / messages, rendered as
    a generation's would be): at every prompt position p, ``f_i(x_p) * d logit / d f_i(x_p)``
    with the SAE spliced in at its hook point and its error term kept (``x_hat +
    stopgrad(x - x_hat)``: the forward is the model's own), the logit being the last
    position's ``target_token_id`` (None: the greedy next token). The ``top_n`` features by
    the magnitude of their attribution summed over positions are listed; the first
    ``ablate_top`` of them are checked by zeroing each one at every position and measuring
    the logit again. Backends reporting the ``gradients`` capability only (transformers)."""

    _names = {"prompt_token_ids": "prompt"}

    request_id: str
    sae_id: Name
    layer: Index
    prompt: str | None = None
    prompt_token_ids: Annotated[list[Index], msgspec.Meta(min_length=1)] | None = None
    messages: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1)] | None = None
    target_token_id: Index | None = None
    top_n: Annotated[int, msgspec.Meta(ge=1, le=MAX_ATTRIBUTION_TOP_N)] = 10
    ablate_top: Annotated[int, msgspec.Meta(ge=0, le=MAX_ATTRIBUTION_ABLATE)] = 5
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_prompt_job(self)


__all__ = [
    "HIDDEN_POOLINGS",
    "POOLINGS",
    "PRIORITIES",
    "RESERVED_TEMPLATE_KWARGS",
    "AttachSpec",
    "AttributionJob",
    "BatchingOptions",
    "MAX_ATTRIBUTION_ABLATE",
    "MAX_ATTRIBUTION_TOP_N",
    "MAX_DISTRIBUTION_BYTES",
    "MAX_FEATURE_LOGITS_TOP_N",
    "MAX_TOKENIZE_CHARS",
    "MAX_TOKENIZE_TEXTS",
    "EmbedJob",
    "FeatureLogitsJob",
    "GenerationJob",
    "HiddenStatesJob",
    "LoadModelJob",
    "ScoreJob",
    "TokenizeJob",
    "check_template_kwargs",
]
