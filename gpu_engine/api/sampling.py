"""How a request decodes: sampling parameters and constrained (structured) output."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .errors import InvalidParameter
from .fields import (
    LOGIT_BIAS,
    MAX_STOP_SEQUENCES,
    PENALTY,
    REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
    TEMPERATURE,
    TOP_K,
    TOP_LOGPROBS,
    TOP_P,
    Index,
    Name,
    Positive,
    check_fields,
)

STRUCTURED_TYPES = ("json_object", "json_schema", "tool_call")
# how a chat template writes a tool call (``capabilities().tool_call_format``):
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

    _names = {"type": "response_format"}

    type: Literal[STRUCTURED_TYPES]  # type: ignore[valid-type]
    schema: str = ""
    tool_format: str = ""
    tool_mode: str = ""

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.type in ("json_schema", "tool_call")) != bool(self.schema):
            raise InvalidParameter(
                "structured.schema is given exactly when the type is json_schema or tool_call", param="response_format"
            )
        if self.type == "tool_call":
            if self.tool_format not in TOOL_CALL_FORMATS or self.tool_mode not in TOOL_CALL_MODES:
                raise InvalidParameter(
                    f"a tool_call grammar needs tool_format in {TOOL_CALL_FORMATS} and tool_mode in {TOOL_CALL_MODES}",
                    param="tool_choice",
                )
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

    max_tokens: Positive | None = 16
    temperature: Annotated[float, TEMPERATURE.meta] = 1.0
    top_p: Annotated[float, TOP_P.meta] = 1.0
    top_k: Annotated[int, TOP_K.meta] = 0
    seed: int | None = None
    repetition_penalty: Annotated[float, REPETITION_PENALTY.meta] = 1.0
    presence_penalty: Annotated[float, PENALTY.meta] = 0.0
    frequency_penalty: Annotated[float, PENALTY.meta] = 0.0
    stop: Annotated[list[Name], msgspec.Meta(max_length=MAX_STOP_SEQUENCES)] = msgspec.field(default_factory=list)
    stop_token_ids: list[Index] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    # on the JSON wire the ids are object keys ("5"); the vocabulary is checked by the engine
    logit_bias: dict[Index, Annotated[float, LOGIT_BIAS.meta]] = msgspec.field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: Annotated[int, TOP_LOGPROBS.meta] = 0
    # the prompt tokens' own log-probabilities (FinishEvent.prompt_logprobs) and, with
    # prompt_top_logprobs > 0, the top alternatives at every prompt position
    # (FinishEvent.prompt_top_logprobs), all read from the request's own prefill: steered
    # as the request is, one forward whatever the prompt's length
    prompt_logprobs: bool = False
    prompt_top_logprobs: Annotated[int, TOP_LOGPROBS.meta] = 0
    # the text of every prompt and completion token (FinishEvent.prompt_tokens/tokens)
    # and of the whole prompt (TokenEvent.prompt_text on the first token, and
    # FinishEvent.prompt_text): the tokenizer is the engine's, never the web tier's
    token_texts: bool = False
    max_tokens_default: Positive | None = None
    # response_format: the output is constrained to this grammar (backends reporting
    # ``structured_output``); EOS is allowed only where the grammar is complete
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        check_fields(self)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise InvalidParameter(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}", param="seed"
            )
        if self.prompt_top_logprobs and not self.prompt_logprobs:
            raise InvalidParameter("prompt_top_logprobs needs prompt_logprobs", param="prompt_top_logprobs")


__all__ = ["STRUCTURED_TYPES", "TOOL_CALL_FORMATS", "TOOL_CALL_MODES", "SamplingParams", "StructuredOutput"]
