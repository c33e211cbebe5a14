"""The /v1 wire formats as pydantic models: requests validate themselves and convert to
engine jobs; responses are built from engine results.

Field names and ranges follow OpenAI's reference schema (CreateChatCompletionRequest,
CreateCompletionRequest, CreateEmbeddingRequest); the miLLM extensions are ``profile``,
``steering``, ``steering_intensity``, ``return_sae_activations``, ``monitoring``,
``capture`` and ``analyze``. A model declares
exactly the fields the server reads: any other key a request sends is named in the
``X-miLLM-Ignored-Fields`` response header (or refused under ``X-miLLM-Strict``), and the
output-changing fields it cannot honour (``tools``, ``response_format`` other than text,
``suffix``, …) are refused — both in ``inference.policy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from gpu_engine.api.protocol import (
    MAX_LOGIT_BIAS,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    PENALTY,
    REPETITION_PENALTY,
    TOP_K,
    TOP_P,
    SamplingParams,
    StructuredOutput,
)
from inference.protocol_base import (  # noqa: F401 - the limits are read from here too
    MAX_ACTIVATION_ENTRIES,
    MAX_ACTIVATION_FEATURES,
    MAX_ACTIVATION_TOP_K,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_EMBEDDING_INPUTS,
    MAX_EXTRA_CONVERSATIONS,
    MAX_N,
    MAX_TOKENS_LIMIT,
    SEED_MAX,
    SEED_MIN,
    _Strict,
    _Wire,
)
from inference.protocol_extensions import (  # noqa: F401 - re-exported: the request's parts
    MAX_ANALYZERS,
    MAX_PROBES,
    AnalyzeRequest,
    AttentionCaptureRequest,
    CapturePositions,
    CaptureRequest,
    InlineSteering,
    MonitoringRequest,
    PositionRange,
    ProbeAsk,
    ReturnSaeActivations,
    SteeringFeature,
)
from inference.protocol_messages import (  # noqa: F401 - re-exported: the request's parts
    MAX_TOOLS,
    ChatMessage,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCallFunction,
    ToolCallIn,
)
from inference.steering_aliases import AliasRecord
from inference.steering_aliases import rewrite as rewrite_aliases
from inference.structured import NAME_RE, structured_output


class StreamOptions(_Wire):
    include_usage: bool = False
    # OpenAI's default is true; miLLM pads only when asked (``inference.streaming``)
    include_obfuscation: bool = False


# service_tier: "auto" and "default" are what every request gets; "flex" runs at the
# engine's batch priority (behind interactive work); "priority", "fast" and "scale" are
# refused by inference.policy (no tier above interactive)
SERVICE_TIERS = {"auto": "default", "default": "default", "flex": "flex"}
MAX_CACHE_KEY = 256  # GenerationJob.cache_namespace's limit


def _intensity(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() == "off":
            return 0.0
        raise ValueError('steering_intensity must be a number in [0, 2] or "off"')
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        # pydantic reports ValueError as a validation error; a TypeError would escape
        raise ValueError('steering_intensity must be a number in [0, 2] or "off"')  # noqa: TRY004
    if not math.isfinite(value) or not 0 <= value <= 2:
        raise ValueError("steering_intensity must lie in [0, 2]")
    return float(value)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("stop must be a string or a list of strings")
    if len(value) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
    if any(not s for s in value):
        raise ValueError("stop sequences must be non-empty")
    return list(value)


def _logit_bias(value: Any) -> dict[str, float] | None:
    """OpenAI's ``{"<token id>": bias}``, bias in [-100, 100]; the vocabulary is the
    engine's to check (the web tier holds no tokenizer)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    out: dict[str, float] = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or str(int(key)) != key or int(key) > 2**31:
            raise ValueError(f"logit_bias keys must be token ids (got {key!r})")
        if (
            isinstance(bias, bool)
            or not isinstance(bias, (int, float))
            or not math.isfinite(bias)
            or abs(bias) > MAX_LOGIT_BIAS
        ):
            raise ValueError(
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}] (got {bias!r} for {key})"
            )
        out[key] = float(bias)
    return out


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that sends no temperature, top_p or max_tokens gets: OpenAI's
    defaults, or the CBM_DEFAULT_* settings on a batching engine (``planning``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    # None: the endpoint's own (chat fills the context window, completions 16); a number
    # is a ceiling that shrinks to the room a long prompt leaves, never a refusal
    max_tokens: int | None = None


OPENAI_DEFAULTS = SamplingDefaults()


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ResponseFormat shapes: ``{type}``, and for ``json_schema`` a ``json_schema``
    object ``{name, description?, schema?, strict?}``. Which types and schemas are honoured
    is decided later (``inference.policy``, ``inference.structured``)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError("response_format must be an object with a string type")
    if value["type"] == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("a json_schema response_format needs a json_schema object")
        name = spec.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError("json_schema.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
        if spec.get("schema") is not None and not isinstance(spec["schema"], (dict, bool)):
            raise ValueError("json_schema.schema must be a JSON schema object")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise ValueError("json_schema.strict must be a boolean")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise ValueError("json_schema.description must be a string")
    return value


class _GenerationRequest(_Wire):
    model: str = Field(min_length=1, max_length=500)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    # OpenAI's range, narrower than the engine's (TEMPERATURE: up to 100)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, **TOP_P.bounds())
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(default=None, **PENALTY.bounds())
    frequency_penalty: float | None = Field(default=None, **PENALTY.bounds())
    logit_bias: dict[str, float] | None = None
    # vLLM-style sampling extras the engine supports
    top_k: int | None = Field(default=None, ge=TOP_K.ge, le=2**31)
    repetition_penalty: float | None = Field(default=None, **REPETITION_PENALTY.bounds())
    ignore_eos: bool = False
    # vLLM's: token ids that end the generation like EOS (finish_reason "stop"; the token
    # itself is not in the text); on vLLM they also end a grammar
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(default=None, max_length=64)
    # miLLM extensions
    profile: str | None = Field(default=None, min_length=1, max_length=200)
    steering: InlineSteering | None = None
    steering_intensity: float | None = None
    # which steering shape of another tool the body used (``inference.steering_aliases``):
    # the server's own record, not a field a client sends (kept out of the schema)
    steering_alias: SkipJsonSchema[AliasRecord | None] = None
    return_sae_activations: ReturnSaeActivations | None = None
    # SAE fidelity of the rows read (``inference.fidelity``): millm.sae_fidelity
    monitoring: MonitoringRequest | None = None
    capture: CaptureRequest | None = None
    analyze: list[AnalyzeRequest] | None = Field(default=None, min_length=1, max_length=MAX_ANALYZERS)
    # probes scored on this request instead of the armed set; [] scores none
    probes: list[str | ProbeAsk] | None = Field(default=None, max_length=MAX_PROBES)
    # scoring mode (the original's, vLLM's names): the next token's distribution over these
    # ids, one forward pass, nothing generated (``inference.scoring``)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    return_tokens_as_token_ids: bool = False
    # constrained decoding (inference.structured); the unsupported types are refused by
    # inference.policy
    response_format: dict[str, Any] | None = None
    # the prefix cache's namespace (GenerationJob.cache_namespace); cache_salt is vLLM's
    # name for the same thing (both given: equal)
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_KEY)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_KEY)
    service_tier: str | None = None

    # the steering shapes of other tools, as miLLM's own fields (docs/api-v1.md)
    _aliases = model_validator(mode="before")(classmethod(lambda cls, data: rewrite_aliases(data)))
    _stop = field_validator("stop", mode="before")(classmethod(lambda cls, v: _stop(v)))
    _intensity = field_validator("steering_intensity", mode="before")(classmethod(lambda cls, v: _intensity(v)))
    _logit_bias = field_validator("logit_bias", mode="before")(classmethod(lambda cls, v: _logit_bias(v)))
    # one analyzer ({name, params}) or a list of them
    _analyze = field_validator("analyze", mode="before")(classmethod(lambda cls, v: [v] if isinstance(v, dict) else v))

    @property
    def cache_namespace(self) -> str | None:
        return self.prompt_cache_key if self.prompt_cache_key is not None else self.cache_salt

    @property
    def answered_tier(self) -> str | None:
        """The ``service_tier`` an answer echoes (only when the request sent one)."""
        return None if self.service_tier is None else SERVICE_TIERS.get(self.service_tier)

    @property
    def priority(self) -> str:
        return "batch" if self.service_tier == "flex" else "interactive"

    @property
    def obfuscate(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_obfuscation)

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 or t > 2**31 for t in value):
            raise ValueError("token ids must be non-negative integers")
        if value is not None and len(set(value)) != len(value):
            raise ValueError("a token id is listed twice")
        return value

    _response_format = field_validator("response_format", mode="before")(
        classmethod(lambda cls, v: _response_format(v))
    )

    def structured(self) -> StructuredOutput | None:
        """The engine's grammar request, or None (text); 400 response_format_unsupported
        for a schema outside the supported subset."""
        return structured_output(self.response_format)

    def unread_fields(self) -> frozenset[str]:
        # OpenAI: "only set this when you set stream: true"
        unread = frozenset() if self.stream else frozenset({"stream_options"})
        if self.allowed_token_ids is not None:
            # scoring mode: one forward pass, no prefix cache, answered at once
            return unread | {"prompt_cache_key", "cache_salt"}
        # keys top_logprobs of scoring mode only
        return unread | {"return_tokens_as_token_ids"}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def uses_extensions(self) -> bool:
        return any(
            x is not None
            for x in (
                self.profile,
                self.steering,
                self.steering_intensity,
                self.return_sae_activations,
                self.monitoring,
                self.capture,
                self.analyze,
                self.probes,
            )
        )

    def _sampling(
        self,
        *,
        max_tokens: int | None,
        logprobs: bool,
        top_logprobs: int,
        prompt_logprobs: bool,
        choice: int,
        defaults: SamplingDefaults,
        max_tokens_default: int | None = None,
        prompt_top_logprobs: int = 0,
    ) -> SamplingParams:
        seed = self.seed
        if seed is not None and choice:
            # n > 1 with a seed: each choice gets its own (still reproducible) stream
            seed = seed + choice if seed + choice <= SEED_MAX else seed - choice
        return SamplingParams(
            max_tokens=max_tokens,
            max_tokens_default=max_tokens_default,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=seed,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            logit_bias={int(t): b for t, b in (self.logit_bias or {}).items()},
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=prompt_top_logprobs,
            # token texts come from the engine's tokenizer (the web tier holds none): asked
            # for where the answer shows tokens that no token event carries
            token_texts=self._needs_token_texts(),
            structured=self.structured(),
        )

    def _needs_token_texts(self) -> bool:
        return self.return_sae_activations is not None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    # the original's: more conversations in the same request (one queue slot), run
    # together; conversation c's choices are indexes c·n … c·n + n − 1
    extra_messages: list[list[ChatMessage]] | None = Field(
        default=None, min_length=1, max_length=MAX_EXTRA_CONVERSATIONS
    )
    # rendered by the chat template where it supports tools, else refused by name; calls
    # parsed and constrained (inference.tools)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # false: at most one call under auto (required and a named function make one anyway)
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.extra_messages is not None:
            if any(not conversation for conversation in self.extra_messages):
                raise ValueError("each extra_messages conversation needs a message")
            if (1 + len(self.extra_messages)) * self.n > MAX_N * 4:
                raise ValueError(f"at most {MAX_N * 4} choices (conversations × n) per request")
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as chat templates take them (None without tools)."""
        if not self.tools:
            return None
        return [
            {"type": "function", "function": t.function.model_dump(exclude_none=True, exclude={"strict"})}
            for t in self.tools
        ]

    def tool_choice_mode(self) -> str:
        """none | auto | required | named (OpenAI's default: auto with tools, else none)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        return choice or ("auto" if self.tools else "none")

    def conversations(self) -> list[list[dict[str, Any]]]:
        """``messages``, then each of ``extra_messages``, as the chat template takes them."""
        extra = self.extra_messages or []
        return [self.template_messages(), *[[m.for_template() for m in c] for c in extra]]

    def unread_fields(self) -> frozenset[str]:
        unread = super().unread_fields()
        if not self.tools:
            unread |= {"parallel_tool_calls"}
        # max_completion_tokens wins
        return unread | {"max_tokens"} if self.max_completion_tokens is not None else unread

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling(self, choice: int = 0, defaults: SamplingDefaults = OPENAI_DEFAULTS) -> SamplingParams:
        return self._sampling(
            max_tokens=self.effective_max_tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            prompt_logprobs=False,
            choice=choice,
            defaults=defaults,
            max_tokens_default=defaults.max_tokens,
        )

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


PromptItem = str | list[int]


def _prompt(value: Any) -> list[PromptItem]:
    """string | [string] | [int] | [[int]] → a list of prompts (text or token ids)."""

    def ids(seq: list[Any]) -> list[int]:
        if not seq:
            raise ValueError("a token-id prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
            raise ValueError("token ids must be integers")
        if any(t < 0 or t > 2**31 for t in seq):
            raise ValueError("token ids must be non-negative integers")
        return list(seq)

    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value):
            return list(value)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return [ids(value)]
        if all(isinstance(x, list) for x in value):
            return [ids(x) for x in value]
    raise ValueError(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists, and not empty"
    )


class CompletionRequest(_GenerationRequest):
    prompt: list[PromptItem]
    # OpenAI's minimum is 0: with echo, the classic scoring call (``scores_only``)
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool = True

    _prompt = field_validator("prompt", mode="before")(classmethod(lambda cls, v: _prompt(v)))

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        if len(self.prompt) * self.n > MAX_N * 4:
            raise ValueError(f"at most {MAX_N * 4} choices (prompts × n) per request")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def scores_only(self) -> bool:
        """``max_tokens: 0``: the prompt is read (echoed and scored) and nothing is
        generated. The engine runs its prefill as a one-token generation whose token is
        dropped from the answer (``inference.outcomes.prompt_only``)."""
        return self.max_tokens == 0

    def _needs_token_texts(self) -> bool:
        # echo shows the prompt (and its tokens, with logprobs)
        return self.echo or self.return_sae_activations is not None

    def sampling(self, choice: int = 0, defaults: SamplingDefaults = OPENAI_DEFAULTS) -> SamplingParams:
        if self.max_tokens is not None:
            # max_tokens 0: one token, never shown (its forward is the prompt's prefill)
            max_tokens, ceiling = max(self.max_tokens, 1), None
        elif defaults.max_tokens is None:
            max_tokens, ceiling = 16, None  # OpenAI's legacy default
        else:
            max_tokens, ceiling = None, defaults.max_tokens
        return self._sampling(
            max_tokens=max_tokens,
            max_tokens_default=ceiling,
            logprobs=self.wants_logprobs,
            top_logprobs=self.logprobs or 0,
            prompt_logprobs=self.echo and self.wants_logprobs,
            # the alternatives at each prompt position, from the same
            # (steered) prefill
            prompt_top_logprobs=(self.logprobs or 0) if self.echo else 0,
            choice=choice,
            defaults=defaults,
        )


def _embedding_input(value: Any) -> list[PromptItem]:
    items = _prompt(value)
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
    if any(isinstance(x, str) and not x for x in items):
        raise ValueError("an input is an empty string")
    return items


class EmbeddingRequest(_Wire):
    model: str = Field(min_length=1, max_length=500)
    input: list[PromptItem]
    encoding_format: Literal["float", "base64"] = "float"
    # only the model's own size is honoured (``inference.policy.check_dimensions``)
    dimensions: int | None = Field(default=None, ge=1)

    _input = field_validator("input", mode="before")(classmethod(lambda cls, v: _embedding_input(v)))


# --------------------------------------------------------------------------- responses


class UsageInfo(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(_Wire):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(_Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EmbeddingData(_Wire):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(_Wire):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: UsageInfo
