"""The ``POST /v1/responses`` request as pydantic models (OpenAI's CreateResponse): its
input items, flat function tools, ``text.format`` and the fields it shares with chat. The
translation into the chat request that answers it is ``inference.responses``; the fields
it cannot honour are refused by ``inference.policy`` (``UNHONOURED``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from gpu_engine.api.protocol import TOP_P
from inference.protocol_base import MAX_TOKENS_LIMIT, _Wire
from inference.protocol_extensions import (
    MAX_ANALYZERS,
    MAX_PROBES,
    AnalyzeRequest,
    CaptureRequest,
    InlineSteering,
    ProbeAsk,
    ReturnSaeActivations,
)
from inference.protocol_messages import MAX_TOOLS
from inference.steering_aliases import AliasRecord
from inference.steering_aliases import rewrite as rewrite_aliases
from inference.structured import NAME_RE

MAX_INPUT_ITEMS = 4096
METADATA_MAX_PAIRS = 16  # OpenAI's limits on ``metadata``
METADATA_KEY_MAX = 64
METADATA_VALUE_MAX = 512

# OpenAI's input item and content types this server cannot take (field_not_honoured), as
# opposed to a type OpenAI does not define either (invalid_parameter)
OPENAI_ITEM_TYPES = frozenset(
    {
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "web_search_call",
        "reasoning",
        "item_reference",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "compaction",
        "tool_search_call",
        "tool_search_output",
    }
)
OPENAI_PART_TYPES = frozenset({"input_image", "input_file", "input_audio", "refusal"})
# the built-in (hosted) tools: refused by name (inference.policy)
BUILTIN_TOOL_TYPES = frozenset(
    {
        "file_search",
        "computer",
        "computer_use",
        "computer_use_preview",
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "mcp",
        "code_interpreter",
        "image_generation",
        "local_shell",
        "shell",
        "custom",
        "apply_patch",
        "namespace",
        "tool_search",
    }
)


# --------------------------------------------------------------------------- input items


class TextContent(_Wire):
    """``input_text`` (any role) or ``output_text`` (an assistant's earlier answer, as
    ``output`` returns it: its ``annotations`` and ``logprobs`` are accepted and unread)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class OtherContent(_Wire):
    type: str


def _part_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type")
        return "<text>" if kind in ("input_text", "output_text") else "<other>" if isinstance(kind, str) else None
    return None


ContentPart = Annotated[
    Annotated[TextContent, Tag("<text>")] | Annotated[OtherContent, Tag("<other>")],
    Discriminator(_part_kind, custom_error_type="invalid_part", custom_error_message="a content part needs a type"),
]


def _parts(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class MessageItem(_Wire):
    """EasyInputMessage / InputMessage / an earlier OutputMessage fed back (its ``id`` and
    ``status`` accepted and unread)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentPart]  # a string is one text part
    id: str | None = Field(default=None, max_length=200)
    status: str | None = None

    _content = field_validator("content", mode="before")(classmethod(lambda cls, v: _parts(v)))

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, TextContent))


class FunctionCallItem(_Wire):
    """An earlier ``function_call`` output item, fed back before its result."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=200)
    name: str
    arguments: str
    id: str | None = Field(default=None, max_length=200)
    status: str | None = None


class FunctionCallOutputItem(_Wire):
    """A function's result: ``output`` a string or text parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=200)
    output: list[ContentPart]  # a string is one text part
    id: str | None = Field(default=None, max_length=200)
    status: str | None = None

    _output = field_validator("output", mode="before")(classmethod(lambda cls, v: _parts(v)))

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.output if isinstance(p, TextContent))


class OtherItem(_Wire):
    type: str


def _item_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind is None and "role" in value:
        return "<message>"  # EasyInputMessage's type is optional
    if kind in ("message", "function_call", "function_call_output"):
        return f"<{kind}>"
    return "<other>" if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("<message>")]
    | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")]
    | Annotated[OtherItem, Tag("<other>")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_item",
        custom_error_message="an input item is an object with a type (message, function_call, "
        "function_call_output) or a role",
    ),
]


# --------------------------------------------------------------------------- tools, text


class FunctionTool(_Wire):
    """Responses' flat function tool ``{type, name, description, parameters, strict}``."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError("a function name is 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
        return value


class BuiltinTool(_Wire):
    """A hosted tool (web_search, file_search, …): refused by ``inference.policy``."""

    type: str


def _tool_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind == "function":
        return "<function>"
    return "<builtin>" if kind in BUILTIN_TOOL_TYPES else None


ResponsesTool = Annotated[
    Annotated[FunctionTool, Tag("<function>")] | Annotated[BuiltinTool, Tag("<builtin>")],
    Discriminator(
        _tool_kind,
        custom_error_type="invalid_tool",
        custom_error_message="unknown tool type: a tool is {type: function, name, parameters, …} "
        "(or one of OpenAI's built-in tools, which are not available)",
    ),
]


class ToolChoiceFunction(_Wire):
    type: Literal["function"]
    name: str


class ToolChoiceOther(_Wire):
    """allowed_tools, a hosted tool, mcp, custom: refused by ``inference.policy``."""

    type: str


def _choice_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "<mode>"
    if isinstance(value, dict):
        return "<function>" if value.get("type") == "function" else "<other>"
    return None


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("<mode>")]
    | Annotated[ToolChoiceFunction, Tag("<function>")]
    | Annotated[ToolChoiceOther, Tag("<other>")],
    Discriminator(
        _choice_kind,
        custom_error_type="invalid_tool_choice",
        custom_error_message='tool_choice is "none", "auto", "required" or {"type": "function", "name"}',
    ),
]


class TextFormat(_Wire):
    """``text.format``: text, json_object, or json_schema ``{name, schema, strict,
    description}`` (Responses' flat form of chat's ``response_format``)."""

    type: str
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _named(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or not NAME_RE.match(self.name)):
            raise ValueError("a json_schema format needs a name of 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
        return self

    def response_format(self) -> dict[str, Any] | None:
        if self.type == "json_schema":
            spec: dict[str, Any] = {"name": self.name}
            for key, value in (("schema", self.schema_), ("strict", self.strict), ("description", self.description)):
                if value is not None:
                    spec[key] = value
            return {"type": "json_schema", "json_schema": spec}
        return {"type": self.type}

    def echo(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "json_schema":
            out.update(name=self.name, schema=self.schema_ if self.schema_ is not None else {}, strict=self.strict)
            if self.description is not None:
                out["description"] = self.description
        return out


class ResponseStreamOptions(_Wire):
    """``stream_options``: OpenAI's default pads every delta event; miLLM pads only when
    asked, as on chat (``inference.streaming.obfuscation``)."""

    include_obfuscation: bool = False


class TextConfig(_Wire):
    format: TextFormat | None = None
    verbosity: str | None = None  # only "medium" (the model's own) is honoured: inference.policy


def _metadata(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("metadata must be an object of string values")
    if len(value) > METADATA_MAX_PAIRS:
        raise ValueError(f"metadata holds at most {METADATA_MAX_PAIRS} pairs")
    for key, item in value.items():
        if len(key) > METADATA_KEY_MAX:
            raise ValueError(f"metadata keys are at most {METADATA_KEY_MAX} characters")
        if not isinstance(item, str) or len(item) > METADATA_VALUE_MAX:
            raise ValueError(f"metadata values are strings of at most {METADATA_VALUE_MAX} characters")
    return value


# --------------------------------------------------------------------------- the request


class ResponsesRequest(_Wire):
    """OpenAI's CreateResponse, the fields this server reads; the output-changing ones it
    cannot honour are refused by ``inference.policy`` (``UNHONOURED``), the rest it does
    not read are named in ``X-miLLM-Ignored-Fields``."""

    model: str = Field(min_length=1, max_length=500)
    # optional, as OpenAI's: after ``previous_response_id`` a request may send none (only,
    # say, new ``instructions``); with nothing to answer it is refused (``inference.responses``)
    input: list[InputItem] = Field(default_factory=list, max_length=MAX_INPUT_ITEMS)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, **TOP_P.bounds())
    text: TextConfig | None = None
    tools: list[ResponsesTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    store: bool = True
    background: bool = False
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=200)
    metadata: dict[str, str] | None = None
    # refused unless neutral (inference.policy): declared so that a neutral value is read
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    # as on chat: the prefix cache's namespace, and the tier (refused above interactive
    # by inference.policy)
    prompt_cache_key: Any = None
    cache_salt: Any = None  # vLLM's name for it (both: equal, inference.policy)
    service_tier: str | None = None
    # sampling extras, checked as the chat request checks them
    seed: Any = None
    stop: Any = None
    top_k: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    # miLLM extensions, as on chat
    profile: str | None = Field(default=None, min_length=1, max_length=200)
    steering: InlineSteering | None = None
    steering_intensity: Any = None
    return_sae_activations: ReturnSaeActivations | None = None
    capture: CaptureRequest | None = None
    analyze: list[AnalyzeRequest] | None = Field(default=None, min_length=1, max_length=MAX_ANALYZERS)
    probes: list[str | ProbeAsk] | None = Field(default=None, max_length=MAX_PROBES)
    chat_template_kwargs: dict[str, Any] | None = None
    # which steering shape of another tool the body used (``inference.steering_aliases``)
    steering_alias: AliasRecord | None = None

    # the steering shapes of other tools (vllm_xargs, EasySteer, …) as on chat
    _aliases = model_validator(mode="before")(classmethod(lambda cls, data: rewrite_aliases(data)))

    _metadata = field_validator("metadata", mode="before")(classmethod(lambda cls, v: _metadata(v)))
    _analyze = field_validator("analyze", mode="before")(classmethod(lambda cls, v: [v] if isinstance(v, dict) else v))

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if isinstance(value, str):  # a text input: one user message
            return [{"type": "message", "role": "user", "content": value}]
        return value

    def unread_fields(self) -> frozenset[str]:
        unread = frozenset() if self.tools else frozenset({"parallel_tool_calls"})
        return unread if self.stream else unread | {"stream_options"}

    @property
    def obfuscate(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_obfuscation)

    @property
    def text_format(self) -> dict[str, Any]:
        """``text`` as the Response echoes it."""
        fmt = self.text.format if self.text is not None else None
        return {"format": fmt.echo() if fmt is not None else {"type": "text"}, "verbosity": "medium"}


# extension and sampling fields handed to the chat request as they are
PASSED = (
    "prompt_cache_key",
    "cache_salt",
    "ignore_eos",
    "service_tier",
    "seed",
    "stop",
    "top_k",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop_token_ids",
    "profile",
    "steering",
    "steering_intensity",
    "return_sae_activations",
    "capture",
    "analyze",
    "probes",
    "chat_template_kwargs",
)
