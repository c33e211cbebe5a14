"""The /v1 response bodies as typed models: chat completions and their stream chunks,
completions, usage and log-probabilities, in the shapes of OpenAI's published schemas
(tests/v1/test_openai_schemas.py validates every answer against them).

Fields a schema requires are always present, ``null`` when there is nothing (a chat
message's ``refusal``, a choice's ``logprobs``); optional extensions (``usage`` on stream
chunks, ``millm``) appear only when the request asked for them (``OMIT_IF_NONE``).
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from gpu_engine.api.protocol import EngineStatus, TokenLogprob


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset()

    def dump(self) -> dict[str, Any]:
        data = self.model_dump(mode="json", exclude_none=False)
        return self._omit(data)

    def _omit(self, data: dict[str, Any]) -> dict[str, Any]:
        for name in self.OMIT_IF_NONE:
            if data.get(name) is None:
                data.pop(name, None)
        for name, value in self:
            if isinstance(value, _Body) and isinstance(data.get(name), dict):
                data[name] = value._omit(data[name])
            elif isinstance(value, list):
                data[name] = [
                    v._omit(d) if isinstance(v, _Body) else d for v, d in zip(value, data.get(name) or [], strict=False)
                ]
        return data


FinishReason = Literal["stop", "length", "tool_calls"]


def finish_reason(engine_reason: str, *, tool_calls: bool = False) -> FinishReason:
    if tool_calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def fingerprint(status: EngineStatus | None, version: str) -> str:
    """``system_fingerprint``: what the answer was computed with — the server version and
    the resident model's backend, checkpoint, device, dtype and kernels. Equal for two
    answers only when all of those were equal."""
    parts = [version]
    if status is not None:
        parts += [str(status.backend), str(status.model_id), str(status.device), str(status.dtype), str(status.kernels)]
    return "fp_" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# --- chat ------------------------------------------------------------------------------


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]

    @classmethod
    def of(cls, lp: TokenLogprob) -> ChatTokenLogprob:
        return cls(
            token=lp.token,
            logprob=lp.logprob,
            bytes=list(lp.token.encode()),
            top_logprobs=[
                TopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode())) for t in lp.top_logprobs
            ],
        )


class ChatLogprobs(_Body):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    """A whole call in one stream delta (ChatCompletionMessageToolCallChunk)."""

    index: int


class ChatMessage(_Body):
    OMIT_IF_NONE = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Body):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Body):
    OMIT_IF_NONE = frozenset({"millm", "service_tier"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    # the tier that served it, when the request sent service_tier (as OpenAI answers)
    service_tier: str | None = None
    millm: dict[str, Any] | None = None


class ChatDelta(_Body):
    OMIT_IF_NONE = frozenset({"role", "content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Body):
    OMIT_IF_NONE = frozenset({"millm", "service_tier"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # present (null until the last chunk) with include_usage
    service_tier: str | None = None
    millm: dict[str, Any] | None = None


# --- completions -----------------------------------------------------------------------


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class Completion(_Body):
    """A completion, and (OpenAI streams completions this way) each of its chunks."""

    OMIT_IF_NONE = frozenset({"usage", "millm"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    millm: dict[str, Any] | None = None
