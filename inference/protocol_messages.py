"""A chat request's messages and tools as the chat template receives them (OpenAI's
ChatCompletionRequestMessage, ChatCompletionTool, ChatCompletionNamedToolChoice). The
request that carries them is ``inference.protocol.ChatCompletionRequest``."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from inference.protocol_base import _Wire
from inference.structured import NAME_RE


class TextPart(_Wire):
    type: Literal["text"]
    text: str


MAX_TOOLS = 128


def _function_name(value: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError("a function name is 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    return value


class FunctionDefinition(_Wire):
    """OpenAI's FunctionObject: rendered into the chat template; ``parameters`` is also
    the schema the call's arguments are constrained to (``inference.tools``). ``strict``
    is read: calls are always constrained, as ``strict: true`` asks."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _name = field_validator("name")(classmethod(lambda cls, v: _function_name(v)))


class Tool(_Wire):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Wire):
    name: str
    arguments: str


class ToolCallIn(_Wire):
    """An assistant message's earlier call (ChatCompletionMessageToolCall)."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Wire):
    """A message as the chat template receives it: its role, its text, an assistant's
    ``tool_calls`` and a tool result's ``tool_call_id`` (``for_template``). Nothing else a
    message carries (``name``, …) reaches the model."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=200)

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs to tool messages")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({type: text, text}) are supported")
            return value
        raise ValueError("content must be a string or a list of text parts")

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.tool_calls:
            # as transformers' chat templates take a call: its arguments as an object
            # (vLLM does the same); arguments that are not a JSON object stay text
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
